"""The KL's key-outer pass for Hopper GPUs, in Gluon: the Triton kernel's program
(``kl.kernels._kl_kernel``) with the key and index-key blocks by TMA, the segment's q and
index_q rows gathered by ``cp.async`` a unit ahead, and head g's exponentials during head
g + 1's score products.
"""
from __future__ import annotations

import math

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)

from ..configs import KL_STAGES
from ..sm90 import (BLOCK_SIZES, HEAD_DIMS, NUM_WARPS, _block_descriptor, _diagonal_pairs,
                    _hopper_16bit, _io_layout, _mma_layout, _rows_ready, _segment_of,
                    _step_tokens, _tma_ready)


LN_2 = gl.constexpr(math.log(2.0))


@gluon.jit
def _gather_kl_unit(Q, LSE, IQ, LSE_INDEX, q_smem, lse_smem, iq_smem, lse_index_smem,
                    token_smem, io_tokens, row_tokens, head, index_head, with_step,
                    stride_q_t, stride_q_h, stride_iq_t, stride_iq_h, HI: gl.constexpr,
                    NUM_HEADS: gl.constexpr, PAIRS: gl.constexpr, HEAD_DIM: gl.constexpr,
                    io_layout: gl.constexpr, row_layout: gl.constexpr):
    """One KL unit's rows, given its pairs' tokens (``_step_tokens`` in ``io_layout``'s rows and
    in ``row_layout``): one main head's q rows and log-sum-exps and, for a step's first unit
    (``with_step``), the step's index_q rows, index log-sum-exps (asynchronous copies, one
    commit group; zeros for missing pairs) and tokens (a plain store)."""
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, io_layout))
    valid = io_tokens < (1 << 30)
    token = gl.where(valid, io_tokens, 0).to(gl.int64)
    async_copy.async_copy_global_to_shared(
        q_smem, Q + token[:, None] * stride_q_t + head * stride_q_h + dims[None, :],
        mask=valid[:, None])
    row_valid = row_tokens < (1 << 30)
    row_token = gl.where(row_valid, row_tokens, 0).to(gl.int64)
    async_copy.async_copy_global_to_shared(lse_smem, LSE + row_token * NUM_HEADS + head,
                                           mask=row_valid)
    if with_step:  # (a masked copy would write zeros over the step's rows)
        async_copy.async_copy_global_to_shared(
            iq_smem, IQ + token[:, None] * stride_iq_t + index_head * stride_iq_h
            + dims[None, :], mask=valid[:, None])
        async_copy.async_copy_global_to_shared(lse_index_smem, LSE_INDEX + row_token * HI
                                               + index_head, mask=row_valid)
        token_smem.store(row_tokens)
    async_copy.commit_group()


@gluon.jit
def _kl_unit_issue(unit, io_tokens, row_tokens, Q, LSE, IQ, LSE_INDEX, PAIR_TOKEN, q_smem,
                   lse_smem, iq_smem, lse_index_smem, token_smem, k_smem, no_scores, first,
                   last, index_head, stride_q_t, stride_q_h, stride_iq_t, stride_iq_h,
                   HI: gl.constexpr, GQ: gl.constexpr, PAIRS: gl.constexpr,
                   HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, STEP_SLOTS: gl.constexpr,
                   io_layout: gl.constexpr, row_layout: gl.constexpr):
    """Issues KL unit ``unit``'s product ``K q^T`` (asynchronous, returned) once its rows are
    in, then gathers unit + STAGES - 2 into the slot of unit - 2 (both warpgroups are done with
    it past the barrier) with the tokens read one unit earlier, and reads the next ones."""
    async_copy.wait_group(STAGES - 3)  # later units' groups may still be in flight
    gl.thread_barrier()
    fence_async_shared()
    scores = warpgroup_mma(k_smem, q_smem.index(unit % STAGES).permute((1, 0)), no_scores,
                           use_acc=False, is_async=True)
    gather = unit + STAGES - 2
    step_slot = (gather // GQ) % STEP_SLOTS
    _gather_kl_unit(Q, LSE, IQ, LSE_INDEX, q_smem.index(gather % STAGES),
                    lse_smem.index(gather % STAGES), iq_smem.index(step_slot),
                    lse_index_smem.index(step_slot), token_smem.index(step_slot), io_tokens,
                    row_tokens, index_head * GQ + gather % GQ, index_head, gather % GQ == 0,
                    stride_q_t, stride_q_h, stride_iq_t, stride_iq_h, HI, HI * GQ, PAIRS,
                    HEAD_DIM, io_layout, row_layout)
    next_pair = first + ((gather + 1) // GQ) * PAIRS
    return (scores,
            _step_tokens(PAIR_TOKEN, next_pair, last, 1, PAIRS, PAIRS,
                         gl.SliceLayout(1, io_layout)),
            _step_tokens(PAIR_TOKEN, next_pair, last, 1, PAIRS, PAIRS, row_layout))


# 2^f = 1 + f (C1 + f (C2 + f C3)) on [-1/2, 1/2], relative error 1.0e-4 (fitted for the
# relative error with the constant fixed at 1): far under the bf16 rounding of (s - t).
EXP2_C1 = gl.constexpr(0.6932828426361084)
EXP2_C2 = gl.constexpr(0.24220985174179077)
EXP2_C3 = gl.constexpr(0.05500836670398712)
ROUNDING_SHIFT = gl.constexpr(12582912.0)  # 1.5 * 2^23: x + it holds round(x) in its low bits

# Every second head's exponentials on the FMA units (with an even GQ): the special function
# unit, which does the rest, bounds the kernel at wide groups. benchmarks/bench_kl.py
# --exp-split times both settings.
SPLIT_EXPONENTIALS = True


@gluon.jit
def _exp2_fma(x):
    """2^x on the FMA units, not the special function unit: round(x) goes into the exponent
    bits, 2^(x - round(x)) is a cubic. Below 2^-126 it gives about 2^-126, not 0 (a
    probability nothing here can tell from 0); above 2^127 garbage, which only the causal mask
    sees (a kept score is at most its log-sum-exp)."""
    x = gl.maximum(x, -126.0)
    shifted = x + ROUNDING_SHIFT
    frac = x - (shifted - ROUNDING_SHIFT)
    mantissa = gl.fma(gl.fma(gl.fma(frac, EXP2_C3, EXP2_C2), frac, EXP2_C1), frac, 1.0)
    bits = mantissa.to(gl.int32, bitcast=True) + (shifted.to(gl.int32, bitcast=True) << 23)
    return bits.to(gl.float32, bitcast=True)


@gluon.jit
def _kl_add_head(teacher, scores, outstanding: gl.constexpr, lse_smem, scale_log2,
                 cols_layout: gl.constexpr, ON_FMA: gl.constexpr):
    """teacher + one head's probabilities, once its product is done (``outstanding`` later
    products may still run); with ``ON_FMA`` their exponentials on the FMA units."""
    scores = warpgroup_mma_wait(num_outstanding=outstanding, deps=(scores,))
    lse = lse_smem.load(cols_layout)
    if ON_FMA:
        return teacher + _exp2_fma(scores * scale_log2 - lse[None, :])
    return teacher + gl.exp2(scores * scale_log2 - lse[None, :])


@gluon.jit
def _log2_approx(x):
    """log2 by the special function unit (``lg2.approx``, relative error ~2^-22): ``gl.log``
    is libdevice's logf, some 20 instructions and a branch per element."""
    return gl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32,
                                     is_pure=True, pack=1)


@gluon.jit
def _kl_step_end(teacher, d_index_k, value_keys, step, first, last, diagonal_steps, key_pos,
                 query_base, index_head, index_scale, ik_smem, iq_smem, lse_index_smem,
                 token_smem, dz_smem, DIQ, HI: gl.constexpr, GQ: gl.constexpr,
                 PAIRS: gl.constexpr, BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr,
                 STEP_SLOTS: gl.constexpr, QUERY_SIDE: gl.constexpr, WITH_VALUE: gl.constexpr,
                 s_layout: gl.constexpr, diq_layout: gl.constexpr):
    """A KL step's end, once its teacher (the sum of its heads' probabilities) is complete:
    the student, d index_k += (s - t) index_q; with QUERY_SIDE d index_q by atomic adds and,
    with WITH_VALUE, the value's terms summed over the pairs into ``value_keys`` (one per key:
    the sum over a row of the MMA layout needs no other warp). Returns d index_k and
    value_keys."""
    cols_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    slot = step % STEP_SLOTS
    cols = gl.arange(0, PAIRS, layout=cols_layout)
    col_valid = (first + step * PAIRS + cols < last)[None, :]
    student = warpgroup_mma(ik_smem, iq_smem.index(slot).permute((1, 0)),
                            gl.zeros((BLOCK, PAIRS), gl.float32, layout=s_layout),
                            use_acc=False)
    log_student = student * index_scale - lse_index_smem.index(slot).load(cols_layout)[None, :]
    # Masked column- and (on the diagonal only) key-wise, never as a [BLOCK, PAIRS] mask.
    teacher = gl.where(col_valid, teacher / GQ, 0.0)
    student = gl.where(col_valid, gl.exp(log_student), 0.0)
    if step < diagonal_steps:
        query_pos = token_smem.index(slot).load(cols_layout) - query_base
        teacher = gl.where(key_pos[:, None] <= query_pos[None, :], teacher, 0.0)
        student = gl.where(key_pos[:, None] <= query_pos[None, :], student, 0.0)
    if QUERY_SIDE and WITH_VALUE:
        log_teacher = _log2_approx(gl.maximum(teacher, 1e-30)) * LN_2
        terms = gl.where(teacher > 0, teacher * (log_teacher - log_student), 0.0)
        value_keys += gl.sum(terms, axis=1)
    # (s - t) lies in [-1, 1]; its tiny factor is applied in the backward (as in Triton). Both
    # products read it from shared memory, d index_q transposed.
    dz_smem.store((student - teacher).to(dz_smem.dtype))
    fence_async_shared()
    gl.thread_barrier()
    if QUERY_SIDE:
        # d index_q's product first: its atomic adds run while d index_k's product does.
        d_index_q = warpgroup_mma(dz_smem.permute((1, 0)), ik_smem,
                                  gl.zeros((PAIRS, HEAD_DIM), gl.float32, layout=diq_layout),
                                  use_acc=False, is_async=True)
        d_index_k = warpgroup_mma(dz_smem, iq_smem.index(slot), d_index_k, is_async=True)
        d_index_q = warpgroup_mma_wait(num_outstanding=1, deps=(d_index_q,))
        pair_rows = gl.arange(0, PAIRS, layout=gl.SliceLayout(1, diq_layout))
        dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, diq_layout))
        token = token_smem.index(slot).load(gl.SliceLayout(1, diq_layout))
        rows = (token * HI + index_head).to(gl.int64)
        gl.atomic_add(DIQ + rows[:, None] * HEAD_DIM + dims[None, :], d_index_q,
                      mask=(first + step * PAIRS + pair_rows < last)[:, None], sem="relaxed")
        d_index_k = warpgroup_mma_wait(num_outstanding=0, deps=(d_index_k,))
    else:
        d_index_k = warpgroup_mma(dz_smem, iq_smem.index(slot), d_index_k)
    return d_index_k, value_keys


@gluon.jit
def _kl_hopper_kernel(
    Q, IQ, LSE, LSE_INDEX, DIK, KL_PARTS, DIQ, k_desc, ik_desc,
    SEGMENTS, SEGMENT_ORDER, PAIR_TOKEN, BUCKET_START, BUCKET_COUNT, BLOCK_SEQUENCE,
    BLOCK_LOCAL, CU_SEQLENS, query_start,
    stride_q_t, stride_q_h, stride_iq_t, stride_iq_h, scale_log2, index_scale,
    HI: gl.constexpr, GQ: gl.constexpr, KV_GROUP: gl.constexpr, INDEX_GROUP: gl.constexpr,
    PAIRS: gl.constexpr, BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr,
    SEGMENT_PAIRS: gl.constexpr, QUERY_SIDE: gl.constexpr, WITH_VALUE: gl.constexpr,
    STAGES: gl.constexpr, EXP_SPLIT: gl.constexpr,
):
    """kl.kernels._kl_kernel's work (the KL of one segment of the key-block list, PAIRS pairs a
    step) on Hopper, index head dim = head dim. A step is GQ units, one per main head of the
    index head: ``K q_g^T`` ([BLOCK, PAIRS], transposed: the block's keys are the MMA rows)
    and its exponentials, added into the teacher; head g's exponentials run while the tensor
    cores compute head g + 1's product. Each unit's q rows and log-sum-exps, and a step's
    index_q rows, index log-sum-exps and tokens, arrive in rings in shared memory (the q ring
    of STAGES units: unit u - 1 is still read while u + STAGES - 2 arrives into the slot of
    u - 2). The step's end is as in the Triton kernel: the student from ``index_k index_q^T``,
    d index_k += (s - t) index_q in registers, with QUERY_SIDE d index_q = (s - t)^T index_k
    (from shared memory, transposed) by atomic adds and, with WITH_VALUE, the program's
    terms of the value, summed, into KL_PARTS[program] (0 for padding). d index_k goes to DIK
    as the Triton kernel's does. With EXP_SPLIT (GQ even) the last head of each pair takes
    its exponentials on the FMA units (``_exp2_fma``), the other on the special function
    unit: that unit alone bounds some 20% of the kernel at GQ 16."""
    NUM_WARPS: gl.constexpr = gl.num_warps()
    # Slots of index_q rows: the gathers run STAGES - 2 units ahead, so up to that many units'
    # steps past the current one arrive before it ends.
    STEP_SLOTS: gl.constexpr = (STAGES - 2 + GQ - 1) // GQ + 1
    CHUNK: gl.constexpr = 2 if GQ % 2 == 0 else 1
    s_layout: gl.constexpr = _mma_layout(PAIRS, NUM_WARPS)  # teacher, student [BLOCK, PAIRS]
    dik_layout: gl.constexpr = _mma_layout(HEAD_DIM, NUM_WARPS)  # d index_k [BLOCK, Di]
    # d index_q [PAIRS, Di]: 64 MMA rows, the two warpgroups split the columns.
    diq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NUM_WARPS // 2, 2], instr_shape=[16, HEAD_DIM // 2, 16])
    io_layout: gl.constexpr = _io_layout(HEAD_DIM, NUM_WARPS)
    io_rows: gl.constexpr = gl.SliceLayout(1, io_layout)
    cols_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_layout: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
    vector_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])

    segment = gl.load(SEGMENT_ORDER + gl.program_id(0))
    bucket = gl.load(SEGMENTS + 2 * segment)
    if bucket < 0:  # padding segment
        if QUERY_SIDE and WITH_VALUE:
            gl.store(KL_PARTS + gl.program_id(0), 0.0)
        return
    first, last, index_head, block, seq_start, query_base = _segment_of(
        SEGMENTS, BUCKET_START, BUCKET_COUNT, BLOCK_SEQUENCE, BLOCK_LOCAL, CU_SEQLENS,
        query_start, segment, bucket, HI, SEGMENT_PAIRS)
    steps = (last - first + PAIRS - 1) // PAIRS

    k_smem = gl.allocate_shared_memory(k_desc.dtype, [BLOCK, HEAD_DIM], k_desc.layout)
    ik_smem = gl.allocate_shared_memory(ik_desc.dtype, [BLOCK, HEAD_DIM], ik_desc.layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    fence_async_shared()
    row = (seq_start + block * BLOCK).to(gl.int32)
    mbarrier.expect(kv_ready, k_desc.block_type.nbytes + ik_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row, (index_head // KV_GROUP) * HEAD_DIM],
                                    kv_ready, k_smem)
    tma.async_copy_global_to_shared(ik_desc, [row, (index_head // INDEX_GROUP) * HEAD_DIM],
                                    kv_ready, ik_smem)

    rows_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([PAIRS, HEAD_DIM],
                                                                   Q.dtype.element_ty)
    q_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [STAGES, PAIRS, HEAD_DIM], rows_smem)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, PAIRS], vector_smem)
    iq_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [STEP_SLOTS, PAIRS, HEAD_DIM],
                                        rows_smem)
    lse_index_smem = gl.allocate_shared_memory(gl.float32, [STEP_SLOTS, PAIRS], vector_smem)
    token_smem = gl.allocate_shared_memory(gl.int32, [STEP_SLOTS, PAIRS], vector_smem)
    dz_smem = gl.allocate_shared_memory(
        Q.dtype.element_ty, [BLOCK, PAIRS],
        gl.NVMMASharedLayout.get_default_for([BLOCK, PAIRS], Q.dtype.element_ty))
    # Unit u: step u // GQ, main head index_head * GQ + u % GQ, q ring slot u % STAGES.
    for ahead in gl.static_range(STAGES - 2):
        step_pair = first + (ahead // GQ) * PAIRS
        _gather_kl_unit(Q, LSE, IQ, LSE_INDEX, q_smem.index(ahead), lse_smem.index(ahead),
                        iq_smem.index((ahead // GQ) % STEP_SLOTS),
                        lse_index_smem.index((ahead // GQ) % STEP_SLOTS),
                        token_smem.index((ahead // GQ) % STEP_SLOTS),
                        _step_tokens(PAIR_TOKEN, step_pair, last, 1, PAIRS, PAIRS, io_rows),
                        _step_tokens(PAIR_TOKEN, step_pair, last, 1, PAIRS, PAIRS, row_layout),
                        index_head * GQ + ahead % GQ, index_head, ahead % GQ == 0, stride_q_t,
                        stride_q_h, stride_iq_t, stride_iq_h, HI, HI * GQ, PAIRS, HEAD_DIM,
                        io_layout, row_layout)
    # The tokens of the next unit to gather, read one iteration ahead.
    gather_pair = first + ((STAGES - 2) // GQ) * PAIRS
    io_tokens = _step_tokens(PAIR_TOKEN, gather_pair, last, 1, PAIRS, PAIRS, io_rows)
    row_tokens = _step_tokens(PAIR_TOKEN, gather_pair, last, 1, PAIRS, PAIRS, row_layout)
    diagonal_steps = (_diagonal_pairs(PAIR_TOKEN, first, last, query_base, block, BLOCK,
                                      row_layout) + PAIRS - 1) // PAIRS

    key_pos = block * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, s_layout))
    no_scores = gl.zeros((BLOCK, PAIRS), gl.float32, layout=s_layout)
    d_index_k = gl.zeros((BLOCK, HEAD_DIM), gl.float32, layout=dik_layout)
    value_keys = gl.zeros((BLOCK,), gl.float32, layout=gl.SliceLayout(1, s_layout))
    teacher = gl.zeros((BLOCK, PAIRS), gl.float32, layout=s_layout)
    mbarrier.wait(kv_ready, 0)
    for step in range(0, steps):
        # Heads in chunks of CHUNK, unrolled: head g's product runs while head g - 1's
        # exponentials do. No product is in flight across iterations (a loop-carried one is
        # copied, and ptxas then serializes every product); chunks of 4 spill.
        for chunk in range(0, GQ // CHUNK):
            unit = step * GQ + chunk * CHUNK
            previous, io_tokens, row_tokens = _kl_unit_issue(
                unit, io_tokens, row_tokens, Q, LSE, IQ, LSE_INDEX, PAIR_TOKEN, q_smem,
                lse_smem, iq_smem, lse_index_smem, token_smem, k_smem, no_scores, first, last,
                index_head, stride_q_t, stride_q_h, stride_iq_t, stride_iq_h, HI, GQ, PAIRS,
                HEAD_DIM, STAGES, STEP_SLOTS, io_layout, row_layout)
            for g in gl.static_range(1, CHUNK):
                scores, io_tokens, row_tokens = _kl_unit_issue(
                    unit + g, io_tokens, row_tokens, Q, LSE, IQ, LSE_INDEX, PAIR_TOKEN, q_smem,
                    lse_smem, iq_smem, lse_index_smem, token_smem, k_smem, no_scores, first,
                    last, index_head, stride_q_t, stride_q_h, stride_iq_t, stride_iq_h, HI, GQ,
                    PAIRS, HEAD_DIM, STAGES, STEP_SLOTS, io_layout, row_layout)
                teacher = _kl_add_head(teacher, previous, 1,
                                       lse_smem.index((unit + g - 1) % STAGES), scale_log2,
                                       cols_layout, False)
                previous = scores
            teacher = _kl_add_head(teacher, previous, 0,
                                   lse_smem.index((unit + CHUNK - 1) % STAGES), scale_log2,
                                   cols_layout, EXP_SPLIT)
        d_index_k, value_keys = _kl_step_end(
            teacher, d_index_k, value_keys, step, first, last, diagonal_steps, key_pos,
            query_base, index_head, index_scale, ik_smem, iq_smem, lse_index_smem, token_smem,
            dz_smem, DIQ, HI, GQ, PAIRS, BLOCK, HEAD_DIM, STEP_SLOTS, QUERY_SIDE, WITH_VALUE,
            s_layout, diq_layout)
        teacher = gl.zeros((BLOCK, PAIRS), gl.float32, layout=s_layout)
    async_copy.wait_group(0)
    mbarrier.invalidate(kv_ready)

    keys = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, dik_layout))
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, dik_layout))
    if QUERY_SIDE:  # added into d index_k's rows, as d index_q's: no partials to reduce
        seq_end = gl.load(CU_SEQLENS + gl.load(BLOCK_SEQUENCE + bucket // HI) + 1)
        key_rows = seq_start + block * BLOCK + keys
        index_key_heads: gl.constexpr = HI // INDEX_GROUP
        gl.atomic_add(DIK + (key_rows.to(gl.int64) * index_key_heads
                             + index_head // INDEX_GROUP)[:, None] * HEAD_DIM + dims[None, :],
                      d_index_k, mask=(key_rows < seq_end)[:, None], sem="relaxed")
    else:
        gl.store(DIK + (segment.to(gl.int64) * BLOCK + keys)[:, None] * HEAD_DIM
                 + dims[None, :], d_index_k)
    if QUERY_SIDE and WITH_VALUE:
        gl.store(KL_PARTS + gl.program_id(0), gl.sum(value_keys, axis=0))


def supported_kl(q, k, index_q, index_k, p) -> bool:
    """Whether ``_kl_hopper_kernel`` runs the KL of ``p``: a Hopper GPU, 16-bit inputs, index
    head dim equal to the head dim (64 or 128), blocks of 64 or 128, keys and index keys TMA
    can read, query and index query rows that 16-byte copies can gather."""
    return (_hopper_16bit(q, k, index_q, index_k) and p.head_dim in HEAD_DIMS
            and p.index_dim == p.head_dim and p.block_size in BLOCK_SIZES
            and _tma_ready(k) and _tma_ready(index_k)
            and _rows_ready(q) and _rows_ready(index_q))


def kl_key_walk_parts(q, k, index_q, index_k, lse, lse_index, p, d_index_k, value_parts,
                      d_index_q, query_side: bool, with_value: bool, scale_log2: float,
                      pairs: int):
    """``kl.kl_key_walk``'s Gluon kernel, ``pairs`` pairs a step: d index_k partials per segment
    into ``d_index_k`` or, with ``query_side``, d index_k itself added into ``d_index_k`` and
    d index_q into ``d_index_q`` and, with ``with_value`` too, the value's terms per program
    into ``value_parts``; ``supported_kl(q, k, index_q, index_k, p)`` must hold."""
    work = p.block_work
    shared = p.shared
    _kl_hopper_kernel[(work.segments.shape[0],)](
        q, index_q, lse, lse_index, d_index_k, value_parts, d_index_q,
        _block_descriptor(k, p.block_size),
        _block_descriptor(index_k, p.block_size), work.segments, work.segment_order,
        work.pair_token, work.bucket_start, work.bucket_count, work.block_sequence,
        work.block_local, p.cu_seqlens, p.query_start, q.stride(0), q.stride(1),
        index_q.stride(0), index_q.stride(1), scale_log2, p.index_scale, HI=shared["HI"],
        GQ=shared["GQ"], KV_GROUP=shared["KV_GROUP"], INDEX_GROUP=shared["INDEX_GROUP"],
        PAIRS=pairs, BLOCK=p.block_size, HEAD_DIM=p.head_dim,
        SEGMENT_PAIRS=work.segment_pairs, QUERY_SIDE=query_side, WITH_VALUE=with_value,
        STAGES=KL_STAGES, EXP_SPLIT=SPLIT_EXPONENTIALS and shared["GQ"] % 2 == 0,
        num_warps=NUM_WARPS)
