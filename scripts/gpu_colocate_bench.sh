#!/usr/bin/env bash
# Prefill and decode sharing one GPU, on the Qwen3-8B shape: the public two-servers-on-one-GPU
# experiment's workload (1,000 in / 100 out, ${N:-200} requests at ${RATE:-16} req/s, near
# one server's published 17.6 req/s) through
#
#   aggregated      kvmesh serve: one engine, the whole GPU
#   two-servers-*   two kvmesh serve sharing the GPU, half the load each (the public
#                   experiment's second configuration; time-sliced here, no MPS)
#   split-<S>       kvmesh node --no-etcd --roles gateway,router,prefill,decode --sm-split S:
#                   a prefill and a decode engine, each on its share of the SMs (green
#                   contexts), KV handed over in process
#   ipc-<S>         two kvmesh node processes finding each other through --registry-dir: a
#                   prefill node on its side of --sm-split S, and a gateway + router + decode
#                   node on the other with --kv-transport cuda-ipc (the prefill process copies
#                   KV into the decode process's exported cache on the GPU); each loads its
#                   own weights, with 0.45 of the memory
#
# for each S in ${SPLITS:-whole prefill:96 prefill:80 prefill:112} (on an H100's 132 SMs:
# decode on 36, 52 and 20; `whole`: both engines on every SM, time-shared, as two servers
# under MPS are). kvmesh bench prints each run's table (TTFT / TPOT / ITL mean, median, p99,
# req/s); the runs go to bench/results/colocate-<device>.json. IPC_SPLITS (default
# prefill:96) lists the ipc-<S> runs; empty skips them.
#
#   MODEL=target/bench-models/qwen3-8b bash scripts/gpu_colocate_bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-out/results}/colocate"
model="${MODEL:-target/bench-models/qwen3-8b}"
port="${PORT:-8472}"
bin="${KVMESH_BIN:-gpu-out/kvmesh}"
n="${N:-200}"
rate="${RATE:-16}"
mkdir -p "$out"
# shellcheck source=scripts/gpu_env.sh
. scripts/gpu_env.sh
in_len="${INPUT_LEN:-1000}"
engine=(--device "${DEVICE:-cuda}" --model "$model" --max-model-len "${MAX_LEN:-4096}" --max-num-seqs 256
    --max-num-batched-tokens 8192 --host 127.0.0.1)
pid=""
trap '[ -n "$pid" ] && kill $pid 2>/dev/null || true' EXIT # one pid, or two
# Waits for the server on $port, and with a router for its decode and prefill roles.
up() {
    local log=$1 routed=$2
    for _ in $(seq 1 300); do
        if curl -sf "http://127.0.0.1:$port/health" >/dev/null; then
            [ "$routed" = 0 ] && return 0
            local m
            m=$(curl -sf "http://127.0.0.1:$port/metrics" || true)
            grep -q '^kvmesh:router_workers_routable[^ ]* 1' <<<"$m" &&
                grep -q '^kvmesh:router_prefill_workers_connected[^ ]* 1' <<<"$m" && return 0
        fi
        kill -0 "$pid" 2>/dev/null || { tail -20 "$log"; return 1; }
        sleep 1
    done
    echo "the server did not come up"
    return 1
}
run() { # LABEL ROUTED COMMAND...
    local label=$1 routed=$2
    shift 2
    "$@" >"$out/$label.log" 2>&1 &
    pid=$!
    up "$out/$label.log" "$routed"
    grep -m2 "KV cache\|SMs split" "$out/$label.log" || true
    "$bin" bench --base-url "http://127.0.0.1:$port" --tokenizer "$model" --label "$label" \
        --result-dir "$out" --percentiles 50,99 --timeout 300 --dataset random \
        --input-len "$in_len" --output-len 100 --num-prompts "$n" --request-rate "$rate" 2>&1 |
        tee -a "$out/bench.txt"
    # How the KV moved (kvmesh:kv_transfers_total by transport), for the summary.
    curl -sf "http://127.0.0.1:$port/metrics" | grep '^kvmesh:kv_transfers_total' \
        >"$out/$label.transfers" || true
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    pid=""
}
run aggregated 0 "$bin" serve "${engine[@]}" --port "$port"
# Two aggregated servers sharing the GPU, as the public experiment ran them (there under MPS;
# here time-sliced, no MPS daemon): half the memory each, half the requests each at half the
# rate, two clients at once.
if [ "${TWO_SERVERS:-1}" = 1 ]; then
    pids=()
    for i in 0 1; do
        "$bin" serve "${engine[@]}" --port $((port + 1 + i)) --gpu-memory-utilization 0.45 \
            >"$out/two-servers-$i.log" 2>&1 &
        pids+=($!)
    done
    for i in 0 1; do
        pid=${pids[$i]} port=$((port + 1 + i)) up "$out/two-servers-$i.log" 0
    done
    pid="${pids[*]}" # for the exit trap
    half_rate=$(python3 -c "print(float('$rate') / 2)")
    clients=()
    for i in 0 1; do
        "$bin" bench --base-url "http://127.0.0.1:$((port + 1 + i))" --tokenizer "$model" \
            --label "two-servers-$i" --result-dir "$out" --percentiles 50,99 --timeout 300 \
            --dataset random --input-len "$in_len" --output-len 100 --seed $((i + 1)) \
            --num-prompts $((n / 2)) --request-rate "$half_rate" >"$out/two-servers-$i.txt" 2>&1 &
        clients+=($!)
    done
    wait "${clients[@]}" || true
    cat "$out"/two-servers-?.txt | tee -a "$out/bench.txt" | grep "req/s:" || true
    kill "${pids[@]}" 2>/dev/null || true
    wait "${pids[@]}" 2>/dev/null || true
    pid=""
fi
for s in ${SPLITS:-whole prefill:96 prefill:80 prefill:112}; do
    split=(--sm-split "$s")
    [ "$s" = whole ] && split=()
    run "split-${s/:/-}" 1 "$bin" node --no-etcd --node-id colocated \
        --roles gateway,router,prefill,decode "${split[@]}" "${engine[@]}" --port "$port"
done
for s in ${IPC_SPLITS-prefill:96}; do
    reg=$(mktemp -d)
    "$bin" node --registry-dir "$reg" --node-id prefill --roles prefill --sm-split "$s" \
        "${engine[@]}" --gpu-memory-utilization 0.45 >"$out/ipc-${s/:/-}-prefill.log" 2>&1 &
    ppid_=$!
    trap '[ -n "$pid" ] && kill $pid 2>/dev/null || true; kill $ppid_ 2>/dev/null || true' EXIT
    run "ipc-${s/:/-}" 1 "$bin" node --registry-dir "$reg" --node-id decode \
        --roles gateway,router,decode --kv-transport cuda-ipc --sm-split "$s" "${engine[@]}" \
        --gpu-memory-utilization 0.45 --port "$port"
    kill "$ppid_" 2>/dev/null || true
    wait "$ppid_" 2>/dev/null || true
    rm -rf "$reg"
done
python3 - "$out" "$model" "$n" "$rate" "$in_len" <<'PY'
import glob, json, re, subprocess, sys
from pathlib import Path
d, model, n, rate = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
try:
    name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.strip().splitlines()[0]
except (OSError, IndexError):
    sys.exit("no GPU named by nvidia-smi: the runs stay under " + str(d))
runs = {Path(f).name[: -len("-summary.json")]: json.loads(Path(f).read_text())
        for f in sorted(glob.glob(str(d / "*-summary.json")))}
for label, run in runs.items():
    t = d / f"{label}.transfers"
    if t.exists():
        run["kv_transfers"] = {m.group(1): float(m.group(2)) for m in re.finditer(
            r'transport="([^"]+)"\}\s+(\S+)', t.read_text()) if float(m.group(2)) > 0}
out = {
    "benchmark": "colocated prefill and decode on one GPU",
    "device": name,
    "model": model,
    "workload": f"random {sys.argv[5]} in / 100 out, {n} requests at {rate} req/s",
    "published_peer": "two vLLM servers on one GPU (public experiment, 200 requests of 1,000/100): one server 17.6 req/s, TTFT 43 ms, TPOT 9.0 ms (p99 11.3); two sharing 17.1 req/s, TPOT 21 ms; split 64/64 SMs 16.0 req/s, TPOT 25 ms",
    "runs": runs,
}
p = Path("bench/results") / ("colocate-" + (re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown") + ".json")
p.parent.mkdir(parents=True, exist_ok=True)
p.write_text(json.dumps(out, indent=2))
print(f"wrote {p}")
PY
