#!/usr/bin/env python3
"""FP8 Qwen3.5 checkpoints and transformers' outputs on them, for `tests/qwen35_reference.rs`.

Why: Qwen3.5 is published in FP8 in the two formats kvmesh reads for the dense families:
Qwen's own block-scaled `fp8` files, and llm-compressor's `FP8_DYNAMIC` recipe
(compressed-tensors, per-channel weights, dynamic per-token activations) with the Gated
DeltaNet layers left in bf16 (`ignore: ["lm_head", "re:.*visual.*", "re:.*linear_attn.*"]`,
the recipe published with the community `Qwen3.5-9B-FP8-Dynamic` checkpoints). kvmesh's CPU
backend dequantizes them at load; this script makes small ones the way those are made and
records what transformers computes on the dequantized weights.

- `hf-qwen35-fp8-ct`: `Qwen3_5ForCausalLM` (top-level layout), quantized by compressed-tensors
  itself with that recipe: the full-attention and MLP projections per channel, the
  linear-attention projections and the head left bf16.
- `hf-qwen35-fp8-block-cg`: `Qwen3_5ForConditionalGeneration` (a tiny vision tower, a
  multi-token-prediction head, the text model under `model.language_model.`), every
  projection of the text model block-scaled (128 x 128, partial blocks: the sides here are
  under 128) but `in_proj_a`, `in_proj_b` (the per-head gate inputs, which published FP8
  recipes keep bf16) and the head, which `modules_to_not_convert` names. The blocks are
  quantized by hand as `fp8_fixtures.py` does (transformers' `Fp8Quantize` leaves sides that
  are not multiples of 128 unquantized), checked against compressed-tensors'
  `FP8BlockDequantizer`.

The reference is transformers (f32, eager attention) on the same config with the quantized
layers' weights replaced by their exact f32 dequantization (fp8 x scale), recorded as
`scripts/qwen35_fixtures.py` records its fixtures, plus the quantization method and the FP8
tensors' names.

Usage (CPU only; a minute):
    target/ref-venv/bin/pip install -r scripts/requirements-reference.txt
    target/ref-venv/bin/python scripts/qwen35_fp8_fixtures.py
    cargo test --test qwen35_reference
"""

import json
import os
import sys
import tempfile

import compressed_tensors
import safetensors.torch
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fp8_fixtures as f8  # noqa: E402
import qwen35_fixtures as q35  # noqa: E402

SPECS = [
    dict(
        name="hf-qwen35-fp8-ct",
        method="compressed-tensors",
        dtype=torch.bfloat16,
        tie=False,
        text=dict(
            num_hidden_layers=4,
            layer_types=[q35.LIN, q35.FULL, q35.LIN, q35.FULL],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
        ),
    ),
    dict(
        name="hf-qwen35-fp8-block-cg",
        method="block",
        dtype=torch.bfloat16,
        tie=True,
        conditional=True,
        text=dict(
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
        ),
    ),
]

# Left bf16 in the block-scaled fixture, as `modules_to_not_convert` names them.
BLOCK_SKIP = ["lm_head", "in_proj_a", "in_proj_b"]


def text_projection(name: str) -> bool:
    """A linear layer of the text model (not the vision tower's, not the MTP head's)."""
    if name.startswith(("model.visual.", "mtp.")) or not name.endswith(".weight"):
        return False
    module = name.removesuffix(".weight")
    return module.endswith(("_proj", "in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b"))


def block(spec: dict, out: str) -> dict:
    path = os.path.join(out, "model.safetensors")
    state = safetensors.torch.load_file(path)
    quantized, dense = {}, {}
    for name, t in state.items():
        module = name.removesuffix(".weight")
        if text_projection(name) and not module.endswith(tuple(BLOCK_SKIP)):
            q, inv = f8.quantize_blocks(t)
            quantized[name] = q
            quantized[module + ".weight_scale_inv"] = inv
            dense[name] = f8.dequantize_blocks(q, inv)
        else:
            quantized[name] = t
    safetensors.torch.save_file(quantized, path, metadata={"format": "pt"})
    os.chmod(path, 0o644)
    f8.set_quantization_config(
        out,
        {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": list(f8.BLOCK),
            "modules_to_not_convert": BLOCK_SKIP,
        },
    )
    from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import (
        FP8BlockDequantizer,
    )

    theirs = FP8BlockDequantizer.from_pretrained(out, dtype=torch.float32).process(dict(quantized))
    for name, t in dense.items():
        diff = float((theirs[name].to(torch.float32) - t).abs().max())
        if diff != 0:
            sys.exit(f"{name}: FP8BlockDequantizer differs from the by-hand dequantization by {diff}")
    return dense


@torch.no_grad()
def compressed(spec: dict, out: str) -> dict:
    """llm-compressor's FP8_DYNAMIC recipe, applied with compressed-tensors itself to the
    model as saved (so module names are the file's)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    def args(strategy, dynamic):
        return QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True, dynamic=dynamic)

    qcfg = QuantizationConfig(
        config_groups={
            "group_0": QuantizationScheme(
                targets=["Linear"], weights=args("channel", False), input_activations=args("token", True)
            )
        },
        ignore=["lm_head", "re:.*visual.*", "re:.*linear_attn.*"],
        format="float-quantized",
    )
    model = q35.load(out).to(spec["dtype"])
    apply_quantization_config(model, qcfg)
    for _, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None or scheme.weights is None:
            continue
        w = module.weight.to(torch.float32)
        lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
        scale, zp = calculate_qparams(lo, hi, scheme.weights)
        module.weight_scale.data = scale.to(module.weight_scale.dtype)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data = zp.to(module.weight_zero_point.dtype)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    f8.save_base(model, out)
    compressor.update_config(out)
    state = safetensors.torch.load_file(os.path.join(out, "model.safetensors"))
    dense = {}
    for name, t in state.items():
        if t.dtype == f8.FP8:
            module = name.removesuffix(".weight")
            dense[name] = t.to(torch.float32) * state[module + ".weight_scale"].to(torch.float32)
    return dense


def dequantized_folder(out: str, dense: dict, tmp: str) -> str:
    """The checkpoint with its FP8 layers replaced by their f32 dequantization, their
    scales dropped and no quantization_config: what the reference loads."""
    folder = os.path.join(tmp, os.path.basename(out))
    os.makedirs(folder)
    state = safetensors.torch.load_file(os.path.join(out, "model.safetensors"))
    tensors = {}
    for name, t in state.items():
        if name.endswith(("_scale", "_scale_inv", "_zero_point")):
            continue
        tensors[name] = dense[name].contiguous() if name in dense else t.to(torch.float32)
    safetensors.torch.save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    del cfg["quantization_config"]
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    for f_ in os.listdir(out):
        if f_.startswith("tokenizer") or f_.endswith(".jinja"):
            with open(os.path.join(out, f_), "rb") as a, open(os.path.join(folder, f_), "wb") as b:
                b.write(a.read())
    return folder


def check_loaded(folder: str, dense: dict) -> None:
    """transformers' model of the dequantized folder holds exactly those weights."""
    params = {k: v for k, v in q35.load(folder).named_parameters()}
    for name, want in dense.items():
        got = params.get(name)
        if got is None:
            sys.exit(f"{folder}: the reference model has no parameter {name}")
        diff = float((got.detach().to(torch.float32) - want).abs().max())
        if diff != 0:
            sys.exit(f"{name}: the reference model's weight differs from the dequantized one by {diff}")


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    only = set(sys.argv[1:])
    for i, spec in enumerate(SPECS):
        if only and spec["name"] not in only:
            continue
        out = q35.make_checkpoint(spec, seed=4700 + i)
        dense = block(spec, out) if spec["method"] == "block" else compressed(spec, out)
        if not dense:
            sys.exit(f"{spec['name']}: nothing was quantized")
        with tempfile.TemporaryDirectory() as tmp:
            folder = dequantized_folder(out, dense, tmp)
            check_loaded(folder, dense)
            result = q35.reference(folder)
        with open(os.path.join(out, "config.json")) as f:
            qcfg = json.load(f)["quantization_config"]
        result["model"] = spec["name"]
        result["safetensors_fnv1a64"] = q35.fnv1a64(os.path.join(out, "model.safetensors"))
        result["compressed_tensors_version"] = compressed_tensors.__version__
        result["reference_from"] = "transformers on the weights dequantized in f32 (fp8 x scale)"
        result["quant_method"] = qcfg["quant_method"]
        result["quantized_weights"] = f8.quantized_names(out)
        path = os.path.join(q35.REPO, q35.OUT_DIR, f"{spec['name']}.json")
        with open(path, "w") as f:
            json.dump(result, f, separators=(",", ":"))
            f.write("\n")
        print(f"wrote {os.path.relpath(out, q35.REPO)} and {os.path.relpath(path, q35.REPO)}")


if __name__ == "__main__":
    main()
