//! The OpenAI request bodies, and their validation into what the engine runs. Each rule gives
//! its own message and names the offending parameter.

use serde::Deserialize;
use serde_json::Value;

use crate::error::{client_text, ApiError};
use crate::validation::Invalid;
use kvmesh_gpu::sampler::SamplingParams;
use kvmesh_gpu::tokenizer::SamplingDefaults;

#[derive(Deserialize, Debug, Default)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum StringOrList {
    One(String),
    Many(Vec<String>),
}

/// Parameters shared by both endpoints.
#[derive(Deserialize, Debug, Default)]
pub struct Common {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub seed: Option<i64>,
    pub stop: Option<StringOrList>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub ignore_eos: Option<bool>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<i64>,
    pub return_token_ids: Option<bool>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
}

#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Deserialize, Debug)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Deserialize, Debug)]
pub struct ChatMessage {
    pub role: String,
    pub content: Option<Content>,
    /// An assistant's earlier calls.
    pub tool_calls: Option<Vec<Value>>,
    /// A tool's answer: the call it answers, and the function's name.
    pub tool_call_id: Option<String>,
    pub name: Option<String>,
}

#[derive(Deserialize, Debug)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    /// Chat: `logprobs` is a flag and `top_logprobs` the count.
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
}

#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Deserialize, Debug)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    /// Completions: `logprobs` is the count.
    pub logprobs: Option<i64>,
    pub echo: Option<bool>,
}

/// Parses a request body as a JSON object.
pub fn parse_body(body: &[u8]) -> Result<Value, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("The request body is not valid JSON: {e}"), None))?;
    if !v.is_object() {
        return Err(ApiError::invalid(
            "The request body must be a JSON object.",
            None,
        ));
    }
    Ok(v)
}

/// Reads the fields `T` knows from a request object, naming the field at fault. (Each
/// endpoint reads its own fields and the shared ones separately: serde's `flatten` would
/// lose the field path in errors.)
pub fn fields<T: serde::de::DeserializeOwned>(v: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        // Serde's messages quote the value at fault (`invalid type: string "…"`): cut.
        let path = client_text(&e.path().to_string()).into_owned();
        let param = (path != ".").then(|| path.clone());
        let inner = client_text(&e.into_inner().to_string()).into_owned();
        let msg = if inner.contains("did not match any variant") {
            format!("`{path}` has the wrong type or shape")
        } else {
            match &param {
                Some(p) => format!("Invalid value for `{p}`: {inner}"),
                None => format!("Invalid request: {inner}"),
            }
        };
        ApiError::invalid(msg, param)
    })
}

/// Refuses, by name, request fields of the OpenAI API this server does not implement:
/// ignoring them would answer something else than what was asked (one sample instead of the
/// best of several). `best_of` equal to `n` passes (as vLLM accepts).
pub fn refuse_unsupported(body: &Value) -> Result<(), ApiError> {
    let get = |k: &str| body.get(k).filter(|v| !v.is_null());
    for old in ["functions", "function_call"] {
        if get(old).is_some() {
            return Err(Invalid::DeprecatedFunctions(old).into());
        }
    }
    if let Some(b) = get("best_of") {
        let n = body.get("n").and_then(Value::as_i64).unwrap_or(1);
        if b.as_i64() != Some(n) {
            return Err(Invalid::BestOf(n).into());
        }
    }
    Ok(())
}

/// What a validated request asks the engine and the detokenizer for.
pub struct Validated {
    pub params: SamplingParams,
    /// `None`: as much as the context allows.
    pub max_tokens: Option<usize>,
    pub stops: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub return_token_ids: bool,
}

pub use crate::validation::MAX_LOGPROBS;

pub fn validate_common(
    c: &Common,
    served: &str,
    defaults: &SamplingDefaults,
    top_logprobs: Option<usize>,
) -> Result<Validated, ApiError> {
    if let Some(m) = &c.model {
        if m != served {
            return Err(ApiError::model_not_found(m, &[served]));
        }
    }
    let max_tokens = match (c.max_completion_tokens, c.max_tokens) {
        (Some(v), _) => Some(("max_completion_tokens", v)),
        (None, Some(v)) => Some(("max_tokens", v)),
        _ => None,
    };
    if let Some((field, got)) = max_tokens {
        if got < 1 {
            return Err(Invalid::MaxTokens { field, got }.into());
        }
    }
    let temperature = c.temperature.or(defaults.temperature).unwrap_or(1.0);
    if temperature < 0.0 || !temperature.is_finite() {
        return Err(Invalid::Temperature(temperature).into());
    }
    let top_p = c.top_p.or(defaults.top_p).unwrap_or(1.0);
    if top_p <= 0.0 || top_p > 1.0 || top_p.is_nan() {
        return Err(Invalid::TopP(top_p).into());
    }
    let top_k = c.top_k.or(defaults.top_k).unwrap_or(0);
    if top_k < -1 {
        return Err(Invalid::TopK(top_k).into());
    }
    if let Some(n) = c.n {
        if n != 1 {
            return Err(Invalid::N(n).into());
        }
    }
    for (name, v) in [
        ("presence_penalty", c.presence_penalty),
        ("frequency_penalty", c.frequency_penalty),
    ] {
        if let Some(v) = v {
            if v != 0.0 {
                return Err(Invalid::Penalty(name).into());
            }
        }
    }
    let stops = match &c.stop {
        None => Vec::new(),
        Some(StringOrList::One(s)) => vec![s.clone()],
        Some(StringOrList::Many(v)) => v.clone(),
    };
    if stops.iter().any(String::is_empty) {
        return Err(Invalid::EmptyStop.into());
    }
    let seed = match c.seed {
        Some(s) if s < 0 => {
            return Err(Invalid::Seed(s).into());
        }
        s => s.map(|s| s as u64),
    };
    let stream = c.stream.unwrap_or(false);
    if c.stream_options.is_some() && !stream {
        return Err(Invalid::StreamOptionsWithoutStream.into());
    }
    Ok(Validated {
        params: SamplingParams {
            temperature: temperature as f32,
            top_k: top_k.max(0) as usize,
            top_p: top_p as f32,
            seed,
            max_tokens: 0,
            stop_token_ids: c.stop_token_ids.clone().unwrap_or_default(),
            ignore_eos: c.ignore_eos.unwrap_or(false),
            logprobs: top_logprobs,
            resume_draws: 0,
            logit_bias: Vec::new(),
            guide: None,
        },
        max_tokens: max_tokens.map(|(_, v)| v as usize),
        stops,
        stream,
        include_usage: c.stream_options.as_ref().is_some_and(|o| o.include_usage),
        return_token_ids: c.return_token_ids.unwrap_or(false),
    })
}

/// Chat `logprobs`/`top_logprobs` into the number of alternatives (None: no logprobs).
pub fn chat_logprobs(logprobs: Option<bool>, top: Option<i64>) -> Result<Option<usize>, ApiError> {
    match (logprobs.unwrap_or(false), top) {
        (_, Some(t)) if !(0..=MAX_LOGPROBS).contains(&t) => Err(Invalid::TopLogprobs(t).into()),
        (false, Some(_)) => Err(Invalid::TopLogprobsWithoutLogprobs.into()),
        (true, t) => Ok(Some(t.unwrap_or(0) as usize)),
        (false, None) => Ok(None),
    }
}

pub fn completion_logprobs(n: Option<i64>) -> Result<Option<usize>, ApiError> {
    match n {
        None => Ok(None),
        Some(n) if (0..=MAX_LOGPROBS).contains(&n) => Ok(Some(n as usize)),
        Some(n) => Err(Invalid::Logprobs(n).into()),
    }
}

/// Messages as the chat template reads them: role and plain-text content.
pub fn template_messages(messages: &[ChatMessage]) -> Result<Vec<Value>, ApiError> {
    if messages.is_empty() {
        return Err(Invalid::NoMessages.into());
    }
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            if !matches!(
                m.role.as_str(),
                "system" | "developer" | "user" | "assistant" | "tool"
            ) {
                return Err(Invalid::Role {
                    message: i,
                    role: m.role.clone(),
                }
                .into());
            }
            let text = match &m.content {
                None => String::new(),
                Some(Content::Text(t)) => t.clone(),
                Some(Content::Parts(parts)) => {
                    let mut s = String::new();
                    for p in parts {
                        if p.kind != "text" {
                            return Err(Invalid::ContentPart {
                                message: i,
                                kind: p.kind.clone(),
                            }
                            .into());
                        }
                        s.push_str(p.text.as_deref().unwrap_or(""));
                    }
                    s
                }
            };
            let role = if m.role == "developer" {
                "system"
            } else {
                m.role.as_str()
            };
            let mut msg = serde_json::json!({"role": role, "content": text});
            if let Some(calls) = &m.tool_calls {
                msg["tool_calls"] = Value::Array(
                    calls
                        .iter()
                        .enumerate()
                        .map(|(k, c)| template_call(c, &format!("messages[{i}].tool_calls[{k}]")))
                        .collect::<Result<_, _>>()?,
                );
            }
            if let Some(id) = &m.tool_call_id {
                msg["tool_call_id"] = Value::String(id.clone());
            }
            if let Some(n) = &m.name {
                msg["name"] = Value::String(n.clone());
            }
            Ok(msg)
        })
        .collect()
}

/// An assistant's earlier call as templates read it: OpenAI's shape, with `arguments` also
/// parsed into an object (Hugging Face templates render it with `tojson`).
fn template_call(c: &Value, at: &str) -> Result<Value, ApiError> {
    let at = || at.to_string();
    let f = c
        .get("function")
        .filter(|f| f.is_object())
        .ok_or_else(|| Invalid::CallFunction { at: at() })?;
    let name = f
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| Invalid::CallName { at: at() })?;
    let args = match f.get("arguments") {
        Some(Value::String(s)) => {
            serde_json::from_str::<Value>(s).map_err(|e| Invalid::CallArgumentsJson {
                at: at(),
                error: e.to_string(),
            })?
        }
        Some(v @ Value::Object(_)) => v.clone(),
        None | Some(Value::Null) => serde_json::json!({}),
        Some(_) => return Err(Invalid::CallArgumentsKind { at: at() }.into()),
    };
    Ok(serde_json::json!({
        "id": c.get("id").cloned().unwrap_or(Value::Null),
        "type": "function",
        "function": {"name": name, "arguments": args},
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serde_errors_quoting_a_huge_value_are_cut() {
        // serde quotes a string of the wrong type whole: `invalid type: string "…"`.
        let body = serde_json::json!({"max_tokens": "9".repeat(1 << 20)});
        let e = fields::<Common>(&body).expect_err("a string is no number");
        assert!(e.message.len() < 400, "{} bytes", e.message.len());
        assert!(e.message.contains("bytes)"), "{}", e.message);
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        let role = "r".repeat(1 << 20);
        let m: Vec<ChatMessage> =
            serde_json::from_value(serde_json::json!([{"role": role, "content": "hi"}])).unwrap();
        let e = template_messages(&m).expect_err("an unknown role");
        assert!(e.message.len() < 400, "{} bytes", e.message.len());
        assert!(e.message.contains("… (1048576 bytes)`"), "{}", e.message);
    }
}
