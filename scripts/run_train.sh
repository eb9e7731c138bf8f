#!/usr/bin/env bash
# Launch train.py on this node's processes, the job checked first:
#
#   NGPU=4 scripts/run_train.sh --job.config_file configs/llama3_8b.toml [--section.key value ...]
#
# First `python -m graph_trainer.cli.check` checks the job in one process (configuration, device,
# folders, the paths it reads, memory, as each rank would): a mistake is one line on stderr and exit code 2, before
# any rank starts. Then `torchrun --nproc_per_node $NGPU train.py` with the same flags.
#
# NGPU: processes on this node (default 1). Several nodes: NNODES=M and torchrun's rendezvous in
# TORCHRUN_ARGS, the same command on every node, e.g.
#   NGPU=8 NNODES=2 TORCHRUN_ARGS="--rdzv_backend c10d --rdzv_endpoint node0:29500 --rdzv_id job1" \
#       scripts/run_train.sh --job.config_file configs/llama3_8b.toml
# One node runs torchrun --standalone. PYTHON: the interpreter (default: the repository's .venv).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
ngpu="${NGPU:-1}"
nnodes="${NNODES:-1}"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
"$python" -m graph_trainer.cli.check --nproc_per_node "$ngpu" --nnodes "$nnodes" "$@"
if [ "$nnodes" = 1 ]; then
  rendezvous=(--standalone)
else
  read -r -a rendezvous <<<"--nnodes $nnodes ${TORCHRUN_ARGS:-}"
fi
exec "$python" -m torch.distributed.run "${rendezvous[@]}" --nproc_per_node "$ngpu" "$root/train.py" "$@"
