"""The 16k H16 training step with its independent kernels on two streams, switch by switch,
against dense SDPA fwd+bwd in the same process. Run once per code version (PYTHONPATH picks
the package: the switches exist with ``streams.patch`` applied; a version without them times
its one step). Prints a table and writes OUT/NAME.json.

    OUT=DIR python run_streams.py NAME

Variants (where the package has the switches): both streams' jobs off
(``library.CONCURRENT_BLOCK_WORK``: the KL's key-block list beside the forward;
``attention.CONCURRENT_INDEX_LSE``: the index log-sum-exp beside the Gluon forward), both on
with the side stream at default priority, and both on at high priority
(``streams.SIDE_PRIORITY``). Each variant's outputs and gradients are checked against the
first variant's (bitwise, but the gradients summed by atomic adds). Times: eager and replayed
from a CUDA graph, in two rounds interleaved with dense. Last, the kernels of the last
variant's graphed step with their start times, to show the overlap."""
import json
import os
import sys

import torch
import torch.nn.functional as F

import openmsa
from openmsa import msa_attention
from openmsa.bench.run import index_inputs
from openmsa.bench.timing import median_ms
from openmsa.ops import attention, library, streams

name = sys.argv[1]
out_dir = os.environ["OUT"]
S, H, Hkv, Hi, D = 16384, 16, 2, 4, 128
SWITCHES = [(library, "CONCURRENT_BLOCK_WORK"), (attention, "CONCURRENT_INDEX_LSE"),
            (streams, "SIDE_PRIORITY")]
if all(hasattr(module, switch) for module, switch in SWITCHES):
    VARIANTS = {"streams off": (False, False, 0), "streams, priority 0": (True, True, 0),
                "streams, priority -1": (True, True, -1)}
else:
    VARIANTS = {"default": None}
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
    grads = torch.autograd.grad((out, kl), inputs, (dout, one))
    return (out.detach(), kl.detach()) + grads  # no autograd graph kept alive


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


def set_variant(label):
    if VARIANTS[label] is not None:
        for (module, switch), value in zip(SWITCHES, VARIANTS[label]):
            setattr(module, switch, value)


names = ("out", "kl", "dq", "dk", "dv", "d_index_q", "d_index_k")
result = dict(name=name, package=os.path.dirname(openmsa.__file__), checks={}, rounds=[])
labels = list(VARIANTS)
set_variant(labels[0])
reference = step()
replays = {}
for label in labels:
    set_variant(label)
    got = step()
    result["checks"][label] = {
        n: ("equal" if torch.equal(a, b) else
            f"rel rms {((a - b).float().pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt()).item():.2e}")
        for n, a, b in zip(names, got, reference)}
    replays[label] = graphed(step)
for _ in range(2):
    timings = {"dense": median_ms(dense)}
    for label in labels:
        set_variant(label)
        timings[label] = (median_ms(step), median_ms(replays[label]))
    result["rounds"].append(timings)

# The last variant's graphed step: kernels and start times (us from the first kernel).
replay = replays[labels[-1]]
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
start = events[0]["ts"]
result["kernels"] = [(e["name"][:50], e.get("args", {}).get("stream"), round(e["ts"] - start, 1),
                      round(e["dur"], 1)) for e in events]
result["graph_span_us"] = round(max(e["ts"] + e["dur"] for e in events) - start, 1)
with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
    json.dump(result, f, indent=1)
print(json.dumps(result["checks"], indent=1))
for kernel, stream, at, us in result["kernels"]:
    if us >= 15:
        print(f"  stream {stream} at {at:8.1f} us {us:8.1f} us  {kernel}")
print(f"graph span {result['graph_span_us']} us")
print(f"{name}: variant | eager ms | graph ms (per round), dense ms")
for label in labels:
    cells = "  ".join(f"{r[label][0]:.3f} | {r[label][1]:.3f}" for r in result["rounds"])
    print(f"  {label:22s} {cells}")
print("  dense " + "  ".join(f"{r['dense']:.3f}" for r in result["rounds"]))
