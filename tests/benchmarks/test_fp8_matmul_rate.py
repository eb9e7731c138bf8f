"""The FP8 matmul benchmark (``benchmarks.fp8_matmul_rate``) on the CPU: every linear's three
matmuls run in bf16 and in e4m3 with both scalings, laid out as ``_scaled_mm`` takes them, and
the products agree with the fp32 product to e4m3's precision (a wrong scale or layout breaks it)."""

import json
import subprocess
import sys

from tests.conftest import ROOT


def test_smoke_times_every_linear_matmul_with_products_to_fp8_precision(tmp_path):
    command = [sys.executable, "-m", "benchmarks.fp8_matmul_rate", str(tmp_path), "--smoke", "--iters", "1"]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True, timeout=120)
    result = json.loads((tmp_path / "fp8_matmul_rate.json").read_text())
    linears = [r for r in result["rows"] if r["matmul"] in ("forward", "input_grad", "weight_grad")]
    linears = [r for r in linears if "grouped" not in r["kind"]]
    kinds = {r["kind"] for r in linears}
    assert kinds == {
        "bf16",
        "fp8 tensorwise fast accum",
        "fp8 tensorwise",
        "fp8 rowwise fast accum",
        "fp8 rowwise",
    }
    assert len(linears) == 9 * 3 * 5
    for r in linears:
        assert r["error"] is None and r["seconds"] > 0, r
        # e4m3 keeps 3 mantissa bits: about 2^-4 / sqrt(3) relative rounding per operand
        bound = 2e-3 if r["kind"] == "bf16" else 6e-2
        assert 0 < r["rel_error"] < bound, r
    assert (tmp_path / "fp8_matmul_rate.md").read_text().startswith("FP8 vs bf16 matmuls")
