//! kvmesh's HTTP/1 server: hyper connections with the limits a public endpoint needs.
//!
//! - A request head must arrive whole within the header timeout of the connection opening
//!   (or of its first byte, after an idle keep-alive pause): a silent or header-dripping
//!   client is closed.
//! - A keep-alive connection with no request in flight is closed after the idle timeout.
//! - A request body must arrive whole within the body timeout of its head; a late one gets
//!   408 and the connection is closed.
//! - At most `max_connections` connections are open (never more than the open-file limit
//!   allows, less a margin); beyond it a new connection gets a 503 at once and is closed. An
//!   accept that fails (out of file descriptors) is retried after a short pause.
//! - A client that keeps the server's writes waiting (its socket full) and, over the send
//!   timeout, takes its answer at under [`MIN_SEND_RATE`] bytes a second, is closed (its
//!   request is cancelled): a client that stopped reading, or reads a few bytes at a time,
//!   holds a connection and a response for that long at most.
//! - Responses, streamed ones included, are never cut by the other timeouts.
//! - Errors made below the API's handlers (unknown route, wrong method, body too large or
//!   too slow, a rejected extractor) are answered in the OpenAI error shape.
//!
//! On shutdown the listener closes at once; idle connections are closed, and connections
//! with a request in flight finish it (a stream runs to its end) before closing. The caller
//! bounds that with its own grace period: dropping the future closes every connection.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue, Method, Request, Response, StatusCode};
use axum::response::IntoResponse;
use axum::Router;
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use kvmesh_telemetry::RateLimited;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower_service::Service;

use crate::conn_phase::{ConnPhase, Expired};
use crate::error::ApiError;
use crate::raw_errors;
use crate::send_pace::SendPace;
pub use crate::send_pace::MIN_SEND_RATE;

/// Defaults of the limits, in seconds (`kvmesh serve` and `kvmesh node` flags).
pub const DEFAULT_HEADER_TIMEOUT_S: f64 = 10.0;
pub const DEFAULT_IDLE_TIMEOUT_S: f64 = 75.0;
pub const DEFAULT_BODY_TIMEOUT_S: f64 = 30.0;
pub const DEFAULT_SEND_TIMEOUT_S: f64 = 30.0;
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;

/// The largest request body the API reads (axum's default, made explicit for messages).
pub const MAX_BODY_BYTES: usize = 2 << 20;

/// Connections refused with a 503 that may linger (sending it, then reading what the client
/// had sent so that closing does not reset the connection under the answer).
const MAX_REFUSING: usize = 32;

#[derive(Clone, Debug, PartialEq)]
pub struct HttpLimits {
    /// A request head must be complete this long after the connection opened or, on a
    /// keep-alive connection, after its first byte. `None`: no limit.
    pub header_timeout: Option<Duration>,
    /// A keep-alive connection with no request in flight is closed after this long.
    pub idle_timeout: Option<Duration>,
    /// A request body must be complete this long after its head.
    pub body_timeout: Option<Duration>,
    /// A client that takes no byte of the answer for this long, while bytes wait for it, is
    /// closed.
    pub send_timeout: Option<Duration>,
    /// Open connections at most (capped by the open-file limit).
    pub max_connections: usize,
}

impl Default for HttpLimits {
    fn default() -> HttpLimits {
        let s = |v: f64| Some(Duration::from_secs_f64(v));
        HttpLimits {
            header_timeout: s(DEFAULT_HEADER_TIMEOUT_S),
            idle_timeout: s(DEFAULT_IDLE_TIMEOUT_S),
            body_timeout: s(DEFAULT_BODY_TIMEOUT_S),
            send_timeout: s(DEFAULT_SEND_TIMEOUT_S),
            max_connections: DEFAULT_MAX_CONNECTIONS,
        }
    }
}

/// The soft limit on open files (RLIMIT_NOFILE), when there is one.
pub fn open_file_limit() -> Option<usize> {
    #[cfg(unix)]
    {
        let mut r = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes into the struct it is given and reads nothing else.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0
            || r.rlim_cur == libc::RLIM_INFINITY
        {
            return None;
        }
        Some(r.rlim_cur as usize)
    }
    #[cfg(not(unix))]
    None
}

/// The most connections a process with `open_files` descriptors may hold: the rest is kept
/// for what else it opens (model files, the engine, cluster links, logs): an eighth of the
/// limit, at least 64.
pub fn connection_ceiling(open_files: usize) -> usize {
    open_files.saturating_sub((open_files / 8).max(64)).max(1)
}

/// Raises the soft open-file limit toward the hard one, as far as `connections` need (never
/// lowers it): many systems start processes at 1024 with a much higher hard limit.
fn raise_open_file_limit(connections: usize) {
    #[cfg(unix)]
    {
        let needed = (connections + 64).max((connections * 8).div_ceil(7) + 1) as libc::rlim_t;
        let mut r = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit and setrlimit read and write only the struct they are given.
        unsafe {
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) != 0
                || r.rlim_cur == libc::RLIM_INFINITY
                || r.rlim_cur >= needed
            {
                return;
            }
            let from = r.rlim_cur;
            r.rlim_cur = if r.rlim_max == libc::RLIM_INFINITY {
                needed
            } else {
                needed.min(r.rlim_max)
            };
            if r.rlim_cur > from && libc::setrlimit(libc::RLIMIT_NOFILE, &r) == 0 {
                tracing::debug!("open-file limit raised from {from} to {}", r.rlim_cur);
            }
        }
    }
    #[cfg(not(unix))]
    let _ = connections;
}

/// The connection cap `serve` applies for `asked`: capped by the open-file limit (raised
/// first as far as the hard limit allows).
pub fn effective_max_connections(asked: usize) -> usize {
    let asked = asked.max(1);
    raise_open_file_limit(asked);
    match open_file_limit() {
        Some(files) if asked > connection_ceiling(files) => {
            let cap = connection_ceiling(files);
            tracing::warn!(
                "--max-connections {asked} is more than the open-file limit of {files} allows; \
                 serving at most {cap} connections (raise `ulimit -n` for more)"
            );
            cap
        }
        _ => asked,
    }
}

/// Serves `app` on `listener` until `shutdown` completes, then stops accepting and lets the
/// open requests finish (see the module's notes).
pub async fn serve<F>(
    listener: TcpListener,
    app: Router,
    limits: HttpLimits,
    shutdown: F,
) -> io::Result<()>
where
    F: Future<Output = ()> + Send,
{
    let max = effective_max_connections(limits.max_connections);
    let fmt = |d: Option<Duration>| d.map_or("off".to_string(), |d| format!("{:?}", d));
    tracing::info!(
        "HTTP limits: {max} connections, header timeout {}, idle timeout {}, body timeout {}",
        fmt(limits.header_timeout),
        fmt(limits.idle_timeout),
        fmt(limits.body_timeout),
    );
    let limits = Arc::new(limits);
    let permits = Arc::new(Semaphore::new(max));
    let refusing = Arc::new(Semaphore::new(MAX_REFUSING));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut conns = JoinSet::new();
    let mut accept_errors = AcceptErrors::default();
    let mut full = RateLimited::default();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            accepted = listener.accept() => match accepted {
                Ok((tcp, _peer)) => {
                    accept_errors.reset();
                    match permits.clone().try_acquire_owned() {
                        Ok(permit) => {
                            conns.spawn(connection(
                                tcp,
                                app.clone(),
                                limits.clone(),
                                permit,
                                stop_rx.clone(),
                            ));
                        }
                        Err(_) => {
                            if full.ready() {
                                tracing::warn!(
                                    "{max} HTTP connections open (--max-connections): \
                                     answering new ones 503{}",
                                    full.suppressed_note()
                                );
                            }
                            refuse(tcp, max, &refusing);
                        }
                    }
                }
                Err(e) if is_connection_error(&e) => {}
                Err(e) => {
                    let pause = accept_errors.failed(&e);
                    tokio::select! {
                        _ = &mut shutdown => break,
                        _ = tokio::time::sleep(pause) => {}
                    }
                }
            },
        }
    }
    drop(listener);
    stop_tx.send_replace(true);
    while conns.join_next().await.is_some() {}
    Ok(())
}

/// Errors of one connection that `accept` reports: nothing wrong with the listener.
fn is_connection_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::Interrupted
    )
}

/// Backoff and logging for a failing `accept` (out of file descriptors, out of memory):
/// a pause growing from 10 ms to 1 s, and one log line every few seconds at most.
#[derive(Default)]
struct AcceptErrors {
    pause: Duration,
    log: RateLimited,
}

impl AcceptErrors {
    fn failed(&mut self, e: &io::Error) -> Duration {
        self.pause = (self.pause * 2).clamp(Duration::from_millis(10), Duration::from_secs(1));
        if self.log.ready() {
            let why = match e.raw_os_error() {
                Some(libc::EMFILE) | Some(libc::ENFILE) => {
                    " (out of file descriptors: lower --max-connections or raise `ulimit -n`)"
                }
                _ => "",
            };
            tracing::error!(
                "accepting an HTTP connection failed: {e}{why}; retrying in {:?}{}",
                self.pause,
                self.log.suppressed_note()
            );
        }
        self.pause
    }

    fn reset(&mut self) {
        self.pause = Duration::ZERO;
    }
}

/// Answers a connection beyond the cap with 503 and closes it, without waiting for it.
fn refuse(tcp: TcpStream, max: usize, refusing: &Arc<Semaphore>) {
    let body = ApiError::too_many_connections(max).body().to_string();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let answer = [head.as_bytes(), body.as_bytes()].concat();
    // A new socket's send buffer is empty: the answer goes out without waiting.
    let _ = tcp.try_write(&answer);
    let Ok(permit) = refusing.clone().try_acquire_owned() else {
        return; // dropped: closed at once
    };
    tokio::spawn(async move {
        let _permit = permit;
        let mut tcp = tcp;
        // Closing with unread bytes would reset the connection, and the client could lose
        // the answer: say we are done, then read what it sent for a moment.
        let _ = tokio::time::timeout(Duration::from_millis(500), async {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let _ = tcp.shutdown().await;
            let mut sink = [0u8; 4096];
            while matches!(tcp.read(&mut sink).await, Ok(n) if n > 0) {}
        })
        .await;
    });
}

/// One connection: hyper's HTTP/1, watched by the connection's clock.
async fn connection(
    tcp: TcpStream,
    app: Router,
    limits: Arc<HttpLimits>,
    _permit: OwnedSemaphorePermit,
    mut stop: watch::Receiver<bool>,
) {
    // Streams are many small writes: without TCP_NODELAY a chunk can wait ~40 ms for the
    // client's delayed ACK (Nagle), which shows up as time to first token.
    if let Err(e) = tcp.set_nodelay(true) {
        tracing::debug!("TCP_NODELAY: {e}");
    }
    let clock = Arc::new(Clock::new(&limits));
    let io = TokioIo::new(Watched {
        io: tcp,
        clock: clock.clone(),
        rewrite: None,
        linger: None,
        send_timeout: limits.send_timeout,
        stalled: None,
    });
    let body_timeout = limits.body_timeout;
    let svc = {
        let clock = clock.clone();
        hyper::service::service_fn(move |req| handle(req, app.clone(), clock.clone(), body_timeout))
    };
    let conn = hyper::server::conn::http1::Builder::new()
        // The clock below times heads: hyper's own timer would also run while idle.
        .header_read_timeout(None)
        .serve_connection(io, svc);
    tokio::pin!(conn);
    let mut stopping = false;
    loop {
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!("HTTP connection ended: {e}");
                }
                return;
            }
            _ = stop.wait_for(|s| *s), if !stopping => {
                stopping = true;
                // Idle: closed now; in a request: closed once its response is sent.
                conn.as_mut().graceful_shutdown();
            }
            expired = clock.expired() => {
                match expired {
                    Expired::Head => tracing::debug!(
                        "closing an HTTP connection: no complete request head within {:?}",
                        limits.header_timeout.unwrap_or_default()
                    ),
                    Expired::Idle => tracing::debug!("closing an idle HTTP connection"),
                }
                return;
            }
        }
    }
}

/// A connection's [`ConnPhase`] behind a lock, and the wake-up of the task that closes the
/// connection when the phase's deadline passes.
struct Clock {
    phase: Mutex<ConnPhase>,
    /// Whether the phase is idle (read on every socket read; the lock only on changes).
    idle_now: AtomicBool,
    /// A request body was refused before it was read (413): drain it before closing.
    linger: AtomicBool,
    changed: Notify,
}

impl Clock {
    fn new(limits: &HttpLimits) -> Clock {
        Clock {
            phase: Mutex::new(ConnPhase::new(
                limits.header_timeout,
                limits.idle_timeout,
                Instant::now(),
            )),
            idle_now: AtomicBool::new(false),
            linger: AtomicBool::new(false),
            changed: Notify::new(),
        }
    }

    fn set(&self, f: impl FnOnce(&mut ConnPhase)) {
        let mut p = self.phase.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut p);
        self.idle_now.store(p.is_idle(), Ordering::Relaxed);
        drop(p);
        self.changed.notify_one();
    }

    /// Bytes came in: after an idle pause, the next head's time starts.
    fn bytes_read(&self) {
        if self.idle_now.load(Ordering::Relaxed) {
            self.set(|p| {
                p.bytes_read(Instant::now());
            });
        }
    }

    /// A request head was read: no head or idle timeout until its response is sent.
    fn request_started(self: &Arc<Self>) -> InFlight {
        self.set(ConnPhase::request_started);
        InFlight(self.clone())
    }

    fn request_done(&self) {
        self.set(|p| p.request_done(Instant::now()));
    }

    /// Resolves when the phase's deadline passes.
    async fn expired(&self) -> Expired {
        loop {
            let changed = self.changed.notified();
            let (deadline, passed) = {
                let p = self.phase.lock().unwrap_or_else(|e| e.into_inner());
                (p.deadline(), p.expired(Instant::now()))
            };
            if let Some(why) = passed {
                return why;
            }
            let Some((deadline, _)) = deadline else {
                changed.await;
                continue;
            };
            tokio::select! {
                _ = tokio::time::sleep_until(deadline) => {}
                _ = changed => {}
            }
        }
    }
}

/// A request in flight on a connection; dropped when its response is sent (or abandoned).
struct InFlight(Arc<Clock>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.request_done();
    }
}

/// The socket, telling the clock when bytes arrive, and giving the library's own bodiless
/// error answers an OpenAI body (`raw_errors`).
struct Watched {
    io: TcpStream,
    clock: Arc<Clock>,
    /// An answer written in place of one of hyper's, and how far it got: `(bytes, sent,
    /// the length of hyper's answer)`.
    rewrite: Option<(Vec<u8>, usize, usize)>,
    /// Closing: until when, and how many more bytes, the rest of the request is read and
    /// dropped (`poll_shutdown`).
    linger: Option<(Pin<Box<tokio::time::Sleep>>, usize, Lingering)>,
    send_timeout: Option<Duration>,
    /// Since the socket refused bytes (its buffer full, the client not keeping up): the
    /// send timeout's timer, and what the client has taken since; dropped once the client
    /// has taken the answer at [`MIN_SEND_RATE`] over that time.
    stalled: Option<Stall>,
}

struct Stall {
    timer: Pin<Box<tokio::time::Sleep>>,
    pace: SendPace,
}

/// A closing connection reads and drops what its client is still sending, for at most this
/// long and this much, before it closes: closing with unread bytes makes the kernel reset
/// the connection, and a client still writing a body the server refused (a 413 sent before
/// the body was read) would see the reset instead of the answer.
const LINGER_TIME: Duration = Duration::from_secs(5);
const LINGER_BYTES: usize = 64 << 20;

/// Connections lingering at once, at most, across the server: past this, a connection whose
/// body was refused unread closes at once (its client may see a reset instead of the 413).
/// Each lingering connection holds its place for at most [`LINGER_TIME`].
const MAX_LINGERING: usize = 64;

static LINGERING: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// A place among the [`MAX_LINGERING`] connections that may linger, given back when dropped.
struct Lingering;

impl Lingering {
    fn take() -> Option<Lingering> {
        LINGERING
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < MAX_LINGERING).then_some(n + 1)
            })
            .ok()
            .map(|_| Lingering)
    }
}

impl Drop for Lingering {
    fn drop(&mut self) {
        LINGERING.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Connections closed for a client that stopped reading, logged at most every 5 s.
static SEND_STALLS: Mutex<RateLimited> = Mutex::new(RateLimited::new());

impl Watched {
    /// A write's outcome, timed: pending writes for the whole send timeout become an error,
    /// which ends the connection.
    fn timed<T: Written>(
        &mut self,
        cx: &mut Context<'_>,
        r: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        let Some(after) = self.send_timeout else {
            return r;
        };
        if let Poll::Ready(res) = &r {
            if let Some(stall) = &mut self.stalled {
                let n = res.as_ref().map_or(0, |w| w.bytes());
                if stall.pace.took(n, Instant::now()) {
                    self.stalled = None;
                }
            }
            return r;
        }
        let stall = self.stalled.get_or_insert_with(|| Stall {
            timer: Box::pin(tokio::time::sleep(after)),
            pace: SendPace::new(Instant::now()),
        });
        if stall.timer.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        let why = stall.pace.verdict(after);
        let mut log = SEND_STALLS.lock().unwrap_or_else(|e| e.into_inner());
        if log.ready() {
            tracing::info!("closing an HTTP connection: {why}{}", log.suppressed_note());
        }
        Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, why)))
    }

    /// Writes the rewritten answer to its end, then says hyper's was written.
    fn poll_rewrite(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        loop {
            let Some((bytes, sent, replaced)) = &self.rewrite else {
                return Poll::Ready(Ok(0));
            };
            if *sent == bytes.len() {
                let n = *replaced;
                self.rewrite = None;
                return Poll::Ready(Ok(n));
            }
            let r = Pin::new(&mut self.io).poll_write(cx, &bytes[*sent..]);
            match self.timed(cx, r) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Ok(0)),
                Poll::Ready(Ok(n)) => {
                    if let Some((_, sent, _)) = &mut self.rewrite {
                        *sent += n;
                    }
                }
                other => return other,
            }
        }
    }
}

/// What a write's result says was written.
trait Written {
    fn bytes(&self) -> usize;
}

impl Written for usize {
    fn bytes(&self) -> usize {
        *self
    }
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.io).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.clock.bytes_read();
        }
        r
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.rewrite.is_none() {
            if let Some(bytes) = raw_errors::with_body(buf) {
                self.rewrite = Some((bytes, 0, buf.len()));
            }
        }
        if self.rewrite.is_some() {
            return self.poll_rewrite(cx);
        }
        let r = Pin::new(&mut self.io).poll_write(cx, buf);
        self.timed(cx, r)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        // A library error answer is one short head; join it to look at it whole.
        let first = bufs.iter().find(|b| !b.is_empty());
        if self.rewrite.is_some() || first.is_some_and(|b| b.starts_with(b"HTTP/1.1 4")) {
            let joined: Vec<u8> = bufs.iter().flat_map(|b| b.iter().copied()).collect();
            return self.poll_write(cx, &joined);
        }
        let r = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.timed(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    /// Sends the end of the answer; after a body refused unread, lingers (`LINGER_TIME`)
    /// until the client has stopped sending it.
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if !self.clock.linger.load(Ordering::Relaxed) {
            return Pin::new(&mut self.io).poll_shutdown(cx);
        }
        if self.linger.is_none() {
            std::task::ready!(Pin::new(&mut self.io).poll_shutdown(cx))?;
            let Some(place) = Lingering::take() else {
                return Poll::Ready(Ok(()));
            };
            self.linger = Some((
                Box::pin(tokio::time::sleep(LINGER_TIME)),
                LINGER_BYTES,
                place,
            ));
        }
        let this = &mut *self;
        let (deadline, left, _) = this.linger.as_mut().expect("set above");
        let mut buf = [0u8; 16 << 10];
        loop {
            if *left == 0 || deadline.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Ok(()));
            }
            let mut rb = ReadBuf::new(&mut buf);
            match Pin::new(&mut this.io).poll_read(cx, &mut rb) {
                Poll::Ready(Ok(())) if rb.filled().is_empty() => return Poll::Ready(Ok(())),
                Poll::Ready(Ok(())) => *left = left.saturating_sub(rb.filled().len()),
                Poll::Ready(Err(_)) => return Poll::Ready(Ok(())),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

async fn handle(
    req: Request<Incoming>,
    mut app: Router,
    clock: Arc<Clock>,
    body_timeout: Option<Duration>,
) -> Result<Response<Tracked>, Infallible> {
    let in_flight = clock.request_started();
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let late = Arc::new(AtomicBool::new(false));
    let mut req = req;
    if let Some(after) = body_timeout {
        req.extensions_mut().insert(BodyLate {
            late: late.clone(),
            after,
        });
    }
    let req = req.map(|b| {
        Body::new(TimedBody {
            deadline: body_timeout
                .filter(|_| !http_body::Body::is_end_stream(&b))
                .map(|d| Instant::now() + d),
            inner: b,
            sleep: None,
            late: late.clone(),
        })
    });
    let resp = match app.call(req).await {
        Ok(r) => r,
        Err(never) => match never {},
    };
    if resp.status() == StatusCode::PAYLOAD_TOO_LARGE {
        clock.linger.store(true, Ordering::Relaxed);
    }
    // The trace middleware has already answered 408 on the API's routes (with the trace's
    // headers); elsewhere the handler's read error becomes one here.
    let resp = if late.load(Ordering::Relaxed) && resp.status() != StatusCode::REQUEST_TIMEOUT {
        let mut r = ApiError::body_timeout(body_timeout.unwrap_or_default()).into_response();
        r.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        r
    } else {
        openai_errors(resp, &method, &path).await
    };
    Ok(resp.map(|body| Tracked {
        body,
        in_flight: Some(in_flight),
    }))
}

/// The body length a request declares (hyper has refused conflicting ones already).
pub fn declared_length<B>(req: &Request<B>) -> Option<u64> {
    req.headers()
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Gives error responses made outside the API's handlers (axum's rejections and
/// routing: plain text or empty bodies) the OpenAI error shape. JSON, event streams and
/// pages pass unchanged.
pub async fn openai_errors(resp: Response<Body>, method: &Method, path: &str) -> Response<Body> {
    let status = resp.status();
    if !(status.is_client_error() || status.is_server_error()) {
        return resp;
    }
    let plain = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_none_or(|ct| ct.starts_with("text/plain"));
    if !plain {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let text = axum::body::to_bytes(body, 4096)
        .await
        .map(|b| String::from_utf8_lossy(&b).trim().to_string())
        .unwrap_or_default();
    let allow = parts
        .headers
        .get(header::ALLOW)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let err = match status {
        StatusCode::NOT_FOUND => ApiError::not_found(path),
        StatusCode::METHOD_NOT_ALLOWED => ApiError::method_not_allowed(method, path, &allow),
        StatusCode::PAYLOAD_TOO_LARGE => ApiError::body_too_large(MAX_BODY_BYTES),
        _ => ApiError::from_status(status, text),
    };
    let mut out = err.into_response();
    for name in [
        header::ALLOW,
        header::RETRY_AFTER,
        header::WWW_AUTHENTICATE,
        header::CONNECTION,
    ] {
        if let Some(v) = parts.headers.get(&name) {
            out.headers_mut().insert(name, v.clone());
        }
    }
    out
}

/// Whether a request's body missed its deadline, for the trace middleware: the handler
/// sees only a failed read (a 400), the client gets 408.
#[derive(Clone, Debug)]
pub struct BodyLate {
    late: Arc<AtomicBool>,
    after: Duration,
}

impl BodyLate {
    /// The 408 to answer with, once the body missed its deadline.
    pub fn response(&self) -> Option<Response<Body>> {
        self.late.load(Ordering::Relaxed).then(|| {
            let mut r = ApiError::body_timeout(self.after).into_response();
            r.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            r
        })
    }
}

#[derive(Debug)]
struct BodyTimeout;

impl std::fmt::Display for BodyTimeout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the request body did not arrive in time")
    }
}

impl std::error::Error for BodyTimeout {}

/// A request body that fails once its deadline passes before its end.
struct TimedBody {
    inner: Incoming,
    deadline: Option<Instant>,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
    late: Arc<AtomicBool>,
}

impl http_body::Body for TimedBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        if let Poll::Ready(f) = Pin::new(&mut this.inner).poll_frame(cx) {
            return Poll::Ready(f.map(|r| r.map_err(Into::into)));
        }
        if let Some(d) = this.deadline {
            let sleep = this
                .sleep
                .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(d)));
            if sleep.as_mut().poll(cx).is_ready() {
                this.deadline = None;
                this.late.store(true, Ordering::Relaxed);
                return Poll::Ready(Some(Err(Box::new(BodyTimeout))));
            }
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A response body that tells its connection's clock when it is done.
struct Tracked {
    body: Body,
    in_flight: Option<InFlight>,
}

impl http_body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.body).poll_frame(cx);
        if matches!(r, Poll::Ready(None) | Poll::Ready(Some(Err(_)))) {
            this.in_flight = None;
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ceiling_leaves_room_for_other_files() {
        assert_eq!(connection_ceiling(256), 192);
        assert_eq!(connection_ceiling(1024), 896);
        assert_eq!(connection_ceiling(65536), 57344);
        assert_eq!(connection_ceiling(10), 1);
        // What raise_open_file_limit asks for is enough.
        for asked in [1, 8, 100, 1024, 5000, 100_000] {
            let needed = (asked + 64).max((asked * 8usize).div_ceil(7) + 1);
            assert!(connection_ceiling(needed) >= asked, "{asked}");
        }
    }

    #[test]
    fn lingering_closes_share_one_bounded_budget() {
        let held: Vec<Lingering> = std::iter::from_fn(Lingering::take).take(1000).collect();
        assert_eq!(held.len(), MAX_LINGERING);
        assert!(Lingering::take().is_none());
        drop(held);
        assert!(Lingering::take().is_some());
    }

    #[tokio::test]
    async fn plain_errors_get_the_openai_shape() {
        let resp = Response::builder()
            .status(StatusCode::METHOD_NOT_ALLOWED)
            .header(header::ALLOW, "POST")
            .body(Body::empty())
            .unwrap();
        let out = openai_errors(resp, &Method::GET, "/v1/completions").await;
        assert_eq!(out.status(), StatusCode::METHOD_NOT_ALLOWED);
        assert_eq!(out.headers()[header::ALLOW], "POST");
        let b = axum::body::to_bytes(out.into_body(), 1 << 16)
            .await
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["error"]["code"], "method_not_allowed");
        assert!(v["error"]["message"].as_str().unwrap().contains("POST"));
        // JSON errors are left alone.
        let json = ApiError::not_found("/x").into_response();
        let out = openai_errors(json, &Method::GET, "/x").await;
        let b = axum::body::to_bytes(out.into_body(), 1 << 16)
            .await
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["error"]["code"], "unknown_url");
    }
}
