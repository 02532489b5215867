"""Benchmark of the sparse main attention (forward, backward) against dense SDPA (GPU only).

    python benchmarks/bench_attention.py --out DIR

For each shape, kept blocks come from the selection kernel on two kinds of index inputs:
"random" (independent random index queries: consecutive tokens pick unrelated blocks) and
"coherent" (index queries drift slowly along the sequence, as a trained index branch's would,
so neighbouring tokens pick similar blocks). For both it reports the union of kept blocks over
8 consecutive tokens (what a query-outer kernel that packs 8 tokens would have to walk), then
times the kernels. Effective TFLOP/s count 4 * D FLOPs per kept (query, key, main head) triple
for the forward and 2.5x that for the backward; dense SDPA (PyTorch's default backend, cuDNN on
an H200) counts the causal triangle the same way, in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
import triton

from openmsa.bench.flops import kept_triples
from openmsa.bench.selection import index_inputs
from openmsa.bench.timing import kernel_times, median_ms
from openmsa.ops import sm90
from openmsa.ops.attention import (attention_backward, attention_delta, attention_dkdv,
                                   attention_dq, sparse_attention_fwd)
from openmsa.ops.kl import kl_key_walk, kl_query_side
from openmsa.ops.layout import batch_cu_seqlens
from openmsa.ops.problem import SparseAttentionProblem
from openmsa.ops.select import select_blocks_fwd

SHAPES = [
    # (name, S, H, Hkv, Hi, D)
    ("H16/Hkv2/Hi4", 16384, 16, 2, 4, 128),
    ("H16/Hkv2/Hi4", 32768, 16, 2, 4, 128),
    ("H64/Hkv4/Hi4", 32768, 64, 4, 4, 128),
    ("H64/Hkv4/Hi4", 131072, 64, 4, 4, 128),
]


def union_blocks(ids, tokens=8):
    """Mean number of distinct blocks kept by `tokens` consecutive tokens (per index head)."""
    seqlen, num_index_heads, top_k = ids.shape
    usable = seqlen // tokens * tokens
    grouped = ids[:usable].view(-1, tokens, num_index_heads, top_k).permute(0, 2, 1, 3)
    grouped = grouped.reshape(-1, tokens * top_k).sort(dim=-1).values
    distinct = (grouped[:, 1:] != grouped[:, :-1]) & (grouped[:, 1:] >= 0)
    return (distinct.sum(-1) + (grouped[:, 0] >= 0)).float().mean().item()


def tune(args, seqlen=32768, heads=64, kv_heads=4, index_heads=4, head_dim=128):
    """Sweeps tile rows x warps x pipeline stages for each kernel (coherent selection), the
    KL's kernels included."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(seqlen, h, head_dim, device="cuda", generator=generator).bfloat16()
               for h in (heads, kv_heads, kv_heads))
    dout = torch.randn_like(q)
    cu = batch_cu_seqlens(1, seqlen, "cuda")
    index_q, index_k = index_inputs("coherent", seqlen, index_heads, head_dim, generator)
    ids = select_blocks_fwd(index_q, index_k, cu, top_k=args.top_k, block_size=args.block_size,
                            index_softmax_scale=head_dim ** -0.5, num_local_blocks=1,
                            num_sink_blocks=0)
    scale = head_dim ** -0.5
    base = SparseAttentionProblem(q, k, ids, cu, args.block_size, scale)
    out, lse, _ = sparse_attention_fwd(q, k, v, None, None, base)
    delta = attention_delta(out, dout, base)
    sweep, best = [], {}

    def record(kernel, config, fn):
        try:
            ms = bench(fn)
        except Exception as error:  # out of shared memory or registers
            print(f"{kernel} {config} failed: {type(error).__name__}"[:200], flush=True)
            return
        sweep.append(dict(config, kernel=kernel, ms=ms))
        print(f"tune S={seqlen} H{heads} coherent {kernel} {config}: {ms:.2f} ms", flush=True)
        if kernel not in best or ms < best[kernel][1]:
            best[kernel] = (config, ms)

    index_scale = head_dim ** -0.5
    with_index = SparseAttentionProblem(q, k, ids, cu, args.block_size, scale, index_k,
                                        index_scale)
    _, _, lse_index = sparse_attention_fwd(q, k, v, index_q, index_k, with_index)
    for rows in (64, 128):
        tiles = dict(query_rows=rows, key_rows=rows)
        main_only = SparseAttentionProblem(q, k, ids, cu, args.block_size, scale, **tiles)
        problem = SparseAttentionProblem(q, k, ids, cu, args.block_size, scale, index_k,
                                         index_scale, **tiles)
        for num_warps in (8,):  # 4 warps: 1.3-4x slower in every kernel (earlier sweep)
            for num_stages in (1, 2):
                config = dict(rows=rows, num_warps=num_warps, num_stages=num_stages)
                # The Triton kernels' configurations (not the Hopper kernels').
                launch = dict(num_warps=num_warps, num_stages=num_stages)
                triton_launch = dict(launch, use_hopper=False)
                record("fwd+index", config, lambda: sparse_attention_fwd(
                    q, k, v, index_q, index_k, problem, **triton_launch))
                record("kl_query", config, lambda: kl_query_side(
                    q, k, index_q, index_k, lse, lse_index, problem, True, True, **launch))
                record("kl_one_pass", config, lambda: kl_key_walk(
                    q, k, index_q, index_k, lse, lse_index, problem, True, True, **launch))
                record("fwd", config, lambda: sparse_attention_fwd(q, k, v, None, None,
                                                                   main_only, **triton_launch))
                record("dq", config, lambda: attention_dq(q, k, v, dout, lse, delta, main_only,
                                                          **triton_launch))
                record("dkdv", config, lambda: attention_dkdv(q, k, v, dout, lse, delta,
                                                              main_only, **triton_launch))
    return {kernel: config for kernel, (config, _) in best.items()}, sweep


bench = median_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--top-k", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--max-seqlen", type=int, default=131072)
    parser.add_argument("--min-seqlen", type=int, default=0, help="skip shorter shapes")
    parser.add_argument("--kinds", default="random,coherent",
                        help="which selections to run (their inputs stay those of a full run; "
                             "a case runs after the ones before it, in the GPU's power state "
                             "they leave)")
    parser.add_argument("--sweep", action="store_true",
                        help="first sweep tile rows x warps x stages per kernel at S=32k")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    best_configs, sweep = tune(args) if args.sweep else ({}, [])
    for name, seqlen, heads, kv_heads, index_heads, head_dim in SHAPES:
        if not args.min_seqlen <= seqlen <= args.max_seqlen:
            continue
        generator = torch.Generator(device="cuda").manual_seed(seqlen + heads)
        q = torch.randn(seqlen, heads, head_dim, device="cuda", generator=generator).bfloat16()
        k = torch.randn(seqlen, kv_heads, head_dim, device="cuda",
                        generator=generator).bfloat16()
        v = torch.randn(seqlen, kv_heads, head_dim, device="cuda",
                        generator=generator).bfloat16()
        dout = torch.randn_like(q)
        cu = batch_cu_seqlens(1, seqlen, "cuda")
        scale = head_dim ** -0.5

        # Dense SDPA baseline, same run, [B, H, S, D] layout.
        qd, kd, vd = (t.transpose(0, 1)[None].contiguous().requires_grad_() for t in (q, k, v))
        dense_out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)
        dense_fwd = bench(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True,
                                                                 enable_gqa=True))
        dense_bwd = bench(lambda: torch.autograd.grad(dense_out, (qd, kd, vd),
                                                      dout.transpose(0, 1)[None],
                                                      retain_graph=True))
        dense_flops = 4.0 * heads * head_dim * seqlen * (seqlen + 1) / 2
        del qd, kd, vd, dense_out

        for kind in ("random", "coherent"):
            # Drawn for every kind, run or not: the generator's state, and so each case's
            # inputs, do not depend on --kinds.
            index_q, index_k = index_inputs(kind, seqlen, index_heads, head_dim, generator)
            if kind not in args.kinds.split(","):
                continue
            ids = select_blocks_fwd(index_q, index_k, cu, top_k=args.top_k,
                                    block_size=args.block_size, index_softmax_scale=scale,
                                    num_local_blocks=1, num_sink_blocks=0)
            triples = kept_triples(ids, args.block_size, heads // index_heads)
            union = union_blocks(ids)
            # Both work lists (the key-block one is built lazily, on the first backward).
            build_ms = bench(lambda: SparseAttentionProblem(q, k, ids, cu, args.block_size,
                                                            scale).block_work)
            problem = SparseAttentionProblem(q, k, ids, cu, args.block_size, scale)
            fwd_ms = bench(lambda: sparse_attention_fwd(q, k, v, None, None, problem))
            out, lse, _ = sparse_attention_fwd(q, k, v, None, None, problem)
            bwd_ms = bench(lambda: attention_backward(q, k, v, out, dout, lse, problem))
            fwd_again = bench(lambda: sparse_attention_fwd(q, k, v, None, None, problem))
            # The Triton forward in the same run (the default is the Hopper kernel, where the
            # GPU and inputs allow it; openmsa/ops/attention/sm90_forward.py).
            fwd_triton = bench(lambda: sparse_attention_fwd(q, k, v, None, None, problem,
                                                            use_hopper=False))
            bwd_triton = bench(lambda: attention_backward(q, k, v, out, dout, lse, problem,
                                                          use_hopper=False))
            flops = 4.0 * head_dim * triples
            row = dict(shape=name, seqlen=seqlen, selection=kind, union_of_8_tokens=union,
                       csr_ms=build_ms, fwd_ms=fwd_ms, fwd_ms_repeat=fwd_again, bwd_ms=bwd_ms,
                       fwd_kernel="hopper" if sm90.supported(q, k, v, problem) else "triton",
                       fwd_triton_ms=fwd_triton, bwd_triton_ms=bwd_triton,
                       fwd_tflops=flops / fwd_ms / 1e9, bwd_tflops=2.5 * flops / bwd_ms / 1e9,
                       dense_fwd_ms=dense_fwd, dense_bwd_ms=dense_bwd,
                       dense_fwd_tflops=dense_flops / dense_fwd / 1e9,
                       dense_bwd_tflops=2.5 * dense_flops / dense_bwd / 1e9,
                       speedup_fwd=dense_fwd / (fwd_ms + build_ms),
                       speedup_bwd=dense_bwd / bwd_ms,
                       peak_gib=torch.cuda.max_memory_allocated() / 2**30)
            row["bwd_kernels_ms"] = kernel_times(
                lambda: attention_backward(q, k, v, out, dout, lse, problem))
            counts = problem.block_work.bucket_count.float()
            row["pairs_per_key_block_max_over_mean"] = (counts.max() / counts.mean()).item()
            row["build_kernels_ms"] = kernel_times(
                lambda: SparseAttentionProblem(q, k, ids, cu, args.block_size, scale).block_work)
            rows.append(row)
            print(json.dumps(row), flush=True)
            del out, lse, problem, ids, index_q, index_k
            torch.cuda.empty_cache()
        del q, k, v, dout
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    result = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                  triton=triton.__version__, date=time.strftime("%Y-%m-%d"), args=vars(args),
                  sweep=sweep, best_configs=best_configs, rows=rows)
    with open(os.path.join(args.out, "bench_attention.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nsparse attention, {result['gpu']}, bf16, top_k={args.top_k} "
          f"block={args.block_size}; TFLOP/s on kept pairs; speedups vs dense SDPA same run")
    print(f"{'shape':>13} {'S':>7} {'select':>8} {'union8':>6} {'csr':>6} {'fwd ms':>7} "
          f"{'TF/s':>5} {'(triton)':>8} {'bwd ms':>7} {'TF/s':>5} {'(triton)':>8} "
          f"{'dense f/b ms':>14} "
          f"{'x fwd':>6} {'x bwd':>6}")
    for r in rows:
        print(f"{r['shape']:>13} {r['seqlen']:>7} {r['selection']:>8} "
              f"{r['union_of_8_tokens']:>6.1f} {r['csr_ms']:>6.2f} {r['fwd_ms']:>7.2f} "
              f"{r['fwd_tflops']:>5.0f} {r['fwd_triton_ms']:>8.2f} {r['bwd_ms']:>7.2f} "
              f"{r['bwd_tflops']:>5.0f} {r['bwd_triton_ms']:>8.2f} "
              f"{r['dense_fwd_ms']:>6.1f}/{r['dense_bwd_ms']:>7.1f} {r['speedup_fwd']:>6.1f} "
              f"{r['speedup_bwd']:>6.1f}")


if __name__ == "__main__":
    main()
