"""fake_world: one CPU process traces layout after layout, each world with its own process groups."""

from __future__ import annotations

import torch

from graph_trainer.build import build_job_model, build_layout
from graph_trainer.config_loading import load_config
from graph_trainer.fake_trace import fake_world, trace_without_passes
from graph_trainer.graph.collectives import group_name, is_collective
from graph_trainer.torch_compat import resolve_process_group

SMALL = ["--training.local_batch_size", "1", "--training.seq_len", "16"]
HSDP_TP = ["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2", "--parallelism.tp", "2"]


def test_a_later_world_does_not_reuse_an_earlier_worlds_process_groups():
    # DeepSeek-V3 HSDP x TP x EP fills DTensor's sharding caches with meshes of its world (keyed by
    # mesh value); LLaMA-3 HSDP x TP in the next world has equal-looking meshes and must still get
    # collectives on its own, live process groups.
    earlier = load_config(["--job.config_file", "configs/deepseek_v3_debug.toml", *SMALL, *HSDP_TP])
    earlier.parallelism.ep = 2
    with fake_world(8):
        build_job_model(earlier, build_layout(earlier, 8, "cpu"), torch.device("meta"))
    later = load_config([*SMALL, *HSDP_TP])
    with fake_world(8):
        traced, _ = trace_without_passes(later, 8)
        groups = {group_name(n) for n in traced.gm.graph.nodes if is_collective(n)}
        assert groups and all(resolve_process_group(g) is not None for g in groups)
