"""Experiment: Gluon forward vs the shipped Triton forward: equality and interleaved timings."""
import sys, os, json
sys.path.insert(0, os.path.dirname(__file__))
import torch, triton, triton.testing
from openmsa.bench.run import index_inputs
from openmsa.ops.attention import SparseAttentionProblem, sparse_attention_fwd, LOG2_E
from openmsa.ops.schedule import batch_cu_seqlens
from openmsa.ops.select import select_blocks_fwd
import gluon_fwd

CASES = [  # name, seqlens, H, Hkv, Hi, timed
    ("packed-partial", (1000, 2037, 130), 16, 2, 4, False),
    ("16k-H16", (16384,), 16, 2, 4, True),
    ("32k-H64", (32768,), 64, 4, 4, True),
    ("128k-H64", (131072,), 64, 4, 4, True),
]
rows = []
for name, seqlens, H, Hkv, Hi, timed in CASES:
    D, block, top_k = 128, 128, 16
    S = sum(seqlens)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(S, h, D, device="cuda", generator=g).bfloat16() for h in (H, Hkv, Hkv))
    index_q, index_k = index_inputs("coherent", S, Hi, D, g)
    cu = torch.tensor([0] + list(torch.tensor(seqlens).cumsum(0)), dtype=torch.int32, device="cuda")
    ids = select_blocks_fwd(index_q, index_k, cu, top_k=top_k, block_size=block,
                            index_softmax_scale=D ** -0.5, num_local_blocks=1, num_sink_blocks=0)
    scale = D ** -0.5
    p = SparseAttentionProblem(q, k, ids, cu, block, scale)
    out_t, lse_t, _ = sparse_attention_fwd(q, k, v, None, None, p)
    try:
        out_g, lse_g = gluon_fwd.gluon_fwd(q, k, v, p, scale * LOG2_E)
        torch.cuda.synchronize()
    except Exception as e:
        print(name, "FAILED", repr(e)[:2000], flush=True)
        raise
    row = dict(case=name, S=S, H=H,
               out_max_abs=(out_g.float() - out_t.float()).abs().max().item(),
               out_mismatch=(out_g != out_t).float().mean().item(),
               lse_max_abs=(lse_g - lse_t).abs().max().item(),
               nan=bool(torch.isnan(out_g).any().item()))
    if timed:
        tt, tg = [], []
        for _ in range(3):
            tt.append(triton.testing.do_bench(lambda: sparse_attention_fwd(q, k, v, None, None, p), warmup=25, rep=200, return_mode="median"))
            tg.append(triton.testing.do_bench(lambda: gluon_fwd.gluon_fwd(q, k, v, p, scale * LOG2_E), warmup=25, rep=200, return_mode="median"))
        row.update(triton_ms=min(tt), gluon_ms=min(tg), speedup=min(tt) / min(tg))
    print(json.dumps(row), flush=True)
    rows.append(row)
out = os.environ.get("OUT")
if out:
    json.dump(rows, open(os.path.join(out, "gluon_fwd.json"), "w"), indent=1)
