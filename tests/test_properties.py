"""Property-based tests (hypothesis): the Triton kernels against the reference on random shapes,
head mappings, block sizes, top_k, forced blocks and packed lengths (CPU interpreter, fp32)."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import openmsa
from openmsa.ops import msa as msa_module
from openmsa.testing import QUANTITY_NAMES, rel_rms_error, run_with_grads

pytestmark = pytest.mark.skipif(not msa_module.INTERPRETING,
                                reason="needs TRITON_INTERPRET=1 (the README's test command)")

# (H, Hkv, Hi, Hik): every SPEC head-mapping rule, including GQ = H / Hi not a power of two.
HEAD_MAPPINGS = [(1, 1, 1, 1), (4, 2, 2, 1), (4, 1, 4, 2), (6, 2, 2, 2), (8, 2, 4, 4),
                 (6, 3, 3, 1), (4, 4, 4, 1)]


@st.composite
def problems(draw):
    heads = draw(st.sampled_from(HEAD_MAPPINGS))
    top_k = draw(st.integers(1, 4))
    num_local = draw(st.integers(1, min(2, top_k)))
    num_sink = draw(st.integers(0, min(1, top_k - num_local)))
    packed = draw(st.booleans())
    if packed:
        seqlens = draw(st.lists(st.integers(1, 170), min_size=1, max_size=3))
        shape = (sum(seqlens),)
    else:
        seqlens = None
        shape = (draw(st.integers(1, 2)), draw(st.integers(1, 170)))
    options = dict(top_k=top_k, block_size=draw(st.sampled_from([64, 128])),
                   num_local_blocks=num_local,
                   num_sink_blocks=num_sink, warmup=draw(st.booleans()))
    return heads, shape, seqlens, options, draw(st.integers(0, 2**16))


def _inputs(heads, shape, seed, integer=False):
    generator = torch.Generator().manual_seed(seed)
    dims = [(heads[0], 64), (heads[1], 64), (heads[1], 64), (heads[2], 64), (heads[3], 64)]
    if integer:  # exact scores in any summation order: selection must match exactly
        return [torch.randint(-2, 3, (*shape, h, d), generator=generator).float()
                for h, d in dims]
    return [torch.randn(*shape, h, d, generator=generator) for h, d in dims]


def _offsets(seqlens):
    if seqlens is None:
        return None
    return torch.tensor([0, *seqlens], dtype=torch.int64).cumsum(0).to(torch.int32)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_kernels_match_the_reference(problem):
    heads, shape, seqlens, options, seed = problem
    inputs = _inputs(heads, shape, seed)
    cu_seqlens = _offsets(seqlens)
    out_grad = torch.randn(*shape, heads[0], 64, generator=torch.Generator().manual_seed(seed))
    sparse = not options["warmup"]
    got, ids = run_with_grads(openmsa.msa_attention, inputs, cu_seqlens, out_grad, 1.5,
                              backend="triton", return_indices=sparse, **options)
    given = dict(block_indices=ids, return_indices=True) if sparse else {}
    expected, _ = run_with_grads(openmsa.msa_attention, [t.double() for t in inputs],
                                 cu_seqlens, out_grad, 1.5, backend="reference", **given,
                                 **options)
    for name in QUANTITY_NAMES:
        assert rel_rms_error(got[name], expected[name]) < 2e-5, name


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_kernel_selection_equals_the_reference_on_exact_scores(problem):
    heads, shape, seqlens, options, seed = problem
    _, _, _, index_q, index_k = _inputs(heads, shape, seed, integer=True)
    options = dict(options, index_softmax_scale=1.0)
    options.pop("warmup")
    kernel = openmsa.select_blocks(index_q, index_k, cu_seqlens=_offsets(seqlens),
                                   backend="triton", **options)
    reference = openmsa.select_blocks(index_q, index_k, cu_seqlens=_offsets(seqlens),
                                      backend="reference", **options)
    assert torch.equal(kernel.sort(-1).values, reference.sort(-1).values)


def _valid_offsets(offsets, total):
    return (len(offsets) >= 2 and offsets[0] == 0 and offsets[-1] == total
            and all(a <= b for a, b in zip(offsets, offsets[1:])))


# Each corruption with the argument its error must name: the corrupted one (a wrong top_k
# could also break num_local_blocks + num_sink_blocks <= top_k, but top_k's range is checked
# first).
CORRUPTIONS = [
    ("top_k", "top_k", st.integers(-5, 0) | st.integers(65, 1000)),
    ("block_size", "block_size", st.integers(-5, 300).filter(lambda b: b not in (64, 128))),
    ("num_local_blocks", "num_local_blocks", st.integers(-5, 0)),
    ("num_sink_blocks", "num_sink_blocks", st.integers(-9, -1)),
    ("softmax_scale", "softmax_scale", st.sampled_from([float("inf"), float("-inf"),
                                                        float("nan")])),
    ("index_softmax_scale", "index_softmax_scale", st.sampled_from(["0.1", [0.1], 1j])),
    ("q", "q", st.integers(1, 3).map(lambda n: torch.randn(1, 70, 4, 64)[..., :64 - n])),
    # KV heads that do not divide q's 4 (4 would, and then v's 2 would not match k's).
    ("k", "k", st.sampled_from([3, 5, 6]).map(lambda n: torch.randn(1, 70, n, 64))),
    ("v", "v", st.integers(1, 3).map(lambda n: torch.randn(1, 70 + n, 2, 64))),
    ("index_q", "index_q", st.integers(1, 3).map(lambda n: torch.randn(1, 70, 2 * n + 1, 64))),
    ("index_k", "index_k", st.sampled_from([3, 4]).map(lambda n: torch.randn(1, 70, n, 64))),
    ("cu_seqlens", "cu_seqlens", st.lists(st.integers(-3, 80), min_size=1, max_size=4).filter(
        lambda xs: not _valid_offsets(xs, 70)).map(
        lambda xs: torch.tensor(xs, dtype=torch.int32))),
    ("kl_value", "kl_value", st.sampled_from([0, 1, "no", None])),
    ("deterministic", "deterministic", st.sampled_from([0, 1, "no", None])),
    ("tuning", "tuning", st.sampled_from(["fast", "Default", 3, {"dq_pass": "walk"}])),
]


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_malformed_input_raises_an_error_naming_the_corrupted_argument(data):
    """Random corruptions of one argument of a valid call raise TypeError / ValueError whose
    message starts with that argument's name."""
    q, k, v, index_q, index_k = _inputs((4, 2, 2, 1), (1, 70), 0)
    call = dict(q=q, k=k, v=v, index_q=index_q, index_k=index_k)
    kwargs = dict(top_k=2, block_size=64)
    name, named, values = data.draw(st.sampled_from(CORRUPTIONS))
    value = data.draw(values)
    if name in call:
        call[name] = value
    else:
        kwargs[name] = value
    if name == "cu_seqlens":
        call = {key: t[0] for key, t in call.items()}  # packed [T, heads, dim]
    with pytest.raises((TypeError, ValueError)) as raised:
        openmsa.msa_attention(*call.values(), **kwargs)
    assert str(raised.value).split(":")[0] == named, str(raised.value)
