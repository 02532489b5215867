"""The ``openmsa eval`` command: arguments, progress, outputs."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict

import torch

from ..bench.run import parse_length
from ..arguments import DTYPES, parse_device
from .tasks import TASKS

# Defaults; an openmsa train checkpoint's own MSA options come before them, and the CPU smoke
# setting's (its model has 64-token blocks) replace them.
DEFAULTS = dict(lengths="4k,8k,16k", samples=8, top_k=16, block_size=128, num_local_blocks=1,
                local_block_dilation=1, num_sink_blocks=0, index_precision="input",
                share_index_every=1)
SMOKE = dict(DEFAULTS, lengths="512,1024", samples=1, top_k=2, block_size=64)
# Each sample's records, appended as they finish (the first line: the run's settings), so that
# an interrupted run keeps what it did and ``--resume`` goes on from there.
SAMPLES_FILE = "samples.jsonl"
MSA_OPTIONS = ("top_k", "block_size", "num_local_blocks", "local_block_dilation",
               "num_sink_blocks", "index_precision", "share_index_every")


def _lengths(text: str) -> tuple[int, ...]:
    lengths = tuple(parse_length(part) for part in text.split(","))
    for length in lengths:
        if length < 256:
            raise argparse.ArgumentTypeError(f"expected lengths of at least 256 tokens, "
                                             f"received {length}")
    return lengths


def _tasks(text: str) -> tuple[str, ...]:
    tasks = tuple(part.strip() for part in text.split(","))
    unknown = [task for task in tasks if task not in TASKS]
    if unknown:
        raise argparse.ArgumentTypeError(f"expected tasks from {', '.join(TASKS)}, received "
                                         f"{', '.join(unknown)}")
    return tasks


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="PATH",
                        help="a local Hugging Face causal LM folder (Llama or Qwen3), with its "
                        "tokenizer; converted to MSA with the options below")
    source.add_argument("--smoke", action="store_true",
                        help="a tiny random Llama on the tasks' word-level tokenizer (CPU "
                        "smoke setting: the pipeline, not a quality figure)")
    parser.add_argument("--tasks", type=_tasks, default=TASKS,
                        help=f"comma-separated, from {', '.join(TASKS)} (default: all)")
    for name, kind, text in (("lengths", _lengths, "prompt lengths in tokens"),
                             ("samples", int, "samples per task and length"),
                             ("top-k", int, "kept blocks per query and index head"),
                             ("block-size", int, "tokens per key block")):
        key = name.replace("-", "_")
        own = "a checkpoint's own, else " if key in MSA_OPTIONS else ""
        parser.add_argument(f"--{name}", type=kind, help=f"{text} (default: {own}"
                            f"{DEFAULTS[key]}; smoke: {SMOKE[key]})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the samples")
    parser.add_argument("--batch", type=int, default=1,
                        help="samples of a task and length generated together (default 1; "
                        "more is faster on a GPU; a shorter prompt of a batch gets a few "
                        "filler tokens after [BOS], recorded per sample as inserted_tokens)")
    for name, kind, text in (("num-local-blocks", int, "forced local blocks"),
                             ("local-block-dilation", int, "their spacing"),
                             ("num-sink-blocks", int, "forced first blocks"),
                             ("share-index-every", int, "layers 0, N, 2N, ... select")):
        parser.add_argument(f"--{name}", type=kind, help=f"{text} (default: a checkpoint's "
                            f"own, else {DEFAULTS[name.replace('-', '_')]})")
    parser.add_argument("--index-precision", choices=("input", "fp8"),
                        help="selection scores (default: a checkpoint's own, else input)")
    parser.add_argument("--device", type=parse_device,
                        help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--dtype", choices=sorted(DTYPES),
                        help="the model's dtype (default: bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--out", default="runs/eval", help="folder for eval.json and the plot")
    parser.add_argument("--resume", action="store_true",
                        help=f"take the finished samples of an interrupted run from OUT/"
                        f"{SAMPLES_FILE} (its settings must equal these) and run the rest")


def _progress():
    interactive = sys.stdout.isatty()
    start = time.perf_counter()

    def show(done, total, result):
        elapsed = time.perf_counter() - start
        eta = elapsed / done * (total - done)
        line = (f"[{done}/{total}] {elapsed:.0f}s elapsed, ETA {eta:.0f}s: {result['task']} "
                f"{result['length']} {result['mode']} score {result['score']:.2f}, answer tokens "
                f"{result['token_accuracy']:.2f}")
        if interactive:
            print(f"\r{line:<100}", end="\n" if done == total else "", flush=True)
        else:
            print(line, flush=True)
    return show


def read_samples_file(path: str) -> tuple[dict, list[dict]]:
    """The settings and the records of ``path`` (a run's samples file, perhaps cut short); a
    last line cut mid-write is dropped."""
    with open(path) as handle:
        lines = handle.read().split("\n")
    try:
        settings = json.loads(lines[0])["settings"]
    except (ValueError, KeyError, TypeError):
        raise SystemExit(f"openmsa eval: {path} does not start with a settings line")
    records = []
    for number, line in enumerate(lines[1:], 2):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError:
            if number < len(lines):  # only a last line with no newline can be cut mid-write
                raise SystemExit(f"openmsa eval: {path} line {number} is not JSON")
    return settings, records


def _read_samples(path: str, header: dict) -> list[dict]:
    """The records of ``path``, an interrupted run's samples file, whose settings must be
    ``header``."""
    written, records = read_samples_file(path)
    if written != header:
        differ = sorted(key for key in set(written) | set(header)
                        if written.get(key) != header.get(key))
        raise SystemExit(f"openmsa eval: --resume: {path} was written with other settings "
                         f"({', '.join(differ)} differ); run without --resume to start again")
    return records


def run(args) -> int:
    from .report import plot, print_table, write_json
    from .run import (EvalSettings, checkpoint_msa_options, evaluate, finished_records,
                      load_model, smoke_model, summarize)

    if args.model is not None and not os.path.isdir(args.model):
        raise SystemExit(f"openmsa eval: --model: expected a local Hugging Face model folder, "
                         f"received {args.model!r} (no such folder)")
    device = args.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES[args.dtype] if args.dtype else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    defaults = SMOKE if args.smoke else dict(DEFAULTS, **checkpoint_msa_options(args.model))

    def chosen(key):
        value = getattr(args, key)
        return value if value is not None else defaults[key]

    lengths = chosen("lengths")
    settings = EvalSettings(tasks=args.tasks,
                            lengths=_lengths(lengths) if isinstance(lengths, str) else lengths,
                            samples=chosen("samples"), seed=args.seed, batch=args.batch)
    if settings.samples < 1:
        raise ValueError(f"samples: expected an int >= 1, received {settings.samples}")
    if settings.batch < 1:
        raise SystemExit(f"openmsa eval: --batch: expected an int >= 1, received "
                         f"{settings.batch}")
    # The reference on a CPU: the Triton interpreter would run the kernels for minutes.
    backend = "reference" if device.type == "cpu" else "auto"
    msa_options = dict({key: chosen(key) for key in MSA_OPTIONS}, backend=backend)
    if args.smoke:
        model, tokenizer = smoke_model(msa_options, seed=args.seed)
        model = model.to(device=device, dtype=dtype)
        name = "smoke (tiny random Llama)"
    else:
        model, tokenizer = load_model(args.model, device, dtype, msa_options)
        name = args.model
    print(f"openmsa eval: {name} on {device} ({dtype}), tasks {', '.join(settings.tasks)}, "
          f"lengths {', '.join(map(str, settings.lengths))}, {settings.samples} samples each "
          f"({settings.batch} at a time), "
          f"dense and MSA attention with the same weights", flush=True)
    header = json.loads(json.dumps(dict(asdict(settings), model=name, device=str(device),
                                        dtype=str(dtype), msa_options=msa_options)))
    os.makedirs(args.out, exist_ok=True)
    samples_path = os.path.join(args.out, SAMPLES_FILE)
    earlier = []
    if args.resume and os.path.exists(samples_path):
        earlier = finished_records(settings, _read_samples(samples_path, header))
        print(f"resuming: {len(earlier)} finished records from {samples_path}", flush=True)
    with open(samples_path, "w") as handle:
        # Rewritten whole first: the earlier records, then each group's as it finishes.
        handle.write(json.dumps({"settings": header}) + "\n")

        def append(records):
            for record in records:
                handle.write(json.dumps(record) + "\n")
            handle.flush()

        append(earlier)
        results = evaluate(model, tokenizer, settings, device, _progress(), earlier, append)
    rows = summarize(results)
    print()
    print_table(rows)
    write_json(os.path.join(args.out, "eval.json"), header, rows, results)
    picture = plot(rows, os.path.join(args.out, "accuracy.png"), f"openmsa eval: {name}")
    print(f"wrote {os.path.join(args.out, 'eval.json')}" + (f", {picture}" if picture else ""))
    return 0
