"""Which of a step's long-walk routes have work, read on the host once per pass.

The key-outer forward and dQ (``Tuning.main_walk_limit_per_slot``) and the index log-sum-exp
split (``Tuning.index_lse_split``) take the query tiles whose unions hold more blocks than a
limit. Whether any tile does is known on the device alone, after the work lists; without that
knowledge every route launches its list builds, flag passes and combines, which then find
nothing to do (0.6 ms of a 25 ms step at 32k, 2.5 ms at 128k on coherent selections). So where
a route is configured, ``long_walks`` reads, in one synchronization, whether any tile passes
each limit, and a route with no such tile is not run: its tiles walk as the default's do, with
the default's kernels. While a CUDA graph is captured nothing can be read, so every configured
route runs (its kernels decide on the device, as before).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..configs import INDEX_WALK_LIMIT_PER_SLOT
from ..problem import SparseAttentionProblem


@dataclass(frozen=True)
class LongWalks:
    """Whether the main walk limit (``main``) and the index walk limit (``index``) leave any
    tile to their key-outer routes; each False also where its route is not configured."""

    main: bool
    index: bool


def configured_walk_limit(p: SparseAttentionProblem) -> int:
    """The most blocks a query tile's walk (forward and dQ) takes before its rows go key-outer,
    as the tuning and the shapes set it; 0: every tile walks (warmup keeps every causal block,
    so its tiles never go; nor where no union can pass the limit: short sequences)."""
    per_slot = p.tuning.main_walk_limit_per_slot
    if per_slot <= 0 or p.all_causal:
        return 0
    limit = max(1, int(per_slot * p.top_k))
    return limit if limit < p.union_bound(p.query_work) else 0


def configured_index_walk_limit(p: SparseAttentionProblem) -> int:
    """The most blocks an index log-sum-exp tile walks under ``Tuning.index_lse_split``; 0:
    the split is off, or no tile's union can pass the limit."""
    if not (p.tuning.index_lse_split and p.with_index) or p.all_causal:
        return 0
    limit = INDEX_WALK_LIMIT_PER_SLOT * p.top_k
    return limit if limit < p.union_bound(p.index_tile_work) else 0


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def long_walks(p: SparseAttentionProblem) -> LongWalks:
    """Whether any tile passes the configured walk limits, for this problem's work lists:
    computed once per problem (one host synchronization where a limit is configured, none
    otherwise); while a CUDA graph is captured, every configured route counts as having work."""
    cached = p.host_cache.get("long_walks")
    if cached is not None:
        return cached
    main_limit, index_limit = configured_walk_limit(p), configured_index_walk_limit(p)
    if not (main_limit or index_limit) or _capturing(p.block_ids.device):
        walks = LongWalks(main=main_limit > 0, index=index_limit > 0)
    else:
        checks = [(work.union_count > limit).any()
                  for work, limit in ((p.query_work, main_limit),
                                      (p.index_tile_work, index_limit)) if limit]
        passed = iter(torch.stack(checks).tolist())
        walks = LongWalks(main=bool(main_limit) and next(passed),
                          index=bool(index_limit) and next(passed))
    p.host_cache["long_walks"] = walks
    return walks
