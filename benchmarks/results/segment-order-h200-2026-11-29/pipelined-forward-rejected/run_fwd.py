"""Experiment: pipelined forward vs the shipped forward, same problems, interleaved timings."""
import sys, os, json, time
sys.path.insert(0, os.path.dirname(__file__))
import torch, triton, triton.testing
from openmsa.bench.run import index_inputs
from openmsa.ops.attention import (SparseAttentionProblem, sparse_attention_fwd, _launch, _strides,
                                   LOG2_E, FWD_CONFIG)
from openmsa.ops.schedule import batch_cu_seqlens
from openmsa.ops.select import select_blocks_fwd
import fwd_pipe

dev = "cuda" if torch.cuda.is_available() else "cpu"
if dev == "cpu":
    SHAPES = [(300, 8, 2, 2, 32, 32, 4), (513, 4, 1, 2, 16, 16, 3)]  # S, H, Hkv, Hi, D, block, topk
    dtype = torch.float32
else:
    SHAPES = [(16384, 16, 2, 4, 128, 128, 16), (32768, 64, 4, 4, 128, 128, 16),
              (131072, 64, 4, 4, 128, 128, 16)]
    dtype = torch.bfloat16


def pipe_fwd(q, k, v, index_q, index_k, p, index_max, num_stages):
    out = torch.empty_like(q)
    lse = torch.empty(p.total, p.num_heads, dtype=torch.float32, device=q.device)
    lse_index = (torch.empty(p.total, p.num_index_heads, dtype=torch.float32, device=q.device)
                 if p.with_index else lse)
    iq, ik = (index_q, index_k) if p.with_index else (q, k)
    given = p.with_index
    _launch(fwd_pipe.fwd_pipe_kernel, p.query_grid(),
        q, k, v, iq, ik, out, lse, lse_index, index_max if given else lse,
        *p.query_work_args(), *_strides(q, k, v, out, iq, ik), p.scale * LOG2_E, p.index_scale,
        **p.query_constants(), WITH_INDEX=p.with_index, INDEX_MAX_GIVEN=given,
        num_warps=8, num_stages=num_stages)
    return out, lse, (lse_index if p.with_index else None)


rows = []
for S, H, Hkv, Hi, D, block, top_k in SHAPES:
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(S, h, D, device=dev, generator=g).to(dtype) for h in (H, Hkv, Hkv))
    index_q, index_k = index_inputs("coherent", S, Hi, D, g, device=dev)
    index_q, index_k = index_q.to(dtype), index_k.to(dtype)
    cu = batch_cu_seqlens(1, S, dev)
    ids, imax = select_blocks_fwd(index_q, index_k, cu, top_k=top_k, block_size=block,
                                  index_softmax_scale=D ** -0.5, num_local_blocks=1,
                                  num_sink_blocks=0, return_max=True)
    scale = D ** -0.5
    for with_index in (False, True):
        p = (SparseAttentionProblem(q, k, ids, cu, block, scale, index_k=index_k, index_scale=D ** -0.5)
             if with_index else SparseAttentionProblem(q, k, ids, cu, block, scale))
        iq, ik_ = (index_q, index_k) if with_index else (None, None)
        mx = imax if with_index else None
        base = sparse_attention_fwd(q, k, v, iq, ik_, p, index_max=mx)
        for stages in ((1, 2) if dev == "cuda" else (1,)):
            pipe = pipe_fwd(q, k, v, index_q, index_k, p, imax, stages)
            err = [(a.float() - b.float()).abs().max().item() for a, b in zip(base, pipe) if a is not None]
            row = dict(S=S, H=H, with_index=with_index, stages=stages, max_abs_diff=err)
            if dev == "cuda":
                fb = lambda: sparse_attention_fwd(q, k, v, iq, ik_, p, index_max=mx)
                fp = lambda: pipe_fwd(q, k, v, index_q, index_k, p, imax, stages)
                tb, tp = [], []
                for _ in range(3):
                    tb.append(triton.testing.do_bench(fb, warmup=25, rep=200, return_mode="median"))
                    tp.append(triton.testing.do_bench(fp, warmup=25, rep=200, return_mode="median"))
                row.update(base_ms=min(tb), pipe_ms=min(tp), ratio=min(tb) / min(tp))
            print(json.dumps(row), flush=True)
            rows.append(row)
out = os.environ.get("OUT")
if out:
    json.dump(rows, open(os.path.join(out, "fwd_pipe.json"), "w"), indent=1)
