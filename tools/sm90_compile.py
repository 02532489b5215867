"""Developer tooling: the Hopper (Gluon) kernels compiled for sm_90a on any machine, GPU or not,
and what ptxas says of them (registers, spills, whether it serialized the asynchronous
tensor-core products). Used by tests/ops/test_sm90.py and benchmarks/inspect_kernels.py.

    python tools/sm90_compile.py [forward|dq|dkdv|dkdv-skip|kl] [HEAD_DIM BLOCK DTYPE HEADS]
    python tools/sm90_compile.py select [input|fp8] [TILE_ROWS WARPS STAGES IMPRECISE_ACC|none]
    python tools/sm90_compile.py key-outer [forward|dq|dkdv|dkdv-atomic-dq|dkdv-hard-atomic-dq|
        kl-teacher][+teacher]
        [STAGES ...]
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

from openmsa.ops.attention.sm90_backward import (_dkdv_maxnreg, _sparse_attn_dkdv_hopper_kernel,
                                                 _sparse_attn_dq_hopper_kernel)
from openmsa.ops.attention.sm90_forward import _sparse_attn_fwd_hopper_kernel
from openmsa.ops.attention.sm90_key_outer import STEP_ROWS, _key_outer_hopper_kernel
from openmsa.ops.configs import (DQ_REGISTERS, FORWARD_REGISTERS, KEY_OUTER_HOPPER_REGISTERS,
                                 KEY_OUTER_HOPPER_STAGES, KEY_STEP_REGISTERS, KEY_STEP_STAGES,
                                 KL_STAGES)
from openmsa.ops.kl.sm90 import _kl_hopper_kernel
from openmsa.ops.sm90 import NUM_WARPS, ROWS, _maxnreg, key_step_tokens


def compile_for_sm90(head_dim: int = 128, block_size: int = 128, dtype: str = "bf16",
                     kernel: str = "forward", heads_per_token: int = 16):
    """The ``kernel`` ("forward", "dq", "dq-walk-limit": leaving long walks to the key-outer dQ,
    "dkdv", "dkdv-skip": leaving the segments another launch writes (``Tuning.dq_pass =
    "hard_atomic"``), "kl", "key-outer-forward", "key-outer-dq" or "key-outer-dq-16bit": its partials in the inputs'
    precision) compiled for sm_90a on any machine, GPU or not (nothing runs): the compiled
    kernel, whose ``asm["ptx"]`` ``ptxas_report`` reports on (benchmarks/inspect_kernels.py,
    tests/ops/test_sm90.py)."""
    element = gl.bfloat16 if dtype == "bf16" else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([block_size, head_dim], element)
    fn = {"forward": _sparse_attn_fwd_hopper_kernel, "dq": _sparse_attn_dq_hopper_kernel,
          "dq-walk-limit": _sparse_attn_dq_hopper_kernel,
          "dkdv": _sparse_attn_dkdv_hopper_kernel, "dkdv-skip": _sparse_attn_dkdv_hopper_kernel,
          "kl": _kl_hopper_kernel,
          "key-outer-forward": _key_outer_hopper_kernel,
          "key-outer-dq": _key_outer_hopper_kernel,
          "key-outer-dq-16bit": _key_outer_hopper_kernel}[kernel]
    tile_tokens = ROWS // (1 << (heads_per_token - 1).bit_length())  # 128-row query tiles
    constants = dict(HI=4, GQ=heads_per_token, KV_GROUP=1, TOK=tile_tokens, BLOCK=block_size,
                     HEAD_DIM=head_dim, UNION_SLOTS=tile_tokens * 16)
    options = dict(num_warps=NUM_WARPS)
    if kernel.startswith("dq"):  # as the backward launches it: computing the deltas
        constants.update(WRITE_DELTA=True, CONSUMER_REGS=DQ_REGISTERS[0],
                         LOADER_REGS=DQ_REGISTERS[1], WALK_LIMIT=64 if "limit" in kernel else 0)
        options = dict(num_warps=4, maxnreg=_maxnreg(3, DQ_REGISTERS))
    if kernel == "forward":  # warp-specialized (sparse_attention_fwd's launch)
        constants.update(CONSUMER_REGS=FORWARD_REGISTERS[0], LOADER_REGS=FORWARD_REGISTERS[1],
                         WALK_LIMIT=0)
        options = dict(num_warps=4, maxnreg=_maxnreg(3, FORWARD_REGISTERS))
    if kernel.startswith("dkdv"):  # 32-row steps, warp-specialized (attention_dkdv_parts')
        consumer, gather = KEY_STEP_REGISTERS
        constants = dict(HI=4, GQ=heads_per_token, KV_GROUP=1,
                         TOK=key_step_tokens(heads_per_token), BLOCK=block_size,
                         HEAD_DIM=head_dim, SEGMENT_PAIRS=2048, STAGES=KEY_STEP_STAGES,
                         CONSUMER_REGS=consumer, GATHER_REGS=gather,
                         WITH_SKIP=kernel == "dkdv-skip")
        options = dict(num_warps=4, maxnreg=_dkdv_maxnreg(block_size, KEY_STEP_REGISTERS))
    if kernel == "kl":  # with its query side and value
        constants = dict(HI=4, GQ=heads_per_token, KV_GROUP=1, INDEX_GROUP=4, PAIRS=64,
                         BLOCK=block_size, HEAD_DIM=head_dim, SEGMENT_PAIRS=2048,
                         QUERY_SIDE=True, WITH_VALUE=True, STAGES=KL_STAGES)
    if kernel.startswith("key-outer"):  # as key_outer's windows launch it
        consumer, gather = KEY_OUTER_HOPPER_REGISTERS
        constants = dict(HI=4, GQ=heads_per_token, KV_GROUP=1,
                         TOK=key_step_tokens(heads_per_token, STEP_ROWS), BLOCK=block_size,
                         HEAD_DIM=head_dim, TOP_K=16, SEGMENT_PAIRS=1024,
                         STAGES=KEY_OUTER_HOPPER_STAGES,
                         WITH_GRAD=kernel.startswith("key-outer-dq"), CONSUMER_REGS=consumer,
                         GATHER_REGS=gather)
        options = dict(num_warps=4, maxnreg=_maxnreg(3, KEY_OUTER_HOPPER_REGISTERS))
    pointers = dict(Q=f"*{dtype}", OUT=f"*{dtype}", DOUT=f"*{dtype}", DQ=f"*{dtype}",
                    LSE="*fp32", DELTA="*fp32", DK_PART="*fp32", DV_PART="*fp32",
                    UNION_MEMBERS="*i64", IQ=f"*{dtype}", LSE_INDEX="*fp32", DIK="*fp32",
                    KL_PARTS="*fp32", DIQ="*fp32", LSE_PART="*fp32",
                    OUT_PART="*fp32" if kernel == "key-outer-dq" else f"*{dtype}")
    types = {}
    for name in fn.arg_names:
        if name in constants:
            types[name] = "constexpr"
        elif name.endswith("_desc"):
            types[name] = f"tensordesc<{dtype}[{block_size}, {head_dim}],{layout!r}>"
        elif name.isupper():
            types[name] = pointers.get(name, "*i32")
        else:
            types[name] = "fp32" if name.startswith(("scale", "index_scale")) else "i32"
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
               if types[name].startswith("*") or name.startswith("stride")}
    source = GluonASTSource(fn=fn, signature=types, constexprs=constants, attrs=aligned)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def compile_select_for_sm90(index_precision: str, **config):
    """The selection kernel, as ``select_blocks_fwd`` launches it for Hi = 4, Hik = 1,
    Di = 128, blocks of 128, top 16 (with the row maximum in input precision), and for fp8
    the quantization kernel too, compiled for sm_90a: Triton's GPU compiler checks what its
    CPU interpreter lets pass (one return type per function, fp8 operands). ``config``
    overrides ``configs.SELECT_CONFIG``'s entries. Returns the compiled selection kernel."""
    from triton.compiler import ASTSource

    from openmsa.ops.configs import SELECT_CONFIG, SELECT_MAX_REGISTERS
    from openmsa.ops.quantize import _quantize_rows_kernel
    from openmsa.ops.select import _select_fwd_kernel

    def build(fn, types, constants, **options):
        types = dict(types, **{name: "constexpr" for name in constants})
        aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
                   if types[name].startswith("*") or name.startswith("stride")}
        source = ASTSource(fn=fn, signature={name: types[name] for name in fn.arg_names},
                           constexprs=constants, attrs=aligned)
        return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)

    quantized = index_precision == "fp8"
    config = dict(SELECT_CONFIG[index_precision], **config)
    element = "*fp8e4nv" if quantized else "*bf16"
    types = {name: "i32" for name in _select_fwd_kernel.arg_names}
    types.update(IQ=element, IK=element, IQ_SCALE="*fp32", IK_SCALE="*fp32", IDS="*i32",
                 ROW_MAX="*fp32", CU_SEQLENS="*i32", SCHEDULE="*i32", scale="fp32")
    constants = dict(G=4, TILE_TOKENS=config["tile_rows"] // 4, ROWS=config["tile_rows"],
                     BLOCK=128, HEAD_DIM=128, TOP_K=16, TOPK_SLOTS=16, NUM_LOCAL=1,
                     LOCAL_DILATION=1, NUM_SINK=0,
                     NEGATIVE_SCALE=False, WITH_MAX=not quantized, PRECISION="tf32",
                     QUANTIZED=quantized, IMPRECISE_ACC=config.get("imprecise_acc"))
    # As the launch: with the row maximum (input precision) registers are capped.
    capped = {} if quantized else dict(maxnreg=SELECT_MAX_REGISTERS)
    kernel = build(_select_fwd_kernel, types, constants, num_warps=config["num_warps"],
                   num_stages=config["num_stages"], **capped)
    if quantized:
        build(_quantize_rows_kernel, dict(X="*bf16", CODES="*fp8e4nv", SCALES="*fp32",
                                          num_rows="i32", stride_row="i32"),
              dict(DIM=128, ROWS=32), num_warps=4)
    return kernel


def compile_decode_for_sm90(new_tokens: int = 1, heads_per_key_head: int = 4,
                            heads_per_index_head: int = 16, pdl: bool = False):
    """The decode kernels (``ops.decode_kernels``), bf16, D = 128, blocks of 128, as
    ``msa_decode`` launches them for ``new_tokens`` new tokens a sequence, compiled for sm_90a
    (the block-score kernel in both index precisions; ``pdl``: with programmatic dependent
    launch). Returns (block scores, fp8 block scores, top blocks, attention, merge)."""
    from triton.compiler import ASTSource

    from openmsa.ops.decode_kernels import (_decode_attention_kernel,
                                            _decode_block_scores_kernel,
                                            _decode_top_blocks_kernel, _merge_partials_kernel,
                                            score_launch)

    def build(fn, types, constants, num_warps=4, num_stages=3):
        types = dict({name: "i32" for name in fn.arg_names}, **types,
                     **{name: "constexpr" for name in constants})
        aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
                   if types[name].startswith("*") or name.startswith("stride")}
        constants = dict(constants, PDL=pdl)
        types["PDL"] = "constexpr"
        source = ASTSource(fn=fn, signature={name: types[name] for name in fn.arg_names},
                           constexprs=constants, attrs=aligned)
        return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages,
                                           launch_pdl=pdl))

    rows = max(16, triton.next_power_of_2(new_tokens * heads_per_key_head))
    scores = []
    for fp8 in (False, True):
        launch = score_launch(rows, fp8)
        scores.append(build(
            _decode_block_scores_kernel,
            dict(IQ="*bf16", IKC="*bf16", LENGTHS="*i32", SCORES="*fp32", scale="fp32"),
            dict(NEW=new_tokens, G=heads_per_key_head, ROWS=rows, BLOCK=128, HEAD_DIM=128,
                 BLOCKS_PER_PROGRAM=launch.pop("blocks_per_program"), NEGATIVE_SCALE=False,
                 FP8=fp8, PRECISION="tf32"), **launch))
    top_blocks = build(_decode_top_blocks_kernel, dict(SCORES="*fp32", LENGTHS="*i32",
                                                       IDS="*i32"),
                       dict(NEW=new_tokens, BLOCK=128, TOP_K=16, NUM_LOCAL=1, LOCAL_DILATION=1,
                            NUM_SINK=0, BLOCKS_POW2=8192), num_warps=16)
    attention = build(_decode_attention_kernel,
                      dict(Q="*bf16", KC="*bf16", VC="*bf16", IDS="*i32", LENGTHS="*i32",
                           MAXES="*fp32", SUMS="*fp32", ACCS="*fp32", scale_log2="fp32"),
                      dict(NEW=new_tokens, GQ=heads_per_index_head,
                           ROWS=max(16, triton.next_power_of_2(heads_per_index_head)),
                           KV_GROUP=1, NUM_HEADS=4 * heads_per_index_head, SLOTS=16, BLOCK=128,
                           HEAD_DIM=128, PRECISION="tf32"))
    merge = build(_merge_partials_kernel, dict(MAXES="*fp32", SUMS="*fp32", ACCS="*fp32",
                                               OUT="*bf16"),
                  dict(SLOTS=16, SLOTS_POW2=16, HEAD_DIM=128))
    return (*scores, top_blocks, attention, merge)


def compile_key_outer_for_sm90(kernel: str = "forward", num_stages: int = 2,
                               num_warps: int = 8):
    """A Triton key-outer kernel, bf16, H64/Hi4 (16 heads a pair), D = 128, blocks of 128,
    top 16, compiled for sm_90a with ``num_stages``: the key-outer forward or dQ
    (``attention.key_outer``; whether Triton's pipeliner turns its gathers into asynchronous
    copies, and the shared memory that costs: a launch past the GPU's shared memory falls
    back to one stage, ``launch``), or dK/dV ("dkdv"; "dkdv-atomic-dq": with every row's dQ added
    atomically, ``Tuning.dq_pass = "dkdv_atomic"``; "dkdv-hard-atomic-dq": the hard rows' dQ
    only, on the segments flagged as holding one, ``"hard_atomic"``; a "+teacher" suffix: storing each pair's
    KL teacher too, ``Tuning.kl_teacher = "from_dkdv"``) as ``attention.backward`` launches
    it, or the KL pass that reads those teachers ("kl-teacher", ``kl.kl_from_teacher``)."""
    from triton.compiler import ASTSource

    from openmsa.ops.attention.backward import _sparse_attn_dkdv_kernel
    from openmsa.ops.configs import DKDV_ATOMIC_DQ_ROWS, KL_TEACHER_PAIRS
    from openmsa.ops.problem import _tile_shape
    from openmsa.ops.attention.key_outer import _dq_key_outer_kernel, _fwd_key_outer_kernel
    from openmsa.ops.kl.kernels import _kl_kernel

    kernel, teacher = kernel.removesuffix("+teacher"), kernel.endswith("+teacher")
    fn = {"forward": _fwd_key_outer_kernel, "dq": _dq_key_outer_kernel,
          "dkdv": _sparse_attn_dkdv_kernel, "dkdv-atomic-dq": _sparse_attn_dkdv_kernel,
          "dkdv-hard-atomic-dq": _sparse_attn_dkdv_kernel,
          "kl-teacher": _kl_kernel}[kernel]
    constants = dict(HI=4, GQ=16, GQ_PAD=16, KV_GROUP=1, TOK=8, BLOCK=128, HEAD_DIM=128,
                     TOP_K=16, SEGMENT_PAIRS=1024, PRECISION="tf32")
    if kernel == "dkdv":  # 64-row steps: 4 pairs x 16 heads
        del constants["TOP_K"]
        constants.update(INDEX_GROUP=4, TOK=4, TOKP=16, ROWS=64, INDEX_DIM=128,
                         ATOMIC_DQ=False)
    if kernel in ("dkdv-atomic-dq", "dkdv-hard-atomic-dq"):  # DKDV_ATOMIC_DQ_ROWS-row steps
        del constants["TOP_K"]
        tokens, _, rows = _tile_shape(16, DKDV_ATOMIC_DQ_ROWS)
        constants.update(INDEX_GROUP=4, TOK=tokens, TOKP=16, ROWS=rows, INDEX_DIM=128,
                         ATOMIC_DQ=True)
    if kernel.startswith("dkdv"):
        hard = kernel == "dkdv-hard-atomic-dq"
        constants.update(STORE_TEACHER=teacher, SEGMENTS_RUN=2 if hard else 0,
                         HARD_ROWS_DQ=hard)
    if kernel == "kl-teacher":
        constants = dict(HI=4, GQ=16, KV_GROUP=1, INDEX_GROUP=4, PAIRS=KL_TEACHER_PAIRS,
                         BLOCK=128, HEAD_DIM=128, INDEX_DIM=128, SEGMENT_PAIRS=1024,
                         QUERY_SIDE=True, WITH_VALUE=False, PRECISION="tf32",
                         TEACHER_GIVEN=True)
    floats = ("LSE_PART", "LSE", "DELTA", "DQ_PART", "DK_PART", "DV_PART", "DQ_SUM",
              "LSE_INDEX", "DIK", "KL_PARTS", "DIQ")
    types = {}
    for name in fn.arg_names:
        if name in constants:
            types[name] = "constexpr"
        elif name in ("Q", "K", "V", "DOUT", "OUT_PART", "IQ", "IK"):
            types[name] = "*bf16"
        elif name == "TEACHER":
            types[name] = "*fp16"
        elif name == "HARD":
            types[name] = "*i8"
        elif name.isupper():
            types[name] = "*fp32" if name in floats else "*i32"
        else:
            types[name] = "fp32" if name in ("scale_log2", "index_scale") else "i32"
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
               if types[name].startswith("*") or name.startswith("stride")}
    source = ASTSource(fn=fn, signature=types, constexprs=constants, attrs=aligned)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def ptxas_report(ptx: str) -> dict:
    """What Triton's bundled ptxas says of a kernel's PTX for sm_90a: registers, spilled bytes,
    whether it serialized the asynchronous products (a slow loop), and its whole text."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.ptx")
        with open(path, "w") as handle:
            handle.write(ptx)
        text = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.devnull],
                              capture_output=True, text=True, check=True).stderr
    registers = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores", text)
    return dict(registers=int(registers.group(1)),
                spill_bytes=int(spills.group(1)) if spills else 0,
                serialized="wgmma.mma_async instructions are serialized" in text, text=text)


if __name__ == "__main__" and sys.argv[1:2] == ["select"]:
    # python tools/sm90_compile.py select input|fp8 [tile_rows num_warps num_stages imprecise_acc]
    precision = sys.argv[2] if len(sys.argv) > 2 else "fp8"
    overrides = {}
    if len(sys.argv) > 3:
        rows, warps, stages, acc = sys.argv[3:7]
        overrides = dict(tile_rows=int(rows), num_warps=int(warps), num_stages=int(stages),
                         imprecise_acc=None if acc == "none" else int(acc))
    compiled = compile_select_for_sm90(precision, **overrides)
    report = ptxas_report(compiled.asm["ptx"])
    print(f"select {precision} {overrides or 'configs.SELECT_CONFIG'}: {report['registers']} "
          f"registers, {report['spill_bytes']} bytes spilled, {compiled.metadata.shared} bytes "
          f"of shared memory, products "
          f"{'serialized' if report['serialized'] else 'asynchronous'}")
elif __name__ == "__main__" and sys.argv[1:2] == ["key-outer"]:
    # python tools/sm90_compile.py key-outer [forward|dq|dkdv|dkdv-atomic-dq|
    # dkdv-hard-atomic-dq|kl-teacher][+teacher] [STAGES ...]
    kernel = sys.argv[2] if len(sys.argv) > 2 else "forward"
    for stages in map(int, sys.argv[3:] or ["1", "2", "3"]):
        compiled = compile_key_outer_for_sm90(kernel, stages)
        report = ptxas_report(compiled.asm["ptx"])
        copies = compiled.asm["ttgir"].count("async_copy_global_to_local")
        print(f"key-outer {kernel}, {stages} stages: {report['registers']} registers, "
              f"{report['spill_bytes']} bytes spilled, {compiled.metadata.shared} bytes of "
              f"shared memory, {copies} asynchronous copies in its TTGIR")
elif __name__ == "__main__":
    name = sys.argv[1] if len(sys.argv) > 1 else "forward"
    shape = sys.argv[2:6]
    head_dim, block_size, dtype, heads = (int(shape[0]), int(shape[1]), shape[2],
                                          int(shape[3])) if shape else (128, 128, "bf16", 16)
    compiled = compile_for_sm90(head_dim, block_size, dtype, kernel=name,
                                heads_per_token=heads)
    report = ptxas_report(compiled.asm["ptx"])
    print(f"{name}: {report['registers']} registers, {report['spill_bytes']} bytes spilled, "
          f"{compiled.metadata.shared} bytes of shared memory, products "
          f"{'serialized' if report['serialized'] else 'asynchronous'}")
