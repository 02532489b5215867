"""The spread of the 16k, H16 step replayed from a CUDA graph: 400 replays timed one by one by
CUDA events, each after the L2 cache is flushed (as ``median_ms`` times), with dense SDPA
fwd+bwd timed the same way before and after. Prints one JSON line, writes OUT/NAME.json.

    OUT=DIR python run_spread.py NAME"""
import json
import os
import sys

import torch
import torch.nn.functional as F

from openmsa import msa_attention
from openmsa.bench.run import make_inputs
from openmsa.bench.timing import graphed, median_ms

name = sys.argv[1]
S, D = 16384, 128
inputs = make_inputs(dict(heads=16, kv_heads=2, index_heads=4, head_dim=D), S, "coherent")
q, k, v, iq, ik = inputs
dout = torch.randn_like(q)
one = torch.ones((), device="cuda")


def step():
    out, kl = msa_attention(*inputs, top_k=16, block_size=128)
    torch.autograd.grad((out, kl), inputs, (dout, one))


def dense():
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                         v.transpose(1, 2), is_causal=True, enable_gqa=True)
    torch.autograd.grad(out, (q, k, v), dout.transpose(1, 2))


flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")


def spread(fn, calls):
    """Percentiles 10, 25, 50, 75, 90 of ``calls`` timed calls (ms)."""
    times = []
    for _ in range(calls):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return [round(times[int(calls * f)], 3) for f in (0.1, 0.25, 0.5, 0.75, 0.9)]


replay = graphed(step)
for _ in range(20):
    replay()
result = dict(name=name, dense_percentiles_ms=spread(dense, 100),
              step_graph_percentiles_ms=spread(replay, 400),
              step_graph_median_ms=median_ms(replay))
result["dense_again_percentiles_ms"] = spread(dense, 100)
with open(os.path.join(os.environ["OUT"], f"{name}.json"), "w") as f:
    json.dump(result, f, indent=1)
print(json.dumps(result))
