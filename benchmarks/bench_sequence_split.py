"""The compute of sequence-parallel ranks on one GPU (no communication): each rank's two zig-zag
query chunks, forward+backward against every key, against the whole step (GPU only).

    python benchmarks/bench_sequence_split.py [--seqlen 131072] [--world 2 4]

A rank's time over the whole step's, times the world size, is the compute balance of the split
(1.0: perfect); the all-gathers and reduce-scatters come on top.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton.testing

from openmsa import msa_attention
from openmsa.bench.selection import index_inputs


def bench(fn):
    return triton.testing.do_bench(fn, warmup=5, rep=100, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seqlen", type=int, default=131072)
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    seqlen, heads, kv_heads, index_heads, dim = args.seqlen, 64, 4, 4, 128
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, seqlen, h, dim, device="cuda", generator=generator).bfloat16()
               .requires_grad_() for h in (heads, kv_heads, kv_heads))
    index_q, index_k = index_inputs("coherent", seqlen, index_heads, dim, generator)
    index_q, index_k = index_q[None].requires_grad_(), index_k[None].requires_grad_()
    dout, one = torch.randn_like(q), torch.ones((), device="cuda")

    def step(first, end):
        inputs = (q[:, first:end], k, v, index_q[:, first:end], index_k)
        leaves = (q, k, v, index_q, index_k)
        out, kl = msa_attention(*inputs, top_k=16, block_size=128, query_start=first,
                                kl_num_queries=seqlen)
        torch.autograd.grad((out, kl), leaves, (dout[:, first:end], one))

    whole = bench(lambda: step(0, seqlen))
    rows = [dict(seqlen=seqlen, world=1, rank=0, ms=whole, balance=1.0)]
    for world in args.world:
        chunk = seqlen // (2 * world)
        for rank in (0, world - 1):
            chunks = ((rank * chunk, (rank + 1) * chunk),
                      ((2 * world - 1 - rank) * chunk, (2 * world - rank) * chunk))
            ms = bench(lambda: [step(a, b) for a, b in chunks])
            rows.append(dict(seqlen=seqlen, world=world, rank=rank, ms=ms,
                             balance=ms * world / whole))
    for row in rows:
        print(json.dumps(row))
    print(f"\nS={seqlen} H{heads}/Hkv{kv_heads}/Hi{index_heads} D{dim} coherent, fwd+bwd, "
          f"{torch.cuda.get_device_name()}: one rank's compute (no communication)")
    for row in rows:
        print(f"  W={row['world']} rank {row['rank']}: {row['ms']:8.2f} ms  "
              f"(x W / whole step = {row['balance']:.2f})")


if __name__ == "__main__":
    main()
