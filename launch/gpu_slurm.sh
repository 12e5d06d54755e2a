#!/bin/bash
# rljax on Slurm: one JAX process per GPU (or per node), optional vLLM rollout nodes, requeue on preemption.
#
# Exact sbatch line (2 nodes x 8 GPUs, 16 JAX processes, vLLM started by rljax next to the trainer):
#   sbatch --nodes=2 --ntasks-per-node=8 --gpus-per-node=8 launch/gpu_slurm.sh -- \
#       --config=configs/grpo.py:qwen2.5-0.5b --config.model.path=/models/Qwen2.5-0.5B-Instruct \
#       --workdir=/shared/runs/run1
# Dedicated rollout nodes (the last k nodes each run one vLLM server as a Slurm step of its own,
# `python -m rljax.rollout.serve`: rljax's tcp weight-transfer backend, processed log-probs, bound to the
# node's private address, every route but /health behind a per-job bearer token; the trainer is given the
# URLs, the token file and tcp weight sync from every trainer node's private address; docs/scale.md):
#   RLJAX_ROLLOUT_NODES=1 sbatch --nodes=3 --ntasks-per-node=8 --gpus-per-node=8 launch/gpu_slurm.sh -- ...
# CPU-only cluster (what the tests run): RLJAX_PLATFORM=cpu sbatch --ntasks=2 launch/gpu_slurm.sh -- \
#       --config=configs/grpo.py:smoke --workdir=/tmp/rljax_slurm
#
# Everything after `--` goes to `python -m rljax.main` unchanged (config file, --config.* overrides,
# --workdir); with rollout nodes the rollout overrides are appended (`--config.rollout.vllm.urls=(...)`,
# `.token_file=`, `.allow_remote=true`, `--config.rollout.weight_sync.transport=tcp`, `.tcp_host=`). The
# token is generated for each start of the job in <workdir>/secrets/server_token (0600, directory 0700):
# <workdir> must be on a file system the rollout nodes share, readable by the job's user only. Logs: the
# Slurm output file below, and <workdir>/logs/{batch.log, rank-<i>.log, preflight-rank-<i>.log, vllm-<node>.log}.
# Preemption: Slurm sends USR1 to this script 120 s before the time limit (--signal) and `scancel
# --signal=USR1 --batch <job>` does the same by hand; the script forwards it to the training step, every
# process saves at the next step boundary and exits 143, and the script runs `scontrol requeue` so the job
# restarts and resumes from <workdir>/checkpoints. Slurm keeps a requeued job pending for its credential
# lifetime (AuthInfo cred_expire, default 120 s) before it starts again.
#
# Environment (all optional):
#   RLJAX_PLATFORM=gpu|cpu|tpu    JAX platform (default gpu; cpu for CPU-only clusters)
#   RLJAX_PROCESS_PER=gpu|node    one JAX process per GPU (default; tasks = --ntasks-per-node) or one per node
#                                 driving all of its GPUs (RLJAX_LOCAL_DEVICE_IDS is set for it)
#   RLJAX_CPU_DEVICES=k           simulated devices per process on CPU
#   RLJAX_ROLLOUT_NODES=k         last k nodes serve vLLM (default 0: rljax starts its own server)
#   RLJAX_ROLLOUT_SHARE_NODES=1   the k servers run on the last k trainer nodes instead, still each as its
#                                 own step (a single-node cluster; nodes with GPUs to spare)
#   RLJAX_NODE_ADDRS=n1=a1,...    a node's private address (servers bind it, the trainer's tcp weight sync
#                                 binds its leader's); default: the node's Slurm NodeAddr (scontrol show
#                                 node), resolved to IPv4 with getent if it is a name; never 0.0.0.0
#   RLJAX_VLLM_PORT (8000), RLJAX_VLLM_MODEL (default: the config's model.path), RLJAX_VLLM_ARGS (extra
#   vLLM arguments, a word list), RLJAX_VLLM_TIMEOUT (600 s to become healthy)
#   RLJAX_PYTHON                  interpreter (default: $SLURM_SUBMIT_DIR/.venv/bin/python, else python3)
#   RLJAX_ENTRY                   module or .py file to run (default rljax.main; launch/selftest.py checks
#                                 the launch path without the trainer)
#   RLJAX_PREFLIGHT=1|0           run `rljax.preflight` on all tasks before training (default 1)
#   RLJAX_REQUEUE=1|0             requeue after a preemption save (default 1)
#   RLJAX_COORDINATOR_PORT        jax.distributed coordinator port (default derived from the job id)
#   RLJAX_DRY_RUN=1               print the plan and the srun commands, run nothing
#SBATCH --job-name=rljax
#SBATCH --requeue
#SBATCH --signal=B:USR1@120
#SBATCH --open-mode=append
#SBATCH --output=rljax-%j.out
#SBATCH --time=24:00:00

set -uo pipefail

EXIT_PREEMPTED=143

log() { echo "rljax-slurm: $*" | tee -a "${LOGDIR:-/dev/null}/batch.log" >&2; }
die() { echo "rljax-slurm: error: $*" >&2; exit 2; }

[ "${1:-}" = "--" ] && shift
ARGS=("$@")

# ---------------------------------------------------------------------------------------------- workdir
WORKDIR=""
for ((i = 0; i < ${#ARGS[@]}; i++)); do
  case "${ARGS[i]}" in
    --workdir=*) WORKDIR="${ARGS[i]#--workdir=}" ;;
    --workdir) WORKDIR="${ARGS[i + 1]:-}" ;;
  esac
done
[ -n "$WORKDIR" ] || die "pass --workdir=DIR after -- (metrics, checkpoints and logs go there)"
LOGDIR="$WORKDIR/logs"
mkdir -p "$LOGDIR" || die "cannot create $LOGDIR"

# ---------------------------------------------------------------------------------------------- plan
SUBMIT_DIR="${SLURM_SUBMIT_DIR:-$PWD}"
if [ -z "${RLJAX_PYTHON:-}" ]; then
  RLJAX_PYTHON=python3
  [ -x "$SUBMIT_DIR/.venv/bin/python" ] && RLJAX_PYTHON="$SUBMIT_DIR/.venv/bin/python"
fi
PLATFORM="${RLJAX_PLATFORM:-gpu}"
PROCESS_PER="${RLJAX_PROCESS_PER:-gpu}"
ROLLOUT_NODES="${RLJAX_ROLLOUT_NODES:-0}"
ENTRY="${RLJAX_ENTRY:-rljax.main}"
JOB_ID="${SLURM_JOB_ID:?not inside a Slurm job (submit with sbatch)}"
RESTART="${SLURM_RESTART_COUNT:-0}"

mapfile -t NODES < <(scontrol show hostnames "${SLURM_JOB_NODELIST:?}")
NUM_NODES=${#NODES[@]}
((ROLLOUT_NODES >= 0 && (ROLLOUT_NODES < NUM_NODES || ${RLJAX_ROLLOUT_SHARE_NODES:-0} == 1))) \
  || die "RLJAX_ROLLOUT_NODES=$ROLLOUT_NODES needs at least one trainer node among $NUM_NODES nodes"
NUM_TRAINER_NODES=$((NUM_NODES - ROLLOUT_NODES))
SERVE_NODES=("${NODES[@]:NUM_TRAINER_NODES}")
if [ "${RLJAX_ROLLOUT_SHARE_NODES:-0}" = 1 ]; then  # servers on the last trainer nodes, as steps of their own
  ((ROLLOUT_NODES <= NUM_NODES)) || die "RLJAX_ROLLOUT_NODES=$ROLLOUT_NODES exceeds the job's $NUM_NODES nodes"
  NUM_TRAINER_NODES=$NUM_NODES
  SERVE_NODES=("${NODES[@]:NUM_NODES-ROLLOUT_NODES}")
fi
TRAINER_NODES=("${NODES[@]:0:NUM_TRAINER_NODES}")
TRAINER_NODELIST=$(IFS=,; echo "${TRAINER_NODES[*]}")

if [ "$PROCESS_PER" = node ]; then
  TASKS_PER_NODE=1
  GPUS="${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-0}}"
  GPUS="${GPUS##*:}"
  if [ "$PLATFORM" = gpu ] && ((GPUS > 0)); then
    export RLJAX_LOCAL_DEVICE_IDS=$(seq -s, 0 $((GPUS - 1)))
  fi
elif [ "$PROCESS_PER" = gpu ]; then
  TASKS_PER_NODE="${SLURM_NTASKS_PER_NODE:-$((${SLURM_NTASKS:-$NUM_NODES} / NUM_NODES))}"
else
  die "RLJAX_PROCESS_PER must be gpu or node, got $PROCESS_PER"
fi
((TASKS_PER_NODE >= 1)) || die "no tasks per node (submit with --ntasks-per-node or --ntasks)"
NUM_TASKS=$((TASKS_PER_NODE * NUM_TRAINER_NODES))

PORT="${RLJAX_COORDINATOR_PORT:-$((20000 + (JOB_ID * 16 + RESTART) % 20000))}"
export RLJAX_COORDINATOR="${TRAINER_NODES[0]}:$PORT"
export RLJAX_PLATFORM="$PLATFORM"
unset RLJAX_PROCESS_ID RLJAX_NUM_PROCESSES  # those are the local launcher's, not Slurm's

# ---------------------------------------------------------------------------------------------- env
export PYTHONUNBUFFERED=1
if [ "$PLATFORM" = gpu ]; then
  export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
  export NCCL_ASYNC_ERROR_HANDLING="${NCCL_ASYNC_ERROR_HANDLING:-1}"
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_latency_hiding_scheduler=true"
  # The device plan (rljax.device_plan, the one every launcher uses): the trainer's share of each GPU,
  # less a colocated server's (servers on their own nodes: RLJAX_ROLLOUT_NODES without SHARE_NODES).
  PLAN_GPUS="${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-$TASKS_PER_NODE}}"
  PLAN_ROLLOUT_NODES=$ROLLOUT_NODES
  [ "${RLJAX_ROLLOUT_SHARE_NODES:-0}" = 1 ] && PLAN_ROLLOUT_NODES=0
  PLAN_ARGS=(--gpus "${PLAN_GPUS##*:}" --nodes "$NUM_NODES" --rollout-nodes "$PLAN_ROLLOUT_NODES"
    --process-per "$PROCESS_PER")
  PLAN_ENV=$("$RLJAX_PYTHON" -m rljax.launch --plan-env "${PLAN_ARGS[@]}" -- "${ARGS[@]}") \
    || die "no device plan fits this job (run: $RLJAX_PYTHON -m rljax.launch --plan ${PLAN_ARGS[*]} -- ${ARGS[*]})"
  [ -n "${XLA_PYTHON_CLIENT_MEM_FRACTION:-}" ] || export "${PLAN_ENV:?}"
  log "trainer memory share: XLA_PYTHON_CLIENT_MEM_FRACTION=$XLA_PYTHON_CLIENT_MEM_FRACTION"
  if [ "${RLJAX_DRY_RUN:-0}" = 1 ]; then
    echo "rljax-slurm: plan $("$RLJAX_PYTHON" -m rljax.launch --plan "${PLAN_ARGS[@]}" -- "${ARGS[@]}" | tr -d '\n')"
  fi
elif [ "$PLATFORM" = cpu ]; then
  export JAX_PLATFORMS=cpu
fi

if [[ "$ENTRY" == *.py ]]; then ENTRY_CMD=("$RLJAX_PYTHON" "$ENTRY"); else ENTRY_CMD=("$RLJAX_PYTHON" -m "$ENTRY"); fi
SRUN=(srun --kill-on-bad-exit=1 --nodes="$NUM_TRAINER_NODES" --nodelist="$TRAINER_NODELIST"
  --ntasks="$NUM_TASKS" --ntasks-per-node="$TASKS_PER_NODE" --open-mode=append)

log "job $JOB_ID restart $RESTART: $NUM_TASKS JAX processes on ${TRAINER_NODES[*]} ($PLATFORM," \
  "per $PROCESS_PER), rollout nodes: ${SERVE_NODES[*]:-none}, coordinator $RLJAX_COORDINATOR"

run() {  # runs (or, dry, prints) one command
  if [ "${RLJAX_DRY_RUN:-0}" = 1 ]; then printf 'rljax-slurm: would run:'; printf ' %q' "$@"; echo; return 0; fi
  "$@"
}

# ---------------------------------------------------------------------------------------------- rollout
SERVER_PIDS=()
cleanup() { for pid in "${SERVER_PIDS[@]}"; do kill "$pid" 2>/dev/null; done; }
trap cleanup EXIT

node_addr() {  # the private address of node $1 (RLJAX_NODE_ADDRS, else Slurm's NodeAddr), resolved to IPv4
  local node=$1 entry addr=""
  local -a entries=()
  IFS=, read -ra entries <<<"${RLJAX_NODE_ADDRS:-}"
  for entry in "${entries[@]}"; do [ "${entry%%=*}" = "$node" ] && addr="${entry#*=}"; done
  if [ -z "$addr" ]; then
    addr=$(scontrol -o show node "$node" 2>/dev/null | tr ' ' '\n' | sed -n 's/^NodeAddr=//p')
    addr="${addr:-$node}"
  fi
  [[ "$addr" =~ ^[0-9]+(\.[0-9]+){3}$ ]] || addr=$(getent ahostsv4 "$addr" | awk 'NR == 1 { print $1 }')
  case "$addr" in
    "" | 0.0.0.0) echo "rljax-slurm: error: no private address for node $node (set RLJAX_NODE_ADDRS=$node=ADDR)" >&2
      return 2 ;;
  esac
  echo "$addr"
}

new_server_token() {  # one token per start of the job, readable by this user only (0700 dir, 0600 file)
  local dir="$WORKDIR/secrets"
  (umask 077 && mkdir -p "$dir") || die "cannot create $dir"
  [ -O "$dir" ] && [ ! -L "$dir" ] || die "$dir is not owned by $(id -un)"
  chmod 700 "$dir" || die "cannot chmod $dir"
  TOKEN_FILE="$dir/server_token"
  (umask 077 && head -c 32 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=\n' >"$TOKEN_FILE.tmp.$$" \
    && mv -f "$TOKEN_FILE.tmp.$$" "$TOKEN_FILE") || die "cannot write $TOKEN_FILE"
}

rollout_args() {  # the trainer's overrides for the servers on SERVE_NODES; sets ROLLOUT_ARGS, SERVE_ADDRS
  local port=$1 urls=() node addr trainers=()
  SERVE_ADDRS=()
  for node in "${SERVE_NODES[@]}"; do
    addr=$(node_addr "$node") || exit 2
    SERVE_ADDRS+=("$addr")
    urls+=("'http://$addr:$port'")
  done
  for node in "${TRAINER_NODES[@]}"; do  # each trainer process serves its own shards on its node's address
    addr=$(node_addr "$node") || exit 2
    trainers+=("$addr")
  done
  ROLLOUT_ARGS=("--config.rollout.vllm.urls=($(IFS=,; echo "${urls[*]}"),)"
    "--config.rollout.vllm.token_file=$TOKEN_FILE" --config.rollout.vllm.allow_remote=true
    --config.rollout.weight_sync.transport=tcp
    "--config.rollout.weight_sync.tcp_host=$(IFS=,; echo "${trainers[*]}")")
}

start_rollout_servers() {  # one `rljax.rollout.serve` step per rollout node, then wait for /health
  local port="${RLJAX_VLLM_PORT:-8000}" serve=() i arg
  new_server_token
  rollout_args "$port"
  TRAIN_ARGS+=("${ROLLOUT_ARGS[@]}")
  serve=(-m rljax.rollout.serve --port "$port" --token-file "$TOKEN_FILE")
  [ -n "${RLJAX_VLLM_MODEL:-}" ] && serve+=(--model "$RLJAX_VLLM_MODEL")
  for arg in ${RLJAX_VLLM_ARGS:-}; do serve+=("--vllm-arg=$arg"); done
  for i in "${!SERVE_NODES[@]}"; do
    local node="${SERVE_NODES[i]}" host=(--host "${SERVE_ADDRS[i]}")
    local cmd=(srun --overlap --nodes=1 --ntasks=1 --nodelist="$node" --output="$LOGDIR/vllm-$node.log"
      --open-mode=append "$RLJAX_PYTHON" "${serve[@]}" "${host[@]}" -- "${TRAIN_ARGS[@]}")
    if [ "${RLJAX_DRY_RUN:-0}" = 1 ]; then
      run "${cmd[@]}"
      "$RLJAX_PYTHON" "${serve[@]}" "${host[@]}" --print -- "${TRAIN_ARGS[@]}" || die "bad rollout server setup"
    else
      "${cmd[@]}" &
      SERVER_PIDS+=($!)
    fi
  done
  [ "${RLJAX_DRY_RUN:-0}" = 1 ] && return 0
  local deadline=$((SECONDS + ${RLJAX_VLLM_TIMEOUT:-600}))
  for i in "${!SERVE_NODES[@]}"; do  # until /health answers; a server step that exits fails at once
    until "$RLJAX_PYTHON" -m rljax.launch --wait-url "http://${SERVE_ADDRS[i]}:$port/health" --timeout 10; do
      kill -0 "${SERVER_PIDS[i]}" 2>/dev/null && ((SECONDS < deadline)) && continue
      die "vLLM on ${SERVE_NODES[i]} not healthy; see $LOGDIR/vllm-${SERVE_NODES[i]}.log"
    done
  done
  log "rollout servers healthy: ${SERVE_ADDRS[*]} (port $port, token $TOKEN_FILE)"
}

TRAIN_ARGS=("${ARGS[@]}")
((ROLLOUT_NODES > 0)) && start_rollout_servers

# ---------------------------------------------------------------------------------------------- preflight
if [ "${RLJAX_PREFLIGHT:-1}" = 1 ]; then
  if ! run "${SRUN[@]}" --output="$LOGDIR/preflight-rank-%t.log" \
      "$RLJAX_PYTHON" -m rljax.preflight "${TRAIN_ARGS[@]}"; then
    grep -h "^preflight:\|^rljax: error" "$LOGDIR/preflight-rank-0.log" >&2
    die "preflight failed; see $LOGDIR/preflight-rank-0.log"
  fi
fi

# ---------------------------------------------------------------------------------------------- train
PREEMPTED=0
TRAIN_PID=""
on_signal() {  # Slurm's --signal / scancel --signal: forward to the training step, which saves and exits 143
  PREEMPTED=1
  log "received $1; forwarding USR1 to the training step"
  [ -n "$TRAIN_PID" ] && kill -s USR1 "$TRAIN_PID" 2>/dev/null
}
trap 'on_signal USR1' USR1
trap 'on_signal TERM' TERM

if [ "${RLJAX_DRY_RUN:-0}" = 1 ]; then
  run "${SRUN[@]}" --output="$LOGDIR/rank-%t.log" "${ENTRY_CMD[@]}" "${TRAIN_ARGS[@]}"
  exit 0
fi
RANK0_LOG="$LOGDIR/rank-0.log"
RANK0_OFFSET=$(($(stat -c %s "$RANK0_LOG" 2>/dev/null || echo 0) + 1))  # this attempt's part of the log
"${SRUN[@]}" --output="$LOGDIR/rank-%t.log" "${ENTRY_CMD[@]}" "${TRAIN_ARGS[@]}" &
TRAIN_PID=$!
while :; do  # `wait` returns early (> 128) whenever a trapped signal arrives
  wait "$TRAIN_PID"
  RC=$?
  ((RC > 128)) && kill -0 "$TRAIN_PID" 2>/dev/null && continue
  break
done
log "training step exited with $RC"
((RC == EXIT_PREEMPTED)) && ! tail -c +"$RANK0_OFFSET" "$RANK0_LOG" 2>/dev/null | grep -q "preempted; saved step" \
  && log "exit 143 without a preemption save (a rank failed and srun ended the others): not requeueing"

# Requeue when this script was signalled (Slurm is ending the job) and the step did not finish, or when the
# step exited 143 after a preemption save. 143 alone is not enough: when one rank crashes, srun's
# --kill-on-bad-exit TERMs the others, and their exit status can be 143 too; only a real save logs the line.
SAVED=0
tail -c +"$RANK0_OFFSET" "$RANK0_LOG" 2>/dev/null | grep -q "preempted; saved step" && SAVED=1
if (((PREEMPTED && RC != 0) || (RC == EXIT_PREEMPTED && SAVED))) && [ "${RLJAX_REQUEUE:-1}" = 1 ]; then
  log "preempted: requeueing job $JOB_ID (it resumes from $WORKDIR/checkpoints)"
  trap '' TERM  # requeue cancels this script; finish the log line first
  cleanup
  scontrol requeue "$JOB_ID"
  exit 0
fi
exit "$RC"
