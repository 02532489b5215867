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
