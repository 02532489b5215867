"""The index log-sum-exp alone (next to the Hopper forward, on its own 32-token tiles) under
2/4/8 warps and 1-3 pipeline stages, at 16k H16 and 128k H64 (coherent selections)."""
import json
import os

import torch

from openmsa.bench.run import index_inputs
from openmsa.bench.timing import median_ms
from openmsa.ops import attention
from openmsa.ops.attention import SparseAttentionProblem, index_log_sum_exp
from openmsa.ops.schedule import batch_cu_seqlens
from openmsa.ops.select import select_blocks_fwd

out_dir = os.environ["OUT"]
rows = []
for S, H in ((16384, 16), (131072, 64)):
    D, Hi = 128, 4
    g = torch.Generator(device="cuda").manual_seed(S)
    q = torch.randn(S, H, D, device="cuda", generator=g).bfloat16()
    k = torch.randn(S, 4, D, device="cuda", generator=g).bfloat16()
    iq, ik = index_inputs("coherent", S, Hi, D, g)
    cu = batch_cu_seqlens(1, S, "cuda")
    ids, index_max = select_blocks_fwd(iq, ik, cu, top_k=16, block_size=128,
                                       index_softmax_scale=D ** -0.5, num_local_blocks=1,
                                       num_sink_blocks=0, return_max=True)
    p = SparseAttentionProblem(q, k, ids, cu, 128, D ** -0.5, ik, D ** -0.5)
    p.index_tile_work
    reference = index_log_sum_exp(iq, ik, index_max, p)
    row = dict(S=S, H=H)
    for warps in (2, 4, 8):
        for stages in (1, 2, 3):
            attention.INDEX_ALONE_CONFIG = dict(num_warps=warps, num_stages=stages)
            row[f"w{warps}_s{stages}_max_diff"] = (
                index_log_sum_exp(iq, ik, index_max, p) - reference).abs().max().item()
            row[f"w{warps}_s{stages}_ms"] = median_ms(
                lambda: index_log_sum_exp(iq, ik, index_max, p))
    print(json.dumps(row), flush=True)
    rows.append(row)
with open(os.path.join(out_dir, "index_configs.json"), "w") as f:
    json.dump(rows, f, indent=1)
