"""The Triton block-selection kernel against the reference, under the CPU interpreter.

Inputs hold small integers, so every index score is an exact integer in fp32 and fp16 whatever
the summation order: kernel and reference must then agree exactly, ties included (ties go to the
lower block id), with no near-tie ambiguity.
"""

import pytest
import torch

import openmsa
from openmsa.ops import msa as msa_module
from openmsa.ops import select as select_module
from openmsa.testing import MSACase, random_inputs

pytestmark = pytest.mark.skipif(not msa_module.INTERPRETING,
                                reason="needs TRITON_INTERPRET=1 (the README's test command)")


def integer_index_inputs(seqlens_or_shape, num_index_heads, num_index_kv_heads, head_dim=64,
                         dtype=torch.float32, seed=0, low=-2, high=3):
    generator = torch.Generator().manual_seed(seed)
    lead = seqlens_or_shape
    index_q = torch.randint(low, high, (*lead, num_index_heads, head_dim), generator=generator)
    index_k = torch.randint(low, high, (*lead, num_index_kv_heads, head_dim), generator=generator)
    return index_q.to(dtype), index_k.to(dtype)


SELECT_CASES = [
    # (name, lead shape or seqlens, Hi, Hik, head dim, dtype, options)
    ("batch2_partial_block", (2, 300), 4, 2, 64, torch.float32, dict(top_k=3, block_size=64)),
    ("top_k_1", (1, 200), 2, 2, 64, torch.float32, dict(top_k=1, block_size=64)),
    ("top_k_above_visible_blocks", (1, 300), 2, 1, 64, torch.float32,
     dict(top_k=8, block_size=64)),
    ("local_and_sink", (1, 450), 2, 1, 64, torch.float32,
     dict(top_k=4, block_size=64, num_local_blocks=2, num_sink_blocks=1)),
    ("dilated_local_window", (2, 700), 2, 1, 64, torch.float32,
     dict(top_k=6, block_size=64, num_local_blocks=3, local_block_dilation=3,
          num_sink_blocks=1)),
    ("block_128_head_dim_128", (1, 400), 4, 1, 128, torch.float32,
     dict(top_k=2, block_size=128)),
    ("three_heads_per_key_head", (1, 260), 6, 2, 64, torch.float32,
     dict(top_k=2, block_size=64)),
    ("negative_scale", (1, 300), 2, 1, 64, torch.float32,
     dict(top_k=2, block_size=64, index_softmax_scale=-0.5)),
    ("fp16", (2, 200), 2, 1, 64, torch.float16, dict(top_k=2, block_size=64)),
    ("head_dim_256", (1, 200), 2, 1, 256, torch.float32, dict(top_k=2, block_size=64)),
]


@pytest.mark.parametrize("index_precision", ["input", "fp8"])
@pytest.mark.parametrize("case", SELECT_CASES, ids=lambda c: c[0])
def test_kernel_selection_equals_reference(case, index_precision):
    """fp8 too: integers in [-2, 2] have codes 0, +-224, +-448 and scales 2^e / 448, so the fp8
    scores are exact multiples of one float and ties stay exact ties."""
    _, lead, hi, hik, head_dim, dtype, options = case
    options = dict(options, index_precision=index_precision)
    options.setdefault("index_softmax_scale", 1.0)
    index_q, index_k = integer_index_inputs(lead, hi, hik, head_dim, dtype)
    kernel = openmsa.select_blocks(index_q, index_k, backend="triton", **options)
    reference = openmsa.select_blocks(index_q, index_k, backend="reference", **options)
    assert kernel.dtype == torch.int32 and kernel.shape == reference.shape
    torch.testing.assert_close(kernel.sort(dim=-1).values, reference.sort(dim=-1).values,
                               rtol=0, atol=0)


@pytest.mark.parametrize("seqlens,index_precision,dilation", [
    ((70, 1, 200, 129), "input", 1), ((64, 128, 65), "input", 1), ((70, 1, 200, 129), "fp8", 1),
    ((70, 1, 200, 329), "input", 2), ((70, 1, 200, 329), "fp8", 3)])
def test_packed_selection_equals_reference_and_each_sequence_alone(seqlens, index_precision,
                                                                   dilation):
    index_q, index_k = integer_index_inputs((sum(seqlens),), 4, 2, seed=1)
    cu_seqlens = torch.tensor([0, *seqlens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    options = dict(top_k=3 if dilation == 1 else 4, block_size=64, index_softmax_scale=1.0,
                   num_sink_blocks=1, index_precision=index_precision,
                   num_local_blocks=1 if dilation == 1 else 2, local_block_dilation=dilation)
    kernel = openmsa.select_blocks(index_q, index_k, cu_seqlens=cu_seqlens, backend="triton",
                                   **options)
    reference = openmsa.select_blocks(index_q, index_k, cu_seqlens=cu_seqlens,
                                      backend="reference", **options)
    assert kernel.shape == (4, sum(seqlens), options["top_k"])
    assert torch.equal(kernel.sort(dim=-1).values, reference.sort(dim=-1).values)
    offsets = cu_seqlens.tolist()
    for start, end in zip(offsets, offsets[1:]):
        alone = openmsa.select_blocks(index_q[None, start:end], index_k[None, start:end],
                                      backend="triton", **options)
        assert torch.equal(kernel[:, start:end].sort(dim=-1).values,
                           alone[0].sort(dim=-1).values)


@pytest.mark.parametrize("scale,top_k,local,sinks,dilation", [
    (0.3, 2, 1, 0, 1), (-0.5, 2, 1, 0, 1), (0.3, 4, 2, 1, 1), (0.3, 4, 1, 2, 1),
    (0.3, 6, 3, 1, 2), (-0.5, 4, 3, 0, 3)])
def test_row_max_is_the_largest_visible_score(scale, top_k, local, sinks, dilation):
    """return_max: each (token, index head)'s largest scaled score over its visible keys (a
    negative scale makes it the scaled smallest raw score), in packed input with a range of
    queries starting inside a sequence; forced local (also dilated) and sink blocks included
    (top_k leaves a slot for the best unforced block, as msa_attention requires before using
    it)."""
    seqlens = (70, 1, 200, 129)
    index_q, index_k = integer_index_inputs((sum(seqlens),), 4, 2, seed=2)
    cu = torch.tensor([0, *seqlens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    first = 37
    _, row_max = select_module.select_blocks_fwd(
        index_q[first:], index_k, cu, top_k=top_k, block_size=32, index_softmax_scale=scale,
        num_local_blocks=local, num_sink_blocks=sinks, query_start=first, return_max=True,
        local_block_dilation=dilation)
    expected = torch.empty(sum(seqlens), 4)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        scores = scale * torch.einsum("ihd,jhd->hij", index_q[start:end],
                                      index_k[start:end].repeat_interleave(2, dim=1))
        causal = torch.ones(end - start, end - start, dtype=torch.bool).tril()
        expected[start:end] = scores.masked_fill(~causal, float("-inf")).amax(-1).T
    torch.testing.assert_close(row_max, expected[first:], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_a_dilated_window_forces_every_dth_block(backend):
    """local_block_dilation=d keeps blk(i), blk(i) - d, ..., blk(i) - (L - 1) d of every row
    (those inside the sequence), whatever their scores: index keys that make those blocks
    the worst, so that only forcing keeps them."""
    seqlen, block, local, dilation = 900, 64, 3, 4
    index_q = torch.ones(1, seqlen, 2, 64)
    position = torch.arange(seqlen)
    # Scores fall with the distance from block 2 mod 4 (own blocks excepted by causality):
    # blocks own - 4, own - 8 score lowest for most rows.
    index_k = (-(position // block - 2).remainder(dilation).float() * 10
               - (position // block).float())[None, :, None, None].expand(1, seqlen, 1, 64)
    ids = openmsa.select_blocks(index_q, index_k.contiguous(), top_k=local + 2, block_size=block,
                                num_local_blocks=local, local_block_dilation=dilation,
                                index_softmax_scale=1.0, backend=backend)
    for i in range(seqlen):
        own = i // block
        forced = {own - m * dilation for m in range(local) if own - m * dilation >= 0}
        for r in range(2):
            kept = set(ids[0, r, i].tolist()) - {-1}
            assert forced <= kept, (i, r, forced, kept)


@pytest.mark.parametrize("return_max", [False, True])
def test_blocks_scoring_far_below_zero_are_kept(return_max):
    """Every score negative (index queries opposite to the keys), most of them below -2: the
    kernel keeps the same blocks as the reference (an unused-slot test by magnitude once
    dropped every block scoring -2 or less), and with ``return_max`` its row maxima are the
    largest visible scores."""
    seqlens = (150, 1, 250)
    index_q, index_k = integer_index_inputs((sum(seqlens),), 4, 2, seed=5)
    index_q, index_k = -(index_q.abs() + 1), index_k.abs() + 1  # every product negative
    cu = torch.tensor([0, *seqlens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    options = dict(top_k=3, block_size=64, index_softmax_scale=0.5, num_local_blocks=1,
                   num_sink_blocks=0)
    reference = openmsa.select_blocks(index_q, index_k, cu_seqlens=cu, backend="reference",
                                      **options)
    assert (reference >= 0).sum() > 2 * sum(seqlens) * 4  # more than the own blocks are kept
    kernel = select_module.select_blocks_fwd(index_q, index_k, cu, return_max=return_max,
                                             **options)
    ids, row_max = kernel if return_max else (kernel, None)
    assert torch.equal(ids.permute(1, 0, 2).sort(-1).values, reference.sort(-1).values)
    if return_max:
        expected = torch.empty(sum(seqlens), 4)
        for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
            scores = 0.5 * torch.einsum("ihd,jhd->hij", index_q[start:end],
                                        index_k[start:end].repeat_interleave(2, dim=1))
            causal = torch.ones(end - start, end - start, dtype=torch.bool).tril()
            expected[start:end] = scores.masked_fill(~causal, float("-inf")).amax(-1).T
        assert expected.max() < -2
        torch.testing.assert_close(row_max, expected, rtol=1e-6, atol=1e-6)


def test_ties_go_to_the_lower_block_id():
    index_q, index_k = integer_index_inputs((1, 64 * 6), 2, 1)
    index_k[:] = 1.0  # every key scores the same: all blocks tie
    ids = openmsa.select_blocks(index_q, index_k, top_k=3, block_size=64, backend="triton")
    assert all(set(row.tolist()) == {5, 0, 1} for row in ids[0, :, -1])


def test_every_slot_is_written(monkeypatch):
    """The id buffer is poisoned before the kernel: no poison may survive."""
    original_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        return original_empty(*args, **kwargs).fill_(-7777)

    index_q, index_k = integer_index_inputs((2, 200), 2, 1)
    monkeypatch.setattr(select_module.torch, "empty", poisoned_empty)
    ids = openmsa.select_blocks(index_q, index_k, top_k=5, block_size=64, backend="triton")
    monkeypatch.undo()
    assert (ids >= -1).all()
    own = torch.arange(200) // 64
    assert (ids == own[:, None]).any(dim=-1).all()


def test_msa_attention_triton_backend_uses_the_kernel_selection():
    case = MSACase("x", batch=1, seqlen=200, num_heads=4, num_kv_heads=2, num_index_heads=2)
    inputs, _ = random_inputs(case, torch.float32, "cpu", seed=2)
    index_q, index_k = integer_index_inputs((1, 200), 2, 1)
    q, k, v = (t.detach() for t in inputs[:3])
    options = dict(top_k=2, block_size=64, index_softmax_scale=1.0, return_indices=True)
    out, kl, ids = openmsa.msa_attention(q, k, v, index_q, index_k, backend="triton", **options)
    ref_out, ref_kl, ref_ids = openmsa.msa_attention(q, k, v, index_q, index_k,
                                                     backend="reference", **options)
    assert torch.equal(ids.sort(-1).values, ref_ids.sort(-1).values)
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kl, ref_kl, rtol=1e-6, atol=1e-6)


def test_fp8_kernel_ranks_the_quantized_scores():
    """Inputs where fp8 reverses two blocks' order (tests/ops/test_quantize.py): the kernel
    keeps the block the fp8 scores rank first, also with a query range."""
    from test_quantize import flip_inputs

    index_q, index_k, options = flip_inputs()
    by_input = openmsa.select_blocks(index_q, index_k, backend="triton", **options)
    by_fp8 = openmsa.select_blocks(index_q, index_k, backend="triton", index_precision="fp8",
                                   **options)
    assert set(by_input[0, 0, -1].tolist()) == {2, 0}
    assert set(by_fp8[0, 0, -1].tolist()) == {2, 1}
    cu = torch.tensor([0, index_k.shape[1]], dtype=torch.int32)
    first = index_k.shape[1] - 5
    ranged = select_module.select_blocks_fwd(
        index_q[0, first:], index_k[0], cu, top_k=2, block_size=64, index_softmax_scale=1.0,
        num_local_blocks=1, num_sink_blocks=0, query_start=first, index_precision="fp8")
    assert set(ranged[-1, 0].tolist()) == {2, 1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_kernel_agrees_with_the_reference_on_random_inputs(dtype):
    """Random (non-integer) inputs: kernel and reference sum the same fp8 products in other
    orders, so only near-ties may differ."""
    generator = torch.Generator().manual_seed(4)
    index_q = torch.randn(1, 700, 4, 64, generator=generator).to(dtype)
    index_k = torch.randn(1, 700, 1, 64, generator=generator).to(dtype)
    options = dict(top_k=4, block_size=64, index_precision="fp8")
    kernel = openmsa.select_blocks(index_q, index_k, backend="triton", **options)
    reference = openmsa.select_blocks(index_q, index_k, backend="reference", **options)
    agree = (kernel.sort(-1).values == reference.sort(-1).values).all(-1).float().mean()
    assert agree >= 0.995


def test_fp8_refuses_row_maxima():
    index_q, index_k = integer_index_inputs((200,), 2, 1)
    cu = torch.tensor([0, 200], dtype=torch.int32)
    with pytest.raises(ValueError, match="return_max"):
        select_module.select_blocks_fwd(index_q, index_k, cu, top_k=2, block_size=64,
                                        index_softmax_scale=1.0, num_local_blocks=1,
                                        num_sink_blocks=0, index_precision="fp8",
                                        return_max=True)
