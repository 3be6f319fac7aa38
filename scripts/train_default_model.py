#!/usr/bin/env python3
"""Train the small default model that `kvmesh serve` embeds.

Why: kvmesh needs a real, self-contained Llama checkpoint it can ship in the
repository, so that `kvmesh serve` works out of the box, its tests run against
real weights, and nothing has to be fetched from a model hub at run time.

What this script does, deterministically (fixed seed, fixed step count):

1. Reads `data/tinyshakespeare.txt` (public domain), which is plays written as
   speeches "SPEAKER:\\nlines...\\n" separated by blank lines.  Each speech is
   turned into "SPEAKER:\\nlines\\n<|end|>" (the blank-line separator is
   replaced by the `<|end|>` special token), so the model learns to close a
   speech - and later a chat turn - with `<|end|>`.  The last ~5% of speeches
   are held out for validation.
2. Trains a byte-level BPE tokenizer (HF `tokenizers`) on the training text,
   with special tokens `<s>`, `</s>`, `<|end|>` and `<pad>`.
3. Trains a small Llama (exactly the architecture of HF `LlamaForCausalLM`:
   RMSNorm, rotate-half rotary embeddings, SwiGLU MLP, grouped-query
   attention, no biases, untied embeddings), written here in plain PyTorch
   with HF's tensor names, on CPU with AdamW and a warmup+cosine schedule.
4. Writes a Hugging Face style checkpoint: `config.json`, `model.safetensors`
   (bf16), `tokenizer.json`, `tokenizer_config.json` (with a chat template),
   `chat_template.jinja`, `generation_config.json` and a `README.md` card.
5. Verifies the saved file: an independent pure-numpy forward pass over
   the saved bf16 weights must match the PyTorch model's logits.

Usage:
    pip install -r scripts/requirements-train.txt
    python3 scripts/train_default_model.py --out models/shakespeare
    python3 scripts/train_default_model.py --out models/shakespeare --verify
        (only re-check an existing checkpoint: numpy vs torch forward, tokenizer,
         chat template, and a sample)

torch.compile needs a C++ compiler (gcc) on CPU; --no-compile trains without it.
"""

import argparse
import json
import math
import os
import random
import struct
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SEED = 1337
BOS, EOS, END, PAD = "<s>", "</s>", "<|end|>", "<pad>"
SPECIAL_TOKENS = [BOS, EOS, END, PAD]  # ids 0, 1, 2, 3
USER_NAME = "QUESTIONER"
ASSISTANT_NAME = "KVMESH"

# Renders a chat as speeches of the kind the model was trained on. Tools, when a request
# offers them, are listed first, and calls are written in <tool_call> blocks (the Hermes /
# Qwen format the server parses); without tools it renders exactly the trained format.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}{{ 'TOOLS:\\n' }}{% for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}"
    "{{ 'To call a tool, answer with <tool_call>\\n{\"name\": <name>, \"arguments\": <object>}\\n</tool_call>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{{ message['content'] + '\\n' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '" + ASSISTANT_NAME + ":\\n' + message['content'] }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{{ '<tool_call>\\n{\"name\": ' + (call['function']['name'] | tojson) + ', \"arguments\": ' + (call['function']['arguments'] | tojson) + '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '\\n<|end|>' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ 'TOOL:\\n' + message['content'] + '\\n<|end|>' }}"
    "{% else %}"
    "{{ '" + USER_NAME + ":\\n' + message['content'] + '\\n<|end|>' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '" + ASSISTANT_NAME + ":\\n' }}{% endif %}"
)


# ----------------------------------------------------------------------------
# data + tokenizer


def split_speeches(text):
    """Split the play text into speeches ("SPEAKER:\\nlines"), no trailing newline."""
    parts = text.replace("\r\n", "\n").strip("\n").split("\n\n")
    return [p.strip("\n") for p in parts if p.strip()]


def train_tokenizer(texts, vocab_size):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # encode(text, add_special_tokens=True) prepends <s>, as add_bos_token says.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def check_tokenizer(tok, sample_texts):
    for t in sample_texts:
        ids = tok.encode(t, add_special_tokens=False).ids
        back = tok.decode(ids, skip_special_tokens=False)
        assert back == t, f"round trip failed: {t[:80]!r} -> {back[:80]!r}"
    for s in SPECIAL_TOKENS:
        ids = tok.encode(s, add_special_tokens=False).ids
        assert ids == [tok.token_to_id(s)], f"special token {s} is not a single id: {ids}"
    mixed = "ROMEO:\nBut soft!\n<|end|>JULIET:\nAy me.\n<|end|>"
    ids = tok.encode(mixed, add_special_tokens=False).ids
    assert tok.decode(ids, skip_special_tokens=False) == mixed
    assert ids.count(tok.token_to_id(END)) == 2
    assert tok.encode("hi").ids[0] == tok.token_to_id(BOS)


def encode_speeches(tok, speeches):
    """Token stream of "SPEAKER:\\nlines\\n<|end|>" speeches, plus speech start offsets."""
    end_id = tok.token_to_id(END)
    stream, starts = [], []
    for enc in tok.encode_batch([s + "\n" for s in speeches], add_special_tokens=False):
        starts.append(len(stream))
        stream.extend(enc.ids)
        stream.append(end_id)
    return np.array(stream, dtype=np.int64), np.array(starts, dtype=np.int64)


# ----------------------------------------------------------------------------
# model: HF LlamaForCausalLM, in plain PyTorch, with HF's parameter names


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(head_dim, theta, positions):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h, d = cfg["hidden_size"], cfg["head_dim"]
        self.n_heads, self.n_kv, self.head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], d
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=False)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.n_heads // self.n_kv  # query head i uses kv head i // rep (HF repeat_kv)
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h, i = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, dropout=0.0):
        super().__init__()
        self.dropout = dropout  # residual dropout, training only (not part of the HF architecture)
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])

    def forward(self, x, cos, sin):
        x = x + F.dropout(self.self_attn(self.input_layernorm(x), cos, sin), self.dropout, self.training)
        return x + F.dropout(self.mlp(self.post_attention_layernorm(x)), self.dropout, self.training)


class LlamaModel(nn.Module):
    def __init__(self, cfg, dropout=0.0):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList([DecoderLayer(cfg, dropout) for _ in range(cfg["num_hidden_layers"])])
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg, dropout=0.0):
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg, dropout)
        self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)

    def init_weights(self, gen):
        std = self.cfg["initializer_range"]
        resid_std = std / math.sqrt(2 * self.cfg["num_hidden_layers"])
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                nn.init.ones_(p)
            elif name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
                nn.init.normal_(p, 0.0, resid_std, generator=gen)
            else:
                nn.init.normal_(p, 0.0, std, generator=gen)

    def forward(self, ids):
        t = ids.shape[1]
        cos, sin = rope_cos_sin(self.cfg["head_dim"], self.cfg["rope_parameters"]["rope_theta"], torch.arange(t))
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))


# ----------------------------------------------------------------------------
# independent numpy forward over the saved safetensors file (for --verify)


def read_safetensors_numpy(path):
    """Parse a safetensors file by hand; bf16 tensors are widened to float32."""
    with open(path, "rb") as f:
        blob = f.read()
    (hlen,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + hlen])
    base = 8 + hlen
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        raw = blob[base + a : base + b]
        if meta["dtype"] == "BF16":
            arr = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        elif meta["dtype"] == "F32":
            arr = np.frombuffer(raw, dtype="<f4").copy()
        else:
            raise ValueError(f"unexpected dtype {meta['dtype']} for {name}")
        out[name] = arr.reshape(meta["shape"])
    return out


def numpy_forward(w, cfg, ids):
    h, nh, nkv, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, t = cfg["rms_norm_eps"], len(ids)

    def rms(x, weight):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight

    half = hd // 2
    inv_freq = 1.0 / (cfg["rope_parameters"]["rope_theta"] ** (np.arange(half, dtype=np.float64) * 2 / hd))
    ang = np.arange(t, dtype=np.float64)[:, None] * inv_freq[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, -1).astype(np.float32)
    sin = np.concatenate([np.sin(ang)] * 2, -1).astype(np.float32)

    def rope(x):  # x: [heads, t, hd]
        rot = np.concatenate([-x[..., half:], x[..., :half]], -1)
        return x * cos + rot * sin

    mask = np.triu(np.full((t, t), -np.inf, dtype=np.float32), 1)
    x = w["model.embed_tokens.weight"][np.asarray(ids)]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = rms(x, w[p + "input_layernorm.weight"])
        q = rope((a @ w[p + "self_attn.q_proj.weight"].T).reshape(t, nh, hd).transpose(1, 0, 2))
        k = rope((a @ w[p + "self_attn.k_proj.weight"].T).reshape(t, nkv, hd).transpose(1, 0, 2))
        v = (a @ w[p + "self_attn.v_proj.weight"].T).reshape(t, nkv, hd).transpose(1, 0, 2)
        heads = []
        for j in range(nh):
            kv = j // (nh // nkv)
            s = q[j] @ k[kv].T / np.sqrt(hd) + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            heads.append((s / s.sum(-1, keepdims=True)) @ v[kv])
        x = x + np.concatenate(heads, -1) @ w[p + "self_attn.o_proj.weight"].T
        m = rms(x, w[p + "post_attention_layernorm.weight"])
        g = m @ w[p + "mlp.gate_proj.weight"].T
        u = m @ w[p + "mlp.up_proj.weight"].T
        x = x + ((g / (1.0 + np.exp(-g))) * u) @ w[p + "mlp.down_proj.weight"].T
    return rms(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


# ----------------------------------------------------------------------------
# training helpers


def make_config(args, vocab_size, bos_id, end_id, pad_id):
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.hidden // args.heads,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": end_id,
        "pad_token_id": pad_id,
        "dtype": "bfloat16",
    }


def get_batch(stream, starts, batch_size, seq_len, bos_id, rng):
    """Half the rows start at a speech, after <s> (as chat prompts will); half at a random offset."""
    rows = []
    for r in range(batch_size):
        if r % 2 == 0:
            s = int(starts[rng.integers(len(starts))])
            s = min(s, len(stream) - seq_len)
            row = np.concatenate([[bos_id], stream[s : s + seq_len]])
        else:
            s = int(rng.integers(len(stream) - seq_len - 1))
            row = stream[s : s + seq_len + 1]
        rows.append(row)
    b = torch.from_numpy(np.stack(rows).astype(np.int64))
    return b[:, :-1], b[:, 1:]


@torch.no_grad()
def evaluate(model, stream, seq_len, max_batches, batch_size, bos_id):
    """Mean next-token loss over contiguous non-overlapping val windows, each after <s>."""
    model.eval()
    n = (len(stream) - 1) // seq_len
    windows = [np.concatenate([[bos_id], stream[i * seq_len : (i + 1) * seq_len]]) for i in range(n)]
    windows = windows[: max_batches * batch_size]
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        b = torch.from_numpy(np.stack(windows[i : i + batch_size]).astype(np.int64))
        logits = model(b[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1), reduction="sum")
        total += loss.item()
        count += b[:, 1:].numel()
    model.train()
    return total / count


@torch.no_grad()
def sample(model, tok, prompt, max_new_tokens, temperature, seed, stop_ids=()):
    gen = torch.Generator().manual_seed(seed)
    ids = tok.encode(prompt, add_special_tokens=True).ids
    model.eval()
    for _ in range(max_new_tokens):
        ctx = torch.tensor([ids[-512:]])
        logits = model(ctx)[0, -1].float() / temperature
        nxt = int(torch.multinomial(F.softmax(logits, -1), 1, generator=gen))
        ids.append(nxt)
        if nxt in stop_ids:
            break
    return tok.decode(ids, skip_special_tokens=False)


def lr_at(step, total, peak, warmup, min_ratio=0.1):
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def to_bf16_state(model):
    return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}


def load_model(out_dir):
    with open(os.path.join(out_dir, "config.json")) as f:
        cfg = json.load(f)
    model = LlamaForCausalLM(cfg)
    state = {k: v.float() for k, v in load_file(os.path.join(out_dir, "model.safetensors")).items()}
    model.load_state_dict(state, strict=True)
    model.eval()
    return model, cfg


def verify(out_dir):
    """numpy forward of the saved file vs the torch model loaded from the same file."""
    model, cfg = load_model(out_dir)
    tok = Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json"))
    prompt = "ROMEO:\nBut soft, what light through yonder window breaks?\n<|end|>JULIET:\n"
    ids = tok.encode(prompt, add_special_tokens=True).ids
    with torch.no_grad():
        t_logits = model(torch.tensor([ids]))[0].numpy()
    n_logits = numpy_forward(read_safetensors_numpy(os.path.join(out_dir, "model.safetensors")), cfg, ids)
    diff = float(np.abs(t_logits - n_logits).max())
    print(f"verify: {len(ids)} prompt tokens, max |torch - numpy| logit diff = {diff:.3e}, "
          f"logit range [{t_logits.min():.2f}, {t_logits.max():.2f}], "
          f"argmax agree {(t_logits.argmax(-1) == n_logits.argmax(-1)).mean():.3f}")
    assert diff < 1e-3, "numpy forward does not match torch forward"
    check_tokenizer(tok, [prompt, "Hello,\n\n  world!\t\u00e9 \u2014 ok\n"])
    try:
        import jinja2
    except ImportError:
        print("verify: jinja2 not installed; chat template not rendered")
    else:
        with open(os.path.join(out_dir, "tokenizer_config.json")) as f:
            tcfg = json.load(f)
        chat = [{"role": "system", "content": "A scene in Verona."},
                {"role": "user", "content": "Who art thou?"},
                {"role": "assistant", "content": "A humble servant of the stage."},
                {"role": "user", "content": "Then speak."}]
        rendered = jinja2.Environment().from_string(tcfg["chat_template"]).render(
            messages=chat, add_generation_prompt=True, bos_token=tcfg["bos_token"], eos_token=tcfg["eos_token"])
        print(f"verify: chat template renders to {rendered!r}")
        assert rendered.startswith(BOS) and rendered.endswith(ASSISTANT_NAME + ":\n")
        ids = tok.encode(rendered, add_special_tokens=False).ids
        assert ids[0] == tok.token_to_id(BOS) and ids.count(tok.token_to_id(END)) == 3
        assert tok.decode(ids, skip_special_tokens=False) == rendered
    return model, tok, diff


# ----------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="data/tinyshakespeare.txt")
    ap.add_argument("--out", default="models/shakespeare")
    ap.add_argument("--verify", action="store_true", help="only verify an existing checkpoint in --out")
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=688)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=12)
    ap.add_argument("--steps", type=int, default=900)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--dropout", type=float, default=0.1, help="residual dropout while training")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-batches", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast for matmuls (CPU AMX)")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile (about 2x slower on CPU)")
    ap.add_argument("--bench", type=int, default=0, help="time N training steps and exit")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)

    if args.verify:
        model, tok, _ = verify(args.out)
        print(sample(model, tok, "ROMEO:\n", 300, 0.8, SEED))
        return

    t_start = time.time()
    with open(args.data, encoding="utf-8") as f:
        text = f.read()
    speeches = split_speeches(text)
    n_val = max(1, round(len(speeches) * 0.05))
    train_sp, val_sp = speeches[:-n_val], speeches[-n_val:]

    tok = train_tokenizer([s + "\n" for s in train_sp], args.vocab_size)
    check_tokenizer(tok, [text[:5000], text[-5000:], "Hello,\n\n  world!\t\u00e9\u00e8 \u2014 ok\n"])
    bos_id, eos_id, end_id, pad_id = (tok.token_to_id(s) for s in SPECIAL_TOKENS)
    train_stream, train_starts = encode_speeches(tok, train_sp)
    val_stream, _ = encode_speeches(tok, val_sp)
    print(f"speeches: {len(train_sp)} train / {len(val_sp)} val; tokens: {len(train_stream)} train / "
          f"{len(val_stream)} val; vocab {tok.get_vocab_size()}; "
          f"{len(text) / (len(train_stream) + len(val_stream)):.2f} chars/token", flush=True)

    cfg = make_config(args, tok.get_vocab_size(), bos_id, end_id, pad_id)
    model = LlamaForCausalLM(cfg, dropout=args.dropout)
    model.init_weights(torch.Generator().manual_seed(SEED))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} params; config "
          + json.dumps({k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                            "num_attention_heads", "num_key_value_heads", "head_dim")}),
          flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=True,
    )
    # torch.compile fuses the elementwise ops (rope, RMSNorm, SwiGLU), which dominate on CPU.
    # Evaluation uses the uncompiled module (same weights) to avoid recompiling for new shapes.
    train_fwd = model if args.no_compile else torch.compile(model)
    rng = np.random.default_rng(SEED)
    steps = args.bench or args.steps
    model.train()
    t_train = time.time()
    train_losses = []
    val_loss = float("nan")
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, args.lr, args.warmup)
        x, y = get_batch(train_stream, train_starts, args.batch_size, args.seq_len, bos_id, rng)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            logits = train_fwd(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        train_losses.append(loss.item())
        if args.bench:
            if step in (1, steps - 1):
                el = time.time() - t_train
                print(f"bench step {step}: {el:.1f}s, {el / (step + 1):.3f}s/step, "
                      f"{(step + 1) * args.batch_size * args.seq_len / el:.0f} tok/s", flush=True)
            continue
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step:5d}  loss {np.mean(train_losses[-50:]):.4f}  lr {opt.param_groups[0]['lr']:.2e}  "
                  f"{time.time() - t_train:.0f}s", flush=True)
        if (step + 1) % args.eval_every == 0 or step == steps - 1:
            val_loss = evaluate(model, val_stream, args.seq_len, args.eval_batches, args.batch_size, bos_id)
            print(f"step {step + 1:5d}  val loss {val_loss:.4f}", flush=True)
    if args.bench:
        return
    train_time = time.time() - t_train
    # Final train loss: the same evaluation as val, on a train slice of the same size.
    train_eval = evaluate(model, train_stream[-len(val_stream):], args.seq_len, args.eval_batches,
                          args.batch_size, bos_id)
    val_full = evaluate(model, val_stream, args.seq_len, 10**9, args.batch_size, bos_id)
    print(f"training took {train_time:.0f}s; final train loss {train_eval:.4f}, val loss {val_full:.4f}")

    out = args.out
    os.makedirs(out, exist_ok=True)
    save_file(to_bf16_state(model), os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    tok.save(os.path.join(out, "tokenizer.json"))
    added = {str(tok.token_to_id(s)): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": True} for s in SPECIAL_TOKENS}
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": END,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": 512,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(tok_cfg, f, indent=2)
        f.write("\n")
    with open(os.path.join(out, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    gen_cfg = {"bos_token_id": bos_id, "eos_token_id": [eos_id, end_id], "pad_token_id": pad_id,
               "max_length": 512, "do_sample": True, "temperature": 0.8, "top_p": 0.95}
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump(gen_cfg, f, indent=2)
        f.write("\n")

    # Check the saved file (numpy vs torch), and that bf16 rounding cost little.
    saved_model, tok2, diff = verify(out)
    val_bf16 = evaluate(saved_model, val_stream, args.seq_len, 10**9, args.batch_size, bos_id)
    print(f"val loss with saved bf16 weights: {val_bf16:.4f}")
    text_sample = sample(saved_model, tok2, "ROMEO:\n", 300, 0.8, SEED)
    print("---- sample (temperature 0.8, prompt 'ROMEO:\\n') ----")
    print(text_sample)
    print("----")

    size = os.path.getsize(os.path.join(out, "model.safetensors"))
    card = f"""# kvmesh default model: shakespeare

A tiny Llama model trained from scratch on Tiny Shakespeare, embedded as the
default model of `kvmesh serve`. It writes Shakespeare-like speeches; it is a
test and demo model, not an assistant.

## Architecture (HF `LlamaForCausalLM`)

| field | value |
| --- | --- |
| parameters | {n_params:,} ({size / 1e6:.1f} MB in bf16 safetensors) |
| hidden_size / intermediate_size | {cfg['hidden_size']} / {cfg['intermediate_size']} (SwiGLU) |
| layers | {cfg['num_hidden_layers']} |
| attention heads / kv heads / head_dim | {cfg['num_attention_heads']} / {cfg['num_key_value_heads']} / {cfg['head_dim']} (GQA) |
| rope_theta / rms_norm_eps | {cfg['rope_parameters']['rope_theta']} / {cfg['rms_norm_eps']} |
| vocab | {cfg['vocab_size']} (byte-level BPE), untied embeddings |
| max_position_embeddings | {cfg['max_position_embeddings']} |

Special tokens: `<s>`={bos_id} (bos), `</s>`={eos_id}, `<|end|>`={end_id} (end of a
speech / turn; the tokenizer's eos), `<pad>`={pad_id}. Generation stops on `</s>` or `<|end|>`.
`tokenizer.json` prepends `<s>` when special tokens are added; the chat template
already starts with `<s>`, so encode a rendered chat without adding special tokens.

## Data

`data/tinyshakespeare.txt` (public domain). Each speech `SPEAKER:\\nlines\\n`
is followed by `<|end|>` instead of the blank line. Last 5% of speeches held
out for validation ({len(train_stream):,} train / {len(val_stream):,} val tokens).

The chat template renders a system message as a plain line, user turns as
`{USER_NAME}:\\n...\\n<|end|>` and assistant turns as `{ASSISTANT_NAME}:\\n...\\n<|end|>`.

## Training

AdamW (betas 0.9/0.95, weight decay {args.weight_decay}), residual dropout {args.dropout}
while training (none at inference), peak lr {args.lr}, {args.warmup} warmup
steps then cosine to 10%, {args.steps} steps of {args.batch_size} x {args.seq_len} tokens,
seed {SEED}, CPU ({args.threads} threads{', bf16 autocast' if args.bf16 else ', fp32'}):
{train_time / 60:.1f} minutes.

Final loss (nats/token): train {train_eval:.3f}, validation {val_full:.3f}
(validation with the saved bf16 weights: {val_bf16:.3f}). Both are measured with dropout
off; validation is the end of the last play, so names and plot are unseen there.

## Retrain

    pip install -r scripts/requirements-train.txt
    python3 scripts/train_default_model.py --out models/shakespeare
    python3 scripts/train_default_model.py --out models/shakespeare --verify
"""
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(card)
    print(f"wrote {out} in {time.time() - t_start:.0f}s total")


if __name__ == "__main__":
    sys.exit(main())
