"""``msa_attention``'s kernels as PyTorch custom operators (``torch.library``).

``openmsa::msa_forward`` runs selection (or takes given blocks, or every causal block in
warmup), the sparse attention forward and the KL's forward parts; ``openmsa::msa_backward`` runs
the backward. Each has a fake implementation (output shapes from input shapes alone), so
``torch.compile`` traces through ``msa_attention`` without graph breaks, and the backward is
registered as the forward's autograd formula. The query-tile work lists built by the forward are
outputs, so the backward reuses them instead of building them again.

Inputs are packed: q ``[Tq, H, D]``, k and v ``[T, Hkv, D]``, index_q ``[Tq, Hi, Di]``, index_k
``[T, Hik, Di]``, cu_seqlens int32 ``[N + 1]``; block ids are token-major int32 ``[Tq, Hi, k]``.
The queries are the packed tokens ``[query_start, query_start + Tq)`` of the keys' packing (all
of them by default: ``query_start = 0``, ``Tq = T``), and the KL is a mean over
``kl_num_queries`` query tokens (None: Tq); context parallelism runs each rank's queries so.

The KL's gradients do not depend on ``dout`` (only on the scalar gradient reaching ``kl``), so
the forward computes them unscaled, along with the value, and the backward only scales them.
The key-block -> queries list the KL kernel walks is an output too (one flat int32 tensor), for
the backward's dK/dV.
"""

from typing import Optional

import torch

from . import attention
from .attention import (SparseAttentionProblem, attention_backward, index_branch_kl,
                        query_tile_shape, scaled_kl_gradients, sparse_attention_fwd)
from .csr import BlockWork, QueryTileWork, block_work_sizes, build_causal_query_tile_work
from .dense import dense_attention_backward, dense_attention_forward, dense_log_sum_exp
from .layout import all_causal_block_ids
from .schedule import query_tile_entries
from .select import select_blocks_fwd
from .validate import query_positions_from_offsets

Tensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _block_work_sizes(q, k, index_q, cu_seqlens, slots: int, block_size: int):
    return block_work_sizes(q.shape[0], index_q.shape[1], slots, k.shape[0],
                            cu_seqlens.shape[0] - 1, block_size,
                            _segment_pairs(q, index_q, slots))


def _segment_pairs(q, index_q, slots: int) -> int:
    """The key-block list's pairs per segment, as ``SparseAttentionProblem`` picks them."""
    return attention.segment_pairs(q.shape[0], index_q.shape[1], slots)


@torch.library.custom_op("openmsa::msa_forward", mutates_args=())
def msa_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index_q: torch.Tensor,
                index_k: torch.Tensor, cu_seqlens: torch.Tensor,
                block_ids: Optional[torch.Tensor], top_k: int, block_size: int,
                softmax_scale: float, index_scale: float, num_local_blocks: int,
                num_sink_blocks: int, warmup: bool, max_seqlen: int, kl_value: bool,
                index_grad: bool, query_start: int = 0, kl_num_queries: Optional[int] = None,
                dense_batch: int = 0, deterministic: bool = False,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                           torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                           torch.Tensor, torch.Tensor]:
    """Returns out, kl (fp32 0-dim: the exact KL, or 0 with ``kl_value=False``), the main lse2
    ``[Tq, H]``, the index log-sum-exp ``[Tq, Hi]``, the kept block ids, the unscaled KL
    gradients of index_q (fp32 ``[Tq, Hi, Di]``) and index_k (fp32, index_k's shape) and the
    packed key-block -> queries list (all three empty unless ``index_grad``), and the query-tile
    work lists. ``block_ids``: given kept blocks, or None to select (or, in warmup, keep every
    causal block of sequences up to ``max_seqlen`` tokens). ``dense_batch`` > 0: warmup's main
    attention runs on cuDNN over that many equal batch rows (``openmsa.ops.dense``; every token
    a query). ``deterministic``: the KL's gradients and value are summed in a fixed order
    (``attention.index_branch_kl``)."""
    total = q.shape[0]
    query_work = index_max = None
    if warmup:
        positions = query_positions_from_offsets(cu_seqlens, k.shape[0])
        ids = all_causal_block_ids(positions[query_start:query_start + total],
                                   index_q.shape[1], block_size, max_seqlen)
        tile_tokens = query_tile_shape(q.shape[1] // index_q.shape[1])[0]
        query_work = build_causal_query_tile_work(cu_seqlens, total, index_q.shape[1],
                                                  tile_tokens, block_size, ids.shape[2],
                                                  query_start)
    elif block_ids is not None:
        ids = block_ids.clone()  # outputs may not alias inputs
    else:
        # Selection's largest block score is each row's largest kept index score when a slot
        # is left for the best block beside the forced ones; the forward then needs no running
        # maximum for the index log-sum-exp.
        keeps_best = top_k > num_local_blocks + num_sink_blocks
        selected = select_blocks_fwd(
            index_q, index_k, cu_seqlens, top_k=top_k, block_size=block_size,
            index_softmax_scale=index_scale, num_local_blocks=num_local_blocks,
            num_sink_blocks=num_sink_blocks, query_start=query_start, return_max=keeps_best)
        ids, index_max = selected if keeps_best else (selected, None)
    problem = SparseAttentionProblem(q, k, ids, cu_seqlens, block_size, softmax_scale, index_k,
                                     index_scale, query_start=query_start,
                                     kl_num_queries=kl_num_queries, query_work=query_work,
                                     all_causal=warmup)
    if dense_batch:
        out, lse = dense_attention_forward(q, k, v, dense_batch, softmax_scale)
        lse_index = dense_log_sum_exp(index_q, index_k, dense_batch, index_scale)
    else:
        out, lse, lse_index = sparse_attention_fwd(q, k, v, index_q, index_k, problem,
                                                   index_max)
    kl = torch.zeros((), dtype=torch.float32, device=q.device)
    d_index_q, d_index_k = (q.new_empty(0, dtype=torch.float32) for _ in range(2))
    block_work = q.new_empty(0, dtype=torch.int32)
    if kl_value or index_grad:
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


@msa_forward.register_fake
def _(q, k, v, index_q, index_k, cu_seqlens, block_ids, top_k, block_size, softmax_scale,
      index_scale, num_local_blocks, num_sink_blocks, warmup, max_seqlen, kl_value, index_grad,
      query_start=0, kl_num_queries=None, dense_batch=0, deterministic=False):
    total, num_heads, _ = q.shape
    num_index_heads, index_dim = index_q.shape[1], index_q.shape[2]
    if warmup:
        slots = -(-max_seqlen // block_size)
    elif block_ids is not None:
        slots = block_ids.shape[2]
    else:
        slots = top_k
    tokens = query_tile_shape(num_heads // num_index_heads)[0]
    entries = query_tile_entries(total, cu_seqlens.shape[0] - 1, tokens, query_start)
    f32 = dict(dtype=torch.float32, device=q.device)
    i32 = dict(dtype=torch.int32, device=q.device)
    grad_q_shape = (total, num_index_heads, index_dim) if index_grad else (0,)
    grad_k_shape = index_k.shape if index_grad else (0,)
    pairs, blocks, segments = _block_work_sizes(q, k, index_q, cu_seqlens, slots, block_size)
    work_size = pairs + 3 * blocks * num_index_heads + 2 * blocks + 3 * segments
    width = tokens * slots
    return (torch.empty_like(q), q.new_empty((), **f32), q.new_empty(total, num_heads, **f32),
            q.new_empty(total, num_index_heads, **f32),
            q.new_empty(total, num_index_heads, slots, **i32), q.new_empty(grad_q_shape, **f32),
            q.new_empty(grad_k_shape, **f32),
            q.new_empty(work_size if index_grad else 0, **i32),
            q.new_empty(entries, 2, **i32), q.new_empty(entries, num_index_heads, width, **i32),
            q.new_empty(entries, num_index_heads, width, dtype=torch.int64, device=q.device),
            q.new_empty(entries, num_index_heads, **i32))


@torch.library.custom_op("openmsa::msa_backward", mutates_args=())
def msa_backward(dout: torch.Tensor, dkl: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, index_q: torch.Tensor, index_k: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, lse_index: torch.Tensor,
                 block_ids: torch.Tensor, d_index_q: torch.Tensor, d_index_k: torch.Tensor,
                 block_work: torch.Tensor, schedule: torch.Tensor, union: torch.Tensor,
                 union_members: torch.Tensor, union_count: torch.Tensor,
                 cu_seqlens: torch.Tensor, block_size: int, softmax_scale: float,
                 index_scale: float, index_grads: bool, main_grads: bool, query_start: int = 0,
                 kl_num_queries: Optional[int] = None, dense_batch: int = 0,
                 deterministic: bool = False) -> Tensors:
    """With ``main_grads``, dq, dk, dv, and with ``index_grads``, the KL gradients of index_q
    and index_k (empty tensors otherwise: a frozen main or index branch costs no kernel).
    ``dkl``: the fp32 0-dim gradient reaching kl. ``d_index_q``, ``d_index_k``, ``block_work``:
    the forward's unscaled KL gradients and packed key-block list, or empty to compute them
    here."""
    work = QueryTileWork(schedule, union, union_members, union_count,
                         tile_tokens=query_tile_shape(q.shape[1] // block_ids.shape[1])[0])
    blocks = None
    if block_work.numel():
        blocks = BlockWork.unpacked(
            block_work, *_block_work_sizes(q, k, index_q, cu_seqlens, block_ids.shape[2],
                                           block_size),
            num_index_heads=block_ids.shape[1],
            segment_pairs=_segment_pairs(q, index_q, block_ids.shape[2]))
    problem = SparseAttentionProblem(q, k, block_ids, cu_seqlens, block_size, softmax_scale,
                                     index_k, index_scale, query_work=work, block_work=blocks,
                                     query_start=query_start, kl_num_queries=kl_num_queries)
    # Outputs may not alias each other: every skipped gradient is an empty tensor of its own.
    if not main_grads:
        dq, dk, dv = (q.new_empty(0) for _ in range(3))
    elif dense_batch:
        dq, dk, dv = dense_attention_backward(dout, q, k, v, out, lse, dense_batch,
                                              softmax_scale)
    else:
        dq, dk, dv = attention_backward(q, k, v, out, dout, lse, problem)
    if not index_grads:
        return dq, dk, dv, q.new_empty(0), q.new_empty(0)
    if d_index_q.numel() == 0:  # the forward ran without index gradients
        _, d_index_q, d_index_k = index_branch_kl(q, k, index_q, index_k, lse, lse_index,
                                                  problem, False, True, deterministic)
    return (dq, dk, dv) + scaled_kl_gradients(d_index_q, d_index_k, dkl, problem,
                                              index_q.dtype, index_k.dtype)


@msa_backward.register_fake
def _(dout, dkl, q, k, v, index_q, index_k, out, lse, lse_index, block_ids, d_index_q,
      d_index_k, block_work, schedule, union, union_members, union_count, cu_seqlens,
      block_size, softmax_scale, index_scale, index_grads, main_grads, query_start=0,
      kl_num_queries=None, dense_batch=0, deterministic=False):
    main = ((torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)) if main_grads
            else tuple(q.new_empty(0) for _ in range(3)))
    index = ((torch.empty_like(index_q), torch.empty_like(index_k)) if index_grads
             else (q.new_empty(0), q.new_empty(0)))
    return main + index


def _setup_context(ctx, inputs, output):
    (q, k, v, index_q, index_k, cu_seqlens, _, _, block_size, softmax_scale, index_scale, *_,
     query_start, kl_num_queries, dense_batch, deterministic) = inputs
    out, _, *saved = output
    ctx.save_for_backward(q, k, v, index_q, index_k, out, cu_seqlens, *saved)
    # Gradients of outputs that reach nothing stay None instead of zero-filled tensors (ten
    # fill kernels a step); _backward handles None for out and kl.
    ctx.set_materialize_grads(False)
    ctx.options = (block_size, softmax_scale, index_scale)
    # Both operators take them.
    ctx.trailing_options = (query_start, kl_num_queries, dense_batch, deterministic)


def _backward(ctx, dout, dkl, *_):
    q, k, v, index_q, index_k, out, cu_seqlens, *saved = ctx.saved_tensors
    main_grads = any(ctx.needs_input_grad[:3])
    index_grads = ctx.needs_input_grad[3] or ctx.needs_input_grad[4]
    if dkl is None:
        dkl = torch.zeros((), dtype=torch.float32, device=q.device)
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv, grad_index_q, grad_index_k = msa_backward(
        dout, dkl, q, k, v, index_q, index_k, out, *saved, cu_seqlens, *ctx.options,
        index_grads, main_grads, *ctx.trailing_options)
    if not main_grads:
        dq = dk = dv = None
    if not index_grads:
        grad_index_q = grad_index_k = None
    return (dq, dk, dv, grad_index_q, grad_index_k) + (None,) * 16


msa_forward.register_autograd(_backward, setup_context=_setup_context)
