"""dK/dV at 4 heads per index head: steps of 64 rows one after the other against 32 rows
pipelined (``hopper.KEY_STEP_SEQUENTIAL_MAX_HEADS`` 4 against 0; it exists with
``dkdv_rows.patch`` applied), at 16k H16 coherent, in one process with dense SDPA fwd+bwd.
Prints one JSON line and writes OUT/dkdv_rows.json.

    OUT=DIR python run_dkdv_rows.py

Per setting: the Gluon dK/dV alone (with its reduction) in three interleaved rounds; dk, dv
against the Triton kernel's (relative RMS) and against a second run (bitwise); then the
training step, eager and from a CUDA graph, in two interleaved rounds."""
import json
import os

import torch
import torch.nn.functional as F

from openmsa import msa_attention
from openmsa.bench.run import index_inputs
from openmsa.bench.timing import median_ms
from openmsa.ops import hopper
from openmsa.ops.attention import (SparseAttentionProblem, attention_delta, attention_dkdv,
                                   sparse_attention_fwd)
from openmsa.ops.schedule import batch_cu_seqlens
from openmsa.ops.select import select_blocks_fwd

out_dir = os.environ["OUT"]
S, H, Hkv, Hi, D = 16384, 16, 2, 4, 128
SETTINGS = {"64 rows, sequential": 4, "32 rows, pipelined": 0}
g = torch.Generator(device="cuda").manual_seed(S)
q, k, v = (torch.randn(1, S, h, D, device="cuda", generator=g).bfloat16().requires_grad_()
           for h in (H, Hkv, Hkv))
dout = torch.randn_like(q)
iq, ik = index_inputs("coherent", S, Hi, D, g)
iq, ik = iq[None].requires_grad_(), ik[None].requires_grad_()
inputs = (q, k, v, iq, ik)
one = torch.ones((), device="cuda")


def step():
    out, kl = msa_attention(*inputs, top_k=16, block_size=128)
    torch.autograd.grad((out, kl), inputs, (dout, one))


def dense():
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                         v.transpose(1, 2), is_causal=True, enable_gqa=True)
    torch.autograd.grad(out, (q, k, v), dout.transpose(1, 2))


def graphed(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def rel(a, b):
    return ((a - b).float().pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt()).item()


qp, kp, vp, iqp, ikp = (t.detach()[0] for t in inputs)
cu = batch_cu_seqlens(1, S, "cuda")
ids, index_max = select_blocks_fwd(iqp, ikp, cu, top_k=16, block_size=128,
                                   index_softmax_scale=D ** -0.5, num_local_blocks=1,
                                   num_sink_blocks=0, return_max=True)
p = SparseAttentionProblem(qp, kp, ids, cu, 128, D ** -0.5, ikp, D ** -0.5)
o, lse, _ = sparse_attention_fwd(qp, kp, vp, iqp, ikp, p, index_max)
dop = dout[0]
delta = attention_delta(o, dop, p)
args = (qp, kp, vp, dop, lse, delta, p)
triton_dk, triton_dv = attention_dkdv(*args, use_hopper=False)
result = dict(checks={}, dkdv_ms={name: [] for name in SETTINGS},
              step={name: [] for name in SETTINGS}, dense_ms=[])
replays = {}
for name, heads in SETTINGS.items():
    hopper.KEY_STEP_SEQUENTIAL_MAX_HEADS = heads
    dk, dv = attention_dkdv(*args, use_hopper=True)
    dk2, dv2 = attention_dkdv(*args, use_hopper=True)
    result["checks"][name] = dict(dk_vs_triton=rel(dk, triton_dk), dv_vs_triton=rel(dv, triton_dv),
                                  bitwise_repeat=torch.equal(dk, dk2) and torch.equal(dv, dv2))
    replays[name] = graphed(step)
for _ in range(3):
    for name, heads in SETTINGS.items():
        hopper.KEY_STEP_SEQUENTIAL_MAX_HEADS = heads
        result["dkdv_ms"][name].append(median_ms(lambda: attention_dkdv(*args, use_hopper=True)))
for _ in range(2):
    result["dense_ms"].append(median_ms(dense))
    for name, heads in SETTINGS.items():
        hopper.KEY_STEP_SEQUENTIAL_MAX_HEADS = heads
        result["step"][name].append((median_ms(step), median_ms(replays[name])))
with open(os.path.join(out_dir, "dkdv_rows.json"), "w") as f:
    json.dump(result, f, indent=1)
print(json.dumps(result))
for name in SETTINGS:
    print(f"{name:22s} dK/dV {' '.join(f'{t:.3f}' for t in result['dkdv_ms'][name])} ms | step "
          + "  ".join(f"{e:.3f} eager {gr:.3f} graph" for e, gr in result["step"][name]))
print("dense " + " ".join(f"{t:.3f}" for t in result["dense_ms"]))
