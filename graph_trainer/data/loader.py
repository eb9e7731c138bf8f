"""Token packing, data-parallel sharding and the resumable batch loader.

The trainer calls ``build_dataloader(...)``: a :class:`TokenBatchLoader` yielding ``(tokens, labels)``
batches. Documents come from the synthetic corpus (``graph_trainer.data.synthetic``), a local file or
folder, or a Hugging Face hub dataset (``graph_trainer.data.documents``: tables or streams), and are
tokenized by a ``graph_trainer.data.tokenizer`` tokenizer.

How batches are made
--------------------
The documents are split into ``S`` shards (``training.dataset_shards``; shard ``s`` holds documents
``s, s+S, s+2S, ...``, see ``graph_trainer.data.documents``). In each shard, documents are read in
order; each becomes ``[bos] + encode(text) + [eos]`` (bos/eos only when the tokenizer has them) and
they are concatenated into one endless token stream; a finite dataset simply starts over (next
epoch) when it runs out. A shard's stream is cut into consecutive, non-overlapping windows of
``seq_len + 1`` tokens; a window gives ``tokens = window[:-1]`` and ``labels = window[1:]``.

Data-parallel sharding rule
---------------------------
With ``B = local_batch_size`` and ``D = dp_degree``, a batch of all ranks together has ``G = B*D``
rows (``S`` must divide it): global rows ``s*G/S .. (s+1)*G/S - 1`` are the next ``G/S`` windows of
shard ``s``, and rank ``r`` takes global rows ``r*B .. r*B + B - 1``. So the rows of ranks 0..D-1
concatenated in rank order are exactly the rows of a single process run with batch ``B*D`` and the
same ``S``. With gradient accumulation a training step takes M consecutive batches (microbatches);
the ``M*D`` batches of a step in (microbatch, rank) order are then, with one shard, the rows of one
process with batch ``M*B*D``.

A rank reads (tokenizes) only the shards its rows come from, and skips the other ranks' windows in
them. With ``S = 1`` (the default) every rank tokenizes the whole stream: ``D``-fold work, but the
batches do not depend on ``D``. With ``S = D`` each rank tokenizes only its own shard's documents;
the batches are then fixed by ``S``, and a single process reproduces them with the same ``S``.

Resuming
--------
``state_dict()`` is ``{"version", "stream", "step", "shards", "positions"}``: the number of batches
(microbatches) produced, and for each shard this rank reads the position of its next unread token
(document index counted across epochs, token offset inside that document). After every batch all
ranks reading a shard stand at the same place in it; :func:`merge_states` joins the ranks' states
into one with every shard (the checkpoint holds that one). It can be loaded with a different local
batch size or dp degree (``S`` still dividing the batch) and reading continues at the same tokens.
``stream`` names the dataset and tokenizer; loading a state saved for a different stream or number
of shards is a ConfigError. A version 1 state (one stream: ``doc`` and ``offset``) loads as one shard.
"""

from __future__ import annotations

import array

import torch

from graph_trainer.data.documents import load_documents
from graph_trainer.data.synthetic import SyntheticDocuments, split_seed
from graph_trainer.data.tokenizer import Tokenizer
from graph_trainer.errors import ConfigError

__all__ = ["TokenBatchLoader", "build_dataloader", "merge_states"]


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

    ``streams`` maps each shard this rank reads (see the module docstring) to its packed stream.
    ``iter()`` returns the loader itself, so all iterators share one position.
    """

    _STATE_VERSION = 2

    def __init__(
        self,
        streams: dict[int, _PackedStream],
        *,
        stream_id: str,
        shards: int,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int,
        dp_degree: int,
    ):
        self._streams = dict(sorted(streams.items()))
        self._stream_id = stream_id
        self.shards = shards
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self._step = 0

    def __iter__(self) -> TokenBatchLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        window, rows = self.seq_len + 1, self.local_batch_size
        per_shard = rows * self.dp_degree // self.shards  # global rows of a batch each shard gives
        first, last = self.dp_rank * rows, (self.dp_rank + 1) * rows  # this rank's global rows
        # int64 buffer: turning it into a tensor is faster than a list (measured: docs/performance.md)
        flat = array.array("q")
        for shard, stream in self._streams.items():
            start, stop = shard * per_shard, (shard + 1) * per_shard
            mine_from, mine_to = max(first, start), min(last, stop)
            stream.read((mine_from - start) * window, None)  # other ranks' windows of this shard
            stream.read((mine_to - mine_from) * window, flat)
            stream.read((stop - mine_to) * window, None)
        self._step += 1
        batch = torch.frombuffer(flat, dtype=torch.int64).view(rows, window)
        # Contiguous copies: a traced step should not see two overlapping strided views.
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

    def state_dict(self) -> dict:
        """Small picklable state to resume exactly after the last batch produced: the positions of
        the shards this rank reads (every shard with one shard or one data-parallel rank; else
        :func:`merge_states` of every rank's makes the whole state)."""
        return {
            "version": self._STATE_VERSION,
            "stream": self._stream_id,
            "step": self._step,
            "shards": self.shards,
            "positions": {str(s): [stream.doc, stream.offset] for s, stream in self._streams.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (from :meth:`state_dict` or :func:`merge_states`): the next batch
        is the one that followed it."""
        state = _upgraded(state)
        if state["stream"] != self._stream_id:
            raise ConfigError(
                f"data loader state was saved for {state['stream']!r} but this run reads "
                f"{self._stream_id!r}; resume with the same dataset, seed and tokenizer"
            )
        if state["shards"] != self.shards:
            raise ConfigError(
                f"data loader state was saved with training.dataset_shards = {state['shards']}, this run "
                f"has {self.shards}; resume with the same number of shards"
            )
        missing = [s for s in self._streams if str(s) not in state["positions"]]
        if missing:
            raise ConfigError(f"data loader state holds no position of shard {missing[0]}, which this rank reads")
        self._step = int(state["step"])
        for shard, stream in self._streams.items():
            doc, offset = state["positions"][str(shard)]
            stream.seek(int(doc), int(offset))


def _upgraded(state: dict) -> dict:
    """``state`` checked, in the current version's form (version 1: one stream, ``doc`` and ``offset``)."""
    if state.get("version") == 1 and all(k in state for k in ("stream", "step", "doc", "offset")):
        return {**state, "shards": 1, "positions": {"0": [state["doc"], state["offset"]]}}
    missing = [k for k in ("version", "stream", "step", "shards", "positions") if k not in state]
    if missing:
        raise ConfigError(f"data loader state lacks {missing}; it must come from TokenBatchLoader.state_dict()")
    if state["version"] != TokenBatchLoader._STATE_VERSION:
        raise ConfigError(
            f"data loader state has version {state['version']}; this build reads versions 1 and "
            f"{TokenBatchLoader._STATE_VERSION}"
        )
    return state


def merge_states(states: list[dict]) -> dict:
    """One state holding every shard's position, from the ``state_dict()`` of every data-parallel
    rank (ranks that read the same shard stand at the same position of it after every batch)."""
    merged = dict(states[0], positions={})
    for state in states:
        for shard, position in state["positions"].items():
            known = merged["positions"].setdefault(shard, position)
            if known != position:
                raise ValueError(f"ranks disagree on shard {shard}'s position: {known} vs {position}")
    if len(merged["positions"]) != merged["shards"]:
        raise ValueError(f"the states hold {len(merged['positions'])} of {merged['shards']} shards' positions")
    merged["positions"] = dict(sorted(merged["positions"].items(), key=lambda kv: int(kv[0])))
    return merged


def _check_sizes(seq_len: int, local_batch_size: int, dp_rank: int, dp_degree: int, shards: int) -> None:
    for name, value, low in (
        ("training.seq_len", seq_len, 1),
        ("training.local_batch_size", local_batch_size, 1),
        ("dp_degree", dp_degree, 1),
        ("training.dataset_shards", shards, 1),
    ):
        if not isinstance(value, int) or value < low:
            raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
    if not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_degree:
        raise ConfigError(f"dp_rank must be in [0, {dp_degree}), got {dp_rank!r}")
    rows = local_batch_size * dp_degree
    if rows % shards:
        raise ConfigError(
            f"training.dataset_shards = {shards} must divide the sequences of a batch over all data-parallel "
            f"ranks (training.local_batch_size x data-parallel degree = {local_batch_size} x {dp_degree} = {rows})"
        )


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
    subset: str = "",
    streaming: bool = False,
    shards: int = 1,
    setting: str = "training.dataset",
    split_setting: str = "training.dataset_split",
) -> TokenBatchLoader:
    """Build the loader for ``training.dataset`` (or the setting named ``setting``, which errors name,
    as they name the split ``split_setting``).

    ``dataset`` is ``"synthetic"`` (the built-in corpus, a pure function of ``seed``), a local
    ``.json``/``.jsonl``/``.parquet``/``.txt`` file or folder of such files (read with
    ``datasets.load_dataset``; a ``.txt`` document is a blank-line separated paragraph), or a Hugging
    Face hub dataset name, with ``subset`` its configuration (needs network or the HF cache); files
    and hub datasets are read as tables or, with ``streaming``, as streams. Documents come from column
    ``text_field`` in order; the dataset repeats forever. ``seed`` only affects the synthetic corpus
    (with ``dataset_split``: ``synthetic.split_seed``). Rank ``dp_rank`` of ``dp_degree`` gets its
    share of each batch from ``shards`` shards by the rule in the module docstring. Token ids are
    checked to fit the model's ``vocab_size``.
    """
    _check_sizes(seq_len, local_batch_size, dp_rank, dp_degree, shards)
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
    per_shard = local_batch_size * dp_degree // shards
    mine = range(dp_rank * local_batch_size // per_shard, ((dp_rank + 1) * local_batch_size - 1) // per_shard + 1)
    if dataset == "synthetic":
        if subset or streaming:
            raise ConfigError(f"{setting} 'synthetic' is generated: it has no subsets and is not streamed")
        sources = {s: SyntheticDocuments(split_seed(seed, dataset_split), tokenizer, s, shards) for s in mine}
        held_out = "" if dataset_split == "train" else f" split={dataset_split}"
        stream_id = f"synthetic seed={seed}{held_out} tokenizer={tok_id}"
    else:
        where = dict(subset=subset, split=dataset_split, streaming=streaming, text_field=text_field)
        named_as = dict(setting=setting, split_setting=split_setting)
        sources = load_documents(dataset, **where, tokenizer=tokenizer, **named_as, shards=shards, read=mine)
        named = f" subset={subset}" if subset else ""
        stream_id = f"{dataset}{named} split={dataset_split} field={text_field} tokenizer={tok_id}"
    return TokenBatchLoader(
        {s: _PackedStream(source, dataset) for s, source in sources.items()},
        stream_id=stream_id,
        shards=shards,
        seq_len=seq_len,
        local_batch_size=local_batch_size,
        dp_rank=dp_rank,
        dp_degree=dp_degree,
    )
