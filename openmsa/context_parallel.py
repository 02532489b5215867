"""Context parallelism: one long sequence split across the ranks of a ``torch.distributed`` group.

Two modes (docs/CONTEXT_PARALLEL.md compares them):

- ``mode="head"`` (DeepSpeed-Ulysses style): every rank passes its contiguous shard of the
  sequence, ``[B, S / W, heads, dim]``. An all-to-all turns that into the whole sequence for
  ``1 / W`` of the GQA groups (main heads, KV heads and index heads); the unmodified MSA kernels
  run on it; an all-to-all turns the output back into sequence shards. Index key heads shared by
  several ranks (the paper's single one) are all-gathered along the sequence instead, and their
  gradients summed back. Needs ``Hkv % W == 0``.
- ``mode="sequence"``: every rank passes its zig-zag shard (``zigzag_shard``): the sequence cut
  into ``2W`` equal chunks, rank ``r`` holding chunks ``r`` and ``2W - 1 - r``, so that every
  rank has the same causal work. k, v and index_k are all-gathered; selection and the sparse
  attention run for the rank's queries only, against every key (``msa_attention``'s query
  ranges, one per chunk); the backward reduce-scatters the key-side gradients to their owners.
  Needs ``S`` divisible by ``2W``; any head counts. Packed input is cut so as a whole by
  default (``packed_split="packing"``); ``packed_split="sequence"`` cuts each packed sequence
  into ``2W`` chunks instead, rank ``r`` holding chunks ``r`` and ``2W - 1 - r`` of every
  sequence, one after the other (Transformer Engine's and Megatron-core's THD layout; every
  sequence's length divisible by ``2W``; two query ranges per sequence; ``zigzag_shard_sequences``
  cuts a packing so).

Communication per layer and rank, forward (the backward moves the same again), in elements:

- head: ``(W - 1) / W * S / W * B * (2 * H * D + 2 * Hkv * D + Hi * Di)`` for the all-to-alls
  of q, out, k, v and index_q, plus ``(W - 1) * S / W * B * Hik * Di`` for the all-gather of
  index_k when ``Hik % W != 0``;
- sequence: ``(W - 1) / W * S * B * (2 * Hkv * D + Hik * Di)`` for the all-gathers of k, v and
  index_k.

The returned ``kl`` has the single-process value on every rank; its gradient on each rank is that
rank's share, so every rank adds ``kl_weight * kl`` to its loss, as it adds its own tokens' loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .ops.msa import msa_attention, sparse_attention

if dist.is_available():  # torch builds without distributed support still import openmsa
    # Imported with the module, not on first use: imported after init_process_group, it made
    # gloo processes abort at exit now and then.
    import torch.distributed.nn.functional as dist_fn

MODES = ("head", "sequence")
PACKED_SPLITS = ("packing", "sequence")


def _zigzag_part(x: torch.Tensor, rank: int, world: int, dim: int) -> torch.Tensor:
    """Chunks ``rank`` and ``2 * world - 1 - rank`` of ``2 * world`` equal chunks along ``dim``."""
    chunks = x.chunk(2 * world, dim)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim)


def _shard_part(x: torch.Tensor, rank: int, world: int, dim: int, zigzag: bool) -> torch.Tensor:
    return _zigzag_part(x, rank, world, dim) if zigzag else x.chunk(world, dim)[rank]


def zigzag_shard(x: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
    """This rank's zig-zag shard of ``x`` along ``dim``: of ``2W`` equal chunks (``W`` ranks in
    ``group``), chunks ``r`` and ``2W - 1 - r``, concatenated. Sequence mode takes its inputs so;
    shard tokens, labels and position ids the same way (``dim=1`` for ``[B, S, ...]``,
    ``dim=0`` for packed ``[T, ...]``)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[dim] % (2 * world):
        raise ValueError(f"x: expected a length along dim {dim} divisible by 2 * world size = "
                         f"{2 * world} (zig-zag chunks), received {x.shape[dim]}")
    return _zigzag_part(x, rank, world, dim)


def zigzag_shard_sequences(x: torch.Tensor, cu_seqlens: torch.Tensor, group=None,
                           dim: int = 0) -> torch.Tensor:
    """This rank's shard of packed ``x`` (the packing along ``dim``, ``cu_seqlens`` its offsets)
    for ``packed_split="sequence"``: chunks ``r`` and ``2W - 1 - r`` of each sequence's ``2W``
    equal chunks, one sequence after the other (Transformer Engine's and Megatron-core's THD
    layout). Shard tokens, labels and position ids the same way."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    lengths = _zigzag_sequence_lengths(cu_seqlens.tolist(), world)
    return torch.cat([_zigzag_part(sequence, rank, world, dim)
                      for sequence in x.split(lengths, dim)], dim)


def zigzag_unshard(shard: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
    """The whole tensor from every rank's ``zigzag_shard`` (an all-gather). Differentiable: the
    backward sums the ranks' gradients of the whole tensor and returns this rank's part."""
    if shard.shape[dim] % 2:
        raise ValueError(f"shard: expected an even length along dim {dim} (two zig-zag chunks), "
                         f"received {shard.shape[dim]}")
    return _GatherShards.apply(shard, group, dim, True)


def shard_sequence(x: torch.Tensor, group=None, mode: str = "head", dim: int = 1) -> torch.Tensor:
    """The shard of ``x`` (a whole sequence along ``dim``) that this rank passes in ``mode``:
    contiguous in head mode, zig-zag in sequence mode."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, received {mode!r}")
    if mode == "sequence":
        return zigzag_shard(x, group, dim)
    world = dist.get_world_size(group)
    if x.shape[dim] % world:
        raise ValueError(f"x: expected a length along dim {dim} divisible by the world size "
                         f"{world}, received {x.shape[dim]}")
    return x.chunk(world, dim)[dist.get_rank(group)]


class _GatherShards(torch.autograd.Function):
    """All-gather of the ranks' shards along ``dim`` into the whole sequence (shards contiguous
    in rank order, or zig-zag); the backward reduce-scatters: each rank gets the sum over the
    ranks of the gradient of its own shard."""

    @staticmethod
    def forward(ctx, shard, group, dim, zigzag):
        ctx.group, ctx.dim, ctx.zigzag = group, dim, zigzag
        shard = shard.contiguous()
        shards = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
        dist.all_gather(shards, shard, group=group)
        if not zigzag:
            return torch.cat(shards, dim)
        # Chunk c of 2W is rank c's first half for c < W, rank 2W - 1 - c's second half after.
        halves = [s.chunk(2, dim) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim)

    @staticmethod
    def backward(ctx, grad):
        world = dist.get_world_size(ctx.group)
        parts = [_shard_part(grad, rank, world, ctx.dim, ctx.zigzag).contiguous()
                 for rank in range(world)]
        own = torch.empty_like(parts[0])
        dist.reduce_scatter(own, parts, group=ctx.group)
        return own, None, None, None


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


def _global_kl(share: torch.Tensor, group) -> torch.Tensor:
    """The sum over the ranks of their ``share`` of the KL, as a value; the gradient of this
    rank's own share (the all-reduce runs without autograd)."""
    total = share.detach().clone()
    dist.all_reduce(total, group=group)
    return share + (total - share.detach())


def context_parallel_msa_attention(q, k, v, index_q, index_k, *, group=None, mode: str = "head",
                                   packed_split: str = "packing", **options):
    """MSA over a sequence split across ``group``. ``options`` are those of ``msa_attention``
    (``cu_seqlens`` describes the whole packing; ``block_indices`` and ``query_start`` are not
    supported).

    ``mode="head"``: inputs and ``out`` are this rank's contiguous shard ``[B, S / W, heads,
    dim]`` (packed ``[T / W, heads, dim]``), shards in rank order; needs ``Hkv % W == 0``.
    ``mode="sequence"``: inputs and ``out`` are this rank's zig-zag shard (``zigzag_shard``),
    same shapes; needs ``S`` (packed: ``T``) divisible by ``2W``. With ``return_indices=True`` it
    also returns kept block ids: in sequence mode those of the rank's queries,
    ``[B, Hi, S / W, top_k]`` (packed ``[Hi, T / W, top_k]``) in the shard's token order; in head
    mode those of the rank's index heads over the whole sequence, ``[B, Hi / W, S, top_k]``
    (packed ``[Hi / W, T, top_k]``). ``context_parallel_sparse_attention`` takes either back
    (layers sharing a selection, SPEC section 9).

    ``packed_split`` (sequence mode, packed input): ``"packing"`` (the whole packing in ``2W``
    chunks) or ``"sequence"`` (each sequence in ``2W`` chunks, the THD layout of Transformer
    Engine and Megatron-core; ``cu_seqlens`` describes the whole packing, its values read on
    the host).

    Returns ``(out, kl)`` (``(out, kl, indices)`` with ``return_indices``)."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, received {mode!r}")
    _check_packed_split(packed_split, mode, options)
    if not dist.is_initialized():
        raise ValueError("group: expected an initialized torch.distributed process group, "
                         "received none (call torch.distributed.init_process_group first)")
    for name in ("block_indices", "query_start", "kl_num_queries"):
        if options.get(name) is not None:
            raise ValueError(f"{name}: expected None (not supported with context parallelism), "
                             f"received {type(options[name]).__name__}")
    packed = options.get("cu_seqlens") is not None
    rank_of_inputs = 3 if packed else 4
    layout = "[T / W, heads, dim] (with cu_seqlens)" if packed else "[B, S / W, heads, dim]"
    inputs = {"q": q, "k": k, "v": v, "index_q": index_q, "index_k": index_k}
    for name, tensor in inputs.items():
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != rank_of_inputs:
            raise ValueError(f"{name}: expected a {rank_of_inputs}-D {layout} sequence shard, "
                             f"received {getattr(tensor, 'shape', type(tensor).__name__)}")
        if tensor.shape[:-2] != q.shape[:-2]:
            raise ValueError(f"{name}: expected leading dimensions {tuple(q.shape[:-2])} (those "
                             f"of q: every input holds the same tokens), received "
                             f"{tuple(tensor.shape[:-2])}")
    if mode == "head":
        return _head_parallel(q, k, v, index_q, index_k, group, packed, options)
    if packed_split == "sequence":
        return _per_sequence_parallel(q, k, v, index_q, index_k, group, options)
    return _sequence_parallel(q, k, v, index_q, index_k, group, packed, options)


def _head_parallel(q, k, v, index_q, index_k, group, packed, options):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if packed:  # one packed row: [1, T / W, heads, dim]; cu_seqlens covers the whole packing
        q, k, v, index_q, index_k = (t[None] for t in (q, k, v, index_q, index_k))
    num_kv_heads, num_index_heads = k.shape[2], index_q.shape[2]
    num_index_kv_heads = index_k.shape[2]
    _check_kv_heads_split(k, world)
    if num_index_heads % num_kv_heads:
        raise ValueError(f"index_q: expected a multiple of the {num_kv_heads} KV heads, "
                         f"received {num_index_heads}")

    q_heads, k_heads, v_heads, iq_heads = (_sequence_to_heads(t, group)
                                           for t in (q, k, v, index_q))
    if num_index_kv_heads % world == 0:
        ik_heads = _sequence_to_heads(index_k, group)
    else:  # shared index key heads: every rank takes the ones its index heads read
        full = _GatherShards.apply(index_k, group, 1, False)
        per_key_head = num_index_heads // num_index_kv_heads
        local = num_index_heads // world
        first, last = rank * local // per_key_head, ((rank + 1) * local - 1) // per_key_head
        ik_heads = full[:, :, first:last + 1]
    if packed:  # msa_attention takes packed input as [T, heads, dim]
        q_heads, k_heads, v_heads, iq_heads, ik_heads = (
            t[0] for t in (q_heads, k_heads, v_heads, iq_heads, ik_heads))
    out, kl, *indices = msa_attention(q_heads, k_heads, v_heads, iq_heads, ik_heads, **options)
    if packed:
        out = out[None]
    # Each rank's KL is a mean over its index heads, a 1 / W share of them.
    kl = _global_kl(kl / world, group)
    out = _heads_to_sequence(out, group)
    return ((out[0] if packed else out), kl, *indices)


def _check_kv_heads_split(k, world: int) -> None:
    """Head-parallel mode splits whole GQA groups: k ``[B, S, Hkv, D]``."""
    if k.shape[2] % world:
        raise ValueError(f"k: expected a number of KV heads divisible by the world size {world} "
                         f"(head-parallel mode splits whole GQA groups), received {k.shape[2]}")


def _zigzag_chunks(q, dim: int, world: int, rank: int):
    """A zig-zag shard's two chunks: their length and the first token of each in the whole
    sequence (or packing)."""
    local = q.shape[dim]
    if local % 2:
        raise ValueError(f"q: expected a shard of an even number of tokens (the {world} ranks' "
                         f"{world * local} tokens cut into 2 * {world} equal zig-zag chunks), "
                         f"received {local}")
    chunk = local // 2
    return chunk, (rank * chunk, (2 * world - 1 - rank) * chunk)


def _check_packed_split(packed_split, mode: str, options: dict) -> None:
    if packed_split not in PACKED_SPLITS:
        raise ValueError(f"packed_split: expected one of {PACKED_SPLITS}, received "
                         f"{packed_split!r}")
    if packed_split == "sequence" and (mode != "sequence" or options.get("cu_seqlens") is None):
        raise ValueError("packed_split: expected 'packing' unless mode='sequence' with "
                         "cu_seqlens (it splits packed sequences), received 'sequence'")


def _zigzag_sequence_lengths(offsets: list[int], world: int) -> list[int]:
    """The packed sequences' lengths, each of which the per-sequence zig-zag layout cuts into
    ``2 * world`` equal chunks."""
    lengths = [end - start for start, end in zip(offsets, offsets[1:])]
    if any(length % (2 * world) for length in lengths):
        raise ValueError(f"cu_seqlens: expected every sequence's length divisible by 2 * world "
                         f"size = {2 * world} (each is cut into zig-zag chunks), received "
                         f"lengths {lengths}")
    return lengths


def _per_sequence_chunks(cu_seqlens: torch.Tensor, world: int, rank: int):
    """The per-sequence zig-zag layout of a packing (``packed_split="sequence"``): the packed
    tokens' order as the ranks' shards concatenated in rank order (an index into them), and
    this rank's chunks as (first token in its shard, first token in the packing, length)."""
    offsets = cu_seqlens.tolist()
    lengths = _zigzag_sequence_lengths(offsets, world)
    shard_tokens = offsets[-1] // world
    pieces, own = [], []
    local = 0  # a sequence's first token in every rank's shard
    for start, length in zip(offsets, lengths):
        chunk = length // (2 * world)
        for c in range(2 * world):
            owner, second = (c, 0) if c < world else (2 * world - 1 - c, 1)
            first = owner * shard_tokens + local + second * chunk
            pieces.append(torch.arange(first, first + chunk))  # on the host: one copy below
        own += [(local, start + rank * chunk, chunk),
                (local + chunk, start + (2 * world - 1 - rank) * chunk, chunk)]
        local += 2 * chunk
    order = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)
    return order.to(cu_seqlens.device), own


def _per_sequence_keys(tensors, group, order):
    """The packing's k, v, index_k from every rank's per-sequence zig-zag shard (differentiable:
    the backward reduce-scatters the gradients to their owners)."""
    return [_GatherShards.apply(t, group, 0, False).index_select(0, order) for t in tensors]


def _ranges_msa(q, index_q, k, v, index_k, ranges, kl_num_queries: int, options):
    """``msa_attention`` for the queries of each range (first token in q, first token in the
    sequence or packing, length; q's tokens along dim -3) against every key: their outputs in
    q's order, this rank's share of the KL, and their kept ids (None without)."""
    outs, ids, kl = [], [], 0
    for local, start, length in ranges:
        part = (..., slice(local, local + length), slice(None), slice(None))
        out, kl_part, *kept = msa_attention(q[part], k, v, index_q[part], index_k,
                                            query_start=start, kl_num_queries=kl_num_queries,
                                            **options)
        outs.append(out)
        ids += kept  # [Hi, length, top_k], or [1, Hi, length, top_k] for a batch row
        kl = kl + kl_part  # this rank's share: its queries' terms over the global count
    return torch.cat(outs, dim=-3), kl, torch.cat(ids, dim=-2) if ids else None


def _ranges_sparse(q, k, v, block_indices, ranges, options):
    """``sparse_attention`` for the queries of each range (as ``_ranges_msa``'s) over their
    rows of ``block_indices`` (None in warmup)."""
    return torch.cat([sparse_attention(
        q[..., local:local + length, :, :], k, v,
        None if block_indices is None else block_indices[..., local:local + length, :],
        query_start=start, **options) for local, start, length in ranges], dim=-3)


def _per_sequence_parallel(q, k, v, index_q, index_k, group, options):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    order, own = _per_sequence_chunks(options["cu_seqlens"], world, rank)
    keys = _per_sequence_keys((k, v, index_k), group, order)
    out, kl, ids = _ranges_msa(q, index_q, *keys, own, order.numel(), options)
    kl = _global_kl(kl, group)
    return (out, kl) if ids is None else (out, kl, ids)


def _sequence_parallel(q, k, v, index_q, index_k, group, packed, options):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    dim = 0 if packed else 1  # the sequence dim
    chunk, starts = _zigzag_chunks(q, dim, world, rank)
    ranges = [(half * chunk, start, chunk) for half, start in enumerate(starts)]
    keys = [zigzag_unshard(t, group, dim) for t in (k, v, index_k)]
    total = world * q.shape[dim]
    # Query ranges run on one packing, or on one sequence (a batch of one): row by row.
    rows = [(q, index_q, *keys)] if packed else [
        (q[b, None], index_q[b, None], *(t[b, None] for t in keys)) for b in range(q.shape[0])]
    outs, indices, kl = [], [], 0
    for row_q, row_iq, row_k, row_v, row_ik in rows:
        out, kl_part, ids = _ranges_msa(row_q, row_iq, row_k, row_v, row_ik, ranges,
                                        len(rows) * total, options)
        outs.append(out)
        kl = kl + kl_part
        if ids is not None:
            indices.append(ids)
    out, kl = torch.cat(outs), _global_kl(kl, group)
    return (out, kl, torch.cat(indices)) if indices else (out, kl)


def context_parallel_sparse_attention(q, k, v, block_indices, *, group=None, mode: str = "head",
                                      packed_split: str = "packing", **options):
    """``sparse_attention`` over a sequence split across ``group`` (inputs and ``out`` as
    ``context_parallel_msa_attention``'s): a layer sharing the selection of a layer that ran
    ``context_parallel_msa_attention`` in the same mode takes its ``block_indices`` as returned
    there (``None`` with ``warmup=True``). ``options`` are ``sparse_attention``'s
    (``cu_seqlens`` describes the whole packing; ``num_index_heads`` in warmup counts all
    ranks' index heads; ``packed_split`` as there)."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, received {mode!r}")
    _check_packed_split(packed_split, mode, options)
    if not dist.is_initialized():
        raise ValueError("group: expected an initialized torch.distributed process group, "
                         "received none (call torch.distributed.init_process_group first)")
    if options.get("query_start") is not None:
        raise ValueError("query_start: expected None (context parallelism sets the ranges), "
                         f"received {options['query_start']}")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    packed = options.get("cu_seqlens") is not None
    if mode == "head":
        if packed:
            q, k, v = (t[None] for t in (q, k, v))
        _check_kv_heads_split(k, world)
        q_heads, k_heads, v_heads = (_sequence_to_heads(t, group) for t in (q, k, v))
        if packed:
            q_heads, k_heads, v_heads = (t[0] for t in (q_heads, k_heads, v_heads))
        if options.get("warmup"):
            options = dict(options)
            heads = options.pop("num_index_heads", None) or k.shape[2]
            options["num_index_heads"] = heads // world
        out = sparse_attention(q_heads, k_heads, v_heads, block_indices, **options)
        out = _heads_to_sequence(out[None] if packed else out, group)
        return out[0] if packed else out
    if packed_split == "sequence":
        order, own = _per_sequence_chunks(options["cu_seqlens"], world, rank)
        keys = _per_sequence_keys((k, v), group, order)
        return _ranges_sparse(q, *keys, block_indices, own, options)
    dim = 0 if packed else 1
    chunk, starts = _zigzag_chunks(q, dim, world, rank)
    ranges = [(half * chunk, start, chunk) for half, start in enumerate(starts)]
    keys = [zigzag_unshard(t, group, dim) for t in (k, v)]
    if packed:
        return _ranges_sparse(q, *keys, block_indices, ranges, options)
    return torch.cat([_ranges_sparse(
        q[b, None], *(t[b, None] for t in keys),
        None if block_indices is None else block_indices[b, None], ranges, options)
        for b in range(q.shape[0])])
