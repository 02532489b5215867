"""The KL's value alone (no gradient wanted, as under ``torch.no_grad``) on the GPU, in bf16, on
every selection kind and in warmup: it comes from the one-pass key-outer kernel, and must equal
the value the training forward returns and the fp32 reference's on the same kept blocks.
Skipped without a GPU."""

import pytest
import torch

import openmsa
from openmsa.bench.selection import SELECTION_KINDS, index_inputs

SEQLEN = 4096
HEADS, KV_HEADS, INDEX_HEADS, DIM = 16, 2, 4, 128


def inputs(kind: str, seed: int = 0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(1, SEQLEN, h, DIM, device="cuda", generator=generator).bfloat16()
               for h in (HEADS, KV_HEADS, KV_HEADS))
    index_q, index_k = index_inputs(kind, SEQLEN, INDEX_HEADS, DIM, generator)
    return q, k, v, index_q[None], index_k[None]  # index_inputs gives bf16


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("mode", [*SELECTION_KINDS, "warmup"])
def test_kl_value_alone_matches_the_training_value_and_the_reference(mode, deterministic):
    kind = "coherent" if mode == "warmup" else mode
    tensors = inputs(kind)
    options = dict(top_k=16, block_size=128, warmup=mode == "warmup",
                   deterministic=deterministic)
    with torch.no_grad():
        _, value_alone = openmsa.msa_attention(*tensors, **options)
        _, again = openmsa.msa_attention(*tensors, **options)
    assert torch.equal(value_alone, again)  # summed per program in a fixed order
    trained = [t.clone().requires_grad_() for t in tensors]
    _, with_gradients, *ids = openmsa.msa_attention(*trained, return_indices=mode != "warmup",
                                                    **options)
    # The same pairs, summed per program (value alone, default path) or per query (the
    # deterministic training forward): summation order only.
    torch.testing.assert_close(value_alone, with_gradients.detach(), rtol=1e-4, atol=0)
    reference_options = dict(options, backend="reference")
    if mode != "warmup":
        reference_options["block_indices"] = ids[0]
    with torch.no_grad():
        _, expected = openmsa.msa_attention(*(t.float() for t in tensors), **reference_options)
    torch.testing.assert_close(value_alone, expected, rtol=2e-2, atol=0)
    assert value_alone > 0
