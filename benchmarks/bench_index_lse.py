"""The index log-sum-exp over the kept tokens (the KL's student normalizer), computed beside
the Hopper forward, three ways (GPU only): the query-outer walk of the Triton forward's index part
on 64-token tiles (its cost follows each tile's union of kept blocks) against the key-outer
pass over a key-block list of the rows' pairs (its cost follows the kept pairs),
and the split of the two by each tile's union that the forward runs (tiles of at most
``INDEX_WALK_LIMIT_PER_SLOT * top_k`` blocks walk, the rest key-outer), all given selection's
row maxima, on every selection kind.

    python benchmarks/bench_index_lse.py --out DIR [--seqlens 32768,131072]

H64/Hkv4/Hi4/Hik1, Di = 128, top 16 of 128, bf16. The walk's tile lists are built beforehand;
the key-outer pass builds a list of the pairs of the rows the walk left (all of them for
"key-outer") each time, which its times include. Each row gives the selection's
neighbours' Jaccard and 8-token union, the three times (speedup: the walk's over the split's)
and how far the results lie apart (the larger max absolute difference of the natural-log
values of key-outer and split against the walk). Prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import triton

from openmsa.bench.selection import SELECTION_KINDS, index_inputs, selection_statistics
from openmsa.bench.timing import median_ms
from openmsa.ops.attention import index_log_sum_exp, index_log_sum_exp_key_outer
from openmsa.ops.layout import batch_cu_seqlens
from openmsa.ops.problem import SparseAttentionProblem
from openmsa.ops.select import select_blocks_fwd

HEADS, KV_HEADS, INDEX_HEADS, DIM, TOP_K, BLOCK = 64, 4, 4, 128, 16, 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seqlens", default="32768,131072")
    parser.add_argument("--kinds", default=",".join(SELECTION_KINDS))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for seqlen in map(int, args.seqlens.split(",")):
        for kind in args.kinds.split(","):
            generator = torch.Generator(device="cuda").manual_seed(seqlen)
            q = torch.randn(seqlen, HEADS, DIM, device="cuda", generator=generator).bfloat16()
            k = torch.randn(seqlen, KV_HEADS, DIM, device="cuda", generator=generator).bfloat16()
            index_q, index_k = index_inputs(kind, seqlen, INDEX_HEADS, DIM, generator)
            cu = batch_cu_seqlens(1, seqlen, "cuda")
            scale = DIM ** -0.5
            ids, row_max = select_blocks_fwd(index_q, index_k, cu, top_k=TOP_K, block_size=BLOCK,
                                             index_softmax_scale=scale, num_local_blocks=1,
                                             num_sink_blocks=0, return_max=True)
            problem = SparseAttentionProblem(q, k, ids, cu, BLOCK, scale, index_k, scale)
            problem.index_tile_work
            walk = index_log_sum_exp(index_q, index_k, row_max, problem)
            key_outer = index_log_sum_exp_key_outer(index_q, index_k, row_max, problem,
                                                    walk_limit=0)
            split = index_log_sum_exp_key_outer(index_q, index_k, row_max, problem)
            row = dict(seqlen=seqlen, selection=kind, **selection_statistics(ids),
                       query_outer_ms=median_ms(
                           lambda: index_log_sum_exp(index_q, index_k, row_max, problem)),
                       key_outer_ms=median_ms(
                           lambda: index_log_sum_exp_key_outer(index_q, index_k, row_max,
                                                               problem, walk_limit=0)),
                       split_ms=median_ms(
                           lambda: index_log_sum_exp_key_outer(index_q, index_k, row_max,
                                                               problem)),
                       max_abs_difference=max((walk - key_outer).abs().max().item(),
                                              (walk - split).abs().max().item()))
            row["speedup"] = row["query_outer_ms"] / row["split_ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                  triton=triton.__version__, date=time.strftime("%Y-%m-%d"), args=vars(args),
                  config=f"H{HEADS}/Hkv{KV_HEADS}/Hi{INDEX_HEADS}/Hik1 Di={DIM} top {TOP_K} of "
                  f"{BLOCK}, bf16", rows=rows)
    with open(os.path.join(args.out, "bench_index_lse.json"), "w") as handle:
        json.dump(result, handle, indent=2)
    print(f"\nindex log-sum-exp alone, {result['gpu']}, {result['config']}")
    print(f"{'S':>7} {'selection':>9} {'Jaccard':>7} {'union8':>6} {'query-outer ms':>14} "
          f"{'key-outer ms':>12} {'split ms':>8} {'speedup':>7} {'max |diff|':>10}")
    for r in rows:
        print(f"{r['seqlen']:>7} {r['selection']:>9} {r['jaccard']:>7.3f} {r['union_8']:>6.1f} "
              f"{r['query_outer_ms']:>14.3f} {r['key_outer_ms']:>12.3f} {r['split_ms']:>8.3f} "
              f"{r['speedup']:>6.2f}x "
              f"{r['max_abs_difference']:>10.2e}")


if __name__ == "__main__":
    main()
