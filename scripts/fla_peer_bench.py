#!/usr/bin/env python3
"""flash-linear-attention's Gated DeltaNet kernels on the shapes kvmesh's were just timed on.

    gpu-bench --presets qwen3.5-9b --gated-deltanet --json bench/results/gpu-gdn-kvmesh.json
    python3 scripts/fla_peer_bench.py --kvmesh bench/results/gpu-gdn-kvmesh.json \
        --json bench/results/gpu-gdn-fla.json

For each case kvmesh's JSON lists (one linear layer of the model: `seqs` sequences of `tokens`
new tokens, fresh prompts or decode steps continuing a state), this times what
flash-linear-attention (PyPI `fla-core`, Triton) runs for the same layer, as a serving engine
that uses it runs it:

  prompts:  causal_conv1d (SiLU) -> chunk_gated_delta_rule (q/k L2 norm, beta's sigmoid and
            the decay -exp(A_log) * softplus(a + dt_bias) in the kernel) -> rms_norm_gated
  decode:   causal_conv1d_update (SiLU) -> fused_recurrent_gated_delta_rule (the same options,
            the state in f32) -> rms_norm_gated

kvmesh's side is `delta_conv_silu` then `gated_delta_rule` with its gated norm (two launches),
and the scan path's five launches beside it (`scan ms`, CudaOptions::gdn_scan).
Inputs are bf16 for fla (as models run it) and f32 projections for kvmesh (as its engine
gives them); outputs bf16 on both. Each side's time is the median of --reps runs after
warm-up runs (Triton autotunes on its first calls), CUDA events around the whole layer.
Prints one table and writes JSON. A part that fails (fla's API moves between versions) is
recorded with its error, not guessed around.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kvmesh", required=True, help="gpu-bench --gated-deltanet's JSON")
    p.add_argument("--json", required=True, help="where to write the comparison")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    a = p.parse_args()
    if a.reps < 1 or a.warmup < 1:
        p.error("--reps and --warmup must be at least 1")
    return a


def timed(torch, fn, reps, warmup):
    """Median milliseconds of fn() over reps runs after warmup runs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def layer(torch, fla, shape, case):
    """Inputs for one case and the function running fla's layer on them."""
    nk, nv, dk, dv, kw = (shape[k] for k in ("nk", "nv", "dk", "dv", "kw"))
    b, t = case["seqs"], case["tokens"]
    cd = 2 * nk * dk + nv * dv
    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(7)

    def rand(*size, dtype=bf, scale=1.0):
        return ((torch.rand(*size, generator=g, device=dev) * 2 - 1) * scale).to(dtype)

    x = rand(b, t, cd, scale=1.5)
    z = rand(b, t, nv, dv, scale=1.5)
    a = rand(b, t, nv, scale=1.5)
    beta = rand(b, t, nv, scale=1.5)
    conv_w = rand(cd, kw, scale=0.6)
    a_log = rand(nv, dtype=torch.float32, scale=2.0)
    dt_bias = rand(nv, dtype=torch.float32)
    norm_w = rand(dv) * 0.5 + 1.0
    eps = 1e-6
    state = torch.zeros(b, nv, dk, dv, device=dev, dtype=torch.float32)
    conv_cache = torch.zeros(b, cd, kw, device=dev, dtype=bf)

    def split(mixed):
        q = mixed[..., : nk * dk].reshape(b, t, nk, dk)
        k = mixed[..., nk * dk : 2 * nk * dk].reshape(b, t, nk, dk)
        v = mixed[..., 2 * nk * dk :].reshape(b, t, nv, dv)
        return q, k, v

    opts = dict(
        use_qk_l2norm_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        use_gate_in_kernel=True,
        A_log=a_log,
        dt_bias=dt_bias,
        output_final_state=True,
    )

    def norm(o):
        return fla["rms_norm_gated"](
            o.reshape(-1, dv), z.reshape(-1, dv), norm_w, None, activation="swish", eps=eps
        )

    def prompt():
        mixed, _ = fla["causal_conv1d"](x, weight=conv_w, activation="silu")
        q, k, v = split(mixed)
        o, _ = fla["chunk"](q, k, v, a, beta, initial_state=None, **opts)
        return norm(o)

    def decode():
        mixed, _ = fla["causal_conv1d_update"](x, conv_cache, weight=conv_w, activation="silu")
        q, k, v = split(mixed)
        o, _ = fla["recurrent"](q, k, v, g=a, beta=beta, initial_state=state, **opts)
        return norm(o)

    return prompt if case["fresh"] else decode


def main():
    args = parse_args()
    ours = json.loads(Path(args.kvmesh).read_text())
    try:
        import torch
        from fla.modules.causal_conv1d import causal_conv1d, causal_conv1d_update
        from fla.modules.fused_norm_gate import rms_norm_gated
        from fla.ops.gated_delta_rule import (
            chunk_gated_delta_rule,
            fused_recurrent_gated_delta_rule,
        )
        import fla as fla_pkg
    except ImportError as e:
        sys.exit(f"fla_peer_bench: {e} (fla-core and einops must be importable: see gpu_verify.sh)")
    if not torch.cuda.is_available():
        sys.exit("fla_peer_bench: no CUDA device (this peer runs on the GPU machine)")
    fla = {
        "causal_conv1d": causal_conv1d,
        "causal_conv1d_update": causal_conv1d_update,
        "rms_norm_gated": rms_norm_gated,
        "chunk": chunk_gated_delta_rule,
        "recurrent": fused_recurrent_gated_delta_rule,
    }
    shape = ours["shape"]
    rows = []
    for case in ours["cases"]:
        row = {k: case[k] for k in ("label", "seqs", "tokens", "fresh")}
        row["kvmesh_ms"] = case["ms"]
        if "scan_ms" in case:
            row["kvmesh_scan_ms"] = case["scan_ms"]
        try:
            fn = layer(torch, fla, shape, case)
            row["fla_ms"] = timed(torch, fn, args.reps, args.warmup)
        except Exception as e:  # recorded, not guessed around
            row["fla_error"] = f"{type(e).__name__}: {e}"[:500]
        rows.append(row)
        torch.cuda.empty_cache()
    print(f"{'case':<20} {'kvmesh ms':>10} {'scan ms':>10} {'fla ms':>10} {'kvmesh / fla':>13} {'scan / fla':>11}")
    for r in rows:
        f = r.get("fla_ms")
        s = r.get("kvmesh_scan_ms", float("nan"))
        ratio = f"{r['kvmesh_ms'] / f:.2f}x" if f else r.get("fla_error", "")[:60]
        sratio = f"{s / f:.2f}x" if f else ""
        print(f"{r['label']:<20} {r['kvmesh_ms']:>10.3f} {s:>10.3f} {f if f else float('nan'):>10.3f} {ratio:>13} {sratio:>11}")
    out = {
        "benchmark": "gated-deltanet-kernels",
        "device": torch.cuda.get_device_name(0),
        "shape": shape,
        "model": ours.get("preset"),
        "fla_version": getattr(fla_pkg, "__version__", "unknown"),
        "torch_version": torch.__version__,
        "timing": f"CUDA events around one layer's conv + delta rule + gated norm; median of {args.reps} after {args.warmup} warm-up runs",
        "kvmesh_timing": ours.get("timing"),
        "cases": rows,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
