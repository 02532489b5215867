"""Where the host's time of an eager 16k, H16 step goes: cProfile over 30 steps (each queued
after the GPU drained, so the host never waits on a full launch queue), the functions with the
most time of their own and the most time inside them. Writes OUT/NAME.txt.

    OUT=DIR python run_host_profile.py NAME"""
import cProfile
import io
import os
import pstats
import sys
import time

import torch

from openmsa import msa_attention
from openmsa.bench.run import make_inputs

name = sys.argv[1]
S, D = 16384, 128
inputs = make_inputs(dict(heads=16, kv_heads=2, index_heads=4, head_dim=D), S, "coherent")
dout = torch.randn_like(inputs[0])
one = torch.ones((), device="cuda")


def step():
    out, kl = msa_attention(*inputs, top_k=16, block_size=128)
    torch.autograd.grad((out, kl), inputs, (dout, one))


for _ in range(5):
    step()
host = []
profile = cProfile.Profile()
for _ in range(30):
    torch.cuda.synchronize()
    start = time.perf_counter()
    profile.enable()
    step()
    profile.disable()
    host.append((time.perf_counter() - start) * 1000)
host.sort()
text = io.StringIO()
text.write(f"host ms per step under cProfile: median {host[15]:.3f}, "
           f"min {host[0]:.3f}, max {host[-1]:.3f}\n")
for key in ("tottime", "cumtime"):
    pstats.Stats(profile, stream=text).sort_stats(key).print_stats(45)
with open(os.path.join(os.environ["OUT"], f"{name}.txt"), "w") as f:
    f.write(text.getvalue())
print(text.getvalue()[:6000])
