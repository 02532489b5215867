"""RULER-style synthetic long-context tasks, generated as text for any tokenizer.

Each task builds a prompt of about ``length`` tokens of the given tokenizer: filler sentences
with facts ("needles") inserted at random depths, then a question; the expected answers are
strings the model must generate. Six tasks, after RULER's categories:

- ``niah_single``: one needle (a key and a 7-digit value), asked back.
- ``niah_multikey``: four needles with different keys; one is asked.
- ``niah_multivalue``: four values of one key; all four are asked.
- ``niah_multiquery``: four needles; two keys are asked at once.
- ``variable_tracking``: a chain ``VAR a = 12345``, ``VAR b = VAR a``, ... among the filler;
  every variable holding the number is asked.
- ``common_words``: a numbered list of words where ten appear far more often than the others;
  the ten are asked (aggregation over the whole context: no needles).

``synthetic_tokenizer()`` is a word-level tokenizer whose vocabulary holds exactly the words
these tasks use (digits one token each): small models trained by openmsa read the same tasks
as text, so one evaluation serves them and any Hugging Face model.

Prompts are built from pieces joined by spaces. A word-level tokenizer behind a whitespace split
(``synthetic_tokenizer``) encodes such a text as its pieces' encodings joined, so for it the
pieces are encoded once per process and the sample carries the prompt's ids
(``Sample.prompt_ids``): a 16k-token training batch is then made without tokenizing its
prompts (docs/EVAL.md, "Making the batches"). Other tokenizers count and encode whole texts.
"""

from __future__ import annotations

import json
import random
import re
import weakref
from dataclasses import dataclass, field

FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
          "There and back again.")
KEYS = ("apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "eagle", "forest",
        "candle", "silver", "harbor", "meadow", "rocket", "violet", "copper", "island",
        "marble", "falcon", "garden", "winter", "summer", "autumn", "spring", "planet",
        "desert", "valley", "castle", "dragon", "feather", "lantern", "mirror", "ocean",
        "pepper", "shadow", "thunder", "velvet", "willow", "zebra", "anchor", "bridge",
        "cactus", "dolphin", "ember", "glacier", "hammer", "jungle", "kettle", "ladder",
        "magnet", "needle", "orchid", "parrot", "quartz", "saddle", "tunnel", "walnut",
        "yogurt", "basket", "cobalt", "donkey", "engine", "fossil", "goblet")
TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery",
         "variable_tracking", "common_words")
_NEEDLE = "One of the special magic numbers for {key} is: {value}."
_HEADER = ("Some special magic numbers are hidden within the following text. Make sure to "
           "memorize them. I will quiz you about the numbers afterwards.")
_VARIABLES = ("Memorize and track the chain of variable assignments hidden in the following "
              "text.")
_WORDS = "Below is a numbered list of words. Memorize the ones that appear most often."


@dataclass(frozen=True)
class Sample:
    """A prompt, the answers its continuation must contain, the needles' character spans in
    the prompt (empty for aggregation) and a generation budget; the prompt's token ids
    (without [BOS]) when the tokenizer encodes pieces apart (the module docstring), else
    None."""
    task: str
    prompt: str
    answers: tuple[str, ...]
    needle_spans: tuple[tuple[int, int], ...] = field(default=())
    max_new_tokens: int = 32
    prompt_ids: tuple[int, ...] | None = field(default=None, repr=False)


def _value(rng: random.Random) -> str:
    return str(rng.randrange(1_000_000, 10_000_000))


# tokenizer -> {piece: ids} for tokenizers that encode space-joined pieces apart, else None.
_PIECE_IDS = weakref.WeakKeyDictionary()


def splits_at_whitespace(tokenizer) -> bool:
    """Whether ``tokenizer`` encodes ``" ".join(pieces)`` as its pieces' encodings joined: a
    fast tokenizer with a word-level model behind a whitespace split and at most a lower-case
    normalizer, so no token can span a space."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    spec = json.loads(backend.to_str())
    split = spec.get("pre_tokenizer") or {}
    if split.get("type") == "Sequence":
        split = (split.get("pretokenizers") or [{}])[0]
    normalizer = spec.get("normalizer")
    return ((spec.get("model") or {}).get("type") == "WordLevel"
            and split.get("type") in ("WhitespaceSplit", "Whitespace")
            and (normalizer is None or normalizer.get("type") == "Lowercase"))


def _piece_cache(tokenizer) -> dict | None:
    if tokenizer not in _PIECE_IDS:
        _PIECE_IDS[tokenizer] = {} if splits_at_whitespace(tokenizer) else None
    return _PIECE_IDS[tokenizer]


def _encode_pieces(tokenizer, pieces: list[str], own: dict | None = None) -> list[int] | None:
    """The ids of ``" ".join(pieces)`` from the pieces' ids: ``own`` (``_own_pieces``), else
    cached (new pieces encoded in one batch and kept), or None for a tokenizer that does not
    split at whitespace."""
    cache = _piece_cache(tokenizer)
    if cache is None:
        return None
    own = own or {}
    new = list(dict.fromkeys(piece for piece in pieces if piece not in cache and piece not in own))
    if new:
        cache.update(zip(new, tokenizer(new, add_special_tokens=False)["input_ids"]))
    return [token for piece in pieces for token in (own[piece] if piece in own else cache[piece])]


def _own_pieces(tokenizer, pieces: list[str]) -> dict:
    """A sample's own pieces (its needles and question) encoded in one batch, for its prompt
    alone: the cache keeps only pieces that recur, so it stays small over a training run."""
    if _piece_cache(tokenizer) is None:
        return {}
    return dict(zip(pieces, tokenizer(pieces, add_special_tokens=False)["input_ids"]))


def _count(tokenizer, pieces: list[str], own: dict | None = None) -> int:
    """Tokens of ``" ".join(pieces)`` (``own``: as for ``_encode_pieces``)."""
    ids = _encode_pieces(tokenizer, pieces, own)
    if ids is None:
        ids = tokenizer(" ".join(pieces), add_special_tokens=False)["input_ids"]
    return len(ids)


def _haystack(tokenizer, header: str, needles: list[str], question: str, length: int,
              rng: random.Random):
    """The header, filler sentences up to about ``length`` tokens with ``needles`` at random
    depths among them, then the question; the needles' character spans; the prompt's ids
    (``_encode_pieces``). Pieces are counted apart, which a tokenizer merging across them can
    exceed: the filler shrinks until the whole prompt fits."""
    own = _own_pieces(tokenizer, [*needles, question])
    budget = length - _count(tokenizer, [header, *needles, question], own)
    state = rng.getstate()
    while True:
        rng.setstate(state)
        pieces, spans = _fill(tokenizer, header, needles, question, budget, rng)
        ids = _encode_pieces(tokenizer, pieces, own)
        over = (len(ids) if ids is not None else _count(tokenizer, pieces)) - length
        if over <= 0:
            return " ".join(pieces), spans, ids
        budget -= over


def _fill(tokenizer, header, needles, question, budget, rng):
    """The prompt's pieces (header, filler with the needles among it, question) and the
    needles' character spans in their space-joined text."""
    per_sentence = [_count(tokenizer, [sentence]) for sentence in FILLER]
    fillers = []
    while budget > 0:
        index = len(fillers) % len(FILLER)
        budget -= per_sentence[index]
        if budget >= 0:
            fillers.append(FILLER[index])
    slots = sorted(rng.randrange(len(fillers) + 1) for _ in needles)
    pieces = [header]
    order = list(needles)
    for position, sentence in enumerate(fillers + [None]):
        while slots and slots[0] == position:
            slots.pop(0)
            pieces.append(order.pop(0))
        if sentence is not None:
            pieces.append(sentence)
    spans, end = [], -1
    for piece in pieces:
        end += 1 + len(piece)  # a space before every piece but the first
        if piece in needles:
            spans.append((end - len(piece), end))
    return pieces + [question], tuple(spans)


def _niah(task: str, tokenizer, length: int, rng: random.Random) -> Sample:
    keys = rng.sample(KEYS, 4)
    if task == "niah_single":
        facts = [(keys[0], _value(rng))]
        asked = [0]
    elif task == "niah_multivalue":
        facts = [(keys[0], _value(rng)) for _ in range(4)]
        asked = [0, 1, 2, 3]
    else:
        facts = [(key, _value(rng)) for key in keys]
        asked = sorted(rng.sample(range(4), 1 if task == "niah_multikey" else 2))
    needles = [_NEEDLE.format(key=key, value=value) for key, value in facts]
    asked_keys = sorted({facts[i][0] for i in asked}, key=[k for k, _ in facts].index)
    if task == "niah_single" or task == "niah_multikey":
        question = (f"What is the special magic number for {asked_keys[0]} mentioned in the "
                    f"provided text? The special magic number for {asked_keys[0]} mentioned "
                    f"in the provided text is:")
    else:
        joined = " and ".join(asked_keys)
        question = (f"What are all the special magic numbers for {joined} mentioned in the "
                    f"provided text? The special magic numbers for {joined} mentioned in the "
                    f"provided text are:")
    prompt, spans, ids = _haystack(tokenizer, _HEADER, needles, question, length, rng)
    answers = tuple(facts[i][1] for i in asked)
    return Sample(task, prompt, answers, spans, max_new_tokens=12 * len(answers) + 4,
                  prompt_ids=_ids(ids))


def _ids(ids: list[int] | None) -> tuple[int, ...] | None:
    return None if ids is None else tuple(ids)


def _variable_tracking(tokenizer, length: int, rng: random.Random) -> Sample:
    names = [name.upper() for name in rng.sample(KEYS, 5)]
    number = str(rng.randrange(10_000, 100_000))
    needles = [f"VAR {names[0]} = {number}."] + [
        f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, len(names))]
    question = (f"Find all variables that are assigned the value {number} in the text above. "
                f"Answer: the variables assigned the value {number} are:")
    # The chain must be read in order: the needles keep their order among the filler.
    prompt, spans, ids = _haystack(tokenizer, _VARIABLES, needles, question, length, rng)
    return Sample("variable_tracking", prompt, tuple(name.lower() for name in names), spans,
                  max_new_tokens=4 * len(names) + 4, prompt_ids=_ids(ids))


def _common_words(tokenizer, length: int, rng: random.Random) -> Sample:
    common = rng.sample(KEYS, 10)
    rare = [word for word in KEYS if word not in common]
    question = ("Question: What are the 10 most common words in the above list? Answer: The top "
                "10 words that appear most often in the list are:")
    order = rng.random()

    def pieces(entries: int) -> list[str]:
        # Each common word appears about 3x as often as each rare one (at least twice, while a
        # rare word appears at most once in short lists), so the ten are well defined.
        each = max(2, round(3 * entries / (30 + len(rare))))
        words = [word for word in common for _ in range(each)]
        words += [rare[i % len(rare)] for i in range(max(0, entries - len(words)))]
        random.Random(order).shuffle(words)
        listing = [piece for i, word in enumerate(words) for piece in (f"{i + 1}.", word)]
        return [_WORDS, *listing, question]

    entries = 40
    for _ in range(3):  # scale the list to the length, then trim it under
        entries = max(40, int(entries * length / _count(tokenizer, pieces(entries))))
    while entries > 40 and _count(tokenizer, pieces(entries)) > length:
        entries = int(entries * 0.99)
    prompt = pieces(entries)
    return Sample("common_words", " ".join(prompt), tuple(common),
                  max_new_tokens=3 * len(common) + 4,
                  prompt_ids=_ids(_encode_pieces(tokenizer, prompt)))


def make_sample(task: str, tokenizer, length: int, seed: int) -> Sample:
    """One sample of ``task`` of about ``length`` tokens of ``tokenizer`` (never more), from
    ``seed``."""
    if task not in TASKS:
        raise ValueError(f"task: expected one of {TASKS}, received {task!r}")
    if not isinstance(length, int) or length < 256:
        raise ValueError(f"length: expected an int >= 256 (tokens), received {length!r}")
    rng = random.Random(f"{task}/{length}/{seed}")
    if task == "variable_tracking":
        return _variable_tracking(tokenizer, length, rng)
    if task == "common_words":
        return _common_words(tokenizer, length, rng)
    return _niah(task, tokenizer, length, rng)


def answer_text(answers: tuple[str, ...]) -> str:
    """The answers as the LM presets train a model to write them after the prompt (then
    [EOS]): ``" a, b, c."``."""
    return " " + ", ".join(answers) + "."


def answer_recall(generated: str, answers: tuple[str, ...]) -> float:
    """The share of ``answers`` found as whole words of ``generated`` (case-insensitive;
    digits separated by spaces, as word-level tokenizers decode them, are joined first)."""
    text = re.sub(r"(?<=\d)\s+(?=\d)", "", generated.lower())
    words = set(re.findall(r"\w+", text))
    return sum(answer.lower() in words for answer in answers) / len(answers)


def task_vocabulary() -> list[str]:
    """Every word and symbol the tasks write (lower case), digits one each."""
    texts = [_HEADER, _VARIABLES, _WORDS, *FILLER, _NEEDLE, *KEYS,
             "What is the special magic number for mentioned in the provided text? The special "
             "magic number for mentioned in the provided text is: What are all the special "
             "magic numbers for and mentioned in the provided text? The special magic numbers "
             "for and mentioned in the provided text are:",
             "VAR = Find all variables that are assigned the value in the text above. Answer: "
             "the variables assigned the value are:",
             "Question: What are the 10 most common words in the above list? Answer: The top "
             "words that appear most often in the list are:"]
    words = set()
    for text in texts:
        words.update(re.findall(r"[a-z]+|[^\sa-z0-9]", text.lower().replace("{key}", "")
                                .replace("{value}", "")))
    return sorted(words) + [str(digit) for digit in range(10)]


def synthetic_tokenizer():
    """A word-level ``PreTrainedTokenizerFast`` over ``task_vocabulary()`` (lower-cased input,
    punctuation and each digit a token of its own) with [BOS], [EOS], [PAD] and [UNK]."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[BOS]", "[EOS]"]
    vocab = {token: index for index, token in enumerate(specials + task_vocabulary())}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(),
        pre_tokenizers.Digits(individual_digits=True)])
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="[BOS]",
                                   eos_token="[EOS]", pad_token="[PAD]", unk_token="[UNK]")
