"""The ``openmsa`` command line and the README's example."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from openmsa import MSAAttention, cli
from openmsa.ops import pipeline as pipeline_module
from openmsa.ops.interpreter import INTERPRETING
from openmsa.testing import TOLERANCE, compare_with_reference


needs_interpreter = pytest.mark.skipif(
    not INTERPRETING, reason="needs TRITON_INTERPRET=1 (the README's test command)")


@needs_interpreter
def test_check_on_a_cpu_runs_the_kernels_under_the_interpreter(capsys, monkeypatch):
    """On a CPU the default check exercises the Triton kernels (interpreted), not the
    reference against itself."""
    calls = []
    original = pipeline_module.select_blocks_fwd  # selection's Triton kernel
    monkeypatch.setattr(pipeline_module, "select_blocks_fwd",
                        lambda *a, **kw: calls.append(1) or original(*a, **kw))
    assert cli.main(["check", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "backend=triton" in printed and "interpreted on the CPU" in printed
    assert f"{len(cli.CPU_CASES)} passed, 0 failed" in printed
    for case in cli.CPU_CASES:
        assert re.search(rf"^{case.name}\s.*PASS", printed, re.MULTILINE)
    assert calls  # the kernels ran


def test_check_without_the_interpreter_starts_one(tmp_path):
    """Started without TRITON_INTERPRET=1 (as a user types it), ``openmsa check`` on a CPU runs
    itself again with the interpreter instead of comparing the reference with itself."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "openmsa", "check", "--device", "cpu"],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "under Triton's CPU interpreter" in result.stdout
    assert "backend=triton" in result.stdout
    assert f"{len(cli.CPU_CASES)} passed, 0 failed" in result.stdout


def test_check_of_the_reference_says_it_checks_no_kernel(capsys):
    assert cli.main(["check", "--device", "cpu", "--backend", "reference"]) == 0
    assert "no kernels" in capsys.readouterr().out


def test_check_refuses_bfloat16_under_the_interpreter(capsys):
    assert cli.main(["check", "--device", "cpu", "--dtype", "bfloat16"]) == 2
    assert "bfloat16" in capsys.readouterr().err


def test_check_fails_for_a_wrong_implementation():
    """The comparison behind ``openmsa check`` must catch a broken function."""

    def wrong(*tensors, **options):
        out, kl, *rest = cli.msa_attention(*tensors, **options)
        return (out * 1.01, kl, *rest)

    case = cli.CPU_CASES[0]
    comparison = compare_with_reference(wrong, case, torch.float32, "cpu")
    assert not comparison.passed(TOLERANCE[torch.float32])


@pytest.mark.parametrize("module", ["openmsa", "openmsa.cli"])
def test_help_names_every_command_with_what_it_does(module):
    """``python -m openmsa`` works like the ``openmsa`` command; its help says what each
    command does and shows examples."""
    result = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                            text=True, check=True)
    for command, words in (("train", "train an MSA model"), ("check", "compare msa_attention"),
                           ("bench", "time MSA against dense")):
        assert re.search(rf"^\s+{command}\s+.*{words}", result.stdout, re.MULTILINE), command
        assert re.search(rf"^\s+openmsa {command}\b", result.stdout, re.MULTILINE), command
    if module == "openmsa":
        return  # the same parser: its commands' help is checked once, below
    for command in ("train", "check", "bench", "eval"):
        sub = subprocess.run([sys.executable, "-m", module, command, "--help"],
                             capture_output=True, text=True, check=True)
        assert sub.stdout.startswith(f"usage: openmsa {command}"), command


@pytest.mark.parametrize("number", range(3))
def test_readme_python_examples_run_as_copied(number):
    """Each of the README's Python snippets runs on its own, in a fresh namespace, as a user
    pastes it."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.DOTALL)
    assert len(blocks) == 3
    exec(compile(blocks[number], f"README.md, snippet {number + 1}", "exec"), {})


def test_unknown_subcommand_exits_with_usage_error():
    with pytest.raises(SystemExit) as raised:
        cli.main(["frobnicate"])
    assert raised.value.code == 2


@pytest.mark.parametrize("arguments,says", [
    (["--steps", "0"], "argument --steps: expected a positive integer, got 0"),
    (["--steps", "-5"], "argument --steps: expected a positive integer, got -5"),
    (["--steps", "two"], "argument --steps: expected a positive integer, got 'two'"),
    (["--device", "foo"], "argument --device: expected cpu or cuda, got 'foo'"),
    (["--device", "mps"], "argument --device: expected cpu or cuda, got 'mps'"),
    pytest.param(["--device", "cuda"], "argument --device: 'cuda': this torch",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="has a GPU")),
])
def test_train_refuses_bad_values_before_it_starts(arguments, says, tmp_path, capsys):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as raised:
        cli.main(["train", "--preset", "tiny", "--out", str(out), *arguments])
    assert raised.value.code == 2
    assert says in capsys.readouterr().err
    assert not out.exists()  # no empty output folder left behind


def test_train_steps_scale_the_curriculum_instead_of_dropping_it():
    from openmsa.train.run import PRESETS, with_steps

    gpu = PRESETS["gpu"]  # 900 steps: 300 at 256 tokens, 200 at 2048, warmup 600, eval 50
    tenth = with_steps(gpu, 90)
    assert tenth.curriculum == ((30, 256, 32), (20, 2048, 16))
    assert (tenth.steps, tenth.warmup_steps, tenth.eval_every) == (90, 60, 5)
    assert with_steps(gpu, 900) == gpu
    tiny = with_steps(gpu, 2)  # the full length keeps a step of its own
    assert tiny.curriculum == ((1, 256, 32),) and tiny.warmup_steps == 1
    assert with_steps(gpu, 1).curriculum == () and with_steps(gpu, 1).warmup_steps == 0


def test_train_without_matplotlib_saves_the_metrics_and_says_the_plot_was_skipped(
        tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    assert cli.main(["train", "--preset", "tiny", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "held-out samples" in printed and "matplotlib is not installed" in printed
    assert (tmp_path / "metrics.json").exists() and (tmp_path / "metrics.csv").exists()
    assert not (tmp_path / "curves.png").exists()


def test_train_progress_shows_elapsed_time_and_eta(capsys):
    from openmsa.train.run import _progress_printer

    show = _progress_printer()  # not a terminal here: a line per evaluation
    record = dict(step=2, task_loss=1.0, eval_accuracy=0.5)
    show("dense", 1, 4, None)
    show("dense", 2, 4, record)
    line = capsys.readouterr().out.strip()
    assert re.fullmatch(r"dense step 2/4 \d+:\d\d elapsed, ETA \d+:\d\d loss 1\.000 acc 0\.50",
                        line), line


def test_train_smoke_preset_writes_metrics_and_plot(tmp_path):
    import json

    assert cli.main(["train", "--preset", "tiny", "--out", str(tmp_path)]) == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert set(metrics["history"]) == {"dense", "msa"}
    final = metrics["summary"]["final"]["msa"]
    assert 0.0 <= final["eval_block_recall"] <= 1.0 and final["train_kl"] >= 0.0
    assert (tmp_path / "metrics.csv").read_text().count("\n") == 5  # header + 2 evals x 2
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_context_parallel_example_runs_on_three_processes_and_the_modes_agree(tmp_path):
    """Sequence mode takes any number of ranks (3 here); at the same world size both modes
    print the same totals (loss, KL, gradient norms)."""
    example = Path(__file__).parents[1] / "examples" / "context_parallel.py"
    totals = {}
    for port, mode in enumerate(("sequence", "head"), start=29500):
        result = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "3",
             "--master_port", str(port), str(example), "--mode", mode],
            capture_output=True, text=True, cwd=tmp_path, timeout=600)
        # A rank's own abort message (gloo, C++) precedes torchrun's summary: show both.
        aborts = [line for line in result.stderr.splitlines()
                  if re.search(r"terminate|what\(\)|Error|error:", line)]
        found = re.search(rf"total over 3 ranks \({mode} mode\): (.*)", result.stdout)
        # Gloo's threads now and then abort a process at its exit on a loaded machine
        # ("terminate called without an active exception", then torchrun's failure report).
        # When every rank printed its line and rank 0 the totals (after all-reduces every rank
        # joined), only the barrier and the teardown were left: the totals still count. Any
        # other failure fails.
        exit_abort = (found is not None and len(re.findall(r"rank \d/3", result.stdout)) == 3
                      and "terminate called without an active exception" in result.stderr)
        assert result.returncode == 0 or exit_abort, (
            "\n".join(aborts[-10:]) + "\n" + result.stdout[-500:] + result.stderr[-1500:])
        assert found, result.stdout
        totals[mode] = found.group(1)
    assert totals["sequence"] == totals["head"]


def _train_and_record_models(monkeypatch, out, *arguments):
    """``openmsa train --preset tiny ARGUMENTS``: the models it built and its summary."""
    import json

    from openmsa.train import run as train_run

    built = []
    original = train_run.RetrievalModel

    def recording(*args, **kwargs):
        built.append(original(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(train_run, "RetrievalModel", recording)
    assert cli.main(["train", "--preset", "tiny", *arguments, "--out", str(out)]) == 0
    return built, json.loads((out / "metrics.json").read_text())["summary"]


def _msa_layers(models):
    return [module for model in models for module in model.modules()
            if getattr(module, "is_msa_layer", False)]


def test_train_index_precision_reaches_every_msa_layer_and_the_metrics(tmp_path, monkeypatch):
    built, summary = _train_and_record_models(monkeypatch, tmp_path, "--index-precision", "fp8")
    layers = _msa_layers(built)
    assert layers and all(layer.options["index_precision"] == "fp8" for layer in layers)
    assert summary["index_precision"] == "fp8"
    with pytest.raises(SystemExit):
        cli.main(["train", "--preset", "tiny", "--index-precision", "int4"])


def test_train_shares_the_index_across_layers_when_asked(tmp_path, monkeypatch):
    """--layers 3 --share-index-every 2: the MSA model's layers 0 and 2 select, layer 1 reuses
    layer 0's selection; the summary records it; bad values are refused."""
    built, summary = _train_and_record_models(monkeypatch, tmp_path, "--layers", "3",
                                              "--share-index-every", "2")
    msa = [model for model in built if isinstance(model.blocks[0].attention, MSAAttention)]
    assert len(msa) == 1 and len(msa[0].blocks) == 3
    assert [b.attention.has_index_branch for b in msa[0].blocks] == [True, False, True]
    assert summary["share_index_every"] == 2 and summary["settings"]["layers"] == 3
    assert summary["share_index_kl"] is False
    assert not msa[0].blocks[1].attention.share_index_kl
    with pytest.raises(SystemExit):
        cli.main(["train", "--preset", "tiny", "--share-index-every", "0"])


def test_train_share_index_kl_makes_sharing_layers_teach(tmp_path, monkeypatch):
    """--share-index-kl: the MSA model's sharing layer teaches layer 0's index branch, the
    model's KL averages all its layers, the final evaluation covers the preset's samples; the
    flag without sharing is refused."""
    built, summary = _train_and_record_models(monkeypatch, tmp_path, "--layers", "2",
                                              "--share-index-every", "2", "--share-index-kl")
    msa = next(model for model in built if isinstance(model.blocks[0].attention, MSAAttention))
    assert [b.attention.share_index_kl for b in msa.blocks] == [False, True]
    assert summary["share_index_kl"] is True
    assert {"final_accuracy", "final_block_recall", "final_mass_recall"} <= set(
        summary["final"]["msa"])
    final_accuracy = summary["final"]["dense"]["final_accuracy"]
    assert final_accuracy * 128 == round(final_accuracy * 128)  # 128 samples: the tiny preset's
    x = (torch.randint(16, (2, 192)), torch.randint(16, (2, 192)))
    _, kl = msa(x)
    assert [block.attention.last_index_inputs is not None for block in msa.blocks] == [True,
                                                                                     False]
    with torch.no_grad():
        hidden = msa.key_embedding(x[0]) + msa.value_embedding(x[1])
        layer_kls = []
        for block in msa.blocks:
            hidden, layer_kl, _ = block(hidden, False)
            layer_kls.append(layer_kl)
    torch.testing.assert_close(kl.detach(), torch.stack(layer_kls).mean())
    assert layer_kls[1] > 0
    with pytest.raises(SystemExit, match="--share-index-kl needs --share-index-every"):
        cli.main(["train", "--preset", "tiny", "--share-index-kl"])


def test_train_local_window_options_reach_every_msa_layer(tmp_path, monkeypatch):
    """--num-local-blocks 2 --local-block-dilation 3: every MSA layer's attention options and
    the summary carry them; a window wider than the preset's top_k and a dilation of 0 are
    refused."""
    built, summary = _train_and_record_models(monkeypatch, tmp_path, "--num-local-blocks", "2",
                                              "--local-block-dilation", "3")
    layers = _msa_layers(built)
    assert layers and all((layer.options["num_local_blocks"],
                           layer.options["local_block_dilation"]) == (2, 3) for layer in layers)
    assert (summary["num_local_blocks"], summary["local_block_dilation"]) == (2, 3)
    with pytest.raises(SystemExit):
        cli.main(["train", "--preset", "tiny", "--local-block-dilation", "0"])
    with pytest.raises(ValueError, match="^num_local_blocks: expected an int <= the preset's "
                                         "top_k=2, received 3$"):
        cli.main(["train", "--preset", "tiny", "--num-local-blocks", "3",
                  "--out", str(tmp_path / "wide")])
