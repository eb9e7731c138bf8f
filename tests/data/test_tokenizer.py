"""Tests of graph_trainer.data.tokenizer: the byte tokenizer, Hugging Face tokenizer files and their special tokens."""

import json

import pytest

from graph_trainer.data.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer
from graph_trainer.errors import ConfigError


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
