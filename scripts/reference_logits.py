#!/usr/bin/env python3
"""Record reference outputs of Hugging Face transformers for kvmesh's forward-pass tests.

Why: kvmesh implements the Llama / Qwen2 / Qwen3 / Mistral forward pass itself (in Rust).
To prove that math correct we compare it against an independent implementation, the
`transformers` models, on the same checkpoints.  PyTorch is far too heavy for CI, so this
script is run once by hand and its outputs are committed as JSON fixtures; the Rust test
`tests/forward_reference.rs` then only reads the JSON.

What it does, for every model folder given (default: the four random tiny fixtures in
`tests/fixtures/models/` and the trained default model `models/shakespeare`):

1. Loads the folder with `AutoModelForCausalLM.from_pretrained(dir, dtype=torch.float32,
   attn_implementation="eager")` (`dtype` is transformers 5's name for `torch_dtype`); the
   bf16 weights are upcast to f32, as kvmesh's CPU backend does.
2. Builds two prompts as token-id lists, deterministically: `<s>` (the bos token, id 0)
   followed by the start of a fixed Shakespeare passage tokenized with the folder's own
   `tokenizer.json` (HF `tokenizers`), cut to 5 tokens (short) and 45 tokens (long, so it
   spans three 16-token KV blocks).
3. For each prompt records: the ids, the full logits at the last prompt position, the
   argmax at every prompt position (with the gap to the runner-up, so a test can tell a
   near-tie from a real disagreement), and the greedy continuation of 24 new tokens from
   `generate(do_sample=False, max_new_tokens=24)` with end-of-sequence disabled (the eos
   tokens are not suppressed, generation just does not stop on them, which is what
   kvmesh's `ignore_eos` does).  The continuation is cross-checked against a plain
   argmax loop over full forward passes, and its length is verified.
4. Writes `tests/fixtures/reference/<folder-name>.json` (floats rounded to 6 significant
   digits), including the transformers / torch versions used and a FNV-1a hash of the
   folder's `model.safetensors` (rerun this script whenever a model is regenerated).

Usage (CPU is enough; takes a few seconds):
    python3 -m venv /tmp/venv-ref
    /tmp/venv-ref/bin/pip install -r scripts/requirements-reference.txt
    /tmp/venv-ref/bin/python scripts/reference_logits.py
    cargo test --test forward_reference
"""

import argparse
import json
import os
import sys

import tokenizers
import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODELS = [
    "tests/fixtures/models/tiny-llama",
    "tests/fixtures/models/tiny-qwen2",
    "tests/fixtures/models/tiny-qwen3",
    "tests/fixtures/models/tiny-mistral",
    "models/shakespeare",
]
OUT_DIR = "tests/fixtures/reference"

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


def sig6(x: float) -> float:
    """Rounds to 6 significant digits (keeps the JSON small; f32 has ~7)."""
    return float(f"{x:.6g}")


def fnv1a64(path: str) -> str:
    """64-bit FNV-1a of a file, as hex: lets the Rust test tell a stale fixture (the model
    was retrained or re-initialised since) from a wrong forward pass."""
    h = 0xCBF29CE484222325
    with open(path, "rb") as f:
        data = f.read()
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def prompt_ids(tok: tokenizers.Tokenizer, length: int, text: str) -> list:
    ids = tok.encode(text, add_special_tokens=False).ids
    if len(ids) < length - 1:
        sys.exit(f"prompt text too short: {len(ids)} tokens, need {length - 1}")
    return [BOS_ID] + ids[: length - 1]


@torch.no_grad()
def greedy_loop(model, ids: list, n: int) -> list:
    """Argmax continuation by full recomputation: the plain definition of greedy decoding."""
    seq = list(ids)
    for _ in range(n):
        logits = model(torch.tensor([seq])).logits[0, -1]
        seq.append(int(torch.argmax(logits)))
    return seq[len(ids):]


@torch.no_grad()
def reference(model_dir: str) -> dict:
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    tok = tokenizers.Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    vocab = model.config.vocab_size
    out = {
        "model": os.path.basename(os.path.normpath(model_dir)),
        "architecture": model.config.architectures[0],
        "vocab_size": vocab,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "tokenizers_version": tokenizers.__version__,
        "safetensors_fnv1a64": fnv1a64(os.path.join(model_dir, "model.safetensors")),
        "new_tokens": NEW_TOKENS,
        "prompts": [],
    }
    for name, length, text in PROMPTS:
        ids = prompt_ids(tok, length, text)
        assert all(0 <= t < vocab for t in ids)
        logits = model(torch.tensor([ids])).logits[0]  # [len, vocab]
        last = logits[-1]
        argmax = [int(t) for t in torch.argmax(logits, dim=-1)]
        top2_all = torch.topk(logits, 2, dim=-1).values
        argmax_gap = [sig6(float(g)) for g in (top2_all[:, 0] - top2_all[:, 1])]

        # Greedy, never stopping: no eos to stop on, and min length = max length.
        gen_cfg = GenerationConfig(
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
        # The folder's generation_config.json names eos ids (and a max_length); generate()
        # fills unset fields from it, so replace it rather than merge with it.
        model.generation_config = gen_cfg
        gen = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        )
        cont = [int(t) for t in gen[0, len(ids):]]
        if len(cont) != NEW_TOKENS:
            sys.exit(f"{model_dir} {name}: generate gave {len(cont)} tokens, not {NEW_TOKENS}")
        loop = greedy_loop(model, ids, NEW_TOKENS)
        if loop != cont:
            sys.exit(f"{model_dir} {name}: generate {cont} != argmax loop {loop}")

        # Smallest gap between the best and second-best logit along the greedy path: a
        # tiny gap would make an exact-match test fragile, so it is recorded for review.
        seq = ids + cont
        path = model(torch.tensor([seq[:-1]])).logits[0, len(ids) - 1:]
        top2 = torch.topk(path, 2, dim=-1).values
        min_gap = float((top2[:, 0] - top2[:, 1]).min())

        out["prompts"].append(
            {
                "name": name,
                "ids": ids,
                "last_logits": [sig6(v) for v in last.tolist()],
                "argmax": argmax,
                "greedy": cont,
                "argmax_top2_gap": argmax_gap,
                "greedy_min_top2_gap": sig6(min_gap),
            }
        )
        print(
            f"{out['model']:>12} {name:>5}: {len(ids)} ids, argmax(last)={argmax[-1]}, "
            f"greedy={cont[:6]}..., min top-2 gap on greedy path {min_gap:.4f}"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="*", default=DEFAULT_MODELS, help="model folders")
    ap.add_argument("--out-dir", default=OUT_DIR)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    os.makedirs(os.path.join(REPO, args.out_dir), exist_ok=True)
    for m in args.models:
        d = m if os.path.isabs(m) else os.path.join(REPO, m)
        ref = reference(d)
        path = os.path.join(REPO, args.out_dir, f"{ref['model']}.json")
        with open(path, "w") as f:
            json.dump(ref, f, separators=(",", ":"))
            f.write("\n")
        print(f"wrote {os.path.relpath(path, REPO)} ({os.path.getsize(path)} bytes)")


if __name__ == "__main__":
    main()
