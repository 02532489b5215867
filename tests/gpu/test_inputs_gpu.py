"""The public functions with odd but legal input on the GPU (the CPU versions are in
tests/test_api.py): non-contiguous offsets and ids, frozen branches (eager and compiled), given
ids returned as a new tensor, a KL that rounding would push below 0, float64 refused by the
kernels. Skipped without a GPU."""

import pytest
import torch

import openmsa
from openmsa.testing import INPUT_NAMES


def inputs(seqlens=(700, 1500, 333), heads=(16, 2, 2, 4, 1), seed=0):
    """Packed bf16 inputs requiring grad, and their int32 cu_seqlens."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(seqlens)
    tensors = [torch.randn(total, h, 128, device="cuda", generator=generator).bfloat16()
               .requires_grad_() for h in heads]
    offsets = torch.tensor([0, *seqlens], device="cuda").cumsum(0).to(torch.int32)
    return tensors, offsets


OPTIONS = dict(top_k=4, block_size=128)


def run(tensors, cu_seqlens, out_grad, **options):
    tensors = [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]
    out, kl, ids = openmsa.msa_attention(*tensors, cu_seqlens=cu_seqlens, return_indices=True,
                                         **OPTIONS, **options)
    if out.requires_grad or kl.requires_grad:
        ((out.float() * out_grad).sum() + kl).backward()
    return [out.detach(), kl.detach(), ids] + [t.grad for t in tensors]


def test_non_contiguous_cu_seqlens_and_block_indices_read_their_values():
    tensors, cu_seqlens = inputs()
    out_grad = torch.randn(tensors[0].shape, device="cuda")
    expected = run(tensors, cu_seqlens, out_grad, deterministic=True)
    wide = torch.stack([cu_seqlens, torch.full_like(cu_seqlens, 99)], -1)
    strided = wide[:, 0]
    assert not strided.is_contiguous() and torch.equal(strided, cu_seqlens)
    got = run(tensors, strided, out_grad, deterministic=True)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    ids = expected[2]  # [Hi, T, top_k]
    strided_ids = ids.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert not strided_ids.is_contiguous()
    given = run(tensors, strided, out_grad, block_indices=strided_ids, deterministic=True)
    reference = run(tensors, cu_seqlens, out_grad, block_indices=ids.contiguous(),
                    deterministic=True)
    for a, b in zip(given, reference):
        assert torch.equal(a, b)


PATTERNS = {"main": (True, True, True, False, False), "index": (False, False, False, True, True),
            "nothing": (False,) * 5}
# sparse and warmup on the Triton kernels (packed, deterministic: bitwise comparisons), and
# warmup's dense main attention on cuDNN (batch input, not deterministic).
MODES = {"sparse": dict(top_k=4, deterministic=True),
         "warmup_triton": dict(warmup=True, deterministic=True),
         "warmup_cudnn": dict(warmup=True)}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_frozen_branches_get_no_gradient_and_the_rest_the_full_one(pattern, mode):
    if mode == "warmup_cudnn":
        generator = torch.Generator(device="cuda").manual_seed(1)
        tensors = [torch.randn(2, 1024, h, 128, device="cuda", generator=generator).bfloat16()
                   for h in (16, 2, 2, 4, 1)]
        cu_seqlens = None
    else:
        tensors, cu_seqlens = inputs(seed=1)
    out_grad = torch.randn(tensors[0].shape, device="cuda")
    options = dict(MODES[mode], block_size=128, cu_seqlens=cu_seqlens)
    full = _gradients(tensors, out_grad, (True,) * 5, options)
    got = _gradients(tensors, out_grad, PATTERNS[pattern], options)
    for name, flag, a, b in zip(INPUT_NAMES, PATTERNS[pattern], got, full):
        if not flag:
            assert a is None, name
        elif options.get("deterministic"):
            assert torch.equal(a, b), name
        else:
            assert (a.float() - b.float()).norm() <= 1e-2 * b.float().norm(), name


def _gradients(tensors, out_grad, flags, options):
    tensors = [t.detach().clone().requires_grad_(flag) for t, flag in zip(tensors, flags)]
    out, kl = openmsa.msa_attention(*tensors, **options)
    if any(flags):
        ((out.float() * out_grad).sum() + kl).backward()
    else:
        assert not out.requires_grad and not kl.requires_grad
    return [t.grad for t in tensors]


@pytest.mark.parametrize("frozen", ["index", "main"])
def test_layer_with_a_frozen_branch_compiles_on_inductor(frozen):
    torch.manual_seed(0)
    layer = openmsa.MSAAttention(512, num_heads=8, num_kv_heads=2, head_dim=128,
                                 num_index_heads=4, top_k=4, block_size=128,
                                 deterministic=True).cuda().bfloat16()
    for name, parameter in layer.named_parameters():
        parameter.requires_grad_(("index_" in name) != (frozen == "index"))
    trainable = [p for p in layer.parameters() if p.requires_grad]
    x = torch.randn(2, 1024, 512, device="cuda", dtype=torch.bfloat16)

    def gradients(module):
        hidden, kl = module(x)
        return torch.autograd.grad(hidden.float().square().mean() + kl, trainable)

    eager = gradients(layer)
    compiled = gradients(torch.compile(layer, fullgraph=True))
    for got, expected in zip(compiled, eager):
        assert expected.float().abs().max() > 0
        assert (got.float() - expected.float()).norm() <= 2e-2 * expected.float().norm()


def test_given_block_indices_come_back_as_a_new_int32_tensor():
    tensors, cu_seqlens = inputs(seed=2)
    tensors = [t.detach() for t in tensors]
    ids = openmsa.select_blocks(*tensors[3:], cu_seqlens=cu_seqlens, **OPTIONS).long()
    given = ids.clone()
    _, _, returned = openmsa.msa_attention(*tensors, cu_seqlens=cu_seqlens, block_indices=given,
                                           return_indices=True, **OPTIONS)
    assert returned is not given and returned.dtype == torch.int32
    assert torch.equal(returned.long(), ids)
    returned.fill_(-5)
    assert torch.equal(given, ids)


@pytest.mark.parametrize("deterministic", [False, True])
def test_kl_is_never_negative_and_its_gradient_unchanged(deterministic):
    """Index branch = main branch (one main head per index head): the exact KL is 0, rounding
    scatters it around 0; the value is clamped at 0 and the gradient is the carrier's."""
    for seed in range(4):
        generator = torch.Generator(device="cuda").manual_seed(seed)
        q, k, v = (torch.randn(1, 2048, 4, 128, device="cuda", generator=generator).bfloat16()
                   for _ in range(3))
        results = []
        for kl_value in (True, False):
            index_q, index_k = q.clone().requires_grad_(), k.clone().requires_grad_()
            _, kl = openmsa.msa_attention(q, k, v, index_q, index_k, top_k=4, block_size=128,
                                          deterministic=deterministic, kl_value=kl_value)
            results.append((kl, torch.autograd.grad(kl, (index_q, index_k))))
        (kl, grads), (carrier, carrier_grads) = results
        assert kl.item() >= 0.0 and carrier.item() == 0.0
        assert kl.item() < 1e-5  # the two branches agree
        for got, expected in zip(grads, carrier_grads):
            if deterministic:
                assert torch.equal(got, expected)
            else:  # atomic adds in any order
                torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-6)


def test_float64_on_the_gpu_is_refused_by_the_kernels_naming_the_reference():
    tensors = [torch.randn(1, 256, h, 128, device="cuda", dtype=torch.float64)
               for h in (4, 2, 2, 2, 1)]
    with pytest.raises(ValueError, match=r"^q: expected dtype in \(.*\) for backend='auto' on "
                       r"cuda tensors \(the Triton kernels; float64 runs on "
                       r"backend='reference'\), received torch\.float64$"):
        openmsa.msa_attention(*tensors, top_k=2, block_size=128)
    out, kl = openmsa.msa_attention(*tensors, top_k=2, block_size=128, backend="reference")
    assert out.dtype == torch.float64 and torch.isfinite(kl)


def test_inputs_are_not_modified_in_place():
    tensors, cu_seqlens = inputs(seed=3)
    strided = torch.stack([cu_seqlens, cu_seqlens], -1)[:, 0]
    watched = [t.detach() for t in tensors] + [strided]
    before = [t.clone() for t in watched]
    versions = [t._version for t in watched]
    run(tensors, strided, torch.randn(tensors[0].shape, device="cuda"))
    for name, tensor, copy, version in zip(INPUT_NAMES + ("cu_seqlens",), watched, before,
                                           versions):
        assert tensor._version == version and torch.equal(tensor, copy), name
