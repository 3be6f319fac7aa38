#!/usr/bin/env python3
"""FP8 checkpoints and their reference outputs, for tests/fp8_reference.rs.

Why: kvmesh reads the two FP8 formats published for the model families it runs and, on the
CPU, dequantizes them at load. The dequantization is checked against independent code on
small checkpoints made the way the published ones are: a model written by transformers'
`save_pretrained` in bf16, then quantized.

- `hf-qwen3-fp8-block`: the block-scaled format Qwen's `-FP8` and DeepSeek's checkpoints
  use (`quant_method: fp8`, `fmt: e4m3`, `activation_scheme: dynamic`,
  `weight_block_size: [128, 128]`, one f32 `weight_scale_inv` per 128x128 block, the output
  head left in bf16 as transformers leaves it when `modules_to_not_convert` is absent).
  Hidden 192 and intermediate 320, so every projection has a partial last block in at
  least one direction. The blocks are quantized by hand (transformers' `Fp8Quantize`
  leaves a tensor whose sides are not multiples of the block unquantized, so it cannot make
  this file): per block, scale = 448 / max|w| and the e4m3 value is w * scale, stored with
  its inverse, as `Fp8Quantize` does for whole blocks.
  The reference is transformers running the weights as dequantized by compressed-tensors'
  `FP8BlockDequantizer` (which pads a partial block and multiplies every element by the
  scale of the 128x128 block it lies in). transformers' own loader cannot be the
  reference here: its `Fp8Dequantize` derives the block from the scale grid
  (`rows // grid_rows`): 96, not 128, for a side of 192 (a silent misreading of the
  attention projections), and it refuses the MLP's side of 320 (the script checks that it
  still refuses, so a fix upstream is noticed).
- `hf-llama-fp8-block-ignore`: the same format with every side a multiple of 128, bf16
  scales, tied embeddings, and `modules_to_not_convert` naming one layer that stays bf16;
  quantized with transformers' own `Fp8Quantize`. The reference is transformers loading the
  FP8 files itself (on a machine without a GPU it dequantizes at load).
- `hf-qwen2-fp8-ct`: llm-compressor's format (`quant_method: compressed-tensors`,
  `format: float-quantized`) made with the compressed-tensors package itself: two config
  groups, per-channel weights for the attention projections and per-tensor weights for the
  MLP, both with dynamic per-token FP8 activations (the `FP8_DYNAMIC` recipe's), and an
  `ignore` list naming `lm_head` and one MLP projection by regex (compressed-tensors writes
  the modules it matched back by name). transformers loading the files with
  `CompressedTensorsConfig(dequantize=True)` holds the hand-dequantized weights rounded to
  bf16 (compressed-tensors writes fp8 x scale in the scale's dtype); the reference runs the
  exact f32 products, as for the first fixture.

In every case the reference runs in f32 with activations unquantized: kvmesh's CPU backend
is the dequantized model, and a GPU that quantizes activations is checked against it.
For each fixture the script also dequantizes the weights by hand and checks that the
reference model (and, where it can load the files, transformers' own loader) holds exactly
those weights.

The outputs are the ones `scripts/reference_logits.py` records (same prompts, greedy
continuation, teacher-forced steps), written to `tests/fixtures/reference/<model>.json`.

Usage (CPU is enough):
    target/ref-venv/bin/pip install -r scripts/requirements-reference.txt
    target/ref-venv/bin/python scripts/fp8_fixtures.py
    cargo test --test fp8_reference
"""

import json
import math
import os
import random
import shutil
import sys
import tempfile

import compressed_tensors
import safetensors.torch
import tokenizers
import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config
from transformers.utils.quantization_config import CompressedTensorsConfig, FineGrainedFP8Config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reference_logits as ref  # noqa: E402

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
BLOCK = (128, 128)

FIXTURES = [
    dict(
        name="hf-qwen3-fp8-block",
        cls=Qwen3Config,
        hidden=192,
        inter=320,
        heads=6,
        kv_heads=2,
        extra={"head_dim": 32},
        tie=False,
        method="block-by-hand",
        quantization_config={
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
        },
    ),
    dict(
        name="hf-llama-fp8-block-ignore",
        cls=LlamaConfig,
        hidden=256,
        inter=512,
        heads=4,
        kv_heads=2,
        extra={"head_dim": 64},
        tie=True,
        method="block-transformers",
        skip=["model.layers.1.mlp.down_proj"],
    ),
    dict(
        name="hf-qwen2-fp8-ct",
        cls=Qwen2Config,
        hidden=192,
        inter=320,
        heads=6,
        kv_heads=2,
        extra={},
        tie=True,
        method="compressed-tensors",
    ),
]


def base_model(spec: dict, seed: int):
    """The bf16 model as `save_pretrained` writes it, weights at the scale the other
    fixtures use (see `reference_logits.redraw`)."""
    vocab = tokenizers.Tokenizer.from_file(
        os.path.join(ref.REPO, ref.TOKENIZER_FROM, "tokenizer.json")
    ).get_vocab_size()
    cls = spec["cls"]
    cfg = cls(
        vocab_size=vocab,
        hidden_size=spec["hidden"],
        intermediate_size=spec["inter"],
        num_hidden_layers=2,
        num_attention_heads=spec["heads"],
        num_key_value_heads=spec["kv_heads"],
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=spec["tie"],
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        bos_token_id=ref.BOS_ID,
        eos_token_id=[1, 2],
        pad_token_id=3,
        **spec["extra"],
    )
    cfg.architectures = [cls.__name__.replace("Config", "ForCausalLM")]
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    ref.redraw(model, seed, spec["tie"])
    return model.to(torch.bfloat16)


def save_base(model, out: str) -> None:
    if os.path.isdir(out):
        shutil.rmtree(out)
    model.save_pretrained(out)
    os.chmod(os.path.join(out, "model.safetensors"), 0o644)
    tok_dir = os.path.join(ref.REPO, ref.TOKENIZER_FROM)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(tok_dir, f), os.path.join(out, f))


def is_projection(name: str) -> bool:
    return name.endswith("_proj.weight") or name == "lm_head.weight"


# ---------------------------------------------------------------------------------------
# block-scaled FP8 (quant_method fp8)


def quantize_blocks(w: torch.Tensor):
    """Per 128x128 block (the last ones partial): scale = 448 / max|w|, e4m3 = w * scale
    clamped to +-448, stored with 1 / scale. A block of zeros keeps scale 1."""
    rows, cols = w.shape
    gr, gc = math.ceil(rows / BLOCK[0]), math.ceil(cols / BLOCK[1])
    w = w.to(torch.float32)
    q = torch.empty(rows, cols, dtype=FP8)
    inv = torch.empty(gr, gc, dtype=torch.float32)
    for i in range(gr):
        for j in range(gc):
            r = slice(i * BLOCK[0], min((i + 1) * BLOCK[0], rows))
            c = slice(j * BLOCK[1], min((j + 1) * BLOCK[1], cols))
            amax = w[r, c].abs().max()
            scale = FP8_MAX / amax if amax > 0 else torch.tensor(1.0)
            q[r, c] = torch.clamp(w[r, c] * scale, -FP8_MAX, FP8_MAX).to(FP8)
            inv[i, j] = (1.0 / scale).to(torch.float32)
    return q, inv


def dequantize_blocks(q: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """Each element times the scale of the 128x128 block it lies in."""
    rows, cols = q.shape
    s = inv.to(torch.float32).repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)
    return q.to(torch.float32) * s[:rows, :cols]


def block_by_hand(spec: dict, model, out: str) -> dict:
    save_base(model, out)
    path = os.path.join(out, "model.safetensors")
    state = safetensors.torch.load_file(path)
    quantized, dense = {}, {}
    for name, t in state.items():
        if is_projection(name) and name != "lm_head.weight":
            q, inv = quantize_blocks(t)
            quantized[name] = q
            quantized[name.removesuffix("weight") + "weight_scale_inv"] = inv
            dense[name] = dequantize_blocks(q, inv)
        else:
            quantized[name] = t
            dense[name] = t.to(torch.float32)
    safetensors.torch.save_file(quantized, path, metadata={"format": "pt"})
    os.chmod(path, 0o644)
    set_quantization_config(out, spec["quantization_config"])
    # compressed-tensors' converter for this format, on the same tensors.
    from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import (
        FP8BlockDequantizer,
    )

    conv = FP8BlockDequantizer.from_pretrained(out, dtype=torch.float32)
    theirs = conv.process(dict(quantized))
    for name, t in dense.items():
        diff = float((theirs[name].to(torch.float32) - t).abs().max())
        if diff != 0:
            sys.exit(f"{name}: FP8BlockDequantizer differs from the by-hand dequantization by {diff}")
    check_transformers_refuses_partial_blocks(out)
    return theirs


def check_transformers_refuses_partial_blocks(out: str) -> None:
    """transformers' loader derives the block from the scale grid, so it must refuse (a side
    of 320 over 3 blocks) or disagree with 128x128 blocks; if it ever agrees, it can be the
    reference here instead."""
    try:
        with open(os.path.join(out, "config.json")) as f:
            ref.load(out, json.load(f))
    except (ValueError, RuntimeError) as e:
        print(f"  transformers' FP8 loader refuses the partial blocks, as expected: {type(e).__name__}")
        return
    sys.exit("transformers' FP8 loader now loads partial 128x128 blocks: make it the reference")


class _Quantizer:
    """What `Fp8Quantize` reads from its quantizer: the config."""

    def __init__(self, config):
        self.quantization_config = config


def block_transformers(spec: dict, model, out: str) -> dict:
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    qcfg = FineGrainedFP8Config(modules_to_not_convert=spec["skip"], weight_block_size=BLOCK)
    op = Fp8Quantize(_Quantizer(qcfg))
    save_base(model, out)
    path = os.path.join(out, "model.safetensors")
    state = safetensors.torch.load_file(path)
    quantized, dense = {}, {}
    for name, t in state.items():
        module = name.removesuffix(".weight")
        if is_projection(name) and module not in spec["skip"]:
            got = op.convert({name: t})
            q = got[name]
            inv = got[module + ".weight_scale_inv"].to(torch.bfloat16)
            if q.dtype != FP8:
                sys.exit(f"{name}: Fp8Quantize left it {q.dtype}")
            quantized[name] = q
            quantized[module + ".weight_scale_inv"] = inv
            dense[name] = dequantize_blocks(q, inv)
        else:
            quantized[name] = t
            dense[name] = t.to(torch.float32)
    safetensors.torch.save_file(quantized, path, metadata={"format": "pt"})
    os.chmod(path, 0o644)
    d = qcfg.to_dict()
    d["quant_method"] = "fp8"
    d["weight_block_size"] = list(BLOCK)
    set_quantization_config(out, d)
    return dense


# ---------------------------------------------------------------------------------------
# compressed-tensors float8


def ct_config():
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    def args(strategy, dynamic):
        return QuantizationArgs(
            num_bits=8, type="float", strategy=strategy, symmetric=True, dynamic=dynamic
        )

    token = args("token", True)
    return QuantizationConfig(
        config_groups={
            "group_0": QuantizationScheme(
                targets=[r"re:.*self_attn\.(q|k|v|o)_proj$"],
                weights=args("channel", False),
                input_activations=token,
            ),
            "group_1": QuantizationScheme(
                targets=[r"re:.*mlp\.(gate|up|down)_proj$"],
                weights=args("tensor", False),
                input_activations=token,
            ),
        },
        ignore=["lm_head", r"re:.*layers\.1\.mlp\.up_proj$"],
        format="float-quantized",
    )


@torch.no_grad()
def compressed(spec: dict, model, out: str) -> dict:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams

    qcfg = ct_config()
    apply_quantization_config(model, qcfg)
    for name, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None or scheme.weights is None:
            continue
        w = module.weight.to(torch.float32)
        if scheme.weights.strategy == "channel":
            lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
        else:
            lo, hi = w.amin().reshape(1), w.amax().reshape(1)
        scale, zp = calculate_qparams(lo, hi, scheme.weights)
        module.weight_scale.data = scale.to(module.weight_scale.dtype)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data = zp.to(module.weight_zero_point.dtype)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    save_base(model, out)
    compressor.update_config(out)
    state = safetensors.torch.load_file(os.path.join(out, "model.safetensors"))
    dense = {}
    for name, t in state.items():
        if name.endswith(("_scale", "_zero_point")):
            continue
        module = name.removesuffix(".weight")
        if t.dtype == FP8:
            s = state[module + ".weight_scale"].to(torch.float32)
            dense[name] = t.to(torch.float32) * s
        else:
            dense[name] = t.to(torch.float32)
    return dense


# ---------------------------------------------------------------------------------------


def set_quantization_config(out: str, qcfg: dict) -> None:
    path = os.path.join(out, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {k: (v.value if hasattr(v, "value") else v) for k, v in qcfg.items()}
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")


def dense_folder(out: str, dense: dict, tmp: str) -> str:
    """The checkpoint with its weights dequantized (f32) and no quantization_config."""
    folder = os.path.join(tmp, "dense")
    shutil.copytree(out, folder)
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    del cfg["quantization_config"]
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    tensors = {k: v.contiguous() for k, v in dense.items()}
    safetensors.torch.save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return folder


def load_quantized(spec: dict, out: str):
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    if spec["method"] == "compressed-tensors":
        model = AutoModelForCausalLM.from_pretrained(
            out,
            dtype=torch.float32,
            attn_implementation="eager",
            quantization_config=CompressedTensorsConfig(dequantize=True),
        )
    else:
        model = ref.load(out, cfg)
    # transformers keeps the tensors it did not dequantize (norms, embeddings, the layers
    # left unquantized) in their stored bf16; widening them is exact and makes the math f32
    # throughout, as in the other references.
    return model.to(torch.float32).eval()


def check_weights(model, dense: dict, name: str, rounded_to=None) -> None:
    """The model holds exactly the weights dequantized by hand (each rounded to
    `rounded_to` first, when the loader writes its product in that dtype)."""
    params = dict(model.named_parameters())
    for k, want in dense.items():
        if k not in params:
            if k == "lm_head.weight":
                continue
            sys.exit(f"{name}: the reference model has no parameter {k}")
        if rounded_to is not None:
            want = want.to(rounded_to).to(torch.float32)
        got = params[k].detach().to(torch.float32)
        diff = float((got - want).abs().max())
        if diff != 0:
            sys.exit(f"{name}: {k} in the reference model differs from the dequantized weight by {diff}")


def reference(spec: dict, out: str, dense: dict) -> dict:
    name = spec["name"]
    tok = tokenizers.Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    with tempfile.TemporaryDirectory() as tmp:
        if spec["method"] == "block-transformers":
            model = load_quantized(spec, out)
            check_weights(model, dense, name)
            source = "transformers loading the FP8 files (dequantized at load, on the CPU)"
        else:
            if spec["method"] == "compressed-tensors":
                # compressed-tensors writes its product in the scale's dtype (bf16 here):
                # the same weights, rounded. The reference keeps the exact f32 product,
                # as kvmesh does and as an FP8 GEMM's f32 epilogue does.
                check_weights(load_quantized(spec, out), dense, name, rounded_to=torch.bfloat16)
                source = (
                    "transformers on the weights dequantized in f32 (fp8 x scale); its own "
                    "compressed-tensors loader (dequantize=True) gives the same weights "
                    "rounded to bf16, the scales' dtype"
                )
            else:
                source = (
                    "transformers on the weights dequantized by compressed-tensors' "
                    "FP8BlockDequantizer (transformers' own FP8 loader refuses partial blocks)"
                )
            folder = dense_folder(out, dense, tmp)
            with open(os.path.join(folder, "config.json")) as f:
                model = ref.load(folder, json.load(f))
            check_weights(model, dense, name)
        vocab = model.config.vocab_size
        columns = sorted(random.Random(7).sample(range(vocab), ref.NUM_COLUMNS))
        results = ref.run_prompts(model, tok, columns)
    with open(os.path.join(out, "config.json")) as f:
        qcfg = json.load(f)["quantization_config"]
    return {
        "format": 1,
        "model": name,
        "architecture": model.config.architectures[0],
        "vocab_size": vocab,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "tokenizers_version": tokenizers.__version__,
        "compressed_tensors_version": compressed_tensors.__version__,
        "safetensors_fnv1a64": ref.fnv1a64(os.path.join(out, "model.safetensors")),
        "reference_from": source,
        "quant_method": qcfg["quant_method"],
        "quantized_weights": quantized_names(out),
        "new_tokens": ref.NEW_TOKENS,
        "columns": columns,
        "prompts": results,
    }


def quantized_names(out: str) -> list:
    with safetensors.safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        return sorted(k for k in f.keys() if f.get_slice(k).get_dtype() == "F8_E4M3")


MAKERS = {
    "block-by-hand": block_by_hand,
    "block-transformers": block_transformers,
    "compressed-tensors": compressed,
}


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    only = set(sys.argv[1:])
    for i, spec in enumerate(FIXTURES):
        if only and spec["name"] not in only:
            continue
        print(spec["name"])
        out = os.path.join(ref.REPO, ref.MODELS_DIR, spec["name"])
        model = base_model(spec, seed=2000 + i)
        dense = MAKERS[spec["method"]](spec, model, out)
        result = reference(spec, out, dense)
        path = os.path.join(ref.REPO, ref.OUT_DIR, f"{spec['name']}.json")
        with open(path, "w") as f:
            json.dump(result, f, separators=(",", ":"))
            f.write("\n")
        print(f"wrote {os.path.relpath(out, ref.REPO)} and {os.path.relpath(path, ref.REPO)}")


if __name__ == "__main__":
    main()
