"""The 16k H16 training step and its KL kernel, for a before/after comparison of KL kernel
changes: run once per code version (PYTHONPATH picks the package), each run with dense SDPA
fwd+bwd in the same process. Prints one JSON line and writes OUT/NAME.json.

    OUT=DIR python run_kl_step.py NAME

Times: the step (msa_attention fwd+bwd, eager and replayed from a CUDA graph, with and without
the KL value); the KL kernel alone (one pass, with the value), for each setting of any
``hopper.KL_*`` switch listed in KL_SWITCHES; dense. Checks: the Gluon KL against the Triton KL
(value, d index_q, d index_k) at this shape. Also every kernel of the graphed step and its
length."""
import json
import os
import sys

import torch
import torch.nn.functional as F

import openmsa
from openmsa import msa_attention
from openmsa.bench.run import index_inputs
from openmsa.bench.timing import median_ms
from openmsa.ops import hopper
from openmsa.ops.attention import (SparseAttentionProblem, kl_key_walk, sparse_attention_fwd)
from openmsa.ops.schedule import batch_cu_seqlens
from openmsa.ops.select import select_blocks_fwd

name = sys.argv[1]
out_dir = os.environ["OUT"]
S, H, Hkv, Hi, D = 16384, 16, 2, 4, 128
KL_SWITCHES = [switch for switch in ("KL_OVERLAP",) if hasattr(hopper, switch)]
g = torch.Generator(device="cuda").manual_seed(S)
q, k, v = (torch.randn(1, S, h, D, device="cuda", generator=g).bfloat16().requires_grad_()
           for h in (H, Hkv, Hkv))
dout = torch.randn_like(q)
iq, ik = index_inputs("coherent", S, Hi, D, g)
iq, ik = iq[None].requires_grad_(), ik[None].requires_grad_()
inputs = (q, k, v, iq, ik)
one = torch.ones((), device="cuda")


def step(kl_value=True):
    out, kl = msa_attention(*inputs, top_k=16, block_size=128, kl_value=kl_value)
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


result = dict(name=name, package=os.path.dirname(openmsa.__file__))
result["dense_ms"] = median_ms(dense)
result["step_ms"] = median_ms(step)
result["step_no_value_ms"] = median_ms(lambda: step(False))
replay = graphed(step)
result["step_graph_ms"] = median_ms(replay)
result["dense_again_ms"] = median_ms(dense)

# The KL kernel alone, from the step's own selection and log-sum-exps.
qp, kp, vp, iqp, ikp = (t.detach()[0] for t in inputs)
cu = batch_cu_seqlens(1, S, "cuda")
ids, index_max = select_blocks_fwd(iqp, ikp, cu, top_k=16, block_size=128,
                                   index_softmax_scale=D ** -0.5, num_local_blocks=1,
                                   num_sink_blocks=0, return_max=True)
p = SparseAttentionProblem(qp, kp, ids, cu, 128, D ** -0.5, ikp, D ** -0.5)
_, lse, lse_index = sparse_attention_fwd(qp, kp, vp, iqp, ikp, p, index_max)
args = (qp, kp, iqp, ikp, lse, lse_index, p)
settings = [{}] + [{switch: not getattr(hopper, switch)} for switch in KL_SWITCHES]
result["kl_kernel_ms"] = {}
for setting in settings:
    saved = {switch: getattr(hopper, switch) for switch in setting}
    for switch, value in setting.items():
        setattr(hopper, switch, value)
    label = ",".join(f"{s}={v}" for s, v in setting.items()) or "default"
    result["kl_kernel_ms"][label] = median_ms(lambda: kl_key_walk(*args, True, True))
    d_index_k, parts, d_index_q = kl_key_walk(*args, True, True)
    t_k, t_parts, t_q = kl_key_walk(*args, True, True, use_hopper=False)

    def rel(a, b):
        return ((a - b).float().pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt()).item()
    result.setdefault("gluon_vs_triton", {})[label] = dict(
        kl=(p.kl_mean(parts).item(), p.kl_mean(t_parts).item()),
        d_index_k=rel(d_index_k, t_k), d_index_q=rel(d_index_q, t_q))
    for switch, value in saved.items():
        setattr(hopper, switch, value)

# The graphed step's kernels.
for _ in range(3):
    replay()
torch.cuda.synchronize()
trace = os.path.join(out_dir, f"{name}-trace.json")
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    replay()
    torch.cuda.synchronize()
prof.export_chrome_trace(trace)
events = sorted((e for e in json.load(open(trace))["traceEvents"]
                 if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                key=lambda e: e["ts"])
os.remove(trace)
result["kernels"] = [(e["name"][:60], round(e["dur"], 1)) for e in events]
result["kernel_sum_ms"] = sum(e["dur"] for e in events) / 1000
with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
    json.dump(result, f, indent=1)
print(json.dumps({key: value for key, value in result.items() if key != "kernels"}))
for kernel, us in result["kernels"]:
    if us >= 40:
        print(f"  {us:8.1f} us  {kernel}")
