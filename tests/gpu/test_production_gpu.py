"""What a training stack needs on the GPU: custom operators that pass opcheck, torch.compile with
fullgraph=True, CUDA graph capture and replay of forward+backward, and steady memory over
repeated steps. Skipped without a GPU."""

import pytest
import torch

import openmsa
from openmsa import msa_attention
from openmsa.bench.timing import captured as captured_graph
from openmsa.ops.custom_ops import msa_backward, msa_forward
from openmsa.ops.layout import batch_cu_seqlens


def inputs(seqlen=2048, heads=16, kv_heads=2, index_heads=4, seed=0, batch=1):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(batch, seqlen, h, 128, device="cuda", generator=generator).bfloat16()
            .requires_grad_() for h in (heads, kv_heads, kv_heads, index_heads, 1)]


def packed(tensors):
    return [t.detach().reshape(-1, *t.shape[2:]).requires_grad_() for t in tensors]


@pytest.mark.parametrize("warmup_on_cudnn", [False, True])
def test_custom_operators_pass_opcheck_on_cuda(warmup_on_cudnn):
    q, k, v, index_q, index_k = packed(inputs(seqlen=1024))
    cu_seqlens = batch_cu_seqlens(1, 1024, "cuda")
    dense_batch = 1 if warmup_on_cudnn else 0
    args = (q, k, v, index_q, index_k, cu_seqlens, None, 8, 128, 128 ** -0.5, 128 ** -0.5, 1,
            0, warmup_on_cudnn, 1024, True, True, 0, None, dense_batch)
    torch.library.opcheck(msa_forward, args)
    with torch.no_grad():
        out, _, *saved = msa_forward(*args)
    backward_args = (torch.randn_like(out), torch.tensor(2.0, device="cuda"), q.detach(),
                     k.detach(), v.detach(), index_q.detach(), index_k.detach(), out, *saved,
                     cu_seqlens, 128, 128 ** -0.5, 128 ** -0.5, True, True, 0, None,
                     dense_batch)
    torch.library.opcheck(msa_backward, backward_args)


def test_model_compiles_with_fullgraph_on_inductor():
    torch.manual_seed(0)
    layer = openmsa.MSAAttention(512, num_heads=8, num_kv_heads=2, head_dim=128,
                                 num_index_heads=4, top_k=4, block_size=128).cuda().bfloat16()
    x = torch.randn(2, 1024, 512, device="cuda", dtype=torch.bfloat16)

    def loss_of(module):
        hidden, kl = module(x)
        loss = hidden.float().square().mean() + kl
        return loss, torch.autograd.grad(loss, list(layer.parameters()))

    eager_loss, eager_grads = loss_of(layer)
    compiled_loss, compiled_grads = loss_of(torch.compile(layer, fullgraph=True))
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=2e-2, atol=1e-3)
    for got, expected in zip(compiled_grads, eager_grads):
        assert (got.float() - expected.float()).norm() <= 2e-2 * expected.float().norm() + 1e-6


def test_reduce_overhead_compile_replays_the_step_from_cuda_graphs():
    """torch.compile(mode="reduce-overhead"): the layer's forward and backward replay from
    CUDA graphs (the short-context answer to the host's launch costs); the third call, a
    replay, gives the eager loss and gradients."""
    torch.manual_seed(0)
    layer = openmsa.MSAAttention(512, num_heads=8, num_kv_heads=2, head_dim=128,
                                 num_index_heads=4, top_k=4, block_size=128).cuda().bfloat16()
    x = torch.randn(2, 1024, 512, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True)

    def loss_of(module):
        hidden, kl = module(x)
        loss = hidden.float().square().mean() + kl
        grads = torch.autograd.grad(loss, list(layer.parameters()))
        return loss.detach().clone(), [g.detach().clone() for g in grads]

    eager_loss, eager_grads = loss_of(layer)
    for _ in range(3):  # warm-up, recording, replay
        torch.compiler.cudagraph_mark_step_begin()
        compiled_loss, compiled_grads = loss_of(compiled)
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=2e-2, atol=1e-3)
    for got, expected in zip(compiled_grads, eager_grads):
        assert (got.float() - expected.float()).norm() <= 2e-2 * expected.float().norm() + 1e-6


@pytest.mark.parametrize("deterministic", [True, False])
def test_forward_backward_replays_under_a_cuda_graph(deterministic):
    """Captured once, replayed on new data in the same buffers: equal to eager (nothing
    synchronizes with the host). Bitwise with ``deterministic=True``; by default the KL's value
    and index gradients are sums of atomic adds in any order, so they agree to fp32 rounding,
    and the main branch's outputs stay bitwise equal."""
    static = inputs()
    dout = torch.randn_like(static[0])
    one = torch.ones((), device="cuda")

    def step(tensors):
        out, kl = msa_attention(*tensors, top_k=8, block_size=128, deterministic=deterministic)
        return (out, kl) + torch.autograd.grad((out, kl), tensors, (dout, one))

    graph, captured = captured_graph(lambda: step(static))
    for seed in (1, 2):
        fresh = inputs(seed=seed)
        with torch.no_grad():
            for buffer, value in zip(static, fresh):
                buffer.copy_(value)
        graph.replay()
        expected = step(fresh)
        for name, got, want in zip(("out", "kl", "dq", "dk", "dv", "dindex_q", "dindex_k"),
                                   captured, expected):
            if deterministic or name in ("out", "dq", "dk", "dv"):
                assert torch.equal(got, want), name
            else:
                torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-5, msg=name)


def test_repeated_training_steps_do_not_grow_memory():
    tensors = inputs(seqlen=4096)
    dout = torch.randn_like(tensors[0])
    one = torch.ones((), device="cuda")
    allocated = []
    for _ in range(6):
        out, kl = msa_attention(*tensors, top_k=8, block_size=128)
        torch.autograd.grad((out, kl), tensors, (dout, one))
        del out, kl
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
    assert len(set(allocated[1:])) == 1, allocated


@pytest.mark.parametrize("where", ["q", "k"])
def test_non_finite_inputs_behave_like_sdpa(where):
    """A NaN in one query row spoils that row's output only; a NaN in one key spoils the rows
    that attend to it (those that kept its block), as in dense attention."""
    q, k, v, index_q, index_k = (t.detach() for t in inputs(seqlen=1024))
    target = q if where == "q" else k
    target[0, 700, 0, 5] = float("nan")
    out, _, ids = msa_attention(q, k, v, index_q, index_k, top_k=4, block_size=128,
                                return_indices=True)
    bad = out.isnan().any(-1)[0]  # [S, H]
    if where == "q":
        expected = torch.zeros_like(bad)
        expected[700, 0] = True
    else:  # key 700 is in block 5; every head of KV head 0 whose token kept block 5 and is >= 700
        kept = (ids[0] == 5).any(-1).permute(1, 0)  # [S, Hi]
        heads_per_index = q.shape[2] // index_q.shape[2]
        kept = kept.repeat_interleave(heads_per_index, dim=1)
        reads_kv0 = torch.arange(q.shape[2], device="cuda") < q.shape[2] // k.shape[2]
        expected = (kept & reads_kv0[None, :]
                    & (torch.arange(1024, device="cuda") >= 700)[:, None])
    assert torch.equal(bad, expected)
