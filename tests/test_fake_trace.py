"""fake_trace: one CPU process traces layout after layout, each world with its own process groups; the GPU
route traces the fused attention kernels an H100 runs, masked ones included."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from graph_trainer.analysis.cost_model import node_flops
from graph_trainer.build import build_job_model, build_layout
from graph_trainer.config_loading import load_config
from graph_trainer.fake_trace import fake_world, trace_job, trace_without_passes
from graph_trainer.graph.collectives import group_name, is_collective
from graph_trainer.graph.ops import ATTENTION_PREFIX, name_of
from graph_trainer.graph.sizes import value_of
from graph_trainer.torch_compat import resolve_process_group
from models.registry import model_args

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


def _attention_nodes(gm) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function" and name_of(n).startswith(ATTENTION_PREFIX)]


def test_masked_attention_is_traced_as_the_memory_efficient_kernel_over_each_chunks_keys():
    # cp 2 on 4 ranks (dp_shard 2): every block attends its rank's two chunks with a mask; the GPU route
    # traces the kernel an H100 runs for a masked SDPA, never the CPU flash kernel
    seq, cp = 64, 2
    cfg = load_config(["--training.local_batch_size", "1", "--training.seq_len", str(seq), "--parallelism.cp", str(cp)])
    with fake_world(4):
        gm = trace_job(cfg, 4, gpu_attention=True).gm
        names = Counter(name_of(n) for n in _attention_nodes(gm))
        blocks = model_args(cfg).n_layers
        assert names == {
            "_scaled_dot_product_efficient_attention": 2 * blocks,
            "_scaled_dot_product_efficient_attention_backward": 2 * blocks,
        }
        c = seq // (2 * cp)
        forwards = [n for n in _attention_nodes(gm) if not name_of(n).endswith("_backward")]
        # rank 0 holds chunks 0 and 2 cp - 1: their queries read c and 2 cp x c keys
        keys = sorted({value_of(n.args[1]).shape[2] for n in forwards})
        assert keys == [c, 2 * cp * c]
        for n in forwards:
            q, k, bias = (value_of(a) for a in (n.args[0], n.args[1], n.args[3]))
            assert tuple(bias.shape) == (q.shape[0], q.shape[1], q.shape[2], k.shape[2])  # expanded as SDPA does
            b, h, lq, d = q.shape
            # every query x key pair of the chunk's rectangle: the masked kernel skips no tile
            assert node_flops(n)[0] == 2.0 * b * h * lq * k.shape[2] * (2 * d)


def test_a_boolean_mask_becomes_an_additive_bias_in_rows_padded_to_16():
    from torch.fx.experimental.proxy_tensor import make_fx

    from graph_trainer.fake_trace import BIAS_ALIGNMENT, _gpu_attention

    q = torch.randn(2, 4, 8, 16)
    k = v = torch.randn(2, 4, 20, 16)
    mask = torch.ones(8, 20, dtype=torch.bool).tril(12)

    gm = make_fx(lambda q, k, v, m: _gpu_attention(q, k, v, m), tracing_mode="fake")(q, k, v, mask)
    (attention,) = _attention_nodes(gm)
    assert name_of(attention) == "_scaled_dot_product_efficient_attention"
    bias = value_of(attention.args[3])
    assert bias.dtype == q.dtype and tuple(bias.shape) == (2, 4, 8, 20)
    assert bias.stride(-2) == 20 + BIAS_ALIGNMENT - 20 % BIAS_ALIGNMENT  # each row starts on 16 elements
    ops = {name_of(n) for n in gm.graph.nodes if n.op == "call_function"}
    assert {"masked_fill", "constant_pad_nd"} <= ops
    # aligned keys: the bias is a view of the mask, nothing copied
    k32 = torch.randn(2, 4, 32, 16)
    gm = make_fx(lambda q, k, v, m: _gpu_attention(q, k, v, m), tracing_mode="fake")(q, k32, k32, torch.zeros(8, 32))
    assert "constant_pad_nd" not in {name_of(n) for n in gm.graph.nodes if n.op == "call_function"}


def test_fake_world_refuses_a_rank_outside_it():
    with pytest.raises(ValueError, match="rank 4 is not one of the 4 ranks"):
        with fake_world(4, 4):
            pass
