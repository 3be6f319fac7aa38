#!/usr/bin/env python3
"""Hugging Face transformers on the same GPU and the same checkpoints as `gpu-bench`.

The peer measurement for `bench/src/bin/gpu_bench.rs`: the same random-weight bf16 model folders
(Qwen2.5-0.5B and Llama-3.2-1B shapes, under `target/bench-models/<preset>`), the same
prompt tokens, greedy decode at batch 1/8/32/64/128 after a 128-token prompt (median
ms/step of 20 steps after 3 warm-up steps), prefill tokens/s at 512 and 2048 tokens, and a
device-to-device copy bandwidth measured in the same run (reported as 2 x bytes / time,
read + write, as gpu-bench does). Every timed region is fenced by
`torch.cuda.synchronize()`. Decode uses transformers' StaticCache when the installed
version can build one (recorded in the JSON as "kv_cache"), else its default dynamic cache.
The JSON goes to `bench/results/hf-<device name>.json`, beside gpu-bench's
`bench/results/gpu-<device name>.json` (the same file-name rule), and if that file exists
the two are printed side by side.

No network: the checkpoints are local folders and the hub is forced offline.

How to run both on the GPU machine (which has no Rust toolchain):

    # here, where Rust is installed:
    cargo build --release --features cuda --bin gpu-bench
    # carry target/release/gpu-bench to the GPU machine, then in the repository root there:
    target/release/gpu-bench              # makes target/bench-models/* once, writes gpu-*.json
    python3 scripts/hf_peer_bench.py      # needs torch with CUDA and transformers

`python3 scripts/hf_peer_bench.py --help` lists the options (`--compile` adds
torch.compile, which is how StaticCache is meant to be used; off by default so the default
run is plain eager PyTorch).
"""

import argparse
import inspect
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402


def sanitize(name):
    """The device name as a file-name fragment; the same rule as gpu_bench.rs `sanitize`."""
    s = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return s or "unknown"


def token(i, vocab):
    """The prompt token rule gpu-bench uses, so both engines see the same ids."""
    return (i * 7919 + 13) % min(vocab, 2000)


def sync_time(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t, out


def copy_bandwidth(mib, reps):
    """Best of `reps` timed device-to-device copies of a `mib`-MiB buffer, in bytes/s."""
    n = mib << 20
    src = torch.zeros(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch, not measured
    best = 0.0
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end)
        if ms > 0:
            best = max(best, 2.0 * n / (ms * 1e-3))
    del src, dst
    torch.cuda.empty_cache()
    return best


def weight_bytes_per_step(model):
    """Parameter bytes a decode step reads: everything but an untied input embedding, of
    which a step gathers only the batch's rows (gpu-bench counts the same way)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == emb.data_ptr()
    if not tied:
        total -= emb.numel() * emb.element_size()
    return total


def make_static_cache(model, batch, max_len):
    """A StaticCache, across the constructor signatures transformers has had; None when
    this version has none (the caller then uses the default dynamic cache)."""
    try:
        from transformers import StaticCache
    except ImportError:
        return None
    params = inspect.signature(StaticCache.__init__).parameters
    kw = {"config": model.config, "max_cache_len": max_len}
    if "max_batch_size" in params:
        kw["max_batch_size"] = batch
    elif "batch_size" in params:
        kw["batch_size"] = batch
    if "device" in params:
        kw["device"] = model.device
    if "dtype" in params:
        kw["dtype"] = model.dtype
    try:
        return StaticCache(**kw)
    except (TypeError, ValueError) as e:
        print(f"StaticCache unavailable ({e}); using the dynamic cache", file=sys.stderr)
        return None


def logits_kwargs(model):
    """Ask for the last position's logits only when the model supports it, so prefill does
    not spend time on a [tokens, vocab] output gpu-bench never computes."""
    params = inspect.signature(model.forward).parameters
    if "logits_to_keep" in params:
        return {"logits_to_keep": 1}
    if "num_logits_to_keep" in params:
        return {"num_logits_to_keep": 1}
    return {}


@torch.inference_mode()
def bench_model(args, name, bw):
    path = Path(args.models_dir) / name
    if not (path / "model.safetensors").exists():
        sys.exit(f"{path} has no model.safetensors; run gpu-bench first, it makes the checkpoints")
    model = AutoModelForCausalLM.from_pretrained(
        path,
        torch_dtype=torch.bfloat16,
        attn_implementation=args.attn,
        local_files_only=True,
    ).to("cuda")
    model.eval()
    forward = model
    if args.compile:
        forward = torch.compile(model, mode="reduce-overhead", fullgraph=False)
    vocab = model.config.vocab_size
    step_bytes = weight_bytes_per_step(model)
    lk = logits_kwargs(model)

    prefill = []
    for n in args.prefill_lens:
        ids = torch.tensor([[token(i, vocab) for i in range(n)]], device="cuda")
        run = lambda: forward(input_ids=ids, use_cache=True, **lk).logits[:, -1].argmax(-1)  # noqa: E731
        sync_time(run)
        secs = statistics.median(sync_time(run)[0] for _ in range(args.prefill_reps))
        print(f"{name}: prefill {n} tokens {secs * 1e3:.1f} ms", file=sys.stderr)
        prefill.append({"tokens": n, "ms": secs * 1e3, "tokens_per_s": n / secs})

    decode = []
    cache_kind = "dynamic"
    total_steps = args.warmup + args.decode_steps
    for b in args.batches:
        prompts = [[token(i + s, vocab) for i in range(args.prompt_len)] for s in range(b)]
        ids = torch.tensor(prompts, device="cuda")
        cache = None
        if not args.dynamic_cache:
            cache = make_static_cache(model, b, args.prompt_len + total_steps + 1)
        cache_kind = "static" if cache is not None else "dynamic"
        pos = torch.arange(args.prompt_len, device="cuda")
        kw = {"past_key_values": cache, "cache_position": pos} if cache is not None else {}
        out = forward(input_ids=ids, use_cache=True, **kw, **lk)
        past = out.past_key_values if cache is None else cache
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        times = []
        for step in range(total_steps):
            p = args.prompt_len + step
            cp = torch.tensor([p], device="cuda")

            def one():
                o = forward(input_ids=nxt, past_key_values=past, cache_position=cp, use_cache=True)
                return o.logits[:, -1].argmax(-1, keepdim=True), o.past_key_values

            secs, (nxt, pkv) = sync_time(one)
            if cache is None:
                past = pkv
            if step >= args.warmup:
                times.append(secs)
        step = statistics.median(times)
        print(f"{name}: batch {b} decode {step * 1e3:.2f} ms/step ({cache_kind} cache)", file=sys.stderr)
        decode.append({
            "batch": b,
            "ms_per_step": step * 1e3,
            "ms_per_output_token_per_sequence": step * 1e3,
            "tokens_per_s": b / step,
            "weight_bandwidth_utilisation": step_bytes / step / bw,
        })
        del past, cache, out
        torch.cuda.empty_cache()

    util1 = next((d["weight_bandwidth_utilisation"] for d in decode if d["batch"] == 1), None)
    result = {
        "preset": name,
        "model": str(path),
        "architecture": (model.config.architectures or ["?"])[0],
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": "bf16",
        "attn_implementation": args.attn,
        "kv_cache": cache_kind,
        "torch_compile": args.compile,
        "weight_bytes_per_step": step_bytes,
        "bound_ms_per_token_batch1": step_bytes / bw * 1e3,
        "batch1_bandwidth_utilisation": util1,
        "decode_prompt_tokens": args.prompt_len,
        "decode_warmup_steps": args.warmup,
        "decode_measured_steps": args.decode_steps,
        "decode": decode,
        "prefill": prefill,
    }
    del model, forward
    torch.cuda.empty_cache()
    return result


def side_by_side(ours, peer):
    """Prints gpu-bench against this run, per model and batch, when both files exist."""
    by_name = {m["preset"]: m for m in ours.get("models", [])}
    print()
    print(f"{'model':<14} {'what':<16} {'kvmesh':>12} {'transformers':>14} {'ratio':>8}")
    for m in peer["models"]:
        k = by_name.get(m["preset"])
        if k is None:
            continue
        kd = {d["batch"]: d for d in k["decode"]}
        for d in m["decode"]:
            o = kd.get(d["batch"])
            if o:
                print(f"{m['preset']:<14} {'decode b' + str(d['batch']) + ' ms':<16} "
                      f"{o['ms_per_step']:>12.3f} {d['ms_per_step']:>14.3f} "
                      f"{d['ms_per_step'] / o['ms_per_step']:>7.2f}x")
        kp = {p["tokens"]: p for p in k["prefill"]}
        for p in m["prefill"]:
            o = kp.get(p["tokens"])
            if o:
                print(f"{m['preset']:<14} {'prefill ' + str(p['tokens']) + ' tok/s':<16} "
                      f"{o['tokens_per_s']:>12.0f} {p['tokens_per_s']:>14.0f} "
                      f"{o['tokens_per_s'] / p['tokens_per_s']:>7.2f}x")
    print("(ratio > 1: kvmesh is faster)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--models-dir", default="target/bench-models")
    ap.add_argument("--presets", default="qwen2.5-0.5b,llama-3.2-1b")
    ap.add_argument("--json", default=None, help="default bench/results/hf-<device>.json")
    ap.add_argument("--gpu-json", default=None,
                    help="gpu-bench's result to compare with; default bench/results/gpu-<device>.json")
    ap.add_argument("--batches", type=ints, default=[1, 8, 32, 64, 128])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=20)
    ap.add_argument("--prefill-lens", type=ints, default=[512, 2048])
    ap.add_argument("--prefill-reps", type=int, default=3)
    ap.add_argument("--copy-mib", type=int, default=1024)
    ap.add_argument("--copy-reps", type=int, default=10)
    ap.add_argument("--attn", default="sdpa", help="attn_implementation (sdpa, eager, flash_attention_2)")
    ap.add_argument("--dynamic-cache", action="store_true", help="do not use StaticCache")
    ap.add_argument("--compile", action="store_true", help="torch.compile(mode=reduce-overhead)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("no CUDA device visible to torch")
    torch.manual_seed(0)
    device = torch.cuda.get_device_name(0)
    print(f"measuring device-to-device copy bandwidth ({args.copy_mib} MiB)...", file=sys.stderr)
    bw = copy_bandwidth(args.copy_mib, args.copy_reps)
    models = [bench_model(args, p, bw) for p in args.presets.split(",") if p]
    out = {
        "benchmark": "hf-transformers-peer",
        "engine": f"transformers {transformers.__version__}, torch {torch.__version__}",
        "device": device,
        "device_ordinal": 0,
        "copy_bandwidth_gb_s": bw / 1e9,
        "copy_buffer_bytes": args.copy_mib << 20,
        "copy_bandwidth_note": "tensor.copy_ on the device, 2 x bytes / time (read + write), best of copy_reps",
        "timing": "host clock around each forward (greedy argmax on the device), torch.cuda.synchronize() before and after",
        "models": models,
    }
    print(f"device       {device}")
    print(f"copy bw      {bw / 1e9:.1f} GB/s")
    for m in models:
        print()
        print(f"model        {m['model']} ({m['architecture']}, {m['parameters'] / 1e6:.0f}M parameters, "
              f"{m['kv_cache']} cache)")
        print(f"{'batch':>8} {'ms/step':>12} {'tokens/s':>12} {'bw utilisation':>14}")
        for d in m["decode"]:
            print(f"{d['batch']:>8} {d['ms_per_step']:>12.3f} {d['tokens_per_s']:>12.1f} "
                  f"{d['weight_bandwidth_utilisation'] * 100:>13.1f}%")
        for p in m["prefill"]:
            print(f"prefill      {p['tokens']} tokens in {p['ms']:.1f} ms = {p['tokens_per_s']:.0f} tokens/s")
    path = Path(args.json or f"bench/results/hf-{sanitize(device)}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")
    gpu_json = Path(args.gpu_json or f"bench/results/gpu-{sanitize(device)}.json")
    if gpu_json.exists():
        side_by_side(json.loads(gpu_json.read_text()), out)


if __name__ == "__main__":
    main()
