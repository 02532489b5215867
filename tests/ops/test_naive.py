"""The eager reference against the loop implementation, and its properties (SPEC sections 3-4)."""

import pytest
import torch

import openmsa
from openmsa.ops import naive
from openmsa.ops.validate import validate_msa_args
from openmsa.testing import (INPUT_NAMES, QUANTITY_NAMES, MSACase, msa_options, random_inputs,
                             run_query_ranges, run_with_grads)
from loop_reference import loop_msa



def _grad_seed(inputs, num_heads, head_dim, seed=7):
    lead = inputs[0].shape[:-2]
    return torch.randn(*lead, num_heads, head_dim, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(seed))


def _ids_as_sets(ids):
    """[..., k] int ids -> nested lists of sets without the -1 slots."""
    if ids.dim() == 1:
        return {int(n) for n in ids if n >= 0}
    return [_ids_as_sets(row) for row in ids]


LOOP_CASES = [
    MSACase("batch2_partial_block", batch=2, seqlen=150, num_heads=4, num_kv_heads=2,
            num_index_heads=2, options=dict(top_k=2, block_size=64)),
    MSACase("index_key_gqa", batch=1, seqlen=140, num_heads=4, num_kv_heads=1, num_index_heads=4,
            num_index_kv_heads=2, options=dict(top_k=1, block_size=64)),
    MSACase("local_and_sink", batch=1, seqlen=330, num_heads=2, num_kv_heads=1,
            num_index_heads=1, options=dict(top_k=3, block_size=64, num_local_blocks=2,
                                            num_sink_blocks=1, softmax_scale=0.3,
                                            index_softmax_scale=0.2)),
    MSACase("dilated_local_window", batch=1, seqlen=520, num_heads=2, num_kv_heads=1,
            num_index_heads=2, options=dict(top_k=6, block_size=64, num_local_blocks=3,
                                            local_block_dilation=2, num_sink_blocks=1)),
    MSACase("packed", seqlens=(70, 1, 140, 64), num_heads=4, num_kv_heads=2, num_index_heads=2,
            options=dict(top_k=2, block_size=64)),
    MSACase("warmup", batch=2, seqlen=90, num_heads=4, num_kv_heads=2, num_index_heads=2,
            options=dict(block_size=64, warmup=True)),
    MSACase("warmup_packed", seqlens=(50, 80), num_heads=2, num_kv_heads=1, num_index_heads=2,
            num_index_kv_heads=2, options=dict(block_size=64, warmup=True)),
]


@pytest.mark.parametrize("case", LOOP_CASES, ids=lambda c: c.name)
def test_reference_matches_loop_implementation(case):
    inputs, cu_seqlens = random_inputs(case, torch.float64, "cpu", seed=3)
    out_grad = _grad_seed(inputs, case.num_heads, case.head_dim)
    kl_weight = 3.0
    warmup = case.options.get("warmup", False)
    options = dict(case.options, return_indices=not warmup)
    ref, ref_ids = run_with_grads(openmsa.naive_msa_attention, inputs, cu_seqlens, out_grad,
                                  kl_weight, **options)

    def loop(*tensors, cu_seqlens=None, return_indices=False, **opts):
        offsets = None if cu_seqlens is None else cu_seqlens.tolist()
        out, kl, selections = loop_msa(*tensors, cu_seqlens=offsets, **opts)
        loop.selections = selections
        return out, kl

    expected, _ = run_with_grads(loop, inputs, cu_seqlens, out_grad, kl_weight, **options)
    for name in QUANTITY_NAMES:
        torch.testing.assert_close(ref[name].double(), expected[name].double(), rtol=1e-6,
                                   atol=1e-9, msg=name)
    if not warmup:
        if cu_seqlens is None:
            assert _ids_as_sets(ref_ids) == loop.selections
        else:  # packed ids [Hi, T, k] -> per sequence [Hi][i]
            offsets = cu_seqlens.tolist()
            per_sequence = [_ids_as_sets(ref_ids[:, a:b]) for a, b in zip(offsets, offsets[1:])]
            assert per_sequence == loop.selections


def _dense_inputs(seed=0, batch=1, seqlen=200, heads=(4, 2, 2, 1), dtype=torch.float64):
    case = MSACase("x", batch=batch, seqlen=seqlen, num_heads=heads[0], num_kv_heads=heads[1],
                   num_index_heads=heads[2], num_index_kv_heads=heads[3])
    inputs, _ = random_inputs(case, dtype, "cpu", seed=seed)
    return case, inputs


def test_sparse_equals_warmup_when_top_k_covers_every_block():
    case, inputs = _dense_inputs(seqlen=300)  # 5 blocks of 64
    out_grad = _grad_seed(inputs, case.num_heads, case.head_dim)
    sparse, _ = run_with_grads(openmsa.naive_msa_attention, inputs, None, out_grad, 2.0,
                               top_k=5, block_size=64)
    dense, _ = run_with_grads(openmsa.naive_msa_attention, inputs, None, out_grad, 2.0,
                              block_size=64, warmup=True)
    for name in QUANTITY_NAMES:
        torch.testing.assert_close(sparse[name], dense[name], rtol=1e-12, atol=1e-12, msg=name)


def test_sparse_differs_from_warmup_when_blocks_are_dropped():
    """Guards the test above: with fewer kept blocks the results must differ."""
    _, inputs = _dense_inputs(seqlen=300)
    sparse, _ = openmsa.naive_msa_attention(*inputs, top_k=2, block_size=64)
    dense, _ = openmsa.naive_msa_attention(*inputs, block_size=64, warmup=True)
    assert not torch.allclose(sparse, dense)


PACKED_CASE = MSACase("packed", seqlens=(130, 1, 64, 200), num_heads=4, num_kv_heads=2,
                      num_index_heads=2, num_index_kv_heads=1,
                      options=dict(top_k=2, block_size=64, num_sink_blocks=1))


@pytest.mark.parametrize("warmup", [False, True])
def test_packed_equals_each_sequence_alone(warmup):
    inputs, cu_seqlens = random_inputs(PACKED_CASE, torch.float64, "cpu", seed=5)
    out_grad = _grad_seed(inputs, PACKED_CASE.num_heads, PACKED_CASE.head_dim)
    options = dict(PACKED_CASE.options, warmup=warmup, return_indices=not warmup)
    packed, packed_ids = run_with_grads(openmsa.naive_msa_attention, inputs, cu_seqlens,
                                        out_grad, 1.0, **options)
    offsets = cu_seqlens.tolist()
    total = offsets[-1]
    kl_weighted = 0.0
    for start, end in zip(offsets, offsets[1:]):
        alone_inputs = [t[None, start:end] for t in inputs]
        # Each sequence's KL is averaged over its own tokens; the packed KL over all tokens, so
        # the weight of the KL term scales by the token share.
        share = (end - start) / total
        alone, alone_ids = run_with_grads(openmsa.naive_msa_attention, alone_inputs, None,
                                          out_grad[None, start:end], share, **options)
        kl_weighted += alone["kl"].double() * share
        for name in ("out",) + tuple(f"d{n}" for n in INPUT_NAMES):
            # kl is float32 (SPEC), so the gradient reaching the index branch is rounded to
            # float32 and the different KL weights differ at that rounding.
            rtol = 1e-6 if "index" in name else 1e-12
            torch.testing.assert_close(packed[name][start:end], alone[name][0], rtol=rtol,
                                       atol=1e-12, msg=name)
        if not warmup:
            assert torch.equal(packed_ids[:, start:end], alone_ids[0])
    torch.testing.assert_close(packed["kl"].double(), kl_weighted, rtol=1e-6, atol=0)


# Query ranges that start inside key blocks; the packed ones cross sequence boundaries.
RANGE_CASES = [
    (PACKED_CASE, ((0, 37), (37, 200), (200, 395))),
    (MSACase("one_sequence", batch=1, seqlen=200, num_heads=4, num_kv_heads=2,
             num_index_heads=2, options=dict(top_k=2, block_size=64)),
     ((0, 37), (37, 130), (130, 200))),
]


@pytest.mark.parametrize("warmup", [False, True])
@pytest.mark.parametrize("case,ranges", RANGE_CASES, ids=lambda x: getattr(x, "name", ""))
def test_query_ranges_add_up_to_the_full_run(case, ranges, warmup):
    """Queries that are ranges of the keys' tokens (query_start): ids, out and query-side
    gradients are the full run's rows; KLs over the global count and key-side gradients add up
    to the full run's."""
    inputs, cu_seqlens = random_inputs(case, torch.float64, "cpu", seed=8)
    out_grad = _grad_seed(inputs, case.num_heads, case.head_dim)
    options = dict(case.options, warmup=warmup, return_indices=not warmup)
    full, full_ids = run_with_grads(openmsa.naive_msa_attention, inputs, cu_seqlens, out_grad,
                                    2.0, **options)
    parts = run_query_ranges(openmsa.naive_msa_attention, inputs, cu_seqlens, out_grad, 2.0,
                             ranges, **options)
    for (first, end), (part, ids) in zip(ranges, parts):
        rows = (..., slice(first, end), slice(None), slice(None))
        if not warmup:
            assert torch.equal(ids, full_ids[rows[:-1]])
        for name in ("out", "dq", "dindex_q"):
            torch.testing.assert_close(part[name][rows], full[name][rows], rtol=1e-6,
                                       atol=1e-12, msg=name)
    for name in QUANTITY_NAMES:
        # kl is float32 (SPEC): the KLs and index gradients agree to its rounding.
        torch.testing.assert_close(sum(part[name] for part, _ in parts), full[name],
                                   rtol=1e-6, atol=1e-12, msg=name)
    if not warmup:  # a range's ids, given back, reproduce its run
        (first, end), (part, ids) = ranges[1], parts[1]
        rows = (..., slice(first, end), slice(None), slice(None))
        q, k, v, index_q, index_k = (t.detach() for t in inputs)
        out, _ = openmsa.naive_msa_attention(
            q[rows], k, v, index_q[rows], index_k, cu_seqlens=cu_seqlens, query_start=first,
            block_indices=ids, **case.options)
        torch.testing.assert_close(out, part["out"][rows], rtol=1e-12, atol=1e-12)


def test_perturbing_one_packed_sequence_leaves_the_others_unchanged():
    inputs, cu_seqlens = random_inputs(PACKED_CASE, torch.float64, "cpu", seed=6)
    out_grad = _grad_seed(inputs, PACKED_CASE.num_heads, PACKED_CASE.head_dim)
    options = dict(PACKED_CASE.options, return_indices=True)
    before, ids_before = run_with_grads(openmsa.naive_msa_attention, inputs, cu_seqlens,
                                        out_grad, 1.0, **options)
    start, end = cu_seqlens[2].item(), cu_seqlens[3].item()  # the third sequence
    perturbed = [t.detach().clone() for t in inputs]
    for t in perturbed:
        t[start:end] += torch.randn_like(t[start:end])
    after, ids_after = run_with_grads(openmsa.naive_msa_attention, perturbed, cu_seqlens,
                                      out_grad, 1.0, **options)
    others = torch.ones(cu_seqlens[-1].item(), dtype=torch.bool)
    others[start:end] = False
    for name in ("out",) + tuple(f"d{n}" for n in INPUT_NAMES):
        assert torch.equal(before[name][others], after[name][others]), name
        assert not torch.equal(before[name][~others], after[name][~others]), name
    assert torch.equal(ids_before[:, others], ids_after[:, others])


def test_own_block_is_always_kept_and_unused_slots_are_minus_one():
    _, inputs = _dense_inputs(seqlen=300, batch=2)
    _, _, ids = openmsa.naive_msa_attention(*inputs, top_k=3, block_size=64, return_indices=True)
    assert ids.dtype == torch.int32 and ids.shape == (2, 2, 300, 3)
    own = torch.arange(300) // 64
    assert (ids == own[:, None]).any(dim=-1).all()
    # Queries in block n see n + 1 blocks: min(n + 1, top_k) slots are used, the rest are -1.
    used = (ids >= 0).sum(dim=-1)
    assert torch.equal(used, torch.clamp(own + 1, max=3).expand_as(used))
    # No block is kept twice and none lies in the future.
    assert (ids.max(dim=-1).values <= own).all()
    sorted_ids = ids.sort(dim=-1).values
    valid = sorted_ids[..., 1:] >= 0
    assert (sorted_ids[..., 1:] != sorted_ids[..., :-1])[valid].all()


def test_ties_go_to_the_lower_block_id():
    _, inputs = _dense_inputs(seqlen=64 * 6)
    index_k = inputs[4].detach().clone()
    index_k[:] = index_k[:, :1].clone()  # every key scores the same for a query: all blocks tie
    _, _, ids = openmsa.naive_msa_attention(*inputs[:4], index_k, top_k=3, block_size=64,
                                            return_indices=True)
    last = ids[0, :, -1]  # the last query, in block 5: own block + the two lowest ids
    assert all(set(row.tolist()) == {5, 0, 1} for row in last)


def _scored_index_inputs(block_bonus, seqlen, block_size=64, heads=(2, 1, 1, 1)):
    """Inputs whose index scores are exactly ``block_bonus[blk(j)]`` for every query (clear
    margins): index_q is a fixed unit vector, index_k puts the bonus on that direction."""
    case, inputs = _dense_inputs(seqlen=seqlen, heads=heads)
    index_q = torch.zeros_like(inputs[3])
    index_q[..., 0] = 1.0
    index_k = torch.zeros_like(inputs[4])
    bonus = torch.tensor(block_bonus, dtype=torch.float64)
    index_k[..., 0] = bonus[torch.arange(seqlen) // block_size][None, :, None]
    return inputs[:3] + [index_q, index_k]


def test_selection_follows_scores_with_clear_margins():
    bonus = [1.0, 5.0, 2.0, 9.0, 3.0, 0.0, 4.0]  # 7 blocks of 64
    inputs = _scored_index_inputs(bonus, 64 * 7)
    _, _, ids = openmsa.naive_msa_attention(*inputs, top_k=3, block_size=64,
                                            index_softmax_scale=1.0, return_indices=True)
    last = set(ids[0, 0, -1].tolist())
    assert last == {6, 3, 1}  # own block 6, then the best: 3 (9.0) and 1 (5.0)
    mid = set(ids[0, 0, 64 * 4 + 10].tolist())  # block 4 sees blocks 0..4
    assert mid == {4, 3, 1}


def test_forced_local_and_sink_blocks_are_kept_even_with_the_lowest_scores():
    bonus = [-9.0, 5.0, 2.0, 9.0, -8.0, -7.0, 4.0]  # sink block 0 and local block 5 score low
    inputs = _scored_index_inputs(bonus, 64 * 7)
    _, _, ids = openmsa.naive_msa_attention(*inputs, top_k=4, block_size=64,
                                            index_softmax_scale=1.0, num_local_blocks=2,
                                            num_sink_blocks=1, return_indices=True)
    assert set(ids[0, 0, -1].tolist()) == {6, 5, 0, 3}  # own, local, sink, then the best (3)


def test_given_block_indices_reproduce_the_selection():
    _, inputs = _dense_inputs(seqlen=260, heads=(4, 2, 2, 1))
    out, kl, ids = openmsa.naive_msa_attention(*inputs, top_k=2, block_size=64,
                                               return_indices=True)
    out2, kl2 = openmsa.naive_msa_attention(*inputs, top_k=2, block_size=64, block_indices=ids)
    assert torch.equal(out, out2) and torch.equal(kl, kl2)
    own_only = torch.full_like(ids, -1)  # keep only each query's own block: a different result
    own_only[..., 0] = torch.arange(260) // 64
    out3, _ = openmsa.naive_msa_attention(*inputs, top_k=2, block_size=64, block_indices=own_only)
    assert not torch.allclose(out, out3)


def test_query_chunking_does_not_change_results():
    case, inputs = _dense_inputs(seqlen=230, batch=2)
    out_grad = _grad_seed(inputs, case.num_heads, case.head_dim)
    options = dict(top_k=2, block_size=64, return_indices=True)
    whole, ids = run_with_grads(openmsa.naive_msa_attention, inputs, None, out_grad, 1.0,
                                **options)

    def in_chunks_of_one_query(q, k, v, index_q, index_k, cu_seqlens=None, **options):
        problem = validate_msa_args(q, k, v, index_q, index_k,
                                    **msa_options(dict(options, backend="reference")))
        # 1000 elements of [B=2, H=4, chunk, S=230]: chunks of one query.
        return naive.naive_msa_forward(q, k, v, index_q, index_k, problem, chunk_elements=1000)

    chunked, chunked_ids = run_with_grads(in_chunks_of_one_query, inputs, None, out_grad, 1.0,
                                          **options)
    assert torch.equal(ids, chunked_ids)
    for name in QUANTITY_NAMES:
        torch.testing.assert_close(whole[name], chunked[name], rtol=1e-12, atol=1e-12, msg=name)


def test_closed_form_kl_gradient_equals_autograd():
    """SPEC section 4: d kl / d z = (s - t) / (Nq * Hi) on the kept tokens."""
    case, inputs = _dense_inputs(seqlen=200, batch=2, heads=(4, 2, 2, 1), seed=11)
    q, k, v, index_q, index_k = [t.detach() for t in inputs]
    top_k, block_size, index_scale = 2, 64, 0.125
    _, kl, ids = openmsa.naive_msa_attention(q, k, v, index_q, index_k, top_k=top_k,
                                             block_size=block_size,
                                             index_softmax_scale=index_scale,
                                             return_indices=True)
    iq, ik = index_q.clone().requires_grad_(), index_k.clone().requires_grad_()
    _, kl_autograd = openmsa.naive_msa_attention(q, k, v, iq, ik, top_k=top_k,
                                                 block_size=block_size,
                                                 index_softmax_scale=index_scale)
    kl_autograd.backward()

    batch, seqlen, heads = q.shape[0], q.shape[1], q.shape[2]
    hi = index_q.shape[2]
    pos = torch.arange(seqlen)
    kept_block = (ids[..., None] == (pos // block_size)).any(dim=-2)  # [B, Hi, S, S]
    kept = kept_block & (pos[None, :] <= pos[:, None])
    logits = torch.einsum("bihd,bjhd->bhij", q, k.repeat_interleave(heads // k.shape[2], 2))
    logits = (logits * q.shape[-1] ** -0.5).masked_fill(
        ~kept.repeat_interleave(heads // hi, 1), float("-inf"))
    teacher = torch.softmax(logits, -1).view(batch, hi, heads // hi, seqlen, seqlen).mean(2)
    ik_full = index_k.repeat_interleave(hi // index_k.shape[2], 2)
    z = index_scale * torch.einsum("bird,bjrd->brij", index_q, ik_full)
    student = torch.softmax(z.masked_fill(~kept, float("-inf")), -1)
    dz = (student - teacher) / (batch * seqlen * hi)  # zero outside the kept tokens
    d_index_q = index_scale * torch.einsum("brij,bjrd->bird", dz, ik_full)
    d_index_k = index_scale * torch.einsum("brij,bird->bjrd", dz, index_q)
    d_index_k = d_index_k.view(batch, seqlen, index_k.shape[2], -1, index_k.shape[3]).sum(3)
    torch.testing.assert_close(iq.grad, d_index_q, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(ik.grad, d_index_k, rtol=1e-9, atol=1e-12)


def _grads_or_zero(loss, inputs):
    grads = torch.autograd.grad(loss, inputs, allow_unused=True, retain_graph=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, inputs)]


@pytest.mark.parametrize("warmup", [False, True])
def test_out_reaches_only_qkv_and_kl_only_the_index_branch(warmup):
    _, inputs = _dense_inputs(seqlen=150)
    out, kl = openmsa.naive_msa_attention(*inputs, top_k=2, block_size=64, warmup=warmup)
    out_grads = _grads_or_zero(out.sum(), inputs)
    kl_grads = _grads_or_zero(kl, inputs)
    assert all(g.abs().sum() > 0 for g in out_grads[:3])
    assert all(torch.count_nonzero(g) == 0 for g in out_grads[3:])
    assert all(torch.count_nonzero(g) == 0 for g in kl_grads[:3])
    assert all(g.abs().sum() > 0 for g in kl_grads[3:])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_output_dtypes(dtype):
    _, inputs = _dense_inputs(seqlen=70, dtype=dtype)
    out, kl, ids = openmsa.msa_attention(*inputs, top_k=1, block_size=64, return_indices=True)
    assert out.dtype == dtype and out.shape == inputs[0].shape
    assert kl.dtype == torch.float32 and kl.dim() == 0 and torch.isfinite(kl)
    assert ids.dtype == torch.int32


def test_kl_is_zero_when_the_index_branch_matches_a_single_head():
    """With one main head per index head, identical scores and one kept block per query, the
    student equals the teacher: KL = 0 (and positive once they differ)."""
    _, inputs = _dense_inputs(seqlen=130, heads=(1, 1, 1, 1))
    q, k, v, _, _ = inputs
    same = openmsa.naive_msa_attention(q, k, v, q, k, top_k=1, block_size=64)[1]
    assert abs(same.item()) < 1e-6
    different = openmsa.naive_msa_attention(q, k, v, k, q, top_k=1, block_size=64)[1]
    assert different.item() > 1e-3
