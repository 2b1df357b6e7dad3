#!/usr/bin/env bash
# Launch SGLang prefill-decode disaggregation over the MORI-IO backend (sglang-mori), with the router.
#
# One node (GPU sets; ":" separates servers, each server's TP = its GPU count):
#   launch_pd.sh --model-path M --prefill-gpus 0,1,2,3 --decode-gpus 4,5,6,7            # 1P1D, TP4
#   launch_pd.sh --model-path M --prefill-gpus 0,1:2,3 --decode-gpus 4,5:6,7            # 2P2D, TP2
# Several nodes (one role per node; then the router anywhere):
#   launch_pd.sh --role prefill --model-path M --host 10.0.0.1 --gpus 0-7 --ib-device mlx5_0,mlx5_1
#   launch_pd.sh --role decode  --model-path M --host 10.0.0.2 --gpus 0-7 --ib-device mlx5_0,mlx5_1
#   launch_pd.sh --role router  --host 10.0.0.3 --prefill-addr 10.0.0.1:30000@8998 --decode-addr 10.0.0.2:30000
# This machine, no GPU (software engine, tiny model):
#   launch_pd.sh --cpu-demo
#
# Options:
#   --host ADDR          address servers bind to and advertise (default 127.0.0.1; set it for multi-node)
#   --port N             first prefill HTTP port (default 30000); decode starts at N+1000; +10 per server
#   --bootstrap-port N   first prefill bootstrap port (default 8998; +1 per prefill server)
#   --router-port N      router port (default 8000); its metrics on N+1 (bound to --host)
#   --ib-device LIST     RDMA devices (SGLang --disaggregation-ib-device, becomes MORI_RDMA_DEVICES)
#   --xgmi | --no-xgmi   XGMI between same-node GPUs (SGLANG_MORI_XGMI=1); default on for one node
#   --tp N               TP size per server (default: GPUs per server)
#   --server-args "..."  extra args for every server; --prefill-args / --decode-args / --router-args
#                        (--router-args overrides the router's failure-handling flags set here)
#   --log-dir DIR        logs and the pid file (default ./pd-logs)
#   --health-timeout S   bounded wait for /health of every process (default 900; 300 with --cpu-demo)
#   --python PATH        interpreter with sglang, sglang-router and sglang-mori (default python3)
#   --dry-run            print the commands (with their environment) and exit
#   --detach             exit after the health wait and leave the processes running
#   --no-warmup          skip the one-token request through the router that ends the wait
#   --stop               stop the processes recorded in LOG_DIR/pids (only those)
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_DIR="$(dirname "$SCRIPT_DIR")"

MODE=node ROLE="" MODEL="" HOST=127.0.0.1 PORT=30000 BOOT_PORT=8998 ROUTER_PORT=8000
PREFILL_GPUS="" DECODE_GPUS="" GPUS="" IB_DEVICE="" XGMI="" TP=""
SERVER_ARGS="" PREFILL_ARGS="" DECODE_ARGS="" ROUTER_ARGS=""
LOG_DIR=./pd-logs HEALTH_TIMEOUT="" PYTHON="${PYTHON:-}" DRY_RUN=0 DETACH=0 STOP=0 CPU_DEMO=0 WARMUP=1
PREFILL_ADDRS=() DECODE_ADDRS=()

die() { echo "launch_pd.sh: $*" >&2; exit 2; }
need() { [ $# -ge 2 ] && [ -n "$2" ] || die "$1 needs a value"; }

while [ $# -gt 0 ]; do
  case "$1" in
    --model-path) need "$@"; MODEL="$2"; shift ;;
    --prefill-gpus) need "$@"; PREFILL_GPUS="$2"; shift ;;
    --decode-gpus) need "$@"; DECODE_GPUS="$2"; shift ;;
    --role) need "$@"; ROLE="$2"; MODE=role; shift ;;
    --gpus) need "$@"; GPUS="$2"; shift ;;
    --prefill-addr) need "$@"; PREFILL_ADDRS+=("$2"); shift ;;
    --decode-addr) need "$@"; DECODE_ADDRS+=("$2"); shift ;;
    --host) need "$@"; HOST="$2"; shift ;;
    --port) need "$@"; PORT="$2"; shift ;;
    --bootstrap-port) need "$@"; BOOT_PORT="$2"; shift ;;
    --router-port) need "$@"; ROUTER_PORT="$2"; shift ;;
    --ib-device) need "$@"; IB_DEVICE="$2"; shift ;;
    --xgmi) XGMI=1 ;;
    --no-xgmi) XGMI=0 ;;
    --tp) need "$@"; TP="$2"; shift ;;
    --server-args) need "$@"; SERVER_ARGS="$2"; shift ;;
    --prefill-args) need "$@"; PREFILL_ARGS="$2"; shift ;;
    --decode-args) need "$@"; DECODE_ARGS="$2"; shift ;;
    --router-args) need "$@"; ROUTER_ARGS="$2"; shift ;;
    --log-dir) need "$@"; LOG_DIR="$2"; shift ;;
    --health-timeout) need "$@"; HEALTH_TIMEOUT="$2"; shift ;;
    --python) need "$@"; PYTHON="$2"; shift ;;
    --cpu-demo) CPU_DEMO=1 ;;
    --dry-run) DRY_RUN=1 ;;
    --detach) DETACH=1 ;;
    --no-warmup) WARMUP=0 ;;
    --stop) STOP=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
  shift
done

PID_FILE="$LOG_DIR/pids"

# --stop: end exactly the processes this script recorded, by PID (their process groups).
if [ "$STOP" = 1 ]; then
  [ -f "$PID_FILE" ] || die "no $PID_FILE: nothing recorded to stop"
  pids=()
  while read -r pid name; do
    if kill -0 "$pid" 2>/dev/null; then
      kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
      pids+=("$pid"); echo "stopping $name (pid $pid)"
    fi
  done < "$PID_FILE"
  # Bounded: 30 s for a graceful exit, then SIGKILL to the same process groups.
  for _ in $(seq 30); do
    alive=0; for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break; sleep 1
  done
  for pid in "${pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true; done
  rm -f "$PID_FILE"
  echo "stopped"
  exit 0
fi

if [ -z "$PYTHON" ]; then
  if [ "$CPU_DEMO" = 1 ] && [ -x "$REPO_DIR/.venv/bin/python" ]; then PYTHON="$REPO_DIR/.venv/bin/python"; else PYTHON=python3; fi
fi

# ---- what to launch: a list of "kind|name|port|bootstrap|gpus" rows ---------------------------
expand_gpus() {  # "0-3,6" -> "0,1,2,3,6"
  local out=() part a b i
  IFS=, read -r -a parts <<< "$1"
  for part in "${parts[@]}"; do
    if [[ "$part" =~ ^([0-9]+)-([0-9]+)$ ]]; then
      a=${BASH_REMATCH[1]} b=${BASH_REMATCH[2]}
      [ "$a" -le "$b" ] || die "bad GPU range $part"
      for ((i = a; i <= b; i++)); do out+=("$i"); done
    elif [[ "$part" =~ ^[0-9]+$ ]]; then
      out+=("$part")
    else
      die "bad GPU list '$1' (use e.g. 0,1,2,3 or 0-3; ':' separates servers)"
    fi
  done
  (IFS=,; echo "${out[*]}")
}

ROWS=()
add_servers() {  # kind "groups" first-port step-for-bootstrap
  local kind=$1 groups=$2 port=$3 i=0 group
  IFS=: read -r -a gs <<< "$groups"
  for group in "${gs[@]}"; do
    ROWS+=("$kind|$kind$i|$((port + 10 * i))|$((BOOT_PORT + i))|$(expand_gpus "$group")")
    i=$((i + 1))
  done
}

if [ "$CPU_DEMO" = 1 ]; then
  [ "$MODE" = node ] || die "--cpu-demo runs every process on this machine; drop --role"
  [ -z "$PREFILL_GPUS$DECODE_GPUS" ] || die "--cpu-demo uses no GPU"
  HOST=127.0.0.1
  ROWS=("prefill|prefill0|$PORT|$BOOT_PORT|" "decode|decode0|$((PORT + 1000))||")
  HEALTH_TIMEOUT=${HEALTH_TIMEOUT:-300}
  if [ -z "$MODEL" ]; then
    MODEL="$LOG_DIR/tiny-model"
    BUILD_MODEL=1
  fi
elif [ "$MODE" = node ]; then
  [ -n "$PREFILL_GPUS" ] && [ -n "$DECODE_GPUS" ] || die "one node needs --prefill-gpus and --decode-gpus (or --role, or --cpu-demo)"
  add_servers prefill "$PREFILL_GPUS" "$PORT"
  add_servers decode "$DECODE_GPUS" "$((PORT + 1000))"
  XGMI=${XGMI:-1}  # same node: XGMI between the prefill and decode GPUs
else
  case "$ROLE" in
    prefill) add_servers prefill "${GPUS:?--role prefill needs --gpus}" "$PORT" ;;
    decode) add_servers decode "${GPUS:?--role decode needs --gpus}" "$PORT" ;;
    router)
      [ ${#PREFILL_ADDRS[@]} -gt 0 ] && [ ${#DECODE_ADDRS[@]} -gt 0 ] \
        || die "--role router needs --prefill-addr HOST:PORT@BOOTSTRAP and --decode-addr HOST:PORT" ;;
    *) die "--role must be prefill, decode or router" ;;
  esac
  XGMI=${XGMI:-0}  # across nodes the KV goes over RDMA
fi
HEALTH_TIMEOUT=${HEALTH_TIMEOUT:-900}
[ "$MODE" = role ] && [ "$ROLE" = router ] || [ -n "$MODEL" ] || die "--model-path is required"
if [ "$MODE" = role ] && [ "$HOST" = 127.0.0.1 ]; then
  echo "launch_pd.sh: warning: --host 127.0.0.1 is not reachable from other nodes" >&2
fi

# ---- command lines ------------------------------------------------------------------------------
q() { printf '%q' "$1"; }

server_cmd() {  # kind name port bootstrap gpus -> "ENV=... python -m sglang.launch_server ..."
  local kind=$1 port=$3 boot=$4 gpus=$5 env=() args=() tp
  if [ "$CPU_DEMO" = 1 ]; then
    env+=("SGLANG_MORI_ENGINE=soft" "SGLANG_HOST_IP=127.0.0.1" "HF_HUB_OFFLINE=1"
          "PYTHONPATH=$(q "${SGLANG_MORI_CPU_STUBS:-$SCRIPT_DIR/cpu_stubs}")${PYTHONPATH:+:$PYTHONPATH}"
          "OMP_NUM_THREADS=1")
  else
    env+=("HIP_VISIBLE_DEVICES=$gpus")
    [ "$XGMI" = 1 ] && env+=("SGLANG_MORI_XGMI=1")
    [ "$MODE" = role ] && env+=("SGLANG_HOST_IP=$HOST")
  fi
  tp=${TP:-$(awk -F, '{print NF}' <<< "$gpus")}
  args+=(-m sglang.launch_server --model-path "$(q "$MODEL")" --host "$HOST" --port "$port"
         --disaggregation-mode "$kind" --disaggregation-transfer-backend mori)
  [ "$CPU_DEMO" = 1 ] || args+=(--tp-size "$tp")
  [ "$kind" = prefill ] && args+=(--disaggregation-bootstrap-port "$boot")
  [ -n "$IB_DEVICE" ] && args+=(--disaggregation-ib-device "$(q "$IB_DEVICE")")
  if [ "$CPU_DEMO" = 1 ]; then
    # The CPU recipe (reasons in test/harness/launch.py): no CUDA/HIP kernels, a small KV pool,
    # no overlap scheduling on prefill (it records CUDA events), decode retraction backup in a tensor.
    args+=(--device cpu --attention-backend torch_native --max-total-tokens 8192)
    [ "$kind" = prefill ] && args+=(--disable-overlap-schedule)
    [ "$kind" = decode ] && args+=(--disaggregation-decode-retraction-backup cpu_tensor)
  fi
  [ -n "$SERVER_ARGS" ] && args+=($SERVER_ARGS)
  [ "$kind" = prefill ] && [ -n "$PREFILL_ARGS" ] && args+=($PREFILL_ARGS)
  [ "$kind" = decode ] && [ -n "$DECODE_ARGS" ] && args+=($DECODE_ARGS)
  echo "${env[*]} $(q "$PYTHON") ${args[*]}"
}

router_cmd() {
  local args=(-m sglang_router.launch_router --pd-disaggregation) row kind name port boot gpus addr
  if [ "$MODE" = role ]; then
    for addr in "${PREFILL_ADDRS[@]}"; do
      [[ "$addr" == *@* ]] || addr="$addr@8998"
      args+=(--prefill "http://${addr%@*}" "${addr#*@}")
    done
    for addr in "${DECODE_ADDRS[@]}"; do args+=(--decode "http://$addr"); done
  else
    for row in "${ROWS[@]}"; do
      IFS='|' read -r kind name port boot gpus <<< "$row"
      if [ "$kind" = prefill ]; then args+=(--prefill "http://$HOST:$port" "$boot"); else args+=(--decode "http://$HOST:$port"); fi
    done
  fi
  # The router's metrics listener defaults to 0.0.0.0:29000; keep it on our host and next to the router.
  args+=(--host "$HOST" --port "$ROUTER_PORT" --prometheus-host "$HOST" --prometheus-port "$((ROUTER_PORT + 1))")
  # Failure handling (docs/deployment.md "Router failure handling", issue 29). sglang_router counts a
  # PD request's final status against the prefill too, so a decode restart or a slow link opens the
  # prefill's breaker; its default 60 s before half-open then refuses all traffic for a minute after
  # the fault. 1 s brings it back at once; 20 consecutive failed attempts (not 10) keep the retries
  # of the requests one slow link caught from opening it at all at moderate load; 3 attempts per
  # request (not 5) keep a request's worst case at 3 transfer deadlines. The health checks
  # (every 2 s, 3 misses) take a dead server out in about 6 s: a request sent to a dead prefill fails
  # only after decode gives up on its bootstrap, too slowly for the breaker. --router-args comes
  # after these and overrides them.
  args+=(--cb-failure-threshold 20 --cb-success-threshold 2 --cb-timeout-duration-secs 1)
  args+=(--health-check-interval-secs 2 --health-check-timeout-secs 5 --health-failure-threshold 3 --health-success-threshold 1)
  args+=(--retry-max-retries 3)
  [ -n "$ROUTER_ARGS" ] && args+=($ROUTER_ARGS)
  echo "$(q "$PYTHON") ${args[*]}"
}

PLAN=()  # "name|url|command"
for row in "${ROWS[@]}"; do
  IFS='|' read -r kind name port boot gpus <<< "$row"
  PLAN+=("$name|http://$HOST:$port|$(server_cmd "$kind" "$name" "$port" "$boot" "$gpus")")
done
if [ "$MODE" = node ] || [ "$ROLE" = router ]; then
  PLAN+=("router|http://$HOST:$ROUTER_PORT|$(router_cmd)")
fi

if [ "$DRY_RUN" = 1 ]; then
  [ "${BUILD_MODEL:-0}" = 1 ] && echo "# build tiny model: PYTHONPATH=$(q "$REPO_DIR/test") $(q "$PYTHON") -m harness.tiny_model $(q "$MODEL")"
  for p in "${PLAN[@]}"; do IFS='|' read -r name url cmd <<< "$p"; echo "# $name $url"; echo "$cmd"; done
  exit 0
fi

# ---- run ----------------------------------------------------------------------------------------
mkdir -p "$LOG_DIR"
if [ -f "$PID_FILE" ]; then
  while read -r pid _; do kill -0 "$pid" 2>/dev/null && die "processes from an earlier launch still run ($PID_FILE); use --stop"; done < "$PID_FILE"
fi
: > "$PID_FILE"
if [ "${BUILD_MODEL:-0}" = 1 ] && [ ! -f "$MODEL/config.json" ]; then
  echo "building a tiny model in $MODEL"
  PYTHONPATH="$REPO_DIR/test" "$PYTHON" -m harness.tiny_model "$MODEL" > "$LOG_DIR/tiny-model.log" 2>&1 \
    || { cat "$LOG_DIR/tiny-model.log" >&2; die "could not build the tiny model"; }
fi

STARTED=()
cleanup() {
  [ "$DETACH" = 1 ] && return
  for pid in "${STARTED[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true; done
  rm -f "$PID_FILE"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

for p in "${PLAN[@]}"; do
  IFS='|' read -r name url cmd <<< "$p"
  echo "starting $name: $cmd" > "$LOG_DIR/$name.log"
  # Own process group per server (setsid), so --stop and cleanup end its children too.
  setsid bash -c "exec env $cmd" >> "$LOG_DIR/$name.log" 2>&1 < /dev/null &
  STARTED+=("$!")
  echo "$! $name" >> "$PID_FILE"
  echo "started $name (pid $!), log $LOG_DIR/$name.log"
done

# Bounded wait: every process answers /health with 200, or we stop and show why.
deadline=$(( $(date +%s) + HEALTH_TIMEOUT ))
i=0
for p in "${PLAN[@]}"; do
  IFS='|' read -r name url _ <<< "$p"
  pid=${STARTED[$i]}; i=$((i + 1))
  until curl -fsS -o /dev/null --max-time 5 "$url/health" 2>/dev/null; do
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "$name exited before becoming healthy; last log lines:" >&2; tail -n 30 "$LOG_DIR/$name.log" >&2; exit 1
    fi
    if [ "$(date +%s)" -ge "$deadline" ]; then
      echo "$name not healthy after ${HEALTH_TIMEOUT}s; last log lines:" >&2; tail -n 30 "$LOG_DIR/$name.log" >&2; exit 1
    fi
    sleep 2
  done
  echo "healthy: $name $url"
done

# The router can report healthy before it has admitted its workers: prove the whole path with one
# one-token request through it (same deadline), so "ready" means a request would succeed.
if { [ "$MODE" = node ] || [ "$ROLE" = router ]; } && [ "$WARMUP" = 1 ]; then
  until curl -fsS -o /dev/null --max-time 60 -H 'Content-Type: application/json' \
      -d '{"text": "warm up", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}' \
      "http://$HOST:$ROUTER_PORT/generate" 2>/dev/null; do
    if [ "$(date +%s)" -ge "$deadline" ]; then
      echo "no request succeeded through the router within ${HEALTH_TIMEOUT}s; see $LOG_DIR/*.log" >&2; exit 1
    fi
    sleep 2
  done
  echo "ready: a request went through router -> prefill -> decode"
fi

echo
echo "endpoints:"
for p in "${PLAN[@]}"; do IFS='|' read -r name url _ <<< "$p"; echo "  $name  $url"; done
for row in "${ROWS[@]}"; do
  IFS='|' read -r kind name port boot gpus <<< "$row"
  [ "$kind" = prefill ] && echo "  $name bootstrap  $HOST:$boot   (sglang-mori doctor --bootstrap $HOST:$boot)"
done
if [ "$MODE" = node ] || [ "$ROLE" = router ]; then
  echo "  try: curl -s http://$HOST:$ROUTER_PORT/v1/completions -H 'Content-Type: application/json' \\"
  echo "         -d '{\"model\": \"default\", \"prompt\": \"hello\", \"max_tokens\": 8}'"
fi
if [ "$DETACH" = 1 ]; then
  echo "detached; stop with: $0 --stop --log-dir $LOG_DIR"
  exit 0
fi
echo "Ctrl-C stops everything"
wait -n "${STARTED[@]}" || true
echo "a process exited; stopping the rest" >&2
exit 1
