//! Streams a peer may open, granted as they are used.
//!
//! QUIC makes the receiver keep state for every stream it allows a peer to have open at
//! once, allowed or used: quinn sets up a table entry per allowed stream when a connection
//! starts. A fixed grant sized for the busiest connection (thousands of requests to one
//! worker, KV transfers of many streams) costs every connection over a megabyte, most of a
//! router's memory per worker. So every connection starts with a small grant, and the loop
//! that accepts a direction's streams doubles it when those open reach three quarters of
//! it: a busy connection pays for what it uses, and a control link only for its few streams.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use quinn::{Connection, VarInt};

/// Streams each direction allows at first (also the endpoint's transport config).
pub const FIRST_BIDI: u32 = 64;
pub const FIRST_UNI: u32 = 16;
/// At most: one request per stream, and KV transfers of up to 16 streams each.
pub const MOST_BIDI: u64 = 16_384;
pub const MOST_UNI: u64 = 4_096;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dir {
    Bi,
    Uni,
}

/// The streams a peer may open in one direction on one connection: counted while open,
/// the grant doubled when they near it.
pub struct StreamGrant {
    conn: Connection,
    dir: Dir,
    open: AtomicU64,
    granted: AtomicU64,
}

impl StreamGrant {
    pub fn new(conn: &Connection, dir: Dir) -> Arc<StreamGrant> {
        let first = match dir {
            Dir::Bi => FIRST_BIDI,
            Dir::Uni => FIRST_UNI,
        };
        Arc::new(StreamGrant {
            conn: conn.clone(),
            dir,
            open: AtomicU64::new(0),
            granted: AtomicU64::new(first.into()),
        })
    }

    /// A stream the peer opened, counted until the guard drops (when its work is done).
    pub fn enter(self: &Arc<Self>) -> OpenStream {
        let open = self.open.fetch_add(1, Ordering::AcqRel) + 1;
        let granted = self.granted.load(Ordering::Acquire);
        let most = match self.dir {
            Dir::Bi => MOST_BIDI,
            Dir::Uni => MOST_UNI,
        };
        if open * 4 >= granted * 3 && granted < most {
            let more = (granted * 2).min(most);
            if self
                .granted
                .compare_exchange(granted, more, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                let count = VarInt::from_u64(more).expect("a stream count fits a VarInt");
                match self.dir {
                    Dir::Bi => self.conn.set_max_concurrent_bi_streams(count),
                    Dir::Uni => self.conn.set_max_concurrent_uni_streams(count),
                }
            }
        }
        OpenStream(self.clone())
    }

    /// Streams the peer may have open at once now.
    pub fn granted(&self) -> u64 {
        self.granted.load(Ordering::Acquire)
    }
}

/// One open stream of a [`StreamGrant`].
pub struct OpenStream(Arc<StreamGrant>);

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A stream read elsewhere, counted open until it is dropped.
pub struct Counted<R> {
    inner: R,
    _open: OpenStream,
}

impl<R> Counted<R> {
    pub fn new(inner: R, open: OpenStream) -> Counted<R> {
        Counted { inner, _open: open }
    }
}

impl<R: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Counted<R> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}
