"""The fp8 index branch on the GPU (SPEC section 8). Skipped without a GPU (and, for the kernels,
on GPUs without fp8 tensor cores).

The kernel scores e4m3 codes on the fp8 tensor cores; the reference scores the same codes and
scales in fp32. Their kept sets may differ only where the fp8 accumulation's rounding swaps two
blocks whose scores nearly tie, so at least 99.5% of the rows must agree (SPEC section 8's bar).
"""

import json
import os

import pytest
import torch

import openmsa
from openmsa.bench.selection import index_inputs
from openmsa.ops.quantize import quantize_rows_e4m3, quantize_rows_e4m3_fused
from openmsa.testing import TOLERANCE, MSACase, compare_with_reference, same_block_sets

fp8_cores = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a GPU with fp8 tensor cores (compute capability 8.9 on)")


def _record(entry: dict) -> None:
    record = os.environ.get("OPENMSA_GPU_RECORD")
    if record:
        with open(record, "a") as f:
            f.write(json.dumps(entry) + "\n")


@pytest.mark.parametrize("strided", [False, True])
def test_fused_quantization_equals_the_reference_one_bit_for_bit(strided):
    """The kernels' quantization (one Triton kernel) gives the reference's codes and scales
    (PyTorch operations, on the GPU and on the CPU), bit for bit: one scheme everywhere."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(3000, 6, 128, device="cuda", generator=generator)
         * torch.logspace(-2, 2, 128, device="cuda")).bfloat16()
    x[7, 2] = 0  # an all-zero row: scale 1
    if strided:
        x = x[:, 1:5]
    codes, scales = quantize_rows_e4m3_fused(x)
    for device in ("cuda", "cpu"):
        expected_codes, expected_scales = quantize_rows_e4m3(x.to(device), chunk_rows=1000)
        assert torch.equal(scales.cpu(), expected_scales.cpu()), device
        assert torch.equal(codes.cpu().view(torch.uint8),
                           expected_codes.cpu().view(torch.uint8)), device
    row = (7, 1) if strided else (7, 2)
    assert scales[row] == 1 and codes[row].float().abs().max() == 0


CASES = [
    # (kind, S, Hi, Hik, Di, block_size, top_k, options)
    ("coherent", 8192, 4, 1, 128, 128, 16, {}),
    ("random", 8192, 4, 1, 128, 128, 16, {}),
    ("random", 3000, 4, 2, 64, 64, 8, dict(num_local_blocks=2, num_sink_blocks=1)),
    ("random", 6000, 8, 1, 128, 64, 64, dict(index_softmax_scale=-0.3)),
]


@fp8_cores
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}_S{c[1]}_Hi{c[2]}_Hik{c[3]}_k{c[6]}")
def test_fp8_selection_agrees_with_the_fp32_reference_of_the_fp8_scheme(case):
    kind, seqlen, hi, hik, di, block_size, top_k, options = case
    generator = torch.Generator(device="cuda").manual_seed(1)
    index_q, _ = index_inputs(kind, seqlen, hi, di, generator)
    index_k = torch.randn(seqlen, hik, di, device="cuda", generator=generator).bfloat16()
    options = dict(options, top_k=top_k, block_size=block_size)
    kernel = openmsa.select_blocks(index_q[None], index_k[None], backend="triton",
                                   index_precision="fp8", **options)
    reference = openmsa.select_blocks(index_q[None], index_k[None], backend="reference",
                                      index_precision="fp8", **options)
    input_precision = openmsa.select_blocks(index_q[None], index_k[None], backend="triton",
                                            **options)
    rate = same_block_sets(kernel, reference).float().mean().item()
    versus_input = same_block_sets(kernel, input_precision).float().mean().item()
    _record({"test": "fp8_select_agreement", "case": [kind, *case[1:7]], "agreement": rate,
             "agreement_with_input_precision": versus_input})
    print(f"fp8 selection {case[:7]}: {100 * rate:.3f}% of rows as the fp32 reference of the "
          f"fp8 scheme, {100 * versus_input:.2f}% as the bf16 selection")
    assert rate >= 0.995
    # The option changes what is ranked: some rows differ from the bf16 selection.
    assert versus_input < 1.0


@fp8_cores
@pytest.mark.parametrize("packed", [False, True])
def test_msa_attention_with_fp8_selection_matches_the_reference_on_its_blocks(packed):
    """Output, KL and every gradient in bf16 within the reference's own bf16 error, on the
    kernel's kept blocks (the KL uses the input-precision scores)."""
    options = dict(top_k=8, block_size=128, index_precision="fp8")
    if packed:
        case = MSACase("fp8 packed", seqlens=(1500, 1, 2100), num_heads=16, num_kv_heads=2,
                       num_index_heads=4, head_dim=128, index_head_dim=128,
                       options=dict(options, num_sink_blocks=1))
    else:
        case = MSACase("fp8", batch=2, seqlen=2048, num_heads=16, num_kv_heads=2,
                       num_index_heads=4, head_dim=128, index_head_dim=128, options=options)
    comparison = compare_with_reference(openmsa.msa_attention, case, torch.bfloat16, "cuda")
    _record({"test": "fp8_msa_attention", "packed": packed, "errors": comparison.errors,
             "selection_agreement": comparison.selection_agreement})
    assert comparison.passed(TOLERANCE[torch.bfloat16]), comparison.errors
    assert comparison.selection_agreement >= 0.995
