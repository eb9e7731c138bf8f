"""What decides the rounding of the CPU kernels: pinned where PyTorch and MKL let us, and a
fingerprint of what a machine still contributes.

A CPU run's floats depend on which kernel code runs, and PyTorch picks it per machine:

* ATen's vectorised kernels come in builds for the baseline ISA, AVX2 and AVX-512; a machine runs
  the widest it supports, and the vector width changes the order of reductions (seen here: AVX2
  instead of AVX-512 moves the debug LLaMA-3 loss from step 3).
* MKL's matmuls dispatch on the CPU's vendor and ISA: an Intel CPU with AVX2 takes another path
  than an AMD one, which moves the loss from step 1 (seen under qemu with an Intel Haswell CPU
  model against this AMD EPYC; the reason curves recorded on one machine failed on another).
* MKL's vector math (VML: ``torch.sqrt``, ``exp``, ``log``, ... on contiguous float tensors, and so
  AdamW's ``exp_avg_sq.sqrt()``) is not correctly rounded on every path: on the AMD EPYC that
  recorded the curves some float square roots are one ulp off the IEEE result, on an (emulated)
  Intel Haswell none are (measured: docs/performance.md).
* The number of intra-op threads splits reductions.

``PINNED_ENV`` fixes what can be fixed for the curve jobs: one thread, ATen's baseline build
whatever the ISA, and MKL's conditional numerical reproducibility (CNR) on its ``COMPATIBLE``
branch, the one branch MKL honours on non-Intel CPUs too (``MKL_CBWR=AVX2`` falls back to MKL's
automatic choice on AMD: ``fingerprint`` reads the branch in effect). What is left to the machine
is in ``fingerprint()``: the PyTorch build, the architecture, the CPU vendor and ISA level (VML's
paths), whether the pins took effect, and the first initial weights the release draws
(``init_draws``: torch 2.13 changed how ``trunc_normal_`` samples, so 2.11 starts from other
weights). Curves are compared bitwise on a machine whose fingerprint matches the one that
recorded them, within ``curves.CURVE_RTOL`` elsewhere, and not at all by a torch that draws other
initial weights (nothing but the seed would be the same).
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT

PINNED_ENV = {
    "OMP_NUM_THREADS": "1",
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_CBWR": "COMPATIBLE",
}

_FINGERPRINT = r"""
import ctypes, json, os, platform, torch

def mkl_branch():
    # MKL's CNR branch in effect (query MKL_CBWR_BRANCH = 1): 3 is COMPATIBLE, 2 AUTO, 1 off.
    # mkl_serv_cbwr_get is MKL's exported service entry; a build without it reports None.
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        get = lib.mkl_serv_cbwr_get
    except (OSError, AttributeError):
        return None
    get.restype, get.argtypes = ctypes.c_int, [ctypes.c_int]
    return get(1)

def cpu():
    vendor, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "vendor_id":
                    vendor = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    isa = next((name for name in ("avx512f", "avx2", "avx", "sse4_2") if name in flags), "other")
    return vendor, isa

def init_draws():
    # The first values trunc_normal_ (the models' initialisation) draws from seed 0, to 6 digits: a
    # torch release that samples it otherwise starts every curve from other weights.
    torch.manual_seed(0)
    w = torch.nn.init.trunc_normal_(torch.empty(4), std=0.02)
    return [float(f"{v:.6g}") for v in w.tolist()]

blas = [line.strip() for line in torch.__config__.show().splitlines() if "Math Kernel Library" in line]
vendor, isa = cpu()
print(json.dumps({
    "torch": f"{torch.__version__} ({torch.version.git_version[:12]})",
    "arch": platform.machine(),
    "cpu_vendor": vendor,
    "cpu_isa": isa,
    "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    "blas": blas[0].lstrip("- ") if blas else "not MKL",
    "mkl_cnr_branch": mkl_branch() if blas else None,
    "init_draws": init_draws(),
}, sort_keys=True))
"""


def fingerprint() -> dict:
    """What decides the curves' floats on this machine, read in a process with ``PINNED_ENV``
    (so the capability and the MKL branch are those the curve jobs really get)."""
    import os

    env = {**os.environ, "PYTHONPATH": ROOT, **PINNED_ENV}
    out = subprocess.run(
        [sys.executable, "-c", _FINGERPRINT], capture_output=True, text=True, env=env, check=True, cwd=ROOT
    )
    return json.loads(out.stdout)
