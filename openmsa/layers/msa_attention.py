"""``MSAAttention``: a GQA self-attention layer whose attention is MiniMax Sparse Attention."""

from __future__ import annotations

import torch
from torch import nn

from ..context_parallel import (MODES, context_parallel_msa_attention,
                                             shard_sequence)
from ..ops.msa import msa_attention
from ..ops.validate import check_index_precision, query_positions_from_offsets


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding (the Llama / Qwen convention: halves rotated).

    x: ``[..., tokens, heads, dim]``; positions: int ``[..., tokens]`` (broadcast over heads)."""
    dim = x.shape[-1]
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=x.device, dtype=compute) / dim))
    angles = positions.to(compute)[..., None] * inv_freq  # [..., tokens, dim / 2]
    cos = torch.cat((angles, angles), dim=-1).cos()[..., None, :]
    sin = torch.cat((angles, angles), dim=-1).sin()[..., None, :]
    rotated = x.to(compute) * cos + rotate_half(x.to(compute)) * sin
    return rotated.to(x.dtype)


class MSAAttention(nn.Module):
    """Self-attention with q/k/v/o projections, an index branch (its own query and key
    projections, no values), RoPE on both branches and optional QK-norm on both.

    ``forward(hidden_states)`` returns ``(hidden, kl)``: add ``kl_weight * kl`` to the loss. The
    index branch reads a detached copy of the hidden states, so the KL trains only the index
    projections. ``warmup = True`` runs dense causal attention (the KL then covers the whole
    prefix); ``MSAWarmupSchedule`` switches every layer of a model by step. ``top_k``,
    ``block_size``, ``num_local_blocks``, ``num_sink_blocks``, ``backend``, ``deterministic``
    and ``index_precision`` (``"fp8"``: selection on fp8 index scores) are passed to
    ``msa_attention``.
    """

    is_msa_layer = True  # set_msa_warmup switches every module that says so

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: int | None = None, num_index_heads: int | None = None,
                 num_index_kv_heads: int = 1, index_head_dim: int | None = None, *,
                 top_k: int = 16, block_size: int = 128, num_local_blocks: int = 1,
                 num_sink_blocks: int = 0, rope_theta: float = 10000.0, qk_norm: bool = False,
                 bias: bool = False, backend: str = "auto", deterministic: bool = False,
                 index_precision: str = "input", context_parallel_group=None,
                 context_parallel_mode: str = "head"):
        super().__init__()
        # With a process group, hidden_states is this rank's shard of the sequence and the
        # attention runs across the group (openmsa.context_parallel): head mode
        # takes contiguous shards, sequence mode zig-zag ones (shard_sequence cuts either).
        if context_parallel_mode not in MODES:
            raise ValueError(f"context_parallel_mode: expected one of {MODES}, received "
                             f"{context_parallel_mode!r}")
        check_index_precision(index_precision)  # here, not at the first forward
        self.context_parallel_group = context_parallel_group
        self.context_parallel_mode = context_parallel_mode
        head_dim = head_dim or hidden_size // num_heads
        num_index_heads = num_index_heads or num_kv_heads
        index_head_dim = index_head_dim or head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.num_index_heads, self.num_index_kv_heads = num_index_heads, num_index_kv_heads
        self.index_head_dim = index_head_dim
        self.options = dict(top_k=top_k, block_size=block_size,
                            num_local_blocks=num_local_blocks, num_sink_blocks=num_sink_blocks,
                            backend=backend, deterministic=deterministic,
                            index_precision=index_precision)
        self.rope_theta = rope_theta
        self.warmup = False
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.index_q_proj = nn.Linear(hidden_size, num_index_heads * index_head_dim, bias=False)
        self.index_k_proj = nn.Linear(hidden_size, num_index_kv_heads * index_head_dim,
                                      bias=False)
        norm = (lambda dim: nn.RMSNorm(dim, eps=1e-6)) if qk_norm else (lambda dim: nn.Identity())
        self.q_norm, self.k_norm = norm(head_dim), norm(head_dim)
        self.index_q_norm, self.index_k_norm = norm(index_head_dim), norm(index_head_dim)

    def projections(self, hidden_states: torch.Tensor, position_ids: torch.Tensor):
        """The inputs of ``msa_attention``: ``(q, k, v, index_q, index_k)`` of
        ``hidden_states`` at ``position_ids``, with QK-norm and RoPE applied; the index branch
        reads a detached copy."""
        lead = hidden_states.shape[:-1]
        detached = hidden_states.detach()

        def project(layer, x, heads, dim, norm):
            return apply_rope(norm(layer(x).view(*lead, heads, dim)), position_ids,
                              self.rope_theta)

        q = project(self.q_proj, hidden_states, self.num_heads, self.head_dim, self.q_norm)
        k = project(self.k_proj, hidden_states, self.num_kv_heads, self.head_dim, self.k_norm)
        v = self.v_proj(hidden_states).view(*lead, self.num_kv_heads, self.head_dim)
        index_q = project(self.index_q_proj, detached, self.num_index_heads,
                          self.index_head_dim, self.index_q_norm)
        index_k = project(self.index_k_proj, detached, self.num_index_kv_heads,
                          self.index_head_dim, self.index_k_norm)
        return q, k, v, index_q, index_k

    def forward(self, hidden_states: torch.Tensor, position_ids: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None,
                return_indices: bool = False):
        """hidden_states: ``[B, S, hidden]``, or packed ``[T, hidden]`` with ``cu_seqlens``
        (with context parallelism: this rank's shard, ``cu_seqlens`` of the whole packing).
        position_ids: optional ``[B, S]`` (packed: ``[T]``); default: positions within each
        sequence (of this rank's tokens). Returns ``(hidden, kl)``; with ``return_indices``,
        ``(hidden, kl, indices)`` (indices None in warmup)."""
        lead = hidden_states.shape[:-1]
        if position_ids is None:
            position_ids = self._default_positions(lead, cu_seqlens, hidden_states.device)
        q, k, v, index_q, index_k = self.projections(hidden_states, position_ids)
        options = dict(self.options, warmup=self.warmup, cu_seqlens=cu_seqlens,
                       max_seqlen=max_seqlen, return_indices=return_indices and not self.warmup)
        if self.context_parallel_group is not None:
            out, kl, *indices = context_parallel_msa_attention(
                q, k, v, index_q, index_k, group=self.context_parallel_group,
                mode=self.context_parallel_mode, **options)
        else:
            out, kl, *indices = msa_attention(q, k, v, index_q, index_k, **options)
        hidden = self.o_proj(out.reshape(*lead, self.num_heads * self.head_dim))
        if return_indices:  # warmup selects nothing: None
            return hidden, kl, (indices[0] if indices else None)
        return hidden, kl

    def _default_positions(self, lead, cu_seqlens, device) -> torch.Tensor:
        """Each token's position in its sequence; with context parallelism, those of this
        rank's shard of the whole sequence (or packing)."""
        group = self.context_parallel_group
        ranks = 1 if group is None else torch.distributed.get_world_size(group)
        tokens = ranks * lead[-1]
        if cu_seqlens is None:
            positions = torch.arange(tokens, device=device)
        else:  # cu_seqlens describes the whole packing
            positions = query_positions_from_offsets(cu_seqlens, tokens)
        if group is not None:
            if self.context_parallel_mode == "sequence" and lead[-1] % 2:
                raise ValueError(f"hidden_states: expected an even number of tokens per rank "
                                 f"(sequence mode cuts the sequence into 2 x {ranks} equal "
                                 f"chunks), received {lead[-1]}")
            positions = shard_sequence(positions, group, self.context_parallel_mode, dim=0)
        return positions if cu_seqlens is not None else positions.expand(lead)


def set_msa_warmup(model: nn.Module, warmup: bool) -> int:
    """Sets ``warmup`` on every MSA layer of ``model`` (``MSAAttention`` and converted Hugging
    Face attention); returns how many it set."""
    layers = [module for module in model.modules() if getattr(module, "is_msa_layer", False)]
    for layer in layers:
        layer.warmup = warmup
    return len(layers)


class MSAWarmupSchedule:
    """Dense warmup for the first ``warmup_steps`` steps, sparse after:
    ``schedule.apply(model, step)`` before each step."""

    def __init__(self, warmup_steps: int):
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps: expected an int >= 0, received {warmup_steps}")
        self.warmup_steps = warmup_steps

    def is_warmup(self, step: int) -> bool:
        return step < self.warmup_steps

    def apply(self, model: nn.Module, step: int) -> bool:
        warmup = self.is_warmup(step)
        set_msa_warmup(model, warmup)
        return warmup
