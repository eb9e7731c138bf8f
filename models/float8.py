"""FP8 training of a model's linears: which ``nn.Linear`` modules compute in float8, and the swap.

``convert_linears(model, settings, tp)`` replaces the chosen linears of a model built on the meta
device, before it is parallelised, with torchao's ``Float8Linear`` under the recipe
``settings.recipe_name`` names (``Float8LinearConfig.from_recipe_name``: dynamic scaling; the
forward, input-gradient and weight-gradient matmuls each cast their two operands to float8 with
scales from their amax and run ``torch._scaled_mm``). A ``Float8Linear`` is an ``nn.Linear``:
the same ``weight`` parameter, FQN and state dict, so tensor parallel, SimpleFSDP, checkpoints
and Hugging Face weights see no difference. The casts and matmuls are aten ops: the tracer
records them in the step's graph (``_scaled_mm`` nodes and the amax/scale/cast chains around
them), and eager mode runs the same ops, so graph == eager bitwise as for every layout.

Which linears (``select_linears``; each decision logged by the caller):

- every ``nn.Linear`` of the model, except
- those whose FQN contains an entry of ``settings.filter_fqns`` (every entry must match one:
  a filter that names nothing is a ``ConfigError``),
- the output projection (``output``) unless ``settings.convert_output``, and a MoE's router
  gate (``moe.router.gate``) unless ``settings.convert_router``: precision-sensitive, kept in the
  parameter dtype, as DeepSeek-V3's FP8 training keeps its output head and gating,
- linears with a dimension that is not a multiple of 16 on every tensor-parallel rank
  (``_scaled_mm``'s requirement: in and out features each a multiple of ``16 * tp``, whichever
  of them tensor parallel splits).

A MoE's routed experts (``settings.convert_routed_experts``, recipe ``rowwise_with_gw_hp``):
``convert_routed_experts`` gives each ``GroupedExperts`` module ``float8_grouped_linear`` as its
matmul. Its forward and input-gradient matmuls cast as a ``Float8Linear`` of that recipe casts
(torchao's ``tensor_to_scale`` and ``to_fp8_saturated``: one scale per token row, per weight row
along the summed dim, rounded down to a power of 2) and run one ``torch._scaled_mm`` per local
expert on its block of rows, inside one op (``graph_trainer::float8_grouped_mm``: the graph sees
one node, whose block sizes are data; a traced per-expert ``_scaled_mm`` would specialise on
them); the weight gradient is each expert's rows' product in high precision. Expert by expert
this is what a ``Float8Linear`` of the recipe computes on that expert's rows (bitwise:
``tests/models/test_float8_experts.py``). Not built: torch's ``_scaled_grouped_mm`` (all experts
in one kernel; no CPU kernel to check it against) and a float8 weight gradient (it sums over each
expert's tokens, which ``_scaled_mm`` takes only in multiples of 16: torchao pads each expert's
rows for it).

Expert parallel's tokens in float8 (``settings.dispatch_in_float8``): ``rows_to_float8_bytes``
casts rows exactly as the experts' forward and input-gradient casts do and packs each row's
float8 values with its scale, ``float8_bytes_to_rows`` turns them back into rows of the
parameter dtype (exactly the float8 values times their scales); expert parallel's dispatcher
(``graph_trainer.distributed.expert_parallel``) sends the packed bytes. A per-row cast commutes
with moving rows, so the experts cast the rows they receive to the float8 values that were sent;
only the weight gradients of their first matmuls (high precision) see the rows as float8 rather
than as they were.

Numerics: float8 rounds both operands of every matmul (e4m3: 3 mantissa bits; the tensorwise
recipe's output gradient e5m2: 2), a relative error of a few percent per product against the
parameter dtype's; how far a training run moves is measured in docs/numerics.md. torchao is
imported here only (and only when a recipe is chosen).

FP8 on the CPU: ATen's CPU ``_scaled_mm`` kernel takes seconds for one 512-cube matmul on some
CPUs and milliseconds on others, so a job, a stored curve or a CI case would pass or time out by
machine. Once float8 is in use (``torchao_float8``, ``check_scaled_mm``) the process computes
``torch._scaled_mm`` on the CPU by its definition instead (``scaled_mm_in_float32``, made the CPU
kernel by ``torch_compat.use_cpu_scaled_mm``): the float8 operands widened to float32, where each
product of two float8 values is exact (at most 8 significant bits, exponents well inside
float32's range), one float32 matmul, the scales applied in float32, one rounding to the output
dtype. Its speed is the machine's float32 matmul rate, and its bits are those of a float32 matmul
of exact products: the same in eager and graph mode (both call the op), on any CPU whose float32
matmul sums in the same order. A GPU's ``_scaled_mm`` forms the same exact products and sums them
in float32 in its own order (with fast accumulation, the forward's in less), so CPU and GPU FP8
differ by accumulation rounding alone (docs/numerics.md, "FP8 linears").

Failure: ``ConfigError`` when torchao is missing, this torch or device has no scaled matmul
(``check_scaled_mm``), or a filter names no linear; the routed experts' settings are checked by
``graph_trainer.validation``.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn as nn

from graph_trainer.config import Float8
from graph_trainer.errors import ConfigError
from graph_trainer.torch_compat import scaled_mm, use_cpu_scaled_mm

OUTPUT_FQN = "output"
"""The output projection (vocabulary logits), kept unless ``convert_output``."""
ROUTER_SUFFIX = "router.gate"
"""A MoE's router gate (``layers.N.moe.router.gate``), kept unless ``convert_router``."""
SCALED_MM_MULTIPLE = 16
"""``_scaled_mm`` needs each matrix dimension to be a multiple of this."""


@dataclass(frozen=True)
class LinearChoice:
    """What happens to one ``nn.Linear``: converted, or kept and why."""

    fqn: str
    converted: bool
    reason: str


def _why_kept(fqn: str, linear: nn.Linear, settings: Float8, tp: int) -> str | None:
    """Why ``linear`` stays in high precision (None: it is converted)."""
    matching = [f for f in settings.filter_fqns if f in fqn]
    if matching:
        return f"float8.filter_fqns ({matching[0]!r})"
    if fqn == OUTPUT_FQN and not settings.convert_output:
        return "the output projection; float8.convert_output converts it"
    if fqn.endswith(ROUTER_SUFFIX) and not settings.convert_router:
        return "the router gate; float8.convert_router converts it"
    multiple = SCALED_MM_MULTIPLE * tp
    if linear.in_features % multiple or linear.out_features % multiple:
        return f"[{linear.out_features}, {linear.in_features}] is not a multiple of {multiple} (16 x tp) in each dim"
    return None


def select_linears(model: nn.Module, settings: Float8, tp: int = 1) -> list[LinearChoice]:
    """The decision for every ``nn.Linear`` of ``model`` (module docstring); raises ``ConfigError``
    when an entry of ``settings.filter_fqns`` matches no linear."""
    linears = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, nn.Linear)]
    unmatched = [f for f in settings.filter_fqns if not any(f in fqn for fqn, _ in linears)]
    if unmatched:
        raise ConfigError(
            f"float8.filter_fqns: {', '.join(map(repr, unmatched))} matches no linear of the model "
            f"(its linears are e.g. {', '.join(fqn for fqn, _ in linears[:4])})"
        )
    choices = []
    for fqn, linear in linears:
        reason = _why_kept(fqn, linear, settings, tp)
        choices.append(LinearChoice(fqn, reason is None, reason or "converted"))
    return choices


_IMPORT_NOISE = ("torchao", "torch.utils._pytree")
"""Loggers that warn while torchao imports on a machine without its compiled kernels (CPU: the
CUDA-only extensions it cannot load) or about its enum registration; none concerns float8
training, and an error line after them would not be the one line a bad config gets."""


def torchao_float8():
    """torchao's float8 training module, or a ConfigError saying how to get it. Its matmuls on the
    CPU are ``scaled_mm_in_float32`` from here on (``use_cpu_scaled_mm``)."""
    use_cpu_scaled_mm(scaled_mm_in_float32)
    loggers = [logging.getLogger(name) for name in _IMPORT_NOISE]
    levels = [log.level for log in loggers]
    try:
        for log in loggers:
            log.setLevel(logging.ERROR)
        import torchao.float8 as ao_float8
    except ImportError as error:
        raise ConfigError(
            f"float8.recipe_name needs torchao's float8 training ({error}); pip install torchao (requirements.txt)"
        ) from None
    finally:
        for log, level in zip(loggers, levels, strict=True):
            log.setLevel(level)
    return ao_float8


WIDE_OUTPUTS = (torch.float32, torch.bfloat16, torch.float16)
"""The output dtypes ``scaled_mm_in_float32`` computes."""


def scaled_mm_in_float32(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
    """``torch._scaled_mm`` on the CPU, by its definition (``use_cpu_scaled_mm`` makes it the CPU
    kernel; module docstring, "FP8 on the CPU"): the float8 operands widened to float32 (exact),
    one float32 matmul, the output times ``scale_a`` then ``scale_b`` (one value, or one per row /
    column) and plus ``bias`` in float32, rounded once to ``out_dtype`` (default: ``a``'s dtype).
    ``use_fast_accum`` changes nothing here (one accumulation). A float8 output (``scale_result``)
    is not computed."""
    out_dtype = out_dtype or a.dtype
    if out_dtype not in WIDE_OUTPUTS or scale_result is not None:
        raise NotImplementedError(
            f"graph_trainer's CPU torch._scaled_mm computes {', '.join(map(str, WIDE_OUTPUTS))} outputs, "
            f"not {out_dtype}{' with scale_result' if scale_result is not None else ''}"
        )
    out = torch.mm(a.to(torch.float32), b.to(torch.float32)).mul_(scale_a).mul_(scale_b)
    if bias is not None:
        out.add_(bias)
    return out.to(out_dtype)


def check_scaled_mm(device: torch.device | str) -> None:
    """Raise ``ConfigError`` unless this torch runs an e4m3 ``_scaled_mm`` on ``device`` (CUDA:
    compute capability 8.9 or newer, e.g. H100; CPU: ``scaled_mm_in_float32``, made the CPU kernel
    here)."""
    device = torch.device(device)
    if device.type == "meta":
        return
    use_cpu_scaled_mm(scaled_mm_in_float32)
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ConfigError(f"float8 needs a GPU with FP8 matmuls (compute capability 8.9+, e.g. H100); {name} has none")
    try:
        a = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
        one = torch.ones((), device=device)
        scaled_mm(a, a.t(), one, one, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError, AttributeError) as error:
        first = str(error).splitlines()[0][:160]
        raise ConfigError(
            f"float8 needs torch._scaled_mm on {device.type}; torch {torch.__version__} refused it: {first}"
        ) from None


def convert_linears(model: nn.Module, settings: Float8, tp: int = 1) -> list[LinearChoice]:
    """Swap the selected linears of ``model`` (on meta, not yet parallelised) for torchao's
    ``Float8Linear`` under ``settings.recipe_name``; returns every linear's decision."""
    if settings.recipe_name == "none":
        return []
    ao_float8 = torchao_float8()
    choices = select_linears(model, settings, tp)
    chosen = {c.fqn for c in choices if c.converted}
    config = ao_float8.Float8LinearConfig.from_recipe_name(settings.recipe_name)
    ao_float8.convert_to_float8_training(model, config=config, module_filter_fn=lambda _m, fqn: fqn in chosen)
    return choices


EXPERTS_RECIPE = "rowwise_with_gw_hp"
"""The recipe the routed experts compute in float8 with (module docstring)."""
EXPERTS_FLOAT8_DTYPE = torch.float8_e4m3fn
"""The float8 dtype of the experts' operands: ``EXPERTS_RECIPE`` casts inputs, weights and output
gradients to e4m3."""


@torch.library.custom_op("graph_trainer::float8_grouped_mm", mutates_args=())
def float8_grouped_mm(
    a: torch.Tensor,
    a_inverse_scale: torch.Tensor,
    b: torch.Tensor,
    b_inverse_scale: torch.Tensor,
    counts: torch.Tensor,
    out_dtype: torch.dtype,
    use_fast_accum: bool,
) -> torch.Tensor:
    """Row block ``e`` of ``a`` [M, K] (its ``counts[e]`` rows, in order) times ``b[e]``ᵀ
    ([E, N, K] float8, row-major per expert), one ``torch._scaled_mm`` each: rowwise scales
    ``a_inverse_scale`` [M, 1] and ``b_inverse_scale`` [E, 1, N] (reciprocals of the cast scales)."""
    sizes = counts.tolist()
    blocks = zip(a.split(sizes), a_inverse_scale.split(sizes), b, b_inverse_scale, strict=True)
    outs = [
        scaled_mm(rows, w.t(), s, sw, out_dtype=out_dtype, use_fast_accum=use_fast_accum) for rows, s, w, sw in blocks
    ]
    return torch.cat(outs) if outs else a.new_empty((0, b.shape[1]), dtype=out_dtype)


@float8_grouped_mm.register_fake
def _(a, a_inverse_scale, b, b_inverse_scale, counts, out_dtype, use_fast_accum):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def _cast_rows(t: torch.Tensor, float8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(``t`` in float8 with one scale per row of its last dim, the inverse scales), as a
    ``Float8Linear`` of ``EXPERTS_RECIPE`` casts (scales rounded down to powers of 2)."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    scale = tensor_to_scale(
        t,
        float8_dtype,
        scaling_granularity=ScalingGranularity.AXISWISE,
        axiswise_dim=-1,
        round_scales_to_power_of_2=True,
    )
    return to_fp8_saturated(t.to(torch.float32) * scale, float8_dtype), scale.reciprocal()


ROW_SCALE_BYTES = 4
"""Bytes of the float32 inverse scale a float8 row carries on a wire (``rows_to_float8_bytes``)."""


def rows_to_float8_bytes(t: torch.Tensor, float8_dtype: torch.dtype) -> torch.Tensor:
    """``t`` [N, D] cast as the routed experts cast their rows (``_cast_rows``), packed for a wire:
    [N, D + 4] bytes, each row's float8 values followed by its float32 inverse scale."""
    t8, inverse = _cast_rows(t, float8_dtype)
    return torch.cat([t8.view(torch.uint8), inverse.view(torch.uint8)], dim=1)


def float8_bytes_to_rows(packed: torch.Tensor, float8_dtype: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """The rows ``rows_to_float8_bytes`` packed, in ``dtype``: each float8 value times its row's
    inverse scale, a power of 2, so the product is exact (bf16 holds every e4m3 value so scaled).
    ``_cast_rows`` of the result gives the same float8 values again, or where a row's largest value
    rounded down to half the float8 range, twice them with half the inverse scale: the same products."""
    d = packed.shape[1] - ROW_SCALE_BYTES
    values = packed[:, :d].view(float8_dtype)
    inverse = packed[:, d:].contiguous().view(torch.float32)
    return (values.to(torch.float32) * inverse).to(dtype)


class _Float8GroupedLinear(torch.autograd.Function):
    """``x`` [M, K] rows sorted by expert, ``w`` [E, N, K], ``counts`` [E] -> each block of rows
    times its expert's ``w[e]``ᵀ (module docstring)."""

    @staticmethod
    def forward(ctx, x, w, counts, float8_dtype, fast_accum):
        ctx.save_for_backward(x, w, counts)
        ctx.float8_dtype, ctx.fast_accum = float8_dtype, fast_accum
        x8, x_inverse = _cast_rows(x, float8_dtype)
        w8, w_inverse = _cast_rows(w, float8_dtype)
        return float8_grouped_mm(x8, x_inverse, w8, w_inverse.transpose(-2, -1), counts, x.dtype, fast_accum[0])

    @staticmethod
    def backward(ctx, grad_out):
        x, w, counts = ctx.saved_tensors
        g8, g_inverse = _cast_rows(grad_out, ctx.float8_dtype)
        wt8, wt_inverse = _cast_rows(w.transpose(-2, -1), ctx.float8_dtype)
        wt8 = wt8.contiguous()  # (row-major per expert: its transpose is the column-major operand)
        grad_x = float8_grouped_mm(
            g8, g_inverse, wt8, wt_inverse.transpose(-2, -1), counts, grad_out.dtype, ctx.fast_accum[1]
        )
        sizes = counts.tolist()
        grad_w = torch.stack([g.t() @ rows for g, rows in zip(grad_out.split(sizes), x.split(sizes), strict=True)])
        return grad_x, grad_w, None, None, None


def float8_grouped_linear(
    x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, float8_dtype: torch.dtype, fast_accum: tuple[bool, bool]
) -> torch.Tensor:
    """Each block of ``x``'s rows (``counts`` per expert) times its expert's ``w[e]``ᵀ, the forward
    and input-gradient matmuls in float8 (module docstring); ``fast_accum``: theirs."""
    return _Float8GroupedLinear.apply(x, w, counts, float8_dtype, fast_accum)


def convert_routed_experts(model: nn.Module) -> int:
    """Give every routed-experts module of ``model`` (a ``float8_matmul`` attribute, None before)
    ``float8_grouped_linear`` under ``EXPERTS_RECIPE``; returns how many modules."""
    ao_float8 = torchao_float8()
    config = ao_float8.Float8LinearConfig.from_recipe_name(EXPERTS_RECIPE)
    fast = (config.gemm_config_output.use_fast_accum, config.gemm_config_grad_input.use_fast_accum)
    matmul = functools.partial(float8_grouped_linear, float8_dtype=EXPERTS_FLOAT8_DTYPE, fast_accum=fast)
    experts = [m for m in model.modules() if hasattr(m, "float8_matmul")]
    for module in experts:
        module.float8_matmul = matmul
    return len(experts)


def summary(choices: list[LinearChoice]) -> str:
    """One log line: how many linears compute in float8, and each kept one with its reason."""
    kept = [c for c in choices if not c.converted]
    converted = len(choices) - len(kept)
    reasons: dict[str, list[str]] = {}
    for c in kept:
        reasons.setdefault(c.reason, []).append(c.fqn)
    parts = [
        f"{len(fqns)} kept ({why}): {', '.join(fqns[:3])}{' ...' if len(fqns) > 3 else ''}"
        for why, fqns in reasons.items()
    ]
    return f"{converted} of {len(choices)} linears compute in float8" + ("; " + "; ".join(parts) if parts else "")


__all__ = [
    "EXPERTS_FLOAT8_DTYPE",
    "EXPERTS_RECIPE",
    "ROW_SCALE_BYTES",
    "LinearChoice",
    "WIDE_OUTPUTS",
    "check_scaled_mm",
    "convert_linears",
    "convert_routed_experts",
    "float8_grouped_linear",
    "float8_bytes_to_rows",
    "float8_grouped_mm",
    "rows_to_float8_bytes",
    "scaled_mm_in_float32",
    "select_linears",
    "summary",
    "torchao_float8",
]
