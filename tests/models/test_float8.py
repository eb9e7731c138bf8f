"""FP8 linears (models/float8.py): which linears convert and why the others stay, the swap to
torchao's Float8Linear (same parameters and names), its math against torchao's on the same
inputs, the scaled-matmul check of this machine, and the CPU's scaled matmul by its definition."""

import dataclasses

import pytest
import torch
import torch.nn as nn

from graph_trainer.config import Float8
from graph_trainer.config_loading import load_config
from graph_trainer.errors import ConfigError
from models import float8
from models.registry import MODEL_SPECS, model_args

TENSORWISE = Float8(recipe_name="tensorwise")


def _meta_model(name: str, n_layers: int = 2) -> nn.Module:
    cfg = load_config(["--model.name", name, "--model.n_layers", str(n_layers)])
    with torch.device("meta"):
        return MODEL_SPECS[name].build(model_args(cfg))


def _choices(model, settings=TENSORWISE, tp=1) -> dict[str, str]:
    return {c.fqn: c.reason for c in float8.select_linears(model, settings, tp)}


def test_every_linear_converts_but_the_output_projection_by_default():
    choices = _choices(_meta_model("llama3"))
    assert choices.pop("output").startswith("the output projection")
    assert len(choices) == 2 * 7 and set(choices.values()) == {"converted"}
    assert (
        _choices(_meta_model("llama3"), dataclasses.replace(TENSORWISE, convert_output=True))["output"] == "converted"
    )


def test_deepseek_keeps_its_router_gate_unless_asked_and_the_dims_decide_then():
    choices = _choices(_meta_model("deepseek_v3"))
    assert choices["layers.1.moe.router.gate"].startswith("the router gate")
    asked = _choices(_meta_model("deepseek_v3"), dataclasses.replace(TENSORWISE, convert_router=True))
    # the debug model routes over 8 experts: a gate of 8 outputs is not a multiple of 16
    assert "is not a multiple of 16" in asked["layers.1.moe.router.gate"]
    assert choices["layers.0.attention.wkv_a"] == asked["layers.0.attention.wkv_a"] == "converted"


def test_filters_keep_the_linears_they_name_and_must_name_one():
    settings = dataclasses.replace(TENSORWISE, filter_fqns=["attention.wo", "w2"])
    choices = _choices(_meta_model("llama3"), settings)
    assert choices["layers.1.attention.wo"] == "float8.filter_fqns ('attention.wo')"
    assert choices["layers.0.feed_forward.w2"] == "float8.filter_fqns ('w2')"
    assert choices["layers.0.feed_forward.w1"] == "converted"
    with pytest.raises(ConfigError, match="float8.filter_fqns: 'attention.wz' matches no linear of the model"):
        float8.select_linears(_meta_model("llama3"), dataclasses.replace(TENSORWISE, filter_fqns=["attention.wz"]))


def test_tensor_parallel_degree_sets_the_multiple_each_dim_needs():
    # debug LLaMA-3: dim 256, ffn 768; under tp 32 a rank's slice of 256 is 8, not a multiple of 16
    choices = _choices(_meta_model("llama3"), tp=32)
    assert choices["layers.0.feed_forward.w1"] == "[768, 256] is not a multiple of 512 (16 x tp) in each dim"
    assert _choices(_meta_model("llama3"), tp=16)["layers.0.feed_forward.w1"] == "converted"


def test_conversion_swaps_in_torchao_linears_with_the_same_parameters():
    from torchao.float8.float8_linear import Float8Linear

    model = _meta_model("llama3")
    names = [n for n, _ in model.named_parameters()]
    choices = float8.convert_linears(model, TENSORWISE)
    assert [n for n, _ in model.named_parameters()] == names
    converted = {fqn for fqn, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert converted == {c.fqn for c in choices if c.converted} and "output" not in converted
    assert float8.summary(choices).startswith("14 of 15 linears compute in float8; 1 kept (the output projection")
    assert float8.convert_linears(model, Float8()) == []  # recipe 'none': nothing to do


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_a_converted_linear_is_torchaos_float8_linear_on_the_same_inputs(recipe):
    """The swap changes no math: our converted linear and torchao's own conversion of the same
    linear give bitwise the same output and gradients; and float8 moves the product by e4m3's
    rounding only (against the fp32 linear: a few percent, not a wrong scale)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(64, 32, bias=False))
    ours, theirs = (nn.Sequential(nn.Linear(64, 32, bias=False)) for _ in range(2))
    for m in (ours, theirs):
        m.load_state_dict(reference.state_dict())
    float8.convert_linears(ours, Float8(recipe_name=recipe))
    convert_to_float8_training(theirs, config=Float8LinearConfig.from_recipe_name(recipe))
    x = torch.randn(16, 64)
    outputs = []
    for m in (ours, theirs, reference):
        xi = x.clone().requires_grad_(True)
        y = m(xi)
        y.square().sum().backward()
        outputs.append((y.detach(), xi.grad, m[0].weight.grad))
    for a, b in zip(outputs[0], outputs[1], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(outputs[0], outputs[2], strict=True):
        assert 1e-3 < ((a - b).norm() / b.norm()).item() < 0.1


def test_this_cpu_runs_scaled_matmuls():
    float8.check_scaled_mm("cpu")  # torch 2.13's CPU build implements e4m3 _scaled_mm
    float8.check_scaled_mm("meta")  # traced jobs (analyze, the dry run) need no device


def test_a_machine_without_scaled_matmuls_is_refused_with_one_line(monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("_scaled_mm is not implemented for this backend\nmore detail")

    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    with pytest.raises(
        ConfigError, match=r"float8 needs torch._scaled_mm on cpu; .* refused it: _scaled_mm is not"
    ) as e:
        float8.check_scaled_mm("cpu")
    assert "\n" not in str(e.value)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ConfigError, match=r"compute capability 8.9\+, e.g. H100\); NVIDIA A100 has none"):
        float8.check_scaled_mm("cuda")


def _float8(values, dtype=torch.float8_e4m3fn) -> torch.Tensor:
    """``values`` as float8, each exactly representable (checked)."""
    t = torch.tensor(values, dtype=torch.float32)
    assert torch.equal(t.to(dtype).float(), t)
    return t.to(dtype)


def test_the_cpu_scaled_mm_is_its_definition_widened_to_float32():
    # e4m3's largest and smallest magnitudes (448, 2^-9) and an e5m2 operand (57344, 2^-16):
    # every product exact in float32, the sums of integers exact, so the result is known exactly
    a = _float8([[448.0, 2**-9, -3.0], [1.0, -448.0, 0.5]])
    b = _float8([[2**-9, 448.0], [448.0, 2**-9], [-2.0, 0.0]]).t().contiguous().t()  # column-major
    g = _float8([[57344.0, 2**-16, 1.5], [-1.0, 0.0, 3.0]], torch.float8_e5m2)
    exact = torch.tensor(a.double().numpy() @ b.double().numpy())
    assert exact[0, 0].item() == 448 * 2**-9 + 2**-9 * 448 + 6  # (no float32 sum rounds here)
    sa, sb = torch.tensor([[0.75], [3.0]]), torch.tensor([[1.25, 0.1]])
    bias = torch.tensor([0.5, -1.0], dtype=torch.bfloat16)
    out = float8.scaled_mm_in_float32(a, b, sa, sb, bias=bias, out_dtype=torch.bfloat16)
    expected = (exact.float() * sa * sb + bias.float()).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    one = torch.tensor(1.0)
    gb = float8.scaled_mm_in_float32(g, b, one, one, out_dtype=torch.float32)
    assert torch.equal(gb, torch.tensor(g.double().numpy() @ b.double().numpy()).float())
    with pytest.raises(NotImplementedError, match="not torch.float8_e4m3fn"):
        float8.scaled_mm_in_float32(a, b, one, one)  # float8 output (a's dtype) is not computed


def test_float8_in_use_makes_every_cpu_scaled_mm_the_definition():
    float8.torchao_float8()
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 32, generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(48, 32, generator=g).to(torch.float8_e4m3fn).t()
    sa, sb = torch.rand(64, 1, generator=g), torch.rand(1, 48, generator=g)
    # (float32 out: ATen's own CPU kernel rounds these otherwise, so only ours gives these bits)
    expected = float8.scaled_mm_in_float32(a, b, sa, sb, out_dtype=torch.float32)
    assert torch.equal(torch._scaled_mm(a, b, sa, sb, out_dtype=torch.float32), expected)
    out = torch.empty(0)
    torch._scaled_mm(a, b, sa, sb, out_dtype=torch.float32, out=out)
    assert torch.equal(out, expected)
