"""The built-in synthetic corpus (``training.dataset = "synthetic"``): learnable text without any files.

Contract
--------
Document ``i`` is ``synthetic_document(seed, i)``, a pure function of ``(seed, index)`` (no global
RNG, the same text on every Python version: see the function), so any rank can produce any
document and a resumed run reads the same text. The corpus is endless: it has no epochs.
:class:`SyntheticDocuments` is the document source ``graph_trainer.data.loader`` packs (each document
``[bos] + encode(text) + [eos]``); ``seed`` is ``training.seed``.
"""

from __future__ import annotations

import hashlib
import random

from graph_trainer.data.tokenizer import Tokenizer, with_specials

__all__ = ["split_seed", "synthetic_document", "SyntheticDocuments"]

# A tiny closed vocabulary: a small model first learns the spelling of these words (byte level),
# then the sentence templates, then the arithmetic and the in-document repetitions.
_NAMES = ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy")
_ADJECTIVES = ("small", "red", "old", "quick", "quiet", "happy", "green", "tall", "lazy", "brave")
_NOUNS = ("cat", "dog", "bird", "fox", "robot", "farmer", "teacher", "child", "king", "horse")
_VERBS = ("sees", "likes", "follows", "helps", "finds", "calls", "feeds", "paints", "meets", "hears")
_OBJECTS = ("ball", "apple", "river", "house", "book", "tree", "garden", "letter", "boat", "song")
_NUMBER_WORDS = (
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
    "twenty",
)

_MASK64 = (1 << 64) - 1


def _doc_seed(seed: int, index: int) -> int:
    """A well-mixed 64-bit seed for document ``index`` (splitmix64 finaliser; no global RNG)."""
    x = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def synthetic_document(seed: int, index: int) -> str:
    """Text of synthetic document ``index``: a pure function of ``(seed, index)``.

    A document is 4 to 12 sentences about a small cast (two names, three nouns, three objects drawn
    per document, so context helps prediction): subject-verb-object sentences, correct additions and
    subtractions ("12 plus 7 is 19."), counting runs, number words, and exact repeats of an earlier
    sentence of the same document ("again, ...").
    """
    # Only Random(int) seeding and random() are promised to stay the same across Python versions,
    # so every draw is built from random(), which is also cheaper than randrange (measured: docs/performance.md).
    uniform = random.Random(_doc_seed(seed, index)).random

    def below(n: int) -> int:
        return int(uniform() * n)

    def pick(options):
        return options[int(uniform() * len(options))]

    def distinct(options, k: int) -> list:
        pool = list(options)
        return [pool.pop(below(len(pool))) for _ in range(k)]

    names, nouns, objects = distinct(_NAMES, 2), distinct(_NOUNS, 3), distinct(_OBJECTS, 3)
    sentences: list[str] = []
    for _ in range(4 + below(9)):
        kind = below(10)
        if kind < 3:
            s = f"the {pick(_ADJECTIVES)} {pick(nouns)} {pick(_VERBS)} the {pick(objects)}."
        elif kind < 4:
            s = f"{pick(names)} {pick(_VERBS)} the {pick(nouns)} and the {pick(objects)}."
        elif kind < 6:
            a, b = below(50), below(50)
            s = f"{a} plus {b} is {a + b}."
        elif kind < 7:
            a, b = below(50), below(50)
            a, b = max(a, b), min(a, b)
            s = f"{a} minus {b} is {a - b}."
        elif kind < 8:
            start = below(30)
            s = "counting: " + " ".join(str(n) for n in range(start, start + 3 + below(5))) + "."
        elif kind < 9:
            n = below(len(_NUMBER_WORDS))
            s = f"{_NUMBER_WORDS[n]} is {n}."
        elif sentences:
            s = "again, " + pick(sentences)
        else:
            s = f"{pick(names)} has {2 + below(8)} {pick(objects)}s."
        sentences.append(s)
    return " ".join(sentences) + "\n"


class SyntheticDocuments:
    """Shard ``shard`` of ``shards`` of the endless synthetic corpus as token lists: the shard's
    document ``k`` is ``synthetic_document(seed, shard + k * shards)``."""

    num_docs = None  # infinite: there are no epochs

    def __init__(self, seed: int, tokenizer: Tokenizer, shard: int = 0, shards: int = 1):
        self._seed = seed
        self._tokenizer = tokenizer
        self._shard, self._shards = shard, shards

    def tokens(self, k: int) -> list[int]:
        """Token ids of the shard's document ``k`` with bos/eos."""
        index = self._shard + k * self._shards
        return with_specials(self._tokenizer, self._tokenizer.encode(synthetic_document(self._seed, index)))


def split_seed(seed: int, split: str) -> int:
    """The seed of the synthetic corpus's ``split``: ``seed`` itself for "train" (the training
    stream), else a seed of its own for each split name (held-out documents: text the training
    stream holds only by the chance of the same template and draw), the same on every run and
    every Python version (no ``hash()``)."""
    if split == "train":
        return seed
    digest = hashlib.sha256(f"{seed}:{split}".encode()).digest()
    return int.from_bytes(digest[:8], "little")
