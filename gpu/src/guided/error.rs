//! Why a grammar cannot be followed: one variant per rule, the model's side apart from the
//! request's. The texts are what a client reads (through the gateway's 400s) and what the
//! engine reports when a sequence's matcher fails.

/// What went wrong preparing, compiling or following a grammar.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GuidedError {
    // The model's side: its tokenizer cannot drive a grammar, whatever the request.
    #[error("cannot read this tokenizer's vocabulary for constrained decoding: {0}")]
    Vocabulary(String),
    #[error("the tokenizer has {tokens} tokens but the model only {logits} logits")]
    MoreTokensThanLogits { tokens: usize, logits: usize },
    #[error("the model has no eos token to end a constrained output with")]
    NoEos,
    /// llguidance refused to set up its parser factory over the vocabulary.
    #[error("{0}")]
    Setup(String),

    // The request's side.
    #[error("the grammar does not serialise: {0}")]
    Serialise(String),
    #[error("the grammar is not llguidance JSON: {0}")]
    NotJson(String),
    #[error("the grammar is {size} bytes, over the {limit} allowed")]
    TooLarge { size: usize, limit: usize },
    /// Nested past `depth::MAX_GRAMMAR_DEPTH`; the text names what and the limit.
    #[error("{0}")]
    TooDeep(String),
    #[error("the grammar did not compile within {limit_ms} ms")]
    CompileTimeout { limit_ms: u128 },
    #[error("the grammar took {took_ms} ms to compile, over the {limit_ms} ms allowed")]
    CompileSlow { took_ms: u128, limit_ms: u128 },
    #[error("cannot start compiling the grammar: {0}")]
    CompileThread(String),
    /// llguidance's reason the grammar (a schema, a regex, Lark) does not compile.
    #[error("{0}")]
    Invalid(String),
    #[error("the grammar replays {replay} tokens of a {prompt}-token prompt")]
    Replay { replay: usize, prompt: usize },
    /// The matcher failed: a token the grammar does not allow, or llguidance's own error
    /// while following it.
    #[error("{0}")]
    Rejected(String),
}

impl GuidedError {
    /// Whether the model, not the request, is what cannot be constrained (a server's 5xx
    /// rather than a client's 4xx).
    pub fn is_model_side(&self) -> bool {
        matches!(
            self,
            GuidedError::Vocabulary(_)
                | GuidedError::MoreTokensThanLogits { .. }
                | GuidedError::NoEos
                | GuidedError::Setup(_)
                | GuidedError::CompileThread(_)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn texts_name_the_rule_and_the_side_is_known() {
        let e = GuidedError::TooLarge {
            size: 300_000,
            limit: 262_144,
        };
        assert_eq!(
            e.to_string(),
            "the grammar is 300000 bytes, over the 262144 allowed"
        );
        assert!(!e.is_model_side());
        let e = GuidedError::MoreTokensThanLogits {
            tokens: 10,
            logits: 8,
        };
        assert_eq!(
            e.to_string(),
            "the tokenizer has 10 tokens but the model only 8 logits"
        );
        assert!(e.is_model_side());
        assert!(GuidedError::NoEos.is_model_side());
        for request_side in [
            GuidedError::NotJson("x".into()),
            GuidedError::TooDeep("x".into()),
            GuidedError::CompileTimeout { limit_ms: 5 },
            GuidedError::Invalid("x".into()),
            GuidedError::Replay {
                replay: 3,
                prompt: 2,
            },
            GuidedError::Rejected("x".into()),
        ] {
            assert!(!request_side.is_model_side(), "{request_side:?}");
        }
    }
}
