"""The data a job reads: the resumable loader, the synthetic corpus, tokenizers."""
