#!/usr/bin/env bash
# Multi-node training with DeepSpeed's launcher and a hostfile. Arguments are train.py's Hydra
# overrides, passed through unchanged; relative paths (HOSTFILE, overrides) are relative to the repo root.
#
# Default (pdsh over ssh): run once, on node 0 or on any machine that can ssh to every host:
#   HOSTFILE=scripts/multinode/hostfile MASTER_ADDR=10.0.0.1 \
#     bash scripts/multinode/launch_hostfile.sh model_name_or_path=CKPT_DIR num_stages=4 ...
# `deepspeed` reads the hostfile and starts, through pdsh + ssh, one launcher per host, which starts
# one rank per slot. Needs pdsh on this machine and passwordless ssh to every host in the hostfile.
#
# NODE_RANK=n (no ssh): run once on every node, each with its own n (0 = the hostfile's first host);
# each launches only its own node's ranks (`deepspeed --no_ssh --node_rank n`). train_slurm.sbatch runs
# it this way from srun, and tests/test_multinode.py runs it twice on one machine.
#
# Every node needs the repo, .venv, the checkpoint and the data at the same path, and output_dir on a
# filesystem all nodes share: each pipeline stage's files are written by a rank on its own node, and
# rank 0 writes `latest` after all of them.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

# The hostfile ("<host> slots=<GPUs>" per line, node 0 first; see hostfile.example).
HOSTFILE="${HOSTFILE:-scripts/multinode/hostfile}"
[ -f "$HOSTFILE" ] || { echo "launch_hostfile.sh: no hostfile $HOSTFILE (set HOSTFILE; see scripts/multinode/hostfile.example)" >&2; exit 2; }
# Node 0's address, reachable from every node: rank 0 serves the rendezvous (TCPStore) there. Default:
# the hostfile's first host name. (Left empty, DeepSpeed would ssh to that host for `hostname -I`.)
MASTER_ADDR="${MASTER_ADDR:-$(awk '$1 !~ /^#/ && NF { print $1; exit }' "$HOSTFILE")}"
# Empty: launch every node from here over pdsh/ssh. A number: launch only that node's ranks, without ssh.
NODE_RANK="${NODE_RANK:-}"
# Rendezvous TCP port on MASTER_ADDR: free there and open between the nodes. Unset, a port free now is chosen
# when MASTER_ADDR is this machine and one command launches every node (not 29500, torch's default, which another
# job may hold); every node launched on its own must be given the same one.
if [ -z "${MASTER_PORT:-}" ] && [ -n "$NODE_RANK" ]; then
  echo "launch_hostfile.sh: error: NODE_RANK=$NODE_RANK without MASTER_PORT: set MASTER_PORT, the same on every node, to a port free on MASTER_ADDR $MASTER_ADDR (\`.venv/bin/python -m training.resilience.ports\` run there prints one)" >&2
  exit 2
fi
MASTER_PORT="$(.venv/bin/python -m training.resilience.ports --who launch_hostfile --host "$MASTER_ADDR")"
# The DeepSpeed launcher (the project's venv; the same path must exist on every node).
DEEPSPEED="${DEEPSPEED:-.venv/bin/deepspeed}"

# ---- Environment of every rank (the launcher passes its own environment to the ranks it starts) ----
# One OpenMP thread per rank: by default each of the 8 ranks of a node would start one thread per core
# and oversubscribe the CPU (4 ranks x 2 threads on a 2-core machine ran 15-20x slower than 1 thread).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Flush rank output line by line, so a node's log shows where it stopped when another node fails.
export PYTHONUNBUFFERED="${PYTHONUNBUFFERED:-1}"
# NCCL prints warnings and errors with their cause (a wrong interface, an IB failure); INFO to debug start-up.
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
# A failed or timed-out collective aborts NCCL and ends the process, so the launchers exit and the job
# ends instead of hanging (torchrun's setting; torch < 2.2 read the old name NCCL_ASYNC_ERROR_HANDLING).
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
# Collective timeout in minutes (train.py's process group uses DeepSpeed's default, read from this
# variable; 10 in DeepSpeed 0.19.8). It bounds the slowest start-up step every rank waits for, e.g.
# tokenizing a large corpus into the cache, and how long a hung collective blocks the job.
export DEEPSPEED_TIMEOUT="${DEEPSPEED_TIMEOUT:-30}"
# Optional, set them in the environment of this script when the cluster needs them (NCCL reads them):
#   NCCL_SOCKET_IFNAME=eth0     interface for NCCL's bootstrap and socket traffic ("^docker,lo" excludes);
#                               NCCL may otherwise pick one the other nodes cannot reach and hang at init
#   NCCL_IB_HCA=mlx5_0,mlx5_1   InfiniBand adapters NCCL may use, when not all of them are on the
#                               fabric that connects the nodes
#   NCCL_IB_DISABLE=1           no InfiniBand: TCP sockets only (clusters without IB, or to rule it out)
# FORWARD_VARS="VAR1 VAR2": more variables for the remote ranks (pdsh mode), e.g. HF_HOME.
FORWARD_VARS="OMP_NUM_THREADS TORCH_NCCL_ASYNC_ERROR_HANDLING DEEPSPEED_TIMEOUT ${FORWARD_VARS:-}"

args=(--hostfile "$HOSTFILE" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
if [ -n "$NODE_RANK" ]; then
  # Every node runs this itself, with its own environment; DeepSpeed reads no .deepspeed_env here.
  args+=(--no_ssh --node_rank "$NODE_RANK")
else
  # pdsh mode: the remote ranks do not inherit this shell's environment. DeepSpeed forwards only
  # variables named PYTHON*, UCX*, MV2*, MLFLOW*, NCCL* (CUDA) and those listed in a .deepspeed_env file
  # (~/.deepspeed_env and ./.deepspeed_env, or the file DS_ENV_FILE names): KEY=VALUE lines only,
  # since it splits every line on '=' (a comment or blank line there stops the launch).
  # This launch writes its own file: FORWARD_VARS, then the lines of ~/.deepspeed_env and
  # ./.deepspeed_env (DS_ENV_FILE replaces those two names, so their contents are copied in).
  # Overwritten at each launch, in work/ (not committed).
  env_file="$PWD/work/multinode/deepspeed_env"
  mkdir -p "$(dirname "$env_file")"
  for var in $FORWARD_VARS; do
    if [ -n "${!var:-}" ]; then printf '%s=%s\n' "$var" "${!var}"; fi
  done > "$env_file"
  for user_file in "$HOME/.deepspeed_env" ./.deepspeed_env; do
    if [ -f "$user_file" ]; then grep -E '^[A-Za-z_][A-Za-z0-9_]*=' "$user_file" >> "$env_file" || true; fi
  done
  export DS_ENV_FILE="$env_file"
fi

echo "[launch_hostfile] $DEEPSPEED ${args[*]} train.py $*" >&2
# SIGUSR1 (SLURM's --signal warning) reaches every process of the job step: the launchers ignore it (a
# Python launcher would die of it), train.py's ranks catch it (they set their own handler), finish the
# step, save and exit 75 (docs/checkpoints.md#preemption-and-time-limits).
trap '' USR1
exec "$DEEPSPEED" "${args[@]}" train.py "$@"
