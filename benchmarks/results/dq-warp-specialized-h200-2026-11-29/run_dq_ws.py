"""dQ: the warp-specialized Gluon kernel (two register splits) against the lock-step Gluon
kernel and the Triton kernel, same problems (coherent selections, bench_attention.py's seeds),
interleaved, twice; dq compared bitwise with the Triton kernel's (given deltas), and the deltas
the kernel writes against attention_delta's. Then the whole backward with each Gluon dQ."""
import json
import os

import torch
import triton.testing

from openmsa.bench.flops import kept_triples
from openmsa.bench.run import index_inputs
from openmsa.ops import hopper
from openmsa.ops.attention import (LOG2_E, SparseAttentionProblem, attention_backward,
                                   attention_delta, attention_dq, sparse_attention_fwd)
from openmsa.ops.schedule import batch_cu_seqlens
from openmsa.ops.select import select_blocks_fwd

out_dir = os.environ["OUT"]
VARIANTS = {"lockstep": dict(warp_specialized=False),
            "ws_240_24": dict(warp_specialized=True, registers=(240, 24)),
            "ws_232_40": dict(warp_specialized=True, registers=(232, 40))}
hopper_dq = hopper.attention_dq


def bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=150, return_mode="median")


rows = []
for S, H, Hkv in ((131072, 64, 4), (32768, 64, 4), (16384, 16, 2), (32768, 16, 2)):
    D, Hi = 128, 4
    g = torch.Generator(device="cuda").manual_seed(S + H)
    q, k, v = (torch.randn(S, h, D, device="cuda", generator=g).bfloat16()
               for h in (H, Hkv, Hkv))
    dout = torch.randn_like(q)
    iq, ik = index_inputs("coherent", S, Hi, D, g)
    cu = batch_cu_seqlens(1, S, "cuda")
    ids = select_blocks_fwd(iq, ik, cu, top_k=16, block_size=128, index_softmax_scale=D ** -0.5,
                            num_local_blocks=1, num_sink_blocks=0)
    p = SparseAttentionProblem(q, k, ids, cu, 128, D ** -0.5)
    out, lse, _ = sparse_attention_fwd(q, k, v, None, None, p)
    delta = attention_delta(out, dout, p)
    triton_dq = attention_dq(q, k, v, dout, lse, delta, p, use_hopper=False)
    row = dict(S=S, H=H)
    timings = {"triton": lambda: attention_dq(q, k, v, dout, lse, delta, p, use_hopper=False)}
    scale_log2 = p.scale * LOG2_E
    for name, options in VARIANTS.items():
        dq = hopper_dq(q, k, v, dout, lse, delta, p, scale_log2, **options)
        row[f"{name}_bitwise_equal_triton"] = bool(torch.equal(dq, triton_dq))
        written = torch.full_like(delta, float("nan"))
        dq_fused = hopper_dq(q, k, v, dout, lse, written, p, scale_log2, out=out, **options)
        row[f"{name}_delta_max_abs_error"] = (written - delta).abs().max().item()
        row[f"{name}_fused_dq_rel_rms"] = ((dq_fused.float() - dq.float()).pow(2).mean().sqrt()
                                           / dq.float().pow(2).mean().sqrt()).item()
        timings[name] = (lambda o=options: hopper_dq(q, k, v, dout, lse, delta, p, scale_log2,
                                                     out=out, **o))
    for name, options in VARIANTS.items():
        def backward(o=options):
            hopper.attention_dq = lambda *a, **kw: hopper_dq(*a, **kw, **o)
            try:
                return attention_backward(q, k, v, out, dout, lse, p)
            finally:
                hopper.attention_dq = hopper_dq
        timings[f"backward_{name}"] = backward
    best = {name: float("inf") for name in timings}
    for _ in range(2):
        for name, fn in timings.items():
            best[name] = min(best[name], bench(fn))
    flops = 4.0 * D * kept_triples(ids, 128, H // Hi)
    row.update({f"{name}_ms": ms for name, ms in best.items()})
    row.update({f"{name}_tflops": 2.5 * flops / ms / 1e9
                for name, ms in best.items() if name.startswith("backward")})
    print(json.dumps(row), flush=True)
    rows.append(row)
    with open(os.path.join(out_dir, "dq_ws.json"), "w") as handle:
        json.dump(rows, handle, indent=1)
    del q, k, v, dout, p, out, lse, delta, triton_dq
    torch.cuda.empty_cache()

names = ["triton"] + list(VARIANTS)
print(f"{'S':>7} {'H':>3} " + " ".join(f"{n:>10}" for n in names) + "  dq ms | backward ms (TFLOP/s)")
for r in rows:
    print(f"{r['S']:>7} {r['H']:>3} " + " ".join(f"{r[n + '_ms']:>10.2f}" for n in names)
          + " | " + " ".join(f"{r['backward_' + n + '_ms']:.2f} ({r['backward_' + n + '_tflops']:.0f})"
                             for n in VARIANTS))
    print("   bitwise equal Triton:", [r[f"{n}_bitwise_equal_triton"] for n in VARIANTS],
          "delta err:", [f"{r[n + '_delta_max_abs_error']:.1e}" for n in VARIANTS])
