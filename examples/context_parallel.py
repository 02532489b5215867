"""One MSA layer over a sequence split across processes (context parallelism).

    torchrun --nproc_per_node 2 examples/context_parallel.py                  # head-parallel
    torchrun --nproc_per_node 3 examples/context_parallel.py --mode sequence  # sequence-parallel

CPU (gloo) or GPUs (NCCL). Each rank holds its shard of the sequence, which shard_sequence cuts
for the mode: contiguous for head mode (the layer exchanges heads with all-to-alls and runs MSA
on the whole sequence for its GQA groups), zig-zag for sequence mode (chunks r and 2W - 1 - r
of 2W; the layer all-gathers keys and runs MSA for its own queries). Labels and position ids of
a real model are sharded the same way; the layer derives RoPE positions of its shard itself.

Rank 0 prints the totals over all ranks (the loss, the KL, the norms of the input's and the
weights' gradients): at the same number of processes both modes print the same figures, those
of the layer run in one process.
"""

import argparse
import os

import torch
import torch.distributed as dist

from openmsa import MSAAttention
from openmsa.context_parallel import MODES, shard_sequence

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
# Head mode splits whole GQA groups, so the KV heads are a multiple of the world size; sequence
# mode takes any head counts and any world size. Both modes get the same layer here.
kv_heads = 2 * world
layer = MSAAttention(256, num_heads=4 * kv_heads, num_kv_heads=kv_heads, head_dim=64, top_k=2,
                     block_size=64, context_parallel_group=dist.group.WORLD,
                     context_parallel_mode=args.mode).to(device)
seqlen = 512 * world  # divisible by 2 * world: the zig-zag chunks
hidden = torch.randn(1, seqlen, 256, generator=torch.Generator().manual_seed(1)).to(device)
shard = shard_sequence(hidden, dist.group.WORLD, args.mode, dim=1).requires_grad_()

out, kl = layer(shard)  # kl: the whole sequence's KL on every rank
task_loss = out.square().sum()  # this rank's tokens' share of the loss
(task_loss + 0.1 * kl).backward()
print(f"rank {rank}/{world} ({args.mode} mode): shard {tuple(shard.shape)} -> out "
      f"{tuple(out.shape)}", flush=True)

# Totals over the ranks: the loss and the squared gradient norms add up; each rank's weight
# gradients are its share of the whole sequence's.
totals = torch.stack([task_loss.detach(), shard.grad.square().sum()]).double()
dist.all_reduce(totals)
weight_grads = torch.cat([p.grad.flatten() for p in layer.parameters()]).double()
dist.all_reduce(weight_grads)
if rank == 0:
    print(f"total over {world} ranks ({args.mode} mode): loss {totals[0]:.6g} + 0.1 * kl "
          f"{kl.item():.6g}; input grad norm {totals[1].sqrt():.6g}; weight grad norm "
          f"{weight_grads.norm():.6g}", flush=True)
dist.barrier()  # no rank tears its connections down while another still reads from them
dist.destroy_process_group()
