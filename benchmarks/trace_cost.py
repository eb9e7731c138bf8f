"""Cost of tracing a (possibly real-size) flavor on the meta/fake path, in one CPU process.

    python -m benchmarks.trace_cost --model.flavor 8B --training.seq_len 8192 [--training.local_batch_size 1]

The model is built on the meta device and traced under fake tensors: no parameter or
activation memory is ever allocated. Prints trace time, node count, collectives by type and
the process's peak RSS.
"""

from __future__ import annotations

import resource
import sys
import time

import torch


def main(argv: list[str]) -> int:
    from graph_trainer.compiler.tracer import trace_train_step
    from graph_trainer.config_loading import load_config
    from graph_trainer.graph.collectives import collective_counts, format_counts
    from graph_trainer.validation import validate_config
    from models.registry import MODEL_SPECS

    cfg = load_config(argv)
    validate_config(cfg)
    spec = MODEL_SPECS[cfg.model.name]
    args = spec.flavors[cfg.model.flavor]
    start = time.perf_counter()
    with torch.device("meta"):
        model = spec.build(args)
    built = time.perf_counter() - start
    shape = (cfg.training.local_batch_size, cfg.training.seq_len)
    tokens = torch.empty(shape, dtype=torch.long, device="meta")
    labels = torch.empty(shape, dtype=torch.long, device="meta")
    traced = trace_train_step(model, tokens, labels, fake_device=torch.device("cpu"))
    peak_rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{cfg.model.name} {cfg.model.flavor}: {n_params:,} parameters, batch {shape[0]}x{shape[1]}")
    print(
        f"build on meta: {built:.2f}s, trace: {traced.trace_seconds:.2f}s, "
        f"nodes: {len(traced.gm.graph.nodes):,}, collectives: {format_counts(collective_counts(traced.gm.graph))}"
    )
    print(f"peak RSS: {peak_rss_gib:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
