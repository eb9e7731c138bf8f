#!/usr/bin/env bash
# Create ./.venv with everything graph_trainer needs. Idempotent.
#
# torch: a machine with an NVIDIA driver gets the CUDA build torch==2.14.1 (the release the
# project tested for GPU users: its unit tests and default job on CPU, with
# scripts/test_torch_version.sh); a machine without one gets the CPU build torch==2.13.0 (CI).
# An already installed torch >= 2.13 in the venv is kept. torch is installed first so that
# nothing below pulls another build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
"$VPY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true

have_torch=$("$VPY" - <<'PYEOF' 2>/dev/null || echo no
import torch
major, minor = (int(x) for x in torch.__version__.split(".")[:2])
print("yes" if (major, minor) >= (2, 13) else "no")
PYEOF
)
if [ "$have_torch" != "yes" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    "$VPY" -m pip install -q "torch==2.14.1"
  else
    "$VPY" -m pip install -q "torch==2.13.0"
  fi
fi
"$VPY" -m pip install -q -r requirements.txt
# The repository's own modules byte-compiled once, as pip compiles the installed packages: where
# PYTHONDONTWRITEBYTECODE is set (CI), every process would otherwise compile them from source again.
"$VPY" -m compileall -q -j 0 graph_trainer models suites tests benchmarks ./*.py >/dev/null
"$VPY" -c "import torch, torchtitan; print(f'graph_trainer env ready: torch {torch.__version__}, cuda available: {torch.cuda.is_available()}')"
