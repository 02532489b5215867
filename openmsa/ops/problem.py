"""The description of one sparse-attention problem that the forward and the backward share:
shapes, scales, tile shapes and the device-built work lists.

Queries are packed tokens ``[Tq, ...]``, the packed tokens ``[query_start, query_start + Tq)``
of the keys' packing ``[T, ...]`` and ``cu_seqlens`` (all of them by default). Log-sum-exps
are kept in base 2 of the scaled scores (``lse2 = log2 sum 2^(c * log2(e) * q.k)``), so
``P = 2^(c * log2(e) * q.k - lse2)``; the natural-log LSE is ``lse2 * ln 2``.
"""

from __future__ import annotations

import functools
import math

import torch
import triton

from .configs import DEFAULT_TUNING, INDEX_TILE_TOKENS, QUERY_ROWS, Tuning
from .worklists import (MAX_TILE_TOKENS, BlockWork, QueryTileWork, build_block_work,
                        build_causal_block_work, build_query_tile_work)

LOG2_E = math.log2(math.e)


@functools.lru_cache(maxsize=None)
def _cuda_multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def multiprocessors(device: torch.device) -> int:
    """The SM count of a CUDA device (1 elsewhere): the work lists' sizes depend on it."""
    if device.type != "cuda":
        return 1
    return _cuda_multiprocessors(torch.cuda.current_device() if device.index is None
                                 else device.index)


def segment_pairs(tuning: Tuning, num_queries: int, num_heads: int, num_index_heads: int,
                  slots: int, device: torch.device) -> int:
    """Pairs per key-outer segment of a problem (``Tuning.segment_pairs_for``), from its shapes
    and device alone: the forward's lists and the backward's reading of them agree."""
    return tuning.segment_pairs_for(num_queries, num_index_heads, slots,
                                    num_heads // num_index_heads, multiprocessors(device))


def _precision(tensor) -> str:
    """fp32 inputs keep full precision in the MMAs (no TF32); 16-bit inputs are exact anyway."""
    return "ieee" if tensor.dtype == torch.float32 else "tf32"


def query_tile_shape(gq: int) -> tuple[int, int, int]:
    """(tokens, padded heads, MMA rows) of the query-outer kernels' tiles."""
    return _tile_shape(gq, QUERY_ROWS)


def _tile_shape(gq: int, target_rows: int) -> tuple[int, int, int]:
    """(tokens per tile, padded heads, MMA rows) for ``gq`` heads per token: a power-of-two
    token count with about ``target_rows`` rows, and at least 16 rows; at most
    MAX_TILE_TOKENS tokens (the bits of a block's members mask)."""
    heads = triton.next_power_of_2(gq)
    tokens = max(1, target_rows // heads)
    tokens = 1 << (tokens.bit_length() - 1)
    tokens = min(max(tokens, 16 // min(heads, 16)), MAX_TILE_TOKENS)
    return tokens, heads, heads * tokens


class SparseAttentionProblem:
    """Shapes, constants and device-built work lists shared by the forward and the backward.

    ``index_k``, ``index_scale`` (None: main attention only, no KL) describe the index branch.
    The queries (q and the query-side tensors, ``[Tq, ...]``) are the packed tokens
    ``[query_start, query_start + Tq)`` of the packing of k (``[T, ...]``) and ``cu_seqlens``;
    by default all of them. The KL is a mean over ``kl_num_queries`` query tokens (default Tq).
    ``all_causal``: ``block_ids`` keep every causal block (warmup), so the key-block list is
    built directly, without sorting them.
    """

    def __init__(self, q, k, block_ids, cu_seqlens, block_size, softmax_scale, index_k=None,
                 index_scale=None, query_rows=QUERY_ROWS, key_rows=64,
                 query_work: QueryTileWork | None = None, block_work: BlockWork | None = None,
                 query_start: int = 0, kl_num_queries: int | None = None,
                 all_causal: bool = False, tuning: Tuning = DEFAULT_TUNING):
        self.total, self.num_heads, self.head_dim = q.shape
        self.num_keys, self.num_kv_heads = k.shape[0], k.shape[1]
        self.query_start = query_start
        self.kl_num_queries = self.total if kl_num_queries is None else kl_num_queries
        self.num_index_heads, self.top_k = block_ids.shape[1], block_ids.shape[2]
        self.gq = self.num_heads // self.num_index_heads
        self.with_index = index_k is not None
        self.index_dim = index_k.shape[2] if self.with_index else 16
        self.index_group = self.num_index_heads // index_k.shape[1] if self.with_index else 1
        self.index_scale = index_scale if self.with_index else 0.0
        self.block_size = block_size
        self.scale = softmax_scale
        self.block_ids = block_ids
        self.cu_seqlens = cu_seqlens
        self.query_tokens, gq_pad, self.query_rows = _tile_shape(self.gq, query_rows)
        self.key_tokens, _, self.key_rows = _tile_shape(self.gq, key_rows)
        # Given when the forward built it already (the custom operator's backward).
        self.query_work: QueryTileWork = query_work or build_query_tile_work(
            block_ids, cu_seqlens, self.query_tokens, query_start)
        self.shared = dict(HI=self.num_index_heads, GQ=self.gq, GQ_PAD=gq_pad,
                           KV_GROUP=self.num_index_heads // self.num_kv_heads,
                           INDEX_GROUP=self.index_group, BLOCK=block_size,
                           HEAD_DIM=self.head_dim, INDEX_DIM=self.index_dim,
                           PRECISION=_precision(q))
        self.all_causal = all_causal
        self.tuning = tuning
        if block_work is not None:  # given when the forward built it already
            self.block_work = block_work

    def union_bound(self, work: QueryTileWork) -> int:
        """The most blocks a tile's union of ``work`` can hold, known on the host: the union's
        width, and no more than the key blocks of the keys' whole packing (a sequence holds at
        most ceil(T / block_size)). A walk limit at least this large leaves no tile."""
        return min(work.union.shape[-1], triton.cdiv(self.num_keys, self.block_size))

    @functools.cached_property
    def index_tile_work(self) -> QueryTileWork:
        """The index log-sum-exp's walk lists when it runs alone (``index_log_sum_exp``): tiles
        of INDEX_TILE_TOKENS tokens, or the main tiles when those are as wide."""
        if self.query_tokens >= INDEX_TILE_TOKENS:
            return self.query_work
        return build_query_tile_work(self.block_ids, self.cu_seqlens, INDEX_TILE_TOKENS,
                                     self.query_start)

    @functools.cached_property
    def block_work(self) -> BlockWork:
        """The key-block -> queries list (dK/dV and the KL): built on first use."""
        pairs = self.segment_pairs()
        if self.all_causal:
            return build_causal_block_work(self.cu_seqlens, self.total, self.num_index_heads,
                                           self.block_size, self.top_k, pairs,
                                           self.query_start, self.num_keys, "head_rows")
        return build_block_work(self.block_ids, self.cu_seqlens, self.block_size, pairs,
                                self.query_start, self.num_keys,
                                self._top_k_segment_order(pairs))

    def block_work_of_rows(self, rows: torch.Tensor) -> BlockWork:
        """The key-block -> queries list of the pairs of the (query row, index head)s set in
        ``rows`` ([Tq, Hi], bool or int) alone, each pair with its slot: the key-outer passes
        over the rows the query-outer walks leave."""
        pairs = self.segment_pairs()
        return build_block_work(torch.where(rows[:, :, None] != 0, self.block_ids, -1),
                                self.cu_seqlens, self.block_size, pairs, self.query_start,
                                self.num_keys, self._top_k_segment_order(pairs),
                                with_slots=True)

    def segment_pairs(self) -> int:
        """Pairs per segment of this problem's key-block lists."""
        return segment_pairs(self.tuning, self.total, self.num_heads, self.num_index_heads,
                             self.top_k, self.block_ids.device)

    def _top_k_segment_order(self, pairs_per_segment: int) -> str:
        """``build_block_work``'s segment order for this problem's size on its device."""
        sms = multiprocessors(self.block_ids.device)
        pairs = self.total * self.num_index_heads * self.top_k
        threshold = self.tuning.rows_order_min_segments_per_sm * pairs_per_segment * sms
        return "rows" if pairs >= threshold else "pairs"

    def query_constants(self):
        return dict(self.shared, TOK=self.query_tokens, TOKP=max(16, self.query_tokens),
                    ROWS=self.query_rows, UNION_SLOTS=self.query_work.union.shape[-1])

    def key_constants(self, tokens, rows):
        return dict(self.shared, TOK=tokens, TOKP=max(16, tokens), ROWS=rows,
                    SEGMENT_PAIRS=self.block_work.segment_pairs)

    def kl_constants(self, pairs):
        shared = {name: self.shared[name] for name in ("HI", "GQ", "KV_GROUP", "INDEX_GROUP",
                                                       "BLOCK", "HEAD_DIM", "INDEX_DIM",
                                                       "PRECISION")}
        return dict(shared, PAIRS=pairs, SEGMENT_PAIRS=self.block_work.segment_pairs)

    def query_grid(self):
        return (self.query_work.schedule.shape[0], self.num_index_heads)

    def query_work_args(self):
        work = self.query_work
        return (work.schedule, work.union, work.union_members, work.union_count,
                self.cu_seqlens, self.query_start, self.query_start + self.total)

    def key_work_args(self):
        work = self.block_work
        return (work.segments, work.segment_order, work.pair_token, work.bucket_start,
                work.bucket_count, work.block_sequence, work.block_local, self.cu_seqlens,
                self.query_start)

    def kl_mean(self, kl_parts):
        """The KL from its terms summed in parts (per (token, index head) or per key-outer
        program): their sum over Nq * Hi, with Nq = ``kl_num_queries``."""
        return kl_parts.sum() / (self.kl_num_queries * self.num_index_heads)

    def kl_gradient_scale(self) -> float:
        """d kl / d z = (s - t) * kl_grad * this, kl_grad being the gradient reaching kl: 1 /
        (Nq * Hi), times the index scale for the chain rule through
        z = index_scale * index_q . index_k."""
        return self.index_scale / (self.kl_num_queries * self.num_index_heads)
