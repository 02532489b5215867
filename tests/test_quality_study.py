"""benchmarks/quality_study.py (the long-context quality study's driver) on the CPU: its jobs'
commands, resuming, failing loudly, and the report's comparisons; and ``openmsa train --models``,
which lets its runs share a GPU."""

import importlib.util
import json
import os
import sys
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def study():
    path = os.path.join(ROOT, "benchmarks", "quality_study.py")
    spec = importlib.util.spec_from_file_location("quality_study", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _args(out, **overrides):
    settings = dict(out=str(out), preset="ruler-tiny", seeds=[0, 1], variants=["share2"],
                    steps=None, adapt_steps=5, lengths="256,512", samples=2,
                    device_args=["--device", "cpu"], parallel=4, train_args=[], eval_batch=1,
                    only_variants=False, merge=[])
    return SimpleNamespace(**dict(settings, **overrides))


def test_jobs_train_each_model_of_each_seed_and_variant_apart(study, tmp_path):
    jobs = study._jobs_train(_args(tmp_path))
    outputs = [output for _, _, output in jobs]
    assert outputs == [str(tmp_path / f"seed{s}" / p) for s in (0, 1)
                       for p in ("dense", "msa", "share2/msa")]
    for log, command, _ in jobs:
        assert command[command.index("--seed") + 1] in log  # each seed's log in its folder
        assert command[-4:] == ["--device", "cpu", "--data-workers", "0"]
    variant = jobs[2][1]
    assert variant[variant.index("--models") + 1] == "msa"
    assert variant[variant.index("--share-index-every") + 1] == "2"
    assert len({log for log, _, _ in jobs}) == len(jobs)
    on_gpu = study._jobs_train(_args(tmp_path, device_args=[], parallel=2))[0][1]
    assert int(on_gpu[on_gpu.index("--data-workers") + 1]) == max(1, (os.cpu_count() - 2) // 2)
    adapt = study._jobs_adapt(_args(tmp_path))[1][1]
    assert adapt[adapt.index("--adapt-index") + 1] == str(tmp_path / "seed1" / "dense")
    tuned = study._jobs_train(_args(tmp_path, train_args=["--grad-clip", "1"]))
    assert all(command[-2:] == ["--grad-clip", "1"] for _, command, _ in tuned)
    assert "--grad-clip" not in study._jobs_adapt(_args(tmp_path, train_args=["--grad-clip",
                                                                                "1"]))[0][1]
    batched = study._jobs_eval(_args(tmp_path, eval_batch=5))[0][1]
    assert batched[batched.index("--batch") + 1] == "5"
    evals = study._jobs_eval(_args(tmp_path))
    assert [os.path.basename(os.path.dirname(out)) for _, _, out in evals[:4]] == [
        "eval_dense", "eval_msa", "eval_adapted", "eval_msa_share2"]


def test_jobs_skip_done_outputs_and_a_failed_one_stops_the_stage(study, tmp_path, capsys):
    done = tmp_path / "done.txt"
    done.write_text("")
    write = f"open({str(tmp_path / 'new.txt')!r}, 'w').close()"
    jobs = [(str(tmp_path / "a.log"), [sys.executable, "-c", "raise SystemExit(3)"], str(done)),
            (str(tmp_path / "b.log"), [sys.executable, "-c", write], str(tmp_path / "new.txt"))]
    study.run_jobs(jobs, 2, "train")
    assert (tmp_path / "new.txt").exists() and not (tmp_path / "a.log").exists()
    assert "1 to run, 1 done before" in capsys.readouterr().out
    failing = [(str(tmp_path / "c.log"),
                [sys.executable, "-c", "print('the reason'); raise SystemExit(2)"],
                str(tmp_path / "never.txt"))]
    with pytest.raises(SystemExit, match=r"(?s)c\.log failed \(exit 2\).*the reason"):
        study.run_jobs(failing, 1, "eval")


def _eval_json(folder, accuracies, token_shift=None):
    """An eval.json of ``accuracies``; with ``token_shift``, answer-token accuracies of each
    accuracy plus it (else none, as evaluations before that score existed)."""
    os.makedirs(folder)
    rows = [dict(task=task, length=length, mode=mode, samples=2, accuracy=value,
                 block_recall=None, mass_recall=None)
            for (task, length, mode), value in accuracies.items()]
    if token_shift is not None:
        for row in rows:
            row["token_accuracy"] = row["accuracy"] + token_shift[row["mode"]]
    with open(os.path.join(folder, "eval.json"), "w") as handle:
        json.dump(dict(settings={}, summary=rows, samples=[]), handle)


def test_report_compares_msa_training_and_the_adapted_model_over_seeds(study, tmp_path):
    for seed, shift in ((0, 0.0), (1, 0.1)):
        root = tmp_path / f"seed{seed}"
        for name, dense, msa in (("dense", 0.8, 0.1), ("msa", 0.6, 0.7), ("adapted", 0.8, 0.5),
                                 ("msa_share2", 0.5, 0.4)):
            _eval_json(str(root / f"eval_{name}"),
                       {("average", 256, "dense"): dense + shift,
                        ("average", 256, "msa"): msa + shift,
                        ("average", 512, "dense"): dense,
                        ("average", 512, "msa"): msa - shift},
                       # Seed 1 alone has answer-token accuracies: their mean is its own.
                       None if seed == 0 else {"dense": 0.05, "msa": 0.15})
    result = study.report(_args(tmp_path))
    points = {(c["comparison"], c["length"]): c["points"] for c in result["comparisons"]}
    tokens = {(c["comparison"], c["length"]): c["token_points"]
              for c in result["comparisons"]}
    # seed 1 at 256: msa (MSA) 0.8 + 0.15, dense (dense) 0.9 + 0.05; adapted 0.6 + 0.15 - 0.95;
    # at 512: share2 (MSA) 0.3 + 0.15, dense (dense) 0.8 + 0.05
    assert tokens[("msa-trained (MSA) - dense-trained (dense)", 256)] == pytest.approx(0)
    assert tokens[("adapted (MSA) - adapted (dense)", 256)] == pytest.approx(-20)
    assert tokens[("msa_share2 (MSA) - dense-trained (dense)", 512)] == pytest.approx(-40)
    assert points[("msa-trained (MSA) - dense-trained (dense)", 256)] == pytest.approx(-10)
    assert points[("msa-trained (MSA) - dense-trained (dense)", 512)] == pytest.approx(-15)
    assert points[("adapted (MSA) - adapted (dense)", 256)] == pytest.approx(-30)
    assert points[("msa_share2 (MSA) - dense-trained (dense)", 512)] == pytest.approx(-45)
    saved = json.load(open(tmp_path / "study.json"))
    assert saved["training_length"] == 320 and len(saved["rows"]) == 2 * 4 * 4


def test_only_variants_runs_the_variants_models_alone(study, tmp_path):
    args = _args(tmp_path, only_variants=True, variants=["fp8", "share2"], seeds=[1])
    trained = [output for _, _, output in study._jobs_train(args)]
    assert trained == [str(tmp_path / "seed1" / v / "msa") for v in ("fp8", "share2")]
    fp8 = study._jobs_train(args)[0][1]
    assert fp8[fp8.index("--index-precision") + 1] == "fp8"
    assert study._jobs_adapt(args) == []
    evaluated = [os.path.basename(os.path.dirname(out)) for _, _, out in study._jobs_eval(args)]
    assert evaluated == ["eval_msa_fp8", "eval_msa_share2"]


def test_report_merges_an_earlier_studys_rows_and_this_runs_win(study, tmp_path):
    """The base models from an earlier call's study.json (as a record holds it), the variant
    from this run; the earlier file's stale variant rows give way to this run's."""
    earlier = tmp_path / "earlier"
    for name, dense, msa in (("dense", 0.8, 0.1), ("msa", 0.6, 0.7), ("adapted", 0.8, 0.5),
                             ("msa_share2", 0.0, 0.0)):
        _eval_json(str(earlier / "seed0" / f"eval_{name}"),
                   {("average", 256, "dense"): dense, ("average", 256, "msa"): msa})
    first = study.report(_args(earlier, seeds=[0]))
    record = tmp_path / "record.json"
    record.write_text(json.dumps(dict(command="...", study=first)))
    now = tmp_path / "now"
    _eval_json(str(now / "seed0" / "eval_msa_share2"),
               {("average", 256, "dense"): 0.5, ("average", 256, "msa"): 0.4})
    result = study.report(_args(now, seeds=[0], only_variants=True, merge=[str(record)]))
    points = {(c["comparison"], c["length"]): c["points"] for c in result["comparisons"]}
    assert points[("msa_share2 (MSA) - dense-trained (dense)", 256)] == pytest.approx(-40)
    assert points[("msa-trained (MSA) - dense-trained (dense)", 256)] == pytest.approx(-10)
    assert len(result["rows"]) == 4 * 2 and result["merged"] == [str(record)]
    study.report(_args(tmp_path / "fresh", seeds=[0], merge=[str(record)]))
    assert (tmp_path / "fresh" / "study.json").exists()  # a merged report alone: no folder yet
    with pytest.raises(SystemExit, match="--merge: .* samples 2, this one of 3"):
        study.report(_args(now, seeds=[0], samples=3, merge=[str(record)]))


def test_bad_only_variants_and_merge_arguments_are_named(study, tmp_path, monkeypatch):
    for argv, message in ((["--only-variants"], "--only-variants: name the variants"),
                          (["--merge", str(tmp_path / "none.json")], "--merge: no file")):
        monkeypatch.setattr(sys, "argv", ["quality_study.py", "--out", str(tmp_path), *argv])
        with pytest.raises(SystemExit, match=message):
            study.main()


def test_train_one_model_of_an_lm_preset(tmp_path):
    from openmsa.cli import main

    main(["train", "--preset", "ruler-tiny", "--models", "msa", "--device", "cpu",
          "--out", str(tmp_path)])
    assert sorted(os.listdir(tmp_path)) == ["history_msa.json", "msa"]
    history = json.load(open(tmp_path / "history_msa.json"))["history"]
    assert list(history) == ["msa"]
    with pytest.raises(SystemExit):
        main(["train", "--preset", "ruler-tiny", "--models", "sparse", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--data-workers: expected 0 or more"):
        main(["train", "--preset", "ruler-tiny", "--data-workers", "-1", "--out",
              str(tmp_path)])


def test_report_takes_an_unfinished_evaluation_from_the_lengths_its_samples_file_completes(
        study, tmp_path, capsys):
    """An evaluation cut at 512 tokens (no eval.json): the report takes its 256-token cells
    from the samples file, leaves 512 out and says so."""
    settings = dict(tasks=["niah_single", "common_words"], lengths=[256, 512], samples=2,
                    modes=["dense", "msa"])
    for name in ("dense", "msa", "adapted", "msa_share2"):
        folder = tmp_path / "seed0" / f"eval_{name}"
        folder.mkdir(parents=True)
        lines = [json.dumps({"settings": settings})]
        for length, samples in ((256, 2), (512, 1)):  # 512: one of two samples done
            for task in settings["tasks"]:
                for sample in range(samples):
                    for mode in settings["modes"]:
                        score = 1.0 if (name, mode) == ("msa", "msa") else 0.5
                        lines.append(json.dumps(dict(task=task, length=length, sample=sample,
                                                     mode=mode, score=score,
                                                     token_accuracy=score)))
        (folder / "samples.jsonl").write_text("\n".join(lines) + "\n" + '{"task": "ni')
    result = study.report(_args(tmp_path, seeds=[0]))
    points = {(c["comparison"], c["length"]): c["points"] for c in result["comparisons"]}
    assert points == {("msa-trained (MSA) - dense-trained (dense)", 256): pytest.approx(50),
                      ("adapted (MSA) - adapted (dense)", 256): pytest.approx(0),
                      ("msa_share2 (MSA) - dense-trained (dense)", 256): pytest.approx(0)}
    assert result["unfinished_evaluations"][0] == "seed0/dense: unfinished: no 512 tokens"
    assert "evaluation from its samples file, seed0/msa" in capsys.readouterr().out
