//! Reading what the tools produce: PTX entries, ptxas's report, an ELF symbol table.

use std::collections::{BTreeMap, BTreeSet};

use kvmesh_gpu::backend::cuda::shapes::KernelUsage;

/// One `.entry` of a PTX module.
#[derive(Debug)]
pub struct Entry {
    pub params: usize,
    /// `.maxntid` (from `__launch_bounds__`), as a thread count.
    pub max_threads: Option<u32>,
    /// Whether the body uses a module's `.extern .shared` array (dynamic shared memory).
    pub dynamic_smem: bool,
}

pub fn ptx_entries(ptx: &str) -> BTreeMap<String, Entry> {
    let externs: Vec<&str> = ptx
        .lines()
        .filter(|l| l.trim_start().starts_with(".extern .shared"))
        .filter_map(|l| l.split_whitespace().last())
        .map(|n| n.trim_end_matches(';').trim_end_matches("[]"))
        .collect();
    let mut out = BTreeMap::new();
    let mut rest = ptx;
    while let Some(at) = rest.find(".entry ") {
        rest = &rest[at + ".entry ".len()..];
        let open = rest.find('(').expect("an entry's parameter list");
        let name = rest[..open].trim().to_string();
        let close = rest.find(')').expect("an entry's parameter list end");
        let params = rest[open..close].matches(".param").count();
        let body_at = rest.find('{').expect("an entry's body");
        let max_threads = rest[close..body_at]
            .lines()
            .find_map(|l| l.trim().strip_prefix(".maxntid"))
            .map(|dims| {
                dims.split(',')
                    .map(|d| d.trim().parse::<u32>().expect(".maxntid figure"))
                    .product()
            });
        let body_end = rest.find(".entry ").unwrap_or(rest.len());
        let body = &rest[body_at..body_end.max(body_at)];
        let dynamic_smem = externs.iter().any(|e| body.contains(e));
        out.insert(
            name,
            Entry {
                params,
                max_threads,
                dynamic_smem,
            },
        );
    }
    out
}

/// The figure in front of `suffix` in a comma-separated ptxas line
/// (`... 6280 bytes smem, ...`).
fn figure(line: &str, suffix: &str) -> Option<u32> {
    line.split([',', ':']).map(str::trim).find_map(|part| {
        part.strip_suffix(suffix)?
            .trim()
            .rsplit(' ')
            .next()?
            .parse()
            .ok()
    })
}

/// Per kernel, what `ptxas -v` reported.
pub fn parse_ptxas(report: &str) -> Result<BTreeMap<String, KernelUsage>, String> {
    let mut out: BTreeMap<String, KernelUsage> = BTreeMap::new();
    let mut entry: Option<String> = None;
    let mut props_for: Option<String> = None;
    for line in report.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default().to_string();
            out.entry(name.clone()).or_default();
            entry = Some(name);
        } else if let Some(rest) = line.split("Function properties for ").nth(1) {
            props_for = Some(rest.trim().to_string());
        } else if line.contains("bytes stack frame") {
            // Properties of a function that is not the entry (a non-inlined device
            // function) are not the kernel's.
            if let (Some(f), Some(e)) = (&props_for, &entry) {
                if f == e {
                    let u = out.get_mut(e).expect("entry recorded");
                    u.stack_frame = figure(line, "bytes stack frame").unwrap_or(0);
                    u.spill_stores = figure(line, "bytes spill stores").unwrap_or(0);
                    u.spill_loads = figure(line, "bytes spill loads").unwrap_or(0);
                }
            }
        } else if line.contains("Used ") && line.contains(" registers") {
            let e = entry
                .as_ref()
                .ok_or_else(|| format!("a register count before any entry: {line}"))?;
            let u = out.get_mut(e).expect("entry recorded");
            u.registers = line
                .split("Used ")
                .nth(1)
                .and_then(|r| r.split_whitespace().next())
                .and_then(|n| n.parse().ok())
                .ok_or_else(|| format!("unreadable register count: {line}"))?;
            u.smem = figure(line, "bytes smem").unwrap_or(0);
        }
    }
    if out.is_empty() {
        return Err(format!("no kernels in ptxas's report:\n{report}"));
    }
    Ok(out)
}

fn u16_at(b: &[u8], at: usize) -> usize {
    u16::from_le_bytes(b[at..at + 2].try_into().unwrap()) as usize
}
fn u32_at(b: &[u8], at: usize) -> usize {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap()) as usize
}
fn u64_at(b: &[u8], at: usize) -> usize {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap()) as usize
}

/// Names of the symbols an ELF64 little-endian file defines (its `.symtab`).
fn elf_symbols(elf: &[u8]) -> Result<Vec<&str>, String> {
    if elf.len() < 64 || &elf[..4] != b"\x7fELF" || elf[4] != 2 || elf[5] != 1 {
        return Err("not a 64-bit little-endian ELF file".into());
    }
    let (shoff, shentsize, shnum) = (u64_at(elf, 0x28), u16_at(elf, 0x3a), u16_at(elf, 0x3c));
    let section = |i: usize| shoff + i * shentsize;
    let symtab = (0..shnum)
        .map(section)
        .find(|&s| u32_at(elf, s + 4) == 2)
        .ok_or("no .symtab (a stripped binary?)")?;
    let strtab = section(u32_at(elf, symtab + 40));
    let (str_off, str_size) = (u64_at(elf, strtab + 24), u64_at(elf, strtab + 32));
    let strings = &elf[str_off..str_off + str_size];
    let (off, size) = (u64_at(elf, symtab + 24), u64_at(elf, symtab + 32));
    let mut names = Vec::new();
    for sym in elf[off..off + size].chunks_exact(24) {
        let (name, shndx) = (u32_at(sym, 0), u16_at(sym, 6));
        if shndx == 0 || name >= strings.len() {
            continue;
        }
        let end = strings[name..].iter().position(|&c| c == 0).unwrap_or(0);
        if let Ok(s) = std::str::from_utf8(&strings[name..name + end]) {
            names.push(s);
        }
    }
    Ok(names)
}

/// The parts of a legacy-mangled Rust path (`_ZN6cudarc6cublas3sys...E`).
fn demangle(sym: &str) -> Option<Vec<&str>> {
    let mut rest = sym.strip_prefix("_ZN")?;
    let mut parts = Vec::new();
    while !rest.starts_with('E') {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        let len: usize = rest[..digits].parse().ok()?;
        parts.push(rest.get(digits..digits + len)?);
        rest = &rest[digits + len..];
    }
    Some(parts)
}

/// Per library (`cublas`, `driver`, `nvrtc`), the functions whose run-time loader the binary
/// contains. cudarc loads each function on its first call and keeps it in a static inside
/// the wrapper (`cudarc::<lib>::sys::<function>::_S`); that static is linked exactly when the
/// wrapper is, whether or not the optimiser inlined the wrapper itself.
pub fn cudarc_calls(elf: &[u8]) -> Result<BTreeMap<String, BTreeSet<String>>, String> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for sym in elf_symbols(elf)? {
        if let Some(["cudarc", lib, "sys", function, "_S", ..]) = demangle(sym).as_deref() {
            out.entry(lib.to_string())
                .or_default()
                .insert(function.to_string());
        }
    }
    Ok(out)
}
