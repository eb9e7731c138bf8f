"""Tests of graph_trainer.data.loader (and the synthetic corpus): packing, DP sharding, resuming, local files, errors.

The tokenizers' own tests are in tests/data/test_tokenizer.py.
"""

import collections
import json
import math
import pickle
import re

import pytest
import torch

from graph_trainer.data.loader import build_dataloader, merge_states
from graph_trainer.data.synthetic import synthetic_document
from graph_trainer.data.tokenizer import ByteTokenizer, build_tokenizer
from graph_trainer.errors import ConfigError
from tests.data.test_tokenizer import train_word_level

BYTES = ByteTokenizer()


def make_loader(**overrides):
    """A small synthetic loader; keyword arguments override the defaults."""
    args = dict(
        dataset="synthetic",
        tokenizer=BYTES,
        seq_len=32,
        local_batch_size=4,
        dp_rank=0,
        dp_degree=1,
        seed=0,
        vocab_size=258,
    )
    args.update(overrides)
    return build_dataloader(**args)


def take(loader, n):
    """The next ``n`` batches of ``loader`` as a list of (tokens, labels)."""
    return [next(loader) for _ in range(n)]


def window_stream(batches):
    """The token stream the batches were cut from: each row's window is tokens[0] followed by labels."""
    out = []
    for tokens, labels in batches:
        for row in range(tokens.shape[0]):
            out.append(int(tokens[row, 0]))
            out.extend(labels[row].tolist())
    return out


def byte_stream(docs):
    """What the packer must produce for ``docs`` with the byte tokenizer: bos + bytes + eos per doc."""
    out = []
    for doc in docs:
        out += [BYTES.bos_id] + list(doc.encode("utf-8")) + [BYTES.eos_id]
    return out


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """Keep the Arrow cache that datasets.load_dataset writes inside the test's tmp_path."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    return tmp_path


def write_jsonl(path, docs, field="text"):
    with open(path, "w", encoding="utf-8") as f:
        for i, doc in enumerate(docs):
            f.write(json.dumps({field: doc, "id": i}) + "\n")
    return str(path)


DOCS = ["the cat sat on the mat.", "two plus two is four.", "héllo wörld, ünïcode ✓", "a short one"]


# ---------------------------------------------------------------- a Hugging Face tokenizer in the packer


def test_hf_tokenizer_packs_bos_and_eos(hf_cache):
    trained = train_word_level(["the cat sees the dog", "the dog likes the ball"])
    trained.save(str(hf_cache / "tokenizer.json"))
    tok = build_tokenizer(str(hf_cache / "tokenizer.json"))
    docs = ["the cat sees the dog", "the ball"]
    data = write_jsonl(hf_cache / "d.jsonl", docs)
    loader = make_loader(dataset=data, tokenizer=tok, seq_len=5, local_batch_size=2, vocab_size=tok.vocab_size)
    expected = []
    for doc in docs:
        expected += [tok.bos_id] + tok.encode(doc) + [tok.eos_id]
    got = window_stream(take(loader, 3))
    assert got == (expected * 4)[: len(got)]


# ---------------------------------------------------------------- synthetic stream and batches


def test_batches_shape_dtype_and_labels_shifted():
    for tokens, labels in take(make_loader(seq_len=16, local_batch_size=3), 4):
        assert tokens.shape == labels.shape == (3, 16)
        assert tokens.dtype == labels.dtype == torch.int64 and tokens.device.type == "cpu"
        assert torch.equal(tokens[:, 1:], labels[:, :-1])
        assert int(tokens.max()) < 258 and int(tokens.min()) >= 0


def test_deterministic_and_seeded():
    a, b = take(make_loader(seed=3), 5), take(make_loader(seed=3), 5)
    assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b, strict=True))
    c = take(make_loader(seed=4), 5)
    assert not all(torch.equal(x[0], y[0]) for x, y in zip(a, c, strict=True))


def test_synthetic_stream_is_the_packed_documents():
    got = window_stream(take(make_loader(seed=5, seq_len=63), 6))
    docs, expected = [], []
    while len(expected) < len(got):
        expected += byte_stream([synthetic_document(5, len(docs))])
        docs.append(None)
    assert got == expected[: len(got)]


def _entropy_bits(counts):
    total = sum(counts.values())
    return -sum(c / total * math.log2(c / total) for c in counts.values())


def test_synthetic_corpus_has_learnable_structure():
    stream = window_stream(take(make_loader(seq_len=999, local_batch_size=10), 1))
    assert len(stream) == 10_000
    unigram = _entropy_bits(collections.Counter(stream))
    # Uniform noise over the 258 ids would sit at log2(258) ~ 8 bits; the corpus must be far below.
    assert unigram < 0.75 * math.log2(BYTES.vocab_size)
    # For i.i.d. tokens the previous token tells nothing: H(next | previous) would equal the unigram
    # entropy up to a small estimation bias. Sequential structure makes it clearly lower.
    pairs = collections.Counter(zip(stream, stream[1:], strict=False))
    conditional = _entropy_bits(pairs) - _entropy_bits(collections.Counter(stream[:-1]))
    assert conditional < unigram - 0.5
    # The arithmetic facts in the text are true, so they can be learned rather than memorised.
    text = BYTES.decode(stream)
    sums = re.findall(r"(?<!\d)(\d+) plus (\d+) is (\d+)\.", text)
    diffs = re.findall(r"(?<!\d)(\d+) minus (\d+) is (\d+)\.", text)
    assert sums and diffs
    assert all(int(a) + int(b) == int(c) for a, b, c in sums)
    assert all(int(a) - int(b) == int(c) for a, b, c in diffs)


# ---------------------------------------------------------------- data-parallel sharding


def _rank_loaders(degree, batch=3, **kwargs):
    return [make_loader(local_batch_size=batch, dp_rank=r, dp_degree=degree, **kwargs) for r in range(degree)]


def _assert_dp_union(degree, steps, batch=3, **kwargs):
    single = take(make_loader(local_batch_size=batch * degree, **kwargs), steps)
    ranks = [take(loader, steps) for loader in _rank_loaders(degree, batch, **kwargs)]
    for step in range(steps):
        for part in (0, 1):  # tokens, labels
            union = torch.cat([ranks[r][step][part] for r in range(degree)])
            assert torch.equal(union, single[step][part]), f"step {step} differs for dp_degree={degree}"
    # The ranks' shares are disjoint: no rank repeats another's window in the same step.
    assert not torch.equal(ranks[0][0][0], ranks[1][0][0])


@pytest.mark.parametrize("degree", [2, 4])
def test_dp_union_equals_single_process_synthetic(degree):
    _assert_dp_union(degree, steps=3, seed=11)


def test_dp_union_equals_single_process_file_across_epochs(hf_cache):
    _assert_dp_union(2, steps=4, dataset=write_jsonl(hf_cache / "d.jsonl", DOCS), seq_len=10)


@pytest.mark.parametrize(("degree", "shards", "batch"), [(2, 2, 3), (4, 4, 1), (2, 3, 3), (2, 4, 2), (4, 2, 1)])
def test_dp_union_equals_single_process_with_the_same_shards(degree, shards, batch):
    _assert_dp_union(degree, steps=3, batch=batch, seed=11, shards=shards)


@pytest.mark.parametrize("streaming", [False, True])
def test_dp_union_with_shards_file_across_epochs(hf_cache, streaming):
    data = write_jsonl(hf_cache / "d.jsonl", DOCS)
    _assert_dp_union(2, steps=6, dataset=data, seq_len=10, shards=2, streaming=streaming)
    _assert_dp_union(2, steps=6, dataset=data, seq_len=10, shards=3, streaming=streaming)


def test_a_shard_is_every_shards_th_document_packed_alone(hf_cache):
    docs = DOCS + ["fifth", "sixth document"]
    data = write_jsonl(hf_cache / "d.jsonl", docs)
    batches = take(make_loader(dataset=data, seq_len=7, local_batch_size=2, shards=2), 9)
    for row in (0, 1):  # one row per shard and batch
        got = window_stream([(t[row : row + 1], lab[row : row + 1]) for t, lab in batches])
        expected = byte_stream(docs[row::2])
        assert len(got) > len(expected)  # into the shard's second epoch
        assert got == (expected * 2)[: len(got)]


class _Recording(ByteTokenizer):
    """The byte tokenizer, remembering every text it encoded."""

    def __init__(self):
        super().__init__()
        self.texts = []

    def encode(self, text):
        self.texts.append(text)
        return super().encode(text)


@pytest.mark.parametrize("streaming", [False, True])
def test_each_rank_tokenizes_only_its_shards_documents(hf_cache, streaming):
    data = write_jsonl(hf_cache / "d.jsonl", DOCS)
    for shards in (1, 2):
        for rank in (0, 1):
            tokenizer = _Recording()
            loader = make_loader(
                dataset=data, tokenizer=tokenizer, dp_rank=rank, dp_degree=2, shards=shards, streaming=streaming
            )
            take(loader, 3)
            mine = DOCS if shards == 1 else DOCS[rank::2]
            assert set(tokenizer.texts) == set(mine), (shards, rank)


def test_streaming_gives_the_table_s_batches_and_resumes_without_tokenizing_the_skipped(hf_cache):
    data = write_jsonl(hf_cache / "d.jsonl", DOCS)
    args = dict(dataset=data, seq_len=6, local_batch_size=2, tokenizer=_Recording())
    for shards in (1, 2):
        table = take(make_loader(**args, shards=shards), 12)
        stream = make_loader(**args, shards=shards, streaming=True)
        assert all(torch.equal(a[0], b[0]) for a, b in zip(table, take(stream, 12), strict=True))
    # Resume deep in the stream: the documents before the saved one are read again, not tokenized.
    state = stream.state_dict()
    tokenizer = _Recording()
    resumed = make_loader(**{**args, "tokenizer": tokenizer}, shards=2, streaming=True)
    resumed.load_state_dict(state)
    next(resumed)
    assert state["positions"]["0"][0] > 2  # in the second epoch of a shard of two documents
    assert len(tokenizer.texts) <= 2 * 2  # each shard's current document and the next one


# ---------------------------------------------------------------- resuming


def _assert_resumes_exactly(make, stops, total):
    reference = take(make(), total)
    for k in stops:
        loader = make()
        take(loader, k)
        state = pickle.loads(pickle.dumps(loader.state_dict()))
        resumed = make()
        resumed.load_state_dict(state)
        assert resumed.state_dict() == state
        for expected, got in zip(reference[k:], take(resumed, total - k), strict=True):
            assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1]), f"resume after {k}"


def test_resume_synthetic_exactly():
    _assert_resumes_exactly(lambda: make_loader(seed=2), stops=[0, 1, 4], total=7)
    _assert_resumes_exactly(lambda: make_loader(seed=2, dp_rank=1, dp_degree=2), stops=[3], total=6)


def test_resume_file_exactly_across_epoch_boundary(hf_cache):
    data = write_jsonl(hf_cache / "d.jsonl", DOCS)
    epoch_tokens = len(byte_stream(DOCS))
    per_batch = 2 * 9
    total = 2 * epoch_tokens // per_batch + 2  # more than two epochs
    _assert_resumes_exactly(
        lambda: make_loader(dataset=data, seq_len=8, local_batch_size=2), stops=range(total), total=total
    )


@pytest.mark.parametrize("streaming", [False, True])
def test_resume_with_shards_exactly_across_epochs(hf_cache, streaming):
    data = write_jsonl(hf_cache / "d.jsonl", DOCS)
    make = lambda: make_loader(dataset=data, seq_len=8, local_batch_size=2, shards=2, streaming=streaming)  # noqa: E731
    _assert_resumes_exactly(make, stops=[0, 3, 7], total=10)


def test_ranks_states_merge_and_resume_on_another_dp_degree():
    ranks = _rank_loaders(2, batch=2, seed=3, shards=2)
    for loader in ranks:
        take(loader, 3)
    with pytest.raises(ValueError, match="1 of 2 shards"):
        merge_states([ranks[0].state_dict()])
    state = merge_states([loader.state_dict() for loader in ranks])
    expected = [torch.cat(parts) for parts in zip(*[[t for t, _ in take(loader, 2)] for loader in ranks], strict=True)]
    single = make_loader(local_batch_size=4, seed=3, shards=2)  # the same batches on one rank
    single.load_state_dict(json.loads(json.dumps(state)))  # as train_state.json holds it
    assert all(torch.equal(e, t) for e, (t, _) in zip(expected, take(single, 2), strict=True))


def test_a_version_1_state_loads_as_one_shard():
    loader = make_loader(seed=4)
    take(loader, 3)
    state = loader.state_dict()
    old = {"version": 1, "stream": state["stream"], "step": 3, "doc": state["positions"]["0"][0]}
    old["offset"] = state["positions"]["0"][1]
    resumed = make_loader(seed=4)
    resumed.load_state_dict(old)
    assert torch.equal(next(resumed)[0], next(loader)[0])
    with pytest.raises(ConfigError, match="dataset_shards = 1, this run has 2"):
        make_loader(seed=4, shards=2).load_state_dict(old)


def test_state_of_another_stream_is_rejected():
    loader = make_loader(seed=1)
    take(loader, 2)
    with pytest.raises(ConfigError, match="seed=1"):
        make_loader(seed=2).load_state_dict(loader.state_dict())


# ---------------------------------------------------------------- local files


def _write_parquet(path, docs):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), str(path))
    return str(path)


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "txt", "folder"])
def test_local_files_are_packed_in_order_and_repeat(hf_cache, kind):
    if kind in ("jsonl", "json"):
        data = write_jsonl(hf_cache / f"d.{kind}", DOCS)
    elif kind == "parquet":
        data = _write_parquet(hf_cache / "d.parquet", DOCS)
    elif kind == "txt":
        # A .txt document is a paragraph; single newlines stay inside it.
        (hf_cache / "d.txt").write_text("line one\nline two\n\n" + "\n\n".join(DOCS[1:]) + "\n", encoding="utf-8")
        data = str(hf_cache / "d.txt")
    else:
        folder = hf_cache / "folder"
        (folder / "sub").mkdir(parents=True)
        write_jsonl(folder / "a.jsonl", DOCS[:2])
        write_jsonl(folder / "sub" / "b.jsonl", DOCS[2:])
        data = str(folder)
    docs = ["line one\nline two"] + DOCS[1:] if kind == "txt" else DOCS
    got = window_stream(take(make_loader(dataset=data, seq_len=15, local_batch_size=2), 8))
    expected = byte_stream(docs)
    assert len(got) > 2 * len(expected)  # wraps into a third epoch
    assert got == (expected * (len(got) // len(expected) + 1))[: len(got)]


def test_empty_documents_are_skipped_and_all_empty_is_an_error(hf_cache):
    data = write_jsonl(hf_cache / "d.jsonl", ["", "ab", ""])
    got = window_stream(take(make_loader(dataset=data, seq_len=3, local_batch_size=1), 2))
    assert got == (byte_stream(["ab"]) * 2)[: len(got)]
    empty = write_jsonl(hf_cache / "e.jsonl", ["", ""])
    with pytest.raises(ConfigError, match="no tokens"):
        next(make_loader(dataset=empty))


# ---------------------------------------------------------------- user errors


@pytest.mark.parametrize("streaming", [False, True])
def test_an_empty_file_or_folder_is_one_line_naming_it(hf_cache, streaming):
    """datasets fails on an empty JSON file with a bare StopIteration (on a blank text file, with
    its own error): every local file type, empty or blank, is one line naming the setting and path."""
    (hf_cache / "empty").mkdir()
    for name, text in (("e.jsonl", ""), ("e.json", "\n\n"), ("e.txt", ""), ("empty/a.jsonl", " \n")):
        (hf_cache / name).write_text(text)
    for name in ("e.jsonl", "e.json", "e.txt", "empty"):
        path = str(hf_cache / name)
        with pytest.raises(ConfigError) as info:
            make_loader(dataset=path, setting="validation.dataset", streaming=streaming)
        what = "folder holds only empty files" if name == "empty" else "file is empty"
        assert str(info.value) == f"validation.dataset {what}: {path!r} has no rows"


def test_missing_text_field_names_field_and_columns(hf_cache):
    data = write_jsonl(hf_cache / "d.jsonl", DOCS, field="content")
    with pytest.raises(ConfigError, match=r"'text'.*\['content', 'id'\]"):
        make_loader(dataset=data)


def test_missing_dataset_path_names_the_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=re.escape("./nope.jsonl")):
        make_loader(dataset="./nope.jsonl")


def test_every_local_dataset_suffix_has_its_builder():
    from graph_trainer.config_paths import LOCAL_DATASET_SUFFIXES
    from graph_trainer.data.documents import _BUILDERS

    assert sorted(_BUILDERS) == sorted(LOCAL_DATASET_SUFFIXES)


def test_unsupported_file_type(tmp_path):
    (tmp_path / "d.csv").write_text("text\nhello\n")
    with pytest.raises(ConfigError, match="unsupported extension"):
        make_loader(dataset=str(tmp_path / "d.csv"))


def test_vocab_too_small_for_tokenizer():
    with pytest.raises(ConfigError, match="tokenizer has 258 ids but model.flavor vocab_size is 200"):
        make_loader(vocab_size=200)


@pytest.mark.parametrize(
    "bad",
    [
        dict(seq_len=0),
        dict(local_batch_size=0),
        dict(dp_rank=2, dp_degree=2),
        dict(dp_degree=0),
        dict(dataset=""),
        dict(shards=0),
    ],
)
def test_bad_shapes_and_ranks(bad):
    with pytest.raises(ConfigError):
        make_loader(**bad)


def test_shards_must_divide_the_batch_of_all_ranks():
    with pytest.raises(ConfigError, match=r"dataset_shards = 3 must divide.*4 x 2 = 8"):
        make_loader(local_batch_size=4, dp_degree=2, shards=3)


@pytest.mark.parametrize("streaming", [False, True])
def test_too_few_rows_for_the_shards(hf_cache, streaming):
    data = write_jsonl(hf_cache / "d.jsonl", DOCS)
    with pytest.raises(ConfigError, match="4 rows: too few for 8 shards.*at most 4"):
        next(make_loader(dataset=data, local_batch_size=8, shards=8, streaming=streaming))


def test_settings_a_dataset_cannot_take(hf_cache):
    data = write_jsonl(hf_cache / "d.jsonl", DOCS)
    with pytest.raises(ConfigError, match="local path, which has no subsets"):
        make_loader(dataset=data, subset="en")
    with pytest.raises(ConfigError, match="no subsets and is not streamed"):
        make_loader(streaming=True)
    with pytest.raises(ConfigError, match="a slice, which a streamed dataset cannot take"):
        make_loader(dataset=data, streaming=True, dataset_split="train[:50%]")
