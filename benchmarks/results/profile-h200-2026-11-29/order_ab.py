"""A/B: execution order of the key-outer segments (dK/dV and the KL key side)."""
import json, sys
import torch, triton.testing
sys.path.insert(0, "benchmarks")
from openmsa.bench.run import index_inputs
from openmsa.ops.attention import (SparseAttentionProblem, attention_delta, attention_dkdv,
                                   kl_key_side, kl_query_side, sparse_attention_fwd)
from openmsa.ops.schedule import batch_cu_seqlens
from openmsa.ops.select import select_blocks_fwd

def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=300, return_mode="median")

for seqlen in (32768, 131072):
    H, Hkv, Hi, D = 64, 4, 4, 128
    g = torch.Generator(device="cuda").manual_seed(seqlen)
    q = torch.randn(seqlen, H, D, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(seqlen, Hkv, D, device="cuda", generator=g).bfloat16() for _ in range(2))
    dout = torch.randn_like(q)
    cu = batch_cu_seqlens(1, seqlen, "cuda")
    iq, ik = index_inputs("coherent", seqlen, Hi, D, g)
    ids = select_blocks_fwd(iq, ik, cu, top_k=16, block_size=128, index_softmax_scale=D ** -0.5,
                            num_local_blocks=1, num_sink_blocks=0)
    p = SparseAttentionProblem(q, k, ids, cu, 128, D ** -0.5, ik, D ** -0.5)
    out, lse, lse_index = sparse_attention_fwd(q, k, v, iq, ik, p)
    delta = attention_delta(out, dout, p)
    factor = torch.ones((), device="cuda")
    work = p.block_work
    largest_first = work.segment_order.clone()
    n = work.segments.shape[0]
    natural = torch.arange(n, device="cuda", dtype=torch.int32)
    bucket = work.segments[:, 0].long()
    head_major_key = torch.where(bucket >= 0, (bucket % Hi) * n + torch.arange(n, device="cuda"),
                                 Hi * n + torch.arange(n, device="cuda"))
    head_major = torch.argsort(head_major_key).to(torch.int32)
    results, reference = {}, None
    for name, order in (("largest_first", largest_first), ("natural", natural),
                        ("head_major", head_major), ("largest_first_again", largest_first)):
        work.segment_order = order.contiguous()
        grads = attention_dkdv(q, k, v, dout, lse, delta, p) + (
            kl_key_side(q, k, iq, ik, lse, lse_index, factor, p),)
        if reference is None:
            reference = grads
        same = all(torch.equal(a, b) for a, b in zip(grads, reference))
        results[name] = dict(dkdv_ms=bench(lambda: attention_dkdv(q, k, v, dout, lse, delta, p)),
                             kl_key_ms=bench(lambda: kl_key_side(q, k, iq, ik, lse, lse_index,
                                                                 factor, p)),
                             bitwise_equal=same)
        print(json.dumps(dict(seqlen=seqlen, order=name, **results[name])), flush=True)
    from openmsa.ops.csr import build_block_work
    for pairs in (1024, 4096):
        p.block_work = build_block_work(ids, cu, 128, pairs)
        p.block_work.segment_order = torch.arange(p.block_work.segments.shape[0], device="cuda",
                                                  dtype=torch.int32)
        grads = attention_dkdv(q, k, v, dout, lse, delta, p) + (
            kl_key_side(q, k, iq, ik, lse, lse_index, factor, p),)
        same = all(torch.equal(a, b) for a, b in zip(grads, reference))
        print(json.dumps(dict(seqlen=seqlen, order=f"natural, segment_pairs {pairs}",
                              dkdv_ms=bench(lambda: attention_dkdv(q, k, v, dout, lse, delta, p)),
                              kl_key_ms=bench(lambda: kl_key_side(q, k, iq, ik, lse, lse_index,
                                                                  factor, p)),
                              bitwise_equal=same)), flush=True)
    del q, k, v, dout, out, lse, p, work, delta
    torch.cuda.empty_cache()
