#!/usr/bin/env bash
# The one-GPU table in one command (a 500 s budget for the rows: under 10 minutes in all;
# docs/testing.md says what each column means). On the offline H100 machine, in the project
# root copied there with .devicegpu/:
#
#   bash scripts/gpu_table.sh OUT            # the real rows on CUDA, 500 s budget
#   bash scripts/gpu_table.sh OUT --smoke    # the same rows on the CPU at tiny sizes (what CI runs)
#
# Other flags go to `python3 -m benchmarks.gpu_table` (--rows, --steps, --budget, --list).
# First, where the packages the jobs import are missing (tomli, tyro, torchtitan, datasets, torchao:
# that machine has no registry), it installs the wheels ../shared/gpu/prepare.sh torchao==0.18.0
# (the FP8 rows' torchao, an extra there) carried in
# .devicegpu/ (their install script also checks the GPU). PYTHON picks the interpreter
# (default python3, that machine's torch).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)  # (no cd: OUT is relative to where the command runs)
py=${PYTHON:-python3}
missing=$("$py" -c '
import importlib.util
print(" ".join(m for m in ("tomli", "tyro", "torchtitan", "datasets", "torchao") if importlib.util.find_spec(m) is None))')
if [ -n "$missing" ]; then
    if [ ! -f "$root/.devicegpu/install.sh" ]; then
        echo "error: $py lacks $missing and there is no .devicegpu/install.sh: run bash ../shared/gpu/prepare.sh torchao==0.18.0" \
             "on a machine with a package registry and copy .devicegpu/ here" >&2
        exit 2
    fi
    echo "installing the carried wheels for: $missing"
    bash "$root/.devicegpu/install.sh"
fi
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" exec "$py" -m benchmarks.gpu_table "$@"
