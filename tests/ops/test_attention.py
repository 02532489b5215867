"""The Triton sparse attention (forward and backward) against the reference, under the CPU
interpreter, on the same kept blocks."""

import dataclasses
import math

import pytest
import torch

import openmsa
from openmsa.ops import attention as attention_module
from openmsa.ops.attention import key_outer as key_outer_module
from openmsa.ops import msa as msa_module
from openmsa.ops import select as select_module
from openmsa.ops.configs import DEFAULT_TUNING, INDEX_TILE_TOKENS, Tuning, resolve_tuning
from openmsa.ops.layout import ids_to_token_major, packed_offsets, packed_tokens
from openmsa.ops.problem import SparseAttentionProblem
from openmsa.ops.worklists import build_block_work
from openmsa.testing import (INPUT_NAMES, QUANTITY_NAMES, MSACase, random_inputs, rel_rms_error,
                             run_query_ranges, run_with_grads, same_block_sets,
                             tuned_msa_attention)

from attention_cases import (CASES, TOLERANCE, count_calls, full_and_ranges,
                             kernel_and_reference, poison_new_buffers)

pytestmark = pytest.mark.skipif(not msa_module.INTERPRETING,
                                reason="needs TRITON_INTERPRET=1 (the README's test command)")

DTYPE_CASES = [(case, torch.float32) for case in CASES] + [
    (case, torch.float16) for case in CASES[:2]]  # fp16 on two cases keeps the CPU suite short


@pytest.mark.parametrize("case,dtype", DTYPE_CASES,
                         ids=lambda x: str(x).replace("torch.", "") if isinstance(
                             x, torch.dtype) else x.name)
def test_msa_attention_kernels_match_reference(case, dtype):
    got, expected, _ = kernel_and_reference(case, dtype)
    for name in QUANTITY_NAMES:
        error = rel_rms_error(got[name], expected[name])
        assert error < TOLERANCE[dtype], (name, error)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_selection_runs_the_same_attention_and_kl_kernels(dtype):
    """index_precision="fp8": the kernels' fp8 selection equals the reference's (exactly, on
    these inputs), and out, KL and gradients on those blocks match the reference: the KL
    kernels keep the input-precision scores (and the forward its running index maximum)."""
    case = MSACase("packed_many_blocks", seqlens=(130, 600), num_heads=4, num_kv_heads=2,
                   num_index_heads=2, options=dict(top_k=3, block_size=64, num_sink_blocks=1))
    got, expected, ids = kernel_and_reference(case, dtype, seed=6, index_precision="fp8")
    for name in QUANTITY_NAMES:
        error = rel_rms_error(got[name], expected[name])
        assert error < TOLERANCE[dtype], (name, error)
    inputs, cu_seqlens = random_inputs(case, dtype, "cpu", seed=6)
    options = dict(case.options, cu_seqlens=cu_seqlens, return_indices=True)
    _, _, reference_ids = openmsa.msa_attention(*inputs, backend="reference",
                                                index_precision="fp8", **options)
    _, _, input_ids = openmsa.msa_attention(*inputs, backend="reference", **options)
    assert torch.equal(ids.sort(-1).values, reference_ids.sort(-1).values)
    assert not torch.equal(ids.sort(-1).values, input_ids.sort(-1).values)


def test_sparse_attention_decomposed_api_matches_reference():
    case = CASES[1]
    inputs, cu_seqlens = random_inputs(case, torch.float32, "cpu", seed=3)
    q, k, v, index_q, index_k = (t.detach() for t in inputs)
    ids = openmsa.select_blocks(index_q, index_k, cu_seqlens=cu_seqlens, backend="triton",
                                top_k=3, block_size=64, num_sink_blocks=1)
    out_grad = torch.randn_like(q)

    def run(backend):
        tensors = [t.clone().requires_grad_() for t in (q, k, v)]
        out = openmsa.sparse_attention(*tensors, ids, block_size=64, cu_seqlens=cu_seqlens,
                                       backend=backend)
        grads = torch.autograd.grad((out * out_grad).sum(), tensors)
        return [out, *grads]

    for got, expected in zip(run("triton"), run("reference")):
        assert rel_rms_error(got, expected) < 1e-5


def test_log_sum_exps_match_the_kept_logits():
    """Main lse2 per (token, head) and the index log-sum-exp per (token, index head), both over
    the kept causal keys, against logsumexp of explicitly masked logits."""
    case = CASES[0]
    inputs, _ = random_inputs(case, torch.float32, "cpu", seed=4)
    q, k, v, index_q, index_k = (t.detach() for t in inputs)
    ids = openmsa.select_blocks(index_q, index_k, top_k=3, block_size=64, backend="triton")
    cu = packed_offsets(None, 2, 200, "cpu")
    scale, index_scale = 64 ** -0.5, 0.3
    flat = [packed_tokens(t) for t in (q, k, v, index_q, index_k)]
    problem = SparseAttentionProblem(
        flat[0], flat[1], ids_to_token_major(ids, False), cu, 64, scale, flat[4], index_scale)
    _, lse2, lse_index = attention_module.sparse_attention_fwd(*flat, problem)
    # With each row's largest kept score given (selection's), the index sum needs no running
    # maximum: the same log-sum-exp.
    _, row_max = select_module.select_blocks_fwd(
        flat[3], flat[4], cu, top_k=3, block_size=64, index_softmax_scale=index_scale,
        num_local_blocks=1, num_sink_blocks=0, return_max=True)
    _, _, lse_index_given = attention_module.sparse_attention_fwd(*flat, problem, row_max)
    torch.testing.assert_close(lse_index_given, lse_index, rtol=1e-6, atol=1e-6)
    pos = torch.arange(200)
    kept = (ids[..., None] == (pos // 64)).any(-2) & (pos[None, :] <= pos[:, None])  # [B,Hi,S,S]
    logits = scale * torch.einsum("bihd,bjhd->bhij", q, k.repeat_interleave(2, dim=2))
    logits = logits.masked_fill(~kept.repeat_interleave(2, dim=1), float("-inf"))
    expected = torch.logsumexp(logits, -1).permute(0, 2, 1).reshape(400, 4)
    torch.testing.assert_close(lse2 * math.log(2), expected, rtol=1e-5, atol=1e-5)
    z = index_scale * torch.einsum("bird,bjrd->brij", index_q, index_k.expand(-1, -1, 2, -1))
    expected_index = torch.logsumexp(z.masked_fill(~kept, float("-inf")), -1)
    torch.testing.assert_close(lse_index, expected_index.permute(0, 2, 1).reshape(400, 2),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("index_heads", [1, 2])
@pytest.mark.parametrize("query_range", [(0, 400), (45, 330)])
def test_index_log_sum_exp_alone_on_wider_tiles(query_range, index_heads):
    """Next to the Hopper forward the index log-sum-exp runs alone: split between the walk and
    a key-outer pass over a list of the left rows' pairs by each tile's union when selection
    gives each row's largest kept score (``Tuning.index_lse_split``), else on tiles of
    INDEX_TILE_TOKENS tokens (the main tiles hold 8 at 16 heads per index head), also for a
    query range: against logsumexp of each packed sequence's masked index scores, every index
    head (two share one index key head)."""
    first, end = query_range
    case = MSACase("sixteen_heads_per_index_head", seqlens=(150, 1, 249),
                   num_heads=16 * index_heads, num_kv_heads=index_heads,
                   num_index_heads=index_heads)
    inputs, cu = random_inputs(case, torch.float32, "cpu", seed=6)
    q, k, v, index_q, index_k = (t.detach().reshape(-1, *t.shape[-2:]) for t in inputs)
    q, index_q = q[first:end], index_q[first:end]
    ids, row_max = select_module.select_blocks_fwd(
        index_q, index_k, cu, top_k=3, block_size=64, index_softmax_scale=0.3,
        num_local_blocks=1, num_sink_blocks=0, query_start=first, return_max=True)
    problem = SparseAttentionProblem(q, k, ids, cu, 64, 64 ** -0.5, index_k,
                                                      0.3, query_start=first)
    assert problem.query_tokens < INDEX_TILE_TOKENS
    assert problem.index_tile_work.tile_tokens == INDEX_TILE_TOKENS
    alone = attention_module.index_log_sum_exp(index_q, index_k, row_max, problem)
    # Key-outer for every row (limit 0), for the tiles of more than one block (the first tile
    # of a sequence keeps block 0 alone: both passes run), and at the default limit.
    split = [attention_module.index_log_sum_exp_key_outer(index_q, index_k, row_max, problem,
                                                          walk_limit=limit)
             for limit in (0, 1, None)]

    expected = torch.empty(end - first, index_heads, dtype=torch.float64)
    offsets = cu.tolist()
    for start, stop in zip(offsets, offsets[1:]):
        lo, hi = max(start, first), min(stop, end)  # this sequence's queries in the range
        if hi <= lo:
            continue
        positions = torch.arange(lo, hi) - start
        keys = torch.arange(stop - start)
        for head in range(index_heads):
            kept_blocks = ids[lo - first:hi - first, head].long()  # [queries, top_k]; -1 unused
            kept = ((kept_blocks[:, :, None] == (keys // 64)[None, None, :]).any(1)
                    & (keys[None, :] <= positions[:, None]))
            z = 0.3 * (index_q[lo - first:hi - first, head].double()
                       @ index_k[start:stop, 0].double().T)
            expected[lo - first:hi - first, head] = torch.logsumexp(
                z.masked_fill(~kept, float("-inf")), -1)
    torch.testing.assert_close(alone.double(), expected, rtol=1e-5, atol=1e-5)
    for got in split:
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    # Per-slot sums added in slot order, no atomics: the same bits every run.
    again = attention_module.index_log_sum_exp_key_outer(index_q, index_k, row_max, problem,
                                                         walk_limit=1)
    assert torch.equal(again, split[1])
    # Without row maxima (fp8 selection) the kernel keeps a running maximum: the same sums.
    running = attention_module.index_log_sum_exp(index_q, index_k, None, problem)
    torch.testing.assert_close(running.double(), expected, rtol=1e-5, atol=1e-5)


def test_every_output_element_is_written(monkeypatch):
    """All kernel buffers are poisoned before the kernels."""
    case = CASES[1]
    clean, _, _ = kernel_and_reference(case, torch.float32)
    poison_new_buffers(monkeypatch)
    poisoned, _, _ = kernel_and_reference(case, torch.float32)
    monkeypatch.undo()
    for name in QUANTITY_NAMES:
        assert torch.equal(poisoned[name], clean[name]), name


def test_backward_is_bitwise_deterministic():
    case = CASES[1]
    first, _, _ = kernel_and_reference(case, torch.float32, seed=5, deterministic=True)
    second, _, _ = kernel_and_reference(case, torch.float32, seed=5, deterministic=True)
    for name in QUANTITY_NAMES:
        assert torch.equal(first[name], second[name]), name


def test_packed_equals_each_sequence_alone():
    case = CASES[1]
    inputs, cu_seqlens = random_inputs(case, torch.float32, "cpu", seed=6)
    out_grad = torch.randn(*inputs[0].shape, generator=torch.Generator().manual_seed(7))
    options = dict(case.options, return_indices=True, backend="triton")
    packed, _ = run_with_grads(openmsa.msa_attention, inputs, cu_seqlens, out_grad, 0.0,
                               **options)
    offsets = cu_seqlens.tolist()
    for start, end in zip(offsets, offsets[1:]):
        alone, _ = run_with_grads(openmsa.msa_attention, [t[None, start:end] for t in inputs],
                                  None, out_grad[None, start:end], 0.0, **options)
        for name in ("out",) + tuple(f"d{n}" for n in INPUT_NAMES[:3]):
            torch.testing.assert_close(packed[name][start:end], alone[name][0], rtol=1e-6,
                                       atol=1e-6)


def test_blocks_split_into_many_segments_give_the_same_gradients():
    """Small segments make every key block's dK, dV and d index_k a sum of several programs'
    partials."""
    case = CASES[1]
    whole, _, _ = kernel_and_reference(case, torch.float32, seed=9)
    split, expected, _ = kernel_and_reference(case, torch.float32, seed=9,
                                              tuning=Tuning(segment_pairs=8))
    for name in ("dk", "dv", "dindex_k"):
        torch.testing.assert_close(split[name], whole[name], rtol=1e-5, atol=1e-6)
        assert rel_rms_error(split[name], expected[name]) < 1e-5


def test_long_problems_take_longer_segments():
    """From ``long_segments_min_pairs`` (token, index head, slot) entries on, segments hold
    ``long_segment_pairs``: the forward's list and the backward's reading of it (sizes from the
    shapes alone) agree, and the gradients still match the reference."""
    case = CASES[1]
    short = Tuning(segment_pairs=8, long_segment_pairs=32)
    assert short.segment_pairs_for(1000, 4, 16) == 8
    assert DEFAULT_TUNING.segment_pairs_for(1 << 18, 4, 16) == DEFAULT_TUNING.long_segment_pairs
    tuning = Tuning(segment_pairs=8, long_segment_pairs=32, long_segments_min_pairs=1)
    assert tuning.segment_pairs_for(1, 1, 1) == 32
    got, expected, _ = kernel_and_reference(case, torch.float32, seed=9, tuning=tuning)
    for name in QUANTITY_NAMES:
        assert rel_rms_error(got[name], expected[name]) < TOLERANCE[torch.float32], name


def test_short_problems_with_wide_groups_take_shorter_segments():
    """Below ``short_segments_per_sm`` segments per SM, problems with at least
    ``short_segments_min_heads`` heads per index head cut segments at ``short_segment_pairs``;
    the forward's list and the backward's reading of it (sizes from the shapes alone) agree,
    and the gradients still match the reference."""
    rule = Tuning(segment_pairs=64, short_segment_pairs=8, short_segments_per_sm=4,
                  short_segments_min_heads=2)
    assert rule.segment_pairs_for(10, 2, 3, heads_per_index_head=2, multiprocessors=2) == 8
    assert rule.segment_pairs_for(10, 2, 3, heads_per_index_head=1, multiprocessors=2) == 64
    # 4 x 64 x 2 = 512 entries are enough segments per SM: the usual size.
    assert rule.segment_pairs_for(64, 2, 4, heads_per_index_head=2, multiprocessors=2) == 64
    assert rule.segment_pairs_for(63, 2, 4, heads_per_index_head=2, multiprocessors=2) == 8
    assert DEFAULT_TUNING.segment_pairs_for(1 << 16, 4, 16, heads_per_index_head=16,
                                            multiprocessors=132) == 1024
    for tokens, pairs in ((1 << 12, 512), (1 << 14, 512), (1 << 15, 1024)):
        assert DEFAULT_TUNING.segment_pairs_for(tokens, 4, 16, heads_per_index_head=16,
                                                multiprocessors=132) == pairs
        assert DEFAULT_TUNING.segment_pairs_for(tokens, 4, 16, heads_per_index_head=4,
                                                multiprocessors=132) == 1024
    case = CASES[1]  # 2 heads per index head
    inputs, cu_seqlens = random_inputs(case, torch.float32, "cpu", seed=9)
    packed = [packed_tokens(t.detach()) for t in inputs]
    ids = torch.full((packed[0].shape[0], case.num_index_heads, 3), -1, dtype=torch.int32)
    ids[:, :, 0] = 0
    big = Tuning(segment_pairs=64, short_segment_pairs=8, short_segments_per_sm=10**6,
                 short_segments_min_heads=2)
    for tuning, expected_pairs in ((big, 8), (Tuning(segment_pairs=64, short_segment_pairs=8,
                                                     short_segments_per_sm=10**6,
                                                     short_segments_min_heads=3), 64)):
        problem = SparseAttentionProblem(packed[0], packed[1], ids, cu_seqlens, 64, 1.0,
                                         tuning=tuning)
        assert problem.segment_pairs() == expected_pairs
    got, expected, _ = kernel_and_reference(case, torch.float32, seed=9, tuning=big)
    whole, _, _ = kernel_and_reference(case, torch.float32, seed=9)
    for name in QUANTITY_NAMES:
        assert rel_rms_error(got[name], expected[name]) < TOLERANCE[torch.float32], name
    for name in ("dk", "dv", "dindex_k"):
        assert not torch.equal(got[name], whole[name]), name  # other partial sums: other bits


def test_segment_orders_give_bitwise_equal_gradients():
    """The key-outer programs' order (most pairs first, or by query row) changes nothing but
    timing: each segment writes its own partials, summed in a fixed order."""
    results = []
    for min_segments_per_sm in (0, 10**9):  # by query row always / never
        tuning = Tuning(segment_pairs=8, rows_order_min_segments_per_sm=min_segments_per_sm)
        got, _, _ = kernel_and_reference(CASES[1], torch.float32, seed=15, tuning=tuning,
                                         deterministic=True)
        results.append(got)
    for name in QUANTITY_NAMES:
        assert torch.equal(results[0][name], results[1][name]), name


@pytest.mark.parametrize("case", [
    MSACase("warmup_batch2", batch=2, seqlen=200, num_heads=4, num_kv_heads=2,
            num_index_heads=2, options=dict(block_size=64, warmup=True)),
    MSACase("warmup_packed_gqa3", seqlens=(70, 1, 200, 129), num_heads=6, num_kv_heads=2,
            num_index_heads=2, options=dict(block_size=64, warmup=True, max_seqlen=200)),
], ids=lambda c: c.name)
def test_warmup_kernels_match_reference(case):
    """Warmup runs the sparse kernels with every causal block kept (no membership tests)."""
    inputs, cu_seqlens = random_inputs(case, torch.float32, "cpu", seed=13)
    out_grad = torch.randn(*inputs[0].shape, generator=torch.Generator().manual_seed(14))
    got, _ = run_with_grads(openmsa.msa_attention, inputs, cu_seqlens, out_grad, 1.5,
                            backend="triton", **case.options)
    expected, _ = run_with_grads(openmsa.msa_attention, [t.double() for t in inputs],
                                 cu_seqlens, out_grad, 1.5, backend="reference",
                                 **case.options)
    for name in QUANTITY_NAMES:
        assert rel_rms_error(got[name], expected[name]) < 1e-5, name


RANGE_CASE = MSACase("packed_query_ranges", seqlens=(70, 1, 150, 65), num_heads=4,
                     num_kv_heads=2, num_index_heads=2, options=dict(top_k=2, block_size=64))
# Together every query. 37 and 200 (position 129 of the third sequence) start inside a key block
# and inside a query tile (64 tokens here); the last two ranges cross sequence boundaries.
QUERY_RANGES = ((0, 37), (37, 200), (200, 286))
ONE_SEQUENCE = MSACase("one_sequence_query_ranges", batch=1, seqlen=200, num_heads=4,
                       num_kv_heads=2, num_index_heads=2, options=dict(top_k=2, block_size=64))


@pytest.mark.parametrize("case,ranges,warmup", [
    (RANGE_CASE, QUERY_RANGES, False), (RANGE_CASE, QUERY_RANGES, True),
    (ONE_SEQUENCE, ((0, 37), (37, 130), (130, 200)), False),
], ids=["packed", "packed_warmup", "one_sequence"])
def test_query_ranges_add_up_to_the_full_run(case, ranges, warmup, monkeypatch):
    """Queries that are a range of the keys' tokens (msa_attention's query_start, as context
    parallelism runs them): selection, out and the query-side gradients are the full run's rows;
    the KLs over the global count and the key-side gradients add up to the full run's. New
    buffers are poisoned: the key-side gradients of blocks no query of a range kept must come
    out zero, not unwritten."""
    inputs, cu_seqlens = random_inputs(case, torch.float32, "cpu", seed=15)
    out_grad = torch.randn(*inputs[0].shape, generator=torch.Generator().manual_seed(16))
    options = dict(case.options, warmup=warmup, return_indices=not warmup, backend="triton")
    full, full_ids = run_with_grads(openmsa.msa_attention, inputs, cu_seqlens, out_grad, 1.5,
                                    **options)
    poison_new_buffers(monkeypatch)
    parts = run_query_ranges(openmsa.msa_attention, inputs, cu_seqlens, out_grad, 1.5, ranges,
                             **options)
    for (first, end), (part, ids) in zip(ranges, parts):
        rows = (..., slice(first, end), slice(None), slice(None))
        if not warmup:
            assert same_block_sets(ids, full_ids[rows[:-1]]).all(), (first, end)
        for name in ("out", "dq", "dindex_q"):
            torch.testing.assert_close(part[name][rows], full[name][rows], rtol=1e-5,
                                       atol=1e-6, msg=f"{name} of range {first}..{end}")
    if case is RANGE_CASE:  # the last range's queries start in the third sequence
        last = parts[-1][0]
        for name in ("dk", "dv", "dindex_k"):
            assert torch.count_nonzero(last[name][:71]) == 0, name
    for name in QUANTITY_NAMES:
        total = sum(part[name] for part, _ in parts)
        assert rel_rms_error(total, full[name]) < 1e-5, name


KEY_OUTER_CASE = MSACase("sixteen_heads_per_index_head_packed", seqlens=(200, 1, 130),
                         num_heads=16, num_kv_heads=1, num_index_heads=1,
                         options=dict(top_k=2, block_size=64))
# Tiles of more than one block per kept slot go key-outer, in windows of 120 rows (16 heads x 2
# slots x 64 dims x 4 bytes a row's dQ partials): three windows a pass.
KEY_OUTER_TUNING = Tuning(main_walk_limit_per_slot=1.0, key_outer_partial_bytes=120 * 16 * 2 * 256)


def _count_hard_rows(monkeypatch):
    """Counts the rows that each key-outer pass takes (the patched ``hard_rows``)."""
    counts = []
    original = key_outer_module.hard_rows

    def counted(p, limit, **options):
        hard = original(p, limit, **options)
        counts.append((int(hard.sum()), hard.numel()))
        return hard

    monkeypatch.setattr(key_outer_module, "hard_rows", counted)
    return counts


@pytest.mark.parametrize("case,dtype,tuning", [
    (KEY_OUTER_CASE, torch.float32, KEY_OUTER_TUNING),
    (KEY_OUTER_CASE, torch.float16, KEY_OUTER_TUNING),
    (CASES[1], torch.float32, Tuning(main_walk_limit_per_slot=0.5)),
    # Three heads padded to four, windows of 40 rows.
    (CASES[2], torch.float32, Tuning(main_walk_limit_per_slot=0.5,
                                     key_outer_partial_bytes=40 * 4 * 2 * 256)),
], ids=["gq16_fp32", "gq16_fp16", "packed_with_sink_fp32", "three_heads_fp32"])
def test_key_outer_forward_and_dq_match_reference(case, dtype, tuning, monkeypatch):
    """Tiles whose union holds more than ``main_walk_limit_per_slot * top_k`` blocks take the
    forward and dQ key-outer (per-slot partials merged by log-sum-exp, summed in slot order),
    here over several windows of rows, the other tiles walking: the reference's quantities,
    every element written (new buffers poisoned) and bitwise the same twice."""
    passes = count_calls(monkeypatch, attention_module, {"key_outer_dq": "key_outer_dq"})
    counts = _count_hard_rows(monkeypatch)
    got, expected, _ = kernel_and_reference(case, dtype, seed=4, tuning=tuning)
    assert len(counts) == 2 and all(0 < hard < total for hard, total in counts), counts
    for name in QUANTITY_NAMES:
        error = rel_rms_error(got[name], expected[name])
        assert error < TOLERANCE[dtype], (name, error)
    assert passes == ["key_outer_dq"], passes
    poison_new_buffers(monkeypatch)
    again, _, _ = kernel_and_reference(case, dtype, seed=4, tuning=tuning)
    for name in QUANTITY_NAMES:
        assert torch.equal(again[name], got[name]), name


def _window_bytes(monkeypatch) -> list:
    """The bytes per slot each key-outer pass sized its windows by (the patched ``_windows``):
    the forward's first, then dQ's."""
    sizes = []
    original = key_outer_module._windows

    def recorded(p, bytes_per_slot, *rest):
        sizes.append(bytes_per_slot)
        return original(p, bytes_per_slot, *rest)

    monkeypatch.setattr(key_outer_module, "_windows", recorded)
    return sizes


@pytest.mark.parametrize("dq_partials,dq_bytes", [("float32", 4), ("input", 2)])
def test_key_outer_dq_partials_in_the_chosen_precision(dq_partials, dq_bytes, monkeypatch):
    """fp16 inputs: dQ's partials in fp32 or fp16 (``Tuning.key_outer_dq_partials``), summed in
    fp32; within the precision's tolerance of the reference either way, bitwise the same
    twice."""
    sizes = _window_bytes(monkeypatch)
    tuning = Tuning(main_walk_limit_per_slot=1.0, key_outer_partial_bytes=120 * 16 * 2 * 256,
                    key_outer_dq_partials=dq_partials)
    got, expected, _ = kernel_and_reference(KEY_OUTER_CASE, torch.float16, seed=4,
                                            tuning=tuning)
    head_dim = KEY_OUTER_CASE.head_dim
    assert sizes == [2 * head_dim + 4, dq_bytes * head_dim], sizes
    for name in QUANTITY_NAMES:
        error = rel_rms_error(got[name], expected[name])
        assert error < TOLERANCE[torch.float16], (name, error)
    again, _, _ = kernel_and_reference(KEY_OUTER_CASE, torch.float16, seed=4, tuning=tuning)
    assert torch.equal(again["dq"], got["dq"])


def test_key_outer_dq_partials_must_be_named():
    with pytest.raises(ValueError, match="key_outer_dq_partials"):
        Tuning(key_outer_dq_partials="bfloat16")
    with pytest.raises(ValueError, match="dq_pass: expected one of"):
        Tuning(dq_pass="atomic")


DQ_ATOMIC = Tuning(dq_pass="dkdv_atomic")


def _count_backward_routes(monkeypatch) -> list:
    """Which route each backward took for dq: "walk" (``_walk_dq``) or "dkdv_atomic"
    (``triton_backward_atomic_dq``)."""
    return count_calls(monkeypatch, attention_module, {
        "_walk_dq": "walk", "triton_backward_atomic_dq": "dkdv_atomic"})


@pytest.mark.parametrize("case,dtype,tuning", [
    (KEY_OUTER_CASE, torch.float32, DQ_ATOMIC),
    (KEY_OUTER_CASE, torch.float16, DQ_ATOMIC),
    (CASES[1], torch.float32, DQ_ATOMIC),
    (CASES[2], torch.float32, DQ_ATOMIC),
    # The forward's hard rows key-outer, every row's dQ from dK/dV.
    (KEY_OUTER_CASE, torch.float32, dataclasses.replace(KEY_OUTER_TUNING,
                                                        dq_pass="dkdv_atomic")),
], ids=["gq16_fp32", "gq16_fp16", "packed_with_sink_fp32", "three_heads_fp32",
        "gq16_fp32_key_outer_forward"])
def test_dq_from_dkdv_atomics_matches_reference(case, dtype, tuning, monkeypatch):
    """``Tuning.dq_pass = "dkdv_atomic"``: no dQ walk; every row's dq is added atomically by
    the dK/dV steps (32 rows a step: two tokens of 16 heads, eight of three heads padded to
    four); the reference's quantities, every element written (new buffers poisoned)."""
    routes = _count_backward_routes(monkeypatch)
    poison_new_buffers(monkeypatch)
    got, expected, _ = kernel_and_reference(case, dtype, seed=4, tuning=tuning)
    assert routes == ["dkdv_atomic"], routes
    for name in QUANTITY_NAMES:
        error = rel_rms_error(got[name], expected[name])
        assert error < TOLERANCE[dtype], (name, error)


@pytest.mark.parametrize("case,options", [
    (CASES[4], {}), (CASES[5], {}), (CASES[3], {}), (CASES[1], dict(warmup=True))],
    ids=["one_head_per_index_head", "packed_dilated_window", "block128_d128",
         "packed_warmup"])
def test_dq_from_dkdv_atomics_matches_the_walk(case, options, monkeypatch):
    """More shapes for ``dq_pass = "dkdv_atomic"`` (one head per index head: 32 tokens a step;
    local windows; blocks of 128 and D = 128; warmup's every causal block): dq, dk, dv equal
    the walk's to fp32 rounding. The atomic adds sum in another order, so the allowed error
    scales with each tensor's largest element (a few ulps of it); a wrong term is O(1)."""
    routes = _count_backward_routes(monkeypatch)
    inputs, cu_seqlens = random_inputs(case, torch.float32, "cpu", seed=21)
    out_grad = torch.randn(*inputs[0].shape, generator=torch.Generator().manual_seed(22))
    run = dict(case.options, **options, backend="triton")
    atomic, _ = run_with_grads(tuned_msa_attention(DQ_ATOMIC), inputs, cu_seqlens, out_grad,
                               1.0, **run)
    walked, _ = run_with_grads(openmsa.msa_attention, inputs, cu_seqlens, out_grad, 1.0, **run)
    assert routes == ["dkdv_atomic", "walk"], routes
    for name in ("dq", "dk", "dv"):
        ulps = 4e-6 * walked[name].abs().max().item()
        torch.testing.assert_close(atomic[name], walked[name], rtol=1e-5, atol=ulps, msg=name)


def test_deterministic_keeps_the_dq_walk(monkeypatch):
    """``deterministic=True`` with ``dq_pass = "dkdv_atomic"``: the walk runs (atomic sums
    vary in order), the main gradients bitwise the default tuning's."""
    routes = _count_backward_routes(monkeypatch)
    got, _, _ = kernel_and_reference(KEY_OUTER_CASE, torch.float32, seed=4, tuning=DQ_ATOMIC,
                                     deterministic=True)
    walked, _, _ = kernel_and_reference(KEY_OUTER_CASE, torch.float32, seed=4,
                                        deterministic=True)
    assert routes == ["walk", "walk"], routes
    for name in ("dq", "dk", "dv"):
        assert torch.equal(got[name], walked[name]), name


HARD_ATOMIC_TUNING = dataclasses.replace(KEY_OUTER_TUNING, dq_pass="hard_atomic",
                                         segment_pairs=16)


def _count_hard_atomic_routes(monkeypatch) -> dict:
    """What each backward ran for the rows the walk leaves: "key_outer_dq" or "hard_atomic"
    (``dkdv_with_hard_atomic_dq``), and the segment flags each hard-atomic pass made."""
    seen = dict(routes=count_calls(monkeypatch, attention_module, {
        "key_outer_dq": "key_outer_dq", "dkdv_with_hard_atomic_dq": "hard_atomic"}), flags=[])
    original = key_outer_module.segment_hard

    def recorded(p, hard):
        flags = original(p, hard)
        seen["flags"].append(flags.clone())
        return flags

    monkeypatch.setattr(key_outer_module, "segment_hard", recorded)
    return seen


@pytest.mark.parametrize("case,dtype,tuning", [
    (KEY_OUTER_CASE, torch.float32, HARD_ATOMIC_TUNING),
    (KEY_OUTER_CASE, torch.float16, HARD_ATOMIC_TUNING),
    (CASES[1], torch.float32, Tuning(main_walk_limit_per_slot=0.5, dq_pass="hard_atomic",
                                     segment_pairs=8)),
    # Three heads padded to four: 32-row atomic steps of eight tokens.
    (CASES[2], torch.float32, Tuning(main_walk_limit_per_slot=0.5, dq_pass="hard_atomic",
                                     segment_pairs=8)),
    (CASES[3], torch.float32, Tuning(main_walk_limit_per_slot=0.5, dq_pass="hard_atomic",
                                     segment_pairs=8)),
], ids=["gq16_fp32", "gq16_fp16", "packed_with_sink_fp32", "three_heads_fp32",
        "block128_d128_fp32"])
def test_hard_rows_dq_from_dkdv_atomics_matches_reference(case, dtype, tuning, monkeypatch):
    """``Tuning.dq_pass = "hard_atomic"``: the rows the walk leaves get their dq from the
    dK/dV pass's atomic adds (no key-outer dQ); only the segments holding such a row run on
    the atomic kernel, the others on the plain one, and the walk keeps the other rows: the
    reference's quantities, every element written (new buffers poisoned), with hard and easy
    rows, flagged and unflagged segments."""
    seen = _count_hard_atomic_routes(monkeypatch)
    counts = _count_hard_rows(monkeypatch)
    launches = []
    triton_parts = attention_module.triton_dkdv_parts

    def recorded(*args, segment_hard=None, hard_segments_only=False, **options):
        launches.append((segment_hard is not None, hard_segments_only))
        return triton_parts(*args, segment_hard=segment_hard,
                            hard_segments_only=hard_segments_only, **options)

    monkeypatch.setattr(attention_module, "triton_dkdv_parts", recorded)
    poison_new_buffers(monkeypatch)
    got, expected, _ = kernel_and_reference(case, dtype, seed=4, tuning=tuning)
    assert seen["routes"] == ["hard_atomic"], seen["routes"]
    # The plain pass left the flagged segments, the atomic pass ran them alone.
    assert launches == [(True, False), (True, True)], launches
    assert all(0 < hard < total for hard, total in counts), counts
    (flags,) = seen["flags"]
    assert 0 < int(flags.sum()) < flags.numel(), flags
    for name in QUANTITY_NAMES:
        error = rel_rms_error(got[name], expected[name])
        assert error < TOLERANCE[dtype], (name, error)


def _mixed_segments(p, hard) -> int:
    """The segments of ``p``'s key-block list holding pairs of both hard and easy rows."""
    work, mixed = p.block_work, 0
    for bucket, first in work.segments.tolist():
        if bucket < 0:
            continue
        end = int(work.bucket_start[bucket] + work.bucket_count[bucket])
        tokens = work.pair_token[first:min(first + work.segment_pairs, end)].long()
        flags = hard[tokens, bucket % p.num_index_heads]
        mixed += bool(flags.any() and not flags.all())
    return mixed


def test_segment_hard_flags_the_segments_holding_a_flagged_row():
    """``key_outer.segment_hard``: 1 for a segment of the key-block list holding a pair whose
    (token, index head) is set, else 0 (padding segments too); random flags over four index
    heads, buckets numbered ``global block x Hi + index head``."""
    case = CASES[1]
    inputs, cu = random_inputs(case, torch.float32, "cpu", seed=2)
    q, k, _, index_q, index_k = (t.detach().reshape(-1, *t.shape[-2:]) for t in inputs)
    ids = select_module.select_blocks_fwd(index_q, index_k, cu, top_k=3, block_size=64,
                                          index_softmax_scale=0.3, num_local_blocks=1,
                                          num_sink_blocks=1, return_max=True)[0]
    problem = SparseAttentionProblem(q, k, ids, cu, 64, 64 ** -0.5,
                                     tuning=Tuning(segment_pairs=8))
    hard = (torch.rand(q.shape[0], 4, generator=torch.Generator().manual_seed(3)) < 0.1)
    flags = key_outer_module.segment_hard(problem, hard.to(torch.int8))
    work = problem.block_work
    expected = []
    for bucket, first in work.segments.tolist():
        end = int(work.bucket_start[max(bucket, 0)] + work.bucket_count[max(bucket, 0)])
        tokens = work.pair_token[first:min(first + work.segment_pairs, end)].long()
        expected.append(bucket >= 0 and bool(hard[tokens, bucket % 4].any()))
    assert 0 < sum(expected) < len(expected), expected
    assert flags.tolist() == [int(e) for e in expected]


def test_hard_rows_dq_adds_into_the_hard_rows_alone(monkeypatch):
    """``dq_pass = "hard_atomic"``: the atomic dK/dV steps add into the fp32 dQ sum at the
    hard rows only (the easy rows' adds would be wasted atomics, their sum never read): the
    easy rows, zeroed here before the pass, stay zero, also in segments of both kinds of row
    (segments of 12 pairs here, across the tiles' 8 tokens)."""
    seen = dict(sums=[])
    original_hard_rows = key_outer_module.hard_rows
    original_dq_from_sum = key_outer_module.dq_from_sum

    def zeroing_easy_rows(p, limit, dq_sum=None):
        hard = original_hard_rows(p, limit, dq_sum=dq_sum)
        if dq_sum is not None:  # the backward's call (the forward's gives none)
            dq_sum.view(p.total, p.num_index_heads, p.gq, p.head_dim)[hard == 0] = 0
        return hard

    def recorded(dq_sum, dq, p, hard=None):
        seen["sums"].append((dq_sum.clone(), hard.clone(), p.gq, _mixed_segments(p, hard)))
        return original_dq_from_sum(dq_sum, dq, p, hard=hard)

    monkeypatch.setattr(key_outer_module, "hard_rows", zeroing_easy_rows)
    monkeypatch.setattr(key_outer_module, "dq_from_sum", recorded)
    kernel_and_reference(KEY_OUTER_CASE, torch.float32, seed=4,
                         tuning=dataclasses.replace(HARD_ATOMIC_TUNING, segment_pairs=12))
    ((dq_sum, hard, gq, mixed),) = seen["sums"]
    rows = dq_sum.view(hard.shape[0], hard.shape[1], gq, -1)
    assert 0 < int(hard.sum()) < hard.numel() and mixed > 0, (hard, mixed)
    assert torch.count_nonzero(rows[hard == 0]) == 0
    assert torch.count_nonzero(rows[hard != 0]) > 0


def test_hard_rows_dq_from_dkdv_atomics_with_kl_teachers(monkeypatch):
    """``dq_pass = "hard_atomic"`` with ``kl_value=False`` (the teachers stored by the dK/dV
    pass, both launches of it here): the reference's gradients."""
    from openmsa.ops import pipeline

    seen = _count_hard_atomic_routes(monkeypatch)
    teachers = count_calls(monkeypatch, pipeline, {"kl_from_teacher": "teacher"})
    poison_new_buffers(monkeypatch)
    got, expected, _ = kernel_and_reference(KEY_OUTER_CASE, torch.float32, seed=4,
                                            tuning=HARD_ATOMIC_TUNING, kl_value=False)
    assert seen["routes"] == ["hard_atomic"] and teachers == ["teacher"], (seen, teachers)
    for name in ("out", "dq", "dk", "dv", "dindex_q", "dindex_k"):
        error = rel_rms_error(got[name], expected[name])
        assert error < TOLERANCE[torch.float32], (name, error)


@pytest.mark.parametrize("options,route", [
    (dict(deterministic=True), "key_outer_dq"), (dict(), "key_outer_dq")],
    ids=["deterministic", "sum_past_its_bound"])
def test_hard_rows_dq_falls_back_to_the_key_outer_dq(options, route, monkeypatch):
    """``dq_pass = "hard_atomic"`` with ``deterministic=True`` (atomic sums vary in order), or
    with a dQ sum larger than ``hard_atomic_max_bytes``: the key-outer dQ runs, the gradients
    bitwise those of the walk tuning's."""
    seen = _count_hard_atomic_routes(monkeypatch)
    tuning = HARD_ATOMIC_TUNING
    if not options:
        tuning = dataclasses.replace(tuning, hard_atomic_max_bytes=331 * 16 * 64 * 4 - 1)
    got, _, _ = kernel_and_reference(KEY_OUTER_CASE, torch.float32, seed=4, tuning=tuning,
                                     **options)
    walked, _, _ = kernel_and_reference(
        KEY_OUTER_CASE, torch.float32, seed=4,
        tuning=dataclasses.replace(HARD_ATOMIC_TUNING, dq_pass="walk"), **options)
    assert seen["routes"] == [route, route], seen["routes"]
    for name in ("dq", "dk", "dv"):
        assert torch.equal(got[name], walked[name]), name
    at_bound = dataclasses.replace(HARD_ATOMIC_TUNING, hard_atomic_max_bytes=331 * 16 * 64 * 4)
    kernel_and_reference(KEY_OUTER_CASE, torch.float32, seed=4, tuning=at_bound)
    assert seen["routes"][-1] == "hard_atomic", seen["routes"]


def test_hard_atomic_max_bytes_is_checked():
    for value in (-1, 1.5, True):
        with pytest.raises(ValueError, match="^hard_atomic_max_bytes: expected an int"):
            Tuning(hard_atomic_max_bytes=value)


@pytest.mark.parametrize("tuning,route", [
    (None, "walk"), ("default", "walk"), ("incoherent", "dkdv_atomic"),
    ("adaptive", "walk"), (Tuning(dq_pass="dkdv_atomic"), "dkdv_atomic")],
    ids=["none", "default", "incoherent", "adaptive", "tuning_object"])
def test_msa_attention_runs_the_tuning_it_is_given(tuning, route, monkeypatch):
    """``msa_attention(tuning=...)``: a name of ``configs.TUNINGS`` or a ``Tuning`` picks the
    kernels' routes (the atomic dQ of "incoherent" here); the reference's quantities."""
    routes = _count_backward_routes(monkeypatch)
    inputs, cu_seqlens = random_inputs(CASES[1], torch.float32, "cpu", seed=5)
    out_grad = torch.randn(*inputs[0].shape, generator=torch.Generator().manual_seed(6))
    run = dict(CASES[1].options, return_indices=True, tuning=tuning)
    got, ids = run_with_grads(openmsa.msa_attention, inputs, cu_seqlens, out_grad, 1.0,
                              backend="triton", **run)
    expected, _ = run_with_grads(openmsa.msa_attention, [t.double() for t in inputs],
                                 cu_seqlens, out_grad, 1.0, backend="reference",
                                 block_indices=ids, **run)
    assert routes == [route], routes
    for name in QUANTITY_NAMES:
        assert rel_rms_error(got[name], expected[name]) < TOLERANCE[torch.float32], name


def test_tuning_is_checked_and_eager_only():
    """A tuning that is neither None, a ``Tuning`` nor a known name fails naming ``tuning``,
    in ``msa_attention``, its reference and the layer; under a dispatch mode (as under
    torch.compile) the registered operators run, which take the default tuning only."""
    from torch.utils.flop_counter import FlopCounterMode

    from openmsa.layers import MSAAttention

    inputs, cu_seqlens = random_inputs(CASES[1], torch.float32, "cpu", seed=5)
    run = dict(CASES[1].options, cu_seqlens=cu_seqlens)
    for fn in (openmsa.msa_attention, msa_module.naive_msa_attention):
        with pytest.raises(ValueError,
                           match="^tuning: expected None, a configs.Tuning, an openmsa.AutoTuning"):
            fn(*inputs, tuning="fast", **run)
    with pytest.raises(ValueError, match="^tuning: expected"):
        MSAAttention(64, 4, 2, tuning=Tuning)
    with FlopCounterMode(display=False):
        with pytest.raises(ValueError, match="^tuning: torch.compile, export"):
            openmsa.msa_attention(*inputs, backend="triton", tuning="incoherent", **run)
        openmsa.msa_attention(*inputs, backend="triton", tuning="default", **run)


def test_layer_passes_its_tuning_on(monkeypatch):
    """``MSAAttention(tuning="incoherent")`` runs that tuning's routes in its steps."""
    from openmsa.layers import MSAAttention

    routes = _count_backward_routes(monkeypatch)
    torch.manual_seed(0)
    layer = MSAAttention(128, 4, 2, head_dim=64, num_index_heads=2, top_k=2, block_size=64,
                         backend="triton", tuning="incoherent")
    hidden = torch.randn(1, 200, 128, requires_grad=True)
    out, kl = layer(hidden)
    (out.square().sum() + kl).backward()
    assert routes == ["dkdv_atomic"], routes


@pytest.mark.parametrize("tuning", [
    KEY_OUTER_TUNING, dataclasses.replace(KEY_OUTER_TUNING, dq_pass="dkdv_atomic"),
    HARD_ATOMIC_TUNING], ids=["key_outer_dq", "dq_from_dkdv_atomics", "hard_rows_atomic_dq"])
def test_key_outer_rows_of_query_ranges_add_up_to_the_full_run(tuning, monkeypatch):
    """The key-outer passes on query ranges (rows named relative to ``query_start``): out and
    dq are the full run's rows, with the hard rows' dQ from the key-outer dQ, or every row's
    from the dK/dV pass's atomic sums."""
    counts = _count_hard_rows(monkeypatch)
    ranges = ((0, 150), (150, 331))
    full, parts = full_and_ranges(tuned_msa_attention(tuning), KEY_OUTER_CASE, 8, ranges,
                                  return_indices=True)
    assert all(hard > 0 for hard, _ in counts), counts
    for (first, end), (part, _) in zip(ranges, parts):
        for name in ("out", "dq"):
            torch.testing.assert_close(part[name][first:end], full[name][first:end],
                                       rtol=1e-5, atol=1e-6, msg=f"{name} of {first}..{end}")


def test_walk_limit_follows_the_tuning():
    """0 turns the split off, as does a limit no union can pass or warmup's every block."""
    case = CASES[0]
    inputs, cu = random_inputs(case, torch.float32, "cpu", seed=1)
    q, k = (t.detach().reshape(-1, *t.shape[-2:]) for t in inputs[:2])
    ids = torch.zeros(q.shape[0], 2, 3, dtype=torch.int32)
    ids[:, :, 1:] = -1
    cu = torch.tensor([0, 200, 400], dtype=torch.int32)

    def limit(per_slot, all_causal=False):
        problem = SparseAttentionProblem(q, k, ids, cu, 64, 0.1, all_causal=all_causal,
                                         tuning=Tuning(main_walk_limit_per_slot=per_slot))
        return key_outer_module.walk_limit(problem)

    slots = SparseAttentionProblem(q, k, ids, cu, 64, 0.1).query_work.union.shape[-1]
    assert slots > 7
    assert limit(0.0) == 0 and limit(1.0) == 3 and limit(0.5) == 1
    assert limit(slots / 3) == 0 and limit(1.0, all_causal=True) == 0
    # 400 packed keys hold 7 blocks of 64 at most: no union passes a limit of 7.
    assert limit(2.0) == 6 and limit(2.5) == 0


def test_key_outer_windows_hold_no_more_rows_than_the_queries():
    """A partials budget past the problem's size: one window of every query row, its
    partials sized by the rows, not by the budget."""
    inputs, cu = random_inputs(KEY_OUTER_CASE, torch.float32, "cpu", seed=2)
    q, k, _, index_q, index_k = (t.detach().reshape(-1, *t.shape[-2:]) for t in inputs)
    ids = select_module.select_blocks_fwd(index_q, index_k, cu, top_k=2, block_size=64,
                                          index_softmax_scale=0.3, num_local_blocks=1,
                                          num_sink_blocks=0)
    tuning = Tuning(main_walk_limit_per_slot=1.0, key_outer_partial_bytes=1 << 40)
    problem = SparseAttentionProblem(q, k, ids, cu, 64, 0.1, tuning=tuning)
    hard = torch.ones(problem.total, problem.num_index_heads, dtype=torch.int8)
    rows, windows, counts, _ = key_outer_module._windows(
        problem, 4 * q.shape[-1], hard, problem.block_work_of_rows(hard))
    assert rows == problem.total and windows == [(0, problem.total)]
    assert counts.tolist() == [problem.total * problem.num_index_heads]


def test_index_lse_split_walks_alone_where_no_union_passes_the_limit(monkeypatch):
    """``index_log_sum_exp_key_outer`` at a walk limit no tile's union can pass (the keys'
    blocks) builds no list of left rows and returns the walk's bits; one block less, the
    split runs (its list built) and agrees."""
    inputs, cu = random_inputs(KEY_OUTER_CASE, torch.float32, "cpu", seed=5)
    q, k, _, index_q, index_k = (t.detach().reshape(-1, *t.shape[-2:]) for t in inputs)
    ids, row_max = select_module.select_blocks_fwd(
        index_q, index_k, cu, top_k=2, block_size=64, index_softmax_scale=0.3,
        num_local_blocks=1, num_sink_blocks=0, return_max=True)
    problem = SparseAttentionProblem(q, k, ids, cu, 64, 0.1, index_k, 0.3)
    blocks = -(-q.shape[0] // 64)
    assert problem.union_bound(problem.index_tile_work) == blocks
    built = count_calls(monkeypatch, SparseAttentionProblem, {"block_work_of_rows": "list"})
    walked = attention_module.index_log_sum_exp(index_q, index_k, row_max, problem)
    alone = attention_module.index_log_sum_exp_key_outer(index_q, index_k, row_max, problem,
                                                         walk_limit=blocks)
    assert built == [] and torch.equal(alone, walked)
    split = attention_module.index_log_sum_exp_key_outer(index_q, index_k, row_max, problem,
                                                         walk_limit=blocks - 1)
    assert built == ["list"]
    torch.testing.assert_close(split, walked, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window_rows", [1, 7, 64, 1000])
def test_window_bounds_cut_each_segment_at_the_windows_rows(window_rows):
    """``window_bounds``: per segment of a key-block list (its padding segments too) and per
    window, the first pair whose query row is at least the window's first row, as a search
    over the segment's rows in torch finds it; windows past the last row end at the segment's
    end."""
    gen = torch.Generator().manual_seed(3)
    total, heads, top_k, block = 300, 2, 3, 16
    ids = torch.randint(0, total // block, (total, heads, top_k), generator=gen)
    positions = torch.arange(total)[:, None, None]
    ids = torch.where(ids * block <= positions, ids, -1).to(torch.int32)
    cu = torch.tensor([0, total], dtype=torch.int32)
    pairs = 8  # small segments: blocks hold several
    work = build_block_work(ids, cu, block, pairs, 0, total, "rows")
    segments = work.segments.shape[0]
    windows = -(-total // window_rows)
    bounds = key_outer_module.window_bounds(work, total, window_rows, windows)
    assert bounds.shape == (segments, windows + 1)
    rows = torch.clamp(torch.arange(windows + 1) * window_rows, max=total)
    padding = 0
    for segment in range(segments):
        bucket, first = (int(x) for x in work.segments[segment])
        if bucket < 0:
            padding += 1
            assert bool((bounds[segment] == bounds[segment, 0]).all()), segment
            continue
        end = int(work.bucket_start[bucket] + work.bucket_count[bucket])
        last = min(first + pairs, end)
        tokens = work.pair_token[first:last].long()
        assert bool((tokens[1:] >= tokens[:-1]).all())  # the order the search relies on
        expected = first + torch.searchsorted(tokens, rows, right=False)
        assert torch.equal(bounds[segment].long(), expected), segment
    assert segments - padding > 10


@pytest.mark.parametrize("tuning,route", [
    ("incoherent", ["dkdv_atomic"]), (HARD_ATOMIC_TUNING, ["walk"])],
    ids=["incoherent", "hard_rows_atomic_dq"])
def test_sparse_attention_runs_the_tuning_it_is_given(tuning, route, monkeypatch):
    """``sparse_attention(tuning=...)`` (a sharing layer's main attention): the tuning's dQ
    route, the reference's gradients; a selection handed on under another tuning is not
    reused (its key-block list's segments follow the tuning), one under the same is."""
    routes = _count_backward_routes(monkeypatch)
    inputs, cu_seqlens = random_inputs(KEY_OUTER_CASE, torch.float32, "cpu", seed=7)
    q, k, v = (t.detach().requires_grad_() for t in inputs[:3])
    run = dict(KEY_OUTER_CASE.options, return_indices=True, cu_seqlens=cu_seqlens)
    _, _, ids = openmsa.msa_attention(q, k, v, *inputs[3:], backend="triton", **run)
    block_size = run["block_size"]
    sparse = dict(block_size=block_size, cu_seqlens=cu_seqlens)
    resolved = resolve_tuning(tuning)
    assert msa_module.HandedOnSelection.of(ids, q, k, cu_seqlens, q.shape[-2], block_size, 0,
                                           resolved) is None
    assert msa_module.HandedOnSelection.of(ids, q, k, cu_seqlens, q.shape[-2], block_size, 0,
                                           DEFAULT_TUNING) is not None
    out = openmsa.sparse_attention(q, k, v, ids, **sparse, backend="triton",
                                   tuning=tuning)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    assert routes == route, routes
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    expected_out = openmsa.sparse_attention(qd, kd, vd, ids, **sparse,
                                            backend="reference")
    expected = torch.autograd.grad(expected_out, (qd, kd, vd), dout.double())
    assert rel_rms_error(out, expected_out) < TOLERANCE[torch.float32]
    for name, a, b in zip("qkv", got, expected):
        assert rel_rms_error(a, b) < TOLERANCE[torch.float32], name
    with pytest.raises(ValueError, match="^tuning: expected None"):
        openmsa.sparse_attention(q, k, v, ids, **sparse, tuning="fast")
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False):
        with pytest.raises(ValueError, match="^tuning: torch.compile, export"):
            openmsa.sparse_attention(q, k, v, ids, **sparse, backend="triton",
                                     tuning=tuning)
