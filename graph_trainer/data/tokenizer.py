"""Tokenizers: the built-in byte tokenizer and Hugging Face ``tokenizer.json`` files.

The trainer calls ``build_tokenizer(path)`` (``training.tokenizer_path``): ``""``/``"bytes"`` gives
the built-in :class:`ByteTokenizer`, a path to a Hugging Face ``tokenizer.json`` (or a folder
holding one) gives :class:`HFTokenizer`; anything else is a ConfigError.

Contract
--------
A tokenizer (:class:`Tokenizer`) has a ``vocab_size`` (every id it gives is below it),
``bos_id``/``eos_id`` (None when it has no such token), and ``encode(text)``, which never adds
special tokens itself: the data pipeline (``graph_trainer.data.loader``) makes each document
``[bos] + encode(text) + [eos]`` (``with_specials``; bos/eos only when the tokenizer has them).
"""

from __future__ import annotations

import json
import os
from typing import Protocol

from graph_trainer.errors import ConfigError, one_line

__all__ = [
    "Tokenizer",
    "ByteTokenizer",
    "HFTokenizer",
    "build_tokenizer",
    "document_start",
    "with_specials",
]


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    vocab_size: int
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without any special tokens."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255 are byte values, 256 is bos, 257 is eos (258 ids)."""

    vocab_size = 258
    bos_id = 256
    eos_id = 257

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text``."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Text of the byte ids in ``ids``; bos/eos are dropped, invalid UTF-8 becomes U+FFFD."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=258)"


# Used only when no tokenizer_config.json sits next to tokenizer.json to name the special tokens.
_BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "[BOS]", "<|startoftext|>")
_EOS_CANDIDATES = ("<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<|endoftext|>")


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer loaded from a ``tokenizer.json`` file.

    bos/eos come from ``tokenizer_config.json`` in the same folder when it exists (its
    ``bos_token``/``eos_token``, which may be null), otherwise from well-known special token names
    (``<|begin_of_text|>``, ``<s>``, ``<|end_of_text|>``, ``</s>``, ...). ``encode`` never adds
    special tokens itself: the packer adds bos/eos around each document.
    """

    def __init__(self, path: str):
        from tokenizers import Tokenizer as _RustTokenizer

        self.path = path
        try:
            self._tok = _RustTokenizer.from_file(path)
        except Exception as e:  # the Rust side raises plain Exception subclasses with long messages
            raise ConfigError(
                f"training.tokenizer_path {path!r} is not a valid Hugging Face tokenizer.json: {one_line(e)}"
            ) from e
        vocab = self._tok.get_vocab(with_added_tokens=True)
        # Ids can have holes; the model must cover the largest one.
        self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)
        self.bos_id, self.eos_id = self._special_ids(path)

    def _special_ids(self, path: str) -> tuple[int | None, int | None]:
        config_path = os.path.join(os.path.dirname(os.path.abspath(path)), "tokenizer_config.json")
        if os.path.isfile(config_path):
            try:
                with open(config_path, encoding="utf-8") as f:
                    config = json.load(f)
            except (OSError, ValueError) as e:
                raise ConfigError(f"cannot read {config_path}: {one_line(e)}") from e
            if "bos_token" in config or "eos_token" in config:
                return self._config_token(config.get("bos_token")), self._config_token(config.get("eos_token"))
        return self._first_known(_BOS_CANDIDATES), self._first_known(_EOS_CANDIDATES)

    def _config_token(self, entry) -> int | None:
        # tokenizer_config.json writes a special token either as a string or as {"content": ...}.
        if isinstance(entry, dict):
            entry = entry.get("content")
        return self._tok.token_to_id(entry) if isinstance(entry, str) else None

    def _first_known(self, names: tuple[str, ...]) -> int | None:
        for name in names:
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return token_id
        return None

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without the tokenizer's own special-token template."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` (special tokens skipped)."""
        return self._tok.decode(ids)

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_id={self.eos_id})"


def build_tokenizer(tokenizer_path: str) -> Tokenizer:
    """Build the tokenizer named by ``training.tokenizer_path``.

    ``""`` or ``"bytes"`` gives :class:`ByteTokenizer`; a path to a Hugging Face ``tokenizer.json``
    (or to a folder containing one) gives :class:`HFTokenizer`. Anything else is a ConfigError.
    """
    if tokenizer_path in ("", "bytes"):
        return ByteTokenizer()
    path = os.path.expanduser(tokenizer_path)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise ConfigError(
            f"training.tokenizer_path {tokenizer_path!r} does not exist; give '' or 'bytes' for the "
            f"built-in byte tokenizer, or the path of a Hugging Face tokenizer.json (or its folder)"
        )
    return HFTokenizer(path)


def document_start(tokenizer: Tokenizer) -> tuple[str, int]:
    """Where the loader's packed documents start (``models.sequence.document_ids``): at each BOS token
    when the tokenizer has one (``with_specials`` puts it first), else after each EOS token; a
    ``ConfigError`` for a tokenizer with neither (its packed documents cannot be told apart)."""
    if tokenizer.bos_id is not None:
        return ("bos", tokenizer.bos_id)
    if tokenizer.eos_id is not None:
        return ("eos", tokenizer.eos_id)
    raise ConfigError(
        "training.attention_mask block_causal needs a tokenizer with a BOS or an EOS token, which mark where "
        "the packed documents start; this tokenizer has neither (use causal, or another tokenizer)"
    )


def with_specials(tokenizer: Tokenizer, ids: list[int]) -> list[int]:
    """``[bos] + ids + [eos]``, each special token only if the tokenizer has it."""
    if tokenizer.bos_id is not None:
        ids = [tokenizer.bos_id] + ids
    if tokenizer.eos_id is not None:
        ids.append(tokenizer.eos_id)
    return ids
