"""FLOP counts behind every TFLOP/s figure openmsa reports (matmul FLOPs only).

- Dense causal attention: ``4 * H * D`` per causal (query, key) pair (QK^T and PV, 2 FLOPs per
  multiply-add), ``S * (S + 1) / 2`` pairs per sequence; the backward counts 2.5x the forward.
- MSA main attention: ``4 * D`` per kept (query, key, main head) triple; backward 2.5x.
- MSA index scoring: ``2 * Hi * Di`` per causal (query, key) pair.
"""

from __future__ import annotations

import torch

BACKWARD_FACTOR = 2.5


def causal_pairs(seqlen: int) -> int:
    return seqlen * (seqlen + 1) // 2


def dense_attention_flops(seqlen: int, num_heads: int, head_dim: int) -> float:
    return 4.0 * num_heads * head_dim * causal_pairs(seqlen)


def index_scoring_flops(seqlen: int, num_index_heads: int, index_head_dim: int) -> float:
    return 2.0 * num_index_heads * index_head_dim * causal_pairs(seqlen)


def kept_triples(block_ids: torch.Tensor, block_size: int, heads_per_index_head: int) -> int:
    """Kept (query, key, main head) triples of one sequence from its kept block ids
    ``[S, Hi, k]`` (-1 unused): a kept block before the query's own counts ``block_size`` keys,
    the own block the keys up to the query."""
    seqlen = block_ids.shape[0]
    position = torch.arange(seqlen, device=block_ids.device)[:, None, None]
    keys = torch.clamp(position - block_ids.long() * block_size + 1, max=block_size)
    keys = torch.where(block_ids >= 0, keys, 0)
    return int(keys.sum()) * heads_per_index_head


def max_kept_triples(seqlen: int, num_heads: int, top_k: int, block_size: int) -> int:
    """The kept triples when every query keeps ``top_k`` blocks (or all it can see): each query
    keeps its own block's keys up to itself plus ``top_k - 1`` full earlier blocks."""
    total = 0
    for block in range(-(-seqlen // block_size)):
        first, last = block * block_size, min(seqlen, (block + 1) * block_size)
        earlier = min(block, top_k - 1) * block_size
        own = sum(range(1, last - first + 1))  # query at offset o sees o + 1 own keys
        total += own + earlier * (last - first)
    return total * num_heads


def main_attention_flops(triples: int, head_dim: int) -> float:
    return 4.0 * head_dim * triples


def tflops(flops: float, milliseconds: float) -> float:
    return flops / milliseconds / 1e9
