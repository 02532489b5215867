"""One MSA layer over a sequence split across processes (head-parallel context parallelism).

    torchrun --nproc_per_node 2 examples/context_parallel.py      # CPU (gloo) or GPUs (NCCL)

Each rank holds a contiguous shard of the sequence; the layer exchanges heads with all-to-alls,
runs MSA on the whole sequence for its GQA groups and returns its shard.
"""

import os

import torch
import torch.distributed as dist

from openmsa import MSAAttention

use_cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if use_cuda else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else "cpu"
if use_cuda:
    torch.cuda.set_device(device)

torch.manual_seed(0)  # the same weights on every rank
layer = MSAAttention(256, num_heads=8, num_kv_heads=world * 2, head_dim=64, top_k=2,
                     block_size=64, context_parallel_group=dist.group.WORLD).to(device)
seqlen = 512 * world
hidden = torch.randn(1, seqlen, 256, generator=torch.Generator().manual_seed(1)).to(device)
shard = hidden[:, rank * seqlen // world:(rank + 1) * seqlen // world].requires_grad_()

out, kl = layer(shard)
(out.square().sum() + 0.1 * kl).backward()
print(f"rank {rank}/{world}: shard {tuple(shard.shape)} -> out {tuple(out.shape)}, "
      f"kl {kl.item():.4f}, grad norm {shard.grad.norm():.3f}")
dist.destroy_process_group()
