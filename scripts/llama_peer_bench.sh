#!/usr/bin/env bash
# kvmesh's CPU engine beside llama.cpp's llama-bench on the same checkpoint, same cores,
# same thread count.
#
#   scripts/llama_peer_bench.sh
#
# llama.cpp comes from the llama-cpp-python sdist on PyPI (it vendors llama.cpp), so the
# only registries touched are PyPI and Debian's. The checkpoint is a Qwen2.5-0.5B-shaped bf16
# folder made by `kvmesh model init-random`; llama.cpp gets the same weights through its own
# convert_hf_to_gguf.py (bf16 in, bf16 out). The two engines then run alternately, RUNS
# times each (A B A B ...), so drift of the machine hits both alike.
#
# Prints a markdown table and writes bench/results/cpu-peer-llama.json with every raw run.
# Everything fetched or built is kept under target/peer/ (about 8 GB, most of it the
# converter's torch); a second run only re-measures. A first run takes 10-15 minutes on
# 2 cores, about 5 of them building llama-bench.
#
# Environment:
#   THREADS=2          threads for both engines
#   RUNS=2             runs of each engine
#   PROMPTS=512,2048   prefill lengths (tokens)
#   GEN=128            tokens llama-bench decodes per batch-1 sample
#   BATCHES=1,8,32     kvmesh decode batch sizes (must include 1)
#   LLAMA_REPS=3       llama-bench repetitions per test inside one run (its default, 5,
#                      makes each run twice as long for little: RUNS already repeats)
#   JOBS=2             build parallelism (cmake, cargo)
#   QUIET_WAIT=90      seconds to wait, before each engine's turn, for other work to stop
#                      (0: do not wait; other work is still measured and reported)
#   QUIET_LOAD=0.2     CPUs of other work that still count as quiet
set -euo pipefail
cd "$(dirname "$0")/.."

THREADS=${THREADS:-2}
RUNS=${RUNS:-2}
PROMPTS=${PROMPTS:-512,2048}
GEN=${GEN:-128}
BATCHES=${BATCHES:-1,8,32}
LLAMA_REPS=${LLAMA_REPS:-3}
JOBS=${JOBS:-2}
QUIET_WAIT=${QUIET_WAIT:-90}
QUIET_LOAD=${QUIET_LOAD:-0.2}

die() { echo "llama_peer_bench: $*" >&2; exit 1; }
posint() { [[ $2 =~ ^[1-9][0-9]*$ ]] || die "$1 must be a positive integer, got '$2'"; }
intlist() { [[ $2 =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] || die "$1 must be comma-separated positive integers, got '$2'"; }
posint THREADS "$THREADS"
posint RUNS "$RUNS"
posint GEN "$GEN"
posint LLAMA_REPS "$LLAMA_REPS"
posint JOBS "$JOBS"
[[ $QUIET_WAIT =~ ^[0-9]+$ ]] || die "QUIET_WAIT must be a whole number of seconds, got '$QUIET_WAIT'"
[[ $QUIET_LOAD =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "QUIET_LOAD must be a number, got '$QUIET_LOAD'"
intlist PROMPTS "$PROMPTS"
intlist BATCHES "$BATCHES"
[[ ,$BATCHES, == *,1,* ]] || die "BATCHES must include 1 (the row compared with llama.cpp)"
# Each run is minutes long; a typo such as RUNS=50 should not hold the machine for hours.
((RUNS <= 10)) || die "RUNS is capped at 10"

# The pinned peer. The hash makes pip refuse anything but the sdist this was written against.
LCP_VERSION=0.3.36
LCP_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
# What convert_hf_to_gguf.py imports, at versions known to convert this checkpoint. torch is
# imported at module level by the converter even for a bf16 -> bf16 copy, and PyPI's Linux
# wheel pulls CUDA runtime wheels with it (~4 GB, unused here); there is no CPU-only torch
# on PyPI.
CONVERT_PKGS=(torch==2.15.0 transformers==5.23.0 sentencepiece==0.2.3 numpy==2.4.6)

peer=target/peer
src=$peer/src/llama_cpp_python-$LCP_VERSION
llama=$src/vendor/llama.cpp
build=$peer/build
bench_bin=$build/bin/llama-bench
model=$peer/model
gguf=$peer/model-bf16.gguf
venv=$peer/venv
runs_dir=$peer/runs
out_json=bench/results/cpu-peer-llama.json
mkdir -p "$peer"
# Two copies at once would share the cores and measure each other.
exec 9>"$peer/.lock"
flock -n 9 || die "another run holds $peer/.lock"

log() { printf '[%s] %s\n' "$(date +%T)" "$*" >&2; }

# Runs "$@" with its output in $1's log; on failure shows the log's tail.
logged() {
    local logfile=$1
    shift
    if ! "$@" >"$logfile" 2>&1; then
        tail -n 40 "$logfile" >&2
        die "failed (log: $logfile): $*"
    fi
}

t_start=$(date +%s)

# --- 1. llama.cpp's llama-bench -------------------------------------------------------

if ! command -v cmake >/dev/null; then
    log "installing Debian's cmake"
    logged "$peer/apt.log" timeout 900 bash -c 'apt-get update && apt-get install -y cmake'
fi

if [ ! -f "$llama/CMakeLists.txt" ]; then
    sdist=$peer/dl/llama_cpp_python-$LCP_VERSION.tar.gz
    if [ ! -f "$sdist" ]; then
        log "downloading the llama-cpp-python $LCP_VERSION sdist"
        mkdir -p "$peer/dl"
        echo "llama-cpp-python==$LCP_VERSION --hash=sha256:$LCP_SHA256" >"$peer/dl/requirements.txt"
        # pip prepares the sdist's metadata on download (a throwaway build environment);
        # that is the price of using the registry's own client rather than a raw URL.
        logged "$peer/dl/pip.log" timeout 900 python3 -m pip download --no-deps \
            --no-binary :all: --require-hashes -r "$peer/dl/requirements.txt" -d "$peer/dl"
    fi
    echo "$LCP_SHA256  $sdist" | sha256sum -c --quiet - || die "sha256 mismatch: $sdist"
    rm -rf "$peer/src"
    mkdir -p "$peer/src"
    tar -xzf "$sdist" -C "$peer/src"
    [ -f "$llama/CMakeLists.txt" ] || die "no vendor/llama.cpp in $sdist"
fi

# The sdist carries no git metadata, but the changelog names the llama.cpp commit vendored.
llama_commit=$(awk -v v="## [$LCP_VERSION]" '
    $0 == v { on = 1; next }
    on && /^## / { exit }
    on && match($0, /llama\.cpp@[0-9a-f]+/) { print substr($0, RSTART + 10, RLENGTH - 10); exit }
' "$src/CHANGELOG.md")
[ -n "$llama_commit" ] || llama_commit=unknown

cmake_flags=(
    -DCMAKE_BUILD_TYPE=Release
    -DGGML_NATIVE=ON
    # This llama.cpp fetches models over HTTPS through OpenSSL (LLAMA_CURL is gone: setting it
    # only prints a deprecation warning); a benchmark of a local file needs neither.
    -DLLAMA_OPENSSL=OFF
    # One self-contained binary in the cache, no shared libraries beside it to keep in step.
    -DBUILD_SHARED_LIBS=OFF
    # Only llama-bench is built; these keep configure from setting up targets never built.
    -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF
    -DLLAMA_BUILD_SERVER=OFF
    -DGGML_CCACHE=OFF
    # The sources sit inside this repository's work tree, so llama.cpp's build-info would ask
    # git and stamp kvmesh's commit as llama.cpp's. Give it no git, and the changelog's commit.
    -DGIT_EXECUTABLE=/bin/false
    -DLLAMA_BUILD_COMMIT="$llama_commit"
    -DLLAMA_BUILD_NUMBER=0
)
# GGML_NATIVE tunes the binary to this CPU: a cached build from another CPU is rebuilt.
build_key="$LCP_VERSION ${cmake_flags[*]} $(grep -m1 '^flags' /proc/cpuinfo | md5sum | cut -c1-16)"
if [ ! -x "$bench_bin" ] || [ "$(cat "$build/.key" 2>/dev/null)" != "$build_key" ]; then
    log "building llama-bench (Release, GGML_NATIVE, -j$JOBS; several minutes on 2 cores)"
    rm -rf "$build"
    logged "$peer/cmake-configure.log" timeout 600 cmake -S "$llama" -B "$build" "${cmake_flags[@]}"
    logged "$peer/cmake-build.log" timeout 2400 cmake --build "$build" --target llama-bench -j"$JOBS"
    echo "$build_key" >"$build/.key"
fi

# --- 2. The checkpoint, in both formats -----------------------------------------------

kvmesh_bin=target/release/kvmesh
engine_bench=target/release/engine-bench
if [ ! -x "$kvmesh_bin" ]; then
    log "building kvmesh (release)"
    logged "$peer/cargo-kvmesh.log" timeout 3600 cargo build --release -j"$JOBS" --bin kvmesh
fi
if [ ! -x "$engine_bench" ]; then
    log "building engine-bench (release)"
    logged "$peer/cargo-engine-bench.log" timeout 3600 \
        cargo build --release -j"$JOBS" -p kvmesh-bench --bin engine-bench
fi

if [ ! -f "$model/model.safetensors" ]; then
    log "writing the Qwen2.5-0.5B-shaped bf16 checkpoint"
    # Written aside and moved into place, so an interrupted write is never taken as a model.
    rm -rf "$model.tmp"
    logged "$peer/init-random.log" timeout 600 "$kvmesh_bin" model init-random \
        --preset qwen2.5-0.5b --dtype bf16 --seed 0 --out "$model.tmp"
    rm -rf "$model"
    mv "$model.tmp" "$model"
    rm -f "$gguf"
fi

if [ ! -f "$gguf" ]; then
    if [ ! -f "$venv/.ready" ]; then
        log "making the converter's venv (downloads torch)"
        rm -rf "$venv"
        python3 -m venv "$venv"
        logged "$peer/venv.log" timeout 1800 "$venv/bin/pip" install "${CONVERT_PKGS[@]}" "./$llama/gguf-py"
        touch "$venv/.ready"
    fi
    log "converting to GGUF (bf16)"
    # convert_hf_to_gguf.py names a BPE tokenizer's pre-tokenizer by hashing how it splits a
    # fixed text, and refuses hashes it has no entry for. kvmesh's checkpoints carry kvmesh's
    # own 2048-token byte-level BPE tokenizer, which no table lists. It splits with the GPT-2
    # byte-level regex, which llama.cpp knows as "gpt-2", so that is the name given when the
    # hash is unknown and tokenizer.json says ByteLevel with the regex on; anything else still
    # fails. Nothing else is changed, and neither bench tokenizes text: both feed token ids.
    logged "$peer/convert.log" timeout 1200 "$venv/bin/python" - "$llama" "$model" \
        "$model" --outtype bf16 --outfile "$gguf.tmp" <<'PY'
import json
import runpy
import sys
from pathlib import Path

llama_dir, model_dir = Path(sys.argv[1]), Path(sys.argv[2])
sys.path.insert(0, str(llama_dir))
from conversion import base  # noqa: E402

pre = json.loads((model_dir / "tokenizer.json").read_text()).get("pre_tokenizer") or {}
by_hash = base.TextModel.get_vocab_base_pre


def vocab_base_pre(self, tokenizer):
    try:
        return by_hash(self, tokenizer)
    except NotImplementedError:
        if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
            print("pre-tokenizer: byte-level BPE, GPT-2 regex -> gpt-2", file=sys.stderr)
            return "gpt-2"
        raise


base.TextModel.get_vocab_base_pre = vocab_base_pre
sys.argv = [str(llama_dir / "convert_hf_to_gguf.py"), *sys.argv[3:]]
runpy.run_path(sys.argv[0], run_name="__main__")
PY
    mv "$gguf.tmp" "$gguf"
fi
t_setup=$(date +%s)

# --- 3. Alternate runs ----------------------------------------------------------------

rm -rf "$runs_dir"
mkdir -p "$runs_dir"
IFS=, read -r -a prompts <<<"$PROMPTS"
# One invocation per run, one model load: llama-bench turns each -p length into a
# prompt-only test and -n into a separate decode-only test, as `-p ... -n 0` then
# `-p 0 -n GEN` would. Everything else (batch 2048, ubatch 512, f16 KV, flash attention
# auto, repacking) is left at llama-bench's defaults, the numbers its users quote.
llama_cmd=("$bench_bin" -m "$gguf" -t "$THREADS" -p "$PROMPTS" -n "$GEN" -r "$LLAMA_REPS" -o json)
# The decode rows compare like with like: llama-bench's tg decodes GEN tokens from an empty
# context (mean context GEN/2), engine-bench's decode steps sit after a prompt of that length.
kv_prompt_len=$((GEN / 2 > 0 ? GEN / 2 : 1))

# On a shared 2-core machine another job (a build, a test run) halves either engine's numbers
# without a trace in its own output. So each engine's turn waits, for a bounded time, for the
# machine to go quiet, and every run records how much CPU the rest of the machine used
# meanwhile (all CPUs' busy time from /proc/stat less the bench's own, from `times`).
hz=$(getconf CLK_TCK)
busy_jiffies() { awk '/^cpu / { print $2 + $3 + $4 + $7 + $8 + $9; exit }' /proc/stat; }
# Sets child_cpu_s to the CPU seconds this shell's finished children have used. `times` sees
# only the children of the shell it runs in, so this is called directly, never as $(...).
child_cpu() {
    times >"$runs_dir/.times"
    child_cpu_s=$(awk 'NR == 2 { t = 0; for (i = 1; i <= 2; i++) { split($i, a, /[ms]/); t += a[1] * 60 + a[2] }; print t }' \
        "$runs_dir/.times")
}
# CPUs' worth of work on the machine over the next $1 seconds.
load_over() {
    local b0
    b0=$(busy_jiffies)
    sleep "$1"
    awk -v d=$(($(busy_jiffies) - b0)) -v s="$1" -v hz="$hz" 'BEGIN { printf "%.2f", d / hz / s }'
}
wait_quiet() {
    local i load
    ((QUIET_WAIT > 0)) || return 0
    for ((i = 0; i < (QUIET_WAIT + 2) / 3; i++)); do
        load=$(load_over 3)
        awk -v l="$load" -v max="$QUIET_LOAD" 'BEGIN { exit !(l <= max) }' && return 0
        ((i > 0)) || log "waiting up to ${QUIET_WAIT}s for the machine to go quiet ($load CPUs busy)"
    done
    log "still $load CPUs busy after ${QUIET_WAIT}s; measuring anyway (see other_cpus in the JSON)"
}

# Runs one measurement ($1 engine, $2 its result file under runs_dir, $3 where its stdout
# goes, then the command) and appends its metadata to index.jsonl.
measure() {
    local engine=$1 file=$2 stdout=$3 started b0 c0 t0 wall other
    shift 3
    child_cpu
    started=$(date -u +%FT%TZ) b0=$(busy_jiffies) c0=$child_cpu_s t0=$(date +%s.%N)
    if ! timeout 1800 "$@" >"$stdout" 2>"$runs_dir/${file%.json}.log"; then
        tail -n 40 "$runs_dir/${file%.json}.log" >&2
        die "$engine failed (log: $runs_dir/${file%.json}.log)"
    fi
    wall=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    child_cpu
    other=$(awk -v d=$(($(busy_jiffies) - b0)) -v hz="$hz" -v c0="$c0" -v c1="$child_cpu_s" -v w="$wall" \
        'BEGIN { o = d / hz - (c1 - c0); if (o < 0) o = 0; printf "%.2f", o / w }')
    printf '{"engine": "%s", "run": %d, "file": "%s", "started": "%s", "wall_s": %s, "other_cpus": %s}\n' \
        "$engine" "$run" "$file" "$started" "$wall" "$other" >>"$runs_dir/index.jsonl"
    awk -v o="$other" -v max="$QUIET_LOAD" 'BEGIN { exit !(o > max) }' &&
        log "  other work used $other CPUs on average during that run" || true
}

for ((run = 1; run <= RUNS; run++)); do
    wait_quiet
    log "run $run/$RUNS: llama.cpp"
    measure llama.cpp "llama-$run.json" "$runs_dir/llama-$run.json" "${llama_cmd[@]}"

    wait_quiet
    for i in "${!prompts[@]}"; do
        p=${prompts[$i]}
        log "run $run/$RUNS: kvmesh, prefill $p"
        # Decode is measured with the first prefill length; later ones skip to one batch.
        if ((i == 0)); then batches=$BATCHES; else batches=1; fi
        # engine-bench writes its JSON itself; its stdout is a table.
        measure kvmesh "kvmesh-$run-p$p.json" "$runs_dir/kvmesh-$run-p$p.txt" env RAYON_NUM_THREADS="$THREADS" \
            "$engine_bench" --model "$model" --prefill-len "$p" --batches "$batches" \
            --prompt-len "$kv_prompt_len" --json "$runs_dir/kvmesh-$run-p$p.json"
    done
done
t_end=$(date +%s)

# --- 4. Table and JSON ----------------------------------------------------------------

kv_cmd="RAYON_NUM_THREADS=$THREADS $engine_bench --model $model --prefill-len P --batches $BATCHES --prompt-len $kv_prompt_len --json FILE (for each P in $PROMPTS; after the first P, --batches 1)"
export THREADS RUNS PROMPTS GEN BATCHES LLAMA_REPS QUIET_LOAD LCP_VERSION LCP_SHA256 llama_commit runs_dir \
    out_json model gguf kv_cmd kv_prompt_len
export llama_cmd_str="${llama_cmd[*]}" cmake_str="${cmake_flags[*]}"
export kvmesh_version="$("$kvmesh_bin" --version)"
export setup_s=$((t_setup - t_start)) measure_s=$((t_end - t_setup))
python3 - <<'PY'
import datetime
import json
import os
import platform
import statistics
from pathlib import Path

env = os.environ
runs_dir = Path(env["runs_dir"])
prompts = [int(p) for p in env["PROMPTS"].split(",")]
batches = [int(b) for b in env["BATCHES"].split(",")]
gen, n_runs = int(env["GEN"]), int(env["RUNS"])

cpuinfo = {}
for line in Path("/proc/cpuinfo").read_text().splitlines():
    k, _, v = line.partition(":")
    cpuinfo.setdefault(k.strip(), v.strip())
flags = set(cpuinfo.get("flags", "").split())
relevant = ["avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx_vnni",
            "amx_tile", "amx_bf16", "amx_int8"]
cpu_model = cpuinfo.get("model name", platform.processor())
cpu_id = f"family {cpuinfo.get('cpu family')}, model {cpuinfo.get('model')}"

index = [json.loads(l) for l in (runs_dir / "index.jsonl").read_text().splitlines()]
raw_runs, llama, kv = [], {}, {}
for entry in index:
    data = json.loads((runs_dir / entry["file"]).read_text())
    raw_runs.append({**entry, "result": data})
    if entry["engine"] == "llama.cpp":
        for t in data:
            key = f"prefill_{t['n_prompt']}" if t["n_gen"] == 0 else "decode_b1" if t["n_prompt"] == 0 else None
            if key:
                llama.setdefault(key, []).append(t["avg_ts"])
    else:
        p = data["prefill"]["tokens"]
        kv.setdefault(f"prefill_{p}", []).append(data["prefill"]["tokens_per_s"])
        # The same prefill with --cpu-bf16-products (absent on CPUs without AVX512-BF16).
        if data.get("prefill_bf16_products"):
            kv.setdefault(f"prefill_bf16_{p}", []).append(
                data["prefill_bf16_products"]["tokens_per_s"])
        if p == prompts[0]:
            for row in data["decode"]:
                kv.setdefault(f"decode_b{row['batch']}", []).append(row["tokens_per_s"])
        kv.setdefault("memory_bw", []).append(data["memory_read_bandwidth_gb_s"])
        # The prefill's FLOPs and the cores' peaks, measured in the same engine-bench run.
        peaks = data.get("compute_peaks") or {}
        if data["prefill"].get("flops") and peaks.get("f32_fma_gflop_s"):
            kv.setdefault(f"flop_per_token_{p}", []).append(data["prefill"]["flops"] / p)
            kv.setdefault("f32_peak", []).append(peaks["f32_fma_gflop_s"] * 1e9)
            if peaks.get("bf16_dot_gflop_s"):
                kv.setdefault("bf16_peak", []).append(peaks["bf16_dot_gflop_s"] * 1e9)

quiet = float(env["QUIET_LOAD"])
contended = [e for e in index if e["other_cpus"] > quiet]
# (kvmesh's key, llama.cpp's key, label)
rows = [(f"prefill_{p}", f"prefill_{p}", f"prefill {p} tok/s") for p in prompts]
rows += [(f"prefill_bf16_{p}", f"prefill_{p}", f"prefill {p} tok/s, kvmesh --cpu-bf16-products")
         for p in prompts if f"prefill_bf16_{p}" in kv]
rows += [(f"decode_b{b}", f"decode_b{b}", f"decode batch-{b} tok/s") for b in batches]


def span(xs):
    if not xs:
        return "—"
    lo, hi = min(xs), max(xs)
    return f"{lo:.1f}" if f"{lo:.1f}" == f"{hi:.1f}" else f"{lo:.1f}–{hi:.1f}"


lines = [
    f"CPU: {cpu_model} ({cpu_id}); {env['THREADS']} threads each, {os.cpu_count()} CPUs online; "
    + ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in ["avx512f", "avx512_bf16", "amx_bf16"]),
    f"llama.cpp: llama-bench from the llama-cpp-python {env['LCP_VERSION']} sdist, vendored "
    f"llama.cpp {env['llama_commit']}; bf16 GGUF, -r {env['LLAMA_REPS']}, defaults otherwise",
    f"kvmesh: {env['kvmesh_version']}, engine-bench on the bf16 safetensors folder; "
    f"memory read bandwidth {span(kv.get('memory_bw', []))} GB/s",
    f"checkpoint: Qwen2.5-0.5B-shaped random weights, bf16; {n_runs} runs each, alternating "
    f"(llama.cpp first); decode context: llama-bench tg{gen} from empty, kvmesh after "
    f"{env['kv_prompt_len']} tokens",
    "other work on the machine during the runs (CPUs, mean over each run): "
    + (", ".join(f"{e['file'].removesuffix('.json')} {e['other_cpus']:.2f}" for e in contended)
       if contended else f"none above {env['QUIET_LOAD']}"),
    "",
    "| tok/s (min–max of runs) | llama.cpp | kvmesh | kvmesh ÷ llama.cpp (means) |",
    "| --- | ---: | ---: | ---: |",
]
summary = []
for key, llama_key, label in rows:
    a, b = llama.get(llama_key, []), kv.get(key, [])
    ratio = f"{statistics.mean(b) / statistics.mean(a):.2f}×" if a and b else "—"
    lines.append(f"| {label} | {span(a)} | {span(b)} | {ratio} |")
    summary.append({"metric": key, "unit": "tokens/s", "llama_cpp": a, "kvmesh": b})
# Each engine's prefill rate as a share of the arithmetic peaks: what f32 products could reach
# at best, and what llama.cpp's rate would need of them.
arith = []
if kv.get("f32_peak"):
    f32p = statistics.mean(kv["f32_peak"])
    bf16p = statistics.mean(kv["bf16_peak"]) if kv.get("bf16_peak") else None
    lines += ["", f"arithmetic (engine-bench's FLOP count; peaks measured in each kvmesh run, "
              f"means: f32 FMA {f32p / 1e9:.0f} GFLOP/s"
              + (f", bf16 dot products {bf16p / 1e9:.0f} GFLOP/s" if bf16p else "") + "):"]
    for p in prompts:
        fpt = kv.get(f"flop_per_token_{p}")
        if not fpt:
            continue
        fpt = statistics.mean(fpt)
        share = lambda tps, peak: statistics.mean(tps) * fpt / peak
        row = {"prompt": p, "flop_per_token": fpt, "f32_fma_peak": f32p, "bf16_dot_peak": bf16p}
        parts = []
        if kv.get(f"prefill_{p}"):
            row["kvmesh_f32_share_of_f32_peak"] = share(kv[f"prefill_{p}"], f32p)
            parts.append(f"kvmesh's f32 products {100 * row['kvmesh_f32_share_of_f32_peak']:.0f}% of the f32 peak")
        if kv.get(f"prefill_bf16_{p}") and bf16p:
            row["kvmesh_bf16_share_of_bf16_peak"] = share(kv[f"prefill_bf16_{p}"], bf16p)
            parts.append(f"its bf16 products {100 * row['kvmesh_bf16_share_of_bf16_peak']:.0f}% of the bf16 peak")
        if llama.get(f"prefill_{p}"):
            row["llama_cpp_share_of_f32_peak"] = share(llama[f"prefill_{p}"], f32p)
            parts.append(f"llama.cpp's rate {100 * row['llama_cpp_share_of_f32_peak']:.0f}% of the f32 peak"
                         + (f" ({100 * share(llama[f'prefill_{p}'], bf16p):.0f}% of the bf16 peak its products run at)" if bf16p else ""))
        arith.append(row)
        lines.append(f"- prefill {p}: " + "; ".join(parts))
table = "\n".join(lines)
print(table)

out = {
    "benchmark": "cpu-peer-llama",
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "cpu": {
        "model_name": cpu_model,
        "id": cpu_id,
        "cpus_online": os.cpu_count(),
        "flags": {f: f in flags for f in relevant},
    },
    "threads": int(env["THREADS"]),
    "runs_per_engine": n_runs,
    "order": "alternating, llama.cpp first",
    "other_cpus_note": "per run: CPU time the rest of the machine used during it / its wall time",
    "quiet_load_cpus": quiet,
    "checkpoint": {
        "kvmesh_folder": env["model"],
        "gguf": env["gguf"],
        "made_by": "kvmesh model init-random --preset qwen2.5-0.5b --dtype bf16 --seed 0",
        "converted_by": "vendored convert_hf_to_gguf.py --outtype bf16 (tokenizer.ggml.pre = gpt-2)",
    },
    "llama_cpp": {
        "source": f"llama-cpp-python=={env['LCP_VERSION']} sdist, sha256 {env['LCP_SHA256']}",
        "vendored_commit": env["llama_commit"],
        "cmake_flags": env["cmake_str"],
        "command": env["llama_cmd_str"],
    },
    "kvmesh": {"version": env["kvmesh_version"], "command": env["kv_cmd"]},
    "summary": summary,
    "arithmetic": arith,
    "table_markdown": table,
    "seconds": {"setup": int(env["setup_s"]), "measure": int(env["measure_s"])},
    "runs": raw_runs,
}
Path(env["out_json"]).write_text(json.dumps(out, indent=2, ensure_ascii=False) + "\n")
print(f"\nwrote {env['out_json']}")
PY
log "done: $((t_end - t_start))s ($((t_setup - t_start))s setup, $((t_end - t_setup))s measuring)"
