"""FP8 weight all-gather (graph_trainer/distributed/float8_gather.py): which weights it casts, the
shards' cast against torchao's cast of the whole weight and SimpleFSDP's float8 gather of fp32
master shards under bf16 parameters against torchao's cast of its bf16 gather (2 gloo ranks,
bitwise), the traced graph's gathers (float8 bytes, half of bf16's), and the configurations it refuses. (The run
itself, bitwise the run gathering in bf16: the cpu suite's ``float8_*_float8_all_gather`` cases.)"""

from __future__ import annotations

import functools
import os
import sys

import pytest
import torch
import torch.nn as nn

from graph_trainer.config_loading import load_config
from graph_trainer.distributed.float8_gather import weight_cast
from graph_trainer.errors import ConfigError
from graph_trainer.fake_trace import fake_world, trace_job
from graph_trainer.graph import tags
from graph_trainer.graph.collectives import collective_name, is_collective
from graph_trainer.validation import validate_config
from models.float8 import torchao_float8
from tests.launch import run_forked

TENSORWISE = ["--float8.recipe_name", "tensorwise"]
FLOAT8_ALL_GATHER = [*TENSORWISE, "--float8.enable_fsdp_float8_all_gather"]
BF16 = ["--training.mixed_precision_param", "bfloat16", "--training.local_batch_size", "1", "--training.seq_len", "16"]


def _linear(recipe: str) -> nn.Module:
    torchao_float8()  # torchao's import, its warnings silenced
    from torchao.float8.config import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    config = Float8LinearConfig.from_recipe_name(recipe)
    return Float8Linear.from_float(nn.Linear(32, 16, bias=False), config=config)


def test_only_tensorwise_float8_linears_have_a_weight_cast():
    cast = weight_cast(_linear("tensorwise"))
    assert cast is not None and cast.float8_dtype == torch.float8_e4m3fn and not cast.round_scales_to_power_of_2
    assert weight_cast(_linear("rowwise")) is None  # one scale per row: no shard holds a row's cast alone
    assert weight_cast(nn.Linear(32, 16)) is None


@functools.cache
def _gathers(float8_all_gather: bool) -> dict[str, tuple[torch.dtype, int]]:
    """Each parameter's forward all-gather on FSDP4 with bf16 parameters: (dtype, elements)."""
    cfg = load_config([*BF16, *(FLOAT8_ALL_GATHER if float8_all_gather else TENSORWISE)])
    with fake_world(4):
        gm = trace_job(cfg, 4).gm
    out, amax = {}, []
    for n in gm.graph.nodes:
        if is_collective(n) and tags.get(n, "fsdp_role") == "unshard":
            if collective_name(n) == "all_reduce":
                amax.append((tags.phase(n), tags.get(n, "fsdp_param"), n.meta["val"].numel()))
            elif tags.phase(n) == "forward":
                out[tags.get(n, "fsdp_param")] = (n.meta["val"].dtype, n.meta["val"].numel())
    out["amax all-reduces"] = amax
    return out


def test_float8_linears_gather_one_byte_per_element():
    plain, float8 = _gathers(False), _gathers(True)
    assert plain.pop("amax all-reduces") == []
    amax = float8.pop("amax all-reduces")
    linears = {p for p in plain if ".attention.w" in p or ".feed_forward.w" in p}
    assert len(linears) == 6 * 7 and plain.keys() == float8.keys()
    for param, (dtype, numel) in plain.items():
        assert dtype == torch.bfloat16
        assert float8[param] == ((torch.uint8, numel) if param in linears else (dtype, numel)), param
    # one all-reduce (max) of one scalar per weight, in forward only: backward re-gathers with its scale
    assert sorted(amax) == sorted(("forward", p, 1) for p in linears)


def _validate(*args: str, world_size: int = 4) -> str:
    with pytest.raises(ConfigError) as info:
        validate_config(load_config(list(args)), world_size=world_size)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_refused_where_there_is_no_float8_gather_to_make():
    flag = "--float8.enable_fsdp_float8_all_gather"
    assert "needs float8.recipe_name 'tensorwise' (it is 'none')" in _validate(flag)
    assert "(it is 'rowwise')" in _validate("--float8.recipe_name", "rowwise", flag)
    ddp = ["--parallelism.dp_replicate", "4", "--parallelism.dp_shard", "1"]
    assert "needs parallelism.dp_shard > 1 (it is 1" in _validate(*FLOAT8_ALL_GATHER, *ddp)
    per_step = ["--parallelism.fsdp_collectives", "per_step"]
    assert "set parallelism.fsdp_collectives = 'per_microbatch'" in _validate(*FLOAT8_ALL_GATHER, *per_step)
    pipeline = _validate(*FLOAT8_ALL_GATHER, "--parallelism.pp", "2", "--parallelism.pp_microbatches", "2")
    assert "the default under pp > 1" in pipeline
    validate_config(load_config(FLOAT8_ALL_GATHER), world_size=4)  # FSDP4: accepted


CHECKS = ("shard_cast", "master_gather")
"""The reports each rank of ``_cast_worker`` writes ("same", or what differs)."""


@pytest.fixture(scope="module")
def cast_reports(tmp_path_factory) -> dict[str, list[str]]:
    """Every rank's report of each check of one 2-rank launch of ``_cast_worker``."""
    folder = tmp_path_factory.mktemp("float8_cast")
    run_forked(2, os.path.abspath(__file__), str(folder))
    return {check: [(folder / f"{check}{rank}.txt").read_text() for rank in range(2)] for check in CHECKS}


def test_shards_cast_with_the_global_amax_are_the_cast_of_the_whole_weight(cast_reports):
    assert cast_reports["shard_cast"] == ["same"] * 2, cast_reports["shard_cast"]


def test_the_float8_gather_of_fp32_master_shards_is_the_cast_of_the_gathered_bf16_weight(cast_reports):
    """With bf16 parameters the linear casts the gathered bf16 weight, so the scale is that of the
    bf16 values: a shard's amax taken before its cast to bf16 (the fp32 master's) is another scale."""
    assert cast_reports["master_gather"] == ["same"] * 2, cast_reports["master_gather"]


def _report(folder: str, check: str, rank: int, data: torch.Tensor, scale: torch.Tensor, expected) -> None:
    """``check``'s report: "same" when ``data`` (float8) and ``scale`` are bitwise ``expected``'s."""
    same_data = torch.equal(data.view(torch.uint8), expected._data.view(torch.uint8))
    same_scale = torch.equal(scale, expected._scale)
    report = "same" if same_data and same_scale else f"DIFFER (scale {scale.item()} vs {expected._scale.item()})"
    with open(os.path.join(folder, f"{check}{rank}.txt"), "w") as f:
        f.write(report)


def _cast_worker(folder: str) -> None:
    """Under a 2-rank launcher, FSDP over both ranks, with a weight whose largest element lives on
    rank 1: ``shard_cast``: each rank casts its half of a bf16 weight, and the gathered float8
    bytes and the scale must be torchao's cast of the whole; ``master_gather``: SimpleFSDP's float8
    gather of an fp32 master weight under bf16 parameters must hand the linear what torchao's cast
    of SimpleFSDP's bf16 gather of it is (what the linear computes without the float8 gather)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic

    from graph_trainer.distributed.float8_gather import cast_shard
    from graph_trainer.distributed.simple_fsdp import MixedPrecision, ReplicateComputation
    from graph_trainer.torch_compat import cpu_backend

    dist.init_process_group(cpu_backend())
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    linear = _linear("tensorwise")
    assert isinstance(linear, Float8Linear)
    cast = weight_cast(linear)

    def torchao_cast(weight: torch.Tensor):
        return hp_tensor_to_float8_dynamic(weight, torch.float8_e4m3fn, linear.linear_mm_config)

    torch.manual_seed(0)
    master = torch.randn(64, 32)
    master[40, 3] = 37.01  # rank 1's half; not a bf16 number (bf16 rounds it to 37.0), so the amaxes differ
    whole = master.to(torch.bfloat16)
    data, scale = cast_shard(whole.chunk(2)[rank], cast, mesh, (Shard(0),))
    gathered = [torch.empty_like(data.view(torch.uint8)) for _ in range(2)]
    dist.all_gather(gathered, data.view(torch.uint8).contiguous())
    _report(folder, "shard_cast", rank, torch.cat(gathered), scale, torchao_cast(whole))

    param = DTensor.from_local(master.chunk(2)[rank], mesh, [Shard(0)], run_check=False)
    bf16 = MixedPrecision(param_dtype=torch.bfloat16)
    in_bf16 = ReplicateComputation("weight", 1, None, (), bf16).gather(param)
    in_float8 = ReplicateComputation("weight", 1, None, (), MixedPrecision(torch.bfloat16, float8_all_gather=True))
    in_float8.float8 = cast
    weight = in_float8.gather(param)
    assert in_bf16.dtype == torch.bfloat16 and weight._orig_dtype == torch.bfloat16
    _report(folder, "master_gather", rank, weight._data, weight._scale, torchao_cast(in_bf16))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    _cast_worker(sys.argv[1])
