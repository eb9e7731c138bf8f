"""Hugging Face folders in DeepSeek-V3's FP8 release format (``graph_trainer/checkpoint/hf_folder.py``):
float8_e4m3fn weights with float32 ``weight_scale_inv`` block scales and ``quantization_config`` in
``config.json``, read dequantized per slice; against the same weights dequantized offline, bitwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from graph_trainer.checkpoint.hf_folder import HFFolder
from graph_trainer.errors import ConfigError
from tests.checkpoint.test_hf import _job
from tests.hf_models import deepseek_model, save

BLOCK = (128, 128)
QUANTIZATION = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(BLOCK)}
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


def quantize(w: torch.Tensor, block=BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` as the release stores it: e4m3 values and one float32 scale per block (amax / 448)."""
    rows, cols = w.shape
    scale = torch.empty(-(-rows // block[0]), -(-cols // block[1]))
    fp8 = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            piece = w[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]].float()
            scale[i, j] = piece.abs().amax().clamp(min=1e-12) / E4M3_MAX
            fp8[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]] = (piece / scale[i, j]).to(
                torch.float8_e4m3fn
            )
    return fp8, scale


def dequantize_offline(fp8: torch.Tensor, scale: torch.Tensor, block=BLOCK) -> torch.Tensor:
    """The whole tensor dequantized as DeepSeek's fp8_cast_bf16.py does: fp32 product, one bf16 rounding."""
    full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: fp8.shape[0], : fp8.shape[1]]
    return (fp8.float() * full).to(torch.bfloat16)


def _folder(path: Path, tensors: dict, config: dict) -> Path:
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_each_slice_reads_dequantized_as_the_offline_tensor(tmp_path):
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(0))
    fp8, scale = quantize(w)
    other = torch.randn(5, 3)
    folder = HFFolder(
        str(
            _folder(
                tmp_path / "f",
                {"a.weight": fp8, "a.weight_scale_inv": scale, "b": other},
                {"quantization_config": QUANTIZATION},
            )
        )
    )
    assert folder.shapes == {"a.weight": ([300, 200], torch.bfloat16), "b": ([5, 3], torch.float32)}
    offline = dequantize_offline(fp8, scale)
    for rows, cols in [(slice(None), slice(None)), (slice(100, 300), slice(50, 133)), (slice(7, 8), slice(127, 129))]:
        before = folder.bytes_read
        piece = folder.read("a.weight", (rows, cols))
        assert piece.dtype == torch.bfloat16 and torch.equal(piece, offline[rows, cols])
        r0, r1, _ = rows.indices(300)
        c0, c1, _ = cols.indices(200)
        blocks = (-(-r1 // 128) - r0 // 128) * (-(-c1 // 128) - c0 // 128)
        assert folder.bytes_read - before == (r1 - r0) * (c1 - c0) + 4 * blocks  # fp8 elements + their scales
    assert torch.equal(folder.read("b", (slice(None), slice(None))), other)
    # the quantization is a real one: a few percent from the original weights, not a wrong scale
    assert 1e-3 < ((offline.float() - w).norm() / w.norm()).item() < 0.1


@pytest.mark.parametrize(
    "tensors, config, message",
    [
        (
            {"a.weight": "fp8"},
            {"quantization_config": QUANTIZATION},
            r"FP8 tensor a.weight \[256, 128\] needs 2 dims .* of shape \[2, 1\] .*; found None",
        ),
        ({"b.weight_scale_inv": "scale"}, {"quantization_config": QUANTIZATION}, "scales without an FP8 weight"),
        ({"a.weight": "e5m2"}, {"quantization_config": QUANTIZATION}, "is F8_E5M2; floating-point F32"),
    ],
)
def test_malformed_fp8_folders_are_one_line_config_errors(tmp_path, tensors, config, message):
    """(Without the config's quantization_config: tests/checkpoint/test_hf_folder.py.)"""
    fp8, scale = quantize(torch.randn(256, 128))
    made = {"fp8": fp8, "scale": scale, "e5m2": fp8.float().to(torch.float8_e5m2)}
    with pytest.raises(ConfigError, match=message) as error:
        HFFolder(str(_folder(tmp_path / "f", {n: made[kind] for n, kind in tensors.items()}, config)))
    assert "\n" not in str(error.value)


def _release_folders(tmp_path: Path) -> tuple[Path, Path]:
    """A tiny DeepSeek-V3 folder in the release's FP8 format (every projection weight quantized; the
    embedding, output, norms and router gate in bf16, as released), and the same weights dequantized
    offline into a bf16 folder."""
    source = save(deepseek_model(seed=5), tmp_path / "bf16", dtype=torch.bfloat16)
    tensors = load_file(str(source / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    quantized, offline = {}, {}
    for name, tensor in tensors.items():
        if name.endswith("_proj.weight"):
            fp8, scale = quantize(tensor)
            quantized.update({name: fp8, name + "_scale_inv": scale})
            offline[name] = dequantize_offline(fp8, scale)
        else:
            quantized[name] = offline[name] = tensor
    assert sum(t.dtype == torch.float8_e4m3fn for t in quantized.values()) > 20
    fp8_folder = _folder(tmp_path / "fp8", quantized, {**config, "quantization_config": QUANTIZATION})
    return fp8_folder, _folder(tmp_path / "dequantized", offline, config)


def test_a_release_format_folder_loads_as_its_offline_dequantized_twin(tmp_path):
    from graph_trainer.checkpoint.state import model_tensors
    from graph_trainer.config_loading import load_config
    from graph_trainer.trainer import Trainer

    fp8_folder, dequantized = _release_folders(tmp_path)
    loaded = {}
    for name, folder in (("fp8", fp8_folder), ("dequantized", dequantized)):
        trainer = Trainer(load_config(_job("deepseek", folder, tmp_path / f"job_{name}")))
        loaded[name] = {fqn: t.detach().clone() for fqn, t in model_tensors(trainer.model).items()}
    assert loaded["fp8"].keys() == loaded["dequantized"].keys()
    unequal = [fqn for fqn, t in loaded["fp8"].items() if not torch.equal(t, loaded["dequantized"][fqn])]
    assert not unequal, unequal
