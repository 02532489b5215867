"""Forward with the index branch at 128k, H64: fused Triton kernel vs Hopper main + Triton index
part alone (8 or 4 warps), interleaved."""
import json, os, sys
import torch, triton, triton.testing
from openmsa.bench.run import index_inputs
from openmsa.ops.attention import SparseAttentionProblem, sparse_attention_fwd
from openmsa.ops.schedule import batch_cu_seqlens
from openmsa.ops.select import select_blocks_fwd
rows = []
for S, H, Hkv in ((131072, 64, 4), (16384, 16, 2)):
    D, Hi = 128, 4
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(S, h, D, device="cuda", generator=g).bfloat16() for h in (H, Hkv, Hkv))
    iq, ik = index_inputs("coherent", S, Hi, D, g)
    cu = batch_cu_seqlens(1, S, "cuda")
    ids, mx = select_blocks_fwd(iq, ik, cu, top_k=16, block_size=128, index_softmax_scale=D ** -0.5,
                                num_local_blocks=1, num_sink_blocks=0, return_max=True)
    p = SparseAttentionProblem(q, k, ids, cu, 128, D ** -0.5, ik, D ** -0.5)
    variants = {"fused_triton": dict(use_hopper=False), "hopper+index_w8": dict(num_warps=8),
                "hopper+index_w4": dict(num_warps=4)}
    times = {n: [] for n in variants}
    for _ in range(3):
        for n, kw in variants.items():
            times[n].append(triton.testing.do_bench(lambda: sparse_attention_fwd(q, k, v, iq, ik, p, index_max=mx, **kw), warmup=25, rep=200, return_mode="median"))
    row = dict(S=S, H=H, **{n: min(t) for n, t in times.items()})
    print(json.dumps(row), flush=True)
    rows.append(row)
json.dump(rows, open(os.path.join(sys.argv[1], "fwd_index.json"), "w"), indent=1)
