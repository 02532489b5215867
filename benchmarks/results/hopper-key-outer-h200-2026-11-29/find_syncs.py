"""Which operations of the 16k, H16 training step synchronize the host with the GPU: the step
under torch.cuda.set_sync_debug_mode("warn"), with the Python stack of every warning."""
import os
import traceback
import warnings

import torch

from openmsa import msa_attention
from openmsa.bench.run import index_inputs

S, H, Hkv, Hi, D = 16384, 16, 2, 4, 128
g = torch.Generator(device="cuda").manual_seed(S)
q, k, v = (torch.randn(1, S, h, D, device="cuda", generator=g).bfloat16().requires_grad_()
           for h in (H, Hkv, Hkv))
dout = torch.randn_like(q)
index_q, index_k = index_inputs("coherent", S, Hi, D, g)
index_q, index_k = index_q[None].requires_grad_(), index_k[None].requires_grad_()
inputs = (q, k, v, index_q, index_k)
one = torch.ones((), device="cuda")


def step():
    out, kl = msa_attention(*inputs, top_k=16, block_size=128)
    torch.autograd.grad((out, kl), inputs, (dout, one))


step()  # compiles
torch.cuda.synchronize()
found = []


def record(message, category, filename, lineno, file=None, line=None):
    found.append(f"{message}\n" + "".join(traceback.format_stack(limit=14)[:-1]))


warnings.showwarning = record
warnings.simplefilter("always")
torch.cuda.set_sync_debug_mode("warn")
step()
torch.cuda.set_sync_debug_mode("default")
torch.cuda.synchronize()
text = f"{len(found)} synchronizing operations in one step\n\n" + "\n\n".join(found)
with open(os.path.join(os.environ["OUT"], "syncs.txt"), "w") as handle:
    handle.write(text)
print(text[:9000])
