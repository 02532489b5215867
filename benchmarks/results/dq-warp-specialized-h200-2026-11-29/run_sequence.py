"""bench_attention.py's 128k H64 sequence (its seed and draws: dense baseline, random case,
coherent case), with the coherent case's backward timed at checkpoints along it, to find which
step makes it slower there than timed alone. Uses bench_attention.py's own timing and profile
functions. nvidia-smi samples every 100 ms (clocks.csv)."""
import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from bench_attention import bench, kernel_times  # noqa: E402

from openmsa.bench.flops import kept_triples  # noqa: E402
from openmsa.bench.run import index_inputs  # noqa: E402
from openmsa.ops.attention import (SparseAttentionProblem, attention_backward,  # noqa: E402
                                   sparse_attention_fwd)
from openmsa.ops.schedule import batch_cu_seqlens  # noqa: E402
from openmsa.ops.select import select_blocks_fwd  # noqa: E402

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
scale = D ** -0.5
inputs = {kind: index_inputs(kind, S, Hi, D, g) for kind in ("random", "coherent")}


def case(kind):
    ids = select_blocks_fwd(*inputs[kind], cu, top_k=16, block_size=128,
                            index_softmax_scale=scale, num_local_blocks=1, num_sink_blocks=0)
    p = SparseAttentionProblem(q, k, ids, cu, 128, scale)
    out, lse, _ = sparse_attention_fwd(q, k, v, None, None, p)
    return ids, p, out, lse


ids, p, out, lse = case("coherent")
flops = 2.5 * 4.0 * D * kept_triples(ids, 128, H // Hi)
rows = []


def checkpoint(name, problem=None):
    pp, oo, ll = problem or (p, out, lse)
    ms = bench(lambda: attention_backward(q, k, v, oo, dout, ll, pp))
    rows.append(dict(after=name, bwd_ms=ms, bwd_tflops=flops / ms / 1e9))
    print(json.dumps(rows[-1]), flush=True)


checkpoint("setup")
qd, kd, vd = (t.transpose(0, 1)[None].contiguous().requires_grad_() for t in (q, k, v))
dense_out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)
bench(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True))
bench(lambda: torch.autograd.grad(dense_out, (qd, kd, vd), dout.transpose(0, 1)[None],
                                  retain_graph=True))
del qd, kd, vd, dense_out
checkpoint("dense baseline")
r_ids, r_p, r_out, r_lse = case("random")
bench(lambda: sparse_attention_fwd(q, k, v, None, None, r_p))
bench(lambda: attention_backward(q, k, v, r_out, dout, r_lse, r_p))
checkpoint("random case: Gluon forward and backward timed")
bench(lambda: sparse_attention_fwd(q, k, v, None, None, r_p, use_hopper=False))
bench(lambda: attention_backward(q, k, v, r_out, dout, r_lse, r_p, use_hopper=False))
checkpoint("random case: Triton forward and backward timed")
kernel_times(lambda: attention_backward(q, k, v, r_out, dout, r_lse, r_p))
checkpoint("random case: backward profiled")
del r_ids, r_p, r_out, r_lse
torch.cuda.empty_cache()
checkpoint("random case freed, cache emptied")
fresh = case("coherent")[1:]
checkpoint("coherent problem rebuilt (as bench_attention.py does)", fresh)
kernel_times(lambda: attention_backward(q, k, v, fresh[1], dout, fresh[2], fresh[0]))
checkpoint("coherent backward profiled", fresh)
sampler.terminate()
with open(os.path.join(out_dir, "sequence.json"), "w") as handle:
    json.dump(rows, handle, indent=1)
for r in rows:
    print(f"{r['after']:>56} {r['bwd_ms']:7.2f} ms {r['bwd_tflops']:5.0f} TFLOP/s")
