"""The LM presets' optimizer settings (``openmsa.train.lm``): the learning-rate schedule,
gradient clipping, their flags and their record in the history."""

import dataclasses
import json
import math

import pytest
import torch

pytest.importorskip("transformers")

from openmsa.eval.tasks import synthetic_tokenizer  # noqa: E402
from openmsa.train.batches import BatchSpec, make_batch  # noqa: E402
from openmsa.train.lm import (LM_PRESETS, build_model, check_optimizer_settings,  # noqa: E402
                              learning_rate, scaled_preset, train_step)

TINY = LM_PRESETS["ruler-tiny"]


def test_learning_rate_warms_up_then_stays_or_falls_along_a_cosine():
    constant = dataclasses.replace(TINY, lr=1.0, steps=101, lr_warmup=4)
    assert [learning_rate(constant, step) for step in (1, 2, 4, 5, 101)] == [
        0.25, 0.5, 1.0, 1.0, 1.0]
    cosine = dataclasses.replace(constant, lr_schedule="cosine", lr_final=0.2)
    assert learning_rate(cosine, 4) == 1.0  # the warmup's last step
    assert learning_rate(cosine, 101) == pytest.approx(0.2)  # lr_final at the last step
    assert learning_rate(cosine, 4 + 97 // 2) == pytest.approx(
        0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * 48 / 97)))
    values = [learning_rate(cosine, step) for step in range(4, 102)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert learning_rate(dataclasses.replace(cosine, lr_warmup=0), 1) < 1.0


@pytest.mark.parametrize("field, value, message", [
    ("lr", 0.0, "lr: expected a number > 0"), ("grad_clip", 0.0, "grad_clip: expected"),
    ("lr_schedule", "linear", "lr_schedule: expected one of"),
    ("lr_warmup", 4, "lr_warmup: expected 0 to steps - 1 = 3"),
    ("lr_final", 1.5, "lr_final: expected 0 to 1")])
def test_bad_optimizer_settings_are_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        check_optimizer_settings(dataclasses.replace(TINY, **{field: value}))


def test_fewer_steps_scale_the_learning_rate_warmup_with_the_rest():
    gpu = LM_PRESETS["ruler-gpu"]
    assert (gpu.grad_clip, gpu.lr_warmup, gpu.lr_schedule) == (1.0, 100, "cosine")
    short = scaled_preset(gpu, 400)
    assert (short.steps, short.lr_warmup, short.warmup_steps) == (400, 10, 300)
    assert sum(phase[0] for phase in short.curriculum) == 340
    assert scaled_preset(gpu, 20).lr_warmup == 0  # 0.5 rounds to 0: no warmup, still valid
    assert scaled_preset(gpu, 20, dict(lr_warmup=5)).lr_warmup == 5
    with pytest.raises(ValueError, match="optimizer: expected fields from"):
        scaled_preset(gpu, None, dict(momentum=0.9))


def _tiny_step(grad_clip):
    tokenizer = synthetic_tokenizer()
    model = build_model(TINY, tokenizer, "dense", 0, {})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    input_ids, labels = make_batch(tokenizer, BatchSpec("niah_single", 256, 2, 0))
    loss, kl, norm = train_step(model, optimizer, input_ids, labels, 0.0, False, grad_clip)
    after = torch.linalg.vector_norm(torch.stack([
        torch.linalg.vector_norm(p.grad) for p in model.parameters() if p.grad is not None]))
    return norm.item(), after.item()


def test_train_step_clips_the_gradients_and_returns_their_norm_before():
    norm, after = _tiny_step(None)
    assert after == pytest.approx(norm, rel=1e-5) and norm > 0.1
    clipped_norm, clipped_after = _tiny_step(0.1)
    assert clipped_norm == pytest.approx(norm, rel=1e-5)  # the norm before clipping
    assert clipped_after == pytest.approx(0.1, rel=1e-3)


def test_train_flags_set_the_optimizer_and_the_history_records_it(tmp_path, monkeypatch):
    from openmsa.cli import main
    from openmsa.train import lm

    used, step = [], lm.train_step

    def recording_step(model, optimizer, *args):
        used.append(optimizer.param_groups[0]["lr"])  # what the optimizer will step with
        return step(model, optimizer, *args)

    monkeypatch.setattr(lm, "train_step", recording_step)
    assert main(["train", "--preset", "ruler-tiny", "--models", "dense", "--device", "cpu",
                 "--lr", "2e-3", "--grad-clip", "0.5", "--lr-schedule", "cosine",
                 "--lr-warmup", "1", "--out", str(tmp_path)]) == 0
    saved = json.load(open(tmp_path / "history_dense.json"))
    preset = dataclasses.replace(TINY, lr=2e-3, grad_clip=0.5, lr_schedule="cosine",
                                 lr_warmup=1)
    assert {key: saved["settings"][key] for key in ("lr", "grad_clip", "lr_schedule",
                                                    "lr_warmup")} == {
        "lr": 2e-3, "grad_clip": 0.5, "lr_schedule": "cosine", "lr_warmup": 1}
    history = saved["history"]["dense"]
    assert [h["lr"] for h in history] == pytest.approx(
        [learning_rate(preset, step) for step in range(1, TINY.steps + 1)])
    assert used == [h["lr"] for h in history] and history[-1]["lr"] == pytest.approx(2e-4)
    assert all(math.isfinite(h["grad_norm"]) and h["grad_norm"] > 0 for h in history)


@pytest.mark.parametrize("argv, message", [
    (["--preset", "cpu", "--lr", "1e-3"], "--lr: only for training a ruler-"),
    (["--preset", "ruler-tiny", "--grad-clip", "-1"], "--grad-clip: expected a number > 0"),
    (["--preset", "ruler-tiny", "--lr-warmup", "9"], "--lr-warmup: expected 0 to steps - 1"),
    (["--preset", "ruler-tiny", "--steps", "20", "--lr-warmup", "25"],
     "--lr-warmup: expected 0 to steps - 1 = 19"),
    (["--preset", "ruler-tiny", "--adapt-index", "somewhere", "--grad-clip", "1"],
     "--grad-clip: only for training a ruler-\\* preset's models \\(not --preset ruler-tiny "
     "with --adapt-index\\)")])
def test_optimizer_flags_out_of_place_or_range_are_refused(tmp_path, argv, message):
    from openmsa.cli import main

    with pytest.raises(SystemExit, match=message):
        main(["train", *argv, "--out", str(tmp_path)])
