"""Sweep of the decode block-score kernel's launch (GPU only): cached blocks a program walks,
warps and pipeline stages, timed alone as CUDA graph replays against the bandwidth floor of the
cached index keys it reads, at each context and batch. The shipped launch is
``decode_kernels.BLOCKS_PER_PROGRAM`` with Triton's default warps and stages (first row of each
shape); a better one goes there, then ``openmsa bench --decode`` measures the whole step.

    python benchmarks/bench_decode_scores.py --out DIR [--seqlens 131072,524288] [--batches 1,8,32]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time

import torch
import triton

from openmsa.bench.decode import HBM_BYTES_PER_S
from openmsa.bench.selection import index_inputs
from openmsa.bench.timing import graphed, median_ms
from openmsa.ops.decode_kernels import BLOCKS_PER_PROGRAM, decode_block_scores

LAUNCHES = [(BLOCKS_PER_PROGRAM, None, None)] + [
    (blocks, warps, stages) for blocks, warps, stages in itertools.product((4, 8, 16), (4, 8),
                                                                           (1, 2, 3))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seqlens", default="131072,524288")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--index-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for context, batch in itertools.product(map(int, args.seqlens.split(",")),
                                            map(int, args.batches.split(","))):
        generator = torch.Generator(device="cuda").manual_seed(context + batch)
        index_q, index_k = index_inputs("coherent", context, args.index_heads, args.head_dim,
                                        generator, "cuda")
        index_q = index_q[None, -1:].expand(batch, 1, -1, -1).contiguous()
        index_k = index_k[None].expand(batch, -1, -1, -1).contiguous()
        lengths = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        floor_ms = index_k.numel() * index_k.element_size() / HBM_BYTES_PER_S * 1e3
        expected = decode_block_scores(index_q, index_k, lengths, 128, args.head_dim ** -0.5)
        for blocks, warps, stages in LAUNCHES:
            launch = None if warps is None else dict(num_warps=warps, num_stages=stages)

            def scores():
                return decode_block_scores(index_q, index_k, lengths, 128,
                                           args.head_dim ** -0.5, blocks_per_program=blocks,
                                           launch=launch)

            assert torch.equal(scores(), expected), (blocks, warps, stages)
            ms = median_ms(graphed(scores))
            rows.append(dict(context=context, batch=batch, blocks_per_program=blocks,
                             num_warps=warps, num_stages=stages, ms=ms, floor_ms=floor_ms,
                             x_floor=ms / floor_ms, shipped=launch is None))
            print(json.dumps(rows[-1]), flush=True)
    with open(os.path.join(args.out, "bench_decode_scores.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                       triton=triton.__version__, date=time.strftime("%Y-%m-%d"),
                       args=vars(args), rows=rows), f, indent=2)
    print(f"\n{'context':>8} {'batch':>5} {'shipped ms':>10} {'best ms':>8} {'best launch':>22} "
          f"{'floor ms':>8}")
    for (context, batch), group in itertools.groupby(rows, lambda r: (r["context"], r["batch"])):
        group = list(group)
        best = min(group, key=lambda r: r["ms"])
        print(f"{context:>8} {batch:>5} {group[0]['ms']:>10.4f} {best['ms']:>8.4f} "
              f"{str((best['blocks_per_program'], best['num_warps'], best['num_stages'])):>22} "
              f"{group[0]['floor_ms']:>8.4f}")


if __name__ == "__main__":
    main()
