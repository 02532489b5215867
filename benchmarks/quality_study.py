"""The long-context quality study (docs/EVAL.md): dense against MSA training of an LM preset over
seeds, the conversion path (a dense model's index branch trained alone), and variants of the
MSA model (fp8 indexing, index sharing), all evaluated by ``openmsa eval`` at chosen lengths.

    python benchmarks/quality_study.py --out ROOT [--preset ruler-gpu] [--seeds 0,1]
        [--stages train,adapt,eval,report] [--variants fp8,share2] [--parallel 4]
        [--lengths 4k,8k,16k,32k,64k] [--samples 10] [--eval-batch 1] [--adapt-steps 300]
        [--device cuda]
        [--train-args "--grad-clip 1 --lr-schedule cosine"]
        [--only-variants] [--merge EARLIER/study.json,...]

Stages (each skips work whose output exists, so a stage cut short by a time limit resumes):
- ``train``: per seed, the dense model and the MSA model (``openmsa train --models dense`` /
  ``msa``) and each variant's MSA model, as separate processes, up to ``--parallel`` at once
  (a GPU runs small models side by side);
- ``adapt``: per seed, the dense checkpoint converted and its index branch trained by the KL
  alone (``openmsa train --adapt-index``);
- ``eval``: ``openmsa eval --resume`` on every checkpoint (dense and MSA attention with its
  weights; a cut evaluation goes on from the samples it finished);
- ``report``: from each evaluation's eval.json, or, where an evaluation never finished, from
  the lengths its samples file completes (named in the output); ``study.json`` (every
  checkpoint's accuracy and recalls per task, length and mode, and per length the means over
  seeds of the comparisons the quality issue asks: MSA-trained in MSA attention against
  dense-trained in dense attention, and the adapted model in MSA attention against its dense
  self) and ``study.png``; prints a table last.

``--only-variants`` trains and evaluates the variants' models alone, and ``--merge`` joins the
rows of earlier study.json files (the same preset and samples a cell; this run's evaluations win
for a seed and checkpoint both hold) to the report: a call too short for the whole study adds
the variants to the base models another call evaluated.

Logs of every process go to ROOT/seedS/*.log. The training runs share the host's cores for
their batch-generating workers (``--data-workers``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

from openmsa.eval.command import SAMPLES_FILE, read_samples_file
from openmsa.eval.run import EvalSettings, finished_records, summarize

VARIANTS = {"fp8": ["--index-precision", "fp8"], "share2": ["--share-index-every", "2"]}


def _data_workers(args) -> list[str]:
    """``--data-workers`` of each of ``args.parallel`` training runs: the host's cores shared
    among them (each run's own process keeps one); none on a CPU."""
    if args.device_args == ["--device", "cpu"]:
        return ["--data-workers", "0"]
    cores = os.cpu_count() or 2
    return ["--data-workers", str(max(1, (cores - args.parallel) // args.parallel))]


def _jobs_train(args) -> list[tuple[str, list[str], str]]:
    """(log path, command, the checkpoint folder it writes) of every training run."""
    jobs = []
    for seed in args.seeds:
        root = os.path.join(args.out, f"seed{seed}")
        runs = [] if args.only_variants else [("dense", root, []), ("msa", root, [])]
        runs += [("msa", os.path.join(root, variant), VARIANTS[variant])
                 for variant in args.variants]
        for kind, out, extra in runs:
            command = [sys.executable, "-m", "openmsa.cli", "train", "--preset", args.preset,
                       "--models", kind, "--seed", str(seed), "--out", out, *extra,
                       *args.device_args, *_data_workers(args)]
            if args.steps:
                command += ["--steps", str(args.steps)]
            command += args.train_args
            name = os.path.relpath(out, root).replace(os.sep, "_").replace(".", "")
            log = os.path.join(root, f"train_{name + '_' if name else ''}{kind}.log")
            jobs.append((log, command, os.path.join(out, kind)))
    return jobs


def _jobs_adapt(args):
    if args.only_variants:  # no dense model to adapt
        return []
    jobs = []
    for seed in args.seeds:
        root = os.path.join(args.out, f"seed{seed}")
        command = [sys.executable, "-m", "openmsa.cli", "train", "--preset", args.preset,
                   "--adapt-index", os.path.join(root, "dense"), "--steps",
                   str(args.adapt_steps), "--seed", str(seed), "--out", root, *args.device_args,
                   *_data_workers(args)]
        jobs.append((os.path.join(root, "adapt.log"), command, os.path.join(root, "adapted")))
    return jobs


def checkpoints(args, base: bool = True) -> list[tuple[int, str, str]]:
    """(seed, name, folder) of every checkpoint the study trains; ``base=False``: the
    variants' alone."""
    found = []
    for seed in args.seeds:
        root = os.path.join(args.out, f"seed{seed}")
        if base:
            found += [(seed, name, os.path.join(root, name))
                      for name in ("dense", "msa", "adapted")]
        found += [(seed, f"msa_{variant}", os.path.join(root, variant, "msa"))
                  for variant in args.variants]
    return found


def _jobs_eval(args):
    jobs = []
    for seed, name, folder in checkpoints(args, base=not args.only_variants):
        out = os.path.join(args.out, f"seed{seed}", f"eval_{name}")
        command = [sys.executable, "-m", "openmsa.cli", "eval", "--model", folder, "--lengths",
                   args.lengths, "--samples", str(args.samples), "--seed", str(seed),
                   "--batch", str(args.eval_batch), "--out", out, "--resume",
                   *args.device_args]
        jobs.append((os.path.join(args.out, f"seed{seed}", f"eval_{name}.log"), command,
                     os.path.join(out, "eval.json")))
    return jobs


def run_jobs(jobs, parallel: int, stage: str) -> None:
    """Runs the jobs whose output is missing, ``parallel`` at a time; fails on a failed one."""
    waiting = [job for job in jobs if not os.path.exists(job[2])]
    skipped = len(jobs) - len(waiting)
    print(f"{stage}: {len(waiting)} to run" + (f", {skipped} done before" if skipped else ""),
          flush=True)
    running, start, done = [], time.perf_counter(), 0
    while waiting or running:
        while waiting and len(running) < parallel:
            log, command, output = waiting.pop(0)
            os.makedirs(os.path.dirname(log), exist_ok=True)
            handle = open(log, "w")
            running.append((subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT),
                            handle, log, output))
        time.sleep(0.5)
        for entry in [e for e in running if e[0].poll() is not None]:
            process, handle, log, output = entry
            handle.close()
            running.remove(entry)
            done += 1
            if process.returncode != 0 or not os.path.exists(output):
                for other in running:
                    other[0].kill()
                raise SystemExit(f"{stage}: {log} failed (exit {process.returncode}); "
                                 f"its last lines:\n" + "".join(open(log).readlines()[-15:]))
            print(f"{stage}: [{done}/{len(jobs) - skipped}] {time.perf_counter() - start:.0f}s "
                  f"{os.path.relpath(output, os.path.dirname(os.path.dirname(log)))}",
                  flush=True)


def _summary(folder: str):
    """(summary rows, "" or what an unfinished evaluation lacks) of the evaluation in
    ``folder``: its eval.json, else the lengths of its samples file (the records an
    interrupted ``openmsa eval`` kept) that every task and mode finished; None if neither."""
    path = os.path.join(folder, "eval.json")
    if os.path.exists(path):
        return json.load(open(path))["summary"], ""
    path = os.path.join(folder, SAMPLES_FILE)
    if not os.path.exists(path):
        return None
    written, records = read_samples_file(path)
    settings = EvalSettings(**{key: tuple(value) if isinstance(value, list) else value
                               for key, value in written.items()
                               if key in EvalSettings.__dataclass_fields__})
    records = finished_records(settings, records)
    wanted = len(settings.tasks) * settings.samples * len(settings.modes)
    finished = [length for length in settings.lengths
                if sum(r["length"] == length for r in records) == wanted]
    missing = [length for length in settings.lengths if length not in finished]
    rows = summarize([r for r in records if r["length"] in finished])
    return rows, ("unfinished: no " + ", ".join(map(str, missing)) + " tokens") if missing else ""


def _merged_rows(args, evaluated) -> list[dict]:
    """The rows of the earlier study.json files of ``args.merge`` (another call's evaluations
    of the same preset and samples a cell; or records of benchmarks/records holding one
    under "study"), but those of the (seed, checkpoint)s in
    ``evaluated``, which this run's evaluations give."""
    rows = []
    for path in args.merge:
        earlier = json.load(open(path))
        earlier = earlier.get("study", earlier)  # a record of benchmarks/records holds one
        for key in ("preset", "samples"):
            if earlier[key] != getattr(args, key):
                raise SystemExit(f"--merge: {path} holds a study of {key} {earlier[key]!r}, "
                                 f"this one of {getattr(args, key)!r}")
        rows += [r for r in earlier["rows"] if (r["seed"], r["checkpoint"]) not in evaluated]
    return rows


def report(args) -> dict:
    """study.json and study.png from the eval.json files."""
    rows, partial = [], []
    for seed, name, _ in checkpoints(args):
        folder = os.path.join(args.out, f"seed{seed}", f"eval_{name}")
        summary = _summary(folder)
        if summary is None:
            continue
        if summary[1]:
            partial.append(f"seed{seed}/{name}: {summary[1]}")
        for row in summary[0]:
            rows.append(dict(row, seed=seed, checkpoint=name))
    rows += _merged_rows(args, {(r["seed"], r["checkpoint"]) for r in rows})

    def accuracy(name, mode, task, length, key="accuracy"):
        values = [r[key] for r in rows if (r["checkpoint"], r["mode"], r["task"], r["length"])
                  == (name, mode, task, length) and r.get(key) is not None]
        return sum(values) / len(values) if values else None

    lengths = sorted({r["length"] for r in rows})
    tasks = sorted({r["task"] for r in rows})
    # name, mode of the curves; the comparisons are differences of two of them.
    curves = [("dense", "dense"), ("msa", "msa"), ("msa", "dense"), ("adapted", "msa")]
    curves += [(f"msa_{v}", "msa") for v in args.variants]
    means = [dict(checkpoint=name, mode=mode, task=task, length=length,
                  accuracy=accuracy(name, mode, task, length),
                  token_accuracy=accuracy(name, mode, task, length, "token_accuracy"))
             for name, mode in curves for task in tasks for length in lengths]
    comparisons = []
    pairs = [("msa-trained (MSA) - dense-trained (dense)", ("msa", "msa"), ("dense", "dense")),
             ("adapted (MSA) - adapted (dense)", ("adapted", "msa"), ("adapted", "dense"))]
    pairs += [(f"msa_{v} (MSA) - dense-trained (dense)", (f"msa_{v}", "msa"),
               ("dense", "dense")) for v in args.variants]
    for label, first, second in pairs:
        for length in lengths:
            entry = dict(comparison=label, length=length)
            for key, field in (("accuracy", "points"), ("token_accuracy", "token_points")):
                a = accuracy(*first, "average", length, key)
                b = accuracy(*second, "average", length, key)
                entry[field] = None if a is None or b is None else 100 * (a - b)
            comparisons.append(entry)
    from openmsa.train.lm import LM_PRESETS

    study = dict(preset=args.preset, training_length=LM_PRESETS[args.preset].seqlen,
                 seeds=sorted({r["seed"] for r in rows} | set(args.seeds)),
                 variants=args.variants, merged=args.merge,
                 lengths=lengths, samples=args.samples, rows=rows, means=means,
                 comparisons=comparisons, unfinished_evaluations=partial)
    os.makedirs(args.out, exist_ok=True)  # a report of merged studies alone has no folder
    with open(os.path.join(args.out, "study.json"), "w") as handle:
        json.dump(study, handle, indent=1)
    _plot(study, curves, tasks, os.path.join(args.out, "study.png"))
    for line in partial:
        print(f"evaluation from its samples file, {line}")
    for field, metric in (("points", "accuracy"), ("token_points", "answer-token accuracy")):
        print(f"\n{f'comparison ({metric} points, mean of seeds, average of tasks)':<74} "
              + " ".join(f"{length:>7}" for length in lengths))
        for label, _, _ in pairs:
            cells = [c[field] for c in comparisons if c["comparison"] == label]
            print(f"{label:<74} " + " ".join("      -" if p is None else f"{p:>+7.1f}"
                                             for p in cells))
    return study


def _plot(study, curves, tasks, path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    panels = ["average"] + [t for t in tasks if t != "average"]
    columns = min(4, len(panels))
    rows = -(-len(panels) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(3.4 * columns, 3.0 * rows),
                                sharey=True, squeeze=False)
    for axis in axes.flat[len(panels):]:
        axis.axis("off")
    for axis, task in zip(axes.flat, panels):
        for name, mode in curves:
            points = [(m["length"], m["accuracy"]) for m in study["means"]
                      if (m["checkpoint"], m["mode"], m["task"]) == (name, mode, task)
                      and m["accuracy"] is not None]
            if points:
                axis.plot(*zip(*points), marker="o", label=f"{name} ({mode})")
        axis.axvline(study["training_length"], color="grey", linestyle=":", linewidth=1)
        axis.set_xscale("log", base=2)
        axis.set_ylim(-0.03, 1.03)
        axis.set_title(task)
        axis.set_xlabel("tokens (dotted: training length)")
    for axis in axes[:, 0]:
        axis.set_ylabel(f"accuracy (mean of seeds {study['seeds']})")
    axes.flat[0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--preset", default="ruler-gpu")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--stages", default="train,adapt,eval,report")
    parser.add_argument("--variants", default="", help=f"from {', '.join(VARIANTS)}")
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--steps", type=int, default=None, help="training steps (preset's)")
    parser.add_argument("--train-args", default="",
                        help="more arguments of every training run (not the adaptation), "
                        "e.g. \"--grad-clip 1 --lr-schedule cosine\"")
    parser.add_argument("--adapt-steps", type=int, default=300)
    parser.add_argument("--lengths", default="4k,8k,16k,32k,64k")
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--eval-batch", type=int, default=1,
                        help="samples of a task and length generated together (openmsa eval "
                        "--batch)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--only-variants", action="store_true",
                        help="train and evaluate the variants' MSA models alone (no dense, MSA "
                        "or adapted model: their evaluations come from --merge)")
    parser.add_argument("--merge", default="",
                        help="comma-separated study.json files of earlier calls (same preset "
                        "and --samples) whose evaluations the report joins to this run's")
    args = parser.parse_args()
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.train_args = shlex.split(args.train_args)
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: expected names from {', '.join(VARIANTS)}, received "
                         f"{', '.join(unknown)}")
    args.merge = [path for path in args.merge.split(",") if path]
    missing = [path for path in args.merge if not os.path.exists(path)]
    if missing:
        raise SystemExit(f"--merge: no file {', '.join(missing)}")
    if args.only_variants and not args.variants:
        raise SystemExit("--only-variants: name the variants with --variants")
    args.device_args = ["--device", args.device] if args.device else []
    stages = args.stages.split(",")
    for stage, jobs in (("train", _jobs_train), ("adapt", _jobs_adapt), ("eval", _jobs_eval)):
        if stage in stages:
            run_jobs(jobs(args), args.parallel, stage)
    if "report" in stages:
        report(args)


if __name__ == "__main__":
    main()
