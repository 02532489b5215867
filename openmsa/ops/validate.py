"""Argument checking shared by every backend.

Every check runs before any computation and raises ``TypeError`` (wrong type) or ``ValueError``
(wrong value) with a message that names the argument, what was expected and what was received.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from .quantize import INDEX_PRECISIONS

SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_BLOCK_SIZES = (64, 128)
MAX_TOP_K = 64
BACKENDS = ("auto", "triton", "reference")
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# float64 is accepted wherever the eager reference runs (backend="reference", or "auto" on
# CPU tensors): a high-precision oracle, and what torch.autograd.gradcheck needs.
REFERENCE_DTYPES = KERNEL_DTYPES + (torch.float64,)


@dataclass(frozen=True)
class MSAProblem:
    """Validated, resolved description of one ``msa_attention`` call."""

    packed: bool  # inputs are [T, heads, dim] with cu_seqlens
    batch: int  # B (1 when packed)
    seqlen: int  # query tokens per batch row: S (T when packed)
    num_heads: int  # H
    num_kv_heads: int  # Hkv
    num_index_heads: int  # Hi
    num_index_kv_heads: int  # Hik
    head_dim: int  # D
    index_head_dim: int  # Di
    top_k: int
    block_size: int
    softmax_scale: float
    index_softmax_scale: float
    num_local_blocks: int
    num_sink_blocks: int
    warmup: bool
    query_start: int  # q and index_q hold the tokens of k from query_start on (0: all)
    num_keys: int  # tokens of k per batch row (S, or T packed)
    kl_num_queries: int  # the KL's mean divides by this many query tokens
    index_precision: str = "input"  # selection's index scores: "input" or "fp8" (SPEC 8)
    local_block_dilation: int = 1  # blocks between the forced local blocks (SPEC 3 step 3)


def _fail(name: str, expected: str, received) -> ValueError:
    return ValueError(f"{name}: expected {expected}, received {received}")


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, received {type(value).__name__}")


def _check_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, received {type(value).__name__}")


def _resolve_scale(name: str, value, head_dim: int) -> float:
    if value is None:
        return head_dim**-0.5
    # Any real scalar: Python and numpy ints and floats alike.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a real number or None, received "
                        f"{type(value).__name__}")
    try:
        value_as_float = float(value)
    except OverflowError:
        value_as_float = math.inf
    if not math.isfinite(value_as_float):
        raise _fail(name, "a finite number", value)
    return value_as_float


def runs_reference(backend: str, device: torch.device) -> bool:
    """Whether ``backend`` runs the eager reference for tensors on ``device``."""
    return backend == "reference" or (backend == "auto" and device.type != "cuda")


def check_backend(backend) -> None:
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a str, received {type(backend).__name__}")
    if backend not in BACKENDS:
        raise _fail("backend", f"one of {BACKENDS}", repr(backend))


def validate_cu_seqlens(cu_seqlens, total_tokens: int, device: torch.device, max_seqlen) -> None:
    """Checks ``cu_seqlens`` (and ``max_seqlen``) against the packed token count ``total_tokens``.

    Reading the values needs one device-to-host copy; it is skipped while a CUDA graph is being
    captured (capture forbids the copy), where the caller vouches for well-formed offsets.
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens: expected a torch.Tensor, received {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise _fail("cu_seqlens", "dtype torch.int32", cu_seqlens.dtype)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise _fail("cu_seqlens", "a 1-D tensor [num_sequences + 1] with at least 2 entries",
                    f"shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != device:
        raise _fail("cu_seqlens", f"device {device} (the device of q)", cu_seqlens.device)
    if max_seqlen is not None:
        _check_int("max_seqlen", max_seqlen)
        if max_seqlen < 1:
            raise _fail("max_seqlen", "an int >= 1", max_seqlen)
    if cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0:
        raise _fail("cu_seqlens", "first entry 0", offsets[0])
    lengths = [b - a for a, b in zip(offsets[:-1], offsets[1:])]
    if any(length < 0 for length in lengths):
        raise _fail("cu_seqlens", "non-decreasing offsets", offsets)
    if offsets[-1] != total_tokens:
        raise _fail("cu_seqlens", f"last entry equal to the packed token count T={total_tokens}",
                    offsets[-1])
    if max_seqlen is not None and max_seqlen < max(lengths):
        raise _fail("max_seqlen", f">= the longest sequence in cu_seqlens ({max(lengths)})",
                    max_seqlen)


def validate_block_indices(block_indices, problem: MSAProblem, cu_seqlens,
                           device: torch.device, check_values: bool = True) -> None:
    """Checks externally given kept-block ids: int32/int64 ``[B, Hi, S, k]`` (packed ``[Hi, T, k]``)
    whose rows hold the query's own block and otherwise only earlier blocks or -1.
    ``check_values=False``: the layout alone (ids a selection of this library made, unchanged
    since)."""
    if not isinstance(block_indices, torch.Tensor):
        raise TypeError(
            f"block_indices: expected a torch.Tensor, received {type(block_indices).__name__}")
    if block_indices.dtype not in (torch.int32, torch.int64):
        raise _fail("block_indices", "dtype torch.int32 or torch.int64", block_indices.dtype)
    if problem.packed:
        leading = (problem.num_index_heads, problem.seqlen)
        layout = "[Hi, T, top_k]"
    else:
        leading = (problem.batch, problem.num_index_heads, problem.seqlen)
        layout = "[B, Hi, S, top_k]"
    if block_indices.dim() != len(leading) + 1 or tuple(block_indices.shape[:-1]) != leading:
        raise _fail("block_indices", f"shape {layout} = {leading + ('k',)}",
                    tuple(block_indices.shape))
    if block_indices.shape[-1] < 1:
        raise _fail("block_indices", "at least one slot in the last dimension",
                    tuple(block_indices.shape))
    if block_indices.device != device:
        raise _fail("block_indices", f"device {device} (the device of q)", block_indices.device)
    if problem.warmup:
        raise _fail("block_indices", "None when warmup=True (warmup keeps every causal block)",
                    "a tensor")
    # Reading the values would sync the host: not while a CUDA graph is captured, and not under
    # torch.compile (data-dependent); the shapes above are checked there too.
    if not check_values or torch.compiler.is_compiling() or (block_indices.is_cuda
                                         and torch.cuda.is_current_stream_capturing()):
        return
    query_block = query_positions(problem, cu_seqlens, device) // problem.block_size
    if problem.packed:
        query_block = query_block[None, :, None]  # against [Hi, T, k]
    else:
        query_block = query_block[None, None, :, None]  # against [B, Hi, S, k]
    if bool((block_indices < -1).any()) or bool((block_indices > query_block).any()):
        raise _fail("block_indices", "entries in [-1, own block of the query] (-1 = unused; "
                    "ids count blocks from the start of the query's sequence)",
                    "an entry outside that range")
    if not bool((block_indices == query_block).any(dim=-1).all()):
        raise _fail("block_indices", "the query's own block in every row (it is always kept)",
                    "a row without it")
    # The work lists count a (query, block) pair once per entry: a repeat would count it twice.
    ordered = block_indices.sort(dim=-1).values
    if bool(((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any()):
        raise _fail("block_indices", "each block at most once in a row (-1 may repeat)",
                    "a row holding a block twice")


def query_positions(problem: MSAProblem, cu_seqlens, device) -> torch.Tensor:
    """Position of every query inside its own sequence: int64 [S] (packed: [T])."""
    if not problem.packed:
        return torch.arange(problem.query_start, problem.query_start + problem.seqlen,
                            device=device)
    positions = query_positions_from_offsets(cu_seqlens, problem.num_keys)
    return positions[problem.query_start:problem.query_start + problem.seqlen]


def query_positions_from_offsets(cu_seqlens: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """Position of every packed token inside its own sequence: int64 [T]."""
    starts = cu_seqlens[:-1].long()
    lengths = cu_seqlens[1:].long() - starts
    positions = torch.arange(total_tokens, device=cu_seqlens.device)
    return positions - torch.repeat_interleave(starts, lengths, output_size=total_tokens)


def _check_tensors(tensors: dict, backend: str, cu_seqlens, max_seqlen,
                   key_names: tuple[str, ...] = ()) -> None:
    """Types, dtypes, devices, ranks and leading dims of the named tensors (the first is the
    one the others must match). ``key_names`` (with a query range): tensors that hold every
    token of the packing, whose leading dims match the first of them and whose token count
    ``cu_seqlens`` describes."""
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, received {type(tensor).__name__}")
    first_name, first = next(iter(tensors.items()))
    if runs_reference(backend, first.device):
        allowed, where = REFERENCE_DTYPES, f"backend={backend!r}"
    else:
        allowed = KERNEL_DTYPES
        where = (f"backend={backend!r} on {first.device.type} tensors (the Triton kernels; "
                 "float64 runs on backend='reference')")
    if first.dtype not in allowed:
        raise _fail(first_name, f"dtype in {allowed} for {where}", first.dtype)
    for name, tensor in tensors.items():
        if tensor.dtype != first.dtype:
            raise _fail(name, f"dtype {first.dtype} (the dtype of {first_name})", tensor.dtype)
        if tensor.device != first.device:
            raise _fail(name, f"device {first.device} (the device of {first_name})",
                        tensor.device)

    shape = tuple(first.shape)
    if cu_seqlens is not None:
        if first.dim() == 4:
            if first.shape[0] != 1:
                raise _fail(first_name, "batch dimension 1 (or a 3-D [T, heads, dim] tensor) "
                            "with cu_seqlens", f"shape {shape}")
        elif first.dim() != 3:
            raise _fail(first_name, "a 3-D [T, heads, dim] tensor with cu_seqlens",
                        f"shape {shape}")
    elif first.dim() != 4:
        raise _fail(first_name, "a 4-D [B, S, heads, dim] tensor (or 3-D [T, heads, dim] with "
                    "cu_seqlens)", f"shape {shape}")
    rank = first.dim()
    layout = "[B, S, heads, dim]" if rank == 4 else "[T, heads, dim]"
    for name, tensor in tensors.items():
        if tensor.dim() != rank:
            raise _fail(name, f"a {rank}-D {layout} tensor like {first_name}",
                        f"shape {tuple(tensor.shape)}")
        like = key_names[0] if name in key_names else first_name
        if tensor.shape[:-2] != tensors[like].shape[:-2]:
            raise _fail(name, f"leading dimensions {tuple(tensors[like].shape[:-2])} (those of "
                        f"{like})", tuple(tensor.shape[:-2]))
    if max_seqlen is not None and cu_seqlens is None:
        raise _fail("max_seqlen", "None unless cu_seqlens is given", max_seqlen)
    if first.shape[-3] == 0 or (rank == 4 and first.shape[0] == 0):
        raise _fail(first_name, "at least one query token", f"shape {shape}")
    if cu_seqlens is not None:
        keys = tensors[key_names[0]] if key_names else first
        validate_cu_seqlens(cu_seqlens, keys.shape[-3], first.device, max_seqlen)


def _check_query_range_shapes(q, k, query_start) -> None:
    """With a query range: one packing (or sequence) of keys, a range of it as queries."""
    if query_start is None:
        return
    num_queries, num_keys = q.shape[-3], k.shape[-3]
    if q.dim() == 4 and (q.shape[0], k.shape[0]) != (1, 1):
        raise _fail("query_start", "a batch of one with a query range (or packed input)",
                    f"batches of {q.shape[0]} (q) and {k.shape[0]} (k)")
    if query_start + num_queries > num_keys:
        raise _fail("query_start", f"at most {num_keys - num_queries} (the {num_queries} "
                    f"query tokens of q must lie within the {num_keys} tokens of k)",
                    query_start)


def _check_query_range(query_start, kl_num_queries) -> None:
    """The types and signs of the query-range options (their bounds need the shapes)."""
    if query_start is not None:
        _check_int("query_start", query_start)
        if query_start < 0:
            raise _fail("query_start", "an int >= 0", query_start)
    if kl_num_queries is not None:
        _check_int("kl_num_queries", kl_num_queries)


def _check_index_heads(index_q, index_k) -> None:
    if index_k.shape[-1] != index_q.shape[-1]:
        raise _fail("index_k", f"head dim {index_q.shape[-1]} (the head dim of index_q)",
                    index_k.shape[-1])
    if index_q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        raise _fail("index_q", f"head dim in {SUPPORTED_HEAD_DIMS}", index_q.shape[-1])
    for name, heads in (("index_q", index_q.shape[-2]), ("index_k", index_k.shape[-2])):
        if heads < 1:
            raise _fail(name, "at least one head", heads)
    if index_q.shape[-2] % index_k.shape[-2]:
        raise _fail("index_k", f"a number of heads dividing the {index_q.shape[-2]} heads of "
                    "index_q", index_k.shape[-2])


def check_local_block_dilation(local_block_dilation) -> None:
    _check_int("local_block_dilation", local_block_dilation)
    if local_block_dilation < 1:
        raise _fail("local_block_dilation", "an int >= 1 (1: contiguous local blocks)",
                    local_block_dilation)


def check_index_precision(index_precision) -> None:
    if not isinstance(index_precision, str):
        raise TypeError("index_precision: expected a str, received "
                        f"{type(index_precision).__name__}")
    if index_precision not in INDEX_PRECISIONS:
        raise _fail("index_precision", f"one of {INDEX_PRECISIONS}", repr(index_precision))


def check_fp8_device(index_precision: str, device: torch.device) -> None:
    """fp8 index scores on the kernels need fp8 tensor cores (compute capability 8.9 on)."""
    if index_precision != "fp8" or device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise _fail("index_precision", "'input' on this GPU: 'fp8' needs compute capability "
                    "8.9 or later for the Triton kernels (backend='reference' runs it anywhere)",
                    f"'fp8' on a GPU of capability {capability[0]}.{capability[1]}")


def _check_selection_options(top_k, block_size, num_local_blocks, num_sink_blocks,
                             local_block_dilation=1) -> None:
    _check_int("block_size", block_size)
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise _fail("block_size", f"one of {SUPPORTED_BLOCK_SIZES}", block_size)
    _check_int("top_k", top_k)
    if not 1 <= top_k <= MAX_TOP_K:
        raise _fail("top_k", f"an int in [1, {MAX_TOP_K}]", top_k)
    _check_int("num_local_blocks", num_local_blocks)
    if num_local_blocks < 1:
        raise _fail("num_local_blocks", "an int >= 1 (the query's own block is always kept)",
                    num_local_blocks)
    check_local_block_dilation(local_block_dilation)
    _check_int("num_sink_blocks", num_sink_blocks)
    if num_sink_blocks < 0:
        raise _fail("num_sink_blocks", "an int >= 0", num_sink_blocks)
    if num_local_blocks + num_sink_blocks > top_k:
        raise _fail("num_local_blocks + num_sink_blocks", f"<= top_k={top_k}",
                    num_local_blocks + num_sink_blocks)


def validate_select_args(index_q, index_k, *, top_k, block_size, index_softmax_scale,
                         num_local_blocks, num_sink_blocks, cu_seqlens, max_seqlen,
                         backend, index_precision="input", local_block_dilation=1) -> float:
    """Validates the arguments of ``select_blocks``; returns the resolved index scale."""
    check_backend(backend)
    check_index_precision(index_precision)
    _check_tensors({"index_q": index_q, "index_k": index_k}, backend, cu_seqlens, max_seqlen)
    _check_index_heads(index_q, index_k)
    _check_selection_options(top_k, block_size, num_local_blocks, num_sink_blocks,
                             local_block_dilation)
    return _resolve_scale("index_softmax_scale", index_softmax_scale, index_q.shape[-1])


def validate_msa_args(q, k, v, index_q, index_k, *, top_k, block_size, softmax_scale,
                      index_softmax_scale, num_local_blocks, num_sink_blocks, warmup, cu_seqlens,
                      max_seqlen, deterministic, return_indices, backend, query_start=None,
                      kl_num_queries=None, kl_value=True,
                      index_precision="input", local_block_dilation=1) -> MSAProblem:
    """Validates the arguments of ``msa_attention`` (SPEC sections 2, 5, 6 and 7)."""
    tensors = {"q": q, "k": k, "v": v, "index_q": index_q, "index_k": index_k}
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, received {type(tensor).__name__}")
    check_backend(backend)
    for name, flag in (("warmup", warmup), ("deterministic", deterministic),
                       ("return_indices", return_indices), ("kl_value", kl_value)):
        _check_bool(name, flag)
    check_index_precision(index_precision)
    _check_query_range(query_start, kl_num_queries)
    key_names = ("k", "v", "index_k") if query_start is not None else ()
    _check_tensors(tensors, backend, cu_seqlens, max_seqlen, key_names)
    num_queries, num_keys = q.shape[-3], k.shape[-3]
    _check_query_range_shapes(q, k, query_start)
    batch = 1 if cu_seqlens is not None else q.shape[0]
    if kl_num_queries is not None and kl_num_queries < batch * num_queries:
        raise _fail("kl_num_queries", f"an int >= {batch * num_queries} (the query tokens of q)",
                    kl_num_queries)

    # Each tensor is checked against those before it (q, then k, then v), so that the message
    # names the tensor that breaks the rule.
    num_heads, head_dim = q.shape[-2], q.shape[-1]
    num_kv_heads = k.shape[-2]
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise _fail("q", f"head dim in {SUPPORTED_HEAD_DIMS}", head_dim)
    if k.shape[-1] != head_dim:
        raise _fail("k", f"head dim {head_dim} (the head dim of q)", k.shape[-1])
    for name, heads in (("q", num_heads), ("k", num_kv_heads)):
        if heads < 1:
            raise _fail(name, "at least one head", heads)
    if num_heads % num_kv_heads:
        raise _fail("k", f"a number of heads dividing the {num_heads} heads of q", num_kv_heads)
    if tuple(v.shape) != tuple(k.shape):
        raise _fail("v", f"shape {tuple(k.shape)} (the shape of k)", tuple(v.shape))
    _check_index_heads(index_q, index_k)
    num_index_heads = index_q.shape[-2]
    if num_heads % num_index_heads:
        raise _fail("index_q", f"a number of heads dividing the {num_heads} heads of q",
                    num_index_heads)
    if num_index_heads % num_kv_heads:
        raise _fail("index_q", f"a multiple of the {num_kv_heads} heads of k (all main heads of "
                    "one index head must share one KV head)", num_index_heads)
    _check_selection_options(top_k, block_size, num_local_blocks, num_sink_blocks,
                             local_block_dilation)
    scale = _resolve_scale("softmax_scale", softmax_scale, head_dim)
    index_scale = _resolve_scale("index_softmax_scale", index_softmax_scale, index_q.shape[-1])
    if warmup and return_indices:
        raise _fail("return_indices", "False when warmup=True (warmup selects no blocks)", True)

    return MSAProblem(
        packed=cu_seqlens is not None,
        batch=batch,
        seqlen=num_queries,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        num_index_heads=num_index_heads,
        num_index_kv_heads=index_k.shape[-2],
        head_dim=head_dim,
        index_head_dim=index_q.shape[-1],
        top_k=top_k,
        block_size=block_size,
        softmax_scale=scale,
        index_softmax_scale=index_scale,
        num_local_blocks=num_local_blocks,
        num_sink_blocks=num_sink_blocks,
        warmup=warmup,
        query_start=query_start or 0,
        num_keys=num_keys,
        kl_num_queries=kl_num_queries or batch * num_queries,
        index_precision=index_precision,
        local_block_dilation=local_block_dilation,
    )


def validate_sparse_args(q, k, v, block_indices, *, block_size, softmax_scale, cu_seqlens,
                         max_seqlen, backend, warmup=False, num_index_heads=None,
                         deterministic=False, query_start=None,
                         check_index_values=True) -> MSAProblem:
    """Validates the arguments of ``sparse_attention``; the index heads ``Hi`` and the slots per
    row are those of ``block_indices`` (``[B, Hi, S, k]`` or packed ``[Hi, T, k]``), or in
    warmup (no ``block_indices``) ``num_index_heads`` (default Hkv) and every causal block.
    With ``query_start``, q holds the tokens of k from there on, as in ``msa_attention``.
    ``check_index_values=False``: the ids' layout alone (a selection this library made)."""
    check_backend(backend)
    _check_bool("warmup", warmup)
    _check_bool("deterministic", deterministic)
    _check_query_range(query_start, None)
    key_names = ("k", "v") if query_start is not None else ()
    _check_tensors({"q": q, "k": k, "v": v}, backend, cu_seqlens, max_seqlen, key_names)
    num_queries, num_keys = q.shape[-3], k.shape[-3]
    _check_query_range_shapes(q, k, query_start)
    head_dim, num_heads, num_kv_heads = q.shape[-1], q.shape[-2], k.shape[-2]
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise _fail("q", f"head dim in {SUPPORTED_HEAD_DIMS}", head_dim)
    if k.shape[-1] != head_dim:
        raise _fail("k", f"head dim {head_dim} (the head dim of q)", k.shape[-1])
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise _fail("k", f"a number of heads dividing the {num_heads} heads of q", num_kv_heads)
    if tuple(v.shape) != tuple(k.shape):
        raise _fail("v", f"shape {tuple(k.shape)} (the shape of k)", tuple(v.shape))
    packed = cu_seqlens is not None
    if warmup:
        if block_indices is not None:
            raise _fail("block_indices", "None with warmup=True (warmup keeps every causal "
                        "block)", f"a {type(block_indices).__name__}")
        if num_index_heads is None:
            num_index_heads = num_kv_heads
        _check_int("num_index_heads", num_index_heads)
        name, slots = "num_index_heads", 1
    else:
        if num_index_heads is not None:
            raise _fail("num_index_heads", "None with block_indices (their dim -3 gives it)",
                        num_index_heads)
        if not isinstance(block_indices, torch.Tensor):
            raise TypeError(f"block_indices: expected a torch.Tensor, received "
                            f"{type(block_indices).__name__}")
        if block_indices.dim() != (3 if packed else 4):
            raise _fail("block_indices",
                        "a [Hi, T, k] tensor" if packed else "a [B, Hi, S, k] tensor",
                        f"shape {tuple(block_indices.shape)}")
        num_index_heads = block_indices.shape[-3]
        name, slots = "block_indices", max(1, block_indices.shape[-1])
    if num_index_heads < 1 or num_heads % num_index_heads or num_index_heads % num_kv_heads:
        raise _fail(name, f"a number of index heads dividing the {num_heads} heads of q and a "
                    f"multiple of the {num_kv_heads} heads of k", num_index_heads)
    _check_int("block_size", block_size)
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise _fail("block_size", f"one of {SUPPORTED_BLOCK_SIZES}", block_size)
    batch = 1 if packed else q.shape[0]
    problem = MSAProblem(
        packed=packed, batch=batch, seqlen=num_queries,
        num_heads=num_heads, num_kv_heads=num_kv_heads, num_index_heads=num_index_heads,
        num_index_kv_heads=1, head_dim=head_dim, index_head_dim=head_dim,
        top_k=slots, block_size=block_size,
        softmax_scale=_resolve_scale("softmax_scale", softmax_scale, head_dim),
        index_softmax_scale=1.0, num_local_blocks=1, num_sink_blocks=0, warmup=warmup,
        query_start=query_start or 0, num_keys=num_keys, kl_num_queries=batch * num_queries)
    if not warmup:
        validate_block_indices(block_indices, problem, cu_seqlens, q.device,
                               check_values=check_index_values)
    return problem
