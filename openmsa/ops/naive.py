"""Eager PyTorch reference of MSA: the test oracle for every kernel.

Written to be obviously correct, not fast. For one sequence (a batch row or one packed sequence),
with ``i`` a query position, ``j`` a key position and ``blk(j) = j // block_size``:

1. Index scores ``z[r,i,j] = index_softmax_scale * <index_q[i,r], index_k[j, r // (Hi/Hik)]>``
   for ``j <= i``, ``-inf`` otherwise. With ``index_precision="fp8"`` selection (steps 2-4)
   ranks ``index_softmax_scale * s_q * s_k * <q8, k8>`` instead, from the e4m3 codes and row
   scales of ``openmsa.ops.quantize``; the KL keeps ``z``.
2. Block scores ``m[r,i,n] = max_{j in block n, j <= i} z[r,i,j]`` (``-inf`` if the block is not
   visible yet).
3. Forced blocks: the own block ``blk(i)``, ``num_local_blocks - 1`` blocks before it spaced
   ``local_block_dilation`` apart (``blk(i) - d, blk(i) - 2d, ...``) and the first
   ``num_sink_blocks`` blocks (where visible). They count toward ``top_k``.
4. Selection: the forced blocks, then the highest block scores (raw, no softmax) until ``top_k``
   blocks are kept; ties go to the lower block id; ``-inf`` blocks are never kept; unused slots
   are ``-1``.
5. Kept tokens ``T[r,i] = {j <= i : blk(j) kept}`` (warmup: every ``j <= i``).
6. Main attention of head ``h`` (index head ``r = h // (H/Hi)``, KV head ``h // (H/Hkv)``):
   softmax over ``T[r,i]`` of ``softmax_scale * <q, k>``, times ``v``.
7. KL: teacher ``t`` = mean of the main probabilities of the ``H/Hi`` heads of index head ``r``
   (detached); student ``s = softmax_{T[r,i]}(z)``;
   ``kl = sum_{r,i,j in T} t * log(t / s) / (Nq * Hi)`` with ``Nq`` the number of query tokens.

Gradients come from autograd: ``out`` reaches q, k, v only (selection is discrete), ``kl``
reaches index_q, index_k only (the teacher is detached). Queries are processed in chunks, each
under activation checkpointing, so only one chunk's ``[heads, chunk, S]`` scores are alive at a
time, in the forward and in the backward.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from .quantize import quantize_rows_e4m3
from .validate import MSAProblem

# Elements of one chunk's [B, H, chunk, S] score tensor (fp32: 256 MiB).
_CHUNK_ELEMENTS = 1 << 26


def select_blocks_from_scores(block_scores: torch.Tensor, query_block: torch.Tensor, top_k: int,
                              num_local_blocks: int, num_sink_blocks: int,
                              local_block_dilation: int = 1) -> torch.Tensor:
    """Steps 3-4: kept block ids from block scores.

    block_scores: ``[..., C, NB]`` float, ``-inf`` for blocks not visible to the query.
    query_block: ``[C]`` int64 (or any shape broadcasting against ``[..., C]``), the block of
    each query.
    Returns ``[..., C, top_k]`` int64 block ids, ``-1`` for unused slots.
    """
    num_blocks = block_scores.shape[-1]
    blocks = torch.arange(num_blocks, device=block_scores.device)
    behind = query_block[..., None] - blocks  # [..., C, NB] blocks before the query's
    local = (behind % local_block_dilation == 0) & (
        behind < num_local_blocks * local_block_dilation)
    forced = (behind >= 0) & (local | (blocks < num_sink_blocks))
    ranked = block_scores.masked_fill(forced, float("inf"))
    # A stable descending sort keeps equal scores in block order: ties go to the lower id.
    scores, ids = torch.sort(ranked, dim=-1, descending=True, stable=True)
    ids = ids[..., :top_k].masked_fill(scores[..., :top_k] == float("-inf"), -1)
    if num_blocks < top_k:
        ids = torch.nn.functional.pad(ids, (0, top_k - num_blocks), value=-1)
    return ids


def _kept_token_mask(block_ids: torch.Tensor, num_keys: int, block_size: int) -> torch.Tensor:
    """``[..., C, k]`` block ids (-1 = unused) -> ``[..., C, num_keys]`` bool, True for keys in a
    kept block (causality is applied by the caller)."""
    num_blocks = -(-num_keys // block_size)
    # Unused slots (-1) and blocks after the last key (never visible) write into an extra column
    # that is dropped.
    unused = (block_ids < 0) | (block_ids >= num_blocks)
    slots = torch.where(unused, num_blocks, block_ids)
    kept_blocks = torch.zeros(*block_ids.shape[:-1], num_blocks + 1, dtype=torch.bool,
                              device=block_ids.device)
    kept_blocks.scatter_(-1, slots, True)
    return kept_blocks[..., :num_blocks].repeat_interleave(block_size, dim=-1)[..., :num_keys]


def _index_scores(index_q, index_k, causal, scale):
    """Step 1: ``[B, C, Hi, Di] x [B, N, Hik, Di] -> [B, Hi, C, N]``, ``-inf`` where not causal."""
    index_k = index_k.repeat_interleave(index_q.shape[2] // index_k.shape[2], dim=2)
    z = scale * torch.einsum("bird,bjrd->brij", index_q, index_k)
    return z.masked_fill(~causal, float("-inf"))


def _quantized_index_scores(index_q, index_k, causal, scale, compute_dtype):
    """Step 1 in fp8 (SPEC section 8): ``scale * s_q * s_k * <q8, k8>``, ``[B, Hi, C, N]``."""
    q8, q_scale = quantize_rows_e4m3(index_q)  # [B, C, Hi, Di], [B, C, Hi]
    k8, k_scale = quantize_rows_e4m3(index_k)
    group = index_q.shape[2] // index_k.shape[2]
    k8, k_scale = k8.repeat_interleave(group, dim=2), k_scale.repeat_interleave(group, dim=2)
    codes_dot = torch.einsum("bird,bjrd->brij", q8.to(compute_dtype), k8.to(compute_dtype))
    z = (scale * q_scale.transpose(1, 2)[..., None].to(compute_dtype)
         * k_scale.transpose(1, 2)[..., None, :].to(compute_dtype) * codes_dot)
    return z.masked_fill(~causal, float("-inf"))


def _selection_scores(index_q, index_k, causal, scale, index_precision, compute_dtype):
    """The index scores selection ranks: ``[B, Hi, C, N]`` in the given precision."""
    if index_precision == "fp8":
        return _quantized_index_scores(index_q, index_k, causal, scale, compute_dtype)
    return _index_scores(index_q.to(compute_dtype), index_k.to(compute_dtype), causal, scale)


def _select_from_index_scores(z, query_pos, block_size, top_k, num_local_blocks, num_sink_blocks,
                              local_block_dilation=1):
    """Steps 2-4: index scores ``[B, Hi, C, N]`` -> kept block ids ``[B, Hi, C, top_k]``."""
    num_keys = z.shape[-1]
    num_blocks = -(-num_keys // block_size)
    # Block max-pool; the partial last block is padded with -inf.
    padded = torch.nn.functional.pad(z, (0, num_blocks * block_size - num_keys),
                                     value=float("-inf"))
    block_scores = padded.view(*z.shape[:-1], num_blocks, block_size).amax(dim=-1)
    return select_blocks_from_scores(block_scores, query_pos // block_size, top_k,
                                     num_local_blocks, num_sink_blocks, local_block_dilation)


@torch.no_grad()
def naive_select_blocks(index_q, index_k, cu_seqlens, *, top_k, block_size, index_softmax_scale,
                        num_local_blocks, num_sink_blocks, index_precision="input",
                        local_block_dilation=1):
    """Reference of steps 1-4 alone: kept block ids, int32 ``[B, Hi, S, top_k]`` for ``[B, S, ...]``
    inputs, ``[Hi, T, top_k]`` for packed ones."""
    compute_dtype = torch.float64 if index_q.dtype == torch.float64 else torch.float32
    if cu_seqlens is None:
        sequences = [(index_q, index_k)]
    else:
        flat_q, flat_k = index_q.reshape(index_q.shape[-3:]), index_k.reshape(index_k.shape[-3:])
        offsets = cu_seqlens.tolist()
        sequences = [(flat_q[None, a:b], flat_k[None, a:b])
                     for a, b in zip(offsets[:-1], offsets[1:]) if b > a]
    ids = []
    for seq_q, seq_k in sequences:
        batch, seqlen = seq_q.shape[:2]
        chunk = max(1, _CHUNK_ELEMENTS // (batch * seq_q.shape[2] * seqlen))
        for start in range(0, seqlen, chunk):
            end = min(start + chunk, seqlen)
            query_pos = torch.arange(start, end, device=seq_q.device)
            causal = torch.arange(end, device=seq_q.device)[None, :] <= query_pos[:, None]
            z = _selection_scores(seq_q[:, start:end], seq_k[:, :end], causal,
                                  index_softmax_scale, index_precision, compute_dtype)
            ids.append(_select_from_index_scores(z, query_pos, block_size, top_k,
                                                 num_local_blocks, num_sink_blocks,
                                                 local_block_dilation))
    if cu_seqlens is None:
        return torch.cat(ids, dim=2).to(torch.int32)
    return torch.cat([i[0] for i in ids], dim=1).to(torch.int32)


def _attend_chunk(q, k, v, index_q, index_k, block_ids, first_query: int, problem: MSAProblem,
                  compute_dtype: torch.dtype):
    """Steps 1-7 for queries ``first_query .. first_query + C - 1`` of one batch of sequences.

    q: [B, C, H, D]; k, v: [B, N, Hkv, D] with N = first_query + C (later keys are never visible);
    index_q: [B, C, Hi, Di]; index_k: [B, N, Hik, Di] (both None: main attention alone, on given
    block_ids, and a zero KL);
    block_ids: [B, Hi, C, k] externally given kept blocks, or None to select them here.
    Returns out [B, C, H, D] (compute dtype), the chunk's unnormalized KL sum (0-dim) and the
    kept block ids [B, Hi, C, top_k] (None in warmup).
    """
    p = problem
    batch, num_queries, num_keys = q.shape[0], q.shape[1], k.shape[1]
    q, k, v = q.to(compute_dtype), k.to(compute_dtype), v.to(compute_dtype)

    query_pos = torch.arange(first_query, first_query + num_queries, device=q.device)
    key_pos = torch.arange(num_keys, device=q.device)
    causal = key_pos[None, :] <= query_pos[:, None]  # [C, N]

    # Step 1: index scores [B, Hi, C, N].
    if index_q is not None:
        z = _index_scores(index_q.to(compute_dtype), index_k.to(compute_dtype), causal,
                          p.index_softmax_scale)

    if p.warmup:
        kept = causal.expand(batch, p.num_index_heads, num_queries, num_keys)
    else:
        if block_ids is None:  # Steps 2-4.
            ranked = z.detach() if p.index_precision == "input" else _selection_scores(
                index_q.detach(), index_k.detach(), causal, p.index_softmax_scale,
                p.index_precision, compute_dtype)
            block_ids = _select_from_index_scores(ranked, query_pos, p.block_size, p.top_k,
                                                  p.num_local_blocks, p.num_sink_blocks,
                                                  p.local_block_dilation)
        # Step 5.
        kept = _kept_token_mask(block_ids, num_keys, p.block_size) & causal  # [B, Hi, C, N]

    # Step 6: main attention [B, H, C, N].
    heads_per_index_head = p.num_heads // p.num_index_heads
    k = k.repeat_interleave(p.num_heads // p.num_kv_heads, dim=2)
    v = v.repeat_interleave(p.num_heads // p.num_kv_heads, dim=2)
    logits = p.softmax_scale * torch.einsum("bihd,bjhd->bhij", q, k)
    logits = logits.masked_fill(~kept.repeat_interleave(heads_per_index_head, dim=1),
                                float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    out = torch.einsum("bhij,bjhd->bihd", probs, v)

    if index_q is None:
        return out, q.new_zeros(()), block_ids

    # Step 7: KL(teacher || student) on the kept tokens.
    teacher = probs.detach().view(batch, p.num_index_heads, heads_per_index_head,
                                  num_queries, num_keys).mean(dim=2)
    log_student = torch.log_softmax(z.masked_fill(~kept, float("-inf")), dim=-1)
    terms = torch.where(teacher > 0, teacher * (teacher.log() - log_student),
                        torch.zeros_like(teacher))
    return out, terms.sum(), (None if p.warmup else block_ids)


def _attend_sequences(q, k, v, index_q, index_k, block_ids, problem: MSAProblem,
                      compute_dtype: torch.dtype, first_position: int = 0,
                      chunk_elements: int = _CHUNK_ELEMENTS):
    """The queries ``[B, Sq, ...]`` at positions ``first_position ..`` of sequences whose keys
    ``[B, first_position + Sq, ...]`` start at position 0, chunk by chunk. Returns out
    [B, Sq, H, D] (compute dtype), the unnormalized KL sum and kept ids [B, Hi, Sq, top_k]
    (None in warmup)."""
    batch, num_queries, num_keys = q.shape[0], q.shape[1], k.shape[1]
    chunk = max(1, chunk_elements // (batch * problem.num_heads * num_keys))
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, index_q, index_k))
    outs, kl_sum, ids = [], q.new_zeros((), dtype=compute_dtype), []
    for start in range(0, num_queries, chunk):
        end = min(start + chunk, num_queries)
        keys_end = first_position + end
        index_chunk = (None, None) if index_q is None else (index_q[:, start:end],
                                                            index_k[:, :keys_end])
        args = (q[:, start:end], k[:, :keys_end], v[:, :keys_end], *index_chunk,
                None if block_ids is None else block_ids[:, :, start:end],
                first_position + start, problem, compute_dtype)
        if needs_grad:
            out, chunk_kl, chunk_ids = checkpoint(_attend_chunk, *args, use_reentrant=False)
        else:
            out, chunk_kl, chunk_ids = _attend_chunk(*args)
        outs.append(out)
        kl_sum = kl_sum + chunk_kl
        ids.append(chunk_ids)
    block_ids = None if problem.warmup else torch.cat(ids, dim=2)
    return torch.cat(outs, dim=1), kl_sum, block_ids


def naive_msa_forward(q, k, v, index_q, index_k, problem: MSAProblem, cu_seqlens=None,
                      block_indices=None, compute_dtype=None,
                      chunk_elements: int = _CHUNK_ELEMENTS):
    """Reference MSA on validated inputs.

    Returns ``(out, kl, block_ids)``: ``out`` in q's dtype and shape, ``kl`` a float32 0-dim
    tensor, ``block_ids`` int32 ``[B, Hi, S, top_k]`` (packed: ``[Hi, T, top_k]``; None in warmup).
    Given ``block_indices`` are used instead of selecting; then ``block_ids`` holds them (a new
    int32 tensor).
    With a query range (``problem.query_start``), q and index_q hold the tokens from
    ``query_start`` on, and k, v, index_k every token of the packing (or of the one sequence).
    ``compute_dtype`` defaults to float32 (float64 for float64 inputs); tests set the input's
    16-bit dtype to get the error of a reference that computes in that dtype.
    ``chunk_elements`` bounds the elements of one chunk's score tensor.
    """
    if compute_dtype is None:
        compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if block_indices is not None:
        block_indices = block_indices.long()
    if cu_seqlens is None:
        out, kl_sum, block_ids = _attend_sequences(q, k, v, index_q, index_k, block_indices,
                                                   problem, compute_dtype, problem.query_start,
                                                   chunk_elements)
    else:
        query_q, key_k, key_v, query_iq, key_ik = (
            None if t is None else t.reshape(t.shape[-3:])  # [tokens, heads, dim]
            for t in (q, k, v, index_q, index_k))
        offsets = cu_seqlens.tolist()
        first_query, end_query = problem.query_start, problem.query_start + problem.seqlen
        outs, kl_sum, ids = [], q.new_zeros((), dtype=compute_dtype), []
        for start, end in zip(offsets[:-1], offsets[1:]):
            # This sequence's queries: packed tokens [lo, hi), rows [lo, hi) - first_query.
            lo, hi = max(start, first_query), min(end, end_query)
            if hi <= lo:
                continue
            rows = slice(lo - first_query, hi - first_query)
            seq_q, seq_iq = (None if t is None else t[None, rows] for t in (query_q, query_iq))
            seq_k, seq_v, seq_ik = (None if t is None else t[None, start:hi]
                                    for t in (key_k, key_v, key_ik))
            seq_ids = None if block_indices is None else block_indices[None, :, rows]
            out, seq_kl, seq_block_ids = _attend_sequences(
                seq_q, seq_k, seq_v, seq_iq, seq_ik, seq_ids, problem, compute_dtype,
                first_position=lo - start, chunk_elements=chunk_elements)
            outs.append(out[0])
            kl_sum = kl_sum + seq_kl
            ids.append(None if seq_block_ids is None else seq_block_ids[0])
        out = torch.cat(outs, dim=0).reshape(q.shape)
        block_ids = None if problem.warmup else torch.cat(ids, dim=1)
    kl = (kl_sum / (problem.kl_num_queries * problem.num_index_heads)).float()
    # Rounding can leave a KL of nearly agreeing distributions a hair below 0; a KL divergence
    # never is. The clamp passes the gradient through unchanged.
    kl = kl + (kl.clamp_min(0.0) - kl).detach()
    if block_ids is not None:
        block_ids = block_ids.to(torch.int32)
    return out.to(q.dtype), kl, block_ids
