"""The public functions with odd but legal input, on every CPU backend: non-contiguous tensors,
frozen branches, given block ids returned, a KL that rounding would push below zero, numpy
scales, float64 on the reference path. The kernels run under the CPU interpreter."""

import numpy as np
import pytest
import torch

import openmsa
from openmsa.ops import msa as msa_module
from openmsa.testing import INPUT_NAMES, MSACase, random_inputs, run_with_grads

needs_interpreter = pytest.mark.skipif(
    not msa_module.INTERPRETING, reason="needs TRITON_INTERPRET=1 (the README's test command)")
BACKENDS = [pytest.param("triton", marks=needs_interpreter), "reference"]

PACKED = MSACase("packed", seqlens=(30, 40), num_heads=4, num_kv_heads=2, num_index_heads=2,
                 options=dict(top_k=1, block_size=64))
BATCH = MSACase("batch", batch=2, seqlen=150, num_heads=4, num_kv_heads=2, num_index_heads=2,
                options=dict(top_k=2, block_size=64))


def _strided_offsets():
    """cu_seqlens [0, 30, 70] as every other entry of a longer tensor (stride 2)."""
    strided = torch.tensor([0, 99, 30, 99, 70, 99], dtype=torch.int32)[::2]
    assert not strided.is_contiguous()
    return strided


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_cu_seqlens_reads_its_values(backend):
    """The kernels read cu_seqlens through a raw pointer: a strided tensor must give what its
    values give (it gave block ids like 1120552127 and NaN outputs)."""
    inputs, cu_seqlens = random_inputs(PACKED, torch.float32, "cpu", seed=1)
    strided = _strided_offsets()
    assert torch.equal(strided, cu_seqlens)
    out_grad = torch.randn(70, 4, 64, generator=torch.Generator().manual_seed(2))
    options = dict(PACKED.options, backend=backend, return_indices=True)
    expected, expected_ids = run_with_grads(openmsa.msa_attention, inputs, cu_seqlens,
                                            out_grad, 1.0, **options)
    got, ids = run_with_grads(openmsa.msa_attention, inputs, strided, out_grad, 1.0, **options)
    assert torch.equal(ids, expected_ids)
    for name, value in got.items():
        assert torch.equal(value, expected[name]), name
    index_q, index_k = (t.detach() for t in inputs[3:])
    selected = openmsa.select_blocks(index_q, index_k, top_k=1, block_size=64,
                                     cu_seqlens=strided, backend=backend)
    assert torch.equal(selected, expected_ids)
    q, k, v = (t.detach() for t in inputs[:3])
    out = openmsa.sparse_attention(q, k, v, ids, block_size=64, cu_seqlens=strided,
                                   backend=backend)
    assert torch.equal(out, expected["out"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_tensors_give_the_contiguous_results(backend):
    """Inputs sliced out of wider tensors, given block ids as a transposed view, and the
    stride-0 output gradient of ``out.sum()``: each as their contiguous copies."""
    inputs, _ = random_inputs(BATCH, torch.float32, "cpu", seed=3)
    options = dict(BATCH.options, backend=backend)
    ids = openmsa.select_blocks(*(t.detach() for t in inputs[3:]), top_k=2, block_size=64,
                                backend=backend)
    strided_ids = ids.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert not strided_ids.is_contiguous() and torch.equal(strided_ids, ids)

    def run(tensors, block_ids):
        tensors = [t.detach().requires_grad_() for t in tensors]
        out, kl = openmsa.msa_attention(*tensors, block_indices=block_ids, **options)
        (out.sum() + kl).backward()  # out.sum(): a stride-0 gradient reaches the kernels
        return [out.detach(), kl.detach()] + [t.grad for t in tensors]

    expected = run([t.detach().clone() for t in inputs], ids)
    # Every tensor a slice of a wider one (head dim and heads not the innermost storage).
    wide = [torch.cat([t.detach(), torch.randn_like(t)], dim=-2)[..., :t.shape[-2], :]
            for t in inputs]
    assert not any(t.is_contiguous() for t in wide)
    for got, want in zip(run(wide, strided_ids), expected):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


REQUIRES_GRAD = {"main": (True, True, True, False, False),
                 "index": (False, False, False, True, True),
                 "index_k_and_v": (False, False, True, False, True),
                 "nothing": (False,) * 5}


@pytest.mark.parametrize("pattern", REQUIRES_GRAD)
@pytest.mark.parametrize("backend", BACKENDS)
def test_frozen_branches_get_no_gradient_and_the_rest_the_full_one(backend, pattern):
    """Frozen index projections (or a layer reusing another's selection), a frozen main
    branch, or nothing requiring grad: the backward runs, tensors that need no gradient get
    none, and the others get exactly what they get when everything requires grad."""
    inputs, cu_seqlens = random_inputs(PACKED, torch.float32, "cpu", seed=4)
    out_grad = torch.randn(70, 4, 64, generator=torch.Generator().manual_seed(5))
    options = dict(PACKED.options, backend=backend, cu_seqlens=cu_seqlens)
    full, _ = run_with_grads(openmsa.msa_attention, inputs, cu_seqlens, out_grad, 1.0,
                             **PACKED.options, backend=backend)
    tensors = [t.detach().clone().requires_grad_(flag)
               for t, flag in zip(inputs, REQUIRES_GRAD[pattern])]
    out, kl = openmsa.msa_attention(*tensors, **options)
    torch.testing.assert_close(out, full["out"], rtol=0, atol=0)
    if pattern == "nothing":
        assert not out.requires_grad and not kl.requires_grad
        return
    ((out * out_grad).sum() + kl).backward()
    for name, tensor, flag in zip(INPUT_NAMES, tensors, REQUIRES_GRAD[pattern]):
        if flag:
            torch.testing.assert_close(tensor.grad, full[f"d{name}"], rtol=1e-6, atol=1e-8,
                                       msg=name)
        else:
            assert tensor.grad is None, name


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("backend", BACKENDS)
def test_given_block_indices_come_back_as_a_new_int32_tensor(backend, dtype):
    inputs, _ = random_inputs(BATCH, torch.float32, "cpu", seed=6)
    tensors = [t.detach() for t in inputs]
    ids = openmsa.select_blocks(*tensors[3:], top_k=2, block_size=64, backend=backend).to(dtype)
    given = ids.clone()
    _, _, returned = openmsa.msa_attention(*tensors, **BATCH.options, backend=backend,
                                           block_indices=given, return_indices=True)
    assert returned is not given and returned.dtype == torch.int32
    assert returned.shape == given.shape and torch.equal(returned.long(), ids.long())
    returned.fill_(-5)  # the caller's tensor is not behind the returned one
    assert torch.equal(given, ids)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_kl_is_never_negative_and_its_gradient_unchanged(backend, deterministic):
    """Index branch = main branch (one main head per index head, equal scales): teacher and
    student agree and the exact KL is 0; rounding gave about -1e-8. The value is clamped at 0,
    the gradient is the KL's own (that of the kl_value=False carrier)."""
    generator = torch.Generator().manual_seed(2)  # a seed whose rounding went below 0
    q, k, v = (torch.randn(1, 200, 2, 64, generator=generator) for _ in range(3))
    options = dict(top_k=2, block_size=64, backend=backend, deterministic=deterministic)

    def kl_and_grads(kl_value):
        iq, ik = q.clone().requires_grad_(), k.clone().requires_grad_()
        _, kl = openmsa.msa_attention(q, k, v, iq, ik, kl_value=kl_value, **options)
        return kl, torch.autograd.grad(kl, (iq, ik))

    kl, grads = kl_and_grads(True)
    carrier, carrier_grads = kl_and_grads(False)
    assert kl.item() == 0.0 and carrier.item() == 0.0
    for got, expected in zip(grads, carrier_grads):
        assert got.abs().max() > 0
        assert torch.equal(got, expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kl_value_false_gives_a_zero_carrier_with_the_kl_gradient(backend):
    inputs, cu_seqlens = random_inputs(PACKED, torch.float32, "cpu", seed=10)
    out_grad = torch.randn(70, 4, 64, generator=torch.Generator().manual_seed(11))
    options = dict(PACKED.options, backend=backend)
    exact, _ = run_with_grads(openmsa.msa_attention, inputs, cu_seqlens, out_grad, 2.5,
                              **options)
    carrier, _ = run_with_grads(openmsa.msa_attention, inputs, cu_seqlens, out_grad, 2.5,
                                kl_value=False, **options)
    assert exact["kl"].item() > 0 and carrier["kl"].item() == 0.0
    for name in ("dq", "dk", "dv", "dindex_q", "dindex_k"):
        assert carrier[name].abs().max() > 0, name
    for name in ("dq", "dk", "dv"):
        torch.testing.assert_close(carrier[name], exact[name], rtol=1e-6, atol=0, msg=name)
    # The kernels' index gradients without the value come from the teachers the dK/dV pass
    # stores (Tuning.kl_teacher): other sums in another order, so fp32 rounding apart.
    index_tolerance = dict(rtol=1e-4, atol=1e-7) if backend != "reference" else dict(
        rtol=1e-6, atol=0)
    for name in ("dindex_q", "dindex_k"):
        torch.testing.assert_close(carrier[name], exact[name], **index_tolerance, msg=name)


@pytest.mark.parametrize("scale", [np.float32(0.3), np.float64(0.3), np.int64(1)],
                         ids=["numpy_float32", "numpy_float64", "numpy_int64"])
def test_numpy_scalars_are_accepted_as_scales(scale):
    inputs, _ = random_inputs(BATCH, torch.float32, "cpu", seed=7)
    tensors = [t.detach() for t in inputs]
    options = dict(BATCH.options, backend="reference")
    got = openmsa.msa_attention(*tensors, softmax_scale=scale, index_softmax_scale=scale,
                                **options)
    expected = openmsa.msa_attention(*tensors, softmax_scale=float(scale),
                                     index_softmax_scale=float(scale), **options)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    ids = openmsa.select_blocks(*tensors[3:], top_k=2, block_size=64,
                                index_softmax_scale=scale)
    assert ids.shape == (2, 2, 150, 2)


@pytest.mark.parametrize("entry", ["msa_attention", "naive_msa_attention"])
def test_float64_runs_on_the_reference_path_for_gradcheck(entry):
    """float64 is what torch.autograd.gradcheck takes: ``backend="auto"`` on CPU tensors runs
    the reference, which accepts it. (``kl`` is float32 by contract, too coarse for finite
    differences: the check covers ``out``, which keeps the inputs' dtype.)"""
    generator = torch.Generator().manual_seed(8)
    shapes = ((2, 64), (1, 64), (1, 64), (1, 64), (1, 64))
    q, k, v, index_q, index_k = (torch.randn(1, 70, *shape, generator=generator,
                                             dtype=torch.float64) for shape in shapes)
    function = getattr(openmsa, entry)

    def out_of(q, k, v):
        out, _ = function(q, k, v, index_q, index_k, top_k=1, block_size=64, softmax_scale=0.5)
        return out

    main = [t.requires_grad_() for t in (q, k, v)]
    assert torch.autograd.gradcheck(out_of, main, eps=1e-6, atol=1e-5, fast_mode=True)
    ids = openmsa.select_blocks(index_q, index_k, top_k=1, block_size=64)
    assert ids.shape == (1, 1, 70, 1)


@needs_interpreter
def test_float64_is_refused_by_the_kernels_naming_the_reference():
    inputs, _ = random_inputs(BATCH, torch.float64, "cpu", seed=9)
    with pytest.raises(ValueError, match=r"^q: expected dtype in \(.*\) for backend='triton' "
                       r"on cpu tensors \(the Triton kernels; float64 runs on "
                       r"backend='reference'\), received torch\.float64$"):
        openmsa.msa_attention(*inputs, **BATCH.options, backend="triton")


def test_the_interpreter_check_says_what_to_install():
    """Triton 3.6's interpreter fails with numpy 2.4 deep inside a kernel; the library says
    what to install instead. Stand-in: a probe kernel that fails as it does."""
    from openmsa.ops import interpreter

    class FailingProbe:
        def __getitem__(self, grid):
            def launch(*args):
                raise RuntimeError("TypeError('only 0-dimensional arrays can be converted to "
                                   "Python scalars')")
            return launch

    with pytest.raises(RuntimeError, match=r"CPU interpreter cannot run openmsa's kernels with "
                       r"numpy .* install 'numpy<2.4'"):
        interpreter.probe_loaded_loop_bounds(FailingProbe())


@needs_interpreter
def test_the_interpreter_runs_loops_to_loaded_bounds_here():
    """The probe itself passes with this machine's numpy (the suite runs the kernels)."""
    from openmsa.ops import interpreter

    interpreter.probe_loaded_loop_bounds()


def test_documented_installs_pin_a_numpy_the_interpreter_runs_with():
    """Both README installs ('.[train]' for the main job, '.[test]' for the tests) allow the
    documented Triton-on-CPU path, which needs numpy < 2.4 with Triton 3.6."""
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    extras = project["project"]["optional-dependencies"]
    for extra in ("train", "test"):
        assert "numpy<2.4" in extras[extra], extra

