"""Load a Hugging Face folder of LLaMA-3 8B's real dimensions (a few of its layers) with
``checkpoint.initial_load_hf``, on one process and on FSDP=N, and print what each took and read.

    .venv/bin/python -m benchmarks.hf_load OUT [--layers 2] [--nproc 2]

The folder (bf16, 1 GiB files, written to ``OUT/hf``) is made with our own pieces: random weights,
the LLaMA-3 adapter's names and row order (``models/llama3/hf.py``) and
``graph_trainer.checkpoint.hf_folder.write_folder``; so no ``transformers`` here (the logits against
``transformers`` are ``tests/checkpoint/test_hf.py``'s, and the real-size check of this folder
against it, by hand, is in docs/performance.md). Each layout is one ``torchrun tests/hf_probe.py`` job; the
script prints the folder's size, per layout rank 0's load seconds and every rank's bytes read
against its shards, and the ratios: the FSDP load time over the one-process one, and the logits
of FSDP against one process (the same weights: 0 expected).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

import torch

from graph_trainer.checkpoint.hf_folder import write_folder
from models.llama3 import hf
from models.llama3.flavors import FLAVORS
from models.llama3.model import Transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2**30


def write_random_folder(path: str, layers: int) -> int:
    """An 8B-shaped folder of ``layers`` blocks, bf16 random weights; returns its bytes."""
    args = dataclasses.replace(FLAVORS["8B"], n_layers=layers)
    sources = hf.sources(args)
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in Transformer(args).named_parameters()}
    generator = torch.Generator().manual_seed(0)

    def shards():
        shard, size = {}, 0
        for fqn, shape in shapes.items():
            ours = torch.randn(shape, generator=generator).mul_(0.02).to(torch.bfloat16)
            for name, tensor in sources[fqn].to_hf(ours).items():
                if shard and size + tensor.numel() * 2 > GIB:
                    yield shard
                    shard, size = {}, 0
                shard[name], size = tensor, size + tensor.numel() * 2
        yield shard

    write_folder(path, hf.hf_config(args, "bfloat16"), shards())
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def load(out: str, folder: str, layers: int, nproc: int) -> list[dict]:
    probe = os.path.join(out, f"probe_{nproc}")
    os.makedirs(probe, exist_ok=True)
    job = ["--job.config_file", os.path.join(ROOT, "configs", "llama3_8b.toml"), "--model.n_layers", str(layers)]
    job += ["--job.device", "cpu", "--job.dump_folder", os.path.join(probe, "job"), "--compile.mode", "eager"]
    job += ["--activation_checkpoint.mode", "none", "--metrics.enable_tensorboard", "False"]
    job += ["--training.seq_len", "16", "--training.mixed_precision_param", "float32", "--training.loss_chunks", "1"]
    job += ["--parallelism.dp_shard", str(nproc), "--debug.skip_memory_check", "True"]
    job += ["--checkpoint.initial_load_hf", folder]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    cmd += [os.path.join(ROOT, "tests", "hf_probe.py"), probe, os.path.join(out, "tokens.pt"), *job]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, capture_output=True)
    return [json.load(open(os.path.join(probe, f"rank{r}.json"))) for r in range(nproc)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=2)
    a = parser.parse_args()
    os.makedirs(a.out, exist_ok=True)
    folder = os.path.join(a.out, "hf")
    size = write_random_folder(folder, a.layers)
    torch.save(
        torch.randint(0, FLAVORS["8B"].vocab_size, (1, 16), generator=torch.Generator().manual_seed(1)),
        os.path.join(a.out, "tokens.pt"),
    )
    print(f"LLaMA-3 8B dimensions, {a.layers} layers: folder {size / GIB:.2f} GiB of bf16 safetensors")
    results = {}
    for nproc in (1, a.nproc):
        reports = load(a.out, folder, a.layers, nproc)
        results[nproc] = reports
        for rank, r in enumerate(reports):
            read = r["bytes_read"]
            print(
                f"  {nproc} process(es), rank {rank}: load {r['load_seconds']:.2f} s, read {read / GIB:.3f} GiB "
                f"= {read / (2 * r['local_elements']):.3f} x its shards"
            )
    one = torch.load(os.path.join(a.out, "probe_1", "logits.pt"))
    many = torch.load(os.path.join(a.out, f"probe_{a.nproc}", "logits.pt"))
    ratio = results[a.nproc][0]["load_seconds"] / results[1][0]["load_seconds"]
    print(f"ratio: FSDP={a.nproc} load time / one process: {ratio:.2f}")
    print(f"FSDP={a.nproc} logits vs one process: largest difference {(many - one).abs().max().item():.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
