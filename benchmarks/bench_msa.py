"""One MSA layer's training step (fwd + bwd: selection, sparse attention, KL) vs dense SDPA.

    python benchmarks/bench_msa.py --out DIR

Times ``msa_attention`` forward and forward+backward (autograd, upstream gradients on out and
kl) with the exact KL value and with ``kl_value=False``, and PyTorch SDPA (cuDNN on an H200)
dense causal attention forward+backward on the same q, k, v in the same run. Index inputs are
"coherent" (neighbouring tokens keep similar blocks, like a trained index branch) or "random"
(see bench_attention.py), the step with ``deterministic=True`` (the KL in two ordered walks
instead of one pass with atomic adds), and the step replayed from a CUDA graph (its GPU time
without the host's launch costs). Up to --warmup-max-seqlen it also times a warmup step
(dense main attention on cuDNN, the KL kernel with every causal block kept) against dense, and
the same step with ``deterministic=True`` (main attention and KL on the ordered Triton path).
"triton" is the step with the Hopper (Gluon) kernels switched off, in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
import triton

from bench_attention import kernel_times
from openmsa.bench.selection import index_inputs
from openmsa.bench.timing import graphed, median_ms
from openmsa import msa_attention
from openmsa.ops import sm90

SHAPES = [
    # (name, S, H, Hkv, Hi, D)
    ("H16/Hkv2/Hi4", 16384, 16, 2, 4, 128),
    ("H64/Hkv4/Hi4", 32768, 64, 4, 4, 128),
    ("H64/Hkv4/Hi4", 131072, 64, 4, 4, 128),
]


bench = median_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--kinds", default="coherent,random")
    parser.add_argument("--max-seqlen", type=int, default=131072, help="skip longer shapes")
    parser.add_argument("--warmup-max-seqlen", type=int, default=32768,
                        help="also time warmup steps (dense + KL over the prefix) up to this S")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for name, seqlen, heads, kv_heads, index_heads, head_dim in SHAPES:
        if seqlen > args.max_seqlen:
            continue
        generator = torch.Generator(device="cuda").manual_seed(seqlen)
        q, k, v = (torch.randn(1, seqlen, h, head_dim, device="cuda", generator=generator)
                   .bfloat16().requires_grad_() for h in (heads, kv_heads, kv_heads))
        dout = torch.randn_like(q)
        qd, kd, vd = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
        doutd = dout.transpose(1, 2).contiguous()

        def dense_step():
            out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)
            torch.autograd.grad(out, (qd, kd, vd), doutd)

        dense_ms = bench(dense_step)
        dense_kernels = kernel_times(dense_step)
        for kind in args.kinds.split(","):
            index_q, index_k = index_inputs(kind, seqlen, index_heads, head_dim, generator)
            index_q = index_q[None].requires_grad_()
            index_k = index_k[None].requires_grad_()
            inputs = (q, k, v, index_q, index_k)
            one = torch.ones((), device="cuda")

            def step(kl_value, deterministic=False):
                out, kl = msa_attention(*inputs, top_k=16, block_size=128, kl_value=kl_value,
                                        deterministic=deterministic)
                torch.autograd.grad((out, kl), inputs, (dout, one))

            def forward():
                with torch.no_grad():
                    msa_attention(*inputs, top_k=16, block_size=128)

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step(True)
            torch.cuda.synchronize()
            extra_gib = (torch.cuda.max_memory_allocated() - base) / 2**30
            row = dict(shape=name, seqlen=seqlen, selection=kind, dense_step_ms=dense_ms,
                       dense_kernels_ms=dense_kernels,
                       forward_ms=bench(forward), step_ms=bench(lambda: step(True)),
                       step_no_kl_value_ms=bench(lambda: step(False)),
                       step_deterministic_ms=bench(lambda: step(True, deterministic=True)),
                       step_extra_memory_gib=extra_gib)
            with sm90.disabled():
                row["step_triton_kernels_ms"] = bench(lambda: step(True))
            if seqlen <= args.warmup_max_seqlen and kind == args.kinds.split(",")[0]:
                def warmup_step(deterministic):
                    out, kl = msa_attention(*inputs, top_k=16, block_size=128, warmup=True,
                                            deterministic=deterministic)
                    torch.autograd.grad((out, kl), inputs, (dout, one))

                # Warmup's main attention runs on cuDNN, or on the Triton kernels with
                # deterministic=True.
                row["warmup_step_ms"] = bench(lambda: warmup_step(False))
                row["warmup_vs_dense"] = row["warmup_step_ms"] / dense_ms
                row["warmup_triton_step_ms"] = bench(lambda: warmup_step(True))
                row["warmup_kernels_ms"] = kernel_times(lambda: warmup_step(False))
            row["step_kernels_ms"] = kernel_times(lambda: step(True))
            row["step_cuda_graph_ms"] = bench(graphed(lambda: step(True)))
            row["speedup"] = dense_ms / row["step_ms"]
            row["speedup_no_kl_value"] = dense_ms / row["step_no_kl_value_ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)
        del q, k, v, qd, kd, vd, dout, doutd
        torch.cuda.empty_cache()

    result = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                  triton=triton.__version__, date=time.strftime("%Y-%m-%d"), rows=rows)
    with open(os.path.join(args.out, "bench_msa.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nMSA layer training step (fwd+bwd, selection + attention + KL), {result['gpu']}, bf16, "
          "top_k=16 block=128; dense = SDPA causal fwd+bwd, same run")
    print(f"{'shape':>13} {'S':>7} {'select':>8} {'fwd ms':>8} {'step ms':>8} {'no-value':>8} "
          f"{'determ.':>8} {'graph':>8} {'triton':>8} {'dense ms':>9} {'x':>6} {'x no-value':>10} "
          f"{'extra GiB':>9}")
    for r in rows:
        print(f"{r['shape']:>13} {r['seqlen']:>7} {r['selection']:>8} {r['forward_ms']:>8.2f} "
              f"{r['step_ms']:>8.2f} {r['step_no_kl_value_ms']:>8.2f} "
              f"{r['step_deterministic_ms']:>8.2f} {r['step_cuda_graph_ms']:>8.2f} "
              f"{r['step_triton_kernels_ms']:>8.2f} "
              f"{r['dense_step_ms']:>9.2f} "
              f"{r['speedup']:>6.2f} {r['speedup_no_kl_value']:>10.2f} "
              f"{r['step_extra_memory_gib']:>9.2f}"
              + (f"  warmup {r['warmup_step_ms']:.1f} ms = {r['warmup_vs_dense']:.2f}x dense"
                 f" (deterministic: {r['warmup_triton_step_ms']:.1f} ms)"
                 if "warmup_step_ms" in r else ""))


if __name__ == "__main__":
    main()
