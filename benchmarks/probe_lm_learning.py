"""When does a small dense Llama learn the eval tasks? (CPU or GPU; sizes the LM presets'
steps and curriculum before a GPU study.)

Trains the LM presets' dense model (``openmsa.train.lm.build_model``) on a mix of tasks at one
length, one task a step in turn, with the loss on the answer tokens only (``--loss answer``, as
the presets train) or on every token (``--loss all``), and every ``--every`` steps prints, per
task, the teacher-forced accuracy of the answer tokens (the answer's words, its punctuation
and [EOS]) on fixed held-out samples.

    python benchmarks/probe_lm_learning.py --tasks niah_single --length 256 --steps 1500
        [--first-tasks niah_single --first-steps 1000 --first-length 256] [--layers 2]
        [--hidden 128] [--heads 4] [--kv-heads 2] [--batch 16] [--lr 1e-3]
        [--loss answer|all] [--device cpu] [--data-workers N] [--out FILE.json]
    python benchmarks/probe_lm_learning.py --preset ruler-gpu --steps 2800 --length 1024
        --device cuda

``--first-tasks``, ``--first-steps`` and ``--first-length``: a curriculum's first phase, those
tasks alone for those steps (counted in ``--steps``) at that length (default ``--length``),
then ``--tasks``; accuracy is reported on both sets, at both lengths (``task@length`` for the
first phase's length where it differs). ``--preset NAME``: an LM preset's model, learning rate
and batches instead (``openmsa.train.lm.step_batches``: its curriculum's lengths, batch sizes
and tasks), its first ``--steps`` steps; accuracy on all its tasks at ``--length`` and on its
first phase's tasks at that phase's length. With a preset, ``--lr`` and ``--first-steps`` (the
first phase's steps) override the preset's where given. The output holds the model and
schedule that ran (``preset``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from openmsa.eval.tasks import synthetic_tokenizer
from openmsa.train.batches import BatchSpec, batch_stream, make_batch
from openmsa.train.lm import (LM_PRESETS, LR_SCHEDULES, LMPreset, apply_learning_rate,
                              build_model, curriculum_phases, scaled_preset, step_batches,
                              train_step)


def answer_accuracy(model, batches) -> float:
    """Teacher-forced accuracy of the labelled tokens of ``batches``."""
    model.eval()
    right = total = 0
    with torch.no_grad():
        for input_ids, labels in batches:
            with torch.autocast("cuda", torch.bfloat16, enabled=input_ids.is_cuda):
                predicted = model(input_ids).logits[:, :-1].argmax(-1)
            target = labels[:, 1:]
            labelled = target != -100
            right += (predicted[labelled] == target[labelled]).sum().item()
            total += labelled.sum().item()
    model.train()
    return right / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default="niah_single")
    parser.add_argument("--first-tasks", default="")
    parser.add_argument("--first-steps", type=int, default=0)
    parser.add_argument("--first-length", type=int, default=0)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4, help="query heads (head dim 64)")
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=None, help="default 1e-3, or the preset's")
    parser.add_argument("--grad-clip", type=float, default=None,
                        help="clip the gradients to this global norm (default: the preset's)")
    parser.add_argument("--lr-schedule", choices=LR_SCHEDULES, default=None,
                        help="constant or cosine (default: the preset's)")
    parser.add_argument("--lr-warmup", type=int, default=None,
                        help="steps of linear learning-rate warmup (default: the preset's)")
    parser.add_argument("--loss", choices=("answer", "all"), default="answer")
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--data-workers", type=int, default=None,
                        help="processes making the batches ahead (default: none on a CPU, "
                             "else half the host's cores, at most 8)")
    parser.add_argument("--preset", default="", choices=("",) + tuple(LM_PRESETS),
                        help="an LM preset's model, learning rate and batches (its curriculum)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    tasks = args.tasks.split(",")
    first_tasks = [t for t in args.first_tasks.split(",") if t] or tasks
    torch.manual_seed(0)
    device = torch.device(args.device)
    tokenizer = synthetic_tokenizer()
    first_length = args.first_length or args.length
    if args.preset:  # evaluated at --length and at its first phase's length on its tasks
        preset = LM_PRESETS[args.preset]
        if args.lr is not None:
            preset = dataclasses.replace(preset, lr=args.lr)
        if args.first_steps and preset.curriculum:
            phases = preset.curriculum
            preset = dataclasses.replace(
                preset, curriculum=((args.first_steps, *phases[0][1:]),) + phases[1:])
        tasks = list(preset.tasks)
        _, first_length, _, first_tasks = (curriculum_phases(preset)[:1]
                                           or [(0, args.length, 0, tasks)])[0]
        first_tasks = list(first_tasks)
    else:  # the first phase as a curriculum phase of its own tasks
        first_phase = ((args.first_steps, first_length, args.batch, tuple(first_tasks)),)
        preset = LMPreset(seqlen=args.length, block_size=64, top_k=2, steps=args.steps,
                          warmup_steps=0, batch=args.batch, layers=args.layers,
                          hidden_size=args.hidden, num_heads=args.heads,
                          num_kv_heads=args.kv_heads, lr=1e-3 if args.lr is None else args.lr,
                          tasks=tuple(tasks),
                          curriculum=first_phase if args.first_steps else ())
    overrides = dict(grad_clip=args.grad_clip, lr_schedule=args.lr_schedule,
                     lr_warmup=args.lr_warmup)
    preset = scaled_preset(preset, None, {key: value for key, value in overrides.items()
                                          if value is not None})
    schedule = step_batches(preset, seed=0)[:args.steps]
    model = build_model(preset, tokenizer, "dense", 0, {}).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=preset.lr)
    evaluated = [(task, args.length) for task in dict.fromkeys(first_tasks + tasks)]
    if first_length != args.length:
        evaluated += [(task, first_length) for task in first_tasks]
    held_out = {(task if length == args.length else f"{task}@{length}"):
                [make_batch(tokenizer, BatchSpec(task, length, 16, 10_000_000 + 16 * i), device)
                 for i in range(2)] for task, length in evaluated}
    rows, start = [], time.perf_counter()
    batches = batch_stream(tokenizer, schedule, device, args.data_workers)
    for step, (spec, (input_ids, labels)) in enumerate(zip(schedule, batches), 1):
        if args.loss == "all":
            labels = torch.where(input_ids == tokenizer.pad_token_id, -100, input_ids)
        apply_learning_rate(optimizer, preset, step)
        loss, _, _ = train_step(model, optimizer, input_ids, labels, 0.0, msa=False,
                                grad_clip=preset.grad_clip)
        if step % args.every == 0:
            accuracy = {name: answer_accuracy(model, samples)
                        for name, samples in held_out.items()}
            rows.append(dict(step=step, length=spec.length, seconds=time.perf_counter() - start,
                             loss=loss.item(),
                             accuracy=accuracy))
            print(f"step {step} {rows[-1]['seconds']:.0f}s loss {loss.item():.3f} "
                  + " ".join(f"{name} {value:.3f}" for name, value in accuracy.items()),
                  flush=True)
            if args.out:  # at every evaluation: a time limit that cuts the run keeps the rows
                with open(args.out, "w") as handle:
                    json.dump(dict(args=vars(args), preset=dataclasses.asdict(preset),
                                   rows=rows), handle, indent=1)
    batches.close()  # the worker processes end here


if __name__ == "__main__":
    main()
