"""Compiles the attention kernels (Triton's and the Hopper ones in Gluon) for an H100/H200
(sm_90a) on any machine, GPU or not, and prints each launch configuration's shared memory,
registers and register spills.

    python benchmarks/inspect_kernels.py [--stages 1 2] [--keep DIR] [--kernels LABEL ...]

A configuration that needs more than 227 KiB of shared memory cannot launch on the H200; one that
spills registers inside the block loop is usually slow. This is how the stage counts in
``openmsa/ops/configs.py`` were chosen without spending GPU time. The shapes are the paper's:
H = 64, Hi = 4 (16 heads per token), D = Di = 128, block 128, top_k 16, bf16. Uses Triton's
compiler and its bundled ptxas; nothing runs.
"""

from __future__ import annotations

import argparse
import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from openmsa.ops.attention.backward import _sparse_attn_dkdv_kernel, _sparse_attn_dq_kernel
from openmsa.ops.attention.forward import _sparse_attn_fwd_kernel
from openmsa.ops.configs import DEFAULT_TUNING, KL_TEACHER_PAIRS
from openmsa.ops.kl.kernels import _kl_kernel, _kl_query_kernel

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # tools/ beside the package
from tools.sm90_compile import compile_for_sm90, ptxas_report as sm90_ptxas_report  # noqa: E402

SEGMENT_PAIRS = DEFAULT_TUNING.segment_pairs

SHARED_MEMORY_LIMIT = 227 * 1024  # per block on the H100/H200
FLOAT_ARGS = {"scale", "scale_log2", "index_scale"}
INT_POINTERS = {"SCHEDULE", "UNION", "UNION_COUNT", "CU_SEQLENS", "SEGMENTS",
                "SEGMENT_ORDER", "PAIR_TOKEN", "BUCKET_START", "BUCKET_COUNT", "BLOCK_SEQUENCE",
                "BLOCK_LOCAL", "SEGMENT_HARD"}
INPUT_POINTERS = {"Q", "K", "V", "IQ", "IK", "DOUT", "OUT", "DQ"}


def signature(fn, constants):
    """Argument types as the launcher would specialize them for bf16 inputs."""
    types = {}
    for name in fn.arg_names:
        if name in constants:
            types[name] = "constexpr"
        elif name in INPUT_POINTERS:
            types[name] = "*bf16"
        elif name in INT_POINTERS:
            types[name] = "*i32"
        elif name == "UNION_MEMBERS":
            types[name] = "*i64"
        elif name == "HARD":  # int8 flags per (token, index head) (key_outer.hard_rows)
            types[name] = "*i8"
        elif name == "TEACHER":  # fp16 for 16-bit inputs (kl.new_teacher)
            types[name] = "*fp16"
        elif name.isupper():
            types[name] = "*fp32"
        elif name in FLOAT_ARGS:
            types[name] = "fp32"
        else:
            types[name] = "i32"
    # Pointers and strides of real inputs are multiples of 16, which the launcher detects and
    # which decides whether loads can be asynchronous copies (pipelined).
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
               if types[name].startswith("*") or name.startswith("stride")}
    return types, aligned


def inspect(fn, constants, num_warps, num_stages, keep=None):
    # Constexprs left out take their defaults, as at a launch that does not pass them.
    constants = {**{param.name: param.default for param in fn.params
                    if param.is_constexpr and param.has_default}, **constants}
    types, aligned = signature(fn, constants)
    source = ASTSource(fn=fn, signature=types, constexprs=constants, attrs=aligned)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages))
    # ptxas says when it had to serialize the asynchronous MMAs (wgmma): a slow loop.
    return ptxas_report(kernel, f"{fn.__name__}_w{num_warps}_s{num_stages}", keep)


def ptxas_report(kernel, name, keep=None):
    """Shared memory, registers, spills and serialization of a compiled kernel; its PTX is
    kept in ``keep`` as ``name``.ptx when given."""
    ptx = kernel.asm["ptx"]
    if keep:
        with open(os.path.join(keep, f"{name}.ptx"), "w") as handle:
            handle.write(ptx)
    found = sm90_ptxas_report(ptx)
    return dict(shared=kernel.metadata.shared, registers=found["registers"],
                spill_bytes=found["spill_bytes"], serialized=found["serialized"],
                warps=kernel.metadata.num_warps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--keep", help="keep the PTX files in this folder")
    parser.add_argument("--kernels", nargs="+", metavar="LABEL",
                        help="only these rows (labels as printed, e.g. forward 'Hopper kl')")
    args = parser.parse_args()
    shared = dict(HI=4, GQ=16, GQ_PAD=16, KV_GROUP=1, INDEX_GROUP=4, BLOCK=128, HEAD_DIM=128,
                  INDEX_DIM=128, PRECISION="tf32")
    query = dict(shared, TOK=8, TOKP=16, ROWS=128, UNION_SLOTS=128)
    kernels = [
        ("forward", _sparse_attn_fwd_kernel,
         dict(query, WITH_MAIN=True, WITH_INDEX=False, INDEX_MAX_GIVEN=False)),
        ("forward + index lse", _sparse_attn_fwd_kernel,
         dict(query, WITH_MAIN=True, WITH_INDEX=True, INDEX_MAX_GIVEN=False)),
        ("forward + index, max given", _sparse_attn_fwd_kernel,
         dict(query, WITH_MAIN=True, WITH_INDEX=True, INDEX_MAX_GIVEN=True)),
        ("index lse alone", _sparse_attn_fwd_kernel,
         dict(query, WITH_MAIN=False, WITH_INDEX=True, INDEX_MAX_GIVEN=True)),
        ("index lse alone, running max", _sparse_attn_fwd_kernel,
         dict(query, WITH_MAIN=False, WITH_INDEX=True, INDEX_MAX_GIVEN=False)),
        ("dQ", _sparse_attn_dq_kernel, query),
        ("dK/dV", _sparse_attn_dkdv_kernel,
         dict(shared, TOK=4, TOKP=16, ROWS=64, SEGMENT_PAIRS=SEGMENT_PAIRS)),
        ("dK/dV + atomic dQ, 32 rows", _sparse_attn_dkdv_kernel,
         dict(shared, TOK=2, TOKP=16, ROWS=32, SEGMENT_PAIRS=SEGMENT_PAIRS, ATOMIC_DQ=True)),
        ("dK/dV + hard rows' dQ", _sparse_attn_dkdv_kernel,
         dict(shared, TOK=2, TOKP=16, ROWS=32, SEGMENT_PAIRS=SEGMENT_PAIRS, ATOMIC_DQ=True,
              SEGMENTS_RUN=2, HARD_ROWS_DQ=True)),
        ("dK/dV + KL teacher", _sparse_attn_dkdv_kernel,
         dict(shared, TOK=4, TOKP=16, ROWS=64, SEGMENT_PAIRS=SEGMENT_PAIRS,
              STORE_TEACHER=True)),
        ("dK/dV + atomic dQ + teacher", _sparse_attn_dkdv_kernel,
         dict(shared, TOK=2, TOKP=16, ROWS=32, SEGMENT_PAIRS=SEGMENT_PAIRS, ATOMIC_DQ=True,
              STORE_TEACHER=True)),
        ("KL query side", _kl_query_kernel,
         dict(query, WITH_VALUE=True, WITH_GRAD=True)),
    ]
    kl = {name: shared[name] for name in ("HI", "GQ", "KV_GROUP", "INDEX_GROUP", "BLOCK",
                                           "HEAD_DIM", "INDEX_DIM", "PRECISION")}
    for pairs in (32, 64, 128):
        kernels.append((f"KL one pass, {pairs} pairs", _kl_kernel,
                        dict(kl, PAIRS=pairs, SEGMENT_PAIRS=SEGMENT_PAIRS, QUERY_SIDE=True,
                             WITH_VALUE=True)))
    kernels.append(("KL from stored teachers", _kl_kernel,
                    dict(kl, PAIRS=KL_TEACHER_PAIRS, SEGMENT_PAIRS=SEGMENT_PAIRS,
                         QUERY_SIDE=True, WITH_VALUE=False, TEACHER_GIVEN=True)))
    kernels.append(("KL key side (ordered)", _kl_kernel,
                    dict(kl, PAIRS=64, SEGMENT_PAIRS=SEGMENT_PAIRS, QUERY_SIDE=False,
                         WITH_VALUE=False)))
    hopper = [f"Hopper {kernel}" for kernel in ("forward", "dq", "dkdv", "dkdv-skip", "kl")]
    labels = [label for label, _, _ in kernels] + hopper
    unknown = sorted(set(args.kernels or ()) - set(labels))
    if unknown:
        parser.error(f"--kernels: expected labels from {labels}, received {unknown}")
    wanted = set(args.kernels or labels)
    print(f"{'kernel':<26} {'warps':>5} {'stages':>6} {'shared KiB':>10} {'registers':>9} "
          f"{'spill B':>7}  fits  wgmma")
    for label, fn, constants in kernels:
        if label not in wanted:
            continue
        for num_stages in args.stages:
            found = inspect(fn, constants, 8, num_stages, args.keep)
            fits = "yes" if found["shared"] <= SHARED_MEMORY_LIMIT else "NO"
            print(f"{label:<26} {8:>5} {num_stages:>6} {found['shared'] / 1024:>10.1f} "
                  f"{found['registers']:>9} {found['spill_bytes']:>7}  {fits:<4}  "
                  f"{'serialized' if found['serialized'] else 'async'}", flush=True)
    # The Hopper (Gluon) kernels: their pipelining is written out, so stages do not apply. The
    # warp-specialized dK/dV's registers are its launch limit, redistributed among its warps.
    for kernel in ("forward", "dq", "dkdv", "dkdv-skip", "kl"):
        if f"Hopper {kernel}" not in wanted:
            continue
        found = ptxas_report(compile_for_sm90(128, 128, "bf16", kernel=kernel),
                             f"hopper_{kernel}", args.keep)
        fits = "yes" if found["shared"] <= SHARED_MEMORY_LIMIT else "NO"
        print(f"{'Hopper ' + kernel:<26} {found['warps']:>5} {'-':>6} "
              f"{found['shared'] / 1024:>10.1f} "
              f"{found['registers']:>9} {found['spill_bytes']:>7}  {fits:<4}  "
              f"{'serialized' if found['serialized'] else 'async'}", flush=True)


if __name__ == "__main__":
    main()
