"""Public entry points: ``msa_attention`` and its eager reference ``naive_msa_attention``."""

from __future__ import annotations

import os

import torch

from .naive import naive_msa_forward, naive_select_blocks
from .select import select_blocks_packed_or_batched
from .validate import (check_backend, validate_block_indices, validate_msa_args,
                       validate_select_args)

# Triton decides at import time whether kernels are compiled or interpreted on the CPU.
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _use_kernels(backend: str, device: torch.device) -> bool:
    """Whether ``backend`` runs the Triton kernels for tensors on ``device``."""
    if backend == "reference":
        return False
    if backend == "auto":
        return device.type == "cuda"
    if device.type == "cpu" and not INTERPRETING:
        raise ValueError("backend: expected CUDA tensors for 'triton' (or CPU tensors with "
                         "TRITON_INTERPRET=1 set before importing openmsa), received CPU tensors")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"backend: expected CUDA tensors for 'triton', received {device.type}")
    return True


def _return(out, kl, block_ids, return_indices):
    return (out, kl, block_ids) if return_indices else (out, kl)


def msa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index_q: torch.Tensor,
                  index_k: torch.Tensor, *, top_k: int = 16, block_size: int = 128,
                  softmax_scale: float | None = None, index_softmax_scale: float | None = None,
                  num_local_blocks: int = 1, num_sink_blocks: int = 0, warmup: bool = False,
                  cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None,
                  deterministic: bool = False, return_indices: bool = False,
                  backend: str = "auto", block_indices: torch.Tensor | None = None):
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
            kept.
        num_sink_blocks: the first ``num_sink_blocks`` blocks are always kept.
        warmup: dense causal main attention; the KL covers the whole causal prefix.
        cu_seqlens: int32 ``[N + 1]`` offsets of packed sequences (``flash_attn_varlen_func``).
        max_seqlen: optional upper bound on the packed sequences' lengths.
        deterministic: bitwise reproducible gradients.
        return_indices: also return the kept block ids, int32 ``[B, Hi, S, top_k]`` (packed
            ``[Hi, T, top_k]``), relative to each sequence's start, unused slots ``-1``.
        backend: ``"auto"``, ``"triton"`` or ``"reference"`` (the eager reference, any device;
            also accepts float64).
        block_indices: optional kept block ids in the layout ``return_indices`` gives (any number
            of slots, ``-1`` unused); used instead of the index branch's own selection.

    Returns:
        ``out`` with q's shape and dtype; ``kl``, a float32 0-dim tensor holding the exact
        KL(teacher || index student) averaged over query tokens and index heads. ``out``
        back-propagates to q, k, v only; ``kl`` to index_q, index_k only.

    Backends: ``"auto"`` uses the Triton kernels for CUDA tensors and the eager reference for CPU
    tensors; ``"triton"`` forces the kernels (CPU tensors need ``TRITON_INTERPRET=1``, for
    tests); ``"reference"`` forces the eager reference. In this release only the block selection
    is a Triton kernel: the sparse attention, the KL and warmup run the eager reference on the
    kernel's kept blocks, on whichever device the tensors live.
    """
    problem = validate_msa_args(
        q, k, v, index_q, index_k, top_k=top_k, block_size=block_size,
        softmax_scale=softmax_scale, index_softmax_scale=index_softmax_scale,
        num_local_blocks=num_local_blocks, num_sink_blocks=num_sink_blocks, warmup=warmup,
        cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, deterministic=deterministic,
        return_indices=return_indices, backend=backend)
    if block_indices is not None:
        validate_block_indices(block_indices, problem, cu_seqlens, q.device)
    if not _use_kernels(backend, q.device):
        return _return(*naive_msa_forward(q, k, v, index_q, index_k, problem, cu_seqlens,
                                          block_indices), return_indices)
    if block_indices is None and not warmup:
        block_indices = select_blocks_packed_or_batched(
            index_q, index_k, cu_seqlens, top_k=top_k, block_size=block_size,
            index_softmax_scale=problem.index_softmax_scale,
            num_local_blocks=num_local_blocks, num_sink_blocks=num_sink_blocks)
    # The selection above is the Triton kernel. The sparse attention and the KL still run the
    # eager reference on the kernel's kept blocks until their kernels land (see the docstring).
    return _return(*naive_msa_forward(q, k, v, index_q, index_k, problem, cu_seqlens,
                                      block_indices), return_indices)


def select_blocks(index_q: torch.Tensor, index_k: torch.Tensor, *, top_k: int = 16,
                  block_size: int = 128, index_softmax_scale: float | None = None,
                  num_local_blocks: int = 1, num_sink_blocks: int = 0,
                  cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None,
                  backend: str = "auto") -> torch.Tensor:
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
        backend=backend)
    options = dict(top_k=top_k, block_size=block_size, index_softmax_scale=scale,
                   num_local_blocks=num_local_blocks, num_sink_blocks=num_sink_blocks)
    if _use_kernels(backend, index_q.device):
        return select_blocks_packed_or_batched(index_q, index_k, cu_seqlens, **options)
    return naive_select_blocks(index_q, index_k, cu_seqlens, **options)


def naive_msa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index_q: torch.Tensor,
                        index_k: torch.Tensor, *, top_k: int = 16, block_size: int = 128,
                        softmax_scale: float | None = None,
                        index_softmax_scale: float | None = None, num_local_blocks: int = 1,
                        num_sink_blocks: int = 0, warmup: bool = False,
                        cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None,
                        deterministic: bool = False, return_indices: bool = False,
                        backend: str = "reference", block_indices: torch.Tensor | None = None):
    """The eager PyTorch reference of ``msa_attention`` (same signature and results).

    Plain autograd over chunked, checkpointed queries: exact, slow, and the test oracle. It
    accepts every backend name for signature compatibility and always runs the reference;
    float64 inputs are accepted.
    """
    check_backend(backend)
    problem = validate_msa_args(
        q, k, v, index_q, index_k, top_k=top_k, block_size=block_size,
        softmax_scale=softmax_scale, index_softmax_scale=index_softmax_scale,
        num_local_blocks=num_local_blocks, num_sink_blocks=num_sink_blocks, warmup=warmup,
        cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, deterministic=deterministic,
        return_indices=return_indices, backend="reference")
    if block_indices is not None:
        validate_block_indices(block_indices, problem, cu_seqlens, q.device)
    return _return(*naive_msa_forward(q, k, v, index_q, index_k, problem, cu_seqlens,
                                      block_indices), return_indices)
