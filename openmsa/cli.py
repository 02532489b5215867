"""The ``openmsa`` command line."""

from __future__ import annotations

import argparse
import sys
import time

import torch

from .ops.msa import msa_attention
from .testing import QUANTITY_NAMES, MSACase, compare_with_reference

# Small enough for a 2-core CPU in seconds; they cover GQA, index-key GQA, partial last blocks,
# packed input, forced local/sink blocks and warmup.
CPU_CASES = (
    MSACase("gqa", batch=2, seqlen=300, num_heads=4, num_kv_heads=2, num_index_heads=2,
            options=dict(top_k=2, block_size=64)),
    MSACase("packed", seqlens=(70, 200, 1, 129), num_heads=8, num_kv_heads=2, num_index_heads=4,
            num_index_kv_heads=2, options=dict(top_k=3, block_size=64, num_local_blocks=2,
                                               num_sink_blocks=1)),
    MSACase("warmup", batch=1, seqlen=200, num_heads=4, num_kv_heads=1, num_index_heads=2,
            options=dict(block_size=64, warmup=True)),
)
GPU_CASES = (
    MSACase("gqa", batch=2, seqlen=1000, num_heads=8, num_kv_heads=2, num_index_heads=2,
            head_dim=128, index_head_dim=128, options=dict(top_k=4, block_size=128)),
    MSACase("packed", seqlens=(700, 1500, 1, 333), num_heads=16, num_kv_heads=2,
            num_index_heads=4, head_dim=128, index_head_dim=128,
            options=dict(top_k=4, block_size=64, num_local_blocks=2, num_sink_blocks=1)),
    MSACase("paper", batch=1, seqlen=4096, num_heads=16, num_kv_heads=2, num_index_heads=4,
            head_dim=128, index_head_dim=128, options=dict(top_k=16, block_size=128)),
    MSACase("warmup", batch=1, seqlen=2048, num_heads=8, num_kv_heads=2, num_index_heads=2,
            head_dim=128, index_head_dim=128, options=dict(block_size=128, warmup=True)),
)
# An error passes when it is at most twice the error of the reference computing in the same
# dtype, or below this floor (for quantities the two compute identically).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-3}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _check(args) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    cases = GPU_CASES if device.type == "cuda" else CPU_CASES

    def run(*tensors, **options):
        return msa_attention(*tensors, backend=args.backend, **options)

    header = ["case", "shape", "top_k", "sel. agree"] + list(QUANTITY_NAMES) + ["result"]
    rows, failures = [], 0
    print(f"openmsa check: device={device} dtype={args.dtype or dtype} backend={args.backend}; "
          "errors are relative RMS vs the reference in high precision")
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


def _bench(args) -> int:
    from .bench.run import run

    return run(args)


def _train(args) -> int:
    from .train.run import run

    run(args.preset, args.out, device=args.device, seed=args.seed, steps=args.steps)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="openmsa", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser(
        "train", help="train an MSA model and a dense one on a long-context retrieval task")
    train.add_argument("--preset", default="cpu", choices=("cpu", "gpu", "tiny"),
                       help="cpu: a few minutes on 2 cores (default); gpu: 16k tokens with the "
                       "Triton kernels; tiny: a smoke test")
    train.add_argument("--out", default="runs/train", help="folder for metrics and the plot")
    train.add_argument("--device", help="cuda or cpu (default: cuda if available)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--steps", type=int, help="override the preset's step count")
    train.set_defaults(handler=_train)
    bench = commands.add_parser(
        "bench", help="time MSA against dense SDPA and FlexAttention on this GPU")
    from .bench.run import add_arguments

    add_arguments(bench)
    bench.set_defaults(handler=_bench)
    check = commands.add_parser(
        "check", help="run msa_attention on random inputs and compare it with the reference")
    check.add_argument("--device", help="cuda or cpu (default: cuda if available)")
    check.add_argument("--dtype", choices=sorted(DTYPES),
                       help="default: bfloat16 on cuda, float32 on cpu")
    check.add_argument("--backend", default="auto", choices=("auto", "triton", "reference"))
    check.add_argument("--seed", type=int, default=0)
    check.set_defaults(handler=_check)
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
