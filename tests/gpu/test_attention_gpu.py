"""Sparse attention kernels in bf16 on the GPU against the fp32 reference (FlashAttention's rule:
error at most 2x the reference's own bf16 error), and bitwise determinism. Skipped without a GPU."""

import json
import os

import pytest
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from openmsa import msa_attention, select_blocks, sparse_attention
from openmsa.ops import sm90
from openmsa.ops.attention import (attention_delta, attention_dkdv, attention_dq,
                                   sparse_attention_fwd, sm90_backward)
from openmsa.ops.kl import kl_key_walk
from openmsa.ops.kl import sm90 as kl_sm90
from openmsa.ops.problem import LOG2_E, SparseAttentionProblem
from openmsa.ops.select import select_blocks_fwd
from openmsa.testing import (TOLERANCE, MSACase, compare_with_reference, random_inputs,
                             rel_rms_error, run_with_grads)

CASES = [
    MSACase("paper_groups", batch=1, seqlen=4096, num_heads=16, num_kv_heads=2,
            num_index_heads=4, head_dim=128, index_head_dim=128,
            options=dict(top_k=16, block_size=128)),
    MSACase("wide_group", batch=1, seqlen=2048, num_heads=64, num_kv_heads=4, num_index_heads=4,
            head_dim=128, index_head_dim=128, options=dict(top_k=8, block_size=128)),
    MSACase("packed_d64_block64", seqlens=(1000, 1, 2100, 640), num_heads=8, num_kv_heads=2,
            num_index_heads=2, options=dict(top_k=8, block_size=64, num_sink_blocks=1,
                                            num_local_blocks=2)),
    MSACase("batch2_gqa3", batch=2, seqlen=1500, num_heads=12, num_kv_heads=2,
            num_index_heads=4, num_index_kv_heads=2, head_dim=128,
            options=dict(top_k=4, block_size=128)),
    # Warmup: batch rows run the main attention on cuDNN, packed input on the Triton kernels.
    MSACase("warmup_batch2", batch=2, seqlen=1500, num_heads=16, num_kv_heads=2,
            num_index_heads=4, head_dim=128, index_head_dim=128,
            options=dict(block_size=128, warmup=True)),
    MSACase("warmup_packed", seqlens=(700, 1, 1300), num_heads=8, num_kv_heads=2,
            num_index_heads=2, head_dim=128, index_head_dim=128,
            options=dict(block_size=128, warmup=True)),
]
# The Gluon kernels against the Triton ones: the first four cases, and head dim 64 with blocks of
# 128 (the KL's d index_q then has one consumer warpgroup writing all its columns).
HOPPER_CASES = CASES[:4] + [
    MSACase("packed_d64_block128", seqlens=(900, 2100), num_heads=8, num_kv_heads=2,
            num_index_heads=2, options=dict(top_k=6, block_size=128)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_bf16_kernels_within_twice_the_reference_error(case):
    comparison = compare_with_reference(msa_attention, case, torch.bfloat16, "cuda")
    record = os.environ.get("OPENMSA_GPU_RECORD")
    if record:
        with open(record, "a") as f:
            f.write(json.dumps({"test": "attention_bf16", "case": case.name,
                                "errors": comparison.errors,
                                "reference_bf16_errors": comparison.baseline_errors}) + "\n")
    print(case.name, {n: f"{e:.2e}/{comparison.baseline_errors[n]:.2e}"
                      for n, e in comparison.errors.items()})
    assert comparison.passed(TOLERANCE[torch.bfloat16]), comparison.errors


def test_warmup_on_cudnn_matches_warmup_on_the_triton_kernels():
    """deterministic=True keeps warmup on the Triton kernels; both paths agree to bf16 noise."""
    case = CASES[4]
    inputs, _ = random_inputs(case, torch.bfloat16, "cuda", seed=5)
    out_grad = torch.randn(*inputs[0].shape, device="cuda")
    cudnn, _ = run_with_grads(msa_attention, inputs, None, out_grad, 1.0, **case.options)
    kernels, _ = run_with_grads(msa_attention, inputs, None, out_grad, 1.0, deterministic=True,
                                **case.options)
    for name, value in cudnn.items():
        assert rel_rms_error(value, kernels[name]) < 2e-2, name


def test_default_kl_path_agrees_with_the_deterministic_one():
    """The default KL (one key-outer pass, atomic adds) and deterministic=True's (a query-side
    walk more) compute the same sums in different orders."""
    case = CASES[0]
    inputs, _ = random_inputs(case, torch.bfloat16, "cuda", seed=4)
    out_grad = torch.randn(*inputs[0].shape, device="cuda")
    fast, _ = run_with_grads(msa_attention, inputs, None, out_grad, 1.0, **case.options)
    ordered, _ = run_with_grads(msa_attention, inputs, None, out_grad, 1.0, deterministic=True,
                                **case.options)
    for name in ("out", "dq", "dk", "dv"):
        assert torch.equal(fast[name], ordered[name]), name
    for name in ("kl", "dindex_q", "dindex_k"):
        assert rel_rms_error(fast[name], ordered[name]) < 1e-2, name


@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: c.name)
def test_bf16_gradients_are_bitwise_deterministic(case):
    """Run to run (wide_group's 16 heads per index head take the Gluon dK/dV on Hopper)."""
    inputs, _ = random_inputs(case, torch.bfloat16, "cuda", seed=3)
    out_grad = torch.randn(*inputs[0].shape, device="cuda")
    first, _ = run_with_grads(msa_attention, inputs, None, out_grad, 1.0, deterministic=True,
                              **case.options)
    second, _ = run_with_grads(msa_attention, inputs, None, out_grad, 1.0, deterministic=True,
                               **case.options)
    for name, value in first.items():
        assert torch.equal(value, second[name]), name


def _sparse_inputs(case, seed):
    """bf16 q, k, v of ``case``, the kept blocks selection gives for its index inputs, and
    cu_seqlens."""
    inputs, cu_seqlens = random_inputs(case, torch.bfloat16, "cuda", seed=seed)
    q, k, v, index_q, index_k = (t.detach() for t in inputs)
    options = {name: case.options[name] for name in ("top_k", "block_size", "num_sink_blocks",
                                                      "num_local_blocks") if name in case.options}
    ids = select_blocks(index_q, index_k, cu_seqlens=cu_seqlens, **options)
    return q, k, v, ids, cu_seqlens


@pytest.mark.parametrize("case", HOPPER_CASES, ids=lambda c: c.name)
def test_sparse_attention_bf16_within_twice_the_reference_error(case):
    """The decomposed API (its forward on the Hopper kernel where supported) against the fp32
    reference on the same kept blocks: out, dq, dk, dv."""
    q, k, v, ids, cu_seqlens = _sparse_inputs(case, seed=11)
    block_size = case.options["block_size"]
    out_grad = torch.randn_like(q)

    def run(dtype, backend):
        tensors = [t.detach().to(dtype).clone().requires_grad_() for t in (q, k, v)]
        out = sparse_attention(*tensors, ids, block_size=block_size, cu_seqlens=cu_seqlens,
                               backend=backend)
        (out.float() * out_grad.float()).sum().backward()
        return [out] + [t.grad for t in tensors]

    got = run(torch.bfloat16, "triton")
    expected = run(torch.float32, "reference")
    low = run(torch.bfloat16, "reference")
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), got, expected, low):
        error, baseline = rel_rms_error(a, b), rel_rms_error(c, b)
        assert error <= max(TOLERANCE[torch.bfloat16], 2 * baseline), (name, error, baseline)


def _hopper_inputs(case, query_range, seed=12):
    """Packed bf16 inputs of ``case`` (the queries a range of the packing starting inside a
    sequence with ``query_range``), cu_seqlens, the range's start, selection's ids and row
    maxima."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels are for Hopper GPUs")
    inputs, cu_seqlens = random_inputs(case, torch.bfloat16, "cuda", seed=seed)
    q, k, v, index_q, index_k = (t.detach().reshape(-1, *t.shape[-2:]) for t in inputs)
    total = q.shape[0]
    cu = cu_seqlens if cu_seqlens is not None else torch.arange(
        0, total + 1, case.seqlen, device="cuda", dtype=torch.int32)
    start, end = (total // 3 + 5, 2 * total // 3) if query_range else (0, total)
    q, index_q = q[start:end], index_q[start:end]
    options = case.options
    ids, index_max = select_blocks_fwd(
        index_q, index_k, cu, top_k=options["top_k"], block_size=options["block_size"],
        index_softmax_scale=q.shape[-1] ** -0.5,
        num_local_blocks=options.get("num_local_blocks", 1),
        num_sink_blocks=options.get("num_sink_blocks", 0), query_start=start, return_max=True)
    return q, k, v, index_q, index_k, cu, start, ids, index_max


@pytest.mark.parametrize("case", HOPPER_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("query_range", [False, True])
def test_hopper_kernels_equal_the_triton_kernels(case, query_range):
    """Same products in the same order: bitwise equal out, log-sum-exp and dq (also for a range
    of the queries, as context parallelism runs it); with the index branch (its log-sum-exp
    from the Triton kernel alone), equal out and lse and the same index log-sum-exp up to the
    order inside its product."""
    q, k, v, index_q, index_k, cu, start, ids, index_max = _hopper_inputs(case, query_range)
    options = case.options
    scale = q.shape[-1] ** -0.5
    problem = SparseAttentionProblem(q, k, ids, cu, options["block_size"], scale,
                                     query_start=start)
    assert sm90.supported(q, k, v, problem)
    out, lse, _ = sparse_attention_fwd(q, k, v, None, None, problem)
    triton_out, triton_lse, _ = sparse_attention_fwd(q, k, v, None, None, problem,
                                                     use_hopper=False)
    assert torch.equal(out, triton_out)
    assert torch.equal(lse, triton_lse)
    dout = torch.randn_like(q)
    delta = attention_delta(out, dout, problem)
    assert torch.equal(attention_dq(q, k, v, dout, lse, delta, problem),
                       attention_dq(q, k, v, dout, lse, delta, problem, use_hopper=False))

    with_index = SparseAttentionProblem(q, k, ids, cu, options["block_size"], scale, index_k,
                                        scale, query_start=start)
    both = sparse_attention_fwd(q, k, v, index_q, index_k, with_index, index_max=index_max)
    fused = sparse_attention_fwd(q, k, v, index_q, index_k, with_index, index_max=index_max,
                                 use_hopper=False)
    assert torch.equal(both[0], fused[0]) and torch.equal(both[1], fused[1])
    assert rel_rms_error(both[2], fused[2]) < 1e-6


@pytest.mark.parametrize("case", HOPPER_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("query_range", [False, True])
def test_hopper_dq_writes_the_deltas(case, query_range):
    """Given ``out``, the Gluon dQ computes every row's delta (sum_d dO * O) itself: it writes
    all of them (none of the NaNs it starts from is left), equal to ``attention_delta``'s up to
    fp32 summation order, and dq equals the one computed from ``attention_delta``'s deltas up to
    the 16-bit rounding of dS."""
    q, k, v, _, _, cu, start, ids, _ = _hopper_inputs(case, query_range, seed=17)
    problem = SparseAttentionProblem(q, k, ids, cu, case.options["block_size"],
                                     q.shape[-1] ** -0.5, query_start=start)
    out, lse, _ = sparse_attention_fwd(q, k, v, None, None, problem)
    dout = torch.randn_like(q)
    expected = attention_delta(out, dout, problem)
    delta = torch.full_like(expected, float("nan"))
    dq = sm90_backward.attention_dq(q, k, v, dout, lse, delta, problem, problem.scale * LOG2_E,
                             out=out)
    assert not delta.isnan().any()
    torch.testing.assert_close(delta, expected, rtol=1e-5, atol=1e-5)
    assert rel_rms_error(dq, attention_dq(q, k, v, dout, lse, expected, problem)) < 1e-3


@pytest.mark.parametrize("case", HOPPER_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("query_range", [False, True])
def test_hopper_dkdv_matches_the_triton_dkdv(case, query_range):
    """The Gluon dK/dV takes 32-row steps where the Triton kernel takes 64: the same sums in
    another order, so equal up to fp32 summation order before the 16-bit outputs."""
    q, k, v, _, _, cu, start, ids, _ = _hopper_inputs(case, query_range, seed=13)
    problem = SparseAttentionProblem(q, k, ids, cu, case.options["block_size"],
                                     q.shape[-1] ** -0.5, query_start=start)
    dout = torch.randn_like(q)
    assert sm90_backward.supported_key_outer(q, k, v, dout, problem)
    out, lse, _ = sparse_attention_fwd(q, k, v, None, None, problem)
    delta = attention_delta(out, dout, problem)
    dk, dv = attention_dkdv(q, k, v, dout, lse, delta, problem, use_hopper=True)
    triton_dk, triton_dv = attention_dkdv(q, k, v, dout, lse, delta, problem, use_hopper=False)
    assert rel_rms_error(dk, triton_dk) < 2e-3
    assert rel_rms_error(dv, triton_dv) < 2e-3


@pytest.mark.parametrize("case", HOPPER_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("query_range", [False, True])
@pytest.mark.parametrize("query_side,with_value", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("split_exponentials", [True, False], ids=["split_exp", "unit_exp"])
def test_hopper_kl_matches_the_triton_kl(case, query_range, query_side, with_value,
                                         split_exponentials, monkeypatch):
    """The Gluon KL kernel against the Triton one: the same sums (per step the heads in the
    same order), up to fp32 rounding, the order of the atomic adds and, with the exponentials
    split, the cubic's 1e-4 on every second head."""
    monkeypatch.setattr(kl_sm90, "SPLIT_EXPONENTIALS", split_exponentials)
    q, k, v, index_q, index_k, cu, start, ids, index_max = _hopper_inputs(case, query_range,
                                                                          seed=14)
    scale = q.shape[-1] ** -0.5
    problem = SparseAttentionProblem(q, k, ids, cu, case.options["block_size"], scale, index_k,
                                     scale, query_start=start)
    if not kl_sm90.supported_kl(q, k, index_q, index_k, problem):
        assert index_q.shape[-1] != q.shape[-1], "the kernel should take this case"
        pytest.skip("index head dim differs from the head dim")
    _, lse, lse_index = sparse_attention_fwd(q, k, v, index_q, index_k, problem,
                                             index_max=index_max)
    args = (q, k, index_q, index_k, lse, lse_index, problem, query_side, with_value)
    gluon, triton_kl = kl_key_walk(*args), kl_key_walk(*args, use_hopper=False)
    for name, value, expected in zip(("d_index_k", "kl_parts", "d_index_q"), gluon, triton_kl):
        if expected is None:
            assert value is None, name
        else:
            assert torch.isfinite(value).all(), name
            assert rel_rms_error(value, expected) < 1e-3, (name, rel_rms_error(value, expected))


@gluon.jit
def _exp2_fma_kernel(X, Y, BLOCK: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offsets = gl.program_id(0) * BLOCK + gl.arange(0, BLOCK, layout=layout)
    gl.store(Y + offsets, kl_sm90._exp2_fma(gl.load(X + offsets)))


def test_exp2_on_the_fma_units_within_its_cubics_error():
    """``kl.sm90._exp2_fma`` against torch.exp2 over [-140, 20]: relative error at most 1.1e-4
    where 2^x is a normal float, and below 2^-126 nothing above 2^-125 (never NaN)."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("Gluon kernels here need a Hopper GPU or newer")
    x = torch.linspace(-140.0, 20.0, 2**20, device="cuda")
    y = torch.empty_like(x)
    _exp2_fma_kernel[(x.numel() // 1024,)](x, y, BLOCK=1024, num_warps=4)
    expected = torch.exp2(x.double())
    normal = x >= -126
    assert torch.isfinite(y).all()
    relative = ((y.double() - expected) / expected)[normal].abs().max().item()
    assert relative < 1.1e-4, relative
    assert (y[~normal] >= 0).all() and (y[~normal] <= 2.0**-125).all()
