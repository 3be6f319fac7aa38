#!/usr/bin/env bash
# Installs NVIDIA's CUDA 13.0 compiler and library wheels from PyPI into a Python virtual
# environment, target/cuda-tools ($KVMESH_CUDA_TOOLS), for gpu/tests/cuda_offline, which
# checks the CUDA backend on a machine with no GPU and no CUDA toolkit:
#   - nvidia-cuda-nvrtc: libnvrtc.so.13, which the backend loads at run time to compile
#     the kernels (the test compiles it the same way, for every architecture it claims);
#   - nvidia-cuda-nvcc: ptxas, which assembles that PTX and reports registers, shared memory
#     and spills per kernel;
#   - nvidia-cublas: libcublas.so.13, in which every cuBLAS function the backend calls must
#     resolve;
#   - nvidia-cuda-runtime: cuda.h, in which every driver function the backend calls must be
#     declared (the driver itself cannot be loaded without a GPU).
# 13.0 is the release the backend's bindings target (cudarc's cuda-13000) and the oldest
# driver it supports (580) understands its PTX. Does nothing when everything is there.
# scripts/test.sh runs it; about 550 MB to download, 1.2 GB installed (mostly cuBLASLt).
set -euo pipefail
cd "$(dirname "$0")/.."

NVRTC=13.0.88
NVCC=13.0.88
CUBLAS=13.0.2.14
RUNTIME=13.0.96
venv="${KVMESH_CUDA_TOOLS:-target/cuda-tools}"
stamp="$venv/.kvmesh-cuda-tools-$NVRTC-$NVCC-$CUBLAS-$RUNTIME"

[ -f "$stamp" ] && exit 0

mkdir -p "$(dirname "$venv")"
# One installer at a time (scripts/test.sh and a person may both get here).
exec 9>"$venv.lock"
if command -v flock >/dev/null 2>&1; then
    flock 9
fi
[ -f "$stamp" ] && exit 0

if [ ! -x "$venv/bin/python" ]; then
    echo "scripts/cuda-tools.sh: making $venv (python3 -m venv)" >&2
    python3 -m venv "$venv" || {
        echo "scripts/cuda-tools.sh: python3 -m venv failed; on Debian: apt-get install python3-venv" >&2
        exit 1
    }
fi
echo "scripts/cuda-tools.sh: installing NVIDIA's CUDA $NVRTC wheels (nvrtc, nvcc, cublas, runtime) into $venv" >&2
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps \
    "nvidia-cuda-nvrtc==$NVRTC" "nvidia-cuda-nvcc==$NVCC" "nvidia-cublas==$CUBLAS" \
    "nvidia-cuda-runtime==$RUNTIME"
touch "$stamp"
