"""``msa_decode`` on the GPU (SPEC section 10): the decode kernels in bf16 against the fp32
reference, and a converted Hugging Face model's cached steps against a full recompute. Skipped
without a GPU."""

import pytest
import torch

import openmsa
from openmsa.bench.timing import captured as captured_graph
from openmsa.testing import rel_rms_error, same_block_sets

BF16_ERROR = 1e-2  # rel. RMS of bf16 kernels against the fp32 reference


@pytest.fixture(params=[False, True], ids=["launches", "pdl"])
def dependent_launch(request, monkeypatch):
    """The decode kernels launched one after the other, and with programmatic dependent launch
    (each waits for the one before it in the kernel)."""
    from openmsa.ops import decode_kernels

    monkeypatch.setattr(decode_kernels, "DECODE_PDL", request.param)
    return request.param


@pytest.mark.parametrize("local", [(1, 1), (3, 2)], ids=["own_block", "dilated_window"])
@pytest.mark.parametrize("index_precision", ["input", "fp8"])
@pytest.mark.parametrize("new", [1, 4, 40])  # 40: past DECODE_MAX_NEW_TOKENS (query ranges)
def test_decode_matches_the_fp32_reference_in_bf16(new, index_precision, local,
                                                   dependent_launch):
    lengths = torch.tensor([3000, 1777, 129], dtype=torch.int32, device="cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, index_q, index_k = (
        torch.randn(3, 3072, heads, 128, device="cuda", generator=generator).bfloat16()
        for heads in (16, 2, 2, 4, 1))
    new_q, new_iq = (torch.stack([t[b, n - new:n] for b, n in enumerate(lengths.tolist())])
                     for t in (q, index_q))
    options = dict(top_k=8, block_size=128, return_indices=True,
                   index_precision=index_precision, num_local_blocks=local[0],
                   local_block_dilation=local[1])
    out, ids = openmsa.msa_decode(new_q, k, v, new_iq, index_k, lengths, **options)
    expected, expected_ids = openmsa.msa_decode(
        *(t.float() for t in (new_q, k, v, new_iq, index_k)), lengths, backend="reference",
        **options)
    assert out.dtype == torch.bfloat16
    # bf16 scores may swap near-tied blocks against the fp32 reference: compare the outputs on
    # the rows whose kept sets agree, and require nearly all of them to.
    same = same_block_sets(ids.permute(0, 2, 1, 3), expected_ids.permute(0, 2, 1, 3))
    assert same.float().mean() >= 0.9
    rows = same.all(dim=-1)  # [B, Tq]: every index head agrees
    assert rel_rms_error(out[rows].float(), expected[rows]) < BF16_ERROR


def test_cached_generation_steps_match_a_full_recompute_in_bf16():
    transformers = pytest.importorskip("transformers")
    from openmsa.integrations.transformers import convert_to_msa

    config = transformers.LlamaConfig(hidden_size=512, intermediate_size=1024,
                                      num_hidden_layers=2, num_attention_heads=8,
                                      num_key_value_heads=2, head_dim=128, vocab_size=1000,
                                      max_position_embeddings=8192)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).cuda().bfloat16().eval()
    convert_to_msa(model, top_k=8, block_size=128, share_index_every=2)
    prompt = torch.randint(1000, (1, 3000), device="cuda",
                           generator=torch.Generator(device="cuda").manual_seed(1))
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=16, do_sample=False,
                                return_dict_in_generate=True, output_logits=True)
        full = model(cached.sequences, use_cache=False).logits.float()
    for step, logits in enumerate(cached.logits):
        assert rel_rms_error(logits.float(), full[:, 2999 + step]) < 3e-2, step


@pytest.mark.parametrize("index_precision", ["input", "fp8"])
def test_decode_step_replays_under_a_cuda_graph(index_precision, dependent_launch):
    """One decode step of the decode kernels captured once, replayed after the caches and
    lengths changed in place: equal to an eager step (with programmatic dependent launch
    too: the graph keeps its edges)."""
    generator = torch.Generator(device="cuda").manual_seed(2)
    q, k, v, index_q, index_k = (
        torch.randn(2, 4096, heads, 128, device="cuda", generator=generator).bfloat16()
        for heads in (16, 2, 2, 4, 1))
    new_q, new_iq = q[:, :1].clone(), index_q[:, :1].clone()
    lengths = torch.tensor([4000, 2500], dtype=torch.int32, device="cuda")

    def step():
        return openmsa.msa_decode(new_q, k, v, new_iq, index_k, lengths, top_k=8,
                                  block_size=128, index_precision=index_precision)

    graph, captured = captured_graph(step)
    for seed, new_lengths in ((3, [4001, 2501]), (4, [130, 4096])):
        fresh = torch.Generator(device="cuda").manual_seed(seed)
        for buffer in (new_q, k, v, new_iq, index_k):
            buffer.copy_(torch.randn(buffer.shape, device="cuda", generator=fresh))
        lengths.copy_(torch.tensor(new_lengths, dtype=torch.int32))
        graph.replay()
        assert torch.equal(captured, step())
