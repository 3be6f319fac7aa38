//! The CUDA backend checked on a machine with no GPU and no CUDA toolkit, from NVIDIA's
//! wheels on PyPI (`bash scripts/cuda-tools.sh` puts them in target/cuda-tools):
//!
//! - the kernels (`kernels/*.cu`) compiled by NVRTC through the backend's own path (cudarc, loaded at run
//!   time, the backend's options) for every architecture it claims, then assembled by ptxas:
//!   registers, shared memory and spills per kernel, checked against the launch the host
//!   makes and the limits of each architecture (`shapes`);
//! - every NVRTC, cuBLAS and cuBLASLt function the backend calls resolved in the libraries, and every
//!   driver function it calls found in CUDA 13.0's `cuda.h` (the driver itself needs a GPU,
//!   so those calls are listed as checked only on a device).
//!
//! Without the wheels these tests say how to get them and pass, except under CI (`CI` set),
//! where they fail.
#![cfg(feature = "cuda")]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use kvmesh_gpu::backend::cuda::shapes::{self, ArchLimits, KernelShape, KernelUsage};
use kvmesh_gpu::backend::cuda::{ptx_cache, KERNELS_CU};

mod offline;
use offline::{cudarc_calls, parse_ptxas, ptx_entries};

/// Where the wheels' files are.
struct Tools {
    lib: PathBuf,
    ptxas: PathBuf,
    cuda_h: PathBuf,
}

/// The wheels' files in the venv `venv`.
fn wheels(venv: &Path) -> Result<Tools, String> {
    let site = std::fs::read_dir(venv.join("lib"))
        .map_err(|e| format!("{}: {e}", venv.join("lib").display()))?
        .flatten()
        .map(|d| d.path().join("site-packages/nvidia/cu13"))
        .find(|p| p.is_dir())
        .ok_or_else(|| format!("no nvidia/cu13 under {}", venv.display()))?;
    Ok(Tools {
        lib: site.join("lib"),
        ptxas: site.join("bin/ptxas"),
        cuda_h: site.join("include/cuda.h"),
    })
}

/// The wheels (`$KVMESH_CUDA_TOOLS`, else target/cuda-tools), or on a machine with a CUDA
/// toolkit and no wheels (a GPU machine), the toolkit (`$CUDA_HOME`, else /usr/local/cuda).
fn find_tools() -> Result<Tools, String> {
    let venv = match std::env::var_os("KVMESH_CUDA_TOOLS") {
        Some(v) => PathBuf::from(v),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/cuda-tools"),
    };
    let toolkit =
        PathBuf::from(std::env::var_os("CUDA_HOME").unwrap_or_else(|| "/usr/local/cuda".into()));
    let candidates = [
        wheels(&venv),
        Ok(Tools {
            lib: toolkit.join("lib64"),
            ptxas: toolkit.join("bin/ptxas"),
            cuda_h: toolkit.join("include/cuda.h"),
        }),
    ];
    let mut why = Vec::new();
    for tools in candidates {
        let tools = match tools {
            Ok(t) => t,
            Err(e) => {
                why.push(e);
                continue;
            }
        };
        let has_lib = |prefix: &str| {
            std::fs::read_dir(&tools.lib).is_ok_and(|d| {
                d.flatten()
                    .any(|f| f.file_name().to_string_lossy().starts_with(prefix))
            })
        };
        let missing: Vec<String> = [
            (!has_lib("libnvrtc.so")).then(|| format!("{}/libnvrtc.so*", tools.lib.display())),
            (!has_lib("libcublas.so")).then(|| format!("{}/libcublas.so*", tools.lib.display())),
            (!tools.ptxas.exists()).then(|| tools.ptxas.display().to_string()),
            (!tools.cuda_h.exists()).then(|| tools.cuda_h.display().to_string()),
        ]
        .into_iter()
        .flatten()
        .collect();
        if missing.is_empty() {
            return Ok(tools);
        }
        why.push(format!("missing {}", missing.join(", ")));
    }
    Err(why.join("; "))
}

/// The wheels, or `None` (outside CI) after saying how to get them.
fn tools_or_skip() -> Option<Tools> {
    match find_tools() {
        Ok(t) => Some(t),
        Err(why) => {
            let msg = format!(
                "NVIDIA's CUDA wheels are not installed ({why}); run `bash scripts/cuda-tools.sh` \
                 (pip installs nvidia-cuda-nvrtc, nvidia-cuda-nvcc, nvidia-cublas and \
                 nvidia-cuda-runtime 13.0 into target/cuda-tools, or $KVMESH_CUDA_TOOLS)"
            );
            if std::env::var_os("CI").is_some() {
                panic!("{msg}");
            }
            eprintln!("skipped: {msg}");
            None
        }
    }
}

/// Whether this process should run `test`'s body. The dynamic loader reads LD_LIBRARY_PATH
/// once, when a process starts, and cudarc finds the libraries by name, as it does on a GPU
/// machine: so the test re-runs itself with the wheel's folder on it, and the parent only
/// checks that the child passed.
fn in_child(test: &str, tools: &Tools) -> bool {
    const CHILD: &str = "KVMESH_CUDA_OFFLINE_CHILD";
    if std::env::var(CHILD).as_deref() == Ok(test) {
        return true;
    }
    let mut path = tools.lib.as_os_str().to_owned();
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
        path.push(":");
        path.push(old);
    }
    let status = Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, test)
        .env("LD_LIBRARY_PATH", path)
        .status()
        .expect("re-running the test binary");
    assert!(status.success(), "{test} failed in its child process");
    false
}

/// The newest PTX ISA version the oldest driver the backend supports (580, CUDA 13.0)
/// accepts; the CUDA release notes pair each release with its ISA version.
const OLDEST_DRIVER_PTX_ISA: (u32, u32) = (9, 0);

fn arch_of(a: &ArchLimits) -> String {
    a.sm.replace("sm_", "compute_")
}

/// ptxas on `ptx` for `sm` with `extra` options: its report, or its error output.
fn ptxas(tools: &Tools, ptx: &str, sm: &str, extra: &[&str]) -> Result<String, String> {
    // A folder of its own: several architectures are assembled at once.
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!(
        "kvmesh-cuda-offline-{}-{sm}-{call}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join(format!("kernels-{sm}.ptx"));
    std::fs::write(&src, ptx).unwrap();
    let out = Command::new(&tools.ptxas)
        .arg(format!("-arch={sm}"))
        .args(["-v", "--warn-on-spills"])
        .args(extra)
        .arg("-o")
        .arg(dir.join(format!("kernels-{sm}.cubin")))
        .arg(&src)
        .output()
        .expect("running ptxas");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // KVMESH_CUBIN_DIR keeps each architecture's cubin there, for counting a kernel's
    // instructions with nvdisasm (PyPI `nvidia-cuda-nvdisasm`) without a GPU.
    if let Some(keep) = std::env::var_os("KVMESH_CUBIN_DIR") {
        let keep = std::path::PathBuf::from(keep);
        let _ = std::fs::create_dir_all(&keep);
        let name = format!("kernels-{sm}.cubin");
        let _ = std::fs::copy(dir.join(&name), keep.join(name));
    }
    let _ = std::fs::remove_dir_all(&dir);
    if out.status.success() {
        Ok(text)
    } else {
        Err(text)
    }
}

/// One kernel's figures on one architecture, checked; the problems found are pushed.
fn check_kernel(
    a: &ArchLimits,
    k: &KernelShape,
    u: &KernelUsage,
    problems: &mut Vec<String>,
) -> String {
    let fit = match a.fit(k, u) {
        Ok(f) => format!("{:>3} {:>4.0}%", f.blocks_per_sm, 100.0 * f.occupancy),
        Err(e) => {
            problems.push(format!("{}: {e}", a.sm));
            "does not fit".to_string()
        }
    };
    if k.hot && (u.spill_stores > 0 || u.spill_loads > 0) {
        problems.push(format!(
            "{}: {} spills registers ({} bytes stored, {} loaded) and is on every token's path",
            a.sm, k.name, u.spill_stores, u.spill_loads
        ));
    }
    format!(
        "{:<7} {:<24} {:>7} {:>5} {:>7} {:>6} {:>6}/{:<6} {}",
        a.sm,
        k.name,
        k.threads,
        u.registers,
        u.smem,
        u.stack_frame,
        u.spill_stores,
        u.spill_loads,
        fit
    )
}

#[test]
fn cuda_kernels_compile_assemble_and_fit_every_claimed_architecture() {
    let test = "cuda_kernels_compile_assemble_and_fit_every_claimed_architecture";
    let Some(tools) = tools_or_skip() else { return };
    if !in_child(test, &tools) {
        return;
    }
    let (major, minor) = ptx_cache::nvrtc_version().expect("libnvrtc loads through cudarc");
    println!(
        "NVRTC {major}.{minor} (cudarc, dynamic loading), ptxas from {}",
        tools.ptxas.display()
    );
    let mut problems = Vec::new();
    println!(
        "{:<7} {:<24} {:>7} {:>5} {:>7} {:>6} {:>13} {:>9}",
        "arch", "kernel", "threads", "regs", "smem B", "stack", "spill st/ld", "blk/SM occ"
    );
    // NVRTC and ptxas for every architecture at once (each is one core's work for most of a
    // minute); the checks below then read the results in order.
    let built: Vec<(String, String)> = std::thread::scope(|scope| {
        let jobs: Vec<_> = shapes::ARCHS
            .iter()
            .map(|a| {
                let tools = &tools;
                scope.spawn(move || {
                    let ptx = ptx_cache::compile_kernels(KERNELS_CU, &arch_of(a))
                        .unwrap_or_else(|e| panic!("NVRTC refused the kernels for {}: {e}", a.sm));
                    let report = ptxas(tools, &ptx, a.sm, &[])
                        .unwrap_or_else(|e| panic!("ptxas refused the PTX for {}:\n{e}", a.sm));
                    (ptx, report)
                })
            })
            .collect();
        jobs.into_iter()
            .map(|j| j.join().expect("a compile thread"))
            .collect()
    });
    for (a, (ptx, report)) in shapes::ARCHS.iter().zip(built) {
        assert!(ptx.contains(&format!(".target {}", a.sm)), "{}", a.sm);
        // The oldest driver the backend supports, 580 (CUDA 13.0), loads PTX ISA up to 9.0.
        let isa = ptx_cache::ptx_isa(&ptx).expect("a .version directive");
        let (isa_major, isa_minor) = isa.split_once('.').expect("ISA major.minor");
        let isa_v: (u32, u32) = (isa_major.parse().unwrap(), isa_minor.parse().unwrap());
        if isa_v > OLDEST_DRIVER_PTX_ISA {
            problems.push(format!(
                "{}: PTX ISA {isa} is newer than driver 580 (CUDA 13.0) loads",
                a.sm
            ));
        }
        let entries = ptx_entries(&ptx);
        let listed: BTreeSet<&str> = shapes::KERNELS.iter().map(|k| k.name).collect();
        let compiled: BTreeSet<&str> = entries.keys().map(String::as_str).collect();
        assert_eq!(
            compiled, listed,
            "{}: the kernels NVRTC compiled and those the host launches (shapes::KERNELS) differ",
            a.sm
        );
        for line in report.lines().filter(|l| l.contains("warning")) {
            if !line.contains("spill") {
                problems.push(format!("{}: {line}", a.sm));
            }
        }
        let usage = parse_ptxas(&report).unwrap_or_else(|e| panic!("{}: {e}", a.sm));
        for k in shapes::KERNELS {
            let entry = &entries[k.name];
            if entry.max_threads != Some(k.threads) {
                problems.push(format!(
                    "{}: {} is compiled for blocks of {:?} threads (.maxntid) but launched with {}",
                    a.sm, k.name, entry.max_threads, k.threads
                ));
            }
            if entry.dynamic_smem && k.dynamic_smem == 0 {
                problems.push(format!(
                    "{}: {} declares dynamic shared memory the host launch does not give it",
                    a.sm, k.name
                ));
            }
            match usage.get(k.name) {
                Some(u) if u.smem != k.static_smem => problems.push(format!(
                    "{}: {} has {} bytes of static shared memory; shapes.rs expects {}",
                    a.sm, k.name, u.smem, k.static_smem
                )),
                Some(u) => println!("{}", check_kernel(a, k, u, &mut problems)),
                None => problems.push(format!("{}: ptxas reported nothing for {}", a.sm, k.name)),
            }
        }
        // The attention kernels' parameter counts, as `kernels::Attention` pushes them (a
        // launch with a missing argument reads garbage rather than failing).
        for (name, params) in [
            (shapes::ATTENTION_DECODE.name, 17),
            (shapes::ATTENTION_DECODE_VEC[3].1.name, 17),
            (shapes::ATTENTION_PREFILL.name, 16),
            (shapes::ATTENTION_PREFILL_MMA[3].1.name, 16),
            (shapes::ATTENTION_PREFILL_MMA[4].1.name, 16),
        ] {
            assert_eq!(entries[name].params, params, "{}: {name}", a.sm);
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The checks above can fail: NVRTC's message for a broken kernel names the mistake, and a
/// launch bound that leaves too few registers makes ptxas spill, which the report shows and
/// the hot-kernel rule refuses.
#[test]
fn cuda_broken_and_spilling_kernels_are_caught() {
    let test = "cuda_broken_and_spilling_kernels_are_caught";
    let Some(tools) = tools_or_skip() else { return };
    if !in_child(test, &tools) {
        return;
    }
    let broken = KERNELS_CU.replacen("float inv = 1.0f / l;", "float inv = 1.0f / l_typo;", 1);
    assert_ne!(
        broken, KERNELS_CU,
        "the line to break is gone; pick another"
    );
    let e = ptx_cache::compile_kernels(&broken, "compute_90")
        .unwrap_err()
        .to_string();
    assert!(e.contains("l_typo") && e.contains("identifier"), "{e}");

    // Eight resident blocks of 256 threads leave the prefill kernel 32 registers a thread.
    let squeezed = KERNELS_CU.replacen(
        "__launch_bounds__(PF_Q * 32)",
        "__launch_bounds__(PF_Q * 32, 8)",
        1,
    );
    assert_ne!(
        squeezed, KERNELS_CU,
        "the prefill kernel's launch bound is gone"
    );
    let ptx = ptx_cache::compile_kernels(&squeezed, "compute_90").unwrap();
    let report = ptxas(&tools, &ptx, "sm_90", &[]).unwrap();
    assert!(report.contains("warning"), "{report}");
    let usage = parse_ptxas(&report).unwrap();
    let k = shapes::ATTENTION_PREFILL;
    let u = &usage[k.name];
    assert!(u.registers <= 32 && u.spill_stores > 0, "{u:?}");
    let sm90 = shapes::ARCHS.iter().find(|a| a.sm == "sm_90").unwrap();
    let mut problems = Vec::new();
    check_kernel(sm90, &k, u, &mut problems);
    assert!(
        problems.iter().any(|p| p.contains("spills registers")),
        "{problems:?}"
    );
}

/// Keeps the whole backend in this test binary, as it is in `kvmesh`: the entry point the
/// engine builds it through, what other crates call on it directly, and the IPC calls.
fn link_the_backend() {
    use kvmesh_gpu::backend::cuda::CudaBackend;
    std::hint::black_box((
        kvmesh_gpu::model::build_backend as *const () as usize,
        CudaBackend::new as *const () as usize,
        CudaBackend::copy_blocks_out as *const () as usize,
        CudaBackend::copy_blocks_in as *const () as usize,
        CudaBackend::cuda_graphs_enabled as *const () as usize,
        CudaBackend::kv_bytes_per_block as *const () as usize,
        kvmesh_gpu::backend::cuda::device_count as *const () as usize,
        kvmesh_gpu::backend::cuda::green::resolved as *const () as usize,
    ));
    // CUDA IPC, which KV hand-over between processes on one host is built on.
    use kvmesh_gpu::backend::cuda::ipc;
    std::hint::black_box((
        ipc::Exported::alloc as *const () as usize,
        ipc::Mapped::open as *const () as usize,
        ipc::upload as *const () as usize,
        ipc::download as *const () as usize,
        std::mem::drop::<ipc::Mapped> as fn(_) as *const () as usize,
        std::mem::drop::<ipc::Exported> as fn(_) as *const () as usize,
    ));
}

/// The committed list of library functions the backend calls (see the test below).
const CALLS_FILE: &str = "src/backend/cuda/library_calls.txt";

fn render_calls(calls: &BTreeMap<String, BTreeSet<String>>) -> String {
    let mut out = String::from(
        "# Library functions the CUDA backend calls, by library, as cudarc loads them at run\n\
         # time. gpu/tests/cuda_offline finds them in the linked backend and resolves the\n\
         # nvrtc, cublas and cublaslt ones in NVIDIA's 13.0 wheels; the driver ones need a GPU\n\
         # to load, so there they are only checked against cuda.h. Regenerate with\n\
         # KVMESH_BLESS=1.\n",
    );
    for (lib, names) in calls {
        out.push_str(&format!("\n[{lib}]\n"));
        for n in names {
            out.push_str(n);
            out.push('\n');
        }
    }
    out
}

#[test]
fn cuda_library_functions_the_backend_calls_resolve() {
    let test = "cuda_library_functions_the_backend_calls_resolve";
    let Some(tools) = tools_or_skip() else { return };
    if !in_child(test, &tools) {
        return;
    }
    link_the_backend();
    let exe = std::fs::read(std::env::current_exe().unwrap()).unwrap();
    let calls = cudarc_calls(&exe).expect("reading this binary's symbol table");
    for lib in ["cublas", "cublaslt", "driver", "nvrtc"] {
        assert!(
            calls.get(lib).is_some_and(|c| !c.is_empty()),
            "no {lib} calls found in the linked backend: {calls:?}"
        );
    }
    let mut problems = Vec::new();
    // SAFETY: the libraries are only opened and searched for symbols; nothing is called.
    unsafe {
        assert!(cudarc::nvrtc::sys::is_culib_present(), "libnvrtc.so.13");
        assert!(cudarc::cublas::sys::is_culib_present(), "libcublas.so.13");
        assert!(
            cudarc::cublaslt::sys::is_culib_present(),
            "libcublasLt.so.13"
        );
        for (lib, found) in [
            ("nvrtc", cudarc::nvrtc::sys::culib()),
            ("cublas", cudarc::cublas::sys::culib()),
            ("cublaslt", cudarc::cublaslt::sys::culib()),
        ] {
            for name in &calls[lib] {
                if found
                    .get::<*const std::ffi::c_void>(name.as_bytes())
                    .is_err()
                {
                    problems.push(format!("{lib}: {name} does not resolve"));
                }
            }
        }
    }
    // SAFETY: as above; libcuda is only searched, and only where a driver is installed.
    let driver_here = unsafe { cudarc::driver::sys::is_culib_present() };
    if driver_here {
        for name in &calls["driver"] {
            // SAFETY: as above.
            let found = unsafe {
                cudarc::driver::sys::culib()
                    .get::<*const std::ffi::c_void>(name.as_bytes())
                    .is_ok()
            };
            if !found {
                problems.push(format!("driver: {name} does not resolve in libcuda"));
            }
        }
    }
    let header = std::fs::read_to_string(&tools.cuda_h).unwrap();
    let declared: BTreeSet<&str> = header
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .collect();
    for name in &calls["driver"] {
        if !declared.contains(name.as_str()) {
            problems.push(format!(
                "driver: {name} is not declared in {}",
                tools.cuda_h.display()
            ));
        }
    }
    let driver_note = if driver_here {
        "resolved in this machine's driver"
    } else {
        "found in cuda.h, and checked only on a device (no driver here)"
    };
    println!(
        "resolved: {} nvrtc, {} cublas and {} cublaslt functions; {driver_note}: {} driver \
         functions: {}",
        calls["nvrtc"].len(),
        calls["cublas"].len(),
        calls["cublaslt"].len(),
        calls["driver"].len(),
        calls["driver"]
            .iter()
            .cloned()
            .collect::<Vec<_>>()
            .join(" ")
    );
    assert!(problems.is_empty(), "{}", problems.join("\n"));

    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(CALLS_FILE);
    let rendered = render_calls(&calls);
    if std::env::var_os("KVMESH_BLESS").is_some() {
        std::fs::write(&path, &rendered).unwrap();
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert_eq!(
        committed, rendered,
        "the backend's library calls changed: check the new ones, then rerun with \
         KVMESH_BLESS=1 to update gpu/{CALLS_FILE}"
    );
}
