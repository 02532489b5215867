"""The KL's kernels alone (GPU only): the default one-pass key-outer kernel (atomic adds for
d index_q and the value) against ``deterministic=True``'s two walks, for sparse selections on
every selection kind and for warmup (every causal block kept).

    python benchmarks/bench_kl.py --out DIR [--sweep] [--kinds coherent,mid,random]

Per shape and kind: the query-side walk (value + d index_q), the key-outer kernel without its
query side (d index_k), their sum (the deterministic path), the one-pass kernel (all three), how
far the one-pass results lie from the deterministic ones (relative RMS; they differ by summation
order), and the value alone (no gradient wanted: evaluation under ``torch.no_grad``) two ways:
the query-side walk without its gradient, and building the key-block list plus the one-pass
kernel. The selection's neighbours' Jaccard and 8-token union are given beside the times.
``--sweep`` also times the one-pass kernel at 32/64/128 pairs per step and 1/2 pipeline stages.

    python benchmarks/bench_kl.py --out DIR --exp-split [--max-seqlen S]

times the Gluon kernel's two ways with its exponentials (``kl.sm90.SPLIT_EXPONENTIALS``: every
second head's on the FMA units, or all on the special function unit), alone and in a one-layer
training step next to dense SDPA's step in the same run, at short and long contexts on the
three selection kinds, and how far the results of the two settings lie apart.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import triton
import triton.testing

from openmsa.bench.selection import SELECTION_KINDS, index_inputs, selection_statistics
from openmsa.ops.attention import sparse_attention_fwd
from openmsa.ops.kl import kl_key_walk, kl_query_side
from openmsa.ops.kl import sm90 as kl_sm90
from openmsa.ops.layout import all_causal_block_ids, batch_cu_seqlens
from openmsa.ops.problem import SparseAttentionProblem, query_tile_shape
from openmsa.ops.worklists import build_causal_query_tile_work
from openmsa.ops.select import select_blocks_fwd
from openmsa.testing import rel_rms_error

SHAPES = [
    # (name, S, H, Hkv, Hi, D, warmup)
    ("H16/Hkv2/Hi4", 16384, 16, 2, 4, 128, False),
    ("H64/Hkv4/Hi4", 32768, 64, 4, 4, 128, False),
    ("H64/Hkv4/Hi4", 131072, 64, 4, 4, 128, False),
    ("H16/Hkv2/Hi4", 16384, 16, 2, 4, 128, True),
    ("H64/Hkv4/Hi4", 32768, 64, 4, 4, 128, True),
]


def bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")


def problem_for(seqlen, heads, kv_heads, index_heads, head_dim, warmup, kind, generator):
    q, k = (torch.randn(seqlen, h, head_dim, device="cuda", generator=generator).bfloat16()
            for h in (heads, kv_heads))
    v = torch.randn_like(k)
    index_q, index_k = index_inputs(kind, seqlen, index_heads, head_dim, generator)
    cu = batch_cu_seqlens(1, seqlen, "cuda")
    scale = head_dim ** -0.5
    query_work = None
    if warmup:
        ids = all_causal_block_ids(torch.arange(seqlen, device="cuda"), index_heads, 128, seqlen)
        query_work = build_causal_query_tile_work(
            cu, seqlen, index_heads, query_tile_shape(heads // index_heads)[0], 128,
            ids.shape[2])
    else:
        ids = select_blocks_fwd(index_q, index_k, cu, top_k=16, block_size=128,
                                index_softmax_scale=scale, num_local_blocks=1,
                                num_sink_blocks=0)
    def new_problem(work):
        return SparseAttentionProblem(q, k, ids, cu, 128, scale, index_k, scale,
                                      query_work=work, all_causal=warmup)

    problem = new_problem(query_work)
    _, lse, lse_index = sparse_attention_fwd(q, k, v, index_q, index_k, problem)
    tensors = (q, k, index_q, index_k, lse, lse_index)

    def fresh_problem():  # the same query work, no key-block list yet
        return new_problem(problem.query_work)

    problem.block_work  # built once, outside the timings
    return tensors, problem, fresh_problem, ids


def write_result(out: str, name: str, rows: list[dict]) -> dict:
    """The run's rows with the GPU and versions, written as ``out/name``."""
    result = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                  triton=triton.__version__, date=time.strftime("%Y-%m-%d"), rows=rows)
    with open(os.path.join(out, name), "w") as f:
        json.dump(result, f, indent=2)
    return result


# (name, S, H, Hkv, Hi): the exponentials' split where it matters, at short contexts and long.
EXP_SPLIT_SHAPES = [
    ("H64/Hkv4/Hi4", 4096, 64, 4, 4),
    ("H64/Hkv4/Hi4", 8192, 64, 4, 4),
    ("H16/Hkv2/Hi4", 8192, 16, 2, 4),
    ("H16/Hkv2/Hi4", 16384, 16, 2, 4),
    ("H64/Hkv4/Hi4", 32768, 64, 4, 4),
    ("H64/Hkv4/Hi4", 131072, 64, 4, 4),
]


def exp_split_main(args, kinds) -> None:
    from openmsa import msa_attention
    from openmsa.bench.run import dense_baseline, make_inputs
    from openmsa.bench.timing import median_ms

    settings = {"split": True, "unit": False}
    rows = []
    plan = [(shape, kind) for shape in EXP_SPLIT_SHAPES if shape[1] <= args.max_seqlen
            for kind in kinds]
    dense = {}
    for number, ((name, seqlen, heads, kv_heads, index_heads), kind) in enumerate(plan, 1):
        print(f"[{number}/{len(plan)}] {name} S={seqlen} {kind}", flush=True)
        generator = torch.Generator(device="cuda").manual_seed(seqlen)
        tensors, p, _, ids = problem_for(seqlen, heads, kv_heads, index_heads, 128, False,
                                         kind, generator)
        row = dict(shape=name, seqlen=seqlen, selection=kind, **selection_statistics(ids))
        results = {}
        for setting, split in settings.items():
            kl_sm90.SPLIT_EXPONENTIALS = split
            results[setting] = kl_key_walk(*tensors, p, True, True)
        row["split_vs_unit_rel_rms"] = dict(
            kl=rel_rms_error(p.kl_mean(results["split"][1]), p.kl_mean(results["unit"][1])),
            d_index_q=rel_rms_error(results["split"][2], results["unit"][2]),
            d_index_k=rel_rms_error(results["split"][0], results["unit"][0]))
        for round_ in range(2):  # interleaved: the machine's drift hits both settings
            for setting, split in settings.items():
                kl_sm90.SPLIT_EXPONENTIALS = split
                ms = bench(lambda: kl_key_walk(*tensors, p, True, True))
                row[f"kl_{setting}_ms"] = min(ms, row.get(f"kl_{setting}_ms", ms))
        del tensors, p, results
        inputs = make_inputs(dict(heads=heads, kv_heads=kv_heads, index_heads=index_heads,
                                  head_dim=128), seqlen, kind)
        dout = torch.randn_like(inputs[0])
        one = torch.ones((), device="cuda")

        def msa_step():
            out, kl = msa_attention(*inputs, top_k=16, block_size=128)
            torch.autograd.grad((out, kl), inputs, (dout, one))

        for setting, split in settings.items():
            kl_sm90.SPLIT_EXPONENTIALS = split
            row[f"step_{setting}_ms"] = median_ms(msa_step)
        kl_sm90.SPLIT_EXPONENTIALS = True
        key = (name, seqlen)
        if key not in dense:
            dense[key] = dense_baseline(*inputs[:3], dout, median_ms)
        row.update(dense[key])
        for setting in settings:
            if "dense_fwd_bwd_ms" in row:
                row[f"{setting}_vs_dense"] = row["dense_fwd_bwd_ms"] / row[f"step_{setting}_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
        del inputs, dout
        torch.cuda.empty_cache()
    result = write_result(args.out, "bench_kl_exp_split.json", rows)
    print(f"\nGluon KL kernel alone and the one-layer step (ms), {result['gpu']}, bf16, top 16 of "
          "128: split = every second head's exponentials on the FMA units, unit = all on the "
          "special function unit; dense = SDPA's step, same run")
    print(f"{'shape':>13} {'S':>7} {'selection':>9} {'Jacc':>5} {'union':>6} {'KL unit':>8} "
          f"{'KL split':>8} {'step unit':>9} {'step split':>10} {'dense':>8} {'x unit':>6} "
          f"{'x split':>7} {'rel rms':>8}")
    for r in rows:
        dense_ms = r.get("dense_fwd_bwd_ms", float("nan"))
        print(f"{r['shape']:>13} {r['seqlen']:>7} {r['selection']:>9} {r['jaccard']:>5.2f} "
              f"{r['union_8']:>6.1f} {r['kl_unit_ms']:>8.3f} {r['kl_split_ms']:>8.3f} "
              f"{r['step_unit_ms']:>9.2f} {r['step_split_ms']:>10.2f} {dense_ms:>8.1f} "
              f"{r.get('unit_vs_dense', float('nan')):>6.2f} "
              f"{r.get('split_vs_dense', float('nan')):>7.2f} "
              f"{max(r['split_vs_unit_rel_rms'].values()):>8.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--exp-split", action="store_true",
                        help="time the Gluon kernel's exponentials split against unsplit")
    parser.add_argument("--max-seqlen", type=int, default=131072)
    parser.add_argument("--kinds", default=",".join(SELECTION_KINDS),
                        help="selection kinds of the sparse shapes, comma-separated")
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    for kind in kinds:
        if kind not in SELECTION_KINDS:
            parser.error(f"--kinds: expected some of {SELECTION_KINDS}, received {kind!r}")
    os.makedirs(args.out, exist_ok=True)
    if args.exp_split:
        return exp_split_main(args, kinds)
    rows = []
    plan = [(shape, kind) for shape in SHAPES if shape[1] <= args.max_seqlen
            for kind in (["all causal"] if shape[6] else kinds)]
    for (name, seqlen, heads, kv_heads, index_heads, head_dim, warmup), kind in plan:
        generator = torch.Generator(device="cuda").manual_seed(seqlen)
        tensors, p, fresh_problem, ids = problem_for(
            seqlen, heads, kv_heads, index_heads, head_dim, warmup,
            "coherent" if warmup else kind, generator)
        row = dict(shape=name, seqlen=seqlen, warmup=warmup, selection=kind)
        if not warmup:
            row.update(selection_statistics(ids))  # ids: [S, Hi, k]
        row["value_query_side_ms"] = bench(lambda: kl_query_side(*tensors, p, True, False))

        def value_from_key_walk():
            kl_key_walk(*tensors, fresh_problem(), True, True)

        row["value_key_walk_ms"] = bench(value_from_key_walk)
        row["query_side_ms"] = bench(lambda: kl_query_side(*tensors, p, True, True))
        row["key_side_ms"] = bench(lambda: kl_key_walk(*tensors, p, False, False))
        row["deterministic_ms"] = row["query_side_ms"] + row["key_side_ms"]
        row["one_pass_ms"] = bench(lambda: kl_key_walk(*tensors, p, True, True))
        row["speedup"] = row["deterministic_ms"] / row["one_pass_ms"]
        rows_kl, d_index_q = kl_query_side(*tensors, p, True, True)
        d_index_k, _, _ = kl_key_walk(*tensors, p, False, False)
        fast_k, fast_rows, fast_q = kl_key_walk(*tensors, p, True, True)
        row["one_pass_vs_deterministic_rel_rms"] = dict(
            kl=rel_rms_error(p.kl_mean(fast_rows), p.kl_mean(rows_kl)),
            d_index_q=rel_rms_error(fast_q, d_index_q),
            d_index_k=rel_rms_error(fast_k, d_index_k))
        if args.sweep:
            row["sweep"] = {}
            for pairs in (32, 64, 128):
                for stages in (1, 2):
                    try:
                        ms = bench(lambda: kl_key_walk(*tensors, p, True, True, pairs=pairs,
                                                       num_stages=stages))
                    except Exception as error:  # out of shared memory or registers
                        ms = f"failed: {type(error).__name__}"
                    row["sweep"][f"pairs{pairs}_stages{stages}"] = ms
        rows.append(row)
        print(json.dumps(row), flush=True)
        del tensors, p
        torch.cuda.empty_cache()
    result = write_result(args.out, "bench_kl.json", rows)
    print(f"\nKL kernels, {result['gpu']}, bf16, top_k=16 block=128 (warmup: every causal "
          "block); value alone: query-side walk / key-block list + one-pass kernel")
    print(f"{'shape':>13} {'S':>7} {'selection':>10} {'Jacc':>5} {'union':>6} {'query ms':>9} "
          f"{'key ms':>8} {'determ. ms':>10} {'one-pass ms':>11} {'x':>5} "
          f"{'value q ms':>10} {'value k ms':>10}")
    for r in rows:
        jaccard = f"{r['jaccard']:.3f}" if "jaccard" in r else "-"
        union = f"{r['union_8']:.1f}" if "union_8" in r else "-"
        print(f"{r['shape']:>13} {r['seqlen']:>7} {r['selection']:>10} {jaccard:>5} "
              f"{union:>6} {r['query_side_ms']:>9.2f} {r['key_side_ms']:>8.2f} "
              f"{r['deterministic_ms']:>10.2f} {r['one_pass_ms']:>11.2f} {r['speedup']:>5.2f} "
              f"{r['value_query_side_ms']:>10.2f} {r['value_key_walk_ms']:>10.2f}")


if __name__ == "__main__":
    main()
