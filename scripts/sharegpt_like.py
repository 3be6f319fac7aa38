#!/usr/bin/env python3
"""A ShareGPT-shaped file for `kvmesh bench --dataset sharegpt:PATH` on a machine that cannot
download ShareGPT: conversations whose prompt and reply lengths follow log-normal
distributions fitted to what is published of ShareGPT_V3 (prompts: median ~120, mean ~230
tokens; replies: median ~150, mean ~200 tokens; both long-tailed), with text cut from the
repository's Shakespeare. The lengths, not the words, are what a serving benchmark feels.
Counts are in words (~1.3 tokens each with a BPE tokenizer); `kvmesh bench` counts tokens
itself and prints the totals, so the JSON says what was actually sent.

    python3 scripts/sharegpt_like.py OUT.json [--n 400] [--seed 0]
"""
import argparse
import json
import math
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    words = (ROOT / "data/tinyshakespeare.txt").read_text().split()

    def text(n):
        start = rng.randrange(0, len(words) - n - 1)
        return " ".join(words[start:start + n])

    def lognormal(median, mean, cap):
        # mean / median = exp(sigma^2 / 2) for a log-normal.
        sigma = math.sqrt(2 * math.log(mean / median))
        return max(4, min(cap, int(rng.lognormvariate(math.log(median), sigma))))

    rows = []
    for i in range(a.n):
        prompt = lognormal(120 / 1.3, 230 / 1.3, 2000)
        reply = lognormal(150 / 1.3, 200 / 1.3, 1500)
        rows.append({"id": f"synthetic-{i}", "conversations": [
            {"from": "human", "value": text(prompt)},
            {"from": "gpt", "value": text(reply)},
        ]})
    Path(a.out).write_text(json.dumps(rows))
    print(f"wrote {a.out}: {a.n} conversations")


if __name__ == "__main__":
    main()
