"""Where the host time of the 16k, H16 training step goes (the step's wall time is about twice
its GPU time): cProfile over steps of the bench_msa.py step, host time per launch of the
Hopper forward and of the Triton forward."""
import cProfile
import io
import os
import pstats
import time

import torch

from openmsa import msa_attention
from openmsa.bench.run import index_inputs
from openmsa.ops import hopper
from openmsa.ops.attention import SparseAttentionProblem, sparse_attention_fwd
from openmsa.ops.schedule import batch_cu_seqlens
from openmsa.ops.select import select_blocks_fwd

out_dir = os.environ["OUT"]
S, H, Hkv, Hi, D = 16384, 16, 2, 4, 128
g = torch.Generator(device="cuda").manual_seed(S)
q, k, v = (torch.randn(1, S, h, D, device="cuda", generator=g).bfloat16().requires_grad_()
           for h in (H, Hkv, Hkv))
dout = torch.randn_like(q)
index_q, index_k = index_inputs("coherent", S, Hi, D, g)
index_q, index_k = index_q[None].requires_grad_(), index_k[None].requires_grad_()
inputs = (q, k, v, index_q, index_k)
one = torch.ones((), device="cuda")


def step():
    out, kl = msa_attention(*inputs, top_k=16, block_size=128)
    torch.autograd.grad((out, kl), inputs, (dout, one))


def wall(fn, n=20):
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e3


def host(fn, n=50):
    """Host time per call, the GPU kept busy so that launches never wait for it."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000 // 1000 * 50)  # ~0.1 s of GPU spin ahead of the calls
    start = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = (time.perf_counter() - start) / n * 1e3
    torch.cuda.synchronize()
    return elapsed


report = [f"step wall: {wall(step):.2f} ms", f"step host time: {host(step, 10):.2f} ms"]
qs, ks, vs = (t.detach()[0] for t in (q, k, v))
cu = batch_cu_seqlens(1, S, "cuda")
ids = select_blocks_fwd(index_q.detach()[0], index_k.detach()[0], cu, top_k=16, block_size=128,
                        index_softmax_scale=D ** -0.5, num_local_blocks=1, num_sink_blocks=0)
p = SparseAttentionProblem(qs, ks, ids, cu, 128, D ** -0.5)
sparse_attention_fwd(qs, ks, vs, None, None, p)
report.append("forward launch host time: hopper %.3f ms, triton %.3f ms" % (
    host(lambda: sparse_attention_fwd(qs, ks, vs, None, None, p, use_hopper=True)),
    host(lambda: sparse_attention_fwd(qs, ks, vs, None, None, p, use_hopper=False))))
report.append("block descriptor host time: %.3f ms" % host(
    lambda: hopper._block_descriptor(ks, 128)))
profile = cProfile.Profile()
profile.enable()
for _ in range(10):
    step()
torch.cuda.synchronize()
profile.disable()
text = io.StringIO()
pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
text2 = io.StringIO()
pstats.Stats(profile, stream=text2).sort_stats("cumulative").print_stats(40)
with open(os.path.join(out_dir, "host_profile.txt"), "w") as handle:
    handle.write("\n".join(report) + "\n\n" + text.getvalue() + "\n\n" + text2.getvalue())
print("\n".join(report))
print(text.getvalue()[:6000])
