"""FP8 against bf16 matmul rates on one GPU, at the shapes of our flavors' linears.

    python3 -m benchmarks.fp8_matmul_rate OUT [--smoke] [--iters N]

For each linear shape (tokens M, in features K, out features N) it times the three matmuls a
training step runs (forward x @ W^T, input gradient dy @ W, weight gradient dy^T @ x) in bf16
(``torch.mm``) and in float8_e4m3fn through ``torch._scaled_mm`` with tensorwise scales (one
fp32 scalar per operand) and rowwise scales (one per row of the left operand, one per column of
the right), each with and without fast accumulation, bf16 output, and the relative error of
each product against the fp32 product of the same bf16 operands (a wrong scale shows there).
Operands are laid out as the kernel wants them (left row-major, right column-major) before timing: the transposed copies
and the casts a float8 linear also runs are timed apart, as the cast row (amax of a bf16
activation, scale, clamp and cast to e4m3: the memory-bound work per operand). The routed
experts' grouped matmul is timed in bf16 (``torch._grouped_mm``) and rowwise fp8
(``torch._scaled_grouped_mm``) where this torch has them.

Each figure is the median of ``--iters`` calls after warm-up, timed with CUDA events (on the
CPU with ``--smoke``: the same code at sizes cut 64x, timed by the wall clock, to check the
script; CPU times mean nothing here). A case the device or torch refuses is recorded with its
error, not skipped silently. Writes OUT/fp8_matmul_rate.json and OUT/fp8_matmul_rate.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max

# (name, tokens M, in features K, out features N): the 8B's linears at 8192 tokens, the 405B's
# under TP8 (column-parallel out / row-parallel in features divided by 8), DeepSeek-V3-671B's
# routed expert (dim 7168, expert hidden 2048) at 2048 tokens per expert.
LINEARS = [
    ("llama3_8b.wq", 8192, 4096, 4096),
    ("llama3_8b.wk", 8192, 4096, 1024),
    ("llama3_8b.w1", 8192, 4096, 14336),
    ("llama3_8b.w2", 8192, 14336, 4096),
    ("llama3_405b_tp8.wq", 8192, 16384, 2048),
    ("llama3_405b_tp8.w1", 8192, 16384, 6656),
    ("llama3_405b_tp8.w2", 8192, 6656, 16384),
    ("deepseek_v3_671b.expert_w1", 2048, 7168, 2048),
    ("deepseek_v3_671b.expert_w2", 2048, 2048, 7168),
]
# (name, groups, tokens per group, K, N): 8 local experts of the 671B at EP32.
GROUPED = [
    ("deepseek_v3_671b.experts_w1", 8, 2048, 7168, 2048),
    ("deepseek_v3_671b.experts_w2", 8, 2048, 2048, 7168),
]
SMOKE_DIVISOR = 64


def shrink(size: int, smoke: bool) -> int:
    """The size itself, or under --smoke cut 64x and kept a multiple of 16 (scaled_mm's rule)."""
    return max(16, size // SMOKE_DIVISOR // 16 * 16) if smoke else size


def timer(device: torch.device, iters: int) -> Callable[[Callable[[], object]], float]:
    """A function timing a call: median seconds over ``iters`` after 3 warm-up calls."""

    def measure(call: Callable[[], object]) -> float:
        for _ in range(3):
            call()
        times = []
        for _ in range(iters):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                call()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                begin = time.perf_counter()
                call()
                times.append(time.perf_counter() - begin)
        return statistics.median(times)

    return measure


def to_e4m3(x: torch.Tensor, dim: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x cast to e4m3 with its scale: one for the tensor (dim None) or one per slice along dim.

    Returns (fp8 tensor, inverse scale) as ``_scaled_mm`` takes it: x ~= fp8 * inverse scale.
    """
    amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    scale = E4M3_MAX / amax.float().clamp(min=1e-12)
    return (x.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale.reciprocal()


def gemm_operands(m: int, k: int, n: int, device: torch.device) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The (left, right) bf16 operands of a linear's three matmuls, laid out for the kernel."""
    gen = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=torch.bfloat16)

    x, w, dy = randn(m, k), randn(n, k) * 0.02, randn(m, n)
    return {
        "forward": (x, w.t()),  # [M,K] @ [K,N], right column-major
        "input_grad": (dy, w.t().contiguous().t()),  # [M,N] @ [N,K]
        "weight_grad": (dy.t().contiguous(), x.t().contiguous().t()),  # [N,M] @ [M,K]
    }


def scaled_call(a: torch.Tensor, b: torch.Tensor, rowwise: bool, fast: bool) -> Callable[[], object]:
    """A call of _scaled_mm on a and b cast to e4m3 (tensorwise or rowwise scales)."""
    a8, a_inv = to_e4m3(a, 1 if rowwise else None)
    b8, b_inv = to_e4m3(b, 0 if rowwise else None)
    return lambda: torch._scaled_mm(a8, b8, a_inv, b_inv, out_dtype=torch.bfloat16, use_fast_accum=fast)


FP8_VARIANTS = [
    ("tensorwise", False, True),
    ("tensorwise", False, False),
    ("rowwise", True, True),
    ("rowwise", True, False),
]


def linear_rows(name: str, m: int, k: int, n: int, measure, device: torch.device) -> list[dict]:
    """One row per (matmul, kind) of one linear shape: seconds, TFLOP/s, speed-up over bf16."""
    rows = []
    for matmul, (a, b) in gemm_operands(m, k, n, device).items():
        flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
        bf16_s = measure(lambda a=a, b=b: torch.mm(a, b))
        reference = torch.mm(a.float(), b.float())
        rows.append(row(name, matmul, "bf16", flops, bf16_s, bf16_s, error_vs(torch.mm(a, b), reference)))
        for scaling, rowwise, fast in FP8_VARIANTS:
            kind = f"fp8 {scaling}" + (" fast accum" if fast else "")
            try:
                call = scaled_call(a, b, rowwise, fast)
                seconds = measure(call)
            except (RuntimeError, NotImplementedError) as error:
                rows.append(row(name, matmul, kind, flops, None, bf16_s, None, error))
                continue
            rows.append(row(name, matmul, kind, flops, seconds, bf16_s, error_vs(call(), reference)))
    return rows


def error_vs(out: torch.Tensor, reference: torch.Tensor) -> float:
    """Relative Frobenius error of a product against the fp32 product of the bf16 operands."""
    return (torch.linalg.vector_norm(out.float() - reference) / torch.linalg.vector_norm(reference)).item()


def row(name, matmul, kind, flops, seconds, bf16_s, rel_error=None, error=None) -> dict:
    """A result row; seconds None with the error's first line when the case was refused."""
    return {
        "shape": name,
        "matmul": matmul,
        "kind": kind,
        "flops": flops,
        "seconds": seconds,
        "tflops": None if seconds is None else flops / seconds / 1e12,
        "speedup_vs_bf16": None if seconds is None else bf16_s / seconds,
        "rel_error": rel_error,
        "error": None if error is None else str(error).splitlines()[0][:200],
    }


def grouped_rows(name, groups, per_group, k, n, measure, device) -> list[dict]:
    """Rows for the experts' forward grouped matmul: bf16 and rowwise fp8 (fast accum or not)."""
    total = groups * per_group
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(total, k, generator=gen).to(device=device, dtype=torch.bfloat16)
    w = (torch.randn(groups, n, k, generator=gen) * 0.02).to(device=device, dtype=torch.bfloat16)
    offs = torch.arange(per_group, total + 1, per_group, device=device, dtype=torch.int32)
    flops = 2 * total * k * n
    out = []
    try:
        bf16_s = measure(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs))
    except (RuntimeError, NotImplementedError, AttributeError) as error:
        return [row(name, "forward", "bf16 grouped", flops, None, 1.0, None, error)]
    out.append(row(name, "forward", "bf16 grouped", flops, bf16_s, bf16_s))
    x8, x_inv = to_e4m3(x, 1)
    w8, w_inv = to_e4m3(w, 2)  # per (expert, output column)
    for fast in (True, False):
        kind = "fp8 rowwise grouped" + (" fast accum" if fast else "")
        try:
            call = lambda fast=fast: torch._scaled_grouped_mm(  # noqa: E731
                x8,
                w8.transpose(-2, -1),
                x_inv.squeeze(1),
                w_inv.squeeze(2),
                offs=offs,
                out_dtype=torch.bfloat16,
                use_fast_accum=fast,
            )
            out.append(row(name, "forward", kind, flops, measure(call), bf16_s))
        except (RuntimeError, NotImplementedError, AttributeError) as error:
            out.append(row(name, "forward", kind, flops, None, bf16_s, None, error))
    return out


def cast_row(m: int, k: int, measure, device: torch.device) -> dict:
    """The memory-bound work per operand: amax, scale, clamp, cast of one bf16 [M, K] tensor."""
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    seconds = measure(lambda: to_e4m3(x, None))
    moved = x.numel() * (2 + 2 + 1)  # amax reads it, the cast reads it again and writes e4m3
    return {
        "shape": f"cast [{m}, {k}]",
        "matmul": "cast",
        "kind": "amax + cast to e4m3 (op by op)",
        "flops": 0,
        "seconds": seconds,
        "tflops": None,
        "speedup_vs_bf16": None,
        "gb_per_s": moved / seconds / 1e9,
        "rel_error": None,
        "error": None,
    }


def markdown(result: dict) -> str:
    """The rows as a markdown table under a line naming machine, torch and date."""
    lines = [
        f"FP8 vs bf16 matmuls, {result['started']}: {result['device']}, torch {result['torch']}, "
        f"median of {result['iters']} calls{' (smoke: CPU, sizes cut 64x)' if result['smoke'] else ''}.",
        "",
        "| shape | matmul | kind | ms | TFLOP/s | vs bf16 | error vs fp32 product |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if r["seconds"] is None:
            lines.append(f"| {r['shape']} | {r['matmul']} | {r['kind']} | refused: {r['error']} | | | |")
            continue
        rate = f"{r['tflops']:.0f}" if r["tflops"] is not None else f"{r['gb_per_s']:.0f} GB/s"
        speed = f"{r['speedup_vs_bf16']:.2f}x" if r["speedup_vs_bf16"] is not None else ""
        err = "" if r["rel_error"] is None else f"{r['rel_error']:.1e}"
        lines.append(
            f"| {r['shape']} | {r['matmul']} | {r['kind']} | {r['seconds'] * 1e3:.3f} | {rate} | {speed} | {err} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--smoke", action="store_true", help="CPU, sizes cut 64x: checks the script only")
    parser.add_argument("--iters", type=int, default=20)
    opts = parser.parse_args()
    if not opts.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: this measures a GPU (--smoke checks the script on the CPU)")
    device = torch.device("cpu" if opts.smoke else "cuda")
    measure = timer(device, opts.iters)
    rows = []
    for name, m, k, n in LINEARS:
        rows += linear_rows(name, *(shrink(s, opts.smoke) for s in (m, k, n)), measure, device)
        print(f"{name}: done", flush=True)
    for name, groups, per_group, k, n in GROUPED:
        rows += grouped_rows(name, groups, *(shrink(s, opts.smoke) for s in (per_group, k, n)), measure, device)
    rows.append(cast_row(shrink(8192, opts.smoke), shrink(4096, opts.smoke), measure, device))
    result = {
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "iters": opts.iters,
        "smoke": opts.smoke,
        "rows": rows,
    }
    opts.output_dir.mkdir(parents=True, exist_ok=True)
    (opts.output_dir / "fp8_matmul_rate.json").write_text(json.dumps(result, indent=1))
    table = markdown(result)
    (opts.output_dir / "fp8_matmul_rate.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
