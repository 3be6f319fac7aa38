#!/usr/bin/env bash
# A whole kvmesh cluster on this machine: etcd, one gateway node and any number of worker
# nodes, each a background process with its log and pid file in one run folder.
# `cluster.sh --help` says how to use it.
# (A && B || C below is meant as written; cluster.env, sourced, sets NODES and the like.)
# shellcheck disable=SC2015,SC2153
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_DIR="$(cd "$SCRIPT_DIR/../.." && pwd)"
PROG="${0##*/}"

usage() {
    cat <<EOF
Usage: $PROG COMMAND [OPTIONS] [-- NODE_FLAGS...]

Runs a kvmesh cluster on this machine: etcd on a free loopback port, one gateway node
(--roles gateway,router) and the worker nodes you ask for. Every process writes its log
and pid file into the run folder.

Commands:
  up        start etcd, the gateway and the workers; wait until the gateway answers
            /health and its router is connected to every worker
  down      stop everything: SIGTERM, wait, then SIGKILL whatever is left
  status    which processes live, then \`kvmesh cluster status\`
  logs      the last lines of every log; \`logs NAME\` shows one (gateway, worker-1, etcd, ...)
  url       print the gateway's URL

Options (up):
  -w, --workers SPEC      the worker nodes (default: \$WORKERS, else worker:sim:2). SPEC is a
                          list of ROLE[:BACKEND[:COUNT]][@MODEL] separated by commas or spaces:
                            ROLE     worker, prefill, decode, or prefill+decode (one node)
                            BACKEND  sim (no math, a timing model; default) or cpu
                            COUNT    how many such nodes (default 1)
                            MODEL    a Hugging Face model folder for these nodes (default:
                                     --model, else the embedded model); the gateway serves
                                     every model its workers serve
                          A bare number N means N x worker:sim.
                          e.g. "worker:sim:2", "worker:cpu:2", "prefill:cpu,decode:cpu",
                          "worker:cpu worker:cpu@/models/qwen2"
  -p, --port PORT         the gateway's HTTP port (default: \$KVMESH_PORT, else a free one)
      --host HOST         the gateway's HTTP address (default: 127.0.0.1)
  -c, --cluster NAME      the cluster's name in etcd (default: \$KVMESH_CLUSTER, else local)
      --etcd URL          use this running etcd instead of starting one
      --model DIR         a Hugging Face model folder for every node, the gateway included
                          (default: the workers' own; the embedded model)
      --policy POLICY     the router's policy (round-robin, least-loaded, power-of-two, prefix)
      --shutdown-grace S  seconds a node lets running requests finish on SIGTERM (node default 30)
      --timeout S         how long up waits for the cluster (default: 120)
  Everything after -- is passed to every node (e.g. -- --sim-speed 3 --threads 1).

Options (down):
      --timeout S         seconds between SIGTERM and SIGKILL (default: the nodes' shutdown
                          grace + 15, i.e. 45)
Options (logs):
  -n, --lines N           lines per log (default: 20 for all, 100 for one)
  -f, --follow            keep following (tail -f)

Options (all commands):
      --run-dir DIR       the run folder (default: \$KVMESH_RUN_DIR, else deploy/local/run)
  -h, --help              this text

Environment:
  KVMESH_BIN       the kvmesh binary (default: target/release/kvmesh, else target/debug/kvmesh,
                   else kvmesh on PATH)
  ETCD_BIN         the etcd binary (default: etcd on PATH; Debian: apt-get install etcd-server)
  KVMESH_RUN_DIR, WORKERS, KVMESH_PORT, KVMESH_CLUSTER: defaults for the options above
  RUST_LOG         the nodes' log filter (default info)

Examples:
  $PROG up                                    # etcd, a gateway and two sim workers
  $PROG up -w "worker:cpu prefill:cpu decode:cpu" -p 8000
  $PROG up -w prefill:cpu,decode:cpu -- --threads 1
  $PROG up -w 4 -- --kv-cache-gib 0.25        # a sim worker's KV cache is real memory too:
                                              # about 300 MiB each instead of 1.1 GiB
  $PROG status
  $PROG logs worker-1 -f
  $PROG down
EOF
}

die() {
    echo "$PROG: $*" >&2
    exit 1
}

note() {
    echo "$PROG: $*" >&2
}

# ---------------------------------------------------------------------------------------------
# Options

COMMAND=""
RUN_DIR="${KVMESH_RUN_DIR:-$SCRIPT_DIR/run}"
WORKERS_SPEC="${WORKERS:-worker:sim:2}"
PORT="${KVMESH_PORT:-0}"
HOST="127.0.0.1"
CLUSTER="${KVMESH_CLUSTER:-local}"
EXTERNAL_ETCD=""
MODEL=""
POLICY=""
GRACE=""
TIMEOUT=""
LINES=""
FOLLOW=0
LOG_NAME=""
NODE_FLAGS=()

need_value() {
    [ "$#" -ge 2 ] && [ -n "$2" ] || die "$1 needs a value (see --help)"
}

while [ "$#" -gt 0 ]; do
    case "$1" in
        -h | --help | help)
            usage
            exit 0
            ;;
        --run-dir) need_value "$@"; RUN_DIR="$2"; shift 2 ;;
        -w | --workers) need_value "$@"; WORKERS_SPEC="$2"; shift 2 ;;
        -p | --port) need_value "$@"; PORT="$2"; shift 2 ;;
        --host) need_value "$@"; HOST="$2"; shift 2 ;;
        -c | --cluster) need_value "$@"; CLUSTER="$2"; shift 2 ;;
        --etcd) need_value "$@"; EXTERNAL_ETCD="$2"; shift 2 ;;
        --model) need_value "$@"; MODEL="$2"; shift 2 ;;
        --policy) need_value "$@"; POLICY="$2"; shift 2 ;;
        --shutdown-grace) need_value "$@"; GRACE="$2"; shift 2 ;;
        --timeout) need_value "$@"; TIMEOUT="$2"; shift 2 ;;
        -n | --lines) need_value "$@"; LINES="$2"; shift 2 ;;
        -f | --follow) FOLLOW=1; shift ;;
        --)
            shift
            NODE_FLAGS=("$@")
            break
            ;;
        -*) die "unknown option $1 (see --help)" ;;
        *)
            if [ -z "$COMMAND" ]; then
                COMMAND="$1"
            elif [ "$COMMAND" = logs ] && [ -z "$LOG_NAME" ]; then
                LOG_NAME="$1"
            else
                die "unexpected argument '$1' (see --help)"
            fi
            shift
            ;;
    esac
done

is_uint() {
    [[ "$1" =~ ^[0-9]+$ ]]
}

[ -n "$COMMAND" ] || {
    usage >&2
    exit 2
}
is_uint "$PORT" || die "--port must be a port number, not '$PORT'"
[ -z "$TIMEOUT" ] || is_uint "$TIMEOUT" || die "--timeout must be whole seconds, not '$TIMEOUT'"
[ -z "$LINES" ] || is_uint "$LINES" || die "--lines must be a number, not '$LINES'"
[ -z "$GRACE" ] || [[ "$GRACE" =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "--shutdown-grace must be seconds, not '$GRACE'"
[[ "$CLUSTER" =~ ^[A-Za-z0-9._-]+$ ]] || die "--cluster may hold letters, digits, '.', '_' and '-' only"

ENV_FILE="$RUN_DIR/cluster.env"

# ---------------------------------------------------------------------------------------------
# Helpers

find_kvmesh() {
    if [ -n "${KVMESH_BIN:-}" ]; then
        [ -x "$KVMESH_BIN" ] || die "KVMESH_BIN=$KVMESH_BIN is not an executable file"
        echo "$KVMESH_BIN"
    elif [ -x "$REPO_DIR/target/release/kvmesh" ]; then
        echo "$REPO_DIR/target/release/kvmesh"
    elif [ -x "$REPO_DIR/target/debug/kvmesh" ]; then
        echo "$REPO_DIR/target/debug/kvmesh"
    elif command -v kvmesh >/dev/null 2>&1; then
        command -v kvmesh
    else
        die "no kvmesh binary: build one (cargo build --release), put kvmesh on PATH, or set KVMESH_BIN"
    fi
}

find_etcd() {
    if [ -n "${ETCD_BIN:-}" ]; then
        [ -x "$ETCD_BIN" ] || die "ETCD_BIN=$ETCD_BIN is not an executable file"
        echo "$ETCD_BIN"
        return
    fi
    local b
    for b in "$(command -v etcd 2>/dev/null || true)" /usr/bin/etcd /usr/local/bin/etcd; do
        if [ -n "$b" ] && [ -x "$b" ]; then
            echo "$b"
            return
        fi
    done
    die "no etcd binary: install Debian's etcd-server (apt-get install etcd-server), set ETCD_BIN, or pass --etcd URL"
}

# Whether a process runs (a zombie, exited but not yet reaped by its new parent, does not).
alive() {
    local pid="$1"
    kill -0 "$pid" 2>/dev/null || return 1
    if [ -r "/proc/$pid/stat" ]; then
        local stat
        stat="$(cat "/proc/$pid/stat" 2>/dev/null)" || return 1
        # The state is the first field after the command name's closing parenthesis.
        stat="${stat##*) }"
        [ "${stat%% *}" != Z ] || return 1
    fi
    return 0
}

# Whether pid $1 is the process that pid file $2 names (and not a later one that got its
# number): its command line must hold the marker written next to the pid.
is_ours() {
    local pid="$1" name="$2"
    alive "$pid" || return 1
    [ -r "/proc/$pid/cmdline" ] || return 0
    local cmdline
    cmdline="$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null)" || return 1
    if [ "$name" = etcd ]; then
        [[ "$cmdline" == *"--data-dir=$RUN_DIR/etcd-data"* ]]
    else
        [[ "$cmdline" == *" --node-id $name "* ]]
    fi
}

read_pid() {
    local f="$RUN_DIR/$1.pid"
    [ -f "$f" ] || return 1
    local pid
    pid="$(head -n1 "$f" 2>/dev/null)"
    is_uint "$pid" || return 1
    echo "$pid"
}

# The names of every process with a pid file: nodes first, etcd last.
pid_names() {
    local f n names=() has_etcd=0
    for f in "$RUN_DIR"/*.pid; do
        [ -e "$f" ] || continue
        n="${f##*/}"
        n="${n%.pid}"
        if [ "$n" = etcd ]; then
            has_etcd=1
        else
            names+=("$n")
        fi
    done
    [ "$has_etcd" = 0 ] || names+=(etcd)
    [ "${#names[@]}" -eq 0 ] || printf '%s\n' "${names[@]}"
}

port_in_use() {
    local port="$1"
    if command -v ss >/dev/null 2>&1; then
        ss -Htan "sport = :$port" 2>/dev/null | grep -q . && return 0
        return 1
    fi
    (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null
}

# A port nothing uses now, below the kernel's ephemeral range so that outgoing
# connections do not take it meanwhile.
free_port() {
    local p i
    for i in $(seq 1 200); do
        p=$((20000 + RANDOM % 12000))
        if ! port_in_use "$p"; then
            echo "$p"
            return
        fi
    done
    die "found no free port in 20000-31999"
}

http_get() {
    curl -fsS --max-time 3 "$1" 2>/dev/null
}

log_tail() {
    local name="$1" n="${2:-20}"
    if [ -f "$RUN_DIR/$name.log" ]; then
        echo "--- $RUN_DIR/$name.log (last $n lines) ---" >&2
        tail -n "$n" "$RUN_DIR/$name.log" >&2
    fi
}

load_env() {
    [ -f "$ENV_FILE" ] || return 1
    # shellcheck source=/dev/null
    . "$ENV_FILE"
}

# ---------------------------------------------------------------------------------------------
# up

WORKER_IDS=()
WORKER_ROLES=()
WORKER_BACKENDS=()
WORKER_MODELS=()

parse_workers() {
    local spec="${1//,/ }" item role backend count extra i model
    declare -A seen=()
    for item in $spec; do
        model=""
        if [[ "$item" == *@* ]]; then
            model="${item#*@}"
            item="${item%%@*}"
            [ -n "$model" ] || die "bad worker '$item@': MODEL after @ is empty"
            [ -d "$model" ] || die "bad worker '$item@$model': $model is not a model folder"
        fi
        if is_uint "$item"; then
            role=worker backend=sim count="$item"
        else
            IFS=: read -r role backend count extra <<<"$item"
            [ -z "$extra" ] || die "bad worker '$item': ROLE[:BACKEND[:COUNT]]"
            backend="${backend:-sim}"
            count="${count:-1}"
        fi
        case "$role" in
            worker | prefill | decode) ;;
            prefill+decode | decode+prefill) role="prefill,decode" ;;
            *) die "bad worker '$item': the role is worker, prefill, decode or prefill+decode" ;;
        esac
        case "$backend" in
            sim | cpu) ;;
            *) die "bad worker '$item': the backend is sim or cpu" ;;
        esac
        is_uint "$count" && [ "$count" -ge 1 ] || die "bad worker '$item': COUNT must be 1 or more"
        local stem="${role/prefill,decode/pd}"
        for ((i = 0; i < count; i++)); do
            seen[$stem]=$((${seen[$stem]:-0} + 1))
            WORKER_IDS+=("$stem-${seen[$stem]}")
            WORKER_ROLES+=("$role")
            WORKER_BACKENDS+=("$backend")
            WORKER_MODELS+=("$model")
        done
    done
    [ "${#WORKER_IDS[@]}" -ge 1 ] || die "no workers in '$1'"
    # A prefill node only hands its KV to a decoding node: every model needs a worker or
    # decode node, or the cluster would come up unable to serve anything.
    declare -A decodes=()
    for i in "${!WORKER_IDS[@]}"; do
        case "${WORKER_ROLES[$i]}" in
            *worker* | *decode*) decodes["m:${WORKER_MODELS[$i]}"]=1 ;;
        esac
    done
    for i in "${!WORKER_IDS[@]}"; do
        [ -n "${decodes["m:${WORKER_MODELS[$i]}"]:-}" ] ||
            die "bad workers '$1': ${WORKER_MODELS[$i]:-the default model} has prefill nodes but no worker or decode node to serve it"
    done
    # The sim backend makes its tokens up: its nodes and those computing the model never
    # serve one model name together (routers keep them apart by fingerprint).
    declare -A backend_of=()
    for i in "${!WORKER_IDS[@]}"; do
        local key="m:${WORKER_MODELS[$i]}" b="${WORKER_BACKENDS[$i]}"
        [ "${backend_of[$key]:-$b}" = "$b" ] ||
            die "bad workers '$1': ${WORKER_MODELS[$i]:-${MODEL:-the embedded model}} has both sim and cpu nodes; the sim backend's tokens are not the model's, so one model is served by one of them (give the others another model with @MODEL)"
        backend_of[$key]="$b"
    done
    # What the gateway's --model is computed by: the backend of the nodes serving it.
    MODEL_BACKEND="${backend_of["m:"]:-}"
}

# Starts a background process: $1 the name (log and pid file), the rest the command.
spawn() {
    local name="$1"
    shift
    nohup "$@" >>"$RUN_DIR/$name.log" 2>&1 </dev/null &
    echo "$!" >"$RUN_DIR/$name.pid"
}

etcd_healthy() {
    http_get "$1/health" | grep -q '"health":"true"'
}

start_etcd() {
    local bin attempt cport pport deadline pid
    bin="$(find_etcd)"
    # ETCD_* variables would set etcd flags too (and clash with ours); etcd 3.4 needs
    # ETCD_UNSUPPORTED_ARCH on arm64, so that one stays (and is set there).
    local -a clear_env=()
    local v
    for v in $(compgen -e | grep '^ETCD_' || true); do
        [ "$v" = ETCD_UNSUPPORTED_ARCH ] || clear_env+=(-u "$v")
    done
    local -a arch_env=()
    if [ -z "${ETCD_UNSUPPORTED_ARCH:-}" ]; then
        case "$(uname -m)" in
            aarch64 | arm64) arch_env=(ETCD_UNSUPPORTED_ARCH=arm64) ;;
        esac
    fi
    for attempt in 1 2 3 4 5; do
        cport="$(free_port)"
        pport="$(free_port)"
        [ "$cport" != "$pport" ] || continue
        rm -rf "$RUN_DIR/etcd-data"
        ETCD_URL="http://127.0.0.1:$cport"
        echo "=== $PROG: starting etcd at $ETCD_URL (try $attempt) ===" >>"$RUN_DIR/etcd.log"
        spawn etcd env "${clear_env[@]}" "${arch_env[@]}" "$bin" \
            --name=kvmesh-local \
            --data-dir="$RUN_DIR/etcd-data" \
            --listen-client-urls="$ETCD_URL" \
            --advertise-client-urls="$ETCD_URL" \
            --listen-peer-urls="http://127.0.0.1:$pport" \
            --initial-advertise-peer-urls="http://127.0.0.1:$pport" \
            --initial-cluster="kvmesh-local=http://127.0.0.1:$pport" \
            --initial-cluster-state=new \
            --initial-cluster-token="kvmesh-local-$cport" \
            --heartbeat-interval=100 \
            --election-timeout=500
        pid="$(read_pid etcd)"
        deadline=$((SECONDS + 30))
        while [ "$SECONDS" -lt "$deadline" ]; do
            if ! alive "$pid"; then
                break
            fi
            if etcd_healthy "$ETCD_URL"; then
                return 0
            fi
            sleep 0.2
        done
        if alive "$pid"; then
            kill -KILL "$pid" 2>/dev/null || true
        fi
        rm -f "$RUN_DIR/etcd.pid"
    done
    log_tail etcd 30
    die "etcd did not start (log: $RUN_DIR/etcd.log)"
}

# The gateway's router lists every worker it knows in /status; a worker is ready when it
# is there and connected.
router_connected() {
    local status="$1" id="$2"
    # One object per line: the worker entries hold no nested objects.
    tr '{' '\n' <<<"$status" | grep -F "\"node_id\":\"$id\"" | grep -q '"connected":true'
}

cmd_up() {
    command -v curl >/dev/null 2>&1 || die "curl is needed (apt-get install curl)"
    parse_workers "$WORKERS_SPEC"
    local bin
    bin="$(find_kvmesh)"
    mkdir -p "$RUN_DIR"
    RUN_DIR="$(cd "$RUN_DIR" && pwd -P)"
    ENV_FILE="$RUN_DIR/cluster.env"

    local n pid
    while read -r n; do
        [ -n "$n" ] || continue
        pid="$(read_pid "$n" || true)"
        if [ -n "$pid" ] && is_ours "$pid" "$n"; then
            die "a cluster is already running from $RUN_DIR ($n is pid $pid): '$PROG down' first"
        fi
        rm -f "$RUN_DIR/$n.pid"
    done < <(pid_names)
    rm -f "$RUN_DIR"/*.log "$ENV_FILE"

    local timeout="${TIMEOUT:-120}"
    echo "kvmesh: $bin ($("$bin" --version 2>/dev/null || echo 'version unknown'))"

    local etcd_owned=0
    if [ -n "$EXTERNAL_ETCD" ]; then
        ETCD_URL="$EXTERNAL_ETCD"
        etcd_healthy "$ETCD_URL" || die "etcd at $ETCD_URL does not answer /health"
    else
        start_etcd
        etcd_owned=1
        echo "etcd: $ETCD_URL (pid $(read_pid etcd), data $RUN_DIR/etcd-data)"
    fi

    local -a common=(--etcd "$ETCD_URL" --cluster "$CLUSTER" --listen 127.0.0.1:0)
    [ -z "$GRACE" ] || common+=(--shutdown-grace "$GRACE")
    local -a gw_flags=(--roles "gateway,router" --host "$HOST" --port "$PORT")
    [ -z "$POLICY" ] || gw_flags+=(--policy "$POLICY")
    [ -z "$MODEL" ] || gw_flags+=(--model "$MODEL" --backend "${MODEL_BACKEND:-cpu}")

    # Plain log files: no colour codes.
    export NO_COLOR=1
    spawn gateway "$bin" node --node-id gateway "${common[@]}" "${gw_flags[@]}" "${NODE_FLAGS[@]}"
    local i
    local -a model_flags
    for i in "${!WORKER_IDS[@]}"; do
        model_flags=()
        local model="${WORKER_MODELS[$i]:-$MODEL}"
        [ -z "$model" ] || model_flags=(--model "$model")
        spawn "${WORKER_IDS[$i]}" "$bin" node --node-id "${WORKER_IDS[$i]}" "${common[@]}" \
            "${model_flags[@]}" --roles "${WORKER_ROLES[$i]}" --backend "${WORKER_BACKENDS[$i]}" \
            --status-port 0 "${NODE_FLAGS[@]}"
    done

    {
        printf 'ETCD_URL=%q\n' "$ETCD_URL"
        printf 'ETCD_OWNED=%q\n' "$etcd_owned"
        printf 'CLUSTER=%q\n' "$CLUSTER"
        printf 'KVMESH=%q\n' "$bin"
        printf 'GRACE=%q\n' "$GRACE"
        printf 'NODES=%q\n' "gateway ${WORKER_IDS[*]}"
        printf 'WORKER_NODES=%q\n' "${WORKER_IDS[*]}"
        printf 'GATEWAY_URL=\n'
    } >"$ENV_FILE"

    echo "starting the gateway and ${#WORKER_IDS[@]} worker(s): ${WORKER_IDS[*]} (waiting up to ${timeout}s)"
    local deadline=$((SECONDS + timeout)) gw_url="" status missing
    while :; do
        for n in gateway "${WORKER_IDS[@]}"; do
            pid="$(read_pid "$n" || true)"
            if [ -z "$pid" ] || ! alive "$pid"; then
                log_tail "$n" 30
                fail_up "$n exited during start-up"
            fi
        done
        if [ -z "$gw_url" ]; then
            gw_url="$(sed -n 's/^kvmesh listening on //p' "$RUN_DIR/gateway.log" | tail -n1)"
            if [ -n "$gw_url" ]; then
                printf 'GATEWAY_URL=%q\n' "$gw_url" >>"$ENV_FILE"
            fi
        fi
        missing=""
        if [ -n "$gw_url" ] && http_get "$gw_url/health" >/dev/null; then
            status="$(http_get "$gw_url/status" || true)"
            for n in "${WORKER_IDS[@]}"; do
                router_connected "$status" "$n" || missing="$missing $n"
            done
            [ -n "$missing" ] || break
        else
            missing=" (the gateway's /health)"
        fi
        if [ "$SECONDS" -ge "$deadline" ]; then
            for n in gateway "${WORKER_IDS[@]}"; do
                log_tail "$n" 15
            done
            fail_up "not ready after ${timeout}s; still waiting for:$missing"
        fi
        sleep 0.3
    done

    local models model
    models="$(http_get "$gw_url/v1/models" | grep -o '"id":"[^"]*"' | cut -d'"' -f4 | paste -sd, -)"
    model="${models%%,*}"
    echo
    NO_COLOR=1 RUST_LOG=warn "$bin" cluster status --etcd "$ETCD_URL" --cluster "$CLUSTER" 2>/dev/null || true
    echo
    echo "kvmesh cluster '$CLUSTER' is up: $gw_url (models ${models:-unknown}), logs in $RUN_DIR"
    echo "  curl -s $gw_url/v1/completions -H 'content-type: application/json' \\"
    echo "    -d '{\"model\": \"${model:-MODEL}\", \"prompt\": \"ROMEO:\", \"max_tokens\": 32}'"
    echo "  $0 status | logs [NAME] | down"
}

fail_up() {
    note "up failed: $1"
    note "stopping what was started (logs stay in $RUN_DIR)"
    stop_all 10 >&2 || true
    exit 1
}

# ---------------------------------------------------------------------------------------------
# down

# Stops the named processes: SIGTERM, up to $1 seconds for them to exit, then SIGKILL.
stop_group() {
    local timeout="$1"
    shift
    local -a names=() pids=()
    local n pid
    for n in "$@"; do
        pid="$(read_pid "$n" || true)"
        if [ -n "$pid" ] && is_ours "$pid" "$n"; then
            names+=("$n")
            pids+=("$pid")
            kill -TERM "$pid" 2>/dev/null || true
            echo "$n: SIGTERM to pid $pid"
        else
            rm -f "$RUN_DIR/$n.pid"
        fi
    done
    [ "${#pids[@]}" -gt 0 ] || return 0
    local deadline=$((SECONDS + timeout)) left i
    while :; do
        left=0
        for i in "${!pids[@]}"; do
            if alive "${pids[$i]}"; then
                left=$((left + 1))
            fi
        done
        [ "$left" -gt 0 ] && [ "$SECONDS" -lt "$deadline" ] || break
        sleep 0.2
    done
    for i in "${!pids[@]}"; do
        if alive "${pids[$i]}"; then
            echo "${names[$i]}: still running after ${timeout}s, SIGKILL to pid ${pids[$i]}"
            kill -KILL "${pids[$i]}" 2>/dev/null || true
        fi
    done
    local status=0
    for i in "${!pids[@]}"; do
        local waited=0
        while alive "${pids[$i]}" && [ "$waited" -lt 50 ]; do
            sleep 0.1
            waited=$((waited + 1))
        done
        if alive "${pids[$i]}"; then
            note "${names[$i]} (pid ${pids[$i]}) did not exit even after SIGKILL"
            status=1
        else
            rm -f "$RUN_DIR/${names[$i]}.pid"
        fi
    done
    return "$status"
}

stop_all() {
    local timeout="$1" n
    local -a nodes=()
    while read -r n; do
        [ -z "$n" ] || [ "$n" = etcd ] || nodes+=("$n")
    done < <(pid_names)
    local status=0
    # The nodes together (each drains its own requests), then etcd, which they leave last.
    if [ "${#nodes[@]}" -gt 0 ]; then
        stop_group "$timeout" "${nodes[@]}" || status=1
    fi
    stop_group 15 etcd || status=1
    return "$status"
}

cmd_down() {
    [ -d "$RUN_DIR" ] || {
        echo "nothing runs from $RUN_DIR"
        return 0
    }
    RUN_DIR="$(cd "$RUN_DIR" && pwd -P)"
    GRACE=""
    load_env || true
    local grace="${GRACE:-30}"
    local timeout="${TIMEOUT:-$(( ${grace%.*} + 15 ))}"
    if [ -z "$(pid_names)" ]; then
        echo "nothing runs from $RUN_DIR"
        return 0
    fi
    stop_all "$timeout"
    echo "stopped; logs are in $RUN_DIR"
}

# ---------------------------------------------------------------------------------------------
# status, logs, url

cmd_status() {
    [ -d "$RUN_DIR" ] && load_env || {
        echo "no cluster was started from $RUN_DIR"
        return 3
    }
    RUN_DIR="$(cd "$RUN_DIR" && pwd -P)"
    echo "cluster '$CLUSTER' from $RUN_DIR"
    echo "gateway: ${GATEWAY_URL:-unknown}   etcd: $ETCD_URL$([ "$ETCD_OWNED" = 1 ] || echo ' (not ours)')"
    echo
    printf '%-14s %-8s %-8s %s\n' PROCESS PID STATE LOG
    local n pid state running=0 dead=0 names
    names="$NODES"
    [ "$ETCD_OWNED" != 1 ] || names="etcd $names"
    for n in $names; do
        pid="$(read_pid "$n" || true)"
        if [ -n "$pid" ] && is_ours "$pid" "$n"; then
            state=running
            running=$((running + 1))
        else
            state=stopped
            dead=$((dead + 1))
        fi
        printf '%-14s %-8s %-8s %s\n' "$n" "${pid:--}" "$state" "$RUN_DIR/$n.log"
    done
    echo
    if [ "$running" -gt 0 ] && http_get "$ETCD_URL/health" >/dev/null; then
        local bin="${KVMESH:-}"
        [ -x "$bin" ] || bin="$(find_kvmesh)"
        NO_COLOR=1 RUST_LOG=warn "$bin" cluster status --etcd "$ETCD_URL" --cluster "$CLUSTER" ||
            note "kvmesh cluster status failed"
    else
        echo "(etcd at $ETCD_URL does not answer: no cluster status)"
    fi
    [ "$running" -gt 0 ] || return 3
    [ "$dead" -eq 0 ] || return 1
}

cmd_logs() {
    [ -d "$RUN_DIR" ] || die "no run folder $RUN_DIR"
    if [ -n "$LOG_NAME" ]; then
        local f="$RUN_DIR/$LOG_NAME.log"
        if [ ! -f "$f" ]; then
            local known=() l
            for l in "$RUN_DIR"/*.log; do
                [ -e "$l" ] && known+=("$(basename "$l" .log)")
            done
            die "no log $f (there are: ${known[*]:-none})"
        fi
        if [ "$FOLLOW" = 1 ]; then
            exec tail -n "${LINES:-100}" -f "$f"
        fi
        tail -n "${LINES:-100}" "$f"
        return
    fi
    local -a logs=()
    local f
    for f in "$RUN_DIR"/*.log; do
        [ -e "$f" ] && logs+=("$f")
    done
    [ "${#logs[@]}" -gt 0 ] || die "no logs in $RUN_DIR"
    if [ "$FOLLOW" = 1 ]; then
        exec tail -n "${LINES:-20}" -f "${logs[@]}"
    fi
    tail -n "${LINES:-20}" "${logs[@]}"
}

cmd_url() {
    load_env && [ -n "${GATEWAY_URL:-}" ] || die "no cluster was started from $RUN_DIR"
    echo "$GATEWAY_URL"
}

case "$COMMAND" in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    logs) cmd_logs ;;
    url) cmd_url ;;
    *) die "unknown command '$COMMAND' (up, down, status, logs, url; see --help)" ;;
esac
