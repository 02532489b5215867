"""The ``openmsa`` command line and the README's example."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from openmsa import cli
from openmsa.testing import compare_with_reference


def test_check_passes_and_prints_a_table(capsys):
    assert cli.main(["check", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "3 passed, 0 failed" in printed
    for case in cli.CPU_CASES:
        assert re.search(rf"^{case.name}\s.*PASS", printed, re.MULTILINE)


def test_check_fails_for_a_wrong_implementation():
    """The comparison behind ``openmsa check`` must catch a broken function."""

    def wrong(*tensors, **options):
        out, kl, *rest = cli.msa_attention(*tensors, **options)
        return (out * 1.01, kl, *rest)

    case = cli.CPU_CASES[0]
    comparison = compare_with_reference(wrong, case, torch.float32, "cpu")
    assert not comparison.passed(cli.TOLERANCE[torch.float32])


def test_console_script_runs():
    result = subprocess.run([sys.executable, "-m", "openmsa.cli", "--help"], capture_output=True,
                            text=True, check=True)
    assert "check" in result.stdout


def test_readme_python_examples_run():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.DOTALL)
    assert blocks
    namespace = {}  # the blocks read as one story: later ones use the first one's imports
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)


def test_unknown_subcommand_exits_with_usage_error():
    with pytest.raises(SystemExit) as raised:
        cli.main(["frobnicate"])
    assert raised.value.code == 2


def test_train_smoke_preset_writes_metrics_and_plot(tmp_path):
    import json

    assert cli.main(["train", "--preset", "tiny", "--out", str(tmp_path)]) == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert set(metrics["history"]) == {"dense", "msa"}
    final = metrics["summary"]["final"]["msa"]
    assert 0.0 <= final["eval_block_recall"] <= 1.0 and final["train_kl"] >= 0.0
    assert (tmp_path / "metrics.csv").read_text().count("\n") == 5  # header + 2 evals x 2
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
