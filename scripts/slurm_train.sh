#!/usr/bin/env bash
# Run a job on several nodes under Slurm: one scripts/run_train.sh per node (srun), every node's
# torchrun meeting at the first node of the allocation (c10d rendezvous).
#
#   sbatch --nodes 4 --gpus-per-node 8 scripts/slurm_train.sh --job.config_file configs/llama3_8b.toml
#
# from the repository's root (sbatch runs a copy of this script: the repository is where it was
# submitted, $SLURM_SUBMIT_DIR).
# NGPU: processes per node (default: $SLURM_GPUS_ON_NODE, else 8). RDZV_PORT: the rendezvous port on
# the first node (default 29500). Every node must see the repository (and its .venv) at the same
# path, and job.dump_folder / checkpoint.folder on a filesystem all nodes share (checkpoints are
# written by every rank and read back by every rank). Each node checks the job first
# (graph_trainer.cli.check): a mistake is one line in the Slurm log and exit code 2.
#SBATCH --job-name=graph_trainer
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
set -euo pipefail
root="${SLURM_SUBMIT_DIR:-$(cd "$(dirname "$0")/.." && pwd)}"
nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
head_node=$(echo "$nodes" | head -n 1)
export NGPU="${NGPU:-${SLURM_GPUS_ON_NODE:-8}}"
export NNODES="$SLURM_NNODES"
export TORCHRUN_ARGS="--rdzv_backend c10d --rdzv_endpoint $head_node:${RDZV_PORT:-29500} --rdzv_id ${SLURM_JOB_ID}"
echo "graph_trainer: $NNODES node(s) x $NGPU process(es), rendezvous at $head_node:${RDZV_PORT:-29500}"
exec srun --ntasks-per-node=1 --kill-on-bad-exit=1 "$root/scripts/run_train.sh" "$@"
