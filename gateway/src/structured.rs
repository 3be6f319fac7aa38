//! What a request asks its output to look like: OpenAI's `response_format`, vLLM's
//! `structured_outputs` (and its older `guided_*` fields), tools that must be called, and
//! `logit_bias`. Each is checked here, and a grammar is compiled once over the model's
//! vocabulary, so a bad one is a 400 naming the field before anything runs.

use serde_json::Value;

use kvmesh_gpu::guided::{grammar, Guide, TopLevelGrammar};

use crate::error::ApiError;
use crate::state::ServedModel;
use crate::tools::{self, Choice, ToolFormat, ToolRequest};
use crate::validation::Invalid;

/// The output's shape, as the engine and the response need it.
#[derive(Default)]
pub struct Shape {
    pub guide: Option<Guide>,
    /// The field that made `guide`: a grammar that fails while generating is its fault.
    pub guide_field: Option<&'static str>,
    pub logit_bias: Vec<(u32, f32)>,
    /// Tools offered, and how the output is read back into calls.
    pub tools: Option<ToolUse>,
}

pub struct ToolUse {
    pub request: ToolRequest,
    /// `None` when calls are not parsed (`tool_choice: "none"`).
    pub format: Option<ToolFormat>,
    /// A grammar makes the output calls (`required` or a named function).
    pub forced: bool,
}

/// Reads and checks every shaping field of a request body.
pub fn read(body: &Value, chat: bool, model: &ServedModel) -> Result<Shape, ApiError> {
    let logit_bias = logit_bias(body, model.vocab_size())?;
    let mut asked: Vec<(&'static str, TopLevelGrammar)> = Vec::new();
    if let Some(g) = response_format(body)? {
        asked.push(("response_format", g));
    }
    asked.extend(vllm_fields(body)?);
    let tools = if chat {
        tools::read(body)?
    } else {
        if body
            .get("tools")
            .is_some_and(|t| !t.is_null() && !t.as_array().is_some_and(Vec::is_empty))
        {
            return Err(Invalid::ToolsOnCompletions.into());
        }
        None
    };
    let tools = match tools {
        None => None,
        Some(request) => Some(tool_use(request, model, &mut asked)?),
    };
    if asked.len() > 1 {
        return Err(Invalid::TwoConstraints {
            first: asked[0].0,
            second: asked[1].0,
        }
        .into());
    }
    let guide_field = asked.last().map(|(f, _)| *f);
    let guide = match asked.pop() {
        None => None,
        Some((field, g)) => {
            let guides = model.guides.get().map_err(|e| Invalid::CannotConstrain {
                field,
                why: e.to_string(),
            })?;
            // Compiled once and kept: the engine starts the sequence from this copy.
            let guide = Guide::new(&g);
            guides.prepare(&guide).map_err(|e| Invalid::CannotFollow {
                field: field.into(),
                why: e.to_string(),
            })?;
            Some(guide)
        }
    };
    Ok(Shape {
        guide,
        guide_field,
        logit_bias,
        tools,
    })
}

/// The tool format (`--tool-call-parser`'s, else the template's), and for `required` or a
/// named function the grammar of calls: in that format, or as a bare JSON array of calls when
/// there is none (what vLLM does whatever the template).
fn tool_use(
    request: ToolRequest,
    model: &ServedModel,
    asked: &mut Vec<(&'static str, TopLevelGrammar)>,
) -> Result<ToolUse, ApiError> {
    if request.choice == Choice::None {
        return Ok(ToolUse {
            request,
            format: None,
            forced: false,
        });
    }
    // Each function's parameters must be a schema llguidance can follow.
    for (i, t) in request.tools.iter().enumerate() {
        let guides = model
            .guides
            .get()
            .map_err(|e| Invalid::ToolsUnconstrainable(e.to_string()))?;
        guides
            .validate(grammar::json_schema(t.parameters.clone()))
            .map_err(|e| Invalid::ToolSchema {
                index: i,
                why: e.to_string(),
            })?;
    }
    let format = match model.tool_format() {
        Some(f) => f,
        None if request.choice != Choice::Auto => ToolFormat::JsonArray,
        None => {
            return Err(Invalid::NoToolFormat {
                model: model.name.clone(),
            }
            .into())
        }
    };
    let forced = match &request.choice {
        Choice::Required => Some(request.tools.clone()),
        Choice::Named(n) => Some(
            request
                .tools
                .iter()
                .filter(|t| &t.name == n)
                .cloned()
                .collect(),
        ),
        _ => None,
    };
    if let Some(list) = &forced {
        let parallel = request.parallel && request.choice == Choice::Required;
        asked.push((
            "tool_choice",
            format.grammar(list, parallel, &model.tokenizer),
        ));
    }
    Ok(ToolUse {
        request,
        format: Some(format),
        forced: forced.is_some(),
    })
}

/// OpenAI's `logit_bias`: token id (as a string key) to a bias in [-100, 100].
fn logit_bias(body: &Value, vocab: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(b) = body.get("logit_bias").filter(|v| !v.is_null()) else {
        return Ok(Vec::new());
    };
    let map = b.as_object().ok_or(Invalid::LogitBiasNotObject)?;
    let mut out = Vec::with_capacity(map.len());
    for (k, v) in map {
        let id: u32 = k
            .trim()
            .parse()
            .map_err(|_| Invalid::LogitBiasKey(k.clone()))?;
        if id as usize >= vocab {
            return Err(Invalid::LogitBiasOutsideVocab { id, vocab }.into());
        }
        let bias = v
            .as_f64()
            .filter(|b| (-100.0..=100.0).contains(b))
            .ok_or_else(|| Invalid::LogitBiasValue {
                id,
                got: v.to_string(),
            })?;
        out.push((id, bias as f32));
    }
    Ok(out)
}

fn response_format(body: &Value) -> Result<Option<TopLevelGrammar>, ApiError> {
    let Some(f) = body.get("response_format").filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    match f.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(grammar::json_object())),
        Some("json_schema") => {
            let js = f
                .get("json_schema")
                .filter(|v| v.is_object())
                .ok_or(Invalid::JsonSchemaNotObject)?;
            match js.get("schema") {
                Some(s @ Value::Object(_)) => Ok(Some(grammar::json_schema(s.clone()))),
                // OpenAI's SDK sends no schema for a bare name: any JSON object.
                None | Some(Value::Null) => Ok(Some(grammar::json_object())),
                Some(_) => Err(Invalid::SchemaNotObject.into()),
            }
        }
        Some(other) => Err(Invalid::ResponseFormatType(other.to_string()).into()),
        None => Err(Invalid::ResponseFormatNoType.into()),
    }
}

/// vLLM's `structured_outputs` object and its older top-level `guided_*` fields.
fn vllm_fields(body: &Value) -> Result<Vec<(&'static str, TopLevelGrammar)>, ApiError> {
    let mut out = Vec::new();
    let get = |o: &Value, k: &str| o.get(k).filter(|v| !v.is_null()).cloned();
    if let Some(so) = body.get("structured_outputs").filter(|v| !v.is_null()) {
        if !so.is_object() {
            return Err(Invalid::StructuredOutputsNotObject.into());
        }
        for k in so.as_object().into_iter().flat_map(|o| o.keys()) {
            if !matches!(
                k.as_str(),
                "json"
                    | "regex"
                    | "choice"
                    | "grammar"
                    | "json_object"
                    | "disable_any_whitespace"
                    | "disable_additional_properties"
                    | "whitespace_pattern"
            ) {
                return Err(Invalid::StructuredOutputsKey(k.clone()).into());
            }
        }
        let named = [
            ("json", "structured_outputs.json"),
            ("regex", "structured_outputs.regex"),
            ("choice", "structured_outputs.choice"),
            ("grammar", "structured_outputs.grammar"),
        ];
        for (k, field) in named {
            if let Some(v) = get(so, k) {
                out.push((field, one(field, k, v)?));
            }
        }
        if so.get("json_object").and_then(Value::as_bool) == Some(true) {
            out.push(("structured_outputs.json_object", grammar::json_object()));
        }
    }
    for (field, k) in [
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ] {
        if let Some(v) = get(body, field) {
            out.push((field, one(field, k, v)?));
        }
    }
    Ok(out)
}

/// One vLLM constraint of kind `k` (json, regex, choice, grammar).
fn one(field: &'static str, k: &str, v: Value) -> Result<TopLevelGrammar, ApiError> {
    let bad = |what| ApiError::from(Invalid::ConstraintValue { field, what });
    match k {
        "json" => match v {
            Value::Object(_) => Ok(grammar::json_schema(v)),
            Value::String(s) => match serde_json::from_str::<Value>(&s) {
                Ok(o @ Value::Object(_)) => Ok(grammar::json_schema(o)),
                _ => Err(bad("a JSON Schema (an object, or a string holding one)")),
            },
            _ => Err(bad("a JSON Schema (an object, or a string holding one)")),
        },
        "regex" => match v {
            Value::String(s) if !s.is_empty() => Ok(grammar::regex(&s)),
            _ => Err(bad("a non-empty regular expression string")),
        },
        "choice" => {
            let list: Option<Vec<String>> = v
                .as_array()
                .and_then(|a| a.iter().map(|c| c.as_str().map(String::from)).collect());
            match list {
                Some(l) if !l.is_empty() && l.iter().all(|c| !c.is_empty()) => {
                    Ok(grammar::choice(&l))
                }
                _ => Err(bad("a non-empty list of non-empty strings")),
            }
        }
        _ => match v {
            Value::String(s) if !s.trim().is_empty() => Ok(grammar::lark(&s)),
            _ => Err(bad("a grammar in Lark syntax, as a string")),
        },
    }
}
