"""The key-outer forward and dQ (``attention.key_outer``) on the GPU, next to the Gluon walk of
the other tiles: bf16 against the fp32 reference (within twice the reference's own bf16 error),
bitwise the same twice and under a CUDA graph. Skipped without a GPU."""

import dataclasses
import json
import os

import pytest
import torch

from openmsa.bench.timing import captured as captured_graph
from openmsa.ops import attention as attention_module
from openmsa.ops.attention import (attention_backward, key_outer, sm90_backward,
                                    sm90_key_outer)
from openmsa.ops.attention import sparse_attention_fwd
from openmsa.ops.configs import Tuning
from openmsa.testing import (TOLERANCE, MSACase, compare_with_reference, random_inputs,
                             rel_rms_error, run_with_grads, tuned_msa_attention)

# Random index inputs: neighbouring tokens keep different blocks, so most tiles go key-outer.
CASES = [
    MSACase("paper_groups", batch=1, seqlen=4096, num_heads=16, num_kv_heads=2,
            num_index_heads=4, head_dim=128, index_head_dim=128,
            options=dict(top_k=16, block_size=128)),
    MSACase("wide_group", batch=1, seqlen=4096, num_heads=64, num_kv_heads=4, num_index_heads=4,
            head_dim=128, index_head_dim=128, options=dict(top_k=8, block_size=128)),
    MSACase("packed_d64_block64", seqlens=(1000, 1, 2100, 640), num_heads=8, num_kv_heads=2,
            num_index_heads=2, options=dict(top_k=8, block_size=64, num_sink_blocks=1,
                                            num_local_blocks=2)),
]
# One block per kept slot (at 4k tokens a union holds at most 32 blocks); windows of partials of
# 64 MiB (several a pass).
TUNING = Tuning(main_walk_limit_per_slot=1.0, key_outer_partial_bytes=64 << 20)


def _record(test: str, case, comparison, **fields) -> None:
    """Prints a bf16 comparison's errors (kernels / reference in bf16) and appends them, with
    ``fields``, to the JSON lines file OPENMSA_GPU_RECORD names, if any."""
    record = os.environ.get("OPENMSA_GPU_RECORD")
    if record:
        with open(record, "a") as f:
            f.write(json.dumps({"test": test, "case": case.name, **fields,
                                "errors": comparison.errors,
                                "reference_bf16_errors": comparison.baseline_errors}) + "\n")
    print(case.name, fields, {n: f"{e:.2e}/{comparison.baseline_errors[n]:.2e}"
                              for n, e in comparison.errors.items()})


def _count_gluon_launches(monkeypatch) -> list:
    """The Gluon key-outer launches made from now on: True for dQ's, False for the forward's."""
    launches = []
    original = sm90_key_outer.launch_key_outer

    def counted(*args, **kwargs):
        launches.append(kwargs.get("dout") is not None)
        return original(*args, **kwargs)

    monkeypatch.setattr(sm90_key_outer, "launch_key_outer", counted)
    return launches


def _record_gluon_grids(monkeypatch) -> list:
    """The grids of the Gluon key-outer kernel's launches made from now on."""
    grids = []
    kernel = sm90_key_outer._key_outer_hopper_kernel

    class Recorded:
        def __getitem__(self, grid):
            grids.append(tuple(grid))
            return kernel[grid]

    monkeypatch.setattr(sm90_key_outer, "_key_outer_hopper_kernel", Recorded())
    return grids


@pytest.mark.parametrize("kernels,dq_partials", [("gluon", "float32"), ("triton", "float32"),
                                                ("gluon", "input"), ("triton", "input")])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_bf16_key_outer_within_twice_the_reference_error(case, kernels, dq_partials,
                                                         monkeypatch):
    """Both kernels, the dQ partials in fp32 and in bf16 (``Tuning.key_outer_dq_partials``)."""
    counts = []
    original = key_outer.hard_rows

    def counted(p, limit, **options):
        hard = original(p, limit, **options)
        counts.append(hard.float().mean().item())
        return hard

    monkeypatch.setattr(key_outer, "hard_rows", counted)
    monkeypatch.setattr(key_outer, "KEY_OUTER_HOPPER", kernels == "gluon")
    launches = _count_gluon_launches(monkeypatch)
    slot_bytes = []
    windows = key_outer._windows
    monkeypatch.setattr(key_outer, "_windows",
                        lambda p, size, *rest: slot_bytes.append(size) or windows(p, size, *rest))
    tuning = dataclasses.replace(TUNING, key_outer_dq_partials=dq_partials)
    comparison = compare_with_reference(tuned_msa_attention(tuning), case, torch.bfloat16,
                                        "cuda")
    _record("key_outer_bf16", case, comparison, kernels=kernels, dq_partials=dq_partials,
            hard_row_share=counts)
    assert counts and all(share > 0 for share in counts), counts
    # dQ's partials took 4 bytes an element, or the inputs' 2.
    assert slot_bytes[1] == (4 if dq_partials == "float32" else 2) * case.head_dim, slot_bytes
    # The Gluon kernels ran both passes, or none ran when switched off.
    assert set(launches) == ({False, True} if kernels == "gluon" else set()), launches
    assert comparison.passed(TOLERANCE[torch.bfloat16]), comparison.errors


@pytest.mark.parametrize("forward_limit", [0.0, 1.0])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_bf16_dq_from_dkdv_atomics_within_twice_the_reference_error(case, forward_limit,
                                                                    monkeypatch):
    """``Tuning.dq_pass = "dkdv_atomic"``: no dQ walk, every row's dQ added atomically by the
    (Triton) dK/dV steps; the forward walking every tile, or its hard rows key-outer."""
    routes = []
    original = attention_module.triton_backward_atomic_dq
    monkeypatch.setattr(attention_module, "triton_backward_atomic_dq",
                        lambda *args: routes.append(1) or original(*args))
    tuning = dataclasses.replace(TUNING, dq_pass="dkdv_atomic",
                                 main_walk_limit_per_slot=forward_limit)
    comparison = compare_with_reference(tuned_msa_attention(tuning), case, torch.bfloat16,
                                        "cuda")
    _record("dq_from_dkdv_atomics_bf16", case, comparison, forward_limit=forward_limit)
    assert routes, "the dK/dV pass did not give dq"
    assert comparison.passed(TOLERANCE[torch.bfloat16]), comparison.errors


@pytest.mark.parametrize("kl_value", [True, False])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_bf16_hard_rows_dq_from_dkdv_atomics_within_twice_the_reference_error(case, kl_value,
                                                                              monkeypatch):
    """``Tuning.dq_pass = "hard_atomic"``: the walk's rows get their dq from the (Gluon) dQ
    walk, the hard rows' from the atomic adds of the Triton dK/dV steps over the segments
    holding a hard pair; the other segments from the Gluon dK/dV kernel told to skip the
    flagged ones (with ``kl_value=False`` every segment on the Triton kernel, which stores the
    KL teachers)."""
    routes = []
    original = attention_module.dkdv_with_hard_atomic_dq
    monkeypatch.setattr(attention_module, "dkdv_with_hard_atomic_dq",
                        lambda *args: routes.append(1) or original(*args))
    skips = []
    gluon_parts = sm90_backward.attention_dkdv_parts

    def recorded(*args, skip=None, **options):
        skips.append(skip is not None)
        return gluon_parts(*args, skip=skip, **options)

    monkeypatch.setattr(sm90_backward, "attention_dkdv_parts", recorded)
    tuning = dataclasses.replace(TUNING, dq_pass="hard_atomic")
    comparison = compare_with_reference(tuned_msa_attention(tuning), case, torch.bfloat16,
                                        "cuda", kl_value=kl_value)
    _record("hard_rows_dq_from_dkdv_atomics_bf16", case, comparison, kl_value=kl_value)
    assert routes, "the hard rows' dq did not come from the dK/dV pass"
    # Every Gluon dK/dV launch left the atomic kernel's segments; on Hopper one ran when no
    # teacher was stored (the 128-dim cases).
    assert all(skips), skips
    if kl_value and case.head_dim == 128 and torch.cuda.get_device_capability()[0] == 9:
        assert skips, "the Gluon dK/dV kernel did not run"
    assert comparison.passed(TOLERANCE[torch.bfloat16]), comparison.errors


@pytest.mark.parametrize("dq_pass", ["walk", "dkdv_atomic"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_bf16_kl_teachers_from_dkdv_within_twice_the_reference_error(case, dq_pass,
                                                                     monkeypatch):
    """``Tuning.kl_teacher = "from_dkdv"`` with ``kl_value=False``: no KL in the forward, the
    (Triton) dK/dV pass stores the teachers in fp16 and the KL pass reads them; with the dQ
    walk or the atomic dQ."""
    from openmsa.ops import pipeline

    calls = []
    original = pipeline.kl_from_teacher
    monkeypatch.setattr(pipeline, "kl_from_teacher",
                        lambda *args: calls.append(1) or original(*args))
    tuning = Tuning(kl_teacher="from_dkdv", dq_pass=dq_pass)
    comparison = compare_with_reference(tuned_msa_attention(tuning), case, torch.bfloat16,
                                        "cuda", kl_value=False)
    _record("kl_teachers_from_dkdv_bf16", case, comparison, dq_pass=dq_pass)
    assert calls == [1], calls
    assert comparison.passed(TOLERANCE[torch.bfloat16]), comparison.errors


@pytest.mark.parametrize("dq_pass", ["dkdv_atomic", "hard_atomic"])
def test_dq_from_dkdv_atomics_under_a_cuda_graph(dq_pass):
    """``dq_pass = "dkdv_atomic"`` and ``"hard_atomic"`` wait on no host value: a step
    captured in a CUDA graph and replayed on new inputs gives the eager step's values up to the
    atomic sums' order (dq within bf16 rounding, everything else bitwise)."""
    case = CASES[1]
    attention = tuned_msa_attention(dataclasses.replace(TUNING, dq_pass=dq_pass))
    inputs, cu_seqlens = random_inputs(case, torch.bfloat16, "cuda", seed=3)
    static = [t.detach().clone().requires_grad_() for t in inputs]
    out_grad = torch.randn_like(inputs[0])

    def step():
        out, kl = attention(*static, cu_seqlens=cu_seqlens, **case.options)[:2]
        loss = (out.float() * out_grad.float()).sum() + kl
        return (out,) + torch.autograd.grad(loss, static)[:3]

    graph, captured = captured_graph(step)
    fresh, _ = random_inputs(case, torch.bfloat16, "cuda", seed=11)
    with torch.no_grad():
        for target, value in zip(static, fresh):
            target.copy_(value)
    graph.replay()
    for name, got, want in zip(("out", "dq", "dk", "dv"), captured, step()):
        if name == "dq":
            assert rel_rms_error(got.float(), want.float()) < 1e-2, name
        else:
            assert torch.equal(got, want), name


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_bf16_index_lse_split_within_twice_the_reference_error(case, monkeypatch):
    """``Tuning.index_lse_split``: the index log-sum-exp beside the Gluon forward split between
    its walk and the key-outer pass over the left rows' pairs (the KL's student normalizer,
    so d index_q and d index_k carry its error), with and without the key-outer main passes;
    bitwise the same twice."""
    calls = []
    original = attention_module.index_log_sum_exp_key_outer
    monkeypatch.setattr(attention_module, "index_log_sum_exp_key_outer",
                        lambda *args: calls.append(1) or original(*args))
    for tuning in (Tuning(index_lse_split=True),
                   dataclasses.replace(TUNING, index_lse_split=True)):
        comparison = compare_with_reference(tuned_msa_attention(tuning), case, torch.bfloat16,
                                            "cuda")
        print(case.name, {n: f"{e:.2e}/{comparison.baseline_errors[n]:.2e}"
                          for n, e in comparison.errors.items()})
        assert comparison.passed(TOLERANCE[torch.bfloat16]), comparison.errors
    assert calls, "the split did not run"
    inputs, cu_seqlens = random_inputs(case, torch.bfloat16, "cuda", seed=3)
    out_grad = torch.randn_like(inputs[0])
    runs = [run_with_grads(tuned_msa_attention(Tuning(index_lse_split=True)), inputs,
                           cu_seqlens, out_grad, 1.0, deterministic=True, **case.options)[0]
            for _ in range(2)]
    for name, value in runs[0].items():
        assert torch.equal(value, runs[1][name]), name


def test_key_outer_levers_replay_under_a_cuda_graph_bitwise():
    """The key-outer passes with the index log-sum-exp split wait on no host value: a training
    step captured
    once in a CUDA graph, replayed on new inputs, is bitwise the eager step
    (``deterministic=True``)."""
    case = CASES[1]
    tuning = dataclasses.replace(TUNING, index_lse_split=True)
    attention = tuned_msa_attention(tuning)
    inputs, cu_seqlens = random_inputs(case, torch.bfloat16, "cuda", seed=3)
    static = [t.detach().clone().requires_grad_() for t in inputs]
    out_grad = torch.randn_like(inputs[0])

    def step():
        out, kl = attention(*static, cu_seqlens=cu_seqlens, deterministic=True,
                            **case.options)[:2]
        loss = (out.float() * out_grad.float()).sum() + kl
        return (out, kl) + torch.autograd.grad(loss, static)

    graph, captured = captured_graph(step)
    for seed in (11, 12):
        fresh, _ = random_inputs(case, torch.bfloat16, "cuda", seed=seed)
        with torch.no_grad():
            for target, value in zip(static, fresh):
                target.copy_(value)
        graph.replay()
        for got, want in zip(captured, step()):
            assert torch.equal(got, want)


def test_key_outer_is_bitwise_deterministic():
    """deterministic=True (d index_k then without atomics): two runs bitwise equal."""
    case = CASES[1]
    inputs, _ = random_inputs(case, torch.bfloat16, "cuda", seed=3)
    out_grad = torch.randn_like(inputs[0])
    runs = [run_with_grads(tuned_msa_attention(TUNING), inputs, None, out_grad, 1.0,
                           deterministic=True, **case.options)[0] for _ in range(2)]
    for name, value in runs[0].items():
        assert torch.equal(value, runs[1][name]), name


@pytest.mark.parametrize("programs", [None, 1, 3], ids=["a_program_per_sm", "one_program",
                                                        "three_programs"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gluon_key_outer_matches_the_triton_kernels(case, programs, monkeypatch):
    """The Gluon key-outer forward and dQ against the Triton ones on the same hard rows: the
    same products in another order (relative RMS within bf16 rounding). ``programs``: the
    persistent grid's size (None: a program per SM), fewer programs taking more segments each
    (the barriers' phases carried from segment to segment)."""
    if programs is not None:
        monkeypatch.setattr(sm90_key_outer, "multiprocessors", lambda device: programs)
    grids = _record_gluon_grids(monkeypatch)
    from openmsa.ops.layout import batch_cu_seqlens
    from openmsa.ops.problem import SparseAttentionProblem
    from openmsa.ops.select import select_blocks_fwd

    inputs, cu = random_inputs(case, torch.bfloat16, "cuda", seed=5)
    q, k, v, index_q, index_k = (t.detach().reshape(-1, *t.shape[-2:]) for t in inputs)
    if cu is None:
        cu = batch_cu_seqlens(case.batch, case.seqlen, "cuda")
    options = dict(case.options)
    top_k, block = options.pop("top_k"), options.pop("block_size")
    ids, _ = select_blocks_fwd(index_q, index_k, cu, top_k=top_k, block_size=block,
                               index_softmax_scale=case.index_head_dim ** -0.5,
                               num_local_blocks=options.get("num_local_blocks", 1),
                               num_sink_blocks=options.get("num_sink_blocks", 0),
                               return_max=True)
    dout = torch.randn_like(q)
    results = {}
    for kernels in ("gluon", "triton"):
        monkeypatch.setattr(key_outer, "KEY_OUTER_HOPPER", kernels == "gluon")
        launches = _count_gluon_launches(monkeypatch)
        problem = SparseAttentionProblem(q, k, ids, cu, block, q.shape[-1] ** -0.5,
                                         tuning=TUNING)
        out, lse, _ = sparse_attention_fwd(q, k, v, None, None, problem)
        dq = attention_backward(q, k, v, out, dout, lse, problem)[0]
        results[kernels] = (out.float(), lse, dq.float())
        assert bool(launches) == (kernels == "gluon"), launches
    # The Gluon launches ran on the persistent grid asked for (no more programs than that).
    assert grids and all(len(grid) == 1 for grid in grids), grids
    if programs is not None:
        assert all(grid[0] <= programs for grid in grids) and (programs,) in grids, grids
    for name, gluon_value, triton_value in zip(("out", "lse", "dq"), results["gluon"],
                                               results["triton"]):
        error = rel_rms_error(gluon_value, triton_value)
        print(case.name, name, f"{error:.2e}")
        assert error < 1e-2, (name, error)


# The named tunings' dQ routes with a limit low enough that 4k-token tiles go key-outer.
NAMED_TUNING_ROUTES = [dataclasses.replace(TUNING, dq_pass=dq_pass, index_lse_split=True)
                       for dq_pass in ("hard_atomic", "dkdv_atomic")]


@pytest.mark.parametrize("tuning", ["adaptive", *NAMED_TUNING_ROUTES],
                         ids=["adaptive", "hard_atomic", "dkdv_atomic"])
@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: c.name)
def test_bf16_sparse_attention_under_a_named_tuning_within_twice_the_default_error(
        case, tuning, monkeypatch):
    """``sparse_attention(tuning=...)`` (a sharing layer's main attention) in bf16 on random
    selections: out, dq, dk and dv against the fp32 reference, within twice the error of the
    default routes (or bf16's tolerance). The tunings of one block a slot take their key-outer
    routes; "adaptive" (4 x top_k blocks a tile) at 4k tokens walks every tile, as no union
    of 32 blocks can pass its limit."""
    import openmsa
    limits = []
    original = key_outer.hard_rows
    monkeypatch.setattr(key_outer, "hard_rows",
                        lambda p, limit, **kw: limits.append(limit) or original(p, limit, **kw))
    inputs, cu = random_inputs(case, torch.bfloat16, "cuda", seed=3)
    q, k, v = (t.detach().requires_grad_() for t in inputs[:3])
    run = dict(case.options, return_indices=True, cu_seqlens=cu)
    with torch.no_grad():
        _, _, ids = openmsa.msa_attention(q, k, v, *inputs[3:], **run)
    sparse = dict(block_size=case.options["block_size"], cu_seqlens=cu)
    dout = torch.randn_like(q)

    def run_sparse(dtype, **options):
        qr, kr, vr = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
        out = openmsa.sparse_attention(qr, kr, vr, ids, **sparse, **options)
        return (out, *torch.autograd.grad(out, (qr, kr, vr), dout.to(dtype)))

    exact = run_sparse(torch.float32, backend="reference")
    default = run_sparse(torch.bfloat16)
    tuned = run_sparse(torch.bfloat16, tuning=tuning)
    assert bool(limits) == (tuning != "adaptive"), limits
    for name, value, baseline, expected in zip(("out", "dq", "dk", "dv"), tuned, default, exact):
        error, default_error = rel_rms_error(value, expected), rel_rms_error(baseline, expected)
        print(case.name, getattr(tuning, "dq_pass", tuning), name, f"{error:.2e}/{default_error:.2e}")
        assert error <= max(TOLERANCE[torch.bfloat16], 2 * default_error), (name, error,
                                                                            default_error)
