"""The 128k H64 coherent backward of bench_attention.py (its seed and draw order, so its
selection) timed in three GPU states: after setup, right after ~20 s of the 128k random case's
backward (the load that precedes it in bench_attention.py), and after 30 s idle. nvidia-smi
samples clocks, power and temperature every 100 ms throughout (clocks.csv); each timing also
profiles one call's kernels."""
import json
import os
import subprocess
import time

import torch
import triton.testing

from openmsa.bench.flops import kept_triples
from openmsa.bench.run import index_inputs
from openmsa.ops.attention import SparseAttentionProblem, attention_backward, sparse_attention_fwd
from openmsa.ops.schedule import batch_cu_seqlens
from openmsa.ops.select import select_blocks_fwd

out_dir = os.environ["OUT"]
sampler = subprocess.Popen(
    ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,"
     "clocks_event_reasons.sw_power_cap", "--format=csv", "-lms", "100"],
    stdout=open(os.path.join(out_dir, "clocks.csv"), "w"))
S, H, Hkv, D, Hi = 131072, 64, 4, 128, 4
g = torch.Generator(device="cuda").manual_seed(S + H)
q, k, v = (torch.randn(S, h, D, device="cuda", generator=g).bfloat16() for h in (H, Hkv, Hkv))
dout = torch.randn_like(q)
cu = batch_cu_seqlens(1, S, "cuda")


def problem_of(kind):
    iq, ik = index_inputs(kind, S, Hi, D, g)
    ids = select_blocks_fwd(iq, ik, cu, top_k=16, block_size=128, index_softmax_scale=D ** -0.5,
                            num_local_blocks=1, num_sink_blocks=0)
    p = SparseAttentionProblem(q, k, ids, cu, 128, D ** -0.5)
    out, lse, _ = sparse_attention_fwd(q, k, v, None, None, p)
    return ids, p, out, lse


random_case = problem_of("random")  # drawn first, as in bench_attention.py
ids, p, out, lse = problem_of("coherent")
flops = 2.5 * 4.0 * D * kept_triples(ids, 128, H // Hi)


def backward():
    return attention_backward(q, k, v, out, dout, lse, p)


def measure(state):
    ms = triton.testing.do_bench(backward, warmup=25, rep=200, return_mode="median")
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        backward()
        torch.cuda.synchronize()
    kernels = {e.key[:40]: e.device_time_total / 1000 for e in prof.key_averages()
               if e.device_time_total > 0 and "hopper" in e.key}
    row = dict(state=state, time=time.strftime("%H:%M:%S"), bwd_ms=ms,
               bwd_tflops=flops / ms / 1e9, kernels_ms=kernels)
    print(json.dumps(row), flush=True)
    return row


rows = [measure("after setup")]
_, p_random, out_random, lse_random = random_case
start = time.time()
while time.time() - start < 20:
    attention_backward(q, k, v, out_random, dout, lse_random, p_random)
torch.cuda.synchronize()
rows.append(measure("after 20 s of the random case's backward"))
time.sleep(30)
rows.append(measure("after 30 s idle"))
rows.append(measure("again"))
sampler.terminate()
with open(os.path.join(out_dir, "after_load.json"), "w") as handle:
    json.dump(rows, handle, indent=1)
for r in rows:
    print(f"{r['state']:>42} {r['bwd_ms']:7.2f} ms {r['bwd_tflops']:5.0f} TFLOP/s "
          + " ".join(f"{v:.2f}" for v in r["kernels_ms"].values()))
