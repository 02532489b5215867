"""One MSA layer's training step on coherent inputs, for a kernel profiler (GPU only).

    ncu --kernel-name regex:"_sparse|_kl_|_select" --launch-skip 6 --launch-count 6 \
        --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis \
        python benchmarks/profile_step.py --seqlen 32768

Runs the step twice (the first compiles), so the profiler's skip count can pass the first one.
"""

from __future__ import annotations

import argparse

import torch

from openmsa import msa_attention
from openmsa.bench.selection import index_inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seqlen", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--index-heads", type=int, default=4)
    args = parser.parse_args()
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, args.seqlen, h, 128, device="cuda", generator=generator)
               .bfloat16().requires_grad_() for h in (args.heads, args.kv_heads, args.kv_heads))
    index_q, index_k = index_inputs("coherent", args.seqlen, args.index_heads, 128, generator)
    inputs = (q, k, v, index_q[None].requires_grad_(), index_k[None].requires_grad_())
    dout, one = torch.randn_like(q), torch.ones((), device="cuda")
    for _ in range(2):
        out, kl = msa_attention(*inputs, top_k=16, block_size=128)
        torch.autograd.grad((out, kl), inputs, (dout, one))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
