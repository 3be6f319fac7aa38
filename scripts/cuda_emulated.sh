#!/usr/bin/env bash
# Runs CUDA-backend tests on this machine's CPU through kvmesh's CUDA emulator (gpu/emu):
# a stand-in for the CUDA driver, NVRTC and cuBLAS that cudarc loads in their place, which
# compiles the kernels with the host's C++ compiler and runs each block's threads as fibers.
#
#   scripts/cuda_emulated.sh build            # the emulator only: target/cuda-emu/
#   scripts/cuda_emulated.sh cargo ARGS...    # cargo with the emulator first on the path
#   scripts/cuda_emulated.sh test [ARGS]      # tests/cuda_parity.rs (libtest ARGS: a filter...)
#   scripts/cuda_emulated.sh ci               # what CI runs: all but the skips below
#
# What it shows: the kernels' indexing, shared memory, barriers and warp exchanges, and the
# backend's launches, copies and graphs, against the CPU backend, without a GPU. Timings
# mean nothing here, and the device's own rounding (expf's approximation, tensor-core sums)
# is the host's. Not emulated: UCX's CUDA lanes.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
out="$root/target/cuda-emu"

build() {
    mkdir -p "$out"
    local lib="$out/libkvmesh_cuda_emu.so"
    if [[ ! -f $lib || -n $(find gpu/emu -newer "$lib") ]]; then
        "${CXX:-g++}" -std=c++17 -O2 -g -fPIC -shared -Wall -Wextra -Wno-unused-parameter \
            -DKVMESH_EMU_DIR="\"$root/gpu/emu\"" gpu/emu/driver.cpp -o "$lib.tmp" -ldl -lpthread
        mv "$lib.tmp" "$lib"
    fi
    for name in libcuda.so libcuda.so.1 libnvrtc.so libnvrtc.so.13 libcublas.so libcublas.so.13 \
        libcublasLt.so libcublasLt.so.13; do
        ln -sf libkvmesh_cuda_emu.so "$out/$name"
    done
}

with_emulator() {
    build
    # The backend's PTX cache and the emulator's compiled kernels stay apart from a real
    # GPU's (the emulated NVRTC also reports a version no real one has).
    # The PTX cache keys on the kernel source, not on the emulator: one per emulator version.
    export XDG_CACHE_HOME="$out/cache-$(cat gpu/emu/* | sha1sum | cut -c1-12)"
    export KVMESH_EMU_CACHE="$out/kernels"
    export LD_LIBRARY_PATH="$out${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    "$@"
}

# Left out of `ci`, each with its reason: what the emulator cannot do, and what takes minutes
# here (the first two are run by `test` with no filter, and on a GPU by gpu_verify.sh).
ci_skips=(
    greedy_generation_is_token_identical_with_and_without_graphs # 4 min here
    device_sampling_follows_the_cpu_sampler                      # 3.5 min: 400 seeds
    the_8b_shapes_layers_match_the_cpu # 8B-sized products through the emulated cuBLAS
    fp8_cublaslt_products_match_the_quantized_product_on_the_host # 3 min, the same
    two_processes_on_one_gpu_put_kv_with_ucx_from_gpu_to_gpu # needs a UCX built with CUDA
)

case "${1:-test}" in
    build) build ;;
    cargo) shift; with_emulator cargo "$@" ;;
    test)
        shift || true
        with_emulator cargo test -j"${CARGO_BUILD_JOBS:-2}" --features cuda --test cuda_parity -- \
            --test-threads=1 "$@"
        ;;
    ci)
        skips=()
        for t in "${ci_skips[@]}"; do skips+=(--skip "$t"); done
        with_emulator cargo test -j"${CARGO_BUILD_JOBS:-2}" --features cuda --test cuda_parity -- \
            --test-threads=1 "${skips[@]}"
        # The kernel-level tests again with threads and blocks in the other order (seconds).
        KVMESH_EMU_SCHEDULE=reverse with_emulator cargo test -j"${CARGO_BUILD_JOBS:-2}" \
            --features cuda --test cuda_parity -- --test-threads=1 gated_deltanet skinny_ \
            device_sampling_of_large fp8_decode fp8_activation fp8_fused_products hybrid_prompts
        ;;
    *) echo "usage: $0 build | cargo ARGS... | test [FILTER] | ci" >&2; exit 2 ;;
esac
