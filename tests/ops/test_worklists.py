"""The device-built work lists (openmsa/ops/worklists/) against per-token loops."""

import pytest
import torch
import triton
import triton.language as tl

from openmsa.ops.worklists import (BlockWork, block_work_sizes, build_block_work,
                                   build_causal_block_work, build_causal_query_tile_work,
                                   build_query_tile_work, query_tile_schedule)
from openmsa.ops.worklists.key_blocks import _count_at_most_wide, wide_search_steps
from openmsa.ops.layout import all_causal_block_ids
from openmsa.ops.validate import query_positions_from_offsets


def random_block_ids(seqlens, num_index_heads, top_k, block_size, seed):
    """Token-major ids as selection returns them: distinct causal blocks, own block included,
    unused slots -1 (short prefixes keep fewer blocks than top_k)."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for length in seqlens:
        for position in range(length):
            own = position // block_size
            per_head = []
            for _ in range(num_index_heads):
                earlier = torch.randperm(own, generator=generator)[:top_k - 1].tolist()
                kept = [own] + earlier
                per_head.append(kept + [-1] * (top_k - len(kept)))
            rows.append(per_head)
    cu_seqlens = torch.tensor([0] + list(torch.tensor(seqlens).cumsum(0)), dtype=torch.int32)
    return torch.tensor(rows, dtype=torch.int32), cu_seqlens


SEQLENS = (70, 1, 200, 129)  # 400 tokens
# (first, end) query ranges of the packing: all of it, and ranges starting inside a sequence.
RANGES = [(0, 400), (37, 300), (100, 250)]


TILE_CASES = [(1, RANGES[0]), (4, RANGES[0]), (8, RANGES[0]), (64, RANGES[0]), (8, RANGES[1]),
              (64, RANGES[2])]


@pytest.mark.parametrize("use_triton,tile_tokens,query_range",
                         [(False, *case) for case in TILE_CASES]
                         + [(True, *case) for case in TILE_CASES[3:]])
def test_query_tile_unions_and_members(use_triton, tile_tokens, query_range):
    """Both builders: torch operations, and the Triton kernel (the default on a GPU)."""
    first, end = query_range
    ids, cu = random_block_ids(SEQLENS, 3, 4, 16, seed=tile_tokens)
    work = build_query_tile_work(ids[first:end], cu, tile_tokens, query_start=first,
                                 use_triton=use_triton)
    seen_tiles = set()
    for entry, (sequence, tile) in enumerate(work.schedule.tolist()):
        if sequence < 0:
            assert (work.union_count[entry] == 0).all()
            continue
        seen_tiles.add((sequence, tile))
        start, stop = cu[sequence].item(), cu[sequence + 1].item()
        tile_start = start + tile * tile_tokens  # packed token of the tile's first position
        tokens = range(max(tile_start, first), min(tile_start + tile_tokens, stop, end))
        for head in range(3):
            kept = {t: set(ids[t, head].tolist()) - {-1} for t in tokens}
            expected = sorted(set().union(*kept.values()))
            count = work.union_count[entry, head].item()
            assert work.union[entry, head, :count].tolist() == expected
            assert (work.union[entry, head, count:] == -1).all()
            for slot, block in enumerate(expected):
                members = work.union_members[entry, head, slot].item() % (1 << 64)  # as uint64
                bits = {t - tile_start for t in tokens if block in kept[t]}
                assert members == sum(1 << bit for bit in bits)
    expected_tiles = set()
    for sequence, (start, stop) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        queries = range(max(start, first) - start, min(stop, end) - start)  # positions
        if queries:
            expected_tiles |= {(sequence, t) for t in range(queries[0] // tile_tokens,
                                                            queries[-1] // tile_tokens + 1)}
    assert seen_tiles == expected_tiles


@pytest.mark.parametrize("use_triton", [False, True])
def test_tiles_beyond_the_members_mask_are_refused(use_triton):
    ids, cu = random_block_ids((10,), 1, 1, 16, seed=0)
    with pytest.raises(ValueError, match="tile_tokens"):
        build_query_tile_work(ids, cu, 128, use_triton=use_triton)


def test_query_tile_builders_give_equal_lists():
    """The Triton kernel's lists equal the torch operations', padding entries included, with
    an odd top_k (entries padded to a power of two inside the kernel)."""
    ids, cu = random_block_ids(SEQLENS, 2, 3, 16, seed=5)
    lists = [build_query_tile_work(ids[37:300], cu, 8, query_start=37, use_triton=use_triton)
             for use_triton in (False, True)]
    for name in ("schedule", "union", "union_members", "union_count"):
        torch_list, triton_list = (getattr(work, name) for work in lists)
        assert triton_list.dtype == torch_list.dtype, name
        assert torch.equal(triton_list, torch_list), name


@pytest.mark.parametrize("segment_pairs,query_range", [
    (3, RANGES[0]), (2048, RANGES[0]), (3, RANGES[1])])
def test_key_block_lists_hold_every_pair_in_token_order(segment_pairs, query_range):
    first, end = query_range
    num_index_heads, block_size = 2, 16
    ids, cu = random_block_ids(SEQLENS, num_index_heads, 4, block_size, seed=1)
    work = build_block_work(ids[first:end], cu, block_size, segment_pairs, query_start=first,
                            num_keys=400)
    covered = {}
    for bucket, first_pair in work.segments.tolist():
        if bucket < 0:
            continue
        bucket_end = work.bucket_start[bucket].item() + work.bucket_count[bucket].item()
        covered.setdefault(bucket, []).extend(
            work.pair_token[first_pair:min(first_pair + segment_pairs, bucket_end)].tolist())
    blocks = set()
    for global_block in range(work.num_global_blocks):
        sequence = work.block_sequence[global_block].item()
        if sequence < 0:
            continue
        start, stop = cu[sequence].item(), cu[sequence + 1].item()
        block = work.block_local[global_block].item()
        blocks.add((sequence, block))
        for head in range(num_index_heads):
            # Pairs name query rows: packed token - first.
            expected = [t - first for t in range(max(start, first), min(stop, end))
                        if block in ids[t, head].tolist()]
            assert covered.get(global_block * num_index_heads + head, []) == expected
    assert blocks == {(s, b) for s, n in enumerate(SEQLENS) for b in range(-(-n // block_size))}
    # Programs run most pairs first.
    sizes = [min(segment_pairs, work.bucket_start[b].item() + work.bucket_count[b].item() - f)
             if b >= 0 else 0 for b, f in work.segments[work.segment_order.long()].tolist()]
    assert sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("segment_order", ["rows", "head_rows"])
def test_segments_run_in_query_row_order(segment_order):
    """The L2-friendly orders: every segment once, padding last, sorted by (first query row,
    index head) or (index head, first query row); the lists themselves do not change."""
    first, end = RANGES[1]
    num_index_heads = 3
    ids, cu = random_block_ids(SEQLENS, num_index_heads, 4, 16, seed=4)
    by_pairs = build_block_work(ids[first:end], cu, 16, 3, query_start=first, num_keys=400)
    work = build_block_work(ids[first:end], cu, 16, 3, query_start=first, num_keys=400,
                            segment_order=segment_order)
    for name in ("pair_token", "bucket_start", "bucket_count", "segments"):
        assert torch.equal(getattr(work, name), getattr(by_pairs, name)), name
    order = work.segment_order.long().tolist()
    assert sorted(order) == list(range(work.segments.shape[0]))
    keys = []
    for bucket, first_pair in work.segments[order].tolist():
        if bucket < 0:
            keys.append((1, 0, 0))  # padding
            continue
        row, head = work.pair_token[first_pair].item(), bucket % num_index_heads
        keys.append((0, row, head) if segment_order == "rows" else (0, head, row))
    assert keys == sorted(keys)
    assert keys[0][0] == 0 and keys[-1][0] == 1


def test_unknown_segment_orders_are_refused():
    ids, cu = random_block_ids((40,), 1, 2, 16, seed=0)
    with pytest.raises(ValueError, match="segment_order"):
        build_block_work(ids, cu, 16, 4, segment_order="blocks")


def test_pair_counts_beyond_int32_are_refused():
    """Pair numbers are int32 in the kernels: 2^31 (token, index head, slot) entries refuse."""
    ids = torch.zeros(1, 1, 1, dtype=torch.int32).expand(2**21, 32, 32)  # a view, no memory
    with pytest.raises(ValueError, match="block_ids: expected fewer than 2"):
        build_block_work(ids, torch.tensor([0, 2**21], dtype=torch.int32), 64, 2048)


@pytest.mark.parametrize("tile_tokens,query_range", [
    (1, RANGES[0]), (8, RANGES[0]), (16, RANGES[0]), (8, RANGES[1]), (16, RANGES[2])])
def test_warmup_tile_lists_built_directly_equal_the_sorted_ones(tile_tokens, query_range):
    first, end = query_range
    cu = torch.tensor([0] + list(torch.tensor(SEQLENS).cumsum(0)), dtype=torch.int32)
    positions = query_positions_from_offsets(cu, 400)[first:end]
    ids = all_causal_block_ids(positions, 3, 16, max(SEQLENS))
    sorted_work = build_query_tile_work(ids, cu, tile_tokens, query_start=first)
    direct = build_causal_query_tile_work(cu, end - first, 3, tile_tokens, 16, ids.shape[2],
                                          query_start=first)
    assert torch.equal(direct.schedule, sorted_work.schedule)
    assert torch.equal(direct.union_count, sorted_work.union_count)
    for name in ("union", "union_members"):
        got, expected = getattr(direct, name), getattr(sorted_work, name)
        assert got.shape == expected.shape, name
        assert torch.equal(got, expected), name


@pytest.mark.parametrize("segment_pairs,query_range,segment_order", [
    (3, RANGES[0], "pairs"), (2048, RANGES[0], "pairs"), (5, RANGES[1], "head_rows"),
    (7, RANGES[2], "pairs"), (7, RANGES[2], "head_rows")])
def test_warmup_key_block_lists_built_directly_equal_the_sorted_ones(segment_pairs,
                                                                     query_range,
                                                                     segment_order):
    first, end = query_range
    cu = torch.tensor([0] + list(torch.tensor(SEQLENS).cumsum(0)), dtype=torch.int32)
    positions = query_positions_from_offsets(cu, 400)[first:end]
    ids = all_causal_block_ids(positions, 3, 16, max(SEQLENS))
    sorted_work = build_block_work(ids, cu, 16, segment_pairs, query_start=first, num_keys=400,
                                   segment_order=segment_order)
    direct = build_causal_block_work(cu, end - first, 3, 16, ids.shape[2], segment_pairs,
                                     query_start=first, num_keys=400,
                                     segment_order=segment_order)
    pairs = sorted_work.bucket_count.sum().item()
    assert direct.pair_token.shape == sorted_work.pair_token.shape
    assert torch.equal(direct.pair_token[:pairs], sorted_work.pair_token[:pairs])
    for name in ("bucket_start", "bucket_count", "bucket_segments_end", "block_sequence",
                 "block_local", "segments", "segment_order"):
        assert torch.equal(getattr(direct, name), getattr(sorted_work, name)), name
    assert direct.num_global_blocks == sorted_work.num_global_blocks


@pytest.mark.parametrize("use_triton", [False, True])
def test_key_block_lists_survive_packing_into_one_tensor(use_triton):
    """The custom operators carry the key-block lists as one int32 tensor; its size comes from
    the shapes alone (the fake implementation's), and unpacking gives the lists back. (The
    Triton builder writes them into one tensor from the start.)"""
    ids, cu = random_block_ids(SEQLENS, 2, 4, 16, seed=3)
    work = build_block_work(ids, cu, 16, 5, use_triton=use_triton)
    sizes = block_work_sizes(400, 2, 4, 400, len(SEQLENS), 16, 5)
    flat = work.packed()
    pairs, blocks, segments = sizes
    assert flat.dtype == torch.int32
    assert flat.numel() == pairs + 3 * blocks * 2 + 2 * blocks + 3 * segments
    back = BlockWork.unpacked(flat, *sizes, num_index_heads=2, segment_pairs=5)
    for name in ("pair_token", "bucket_start", "bucket_count", "bucket_segments_end",
                 "block_sequence", "block_local", "segments", "segment_order"):
        assert torch.equal(getattr(back, name), getattr(work, name)), name
    assert (back.num_global_blocks, back.segment_pairs) == (work.num_global_blocks, 5)


@pytest.mark.parametrize("segment_order", ["pairs", "rows", "head_rows"])
@pytest.mark.parametrize("num_index_heads,top_k,block_size,segment_pairs,query_range", [
    (2, 4, 16, 3, RANGES[0]), (3, 5, 16, 2048, RANGES[1]), (1, 1, 64, 5, RANGES[2])])
def test_key_block_builders_give_equal_lists(segment_order, num_index_heads, top_k,
                                             block_size, segment_pairs, query_range):
    """The Triton kernels' key-block lists (the default on a GPU) equal the torch operations'
    (checked against per-token loops above), padding segments and blocks included."""
    first, end = query_range
    ids, cu = random_block_ids(SEQLENS, num_index_heads, top_k, block_size, seed=first + top_k)
    lists = [build_block_work(ids[first:end], cu, block_size, segment_pairs, query_start=first,
                              num_keys=400, segment_order=segment_order, use_triton=use_triton)
             for use_triton in (False, True)]
    pairs = int((ids[first:end] >= 0).sum())
    assert lists[0].pair_token.shape == lists[1].pair_token.shape
    assert torch.equal(lists[0].pair_token[:pairs], lists[1].pair_token[:pairs])
    for name in ("bucket_start", "bucket_count", "bucket_segments_end", "block_sequence",
                 "block_local", "segments", "segment_order"):
        torch_list, triton_list = (getattr(work, name) for work in lists)
        assert triton_list.dtype == torch_list.dtype, name
        assert torch.equal(triton_list, torch_list), name
    assert lists[0].num_global_blocks == lists[1].num_global_blocks


@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize("num_index_heads,top_k,query_range", [
    (2, 4, RANGES[0]), (3, 5, RANGES[1])])
def test_key_block_pairs_carry_their_slot(use_triton, num_index_heads, top_k, query_range):
    """``with_slots``: each pair's slot is its block's position in its row's ids (what the
    key-outer kernels index the partials by); without it, none."""
    first, end = query_range
    block_size = 16
    ids, cu = random_block_ids(SEQLENS, num_index_heads, top_k, block_size, seed=7 + top_k)
    work = build_block_work(ids[first:end], cu, block_size, 3, query_start=first, num_keys=400,
                            use_triton=use_triton, with_slots=True)
    assert work.pair_slot is not None and work.pair_slot.dtype == torch.int32
    checked = 0
    for bucket, first_pair in work.segments.tolist():
        if bucket < 0:
            continue
        head = bucket % num_index_heads
        global_block = bucket // num_index_heads
        block = work.block_local[global_block].item()
        bucket_end = work.bucket_start[bucket].item() + work.bucket_count[bucket].item()
        for pair in range(first_pair, min(first_pair + 3, bucket_end)):
            row = work.pair_token[pair].item()
            slot = work.pair_slot[pair].item()
            assert ids[first + row, head, slot].item() == block, (pair, row, slot)
            checked += 1
    assert checked == int((ids[first:end] >= 0).sum())
    plain = build_block_work(ids[first:end], cu, block_size, 3, query_start=first,
                             num_keys=400, use_triton=use_triton)
    assert plain.pair_slot is None


@pytest.mark.parametrize("seqlens", [SEQLENS, (400,), (0, 0, 5), (17,) * 20])
@pytest.mark.parametrize("tile_tokens", [1, 8, 64])
def test_query_tile_schedule_kernel_equals_torch(seqlens, tile_tokens):
    """The schedule's Triton kernel (the default on a GPU) against the torch operations, over
    the whole packing and over query ranges starting and ending inside sequences."""

    cu = torch.tensor([0] + torch.tensor(seqlens).cumsum(0).tolist(), dtype=torch.int32)
    total = cu[-1].item()
    for first, end in ((0, total), (min(37, total), max(total - 20, min(37, total))),
                       (total // 2, total)):
        lists = [query_tile_schedule(cu, end - first, tile_tokens, first, use_triton=use)
                 for use in (False, True)]
        assert torch.equal(lists[0], lists[1]), (first, end)


def test_segment_order_by_sort_equals_the_rank_kernel():
    """Past ``rank_max_segments`` segments a torch sort orders them instead of the rank
    kernel: the same order."""
    ids, cu = random_block_ids(SEQLENS, 2, 4, 16, seed=9)
    by_rank = build_block_work(ids, cu, 16, 3, use_triton=True)
    by_sort = build_block_work(ids, cu, 16, 3, use_triton=True, rank_max_segments=0)
    assert torch.equal(by_rank.segment_order, by_sort.segment_order)


@triton.jit
def _count_kernel(SORTED, VALUES, OUT, size, num_values, LANES: tl.constexpr, FAN: tl.constexpr,
                  STEPS: tl.constexpr):
    lane = tl.program_id(0) * LANES + tl.arange(0, LANES)
    value = tl.load(VALUES + lane, mask=lane < num_values, other=0)
    tl.store(OUT + lane, _count_at_most_wide(SORTED, value, size, FAN, STEPS),
             mask=lane < num_values)


@pytest.mark.parametrize("size,fan", [(0, 4), (1, 4), (3, 4), (1000, 4), (1000, 32), (4097, 8)])
def test_wide_search_counts_like_searchsorted(size, fan):
    """The bucket runs' wide search: for every value around and inside a sorted array with long
    runs of equal entries, the entries at most the value (torch.searchsorted's right side),
    with as many steps as ``wide_search_steps`` gives."""
    generator = torch.Generator().manual_seed(size + fan)
    ordered = torch.sort(torch.randint(0, 60, (size,), generator=generator)).values
    ordered = ordered.to(torch.int32)
    values = torch.arange(-2, 63, dtype=torch.int32)
    out = torch.empty_like(values)
    lanes = 16
    _count_kernel[(triton.cdiv(values.numel(), lanes),)](
        ordered, values, out, size, values.numel(), LANES=lanes, FAN=fan,
        STEPS=wide_search_steps(size, fan))
    expected = torch.searchsorted(ordered, values, right=True).to(torch.int32)
    assert torch.equal(out, expected)


def test_query_tile_schedule_covers_every_tile_once_longest_first():
    cu_seqlens = torch.tensor([0, 70, 71, 271, 271, 400], dtype=torch.int32)
    schedule = query_tile_schedule(cu_seqlens, 400, tile_tokens=64)
    real = schedule[schedule[:, 0] >= 0].tolist()
    expected = sorted((s, t) for s, n in enumerate([70, 1, 200, 0, 129])
                      for t in range(-(-n // 64)))
    assert sorted(map(tuple, real)) == expected
    tiles = [t for _, t in real]
    assert tiles == sorted(tiles, reverse=True)
    assert (schedule[len(real):] == -1).all()
