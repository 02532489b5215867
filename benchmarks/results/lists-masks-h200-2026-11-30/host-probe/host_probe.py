"""Is the eager 16k H16 step bound by the host? Times the step eagerly three times in a row
(``median_ms``, as bench_msa.py's step column), then the host's own time per step: the seconds
the Python call takes to return (launches queued, no synchronization), over 50 steps after the
queue has been drained. Prints one JSON line.

    python benchmarks/results/lists-masks-h200-2026-11-30/host-probe/host_probe.py"""
import json
import time

import torch

from openmsa import msa_attention
from openmsa.bench.run import make_inputs
from openmsa.bench.timing import median_ms

S, D = 16384, 128
inputs = make_inputs(dict(heads=16, kv_heads=2, index_heads=4, head_dim=D), S, "coherent")
q, k, v, iq, ik = inputs
dout = torch.randn_like(q)
one = torch.ones((), device="cuda")


def step():
    out, kl = msa_attention(*inputs, top_k=16, block_size=128)
    torch.autograd.grad((out, kl), inputs, (dout, one))


result = dict(eager_ms=[median_ms(step) for _ in range(3)])
host = []
for _ in range(50):
    torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    host.append((time.perf_counter() - start) * 1000)
host.sort()
result["host_ms_median"] = host[len(host) // 2]
result["host_ms_min_max"] = (host[0], host[-1])
print(json.dumps(result))
