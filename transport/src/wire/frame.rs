//! Framing: each message is a little-endian `u32` length and an rkyv archive. Archives are
//! validated (bytecheck) before use, so a bad peer gets an error, never undefined behaviour.

use rkyv::rancor;
use rkyv::util::AlignedVec;

use crate::TransportError;

/// Frames larger than this are refused (a token event or request is far smaller; KV payloads
/// use their own streams).
pub const MAX_FRAME: usize = 64 << 20;

/// The largest frame a reader takes for a message type. What a peer can make a reader hold
/// is bounded by the message it expects (a hello is a few dozen bytes), not by
/// [`MAX_FRAME`]; and a reader grows its buffer only as bytes arrive (`body_step`), so a
/// declared length alone commits at most [`FIRST_READ`].
pub trait Bounded {
    const MAX_BYTES: usize;
}

/// The most a reader allocates for a frame before any of its body has arrived.
pub const FIRST_READ: usize = 64 << 10;

/// The buffer length to read up to next, with `got` of `n` bytes in: at most double what
/// arrived, so memory follows the bytes a peer actually sent.
fn body_step(got: usize, n: usize) -> usize {
    n.min((2 * got).max(FIRST_READ))
}

/// A frame's declared length, refused above `T`'s bound.
fn checked_len<T: Bounded>(len: [u8; 4]) -> Result<usize, TransportError> {
    let n = u32::from_le_bytes(len) as usize;
    let max = T::MAX_BYTES.min(MAX_FRAME);
    if n > max {
        return Err(TransportError::Codec(format!(
            "a {n}-byte {} frame is over its {max}-byte limit",
            std::any::type_name::<T>()
                .rsplit("::")
                .next()
                .unwrap_or("message")
        )));
    }
    Ok(n)
}

/// What goes on the wire: any type rkyv archives with its default serializer.
pub trait Encode:
    for<'a> rkyv::Serialize<
    rkyv::api::high::HighSerializer<
        AlignedVec,
        rkyv::ser::allocator::ArenaHandle<'a>,
        rancor::Error,
    >,
>
{
}

impl<T> Encode for T where
    T: for<'a> rkyv::Serialize<
        rkyv::api::high::HighSerializer<
            AlignedVec,
            rkyv::ser::allocator::ArenaHandle<'a>,
            rancor::Error,
        >,
    >
{
}

/// Serializes a message to its frame payload.
pub fn encode<T>(msg: &T) -> Result<AlignedVec, TransportError>
where
    T: Encode,
{
    rkyv::to_bytes::<rancor::Error>(msg).map_err(|e| TransportError::Codec(e.to_string()))
}

/// Validates and deserializes a frame payload.
pub fn decode<T>(bytes: &[u8]) -> Result<T, TransportError>
where
    T: rkyv::Archive,
    T::Archived: for<'a> rkyv::bytecheck::CheckBytes<rkyv::api::high::HighValidator<'a, rancor::Error>>
        + rkyv::Deserialize<T, rkyv::api::high::HighDeserializer<rancor::Error>>,
{
    rkyv::from_bytes::<T, rancor::Error>(bytes).map_err(|e| TransportError::Codec(e.to_string()))
}

/// Writes one message as a frame.
pub async fn write_msg<T>(send: &mut quinn::SendStream, msg: &T) -> Result<(), TransportError>
where
    T: Encode,
{
    send.write_all(&frame(msg)?)
        .await
        .map_err(TransportError::from)
}

/// A message as a frame: its length, then its archive.
pub fn frame<T>(msg: &T) -> Result<Vec<u8>, TransportError>
where
    T: Encode,
{
    let mut frame = Vec::new();
    frame_into(msg, &mut frame)?;
    Ok(frame)
}

/// As [`frame`], appended to `out`: several frames written with one call, with no buffer
/// of their own each.
pub fn frame_into<T>(msg: &T, out: &mut Vec<u8>) -> Result<(), TransportError>
where
    T: Encode,
{
    let body = encode(msg)?;
    out.reserve(4 + body.len());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&body);
    Ok(())
}

/// Reads one frame from any byte stream (TCP, or a QUIC stream through tokio's traits);
/// `Ok(None)` when the stream ended cleanly between frames.
pub async fn read_frame<T, R>(r: &mut R) -> Result<Option<T>, TransportError>
where
    R: tokio::io::AsyncRead + Unpin,
    T: rkyv::Archive + Bounded,
    T::Archived: for<'a> rkyv::bytecheck::CheckBytes<rkyv::api::high::HighValidator<'a, rancor::Error>>
        + rkyv::Deserialize<T, rkyv::api::high::HighDeserializer<rancor::Error>>,
{
    use tokio::io::AsyncReadExt;
    let io = |e: std::io::Error| TransportError::Stream(e.to_string());
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        let n = r.read(&mut len[got..]).await.map_err(io)?;
        if n == 0 {
            return if got == 0 {
                Ok(None)
            } else {
                Err(TransportError::Codec(
                    "the stream ended inside a frame header".into(),
                ))
            };
        }
        got += n;
    }
    let n = checked_len::<T>(len)?;
    let mut body = AlignedVec::<16>::new();
    while body.len() < n {
        let (got, next) = (body.len(), body_step(body.len(), n));
        body.resize(next, 0);
        r.read_exact(&mut body[got..])
            .await
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::UnexpectedEof => {
                    TransportError::Codec("the stream ended inside a frame".into())
                }
                _ => io(e),
            })?;
    }
    decode(&body).map(Some)
}

/// Reads one frame; `Ok(None)` when the peer finished the stream cleanly between frames.
pub async fn read_msg<T>(recv: &mut quinn::RecvStream) -> Result<Option<T>, TransportError>
where
    T: rkyv::Archive + Bounded,
    T::Archived: for<'a> rkyv::bytecheck::CheckBytes<rkyv::api::high::HighValidator<'a, rancor::Error>>
        + rkyv::Deserialize<T, rkyv::api::high::HighDeserializer<rancor::Error>>,
{
    let mut len = [0u8; 4];
    match recv.read_exact(&mut len).await {
        Ok(()) => {}
        Err(quinn::ReadExactError::FinishedEarly(0)) => return Ok(None),
        Err(quinn::ReadExactError::FinishedEarly(_)) => {
            return Err(TransportError::Codec(
                "the stream ended inside a frame header".into(),
            ))
        }
        Err(quinn::ReadExactError::ReadError(e)) => return Err(e.into()),
    }
    let n = checked_len::<T>(len)?;
    // Aligned, so the archive can be validated and read in place.
    let mut body = AlignedVec::<16>::new();
    while body.len() < n {
        let (got, next) = (body.len(), body_step(body.len(), n));
        body.resize(next, 0);
        recv.read_exact(&mut body[got..])
            .await
            .map_err(|e| match e {
                quinn::ReadExactError::FinishedEarly(_) => {
                    TransportError::Codec("the stream ended inside a frame".into())
                }
                quinn::ReadExactError::ReadError(e) => e.into(),
            })?;
    }
    decode(&body).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::msg::*;

    #[test]
    fn messages_round_trip() {
        let r = GenerateRequest {
            request_id: 7,
            prompt: vec![1, 2, 3],
            temperature: 0.5,
            top_k: 4,
            top_p: 0.9,
            seed: Some(9),
            max_tokens: 16,
            stop_token_ids: vec![2],
            ignore_eos: true,
            logprobs: Some(2),
            resume_draws: 5,
            traceparent: Some("00-abc-def-01".into()),
            prefill: Some(PrefillPeer {
                node_id: "p1".into(),
                quic_addr: "127.0.0.1:7000".into(),
                cert_sha256: "00".repeat(32),
                min_tokens: 64,
                ucx: true,
                cuda_ipc: true,
                ucx_cuda: true,
            }),
            logit_bias: vec![TokenBias {
                token: 3,
                bias: -100.0,
            }],
            guide: Some(WireGuide {
                grammar: "{}".into(),
                replay: 2,
            }),
        };
        assert_eq!(decode::<GenerateRequest>(&encode(&r).unwrap()).unwrap(), r);
        let e = TokenEvent::Token {
            token: 5,
            logprob: -0.25,
            top: vec![TopLogprob {
                token: 5,
                logprob: -0.25,
            }],
            finish: Some(Finish::Length),
            cached_tokens: 16,
        };
        assert_eq!(decode::<TokenEvent>(&encode(&e).unwrap()).unwrap(), e);
    }

    #[test]
    fn garbage_is_an_error_not_a_crash() {
        let good = encode(&TokenEvent::Failed {
            message: "x".into(),
        })
        .unwrap();
        let mut bad = AlignedVec::<16>::new();
        bad.extend_from_slice(&good);
        for b in bad.iter_mut() {
            *b = 0xff; // no such variant, lengths pointing out of the buffer
        }
        assert!(decode::<TokenEvent>(&bad).is_err());
        let mut short = AlignedVec::<16>::new();
        short.extend_from_slice(&good[..good.len() / 2]);
        assert!(decode::<TokenEvent>(&short).is_err());
        assert!(decode::<GenerateRequest>(&[1, 2, 3]).is_err());
    }

    /// A frame's bound is its message's: a hello declaring 64 MiB is refused on its length,
    /// before anything is read or allocated; a large legitimate frame still arrives whole.
    #[tokio::test]
    async fn frames_are_bounded_by_their_message() {
        let mut hostile = (64u32 * 1024 * 1024 - 16).to_le_bytes().to_vec();
        hostile.extend_from_slice(&[0xAB; 4096]);
        let e = read_frame::<KvStreamHello, _>(&mut &hostile[..])
            .await
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("KvStreamHello") && e.contains("256-byte limit"),
            "{e}"
        );
        let e = read_frame::<LoadReport, _>(&mut &hostile[..])
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("LoadReport"), "{e}");

        let hello = KvStreamHello {
            transfer_id: 9,
            secret: 77,
            stream: 1,
        };
        let f = frame(&hello).unwrap();
        assert!(f.len() - 4 <= KvStreamHello::MAX_BYTES);
        assert_eq!(
            read_frame::<KvStreamHello, _>(&mut &f[..]).await.unwrap(),
            Some(hello)
        );

        // 3 MiB of prompt: read in growing steps, whole.
        let big = StreamRequest::Card {
            fingerprint: "f".repeat(3 << 20),
        };
        let f = frame(&big).unwrap();
        assert!(f.len() > 16 * FIRST_READ);
        assert_eq!(
            read_frame::<StreamRequest, _>(&mut &f[..]).await.unwrap(),
            Some(big)
        );
        // Cut short: an error, not a hang or a panic.
        let cut = &f[..f.len() / 2];
        assert!(read_frame::<StreamRequest, _>(&mut &cut[..]).await.is_err());
        assert_eq!(body_step(0, 10), 10);
        assert_eq!(body_step(0, 1 << 20), FIRST_READ);
        assert_eq!(body_step(FIRST_READ, 1 << 20), 2 * FIRST_READ);
    }
}
