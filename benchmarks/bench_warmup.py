"""A warmup step against the dense step, measured alternately in one run (GPU only).

    python benchmarks/bench_warmup.py --out DIR [--rounds 6]

The dense SDPA step's wall time varies by ~10% between runs while its kernels do not, so one
pair of measurements can land on either side of a ratio. This times the dense step (SDPA causal
fwd+bwd) and an ``msa_attention(warmup=True)`` step (fwd+bwd, upstream gradients on out and
kl) alternately, ``--rounds`` times each, at S = 32k, H64/Hkv4/Hi4, D = Di = 128, and reports
every pair's ratio and the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F
import triton
import triton.testing

from openmsa import msa_attention
from openmsa.bench.selection import index_inputs


def bench(fn):
    return triton.testing.do_bench(fn, warmup=100, rep=1000, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seqlen", type=int, default=32768)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    heads, kv_heads, index_heads, head_dim = 64, 4, 4, 128
    generator = torch.Generator(device="cuda").manual_seed(args.seqlen)
    q, k, v = (torch.randn(1, args.seqlen, h, head_dim, device="cuda", generator=generator)
               .bfloat16().requires_grad_() for h in (heads, kv_heads, kv_heads))
    index_q, index_k = (t[None].requires_grad_() for t in index_inputs(
        "coherent", args.seqlen, index_heads, head_dim, generator))
    dout = torch.randn_like(q)
    qd, kd, vd = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    doutd = dout.transpose(1, 2).contiguous()
    inputs = (q, k, v, index_q, index_k)
    one = torch.ones((), device="cuda")

    def dense_step():
        out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)
        torch.autograd.grad(out, (qd, kd, vd), doutd)

    def warmup_step():
        out, kl = msa_attention(*inputs, warmup=True)
        torch.autograd.grad((out, kl), inputs, (dout, one))

    pairs = []
    for _ in range(args.rounds):
        dense_ms, warmup_ms = bench(dense_step), bench(warmup_step)
        pairs.append(dict(dense_ms=dense_ms, warmup_ms=warmup_ms, ratio=warmup_ms / dense_ms))
        print(json.dumps(pairs[-1]), flush=True)
    summary = {key: statistics.median(p[key] for p in pairs)
               for key in ("dense_ms", "warmup_ms", "ratio")}
    result = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                  triton=triton.__version__, date=time.strftime("%Y-%m-%d"), seqlen=args.seqlen,
                  shape="H64/Hkv4/Hi4", pairs=pairs, median=summary)
    with open(os.path.join(args.out, "bench_warmup.json"), "w") as f:
        json.dump(result, f, indent=2)
    ratios = [p["ratio"] for p in pairs]
    print(f"\nwarmup vs dense step, {result['gpu']}, S={args.seqlen}, H64/Hkv4/Hi4, bf16, "
          f"{args.rounds} alternating rounds: dense median {summary['dense_ms']:.1f} ms, "
          f"warmup median {summary['warmup_ms']:.1f} ms, ratio median {summary['ratio']:.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f})")


if __name__ == "__main__":
    main()
