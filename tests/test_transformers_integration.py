"""Converting tiny Hugging Face Llama / Qwen3 models (random weights, nothing downloaded)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import openmsa  # noqa: E402
from openmsa import set_msa_warmup  # noqa: E402
from openmsa.integrations.transformers import HFMSAAttention, convert_to_msa, msa_kl  # noqa: E402
from openmsa.integrations.transformers import _rope as _hf_rope  # noqa: E402


def tiny_model(family, layers=2):
    common = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=101,
                  max_position_embeddings=1024)
    torch.manual_seed(0)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    return model.double()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_converted_model_equals_the_original_when_every_block_is_kept(family):
    model = tiny_model(family)
    tokens = torch.randint(101, (2, 200), generator=torch.Generator().manual_seed(1))
    expected = model(tokens, use_cache=False).logits
    assert convert_to_msa(model, top_k=4, block_size=64, backend="reference") == 2
    assert all(isinstance(layer.self_attn, HFMSAAttention) for layer in model.model.layers)
    converted = model(tokens, use_cache=False).logits  # 200 tokens: 4 blocks, all kept
    torch.testing.assert_close(converted, expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_converted_model_keeping_only_the_own_block_attends_within_blocks(family):
    """top_k=1 keeps each query's own block alone: every layer attends within 64-token blocks,
    so the converted model's logits of a block are the original model's on that block alone
    (at its positions)."""
    original = tiny_model(family)
    model = tiny_model(family)
    assert convert_to_msa(model, top_k=1, block_size=64, backend="reference") == 2
    tokens = torch.randint(101, (2, 200), generator=torch.Generator().manual_seed(1))
    logits = model(tokens, use_cache=False).logits
    for start in range(0, 200, 64):
        end = min(start + 64, 200)
        positions = torch.arange(start, end).expand(2, -1)
        expected = original(tokens[:, start:end], position_ids=positions, use_cache=False).logits
        torch.testing.assert_close(logits[:, start:end], expected, rtol=1e-9, atol=1e-9)
    dense = original(tokens, use_cache=False).logits
    assert (logits[:, 64:] - dense[:, 64:]).abs().max() > 1e-3  # later blocks lost keys
    logits.sum().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "index_" not in n)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_kl_reaches_only_the_index_projections(family):
    model = tiny_model(family)
    convert_to_msa(model, top_k=1, block_size=64, backend="reference")
    tokens = torch.randint(101, (1, 150), generator=torch.Generator().manual_seed(2))
    logits = model(tokens, use_cache=False).logits
    kl = msa_kl(model)
    assert kl.dim() == 0 and kl.item() > 0
    kl.backward(retain_graph=True)
    for name, parameter in model.named_parameters():
        touched = parameter.grad is not None and parameter.grad.abs().sum() > 0
        assert touched == ("index_" in name), name  # index projections (and Qwen3 index norms)
    model.zero_grad()
    logits.sum().backward()
    assert all(p.grad is None or p.grad.abs().sum() == 0
               for n, p in model.named_parameters() if "index_" in n)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_converted_model_trains_under_bf16_autocast(family):
    """Autocast gives the projections in bf16 while RoPE's fp32 factors (and Qwen3's norms)
    would promote q and k: every branch must reach msa_attention in one dtype, and the model
    must match the autocast original when every block is kept."""
    model = tiny_model(family).float()
    tokens = torch.randint(101, (2, 200), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(tokens, use_cache=False).logits.float()
    convert_to_msa(model, top_k=4, block_size=64, backend="reference")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens, use_cache=False).logits.float()
        kl = msa_kl(model)
    torch.testing.assert_close(logits, expected, rtol=0.05, atol=0.05)
    (logits.logsumexp(-1).mean() + kl).backward()
    assert model.model.layers[0].self_attn.index_q_proj.weight.grad is not None


def test_index_branch_starts_from_the_main_projections():
    model = tiny_model("llama")
    q_weight = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    convert_to_msa(model, top_k=1, block_size=64, backend="reference")
    layer = model.model.layers[0].self_attn
    expected = q_weight.view(2, 2, 64, 128).mean(1).reshape(128, 128)
    torch.testing.assert_close(layer.index_q_proj.weight, expected)


def test_warmup_switch_and_clear_errors():
    model = tiny_model("llama")
    convert_to_msa(model, top_k=1, block_size=64, backend="reference")
    assert set_msa_warmup(model, True) == 2
    assert all(layer.self_attn.warmup for layer in model.model.layers)
    tokens = torch.randint(101, (1, 130), generator=torch.Generator().manual_seed(3))
    dense = model(tokens, use_cache=False).logits
    # In warmup the cached path (msa_decode) is dense too: the same logits.
    torch.testing.assert_close(model(tokens, use_cache=True).logits, dense, rtol=1e-9,
                               atol=1e-9)
    with pytest.raises(ValueError, match="^model:"):
        convert_to_msa(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="^index_precision:"):
        convert_to_msa(tiny_model("llama"), index_precision="fp4")
    with pytest.raises(ValueError, match="^local_block_dilation: expected an int >= 1"):
        convert_to_msa(tiny_model("llama"), local_block_dilation=0)


def test_converted_layers_keep_a_dilated_local_window_also_with_the_cache():
    """local_block_dilation reaches every converted layer: the cached generation path
    (msa_decode) gives the uncached forward's logits, and the dilated window changes them
    against the contiguous one."""
    tokens = torch.randint(101, (1, 700), generator=torch.Generator().manual_seed(5))
    logits = {}
    for dilation in (1, 3):
        model = tiny_model("llama")
        convert_to_msa(model, top_k=3, block_size=64, num_local_blocks=2,
                       local_block_dilation=dilation, backend="reference")
        assert all(layer.self_attn.options["local_block_dilation"] == dilation
                   for layer in model.model.layers)
        with torch.no_grad():
            logits[dilation] = model(tokens, use_cache=False).logits
            cached = model(tokens, use_cache=True).logits
        torch.testing.assert_close(cached, logits[dilation], rtol=1e-9, atol=1e-9)
    assert not torch.equal(logits[1], logits[3])


def test_converted_layers_select_with_the_given_index_precision():
    """fp8 selection through the converted model: its output is the model's with the fp8
    reference's blocks, and differs from the input-precision model's somewhere."""
    tokens = torch.randint(101, (1, 700), generator=torch.Generator().manual_seed(4))
    logits = {}
    for precision in ("input", "fp8"):
        model = tiny_model("llama")
        convert_to_msa(model, top_k=2, block_size=64, backend="reference",
                       index_precision=precision)
        assert all(layer.self_attn.options["index_precision"] == precision
                   for layer in model.model.layers)
        with torch.no_grad():
            logits[precision] = model(tokens, use_cache=False).logits
    assert not torch.equal(logits["input"], logits["fp8"])


def test_converted_layers_take_the_tuning_auto_each_its_own():
    """``convert_to_msa(tuning=...)``: a name reaches every layer's calls, "auto" makes one
    AutoTuning a layer (sharing layers included), a bad tuning fails naming ``tuning``."""
    model = tiny_model("llama", layers=3)
    convert_to_msa(model, top_k=2, block_size=64, backend="reference", tuning="auto",
                   share_index_every=2)
    tunings = [layer.self_attn.options["tuning"] for layer in model.model.layers]
    assert all(isinstance(t, openmsa.AutoTuning) for t in tunings)
    assert len({id(t) for t in tunings}) == 3
    tokens = torch.randint(101, (1, 200), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model(tokens, use_cache=False)
    model = tiny_model("llama")
    convert_to_msa(model, top_k=2, block_size=64, backend="reference", tuning="adaptive")
    assert all(layer.self_attn.options["tuning"] == "adaptive" for layer in model.model.layers)
    with pytest.raises(ValueError, match="^tuning: expected None"):
        convert_to_msa(tiny_model("llama"), tuning="fast")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_converted_model_with_index_sharing_runs_forward_and_backward(family):
    """share_index_every=2 on 3 layers: layers 0 and 2 select, layer 1 attends over layer 0's
    blocks with no index projections; msa_kl averages layers 0 and 2; the KL reaches only their
    index projections, the logits every main projection. With top_k covering every block the
    sharing model equals the original."""
    model = tiny_model(family, layers=3)
    tokens = torch.randint(101, (2, 200), generator=torch.Generator().manual_seed(1))
    expected = model(tokens, use_cache=False).logits
    assert convert_to_msa(model, top_k=4, block_size=64, backend="reference",
                          share_index_every=2) == 3
    attention = [layer.self_attn for layer in model.model.layers]
    assert [a.has_index_branch for a in attention] == [True, False, True]
    assert not [n for n, _ in attention[1].named_parameters() if "index_" in n]
    torch.testing.assert_close(model(tokens, use_cache=False).logits, expected, rtol=1e-9,
                               atol=1e-9)

    model = tiny_model(family, layers=3)
    convert_to_msa(model, top_k=1, block_size=64, backend="reference", share_index_every=2)
    attention = [layer.self_attn for layer in model.model.layers]
    logits = model(tokens, use_cache=False).logits
    kl = msa_kl(model)
    torch.testing.assert_close(kl, (attention[0].last_kl + attention[2].last_kl) / 2)
    assert attention[1].last_kl is None
    assert attention[0].last_indices is not None and attention[2].last_indices is None
    kl.backward(retain_graph=True)
    for name, parameter in model.named_parameters():
        touched = parameter.grad is not None and parameter.grad.abs().sum() > 0
        assert touched == ("index_" in name), name
    model.zero_grad()
    logits.sum().backward()
    for name, parameter in model.named_parameters():
        if "self_attn" in name and "index_" not in name and "norm" not in name:
            assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name
    set_msa_warmup(model, True)  # sharing layers run dense too
    model(tokens, use_cache=False).logits.sum().backward()
    with pytest.raises(ValueError, match="^share_index_every: expected an int >= 1"):
        convert_to_msa(tiny_model(family), share_index_every=0)
    with pytest.raises(ValueError, match="^share_index_kl: expected a bool"):
        convert_to_msa(tiny_model(family), share_index_every=2, share_index_kl="yes")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("warmup", [False, True])
def test_share_index_kl_makes_sharing_layers_teach_the_index_branch(family, warmup):
    """share_index_kl=True: the logits stay plain sharing's; layer 1's KL is msa_attention's of
    layer 0's index inputs against layer 1's attention over layer 0's ids, msa_kl averages all
    three layers, and layer 1's KL reaches only layer 0's index projections."""
    tokens = torch.randint(101, (2, 200), generator=torch.Generator().manual_seed(1))
    logits = {}
    for teach in (False, True):
        model = tiny_model(family, layers=3)
        convert_to_msa(model, top_k=1, block_size=64, backend="reference", share_index_every=2,
                       share_index_kl=teach)
        set_msa_warmup(model, warmup)
        attention = [layer.self_attn for layer in model.model.layers]
        inputs = []
        hook = model.model.layers[1].self_attn.register_forward_pre_hook(
            lambda _, args, kwargs: inputs.append(kwargs["hidden_states"]), with_kwargs=True)
        logits[teach] = model(tokens, use_cache=False).logits
        hook.remove()
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-12, atol=1e-12)
    assert attention[1].share_index_kl and attention[1].last_kl is not None
    torch.testing.assert_close(msa_kl(model), sum(a.last_kl for a in attention) / 3)
    sharer, source = attention[1], attention[0]
    cos, sin = model.model.rotary_emb(inputs[0], torch.arange(200)[None].expand(2, 200))
    heads = lambda layer, count, norm: _hf_rope(  # noqa: E731
        norm(layer(inputs[0]).view(2, 200, count, sharer.head_dim)), cos, sin)
    q = heads(sharer.q_proj, sharer.num_heads, sharer.q_norm)
    k = heads(sharer.k_proj, sharer.num_kv_heads, sharer.k_norm)
    v = sharer.v_proj(inputs[0]).view(2, 200, sharer.num_kv_heads, sharer.head_dim)
    index_q, index_k = source.last_index_inputs
    _, expected = openmsa.msa_attention(q, k, v, index_q, index_k, warmup=warmup,
                                        block_indices=None if warmup else source.last_indices,
                                        softmax_scale=sharer.scaling, top_k=1, block_size=64,
                                        backend="reference")
    torch.testing.assert_close(sharer.last_kl, expected, rtol=1e-10, atol=1e-12)
    sharer.last_kl.backward()
    for name, parameter in model.named_parameters():
        touched = parameter.grad is not None and parameter.grad.abs().sum() > 0
        assert touched == name.startswith("model.layers.0.self_attn.index_"), name
