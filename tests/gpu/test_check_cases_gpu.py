"""``openmsa check``'s GPU cases as tests: msa_attention (Triton kernels on CUDA) in bf16 against
the fp32 reference, within 2x the reference's own bf16 error. Skipped without a GPU."""

import pytest
import torch

from openmsa import cli, msa_attention
from openmsa.testing import TOLERANCE, compare_with_reference


@pytest.mark.parametrize("case", cli.GPU_CASES, ids=lambda c: c.name)
def test_auto_backend_bf16_matches_fp32_reference(case):
    comparison = compare_with_reference(msa_attention, case, torch.bfloat16, "cuda")
    assert comparison.passed(TOLERANCE[torch.bfloat16]), comparison.errors


def test_forced_blocks_filling_top_k_run_the_index_sum_with_a_running_maximum():
    """top_k = num_local_blocks + num_sink_blocks: selection gives no row maxima, so the index
    log-sum-exp next to the Hopper forward keeps a running maximum (as with fp8 selection)."""
    from openmsa.testing import MSACase

    case = MSACase("forced_fill", batch=1, seqlen=3000, num_heads=16, num_kv_heads=2,
                   num_index_heads=4, head_dim=128, index_head_dim=128,
                   options=dict(top_k=3, block_size=128, num_local_blocks=2, num_sink_blocks=1))
    comparison = compare_with_reference(msa_attention, case, torch.bfloat16, "cuda")
    assert comparison.passed(TOLERANCE[torch.bfloat16]), comparison.errors
