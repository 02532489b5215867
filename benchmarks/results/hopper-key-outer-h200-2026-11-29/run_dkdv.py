"""dK/dV: the Gluon kernel (rings of 3, 4, 5 steps) against the Triton kernel, same problems
(coherent selections), interleaved. Partials are compared with the Triton kernel's."""
import json
import os

import torch
import triton.testing

from openmsa.bench.run import index_inputs
from openmsa.ops import hopper
from openmsa.ops.attention import (LOG2_E, SparseAttentionProblem, attention_delta,
                                   attention_dkdv, sparse_attention_fwd)
from openmsa.ops.schedule import batch_cu_seqlens
from openmsa.ops.select import select_blocks_fwd
from openmsa.testing import rel_rms_error

out_dir = os.environ["OUT"]
rows = []
for S, H, Hkv in ((131072, 64, 4), (32768, 64, 4), (16384, 16, 2)):
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
    dk, dv = attention_dkdv(q, k, v, dout, lse, delta, p, use_hopper=True)
    row = dict(S=S, H=H, dk_rel_rms=rel_rms_error(dk, triton_dk),
               dv_rel_rms=rel_rms_error(dv, triton_dv))
    timings = {"triton": lambda: attention_dkdv(q, k, v, dout, lse, delta, p, use_hopper=False),
               "hopper": lambda: attention_dkdv(q, k, v, dout, lse, delta, p, use_hopper=True)}
    for stages in (3, 4, 5):
        timings[f"parts_stages{stages}"] = (
            lambda s=stages: hopper.attention_dkdv_parts(q, k, v, dout, lse, delta, p,
                                                         p.scale * LOG2_E, stages=s))
    best = {name: float("inf") for name in timings}
    for _ in range(2):
        for name, fn in timings.items():
            best[name] = min(best[name], triton.testing.do_bench(
                fn, warmup=25, rep=150, return_mode="median"))
    row.update({f"{name}_ms": ms for name, ms in best.items()})
    row["speedup"] = best["triton"] / best["hopper"]
    print(json.dumps(row), flush=True)
    rows.append(row)
    with open(os.path.join(out_dir, "dkdv.json"), "w") as handle:
        json.dump(rows, handle, indent=1)
    del q, k, v, dout, p, out, lse, delta, dk, dv, triton_dk, triton_dv
    torch.cuda.empty_cache()
