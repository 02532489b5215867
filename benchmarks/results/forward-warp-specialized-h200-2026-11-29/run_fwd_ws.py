"""The main forward: the warp-specialized Gluon kernel (two register splits) against the
previous Gluon kernel and the Triton kernel, same problems (coherent selections), interleaved;
out and lse compared bitwise with the Triton kernel's."""
import json
import os

import torch
import triton.testing

from openmsa.bench.flops import kept_triples
from openmsa.bench.run import index_inputs
from openmsa.ops import hopper
from openmsa.ops.attention import LOG2_E, SparseAttentionProblem, sparse_attention_fwd
from openmsa.ops.schedule import batch_cu_seqlens
from openmsa.ops.select import select_blocks_fwd

out_dir = os.environ["OUT"]
VARIANTS = {"previous": dict(warp_specialized=False),
            "ws_232_40": dict(warp_specialized=True, registers=(232, 40)),
            "ws_240_24": dict(warp_specialized=True, registers=(240, 24))}
rows = []
for S, H, Hkv in ((131072, 64, 4), (32768, 64, 4), (16384, 16, 2)):
    D, Hi = 128, 4
    g = torch.Generator(device="cuda").manual_seed(S + H)  # bench_attention.py's seed
    q, k, v = (torch.randn(S, h, D, device="cuda", generator=g).bfloat16()
               for h in (H, Hkv, Hkv))
    iq, ik = index_inputs("coherent", S, Hi, D, g)
    cu = batch_cu_seqlens(1, S, "cuda")
    ids = select_blocks_fwd(iq, ik, cu, top_k=16, block_size=128, index_softmax_scale=D ** -0.5,
                            num_local_blocks=1, num_sink_blocks=0)
    p = SparseAttentionProblem(q, k, ids, cu, 128, D ** -0.5)
    triton_out, triton_lse, _ = sparse_attention_fwd(q, k, v, None, None, p, use_hopper=False)
    row = dict(S=S, H=H)
    timings = {"triton": lambda: sparse_attention_fwd(q, k, v, None, None, p, use_hopper=False)}
    for name, options in VARIANTS.items():
        out, lse = hopper.sparse_attention_fwd(q, k, v, p, p.scale * LOG2_E, **options)
        row[f"{name}_bitwise_equal_triton"] = bool(torch.equal(out, triton_out)
                                                   and torch.equal(lse, triton_lse))
        timings[name] = (lambda o=options: hopper.sparse_attention_fwd(
            q, k, v, p, p.scale * LOG2_E, **o))
    best = {name: float("inf") for name in timings}
    for _ in range(2):
        for name, fn in timings.items():
            best[name] = min(best[name], triton.testing.do_bench(fn, warmup=10, rep=100,
                                                                 return_mode="median"))
    flops = 4.0 * D * kept_triples(ids, 128, H // Hi)
    row.update({f"{name}_ms": ms for name, ms in best.items()})
    row.update({f"{name}_tflops": flops / ms / 1e9 for name, ms in best.items()})
    print(json.dumps(row), flush=True)
    rows.append(row)
    with open(os.path.join(out_dir, "fwd_ws.json"), "w") as handle:
        json.dump(rows, handle, indent=1)
    del q, k, v, p, triton_out, triton_lse
    torch.cuda.empty_cache()

names = ["triton"] + list(VARIANTS)
print(f"{'S':>7} {'H':>3} " + " ".join(f"{n:>10}" for n in names) + "  (ms; TFLOP/s)")
for r in rows:
    print(f"{r['S']:>7} {r['H']:>3} " + " ".join(f"{r[n + '_ms']:>10.2f}" for n in names)
          + "  " + " ".join(f"{r[n + '_tflops']:.0f}" for n in names))
