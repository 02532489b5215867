"""``MSAAttention`` against a plain composition of its projections, RoPE and the reference."""

import pytest
import torch

import openmsa
from openmsa.layers import MSAAttention, MSAWarmupSchedule, set_msa_warmup
from openmsa.layers.msa_attention import apply_rope


def _layer(qk_norm=False):
    torch.manual_seed(0)
    return MSAAttention(96, num_heads=4, num_kv_heads=2, head_dim=64, num_index_heads=2,
                        top_k=2, block_size=64, qk_norm=qk_norm, backend="reference").double()


def _manual(layer, x, positions, warmup=False):
    batch, seqlen, _ = x.shape

    def heads(t, n):
        return t.view(batch, seqlen, n, -1)

    q = apply_rope(layer.q_norm(heads(layer.q_proj(x), 4)), positions, 10000.0)
    k = apply_rope(layer.k_norm(heads(layer.k_proj(x), 2)), positions, 10000.0)
    v = heads(layer.v_proj(x), 2)
    index_q = apply_rope(layer.index_q_norm(heads(layer.index_q_proj(x.detach()), 2)),
                         positions, 10000.0)
    index_k = apply_rope(layer.index_k_norm(heads(layer.index_k_proj(x.detach()), 1)),
                         positions, 10000.0)
    out, kl = openmsa.naive_msa_attention(q, k, v, index_q, index_k, top_k=2, block_size=64,
                                          warmup=warmup)
    return layer.o_proj(out.reshape(batch, seqlen, -1)), kl


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("warmup", [False, True])
def test_layer_matches_projections_plus_reference(qk_norm, warmup):
    layer = _layer(qk_norm)
    layer.warmup = warmup
    x = torch.randn(2, 150, 96, dtype=torch.float64)
    hidden, kl = layer(x)
    expected, expected_kl = _manual(layer, x, torch.arange(150).expand(2, 150), warmup)
    torch.testing.assert_close(hidden, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(kl, expected_kl, rtol=1e-6, atol=1e-9)


def test_rope_is_a_rotation_that_depends_on_relative_position():
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 64, dtype=torch.float64), torch.randn(1, 1, 1, 64,
                                                                        dtype=torch.float64)

    def score(i, j):
        return (apply_rope(q, torch.tensor([[i]]), 1e4) * apply_rope(k, torch.tensor([[j]]),
                                                                    1e4)).sum()

    torch.testing.assert_close(score(7, 3), score(104, 100))
    assert not torch.allclose(score(7, 3), score(7, 4))
    torch.testing.assert_close(apply_rope(q, torch.tensor([[5]]), 1e4).norm(), q.norm())


def test_kl_trains_only_the_index_projections_and_out_never_does():
    layer = _layer()
    x = torch.randn(1, 150, 96, dtype=torch.float64, requires_grad=True)
    hidden, kl = layer(x)
    index_params = [layer.index_q_proj.weight, layer.index_k_proj.weight]
    main_params = [layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight]
    kl_grads = torch.autograd.grad(kl, index_params + main_params + [x], allow_unused=True,
                                   retain_graph=True)
    assert all(g.abs().sum() > 0 for g in kl_grads[:2])
    assert all(g is None or torch.count_nonzero(g) == 0 for g in kl_grads[2:])  # x detached
    out_grads = torch.autograd.grad(hidden.sum(), index_params, allow_unused=True)
    assert all(g is None or torch.count_nonzero(g) == 0 for g in out_grads)


def test_packed_input_equals_each_sequence_alone():
    layer = _layer()
    lengths = (70, 130)
    x = torch.randn(sum(lengths), 96, dtype=torch.float64)
    cu_seqlens = torch.tensor([0, 70, 200], dtype=torch.int32)
    packed, _ = layer(x, cu_seqlens=cu_seqlens)
    for start, end in ((0, 70), (70, 200)):
        alone, _ = layer(x[None, start:end])
        torch.testing.assert_close(packed[start:end], alone[0], rtol=1e-10, atol=1e-10)


def test_indices_are_returned_and_none_in_warmup():
    layer = _layer()
    x = torch.randn(1, 150, 96, dtype=torch.float64)
    _, _, indices = layer(x, return_indices=True)
    assert indices.shape == (1, 2, 150, 2)
    layer.warmup = True
    assert layer(x, return_indices=True)[2] is None


def test_warmup_schedule_switches_every_layer():
    model = torch.nn.Sequential(_layer(), torch.nn.Linear(2, 2), _layer())
    schedule = MSAWarmupSchedule(3)
    assert schedule.apply(model, 0) and all(m.warmup for m in (model[0], model[2]))
    assert not schedule.apply(model, 3) and not any(m.warmup for m in (model[0], model[2]))
    assert set_msa_warmup(model, True) == 2
    with pytest.raises(ValueError, match="^warmup_steps:"):
        MSAWarmupSchedule(-1)


def test_mass_recall_is_the_question_attention_mass_of_the_kept_blocks():
    """openmsa train's mass recall against an explicit dense softmax of the question's row."""
    from openmsa.train.run import question_mass_recall

    torch.manual_seed(0)
    layer = MSAAttention(32, num_heads=4, num_kv_heads=2, head_dim=16, top_k=2, block_size=8)
    hidden = torch.randn(2, 20, 32)  # blocks of 8: 0-7, 8-15, 16-19
    kept = torch.tensor([[0, 2], [1, -1]])[None, :, None].expand(2, 2, 20, 2)  # [B, Hi, S, k]
    with torch.no_grad():
        mass = question_mass_recall(layer, hidden, kept, 8)
        q, k, *_ = layer.projections(hidden, torch.arange(20).expand(2, 20))
        scores = torch.einsum("bhd,bshd->bhs", q[:, -1], k.repeat_interleave(2, dim=2)) / 4
        teacher = scores.softmax(-1).view(2, 2, 2, 20).mean(2)  # index head = 2 main heads
    expected = torch.stack([teacher[:, 0, :8].sum(-1) + teacher[:, 0, 16:].sum(-1),
                            teacher[:, 1, 8:16].sum(-1)], dim=1)
    torch.testing.assert_close(mass, expected)
    everything = torch.arange(3).expand(2, 2, 20, 3)
    torch.testing.assert_close(question_mass_recall(layer, hidden, everything, 8),
                               torch.ones(2, 2))


def test_layer_passes_its_attention_options_through(monkeypatch):
    from openmsa.layers import msa_attention as layer_module
    seen = {}

    def recording(*tensors, **options):
        seen.update(options)
        return openmsa.naive_msa_attention(*tensors, **options)

    monkeypatch.setattr(layer_module, "msa_attention", recording)
    layer = MSAAttention(64, num_heads=4, num_kv_heads=2, head_dim=64, top_k=3, block_size=64,
                         num_sink_blocks=1, deterministic=True, index_precision="fp8",
                         num_local_blocks=2, local_block_dilation=2)
    layer(torch.randn(1, 130, 64))
    names = ("top_k", "block_size", "num_sink_blocks", "deterministic", "index_precision",
             "num_local_blocks", "local_block_dilation")
    assert {key: seen[key] for key in names} == dict(
        top_k=3, block_size=64, num_sink_blocks=1, deterministic=True, index_precision="fp8",
        num_local_blocks=2, local_block_dilation=2)


def test_layer_refuses_a_bad_local_block_dilation_when_built():
    with pytest.raises(ValueError, match="^local_block_dilation: expected an int >= 1"):
        MSAAttention(64, num_heads=4, num_kv_heads=2, local_block_dilation=0)


def test_layer_refuses_an_unknown_index_precision_when_built():
    with pytest.raises(ValueError, match="index_precision"):
        MSAAttention(64, num_heads=4, num_kv_heads=2, index_precision="int8")
