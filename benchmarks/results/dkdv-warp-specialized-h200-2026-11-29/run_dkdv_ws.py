"""dK/dV: the warp-specialized Gluon kernel (register splits, ring depths) against the
lock-step Gluon kernel (the ``warp_specialized=False`` option of commit a5fd3f8) and the Triton
kernel, same problems (coherent selections), interleaved. dk and dv (reduced) are compared
with the Triton kernel's; each variant is also run twice and compared bitwise."""
import json
import os

import torch
import triton.testing

from openmsa.bench.run import index_inputs
from openmsa.ops import hopper
from openmsa.ops.attention import (LOG2_E, SparseAttentionProblem, _reduce_segments,
                                   attention_delta, attention_dkdv, sparse_attention_fwd)
from openmsa.ops.schedule import batch_cu_seqlens
from openmsa.ops.select import select_blocks_fwd
from openmsa.testing import rel_rms_error

out_dir = os.environ["OUT"]
VARIANTS = {  # name: attention_dkdv_parts options
    "lockstep": dict(warp_specialized=False),
    "ws_232_32_s4": dict(registers=(232, 32), stages=4),
    "ws_240_24_s4": dict(registers=(240, 24), stages=4),
    "ws_232_32_s6": dict(registers=(232, 32), stages=6),
}
rows = []
for S, H, Hkv in ((131072, 64, 4), (32768, 64, 4), (16384, 16, 2), (32768, 16, 2)):
    D, Hi = 128, 4
    g = torch.Generator(device="cuda").manual_seed(S)
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
    triton_dk, triton_dv = attention_dkdv(q, k, v, dout, lse, delta, p, use_hopper=False)
    group = p.shared["KV_GROUP"]
    row = dict(S=S, H=H)

    def reduced(**options):
        dk_part, dv_part = hopper.attention_dkdv_parts(q, k, v, dout, lse, delta, p,
                                                       p.scale * LOG2_E, **options)
        return (_reduce_segments(dk_part, torch.empty_like(k), p.scale, group, p),
                _reduce_segments(dv_part, torch.empty_like(v), 1.0, group, p))

    for name, options in VARIANTS.items():
        dk, dv = reduced(**options)
        again = reduced(**options)
        row[f"{name}_dk_rel_rms"] = rel_rms_error(dk, triton_dk)
        row[f"{name}_dv_rel_rms"] = rel_rms_error(dv, triton_dv)
        row[f"{name}_bitwise_repeat"] = bool(torch.equal(dk, again[0])
                                             and torch.equal(dv, again[1]))
    timings = {"triton": lambda: attention_dkdv(q, k, v, dout, lse, delta, p, use_hopper=False)}
    for name, options in VARIANTS.items():
        timings[name] = (lambda o=options: hopper.attention_dkdv_parts(
            q, k, v, dout, lse, delta, p, p.scale * LOG2_E, **o))
    best = {name: float("inf") for name in timings}
    for _ in range(2):
        for name, fn in timings.items():
            best[name] = min(best[name], triton.testing.do_bench(
                fn, warmup=25, rep=150, return_mode="median"))
    row.update({f"{name}_ms": ms for name, ms in best.items()})
    print(json.dumps(row), flush=True)
    rows.append(row)
    with open(os.path.join(out_dir, "dkdv_ws.json"), "w") as handle:
        json.dump(rows, handle, indent=1)
    del q, k, v, dout, p, out, lse, delta, triton_dk, triton_dv
    torch.cuda.empty_cache()

print(f"{'S':>7} {'H':>3} " + " ".join(f"{n:>13}" for n in ["triton"] + list(VARIANTS)))
for r in rows:
    print(f"{r['S']:>7} {r['H']:>3} " + " ".join(
        f"{r[n + '_ms']:>13.2f}" for n in ["triton"] + list(VARIANTS)))
