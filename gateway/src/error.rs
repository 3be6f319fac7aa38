//! Every way a request can fail, as the OpenAI API reports it:
//! `{"error": {"message", "type", "param", "code"}}` with the matching HTTP status.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use kvmesh_gpu::EngineError;

/// The most bytes of a client's text an error message quotes ([`client_text`]).
pub const CLIENT_TEXT_MAX: usize = 200;

/// The most bytes of an error message a trace keeps (the span store cuts longer ones too).
pub const TRACE_TEXT_MAX: usize = 1024;

/// Client-supplied text as an error message may echo it: whole if at most
/// [`CLIENT_TEXT_MAX`] bytes, else cut there (on a char boundary) and marked with its length,
/// `abc… (1048576 bytes)`. Messages that quote request content go back to the client and
/// onto the request's trace, so a huge field must not be copied into them.
pub fn client_text(s: &str) -> std::borrow::Cow<'_, str> {
    kvmesh_telemetry::clip(s, CLIENT_TEXT_MAX)
}

/// [`client_text`] in backquotes, as messages name a value the client sent: `` `abc` ``.
pub fn quoted(s: &str) -> String {
    format!("`{}`", client_text(s))
}

/// Why a routed request found no worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unavailable {
    /// Every worker's queue is full (HTTP 429, as on one node).
    QueueFull,
    /// No worker is there, or none could take it in time (HTTP 503).
    NoWorker,
    /// Its worker was lost before anything reached the client, and no other could
    /// continue it (HTTP 502).
    WorkerLost,
}

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn invalid(message: impl Into<String>, param: impl Into<Option<String>>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.into(),
            code: None,
        }
    }

    pub fn param(param: &str, message: impl Into<String>) -> ApiError {
        ApiError::invalid(message, Some(param.to_string()))
    }

    /// A request for a model the server does not serve; `served` names those it does.
    pub fn model_not_found(asked: &str, served: &[&str]) -> ApiError {
        let served = match served {
            [] => "no model yet".to_string(),
            [one] => format!("`{one}`"),
            many => many
                .iter()
                .map(|m| format!("`{m}`"))
                .collect::<Vec<_>>()
                .join(", "),
        };
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!(
                "The model {} does not exist. This server serves {served}.",
                quoted(asked)
            ),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
        }
    }

    pub fn context_length(limit: usize, prompt: usize, completion: usize, param: &str) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: format!(
                "This model's maximum context length is {limit} tokens. However, you requested {} \
                 tokens ({prompt} in the prompt, {completion} for the completion). Please reduce \
                 the length of the prompt or of max_tokens.",
                prompt + completion
            ),
            kind: "invalid_request_error",
            param: Some(param.into()),
            code: Some("context_length_exceeded"),
        }
    }

    /// A routed request no worker could take.
    pub fn no_worker(why: Unavailable, message: String) -> ApiError {
        use Unavailable as U;
        let (status, kind, code) = match why {
            U::QueueFull => (
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                Some("queue_full"),
            ),
            U::NoWorker => (
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                Some("no_worker_available"),
            ),
            U::WorkerLost => (StatusCode::BAD_GATEWAY, "bad_gateway", Some("worker_lost")),
        };
        ApiError {
            status,
            message,
            kind,
            param: None,
            code,
        }
    }

    pub fn unauthorized() -> ApiError {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: "Incorrect or missing API key: send `Authorization: Bearer <key>`.".into(),
            kind: "authentication_error",
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    pub fn not_found(path: &str) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("No route for {}.", client_text(path)),
            kind: "invalid_request_error",
            param: None,
            code: Some("unknown_url"),
        }
    }

    /// A prompt of more bytes than `limit` tokens can hold: refused before tokenizing.
    pub fn prompt_too_many_bytes(
        limit: usize,
        bytes: usize,
        per_token: usize,
        param: &str,
    ) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: format!(
                "This model's maximum context length is {limit} tokens. However, your prompt is \
                 {bytes} bytes long, and {limit} tokens of this tokenizer hold at most {} bytes \
                 (no token stands for more than {per_token} bytes), so the prompt is longer \
                 than {limit} tokens. Please reduce the length of the prompt.",
                limit.saturating_mul(per_token)
            ),
            kind: "invalid_request_error",
            param: Some(param.into()),
            code: Some("context_length_exceeded"),
        }
    }

    /// A prompt given as token ids with an id the model does not have.
    pub fn token_out_of_vocab(id: u32, index: usize, vocab: usize) -> ApiError {
        ApiError::param(
            "prompt",
            format!(
                "Token id {id} (at position {index} of the prompt) is out of vocabulary: this \
                 model's token ids go from 0 to {}.",
                vocab.saturating_sub(1)
            ),
        )
    }

    pub fn method_not_allowed(method: &axum::http::Method, path: &str, allow: &str) -> ApiError {
        let allowed = if allow.is_empty() {
            String::new()
        } else {
            format!(" Use {allow}.")
        };
        ApiError {
            status: StatusCode::METHOD_NOT_ALLOWED,
            message: format!(
                "Method {} is not allowed on {}.{allowed}",
                client_text(method.as_str()),
                client_text(path)
            ),
            kind: "invalid_request_error",
            param: None,
            code: Some("method_not_allowed"),
        }
    }

    pub fn body_too_large(limit: usize) -> ApiError {
        ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!(
                "The request body is larger than the limit of {limit} bytes ({} MiB).",
                limit >> 20
            ),
            kind: "invalid_request_error",
            param: None,
            code: Some("request_too_large"),
        }
    }

    pub fn body_timeout(after: std::time::Duration) -> ApiError {
        ApiError {
            status: StatusCode::REQUEST_TIMEOUT,
            message: format!(
                "The request body did not arrive within {:.1} s of its headers.",
                after.as_secs_f64()
            ),
            kind: "invalid_request_error",
            param: None,
            code: Some("request_timeout"),
        }
    }

    pub fn too_many_connections(max: usize) -> ApiError {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: format!(
                "The server has as many connections open as it takes ({max}). Retry later."
            ),
            kind: "service_unavailable",
            param: None,
            code: Some("too_many_connections"),
        }
    }

    /// Any other status, with the text that came with it.
    pub fn from_status(status: StatusCode, text: String) -> ApiError {
        let message = if text.is_empty() {
            status
                .canonical_reason()
                .unwrap_or("Request failed")
                .to_string()
        } else {
            text
        };
        let kind = match status.as_u16() {
            401 => "authentication_error",
            403 => "permission_error",
            429 => "rate_limit_error",
            503 => "service_unavailable",
            s if s >= 500 => "server_error",
            _ => "invalid_request_error",
        };
        ApiError {
            status,
            message,
            kind,
            param: None,
            code: None,
        }
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    /// Nothing can serve the request right now (a cluster gateway with no worker).
    /// What a worker gave the gateway cannot be used (a model card that fails its check).
    pub fn bad_gateway(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_GATEWAY,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: Some("bad_model_card"),
        }
    }

    /// A stream cut because the server's shutdown grace period ended.
    pub fn stream_cut() -> ApiError {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: "The server is shutting down, and its grace period ended before this \
                      stream finished; retry the request."
                .into(),
            kind: "service_unavailable",
            param: None,
            code: Some("server_shutting_down"),
        }
    }

    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "service_unavailable",
            param: None,
            code: Some("no_worker_available"),
        }
    }

    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> ApiError {
        match e {
            // These may quote what the request holds (a template's own error, say): cut.
            EngineError::InvalidRequest(m) => ApiError::invalid(engine_text(&m), None),
            EngineError::Tokenizer(m) => {
                ApiError::invalid(format!("tokenizer: {}", engine_text(&m)), None)
            }
            EngineError::ChatTemplate(m) => ApiError::invalid(
                format!("chat template: {}", engine_text(&m)),
                Some("messages".into()),
            ),
            EngineError::QueueFull { waiting } => ApiError {
                status: StatusCode::TOO_MANY_REQUESTS,
                message: format!(
                    "The server is at capacity ({waiting} requests waiting). Retry later."
                ),
                kind: "rate_limit_error",
                param: None,
                code: Some("queue_full"),
            },
            EngineError::Stopped => ApiError {
                status: StatusCode::SERVICE_UNAVAILABLE,
                message: "The engine is not running.".into(),
                kind: "service_unavailable",
                param: None,
                code: None,
            },
            other => ApiError::internal(other.to_string()),
        }
    }
}

/// An engine's message about a request, cut to [`TRACE_TEXT_MAX`].
fn engine_text(m: &str) -> String {
    kvmesh_telemetry::clip(m, TRACE_TEXT_MAX).into_owned()
}

/// The message of an error response, carried in its extensions so the request's root span
/// records it (`traces::trace_request`) whichever span made the response.
#[derive(Clone, Debug)]
pub struct ErrorNote(pub String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        // On the request's span when there is one (the gateway's trace middleware).
        let span = tracing::Span::current();
        let note = kvmesh_telemetry::clip(&self.message, TRACE_TEXT_MAX).into_owned();
        span.record("otel.status_code", "ERROR");
        span.record("otel.status_description", note.as_str());
        let mut r = (self.status, Json(self.body())).into_response();
        r.extensions_mut().insert(ErrorNote(note));
        // Busy or briefly without workers: say when to come back.
        if matches!(
            self.status,
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
        ) {
            r.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static("1"),
            );
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_huge_model_name_is_quoted_short_with_its_length() {
        let name = "x".repeat(1 << 20);
        let e = ApiError::model_not_found(&name, &["m"]);
        assert_eq!(e.status, StatusCode::NOT_FOUND);
        assert!(e.message.len() < 400, "{} bytes", e.message.len());
        assert!(e.message.contains("… (1048576 bytes)`"), "{}", e.message);
        assert!(
            e.message.ends_with("This server serves `m`."),
            "{}",
            e.message
        );
        // Short names are quoted whole, as before.
        let e = ApiError::model_not_found("gpt-4", &["m"]);
        assert!(e.message.starts_with("The model `gpt-4` does not exist."));
        // Cut on a char boundary.
        let q = quoted(&"é".repeat(1000));
        assert!(q.starts_with(&format!("`{}", "é".repeat(100))), "{q}");
        assert!(q.ends_with("… (2000 bytes)`"), "{q}");
    }

    #[test]
    fn routes_and_methods_are_quoted_short() {
        let path = format!("/{}", "p".repeat(1 << 20));
        for e in [
            ApiError::not_found(&path),
            ApiError::method_not_allowed(&axum::http::Method::PUT, &path, "GET"),
        ] {
            assert!(e.message.len() < 400, "{} bytes", e.message.len());
            assert!(e.message.contains("(1048577 bytes)"), "{}", e.message);
        }
    }

    #[test]
    fn a_huge_engine_message_is_cut_for_the_client_and_the_trace() {
        let e = ApiError::from(EngineError::ChatTemplate("t".repeat(1 << 20)));
        assert!(e.message.len() < TRACE_TEXT_MAX + 64, "{}", e.message.len());
        assert!(e.message.ends_with("(1048576 bytes)"));
        let r = ApiError::internal("i".repeat(1 << 20)).into_response();
        let note = &r.extensions().get::<ErrorNote>().expect("a note").0;
        assert!(note.len() < TRACE_TEXT_MAX + 64, "{}", note.len());
    }
}
