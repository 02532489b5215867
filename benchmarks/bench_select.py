"""Benchmark of the fused block-selection kernel against the plain PyTorch route (GPU only).

    python benchmarks/bench_select.py --out DIR [--seqlens 32768,131072,524288,1048576]

Effective TFLOP/s count 2 * Hi * Di FLOPs per causal (i, j) pair. The PyTorch route is what one
writes without a kernel: bf16 matmul, causal mask, block max-pool, torch.topk, chunked over
queries so that it fits in memory; it runs only up to --torch-max-seqlen. A sweep of kernel
configurations runs first at --tune-seqlen, and the best one is used for the sweep.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch
import triton
import triton.testing

from openmsa.bench.flops import index_scoring_flops
from openmsa.ops.layout import batch_cu_seqlens
from openmsa.ops.select import select_blocks_fwd


def torch_route(index_q, index_k, top_k, block_size, scale, chunk=8192):
    """Plain PyTorch selection for one sequence: [S, Hi, Di], [S, 1, Di] -> [Hi, S, top_k]."""
    seqlen, num_heads, _ = index_q.shape
    keys = index_k[:, 0].T  # [Di, S]
    out = torch.empty(num_heads, seqlen, top_k, dtype=torch.int64, device=index_q.device)
    for start in range(0, seqlen, chunk):
        end = min(start + chunk, seqlen)
        z = (index_q[start:end].transpose(0, 1) @ keys[:, :end]) * scale  # [Hi, C, end]
        pos = torch.arange(start, end, device=z.device)
        z = z.masked_fill(torch.arange(end, device=z.device)[None, :] > pos[:, None],
                          float("-inf"))
        pad = -(-end // block_size) * block_size - end
        z = torch.nn.functional.pad(z, (0, pad), value=float("-inf"))
        blocks = z.view(num_heads, end - start, -1, block_size).amax(-1)
        k = min(top_k, blocks.shape[-1])
        out[:, start:end, :k] = blocks.topk(k, dim=-1).indices
    return out


def bench(fn, reps=5):
    return triton.testing.do_bench(fn, warmup=1, rep=reps, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help="folder for results.json")
    parser.add_argument("--seqlens", default="32768,131072,524288,1048576")
    parser.add_argument("--heads", type=int, default=4, help="index heads Hi (Hik = 1)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=16)
    parser.add_argument("--tune-seqlen", type=int, default=131072)
    parser.add_argument("--torch-max-seqlen", type=int, default=131072)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda")
    scale = args.head_dim ** -0.5
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "triton": triton.__version__, "python": platform.python_version(),
               "date": time.strftime("%Y-%m-%d"), "args": vars(args), "tuning": [], "rows": []}

    def make_inputs(seqlen):
        generator = torch.Generator(device=device).manual_seed(seqlen)
        index_q = torch.randn(seqlen, args.heads, args.head_dim, device=device,
                              generator=generator, dtype=torch.bfloat16)
        index_k = torch.randn(seqlen, 1, args.head_dim, device=device, generator=generator,
                              dtype=torch.bfloat16)
        return index_q, index_k, batch_cu_seqlens(1, seqlen, device)

    def run_kernel(index_q, index_k, cu, **config):
        return select_blocks_fwd(index_q, index_k, cu, top_k=args.top_k,
                                 block_size=args.block_size, index_softmax_scale=scale,
                                 num_local_blocks=1, num_sink_blocks=0, **config)

    # 1. Configuration sweep.
    index_q, index_k, cu = make_inputs(args.tune_seqlen)
    flops = index_scoring_flops(args.tune_seqlen, args.heads, args.head_dim)
    best = None
    for tile_rows in (64, 128, 256):
        for num_warps in (4, 8):
            for num_stages in (2, 3):
                config = dict(tile_rows=tile_rows, num_warps=num_warps, num_stages=num_stages)
                try:
                    ms = bench(lambda: run_kernel(index_q, index_k, cu, **config))
                except Exception as error:  # a config can exceed shared memory or registers
                    print(f"config {config} failed: {type(error).__name__}: {error}"[:200])
                    continue
                tflops = flops / ms / 1e9
                results["tuning"].append(dict(config, ms=ms, tflops=tflops))
                print(f"tune S={args.tune_seqlen} {config}: {ms:.2f} ms {tflops:.0f} TFLOP/s",
                      flush=True)
                if best is None or ms < best[1]:
                    best = (config, ms)
    config = best[0]
    results["best_config"] = config
    del index_q, index_k

    # 2. Sweep over sequence lengths with the best configuration.
    for seqlen in [int(s) for s in args.seqlens.split(",")]:
        index_q, index_k, cu = make_inputs(seqlen)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ids = run_kernel(index_q, index_k, cu, **config)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        reps = 3 if seqlen >= 524288 else 10
        ms = bench(lambda: run_kernel(index_q, index_k, cu, **config), reps=reps * 20)
        ms_again = bench(lambda: run_kernel(index_q, index_k, cu, **config), reps=reps * 20)
        flops = index_scoring_flops(seqlen, args.heads, args.head_dim)
        row = dict(seqlen=seqlen, kernel_ms=ms, kernel_ms_repeat=ms_again,
                   kernel_tflops=flops / ms / 1e9, extra_memory_bytes=extra,
                   ids_bytes=ids.numel() * ids.element_size())
        if seqlen <= args.torch_max_seqlen:
            torch_ms = bench(lambda: torch_route(index_q, index_k, args.top_k, args.block_size,
                                                 scale), reps=reps * 20)
            row.update(torch_ms=torch_ms, speedup_vs_torch=torch_ms / ms)
        results["rows"].append(row)
        print(json.dumps(row), flush=True)
        del index_q, index_k, ids

    with open(os.path.join(args.out, "bench_select.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(f"\nselection kernel, {results['gpu']}, bf16, Hi={args.heads} Hik=1 "
          f"Di={args.head_dim} block={args.block_size} top_k={args.top_k}, config {config}")
    print(f"{'S':>8} {'kernel ms':>10} {'TFLOP/s':>8} {'torch ms':>9} {'speedup':>8} "
          f"{'extra MiB':>9}")
    for row in results["rows"]:
        torch_ms = f"{row['torch_ms']:.1f}" if "torch_ms" in row else "-"
        speedup = f"{row['speedup_vs_torch']:.1f}x" if "torch_ms" in row else "-"
        print(f"{row['seqlen']:>8} {row['kernel_ms']:>10.2f} {row['kernel_tflops']:>8.0f} "
              f"{torch_ms:>9} {speedup:>8} {row['extra_memory_bytes'] / 2**20:>9.1f}")


if __name__ == "__main__":
    main()
