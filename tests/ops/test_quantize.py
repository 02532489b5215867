"""The fp8 index branch's quantization and its reference selection (SPEC section 8), checked
against computations written here from the SPEC's words: e4m3 rounding by searching every
finite e4m3 value, and scores in float64."""

import pytest
import torch

import openmsa
from openmsa.ops.naive import select_blocks_from_scores
from openmsa.ops.interpreter import INTERPRETING
from openmsa.ops.quantize import E4M3_MAX, quantize_rows_e4m3, quantize_rows_e4m3_fused
from openmsa.ops.validate import check_index_precision

# Every finite e4m3 value, in bit order (code 0x7F and 0xFF are NaN).
CODES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
FINITE = torch.isfinite(CODES.float())
VALUES = CODES.float()[FINITE].double()
EVEN_MANTISSA = (torch.arange(256)[FINITE] % 2 == 0)


def round_to_e4m3(values: torch.Tensor) -> torch.Tensor:
    """Nearest finite e4m3 value (ties to the even code), saturating: by search."""
    distance = (values.double()[..., None] - VALUES).abs()
    nearest = distance.min(dim=-1, keepdim=True).values
    candidates = distance == nearest
    # Of two equidistant values, the one with an even mantissa (the last code bit 0).
    even = candidates & EVEN_MANTISSA
    choice = torch.where(even.any(-1, keepdim=True), even, candidates).int().argmax(-1)
    return VALUES[choice]


def quantize_by_the_spec(x: torch.Tensor):
    x = x.float()
    row_max = x.abs().amax(-1)
    scale = torch.where(row_max > 0, row_max / 448, torch.ones_like(row_max))
    return round_to_e4m3((x / scale[..., None]).clamp(-448, 448)), scale


def hard_rows():
    """Rows whose codes test the rounding: random magnitudes over six decades, an all-zero row,
    an exact row, exact halfway points, subnormals, and values just below powers of two (the
    CPU interpreter's cast rounds 127.03 down to 64)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 48, generator=generator) * torch.logspace(-3, 3, 48)
    x[5, 1] = 0  # all zero: scale 1
    x[6:9, 0] = 0
    x[6, 0, :4] = torch.tensor([448.0, 10.0, 0.0, -448.0])  # an exact row: codes = values
    # Values of x / s exactly halfway between two e4m3 values (in [16, 32) the step is 2; 0.5 and
    # the halfway points of subnormals): the max entry pins s = 1.
    x[7, 0, :6] = torch.tensor([448.0, 17.0, 19.0, -21.0, 2.0 ** -10, 3 * 2.0 ** -10])
    x[8, 0, :7] = torch.tensor([448.0, 127.03, -63.9, 15.99, 1.999, -2.0 ** -12, -0.0])
    return x


def test_codes_are_the_nearest_e4m3_values_ties_to_even():
    x = hard_rows()
    codes, scales = quantize_rows_e4m3(x)
    expected_codes, expected_scales = quantize_by_the_spec(x)
    assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    assert torch.equal(scales, expected_scales)
    assert torch.equal(codes.double(), expected_codes)
    assert scales[5, 1] == 1 and codes[5, 1].float().abs().max() == 0
    assert codes[7, 0, :6].tolist() == [448.0, 16.0, 20.0, -20.0, 0.0, 2.0 ** -8]
    assert codes[8, 0, :7].tolist() == [448.0, 128.0, -64.0, 16.0, 2.0, 0.0, 0.0]
    nonzero = x.abs().amax(-1) > 0
    assert (codes.float().abs().amax(-1)[nonzero] == E4M3_MAX).all()


@pytest.mark.skipif(not INTERPRETING, reason="needs TRITON_INTERPRET=1 (the README's test command)")
def test_the_triton_quantizer_gives_the_specs_codes_and_scales():
    """The kernel the fp8 selection and the decode kernels quantize with (round_to_e4m3 in
    fp32 arithmetic), against the SPEC's rounding by search."""
    x = hard_rows()[..., :32]  # a power-of-two head dim
    codes, scales = quantize_rows_e4m3_fused(x)
    expected_codes, expected_scales = quantize_by_the_spec(x)
    assert codes.dtype == torch.float8_e4m3fn
    assert torch.equal(scales, expected_scales) and torch.equal(codes.double(), expected_codes)
    # Bit for bit as PyTorch's cast, which keeps the sign of values rounding to zero.
    cast_codes, _ = quantize_rows_e4m3(x)
    assert torch.equal(codes.view(torch.uint8), cast_codes.view(torch.uint8))


def test_chunks_do_not_change_the_result_and_inputs_may_be_strided():
    generator = torch.Generator().manual_seed(1)
    wide = torch.randn(50, 4, 96, generator=generator, dtype=torch.float16)
    x = wide[:, 1:3, 10:74]  # a strided view
    codes, scales = quantize_rows_e4m3(x, chunk_rows=7)
    whole_codes, whole_scales = quantize_rows_e4m3(x.contiguous())
    assert codes.shape == (50, 2, 64) and scales.shape == (50, 2)
    assert torch.equal(codes.view(torch.uint8), whole_codes.view(torch.uint8))
    assert torch.equal(scales, whole_scales)


def test_a_rounding_step_past_448_saturates_instead_of_becoming_nan():
    """x / s can exceed 448 by a rounding step (s = max / 448 is rounded); the cast alone would
    turn such a value into NaN."""
    found = 0
    for value in torch.linspace(1, 100, 20000):
        if value / (value / 448) > 448:
            found += 1
            codes, _ = quantize_rows_e4m3(torch.stack([value, torch.tensor(1.0)])[None])
            assert codes[0, 0].float() == 448
    assert found  # such values exist, so the case was exercised


def fp8_reference_ids(index_q, index_k, top_k, block_size, scale, local=1, sinks=0):
    """SPEC section 8 in float64 for one batch row ``[S, heads, dim]``: block ids
    ``[Hi, S, top_k]``."""
    seqlen = index_q.shape[0]
    q8, q_scale = quantize_by_the_spec(index_q)
    k8, k_scale = quantize_by_the_spec(index_k)
    group = index_q.shape[1] // index_k.shape[1]
    k8, k_scale = k8.repeat_interleave(group, 1), k_scale.repeat_interleave(group, 1)
    z = (scale * q_scale.double().T[:, :, None] * k_scale.double().T[:, None, :]
         * torch.einsum("ird,jrd->rij", q8, k8))
    causal = torch.ones(seqlen, seqlen, dtype=torch.bool).tril()
    z = z.masked_fill(~causal, float("-inf"))
    blocks = -(-seqlen // block_size)
    z = torch.nn.functional.pad(z, (0, blocks * block_size - seqlen), value=float("-inf"))
    block_scores = z.view(*z.shape[:2], blocks, block_size).amax(-1)
    return select_blocks_from_scores(block_scores, torch.arange(seqlen) // block_size, top_k,
                                     local, sinks)


@pytest.mark.parametrize("dtype,scale,local,sinks", [(torch.float32, 0.125, 1, 0),
                                                     (torch.float16, -0.3, 2, 1)])
def test_reference_selection_ranks_the_fp8_scores(dtype, scale, local, sinks):
    generator = torch.Generator().manual_seed(2)
    index_q = torch.randn(1, 520, 4, 64, generator=generator).to(dtype)
    index_k = torch.randn(1, 520, 2, 64, generator=generator).to(dtype)
    options = dict(top_k=4, block_size=64, index_softmax_scale=scale, num_local_blocks=local,
                   num_sink_blocks=sinks)
    got = openmsa.select_blocks(index_q, index_k, backend="reference", index_precision="fp8",
                                **options)
    expected = fp8_reference_ids(index_q[0], index_k[0], 4, 64, scale, local, sinks)
    same = (got[0].sort(-1).values == expected.sort(-1).values).all(-1)
    # fp32 against float64 scores: only exact near-ties may go either way.
    assert same.float().mean() > 0.995
    bf16_like = openmsa.select_blocks(index_q, index_k, backend="reference", **options)
    assert not torch.equal(bf16_like.sort(-1).values, got.sort(-1).values)


def flip_inputs(dtype=torch.float32):
    """One query and two earlier key blocks whose order fp8 reverses. The query points along
    dim 0. Block 0's best key is 1 + 2^-6 along dim 0 with an 8 in dim 1: its scale 8/448 makes
    the code of 1.016 land on 56 (the step there is 4), 1.0 after scaling. Block 1's best key is
    1 + 2^-7 alone: exact in fp8. In the inputs' precision block 0 wins; in fp8 block 1."""
    block, dim = 64, 64
    index_q = torch.zeros(1, 3 * block, 1, dim, dtype=dtype)
    index_q[..., 0] = 1.0
    index_k = torch.zeros(1, 3 * block, 1, dim, dtype=dtype)
    index_k[0, 3, 0, :2] = torch.tensor([1 + 2 ** -6, 8.0])
    index_k[0, block + 5, 0, 0] = 1 + 2 ** -7
    return index_q, index_k, dict(top_k=2, block_size=block, index_softmax_scale=1.0)


def test_reference_fp8_selection_follows_the_quantized_scores():
    index_q, index_k, options = flip_inputs()
    last = -1  # a query of block 2, which sees blocks 0 and 1 and keeps one of them
    by_input = openmsa.select_blocks(index_q, index_k, backend="reference", **options)
    by_fp8 = openmsa.select_blocks(index_q, index_k, backend="reference",
                                   index_precision="fp8", **options)
    assert set(by_input[0, 0, last].tolist()) == {2, 0}
    assert set(by_fp8[0, 0, last].tolist()) == {2, 1}


def test_msa_reference_selects_in_fp8_but_its_kl_keeps_the_input_scores():
    """With the same kept blocks, fp8 and input precision give the same KL and gradients: the
    KL's scores are the inputs'."""
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 400, h, 64, generator=generator) for h in (4, 2, 2))
    index_q, index_k = (torch.randn(1, 400, h, 64, generator=generator).requires_grad_()
                        for h in (2, 1))
    options = dict(top_k=3, block_size=64, backend="reference", return_indices=True)
    out8, kl8, ids8 = openmsa.msa_attention(q, k, v, index_q, index_k, index_precision="fp8",
                                            **options)
    grads8 = torch.autograd.grad(kl8, (index_q, index_k))
    ids_select = openmsa.select_blocks(index_q, index_k, top_k=3, block_size=64,
                                       backend="reference", index_precision="fp8")
    assert torch.equal(ids8, ids_select)
    _, _, ids_by_input = openmsa.msa_attention(q, k, v, index_q, index_k, **options)
    assert not torch.equal(ids8, ids_by_input)  # the blocks differ; the KL's scores do not
    out, kl, _ = openmsa.msa_attention(q, k, v, index_q, index_k, block_indices=ids8, **options)
    grads = torch.autograd.grad(kl, (index_q, index_k))
    assert torch.equal(out8, out) and torch.equal(kl8, kl)
    for a, b in zip(grads8, grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("value,error", [("bf16", ValueError), ("FP8", ValueError),
                                         (8, TypeError), (None, TypeError)])
def test_index_precision_is_checked_by_name(value, error):
    with pytest.raises(error, match="index_precision"):
        check_index_precision(value)
    index_q = torch.randn(1, 64, 1, 64)
    with pytest.raises(error, match="index_precision"):
        openmsa.select_blocks(index_q, index_q, backend="reference", index_precision=value)
    with pytest.raises(error, match="index_precision"):
        openmsa.msa_attention(index_q, index_q, index_q, index_q, index_q,
                              backend="reference", index_precision=value)
