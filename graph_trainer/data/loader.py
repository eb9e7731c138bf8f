"""Datasets, token packing, data-parallel sharding and the resumable batch loader.

The trainer calls ``build_dataloader(...)``: a :class:`TokenBatchLoader` yielding ``(tokens, labels)``
batches. Documents come from the synthetic corpus (``graph_trainer.data.synthetic``), a local file or
folder, or a Hugging Face hub dataset, and are tokenized by a ``graph_trainer.data.tokenizer`` tokenizer.

How batches are made
--------------------
Documents are read in order. Each becomes ``[bos] + encode(text) + [eos]`` (bos/eos only when the
tokenizer has them) and all documents are concatenated into one endless token stream; a finite
dataset simply starts over (next epoch) when it runs out. The stream is cut into consecutive,
non-overlapping windows of ``seq_len + 1`` tokens; a window gives ``tokens = window[:-1]`` and
``labels = window[1:]``.

Data-parallel sharding rule
---------------------------
With ``B = local_batch_size`` and ``D = dp_degree``, step ``s`` (0-based) consumes the global
windows ``s*B*D .. s*B*D + B*D - 1``, and rank ``r`` takes row ``i`` of its batch from window
``s*B*D + r*B + i``. So the rows of ranks 0..D-1 concatenated in rank order are exactly the rows of a
single process run with batch ``B*D``. With gradient accumulation a training step takes M
consecutive batches (microbatches); the ``M*D`` batches of a step in (microbatch, rank) order are
then the rows of one process with batch ``M*B*D``. Every rank reads (tokenises) the whole global stream and skips
the other ranks' windows, which keeps the rule exact for any dataset at the price of D-fold
tokenisation work (cheap next to a training step).

Resuming
--------
``state_dict()`` is ``{"version", "stream", "step", "doc", "offset"}``: the number of batches
(microbatches) produced, and the position of the next unread token of the global stream (document index counted
across epochs, token offset inside that document). After every batch all ranks stand at the same
global step boundary, so the state is identical on every rank and does not depend on the rank; it can
be loaded with a different local batch size or dp degree and reading continues at the same token.
``stream`` names the dataset and tokenizer; loading a state saved for a different stream is a
ConfigError.

Hub datasets (``training.dataset = "org/name"``) are read with ``datasets.load_dataset(name,
split=...)`` and so need network access or a copy already in the Hugging Face cache.
"""

from __future__ import annotations

import array
import os

import torch

from graph_trainer.data.synthetic import SyntheticDocuments, split_seed
from graph_trainer.data.tokenizer import Tokenizer, with_specials
from graph_trainer.errors import ConfigError, one_line

__all__ = ["TokenBatchLoader", "build_dataloader"]


# --------------------------------------------------------------------------------------------
# Files and Hugging Face datasets
# --------------------------------------------------------------------------------------------

_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}
_CHUNK_DOCS = 256  # documents read from Arrow at a time: bounded memory, few slow per-row calls


class _HFDocuments:
    """Documents of a map-style ``datasets.Dataset``, read lazily in chunks; index ``i`` is row ``i % n``.

    Arrow tables are memory-mapped, so nothing is loaded beyond the current chunk, and resuming jumps
    straight to a row instead of replaying the corpus.
    """

    def __init__(self, ds, text_field: str, tokenizer: Tokenizer, name: str, strip_newlines: bool):
        columns = list(ds.column_names)
        if text_field not in columns:
            raise ConfigError(
                f"training.text_field {text_field!r} is not a column of dataset {name!r}; its columns are {columns}"
            )
        self.num_docs = len(ds)
        if self.num_docs == 0:
            raise ConfigError(f"dataset {name!r} has no rows")
        self._ds = ds.select_columns([text_field])
        self._field = text_field
        self._name = name
        self._tokenizer = tokenizer
        self._strip = strip_newlines
        self._chunk_start = -1
        self._chunk: list = []

    def tokens(self, index: int) -> list[int]:
        """Token ids of row ``index % num_docs`` with bos/eos; ``[]`` for an empty or null text."""
        row = index % self.num_docs
        if not 0 <= row - self._chunk_start < len(self._chunk):
            self._chunk_start = row - row % _CHUNK_DOCS
            self._chunk = self._ds[self._chunk_start : self._chunk_start + _CHUNK_DOCS][self._field]
        text = self._chunk[row - self._chunk_start]
        if text is None:
            return []
        if not isinstance(text, str):
            raise ConfigError(
                f"training.text_field {self._field!r} of dataset {self._name!r} holds "
                f"{type(text).__name__} values (row {row}); it must hold strings"
            )
        if self._strip:
            text = text.strip("\n")
        if not text:
            return []  # an empty document carries nothing to learn, not even a bos/eos pair
        return with_specials(self._tokenizer, self._tokenizer.encode(text))


def _is_local_path(dataset: str) -> bool:
    """Whether ``dataset`` names a local file/folder rather than a hub dataset such as "org/name"."""
    if os.path.exists(os.path.expanduser(dataset)):
        return True
    return os.path.isabs(dataset) or dataset.startswith((".", "~")) or os.path.splitext(dataset)[1].lower() in _BUILDERS


def _local_data_files(dataset: str, setting: str) -> tuple[str, list[str]]:
    """The ``datasets`` builder name and the sorted files of a local file or folder."""
    path = os.path.expanduser(dataset)
    allowed = ", ".join(sorted(_BUILDERS))
    if not os.path.exists(path):
        raise ConfigError(
            f"{setting} path {dataset!r} does not exist; give 'synthetic', an existing "
            f"{allowed} file or folder of them, or a Hugging Face hub dataset name"
        )
    if os.path.isdir(path):
        files = []
        for root, dirs, names in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))  # skip .cache and the like
            files += [
                os.path.join(root, n)
                for n in names
                if not n.startswith(".") and os.path.splitext(n)[1].lower() in _BUILDERS
            ]
        files.sort()
        if not files:
            raise ConfigError(f"{setting} folder {dataset!r} holds no {allowed} files")
    else:
        files = [path]
    builders = {_BUILDERS.get(os.path.splitext(f)[1].lower()) for f in files}
    if None in builders:
        raise ConfigError(f"{setting} file {dataset!r} has an unsupported extension; allowed: {allowed}")
    if len(builders) > 1:
        raise ConfigError(
            f"{setting} folder {dataset!r} mixes file types ({sorted(builders)}); keep one of {allowed} per folder"
        )
    return builders.pop(), files


def _load_hf_documents(dataset: str, split: str, text_field: str, tokenizer: Tokenizer, setting: str) -> _HFDocuments:
    """Open a local file/folder or a hub dataset as a lazy document source."""
    import datasets

    if _is_local_path(dataset):
        builder, files = _local_data_files(dataset, setting)
        # Name the files after the requested split so any split name (and slicing such as
        # "train[:10%]") works on local data.
        kwargs = {"data_files": {split.split("[")[0]: files}}
        if builder == "text":
            kwargs["sample_by"] = "paragraph"  # a blank-line separated paragraph is one document
        what = f"{setting} {dataset!r}"
    else:
        builder, kwargs = dataset, {}
        what = f"Hugging Face dataset {dataset!r} (hub datasets need network access or a copy in the HF cache)"
    try:
        ds = datasets.load_dataset(builder, split=split, **kwargs)
    except ConfigError:
        raise
    except Exception as e:  # datasets raises many unrelated types for bad files, splits and names
        raise ConfigError(f"cannot load {what} with split {split!r}: {one_line(e)}") from e
    if not isinstance(ds, datasets.Dataset):
        raise ConfigError(f"{what} with split {split!r} did not give a single table but {type(ds).__name__}")
    return _HFDocuments(ds, text_field, tokenizer, dataset, strip_newlines=builder == "text")


# --------------------------------------------------------------------------------------------
# Packing and batching
# --------------------------------------------------------------------------------------------


class _PackedStream:
    """A cursor over the concatenation of all documents' tokens, at (document ``doc``, token ``offset``)."""

    def __init__(self, documents, name: str):
        self._documents = documents
        self._name = name
        self.doc = 0
        self.offset = 0
        self._cached_doc = -1
        self._cached: list[int] = []

    def seek(self, doc: int, offset: int) -> None:
        """Move the cursor to token ``offset`` of document ``doc``."""
        self.doc, self.offset = doc, offset

    def _current(self) -> list[int]:
        if self._cached_doc != self.doc:
            self._cached, self._cached_doc = self._documents.tokens(self.doc), self.doc
        return self._cached

    def read(self, n: int, out: array.array | list[int] | None) -> None:
        """Advance by ``n`` tokens, appending them to ``out`` (or dropping them when ``out`` is None)."""
        empty_run = 0
        limit = self._documents.num_docs
        while n > 0:
            tokens = self._current()
            available = len(tokens) - self.offset
            if available <= 0:
                empty_run += 1
                # A whole epoch without a token would loop forever.
                if limit is not None and empty_run >= limit:
                    raise ConfigError(f"dataset {self._name!r} yields no tokens: every document is empty")
                self.doc, self.offset = self.doc + 1, 0
                continue
            empty_run = 0
            take = min(n, available)
            if out is not None:
                out.extend(tokens[self.offset : self.offset + take])
            self.offset += take
            n -= take
            if self.offset == len(tokens):
                self.doc, self.offset = self.doc + 1, 0


class TokenBatchLoader:
    """Endless iterator of ``(tokens, labels)`` int64 CPU batches of shape ``[local_batch_size, seq_len]``.

    See the module docstring for the packing, the data-parallel sharding rule and the resume state.
    ``iter()`` returns the loader itself, so all iterators share one position.
    """

    _STATE_VERSION = 1

    def __init__(
        self,
        stream: _PackedStream,
        *,
        stream_id: str,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int,
        dp_degree: int,
    ):
        self._stream = stream
        self._stream_id = stream_id
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self._step = 0

    def __iter__(self) -> TokenBatchLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.seq_len + 1
        rows = self.local_batch_size
        # Global windows of this step: ranks 0..D-1 take consecutive blocks of `rows` windows.
        self._stream.read(self.dp_rank * rows * window, None)
        # int64 buffer: turning it into a tensor is faster than a list (measured: docs/performance.md)
        flat = array.array("q")
        self._stream.read(rows * window, flat)
        self._stream.read((self.dp_degree - 1 - self.dp_rank) * rows * window, None)
        self._step += 1
        batch = torch.frombuffer(flat, dtype=torch.int64).view(rows, window)
        # Contiguous copies: a traced step should not see two overlapping strided views.
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

    def state_dict(self) -> dict:
        """Small picklable state to resume exactly after the last batch produced (same on every rank)."""
        return {
            "version": self._STATE_VERSION,
            "stream": self._stream_id,
            "step": self._step,
            "doc": self._stream.doc,
            "offset": self._stream.offset,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (from :meth:`state_dict`): the next batch is the one that followed it."""
        missing = [k for k in ("version", "stream", "step", "doc", "offset") if k not in state]
        if missing:
            raise ConfigError(f"data loader state lacks {missing}; it must come from TokenBatchLoader.state_dict()")
        if state["version"] != self._STATE_VERSION:
            raise ConfigError(
                f"data loader state has version {state['version']}; this build reads version {self._STATE_VERSION}"
            )
        if state["stream"] != self._stream_id:
            raise ConfigError(
                f"data loader state was saved for {state['stream']!r} but this run reads "
                f"{self._stream_id!r}; resume with the same dataset, seed and tokenizer"
            )
        self._step = int(state["step"])
        self._stream.seek(int(state["doc"]), int(state["offset"]))


def build_dataloader(
    *,
    dataset: str,
    tokenizer: Tokenizer,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int,
    dp_degree: int,
    seed: int,
    vocab_size: int,
    dataset_split: str = "train",
    text_field: str = "text",
    setting: str = "training.dataset",
) -> TokenBatchLoader:
    """Build the loader for ``training.dataset`` (or the setting named ``setting``, which errors name).

    ``dataset`` is ``"synthetic"`` (the built-in corpus, a pure function of ``seed``), a local
    ``.json``/``.jsonl``/``.parquet``/``.txt`` file or folder of such files (read with
    ``datasets.load_dataset``; a ``.txt`` document is a blank-line separated paragraph), or a Hugging
    Face hub dataset name (needs network or the HF cache). Documents come from column ``text_field``
    in order; the dataset repeats forever. ``seed`` only affects the synthetic corpus (with
    ``dataset_split``: ``synthetic.split_seed``). Rank
    ``dp_rank`` of ``dp_degree`` gets its share of each step by the rule in the module docstring.
    Token ids are checked to fit the model's ``vocab_size``.
    """
    for name, value, low in (
        ("training.seq_len", seq_len, 1),
        ("training.local_batch_size", local_batch_size, 1),
        ("dp_degree", dp_degree, 1),
    ):
        if not isinstance(value, int) or value < low:
            raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
    if not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_degree:
        raise ConfigError(f"dp_rank must be in [0, {dp_degree}), got {dp_rank!r}")
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"tokenizer has {tokenizer.vocab_size} ids but model.flavor vocab_size is {vocab_size}; "
            f"choose a flavor with vocab_size >= {tokenizer.vocab_size} or a smaller tokenizer"
        )
    if not dataset:
        raise ConfigError(
            f"{setting} is empty; give 'synthetic', a local .json/.jsonl/.parquet/.txt file "
            "or folder, or a Hugging Face hub dataset name"
        )
    # Not repr(tokenizer): a user tokenizer's default repr holds a memory address.
    tok_id = (
        f"{type(tokenizer).__name__}(vocab_size={tokenizer.vocab_size}, bos={tokenizer.bos_id}, eos={tokenizer.eos_id})"
    )
    if dataset == "synthetic":
        documents = SyntheticDocuments(split_seed(seed, dataset_split), tokenizer)
        held_out = "" if dataset_split == "train" else f" split={dataset_split}"
        stream_id = f"synthetic seed={seed}{held_out} tokenizer={tok_id}"
    else:
        documents = _load_hf_documents(dataset, dataset_split, text_field, tokenizer, setting)
        stream_id = f"{dataset} split={dataset_split} field={text_field} tokenizer={tok_id}"
    return TokenBatchLoader(
        _PackedStream(documents, dataset),
        stream_id=stream_id,
        seq_len=seq_len,
        local_batch_size=local_batch_size,
        dp_rank=dp_rank,
        dp_degree=dp_degree,
    )
