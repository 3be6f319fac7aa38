#!/usr/bin/env python3
"""Record reference outputs of Hugging Face transformers for kvmesh's forward-pass tests.

Why: kvmesh implements the Llama / Qwen2 / Qwen3 / Mistral forward pass itself (in Rust) and
reads the checkpoints' config.json itself. To prove both right we compare against an
independent implementation, `transformers`, on the same folders. PyTorch is far too heavy
for CI, so this script is run by hand and its outputs are committed as JSON; the Rust tests
(`tests/forward_reference.rs`, `tests/config_layouts.rs`) only read the JSON.

Two jobs:

`--make-checkpoints` writes the `hf-*` folders under `tests/fixtures/models/` with
transformers itself: a config object of the family's own class, a model built from it, its
weights redrawn at a scale that gives decisive logits (transformers' 0.02 init makes every
logit nearly equal), and `save_pretrained`, so the files are exactly what a user's
transformers writes today (the `rope_parameters` layout, `dtype`, `layer_types`). The set
covers every family, f32 and bf16, tied and untied embeddings, every RoPE type kvmesh runs
(default, linear, dynamic, llama3, yarn; the scaled ones at a small
`max_position_embeddings` so scaling matters within a 45-token prompt), sliding windows
(Mistral's, and Qwen2's per-layer one) and Llama's/Qwen3's attention and MLP biases.

The default job records references for every folder (the `hf-*` ones, the `tiny-*` ones
`kvmesh model init-random` wrote, and the trained `models/shakespeare`):

1. The config in both layouts: `config.json` as it is, and the other layout written by
   `legacy_config()` to `tests/fixtures/legacy-configs/<model>.json` (top-level `rope_theta`,
   `rope_scaling` with `type` or `rope_type`, `torch_dtype`, no `layer_types`). transformers
   loads both; the script checks that they give identical logits.
2. The model loaded with `dtype=torch.float32, attn_implementation="eager"` (bf16 weights are
   upcast, as kvmesh's CPU backend does), and its rotary tables (`inv_freq`,
   `attention_scaling`; for dynamic RoPE also at the lengths the prompts reach).
3. Two prompts as token ids: `<s>` then a fixed Shakespeare passage tokenized by the folder's
   `tokenizer.json`, cut to 5 and 45 tokens (the longer spans three 16-token KV blocks and
   passes the scaled models' `max_position_embeddings`). For each:
   - the logits at the last prompt position (one forward over the prompt) and the argmax at
     every prompt position with its gap to the runner-up;
   - the greedy continuation of 24 tokens from `generate(do_sample=False)` with end of
     sequence disabled (what kvmesh's `ignore_eos` does);
   - the teacher-forced sequence (prompt + continuation) as generation computes it, one
     pass over the prompt and then one token at a time through the KV cache: at every
     position the argmax, the gap to the runner-up, the log-sum-exp, the top 8 (ids and
     logits) and the logits at 24 fixed vocabulary columns. That is also what defines
     dynamic RoPE's result (its frequencies change with the length, so keys keep the
     rotation of the length they were computed at); for every other type the script checks
     it against one forward over the whole sequence.
4. Writes `tests/fixtures/reference/<model>.json` (floats to 6 significant digits) with the
   transformers / torch / tokenizers versions and an FNV-1a hash of `model.safetensors`.

Usage (CPU is enough; a minute or two):
    python3 -m venv /tmp/venv-ref
    /tmp/venv-ref/bin/pip install -r scripts/requirements-reference.txt
    /tmp/venv-ref/bin/python scripts/reference_logits.py --make-checkpoints
    /tmp/venv-ref/bin/python scripts/reference_logits.py
    cargo test --test forward_reference --test config_layouts
"""

import argparse
import copy
import json
import math
import os
import random
import shutil
import sys
import tempfile

import tokenizers
import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS_DIR = "tests/fixtures/models"
OUT_DIR = "tests/fixtures/reference"
LEGACY_DIR = "tests/fixtures/legacy-configs"
TOKENIZER_FROM = "models/shakespeare"

# (name, length, text): the prompt is bos + the text's first `length - 1` tokens.
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
BOS_ID = 0
NEW_TOKENS = 24
TOP = 8
NUM_COLUMNS = 24

CONFIG_CLASSES = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "mistral": MistralConfig,
}

# The checkpoints transformers writes. `legacy_type_key` picks how the legacy config spells
# the RoPE type ("type", the oldest spelling, or "rope_type"), so both are read somewhere.
CHECKPOINTS = [
    dict(
        name="hf-llama-llama3-f32",
        family="llama",
        dtype=torch.float32,
        tie=False,
        max_position_embeddings=512,
        rope={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        legacy_type_key="rope_type",
    ),
    dict(
        name="hf-llama-linear-bias-bf16",
        family="llama",
        dtype=torch.bfloat16,
        tie=True,
        max_position_embeddings=32,
        rope={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        extra={"attention_bias": True, "mlp_bias": True},
        legacy_type_key="type",
    ),
    dict(
        name="hf-llama-dynamic-f32",
        family="llama",
        dtype=torch.float32,
        tie=True,
        max_position_embeddings=32,
        rope={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
        legacy_type_key="type",
    ),
    dict(
        name="hf-qwen2-bf16",
        family="qwen2",
        dtype=torch.bfloat16,
        tie=True,
        max_position_embeddings=4096,
        rope={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    dict(
        name="hf-qwen2-yarn-window-f32",
        family="qwen2",
        dtype=torch.float32,
        tie=False,
        max_position_embeddings=128,
        rope={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        extra={"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
        legacy_type_key="type",
    ),
    dict(
        name="hf-qwen3-yarn-bf16",
        family="qwen3",
        dtype=torch.bfloat16,
        tie=True,
        max_position_embeddings=128,
        rope={
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "attention_factor": 1.25,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "truncate": False,
        },
        extra={"head_dim": 32},
        legacy_type_key="rope_type",
    ),
    dict(
        name="hf-qwen3-bias-f32",
        family="qwen3",
        dtype=torch.float32,
        tie=False,
        max_position_embeddings=4096,
        rope={"rope_type": "default", "rope_theta": 1000000.0},
        extra={"head_dim": 32, "attention_bias": True},
    ),
    dict(
        name="hf-mistral-window-f32",
        family="mistral",
        dtype=torch.float32,
        tie=False,
        max_position_embeddings=4096,
        rope={"rope_type": "default", "rope_theta": 1000000.0},
        extra={"sliding_window": 8},
    ),
    dict(
        name="hf-mistral-bf16",
        family="mistral",
        dtype=torch.bfloat16,
        tie=True,
        max_position_embeddings=4096,
        rope={"rope_type": "default", "rope_theta": 10000.0},
        extra={"sliding_window": None},
    ),
]

OTHER_MODELS = [
    "tests/fixtures/models/tiny-llama",
    "tests/fixtures/models/tiny-qwen2",
    "tests/fixtures/models/tiny-qwen3",
    "tests/fixtures/models/tiny-mistral",
    "models/shakespeare",
]


def sig6(x: float) -> float:
    """Rounds to 6 significant digits (keeps the JSON small; f32 has ~7)."""
    return float(f"{x:.6g}")


def fnv1a64(path: str) -> str:
    """64-bit FNV-1a of a file, as hex: lets the Rust test tell a stale fixture (the model
    was regenerated since) from a wrong forward pass."""
    h = 0xCBF29CE484222325
    with open(path, "rb") as f:
        data = f.read()
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


# ---------------------------------------------------------------------------------------
# checkpoints


@torch.no_grad()
def redraw(model, seed: int, tied: bool) -> None:
    """Weights at the scale `kvmesh model init-random` uses: unit-variance embeddings,
    1/sqrt(fan_in) matrices, norms near 1, biases of 0.1. Logits then have a spread of
    several units, so greedy choices are decisive rather than near-ties. With tied
    embeddings the embeddings are drawn at 0.25: at unit scale a token's own embedding
    dominates the residual stream and the tied head just repeats the last token."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        n = torch.randn(p.shape, generator=g, dtype=torch.float32)
        if "norm" in name:
            p.copy_(1.0 + 0.1 * n)
        elif name.endswith(".bias"):
            p.copy_(0.1 * n)
        elif "embed_tokens" in name:
            p.copy_(n * (0.25 if tied else 1.0))
        elif "lm_head" in name:
            p.copy_(n * 4.0 / math.sqrt(p.shape[1]))
        else:
            p.copy_(n / math.sqrt(p.shape[1]))


def make_checkpoint(spec: dict, seed: int) -> str:
    out = os.path.join(REPO, MODELS_DIR, spec["name"])
    tok_dir = os.path.join(REPO, TOKENIZER_FROM)
    vocab = tokenizers.Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json")).get_vocab_size()
    cls = CONFIG_CLASSES[spec["family"]]
    cfg = cls(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=spec["max_position_embeddings"],
        rms_norm_eps=1e-6,
        tie_word_embeddings=spec["tie"],
        rope_parameters=copy.deepcopy(spec["rope"]),
        bos_token_id=BOS_ID,
        eos_token_id=[1, 2],
        pad_token_id=3,
        **spec.get("extra", {}),
    )
    cfg.architectures = [cls.__name__.replace("Config", "ForCausalLM")]
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    redraw(model, seed, spec["tie"])
    if spec["tie"]:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model = model.to(spec["dtype"])
    if os.path.isdir(out):
        shutil.rmtree(out)
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(tok_dir, f), os.path.join(out, f))
    print(f"wrote {os.path.relpath(out, REPO)}: {sorted(os.listdir(out))}")
    return out


def legacy_config(cfg: dict, type_key: str = "type") -> dict:
    """The same config in the layout transformers wrote before `rope_parameters`: top-level
    `rope_theta`, `rope_scaling` for a scaled type (absent otherwise), `torch_dtype`, and no
    `layer_types` (older files derived it from `max_window_layers`)."""
    old = {}
    for k, v in cfg.items():
        if k == "rope_parameters":
            p = dict(v)
            old["rope_theta"] = p.pop("rope_theta", 10000.0)
            kind = p.pop("rope_type", p.pop("type", "default"))
            if kind != "default":
                old["rope_scaling"] = {type_key: kind, **p}
        elif k == "dtype":
            old["torch_dtype"] = v
        elif k == "layer_types":
            continue
        else:
            old[k] = v
    return old


# ---------------------------------------------------------------------------------------
# references


def prompt_ids(tok: tokenizers.Tokenizer, length: int, text: str) -> list:
    ids = tok.encode(text, add_special_tokens=False).ids
    if len(ids) < length - 1:
        sys.exit(f"prompt text too short: {len(ids)} tokens, need {length - 1}")
    return [BOS_ID] + ids[: length - 1]


def load(model_dir: str, config: dict):
    """The folder as transformers loads it, with `config` as its config.json."""
    with tempfile.TemporaryDirectory() as tmp:
        for f in os.listdir(model_dir):
            if f != "config.json":
                os.symlink(os.path.join(model_dir, f), os.path.join(tmp, f))
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f)
        model = AutoModelForCausalLM.from_pretrained(
            tmp, dtype=torch.float32, attn_implementation="eager"
        )
    model.eval()
    return model


@torch.no_grad()
def reset_rope(model) -> None:
    """Dynamic RoPE keeps the longest length it saw; a one-token pass puts it back to the
    model's own frequencies, so each measurement starts from the same state."""
    model(torch.tensor([[BOS_ID]]))


@torch.no_grad()
def teacher_forced(model, ids: list, cont: list) -> torch.Tensor:
    """Logits at every position of `ids + cont` (but the last) the way generation computes
    them: one pass over the prompt, then the continuation one token at a time through the
    KV cache. For RoPE that ignores the length this equals one pass over everything (the
    script checks it); for dynamic RoPE it is what decoding gives, keys rotated by the length
    at the time they were computed."""
    reset_rope(model)
    out = model(torch.tensor([ids]), use_cache=True)
    past = out.past_key_values
    rows = list(out.logits[0])
    for t in cont[:-1]:
        out = model(torch.tensor([[t]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        rows.append(out.logits[0, -1])
    return torch.stack(rows)


@torch.no_grad()
def greedy(model, ids: list) -> list:
    reset_rope(model)
    # Greedy, never stopping: no eos to stop on. generate() fills unset fields from the
    # folder's generation_config.json, so replace it rather than merge with it.
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
    gen = model.generate(
        torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long)
    )
    cont = [int(t) for t in gen[0, len(ids):]]
    if len(cont) != NEW_TOKENS:
        sys.exit(f"generate gave {len(cont)} tokens, not {NEW_TOKENS}")
    return cont


def rope_tables(model, lengths: list) -> dict:
    emb = model.model.rotary_emb
    out = {
        "rope_type": emb.rope_type,
        "inv_freq": [float(x) for x in emb.original_inv_freq.tolist()],
        "attention_scaling": float(emb.attention_scaling),
    }
    if "dynamic" in emb.rope_type:
        fn = ROPE_INIT_FUNCTIONS["dynamic"]
        out["inv_freq_at_length"] = {
            str(n): [float(x) for x in fn(model.config, None, seq_len=n)[0].tolist()]
            for n in lengths
        }
    return out


@torch.no_grad()
def run_prompts(model, tok, columns: list) -> list:
    dynamic = "dynamic" in model.model.rotary_emb.rope_type
    results = []
    for name, length, text in PROMPTS:
        ids = prompt_ids(tok, length, text)
        reset_rope(model)
        logits = model(torch.tensor([ids])).logits[0]  # [len, vocab]
        top2 = torch.topk(logits, 2, dim=-1).values
        cont = greedy(model, ids)

        seq = ids + cont
        steps = teacher_forced(model, ids, cont)
        # Consistency: greedy decoding picks the argmax of the cached pass at every new
        # position, and for RoPE that ignores the length, the cached pass equals one forward
        # over the whole sequence.
        step_argmax = [int(t) for t in torch.argmax(steps, dim=-1)]
        if step_argmax[len(ids) - 1:] != cont:
            sys.exit(f"{name}: generate {cont} != argmax of the cached pass {step_argmax[len(ids) - 1:]}")
        if not dynamic:
            reset_rope(model)
            whole = model(torch.tensor([seq[:-1]])).logits[0]
            diff = float((whole - steps).abs().max())
            if diff > 1e-3:
                sys.exit(f"{name}: one pass and the cached pass differ by {diff}")
        stop2 = torch.topk(steps, 2, dim=-1).values
        topk = torch.topk(steps, TOP, dim=-1)
        gaps = (stop2[:, 0] - stop2[:, 1]).tolist()
        results.append(
            {
                "name": name,
                "ids": ids,
                "last_logits": [sig6(v) for v in logits[-1].tolist()],
                "argmax": [int(t) for t in torch.argmax(logits, dim=-1)],
                "argmax_top2_gap": [sig6(float(g)) for g in (top2[:, 0] - top2[:, 1])],
                "greedy": cont,
                "greedy_min_top2_gap": sig6(min(gaps[len(ids) - 1:])),
                "steps": {
                    "argmax": step_argmax,
                    "gap": [sig6(g) for g in gaps],
                    "lse": [sig6(v) for v in torch.logsumexp(steps, dim=-1).tolist()],
                    "top_ids": topk.indices.tolist(),
                    "top_logits": [[sig6(v) for v in r] for r in topk.values.tolist()],
                    "columns": [[sig6(v) for v in r] for r in steps[:, columns].tolist()],
                },
            }
        )
        print(
            f"  {name:>5}: {len(ids)} ids, greedy={cont[:6]}..., "
            f"min top-2 gap on the greedy path {min(gaps[len(ids) - 1:]):.4f}"
        )
    return results


def flat(results: list) -> torch.Tensor:
    vals = []
    for p in results:
        vals += p["last_logits"]
        for r in p["steps"]["columns"] + p["steps"]["top_logits"]:
            vals += r
        vals += p["steps"]["lse"]
    return torch.tensor(vals)


def reference(model_dir: str, type_key: str) -> dict:
    name = os.path.basename(os.path.normpath(model_dir))
    print(name)
    with open(os.path.join(model_dir, "config.json")) as f:
        current = json.load(f)
    if "rope_parameters" not in current:
        sys.exit(f"{model_dir}/config.json is not in the current layout (no rope_parameters)")
    legacy = legacy_config(current, type_key)
    legacy_path = os.path.join(REPO, LEGACY_DIR, f"{name}.json")
    os.makedirs(os.path.dirname(legacy_path), exist_ok=True)
    with open(legacy_path, "w") as f:
        json.dump(legacy, f, indent=2)
        f.write("\n")

    tok = tokenizers.Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    model = load(model_dir, current)
    vocab = model.config.vocab_size
    columns = sorted(random.Random(7).sample(range(vocab), NUM_COLUMNS))
    results = run_prompts(model, tok, columns)
    lengths = sorted({len(p["ids"]) + k for p in results for k in range(NEW_TOKENS)})
    rope = rope_tables(model, lengths)

    legacy_model = load(model_dir, legacy)
    legacy_results = run_prompts(legacy_model, tok, columns)
    layout_diff = float((flat(results) - flat(legacy_results)).abs().max())
    if layout_diff > 0 or [p["greedy"] for p in results] != [p["greedy"] for p in legacy_results]:
        sys.exit(f"{name}: the legacy config gives different logits (max diff {layout_diff})")

    return {
        "format": 2,
        "model": name,
        "architecture": model.config.architectures[0],
        "vocab_size": vocab,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "tokenizers_version": tokenizers.__version__,
        "safetensors_fnv1a64": fnv1a64(os.path.join(model_dir, "model.safetensors")),
        "legacy_config": os.path.relpath(legacy_path, REPO),
        "legacy_config_max_abs_diff": layout_diff,
        "rope": rope,
        "new_tokens": NEW_TOKENS,
        "columns": columns,
        "prompts": results,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="*", help="model folders (default: every fixture)")
    ap.add_argument("--make-checkpoints", action="store_true",
                    help="(re)write the hf-* checkpoints with transformers' save_pretrained")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    type_keys = {c["name"]: c.get("legacy_type_key", "type") for c in CHECKPOINTS}
    if args.make_checkpoints:
        for i, spec in enumerate(CHECKPOINTS):
            make_checkpoint(spec, seed=1000 + i)
        return
    models = args.models or (
        [os.path.join(MODELS_DIR, c["name"]) for c in CHECKPOINTS] + OTHER_MODELS
    )
    os.makedirs(os.path.join(REPO, OUT_DIR), exist_ok=True)
    for m in models:
        d = m if os.path.isabs(m) else os.path.join(REPO, m)
        name = os.path.basename(os.path.normpath(d))
        ref = reference(d, type_keys.get(name, "type"))
        path = os.path.join(REPO, OUT_DIR, f"{ref['model']}.json")
        with open(path, "w") as f:
            json.dump(ref, f, separators=(",", ":"))
            f.write("\n")
        print(f"wrote {os.path.relpath(path, REPO)} ({os.path.getsize(path)} bytes)")


if __name__ == "__main__":
    main()
