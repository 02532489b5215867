"""Keeps the GPU busy for SECONDS: the 16k, H16 MSA step and dense SDPA fwd+bwd at the same
shape, alternately, so that a benchmark run right after it meets a GPU warm from minutes of
load (as after the GPU tests).

    python heat.py SECONDS"""
import sys
import time

import torch
import torch.nn.functional as F

from openmsa import msa_attention
from openmsa.bench.run import make_inputs

inputs = make_inputs(dict(heads=16, kv_heads=2, index_heads=4, head_dim=128), 16384, "coherent")
q, k, v, _, _ = inputs
dout = torch.randn_like(q)
one = torch.ones((), device="cuda")
end = time.time() + float(sys.argv[1])
steps = 0
while time.time() < end:
    for _ in range(20):
        out, kl = msa_attention(*inputs, top_k=16, block_size=128)
        torch.autograd.grad((out, kl), inputs, (dout, one))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True,
                                             enable_gqa=True)
        torch.autograd.grad(out, (q, k, v), dout.transpose(1, 2))
    torch.cuda.synchronize()
    steps += 20
print(f"{steps} MSA and dense steps in {sys.argv[1]} s")
