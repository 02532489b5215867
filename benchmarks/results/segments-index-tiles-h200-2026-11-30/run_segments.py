"""The key-outer kernels of the 16k, H16 step (dK/dV with its reduction, and the KL) on
key-block lists cut into segments of different sizes and taken in different orders. Prints one
JSON line per (segment pairs, order) and writes OUT/NAME.json.

    OUT=DIR python run_segments.py NAME [SEQLEN HEADS,KV_HEADS,INDEX_HEADS PAIRS,... ORDER,...]

Default: 16384 16,2,4 512,1024,2048,4096 pairs,rows."""
import json
import os
import sys

import torch

from openmsa.bench.run import make_inputs
from openmsa.bench.timing import median_ms
from openmsa.ops import attention, hopper
from openmsa.ops.attention import (SparseAttentionProblem, attention_dkdv, kl_key_walk,
                                   sparse_attention_fwd)
from openmsa.ops.csr import build_block_work
from openmsa.ops.schedule import batch_cu_seqlens
from openmsa.ops.select import select_blocks_fwd

name = sys.argv[1]
S, heads, sizes, orders = (sys.argv[2:] + ["16384", "16,2,4", "512,1024,2048,4096",
                                          "pairs,rows"][len(sys.argv) - 2:])
S, D = int(S), 128
H, Hkv, Hi = (int(h) for h in heads.split(","))
q, k, v, iq, ik = (t.detach()[0] for t in make_inputs(
    dict(heads=H, kv_heads=Hkv, index_heads=Hi, head_dim=D), S, "coherent"))
dout = torch.randn_like(q)
cu = batch_cu_seqlens(1, S, "cuda")
ids, index_max = select_blocks_fwd(iq, ik, cu, top_k=16, block_size=128,
                                   index_softmax_scale=D ** -0.5, num_local_blocks=1,
                                   num_sink_blocks=0, return_max=True)
base = SparseAttentionProblem(q, k, ids, cu, 128, D ** -0.5, ik, D ** -0.5)
out, lse, lse_index = sparse_attention_fwd(q, k, v, iq, ik, base, index_max)
delta = attention.attention_delta(out, dout, base)

results = []
for segment_pairs in (int(size) for size in sizes.split(",")):
    for order in orders.split(","):
        work = build_block_work(ids, cu, 128, segment_pairs, 0, None, order)
        p = SparseAttentionProblem(q, k, ids, cu, 128, D ** -0.5, ik, D ** -0.5,
                                   query_work=base.query_work, block_work=work)
        row = dict(seqlen=S, heads=heads, segment_pairs=segment_pairs, order=order,
                   segments=int((work.segments[:, 0] >= 0).sum()))
        row["kl_ms"] = median_ms(lambda: kl_key_walk(q, k, iq, ik, lse, lse_index, p,
                                                     True, True))
        row["dkdv_parts_ms"] = median_ms(lambda: hopper.attention_dkdv_parts(
            q, k, v, dout, lse, delta, p, p.scale * attention.LOG2_E))
        row["dkdv_with_reduction_ms"] = median_ms(lambda: attention_dkdv(
            q, k, v, dout, lse, delta, p))
        results.append(row)
        print(json.dumps(row), flush=True)
with open(os.path.join(os.environ["OUT"], f"{name}.json"), "w") as f:
    json.dump(results, f, indent=1)
