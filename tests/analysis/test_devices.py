"""graph_trainer.analysis.devices: the device models by name and the attention kernel choice."""

import dataclasses

import pytest
import torch
import torch.fx as fx

from graph_trainer.analysis.cost_model import node_compute_time, node_flops
from graph_trainer.analysis.devices import (
    ATTENTION_KERNELS,
    CPU_2CORE,
    DEVICES,
    H100_HBM2E_500W,
    H100_KERNELS,
    H100_SXM,
    H200_SXM,
    with_attention,
)

aten = torch.ops.aten


def _sdpa_nodes(b=1, h=32, s=8192, d=128):
    """A causal fused-attention forward and its backward at the Llama3-8B shape (meta tensors)."""
    g = fx.Graph()

    def placeholder(name, *shape, dtype=torch.bfloat16):
        node = g.placeholder(name)
        node.meta["val"] = torch.empty(*shape, dtype=dtype, device="meta")
        return node

    def call(target, args, val):
        node = g.call_function(target, args)
        node.meta["val"] = val
        return node

    q, k, v, grad, out = (placeholder(n, b, h, s, d) for n in ("q", "k", "v", "grad", "out"))
    lse = placeholder("lse", b, h, s, dtype=torch.float32)
    meta = torch.empty(b, h, s, d, dtype=torch.bfloat16, device="meta")
    fwd = call(aten._scaled_dot_product_flash_attention_for_cpu.default, (q, k, v, 0.0, True), (meta, lse.meta["val"]))
    bwd = call(
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        (grad, q, k, v, out, lse, 0.0, True),
        (meta,) * 3,
    )
    return fwd, bwd


def test_devices_by_name_and_the_calibrated_models_kept():
    assert DEVICES == {"h100": H100_SXM, "h200": H200_SXM, "h100_hbm2e_500w": H100_HBM2E_500W, "cpu": CPU_2CORE}
    assert (H100_SXM.peak_flops_bf16, H100_SXM.hbm_bandwidth, H100_SXM.kernel_efficiency) == (
        989e12,
        3.35e12,
        H100_KERNELS,
    )
    assert (H200_SXM.hbm_bandwidth, H200_SXM.kernel_efficiency) == (4.8e12, H100_KERNELS)


def test_the_published_runs_h100_differs_from_the_sxm_in_its_memory_bandwidth_and_peak():
    assert H100_HBM2E_500W.name == "H100 96GB HBM2e, 500 W"
    assert H100_HBM2E_500W.hbm_bandwidth == 2.4e12  # torchtitan's benchmark file
    assert H100_HBM2E_500W.inter_node_bandwidth == 400e9 / 8  # 400 Gb/s per GPU
    # between the NVL's 835 TFLOP/s (400 W) and the SXM's 989 (700 W), linear in the power limit
    assert H100_HBM2E_500W.peak_flops_bf16 == pytest.approx(
        835e12 + (989e12 - 835e12) * (500 - 400) / (700 - 400), rel=1e-3
    )
    ratio = H100_HBM2E_500W.peak_flops_bf16 / H100_SXM.peak_flops_bf16
    assert H100_HBM2E_500W.peak_flops_fp32 == pytest.approx(H100_SXM.peak_flops_fp32 * ratio)
    same = {f.name for f in dataclasses.fields(H100_SXM)} - {
        "name",
        "hbm_bandwidth",
        "peak_flops_bf16",
        "peak_flops_fp32",
    }
    assert all(getattr(H100_HBM2E_500W, f) == getattr(H100_SXM, f) for f in same)


def test_cudnn_rates_are_the_calibrated_ones_and_fa3_beats_fa2():
    cudnn, fa2, fa3 = (ATTENTION_KERNELS[k] for k in ("cudnn", "fa2", "fa3"))
    assert (cudnn.forward, cudnn.backward) == (H100_KERNELS.attention_forward, H100_KERNELS.attention_backward)
    assert fa2.forward < fa3.forward and fa2.backward < fa3.backward
    assert all(0 < r.forward < 1 and 0 < r.backward < 1 for r in ATTENTION_KERNELS.values())


@pytest.mark.parametrize("device_name", ["h100", "h200", "h100_hbm2e_500w"])
@pytest.mark.parametrize("kernel", ["cudnn", "fa2", "fa3"])
def test_with_attention_changes_only_the_attention_rates(device_name, kernel):
    device = DEVICES[device_name]
    chosen = with_attention(device, kernel)
    rates = ATTENTION_KERNELS[kernel]
    assert chosen.name == f"{device.name}, {rates.name} attention"
    assert (chosen.kernel_efficiency.attention_forward, chosen.kernel_efficiency.attention_backward) == (
        rates.forward,
        rates.backward,
    )
    assert dataclasses.replace(chosen.kernel_efficiency, attention_forward=0, attention_backward=0) == (
        dataclasses.replace(device.kernel_efficiency, attention_forward=0, attention_backward=0)
    )
    assert dataclasses.replace(chosen, name="", kernel_efficiency=None) == dataclasses.replace(
        device, name="", kernel_efficiency=None
    )


def test_attention_time_follows_the_chosen_kernel():
    fwd, bwd = _sdpa_nodes()
    for node, field in ((fwd, "forward"), (bwd, "backward")):
        flops = node_flops(node)[0]
        for kernel, rates in ATTENTION_KERNELS.items():
            device = with_attention(H100_SXM, kernel)
            seconds = node_compute_time(node, device) - device.launch_overhead
            assert seconds == pytest.approx(flops / (989e12 * getattr(rates, field))), (kernel, field)
    fa2, fa3 = with_attention(H100_SXM, "fa2"), with_attention(H100_SXM, "fa3")
    assert node_compute_time(fwd, fa2) > node_compute_time(fwd, fa3)


def test_with_attention_refuses_unknown_kernels_and_devices_without_fused_attention():
    with pytest.raises(ValueError, match="unknown attention kernel 'fa4'; choose from cudnn, fa2, fa3"):
        with_attention(H100_SXM, "fa4")
    with pytest.raises(ValueError, match="CPU 2-core runs no fused attention kernel"):
        with_attention(CPU_2CORE, "fa2")
