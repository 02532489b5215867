"""``openmsa bench``: MSA against dense attention, in the same run, on a CUDA GPU.

For each sequence length and each selection kind (coherent, mid, random by default: speed
depends on how much neighbouring tokens' kept blocks overlap, so every row reports the measured
neighbours' Jaccard and 8-token union): MSA forward, backward and forward+backward
(``msa_attention`` with the KL, through autograd), its parts (selection, main attention, KL =
the rest), dense PyTorch SDPA (once per length: it does not depend on the selection),
FlexAttention with a block mask of the same budget (each 128-query tile keeps top_k blocks) and
flash-linear-attention's NSA selection kernels (``ParallelNSAFunction``, optional ``fla-core``)
on the same block ids when ``Hi = Hkv``. Before any timing, MSA is checked against the
reference on random inputs of the same head configuration (2048 tokens; bf16 errors at most
2x the reference's own); a shape that fails is reported, not timed.
Baselines that fail (out of memory, no FlexAttention) are reported as skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from ..ops.configs import TUNINGS
from ..ops.msa import GPU_HEAD_DIMS
from ..ops.quantize import INDEX_PRECISIONS
from ..ops.validate import MAX_TOP_K, SUPPORTED_BLOCK_SIZES
from . import flops
from .options import msa_options, step_options
from .selection import SELECTION_KINDS, index_inputs, selection_statistics

PRESETS = {"h64": (64, 4, 4), "h16": (16, 2, 4)}  # (H, Hkv, Hi), Hik = 1
DEFAULT_SEQLENS = "4k,16k,32k,128k"
CHECK_TOKENS = 2048


def parse_length(text: str) -> int:
    """'4096', '4k' (= 4096), '1m' (= 1048576); at least 1."""
    units = {"k": 1 << 10, "m": 1 << 20}
    text = text.strip().lower()
    try:
        length = int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a length like 4096, 4k or 1m, got {text!r}")
    if length < 1:
        raise argparse.ArgumentTypeError(f"expected a positive length, got {text!r}")
    return length


def parse_lengths(text: str) -> list[int]:
    lengths = [parse_length(part) for part in text.split(",") if part.strip()]
    if not lengths:
        raise argparse.ArgumentTypeError(f"expected comma-separated lengths, got {text!r}")
    return lengths


def parse_heads(text: str) -> tuple[int, int, int]:
    try:
        heads, kv_heads, index_heads = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected H,Hkv,Hi like 64,4,4, got {text!r}")
    if min(heads, kv_heads, index_heads) < 1:
        raise argparse.ArgumentTypeError(f"expected positive head counts, got {text!r}")
    if heads % kv_heads or heads % index_heads or index_heads % kv_heads:
        raise argparse.ArgumentTypeError(
            f"expected H % Hkv == H % Hi == Hi % Hkv == 0, got {text!r}")
    return heads, kv_heads, index_heads


def parse_top_k(text: str) -> int:
    try:
        top_k = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
    if not 1 <= top_k <= MAX_TOP_K:
        raise argparse.ArgumentTypeError(f"expected an integer in [1, {MAX_TOP_K}], got {top_k}")
    return top_k


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default="h64",
                        help="head configuration: h64 = H64/Hkv4/Hi4, h16 = H16/Hkv2/Hi4")
    parser.add_argument("--heads", type=parse_heads, help="H,Hkv,Hi (overrides --preset)")
    # String defaults go through ``type`` too: the help shows them as written.
    parser.add_argument("--seqlens", type=parse_lengths, default=DEFAULT_SEQLENS,
                        help="comma-separated lengths, 4k..1m")
    parser.add_argument("--head-dim", type=int, choices=GPU_HEAD_DIMS, default=128,
                        help="head dim of the main and the index branch")
    parser.add_argument("--top-k", type=parse_top_k, default=16,
                        help="blocks kept per query token and index head")
    parser.add_argument("--block-size", type=int, choices=SUPPORTED_BLOCK_SIZES, default=128,
                        help="tokens per key block")
    parser.add_argument("--selection", "--selections", dest="selections",
                        type=parse_selections, default="coherent,mid,random",
                        help="comma-separated kinds of index inputs, each timed: coherent (like "
                        "a trained index branch), mid (neighbours' Jaccard about 0.5), random")
    parser.add_argument("--index-precision", choices=INDEX_PRECISIONS, default="input",
                        help="selection's index scores: input (bf16) or fp8")
    parser.add_argument("--tuning", choices=sorted(TUNINGS) + ["auto"], default="default",
                        help="the MSA step's kernel routes (msa_attention's tuning): incoherent "
                        "for selections whose neighbours keep different blocks, adaptive: each "
                        "query tile's route by its union, auto: either by the previous step's "
                        "long walks")
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    parser.add_argument("--no-fla", action="store_true",
                        help="skip flash-linear-attention's NSA kernels (pip install fla-core)")
    parser.add_argument("--baseline-max-seqlen", type=parse_length, default="128k",
                        help="time dense SDPA and FlexAttention up to this length (a dense "
                             "step at 1M takes minutes)")
    parser.add_argument("--out", default="runs/bench", help="folder for bench.json and plots")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the plan and the FLOP counts, run nothing")
    parser.add_argument("--decode", action="store_true",
                        help="time one decode step (msa_decode, one new token per sequence) "
                        "against dense decoding at each --seqlens context and --batches size, "
                        "next to the memory-bandwidth floor, instead of training steps")
    parser.add_argument("--batches", type=parse_batches, default="1,8,32",
                        help="batch sizes of --decode")
    parser.add_argument("--prefill-seqlens", type=parse_optional_lengths, default="128k",
                        help="--decode: prompt lengths whose prefill through msa_decode is timed "
                        "against the training forward ('' for none)")


def plan(args) -> list[dict]:
    heads, kv_heads, index_heads = args.heads or PRESETS[args.preset]
    rows = []
    for seqlen in args.seqlens:
        triples = flops.max_kept_triples(seqlen, heads, args.top_k, args.block_size)
        rows.append(dict(
            shape=f"H{heads}/Hkv{kv_heads}/Hi{index_heads}", seqlen=seqlen, heads=heads,
            kv_heads=kv_heads, index_heads=index_heads, head_dim=args.head_dim,
            top_k=args.top_k, block_size=args.block_size,
            dense_fwd_tflop=flops.dense_attention_flops(seqlen, heads, args.head_dim) / 1e12,
            msa_main_fwd_tflop=flops.main_attention_flops(triples, args.head_dim) / 1e12,
            index_tflop=flops.index_scoring_flops(seqlen, index_heads, args.head_dim) / 1e12))
    return rows


def parse_batches(text: str) -> list[int]:
    try:
        batches = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated batch sizes, got {text!r}")
    if not batches or min(batches) < 1:
        raise argparse.ArgumentTypeError(f"expected positive batch sizes, got {text!r}")
    return batches


def parse_selections(text: str) -> list[str]:
    kinds = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [kind for kind in kinds if kind not in SELECTION_KINDS]
    if not kinds or unknown:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated kinds of {', '.join(SELECTION_KINDS)}, got {text!r}")
    return kinds


def parse_optional_lengths(text: str) -> list[int]:
    return parse_lengths(text) if text.strip() else []


def run_decode(args) -> int:
    """``--decode``: decode steps against dense decoding (openmsa.bench.decode)."""
    from . import decode

    rows = decode.plan(args, args.heads or PRESETS[args.preset])
    print(f"openmsa bench --decode: top_k={args.top_k} block_size={args.block_size} "
          f"selections={','.join(args.selections)} index_precision={args.index_precision}; "
          f"bytes a step "
          f"reads at {decode.HBM_BYTES_PER_S / 1e12:.0f} TB/s (floors, ms):")
    if args.dry_run:
        decode.print_table(rows)
        return 0
    if not torch.cuda.is_available():
        import sys

        print("openmsa bench needs a CUDA GPU (use --dry-run to see the plan)", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    heads = args.heads or PRESETS[args.preset]
    results, prefill = [], []
    for number, row in enumerate(rows, 1):
        print(f"[{number}/{len(rows)}] context {row['context']}, batch {row['batch']}",
              flush=True)
        results += decode.measure(row, args)
    for context in args.prefill_seqlens:
        prefill.append(decode.measure_prefill(context, heads, args))
    with open(os.path.join(args.out, "bench_decode.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                       date=time.strftime("%Y-%m-%d"),
                       args={k: v for k, v in vars(args).items() if k != "handler"},
                       rows=results, prefill=prefill), f, indent=2, default=str)
    decode.print_table(results)
    for p in prefill:
        print(f"prefill {p['context']}: msa_decode {p['prefill_ms']:.2f} ms, training forward "
              f"{p['training_forward_ms']:.2f} ms ({p['prefill_vs_forward']:.3f}x)")
    return 0


def run(args) -> int:
    if args.decode:
        return run_decode(args)
    rows = plan(args)
    print(f"openmsa bench: top_k={args.top_k} block_size={args.block_size} "
          f"selections={','.join(args.selections)} index_precision={args.index_precision} "
          f"tuning={args.tuning}; FLOPs (TFLOP, forward, at most top_k blocks a token): "
          "dense / MSA main / index")
    for row in rows:
        print(f"  {row['shape']} S={row['seqlen']}: {row['dense_fwd_tflop']:.2f} / "
              f"{row['msa_main_fwd_tflop']:.2f} / {row['index_tflop']:.2f}")
    if args.dry_run:
        return 0
    if not torch.cuda.is_available():
        import sys

        print("openmsa bench needs a CUDA GPU (use --dry-run to see the plan)", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    results = []
    for number, row in enumerate(rows, 1):
        dense = {}  # dense attention does not depend on the selection: timed once per length
        for kind in args.selections:
            print(f"[{number}/{len(rows)}] S={row['seqlen']}, {kind} selection", flush=True)
            results.append(measure(row, args, kind, dense))
    report = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                  date=time.strftime("%Y-%m-%d"), args={k: v for k, v in vars(args).items()
                                                        if k != "handler"}, rows=results)
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump(report, f, indent=2, default=str)
    print_table(results)
    plot(results, args.out)
    return 0


def make_inputs(row, seqlen, selection, device="cuda", seed=0):
    """bf16 q, k, v, index_q, index_k ``[1, S, heads, D]`` requiring grad."""
    generator = torch.Generator(device=device).manual_seed(seed + seqlen)
    d = row["head_dim"]
    q, k, v = (torch.randn(1, seqlen, h, d, device=device, generator=generator).bfloat16()
               for h in (row["heads"], row["kv_heads"], row["kv_heads"]))
    index_q, index_k = index_inputs(selection, seqlen, row["index_heads"], d, generator, device)
    return [t.requires_grad_() for t in (q, k, v, index_q[None], index_k[None])]


def measure(row, args, selection: str, dense: dict) -> dict:
    """One row: ``row``'s shape on ``selection``'s index inputs. ``dense``: the dense baseline's
    figures at this length, filled by the first kind that times them."""
    from ..ops.msa import msa_attention, select_blocks, sparse_attention
    from ..testing import TOLERANCE, MSACase, compare_with_reference
    from .timing import median_ms

    seqlen = row["seqlen"]
    options, step = msa_options(args), step_options(args)
    result = dict(row, selection=selection, tuning=args.tuning)
    case = MSACase("check", batch=1, seqlen=min(seqlen, CHECK_TOKENS), num_heads=row["heads"],
                   num_kv_heads=row["kv_heads"], num_index_heads=row["index_heads"],
                   head_dim=row["head_dim"], index_head_dim=row["head_dim"], options=step)
    comparison = compare_with_reference(msa_attention, case, torch.bfloat16, "cuda")
    result["check_errors"] = comparison.errors
    if not comparison.passed(TOLERANCE[torch.bfloat16]):
        result["status"] = "correctness check failed: not timed"
        return result

    bench = median_ms

    inputs = make_inputs(row, seqlen, selection)
    q, k, v, index_q, index_k = inputs
    dout = torch.randn_like(q)
    one = torch.ones((), device="cuda")

    def msa_step():
        out, kl = msa_attention(*inputs, **step)
        torch.autograd.grad((out, kl), inputs, (dout, one))

    def msa_forward():
        with torch.no_grad():
            msa_attention(*inputs, **step)

    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    msa_step()
    result["msa_step_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    result["msa_fwd_ms"] = bench(msa_forward)
    result["msa_fwd_bwd_ms"] = bench(msa_step)
    result["msa_bwd_ms"] = result["msa_fwd_bwd_ms"] - result["msa_fwd_ms"]
    with torch.no_grad():
        ids = select_blocks(index_q, index_k, **options)
    result["selection_ms"] = bench(lambda: select_blocks(index_q, index_k, **options))

    def attention_step():
        out = sparse_attention(q, k, v, ids, block_size=args.block_size, tuning=step["tuning"])
        torch.autograd.grad(out, (q, k, v), dout)

    result["main_attention_fwd_bwd_ms"] = bench(attention_step)
    if args.tuning == "auto":  # the route the timed steps settled on
        result["auto_long_walk_share"] = step["tuning"].long_walk_share
        result["auto_route"] = ("default" if step["tuning"].tuning == TUNINGS["default"]
                                else "adaptive")
    result["kl_fwd_bwd_ms"] = (result["msa_fwd_bwd_ms"] - result["selection_ms"]
                               - result["main_attention_fwd_bwd_ms"])
    result.update(selection_statistics(ids[0].permute(1, 0, 2)))
    triples = flops.kept_triples(ids[0].permute(1, 0, 2), args.block_size,
                                 row["heads"] // row["index_heads"])
    main_flops = flops.main_attention_flops(triples, row["head_dim"])
    result["main_attention_tflops_fwd_bwd"] = flops.tflops(
        main_flops * (1 + flops.BACKWARD_FACTOR), result["main_attention_fwd_bwd_ms"])
    result["selection_tflops"] = flops.tflops(row["index_tflop"] * 1e12, result["selection_ms"])
    if not args.no_fla:
        result.update(fla_baseline(q, k, v, dout, ids, args.block_size, bench, attention_step))
        if "fla_fwd_bwd_ms" in result:
            result["main_attention_vs_fla"] = (result["fla_fwd_bwd_ms"]
                                               / result["main_attention_fwd_bwd_ms"])
    if seqlen > args.baseline_max_seqlen:
        result["dense_status"] = result["flex_status"] = "skipped: S > --baseline-max-seqlen"
    else:
        if not dense:
            dense.update(dense_baseline(q, k, v, dout, bench), dense_selection=selection)
        result.update(dense)
        if not args.no_flex:
            result.update(flex_baseline(q, k, v, dout, ids, args.block_size, bench))
    if "dense_fwd_bwd_ms" in result:
        result["speedup_vs_dense"] = result["dense_fwd_bwd_ms"] / result["msa_fwd_bwd_ms"]
    result["status"] = "ok"
    print(json.dumps({key: value for key, value in result.items() if key != "check_errors"}),
          flush=True)
    return result


def dense_baseline(q, k, v, dout, bench) -> dict:
    import torch.nn.functional as F

    qd, kd, vd = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    doutd = dout.transpose(1, 2).contiguous()

    def forward():
        return F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)

    def step():
        torch.autograd.grad(forward(), (qd, kd, vd), doutd)

    try:
        return dict(dense_fwd_ms=bench(forward), dense_fwd_bwd_ms=bench(step))
    except torch.OutOfMemoryError:
        return dict(dense_status="skipped: out of memory")


def add_selection_and_dense(row: dict, attention, inputs, dout, dense: dict) -> None:
    """The row's measured Jaccard and union (of ``attention``'s selection) and dense SDPA's
    step (timed once per case: ``dense`` keeps it)."""
    from .timing import median_ms

    with torch.no_grad():
        _, _, ids = attention(*inputs, top_k=16, block_size=128, return_indices=True)
    row.update(selection_statistics(ids[0].permute(1, 0, 2)))
    if not dense:
        dense.update(dense_baseline(*inputs[:3], dout, median_ms))
    row["dense_step_ms"] = dense["dense_fwd_bwd_ms"]


def fla_baseline(q, k, v, dout, ids, block_size, bench, attention_step) -> dict:
    """flash-linear-attention's NSA selection kernels (``fla.ops.nsa.ParallelNSAFunction``,
    selected-block branch alone, no gates) on MSA's block ids, forward and fwd+bwd, and the
    relative RMS difference of its output from ``sparse_attention``'s (the same attention: a
    block's keys up to the query, for every kept block). Needs ``Hi = Hkv`` (fla's ids are per
    KV head) and ``H / Hkv`` a power of two >= 16 (fla's tile); reported as skipped otherwise."""
    from ..ops.msa import sparse_attention
    from ..testing import rel_rms_error

    try:
        from fla.ops.nsa.parallel import ParallelNSAFunction
    except ImportError:
        return dict(fla_status="skipped: fla-core is not installed (pip install fla-core)")
    heads, kv_heads, index_heads = q.shape[2], k.shape[2], ids.shape[1]
    group = heads // kv_heads
    if index_heads != kv_heads or group < 16 or group & (group - 1):
        return dict(fla_status=f"skipped: fla's NSA needs Hi = Hkv and H / Hkv a power of 2 >= "
                    f"16, here H{heads}/Hkv{kv_heads}/Hi{index_heads}")
    fla_ids = ids[0].permute(1, 0, 2)[None].long().contiguous()  # [1, S, Hkv, k]; -1: unused
    scale = q.shape[-1] ** -0.5
    try:
        def forward():
            return ParallelNSAFunction.apply(q, k, v, fla_ids, ids.shape[-1], block_size,
                                             scale, None)

        def step():
            torch.autograd.grad(forward(), (q, k, v), dout)

        with torch.no_grad():
            difference = rel_rms_error(forward().float(),
                                       sparse_attention(q, k, v, ids, block_size=block_size)
                                       .float())
        return dict(fla_fwd_ms=bench(forward), fla_fwd_bwd_ms=bench(step),
                    fla_vs_msa_out_rel_rms=difference)
    except Exception as error:  # compile failures, out of memory: report, do not crash
        return dict(fla_status=f"skipped: {type(error).__name__}: {error}"[:200])


def flex_block_mask(ids: torch.Tensor, num_heads: int, seqlen: int):
    """FlexAttention block mask with MSA's budget: every 128-query tile keeps the (up to top_k)
    128-key blocks its last token kept; causal inside. ids: ``[1, Hi, S, k]``, blocks of 128.

    The tile's own block is the only partial one (causal mask); the others are full blocks."""
    from torch.nn.attention.flex_attention import BlockMask

    tile = 128
    num_tiles = -(-seqlen // tile)
    tiles = torch.arange(num_tiles, device=ids.device)
    last_token = torch.clamp(tiles * tile + tile - 1, max=seqlen - 1)
    tile_ids = ids[0][:, last_token].long()  # [Hi, tiles, k]
    earlier = (tile_ids >= 0) & (tile_ids != tiles[None, :, None])
    unused = num_tiles  # sorts after every real block
    full = torch.where(earlier, tile_ids, unused).sort(dim=-1).values
    full_counts = earlier.sum(-1)
    # One column per key tile; columns past the count are ignored.
    full = torch.nn.functional.pad(full, (0, max(0, num_tiles - full.shape[-1])), value=unused)
    full = torch.where(full == unused, 0, full)
    heads_per_index = num_heads // ids.shape[1]

    def per_head(t):
        return t.repeat_interleave(heads_per_index, dim=0)[None].to(torch.int32).contiguous()

    own = torch.zeros(num_heads, num_tiles, num_tiles, dtype=torch.long, device=ids.device)
    own[..., 0] = tiles
    # The mask function must define the mask exactly (the block lists only let kernels skip
    # work): a [H, tiles, tiles] table of kept tiles, causal inside.
    kept = torch.zeros(ids.shape[1], num_tiles, num_tiles + 1, dtype=torch.bool,
                       device=ids.device)
    kept.scatter_(2, torch.where(tile_ids >= 0, tile_ids, num_tiles), True)
    kept = kept[..., :num_tiles].repeat_interleave(heads_per_index, dim=0)

    def causal(b, h, q_idx, kv_idx):
        return kept[h, q_idx // tile, kv_idx // tile] & (q_idx >= kv_idx)

    return BlockMask.from_kv_blocks(
        torch.ones(1, num_heads, num_tiles, dtype=torch.int32, device=ids.device),
        own[None].to(torch.int32).contiguous(), per_head(full_counts), per_head(full),
        BLOCK_SIZE=tile, mask_mod=causal, seq_lengths=(seqlen, seqlen))


def flex_baseline(q, k, v, dout, ids, block_size, bench) -> dict:
    """FlexAttention with ``flex_block_mask`` (same budget as MSA), forward and backward."""
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:
        return dict(flex_status="skipped: no FlexAttention in this torch")
    if block_size != 128:
        return dict(flex_status="skipped: the FlexAttention baseline uses blocks of 128")
    try:
        mask = flex_block_mask(ids, q.shape[2], q.shape[1])
        compiled = torch.compile(flex_attention)
        qd, kd, vd = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
        doutd = dout.transpose(1, 2).contiguous()

        def forward():
            return compiled(qd, kd, vd, block_mask=mask, enable_gqa=True)

        def step():
            torch.autograd.grad(forward(), (qd, kd, vd), doutd)

        return dict(flex_fwd_ms=bench(forward), flex_fwd_bwd_ms=bench(step))
    except Exception as error:  # compile failures, out of memory: report, do not crash
        return dict(flex_status=f"skipped: {type(error).__name__}: {error}"[:200])


def print_table(results: list[dict]) -> None:
    print(f"\n{'shape':>13} {'S':>8} {'selection':>9} {'Jaccard':>7} {'union8':>6} "
          f"{'msa f+b ms':>11} {'select':>7} {'attn':>7} {'kl':>7} {'dense f+b':>10} "
          f"{'flex f+b':>9} {'fla attn':>9} {'x dense':>8} {'attn/fla':>8} {'GiB':>6}")
    for r in results:
        if r.get("status") != "ok":
            print(f"{r['shape']:>13} {r['seqlen']:>8} {r['selection']:>9}  {r.get('status')}")
            continue

        def number(key, fmt="{:.2f}"):
            return fmt.format(r[key]) if key in r else "-"

        print(f"{r['shape']:>13} {r['seqlen']:>8} {r['selection']:>9} "
              f"{number('jaccard', '{:.3f}'):>7} {number('union_8', '{:.1f}'):>6} "
              f"{number('msa_fwd_bwd_ms'):>11} "
              f"{number('selection_ms'):>7} {number('main_attention_fwd_bwd_ms'):>7} "
              f"{number('kl_fwd_bwd_ms'):>7} {number('dense_fwd_bwd_ms'):>10} "
              f"{number('flex_fwd_bwd_ms'):>9} {number('fla_fwd_bwd_ms'):>9} "
              f"{number('speedup_vs_dense'):>8} {number('main_attention_vs_fla'):>8} "
              f"{number('msa_step_extra_gib'):>6}")


def plot(results: list[dict], out_dir: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots")
        return
    done = [r for r in results if r.get("status") == "ok"]
    if not done:
        return
    figure, (times, speedups) = plt.subplots(1, 2, figsize=(11, 4))
    kinds = list(dict.fromkeys(r["selection"] for r in done))
    styles = dict(zip(SELECTION_KINDS, ("-", "--", ":")))
    dense = sorted({(r["seqlen"], r["dense_fwd_bwd_ms"]) for r in done if "dense_fwd_bwd_ms" in r})
    if dense:
        times.plot(*zip(*dense), marker="s", color="black", label="dense SDPA")
    for kind in kinds:
        rows = [r for r in done if r["selection"] == kind]
        for key, label, color in (("msa_fwd_bwd_ms", "MSA step", "C0"),
                                  ("main_attention_fwd_bwd_ms", "MSA main attention", "C1"),
                                  ("fla_fwd_bwd_ms", "fla NSA, same ids", "C2"),
                                  ("flex_fwd_bwd_ms", "FlexAttention, same budget", "C3")):
            points = [(r["seqlen"], r[key]) for r in rows if key in r]
            if points:
                times.plot(*zip(*points), marker="o", color=color, linestyle=styles[kind],
                           label=f"{label} ({kind})")
        compared = [(r["seqlen"], r["speedup_vs_dense"]) for r in rows
                    if "speedup_vs_dense" in r]
        if compared:  # none where every length is past --baseline-max-seqlen
            speedups.plot(*zip(*compared), marker="o", linestyle=styles[kind], label=kind)
    times.set(xscale="log", yscale="log", xlabel="sequence length",
              ylabel="fwd+bwd ms", title="one attention layer, fwd+bwd")
    times.legend(fontsize=6)
    speedups.axhline(1.0, color="gray", linestyle=":")
    speedups.set(xscale="log", xlabel="sequence length", ylabel="dense time / MSA time",
                 title="MSA step's speedup over dense, by selection kind")
    if speedups.get_legend_handles_labels()[0]:  # none where every length is past the baseline
        speedups.legend()
    figure.tight_layout()
    figure.savefig(os.path.join(out_dir, "bench.png"), dpi=110)
    plt.close(figure)
