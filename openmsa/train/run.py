"""``openmsa train``: an MSA model and a dense one learn the retrieval task side by side.

The MSA model trains with dense warmup first (its index branch learns from the KL while every
block is visible), then sparse. Every ``eval_every`` steps both models are scored on a fixed
held-out batch; the MSA model always with sparse attention, so its accuracy and two recalls
show the index branch learning, during warmup too:

- *block recall*: the share of (question, index head) pairs whose kept blocks include the block
  of the asked fact (also per index head, and for "any index head of the layer");
- *mass recall*: the share of the main attention's mass at the question (dense, averaged over
  each index head's main heads: the KL's teacher) that the kept blocks hold.
"""

from __future__ import annotations

import csv
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F

from ..layers.msa_attention import MSAWarmupSchedule, set_msa_warmup
from ..ops.validate import check_index_precision
from .model import RetrievalModel
from .task import RetrievalTask


@dataclass(frozen=True)
class Preset:
    seqlen: int
    block_size: int
    top_k: int
    num_pairs: int
    batch: int
    steps: int
    warmup_steps: int
    eval_every: int
    layers: int = 1
    lr: float = 3e-3
    kl_weight: float = 1.0
    rope_theta: float = 10000.0
    # KV heads of the 4 attention heads; each KV head has one index head.
    num_kv_heads: int = 2
    # A curriculum: phases of (steps, tokens, batch) before training on seqlen tokens.
    curriculum: tuple[tuple[int, int, int], ...] = ()
    # Held-out samples of the final evaluation (in batches of 64): finer than the 64 of the
    # evaluations along the way, for comparing runs within a point.
    final_eval_samples: int = 512


PRESETS = {
    # 2-core CPU, eager reference backend, a few minutes: 4 blocks of 64, keep 2 (own + 1).
    "cpu": Preset(seqlen=256, block_size=64, top_k=2, num_pairs=4, batch=32, steps=300,
                  warmup_steps=100, eval_every=25),
    # Smoke test for CI: the same pipeline (the GPU preset's curriculum too), a few steps.
    "tiny": Preset(seqlen=192, block_size=64, top_k=2, num_pairs=3, batch=4, steps=4,
                   warmup_steps=2, eval_every=2, rope_theta=1e6, curriculum=((1, 64, 2),
                                                                            (1, 128, 2)),
                   final_eval_samples=128),
    # GPU, Triton kernels: 16k tokens, 128 blocks of 128, keep 4. Neither model learns from
    # scratch at 16k, so a curriculum of 256, then 2048, then 16k tokens (RoPE base 1e6); the
    # MSA model's warmup lasts 100 steps into the 16k phase. One KV head (so one index head for
    # all 4 heads): with two, the head group that does not read the fact has no reason to keep
    # its block (docs/TRAINING.md has the runs behind these choices).
    "gpu": Preset(seqlen=16384, block_size=128, top_k=4, num_pairs=8, batch=8, steps=900,
                  warmup_steps=600, eval_every=50, rope_theta=1e6, num_kv_heads=1,
                  curriculum=((300, 256, 32), (200, 2048, 16))),
}


def _task(preset: Preset, seqlen: int | None = None) -> RetrievalTask:
    return RetrievalTask(seqlen=seqlen or preset.seqlen, num_keys=16, num_values=16,
                         num_fillers=16, num_pairs=preset.num_pairs)


def _autocast(device):
    device = torch.device(device)
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def _to(tokens, device):
    return tuple(t.to(device) for t in tokens)


def question_mass_recall(layer, hidden_states, kept_blocks, block_size):
    """The share of the main attention's mass that the question's kept blocks hold: the
    question (last token) attends densely over the whole sequence; each index head's mass is
    the mean over its main heads (the KL's teacher). Returns ``[B, Hi]``."""
    batch, seqlen, _ = hidden_states.shape
    positions = torch.arange(seqlen, device=hidden_states.device).expand(batch, seqlen)
    q, k, *_ = layer.projections(hidden_states, positions)
    k = k.float().repeat_interleave(layer.num_heads // layer.num_kv_heads, dim=2)
    scores = torch.einsum("bhd,bshd->bhs", q[:, -1].float(), k) * layer.head_dim ** -0.5
    teacher = scores.softmax(-1).view(batch, layer.num_index_heads, -1, seqlen).mean(2)
    num_blocks = -(-seqlen // block_size)
    block_mass = F.pad(teacher, (0, num_blocks * block_size - seqlen)).view(
        batch, layer.num_index_heads, num_blocks, block_size).sum(-1)
    question_blocks = kept_blocks[:, :, -1, :].long()  # [B, Hi, top_k], -1 unused
    kept_mass = block_mass.gather(-1, question_blocks.clamp(min=0))
    return torch.where(question_blocks >= 0, kept_mass, 0.0).sum(-1)


@torch.no_grad()
def evaluate(model, tokens, answers, fact_positions, block_size):
    """Accuracy, KL and (MSA) block recall on a fixed batch, with sparse attention."""
    is_msa = set_msa_warmup(model, False) > 0
    layer_inputs = []  # each MSA layer's hidden states, for the mass recall
    hooks = [module.register_forward_pre_hook(lambda _, args: layer_inputs.append(args[0]))
             for module in model.modules() if getattr(module, "is_msa_layer", False)]
    with _autocast(tokens[0].device):
        logits, kl, indices = model(tokens, return_indices=True)
    for hook in hooks:
        hook.remove()
    accuracy = (logits.argmax(-1) == answers).float().mean().item()
    result = {"accuracy": accuracy, "kl": kl.item()}
    if is_msa:
        fact_block = (fact_positions // block_size)[:, None, None]
        # [layers, B, Hi]: the question's kept blocks hold the asked fact's block.
        hits = torch.stack([(layer[:, :, -1, :] == fact_block).any(-1) for layer in indices])
        result["block_recall"] = hits.float().mean().item()
        # Per index head, and for "some index head of the layer": a head group that does not
        # read the fact has no reason to keep its block.
        result["block_recall_per_index_head"] = hits.float().mean(dim=(0, 1)).tolist()
        result["block_recall_any_index_head"] = hits.any(-1).float().mean().item()
        layers = [module for module in model.modules() if getattr(module, "is_msa_layer", False)]
        with _autocast(tokens[0].device):
            mass = torch.stack([question_mass_recall(layer, hidden, kept, block_size)
                                for layer, hidden, kept in zip(layers, layer_inputs, indices)])
        result["mass_recall"] = mass.mean().item()
        result["mass_recall_per_index_head"] = mass.mean(dim=(0, 1)).tolist()
    return result


def train_model(kind: str, preset: Preset, device, seed: int, progress,
                index_precision: str = "input", share_index_every: int = 1,
                num_local_blocks: int = 1, local_block_dilation: int = 1,
                share_index_kl: bool = False) -> list[dict]:
    task = _task(preset)
    torch.manual_seed(seed)
    phases = []  # (last step, task, batch) of each curriculum phase
    for steps, seqlen, batch in preset.curriculum:
        phases.append(((phases[-1][0] if phases else 0) + steps, _task(preset, seqlen), batch))
    model = RetrievalModel(task, kind, layers=preset.layers, top_k=preset.top_k,
                           block_size=preset.block_size, rope_theta=preset.rope_theta,
                           num_kv_heads=preset.num_kv_heads, index_precision=index_precision,
                           share_index_every=share_index_every,
                           share_index_kl=share_index_kl,
                           num_local_blocks=num_local_blocks,
                           local_block_dilation=local_block_dilation).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=preset.lr)
    schedule = MSAWarmupSchedule(preset.warmup_steps if kind == "msa" else 0)
    data = torch.Generator().manual_seed(seed + 1)
    eval_tokens, eval_answers, eval_positions = task.sample(64, torch.Generator().manual_seed(
        seed + 2))
    eval_tokens = _to(eval_tokens, device)
    eval_answers, eval_positions = eval_answers.to(device), eval_positions.to(device)
    history = []
    start = time.perf_counter()
    for step in range(1, preset.steps + 1):
        warmup = schedule.apply(model, step - 1) if kind == "msa" else False
        phase_task, batch = next(((t, b) for last, t, b in phases if step <= last),
                                 (task, preset.batch))
        tokens, answers, _ = phase_task.sample(batch, data)
        with _autocast(device):  # bf16 on a GPU: the Triton kernels' dtype
            logits, kl = model(_to(tokens, device))
        task_loss = F.cross_entropy(logits.float(), answers.to(device))
        loss = task_loss + preset.kl_weight * kl
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % preset.eval_every == 0 or step == preset.steps:
            record = {"model": kind, "step": step, "phase": "warmup" if warmup else "sparse",
                      "train_tokens": tokens[0].shape[1],
                      "task_loss": task_loss.item(), "train_kl": kl.item(),
                      "seconds": time.perf_counter() - start}
            record.update({f"eval_{key}": value for key, value in evaluate(
                model, eval_tokens, eval_answers, eval_positions, preset.block_size).items()})
            history.append(record)
        progress(kind, step, preset.steps, history[-1] if history else None)
    history[-1].update(final_evaluation(model, task, preset, seed, device))
    return history


FINAL_METRICS = ("accuracy", "block_recall", "mass_recall")


def final_evaluation(model, task, preset: Preset, seed: int, device) -> dict:
    """``final_accuracy`` (and for MSA ``final_block_recall``, ``final_mass_recall``) over
    ``preset.final_eval_samples`` held-out samples, drawn apart from the training data and the
    evaluation batch."""
    generator = torch.Generator().manual_seed(seed + 3)
    sums, batches = {}, 0
    for start in range(0, preset.final_eval_samples, 64):
        size = min(64, preset.final_eval_samples - start)
        tokens, answers, positions = task.sample(size, generator)
        result = evaluate(model, _to(tokens, device), answers.to(device), positions.to(device),
                          preset.block_size)
        for key in FINAL_METRICS:
            if key in result:
                sums[key] = sums.get(key, 0.0) + result[key] * size
        batches += size
    return {f"final_{key}": total / batches for key, total in sums.items()}


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes}:{seconds:02d}"


def _progress_printer():
    """A progress bar with elapsed time and ETA on a terminal; one line per evaluation
    otherwise (logs stay readable)."""
    interactive = sys.stdout.isatty()
    starts = {}

    def show(kind, step, total, last):
        elapsed = time.perf_counter() - starts.setdefault(kind, time.perf_counter())
        timing = f" {_clock(elapsed)} elapsed, ETA {_clock(elapsed / step * (total - step))}"
        summary = ""
        if last:
            summary = f" loss {last['task_loss']:.3f} acc {last['eval_accuracy']:.2f}"
            if "eval_block_recall" in last:
                summary += (f" kl {last['train_kl']:.3f} recall {last['eval_block_recall']:.2f}"
                            f" mass {last['eval_mass_recall']:.2f}")
        if interactive:
            done = 30 * step // total
            print(f"\r{kind:>5} [{'#' * done}{'.' * (30 - done)}] {step}/{total}{timing}"
                  f"{summary}", end="\n" if step == total else "", flush=True)
        elif last and last["step"] == step:
            print(f"{kind:>5} step {step}/{total}{timing}{summary}", flush=True)
    return show


def _curriculum_ends(histories: dict) -> list[int]:
    """Evaluation steps after which the training sequence length changed."""
    history = next(iter(histories.values()), [])
    return [a["step"] for a, b in zip(history, history[1:])
            if a.get("train_tokens") != b.get("train_tokens")]


def plot(histories: dict, path: str, preset_name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # (title, [(metric, label suffix), ...]) per panel
    panels = [("task loss", [("task_loss", "")]),
              ("held-out accuracy", [("eval_accuracy", "")]),
              ("KL (index vs main)", [("train_kl", "")]),
              ("recall", [("eval_block_recall", " fact block"), ("eval_mass_recall", " mass")])]
    figure, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4))
    for axis, (title, metrics) in zip(axes, panels):
        for kind, history in histories.items():
            for key, suffix in metrics:
                points = [(r["step"], r[key]) for r in history if key in r]
                if points and not (key == "train_kl" and kind == "dense"):
                    axis.plot(*zip(*points), marker="o", markersize=3, label=kind + suffix)
        warmup_end = [r["step"] for r in histories.get("msa", []) if r["phase"] == "warmup"]
        if warmup_end:
            axis.axvline(max(warmup_end), color="gray", linestyle=":", linewidth=1)
        for phase_end in _curriculum_ends(histories):
            axis.axvline(phase_end, color="gray", linestyle="--", linewidth=1)
        axis.set_title(title)
        axis.set_xlabel("step")
        axis.legend()
    figure.suptitle(f"openmsa train --preset {preset_name} (dotted: end of dense warmup; "
                    "dashed: training length changes)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def with_steps(preset: Preset, steps: int) -> Preset:
    """``preset`` with ``steps`` steps in all: its warmup, curriculum phases and evaluation
    interval scale by the same factor (each phase keeps at least one step; phases that no
    longer fit before the last step are dropped)."""
    factor = steps / preset.steps

    def scaled(n):
        return max(1, round(n * factor))

    curriculum, used = [], 0
    for phase_steps, tokens, batch in preset.curriculum:
        phase_steps = scaled(phase_steps)
        if used + phase_steps >= steps:  # the full length needs a step of its own
            break
        curriculum.append((phase_steps, tokens, batch))
        used += phase_steps
    return Preset(**dict(asdict(preset), steps=steps,
                         warmup_steps=min(round(preset.warmup_steps * factor), steps - 1),
                         eval_every=scaled(preset.eval_every), curriculum=tuple(curriculum)))


def _write_plot(histories: dict, out_dir: str, preset_name: str) -> str:
    """curves.png, or a line saying why there is none (matplotlib is the train extra's)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "no curves.png: matplotlib is not installed (pip install 'openmsa[train]')"
    plot(histories, os.path.join(out_dir, "curves.png"), preset_name)
    return ""


def run(preset_name: str, out_dir: str, device: str | torch.device | None = None, seed: int = 0,
        steps: int | None = None, index_precision: str = "input", layers: int | None = None,
        share_index_every: int = 1, num_local_blocks: int = 1,
        local_block_dilation: int = 1, share_index_kl: bool = False) -> dict:
    """Trains the dense and the MSA model of a preset; ``index_precision``,
    ``num_local_blocks`` and ``local_block_dilation`` are the MSA model's (``msa_attention``'s
    options). ``layers``: attention blocks instead of the preset's; ``share_index_every``: MSA
    layers 0, N, 2N, ... select, the others share the selection of the one before them (SPEC
    section 9); ``share_index_kl``: the sharing layers' attention also teaches the index branch
    they read (``MSAAttention``'s option)."""
    check_index_precision(index_precision)
    if share_index_kl and share_index_every == 1:
        raise ValueError("share_index_kl: applies with share_index_every > 1 (with 1 every "
                         "layer has its own index branch)")
    for name, value in (("layers", layers), ("share_index_every", share_index_every),
                        ("num_local_blocks", num_local_blocks),
                        ("local_block_dilation", local_block_dilation)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"{name}: expected a positive int, received {value!r}")
    if preset_name not in PRESETS:
        raise ValueError(f"preset_name: expected one of {sorted(PRESETS)}, received "
                         f"{preset_name!r}")
    preset = PRESETS[preset_name]
    if steps is not None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps: expected a positive int, received {steps!r}")
        print(f"openmsa train: --steps {steps}: the preset's {preset.steps} steps, its warmup, "
              f"curriculum and evaluation interval scaled by {steps / preset.steps:.3g}")
        preset = with_steps(preset, steps)
    if layers is not None:
        preset = replace(preset, layers=layers)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: expected a device this torch can use, received {device} "
                         f"(torch {torch.__version__} sees no CUDA GPU)")
    print(f"openmsa train: preset {preset_name} on {device}, index precision "
          f"{index_precision}, index shared every {share_index_every} layers"
          f"{' (sharing layers teach it)' if share_index_kl else ''}: {asdict(preset)}")
    progress = _progress_printer()
    if num_local_blocks > preset.top_k:
        raise ValueError(f"num_local_blocks: expected an int <= the preset's top_k="
                         f"{preset.top_k}, received {num_local_blocks}")
    histories = {kind: train_model(kind, preset, device, seed, progress, index_precision,
                                   share_index_every, num_local_blocks, local_block_dilation,
                                   share_index_kl)
                 for kind in ("dense", "msa")}
    final = {kind: history[-1] for kind, history in histories.items()}
    summary = {"preset": preset_name, "settings": asdict(preset), "device": str(device),
               "seed": seed, "index_precision": index_precision,
               "share_index_every": share_index_every, "share_index_kl": share_index_kl,
               "num_local_blocks": num_local_blocks,
               "local_block_dilation": local_block_dilation, "final": final}
    os.makedirs(out_dir, exist_ok=True)  # only now: a run that fails early leaves no folder
    with open(os.path.join(out_dir, "metrics.json"), "w") as f:
        json.dump({"summary": summary, "history": histories}, f, indent=2)
    rows = [record for history in histories.values() for record in history]
    with open(os.path.join(out_dir, "metrics.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
        writer.writeheader()
        writer.writerows(rows)
    skipped_plot = _write_plot(histories, out_dir, preset_name)
    dense, msa = final["dense"], final["msa"]
    print(f"\nfinal ({preset.final_eval_samples} held-out samples, {preset.steps} steps): dense "
          f"accuracy {dense['final_accuracy']:.3f} | MSA accuracy {msa['final_accuracy']:.3f}, "
          f"KL {msa['train_kl']:.4f}, block recall {msa['final_block_recall']:.3f}, mass recall "
          f"{msa['final_mass_recall']:.3f}; chance accuracy {1 / 16:.3f}")
    if skipped_plot:
        print(skipped_plot)
        print(f"wrote {out_dir}/metrics.json, metrics.csv")
    else:
        print(f"wrote {out_dir}/metrics.json, metrics.csv, curves.png")
    return summary
