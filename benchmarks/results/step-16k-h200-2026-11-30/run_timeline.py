"""The 16k H16 step's timeline replayed from a CUDA graph (every kernel's start and end: where
the GPU is busy, where it waits between kernels), and what running independent parts of the
step on a second stream would save (each pair timed back to back and side by side, both from
CUDA graphs). bench_msa.py's 16k H16 inputs (coherent selections)."""
import json
import os

import torch

from openmsa import msa_attention
from openmsa.bench.run import index_inputs
from openmsa.bench.timing import median_ms
from openmsa.ops import attention
from openmsa.ops.attention import (LOG2_E, SparseAttentionProblem, attention_backward,
                                   index_branch_kl, index_log_sum_exp)
from openmsa.ops import hopper
from openmsa.ops.schedule import batch_cu_seqlens
from openmsa.ops.select import select_blocks_fwd

out_dir = os.environ["OUT"]
S, H, Hkv, Hi, D = 16384, 16, 2, 4, 128
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


result = {}
replay = graphed(step)
result["step_graph_ms"] = median_ms(replay)
for _ in range(3):
    replay()
torch.cuda.synchronize()
trace = os.path.join(out_dir, "trace.json")
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    replay()
    torch.cuda.synchronize()
prof.export_chrome_trace(trace)
events = [e for e in json.load(open(trace))["traceEvents"]
          if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
events.sort(key=lambda e: e["ts"])
os.remove(trace)
span = events[-1]["ts"] + events[-1]["dur"] - events[0]["ts"]
busy = sum(e["dur"] for e in events)
big = [e for e in events if e["dur"] >= 50]
timeline = []
end = events[0]["ts"]
for e in events:
    timeline.append(dict(name=e["name"][:80], start_us=round(e["ts"] - events[0]["ts"], 1),
                         dur_us=round(e["dur"], 1), gap_us=round(e["ts"] - end, 1)))
    end = max(end, e["ts"] + e["dur"])
result.update(kernels=len(events), span_ms=span / 1000, kernel_sum_ms=busy / 1000,
              big_kernels_ms=sum(e["dur"] for e in big) / 1000,
              small_kernels_ms=sum(e["dur"] for e in events if e["dur"] < 50) / 1000,
              gaps_ms=sum(t["gap_us"] for t in timeline if t["gap_us"] > 0) / 1000)
# Where the small kernels and gaps are: between which big kernels.
stretch, stretches = dict(small=0, gap=0.0, kernels=0.0), []
for t in timeline:
    if t["dur_us"] >= 50:
        stretches.append(dict(before=t["name"][:40], **stretch))
        stretch = dict(small=0, gap=0.0, kernels=0.0)
    else:
        stretch["small"] += 1
        stretch["kernels"] += t["dur_us"]
    stretch["gap"] += max(t["gap_us"], 0)
stretches.append(dict(before="end", **stretch))
result["stretches"] = stretches
print(json.dumps({k: v for k, v in result.items() if k != "stretches"}), flush=True)
for s in stretches:
    print(f"{s['small']:4d} small kernels {s['kernels']:8.1f} us, gaps {s['gap']:7.1f} us, "
          f"then {s['before']}")
with open(os.path.join(out_dir, "timeline.json"), "w") as f:
    json.dump(dict(result, timeline=timeline), f, indent=1)

if os.environ.get("PARTS", "1") == "0":
    raise SystemExit
# Parts of the step, back to back and side by side.
qp, kp, vp, iqp, ikp = (t.detach()[0] for t in inputs)
cu = batch_cu_seqlens(1, S, "cuda")
ids, index_max = select_blocks_fwd(iqp, ikp, cu, top_k=16, block_size=128,
                                   index_softmax_scale=D ** -0.5, num_local_blocks=1,
                                   num_sink_blocks=0, return_max=True)
p = SparseAttentionProblem(qp, kp, ids, cu, 128, D ** -0.5, ikp, D ** -0.5)
p.block_work  # built once
out, lse = hopper.sparse_attention_fwd(qp, kp, vp, p, p.scale * LOG2_E)
lse_index = index_log_sum_exp(iqp, ikp, index_max, p)
dout_p = dout[0]
side = torch.cuda.Stream()


def fwd_main():
    hopper.sparse_attention_fwd(qp, kp, vp, p, p.scale * LOG2_E)


def fwd_index():
    index_log_sum_exp(iqp, ikp, index_max, p)


def kl():
    index_branch_kl(qp, kp, iqp, ikp, lse, lse_index, p, True, True, False)


def backward():
    attention_backward(qp, kp, vp, out, dout_p, lse, p)


def lists():
    p2 = SparseAttentionProblem(qp, kp, ids, cu, 128, D ** -0.5, ikp, D ** -0.5)
    p2.block_work


def pair(first, second):
    def serial():
        first()
        second()

    def parallel():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            second()
        first()
        torch.cuda.current_stream().wait_stream(side)
    return serial, parallel


rows = {}
for name, fns in (("fwd_main", (fwd_main,)), ("fwd_index", (fwd_index,)), ("kl", (kl,)),
                  ("backward", (backward,)), ("lists", (lists,)),
                  ("fwd_main+fwd_index", pair(fwd_main, fwd_index)),
                  ("backward+kl", pair(backward, kl)),
                  ("fwd_main+lists", pair(fwd_main, lists))):
    times = [median_ms(graphed(fn)) for fn in fns]
    rows[name] = times
    print(f"{name:>20}: " + " / ".join(f"{t:.3f}" for t in times) + " ms"
          + ("  (back to back / side by side)" if len(times) == 2 else ""), flush=True)
result["parts_ms"] = rows
with open(os.path.join(out_dir, "timeline.json"), "w") as f:
    json.dump(dict(result, timeline=timeline), f, indent=1)
