"""One MSA layer over a sequence split across processes (context parallelism).

    torchrun --nproc_per_node 2 examples/context_parallel.py                  # head-parallel
    torchrun --nproc_per_node 2 examples/context_parallel.py --mode sequence  # sequence-parallel

CPU (gloo) or GPUs (NCCL). Each rank holds its shard of the sequence, which shard_sequence cuts
for the mode: contiguous for head mode (the layer exchanges heads with all-to-alls and runs MSA
on the whole sequence for its GQA groups), zig-zag for sequence mode (chunks r and 2W - 1 - r
of 2W; the layer all-gathers keys and runs MSA for its own queries). Labels and position ids of
a real model are sharded the same way; the layer derives RoPE positions of its shard itself.
"""

import argparse
import os

import torch
import torch.distributed as dist

from openmsa import MSAAttention
from openmsa.integrations.context_parallel import MODES, shard_sequence

parser = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--mode", choices=MODES, default="head")
args = parser.parse_args()

use_cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if use_cuda else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else "cpu"
if use_cuda:
    torch.cuda.set_device(device)

torch.manual_seed(0)  # the same weights on every rank
# Head mode splits whole GQA groups: a multiple of the world size of KV heads.
layer = MSAAttention(256, num_heads=8, num_kv_heads=world * 2, head_dim=64, top_k=2,
                     block_size=64, context_parallel_group=dist.group.WORLD,
                     context_parallel_mode=args.mode).to(device)
seqlen = 512 * world
hidden = torch.randn(1, seqlen, 256, generator=torch.Generator().manual_seed(1)).to(device)
shard = shard_sequence(hidden, dist.group.WORLD, args.mode, dim=1).requires_grad_()

out, kl = layer(shard)
(out.square().sum() + 0.1 * kl).backward()
print(f"rank {rank}/{world} ({args.mode} mode): shard {tuple(shard.shape)} -> out "
      f"{tuple(out.shape)}, kl {kl.item():.4f}, grad norm {shard.grad.norm():.3f}")
dist.destroy_process_group()
