//! NVRTC compilation of the kernels, cached on disk.
//!
//! Compiling the kernels (`kernels/*.cu`) takes a second or more; a worker restarts often enough that paying
//! it each time matters. The PTX is stored under `$XDG_CACHE_HOME/kvmesh/ptx` (or
//! `~/.cache/kvmesh/ptx`) in a file named by a hash of everything that affects the output:
//! the source, the options and the target architecture. The hash is our own FNV-1a (64-bit)
//! rather than `std`'s `DefaultHasher`, whose output may change between Rust releases and
//! would then silently orphan every cached file.
//!
//! The key and path functions are pure so they are tested without a GPU.

use std::path::{Path, PathBuf};

use crate::backend::error::ToolchainError;
use crate::error::{EngineError, Result};

/// Bumped when the cache layout itself changes, so old files are never read as new ones.
const CACHE_FORMAT: &str = "kvmesh-ptx-v1";

/// 64-bit FNV-1a over `bytes`, continuing from `state`.
fn fnv1a(mut state: u64, bytes: &[u8]) -> u64 {
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    for &b in bytes {
        state ^= b as u64;
        state = state.wrapping_mul(PRIME);
    }
    state
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// A stable key for `source` compiled with `options` for `arch` (e.g. `compute_90`). Each
/// part is hashed with its length in front so that moving text between parts changes the key.
pub fn cache_key(source: &str, options: &[String], arch: &str) -> String {
    let mut h = FNV_OFFSET;
    let mut part = |bytes: &[u8]| {
        h = fnv1a(h, &(bytes.len() as u64).to_le_bytes());
        h = fnv1a(h, bytes);
    };
    part(CACHE_FORMAT.as_bytes());
    part(source.as_bytes());
    part(arch.as_bytes());
    part(&(options.len() as u64).to_le_bytes());
    for o in options {
        part(o.as_bytes());
    }
    format!("{h:016x}")
}

/// The folder cached PTX lives in, from the environment values given (pure, for tests):
/// `$XDG_CACHE_HOME/kvmesh/ptx` when that is set to an absolute path, else
/// `$HOME/.cache/kvmesh/ptx`, else `None` (no cache; compile every time).
pub fn cache_dir_from(xdg_cache_home: Option<&str>, home: Option<&str>) -> Option<PathBuf> {
    let base = match xdg_cache_home {
        // The XDG spec says relative values are to be ignored.
        Some(x) if !x.is_empty() && Path::new(x).is_absolute() => PathBuf::from(x),
        _ => match home {
            Some(h) if !h.is_empty() => Path::new(h).join(".cache"),
            _ => return None,
        },
    };
    Some(base.join("kvmesh").join("ptx"))
}

/// The cache folder for this process's environment.
pub fn cache_dir() -> Option<PathBuf> {
    let xdg = std::env::var("XDG_CACHE_HOME").ok();
    let home = std::env::var("HOME").ok();
    cache_dir_from(xdg.as_deref(), home.as_deref())
}

/// The file a key's PTX is stored in, with the arch in the name so a person looking at the
/// folder can tell the entries apart.
pub fn cache_path(dir: &Path, key: &str, arch: &str) -> PathBuf {
    let arch: String = arch
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect();
    dir.join(format!("kernels-{arch}-{key}.ptx"))
}

/// The NVRTC architecture flag for a compute capability: `(9, 0)` gives `compute_90`.
/// PTX for a virtual architecture is JIT-compiled by the driver for the exact device.
pub fn arch_for(major: i32, minor: i32) -> String {
    format!("compute_{major}{minor}")
}

/// Options the kernels are compiled with. No `--use_fast_math`: RoPE's `sincosf` at large
/// positions and the softmax `expf` would drift from the CPU reference the backend is
/// checked against; the kernels use fast intrinsics explicitly where it is safe. The launch
/// figures of `shapes` go in as macros, so the kernels and the host cannot disagree on them.
pub fn compile_options(arch: &str) -> Vec<String> {
    let mut options = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
    ];
    options.extend(
        super::shapes::defines()
            .into_iter()
            .map(|(name, value)| format!("-D{name}={value}")),
    );
    options
}

/// The PTX ISA version a module declares (`.version 9.0`): a driver loads only the ISA
/// versions up to its own CUDA release's.
pub fn ptx_isa(ptx: &str) -> Option<&str> {
    ptx.lines()
        .find_map(|l| l.trim().strip_prefix(".version "))
        .map(str::trim)
}

/// `source` (`kernels::KERNELS_CU`, or a broken copy of it to see the compiler refuse it)
/// compiled by NVRTC for `arch` (`compute_90`, ...) exactly as the backend compiles it when
/// it starts, without the cache: for checks that have no GPU.
pub fn compile_kernels(source: &str, arch: &str) -> Result<String> {
    compile(source, &compile_options(arch))
}

/// PTX text for `source`: from the cache when present, else compiled by NVRTC and written
/// to the cache (a cache that cannot be written only costs the next start a recompile).
pub fn load_or_compile(source: &str, arch: &str) -> Result<String> {
    let options = compile_options(arch);
    // The compiler's version is part of the key: PTX from a newer NVRTC can carry a PTX ISA
    // version an older driver refuses, so a toolkit change must not reuse old files.
    let mut key_parts = options.clone();
    key_parts.push(match nvrtc_version() {
        Some((major, minor)) => format!("nvrtc-{major}.{minor}"),
        None => "nvrtc-unknown".to_string(),
    });
    let key = cache_key(source, &key_parts, arch);
    let path = cache_dir().map(|d| cache_path(&d, &key, arch));
    if let Some(p) = &path {
        if let Ok(text) = std::fs::read_to_string(p) {
            if text.contains(".entry") {
                tracing::debug!(path = %p.display(), "using cached PTX");
                return Ok(text);
            }
        }
    }
    let ptx = compile(source, &options)?;
    if let Some(p) = &path {
        if let Err(e) = write_atomically(p, &ptx) {
            tracing::warn!(path = %p.display(), error = %e, "could not cache the compiled PTX");
        }
    }
    Ok(ptx)
}

/// NVRTC's `(major, minor)` version, or `None` when the library cannot be loaded.
pub fn nvrtc_version() -> Option<(i32, i32)> {
    // SAFETY: the probe only opens the library; nvrtcVersion is called only once it is known
    // to load, and writes two ints through valid pointers.
    unsafe {
        if !cudarc::nvrtc::sys::is_culib_present() {
            return None;
        }
        let (mut major, mut minor) = (0, 0);
        let r = cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor);
        (r == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS).then_some((major, minor))
    }
}

/// Writes through a temporary file and a rename, so two workers starting together never
/// read each other's half-written PTX.
fn write_atomically(path: &Path, text: &str) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}

fn compile(source: &str, options: &[String]) -> Result<String> {
    // SAFETY: only probes whether the library can be opened.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(ToolchainError::NoNvrtc.into());
    }
    let opts = cudarc::nvrtc::CompileOptions {
        options: options.to_vec(),
        name: Some("kvmesh_kernels.cu".into()),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(source, opts)
        .map_err(|e| EngineError::device("compiling the CUDA kernels failed", e))?;
    match ptx.as_bytes() {
        Some(bytes) => {
            // The image is a NUL-terminated C string.
            let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
            String::from_utf8(bytes[..end].to_vec())
                .map_err(|e| ToolchainError::PtxNotUtf8(e).into())
        }
        None => Err(ToolchainError::NoPtx.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_matches_the_published_vectors() {
        assert_eq!(fnv1a(FNV_OFFSET, b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(FNV_OFFSET, b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(FNV_OFFSET, b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn ptx_cache_key_is_stable_and_sensitive_to_every_input() {
        let opts = compile_options("compute_90");
        let k = cache_key("src", &opts, "compute_90");
        assert_eq!(k, cache_key("src", &opts, "compute_90"));
        assert_eq!(k.len(), 16);
        assert_ne!(k, cache_key("src ", &opts, "compute_90"));
        assert_ne!(k, cache_key("src", &opts, "compute_80"));
        assert_ne!(
            k,
            cache_key("src", &compile_options("compute_80"), "compute_90")
        );
        assert_ne!(k, cache_key("src", &[], "compute_90"));
        // Text moved between parts must not collide.
        assert_ne!(
            cache_key("ab", &["c".to_string()], "x"),
            cache_key("a", &["bc".to_string()], "x")
        );
    }

    #[test]
    fn ptx_cache_dir_prefers_absolute_xdg_then_home() {
        assert_eq!(
            cache_dir_from(Some("/xdg"), Some("/home/u")),
            Some(PathBuf::from("/xdg/kvmesh/ptx"))
        );
        assert_eq!(
            cache_dir_from(Some("relative"), Some("/home/u")),
            Some(PathBuf::from("/home/u/.cache/kvmesh/ptx"))
        );
        assert_eq!(
            cache_dir_from(None, Some("/home/u")),
            Some(PathBuf::from("/home/u/.cache/kvmesh/ptx"))
        );
        assert_eq!(cache_dir_from(Some(""), None), None);
    }

    #[test]
    fn ptx_cache_path_names_the_arch_and_key() {
        let p = cache_path(Path::new("/c"), "00ff", "compute_90");
        assert_eq!(p, PathBuf::from("/c/kernels-compute_90-00ff.ptx"));
        // Nothing from the arch string can escape the folder.
        let p = cache_path(Path::new("/c"), "k", "../x");
        assert_eq!(p.parent(), Some(Path::new("/c")));
    }

    #[test]
    fn ptx_cache_arch_from_compute_capability() {
        assert_eq!(arch_for(9, 0), "compute_90");
        assert_eq!(arch_for(8, 6), "compute_86");
        assert!(compile_options("compute_90").contains(&"--gpu-architecture=compute_90".into()));
    }

    #[test]
    fn ptx_cache_write_is_readable_back() {
        let dir = std::env::temp_dir().join(format!("kvmesh-ptx-test-{}", std::process::id()));
        let p = cache_path(&dir, "abc", "compute_90");
        write_atomically(&p, "// .entry x").unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "// .entry x");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
