//! kv-bench's UCX rows: a transfer between two UCX workers of this process, exactly as a
//! prefill and a decode worker move one (the destination pool registered, puts into its
//! blocks, a notice per piece after a flush), over the UCX transports `tls` names.

use std::sync::Arc;

use kvmesh_gpu::kv_pool::{HostKvPool, KvKind};
use kvmesh_transport::kv::streams::{KvInbound, Target};
use kvmesh_transport::kv::ucx::{
    remote_keys, wire_buffers, MemoryType, NoticeStream, Registration, Ucx, UcxError, UcxOptions,
    UcxReceiver, UcxSender,
};
use kvmesh_transport::kv::{KvReceiver, KvRegion, KvSender, Landing};

/// Two UCX workers (one per side) and the destination pool's registration.
pub struct UcxPair {
    prefill: Ucx,
    decode: Ucx,
    reg: Registration,
    pub tl: String,
}

impl UcxPair {
    /// Registers `dst` (every layer's K and V) with the decode side's worker.
    pub async fn new(dst: &Arc<HostKvPool>, tls: &str) -> Result<UcxPair, UcxError> {
        let opts = UcxOptions {
            tls: Some(tls.to_string()),
        };
        let (prefill, decode) = (Ucx::start(&opts)?, Ucx::start(&opts)?);
        let bufs = (0..dst.spec().num_layers)
            .flat_map(|l| {
                [KvKind::K, KvKind::V].map(|k| (dst.base(l, k) as usize, dst.layer_bytes()))
            })
            .collect();
        // SAFETY: the bench keeps the destination pool alive past the pair.
        let reg = unsafe { decode.register(bufs, MemoryType::Host) }.await?;
        let mut pair = UcxPair {
            prefill,
            decode,
            reg,
            tl: String::new(),
        };
        pair.tl = pair.prefill.transport_to(pair.decode.address()).await?;
        Ok(pair)
    }

    /// One transfer's sender and receiver, notices on `lanes` in-memory streams.
    pub fn transfer(
        &self,
        landing: Arc<Landing>,
        source: Arc<KvRegion>,
        dest_blocks: Vec<u32>,
        lanes: usize,
    ) -> (Box<dyn KvSender>, Box<dyn KvReceiver>) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let mut streams = Vec::new();
        for _ in 0..lanes {
            let (w, r) = tokio::io::duplex(1 << 16);
            tx.send(Box::new(r) as KvInbound).expect("open");
            streams.push((NoticeStream::Other(Box::new(w)), Vec::new()));
        }
        let target = Target {
            source,
            transfer_id: landing.transfer_id,
            dest_blocks,
            span: tracing::Span::none(),
        };
        let keys = remote_keys(
            &self.decode.address(),
            self.reg.id,
            &wire_buffers(&self.reg),
        );
        let sender = UcxSender::start(self.prefill.clone(), target, keys, streams, false)
            .expect("the registration covers every layer");
        let receiver = UcxReceiver::new(Arc::clone(&landing), rx, lanes, false, self.reg.id);
        (Box::new(sender), Box::new(receiver))
    }
}
