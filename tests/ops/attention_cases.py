"""Problem shapes, the kernels-against-reference run and the monkeypatching helpers that
tests/ops/test_attention.py and tests/ops/test_kl.py share (CPU interpreter)."""

import torch

import openmsa
from openmsa.testing import (MSACase, random_inputs, run_query_ranges, run_with_grads,
                             tuned_msa_attention)

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
    MSACase("packed_dilated_window", seqlens=(260, 1, 330), num_heads=4, num_kv_heads=2,
            num_index_heads=2, options=dict(top_k=4, block_size=64, num_local_blocks=2,
                                            local_block_dilation=2)),
]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}


def kernel_and_reference(case, dtype, seed=0, tuning=None, **extra_options):
    """The kernels' out, kl and gradients (``backend="triton"``; with ``tuning``, at those
    work-list sizes), the reference's in float64 on the kernels' kept blocks, and the blocks."""
    inputs, cu_seqlens = random_inputs(case, dtype, "cpu", seed=seed)
    out_grad = torch.randn(*inputs[0].shape, generator=torch.Generator().manual_seed(seed + 1))
    options = dict(case.options, return_indices=True, **extra_options)
    kernels = openmsa.msa_attention if tuning is None else tuned_msa_attention(tuning)
    got, ids = run_with_grads(kernels, inputs, cu_seqlens, out_grad, 1.0, backend="triton",
                              **options)
    high = [t.double() for t in inputs]
    expected, _ = run_with_grads(openmsa.msa_attention, high, cu_seqlens, out_grad, 1.0,
                                 backend="reference", block_indices=ids, **options)
    return got, expected, ids


def poison_new_buffers(monkeypatch):
    """Fills every tensor torch.empty / empty_like make from now on with NaN (floats) or -7777
    (ints): an element a kernel should write but does not shows."""
    original_empty, original_empty_like = torch.empty, torch.empty_like

    def poison(tensor):
        return tensor.fill_(float("nan") if tensor.is_floating_point() else -7777)

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(original_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like",
                        lambda *a, **kw: poison(original_empty_like(*a, **kw)))


def count_calls(monkeypatch, module, kinds: dict) -> list:
    """Records, in call order, the kind (``kinds[name]``) of each call from now on to the
    functions ``module`` holds under the names in ``kinds`` (still called through)."""
    calls = []
    for name, kind in kinds.items():
        original = getattr(module, name)

        def counted(*args, original=original, kind=kind, **kwargs):
            calls.append(kind)
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return calls


def full_and_ranges(fn, case, seed, ranges, **options):
    """``fn``'s values and gradients (fp32, CPU) over every query of ``case``'s random problem
    and over each query range ``(first, end)`` of ``ranges`` (``run_query_ranges``): the full
    run's and the ranges' ``(values, indices)``."""
    inputs, cu_seqlens = random_inputs(case, torch.float32, "cpu", seed=seed)
    out_grad = torch.randn(*inputs[0].shape, generator=torch.Generator().manual_seed(seed + 1))
    run = dict(case.options, **options)
    full, _ = run_with_grads(fn, inputs, cu_seqlens, out_grad, 1.0, **run)
    return full, run_query_ranges(fn, inputs, cu_seqlens, out_grad, 1.0, ranges, **run)
