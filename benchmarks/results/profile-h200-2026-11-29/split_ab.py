"""A/B: the forward with the tile split into two interleaved 64-row halves."""
import json, sys
import torch, triton.testing
sys.path.insert(0, "ab_old")
from fwd_split import _fwd_split_kernel
from openmsa.bench.run import index_inputs
from openmsa.ops.attention import (LOG2_E, SparseAttentionProblem, _strides,
                                   sparse_attention_fwd)
from openmsa.ops.schedule import batch_cu_seqlens
from openmsa.ops.select import select_blocks_fwd

def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=300, return_mode="median")

for seqlen, H, Hkv in ((32768, 64, 4), (131072, 64, 4), (16384, 16, 2)):
    Hi, D = 4, 128
    g = torch.Generator(device="cuda").manual_seed(seqlen)
    q = torch.randn(seqlen, H, D, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(seqlen, Hkv, D, device="cuda", generator=g).bfloat16() for _ in range(2))
    cu = batch_cu_seqlens(1, seqlen, "cuda")
    iq, ik = index_inputs("coherent", seqlen, Hi, D, g)
    ids = select_blocks_fwd(iq, ik, cu, top_k=16, block_size=128, index_softmax_scale=D ** -0.5,
                            num_local_blocks=1, num_sink_blocks=0)
    p = SparseAttentionProblem(q, k, ids, cu, 128, D ** -0.5)
    out, lse, _ = sparse_attention_fwd(q, k, v, None, None, p)
    row = dict(seqlen=seqlen, heads=H, shipped_ms=bench(lambda: sparse_attention_fwd(q, k, v, None, None, p)))
    for stages in (1, 2):
        out2, lse2 = torch.empty_like(q), torch.empty_like(lse)
        def split():
            _fwd_split_kernel[p.query_grid()](
                q, k, v, out2, lse2, *p.query_work_args(), *_strides(q, k, v, out2),
                p.scale * LOG2_E, **p.query_constants(), num_warps=8, num_stages=stages)
        split()
        row[f"split_{stages}stage_ms"] = bench(split)
        row[f"split_{stages}stage_max_out_diff"] = (out2.float() - out.float()).abs().max().item()
        row[f"split_{stages}stage_max_lse_diff"] = (lse2 - lse).abs().max().item()
    print(json.dumps(row), flush=True)
    del q, k, v, out, lse, p
    torch.cuda.empty_cache()
