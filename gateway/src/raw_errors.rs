//! Errors the HTTP library writes itself. When a request head cannot be parsed (a garbage
//! request line, a bad version or header, two Content-Lengths, a URI or header block over
//! the limits), hyper answers 400, 414 or 431 with an empty body and closes, before any
//! request reaches the routes. The connection's socket wrapper (`http::Watched`) puts the
//! OpenAI error body into those answers as they are written, so every status the gateway
//! sends carries one.

use axum::http::StatusCode;

use crate::error::ApiError;

/// What hyper's own error answers look like: a 4xx status line, then (among its headers)
/// `content-length: 0` and `connection: close`. Answers made by the routes always carry a
/// JSON body, so they never match.
const EMPTY: &[u8] = b"\r\ncontent-length: 0\r\n";

/// The answer to write instead of `head`, when `head` is one of hyper's bodiless errors.
pub fn with_body(head: &[u8]) -> Option<Vec<u8>> {
    if !head.starts_with(b"HTTP/1.1 4") || !head.ends_with(b"\r\n\r\n") || head.len() > 1024 {
        return None;
    }
    let text = std::str::from_utf8(head).ok()?;
    let lower = text.to_ascii_lowercase();
    if !lower.contains("\r\nconnection: close\r\n") {
        return None;
    }
    let at = lower.find(std::str::from_utf8(EMPTY).ok()?)?;
    let status = StatusCode::from_u16(text.get(9..12)?.parse().ok()?).ok()?;
    let message = match status.as_u16() {
        400 => {
            "The request could not be parsed as HTTP/1.1: a malformed request line, \
                version or header field, or conflicting Content-Length headers."
        }
        414 => "The request URI is too long.",
        431 => "The request's header fields are too many (at most 100) or too large.",
        _ => status.canonical_reason().unwrap_or("Bad request"),
    };
    let body = ApiError::from_status(status, message.to_string())
        .body()
        .to_string();
    let mut out = Vec::with_capacity(head.len() + body.len() + 64);
    out.extend_from_slice(&head[..at]);
    out.extend_from_slice(
        format!(
            "\r\ncontent-type: application/json\r\ncontent-length: {}\r\n",
            body.len()
        )
        .as_bytes(),
    );
    out.extend_from_slice(&head[at + EMPTY.len()..]);
    out.extend_from_slice(body.as_bytes());
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hypers_empty_errors_get_an_openai_body_and_others_pass() {
        let head = b"HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\n\
                     content-length: 0\r\ndate: Thu, 26 Nov 2026 05:17:22 GMT\r\n\r\n";
        let out = String::from_utf8(with_body(head).unwrap()).unwrap();
        let (h, body) = out.split_once("\r\n\r\n").unwrap();
        assert!(h.starts_with("HTTP/1.1 431 "), "{h}");
        assert!(h.contains("content-type: application/json"), "{h}");
        assert!(
            h.contains(&format!("content-length: {}", body.len())),
            "{h}"
        );
        assert!(
            h.contains("connection: close") && h.contains("date: "),
            "{h}"
        );
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains("100"),
            "{v}"
        );
        // A route's answer (a body), a success, and a kept-alive answer are not touched.
        for other in [
            &b"HTTP/1.1 400 Bad Request\r\nconnection: close\r\ncontent-length: 80\r\n\r\n"[..],
            b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 0\r\n\r\n",
            b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n",
            b"HTTP/1.1 400 Bad Request\r\nconnection: close\r\ncontent-length: 0\r\n\r\n{}",
        ] {
            assert!(
                with_body(other).is_none(),
                "{}",
                String::from_utf8_lossy(other)
            );
        }
    }
}
