//! UCX transfers between two UCX workers in this process, over the transports named by
//! `UCX_TLS`-style lists: `tcp` (loopback) and shared memory (`sm`: cma / posix).

use super::*;
use crate::kv::tests::region;
use crate::kv::KvRegion;

fn fill(mem: &mut [Vec<u8>]) {
    for (i, m) in mem.iter_mut().enumerate() {
        for (j, b) in m.iter_mut().enumerate() {
            *b = (i * 31 + j * 7 + 1) as u8;
        }
    }
}

fn start(tls: &str) -> Ucx {
    Ucx::start(&UcxOptions {
        tls: Some(tls.into()),
    })
    .unwrap_or_else(|e| panic!("UCX over {tls}: {e} (the test script installs libucx0)"))
}

/// A decode side: its pool registered, a landing over `dst_blocks`.
struct Decode {
    ucx: Ucx,
    reg: Registration,
    landing: Arc<Landing>,
}

async fn decode(
    tls: &str,
    dst: &mut [Vec<u8>],
    blocks: Vec<u32>,
    positions: std::ops::Range<usize>,
    id: u64,
) -> Decode {
    let ucx = start(tls);
    let bufs: Vec<(usize, usize)> = vec![0usize, 2, 1, 3]
        .into_iter()
        .map(|i| (dst[i].as_ptr() as usize, dst[i].len()))
        .collect();
    // SAFETY: the test keeps `dst` alive past the registration.
    let reg = unsafe { ucx.register(bufs, MemoryType::Host) }
        .await
        .unwrap();
    let landing = Arc::new(Landing::new(region(dst, blocks, positions), id));
    Decode { ucx, reg, landing }
}

/// The sender and receiver of one transfer, joined by in-memory notice streams.
fn pair(
    prefill: &Ucx,
    d: &Decode,
    src: Arc<KvRegion>,
    dest_blocks: Vec<u32>,
    lanes: usize,
    keys: Option<RemoteKeys>,
) -> (Result<UcxSender, TransportError>, UcxReceiver) {
    let (tx, rx) = mpsc::unbounded_channel();
    let mut streams = Vec::new();
    for _ in 0..lanes {
        let (w, r) = tokio::io::duplex(1 << 16);
        tx.send(Box::new(r) as KvInbound).unwrap();
        streams.push((NoticeStream::Other(Box::new(w)), Vec::new()));
    }
    let keys =
        keys.unwrap_or_else(|| remote_keys(&d.ucx.address(), d.reg.id, &wire_buffers(&d.reg)));
    let target = Target {
        source: src,
        transfer_id: d.landing.transfer_id,
        dest_blocks,
        span: tracing::Span::none(),
    };
    let send = UcxSender::start(prefill.clone(), target, keys, streams, true);
    (
        send,
        UcxReceiver::new(d.landing.clone(), rx, lanes, true, d.reg.id),
    )
}

async fn lands_every_byte_in_place(tls: &str) {
    let mut src = vec![vec![0u8; 6 * 4 * 8]; 4];
    fill(&mut src);
    let mut dst = vec![vec![0u8; 6 * 4 * 8]; 4];
    let (from, to) = (4, 14);
    let prefill = start(tls);
    let d = decode(tls, &mut dst, vec![3, 4, 0, 1], from..to, 77).await;
    let s = Arc::new(region(&mut src, vec![5, 1, 2, 0], from..to));
    let (send, mut recv) = pair(&prefill, &d, s, vec![3, 4, 0, 1], 2, None);
    let mut send = send.unwrap();
    let receiving = tokio::spawn(async move {
        let t = recv.complete().await;
        (t, recv.transport_layer())
    });
    send.send(0, 4, 5).await.unwrap();
    send.send(1, 4, 10).await.unwrap();
    send.send(0, 9, 5).await.unwrap();
    let sent = send.finish().await.unwrap();
    let (got, tl) = receiving.await.unwrap();
    let got = got.unwrap();
    assert_eq!(sent, got);
    assert_eq!(got.bytes, 2 * 2 * 10 * 8);
    assert_eq!(got.pieces, 3);
    let tl = tl.expect("the notices name UCX's transport");
    eprintln!("UCX over {tls}: transport layer {tl}");
    assert_ne!(tl, "unknown");
    let (sb, db) = ([5usize, 1, 2, 0], [3usize, 4, 0, 1]);
    for buf in 0..4 {
        for pos in 0..16 {
            let s = (sb[pos / 4] * 4 + pos % 4) * 8;
            let d = (db[pos / 4] * 4 + pos % 4) * 8;
            let want = if (from..to).contains(&pos) {
                &src[buf][s..s + 8]
            } else {
                &[0u8; 8][..]
            };
            assert_eq!(
                &dst[buf][d..d + 8],
                want,
                "{tls}: buffer {buf} position {pos}"
            );
        }
    }
    drop(d);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_lands_every_byte_in_place() {
    lands_every_byte_in_place("tcp").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_memory_lands_every_byte_in_place() {
    lands_every_byte_in_place("sm").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeat_or_a_gap_fails_the_transfer() {
    for (pieces, want) in [
        (vec![(0, 0, 4), (0, 0, 4)], "expected 4"),
        (vec![(0, 0, 4), (0, 6, 2)], "expected 4"),
    ] {
        let mut src = vec![vec![0u8; 4 * 4 * 8]; 4];
        fill(&mut src);
        let mut dst = vec![vec![0u8; 4 * 4 * 8]; 4];
        let prefill = start("tcp");
        let d = decode("tcp", &mut dst, vec![0, 1], 0..8, 5).await;
        let s = Arc::new(region(&mut src, vec![1, 0], 0..8));
        let (send, mut recv) = pair(&prefill, &d, s, vec![0, 1], 1, None);
        let mut send = send.unwrap();
        for (l, f, n) in pieces {
            send.send(l, f, n).await.unwrap();
        }
        let _ = send.finish().await;
        let e = recv.complete().await.unwrap_err().to_string();
        assert!(e.contains(want), "{e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_key_or_a_put_outside_the_registration_is_refused() {
    let mut src = vec![vec![0u8; 4 * 4 * 8]; 4];
    let mut dst = vec![vec![0u8; 8 * 4 * 8]; 4];
    let prefill = start("tcp");
    let d = decode("tcp", &mut dst, vec![0, 1], 0..8, 6).await;
    let s = Arc::new(region(&mut src, vec![0, 1], 0..8));
    // Garbage where the packed keys should be.
    let mut keys = remote_keys(&d.ucx.address(), 99, &wire_buffers(&d.reg));
    for b in &mut keys.buffers {
        b.rkey = vec![0xAB; b.rkey.len().max(8)];
    }
    let (send, mut recv) = pair(&prefill, &d, s.clone(), vec![0, 1], 1, Some(keys));
    let mut send = send.unwrap();
    send.send(0, 0, 8).await.unwrap();
    // UCX refuses the key (RDMA transports), or the decode side refuses the notices that
    // name a registration it did not give (transports that do not check keys, as TCP).
    match send.finish().await {
        Err(e) => assert!(e.to_string().contains("remote key"), "{e}"),
        Ok(_) => {
            let e = recv.complete().await.unwrap_err().to_string();
            assert!(e.contains("registration"), "{e}");
        }
    }
    // The decode side's blocks named beyond its registered buffers.
    let keys = remote_keys(&d.ucx.address(), d.reg.id, &wire_buffers(&d.reg));
    let (send, _recv) = pair(&prefill, &d, s.clone(), vec![0, 9], 1, Some(keys));
    let mut send = send.unwrap();
    send.send(0, 0, 8).await.unwrap();
    let e = send.finish().await.unwrap_err().to_string();
    assert!(e.contains("outside the peer's buffer"), "{e}");
    // Fewer buffers than the layers need.
    let mut keys = remote_keys(&d.ucx.address(), d.reg.id, &wire_buffers(&d.reg));
    keys.buffers.pop();
    let (send, _recv) = pair(&prefill, &d, s, vec![0, 1], 1, Some(keys));
    assert!(send
        .err()
        .unwrap()
        .to_string()
        .contains("registered 3 KV buffers"));
    assert!(
        dst.iter().all(|b| b.iter().all(|&x| x == 0)),
        "nothing was written"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_checksum_fails_the_landing() {
    let mut dst = vec![vec![0u8; 4 * 4 * 8]; 4];
    let landing = Arc::new(Landing::new(region(&mut dst, vec![0, 1], 0..8), 3));
    let notice = KvLandedNotice {
        piece: KvPiece {
            transfer_id: 3,
            layer: 0,
            first_pos: 0,
            num_pos: 8,
            blocks: vec![0, 1],
            bytes_per_pos: 8,
            payload_bytes: 128,
        },
        registration: 4,
        checksum: Some(1),
        tl: "tcp".into(),
    };
    let (mut w, r) = tokio::io::duplex(4096);
    w.write_all(&wire::frame(&notice).unwrap()).await.unwrap();
    drop(w);
    let mut r: KvInbound = Box::new(r);
    let e = read_notices(&mut r, landing.clone(), (true, 4), Arc::default())
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("checksum"), "{e}");
    assert_eq!(landing.landed_bytes(), 0);
}

/// The decode side in another process (this test binary, run as `child_decode`): its UCX
/// worker, its registered buffers, and their checksums on request.
struct Child {
    proc: std::process::Child,
    out: std::io::BufReader<std::process::ChildStdout>,
    keys: RemoteKeys,
}

const CHILD_LAYERS: usize = 2;

impl Child {
    fn spawn(tls: &str, bytes: usize) -> Child {
        use std::io::BufRead;
        #[allow(clippy::zombie_processes)] // waited for in `Drop`
        let mut proc = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "kv::ucx::tests::child_decode",
                "--ignored",
                "--nocapture",
            ])
            .env("KVMESH_UCX_CHILD", format!("{tls} {bytes}"))
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = std::io::BufReader::new(proc.stdout.take().unwrap());
        let mut line = String::new();
        loop {
            line.clear();
            assert_ne!(out.read_line(&mut line).unwrap(), 0, "the child ended");
            if let Some(rest) = line.strip_prefix("KEYS ") {
                let w: Vec<&str> = rest.split_whitespace().collect();
                let hex = |s: &str| {
                    (0..s.len())
                        .step_by(2)
                        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
                        .collect::<Vec<u8>>()
                };
                let buffers = w[2..]
                    .chunks(3)
                    .map(|c| RemoteBuffer {
                        base: c[0].parse().unwrap(),
                        len: c[1].parse().unwrap(),
                        rkey: hex(c[2]),
                    })
                    .collect();
                let keys = RemoteKeys {
                    peer: hex(w[0]).into(),
                    registration: w[1].parse().unwrap(),
                    buffers,
                };
                return Child { proc, out, keys };
            }
        }
    }

    /// The checksums of the child's buffers (K0, V0, K1, V1).
    fn sums(&mut self) -> Vec<u64> {
        use std::io::{BufRead, Write};
        let stdin = self.proc.stdin.as_mut().unwrap();
        writeln!(stdin, "SUM").unwrap();
        stdin.flush().unwrap();
        let mut line = String::new();
        self.out.read_line(&mut line).unwrap();
        line.trim()
            .strip_prefix("SUMS ")
            .unwrap()
            .split_whitespace()
            .map(|x| x.parse().unwrap())
            .collect()
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.proc.kill();
        let _ = self.proc.wait();
    }
}

/// Run by `Child::spawn` only.
#[test]
#[ignore]
fn child_decode() {
    use std::io::BufRead;
    let Ok(spec) = std::env::var("KVMESH_UCX_CHILD") else {
        return;
    };
    let (tls, bytes) = spec.split_once(' ').unwrap();
    let bytes: usize = bytes.parse().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let ucx = start(tls);
    let bufs: Vec<Vec<u8>> = (0..2 * CHILD_LAYERS).map(|_| vec![0u8; bytes]).collect();
    let spans = bufs
        .iter()
        .map(|b| (b.as_ptr() as usize, b.len()))
        .collect();
    // SAFETY: `bufs` outlives the registration (the process ends in this function).
    let reg = rt
        .block_on(unsafe { ucx.register(spans, MemoryType::Host) })
        .unwrap();
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let mut line = format!("KEYS {} {}", hex(&ucx.address()), reg.id);
    for b in &reg.buffers {
        line += &format!(" {} {} {}", b.base, b.len, hex(&b.rkey));
    }
    println!("{line}");
    for cmd in std::io::stdin().lock().lines() {
        if cmd.unwrap().trim() == "SUM" {
            let sums: Vec<String> = bufs
                .iter()
                .map(|b| {
                    let mut c = Checksum::default();
                    c.update(b);
                    c.finish().to_string()
                })
                .collect();
            println!("SUMS {}", sums.join(" "));
        }
    }
}

/// A sender to the child's buffers; positions `0..positions` in blocks of 4, 8-byte
/// positions, the child's blocks in reverse order of ours.
fn child_transfer(
    prefill: &Ucx,
    child: &Child,
    src: &mut [Vec<u8>],
    positions: usize,
) -> (UcxSender, Vec<u32>, KvInbound) {
    let blocks = positions / 4;
    let ours: Vec<u32> = (0..blocks as u32).collect();
    let theirs: Vec<u32> = ours.iter().rev().copied().collect();
    let s = Arc::new(region(src, ours, 0..positions));
    let (w, r) = tokio::io::duplex(1 << 20);
    let target = Target {
        source: s,
        transfer_id: 1,
        dest_blocks: theirs.clone(),
        span: tracing::Span::none(),
    };
    let send = UcxSender::start(
        prefill.clone(),
        target,
        child.keys.clone(),
        vec![(NoticeStream::Other(Box::new(w)), Vec::new())],
        false,
    )
    .unwrap();
    (send, theirs, Box::new(r))
}

async fn lands_in_another_process(tls: &str) {
    let positions = 64;
    let bytes = positions * 8;
    let mut src = vec![vec![0u8; bytes]; 4];
    fill(&mut src);
    let mut child = Child::spawn(tls, bytes);
    let prefill = start(tls);
    let (mut send, theirs, _notices) = child_transfer(&prefill, &child, &mut src, positions);
    for layer in 0..CHILD_LAYERS {
        send.send(layer, 0, 24).await.unwrap();
        send.send(layer, 24, 40).await.unwrap();
    }
    let t = send.finish().await.unwrap();
    assert_eq!(t.bytes as usize, 2 * CHILD_LAYERS * bytes);
    // What the child's buffers must hold: our block i in its block theirs[i]. The region's
    // buffers are K0, K1 then V0, V1; the child's registration is K0, V0, K1, V1.
    let want: Vec<u64> = [0usize, 2, 1, 3]
        .iter()
        .map(|&b| {
            let mut mirror = vec![0u8; bytes];
            for (i, &d) in theirs.iter().enumerate() {
                mirror[d as usize * 32..][..32].copy_from_slice(&src[b][i * 32..][..32]);
            }
            let mut c = Checksum::default();
            c.update(&mirror);
            c.finish()
        })
        .collect();
    let tl = prefill.transport_to(child.keys.peer.clone()).await.unwrap();
    eprintln!("UCX over {tls} between processes: transport layer {tl}");
    assert_eq!(child.sums(), want, "{tls}: the child's buffers");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_lands_in_another_process() {
    lands_in_another_process("tcp").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_memory_lands_in_another_process() {
    lands_in_another_process("sm").await;
}

/// The decode process is killed mid-transfer: the sender fails (UCX's peer error handling,
/// or the put deadline) instead of hanging, and nothing else in this process is hurt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_killed_mid_put_fails_the_sender() {
    for tls in ["tcp", "sm"] {
        let positions = 1 << 16; // 512 KiB per buffer
        let bytes = positions * 8;
        let mut src = vec![vec![0u8; bytes]; 4];
        fill(&mut src);
        let mut child = Child::spawn(tls, bytes);
        let prefill = start(tls);
        let (mut send, _, mut notices) = child_transfer(&prefill, &child, &mut src, positions);
        send.send(0, 0, 1024).await.unwrap();
        // The first piece has landed: the endpoint is up and in use.
        let first = wire::read_frame::<KvLandedNotice, _>(&mut notices)
            .await
            .unwrap();
        assert_eq!(first.unwrap().piece.num_pos, 1024);
        let _ = child.proc.kill();
        let _ = child.proc.wait();
        let started = std::time::Instant::now();
        let mut at = 1024;
        let mut failed = None;
        while at < positions && failed.is_none() {
            failed = send.send(0, at, 1024).await.err();
            at += 1024;
        }
        // The lane's error comes out of `send` (which then finishes) or out of `finish`.
        let e = match failed {
            Some(e) => e,
            None => {
                let r = tokio::time::timeout(std::time::Duration::from_secs(30), send.finish());
                r.await
                    .expect("the sender gives up within 30 s")
                    .unwrap_err()
            }
        }
        .to_string();
        eprintln!(
            "{tls}: the sender failed after {:.2} s: {e}",
            started.elapsed().as_secs_f64()
        );
        assert!(e.contains("UCX"), "{e}");
    }
}

#[test]
fn checksums_do_not_depend_on_how_the_bytes_are_split() {
    let bytes: Vec<u8> = (0..1000u32).map(|i| (i * 7 % 251) as u8).collect();
    let whole = {
        let mut c = Checksum::default();
        c.update(&bytes);
        c.finish()
    };
    for cuts in [vec![3, 500, 501], vec![8, 16, 999], vec![1, 2, 3, 4, 5]] {
        let mut c = Checksum::default();
        let mut at = 0;
        for cut in cuts {
            c.update(&bytes[at..cut]);
            at = cut;
        }
        c.update(&bytes[at..]);
        assert_eq!(c.finish(), whole);
    }
    let mut other = bytes.clone();
    other[999] ^= 1;
    let mut c = Checksum::default();
    c.update(&other);
    assert_ne!(c.finish(), whole);
}

/// A UCX without CUDA (Debian's) refuses a GPU's memory by name, before anything is put:
/// a sender whose source is device memory, a put that says its sources are, and binding a
/// GPU's context to the UCX thread. The library says whether it has CUDA.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ucx_without_cuda_refuses_device_memory_by_name() {
    let mut src = vec![vec![0u8; 4 * 4 * 8]; 4];
    fill(&mut src);
    let mut dst = vec![vec![0u8; 4 * 4 * 8]; 4];
    let prefill = start("tcp");
    assert!(
        !prefill.supports_cuda(),
        "Debian's UCX has no CUDA transports: {}",
        prefill.describe()
    );
    assert!(
        !prefill.describe().contains("CUDA"),
        "{}",
        prefill.describe()
    );
    let d = decode("tcp", &mut dst, vec![0, 1], 0..8, 9).await;
    let dev = crate::kv::tests::device(3);
    // SAFETY: host buffers standing for device memory, alive for the test.
    let s = Arc::new(unsafe { region(&mut src, vec![0, 1], 0..8).on_device(dev.clone()) });
    let (send, _recv) = pair(&prefill, &d, s, vec![0, 1], 1, None);
    match send {
        Err(TransportError::DeviceMemory { device: 3 }) => {}
        Err(e) => panic!("refused for another reason: {e}"),
        Ok(_) => panic!("a device region was accepted by a UCX without CUDA"),
    }
    let keys = Arc::new(remote_keys(
        &d.ucx.address(),
        d.reg.id,
        &wire_buffers(&d.reg),
    ));
    let op = PutOp {
        src: src[0].as_ptr() as usize,
        buffer: 0,
        dst: keys.buffers[0].base,
        len: 8,
    };
    // SAFETY: the source is a live host buffer (refused before it is read).
    let e = unsafe { prefill.put(keys, vec![op], MemoryType::Cuda, Box::new(())) }
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("no CUDA support"), "{e}");
    let e = prefill.bind(dev.clone()).await.unwrap_err().to_string();
    assert!(e.contains("libucx-cu13"), "{e}");
    assert!(dev.calls.lock().is_empty(), "nothing was copied");
    assert!(
        dst.iter().all(|b| b.iter().all(|&x| x == 0)),
        "nothing landed"
    );
}
