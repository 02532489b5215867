"""The main attention's backward for Hopper GPUs, in Gluon: dQ query-outer (the Triton dQ's
program with TMA rings of K and V blocks, asynchronous products, warp specialization, and the
deltas computed in the same pass), and dK/dV key-outer (q and dO rows of a segment's pairs
gathered by ``cp.async`` while the previous step's dV and dK products run).
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                              warpgroup_mma, warpgroup_mma_wait)

from ..configs import DQ_REGISTERS, KEY_STEP_REGISTERS, KEY_STEP_STAGES
from ..sm90 import (BLOCK_SIZES, HEAD_DIMS, _block_descriptor, _block_kv_loads, _block_rings,
                    _diagonal_pairs, _half_members, _hopper_16bit, _io_layout, _maxnreg,
                    _mma_layout, _mma_rows, _pass_over, _ring_loads, _rows_ready, _segment_of,
                    _step_barriers, _step_tokens, _tile_of, _tile_rows, _tma_ready, _visible,
                    _walk_of, key_step_tokens)


@gluon.jit
def _masked_probs(scores, u, lse, blocks, members, first_position, all_members, row_bit,
                  row_valid, row_position, scale_log2, BLOCK: gl.constexpr,
                  layout: gl.constexpr):
    """Walk entry u's probabilities from the final log-sum-exps, zero where a row does not see
    a key; ``members``: entry u's members mask, ``all_members``: that of a block all the
    warpgroup's queries kept."""
    block = gl.load(blocks + u)
    probs = gl.exp2(scores * scale_log2 - lse[:, None])
    if (block * BLOCK + BLOCK > first_position) | ((members & all_members) != all_members):
        probs = gl.where(_visible(block, members, row_bit, row_valid, row_position, BLOCK,
                                  layout), probs, 0.0)
    return probs


@gluon.jit
def _dq_query_rows(Q, DOUT, OUT, LSE, DELTA, DQ, q_smem, do_smem, k_smem, v_smem, k_full,
                   k_empty, v_full, v_empty, blocks, members_of, walk_length, tile, index_head,
                   stride_q_t, stride_q_h, stride_do_t, stride_do_h, stride_o_t, stride_o_h,
                   stride_dq_t, stride_dq_h, scale, scale_log2, HI: gl.constexpr,
                   GQ: gl.constexpr, TOK: gl.constexpr, BLOCK: gl.constexpr,
                   HEAD_DIM: gl.constexpr, WRITE_DELTA: gl.constexpr, HALF: gl.constexpr):
    """One consumer warpgroup of the warp-specialized dQ: rows [64 HALF, 64 HALF + 64) of the
    tile (half of its tokens). It brings its q and dO rows into shared memory (and, with
    WRITE_DELTA, computes and writes their deltas), walks the loader's K and V rings, and stores
    its rows of dq.

    Per walk entry u: ``dQ += dS K`` of the warpgroup's previous entry (whose K stays held
    until then, "pending") and ``S_u = Q K_u^T`` are issued together; the held K goes back to
    the loader as soon as the first is done, then ``dP_u = dO V_u^T`` is issued and block u's
    exponentials run while it is computed. An entry none of the warpgroup's tokens kept is
    passed over as in the forward (``_fwd_query_rows``), the pending product done first when
    its K stage is the current entry's."""
    (seq_start, seq_len, first_position, first_query, end_query, all_members,
     query_base) = tile
    NUM_WARPS: gl.constexpr = gl.num_warps()
    ROWS: gl.constexpr = 64
    s_layout: gl.constexpr = _mma_layout(BLOCK, NUM_WARPS)  # scores [ROWS, BLOCK]
    o_layout: gl.constexpr = _mma_layout(HEAD_DIM, NUM_WARPS)  # [ROWS, D] accumulator
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    io_layout: gl.constexpr = _io_layout(HEAD_DIM, NUM_WARPS)
    rows_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    q_rows = q_smem.slice(HALF * ROWS, ROWS)
    do_rows = do_smem.slice(HALF * ROWS, ROWS)

    io_valid, io_token, io_head, dims = _tile_rows(index_head, first_position, first_query,
                                                   end_query, query_base, GQ, TOK, ROWS,
                                                   HEAD_DIM, io_layout, HALF * ROWS)
    q_rows.store(gl.load(Q + io_token[:, None] * stride_q_t + io_head[:, None] * stride_q_h
                         + dims[None, :], mask=io_valid[:, None], other=0.0))
    dout = gl.load(DOUT + io_token[:, None] * stride_do_t + io_head[:, None] * stride_do_h
                   + dims[None, :], mask=io_valid[:, None], other=0.0)
    do_rows.store(dout)
    if WRITE_DELTA:
        tile_delta = _row_deltas(OUT, dout, io_token, io_head, dims, io_valid, stride_o_t,
                                 stride_o_h)
    fence_async_shared()  # the products read q and dO through the async proxy

    heads, row_bit, row_valid, row_position = _mma_rows(first_position, first_query,
                                                        end_query, GQ, TOK, ROWS, rows_layout,
                                                        HALF * ROWS)
    row_index = ((query_base + row_position).to(gl.int64) * (HI * GQ) + index_head * GQ
                 + heads)
    lse = gl.load(LSE + row_index, mask=row_valid, other=0.0)
    if WRITE_DELTA:
        # Row r of the io rows is row r of the products (the same rows of q_rows).
        delta = gl.convert_layout(tile_delta, rows_layout)
        gl.store(DELTA + row_index, delta, mask=row_valid)
    else:
        delta = gl.load(DELTA + row_index, mask=row_valid, other=0.0)

    half_members = _half_members(HALF, TOK)
    half_all = all_members & half_members
    dq = gl.zeros((ROWS, HEAD_DIM), gl.float32, layout=o_layout)
    no_scores = gl.zeros((ROWS, BLOCK), gl.float32, layout=s_layout)
    no_dscores = gl.zeros((ROWS, BLOCK), Q.dtype.element_ty, layout=ds_layout)
    dscores = no_dscores
    pending = False  # dscores belong to entry `held`, whose K stage is still held
    held = 0
    for u in range(0, walk_length):
        stage = u % 2
        phase = (u // 2) & 1
        if pending & (held % 2 == stage):
            # The held K stage is entry u's: the loader brings u's K once it is handed back.
            dq = _pending_dsk(dscores, dq, k_smem, k_empty, held)
            dscores = no_dscores
            pending = False
        members = gl.load(members_of + u)
        if (members & half_members) != 0:
            # Without a pending entry, dS K multiplies zeros by this entry's K (as good as any
            # finite block) and hands nothing back.
            dq_stage = gl.where(pending, held, u) % 2
            mbarrier.wait(k_full.index(stage), phase)
            dq = warpgroup_mma(dscores, k_smem.index(dq_stage), dq, is_async=True)
            scores = warpgroup_mma(q_rows, k_smem.index(stage).permute((1, 0)), no_scores,
                                   use_acc=False, is_async=True)
            dq = warpgroup_mma_wait(num_outstanding=1, deps=(dq,))
            mbarrier.arrive(k_empty.index(held % 2), count=1, pred=pending)
            mbarrier.wait(v_full.index(stage), phase)
            dprobs = warpgroup_mma(do_rows, v_smem.index(stage).permute((1, 0)), no_scores,
                                   use_acc=False, is_async=True)
            # Q K^T of block u is done; its exponentials run while dO V^T does.
            scores = warpgroup_mma_wait(num_outstanding=1, deps=(scores,))
            probs = _masked_probs(scores, u, lse, blocks, members, first_position, half_all,
                                  row_bit, row_valid, row_position, scale_log2, BLOCK,
                                  s_layout)
            dprobs = warpgroup_mma_wait(num_outstanding=0, deps=(dprobs,))
            mbarrier.arrive(v_empty.index(stage), count=1)
            dscores = gl.convert_layout(
                (probs * (dprobs - delta[:, None])).to(Q.dtype.element_ty), ds_layout)
            pending = True
            held = u
        else:
            _pass_over(k_full, k_empty, v_full, v_empty, stage, phase)
    if pending:
        dq = _pending_dsk(dscores, dq, k_smem, k_empty, held)

    dq = gl.convert_layout((dq * scale).to(DQ.dtype.element_ty), io_layout)
    io_valid, io_token, io_head, dims = _tile_rows(index_head, first_position, first_query,
                                                   end_query, query_base, GQ, TOK, ROWS,
                                                   HEAD_DIM, io_layout, HALF * ROWS)
    gl.store(DQ + io_token[:, None] * stride_dq_t + io_head[:, None] * stride_dq_h
             + dims[None, :], dq, mask=io_valid[:, None])


@gluon.jit
def _pending_dsk(dscores, dq, k_smem, k_empty, held):
    """``dq + dS K`` of the pending entry ``held``, its K stage then handed back."""
    dq = warpgroup_mma(dscores, k_smem.index(held % 2), dq, is_async=True)
    dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
    mbarrier.arrive(k_empty.index(held % 2), count=1)
    return dq


@gluon.jit
def _row_deltas(OUT, dout, token, head, dims, valid, stride_o_t, stride_o_h):
    """Per row of ``dout`` (rows ``token``, ``head``): its delta, sum_d dO * O."""
    out = gl.load(OUT + token[:, None] * stride_o_t + head[:, None] * stride_o_h
                  + dims[None, :], mask=valid[:, None], other=0.0)
    return gl.sum(out.to(gl.float32) * dout.to(gl.float32), axis=1)


@gluon.jit
def _tile_deltas(DOUT, OUT, DELTA, tile, index_head, stride_do_t, stride_do_h, stride_o_t,
                 stride_o_h, HI: gl.constexpr, GQ: gl.constexpr, TOK: gl.constexpr,
                 HEAD_DIM: gl.constexpr, FIRST_ROW: gl.constexpr):
    """The deltas of 64 rows of a tile from FIRST_ROW, without its walk."""
    (_, _, first_position, first_query, end_query, _, query_base) = tile
    layout: gl.constexpr = _io_layout(HEAD_DIM, gl.num_warps())
    valid, token, head, dims = _tile_rows(index_head, first_position, first_query, end_query,
                                          query_base, GQ, TOK, 64, HEAD_DIM, layout, FIRST_ROW)
    dout = gl.load(DOUT + token[:, None] * stride_do_t + head[:, None] * stride_do_h
                   + dims[None, :], mask=valid[:, None], other=0.0)
    delta = _row_deltas(OUT, dout, token, head, dims, valid, stride_o_t, stride_o_h)
    gl.store(DELTA + token * (HI * GQ) + head, delta, mask=valid)


@gluon.jit
def _sparse_attn_dq_hopper_kernel(
    Q, DOUT, OUT, LSE, DELTA, DQ, k_desc, v_desc, SCHEDULE, UNION, UNION_MEMBERS, UNION_COUNT,
    CU_SEQLENS, query_start, query_end, stride_q_t, stride_q_h, stride_do_t, stride_do_h,
    stride_o_t, stride_o_h, stride_dq_t, stride_dq_h, scale, scale_log2,
    HI: gl.constexpr, GQ: gl.constexpr, KV_GROUP: gl.constexpr, TOK: gl.constexpr,
    BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr, UNION_SLOTS: gl.constexpr,
    WRITE_DELTA: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
    WALK_LIMIT: gl.constexpr,
):
    """dQ, query-outer and warp-specialized as the forward: the forward's loaders
    (``_ring_loads``, one warp each for K and V) and two warpgroups of 64 rows each
    (``_dq_query_rows``). With WRITE_DELTA the deltas (sum_d dO * O) are computed here from OUT
    and written to DELTA for the dK/dV kernel, instead of read from it. WALK_LIMIT > 0: a tile
    whose union holds more blocks is left to the key-outer dQ (with WRITE_DELTA, its deltas
    are still written here: the key-outer dQ and dK/dV read them)."""
    entry = gl.program_id(0)
    index_head = gl.program_id(1)
    sequence = gl.load(SCHEDULE + 2 * entry)
    if sequence < 0:  # padding entry
        return
    blocks, members_of, walk_length = _walk_of(UNION, UNION_MEMBERS, UNION_COUNT, entry,
                                               index_head, HI, UNION_SLOTS)
    tile = _tile_of(CU_SEQLENS, sequence, gl.load(SCHEDULE + 2 * entry + 1), query_start,
                    query_end, TOK)
    if WALK_LIMIT > 0:
        if walk_length > WALK_LIMIT:
            if WRITE_DELTA:  # the key-outer dQ, which takes this tile's rows, reads them
                for half in gl.static_range(2):
                    _tile_deltas(DOUT, OUT, DELTA, tile, index_head, stride_do_t,
                                 stride_do_h, stride_o_t, stride_o_h, HI, GQ, TOK, HEAD_DIM,
                                 half * 64)
            return
    seq_start = tile[0]
    kv_col = (index_head // KV_GROUP) * HEAD_DIM
    rows_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([128, HEAD_DIM],
                                                                   Q.dtype.element_ty)
    q_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [128, HEAD_DIM], rows_smem)
    do_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [128, HEAD_DIM], rows_smem)
    k_smem, v_smem, k_full, k_empty, v_full, v_empty = _block_rings(k_desc, v_desc, BLOCK,
                                                                    HEAD_DIM)
    # The constants go in literally: a tuple bound to a name would turn them into tensors.
    gl.warp_specialize([
        (_dq_query_rows, (Q, DOUT, OUT, LSE, DELTA, DQ, q_smem, do_smem, k_smem, v_smem,
                          k_full, k_empty, v_full, v_empty, blocks, members_of, walk_length,
                          tile, index_head, stride_q_t, stride_q_h, stride_do_t, stride_do_h,
                          stride_o_t, stride_o_h, stride_dq_t, stride_dq_h, scale, scale_log2,
                          HI, GQ, TOK, BLOCK, HEAD_DIM, WRITE_DELTA, 0)),
        (_dq_query_rows, (Q, DOUT, OUT, LSE, DELTA, DQ, q_smem, do_smem, k_smem, v_smem,
                          k_full, k_empty, v_full, v_empty, blocks, members_of, walk_length,
                          tile, index_head, stride_q_t, stride_q_h, stride_do_t, stride_do_h,
                          stride_o_t, stride_o_h, stride_dq_t, stride_dq_h, scale, scale_log2,
                          HI, GQ, TOK, BLOCK, HEAD_DIM, WRITE_DELTA, 1)),
        (_ring_loads, (k_desc, k_smem, k_full, k_empty, blocks, walk_length, seq_start,
                       kv_col, BLOCK)),
        (_ring_loads, (v_desc, v_smem, v_full, v_empty, blocks, walk_length, seq_start,
                       kv_col, BLOCK)),
    ], [4, 1, 1], [CONSUMER_REGS, LOADER_REGS, LOADER_REGS])


def attention_dq(q, k, v, dout, lse, delta, p, scale_log2: float, out=None,
                 walk_limit: int = 0):
    """dq of the main branch (q's dtype); ``supported(q, k, v, p)`` must hold and dout's last
    dimension be contiguous. Given ``out`` (last dimension contiguous), the kernel computes the
    deltas (``attention.backward.attention_delta``'s) itself and writes them into ``delta`` ([T, H]
    fp32), which it then does not read. ``walk_limit`` > 0: the rows of tiles whose union
    holds more blocks are left unwritten (key-outer's), but for their deltas."""
    dq = torch.empty_like(q)
    work = p.query_work
    shared = p.shared
    source = dout if out is None else out  # unread without WRITE_DELTA
    _sparse_attn_dq_hopper_kernel[p.query_grid()](
        q, dout, source, lse, delta, dq, _block_descriptor(k, p.block_size),
        _block_descriptor(v, p.block_size), work.schedule, work.union, work.union_members,
        work.union_count, p.cu_seqlens, p.query_start, p.query_start + p.total, q.stride(0),
        q.stride(1), dout.stride(0), dout.stride(1), source.stride(0), source.stride(1),
        dq.stride(0), dq.stride(1), p.scale, scale_log2, HI=shared["HI"], GQ=shared["GQ"],
        KV_GROUP=shared["KV_GROUP"], TOK=p.query_tokens, BLOCK=p.block_size,
        HEAD_DIM=p.head_dim, UNION_SLOTS=work.union.shape[-1], WRITE_DELTA=out is not None,
        CONSUMER_REGS=DQ_REGISTERS[0], LOADER_REGS=DQ_REGISTERS[1], WALK_LIMIT=walk_limit,
        num_warps=4,
        maxnreg=_maxnreg(3, DQ_REGISTERS))
    return dq


@gluon.jit
def _dkdv_key_rows(pointers, buffers, work, HI: gl.constexpr, GQ: gl.constexpr,
                   TOK: gl.constexpr, BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr,
                   STAGES: gl.constexpr, HALF: gl.constexpr):
    """One consumer warpgroup of the warp-specialized dK/dV: keys [64 HALF, 64 HALF + 64) of
    the block, through every step the gather partition delivers (full barriers), handing each
    slot back (empty barriers) once its dV and dK products are done."""
    Q, DOUT, LSE, DELTA, DK_PART, DV_PART, PAIR_TOKEN = pointers
    (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, token_smem, kv_ready, full,
     empty) = buffers
    (segment, first, last, block, query_base, index_head, steps, diagonal_steps, scale_log2,
     stride_q_t, stride_q_h, stride_do_t, stride_do_h) = work
    NUM_WARPS: gl.constexpr = gl.num_warps()
    ROWS: gl.constexpr = 32
    KEYS: gl.constexpr = 64
    s_layout: gl.constexpr = _mma_layout(ROWS, NUM_WARPS)  # transposed scores [KEYS, ROWS]
    o_layout: gl.constexpr = _mma_layout(HEAD_DIM, NUM_WARPS)  # dK, dV [KEYS, D]
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    cols_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    k_rows = k_smem.slice(HALF * KEYS, KEYS)
    v_rows = v_smem.slice(HALF * KEYS, KEYS)
    key_pos = (block * BLOCK + HALF * KEYS
               + gl.arange(0, KEYS, layout=gl.SliceLayout(1, s_layout)))
    cols = gl.arange(0, ROWS, layout=cols_layout)
    no_scores = gl.zeros((KEYS, ROWS), gl.float32, layout=s_layout)
    dk = gl.zeros((KEYS, HEAD_DIM), gl.float32, layout=o_layout)
    dv = gl.zeros((KEYS, HEAD_DIM), gl.float32, layout=o_layout)
    probs = gl.zeros((KEYS, ROWS), Q.dtype.element_ty, layout=a_layout)
    dscores = gl.zeros((KEYS, ROWS), Q.dtype.element_ty, layout=a_layout)
    mbarrier.wait(kv_ready, 0)
    for j in range(0, steps):
        slot = j % STAGES
        previous = (j + STAGES - 1) % STAGES
        mbarrier.wait(full.index(slot), (j // STAGES) & 1)
        fence_async_shared()
        scores = warpgroup_mma(k_rows, q_smem.index(slot).permute((1, 0)), no_scores,
                               use_acc=False, is_async=True)
        dprobs = warpgroup_mma(v_rows, do_smem.index(slot).permute((1, 0)), no_scores,
                               use_acc=False, is_async=True)
        # dV and dK of step j - 1 (zero operands at j = 0) run while step j's exponentials do.
        dv_token = warpgroup_mma(probs, do_smem.index(previous), dv, is_async=True)
        dk_token = warpgroup_mma(dscores, q_smem.index(previous), dk, is_async=True)
        lse = lse_smem.index(slot).load(cols_layout)
        delta = delta_smem.index(slot).load(cols_layout)
        scores, dprobs = warpgroup_mma_wait(num_outstanding=2, deps=(scores, dprobs))
        col_valid = (first + j * TOK + cols % TOK < last) & (cols // TOK < GQ)
        probs_t = gl.where(col_valid[None, :], gl.exp2(scores * scale_log2 - lse[None, :]), 0.0)
        if j < diagonal_steps:
            query_pos = token_smem.index(slot).load(cols_layout) - query_base
            probs_t = gl.where(key_pos[:, None] <= query_pos[None, :], probs_t, 0.0)
        dscores_t = probs_t * (dprobs - delta[None, :])
        probs_t = probs_t.to(Q.dtype.element_ty)
        dscores_t = dscores_t.to(Q.dtype.element_ty)
        dv, dk, probs_t, dscores_t = warpgroup_mma_wait(
            num_outstanding=0, deps=(dv_token, dk_token, probs_t, dscores_t))
        # Done with step j - 1's slot (the compiler syncs the warpgroup before one thread
        # arrives).
        mbarrier.arrive(empty.index(previous), count=1)
        probs = gl.convert_layout(probs_t, a_layout)
        dscores = gl.convert_layout(dscores_t, a_layout)
    last_slot = (steps + STAGES - 1) % STAGES
    dv = warpgroup_mma(probs, do_smem.index(last_slot), dv, is_async=True)
    dk = warpgroup_mma(dscores, q_smem.index(last_slot), dk, is_async=True)
    dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
    keys = HALF * KEYS + gl.arange(0, KEYS, layout=gl.SliceLayout(1, o_layout))
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    offsets = (segment.to(gl.int64) * BLOCK + keys)[:, None] * HEAD_DIM + dims[None, :]
    gl.store(DK_PART + offsets, dk)
    gl.store(DV_PART + offsets, dv)


@gluon.jit
def _dkdv_gather(pointers, buffers, work, HI: gl.constexpr, GQ: gl.constexpr,
                 TOK: gl.constexpr, BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr,
                 STAGES: gl.constexpr):
    """The gather partition (one warp) of the warp-specialized dK/dV: each step's q and dO
    rows, log-sum-exps, deltas and tokens by ``cp.async`` into the ring, each slot once the
    consumers handed it back; a slot is full when every copy into it has landed."""
    Q, DOUT, LSE, DELTA, DK_PART, DV_PART, PAIR_TOKEN = pointers
    (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, token_smem, kv_ready, full,
     empty) = buffers
    (segment, first, last, block, query_base, index_head, steps, diagonal_steps, scale_log2,
     stride_q_t, stride_q_h, stride_do_t, stride_do_h) = work
    ROWS: gl.constexpr = 32
    # One row per thread: a row's 16-byte pieces share one address register.
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [1, 1], [1, 0])
    row_layout: gl.constexpr = gl.SliceLayout(1, io_layout)
    rows = gl.arange(0, ROWS, layout=row_layout)
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, io_layout))
    head = index_head * GQ + rows // TOK
    tokens = _step_tokens(PAIR_TOKEN, first, last, GQ, TOK, ROWS, row_layout)
    for j in range(0, steps):
        slot = j % STAGES
        valid = tokens < (1 << 30)
        token = gl.where(valid, tokens, 0).to(gl.int64)
        # Slot j % STAGES is free once step j - STAGES is done (slot STAGES - 1 also once
        # the zeros of step -1 are): completion (j + 1) // STAGES of its empty barrier.
        mbarrier.wait(empty.index(slot), (((j + 1) // STAGES) & 1) ^ 1)
        q_row = Q + token * stride_q_t + head * stride_q_h
        async_copy.async_copy_global_to_shared(q_smem.index(slot),
                                               q_row[:, None] + dims[None, :],
                                               mask=valid[:, None])
        do_row = DOUT + token * stride_do_t + head * stride_do_h
        async_copy.async_copy_global_to_shared(do_smem.index(slot),
                                               do_row[:, None] + dims[None, :],
                                               mask=valid[:, None])
        row = token * (HI * GQ) + head
        async_copy.async_copy_global_to_shared(lse_smem.index(slot), LSE + row, mask=valid)
        async_copy.async_copy_global_to_shared(delta_smem.index(slot), DELTA + row, mask=valid)
        async_copy.async_copy_global_to_shared(token_smem.index(slot),
                                               PAIR_TOKEN + first + j * TOK + rows % TOK,
                                               mask=valid)
        async_copy.mbarrier_arrive(full.index(slot), increment_count=False)
        # The next step's tokens, read while this one's rows arrive.
        tokens = _step_tokens(PAIR_TOKEN, first + (j + 1) * TOK, last, GQ, TOK, ROWS,
                              row_layout)


@gluon.jit
def _sparse_attn_dkdv_hopper_kernel(
    Q, DOUT, LSE, DELTA, DK_PART, DV_PART, k_desc, v_desc,
    SEGMENTS, SEGMENT_ORDER, PAIR_TOKEN, BUCKET_START, BUCKET_COUNT, BLOCK_SEQUENCE,
    BLOCK_LOCAL, CU_SEQLENS, query_start,
    stride_q_t, stride_q_h, stride_do_t, stride_do_h, scale_log2, SKIP,
    HI: gl.constexpr, GQ: gl.constexpr, KV_GROUP: gl.constexpr, TOK: gl.constexpr,
    BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr, SEGMENT_PAIRS: gl.constexpr,
    STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, GATHER_REGS: gl.constexpr,
    WITH_SKIP: gl.constexpr = False,
):
    """Key-outer dK, dV of one segment, warp-specialized: one warp gathers the steps' rows
    (``_dkdv_gather``) and each warpgroup computes 64 keys of the block (``_dkdv_key_rows``;
    the first is the launch's 4 warps, the second a worker partition) with no barrier between
    the two, so that one's products run while the other's exponentials do. WITH_SKIP: the
    segments flagged in SKIP (int32 per segment) are left (another kernel writes them)."""
    NUM_WARPS: gl.constexpr = gl.num_warps()
    ROWS: gl.constexpr = 32
    io_layout: gl.constexpr = _io_layout(HEAD_DIM, NUM_WARPS)
    row_layout: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
    vector_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])

    segment = gl.load(SEGMENT_ORDER + gl.program_id(0))
    bucket = gl.load(SEGMENTS + 2 * segment)
    if bucket < 0:  # padding segment
        return
    if WITH_SKIP:
        if gl.load(SKIP + segment) != 0:
            return
    first, last, index_head, block, seq_start, query_base = _segment_of(
        SEGMENTS, BUCKET_START, BUCKET_COUNT, BLOCK_SEQUENCE, BLOCK_LOCAL, CU_SEQLENS,
        query_start, segment, bucket, HI, SEGMENT_PAIRS)
    steps = (last - first + TOK - 1) // TOK

    k_smem = gl.allocate_shared_memory(k_desc.dtype, [BLOCK, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [BLOCK, HEAD_DIM], v_desc.layout)
    step_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM],
                                                                   Q.dtype.element_ty)
    q_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [STAGES, ROWS, HEAD_DIM], step_smem)
    do_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [STAGES, ROWS, HEAD_DIM], step_smem)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, ROWS], vector_smem)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, ROWS], vector_smem)
    token_smem = gl.allocate_shared_memory(gl.int32, [STAGES, ROWS], vector_smem)
    # A consumer warpgroup per 64 keys hands each slot back.
    kv_ready, full, empty = _step_barriers(STAGES, BLOCK // 64)
    _block_kv_loads(k_desc, v_desc, k_smem, v_smem, kv_ready, seq_start, block, index_head,
                    KV_GROUP, BLOCK, HEAD_DIM)
    # Step -1's slot: zeros, which the first iteration's dV and dK products multiply by zeros.
    no_rows = gl.zeros((ROWS, HEAD_DIM), Q.dtype.element_ty, layout=io_layout)
    q_smem.index(STAGES - 1).store(no_rows)
    do_smem.index(STAGES - 1).store(no_rows)
    fence_async_shared()
    diagonal_steps = (_diagonal_pairs(PAIR_TOKEN, first, last, query_base, block, BLOCK,
                                      row_layout) + TOK - 1) // TOK
    pointers = (Q, DOUT, LSE, DELTA, DK_PART, DV_PART, PAIR_TOKEN)
    buffers = (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, token_smem, kv_ready,
               full, empty)
    work = (segment, first, last, block, query_base, index_head, steps, diagonal_steps,
            scale_log2, stride_q_t, stride_q_h, stride_do_t, stride_do_h)
    # The constants go in literally: a tuple bound to a name would turn them into tensors.
    if BLOCK == 128:
        gl.warp_specialize([
            (_dkdv_key_rows, (pointers, buffers, work, HI, GQ, TOK, BLOCK, HEAD_DIM, STAGES, 0)),
            (_dkdv_key_rows, (pointers, buffers, work, HI, GQ, TOK, BLOCK, HEAD_DIM, STAGES, 1)),
            (_dkdv_gather, (pointers, buffers, work, HI, GQ, TOK, BLOCK, HEAD_DIM, STAGES)),
        ], [4, 1], [CONSUMER_REGS, GATHER_REGS])
    else:
        gl.warp_specialize([
            (_dkdv_key_rows, (pointers, buffers, work, HI, GQ, TOK, BLOCK, HEAD_DIM, STAGES, 0)),
            (_dkdv_gather, (pointers, buffers, work, HI, GQ, TOK, BLOCK, HEAD_DIM, STAGES)),
        ], [1], [GATHER_REGS])


def supported_key_outer(q, k, v, dout, p) -> bool:
    """Whether the dK/dV kernel runs ``p``'s backward: as ``supported``, with 32-row steps
    instead of 128-row query tiles, and q and dO rows that 16-byte copies can gather."""
    return (_hopper_16bit(q, k, v, dout) and p.head_dim in HEAD_DIMS
            and p.block_size in BLOCK_SIZES and key_step_tokens(p.gq) is not None
            and _tma_ready(k) and _tma_ready(v) and _rows_ready(q) and _rows_ready(dout))


def _dkdv_maxnreg(block_size: int, registers: tuple) -> int:
    """The dK/dV kernel's register limit: a consumer warpgroup per 64 keys, the gather warp."""
    workers = registers if block_size == 128 else registers[1:]
    return _maxnreg(len(workers) + 1, workers)


def attention_dkdv_parts(q, k, v, dout, lse, delta, p, scale_log2: float,
                         stages: int = KEY_STEP_STAGES, registers: tuple = KEY_STEP_REGISTERS,
                         skip=None, parts=None):
    """fp32 dK (unscaled) and dV partials per segment of ``p``'s key-block list, as the Triton
    kernel writes them; ``supported_key_outer(q, k, v, dout, p)`` must hold. ``skip``: int32
    flags per segment, those set left unwritten (another kernel's); ``parts``: the (dk, dv)
    partials to write into (new ones by default)."""
    work = p.block_work
    segments = work.segments.shape[0]
    dk_part, dv_part = parts or (torch.empty(segments * p.block_size, p.head_dim,
                                             dtype=torch.float32, device=q.device)
                                 for _ in range(2))
    shared = p.shared
    _sparse_attn_dkdv_hopper_kernel[(segments,)](
        q, dout, lse, delta, dk_part, dv_part, _block_descriptor(k, p.block_size),
        _block_descriptor(v, p.block_size), work.segments, work.segment_order, work.pair_token,
        work.bucket_start, work.bucket_count, work.block_sequence, work.block_local,
        p.cu_seqlens, p.query_start, q.stride(0), q.stride(1), dout.stride(0), dout.stride(1),
        scale_log2, skip, HI=shared["HI"], GQ=shared["GQ"], KV_GROUP=shared["KV_GROUP"],
        TOK=key_step_tokens(p.gq), BLOCK=p.block_size, HEAD_DIM=p.head_dim,
        SEGMENT_PAIRS=work.segment_pairs, STAGES=stages, CONSUMER_REGS=registers[0],
        GATHER_REGS=registers[1], WITH_SKIP=skip is not None, num_warps=4,
        maxnreg=_dkdv_maxnreg(p.block_size, registers))
    return dk_part, dv_part
