"""``AutoTuning`` on the GPU: the measurement goes through pinned memory and an event without a
synchronization, the route switches once it has landed, the results are the chosen tuning's,
and a CUDA graph capture neither reads nor measures. Skipped without a GPU."""

import torch

import openmsa
from openmsa.ops.configs import ADAPTIVE_TUNING, DEFAULT_TUNING
from openmsa.testing import MSACase, random_inputs

# Random index inputs at 8k: most 8-token tiles' unions pass the adaptive limit (32 blocks).
# deterministic=True: every sum in a fixed order (the hard rows' dQ key-outer), so the routes'
# results compare bitwise.
CASE = MSACase("wide_group_8k", batch=1, seqlen=8192, num_heads=64, num_kv_heads=4,
               num_index_heads=4, head_dim=128, index_head_dim=128,
               options=dict(top_k=8, block_size=64, deterministic=True))


def _inputs(seed):
    inputs, _ = random_inputs(CASE, torch.bfloat16, "cuda", seed=seed)
    return [t.detach().requires_grad_() for t in inputs]


def _step(inputs, tuning):
    out, kl = openmsa.msa_attention(*inputs, tuning=tuning, **CASE.options)
    grads = torch.autograd.grad(out.float().square().sum() + kl, inputs)
    return [out.detach(), kl.detach(), *grads]


def test_measurement_lands_without_a_synchronization_and_switches_the_route():
    inputs = _inputs(0)
    auto = openmsa.AutoTuning()
    first = _step(inputs, auto)
    host, event = auto._pending
    assert host.is_pinned() and isinstance(event, torch.cuda.Event)
    torch.cuda.synchronize()
    assert auto.tuning == ADAPTIVE_TUNING, auto
    assert auto.threshold < auto.long_walk_share <= 1.0
    second = _step(inputs, auto)
    for name, got, expected in zip(("out", "kl", "dq", "dk", "dv", "dindex_q", "dindex_k"),
                                   first + second, _step(inputs, DEFAULT_TUNING)
                                   + _step(inputs, ADAPTIVE_TUNING)):
        assert torch.equal(got, expected), name


def test_a_captured_graph_neither_reads_nor_measures():
    static = _inputs(1)
    auto = openmsa.AutoTuning()

    def step():
        out, kl = openmsa.msa_attention(*static, tuning=auto, **CASE.options)
        return [out] + list(torch.autograd.grad(out.float().square().sum() + kl, static))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # measures: the capture below runs the adaptive route
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    route = auto.tuning
    assert route == ADAPTIVE_TUNING and auto._pending is None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    assert auto._pending is None, "a measurement was queued inside the capture"
    graph.replay()
    torch.cuda.synchronize()
    eager = _step(static, ADAPTIVE_TUNING)
    for name, got, expected in zip(("out", "dq", "dk", "dv"), captured, [eager[0]] + eager[2:5]):
        assert torch.equal(got, expected), name
