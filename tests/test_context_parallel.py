"""Context parallelism on CPU with gloo: 2 and 4 processes match the single-process run."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import openmsa
from openmsa.integrations.context_parallel import context_parallel_msa_attention

SEQLEN, OPTIONS = 256, dict(top_k=2, block_size=64, backend="reference")


def _inputs(heads):
    generator = torch.Generator().manual_seed(0)
    shapes = [(heads[0], 64), (heads[1], 64), (heads[1], 64), (heads[2], 64), (heads[3], 64)]
    tensors = [torch.randn(1, SEQLEN, h, d, generator=generator, dtype=torch.float64)
               for h, d in shapes]
    out_grad = torch.randn(1, SEQLEN, heads[0], 64, generator=generator, dtype=torch.float64)
    return tensors, out_grad


PACKED = (40, 1, 150, 65)  # 256 tokens in four sequences, split across ranks mid-sequence


def _worker(rank, world, init_file, heads, warmup, failures, packed=False):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        tensors, out_grad = _inputs(heads)
        options = dict(OPTIONS, warmup=warmup)
        if packed:  # [T, heads, dim] with offsets of the whole packing
            tensors, out_grad = [t[0] for t in tensors], out_grad[0]
            options["cu_seqlens"] = torch.tensor([0, *PACKED]).cumsum(0).to(torch.int32)
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
        for name, a, b in zip(("q", "k", "v", "index_q", "index_k"), local, full):
            torch.testing.assert_close(a.grad, b.grad[index], rtol=1e-6, atol=1e-10, msg=name)
    except Exception as error:  # reported to the parent, which fails the test
        failures.put(f"rank {rank}: {type(error).__name__}: {error}"[:2000])
    finally:
        dist.destroy_process_group()


def _spawn(world, heads, warmup=False, packed=False):
    with tempfile.TemporaryDirectory() as folder:
        failures = mp.get_context("spawn").SimpleQueue()
        mp.start_processes(_worker, args=(world, os.path.join(folder, "init"), heads, warmup,
                                          failures, packed), nprocs=world, start_method="spawn")
        messages = []
        while not failures.empty():
            messages.append(failures.get())
        assert not messages, "\n".join(messages)


@pytest.mark.parametrize("world,heads", [
    (2, (4, 2, 2, 1)),   # shared index key head: all-gathered
    (4, (8, 4, 4, 1)),
    (2, (4, 2, 4, 2)),   # index key heads split across ranks
])
def test_head_parallel_matches_single_process(world, heads):
    _spawn(world, heads)


def test_head_parallel_warmup_matches_single_process():
    _spawn(2, (4, 2, 2, 1), warmup=True)


@pytest.mark.parametrize("world", [2, 4])
def test_head_parallel_packed_input_matches_single_process(world):
    _spawn(world, (8, 4, 4, 1), packed=True)


def _layer_worker(rank, world, init_file, failures):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        from openmsa.layers import MSAAttention

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
    except Exception as error:
        failures.put(f"rank {rank}: {type(error).__name__}: {error}"[:2000])
    finally:
        dist.destroy_process_group()


def test_layer_with_a_process_group_matches_the_single_process_layer():
    with tempfile.TemporaryDirectory() as folder:
        failures = mp.get_context("spawn").SimpleQueue()
        mp.start_processes(_layer_worker, args=(2, os.path.join(folder, "init"), failures),
                           nprocs=2, start_method="spawn")
        messages = []
        while not failures.empty():
            messages.append(failures.get())
        assert not messages, "\n".join(messages)


def test_clear_errors():
    with pytest.raises(ValueError, match="^mode:"):
        context_parallel_msa_attention(*_inputs((4, 2, 2, 1))[0], mode="ring")
    with pytest.raises(ValueError, match="^group:"):
        context_parallel_msa_attention(*_inputs((4, 2, 2, 1))[0])
