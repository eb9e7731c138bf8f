"""Data loader tokens/s per rank at D data-parallel ranks: every rank tokenizing the whole stream
(``training.dataset_shards 1``) vs each its own shard (``dataset_shards D``), table and stream.

    .venv/bin/python -m benchmarks.loader_throughput [--ranks 8] [--docs 4000] [--batches 16] \
        [--seq_len 2048] [--local_batch_size 1]

A local .jsonl corpus of ``--docs`` documents of the synthetic corpus's text and a BPE tokenizer
trained on it (Hugging Face ``tokenizers`` BPE, at most 8192 ids) are written to a temporary folder. For each
setting, the loaders of every rank (the ranks of a job run side by side, one process each) are
built, and each reads ``--batches`` batches, timed alone after a first batch (which opens the
dataset). Printed per setting: the slowest rank's tokens/s (the rate the job's ranks keep up
together), the job's tokens/s (ranks x that), and the ratio to one shard's.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

from graph_trainer.config_loading import take_flag
from graph_trainer.data.loader import build_dataloader
from graph_trainer.data.synthetic import synthetic_document
from graph_trainer.data.tokenizer import build_tokenizer


def _corpus(folder: str, docs: int) -> tuple[str, str]:
    """A .jsonl corpus and a tokenizer.json trained on it; their paths."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    texts = [synthetic_document(0, i) for i in range(docs)]
    data = os.path.join(folder, "corpus.jsonl")
    with open(data, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    special = ["<unk>", "<|begin_of_text|>", "<|end_of_text|>"]
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=8192, special_tokens=special))
    path = os.path.join(folder, "tokenizer.json")
    bpe.save(path)
    return data, path


def _rank_seconds(loader, batches: int) -> float:
    next(loader)  # opens the dataset and fills the first chunk
    start = time.perf_counter()
    for _ in range(batches):
        next(loader)
    return time.perf_counter() - start


def main(argv: list[str]) -> int:
    argv, ranks = take_flag(argv, "--ranks", 8, int)
    argv, docs = take_flag(argv, "--docs", 4000, int)
    argv, batches = take_flag(argv, "--batches", 16, int)
    argv, seq_len = take_flag(argv, "--seq_len", 2048, int)
    argv, local = take_flag(argv, "--local_batch_size", 1, int)
    if argv:
        print(f"unknown arguments {argv}; allowed: --ranks --docs --batches --seq_len --local_batch_size")
        return 2
    import datasets

    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory() as folder:
        datasets.config.HF_DATASETS_CACHE = os.path.join(folder, "hf_cache")
        data, tokenizer_path = _corpus(folder, docs)
        tokenizer = build_tokenizer(tokenizer_path)
        tokens = batches * local * seq_len
        print(
            f"{ranks} ranks, {docs} documents, BPE {tokenizer.vocab_size} ids, {batches} batches of {local} x {seq_len}"
        )
        base = None
        for shards, streaming in ((1, False), (ranks, False), (1, True), (ranks, True)):
            seconds = [
                _rank_seconds(
                    build_dataloader(
                        dataset=data, tokenizer=tokenizer, seq_len=seq_len, local_batch_size=local, dp_rank=r,
                        dp_degree=ranks, seed=0, vocab_size=tokenizer.vocab_size, streaming=streaming, shards=shards,
                    ),
                    batches,
                )
                for r in range(ranks)
            ]  # fmt: skip
            per_rank = tokens / max(seconds)
            base = base or per_rank
            what = f"dataset_shards {shards:>2}, {'stream' if streaming else 'table '}"
            print(
                f"{what}: {per_rank:>11,.0f} tokens/s per rank, {per_rank * ranks:>12,.0f} for the job, "
                f"{per_rank / base:5.2f}x"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
