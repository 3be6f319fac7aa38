//! The gateway's HTTP routes: the OpenAI API and the trace viewer's API behind its key, the
//! viewer's page, health, version and metrics.

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::header;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvmesh_telemetry::metrics::{Exposition, CONTENT_TYPE};
use serde_json::{json, Value};

use crate::complete;
use crate::error::ApiError;
use crate::state::AppState;
use crate::{http, traces};

pub fn router(state: Arc<AppState>) -> Router {
    let v1 = Router::new()
        .route("/v1/chat/completions", post(complete::chat))
        .route("/v1/completions", post(complete::completions))
        .route("/v1/models", get(models))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_key))
        .route_layer(middleware::from_fn(refuse_large_bodies))
        .route_layer(middleware::from_fn(traces::trace_request));
    Router::new()
        .merge(v1)
        .merge(traces::page_route())
        .merge(
            traces::api_routes(state.traces.clone())
                .route_layer(middleware::from_fn_with_state(state.clone(), require_key)),
        )
        .route("/health", get(|| async { Json(json!({"status": "ok"})) }))
        .route(
            "/version",
            get(|| async { Json(json!({"version": env!("CARGO_PKG_VERSION")})) }),
        )
        .route("/metrics", get(metrics_page))
        .fallback(|req: Request| async move { ApiError::not_found(req.uri().path()) })
        .layer(DefaultBodyLimit::max(http::MAX_BODY_BYTES))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            count_requests,
        ))
        .with_state(state)
}

/// A body declared larger than the limit is refused before any of it is read: no wait for
/// it, and no `100 Continue` inviting the client to send it. (Bodies without a declared
/// length are cut at the limit as they arrive, by `DefaultBodyLimit`.)
async fn refuse_large_bodies(req: Request, next: Next) -> Response {
    if http::declared_length(&req).is_some_and(|n| n > http::MAX_BODY_BYTES as u64) {
        let mut r = ApiError::body_too_large(http::MAX_BODY_BYTES).into_response();
        r.headers_mut().insert(
            header::CONNECTION,
            header::HeaderValue::from_static("close"),
        );
        return r;
    }
    next.run(req).await
}

async fn require_key(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &st.api_key {
        if !authorized(req.headers(), key) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

/// Whether `headers` carry `Authorization: Bearer <key>`; the scheme's case does not matter
/// (RFC 7235), and the key is compared in constant time.
pub fn authorized(headers: &axum::http::HeaderMap, key: &str) -> bool {
    let Some(v) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let v = v.trim_start();
    let Some((scheme, token)) = v.split_once([' ', '\t']) else {
        return false;
    };
    if !scheme.eq_ignore_ascii_case("bearer") {
        return false;
    }
    let (a, b) = (token.trim().as_bytes(), key.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

/// Why an API key cannot be used, if it cannot: one that could never be sent would lock
/// every route.
pub fn check_api_key(key: &str) -> Result<(), ApiKeyError> {
    if key.is_empty() {
        return Err(ApiKeyError::Empty);
    }
    if !key.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(ApiKeyError::NotPrintable);
    }
    Ok(())
}

/// Why an API key cannot be used: one variant per rule of [`check_api_key`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ApiKeyError {
    #[error(
        "the API key is empty, which would refuse every request; leave --api-key \
         (and KVMESH_API_KEY) unset to serve without one"
    )]
    Empty,
    #[error(
        "the API key must be printable ASCII without spaces (it is sent in an \
         `Authorization: Bearer <key>` header)"
    )]
    NotPrintable,
}

async fn count_requests(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let endpoint = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "other".into());
    let resp = next.run(req).await;
    st.metrics.http(&endpoint, resp.status().as_u16());
    resp
}

async fn metrics_page(State(st): State<Arc<AppState>>) -> Response {
    // The engine's or the workers' families, and the gateway's own.
    let out = Exposition::new();
    st.catalog.render_metrics(&out);
    st.metrics.add_to(&out);
    ([(header::CONTENT_TYPE, CONTENT_TYPE)], out.render()).into_response()
}

async fn models(State(st): State<Arc<AppState>>) -> Json<Value> {
    let data: Vec<Value> = st
        .catalog
        .listed()
        .iter()
        .map(|m| {
            json!({
                "id": m.name,
                "object": "model",
                "created": st.created,
                "owned_by": "kvmesh",
                "root": m.name,
                "max_model_len": m.max_model_len,
            })
        })
        .collect();
    Json(json!({"object": "list", "data": data}))
}
