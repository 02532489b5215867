"""The Triton sparse attention (forward and backward) against the reference, under the CPU
interpreter, on the same kept blocks."""

import math

import pytest
import torch

import openmsa
from openmsa.ops import attention as attention_module
from openmsa.ops import msa as msa_module
from openmsa.ops import select as select_module
from openmsa.ops.layout import ids_to_token_major, packed_offsets, packed_tokens
from openmsa.testing import (INPUT_NAMES, QUANTITY_NAMES, MSACase, random_inputs, rel_rms_error,
                             run_query_ranges, run_with_grads, same_block_sets)

pytestmark = pytest.mark.skipif(not msa_module.INTERPRETING,
                                reason="needs TRITON_INTERPRET=1 (the README's test command)")

CASES = [
    MSACase("batch2_partial_block", batch=2, seqlen=200, num_heads=4, num_kv_heads=2,
            num_index_heads=2, options=dict(top_k=3, block_size=64)),
    MSACase("packed_with_sink", seqlens=(70, 1, 150, 65), num_heads=8, num_kv_heads=2,
            num_index_heads=4, num_index_kv_heads=2,
            options=dict(top_k=3, block_size=64, num_sink_blocks=1)),
    MSACase("three_heads_per_index_head", batch=1, seqlen=200, num_heads=6, num_kv_heads=2,
            num_index_heads=2, options=dict(top_k=2, block_size=64)),
    MSACase("block_128_head_dim_128", batch=1, seqlen=300, num_heads=4, num_kv_heads=1,
            num_index_heads=1, head_dim=128, options=dict(top_k=2, block_size=128)),
    MSACase("one_main_head_per_index_head", batch=1, seqlen=140, num_heads=4, num_kv_heads=4,
            num_index_heads=4, options=dict(top_k=1, block_size=64, softmax_scale=0.3)),
]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}


def _kernel_and_reference(case, dtype, seed=0, **extra_options):
    inputs, cu_seqlens = random_inputs(case, dtype, "cpu", seed=seed)
    out_grad = torch.randn(*inputs[0].shape, generator=torch.Generator().manual_seed(seed + 1))
    options = dict(case.options, return_indices=True, **extra_options)
    got, ids = run_with_grads(openmsa.msa_attention, inputs, cu_seqlens, out_grad, 1.0,
                              backend="triton", **options)
    high = [t.double() for t in inputs]
    expected, _ = run_with_grads(openmsa.msa_attention, high, cu_seqlens, out_grad, 1.0,
                                 backend="reference", block_indices=ids, **options)
    return got, expected, ids


DTYPE_CASES = [(case, torch.float32) for case in CASES] + [
    (case, torch.float16) for case in CASES[:2]]  # fp16 on two cases keeps the CPU suite short


@pytest.mark.parametrize("case,dtype", DTYPE_CASES,
                         ids=lambda x: str(x).replace("torch.", "") if isinstance(
                             x, torch.dtype) else x.name)
def test_msa_attention_kernels_match_reference(case, dtype):
    got, expected, _ = _kernel_and_reference(case, dtype)
    for name in QUANTITY_NAMES:
        error = rel_rms_error(got[name], expected[name])
        assert error < TOLERANCE[dtype], (name, error)


SCALED = MSACase("scales_not_the_defaults", seqlens=(100, 130), num_heads=4, num_kv_heads=2,
                 num_index_heads=2, options=dict(top_k=2, block_size=64, softmax_scale=0.3,
                                                 index_softmax_scale=0.7))


@pytest.mark.parametrize("case", CASES[1:3] + [SCALED], ids=lambda c: c.name)
def test_deterministic_kl_path_matches_reference(case):
    """deterministic=True takes the KL's value and index_q gradient from the query-side walk
    instead of the key-outer kernel's atomic adds; both walks use the given scales."""
    got, expected, _ = _kernel_and_reference(case, torch.float32, deterministic=True)
    for name in QUANTITY_NAMES:
        error = rel_rms_error(got[name], expected[name])
        assert error < TOLERANCE[torch.float32], (name, error)


@pytest.mark.parametrize("deterministic", [False, True])
def test_kl_value_without_gradients_uses_the_given_scales(deterministic):
    """No gradient needed: the value alone comes from the query-side walk, with the given
    main and index scales (the default scales would give another KL)."""
    inputs, cu_seqlens = random_inputs(SCALED, torch.float32, "cpu", seed=17)
    tensors = [t.detach() for t in inputs]
    options = dict(SCALED.options, cu_seqlens=cu_seqlens, deterministic=deterministic)
    with torch.no_grad():
        _, kl, ids = openmsa.msa_attention(*tensors, backend="triton", return_indices=True,
                                           **options)
        _, expected = openmsa.msa_attention(*(t.double() for t in tensors),
                                            backend="reference", block_indices=ids, **options)
        _, at_default_scales = openmsa.msa_attention(
            *(t.double() for t in tensors), backend="reference", block_indices=ids,
            **dict(options, softmax_scale=None, index_softmax_scale=None))
    assert rel_rms_error(kl, expected) < 1e-5
    assert rel_rms_error(at_default_scales, expected) > 1e-2  # the scales matter here


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
    problem = attention_module.SparseAttentionProblem(
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


@pytest.mark.parametrize("query_range", [(0, 400), (45, 330)])
def test_index_log_sum_exp_alone_on_wider_tiles(query_range):
    """Next to the Hopper forward the index log-sum-exp runs alone on tiles of
    INDEX_TILE_TOKENS tokens (the main tiles hold 8 at 16 heads per index head), also for a
    query range: against logsumexp of each packed sequence's masked index scores."""
    first, end = query_range
    case = MSACase("sixteen_heads_per_index_head", seqlens=(150, 1, 249), num_heads=16,
                   num_kv_heads=1, num_index_heads=1)
    inputs, cu = random_inputs(case, torch.float32, "cpu", seed=6)
    q, k, v, index_q, index_k = (t.detach().reshape(-1, *t.shape[-2:]) for t in inputs)
    q, index_q = q[first:end], index_q[first:end]
    ids, row_max = select_module.select_blocks_fwd(
        index_q, index_k, cu, top_k=3, block_size=64, index_softmax_scale=0.3,
        num_local_blocks=1, num_sink_blocks=0, query_start=first, return_max=True)
    problem = attention_module.SparseAttentionProblem(q, k, ids, cu, 64, 64 ** -0.5, index_k,
                                                      0.3, query_start=first)
    assert problem.query_tokens < attention_module.INDEX_TILE_TOKENS
    assert problem.index_tile_work.tile_tokens == attention_module.INDEX_TILE_TOKENS
    alone = attention_module.index_log_sum_exp(index_q, index_k, row_max, problem)

    expected = torch.empty(end - first, 1, dtype=torch.float64)
    offsets = cu.tolist()
    for start, stop in zip(offsets, offsets[1:]):
        lo, hi = max(start, first), min(stop, end)  # this sequence's queries in the range
        if hi <= lo:
            continue
        positions = torch.arange(lo, hi) - start
        keys = torch.arange(stop - start)
        kept_blocks = ids[lo - first:hi - first, 0].long()  # [queries, top_k], -1 unused
        kept = ((kept_blocks[:, :, None] == (keys // 64)[None, None, :]).any(1)
                & (keys[None, :] <= positions[:, None]))
        z = 0.3 * index_q[lo - first:hi - first, 0].double() @ index_k[start:stop, 0].double().T
        expected[lo - first:hi - first, 0] = torch.logsumexp(
            z.masked_fill(~kept, float("-inf")), -1)
    torch.testing.assert_close(alone.double(), expected, rtol=1e-5, atol=1e-5)


def test_kl_value_and_index_k_gradient_need_no_index_q_gradient():
    """Without gradients the value comes from the query-side walk alone; with only index_k
    requiring one, the forward still computes the KL's gradients."""
    case = CASES[1]
    inputs, cu_seqlens = random_inputs(case, torch.float32, "cpu", seed=13)
    options = dict(case.options, backend="triton", cu_seqlens=cu_seqlens)
    q, k, v, index_q, index_k = (t.detach() for t in inputs)
    full_index_k = index_k.clone().requires_grad_()
    _, full_kl = openmsa.msa_attention(q, k, v, index_q.clone().requires_grad_(), full_index_k,
                                       **options)
    expected = torch.autograd.grad(full_kl, full_index_k)[0]
    with torch.no_grad():
        _, value_only = openmsa.msa_attention(q, k, v, index_q, index_k, **options)
    torch.testing.assert_close(value_only, full_kl.detach(), rtol=1e-5, atol=0)
    index_k_only = index_k.clone().requires_grad_()
    _, kl = openmsa.msa_attention(q, k, v, index_q, index_k_only, **options)
    torch.testing.assert_close(torch.autograd.grad(kl, index_k_only)[0], expected, rtol=1e-5,
                               atol=1e-7)


def test_kl_gradient_scales_with_the_weight_on_kl():
    """Loss scaling composes: the index gradients are exactly linear in the KL weight."""
    case = CASES[0]
    inputs, _ = random_inputs(case, torch.float32, "cpu", seed=12)
    out_grad = torch.zeros(*inputs[0].shape)
    options = dict(case.options, backend="triton")
    one, _ = run_with_grads(openmsa.msa_attention, inputs, None, out_grad, 1.0, **options)
    four, _ = run_with_grads(openmsa.msa_attention, inputs, None, out_grad, 4.0, **options)
    for name in ("dindex_q", "dindex_k"):
        torch.testing.assert_close(four[name], 4 * one[name], rtol=1e-6, atol=0)
    assert torch.count_nonzero(one["dq"]) == 0  # kl sends nothing to q, k, v


def _poison_new_buffers(monkeypatch):
    """Fills every tensor torch.empty / empty_like make from now on with NaN (floats) or -7777
    (ints): an element a kernel should write but does not shows."""
    original_empty, original_empty_like = torch.empty, torch.empty_like

    def poison(tensor):
        return tensor.fill_(float("nan") if tensor.is_floating_point() else -7777)

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(original_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like",
                        lambda *a, **kw: poison(original_empty_like(*a, **kw)))


def test_every_output_element_is_written(monkeypatch):
    """All kernel buffers are poisoned before the kernels."""
    case = CASES[1]
    clean, _, _ = _kernel_and_reference(case, torch.float32)
    _poison_new_buffers(monkeypatch)
    poisoned, _, _ = _kernel_and_reference(case, torch.float32)
    monkeypatch.undo()
    for name in QUANTITY_NAMES:
        assert torch.equal(poisoned[name], clean[name]), name


def test_backward_is_bitwise_deterministic():
    case = CASES[1]
    first, _, _ = _kernel_and_reference(case, torch.float32, seed=5, deterministic=True)
    second, _, _ = _kernel_and_reference(case, torch.float32, seed=5, deterministic=True)
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



def test_blocks_split_into_many_segments_give_the_same_gradients(monkeypatch):
    """Small segments make every key block's dK, dV and d index_k a sum of several programs'
    partials."""
    case = CASES[1]
    whole, _, _ = _kernel_and_reference(case, torch.float32, seed=9)
    monkeypatch.setattr(attention_module, "SEGMENT_PAIRS", 8)
    split, expected, _ = _kernel_and_reference(case, torch.float32, seed=9)
    for name in ("dk", "dv", "dindex_k"):
        torch.testing.assert_close(split[name], whole[name], rtol=1e-5, atol=1e-6)
        assert rel_rms_error(split[name], expected[name]) < 1e-5


def test_long_problems_take_longer_segments(monkeypatch):
    """From LONG_SEGMENTS_MIN_PAIRS (token, index head, slot) entries on, segments hold
    LONG_SEGMENT_PAIRS: the forward's list and the backward's reading of it (sizes from the
    shapes alone) agree, and the gradients still match the reference."""
    case = CASES[1]
    monkeypatch.setattr(attention_module, "SEGMENT_PAIRS", 8)
    monkeypatch.setattr(attention_module, "LONG_SEGMENT_PAIRS", 32)
    assert attention_module.segment_pairs(1000, 4, 16) == 8
    monkeypatch.setattr(attention_module, "LONG_SEGMENTS_MIN_PAIRS", 1)
    assert attention_module.segment_pairs(1, 1, 1) == 32
    got, expected, _ = _kernel_and_reference(case, torch.float32, seed=9)
    for name in QUANTITY_NAMES:
        assert rel_rms_error(got[name], expected[name]) < TOLERANCE[torch.float32], name


def test_segment_orders_give_bitwise_equal_gradients(monkeypatch):
    """The key-outer programs' order (most pairs first, or by query row) changes nothing but
    timing: each segment writes its own partials, summed in a fixed order."""
    monkeypatch.setattr(attention_module, "SEGMENT_PAIRS", 8)
    results = []
    for min_segments_per_sm in (0, 10**9):  # by query row always / never
        monkeypatch.setattr(attention_module, "ROWS_ORDER_MIN_SEGMENTS_PER_SM",
                            min_segments_per_sm)
        got, _, _ = _kernel_and_reference(CASES[1], torch.float32, seed=15, deterministic=True)
        results.append(got)
    for name in QUANTITY_NAMES:
        assert torch.equal(results[0][name], results[1][name]), name


def test_kl_kernel_with_several_steps_per_segment(monkeypatch):
    """8 pairs per step of the KL kernel: every segment takes several steps."""
    monkeypatch.setattr(attention_module, "KL_PAIRS", 8)
    got, expected, _ = _kernel_and_reference(CASES[1], torch.float32, seed=14)
    for name in ("kl", "dindex_q", "dindex_k"):
        assert rel_rms_error(got[name], expected[name]) < 1e-5, name


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
    _poison_new_buffers(monkeypatch)
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
