"""The fp8 index branch against bf16 indexing: selection quality and the layer step (GPU only).

    python benchmarks/bench_fp8_index.py --out DIR [--quality-seqlens 32768,131072]
        [--step-seqlens 131072,1048576] [--kinds coherent,mid,random]

Config H64/Hkv4/Hi4/Hik1, D = Di = 128, top 16 of 128-token blocks, bf16 inputs, B = 1.

Quality, per selection kind (openmsa.bench.selection) on the same inputs for both precisions:
- agreement: share of (token, index head) rows whose kept set is the bf16 selection's, and the
  mean share of a row's blocks both keep;
- agreement with the fp32 reference of the same scheme, on sampled rows: the fp8 kernel against
  the fp32 reference of fp8 scoring, the bf16 kernel against the fp32 reference of bf16 inputs;
- mass recall: the share of the dense main attention's probability (fp32, every causal key) that
  the kept blocks hold, on sampled query tokens, mean over tokens and main heads. The main
  queries and keys follow the index branch here (q = its index query + noise, k = the index key
  + noise): in a trained model the index branch follows the main attention, and with unrelated
  random main inputs every selection would hold the same mass.
Steps: ``msa_attention`` fwd + bwd (selection, attention, KL) with each precision, and dense
SDPA fwd + bwd in the same run up to --dense-max-seqlen; the neighbours' Jaccard and 8-token
union of the bf16 selection next to each row. Steps of 512k tokens and more are the median of 3
calls after a warm-up one (timing.median_ms_of_few); shorter ones use timing.median_ms.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
import triton

from openmsa import msa_attention, select_blocks
from openmsa.bench.selection import index_inputs, selection_statistics
from openmsa.bench.timing import median_ms, median_ms_of_few
from openmsa.ops.naive import _select_from_index_scores, _selection_scores
from openmsa.testing import same_block_sets

HEADS, KV_HEADS, INDEX_HEADS, DIM, TOP_K, BLOCK = 64, 4, 4, 128, 16, 128
DEVICE = "cuda"
LONG_SEQLEN = 524288  # from here on steps take seconds: the median of 3 after one warm-up


def reference_rows(index_q, index_k, positions, precision, top_k=TOP_K, block_size=BLOCK,
                   num_local_blocks=1, local_block_dilation=1):
    """fp32 reference selection (the eager reference's scoring and ranking) of the query tokens
    at ``positions`` (sorted) of one sequence (index_q ``[S, Hi, Di]``, index_k ``[S, 1, Di]``):
    ids ``[n, Hi, top_k]``."""
    keys = positions[-1].item() + 1
    causal = torch.arange(keys, device=positions.device)[None, :] <= positions[:, None]
    z = _selection_scores(index_q[positions][None], index_k[None, :keys], causal,
                          index_q.shape[-1] ** -0.5, precision, torch.float32)
    ids = _select_from_index_scores(z, positions, block_size, top_k, num_local_blocks, 0,
                                    local_block_dilation)  # [1, Hi, n, k]
    return ids[0].permute(1, 0, 2)


def sampled_positions(seqlen, samples, generator):
    """``samples`` sorted query positions from the second quarter on (earlier rows keep every
    visible block in any precision)."""
    return torch.randperm(seqlen - seqlen // 4, device=generator.device,
                          generator=generator)[:samples].sort().values + seqlen // 4


def mass_recall(q, k, ids, positions, chunk=32):
    """Mean share of the dense causal attention of the queries at ``positions`` that their kept
    blocks hold. q ``[S, H, D]``, k ``[S, Hkv, D]``, ids ``[S, Hi, top_k]``."""
    shares = [_mass_recall_sum(q, k, ids, positions[start:start + chunk])
              for start in range(0, len(positions), chunk)]
    return sum(shares) / (len(positions) * HEADS)


def _mass_recall_sum(q, k, ids, positions):
    keys = positions[-1].item() + 1
    logits = torch.einsum("nhd,jhd->hnj", q[positions].float(),
                          k[:keys].float().repeat_interleave(HEADS // KV_HEADS, dim=1))
    logits = logits * DIM ** -0.5
    key_pos = torch.arange(keys, device=q.device)
    logits = logits.masked_fill(key_pos[None, None, :] > positions[None, :, None],
                                float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # [H, n, keys]
    kept_ids = ids[positions].long()  # [n, Hi, k]
    blocks = -(-keys // BLOCK)
    kept = torch.zeros(len(positions), INDEX_HEADS, blocks + 1, dtype=torch.bool,
                       device=q.device)
    kept.scatter_(2, torch.where(kept_ids >= 0, kept_ids, blocks), True)
    kept = kept[..., :blocks].repeat_interleave(BLOCK, dim=-1)[..., :keys]  # [n, Hi, keys]
    kept = kept.permute(1, 0, 2).repeat_interleave(HEADS // INDEX_HEADS, dim=0)
    return float((probs * kept).sum())


def quality(seqlen, kind, samples, seed=0):
    generator = torch.Generator(device=DEVICE).manual_seed(seed + seqlen)
    index_q, index_k = index_inputs(kind, seqlen, INDEX_HEADS, DIM, generator, DEVICE)
    # Main inputs that follow the index branch (see the module docstring).
    q = (index_q.repeat_interleave(HEADS // INDEX_HEADS, dim=1).float()
         + 0.5 * torch.randn(seqlen, HEADS, DIM, device=DEVICE, generator=generator))
    k = (index_k.float().expand(seqlen, KV_HEADS, DIM)
         + 0.5 * torch.randn(seqlen, KV_HEADS, DIM, device=DEVICE, generator=generator))
    ids = {precision: select_blocks(index_q[None], index_k[None], top_k=TOP_K,
                                    block_size=BLOCK, index_precision=precision)[0]
           .permute(1, 0, 2) for precision in ("input", "fp8")}  # [S, Hi, k]
    same = same_block_sets(ids["fp8"], ids["input"])
    both = (ids["fp8"].sort(-1).values[..., :, None] == ids["input"][..., None, :])
    both = (both & (ids["input"][..., None, :] >= 0)).any(-2).sum(-1).float()
    counts = (ids["input"] >= 0).sum(-1).float()
    positions = sampled_positions(seqlen, samples, generator)
    row = dict(seqlen=seqlen, selection=kind, samples=samples,
               agreement_with_bf16_selection=float(same.float().mean()),
               shared_blocks_with_bf16_selection=float((both / counts).mean()),
               **{f"bf16_{key}": value for key, value in
                  selection_statistics(ids["input"]).items()},
               **{f"fp8_{key}": value for key, value in
                  selection_statistics(ids["fp8"]).items()})
    for precision in ("input", "fp8"):
        reference = reference_rows(index_q, index_k, positions, precision)
        row[f"{precision}_agreement_with_fp32_reference"] = float(
            same_block_sets(ids[precision][positions], reference).float().mean())
        row[f"{precision}_mass_recall"] = mass_recall(q, k, ids[precision], positions)
    row["mass_recall_fp8_vs_bf16"] = row["fp8_mass_recall"] / row["input_mass_recall"]
    return row


def steps(seqlen, kinds, dense_max_seqlen, seed=0):
    generator = torch.Generator(device=DEVICE).manual_seed(seed + seqlen)
    q, k, v = (torch.randn(1, seqlen, h, DIM, device=DEVICE, generator=generator).bfloat16()
               .requires_grad_() for h in (HEADS, KV_HEADS, KV_HEADS))
    dout = torch.randn_like(q)
    one = torch.ones((), device=DEVICE)
    dense_ms = None
    if seqlen <= dense_max_seqlen:
        qd, kd, vd = (t.detach().transpose(1, 2).contiguous().requires_grad_()
                      for t in (q, k, v))
        doutd = dout.transpose(1, 2).contiguous()

        def dense_step():
            out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)
            torch.autograd.grad(out, (qd, kd, vd), doutd)

        dense_ms = median_ms(dense_step)
        del qd, kd, vd, doutd
    rows = []
    for kind in kinds:
        index_q, index_k = (t[None].requires_grad_() for t in index_inputs(
            kind, seqlen, INDEX_HEADS, DIM, generator, DEVICE))
        inputs = (q, k, v, index_q, index_k)
        with torch.no_grad():
            ids = select_blocks(index_q, index_k, top_k=TOP_K, block_size=BLOCK)[0]
        row = dict(seqlen=seqlen, selection=kind, dense_step_ms=dense_ms,
                   **selection_statistics(ids.permute(1, 0, 2)))
        del ids
        for precision in ("input", "fp8"):
            def step():
                out, kl = msa_attention(*inputs, top_k=TOP_K, block_size=BLOCK,
                                        index_precision=precision)
                torch.autograd.grad((out, kl), inputs, (dout, one))

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            row[f"{precision}_extra_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
            timer = median_ms_of_few if seqlen >= LONG_SEQLEN else median_ms
            row[f"{precision}_step_ms"] = timer(step)
            if dense_ms:
                row[f"{precision}_speedup_vs_dense"] = dense_ms / row[f"{precision}_step_ms"]
        row["fp8_step_vs_input"] = row["input_step_ms"] / row["fp8_step_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--quality-seqlens", default="32768,131072")
    parser.add_argument("--step-seqlens", default="131072,1048576")
    parser.add_argument("--kinds", default="coherent,mid,random")
    parser.add_argument("--samples", type=int, default=512,
                        help="sampled query tokens for the reference agreement and mass recall")
    parser.add_argument("--dense-max-seqlen", type=int, default=131072)
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: smoke test
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    os.makedirs(args.out, exist_ok=True)
    kinds = args.kinds.split(",")
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    result = dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__,
                  date=time.strftime("%Y-%m-%d"), args=vars(args),
                  config=f"H{HEADS}/Hkv{KV_HEADS}/Hi{INDEX_HEADS}/Hik1 D=Di={DIM} top {TOP_K} "
                  f"of {BLOCK}, bf16 inputs, B=1", quality=[], steps=[])
    for seqlen in [int(s) for s in args.quality_seqlens.split(",") if s]:
        for kind in kinds:
            row = quality(seqlen, kind, args.samples)
            result["quality"].append(row)
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    for seqlen in [int(s) for s in args.step_seqlens.split(",") if s]:
        result["steps"] += steps(seqlen, kinds, args.dense_max_seqlen)
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "bench_fp8_index.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nfp8 vs bf16 index branch, {result['gpu']}, {result['config']}")
    print(f"{'S':>8} {'selection':>9} {'same set':>8} {'shared':>7} {'ref agree bf16/fp8':>19} "
          f"{'mass recall bf16/fp8':>21} {'ratio':>6} {'Jaccard':>7}")
    for r in result["quality"]:
        print(f"{r['seqlen']:>8} {r['selection']:>9} "
              f"{100 * r['agreement_with_bf16_selection']:>7.1f}% "
              f"{100 * r['shared_blocks_with_bf16_selection']:>6.1f}% "
              f"{100 * r['input_agreement_with_fp32_reference']:>8.2f}% / "
              f"{100 * r['fp8_agreement_with_fp32_reference']:>6.2f}% "
              f"{r['input_mass_recall']:>10.4f} / {r['fp8_mass_recall']:.4f} "
              f"{r['mass_recall_fp8_vs_bf16']:>6.4f} {r['bf16_jaccard']:>7.3f}")
    print(f"\n{'S':>8} {'selection':>9} {'Jaccard':>7} {'union8':>6} {'bf16 step':>10} "
          f"{'fp8 step':>9} {'fp8 gain':>8} {'dense':>9} {'x dense bf16/fp8':>17}")
    for r in result["steps"]:
        dense = f"{r['dense_step_ms']:.1f}" if r["dense_step_ms"] else "-"
        ratios = (f"{r['input_speedup_vs_dense']:.2f} / {r['fp8_speedup_vs_dense']:.2f}"
                  if r["dense_step_ms"] else "-")
        print(f"{r['seqlen']:>8} {r['selection']:>9} {r['jaccard']:>7.3f} {r['union_8']:>6.1f} "
              f"{r['input_step_ms']:>10.1f} {r['fp8_step_ms']:>9.1f} "
              f"{r['fp8_step_vs_input']:>7.2f}x {dense:>9} {ratios:>17}")


if __name__ == "__main__":
    main()
