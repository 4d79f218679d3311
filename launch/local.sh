#!/usr/bin/env bash
# Runs one shardtrain training as N processes on this machine, joined by jax.distributed over
# 127.0.0.1: the multi-host runtime (coordinator, gloo collectives, heartbeats, preemption sync)
# on a laptop. The CPU devices are divided evenly among the processes.
#
#   launch/local.sh [--restarts R] N CONFIG [KEY=VALUE ...]   e.g. launch/local.sh 2 meshes/demo.yaml train.steps=20
#
#   --restarts R  restart the whole job up to R times (default 0) when a process died, was killed or
#                 hung (exit 70), each time from the newest restorable checkpoint (local tier or
#                 persistent); not after success, a config error (2), a non-finite stop (65) or a
#                 preemption (75: someone asked it to stop)
#
# Environment:
#   SHARDTRAIN_CPU_DEVICES        total simulated CPU devices (default 8; N must divide it)
#   SHARDTRAIN_HEARTBEAT_TIMEOUT  seconds before the others give up on a dead process (default 10)
#   SHARDTRAIN_PORT               coordinator port (default: a free one); one in use is refused (exit 2)
#   SHARDTRAIN_CMD                command to run (default: this checkout's .venv/bin/shardtrain, made by
#                                 `make venv` or `make train`, else `shardtrain` on PATH)
#
# Process 0 writes to this terminal as is (progress bar, metrics); the others' lines go to stderr
# prefixed with "[process i]"; gloo's "[Gloo] Rank r is connected" chatter is dropped from both.
# SIGTERM or Ctrl-C is forwarded to every process as SIGTERM, so all save a checkpoint at the same
# step and exit 75 (never restarted); a second Ctrl-C kills them. Exits with the first non-zero exit code of a process (0 when all succeed) and says which process failed first.
set -u

usage() { echo "usage: $0 [--restarts R] N CONFIG [KEY=VALUE ...]" >&2; exit 2; }
exec 3>&2  # the launcher's own messages; bash's "Killed" job notices go to /dev/null
say() { echo "local.sh: $*" >&3; }
restarts=0
if [ "${1:-}" = --restarts ]; then
  case ${2:-} in '' | *[!0-9]*) say "--restarts R: R must be a count >= 0, got '${2:-}'"; exit 2 ;; esac
  restarts=$2; shift 2
fi
[ $# -ge 2 ] || usage
n=$1; config=$2; shift 2
overrides=("$@")
case $n in '' | *[!0-9]* | 0) say "N must be a positive integer, got '$n'"; usage ;; esac
total=${SHARDTRAIN_CPU_DEVICES:-8}
if ((total % n != 0)); then
  say "$n processes cannot share $total CPU devices evenly; set SHARDTRAIN_CPU_DEVICES to a multiple of $n"
  exit 2
fi
[ -f "$config" ] || { say "config file '$config' does not exist"; exit 2; }

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -n "${SHARDTRAIN_CMD:-}" ]; then
  read -r -a cmd <<<"$SHARDTRAIN_CMD"
elif [ -x "$here/.venv/bin/shardtrain" ]; then  # the project's own environment (make venv / make train)
  cmd=("$here/.venv/bin/shardtrain")
elif command -v shardtrain >/dev/null 2>&1; then
  cmd=(shardtrain)
else
  say "no shardtrain found: run \`make venv\` (or \`make train\`) in $here first, or set SHARDTRAIN_CMD"
  exit 2
fi
flags=$(printf '%s' "${XLA_FLAGS:-}" | sed -E 's/--xla_force_host_platform_device_count=[^ ]*//g')
heartbeat=${SHARDTRAIN_HEARTBEAT_TIMEOUT:-10}

port_free() {  # PORT: whether nothing listens on it here (another job's coordinator must not be joined)
  python3 -c 'import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try: s.bind(("", int(sys.argv[1])))
except OSError: sys.exit(1)' "$1"
}

launch() {  # starts the N processes of one attempt on a fresh port
port=${SHARDTRAIN_PORT:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
if ! port_free "$port"; then  # joining it would hand this job's processes to a running job's coordinator
  say "coordinator port $port (SHARDTRAIN_PORT) is already in use on this host: another job? give this one a free port"
  exit 2
fi
pids=()
for ((i = 0; i < n; i++)); do
  run=(env SHARDTRAIN_COORDINATOR="127.0.0.1:$port" SHARDTRAIN_NUM_PROCESSES="$n" SHARDTRAIN_PROCESS_ID="$i"
    SHARDTRAIN_HEARTBEAT_TIMEOUT="$heartbeat" JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}" PYTHONUNBUFFERED=1
    XLA_FLAGS="$flags --xla_force_host_platform_device_count=$((total / n))"
    "${cmd[@]}" train "$config" ${overrides[@]+"${overrides[@]}"})
  # gloo prints "[Gloo] Rank r is connected to k peer ranks. ..." per device (threads interleave them)
  if [ "$i" -eq 0 ]; then
    "${run[@]}" > >(awk '/connected to [0-9]+ peer ranks/ { next } { print; fflush() }') &
  else
    "${run[@]}" > >(awk -v p="[process $i] " '/connected to [0-9]+ peer ranks/ { next } { print p $0; fflush() }' >&2) 2>&1 &
  fi
  pids+=($!)
  say "process $i of $n: pid $!"
done
say "coordinator 127.0.0.1:$port, $((total / n)) CPU devices per process, heartbeat timeout ${heartbeat}s"
}

interrupts=0
# shellcheck disable=SC2329  # invoked by the traps below
forward() {  # $1: signal received by this script
  interrupts=$((interrupts + 1))
  if [ "$1" = INT ] && ((interrupts > 1)); then
    say "second interrupt: killing all processes"
    kill -KILL "${pids[@]}" 2>/dev/null
  else
    say "SIG$1 received: asking every process to save and stop (SIGTERM)"
    kill -TERM "${pids[@]}" 2>/dev/null
  fi
}
trap 'forward TERM' TERM
trap 'forward INT' INT

describe() {  # $1: exit status from wait
  local code=$1
  if [ "$code" -eq 75 ]; then echo "exited with 75 (preempted: checkpoint saved; rerun to resume)"
  elif [ "$code" -eq 69 ]; then echo "exited with 69 (lost contact with another process)"
  elif [ "$code" -eq 70 ]; then echo "exited with 70 (hung: no step finished in time; stacks in the run dir)"
  elif [ "$code" -eq 65 ]; then echo "exited with 65 (non-finite loss or gradients)"
  elif [ "$code" -eq 134 ]; then echo "aborted (SIGABRT, exit 134; JAX does this when another process stops sending heartbeats)"
  elif [ "$code" -gt 128 ]; then echo "was killed by SIG$(kill -l $((code - 128)) 2>/dev/null) (exit $code)"
  else echo "exited with $code"; fi
}

severity() {  # which failure is the cause: killed by a signal > other errors > lost a peer (69, 134)
  local code=$1
  if [ "$code" -eq 69 ] || [ "$code" -eq 134 ] || [ "$code" -eq 70 ]; then echo 1; elif [ "$code" -gt 128 ]; then echo 3; else echo 2; fi
}

supervise() {  # waits for every process of the attempt; sets first_code
codes=()
running=$n
first_code=0
first_failed=""
hung=()  # processes that neither worked nor exited: killed by this script
deadline=0  # once a process failed, the others get the heartbeat timeout plus a margin to stop
while ((running > 0)); do
  candidate=""  # the most telling failure among the processes that ended since the last poll
  for ((i = 0; i < n; i++)); do
    [ -z "${codes[i]:-}" ] || continue
    kill -0 "${pids[i]}" 2>/dev/null && continue
    wait "${pids[i]}" 2>/dev/null
    codes[i]=$?
    running=$((running - 1))
    [ "${codes[i]}" -ne 0 ] || continue
    say "process $i (pid ${pids[i]}) $(describe "${codes[i]}")"
    if [ -z "$candidate" ] || [ "$(severity "${codes[i]}")" -gt "$(severity "${codes[candidate]}")" ]; then
      candidate=$i
    fi
  done
  if [ -z "$first_failed" ] && [ -n "$candidate" ]; then
    first_failed=$candidate; first_code=${codes[candidate]}
    ((first_code == 75)) || deadline=$((SECONDS + heartbeat + 30))  # a preempted run is saving
  fi
  if ((running > 0 && deadline > 0 && SECONDS >= deadline)); then
    say "processes still running ${heartbeat}+30 s after process $first_failed failed: killing them"
    for ((i = 0; i < n; i++)); do
      [ -n "${codes[i]:-}" ] || { kill -KILL "${pids[i]}" 2>/dev/null; hung+=("$i"); }
    done
    deadline=0
  fi
  ((running > 0)) && sleep 0.2
done 2>/dev/null

if ((first_code == 75)); then
  say "run preempted: every process saved the same step; rerun the same command to resume"
elif [ -n "$first_failed" ] && [ "$(severity "$first_code")" -eq 1 ] && ((${#hung[@]} > 0)); then
  say "run failed: process ${hung[*]} stopped responding (process $first_failed $(describe "$first_code")); killed it"
elif [ -n "$first_failed" ]; then
  say "run failed: process $first_failed failed first: it $(describe "$first_code")"
fi
}

attempt=0
while :; do
  launch
  supervise
  case $first_code in 0 | 2 | 65 | 75) break ;; esac
  ((interrupts == 0)) || break  # killed by a second Ctrl-C: the user wants it stopped
  ((attempt < restarts)) || { ((restarts == 0)) || say "no restarts left (--restarts $restarts)"; break; }
  attempt=$((attempt + 1))
  say "restart $attempt of $restarts: starting all $n processes again (they resume from the newest restorable checkpoint)"
done
exit "$first_code"
