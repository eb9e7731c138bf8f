"""How the cost of tracing and of each pass grows with the graph: Llama3-8B at 8, 16 and 32 layers.

    python -m benchmarks.pass_cost [--world_size 8] [--layers 8,16,32] [--passes transformer_block_bucketing]
        [--section.key value ...]

Each size is traced in this one process on the fake process group (Llama3-8B shapes with
``n_layers`` changed; default job: FSDP over all ranks, batch 1x8192, bf16 parameters), then
the default passes and the named passes run one by one. Prints, per size, the graph's nodes,
the trace time and each pass's time, and the time per layer, so a reader can see whether
the growth is linear.
"""

from __future__ import annotations

import dataclasses
import sys
import time

DEFAULT_JOB = [
    "--model.flavor",
    "8B",
    "--training.seq_len",
    "8192",
    "--training.local_batch_size",
    "1",
    "--training.mixed_precision_param",
    "bfloat16",
]


def _take(argv: list[str], flag: str, default: str) -> tuple[str, list[str]]:
    if flag not in argv:
        return default, argv
    i = argv.index(flag)
    return argv[i + 1], argv[:i] + argv[i + 2 :]


def main(argv: list[str]) -> int:
    from graph_trainer.compiler.memory_policy import memory_policy_passes
    from graph_trainer.compiler.passes import PASS_REGISTRY
    from graph_trainer.config_loading import load_config
    from graph_trainer.fake_trace import fake_world, trace_without_passes
    from graph_trainer.validation import validate_config
    from models.registry import MODEL_SPECS

    world_size, argv = _take(argv, "--world_size", "8")
    layers, argv = _take(argv, "--layers", "8,16,32")
    passes, argv = _take(argv, "--passes", "transformer_block_bucketing")
    world_size = int(world_size)
    cfg = load_config([*DEFAULT_JOB, *argv, "--compile.passes", passes])
    validate_config(cfg, world_size)
    base = MODEL_SPECS[cfg.model.name].flavors[cfg.model.flavor]
    rows = []
    for n_layers in (int(n) for n in layers.split(",")):
        args = dataclasses.replace(base, n_layers=n_layers)
        with fake_world(world_size):
            start = time.perf_counter()
            traced, context = trace_without_passes(cfg, world_size, model_args=args)
            row = {"layers": n_layers, "nodes": len(traced.gm.graph.nodes), "trace": time.perf_counter() - start}
            gm = traced.gm
            for spec in [*memory_policy_passes(cfg), *(PASS_REGISTRY[p] for p in cfg.compile.passes)]:
                start = time.perf_counter()
                gm = spec.fn(gm, context)
                row[spec.name] = time.perf_counter() - start
        rows.append(row)
    names = [k for k in rows[0] if k not in ("layers", "nodes")]
    print(
        f"{cfg.model.name} {cfg.model.flavor} shapes, world size {world_size}, batch "
        f"{cfg.training.local_batch_size}x{cfg.training.seq_len}; seconds (and seconds per layer)"
    )
    print("layers  nodes  " + "  ".join(f"{n:>28s}" for n in names))
    for row in rows:
        cells = "  ".join(f"{row[n]:>17.2f} ({row[n] / row['layers']:.3f}/L)" for n in names)
        print(f"{row['layers']:>6d}  {row['nodes']:>5d}  {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
