"""The work lists' Triton builders on the GPU: equal to the torch operations' lists (bench_msa.py's
three step shapes with coherent selections, and a packed batch with a query range), their GPU
time from CUDA graphs against the torch operations', and the 16k H16 step (CUDA graph) with
the index log-sum-exp on 32- and 64-token tiles, alternating."""
import json
import os

import torch

from openmsa import msa_attention
from openmsa.bench.run import index_inputs
from openmsa.bench.timing import median_ms
from openmsa.ops import attention
from openmsa.ops.csr import build_block_work
from openmsa.ops.schedule import batch_cu_seqlens, query_tile_schedule
from openmsa.ops.select import select_blocks_fwd

out_dir = os.environ["OUT"]
FIELDS = ("bucket_start", "bucket_count", "bucket_segments_end", "block_sequence",
          "block_local", "segments", "segment_order")


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


def equal_block_work(ids, cu, query_start, num_keys, order):
    lists = [build_block_work(ids, cu, 128, attention.SEGMENT_PAIRS, query_start, num_keys,
                              order, use_triton=use) for use in (False, True)]
    pairs = int((ids >= 0).sum())
    same = torch.equal(lists[0].pair_token[:pairs], lists[1].pair_token[:pairs])
    return same and all(torch.equal(getattr(lists[0], f), getattr(lists[1], f)) for f in FIELDS)


rows = []
for S, H, Hkv in ((16384, 16, 2), (32768, 64, 4), (131072, 64, 4)):
    D, Hi = 128, 4
    g = torch.Generator(device="cuda").manual_seed(S)
    iq, ik = index_inputs("coherent", S, Hi, D, g)
    cu = batch_cu_seqlens(1, S, "cuda")
    ids = select_blocks_fwd(iq, ik, cu, top_k=16, block_size=128, index_softmax_scale=D ** -0.5,
                            num_local_blocks=1, num_sink_blocks=0)
    row = dict(S=S, H=H)
    row["block_work_equal"] = {order: equal_block_work(ids, cu, 0, S, order)
                               for order in ("pairs", "rows", "head_rows")}
    row["schedule_equal"] = all(torch.equal(query_tile_schedule(cu, S, t, use_triton=False),
                                            query_tile_schedule(cu, S, t, use_triton=True))
                                for t in (1, 8, 32, 64))
    for use in (False, True):
        name = "triton" if use else "torch"
        row[f"block_work_{name}_ms"] = median_ms(graphed(
            lambda: build_block_work(ids, cu, 128, attention.SEGMENT_PAIRS, 0, S, "pairs",
                                     use_triton=use)))
        row[f"schedule_{name}_ms"] = median_ms(graphed(
            lambda: query_tile_schedule(cu, S, 32, use_triton=use)))
    print(json.dumps(row), flush=True)
    rows.append(row)

# A packed batch of 37 sequences and a query range starting and ending inside sequences.
g = torch.Generator(device="cuda").manual_seed(1)
lengths = torch.randint(1, 3000, (37,), generator=g, device="cuda")
cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).int()
T = int(cu[-1])
iq, ik = index_inputs("random", T, 4, 64, g)
first, end = 1000, T - 777
ids = select_blocks_fwd(iq[first:end], ik, cu, top_k=8, block_size=128,
                        index_softmax_scale=0.125, num_local_blocks=2, num_sink_blocks=1,
                        query_start=first)
packed = dict(T=T, sequences=37, query_range=[first, end])
packed["block_work_equal"] = {order: equal_block_work(ids, cu, first, T, order)
                              for order in ("pairs", "rows", "head_rows")}
packed["schedule_equal"] = all(
    torch.equal(query_tile_schedule(cu, end - first, t, first, use_triton=False),
                query_tile_schedule(cu, end - first, t, first, use_triton=True))
    for t in (1, 8, 32, 64))
print(json.dumps(packed), flush=True)
rows.append(packed)

# The 16k H16 step from a CUDA graph: index tiles of 32 and 64 tokens, alternating.
S, H, Hkv, Hi, D = 16384, 16, 2, 4, 128
g = torch.Generator(device="cuda").manual_seed(S)
q, k, v = (torch.randn(1, S, h, D, device="cuda", generator=g).bfloat16().requires_grad_()
           for h in (H, Hkv, Hkv))
dout = torch.randn_like(q)
iq, ik = index_inputs("coherent", S, Hi, D, g)
inputs = (q, k, v, iq[None].requires_grad_(), ik[None].requires_grad_())
one = torch.ones((), device="cuda")


def step():
    out, kl = msa_attention(*inputs, top_k=16, block_size=128)
    torch.autograd.grad((out, kl), inputs, (dout, one))


step_rows = []
for repeat in range(3):
    for tokens in (32, 64):
        attention.INDEX_TILE_TOKENS = tokens
        step_rows.append(dict(index_tile_tokens=tokens, graph_ms=median_ms(graphed(step)),
                              eager_ms=median_ms(step)))
        print(json.dumps(step_rows[-1]), flush=True)
attention.INDEX_TILE_TOKENS = 32
rows.append(dict(step_16k_h16=step_rows))
with open(os.path.join(out_dir, "lists.json"), "w") as f:
    json.dump(rows, f, indent=1)
