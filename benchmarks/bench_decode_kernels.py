"""The decode kernels timed alone and in a step (GPU only), as CUDA graph replays, at each
context and batch (one new token per sequence, H64/Hkv4/Hi4/Hik1, D=Di=128, top 16 of 128, bf16):

- part ``scores``: a sweep of the block-score kernel's launch (cached blocks a program walks,
  warps, pipeline stages) against the bandwidth floor of the cached index keys it reads; the
  first row of each shape is the shipped launch (``decode_kernels.score_launch``).
- part ``step``: the step's kernels one prefix at a time (scores; + top-k; + attention and
  merge), the top-k's warps, programmatic dependent
  launch (``decode_kernels.DECODE_PDL``) in the other mode than shipped, and dense SDPA decoding
  over the whole cache in the same run.
- part ``cold``: the block scores, the step and dense decoding with the L2 cache made cold in
  three ways: ``write`` (``median_ms``: triton's do_bench zero-fills a 256 MB buffer before each
  call, which leaves the L2 full of dirty lines that the timed call must write back), ``read``
  (a 256 MB buffer read before each call instead: the L2 is full of clean lines) and
  ``layers`` (a model's layers: LAYERS steps over distinct caches replayed from one graph, the
  mean per step; each layer's cache was last read LAYERS steps before).

A better launch goes into ``decode_kernels``; then ``openmsa bench --decode`` measures the step
against dense on every selection kind.

    python benchmarks/bench_decode_kernels.py --out DIR [--parts scores,step]
        [--seqlens 131072,524288] [--batches 1,8,32]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time

import torch
import torch.nn.functional as F
import triton

from openmsa.bench.decode import HBM_BYTES_PER_S
from openmsa.bench.selection import index_inputs
from openmsa.bench.timing import captured, graphed, median_ms, median_ms_read_flushed
from openmsa.ops.decode_kernels import (DECODE_PDL, decode_attention, decode_block_scores,
                                        decode_top_blocks, top_blocks_warps)

LAUNCHES = [(None, None, None)] + [  # the shipped launch first
    (blocks, warps, stages) for blocks, warps, stages in itertools.product((4, 8, 16), (4, 8),
                                                                           (1, 2, 3))]
TOP_K_WARPS = (2, 4, 8)
LAYERS = 8
HEADS, KV_HEADS, TOP_K, BLOCK = 64, 4, 16, 128
TOP = dict(top_k=TOP_K, block_size=BLOCK, num_local_blocks=1, num_sink_blocks=0)


def decode_inputs(context, batch, index_heads, head_dim, seed, with_cache=True):
    """One new token per sequence against full caches (coherent index keys): index_q, index_k,
    lengths and, ``with_cache``, q, k, v (bf16)."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    index_q, index_k = index_inputs("coherent", context, index_heads, head_dim, generator,
                                    "cuda")
    index_q = index_q[None, -1:].expand(batch, 1, -1, -1).contiguous()
    index_k = index_k[None].expand(batch, -1, -1, -1).contiguous()
    lengths = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    inputs = dict(index_q=index_q, index_k=index_k, lengths=lengths)
    if with_cache:
        inputs["q"] = torch.randn(batch, 1, HEADS, head_dim, device="cuda",
                                  generator=generator).bfloat16()
        inputs["k"], inputs["v"] = (torch.randn(batch, context, KV_HEADS, head_dim,
                                                device="cuda", generator=generator).bfloat16()
                                    for _ in range(2))
    return inputs


def sweep_scores(index_q, index_k, lengths, scale, row):
    """The block-score kernel at each of LAUNCHES (checked to score as the shipped one)."""
    rows = []
    floor_ms = index_k.numel() * index_k.element_size() / HBM_BYTES_PER_S * 1e3
    expected = decode_block_scores(index_q, index_k, lengths, BLOCK, scale)
    for blocks, warps, stages in LAUNCHES:
        launch = None if warps is None else dict(num_warps=warps, num_stages=stages)

        def scores():
            return decode_block_scores(index_q, index_k, lengths, BLOCK, scale,
                                       blocks_per_program=blocks, launch=launch)

        assert torch.equal(scores(), expected), (blocks, warps, stages)
        ms = median_ms(graphed(scores))
        rows.append(dict(row, part="scores", blocks_per_program=blocks, num_warps=warps,
                         num_stages=stages, ms=ms, floor_ms=floor_ms, x_floor=ms / floor_ms,
                         shipped=launch is None))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def time_step(q, k, v, index_q, index_k, lengths, scale, row):
    """The step's kernels one prefix at a time, the top-k's warps, and dense."""
    pow2 = triton.next_power_of_2(-(-k.shape[1] // BLOCK))

    def scores(pdl=None):
        return decode_block_scores(index_q, index_k, lengths, BLOCK, scale, pdl=pdl)

    def selection(warps=None, pdl=None):
        return decode_top_blocks(scores(pdl), lengths, num_warps=warps, pdl=pdl, **TOP)

    def step(warps=None, pdl=None):
        return decode_attention(q, k, v, selection(warps, pdl), lengths, BLOCK,
                                q.shape[-1] ** -0.5, pdl=pdl)

    shipped_warps = top_blocks_warps(pow2)
    heads = [t.transpose(1, 2) for t in (q, k, v)]
    timings = {"dense": lambda: F.scaled_dot_product_attention(*heads, enable_gqa=True),
               "scores": scores, "scores+top-k": selection, "step": step}
    for warps in TOP_K_WARPS:
        if warps != shipped_warps:
            timings[f"step, top-k on {warps} warps"] = lambda warps=warps: step(warps)
    pdl = not DECODE_PDL  # the other launch mode than the shipped one
    assert torch.equal(step(pdl=pdl), step())
    timings[f"step, programmatic dependent launch {'on' if pdl else 'off'}"] = (
        lambda: step(pdl=pdl))
    rows = []
    for name, fn in timings.items():
        rows.append(dict(row, part="step", stage=name, ms=median_ms(graphed(fn)),
                         top_k_warps_shipped=shipped_warps))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def layers_ms(make_step) -> float:
    """Mean ms per step of LAYERS steps over distinct caches (``make_step(layer)`` builds one
    layer's inputs and returns its step), replayed from one graph without flushing."""
    steps = [make_step(layer) for layer in range(LAYERS)]
    graph, _ = captured(lambda: [step() for step in steps])
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 20
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / LAYERS


def time_cold(context, batch, index_heads, head_dim, scale, row):
    """Scores, step and dense with the L2 made cold by a write, by reads, and by layers."""
    def make(layer):
        inputs = decode_inputs(context, batch, index_heads, head_dim, context + batch + layer)
        q, k, v, index_q, index_k, lengths = (inputs[name] for name in (
            "q", "k", "v", "index_q", "index_k", "lengths"))
        heads = [t.transpose(1, 2) for t in (q, k, v)]

        def scores():
            return decode_block_scores(index_q, index_k, lengths, BLOCK, scale)

        def step():
            ids = decode_top_blocks(scores(), lengths, **TOP)
            return decode_attention(q, k, v, ids, lengths, BLOCK, head_dim ** -0.5)

        return dict(scores=scores, step=step,
                    dense=lambda: F.scaled_dot_product_attention(*heads, enable_gqa=True))

    rows = []
    first = make(0)
    for name in ("scores", "step", "dense"):
        graph = graphed(first[name])
        timed = dict(write=median_ms(graph), read=median_ms_read_flushed(graph),
                     layers=layers_ms(lambda layer: first[name] if layer == 0
                                      else make(layer)[name]))
        for cold, ms in timed.items():
            rows.append(dict(row, part="cold", stage=name, cold=cold, ms=ms))
            print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--parts", default="scores,step")
    parser.add_argument("--seqlens", default="131072,524288")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--index-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    parts = args.parts.split(",")
    scale = args.head_dim ** -0.5
    rows = []
    for context, batch in itertools.product(map(int, args.seqlens.split(",")),
                                            map(int, args.batches.split(","))):
        row = dict(context=context, batch=batch)
        if "scores" in parts:
            inputs = decode_inputs(context, batch, args.index_heads, args.head_dim,
                                   context + batch, with_cache=False)
            rows += sweep_scores(inputs["index_q"], inputs["index_k"], inputs["lengths"], scale,
                                 row)
        if "cold" in parts:
            rows += time_cold(context, batch, args.index_heads, args.head_dim, scale, row)
        if "step" in parts:
            inputs = decode_inputs(context, batch, args.index_heads, args.head_dim,
                                   context + batch)
            rows += time_step(*(inputs[name] for name in (
                "q", "k", "v", "index_q", "index_k", "lengths")), scale, row)
        inputs = None
    with open(os.path.join(args.out, "bench_decode_kernels.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                       triton=triton.__version__, date=time.strftime("%Y-%m-%d"),
                       args=vars(args), rows=rows), f, indent=2)
    shapes = lambda part: itertools.groupby([r for r in rows if r["part"] == part],
                                            lambda r: (r["context"], r["batch"]))
    if "scores" in parts:
        print(f"\n{'context':>8} {'batch':>5} {'shipped ms':>10} {'best ms':>8} "
              f"{'best launch':>22} {'floor ms':>8}")
        for (context, batch), group in shapes("scores"):
            group = list(group)
            best = min(group, key=lambda r: r["ms"])
            launch = (best["blocks_per_program"], best["num_warps"], best["num_stages"])
            print(f"{context:>8} {batch:>5} {group[0]['ms']:>10.4f} {best['ms']:>8.4f} "
                  f"{str(launch):>22} {group[0]['floor_ms']:>8.4f}")
    if "cold" in parts:
        print(f"\n{'context':>8} {'batch':>5} {'stage':>6} {'write us':>8} {'read us':>8} "
              f"{'layers us':>9}")
        for (context, batch), group in shapes("cold"):
            for stage, cells in itertools.groupby(group, lambda r: r["stage"]):
                us = {r["cold"]: 1e3 * r["ms"] for r in cells}
                print(f"{context:>8} {batch:>5} {stage:>6} {us['write']:>8.1f} "
                      f"{us['read']:>8.1f} {us['layers']:>9.1f}")
    if "step" in parts:
        for (context, batch), group in shapes("step"):
            cells = ", ".join(f"{r['stage']} {1e3 * r['ms']:.1f}" for r in group)
            print(f"{context} batch {batch} (us): {cells}")


if __name__ == "__main__":
    main()
