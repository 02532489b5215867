"""Experiment: the query-outer sparse forward in Gluon (Hopper): K/V blocks by TMA into a
two-stage ring, explicit asynchronous wgmma so that the exponentials of block u overlap the
P V product of block u - 1 and the Q K^T of block u + 1."""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import (tma, mbarrier, fence_async_shared,
                                                              warpgroup_mma, warpgroup_mma_wait,
                                                              warpgroup_mma_init)


@gluon.jit
def _issue_load(desc, bar, smem, row, col, pred):
    mbarrier.expect(bar, desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(desc, [row, col], bar, smem, pred=pred)


@gluon.jit
def _block_row(blocks, u, n, seq_start, BLOCK: gl.constexpr):
    """First key row of walk entry u (clamped into the walk: a predicated-off load needs one)."""
    block = gl.load(blocks + gl.minimum(u, n - 1))
    return (seq_start + block * BLOCK).to(gl.int32)


@gluon.jit
def _softmax(scores, running_max, running_sum, members, block, needs_mask, all_members_ok,
             row_bit, row_valid, row_position, seq_len, scale_log2,
             BLOCK: gl.constexpr, layout: gl.constexpr):
    scores = scores * scale_log2
    if needs_mask:
        key_pos = block * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(0, layout))
        row_member = (((members >> row_bit) & 1) != 0) & row_valid
        visible = (row_member[:, None] & (key_pos < seq_len)[None, :]
                   & (key_pos[None, :] <= row_position[:, None]))
        scores = gl.where(visible, scores, float("-inf"))
    new_max = gl.maximum(running_max, gl.max(scores, axis=1))
    safe_max = gl.where(new_max == float("-inf"), 0.0, new_max)
    rescale = gl.exp2(running_max - safe_max)
    probs = gl.exp2(scores - safe_max[:, None])
    running_sum = running_sum * rescale + gl.sum(probs, axis=1)
    return probs, rescale, new_max, running_sum



@gluon.jit
def _softmax_of(scores, u, running_max, running_sum, blocks, members_of, first_position,
                all_members, row_bit, row_valid, row_position, seq_len, scale_log2,
                BLOCK: gl.constexpr, mma: gl.constexpr):
    """Online softmax of walk entry u's scores (masked where the block needs it)."""
    block = gl.load(blocks + u)
    members = gl.load(members_of + u)
    needs_mask = (block * BLOCK + BLOCK > first_position) | (members != all_members)
    return _softmax(scores, running_max, running_sum, members, block, needs_mask, True,
                    row_bit, row_valid, row_position, seq_len, scale_log2, BLOCK, mma)


@gluon.jit
def gluon_fwd_kernel(
    Q, k_desc, v_desc, OUT, LSE, SCHEDULE, UNION, UNION_MEMBERS, UNION_COUNT, CU_SEQLENS,
    query_start, query_end, stride_q_t, stride_q_h, stride_o_t, stride_o_h, scale_log2,
    HI: gl.constexpr, GQ: gl.constexpr, KV_GROUP: gl.constexpr, TOK: gl.constexpr,
    ROWS: gl.constexpr, BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr, UNION_SLOTS: gl.constexpr,
):
    NUM_WARPS: gl.constexpr = gl.num_warps()
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                  instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NUM_WARPS, 1], [1, 0])
    rows_of: gl.constexpr = gl.SliceLayout(1, mma)
    cols_of: gl.constexpr = gl.SliceLayout(0, mma)

    entry = gl.program_id(0)
    index_head = gl.program_id(1)
    sequence = gl.load(SCHEDULE + 2 * entry)
    if sequence < 0:
        return
    tile = gl.load(SCHEDULE + 2 * entry + 1)
    seq_start = gl.load(CU_SEQLENS + sequence)
    seq_len = gl.load(CU_SEQLENS + sequence + 1) - seq_start
    first_position = tile * TOK
    first_query = gl.maximum(query_start - seq_start - first_position, 0)
    end_query = gl.minimum(gl.minimum(query_end - seq_start, seq_len) - first_position, TOK)
    one = first_query.to(gl.int64) * 0 + 1
    all_members = (gl.where(end_query >= 64, -1, (one << end_query.to(gl.int64)) - 1)
                   - ((one << first_query.to(gl.int64)) - 1))
    query_base = seq_start - query_start

    # Q: [ROWS, D], head-major rows (row = g * TOK + t), loaded once and kept in shared memory.
    rows_l = gl.arange(0, ROWS, layout=gl.SliceLayout(1, load_layout))
    dims_l = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, load_layout))
    valid_l = ((rows_l // TOK < GQ) & (rows_l % TOK >= first_query) & (rows_l % TOK < end_query))
    token_l = (query_base + first_position + rows_l % TOK).to(gl.int64)
    head_l = index_head * GQ + rows_l // TOK
    q = gl.load(Q + token_l[:, None] * stride_q_t + head_l[:, None] * stride_q_h + dims_l[None, :],
                mask=valid_l[:, None], other=0.0)
    q_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [ROWS, HEAD_DIM],
                                       gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], Q.dtype.element_ty),
                                       q)

    rows = gl.arange(0, ROWS, layout=rows_of)
    row_bit = (rows % TOK).to(gl.int64)
    row_valid = (rows // TOK < GQ) & (rows % TOK >= first_query) & (rows % TOK < end_query)
    row_position = first_position + rows % TOK

    offset = (entry * HI + index_head) * UNION_SLOTS
    blocks = UNION + offset
    members_of = UNION_MEMBERS + offset
    n = gl.load(UNION_COUNT + entry * HI + index_head)
    kv_col = (index_head // KV_GROUP) * HEAD_DIM

    k_smem = gl.allocate_shared_memory(k_desc.dtype, [2, BLOCK, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [2, BLOCK, HEAD_DIM], v_desc.layout)
    k_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(k_bar.index(i), count=1)
        mbarrier.init(v_bar.index(i), count=1)
    fence_async_shared()

    running_max = gl.full((ROWS,), float("-inf"), gl.float32, layout=rows_of)
    running_sum = gl.zeros((ROWS,), gl.float32, layout=rows_of)
    acc = gl.zeros((ROWS, HEAD_DIM), gl.float32, layout=mma)
    zero_scores = gl.zeros((ROWS, BLOCK), gl.float32, layout=mma)
    if n > 0:
        # Prologue: K and V of blocks 0 and 1 in flight; softmax of block 0.
        for i in gl.static_range(2):
            row = _block_row(blocks, i, n, seq_start, BLOCK)
            _issue_load(k_desc, k_bar.index(i), k_smem.index(i), row, kv_col, i < n)
            _issue_load(v_desc, v_bar.index(i), v_smem.index(i), row, kv_col, i < n)
        mbarrier.wait(k_bar.index(0), 0)
        scores = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero_scores,
                               use_acc=False, is_async=True)
        scores = warpgroup_mma_wait(num_outstanding=0, deps=(scores,))
        probs, rescale, running_max, running_sum = _softmax_of(
            scores, 0, running_max, running_sum, blocks, members_of, first_position,
            all_members, row_bit, row_valid, row_position, seq_len, scale_log2, BLOCK, mma)
        p = gl.convert_layout(probs.to(v_smem.dtype), p_layout)
        for u in range(1, n):
            stage = u % 2
            prev = 1 - stage
            # K(u - 1) is consumed: its stage takes K(u + 1).
            _issue_load(k_desc, k_bar.index(prev), k_smem.index(prev),
                        _block_row(blocks, u + 1, n, seq_start, BLOCK), kv_col, u + 1 < n)
            mbarrier.wait(k_bar.index(stage), (u // 2) & 1)
            scores = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), zero_scores,
                                   use_acc=False, is_async=True)
            mbarrier.wait(v_bar.index(prev), ((u - 1) // 2) & 1)
            acc_token = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
            # S(u) done; the exponentials of block u run while P V(u - 1) does.
            scores = warpgroup_mma_wait(num_outstanding=1, deps=(scores,))
            probs, rescale, running_max, running_sum = _softmax_of(
                scores, u, running_max, running_sum, blocks, members_of, first_position,
                all_members, row_bit, row_valid, row_position, seq_len, scale_log2, BLOCK, mma)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_token,))
            # V(u - 1) is consumed: its stage takes V(u + 1).
            _issue_load(v_desc, v_bar.index(prev), v_smem.index(prev),
                        _block_row(blocks, u + 1, n, seq_start, BLOCK), kv_col, u + 1 < n)
            acc = acc * rescale[:, None]
            p = gl.convert_layout(probs.to(v_smem.dtype), p_layout)
        last = (n - 1) % 2
        mbarrier.wait(v_bar.index(last), ((n - 1) // 2) & 1)
        acc = warpgroup_mma(p, v_smem.index(last), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    for i in gl.static_range(2):
        mbarrier.invalidate(k_bar.index(i))
        mbarrier.invalidate(v_bar.index(i))

    running_sum = gl.where(row_valid, running_sum, 1.0)
    out = (acc / running_sum[:, None]).to(OUT.dtype.element_ty)
    out = gl.convert_layout(out, load_layout)
    gl.store(OUT + token_l[:, None] * stride_o_t + head_l[:, None] * stride_o_h + dims_l[None, :],
             out, mask=valid_l[:, None])
    row_token = (query_base + row_position).to(gl.int64)
    row_head = index_head * GQ + rows // TOK
    gl.store(LSE + row_token * (HI * GQ) + row_head, running_max + gl.log2(running_sum),
             mask=row_valid)


def kv_descriptor(t, block):
    """[T, Hkv, D] (contiguous heads) as 2D [T, Hkv * D] with [block, D] boxes."""
    total, heads, dim = t.shape
    assert t.stride(2) == 1 and t.stride(1) == dim
    layout = gl.NVMMASharedLayout.get_default_for([block, dim], gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16)
    return TensorDescriptor(t, [total, heads * dim], [t.stride(0), 1], [block, dim], layout)


def gluon_fwd(q, k, v, p, scale_log2):
    out = torch.empty_like(q)
    lse = torch.empty(p.total, p.num_heads, dtype=torch.float32, device=q.device)
    const = p.query_constants()
    work = p.query_work
    gluon_fwd_kernel[p.query_grid()](
        q, kv_descriptor(k, p.block_size), kv_descriptor(v, p.block_size), out, lse,
        work.schedule, work.union, work.union_members, work.union_count, p.cu_seqlens,
        p.query_start, p.query_start + p.total, q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), scale_log2, HI=const["HI"], GQ=const["GQ"], KV_GROUP=const["KV_GROUP"],
        TOK=const["TOK"], ROWS=const["ROWS"], BLOCK=const["BLOCK"], HEAD_DIM=const["HEAD_DIM"],
        UNION_SLOTS=const["UNION_SLOTS"], num_warps=8)
    return out, lse
