#!/usr/bin/env python3
"""How the Rust sources are shaped: long files, long functions, and import cycles between
modules of a crate. Prints what exceeds the limits and exits 1 when anything does.

    python3 scripts/code_shape.py            # the limits: 1000 lines a file, 120 a function
    python3 scripts/code_shape.py --top 15   # also the longest files and functions

What counts:
- Non-test sources: every `.rs` file under a crate's `src/` (tests/ folders are whole-system
  tests), except files that are test modules themselves (declared under `#[cfg(test)]`), and
  every CUDA source (`.cu`, `.cuh`) there, for the file limit.
- A function's length: from its `fn` line to its closing brace; functions inside
  `#[cfg(test)]` modules and `#[test]` functions are not counted.
- Module imports: a module uses another when its code (outside test modules, and not a
  `pub use` re-export or a `mod` declaration) names a path into it: `crate::a::b`,
  `super::x`, `self::x`, or a child module by its bare name. A cycle is a set of modules of
  one crate that reach each other this way. Modules are files; an edge from a file to its
  parent or child counts too. A crate's library (or main binary) is one graph, and each
  binary that is a folder (`src/bin/<name>/main.rs` and its modules) one of its own.
"""

import argparse
import os
import re
import sys
from collections import defaultdict

FILE_LIMIT = 1000
FN_LIMIT = 120


def strip(src):
    """The source with comments, string and char literals blanked (newlines kept), so that
    braces and paths can be found by regular expressions."""
    out = []
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif src.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if src.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif src.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", src[i:j]))
            i = j
        elif re.match(r'b?r#*"', src[i:i + 20]) and (i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_")):
            m = re.match(r'(b?r)(#*)"', src[i:])
            hashes = m.group(2)
            end = src.find('"' + hashes, i + len(m.group(0)))
            end = n if end < 0 else end + 1 + len(hashes)
            out.append('""' + re.sub(r"[^\n]", " ", src[i + 2:end]))
            i = end
        elif c == '"' or (c == "b" and src.startswith('b"', i) and (i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_"))):
            j = i + (2 if c == "b" else 1)
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            j += 1
            out.append('""' + re.sub(r"[^\n]", " ", src[i + 2:j]))
            i = j
        elif c == "'":
            m = re.match(r"'(\\(x[0-9a-fA-F]{2}|u\{[0-9a-fA-F]+\}|.)|[^\\'\n])'", src[i:])
            if m:
                out.append(" " * len(m.group(0)))
                i += len(m.group(0))
            else:  # a lifetime
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def match_brace(s, open_at):
    depth = 0
    for j in range(open_at, len(s)):
        if s[j] == "{":
            depth += 1
        elif s[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return len(s) - 1


def line_of(s, pos):
    return s.count("\n", 0, pos) + 1


def test_ranges(s):
    """Character ranges of `#[cfg(test)] mod x { .. }` blocks and `#[test]` functions."""
    ranges = []
    for m in re.finditer(r"#\[cfg\(test\)\]\s*(pub(\([^)]*\))?\s+)?mod\s+\w+\s*\{", s):
        start = m.end() - 1
        ranges.append((m.start(), match_brace(s, start)))
    for m in re.finditer(r"#\[(tokio::)?test[^\]]*\]", s):
        b = s.find("{", m.end())
        if b >= 0:
            ranges.append((m.start(), match_brace(s, b)))
    return ranges


def inside(ranges, pos):
    return any(a <= pos <= b for a, b in ranges)


def functions(s, ranges):
    """(name, first line, lines) of every non-test function with a body."""
    out = []
    for m in re.finditer(r"\bfn\s+(\w+)", s):
        if inside(ranges, m.start()):
            continue
        # The body opens at the first `{` not inside the signature's parentheses/generics;
        # a `;` first means a declaration without a body (trait method).
        depth, j = 0, m.end()
        while j < len(s):
            ch = s[j]
            if ch in "(<[":
                depth += 1
            elif ch in ")>]":
                # `->` is not a closing angle bracket
                if not (ch == ">" and s[j - 1] == "-"):
                    depth -= 1
            elif ch == ";" and depth <= 0:
                j = -1
                break
            elif ch == "{" and depth <= 0:
                break
            j += 1
        if j < 0 or j >= len(s):
            continue
        end = match_brace(s, j)
        first, last = line_of(s, m.start()), line_of(s, end)
        out.append((m.group(1), first, last - first + 1))
    return out


def crates(root):
    """(crate dir, src dir) of every workspace member with a src/ folder."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("target", ".git", "node_modules")]
        if "Cargo.toml" in filenames and os.path.isdir(os.path.join(dirpath, "src")):
            out.append((dirpath, os.path.join(dirpath, "src")))
    return out


def module_path(src_dir, path):
    rel = os.path.relpath(path, src_dir)[:-3].split(os.sep)
    if rel[-1] == "mod":
        rel = rel[:-1]
    if rel in (["lib"], ["main"]):
        return ()
    if rel[0] == "bin":
        return None  # each binary is a crate of its own: see bin_crates
    return tuple(rel)


def bin_crates(src_dir):
    """The binaries of a crate that are folders (`src/bin/<name>/main.rs` and its modules):
    each a crate of its own, whose modules import each other like a library's. A binary of one
    file has no modules to cycle through."""
    bin_dir = os.path.join(src_dir, "bin")
    if not os.path.isdir(bin_dir):
        return []
    return sorted(
        os.path.join(bin_dir, d)
        for d in os.listdir(bin_dir)
        if os.path.isfile(os.path.join(bin_dir, d, "main.rs"))
    )


def test_only_files(src_dir, files):
    """Files declared as `#[cfg(test)] mod x;` by their parent."""
    out = set()
    for f in files:
        s = strip(open(f, encoding="utf-8").read())
        for m in re.finditer(r"#\[cfg\(test\)\]\s*(pub(\([^)]*\))?\s+)?mod\s+(\w+)\s*;", s):
            name = m.group(3)
            base = os.path.dirname(f) if os.path.basename(f) in ("mod.rs", "lib.rs", "main.rs") else f[:-3]
            for cand in (os.path.join(base, name + ".rs"), os.path.join(base, name, "mod.rs")):
                if os.path.exists(cand):
                    out.add(os.path.normpath(cand))
    return out


def reexports(mods, path, s):
    """Names a module re-exports (`pub use a::b::{C, D}`), each with the module it comes
    from, so that a use of `crate::C` counts against the module that defines C."""
    out = {}
    for m in re.finditer(r"\bpub(?:\([^)]*\))?\s+use\s+([^;]*);", s):
        body = re.sub(r"\s+", "", m.group(1))
        g = re.match(r"(.*?)::\{(.*)\}$", body)
        items = [(g.group(1), b) for b in g.group(2).split(",") if b] if g else [(body.rsplit("::", 1)[0] if "::" in body else "", body.rsplit("::", 1)[-1])]
        for prefix, item in items:
            full = [p for p in (prefix + "::" + item).split("::") if p]
            name = full[-1].split("as")[-1] if "as" in full[-1] else full[-1]
            head = full[0] if full else ""
            if head == "crate":
                base, rest = [], full[1:]
            elif head in ("self", "super"):
                base = list(path) if head == "self" else list(path)[:-1]
                rest = full[1:]
            else:
                base, rest = list(path), full
            target = None
            for k in range(len(rest) + 1):
                if tuple(base + rest[:k]) in mods:
                    target = tuple(base + rest[:k])
            if target is not None and target != path:
                out[name] = target
    return out


def edges(mods, path, s, ranges, exported):
    """Modules of the crate that the module `path` uses."""
    code = list(s)
    for a, b in ranges:
        for k in range(a, b + 1):
            if code[k] != "\n":
                code[k] = " "
    code = "".join(code)
    # Re-exports and module declarations are not uses.
    code = re.sub(r"\bpub(\([^)]*\))?\s+use\b[^;]*;", lambda m: re.sub(r"[^\n]", " ", m.group(0)), code)
    code = re.sub(r"\bmod\s+\w+\s*;", " ", code)
    targets = set()

    def resolve(parts):
        best, k_best = None, 0
        for k in range(len(parts) + 1):
            if tuple(parts[:k]) in mods:
                best, k_best = tuple(parts[:k]), k
        # An item the module only re-exports belongs to the module it comes from.
        if best is not None and k_best < len(parts):
            best = exported.get(best, {}).get(parts[k_best], best)
        return best

    # Expand `use a::{b, c::d}` groups one level so that each branch resolves.
    for m in re.finditer(r"\b(crate|super|self)((?:::(?:\w+|super))*)(::\{([^}]*)\})?", code):
        if not m.group(2) and not m.group(4):
            continue
        head = m.group(1)
        rest = [p for p in m.group(2).split("::") if p]
        if head == "crate":
            base = []
        else:
            base = list(path)
            if head == "super":
                base = base[:-1]
        while rest and rest[0] == "super":
            base = base[:-1]
            rest = rest[1:]
        branches = [[]]
        if m.group(4):
            branches = [[p for p in b.strip().split("::") if p] for b in m.group(4).split(",") if b.strip()]
        for br in branches:
            t = resolve(base + rest + [p for p in br if p not in ("self", "*")])
            if t is not None and t != path:
                targets.add(t)
    # A child module named bare: `child::Item`.
    for child in [p for p in mods if len(p) == len(path) + 1 and p[:-1] == path]:
        if re.search(r"(?<![:\w])" + re.escape(child[-1]) + r"::", code):
            targets.add(child)
    return targets


def cycles(graph):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    ap.add_argument("--top", type=int, default=0, help="also list the N longest files and functions")
    args = ap.parse_args()
    root = os.path.normpath(args.root)
    long_files, long_fns, all_files, all_fns, found_cycles = [], [], [], [], []
    for crate_dir, src_dir in sorted(crates(root)):
        files = []
        kernels = []
        for dirpath, _, filenames in os.walk(src_dir):
            files += [os.path.normpath(os.path.join(dirpath, f)) for f in filenames if f.endswith(".rs")]
            kernels += [os.path.normpath(os.path.join(dirpath, f)) for f in filenames if f.endswith((".cu", ".cuh"))]
        # CUDA sources count for the file limit (their functions are not parsed).
        for f in sorted(kernels):
            raw = open(f, encoding="utf-8").read()
            n = raw.count("\n") + (0 if raw.endswith("\n") else 1)
            rel = os.path.relpath(f, root)
            all_files.append((n, rel))
            if n > FILE_LIMIT:
                long_files.append((n, rel))
        tests = test_only_files(src_dir, files)
        sources_by_file = {}
        for f in sorted(files):
            if f in tests:
                continue
            raw = open(f, encoding="utf-8").read()
            s = strip(raw)
            rel = os.path.relpath(f, root)
            n = raw.count("\n") + (0 if raw.endswith("\n") else 1)
            all_files.append((n, rel))
            if n > FILE_LIMIT:
                long_files.append((n, rel))
            ranges = test_ranges(s)
            for name, first, length in functions(s, ranges):
                all_fns.append((length, f"{rel}:{first}", name))
                if length > FN_LIMIT:
                    long_fns.append((length, f"{rel}:{first}", name))
            sources_by_file[f] = (rel, s, ranges)
        # The library (or main binary), then each binary that is a folder, as crates.
        for graph_dir in [src_dir] + bin_crates(src_dir):
            mods, sources = {}, {}
            for f, (rel, s, ranges) in sources_by_file.items():
                if os.path.commonpath([graph_dir, f]) != os.path.normpath(graph_dir):
                    continue
                mp = module_path(graph_dir, f)
                if mp is not None:
                    mods[mp] = rel
                    sources[mp] = (s, ranges)
            exported = {mp: reexports(mods, mp, s) for mp, (s, _) in sources.items()}
            graph = {mp: edges(mods, mp, s, r, exported) for mp, (s, r) in sources.items()}
            crate = os.path.relpath(crate_dir if graph_dir == src_dir else graph_dir, root)
            for comp in cycles(graph):
                names = ["::".join(c) or "(root)" for c in comp]
                links = [
                    f"{'::'.join(a) or '(root)'} -> {'::'.join(b) or '(root)'}"
                    for a in comp
                    for b in sorted(graph[a])
                    if b in comp
                ]
                found_cycles.append((crate, names, links))

    print(f"files over {FILE_LIMIT} lines: {len(long_files)}")
    for n, f in sorted(long_files, reverse=True):
        print(f"  {n:5} {f}")
    print(f"functions over {FN_LIMIT} lines: {len(long_fns)}")
    for n, where, name in sorted(long_fns, reverse=True):
        print(f"  {n:5} {where} {name}")
    print(f"module import cycles: {len(found_cycles)}")
    for crate, names, links in found_cycles:
        print(f"  {crate}: {', '.join(names)}")
        for l in links:
            print(f"      {l}")
    if args.top:
        print(f"longest files ({len(all_files)} non-test source files):")
        for n, f in sorted(all_files, reverse=True)[: args.top]:
            print(f"  {n:5} {f}")
        print(f"longest functions ({len(all_fns)} non-test functions):")
        for n, where, name in sorted(all_fns, reverse=True)[: args.top]:
            print(f"  {n:5} {where} {name}")
    return 1 if long_files or long_fns or found_cycles else 0


if __name__ == "__main__":
    sys.exit(main())
