"""A synthetic long-context retrieval task.

A sequence holds ``num_pairs`` key-value facts scattered through filler tokens; its last token
asks for one key, and the model must answer that key's value. Each fact is one token (its key
and value are embedded as a sum), so one attention layer can solve the task by attending from
the question to the matching fact; the facts sit in different key blocks, so a sparse model
only answers right when its index branch keeps the block of the asked fact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RetrievalTask:
    seqlen: int = 512
    num_keys: int = 32
    num_values: int = 32
    num_fillers: int = 16
    num_pairs: int = 8

    @property
    def vocab_keys(self) -> int:
        """Embedding rows for the key part: every key, plus 'no key' (fillers)."""
        return self.num_keys + 1

    @property
    def vocab_values(self) -> int:
        """Embedding rows for the value part: every value, every filler, and 'question'."""
        return self.num_values + self.num_fillers + 1

    def sample(self, batch: int, generator: torch.Generator):
        """Returns (key_ids, value_ids) ``[batch, seqlen]`` int64, the answers ``[batch]``
        (a value id) and the positions of the asked facts ``[batch]``."""
        no_key = self.num_keys
        question = self.num_values + self.num_fillers
        keys = torch.full((batch, self.seqlen), no_key, dtype=torch.int64)
        values = self.num_values + torch.randint(self.num_fillers, (batch, self.seqlen),
                                                 generator=generator)
        answers = torch.empty(batch, dtype=torch.int64)
        fact_positions = torch.empty(batch, dtype=torch.int64)
        for row in range(batch):
            positions = torch.randperm(self.seqlen - 1, generator=generator)[:self.num_pairs]
            fact_keys = torch.randperm(self.num_keys, generator=generator)[:self.num_pairs]
            fact_values = torch.randint(self.num_values, (self.num_pairs,), generator=generator)
            keys[row, positions] = fact_keys
            values[row, positions] = fact_values
            asked = int(torch.randint(self.num_pairs, (1,), generator=generator))
            keys[row, -1] = fact_keys[asked]
            values[row, -1] = question
            answers[row] = fact_values[asked]
            fact_positions[row] = positions[asked]
        return (keys, values), answers, fact_positions
