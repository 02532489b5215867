"""The fp8 index branch's quantization (SPEC section 8), shared by the kernels and the reference.

Every (token, head) row ``x`` of ``index_q`` and ``index_k`` becomes e4m3 codes ``x8`` and one
fp32 scale ``s``: ``s = max|x| / 448`` (1 for an all-zero row) and ``x8 = round(x / s)``, rounded
to the nearest e4m3 value (ties to even) and saturating at +-448. Index scores are then
``scale * s_q * s_k * <q8, k8>``. Only selection (steps 1-2) uses them; the KL keeps the
input-precision scores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .interpreter import INTERPRETING

INDEX_PRECISIONS = ("input", "fp8")
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn value
# Rows quantized per step: bounds the fp32 temporaries at 1M tokens (64k rows of 128 dims:
# 32 MiB each) while each step stays a few large kernels.
_CHUNK_ROWS = 1 << 16


def quantize_rows_e4m3(x: torch.Tensor, chunk_rows: int = _CHUNK_ROWS):
    """``x [..., D]`` (any float dtype) -> ``(codes, scales)``: float8_e4m3fn ``[..., D]`` and
    fp32 ``[...]``, one scale per row of the last dimension. In PyTorch operations: the
    reference's quantization, and the kernels' on a CPU (``quantize_rows_e4m3_fused`` is
    theirs on a GPU)."""
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


@triton.jit
def round_to_e4m3(y):
    """fp32 ``y`` (``|y| <= 448``) rounded to the nearest e4m3 value, ties to even, as fp32
    (the sign kept, also on zeros, as a cast keeps it). Done in fp32 arithmetic rather than by a
    cast: Triton's CPU interpreter casts values just below a power of two (127.03) to half the
    right code (64)."""
    bits = y.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF  # biased
    step_exponent = tl.maximum(exponent - 127, -6) - 3  # 3 mantissa bits; subnormals below 2^-6
    step = ((step_exponent + 127) << 23).to(tl.float32, bitcast=True)
    inverse_step = ((127 - step_exponent) << 23).to(tl.float32, bitcast=True)
    # Adding and removing 1.5 * 2^23 rounds |y| / step (exact: a power of two) to an integer,
    # ties to even.
    magnitude = ((tl.abs(y) * inverse_step + 12582912.0) - 12582912.0) * step
    return (magnitude.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32,
                                                                            bitcast=True)


@triton.jit
def quantize_tile_e4m3(x):
    """A tile's rows ``x [R, D]`` -> (codes ``[R, D]``, fp32 scales ``[R]``) as
    ``quantize_rows_e4m3``; the codes are e4m3 values held in fp32."""
    x = x.to(tl.float32)
    row_max = tl.max(tl.abs(x), axis=1)
    # Correctly rounded divisions (Triton's "/" is approximate in fp32), as PyTorch's.
    scale = tl.where(row_max > 0, tl.math.div_rn(row_max, tl.full(row_max.shape, 448.0,
                                                                   tl.float32)), 1.0)
    scaled = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
    return round_to_e4m3(tl.clamp(scaled, -448.0, 448.0)), scale


@triton.jit
def _quantize_rows_kernel(X, CODES, SCALES, num_rows, stride_row, DIM: tl.constexpr,
                          ROWS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    dims = tl.arange(0, DIM)
    valid = rows < num_rows
    x = tl.load(X + rows[:, None] * stride_row + dims[None, :], mask=valid[:, None],
                other=0.0)
    codes, scale = quantize_tile_e4m3(x)
    tl.store(CODES + rows[:, None] * DIM + dims[None, :], codes.to(tl.float8e4nv),
             mask=valid[:, None])
    tl.store(SCALES + rows, scale, mask=valid)


def quantize_rows_e4m3_fused(x: torch.Tensor):
    """``quantize_rows_e4m3`` in one Triton kernel (CUDA tensors): one read of ``x``, one write
    of the codes and scales. Bit for bit the PyTorch operations' result
    (tests/ops/test_quantize.py under the CPU interpreter, tests/gpu/test_fp8_index_gpu.py); on a
    CPU without the interpreter the operations run instead."""
    if x.device.type != "cuda" and not INTERPRETING:
        return quantize_rows_e4m3(x)
    dim = x.shape[-1]
    rows = x.reshape(-1, dim)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    codes = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    block_rows = max(1, 4096 // dim)
    _quantize_rows_kernel[(triton.cdiv(rows.shape[0], block_rows),)](
        rows, codes, scales, rows.shape[0], rows.stride(0), DIM=dim, ROWS=block_rows,
        num_warps=4)
    return codes, scales
