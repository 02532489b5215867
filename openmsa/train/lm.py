"""``openmsa train --preset ruler-*``: small GQA causal LMs (Hugging Face Llama) trained on a mix
of ``openmsa.eval`` tasks, written as checkpoints that ``openmsa eval --model`` reads.

Two models from the same seed: "dense" (plain attention) and "msa" (``convert_to_msa``: dense
warmup, then sparse, its index branch trained by the KL). ``adapt_index_branch`` takes the
other path to MSA: a dense checkpoint converted, its weights frozen, the index branch trained
by the KL alone ("adapted"). Each step draws a batch of one task
(the tasks in turn) at the current curriculum length; the loss is the next-token loss on the
answer tokens only (the prompt is context), plus ``kl_weight`` times the KL for MSA. A
checkpoint is a Hugging Face folder (``save_pretrained``, the tasks' word-level tokenizer) with
``openmsa.json``: the model kind and its MSA options (an MSA checkpoint's weights include the
index projections, which ``openmsa.eval.run.load_model`` restores after converting).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, replace

import torch

from ..eval.tasks import TASKS, synthetic_tokenizer
from ..integrations.transformers import convert_to_msa, msa_kl
from ..layers.msa_attention import MSAWarmupSchedule, set_msa_warmup
from .batches import BatchSpec, batch_stream


@dataclass(frozen=True)
class LMPreset:
    seqlen: int
    block_size: int
    top_k: int
    steps: int
    warmup_steps: int
    batch: int
    layers: int = 4
    hidden_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    lr: float = 1e-3
    kl_weight: float = 1.0
    rope_theta: float = 1e6
    tasks: tuple[str, ...] = TASKS
    # Phases of (steps, tokens, batch) or (steps, tokens, batch, tasks) before training at
    # seqlen tokens on ``tasks``: a phase without its own tasks trains on the preset's.
    curriculum: tuple[tuple, ...] = ()
    # The optimizer: gradients clipped to this global norm (None: not clipped); the learning
    # rate rising linearly over the first ``lr_warmup`` steps, then constant ("constant") or
    # falling along a cosine to ``lr_final`` x lr at the last step ("cosine").
    grad_clip: float | None = None
    lr_warmup: int = 0
    lr_schedule: str = "constant"
    lr_final: float = 0.1


LM_PRESETS = {
    # CI smoke test: the whole pipeline in seconds.
    "ruler-tiny": LMPreset(seqlen=320, block_size=64, top_k=2, steps=4, warmup_steps=2, batch=2,
                           layers=2, tasks=("niah_single", "variable_tracking"),
                           curriculum=((2, 256, 2),)),
    # 2-core CPU, the eager reference, minutes: 4 layers at 512 tokens, 2 of 8 blocks kept.
    "ruler-cpu": LMPreset(seqlen=512, block_size=64, top_k=2, steps=300, warmup_steps=150,
                          batch=8),
    # GPU, Triton kernels, bf16 autocast: 4 layers, GQA 8/2 heads, 16k tokens after a curriculum
    # (single-needle retrieval alone at 256 tokens first, then the needle tasks, then all six
    # at growing lengths: docs/EVAL.md, "Will the models learn the tasks?"); 8 of 128 blocks
    # kept, sparse from step 3001; gradients clipped, lr warmed up and decayed (the moves
    # between lengths and task mixes set learning back less: docs/EVAL.md, "The optimizer").
    "ruler-gpu": LMPreset(seqlen=16384, block_size=128, top_k=8, steps=4000, warmup_steps=3000,
                          batch=4, hidden_size=512, num_heads=8, num_kv_heads=2, lr=2.5e-4,
                          grad_clip=1.0, lr_warmup=100, lr_schedule="cosine",
                          curriculum=((1000, 256, 64, ("niah_single",)),
                                      (1000, 256, 64, ("niah_single", "niah_multikey",
                                                       "niah_multivalue", "niah_multiquery")),
                                      (800, 1024, 32), (600, 4096, 8))),
}


def _preset_msa_options(preset: LMPreset, device: torch.device, overrides: dict | None) -> dict:
    """``convert_to_msa``'s options for ``preset`` on ``device`` (the reference on a CPU),
    ``overrides`` over them."""
    options = dict(top_k=preset.top_k, block_size=preset.block_size,
                   backend="reference" if device.type == "cpu" else "auto")
    options.update(overrides or {})
    return options


def _save_checkpoint(model, tokenizer, folder: str, description: dict) -> None:
    """A Hugging Face folder with the tokenizer and ``openmsa.json`` (``description``)."""
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    with open(os.path.join(folder, "openmsa.json"), "w") as handle:
        json.dump(description, handle, indent=1)


def build_model(preset: LMPreset, tokenizer, kind: str, seed: int, msa_options: dict):
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=preset.hidden_size, intermediate_size=4 * preset.hidden_size,
        num_hidden_layers=preset.layers, num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_kv_heads, head_dim=preset.head_dim,
        vocab_size=len(tokenizer), max_position_embeddings=1 << 20,
        rope_theta=preset.rope_theta, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = transformers.LlamaForCausalLM(config)
    if kind == "msa":
        convert_to_msa(model, **msa_options)
    return model


def curriculum_phases(preset: LMPreset) -> list[tuple[int, int, int, tuple[str, ...]]]:
    """The curriculum's phases as (last step, tokens, batch, tasks), a phase without tasks of
    its own taking the preset's."""
    phases, last = [], 0
    for steps, tokens, batch, *tasks in preset.curriculum:
        last += steps
        phases.append((last, tokens, batch, tuple(tasks[0]) if tasks else preset.tasks))
    return phases


def step_batches(preset: LMPreset, seed: int) -> list[BatchSpec]:
    """The batch of every training step of ``preset``: the curriculum's phases (their lengths,
    batch sizes and tasks), then the preset's; step s (from 1) trains task (s - 1) mod the
    number of its phase's tasks."""
    phases = curriculum_phases(preset)
    specs = []
    for step in range(1, preset.steps + 1):
        length, batch, tasks = next(((t, b, k) for end, t, b, k in phases if step <= end),
                                    (preset.seqlen, preset.batch, preset.tasks))
        specs.append(BatchSpec(tasks[(step - 1) % len(tasks)], length, batch,
                               seed * 1_000_003 + step * batch))
    return specs


LR_SCHEDULES = ("constant", "cosine")
OPTIMIZER_FIELDS = ("lr", "grad_clip", "lr_warmup", "lr_schedule", "lr_final")


def learning_rate(preset: LMPreset, step: int) -> float:
    """The learning rate of step ``step`` (1 to ``preset.steps``)."""
    if step <= preset.lr_warmup:
        return preset.lr * step / preset.lr_warmup
    if preset.lr_schedule == "constant":
        return preset.lr
    progress = (step - preset.lr_warmup) / max(1, preset.steps - preset.lr_warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return preset.lr * (preset.lr_final + (1 - preset.lr_final) * cosine)


def apply_learning_rate(optimizer, preset: LMPreset, step: int) -> float:
    """Sets every parameter group of ``optimizer`` to step ``step``'s learning rate; returns
    it."""
    lr = learning_rate(preset, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def check_optimizer_settings(preset: LMPreset) -> None:
    """Clear errors for optimizer settings a preset's overrides got wrong."""
    if not preset.lr > 0:
        raise ValueError(f"lr: expected a number > 0, received {preset.lr!r}")
    if preset.grad_clip is not None and not preset.grad_clip > 0:
        raise ValueError(f"grad_clip: expected a number > 0 or None, received "
                         f"{preset.grad_clip!r}")
    if preset.lr_schedule not in LR_SCHEDULES:
        raise ValueError(f"lr_schedule: expected one of {LR_SCHEDULES}, received "
                         f"{preset.lr_schedule!r}")
    if not 0 <= preset.lr_warmup < preset.steps:
        raise ValueError(f"lr_warmup: expected 0 to steps - 1 = {preset.steps - 1}, received "
                         f"{preset.lr_warmup!r}")
    if not 0 <= preset.lr_final <= 1:
        raise ValueError(f"lr_final: expected 0 to 1, received {preset.lr_final!r}")


def train_step(model, optimizer, input_ids, labels, kl_weight: float, msa: bool,
               grad_clip: float | None = None):
    """One optimizer step of an LM preset's model on a batch (bf16 autocast on a GPU): the
    next-token loss on the labelled tokens plus, for an MSA model, ``kl_weight`` x its KL
    (in warmup too: the index branch learns from the KL while every block is visible), its
    gradients clipped to the global norm ``grad_clip`` (None: not clipped). Returns (loss,
    kl, the gradients' global norm before clipping), detached."""
    with torch.autocast("cuda", torch.bfloat16, enabled=input_ids.is_cuda):
        loss = model(input_ids, labels=labels, use_cache=False).loss
        kl = msa_kl(model) if msa else loss.new_zeros(())
    optimizer.zero_grad(set_to_none=True)
    (loss.float() + kl_weight * kl.float()).backward()
    # The norm is recorded either way: its spikes show where training is unstable.
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(),
                                          grad_clip if grad_clip is not None else math.inf)
    optimizer.step()
    return loss.detach(), kl.detach(), norm.detach()


def train_lm_model(kind: str, preset: LMPreset, device, seed: int, msa_options: dict,
                   out_dir: str, progress=print, workers: int | None = None) -> list[dict]:
    """Trains one model (``kind`` "dense" or "msa") and writes its checkpoint to
    ``out_dir/kind``; returns the loss history. ``workers``: processes generating the batches
    ahead (None: ``batches.default_workers``)."""
    tokenizer = synthetic_tokenizer()
    model = build_model(preset, tokenizer, kind, seed, msa_options).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=preset.lr)
    schedule = MSAWarmupSchedule(preset.warmup_steps if kind == "msa" else 0)
    specs = step_batches(preset, seed)
    batches = batch_stream(tokenizer, specs, device, workers)
    history, start = [], time.perf_counter()
    for step, (spec, (input_ids, labels)) in enumerate(zip(specs, batches), 1):
        warmup = schedule.apply(model, step - 1) if kind == "msa" else False
        lr = apply_learning_rate(optimizer, preset, step)
        loss, kl, norm = train_step(model, optimizer, input_ids, labels, preset.kl_weight,
                                    kind == "msa", preset.grad_clip)
        history.append({"model": kind, "step": step, "task": spec.task, "tokens": spec.length,
                        "phase": "warmup" if warmup else "sparse", "loss": loss.item(),
                        "kl": kl.item(), "grad_norm": norm.item(), "lr": lr,
                        "seconds": time.perf_counter() - start})
        progress(kind, step, preset.steps, history[-1])
    batches.close()  # the worker processes end here, not at garbage collection
    _save_checkpoint(model, tokenizer, os.path.join(out_dir, kind),
                     {"kind": kind, "msa_options": msa_options if kind == "msa" else None,
                      "preset": asdict(preset), "seed": seed})
    return history


def scaled_preset(preset: LMPreset, steps: int | None = None,
                  optimizer: dict | None = None) -> LMPreset:
    """``preset`` over ``steps`` instead of its own (its warmup, learning-rate warmup and
    curriculum scaled along), then its optimizer fields ``optimizer`` (``lr``, ``grad_clip``,
    ``lr_warmup``, ``lr_schedule``, ``lr_final``) replaced, checked."""
    if steps is not None:
        factor = steps / preset.steps
        preset = replace(preset, steps=steps,
                         warmup_steps=min(round(preset.warmup_steps * factor), steps - 1),
                         lr_warmup=min(round(preset.lr_warmup * factor), steps - 1),
                         curriculum=tuple((max(1, round(n * factor)), *rest)
                                          for n, *rest in preset.curriculum))
    unknown = sorted(set(optimizer or {}) - set(OPTIMIZER_FIELDS))
    if unknown:
        raise ValueError(f"optimizer: expected fields from {OPTIMIZER_FIELDS}, received "
                         f"{unknown}")
    preset = replace(preset, **(optimizer or {}))
    check_optimizer_settings(preset)
    return preset


def run_lm(preset_name: str, out_dir: str, device=None, seed: int = 0,
           msa_options: dict | None = None, layers: int | None = None,
           steps: int | None = None, workers: int | None = None,
           models: tuple[str, ...] = ("dense", "msa"), optimizer: dict | None = None) -> dict:
    """Trains the dense and the MSA model of an LM preset (``LM_PRESETS``) and writes their
    checkpoints and ``history.json`` (``history_KIND.json`` for one model) to ``out_dir``;
    ``msa_options`` override the preset's (``convert_to_msa``'s keyword arguments); ``layers``
    and ``steps`` the preset's (``scaled_preset``); ``workers``: processes generating the
    batches ahead (None: ``batches.default_workers``); ``models``: which of the two to train
    (runs of one each can share a GPU side by side); ``optimizer``: the preset's optimizer
    fields to override (``scaled_preset``)."""
    models = tuple(dict.fromkeys(models))  # each once, in the order given
    unknown = [kind for kind in models if kind not in ("dense", "msa")]
    if not models or unknown:
        raise ValueError(f"models: expected 'dense', 'msa' or both, received {models!r}")
    if preset_name not in LM_PRESETS:
        raise ValueError(f"preset_name: expected one of {sorted(LM_PRESETS)}, received "
                         f"{preset_name!r}")
    preset = LM_PRESETS[preset_name]
    if layers is not None:
        preset = replace(preset, layers=layers)
    preset = scaled_preset(preset, steps, optimizer)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    options = _preset_msa_options(preset, device, msa_options)
    os.makedirs(out_dir, exist_ok=True)
    print(f"openmsa train: preset {preset_name} on {device}: {preset.layers}-layer Llama "
          f"(H{preset.num_heads}/Hkv{preset.num_kv_heads}, hidden {preset.hidden_size}) on "
          f"{', '.join(preset.tasks)} at {preset.seqlen} tokens, {' and '.join(models)}; "
          f"MSA options {options}", flush=True)
    progress = _progress_printer(len(preset.tasks))
    histories = {kind: train_lm_model(kind, preset, device, seed, options, out_dir, progress,
                                      workers)
                 for kind in models}
    # One model's run writes its own file, so that side-by-side runs into one folder keep both.
    name = "history.json" if len(models) == 2 else f"history_{models[0]}.json"
    with open(os.path.join(out_dir, name), "w") as handle:
        json.dump({"preset": preset_name, "settings": asdict(preset), "seed": seed,
                   "msa_options": options, "history": histories}, handle, indent=1)
    for kind, history in histories.items():
        tail = history[-len(preset.tasks):]
        print(f"{kind}: final loss {sum(h['loss'] for h in tail) / len(tail):.3f} (mean of the "
              f"last {len(tail)} steps); checkpoint {os.path.join(out_dir, kind)}")
    print(f"evaluate: openmsa eval --model {os.path.join(out_dir, 'msa')} --lengths "
          f"{max(256, preset.seqlen // 2)},{preset.seqlen},{2 * preset.seqlen}")
    return histories


def _progress_printer(tasks: int):
    """One line every tenth of the run (and at its end), with the mean loss and KL of the last
    ``tasks`` steps (one of each task): logs stay readable."""
    recent: dict = {}

    def show(kind, step, total, record):
        window = recent.setdefault(kind, [])
        window[:] = (window + [record])[-tasks:]
        if step == total or step % max(1, total // 10) == 0:
            loss = sum(r["loss"] or 0.0 for r in window) / len(window)
            kl = sum(r["kl"] for r in window) / len(window)
            print(f"{kind:>7} step {step}/{total} {record['seconds']:.0f}s {record['phase']} at "
                  f"{record['tokens']} tokens:"
                  + (f" loss {loss:.3f}" if kind != "adapted" else "")
                  + (f" kl {kl:.4f}" if kind != "dense" else ""), flush=True)
    return show


def adapt_index_branch(dense_dir: str, out_dir: str, preset_name: str, steps: int,
                       device=None, seed: int = 0, msa_options: dict | None = None,
                       workers: int | None = None) -> list:
    """The conversion path of a dense-trained model: loads the dense checkpoint ``dense_dir``,
    converts it (the preset's MSA options, ``msa_options`` over them), freezes every weight
    but the index branch's and trains that by the KL alone for ``steps`` steps, every block
    visible (warmup: the KL's teacher is the dense attention); writes ``out_dir/adapted``."""
    from ..eval.run import load_model

    preset = LM_PRESETS[preset_name]
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    options = _preset_msa_options(preset, device, msa_options)
    model, tokenizer = load_model(dense_dir, device, torch.float32, options)
    model.train()
    trained = []
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(".index_" in name)
        if parameter.requires_grad:
            trained.append(parameter)
    optimizer = torch.optim.AdamW(trained, lr=preset.lr)
    set_msa_warmup(model, True)
    autocast = torch.autocast("cuda", torch.bfloat16, enabled=device.type == "cuda")
    progress = _progress_printer(len(preset.tasks))
    print(f"openmsa train: the index branch of {dense_dir} by the KL alone, {steps} steps at "
          f"{preset.seqlen} tokens, {options}", flush=True)
    specs = step_batches(replace(preset, steps=steps, curriculum=()), seed)  # at seqlen
    batches = batch_stream(tokenizer, specs, device, workers)
    history, start = [], time.perf_counter()
    for step, (spec, (input_ids, _)) in enumerate(zip(specs, batches), 1):
        with autocast:
            model(input_ids, use_cache=False)
            kl = msa_kl(model).float()
        optimizer.zero_grad(set_to_none=True)
        kl.backward()
        optimizer.step()
        history.append({"model": "adapted", "step": step, "task": spec.task,
                        "tokens": preset.seqlen, "phase": "index only", "loss": None,
                        "kl": kl.item(), "seconds": time.perf_counter() - start})
        progress("adapted", step, steps, history[-1])
    batches.close()
    set_msa_warmup(model, False)
    _save_checkpoint(model, tokenizer, os.path.join(out_dir, "adapted"),
                     {"kind": "adapted", "from": dense_dir, "msa_options": options,
                      "preset": asdict(preset), "seed": seed, "steps": steps,
                      "history": history})
    return history
