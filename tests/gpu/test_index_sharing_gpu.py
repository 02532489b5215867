"""Index sharing across layers on the GPU (SPEC section 9): the main attention alone over given
blocks and in warmup (cuDNN and the Triton kernels) against the fp32 reference in bf16, a shared
stack under torch.compile (inductor, fullgraph) and replayed from a CUDA graph. Skipped
without a GPU."""

import pytest
import torch

import openmsa
from openmsa.bench.timing import captured as captured_graph
from openmsa.layers import MSAAttention
from openmsa.testing import rel_rms_error

BF16_ERROR = 1e-2  # rel. RMS of bf16 kernels against the fp32 reference (measured ~3e-3)


def _inputs(lead, seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(*lead, heads, 128, device="cuda", generator=generator).bfloat16()
            for heads in (16, 2, 2, 4, 1)]


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("warmup", [False, True])
def test_sparse_attention_matches_the_fp32_reference_in_bf16(packed, warmup):
    """Given blocks (the library's selection) or warmup's every causal block: cuDNN for batch
    rows, the Triton / Hopper kernels for packed ones; out, dq, dk, dv."""
    lead, call = ((3000,), dict(cu_seqlens=torch.tensor([0, 1000, 1001, 3000], device="cuda",
                                                        dtype=torch.int32))) \
        if packed else ((2, 2048), {})
    q, k, v, index_q, index_k = _inputs(lead)
    ids = None if warmup else openmsa.select_blocks(index_q, index_k, top_k=8, block_size=128,
                                                    **call)
    options = dict(call, block_size=128, warmup=warmup)
    if warmup:
        options["num_index_heads"] = 4
    dout = torch.randn_like(q)

    def run(dtype, backend):
        tensors = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = openmsa.sparse_attention(*tensors, ids, backend=backend, **options)
        return [out, *torch.autograd.grad(out, tensors, dout.to(dtype))]

    for name, got, expected in zip(("out", "dq", "dk", "dv"), run(torch.bfloat16, "auto"),
                                   run(torch.float32, "reference")):
        assert got.dtype == torch.bfloat16
        assert rel_rms_error(got.float(), expected) < BF16_ERROR, name


def _stack(deterministic=False, share_index_kl=False, backend="auto"):
    torch.manual_seed(0)
    first = MSAAttention(512, num_heads=8, num_kv_heads=2, head_dim=128, num_index_heads=4,
                         top_k=4, block_size=128, deterministic=deterministic, backend=backend)
    second = MSAAttention(512, num_heads=8, num_kv_heads=2, head_dim=128, num_index_heads=4,
                          top_k=4, block_size=128, deterministic=deterministic,
                          share_index_from=first, share_index_kl=share_index_kl,
                          backend=backend)
    return torch.nn.ModuleList([first, second]).cuda().bfloat16()


@pytest.mark.parametrize("warmup", [False, True])
def test_share_index_kl_matches_the_fp32_reference_in_bf16(warmup):
    """share_index_kl: the sharing layer's KL and its gradient on layer 0's index projections,
    kernels in bf16 against the reference in fp32 on the same weights and the same ids."""
    x = torch.randn(2, 2048, 512, device="cuda", dtype=torch.bfloat16)
    results = {}
    for backend, dtype in (("auto", torch.bfloat16), ("reference", torch.float32)):
        stack = _stack(share_index_kl=True, backend=backend).to(dtype)
        for layer in stack:
            layer.warmup = warmup
        given = results["auto"][2] if backend == "reference" and not warmup else None
        hidden, _, ids = stack[0](x.to(dtype), return_indices=True, block_indices=given)
        _, kl = stack[1](hidden)
        grads = torch.autograd.grad(kl, [stack[0].index_q_proj.weight,
                                         stack[0].index_k_proj.weight])
        results[backend] = (kl, grads, ids)
    (kl, grads, _), (expected_kl, expected_grads, _) = results["auto"], results["reference"]
    assert abs(kl.float() - expected_kl) <= BF16_ERROR * expected_kl
    for got, expected in zip(grads, expected_grads):
        assert rel_rms_error(got.float(), expected) < 3 * BF16_ERROR


def _loss(stack, x):
    hidden, kl = stack[0](x)
    hidden, second_kl = stack[1](hidden)
    return hidden.float().square().mean() + kl + second_kl


@pytest.mark.parametrize("share_index_kl", [False, True])
def test_shared_stack_compiles_with_fullgraph_on_inductor(share_index_kl):
    stack = _stack(share_index_kl=share_index_kl)
    x = torch.randn(2, 1024, 512, device="cuda", dtype=torch.bfloat16)
    parameters = list(stack.parameters())
    eager = _loss(stack, x)
    eager_grads = torch.autograd.grad(eager, parameters)
    compiled = torch.compile(lambda x: _loss(stack, x), fullgraph=True)
    loss = compiled(x)
    grads = torch.autograd.grad(loss, parameters)
    torch.testing.assert_close(loss, eager, rtol=2e-2, atol=1e-3)
    for got, expected in zip(grads, eager_grads):
        assert (got.float() - expected.float()).norm() <= 2e-2 * expected.float().norm() + 1e-6


@pytest.mark.parametrize("share_index_kl", [False, True])
def test_shared_stack_replays_under_a_cuda_graph_bitwise(share_index_kl):
    """deterministic=True: captured once, replayed on new inputs, bitwise equal to eager."""
    stack = _stack(deterministic=True, share_index_kl=share_index_kl)
    parameters = list(stack.parameters())
    static = torch.randn(1, 2048, 512, device="cuda", dtype=torch.bfloat16)

    def step(x):
        loss = _loss(stack, x)
        return (loss,) + torch.autograd.grad(loss, parameters)

    graph, captured = captured_graph(lambda: step(static))
    for seed in (1, 2):
        fresh = torch.randn(1, 2048, 512, device="cuda", dtype=torch.bfloat16,
                            generator=torch.Generator(device="cuda").manual_seed(seed))
        static.copy_(fresh)
        graph.replay()
        for got, want in zip(captured, step(fresh)):
            assert torch.equal(got, want)
