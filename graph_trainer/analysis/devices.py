"""Device models: the throughputs, link bandwidths and kernel efficiencies the cost model uses.

A ``DeviceModel`` is one accelerator and its interconnect (SI units). ``KernelEfficiency`` says
which fraction of the roofline each class of kernel reaches (``cost_model.kernel_class`` sorts a
node into its class). ``H100_SXM`` is calibrated per kernel class on torch.profiler tables of one
H100 (the comments at ``H100_KERNELS`` say from which ops; the runs are in docs/performance.md,
the tables in docs/h100_profiles/); ``H200_SXM`` is the H100 with the H200's memory bandwidth;
``H100_HBM2E_500W`` is the H100 of torchtitan's published Llama 3.1 benchmark (96 GB HBM2e at
2.4 TB/s, a 500 W power limit); ``CPU_2CORE`` is a rough model for sanity checks.
``DEVICES`` names them for the command lines (``analyze``, ``metrics.simulate_device``) and the
passes (``auto_bucketing`` always decides for the H100).

The attention kernel is software, not hardware: ``ATTENTION_KERNELS`` holds the rates of cuDNN's
fused attention (the calibrated ``H100_KERNELS`` ones), FlashAttention-2 and FlashAttention-3 on
the H100, and ``with_attention(device, name)`` is ``device`` running that kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class KernelEfficiency:
    """Fraction of the roofline one class of kernels reaches (``kernel_class`` names the class).

    Compute classes (matmuls, attention) scale the FLOP side of the roofline; memory classes
    scale the byte side. The memory side of a compute class uses ``elementwise``.
    """

    matmul: float
    """Dense GEMMs (mm, addmm, bmm, baddbmm), of the dtype's peak FLOP/s."""
    grouped_mm: float
    """``_grouped_mm`` (MoE experts), of the dtype's peak FLOP/s."""
    scaled_mm_tensorwise: float
    """fp8 ``_scaled_mm`` with one scale per operand, of the fp8 peak (twice bf16's)."""
    scaled_mm_rowwise: float
    """fp8 ``_scaled_mm`` with a scale per row / column, of the fp8 peak."""
    attention_forward: float
    """Fused SDPA forward kernels, of peak FLOP/s for the counted attention FLOPs."""
    attention_backward: float
    """Fused SDPA backward kernels (counted as 2.5x the forward FLOPs), of peak FLOP/s."""
    elementwise: float
    """Elementwise and copy kernels whose operands are contiguous and of the output's size."""
    strided: float
    """Elementwise kernels with a broadcast or non-contiguous operand, and cat / stack."""
    dtype_cast: float
    """Copies that change the dtype (``_to_copy`` bf16 <-> fp32)."""
    reduction: float
    """Sums, means, norms and other reductions."""
    softmax_forward: float
    """(log_)softmax forward over rows (the loss over the vocabulary)."""
    softmax_backward: float
    """(log_)softmax backward."""
    scatter_add: float
    """Accumulating scatters (index_add, scatter_add, index_put with accumulate): atomics."""


@dataclass(frozen=True)
class DeviceModel:
    """Throughputs and fixed costs of one accelerator and its interconnect (SI units)."""

    name: str
    peak_flops_bf16: float
    """Dense tensor-core FLOP/s for bf16/fp16 matmuls (fp8 counts twice this)."""
    peak_flops_fp32: float
    """FLOP/s for fp32 matmuls (and any dtype other than bf16/fp16/fp8)."""
    hbm_bandwidth: float
    """Device memory bytes/s: the roofline for memory-bound kernels."""
    intra_node_bandwidth: float
    """Bytes/s per direction per rank on links inside a node (NVLink)."""
    inter_node_bandwidth: float
    """Bytes/s per direction per rank between nodes (one NIC per GPU)."""
    collective_latency: float
    """Fixed seconds per collective (launch, synchronisation, ring start-up)."""
    flops_efficiency: float
    """Fraction of peak FLOP/s that real kernels achieve (when ``kernel_efficiency`` is None)."""
    bandwidth_efficiency: float
    """Fraction of peak link bandwidth that collectives achieve, and of memory bandwidth that
    kernels achieve when ``kernel_efficiency`` is None."""
    launch_overhead: float
    """Seconds added to every compute kernel (launch gap and tail effects)."""
    kernel_efficiency: KernelEfficiency | None = None
    """Per kernel class fractions of the roofline (see ``kernel_class``); None: the two global ones."""
    fused_attention: bool = False
    """The device runs attention as a fused GPU kernel: graphs simulated for it are traced with
    ``fake_trace``'s ``gpu_attention`` (a CPU trace would hold the math fallback's S x S scores)."""

    def peak_flops(self, dtype: torch.dtype) -> float:
        if dtype in (torch.bfloat16, torch.float16):
            return self.peak_flops_bf16
        if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            return 2 * self.peak_flops_bf16
        return self.peak_flops_fp32


@dataclass(frozen=True)
class AttentionKernel:
    """Rates of one fused attention implementation, as ``KernelEfficiency``'s attention fields."""

    name: str
    forward: float
    """Forward FLOP/s over the device's peak (``KernelEfficiency.attention_forward``)."""
    backward: float
    """Backward FLOP/s over the device's peak (``KernelEfficiency.attention_backward``)."""


# Calibration of H100_SXM's kernels (the runs are in docs/performance.md, the two
# torch.profiler tables in docs/h100_profiles/: llama3 8B shape x 4 layers at 1 x 8192 and
# deepseek_v3 16B shape x 4 layers at 2 x 4096, pure bf16, traced graph, 2 steady steps).
# Each profiled aten op (name + input shapes) was matched to the nodes of the same graph
# traced here (``fake_trace``: ``param_dtype=bfloat16, gpu_attention=True``); a class's
# efficiency is sum(roofline time at 100%) / sum(profiled CUDA time) over its matched ops,
# pooled over both profiles (rows mixing two kernel classes, e.g. pow(x, 1.0) running as a
# copy_, are left out). Per profile (8B / 16B) and what the pool covers:
H100_KERNELS = KernelEfficiency(
    # mm: 0.776 / 0.803 over 110 ms of mm (87 + 96 calls per step); single shapes 0.63-0.84.
    matmul=0.78,
    # _grouped_mm (MoE experts, 64 groups of ~768 rows): 0.52-0.59, 16B only, 13.9 ms.
    grouped_mm=0.56,
    # fp8 _scaled_mm: no H100 profile. Measured on one H200 (the H100's compute, NVIDIA's
    # datasheets) by benchmarks/fp8_matmul_rate.py (docs/performance.md, "FP8 against bf16
    # matmuls"): over the Llama3-8B and 405B/TP8 linears' three matmuls as torchao runs them
    # (forward with fast accumulation, both gradients without), the fp8 rate is 0.948
    # (tensorwise) and 0.894 (rowwise) of twice the bf16 rate of the same matmuls measured
    # beside them; applied to the in-step bf16 matmul efficiency above (0.78). The routed
    # experts' smaller shapes measured 0.72 / 0.71: not applied (their grouped matmuls stay bf16).
    scaled_mm_tensorwise=0.74,
    scaled_mm_rowwise=0.70,
    # cuDNN flash attention (sm90), causal, FLOPs as counted by ``_attention_flops``:
    # forward 0.611 (8B, d=128, S=8192) / 0.533 (16B, d_qk=192, d_v=128, S=4096).
    attention_forward=0.59,
    # backward (2.5x the forward FLOPs): 0.442 / 0.384.
    attention_backward=0.43,
    # Contiguous pointwise kernels, fills, gathers (add, mul, silu(_backward), nll_loss_backward's
    # zero-fill, embedding_dense_backward; 16B: index_copy at 0.56): 0.922 / 0.865, 20 ms.
    elementwise=0.90,
    # Broadcast or strided operands (RMSNorm scale by rsqrt / by weight, RoPE on strided
    # halves, stack/cat interleaving): 0.488 / 0.493, 17 ms; single ops range 0.29-0.70.
    strided=0.49,
    # bf16 <-> fp32 _to_copy (RMSNorm upcasts, logits to fp32 and back): 0.695 / 0.710, 12.5 ms.
    dtype_cast=0.70,
    # sums over rows/columns (norm-weight gradients, MoE combine): 0.588 / 0.699, 2.4 ms.
    reduction=0.66,
    # cunn_SoftMaxForward on (tokens, vocab) fp32: 0.452 / 0.452 (it reads its input twice).
    softmax_forward=0.45,
    # cunn_SoftMaxBackward: 0.659 / 0.662.
    softmax_backward=0.66,
    # index_add of 49152 bf16 rows into 8192 (MoE combine, atomics): 0.094 (16B, 2.6 ms).
    scatter_add=0.094,
)

H100_SXM = DeviceModel(
    name="H100 SXM",
    peak_flops_bf16=989e12,
    # fp32 matmuls at PyTorch's default (torch.backends.cuda.matmul.allow_tf32 = False) run on
    # the non-tensor-core FP32 units: 67 TFLOP/s. With TF32 enabled it would be 494e12.
    # No fp32 profile exists: fp32 kernels take the bf16-derived class efficiencies, which the
    # measured fp32 step time checks in aggregate (tests/analysis/test_calibration.py).
    peak_flops_fp32=67e12,
    hbm_bandwidth=3.35e12,
    intra_node_bandwidth=450e9,  # NVLink 4, 900 GB/s bidirectional, 8 GPUs per node
    inter_node_bandwidth=50e9,  # 400 Gb/s InfiniBand NIC per GPU
    collective_latency=15e-6,
    flops_efficiency=0.7,  # unused for kernels (kernel_efficiency is set)
    bandwidth_efficiency=0.8,  # links only (collectives); not re-calibrated here
    # GPU time per step not spent in any kernel, per kernel launched: (step time from tok/s -
    # profiled CUDA time) / launches, 8B: (204.45 - 203.36 ms) / ~1140 (1048 cudaLaunchKernel
    # + 95 cuBLAS/cuDNN), 16B: (148.68 - 141.01 ms) / ~1720; pooled 8.8 ms / 2860 = 3.1 us.
    # Per profile 1.0 / 4.5 us: the 16B step has host-bound stretches (GPU idle) that the
    # simulator does not model; the tables have no timeline to locate them.
    launch_overhead=3.1e-6,
    kernel_efficiency=H100_KERNELS,
    fused_attention=True,
)

H200_SXM = replace(
    H100_SXM,
    name="H200 SXM",
    # The same GH100 compute (NVIDIA's H200 datasheet: 989 TFLOP/s dense bf16, NVLink 4 at 900
    # GB/s) with HBM3e at 4.8 TB/s (datasheet) instead of 3.35: the H100's kernel efficiencies
    # are kept. Checked on one H200 against the one-GPU table's measured forward/backward
    # (docs/performance.md, the one-GPU table on an H200); its 141 GB are not in DEVICE_MEMORY_BYTES.
    hbm_bandwidth=4.8e12,
)

CPU_2CORE = DeviceModel(
    # Rough, for sanity checks only: measured once on the 2-core AMD EPYC dev machine with
    # 1024^3 matmuls, a 128 MiB elementwise op and gloo over loopback.
    name="CPU 2-core",
    peak_flops_bf16=200e9,
    peak_flops_fp32=80e9,
    hbm_bandwidth=6e9,
    intra_node_bandwidth=1e9,
    inter_node_bandwidth=1e9,
    collective_latency=100e-6,
    flops_efficiency=1.0,
    bandwidth_efficiency=1.0,
    launch_overhead=10e-6,
)

H100_HBM2E_500W = replace(
    H100_SXM,
    name="H100 96GB HBM2e, 500 W",
    # torchtitan's benchmarks/llama3_h100_202412_torchtitan.md ("Hardware"): Grand Teton hosts of
    # 8 H100s "fully connected with NVLink", each "equipped with 96GB HBM2e with 2.4 TB/sec peak
    # memory bandwidth", "backend RDMA network with 400 Gb/s per GPU" (H100_SXM's 50e9 B/s
    # inter-node), "the default 500W power limit". NVLink and NIC are kept from H100_SXM.
    hbm_bandwidth=2.4e12,
    # Peak tensor-core rate: no published bf16 matmul rate of an H100 at a 500 W limit exists (the
    # power-capping study of an HBM2e H100, arXiv 2604.11391, caps 200-700 W, reports fp64 DGEMM).
    # torchtitan's footnote places the card's peak "between SXM and NVL" ("we don't know its exact
    # value"). NVIDIA's H100 datasheet gives two operating points of the same GH100 tensor cores:
    # SXM 989 TFLOP/s dense bf16 at up to 700 W, NVL 835 (1,671 with sparsity) at 350-400 W.
    # Interpolated linearly in the power limit between them (NVL at its 400 W end):
    # 835 + (989 - 835) * (500 - 400) / (700 - 400) = 886 TFLOP/s, and fp32 scaled alike. The kernel
    # efficiencies stay those calibrated on a 700 W H100 80GB HBM3 (fractions of the peak).
    peak_flops_bf16=886e12,
    peak_flops_fp32=67e12 * 886 / 989,
)

# Measured on the 989 TFLOP/s H100 SXM5 and kept as fractions of a device's peak: on the 500 W
# card, whose peak is lower, each kernel runs at the same fraction of that lower peak.
# FLOPs are counted as ``cost_model._attention_flops`` counts them and as the FlashAttention
# papers do (causal: half of 4*B*H*S*S*D; backward 2.5x the forward).
ATTENTION_KERNELS: dict[str, AttentionKernel] = {
    # cuDNN fused attention (sm90): H100_KERNELS' calibrated rates (its comments say from which profiles).
    "cudnn": AttentionKernel("cuDNN", forward=H100_KERNELS.attention_forward, backward=H100_KERNELS.attention_backward),
    # FlashAttention-2 (PyTorch's SDPA flash backend is FA2), and FlashAttention-3: the FA3 paper
    # (Shah et al., arXiv 2407.08608v2), H100 80GB SXM5, bf16, head dim 128, at sequence length 8k
    # (the 8B rows' 8192): forward with causal mask (Fig. 5) FA2 333, FA3 602 TFLOP/s; backward
    # (Fig. 6, published without causal mask only) FA2 318, FA3 559 TFLOP/s; over 989 TFLOP/s.
    # (cuDNN in the same figures: 529 forward, 518 backward; the 1k-16k range of FA2 forward is
    # 260-335, of FA3 423-616.)
    "fa2": AttentionKernel("FlashAttention-2", forward=333 / 989, backward=318 / 989),
    "fa3": AttentionKernel("FlashAttention-3", forward=602 / 989, backward=559 / 989),
}


def with_attention(device: DeviceModel, kernel: str) -> DeviceModel:
    """``device`` running its fused attention with ``ATTENTION_KERNELS[kernel]``'s rates (its name
    says which); raises ``ValueError`` for an unknown kernel or a device without fused attention."""
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; choose from {', '.join(ATTENTION_KERNELS)}")
    if device.kernel_efficiency is None or not device.fused_attention:
        raise ValueError(f"{device.name} runs no fused attention kernel: it has no attention kernel to choose")
    rates = ATTENTION_KERNELS[kernel]
    return replace(
        device,
        name=f"{device.name}, {rates.name} attention",
        kernel_efficiency=replace(
            device.kernel_efficiency, attention_forward=rates.forward, attention_backward=rates.backward
        ),
    )


DEVICES: dict[str, DeviceModel] = {
    "h100": H100_SXM,
    "h200": H200_SXM,
    "h100_hbm2e_500w": H100_HBM2E_500W,
    "cpu": CPU_2CORE,
}


__all__ = [
    "ATTENTION_KERNELS",
    "CPU_2CORE",
    "DEVICES",
    "H100_HBM2E_500W",
    "H100_KERNELS",
    "H100_SXM",
    "H200_SXM",
    "AttentionKernel",
    "DeviceModel",
    "KernelEfficiency",
    "with_attention",
]
