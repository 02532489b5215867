"""The key-outer forward and dQ (``attention.key_outer``) for Hopper GPUs, in Gluon.

The Triton kernels' work (each segment of a key block's hard pairs, cut to the window's rows)
with the dK/dV kernel's machinery, on a persistent grid: a program per SM takes segments in
turn. Per segment, one warp loads K and V of the block by TMA once both consumers are done with
the previous block's; another gathers the steps' q (and dO, log-sum-exps, deltas) rows by
``cp.async`` into a ring of shared memory, running ahead into the next segment; two consumer
warpgroups take alternate steps of 64 rows (pairs x heads), so one's exponentials run while the
other's products do. Rows are the products' M dimension, so a row's softmax over the block
stays within one warpgroup. A window without hard rows costs one short wave, and a segment's
setup overlaps the previous one's products. They write the same per-slot partials as the
Triton kernels, which the same combine and sum read.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                              warpgroup_mma, warpgroup_mma_wait)

from ..configs import (KEY_OUTER_HOPPER_PROGRAMS_PER_SM, KEY_OUTER_HOPPER_REGISTERS,
                       KEY_OUTER_HOPPER_STAGES)
from ..problem import multiprocessors
from ..sm90 import (BLOCK_SIZES, HEAD_DIMS, _block_descriptor, _block_kv_loads,
                    _diagonal_pairs, _hopper_16bit, _io_layout, _maxnreg, _mma_layout,
                    _rows_ready, _segment_of, _step_barriers, _step_tokens, _tma_ready,
                    key_step_tokens)

STEP_ROWS = 64  # rows (pairs x padded heads) of one consumer step: one warpgroup's MMA rows


def supported(q, k, v, p, dout=None) -> bool:
    """Whether the Gluon key-outer kernels take ``p``'s hard rows: a Hopper GPU, 16-bit inputs,
    head dim 64 or 128, blocks of 64 or 128 keys, K and V that TMA reads, q (and dO) rows that
    16-byte copies gather."""
    tensors = (q, k, v) if dout is None else (q, k, v, dout)
    return (_hopper_16bit(*tensors) and p.head_dim in HEAD_DIMS
            and p.block_size in BLOCK_SIZES and key_step_tokens(p.gq, STEP_ROWS) is not None
            and _tma_ready(k) and _tma_ready(v) and _rows_ready(q)
            and (dout is None or _rows_ready(dout)))


@gluon.jit
def _segment_work(segments, position, window, num_bounds, HI: gl.constexpr,
                  SEGMENT_PAIRS: gl.constexpr):
    """The segment at ``position`` of the program order, cut to the window's pairs [low, high)
    (``key_outer.window_bounds``; none for a padding segment), its index head, block, sequence
    start and the query row of the sequence's position 0."""
    (SEGMENTS, SEGMENT_ORDER, _, _, BOUNDS, BUCKET_START, BUCKET_COUNT, BLOCK_SEQUENCE,
     BLOCK_LOCAL, CU_SEQLENS, query_start, _) = segments
    segment = gl.load(SEGMENT_ORDER + position)
    bucket = gl.load(SEGMENTS + 2 * segment)
    _, _, index_head, block, seq_start, query_base = _segment_of(
        SEGMENTS, BUCKET_START, BUCKET_COUNT, BLOCK_SEQUENCE, BLOCK_LOCAL, CU_SEQLENS,
        query_start, segment, gl.maximum(bucket, 0), HI, SEGMENT_PAIRS)
    bounds = BOUNDS + segment.to(gl.int64) * num_bounds + window
    low = gl.load(bounds)
    high = gl.where(bucket < 0, low, gl.load(bounds + 1))
    return low, high, index_head, block, seq_start, query_base


@gluon.jit
def _step_rows(first_pair, end, GQ: gl.constexpr, TOK: gl.constexpr, ROWS: gl.constexpr,
               layout: gl.constexpr):
    """Per row of a step (head-major: row = g * TOK + t) in ``layout``: whether it is a pair's
    head, and its head g."""
    rows = gl.arange(0, ROWS, layout=layout)
    return (first_pair + rows % TOK < end) & (rows // TOK < GQ), rows // TOK


@gluon.jit
def _kv_loads(k_desc, v_desc, k_smem, v_smem, kv_ready, kv_empty, segments, window,
              num_bounds, HI: gl.constexpr, KV_GROUP: gl.constexpr, BLOCK: gl.constexpr,
              HEAD_DIM: gl.constexpr, SEGMENT_PAIRS: gl.constexpr):
    """The K and V partition (one warp): per segment of the program with pairs in the window,
    its block's K and V once both consumer warpgroups handed the previous block's back
    (``kv_empty``), completing ``kv_ready``."""
    (_, _, _, _, _, _, _, _, _, _, _, num_segments) = segments
    count = 0
    for position in range(gl.program_id(0), num_segments, gl.num_programs(0)):
        low, high, index_head, block, seq_start, _ = _segment_work(
            segments, position, window, num_bounds, HI, SEGMENT_PAIRS)
        if low < high:
            mbarrier.wait(kv_empty, (count & 1) ^ 1)  # a fresh barrier passes parity 1
            _block_kv_loads(k_desc, v_desc, k_smem, v_smem, kv_ready, seq_start, block,
                            index_head, KV_GROUP, BLOCK, HEAD_DIM)
            count += 1


@gluon.jit
def _gather_steps(Q, DOUT, LSE, DELTA, q_smem, do_smem, lse_smem, delta_smem, token_smem,
                  slot_smem, full, empty, segments, window, num_bounds, stride_q_t, stride_q_h,
                  stride_do_t, stride_do_h, HI: gl.constexpr, GQ: gl.constexpr, TOK: gl.constexpr,
                  HEAD_DIM: gl.constexpr, SEGMENT_PAIRS: gl.constexpr, STAGES: gl.constexpr,
                  WITH_GRAD: gl.constexpr):
    """The gather partition (one warp): each step's q rows, tokens and slots (and, WITH_GRAD, dO
    rows, log-sum-exps and deltas) by ``cp.async`` into ring slot ``g % STAGES`` (g: the program's
    step count over its segments) once the consumer of step ``g - STAGES`` handed it back; a
    slot is full when every copy into it has landed."""
    ROWS: gl.constexpr = 64
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [1, 1], [1, 0])
    row_layout: gl.constexpr = gl.SliceLayout(1, io_layout)
    (_, _, PAIR_TOKEN, PAIR_SLOT, _, _, _, _, _, _, _, num_segments) = segments
    rows = gl.arange(0, ROWS, layout=row_layout)
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, io_layout))
    base = 0
    for position in range(gl.program_id(0), num_segments, gl.num_programs(0)):
        low, high, index_head, _, _, _ = _segment_work(segments, position, window, num_bounds,
                                                       HI, SEGMENT_PAIRS)
        if low < high:
            steps = (high - low + TOK - 1) // TOK
            head = index_head * GQ + rows // TOK
            for j in range(0, steps):
                step = base + j
                slot = step % STAGES
                first_pair = low + j * TOK
                tokens = _step_tokens(PAIR_TOKEN, first_pair, high, GQ, TOK, ROWS, row_layout)
                valid = tokens < (1 << 30)
                token = gl.where(valid, tokens, 0).to(gl.int64)
                mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)
                async_copy.async_copy_global_to_shared(
                    q_smem.index(slot), (Q + token * stride_q_t + head * stride_q_h)[:, None]
                    + dims[None, :], mask=valid[:, None])
                async_copy.async_copy_global_to_shared(token_smem.index(slot),
                                                       PAIR_TOKEN + first_pair + rows % TOK,
                                                       mask=valid)
                async_copy.async_copy_global_to_shared(slot_smem.index(slot),
                                                       PAIR_SLOT + first_pair + rows % TOK,
                                                       mask=valid)
                if WITH_GRAD:
                    async_copy.async_copy_global_to_shared(
                        do_smem.index(slot),
                        (DOUT + token * stride_do_t + head * stride_do_h)[:, None]
                        + dims[None, :], mask=valid[:, None])
                    row = token * (HI * GQ) + head
                    async_copy.async_copy_global_to_shared(lse_smem.index(slot), LSE + row,
                                                           mask=valid)
                    async_copy.async_copy_global_to_shared(delta_smem.index(slot),
                                                           DELTA + row, mask=valid)
                async_copy.mbarrier_arrive(full.index(slot), increment_count=False)
            base += steps


@gluon.jit
def _consumer_steps(PART, LSE_PART, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem,
                    token_smem, slot_smem, kv_ready, kv_empty, full, empty, segments, window,
                    num_bounds, window_start, scale_log2, HI: gl.constexpr, GQ: gl.constexpr,
                    TOK: gl.constexpr, BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr,
                    TOP_K: gl.constexpr, SEGMENT_PAIRS: gl.constexpr, STAGES: gl.constexpr,
                    HALF: gl.constexpr, WITH_GRAD: gl.constexpr):
    """One consumer warpgroup: steps HALF, HALF + 2, ... of each segment with pairs in the
    window, once the block's K and V are in (``kv_ready``), handing them back (``kv_empty``)
    after its steps. A step issues ``S = Q K^T`` and goes on as the forward's
    (``_fwd_step``) or, WITH_GRAD, dQ's (``_dq_step``)."""
    NUM_WARPS: gl.constexpr = gl.num_warps()
    ROWS: gl.constexpr = 64
    s_layout: gl.constexpr = _mma_layout(BLOCK, NUM_WARPS)  # scores [ROWS, BLOCK]
    o_layout: gl.constexpr = _mma_layout(HEAD_DIM, NUM_WARPS)  # outputs and dQ [ROWS, D]
    pairs_layout: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
    (_, _, PAIR_TOKEN, _, _, _, _, _, _, _, _, num_segments) = segments
    keys = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, s_layout))
    if WITH_GRAD:  # dQ stores from the products' layout, the forward through an I/O layout
        dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    else:
        dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, _io_layout(HEAD_DIM, NUM_WARPS)))
    no_scores = gl.zeros((ROWS, BLOCK), gl.float32, layout=s_layout)
    no_acc = gl.zeros((ROWS, HEAD_DIM), gl.float32, layout=o_layout)
    base = 0
    count = 0
    for position in range(gl.program_id(0), num_segments, gl.num_programs(0)):
        low, high, index_head, block, _, query_base = _segment_work(
            segments, position, window, num_bounds, HI, SEGMENT_PAIRS)
        if low < high:
            steps = (high - low + TOK - 1) // TOK
            diagonal_steps = (_diagonal_pairs(PAIR_TOKEN, low, high, query_base, block, BLOCK,
                                              pairs_layout) + TOK - 1) // TOK
            mbarrier.wait(kv_ready, count & 1)
            for j in range(HALF, steps, 2):
                step = base + j
                slot = step % STAGES
                mbarrier.wait(full.index(slot), (step // STAGES) & 1)
                scores = warpgroup_mma(q_smem.index(slot), k_smem.permute((1, 0)), no_scores,
                                       use_acc=False, is_async=True)
                if WITH_GRAD:
                    _dq_step(scores, PART, k_smem, v_smem, do_smem, lse_smem, delta_smem,
                             token_smem, slot_smem, empty, slot, low, j, high, index_head, block,
                             query_base, diagonal_steps, keys, dims, no_scores, no_acc,
                             window_start, scale_log2, HI, GQ, TOK, BLOCK, HEAD_DIM, TOP_K)
                else:
                    _fwd_step(scores, PART, LSE_PART, v_smem, q_smem, token_smem, slot_smem,
                              empty, slot, low, j, high, index_head, block, query_base,
                              diagonal_steps, keys, dims, no_acc, window_start, scale_log2, HI,
                              GQ, TOK, BLOCK, HEAD_DIM, TOP_K)
            mbarrier.arrive(kv_empty, count=1)  # done with this block's K and V
            base += steps
            count += 1


@gluon.jit
def _fwd_step(scores, OUT_PART, LSE_PART, v_smem, q_smem, token_smem, slot_smem, empty, slot,
              low, j, high, index_head, block, query_base, diagonal_steps, keys, dims, no_out,
              window_start, scale_log2, HI: gl.constexpr, GQ: gl.constexpr, TOK: gl.constexpr,
              BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr, TOP_K: gl.constexpr):
    """Step ``j`` of the segment's pairs from ``low`` in the forward, once ``S = Q K^T`` is
    issued: the rows' softmax over the block's visible
    keys, their output normalized over the block and their log-sum-exp (base 2) into each
    row's slot of OUT_PART [window rows, HI, TOP_K, GQ, D] and LSE_PART [..., GQ]."""
    NUM_WARPS: gl.constexpr = gl.num_warps()
    ROWS: gl.constexpr = 64
    s_layout: gl.constexpr = _mma_layout(BLOCK, NUM_WARPS)
    o_layout: gl.constexpr = _mma_layout(HEAD_DIM, NUM_WARPS)  # [ROWS, D]
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    io_layout: gl.constexpr = _io_layout(HEAD_DIM, NUM_WARPS)
    rows_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    io_rows: gl.constexpr = gl.SliceLayout(1, io_layout)
    token = token_smem.index(slot).load(rows_layout)
    token_io = token_smem.index(slot).load(io_rows)
    slot_io = slot_smem.index(slot).load(io_rows)
    # The rows' partials' offsets while Q K^T runs.
    first_pair = low + j * TOK
    valid_io, head_io = _step_rows(first_pair, high, GQ, TOK, ROWS, io_rows)
    offset_io = ((((token_io - window_start).to(gl.int64) * HI + index_head) * TOP_K + slot_io)
                 * GQ + head_io)
    scores = warpgroup_mma_wait(num_outstanding=0, deps=(scores,))
    mbarrier.arrive(empty.index(slot), count=1)  # q, tokens and slots read
    valid, head = _step_rows(first_pair, high, GQ, TOK, ROWS, rows_layout)
    scores = scores * scale_log2
    if j < diagonal_steps:  # pairs ascend by row: only the first can see past it
        scores = gl.where((block * BLOCK + keys)[None, :] <= (token - query_base)[:, None],
                          scores, float("-inf"))
    row_max = gl.max(scores, axis=1)
    safe_max = gl.where(row_max == float("-inf"), 0.0, row_max)
    probs = gl.exp2(scores - safe_max[:, None])
    row_sum = gl.sum(probs, axis=1)
    p = gl.convert_layout(probs.to(q_smem.dtype), p_layout)
    out = warpgroup_mma(p, v_smem, no_out, use_acc=False, is_async=True)
    offset = gl.convert_layout(offset_io, rows_layout)
    gl.store(LSE_PART + offset, safe_max + gl.log2(gl.where(valid, row_sum, 1.0)), mask=valid)
    out = warpgroup_mma_wait(num_outstanding=0, deps=(out,))
    row_sum = gl.where(row_sum > 0, row_sum, 1.0)
    out = out / gl.convert_layout(row_sum, gl.SliceLayout(1, o_layout))[:, None]
    out = gl.convert_layout(out.to(OUT_PART.dtype.element_ty), io_layout)
    gl.store(OUT_PART + offset_io[:, None] * HEAD_DIM + dims[None, :], out,
             mask=valid_io[:, None])


@gluon.jit
def _dq_step(scores, DQ_PART, k_smem, v_smem, do_smem, lse_smem, delta_smem, token_smem,
             slot_smem, empty, slot, low, j, high, index_head, block, query_base, diagonal_steps,
             keys, dims, no_scores, no_dq, window_start, scale_log2, HI: gl.constexpr,
             GQ: gl.constexpr, TOK: gl.constexpr, BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr,
             TOP_K: gl.constexpr):
    """Step ``j`` of the segment's pairs from ``low`` in dQ, once ``S = Q K^T`` is issued:
    ``P = exp2(S - lse2)``, ``dS = P (dO V^T - delta)`` and the rows' dQ over the block,
    ``dS K`` (unscaled, fp32, stored in DQ_PART's precision), into each row's slot of DQ_PART
    [window rows, HI, TOP_K, GQ, D]."""
    NUM_WARPS: gl.constexpr = gl.num_warps()
    ROWS: gl.constexpr = 64
    s_layout: gl.constexpr = _mma_layout(BLOCK, NUM_WARPS)
    o_layout: gl.constexpr = _mma_layout(HEAD_DIM, NUM_WARPS)
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    rows_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    out_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    dprobs = warpgroup_mma(do_smem.index(slot), v_smem.permute((1, 0)), no_scores,
                           use_acc=False, is_async=True)
    token = token_smem.index(slot).load(rows_layout)
    lse = lse_smem.index(slot).load(rows_layout)
    delta = delta_smem.index(slot).load(rows_layout)
    scores = warpgroup_mma_wait(num_outstanding=1, deps=(scores,))
    probs = gl.exp2(scores * scale_log2 - lse[:, None])
    if j < diagonal_steps:
        probs = gl.where((block * BLOCK + keys)[None, :] <= (token - query_base)[:, None],
                         probs, 0.0)
    dprobs = warpgroup_mma_wait(num_outstanding=0, deps=(dprobs,))
    slot_out = slot_smem.index(slot).load(out_rows)
    mbarrier.arrive(empty.index(slot), count=1)  # q, dO and the rows' values read
    dscores = gl.convert_layout((probs * (dprobs - delta[:, None])).to(do_smem.dtype),
                                ds_layout)
    dq = warpgroup_mma(dscores, k_smem, no_dq, use_acc=False, is_async=True)
    first_pair = low + j * TOK
    valid, head = _step_rows(first_pair, high, GQ, TOK, ROWS, out_rows)
    token_out = gl.convert_layout(token, out_rows)
    offset = ((((token_out - window_start).to(gl.int64) * HI + index_head) * TOP_K + slot_out)
              * GQ + head)
    dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
    gl.store(DQ_PART + offset[:, None] * HEAD_DIM + dims[None, :],
             dq.to(DQ_PART.dtype.element_ty), mask=valid[:, None])


# A pass launches once per window: its scalars would otherwise compile variants (1, multiples
# of 16).
@gluon.jit(do_not_specialize=["window", "num_bounds", "num_segments", "query_start",
                              "window_start"])
def _key_outer_hopper_kernel(
    Q, DOUT, LSE, DELTA, WINDOW_HARD, window, BOUNDS, num_bounds, OUT_PART, LSE_PART,
    k_desc, v_desc, SEGMENTS, SEGMENT_ORDER, PAIR_TOKEN, PAIR_SLOT, BUCKET_START,
    BUCKET_COUNT, BLOCK_SEQUENCE, BLOCK_LOCAL, CU_SEQLENS, query_start, num_segments,
    window_start, stride_q_t, stride_q_h, stride_do_t, stride_do_h, scale_log2,
    HI: gl.constexpr, GQ: gl.constexpr, KV_GROUP: gl.constexpr, TOK: gl.constexpr,
    BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr, TOP_K: gl.constexpr,
    SEGMENT_PAIRS: gl.constexpr, STAGES: gl.constexpr,
    WITH_GRAD: gl.constexpr, CONSUMER_REGS: gl.constexpr, GATHER_REGS: gl.constexpr,
):
    """The window's hard pairs, segment by segment on a persistent grid (programs take the
    segment order's positions program_id, program_id + programs, ...), warp-specialized: one
    warp loads each block's K and V (``_kv_loads``), one gathers the steps' rows
    (``_gather_steps``), two warpgroups take alternate steps (``_consumer_steps``; the first
    is the launch's 4 warps, the second a worker partition). Without WITH_GRAD the forward
    (``_fwd_step``: OUT_PART, LSE_PART), with it dQ (``_dq_step``: partials in OUT_PART, fp32
    or 16-bit; DOUT, LSE and DELTA read)."""
    ROWS: gl.constexpr = 64
    vector_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    if gl.load(WINDOW_HARD + window) == 0:  # every program of a window without hard rows
        return

    k_smem = gl.allocate_shared_memory(k_desc.dtype, [BLOCK, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [BLOCK, HEAD_DIM], v_desc.layout)
    step_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM],
                                                                   Q.dtype.element_ty)
    q_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [STAGES, ROWS, HEAD_DIM], step_smem)
    token_smem = gl.allocate_shared_memory(gl.int32, [STAGES, ROWS], vector_smem)
    slot_smem = gl.allocate_shared_memory(gl.int32, [STAGES, ROWS], vector_smem)
    if WITH_GRAD:
        do_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [STAGES, ROWS, HEAD_DIM],
                                            step_smem)
        lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, ROWS], vector_smem)
        delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, ROWS], vector_smem)
    else:  # the forward gathers no dO, lse2 or deltas: names only
        do_smem, lse_smem, delta_smem = q_smem, token_smem, token_smem
    kv_ready, full, empty = _step_barriers(STAGES, 1)  # a step has one consumer warpgroup
    kv_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_empty, count=2)  # both consumer warpgroups
    fence_async_shared()
    # The hard pairs' list, its window bounds and its length, as every partition reads them.
    segments = (SEGMENTS, SEGMENT_ORDER, PAIR_TOKEN, PAIR_SLOT, BOUNDS, BUCKET_START,
                BUCKET_COUNT, BLOCK_SEQUENCE, BLOCK_LOCAL, CU_SEQLENS, query_start, num_segments)
    # The constants go in literally: a tuple bound to a name would turn them into tensors.
    gl.warp_specialize([
        (_consumer_steps, (OUT_PART, LSE_PART, k_smem, v_smem, q_smem, do_smem, lse_smem,
                           delta_smem, token_smem, slot_smem, kv_ready, kv_empty, full, empty,
                           segments, window, num_bounds, window_start, scale_log2, HI, GQ, TOK,
                           BLOCK, HEAD_DIM, TOP_K, SEGMENT_PAIRS, STAGES, 0, WITH_GRAD)),
        (_consumer_steps, (OUT_PART, LSE_PART, k_smem, v_smem, q_smem, do_smem, lse_smem,
                           delta_smem, token_smem, slot_smem, kv_ready, kv_empty, full, empty,
                           segments, window, num_bounds, window_start, scale_log2, HI, GQ, TOK,
                           BLOCK, HEAD_DIM, TOP_K, SEGMENT_PAIRS, STAGES, 1, WITH_GRAD)),
        (_gather_steps, (Q, DOUT, LSE, DELTA, q_smem, do_smem, lse_smem, delta_smem,
                         token_smem, slot_smem, full, empty, segments, window, num_bounds,
                         stride_q_t, stride_q_h, stride_do_t, stride_do_h, HI, GQ, TOK,
                         HEAD_DIM, SEGMENT_PAIRS, STAGES, WITH_GRAD)),
        (_kv_loads, (k_desc, v_desc, k_smem, v_smem, kv_ready, kv_empty, segments, window,
                     num_bounds, HI, KV_GROUP, BLOCK, HEAD_DIM, SEGMENT_PAIRS)),
    ], [4, 1, 1], [CONSUMER_REGS, GATHER_REGS, GATHER_REGS])


def block_descriptors(k, v, block_size: int):
    """The TMA descriptors of K's and V's blocks, made once per pass (on the host's path)."""
    return _block_descriptor(k, block_size), _block_descriptor(v, block_size)


def launch_key_outer(q, descriptors, window_hard, window, bounds, part, lse_part, arguments,
                     start, segments, constants, scale_log2, dout=None, lse=None, delta=None):
    """One window's forward (``dout`` None: ``part`` the bf16/fp16 outputs, ``lse_part`` their
    log-sum-exps) or dQ (``part`` the partials, fp32 or 16-bit) over the hard pairs' key-block
    list (``key_outer._hard_work``'s ``arguments``, ``segments`` of them; the window's pairs of
    each in ``bounds``), K and V read through ``descriptors`` (``block_descriptors``), on a
    program per SM (at most one per segment); ``supported`` must hold."""
    with_grad = dout is not None
    # The forward reads no dO, lse2 or deltas, dQ writes no lse2 partials: stand-ins.
    dout, lse, delta, lse_part = ((dout, lse, delta, part) if with_grad
                                  else (q, lse_part, lse_part, lse_part))
    programs = max(1, min(segments, KEY_OUTER_HOPPER_PROGRAMS_PER_SM * multiprocessors(q.device)))
    _key_outer_hopper_kernel[(programs,)](
        q, dout, lse, delta, window_hard, window, bounds, bounds.shape[1], part, lse_part,
        *descriptors, *arguments, segments, start, q.stride(0), q.stride(1), dout.stride(0),
        dout.stride(1), scale_log2, HI=constants["HI"], GQ=constants["GQ"],
        KV_GROUP=constants["KV_GROUP"], TOK=key_step_tokens(constants["GQ"], STEP_ROWS),
        BLOCK=constants["BLOCK"], HEAD_DIM=constants["HEAD_DIM"], TOP_K=constants["TOP_K"],
        SEGMENT_PAIRS=constants["SEGMENT_PAIRS"], STAGES=KEY_OUTER_HOPPER_STAGES,
        WITH_GRAD=with_grad, CONSUMER_REGS=KEY_OUTER_HOPPER_REGISTERS[0],
        GATHER_REGS=KEY_OUTER_HOPPER_REGISTERS[1], num_warps=4,
        maxnreg=_maxnreg(3, KEY_OUTER_HOPPER_REGISTERS))
