"""benchmarks/probe_lm_learning.py on the CPU: a preset's batches, its evaluations at the
probe's length and at the first phase's, and the rows written at every evaluation."""

import importlib
import json
import os
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "benchmarks")


@pytest.fixture
def probe(monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)
    return importlib.import_module("probe_lm_learning")


def test_preset_probe_evaluates_both_lengths_at_every_evaluation(probe, tmp_path, monkeypatch):
    out = tmp_path / "probe.json"
    monkeypatch.setattr(sys, "argv", ["probe", "--preset", "ruler-tiny", "--steps", "4",
                                      "--every", "2", "--length", "320", "--out", str(out)])
    probe.main()
    rows = json.loads(out.read_text())["rows"]
    # ruler-tiny: 2 steps at 256 tokens (its first phase), then its own 320.
    assert [(row["step"], row["length"]) for row in rows] == [(2, 256), (4, 320)]
    for row in rows:
        assert set(row["accuracy"]) == {"niah_single", "variable_tracking",
                                        "niah_single@256", "variable_tracking@256"}
        assert all(0.0 <= value <= 1.0 for value in row["accuracy"].values())


def test_rows_are_on_disk_before_the_run_ends(probe, tmp_path, monkeypatch):
    """A run cut after its first evaluation (a device's time limit) keeps that row."""
    out = tmp_path / "probe.json"
    monkeypatch.setattr(sys, "argv", ["probe", "--preset", "ruler-tiny", "--steps", "4",
                                      "--every", "2", "--length", "320", "--out", str(out)])
    train_step, calls = probe.train_step, []

    def cut_at_step_three(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt("the time limit")
        return train_step(*args, **kwargs)

    monkeypatch.setattr(probe, "train_step", cut_at_step_three)
    try:
        probe.main()
    except KeyboardInterrupt:
        pass
    assert len(calls) == 3
    assert [row["step"] for row in json.loads(out.read_text())["rows"]] == [2]


def test_preset_overrides_are_applied_and_recorded(probe, tmp_path, monkeypatch):
    """--lr and --first-steps over the preset's; the output names the model that ran."""
    out = tmp_path / "probe.json"
    monkeypatch.setattr(sys, "argv", ["probe", "--preset", "ruler-tiny", "--steps", "4",
                                      "--every", "1", "--length", "320", "--lr", "0.01",
                                      "--first-steps", "3", "--out", str(out)])
    rates = []
    adamw = probe.torch.optim.AdamW
    monkeypatch.setattr(probe.torch.optim, "AdamW",
                        lambda params, lr: rates.append(lr) or adamw(params, lr=lr))
    probe.main()
    result = json.loads(out.read_text())
    assert rates == [0.01]
    assert [row["length"] for row in result["rows"]] == [256, 256, 256, 320]
    assert result["preset"]["lr"] == 0.01
    assert result["preset"]["curriculum"][0][:2] == [3, 256]
    assert result["preset"]["layers"] == 2


def test_batches_from_workers_train_alike(probe, tmp_path, monkeypatch):
    """--data-workers 1 (batches made ahead in a spawned process) gives the same run as 0."""
    losses = {}
    for workers in ("0", "1"):
        out = tmp_path / f"probe{workers}.json"
        monkeypatch.setattr(sys, "argv", ["probe", "--preset", "ruler-tiny", "--steps", "4",
                                          "--every", "1", "--length", "320",
                                          "--data-workers", workers, "--out", str(out)])
        probe.main()
        losses[workers] = [row["loss"] for row in json.loads(out.read_text())["rows"]]
    assert len(losses["0"]) == 4 and losses["0"] == losses["1"]
