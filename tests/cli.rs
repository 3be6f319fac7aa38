//! Start-up errors name what is wrong; `model init-random` writes servable checkpoints.

use std::process::Command;

fn kvmesh(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvmesh"))
        .args(args)
        .output()
        .expect("run kvmesh");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("kvmesh-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn a_missing_model_folder_is_named() {
    let (ok, out) = kvmesh(&["serve", "--model", "/nonexistent/model", "--port", "0"]);
    assert!(!ok);
    assert!(out.contains("/nonexistent/model"), "{out}");
}

#[test]
fn missing_files_and_unknown_architectures_are_named() {
    let dir = tmp("broken");
    let (ok, out) = kvmesh(&[
        "model",
        "init-random",
        "--arch",
        "qwen2",
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert!(ok, "{out}");
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    let (ok, out) = kvmesh(&["serve", "--model", dir.to_str().unwrap(), "--port", "0"]);
    assert!(!ok);
    assert!(out.contains("tokenizer.json"), "{out}");

    let cfg = std::fs::read_to_string(dir.join("config.json"))
        .unwrap()
        .replace("Qwen2ForCausalLM", "GPT2LMHeadModel")
        .replace("\"qwen2\"", "\"gpt2\"");
    std::fs::write(dir.join("config.json"), cfg).unwrap();
    let (ok, out) = kvmesh(&["serve", "--model", dir.to_str().unwrap(), "--port", "0"]);
    assert!(!ok);
    assert!(out.contains("GPT2LMHeadModel"), "{out}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn init_random_writes_every_family_and_preset_shape() {
    for arch in ["llama", "qwen2", "qwen3", "mistral"] {
        let dir = tmp(arch);
        let (ok, out) = kvmesh(&[
            "model",
            "init-random",
            "--arch",
            arch,
            "--preset",
            "tiny",
            "--out",
            dir.to_str().unwrap(),
        ]);
        assert!(ok, "{out}");
        for f in [
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
        ] {
            assert!(dir.join(f).exists(), "{arch}: {f}");
        }
        let cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(cfg["model_type"], arch);
        std::fs::remove_dir_all(&dir).ok();
    }
    // A real preset's shape, shrunk in depth to keep the test quick.
    let dir = tmp("qwen25");
    let (ok, out) = kvmesh(&[
        "model",
        "init-random",
        "--preset",
        "qwen2.5-0.5b",
        "--layers",
        "1",
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert!(ok, "{out}");
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["hidden_size"], 896);
    assert_eq!(cfg["num_key_value_heads"], 2);
    assert_eq!(cfg["vocab_size"], 151936);
    std::fs::remove_dir_all(&dir).ok();
    let (ok, out) = kvmesh(&[
        "model",
        "init-random",
        "--arch",
        "llama",
        "--preset",
        "qwen3-0.6b",
        "--out",
        "/tmp/x",
    ]);
    assert!(!ok && out.contains("qwen3"), "{out}");
}

/// The Qwen3.5 preset's layer layout comes with its shape: a flag that would change one
/// without the other is refused before anything is written. (`--fp8` is taken: its FP8
/// checkpoint is checked small in `init`'s unit tests.)
#[test]
fn the_hybrid_preset_refuses_shape_flags() {
    for extra in [&["--layers", "1"][..], &["--hidden-size", "64"]] {
        let dir = tmp("qwen35-9b");
        let mut args = vec![
            "model",
            "init-random",
            "--preset",
            "qwen3.5-9b",
            "--out",
            dir.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let (ok, out) = kvmesh(&args);
        assert!(!ok, "{extra:?}: {out}");
        assert!(
            out.contains("qwen3.5-9b") && out.contains("hybrid"),
            "{extra:?}: {out}"
        );
        assert!(!dir.join("model.safetensors").exists(), "{extra:?}");
        std::fs::remove_dir_all(&dir).ok();
    }
}

#[test]
fn asking_for_a_device_that_is_not_there_is_a_clear_error() {
    let (ok, out) = kvmesh(&["serve", "--device", "tpu", "--port", "0"]);
    assert!(!ok);
    assert!(out.contains("auto, cpu, cuda or cuda:N"), "{out}");
    // This machine has no GPU; a default build has no CUDA support either way.
    let (ok, out) = kvmesh(&["serve", "--device", "cuda:0", "--port", "0"]);
    assert!(!ok);
    assert!(out.contains("CUDA"), "{out}");
}

#[test]
fn a_routing_bound_that_would_change_the_routing_silently_is_refused() {
    // A negative or NaN bound would act as "no imbalance allowed"; clap refuses it before
    // anything starts (no etcd is needed to get this far).
    for bad in ["-1", "NaN", "lots"] {
        let flag = format!("--prefix-max-imbalance={bad}");
        let (ok, out) = kvmesh(&[
            "node",
            "--etcd",
            "http://127.0.0.1:9",
            "--roles",
            "gateway,router",
            "--policy",
            "prefix",
            &flag,
        ]);
        assert!(!ok, "{bad} accepted: {out}");
        assert!(
            out.contains("--prefix-max-imbalance") && out.contains("relative imbalance"),
            "{bad}: {out}"
        );
    }
}

#[test]
fn kv_over_ucx_without_the_library_says_what_to_install() {
    // Before the node joins anything, so no etcd is needed.
    let out = Command::new(env!("CARGO_BIN_EXE_kvmesh"))
        .args([
            "node",
            "--etcd",
            "http://127.0.0.1:9",
            "--roles",
            "prefill",
            "--backend",
            "sim",
            "--kv-transport",
            "ucx",
        ])
        .env("KVMESH_UCX_LIB", "/nonexistent/libucp.so.0")
        .output()
        .expect("run kvmesh");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("--kv-transport ucx") && text.contains("libucx0"),
        "{text}"
    );
}

/// An SM split on an engine that runs on the CPU is refused at start, naming the device.
#[test]
fn an_sm_split_without_a_gpu_is_refused_naming_the_device() {
    let (ok, out) = kvmesh(&[
        "node",
        "--no-etcd",
        "--roles",
        "gateway,router,prefill,decode",
        "--port",
        "0",
        "--device",
        "cpu",
        "--sm-split",
        "prefill:96,decode:36",
    ]);
    assert!(!ok, "{out}");
    assert!(
        out.contains("--sm-split prefill:96,decode:36 splits a CUDA GPU's SMs")
            && out.contains("--device cpu runs them on the CPU"),
        "{out}"
    );
}

/// CUDA IPC on a decode engine that runs on the CPU is refused at start, naming the device.
#[test]
fn cuda_ipc_without_a_gpu_is_refused_naming_the_device() {
    let (ok, out) = kvmesh(&[
        "node",
        "--no-etcd",
        "--roles",
        "gateway,router,decode",
        "--port",
        "0",
        "--device",
        "cpu",
        "--kv-transport",
        "cuda-ipc",
    ]);
    assert!(!ok, "{out}");
    assert!(
        out.contains("--kv-transport cuda-ipc") && out.contains("--device cpu runs it on the CPU"),
        "{out}"
    );
}
