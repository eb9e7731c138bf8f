"""A checkpoint back to a Hugging Face folder that ``transformers`` loads.

    python -m graph_trainer.cli.export_hf --checkpoint DIR --step N --out HF_DIR [--dtype bfloat16] [--max_shard_gb 5]
        [--tokenizer TOKENIZER_DIR] [--config_from HF_DIR]

``DIR`` is the job's checkpoint folder (``<dump_folder>/<checkpoint.folder>``, holding ``step-<N>``).
The checkpoint is verified against its manifest, then written one shard at a time
(``graph_trainer.checkpoint.hf.export_hf``): ``config.json``, ``model-0000K-of-0000N.safetensors``
and ``model.safetensors.index.json``. ``--dtype`` is the weights' dtype in the folder: ``float32``
(default: our master weights exactly) or ``bfloat16`` (half the size, as published checkpoints).
``--tokenizer`` copies a folder's ``tokenizer.json`` (and ``tokenizer_config.json``,
``special_tokens_map.json``) beside the weights, e.g. the folder the job was fine-tuned from.
``--config_from`` keeps that folder's ``config.json`` fields that do not describe the architecture
(``bos_token_id``, ``eos_token_id``, generation settings, ...) in the exported ``config.json``; the
folder must describe the checkpoint's model (a folder of another one is refused), and a float8
release's ``quantization_config`` is left out (the export's weights are not quantized).
A mistake (no such checkpoint, an existing ``--out``, an unknown option) is one line and exit 2.
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from graph_trainer.checkpoint.hf import export_hf
from graph_trainer.errors import ConfigError, OneLineError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit 2, as every other mistake
        usage = " ".join(self.format_usage().split()).removeprefix("usage: ")
        raise ConfigError(f"{message} (usage: {usage})")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m graph_trainer.cli.export_hf", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="the checkpoint folder holding step-<N>")
    parser.add_argument("--step", required=True, type=int, help="which step-<N> to export")
    parser.add_argument("--out", required=True, help="the Hugging Face folder to create (must not exist)")
    parser.add_argument("--dtype", default="float32", choices=sorted(_DTYPES), help="dtype of the exported weights")
    parser.add_argument("--max_shard_gb", default=5.0, type=float, help="largest safetensors file, GiB")
    parser.add_argument("--tokenizer", default="", help="a folder whose tokenizer files to copy beside the weights")
    parser.add_argument(
        "--config_from", default="", help="a Hugging Face folder of this model whose other config.json fields to keep"
    )
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        args = parser.parse_args(argv)
        if args.max_shard_gb <= 0:
            raise ConfigError(f"--max_shard_gb {args.max_shard_gb} must be > 0")
        max_shard_bytes = int(args.max_shard_gb * 2**30)
        files = export_hf(
            args.checkpoint, args.step, args.out, _DTYPES[args.dtype], max_shard_bytes, args.tokenizer, args.config_from
        )
    except OneLineError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    print(f"wrote {args.out}: config.json, model.safetensors.index.json and {len(files)} safetensors files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
