"""Where a named tuning's training step spends its time against the first tuning's, kernel by
kernel (GPU only).

    python benchmarks/profile_tunings.py --out DIR [--seqlens 32768,131072]
        [--kinds coherent,mid,random] [--tunings default,adaptive,auto] [--heads 64,4,4]
        [--rounds 4]

For each length and selection kind: the eager one-layer step (``msa_attention`` with the KL
value, forward and backward through autograd) under each of ``--tunings`` (the median of
``--rounds`` timings, the tunings taking turns in alternating order), dense SDPA's step in
the same run, the selection's neighbours' Jaccard and 8-token union, the shares of tiles past
the tuning's walk limits, and the GPU time and launch count of every kernel per step (torch
profiler, the mean of ``PROFILED_STEPS`` steps). The table printed last lists each
tuning's step and the kernels whose time differs from the first tuning's by more than
``--min-us`` microseconds: a tuning's fixed costs on selections it does not help show there.
Writes ``DIR/profile_tunings.json``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from openmsa import msa_attention
from openmsa.bench.run import dense_baseline
from openmsa.bench.selection import SELECTION_KINDS, index_inputs, selection_statistics
from openmsa.bench.timing import kernel_profile, median_ms
from openmsa.ops.attention.key_outer import walk_limit
from openmsa.ops.auto_tuning import own_tuning
from openmsa.ops.configs import INDEX_WALK_LIMIT_PER_SLOT, TUNINGS
from openmsa.ops.layout import batch_cu_seqlens
from openmsa.ops.problem import SparseAttentionProblem
from openmsa.ops.select import select_blocks_fwd

DIM, TOP_K, BLOCK = 128, 16, 128
PROFILED_STEPS = 5  # a kernel's time in one step varies by several percent: the mean of five


def long_walk_shares(q, k, ids, cu, index_k, tuning: str) -> dict:
    """The shares of main query tiles and of index tiles whose unions pass ``tuning``'s walk
    limits (0 where a limit is not configured): the tiles its long-walk routes take ("auto":
    the adaptive tuning's, which it runs past its threshold)."""
    p = SparseAttentionProblem(q, k, ids, cu, BLOCK, DIM ** -0.5, index_k, DIM ** -0.5,
                               tuning=TUNINGS["adaptive" if tuning == "auto" else tuning])
    index_limit = INDEX_WALK_LIMIT_PER_SLOT * TOP_K if p.tuning.index_lse_split else 0
    if index_limit >= p.union_bound(p.index_tile_work):
        index_limit = 0  # no index tile can pass it: the split walks alone
    shares = {}
    for name, work, limit in (("main", p.query_work, walk_limit(p)),
                              ("index", p.index_tile_work, index_limit)):
        valid = work.schedule[:, 0] >= 0
        passed = (work.union_count[valid] > limit).float().mean() if limit else 0.0
        shares[f"{name}_long_walk_share"] = float(passed)
    return shares


def measure(seqlen: int, kind: str, heads, tunings, rounds: int) -> list[dict]:
    num_heads, kv_heads, index_heads = heads
    generator = torch.Generator(device="cuda").manual_seed(seqlen)
    q, k, v = (torch.randn(1, seqlen, h, DIM, device="cuda", generator=generator).bfloat16()
               for h in (num_heads, kv_heads, kv_heads))
    index_q, index_k = index_inputs(kind, seqlen, index_heads, DIM, generator)
    cu = batch_cu_seqlens(1, seqlen, "cuda")
    ids, _ = select_blocks_fwd(index_q, index_k, cu, top_k=TOP_K, block_size=BLOCK,
                               index_softmax_scale=DIM ** -0.5, num_local_blocks=1,
                               num_sink_blocks=0, return_max=True)
    statistics = selection_statistics(ids)
    inputs = [t.clone().requires_grad_() for t in (q, k, v, index_q[None], index_k[None])]
    dout, one = torch.randn_like(q), torch.ones((), device="cuda")
    dense = dense_baseline(*inputs[:3], dout, median_ms)
    steps = {name: _step(inputs, dout, one, name) for name in tunings}
    # The tunings take turns, in alternating order, so that neither is always timed on a GPU
    # the other has warmed: within one call the same kernel on the same inputs read 7-16%
    # slower when timed later (benchmarks/records/long-walk-routes.json).
    times = {name: [] for name in tunings}
    for turn in range(rounds):
        for name in (tunings if turn % 2 == 0 else tunings[::-1]):
            times[name].append(median_ms(steps[name]))
    rows = []
    for name in tunings:
        row = dict(seqlen=seqlen, selection=kind, heads=list(heads), tuning=name, **statistics,
                   **long_walk_shares(q[0], k[0], ids, cu, index_k, name),
                   step_ms=sorted(times[name])[len(times[name]) // 2], round_ms=times[name],
                   kernels=kernel_profile(steps[name], PROFILED_STEPS), **dense)
        row["step_x_dense"] = dense["dense_fwd_bwd_ms"] / row["step_ms"]
        rows.append(row)
        print(json.dumps({key: value for key, value in row.items() if key != "kernels"}),
              flush=True)
    torch.cuda.empty_cache()
    return rows


def _step(inputs, dout, one, tuning: str):
    """One eager training step of ``msa_attention`` under ``tuning`` ("auto": an AutoTuning
    of the case's own, which its first steps' measurements settle)."""
    tuning = own_tuning(tuning)

    def step():
        out, kl = msa_attention(*inputs, top_k=TOP_K, block_size=BLOCK, tuning=tuning)
        torch.autograd.grad((out, kl), inputs, (dout, one))

    return step


def table(rows, min_us: float) -> str:
    lines = ["| S | selection | Jaccard | union8 | tuning | long walks main / index | step ms | "
             "x dense | kernels differing from the first tuning's (ms, launches) |",
             "|" + "---|" * 9]
    first = {}
    for row in rows:
        key = (row["seqlen"], row["selection"])
        base = first.setdefault(key, row)
        notes = []
        if row is not base:
            names = set(row["kernels"]) | set(base["kernels"])
            for name in sorted(names, key=lambda n: -abs(row["kernels"].get(n, [0, 0])[0]
                                                        - base["kernels"].get(n, [0, 0])[0])):
                new, old = row["kernels"].get(name, [0.0, 0]), base["kernels"].get(name, [0.0, 0])
                if abs(new[0] - old[0]) * 1000 >= min_us:
                    notes.append(f"{name[:40]} {old[0]:.3f}->{new[0]:.3f} "
                                 f"({old[1]:g}->{new[1]:g})")
        lines.append(f"| {row['seqlen']} | {row['selection']} | {row['jaccard']:.2f} | "
                     f"{row['union_8']:.1f} | {row['tuning']} | "
                     f"{row['main_long_walk_share']:.2f} / {row['index_long_walk_share']:.2f} | "
                     f"{row['step_ms']:.2f} | "
                     f"{row['step_x_dense']:.2f} | {'; '.join(notes[:8]) or '-'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seqlens", default="32768,131072")
    parser.add_argument("--kinds", default=",".join(SELECTION_KINDS))
    parser.add_argument("--tunings", default="default,adaptive,auto")
    parser.add_argument("--heads", default="64,4,4", help="H,Hkv,Hi")
    parser.add_argument("--min-us", type=float, default=30.0)
    parser.add_argument("--rounds", type=int, default=4,
                        help="timings of each tuning, taking turns in alternating order")
    args = parser.parse_args()
    tunings = args.tunings.split(",")
    if args.rounds < 1:
        parser.error(f"--rounds: expected 1 or more, received {args.rounds}")
    for name in tunings:
        if name not in TUNINGS and name != "auto":
            parser.error(f"--tunings: expected names of {sorted(TUNINGS)} or auto, received "
                         f"{name!r}")
    kinds = args.kinds.split(",")
    for kind in kinds:
        if kind not in SELECTION_KINDS:
            parser.error(f"--kinds: expected names of {SELECTION_KINDS}, received {kind!r}")
    heads = tuple(int(h) for h in args.heads.split(","))
    if len(heads) != 3:
        parser.error(f"--heads: expected H,Hkv,Hi, received {args.heads!r}")
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for seqlen in (int(s) for s in args.seqlens.split(",")):
        for kind in kinds:
            rows += measure(seqlen, kind, heads, tunings, args.rounds)
    with open(os.path.join(args.out, "profile_tunings.json"), "w") as f:
        json.dump(dict(command="python benchmarks/profile_tunings.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
            gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)
    print(table(rows, args.min_us))


if __name__ == "__main__":
    main()
