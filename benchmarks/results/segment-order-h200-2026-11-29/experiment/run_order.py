"""Experiment: key-outer segment order (most pairs first vs by first query row) for dK/dV and
the KL kernel, warmup and top-k selections."""
import sys, os, json
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import torch, triton, triton.testing
from bench_kl import problem_for
from openmsa.ops.attention import kl_key_walk, attention_dkdv, attention_delta

CASES_NEW = [("H16/Hkv2/Hi4", 32768, 16, 2, 4, 128, False), ("H16/Hkv2/Hi4", 16384, 16, 2, 4, 128, True)]
CASES = [("H64/Hkv4/Hi4", 32768, 64, 4, 4, 128, True), ("H64/Hkv4/Hi4", 32768, 64, 4, 4, 128, False),
         ("H64/Hkv4/Hi4", 131072, 64, 4, 4, 128, False), ("H16/Hkv2/Hi4", 16384, 16, 2, 4, 128, False)]


def orders(work, num_index_heads, num_queries):
    seg_bucket = work.segments[:, 0].long()
    first = work.segments[:, 1].long().clamp(max=work.pair_token.numel() - 1)
    token = work.pair_token[first].long()
    valid = seg_bucket >= 0
    head = seg_bucket.clamp(min=0) % num_index_heads
    big = num_index_heads * (num_queries + 1)
    by_row = torch.where(valid, token * num_index_heads + head, big)
    by_head_row = torch.where(valid, head * (num_queries + 1) + token, big)
    return {"as_built": work.segment_order.clone(),
            "pairs_desc": torch.argsort(torch.where(valid, work.bucket_start[seg_bucket.clamp(min=0)].long() + work.bucket_count[seg_bucket.clamp(min=0)].long() - first, 0).clamp(max=work.segment_pairs), descending=True, stable=True).to(torch.int32),
            "row": torch.argsort(by_row, stable=True).to(torch.int32),
            "head_row": torch.argsort(by_head_row, stable=True).to(torch.int32)}


def bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")


if os.environ.get("ORDER_CASES") == "new":
    CASES = CASES_NEW
rows = []
for name, S, H, Hkv, Hi, D, warmup in CASES:
    g = torch.Generator(device="cuda").manual_seed(S)
    tensors, p = problem_for(S, H, Hkv, Hi, D, warmup, g)
    q, k, index_q, index_k, lse, lse_index = tensors
    v = torch.randn_like(k)
    dout = torch.randn_like(q)
    delta = torch.randn(p.total, p.num_heads, device="cuda") * 0.01
    work = p.block_work
    all_orders = orders(work, Hi, p.total)
    reference = None
    times = {}
    for rnd in range(2):
        for label, order in all_orders.items():
            work.segment_order = order
            t_kl = bench(lambda: kl_key_walk(*tensors, p, True, True))
            t_dkdv = None if warmup else bench(lambda: attention_dkdv(q, k, v, dout, lse, delta, p))
            times.setdefault(label, []).append((t_kl, t_dkdv))
    for label, order in all_orders.items():
        work.segment_order = order
        dik, kl_rows, diq = kl_key_walk(*tensors, p, True, True)
        if reference is None:
            reference = (dik, kl_rows, diq)
        diff = [((a - b).abs().max() / b.abs().max()).item() for a, b in zip((dik, kl_rows, diq), reference)]
        best_kl = min(t[0] for t in times[label])
        best_dkdv = None if warmup else min(t[1] for t in times[label])
        row = dict(shape=name, S=S, warmup=warmup, order=label, kl_ms=best_kl, dkdv_ms=best_dkdv,
                   all=times[label], max_rel_diff=diff)
        print(json.dumps(row), flush=True)
        rows.append(row)
    del tensors, p, q, k, v, dout, work
    torch.cuda.empty_cache()
out = os.environ.get("OUT")
if out:
    json.dump(rows, open(os.path.join(out, "order.json"), "w"), indent=1)
