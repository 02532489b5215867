"""openmsa: training kernels for MiniMax Sparse Attention (MSA), and tools around them."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

from .arguments import DTYPES, parse_device
from .ops.interpreter import INTERPRETING
from .ops.msa import msa_attention
from .ops.quantize import INDEX_PRECISIONS
from .testing import QUANTITY_NAMES, TOLERANCE, MSACase, compare_with_reference
from .train.lm import LR_SCHEDULES

# Small enough for a 2-core CPU in seconds; they cover GQA, index-key GQA, partial last blocks,
# packed input, forced local/sink blocks and warmup.
CPU_CASES = (
    MSACase("gqa", batch=2, seqlen=300, num_heads=4, num_kv_heads=2, num_index_heads=2,
            options=dict(top_k=2, block_size=64)),
    MSACase("packed", seqlens=(70, 200, 1, 129), num_heads=8, num_kv_heads=2, num_index_heads=4,
            num_index_kv_heads=2, options=dict(top_k=4, block_size=64, num_local_blocks=2,
                                               local_block_dilation=2, num_sink_blocks=1)),
    MSACase("warmup", batch=1, seqlen=200, num_heads=4, num_kv_heads=1, num_index_heads=2,
            options=dict(block_size=64, warmup=True)),
    MSACase("fp8 index", batch=1, seqlen=300, num_heads=4, num_kv_heads=2, num_index_heads=2,
            options=dict(top_k=3, block_size=64, index_precision="fp8")),
)
GPU_CASES = (
    MSACase("gqa", batch=2, seqlen=1000, num_heads=8, num_kv_heads=2, num_index_heads=2,
            head_dim=128, index_head_dim=128, options=dict(top_k=4, block_size=128)),
    MSACase("packed", seqlens=(700, 1500, 1, 333), num_heads=16, num_kv_heads=2,
            num_index_heads=4, head_dim=128, index_head_dim=128,
            options=dict(top_k=4, block_size=64, num_local_blocks=2, local_block_dilation=2,
                         num_sink_blocks=1)),
    MSACase("paper", batch=1, seqlen=4096, num_heads=16, num_kv_heads=2, num_index_heads=4,
            head_dim=128, index_head_dim=128, options=dict(top_k=16, block_size=128)),
    MSACase("warmup", batch=1, seqlen=2048, num_heads=8, num_kv_heads=2, num_index_heads=2,
            head_dim=128, index_head_dim=128, options=dict(block_size=128, warmup=True)),
    MSACase("paper fp8 index", batch=1, seqlen=4096, num_heads=16, num_kv_heads=2,
            num_index_heads=4, head_dim=128, index_head_dim=128,
            options=dict(top_k=16, block_size=128, index_precision="fp8")),
)
EXAMPLES = """examples:
  openmsa train                       MSA against dense on a retrieval task (~3 min, 2-core CPU)
  openmsa train --preset gpu          the same at 16k tokens on the Triton kernels (GPU)
  openmsa check                       the kernels against the reference (interpreted on a CPU)
  openmsa bench --seqlens 32k,128k    one layer's step against dense attention (GPU)
  openmsa eval --smoke                long-context tasks, dense against MSA (CPU smoke setting)
  openmsa eval --model DIR            the same tasks on a local Hugging Face Llama / Qwen3

Run "openmsa COMMAND --help" for a command's options.
"""


class HelpFormatter(argparse.HelpFormatter):
    """Shows each option's default where it has one."""

    def _get_help_string(self, action):
        text = action.help or ""
        shown = action.default is not None and action.default is not False
        if shown and action.default != argparse.SUPPRESS and "default" not in text:
            text += " (default: %(default)s)"
        return text


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _check(args) -> int:
    device = args.device or _default_device()
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    backend = args.backend
    if device.type == "cpu" and backend == "auto":
        backend = "triton"  # "auto" would run the reference on CPU tensors: nothing to check
    if device.type == "cpu" and backend == "triton":
        if dtype == torch.bfloat16:
            print("openmsa check: bfloat16 is computed wrongly by Triton's CPU interpreter; "
                  "use --dtype float32 or float16 on a CPU", file=sys.stderr)
            return 2
        if not INTERPRETING:  # Triton reads TRITON_INTERPRET once, at import: start anew
            print("openmsa check: running the Triton kernels under Triton's CPU interpreter "
                  "(TRITON_INTERPRET=1, in a new process)", flush=True)
            command = [sys.executable, "-m", "openmsa", "check", "--device", "cpu",
                       "--dtype", args.dtype or "float32", "--backend", "triton",
                       "--seed", str(args.seed)]
            env = dict(os.environ, TRITON_INTERPRET="1")
            return subprocess.run(command, env=env).returncode
    cases = GPU_CASES if device.type == "cuda" else CPU_CASES

    def run(*tensors, **options):
        return msa_attention(*tensors, backend=backend, **options)

    if backend == "reference":
        compared = ("the eager reference (no kernels) against itself in float64: a check of "
                    "the comparison, not of the kernels")
    elif device.type == "cpu":
        compared = "the Triton kernels, interpreted on the CPU, against the reference in float64"
    else:
        compared = "the kernels on the GPU against the reference in float32"
    header = ["case", "shape", "top_k", "sel. agree"] + list(QUANTITY_NAMES) + ["result"]
    rows, failures = [], 0
    print(f"openmsa check: device={device} dtype={str(dtype).replace('torch.', '')} "
          f"backend={backend}: {compared}; errors are relative RMS")
    for case in cases:
        start = time.perf_counter()
        comparison = compare_with_reference(run, case, dtype, device, seed=args.seed)
        passed = comparison.passed(TOLERANCE[dtype])
        failures += not passed
        agreement = comparison.selection_agreement
        rows.append([case.name, case.shape_label(),
                     "all" if case.options.get("warmup") else str(case.options["top_k"]),
                     "-" if agreement is None else f"{100 * agreement:.1f}%"]
                    + [f"{comparison.errors[name]:.1e}" for name in QUANTITY_NAMES]
                    + [f"{'PASS' if passed else 'FAIL'} ({time.perf_counter() - start:.1f}s)"])
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    for row in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)))
    print(f"{len(rows) - failures} passed, {failures} failed")
    return 1 if failures else 0


def add_local_block_arguments(parser: argparse.ArgumentParser) -> None:
    """The forced local window of the MSA model (SPEC section 3 step 3), for train and bench."""
    parser.add_argument("--num-local-blocks", type=positive_int, default=1, metavar="L",
                        help="the own block and L - 1 blocks before it are always kept")
    parser.add_argument("--local-block-dilation", type=positive_int, default=1, metavar="D",
                        help="those blocks' spacing: blk(i) - D, blk(i) - 2D, ... (1: contiguous)")


def _bench(args) -> int:
    from .bench.run import run

    return run(args)


def _eval(args) -> int:
    from .eval.command import run

    return run(args)


def _lm_models(text: str) -> tuple[str, ...]:
    models = tuple(part.strip() for part in text.split(","))
    if not models or any(model not in ("dense", "msa") for model in models):
        raise argparse.ArgumentTypeError(f"expected dense, msa or dense,msa, received {text!r}")
    return models


def _train(args) -> int:
    from .train.run import run

    if args.adapt_index and not args.preset.startswith("ruler"):
        raise SystemExit("openmsa train: --adapt-index needs a ruler-* preset (its tasks, "
                         f"length and MSA options), received --preset {args.preset}")
    if args.share_index_kl and args.share_index_every == 1:
        raise SystemExit("openmsa train: --share-index-kl needs --share-index-every N > 1 "
                         "(with 1 every layer has its own index branch)")
    if args.data_workers is not None and args.data_workers < 0:
        raise SystemExit(f"openmsa train: --data-workers: expected 0 or more, received "
                         f"{args.data_workers}")
    optimizer = {key: value for key, value in (("lr", args.lr), ("grad_clip", args.grad_clip),
                                               ("lr_schedule", args.lr_schedule),
                                               ("lr_warmup", args.lr_warmup))
                 if value is not None}
    if optimizer and (not args.preset.startswith("ruler") or args.adapt_index):
        flags = ", ".join("--" + key.replace("_", "-") for key in optimizer)
        raise SystemExit(f"openmsa train: {flags}: only for training a ruler-* preset's models "
                         f"(not --preset {args.preset}" + (" with --adapt-index)"
                                                            if args.adapt_index else ")"))
    if args.preset.startswith("ruler"):
        from .train.lm import LM_PRESETS, adapt_index_branch, run_lm, scaled_preset

        options = dict(index_precision=args.index_precision,
                       share_index_every=args.share_index_every,
                       share_index_kl=args.share_index_kl,
                       num_local_blocks=args.num_local_blocks,
                       local_block_dilation=args.local_block_dilation)
        if args.adapt_index:
            adapt_index_branch(args.adapt_index, args.out, args.preset, args.steps or 100,
                               device=args.device, seed=args.seed, msa_options=options,
                               workers=args.data_workers)
        else:
            try:
                scaled_preset(LM_PRESETS[args.preset], args.steps, optimizer)
            except ValueError as error:  # named as its flag
                raise SystemExit(f"openmsa train: --{str(error).replace('_', '-', 1)}")
            run_lm(args.preset, args.out, device=args.device, seed=args.seed,
                   msa_options=options, layers=args.layers, steps=args.steps,
                   workers=args.data_workers, models=args.models, optimizer=optimizer)
        return 0
    run(args.preset, args.out, device=args.device, seed=args.seed, steps=args.steps,
        index_precision=args.index_precision, layers=args.layers,
        share_index_every=args.share_index_every, share_index_kl=args.share_index_kl,
        num_local_blocks=args.num_local_blocks, local_block_dilation=args.local_block_dilation)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="openmsa", description=__doc__, epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = commands.add_parser(
        "train", formatter_class=HelpFormatter,
        help="train an MSA model and a dense one on a long-context retrieval task",
        description="Train an MSA model and a dense one side by side on a synthetic retrieval "
        "task; write metrics.json, metrics.csv and curves.png to --out.")
    train.add_argument("--preset", default="cpu",
                       choices=("cpu", "gpu", "tiny", "ruler-cpu", "ruler-gpu", "ruler-tiny"),
                       help="cpu: a few minutes on 2 cores; gpu: 16k tokens with the Triton "
                       "kernels; tiny: a smoke test; ruler-*: 4-layer causal LMs on openmsa "
                       "eval's tasks, written as checkpoints openmsa eval --model reads")
    train.add_argument("--out", default="runs/train", help="folder for metrics and the plot")
    train.add_argument("--device", type=parse_device,
                       help="cpu or cuda (default: cuda if available)")
    train.add_argument("--seed", type=int, default=0, help="seed of weights and data")
    train.add_argument("--steps", type=positive_int,
                       help="total steps instead of the preset's; its warmup, curriculum and "
                       "evaluation interval scale along")
    train.add_argument("--index-precision", default="input", choices=INDEX_PRECISIONS,
                       help="the MSA model's selection scores: input (its autocast dtype) or "
                       "fp8 (e4m3 with a scale per row; GPU of compute capability 8.9 on)")
    train.add_argument("--layers", type=positive_int, default=None,
                       help="attention blocks of both models instead of the preset's")
    train.add_argument("--share-index-every", type=positive_int, default=1, metavar="N",
                       help="MSA layers 0, N, 2N, ... select blocks, the others reuse the "
                       "selection of the one before them (default 1: every layer selects)")
    train.add_argument("--share-index-kl", action="store_true",
                       help="with --share-index-every N > 1: the sharing layers' attention "
                       "also teaches the index branch they read (a KL over their kept tokens)")
    train.add_argument("--adapt-index", metavar="DIR",
                       help="ruler-* presets: convert the dense checkpoint DIR, freeze its "
                       "weights and train only the index branch by the KL (--steps, default "
                       "100), into OUT/adapted")
    train.add_argument("--models", type=_lm_models, default=("dense", "msa"),
                       help="ruler-* presets: which models to train, dense, msa or dense,msa "
                       "(default: both, one after the other)")
    train.add_argument("--lr", type=float, default=None,
                       help="ruler-* presets: the learning rate instead of the preset's")
    train.add_argument("--grad-clip", type=float, default=None, metavar="NORM",
                       help="ruler-* presets: clip the gradients to this global norm (default: "
                       "the preset's)")
    train.add_argument("--lr-schedule", choices=LR_SCHEDULES, default=None,
                       help="ruler-* presets: after the warmup, a constant learning rate or a "
                       "cosine down to a tenth of it at the last step (default: the preset's)")
    train.add_argument("--lr-warmup", type=int, default=None, metavar="STEPS",
                       help="ruler-* presets: steps of linear learning-rate warmup (default: "
                       "the preset's)")
    train.add_argument("--data-workers", type=int, default=None, metavar="N",
                       help="ruler-* presets: processes that generate the batches ahead of the "
                       "steps (default: none on a CPU, half the cores up to 8 on a GPU; 0: in "
                       "the step loop)")
    add_local_block_arguments(train)
    train.set_defaults(handler=_train)
    bench = commands.add_parser(
        "bench", formatter_class=HelpFormatter,
        help="time MSA against dense SDPA and FlexAttention on a CUDA GPU",
        description="Time one MSA attention layer (forward, backward, its parts) against "
        "dense SDPA and FlexAttention in the same run, on a CUDA GPU.")
    from .bench.run import add_arguments

    add_arguments(bench)
    add_local_block_arguments(bench)
    bench.set_defaults(handler=_bench)
    evaluation = commands.add_parser(
        "eval", formatter_class=HelpFormatter,
        help="RULER-style long-context tasks on a model in dense and in MSA attention",
        description="Generate RULER-style tasks (needle retrieval with one and several keys, "
        "values and queries; variable tracking; common-word aggregation) at chosen lengths and "
        "score a causal LM on them in dense and in MSA attention with the same weights "
        "(answers generated through the cache path); write eval.json and accuracy.png.")
    from .eval.command import add_arguments as add_eval_arguments

    add_eval_arguments(evaluation)
    evaluation.set_defaults(handler=_eval)
    check = commands.add_parser(
        "check", formatter_class=HelpFormatter,
        help="compare msa_attention's kernels with the reference on random inputs",
        description="Run msa_attention on random inputs and compare its output, KL, selection "
        "and five gradients with the eager reference. On a CPU the Triton kernels run under "
        "Triton's interpreter (TRITON_INTERPRET=1).")
    check.add_argument("--device", type=parse_device,
                       help="cpu or cuda (default: cuda if available)")
    check.add_argument("--dtype", choices=sorted(DTYPES),
                       help="default: bfloat16 on cuda, float32 on cpu")
    check.add_argument("--backend", default="auto", choices=("auto", "triton", "reference"),
                       help="auto: the kernels (interpreted on a CPU); reference: the "
                       "reference against itself")
    check.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    check.set_defaults(handler=_check)
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
