"""``openmsa eval``: RULER-style tasks (``tasks``) on one model in dense and in MSA attention,
with the same weights, at chosen lengths.

The model is a Hugging Face causal LM converted with ``convert_to_msa`` (a local checkpoint
folder, or the smoke setting's tiny random Llama). "dense" runs every converted layer in
warmup (dense causal attention), "msa" sparse. Answers are generated greedily through the
cache path (``generate(use_cache=True)``: the prompt's prefill, then ``msa_decode`` steps), and
a sample scores the share of its expected answers found in the continuation. A second, graded
score: the *answer-token accuracy*, teacher-forced (the prompt and the answer as the LM presets
train it, ``tasks.answer_text`` and [EOS], in one forward; the share of the answer's tokens that
are the greedy prediction from the tokens before them): it counts the digits of a value half
right, where the exact answer scores nothing. In MSA attention the prefill also records, per
layer, the last prompt token's kept blocks:

- *block recall*: the share of (needle, layer, index head) whose kept blocks hold a token of
  the needle (tasks with needles);
- *mass recall*: the share of the dense attention mass of that token (its queries against
  every prompt key, averaged over each index head's main heads) that the kept blocks hold.
"""

from __future__ import annotations

import inspect
import json
import os
import time
from dataclasses import dataclass

import torch

from ..integrations.transformers import convert_to_msa, record_selection
from ..layers.msa_attention import set_msa_warmup
from .tasks import (FILLER, TASKS, Sample, answer_recall, answer_text, make_sample,
                    synthetic_tokenizer)

MODES = ("dense", "msa")


@dataclass(frozen=True)
class EvalSettings:
    tasks: tuple[str, ...] = TASKS
    lengths: tuple[int, ...] = (4096, 8192, 16384)
    samples: int = 8
    seed: int = 0
    modes: tuple[str, ...] = MODES
    # Samples of one task and length generated together (a shorter prompt gets a few filler
    # tokens after [BOS]: ``equal_length_prompts``); 1: each alone, as written.
    batch: int = 1


def smoke_model(msa_options: dict | None = None, seed: int = 0):
    """A tiny random Llama (2 layers, 4 heads of 64, 2 KV heads) on ``synthetic_tokenizer()``,
    converted to MSA with ``msa_options`` (default: top 2 blocks of 64): the CPU smoke setting
    (its answers are noise; the pipeline is real)."""
    import transformers

    tokenizer = synthetic_tokenizer()
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, vocab_size=len(tokenizer),
        max_position_embeddings=65536, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = transformers.LlamaForCausalLM(config).eval()
    convert_to_msa(model, **(msa_options or dict(top_k=2, block_size=64)))
    return model, tokenizer


def checkpoint_msa_options(path: str) -> dict:
    """The MSA options an ``openmsa train`` checkpoint was trained with ({} for a dense or a
    foreign checkpoint)."""
    described = os.path.join(path, "openmsa.json")
    if not os.path.exists(described):
        return {}
    with open(described) as handle:
        return json.load(handle).get("msa_options") or {}


def load_model(path: str, device, dtype, msa_options: dict):
    """A local Hugging Face causal LM folder and its tokenizer, converted with
    ``msa_options`` (``convert_to_msa``'s keyword arguments). An ``openmsa train`` MSA
    checkpoint's index projections are loaded after the conversion (the plain model drops
    them when it loads)."""
    import transformers
    from safetensors.torch import load_file

    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    convert_to_msa(model, **msa_options)
    if checkpoint_msa_options(path):
        state = {}
        for name in sorted(os.listdir(path)):
            if name.endswith(".safetensors"):
                state.update(load_file(os.path.join(path, name)))
        index_state = {key: value for key, value in state.items() if ".index_" in key}
        missing = [key for key in model.state_dict() if ".index_" in key
                   and key not in index_state]
        if missing:
            raise ValueError(f"model: the checkpoint {path} lacks the index weights {missing[:3]}"
                             f" (its MSA options differ from the conversion's?)")
        unexpected = model.load_state_dict(index_state, strict=False).unexpected_keys
        if unexpected:
            raise ValueError(f"model: the checkpoint {path} has index weights the conversion "
                             f"does not make: {unexpected[:3]}")
    return model.to(device=device, dtype=dtype), tokenizer


def selection_recalls(records: list[dict], needle_tokens: list[range], row: int = 0) -> dict:
    """Block and mass recall of the last prompt token of batch row ``row`` from the layers'
    ``record_selection`` records; block recall is None without needles."""
    hits, masses = [], []
    for record in records:
        if not record:
            continue
        ids = record["ids"][row].long()  # [Hi, k]
        block = record["block_size"]
        for tokens in needle_tokens:
            needle_blocks = torch.tensor(sorted({t // block for t in tokens}))
            hits.append((ids[:, :, None] == needle_blocks.to(ids.device)).any(-1).any(-1))
        query = record["query"][row].float()  # [H, D]
        keys = record["keys"][row].float()  # [L, Hkv, D]
        heads, kv_heads = query.shape[0], keys.shape[1]
        index_heads = ids.shape[0]
        kv_of_head = torch.arange(heads, device=query.device) // (heads // kv_heads)
        probs = torch.softmax(torch.einsum("hd,lhd->hl", query, keys[:, kv_of_head])
                              * record["scale"], dim=-1)  # [H, L]
        blocks = -(-keys.shape[0] // block)
        per_block = torch.nn.functional.pad(probs, (0, blocks * block - keys.shape[0]))
        per_block = per_block.view(heads, blocks, block).sum(-1)  # [H, blocks]
        kept = torch.zeros(index_heads, blocks, dtype=torch.bool, device=ids.device)
        valid = ids >= 0
        kept[torch.arange(index_heads, device=ids.device)[:, None].expand_as(ids)[valid],
             ids[valid]] = True
        index_of_head = torch.arange(heads, device=query.device) // (heads // index_heads)
        masses.append((per_block * kept[index_of_head]).sum(-1).mean())
    return {"block_recall": torch.cat(hits).float().mean().item() if hits else None,
            "mass_recall": torch.stack(masses).mean().item() if masses else None}


def _needle_tokens(tokenizer, sample: Sample, offsets) -> list[range]:
    """Token positions of each needle (from the prompt's character offsets)."""
    spans = []
    for start, end in sample.needle_spans:
        inside = [i for i, (a, b) in enumerate(offsets) if a < end and b > start]
        spans.append(range(inside[0], inside[-1] + 1))
    return spans


def encode_prompt(tokenizer, sample: Sample) -> tuple[list[int], list[range]]:
    """The prompt's ids ([BOS] first where the tokenizer has one) and each needle's token
    positions among them (none without a fast tokenizer: needles are located by character
    offsets, which only fast tokenizers give)."""
    encoded = tokenizer(sample.prompt, add_special_tokens=False,
                        return_offsets_mapping=tokenizer.is_fast)
    ids, offset = encoded["input_ids"], 0
    if tokenizer.bos_token_id is not None:
        ids, offset = [tokenizer.bos_token_id] + ids, 1
    needles = [] if not tokenizer.is_fast else [
        range(r.start + offset, r.stop + offset)
        for r in _needle_tokens(tokenizer, sample, encoded["offset_mapping"])]
    return ids, needles


@torch.no_grad()
def answer_token_accuracy(model, tokenizer, ids: list[int], sample: Sample, device) -> float:
    """Teacher-forced: the share of the answer's tokens (``answer_text`` and [EOS]) that are
    the model's greedy prediction after ``ids`` (the prompt) and the answer's tokens before
    them, in whichever attention the model's layers are set to."""
    return answer_token_accuracies(model, tokenizer, [ids], [sample], device)[0]


def _answer_ids(tokenizer, sample: Sample) -> list[int]:
    answer = tokenizer(answer_text(sample.answers), add_special_tokens=False)["input_ids"]
    return answer + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])


@torch.no_grad()
def answer_token_accuracies(model, tokenizer, prompts: list[list[int]], samples, device):
    """``answer_token_accuracy`` of each (prompt ids, sample): one forward for all where the
    prompts and the answers are equally long, else one each."""
    answers = [_answer_ids(tokenizer, sample) for sample in samples]
    if len({len(ids) for ids in prompts}) > 1 or len({len(a) for a in answers}) > 1:
        return [answer_token_accuracies(model, tokenizer, [ids], [sample], device)[0]
                for ids, sample in zip(prompts, samples)]
    full = torch.tensor([ids + answer for ids, answer in zip(prompts, answers)], device=device)
    keep = len(answers[0]) + 1
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        # Only the logits that predict the answer: a large vocabulary's logits over a long
        # prompt would not fit.
        logits = model(input_ids=full, use_cache=False, logits_to_keep=keep).logits
    else:  # a model (or an older transformers) without the argument: every position's
        logits = model(input_ids=full, use_cache=False).logits[:, -keep:]
    predicted = logits[:, :-1].argmax(-1)
    expected = torch.tensor(answers, device=predicted.device)
    return (predicted == expected).float().mean(-1).tolist()


def equal_length_prompts(tokenizer, prompts: list[tuple]) -> tuple[list[tuple], list[int]]:
    """``encode_prompt`` results made as long as the longest: a shorter prompt gets filler
    tokens (a haystack sentence's, repeated) after its [BOS] (or at its start), its needles'
    positions moving along; returns the prompts and each one's count of inserted tokens. The
    layers take no padding mask, so a batch of prompts must be equally long."""
    longest = max(len(ids) for ids, _ in prompts)
    filler = tokenizer(" ".join(FILLER), add_special_tokens=False)["input_ids"]
    at = 1 if tokenizer.bos_token_id is not None else 0
    padded, inserted = [], []
    for ids, needles in prompts:
        count = longest - len(ids)
        extra = (filler * (count // len(filler) + 1))[:count]
        padded.append((ids[:at] + extra + ids[at:],
                       [range(r.start + count, r.stop + count) for r in needles]))
        inserted.append(count)
    return padded, inserted


@torch.no_grad()
def evaluate_batch(model, tokenizer, samples: list[Sample], mode: str, device,
                   prompts: list[tuple] | None = None) -> list[dict]:
    """Generates the answers of ``samples`` in ``mode`` ("dense" or "msa") as one batch;
    returns per sample its score, its answer-token accuracy, the continuation and (msa) the
    recalls. ``prompts``: ``encode_prompt``'s results, when the caller has them (the same
    samples evaluated in both modes), equally long (``equal_length_prompts``)."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, received {mode!r}")
    prompts = prompts or [encode_prompt(tokenizer, sample) for sample in samples]
    lengths = sorted({len(ids) for ids, _ in prompts})
    if len(lengths) > 1:
        raise ValueError(f"prompts: expected equally long prompts for one batch (the layers "
                         f"take no padding mask), received lengths {lengths}; see "
                         f"equal_length_prompts")
    input_ids = torch.tensor([ids for ids, _ in prompts], device=device)
    set_msa_warmup(model, mode == "dense")
    records = record_selection(model)
    start = time.perf_counter()
    output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                            max_new_tokens=max(s.max_new_tokens for s in samples),
                            do_sample=False, use_cache=True,
                            pad_token_id=tokenizer.pad_token_id)
    seconds = time.perf_counter() - start
    results = []
    for row, (sample, (ids, needles)) in enumerate(zip(samples, prompts)):
        # A sample's own budget: greedy decoding gives each row what it gives the row alone.
        new = output[row, len(ids):len(ids) + sample.max_new_tokens]
        continuation = tokenizer.decode(new, skip_special_tokens=True)
        result = {"task": sample.task, "mode": mode, "prompt_tokens": len(ids),
                  "score": answer_recall(continuation, sample.answers),
                  "answers": sample.answers, "continuation": continuation,
                  "seconds": seconds / len(samples)}
        if mode == "msa":
            result.update(selection_recalls(records, needles, row))
        results.append(result)
    for record in records:
        record.clear()
    accuracies = answer_token_accuracies(model, tokenizer, [ids for ids, _ in prompts],
                                         samples, device)
    for result, accuracy in zip(results, accuracies):
        result["token_accuracy"] = accuracy
    return results


def evaluate_sample(model, tokenizer, sample: Sample, mode: str, device, prompt=None) -> dict:
    """``evaluate_batch`` of one sample (``prompt``: its ``encode_prompt`` result, when the
    caller has it)."""
    return evaluate_batch(model, tokenizer, [sample], mode, device,
                          None if prompt is None else [prompt])[0]


def sample_groups(settings: EvalSettings) -> list[tuple[str, int, list[int]]]:
    """(task, length, sample indices) of each group of samples ``evaluate`` runs together, in
    its order."""
    return [(task, length, list(range(first, min(first + settings.batch, settings.samples))))
            for length in settings.lengths for task in settings.tasks
            for first in range(0, settings.samples, settings.batch)]


def _by_key(records) -> dict:
    return {(r["task"], r["length"], r["sample"], r["mode"]): r for r in records}


def _group_records(known: dict, task: str, length: int, indices: list[int], modes):
    """The records of one group of samples in ``known`` (``_by_key``), in ``evaluate``'s
    order, or None unless every one of them is there."""
    keys = [(task, length, index, mode) for index in indices for mode in modes]
    return [known[key] for key in keys] if all(key in known for key in keys) else None


def finished_records(settings: EvalSettings, earlier: list[dict]) -> list[dict]:
    """The records of ``earlier`` (an interrupted run's) in the groups of ``settings`` that
    they complete, in ``evaluate``'s order; any others are dropped (their groups run again)."""
    known = _by_key(earlier)
    finished = []
    for task, length, indices in sample_groups(settings):
        finished.extend(_group_records(known, task, length, indices, settings.modes) or ())
    return finished


def evaluate(model, tokenizer, settings: EvalSettings, device, progress=None,
             earlier: list[dict] | None = None, on_group=None) -> list[dict]:
    """Every (task, length, sample, mode) of ``settings``, ``settings.batch`` samples of a task
    and length at a time (made equally long by ``equal_length_prompts``);
    ``progress(done, total, record)`` after each. ``earlier``: records of an interrupted run
    of the same settings; a group of samples all of whose records are there is taken from
    them, not run again (a group only partly there runs again whole). ``on_group(records)``:
    after each group that ran, with its new records (``openmsa eval`` appends them to its
    samples file)."""
    for task in settings.tasks:
        if task not in TASKS:
            raise ValueError(f"tasks: expected names from {TASKS}, received {task!r}")
    if not isinstance(settings.batch, int) or settings.batch < 1:
        raise ValueError(f"batch: expected an int >= 1, received {settings.batch!r}")
    total = len(settings.lengths) * len(settings.tasks) * settings.samples * len(settings.modes)
    known = _by_key(earlier or ())
    results = []
    for task, length, indices in sample_groups(settings):
        done = _group_records(known, task, length, indices, settings.modes)
        if done is not None:
            results.extend(done)
            continue
        samples = [make_sample(task, tokenizer, length, settings.seed * 100_003 + index)
                   for index in indices]
        # Encoded once for both modes.
        prompts, inserted = equal_length_prompts(
            tokenizer, [encode_prompt(tokenizer, sample) for sample in samples])
        by_mode = [evaluate_batch(model, tokenizer, samples, mode, device, prompts)
                   for mode in settings.modes]
        new = []
        for position, index in enumerate(indices):
            for mode_results in by_mode:
                new.append(dict(mode_results[position], length=length, sample=index,
                                inserted_tokens=inserted[position]))
                results.append(new[-1])
                if progress:
                    progress(len(results), total, results[-1])
        if on_group:
            on_group(new)
    return results


def summarize(results: list[dict]) -> list[dict]:
    """Mean score, answer-token accuracy (and recalls) per (task, length, mode), then per
    (length, mode) over tasks (task "average")."""
    groups: dict = {}
    for result in results:
        groups.setdefault((result["task"], result["length"], result["mode"]), []).append(result)
    rows = []
    for (task, length, mode), members in groups.items():
        row = {"task": task, "length": length, "mode": mode, "samples": len(members),
               "accuracy": sum(m["score"] for m in members) / len(members),
               "token_accuracy": sum(m["token_accuracy"] for m in members) / len(members)}
        for key in ("block_recall", "mass_recall"):
            values = [m[key] for m in members if m.get(key) is not None]
            row[key] = sum(values) / len(values) if values else None
        rows.append(row)
    for length, mode in sorted({(r["length"], r["mode"]) for r in rows}):
        members = [r for r in rows if (r["length"], r["mode"]) == (length, mode)]
        rows.append({"task": "average", "length": length, "mode": mode,
                     "samples": sum(r["samples"] for r in members),
                     "accuracy": sum(r["accuracy"] for r in members) / len(members),
                     "token_accuracy": sum(r["token_accuracy"] for r in members) / len(members),
                     "block_recall": None, "mass_recall": None})
    return rows
