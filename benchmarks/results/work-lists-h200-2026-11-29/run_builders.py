"""The query-tile lists (build_query_tile_work) from torch operations and from the Triton
kernel, on bench_msa.py's coherent selections: equal lists, and the time of each, eager and
replayed from a CUDA graph (GPU time alone)."""
import json
import os

import torch

from openmsa.bench.run import index_inputs
from openmsa.bench.timing import median_ms
from openmsa.ops.attention import SparseAttentionProblem
from openmsa.ops.csr import build_query_tile_work
from openmsa.ops.schedule import batch_cu_seqlens
from openmsa.ops.select import select_blocks_fwd

out_dir = os.environ["OUT"]


def graphed(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


rows = []
for S, H in ((131072, 64), (32768, 64), (16384, 16)):
    D, Hi = 128, 4
    g = torch.Generator(device="cuda").manual_seed(S + H)
    q = torch.randn(S, H, D, device="cuda", generator=g).bfloat16()
    iq, ik = index_inputs("coherent", S, Hi, D, g)
    cu = batch_cu_seqlens(1, S, "cuda")
    ids = select_blocks_fwd(iq, ik, cu, top_k=16, block_size=128, index_softmax_scale=D ** -0.5,
                            num_local_blocks=1, num_sink_blocks=0)
    tokens = SparseAttentionProblem(q, ik, ids, cu, 128, D ** -0.5).query_tokens
    row = dict(S=S, H=H, tile_tokens=tokens)
    lists = {}
    for name, use_triton in (("torch", False), ("triton", True)):
        def build(use_triton=use_triton):
            return build_query_tile_work(ids, cu, tokens, use_triton=use_triton)
        lists[name] = build()
        row[f"{name}_ms"] = median_ms(build)
        row[f"{name}_graph_ms"] = median_ms(graphed(build))
    row["equal"] = all(torch.equal(getattr(lists["torch"], field), getattr(lists["triton"], field))
                       for field in ("schedule", "union", "union_members", "union_count"))
    print(json.dumps(row), flush=True)
    rows.append(row)
    with open(os.path.join(out_dir, "builders.json"), "w") as handle:
        json.dump(rows, handle, indent=1)
