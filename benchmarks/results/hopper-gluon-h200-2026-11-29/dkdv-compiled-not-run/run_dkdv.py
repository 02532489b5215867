"""dK/dV: the Gluon kernel against the Triton kernel, same problems, interleaved (coherent)."""
import json, os
import torch, triton, triton.testing
from openmsa.bench.run import index_inputs
from openmsa.ops.attention import (SparseAttentionProblem, attention_delta, attention_dkdv,
                                   sparse_attention_fwd)
from openmsa.ops.schedule import batch_cu_seqlens
from openmsa.ops.select import select_blocks_fwd
from openmsa.testing import rel_rms_error
out_dir = os.environ["OUT"]
rows = []
for S, H, Hkv in ((131072, 64, 4), (32768, 64, 4), (16384, 16, 2)):
    D, Hi = 128, 4
    g = torch.Generator(device="cuda").manual_seed(S)
    q, k, v = (torch.randn(S, h, D, device="cuda", generator=g).bfloat16() for h in (H, Hkv, Hkv))
    dout = torch.randn_like(q)
    iq, ik = index_inputs("coherent", S, Hi, D, g)
    cu = batch_cu_seqlens(1, S, "cuda")
    ids = select_blocks_fwd(iq, ik, cu, top_k=16, block_size=128, index_softmax_scale=D ** -0.5,
                            num_local_blocks=1, num_sink_blocks=0)
    p = SparseAttentionProblem(q, k, ids, cu, 128, D ** -0.5)
    out, lse, _ = sparse_attention_fwd(q, k, v, None, None, p)
    delta = attention_delta(out, dout, p)
    hop = attention_dkdv(q, k, v, dout, lse, delta, p)
    tri = attention_dkdv(q, k, v, dout, lse, delta, p, use_hopper=False)
    row = dict(S=S, H=H, dk_rel_rms=rel_rms_error(hop[0], tri[0]),
               dv_rel_rms=rel_rms_error(hop[1], tri[1]))
    th, tt = [], []
    for _ in range(2):
        th.append(triton.testing.do_bench(lambda: attention_dkdv(q, k, v, dout, lse, delta, p), warmup=25, rep=150, return_mode="median"))
        tt.append(triton.testing.do_bench(lambda: attention_dkdv(q, k, v, dout, lse, delta, p, use_hopper=False), warmup=25, rep=150, return_mode="median"))
    row.update(hopper_ms=min(th), triton_ms=min(tt), speedup=min(tt) / min(th))
    print(json.dumps(row), flush=True)
    rows.append(row)
    json.dump(rows, open(os.path.join(out_dir, "dkdv.json"), "w"), indent=1)
    del q, k, v, dout, p, out, lse, delta, hop, tri
    torch.cuda.empty_cache()
