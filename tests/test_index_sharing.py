"""Index sharing across layers (SPEC section 9): a layer without an index branch attends over
the blocks an earlier layer kept. Reference backend in float64 (any machine), and the Triton
kernels under the CPU interpreter where marked."""

import pytest
import torch

import openmsa
from openmsa.layers import MSAAttention, set_msa_warmup
from openmsa.ops import msa as msa_module
from openmsa.testing import rel_rms_error

interpreted = pytest.mark.skipif(not msa_module.INTERPRETING,
                                 reason="needs TRITON_INTERPRET=1 (the README's test command)")
OPTIONS = dict(top_k=2, block_size=64)


def _stack(backend="reference", dtype=torch.float64, every=2, layers=3, share_index_kl=False,
           **options):
    """``layers`` layers, 0, every, 2 every, ... with an index branch, the others sharing
    (with ``share_index_kl``, teaching the index branch they read)."""
    torch.manual_seed(0)
    stack = []
    for layer in range(layers):
        source = None if layer % every == 0 else stack[layer - layer % every]
        stack.append(MSAAttention(96, num_heads=4, num_kv_heads=2, head_dim=64,
                                  num_index_heads=2, backend=backend, share_index_from=source,
                                  share_index_kl=share_index_kl and source is not None,
                                  **dict(OPTIONS, **options)))
    return [layer.to(dtype) for layer in stack]


def _run(stack, x, **call):
    """The layers chained (each input the previous output): hidden, KLs, each layer's ids."""
    kls, ids = [], []
    for layer in stack:
        x, kl, layer_ids = layer(x, return_indices=True, **call)
        kls.append(kl)
        ids.append(layer_ids)
    return x, kls, ids


def test_sharing_layers_have_no_index_branch_and_validate_their_source():
    indexer, sharer, third = _stack(layers=3, every=3)
    assert indexer.has_index_branch and not sharer.has_index_branch
    names = [name for name, _ in sharer.named_parameters()]
    assert names and not [name for name in names if "index" in name]
    assert [name for name, _ in indexer.named_parameters() if "index" in name]
    # A layer sharing a sharer reads the selection's origin, which is not its submodule.
    chained = MSAAttention(96, 4, 2, 64, num_index_heads=2, share_index_from=sharer, **OPTIONS)
    assert chained._index_source[0] is indexer and third._index_source[0] is indexer
    assert not [m for m in chained.modules() if isinstance(m, MSAAttention) and m is not chained]
    assert "index_q_proj.weight" not in sharer.state_dict()
    with pytest.raises(ValueError, match="^share_index_from: expected a layer with this "
                                         r"layer's \(H, Hkv, Hi, block_size\)"):
        MSAAttention(96, 4, 2, 64, num_index_heads=4, share_index_from=indexer, **OPTIONS)
    with pytest.raises(ValueError, match="^share_index_from: .*block_size"):
        MSAAttention(96, 4, 2, 64, num_index_heads=2, top_k=2, block_size=128,
                     share_index_from=indexer)
    with pytest.raises(TypeError, match="^share_index_from: expected an MSAAttention"):
        MSAAttention(96, 4, 2, 64, share_index_from=torch.nn.Linear(2, 2))
    fresh = _stack(layers=2)[1]
    with pytest.raises(ValueError, match="^block_indices: expected the kept ids"):
        fresh(torch.randn(1, 130, 96, dtype=torch.float64))


@pytest.mark.parametrize("packed", [False, True])
def test_shared_stack_equals_the_explicit_composition(packed):
    """A stack equals: the indexer's msa_attention, then each sharing layer's projections,
    sparse_attention over the indexer's ids and o_proj; sharing layers' KL is 0."""
    stack = _stack(layers=3, every=3)
    call = {}
    if packed:
        x = torch.randn(330, 96, dtype=torch.float64)
        call = dict(cu_seqlens=torch.tensor([0, 130, 131, 330], dtype=torch.int32))
    else:
        x = torch.randn(2, 200, 96, dtype=torch.float64)
    hidden, kls, ids = _run(stack, x, **call)
    lead = x.shape[:-1]
    positions = stack[0]._default_positions(lead, call.get("cu_seqlens"), x.device)
    expected, expected_kl, expected_ids = stack[0](x, return_indices=True, **call)
    for layer in stack[1:]:
        q, k, v, index_q, index_k = layer.projections(expected, positions)
        assert index_q is None and index_k is None
        out = openmsa.sparse_attention(q, k, v, expected_ids, block_size=64,
                                       backend="reference", **call)
        expected = layer.o_proj(out.reshape(*lead, -1))
    torch.testing.assert_close(hidden, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(kls[0], expected_kl)
    assert all(kl == 0 and not kl.requires_grad for kl in kls[1:])
    assert all(torch.equal(layer_ids, ids[0]) for layer_ids in ids[1:])
    # The main attention over given ids is msa_attention's over the same ids.
    q, k, v, index_q, index_k = stack[0].projections(x, positions)
    out, _ = openmsa.msa_attention(q, k, v, index_q, index_k, block_indices=ids[0],
                                   backend="reference", **OPTIONS, **call)
    torch.testing.assert_close(openmsa.sparse_attention(q, k, v, ids[0], block_size=64,
                                                        backend="reference", **call), out)


def test_gradients_reach_exactly_the_parameters_they_should():
    """The KL reaches only the indexer's index projections; the output reaches every main
    projection and no index projection."""
    stack = _stack(layers=3, every=3)
    x = torch.randn(2, 200, 96, dtype=torch.float64)
    hidden, kls, _ = _run(stack, x)
    kl = torch.stack(kls[:1]).mean()
    named = [(f"{i}.{name}", p) for i, layer in enumerate(stack)
             for name, p in layer.named_parameters()]
    kl_grads = torch.autograd.grad(kl, [p for _, p in named], allow_unused=True,
                                   retain_graph=True)
    out_grads = torch.autograd.grad(hidden.square().sum(), [p for _, p in named],
                                    allow_unused=True)
    for (name, _), kl_grad, out_grad in zip(named, kl_grads, out_grads):
        is_index = "index_" in name
        assert (kl_grad is not None and kl_grad.abs().max() > 0) == is_index, name
        assert is_index == (out_grad is None or out_grad.abs().max() == 0), name
    assert all(name.startswith("0.") for name, _ in named if "index_" in name)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("warmup", [False, True])
def test_share_index_kl_teaches_the_source_index_branch(packed, warmup):
    """share_index_kl: the outputs stay those of plain sharing; a sharing layer's KL is
    msa_attention's of the source's index inputs against its own q and k over the source's ids
    (the whole prefix in warmup); it reaches the source's index projections and nothing else."""
    call = {}
    if packed:
        x = torch.randn(330, 96, dtype=torch.float64)
        call = dict(cu_seqlens=torch.tensor([0, 130, 131, 330], dtype=torch.int32))
    else:
        x = torch.randn(2, 200, 96, dtype=torch.float64)
    teaching, plain = _stack(layers=3, every=3, share_index_kl=True), _stack(layers=3, every=3)
    for layer in teaching + plain:
        layer.warmup = warmup
    hidden, kls, ids = _run(teaching, x, **call)
    plain_hidden, plain_kls, _ = _run(plain, x, **call)
    torch.testing.assert_close(hidden, plain_hidden, rtol=1e-12, atol=1e-12)
    assert [layer.has_kl for layer in teaching] == [True] * 3
    assert [layer.has_kl for layer in plain] == [True, False, False]
    assert not [n for n, _ in teaching[1].named_parameters() if "index" in n]
    positions = teaching[0]._default_positions(x.shape[:-1], call.get("cu_seqlens"), x.device)
    _, _, _, index_q, index_k = teaching[0].projections(x, positions)
    inputs = x
    for layer, kl, layer_ids in zip(teaching, kls, ids):
        q, k, v, *_ = layer.projections(inputs, positions)
        _, expected_kl = openmsa.msa_attention(q, k, v, index_q, index_k, block_indices=layer_ids,
                                               warmup=warmup, backend="reference", **OPTIONS,
                                               **call)
        torch.testing.assert_close(kl, expected_kl, rtol=1e-12, atol=1e-12)
        inputs = layer(inputs, **call)[0]
    assert kls[1] > 0 and not torch.allclose(kls[1], kls[0])
    torch.testing.assert_close(kls[0], plain_kls[0])
    named = [(f"{i}.{name}", p) for i, layer in enumerate(teaching)
             for name, p in layer.named_parameters()]
    grads = torch.autograd.grad(kls[2], [p for _, p in named], allow_unused=True)
    for (name, _), grad in zip(named, grads):
        assert (grad is not None and grad.abs().max() > 0) == name.startswith("0.index_"), name


def test_share_index_kl_clear_errors():
    with pytest.raises(ValueError, match="^share_index_kl: applies to a layer that shares"):
        MSAAttention(96, 4, 2, 64, num_index_heads=2, share_index_kl=True, **OPTIONS)
    indexer = _stack(layers=1)[0]
    with pytest.raises(ValueError, match="^share_index_kl: expected a bool"):
        MSAAttention(96, 4, 2, 64, num_index_heads=2, share_index_from=indexer,
                     share_index_kl=1, **OPTIONS)
    sharer = MSAAttention(96, 4, 2, 64, num_index_heads=2, share_index_from=indexer,
                          share_index_kl=True, **OPTIONS).double()
    x = torch.randn(1, 130, 96, dtype=torch.float64)
    indexer.warmup = sharer.warmup = True  # no ids are needed, the index inputs are
    with pytest.raises(ValueError, match="^share_index_kl: the layer this one shares ran no "
                                         "forward"):
        sharer(x)


def test_warmup_runs_sharing_layers_dense_and_selects_after():
    stack = _stack(layers=2)
    x = torch.randn(1, 200, 96, dtype=torch.float64)
    for layer in stack:
        layer.warmup = True
    hidden, kls, ids = _run(stack, x)
    assert ids == [None, None]
    first, _ = stack[0](x)
    positions = torch.arange(200).expand(1, 200)
    q, k, v, _, _ = stack[1].projections(first, positions)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(2, 2).transpose(1, 2),
        v.repeat_interleave(2, 2).transpose(1, 2), is_causal=True).transpose(1, 2)
    torch.testing.assert_close(hidden, stack[1].o_proj(expected.reshape(1, 200, -1)),
                               rtol=1e-10, atol=1e-10)
    assert kls[1] == 0
    # set_msa_warmup switches sharing layers too.
    assert set_msa_warmup(torch.nn.ModuleList(stack), False) == 2
    _, _, ids = _run(stack, x)
    assert ids[0] is not None and torch.equal(ids[0], ids[1])


def test_fp8_index_branch_shares_its_fp8_selection():
    stack = _stack(layers=2, index_precision="fp8")
    x = torch.randn(1, 300, 96, dtype=torch.float64)
    _, _, ids = _run(stack, x)
    fp8_ids = ids[0]
    input_ids = _run(_stack(layers=2), x)[2][0]
    assert torch.equal(ids[1], fp8_ids) and not torch.equal(fp8_ids, input_ids)


@interpreted
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("warmup", [False, True])
def test_sparse_attention_kernels_match_the_reference(packed, warmup):
    """sparse_attention on the custom operators (given ids, or warmup's every causal block),
    out and gradients, against the reference, batch and packed."""
    generator = torch.Generator().manual_seed(3)
    call = {}
    lead = (330,) if packed else (2, 200)
    if packed:
        call["cu_seqlens"] = torch.tensor([0, 130, 131, 330], dtype=torch.int32)
    q, k, v = (torch.randn(*lead, heads, 64, generator=generator) for heads in (4, 2, 2))
    index_q, index_k = (torch.randn(*lead, heads, 64, generator=generator) for heads in (2, 1))
    ids = None
    if not warmup:
        ids = openmsa.select_blocks(index_q, index_k, backend="reference", top_k=2,
                                    block_size=64, **call)
    out_grad = torch.randn_like(q)
    options = dict(call, block_size=64, warmup=warmup)
    if warmup:
        options["num_index_heads"] = 2

    def run(backend):
        tensors = [t.clone().requires_grad_() for t in (q, k, v)]
        out = openmsa.sparse_attention(*tensors, ids, backend=backend, **options)
        return [out, *torch.autograd.grad((out * out_grad).sum(), tensors)]

    for got, expected in zip(run("triton"), run("reference")):
        assert rel_rms_error(got, expected) < 1e-5


@interpreted
def test_sparse_operators_pass_opcheck():
    from openmsa.ops.custom_ops import sparse_backward, sparse_forward
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(150, heads, 64, generator=generator).requires_grad_()
               for heads in (4, 2, 2))
    cu_seqlens = torch.tensor([0, 70, 150], dtype=torch.int32)
    index_q, index_k = (torch.randn(150, heads, 64, generator=generator) for heads in (2, 1))
    ids = openmsa.select_blocks(index_q, index_k, cu_seqlens=cu_seqlens, backend="reference",
                                top_k=2, block_size=64).permute(1, 0, 2).contiguous()
    for block_ids, warmup in ((ids, False), (None, True)):
        args = (q, k, v, cu_seqlens, block_ids, 2, 64, 0.125, warmup, 80, 0, 0)
        torch.library.opcheck(sparse_forward, args)
        with torch.no_grad():
            out, lse, kept, *work = sparse_forward(*args)
        torch.library.opcheck(sparse_backward, (torch.randn_like(out), q.detach(), k.detach(),
                                                v.detach(), out, lse, kept, *work, cu_seqlens,
                                                64, 0.125, 0, 0))
        if not warmup:  # a sharing layer's call: the selecting forward's lists given (the
            # autograd and dispatch checks ran above on the same operator)
            torch.library.opcheck(sparse_forward, args + tuple(work),
                                  test_utils=("test_schema", "test_faketensor"))


@interpreted
def test_shared_stack_compiles_with_fullgraph_and_matches_eager():
    stack = torch.nn.ModuleList(_stack(backend="triton", dtype=torch.float32, layers=2))

    def loss_of(layers, x):
        hidden, kls, _ = _run(layers, x)
        return hidden.square().mean() + kls[0]

    x = torch.randn(2, 150, 96)
    eager = loss_of(stack, x)
    eager_grads = torch.autograd.grad(eager, list(stack.parameters()))
    compiled = torch.compile(lambda x: loss_of(stack, x), fullgraph=True, backend="aot_eager")
    loss = compiled(x)
    grads = torch.autograd.grad(loss, list(stack.parameters()))
    torch.testing.assert_close(loss, eager, rtol=1e-5, atol=1e-6)
    for got, expected in zip(grads, eager_grads):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


def test_sparse_attention_clear_errors():
    q, k, v = (torch.randn(1, 130, heads, 64) for heads in (4, 2, 2))
    with pytest.raises(ValueError, match="^block_indices: expected None with warmup=True"):
        openmsa.sparse_attention(q, k, v, torch.zeros(1, 2, 130, 2, dtype=torch.int32),
                                 block_size=64, warmup=True)
    with pytest.raises(ValueError, match="^num_index_heads: expected a number of index heads"):
        openmsa.sparse_attention(q, k, v, block_size=64, warmup=True, num_index_heads=3)
    with pytest.raises(ValueError, match="^num_index_heads: expected None with block_indices"):
        openmsa.sparse_attention(q, k, v, torch.zeros(1, 2, 130, 2, dtype=torch.int32),
                                 block_size=64, num_index_heads=2)
    with pytest.raises(TypeError, match="^deterministic: expected a bool"):
        openmsa.sparse_attention(q, k, v, block_size=64, warmup=True, deterministic=1)
    with pytest.raises(TypeError, match="^block_indices: expected a torch.Tensor"):
        openmsa.sparse_attention(q, k, v, block_size=64)


@interpreted
@pytest.mark.parametrize("packed", [False, True])
def test_sharing_reuses_the_selecting_forwards_work_lists(packed, monkeypatch):
    """Ids that msa_attention returned carry its work lists: sparse_attention over them builds
    no list and checks no value, and gives exactly what it gives over a copy of the ids (checked,
    lists built anew). Ids changed in place since, or used with another cu_seqlens, are checked
    again."""
    from openmsa.ops import problem as problem_module
    generator = torch.Generator().manual_seed(5)
    call = {}
    lead = (330,) if packed else (2, 200)
    if packed:
        call["cu_seqlens"] = torch.tensor([0, 130, 131, 330], dtype=torch.int32)
    q, k, v = (torch.randn(*lead, heads, 64, generator=generator).requires_grad_()
               for heads in (4, 2, 2))
    index_q, index_k = (torch.randn(*lead, heads, 64, generator=generator).requires_grad_()
                        for heads in (2, 1))
    _, kl, ids = openmsa.msa_attention(q, k, v, index_q, index_k, backend="triton",
                                       return_indices=True, **OPTIONS, **call)
    builds = []
    for name in ("build_query_tile_work", "build_block_work"):
        original = getattr(problem_module, name)
        monkeypatch.setattr(problem_module, name,
                            lambda *a, _f=original, _n=name, **kw: builds.append(_n) or _f(*a, **kw))
    checks = []
    original_check = msa_module.validate_sparse_args
    monkeypatch.setattr(msa_module, "validate_sparse_args", lambda *a, **kw: checks.append(
        kw["check_index_values"]) or original_check(*a, **kw))
    out_grad = torch.randn_like(q)

    def shared(block_ids):
        out = openmsa.sparse_attention(q * 0.5, k, v, block_ids, backend="triton",
                                       block_size=64, **call)
        return [out, *torch.autograd.grad((out * out_grad).sum(), (q, k, v))]

    reused = shared(ids)
    assert builds == [] and checks == [False]
    rebuilt = shared(ids.clone())
    assert builds == ["build_query_tile_work", "build_block_work"] and checks == [False, True]
    for got, expected in zip(reused, rebuilt):
        assert torch.equal(got, expected)
    if packed:  # another cu_seqlens tensor, even of the same packing: checked and built anew
        call["cu_seqlens"] = call["cu_seqlens"].clone()
        shared(ids)
        assert builds[2:] == ["build_query_tile_work", "build_block_work"] and checks[2] is True
    ids[..., 0] = 100  # past every query's own block
    with pytest.raises(ValueError, match="^block_indices: expected entries in"):
        shared(ids)
