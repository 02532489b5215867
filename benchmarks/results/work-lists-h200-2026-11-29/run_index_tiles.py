"""The index log-sum-exp alone (next to the Hopper forward) on tiles of 8 (the main tiles at
16 heads per index head), 32 and 64 tokens, coherent selections at bench_msa.py's H64 shapes:
time of the kernel, of building its lists, and the largest difference from the 8-token run."""
import json
import os

import torch

from openmsa.bench.run import index_inputs
from openmsa.bench.timing import median_ms
from openmsa.ops import attention
from openmsa.ops.csr import build_query_tile_work
from openmsa.ops.schedule import batch_cu_seqlens
from openmsa.ops.select import select_blocks_fwd

out_dir = os.environ["OUT"]
rows = []
for S in (131072, 32768):
    H, D, Hi = 64, 128, 4
    g = torch.Generator(device="cuda").manual_seed(S + H)
    q = torch.randn(S, H, D, device="cuda", generator=g).bfloat16()
    iq, ik = index_inputs("coherent", S, Hi, D, g)
    cu = batch_cu_seqlens(1, S, "cuda")
    ids, index_max = select_blocks_fwd(iq, ik, cu, top_k=16, block_size=128,
                                       index_softmax_scale=D ** -0.5, num_local_blocks=1,
                                       num_sink_blocks=0, return_max=True)
    row = dict(S=S, H=H)
    lse = {}
    for tokens in (8, 32, 64):
        p = attention.SparseAttentionProblem(q, ik, ids, cu, 128, D ** -0.5, ik, D ** -0.5)
        p.index_tile_work = build_query_tile_work(ids, cu, tokens)
        row[f"union_mean_{tokens}"] = p.index_tile_work.union_count.float().mean().item()
        row[f"lists_{tokens}_ms"] = median_ms(lambda: build_query_tile_work(ids, cu, tokens))
        lse[tokens] = attention.index_log_sum_exp(iq, ik, index_max, p)
        row[f"index_lse_{tokens}_ms"] = median_ms(
            lambda: attention.index_log_sum_exp(iq, ik, index_max, p))
        row[f"max_abs_diff_{tokens}_vs_8"] = (lse[tokens] - lse[8]).abs().max().item()
    print(json.dumps(row), flush=True)
    rows.append(row)
    with open(os.path.join(out_dir, "index_tiles.json"), "w") as handle:
        json.dump(rows, handle, indent=1)
    del q, iq, ik, ids, index_max, p, lse
    torch.cuda.empty_cache()
