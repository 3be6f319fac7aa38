//! Tool calling: the functions a request offers, how the model's chat template says it calls
//! them (read from the template's text), the grammar that makes `required` and named choices
//! always parse, and the parser that turns the output back into OpenAI `tool_calls`.

use serde_json::{json, Value};

use kvmesh_gpu::guided::{grammar, TopLevelGrammar};
use kvmesh_gpu::tokenizer::TextTokenizer;

use crate::error::ApiError;
use crate::shared_defs::SharedDefs;
use crate::validation::Invalid;

/// How a family of models writes its calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    /// Qwen2.5 / Qwen3 (Hermes style): `<tool_call>\n{"name": .., "arguments": {..}}\n</tool_call>`,
    /// one block per call.
    Hermes,
    /// Llama 3.1+: a bare JSON object `{"name": .., "parameters": {..}}`, several joined by `; `.
    Llama3Json,
    /// Mistral: `[TOOL_CALLS]` then a JSON array of `{"name": .., "arguments": {..}}`.
    Mistral,
    /// A bare JSON array of `{"name": .., "parameters": {..}}`: how calls are forced (with
    /// `tool_choice` required or a named function) on a model whose template shows no format
    /// and for which none was named (`--tool-call-parser`).
    JsonArray,
}

/// A `--tool-call-parser` name kvmesh has no parser for.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown tool call parser {0:?}: kvmesh reads hermes, llama3_json or mistral")]
pub struct UnknownToolParser(pub String);

impl ToolFormat {
    /// The format a chat template speaks, if it offers tools at all.
    pub fn of_template(text: &str) -> Option<ToolFormat> {
        if !text.contains("tools") {
            return None;
        }
        if text.contains("<tool_call>") {
            Some(ToolFormat::Hermes)
        } else if text.contains("[TOOL_CALLS]") {
            Some(ToolFormat::Mistral)
        } else if text.contains("<|python_tag|>") || text.contains("ipython") {
            Some(ToolFormat::Llama3Json)
        } else {
            None
        }
    }

    /// The format `--tool-call-parser` names (vLLM's names for the same formats).
    pub fn by_name(name: &str) -> Result<ToolFormat, UnknownToolParser> {
        match name {
            "hermes" => Ok(ToolFormat::Hermes),
            "llama3_json" => Ok(ToolFormat::Llama3Json),
            "mistral" => Ok(ToolFormat::Mistral),
            other => Err(UnknownToolParser(other.to_string())),
        }
    }

    fn args_key(self) -> &'static str {
        match self {
            ToolFormat::Llama3Json | ToolFormat::JsonArray => "parameters",
            _ => "arguments",
        }
    }

    /// Where the output's calls begin (Llama 3's calls are the output itself).
    fn marker(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "<tool_call>",
            ToolFormat::Mistral => "[TOOL_CALLS]",
            ToolFormat::Llama3Json => "{",
            ToolFormat::JsonArray => "[",
        }
    }

    /// A grammar whose every output is one call (or several, with `parallel`) of `tools`.
    pub fn grammar(self, tools: &[Tool], parallel: bool, tok: &TextTokenizer) -> TopLevelGrammar {
        if self == ToolFormat::JsonArray {
            return json_array_grammar(tools, parallel);
        }
        let schema = calls_schema(tools, self.args_key());
        let body = format!("%json {}", grammar::compact(schema));
        let lit = |s: &str| match tok.added_token_id(s) {
            Some(id) => format!("<[{id}]>"),
            None => grammar::lark_string(s),
        };
        let more = |sep: &str| {
            if parallel {
                format!("({} call)*", grammar::lark_string(sep))
            } else {
                String::new()
            }
        };
        let text = match self {
            ToolFormat::Hermes => format!(
                "start: call {}\ncall: {} {} body {}\nbody: {body}\n",
                more("\n"),
                lit("<tool_call>"),
                grammar::lark_string("\n"),
                grammar::lark_string("\n</tool_call>"),
            ),
            ToolFormat::Mistral => format!(
                "start: {} \"[\" call {} \"]\"\ncall: {body}\n",
                lit("[TOOL_CALLS]"),
                more(", "),
            ),
            ToolFormat::Llama3Json => format!("start: call {}\ncall: {body}\n", more("; ")),
            ToolFormat::JsonArray => unreachable!("returned above"),
        };
        grammar::lark(&text)
    }

    /// The calls in a finished output, and the text around them. `None` when the output
    /// holds no call in this format (or a malformed one): it is then plain content.
    pub fn parse(self, text: &str) -> Option<(String, Vec<Call>)> {
        let key = self.args_key();
        let call = |raw: &str| call_from(raw.trim(), key);
        match self {
            ToolFormat::Hermes => {
                let mut content = String::new();
                let mut calls = Vec::new();
                let mut rest = text;
                while let Some(at) = rest.find("<tool_call>") {
                    content.push_str(&rest[..at]);
                    let after = &rest[at + "<tool_call>".len()..];
                    let (body, next) = match after.find("</tool_call>") {
                        Some(end) => (&after[..end], &after[end + "</tool_call>".len()..]),
                        None => (after, ""),
                    };
                    calls.push(call(body)?);
                    rest = next;
                }
                content.push_str(rest);
                (!calls.is_empty()).then(|| (content.trim().to_string(), calls))
            }
            ToolFormat::Mistral | ToolFormat::JsonArray => {
                let t = text.trim_start();
                let t = t.strip_prefix("[TOOL_CALLS]").unwrap_or(t).trim();
                if !t.starts_with('[') {
                    return None;
                }
                let v: Vec<Value> = serde_json::from_str(t).ok()?;
                let objs = objects(t);
                if objs.len() != v.len() {
                    return None;
                }
                let calls = objs
                    .iter()
                    .map(|&(a, b)| call(&t[a..b?]))
                    .collect::<Option<Vec<_>>>()?;
                (!calls.is_empty()).then(|| (String::new(), calls))
            }
            ToolFormat::Llama3Json => {
                let t = text.trim();
                let t = t.strip_prefix("<|python_tag|>").unwrap_or(t).trim();
                if !t.starts_with('{') {
                    return None;
                }
                more_llama_calls(t, Vec::new(), &call)
            }
        }
    }
}

/// Calls as a JSON array of `{"name", "parameters"}` objects: one of them (or, with
/// `parallel`, one or more), each naming one of `tools` with arguments its schema allows.
fn json_array_grammar(tools: &[Tool], parallel: bool) -> TopLevelGrammar {
    let mut item = calls_schema(tools, "parameters");
    let defs = item.as_object_mut().and_then(|o| o.remove("$defs"));
    let mut schema = json!({"type": "array", "items": item, "minItems": 1});
    if !parallel {
        schema["maxItems"] = json!(1);
    }
    if let Some(defs) = defs {
        schema["$defs"] = defs;
    }
    grammar::json_schema(schema)
}

/// One call object of any of `tools`, its arguments under `args_key`; each tool's own
/// definitions gathered at the root (see [`SharedDefs`]).
fn calls_schema(tools: &[Tool], args_key: &str) -> Value {
    let mut defs = SharedDefs::default();
    let mut calls: Vec<Value> = tools
        .iter()
        .enumerate()
        .map(|(i, t)| {
            json!({
                "type": "object",
                "properties": {"name": {"const": t.name}, (args_key): defs.embed(i, &t.parameters)},
                "required": ["name", args_key],
                "additionalProperties": false,
            })
        })
        .collect();
    let mut schema = match calls.len() {
        1 => calls.remove(0),
        _ => json!({ "anyOf": calls }),
    };
    defs.finish(&mut schema);
    schema
}

/// Llama 3 calls: JSON objects joined by `;`.
fn more_llama_calls(
    mut rest: &str,
    mut calls: Vec<Call>,
    call: &dyn Fn(&str) -> Option<Call>,
) -> Option<(String, Vec<Call>)> {
    loop {
        let mut de = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        de.next()?.ok()?;
        calls.push(call(&rest[..de.byte_offset()])?);
        let after = rest[de.byte_offset()..].trim_start();
        if after.is_empty() {
            return Some((String::new(), calls));
        }
        rest = after.strip_prefix(';')?;
    }
}

/// A call from its JSON object's text. Its arguments are the object's own text for them
/// (as they were streamed), or re-serialised when given another way.
fn call_from(raw: &str, key: &str) -> Option<Call> {
    let v: Value = serde_json::from_str(raw).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    if let Some((_, Some((args, true)))) = partial(raw, key) {
        return Some(Call {
            name,
            arguments: args.to_string(),
        });
    }
    let args = v
        .get(key)
        .or_else(|| v.get("arguments"))
        .cloned()
        .unwrap_or(json!({}));
    let arguments = match args {
        Value::String(s) => s,
        other => other.to_string(),
    };
    Some(Call { name, arguments })
}

/// The top-level JSON objects in `s` (what lies between them is skipped): each one's start,
/// and its end once it closed.
fn objects(s: &str) -> Vec<(usize, Option<usize>)> {
    let mut out = Vec::new();
    let (mut depth, mut in_str, mut esc) = (0usize, false, false);
    for (i, b) in s.bytes().enumerate() {
        if in_str {
            match (esc, b) {
                (true, _) => esc = false,
                (false, b'\\') => esc = true,
                (false, b'"') => in_str = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' if depth > 0 => in_str = true,
            b'{' => {
                if depth == 0 {
                    out.push((i, None));
                }
                depth += 1;
            }
            b'}' if depth > 0 => {
                depth -= 1;
                if depth == 0 {
                    if let Some(last) = out.last_mut() {
                        last.1 = Some(i + 1);
                    }
                }
            }
            _ => {}
        }
    }
    out
}

/// How much of `s` a JSON object at its start spans so far, and whether it closed.
fn object_extent(s: &str) -> (usize, bool) {
    match objects(s).first() {
        Some(&(0, Some(end))) => (end, true),
        _ => (s.len(), false),
    }
}

/// A call object's name and the text of its arguments so far (and whether they are
/// complete), when it is written name first, as the grammar writes it: `{"name": "f",
/// "arguments": {...`. `None` until the name is complete, or for another layout.
fn partial<'a>(o: &'a str, key: &str) -> Option<(String, Option<(&'a str, bool)>)> {
    let rest = o.strip_prefix('{')?.trim_start().strip_prefix("\"name\"")?;
    let rest = rest.trim_start().strip_prefix(':')?.trim_start();
    if !rest.starts_with('"') {
        return None;
    }
    let mut de = serde_json::Deserializer::from_str(rest).into_iter::<String>();
    let name = de.next()?.ok()?;
    let after = rest[de.byte_offset()..].trim_start();
    let Some(after) = after.strip_prefix(',') else {
        return Some((name, None));
    };
    let after = after.trim_start();
    let quoted = format!("\"{key}\"");
    let Some(after) = after
        .strip_prefix(quoted.as_str())
        .or_else(|| after.strip_prefix("\"arguments\""))
    else {
        return Some((name, None));
    };
    let Some(after) = after.trim_start().strip_prefix(':') else {
        return Some((name, None));
    };
    let value = after.trim_start();
    if !value.starts_with('{') {
        return Some((name, None));
    }
    let (n, done) = object_extent(value);
    Some((name, Some((&value[..n], done))))
}

/// A function the request offers.
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    pub name: String,
    pub parameters: Value,
}

/// A call the model made.
#[derive(Clone, Debug, PartialEq)]
pub struct Call {
    pub name: String,
    /// A JSON object, as a string (as OpenAI gives it).
    pub arguments: String,
}

impl Call {
    pub fn to_json(&self, id: &str) -> Value {
        json!({"id": id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}})
    }
}

/// What the request asks of tools.
#[derive(Clone, Debug, PartialEq)]
pub enum Choice {
    None,
    Auto,
    Required,
    Named(String),
}

/// A request's tools, read and checked: the objects the template gets, the functions, and
/// the choice.
#[derive(Clone, Debug)]
pub struct ToolRequest {
    pub objects: Vec<Value>,
    pub tools: Vec<Tool>,
    pub choice: Choice,
    pub parallel: bool,
}

/// Reads `tools`, `tool_choice` and `parallel_tool_calls`; `None` without tools. (The
/// deprecated `functions` / `function_call` are refused with the other unsupported fields,
/// in `protocol::refuse_unsupported`.)
pub fn read(body: &Value) -> Result<Option<ToolRequest>, ApiError> {
    let get = |k: &str| body.get(k).filter(|v| !v.is_null());
    let list = match get("tools") {
        None => Vec::new(),
        Some(Value::Array(a)) => a.clone(),
        Some(_) => return Err(Invalid::ToolsNotArray.into()),
    };
    let mut tools = Vec::new();
    for (i, t) in list.iter().enumerate() {
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(Invalid::ToolType { index: i }.into());
        }
        let f = t
            .get("function")
            .filter(|f| f.is_object())
            .ok_or(Invalid::ToolFunction { index: i })?;
        let name = f.get("name").and_then(Value::as_str).unwrap_or("");
        let valid = !name.is_empty()
            && name.len() <= 64
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
        if !valid {
            return Err(Invalid::FunctionName {
                index: i,
                got: name.to_string(),
            }
            .into());
        }
        if tools.iter().any(|t: &Tool| t.name == name) {
            return Err(Invalid::DuplicateTool {
                index: i,
                name: name.to_string(),
            }
            .into());
        }
        let parameters = match f.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
            Some(p @ Value::Object(_)) => p.clone(),
            Some(_) => return Err(Invalid::ToolParameters { index: i }.into()),
        };
        tools.push(Tool {
            name: name.to_string(),
            parameters,
        });
    }
    let choice = read_choice(get("tool_choice"), tools.is_empty())?;
    if choice != Choice::None && tools.is_empty() {
        return Err(Invalid::ToolChoiceWithoutTools.into());
    }
    if let Choice::Named(n) = &choice {
        if !tools.iter().any(|t| &t.name == n) {
            return Err(Invalid::ToolChoiceNotATool(n.clone()).into());
        }
    }
    let parallel = match get("parallel_tool_calls") {
        None => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(Invalid::ParallelToolCalls.into()),
    };
    if tools.is_empty() {
        return Ok(None);
    }
    Ok(Some(ToolRequest {
        objects: list,
        tools,
        choice,
        parallel,
    }))
}

/// `tool_choice`; without it, `auto` when there are tools.
fn read_choice(c: Option<&Value>, no_tools: bool) -> Result<Choice, ApiError> {
    Ok(match c {
        None if no_tools => Choice::None,
        None => Choice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => Choice::None,
            "auto" => Choice::Auto,
            "required" => Choice::Required,
            other => return Err(Invalid::ToolChoiceValue(other.to_string()).into()),
        },
        Some(c) => {
            let name = c
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| c.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or(Invalid::ToolChoiceNamed)?;
            Choice::Named(name.to_string())
        }
    })
}

/// What a streamed output says of its calls, as OpenAI streams them.
#[derive(Clone, Debug, PartialEq)]
pub enum ToolDelta {
    /// A call begins: its index and function name (sent once).
    Name { index: usize, name: String },
    /// More of a call's arguments.
    Args { index: usize, text: String },
}

/// Follows a streamed output: text before any call is content; each call's name is given
/// once it is complete and its arguments as they grow.
pub struct ToolStream {
    format: ToolFormat,
    text: String,
    /// Bytes of `text` already given out as content.
    content_sent: usize,
    /// Calls whose arguments are all given out.
    calls_done: usize,
    /// Calls whose name is given out.
    announced: usize,
    /// Bytes of the current call's arguments given out.
    args_sent: usize,
    /// A marker was seen: the rest is calls.
    in_calls: bool,
    /// The grammar makes the whole output calls.
    forced: bool,
}

impl ToolStream {
    pub fn new(format: ToolFormat, forced: bool) -> ToolStream {
        ToolStream {
            format,
            text: String::new(),
            content_sent: 0,
            calls_done: 0,
            announced: 0,
            args_sent: 0,
            in_calls: forced,
            forced,
        }
    }

    /// Adds output text; what can be said now: content, and calls that completed (with
    /// their index).
    pub fn push(&mut self, delta: &str, last: bool) -> (String, Vec<ToolDelta>) {
        self.text.push_str(delta);
        let mut content = String::new();
        if !self.in_calls {
            let marker = self.format.marker();
            let unsent = &self.text[self.content_sent..];
            let at = if self.format == ToolFormat::Llama3Json {
                // Llama's calls are the whole output: only a leading `{` starts them.
                let lead = unsent.trim_start();
                (self.content_sent == 0 && lead.starts_with(marker))
                    .then(|| unsent.len() - lead.len())
            } else {
                unsent.find(marker)
            };
            match at {
                Some(at) => {
                    content.push_str(&unsent[..at]);
                    self.content_sent += at;
                    self.in_calls = true;
                }
                None => {
                    // Hold back what could still become a marker.
                    let keep = if last {
                        0
                    } else {
                        held_back(
                            unsent,
                            marker,
                            self.content_sent == 0 && self.format == ToolFormat::Llama3Json,
                        )
                    };
                    let n = unsent.len() - keep;
                    content.push_str(&unsent[..n]);
                    self.content_sent += n;
                }
            }
        }
        let mut deltas = Vec::new();
        if self.in_calls {
            self.follow_calls(&mut deltas);
            if last && !self.forced && self.announced == 0 {
                // Not a call after all: it was content.
                content.push_str(&self.text[self.content_sent..]);
                self.content_sent = self.text.len();
            }
        }
        (content, deltas)
    }

    /// Each call object after the marker: its name once it is complete, then its arguments'
    /// text as it grows. An object written another way (auto mode) is given whole once it
    /// closes.
    fn follow_calls(&mut self, deltas: &mut Vec<ToolDelta>) {
        let key = self.format.args_key();
        let region = &self.text[self.content_sent..];
        for (k, (start, end)) in objects(region)
            .into_iter()
            .enumerate()
            .skip(self.calls_done)
        {
            let o = &region[start..end.unwrap_or(region.len())];
            let (name, args) = match partial(o, key) {
                Some(p) => p,
                None => match end.and_then(|_| call_from(o, key)) {
                    Some(c) => {
                        deltas.push(ToolDelta::Name {
                            index: k,
                            name: c.name,
                        });
                        deltas.push(ToolDelta::Args {
                            index: k,
                            text: c.arguments,
                        });
                        (self.announced, self.calls_done, self.args_sent) = (k + 1, k + 1, 0);
                        continue;
                    }
                    None => return,
                },
            };
            if self.announced <= k {
                deltas.push(ToolDelta::Name { index: k, name });
                self.announced = k + 1;
                self.args_sent = 0;
            }
            let Some((text, done)) = args else {
                return;
            };
            if text.len() > self.args_sent {
                deltas.push(ToolDelta::Args {
                    index: k,
                    text: text[self.args_sent..].to_string(),
                });
                self.args_sent = text.len();
            }
            if !done {
                return;
            }
            self.calls_done = k + 1;
            self.args_sent = 0;
        }
    }

    pub fn made_calls(&self) -> bool {
        self.announced > 0
    }
}

/// How many bytes at the end of `text` could be the start of `marker`.
fn held_back(text: &str, marker: &str, leading_only: bool) -> usize {
    if leading_only {
        return if text.trim().is_empty() {
            text.len()
        } else {
            0
        };
    }
    (1..marker.len().min(text.len()) + 1)
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n) && marker.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_format_parses_its_calls_and_leaves_text_alone() {
        let (c, calls) = ToolFormat::Hermes
            .parse("Let me look.\n<tool_call>\n{\"name\": \"get\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"put\", \"arguments\": {}}\n</tool_call>")
            .unwrap();
        assert_eq!(c, "Let me look.");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].name, "get");
        assert_eq!(calls[0].arguments, "{\"city\": \"Paris\"}");
        let (_, calls) = ToolFormat::Llama3Json
            .parse("{\"name\": \"a\", \"parameters\": {\"x\": 1}}; {\"name\": \"b\", \"parameters\": {}}")
            .unwrap();
        assert_eq!((calls[0].name.as_str(), calls[1].name.as_str()), ("a", "b"));
        assert_eq!(calls[0].arguments, "{\"x\": 1}");
        let (_, calls) = ToolFormat::Mistral
            .parse("[TOOL_CALLS][{\"name\": \"m\", \"arguments\": {\"q\": \"z\"}}]")
            .unwrap();
        assert_eq!(calls[0].name, "m");
        assert!(ToolFormat::Hermes.parse("just words").is_none());
        assert!(ToolFormat::Llama3Json.parse("{not json").is_none());
        assert!(ToolFormat::Mistral.parse("[TOOL_CALLS] nope").is_none());
    }

    #[test]
    fn a_stream_gives_content_then_each_call_once() {
        let mut s = ToolStream::new(ToolFormat::Hermes, false);
        let out = "Hi <tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>\n<tool_call>\n{\"name\": \"g\", \"arguments\": {}}\n</tool_call>";
        let mut content = String::new();
        let mut deltas = Vec::new();
        let pieces: Vec<&str> = out.split_inclusive(['<', '}', '\n', ':', ' ']).collect();
        for (i, p) in pieces.iter().enumerate() {
            let (c, k) = s.push(p, i + 1 == pieces.len());
            content.push_str(&c);
            deltas.extend(k);
        }
        assert_eq!(content, "Hi ");
        let names: Vec<_> = deltas
            .iter()
            .filter_map(|d| match d {
                ToolDelta::Name { index, name } => Some((*index, name.as_str())),
                _ => None,
            })
            .collect();
        assert_eq!(names, vec![(0, "f"), (1, "g")]);
        let args = |i: usize| -> String {
            deltas
                .iter()
                .filter_map(|d| match d {
                    ToolDelta::Args { index, text } if *index == i => Some(text.as_str()),
                    _ => None,
                })
                .collect()
        };
        // Arguments arrive in pieces and add up to the whole response's.
        let (_, whole) = ToolFormat::Hermes.parse(out).unwrap();
        assert_eq!(args(0), whole[0].arguments);
        assert_eq!(args(1), whole[1].arguments);
        assert_eq!(args(0), "{\"a\": 1}");
        let pieces_of_first = deltas
            .iter()
            .filter(|d| matches!(d, ToolDelta::Args { index: 0, .. }))
            .count();
        assert!(pieces_of_first > 1, "{deltas:?}");
        // Text that only looked like a call start is content in the end.
        let mut s = ToolStream::new(ToolFormat::Hermes, false);
        let (a, _) = s.push("a <tool", false);
        let (b, k) = s.push("box>", true);
        assert_eq!(format!("{a}{b}"), "a <toolbox>");
        assert!(k.is_empty());
    }

    #[test]
    fn forced_json_array_calls_parse_whole_and_streamed() {
        let out = "[{\"name\": \"f\", \"parameters\": {\"a\": [1, 2]}}, {\"name\": \"g\", \"parameters\": {}}]";
        let (content, calls) = ToolFormat::JsonArray.parse(out).unwrap();
        assert_eq!(content, "");
        assert_eq!(calls[0].name, "f");
        assert_eq!(calls[0].arguments, "{\"a\": [1, 2]}");
        assert_eq!(calls[1].name, "g");
        let mut s = ToolStream::new(ToolFormat::JsonArray, true);
        let mut deltas = Vec::new();
        let mut content = String::new();
        let pieces: Vec<&str> = out.split_inclusive([',', ' ', '{']).collect();
        for (i, p) in pieces.iter().enumerate() {
            let (c, d) = s.push(p, i + 1 == pieces.len());
            content.push_str(&c);
            deltas.extend(d);
        }
        assert_eq!(content, "");
        let args: String = deltas
            .iter()
            .filter_map(|d| match d {
                ToolDelta::Args { index: 0, text } => Some(text.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(args, calls[0].arguments);
        assert!(deltas.contains(&ToolDelta::Name {
            index: 1,
            name: "g".into()
        }));
        assert_eq!(ToolFormat::by_name("hermes"), Ok(ToolFormat::Hermes));
        let e = ToolFormat::by_name("pythonic").unwrap_err();
        assert_eq!(e, UnknownToolParser("pythonic".into()));
        assert!(e.to_string().contains("hermes"), "{e}");
    }

    #[test]
    fn templates_say_their_format() {
        assert_eq!(
            ToolFormat::of_template("{% if tools %}<tool_call>{% endif %}"),
            Some(ToolFormat::Hermes)
        );
        assert_eq!(
            ToolFormat::of_template("{% if tools %}[TOOL_CALLS]{% endif %}"),
            Some(ToolFormat::Mistral)
        );
        assert_eq!(
            ToolFormat::of_template("{% if tools %}<|python_tag|>{% endif %}"),
            Some(ToolFormat::Llama3Json)
        );
        assert_eq!(ToolFormat::of_template("{{ messages }}"), None);
    }
}
