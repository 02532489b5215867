"""The main attention's kernels and the KL kernel for Hopper GPUs (sm_90), in Gluon, Triton's
lower-level language.

They run the programs of the Triton kernels in ``attention``, on the same work lists:

- forward (main branch only) and dQ, query-outer: one program per (query tile, index head)
  walks the distinct blocks its tokens kept; a row sees a block only if its own token kept it;
- dK/dV and the KL, key-outer: one program per segment of the pairs (token, index head) that
  kept one key block.

What the Triton kernels cannot express:

- K and V blocks arrive by TMA into rings of shared memory (query-outer), or the gathered q,
  dO and index_q rows by ``cp.async`` (key-outer), the next ones while these are computed;
- the tensor-core products are issued asynchronously and waited for explicitly, so that
  exponentials run while the tensor cores compute another product: block u's exponentials
  during ``P V`` of block u - 1 (forward) or ``dO V_u^T`` (dQ), step j's during dV and dK of
  step j - 1 (dK/dV), head g's during head g + 1's scores (KL). This is the intra-warpgroup
  overlap of FlashAttention-3;
- warp specialization (forward, dQ, dK/dV): one warp loads the key blocks (forward and dQ, by
  TMA) or gathers the query rows (dK/dV) while each of two warpgroups computes half of the
  tile's rows or of the key block, synchronized by mbarriers instead of CTA-wide barriers, so
  that one warpgroup's products run while the other's exponentials do.

The forward and dQ are bitwise equal to the Triton kernels (same products, same order); dK/dV
and the KL sum the same terms in other groupings, equal up to fp32 rounding (all tested on the
GPU). ``supported``, ``supported_key_outer`` and ``supported_kl`` say which inputs they take;
the others, the CPU interpreter and the index branch's log-sum-exp run the Triton kernels. See
docs/KERNELS.md.
"""
from __future__ import annotations

import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

LN_2 = gl.constexpr(math.log(2.0))
NUM_WARPS = 8  # two warpgroups: the MMA rows (128) split 64 / 64
ROWS = 128
HEAD_DIMS = (64, 128)
BLOCK_SIZES = (64, 128)


@gluon.constexpr_function
def _mma_layout(n, num_warps):
    """The wgmma accumulator layout of [128, n] products: the warps stacked along the rows."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                     instr_shape=[16, n, 16])


@gluon.constexpr_function
def _io_layout(head_dim, num_warps):
    """Rows of 16-bit [*, head_dim] tiles in 16-byte pieces, for loads and stores."""
    return gl.BlockedLayout([1, 8], [32 * 8 // head_dim, head_dim // 8], [num_warps, 1], [1, 0])


@gluon.jit
def _issue_block_load(desc, barrier, smem, row, col, pred):
    """TMA of one key block's [BLOCK, D] rows into ``smem``, completing on ``barrier``."""
    mbarrier.expect(barrier, desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(desc, [row, col], barrier, smem, pred=pred)


@gluon.jit
def _block_row(blocks, u, walk_length, seq_start, BLOCK: gl.constexpr):
    """Packed row of the first key of walk entry ``u`` (clamped into the walk, so that a
    predicated-off load still has a valid address)."""
    block = gl.load(blocks + gl.minimum(u, walk_length - 1))
    return (seq_start + block * BLOCK).to(gl.int32)


@gluon.jit
def _tile_rows(index_head, first_position, first_query, end_query, query_base,
               GQ: gl.constexpr, TOK: gl.constexpr, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
               layout: gl.constexpr, FIRST_ROW: gl.constexpr = 0):
    """Per row of a [ROWS, HEAD_DIM] tile in ``layout``: whether it is a query, its token's
    row in the query tensors, its head; and the column indices. Computed where needed (before
    the walk, and again after it) rather than held in registers across it. The tile's rows
    [FIRST_ROW, FIRST_ROW + ROWS)."""
    rows = FIRST_ROW + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    valid = (rows // TOK < GQ) & (rows % TOK >= first_query) & (rows % TOK < end_query)
    token = (query_base + first_position + rows % TOK).to(gl.int64)
    return valid, token, index_head * GQ + rows // TOK, dims


@gluon.jit
def _tile_of(CU_SEQLENS, sequence, tile, query_start, query_end, TOK: gl.constexpr):
    """A query tile's sequence start and length, first position, queries (its tokens
    [first_query, end_query), see attention._query_tile), the members mask of a block all its
    queries kept, and the query row of the sequence's position 0."""
    seq_start = gl.load(CU_SEQLENS + sequence)
    seq_len = gl.load(CU_SEQLENS + sequence + 1) - seq_start
    first_position = tile * TOK
    first_query = gl.maximum(query_start - seq_start - first_position, 0)
    end_query = gl.minimum(gl.minimum(query_end - seq_start, seq_len) - first_position, TOK)
    one = first_query.to(gl.int64) * 0 + 1
    all_members = (gl.where(end_query >= 64, -1, (one << end_query.to(gl.int64)) - 1)
                   - ((one << first_query.to(gl.int64)) - 1))
    return (seq_start, seq_len, first_position, first_query, end_query, all_members,
            seq_start - query_start)


@gluon.jit
def _mma_rows(first_position, first_query, end_query, GQ: gl.constexpr, TOK: gl.constexpr,
              ROWS: gl.constexpr, layout: gl.constexpr, FIRST_ROW: gl.constexpr = 0):
    """Per MMA row (in ``layout``, a row slice of the products; the tile's rows [FIRST_ROW,
    FIRST_ROW + ROWS)): its index, its token's bit in a members mask, whether it is a query,
    its position."""
    rows = FIRST_ROW + gl.arange(0, ROWS, layout=layout)
    row_valid = (rows // TOK < GQ) & (rows % TOK >= first_query) & (rows % TOK < end_query)
    return rows, (rows % TOK).to(gl.int64), row_valid, first_position + rows % TOK


@gluon.jit
def _walk_of(UNION, UNION_MEMBERS, UNION_COUNT, entry, index_head, HI: gl.constexpr,
             UNION_SLOTS: gl.constexpr):
    """The tile's walk list (attention._walk_list): blocks, token masks, length."""
    walk = (entry * HI + index_head) * UNION_SLOTS
    return (UNION + walk, UNION_MEMBERS + walk,
            gl.load(UNION_COUNT + entry * HI + index_head))


@gluon.jit
def _row_member(members, row_bit, row_valid):
    """Per row, whether its token kept the block whose token mask is ``members``. Before the
    tile the forward masks a block by a select per row instead of a mask per element (a bias of
    -inf added to the scores would be cheaper still, but leaves NaN scores NaN). dQ keeps one
    branch, ``_visible``'s comparison per element: a second branch made ptxas spill 56 bytes at
    16 heads per index head."""
    return (((members >> row_bit) & 1) != 0) & row_valid


@gluon.jit
def _visible(block, members, row_bit, row_valid, row_position, BLOCK: gl.constexpr,
             layout: gl.constexpr):
    """[ROWS, BLOCK]: whether a row sees a key of ``block``: its token kept the block and the
    key is not after the query (so it is in the sequence, as the query is). One comparison per
    element, with the row's last key: -1 where its token did not keep the block."""
    key_pos = block * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(0, layout))
    last_key = gl.where(_row_member(members, row_bit, row_valid), row_position, -1)
    return key_pos[None, :] <= last_key[:, None]


@gluon.jit
def _online_softmax(scores, u, running_max, running_sum, blocks, members_of, first_position,
                    all_members, row_bit, row_valid, row_position, scale_log2,
                    BLOCK: gl.constexpr, layout: gl.constexpr):
    """Walk entry u's probabilities (unnormalized, base 2) and the running max and sum. Masked
    only where the block needs it (see attention._walk_block)."""
    block = gl.load(blocks + u)
    members = gl.load(members_of + u)
    scores = scores * scale_log2
    if block * BLOCK + BLOCK > first_position:  # the tile's own block(s): a mask per element
        scores = gl.where(_visible(block, members, row_bit, row_valid, row_position, BLOCK,
                                   layout), scores, float("-inf"))
    elif members != all_members:  # before the tile only whole rows drop out
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
    the tile through its walk (the loader's K and V rings; each stage handed back once its
    product is done), then their out and log-sum-exp."""
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
    rows, row_bit, row_valid, row_position = _mma_rows(first_position, first_query, end_query,
                                                       GQ, TOK, ROWS, rows_layout, HALF * ROWS)
    running_max = gl.full((ROWS,), float("-inf"), gl.float32, layout=rows_layout)
    running_sum = gl.zeros((ROWS,), gl.float32, layout=rows_layout)
    acc = gl.zeros((ROWS, HEAD_DIM), gl.float32, layout=o_layout)
    no_scores = gl.zeros((ROWS, BLOCK), gl.float32, layout=s_layout)
    if walk_length > 0:
        # Walk entry u: stage u % 2 of both rings, phase (u // 2) % 2.
        mbarrier.wait(k_full.index(0), 0)
        scores = warpgroup_mma(q_rows, k_smem.index(0).permute((1, 0)), no_scores,
                               use_acc=False, is_async=True)
        scores = warpgroup_mma_wait(num_outstanding=0, deps=(scores,))
        mbarrier.arrive(k_empty.index(0), count=1)
        probs, rescale, running_max, running_sum = _online_softmax(
            scores, 0, running_max, running_sum, blocks, members_of, first_position,
            all_members, row_bit, row_valid, row_position, scale_log2, BLOCK, s_layout)
        p = gl.convert_layout(probs.to(Q.dtype.element_ty), p_layout)
        for u in range(1, walk_length):
            stage = u % 2
            previous = 1 - stage
            mbarrier.wait(k_full.index(stage), (u // 2) & 1)
            scores = warpgroup_mma(q_rows, k_smem.index(stage).permute((1, 0)), no_scores,
                                   use_acc=False, is_async=True)
            mbarrier.wait(v_full.index(previous), ((u - 1) // 2) & 1)
            pv = warpgroup_mma(p, v_smem.index(previous), acc, is_async=True)
            # Q K^T of block u is done; its exponentials run while P V of block u - 1 does.
            scores = warpgroup_mma_wait(num_outstanding=1, deps=(scores,))
            mbarrier.arrive(k_empty.index(stage), count=1)
            probs, rescale, running_max, running_sum = _online_softmax(
                scores, u, running_max, running_sum, blocks, members_of, first_position,
                all_members, row_bit, row_valid, row_position, scale_log2, BLOCK,
                s_layout)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(pv,))
            mbarrier.arrive(v_empty.index(previous), count=1)
            acc = acc * gl.convert_layout(rescale, gl.SliceLayout(1, o_layout))[:, None]
            p = gl.convert_layout(probs.to(Q.dtype.element_ty), p_layout)
        last = (walk_length - 1) % 2
        mbarrier.wait(v_full.index(last), ((walk_length - 1) // 2) & 1)
        acc = warpgroup_mma(p, v_smem.index(last), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

    running_sum = gl.where(row_valid, running_sum, 1.0)
    out = acc / gl.convert_layout(running_sum, gl.SliceLayout(1, o_layout))[:, None]
    out = gl.convert_layout(out.to(OUT.dtype.element_ty), io_layout)
    io_valid, io_token, io_head, dims = _tile_rows(index_head, first_position, first_query,
                                                   end_query, query_base, GQ, TOK, ROWS,
                                                   HEAD_DIM, io_layout, HALF * ROWS)
    gl.store(OUT + io_token[:, None] * stride_o_t + io_head[:, None] * stride_o_h
             + dims[None, :], out, mask=io_valid[:, None])
    row_head = index_head * GQ + rows // TOK
    gl.store(LSE + (query_base + row_position).to(gl.int64) * (HI * GQ) + row_head,
             running_max + gl.log2(running_sum), mask=row_valid)


@gluon.jit
def _block_loads(k_desc, v_desc, k_smem, v_smem, k_full, k_empty, v_full, v_empty, blocks,
                 walk_length, seq_start, kv_col, BLOCK: gl.constexpr):
    """The loader (one warp) of the warp-specialized forward and dQ: each walk entry's K and V
    blocks by TMA into two-stage rings, each stage once both consumers handed it back."""
    for u in range(0, walk_length):
        stage = u % 2
        row = _block_row(blocks, u, walk_length, seq_start, BLOCK)
        mbarrier.wait(k_empty.index(stage), ((u // 2) & 1) ^ 1)
        _issue_block_load(k_desc, k_full.index(stage), k_smem.index(stage), row, kv_col, True)
        mbarrier.wait(v_empty.index(stage), ((u // 2) & 1) ^ 1)
        _issue_block_load(v_desc, v_full.index(stage), v_smem.index(stage), row, kv_col, True)


@gluon.jit
def _block_rings(k_desc, v_desc, BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr):
    """``_block_loads``' two-stage K and V rings in shared memory and their barriers: full
    (the TMA landed) and empty (both consumer warpgroups handed the stage back)."""
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [2, BLOCK, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [2, BLOCK, HEAD_DIM], v_desc.layout)
    k_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for stage in gl.static_range(2):
        mbarrier.init(k_full.index(stage), count=1)
        mbarrier.init(v_full.index(stage), count=1)
        mbarrier.init(k_empty.index(stage), count=2)  # one arrival per consumer warpgroup
        mbarrier.init(v_empty.index(stage), count=2)
    fence_async_shared()
    return k_smem, v_smem, k_full, k_empty, v_full, v_empty


@gluon.jit
def _sparse_attn_fwd_hopper_kernel(
    Q, k_desc, v_desc, OUT, LSE, SCHEDULE, UNION, UNION_MEMBERS, UNION_COUNT, CU_SEQLENS,
    query_start, query_end, stride_q_t, stride_q_h, stride_o_t, stride_o_h, scale_log2,
    HI: gl.constexpr, GQ: gl.constexpr, KV_GROUP: gl.constexpr, TOK: gl.constexpr,
    BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr, UNION_SLOTS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
):
    """The forward warp-specialized: one warp loads the walk's K and V blocks (``_block_loads``)
    and each warpgroup computes 64 of the tile's 128 rows (``_fwd_query_rows``; the first is the
    launch's 4 warps, the second a worker partition), with no barrier between the two."""
    NUM_WARPS: gl.constexpr = gl.num_warps()
    ROWS: gl.constexpr = 128
    io_layout: gl.constexpr = _io_layout(HEAD_DIM, NUM_WARPS)

    entry = gl.program_id(0)
    index_head = gl.program_id(1)
    sequence = gl.load(SCHEDULE + 2 * entry)
    if sequence < 0:  # padding entry
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
    blocks, members_of, walk_length = _walk_of(UNION, UNION_MEMBERS, UNION_COUNT, entry,
                                               index_head, HI, UNION_SLOTS)
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
        (_block_loads, (k_desc, v_desc, k_smem, v_smem, k_full, k_empty, v_full, v_empty,
                        blocks, walk_length, seq_start, kv_col, BLOCK)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


@gluon.jit
def _masked_probs(scores, u, lse, blocks, members_of, first_position, all_members, row_bit,
                  row_valid, row_position, scale_log2, BLOCK: gl.constexpr,
                  layout: gl.constexpr):
    """Walk entry u's probabilities from the final log-sum-exps, zero where a row does not see
    a key."""
    block = gl.load(blocks + u)
    members = gl.load(members_of + u)
    probs = gl.exp2(scores * scale_log2 - lse[:, None])
    if (block * BLOCK + BLOCK > first_position) | (members != all_members):
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
    tile. It brings its q and dO rows into shared memory (and, with WRITE_DELTA, computes and
    writes their deltas), walks the loader's K and V rings, and stores its rows of dq.

    Per walk entry u: ``dQ += dS_{u-1} K_{u-1}`` and ``S_u = Q K_u^T`` are issued together;
    K(u - 1) goes back to the loader as soon as the first is done (so a ring of two K blocks
    keeps the loader a whole entry ahead), then ``dP_u = dO V_u^T`` is issued and block u's
    exponentials run while it is computed."""
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
        out = gl.load(OUT + io_token[:, None] * stride_o_t + io_head[:, None] * stride_o_h
                      + dims[None, :], mask=io_valid[:, None], other=0.0)
        tile_delta = gl.sum(out.to(gl.float32) * dout.to(gl.float32), axis=1)
    fence_async_shared()  # the products read q and dO through the async proxy

    rows, row_bit, row_valid, row_position = _mma_rows(first_position, first_query, end_query,
                                                       GQ, TOK, ROWS, rows_layout, HALF * ROWS)
    row_index = ((query_base + row_position).to(gl.int64) * (HI * GQ) + index_head * GQ
                 + rows // TOK)
    lse = gl.load(LSE + row_index, mask=row_valid, other=0.0)
    if WRITE_DELTA:
        # Row r of the io rows is row r of the products (the same rows of q_rows).
        delta = gl.convert_layout(tile_delta, rows_layout)
        gl.store(DELTA + row_index, delta, mask=row_valid)
    else:
        delta = gl.load(DELTA + row_index, mask=row_valid, other=0.0)

    dq = gl.zeros((ROWS, HEAD_DIM), gl.float32, layout=o_layout)
    no_scores = gl.zeros((ROWS, BLOCK), gl.float32, layout=s_layout)
    if walk_length > 0:
        # Walk entry u: stage u % 2 of both rings, phase (u // 2) % 2.
        mbarrier.wait(k_full.index(0), 0)
        scores = warpgroup_mma(q_rows, k_smem.index(0).permute((1, 0)), no_scores,
                               use_acc=False, is_async=True)
        mbarrier.wait(v_full.index(0), 0)
        dprobs = warpgroup_mma(do_rows, v_smem.index(0).permute((1, 0)), no_scores,
                               use_acc=False, is_async=True)
        scores = warpgroup_mma_wait(num_outstanding=1, deps=(scores,))
        probs = _masked_probs(scores, 0, lse, blocks, members_of, first_position, all_members,
                              row_bit, row_valid, row_position, scale_log2, BLOCK,
                              s_layout)
        dprobs = warpgroup_mma_wait(num_outstanding=0, deps=(dprobs,))
        mbarrier.arrive(v_empty.index(0), count=1)
        dscores = gl.convert_layout((probs * (dprobs - delta[:, None])).to(Q.dtype.element_ty),
                                    ds_layout)
        for u in range(1, walk_length):
            stage = u % 2
            previous = 1 - stage
            mbarrier.wait(k_full.index(stage), (u // 2) & 1)
            dq = warpgroup_mma(dscores, k_smem.index(previous), dq, is_async=True)
            scores = warpgroup_mma(q_rows, k_smem.index(stage).permute((1, 0)), no_scores,
                                   use_acc=False, is_async=True)
            dq = warpgroup_mma_wait(num_outstanding=1, deps=(dq,))
            mbarrier.arrive(k_empty.index(previous), count=1)
            mbarrier.wait(v_full.index(stage), (u // 2) & 1)
            dprobs = warpgroup_mma(do_rows, v_smem.index(stage).permute((1, 0)), no_scores,
                                   use_acc=False, is_async=True)
            # Q K^T of block u is done; its exponentials run while dO V^T does.
            scores = warpgroup_mma_wait(num_outstanding=1, deps=(scores,))
            probs = _masked_probs(scores, u, lse, blocks, members_of, first_position,
                                  all_members, row_bit, row_valid, row_position,
                                  scale_log2, BLOCK, s_layout)
            dprobs = warpgroup_mma_wait(num_outstanding=0, deps=(dprobs,))
            mbarrier.arrive(v_empty.index(stage), count=1)
            dscores = gl.convert_layout(
                (probs * (dprobs - delta[:, None])).to(Q.dtype.element_ty), ds_layout)
        dq = warpgroup_mma(dscores, k_smem.index((walk_length - 1) % 2), dq, is_async=True)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))

    dq = gl.convert_layout((dq * scale).to(DQ.dtype.element_ty), io_layout)
    io_valid, io_token, io_head, dims = _tile_rows(index_head, first_position, first_query,
                                                   end_query, query_base, GQ, TOK, ROWS,
                                                   HEAD_DIM, io_layout, HALF * ROWS)
    gl.store(DQ + io_token[:, None] * stride_dq_t + io_head[:, None] * stride_dq_h
             + dims[None, :], dq, mask=io_valid[:, None])


@gluon.jit
def _sparse_attn_dq_hopper_kernel(
    Q, DOUT, OUT, LSE, DELTA, DQ, k_desc, v_desc, SCHEDULE, UNION, UNION_MEMBERS, UNION_COUNT,
    CU_SEQLENS, query_start, query_end, stride_q_t, stride_q_h, stride_do_t, stride_do_h,
    stride_o_t, stride_o_h, stride_dq_t, stride_dq_h, scale, scale_log2,
    HI: gl.constexpr, GQ: gl.constexpr, KV_GROUP: gl.constexpr, TOK: gl.constexpr,
    BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr, UNION_SLOTS: gl.constexpr,
    WRITE_DELTA: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
):
    """dQ, query-outer and warp-specialized as the forward: the forward's loader
    (``_block_loads``) and two warpgroups of 64 rows each (``_dq_query_rows``). With
    WRITE_DELTA the deltas (sum_d dO * O) are computed here from OUT and written to DELTA for
    the dK/dV kernel, instead of read from it."""
    entry = gl.program_id(0)
    index_head = gl.program_id(1)
    sequence = gl.load(SCHEDULE + 2 * entry)
    if sequence < 0:  # padding entry
        return
    tile = _tile_of(CU_SEQLENS, sequence, gl.load(SCHEDULE + 2 * entry + 1), query_start,
                    query_end, TOK)
    seq_start = tile[0]
    blocks, members_of, walk_length = _walk_of(UNION, UNION_MEMBERS, UNION_COUNT, entry,
                                               index_head, HI, UNION_SLOTS)
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
        (_block_loads, (k_desc, v_desc, k_smem, v_smem, k_full, k_empty, v_full, v_empty,
                        blocks, walk_length, seq_start, kv_col, BLOCK)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


@gluon.jit
def _segment_of(SEGMENTS, BUCKET_START, BUCKET_COUNT, BLOCK_SEQUENCE, BLOCK_LOCAL, CU_SEQLENS,
                query_start, segment, bucket, HI: gl.constexpr, SEGMENT_PAIRS: gl.constexpr):
    """A key-outer segment's pairs [first, last), index head, key block, its sequence's first
    row and the query row of the sequence's position 0 (as attention._segment)."""
    first = gl.load(SEGMENTS + 2 * segment + 1)
    global_block = bucket // HI
    sequence = gl.load(BLOCK_SEQUENCE + global_block)
    seq_start = gl.load(CU_SEQLENS + sequence)
    last = gl.minimum(first + SEGMENT_PAIRS,
                      gl.load(BUCKET_START + bucket) + gl.load(BUCKET_COUNT + bucket))
    block = gl.load(BLOCK_LOCAL + global_block)
    return first, last, bucket % HI, block, seq_start, seq_start - query_start


@gluon.jit
def _diagonal_pairs(PAIR_TOKEN, first, last, query_base, block, BLOCK: gl.constexpr,
                    layout: gl.constexpr):
    """How many of the segment's pairs have their query inside the key block, the only ones
    that need the causal mask: its first pairs (at most one per token of the block, in token
    order)."""
    pairs = first + gl.arange(0, BLOCK, layout=layout)
    inside = (gl.load(PAIR_TOKEN + pairs, mask=pairs < last, other=1 << 30) - query_base
              < block * BLOCK + BLOCK - 1)
    return gl.sum(inside.to(gl.int32), axis=0)


@gluon.jit
def _step_tokens(PAIR_TOKEN, first_pair, last, GQ: gl.constexpr, TOK: gl.constexpr,
                 ROWS: gl.constexpr, layout: gl.constexpr):
    """Query row of each row of a key-outer step of TOK pairs x GQ heads (head-major: row =
    g * TOK + t; the KL's units are one head) in ``layout``, 2^30 for rows of missing pairs or
    padding heads."""
    rows = gl.arange(0, ROWS, layout=layout)
    pair = first_pair + rows % TOK
    return gl.load(PAIR_TOKEN + pair, mask=(pair < last) & (rows // TOK < GQ), other=1 << 30)


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
    stride_q_t, stride_q_h, stride_do_t, stride_do_h, scale_log2,
    HI: gl.constexpr, GQ: gl.constexpr, KV_GROUP: gl.constexpr, TOK: gl.constexpr,
    BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr, SEGMENT_PAIRS: gl.constexpr,
    STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, GATHER_REGS: gl.constexpr,
):
    """Key-outer dK, dV of one segment, warp-specialized: one warp gathers the steps' rows
    (``_dkdv_gather``) and each warpgroup computes 64 keys of the block (``_dkdv_key_rows``;
    the first is the launch's 4 warps, the second a worker partition) with no barrier between
    the two, so that one's products run while the other's exponentials do."""
    NUM_WARPS: gl.constexpr = gl.num_warps()
    ROWS: gl.constexpr = 32
    io_layout: gl.constexpr = _io_layout(HEAD_DIM, NUM_WARPS)
    row_layout: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
    vector_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])

    segment = gl.load(SEGMENT_ORDER + gl.program_id(0))
    bucket = gl.load(SEGMENTS + 2 * segment)
    if bucket < 0:  # padding segment
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
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    for stage in gl.static_range(STAGES):
        mbarrier.init(full.index(stage), count=32)  # one arrival per gathering thread
        mbarrier.init(empty.index(stage), count=BLOCK // 64)  # one per consumer warpgroup
    fence_async_shared()
    row = (seq_start + block * BLOCK).to(gl.int32)
    kv_col = (index_head // KV_GROUP) * HEAD_DIM
    mbarrier.expect(kv_ready, 2 * k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row, kv_col], kv_ready, k_smem)
    tma.async_copy_global_to_shared(v_desc, [row, kv_col], kv_ready, v_smem)
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


@gluon.jit
def _kl_add_head(teacher, scores, outstanding: gl.constexpr, lse_smem, scale_log2,
                 cols_layout: gl.constexpr):
    """teacher + one head's probabilities, once its product is done (``outstanding`` later
    products may still run)."""
    scores = warpgroup_mma_wait(num_outstanding=outstanding, deps=(scores,))
    lse = lse_smem.load(cols_layout)
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
        # d index_q's product first: its atomic adds run while d index_k's product does
        # (0.895 against 0.904 ms for the kernel at 16k, H16 on an H200).
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
    STAGES: gl.constexpr,
):
    """attention._kl_kernel's work (the KL of one segment of the key-block list, PAIRS pairs a
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
    as the Triton kernel's does."""
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
    units = steps * GQ

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
                                       cols_layout)
                previous = scores
            teacher = _kl_add_head(teacher, previous, 0,
                                   lse_smem.index((unit + CHUNK - 1) % STAGES), scale_log2,
                                   cols_layout)
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


def _tma_ready(t: torch.Tensor) -> bool:
    """Whether ``[T, heads, D]`` can be read as 2D ``[T, heads * D]`` by TMA: contiguous heads
    and 16-byte aligned base and row stride."""
    size = t.element_size()
    return (t.stride(2) == 1 and t.stride(1) == t.shape[2] and t.data_ptr() % 16 == 0
            and (t.stride(0) * size) % 16 == 0)


def _rows_ready(t: torch.Tensor) -> bool:
    """Whether rows of ``[T, heads, D]`` can be gathered in 16-byte pieces: contiguous last
    dimension, 16-byte aligned base and strides."""
    size = t.element_size()
    return (t.stride(2) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * size) % 16 == 0
            and (t.stride(1) * size) % 16 == 0)


def _hopper_16bit(q, *others) -> bool:
    """Whether ``q`` is on a Hopper GPU (compute capability 9.x) in 16 bits, and ``others``
    in its dtype."""
    return (q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9
            and q.dtype in (torch.bfloat16, torch.float16)
            and all(t.dtype == q.dtype for t in others))


def supported(q, k, v, p) -> bool:
    """Whether these kernels run the main-branch forward and dQ of ``p`` (an
    ``attention.SparseAttentionProblem``): a Hopper GPU, 16-bit inputs, head dim 64 or 128,
    blocks of 64 or 128 keys, 128-row query tiles, keys and values TMA can read."""
    return (_hopper_16bit(q, k, v) and q.stride(2) == 1 and p.head_dim in HEAD_DIMS
            and p.block_size in BLOCK_SIZES and p.query_rows == ROWS
            and _tma_ready(k) and _tma_ready(v))


KEY_STEP_ROWS = 32  # dK/dV: rows (pairs x heads) per step
KEY_STEP_STAGES = 4  # dK/dV: steps of q and dO rows in shared memory
# dK/dV: registers per thread of the second consumer warpgroup and of the gather warp's (the
# first consumer warpgroup gets 232 too): no spills at any supported shape with 40 for the
# gather warp (32 spilled up to 8 bytes); (232, 32) and (240, 24) measured the same.
KEY_STEP_REGISTERS = (232, 40)


def key_step_tokens(heads_per_token: int) -> int | None:
    """Pairs per dK/dV step (KEY_STEP_ROWS rows of their padded heads), or None when one
    pair's heads exceed a step."""
    padded = 1 << (heads_per_token - 1).bit_length()
    return KEY_STEP_ROWS // padded if padded <= KEY_STEP_ROWS else None


def supported_key_outer(q, k, v, dout, p) -> bool:
    """Whether the dK/dV kernel runs ``p``'s backward: as ``supported``, with 32-row steps
    instead of 128-row query tiles, and q and dO rows that 16-byte copies can gather."""
    return (_hopper_16bit(q, k, v, dout) and p.head_dim in HEAD_DIMS
            and p.block_size in BLOCK_SIZES and key_step_tokens(p.gq) is not None
            and _tma_ready(k) and _tma_ready(v) and _rows_ready(q) and _rows_ready(dout))


def _block_descriptor(t: torch.Tensor, block_size: int) -> TensorDescriptor:
    """``[T, heads, D]`` as 2D ``[T, heads * D]`` in ``[block_size, D]`` boxes: one key block
    of one head per TMA."""
    total, heads, dim = t.shape
    element = gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([block_size, dim], element)
    return TensorDescriptor(t, [total, heads * dim], [t.stride(0), 1], [block_size, dim],
                            layout)


# Forward: registers per thread of the second consumer warpgroup and of the loader warp's (the
# first consumer warpgroup gets 232 too); (240, 24) measured the same.
FORWARD_REGISTERS = (232, 40)


def _maxnreg(warpgroups: int, workers: tuple) -> int:
    """A warp-specialized kernel's register limit per thread: its ``warpgroups`` share the
    register file, and the first one gets what the worker partitions (``workers``, registers
    per thread of each) leave of the limit times the warpgroups (at most 240)."""
    return (sum(workers) + 240) // warpgroups // 8 * 8


def sparse_attention_fwd(q, k, v, p, scale_log2: float):
    """out [Tq, H, D] and lse2 [Tq, H] of the main branch; ``supported(q, k, v, p)`` must
    hold."""
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
        CONSUMER_REGS=FORWARD_REGISTERS[0], LOADER_REGS=FORWARD_REGISTERS[1], num_warps=4,
        maxnreg=_maxnreg(3, FORWARD_REGISTERS))
    return out, lse


# dQ: as the forward's; (240, 24) measured the same.
DQ_REGISTERS = (232, 40)


def attention_dq(q, k, v, dout, lse, delta, p, scale_log2: float, out=None):
    """dq of the main branch (q's dtype); ``supported(q, k, v, p)`` must hold and dout's last
    dimension be contiguous. Given ``out`` (last dimension contiguous), the kernel computes the
    deltas (``attention.attention_delta``'s) itself and writes them into ``delta`` ([T, H]
    fp32), which it then does not read."""
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
        CONSUMER_REGS=DQ_REGISTERS[0], LOADER_REGS=DQ_REGISTERS[1], num_warps=4,
        maxnreg=_maxnreg(3, DQ_REGISTERS))
    return dq


def _dkdv_maxnreg(block_size: int, registers: tuple) -> int:
    """The dK/dV kernel's register limit: a consumer warpgroup per 64 keys, the gather warp."""
    workers = registers if block_size == 128 else registers[1:]
    return _maxnreg(len(workers) + 1, workers)


def attention_dkdv_parts(q, k, v, dout, lse, delta, p, scale_log2: float,
                         stages: int = KEY_STEP_STAGES, registers: tuple = KEY_STEP_REGISTERS):
    """fp32 dK (unscaled) and dV partials per segment of ``p``'s key-block list, as the Triton
    kernel writes them; ``supported_key_outer(q, k, v, dout, p)`` must hold."""
    work = p.block_work
    segments = work.segments.shape[0]
    dk_part, dv_part = (torch.empty(segments * p.block_size, p.head_dim, dtype=torch.float32,
                                    device=q.device) for _ in range(2))
    shared = p.shared
    _sparse_attn_dkdv_hopper_kernel[(segments,)](
        q, dout, lse, delta, dk_part, dv_part, _block_descriptor(k, p.block_size),
        _block_descriptor(v, p.block_size), work.segments, work.segment_order, work.pair_token,
        work.bucket_start, work.bucket_count, work.block_sequence, work.block_local,
        p.cu_seqlens, p.query_start, q.stride(0), q.stride(1), dout.stride(0), dout.stride(1),
        scale_log2, HI=shared["HI"], GQ=shared["GQ"], KV_GROUP=shared["KV_GROUP"],
        TOK=key_step_tokens(p.gq), BLOCK=p.block_size, HEAD_DIM=p.head_dim,
        SEGMENT_PAIRS=work.segment_pairs, STAGES=stages, CONSUMER_REGS=registers[0],
        GATHER_REGS=registers[1], num_warps=4, maxnreg=_dkdv_maxnreg(p.block_size, registers))
    return dk_part, dv_part


def supported_kl(q, k, index_q, index_k, p) -> bool:
    """Whether ``_kl_hopper_kernel`` runs the KL of ``p``: a Hopper GPU, 16-bit inputs, index
    head dim equal to the head dim (64 or 128), blocks of 64 or 128, keys and index keys TMA
    can read, query and index query rows that 16-byte copies can gather."""
    return (_hopper_16bit(q, k, index_q, index_k) and p.head_dim in HEAD_DIMS
            and p.index_dim == p.head_dim and p.block_size in BLOCK_SIZES
            and _tma_ready(k) and _tma_ready(index_k)
            and _rows_ready(q) and _rows_ready(index_q))


KL_STAGES = 4  # units of q rows in shared memory (two ahead)


def kl_key_walk_parts(q, k, index_q, index_k, lse, lse_index, p, d_index_k, value_parts,
                      d_index_q, query_side: bool, with_value: bool, scale_log2: float,
                      pairs: int):
    """attention.kl_key_walk's kernel, ``pairs`` pairs a step: d index_k partials per segment
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
        STAGES=KL_STAGES, num_warps=NUM_WARPS)


def compile_for_sm90(head_dim: int = 128, block_size: int = 128, dtype: str = "bf16",
                     kernel: str = "forward", heads_per_token: int = 16):
    """The ``kernel`` ("forward", "dq", "dkdv" or "kl") compiled for sm_90a on any machine, GPU
    or not (nothing runs): the compiled kernel, whose ``asm["ptx"]`` ``ptxas_report`` reports on
    (benchmarks/inspect_kernels.py, tests/test_hopper.py)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    element = gl.bfloat16 if dtype == "bf16" else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([block_size, head_dim], element)
    fn = {"forward": _sparse_attn_fwd_hopper_kernel, "dq": _sparse_attn_dq_hopper_kernel,
          "dkdv": _sparse_attn_dkdv_hopper_kernel, "kl": _kl_hopper_kernel}[kernel]
    tile_tokens = ROWS // (1 << (heads_per_token - 1).bit_length())  # 128-row query tiles
    constants = dict(HI=4, GQ=heads_per_token, KV_GROUP=1, TOK=tile_tokens, BLOCK=block_size,
                     HEAD_DIM=head_dim, UNION_SLOTS=tile_tokens * 16)
    options = dict(num_warps=NUM_WARPS)
    if kernel == "dq":  # as the backward launches it: computing the deltas, warp-specialized
        constants.update(WRITE_DELTA=True, CONSUMER_REGS=DQ_REGISTERS[0],
                         LOADER_REGS=DQ_REGISTERS[1])
        options = dict(num_warps=4, maxnreg=_maxnreg(3, DQ_REGISTERS))
    if kernel == "forward":  # warp-specialized (sparse_attention_fwd's launch)
        constants.update(CONSUMER_REGS=FORWARD_REGISTERS[0], LOADER_REGS=FORWARD_REGISTERS[1])
        options = dict(num_warps=4, maxnreg=_maxnreg(3, FORWARD_REGISTERS))
    if kernel == "dkdv":  # 32-row steps, warp-specialized (attention_dkdv_parts' launch)
        consumer, gather = KEY_STEP_REGISTERS
        constants = dict(HI=4, GQ=heads_per_token, KV_GROUP=1,
                         TOK=key_step_tokens(heads_per_token), BLOCK=block_size,
                         HEAD_DIM=head_dim, SEGMENT_PAIRS=2048, STAGES=KEY_STEP_STAGES,
                         CONSUMER_REGS=consumer, GATHER_REGS=gather)
        options = dict(num_warps=4, maxnreg=_dkdv_maxnreg(block_size, KEY_STEP_REGISTERS))
    if kernel == "kl":  # with its query side and value
        constants = dict(HI=4, GQ=heads_per_token, KV_GROUP=1, INDEX_GROUP=4, PAIRS=64,
                         BLOCK=block_size, HEAD_DIM=head_dim, SEGMENT_PAIRS=2048,
                         QUERY_SIDE=True, WITH_VALUE=True, STAGES=KL_STAGES)
    pointers = dict(Q=f"*{dtype}", OUT=f"*{dtype}", DOUT=f"*{dtype}", DQ=f"*{dtype}",
                    LSE="*fp32", DELTA="*fp32", DK_PART="*fp32", DV_PART="*fp32",
                    UNION_MEMBERS="*i64", IQ=f"*{dtype}", LSE_INDEX="*fp32", DIK="*fp32",
                    KL_PARTS="*fp32", DIQ="*fp32")
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


def ptxas_report(ptx: str) -> dict:
    """What Triton's bundled ptxas says of a kernel's PTX for sm_90a: registers, spilled bytes,
    whether it serialized the asynchronous products (a slow loop), and its whole text."""
    import os
    import re
    import subprocess
    import tempfile

    import triton

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
