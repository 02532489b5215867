"""openmsa eval: the tasks, the scoring, the recalls and the command (CPU, reference)."""

import dataclasses
import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from openmsa.eval.run import (EvalSettings, answer_token_accuracy, encode_prompt,  # noqa: E402
                              equal_length_prompts, evaluate, evaluate_batch, evaluate_sample,
                              selection_recalls, smoke_model, summarize)
from openmsa.eval.tasks import (TASKS, answer_recall, answer_text, make_sample,  # noqa: E402
                                synthetic_tokenizer)


@pytest.fixture(scope="module")
def tokenizer():
    return synthetic_tokenizer()


def _tokens(tokenizer, text):
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("length", [256, 1000, 8192])
def test_samples_fit_their_length_and_hold_their_answers(tokenizer, task, length):
    """At most ``length`` tokens and near it, no unknown words; the answers are in the prompt
    (inside the needles where there are needles); variable tracking's chain in order; the
    common words are the ten most frequent."""
    sample = make_sample(task, tokenizer, length, seed=3)
    ids = tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    assert sample.prompt_ids == tuple(ids)  # the pieces' ids joined: the prompt's encoding
    assert 0.9 * length <= len(ids) <= length
    assert tokenizer.unk_token_id not in ids
    needles = [sample.prompt[a:b] for a, b in sample.needle_spans]
    if task == "common_words":
        assert not needles and len(sample.answers) == 10
        counts = {}
        for word in re.findall(r"\d+\. (\w+)", sample.prompt):
            counts[word] = counts.get(word, 0) + 1
        assert set(sorted(counts, key=counts.get)[-10:]) == set(sample.answers)
    elif task == "variable_tracking":
        assert needles[0].startswith(f"VAR {sample.answers[0].upper()} = ")
        for before, after, needle in zip(sample.answers, sample.answers[1:], needles[1:]):
            assert needle == f"VAR {after.upper()} = VAR {before.upper()}."
    else:
        assert len(needles) == (1 if task == "niah_single" else 4)
        for answer in sample.answers:
            assert any(needle.endswith(f"is: {answer}.") for needle in needles)
        expected = {"niah_single": 1, "niah_multikey": 1, "niah_multivalue": 4,
                    "niah_multiquery": 2}[task]
        assert len(sample.answers) == expected
    assert make_sample(task, tokenizer, length, seed=3) == sample
    assert make_sample(task, tokenizer, length, seed=4).prompt != sample.prompt


def _whole_text_tokenizer():
    """benchmarks/bench_batches.py's tokenizer of the whole-text route."""
    path = Path(__file__).parent.parent / "benchmarks" / "bench_batches.py"
    spec = importlib.util.spec_from_file_location("bench_batches", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.whole_text_tokenizer()


@pytest.mark.parametrize("task", TASKS)
def test_samples_and_batches_are_the_same_made_from_pieces_or_whole_texts(tokenizer, task):
    """The encoded-pieces route (word-level tokenizers) against whole-text tokenization."""
    from openmsa.eval.tasks import splits_at_whitespace
    from openmsa.train.batches import BatchSpec, make_batch

    whole = _whole_text_tokenizer()
    assert splits_at_whitespace(tokenizer) and not splits_at_whitespace(whole)
    for length in (256, 3000):
        pieces, text = (make_sample(task, t, length, seed=11) for t in (tokenizer, whole))
        assert text.prompt_ids is None and pieces.prompt_ids is not None
        assert dataclasses.replace(pieces, prompt_ids=None) == text
    spec = BatchSpec(task, 700, 3, seed=2)
    for a, b in zip(make_batch(tokenizer, spec), make_batch(whole, spec)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("task", TASKS)
def test_the_piece_cache_keeps_only_recurring_pieces(task):
    """A sample's own needles and question are not kept: more samples add no pieces."""
    from openmsa.eval import tasks

    tokenizer = synthetic_tokenizer()
    for seed in range(3):
        make_sample(task, tokenizer, 1000, seed)
    kept = len(tasks._PIECE_IDS[tokenizer])
    for seed in range(3, 9):
        make_sample(task, tokenizer, 1000, seed)
    assert len(tasks._PIECE_IDS[tokenizer]) == kept


def test_bad_task_and_length_are_refused(tokenizer):
    with pytest.raises(ValueError, match="^task: expected one of"):
        make_sample("niah", tokenizer, 1000, 0)
    with pytest.raises(ValueError, match="^length: expected an int >= 256"):
        make_sample("niah_single", tokenizer, 100, 0)


def test_answer_recall_counts_whole_words_with_spaced_digits_joined():
    assert answer_recall("the numbers are : 1 2 3 4 5 6 7 and 7654321", ("1234567", "7654321",
                                                                          "111")) == 2 / 3
    assert answer_recall("concatenate", ("cat",)) == 0.0
    assert answer_recall("Apple, RIVER.", ("apple", "river")) == 1.0


def test_selection_recalls_of_a_known_selection():
    """256 tokens (4 blocks of 64); main heads 0-1 (index head 0, KV head 0) attend only to
    block 1, heads 2-3 (index head 1) uniformly. Index head 0 keeps blocks 1 and 3, index
    head 1 block 0 and an unused slot: mass recall (1 + 1 + 1/4 + 1/4) / 4; block recall counts
    (needle, layer, index head) hits."""
    keys = torch.zeros(1, 256, 2, 8)
    keys[0, 64:128, :, 0] = 10.0
    query = torch.zeros(1, 4, 8)  # [B, H, D]
    query[0, :2, 0] = 10.0  # scores 30 on block 1 for heads 0-1 (scale 0.3), 0 elsewhere
    record = dict(ids=torch.tensor([[[1, 3], [0, -1]]]), query=query, keys=keys, scale=0.3,
                  block_size=64)
    needles = [range(70, 80), range(250, 256)]  # blocks 1 and 3
    recalls = selection_recalls([record, {}], needles)
    assert recalls["block_recall"] == pytest.approx(0.5)  # head 0 holds both, head 1 neither
    assert recalls["mass_recall"] == pytest.approx((1 + 1 + 0.25 + 0.25) / 4, abs=1e-6)
    assert selection_recalls([record], [])["block_recall"] is None


def test_msa_keeping_every_block_answers_as_dense_attention(tokenizer):
    """With top_k covering every block, MSA's generated continuation is dense attention's (same
    weights), its block and mass recall are 1; with 2 of 8 blocks it reads less mass."""
    model, tokenizer = smoke_model(dict(top_k=16, block_size=64, backend="reference"))
    sample = make_sample("niah_multivalue", tokenizer, 512, seed=0)
    dense = evaluate_sample(model, tokenizer, sample, "dense", "cpu")
    msa = evaluate_sample(model, tokenizer, sample, "msa", "cpu")
    assert msa["continuation"] == dense["continuation"] and msa["score"] == dense["score"]
    assert msa["token_accuracy"] == dense["token_accuracy"]
    assert msa["block_recall"] == 1.0 and msa["mass_recall"] == pytest.approx(1.0)
    assert "block_recall" not in dense
    sparse_model, _ = smoke_model(dict(top_k=2, block_size=64, backend="reference"))
    sparse = evaluate_sample(sparse_model, tokenizer, sample, "msa", "cpu")
    assert sparse["mass_recall"] < 0.9


def test_evaluate_and_summarize_cover_every_task_length_and_mode(tokenizer):
    model, tokenizer = smoke_model(dict(top_k=2, block_size=64, backend="reference",
                                        share_index_every=2))
    settings = EvalSettings(tasks=("niah_single", "common_words"), lengths=(300, 600),
                            samples=2)
    seen = []
    results = evaluate(model, tokenizer, settings, "cpu", lambda *a: seen.append(a[:2]))
    assert len(results) == 2 * 2 * 2 * 2 and seen[-1] == (16, 16)
    rows = summarize(results)
    keys = {(r["task"], r["length"], r["mode"]) for r in rows}
    assert keys == {(t, n, m) for t in ("niah_single", "common_words", "average")
                    for n in (300, 600) for m in ("dense", "msa")}
    for row in rows:
        if row["task"] == "niah_single" and row["mode"] == "msa":
            assert 0.0 <= row["block_recall"] <= 1.0 and 0.0 < row["mass_recall"] <= 1.0
        if row["task"] == "common_words" or row["mode"] == "dense":
            assert row["block_recall"] is None
    average = [r for r in rows if r["task"] == "average"][0]
    members = [r["accuracy"] for r in rows if r["task"] != "average"
               and (r["length"], r["mode"]) == (average["length"], average["mode"])]
    assert average["accuracy"] == pytest.approx(sum(members) / len(members))
    tokens = [r["token_accuracy"] for r in rows if r["task"] != "average"
              and (r["length"], r["mode"]) == (average["length"], average["mode"])]
    assert average["token_accuracy"] == pytest.approx(sum(tokens) / len(tokens))
    assert all(0.0 <= r["token_accuracy"] <= 1.0 for r in results)


class _Predicts(torch.nn.Module):
    """A causal LM stand-in whose greedy prediction at each position is the input's next
    token where ``right(next token)``, else token 0; it returns the last ``logits_to_keep``
    positions' logits, as Hugging Face models do."""

    def __init__(self, vocab, right):
        super().__init__()
        self.vocab, self.right = vocab, right

    def forward(self, input_ids, use_cache, logits_to_keep):
        following = torch.roll(input_ids, -1, dims=1)
        wanted = torch.where(self.right(following), following, torch.zeros_like(following))
        logits = torch.nn.functional.one_hot(wanted, self.vocab).float()
        return type("Output", (), {"logits": logits[:, -logits_to_keep:]})()


class _PredictsEveryPosition(_Predicts):
    """As ``_Predicts``, for a model without ``logits_to_keep``: every position's logits."""

    def forward(self, input_ids, use_cache):
        return super().forward(input_ids, use_cache, input_ids.shape[1])


def test_answer_token_accuracy_scores_the_answer_tokens_teacher_forced(tokenizer):
    sample = make_sample("niah_multivalue", tokenizer, 300, seed=1)
    ids = [tokenizer.bos_token_id] + tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    answer = tokenizer(answer_text(sample.answers), add_special_tokens=False)["input_ids"]
    answer = answer + [tokenizer.eos_token_id]
    vocab = len(tokenizer)
    every = _Predicts(vocab, lambda t: torch.ones_like(t, dtype=torch.bool))
    assert answer_token_accuracy(every, tokenizer, ids, sample, "cpu") == 1.0
    # Right only where the next token is [EOS]: one of the answer's tokens.
    eos_only = _Predicts(vocab, lambda t: t == tokenizer.eos_token_id)
    assert answer_token_accuracy(eos_only, tokenizer, ids, sample, "cpu") == pytest.approx(
        1 / len(answer))
    # Right only on digits: the values' tokens, not the commas, the full stop or [EOS].
    digits = torch.tensor([tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)])
    digit_only = _Predicts(vocab, lambda t: torch.isin(t, digits))
    expected = sum(token in digits.tolist() for token in answer) / len(answer)
    assert 0 < expected < 1
    assert answer_token_accuracy(digit_only, tokenizer, ids, sample, "cpu") == pytest.approx(
        expected)
    every_position = _PredictsEveryPosition(vocab, lambda t: torch.isin(t, digits))
    assert answer_token_accuracy(every_position, tokenizer, ids, sample, "cpu") == (
        pytest.approx(expected))


def test_eval_command_smoke_writes_json_and_plot(tmp_path, capsys):
    from openmsa.cli import main

    assert main(["eval", "--smoke", "--tasks", "niah_single,variable_tracking", "--lengths",
                 "300,512", "--out", str(tmp_path)]) == 0
    written = json.loads((tmp_path / "eval.json").read_text())
    assert written["settings"]["lengths"] == [300, 512]
    assert written["settings"]["msa_options"]["top_k"] == 2
    assert len(written["samples"]) == 2 * 2 * 2
    assert (tmp_path / "accuracy.png").stat().st_size > 0
    assert "variable_tracking" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["eval", "--smoke", "--tasks", "needle"])
    with pytest.raises(SystemExit, match="--model: expected a local Hugging Face model folder"):
        main(["eval", "--model", str(tmp_path / "missing")])
    with pytest.raises(ValueError, match="^samples: expected an int >= 1"):
        main(["eval", "--smoke", "--samples", "0"])


def _without_timings(records):
    return [{key: value for key, value in record.items() if key != "seconds"}
            for record in records]


def test_an_interrupted_eval_resumes_where_it_stopped(tmp_path, monkeypatch):
    """Cut after its third group (a KeyboardInterrupt in the fourth), ``openmsa eval`` has the
    three groups' records in its samples file; ``--resume`` runs only the other groups (a last
    line cut mid-write dropped) and gives what an uncut run gives."""
    from openmsa.cli import main
    from openmsa.eval import run as eval_run

    command = ["eval", "--smoke", "--tasks", "niah_single,variable_tracking", "--lengths",
               "300,512", "--samples", "2"]
    assert main(command + ["--out", str(tmp_path / "whole")]) == 0
    whole = json.loads((tmp_path / "whole" / "eval.json").read_text())["samples"]
    assert len(whole) == 2 * 2 * 2 * 2

    real_batch = eval_run.evaluate_batch
    calls = []

    def counting_batch(*args, **kwargs):
        calls.append(args[2][0].task)
        if limit is not None and len(calls) > limit:
            raise KeyboardInterrupt
        return real_batch(*args, **kwargs)

    monkeypatch.setattr(eval_run, "evaluate_batch", counting_batch)
    limit = 3 * 2  # three groups of one sample, each in two modes
    cut = tmp_path / "cut"
    with pytest.raises(KeyboardInterrupt):
        main(command + ["--out", str(cut)])
    lines = (cut / "samples.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["settings"]["samples"] == 2
    assert len(lines) == 1 + 3 * 2
    with open(cut / "samples.jsonl", "a") as handle:
        handle.write('{"task": "niah_sin')  # a record cut mid-write
    calls.clear()
    limit = None
    assert main(command + ["--out", str(cut), "--resume"]) == 0
    assert len(calls) == (8 - 3) * 2
    resumed = json.loads((cut / "eval.json").read_text())["samples"]
    assert _without_timings(resumed) == _without_timings(whole)
    assert len((cut / "samples.jsonl").read_text().splitlines()) == 1 + 16
    with pytest.raises(SystemExit, match=r"other settings \(samples differ\)"):
        main(command[:-1] + ["3", "--out", str(cut), "--resume"])


def test_finished_records_keep_only_the_groups_they_complete():
    from openmsa.eval.run import EvalSettings, finished_records

    settings = EvalSettings(tasks=("niah_single",), lengths=(300,), samples=4, batch=2)
    records = [dict(task="niah_single", length=300, sample=index, mode=mode)
               for index in range(4) for mode in ("dense", "msa")]
    assert finished_records(settings, records) == records
    # Sample 3's msa record missing: the group of samples 2 and 3 runs again whole.
    assert finished_records(settings, records[:-1]) == records[:4]
    assert finished_records(settings, records[::-1]) == records


def test_lm_batches_label_only_the_answer_and_eos():
    from openmsa.train.batches import BatchSpec, make_batch

    tokenizer = synthetic_tokenizer()
    input_ids, labels = make_batch(tokenizer, BatchSpec("niah_multiquery", 300, 2, seed=5))
    for row in range(2):
        sample = make_sample("niah_multiquery", tokenizer, 300, 5 + row)
        answer = labels[row][labels[row] != -100]
        assert answer[-1] == tokenizer.eos_token_id
        assert answer_recall(tokenizer.decode(answer), sample.answers) == 1.0
        labelled = (labels[row] != -100).nonzero()[:, 0]
        assert torch.equal(input_ids[row, labelled], answer)  # labels sit on their own tokens
        assert input_ids[row, 0] == tokenizer.bos_token_id
    assert (input_ids[labels == -100] != -100).all()


def test_curriculum_phases_train_their_own_tasks():
    """A phase naming tasks trains those in turn at its length and batch; a phase without
    tasks, and the steps after the curriculum, train the preset's; scaling the steps keeps
    each phase's tasks."""
    from dataclasses import replace

    from openmsa.train.lm import LM_PRESETS, LMPreset, curriculum_phases, step_batches

    preset = LMPreset(seqlen=512, block_size=64, top_k=2, steps=12, warmup_steps=0, batch=2,
                      tasks=("niah_single", "variable_tracking", "common_words"),
                      curriculum=((4, 128, 8, ("niah_multikey", "niah_single")), (3, 256, 4)))
    specs = step_batches(preset, seed=0)
    # Step s (from 1) trains task (s - 1) mod the number of its phase's tasks.
    assert [(s.task, s.length, s.size) for s in specs] == (
        [("niah_multikey", 128, 8), ("niah_single", 128, 8)] * 2
        + [("variable_tracking", 256, 4), ("common_words", 256, 4), ("niah_single", 256, 4)]
        + [("variable_tracking", 512, 2), ("common_words", 512, 2), ("niah_single", 512, 2),
           ("variable_tracking", 512, 2), ("common_words", 512, 2)])
    scaled = replace(preset, steps=24, curriculum=tuple((2 * n, *rest)
                                                        for n, *rest in preset.curriculum))
    assert {s.task for s in step_batches(scaled, seed=0)[:8]} == {"niah_multikey",
                                                                  "niah_single"}
    for name, lm_preset in LM_PRESETS.items():
        for _, _, _, tasks in curriculum_phases(lm_preset):
            assert set(tasks) <= set(TASKS), name


def test_lm_batches_from_worker_processes_equal_the_batches_made_in_the_loop():
    """Batches generated ahead by 2 spawned processes arrive in the steps' order, equal to the
    ones the step loop makes itself; the preset's steps follow its curriculum, tasks in turn."""
    from openmsa.train.batches import batch_stream
    from openmsa.train.lm import LM_PRESETS, step_batches

    tokenizer = synthetic_tokenizer()
    preset = LM_PRESETS["ruler-tiny"]
    specs = step_batches(preset, seed=3)
    assert [s.task for s in specs] == [preset.tasks[i % len(preset.tasks)]
                                       for i in range(preset.steps)]
    (first_steps, first_tokens, first_batch), = preset.curriculum[:1]
    assert all((s.length, s.size) == (first_tokens, first_batch) for s in specs[:first_steps])
    assert all((s.length, s.size) == (preset.seqlen, preset.batch) for s in specs[first_steps:])
    assert len({s.seed for s in specs}) == len(specs)
    specs = specs + specs[:3]  # more batches than the workers keep ahead
    inline = list(batch_stream(tokenizer, specs, "cpu", workers=0))
    ahead = list(batch_stream(tokenizer, specs, "cpu", workers=2))
    assert len(ahead) == len(specs)
    for (ids, labels), (ids_ahead, labels_ahead) in zip(inline, ahead):
        assert torch.equal(ids, ids_ahead) and torch.equal(labels, labels_ahead)
    assert not torch.equal(inline[0][0], inline[1][0])
    with pytest.raises(ValueError, match="^workers: expected 0 or more"):
        next(batch_stream(tokenizer, specs, "cpu", workers=-1))


def test_ruler_preset_checkpoints_load_into_eval_with_their_index_weights(tmp_path):
    """openmsa train --preset ruler-tiny writes a dense and an MSA checkpoint; eval's loader
    converts the MSA one with its own options and restores its trained index projections
    (not the averages a fresh conversion starts from); mismatched options are refused."""
    from safetensors.torch import load_file

    from openmsa.cli import main
    from openmsa.eval.run import checkpoint_msa_options, load_model

    assert main(["train", "--preset", "ruler-tiny", "--out", str(tmp_path)]) == 0
    options = checkpoint_msa_options(str(tmp_path / "msa"))
    assert options["top_k"] == 2 and options["block_size"] == 64
    assert checkpoint_msa_options(str(tmp_path / "dense")) == {}
    model, tokenizer = load_model(str(tmp_path / "msa"), "cpu", torch.float32, options)
    saved = load_file(str(tmp_path / "msa" / "model.safetensors"))
    loaded = model.state_dict()
    index_keys = [key for key in saved if ".index_" in key]
    assert index_keys and all(torch.equal(loaded[key], saved[key]) for key in index_keys)
    assert all(torch.equal(loaded[key], saved[key]) for key in saved)
    with pytest.raises(ValueError, match="^model: the checkpoint .* has index weights"):
        load_model(str(tmp_path / "msa"), "cpu", torch.float32,
                   dict(options, share_index_every=2))
    history = json.loads((tmp_path / "history.json").read_text())
    assert [h["phase"] for h in history["history"]["msa"]] == ["warmup"] * 2 + ["sparse"] * 2
    assert [h["tokens"] for h in history["history"]["msa"]] == [256, 256, 320, 320]


def test_adapting_a_dense_checkpoint_trains_only_its_index_branch(tmp_path):
    """--adapt-index: the dense checkpoint's weights stay as they were, the index projections
    move away from a fresh conversion's averages, and eval loads the result with them."""
    from safetensors.torch import load_file

    from openmsa.cli import main
    from openmsa.eval.run import checkpoint_msa_options, load_model

    assert main(["train", "--preset", "ruler-tiny", "--out", str(tmp_path)]) == 0
    assert main(["train", "--preset", "ruler-tiny", "--adapt-index", str(tmp_path / "dense"),
                 "--steps", "3", "--out", str(tmp_path)]) == 0
    dense = load_file(str(tmp_path / "dense" / "model.safetensors"))
    adapted = load_file(str(tmp_path / "adapted" / "model.safetensors"))
    assert all(torch.equal(adapted[key], value) for key, value in dense.items())
    fresh, _ = load_model(str(tmp_path / "dense"), "cpu", torch.float32,
                          dict(top_k=2, block_size=64, backend="reference"))
    fresh_state = fresh.state_dict()
    index_keys = [key for key in adapted if ".index_" in key and key.endswith("proj.weight")]
    assert index_keys and all(not torch.equal(adapted[key], fresh_state[key])
                              for key in index_keys)
    model, _ = load_model(str(tmp_path / "adapted"), "cpu", torch.float32,
                          checkpoint_msa_options(str(tmp_path / "adapted")))
    assert all(torch.equal(model.state_dict()[key], adapted[key]) for key in index_keys)
    with pytest.raises(SystemExit, match="--adapt-index needs a ruler"):
        main(["train", "--preset", "tiny", "--adapt-index", str(tmp_path / "dense")])


def test_equal_length_prompts_insert_filler_after_bos_and_move_the_needles(tokenizer):
    short, long = (encode_prompt(tokenizer, make_sample("niah_multikey", tokenizer, n, seed=n))
                   for n in (300, 340))
    (padded_short, padded_long), inserted = equal_length_prompts(tokenizer, [short, long])
    count = len(long[0]) - len(short[0])
    assert inserted == [count, 0] and count > 0 and padded_long == long
    ids, needles = padded_short
    assert len(ids) == len(long[0]) and ids[0] == tokenizer.bos_token_id
    assert ids[1 + count:] == short[0][1:]
    assert [list(r) for r in needles] == [[i + count for i in r] for r in short[1]]
    for before, after in zip(short[1], needles):  # the same tokens at the moved positions
        assert [short[0][i] for i in before] == [ids[i] for i in after]


def test_a_batch_gives_each_row_what_the_row_gives_alone(tokenizer):
    """Two prompts of different lengths, made equal, generated as one batch in MSA attention
    (2 of the blocks kept: the rows' recalls differ): each row's continuation, answer-token
    accuracy and recalls are the row's alone."""
    model, tokenizer = smoke_model(dict(top_k=2, block_size=64, backend="reference"))
    samples = [make_sample("niah_multivalue", tokenizer, n, seed=n) for n in (400, 460)]
    prompts, inserted = equal_length_prompts(
        tokenizer, [encode_prompt(tokenizer, sample) for sample in samples])
    assert inserted[0] > 0
    together = evaluate_batch(model, tokenizer, samples, "msa", "cpu", prompts)
    alone = [evaluate_sample(model, tokenizer, sample, "msa", "cpu", prompt)
             for sample, prompt in zip(samples, prompts)]
    assert together[0]["block_recall"] != together[1]["block_recall"]
    for row, single in zip(together, alone):
        assert row["continuation"] == single["continuation"]
        for key in ("token_accuracy", "block_recall", "mass_recall"):
            assert row[key] == pytest.approx(single[key], abs=1e-5)
    with pytest.raises(ValueError, match="prompts: expected equally long prompts"):
        evaluate_batch(model, tokenizer, samples, "msa", "cpu",
                       [encode_prompt(tokenizer, sample) for sample in samples])


def test_evaluate_in_batches_equals_one_sample_at_a_time(tokenizer):
    model, tokenizer = smoke_model(dict(top_k=2, block_size=64, backend="reference"))
    settings = EvalSettings(tasks=("niah_single", "variable_tracking"), lengths=(300,),
                            samples=3)
    alone = evaluate(model, tokenizer, settings, "cpu")
    together = evaluate(model, tokenizer, dataclasses.replace(settings, batch=2), "cpu")
    assert len(together) == len(alone) == 12
    for a, b in zip(alone, together):
        assert (a["task"], a["sample"], a["mode"]) == (b["task"], b["sample"], b["mode"])
        assert a["continuation"] == b["continuation"] and b["inserted_tokens"] == 0
        assert a["token_accuracy"] == pytest.approx(b["token_accuracy"], abs=1e-5)
    with pytest.raises(ValueError, match="batch: expected an int >= 1"):
        evaluate(model, tokenizer, dataclasses.replace(settings, batch=0), "cpu")
