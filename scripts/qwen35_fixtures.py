#!/usr/bin/env python3
"""Small random Qwen3.5 checkpoints and transformers' outputs on them, for
`tests/qwen35_reference.rs`.

Why: kvmesh reads Qwen3.5's configs and runs its hybrid forward pass (Gated DeltaNet layers
between gated full-attention layers) in its own Rust code. This script makes the checkpoints
with transformers itself and records what transformers computes on them, so the Rust tests
compare against an independent implementation without PyTorch in CI. Like
`scripts/reference_logits.py` (whose conventions it follows), it is run by hand and its
outputs are committed.

For each entry of CHECKPOINTS it builds the config object of transformers' own class
(`Qwen3_5TextConfig`, or `Qwen3_5Config` with a tiny vision tower for the
`Qwen3_5ForConditionalGeneration` layout), a model from it, redraws the weights at a scale
that gives decisive logits (see `redraw`), and `save_pretrained`s it under
`tests/fixtures/models/<name>` with the tokenizer of `models/shakespeare`. Then, as
transformers loads that folder (f32, eager attention; bf16 weights upcast):

- for prompts of 5 and 45 tokens (`<s>` + a Shakespeare passage): the logits at the last
  prompt position of one forward pass, and the greedy continuation of 24 tokens from
  `generate` (end of sequence disabled) with the top-2 gap at each step;
- checks that one forward over prompt + continuation gives the same argmax at every new
  position as generation's cached steps (the chunked and the recurrent delta rule agree
  inside transformers too).

Written to `tests/fixtures/reference/<name>.json` with the versions used and an FNV-1a hash
of `model.safetensors`.

Extra files written on purpose: the `_cg` checkpoint gets `mtp.*` tensors (real Qwen3.5
files carry a multi-token-prediction head that transformers does not load), and the
`_interval` checkpoint's config.json states `full_attention_interval` instead of
`layer_types` (transformers derives the list; the script checks it reads the file back to
the same layers).

Usage (CPU only; a minute):
    python3 -m venv target/ref-venv
    target/ref-venv/bin/pip install -r scripts/requirements-reference.txt
    target/ref-venv/bin/python scripts/qwen35_fixtures.py
    cargo test --test qwen35_reference
"""

import json
import math
import os
import shutil
import sys

import safetensors.torch
import tokenizers
import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    GenerationConfig,
    Qwen3_5Config,
    Qwen3_5TextConfig,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS_DIR = "tests/fixtures/models"
OUT_DIR = "tests/fixtures/reference"
TOKENIZER_FROM = "models/shakespeare"
BOS_ID = 0
NEW_TOKENS = 24
PROMPTS = [
    ("short", 5, "ROMEO:\nBut soft, what light through yonder window breaks?"),
    (
        "long",
        45,
        "Shall I compare thee to a summer's day?\n"
        "Thou art more lovely and more temperate:\n"
        "Rough winds do shake the darling buds of May,\n"
        "And summer's lease hath all too short a date;\n"
        "Sometime too hot the eye of heaven shines,\n"
        "And often is his gold complexion dimm'd;",
    ),
]

LIN = "linear_attention"
FULL = "full_attention"

# Shapes chosen so that the set covers: value heads per key head of 1, 2, 3 and 4; key and
# value head sizes that differ; full-attention GQA ratios of 1, 2, 4 and 8; head sizes 8 to
# 32 with partial RoPE of 1/4 and 1/2; tied and untied heads; q/k/v/o biases; f32 and bf16;
# `layer_types` lists (full layers anywhere) and the interval form; both layouts.
CHECKPOINTS = [
    dict(
        name="hf-qwen35-f32",
        dtype=torch.float32,
        tie=False,
        text=dict(
            num_hidden_layers=4,
            layer_types=[LIN, FULL, LIN, FULL],
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
        name="hf-qwen35-interval-bf16",
        dtype=torch.bfloat16,
        tie=True,
        interval=2,
        text=dict(
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=32,
            linear_num_key_heads=1,
            linear_num_value_heads=3,
            linear_key_head_dim=32,
            linear_value_head_dim=16,
        ),
    ),
    dict(
        name="hf-qwen35-gqa-bias-f32",
        dtype=torch.float32,
        tie=True,
        text=dict(
            num_hidden_layers=3,
            layer_types=[FULL, LIN, LIN],
            num_attention_heads=8,
            num_key_value_heads=1,
            head_dim=8,
            attention_bias=True,
            linear_num_key_heads=1,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=24,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "partial_rotary_factor": 0.5,
                "mrope_section": [1, 1, 0],
                "mrope_interleaved": True,
            },
        ),
    ),
    dict(
        name="hf-qwen35-cg-bf16",
        dtype=torch.bfloat16,
        tie=False,
        conditional=True,
        text=dict(
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=32,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [1, 1, 0],
                "mrope_interleaved": True,
            },
        ),
    ),
]

VISION = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
    num_position_embeddings=16,
)


def fnv1a64(path: str) -> str:
    h = 0xCBF29CE484222325
    with open(path, "rb") as f:
        data = f.read()
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def sig6(x: float) -> float:
    return float(f"{x:.6g}")


@torch.no_grad()
def redraw(model, seed: int, tied: bool) -> None:
    """Weights at a scale with decisive logits, and decays the delta rule keeps for a few
    tokens to a few dozen: (1 + w) norms with w ~ 0.1 N, the gated norm's plain weight
    near 1, A in [0.5, 4] (transformers draws up to 16, which forgets almost at once),
    dt_bias ~ 0.5 N, conv taps ~ 0.5 N, projections 1/sqrt(fan_in), embeddings as
    reference_logits.py draws them."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.startswith("model.visual"):
            continue
        n = torch.randn(p.shape, generator=g, dtype=torch.float32)
        if name.endswith("linear_attn.norm.weight"):
            p.copy_(1.0 + 0.1 * n)
        elif "norm" in name:
            p.copy_(0.1 * n)
        elif name.endswith("A_log"):
            u = torch.rand(p.shape, generator=g)
            p.copy_(torch.log(0.5 + 3.5 * u))
        elif name.endswith("dt_bias"):
            p.copy_(0.5 * n)
        elif "conv1d" in name:
            p.copy_(0.5 * n)
        elif name.endswith(".bias"):
            p.copy_(0.1 * n)
        elif "embed_tokens" in name:
            p.copy_(n * (0.25 if tied else 1.0))
        elif "lm_head" in name:
            p.copy_(n * 4.0 / math.sqrt(p.shape[1]))
        else:
            p.copy_(n / math.sqrt(p.shape[1]))


def text_config(spec: dict, vocab: int) -> dict:
    t = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        bos_token_id=BOS_ID,
        eos_token_id=[1, 2],
        pad_token_id=3,
        tie_word_embeddings=spec["tie"],
    )
    t.update(spec["text"])
    if "interval" in spec:
        t["full_attention_interval"] = spec["interval"]
    return t


def make_checkpoint(spec: dict, seed: int) -> str:
    out = os.path.join(REPO, MODELS_DIR, spec["name"])
    tok_dir = os.path.join(REPO, TOKENIZER_FROM)
    vocab = tokenizers.Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json")).get_vocab_size()
    tc = text_config(spec, vocab)
    if spec.get("conditional"):
        cfg = Qwen3_5Config(
            text_config=tc,
            vision_config=dict(VISION, out_hidden_size=tc["hidden_size"]),
            tie_word_embeddings=spec["tie"],
        )
        cfg.architectures = ["Qwen3_5ForConditionalGeneration"]
        model = AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32)
        embed = model.model.language_model.embed_tokens
    else:
        cfg = Qwen3_5TextConfig(**tc)
        cfg.architectures = ["Qwen3_5ForCausalLM"]
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        embed = model.model.embed_tokens
    redraw(model, seed, spec["tie"])
    tied = model.lm_head.weight.data_ptr() == embed.weight.data_ptr()
    if tied != spec["tie"]:
        sys.exit(f"{spec['name']}: head tied is {tied}, meant {spec['tie']}")
    model = model.to(spec["dtype"])
    if os.path.isdir(out):
        shutil.rmtree(out)
    model.save_pretrained(out)
    if spec.get("conditional"):
        add_mtp(out, tc["hidden_size"], spec["dtype"], seed)
    if "interval" in spec:
        interval_form(out, spec["interval"])
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(tok_dir, f), os.path.join(out, f))
    print(f"wrote {os.path.relpath(out, REPO)}: {sorted(os.listdir(out))}")
    return out


def add_mtp(out: str, hidden: int, dtype, seed: int) -> None:
    """A multi-token-prediction head's tensors beside the model's, as released Qwen3.5
    files carry them (transformers skips `^mtp.*` on load, and so must kvmesh)."""
    path = os.path.join(out, "model.safetensors")
    tensors = safetensors.torch.load_file(path)
    meta = {"format": "pt"}
    g = torch.Generator().manual_seed(seed + 77)
    tensors["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=g).to(dtype)
    tensors["mtp.norm.weight"] = torch.zeros(hidden, dtype=dtype)
    tensors["mtp.layers.0.input_layernorm.weight"] = torch.zeros(hidden, dtype=dtype)
    safetensors.torch.save_file(tensors, path, metadata=meta)


def interval_form(out: str, n: int) -> None:
    """config.json with `full_attention_interval` in place of the `layer_types` list
    transformers derived from it (it consumes the interval and writes only the list)."""
    path = os.path.join(out, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    types = cfg.pop("layer_types")
    cfg["full_attention_interval"] = n
    want = [FULL if (i + 1) % n == 0 else LIN for i in range(len(types))]
    if types != want:
        sys.exit(f"{out}: layer_types {types} is not the interval {n}'s {want}")
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")


def load(model_dir: str):
    with open(os.path.join(model_dir, "config.json")) as f:
        arch = json.load(f)["architectures"][0]
    cls = AutoModelForImageTextToText if "Conditional" in arch else AutoModelForCausalLM
    model = cls.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    return model


def prompt_ids(tok, length: int, text: str) -> list:
    ids = tok.encode(text, add_special_tokens=False).ids
    if len(ids) < length - 1:
        sys.exit(f"prompt text too short: {len(ids)} tokens")
    return [BOS_ID] + ids[: length - 1]


@torch.no_grad()
def greedy(model, ids: list):
    model.generation_config = GenerationConfig(
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        eos_token_id=None,
        pad_token_id=BOS_ID,
        bos_token_id=BOS_ID,
        num_beams=1,
        top_k=None,
        top_p=None,
        temperature=None,
    )
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        output_scores=True,
        return_dict_in_generate=True,
    )
    cont = [int(t) for t in out.sequences[0, len(ids):]]
    if len(cont) != NEW_TOKENS:
        sys.exit(f"generate gave {len(cont)} tokens")
    gaps = []
    for s in out.scores:
        top2 = torch.topk(s[0].float(), 2).values
        gaps.append(sig6(float(top2[0] - top2[1])))
    return cont, gaps


@torch.no_grad()
def reference(model_dir: str) -> dict:
    name = os.path.basename(model_dir)
    print(name)
    tok = tokenizers.Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    model = load(model_dir)
    text_cfg = model.config.get_text_config()
    prompts = []
    for pname, length, text in PROMPTS:
        ids = prompt_ids(tok, length, text)
        logits = model(torch.tensor([ids])).logits[0]
        cont, gaps = greedy(model, ids)
        whole = model(torch.tensor([ids + cont[:-1]])).logits[0]
        again = [int(t) for t in torch.argmax(whole[len(ids) - 1:], dim=-1)]
        if again != cont:
            bad = [i for i, (a, b) in enumerate(zip(again, cont)) if a != b]
            if min(gaps[i] for i in bad) > 1e-3:
                sys.exit(f"{name} {pname}: one pass {again} != generation {cont}")
        top2 = torch.topk(logits, 2, dim=-1).values
        prompts.append(
            {
                "name": pname,
                "ids": ids,
                "last_logits": [sig6(v) for v in logits[-1].tolist()],
                "argmax": [int(t) for t in torch.argmax(logits, dim=-1)],
                "argmax_top2_gap": [sig6(float(g)) for g in (top2[:, 0] - top2[:, 1])],
                "greedy": cont,
                "greedy_gaps": gaps,
            }
        )
        print(f"  {pname:>5}: greedy {cont[:8]}..., min gap {min(gaps):.4f}")
    return {
        "format": 1,
        "model": name,
        "architecture": model.config.architectures[0],
        "layer_types": list(text_cfg.layer_types),
        "vocab_size": text_cfg.vocab_size,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "tokenizers_version": tokenizers.__version__,
        "safetensors_fnv1a64": fnv1a64(os.path.join(model_dir, "model.safetensors")),
        "new_tokens": NEW_TOKENS,
        "prompts": prompts,
    }


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    os.makedirs(os.path.join(REPO, OUT_DIR), exist_ok=True)
    only = sys.argv[1:]
    for i, spec in enumerate(CHECKPOINTS):
        if only and spec["name"] not in only:
            continue
        d = make_checkpoint(spec, seed=4600 + i)
        ref = reference(d)
        path = os.path.join(REPO, OUT_DIR, f"{spec['name']}.json")
        with open(path, "w") as f:
            json.dump(ref, f, separators=(",", ":"))
            f.write("\n")
        print(f"wrote {os.path.relpath(path, REPO)} ({os.path.getsize(path)} bytes)")


if __name__ == "__main__":
    main()
