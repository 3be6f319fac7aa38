#!/usr/bin/env python3
"""Totals an Nsight Compute CSV (gpu__time_duration.sum per kernel) step by step.

A forward pass starts with `embed_gather`, so the launches are split there; the steps of a
`scripts/gpu_profile.sh` run are: prefill warm-up, prefill, the decode history fill, the
decode step. The measured prefill (second) and the decode step (last) are printed by
kernel, largest first, with the step's total.
"""

import csv
import io
import sys
from collections import OrderedDict


def kernels(path):
    text = open(path, encoding="utf-8", errors="replace").read()
    start = text.find('"ID"')
    if start < 0:
        sys.exit(f"{path}: no ncu CSV header found")
    out = []
    for row in csv.DictReader(io.StringIO(text[start:])):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = row["Kernel Name"].split("(")[0].strip()
        out.append((name, float(row["Metric Value"].replace(",", "")), row.get("Grid Size", "")))
    return out


def steps(ks):
    cur, all_steps = [], []
    for k in ks:
        if k[0] == "embed_gather" and cur:
            all_steps.append(cur)
            cur = []
        cur.append(k)
    if cur:
        all_steps.append(cur)
    return all_steps


def show(title, step):
    by = OrderedDict()
    for name, ns, _ in step:
        n, t = by.get(name, (0, 0.0))
        by[name] = (n + 1, t + ns)
    total = sum(t for _, t in by.values())
    print(f"\n{title}: {len(step)} launches, {total / 1e6:.3f} ms of kernel time")
    print(f"  {'kernel':<64} {'n':>5} {'ms':>9} {'share':>6}")
    for name, (n, t) in sorted(by.items(), key=lambda kv: -kv[1][1]):
        print(f"  {name[:64]:<64} {n:>5} {t / 1e6:>9.3f} {100 * t / total:>5.1f}%")


def main():
    ks = kernels(sys.argv[1])
    st = steps(ks)
    print(f"{len(ks)} kernels in {len(st)} steps")
    if len(st) >= 2:
        show("prefill (measured run)", st[1])
    if st:
        show("decode step (last)", st[-1])


if __name__ == "__main__":
    main()
