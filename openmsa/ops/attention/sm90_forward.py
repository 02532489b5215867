"""The main attention's forward for Hopper GPUs, in Gluon: the Triton forward's program
(``attention.forward``, main branch only) with K and V blocks arriving by TMA into rings of
shared memory, asynchronous tensor-core products (block u's exponentials run during ``P V`` of
block u - 1) and warp specialization (a loader warp each for K and V, two consumer warpgroups of
64 rows each, each taking half of the tile's tokens).
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ..configs import FORWARD_REGISTERS
from ..sm90 import (_block_descriptor, _block_rings, _half_members, _io_layout, _maxnreg,
                    _mma_layout, _mma_rows, _pass_over, _ring_loads, _row_member, _tile_of,
                    _tile_rows, _visible, _walk_of)


@gluon.jit
def _online_softmax(scores, u, running_max, running_sum, blocks, members, first_position,
                    all_members, row_bit, row_valid, row_position, scale_log2,
                    BLOCK: gl.constexpr, layout: gl.constexpr):
    """Walk entry u's probabilities (unnormalized, base 2) and the running max and sum. Masked
    only where the block needs it (see tiles._walk_block); ``all_members``: the members mask
    of a block all the warpgroup's queries kept; ``members``: entry u's."""
    block = gl.load(blocks + u)
    scores = scores * scale_log2
    if block * BLOCK + BLOCK > first_position:  # the tile's own block(s): a mask per element
        scores = gl.where(_visible(block, members, row_bit, row_valid, row_position, BLOCK,
                                   layout), scores, float("-inf"))
    elif (members & all_members) != all_members:  # before the tile only whole rows drop out
        scores = gl.where(_row_member(members, row_bit, row_valid)[:, None], scores,
                          float("-inf"))
    new_max = gl.maximum(running_max, gl.max(scores, axis=1))
    safe_max = gl.where(new_max == float("-inf"), 0.0, new_max)
    rescale = gl.exp2(running_max - safe_max)
    probs = gl.exp2(scores - safe_max[:, None])
    running_sum = running_sum * rescale + gl.sum(probs, axis=1)
    return probs, rescale, new_max, running_sum


@gluon.jit
def _fwd_query_rows(Q, OUT, LSE, q_smem, k_smem, v_smem, k_full, k_empty, v_full, v_empty,
                    blocks, members_of, walk_length, tile, index_head, stride_o_t, stride_o_h,
                    scale_log2, HI: gl.constexpr, GQ: gl.constexpr, TOK: gl.constexpr,
                    BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr, HALF: gl.constexpr):
    """One consumer warpgroup of the warp-specialized forward: rows [64 HALF, 64 HALF + 64) of
    the tile (half of its tokens) through its walk, then their out and log-sum-exp.

    Walk entry u's ``S_u = Q K_u^T`` is issued with ``O += P V`` of the warpgroup's previous
    entry, whose V stays held until then ("pending"); block u's exponentials run while that
    product does. An entry none of the warpgroup's tokens kept is passed over: its stages are
    handed back at once. The pending entry is at most two behind; when it is, its V stage is
    the current entry's: an entry passed over does its ``P V`` first (it waits for u's V),
    an entry computed issues it as always (the loader brings K(u) meanwhile, V(u) after)."""
    (seq_start, seq_len, first_position, first_query, end_query, all_members,
     query_base) = tile
    NUM_WARPS: gl.constexpr = gl.num_warps()
    ROWS: gl.constexpr = 64
    s_layout: gl.constexpr = _mma_layout(BLOCK, NUM_WARPS)  # scores [ROWS, BLOCK]
    o_layout: gl.constexpr = _mma_layout(HEAD_DIM, NUM_WARPS)  # [ROWS, D] accumulator
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    io_layout: gl.constexpr = _io_layout(HEAD_DIM, NUM_WARPS)
    rows_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    q_rows = q_smem.slice(HALF * ROWS, ROWS)
    heads, row_bit, row_valid, row_position = _mma_rows(first_position, first_query, end_query,
                                                        GQ, TOK, ROWS, rows_layout, HALF * ROWS)
    half_members = _half_members(HALF, TOK)
    half_all = all_members & half_members
    running_max = gl.full((ROWS,), float("-inf"), gl.float32, layout=rows_layout)
    running_sum = gl.zeros((ROWS,), gl.float32, layout=rows_layout)
    acc = gl.zeros((ROWS, HEAD_DIM), gl.float32, layout=o_layout)
    no_scores = gl.zeros((ROWS, BLOCK), gl.float32, layout=s_layout)
    no_probs = gl.zeros((ROWS, BLOCK), Q.dtype.element_ty, layout=p_layout)
    p = no_probs
    pending = False  # p holds the probabilities of entry `held`, whose V stage is still held
    held = 0
    for u in range(0, walk_length):
        stage = u % 2
        phase = (u // 2) & 1
        members = gl.load(members_of + u)
        mine = (members & half_members) != 0
        if pending & (held % 2 == stage) & (not mine):
            # The held V stage is entry u's: the loader brings u's V once it is handed back.
            acc = _pending_pv(p, acc, v_smem, v_full, v_empty, held)
            p = no_probs
            pending = False
        if mine:
            # Without a pending entry, P V multiplies zeros by this entry's V (as good as any
            # finite block) and hands nothing back.
            pv_entry = gl.where(pending, held, u)
            mbarrier.wait(k_full.index(stage), phase)
            scores = warpgroup_mma(q_rows, k_smem.index(stage).permute((1, 0)), no_scores,
                                   use_acc=False, is_async=True)
            mbarrier.wait(v_full.index(pv_entry % 2), (pv_entry // 2) & 1)
            pv = warpgroup_mma(p, v_smem.index(pv_entry % 2), acc, is_async=True)
            scores = warpgroup_mma_wait(num_outstanding=1, deps=(scores,))
            mbarrier.arrive(k_empty.index(stage), count=1)
            probs, rescale, running_max, running_sum = _online_softmax(
                scores, u, running_max, running_sum, blocks, members, first_position,
                half_all, row_bit, row_valid, row_position, scale_log2, BLOCK, s_layout)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(pv,))
            mbarrier.arrive(v_empty.index(held % 2), count=1, pred=pending)
            acc = acc * gl.convert_layout(rescale, gl.SliceLayout(1, o_layout))[:, None]
            p = gl.convert_layout(probs.to(Q.dtype.element_ty), p_layout)
            pending = True
            held = u
        else:
            _pass_over(k_full, k_empty, v_full, v_empty, stage, phase)
    if pending:
        acc = _pending_pv(p, acc, v_smem, v_full, v_empty, held)

    running_sum = gl.where(row_valid, running_sum, 1.0)
    out = acc / gl.convert_layout(running_sum, gl.SliceLayout(1, o_layout))[:, None]
    out = gl.convert_layout(out.to(OUT.dtype.element_ty), io_layout)
    io_valid, io_token, io_head, dims = _tile_rows(index_head, first_position, first_query,
                                                   end_query, query_base, GQ, TOK, ROWS,
                                                   HEAD_DIM, io_layout, HALF * ROWS)
    gl.store(OUT + io_token[:, None] * stride_o_t + io_head[:, None] * stride_o_h
             + dims[None, :], out, mask=io_valid[:, None])
    row_head = index_head * GQ + heads
    gl.store(LSE + (query_base + row_position).to(gl.int64) * (HI * GQ) + row_head,
             running_max + gl.log2(running_sum), mask=row_valid)


@gluon.jit
def _pending_pv(p, acc, v_smem, v_full, v_empty, held):
    """``acc + P V`` of the pending entry ``held``, its V stage then handed back."""
    mbarrier.wait(v_full.index(held % 2), (held // 2) & 1)
    acc = warpgroup_mma(p, v_smem.index(held % 2), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(v_empty.index(held % 2), count=1)
    return acc


@gluon.jit
def _sparse_attn_fwd_hopper_kernel(
    Q, k_desc, v_desc, OUT, LSE, SCHEDULE, UNION, UNION_MEMBERS, UNION_COUNT, CU_SEQLENS,
    query_start, query_end, stride_q_t, stride_q_h, stride_o_t, stride_o_h, scale_log2,
    HI: gl.constexpr, GQ: gl.constexpr, KV_GROUP: gl.constexpr, TOK: gl.constexpr,
    BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr, UNION_SLOTS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, WALK_LIMIT: gl.constexpr,
):
    """The forward warp-specialized: a warp each loads the walk's K and V blocks
    (``_ring_loads``) and each warpgroup computes 64 of the tile's 128 rows
    (``_fwd_query_rows``; the first is the launch's 4 warps, the second a worker partition),
    with no barrier between the two.
    WALK_LIMIT > 0: a tile whose union holds more blocks is left to the key-outer forward."""
    NUM_WARPS: gl.constexpr = gl.num_warps()
    ROWS: gl.constexpr = 128
    io_layout: gl.constexpr = _io_layout(HEAD_DIM, NUM_WARPS)

    entry = gl.program_id(0)
    index_head = gl.program_id(1)
    sequence = gl.load(SCHEDULE + 2 * entry)
    if sequence < 0:  # padding entry
        return
    blocks, members_of, walk_length = _walk_of(UNION, UNION_MEMBERS, UNION_COUNT, entry,
                                               index_head, HI, UNION_SLOTS)
    if WALK_LIMIT > 0:
        if walk_length > WALK_LIMIT:
            return
    tile = _tile_of(CU_SEQLENS, sequence, gl.load(SCHEDULE + 2 * entry + 1), query_start,
                    query_end, TOK)
    (seq_start, seq_len, first_position, first_query, end_query, all_members,
     query_base) = tile
    io_valid, io_token, io_head, dims = _tile_rows(index_head, first_position, first_query,
                                                   end_query, query_base, GQ, TOK, ROWS,
                                                   HEAD_DIM, io_layout)
    q = gl.load(Q + io_token[:, None] * stride_q_t + io_head[:, None] * stride_q_h
                + dims[None, :], mask=io_valid[:, None], other=0.0)
    q_smem = gl.allocate_shared_memory(
        Q.dtype.element_ty, [ROWS, HEAD_DIM],
        gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], Q.dtype.element_ty), q)
    kv_col = (index_head // KV_GROUP) * HEAD_DIM
    k_smem, v_smem, k_full, k_empty, v_full, v_empty = _block_rings(k_desc, v_desc, BLOCK,
                                                                    HEAD_DIM)
    # The constants go in literally: a tuple bound to a name would turn them into tensors.
    gl.warp_specialize([
        (_fwd_query_rows, (Q, OUT, LSE, q_smem, k_smem, v_smem, k_full, k_empty, v_full,
                           v_empty, blocks, members_of, walk_length, tile, index_head,
                           stride_o_t, stride_o_h, scale_log2, HI, GQ, TOK, BLOCK, HEAD_DIM, 0)),
        (_fwd_query_rows, (Q, OUT, LSE, q_smem, k_smem, v_smem, k_full, k_empty, v_full,
                           v_empty, blocks, members_of, walk_length, tile, index_head,
                           stride_o_t, stride_o_h, scale_log2, HI, GQ, TOK, BLOCK, HEAD_DIM, 1)),
        (_ring_loads, (k_desc, k_smem, k_full, k_empty, blocks, walk_length, seq_start,
                       kv_col, BLOCK)),
        (_ring_loads, (v_desc, v_smem, v_full, v_empty, blocks, walk_length, seq_start,
                       kv_col, BLOCK)),
    ], [4, 1, 1], [CONSUMER_REGS, LOADER_REGS, LOADER_REGS])


def sparse_attention_fwd(q, k, v, p, scale_log2: float, walk_limit: int = 0):
    """out [Tq, H, D] and lse2 [Tq, H] of the main branch; ``supported(q, k, v, p)`` must
    hold. ``walk_limit`` > 0: the rows of tiles whose union holds more blocks are left
    unwritten (key-outer's)."""
    out = torch.empty_like(q)
    lse = torch.empty(p.total, p.num_heads, dtype=torch.float32, device=q.device)
    work = p.query_work
    shared = p.shared
    _sparse_attn_fwd_hopper_kernel[p.query_grid()](
        q, _block_descriptor(k, p.block_size), _block_descriptor(v, p.block_size), out, lse,
        work.schedule, work.union, work.union_members, work.union_count, p.cu_seqlens,
        p.query_start, p.query_start + p.total, q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), scale_log2, HI=shared["HI"], GQ=shared["GQ"],
        KV_GROUP=shared["KV_GROUP"], TOK=p.query_tokens, BLOCK=p.block_size,
        HEAD_DIM=p.head_dim, UNION_SLOTS=work.union.shape[-1],
        CONSUMER_REGS=FORWARD_REGISTERS[0], LOADER_REGS=FORWARD_REGISTERS[1],
        WALK_LIMIT=walk_limit, num_warps=4,
        maxnreg=_maxnreg(3, FORWARD_REGISTERS))
    return out, lse
