"""Public entry points: ``msa_attention`` and its eager reference ``naive_msa_attention``."""

from __future__ import annotations

import torch

from .auto_tuning import AutoTuning, route
from .configs import Tuning
from .custom_ops import msa_operator, sparse_operator
from .dense import use_cudnn_dense
from .interpreter import INTERPRETING, check_interpreter
from .layout import (ids_from_token_major, ids_to_token_major,
                     packed_offsets, packed_tokens)
from .naive import naive_msa_forward, naive_select_blocks
from .select import select_blocks_fwd
from .validate import (check_backend, check_fp8_device, runs_reference, validate_block_indices,
                       validate_msa_args, validate_select_args, validate_sparse_args)


def _use_kernels(backend: str, device: torch.device, index_precision: str = "input") -> bool:
    """Whether ``backend`` runs the Triton kernels for tensors on ``device``."""
    if runs_reference(backend, device):
        return False
    check_fp8_device(index_precision, device)
    if device.type == "cpu" and not INTERPRETING:
        raise ValueError("backend: expected CUDA tensors for 'triton' (or CPU tensors with "
                         "TRITON_INTERPRET=1 set before importing openmsa), received CPU tensors")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"backend: expected CUDA tensors for 'triton', received {device.type}")
    if device.type == "cpu":
        check_interpreter()
    return True


# Head dims the attention kernels compile for on a GPU. At 256 the dQ tile alone needs more
# shared memory than an H200 has (benchmarks/inspect_kernels.py), so such inputs go to the
# reference backend by the caller's choice, not silently.
GPU_HEAD_DIMS = (64, 128)


def _check_gpu_head_dims(device: torch.device, **head_dims: int) -> None:
    if device.type != "cuda":
        return  # the CPU interpreter runs any supported head dim (tests)
    for name, dim in head_dims.items():
        if dim not in GPU_HEAD_DIMS:
            raise ValueError(f"{name}: expected head dim in {GPU_HEAD_DIMS} for the Triton "
                             f"kernels on a GPU, received {dim} (backend='reference' runs it)")


def _return(out, kl, block_ids, return_indices):
    return (out, kl, block_ids) if return_indices else (out, kl)


def msa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index_q: torch.Tensor,
                  index_k: torch.Tensor, *, top_k: int = 16, block_size: int = 128,
                  softmax_scale: float | None = None, index_softmax_scale: float | None = None,
                  num_local_blocks: int = 1, num_sink_blocks: int = 0, warmup: bool = False,
                  cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None,
                  deterministic: bool = False, return_indices: bool = False,
                  backend: str = "auto", block_indices: torch.Tensor | None = None,
                  kl_value: bool = True, query_start: int | None = None,
                  kl_num_queries: int | None = None, index_precision: str = "input",
                  local_block_dilation: int = 1,
                  tuning: Tuning | AutoTuning | str | None = None):
    """MiniMax Sparse Attention: returns ``(out, kl)`` (``(out, kl, indices)`` with
    ``return_indices=True``).

    Args:
        q: main queries ``[B, S, H, D]`` (packed: ``[T, H, D]``).
        k, v: main keys and values ``[B, S, Hkv, D]``.
        index_q: index-branch queries ``[B, S, Hi, Di]``; feed it a detached hidden state.
        index_k: index-branch keys ``[B, S, Hik, Di]``.
        top_k: blocks kept per query token and index head (forced blocks included), 1..64.
        block_size: key block size, 64 or 128.
        softmax_scale: main-branch scale, default ``D ** -0.5``.
        index_softmax_scale: index-branch scale, default ``Di ** -0.5``.
        num_local_blocks: the own block plus ``num_local_blocks - 1`` blocks before it are always
            kept (a sliding window of blocks).
        local_block_dilation: the spacing of those blocks: ``d`` keeps ``blk(i) - d,
            blk(i) - 2d, ...`` (default 1: contiguous), so a short window reaches further back.
        num_sink_blocks: the first ``num_sink_blocks`` blocks are always kept.
        warmup: dense causal main attention; the KL covers the whole causal prefix.
        cu_seqlens: int32 ``[N + 1]`` offsets of packed sequences (``flash_attn_varlen_func``).
        max_seqlen: optional upper bound on the packed sequences' lengths.
        deterministic: bitwise reproducible gradients. By default the KL's index gradients
            are sums of atomic adds, in any order (one pass over the kept pairs); with True
            they come from two ordered passes (~15% of a step at 32k-128k).
        return_indices: also return the kept block ids, int32 ``[B, Hi, S, top_k]`` (packed
            ``[Hi, T, top_k]``), relative to each sequence's start, unused slots ``-1``.
        backend: ``"auto"``, ``"triton"`` or ``"reference"`` (the eager reference, any device;
            also accepts float64).
        block_indices: optional kept block ids in the layout ``return_indices`` gives (any number
            of slots, ``-1`` unused, each block at most once per row, the query's own block
            always); used instead of the index branch's own selection.
        kl_value: compute the KL's value. With False, ``kl`` is a zero-valued carrier: its
            value is 0 and its gradient is exactly the KL's. The value rides on a pass the
            gradient needs anyway, so skipping it saves little (about 1% of a step).
        query_start: a query range, for context parallelism: q and index_q ``[Tq, heads, dim]``
            hold only the packed tokens ``[query_start, query_start + Tq)`` of the packing that
            k, v, index_k ``[T, heads, dim]`` and ``cu_seqlens`` describe (the range may start
            and end anywhere, inside sequences too); without ``cu_seqlens``, q ``[1, Sq, ...]``
            holds positions ``[query_start, query_start + Sq)`` of the one sequence of k
            ``[1, S, ...]``. ``out``, the indices and the gradients of q and index_q cover the
            range; those of k, v and index_k cover every key (zero where no query of the range
            reads it).
        kl_num_queries: the number of query tokens the KL is a mean over (default: those of
            q). With the global count, the KLs of disjoint query ranges add up to the KL of
            all queries, and so do their gradients.
        index_precision: the index scores selection ranks: ``"input"`` (in the inputs'
            precision) or ``"fp8"``: index_q and index_k quantized to float8 e4m3 with one
            scale per (token, head) row (SPEC section 8), scored on the fp8 tensor cores
            (compute capability 8.9 on). The KL and its gradients always use the
            input-precision scores; warmup, which selects nothing, ignores it.
        tuning: the kernels' routes and work-list sizes: None (the default), ``"incoherent"``
            (for selections whose neighbours keep different blocks, as a new index branch
            makes: faster there, slower on coherent ones; ``configs.INCOHERENT_TUNING``),
            ``"adaptive"`` (each query tile's route by its union: the long walks' rows
            key-outer, their dQ by the dK/dV pass's atomic adds; ``configs.ADAPTIVE_TUNING``)
            a ``configs.Tuning``, or an ``AutoTuning`` (the default or the adaptive tuning
            by the share of long walks its previous calls' selections measured, read without
            a synchronization; one per layer). Eager calls only: under torch.compile, export
            or a dispatch mode the registered operators run the default, and another tuning
            raises. The reference backend ignores it.

    Returns:
        ``out`` with q's shape and dtype; ``kl``, a float32 0-dim tensor holding the exact
        KL(teacher || index student) averaged over query tokens and index heads (clamped at 0:
        rounding can push a KL of agreeing distributions a hair below it; the gradient is the
        KL's own). ``out`` back-propagates to q, k, v only; ``kl`` to index_q, index_k only;
        inputs that require no gradient cost no backward kernel.

    Backends: ``"auto"`` uses the Triton kernels for CUDA tensors and the eager reference for CPU
    tensors; ``"triton"`` forces the kernels (CPU tensors need ``TRITON_INTERPRET=1``, for
    tests); ``"reference"`` forces the eager reference. Selection, sparse attention and the KL
    (value and gradient) are Triton kernels, run through the custom operators of
    ``openmsa.ops.custom_ops`` (so ``torch.compile`` traces them); warmup runs the KL kernel
    with every causal block kept, and its dense main attention on cuDNN (PyTorch's ATen
    operator, which returns the log-sum-exps the KL needs) for 16-bit CUDA batch input without
    ``deterministic=True``, else the same sparse kernels with every causal block kept. The main
    attention's gradients (q, k, v) are deterministic on the Triton kernels whatever
    ``deterministic`` says (every sum runs in a fixed order); the KL's value and index
    gradients, and warmup's cuDNN backward, need ``deterministic=True`` for that. On a GPU the
    kernels take head dims 64 and 128; 256 needs ``backend="reference"``.
    """
    problem = validate_msa_args(
        q, k, v, index_q, index_k, top_k=top_k, block_size=block_size,
        softmax_scale=softmax_scale, index_softmax_scale=index_softmax_scale,
        num_local_blocks=num_local_blocks, num_sink_blocks=num_sink_blocks, warmup=warmup,
        cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, deterministic=deterministic,
        return_indices=return_indices, backend=backend, query_start=query_start,
        kl_num_queries=kl_num_queries, kl_value=kl_value, index_precision=index_precision,
        local_block_dilation=local_block_dilation)
    auto, tuning = route(tuning, (q, k, v, index_q, index_k))
    if block_indices is not None:
        validate_block_indices(block_indices, problem, cu_seqlens, q.device)
    if not _use_kernels(backend, q.device, index_precision):
        out, kl, block_ids = naive_msa_forward(q, k, v, index_q, index_k, problem, cu_seqlens,
                                               block_indices)
        return _return(out, kl if kl_value else kl - kl.detach(), block_ids, return_indices)
    return msa_kernels(msa_operator(q, k, v, index_q, index_k, tuning=tuning), q, k, v,
                       index_q, index_k, problem, cu_seqlens, max_seqlen, block_indices,
                       kl_value, deterministic, return_indices, tuning, auto)


def msa_kernels(operator, q, k, v, index_q, index_k, problem, cu_seqlens, max_seqlen,
                block_indices, kl_value: bool, deterministic: bool, return_indices: bool,
                tuning: Tuning, auto: AutoTuning | None = None):
    """``msa_attention`` on validated inputs, on the kernels of ``operator``
    (``custom_ops.msa_operator``'s choice, or a ``custom_ops.tuned_msa_forward`` for
    tests) running ``tuning``; ``auto``: the AutoTuning that measures the call's query
    tiles for the next call's route."""
    _check_gpu_head_dims(q.device, q=problem.head_dim, index_q=problem.index_head_dim)
    cu = packed_offsets(cu_seqlens, problem.batch, problem.num_keys, q.device)
    ids = None if block_indices is None else ids_to_token_major(block_indices, problem.packed)
    longest = max_seqlen or problem.num_keys
    # The forward computes the KL's gradients (they do not depend on dout) when they are needed.
    index_grad = torch.is_grad_enabled() and (index_q.requires_grad or index_k.requires_grad)
    warmup = problem.warmup
    dense_batch = problem.batch if warmup and use_cudnn_dense(q, problem, deterministic) else 0
    out, kl, _, _, token_major_ids, _, _, block_work, *query_work = operator(
        packed_tokens(q), packed_tokens(k), packed_tokens(v), packed_tokens(index_q),
        packed_tokens(index_k), cu, ids, problem.top_k, problem.block_size,
        problem.softmax_scale, problem.index_softmax_scale, problem.num_local_blocks,
        problem.num_sink_blocks, warmup, longest, kl_value, index_grad, problem.query_start,
        problem.kl_num_queries, dense_batch, deterministic, problem.index_precision,
        problem.local_block_dilation)
    if auto is not None and not warmup:
        schedule, _, _, union_count = query_work
        auto.observe(schedule, union_count, problem.top_k)
    # The operator's ids are its own tensor (int32, also when the caller gave int64 ids).
    block_ids = None if warmup else ids_from_token_major(token_major_ids, problem.packed,
                                                         problem.batch, problem.seqlen)
    if return_indices and block_ids is not None and not torch.compiler.is_compiling():
        HandedOnSelection.attach(block_ids, token_major_ids, query_work, block_work, q, k,
                                 cu_seqlens, problem, tuning)
    return _return(out.view(q.shape), kl, block_ids, return_indices)


class HandedOnSelection:
    """What a forward that selected knows about the ids it returned: their token-major tensor
    and the work lists it built over them (query tiles; the key-block list when its KL built
    one). Attached to those ids, so that a layer sharing them (``sparse_attention`` on the same
    problem, SPEC section 9) neither builds the lists again nor checks the ids' values, which
    costs a sort and host synchronizations. It holds while the ids are unchanged (their version
    counter) and the sharing call's problem is the selecting one's; any other ids are checked
    and their lists built as before."""

    ATTRIBUTE = "_openmsa_selection"

    def __init__(self, version, key, cu_seqlens, token_major_ids, query_work, block_work):
        self.version, self.key = version, key
        # Held, not named by id: a freed tensor's id can come back on another packing.
        self.cu_seqlens = cu_seqlens
        self.cu_version = None if cu_seqlens is None else cu_seqlens._version
        self.token_major_ids, self.query_work, self.block_work = (token_major_ids, query_work,
                                                                  block_work)

    @staticmethod
    def _key(q, k, num_heads, block_size, query_start, tuning):
        # The lists depend on the packing (cu_seqlens, compared apart), the query range, the
        # tile shape (heads per index head), the block size and the tuning (segment sizes).
        return (tuple(q.shape[:-2]), tuple(k.shape[:-2]), num_heads, block_size, query_start,
                tuning)

    @classmethod
    def attach(cls, block_ids, token_major_ids, query_work, block_work, q, k, cu_seqlens,
               problem, tuning):
        key = cls._key(q, k, problem.num_heads, problem.block_size, problem.query_start,
                       tuning)
        setattr(block_ids, cls.ATTRIBUTE, cls(block_ids._version, key, cu_seqlens,
                                              token_major_ids, query_work, block_work))

    @classmethod
    def tuning_of(cls, block_ids) -> Tuning | None:
        """The tuning of the call that selected ``block_ids`` (None: none attached)."""
        selection = getattr(block_ids, cls.ATTRIBUTE, None)
        return None if selection is None else selection.key[-1]

    @classmethod
    def of(cls, block_ids, q, k, cu_seqlens, num_heads, block_size, query_start, tuning):
        """The handed-on selection of ``block_ids`` if it still holds for this problem."""
        if torch.compiler.is_compiling():
            return None
        selection = getattr(block_ids, cls.ATTRIBUTE, None)
        if (selection is None or selection.version != block_ids._version
                or selection.cu_seqlens is not cu_seqlens
                or (cu_seqlens is not None and cu_seqlens._version != selection.cu_version)
                or selection.key != cls._key(q, k, num_heads, block_size, query_start,
                                             tuning)):
            return None
        return selection


def select_blocks(index_q: torch.Tensor, index_k: torch.Tensor, *, top_k: int = 16,
                  block_size: int = 128, index_softmax_scale: float | None = None,
                  num_local_blocks: int = 1, num_sink_blocks: int = 0,
                  cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None,
                  backend: str = "auto", index_precision: str = "input",
                  local_block_dilation: int = 1) -> torch.Tensor:
    """The index branch's block selection alone (SPEC section 3, steps 1-4).

    Args are those of ``msa_attention``. Returns the kept block ids, int32 ``[B, Hi, S, top_k]``
    (packed: ``[Hi, T, top_k]``), relative to each sequence's start, unused slots ``-1``, in no
    particular order. Feed them to ``msa_attention(..., block_indices=ids)``. The Triton kernel
    never writes block scores to memory; its only output is these ids.
    """
    scale = validate_select_args(
        index_q, index_k, top_k=top_k, block_size=block_size,
        index_softmax_scale=index_softmax_scale, num_local_blocks=num_local_blocks,
        num_sink_blocks=num_sink_blocks, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
        backend=backend, index_precision=index_precision,
        local_block_dilation=local_block_dilation)
    options = dict(top_k=top_k, block_size=block_size, index_softmax_scale=scale,
                   num_local_blocks=num_local_blocks, num_sink_blocks=num_sink_blocks,
                   index_precision=index_precision, local_block_dilation=local_block_dilation)
    if not _use_kernels(backend, index_q.device, index_precision):
        return naive_select_blocks(index_q, index_k, cu_seqlens, **options)
    packed = cu_seqlens is not None
    batch, seqlen = (1, index_q.shape[-3]) if packed else index_q.shape[:2]
    ids = select_blocks_fwd(packed_tokens(index_q), packed_tokens(index_k),
                            packed_offsets(cu_seqlens, batch, seqlen, index_q.device), **options)
    return ids_from_token_major(ids, packed, batch, seqlen)


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     block_indices: torch.Tensor | None = None, *, block_size: int = 128,
                     softmax_scale: float | None = None, cu_seqlens: torch.Tensor | None = None,
                     max_seqlen: int | None = None, backend: str = "auto", warmup: bool = False,
                     num_index_heads: int | None = None, deterministic: bool = False,
                     query_start: int | None = None,
                     tuning: Tuning | AutoTuning | str | None = None) -> torch.Tensor:
    """The main attention alone, over given kept blocks (SPEC section 3, steps 5-6): what a
    layer that shares another layer's selection runs (SPEC section 9).

    ``block_indices``: kept block ids ``[B, Hi, S, k]`` (packed ``[Hi, T, k]``) as
    ``select_blocks`` and ``msa_attention(..., return_indices=True)`` return them; ``Hi`` index
    heads, each shared by ``H / Hi`` main heads. Every row must hold its query's own block.
    ``warmup=True`` (no ``block_indices``): dense causal attention, every causal block kept
    (as ``msa_attention``'s warmup: cuDNN for 16-bit CUDA batch input, else the kernels over
    every causal block, their tiles shaped by ``num_index_heads``, default Hkv). Returns ``out``
    (q's shape and dtype), which back-propagates to q, k and v. The Triton backward is
    deterministic by construction; ``deterministic=True`` keeps warmup off cuDNN, whose backward
    is not. ``query_start``: a query range, as ``msa_attention``'s (context parallelism). The
    kernels run as the custom operators ``openmsa::sparse_forward`` / ``sparse_backward``, so
    ``torch.compile`` traces them. ``tuning``: the kernels' routes, as ``msa_attention``'s
    (another than the default runs eagerly, outside the operators, and raises under a tracer
    or mode; an ``AutoTuning`` runs the route of the call that selected handed-on ids, else its
    latest reading, and measures nothing). Ids that ``msa_attention(..., return_indices=True)``
    returned on the kernels, unchanged since and used on the same problem, come with the work
    lists that forward built: they are reused and the ids' values not checked again
    (``HandedOnSelection``); other ids are checked, which synchronizes the host (skipped under
    CUDA-graph capture and torch.compile).
    """
    auto, tuning = route(tuning, (q, k, v))
    handed_on = None
    if isinstance(block_indices, torch.Tensor) and not warmup:
        if auto is not None:
            tuning = HandedOnSelection.tuning_of(block_indices) or tuning
        handed_on = HandedOnSelection.of(block_indices, q, k, cu_seqlens, q.shape[-2],
                                         block_size, query_start or 0, tuning)
    problem = validate_sparse_args(q, k, v, block_indices, block_size=block_size,
                                   softmax_scale=softmax_scale, cu_seqlens=cu_seqlens,
                                   max_seqlen=max_seqlen, backend=backend, warmup=warmup,
                                   num_index_heads=num_index_heads, deterministic=deterministic,
                                   query_start=query_start,
                                   check_index_values=handed_on is None)
    if not _use_kernels(backend, q.device):
        return naive_msa_forward(q, k, v, None, None, problem, cu_seqlens, block_indices)[0]
    _check_gpu_head_dims(q.device, q=problem.head_dim)
    cu = packed_offsets(cu_seqlens, problem.batch, problem.num_keys, q.device)
    lists = (None,) * 5  # schedule, union, union_members, union_count, block_work
    if handed_on is not None:
        ids = handed_on.token_major_ids
        lists = (*handed_on.query_work, handed_on.block_work)
    else:
        ids = None if warmup else ids_to_token_major(block_indices, problem.packed)
    dense_batch = problem.batch if warmup and use_cudnn_dense(q, problem, deterministic) else 0
    tokens = [packed_tokens(t) for t in (q, k, v)]
    out, *_ = sparse_operator(*tokens, tuning=tuning)(
        *tokens, cu, ids, problem.num_index_heads, block_size, problem.softmax_scale, warmup,
        max_seqlen or problem.num_keys, problem.query_start, dense_batch, *lists)
    return out.view(q.shape)


def naive_msa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index_q: torch.Tensor,
                        index_k: torch.Tensor, *, top_k: int = 16, block_size: int = 128,
                        softmax_scale: float | None = None,
                        index_softmax_scale: float | None = None, num_local_blocks: int = 1,
                        num_sink_blocks: int = 0, warmup: bool = False,
                        cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None,
                        deterministic: bool = False, return_indices: bool = False,
                        backend: str = "reference", block_indices: torch.Tensor | None = None,
                        kl_value: bool = True, query_start: int | None = None,
                        kl_num_queries: int | None = None, index_precision: str = "input",
                        local_block_dilation: int = 1, tuning: Tuning | str | None = None):
    """The eager PyTorch reference of ``msa_attention`` (same signature and results).

    Plain autograd over chunked, checkpointed queries: exact, slow, and the test oracle. It
    accepts every backend name and tuning for signature compatibility and always runs the
    reference; float64 inputs are accepted.
    """
    check_backend(backend)
    route(tuning)  # validated, as msa_attention does
    problem = validate_msa_args(
        q, k, v, index_q, index_k, top_k=top_k, block_size=block_size,
        softmax_scale=softmax_scale, index_softmax_scale=index_softmax_scale,
        num_local_blocks=num_local_blocks, num_sink_blocks=num_sink_blocks, warmup=warmup,
        cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, deterministic=deterministic,
        return_indices=return_indices, backend="reference", query_start=query_start,
        kl_num_queries=kl_num_queries, kl_value=kl_value, index_precision=index_precision,
        local_block_dilation=local_block_dilation)
    if block_indices is not None:
        validate_block_indices(block_indices, problem, cu_seqlens, q.device)
    out, kl, block_ids = naive_msa_forward(q, k, v, index_q, index_k, problem, cu_seqlens,
                                           block_indices)
    return _return(out, kl if kl_value else kl - kl.detach(), block_ids, return_indices)
