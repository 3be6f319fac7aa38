//! A node's UCX worker: one thread owns the UCP context, the worker, the endpoints (one per
//! peer, cached) and the memory registrations, and drives UCX's progress. Other threads talk
//! to it through commands, each answered on a oneshot channel.
//!
//! The thread never spins while idle: it arms the worker and sleeps in `poll` on UCX's event
//! descriptor and on its own command eventfd. While puts are in flight it polls with a 1 ms
//! cap, so a transport that raises no event for a completion is still progressed.

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::oneshot;

use super::error::UcxError;
use super::ffi::{self, Ucp};

/// Where registered memory lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryType {
    Host,
    /// CUDA device memory (`UCS_MEMORY_TYPE_CUDA`): with GPUDirect RDMA, puts go from GPU
    /// to GPU without host staging.
    Cuda,
}

impl MemoryType {
    /// UCX's `ucs_memory_type_t`.
    fn ucs(self) -> u32 {
        match self {
            MemoryType::Host => ffi::UCS_MEMORY_TYPE_HOST,
            MemoryType::Cuda => ffi::UCS_MEMORY_TYPE_CUDA,
        }
    }
}

/// How to start UCX.
#[derive(Clone, Debug, Default)]
pub struct UcxOptions {
    /// The transports UCX may use (as `UCX_TLS`: `tcp`, `sm`, `posix,cma`, `rc`, ...);
    /// `None` leaves UCX's own configuration (its environment) in charge.
    pub tls: Option<String>,
}

/// One registered buffer as a peer addresses it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteBuffer {
    pub base: u64,
    pub len: u64,
    /// The packed remote key (`ucp_rkey_pack`).
    pub rkey: Vec<u8>,
}

/// A peer's registered memory: its worker address, the registration and its buffers.
#[derive(Clone, Debug)]
pub struct RemoteKeys {
    pub peer: Arc<[u8]>,
    pub registration: u64,
    pub buffers: Vec<RemoteBuffer>,
}

/// A registration of this node's memory; unregistered when the last clone is dropped.
pub struct Registration {
    pub id: u64,
    pub buffers: Vec<RemoteBuffer>,
    ucx: Ucx,
}

impl Drop for Registration {
    fn drop(&mut self) {
        let _ = self.ucx.command(Cmd::Unregister(self.id));
    }
}

/// One put: `len` bytes from local `src` to `dst` inside the peer's buffer `buffer`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PutOp {
    pub src: usize,
    pub buffer: u32,
    pub dst: u64,
    pub len: usize,
}

type Reply<T> = oneshot::Sender<Result<T, UcxError>>;
type Keep = Box<dyn std::any::Any + Send>;

enum Cmd {
    Register(
        Vec<(usize, usize)>,
        MemoryType,
        Reply<(u64, Vec<RemoteBuffer>)>,
    ),
    Unregister(u64),
    /// Puts from memory of the given type, then a flush of the endpoint; the reply comes
    /// when the flush completes. `Keep` holds the source memory alive until then.
    Put(Arc<RemoteKeys>, Vec<PutOp>, MemoryType, Keep, Reply<()>),
    Transport(Arc<[u8]>, Reply<String>),
    /// Makes a GPU's context current on the UCX thread.
    Bind(Arc<dyn crate::kv::DeviceCopy>, Reply<()>),
    Stop,
}

/// A handle on the node's UCX thread.
#[derive(Clone)]
pub struct Ucx {
    shared: Arc<Shared>,
}

struct Shared {
    tx: Mutex<mpsc::Sender<Cmd>>,
    wake: i32,
    address: Arc<[u8]>,
    cuda: bool,
    version: (u32, u32, u32),
    tls: String,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        let _ = self.tx.lock().send(Cmd::Stop);
        wake(self.wake);
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
        // SAFETY: the thread that polled it has ended; nothing else uses the fd.
        unsafe { libc::close(self.wake) };
    }
}

fn wake(fd: i32) {
    let one: u64 = 1;
    // SAFETY: an eventfd takes 8-byte writes.
    unsafe { libc::write(fd, &one as *const u64 as *const c_void, 8) };
}

impl Ucx {
    /// Loads UCX, creates a context (RMA, wakeup) and a worker on a thread of their own.
    /// Fails with a message naming what to install when the library is missing.
    pub fn start(opts: &UcxOptions) -> Result<Ucx, UcxError> {
        let ucp = Arc::new(Ucp::load()?);
        // SAFETY: plain eventfd creation.
        let wake_fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if wake_fd < 0 {
            return Err(UcxError::Os {
                what: "eventfd",
                source: std::io::Error::last_os_error(),
            });
        }
        let (tx, rx) = mpsc::channel();
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
        let tls = opts.tls.clone();
        let thread = std::thread::Builder::new()
            .name("kvmesh-ucx".into())
            .spawn(move || match State::open(ucp, tls.as_deref()) {
                Ok(mut st) => {
                    let _ = ready_tx.send(Ok((st.address.clone(), st.cuda, st.version)));
                    st.run(rx, wake_fd);
                    st.close();
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            })
            .map_err(|e| UcxError::Os {
                what: "starting the UCX thread",
                source: e,
            })?;
        let (address, cuda, version) = match ready_rx.recv() {
            Ok(Ok(x)) => x,
            Ok(Err(e)) => {
                let _ = thread.join();
                // SAFETY: unused from here on.
                unsafe { libc::close(wake_fd) };
                return Err(e);
            }
            Err(_) => return Err(UcxError::Thread("the UCX thread ended while starting")),
        };
        Ok(Ucx {
            shared: Arc::new(Shared {
                tx: Mutex::new(tx),
                wake: wake_fd,
                address,
                cuda,
                version,
                tls: opts.tls.clone().unwrap_or_default(),
                thread: Mutex::new(Some(thread)),
            }),
        })
    }

    /// This worker's address, for peers to connect to.
    pub fn address(&self) -> Arc<[u8]> {
        self.shared.address.clone()
    }

    /// Whether UCX here can register CUDA memory.
    pub fn supports_cuda(&self) -> bool {
        self.shared.cuda
    }

    /// The library's version and the transports asked for, for logs and status.
    pub fn describe(&self) -> String {
        let (a, b, c) = self.shared.version;
        let cuda = if self.shared.cuda { ", with CUDA" } else { "" };
        match self.shared.tls.as_str() {
            "" => format!("UCX {a}.{b}.{c}{cuda}"),
            t => format!("UCX {a}.{b}.{c} (transports {t}){cuda}"),
        }
    }

    fn command(&self, c: Cmd) -> Result<(), UcxError> {
        self.shared
            .tx
            .lock()
            .send(c)
            .map_err(|_| UcxError::Thread("the UCX thread has stopped"))?;
        wake(self.shared.wake);
        Ok(())
    }

    async fn ask<T>(&self, make: impl FnOnce(Reply<T>) -> Cmd) -> Result<T, UcxError> {
        let (tx, rx) = oneshot::channel();
        self.command(make(tx))?;
        rx.await
            .map_err(|_| UcxError::Thread("the UCX thread dropped the request"))?
    }

    /// Registers memory (`ucp_mem_map`) and packs a remote key for each buffer.
    ///
    /// # Safety
    /// Each `(address, length)` must stay allocated while the registration lives, and be
    /// memory of `mem`'s type.
    pub async unsafe fn register(
        &self,
        buffers: Vec<(usize, usize)>,
        mem: MemoryType,
    ) -> Result<Registration, UcxError> {
        let (id, buffers) = self.ask(|r| Cmd::Register(buffers, mem, r)).await?;
        Ok(Registration {
            id,
            buffers,
            ucx: self.clone(),
        })
    }

    /// Puts every op into the peer's memory, then flushes: resolves once all have landed
    /// remotely (or failed). `keep` is dropped only after UCX is done with the sources.
    ///
    /// # Safety
    /// Every `src .. src + len` must be readable while `keep` lives, and be memory of type
    /// `src_mem`.
    pub async unsafe fn put(
        &self,
        keys: Arc<RemoteKeys>,
        ops: Vec<PutOp>,
        src_mem: MemoryType,
        keep: Keep,
    ) -> Result<(), UcxError> {
        if src_mem == MemoryType::Cuda && !self.supports_cuda() {
            return Err(UcxError::Invalid(
                "a put from GPU memory, which this UCX build cannot read (it has no CUDA support)"
                    .into(),
            ));
        }
        for op in &ops {
            let b = keys.buffers.get(op.buffer as usize).ok_or_else(|| {
                UcxError::Invalid(format!(
                    "a put names buffer {} of a registration with {}",
                    op.buffer,
                    keys.buffers.len()
                ))
            })?;
            let inside = op.dst >= b.base
                && (op.dst - b.base)
                    .checked_add(op.len as u64)
                    .is_some_and(|end| end <= b.len);
            if !inside {
                return Err(UcxError::Invalid(format!(
                    "a put of {} bytes at {:#x} falls outside the peer's buffer {} ({:#x}, {} bytes)",
                    op.len, op.dst, op.buffer, b.base, b.len
                )));
            }
        }
        self.ask(|r| Cmd::Put(keys, ops, src_mem, keep, r)).await
    }

    /// Makes the GPU context of `copy`'s device current on the UCX thread: UCX's CUDA
    /// transports register and read device memory in the calling thread's context.
    pub async fn bind(&self, copy: Arc<dyn crate::kv::DeviceCopy>) -> Result<(), UcxError> {
        if !self.supports_cuda() {
            return Err(UcxError::Invalid(
                "this UCX build has no CUDA support (libucx-cu13 from PyPI has it; \
                 KVMESH_UCX_LIB names its libucp.so.0)"
                    .into(),
            ));
        }
        self.ask(|r| Cmd::Bind(copy, r)).await
    }

    /// The transport layers UCX chose for RMA to `peer` (`tcp`, `cma`, `rc_mlx5`, ...).
    pub async fn transport_to(&self, peer: Arc<[u8]>) -> Result<String, UcxError> {
        self.ask(|r| Cmd::Transport(peer, r)).await
    }
}

/// A completion UCX reports through a callback.
struct Pending {
    ucp: Arc<Ucp>,
    reply: Option<Reply<()>>,
    _keep: Keep,
    count: Arc<AtomicUsize>,
}

unsafe extern "C" fn flush_done(
    request: *mut c_void,
    status: ffi::ucs_status_t,
    user: *mut c_void,
) {
    // SAFETY: `user` is the `Box<Pending>` leaked when the flush was posted; UCX calls this
    // once.
    let p = unsafe { Box::from_raw(user as *mut Pending) };
    let r = p.ucp.check(status, "UCX flush");
    if let Some(reply) = p.reply {
        let _ = reply.send(r);
    }
    p.count.fetch_sub(1, Ordering::Relaxed);
    // SAFETY: a request handed to a callback is ours to free.
    unsafe { (p.ucp.ucp_request_free)(request) };
}

unsafe extern "C" fn ep_failed(arg: *mut c_void, _ep: ffi::Ep, status: ffi::ucs_status_t) {
    // SAFETY: `arg` is the peer's boxed flag, alive until its endpoint is closed.
    let flag = unsafe { &*(arg as *const Cell<Option<ffi::ucs_status_t>>) };
    flag.set(Some(status));
}

struct Peer {
    ep: ffi::Ep,
    failed: Box<Cell<Option<ffi::ucs_status_t>>>,
    rkeys: HashMap<u64, Vec<ffi::RKey>>,
}

/// The UCX thread's own state.
struct State {
    ucp: Arc<Ucp>,
    ctx: ffi::Context,
    worker: ffi::Worker,
    efd: i32,
    address: Arc<[u8]>,
    cuda: bool,
    version: (u32, u32, u32),
    peers: HashMap<Arc<[u8]>, Peer>,
    /// Peers whose endpoint failed: never dialed again (a restarted peer has a new address).
    dead: std::collections::VecDeque<Arc<[u8]>>,
    regs: HashMap<u64, Vec<ffi::MemH>>,
    in_flight: Arc<AtomicUsize>,
}

impl State {
    fn open(ucp: Arc<Ucp>, tls: Option<&str>) -> Result<State, UcxError> {
        let u = &*ucp;
        let mut cfg: ffi::Config = std::ptr::null_mut();
        // SAFETY: out-parameter; null prefix and file mean UCX's defaults and environment.
        u.check(
            unsafe { (u.ucp_config_read)(std::ptr::null(), std::ptr::null(), &mut cfg) },
            "reading UCX's configuration",
        )?;
        if let Some(t) = tls {
            let (k, v) = (
                CString::new("TLS").unwrap(),
                CString::new(t)
                    .map_err(|e| UcxError::Invalid(format!("UCX transports '{t}': {e}")))?,
            );
            // SAFETY: a live config and two C strings.
            let s = unsafe { (u.ucp_config_modify)(cfg, k.as_ptr(), v.as_ptr()) };
            if s != ffi::UCS_OK {
                // SAFETY: read above.
                unsafe { (u.ucp_config_release)(cfg) };
                return Err(u.error(s, &format!("UCX transports '{t}'")));
            }
        }
        let name = CString::new("kvmesh").unwrap();
        let params = ffi::Params {
            field_mask: ffi::UCP_PARAM_FIELD_FEATURES | ffi::UCP_PARAM_FIELD_NAME,
            features: ffi::UCP_FEATURE_RMA | ffi::UCP_FEATURE_WAKEUP,
            request_size: 0,
            request_init: std::ptr::null(),
            request_cleanup: std::ptr::null(),
            tag_sender_mask: 0,
            mt_workers_shared: 0,
            estimated_num_eps: 0,
            estimated_num_ppn: 0,
            name: name.as_ptr(),
        };
        let mut ctx: ffi::Context = std::ptr::null_mut();
        // SAFETY: valid params and config; the API version this module is written against.
        let s = unsafe { (u.ucp_init_version)(1, 13, &params, cfg, &mut ctx) };
        // SAFETY: the context keeps what it needs of the config.
        unsafe { (u.ucp_config_release)(cfg) };
        u.check(s, "creating a UCX context")?;
        let mut attr = ffi::ContextAttr {
            field_mask: ffi::UCP_ATTR_FIELD_MEMORY_TYPES,
            request_size: 0,
            thread_mode: 0,
            memory_types: 0,
            name: [0; 32],
        };
        // SAFETY: live context, out-parameter.
        let cuda = unsafe { (u.ucp_context_query)(ctx, &mut attr) } == ffi::UCS_OK
            && attr.memory_types & (1 << ffi::UCS_MEMORY_TYPE_CUDA) != 0;
        let wp = ffi::WorkerParams {
            field_mask: ffi::UCP_WORKER_PARAM_FIELD_THREAD_MODE
                | ffi::UCP_WORKER_PARAM_FIELD_EVENTS,
            thread_mode: ffi::UCS_THREAD_MODE_SINGLE,
            cpu_mask: [0; 16],
            events: ffi::UCP_WAKEUP_RMA | ffi::UCP_WAKEUP_TX | ffi::UCP_WAKEUP_RX,
            user_data: std::ptr::null_mut(),
            event_fd: 0,
            flags: 0,
            name: std::ptr::null(),
            am_alignment: 0,
            client_id: 0,
        };
        let mut worker: ffi::Worker = std::ptr::null_mut();
        // SAFETY: live context, valid params.
        let s = unsafe { (u.ucp_worker_create)(ctx, &wp, &mut worker) };
        if s != ffi::UCS_OK {
            // SAFETY: created above, nothing else holds it.
            unsafe { (u.ucp_cleanup)(ctx) };
            return Err(u.error(s, "creating a UCX worker"));
        }
        let fail = |e: UcxError| {
            // SAFETY: created above, nothing else holds them.
            unsafe {
                (u.ucp_worker_destroy)(worker);
                (u.ucp_cleanup)(ctx);
            }
            Err(e)
        };
        let mut efd = -1;
        // SAFETY: live worker created with the wakeup feature.
        if let Err(e) = u.check(
            unsafe { (u.ucp_worker_get_efd)(worker, &mut efd) },
            "UCX event fd",
        ) {
            return fail(e);
        }
        let (mut addr, mut len) = (std::ptr::null_mut(), 0usize);
        // SAFETY: live worker, out-parameters.
        if let Err(e) = u.check(
            unsafe { (u.ucp_worker_get_address)(worker, &mut addr, &mut len) },
            "UCX worker address",
        ) {
            return fail(e);
        }
        // SAFETY: UCX returned `len` bytes at `addr`, released right after the copy.
        let address: Arc<[u8]> =
            unsafe { std::slice::from_raw_parts(addr as *const u8, len) }.into();
        // SAFETY: the address came from this worker.
        unsafe { (u.ucp_worker_release_address)(worker, addr) };
        let version = ucp.version();
        Ok(State {
            ucp,
            ctx,
            worker,
            efd,
            address,
            cuda,
            version,
            peers: HashMap::new(),
            dead: Default::default(),
            regs: HashMap::new(),
            in_flight: Arc::new(AtomicUsize::new(0)),
        })
    }

    fn run(&mut self, rx: mpsc::Receiver<Cmd>, wake_fd: i32) {
        let mut stopping: Option<Instant> = None;
        loop {
            let mut buf = 0u64;
            // SAFETY: draining an eventfd into 8 bytes (EAGAIN when empty is fine).
            unsafe { libc::read(wake_fd, &mut buf as *mut u64 as *mut c_void, 8) };
            loop {
                match rx.try_recv() {
                    Ok(Cmd::Stop) | Err(mpsc::TryRecvError::Disconnected) => {
                        stopping.get_or_insert_with(Instant::now);
                        break;
                    }
                    Ok(c) => self.handle(c),
                    Err(mpsc::TryRecvError::Empty) => break,
                }
            }
            let busy = self.in_flight.load(Ordering::Relaxed) > 0;
            if let Some(t) = stopping {
                if !busy || t.elapsed() > Duration::from_secs(2) {
                    return;
                }
            }
            // SAFETY: this thread owns the worker.
            let n = unsafe { (self.ucp.ucp_worker_progress)(self.worker) };
            self.reap_failed();
            if n > 0 {
                continue;
            }
            // SAFETY: as above.
            let armed = unsafe { (self.ucp.ucp_worker_arm)(self.worker) };
            if armed == ffi::UCS_ERR_BUSY {
                continue;
            }
            let mut fds = [
                libc::pollfd {
                    fd: self.efd,
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: wake_fd,
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            let timeout = if busy || stopping.is_some() { 1 } else { 200 };
            // SAFETY: two valid pollfds.
            unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout) };
        }
    }

    fn handle(&mut self, c: Cmd) {
        match c {
            Cmd::Register(bufs, mem, reply) => {
                let _ = reply.send(self.register(&bufs, mem));
            }
            Cmd::Unregister(id) => {
                for m in self.regs.remove(&id).unwrap_or_default() {
                    // SAFETY: mapped by this context, no longer named by anyone.
                    unsafe { (self.ucp.ucp_mem_unmap)(self.ctx, m) };
                }
            }
            Cmd::Put(keys, ops, mem, keep, reply) => self.put(&keys, &ops, mem, keep, reply),
            Cmd::Transport(peer, reply) => {
                let _ = reply.send(self.transport(&peer));
            }
            Cmd::Bind(copy, reply) => {
                let _ = reply.send(copy.bind_thread().map_err(|e| {
                    UcxError::Invalid(format!("making the GPU's context current for UCX: {e}"))
                }));
            }
            Cmd::Stop => {}
        }
    }

    fn register(
        &mut self,
        bufs: &[(usize, usize)],
        mem: MemoryType,
    ) -> Result<(u64, Vec<RemoteBuffer>), UcxError> {
        let u = self.ucp.clone();
        let mut handles = Vec::new();
        let mut out = Vec::new();
        let mut result = Ok(());
        for &(addr, len) in bufs {
            let p = ffi::MemMapParams {
                field_mask: ffi::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                    | ffi::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                    | ffi::UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE,
                address: addr as *mut c_void,
                length: len,
                flags: 0,
                prot: 0,
                memory_type: mem.ucs(),
            };
            let mut memh: ffi::MemH = std::ptr::null_mut();
            // SAFETY: the caller's contract: the memory stays allocated while registered.
            if let Err(e) = u.check(
                unsafe { (u.ucp_mem_map)(self.ctx, &p, &mut memh) },
                "registering KV memory with UCX",
            ) {
                result = Err(e);
                break;
            }
            handles.push(memh);
            let (mut rb, mut rlen) = (std::ptr::null_mut(), 0usize);
            // SAFETY: a handle of this context; out-parameters.
            if let Err(e) = u.check(
                unsafe { (u.ucp_rkey_pack)(self.ctx, memh, &mut rb, &mut rlen) },
                "packing a UCX remote key",
            ) {
                result = Err(e);
                break;
            }
            // SAFETY: UCX returned `rlen` bytes at `rb`, released right after the copy.
            let rkey = unsafe { std::slice::from_raw_parts(rb as *const u8, rlen) }.to_vec();
            unsafe { (u.ucp_rkey_buffer_release)(rb) };
            out.push(RemoteBuffer {
                base: addr as u64,
                len: len as u64,
                rkey,
            });
        }
        if let Err(e) = result {
            for m in handles {
                // SAFETY: mapped just above.
                unsafe { (u.ucp_mem_unmap)(self.ctx, m) };
            }
            return Err(e);
        }
        let id = crate::kv::random_u64();
        self.regs.insert(id, handles);
        Ok((id, out))
    }

    /// The endpoint to a peer, made (and cached) on first use. UCX's peer error handling is
    /// asked for, so a peer that dies fails the endpoint; where the transports to that peer
    /// cannot detect a failure (UCX 1.13's posix and sysv shared memory), the endpoint is
    /// made without it, and a stalled flush is caught by the sender's deadline instead.
    fn endpoint(&mut self, peer: &Arc<[u8]>) -> Result<&mut Peer, UcxError> {
        if self.dead.contains(peer) {
            return Err(UcxError::PeerGone);
        }
        if !self.peers.contains_key(peer) {
            let failed = Box::new(Cell::new(None));
            let mut made = Err(UcxError::Thread("no endpoint mode was tried"));
            for mode in [
                ffi::UCP_ERR_HANDLING_MODE_PEER,
                ffi::UCP_ERR_HANDLING_MODE_NONE,
            ] {
                let p = ffi::EpParams {
                    field_mask: ffi::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                        | ffi::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                        | ffi::UCP_EP_PARAM_FIELD_ERR_HANDLER,
                    address: peer.as_ptr() as *const c_void,
                    err_mode: mode,
                    err_handler_cb: Some(ep_failed),
                    err_handler_arg: &*failed as *const Cell<_> as *mut c_void,
                    user_data: std::ptr::null_mut(),
                    flags: 0,
                    sockaddr: std::ptr::null(),
                    sockaddr_len: 0,
                    conn_request: std::ptr::null_mut(),
                    name: std::ptr::null(),
                    local_sockaddr: std::ptr::null(),
                    local_sockaddr_len: 0,
                };
                let mut ep: ffi::Ep = std::ptr::null_mut();
                // SAFETY: a live worker; the address bytes are a peer worker's (UCX checks
                // them).
                let s = unsafe { (self.ucp.ucp_ep_create)(self.worker, &p, &mut ep) };
                made = self
                    .ucp
                    .check(s, "connecting to the peer's UCX worker")
                    .map(|()| (ep, mode));
                if made.is_ok() {
                    break;
                }
            }
            let (ep, mode) = made?;
            if mode == ffi::UCP_ERR_HANDLING_MODE_NONE {
                tracing::info!(
                    "UCX: the transports to a peer cannot report its failure; its transfers \
                     rely on the KV timeouts"
                );
            }
            self.peers.insert(
                peer.clone(),
                Peer {
                    ep,
                    failed,
                    rkeys: HashMap::new(),
                },
            );
        }
        Ok(self.peers.get_mut(peer).expect("inserted"))
    }

    fn put(
        &mut self,
        keys: &RemoteKeys,
        ops: &[PutOp],
        src_mem: MemoryType,
        keep: Keep,
        reply: Reply<()>,
    ) {
        let ucp = self.ucp.clone();
        let count = self.in_flight.clone();
        let r = (|| -> Result<ffi::Ep, UcxError> {
            let peer = self.endpoint(&keys.peer)?;
            if let Some(s) = peer.failed.get() {
                return Err(ucp.error(s, "the peer's UCX endpoint failed"));
            }
            let ep = peer.ep;
            if let std::collections::hash_map::Entry::Vacant(slot) =
                peer.rkeys.entry(keys.registration)
            {
                let mut unpacked = Vec::new();
                for b in &keys.buffers {
                    let mut rk: ffi::RKey = std::ptr::null_mut();
                    // SAFETY: a live endpoint; UCX parses (and checks) the packed key.
                    let s = unsafe {
                        (ucp.ucp_ep_rkey_unpack)(ep, b.rkey.as_ptr() as *const c_void, &mut rk)
                    };
                    if s != ffi::UCS_OK {
                        for rk in unpacked {
                            // SAFETY: unpacked just above.
                            unsafe { (ucp.ucp_rkey_destroy)(rk) };
                        }
                        return Err(ucp.error(s, "the peer's remote key could not be unpacked"));
                    }
                    unpacked.push(rk);
                }
                slot.insert(unpacked);
            }
            let rkeys = &peer.rkeys[&keys.registration];
            // The sources' memory type, said rather than left for UCX to detect.
            let mut src = ffi::RequestParam::empty();
            src.op_attr_mask = ffi::UCP_OP_ATTR_FIELD_MEMORY_TYPE;
            src.memory_type = src_mem.ucs();
            for op in ops {
                // SAFETY: the caller's contract covers the source; `put` checked the
                // destination lies inside the peer's registered buffer.
                let st = unsafe {
                    (ucp.ucp_put_nbx)(
                        ep,
                        op.src as *const c_void,
                        op.len,
                        op.dst,
                        rkeys[op.buffer as usize],
                        &src,
                    )
                };
                if let Some(s) = ffi::ptr_status(st) {
                    return Err(ucp.error(s, "UCX put"));
                }
                if !st.is_null() {
                    // SAFETY: a request still in flight is released when it completes.
                    unsafe { (ucp.ucp_request_free)(st) };
                }
            }
            Ok(ep)
        })();
        let ep = match r {
            Ok(ep) => ep,
            Err(e) => {
                let _ = reply.send(Err(e));
                return;
            }
        };
        let pending = Box::into_raw(Box::new(Pending {
            ucp: ucp.clone(),
            reply: Some(reply),
            _keep: keep,
            count: count.clone(),
        }));
        let mut param = ffi::RequestParam::empty();
        param.op_attr_mask = ffi::UCP_OP_ATTR_FIELD_CALLBACK | ffi::UCP_OP_ATTR_FIELD_USER_DATA;
        param.cb = Some(flush_done);
        param.user_data = pending as *mut c_void;
        count.fetch_add(1, Ordering::Relaxed);
        // SAFETY: a live endpoint; the callback owns `pending` if a request is returned.
        let st = unsafe { (ucp.ucp_ep_flush_nbx)(ep, &param) };
        if st.is_null() || ffi::ptr_status(st).is_some() {
            // Done (or failed) at once: the callback will not run.
            // SAFETY: not handed to UCX.
            let p = unsafe { Box::from_raw(pending) };
            count.fetch_sub(1, Ordering::Relaxed);
            let r = match ffi::ptr_status(st) {
                Some(s) => Err(ucp.error(s, "UCX flush")),
                None => Ok(()),
            };
            if let Some(reply) = p.reply {
                let _ = reply.send(r);
            }
        }
    }

    fn transport(&mut self, peer: &Arc<[u8]>) -> Result<String, UcxError> {
        let ucp = self.ucp.clone();
        let ep = self.endpoint(peer)?.ep;
        let (mut buf, mut len): (*mut libc::c_char, usize) = (std::ptr::null_mut(), 0);
        // SAFETY: a memory stream over a buffer libc allocates; freed below.
        let f = unsafe { libc::open_memstream(&mut buf, &mut len) };
        if f.is_null() {
            return Err(UcxError::Os {
                what: "open_memstream",
                source: std::io::Error::last_os_error(),
            });
        }
        // SAFETY: a live endpoint and an open stream.
        unsafe {
            (ucp.ucp_ep_print_info)(ep, f);
            libc::fclose(f);
        }
        // SAFETY: after fclose, `buf` holds `len` bytes (and a NUL), ours to free.
        let text = unsafe { std::slice::from_raw_parts(buf as *const u8, len) };
        let out = String::from_utf8_lossy(text).into_owned();
        unsafe { libc::free(buf as *mut c_void) };
        Ok(rma_transports(&out))
    }

    /// Closes the endpoints UCX reported failed; the next put to such a peer connects anew.
    fn reap_failed(&mut self) {
        let dead: Vec<Arc<[u8]>> = self
            .peers
            .iter()
            .filter(|(_, p)| p.failed.get().is_some())
            .map(|(k, _)| k.clone())
            .collect();
        for k in dead {
            if self.dead.len() >= 1024 {
                self.dead.pop_front();
            }
            self.dead.push_back(k.clone());
            if let Some(p) = self.peers.remove(&k) {
                tracing::warn!(
                    "a UCX peer failed: {}",
                    self.ucp.status(p.failed.get().unwrap_or(0))
                );
                self.close_peer(p);
            }
        }
    }

    fn close_peer(&mut self, p: Peer) {
        let u = self.ucp.clone();
        for rk in p.rkeys.into_values().flatten() {
            // SAFETY: unpacked on this endpoint, used by no request any more (flushes done
            // or the endpoint failed).
            unsafe { (u.ucp_rkey_destroy)(rk) };
        }
        let mut param = ffi::RequestParam::empty();
        param.op_attr_mask = ffi::UCP_OP_ATTR_FIELD_FLAGS;
        param.flags = ffi::UCP_EP_CLOSE_FLAG_FORCE;
        // SAFETY: a live endpoint, closed once.
        let st = unsafe { (u.ucp_ep_close_nbx)(p.ep, &param) };
        if !st.is_null() && ffi::ptr_status(st).is_none() {
            let until = Instant::now() + Duration::from_secs(1);
            // SAFETY: the close request, progressed on this (the owning) thread.
            while unsafe { (u.ucp_request_check_status)(st) } == ffi::UCS_INPROGRESS
                && Instant::now() < until
            {
                unsafe { (u.ucp_worker_progress)(self.worker) };
            }
            unsafe { (u.ucp_request_free)(st) };
        }
        drop(p.failed);
    }

    fn close(mut self) {
        let peers: Vec<Peer> = self.peers.drain().map(|(_, p)| p).collect();
        for p in peers {
            self.close_peer(p);
        }
        for m in std::mem::take(&mut self.regs).into_values().flatten() {
            // SAFETY: mapped by this context.
            unsafe { (self.ucp.ucp_mem_unmap)(self.ctx, m) };
        }
        // SAFETY: everything made from them is gone.
        unsafe {
            (self.ucp.ucp_worker_destroy)(self.worker);
            (self.ucp.ucp_cleanup)(self.ctx);
        }
    }
}

/// The transport layers of the RMA lanes in `ucp_ep_print_info`'s text: lines such as
/// `#   lane[1]:  2:cma/memory.0 md[2] -> ... rma_bw#0` give `cma`.
fn rma_transports(info: &str) -> String {
    let mut names: Vec<String> = Vec::new();
    let mut all: Vec<String> = Vec::new();
    for line in info.lines().filter(|l| l.contains("lane[")) {
        let Some(tl) = line
            .split_whitespace()
            .find_map(|w| {
                w.split_once(':')
                    .map(|(_, r)| r)
                    .filter(|r| r.contains('/'))
            })
            .and_then(|r| r.split('/').next())
        else {
            continue;
        };
        let list = if line.contains("rma") {
            &mut names
        } else {
            &mut all
        };
        if !list.iter().any(|n| n == tl) {
            list.push(tl.to_string());
        }
    }
    if names.is_empty() {
        names = all;
    }
    if names.is_empty() {
        "unknown".into()
    } else {
        names.join("+")
    }
}

#[cfg(test)]
mod tests {
    use super::rma_transports;

    #[test]
    fn rma_lanes_name_their_transport() {
        let info = "#\n# UCP endpoint\n#\n#   lane[0]:  1:tcp/lo.0 md[1]  -> md[1]/tcp/sysdev[255] am am_bw#0\n\
                    #   lane[1]:  3:cma/memory.0 md[3] -> md[3]/cma/sysdev[255] rma_bw#0\n";
        assert_eq!(rma_transports(info), "cma");
        assert_eq!(rma_transports("#   lane[0]:  1:tcp/lo.0 md[1] am\n"), "tcp");
        assert_eq!(rma_transports(""), "unknown");
    }
}
