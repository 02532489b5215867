"""The Gluon KL kernel's ring of q units (``hopper.KL_STAGES``) at the 16k H16 step: for each
depth, the KL kernel alone, the step replayed from a CUDA graph, and the Gluon KL against the
Triton KL (value, d index_q, d index_k); dense SDPA fwd+bwd before and after, same process.
Prints one JSON line and writes OUT/kl_stages.json.

    OUT=DIR python benchmarks/results/lists-masks-h200-2026-11-30/kl-stages-rejected/run_kl_stages.py [STAGES ...]   (default: 4 6 5, each twice, interleaved)"""
import json
import os
import sys

import torch
import torch.nn.functional as F

from openmsa import msa_attention
from openmsa.bench.run import make_inputs
from openmsa.bench.timing import graphed, median_ms
from openmsa.ops import hopper
from openmsa.ops.attention import SparseAttentionProblem, kl_key_walk, sparse_attention_fwd
from openmsa.ops.schedule import batch_cu_seqlens
from openmsa.ops.select import select_blocks_fwd

depths = [int(a) for a in sys.argv[1:]] or [4, 6, 5, 4, 6, 5]
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


def rel(a, b):
    return ((a - b).float().pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt()).item()


qp, kp, vp, iqp, ikp = (t.detach()[0] for t in inputs)
cu = batch_cu_seqlens(1, S, "cuda")
ids, index_max = select_blocks_fwd(iqp, ikp, cu, top_k=16, block_size=128,
                                   index_softmax_scale=D ** -0.5, num_local_blocks=1,
                                   num_sink_blocks=0, return_max=True)
p = SparseAttentionProblem(qp, kp, ids, cu, 128, D ** -0.5, ikp, D ** -0.5)
_, lse, lse_index = sparse_attention_fwd(qp, kp, vp, iqp, ikp, p, index_max)
args = (qp, kp, iqp, ikp, lse, lse_index, p)
t_k, t_parts, t_q = kl_key_walk(*args, True, True, use_hopper=False)

result = dict(dense_ms=median_ms(dense), runs=[])
for depth in depths:
    hopper.KL_STAGES = depth
    d_index_k, parts, d_index_q = kl_key_walk(*args, True, True)
    result["runs"].append(dict(
        stages=depth, kl_kernel_ms=median_ms(lambda: kl_key_walk(*args, True, True)),
        step_graph_ms=median_ms(graphed(step)),
        kl=(p.kl_mean(parts).item(), p.kl_mean(t_parts).item()),
        d_index_k=rel(d_index_k, t_k), d_index_q=rel(d_index_q, t_q)))
result["dense_again_ms"] = median_ms(dense)
with open(os.path.join(os.environ["OUT"], "kl_stages.json"), "w") as f:
    json.dump(result, f, indent=1)
print(json.dumps(result))
