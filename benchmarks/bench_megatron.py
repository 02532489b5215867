"""One MSA layer's attention step inside Megatron-core against ``msa_attention`` called directly
(GPU only; needs megatron-core: benchmarks/run_gpu.sh part megatron carries its wheel).

    python benchmarks/bench_megatron.py --out DIR [--seqlens 8192,32768] [--kinds KINDS]

For each length and selection kind, on the same q, k, v and index inputs (H64/Hkv4/Hi4/Hik1,
D = Di = 128, top 16 of 128, bf16, B = 1): the forward and backward of
- ``direct``: ``msa_attention`` on the tensors;
- ``direct + projections``: the same after the index projections (two ``nn.Linear`` on a
  hidden state, as the Megatron layer has them);
- ``megatron``: Megatron's core-attention slot (``MSACoreAttention``) on the same q, k, v in
  Megatron's ``[s, b, heads, dim]`` layout, its index projections on the hidden state (their
  weights select the index inputs out of it, so the selection kind is the one asked for), the
  KL carried into the backward by ``KLIntoBackward``;
with the selection's measured Jaccard and union and dense SDPA's step (same run) next to the
times. The bar: the Megatron step within 1.1x of the direct one. Prints a table last and
writes megatron.json.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from openmsa import msa_attention
from openmsa.bench.run import add_selection_and_dense, make_inputs
from openmsa.bench.timing import median_ms

SHAPE = dict(heads=64, kv_heads=4, index_heads=4, head_dim=128)


def core_attention(device: str = "cuda", backend: str = "auto", shape: dict = SHAPE):
    """A Megatron ``MSACoreAttention`` for ``shape`` (hidden size heads x head dim), in bf16 on
    ``device`` (parallel state initialized by the caller)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from openmsa.integrations.megatron import MSACoreAttention

    config = TransformerConfig(num_layers=1, hidden_size=shape["heads"] * shape["head_dim"],
                               num_attention_heads=shape["heads"],
                               num_query_groups=shape["kv_heads"],
                               kv_channels=shape["head_dim"], attention_dropout=0.0,
                               use_cpu_initialization=True)
    core = MSACoreAttention(config, 1, None, "self", top_k=16, block_size=128, backend=backend)
    return core.to(device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)


def selecting_hidden(core, index_q, index_k):
    """A hidden state ``[s, 1, hidden]`` holding index_q ``[1, s, Hi, Di]`` and index_k
    ``[1, s, 1, Di]`` in its first features, and the core's index projection weights set to
    read them back: the index inputs, hence the selection kind, are the benchmark's."""
    seqlen, index_dims = index_q.shape[1], index_q.shape[2] * index_q.shape[3]
    key_dims = index_k.shape[3]
    hidden_size = core.index_k_proj.weight.shape[1]
    hidden = torch.zeros(seqlen, 1, hidden_size, dtype=index_q.dtype, device=index_q.device)
    hidden[:, 0, :index_dims] = index_q[0].flatten(1).detach()
    hidden[:, 0, index_dims:index_dims + key_dims] = index_k[0].flatten(1).detach()
    with torch.no_grad():
        core.index_q_proj.weight.zero_()
        core.index_q_proj.weight[:, :index_dims] = torch.eye(index_dims)
        core.index_k_proj.weight.zero_()
        core.index_k_proj.weight[:, index_dims:index_dims + key_dims] = torch.eye(key_dims)
    return hidden


def steps(core, q, k, v, index_q, index_k, dout):
    """The three steps (forward + backward) the benchmark times, on the same tensors."""
    one = torch.ones((), device=q.device)
    hidden = selecting_hidden(core, index_q, index_k)
    query, key, value = (t.detach().transpose(0, 1).requires_grad_() for t in (q, k, v))
    dout_sbhd = dout.transpose(0, 1).reshape(q.shape[1], 1, -1)
    index_layers = [core.index_q_proj, core.index_k_proj]
    params = [p for layer in index_layers for p in layer.parameters()]

    def direct():
        out, kl = msa_attention(q, k, v, index_q, index_k, top_k=16, block_size=128)
        torch.autograd.grad((out, kl), (q, k, v, index_q, index_k), (dout, one))

    def direct_with_projections():
        seqlen = hidden.shape[0]
        iq = index_layers[0](hidden)[0].view(1, seqlen, *index_q.shape[2:])
        ik = index_layers[1](hidden).view(1, seqlen, *index_k.shape[2:])
        out, kl = msa_attention(q, k, v, iq, ik, top_k=16, block_size=128)
        torch.autograd.grad((out, kl), (q, k, v, *params), (dout, one))

    def megatron():
        core.index_inputs = (hidden, None)
        out = core(query, key, value, None)
        torch.autograd.grad(out, (query, key, value, *params), dout_sbhd)

    return dict(direct=direct, direct_with_projections=direct_with_projections,
                megatron=megatron)


def measure(core, seqlen: int, kind: str, dense: dict) -> dict:
    inputs = make_inputs(SHAPE, seqlen, kind)
    dout = torch.randn_like(inputs[0])
    row = dict(seqlen=seqlen, selection=kind)
    for name, step in steps(core, *inputs, dout).items():
        row[f"{name}_ms"] = median_ms(step)
    add_selection_and_dense(row, msa_attention, inputs, dout, dense)
    row["megatron_over_direct"] = row["megatron_ms"] / row["direct_ms"]
    row["megatron_over_direct_with_projections"] = (row["megatron_ms"]
                                                    / row["direct_with_projections_ms"])
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seqlens", default="8192,32768")
    parser.add_argument("--kinds", default="coherent,mid,random")
    args = parser.parse_args()
    import tempfile

    import torch.distributed as dist
    from megatron.core import parallel_state

    os.makedirs(args.out, exist_ok=True)
    dist.init_process_group("nccl", init_method=f"file://{tempfile.mktemp()}", rank=0,
                            world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    core = core_attention()
    rows = []
    for seqlen in args.seqlens.split(","):
        dense = {}  # dense SDPA's step, once per length
        rows += [measure(core, int(seqlen), kind, dense) for kind in args.kinds.split(",")]
    with open(os.path.join(args.out, "megatron.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                       shape=SHAPE, rows=rows), f, indent=1)
    print("S kind | Jaccard union8 | direct, + projections, megatron ms | megatron / direct "
          "(/ with projections) | dense ms")
    for r in rows:
        print(f"{r['seqlen']} {r['selection']} | {r['jaccard']:.2f} {r['union_8']:.1f} | "
              f"{r['direct_ms']:.2f} {r['direct_with_projections_ms']:.2f} "
              f"{r['megatron_ms']:.2f} | {r['megatron_over_direct']:.3f} "
              f"({r['megatron_over_direct_with_projections']:.3f}) | "
              f"{r['dense_step_ms']:.2f}")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
