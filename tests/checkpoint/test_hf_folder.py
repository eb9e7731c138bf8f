"""A Hugging Face folder (graph_trainer/checkpoint/hf_folder.py): slices read and counted, bad folders
one ConfigError each before any tensor is read, and a written folder whole or absent."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from graph_trainer.checkpoint.hf_folder import HFFolder, write_folder
from graph_trainer.errors import ConfigError, JobError


def _folder(tmp_path, tensors_per_file: list[dict[str, torch.Tensor]], index: bool = True):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    weight_map = {}
    for k, tensors in enumerate(tensors_per_file):
        name = f"model-{k}.safetensors"
        save_file(tensors, str(tmp_path / name))
        weight_map.update({n: name for n in tensors})
    if index:
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return tmp_path


def test_folder_reads_slices_and_counts_their_bytes(tmp_path):
    a = torch.arange(24.0).view(4, 6).to(torch.bfloat16)
    folder = HFFolder(str(_folder(tmp_path, [{"a": a}, {"b": torch.ones(3)}])))
    assert folder.shapes == {"a": ([4, 6], torch.bfloat16), "b": ([3], torch.float32)}
    assert torch.equal(folder.read("a", (slice(1, 3), slice(2, 4))), a[1:3, 2:4])
    assert folder.bytes_read == 4 * 2
    folder.read("b", (slice(0, 3),))
    assert folder.bytes_read == 8 + 12


@pytest.mark.parametrize("case", ["no_config", "index_mismatch", "duplicate", "integer_tensor", "no_weights"])
def test_bad_folder_is_one_config_error(tmp_path, case):
    one = {"a": torch.ones(2)}
    if case == "no_config":
        folder = _folder(tmp_path, [one])
        (folder / "config.json").unlink()
        match = "Hugging Face config .*config.json does not exist"
    elif case == "index_mismatch":
        folder = _folder(tmp_path, [one, {"b": torch.ones(2)}])
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-1.safetensors"}}))
        match = "does not match the files: not in the file it names: a"
    elif case == "duplicate":
        folder = _folder(tmp_path, [one, one], index=False)
        match = "tensor a is in both model-0.safetensors and model-1.safetensors"
    elif case == "integer_tensor":
        folder = _folder(tmp_path, [{"a": torch.ones(2, dtype=torch.int8)}])
        match = "tensor a of model-0.safetensors is I8; floating-point F32, .* and F8_E4M3 weights with block scales"
    else:
        folder = _folder(tmp_path, [])
        (folder / "model.safetensors.index.json").unlink()
        match = "holds no \\*.safetensors file"
    with pytest.raises(ConfigError, match=match):
        HFFolder(str(folder))


def test_write_folder_is_whole_or_absent(tmp_path):
    shards = [{"a": torch.ones(2)}, {"b": torch.zeros(3)}]
    files = write_folder(str(tmp_path / "out"), {"model_type": "llama"}, iter(shards))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index == {"metadata": {"total_size": 20}, "weight_map": {"a": files[0], "b": files[1]}}
    with pytest.raises(ConfigError, match="already exists"):
        write_folder(str(tmp_path / "out"), {}, iter(shards))

    def failing():
        yield shards[0]
        raise OSError(28, "No space left on device", "shard")

    with pytest.raises(JobError, match="No space left on device"):
        write_folder(str(tmp_path / "out2"), {}, failing())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no half-written folder, no temporary


def test_fp8_tensors_without_the_configs_quantization_are_refused_before_any_is_read(tmp_path):
    """(The FP8 release format itself: tests/checkpoint/test_hf_fp8.py.)"""
    fp8 = {"w": torch.ones(4, 4).to(torch.float8_e4m3fn), "w_scale_inv": torch.ones(1, 1)}
    folder = _folder(tmp_path, [fp8])
    with pytest.raises(ConfigError, match="holds F8_E4M3 tensors but its config.json has no fp8 quantization_config"):
        HFFolder(str(folder))
