//! One GPU shared by two engines: each side of an SM split (a green context) computing what
//! the whole device does, and device memory handed between processes by CUDA IPC.

use std::process::Command;

use kvmesh_gpu::backend::cuda::green;
use kvmesh_gpu::backend::cuda::ipc::{download, upload, Exported, IpcHandle, Mapped};
use kvmesh_gpu::backend::sm_split::{SmPartition, SmSide, SmSplit};

use super::*;

fn on_partition(m: &LoadedModel, part: Option<SmPartition>) -> Box<dyn Backend> {
    build_backend(
        BackendKind::Cuda(CudaOptions {
            sm_partition: part,
            ..CudaOptions::device(0)
        }),
        m,
        BLOCK_SIZE,
        KvBudget::Blocks(64),
    )
    .unwrap_or_else(|e| panic!("a backend on {part:?}: {e}"))
}

#[test]
fn each_side_of_an_sm_split_computes_what_the_whole_gpu_does() {
    let split: SmSplit = "0.5".parse().unwrap();
    let r = green::resolved(0, split).expect("the device's SM figures");
    println!(
        "--sm-split {split}: prefill {} SMs, decode {} SMs",
        r.prefill, r.decode
    );
    for name in ["tiny-qwen3", "shakespeare"] {
        let m = load(name);
        let prompt = &prompts(name)[0];
        let table: Vec<BlockId> = (0..(prompt.len() + 2).div_ceil(BLOCK_SIZE) as u32)
            .map(BlockId)
            .collect();
        // Built from one model, the backends below share the device copy of the weights
        // `whole` uploaded (in the primary context) from their green contexts.
        let mut whole = on_partition(&m, None);
        let want = forward(whole.as_mut(), prompt, 0, &table);
        let want_next = forward(
            whole.as_mut(),
            &[argmax(&want) as u32],
            prompt.len(),
            &table,
        );
        for side in [SmSide::Prefill, SmSide::Decode] {
            let mut be = on_partition(&m, Some(SmPartition { split, side }));
            let got = forward(be.as_mut(), prompt, 0, &table);
            let got_next = forward(be.as_mut(), &[argmax(&want) as u32], prompt.len(), &table);
            let ctx = format!("{name} on the {side:?} side");
            let d = assert_close(&ctx, &got, &want).max(assert_close(&ctx, &got_next, &want_next));
            assert_eq!(argmax(&got), argmax(&want), "{ctx}: greedy token");
            println!(
                "{ctx}: largest logit difference to the whole GPU {d:.2e} ({})",
                if got == want && got_next == want_next {
                    "bit-identical"
                } else {
                    "not bit-identical"
                }
            );
        }
    }
}

/// Set for the child process of the IPC test: the handle it maps.
const IPC_ENV: &str = "KVMESH_TEST_IPC_HANDLE";

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 + 3) as u8).collect()
}

#[test]
fn a_region_exported_by_ipc_is_read_and_written_by_another_process() {
    if std::env::var_os(IPC_ENV).is_some() {
        return; // the child runs `ipc_child` only
    }
    let ctx = green::context(0, None).expect("a CUDA device");
    let len = 3 << 20;
    let region = Exported::alloc(&ctx, len).unwrap();
    upload(&ctx, region.device_ptr(), &pattern(len)).unwrap();
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "split::ipc_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(IPC_ENV, region.handle().to_hex())
        .output()
        .unwrap();
    let log =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the mapping process failed:\n{log}");
    assert!(
        log.contains("mapped and checked"),
        "the child did not run:\n{log}"
    );
    let mut back = vec![0u8; len];
    download(&ctx, &mut back, region.device_ptr()).unwrap();
    let want: Vec<u8> = pattern(len).iter().map(|b| !b).collect();
    assert!(
        back == want,
        "what the other process wrote is not in the region"
    );
}

/// The other process of the IPC test (does nothing unless `IPC_ENV` is set): maps the
/// region, checks the exporter's bytes, writes their complement.
#[test]
fn ipc_child() {
    let Ok(hex) = std::env::var(IPC_ENV) else {
        return;
    };
    let h = IpcHandle::from_hex(&hex).unwrap();
    let ctx = green::context(0, None).expect("a CUDA device");
    let mapped = Mapped::open(&ctx, &h).unwrap();
    let mut got = vec![0u8; mapped.len()];
    download(&ctx, &mut got, mapped.device_ptr()).unwrap();
    assert!(got == pattern(h.len), "the exporter's bytes differ");
    let flipped: Vec<u8> = got.iter().map(|b| !b).collect();
    upload(&ctx, mapped.device_ptr(), &flipped).unwrap();
    println!("mapped and checked {} bytes", h.len);
}
