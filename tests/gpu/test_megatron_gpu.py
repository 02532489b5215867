"""openmsa inside Megatron-core's GPTModel on the GPU: the MSA GPT on the kernels in bf16, one
process (tensor and context parallel size 1). Skipped without a GPU or without megatron-core
(the GPU machine has none installed: carry its wheel, benchmarks/run_gpu.sh part megatron)."""

import os
import tempfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from openmsa.integrations import megatron as openmsa_megatron  # noqa: E402
from openmsa.testing import rel_rms_error  # noqa: E402

SEQLEN, VOCAB = 2048, 512


@pytest.fixture(scope="module")
def megatron_on_gpu():
    folder = tempfile.mkdtemp()
    dist.init_process_group("nccl", init_method=f"file://{os.path.join(folder, 'init')}",
                            rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _gpt(spec, seed=0):
    torch.manual_seed(seed)
    config = TransformerConfig(num_layers=2, hidden_size=512, num_attention_heads=8,
                               num_query_groups=2, kv_channels=128, attention_dropout=0.0,
                               hidden_dropout=0.0, use_cpu_initialization=True)
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQLEN,
                    position_embedding_type="rope").cuda()


def test_every_block_kept_on_the_kernels_is_megatrons_attention_in_bf16(megatron_on_gpu):
    """16 blocks of 128 all kept: the MSA GPT on the Triton/Gluon kernels under bf16 autocast
    gives Megatron's own attention's logits within bf16 rounding (its error against the fp32
    run at most twice that of Megatron's own bf16 run, plus a little)."""
    dense = _gpt(get_gpt_layer_local_spec())
    msa = _gpt(openmsa_megatron.get_gpt_layer_msa_spec(top_k=16, block_size=128))
    msa.load_state_dict(dense.state_dict(), strict=False)
    generator = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(VOCAB, (1, SEQLEN), device="cuda", generator=generator)
    positions = torch.arange(SEQLEN, device="cuda")[None]
    mask = torch.triu(torch.ones(SEQLEN, SEQLEN, dtype=torch.bool, device="cuda"), 1)[None, None]
    with torch.no_grad():
        expected = dense(tokens, positions, mask).float()
        with torch.autocast("cuda", torch.bfloat16):
            dense_bf16 = dense(tokens, positions, mask).float()
            msa_bf16 = msa(tokens, positions, mask).float()
    baseline = rel_rms_error(dense_bf16, expected)
    assert rel_rms_error(msa_bf16, expected) <= 2 * baseline + 1e-3, baseline
    assert openmsa_megatron.megatron_msa_kl(msa) > 0


def test_example_trains_on_the_kernels_in_bf16(megatron_on_gpu):
    """examples/megatron_pretrain.py's model and loop on the GPU (bf16 autocast, the kernels),
    with and without index sharing: finite losses through warmup into sparse attention, a KL
    that trains."""
    import importlib.util

    path = Path(__file__).parents[2] / "examples" / "megatron_pretrain.py"
    spec = importlib.util.spec_from_file_location("megatron_pretrain", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    for every in (1, 2):
        torch.manual_seed(0)
        model = example.build_model(4096, layers=2, top_k=4, share_index_every=every).cuda()
        losses = example.train(model, steps=20, warmup_steps=5, batch=2, seqlen=4096,
                               device="cuda")
        assert all(torch.isfinite(torch.tensor(losses))), losses
        assert openmsa_megatron.megatron_msa_kl(model) > 0
