"""The main attention's forward on Triton kernels (SPEC section 3, steps 5-6), and the index
branch's log-sum-exp over the kept tokens that the KL needs.

Query-outer: one program per (query tile, index head) walks the distinct blocks the tile's
tokens kept, flash-attention style; a row sees a block only if its own token kept it.
Neighbouring tokens of a trained index branch keep nearly the same blocks, so the walk is close
to ``top_k`` blocks. The index log-sum-exp alone, when each row's largest kept score is known,
can also run split between that walk and a key-outer pass (``index_log_sum_exp_key_outer``),
whose cost follows the kept pairs, not the tiles' unions (``Tuning.index_lse_split``: off
until timed on a GPU in its present form, docs/KERNELS.md section 4).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..configs import (FWD_CONFIG, INDEX_ALONE_CONFIG, INDEX_KEY_OUTER_CONFIG,
                       INDEX_KEY_OUTER_PAIRS, INDEX_WALK_LIMIT_PER_SLOT)
from ..launch import launch, strides
from ..problem import LOG2_E, SparseAttentionProblem
from ..tiles import (_block_keys, _load_rows, _members, _query_tile, _segment, _walk_block,
                     _walk_list)


@triton.jit
def _sparse_attn_fwd_kernel(
    Q, K, V, IQ, IK, OUT, LSE, LSE_INDEX, INDEX_MAX, SCHEDULE, UNION, UNION_MEMBERS,
    UNION_COUNT, CU_SEQLENS, query_start, query_end,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_o_t, stride_o_h, stride_iq_t, stride_iq_h, stride_ik_t, stride_ik_h,
    scale_log2, index_scale,
    HI: tl.constexpr, GQ: tl.constexpr, GQ_PAD: tl.constexpr, KV_GROUP: tl.constexpr,
    INDEX_GROUP: tl.constexpr, TOK: tl.constexpr, TOKP: tl.constexpr, ROWS: tl.constexpr,
    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, INDEX_DIM: tl.constexpr,
    UNION_SLOTS: tl.constexpr, WITH_MAIN: tl.constexpr, WITH_INDEX: tl.constexpr,
    INDEX_MAX_GIVEN: tl.constexpr, PRECISION: tl.constexpr, WALK_LIMIT: tl.constexpr = 0,
    MAIN_WALK_LIMIT: tl.constexpr = 0,
):
    """Query-outer forward: one program per (query tile, index head) walks the distinct blocks
    its tokens kept (flash-attention online softmax); a row sees a block only if its own token
    kept it. WITH_MAIN: writes out and lse2 directly (no partials); WITH_INDEX, also the index
    branch's log-sum-exp over the kept tokens (natural log), which the KL needs (alone, without
    WITH_MAIN, next to the Hopper kernel's main branch). INDEX_MAX_GIVEN: each token's largest
    kept index score is INDEX_MAX (selection's), so the index sum needs no running maximum: its
    terms add up elementwise and are reduced once, after the walk. WALK_LIMIT > 0: a tile
    whose union holds more blocks returns at once, writing nothing (the key-outer pass takes
    its tokens). MAIN_WALK_LIMIT > 0: such a tile leaves its main rows (out, lse2) unwritten
    for the key-outer forward (attention.key_outer) and walks the index branch alone."""
    entry = tl.program_id(0).to(tl.int64)
    index_head = tl.program_id(1).to(tl.int64)
    if tl.load(SCHEDULE + 2 * entry) < 0:  # padding entry
        return
    (seq_start, seq_len, first_position, all_members, row_valid, row_token, row_position,
     row_head, tok_valid, tok_token, tok_position) = _query_tile(
        SCHEDULE, CU_SEQLENS, entry, index_head, query_start, query_end, GQ, TOK, TOKP, ROWS)
    kv_head = index_head // KV_GROUP
    dims = tl.arange(0, HEAD_DIM)
    if WITH_MAIN:
        q = tl.load(Q + row_token[:, None] * stride_q_t + row_head[:, None] * stride_q_h
                    + dims[None, :], mask=row_valid[:, None], other=0.0)  # [ROWS, D]
    if WITH_INDEX:
        index_q = _load_rows(IQ, tok_token, tok_valid, index_head, stride_iq_t, stride_iq_h,
                             INDEX_DIM)  # [TOKP, Di]
    running_max = tl.full((ROWS,), float("-inf"), tl.float32)
    running_sum = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, HEAD_DIM), tl.float32)
    index_max = tl.full((TOKP,), float("-inf"), tl.float32)
    index_sum = tl.zeros((TOKP,), tl.float32)
    if INDEX_MAX_GIVEN:
        index_max = tl.load(INDEX_MAX + tok_token * HI + index_head, mask=tok_valid, other=0.0)
        index_terms = tl.zeros((TOKP, BLOCK), tl.float32)
    blocks, members_of, walk_length = _walk_list(UNION, UNION_MEMBERS, UNION_COUNT, entry,
                                                 index_head, HI, UNION_SLOTS)
    if WALK_LIMIT > 0:
        if walk_length > WALK_LIMIT:
            return
    main_here = True
    if MAIN_WALK_LIMIT > 0:
        main_here = walk_length <= MAIN_WALK_LIMIT
        if not WITH_INDEX:
            if walk_length > MAIN_WALK_LIMIT:
                return
    for u in range(0, walk_length):
        block, members, needs_mask = _walk_block(blocks, members_of, u, first_position,
                                                 all_members, BLOCK)
        key_pos, key_valid, key_token = _block_keys(seq_start, seq_len, block, BLOCK)
        row_member, tok_member = _members(members, row_valid, tok_valid, TOK, TOKP, ROWS)
        if WITH_MAIN and main_here:
            k = _load_rows(K, key_token, key_valid, kv_head, stride_k_t, stride_k_h, HEAD_DIM)
            v = _load_rows(V, key_token, key_valid, kv_head, stride_v_t, stride_v_h, HEAD_DIM)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
            if needs_mask:
                visible = (row_member[:, None] & key_valid[None, :]
                           & (key_pos[None, :] <= row_position[:, None]))
                scores = tl.where(visible, scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
            rescale = tl.exp2(running_max - safe_max)
            probs = tl.exp2(scores - safe_max[:, None])
            running_sum = running_sum * rescale + tl.sum(probs, axis=1)
            acc = tl.dot(probs.to(v.dtype), v, acc * rescale[:, None],
                         input_precision=PRECISION)
            running_max = new_max
        if WITH_INDEX:
            ik = _load_rows(IK, key_token, key_valid, index_head // INDEX_GROUP, stride_ik_t,
                            stride_ik_h, INDEX_DIM)
            z = tl.dot(index_q, tl.trans(ik), input_precision=PRECISION) * index_scale
            tok_visible = (tok_member[:, None] & key_valid[None, :]
                           & (key_pos[None, :] <= tok_position[:, None]))
            if INDEX_MAX_GIVEN:
                # Padding rows (tokens TOK.., or not queries) add garbage that is never stored.
                terms = tl.exp(z - index_max[:, None])
                if block * BLOCK + BLOCK > first_position:  # the tile's own block(s)
                    terms = tl.where(tok_visible, terms, 0.0)
                elif needs_mask:  # before the tile only whole tokens drop out: a select per row
                    terms = tl.where(tok_member[:, None], terms, 0.0)
                index_terms += terms
            else:
                z = tl.where(tok_visible, z, float("-inf"))
                new_index_max = tl.maximum(index_max, tl.max(z, axis=1))
                safe_index_max = tl.where(new_index_max == float("-inf"), 0.0, new_index_max)
                index_sum = (index_sum * tl.exp(index_max - safe_index_max)
                             + tl.sum(tl.exp(z - safe_index_max[:, None]), axis=1))
                index_max = new_index_max
    if WITH_MAIN and main_here:
        running_sum = tl.where(row_valid, running_sum, 1.0)
        tl.store(OUT + row_token[:, None] * stride_o_t + row_head[:, None] * stride_o_h
                 + dims[None, :], (acc / running_sum[:, None]).to(OUT.dtype.element_ty),
                 mask=row_valid[:, None])
        tl.store(LSE + row_token * (HI * GQ) + row_head, running_max + tl.log2(running_sum),
                 mask=row_valid)
    if WITH_INDEX:
        if INDEX_MAX_GIVEN:
            index_sum = tl.sum(index_terms, axis=1)
        index_sum = tl.where(tok_valid, index_sum, 1.0)
        tl.store(LSE_INDEX + tok_token * HI + index_head, index_max + tl.log(index_sum),
                 mask=tok_valid)


def triton_forward(q, k, v, index_q, index_k, p: SparseAttentionProblem, index_max=None,
                   num_warps=None, num_stages=None, walk_limit: int = 0):
    """The Triton forward: out [T, H, D] (q's dtype), lse2 [T, H] and, with the index branch,
    its log-sum-exp [T, Hi] (natural log over the kept tokens; else None), both fp32.
    ``index_max``: fp32 [T, Hi], each row's largest kept index score when known, or None.
    ``num_warps``, ``num_stages``: the launch's (default FWD_CONFIG). ``walk_limit`` > 0: the
    main rows of tiles whose union holds more blocks are left unwritten (key-outer's)."""
    given = p.with_index and index_max is not None
    out = torch.empty_like(q)
    lse = torch.empty(p.total, p.num_heads, dtype=torch.float32, device=q.device)
    lse_index = (torch.empty(p.total, p.num_index_heads, dtype=torch.float32, device=q.device)
                 if p.with_index else lse)
    iq, ik = (index_q, index_k) if p.with_index else (q, k)  # unused placeholders otherwise
    launch(_sparse_attn_fwd_kernel, p.query_grid(),
        q, k, v, iq, ik, out, lse, lse_index, index_max if given else lse,
        *p.query_work_args(), *strides(q, k, v, out, iq, ik), p.scale * LOG2_E, p.index_scale,
        **p.query_constants(), WITH_MAIN=True, WITH_INDEX=p.with_index,
        INDEX_MAX_GIVEN=given, MAIN_WALK_LIMIT=walk_limit,
        num_warps=num_warps or FWD_CONFIG["num_warps"],
        num_stages=num_stages or FWD_CONFIG["num_stages"])
    return out, lse, (lse_index if p.with_index else None)


def index_log_sum_exp(index_q, index_k, index_max, p: SparseAttentionProblem,
                      walk_limit: int = 0, lse_index=None):
    """The index log-sum-exp over the kept tokens alone (natural log, fp32 [T, Hi]): the
    forward's index part on the tiles of ``p.index_tile_work``. ``index_max``: each row's
    largest kept index score (selection's), or None for a running maximum (fp8 selection's
    maxima are not the input-precision scores'; a selection whose forced blocks fill top_k
    gives none). ``walk_limit`` > 0: tiles whose union holds more blocks are skipped, their
    rows left as they are in ``lse_index`` (the buffer to write into; default a new one)."""
    work = p.index_tile_work
    if lse_index is None:
        lse_index = torch.empty(p.total, p.num_index_heads, dtype=torch.float32,
                                device=index_q.device)
    tokens = work.tile_tokens
    padded = max(16, tokens)
    # Without the main branch the kernel reads no q, k, v, out or lse: index tensors stand in.
    launch(_sparse_attn_fwd_kernel, (work.schedule.shape[0], p.num_index_heads),
        index_q, index_k, index_k, index_q, index_k, index_q, lse_index, lse_index,
        lse_index if index_max is None else index_max,
        work.schedule, work.union, work.union_members, work.union_count, p.cu_seqlens,
        p.query_start, p.query_start + p.total,
        *strides(index_q, index_k, index_k, index_q, index_q, index_k), 0.0, p.index_scale,
        **dict(p.query_constants(), TOK=tokens, TOKP=padded, ROWS=padded,
               UNION_SLOTS=work.union.shape[-1]),
        WITH_MAIN=False, WITH_INDEX=True, INDEX_MAX_GIVEN=index_max is not None,
        WALK_LIMIT=walk_limit, **INDEX_ALONE_CONFIG)
    return lse_index


@triton.jit
def _index_sum_key_outer_kernel(
    IQ, IK, INDEX_MAX, SLOT_SUMS, SEGMENTS, SEGMENT_ORDER, PAIR_TOKEN, PAIR_SLOT, BUCKET_START,
    BUCKET_COUNT, BLOCK_SEQUENCE, BLOCK_LOCAL, CU_SEQLENS, query_start,
    stride_iq_t, stride_iq_h, stride_ik_t, stride_ik_h, index_scale,
    HI: tl.constexpr, INDEX_GROUP: tl.constexpr, PAIRS: tl.constexpr, BLOCK: tl.constexpr,
    INDEX_DIM: tl.constexpr, SEGMENT_PAIRS: tl.constexpr, TOP_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One segment of a key-block -> queries list: for each of its (token, index head) pairs,
    the sum over the block's visible keys of exp(z - the row's largest kept score), stored in
    the pair's slot of SLOT_SUMS [Tq, HI, TOP_K] (each slot written once: no atomics)."""
    segment, first, last, index_head, block, seq_start, seq_len, query_base = _segment(
        SEGMENTS, SEGMENT_ORDER, BUCKET_START, BUCKET_COUNT, BLOCK_SEQUENCE, BLOCK_LOCAL,
        CU_SEQLENS, query_start, HI, SEGMENT_PAIRS)
    if segment < 0:
        return
    key_pos, key_valid, key_token = _block_keys(seq_start, seq_len, block, BLOCK)
    ik = _load_rows(IK, key_token, key_valid, index_head // INDEX_GROUP, stride_ik_t,
                    stride_ik_h, INDEX_DIM)
    index_dims = tl.arange(0, INDEX_DIM)
    for first_pair in range(first, last, PAIRS):
        pair_valid = first_pair + tl.arange(0, PAIRS) < last
        token = tl.load(PAIR_TOKEN + first_pair + tl.arange(0, PAIRS), mask=pair_valid, other=0)
        slot = tl.load(PAIR_SLOT + first_pair + tl.arange(0, PAIRS), mask=pair_valid, other=0)
        row = token.to(tl.int64) * HI + index_head
        index_q = tl.load(IQ + token[:, None].to(tl.int64) * stride_iq_t
                          + index_head * stride_iq_h + index_dims[None, :],
                          mask=pair_valid[:, None], other=0.0)  # [PAIRS, Di]
        row_max = tl.load(INDEX_MAX + row, mask=pair_valid, other=0.0)
        z_t = tl.dot(ik, tl.trans(index_q), input_precision=PRECISION) * index_scale
        query_pos = token - query_base
        visible_t = (pair_valid[None, :] & key_valid[:, None]
                     & (key_pos[:, None] <= query_pos[None, :]))
        terms = tl.where(visible_t, tl.exp(z_t - row_max[None, :]), 0.0)  # [BLOCK, PAIRS]
        tl.store(SLOT_SUMS + row * TOP_K + slot, tl.sum(terms, axis=0), mask=pair_valid)


def index_log_sum_exp_key_outer(index_q, index_k, index_max, p: SparseAttentionProblem,
                                walk_limit: int | None = None):
    """``index_log_sum_exp`` given each row's largest kept score, split by each tile's union:
    the query-outer walk takes the tiles of at most ``walk_limit`` blocks (default
    ``INDEX_WALK_LIMIT_PER_SLOT * top_k``; 0: none), and a key-outer pass the rows it left,
    over a key-block list of their pairs alone (one more list build; a program per segment,
    each pair's terms summed into its slot, a row's slots added in slot order). So the cost
    follows the kept pairs where unions are large and stays the walk's where they are small,
    and the result is reproducible run to run (no atomics). Where no tile's union can pass
    the limit (short sequences), the walk alone runs."""
    if walk_limit is None:
        walk_limit = INDEX_WALK_LIMIT_PER_SLOT * p.top_k
    if walk_limit >= p.union_bound(p.index_tile_work):
        return index_log_sum_exp(index_q, index_k, index_max, p)
    walked = torch.full((p.total, p.num_index_heads), float("nan"), dtype=torch.float32,
                        device=index_q.device)
    if walk_limit > 0:
        index_log_sum_exp(index_q, index_k, index_max, p, walk_limit, lse_index=walked)
    left = walked.isnan()  # the rows of the tiles the walk left
    work = p.block_work_of_rows(left)
    slot_sums = torch.zeros(p.total, p.num_index_heads, p.top_k, dtype=torch.float32,
                            device=index_q.device)
    launch(_index_sum_key_outer_kernel, (work.segments.shape[0],),
        index_q, index_k, index_max, slot_sums, work.segments, work.segment_order,
        work.pair_token, work.pair_slot, work.bucket_start, work.bucket_count,
        work.block_sequence, work.block_local, p.cu_seqlens, p.query_start,
        *strides(index_q, index_k), p.index_scale,
        HI=p.num_index_heads, INDEX_GROUP=p.index_group, PAIRS=INDEX_KEY_OUTER_PAIRS,
        BLOCK=p.block_size, INDEX_DIM=p.index_dim, SEGMENT_PAIRS=work.segment_pairs,
        TOP_K=p.top_k, PRECISION=p.shared["PRECISION"], **INDEX_KEY_OUTER_CONFIG)
    return torch.where(left, index_max + slot_sums.sum(-1).log(), walked)
