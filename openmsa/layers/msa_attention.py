"""``MSAAttention``: a GQA self-attention layer whose attention is MiniMax Sparse Attention."""

from __future__ import annotations

import torch
from torch import nn

from ..context_parallel import (MODES, context_parallel_msa_attention,
                                context_parallel_sparse_attention, shard_sequence)
from ..ops.auto_tuning import AutoTuning, own_tuning
from ..ops.configs import Tuning
from ..ops.msa import msa_attention, sparse_attention
from ..ops.validate import (check_index_precision, check_local_block_dilation,
                            query_positions_from_offsets)


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
    ``block_size``, ``num_local_blocks``, ``local_block_dilation``, ``num_sink_blocks``,
    ``backend``, ``deterministic``, ``index_precision`` (``"fp8"``: selection on fp8 index
    scores) and ``tuning`` (``"adaptive"``, ``"incoherent"``: routes for selections whose
    neighbours keep different blocks, as a new index branch makes; ``"auto"``: an
    ``AutoTuning`` of the layer's own, which runs the adaptive tuning while its previous
    selections walked long) are passed to ``msa_attention`` (``tuning`` also to a sharing
    layer's ``sparse_attention``).

    Index sharing (SPEC section 9): ``share_index_from=layer`` builds a layer without an index
    branch (no index projections) that attends over the blocks ``layer`` (an earlier layer of
    the same ``H``, ``Hkv``, ``Hi`` and block size, or a layer sharing from one) kept in its
    latest forward, on the same tokens; its KL is 0 (no gradient), so a model's KL is the mean
    over its layers with an index branch (``has_index_branch``). In warmup it runs dense like
    its source. ``forward(..., block_indices=ids)`` gives the ids explicitly instead (those of
    ``return_indices=True``). ``share_index_kl=True`` (an option beyond SPEC section 9) makes a
    sharing layer a teacher of the index branch it reads: its KL is that of its source's index
    scores against its own main attention over its kept tokens (the whole prefix in warmup), and
    its gradient reaches the source's index projections; the model's KL is then the mean over
    every layer. It costs the sharing layer a KL pass over the kept pairs (no selection), and
    lets one selection serve layers that attend differently.
    """

    is_msa_layer = True  # set_msa_warmup switches every module that says so

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: int | None = None, num_index_heads: int | None = None,
                 num_index_kv_heads: int = 1, index_head_dim: int | None = None, *,
                 top_k: int = 16, block_size: int = 128, num_local_blocks: int = 1,
                 num_sink_blocks: int = 0, rope_theta: float = 10000.0, qk_norm: bool = False,
                 bias: bool = False, backend: str = "auto", deterministic: bool = False,
                 index_precision: str = "input", context_parallel_group=None,
                 context_parallel_mode: str = "head",
                 share_index_from: "MSAAttention | None" = None, local_block_dilation: int = 1,
                 share_index_kl: bool = False,
                 tuning: Tuning | AutoTuning | str | None = None):
        super().__init__()
        # With a process group, hidden_states is this rank's shard of the sequence and the
        # attention runs across the group (openmsa.context_parallel): head mode
        # takes contiguous shards, sequence mode zig-zag ones (shard_sequence cuts either).
        if context_parallel_mode not in MODES:
            raise ValueError(f"context_parallel_mode: expected one of {MODES}, received "
                             f"{context_parallel_mode!r}")
        check_index_precision(index_precision)  # here, not at the first forward
        check_local_block_dilation(local_block_dilation)
        tuning = own_tuning(tuning)  # validated here, not at the first forward
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
                            local_block_dilation=local_block_dilation, backend=backend,
                            deterministic=deterministic, index_precision=index_precision,
                            tuning=tuning)
        self.rope_theta = rope_theta
        self.warmup = False
        # The kept ids of the latest forward, kept for the layers that share them.
        self.last_indices = None
        self._hands_on_indices = False
        # The index branch's inputs of the latest forward, for the sharing layers that teach it.
        self.last_index_inputs = None
        self._hands_on_index_inputs = False
        # The layer whose selection this one reads (a tuple: not a registered submodule).
        self._index_source = ()
        if not isinstance(share_index_kl, bool):
            raise ValueError(f"share_index_kl: expected a bool, received {share_index_kl!r}")
        if share_index_kl and share_index_from is None:
            raise ValueError("share_index_kl: applies to a layer that shares another layer's "
                             "selection (give share_index_from too)")
        self.share_index_kl = share_index_kl
        if share_index_from is not None:
            source = _index_source_of(share_index_from)
            _check_shareable(self, source)
            self._index_source = (source,)
            source._hands_on_indices = True
            source._hands_on_index_inputs |= share_index_kl
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        norm = (lambda dim: nn.RMSNorm(dim, eps=1e-6)) if qk_norm else (lambda dim: nn.Identity())
        self.q_norm, self.k_norm = norm(head_dim), norm(head_dim)
        if self.has_index_branch:
            self.index_q_proj = nn.Linear(hidden_size, num_index_heads * index_head_dim,
                                          bias=False)
            self.index_k_proj = nn.Linear(hidden_size, num_index_kv_heads * index_head_dim,
                                          bias=False)
            self.index_q_norm, self.index_k_norm = norm(index_head_dim), norm(index_head_dim)

    @property
    def has_index_branch(self) -> bool:
        """Whether the layer selects its own blocks (False: it shares another layer's)."""
        return len(self._index_source) == 0

    @property
    def has_kl(self) -> bool:
        """Whether the layer's KL trains an index branch (its own, or with ``share_index_kl``
        its source's): the layers a model's KL averages over."""
        return self.has_index_branch or self.share_index_kl

    def projections(self, hidden_states: torch.Tensor, position_ids: torch.Tensor):
        """The inputs of ``msa_attention``: ``(q, k, v, index_q, index_k)`` of
        ``hidden_states`` at ``position_ids``, with QK-norm and RoPE applied; the index branch
        reads a detached copy (index_q and index_k are None without an index branch)."""
        lead = hidden_states.shape[:-1]

        def project(layer, x, heads, dim, norm):
            return apply_rope(norm(layer(x).view(*lead, heads, dim)), position_ids,
                              self.rope_theta)

        q = project(self.q_proj, hidden_states, self.num_heads, self.head_dim, self.q_norm)
        k = project(self.k_proj, hidden_states, self.num_kv_heads, self.head_dim, self.k_norm)
        v = self.v_proj(hidden_states).view(*lead, self.num_kv_heads, self.head_dim)
        if not self.has_index_branch:
            return q, k, v, None, None
        detached = hidden_states.detach()
        index_q = project(self.index_q_proj, detached, self.num_index_heads,
                          self.index_head_dim, self.index_q_norm)
        index_k = project(self.index_k_proj, detached, self.num_index_kv_heads,
                          self.index_head_dim, self.index_k_norm)
        return q, k, v, index_q, index_k

    def forward(self, hidden_states: torch.Tensor, position_ids: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None,
                return_indices: bool = False, block_indices: torch.Tensor | None = None):
        """hidden_states: ``[B, S, hidden]``, or packed ``[T, hidden]`` with ``cu_seqlens``
        (with context parallelism: this rank's shard, ``cu_seqlens`` of the whole packing).
        position_ids: optional ``[B, S]`` (packed: ``[T]``); default: positions within each
        sequence (of this rank's tokens). block_indices: kept ids to attend over instead of
        the layer's own selection (or, sharing, its source's). Returns ``(hidden, kl)``; with
        ``return_indices``, ``(hidden, kl, indices)`` (indices None in warmup; with context
        parallelism, in the layout ``context_parallel_msa_attention`` returns)."""
        lead = hidden_states.shape[:-1]
        if position_ids is None:
            position_ids = self._default_positions(lead, cu_seqlens, hidden_states.device)
        q, k, v, index_q, index_k = self.projections(hidden_states, position_ids)
        if self.has_index_branch:
            wants_indices = (return_indices or self._hands_on_indices) and not self.warmup
            options = dict(self.options, warmup=self.warmup, cu_seqlens=cu_seqlens,
                           max_seqlen=max_seqlen, return_indices=wants_indices,
                           block_indices=block_indices)
            if self.context_parallel_group is not None:
                out, kl, *indices = context_parallel_msa_attention(
                    q, k, v, index_q, index_k, group=self.context_parallel_group,
                    mode=self.context_parallel_mode, **options)
            else:
                out, kl, *indices = msa_attention(q, k, v, index_q, index_k, **options)
            indices = indices[0] if indices else None
            if self._hands_on_indices:
                self.last_indices = indices
            if self._hands_on_index_inputs:
                self.last_index_inputs = (index_q, index_k)
        else:
            out, kl, indices = self._shared_attention(q, k, v, cu_seqlens, max_seqlen,
                                                      block_indices)
        hidden = self.o_proj(out.reshape(*lead, self.num_heads * self.head_dim))
        if return_indices:  # warmup selects nothing: None
            return hidden, kl, indices
        return hidden, kl

    def _shared_attention(self, q, k, v, cu_seqlens, max_seqlen, block_indices):
        """A layer without an index branch: the main attention over ``block_indices`` or its
        source's latest ids (dense in warmup), with ``share_index_kl`` the KL of the source's
        latest index inputs against this layer's attention. Returns ``(out, kl, ids)``."""
        source = self._index_source[0]
        ids = None
        if not self.warmup:
            ids = block_indices if block_indices is not None else source.last_indices
            if ids is None:
                raise ValueError("block_indices: expected the kept ids of the layer this one "
                                 "shares (given, or from that layer's forward just before), "
                                 "received none (the source ran in warmup, or no forward of it "
                                 "ran yet)")
        group = self.context_parallel_group
        if self.share_index_kl:
            if source.last_index_inputs is None:
                raise ValueError("share_index_kl: the layer this one shares ran no forward "
                                 "before it, so there are no index scores to teach")
            index_q, index_k = source.last_index_inputs
            options = dict(self.options, warmup=self.warmup, cu_seqlens=cu_seqlens,
                           max_seqlen=max_seqlen, block_indices=ids)
            if group is not None:
                out, kl = context_parallel_msa_attention(
                    q, k, v, index_q, index_k, group=group, mode=self.context_parallel_mode,
                    **options)
            else:
                out, kl = msa_attention(q, k, v, index_q, index_k, **options)
            return out, kl, ids
        kl = torch.zeros((), dtype=torch.float32, device=q.device)
        options = dict(block_size=self.options["block_size"], cu_seqlens=cu_seqlens,
                       max_seqlen=max_seqlen, backend=self.options["backend"],
                       tuning=self.options["tuning"])
        if self.warmup:
            options.update(warmup=True, num_index_heads=self.num_index_heads,
                           deterministic=self.options["deterministic"])
            ids = None
        if group is not None:
            out = context_parallel_sparse_attention(q, k, v, ids, group=group,
                                                    mode=self.context_parallel_mode, **options)
        else:
            out = sparse_attention(q, k, v, ids, **options)
        return out, kl, ids

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


def _index_source_of(layer) -> "MSAAttention":
    """The layer with an index branch whose selection ``layer`` stands for (itself, or the
    source it shares)."""
    if not isinstance(layer, MSAAttention):
        raise TypeError(f"share_index_from: expected an MSAAttention, received "
                        f"{type(layer).__name__}")
    return layer if layer.has_index_branch else layer._index_source[0]


def _check_shareable(layer: "MSAAttention", source: "MSAAttention") -> None:
    """SPEC section 9: a shared selection needs the same head mapping and block size."""
    mine = (layer.num_heads, layer.num_kv_heads, layer.num_index_heads,
            layer.options["block_size"])
    theirs = (source.num_heads, source.num_kv_heads, source.num_index_heads,
              source.options["block_size"])
    if mine != theirs:
        raise ValueError(f"share_index_from: expected a layer with this layer's (H, Hkv, Hi, "
                         f"block_size) = {mine}, received one with {theirs}")
    if (layer.context_parallel_group, layer.context_parallel_mode) != (
            source.context_parallel_group, source.context_parallel_mode):
        raise ValueError("share_index_from: expected a layer with this layer's context "
                         "parallel group and mode (the ids' layout follows them), received "
                         "another")
