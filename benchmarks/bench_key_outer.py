"""The main attention's forward and dQ with the tiles of long walks taken key-outer
(``attention.key_outer``), at several walk limits, on every selection kind (GPU only).

    python benchmarks/bench_key_outer.py --out DIR [--seqlens 8192,32768,131072]
        [--limits 0,1.5,2,3,4] [--key-outer-kernels gluon,triton] [--partial-gib 2,8]
        [--dq-partials float32,input] [--index-lse walk,split]
        [--dq-routes walk,dkdv_atomic,hard_atomic] [--kl-teachers recompute,from_dkdv]
        [--heads 64,4,4] [--kernels]
        [--launches 8x2,4x2,8x3]
        [--combine-launches 64x4,128x8] [--hopper-stages 3,4,6]

A limit L sends the query tiles whose union holds more than L x top_k blocks key-outer; 0 walks
every tile (the kernels before). H64/Hkv4/Hi4/Hik1 (``--heads H,Hkv,Hi``: others, e.g. 16,2,4
for the short-context targets' second shape), D = Di = 128, top 16 of 128, bf16, B = 1.
Per row: the selection's neighbours' Jaccard and 8-token union, the share of rows taken
key-outer, the main attention's forward and backward (dQ, dK/dV) alone on a problem whose work
lists are built beforehand, the whole training step (selection, main attention, KL; forward and
backward) through ``msa_attention``'s kernels at that limit, dense SDPA's step in the same run,
and how far out and dq lie from the walk's (relative RMS). Each limit above 0 is timed with the
key-outer passes on each of ``--key-outer-kernels`` (the Gluon kernels, the Triton ones) and
each of ``--partial-gib`` (the memory their partials take at once) and ``--dq-partials``
(dQ's partials in fp32 or bf16); each limit, 0 too, with each of ``--index-lse`` (the index
log-sum-exp's walk alone, or split with a key-outer pass: ``Tuning.index_lse_split``, in the
step's times only) and of ``--dq-routes`` (every row's dQ from the walk, its hard rows by the
key-outer dQ, "dkdv_atomic": from the dK/dV pass's atomic sums, or "hard_atomic": the hard
rows' alone from those sums, on the segments holding one, ``Tuning.dq_pass``; no dQ partials
or key-outer dQ then);
``--kl-teachers`` also times each row's step with ``kl_value=False`` (no KL value in the
forward) under each ``Tuning.kl_teacher`` listed ("recompute": the KL pass rebuilds the
teachers; "from_dkdv": the backward's dK/dV pass stores them);
``--kernels`` adds each row's kernel times (torch profiler) of one forward and one backward.
``--launches WxS,...``: also times
the key-outer kernels' launch (warps x stages, ``configs.KEY_OUTER_CONFIG``) at the last limit,
forward and backward alone; ``--hopper-stages S,...`` the Gluon key-outer kernels' kernel
times with rings of S steps (``configs.KEY_OUTER_HOPPER_STAGES``; a ring past the shared
memory is recorded as an error). Prints a table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import torch
import triton

from openmsa.bench.run import dense_baseline
from openmsa.bench.selection import SELECTION_KINDS, index_inputs, selection_statistics
from openmsa.bench.timing import kernel_times, median_ms
from openmsa.ops.attention import (attention_backward, key_outer, sm90_key_outer,
                                   sparse_attention_fwd)
from openmsa.ops.configs import Tuning
from openmsa.ops.layout import batch_cu_seqlens
from openmsa.ops.problem import SparseAttentionProblem
from openmsa.ops.select import select_blocks_fwd
from openmsa.testing import rel_rms_error, tuned_msa_attention

HEADS, KV_HEADS, INDEX_HEADS, DIM, TOP_K, BLOCK = 64, 4, 4, 128, 16, 128


def measure(seqlen: int, kind: str, limits, dense: dict, launches=(),
            key_outer_kernels=("gluon", "triton"), partial_gib=(2.0,),
            profile: bool = False, combine_launches=(), dq_partials=("input",),
            hopper_stages=(), index_lse=("walk",), dq_routes=("walk",),
            kl_teachers=()) -> list[dict]:
    generator = torch.Generator(device="cuda").manual_seed(seqlen)
    q, k, v = (torch.randn(seqlen, h, DIM, device="cuda", generator=generator).bfloat16()
               for h in (HEADS, KV_HEADS, KV_HEADS))
    index_q, index_k = index_inputs(kind, seqlen, INDEX_HEADS, DIM, generator)
    dout = torch.randn_like(q)
    cu = batch_cu_seqlens(1, seqlen, "cuda")
    scale = DIM ** -0.5
    ids, _ = select_blocks_fwd(index_q, index_k, cu, top_k=TOP_K, block_size=BLOCK,
                               index_softmax_scale=scale, num_local_blocks=1,
                               num_sink_blocks=0, return_max=True)
    statistics = selection_statistics(ids)
    inputs = [t[None].clone().requires_grad_() for t in (q, k, v, index_q, index_k)]
    one = torch.ones((), device="cuda")
    if not dense:
        dense.update(dense_baseline(*inputs[:3], dout[None], median_ms))
    rows, walked = [], None
    # The atomic dQ routes run no key-outer dQ, so no dQ partials; with no hard rows (limit 0)
    # "hard_atomic" is the walk.
    runs = [(limit, kernel, gib, partials, index_lse_kind, route)
            for limit in limits for route in dq_routes if limit or route != "hard_atomic"
            for kernel in (key_outer_kernels if limit else ["-"])
            for gib in (partial_gib if limit else partial_gib[:1])
            for partials in (dq_partials if limit and route == "walk" else dq_partials[:1])
            for index_lse_kind in index_lse]
    for limit, kernel, gib, partials, index_lse_kind, route in runs:
        key_outer.KEY_OUTER_HOPPER = kernel != "triton"
        tuning = Tuning(main_walk_limit_per_slot=limit,
                        key_outer_partial_bytes=int(gib * (1 << 30)),
                        key_outer_dq_partials=partials,
                        index_lse_split=index_lse_kind == "split", dq_pass=route)
        problem = SparseAttentionProblem(q, k, ids, cu, BLOCK, scale, tuning=tuning)
        problem.block_work  # the step builds it for dK/dV anyway
        blocks = key_outer.walk_limit(problem)
        hard = key_outer.hard_rows(problem, blocks).float().mean().item() if blocks else 0.0
        out, lse, _ = sparse_attention_fwd(q, k, v, None, None, problem)
        dq = attention_backward(q, k, v, out, dout, lse, problem)[0]
        if walked is None:
            walked = (out, dq)
        step = tuned_msa_attention(tuning)

        def msa_step():
            result, kl = step(*inputs, top_k=TOP_K, block_size=BLOCK)
            torch.autograd.grad((result, kl), inputs, (dout[None], one))

        row = dict(seqlen=seqlen, selection=kind, limit_per_slot=limit, walk_limit_blocks=blocks,
                   key_outer_kernels=kernel, partial_gib=gib, dq_partials=partials,
                   index_lse=index_lse_kind, dq_route=route,
                   hard_row_share=hard, **statistics,
                   fwd_ms=median_ms(lambda: sparse_attention_fwd(q, k, v, None, None, problem)),
                   bwd_ms=median_ms(lambda: attention_backward(q, k, v, out, dout, lse,
                                                               problem)),
                   step_ms=median_ms(msa_step),
                   out_vs_walk=rel_rms_error(out.float(), walked[0].float()),
                   dq_vs_walk=rel_rms_error(dq.float(), walked[1].float()), **dense)
        if "dense_fwd_bwd_ms" in dense:
            row["step_x_dense"] = dense["dense_fwd_bwd_ms"] / row["step_ms"]
        for teacher in kl_teachers:
            no_value = tuned_msa_attention(dataclasses.replace(tuning, kl_teacher=teacher))

            def step_without_value():
                result, kl = no_value(*inputs, top_k=TOP_K, block_size=BLOCK, kl_value=False)
                torch.autograd.grad((result, kl), inputs, (dout[None], one))

            row[f"step_no_kl_value_{teacher}_ms"] = median_ms(step_without_value)
        if profile:
            row["fwd_kernels_ms"] = kernel_times(
                lambda: sparse_attention_fwd(q, k, v, None, None, problem), top=10)
            row["bwd_kernels_ms"] = kernel_times(
                lambda: attention_backward(q, k, v, out, dout, lse, problem), top=10)
        rows.append(row)
        print(json.dumps(row), flush=True)
    key_outer.KEY_OUTER_HOPPER = True
    for launch in combine_launches:
        combine_rows, warps = map(int, launch.split("x"))
        shipped = (key_outer.KEY_OUTER_COMBINE_ROWS, key_outer.KEY_OUTER_SUM_ROWS,
                   key_outer.KEY_OUTER_COMBINE_WARPS)
        (key_outer.KEY_OUTER_COMBINE_ROWS, key_outer.KEY_OUTER_SUM_ROWS,
         key_outer.KEY_OUTER_COMBINE_WARPS) = combine_rows, combine_rows, warps
        try:
            forward = kernel_times(lambda: sparse_attention_fwd(q, k, v, None, None, problem))
            backward = kernel_times(lambda: attention_backward(q, k, v, out, dout, lse,
                                                               problem))
            row = dict(seqlen=seqlen, selection=kind, limit_per_slot=limits[-1],
                       combine_launch=launch, combine_ms=forward.get("_combine_kernel", 0.0),
                       dq_sum_ms=backward.get("_dq_sum_kernel", 0.0))
        finally:
            (key_outer.KEY_OUTER_COMBINE_ROWS, key_outer.KEY_OUTER_SUM_ROWS,
             key_outer.KEY_OUTER_COMBINE_WARPS) = shipped
        rows.append(row)
        print(json.dumps(row), flush=True)
    passes = (("fwd", lambda: sparse_attention_fwd(q, k, v, None, None, problem)),
              ("bwd", lambda: attention_backward(q, k, v, out, dout, lse, problem)))
    for stages in hopper_stages:
        row = dict(seqlen=seqlen, selection=kind, limit_per_slot=limits[-1],
                   hopper_stages=stages)
        for name, run in passes:
            row.update(_hopper_key_outer_ms(name, run, stages))
        rows.append(row)
        print(json.dumps(row), flush=True)
    for launch in launches:
        warps, stages = map(int, launch.split("x"))
        shipped = dict(key_outer.KEY_OUTER_CONFIG)
        key_outer.KEY_OUTER_CONFIG.update(num_warps=warps, num_stages=stages)
        try:
            row = dict(seqlen=seqlen, selection=kind, limit_per_slot=limits[-1], launch=launch,
                       fwd_ms=median_ms(lambda: sparse_attention_fwd(q, k, v, None, None,
                                                                     problem)),
                       bwd_ms=median_ms(lambda: attention_backward(q, k, v, out, dout, lse,
                                                                   problem)))
        finally:
            key_outer.KEY_OUTER_CONFIG.update(shipped)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _hopper_key_outer_ms(name: str, run, stages: int) -> dict:
    """The Gluon key-outer kernel's time in one ``run`` (a pass, ``name``) with rings of
    ``stages`` steps, or the error of a ring past the shared memory."""
    shipped = sm90_key_outer.KEY_OUTER_HOPPER_STAGES
    sm90_key_outer.KEY_OUTER_HOPPER_STAGES = stages
    try:
        return {f"{name}_key_outer_ms": kernel_times(run).get("_key_outer_hopper_kernel", 0.0)}
    except Exception as error:  # more stages than the shared memory holds
        return {f"{name}_key_outer_ms": None,
                f"{name}_error": f"{type(error).__name__}: {str(error)[:200]}"}
    finally:
        sm90_key_outer.KEY_OUTER_HOPPER_STAGES = shipped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seqlens", default="8192,32768,131072")
    parser.add_argument("--kinds", default=",".join(SELECTION_KINDS))
    parser.add_argument("--limits", default="0,1.5,2,3,4")
    parser.add_argument("--launches", default="")
    parser.add_argument("--key-outer-kernels", default="gluon,triton",
                        help="at each limit > 0, time the key-outer passes on these kernels")
    parser.add_argument("--partial-gib", default="2",
                        help="at each limit > 0, Tuning.key_outer_partial_bytes (GiB) to time")
    parser.add_argument("--dq-partials", default="input",
                        help="at each limit > 0, Tuning.key_outer_dq_partials to time")
    parser.add_argument("--combine-launches", default="",
                        help="RxW,...: the combine's and dQ sum's rows and warps a program to "
                        "time (kernel times) at the last limit")
    parser.add_argument("--hopper-stages", default="",
                        help="S,...: the Gluon key-outer kernels' ring stages to time (kernel "
                        "times, forward and dQ) at the last limit")
    parser.add_argument("--index-lse", default="walk",
                        help="at each limit, the index log-sum-exp to time in the step: walk, "
                        "split (Tuning.index_lse_split)")
    parser.add_argument("--dq-routes", default="walk",
                        help="comma-separated Tuning.dq_pass values: walk, dkdv_atomic, "
                        "hard_atomic")
    parser.add_argument("--kl-teachers", default="",
                        help="comma-separated Tuning.kl_teacher values: recompute, from_dkdv")
    parser.add_argument("--heads", default="64,4,4",
                        help="H,Hkv,Hi of the problem (one index key head)")
    parser.add_argument("--kernels", action="store_true",
                        help="also record each row's forward and backward kernel times")
    args = parser.parse_args()
    global HEADS, KV_HEADS, INDEX_HEADS
    HEADS, KV_HEADS, INDEX_HEADS = (int(x) for x in args.heads.split(","))
    os.makedirs(args.out, exist_ok=True)
    limits = [float(x) for x in args.limits.split(",")]
    rows = []
    for seqlen in map(int, args.seqlens.split(",")):
        dense: dict = {}
        for kind in args.kinds.split(","):
            rows += measure(seqlen, kind, limits, dense,
                            [x for x in args.launches.split(",") if x],
                            args.key_outer_kernels.split(","),
                            [float(x) for x in args.partial_gib.split(",")], args.kernels,
                            [x for x in args.combine_launches.split(",") if x],
                            args.dq_partials.split(","),
                            [int(x) for x in args.hopper_stages.split(",") if x],
                            args.index_lse.split(","), args.dq_routes.split(","),
                            kl_teachers=[x for x in args.kl_teachers.split(",") if x])
    result = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                  triton=triton.__version__, date=time.strftime("%Y-%m-%d"), args=vars(args),
                  config=f"H{HEADS}/Hkv{KV_HEADS}/Hi{INDEX_HEADS}/Hik1 D=Di={DIM} top {TOP_K} "
                  f"of {BLOCK}, bf16, B=1", rows=rows)
    with open(os.path.join(args.out, "bench_key_outer.json"), "w") as handle:
        json.dump(result, handle, indent=2)
    print(f"\nkey-outer forward and dQ by walk limit, {result['gpu']}, {result['config']}")
    print(f"{'S':>7} {'selection':>9} {'Jacc':>5} {'union8':>6} {'limit':>5} {'kernels':>7} "
          f"{'GiB':>4} {'dQ part':>7} {'dQ':>6} {'idx lse':>7} {'hard':>5} "
          f"{'fwd ms':>8} {'bwd ms':>8} {'step ms':>8} {'x dense':>7} {'out/dq vs walk':>16}")
    for r in rows:
        if "hopper_stages" in r:
            print(f"{r['seqlen']:>7} {r['selection']:>9} Gluon key-outer, {r['hopper_stages']} "
                  f"stages: forward {r['fwd_key_outer_ms']} ms, dQ {r['bwd_key_outer_ms']} ms")
            continue
        if "combine_launch" in r:
            print(f"{r['seqlen']:>7} {r['selection']:>9} combine {r['combine_launch']}: "
                  f"combine {r['combine_ms']:.2f} ms, dq sum {r['dq_sum_ms']:.2f} ms")
            continue
        if "launch" in r:
            print(f"{r['seqlen']:>7} {r['selection']:>9} launch {r['launch']}: fwd "
                  f"{r['fwd_ms']:.2f} ms, bwd {r['bwd_ms']:.2f} ms")
            continue
        dq_route = {"dkdv_atomic": "atomic", "hard_atomic": "hard"}.get(r["dq_route"], "walk")
        print(f"{r['seqlen']:>7} {r['selection']:>9} {r['jaccard']:>5.2f} {r['union_8']:>6.1f} "
              f"{r['limit_per_slot']:>5.1f} {r['key_outer_kernels']:>7} {r['partial_gib']:>4g} "
              f"{r['dq_partials']:>7} {dq_route:>6} {r['index_lse']:>7} "
              f"{r['hard_row_share']:>5.2f} {r['fwd_ms']:>8.2f} "
              f"{r['bwd_ms']:>8.2f} {r['step_ms']:>8.2f} {r.get('step_x_dense', 0):>6.2f}x "
              f"{r['out_vs_walk']:>7.1e}/{r['dq_vs_walk']:>7.1e}")
        no_value = {key[len("step_no_kl_value_"):-len("_ms")]: value for key, value in r.items()
                    if key.startswith("step_no_kl_value_")}
        if no_value:
            print(" " * 17 + "step without the KL value, by teacher: " + ", ".join(
                f"{teacher} {ms:.2f} ms" for teacher, ms in no_value.items()))


if __name__ == "__main__":
    main()
