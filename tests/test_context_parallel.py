"""Context parallelism on CPU with gloo: 2 and 4 processes match the single-process run."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import openmsa
from openmsa.context_parallel import (context_parallel_msa_attention,
                                      context_parallel_sparse_attention, shard_sequence,
                                      zigzag_shard, zigzag_shard_sequences)
from openmsa.layers import MSAAttention
from openmsa.testing import INPUT_NAMES, gloo_test_process, same_block_sets

SEQLEN, OPTIONS = 256, dict(top_k=2, block_size=64, backend="reference")
PACKED = (40, 1, 150, 65)  # 256 tokens in four sequences, split across ranks mid-sequence


def _inputs(heads, batch=1):
    generator = torch.Generator().manual_seed(0)
    shapes = [(heads[0], 64), (heads[1], 64), (heads[1], 64), (heads[2], 64), (heads[3], 64)]
    tensors = [torch.randn(batch, SEQLEN, h, d, generator=generator, dtype=torch.float64)
               for h, d in shapes]
    out_grad = torch.randn(batch, SEQLEN, heads[0], 64, generator=generator, dtype=torch.float64)
    return tensors, out_grad


def _packed_offsets():
    return torch.tensor([0, *PACKED]).cumsum(0).to(torch.int32)


def _layer_inputs(packed):
    """A layer's hidden states and their gradient, the call's cu_seqlens, the sequence dim."""
    generator = torch.Generator().manual_seed(1)
    x, hidden_grad = (torch.randn(1, SEQLEN, 96, dtype=torch.float64, generator=generator)
                      for _ in range(2))
    if packed:
        return x[0], hidden_grad[0], dict(cu_seqlens=_packed_offsets()), 0
    return x, hidden_grad, {}, 1


def _run(rank, worker, world, init_file, failures, args):
    """One process: ``worker(rank, world, *args)`` inside a gloo group; errors go to the
    parent."""
    with gloo_test_process(rank, world, init_file, failures):
        worker(rank, world, *args)


def _spawn(worker, world, *args):
    with tempfile.TemporaryDirectory() as folder:
        failures = mp.get_context("spawn").SimpleQueue()
        mp.start_processes(_run, args=(worker, world, os.path.join(folder, "init"), failures,
                                       args), nprocs=world, start_method="spawn")
        messages = []
        while not failures.empty():
            messages.append(failures.get())
        assert not messages, "\n".join(messages)


def _failing_worker(rank, world, before_a_collective):
    if not before_a_collective:
        dist.all_reduce(torch.ones(1))
    if rank == 1:
        raise RuntimeError("rank one fails")
    if before_a_collective:
        dist.all_reduce(torch.ones(1))  # rank 1 never comes: rank 0 must fail, not hang


@pytest.mark.parametrize("before_a_collective", [False, True])
def test_an_error_on_one_rank_fails_the_test(before_a_collective):
    """The workers leave through ``os._exit(0)``: their errors must still reach the parent,
    and a rank waiting for a failed one must not hang."""
    with pytest.raises(AssertionError, match="rank 1: RuntimeError: rank one fails"):
        _spawn(_failing_worker, 2, before_a_collective)


# --------------------------------------------------------------------------------------------
# Head-parallel mode: contiguous shards
# --------------------------------------------------------------------------------------------

def _head_worker(rank, world, heads, warmup, packed):
    tensors, out_grad = _inputs(heads)
    options = dict(OPTIONS, warmup=warmup)
    if packed:  # [T, heads, dim] with offsets of the whole packing
        tensors, out_grad = [t[0] for t in tensors], out_grad[0]
        options["cu_seqlens"] = _packed_offsets()
    full = [t.clone().requires_grad_() for t in tensors]
    out, kl = openmsa.msa_attention(*full, **options)
    ((out * out_grad).sum() + kl).backward()
    shard = slice(rank * SEQLEN // world, (rank + 1) * SEQLEN // world)
    index = (shard,) if packed else (slice(None), shard)
    local = [t[index].clone().requires_grad_() for t in tensors]
    out_cp, kl_cp = context_parallel_msa_attention(*local, **options)
    ((out_cp * out_grad[index]).sum() + kl_cp).backward()
    torch.testing.assert_close(out_cp, out[index], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(kl_cp, kl, rtol=1e-6, atol=1e-9)
    for name, a, b in zip(INPUT_NAMES, local, full):
        torch.testing.assert_close(a.grad, b.grad[index], rtol=1e-6, atol=1e-10, msg=name)


@pytest.mark.parametrize("world,heads", [
    (2, (4, 2, 2, 1)),   # shared index key head: all-gathered
    (4, (8, 4, 4, 1)),
    (2, (4, 2, 4, 2)),   # index key heads split across ranks
])
def test_head_parallel_matches_single_process(world, heads):
    _spawn(_head_worker, world, heads, False, False)


def test_head_parallel_warmup_matches_single_process():
    _spawn(_head_worker, 2, (4, 2, 2, 1), True, False)


@pytest.mark.parametrize("world", [2, 4])
def test_head_parallel_packed_input_matches_single_process(world):
    _spawn(_head_worker, world, (8, 4, 4, 1), False, True)


def _head_layer_worker(rank, world):
    torch.manual_seed(0)
    single = MSAAttention(96, 4, 2, 64, top_k=2, block_size=64, backend="reference").double()
    parallel = MSAAttention(96, 4, 2, 64, top_k=2, block_size=64, backend="reference",
                            context_parallel_group=dist.group.WORLD).double()
    parallel.load_state_dict(single.state_dict())
    x = torch.randn(1, SEQLEN, 96, dtype=torch.float64, generator=torch.Generator()
                    .manual_seed(1))
    hidden, kl = single(x)
    shard = slice(rank * SEQLEN // world, (rank + 1) * SEQLEN // world)
    hidden_cp, kl_cp = parallel(x[:, shard])
    torch.testing.assert_close(hidden_cp, hidden[:, shard], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(kl_cp, kl, rtol=1e-6, atol=1e-9)


def test_layer_with_a_process_group_matches_the_single_process_layer():
    _spawn(_head_layer_worker, 2)


def test_clear_errors():
    with pytest.raises(ValueError, match="^mode:"):
        context_parallel_msa_attention(*_inputs((4, 2, 2, 1))[0], mode="ring")
    with pytest.raises(ValueError, match="^group:"):
        context_parallel_msa_attention(*_inputs((4, 2, 2, 1))[0])
    with pytest.raises(ValueError, match="^context_parallel_mode: expected one of"):
        MSAAttention(96, 4, 2, 64, context_parallel_mode="ring")
    q, k, v = _inputs((4, 2, 2, 1))[0][:3]
    with pytest.raises(ValueError, match="^mode:"):
        context_parallel_sparse_attention(q, k, v, None, mode="ring", warmup=True)
    with pytest.raises(ValueError, match="^group:"):
        context_parallel_sparse_attention(q, k, v, None, warmup=True)
    indexer = MSAAttention(96, 4, 2, 64, top_k=2, block_size=64)
    with pytest.raises(ValueError, match="^share_index_from: expected a layer with this layer's "
                       "context parallel group and mode"):
        MSAAttention(96, 4, 2, 64, top_k=2, block_size=64, context_parallel_mode="sequence",
                     share_index_from=indexer)


# --------------------------------------------------------------------------------------------
# Sequence-parallel mode: zig-zag shards
# --------------------------------------------------------------------------------------------

# (name, heads (H, Hkv, Hi, Hik), batch, packed, warmup). With 4 ranks the chunks are 32 tokens:
# query ranges start inside key blocks of 64; packed chunks cut and cross sequences.
SEQUENCE_CASES = [
    ("shared index key head", (4, 2, 2, 1), 1, False, False),
    ("index key heads split, two batch rows", (4, 2, 4, 2), 2, False, False),
    ("warmup", (4, 2, 2, 1), 1, False, True),
    ("packed", (8, 4, 4, 1), 1, True, False),
    ("packed warmup", (4, 1, 2, 1), 1, True, True),
    ("dilated local window", (4, 2, 2, 1), 1, False, False,
     dict(top_k=3, num_local_blocks=2, local_block_dilation=2)),
]


def _check_sequence_mode(heads, batch, packed, warmup, extra=None):
    """out, kl, all five gradients and the kept blocks against the single-process run."""
    tensors, out_grad = _inputs(heads, batch)
    options = dict(OPTIONS, warmup=warmup, return_indices=not warmup, **(extra or {}))
    dim = 1  # the sequence dim
    if packed:
        tensors, out_grad, dim = [t[0] for t in tensors], out_grad[0], 0
        options["cu_seqlens"] = _packed_offsets()
    full = [t.clone().requires_grad_() for t in tensors]
    out, kl, *ids = openmsa.msa_attention(*full, **options)
    ((out * out_grad).sum() + kl).backward()
    local = [zigzag_shard(t, dim=dim).requires_grad_() for t in tensors]
    out_cp, kl_cp, *ids_cp = context_parallel_msa_attention(*local, mode="sequence", **options)
    ((out_cp * zigzag_shard(out_grad, dim=dim)).sum() + kl_cp).backward()
    torch.testing.assert_close(out_cp, zigzag_shard(out, dim=dim), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(kl_cp, kl, rtol=1e-6, atol=1e-9)
    for name, a, b in zip(INPUT_NAMES, local, full):
        torch.testing.assert_close(a.grad, zigzag_shard(b.grad, dim=dim), rtol=1e-6,
                                   atol=1e-10, msg=name)
    if not warmup:  # ids: [B, Hi, S, k] (packed [Hi, T, k]): the sequence is one dim later
        assert same_block_sets(ids_cp[0], zigzag_shard(ids[0], dim=dim + 1)).all()


def _check_sequence_layer(packed):
    """The layer option: RoPE positions of the zig-zag shard, hidden, kl, and the parameters'
    gradients summed over the ranks."""
    torch.manual_seed(0)
    options = dict(top_k=2, block_size=64, backend="reference")
    single = MSAAttention(96, 4, 2, 64, **options).double()
    parallel = MSAAttention(96, 4, 2, 64, **options, context_parallel_group=dist.group.WORLD,
                            context_parallel_mode="sequence").double()
    parallel.load_state_dict(single.state_dict())
    x, hidden_grad, call, dim = _layer_inputs(packed)
    hidden, kl = single(x, **call)
    ((hidden * hidden_grad).sum() + kl).backward()
    hidden_cp, kl_cp = parallel(zigzag_shard(x, dim=dim), **call)
    ((hidden_cp * zigzag_shard(hidden_grad, dim=dim)).sum() + kl_cp).backward()
    torch.testing.assert_close(hidden_cp, zigzag_shard(hidden, dim=dim), rtol=1e-10,
                               atol=1e-10)
    torch.testing.assert_close(kl_cp, kl, rtol=1e-6, atol=1e-9)
    for (name, got), expected in zip(parallel.named_parameters(), single.parameters()):
        grad = got.grad.clone()
        dist.all_reduce(grad)
        torch.testing.assert_close(grad, expected.grad, rtol=1e-6, atol=1e-10, msg=name)


def _sequence_worker(rank, world, case_names):
    checks = [(name, _check_sequence_mode, case) for name, *case in SEQUENCE_CASES]
    checks += [("layer", _check_sequence_layer, (False,)),
               ("layer, packed", _check_sequence_layer, (True,))]
    for name, check, args in checks:
        if name not in case_names:
            continue
        try:
            check(*args)
        except Exception as error:
            raise AssertionError(f"{name}: {type(error).__name__}: {error}") from error


@pytest.mark.parametrize("world,case_names", [
    (2, [name for name, *_ in SEQUENCE_CASES] + ["layer", "layer, packed"]),
    (4, ["shared index key head", "packed"]),  # chunks of 32 tokens: mid-block ranges
], ids=["2 ranks", "4 ranks"])
def test_sequence_parallel_matches_single_process(world, case_names):
    _spawn(_sequence_worker, world, case_names)


def _sequence_errors_worker(rank, world):
    tensors, _ = _inputs((4, 2, 2, 1))
    shards = [t[:, :SEQLEN // world] for t in tensors]  # the shapes of valid shards
    bad_calls = [
        ("^q: expected a shard of an even number of tokens",
         [t[:, :5] for t in tensors], {}),
        (r"^k: expected leading dimensions \(1, 128\) \(those of q",
         [shards[0], tensors[1][:, :64], *shards[2:]], {}),
        ("^block_indices: expected None",
         shards, dict(block_indices=torch.zeros(1, 2, 128, 2, dtype=torch.int32))),
        ("^max_seqlen: expected None unless cu_seqlens is given", shards, dict(max_seqlen=8)),
        # Packed shards whose offsets do not describe the ranks' tokens: msa_attention's check,
        # on the gathered keys (every rank fails alike).
        ("^cu_seqlens: expected last entry equal to the packed token count T=256",
         [t[0] for t in shards], dict(cu_seqlens=torch.tensor([0, 255], dtype=torch.int32))),
    ]
    for match, inputs, options in bad_calls:
        call = {**OPTIONS, "mode": "sequence", **options}
        with pytest.raises(ValueError, match=match):
            context_parallel_msa_attention(*inputs, **call)
    with pytest.raises(ValueError, match=r"^x: expected a length along dim 1 divisible by "
                       rf"2 \* world size = {2 * world}"):
        zigzag_shard(torch.zeros(1, 2 * world + 1))
    with pytest.raises(ValueError, match="^mode: expected one of"):
        shard_sequence(torch.zeros(1, 8), mode="ring")
    layer = MSAAttention(96, 4, 2, 64, context_parallel_group=dist.group.WORLD,
                         context_parallel_mode="sequence")
    with pytest.raises(ValueError, match="^hidden_states: expected an even number of tokens"):
        layer(torch.zeros(1, 5, 96))


def test_sequence_parallel_clear_errors():
    _spawn(_sequence_errors_worker, 2)


# --------------------------------------------------------------------------------------------
# Index sharing (SPEC section 9) in either mode
# --------------------------------------------------------------------------------------------

def _sharing_stack(**options):
    """An indexer and a layer sharing its selection, float64, reference backend."""
    torch.manual_seed(0)
    first = MSAAttention(96, 4, 2, 64, top_k=2, block_size=64, backend="reference",
                         **options).double()
    second = MSAAttention(96, 4, 2, 64, top_k=2, block_size=64, backend="reference",
                          share_index_from=first, **options).double()
    return first, second


def _check_sharing(mode, packed, warmup):
    """hidden, kl and the parameters' gradients (summed over ranks) of the two-layer stack
    against the single-process stack."""
    world, rank = dist.get_world_size(), dist.get_rank()
    single = _sharing_stack()
    parallel = _sharing_stack(context_parallel_group=dist.group.WORLD,
                              context_parallel_mode=mode)
    for one, other in zip(single, parallel):
        other.load_state_dict(one.state_dict())
        one.warmup = other.warmup = warmup
    x, hidden_grad, call, dim = _layer_inputs(packed)
    if mode == "sequence":
        def shard(t):
            return zigzag_shard(t, dim=dim)
    else:
        def shard(t):
            length = t.shape[dim] // world
            return t.narrow(dim, rank * length, length)

    def run(stack, x):
        hidden, kl = stack[0](x, **call)
        out, second_kl = stack[1](hidden, **call)
        assert second_kl == 0
        return out, kl

    hidden, kl = run(single, x)
    ((hidden * hidden_grad).sum() + kl).backward()
    hidden_cp, kl_cp = run(parallel, shard(x))
    ((hidden_cp * shard(hidden_grad)).sum() + kl_cp).backward()
    torch.testing.assert_close(hidden_cp, shard(hidden), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(kl_cp, kl, rtol=1e-6, atol=1e-9)
    for layer_cp, layer in zip(parallel, single):
        for (name, got), expected in zip(layer_cp.named_parameters(), layer.parameters()):
            grad = got.grad.clone()
            dist.all_reduce(grad)
            torch.testing.assert_close(grad, expected.grad, rtol=1e-6, atol=1e-10, msg=name)


SHARING_CASES = [(mode, packed, warmup) for mode in ("head", "sequence")
                 for packed, warmup in ((False, False), (True, False), (False, True))]


def _sharing_worker(rank, world):
    for case in SHARING_CASES:
        try:
            _check_sharing(*case)
        except Exception as error:
            raise AssertionError(f"{case}: {type(error).__name__}: {error}") from error


def test_index_sharing_matches_single_process_in_both_modes():
    _spawn(_sharing_worker, 2)


# --------------------------------------------------------------------------------------------
# Sequence mode, packed input split per sequence (packed_split="sequence": the THD layout)
# --------------------------------------------------------------------------------------------

PER_SEQUENCE = (64, 8, 120, 64)  # 256 tokens; every length divisible by 2 x 4 ranks


def _check_per_sequence_split(warmup):
    """out, kl, all five gradients and the kept blocks against the single-process run on the
    whole packing; a layer sharing those blocks (context_parallel_sparse_attention) too."""
    tensors, out_grad = _inputs((8, 4, 4, 1))
    tensors, out_grad = [t[0] for t in tensors], out_grad[0]
    offsets = torch.tensor([0, *PER_SEQUENCE]).cumsum(0).to(torch.int32)

    def shard(x):
        return zigzag_shard_sequences(x, offsets)

    options = dict(OPTIONS, warmup=warmup, return_indices=not warmup, cu_seqlens=offsets)
    full = [t.clone().requires_grad_() for t in tensors]
    out, kl, *ids = openmsa.msa_attention(*full, **options)
    sparse_options = dict(block_size=64, cu_seqlens=offsets, backend="reference",
                          warmup=warmup, num_index_heads=4 if warmup else None)
    shared = openmsa.sparse_attention(*full[:3], None if warmup else ids[0], **sparse_options)
    ((out * out_grad).sum() + kl + (shared * out_grad).sum()).backward()
    local = [shard(t).requires_grad_() for t in tensors]
    out_cp, kl_cp, *ids_cp = context_parallel_msa_attention(
        *local, mode="sequence", packed_split="sequence", **options)
    shared_cp = context_parallel_sparse_attention(
        *local[:3], None if warmup else ids_cp[0], mode="sequence", packed_split="sequence",
        **sparse_options)
    local_grad = shard(out_grad)
    ((out_cp * local_grad).sum() + kl_cp + (shared_cp * local_grad).sum()).backward()
    torch.testing.assert_close(out_cp, shard(out), rtol=1e-10,
                               atol=1e-10)
    torch.testing.assert_close(shared_cp, shard(shared),
                               rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(kl_cp, kl, rtol=1e-6, atol=1e-9)
    for name, a, b in zip(INPUT_NAMES, local, full):
        torch.testing.assert_close(a.grad, shard(b.grad),
                                   rtol=1e-6, atol=1e-10, msg=name)
    if not warmup:  # ids [Hi, T, k]: tokens along dim 1
        expected = shard(ids[0].transpose(0, 1)).transpose(0, 1)
        assert same_block_sets(ids_cp[0], expected).all()


def _per_sequence_worker(rank, world):
    for warmup in (False, True):
        try:
            _check_per_sequence_split(warmup)
        except Exception as error:
            raise AssertionError(f"warmup={warmup}: {type(error).__name__}: {error}") from error
    tensors, _ = _inputs((4, 2, 2, 1))
    shards = [t[0, :SEQLEN // world] for t in tensors]
    offsets = torch.tensor([0, *PER_SEQUENCE]).cumsum(0).to(torch.int32)
    bad_calls = [
        ("^packed_split: expected one of", dict(packed_split="tokens", cu_seqlens=offsets)),
        ("^packed_split: expected 'packing' unless mode='sequence' with cu_seqlens",
         dict(packed_split="sequence")),
        ("^cu_seqlens: expected every sequence's length divisible by",
         dict(packed_split="sequence",
              cu_seqlens=torch.tensor([0, 2, 256], dtype=torch.int32))),
    ]
    for match, options in bad_calls:
        with pytest.raises(ValueError, match=match):
            context_parallel_msa_attention(*shards, **{**OPTIONS, "mode": "sequence",
                                                       **options})
    with pytest.raises(ValueError, match="^cu_seqlens: expected every sequence's length "
                                         "divisible by"):
        zigzag_shard_sequences(torch.zeros(256), torch.tensor([0, 2, 256]))


@pytest.mark.parametrize("world", [2, 4])
def test_per_sequence_packed_split_matches_single_process(world):
    _spawn(_per_sequence_worker, world)
