//! The trace viewer's API is behind the API key, as `/v1` is (its answers quote requests'
//! error messages); its page is open. And a huge model name comes back quoted short.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use kvmesh_gateway::error::ApiError;
use kvmesh_gateway::traces::Traces;
use kvmesh_gateway::{router, AppState, Catalog, ListedModel, Resolving};
use kvmesh_telemetry::metrics::Exposition;
use kvmesh_telemetry::SpanStore;
use tower::ServiceExt;

/// Serves no model: every name is unknown.
struct NoModel;

impl Catalog for NoModel {
    fn listed(&self) -> Vec<ListedModel> {
        Vec::new()
    }

    fn resolve<'a>(&'a self, name: Option<&'a str>) -> Resolving<'a> {
        let e = ApiError::model_not_found(name.unwrap_or(""), &["m"]);
        Box::pin(std::future::ready(Err(e)))
    }

    fn render_metrics(&self, _out: &Exposition) {}
}

fn app(key: Option<&str>) -> Router {
    let store = Arc::new(SpanStore::new("gw".into(), 100, 1 << 20));
    let traces = Traces::new(store, Box::new(Vec::new));
    router(AppState::new(
        Arc::new(NoModel),
        key.map(String::from),
        Some(traces),
    ))
}

async fn get(app: &Router, path: &str, auth: Option<&str>) -> (StatusCode, serde_json::Value) {
    let mut req = Request::get(path);
    if let Some(a) = auth {
        req = req.header("authorization", a);
    }
    let r = app
        .clone()
        .oneshot(req.body(Body::empty()).unwrap())
        .await
        .unwrap();
    let status = r.status();
    let bytes = axum::body::to_bytes(r.into_body(), 1 << 20).await.unwrap();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null),
    )
}

const TRACE: &str = "0123456789abcdef0123456789abcdef";

#[tokio::test]
async fn the_trace_api_needs_the_key_the_page_does_not() {
    let app = app(Some("sekrit"));
    let api = [
        "/traces/api/recent".to_string(),
        format!("/traces/api/spans/{TRACE}"),
        format!("/traces/api/trace/{TRACE}"),
        "/v1/models".to_string(),
    ];
    for path in &api {
        for auth in [None, Some("Bearer wrong"), Some("sekrit")] {
            let (st, v) = get(&app, path, auth).await;
            assert_eq!(st, StatusCode::UNAUTHORIZED, "{path} {auth:?}: {v}");
            assert_eq!(v["error"]["code"], "invalid_api_key", "{path}: {v}");
        }
    }
    let (st, v) = get(&app, "/traces/api/recent", Some("Bearer sekrit")).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["node"], "gw");
    assert!(v["requests"].is_array(), "{v}");
    let (st, v) = get(
        &app,
        &format!("/traces/api/spans/{TRACE}"),
        Some("bearer sekrit"),
    )
    .await;
    assert_eq!((st, v), (StatusCode::OK, serde_json::json!([])));
    // Asked with the key, an unknown trace is a 404 of its own, not a 401.
    let (st, v) = get(
        &app,
        &format!("/traces/api/trace/{TRACE}"),
        Some("Bearer sekrit"),
    )
    .await;
    assert_eq!(st, StatusCode::NOT_FOUND, "{v}");
    assert_eq!(v["error"]["code"], "trace_not_found");
    // The page holds no data: it loads without the key (and asks for it on a 401).
    let r = app
        .clone()
        .oneshot(Request::get("/traces").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let page = axum::body::to_bytes(r.into_body(), 1 << 20).await.unwrap();
    let page = String::from_utf8_lossy(&page);
    assert!(
        page.contains("Authorization: \"Bearer \""),
        "the page sends the key"
    );
    // Health stays open.
    assert_eq!(get(&app, "/health", None).await.0, StatusCode::OK);
}

#[tokio::test]
async fn without_a_key_the_trace_api_is_open() {
    let app = app(None);
    let (st, v) = get(&app, "/traces/api/recent", None).await;
    assert_eq!(st, StatusCode::OK, "{v}");
}

#[tokio::test]
async fn a_huge_model_name_comes_back_short() {
    let app = app(Some("k"));
    let body = serde_json::json!({"model": "x".repeat(1 << 20), "messages": []});
    let req = Request::post("/v1/chat/completions")
        .header("authorization", "Bearer k")
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap();
    let r = app.oneshot(req).await.unwrap();
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
    let bytes = axum::body::to_bytes(r.into_body(), 1 << 20).await.unwrap();
    assert!(bytes.len() < 600, "{} bytes", bytes.len());
    let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    let m = v["error"]["message"].as_str().unwrap();
    assert!(m.contains("… (1048576 bytes)`"), "{m}");
    assert_eq!(v["error"]["code"], "model_not_found");
}
