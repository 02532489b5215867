"""Query ranges (sequence parallelism's building block) on the GPU in bf16: ranges that start
inside key blocks and query tiles add up to one run over every query. Skipped without a GPU."""

import pytest
import torch

from openmsa import msa_attention
from openmsa.testing import (QUANTITY_NAMES, MSACase, random_inputs, rel_rms_error,
                             run_query_ranges, run_with_grads, same_block_sets)

CASES = [
    (MSACase("batch_of_one", batch=1, seqlen=3000, num_heads=16, num_kv_heads=2,
             num_index_heads=4, head_dim=128, index_head_dim=128,
             options=dict(top_k=8, block_size=128)),
     ((0, 700), (700, 1901), (1901, 3000))),
    (MSACase("packed", seqlens=(1000, 1, 2100, 640), num_heads=8, num_kv_heads=2,
             num_index_heads=2, options=dict(top_k=8, block_size=64, num_sink_blocks=1)),
     ((0, 1203), (1203, 3741))),
]


@pytest.mark.parametrize("warmup", [False, True], ids=["sparse", "warmup"])
@pytest.mark.parametrize("case,ranges", CASES, ids=[c.name for c, _ in CASES])
def test_bf16_query_ranges_add_up_to_the_full_run(case, ranges, warmup):
    inputs, cu_seqlens = random_inputs(case, torch.bfloat16, "cuda", seed=21)
    out_grad = torch.randn(*inputs[0].shape, device="cuda")
    # deterministic=True: the full run's warmup stays on the Triton kernels, like the ranges'.
    options = dict(case.options, warmup=warmup, return_indices=not warmup, deterministic=True)
    full, full_ids = run_with_grads(msa_attention, inputs, cu_seqlens, out_grad, 1.5, **options)
    parts = run_query_ranges(msa_attention, inputs, cu_seqlens, out_grad, 1.5, ranges,
                             **options)
    for (first, end), (part, ids) in zip(ranges, parts):
        rows = (..., slice(first, end), slice(None), slice(None))
        if not warmup:  # bf16 scores may break near-ties differently: compare most rows
            assert same_block_sets(ids, full_ids[rows[:-1]]).float().mean() > 0.99
        for name in ("out", "dq", "dindex_q"):
            assert rel_rms_error(part[name][rows], full[name][rows]) < 1e-2, (name, first)
    for name in QUANTITY_NAMES:
        total = sum(part[name] for part, _ in parts)
        assert rel_rms_error(total, full[name]) < 1e-2, name
