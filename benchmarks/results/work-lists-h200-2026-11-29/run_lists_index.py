"""Where the small costs of the step go (coherent selections, bench_msa.py's shapes): the work
lists' builders, the index log-sum-exp kernel alone under several launch configurations, and
every kernel of one 16k H16 step (msa_attention fwd + bwd) by GPU time."""
import json
import os

import torch

from openmsa import msa_attention
from openmsa.bench.run import index_inputs
from openmsa.bench.timing import median_ms
from openmsa.ops.attention import (LOG2_E, SEGMENT_PAIRS, SparseAttentionProblem,
                                   _launch, _sparse_attn_fwd_kernel, _strides)
from openmsa.ops.csr import build_block_work, build_query_tile_work
from openmsa.ops.schedule import batch_cu_seqlens
from openmsa.ops.select import select_blocks_fwd

out_dir = os.environ["OUT"]
rows = []
for S, H, Hkv in ((131072, 64, 4), (16384, 16, 2)):
    D, Hi = 128, 4
    g = torch.Generator(device="cuda").manual_seed(S + H)
    q, k, v = (torch.randn(S, h, D, device="cuda", generator=g).bfloat16()
               for h in (H, Hkv, Hkv))
    iq, ik = index_inputs("coherent", S, Hi, D, g)
    cu = batch_cu_seqlens(1, S, "cuda")
    ids, index_max = select_blocks_fwd(iq, ik, cu, top_k=16, block_size=128,
                                       index_softmax_scale=D ** -0.5, num_local_blocks=1,
                                       num_sink_blocks=0, return_max=True)
    p = SparseAttentionProblem(q, k, ids, cu, 128, D ** -0.5, ik, D ** -0.5)
    row = dict(S=S, H=H, union_mean=p.query_work.union_count.float().mean().item())
    row["query_tile_work_ms"] = median_ms(
        lambda: build_query_tile_work(ids, cu, p.query_tokens))
    order = p._top_k_segment_order()
    row["block_work_ms"] = median_ms(
        lambda: build_block_work(ids, cu, 128, SEGMENT_PAIRS, 0, S, order))
    lse_index = torch.empty(S, Hi, device="cuda")

    def index_alone(warps, stages):
        _launch(_sparse_attn_fwd_kernel, p.query_grid(), q, k, v, iq, ik, q, lse_index,
                lse_index, index_max, *p.query_work_args(), *_strides(q, k, v, q, iq, ik),
                p.scale * LOG2_E, p.index_scale, **p.query_constants(), WITH_MAIN=False,
                WITH_INDEX=True, INDEX_MAX_GIVEN=True, num_warps=warps, num_stages=stages)

    for warps in (2, 4, 8):
        for stages in (1, 2, 3, 4):
            row[f"index_alone_w{warps}_s{stages}_ms"] = median_ms(
                lambda: index_alone(warps, stages))
    print(json.dumps(row), flush=True)
    rows.append(row)
    if S == 16384:
        tensors = [t[None].detach().requires_grad_() for t in (q, k, v, iq, ik)]

        def step():
            out, kl = msa_attention(*tensors)
            torch.autograd.backward((out, kl), (torch.ones_like(out), torch.ones_like(kl)))

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        kernels = sorted(((e.key[:70], e.device_time_total / 1000, e.count)
                          for e in prof.key_averages() if e.device_time_total > 0),
                         key=lambda item: -item[1])
        rows.append(dict(S=S, H=H, step_kernels=kernels,
                         step_kernels_total_ms=sum(ms for _, ms, _ in kernels)))
        for name, ms, count in kernels:
            print(f"{ms:8.3f} ms {count:4d}x {name}")
    with open(os.path.join(out_dir, "lists_index.json"), "w") as handle:
        json.dump(rows, handle, indent=1)
    del q, k, v, iq, ik, p, ids, index_max
    torch.cuda.empty_cache()
