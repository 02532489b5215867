"""The KL's kernels (value and index gradients, both passes) against the reference, under the
CPU interpreter, on the same kept blocks."""

import pytest
import torch

import openmsa
from openmsa.ops import msa as msa_module
from openmsa.ops import pipeline as pipeline_module
from openmsa.ops.configs import Tuning
from openmsa.ops.pipeline import teacher_bytes
from openmsa.testing import (QUANTITY_NAMES, MSACase, random_inputs, rel_rms_error,
                             run_with_grads, tuned_msa_attention)

from attention_cases import (CASES, TOLERANCE, count_calls, full_and_ranges,
                             kernel_and_reference, poison_new_buffers)

pytestmark = pytest.mark.skipif(not msa_module.INTERPRETING,
                                reason="needs TRITON_INTERPRET=1 (the README's test command)")


SCALED = MSACase("scales_not_the_defaults", seqlens=(100, 130), num_heads=4, num_kv_heads=2,
                 num_index_heads=2, options=dict(top_k=2, block_size=64, softmax_scale=0.3,
                                                 index_softmax_scale=0.7))


@pytest.mark.parametrize("case", CASES[1:3] + [SCALED], ids=lambda c: c.name)
def test_deterministic_kl_path_matches_reference(case):
    """deterministic=True takes the KL's value and index_q gradient from the query-side walk
    instead of the key-outer kernel's atomic adds; both walks use the given scales."""
    got, expected, _ = kernel_and_reference(case, torch.float32, deterministic=True)
    for name in QUANTITY_NAMES:
        error = rel_rms_error(got[name], expected[name])
        assert error < TOLERANCE[torch.float32], (name, error)


@pytest.mark.parametrize("deterministic", [False, True])
def test_kl_value_without_gradients_uses_the_given_scales(deterministic):
    """No gradient needed: the value alone comes from the key-outer kernel (its gradients
    dropped), with the given main and index scales (the default scales would give another KL)."""
    inputs, cu_seqlens = random_inputs(SCALED, torch.float32, "cpu", seed=17)
    tensors = [t.detach() for t in inputs]
    options = dict(SCALED.options, cu_seqlens=cu_seqlens, deterministic=deterministic)
    with torch.no_grad():
        _, kl, ids = openmsa.msa_attention(*tensors, backend="triton", return_indices=True,
                                           **options)
        _, expected = openmsa.msa_attention(*(t.double() for t in tensors),
                                            backend="reference", block_indices=ids, **options)
        _, at_default_scales = openmsa.msa_attention(
            *(t.double() for t in tensors), backend="reference", block_indices=ids,
            **dict(options, softmax_scale=None, index_softmax_scale=None))
    assert rel_rms_error(kl, expected) < 1e-5
    assert rel_rms_error(at_default_scales, expected) > 1e-2  # the scales matter here

def test_kl_value_and_index_k_gradient_need_no_index_q_gradient():
    """Without gradients the value comes from the key-outer kernel alone; with only index_k
    requiring one, the forward still computes the KL's gradients."""
    case = CASES[1]
    inputs, cu_seqlens = random_inputs(case, torch.float32, "cpu", seed=13)
    options = dict(case.options, backend="triton", cu_seqlens=cu_seqlens)
    q, k, v, index_q, index_k = (t.detach() for t in inputs)
    full_index_k = index_k.clone().requires_grad_()
    _, full_kl = openmsa.msa_attention(q, k, v, index_q.clone().requires_grad_(), full_index_k,
                                       **options)
    expected = torch.autograd.grad(full_kl, full_index_k)[0]
    with torch.no_grad():
        _, value_only = openmsa.msa_attention(q, k, v, index_q, index_k, **options)
    torch.testing.assert_close(value_only, full_kl.detach(), rtol=1e-5, atol=0)
    index_k_only = index_k.clone().requires_grad_()
    _, kl = openmsa.msa_attention(q, k, v, index_q, index_k_only, **options)
    torch.testing.assert_close(torch.autograd.grad(kl, index_k_only)[0], expected, rtol=1e-5,
                               atol=1e-7)


def test_kl_gradient_scales_with_the_weight_on_kl():
    """Loss scaling composes: the index gradients are exactly linear in the KL weight."""
    case = CASES[0]
    inputs, _ = random_inputs(case, torch.float32, "cpu", seed=12)
    out_grad = torch.zeros(*inputs[0].shape)
    options = dict(case.options, backend="triton")
    one, _ = run_with_grads(openmsa.msa_attention, inputs, None, out_grad, 1.0, **options)
    four, _ = run_with_grads(openmsa.msa_attention, inputs, None, out_grad, 4.0, **options)
    for name in ("dindex_q", "dindex_k"):
        torch.testing.assert_close(four[name], 4 * one[name], rtol=1e-6, atol=0)
    assert torch.count_nonzero(one["dq"]) == 0  # kl sends nothing to q, k, v

def test_kl_kernel_with_several_steps_per_segment():
    """8 pairs per step of the KL kernel: every segment takes several steps."""
    got, expected, _ = kernel_and_reference(CASES[1], torch.float32, seed=14,
                                            tuning=Tuning(kl_pairs=8))
    for name in ("kl", "dindex_q", "dindex_k"):
        assert rel_rms_error(got[name], expected[name]) < 1e-5, name


def _count_kl_routes(monkeypatch) -> list:
    """Which KL pass each forward or backward ran: "kl_passes" (``index_branch_kl``) or
    "teacher" (``kl_from_teacher``, the teachers the dK/dV pass stored)."""
    return count_calls(monkeypatch, pipeline_module, {"index_branch_kl": "kl_passes",
                                                      "kl_from_teacher": "teacher"})


TEACHER = Tuning(kl_teacher="from_dkdv")
RECOMPUTE = Tuning(kl_teacher="recompute")


def _teacher_bytes(case, dtype) -> int:
    """The size of the teachers ``case``'s dK/dV pass would store, from its shapes."""
    (q, k, *_), cu_seqlens = random_inputs(case, dtype, "cpu")
    ids_shape = (q.shape[0], case.num_index_heads, case.options["top_k"])
    return teacher_bytes(q, k, cu_seqlens, ids_shape, case.options["block_size"])


TEACHER_BYTES = _teacher_bytes(CASES[1], torch.float32)
# 16 heads per index head (KEY_OUTER_CASE in test_attention.py).
SIXTEEN_HEADS = MSACase("sixteen_heads_per_index_head_packed", seqlens=(200, 1, 130),
                        num_heads=16, num_kv_heads=1, num_index_heads=1,
                        options=dict(top_k=2, block_size=64))


@pytest.mark.parametrize("case,dtype,tuning", [
    (SIXTEEN_HEADS, torch.float32, TEACHER),
    (SIXTEEN_HEADS, torch.float16, TEACHER),
    (CASES[1], torch.float32, TEACHER),
    (CASES[2], torch.float32, TEACHER),
    (SCALED, torch.float32, TEACHER),
    (CASES[3], torch.float32, TEACHER),
    (CASES[1], torch.float32, Tuning(kl_teacher="from_dkdv", dq_pass="dkdv_atomic")),
    (SIXTEEN_HEADS, torch.float32, Tuning(kl_teacher="from_dkdv", main_walk_limit_per_slot=1.0,
                                          key_outer_partial_bytes=120 * 16 * 2 * 256)),
], ids=["gq16_fp32", "gq16_fp16", "packed_with_sink_fp32", "three_heads_fp32", "scaled_fp32",
        "block128_d128_fp32", "with_atomic_dq", "with_hard_rows_key_outer"])
def test_index_gradients_from_the_dkdv_teachers_match_reference(case, dtype, tuning,
                                                                monkeypatch):
    """``Tuning.kl_teacher = "from_dkdv"`` with ``kl_value=False``: the forward runs no KL,
    the backward's dK/dV kernels store each pair's teacher (new buffers poisoned: every one must
    be written) and the KL pass reads them; out, dq, dk, dv and the index gradients are the
    reference's, on the plain dK/dV kernel, with the atomic dQ, and with the hard rows'
    forward and dQ key-outer."""
    routes = _count_kl_routes(monkeypatch)
    poison_new_buffers(monkeypatch)
    got, expected, _ = kernel_and_reference(case, dtype, seed=4, tuning=tuning, kl_value=False)
    assert routes == ["teacher"], routes
    for name in QUANTITY_NAMES:
        error = rel_rms_error(got[name], expected[name])
        assert error < TOLERANCE[dtype], (name, error)


@pytest.mark.parametrize("options,frozen_main", [
    (dict(kl_value=True), False), (dict(kl_value=False, deterministic=True), False),
    (dict(kl_value=False), True)], ids=["value_wanted", "deterministic", "frozen_main_branch"])
def test_kl_teachers_from_dkdv_fall_back_to_the_kl_passes(options, frozen_main, monkeypatch):
    """Where the dK/dV pass cannot give the teachers (the value wanted in the forward,
    ``deterministic=True``, no main gradients so no dK/dV pass), the KL's own passes run, and
    the index gradients (and value) are the reference's."""
    routes = _count_kl_routes(monkeypatch)
    case = CASES[1]
    inputs, cu_seqlens = random_inputs(case, torch.float32, "cpu", seed=7)
    run = dict(case.options, cu_seqlens=cu_seqlens, return_indices=True, **options)
    ids = openmsa.msa_attention(*inputs, backend="triton", **run)[2]
    routes.clear()
    results = []
    for fn, extra in ((tuned_msa_attention(TEACHER), dict(backend="triton")),
                      (openmsa.msa_attention, dict(backend="reference", block_indices=ids))):
        leaves = [t.detach().clone().requires_grad_(not frozen_main or i >= 3)
                  for i, t in enumerate(inputs)]
        out, kl = fn(*[t.double() if extra["backend"] == "reference" else t for t in leaves],
                     **run, **extra)[:2]
        loss = out.double().square().sum() + kl.double()
        wanted = [t for t in leaves if t.requires_grad]
        results.append((kl.detach().double(), torch.autograd.grad(loss, wanted)))
    assert routes == ["kl_passes"], routes
    (kl, grads), (kl_expected, grads_expected) = results
    assert rel_rms_error(kl, kl_expected) < 1e-5
    for grad, grad_expected in zip(grads, grads_expected):
        assert rel_rms_error(grad.double(), grad_expected) < 1e-5


def test_kl_teacher_must_be_named():
    with pytest.raises(ValueError, match="kl_teacher: expected one of"):
        Tuning(kl_teacher="dkdv")
    for size in (-1, 1.5):
        with pytest.raises(ValueError, match="kl_teacher_max_bytes: expected an int"):
            Tuning(kl_teacher_max_bytes=size)


@pytest.mark.parametrize("tuning,route", [
    (None, "teacher"), (RECOMPUTE, "kl_passes"),
    (Tuning(kl_teacher_max_bytes=TEACHER_BYTES - 1), "kl_passes"),
    (Tuning(kl_teacher_max_bytes=TEACHER_BYTES), "teacher")],
    ids=["default", "recompute", "teachers_past_the_bound", "teachers_at_the_bound"])
def test_kl_teacher_route_by_option_and_size(tuning, route, monkeypatch):
    """Without the KL value the default takes the teachers from the dK/dV pass; "recompute",
    or teachers larger than ``kl_teacher_max_bytes``, run the KL passes; either way the
    gradients are the reference's."""
    routes = _count_kl_routes(monkeypatch)
    got, expected, _ = kernel_and_reference(CASES[1], torch.float32, seed=4, tuning=tuning,
                                            kl_value=False)
    assert routes == [route], routes
    for name in QUANTITY_NAMES:
        assert rel_rms_error(got[name], expected[name]) < TOLERANCE[torch.float32], name


def test_kl_teachers_from_dkdv_on_query_ranges_add_up_to_the_full_run():
    """Query ranges (context parallelism's building block) with the teachers from the dK/dV
    pass: each range's d index_q rows are the full run's, and the ranges' d index_k add up to
    the full run's (the KL's count of every token, as the ranks pass it)."""
    ranges = ((0, 120), (120, 286))
    full, parts = full_and_ranges(tuned_msa_attention(TEACHER), CASES[1], 9, ranges,
                                  kl_value=False)
    for (first, end), (part, _) in zip(ranges, parts):
        torch.testing.assert_close(part["dindex_q"][first:end], full["dindex_q"][first:end],
                                   rtol=1e-5, atol=1e-7)
    total = sum(part["dindex_k"] for part, _ in parts)
    assert rel_rms_error(total, full["dindex_k"]) < 1e-5


def test_kl_teachers_from_dkdv_in_warmup_match_the_kl_passes(monkeypatch):
    """Warmup on the sparse kernels (packed input: every causal block kept, the KL over the
    whole prefix) with the teachers from the dK/dV pass: the index gradients equal the KL
    passes' to fp32 rounding."""
    routes = _count_kl_routes(monkeypatch)
    case = CASES[1]
    inputs, cu_seqlens = random_inputs(case, torch.float32, "cpu", seed=11)
    out_grad = torch.randn(*inputs[0].shape, generator=torch.Generator().manual_seed(12))
    options = dict(case.options, warmup=True, kl_value=False, backend="triton")
    from_dkdv, _ = run_with_grads(tuned_msa_attention(TEACHER), inputs, cu_seqlens, out_grad,
                                  1.0, **options)
    passes, _ = run_with_grads(tuned_msa_attention(RECOMPUTE), inputs, cu_seqlens, out_grad,
                               1.0, **options)
    assert routes == ["teacher", "kl_passes"], routes
    for name in ("dindex_q", "dindex_k", "dq", "dk", "dv"):
        torch.testing.assert_close(from_dkdv[name], passes[name], rtol=1e-5, atol=1e-7,
                                   msg=name)
