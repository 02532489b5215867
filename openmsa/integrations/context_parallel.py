"""Context parallelism: one long sequence split across the ranks of a ``torch.distributed`` group.

Head-parallel mode (``mode="head"``, DeepSpeed-Ulysses style): every rank passes its contiguous
shard of the sequence, ``[B, S / W, heads, dim]``. An all-to-all turns that into the whole
sequence for ``1 / W`` of the GQA groups (main heads, KV heads and index heads); the unmodified
MSA kernels run on it; an all-to-all turns the output back into sequence shards. Index key
heads shared by several ranks (the paper's single one) are all-gathered along the sequence
instead, and their gradients summed back. Needs ``Hkv % W == 0``.

Communication per layer and rank, forward (the backward moves the same again), in elements:
``(W - 1) / W * S / W * B * (2 * H * D + 2 * Hkv * D + Hi * Di)`` for the all-to-alls of q, out,
k, v and index_q, plus ``(W - 1) * S / W * B * Hik * Di`` for the all-gather of index_k.

The returned ``kl`` has the single-process value on every rank; its gradient on each rank is that
rank's share, so every rank adds ``kl_weight * kl`` to its loss, as it adds its own tokens' loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn

from ..ops.msa import msa_attention

MODES = ("head",)


class _GatherSequence(torch.autograd.Function):
    """All-gather of sequence shards along dim 1; the backward sums the ranks' gradients of the
    full tensor (all-reduce, which gloo has) and keeps this rank's shard."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        world, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(world, dim=1)[rank], None


def _sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """``[B, S/W, h, d]`` sequence shard -> ``[B, S, h/W, d]`` head shard (differentiable)."""
    world = dist.get_world_size(group)
    chunks = [c.contiguous() for c in x.chunk(world, dim=2)]  # heads for every rank
    received = dist_fn.all_to_all([torch.empty_like(c) for c in chunks], chunks, group=group)
    return torch.cat(received, dim=1)  # rank order = sequence order


def _heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """``[B, S, h/W, d]`` head shard -> ``[B, S/W, h, d]`` sequence shard (differentiable)."""
    world = dist.get_world_size(group)
    chunks = [c.contiguous() for c in x.chunk(world, dim=1)]  # sequence parts for every rank
    received = dist_fn.all_to_all([torch.empty_like(c) for c in chunks], chunks, group=group)
    return torch.cat(received, dim=2)  # rank order = head order


def context_parallel_msa_attention(q, k, v, index_q, index_k, *, group=None, mode: str = "head",
                                   **options):
    """MSA over a sequence split across ``group``: inputs and ``out`` are this rank's contiguous
    sequence shard ``[B, S / W, heads, dim]`` (shards in rank order), or of packed input
    ``[T / W, heads, dim]`` with ``cu_seqlens`` describing the whole packing; ``options`` are
    those of ``msa_attention`` (not ``return_indices``). Returns ``(out, kl)``."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, received {mode!r}")
    if not dist.is_initialized():
        raise ValueError("group: expected an initialized torch.distributed process group, "
                         "received none (call torch.distributed.init_process_group first)")
    if "return_indices" in options:
        raise ValueError("return_indices: not supported with context parallelism")
    world = dist.get_world_size(group)
    packed = options.get("cu_seqlens") is not None
    rank_of_inputs = 3 if packed else 4
    for name, tensor in (("q", q), ("k", k), ("v", v), ("index_q", index_q),
                         ("index_k", index_k)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != rank_of_inputs:
            layout = "[T / W, heads, dim] (with cu_seqlens)" if packed else "[B, S / W, heads, dim]"
            raise ValueError(f"{name}: expected a {rank_of_inputs}-D {layout} sequence shard, "
                             f"received {getattr(tensor, 'shape', type(tensor).__name__)}")
    if packed:  # one packed row: [1, T / W, heads, dim]; cu_seqlens covers the whole packing
        q, k, v, index_q, index_k = (t[None] for t in (q, k, v, index_q, index_k))
    num_kv_heads, num_index_heads = k.shape[2], index_q.shape[2]
    num_index_kv_heads = index_k.shape[2]
    if num_kv_heads % world:
        raise ValueError(f"k: expected a number of KV heads divisible by the world size {world} "
                         f"(head-parallel mode splits whole GQA groups), received {num_kv_heads}")
    if num_index_heads % num_kv_heads:
        raise ValueError(f"index_q: expected a multiple of the {num_kv_heads} KV heads, "
                         f"received {num_index_heads}")

    rank = dist.get_rank(group)
    q_heads, k_heads, v_heads, iq_heads = (_sequence_to_heads(t, group)
                                           for t in (q, k, v, index_q))
    if num_index_kv_heads % world == 0:
        ik_heads = _sequence_to_heads(index_k, group)
    else:  # shared index key heads: every rank takes the ones its index heads read
        full = _GatherSequence.apply(index_k, group)
        per_key_head = num_index_heads // num_index_kv_heads
        local = num_index_heads // world
        first, last = rank * local // per_key_head, ((rank + 1) * local - 1) // per_key_head
        ik_heads = full[:, :, first:last + 1]
    if packed:  # msa_attention takes packed input as [T, heads, dim]
        q_heads, k_heads, v_heads, iq_heads, ik_heads = (
            t[0] for t in (q_heads, k_heads, v_heads, iq_heads, ik_heads))
    out, kl = msa_attention(q_heads, k_heads, v_heads, iq_heads, ik_heads, **options)
    if packed:
        out = out[None]
    # The global KL is the mean of the ranks' KLs (equal head counts). The value is all-reduced
    # without autograd, so each rank's gradient is its own share: d kl / d kl_rank = 1 / W.
    total = kl.detach().clone()
    dist.all_reduce(total, group=group)
    kl = kl / world + (total - kl.detach()) / world
    out = _heads_to_sequence(out, group)
    return (out[0] if packed else out), kl
