#!/usr/bin/env bash
# The serving path of two builds side by side (bench/src/bin/serving_ab.rs): builds
# OLD_REV's `kvmesh` (release, kept under target/ab/<sha>/ for later runs) and NEW_REV's
# (default: this working tree), then alternates them on a gateway/router with two zero-cost
# sim workers, loaded by this tree's `kvmesh bench`. Needs etcd on PATH (scripts/test.sh
# installs Debian's).
#
#   scripts/serving_ab.sh OLD_REV [NEW_REV] [serving-ab flags: --rounds 4 --requests 400 ...]
#
# Prints the table and writes bench/results/serving-ab.json.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { sed -n '2,10p' "$0"; exit 2; }
jobs="${CARGO_BUILD_JOBS:-$(nproc 2>/dev/null || echo 2)}"
old=$1
shift
new=""
if [ $# -gt 0 ] && [[ "$1" != --* ]]; then
    new=$1
    shift
fi

# The release `kvmesh` of revision $1, built once into target/ab/<sha>/kvmesh.
build_rev() {
    local sha dir wt
    sha=$(git rev-parse --short=12 "$1^{commit}")
    dir="$PWD/target/ab/$sha"
    if [ ! -x "$dir/kvmesh" ]; then
        wt=$(mktemp -d)
        git worktree add --detach -f "$wt" "$sha" >&2
        # One target folder for every revision: a second one builds incrementally.
        (cd "$wt" && CARGO_TARGET_DIR="$OLDPWD/target/ab/build" \
            cargo build --release -j"$jobs" --bin kvmesh >&2)
        mkdir -p "$dir"
        cp target/ab/build/release/kvmesh "$dir/kvmesh"
        git worktree remove --force "$wt"
    fi
    echo "$dir/kvmesh"
}

old_bin=$(build_rev "$old")
cargo build --release -j"$jobs" --bin kvmesh --bin serving-ab >&2
if [ -n "$new" ]; then
    new_bin=$(build_rev "$new")
    new_label=$(git rev-parse --short "$new^{commit}")
else
    new_bin="$PWD/target/release/kvmesh"
    new_label="$(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo '+')"
fi
exec target/release/serving-ab --old "$old_bin" --new "$new_bin" \
    --old-label "$(git rev-parse --short "$old^{commit}")" --new-label "$new_label" "$@"
