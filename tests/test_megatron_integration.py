"""openmsa inside Megatron-core's GPTModel (local layer spec) on the CPU: one gloo process
(two for context parallelism), tensor parallel size 1, the reference backend in float32, batch
and packed (THD) input.

Megatron-core assumes CUDA in two places a CPU run reaches (the rotary frequencies move to
``torch.cuda.current_device()``, and attention forks the CUDA RNG tracker); the fixture points
the first at the CPU and gives the second a no-op fork, for these tests only. With context
parallelism a third (the rank's rotary frequencies go through pinned memory) gets a CPU copy of
that function in the worker processes."""

import contextlib
import importlib
import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.tensor_parallel import random as megatron_random  # noqa: E402
from megatron.core.transformer import dot_product_attention  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from openmsa import MSAWarmupSchedule, set_msa_warmup  # noqa: E402
from openmsa.integrations import megatron as openmsa_megatron  # noqa: E402
from openmsa.testing import gloo_test_process  # noqa: E402

SEQLEN, VOCAB = 200, 100


class _NoForkTracker:
    def fork(self, *args, **kwargs):
        return contextlib.nullcontext()


@pytest.fixture
def megatron_on_cpu(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    tracker = _NoForkTracker()
    monkeypatch.setattr(megatron_random, "get_cuda_rng_tracker", lambda *a, **k: tracker)
    monkeypatch.setattr(dot_product_attention.tensor_parallel, "get_cuda_rng_tracker",
                        lambda *a, **k: tracker)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0,
                            world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _config(**overrides):
    options = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                   kv_channels=64, use_cpu_initialization=True, attention_dropout=0.0,
                   hidden_dropout=0.0)
    return TransformerConfig(**dict(options, **overrides))


def _gpt(spec, config=None, seed=0):
    torch.manual_seed(seed)
    return GPTModel(config or _config(), spec, vocab_size=VOCAB, max_sequence_length=1024,
                    position_embedding_type="rope")


def _batch(seed=1, batch=2):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(VOCAB, (batch, SEQLEN), generator=generator)
    positions = torch.arange(SEQLEN).expand(batch, -1)
    mask = torch.triu(torch.ones(SEQLEN, SEQLEN, dtype=torch.bool), 1)[None, None]
    return tokens, positions, mask


def _msa_spec(**options):
    return openmsa_megatron.get_gpt_layer_msa_spec(
        **dict(dict(top_k=4, block_size=64, backend="reference"), **options))


def _msa_gpt_with_weights_of(dense, **options):
    model = _gpt(_msa_spec(**options))
    result = model.load_state_dict(dense.state_dict(), strict=False)
    assert result.unexpected_keys == []
    assert all("index_" in key for key in result.missing_keys)  # the index branch alone is new
    return model


def test_msa_keeping_every_block_equals_megatrons_attention(megatron_on_cpu):
    """200 tokens are 4 blocks of 64: with top_k=4 every block is kept and the MSA GPT is
    Megatron's own on the same weights; keeping only the own block (top_k=1) is not."""
    dense = _gpt(get_gpt_layer_local_spec())
    tokens, positions, mask = _batch()
    expected = dense(tokens, positions, mask)
    every_block = _msa_gpt_with_weights_of(dense)
    torch.testing.assert_close(every_block(tokens, positions, mask), expected, rtol=1e-5,
                               atol=1e-5)
    own_block = _msa_gpt_with_weights_of(dense, top_k=1)
    assert (own_block(tokens, positions, mask) - expected)[:, 64:].abs().max() > 1e-3
    # Warmup is dense attention whatever top_k keeps.
    assert set_msa_warmup(own_block, True) == 2
    torch.testing.assert_close(own_block(tokens, positions, mask), expected, rtol=1e-5,
                               atol=1e-5)


def test_kl_reaches_only_the_index_projections_through_the_backward(megatron_on_cpu):
    """The KL rides the attention output's backward: with kl_weight it trains the index
    projections, and leaves every other gradient as it is without it (kl_weight=0)."""
    tokens, positions, mask = _batch()
    grads = {}
    for weight in (0.0, 2.0):
        model = _gpt(_msa_spec(top_k=2, kl_weight=weight))
        model(tokens, positions, mask).square().mean().backward()
        grads[weight] = {name: p.grad for name, p in model.named_parameters()}
        assert openmsa_megatron.megatron_msa_kl(model) > 0
    for name, grad in grads[2.0].items():
        if "index_" in name:
            assert grads[0.0][name] is None and grad is not None and grad.abs().sum() > 0, name
        else:
            torch.testing.assert_close(grad, grads[0.0][name], rtol=0, atol=0)
    # backward_scale scales the KL's gradient as the loop scales its main loss.
    model = _gpt(_msa_spec(top_k=2, kl_weight=2.0))
    openmsa_megatron.KLIntoBackward.backward_scale = 0.5
    try:
        model(tokens, positions, mask).square().mean().backward()
    finally:
        openmsa_megatron.KLIntoBackward.backward_scale = 1.0
    name = "decoder.layers.0.self_attention.core_attention.index_q_proj.weight"
    torch.testing.assert_close(dict(model.named_parameters())[name].grad, 0.5 * grads[2.0][name])


def test_tiny_gpt_trains_and_its_loss_falls(megatron_on_cpu):
    """A few steps on counting sequences (each token the one before plus 1; dense warmup, then
    sparse; Adam on every parameter): the next-token loss falls."""
    model = _gpt(_msa_spec(top_k=2))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    schedule = MSAWarmupSchedule(5)
    _, positions, mask = _batch(batch=4)
    starts = torch.randint(VOCAB, (4, 1), generator=torch.Generator().manual_seed(0))
    tokens = (starts + torch.arange(SEQLEN)) % VOCAB
    losses = []
    for step in range(15):
        schedule.apply(model, step)
        logits = model(tokens, positions, mask)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB),
                                                 tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    assert losses[-1] < losses[5], losses  # falling in the sparse phase too


def test_unsupported_settings_are_refused_by_name(megatron_on_cpu):
    with pytest.raises(ValueError, match="^config.attention_dropout: expected 0.0"):
        _gpt(_msa_spec(), _config(attention_dropout=0.1))
    with pytest.raises(ValueError, match="^config.num_query_groups: expected a multiple of "
                                         "tensor_model_parallel_size"):
        # Megatron itself allows fewer groups than ranks (it copies KV heads), MSA does not.
        openmsa_megatron.MSACoreAttention(_config(num_query_groups=1,
                                                  tensor_model_parallel_size=2), 1, None, "self")
    with pytest.raises(ValueError, match="^config.sequence_parallel: expected False"):
        openmsa_megatron.MSACoreAttention(_config(tensor_model_parallel_size=2,
                                                  sequence_parallel=True), 1, None, "self")
    model = _gpt(_msa_spec())
    core = model.decoder.layers[0].self_attention.core_attention
    offsets = torch.tensor([0, 130, 200], dtype=torch.int32)
    refused = {"qkv_format": dict(qkv_format="sbhd"),
               "cu_seqlens_q": dict(cu_seqlens_q=None),
               "cu_seqlens_kv": dict(cu_seqlens_kv=torch.tensor([0, 100, 200],
                                                                dtype=torch.int32)),
               "cu_seqlens_q_padded": dict(cu_seqlens_q_padded=torch.tensor(
                   [0, 136, 200], dtype=torch.int32))}
    for name, change in refused.items():
        params = PackedSeqParams(**dict(dict(qkv_format="thd", cu_seqlens_q=offsets,
                                             cu_seqlens_kv=offsets), **change))
        with pytest.raises(ValueError, match=f"^packed_seq_params.{name}: expected"):
            core(*(torch.zeros(SEQLEN, 4, 64) for _ in range(3)), None,
                 packed_seq_params=params)


def test_packed_sequences_run_as_if_alone(megatron_on_cpu):
    """Two sequences (130 and 70 tokens, blocks of 64, top 2) packed in Megatron's THD format:
    each token's logits are those of its sequence run alone, each layer's KL is the two
    sequences' KLs averaged over all tokens, and the main parameters' gradients of a loss
    summed over tokens are the two runs' gradients added."""
    model = _gpt(_msa_spec(top_k=2, kl_weight=0.0))
    lengths = (130, 70)
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(VOCAB, (1, sum(lengths)), generator=generator)
    weights = torch.randn(1, sum(lengths), VOCAB, generator=generator)
    offsets = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=offsets, cu_seqlens_kv=offsets,
                             max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))

    def run(tokens, positions, weights, **options):
        model.zero_grad()
        logits = model(tokens, positions, None, **options)
        (logits * weights).sum().backward()
        kls = [layer.self_attention.core_attention.last_kl for layer in model.decoder.layers]
        grads = {name: p.grad.clone() for name, p in model.named_parameters()
                 if p.grad is not None}
        return logits.detach(), torch.stack(kls), grads

    packed, packed_kl, packed_grads = run(tokens, positions, weights, packed_seq_params=params)
    alone = [run(tokens[:, a:b], positions[:, a:b], weights[:, a:b])
             for a, b in ((0, lengths[0]), (lengths[0], sum(lengths)))]
    torch.testing.assert_close(packed, torch.cat([logits for logits, _, _ in alone], 1),
                               rtol=1e-5, atol=1e-5)
    expected_kl = sum(n * kl for n, (_, kl, _) in zip(lengths, alone)) / sum(lengths)
    torch.testing.assert_close(packed_kl, expected_kl, rtol=1e-5, atol=1e-7)
    assert packed_kl.min() > 0
    assert packed_grads.keys() == alone[0][2].keys()
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, alone[0][2][name] + alone[1][2][name], rtol=1e-4,
                                   atol=1e-5)


def test_a_missing_megatron_core_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron.core.models.common.embeddings.rope_utils", None)
    monkeypatch.delitem(sys.modules, "openmsa.integrations.megatron")
    with pytest.raises(ImportError, match="needs Megatron-core: pip install megatron-core"):
        importlib.import_module("openmsa.integrations.megatron")


def _example():
    path = Path(__file__).parents[1] / "examples" / "megatron_pretrain.py"
    spec = importlib.util.spec_from_file_location("megatron_pretrain", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pretraining_example_runs_its_pipeline_on_the_cpu(megatron_on_cpu):
    """examples/megatron_pretrain.py's model, data and loop at a CPU size (the reference
    backend; the script itself runs on a GPU): every scored position's next token is the value
    its key had in the first half, and the steps run through warmup into sparse attention."""
    example = _example()
    tokens, scored = example.recall_batch(2, 256, 128, torch.Generator().manual_seed(0), "cpu")
    for row, marks in zip(tokens, scored):
        first = {int(k): int(v) for k, v in zip(row[:128:2], row[1:128:2])}
        for position in marks.nonzero().flatten().tolist():
            assert int(row[position + 1]) == first[int(row[position])]
    for layers, every in ((1, 1), (2, 2)):  # the second: layer 2 shares layer 1's selection
        model = example.build_model(256, layers=layers, hidden=64, top_k=2, block_size=64,
                                    backend="reference", share_index_every=every)
        losses = example.train(model, steps=4, warmup_steps=2, batch=2, seqlen=256,
                               device="cpu")
        assert len(losses) == 4 and all(math.isfinite(loss) for loss in losses)
        assert openmsa_megatron.megatron_msa_kl(model) > 0


def test_index_sharing_layers_attend_over_their_indexers_blocks(megatron_on_cpu):
    """share_index_every=2 on 4 layers: layers 2 and 4 have no index projections and, once
    linked, attend over the blocks layers 1 and 3 kept in the same forward (their core
    attention equals sparse_attention on those ids); the model's KL is the indexers' mean; with
    every block kept the model is Megatron's own attention; unlinked or misconfigured sharing
    is refused by name."""
    from openmsa import sparse_attention

    config = _config(num_layers=4)
    dense = _gpt(get_gpt_layer_local_spec(), config)
    tokens, positions, mask = _batch()
    model = _gpt(_msa_spec(top_k=2, share_index_every=2), config)
    names = [name for name in model.state_dict() if "index_" in name]
    assert names and all(".layers.0." in n or ".layers.2." in n for n in names), names
    with pytest.raises(ValueError, match=r"\(layer 2\): shares an earlier layer's selection but "
                                         r"is not linked"):
        model(tokens, positions, mask)
    assert openmsa_megatron.link_index_sharing(model) == 2
    layers = [layer.self_attention.core_attention for layer in model.decoder.layers]
    seen = {}

    def keep(number):
        def hook(module, args, kwargs, output):
            seen[number] = (args[:3], output)
        return hook

    for number in (2, 4):
        layers[number - 1].register_forward_hook(keep(number), with_kwargs=True)
    model(tokens, positions, mask)
    for number, source in ((2, layers[0]), (4, layers[2])):
        (query, key, value), output = seen[number]
        expected = sparse_attention(*(t.transpose(0, 1) for t in (query, key, value)),
                                    source.last_indices, block_size=64, backend="reference")
        torch.testing.assert_close(output, expected.transpose(0, 1).reshape(output.shape),
                                   rtol=0, atol=0)
        assert layers[number - 1].last_kl is None
    kl = openmsa_megatron.megatron_msa_kl(model)
    torch.testing.assert_close(kl, (layers[0].last_kl + layers[2].last_kl) / 2)
    # Every block kept: the shared selection is every block, so Megatron's attention.
    every_block = _gpt(_msa_spec(top_k=4, share_index_every=2), config)
    every_block.load_state_dict(dense.state_dict(), strict=False)
    openmsa_megatron.link_index_sharing(every_block)
    torch.testing.assert_close(every_block(tokens, positions, mask),
                               dense(tokens, positions, mask), rtol=1e-5, atol=1e-5)
    # Warmup: the sharing layers run dense too, so the model is Megatron's own attention.
    dense.load_state_dict(model.state_dict(), strict=False)
    set_msa_warmup(model, True)
    torch.testing.assert_close(model(tokens, positions, mask), dense(tokens, positions, mask),
                               rtol=1e-5, atol=1e-5)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="^share_index_every: expected an int >= 1"):
            _msa_spec(share_index_every=bad)
    # A pipeline stage holding a sharing layer without its indexer.
    stage = torch.nn.ModuleList([openmsa_megatron.MSACoreAttention(
        config, 4, None, "self", share_index_every=2)])
    with pytest.raises(ValueError, match="^model: layer 4 shares an earlier layer's selection, "
                                         "but no earlier MSA layer with an index branch"):
        openmsa_megatron.link_index_sharing(stage)


def _cp_rank_rotary_on_cpu(pos_emb, seq_dim, cp_group):
    """Megatron's ``get_pos_emb_on_this_cp_rank`` (chunks r and 2 x CP - 1 - r of the rotary
    frequencies) without its pinned-memory copy to the GPU."""
    size, rank = cp_group.size(), cp_group.rank()
    chunks = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * size, -1,
                          *pos_emb.shape[seq_dim + 1:])
    chunks = chunks.index_select(seq_dim, torch.tensor([rank, 2 * size - rank - 1]))
    return chunks.view(*chunks.shape[:seq_dim], -1, *chunks.shape[seq_dim + 2:])


def _parallel_worker(rank, world, init_file, failures, body, reference_file):
    """One gloo process of a parallel run: the CPU shims of the fixture (and the context-
    parallel rotary one), then ``body(rank, world, reference)``; errors go to the parent."""
    from megatron.core.models.common.embeddings import rotary_pos_embedding

    torch.cuda.current_device = lambda: "cpu"
    tracker = _NoForkTracker()
    megatron_random.get_cuda_rng_tracker = lambda *a, **k: tracker
    dot_product_attention.tensor_parallel.get_cuda_rng_tracker = lambda *a, **k: tracker
    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = _cp_rank_rotary_on_cpu
    with gloo_test_process(rank, world, init_file, failures):
        try:
            body(rank, world, torch.load(reference_file))
        finally:
            parallel_state.destroy_model_parallel()


def _run_parallel(body, tmp_path, reference, world=2):
    """``body`` on ``world`` gloo processes, each reading ``reference`` (saved here)."""
    import torch.multiprocessing as mp

    reference_file = tmp_path / "reference.pt"
    torch.save(reference, reference_file)
    failures = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_parallel_worker, args=(world, str(tmp_path / "init_parallel"),
                                               failures, body, str(reference_file)),
                       nprocs=world, start_method="spawn")
    messages = []
    while not failures.empty():
        messages.append(failures.get())
    assert not messages, "\n".join(messages)


def _reference_run():
    """The single-process run the parallel ones are held against: a 2-layer MSA GPT whose
    second layer shares the first one's selection, logits of a batch, the first layer's KL,
    and every gradient of a loss summed over tokens (the KL carried into the backward)."""
    model = _gpt(_msa_spec(top_k=2, share_index_every=2), _config(num_layers=2))
    openmsa_megatron.link_index_sharing(model)
    tokens, positions, _ = _batch()
    weights = torch.randn(*tokens.shape, VOCAB, generator=torch.Generator().manual_seed(9))
    reference = dict(state=model.state_dict(), tokens=tokens, positions=positions,
                     weights=weights)
    reference.update(_run_and_keep(model, tokens, positions, weights))
    # Two packed sequences (THD), as context parallelism's per-sequence split needs them.
    packed_tokens = torch.randint(VOCAB, (1, sum(PACKED_LENGTHS)),
                                  generator=torch.Generator().manual_seed(10))
    packed_positions = torch.cat([torch.arange(n) for n in PACKED_LENGTHS])[None]
    packed_weights = torch.randn(1, sum(PACKED_LENGTHS), VOCAB,
                                 generator=torch.Generator().manual_seed(11))
    packed = _run_and_keep(model, packed_tokens, packed_positions, packed_weights,
                           packed_seq_params=_packed_params())
    reference["packed"] = dict(packed, tokens=packed_tokens, positions=packed_positions,
                               weights=packed_weights)
    return reference


PACKED_LENGTHS = (128, 64)  # multiples of 2 x 2 context-parallel ranks


def _packed_params():
    offsets = torch.tensor([0, *PACKED_LENGTHS], dtype=torch.int32).cumsum(0).to(torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=offsets, cu_seqlens_kv=offsets,
                           max_seqlen_q=max(PACKED_LENGTHS), max_seqlen_kv=max(PACKED_LENGTHS))


def _run_and_keep(model, tokens, positions, weights, **options):
    """Logits, the first layer's KL and every gradient of a loss summed over tokens."""
    model.zero_grad(set_to_none=True)
    logits = model(tokens, positions, None, **options)
    (logits * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return dict(logits=logits.detach(), grads=grads,
                kl=model.decoder.layers[0].self_attention.core_attention.last_kl)


def _assert_close_to_scale(got, expected, name):
    # fp32 sums in another order: tolerances relative to the tensor's scale.
    scale = expected.abs().max().item()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6 * scale + 1e-9,
                               msg=lambda message: f"{name}: {message}")


def _context_parallel_body(rank, world, reference):
    """A context-parallel rank: the reference GPT on its zig-zag shard; logits and KL against
    the reference, gradients summed over the ranks too."""
    import torch.distributed as dist

    from openmsa.context_parallel import zigzag_shard, zigzag_shard_sequences

    parallel_state.initialize_model_parallel(1, 1, context_parallel_size=world)
    model = _gpt(_msa_spec(top_k=2, share_index_every=2),
                 _config(num_layers=2, context_parallel_size=world))
    model.load_state_dict(reference["state"])
    assert openmsa_megatron.link_index_sharing(model) == 1
    def shard_packed(x):  # Megatron's THD context-parallel layout, tokens along dim 1
        return zigzag_shard_sequences(x, _packed_params().cu_seqlens_q, dim=1)

    batch = {name: zigzag_shard(reference[name], dim=1)
             for name in ("tokens", "positions", "weights")}
    packed = reference["packed"]
    runs = [("batch", batch, {}, lambda x: zigzag_shard(x, dim=1), reference),
            ("packed", {name: shard_packed(packed[name])
                        for name in ("tokens", "positions", "weights")},
             dict(packed_seq_params=_packed_params()), shard_packed, packed)]
    for label, inputs, options, shard, expected in runs:
        got = _run_and_keep(model, inputs["tokens"], inputs["positions"], inputs["weights"],
                            **options)
        torch.testing.assert_close(got["logits"], shard(expected["logits"]), rtol=1e-5,
                                   atol=1e-5, msg=lambda message: f"{label}: {message}")
        torch.testing.assert_close(got["kl"], expected["kl"], rtol=1e-5, atol=1e-7)
        for name, grad in got["grads"].items():
            dist.all_reduce(grad)  # each rank's share of the whole sequence's gradient
            _assert_close_to_scale(grad, expected["grads"][name], f"{label}: {name}")


def test_context_parallel_ranks_together_equal_one_process(megatron_on_cpu, tmp_path):
    """Megatron's context-parallel group (2 gloo processes) drives openmsa's sequence mode: on
    its zig-zag shard (batch input) or its chunks of every packed sequence (THD input, the
    per-sequence split) each rank's logits are the single-process run's, its KL is the whole
    sequence's, and the ranks' gradients (index projections included, through the KL carried
    into the backward) add up to the single-process ones; the second layer shares the first
    one's selection across the ranks."""
    _run_parallel(_context_parallel_body, tmp_path, _reference_run())


def _tensor_parallel_body(rank, world, reference):
    """A tensor-parallel rank: the reference GPT's weights split as Megatron splits them
    (every parameter marked tensor-parallel along its partition dimension: whole query groups
    with their index query heads; the index key projection whole on every rank); its vocab
    shard of the logits, the mean of the ranks' KLs, and its gradients (split or whole)
    against the reference."""
    import torch.distributed as dist

    parallel_state.initialize_model_parallel(world, 1)
    model = _gpt(_msa_spec(top_k=2, share_index_every=2),
                 _config(num_layers=2, tensor_model_parallel_size=world))
    split = {}
    for name, parameter in model.named_parameters():
        whole = reference["state"][name]
        if getattr(parameter, "tensor_model_parallel", False):
            whole = whole.chunk(world, parameter.partition_dim)[rank]
        split[name] = whole
    result = model.load_state_dict(split, strict=False)
    assert not result.missing_keys or all("_extra_state" in k for k in result.missing_keys)
    openmsa_megatron.link_index_sharing(model)
    index_q = model.decoder.layers[0].self_attention.core_attention.index_q_proj.weight
    assert index_q.shape[0] == 64 and getattr(index_q, "tensor_model_parallel", False)
    logits = model(reference["tokens"], reference["positions"], None)
    torch.testing.assert_close(logits, reference["logits"].chunk(world, -1)[rank],
                               rtol=1e-5, atol=1e-5)
    kl = model.decoder.layers[0].self_attention.core_attention.last_kl.clone()
    dist.all_reduce(kl)
    torch.testing.assert_close(kl / world, reference["kl"], rtol=1e-5, atol=1e-7)
    (logits * reference["weights"].chunk(world, -1)[rank]).sum().backward()
    for name, parameter in model.named_parameters():
        expected = reference["grads"][name]
        if getattr(parameter, "tensor_model_parallel", False):
            expected = expected.chunk(world, parameter.partition_dim)[rank]
        _assert_close_to_scale(parameter.grad, expected, name)


def test_tensor_parallel_ranks_equal_one_process(megatron_on_cpu, tmp_path):
    """Tensor-parallel size 2 (2 gloo processes, 2 query groups: one with its index head per
    rank): the single-process GPT's weights split as Megatron splits them give each rank its
    vocab shard of the single-process logits, KLs whose mean is the single-process KL, and
    the single-process gradients (the shared index key projection's summed over the ranks);
    the second layer shares the first one's selection on each rank."""
    _run_parallel(_tensor_parallel_body, tmp_path, _reference_run())
