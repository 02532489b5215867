"""The LM presets' path on the GPU: a converted Hugging Face Llama (fp32 weights) training under
bf16 autocast on the kernels, every layer selecting and with index sharing, then its checkpoint
evaluated through the cache path. Skipped without a GPU."""

import json
import math
import os
import subprocess
import sys

import pytest

from openmsa.train.lm import run_lm


@pytest.mark.parametrize("share_index_every", [1, 2])
def test_ruler_tiny_trains_under_bf16_autocast_and_loads(tmp_path, share_index_every):
    histories = run_lm("ruler-tiny", str(tmp_path), device="cuda",
                       msa_options=dict(share_index_every=share_index_every))
    msa = histories["msa"]
    assert [h["phase"] for h in msa] == ["warmup", "warmup", "sparse", "sparse"]
    assert all(math.isfinite(h["loss"]) and math.isfinite(h["kl"]) for h in msa)
    assert all(h["kl"] > 0 for h in msa)  # the KL trained the index branch in both phases
    with open(os.path.join(tmp_path, "msa", "openmsa.json")) as handle:
        assert json.load(handle)["msa_options"]["share_index_every"] == share_index_every
    subprocess.run([sys.executable, "-m", "openmsa.cli", "eval", "--model",
                    str(tmp_path / "msa"), "--lengths", "256", "--samples", "3", "--batch", "2",
                    "--tasks", "niah_single", "--out", str(tmp_path / "eval")], check=True)
    with open(tmp_path / "eval" / "eval.json") as handle:
        report = json.load(handle)
    assert report["settings"]["msa_options"]["share_index_every"] == share_index_every
    assert {row["mode"] for row in report["summary"]} >= {"dense", "msa"}
    # The teacher-forced answer-token accuracy ran in both attentions on the GPU kernels, and
    # samples generated two at a time (a batch of 2, then 1) through the cache path.
    assert all(0.0 <= sample["token_accuracy"] <= 1.0 for sample in report["samples"])
    assert len(report["samples"]) == 3 * 2 and report["settings"]["batch"] == 2
