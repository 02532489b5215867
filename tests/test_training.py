"""A tiny attention model trained with the kernels and with the reference ends with the same
weights (CPU interpreter, fp32)."""

import pytest
import torch

import openmsa
from openmsa.ops import msa as msa_module

pytestmark = pytest.mark.skipif(not msa_module.INTERPRETING,
                                reason="needs TRITON_INTERPRET=1 (the README's test command)")


class TinyMSAModel(torch.nn.Module):
    def __init__(self, dim=32, heads=4, kv_heads=2, index_heads=2, head_dim=64):
        super().__init__()
        self.heads, self.kv_heads, self.index_heads, self.head_dim = (heads, kv_heads,
                                                                      index_heads, head_dim)
        self.q = torch.nn.Linear(dim, heads * head_dim, bias=False)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * head_dim, bias=False)
        self.index_q = torch.nn.Linear(dim, index_heads * head_dim, bias=False)
        self.index_k = torch.nn.Linear(dim, head_dim, bias=False)
        self.out = torch.nn.Linear(heads * head_dim, dim, bias=False)

    def forward(self, x, backend):
        batch, seqlen, _ = x.shape
        q = self.q(x).view(batch, seqlen, self.heads, self.head_dim)
        k, v = self.kv(x).view(batch, seqlen, 2, self.kv_heads, self.head_dim).unbind(2)
        detached = x.detach()  # the KL trains the index projections only
        index_q = self.index_q(detached).view(batch, seqlen, self.index_heads, self.head_dim)
        index_k = self.index_k(detached).view(batch, seqlen, 1, self.head_dim)
        out, kl = openmsa.msa_attention(q, k, v, index_q, index_k, top_k=2, block_size=64,
                                        backend=backend)
        return self.out(out.reshape(batch, seqlen, -1)), kl


def train(backend, steps=10):
    torch.manual_seed(0)
    model = TinyMSAModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    data = torch.randn(2, 200, 32, generator=torch.Generator().manual_seed(1))
    target = torch.randn(2, 200, 32, generator=torch.Generator().manual_seed(2))
    for _ in range(steps):
        prediction, kl = model(data, backend)
        loss = torch.nn.functional.mse_loss(prediction, target) + 0.5 * kl
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model


def test_ten_steps_with_kernels_match_ten_steps_with_the_reference():
    kernels, reference = train("triton"), train("reference")
    torch.manual_seed(0)
    initial = TinyMSAModel()  # the weights training started from: every one must have moved
    for (name, got), (_, expected), (_, start) in zip(kernels.named_parameters(),
                                                      reference.named_parameters(),
                                                      initial.named_parameters()):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6, msg=name)
        assert not torch.allclose(got, start), name
