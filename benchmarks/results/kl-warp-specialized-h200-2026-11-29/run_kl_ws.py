"""The KL kernel: the warp-specialized Gluon kernel against the lock-step Gluon kernel, same
problems (coherent selections, bench_attention.py's seeds), interleaved, twice; its outputs
compared with the lock-step kernel's and the Triton kernel's (relative RMS). Query side with
the value (the default step's path); the key side alone (deterministic=True's) at 32k."""
import json
import os

import torch
import triton.testing

from openmsa.bench.run import index_inputs
from openmsa.ops import hopper
from openmsa.ops.attention import SparseAttentionProblem, kl_key_walk, sparse_attention_fwd
from openmsa.ops.schedule import batch_cu_seqlens
from openmsa.ops.select import select_blocks_fwd

out_dir = os.environ["OUT"]
parts = hopper.kl_key_walk_parts


def rel_rms(a, b):
    return ((a.float() - b.float()).pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt()).item()


def kl(inputs, query_side, kernel):
    """kl_key_walk on the lock-step or warp-specialized Gluon kernel, or on Triton's."""
    if kernel == "triton":
        return kl_key_walk(*inputs, query_side, query_side, use_hopper=False)
    hopper.kl_key_walk_parts = lambda *a, **kw: parts(*a, **kw,
                                                      warp_specialized=kernel == "ws")
    try:
        return kl_key_walk(*inputs, query_side, query_side)
    finally:
        hopper.kl_key_walk_parts = parts


rows = []
for S, H, Hkv, sides in ((131072, 64, 4, (True,)), (32768, 64, 4, (True, False)),
                         (16384, 16, 2, (True,))):
    D, Hi = 128, 4
    g = torch.Generator(device="cuda").manual_seed(S + H)
    q, k, v = (torch.randn(S, h, D, device="cuda", generator=g).bfloat16()
               for h in (H, Hkv, Hkv))
    iq, ik = index_inputs("coherent", S, Hi, D, g)
    cu = batch_cu_seqlens(1, S, "cuda")
    ids = select_blocks_fwd(iq, ik, cu, top_k=16, block_size=128, index_softmax_scale=D ** -0.5,
                            num_local_blocks=1, num_sink_blocks=0)
    p = SparseAttentionProblem(q, k, ids, cu, 128, D ** -0.5, ik, D ** -0.5)
    _, lse, lse_index = sparse_attention_fwd(q, k, v, iq, ik, p)
    inputs = (q, k, iq, ik, lse, lse_index, p)
    for query_side in sides:
        row = dict(S=S, H=H, query_side=query_side)
        got = {name: kl(inputs, query_side, name) for name in ("triton", "lockstep", "ws")}
        for name in ("lockstep", "ws"):
            for index, output in enumerate(("d_index_k", "kl_rows", "d_index_q")):
                if got[name][index] is not None:
                    row[f"{name}_{output}_rel_rms_vs_triton"] = rel_rms(got[name][index],
                                                                        got["triton"][index])
        row["ws_d_index_k_rel_rms_vs_lockstep"] = rel_rms(got["ws"][0], got["lockstep"][0])
        if not query_side:  # deterministic=True's path: per-segment partials
            again = kl(inputs, query_side, "ws")
            row["ws_bitwise_reproducible"] = bool(torch.equal(again[0], got["ws"][0]))
        best = {name: float("inf") for name in ("lockstep", "ws")}
        for _ in range(2):
            for name in best:
                best[name] = min(best[name], triton.testing.do_bench(
                    lambda n=name: kl(inputs, query_side, n), warmup=10, rep=100,
                    return_mode="median"))
        row.update({f"{name}_ms": ms for name, ms in best.items()})
        print(json.dumps(row), flush=True)
        rows.append(row)
        with open(os.path.join(out_dir, "kl_ws.json"), "w") as handle:
            json.dump(rows, handle, indent=1)
    del q, k, v, iq, ik, p, lse, lse_index, inputs
    torch.cuda.empty_cache()

for r in rows:
    print(f"{r['S']:>7} H{r['H']:<3} query side {r['query_side']!s:>5}: lock step "
          f"{r['lockstep_ms']:.2f} ms, warp-specialized {r['ws_ms']:.2f} ms; rel RMS vs Triton "
          + " ".join(f"{key.split('_rel')[0]}={value:.1e}" for key, value in r.items()
                     if key.endswith("vs_triton")))
