//! In-process KV transfer: prefill and decode roles in one process. The sender copies each
//! piece from the prefill pool straight into the decode pool's reserved blocks (one `memcpy`
//! per run of positions, no framing, no socket), with the same checks a network receiver
//! makes, and tells the receiver when it is done.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::sync::oneshot;

use super::{HostRegion, Kind, KvReceiver, KvSender, Landing, TransferTotals};
use crate::wire::KvPiece;
use crate::TransportError;

/// The decode side's half, handed to the sender: where pieces land.
pub struct LocalTarget {
    landing: Arc<Landing>,
    done: oneshot::Sender<()>,
}

/// A receiver and the target a local sender fills.
pub fn channel(landing: Arc<Landing>) -> (LocalTarget, LocalReceiver) {
    let (tx, rx) = oneshot::channel();
    (
        LocalTarget {
            landing: landing.clone(),
            done: tx,
        },
        LocalReceiver { landing, done: rx },
    )
}

impl LocalTarget {
    pub fn transfer_id(&self) -> u64 {
        self.landing.transfer_id
    }
}

pub struct LocalSender {
    src: Arc<HostRegion>,
    target: Option<LocalTarget>,
}

impl LocalSender {
    pub fn new(src: Arc<HostRegion>, target: LocalTarget) -> LocalSender {
        LocalSender {
            src,
            target: Some(target),
        }
    }
}

#[async_trait::async_trait]
impl KvSender for LocalSender {
    async fn send(&mut self, layer: usize, first: usize, n: usize) -> Result<(), TransportError> {
        if n == 0 {
            return Ok(());
        }
        let t = self.target.as_ref().ok_or(TransportError::Stopped)?;
        let landing = &t.landing;
        let bpp = self.src.bytes_per_pos();
        let piece = KvPiece {
            transfer_id: landing.transfer_id,
            layer: layer as u32,
            first_pos: first as u32,
            num_pos: n as u32,
            blocks: landing.region.blocks_of(first, n).to_vec(),
            bytes_per_pos: bpp as u32,
            payload_bytes: (2 * n * bpp) as u64,
        };
        let dst = landing.accept(&piece)?;
        let mut src = self.src.segments(layer, Kind::K, first, n)?;
        src.extend(self.src.segments(layer, Kind::V, first, n)?);
        // SAFETY: both regions' contracts: the source positions are computed and readable,
        // the destination ones reserved for this transfer; the pools are distinct memory.
        unsafe { copy_segments(&src, &dst) };
        landing
            .bytes
            .fetch_add(piece.payload_bytes, Ordering::Relaxed);
        landing.landed(&piece);
        Ok(())
    }

    async fn finish(&mut self) -> Result<TransferTotals, TransportError> {
        let t = self.target.take().ok_or(TransportError::Stopped)?;
        let totals = t.landing.totals();
        let _ = t.done.send(());
        Ok(totals)
    }
}

/// Copies the bytes of one list of segments into another of the same total length.
///
/// # Safety
/// Every source segment must be readable and every destination segment writable, with no
/// overlap between them.
unsafe fn copy_segments(src: &[(usize, usize)], dst: &[(usize, usize)]) {
    for (s, d, n) in super::pair_runs(src, dst) {
        // SAFETY: the caller's contract; each pair lies inside one run of each list.
        unsafe { std::ptr::copy_nonoverlapping(s as *const u8, d as *mut u8, n) };
    }
}

pub struct LocalReceiver {
    landing: Arc<Landing>,
    done: oneshot::Receiver<()>,
}

#[async_trait::async_trait]
impl KvReceiver for LocalReceiver {
    async fn complete(&mut self) -> Result<TransferTotals, TransportError> {
        (&mut self.done).await.map_err(|_| {
            TransportError::Stream("the in-process prefill ended before it finished".into())
        })?;
        if !self.landing.is_complete() {
            return Err(TransportError::Stream(format!(
                "the in-process transfer is incomplete: {}",
                self.landing.missing()
            )));
        }
        Ok(self.landing.totals())
    }

    fn landed_bytes(&self) -> u64 {
        self.landing.landed_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::tests::region;

    #[tokio::test]
    async fn copies_between_different_block_tables() {
        let mut src = vec![vec![0u8; 4 * 4 * 8]; 4];
        for (i, m) in src.iter_mut().enumerate() {
            for (j, b) in m.iter_mut().enumerate() {
                *b = (i + j) as u8;
            }
        }
        let mut dst = vec![vec![0u8; 4 * 4 * 8]; 4];
        let s = Arc::new(region(&mut src, vec![2, 0, 3], 4..11));
        let landing = Arc::new(Landing::new(region(&mut dst, vec![1, 3, 0], 4..11), 3));
        let (target, mut recv) = channel(landing);
        let mut send = LocalSender::new(s, target);
        for layer in 0..2 {
            send.send(layer, 4, 3).await.unwrap();
            send.send(layer, 7, 4).await.unwrap();
        }
        assert!(
            send.send(0, 4, 1).await.is_err(),
            "positions already landed"
        );
        let t = send.finish().await.unwrap();
        assert_eq!(recv.complete().await.unwrap(), t);
        // Position 9 (block index 2): source block 3, destination block 0, offset 1.
        for buf in 0..4 {
            assert_eq!(dst[buf][8..16], src[buf][(3 * 4 + 1) * 8..(3 * 4 + 2) * 8]);
        }
    }

    #[tokio::test]
    async fn a_sender_dropped_early_fails_the_receiver() {
        let mut src = vec![vec![0u8; 4 * 4 * 8]; 4];
        let mut dst = vec![vec![0u8; 4 * 4 * 8]; 4];
        let s = Arc::new(region(&mut src, vec![0, 1], 0..8));
        let landing = Arc::new(Landing::new(region(&mut dst, vec![0, 1], 0..8), 1));
        let (target, mut recv) = channel(landing);
        let mut send = LocalSender::new(s, target);
        send.send(0, 0, 8).await.unwrap();
        drop(send);
        assert!(recv.complete().await.is_err());
    }
}
