"""msa_attention as custom operators: opcheck, and torch.compile(fullgraph=True) through a model
(CPU, Triton interpreter); the kernel launch's fallback. The GPU versions are in
tests/gpu/test_production_gpu.py."""

import pytest
import torch

import openmsa
from openmsa.ops import msa as msa_module
from openmsa.ops.custom_ops import msa_backward, msa_forward

pytestmark = pytest.mark.skipif(not msa_module.INTERPRETING,
                                reason="needs TRITON_INTERPRET=1 (the README's test command)")


def packed_problem(dtype=torch.float32, seed=0):
    """Two packed sequences (70 and 80 tokens), H4/Hkv2, Hi2/Hik1, D64, blocks of 64."""
    generator = torch.Generator().manual_seed(seed)
    q, k, v, index_q, index_k = (torch.randn(150, heads, 64, generator=generator, dtype=dtype)
                                 .requires_grad_() for heads in (4, 2, 2, 2, 1))
    cu_seqlens = torch.tensor([0, 70, 150], dtype=torch.int32)
    return q, k, v, index_q, index_k, cu_seqlens


@pytest.mark.parametrize("kl_value", [True, False])
def test_forward_operator_passes_opcheck(kl_value):
    q, k, v, index_q, index_k, cu_seqlens = packed_problem()
    args = (q, k, v, index_q, index_k, cu_seqlens, None, 2, 64, 0.125, 0.125, 1, 0, False, 80,
            kl_value, True)
    torch.library.opcheck(msa_forward, args)


@pytest.mark.parametrize("main_grads,index_grads", [(True, True), (True, False),
                                                   (False, True)])
def test_backward_operator_passes_opcheck(main_grads, index_grads):
    """Also with a frozen main or index branch, whose gradients are distinct empty tensors."""
    q, k, v, index_q, index_k, cu_seqlens = packed_problem()
    with torch.no_grad():
        out, _, *saved = msa_forward(q, k, v, index_q, index_k, cu_seqlens, None, 2, 64, 0.125,
                                     0.125, 1, 0, False, 80, True, index_grads)
    dout = torch.randn_like(out)
    args = (dout, torch.tensor(1.5), q.detach(), k.detach(), v.detach(), index_q.detach(),
            index_k.detach(), out, *saved, cu_seqlens, 64, 0.125, 0.125, index_grads,
            main_grads)
    torch.library.opcheck(msa_backward, args)


def test_operators_pass_opcheck_with_a_query_range():
    """Queries 37..119 of the 150 keys' packing (the range starts inside a block and crosses
    into the second sequence): the fake's tile-list length includes the range's partial first
    tile, and the backward runs through the registered autograd formula."""
    q, k, v, index_q, index_k, cu_seqlens = packed_problem()
    q, index_q = (t.detach()[37:120].requires_grad_() for t in (q, index_q))
    args = (q, k, v, index_q, index_k, cu_seqlens, None, 2, 64, 0.125, 0.125, 1, 0, False, 80,
            True, True, 37, 150)
    torch.library.opcheck(msa_forward, args)


class TinyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = openmsa.MSAAttention(64, num_heads=4, num_kv_heads=2, head_dim=64,
                                              top_k=2, block_size=64, backend="triton")

    def forward(self, x):
        hidden, kl = self.attention(x)
        return hidden.square().mean() + kl


def test_model_compiles_with_fullgraph_and_matches_eager():
    """No graph breaks (fullgraph=True fails on any); aot_eager traces forward and backward
    through the fake implementations without needing a C++ compiler."""
    torch.manual_seed(0)
    model = TinyModel()
    x = torch.randn(2, 150, 64)
    eager_loss = model(x)
    eager_grads = torch.autograd.grad(eager_loss, list(model.parameters()))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    loss = compiled(x)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    for got, expected in zip(grads, eager_grads):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("frozen", ["index", "main"])
def test_model_with_a_frozen_branch_compiles_and_matches_eager(frozen):
    """Frozen index projections (fine-tuning the main weights) or frozen main projections
    (training the index branch of a converted model): compiled with fullgraph, the trainable
    parameters get the eager gradients, the frozen ones none."""
    torch.manual_seed(0)
    model = TinyModel()
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(("index_" in name) != (frozen == "index"))
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert 0 < len(trainable) < len(list(model.parameters()))
    x = torch.randn(2, 150, 64)
    eager_grads = torch.autograd.grad(model(x), trainable)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    grads = torch.autograd.grad(compiled(x), trainable)
    for got, expected in zip(grads, eager_grads):
        assert expected.abs().max() > 0
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


def test_forward_operator_passes_opcheck_with_fp8_selection():
    """index_precision is the operator's last argument; autograd's formula skips it."""
    q, k, v, index_q, index_k, cu_seqlens = packed_problem()
    args = (q, k, v, index_q, index_k, cu_seqlens, None, 2, 64, 0.125, 0.125, 1, 0, False, 80,
            True, True, 0, None, 0, False, "fp8")
    torch.library.opcheck(msa_forward, args)


@pytest.mark.parametrize("mode", ["warmup", "given_blocks"])
def test_forward_operator_passes_opcheck_in_every_mode(mode):
    """The fake implementation's shapes hold for warmup (every causal block) and given blocks."""
    q, k, v, index_q, index_k, cu_seqlens = packed_problem()
    block_ids = None
    if mode == "given_blocks":
        with torch.no_grad():
            ids = openmsa.select_blocks(index_q, index_k, top_k=2, block_size=64,
                                        cu_seqlens=cu_seqlens, backend="triton")
        block_ids = ids.permute(1, 0, 2).to(torch.int32).contiguous()  # token-major
    args = (q, k, v, index_q, index_k, cu_seqlens, block_ids, 2, 64, 0.125, 0.125, 1, 0,
            mode == "warmup", 80, True, True)
    torch.library.opcheck(msa_forward, args)


def test_launch_falls_back_to_one_stage_when_shared_memory_runs_out():
    from triton.runtime.errors import OutOfResources

    from openmsa.ops.launch import launch

    launches = []

    class Kernel:
        fn = type("fn", (), {"__name__": "fake_kernel"})

        def __getitem__(self, grid):
            def launch(*args, num_warps, num_stages, **constants):
                launches.append(num_stages)
                if num_stages > 1:
                    raise OutOfResources(246280, 232448, "shared memory")
            return launch

    remembered = set()
    launch(Kernel(), (1,), num_warps=8, num_stages=2, one_stage=remembered, TOK=64)
    launch(Kernel(), (1,), num_warps=8, num_stages=2, one_stage=remembered, TOK=64)  # known
    launch(Kernel(), (1,), num_warps=8, num_stages=2, one_stage=remembered, TOK=8)  # another
    assert launches == [2, 1, 1, 2, 1]


def test_eager_calls_run_the_pipeline_without_the_operator_dispatch():
    """Eager calls take the autograd Function (no operator dispatch); fake and meta tensors, an
    active dispatch mode and tensor subclasses take the registered operator. Both routes give
    bitwise the same outputs and gradients."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    from openmsa.ops.custom_ops import eager_msa_forward, msa_operator

    q, k, v, index_q, index_k, cu_seqlens = packed_problem()
    inputs = (q, k, v, index_q, index_k)
    assert msa_operator(*inputs) is eager_msa_forward
    assert msa_operator(*(torch.nn.Parameter(t.detach()) for t in inputs)) is eager_msa_forward
    assert msa_operator(*(t.to("meta") for t in inputs)) is msa_forward
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(t) for t in inputs]
        assert msa_operator(*fakes) is msa_forward
    with FlopCounterMode(display=False):
        assert msa_operator(*inputs) is msa_forward

    class Subclass(torch.Tensor):
        pass

    assert msa_operator(q.detach().as_subclass(Subclass), *inputs[1:]) is msa_forward

    def run(operator):
        out_grad = torch.randn(150, 4, 64, generator=torch.Generator().manual_seed(3))
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        out, kl, *_ = operator(*leaves, cu_seqlens, None, 2, 64, 0.125, 0.125, 1, 0, False,
                               80, True, True, 0, None, 0, True)
        grads = torch.autograd.grad((out, kl), leaves, (out_grad, torch.tensor(0.7)))
        return [out, kl, *grads]

    for got, expected in zip(run(eager_msa_forward), run(msa_forward)):
        assert torch.equal(got, expected)
