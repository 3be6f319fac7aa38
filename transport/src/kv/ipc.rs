//! KV over CUDA IPC: a prefill process copies on the GPU straight into the KV pool of a
//! decode process of the same host.
//!
//! # The exchange
//!
//! 1. The decode worker's pool is one device allocation it exported once (the driver's IPC
//!    handle); [`DataPath::CudaIpc`](crate::wire::DataPath::CudaIpc) carries the handle, each
//!    layer buffer's offset in it, and the host's boot id.
//! 2. The prefill worker refuses a handle from another host, maps the pool (once per
//!    export; the mapping is cached by the caller), and for each piece copies every run of
//!    positions from its own blocks into the decode worker's, on the device, with its
//!    engine's copier: one kernel a piece where both caches are on one GPU.
//! 3. The copy returns once it has completed; only then does the sender write a
//!    [`KvLandedNotice`] on a QUIC stream of the request's connection, as UCX's lanes do,
//!    and the decode worker's [`UcxReceiver`](super::ucx::UcxReceiver) checks it as it checks
//!    a UCX notice (the transfer, the order, the blocks) and counts the positions landed.
//!
//! A prefill process that dies mid-copy ends its stream; the decode worker gives the
//! transfer up as with every transport, and holds the blocks until the stream has ended.

use std::sync::Arc;

use super::ucx::NoticeStream;
use super::{pair_runs, Kind, KvRegion, KvSender, RegionMemory, TransferTotals};
use crate::wire::{self, KvLandedNotice, KvPiece, KvStreamHello, UniHeader};
use crate::TransportError;

/// The transport layer notices name, for traces (`ucx_tl`).
pub const TL: &str = "cuda-ipc";

/// This host's identity for CUDA IPC: Linux's boot id, which two processes share exactly
/// when they run on one booted machine. `None` where the system does not say.
pub fn host_id() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

/// Sends a transfer by copies into another process's mapped pool.
pub struct IpcSender {
    source: Arc<KvRegion>,
    dest: KvRegion,
    stream: NoticeStream,
    transfer_id: u64,
    registration: u64,
    totals: TransferTotals,
}

impl IpcSender {
    /// Opens the notice stream on `conn` (the decode worker's connection).
    ///
    /// `source` is this worker's blocks and `dest` the decode worker's, both device
    /// regions: `dest` addresses the mapped pool with the decode worker's block table.
    pub async fn quic(
        conn: &quinn::Connection,
        source: Arc<KvRegion>,
        dest: KvRegion,
        (transfer_id, secret, registration): (u64, u64, u64),
    ) -> Result<IpcSender, TransportError> {
        let mut stream = NoticeStream::Quic(conn.open_uni().await?);
        let hello = UniHeader::Kv(KvStreamHello {
            transfer_id,
            secret,
            stream: 0,
        });
        stream.write(&wire::frame(&hello)?).await?;
        IpcSender::new(source, dest, stream, transfer_id, registration)
    }

    /// A sender on an open stream whose hello is written.
    pub fn new(
        source: Arc<KvRegion>,
        dest: KvRegion,
        stream: NoticeStream,
        transfer_id: u64,
        registration: u64,
    ) -> Result<IpcSender, TransportError> {
        for r in [&*source, &dest] {
            if let RegionMemory::Host = r.memory() {
                return Err(TransportError::MixedMemory);
            }
        }
        if source.bytes_per_pos() != dest.bytes_per_pos()
            || source.num_layers() != dest.num_layers()
        {
            return Err(TransportError::Codec(format!(
                "the decode pool has {} layers of {} bytes a position, this worker's {} of {}",
                dest.num_layers(),
                dest.bytes_per_pos(),
                source.num_layers(),
                source.bytes_per_pos()
            )));
        }
        Ok(IpcSender {
            source,
            dest,
            stream,
            transfer_id,
            registration,
            totals: TransferTotals::default(),
        })
    }
}

#[async_trait::async_trait]
impl KvSender for IpcSender {
    async fn send(&mut self, layer: usize, first: usize, n: usize) -> Result<(), TransportError> {
        if n == 0 {
            return Ok(());
        }
        let mut src = self.source.any_segments(layer, Kind::K, first, n)?;
        src.extend(self.source.any_segments(layer, Kind::V, first, n)?);
        let mut dst = self.dest.any_segments(layer, Kind::K, first, n)?;
        dst.extend(self.dest.any_segments(layer, Kind::V, first, n)?);
        let runs = pair_runs(&src, &dst);
        let (RegionMemory::Device(from), RegionMemory::Device(to)) =
            (self.source.memory(), self.dest.memory())
        else {
            return Err(TransportError::MixedMemory);
        };
        // SAFETY: the source positions are computed and this transfer's to read (its lease);
        // the destination ones are reserved for this transfer by the decode worker, which
        // reads them only after the notice below; `any_segments` kept both inside their
        // pools.
        unsafe { from.copy(&runs, to.device()) }.map_err(TransportError::DeviceCopy)?;
        let bpp = self.source.bytes_per_pos();
        let notice = KvLandedNotice {
            piece: KvPiece {
                transfer_id: self.transfer_id,
                layer: layer as u32,
                first_pos: first as u32,
                num_pos: n as u32,
                blocks: self.dest.blocks_of(first, n).to_vec(),
                bytes_per_pos: bpp as u32,
                payload_bytes: (2 * n * bpp) as u64,
            },
            registration: self.registration,
            checksum: None,
            tl: TL.to_string(),
        };
        self.stream.write(&wire::frame(&notice)?).await?;
        self.totals.bytes += notice.piece.payload_bytes;
        self.totals.pieces += 1;
        Ok(())
    }

    async fn finish(&mut self) -> Result<TransferTotals, TransportError> {
        self.stream.close().await?;
        Ok(self.totals)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::streams::KvInbound;
    use crate::kv::tests::{device, region};
    use crate::kv::ucx::UcxReceiver;
    use crate::kv::{KvReceiver, Landing};
    use tokio::sync::mpsc;

    /// The protocol without a GPU: host buffers stand for both pools, the copier copies
    /// them, and the decode side's receiver checks the notices and counts the landing.
    #[tokio::test]
    async fn copies_then_notices_land_every_position_and_the_receiver_checks_them() {
        let mut src = vec![vec![0u8; 4 * 4 * 8]; 4];
        for (i, m) in src.iter_mut().enumerate() {
            for (j, b) in m.iter_mut().enumerate() {
                *b = (5 * i + 3 * j + 1) as u8;
            }
        }
        let mut dst = vec![vec![0u8; 4 * 4 * 8]; 4];
        let from = device(0);
        // SAFETY: the buffers stand for device memory the copier copies.
        let s = unsafe { region(&mut src, vec![2, 0, 3], 4..11).on_device(from.clone()) };
        let d_send = unsafe { region(&mut dst, vec![1, 3, 0], 4..11).on_device(device(0)) };
        let d_land = unsafe { region(&mut dst, vec![1, 3, 0], 4..11).on_device(device(0)) };
        let landing = Arc::new(Landing::new(d_land, 9));
        let (tx, rx) = mpsc::unbounded_channel();
        let (w, r) = tokio::io::duplex(1 << 16);
        tx.send(Box::new(r) as KvInbound).unwrap();
        let mut recv = UcxReceiver::new(landing.clone(), rx, 1, false, 77);
        let mut send =
            IpcSender::new(Arc::new(s), d_send, NoticeStream::Other(Box::new(w)), 9, 77).unwrap();
        for layer in 0..2 {
            send.send(layer, 4, 3).await.unwrap();
            send.send(layer, 7, 4).await.unwrap();
        }
        let t = send.finish().await.unwrap();
        assert_eq!(t.pieces, 4);
        assert_eq!(recv.complete().await.unwrap(), t);
        assert_eq!(from.calls.lock().len(), 4, "one copy call a piece");
        for buf in 0..4 {
            // Position 9: source block 3, destination block 0, offset 1.
            assert_eq!(dst[buf][8..16], src[buf][(3 * 4 + 1) * 8..(3 * 4 + 2) * 8]);
        }
    }

    #[tokio::test]
    async fn a_notice_naming_another_export_fails_the_transfer() {
        let mut src = vec![vec![1u8; 4 * 4 * 8]; 4];
        let mut dst = vec![vec![0u8; 4 * 4 * 8]; 4];
        let s = unsafe { region(&mut src, vec![0, 1], 0..8).on_device(device(0)) };
        let d_send = unsafe { region(&mut dst, vec![0, 1], 0..8).on_device(device(0)) };
        let d_land = unsafe { region(&mut dst, vec![0, 1], 0..8).on_device(device(0)) };
        let (tx, rx) = mpsc::unbounded_channel();
        let (w, r) = tokio::io::duplex(1 << 16);
        tx.send(Box::new(r) as KvInbound).unwrap();
        let mut recv = UcxReceiver::new(Arc::new(Landing::new(d_land, 3)), rx, 1, false, 1);
        let mut send =
            IpcSender::new(Arc::new(s), d_send, NoticeStream::Other(Box::new(w)), 3, 2).unwrap();
        for layer in 0..2 {
            send.send(layer, 0, 8).await.unwrap();
        }
        send.finish().await.unwrap();
        let e = recv.complete().await.unwrap_err().to_string();
        assert!(e.contains("registration"), "{e}");
    }

    #[test]
    fn host_memory_is_refused_on_either_side() {
        let mut a = vec![vec![0u8; 4 * 4 * 8]; 4];
        let mut b = vec![vec![0u8; 4 * 4 * 8]; 4];
        let host = region(&mut a, vec![0], 0..4);
        let dev = unsafe { region(&mut b, vec![0], 0..4).on_device(device(0)) };
        let (w, _r) = tokio::io::duplex(64);
        assert!(matches!(
            IpcSender::new(Arc::new(host), dev, NoticeStream::Other(Box::new(w)), 1, 1),
            Err(TransportError::MixedMemory)
        ));
    }
}
