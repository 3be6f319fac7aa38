//! In-process KV transfer: prefill and decode roles in one process. The sender copies each
//! piece from the prefill pool straight into the decode pool's reserved blocks (one `memcpy`
//! per run of positions, no framing, no socket), with the same checks a network receiver
//! makes, and tells the receiver when it is done.
//!
//! Two engines on GPUs lend their device caches' blocks themselves
//! ([`RegionMemory::Device`]): the piece is then copied on the device, by the source
//! region's [`DeviceCopy`](super::DeviceCopy), and never crosses the host. One side on a
//! device and the other in host memory is refused (the decode side asks for device blocks
//! only where both engines have them).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::sync::oneshot;

use super::{Kind, KvReceiver, KvRegion, KvSender, Landing, RegionMemory, TransferTotals};
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

    /// Whether the blocks lie in a GPU's memory: the sender's must then too.
    pub fn on_device(&self) -> bool {
        matches!(self.landing.region.memory(), RegionMemory::Device(_))
    }
}

pub struct LocalSender {
    src: Arc<KvRegion>,
    target: Option<LocalTarget>,
}

impl LocalSender {
    pub fn new(src: Arc<KvRegion>, target: LocalTarget) -> LocalSender {
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
        let dst = landing.accept_any(&piece)?;
        let mut src = self.src.any_segments(layer, Kind::K, first, n)?;
        src.extend(self.src.any_segments(layer, Kind::V, first, n)?);
        let runs = super::pair_runs(&src, &dst);
        match (self.src.memory(), landing.region.memory()) {
            // SAFETY: both regions' contracts: the source positions are computed and
            // readable, the destination ones reserved for this transfer; the pools are
            // distinct memory.
            (RegionMemory::Host, RegionMemory::Host) => unsafe { copy_runs(&runs) },
            // SAFETY: the same, on the devices the copiers copy on.
            (RegionMemory::Device(from), RegionMemory::Device(to)) => {
                unsafe { from.copy(&runs, to.device()) }.map_err(TransportError::DeviceCopy)?
            }
            _ => return Err(TransportError::MixedMemory),
        }
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

/// Copies each `(source, destination, length)` run in host memory.
///
/// # Safety
/// Every source range must be readable and every destination range writable, with no
/// overlap between them.
unsafe fn copy_runs(runs: &[(usize, usize, usize)]) {
    for &(s, d, n) in runs {
        // SAFETY: the caller's contract.
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
    use crate::kv::tests::{device, region};

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

    #[tokio::test]
    async fn device_regions_are_copied_by_the_source_copier_in_one_call_a_piece() {
        let mut src = vec![vec![0u8; 4 * 4 * 8]; 4];
        for (i, m) in src.iter_mut().enumerate() {
            for (j, b) in m.iter_mut().enumerate() {
                *b = (7 * i + j) as u8;
            }
        }
        let mut dst = vec![vec![0u8; 4 * 4 * 8]; 4];
        let (from, to) = (device(0), device(1));
        // SAFETY: the regions' buffers stand for device memory the copiers copy.
        let s = unsafe { region(&mut src, vec![2, 0, 3], 4..11).on_device(from.clone()) };
        let d = unsafe { region(&mut dst, vec![1, 3, 0], 4..11).on_device(to.clone()) };
        assert!(
            matches!(
                d.segments(0, Kind::K, 4, 1),
                Err(TransportError::DeviceMemory { device: 1 })
            ),
            "no transport but this one reads a device region"
        );
        let landing = Arc::new(Landing::new(d, 5));
        let (target, mut recv) = channel(landing);
        let mut send = LocalSender::new(Arc::new(s), target);
        for layer in 0..2 {
            send.send(layer, 4, 7).await.unwrap();
        }
        let t = send.finish().await.unwrap();
        assert_eq!(recv.complete().await.unwrap(), t);
        // Positions 4..11 lie in two blocks on both sides: 2 runs of K and 2 of V a layer.
        assert_eq!(*from.calls.lock(), vec![(4, 1), (4, 1)]);
        assert!(to.calls.lock().is_empty(), "the source's copier copies");
        for buf in 0..4 {
            assert_eq!(dst[buf][8..16], src[buf][(3 * 4 + 1) * 8..(3 * 4 + 2) * 8]);
        }
    }

    #[tokio::test]
    async fn host_to_device_in_process_is_refused_and_lands_nothing() {
        let mut src = vec![vec![1u8; 4 * 4 * 8]; 4];
        let mut dst = vec![vec![0u8; 4 * 4 * 8]; 4];
        let s = Arc::new(region(&mut src, vec![0, 1], 0..8));
        // SAFETY: as above.
        let d = unsafe { region(&mut dst, vec![0, 1], 0..8).on_device(device(0)) };
        let landing = Arc::new(Landing::new(d, 2));
        let (target, mut recv) = channel(landing.clone());
        let mut send = LocalSender::new(s, target);
        assert!(matches!(
            send.send(0, 0, 8).await,
            Err(TransportError::MixedMemory)
        ));
        assert_eq!(landing.landed_bytes(), 0);
        assert!(dst.iter().all(|b| b.iter().all(|&x| x == 0)));
        drop(send);
        assert!(recv.complete().await.is_err());
    }
}
