"""Benchmark index inputs of three selection kinds, and the statistics that tell them apart.

A kernel whose cost follows how alike neighbouring tokens' kept blocks are can look fast on one
kind of input and slow on another, so every speed figure is given for all three kinds, with the
measured statistics next to it:

- "coherent": a slow random walk of index queries, as a trained index branch behaves
  (neighbours' Jaccard about 0.98);
- "mid": the walk mixed with fresh per-token directions (Jaccard about 0.5);
- "random": independent queries (neighbours share little beyond the forced own block).
"""

from __future__ import annotations

import math

import torch

SELECTION_KINDS = ("coherent", "mid", "random")
# "mid": the angle between a query and its walk, for a neighbours' Jaccard of about 0.5 at Hi 4,
# Di 128, top 16 of 128-token blocks (measured on the H200's selections: 0.61 at 32k, 0.49 at
# 128k, 0.44 at 1M; coherent 0.98-0.99, random 0.19, 0.08 and 0.04; docs/BENCHMARKS.md).
MID_ANGLE = 0.06 * math.pi
UNION_TOKENS = 8  # the union statistic: distinct blocks kept by this many consecutive tokens


def index_inputs(kind: str, seqlen: int, num_index_heads: int, head_dim: int, generator,
                 device="cuda"):
    """bf16 index_q ``[S, Hi, Di]`` and index_k ``[S, 1, Di]`` of one selection ``kind``."""
    if kind not in SELECTION_KINDS:
        raise ValueError(f"kind: expected one of {SELECTION_KINDS}, received {kind!r}")
    index_k = torch.randn(seqlen, 1, head_dim, device=device, generator=generator)
    shape = (seqlen, num_index_heads, head_dim)
    if kind == "random":
        index_q = torch.randn(shape, device=device, generator=generator)
        return index_q.bfloat16(), index_k.bfloat16()
    steps = torch.randn(shape, device=device, generator=generator)
    walk = torch.cumsum(steps * 0.05, dim=0) + torch.randn(1, num_index_heads, head_dim,
                                                           device=device, generator=generator)
    index_q = walk / walk.norm(dim=-1, keepdim=True)
    if kind == "mid":
        fresh = torch.randn(shape, device=device, generator=generator)
        fresh = fresh - (fresh * index_q).sum(-1, keepdim=True) * index_q  # orthogonal part
        fresh = fresh / fresh.norm(dim=-1, keepdim=True)
        index_q = math.cos(MID_ANGLE) * index_q + math.sin(MID_ANGLE) * fresh
    return (index_q * head_dim ** 0.5).bfloat16(), index_k.bfloat16()


def selection_statistics(block_ids: torch.Tensor) -> dict:
    """Neighbours' Jaccard and union size of kept block ids ``[S, Hi, k]`` (-1 unused) of one
    sequence: ``jaccard``, the mean over tokens and index heads of |A & B| / |A | B| for the
    kept sets A, B of consecutive tokens; ``union_8``, the mean number of distinct blocks kept
    by ``UNION_TOKENS`` consecutive tokens (aligned groups) of one index head."""
    seqlen, heads, slots = block_ids.shape
    ids = block_ids.long()
    num_blocks = int(ids.max()) + 2  # column num_blocks - 1 collects the unused slots
    ids = torch.where(ids < 0, num_blocks - 1, ids)
    # Per token a bitmap of kept blocks, chunked over tokens to bound memory at 1M tokens.
    jaccard_sum, pairs = 0.0, 0
    union_sum, groups = 0.0, 0
    chunk = max(UNION_TOKENS, (1 << 26) // (heads * num_blocks)) // UNION_TOKENS * UNION_TOKENS
    previous = None
    for start in range(0, seqlen, chunk):
        part = ids[start:start + chunk]
        kept = torch.zeros(part.shape[0], heads, num_blocks, dtype=torch.bool, device=ids.device)
        kept.scatter_(2, part, True)
        kept = kept[..., :-1]
        rows = kept if previous is None else torch.cat([previous, kept])
        shared = (rows[1:] & rows[:-1]).sum(-1).float()
        either = (rows[1:] | rows[:-1]).sum(-1).float()
        jaccard_sum += float((shared / either.clamp_min(1)).sum())
        pairs += shared.numel()
        previous = kept[-1:]
        full = kept.shape[0] // UNION_TOKENS * UNION_TOKENS
        if full:
            grouped = kept[:full].view(-1, UNION_TOKENS, heads, num_blocks - 1).any(dim=1)
            union_sum += float(grouped.sum())
            groups += grouped.shape[0] * heads
    return dict(jaccard=jaccard_sum / pairs if pairs else 1.0,
                union_8=union_sum / groups if groups else float("nan"))
