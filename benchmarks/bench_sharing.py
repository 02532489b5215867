"""Index sharing across layers (SPEC section 9): a stack of attention layers with and without a
shared selection, fwd + bwd (GPU only).

    python benchmarks/bench_sharing.py --out DIR [--seqlens 131072,524288]
        [--composed-seqlens 1048576] [--layers 4] [--kinds coherent,mid,random]
        [--index-precisions input] [--kernels]

Config H64/Hkv4/Hi4/Hik1, D = Di = 128, top 16 of 128-token blocks, bf16, B = 1. A stack of
``--layers`` attention layers with chained inputs (layer i + 1's queries are the stack's q plus
layer i's output, so one backward runs through every layer): ``share_index_every`` 1, every layer
selects (``msa_attention``); ``share_index_every`` = layers, layer 0 selects and the others run
``sparse_attention`` over its blocks. Every layer's index inputs are of one selection kind
(openmsa.bench.selection); the sharing layers' main attention reads the indexer's blocks.

At --composed-seqlens (1M: four H64 layers' saved activations exceed an H200's memory) the
stack's time is composed from one indexer layer's step and one sharing layer's step (over the
ids of an indexer's training forward, with the work lists it built), timed alone: ``indexer + (layers - 1) x sharer`` against ``layers x indexer`` (the layers run one
after another, so their times add). Steps of 512k tokens and more are the median of 3 calls
after a warm-up one; shorter ones use timing.median_ms. The same chained stack on dense causal
SDPA is the run's baseline up to --dense-max-seqlen. Prints a table last.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import torch
import torch.nn.functional as F
import triton

from bench_attention import kernel_times
from openmsa import msa_attention, select_blocks, sparse_attention
from openmsa.bench.selection import index_inputs, selection_statistics
from openmsa.bench.timing import median_ms, median_ms_of_few

HEADS, KV_HEADS, INDEX_HEADS, DIM, TOP_K, BLOCK = 64, 4, 4, 128, 16, 128
LONG_SEQLEN = 524288


def _inputs(seqlen, kind, layers, device, generator):
    """Per layer: q, k, v (the same leaves for every layer: at 512k, H64, four layers' own
    would not fit beside their activations) and index inputs of ``kind`` of its own."""
    q, k, v = (torch.randn(1, seqlen, h, DIM, device=device, generator=generator)
               .bfloat16().requires_grad_() for h in (HEADS, KV_HEADS, KV_HEADS))
    stack = []
    for _ in range(layers):
        index_q, index_k = (t[None].requires_grad_() for t in index_inputs(
            kind, seqlen, INDEX_HEADS, DIM, generator, device))
        stack.append((q, k, v, index_q, index_k))
    return stack


def _stack_step(stack, every, precision, dout):
    """fwd + bwd of the chained stack, layers 0, every, ... selecting."""
    out, kls, ids = None, [], None
    for layer, (q, k, v, index_q, index_k) in enumerate(stack):
        q = q if out is None else q + out
        if layer % every == 0:
            out, kl, ids = msa_attention(q, k, v, index_q, index_k, top_k=TOP_K,
                                         block_size=BLOCK, index_precision=precision,
                                         return_indices=True)
            kls.append(kl)
        else:
            out = sparse_attention(q, k, v, ids, block_size=BLOCK)
    leaves = list({id(t): t for layer in stack for t in layer}.values())
    torch.autograd.grad([out, torch.stack(kls).mean()], leaves,
                        [dout, torch.ones((), device=dout.device)], allow_unused=True)


def _dense_stack_step(stack, dout):
    """The same chained stack on dense causal SDPA (cuDNN), the baseline of the run."""
    out = None
    q, k, v = stack[0][:3]
    for _ in stack:
        layer_q = q if out is None else q + out
        out = F.scaled_dot_product_attention(layer_q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True,
                                             enable_gqa=True).transpose(1, 2)
    torch.autograd.grad(out, (q, k, v), dout)


def _layer_steps(stack, precision, dout):
    """One indexer layer's step and one sharing layer's step (over the indexer's blocks)."""
    q, k, v, index_q, index_k = stack[0]
    one = torch.ones((), device=q.device)

    def indexer():
        out, kl = msa_attention(q, k, v, index_q, index_k, top_k=TOP_K, block_size=BLOCK,
                                index_precision=precision)
        torch.autograd.grad((out, kl), (q, k, v, index_q, index_k), (dout, one))

    # The ids of a training forward, as a model's sharing layers get them: they come with the
    # work lists that forward built (its KL's key-block list too), which the sharer reuses.
    _, _, ids = msa_attention(q, k, v, index_q, index_k, top_k=TOP_K, block_size=BLOCK,
                              index_precision=precision, return_indices=True)

    def sharer():
        out = sparse_attention(q, k, v, ids, block_size=BLOCK)
        torch.autograd.grad(out, (q, k, v), dout)

    return indexer, sharer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seqlens", default="131072,524288")
    parser.add_argument("--composed-seqlens", default="1048576")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--kinds", default="coherent,mid,random")
    parser.add_argument("--index-precisions", default="input")
    parser.add_argument("--dense-max-seqlen", type=int, default=131072,
                        help="time the dense stack (SDPA) up to this length")
    parser.add_argument("--kernels", action="store_true",
                        help="also record each stack step's GPU kernels (torch profiler, "
                        "milliseconds per kernel name) beside its time")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda")
    kinds = args.kinds.split(",")
    precisions = args.index_precisions.split(",")
    result = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                  triton=triton.__version__, date=time.strftime("%Y-%m-%d"), args=vars(args),
                  config=f"H{HEADS}/Hkv{KV_HEADS}/Hi{INDEX_HEADS}/Hik1 D=Di={DIM} top {TOP_K} "
                  f"of {BLOCK}, bf16, B=1, {args.layers} layers", rows=[])
    jobs = ([(int(s), False) for s in args.seqlens.split(",") if s]
            + [(int(s), True) for s in args.composed_seqlens.split(",") if s])
    for seqlen, composed in jobs:
        timer = median_ms_of_few if seqlen >= LONG_SEQLEN else median_ms
        for kind in kinds:
            generator = torch.Generator(device=device).manual_seed(seqlen)
            stack = _inputs(seqlen, kind, 1 if composed else args.layers, device, generator)
            dout = torch.randn_like(stack[0][0])
            with torch.no_grad():
                ids = select_blocks(*stack[0][3:], top_k=TOP_K, block_size=BLOCK)[0]
            stats = selection_statistics(ids.permute(1, 0, 2))
            del ids
            if kind == kinds[0]:  # dense attention does not depend on the selection kind
                dense_ms = (median_ms_of_few(functools.partial(_dense_stack_step, stack, dout))
                            if not composed and seqlen <= args.dense_max_seqlen else None)
            for precision in precisions:
                row = dict(seqlen=seqlen, selection=kind, index_precision=precision,
                           layers=args.layers, composed=composed, dense_stack_ms=dense_ms,
                           **stats)
                if composed:
                    indexer, sharer = _layer_steps(stack, precision, dout)
                    row["indexer_layer_ms"] = timer(indexer)
                    row["sharing_layer_ms"] = timer(sharer)
                    row["every_1_ms"] = args.layers * row["indexer_layer_ms"]
                    row["every_layers_ms"] = (row["indexer_layer_ms"]
                                              + (args.layers - 1) * row["sharing_layer_ms"])
                else:
                    for every in (1, args.layers):
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                        row[f"every_{'1' if every == 1 else 'layers'}_ms"] = timer(
                            functools.partial(_stack_step, stack, every, precision, dout))
                        row[f"every_{'1' if every == 1 else 'layers'}_peak_gib"] = (
                            torch.cuda.max_memory_allocated() / 2**30)
                        if args.kernels:
                            row[f"every_{'1' if every == 1 else 'layers'}_kernels_ms"] = (
                                kernel_times(functools.partial(_stack_step, stack, every,
                                                               precision, dout), top=40))
                row["speedup"] = row["every_1_ms"] / row["every_layers_ms"]
                if dense_ms:
                    row["every_layers_vs_dense"] = dense_ms / row["every_layers_ms"]
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
            del stack, dout
            torch.cuda.empty_cache()
    with open(os.path.join(args.out, "bench_sharing.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nindex sharing, {result['gpu']}, {result['config']} (composed: from one indexer "
          f"and one sharing layer's step)")
    print(f"{'S':>8} {'selection':>9} {'prec':>5} {'Jaccard':>7} {'union8':>6} "
          f"{'every 1 ms':>11} {'every ' + str(args.layers) + ' ms':>11} {'speedup':>7} "
          f"{'dense ms':>9} {'composed':>8}")
    for r in result["rows"]:
        dense = f"{r['dense_stack_ms']:.1f}" if r["dense_stack_ms"] else "-"
        print(f"{r['seqlen']:>8} {r['selection']:>9} {r['index_precision']:>5} "
              f"{r['jaccard']:>7.3f} {r['union_8']:>6.1f} {r['every_1_ms']:>11.1f} "
              f"{r['every_layers_ms']:>11.1f} {r['speedup']:>6.2f}x {dense:>9} "
              f"{'yes' if r['composed'] else 'no':>8}")


if __name__ == "__main__":
    main()
