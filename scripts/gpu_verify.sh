#!/usr/bin/env bash
# Everything issue-level that needs an NVIDIA GPU, in one go, for a GPU machine that has no
# Rust toolchain. Here (with Rust), build and stage the binaries into gpu-out/ (ignored):
#
#   bash scripts/gpu_verify.sh build
#
# then on the GPU machine, from the repository root, with gpu-out/ copied along:
#
#   bash scripts/gpu_verify.sh run      # parity tests, gpu-bench, transformers peer bench
#
# `run` writes its logs and JSON under ${OUT:-gpu-out/results}.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
build)
    export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}"
    cargo build --release --features cuda --bin kvmesh --bin gpu-bench
    exe=$(cargo test --release --features cuda --test cuda_parity --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m["target"]["name"]=="cuda_parity" and m.get("executable"): print(m["executable"])')
    # The offline checks (kernels, registers, library symbols) in the test profile CI uses,
    # so its list of library calls is the committed one; on the GPU it also resolves the
    # driver's functions.
    offline=$(cargo test -p kvmesh-gpu --features cuda --test cuda_offline --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m["target"]["name"]=="cuda_offline" and m.get("executable"): print(m["executable"])')
    mkdir -p gpu-out
    cp "$CARGO_TARGET_DIR/release/kvmesh" "$CARGO_TARGET_DIR/release/gpu-bench" gpu-out/
    cp "$exe" gpu-out/cuda_parity
    cp "$offline" gpu-out/cuda_offline
    # Without debug info the four come to ~60 MB instead of ~300 MB: quick to copy over.
    # cuda_offline keeps its symbol table: it reads it.
    strip gpu-out/kvmesh gpu-out/gpu-bench gpu-out/cuda_parity
    strip --strip-debug gpu-out/cuda_offline
    ls -la gpu-out
    ;;
run)
    out="${OUT:-gpu-out/results}"
    mkdir -p "$out"
    nvidia-smi | tee "$out/nvidia-smi.txt" || true
    # shellcheck source=scripts/gpu_env.sh
    . scripts/gpu_env.sh
    # Kernels assembled for this GPU's architecture and the others, every library function
    # resolved (the driver's too, here), before anything runs on the device.
    gpu-out/cuda_offline --test-threads=1 --nocapture 2>&1 | tee "$out/offline.txt" ||
        echo "OFFLINE CHECKS FAILED (see $out/offline.txt)"
    KVMESH_BIN="$PWD/gpu-out/kvmesh" gpu-out/cuda_parity --test-threads=1 --nocapture 2>&1 | tee "$out/parity.txt" ||
        echo "PARITY TESTS FAILED (see $out/parity.txt); benchmarks follow anyway"
    mkdir -p target
    gpu-out/gpu-bench 2>&1 | tee "$out/gpu-bench.txt" || echo "gpu-bench FAILED"
    python3 scripts/hf_peer_bench.py 2>&1 | tee "$out/hf-peer.txt" || true
    cp bench/results/*.json "$out/" 2>/dev/null || true
    ;;
*)
    echo "usage: $0 build|run" >&2
    exit 2
    ;;
esac
