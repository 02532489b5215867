"""The index log-sum-exp alone: the forward kernel's index part on its own (before: a program
per (tile, index head)) against ``_index_lse_kernel`` (the walk lists of the index heads that
share an index key head merged, each key block read once for all of them), its launch swept;
values compared; and the 16k H16 step with each, dense SDPA in the same process.

    OUT=DIR python run_index_lse.py"""
import json
import os

import torch
import torch.nn.functional as F

from openmsa import msa_attention
from openmsa.bench.run import index_inputs
from openmsa.bench.timing import median_ms
from openmsa.ops import attention
from openmsa.ops.attention import SparseAttentionProblem, _launch, _sparse_attn_fwd_kernel
from openmsa.ops.schedule import batch_cu_seqlens
from openmsa.ops.select import select_blocks_fwd

out_dir = os.environ["OUT"]
new_index_lse = attention.index_log_sum_exp


def old_index_lse(index_q, index_k, index_max, p):
    """The index log-sum-exp as before: the forward kernel without its main branch, a program
    per (tile, index head), 4 warps, 2 stages."""
    work = p.index_tile_work
    lse_index = torch.empty(p.total, p.num_index_heads, dtype=torch.float32,
                            device=index_q.device)
    tokens = work.tile_tokens
    padded = max(16, tokens)
    _launch(_sparse_attn_fwd_kernel, (work.schedule.shape[0], p.num_index_heads),
        index_q, index_k, index_k, index_q, index_k, index_q, lse_index, lse_index, index_max,
        work.schedule, work.union, work.union_members, work.union_count, p.cu_seqlens,
        p.query_start, p.query_start + p.total,
        *attention._strides(index_q, index_k, index_k, index_q, index_q, index_k), 0.0,
        p.index_scale, **dict(p.query_constants(), TOK=tokens, TOKP=padded, ROWS=padded,
                              UNION_SLOTS=work.union.shape[-1]),
        WITH_MAIN=False, WITH_INDEX=True, INDEX_MAX_GIVEN=True, num_warps=4, num_stages=2)
    return lse_index


result = {}
for S, H, Hkv, Hi, D in ((16384, 16, 2, 4, 128), (131072, 64, 4, 4, 128)):
    g = torch.Generator(device="cuda").manual_seed(S)
    q, k = (torch.randn(S, h, D, device="cuda", generator=g).bfloat16() for h in (H, Hkv))
    iq, ik = index_inputs("coherent", S, Hi, D, g)
    cu = batch_cu_seqlens(1, S, "cuda")
    ids, index_max = select_blocks_fwd(iq, ik, cu, top_k=16, block_size=128,
                                       index_softmax_scale=D ** -0.5, num_local_blocks=1,
                                       num_sink_blocks=0, return_max=True)
    p = SparseAttentionProblem(q, k, ids, cu, 128, D ** -0.5, ik, D ** -0.5)
    p.index_tile_work
    row = dict(old_ms=median_ms(lambda: old_index_lse(iq, ik, index_max, p)))
    expected = old_index_lse(iq, ik, index_max, p)
    for heads in (1, 2, 4):
        for warps in (4, 8):
            for stages in (1, 2):
                label = f"heads{heads}_warps{warps}_stages{stages}"
                fn = lambda: new_index_lse(iq, ik, index_max, p, heads, warps, stages)  # noqa
                row[label] = median_ms(fn)
                row[label + "_max_abs_diff"] = (fn() - expected).abs().max().item()
    row["default_ms"] = median_ms(lambda: new_index_lse(iq, ik, index_max, p))
    result[f"S{S}_H{H}"] = row
    print(f"S={S} H={H}:", json.dumps(row), flush=True)
    del q, k, iq, ik, p
    torch.cuda.empty_cache()

# The 16k H16 step with the old and the new index log-sum-exp.
S, H, Hkv, Hi, D = 16384, 16, 2, 4, 128
g = torch.Generator(device="cuda").manual_seed(S)
q, k, v = (torch.randn(1, S, h, D, device="cuda", generator=g).bfloat16().requires_grad_()
           for h in (H, Hkv, Hkv))
dout = torch.randn_like(q)
iq, ik = index_inputs("coherent", S, Hi, D, g)
iq, ik = iq[None].requires_grad_(), ik[None].requires_grad_()
inputs = (q, k, v, iq, ik)
one = torch.ones((), device="cuda")


def step():
    out, kl = msa_attention(*inputs, top_k=16, block_size=128)
    torch.autograd.grad((out, kl), inputs, (dout, one))


def dense():
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                         v.transpose(1, 2), is_causal=True, enable_gqa=True)
    torch.autograd.grad(out, (q, k, v), dout.transpose(1, 2))


steps = {"dense_ms": median_ms(dense)}
for round_ in (1, 2):
    for name, fn in (("old", old_index_lse), ("new", new_index_lse)):
        attention.index_log_sum_exp = fn
        steps[f"step_{name}_ms_{round_}"] = median_ms(step)
attention.index_log_sum_exp = new_index_lse
steps["dense_again_ms"] = median_ms(dense)
result["step_16k_H16"] = steps
print(json.dumps(steps))
with open(os.path.join(out_dir, "index_lse.json"), "w") as f:
    json.dump(result, f, indent=1)
