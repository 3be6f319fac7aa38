#!/usr/bin/env bash
# The engine served through its gateway on the GPU machine, under the four profiles of vLLM's
# H100 tuning tables, each scaled down to fit a short GPU lease (the scale is in each run's
# label and in the JSON):
#
#   profile            vLLM's table                                  here
#   throughput         random 1,024 in / 128 out, all at once,       ${TP_N:-300} requests
#                      max concurrency 512, 1,000 requests
#   generation-heavy   1,000 in / 2,000 out, 1 req/s                  ${GEN_N:-12} requests
#   long-context       32,000 in / 100 out, 1 req/s                   ${LONG_N:-8} requests
#   sharegpt-like      ShareGPT, all at once                          ${SG_N:-300} requests,
#                                                                     lengths of scripts/sharegpt_like.py
#
# and, only when PROFILES names it, batch1: 1,024 in / 128 out one request at a time
# (${B1_N:-8} requests), whose TPOT is the batch-1 decode step as served.
#
#   MODEL=target/bench-models/qwen3-8b bash scripts/gpu_serve_bench.sh
#   DEVICE=cpu MAX_LEN=4096 PROFILES=throughput TP_N=4 MODEL=tests/fixtures/models/hf-qwen35-f32 \
#       KVMESH_BIN=target/release/kvmesh OUT=/tmp/smoke TAG=smoke bash scripts/gpu_serve_bench.sh
#
# DEVICE=cpu runs the same on the CPU (a smoke run of the script, with a small model and
# small counts). PROFILES (default: all four) picks profiles by name, e.g. PROFILES=throughput; TAG names
# the results file (bench/results/serve-<device>[-TAG].json), so that another model's run
# does not replace the 8B one's. CUDA_OPTIONS is passed as `--cuda-options` (switches that
# are not the defaults yet, e.g. CUDA_OPTIONS=gdn-scan,prefill-graphs) and recorded in the JSON.
#
# Needs gpu-out/kvmesh (`scripts/gpu_verify.sh build`) and the model folder (gpu-bench makes
# it). Writes bench/results/serve-<device>.json and the per-run JSON under $OUT/serve.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-out/results}"
model="${MODEL:-target/bench-models/qwen3-8b}"
port="${PORT:-8471}"
bin="${KVMESH_BIN:-gpu-out/kvmesh}"
profiles=" ${PROFILES:-throughput sharegpt-like generation-heavy long-context} "
for p in $profiles; do
    case " throughput sharegpt-like generation-heavy long-context batch1 " in
    *" $p "*) ;;
    *) echo "gpu_serve_bench: unknown profile '$p' in PROFILES" >&2; exit 2 ;;
    esac
done
tag="${TAG:-}"
[[ $tag =~ ^[a-z0-9.-]*$ ]] || { echo "gpu_serve_bench: TAG must be lowercase letters, digits, dots and dashes" >&2; exit 2; }
mkdir -p "$out/serve"
# shellcheck source=scripts/gpu_env.sh
. scripts/gpu_env.sh
# vLLM's defaults on an H100 (V1 engine, OpenAI server): up to 1,024 sequences and 8,192
# tokens a step; 256 sequences here, so that the throughput profile's KV (up to 1,152 tokens
# each) fits the cache an 8B model leaves on an 80 GB card without preemption.
cuda_options=()
[ -n "${CUDA_OPTIONS:-}" ] && cuda_options=(--cuda-options "$CUDA_OPTIONS")
"$bin" serve --device "${DEVICE:-cuda}" --model "$model" --max-model-len "${MAX_LEN:-32768}" \
    --max-num-seqs 256 --max-num-batched-tokens 8192 --port "$port" "${cuda_options[@]}" \
    >"$out/serve/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    kill -0 $server 2>/dev/null || { tail -20 "$out/serve/server.log"; exit 1; }
    sleep 1
done
curl -sf "http://127.0.0.1:$port/health" >/dev/null || { echo "the server did not come up"; exit 1; }
grep -m1 "KV cache" "$out/serve/server.log" || true
# The engine's decode counters before and after each profile: where a served token's time
# goes (the model's step, the step around it, the cycle from planning to tokens sent).
scrape() {
    curl -sf "http://127.0.0.1:$port/metrics" | grep '^kvmesh:engine_decode_' >"$out/serve/metrics-$1.txt" || true
}
scrape start
bench() {
    local label=$1
    shift
    case "$profiles" in *" $label "*) ;; *) return 0 ;; esac
    "$bin" bench --base-url "http://127.0.0.1:$port" --tokenizer "$model" --label "$label" \
        --result-dir "$out/serve" --percentiles 50,99 --timeout 300 "$@" 2>&1 | tee -a "$out/serve/bench.txt"
    scrape "$label"
    echo "$label" >>"$out/serve/order.txt"
}
python3 scripts/sharegpt_like.py "$out/serve/sharegpt-like.json" --n "${SG_N:-300}"
bench batch1 --dataset random --input-len 1024 --output-len 128 \
    --num-prompts "${B1_N:-8}" --request-rate inf --max-concurrency 1
bench throughput --dataset random --input-len 1024 --output-len 128 \
    --num-prompts "${TP_N:-300}" --request-rate inf --max-concurrency 512
bench sharegpt-like --dataset "sharegpt:$out/serve/sharegpt-like.json" \
    --num-prompts "${SG_N:-300}" --request-rate inf
bench generation-heavy --dataset random --input-len 1000 --output-len 2000 \
    --num-prompts "${GEN_N:-12}" --request-rate 1
bench long-context --dataset random --input-len 32000 --output-len 100 \
    --num-prompts "${LONG_N:-8}" --request-rate 1
kill $server 2>/dev/null || true
python3 - "$out/serve" "$model" "$tag" <<'PY'
import glob, json, os, re, subprocess, sys
from pathlib import Path
d, model, tag = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
try:
    name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.strip().splitlines()[0]
except (OSError, IndexError):  # DEVICE=cpu smoke runs, on a machine without a GPU
    name = "cpu"
runs = {}
for f in sorted(glob.glob(str(d / "*-summary.json"))):
    label = Path(f).name[: -len("-summary.json")]
    runs[label] = json.loads(Path(f).read_text())

def counters(label):
    vals = {}
    p = d / f"metrics-{label}.txt"
    for line in (p.read_text().splitlines() if p.exists() else []):
        name, _, v = line.rpartition(" ")
        key = name.split("{")[0].removeprefix("kvmesh:engine_decode_")
        vals[key] = vals.get(key, 0.0) + float(v)
    return vals

# Each profile's decode steps, from the counters' change across it.
order = (d / "order.txt").read_text().split() if (d / "order.txt").exists() else []
before = counters("start")
for label in order:
    after = counters(label)
    n = after.get("steps_total", 0) - before.get("steps_total", 0)
    if label in runs and n > 0:
        ms = lambda k: round(1e3 * (after.get(k, 0) - before.get(k, 0)) / n, 3)
        runs[label]["engine_decode"] = {
            "steps": int(n),
            "mean_cycle_ms": ms("cycle_seconds_total"),
            "mean_step_ms": ms("step_seconds_total"),
            "mean_forward_ms": ms("forward_seconds_total"),
        }
        e = runs[label]["engine_decode"]
        print(f"{label}: {e['steps']} decode steps, mean cycle {e['mean_cycle_ms']} ms = step "
              f"{e['mean_step_ms']} ms (forward {e['mean_forward_ms']} ms) + planning and tokens out")
    before = after
out = {
    "benchmark": "serve-profiles",
    "engine": "kvmesh serve --device " + (os.environ.get("DEVICE") or "cuda"),
    "device": name,
    "model": model,
    "server_flags": "--max-model-len " + (os.environ.get("MAX_LEN") or "32768") + " --max-num-seqs 256 --max-num-batched-tokens 8192 (KV: --gpu-memory-utilization 0.9)" + (" --cuda-options " + os.environ["CUDA_OPTIONS"] if os.environ.get("CUDA_OPTIONS") else ""),
    "scaled": "request counts scaled down from vLLM's tuning tables to fit a GPU lease; lengths and rates as published",
    "runs": runs,
}
p = Path("bench/results") / ("serve-" + (re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown") + (f"-{tag}" if tag else "") + ".json")
p.parent.mkdir(parents=True, exist_ok=True)
p.write_text(json.dumps(out, indent=2))
print(f"wrote {p}")
PY
