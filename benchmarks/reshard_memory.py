"""What reshard-after-forward buys: all-gathers and estimated peak memory, on and off.

    python -m benchmarks.reshard_memory --world_size 8 [--section.key value ...]
    python -m benchmarks.reshard_memory --world_size 8 --model.flavor 8B --training.seq_len 8192 \
        --training.local_batch_size 1 --training.mixed_precision_param bfloat16

Traces the job three times in this one process on the fake process group (no real memory, no
communication), with ``parallelism.fsdp_reshard_after_forward`` never, default and always, and prints
the collectives of each graph and the peak memory ``graph_trainer.analysis.memory`` estimates
for one rank (the graph's own peak, and the step's with parameters, gradients and AdamW state),
with their difference from never (the optimizer state is the same in every mode).
"""

from __future__ import annotations

import sys

GIB = float(1 << 30)


def main(argv: list[str]) -> int:
    from graph_trainer.analysis.memory import estimate_peak_memory, estimate_step_memory
    from graph_trainer.config_loading import load_config, take_flag
    from graph_trainer.fake_trace import fake_world, trace_job
    from graph_trainer.graph.collectives import collective_counts, format_counts
    from graph_trainer.validation import validate_config

    argv, world_size = take_flag(argv, "--world_size", 8, int)
    results = {}
    for mode in ("never", "default", "always"):
        cfg = load_config([*argv, "--parallelism.fsdp_reshard_after_forward", mode])
        validate_config(cfg, world_size)
        with fake_world(world_size):
            traced = trace_job(cfg, world_size)
        graph = traced.gm.graph
        results[mode] = (
            collective_counts(graph),
            estimate_peak_memory(graph),
            estimate_step_memory(graph, None, cfg.training),
        )
    t = cfg.training
    print(
        f"{cfg.model.name} {cfg.model.flavor}, world size {world_size}, per-rank batch "
        f"{t.local_batch_size}x{t.seq_len}, param dtype {t.mixed_precision_param}"
    )
    for mode, (counts, mem, step) in results.items():
        print(f"reshard_after_forward={mode:6s}: {format_counts(counts)}")
        print(
            f"    graph's estimated peak {mem.peak_bytes / GIB:.2f} GiB (inputs {mem.input_bytes / GIB:.2f} GiB, "
            f"at node {mem.peak_node})"
        )
        print(f"    step: {step.summary()}")
    never = results["never"][1].peak_bytes
    for mode in ("default", "always"):
        peak = results[mode][1].peak_bytes
        print(f"peak {mode} - never: {(peak - never) / GIB:+.2f} GiB; {mode}/never: {peak / never:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
