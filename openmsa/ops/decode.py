"""``msa_decode``: MSA with a cache (SPEC section 10), new query tokens against per-sequence caches
of k, v and index_k.

Sequence b's ``Tq`` new tokens are the last ones of its first ``cache_seqlens[b]`` cached
tokens, so they are the query range ``[cache_seqlens[b] - Tq, cache_seqlens[b])`` of that
sequence: each row runs through ``msa_attention``'s query ranges (selection, then the main
attention over the kept blocks) without gradient and without the KL, or, with ``block_indices``
(a layer sharing another layer's selection), through ``sparse_attention``'s. The result is
therefore the rows of ``msa_attention`` at those positions by construction.

On the kernels, up to DECODE_MAX_NEW_TOKENS new tokens per sequence run the decode kernels
(``decode_kernels``: selection against the whole cache and the main attention over the kept
blocks, split over the cache and the kept blocks so that batch 1 fills the GPU; the fp8 index
branch quantizes there); longer chunks (prefill) and warmup run the training kernels one batch
row at a time.
The decode kernels read ``cache_seqlens`` on the device only: while a CUDA graph is captured
the host checks of its values are skipped and a decode step on them can be captured; the
training-kernel route reads them on the host and is refused then. On a CPU the eager reference
runs (the kernels under the Triton interpreter).
"""

from __future__ import annotations

import torch

from . import decode_kernels
from .msa import _use_kernels, msa_attention, sparse_attention
from .validate import _fail, validate_msa_args

# New tokens per sequence up to which the decode kernels run (their scoring MMA holds all of a
# sequence's new tokens x index heads of a key head); longer chunks run the training kernels.
DECODE_MAX_NEW_TOKENS = 16


def _capturing(tensor: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on ``tensor``'s device."""
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def _check_decode_args(q, k_cache, v_cache, index_q, index_k_cache, cache_seqlens,
                       block_indices, warmup: bool) -> list[int]:
    """Shapes of ``msa_decode``'s tensors (the rest is checked per row by ``msa_attention``);
    returns the cache lengths."""
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    if block_indices is None and not warmup:
        tensors.update(index_q=index_q, index_k_cache=index_k_cache)
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, received {type(tensor).__name__}")
        if tensor.dim() != 4:
            raise _fail(name, "a 4-D tensor ([B, Tq, heads, dim] for queries, [B, Smax, heads, "
                        "dim] for caches)", f"shape {tuple(tensor.shape)}")
        if tensor.shape[0] != q.shape[0]:
            raise _fail(name, f"batch {q.shape[0]} (that of q)", tensor.shape[0])
    for name in ("v_cache", "index_k_cache"):
        if name in tensors and tensors[name].shape[1] != k_cache.shape[1]:
            raise _fail(name, f"{k_cache.shape[1]} cached positions (those of k_cache)",
                        tensors[name].shape[1])
    if "index_q" in tensors and index_q.shape[1] != q.shape[1]:
        raise _fail("index_q", f"{q.shape[1]} new tokens (those of q)", index_q.shape[1])
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens: expected a torch.Tensor, received "
                        f"{type(cache_seqlens).__name__}")
    if cache_seqlens.dtype not in (torch.int32, torch.int64) or cache_seqlens.dim() != 1:
        raise _fail("cache_seqlens", "an int32 or int64 tensor [B]",
                    f"{cache_seqlens.dtype} of shape {tuple(cache_seqlens.shape)}")
    if cache_seqlens.shape[0] != q.shape[0]:
        raise _fail("cache_seqlens", f"{q.shape[0]} entries (the batch of q)",
                    cache_seqlens.shape[0])
    new_tokens, capacity = q.shape[1], k_cache.shape[1]
    # Reading the lengths syncs the host: not while a CUDA graph is captured (None then).
    lengths = None if _capturing(cache_seqlens) else cache_seqlens.tolist()
    for length in lengths or ():
        if not new_tokens <= length <= capacity:
            raise _fail("cache_seqlens", f"entries in [{new_tokens}, {capacity}] (the new tokens "
                        f"of q are cached, within the cache's {capacity} positions)", length)
    if block_indices is not None:
        if warmup:
            raise _fail("block_indices", "None with warmup=True (warmup keeps every causal "
                        "block)", "a tensor")
        if not isinstance(block_indices, torch.Tensor) or block_indices.dim() != 4 or (
                block_indices.shape[0], block_indices.shape[2]) != (q.shape[0], new_tokens):
            raise _fail("block_indices", f"a [B, Hi, Tq, k] tensor with B={q.shape[0]}, "
                        f"Tq={new_tokens}", getattr(block_indices, "shape", block_indices))
    return lengths


def msa_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               index_q: torch.Tensor | None, index_k_cache: torch.Tensor | None,
               cache_seqlens: torch.Tensor, *, top_k: int = 16, block_size: int = 128,
               softmax_scale: float | None = None, index_softmax_scale: float | None = None,
               num_local_blocks: int = 1, num_sink_blocks: int = 0,
               local_block_dilation: int = 1, index_precision: str = "input",
               block_indices: torch.Tensor | None = None,
               return_indices: bool = False, warmup: bool = False, backend: str = "auto"):
    """MSA for new tokens against a cache (SPEC section 10); inference only.

    Args:
        q: the last ``Tq`` tokens' queries of each sequence ``[B, Tq, H, D]``.
        k_cache, v_cache: ``[B, Smax, Hkv, D]``, holding each sequence's keys and values at
            positions ``0 .. cache_seqlens[b] - 1`` (the new tokens' included); positions past
            ``cache_seqlens[b]`` are ignored.
        index_q: ``[B, Tq, Hi, Di]``; index_k_cache: ``[B, Smax, Hik, Di]`` (both may be None
            with ``block_indices`` or ``warmup``).
        cache_seqlens: int ``[B]``, ``Tq <= cache_seqlens[b] <= Smax``.
        block_indices: kept block ids ``[B, Hi, Tq, k]`` to attend over instead of selecting
            (a layer sharing another layer's selection, SPEC section 9).
        warmup: dense causal attention over the cache (a model still in its warmup).
        The other options are ``msa_attention``'s.

    Returns ``out [B, Tq, H, D]``, equal to the rows of ``msa_attention``'s out at those
    positions for the sequences ``0 .. cache_seqlens[b] - 1``; with ``return_indices`` also the
    kept ids ``[B, Hi, Tq, top_k]`` (None with ``warmup``). No gradient, no KL.
    """
    lengths = _check_decode_args(q, k_cache, v_cache, index_q, index_k_cache, cache_seqlens,
                                 block_indices, warmup)
    new_tokens = q.shape[1]
    if not warmup and new_tokens <= DECODE_MAX_NEW_TOKENS and _use_kernels(backend, q.device):
        return _decode_on_kernels(q, k_cache, v_cache, index_q, index_k_cache, cache_seqlens,
                                  lengths, block_indices, return_indices,
                                  dict(top_k=top_k, block_size=block_size,
                                       softmax_scale=softmax_scale,
                                       index_softmax_scale=index_softmax_scale,
                                       num_local_blocks=num_local_blocks,
                                       local_block_dilation=local_block_dilation,
                                       num_sink_blocks=num_sink_blocks,
                                       index_precision=index_precision, backend=backend))
    if lengths is None:
        raise _fail("cache_seqlens", f"a decode the decode kernels run while a CUDA graph is "
                    f"captured (at most {DECODE_MAX_NEW_TOKENS} new tokens, no warmup; the rest "
                    f"reads the lengths on the host)",
                    f"{new_tokens} new tokens, warmup={warmup}")
    outs, ids = [], []
    with torch.no_grad():
        for row, length in enumerate(lengths):
            rows = slice(row, row + 1)
            keys = (k_cache[rows, :length], v_cache[rows, :length])
            start = length - new_tokens
            if warmup or block_indices is not None:
                given = None if warmup else block_indices[rows]
                outs.append(sparse_attention(
                    q[rows], *keys, given, block_size=block_size, softmax_scale=softmax_scale,
                    backend=backend, warmup=warmup, query_start=start,
                    num_index_heads=(index_q.shape[2] if warmup and index_q is not None
                                     else None)))
                ids.append(given)
                continue
            out, _, kept = msa_attention(
                q[rows], *keys, index_q[rows], index_k_cache[rows, :length], top_k=top_k,
                block_size=block_size, softmax_scale=softmax_scale,
                index_softmax_scale=index_softmax_scale, num_local_blocks=num_local_blocks,
                local_block_dilation=local_block_dilation,
                num_sink_blocks=num_sink_blocks, index_precision=index_precision,
                query_start=start, kl_value=False, return_indices=True, backend=backend)
            outs.append(out)
            ids.append(kept)
    out = torch.cat(outs)
    if not return_indices:
        return out
    return out, (None if warmup else torch.cat(ids))


def _decode_on_kernels(q, k_cache, v_cache, index_q, index_k_cache, cache_seqlens, lengths,
                       block_indices, return_indices, options):
    """``msa_decode`` on the decode kernels; the options are checked as ``msa_attention`` checks
    them for the first sequence's rows. ``lengths``: the host's copy of ``cache_seqlens``, or
    None (CUDA graph capture: the kernels read the lengths on the device; every cached block is
    then scored)."""
    longest = k_cache.shape[1] if lengths is None else max(lengths)
    first_length = longest if lengths is None else lengths[0]
    first = slice(0, 1)
    if block_indices is None:
        problem = validate_msa_args(
            q[first], k_cache[first, :first_length], v_cache[first, :first_length],
            index_q[first], index_k_cache[first, :first_length], warmup=False, cu_seqlens=None,
            max_seqlen=None, deterministic=False, return_indices=False,
            query_start=first_length - q.shape[1], kl_num_queries=None, kl_value=False,
            **options)
        with torch.no_grad():
            block_indices = decode_kernels.decode_select(
                index_q, index_k_cache[:, :longest], cache_seqlens, top_k=problem.top_k,
                block_size=problem.block_size, index_softmax_scale=problem.index_softmax_scale,
                num_local_blocks=problem.num_local_blocks,
                local_block_dilation=problem.local_block_dilation,
                num_sink_blocks=problem.num_sink_blocks,
                index_precision=options["index_precision"])
        scale = problem.softmax_scale
    else:
        scale = options["softmax_scale"]
        scale = q.shape[-1] ** -0.5 if scale is None else scale
    with torch.no_grad():
        out = decode_kernels.decode_attention(q, k_cache[:, :longest], v_cache[:, :longest],
                                              block_indices, cache_seqlens,
                                              options["block_size"], scale)
    return (out, block_indices) if return_indices else out
