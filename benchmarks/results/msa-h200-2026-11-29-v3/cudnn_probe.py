"""Probe: PyTorch's cuDNN attention ops (private aten) for the warmup's dense main attention."""
import math, time, traceback
import torch, torch.nn.functional as F
import triton.testing

def bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=200, return_mode="median")

print(torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default._schema)
torch.manual_seed(0)
B, S, H, Hkv, D = 1, 4096, 16, 2, 128
scale = D ** -0.5
q = torch.randn(B * S, H, D, device="cuda", dtype=torch.bfloat16)
k = torch.randn(B * S, Hkv, D, device="cuda", dtype=torch.bfloat16)
v = torch.randn(B * S, Hkv, D, device="cuda", dtype=torch.bfloat16)
dout = torch.randn_like(q)
qb = q.view(B, S, H, D).transpose(1, 2)
kb = k.view(B, S, Hkv, D).transpose(1, 2)
vb = v.view(B, S, Hkv, D).transpose(1, 2)
ref = F.scaled_dot_product_attention(qb.float(), kb.float().repeat_interleave(H // Hkv, 1),
                                     vb.float().repeat_interleave(H // Hkv, 1), is_causal=True)
logits = torch.einsum("bhid,bhjd->bhij", qb.float(), kb.float().repeat_interleave(H // Hkv, 1)) * scale
logits = logits.masked_fill(torch.ones(S, S, device="cuda", dtype=torch.bool).triu(1), float("-inf"))
ref_lse = torch.logsumexp(logits, -1)
op = torch.ops.aten._scaled_dot_product_cudnn_attention
for name, kk, vv in (("gqa-native", kb, vb), ("expanded", kb.repeat_interleave(H // Hkv, 1), vb.repeat_interleave(H // Hkv, 1))):
    try:
        res = op(qb, kk, vv, None, True, 0.0, True, False, scale=scale)
        out, lse = res[0], res[1]
        print(name, "out", tuple(out.shape), out.stride(), "lse", tuple(lse.shape), lse.dtype, lse.stride())
        print(name, "out err", (out.float() - ref).abs().max().item(), "lse err",
              (lse.view(B, H, S).float() - ref_lse).abs().max().item())
        print(name, "others", [getattr(r, "shape", r) for r in res[2:]], [getattr(r, "dtype", None) for r in res[2:]])
        bop = torch.ops.aten._scaled_dot_product_cudnn_attention_backward
        g = bop(dout.view(B, S, H, D).transpose(1, 2), qb, kk, vv, out, lse, res[6], res[7], None, res[2], res[3], res[4], res[5], 0.0, True, scale=scale)
        print(name, "grads", [tuple(t.shape) for t in g])
        # with lse rebuilt from a base-2 copy and fresh empty philox tensors
        lse2 = (lse * math.log2(math.e)).contiguous()
        g2 = bop(dout.view(B, S, H, D).transpose(1, 2), qb, kk, vv, out, (lse2 / math.log2(math.e)).view_as(lse), res[6], res[7], None, res[2], res[3], res[4], res[5], 0.0, True, scale=scale)
        print(name, "grads rebuilt lse, max diff", [ (a.float()-b.float()).abs().max().item() for a, b in zip(g, g2)])
        # reference grads
        qr, kr, vr = (t.detach().float().requires_grad_() for t in (qb, kb, vb))
        o = F.scaled_dot_product_attention(qr, kr.repeat_interleave(H // Hkv, 1), vr.repeat_interleave(H // Hkv, 1), is_causal=True)
        o.backward(dout.view(B, S, H, D).transpose(1, 2).float())
        dk = g[1] if g[1].shape[1] == Hkv else g[1].view(B, Hkv, H // Hkv, S, D).sum(2)
        print(name, "dq err", (g[0].float() - qr.grad).abs().max().item(), "dk err", (dk.float() - kr.grad).abs().max().item())
    except Exception:
        traceback.print_exc()

for (S, H, Hkv) in ((32768, 64, 4), (16384, 16, 2)):
    q = torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    kn = torch.randn(1, S, Hkv, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    vn = torch.randn(1, S, Hkv, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    do = torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    bop = torch.ops.aten._scaled_dot_product_cudnn_attention_backward
    for name in ("native", "expanded"):
        try:
            kx, vx = (kn, vn) if name == "native" else (kn.repeat_interleave(H // Hkv, 1), vn.repeat_interleave(H // Hkv, 1))
            res = op(q, kx, vx, None, True, 0.0, True, False, scale=scale)
            f_ms = bench(lambda: op(q, kx, vx, None, True, 0.0, True, False, scale=scale))
            g = bop(do, q, kx, vx, res[0], res[1], res[6], res[7], None, res[2], res[3], res[4], res[5], 0.0, True, scale=scale)
            b_ms = bench(lambda: bop(do, q, kx, vx, res[0], res[1], res[6], res[7], None, res[2], res[3], res[4], res[5], 0.0, True, scale=scale))
            print(f"S={S} H{H} {name}: cudnn private fwd {f_ms:.2f} bwd {b_ms:.2f} total {f_ms+b_ms:.2f} ms; dk shape {tuple(g[1].shape)}")
        except Exception as e:
            print(f"S={S} H{H} {name}: {type(e).__name__}: {e}"[:300])
    qd, kd, vd = (t.detach().clone().requires_grad_() for t in (q, kn, vn))
    def public():
        o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)
        torch.autograd.grad(o, (qd, kd, vd), do)
    print(f"S={S} H{H}: public SDPA gqa step {bench(public):.2f} ms")
