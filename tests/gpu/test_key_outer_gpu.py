"""The key-outer forward and dQ (``attention.key_outer``) on the GPU, next to the Gluon walk of
the other tiles: bf16 against the fp32 reference (within twice the reference's own bf16 error),
and bitwise the same twice. Skipped without a GPU."""

import json
import os

import pytest
import torch

from openmsa.ops.attention import key_outer
from openmsa.ops.configs import Tuning
from openmsa.testing import (TOLERANCE, MSACase, compare_with_reference, random_inputs,
                             run_with_grads, tuned_msa_attention)

# Random index inputs: neighbouring tokens keep different blocks, so most tiles go key-outer.
CASES = [
    MSACase("paper_groups", batch=1, seqlen=4096, num_heads=16, num_kv_heads=2,
            num_index_heads=4, head_dim=128, index_head_dim=128,
            options=dict(top_k=16, block_size=128)),
    MSACase("wide_group", batch=1, seqlen=4096, num_heads=64, num_kv_heads=4, num_index_heads=4,
            head_dim=128, index_head_dim=128, options=dict(top_k=8, block_size=128)),
    MSACase("packed_d64_block64", seqlens=(1000, 1, 2100, 640), num_heads=8, num_kv_heads=2,
            num_index_heads=2, options=dict(top_k=8, block_size=64, num_sink_blocks=1,
                                            num_local_blocks=2)),
]
# One block per kept slot (at 4k tokens a union holds at most 32 blocks); windows of partials of
# 64 MiB (several a pass).
TUNING = Tuning(main_walk_limit_per_slot=1.0, key_outer_partial_bytes=64 << 20)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_bf16_key_outer_within_twice_the_reference_error(case, monkeypatch):
    counts = []
    original = key_outer.hard_rows

    def counted(p, limit):
        hard = original(p, limit)
        counts.append(hard.float().mean().item())
        return hard

    monkeypatch.setattr(key_outer, "hard_rows", counted)
    comparison = compare_with_reference(tuned_msa_attention(TUNING), case, torch.bfloat16,
                                        "cuda")
    record = os.environ.get("OPENMSA_GPU_RECORD")
    if record:
        with open(record, "a") as f:
            f.write(json.dumps({"test": "key_outer_bf16", "case": case.name,
                                "hard_row_share": counts, "errors": comparison.errors,
                                "reference_bf16_errors": comparison.baseline_errors}) + "\n")
    print(case.name, counts, {n: f"{e:.2e}/{comparison.baseline_errors[n]:.2e}"
                              for n, e in comparison.errors.items()})
    assert counts and all(share > 0 for share in counts), counts
    assert comparison.passed(TOLERANCE[torch.bfloat16]), comparison.errors


def test_key_outer_is_bitwise_deterministic():
    """deterministic=True (d index_k then without atomics): two runs bitwise equal."""
    case = CASES[1]
    inputs, _ = random_inputs(case, torch.bfloat16, "cuda", seed=3)
    out_grad = torch.randn_like(inputs[0])
    runs = [run_with_grads(tuned_msa_attention(TUNING), inputs, None, out_grad, 1.0,
                           deterministic=True, **case.options)[0] for _ in range(2)]
    for name, value in runs[0].items():
        assert torch.equal(value, runs[1][name]), name
