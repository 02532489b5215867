"""The fp8 index branch's quantization (SPEC section 8), shared by the kernels and the reference.

Every (token, head) row ``x`` of ``index_q`` and ``index_k`` becomes e4m3 codes ``x8`` and one
fp32 scale ``s``: ``s = max|x| / 448`` (1 for an all-zero row) and ``x8 = round(x / s)``, rounded
to the nearest e4m3 value (ties to even) and saturating at +-448. Index scores are then
``scale * s_q * s_k * <q8, k8>``. Only selection (steps 1-2) uses them; the KL keeps the
input-precision scores.
"""

from __future__ import annotations

import torch

INDEX_PRECISIONS = ("input", "fp8")
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn value
# Rows quantized per step: bounds the fp32 temporaries at 1M tokens (64k rows of 128 dims:
# 32 MiB each) while each step stays a few large kernels.
_CHUNK_ROWS = 1 << 16


def quantize_rows_e4m3(x: torch.Tensor, chunk_rows: int = _CHUNK_ROWS):
    """``x [..., D]`` (any float dtype) -> ``(codes, scales)``: float8_e4m3fn ``[..., D]`` and
    fp32 ``[...]``, one scale per row of the last dimension."""
    dim = x.shape[-1]
    codes = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    rows = x.reshape(-1, dim)
    flat_codes, flat_scales = codes.view(-1, dim), scales.view(-1)
    # A tensor divisor: CUDA divides by a Python number as a product with its reciprocal,
    # which can differ from max / 448 in the last bit (the CPU divides exactly).
    e4m3_max = torch.full((), E4M3_MAX, device=x.device)
    for start in range(0, rows.shape[0], chunk_rows):
        part = rows[start:start + chunk_rows].float()
        row_max = part.abs().amax(dim=-1)
        scale = torch.where(row_max > 0, row_max / e4m3_max, torch.ones_like(row_max))
        flat_scales[start:start + chunk_rows] = scale
        # The cast rounds to nearest even but turns values past 448 into NaN: the clamp makes
        # it saturate (x / s can land a rounding step above 448).
        flat_codes[start:start + chunk_rows] = (part / scale[:, None]).clamp_(-E4M3_MAX,
                                                                              E4M3_MAX)
    return codes, scales
