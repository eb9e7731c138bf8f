"""Tests of graph_trainer.data.tokenizer: the byte tokenizer, Hugging Face tokenizer files and their special
tokens, and where the loader's packed documents start (``document_start``, for block_causal attention)."""

import json

import pytest

from graph_trainer.data.loader import build_dataloader
from graph_trainer.data.synthetic import SyntheticDocuments
from graph_trainer.data.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer, document_start
from graph_trainer.errors import ConfigError
from models.sequence import document_ids


def test_byte_tokenizer_round_trip():
    for name in ("", "bytes"):
        tok = build_tokenizer(name)
        assert isinstance(tok, ByteTokenizer)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (258, 256, 257)
    text = "héllo wörld ✓ 12 plus 7 is 19."
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode([tok.bos_id] + ids + [tok.eos_id]) == text


def train_word_level(corpus):
    """A word-level Hugging Face tokenizer trained on ``corpus``, with <s> and </s> as special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=["[UNK]", "<s>", "</s>"]))
    return tok


def test_hf_tokenizer_from_file_and_folder(tmp_path):
    trained = train_word_level(["the cat sees the dog", "the dog likes the ball", "a cat"])
    folder = tmp_path / "tok"
    folder.mkdir()
    trained.save(str(folder / "tokenizer.json"))
    for path in (str(folder / "tokenizer.json"), str(folder)):
        tok = build_tokenizer(path)
        assert isinstance(tok, HFTokenizer)
        assert tok.vocab_size == trained.get_vocab_size()
        assert tok.bos_id == trained.token_to_id("<s>") and tok.eos_id == trained.token_to_id("</s>")
        expected = [trained.token_to_id(w) for w in "the cat likes the ball".split()]
        assert tok.encode("the cat likes the ball") == expected
        assert tok.encode("the zebra")[1] == trained.token_to_id("[UNK]")


def test_hf_tokenizer_config_names_special_tokens(tmp_path):
    trained = train_word_level(["the cat sees the dog"])
    trained.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "eos_token": {"content": "</s>"}}))
    tok = build_tokenizer(str(tmp_path / "tokenizer.json"))
    assert tok.bos_id is None and tok.eos_id == trained.token_to_id("</s>")


def test_missing_tokenizer_path_is_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no_such_tokenizer.json"):
        build_tokenizer(str(tmp_path / "no_such_tokenizer.json"))


def _hf_tokenizer(folder, bos_token, eos_token):
    """A word-level tokenizer whose tokenizer_config.json names ``bos_token`` and ``eos_token`` (or None)."""
    folder.mkdir()
    train_word_level(["the cat sees the dog", "a cat"]).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": bos_token, "eos_token": eos_token}))
    return build_tokenizer(str(folder))


def test_document_start_is_bos_else_eos(tmp_path):
    assert document_start(ByteTokenizer()) == ("bos", 256)
    both = _hf_tokenizer(tmp_path / "both", "<s>", "</s>")
    assert document_start(both) == ("bos", both.bos_id)
    eos_only = _hf_tokenizer(tmp_path / "eos", None, "</s>")
    assert eos_only.bos_id is None and document_start(eos_only) == ("eos", eos_only.eos_id)
    neither = _hf_tokenizer(tmp_path / "neither", None, None)
    with pytest.raises(ConfigError, match="block_causal needs a tokenizer with a BOS or an EOS token"):
        document_start(neither)


@pytest.mark.parametrize("kind", ["bos", "eos"])
def test_document_start_tells_the_loaders_packed_documents_apart(tmp_path, kind):
    """The loader's windows of the synthetic corpus, through ``document_ids`` at the tokenizer's
    ``document_start``: each token's document, counted from the window's first (which may start
    mid-document), as the corpus's documents' lengths place them in the packed stream."""
    tok = ByteTokenizer() if kind == "bos" else _hf_tokenizer(tmp_path / "eos", None, "</s>")
    seq_len, rows, batches = 16, 4, 20
    loader = build_dataloader(
        dataset="synthetic", tokenizer=tok, seq_len=seq_len, local_batch_size=rows, dp_rank=0, dp_degree=1, seed=3,
        vocab_size=tok.vocab_size,
    )  # fmt: skip
    corpus, owner = SyntheticDocuments(3, tok), []
    for doc in range(1000):
        owner += [doc] * len(corpus.tokens(doc))
        if len(owner) > batches * rows * (seq_len + 1):
            break
    crossing = 0
    for b in range(batches):
        tokens, _ = next(loader)
        got = document_ids(tokens, document_start(tok))
        for r in range(rows):
            at = (b * rows + r) * (seq_len + 1)  # the row's window in the stream
            assert got[r].tolist() == [o - owner[at] for o in owner[at : at + seq_len]], (b, r)
        crossing += int((got[:, -1] > 0).sum())
    assert crossing >= 2  # windows that hold the start of another document
