"""Benchmark of the fused block-selection kernel against the plain PyTorch route (GPU only).

    python benchmarks/bench_select.py --out DIR [--seqlens 131072,524288,1048576]
        [--precisions input,fp8,fp8-64] [--kinds coherent,mid,random] [--tune fp8]
        [--num-local-blocks 1] [--local-block-dilation 1]

Effective TFLOP/s count 2 * Hi * Di FLOPs per causal (i, j) pair, in either precision. Both
index precisions run on the same bf16 inputs; fp8's time includes its quantization pass, which
is also timed alone (quant ms: quantize_rows_e4m3_fused). "fp8-64" (any number) is the fp8 kernel
summing that many products on the tensor cores before each fp32 add (``imprecise_acc``); each fp8
row also gives the share of sampled rows whose kept set is the fp32 reference's (SPEC section 8's
bar: 99.5%). The PyTorch route is what one writes without a kernel: bf16
matmul, causal mask, block max-pool, torch.topk, chunked over queries so that it fits in memory;
it runs only up to --torch-max-seqlen. With --tune, a sweep of kernel configurations runs first
at --tune-seqlen, and the best one is used (configs.SELECT_CONFIG holds the chosen ones).
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
from openmsa.bench.selection import index_inputs
from openmsa.ops.configs import SELECT_CONFIG
from openmsa.ops.layout import batch_cu_seqlens
from openmsa.ops.quantize import quantize_rows_e4m3_fused
from openmsa.ops.select import select_blocks_fwd
from openmsa.testing import same_block_sets
from bench_fp8_index import reference_rows, sampled_positions


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


SWEEP = {
    "input": [dict(tile_rows=rows, num_warps=warps, num_stages=stages)
              for rows in (64, 128, 256) for warps in (4, 8) for stages in (2, 3, 4)],
    # fp8 also sweeps the tensor cores' accumulation (configs.SELECT_CONFIG): the fastest
    # configuration whose selection agrees with the fp32 reference on >= 99.5% of sampled rows
    # wins (the most accurate if none does).
    "fp8": [dict(tile_rows=rows, num_warps=warps, num_stages=stages, imprecise_acc=acc)
            for rows, warps, stages in ((128, 4, 2), (128, 4, 3), (128, 8, 2), (256, 8, 3))
            for acc in (None, 64, 32)],
}
AGREEMENT_BAR = 0.995
TUNE_SAMPLES = 512
REFERENCE_CHUNK = 64  # sampled queries scored at once by the reference (fp32 [64, Hi, S])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help="folder for bench_select.json")
    parser.add_argument("--seqlens", default="131072,524288,1048576")
    parser.add_argument("--precisions", default="input,fp8",
                        help="index precisions to time: input, fp8, fp8-N (fp8 with "
                        "imprecise_acc N)")
    parser.add_argument("--kinds", default="coherent,mid,random",
                        help="selection kinds (openmsa.bench.selection)")
    parser.add_argument("--heads", type=int, default=4, help="index heads Hi (Hik = 1)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=16)
    parser.add_argument("--num-local-blocks", type=int, default=1)
    parser.add_argument("--local-block-dilation", type=int, default=1,
                        help="spacing of the forced local blocks (SPEC section 3 step 3)")
    parser.add_argument("--tune", default="",
                        help="precisions whose kernel configurations to sweep at --tune-seqlen "
                        "first (the best is then used), e.g. fp8")
    parser.add_argument("--tune-seqlen", type=int, default=131072)
    parser.add_argument("--torch-max-seqlen", type=int, default=131072,
                        help="time the PyTorch route (input precision) up to this length")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda")
    scale = args.head_dim ** -0.5
    precisions = args.precisions.split(",")
    kinds = args.kinds.split(",")
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "triton": triton.__version__, "python": platform.python_version(),
               "date": time.strftime("%Y-%m-%d"), "args": vars(args), "tuning": [], "rows": []}

    def make_inputs(seqlen, kind):
        generator = torch.Generator(device=device).manual_seed(seqlen)
        index_q, index_k = index_inputs(kind, seqlen, args.heads, args.head_dim, generator,
                                        device)
        return index_q, index_k, batch_cu_seqlens(1, seqlen, device)

    def run_kernel(index_q, index_k, cu, variant, **config):
        return select_blocks_fwd(index_q, index_k, cu, top_k=args.top_k,
                                 block_size=args.block_size, index_softmax_scale=scale,
                                 num_local_blocks=args.num_local_blocks, num_sink_blocks=0,
                                 local_block_dilation=args.local_block_dilation,
                                 index_precision=variant.partition("-")[0], **config)

    def reference_agreement(ids, index_q, index_k, seqlen):
        generator = torch.Generator(device=device).manual_seed(1)
        positions = sampled_positions(seqlen, TUNE_SAMPLES, generator)
        reference = torch.cat([reference_rows(index_q, index_k, chunk, "fp8", args.top_k,
                                              args.block_size, args.num_local_blocks,
                                              args.local_block_dilation)
                               for chunk in positions.split(REFERENCE_CHUNK)])
        return same_block_sets(ids[positions], reference).float().mean().item()

    # 1. Configuration sweeps.
    configs = {precision: dict(SELECT_CONFIG[precision]) for precision in SELECT_CONFIG}
    for precision in filter(None, args.tune.split(",")):
        index_q, index_k, cu = make_inputs(args.tune_seqlen, kinds[0])
        flops = index_scoring_flops(args.tune_seqlen, args.heads, args.head_dim)
        generator = torch.Generator(device=device).manual_seed(1)
        positions = sampled_positions(args.tune_seqlen, TUNE_SAMPLES, generator)
        reference = reference_rows(index_q, index_k, positions, precision, args.top_k,
                                   args.block_size, args.num_local_blocks,
                                   args.local_block_dilation)
        tried = []
        for config in SWEEP[precision]:
            try:
                ids = run_kernel(index_q, index_k, cu, precision, **config)
                ms = bench(lambda: run_kernel(index_q, index_k, cu, precision, **config),
                           reps=100)
            except Exception as error:  # a config can exceed shared memory or registers
                print(f"{precision} config {config} failed: {type(error).__name__}: {error}"
                      [:200])
                continue
            agrees = same_block_sets(ids[positions], reference).float().mean().item()
            tflops = flops / ms / 1e9
            tried.append(dict(config, precision=precision, ms=ms, tflops=tflops,
                              reference_agreement=agrees))
            print(f"tune {precision} S={args.tune_seqlen} {config}: {ms:.2f} ms "
                  f"{tflops:.0f} TFLOP/s, {100 * agrees:.2f}% rows as the fp32 reference",
                  flush=True)
        results["tuning"] += tried
        if not tried:
            raise SystemExit(f"every {precision} configuration failed to run")
        passing = [t for t in tried if t["reference_agreement"] >= AGREEMENT_BAR]
        best = (min(passing, key=lambda t: t["ms"]) if passing
                else max(tried, key=lambda t: t["reference_agreement"]))
        configs[precision] = {key: best[key] for key in SWEEP[precision][0]}
    results["configs"] = configs

    # 2. Sequence lengths x selection kinds x precisions, same inputs for both precisions.
    for seqlen in [int(s) for s in args.seqlens.split(",")]:
        for kind in kinds:
            index_q, index_k, cu = make_inputs(seqlen, kind)
            flops = index_scoring_flops(seqlen, args.heads, args.head_dim)
            reps = 3 if seqlen >= 524288 else 10
            times = {}
            for precision in precisions:
                family, _, imprecise_acc = precision.partition("-")  # fp8-64: imprecise_acc 64
                config = configs[family]
                if imprecise_acc:
                    config = dict(config, imprecise_acc=int(imprecise_acc))
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                ids = run_kernel(index_q, index_k, cu, precision, **config)
                torch.cuda.synchronize()
                extra = torch.cuda.max_memory_allocated() - base
                ms = bench(lambda: run_kernel(index_q, index_k, cu, precision, **config),
                           reps=reps * 20)
                times[precision] = ms
                row = dict(seqlen=seqlen, selection=kind, precision=precision, config=config,
                           kernel_ms=ms, kernel_tflops=flops / ms / 1e9,
                           extra_memory_bytes=extra, ids_bytes=ids.numel() * ids.element_size())
                if precision.startswith("fp8"):
                    row["reference_agreement"] = reference_agreement(ids, index_q, index_k, seqlen)
                    row["quantize_ms"] = bench(lambda: (quantize_rows_e4m3_fused(index_q),
                                                        quantize_rows_e4m3_fused(index_k)))
                    if "input" in times:
                        row["speedup_vs_input"] = times["input"] / ms
                if precision == "input" and seqlen <= args.torch_max_seqlen:
                    torch_ms = bench(lambda: torch_route(index_q, index_k, args.top_k,
                                                         args.block_size, scale), reps=reps * 20)
                    row.update(torch_ms=torch_ms, speedup_vs_torch=torch_ms / ms)
                results["rows"].append(row)
                print(json.dumps(row), flush=True)
                del ids

    with open(os.path.join(args.out, "bench_select.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(f"\nselection kernel, {results['gpu']}, bf16 inputs, Hi={args.heads} Hik=1 "
          f"Di={args.head_dim} block={args.block_size} top_k={args.top_k}, configs {configs}")
    print(f"{'S':>8} {'selection':>9} {'precision':>10} {'kernel ms':>10} {'TFLOP/s':>8} "
          f"{'quant ms':>8} {'x input':>8} {'agree %':>8} {'torch ms':>9} {'extra MiB':>9}")
    for row in results["rows"]:
        def cell(key, fmt):
            return fmt.format(row[key]) if key in row else "-"

        agree = f"{100 * row['reference_agreement']:.2f}" if "reference_agreement" in row else "-"
        print(f"{row['seqlen']:>8} {row['selection']:>9} {row['precision']:>10} "
              f"{row['kernel_ms']:>10.2f} {row['kernel_tflops']:>8.0f} "
              f"{cell('quantize_ms', '{:.2f}'):>8} {cell('speedup_vs_input', '{:.2f}x'):>8} "
              f"{agree:>8} "
              f"{cell('torch_ms', '{:.1f}'):>9} {row['extra_memory_bytes'] / 2**20:>9.1f}")


if __name__ == "__main__":
    main()
