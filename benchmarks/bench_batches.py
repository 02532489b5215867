"""The host's time to make one training batch of an LM preset (`openmsa train --preset ruler-*`),
per phase of its curriculum and task, by the two routes of `openmsa/eval/tasks.py` in the same
run: prompts built from encoded pieces (`synthetic_tokenizer`, which splits at whitespace) and
whole prompts tokenized (the same tokenizer with its pre-tokenizers reordered: the same tokens,
not seen to split at whitespace, so every text is tokenized whole). CPU only.

    python benchmarks/bench_batches.py [--preset ruler-gpu] [--batches 4] [--out DIR]

Prints a table last (median ms per batch, the first batch of each cell left out: it fills the
pieces' cache) and, with --out, writes batches.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time

from openmsa.eval.tasks import synthetic_tokenizer
from openmsa.train.batches import BatchSpec, make_batch
from openmsa.train.lm import LM_PRESETS, curriculum_phases


def whole_text_tokenizer():
    """``synthetic_tokenizer`` with punctuation split first: not seen to split at whitespace."""
    from tokenizers import pre_tokenizers

    tokenizer = synthetic_tokenizer()
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Punctuation(), pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.WhitespaceSplit()])
    return tokenizer


def median_ms(tokenizer, task: str, length: int, size: int, batches: int) -> float:
    times = []
    for index in range(batches + 1):
        start = time.perf_counter()
        make_batch(tokenizer, BatchSpec(task, length, size, 1_000 * index))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="ruler-gpu", choices=sorted(LM_PRESETS))
    parser.add_argument("--batches", type=int, default=4, help="timed batches per cell")
    parser.add_argument("--out", help="folder for batches.json")
    args = parser.parse_args()
    if args.batches < 1:
        parser.error(f"--batches: expected 1 or more, received {args.batches}")
    preset = LM_PRESETS[args.preset]
    phases = [(tokens, batch, tasks) for _, tokens, batch, tasks in curriculum_phases(preset)]
    phases.append((preset.seqlen, preset.batch, preset.tasks))
    routes = {"pieces": synthetic_tokenizer(), "whole": whole_text_tokenizer()}
    rows, timed = [], set()
    for tokens, batch, tasks in phases:
        for task in tasks:
            if (tokens, batch, task) in timed:  # phases may share lengths and tasks
                continue
            timed.add((tokens, batch, task))
            row = dict(tokens=tokens, batch=batch, task=task)
            for route, tokenizer in routes.items():
                row[f"{route}_ms"] = median_ms(tokenizer, task, tokens, batch, args.batches)
            rows.append(row)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        with open(os.path.join(args.out, "batches.json"), "w") as handle:
            json.dump(dict(preset=args.preset, batches=args.batches, commit=commit,
                           host=f"{platform.processor() or platform.machine()}, "
                                f"{os.cpu_count()} cores", rows=rows), handle, indent=1)
    print(f"{'tokens':>6} {'batch':>5} {'task':<18} {'pieces ms':>9} {'whole ms':>9} {'x':>5}")
    for row in rows:
        print(f"{row['tokens']:>6} {row['batch']:>5} {row['task']:<18} {row['pieces_ms']:>9.1f} "
              f"{row['whole_ms']:>9.1f} {row['whole_ms'] / row['pieces_ms']:>5.1f}")


if __name__ == "__main__":
    main()
