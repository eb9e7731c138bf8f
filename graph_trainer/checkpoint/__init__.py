"""Checkpoints: saving and resuming through DCP (files, manifest, safe metadata, state, the
checkpointer), and Hugging Face weights in and out (docs/checkpoints.md)."""
