#!/usr/bin/env bash
# Runs a shardtrain config on every worker (host) of a Cloud TPU VM slice: copies this checkout to
# all workers, installs it there, then starts `shardtrain train` on all of them at once. Each worker
# is one JAX process; jax.distributed finds the others by itself (Cloud TPU detection).
#
#   launch/tpu_vm.sh [--dry-run] [--project ID] [--python python3.12] [--skip-install] [--restarts R] \
#       TPU_NAME ZONE CONFIG [KEY=VALUE ...]
#
#   --dry-run       print the gcloud commands instead of running them
#   --project ID    passed to gcloud (default: gcloud's configured project)
#   --python EXE    Python (>= 3.12) to build the venv with on the workers (default python3.12,
#                   installed with apt when missing)
#   --skip-install  the project is already installed on the workers: only start training
#   --restarts R    when the training fails on a worker (a process died, was killed or hung: exit 70;
#                   the others then stop by JAX's heartbeat), stop what is left of it on every worker
#                   and start it again, up to R times, from the newest restorable checkpoint (the local
#                   tier, checkpoint.local.directory=/dev/shm/..., when every worker still has it, else
#                   the persistent one). Not after success, a config error (2), a non-finite stop (65)
#                   or a preemption (75). Runs from this machine: keep it running (tmux, screen).
#
# Checkpoints must go to a directory every worker sees (checkpoint.directory=gs://BUCKET/...); the
# workers then get the project's `gcs` extra (gcsfs) and jax[tpu] at the version pyproject.toml names.
# Metrics, TensorBoard and plots are written by process 0, on worker 0, under ~/shardtrain/runs/.
set -euo pipefail

dry_run=0
project=()
python=python3.12
install=1
restarts=0
usage() { echo "usage: $0 [--dry-run] [--project ID] [--python EXE] [--skip-install] [--restarts R] TPU_NAME ZONE CONFIG [KEY=VALUE ...]" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) dry_run=1; shift ;;
    --project) [ $# -ge 2 ] || usage; project=(--project "$2"); shift 2 ;;
    --python) [ $# -ge 2 ] || usage; python=$2; shift 2 ;;
    --skip-install) install=0; shift ;;
    --restarts)
      case ${2:-} in '' | *[!0-9]*) echo "--restarts R: R must be a count >= 0, got '${2:-}'" >&2; exit 2 ;; esac
      restarts=$2; shift 2 ;;
    -h | --help) usage ;;
    --*) echo "unknown option $1" >&2; usage ;;
    *) break ;;
  esac
done
[ $# -ge 3 ] || usage
name=$1; zone=$2; config=$3; shift 3
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[ -f "$here/$config" ] || { echo "CONFIG '$config' must be a file of this checkout, relative to its root ($here)" >&2; exit 2; }

show() {  # prints a command, single-quoting the words that need it
  local out="" word
  for word in "$@"; do
    if [[ $word =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then out+="$word "
    else out+="'${word//\'/\'\\\'\'}' "; fi
  done
  echo "${out% }"
}
run() {
  if ((dry_run)); then show "$@"; else "$@"; fi
}

# What to install: jax[tpu] at the version pyproject.toml records, plus the gcs extra (gcsfs) when a
# path the run reads or writes is gs:// (checkpoint.directory, data.path: in the YAML or the overrides).
# Plain text parsing, so that --dry-run needs no Python environment: "section.key=value" per line of
# a block-style YAML (a flow-style section becomes "section={...}"), then the overrides; last wins.
settings() {
  awk '/^[[:space:]]*(#|$)/ { next }
    { sub(/[[:space:]]+#.*$/, "") }
    /^[^[:space:]][^:]*:/ { section = $0; sub(/:.*/, "", section); value = $0; sub(/^[^:]*:[[:space:]]*/, "", value)
                             if (value != "") print section "=" value; next }
    /^[[:space:]]+[^:]+:/ { key = $0; sub(/^[[:space:]]+/, "", key); sub(/:.*/, "", key)
                            value = $0; sub(/^[^:]*:[[:space:]]*/, "", value); print section "." key "=" value }' "$here/$config"
  printf '%s\n' "$@"
}
needs_gcs=$(settings "$@" | awk '/=/ { value[substr($0, 1, index($0, "=") - 1)] = substr($0, index($0, "=") + 1) }
  END { for (k in value) if (value[k] ~ /gs:\/\//) gcs = 1; print gcs + 0 }')
jax_version=$(sed -n 's/^[[:space:]]*"jax[>=]=\([0-9][0-9.]*\)".*/\1/p' "$here/pyproject.toml")
[ -n "$jax_version" ] || { echo "no jax==VERSION line in $here/pyproject.toml" >&2; exit 2; }
project_spec=.
((needs_gcs)) && project_spec="'.[gcs]'"

tpu=(gcloud compute tpus tpu-vm)
where=(--zone "$zone" --worker=all ${project[@]+"${project[@]}"})
train=$(printf '%q ' .venv/bin/shardtrain train "$config" "$@")

if ((install)); then
  archive=/tmp/shardtrain-$name.tar.gz
  run tar czf "$archive" -C "$here" --exclude=.venv --exclude=runs --exclude=.git --exclude=__pycache__ .
  run "${tpu[@]}" scp "$archive" "$name:shardtrain.tar.gz" "${where[@]}"
  setup="set -e; command -v $python >/dev/null || { sudo apt-get update -q && sudo apt-get install -y -q $python $python-venv; }"
  setup+="; rm -rf ~/shardtrain/shardtrain ~/shardtrain/models && mkdir -p ~/shardtrain && tar xzf ~/shardtrain.tar.gz -C ~/shardtrain"
  setup+="; cd ~/shardtrain && { [ -x .venv/bin/python ] || $python -m venv .venv; }"
  setup+="; .venv/bin/pip install -q -U pip && .venv/bin/pip install -q -e $project_spec 'jax[tpu]==$jax_version'"
  run "${tpu[@]}" ssh "$name" "${where[@]}" --command "$setup"
fi
attempt=0
while :; do
  code=0
  run "${tpu[@]}" ssh "$name" "${where[@]}" --command "cd ~/shardtrain && ${train% }" || code=$?
  case $code in 0 | 2 | 65 | 75) exit "$code" ;; esac
  ((attempt < restarts)) || exit "$code"
  attempt=$((attempt + 1))
  echo "training failed (exit $code): restart $attempt of $restarts from the newest restorable checkpoint" >&2
  run "${tpu[@]}" ssh "$name" "${where[@]}" --command "pkill -KILL -f '[.]venv/bin/shardtrain train' || true"
done
