//! The rules a request's sampling fields and messages must keep, one variant each, and the
//! one place they become OpenAI's error body: HTTP 400, `invalid_request_error`, the field
//! as `param` ([`From<Invalid> for ApiError`]). The messages name the field and what it
//! must be, as OpenAI's do.

use crate::error::{quoted, ApiError};

/// The most alternatives `logprobs`/`top_logprobs` may ask for.
pub const MAX_LOGPROBS: i64 = 20;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Invalid {
    /// `max_tokens` or `max_completion_tokens` below 1.
    #[error("`{field}` must be at least 1, got {got}.")]
    MaxTokens { field: &'static str, got: i64 },
    #[error("`temperature` must be 0 or more, got {0}.")]
    Temperature(f64),
    #[error("`top_p` must be in (0, 1], got {0}.")]
    TopP(f64),
    #[error("`top_k` must be -1 (off), 0 (off) or positive, got {0}.")]
    TopK(i64),
    #[error("Only n = 1 is supported, got {0}.")]
    N(i64),
    /// `presence_penalty` or `frequency_penalty` other than 0.
    #[error("`{0}` is not supported; send 0 or leave it out.")]
    Penalty(&'static str),
    #[error("Stop strings must not be empty.")]
    EmptyStop,
    #[error("`seed` must be 0 or more, got {0}.")]
    Seed(i64),
    #[error("`stream_options` needs `stream: true`.")]
    StreamOptionsWithoutStream,
    #[error("`top_logprobs` must be between 0 and {MAX_LOGPROBS}, got {0}.")]
    TopLogprobs(i64),
    #[error("`top_logprobs` needs `logprobs: true`.")]
    TopLogprobsWithoutLogprobs,
    #[error("`logprobs` must be between 0 and {MAX_LOGPROBS}, got {0}.")]
    Logprobs(i64),
    #[error("`messages` must not be empty.")]
    NoMessages,
    #[error("Unknown role {}; use system, user, assistant or tool.", quoted(.role))]
    Role { message: usize, role: String },
    #[error(
        "Content parts of type {} are not supported; this model reads text.",
        quoted(.kind)
    )]
    ContentPart { message: usize, kind: String },
    /// An earlier tool call (`at` is its path, `messages[i].tool_calls[j]`) without a
    /// `function` object.
    #[error("A tool call needs a `function` object.")]
    CallFunction { at: String },
    #[error("A tool call needs a function `name`.")]
    CallName { at: String },
    #[error("`arguments` is not JSON: {error}")]
    CallArgumentsJson { at: String, error: String },
    #[error("`arguments` must be a JSON object, or a string holding one.")]
    CallArgumentsKind { at: String },
}

impl Invalid {
    /// The request field the error is about, as OpenAI's `param` names it.
    pub fn param(&self) -> String {
        use Invalid as I;
        match self {
            I::MaxTokens { field, .. } => (*field).into(),
            I::Temperature(_) => "temperature".into(),
            I::TopP(_) => "top_p".into(),
            I::TopK(_) => "top_k".into(),
            I::N(_) => "n".into(),
            I::Penalty(field) => (*field).into(),
            I::EmptyStop => "stop".into(),
            I::Seed(_) => "seed".into(),
            I::StreamOptionsWithoutStream => "stream_options".into(),
            I::TopLogprobs(_) | I::TopLogprobsWithoutLogprobs => "top_logprobs".into(),
            I::Logprobs(_) => "logprobs".into(),
            I::NoMessages => "messages".into(),
            I::Role { message, .. } => format!("messages[{message}].role"),
            I::ContentPart { message, .. } => format!("messages[{message}].content"),
            I::CallFunction { at } => format!("{at}.function"),
            I::CallName { at } => format!("{at}.function.name"),
            I::CallArgumentsJson { at, .. } | I::CallArgumentsKind { at } => {
                format!("{at}.function.arguments")
            }
        }
    }
}

impl From<Invalid> for ApiError {
    fn from(e: Invalid) -> ApiError {
        ApiError::param(&e.param(), e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;

    #[test]
    fn every_rule_is_a_400_naming_its_field() {
        let cases = [
            (
                Invalid::MaxTokens {
                    field: "max_completion_tokens",
                    got: 0,
                },
                "max_completion_tokens",
                "`max_completion_tokens` must be at least 1, got 0.",
            ),
            (
                Invalid::Temperature(-0.5),
                "temperature",
                "`temperature` must be 0 or more, got -0.5.",
            ),
            (
                Invalid::TopP(0.0),
                "top_p",
                "`top_p` must be in (0, 1], got 0.",
            ),
            (Invalid::TopK(-2), "top_k", "got -2."),
            (Invalid::N(2), "n", "Only n = 1 is supported, got 2."),
            (
                Invalid::Penalty("presence_penalty"),
                "presence_penalty",
                "`presence_penalty` is not supported",
            ),
            (Invalid::EmptyStop, "stop", "must not be empty"),
            (
                Invalid::Seed(-1),
                "seed",
                "`seed` must be 0 or more, got -1.",
            ),
            (
                Invalid::StreamOptionsWithoutStream,
                "stream_options",
                "needs `stream: true`",
            ),
            (
                Invalid::TopLogprobs(21),
                "top_logprobs",
                "between 0 and 20, got 21.",
            ),
            (
                Invalid::TopLogprobsWithoutLogprobs,
                "top_logprobs",
                "needs `logprobs: true`",
            ),
            (
                Invalid::Logprobs(-1),
                "logprobs",
                "between 0 and 20, got -1.",
            ),
            (
                Invalid::NoMessages,
                "messages",
                "`messages` must not be empty.",
            ),
            (
                Invalid::Role {
                    message: 3,
                    role: "robot".into(),
                },
                "messages[3].role",
                "Unknown role `robot`",
            ),
            (
                Invalid::ContentPart {
                    message: 1,
                    kind: "image_url".into(),
                },
                "messages[1].content",
                "type `image_url` are not supported",
            ),
            (
                Invalid::CallFunction {
                    at: "messages[2].tool_calls[0]".into(),
                },
                "messages[2].tool_calls[0].function",
                "needs a `function` object",
            ),
            (
                Invalid::CallName { at: "m".into() },
                "m.function.name",
                "function `name`",
            ),
            (
                Invalid::CallArgumentsJson {
                    at: "m".into(),
                    error: "EOF".into(),
                },
                "m.function.arguments",
                "`arguments` is not JSON: EOF",
            ),
            (
                Invalid::CallArgumentsKind { at: "m".into() },
                "m.function.arguments",
                "must be a JSON object",
            ),
        ];
        for (e, param, text) in cases {
            let api = ApiError::from(e.clone());
            assert_eq!(api.status, StatusCode::BAD_REQUEST, "{e:?}");
            assert_eq!(api.kind, "invalid_request_error", "{e:?}");
            assert_eq!(api.param.as_deref(), Some(param), "{e:?}");
            assert!(api.message.contains(text), "{e:?}: {}", api.message);
            assert_eq!(api.code, None, "{e:?}");
        }
    }

    #[test]
    fn a_huge_role_is_quoted_short() {
        let e = Invalid::Role {
            message: 0,
            role: "r".repeat(1 << 20),
        };
        let m = e.to_string();
        assert!(
            m.len() < 400 && m.contains("(1048576 bytes)"),
            "{}",
            m.len()
        );
    }
}
