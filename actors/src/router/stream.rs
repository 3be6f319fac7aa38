//! One attempt's stream from a worker: the request goes out on a QUIC stream, the worker's
//! token events come back and go on to the client.

use std::sync::atomic::Ordering;

use kvmesh_gateway::dispatch::Event;
use kvmesh_gpu::engine::SeqEvent;
use kvmesh_transport::wire::{self, GenerateRequest, StreamRequest, TokenEvent};
use tokio::sync::mpsc;

use super::attempts::{Outcome, Streamed};
use super::links::{PrefillInFlight, QueuedPrompt, WorkerLink};
use crate::convert;

/// Sends `req` to the worker and forwards its tokens to `tx` until the last one, a failure,
/// or the client leaving. The first token ends the prompt's wait: `prefill` and `queued` are
/// let go then.
pub(crate) async fn stream_from(
    link: &WorkerLink,
    req: &GenerateRequest,
    tx: &mpsc::UnboundedSender<Event>,
    prefill: &mut Option<PrefillInFlight>,
    queued: &mut Option<QueuedPrompt>,
    sent: &mut Streamed,
) -> Outcome {
    let Some(conn) = link.connection() else {
        return Outcome::NotStarted("not connected".into());
    };
    let (mut send, mut recv) = match conn.open_bi().await {
        Ok(s) => s,
        Err(e) => return Outcome::NotStarted(e.to_string()),
    };
    if let Err(e) = wire::write_msg(&mut send, &StreamRequest::Generate(req.clone())).await {
        return Outcome::NotStarted(e.to_string());
    }

    let _ = send.finish();
    let mut tokens = 0usize;
    loop {
        let broken = |reason: String| {
            if tokens == 0 {
                Outcome::NotStarted(reason)
            } else {
                Outcome::Broken { tokens, reason }
            }
        };
        match wire::read_msg::<TokenEvent>(&mut recv).await {
            Ok(Some(TokenEvent::Token {
                token,
                logprob,
                top,
                finish,
                cached_tokens,
            })) => {
                tokens += 1;
                // The prompt is prefilled: the prefill node no longer holds it.
                prefill.take();
                queued.take();
                if tokens == 1 && !link.hot.streamed.load(Ordering::Relaxed) {
                    link.hot.streamed.store(true, Ordering::Relaxed);
                }
                let ev = sent.push(
                    tokens,
                    convert::sampled_from_wire(token, logprob, top),
                    finish.map(convert::finish_from_wire),
                    cached_tokens as usize,
                );
                if tx.send(ev).is_err() {
                    return Outcome::ClientGone;
                }
                if finish.is_some() {
                    return Outcome::Done;
                }
            }
            Ok(Some(TokenEvent::Rejected {
                message,
                retryable,
                queue_full,
            })) => {
                if queue_full && tokens == 0 {
                    return Outcome::Full(message);
                }
                if retryable && tokens == 0 {
                    return Outcome::NotStarted(message);
                }
                let _ = tx.send(Event::Engine(SeqEvent::Failed(message)));
                return Outcome::Done;
            }
            Ok(Some(TokenEvent::Failed { message })) => {
                let _ = tx.send(Event::Engine(SeqEvent::Failed(message)));
                return Outcome::Done;
            }
            Ok(None) => return broken("the worker closed the stream early".into()),
            Err(e) => return broken(e.to_string()),
        }
    }
}
