"""The key-outer kernels' work lists (dK/dV, the KL): for each key block of each index head,
the (token, index head) pairs that kept it, in token order (a key-block -> queries CSR), cut
into segments of at most ``segment_pairs`` pairs, one program each.

Selection gives every (token, index head) ``top_k`` block ids. The queries may be a range of
the keys' packing (``query_start``, for context parallelism): the lists name queries by their
row in the ids (packed token - query_start) and keys by their packed token. Every size that
reaches the host is an upper bound known from the shapes alone, so nothing waits for the GPU.
On a GPU Triton kernels build the lists around one radix sort; on the CPU torch operations do,
and the tests check that both give the same lists.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..configs import RANK_CHUNK, RANK_MAX_SEGMENTS, RANK_OTHERS


@dataclass
class BlockWork:
    """Pairs ``(token, index head)`` with a kept block, grouped by bucket, and the buckets cut
    into segments of at most ``segment_pairs`` pairs (one backward program each, so a block kept
    by very many queries is shared by several programs).

    A bucket is ``(global block, index head)`` with ``global block = first block of the token's
    sequence + block id``; buckets are numbered ``global_block * Hi + index_head``, so the buckets
    (and segments) of one KV head's index heads are contiguous.
    """

    pair_token: torch.Tensor  # int32 [P]: query row of each pair, sorted by bucket then row
    bucket_start: torch.Tensor  # int32 [NB * Hi]: first pair of each bucket
    bucket_count: torch.Tensor  # int32 [NB * Hi]: pairs in each bucket
    bucket_segments_end: torch.Tensor  # int32 [NB * Hi]: segments of buckets 0..b (inclusive)
    block_sequence: torch.Tensor  # int32 [NB]: sequence of each global block (-1: padding)
    block_local: torch.Tensor  # int32 [NB]: block index within its sequence
    segments: torch.Tensor  # int32 [num_segments, 2]: (bucket, first pair); bucket -1 = padding
    segment_order: torch.Tensor  # int32 [num_segments]: the order programs take the segments
    num_global_blocks: int  # NB, an upper bound (padding blocks have sequence -1)
    segment_pairs: int
    flat: torch.Tensor | None = None  # the storage all of the above are views of, if one
    # int32 [P]: each pair's slot (its block's position in the row's ids), where asked for
    # (``build_block_work(with_slots=True)``); not part of ``packed``.
    pair_slot: torch.Tensor | None = None

    def packed(self) -> torch.Tensor:
        """The lists as one flat int32 tensor (a custom operator's output)."""
        if self.flat is not None:
            return self.flat
        return torch.cat([self.pair_token, self.bucket_start, self.bucket_count,
                          self.bucket_segments_end, self.block_sequence, self.block_local,
                          self.segments.flatten(), self.segment_order])

    @staticmethod
    def unpacked(flat: torch.Tensor, num_pairs: int, num_global_blocks: int, num_segments: int,
                 num_index_heads: int, segment_pairs: int) -> "BlockWork":
        """``packed``'s inverse; the sizes are ``block_work_sizes``'."""
        buckets = num_global_blocks * num_index_heads
        parts = flat.split([num_pairs, buckets, buckets, buckets, num_global_blocks,
                            num_global_blocks, 2 * num_segments, num_segments])
        return BlockWork(*parts[:6], segments=parts[6].view(num_segments, 2),
                         segment_order=parts[7], num_global_blocks=num_global_blocks,
                         segment_pairs=segment_pairs, flat=flat)


def sequence_of_tokens(cu_seqlens: torch.Tensor, num_tokens: int,
                       first_token: int = 0) -> torch.Tensor:
    """int64 [num_tokens]: the sequence of each packed token from ``first_token`` on."""
    tokens = torch.arange(first_token, first_token + num_tokens, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].long(), tokens, right=True)


def block_work_sizes(num_queries: int, num_index_heads: int, slots: int, num_keys: int,
                     num_sequences: int, block_size: int, segment_pairs: int):
    """(pairs, global blocks, segments) of ``build_block_work``'s lists, from shapes alone: the
    number of pair entries and upper bounds on the blocks and segments."""
    num_pairs = num_queries * num_index_heads * slots
    num_global_blocks = num_keys // block_size + num_sequences
    num_segments = num_pairs // segment_pairs + num_global_blocks * num_index_heads
    return num_pairs, num_global_blocks, num_segments


def _global_blocks(cu_seqlens: torch.Tensor, block_size: int, num_global_blocks: int):
    """Each sequence's first global block, and each global block's sequence (-1: padding) and
    block index within it (int64)."""
    num_sequences = cu_seqlens.numel() - 1
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    blocks_per_sequence = (lengths + block_size - 1) // block_size
    first_block = torch.cumsum(blocks_per_sequence, 0) - blocks_per_sequence
    global_block = torch.arange(num_global_blocks, device=cu_seqlens.device)
    block_sequence = torch.searchsorted(torch.cumsum(blocks_per_sequence, 0), global_block,
                                        right=True)
    padding_block = block_sequence >= num_sequences
    block_sequence = torch.where(padding_block, 0, block_sequence)
    block_local = global_block - first_block[block_sequence]
    return first_block, torch.where(padding_block, -1, block_sequence), block_local


def _checked_sizes(cu_seqlens: torch.Tensor, num_queries: int, num_index_heads: int,
                   slots: int, block_size: int, segment_pairs: int, num_keys: int | None,
                   name: str):
    """``block_work_sizes``; pair numbers are int32 in the kernels, so their count is checked,
    naming ``name``."""
    if num_queries * num_index_heads * slots >= 2**31:
        raise ValueError(f"{name}: expected fewer than 2^31 (token, index head, slot) "
                         f"entries, received {num_queries} x {num_index_heads} x {slots}")
    return block_work_sizes(num_queries, num_index_heads, slots,
                            num_queries if num_keys is None else num_keys,
                            cu_seqlens.numel() - 1, block_size, segment_pairs)


def _layout(cu_seqlens: torch.Tensor, num_queries: int, num_index_heads: int, slots: int,
            block_size: int, segment_pairs: int, num_keys: int | None, name: str):
    """The torch builders' shared start: ``_checked_sizes`` and ``_global_blocks``."""
    sizes = _checked_sizes(cu_seqlens, num_queries, num_index_heads, slots, block_size,
                           segment_pairs, num_keys, name)
    return sizes, _global_blocks(cu_seqlens, block_size, sizes[1])


# The orders the key-outer programs can take the segments in (``segment_order``):
# - "pairs": most pairs first, so that the longest segments do not start last (few segments
#   per SM);
# - "rows": by first query row, then index head: programs running together read neighbouring
#   queries, which then come from L2 (many segments of top-k selections);
# - "head_rows": by index head, then first query row (warmup's every causal pair: one index
#   head's queries at a time fit in L2 better).
# docs/KERNELS.md has the measurements.
SEGMENT_ORDERS = ("pairs", "rows", "head_rows")


def _segment_order(order: str, pairs, segment_bucket, first_pair, valid, pair_token,
                   num_index_heads: int, num_queries: int) -> torch.Tensor:
    """int32: the segments in ``order`` (one of SEGMENT_ORDERS); padding segments last."""
    if order == "pairs":
        return torch.argsort(pairs, descending=True, stable=True).to(torch.int32)
    if order not in SEGMENT_ORDERS:
        raise ValueError(f"segment_order: expected one of {SEGMENT_ORDERS}, received {order!r}")
    row = pair_token[first_pair.clamp(0, max(pair_token.numel() - 1, 0))].long()
    head = segment_bucket % num_index_heads
    key = (row * num_index_heads + head if order == "rows"
           else head * num_queries + row)
    key = torch.where(valid, key, num_index_heads * num_queries)
    return torch.argsort(key, stable=True).to(torch.int32)


def _block_work(pair_token, starts, counts, block_sequence, block_local, num_segments: int,
                segment_pairs: int, order: str, num_index_heads: int,
                num_queries: int) -> BlockWork:
    """The lists from the pairs in bucket order and each bucket's run: the buckets cut into
    segments, taken in ``order``."""
    device = pair_token.device
    num_buckets = starts.numel()
    segments_per_bucket = (counts + segment_pairs - 1) // segment_pairs
    segments_end = torch.cumsum(segments_per_bucket, 0)
    entry = torch.arange(num_segments, device=device)
    segment_bucket = torch.searchsorted(segments_end, entry, right=True)
    valid = segment_bucket < num_buckets
    segment_bucket = torch.where(valid, segment_bucket, 0)
    segment_in_bucket = entry - (segments_end[segment_bucket] - segments_per_bucket[segment_bucket])
    first_pair = starts[segment_bucket] + segment_in_bucket * segment_pairs
    pairs = torch.where(valid, torch.clamp(starts[segment_bucket] + counts[segment_bucket]
                                           - first_pair, max=segment_pairs), 0)
    segments = torch.stack([torch.where(valid, segment_bucket, -1),
                            torch.where(valid, first_pair, 0)], dim=1)
    segment_order = _segment_order(order, pairs, segment_bucket, first_pair, valid, pair_token,
                                   num_index_heads, num_queries)
    return BlockWork(
        pair_token=pair_token.to(torch.int32),
        bucket_start=starts.to(torch.int32),
        bucket_count=counts.to(torch.int32),
        bucket_segments_end=segments_end.to(torch.int32),
        block_sequence=block_sequence.to(torch.int32),
        block_local=block_local.to(torch.int32),
        segments=segments.to(torch.int32).contiguous(),
        segment_order=segment_order,
        num_global_blocks=block_sequence.numel(),
        segment_pairs=segment_pairs,
    )


def build_block_work(block_ids: torch.Tensor, cu_seqlens: torch.Tensor, block_size: int,
                     segment_pairs: int, query_start: int = 0,
                     num_keys: int | None = None, segment_order: str = "pairs",
                     use_triton: bool | None = None,
                     rank_max_segments: int = RANK_MAX_SEGMENTS,
                     with_slots: bool = False) -> BlockWork:
    """block_ids: int32 ``[Tq, Hi, top_k]`` (``-1`` unused), relative to each sequence's start,
    of the packed tokens ``[query_start, query_start + Tq)``; ``num_keys``: the packing's token
    count T (default Tq); ``segment_order``: one of SEGMENT_ORDERS. ``use_triton``: build the
    lists with Triton kernels around one radix sort (the default on a GPU, where the ~90 torch
    operations would be a step's largest fixed cost) or in torch operations (the default
    elsewhere).
    ``rank_max_segments``: up to this many segments a Triton kernel orders them, past it a
    torch sort. ``with_slots``: also each pair's slot (``BlockWork.pair_slot``)."""
    if segment_order not in SEGMENT_ORDERS:
        raise ValueError(f"segment_order: expected one of {SEGMENT_ORDERS}, "
                         f"received {segment_order!r}")
    if use_triton is None:
        use_triton = block_ids.is_cuda
    if not use_triton:
        return _block_work_torch(block_ids, cu_seqlens, block_size, segment_pairs, query_start,
                                 num_keys, segment_order, with_slots)
    total, num_index_heads, top_k = block_ids.shape
    device = block_ids.device
    num_pairs, num_global_blocks, num_segments = _checked_sizes(
        cu_seqlens, total, num_index_heads, top_k, block_size, segment_pairs, num_keys,
        "block_ids")
    if block_ids.stride(-1) != 1:
        block_ids = block_ids.contiguous()
    num_sequences = cu_seqlens.numel() - 1
    num_buckets = num_global_blocks * num_index_heads
    flat = torch.empty(num_pairs + 3 * num_buckets + 2 * num_global_blocks + 3 * num_segments,
                       dtype=torch.int32, device=device)
    (pair_token, bucket_start, bucket_count, bucket_segments_end, block_sequence, block_local,
     segments, order) = flat.split([num_pairs, num_buckets, num_buckets, num_buckets,
                                    num_global_blocks, num_global_blocks, 2 * num_segments,
                                    num_segments])
    # The global blocks up to the end of each sequence.
    block_end = torch.empty(max(num_sequences, 1), dtype=torch.int32, device=device)
    _sequence_blocks_kernel[(1,)](cu_seqlens, block_end, num_sequences, BLOCK=block_size,
                                  CHUNK=1024)
    # Every pair's bucket; unused slots go to a bucket past the end. 16-bit keys where they
    # fit: the radix sort then makes half the passes.
    key_dtype = torch.int16 if num_buckets < 2**15 else torch.int32
    keys = torch.empty(num_pairs, dtype=key_dtype, device=device)
    search = max(1, num_sequences.bit_length())
    tokens = 64
    if total:
        _pair_buckets_kernel[(triton.cdiv(total, tokens),)](
            block_ids, cu_seqlens, block_end, keys, total, query_start, num_sequences,
            block_ids.stride(0), block_ids.stride(1), num_buckets, HI=num_index_heads,
            TOP_K=top_k, TOKENS=tokens, SLOTS=triton.next_power_of_2(num_index_heads * top_k),
            SEARCH_STEPS=search)
    # Stable: pairs of a bucket stay in token order, so the work list is deterministic.
    sorted_keys, pair_order = torch.sort(keys, stable=True)
    chunk, buckets, fan = 1024, 64, 32
    segments_per_bucket = torch.empty(num_buckets, dtype=torch.int32, device=device)
    programs = max(triton.cdiv(num_pairs, chunk), triton.cdiv(num_buckets, buckets))
    _bucket_runs_kernel[(programs,)](
        sorted_keys, pair_order, pair_token, block_end, bucket_start, bucket_count,
        segments_per_bucket, block_sequence, block_local, num_pairs, num_buckets,
        num_sequences, HI=num_index_heads, PAIR_ENTRIES=num_index_heads * top_k,
        SEGMENT_PAIRS=segment_pairs, CHUNK=chunk, BUCKETS=buckets, FAN=fan,
        PAIR_STEPS=wide_search_steps(num_pairs, fan), SEARCH_STEPS=search)
    torch.cumsum(segments_per_bucket, 0, dtype=torch.int32, out=bucket_segments_end)
    order_key = torch.empty(num_segments, dtype=torch.int64, device=device)
    _segments_kernel[(triton.cdiv(num_segments, chunk),)](
        bucket_segments_end, bucket_start, bucket_count, pair_token, segments, order_key,
        num_segments, num_buckets, total, max(num_pairs - 1, 0), HI=num_index_heads,
        SEGMENT_PAIRS=segment_pairs, ORDER=SEGMENT_ORDERS.index(segment_order), CHUNK=chunk,
        SEARCH_STEPS=max(1, num_buckets.bit_length()))
    if num_segments <= rank_max_segments:
        _stable_rank_kernel[(triton.cdiv(num_segments, RANK_CHUNK),)](
            order_key, order, num_segments, CHUNK=RANK_CHUNK, OTHERS=RANK_OTHERS)
    else:
        order.copy_(torch.argsort(order_key, stable=True))
    return BlockWork(pair_token=pair_token, bucket_start=bucket_start,
                     bucket_count=bucket_count, bucket_segments_end=bucket_segments_end,
                     block_sequence=block_sequence, block_local=block_local,
                     segments=segments.view(num_segments, 2), segment_order=order,
                     num_global_blocks=num_global_blocks, segment_pairs=segment_pairs,
                     flat=flat,
                     pair_slot=(pair_order % top_k).to(torch.int32) if with_slots else None)


@triton.jit
def _stable_rank_kernel(KEYS, ORDER, size, CHUNK: tl.constexpr, OTHERS: tl.constexpr):
    """ORDER[rank(i)] = i, rank(i) = the keys smaller than key i plus the equal ones before it:
    a stable ascending argsort."""
    index = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    valid = index < size
    key = tl.load(KEYS + index, mask=valid, other=0)
    rank = tl.zeros([CHUNK], tl.int32)
    for start in range(0, size, OTHERS):
        other = start + tl.arange(0, OTHERS)
        other_key = tl.load(KEYS + other, mask=other < size, other=0)
        before = ((other_key[None, :] < key[:, None])
                  | ((other_key[None, :] == key[:, None]) & (other[None, :] < index[:, None])))
        rank += tl.sum((before & (other < size)[None, :]).to(tl.int32), axis=1)
    tl.store(ORDER + rank, index, mask=valid)


@triton.jit
def _sequence_blocks_kernel(CU_SEQLENS, BLOCK_END, num_sequences, BLOCK: tl.constexpr,
                            CHUNK: tl.constexpr):
    """One program: BLOCK_END[s] = the key blocks of sequences 0..s."""
    carry = tl.full((), 0, tl.int32)
    for start in range(0, num_sequences, CHUNK):
        sequence = start + tl.arange(0, CHUNK)
        valid = sequence < num_sequences
        length = (tl.load(CU_SEQLENS + sequence + 1, mask=valid, other=0)
                  - tl.load(CU_SEQLENS + sequence, mask=valid, other=0))
        blocks = (length + BLOCK - 1) // BLOCK
        tl.store(BLOCK_END + sequence, carry + tl.cumsum(blocks, 0), mask=valid)
        carry += tl.sum(blocks, 0)


@triton.jit
def _count_at_most(SORTED, value, size, STEPS: tl.constexpr):
    """How many of the ascending SORTED[0:size] are <= value (a binary search per lane)."""
    low = tl.zeros_like(value)
    high = tl.zeros_like(value) + size
    for _ in tl.static_range(STEPS + 1):
        middle = (low + high) // 2
        active = low < high
        at_most = tl.load(SORTED + middle, mask=active, other=0) <= value
        low = tl.where(active & at_most, middle + 1, low)
        high = tl.where(active & ~at_most, middle, high)
    return low


@triton.jit
def _count_at_most_wide(SORTED, value, size, FAN: tl.constexpr, STEPS: tl.constexpr):
    """``_count_at_most`` for long arrays: each step reads FAN - 1 evenly spaced entries of a
    lane's range at once and keeps the gap that holds the answer, so a range of n entries takes
    about log_FAN(n) dependent reads instead of log2(n) (``wide_search_steps``)."""
    low = tl.zeros_like(value).to(tl.int64)  # SORTED[low - 1] <= value, or low = 0
    high = low + size  # SORTED[high] > value, or high = size
    probe = tl.arange(0, FAN)[None, :].to(tl.int64)
    for _ in tl.static_range(STEPS):
        width = high - low
        position = low[:, None] + (width[:, None] * probe) // FAN
        active = (probe > 0) & (position < high[:, None])
        at_most = active & (tl.load(SORTED + position, mask=active, other=0) <= value[:, None])
        count = tl.sum(at_most.to(tl.int64), axis=1)  # the at-most probes are a prefix
        new_low = tl.where(count > 0, low + (width * count) // FAN + 1, low)
        high = tl.where(count < FAN - 1, low + (width * (count + 1)) // FAN, high)
        low = new_low
    return low.to(value.dtype)


def wide_search_steps(size: int, fan: int) -> int:
    """Steps of ``_count_at_most_wide`` over ``size`` entries: a range of width w leaves a gap
    of at most ceil(w / fan) entries, and none once w <= fan."""
    steps = 1
    while size > fan:
        size = -(-size // fan)
        steps += 1
    return steps


@triton.jit
def _pair_buckets_kernel(IDS, CU_SEQLENS, BLOCK_END, KEYS, num_queries, query_start,
                         num_sequences, stride_ids_t, stride_ids_h, num_buckets,
                         HI: tl.constexpr, TOP_K: tl.constexpr, TOKENS: tl.constexpr,
                         SLOTS: tl.constexpr, SEARCH_STEPS: tl.constexpr):
    """Each (query row, index head, slot)'s bucket: (its sequence's first global block + the
    block id) * HI + head; ``num_buckets`` for unused slots."""
    row = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    row_valid = row < num_queries
    # The row's sequence: how many sequences end at or before its packed token.
    sequence = _count_at_most(CU_SEQLENS + 1, row + query_start, num_sequences, SEARCH_STEPS)
    sequence = tl.minimum(sequence, num_sequences - 1)
    first_block = tl.load(BLOCK_END + sequence - 1, mask=row_valid & (sequence > 0), other=0)
    slot = tl.arange(0, SLOTS)
    head = slot // TOP_K
    slot_valid = slot < HI * TOP_K
    valid = row_valid[:, None] & slot_valid[None, :]
    ids = tl.load(IDS + row[:, None].to(tl.int64) * stride_ids_t + head[None, :] * stride_ids_h
                  + (slot % TOP_K)[None, :], mask=valid, other=-1)
    bucket = tl.where(ids >= 0, (first_block[:, None] + ids) * HI + head[None, :], num_buckets)
    tl.store(KEYS + row[:, None].to(tl.int64) * (HI * TOP_K) + slot[None, :],
             bucket.to(KEYS.dtype.element_ty), mask=valid)


@triton.jit
def _bucket_runs_kernel(SORTED, ORDER, PAIR_TOKEN, BLOCK_END, BUCKET_START, BUCKET_COUNT,
                        BUCKET_SEGMENTS, BLOCK_SEQUENCE, BLOCK_LOCAL, num_pairs, num_buckets,
                        num_sequences, HI: tl.constexpr, PAIR_ENTRIES: tl.constexpr,
                        SEGMENT_PAIRS: tl.constexpr, CHUNK: tl.constexpr,
                        BUCKETS: tl.constexpr, FAN: tl.constexpr, PAIR_STEPS: tl.constexpr,
                        SEARCH_STEPS: tl.constexpr):
    """From the sorted buckets: each pair's query row (CHUNK pairs a program); each bucket's run
    (first pair, count) and its segment count, each global block's sequence (-1: padding) and
    local index (BUCKETS buckets and blocks a program). The runs come from wide searches: a few
    dependent reads each, where a binary search takes a read per bit."""
    index = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    pair_valid = index < num_pairs
    order = tl.load(ORDER + index, mask=pair_valid, other=0)
    tl.store(PAIR_TOKEN + index, (order // PAIR_ENTRIES).to(tl.int32), mask=pair_valid)
    if tl.program_id(0) * BUCKETS < num_buckets:  # (the programs past them skip the searches)
        bucket = tl.program_id(0) * BUCKETS + tl.arange(0, BUCKETS)  # also a global block
        bucket_valid = bucket < num_buckets
        start = _count_at_most_wide(SORTED, bucket - 1, num_pairs, FAN, PAIR_STEPS)
        count = _count_at_most_wide(SORTED, bucket, num_pairs, FAN, PAIR_STEPS) - start
        tl.store(BUCKET_START + bucket, start, mask=bucket_valid)
        tl.store(BUCKET_COUNT + bucket, count, mask=bucket_valid)
        tl.store(BUCKET_SEGMENTS + bucket, (count + SEGMENT_PAIRS - 1) // SEGMENT_PAIRS,
                 mask=bucket_valid)
        block_valid = bucket < num_buckets // HI
        sequence = _count_at_most(BLOCK_END, bucket, num_sequences, SEARCH_STEPS)
        padding = sequence >= num_sequences
        first_block = tl.load(BLOCK_END + sequence - 1, mask=~padding & (sequence > 0),
                              other=0)
        tl.store(BLOCK_SEQUENCE + bucket, tl.where(padding, -1, sequence), mask=block_valid)
        tl.store(BLOCK_LOCAL + bucket, bucket - first_block, mask=block_valid)


@triton.jit
def _segments_kernel(SEGMENTS_END, BUCKET_START, BUCKET_COUNT, PAIR_TOKEN, SEGMENTS, ORDER_KEY,
                     num_segments, num_buckets, num_queries, last_pair, HI: tl.constexpr,
                     SEGMENT_PAIRS: tl.constexpr, ORDER: tl.constexpr, CHUNK: tl.constexpr,
                     SEARCH_STEPS: tl.constexpr):
    """Each segment's (bucket, first pair), -1 and 0 for padding, and the key that orders the
    segments (ORDER indexes SEGMENT_ORDERS: pairs, rows, head_rows; padding last)."""
    segment = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    in_range = segment < num_segments
    bucket = _count_at_most(SEGMENTS_END, segment, num_buckets, SEARCH_STEPS)
    valid = in_range & (bucket < num_buckets)
    bucket = tl.where(valid, bucket, 0)
    start = tl.load(BUCKET_START + bucket)
    count = tl.load(BUCKET_COUNT + bucket)
    segments_before = (tl.load(SEGMENTS_END + bucket)
                       - (count + SEGMENT_PAIRS - 1) // SEGMENT_PAIRS)
    first_pair = tl.where(valid, start + (segment - segments_before) * SEGMENT_PAIRS, 0)
    pairs = tl.where(valid, tl.minimum(start + count - first_pair, SEGMENT_PAIRS), 0)
    tl.store(SEGMENTS + 2 * segment, tl.where(valid, bucket, -1), mask=in_range)
    tl.store(SEGMENTS + 2 * segment + 1, first_pair, mask=in_range)
    if ORDER == 0:  # most pairs first
        key = (SEGMENT_PAIRS - pairs).to(tl.int64)
    else:
        row = tl.load(PAIR_TOKEN + tl.minimum(first_pair, last_pair)).to(tl.int64)
        head = bucket % HI
        key = row * HI + head if ORDER == 1 else head * num_queries + row
        key = tl.where(valid, key, HI * num_queries)
    tl.store(ORDER_KEY + segment, key, mask=in_range)


def _block_work_torch(block_ids: torch.Tensor, cu_seqlens: torch.Tensor, block_size: int,
                      segment_pairs: int, query_start: int = 0,
                      num_keys: int | None = None, segment_order: str = "pairs",
                      with_slots: bool = False) -> BlockWork:
    """``build_block_work`` in torch operations."""
    total, num_index_heads, top_k = block_ids.shape
    device = block_ids.device
    (_, num_global_blocks, num_segments), (first_block, block_sequence, block_local) = _layout(
        cu_seqlens, total, num_index_heads, top_k, block_size, segment_pairs, num_keys,
        "block_ids")
    # Bucket of every pair; unused slots go to an extra bucket past the end.
    num_buckets = num_global_blocks * num_index_heads
    token_block = first_block[sequence_of_tokens(cu_seqlens, total, query_start)]  # [Tq]
    heads = torch.arange(num_index_heads, device=device)
    ids = block_ids.long()
    bucket = (token_block[:, None, None] + ids) * num_index_heads + heads[None, :, None]
    bucket = torch.where(ids >= 0, bucket, num_buckets).flatten()
    # Stable: pairs of a bucket stay in token order, so the work list is deterministic. int32
    # keys (a radix sort does half the passes of int64): buckets number fewer than the pairs,
    # which are fewer than 2^31 (checked above).
    sorted_bucket, order = torch.sort(bucket.to(torch.int32), stable=True)
    # Each bucket's run in the sorted keys, found by binary search: a scatter-add of one count
    # per pair serializes on atomics when few buckets hold many pairs (warmup's).
    bounds = torch.searchsorted(sorted_bucket, torch.arange(num_buckets + 1, device=device,
                                                             dtype=torch.int32))
    starts = bounds[:-1]
    work = _block_work(order // (num_index_heads * top_k), starts, bounds[1:] - starts,
                       block_sequence, block_local, num_segments, segment_pairs, segment_order,
                       num_index_heads, total)
    if with_slots:
        work.pair_slot = (order % top_k).to(torch.int32)
    return work


def build_causal_block_work(cu_seqlens: torch.Tensor, num_queries: int, num_index_heads: int,
                            block_size: int, slots: int, segment_pairs: int,
                            query_start: int = 0, num_keys: int | None = None,
                            segment_order: str = "pairs") -> BlockWork:
    """``build_block_work`` of warmup's ids (every block up to each query's own, ``slots``
    slots), built directly instead of by sorting: the queries that kept block b of a sequence
    are its queries at positions >= b * block_size, a run of consecutive rows. Same lists, same
    shapes (past the pairs, ``pair_token`` holds zeros where the sort left unused slots)."""
    device = cu_seqlens.device
    (num_pairs, _, num_segments), (_, block_sequence, block_local) = _layout(
        cu_seqlens, num_queries, num_index_heads, slots, block_size, segment_pairs, num_keys,
        "max_seqlen")
    sequence = block_sequence.clamp(min=0)
    # The query rows [first_row, end_row) of each global block's bucket (the same for every
    # index head): its sequence's queries from the block's first position on.
    first_row = (cu_seqlens[sequence].long() + block_local * block_size - query_start)
    end_row = cu_seqlens[sequence + 1].long() - query_start
    first_row, end_row = first_row.clamp(0, num_queries), end_row.clamp(0, num_queries)
    counts = torch.where(block_sequence >= 0, (end_row - first_row).clamp(min=0), 0)
    counts = counts.repeat_interleave(num_index_heads)  # buckets: global block * Hi + head
    first_row = first_row.repeat_interleave(num_index_heads)
    ends = torch.cumsum(counts, 0)
    starts = ends - counts
    pair = torch.arange(num_pairs, device=device)
    bucket = torch.searchsorted(ends, pair, right=True).clamp(max=counts.numel() - 1)
    pair_token = torch.where(pair < ends[-1], first_row[bucket] + pair - starts[bucket], 0)
    return _block_work(pair_token, starts, counts, block_sequence, block_local, num_segments,
                       segment_pairs, segment_order, num_index_heads, num_queries)
