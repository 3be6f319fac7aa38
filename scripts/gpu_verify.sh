#!/usr/bin/env bash
# Everything issue-level that needs an NVIDIA GPU, in one go, for a GPU machine that has no
# Rust toolchain. Here (with Rust), build and stage the binaries into gpu-out/ (ignored):
#
#   bash scripts/gpu_verify.sh build
#
# then on the GPU machine, from the repository root, with gpu-out/ copied along (the device
# tool: `carry: ["gpu-out"]`):
#
#   bash scripts/gpu_verify.sh run      # parity, gpu-bench, serving profiles, profile, peer
#
# `run` packs its logs into ${OUT:-gpu-out/results}/gpu-results.tgz and copies the JSON
# there; `STAGES="parity bench-8b"` runs a subset, `GPU_BUDGET_S` bounds the whole run.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
build)
    # The `gpu` profile (fat LTO, no symbols) and xz keep what travels small: the device
    # takes 64 MiB in all, the repository's tracked files included.
    export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}"
    # The revision marker goes first and comes back last: a `run` started while a build is
    # still under way (its binaries are the old ones) refuses rather than test stale code.
    rm -f gpu-out/build-rev.txt gpu-out/build-rev.txt.xz
    # external-default-model: the default model is read from models/shakespeare there, not
    # carried twice (10 MB of the binary).
    cargo build --profile gpu --features cuda,external-default-model --bin kvmesh --bin gpu-bench
    artifact() { # the executable of test target $2 of package $1, in the gpu profile
        cargo test --profile gpu $1 --features cuda,external-default-model --test "$2" --no-run --message-format=json 2>/dev/null |
            python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m["target"]["name"]==sys.argv[1] and m.get("executable"): print(m["executable"])' "$2"
    }
    exe=$(artifact "" cuda_parity)
    rm -rf gpu-out
    mkdir -p gpu-out
    cp "$CARGO_TARGET_DIR/gpu/kvmesh" "$CARGO_TARGET_DIR/gpu/gpu-bench" gpu-out/
    cp "$exe" gpu-out/cuda_parity
    # The offline checks (kernels, registers, library symbols) run on every commit here; on
    # the GPU they would also resolve the driver's functions, which the parity tests call
    # anyway. GPU_OFFLINE=1 carries them too, when the transfer has room.
    if [ "${GPU_OFFLINE:-0}" = 1 ]; then
        cp "$(artifact "-p kvmesh-gpu" cuda_offline)" gpu-out/cuda_offline
        strip --strip-debug gpu-out/cuda_offline # it reads its own symbol table
    fi
    strip gpu-out/kvmesh gpu-out/gpu-bench gpu-out/cuda_parity
    # flash-linear-attention (pure Python + Triton, ~1 MB), the peer of the gdn-fla stage.
    pip download --quiet --no-deps --require-hashes -r scripts/requirements-fla.txt -d gpu-out
    # UCX with CUDA (PyPI's libucx-cu13): its run-time libraries only (~17 MB, 4 MB packed),
    # laid out as UCX finds its modules (lib/ucx beside libucs), for KVMESH_UCX_LIB there.
    ucxw=$(mktemp -d)
    pip download --quiet --no-deps --require-hashes -r scripts/requirements-ucx.txt -d "$ucxw"
    python3 - "$ucxw"/libucx_cu13-*.whl gpu-out/ucx <<'PY'
import os, sys, zipfile
whl, dest = sys.argv[1], sys.argv[2]
keep = ["lib/libucp.so.0", "lib/libuct.so.0", "lib/libucs.so.0", "lib/libucm.so.0",
        "lib/ucx/libuct_cuda.so.0", "lib/ucx/libucm_cuda.so.0", "lib/ucx/libuct_cma.so.0",
        "bin/ucx_info"]
with zipfile.ZipFile(whl) as z:
    for k in keep:
        out = os.path.join(dest, k)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "wb") as f:
            f.write(z.read("libucx/" + k))
        os.chmod(out, 0o755)
PY
    rm -rf "$ucxw"
    tar -C gpu-out -cf gpu-out/ucx-cu13.tar ucx
    rm -rf gpu-out/ucx
    xz -T0 -6 gpu-out/*
    git describe --always --dirty >gpu-out/build-rev.txt
    ls -la gpu-out
    tracked=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
    untracked=$(git ls-files -z -o --exclude-standard | xargs -0 -r du -cb 2>/dev/null | tail -1 | cut -f1)
    packed=$(du -cb gpu-out/* | tail -1 | cut -f1)
    total=$((tracked + ${untracked:-0} + packed))
    echo "transfer: $((total >> 20)) MiB (tracked $((tracked >> 20)), untracked $((${untracked:-0} >> 20)), gpu-out $((packed >> 20))) of 64"
    [ "$total" -lt $((64 << 20)) ] || { echo "over the device's 64 MiB transfer limit" >&2; exit 1; }
    ;;
run)
    # One GPU visit gives every figure, most important first, each stage bounded, and the
    # whole run within ${GPU_BUDGET_S:-540} s: a stage starts only if its bound still fits,
    # else it is skipped and says so. STAGES picks stages (default: all, in this order).
    out="${OUT:-gpu-out/results}"
    mkdir -p "$out" target
    work=$(mktemp -d /tmp/kvmesh-gpu.XXXX) # packed into $out at the end
    mkdir -p "$work"
    t0=$(date +%s)
    budget="${GPU_BUDGET_S:-540}"
    stages="${STAGES:-offline parity bench-8b bench-8b-fp8 fp8-mma-ab fp8-out-ab prefill-concurrency-8b skinny-ab-8b long-decode-8b pdl-ab-8b pdl-ab-small product-sweep fuse-ab fuse-ab-fp8 sm-split-8b profile-8b profile-8b-p8192 profile-small serve-8b colocate-8b serve-qwen35-9b serve-qwen35-9b-scan gdn-fla bench-qwen35-9b bench-qwen35-9b-scan bench-qwen35-9b-chunked bench-qwen35-9b-fp8 long-decode-qwen35 profile-8b-fp8 profile-8b-fp8-b8 profile-8b-fp8-f32 profile-qwen35 bench-llama-8b bench-small peer-8b bench-32b-fp8 bench-72b-fp8}"
    # The device returns at most 8 files from $OUT: everything is packed into one archive
    # (and a summary printed) however the run ends.
    touch "$work/.start"
    pack() { # the JSON this run wrote, beside the archive (at most 7 of them come back)
        find bench/results -name '*.json' -newer "$work/.start" -exec cp {} "$out/" \; 2>/dev/null || true
        tar -C "$work" -czf "$out/gpu-results.tgz" . 2>/dev/null || true
        echo "== stages: $(cat "$work/stages.txt" 2>/dev/null | tr '\n' ' ')"
    }
    trap pack EXIT
    [ -e gpu-out/build-rev.txt ] || {
        echo "gpu-out/build-rev.txt is missing: a build is under way or none finished (wait for" \
            "'bash scripts/gpu_verify.sh build' to print its transfer line)" >&2
        exit 2
    }
    echo "binaries built at $(cat gpu-out/build-rev.txt)"
    for f in gpu-out/*.xz; do
        [ -e "$f" ] && xz -d -f "$f"
    done
    chmod +x gpu-out/*
    # UCX with CUDA for the tests of --kv-transport ucx between GPU caches (parity runs them).
    if [ -e gpu-out/ucx-cu13.tar ]; then
        tar -C gpu-out -xf gpu-out/ucx-cu13.tar
        export KVMESH_UCX_LIB="$PWD/gpu-out/ucx/lib/libucp.so.0"
        LD_LIBRARY_PATH="$PWD/gpu-out/ucx/lib" gpu-out/ucx/bin/ucx_info -d >"$work/ucx_info.txt" 2>&1 || true
        echo "UCX for KV: $(grep -c 'Transport: cuda' "$work/ucx_info.txt") CUDA transports ($(grep 'Transport: cuda' "$work/ucx_info.txt" | tr -s ' ' | tr '\n' ' '))"
    fi
    nvidia-smi | tee "$work/nvidia-smi.txt" || true
    # shellcheck source=scripts/gpu_env.sh
    . scripts/gpu_env.sh
    stage() { # NAME BOUND_S COMMAND...: runs COMMAND under timeout if BOUND_S still fits
        local name=$1 bound=$2
        shift 2
        case " $stages " in *" $name "*) ;; *) return 0 ;; esac
        local left=$((budget - ($(date +%s) - t0)))
        if [ "$left" -lt "$bound" ]; then
            echo "$name: skipped ($left s left, needs $bound)" | tee -a "$work/stages.txt"
            return 0
        fi
        local s1
        s1=$(date +%s)
        echo "== $name (at most $bound s)"
        set +e
        timeout "$bound" "$@" >"$work/$name.txt" 2>&1
        local rc=$?
        set -e
        tail -40 "$work/$name.txt"
        echo "$name: rc=$rc in $(($(date +%s) - s1)) s" | tee -a "$work/stages.txt"
    }
    # Kernels assembled for this GPU's architecture and the others, every library function
    # resolved (the driver's too, here), before anything runs on the device.
    [ -x gpu-out/cuda_offline ] && stage offline 90 gpu-out/cuda_offline --test-threads=1 --nocapture
    stage parity 240 env KVMESH_BIN="$PWD/gpu-out/kvmesh" gpu-out/cuda_parity --test-threads=1 --nocapture
    # Only the UCX test of parity (asked for by name: parity runs it too): KV put from one
    # process's GPU cache into another's.
    stage ucx-cuda 90 env KVMESH_BIN="$PWD/gpu-out/kvmesh" gpu-out/cuda_parity --test-threads=1 --nocapture put_kv_with_ucx
    # The 8B shapes (issue: batch-1 decode against the copy bound, prefill against the GEMM
    # peak, KV capacity at the default memory share); the checkpoints are written here.
    stage bench-8b 150 gpu-out/gpu-bench --presets qwen3-8b --json "bench/results/gpu-8b-qwen3.json"
    # FP8 (block-scaled e4m3, as Qwen publishes) on the same shape and card as bench-8b's bf16:
    # the FP8 copy bound is about half, prefill runs cuBLASLt's FP8 GEMMs.
    stage bench-8b-fp8 150 gpu-out/gpu-bench --presets qwen3-8b-fp8 --batches 1,8,32,64,128 \
        --prefill-lens 512,2048 --json bench/results/gpu-8b-qwen3-fp8.json
    # FP8 decode products of 1-16 rows on the tensor cores (fp8_mma_*, CudaOptions::fp8_mma:
    # bf16 mma, activations unquantized) against the default (fp8_gemv_* up to 2 rows,
    # cuBLASLt with quantized activations beyond, three launches a product), side by side:
    # an H200 measured the FP8 step at batch 8 at 5.11 ms against bf16's 5.28.
    stage fp8-mma-ab 200 bash -c 'for o in "" --fp8-mma; do gpu-out/gpu-bench \
        --presets qwen3-8b-fp8 --batches 1,2,4,8,16,32 --sampled-batches 0 --prefill-lens 512 \
        --gemm-size 0 --copy-reps 3 $o --json bench/results/gpu-8b-qwen3-fp8-decode${o:+-mma}.json \
        || exit; done'
    # FP8 prefill with cuBLASLt writing f32 straight into the products' columns against bf16
    # widened by fp8_out_cols (24% of an H200's 512-token prefill), side by side
    # (CudaOptions::fp8_f32_out; parity checks both outputs), then the profile with it.
    stage fp8-out-ab 150 bash -c 'for o in "" --fp8-f32-out; do gpu-out/gpu-bench \
        --presets qwen3-8b-fp8 --batches 1 --sampled-batches 0 --prefill-lens 512,2048,8192 \
        --gemm-size 0 --copy-reps 3 $o --json bench/results/gpu-8b-qwen3-fp8-out${o:+-f32}.json \
        || exit; done'
    stage profile-8b-fp8-f32 120 env OUT="$work" PRESET=qwen3-8b-fp8 BATCH=1 PREFILL=512 \
        EXTRA=--fp8-f32-out bash scripts/gpu_profile.sh
    # Prefill throughput when 1 ... 128 prompts arrive at once, steps packed to 8,192 tokens
    # as the engine packs them (the issue's concurrency table), eagerly and with piecewise
    # graphs (CudaOptions::prefill_graphs: steps of up to 512 tokens), at 1,024-token prompts
    # and at 128-token ones (where a step is short and its launches show).
    stage prefill-concurrency-8b 240 bash -c 'for g in "" --prefill-graphs; do for l in 1024 128; do \
        gpu-out/gpu-bench --presets qwen3-8b --batches 1 --sampled-batches 0 \
        --prefill-lens 512 --prefill-concurrency 1,2,4,8,16,32,64,128 \
        --concurrency-prompt-len $l --gemm-size 0 --copy-reps 3 $g \
        --json bench/results/gpu-8b-qwen3-prefill-c$l${g:+-graphs}.json || exit; done; done'
    # The same card, the same checkpoint: small decode batches with every product through
    # cuBLAS, then with the skinny kernels taking up to 8 rows, side by side (the default,
    # SKINNY_MAX_ROWS, is what these decide).
    stage skinny-ab-8b 70 bash -c 'for r in 0 8; do gpu-out/gpu-bench --presets qwen3-8b \
        --skinny-max-rows $r --batches 1,2,4,8 --sampled-batches 0 --prefill-lens 512 \
        --gemm-size 0 --copy-reps 3 --json bench/results/gpu-8b-qwen3-skinny-$r.json || exit; done'
    # Decode over 2,048-token histories, attention as one block per head and split over the
    # history (CudaOptions::split_decode, the default).
    stage long-decode-8b 90 bash -c 'for f in --no-split-decode ""; do gpu-out/gpu-bench \
        --presets qwen3-8b $f --prompt-len 2048 --batches 1,8,32 --sampled-batches 0 \
        --prefill-lens 512 --gemm-size 0 --copy-reps 3 \
        --json "bench/results/gpu-8b-qwen3-long${f:+-unsplit}.json" || exit; done'
    # Programmatic dependent launch off and on, side by side (CudaOptions::pdl, whose `auto`
    # these decide): the 8B step at small batches, and the small models, where launch gaps
    # are a larger share.
    stage pdl-ab-8b 90 bash -c 'for f in off on; do gpu-out/gpu-bench --presets qwen3-8b \
        --pdl $f --batches 1,4,8,32 --sampled-batches 0 --prefill-lens 512 --gemm-size 0 \
        --copy-reps 3 --json "bench/results/gpu-8b-qwen3-pdl-$f.json" || exit; done'
    stage pdl-ab-small 60 bash -c 'for f in off on; do gpu-out/gpu-bench --pdl $f \
        --batches 1,8,32 --sampled-batches 1 --prefill-lens 512 --gemm-size 0 --copy-reps 3 \
        --json "bench/results/gpu-small-pdl-$f.json" || exit; done'
    # Each kind of decode product timed alone and over every layer back to back, at 1 and 4
    # rows (CUDA events, caches not emptied as ncu empties them): what a launch costs beyond
    # its bytes, the measured basis of the small-model and 85% work.
    stage product-sweep 120 gpu-out/gpu-bench --presets qwen2.5-0.5b,llama-3.2-1b,qwen3-8b \
        --product-sweep 1,4 --batches 1 --sampled-batches 0 --prefill-lens 0 --gemm-size 0 \
        --copy-reps 3 --json bench/results/gpu-product-sweep.json
    # The residual adds and norms as the next product's prologue (CudaOptions::fuse_norms),
    # then also the rotary embedding and K/V write as the q/k/v product's epilogue
    # (CudaOptions::fuse_rope; Qwen3's q/k norms too, by the last warp of each head), both
    # off by default until this has run: off, norms, norms + rope side by side. Qwen3-8B is
    # the shape of the 85% aim: the H100's third run was 6.08 ms against 5.95, and
    # rope_kv_write 0.18 ms of its kernel time.
    stage fuse-ab 180 bash -c 'for f in off norms rope; do gpu-out/gpu-bench \
        $([ $f != off ] && echo --fuse-norms) $([ $f = rope ] && echo --fuse-rope) \
        --presets qwen2.5-0.5b,llama-3.2-1b,qwen3-8b \
        --batches 1,2,8 --sampled-batches 0 --prefill-lens 512 --gemm-size 0 --copy-reps 3 \
        --json "bench/results/gpu-fuse-$f.json" || exit; done'
    # The same for FP8 products (fp8_norm*, fp8_rope*: fp8_gemv_* with those prologues and
    # epilogues) on Qwen3-8B's shape as a block-scaled FP8 checkpoint: off, norms,
    # norms + rope (its q/k norms included). An H200 spent 15% of Qwen3-8B FP8's batch-1
    # step in the launches they replace (add_rmsnorm 8.4%, rope_kv_write 3.8%, silu_mul 2.4%,
    # the last now always the gate/up product's epilogue).
    stage fuse-ab-fp8 200 bash -c 'for f in off norms rope; do gpu-out/gpu-bench \
        $([ $f != off ] && echo --fuse-norms) $([ $f = rope ] && echo --fuse-rope) \
        --presets qwen3-8b-fp8 --batches 1,2 --sampled-batches 0 --prefill-lens 512 \
        --gemm-size 0 --copy-reps 3 --json "bench/results/gpu-fuse-fp8-$f.json" || exit; done'
    # Each side of an SM split alone (green contexts; `--sm-split`): decode on 36 SMs, prefill
    # on 96, against bench-8b's whole GPU: what a split costs each engine.
    stage sm-split-8b 130 bash -c 'for side in decode prefill; do gpu-out/gpu-bench \
        --presets qwen3-8b --sm-split prefill:96,decode:36 --sm-side $side --batches 1,8,32,64 \
        --sampled-batches 0 --prefill-lens 512,2048 --gemm-size 0 --copy-reps 3 \
        --json "bench/results/gpu-8b-qwen3-sm-$side.json" || exit; done'
    # Where the batch-1 step goes, kernel by kernel: what the fusion work is decided on.
    stage profile-8b 120 env OUT="$work" PRESET=qwen3-8b BATCH=1 PREFILL=512 bash scripts/gpu_profile.sh
    # The 8,192-token prefill kernel by kernel: how much of it is attention (inferred, not
    # measured: about 180 of the H100's 315 ms, at ~110 TFLOP/s before the prefill attention
    # kernel's loop went from 850 to 303 instructions a tile), and what comes next.
    stage profile-8b-p8192 150 env OUT="$work" PRESET=qwen3-8b BATCH=1 PREFILL=8192 \
        bash scripts/gpu_profile.sh
    # The small model's step, kernel by kernel (the launch-bubble work is decided on it).
    stage profile-small 60 env OUT="$work" PRESET=qwen2.5-0.5b BATCH=1 PREFILL=2048 \
        bash scripts/gpu_profile.sh
    stage serve-8b 170 env OUT="$work" MODEL=target/bench-models/qwen3-8b bash scripts/gpu_serve_bench.sh
    # Prefill and decode sharing the GPU, on the public two-servers experiment's load: one
    # server, two servers sharing the GPU, and one node whose two engines share every SM or
    # split them (green contexts).
    stage colocate-8b 500 env OUT="$work" MODEL=target/bench-models/qwen3-8b \
        bash scripts/gpu_colocate_bench.sh
    # Qwen3.5-9B (hybrid: Gated DeltaNet + gated attention) served through the gateway: one
    # request at a time (the batch-1 step as served, against the copy bound of its weights and
    # state), then the Throughput profile of vLLM's tuning table for that model (1,024 in /
    # 128 out); the checkpoint (18 GB, random bf16) is written here first.
    stage serve-qwen35-9b 300 env OUT="$work/qwen35" MODEL=target/bench-models/qwen3.5-9b \
        PROFILES="batch1 throughput" TAG=qwen3.5-9b bash -c '[ -e "$MODEL/model.safetensors" ] || \
        gpu-out/kvmesh model init-random --preset qwen3.5-9b --out "$MODEL" || exit; \
        bash scripts/gpu_serve_bench.sh'
    # The same served with the scan path for the Gated DeltaNet layers' prefill
    # (CudaOptions::gdn_scan, `--cuda-options gdn-scan`), not the default until measured.
    stage serve-qwen35-9b-scan 240 env OUT="$work/qwen35-scan" MODEL=target/bench-models/qwen3.5-9b \
        PROFILES="batch1 throughput" TAG=qwen3.5-9b-scan CUDA_OPTIONS=gdn-scan bash -c \
        '[ -e "$MODEL/model.safetensors" ] || gpu-out/kvmesh model init-random \
        --preset qwen3.5-9b --out "$MODEL" || exit; bash scripts/gpu_serve_bench.sh'
    # Qwen3.5-9B's Gated DeltaNet layer: kvmesh's two kernels and its scan path
    # (CudaOptions::gdn_scan), then flash-linear-attention's (chunked prompts, fused
    # recurrent decode) on the same shapes, in the same run.
    stage gdn-fla 240 bash -c 'gpu-out/gpu-bench --presets qwen3.5-9b --gated-deltanet \
        --json bench/results/gpu-gdn-kvmesh.json || exit; d=$(mktemp -d); \
        for w in gpu-out/*.whl; do python3 -m zipfile -e "$w" "$d" || exit; done; \
        PYTHONPATH="$d" python3 scripts/fla_peer_bench.py \
        --kvmesh bench/results/gpu-gdn-kvmesh.json --json bench/results/gpu-gdn-fla.json'
    # Qwen3.5-9B's steps alone (gpu-bench drives the hybrid backend): batch-1 decode against
    # the copy bound of its weights and recurrent state, larger batches, and prefill, whose
    # linear layers run the recurrence token by token (what gdn-fla weighs against chunking).
    stage bench-qwen35-9b 200 gpu-out/gpu-bench --presets qwen3.5-9b --batches 1,8,32,64,128 \
        --sampled-batches 1 --prefill-lens 512,2048,8192 --json bench/results/gpu-9b-qwen35.json
    # The same prompts through the scan path (whose default this decides; decode steps are
    # the same kernels either way).
    stage bench-qwen35-9b-scan 120 gpu-out/gpu-bench --presets qwen3.5-9b --gdn-scan --batches 1 \
        --sampled-batches 0 --prefill-lens 512,2048,8192 --json bench/results/gpu-9b-qwen35-scan.json
    # And through the chunked form (CudaOptions::gdn_chunked).
    stage bench-qwen35-9b-chunked 120 gpu-out/gpu-bench --presets qwen3.5-9b --gdn-chunked \
        --batches 1 --sampled-batches 0 --prefill-lens 512,2048,8192 \
        --json bench/results/gpu-9b-qwen35-chunked.json
    # Qwen3.5-9B as an FP8 checkpoint (Qwen's block-scaled format, the Gated DeltaNet gate
    # inputs left bf16; made in memory), beside the bf16 figures above: its batch-1 step
    # reads about half the bytes.
    stage bench-qwen35-9b-fp8 200 gpu-out/gpu-bench --in-memory --presets qwen3.5-9b-fp8 \
        --batches 1,8,32,64,128 --sampled-batches 0 --prefill-lens 512,2048 \
        --json bench/results/gpu-9b-qwen35-fp8.json
    # Qwen3.5-9B's decode over 2,048-token histories: its full-attention layers' head of 256
    # now has the 16-byte split decode kernel (served at 1,024-token histories its batch-1
    # token took 9.32 ms against gpu-bench's 5.62 ms at 128).
    stage long-decode-qwen35 120 gpu-out/gpu-bench --presets qwen3.5-9b --prompt-len 2048 \
        --batches 1,8,32 --sampled-batches 0 --prefill-lens 512 --gemm-size 0 --copy-reps 3 \
        --json bench/results/gpu-9b-qwen35-long.json
    # The FP8 8B step kernel by kernel (an H200 spent 69% of the batch-1 step in
    # fp8_gemv_block_m1 at 61% of the copy bandwidth, and 24% of a 512-token prefill in
    # fp8_out_cols): what the FP8 work is decided on.
    stage profile-8b-fp8 120 env OUT="$work" PRESET=qwen3-8b-fp8 BATCH=1 PREFILL=512 \
        bash scripts/gpu_profile.sh
    # The FP8 8B step at batch 8, kernel by kernel: an H200 measured it at 5.11 ms against
    # bf16's 5.28 (batch 1: 3.87 against 4.93), though it reads half the bytes. Steps of more
    # than 4 rows quantize the activations and run cuBLASLt's block-scaled GEMM and
    # fp8_out_cols, three launches a product: this says whether the launches or the GEMMs
    # at 8 tokens take the time, which decides a tensor-core GEMV for 2-16 rows.
    stage profile-8b-fp8-b8 120 env OUT="$work" PRESET=qwen3-8b-fp8 BATCH=8 PREFILL=512 \
        bash scripts/gpu_profile.sh
    # Qwen3.5-9B kernel by kernel, a 2,048-token prefill and a batch-1 step: where its
    # prefill (a fifth of Qwen3-8B's rate on the first H200 run) goes, with the tensor-core
    # prefill attention for head size 256 in.
    stage profile-qwen35 150 env OUT="$work" PRESET=qwen3.5-9b BATCH=1 PREFILL=2048 \
        bash scripts/gpu_profile.sh
    stage bench-llama-8b 110 gpu-out/gpu-bench --presets llama-3.1-8b --json "bench/results/gpu-8b-llama.json"
    stage bench-small 60 gpu-out/gpu-bench
    # Qwen3-32B as FP8 on one H100 (34 GB of weights; bf16 would leave almost no KV), and
    # Qwen2.5-72B as FP8 where the card holds it (an H200: 73 GB of weights). Both checkpoints
    # are made in memory: the machine's disk is smaller than the 72B one.
    stage bench-32b-fp8 240 gpu-out/gpu-bench --in-memory --presets qwen3-32b-fp8 \
        --batches 1,8,32,64,128 --prefill-lens 512,2048 --json bench/results/gpu-32b-qwen3-fp8.json
    stage bench-72b-fp8 300 bash -c 'mib=$(nvidia-smi --query-gpu=memory.total \
        --format=csv,noheader,nounits | head -1); if [ "${mib:-0}" -lt 100000 ]; then \
        echo "skipped: $mib MiB on the card, the 72B FP8 weights take 73 GB (an H200 holds them)"; \
        exit 0; fi; gpu-out/gpu-bench --in-memory --presets qwen2.5-72b-fp8 --batches 1,8,32,64 \
        --prefill-lens 512,2048 --json bench/results/gpu-72b-qwen25-fp8.json'
    # transformers + torch.compile on the 8B checkpoint: each new shape recompiles (the first
    # run spent its 150 s compiling after a 512-token prefill), so one prefill length.
    stage peer-8b 240 python3 scripts/hf_peer_bench.py --presets qwen3-8b --compile --batches 1,32 \
        --prefill-lens 512 --gpu-json bench/results/gpu-8b-qwen3.json --json bench/results/hf-compiled-8b.json
    ;;
*)
    echo "usage: $0 build|run" >&2
    exit 2
    ;;
esac
