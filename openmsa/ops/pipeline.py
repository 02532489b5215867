"""``msa_attention`` on the kernels, stage by stage: select -> work lists -> attention -> KL
(``forward``), and the attention's and the KL's gradients (``backward``); the main attention
alone over given blocks (``sparse_forward``, ``sparse_backward``: ``sparse_attention`` and the
layers that share another layer's selection). ``custom_ops`` wraps them as PyTorch operators.

Inputs are packed: q ``[Tq, H, D]``, k and v ``[T, Hkv, D]``, index_q ``[Tq, Hi, Di]``, index_k
``[T, Hik, Di]``, cu_seqlens int32 ``[N + 1]``; block ids are token-major int32 ``[Tq, Hi, k]``.
The queries are the packed tokens ``[query_start, query_start + Tq)`` of the keys' packing (all
of them by default: ``query_start = 0``, ``Tq = T``), and the KL is a mean over
``kl_num_queries`` query tokens (None: Tq); context parallelism runs each rank's queries so.

The KL's gradients do not depend on ``dout`` (only on the scalar gradient reaching ``kl``), so
the forward computes them unscaled, along with the value, and the backward only scales them
(with ``Tuning.kl_teacher = "from_dkdv"`` and no value wanted, the backward computes them from
the teachers its dK/dV pass stores: ``_teacher_from_dkdv``).
The forward also returns the work lists it built (the query-tile lists and the key-block ->
queries list the KL walked), so the backward does not build them again.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .attention import attention_backward, sparse_attention_fwd
from .configs import DEFAULT_TUNING, Tuning
from .dense import dense_attention_backward, dense_attention_forward, dense_log_sum_exp
from .kl import (index_branch_kl, kl_from_teacher, new_teacher, scaled_kl_gradients,
                 teacher_dtype)
from .layout import all_causal_block_ids
from .problem import SparseAttentionProblem, query_tile_shape, segment_pairs
from .select import select_blocks_fwd
from .validate import query_positions_from_offsets
from .worklists import BlockWork, QueryTileWork, block_work_sizes, build_causal_query_tile_work


def block_work_shape(q, k, num_index_heads: int, cu_seqlens, slots: int, block_size: int,
                     tuning: Tuning = DEFAULT_TUNING):
    """(pairs, global blocks, segments) of the key-block list, from the shapes alone, and its
    pairs per segment: as ``SparseAttentionProblem`` builds it."""
    pairs_per_segment = segment_pairs(tuning, q.shape[0], q.shape[1], num_index_heads, slots,
                                      q.device)
    sizes = block_work_sizes(q.shape[0], num_index_heads, slots, k.shape[0],
                             cu_seqlens.shape[0] - 1, block_size, pairs_per_segment)
    return sizes, pairs_per_segment


def unpacked_block_work(block_work: Optional[torch.Tensor], q, k, block_ids, cu_seqlens,
                        block_size: int, tuning: Tuning = DEFAULT_TUNING) -> Optional[BlockWork]:
    """The key-block list a forward returned packed (``BlockWork.packed``), or None when it
    returned none (None or an empty tensor)."""
    if block_work is None or not block_work.numel():
        return None
    sizes, pairs_per_segment = block_work_shape(q, k, block_ids.shape[1], cu_seqlens,
                                                block_ids.shape[2], block_size, tuning)
    return BlockWork.unpacked(block_work, *sizes, num_index_heads=block_ids.shape[1],
                              segment_pairs=pairs_per_segment)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index_q: torch.Tensor,
            index_k: torch.Tensor, cu_seqlens: torch.Tensor, block_ids: Optional[torch.Tensor],
            top_k: int, block_size: int, softmax_scale: float, index_scale: float,
            num_local_blocks: int, num_sink_blocks: int, warmup: bool, max_seqlen: int,
            kl_value: bool, index_grad: bool, query_start: int = 0,
            kl_num_queries: Optional[int] = None, dense_batch: int = 0,
            deterministic: bool = False, index_precision: str = "input",
            local_block_dilation: int = 1, tuning: Tuning = DEFAULT_TUNING):
    """Returns out, kl (fp32 0-dim: the exact KL, clamped at 0, or 0 with ``kl_value=False``),
    the main lse2 ``[Tq, H]``, the index log-sum-exp ``[Tq, Hi]``, the kept block ids, the
    unscaled KL gradients of index_q (fp32 ``[Tq, Hi, Di]``) and index_k (fp32, index_k's
    shape) and the packed key-block -> queries list (all three empty unless ``index_grad``,
    and also where the backward takes the teachers from its dK/dV pass),
    and the query-tile work lists (schedule, union, union members, union count).

    ``block_ids``: given kept blocks, or None to select (or, in warmup, keep every causal block
    of sequences up to ``max_seqlen`` tokens). ``dense_batch`` > 0: warmup's main attention runs
    on cuDNN over that many equal batch rows (``openmsa.ops.dense``; every token a query).
    ``deterministic``: the KL's gradients and value are summed in a fixed order
    (``kl.index_branch_kl``). ``index_precision``: the scores selection ranks ("input" or
    "fp8", SPEC section 8); the KL always uses the input-precision ones.
    ``local_block_dilation``: the spacing of the forced local blocks (SPEC section 3 step 3)."""
    # 1. Selection: the kept block ids [Tq, Hi, k].
    query_work = index_max = None
    if warmup:
        ids, query_work = _causal_ids_and_work(q, k, cu_seqlens, index_q.shape[1], block_size,
                                               max_seqlen, query_start)
    elif block_ids is not None:
        ids = block_ids.clone()  # outputs may not alias inputs
    else:
        # Selection's largest block score is each row's largest kept index score when a slot
        # is left for the best block beside the forced ones; the forward then needs no running
        # maximum for the index log-sum-exp. fp8 scores are not the KL's: the forward keeps
        # its running maximum then (an fp8 shift far off could overflow the sum).
        keeps_best = (top_k > num_local_blocks + num_sink_blocks
                      and index_precision == "input")
        selected = select_blocks_fwd(
            index_q, index_k, cu_seqlens, top_k=top_k, block_size=block_size,
            index_softmax_scale=index_scale, num_local_blocks=num_local_blocks,
            num_sink_blocks=num_sink_blocks, query_start=query_start,
            index_precision=index_precision, return_max=keeps_best,
            local_block_dilation=local_block_dilation)
        ids, index_max = selected if keeps_best else (selected, None)
    # 2. Work lists: the query tiles' block unions now, the key-block list when first needed.
    problem = SparseAttentionProblem(q, k, ids, cu_seqlens, block_size, softmax_scale, index_k,
                                     index_scale, query_start=query_start,
                                     kl_num_queries=kl_num_queries, query_work=query_work,
                                     all_causal=warmup, tuning=tuning)
    # 3. Main attention, with the index branch's log-sum-exp over the kept tokens.
    if dense_batch:
        out, lse = dense_attention_forward(q, k, v, dense_batch, softmax_scale)
        lse_index = dense_log_sum_exp(index_q, index_k, dense_batch, index_scale)
    else:
        out, lse, lse_index = sparse_attention_fwd(q, k, v, index_q, index_k, problem,
                                                   index_max)
    # 4. The KL's value and unscaled gradients (or, for the teachers of the backward's dK/dV
    # pass, nothing).
    kl = torch.zeros((), dtype=torch.float32, device=q.device)
    d_index_q, d_index_k = (q.new_empty(0, dtype=torch.float32) for _ in range(2))
    block_work = q.new_empty(0, dtype=torch.int32)
    if kl_value or forward_index_grads(
            index_grad, kl_value, deterministic, dense_batch, tuning,
            lambda: teacher_bytes(q, k, cu_seqlens, ids.shape, block_size, tuning)):
        value_parts, grad_q, grad_k = index_branch_kl(q, k, index_q, index_k, lse, lse_index,
                                                      problem, kl_value, index_grad,
                                                      deterministic)
        if kl_value:
            # Rounding can leave a KL of nearly agreeing distributions a hair below 0; a KL
            # divergence never is. The gradient (the registered backward) is unaffected.
            kl = problem.kl_mean(value_parts).clamp_min(0.0)
        if index_grad:
            d_index_q, d_index_k = grad_q, grad_k
            block_work = problem.block_work.packed()
    work = problem.query_work
    return (out, kl, lse, lse_index, ids, d_index_q, d_index_k, block_work, work.schedule,
            work.union, work.union_members, work.union_count)


def backward(dout: torch.Tensor, dkl: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, index_q: torch.Tensor, index_k: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, lse_index: torch.Tensor, block_ids: torch.Tensor,
             d_index_q: torch.Tensor, d_index_k: torch.Tensor, block_work: torch.Tensor,
             schedule: torch.Tensor, union: torch.Tensor, union_members: torch.Tensor,
             union_count: torch.Tensor, cu_seqlens: torch.Tensor, block_size: int,
             softmax_scale: float, index_scale: float, index_grads: bool, main_grads: bool,
             query_start: int = 0, kl_num_queries: Optional[int] = None, dense_batch: int = 0,
             deterministic: bool = False, tuning: Tuning = DEFAULT_TUNING):
    """With ``main_grads``, dq, dk, dv, and with ``index_grads``, the KL gradients of index_q
    and index_k (empty tensors otherwise: a frozen main or index branch costs no kernel).
    ``dkl``: the fp32 0-dim gradient reaching kl. ``d_index_q``, ``d_index_k``, ``block_work``:
    the forward's unscaled KL gradients and packed key-block list, or empty to compute them
    here. ``tuning`` must be the forward's."""
    work = QueryTileWork(schedule, union, union_members, union_count,
                         tile_tokens=query_tile_shape(q.shape[1] // block_ids.shape[1])[0])
    blocks = unpacked_block_work(block_work, q, k, block_ids, cu_seqlens, block_size, tuning)
    problem = SparseAttentionProblem(q, k, block_ids, cu_seqlens, block_size, softmax_scale,
                                     index_k, index_scale, query_work=work, block_work=blocks,
                                     query_start=query_start, kl_num_queries=kl_num_queries,
                                     tuning=tuning)
    # The forward left the index gradients to the backward: from the teachers the dK/dV pass
    # stores where it runs, else from the KL's own passes.
    teacher = None
    if (main_grads and index_grads and d_index_q.numel() == 0
            and _teacher_from_dkdv(tuning, deterministic, dense_batch)):
        teacher = new_teacher(q, problem)
    # Outputs may not alias each other: every skipped gradient is an empty tensor of its own.
    if not main_grads:
        dq, dk, dv = (q.new_empty(0) for _ in range(3))
    elif dense_batch:
        dq, dk, dv = dense_attention_backward(dout, q, k, v, out, lse, dense_batch,
                                              softmax_scale)
    else:
        dq, dk, dv = attention_backward(q, k, v, out, dout, lse, problem,
                                        deterministic=deterministic, teacher=teacher)
    if not index_grads:
        return dq, dk, dv, q.new_empty(0), q.new_empty(0)
    if teacher is not None:
        d_index_q, d_index_k = kl_from_teacher(q, k, index_q, index_k, lse, lse_index, teacher,
                                               problem)
    elif d_index_q.numel() == 0:  # the forward ran without index gradients
        _, d_index_q, d_index_k = index_branch_kl(q, k, index_q, index_k, lse, lse_index,
                                                  problem, False, True, deterministic)
    return (dq, dk, dv) + scaled_kl_gradients(d_index_q, d_index_k, dkl, problem,
                                              index_q.dtype, index_k.dtype)


def forward_index_grads(index_grad: bool, kl_value: bool, deterministic: bool,
                        dense_batch: int, tuning: Tuning,
                        teachers_bytes: Callable[[], int]) -> bool:
    """Whether ``forward`` returns the KL's index gradients (and the packed key-block list):
    where they are wanted, unless the backward takes them from its dK/dV pass's teachers (no
    value wanted then; ``teachers_bytes()``: those teachers' size, ``teacher_bytes``, asked
    only then). The registered operator's fake gives its output shapes by this too."""
    return index_grad and (kl_value or not (
        _teacher_from_dkdv(tuning, deterministic, dense_batch)
        and teachers_bytes() <= tuning.kl_teacher_max_bytes))


def teacher_bytes(q, k, cu_seqlens, block_ids_shape, block_size: int,
                  tuning: Tuning = DEFAULT_TUNING) -> int:
    """Bytes of the teachers the dK/dV pass would store (``kl.new_teacher``): one per pair of
    the key-block list and key of its block; ``block_ids_shape``: the kept ids' (or the ids)."""
    (pairs, _, _), _ = block_work_shape(q, k, block_ids_shape[1], cu_seqlens,
                                        block_ids_shape[2], block_size, tuning)
    return pairs * block_size * teacher_dtype(q.dtype).itemsize


def _teacher_from_dkdv(tuning: Tuning, deterministic: bool, dense_batch: int) -> bool:
    """Whether the index gradients may come from the teachers of the backward's dK/dV pass
    (``Tuning.kl_teacher``): not with ``deterministic`` (their kernel adds atomically) nor
    with cuDNN's dense backward (no dK/dV pass of ours). Only where the forward wants no KL
    value, which needs the teacher before any backward, and (``forward_index_grads``) where
    the teachers fit ``Tuning.kl_teacher_max_bytes``."""
    return tuning.kl_teacher == "from_dkdv" and not deterministic and not dense_batch


def _causal_ids_and_work(q, k, cu_seqlens, num_index_heads: int, block_size: int,
                         max_seqlen: int, query_start: int):
    """Warmup's kept blocks (every causal block of sequences up to ``max_seqlen`` tokens) and
    their query-tile work lists."""
    total = q.shape[0]
    positions = query_positions_from_offsets(cu_seqlens, k.shape[0])
    ids = all_causal_block_ids(positions[query_start:query_start + total], num_index_heads,
                               block_size, max_seqlen)
    tile_tokens = query_tile_shape(q.shape[1] // num_index_heads)[0]
    work = build_causal_query_tile_work(cu_seqlens, total, num_index_heads, tile_tokens,
                                        block_size, ids.shape[2], query_start)
    return ids, work


def sparse_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                   block_ids: Optional[torch.Tensor], num_index_heads: int, block_size: int,
                   softmax_scale: float, warmup: bool, max_seqlen: int, query_start: int = 0,
                   dense_batch: int = 0, query_work: Optional[QueryTileWork] = None,
                   tuning: Tuning = DEFAULT_TUNING):
    """The main attention alone (no index branch, no KL) over ``block_ids`` (token-major
    ``[Tq, Hi, k]``) or, with ``warmup``, over every causal block (``num_index_heads`` then
    shapes the work lists; ``dense_batch`` > 0: on cuDNN over that many equal batch rows).
    ``query_work``: the query-tile lists of ``block_ids`` when the forward that selected them
    built them already (a layer sharing its selection). Returns out, lse2 ``[Tq, H]``, the kept
    ids and the query-tile work lists (the given ones: the caller's)."""
    if warmup:
        ids, query_work = _causal_ids_and_work(q, k, cu_seqlens, num_index_heads, block_size,
                                               max_seqlen, query_start)
    else:
        ids = block_ids.clone()  # outputs may not alias inputs
    problem = SparseAttentionProblem(q, k, ids, cu_seqlens, block_size, softmax_scale,
                                     query_start=query_start, query_work=query_work,
                                     all_causal=warmup, tuning=tuning)
    if dense_batch:
        out, lse = dense_attention_forward(q, k, v, dense_batch, softmax_scale)
    else:
        out, lse, _ = sparse_attention_fwd(q, k, v, None, None, problem)
    work = problem.query_work
    return out, lse, ids, work.schedule, work.union, work.union_members, work.union_count


def sparse_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, block_ids: torch.Tensor,
                    schedule: torch.Tensor, union: torch.Tensor, union_members: torch.Tensor,
                    union_count: torch.Tensor, cu_seqlens: torch.Tensor, block_size: int,
                    softmax_scale: float, query_start: int = 0, dense_batch: int = 0,
                    block_work: Optional[torch.Tensor] = None,
                    tuning: Tuning = DEFAULT_TUNING):
    """dq, dk, dv of ``sparse_forward``'s attention, on its work lists; ``block_work``: the
    packed key-block list of ``block_ids`` when a forward built it already (the selecting
    layer's KL), else None or empty to build it here. ``tuning`` must be the forward's."""
    if dense_batch:
        return dense_attention_backward(dout, q, k, v, out, lse, dense_batch, softmax_scale)
    work = QueryTileWork(schedule, union, union_members, union_count,
                         tile_tokens=query_tile_shape(q.shape[1] // block_ids.shape[1])[0])
    blocks = unpacked_block_work(block_work, q, k, block_ids, cu_seqlens, block_size, tuning)
    problem = SparseAttentionProblem(q, k, block_ids, cu_seqlens, block_size, softmax_scale,
                                     query_work=work, block_work=blocks,
                                     query_start=query_start, tuning=tuning)
    return attention_backward(q, k, v, out, dout, lse, problem)
