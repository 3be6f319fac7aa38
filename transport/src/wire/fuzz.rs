//! Every decoder of the wire, run on arbitrary bytes: what `fuzz/fuzz_targets/wire.rs`
//! (cargo-fuzz, by hand) and this module's bounded smoke test (every CI run) call. A peer
//! sends whatever it likes; every input must come back as a value or an error, never a
//! panic, and never an allocation beyond the message type's bound.

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use rkyv::util::AlignedVec;

use super::frame::{decode, read_frame, Bounded};
use super::msg::*;

/// Decodes `data` as each message type (a frame's payload), then reads it as a stream of
/// frames of each type until the bytes or the frames run out.
pub fn decode_all(data: &[u8]) {
    let mut aligned = AlignedVec::<16>::new();
    aligned.extend_from_slice(data);
    macro_rules! each {
        ($($t:ty),* $(,)?) => {$(
            let _ = decode::<$t>(&aligned);
            frames::<$t>(data);
        )*};
    }
    each!(
        GenerateRequest,
        StreamRequest,
        CardReply,
        TokenEvent,
        KvEventBatch,
        PrefillEvent,
        UniHeader,
        LoadReport,
        KvStreamHello,
        KvPiece,
        KvLandedNotice,
    );
}

/// Reads frames of `T` from `data` until it ends or a frame is refused. A byte slice is
/// always ready, so each read completes in one poll.
fn frames<T>(mut data: &[u8])
where
    T: rkyv::Archive + Bounded,
    T::Archived: for<'a> rkyv::bytecheck::CheckBytes<rkyv::api::high::HighValidator<'a, rkyv::rancor::Error>>
        + rkyv::Deserialize<T, rkyv::api::high::HighDeserializer<rkyv::rancor::Error>>,
{
    let mut cx = Context::from_waker(Waker::noop());
    loop {
        let read = pin!(read_frame::<T, _>(&mut data));
        match read.poll(&mut cx) {
            Poll::Ready(Ok(Some(_))) => continue,
            Poll::Ready(_) | Poll::Pending => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::frame::{encode, frame};

    /// Valid frames to start from: the mutations then reach deep into the archives instead
    /// of failing at the first byte.
    fn seeds() -> Vec<Vec<u8>> {
        let req = GenerateRequest {
            request_id: 7,
            prompt: (0..40).collect(),
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
                cuda_ipc: false,
                ucx_cuda: false,
            }),
            logit_bias: vec![TokenBias {
                token: 3,
                bias: -100.0,
            }],
            guide: Some(WireGuide {
                grammar: "{\"type\": \"object\"}".into(),
                replay: 2,
            }),
        };
        let token = TokenEvent::Token {
            token: 5,
            logprob: -0.25,
            top: vec![TopLogprob {
                token: 5,
                logprob: -0.25,
            }],
            finish: Some(Finish::Length),
            cached_tokens: 16,
        };
        let failed = TokenEvent::Failed {
            message: "no".into(),
        };
        let mut two = frame(&token).unwrap();
        two.extend(frame(&failed).unwrap());
        vec![
            encode(&req).unwrap().to_vec(),
            frame(&req).unwrap(),
            encode(&token).unwrap().to_vec(),
            two,
            Vec::new(),
            vec![0xff; 64],
        ]
    }

    /// xorshift64*: reproducible mutations without a dependency.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }

        fn below(&mut self, n: usize) -> usize {
            (self.next() % n.max(1) as u64) as usize
        }
    }

    /// One mutation of the kinds that find decoder bugs: flipped bits, overwritten bytes
    /// (often lengths and offsets), cuts, doubled spans and forged length prefixes.
    fn mutate(rng: &mut Rng, mut v: Vec<u8>) -> Vec<u8> {
        for _ in 0..1 + rng.below(4) {
            let at = rng.below(v.len());
            match rng.below(6) {
                0 if !v.is_empty() => v[at] ^= 1 << rng.below(8),
                1 if !v.is_empty() => v[at] = [0, 0xff, 0x7f, 0x80, 1][rng.below(5)],
                2 => v.truncate(at),
                3 if !v.is_empty() => {
                    let end = (at + 1 + rng.below(16)).min(v.len());
                    let span = v[at..end].to_vec();
                    v.splice(at..at, span);
                }
                4 if v.len() >= 4 => {
                    let len = [0u32, 1, 3, u32::MAX, 64 << 20, (v.len() as u32) * 2][rng.below(6)];
                    v[..4].copy_from_slice(&len.to_le_bytes());
                }
                _ => v.push(rng.next() as u8),
            }
        }
        v
    }

    #[test]
    fn mutated_and_random_frames_never_panic_any_decoder() {
        let seeds = seeds();
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        // Bounded: about a second in the test build.
        for i in 0..20_000 {
            let input = if i % 10 == 0 {
                (0..rng.below(256)).map(|_| rng.next() as u8).collect()
            } else {
                let seed = seeds[rng.below(seeds.len())].clone();
                mutate(&mut rng, seed)
            };
            decode_all(&input);
        }
    }

    #[test]
    fn the_seeds_decode_as_what_they_are() {
        // The harness reaches real values, not only errors: the seeds themselves decode.
        let s = seeds();
        let mut a = AlignedVec::<16>::new();
        a.extend_from_slice(&s[0]);
        assert!(decode::<GenerateRequest>(&a).is_ok());
        let mut data = &s[3][..];
        let mut cx = Context::from_waker(Waker::noop());
        let mut got = 0;
        loop {
            let read = pin!(read_frame::<TokenEvent, _>(&mut data));
            match read.poll(&mut cx) {
                Poll::Ready(Ok(Some(_))) => got += 1,
                other => {
                    assert!(matches!(other, Poll::Ready(Ok(None))));
                    break;
                }
            }
        }
        assert_eq!(got, 2);
    }
}
