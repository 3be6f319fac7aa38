//! The one place where requests and token events change form between the engine's types
//! (what a gateway submits, what an engine emits) and the wire's (what travels between
//! nodes). The router encodes with these and the worker decodes with them, so a field added
//! to one side cannot be forgotten on the other.

use kvmesh_gpu::engine::{FinishReason, Request};
use kvmesh_gpu::guided::Guide;
use kvmesh_gpu::sampler::{Sampled, SamplingParams};
use kvmesh_transport::wire::{
    Finish, GenerateRequest, TokenBias, TokenEvent, TopLogprob, WireGuide,
};

/// A submitted request as a router sends it to a worker (no trace context, no prefill peer:
/// the attempt adds those).
pub fn request_to_wire(request_id: u64, req: &Request) -> GenerateRequest {
    let p = &req.params;
    GenerateRequest {
        request_id,
        prompt: req.prompt.clone(),
        temperature: p.temperature,
        top_k: p.top_k.min(u32::MAX as usize) as u32,
        top_p: p.top_p,
        seed: p.seed,
        max_tokens: p.max_tokens.min(u32::MAX as usize) as u32,
        stop_token_ids: p.stop_token_ids.clone(),
        ignore_eos: p.ignore_eos,
        logprobs: p.logprobs.map(|n| n as u32),
        resume_draws: p.resume_draws,
        traceparent: None,
        prefill: None,
        logit_bias: p
            .logit_bias
            .iter()
            .map(|&(token, bias)| TokenBias { token, bias })
            .collect(),
        guide: p.guide.as_ref().map(|g| WireGuide {
            grammar: g.grammar.to_string(),
            replay: g.replay.min(u32::MAX as usize) as u32,
        }),
    }
}

/// A wire request as the worker's engine takes it.
pub fn request_from_wire(r: &GenerateRequest) -> Request {
    Request {
        prompt: r.prompt.clone(),
        params: SamplingParams {
            temperature: r.temperature,
            top_k: r.top_k as usize,
            top_p: r.top_p,
            seed: r.seed,
            max_tokens: r.max_tokens as usize,
            stop_token_ids: r.stop_token_ids.clone(),
            ignore_eos: r.ignore_eos,
            logprobs: r.logprobs.map(|n| n as usize),
            resume_draws: r.resume_draws,
            logit_bias: r.logit_bias.iter().map(|b| (b.token, b.bias)).collect(),
            guide: r.guide.as_ref().map(|g| Guide {
                grammar: g.grammar.as_str().into(),
                replay: g.replay as usize,
            }),
        },
    }
}

pub fn finish_to_wire(f: FinishReason) -> Finish {
    match f {
        FinishReason::Stop => Finish::Stop,
        FinishReason::Length => Finish::Length,
    }
}

pub fn finish_from_wire(f: Finish) -> FinishReason {
    match f {
        Finish::Stop => FinishReason::Stop,
        Finish::Length => FinishReason::Length,
    }
}

pub fn top_to_wire(top: &[(u32, f32)]) -> Vec<TopLogprob> {
    top.iter()
        .map(|&(token, logprob)| TopLogprob { token, logprob })
        .collect()
}

/// A token drawn on another node, as the engine's sampler would have given it.
pub fn sampled_from_wire(token: u32, logprob: f32, top: Vec<TopLogprob>) -> Sampled {
    Sampled {
        token,
        logprob,
        top: top.into_iter().map(|t| (t.token, t.logprob)).collect(),
    }
}

/// One generated token as a worker streams it to its router.
pub fn token_to_wire(
    sampled: &Sampled,
    finish: Option<FinishReason>,
    cached_tokens: usize,
) -> TokenEvent {
    TokenEvent::Token {
        token: sampled.token,
        logprob: sampled.logprob,
        top: top_to_wire(&sampled.top),
        finish: finish.map(finish_to_wire),
        cached_tokens: cached_tokens as u32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_survives_the_trip_to_a_worker() {
        let req = Request {
            prompt: vec![5, 6, 7],
            params: SamplingParams {
                temperature: 0.7,
                top_k: 40,
                top_p: 0.9,
                seed: Some(3),
                max_tokens: 12,
                stop_token_ids: vec![2],
                ignore_eos: true,
                logprobs: Some(4),
                resume_draws: 9,
                logit_bias: vec![(5, -100.0), (8, 2.5)],
                guide: Some(Guide {
                    grammar: "{\"grammars\":[]}".into(),
                    replay: 3,
                }),
            },
        };
        let wire = request_to_wire(11, &req);
        assert_eq!(wire.request_id, 11);
        assert!(wire.traceparent.is_none() && wire.prefill.is_none());
        let back = request_from_wire(&wire);
        assert_eq!(back.prompt, req.prompt);
        assert_eq!(format!("{:?}", back.params), format!("{:?}", req.params));
    }

    #[test]
    fn a_token_survives_the_trip_to_the_router() {
        let s = Sampled {
            token: 9,
            logprob: -0.5,
            top: vec![(9, -0.5), (3, -1.5)],
        };
        let TokenEvent::Token {
            token,
            logprob,
            top,
            finish,
            cached_tokens,
        } = token_to_wire(&s, Some(FinishReason::Length), 32)
        else {
            panic!("a token event");
        };
        assert_eq!(cached_tokens, 32);
        assert_eq!(finish.map(finish_from_wire), Some(FinishReason::Length));
        let back = sampled_from_wire(token, logprob, top);
        assert_eq!(
            (back.token, back.logprob, back.top),
            (s.token, s.logprob, s.top)
        );
    }
}
