"""``msa_attention``'s kernels as PyTorch custom operators (``torch.library``): registration,
fake implementations and autograd, nothing else (the work is ``openmsa.ops.pipeline``'s).

``openmsa::msa_forward`` runs ``pipeline.forward``; ``openmsa::msa_backward`` runs
``pipeline.backward`` and is registered as the forward's autograd formula.
``openmsa::sparse_forward`` and ``openmsa::sparse_backward`` do the same for the main attention
alone (``pipeline.sparse_forward``: ``sparse_attention`` and layers sharing a selection). Each
has a fake implementation (output shapes from input shapes alone), so ``torch.compile`` traces
through ``msa_attention`` and ``sparse_attention`` without graph breaks. The work lists the
forward builds are outputs, so the backward reuses them instead of building them again.
Eager ``msa_attention`` calls run the same pipeline through a plain autograd Function instead
(``msa_operator`` chooses): the operators' Python dispatch costs short steps host time.
"""

import functools
from typing import Optional

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from . import pipeline
from .configs import DEFAULT_TUNING, Tuning
from .problem import query_tile_shape
from .worklists import QueryTileWork, query_tile_entries

Tensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@torch.library.custom_op("openmsa::msa_forward", mutates_args=())
def msa_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index_q: torch.Tensor,
                index_k: torch.Tensor, cu_seqlens: torch.Tensor,
                block_ids: Optional[torch.Tensor], top_k: int, block_size: int,
                softmax_scale: float, index_scale: float, num_local_blocks: int,
                num_sink_blocks: int, warmup: bool, max_seqlen: int, kl_value: bool,
                index_grad: bool, query_start: int = 0, kl_num_queries: Optional[int] = None,
                dense_batch: int = 0, deterministic: bool = False,
                index_precision: str = "input", local_block_dilation: int = 1,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                           torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                           torch.Tensor, torch.Tensor]:
    """``pipeline.forward`` as an operator (its fake gives the output shapes from the inputs')."""
    return pipeline.forward(q, k, v, index_q, index_k, cu_seqlens, block_ids, top_k, block_size,
                            softmax_scale, index_scale, num_local_blocks, num_sink_blocks,
                            warmup, max_seqlen, kl_value, index_grad, query_start,
                            kl_num_queries, dense_batch, deterministic, index_precision,
                            local_block_dilation)


@msa_forward.register_fake
def _(q, k, v, index_q, index_k, cu_seqlens, block_ids, top_k, block_size, softmax_scale,
      index_scale, num_local_blocks, num_sink_blocks, warmup, max_seqlen, kl_value, index_grad,
      query_start=0, kl_num_queries=None, dense_batch=0, deterministic=False,
      index_precision="input", local_block_dilation=1):
    total, num_heads, _ = q.shape
    num_index_heads, index_dim = index_q.shape[1], index_q.shape[2]
    if warmup:
        slots = -(-max_seqlen // block_size)
    elif block_ids is not None:
        slots = block_ids.shape[2]
    else:
        slots = top_k
    f32 = dict(dtype=torch.float32, device=q.device)
    i32 = dict(dtype=torch.int32, device=q.device)
    ids_shape = (total, num_index_heads, slots)
    with_grads = pipeline.forward_index_grads(
        index_grad, kl_value, deterministic, dense_batch, DEFAULT_TUNING,
        lambda: pipeline.teacher_bytes(q, k, cu_seqlens, ids_shape, block_size))
    grad_q_shape = (total, num_index_heads, index_dim) if with_grads else (0,)
    grad_k_shape = index_k.shape if with_grads else (0,)
    (pairs, blocks, segments), _ = pipeline.block_work_shape(q, k, num_index_heads, cu_seqlens,
                                                              slots, block_size)
    work_size = pairs + 3 * blocks * num_index_heads + 2 * blocks + 3 * segments
    return (torch.empty_like(q), q.new_empty((), **f32), q.new_empty(total, num_heads, **f32),
            q.new_empty(total, num_index_heads, **f32),
            q.new_empty(total, num_index_heads, slots, **i32), q.new_empty(grad_q_shape, **f32),
            q.new_empty(grad_k_shape, **f32),
            q.new_empty(work_size if with_grads else 0, **i32),
            *_fake_query_work(q, cu_seqlens, num_index_heads, slots, query_start))


def _fake_query_work(q, cu_seqlens, num_index_heads: int, slots: int, query_start: int):
    """The fake query-tile work lists (schedule, union, members, count) of the forwards."""
    total, num_heads, _ = q.shape
    tokens = query_tile_shape(num_heads // num_index_heads)[0]
    entries = query_tile_entries(total, cu_seqlens.shape[0] - 1, tokens, query_start)
    i32 = dict(dtype=torch.int32, device=q.device)
    width = tokens * slots
    return (q.new_empty(entries, 2, **i32), q.new_empty(entries, num_index_heads, width, **i32),
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
    """``pipeline.backward`` as an operator."""
    return pipeline.backward(dout, dkl, q, k, v, index_q, index_k, out, lse, lse_index,
                             block_ids, d_index_q, d_index_k, block_work, schedule, union,
                             union_members, union_count, cu_seqlens, block_size, softmax_scale,
                             index_scale, index_grads, main_grads, query_start, kl_num_queries,
                             dense_batch, deterministic)


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
    q, k, v, index_q, index_k, cu_seqlens, _, _, block_size, softmax_scale, index_scale = (
        inputs[:11])
    # The backward's trailing options; index_precision and local_block_dilation (selection's
    # alone) are not.
    query_start, kl_num_queries, dense_batch, deterministic = inputs[17:21]
    out, _, *saved = output
    ctx.save_for_backward(q, k, v, index_q, index_k, out, cu_seqlens, *saved)
    # Gradients of outputs that reach nothing stay None instead of zero-filled tensors (ten
    # fill kernels a step); _backward handles None for out and kl.
    ctx.set_materialize_grads(False)
    ctx.options = (block_size, softmax_scale, index_scale)
    # Both operators take them.
    ctx.trailing_options = (query_start, kl_num_queries, dense_batch, deterministic)


def _backward_with(backward):
    """The autograd formula of a forward operator whose backward is ``backward``
    (``msa_backward``'s arguments)."""

    def formula(ctx, dout, dkl, *_):
        q, k, v, index_q, index_k, out, cu_seqlens, *saved = ctx.saved_tensors
        main_grads = any(ctx.needs_input_grad[:3])
        index_grads = ctx.needs_input_grad[3] or ctx.needs_input_grad[4]
        if dkl is None:
            dkl = torch.zeros((), dtype=torch.float32, device=q.device)
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv, grad_index_q, grad_index_k = backward(
            dout, dkl, q, k, v, index_q, index_k, out, *saved, cu_seqlens, *ctx.options,
            index_grads, main_grads, *ctx.trailing_options)
        if not main_grads:
            dq = dk = dv = None
        if not index_grads:
            grad_index_q = grad_index_k = None
        return (dq, dk, dv, grad_index_q, grad_index_k) + (None,) * 18

    return formula


msa_forward.register_autograd(_backward_with(msa_backward), setup_context=_setup_context)


def tuned_msa_forward(tuning: Tuning):
    """``msa_forward`` with other work-list and key-outer sizes (``configs.Tuning``), through a
    plain autograd Function instead of the registered operators: the same pipeline without the
    operators' Python dispatch (``msa_operator``), and for tests the kernels at sizes the
    defaults reach only on long sequences (several segments per key block, several steps per
    segment)."""
    formula = _backward_with(functools.partial(pipeline.backward, tuning=tuning))

    class TunedMSAForward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            output = pipeline.forward(*inputs, tuning=tuning)
            _setup_context(ctx, inputs, output)
            return output

        @staticmethod
        def backward(ctx, *grads):
            return formula(ctx, *grads)

    return TunedMSAForward.apply


eager_msa_forward = tuned_msa_forward(DEFAULT_TUNING)


@functools.lru_cache(maxsize=None)
def _eager_msa_forward(tuning: Tuning):
    """One autograd Function per tuning a caller names (``Tuning`` is frozen, so hashable)."""
    return eager_msa_forward if tuning == DEFAULT_TUNING else tuned_msa_forward(tuning)


def msa_operator(*inputs: torch.Tensor, tuning: Tuning = DEFAULT_TUNING):
    """The forward operator ``msa_attention`` runs on ``inputs`` (its tensors): the registered
    ``msa_forward`` wherever a tracer or a mode must see one operator (torch.compile and
    export, fake or meta tensors, a TorchDispatchMode such as FakeTensorMode or
    FlopCounterMode, tensor subclasses), else ``eager_msa_forward``: the same pipeline and
    kernels through a plain autograd Function, which skips the operators' Python dispatch
    (argument defaults, schema and aliasing checks: about 0.1-0.2 ms a call on the host, which
    short eager steps wait for). ``tuning``: eager calls only (the registered operators run
    the default; a tracer or mode with another raises)."""
    if _needs_registered_operators(inputs, tuning):
        return msa_forward
    return _eager_msa_forward(tuning)


def is_traced(inputs) -> bool:
    """Whether a tracer or a mode must see the registered operators on ``inputs`` (their
    tensors): torch.compile and export, fake or meta tensors, a dispatch mode, tensor
    subclasses."""
    return (torch.compiler.is_compiling() or is_in_torch_dispatch_mode()
            or any(type(t) not in (torch.Tensor, torch.nn.Parameter) or t.is_meta
                   for t in inputs))


def _needs_registered_operators(inputs, tuning: Tuning) -> bool:
    """Whether a tracer or a mode must see the registered operators (``is_traced``); they run
    the default tuning only, so another raises."""
    traced = is_traced(inputs)
    if traced and tuning != DEFAULT_TUNING:
        raise ValueError("tuning: torch.compile, export, fake or meta tensors and dispatch "
                         "modes run the registered operators, which take the default "
                         "tuning only; leave tuning=None there")
    return traced


@torch.library.custom_op("openmsa::sparse_forward", mutates_args=())
def sparse_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                   block_ids: Optional[torch.Tensor], num_index_heads: int, block_size: int,
                   softmax_scale: float, warmup: bool, max_seqlen: int, query_start: int = 0,
                   dense_batch: int = 0, schedule: Optional[torch.Tensor] = None,
                   union: Optional[torch.Tensor] = None,
                   union_members: Optional[torch.Tensor] = None,
                   union_count: Optional[torch.Tensor] = None,
                   block_work: Optional[torch.Tensor] = None,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                              torch.Tensor, torch.Tensor]:
    """``pipeline.sparse_forward`` as an operator. ``schedule`` ... ``union_count``: the
    query-tile lists of ``block_ids`` that the selecting forward built (a sharing layer), then
    returned as empty tensors (outputs may not alias inputs) and saved from the inputs;
    ``block_work``: that forward's packed key-block list, for the backward alone."""
    return _run_sparse_forward(q, k, v, cu_seqlens, block_ids, num_index_heads, block_size,
                               softmax_scale, warmup, max_seqlen, query_start, dense_batch,
                               schedule, union, union_members, union_count)


def _run_sparse_forward(q, k, v, cu_seqlens, block_ids, num_index_heads, block_size,
                        softmax_scale, warmup, max_seqlen, query_start=0, dense_batch=0,
                        schedule=None, union=None, union_members=None, union_count=None,
                        block_work=None, tuning: Tuning = DEFAULT_TUNING):
    """``sparse_forward``'s body on ``tuning``'s routes (``block_work`` is the backward's)."""
    given = None
    if schedule is not None:
        given = QueryTileWork(schedule, union, union_members, union_count,
                              tile_tokens=query_tile_shape(q.shape[1] // num_index_heads)[0])
    out, lse, ids, *work = pipeline.sparse_forward(q, k, v, cu_seqlens, block_ids,
                                                   num_index_heads, block_size, softmax_scale,
                                                   warmup, max_seqlen, query_start, dense_batch,
                                                   given, tuning=tuning)
    if given is not None:  # outputs may not alias inputs: the given lists are saved from those
        work = [q.new_empty(0, dtype=t.dtype) for t in work]
    return (out, lse, ids, *work)


@sparse_forward.register_fake
def _(q, k, v, cu_seqlens, block_ids, num_index_heads, block_size, softmax_scale, warmup,
      max_seqlen, query_start=0, dense_batch=0, schedule=None, union=None, union_members=None,
      union_count=None, block_work=None):
    total, num_heads, _ = q.shape
    slots = -(-max_seqlen // block_size) if warmup else block_ids.shape[2]
    work = _fake_query_work(q, cu_seqlens, num_index_heads, slots, query_start)
    if schedule is not None:
        work = [q.new_empty(0, dtype=t.dtype) for t in work]
    return (torch.empty_like(q), q.new_empty(total, num_heads, dtype=torch.float32),
            q.new_empty(total, num_index_heads, slots, dtype=torch.int32, device=q.device),
            *work)


@torch.library.custom_op("openmsa::sparse_backward", mutates_args=())
def sparse_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, block_ids: torch.Tensor,
                    schedule: torch.Tensor, union: torch.Tensor, union_members: torch.Tensor,
                    union_count: torch.Tensor, cu_seqlens: torch.Tensor, block_size: int,
                    softmax_scale: float, query_start: int = 0, dense_batch: int = 0,
                    block_work: Optional[torch.Tensor] = None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pipeline.sparse_backward`` as an operator."""
    return pipeline.sparse_backward(dout, q, k, v, out, lse, block_ids, schedule, union,
                                    union_members, union_count, cu_seqlens, block_size,
                                    softmax_scale, query_start, dense_batch, block_work)


@sparse_backward.register_fake
def _(dout, q, k, v, out, lse, block_ids, schedule, union, union_members, union_count,
      cu_seqlens, block_size, softmax_scale, query_start=0, dense_batch=0, block_work=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _sparse_setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, _, _, block_size, softmax_scale, _, _, query_start, dense_batch = (
        inputs[:12])
    given_work, block_work = inputs[12:16], inputs[16]
    out, lse, ids, *work = output
    if given_work[0] is not None:
        work = given_work
    block_work = q.new_empty(0, dtype=torch.int32) if block_work is None else block_work
    ctx.save_for_backward(q, k, v, out, lse, ids, *work, cu_seqlens, block_work)
    ctx.options = (block_size, softmax_scale, query_start, dense_batch)


def _sparse_backward_with(backward):
    """The autograd formula of a sparse forward whose backward is ``backward``
    (``sparse_backward``'s arguments)."""

    def formula(ctx, dout, *_):
        q, k, v, out, lse, ids, *work, cu_seqlens, block_work = ctx.saved_tensors
        dq, dk, dv = backward(dout.contiguous(), q, k, v, out, lse, ids, *work, cu_seqlens,
                              *ctx.options, block_work)
        return (dq, dk, dv) + (None,) * 14

    return formula


sparse_forward.register_autograd(_sparse_backward_with(sparse_backward),
                                 setup_context=_sparse_setup_context)


@functools.lru_cache(maxsize=None)
def tuned_sparse_forward(tuning: Tuning):
    """``sparse_forward`` (same inputs and outputs) on another tuning's routes, through a plain
    autograd Function: the registered operators take the default tuning only."""
    formula = _sparse_backward_with(functools.partial(pipeline.sparse_backward, tuning=tuning))

    class TunedSparseForward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            output = _run_sparse_forward(*inputs, tuning=tuning)
            _sparse_setup_context(ctx, inputs, output)
            ctx.mark_non_differentiable(*output[1:])
            return output

        @staticmethod
        def backward(ctx, *grads):
            return formula(ctx, *grads)

    return TunedSparseForward.apply


def sparse_operator(*inputs: torch.Tensor, tuning: Tuning = DEFAULT_TUNING):
    """The forward operator ``sparse_attention`` runs: the registered ``sparse_forward`` for
    the default tuning, else ``tuned_sparse_forward`` (eager calls only, as
    ``msa_operator``'s tunings)."""
    if tuning == DEFAULT_TUNING or _needs_registered_operators(inputs, tuning):
        return sparse_forward
    return tuned_sparse_forward(tuning)
