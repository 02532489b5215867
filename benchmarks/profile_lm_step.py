"""Where an `openmsa train --preset ruler-*` step's time goes (GPU only): the preset's dense and
MSA models (warmup and sparse) trained on pre-generated batches, one per task, in rounds, so
that the first round's steps (which compile kernels for new shapes) show apart from the steady
state; and the host's time to generate one batch of each task (the trainer generates them in
the step loop).

    python benchmarks/profile_lm_step.py --out DIR [--preset ruler-gpu] [--tokens 16384]
        [--rounds 3] [--layers N]

Prints a table last and writes lm_step.json (per step: model, phase, round, task, tokens,
seconds with the GPU synchronized; and, per openmsa kernel compiled more than once, how many
variants and the arguments whose specialization differs between them: what new sequence
lengths recompile).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

from openmsa.eval.tasks import synthetic_tokenizer
from openmsa.layers.msa_attention import set_msa_warmup
from openmsa.train.batches import BatchSpec, make_batch
from openmsa.train.lm import LM_PRESETS, _preset_msa_options, build_model, train_step


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def compiled_variants() -> dict:
    """{kernel: {"variants": n, "varying": {argument: [its specializations]}}} of the openmsa
    Triton and Gluon kernels compiled more than once in this process (on any device)."""
    from triton.runtime.jit import JITFunction

    report = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("openmsa") or module is None:
            continue
        for attribute, value in vars(module).items():
            if not isinstance(value, JITFunction):
                continue
            specializations = [key[0] for caches in value.device_caches.values()
                               for key in caches[1]]
            if len(specializations) < 2:
                continue
            varying = {}
            for position, argument in enumerate(value.arg_names):
                seen = sorted({str(spec[position]) for spec in specializations
                               if position < len(spec)})
                if len(seen) > 1:
                    varying[argument] = seen
            report[f"{name}.{attribute}"] = dict(variants=len(specializations),
                                                 varying=varying)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--preset", default="ruler-gpu")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--device", default="cuda", help="cpu: the reference, to try the script")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    preset = LM_PRESETS[args.preset]
    if args.layers:
        preset = dataclasses.replace(preset, layers=args.layers)
    device = torch.device(args.device)
    tokenizer = synthetic_tokenizer()
    batches, generation = [], {}
    for number, task in enumerate(preset.tasks):
        start = time.perf_counter()
        batches.append((task, *make_batch(tokenizer, BatchSpec(task, args.tokens, preset.batch,
                                                               number), device)))
        generation[task] = time.perf_counter() - start
    rows = []
    for kind, phase in (("dense", "dense"), ("msa", "warmup"), ("msa", "sparse")):
        model = build_model(preset, tokenizer, kind, 0,
                            _preset_msa_options(preset, device, None)).to(device)
        if kind == "msa":
            set_msa_warmup(model, phase == "warmup")
        optimizer = torch.optim.AdamW(model.parameters(), lr=preset.lr)
        for round_ in range(args.rounds):
            for task, input_ids, labels in batches:
                synchronize(device)
                start = time.perf_counter()
                train_step(model, optimizer, input_ids, labels, preset.kl_weight, kind == "msa",
                           preset.grad_clip)
                synchronize(device)
                rows.append(dict(model=kind, phase=phase, round=round_, task=task,
                                 tokens=input_ids.shape[1], batch=input_ids.shape[0],
                                 seconds=time.perf_counter() - start))
                print(json.dumps(rows[-1]), flush=True)
        del model, optimizer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    variants = compiled_variants()
    with open(os.path.join(args.out, "lm_step.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                       torch=torch.__version__, compiled_variants=variants,
                       preset=args.preset, layers=preset.layers, generation_seconds=generation,
                       rows=rows), f, indent=1)
    for kernel, entry in sorted(variants.items(), key=lambda item: -item[1]["variants"]):
        print(f"{kernel}: {entry['variants']} variants, varying "
              + (", ".join(entry["varying"]) or "options"))
    print("\nbatch generation (s): " + ", ".join(f"{t} {s:.3f}" for t, s in generation.items()))
    print(f"{'phase':>7} " + " ".join(f"{'round ' + str(r) + ' s':>10}" for r in
                                       range(args.rounds)))
    for phase in ("dense", "warmup", "sparse"):
        means = [sum(r["seconds"] for r in rows if r["phase"] == phase and r["round"] == k)
                 / len(batches) for k in range(args.rounds)]
        print(f"{phase:>7} " + " ".join(f"{m:>10.3f}" for m in means))


if __name__ == "__main__":
    main()
