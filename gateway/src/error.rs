//! Every way a request can fail, as the OpenAI API reports it:
//! `{"error": {"message", "type", "param", "code"}}` with the matching HTTP status.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use kvmesh_gpu::EngineError;

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

    pub fn model_not_found(asked: &str, served: &str) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{asked}` does not exist. This server serves `{served}`."),
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
            message: format!("No route for {path}."),
            kind: "invalid_request_error",
            param: None,
            code: Some("unknown_url"),
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
            EngineError::InvalidRequest(m) => ApiError::invalid(m, None),
            EngineError::Tokenizer(m) => ApiError::invalid(format!("tokenizer: {m}"), None),
            EngineError::ChatTemplate(m) => {
                ApiError::invalid(format!("chat template: {m}"), Some("messages".into()))
            }
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

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        // On the request's span when there is one (the gateway's trace middleware).
        let span = tracing::Span::current();
        span.record("otel.status_code", "ERROR");
        span.record("otel.status_message", self.message.as_str());
        (self.status, Json(self.body())).into_response()
    }
}
