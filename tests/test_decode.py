"""``msa_decode`` (SPEC section 10): new tokens against per-sequence caches equal the rows of
``msa_attention`` at those positions; converted Hugging Face models generate with the cache as
they do by recomputing every token. Reference backend in float64 (any machine), the Triton
kernels under the CPU interpreter where marked."""

import pytest
import torch

import openmsa
from openmsa.ops import msa as msa_module
from openmsa.testing import rel_rms_error

interpreted = pytest.mark.skipif(not msa_module.INTERPRETING,
                                 reason="needs TRITON_INTERPRET=1 (the README's test command)")
LENGTHS = (400, 257, 130)  # three sequences' cache lengths, in a cache of 450 positions


def _caches(dtype=torch.float64, capacity=450, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(len(LENGTHS), capacity, heads, 64, generator=generator, dtype=dtype)
            for heads in (4, 2, 2, 2, 1)]  # q, k, v, index_q, index_k at every position


def _new_tokens(full, new):
    """Each sequence's last ``new`` tokens of ``full`` [B, Smax, ...]."""
    return torch.stack([full[b, length - new:length] for b, length in enumerate(LENGTHS)])


@pytest.mark.parametrize("new", [1, 5])
@pytest.mark.parametrize("options", [dict(top_k=2), dict(top_k=3, num_sink_blocks=1),
                                     dict(top_k=2, num_local_blocks=2, index_softmax_scale=-0.1),
                                     dict(top_k=2, index_precision="fp8"),
                                     dict(top_k=3, num_local_blocks=2, local_block_dilation=2)],
                         ids=["default", "sink", "local2_negative_scale", "fp8", "dilated"])
def test_decode_equals_the_rows_of_msa_attention(new, options):
    q, k, v, index_q, index_k = _caches()
    lengths = torch.tensor(LENGTHS, dtype=torch.int32)
    # The cache past each length holds garbage: ignored.
    out, ids = openmsa.msa_decode(_new_tokens(q, new), k, v, _new_tokens(index_q, new), index_k,
                                  lengths, block_size=64, return_indices=True, **options)
    assert out.shape == (3, new, 4, 64) and ids.shape[:3] == (3, 2, new)
    for b, length in enumerate(LENGTHS):
        rows = (slice(b, b + 1), slice(0, length))
        full, _, full_ids = openmsa.msa_attention(q[rows], k[rows], v[rows], index_q[rows],
                                                  index_k[rows], block_size=64,
                                                  return_indices=True, **options)
        torch.testing.assert_close(out[b], full[0, length - new:], rtol=1e-12, atol=1e-12)
        assert torch.equal(ids[b], full_ids[0, :, length - new:])


def test_decode_with_given_blocks_and_in_warmup():
    """block_indices (a sharing layer): the main attention over them; warmup: dense causal over
    the cache."""
    q, k, v, index_q, index_k = _caches()
    lengths = torch.tensor(LENGTHS)
    new_q = _new_tokens(q, 3)
    _, ids = openmsa.msa_decode(new_q, k, v, _new_tokens(index_q, 3), index_k, lengths,
                                top_k=2, block_size=64, return_indices=True)
    given, given_ids = openmsa.msa_decode(new_q, k, v, None, None, lengths, block_size=64,
                                          block_indices=ids, return_indices=True)
    dense = openmsa.msa_decode(new_q, k, v, None, None, lengths, block_size=64, warmup=True)
    assert given_ids is ids or torch.equal(given_ids, ids)
    for b, length in enumerate(LENGTHS):
        keys = (k[b, None, :length], v[b, None, :length])
        expected = openmsa.sparse_attention(q[b, None, :length], *keys, block_size=64,
                                            warmup=True)
        torch.testing.assert_close(dense[b], expected[0, length - 3:], rtol=1e-12, atol=1e-12)
        ranged = openmsa.sparse_attention(new_q[b, None], *keys, ids[b, None], block_size=64,
                                          query_start=length - 3)
        torch.testing.assert_close(given[b], ranged[0], rtol=1e-12, atol=1e-12)
    attention = torch.nn.functional.scaled_dot_product_attention(
        q[0, None, :400].transpose(1, 2), k[0, None, :400].repeat_interleave(2, 2).transpose(1, 2),
        v[0, None, :400].repeat_interleave(2, 2).transpose(1, 2), is_causal=True)
    torch.testing.assert_close(dense[0], attention.transpose(1, 2)[0, -3:], rtol=1e-10,
                               atol=1e-10)


@interpreted
@pytest.mark.parametrize("new,options", [
    (1, dict(top_k=2)), (4, dict(top_k=3, num_sink_blocks=1)),
    (3, dict(top_k=2, num_local_blocks=2, index_softmax_scale=-0.1)),
    (2, dict(top_k=3, index_precision="fp8")),
    (2, dict(top_k=2, index_precision="fp8", index_softmax_scale=-0.1)),
    (3, dict(top_k=4, num_local_blocks=3, local_block_dilation=2, num_sink_blocks=1)),
    (20, dict(top_k=2)),  # past DECODE_MAX_NEW_TOKENS: the training kernels' query ranges
], ids=["one_token", "sink", "local2_negative_scale", "fp8", "fp8_negative_scale",
        "dilated", "long_chunk"])
def test_decode_kernels_match_the_reference(new, options):
    """The decode kernels (block scores split over the cache, attention split over the kept
    blocks) give the reference's ids and out, also over given blocks."""
    from openmsa.ops import decode as decode_module

    q, k, v, index_q, index_k = _caches(torch.float32)
    args = (_new_tokens(q, new), k, v, _new_tokens(index_q, new), index_k,
            torch.tensor(LENGTHS, dtype=torch.int32))
    assert (new <= decode_module.DECODE_MAX_NEW_TOKENS) == (new != 20)
    kernel, kernel_ids = openmsa.msa_decode(*args, block_size=64, backend="triton",
                                            return_indices=True, **options)
    reference, reference_ids = openmsa.msa_decode(*args, block_size=64, backend="reference",
                                                  return_indices=True, **options)
    if new <= decode_module.DECODE_MAX_NEW_TOKENS:  # the decode top-k keeps the reference's order
        assert torch.equal(kernel_ids.long(), reference_ids.long())
    else:
        assert torch.equal(kernel_ids.sort(-1).values, reference_ids.sort(-1).values)
    assert rel_rms_error(kernel, reference) < 1e-5
    given = openmsa.msa_decode(args[0], k, v, None, None, args[-1], block_size=64,
                               block_indices=reference_ids, backend="triton")
    assert rel_rms_error(given, reference) < 1e-5


@interpreted
@pytest.mark.parametrize("num_blocks,new,top_k,local,sink,dilation", [
    (7, 1, 3, 1, 0, 1), (13, 3, 4, 2, 1, 1), (40, 2, 16, 3, 2, 1), (5, 1, 16, 1, 0, 1),
    (300, 1, 16, 1, 0, 1), (40, 2, 8, 4, 1, 3)])
def test_decode_top_blocks_keep_the_references_ids_and_order(num_blocks, new, top_k, local,
                                                             sink, dilation):
    """The decode top-k kernel against ``select_blocks_from_scores`` on scores full of ties
    (small integers) and invisible (-inf) blocks, with forced local (also dilated) and sink
    blocks, fewer visible blocks than top_k, and sequences of different lengths."""
    from openmsa.ops.decode_kernels import decode_top_blocks
    from openmsa.ops.naive import select_blocks_from_scores

    generator = torch.Generator().manual_seed(num_blocks)
    scores = torch.randint(-3, 3, (3, 2, new, num_blocks), generator=generator).float()
    scores[torch.rand(scores.shape, generator=generator) < 0.2] = float("-inf")
    lengths = torch.tensor([num_blocks * 64 - 5, num_blocks * 64 - 64, num_blocks * 32 + 3],
                           dtype=torch.int32)
    positions = lengths.long()[:, None] - new + torch.arange(new)
    query_block = (positions // 64)[:, None, :]
    scores = scores.masked_fill(torch.arange(num_blocks) > query_block[..., None],
                                float("-inf"))  # causal, as the scoring kernel leaves them
    expected = select_blocks_from_scores(scores, query_block, top_k, local, sink, dilation)
    got = decode_top_blocks(scores, lengths, top_k=top_k, block_size=64,
                            num_local_blocks=local, num_sink_blocks=sink,
                            local_block_dilation=dilation)
    assert got.dtype == torch.int32 and torch.equal(got.long(), expected)


@interpreted
def test_decode_block_scores_do_not_depend_on_the_launch():
    """The block-score kernel's tuning knobs (blocks a program walks, warps, stages), as
    benchmarks/bench_decode_kernels.py sweeps them, leave the scores as they are, -inf past each
    sequence's cache included."""
    from openmsa.ops.decode_kernels import decode_block_scores

    _, _, _, index_q, index_k = _caches(torch.float32)
    lengths = torch.tensor(LENGTHS, dtype=torch.int32)
    new_iq = _new_tokens(index_q, 2)
    shipped = decode_block_scores(new_iq, index_k, lengths, 64, 0.125)
    for blocks in (1, 3, 16):
        tuned = decode_block_scores(new_iq, index_k, lengths, 64, 0.125,
                                    blocks_per_program=blocks,
                                    launch=dict(num_warps=8, num_stages=2))
        assert torch.equal(tuned, shipped), blocks
    assert torch.isinf(shipped[2, :, :, -(-130 // 64):]).all()  # past the 130 cached tokens


@interpreted
def test_decode_kernels_need_no_host_lengths(monkeypatch):
    """As under CUDA graph capture (the host's view of cache_seqlens unreadable): the decode
    kernels score every cached block and mask by the device's lengths, with the same result;
    the row-by-row route, which needs the lengths on the host, is refused."""
    from openmsa.ops import decode as decode_module

    q, k, v, index_q, index_k = _caches(torch.float32)
    args = (_new_tokens(q, 2), k, v, _new_tokens(index_q, 2), index_k,
            torch.tensor(LENGTHS, dtype=torch.int32))
    expected = openmsa.msa_decode(*args, top_k=2, block_size=64, backend="triton")
    monkeypatch.setattr(decode_module, "_capturing", lambda tensor: True)
    got = openmsa.msa_decode(*args, top_k=2, block_size=64, backend="triton")
    assert rel_rms_error(got, expected) < 1e-6
    with pytest.raises(ValueError, match="^cache_seqlens: expected a decode the decode kernels "
                                         "run while a CUDA graph is captured"):
        openmsa.msa_decode(*args, top_k=2, block_size=64, backend="triton", warmup=True)


def test_decode_clear_errors():
    q, k, v, index_q, index_k = _caches()
    new_q, new_iq = _new_tokens(q, 2), _new_tokens(index_q, 2)
    lengths = torch.tensor(LENGTHS)
    with pytest.raises(ValueError, match=r"^cache_seqlens: expected entries in \[2, 450\]"):
        openmsa.msa_decode(new_q, k, v, new_iq, index_k, torch.tensor([400, 1, 130]))
    with pytest.raises(ValueError, match="^cache_seqlens: expected 3 entries"):
        openmsa.msa_decode(new_q, k, v, new_iq, index_k, lengths[:2])
    with pytest.raises(ValueError, match="^v_cache: expected 450 cached positions"):
        openmsa.msa_decode(new_q, k, v[:, :300], new_iq, index_k, lengths)
    with pytest.raises(ValueError, match="^index_q: expected 2 new tokens"):
        openmsa.msa_decode(new_q, k, v, index_q[:, :3], index_k, lengths)
    with pytest.raises(TypeError, match="^index_q: expected a torch.Tensor"):
        openmsa.msa_decode(new_q, k, v, None, index_k, lengths)
    with pytest.raises(ValueError, match=r"^block_indices: expected a \[B, Hi, Tq, k\] tensor"):
        openmsa.msa_decode(new_q, k, v, None, None, lengths,
                           block_indices=torch.zeros(3, 2, 5, 2, dtype=torch.int32))


transformers = pytest.importorskip("transformers")

from test_transformers_integration import tiny_model  # noqa: E402


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("share_index_every", [1, 2])
def test_generate_with_the_cache_equals_generation_without_it(family, share_index_every):
    """Greedy, 40 new tokens after a 150-token prompt (3 blocks of 64, 2 kept: selection
    matters), fp32: token for token; the cache holds the index keys of the layers with an
    index branch; every cached step's logits are a full recompute's."""
    from openmsa.integrations.transformers import convert_to_msa

    model = tiny_model(family, layers=3).float().eval()
    convert_to_msa(model, top_k=2, block_size=64, backend="reference",
                   share_index_every=share_index_every)
    prompt = torch.randint(101, (2, 150), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=40, do_sample=False, use_cache=True,
                                return_dict_in_generate=True, output_logits=True)
        recomputed = model.generate(prompt, max_new_tokens=40, do_sample=False,
                                    use_cache=False)
        full = model(cached.sequences, use_cache=False).logits
    assert torch.equal(cached.sequences, recomputed)
    index_keys = cached.past_key_values.openmsa_index_keys
    assert sorted(index_keys) == list(range(0, 3, share_index_every))
    assert index_keys[0].shape == (2, 189, 1, 64)  # the last token's keys are never cached
    for step, logits in enumerate(cached.logits):
        torch.testing.assert_close(logits, full[:, 149 + step], rtol=1e-4, atol=1e-4)
