"""The key-outer kernels' segment size (pairs per dK/dV and KL program) by problem size (GPU only).

    python benchmarks/bench_segments.py --out DIR [--cases h64:4096,h64:8192,h16:8192,...]
                                       [--segment-pairs shipped,1024,512,256] [--kinds KINDS]

A key block's (token, index head) pairs are cut into segments of ``Tuning.segment_pairs``, one
program each. At short contexts a step has few key blocks (32 x Hi at 4k) and few segments, so
the last wave of programs decides the dK/dV and KL kernels' time. For each case, selection kind
and variant (``--segment-pairs``: a number: every problem cut so; ``shipped``: ``Tuning()``'s
rule, which cuts short problems of wide groups at ``short_segment_pairs``; or other fields of
``configs.Tuning``, such as ``kl_pairs=32``): the training step replayed from a
CUDA graph (GPU time alone), the dK/dV, KL, dQ and forward kernels' times (torch profiler, one
replay), the selection's Jaccard and union, and dense SDPA's step in the same run. Prints a
table last and writes segments.json to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from openmsa.bench.run import add_selection_and_dense, make_inputs
from openmsa.bench.timing import captured, median_ms
from openmsa.ops.configs import Tuning
from openmsa.testing import tuned_msa_attention

sys.path.insert(0, os.path.dirname(__file__))
from profile_host import SHAPES, parse_cases  # noqa: E402

KERNELS = {"dkdv": "_sparse_attn_dkdv", "dq": "_sparse_attn_dq", "kl": "_kl_",
           "fwd": "_sparse_attn_fwd_hopper", "select": "_select_fwd"}


def kernel_times(replay) -> dict:
    """Microseconds of the named kernels in one replay of a captured step."""
    replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize()
    times = {name: 0.0 for name in KERNELS}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        for name, prefix in KERNELS.items():
            if event.name.startswith(prefix):
                times[name] += event.device_time
    return {f"{name}_us": round(value, 1) for name, value in times.items()}


def tuning_of(variant: str) -> Tuning:
    """``shipped``; a number N (every problem cut at N pairs); or ``field=value[+field=value]``
    of ``configs.Tuning`` (integers), the other fields shipped: ``kl_pairs=32``."""
    if variant == "shipped":
        return Tuning()
    if variant.isdigit():
        return Tuning(segment_pairs=int(variant), short_segment_pairs=int(variant))
    fields = dict(item.split("=", 1) for item in variant.split("+"))
    return Tuning(**{name: int(value) for name, value in fields.items()})


def measure(shape: str, seqlen: int, kind: str, pairs: str, dense: dict) -> dict:
    inputs = make_inputs(SHAPES[shape], seqlen, kind)
    dout, one = torch.randn_like(inputs[0]), torch.ones((), device="cuda")
    attention = tuned_msa_attention(tuning_of(pairs))

    def step():
        out, kl = attention(*inputs, top_k=16, block_size=128)
        return torch.autograd.grad((out, kl), inputs, (dout, one))

    graph, _ = captured(step)
    row = dict(shape=shape, seqlen=seqlen, selection=kind, segment_pairs=pairs,
               step_graph_ms=median_ms(graph.replay))
    row.update(kernel_times(graph.replay))
    add_selection_and_dense(row, attention, inputs, dout, dense)
    row["x_dense_graph"] = row["dense_step_ms"] / row["step_graph_ms"]
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", type=parse_cases,
                        default=parse_cases("h64:4096,h64:8192,h16:8192,h16:16384,h64:32768"))
    parser.add_argument("--segment-pairs", default="shipped,1024,512,256",
                        help="variants, comma-separated: shipped, a segment size, or "
                             "field=value[+field=value] of configs.Tuning")
    parser.add_argument("--kinds", default="coherent,mid,random")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for shape, seqlen in args.cases:
        dense = {}
        for kind in args.kinds.split(","):
            for pairs in args.segment_pairs.split(","):
                rows.append(measure(shape, seqlen, kind, pairs, dense))
    with open(os.path.join(args.out, "segments.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f,
                  indent=1)
    print("shape S kind variant | Jaccard union8 | step(graph) dkdv kl dq fwd | dense | x dense")
    for r in rows:
        print(f"{r['shape']} {r['seqlen']} {r['selection']} {r['segment_pairs']} | "
              f"{r['jaccard']:.2f} {r['union_8']:.1f} | {r['step_graph_ms']:.3f} ms "
              f"{r['dkdv_us']:.0f} {r['kl_us']:.0f} {r['dq_us']:.0f} {r['fwd_us']:.0f} us | "
              f"{r['dense_step_ms']:.2f} | {r['x_dense_graph']:.2f}")


if __name__ == "__main__":
    main()
