"""The main backward at 128k, H64 (coherent selection): the whole of attention_backward against
its parts timed alone (delta, dQ, dK/dV with its reduction), and the dK/dV kernel with rings
of 3, 4 and 5 steps. All with triton.testing.do_bench (median), interleaved, twice. The
inputs' seed is $SEED (default 131072; bench_attention.py's for this shape is 131136, where
the coherent index inputs are drawn after the random case's: another selection)."""
import json
import os

import torch
import triton.testing

from openmsa.bench.flops import kept_triples
from openmsa.bench.run import index_inputs
from openmsa.ops import hopper
from openmsa.ops.attention import (LOG2_E, SparseAttentionProblem, attention_backward,
                                   attention_delta, attention_dkdv, attention_dq,
                                   sparse_attention_fwd)
from openmsa.ops.schedule import batch_cu_seqlens
from openmsa.ops.select import select_blocks_fwd

out_dir = os.environ["OUT"]
S, H, Hkv, D, Hi = 131072, 64, 4, 128, 4
seed = int(os.environ.get("SEED", S))
g = torch.Generator(device="cuda").manual_seed(seed)
q, k, v = (torch.randn(S, h, D, device="cuda", generator=g).bfloat16() for h in (H, Hkv, Hkv))
dout = torch.randn_like(q)
iq, ik = index_inputs("coherent", S, Hi, D, g)
cu = batch_cu_seqlens(1, S, "cuda")
ids = select_blocks_fwd(iq, ik, cu, top_k=16, block_size=128, index_softmax_scale=D ** -0.5,
                        num_local_blocks=1, num_sink_blocks=0)
p = SparseAttentionProblem(q, k, ids, cu, 128, D ** -0.5)
out, lse, _ = sparse_attention_fwd(q, k, v, None, None, p)
delta = attention_delta(out, dout, p)
timings = {
    "backward": lambda: attention_backward(q, k, v, out, dout, lse, p),
    "delta": lambda: attention_delta(out, dout, p),
    "dq": lambda: attention_dq(q, k, v, dout, lse, delta, p),
    "dkdv": lambda: attention_dkdv(q, k, v, dout, lse, delta, p),
}
for stages in (3, 4, 5):
    timings[f"dkdv_parts_stages{stages}"] = (
        lambda s=stages: hopper.attention_dkdv_parts(q, k, v, dout, lse, delta, p,
                                                     p.scale * LOG2_E, stages=s))
best = {name: float("inf") for name in timings}
for _ in range(2):
    for name, fn in timings.items():
        best[name] = min(best[name], triton.testing.do_bench(fn, warmup=10, rep=300,
                                                             return_mode="median"))
best["sum_of_parts"] = best["delta"] + best["dq"] + best["dkdv"]
best["seed"] = seed
best["backward_tflops"] = 2.5 * 4.0 * D * kept_triples(ids, 128, H // Hi) / best["backward"] / 1e9
print(json.dumps(best), flush=True)
with open(os.path.join(out_dir, "backward_parts.json"), "w") as handle:
    json.dump(best, handle, indent=1)
units = dict(seed="", backward_tflops="TFLOP/s")
for name, value in best.items():
    print(f"{name:>22} {value:8.2f} {units.get(name, 'ms')}")
