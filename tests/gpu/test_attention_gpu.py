"""Sparse attention kernels in bf16 on the GPU against the fp32 reference (FlashAttention's rule:
error at most 2x the reference's own bf16 error), and bitwise determinism. Skipped without a GPU."""

import json
import os

import pytest
import torch

from openmsa import msa_attention
from openmsa.cli import TOLERANCE
from openmsa.testing import (MSACase, compare_with_reference, random_inputs, rel_rms_error,
                             run_with_grads)

CASES = [
    MSACase("paper_groups", batch=1, seqlen=4096, num_heads=16, num_kv_heads=2,
            num_index_heads=4, head_dim=128, index_head_dim=128,
            options=dict(top_k=16, block_size=128)),
    MSACase("wide_group", batch=1, seqlen=2048, num_heads=64, num_kv_heads=4, num_index_heads=4,
            head_dim=128, index_head_dim=128, options=dict(top_k=8, block_size=128)),
    MSACase("packed_d64_block64", seqlens=(1000, 1, 2100, 640), num_heads=8, num_kv_heads=2,
            num_index_heads=2, options=dict(top_k=8, block_size=64, num_sink_blocks=1,
                                            num_local_blocks=2)),
    MSACase("batch2_gqa3", batch=2, seqlen=1500, num_heads=12, num_kv_heads=2,
            num_index_heads=4, num_index_kv_heads=2, head_dim=128,
            options=dict(top_k=4, block_size=128)),
    # Warmup: batch rows run the main attention on cuDNN, packed input on the Triton kernels.
    MSACase("warmup_batch2", batch=2, seqlen=1500, num_heads=16, num_kv_heads=2,
            num_index_heads=4, head_dim=128, index_head_dim=128,
            options=dict(block_size=128, warmup=True)),
    MSACase("warmup_packed", seqlens=(700, 1, 1300), num_heads=8, num_kv_heads=2,
            num_index_heads=2, head_dim=128, index_head_dim=128,
            options=dict(block_size=128, warmup=True)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_bf16_kernels_within_twice_the_reference_error(case):
    comparison = compare_with_reference(msa_attention, case, torch.bfloat16, "cuda")
    record = os.environ.get("OPENMSA_GPU_RECORD")
    if record:
        with open(record, "a") as f:
            f.write(json.dumps({"test": "attention_bf16", "case": case.name,
                                "errors": comparison.errors,
                                "reference_bf16_errors": comparison.baseline_errors}) + "\n")
    print(case.name, {n: f"{e:.2e}/{comparison.baseline_errors[n]:.2e}"
                      for n, e in comparison.errors.items()})
    assert comparison.passed(TOLERANCE[torch.bfloat16]), comparison.errors


def test_warmup_on_cudnn_matches_warmup_on_the_triton_kernels():
    """deterministic=True keeps warmup on the Triton kernels; both paths agree to bf16 noise."""
    case = CASES[4]
    inputs, _ = random_inputs(case, torch.bfloat16, "cuda", seed=5)
    out_grad = torch.randn(*inputs[0].shape, device="cuda")
    cudnn, _ = run_with_grads(msa_attention, inputs, None, out_grad, 1.0, **case.options)
    kernels, _ = run_with_grads(msa_attention, inputs, None, out_grad, 1.0, deterministic=True,
                                **case.options)
    for name, value in cudnn.items():
        assert rel_rms_error(value, kernels[name]) < 2e-2, name


def test_default_kl_path_agrees_with_the_deterministic_one():
    """The default KL (one key-outer pass, atomic adds) and deterministic=True's (a query-side
    walk more) compute the same sums in different orders."""
    case = CASES[0]
    inputs, _ = random_inputs(case, torch.bfloat16, "cuda", seed=4)
    out_grad = torch.randn(*inputs[0].shape, device="cuda")
    fast, _ = run_with_grads(msa_attention, inputs, None, out_grad, 1.0, **case.options)
    ordered, _ = run_with_grads(msa_attention, inputs, None, out_grad, 1.0, deterministic=True,
                                **case.options)
    for name in ("out", "dq", "dk", "dv"):
        assert torch.equal(fast[name], ordered[name]), name
    for name in ("kl", "dindex_q", "dindex_k"):
        assert rel_rms_error(fast[name], ordered[name]) < 1e-2, name


def test_bf16_gradients_are_bitwise_deterministic():
    case = CASES[0]
    inputs, _ = random_inputs(case, torch.bfloat16, "cuda", seed=3)
    out_grad = torch.randn(*inputs[0].shape, device="cuda")
    first, _ = run_with_grads(msa_attention, inputs, None, out_grad, 1.0, deterministic=True,
                              **case.options)
    second, _ = run_with_grads(msa_attention, inputs, None, out_grad, 1.0, deterministic=True,
                               **case.options)
    for name, value in first.items():
        assert torch.equal(value, second[name]), name
