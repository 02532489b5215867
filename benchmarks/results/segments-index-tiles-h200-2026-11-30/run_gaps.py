"""Where the 16k, H16 step replayed from a CUDA graph spends the time its kernels do not: each
kernel's start and end in five profiled replays, each after the L2 cache is flushed (as
``median_ms`` does before every timed call). Prints one JSON line, writes OUT/NAME.json.

    OUT=DIR python run_gaps.py NAME [CONSTANT=VALUE ...]

CONSTANT=VALUE sets an ``openmsa.ops.attention`` constant (an integer) before anything runs,
e.g. SEGMENT_PAIRS=1024. Reports: the step from the graph (``median_ms``) and dense SDPA
fwd+bwd in the same process; for the replay of median span: the span from the first kernel's
start to the last one's end, the kernels' summed time, the gaps between consecutive kernels
and the ten largest (with the kernels around them)."""
import json
import os
import sys

import torch
import torch.nn.functional as F

from openmsa import msa_attention
from openmsa.bench.run import make_inputs
from openmsa.bench.timing import graphed, median_ms
from openmsa.ops import attention

name, overrides = sys.argv[1], sys.argv[2:]
for override in overrides:
    constant, value = override.split("=")
    assert hasattr(attention, constant), constant
    setattr(attention, constant, int(value))
out_dir = os.environ["OUT"]

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


replay = graphed(step)
result = dict(name=name, overrides=overrides, dense_ms=median_ms(dense),
              step_graph_ms=median_ms(replay))
result["dense_again_ms"] = median_ms(dense)

flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
replays = []
for number in range(5):
    flush.zero_()
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
    kernels = [(e["name"][:50], e["ts"], e["ts"] + e["dur"]) for e in events]
    gaps = [(after[1] - before[2], before[0], after[0])
            for before, after in zip(kernels, kernels[1:])]
    replays.append(dict(span_us=kernels[-1][2] - kernels[0][1],
                        kernel_sum_us=sum(end - start for _, start, end in kernels),
                        gap_sum_us=sum(gap for gap, *_ in gaps), kernels=len(kernels),
                        largest_gaps=sorted(gaps, reverse=True)[:10],
                        timeline=[(n, round(s - kernels[0][1], 1), round(e - s, 1))
                                  for n, s, e in kernels]))
replays.sort(key=lambda r: r["span_us"])
result["spans_us"] = [round(r["span_us"], 1) for r in replays]
result["median_replay"] = replays[len(replays) // 2]
with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
    json.dump(result, f, indent=1)
summary = {key: value for key, value in result.items() if key != "median_replay"}
summary.update({key: result["median_replay"][key]
                for key in ("span_us", "kernel_sum_us", "gap_sum_us", "kernels")})
print(json.dumps(summary))
for gap, before, after in result["median_replay"]["largest_gaps"]:
    print(f"  {gap:6.1f} us  {before} -> {after}")
