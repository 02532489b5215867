"""Where a short training step's time goes: the host's Python against the GPU's kernels (GPU only).

    python benchmarks/profile_host.py --out DIR [--cases h64:4096,h64:8192,h16:8192,h16:16384]
                                      [--selections coherent,random] [--profile-case h16:8192]
                                      [--launch-cases h16:8192,h64:4096]

For each case and selection kind: the eager step's median (as ``openmsa bench`` times it), the
same step replayed from a CUDA graph (the GPU's time alone), the host's time to enqueue one step
(the GPU idle when it starts), the eager step and its host time through the registered
``openmsa::msa_forward`` operator (the route under torch.compile and dispatch modes), and dense
SDPA's step in the same run. For ``--profile-case``
(coherent): a cProfile of eager steps (functions by their own time) and the kernels of one step
(torch profiler). Writes host.json, cprofile-SHAPE-S.txt and kernels-SHAPE-S.txt to ``--out``.
``--launch-cases``: the host's time inside Triton's launch call, by kernel, over 50 eager steps
(coherent), and the host's time of the forward alone (launches.json).
``--loop-case shape:S --loop-steps N`` only runs N eager steps (coherent), for a sampling
profiler started around the script (``py-spy record -- python benchmarks/profile_host.py ...``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import io
import json
import os
import pstats
import statistics
import time

import torch
from triton.runtime.jit import JITFunction

from openmsa import msa_attention
from openmsa.bench.run import add_selection_and_dense, make_inputs
from openmsa.bench.timing import graphed, median_ms
from openmsa.ops import msa as msa_module
from openmsa.ops.custom_ops import msa_forward

SHAPES = {"h64": dict(heads=64, kv_heads=4, index_heads=4, head_dim=128),
          "h16": dict(heads=16, kv_heads=2, index_heads=4, head_dim=128)}


def parse_cases(text: str) -> list[tuple[str, int]]:
    cases = []
    for item in text.split(","):
        shape, _, seqlen = item.partition(":")
        if shape not in SHAPES or not seqlen.isdigit():
            raise SystemExit(f"--cases: expected shape:seqlen with shape in {sorted(SHAPES)}, "
                             f"received {item!r}")
        cases.append((shape, int(seqlen)))
    return cases


def step_of(shape: str, seqlen: int, selection: str):
    inputs = make_inputs(SHAPES[shape], seqlen, selection)
    dout, one = torch.randn_like(inputs[0]), torch.ones((), device="cuda")

    def step():
        out, kl = msa_attention(*inputs, top_k=16, block_size=128)
        return torch.autograd.grad((out, kl), inputs, (dout, one))

    return inputs, dout, step


def host_ms(step, calls: int = 30) -> float:
    """Median wall time of enqueueing one step with the GPU idle at its start."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


@contextlib.contextmanager
def registered_operator():
    """msa_attention through the registered ``openmsa::msa_forward`` operator while inside."""
    chooser = msa_module.msa_operator
    msa_module.msa_operator = lambda *inputs, tuning=None: msa_forward
    try:
        yield
    finally:
        msa_module.msa_operator = chooser


def measure(shape: str, seqlen: int, selection: str, dense: dict) -> dict:
    inputs, dout, step = step_of(shape, seqlen, selection)
    step()
    row = dict(shape=shape, seqlen=seqlen, selection=selection)
    row["step_ms"] = median_ms(step)
    row["step_cuda_graph_ms"] = median_ms(graphed(step))
    row["host_ms"] = host_ms(step)
    # The same step through the registered operator (as under torch.compile or a dispatch
    # mode), against the eager route msa_attention takes: the operators' dispatch cost.
    with registered_operator():
        row["step_registered_operator_ms"] = median_ms(step)
        row["host_registered_operator_ms"] = host_ms(step)
    add_selection_and_dense(row, msa_attention, inputs, dout, dense)
    row["x_dense"] = row["dense_step_ms"] / row["step_ms"]
    row["x_dense_graph"] = row["dense_step_ms"] / row["step_cuda_graph_ms"]
    print(json.dumps(row), flush=True)
    return row


def profile(shape: str, seqlen: int, out_dir: str) -> None:
    _, _, step = step_of(shape, seqlen, "coherent")
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(30):
        step()
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(60)
    with open(os.path.join(out_dir, f"cprofile-{shape}-{seqlen}.txt"), "w") as f:
        f.write(f"30 eager steps, {shape} S={seqlen}, coherent\n" + text.getvalue())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                            torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=60)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    with open(os.path.join(out_dir, f"kernels-{shape}-{seqlen}.txt"), "w") as f:
        f.write(f"one eager step, {shape} S={seqlen}, coherent: {len(kernels)} GPU events\n")
        for event in kernels:
            f.write(f"{event.device_time:9.1f} us  {event.name[:110]}\n")
        f.write(table)


def launch_costs(shape: str, seqlen: int, steps: int = 50) -> dict:
    """Host milliseconds per eager step inside ``JITFunction.run`` (Triton's and Gluon's launch
    path: argument binding, cache lookup, tensor descriptors, the launch), by kernel."""
    inputs, _, step = step_of(shape, seqlen, "coherent")
    forward_host = host_ms(lambda: msa_attention(*inputs, top_k=16, block_size=128), steps)
    step_host = host_ms(step, steps)
    spent = collections.defaultdict(lambda: [0, 0.0])
    run = JITFunction.run

    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return run(self, *args, **kwargs)
        finally:
            entry = spent[self.fn.__name__]
            entry[0] += 1
            entry[1] += time.perf_counter() - start

    JITFunction.run = timed
    try:
        host_ms(step, steps)
    finally:
        JITFunction.run = run
    kernels = {name: dict(launches=count / steps, host_us=round(seconds / steps * 1e6, 1))
               for name, (count, seconds) in sorted(spent.items(), key=lambda e: -e[1][1])}
    row = dict(shape=shape, seqlen=seqlen, step_host_ms=step_host, forward_host_ms=forward_host,
               launches=sum(k["launches"] for k in kernels.values()),
               launch_host_ms=sum(k["host_us"] for k in kernels.values()) / 1e3, kernels=kernels)
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", type=parse_cases,
                        default=parse_cases("h64:4096,h64:8192,h16:8192,h16:16384"))
    parser.add_argument("--selections", default="coherent,random")
    parser.add_argument("--profile-case", type=parse_cases, default=parse_cases("h16:8192"))
    parser.add_argument("--launch-cases", type=parse_cases, default=[])
    parser.add_argument("--loop-case", type=parse_cases, default=None)
    parser.add_argument("--loop-steps", type=int, default=2000)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.loop_case:
        for shape, seqlen in args.loop_case:
            _, _, step = step_of(shape, seqlen, "coherent")
            for _ in range(args.loop_steps):
                step()
            torch.cuda.synchronize()
        return
    if args.launch_cases:
        launches = [launch_costs(shape, seqlen) for shape, seqlen in args.launch_cases]
        with open(os.path.join(args.out, "launches.json"), "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                           rows=launches), f, indent=1)
    rows = []
    for shape, seqlen in args.cases:
        dense = {}
        for selection in args.selections.split(","):
            rows.append(measure(shape, seqlen, selection, dense))
    for shape, seqlen in args.profile_case:
        profile(shape, seqlen, args.out)
    with open(os.path.join(args.out, "host.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f,
                  indent=1)
    print("shape S selection | Jaccard union8 | step graph host ms | registered operator: "
          "step host ms | dense ms | x dense (graph)")
    for r in rows:
        print(f"{r['shape']} {r['seqlen']} {r['selection']} | {r['jaccard']:.2f} "
              f"{r['union_8']:.1f} | {r['step_ms']:.2f} {r['step_cuda_graph_ms']:.2f} "
              f"{r['host_ms']:.2f} | {r['step_registered_operator_ms']:.2f} "
              f"{r['host_registered_operator_ms']:.2f} | {r['dense_step_ms']:.2f} | "
              f"{r['x_dense']:.2f} ({r['x_dense_graph']:.2f})")


if __name__ == "__main__":
    main()
