"""Three 16k H16 training steps (bench_msa.py's coherent inputs), for Nsight Compute to profile
the third step's big kernels:

    ncu --clock-control none --kernel-name regex:'_kl_hopper|_hopper_kernel|_sparse_attn_fwd_k' \
        --launch-skip 10 --launch-count 5 --section SpeedOfLight --section WarpStateStats \
        --section ComputeWorkloadAnalysis --section Occupancy --csv --page details \
        python run_ncu_step.py > ncu.csv"""
import torch

from openmsa import msa_attention
from openmsa.bench.run import index_inputs

S, H, Hkv, Hi, D = 16384, 16, 2, 4, 128
g = torch.Generator(device="cuda").manual_seed(S)
q, k, v = (torch.randn(1, S, h, D, device="cuda", generator=g).bfloat16().requires_grad_()
           for h in (H, Hkv, Hkv))
dout = torch.randn_like(q)
iq, ik = index_inputs("coherent", S, Hi, D, g)
iq, ik = iq[None].requires_grad_(), ik[None].requires_grad_()
inputs = (q, k, v, iq, ik)
one = torch.ones((), device="cuda")
for _ in range(3):
    out, kl = msa_attention(*inputs, top_k=16, block_size=128)
    torch.autograd.grad((out, kl), inputs, (dout, one))
torch.cuda.synchronize()
