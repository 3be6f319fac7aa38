#!/usr/bin/env bash
# Runs kvmesh's whole test suite on a fresh machine: unit tests, forward-pass checks against
# committed reference fixtures, and end-to-end tests that start real `kvmesh` processes.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs="${CARGO_BUILD_JOBS:-$(nproc 2>/dev/null || echo 2)}"
cargo test --workspace --all-targets -j"$jobs" "$@"
