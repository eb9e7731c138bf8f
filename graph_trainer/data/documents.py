"""Document sources: one shard of a dataset's documents, tokenized, for the loader to pack.

A source has ``num_docs`` (documents in one epoch of its shard; None when that is not known
before reading it all, or the corpus is endless) and ``tokens(k)``: the token ids, with bos/eos
where the tokenizer has them, of the shard's ``k``-th document counted across epochs (``[]`` for an
empty or null text).

Shards
------
With ``shards`` S, shard ``s`` holds the rows ``s, s+S, s+2S, ...`` of one epoch of the dataset, in
order; when the dataset runs out, the shard starts over at row ``s`` (its next epoch). With S = 1
the one shard is the whole dataset in order. A source reads and tokenizes only its own shard's
rows: S sources cover every row of an epoch exactly once.

Map-style tables (``datasets.Dataset``: memory-mapped Arrow) jump straight to any document, so a
resume costs nothing. Streamed datasets (``datasets.IterableDataset``, ``training.dataset_streaming``)
read rows in order: going back to a document reads the rows before it again, without tokenizing
them. For the same data the two give the same documents in the same order. Hub datasets
("org/name") need network access or a copy already in the Hugging Face cache.
"""

from __future__ import annotations

import os

from graph_trainer.config_paths import is_local_dataset
from graph_trainer.data.tokenizer import Tokenizer, with_specials
from graph_trainer.errors import ConfigError, one_line

__all__ = ["load_documents"]

_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}
"""The ``datasets`` builder of each of ``config.LOCAL_DATASET_SUFFIXES`` (a test holds the two equal)."""
_CHUNK_DOCS = 256  # a table's documents read at a time: bounded memory, few slow per-row calls


class _Texts:
    """Turns a row's text into token ids, with the checks every source needs."""

    def __init__(self, field: str, tokenizer: Tokenizer, name: str, strip_newlines: bool):
        self.field, self._tokenizer, self._name, self._strip = field, tokenizer, name, strip_newlines

    def tokens(self, text, row: int) -> list[int]:
        """Token ids of ``text`` (row ``row`` of its epoch) with bos/eos; ``[]`` for an empty or null text."""
        if text is None:
            return []
        if not isinstance(text, str):
            raise ConfigError(
                f"training.text_field {self.field!r} of dataset {self._name!r} holds "
                f"{type(text).__name__} values (row {row}); it must hold strings"
            )
        if self._strip:
            text = text.strip("\n")
        if not text:
            return []  # an empty document carries nothing to learn, not even a bos/eos pair
        return with_specials(self._tokenizer, self._tokenizer.encode(text))


def _check_field(columns, texts: _Texts, name: str) -> None:
    if columns is not None and texts.field not in columns:
        raise ConfigError(
            f"training.text_field {texts.field!r} is not a column of dataset {name!r}; its columns are {list(columns)}"
        )


def _empty_shard(name: str, rows: int, shard: int, shards: int) -> ConfigError:
    if rows == 0:
        return ConfigError(f"dataset {name!r} has no rows")
    return ConfigError(
        f"dataset {name!r} has {rows} rows: too few for {shards} shards (training.dataset_shards), "
        f"shard {shard} would hold none; use at most {rows} shards"
    )


class TableDocuments:
    """Shard ``shard`` of ``shards`` of a map-style ``datasets.Dataset``, read lazily in chunks."""

    def __init__(self, ds, texts: _Texts, name: str, shard: int, shards: int):
        _check_field(ds.column_names, texts, name)
        self.num_docs = len(range(shard, len(ds), shards))
        if self.num_docs == 0:
            raise _empty_shard(name, len(ds), shard, shards)
        self._ds = ds.select_columns([texts.field])
        self._texts, self._shard, self._shards = texts, shard, shards
        self._chunk_start = -1
        self._chunk: list = []

    def _row(self, j: int) -> int:
        return self._shard + j * self._shards

    def tokens(self, k: int) -> list[int]:
        """Token ids of the shard's document ``k`` (row ``shard + (k % num_docs) * shards``)."""
        j = k % self.num_docs
        if not 0 <= j - self._chunk_start < len(self._chunk):
            self._chunk_start = j - j % _CHUNK_DOCS
            stop = min(self._chunk_start + _CHUNK_DOCS, self.num_docs)
            rows = range(self._row(self._chunk_start), self._row(stop - 1) + 1, self._shards)
            self._chunk = self._ds[rows][self._texts.field]
        return self._texts.tokens(self._chunk[j - self._chunk_start], self._row(j))


class StreamedDocuments:
    """Shard ``shard`` of ``shards`` of a ``datasets.IterableDataset``, read in order."""

    num_docs = None  # known only at the end of the first epoch

    def __init__(self, ds, texts: _Texts, name: str, shard: int, shards: int):
        _check_field(ds.column_names, texts, name)  # None when the stream does not say before reading
        self._ds = ds if ds.column_names is None else ds.select_columns([texts.field])
        self._texts, self._name, self._shard, self._shards = texts, name, shard, shards
        self._restart()

    def _restart(self) -> None:
        self._rows = None  # the current epoch's (row, text) of the shard
        self._row = -1  # the row last read
        self._next = 0  # the shard's document the next read gives
        self._tokens_seen = False  # whether the current epoch gave a non-empty document yet

    def _epoch(self):
        """(row, text) of the shard's rows in one pass over the dataset, read in batches of rows."""
        row, field = 0, self._texts.field
        for batch in self._ds.iter(batch_size=_CHUNK_DOCS):
            if field not in batch:
                _check_field(list(batch), self._texts, self._name)
            texts = batch[field]
            for i in range((self._shard - row) % self._shards, len(texts), self._shards):
                yield row + i, texts[i]
            row += len(texts)
        self._epoch_rows = row

    def _next_text(self):
        """The text of the shard's next row; a new epoch when the dataset runs out."""
        while True:
            if self._rows is None:
                self._rows, self._tokens_seen = self._epoch(), False
            item = next(self._rows, None)
            if item is not None:
                self._row, text = item
                return text
            if self._epoch_rows <= self._shard:
                raise _empty_shard(self._name, self._epoch_rows, self._shard, self._shards)
            if not self._tokens_seen:
                raise ConfigError(f"dataset {self._name!r} yields no tokens: every document is empty")
            self._rows = None

    def tokens(self, k: int) -> list[int]:
        """Token ids of the shard's document ``k``; reading goes forward from the last one read."""
        if k < self._next:
            self._restart()
        while self._next < k:  # documents before k: read, not tokenized
            text = self._next_text()
            self._tokens_seen = self._tokens_seen or bool(text)
            self._next += 1
        tokens = self._texts.tokens(self._next_text(), self._row)
        self._tokens_seen = self._tokens_seen or bool(tokens)
        self._next += 1
        return tokens


def _local_files(path: str) -> list[str]:
    """The data files under folder ``path``, sorted; hidden files and folders skipped."""
    files = []
    for root, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))  # skip .cache and the like
        files += [
            os.path.join(root, n)
            for n in names
            if not n.startswith(".") and os.path.splitext(n)[1].lower() in _BUILDERS
        ]
    return sorted(files)


def _local_data_files(dataset: str, setting: str) -> tuple[str, list[str]]:
    """The ``datasets`` builder name and the sorted files of a local file or folder."""
    path = os.path.expanduser(dataset)
    allowed = ", ".join(sorted(_BUILDERS))
    if not os.path.exists(path):
        raise ConfigError(
            f"{setting} path {dataset!r} does not exist; give 'synthetic', an existing "
            f"{allowed} file or folder of them, or a Hugging Face hub dataset name"
        )
    files = _local_files(path) if os.path.isdir(path) else [path]
    if not files:
        raise ConfigError(f"{setting} folder {dataset!r} holds no {allowed} files")
    builders = {_BUILDERS.get(os.path.splitext(f)[1].lower()) for f in files}
    if None in builders:
        raise ConfigError(f"{setting} file {dataset!r} has an unsupported extension; allowed: {allowed}")
    if len(builders) > 1:
        raise ConfigError(
            f"{setting} folder {dataset!r} mixes file types ({sorted(builders)}); keep one of {allowed} per folder"
        )
    if not any(_holds_data(f) for f in files):  # (datasets fails on them with a bare StopIteration)
        what = "file is empty" if len(files) == 1 and not os.path.isdir(path) else "folder holds only empty files"
        raise ConfigError(f"{setting} {what}: {dataset!r} has no rows")
    return builders.pop(), files


def _holds_data(path: str) -> bool:
    """Whether a data file holds more than whitespace (a Parquet file: more than nothing)."""
    if os.path.splitext(path)[1].lower() == ".parquet":
        return os.path.getsize(path) > 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            if chunk.strip():
                return True
    return False


def _open(dataset: str, subset: str, split: str, streaming: bool, setting: str, split_setting: str):
    """``datasets.load_dataset`` for a local file/folder or a hub dataset; the table or stream and its builder."""
    import datasets

    if streaming and "[" in split:
        raise ConfigError(
            f"{split_setting} {split!r} is a slice, which a streamed dataset cannot take; turn "
            "training.dataset_streaming off, or give a whole split"
        )
    if is_local_dataset(dataset):
        if subset:
            raise ConfigError(f"{setting} {dataset!r} is a local path, which has no subsets; leave the subset out")
        builder, files = _local_data_files(dataset, setting)
        # Name the files after the requested split so any split name (and slicing such as
        # "train[:10%]") works on local data.
        kwargs = {"data_files": {split.split("[")[0]: files}}
        if builder == "text":
            kwargs["sample_by"] = "paragraph"  # a blank-line separated paragraph is one document
        what = f"{setting} {dataset!r}"
    else:
        builder, kwargs = dataset, {"name": subset} if subset else {}
        named = f" subset {subset!r}" if subset else ""
        what = f"Hugging Face dataset {dataset!r}{named} (hub datasets need network access or a copy in the HF cache)"
    try:
        ds = datasets.load_dataset(builder, split=split, streaming=streaming, **kwargs)
    except ConfigError:
        raise
    except Exception as e:  # datasets raises many unrelated types for bad files, splits and names
        raise ConfigError(f"cannot load {what} with {split_setting} {split!r}: {one_line(e)}") from e
    wanted = datasets.IterableDataset if streaming else datasets.Dataset
    if not isinstance(ds, wanted):
        raise ConfigError(f"{what} with {split_setting} {split!r} did not give a single table but {type(ds).__name__}")
    return ds, builder


def load_documents(
    dataset: str,
    *,
    subset: str,
    split: str,
    streaming: bool,
    text_field: str,
    tokenizer: Tokenizer,
    setting: str,
    shards: int,
    read: range,
    split_setting: str = "training.dataset_split",
) -> dict[int, TableDocuments | StreamedDocuments]:
    """The shards ``read`` of ``shards`` of a local file/folder or a hub dataset (``subset``: its
    configuration name, such as C4's "en"), each a table or, with ``streaming``, a stream. Errors
    name the dataset as ``setting`` and the split as ``split_setting``."""
    ds, builder = _open(dataset, subset, split, streaming, setting, split_setting)
    texts = _Texts(text_field, tokenizer, dataset, strip_newlines=builder == "text")
    source = StreamedDocuments if streaming else TableDocuments
    return {shard: source(ds, texts, dataset, shard, shards) for shard in read}
