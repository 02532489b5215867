"""The 16k, H16 step's query-tile unions and index log-sum-exp at 32- and 64-token tiles: the
union kernel at several warp counts, the index log-sum-exp at several launch configurations.
Prints one JSON line per measurement and writes OUT/union_index.json.

    OUT=DIR python run_union_index.py"""
import json
import os

import torch
import triton

from openmsa.bench.run import make_inputs
from openmsa.bench.timing import median_ms
from openmsa.ops import attention
from openmsa.ops.attention import SparseAttentionProblem, index_log_sum_exp
from openmsa.ops.csr import _query_tile_union_kernel, build_query_tile_work
from openmsa.ops.schedule import batch_cu_seqlens, query_tile_schedule
from openmsa.ops.select import select_blocks_fwd

S, D = 16384, 128
q, k, v, iq, ik = (t.detach()[0] for t in make_inputs(
    dict(heads=16, kv_heads=2, index_heads=4, head_dim=D), S, "coherent"))
cu = batch_cu_seqlens(1, S, "cuda")
ids, index_max = select_blocks_fwd(iq, ik, cu, top_k=16, block_size=128,
                                   index_softmax_scale=D ** -0.5, num_local_blocks=1,
                                   num_sink_blocks=0, return_max=True)
results = []


def record(**row):
    results.append(row)
    print(json.dumps(row), flush=True)


for tokens in (32, 64):
    reference = build_query_tile_work(ids, cu, tokens)
    schedule = query_tile_schedule(cu, S, tokens, 0)
    union, members, count = (torch.empty_like(t) for t in (
        reference.union, reference.union_members, reference.union_count))
    width = tokens * 16
    for warps in (2, 4, 8, 16):
        def launch():
            _query_tile_union_kernel[(schedule.shape[0], 4)](
                ids, schedule, cu, union, members, count, 0, S, ids.stride(0), ids.stride(1),
                4, TILE_TOKENS=tokens, TOP_K=16, ENTRIES=triton.next_power_of_2(width),
                num_warps=warps)
        launch()
        same = bool(torch.equal(union, reference.union) and torch.equal(members, reference.union_members))
        record(kernel="union", tokens=tokens, num_warps=warps, ms=median_ms(launch), same=same)
    record(kernel="union_mean_count", tokens=tokens,
           blocks=reference.union_count.float().mean().item())

base = SparseAttentionProblem(q, k, ids, cu, 128, D ** -0.5, ik, D ** -0.5)
expected = index_log_sum_exp(iq, ik, index_max, base)
for tokens in (32, 64):
    attention.INDEX_TILE_TOKENS = tokens
    p = SparseAttentionProblem(q, k, ids, cu, 128, D ** -0.5, ik, D ** -0.5,
                               query_work=base.query_work)
    p.index_tile_work  # built before timing
    for warps, stages in ((4, 2), (8, 2), (4, 3), (8, 3), (4, 1)):
        attention.INDEX_ALONE_CONFIG = dict(num_warps=warps, num_stages=stages)
        got = index_log_sum_exp(iq, ik, index_max, p)
        record(kernel="index_lse", tokens=tokens, num_warps=warps, num_stages=stages,
               ms=median_ms(lambda: index_log_sum_exp(iq, ik, index_max, p)),
               max_difference=(got - expected).abs().max().item())
with open(os.path.join(os.environ["OUT"], "union_index.json"), "w") as f:
    json.dump(results, f, indent=1)
