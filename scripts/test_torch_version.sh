#!/usr/bin/env bash
# Check another torch release on this machine, in a venv of its own: the default debug job, then
# the test command. It is how the CUDA torch that scripts/setup_env.sh pins for GPU machines is
# tested on a CPU machine (a CUDA wheel runs on CPU). Not part of CI: that wheel and its NVIDIA
# libraries are about 6 GB. A maintainer runs it before changing the pin:
#
#   bash scripts/test_torch_version.sh 2.14.1 [VENV_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: bash scripts/test_torch_version.sh TORCH_VERSION [VENV_DIR]}
venv=${2:-${TMPDIR:-/tmp}/graph_trainer_torch_$version}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q "torch==$version"
"$venv/bin/python" -m pip install -q -r requirements.txt
"$venv/bin/python" -c "import torch; print(f'torch {torch.__version__} in $venv')"
out=$(mktemp -d "${TMPDIR:-/tmp}/graph_trainer_torch_check.XXXXXX")
echo "=== the default debug job (output: $out/default)"
OMP_NUM_THREADS=1 "$venv/bin/torchrun" --standalone --nproc_per_node 1 train.py \
    --job.config_file configs/llama3_debug.toml --job.device cpu --job.dump_folder "$out/default"
echo "=== the test command"
"$venv/bin/python" -m pytest -q -n 2 tests
