//! KV handed from one CUDA engine to another of the same process on the device: the
//! decode engine lends its device cache's blocks, the prefill engine its own, and
//! `kv_copy_runs` copies between them with nothing crossing the host.

use kvmesh_gpu::device_kv::{CopyRun, KvMemory};
use kvmesh_gpu::engine::{ExportEvent, Handover, Landed};
use kvmesh_gpu::kv_pool::KvKind;

use super::*;

/// The runs that copy positions `0..n` of every layer from `src`'s blocks to `dst`'s: one
/// per block, K's then V's.
fn runs(src: &engine::KvLease, dst: &engine::KvLease, n: usize) -> Vec<CopyRun> {
    let (KvMemory::Device(sp), KvMemory::Device(dp)) = (src.memory(), dst.memory()) else {
        panic!("both leases should be the device caches' own blocks")
    };
    let bpp = sp.spec().bytes_per_pos() as u64;
    let mut out = Vec::new();
    for layer in 0..sp.spec().num_layers {
        for kind in [KvKind::K, KvKind::V] {
            for b in 0..n.div_ceil(BLOCK_SIZE) {
                let len = (n - b * BLOCK_SIZE).min(BLOCK_SIZE) as u64;
                let at = |base: u64, blocks: &[BlockId]| {
                    base + blocks[b].0 as u64 * BLOCK_SIZE as u64 * bpp
                };
                out.push(CopyRun {
                    src: at(sp.base(layer, kind), src.blocks()),
                    dst: at(dp.base(layer, kind), dst.blocks()),
                    len: len * bpp,
                });
            }
        }
    }
    out
}

/// A prompt exported by one CUDA engine (chunked) and copied on the device into a second
/// engine's lent blocks decodes there exactly as on one engine.
#[test]
fn kv_handed_over_on_the_device_decodes_the_same() {
    for name in MODELS {
        let m = load(name);
        let vocab = m.config.vocab_size;
        let (_, gpu) = backends(&m, 64);
        let want = run_engine(gpu, vocab, greedy_requests(name, 12));
        let (p, d) = (cuda_engine(&m, 16), cuda_engine(&m, 2048));
        assert!(p.info.device_kv.is_some() && d.info.device_kv.is_some());
        for (req, want) in greedy_requests(name, 12).into_iter().zip(want) {
            let n = req.prompt.len();
            let mut first_req = req.clone();
            first_req.params.max_tokens = 1;
            let (mut psub, mut pev) = p.submit_export_on(first_req, 0, Handover::Device).unwrap();
            let Some(ExportEvent::Ready { lease: plo, .. }) = pev.blocking_recv() else {
                panic!("{name}: no Ready")
            };
            let first = match psub.events.blocking_recv() {
                Some(SeqEvent::Token { sampled, .. }) => sampled,
                other => panic!("{name}: {other:?}"),
            };
            psub.finished();
            let (mut dsub, dl) = d
                .submit_remote_prefill_on(req, 1, Handover::Device)
                .unwrap();
            let dlo = dl.blocking_recv().expect("a lease");
            let runs = runs(&plo, &dlo, n);
            let (KvMemory::Device(sp), KvMemory::Device(dp)) = (plo.memory(), dlo.memory()) else {
                unreachable!()
            };
            // SAFETY: the export is finished (its token arrived, so every layer is final),
            // and the decode side's blocks are lent to this copy until `landed`.
            unsafe { sp.copier().copy(&runs, dp.device()) }.expect("the device copy");
            drop(plo);
            dlo.landed(Landed {
                first,
                rng: None,
                cached_tokens: 0,
                state: None,
            });
            let got = tokens_to_end(name, &mut dsub);
            assert_eq!(got, want, "{name}: the device handover changed the tokens");
        }
        println!("{name}: KV handed over on the device decodes identically");
    }
}

/// tiny-llama on the GPU, chunks of 16 prompt tokens, 96 KV blocks: the nodes' engines and
/// their `kvmesh serve` reference.
fn small_cuda_engine(dir: &str) -> [&str; 8] {
    [
        "--model",
        dir,
        "--device",
        "cuda",
        "--max-num-batched-tokens",
        "16",
        "--num-kv-blocks",
        "96",
    ]
}

/// Waits until `node`'s router has the decode and the prefill role connected.
async fn routed(http: &reqwest::Client, node: &kvmesh_bench::harness::Proc) {
    kvmesh_bench::harness::wait_for("the router connected to both roles", 60, async || {
        node.try_metric(http, "kvmesh:router_workers_routable")
            .await
            == Some(1.0)
            && node
                .try_metric(http, "kvmesh:router_prefill_workers_connected")
                .await
                == Some(1.0)
    })
    .await;
}

/// Two greedy prompts through `node`'s gateway answer as `agg` (`kvmesh serve`) does.
async fn answers_as_serve(
    http: &reqwest::Client,
    agg: &common::Server,
    node: &kvmesh_bench::harness::Proc,
    ctx: &str,
) {
    let prompts = [
        "To be, or not to be, that is the question: whether 'tis nobler",
        "Now is the winter of our discontent made glorious summer by this sun of York",
    ];
    for p in prompts {
        let body = json!({"model": "tiny-llama", "prompt": p, "max_tokens": 12,
                          "temperature": 0, "ignore_eos": true});
        let (sa, a) = agg.post("/v1/completions", body.clone()).await;
        let r = http
            .post(format!("{}/v1/completions", node.http))
            .json(&body)
            .send()
            .await
            .expect("send");
        assert_eq!((sa, r.status().as_u16()), (200, 200));
        let s: Value = r.json().await.expect("json");
        assert_eq!(common::text_of(&s), common::text_of(&a), "{ctx}: {p}");
    }
}

/// `kvmesh node --no-etcd` with the prefill and decode roles on one GPU (whole, then split
/// by SMs): greedy answers equal `kvmesh serve --device cuda`'s, and every prompt's KV went
/// from one engine to the other on the device.
#[test]
fn a_node_with_both_roles_on_one_gpu_hands_kv_over_on_the_device() {
    use kvmesh_bench::harness::client;
    let dir = model_dir("tiny-llama");
    let engine = small_cuda_engine(dir.to_str().unwrap());
    let agg = common::Server::start(&engine);
    let rt = tokio::runtime::Runtime::new().unwrap();
    for split in [None, Some("0.5")] {
        let mut args = vec!["--roles", "gateway,router,prefill,decode"];
        args.extend([
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--disagg-min-tokens",
            "8",
        ]);
        args.extend(engine);
        if let Some(s) = split {
            args.extend(["--sm-split", s]);
        }
        let solo = common::kvmesh().node_alone("solo", &args);
        rt.block_on(async {
            let http = client();
            routed(&http, &solo).await;
            answers_as_serve(&http, &agg, &solo, &format!("{split:?}")).await;
            for (series, want) in [
                (
                    "kvmesh:kv_transfers_total{transport=\"in-process-device\"}",
                    2.0,
                ),
                ("kvmesh:kv_transfers_total{transport=\"in-process\"}", 0.0),
            ] {
                assert_eq!(
                    solo.metric(&http, series).await,
                    want,
                    "{split:?}: {series}"
                );
            }
        });
        println!("split {split:?}: both prompts handed over on the device, answers as serve's");
    }
}

/// A prefill node and a gateway + router + decode node of `engine`, finding each other
/// through a fresh registry directory (returned, to remove), each with its extra flags.
fn prefill_and_decode_nodes(
    tag: &str,
    engine: &[&str],
    prefill_flags: &[&str],
    decode_flags: &[&str],
) -> (
    std::path::PathBuf,
    kvmesh_bench::harness::Proc,
    kvmesh_bench::harness::Proc,
) {
    let reg = std::env::temp_dir().join(format!("kvmesh-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&reg);
    let mut pargs = vec!["--roles", "prefill"];
    pargs.extend(prefill_flags);
    pargs.extend(engine);
    let prefill = common::kvmesh().node_in_dir(&reg, "p", &pargs);
    let mut dargs = vec!["--roles", "gateway,router,decode"];
    dargs.extend(decode_flags);
    dargs.extend([
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--disagg-min-tokens",
        "8",
    ]);
    dargs.extend(engine);
    let decode = common::kvmesh().node_in_dir(&reg, "d", &dargs);
    (reg, prefill, decode)
}

/// Two `kvmesh node` processes on one GPU, finding each other through a registry
/// directory: the decode node exports its KV cache (`--kv-transport cuda-ipc`) and the
/// prefill node copies each prompt into it on the device. Greedy answers equal
/// `kvmesh serve --device cuda`'s and every prompt landed by CUDA IPC.
#[test]
fn two_processes_on_one_gpu_hand_kv_over_by_cuda_ipc() {
    use kvmesh_bench::harness::client;
    let dir = model_dir("tiny-llama");
    let engine = small_cuda_engine(dir.to_str().unwrap());
    let agg = common::Server::start(&engine);
    let (reg, prefill, decode) =
        prefill_and_decode_nodes("ipc", &engine, &[], &["--kv-transport", "cuda-ipc"]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let http = client();
        routed(&http, &decode).await;
        answers_as_serve(&http, &agg, &decode, "cuda-ipc").await;
        let series = "kvmesh:kv_transfers_total{transport=\"cuda-ipc\"}";
        assert_eq!(decode.metric(&http, series).await, 2.0, "{series}");
    });
    drop((prefill, decode));
    let _ = std::fs::remove_dir_all(&reg);
    println!("two processes on one GPU: both prompts copied by CUDA IPC, answers as serve's");
}

/// Two `kvmesh node` processes on one GPU with `--kv-transport ucx` and a UCX built with
/// CUDA (`KVMESH_UCX_LIB`: the device script unpacks PyPI's `libucx-cu13`): the decode
/// node registers its KV cache on the GPU with UCX and the prefill node puts each prompt
/// from its own cache on the GPU into it (UCX's `cuda_ipc` lane), with no host staging.
/// Greedy answers equal `kvmesh serve --device cuda`'s, and every prompt landed that way.
#[test]
fn two_processes_on_one_gpu_put_kv_with_ucx_from_gpu_to_gpu() {
    use kvmesh_bench::harness::client;
    let lib = std::env::var("KVMESH_UCX_LIB").unwrap_or_else(|_| {
        panic!(
            "KVMESH_UCX_LIB must name the libucp.so.0 of a UCX built with CUDA (PyPI's \
             libucx-cu13, which scripts/gpu_verify.sh unpacks); Debian's has no CUDA lanes"
        )
    });
    let dir = model_dir("tiny-llama");
    let engine = small_cuda_engine(dir.to_str().unwrap());
    let agg = common::Server::start(&engine);
    let ucx = [
        "--kv-transport",
        "ucx",
        "--ucx-tls",
        "tcp,cuda_copy,cuda_ipc",
    ];
    let (reg, prefill, decode) = prefill_and_decode_nodes("ucx-cuda", &engine, &ucx, &ucx);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let http = client();
        routed(&http, &decode).await;
        answers_as_serve(&http, &agg, &decode, &format!("UCX from {lib}")).await;
        for (series, want) in [
            ("kvmesh:kv_transfers_total{transport=\"ucx-device\"}", 2.0),
            ("kvmesh:kv_transfers_total{transport=\"ucx\"}", 0.0),
            ("kvmesh:disagg_prefills_total{outcome=\"fallback\"}", 0.0),
        ] {
            assert_eq!(decode.metric(&http, series).await, want, "{series}");
        }
    });
    drop((prefill, decode));
    let _ = std::fs::remove_dir_all(&reg);
    println!(
        "two processes on one GPU: both prompts put by UCX from GPU to GPU, answers as serve's"
    );
}
