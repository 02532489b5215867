"""The LM presets' training batches (``openmsa train --preset ruler-*``): RULER-style prompts
with their answers, generated ahead of the step loop in worker processes.

A 16k-token batch of 4 takes the host about 20 ms (50 for common_words) on one core: the prompts
come with their ids, built from encoded pieces (``openmsa.eval.tasks``); tokenized whole they
took 170-280 ms, up to nine times the ``ruler-gpu`` model's GPU step
(benchmarks/records/batch-generation-cpu.json, lm-step.json). The workers keep even slower
tokenizers off the step loop.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import multiprocessing
import os
from dataclasses import dataclass

import torch

from ..eval.tasks import answer_text, make_sample


@dataclass(frozen=True)
class BatchSpec:
    """What one step trains on: ``size`` samples of ``task`` of about ``length`` tokens,
    sample i from seed ``seed + i``."""
    task: str
    length: int
    size: int
    seed: int


def make_batch(tokenizer, spec: BatchSpec, device="cpu"):
    """input_ids and labels ``[size, L]``: prompt, answer, [EOS], right-padded; labels only on
    the answer and [EOS] (-100 elsewhere)."""
    samples = [make_sample(spec.task, tokenizer, spec.length, spec.seed + index)
               for index in range(spec.size)]
    answers = tokenizer([answer_text(sample.answers) for sample in samples],
                        add_special_tokens=False)["input_ids"]
    rows, labels = [], []
    for sample, answer in zip(samples, answers):
        ids = sample.prompt_ids
        if ids is None:
            ids = tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
        prompt = [tokenizer.bos_token_id, *ids]
        answer = answer + [tokenizer.eos_token_id]
        rows.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    # Right padding needs no mask: causal attention never lets a real token see a pad.
    input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=device)
    label_ids = torch.tensor([r + [-100] * (width - len(r)) for r in labels], device=device)
    return input_ids, label_ids


def default_workers(device: torch.device) -> int:
    """Worker processes for a run on ``device``: none on a CPU (the model's compute needs the
    cores), else half the host's cores, at most 8."""
    return 0 if device.type == "cpu" else max(1, min(8, (os.cpu_count() or 2) // 2))


_WORKER_TOKENIZER = None


def _set_worker_tokenizer(tokenizer) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = tokenizer


def _worker_batch(spec: BatchSpec):
    return make_batch(_WORKER_TOKENIZER, spec)


def batch_stream(tokenizer, specs, device, workers: int | None = None):
    """The batches of ``specs`` in order, on ``device``: made in the caller when ``workers``
    is 0, else by ``workers`` spawned processes (None: ``default_workers``), up to twice as
    many ahead of the caller. Each batch depends on its spec alone, so both give the same
    tensors."""
    device = torch.device(device)
    workers = default_workers(device) if workers is None else workers
    if workers < 0:
        raise ValueError(f"workers: expected 0 or more, received {workers}")
    if workers == 0:
        for spec in specs:
            yield make_batch(tokenizer, spec, device)
        return
    context = multiprocessing.get_context("spawn")  # no fork of a process that holds CUDA
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context,
                                                initializer=_set_worker_tokenizer,
                                                initargs=(tokenizer,)) as pool:
        specs = iter(specs)
        pending = collections.deque(pool.submit(_worker_batch, spec)
                                    for spec in itertools.islice(specs, 2 * workers))
        while pending:
            input_ids, labels = pending.popleft().result()
            spec = next(specs, None)
            if spec is not None:
                pending.append(pool.submit(_worker_batch, spec))
            yield input_ids.to(device), labels.to(device)
