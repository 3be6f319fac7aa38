//! The rules a request's sampling fields and messages must keep, one variant each, and the
//! one place they become OpenAI's error body: HTTP 400, `invalid_request_error`, the field
//! as `param` ([`From<Invalid> for ApiError`]). The messages name the field and what it
//! must be, as OpenAI's do.

use crate::error::{client_text, quoted, ApiError};

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

    // What the output must look like (`structured`).
    #[error("`tools` belong to /v1/chat/completions.")]
    ToolsOnCompletions,
    /// Two fields that each constrain the output; `second` is named.
    #[error("`{first}` and `{second}` both constrain the output; send one.")]
    TwoConstraints {
        first: &'static str,
        second: &'static str,
    },
    #[error("This model cannot constrain its output: {}", client_text(.why))]
    CannotConstrain { field: &'static str, why: String },
    /// A constraint the grammar engine refuses (too large, unsupported features).
    #[error("`{field}` cannot be followed: {}", client_text(.why))]
    CannotFollow { field: String, why: String },
    /// The model's grammar engine is unavailable, as it says.
    #[error("{}", client_text(.0))]
    ToolsUnconstrainable(String),
    #[error(
        "`tools[{index}].function.parameters` is not a usable JSON Schema: {}",
        client_text(.why)
    )]
    ToolSchema { index: usize, why: String },
    #[error(
        "The chat template of `{model}` does not say how the model calls tools (it shows no \
         Hermes/Qwen <tool_call>, Llama 3 JSON or Mistral [TOOL_CALLS] format), so calls \
         cannot be told from text with tool_choice \"auto\": start the server with \
         --tool-call-parser hermes|llama3_json|mistral, or send tool_choice \"required\" or \
         a named function (calls are then forced as JSON), or \"none\"."
    )]
    NoToolFormat { model: String },
    #[error("`logit_bias` maps token ids to biases: a JSON object.")]
    LogitBiasNotObject,
    #[error("`logit_bias` key {} is not a token id.", quoted(.0))]
    LogitBiasKey(String),
    #[error("`logit_bias` names token {id}, outside the vocabulary (size {vocab}).")]
    LogitBiasOutsideVocab { id: u32, vocab: usize },
    #[error(
        "`logit_bias` for token {id} must be a number from -100 to 100, got {}.",
        client_text(.got)
    )]
    LogitBiasValue { id: u32, got: String },
    #[error("`json_schema` must be an object with `name` and `schema`.")]
    JsonSchemaNotObject,
    #[error("`schema` must be a JSON Schema object.")]
    SchemaNotObject,
    #[error(
        "`response_format` type {} is not supported; use text, json_object or json_schema.",
        quoted(.0)
    )]
    ResponseFormatType(String),
    #[error("`response_format` needs a `type`.")]
    ResponseFormatNoType,
    #[error("`structured_outputs` must be an object.")]
    StructuredOutputsNotObject,
    #[error(
        "`structured_outputs.{}` is not supported; use json, regex, choice, grammar or \
         json_object.",
        client_text(.0)
    )]
    StructuredOutputsKey(String),
    /// A vLLM constraint field (`guided_regex`, `structured_outputs.choice`, ...) of the
    /// wrong shape: what it must be.
    #[error("`{field}` must be {what}.")]
    ConstraintValue {
        field: &'static str,
        what: &'static str,
    },

    // Tools (`tools`).
    #[error("`tools` must be an array.")]
    ToolsNotArray,
    #[error("Only tools of type `function` are supported.")]
    ToolType { index: usize },
    #[error("A tool needs a `function` object.")]
    ToolFunction { index: usize },
    #[error(
        "Function names are 1 to 64 of a-z, A-Z, 0-9, _ and -; got {}.",
        quoted(.got)
    )]
    FunctionName { index: usize, got: String },
    #[error("Two tools are named `{name}`.")]
    DuplicateTool { index: usize, name: String },
    #[error("`parameters` must be a JSON Schema object.")]
    ToolParameters { index: usize },
    #[error("`tool_choice` needs `tools` to choose from.")]
    ToolChoiceWithoutTools,
    #[error("`tool_choice` names {}, which is not among `tools`.", quoted(.0))]
    ToolChoiceNotATool(String),
    #[error("`parallel_tool_calls` must be true or false.")]
    ParallelToolCalls,
    #[error(
        "`tool_choice` is none, auto, required or a named function; got {}.",
        quoted(.0)
    )]
    ToolChoiceValue(String),
    #[error(
        "A named `tool_choice` is {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}."
    )]
    ToolChoiceNamed,

    // Completions.
    #[error("Send one prompt per request (got {0}).")]
    OnePrompt(usize),
    #[error("The prompt is empty.")]
    EmptyPrompt,

    // Fields of the API this server does not implement.
    /// `functions` or `function_call`.
    #[error("`{0}` is the deprecated form of tools; send `tools` and `tool_choice`.")]
    DeprecatedFunctions(&'static str),
    /// `best_of` other than `n` (given).
    #[error(
        "`best_of` other than `n` ({0}) is not supported: this server does not generate \
         candidates to pick from. Leave it out or send best_of = n."
    )]
    BestOf(i64),
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
            I::ToolsOnCompletions
            | I::ToolsUnconstrainable(_)
            | I::NoToolFormat { .. }
            | I::ToolsNotArray => "tools".into(),
            I::TwoConstraints { second, .. } => (*second).into(),
            I::CannotConstrain { field, .. } | I::ConstraintValue { field, .. } => (*field).into(),
            I::CannotFollow { field, .. } => field.clone(),
            I::ToolSchema { index, .. } | I::ToolParameters { index } => {
                format!("tools[{index}].function.parameters")
            }
            I::LogitBiasNotObject
            | I::LogitBiasKey(_)
            | I::LogitBiasOutsideVocab { .. }
            | I::LogitBiasValue { .. } => "logit_bias".into(),
            I::JsonSchemaNotObject => "response_format.json_schema".into(),
            I::SchemaNotObject => "response_format.json_schema.schema".into(),
            I::ResponseFormatType(_) | I::ResponseFormatNoType => "response_format".into(),
            I::StructuredOutputsNotObject => "structured_outputs".into(),
            I::StructuredOutputsKey(k) => format!("structured_outputs.{}", client_text(k)),
            I::ToolType { index } => format!("tools[{index}].type"),
            I::ToolFunction { index } => format!("tools[{index}].function"),
            I::FunctionName { index, .. } | I::DuplicateTool { index, .. } => {
                format!("tools[{index}].function.name")
            }
            I::ToolChoiceWithoutTools
            | I::ToolChoiceNotATool(_)
            | I::ToolChoiceValue(_)
            | I::ToolChoiceNamed => "tool_choice".into(),
            I::ParallelToolCalls => "parallel_tool_calls".into(),
            I::OnePrompt(_) | I::EmptyPrompt => "prompt".into(),
            I::DeprecatedFunctions(field) => (*field).into(),
            I::BestOf(_) => "best_of".into(),
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
        let shapes = [
            (
                Invalid::ToolsOnCompletions,
                "tools",
                "belong to /v1/chat/completions",
            ),
            (
                Invalid::TwoConstraints {
                    first: "response_format",
                    second: "guided_regex",
                },
                "guided_regex",
                "`response_format` and `guided_regex` both constrain the output; send one.",
            ),
            (
                Invalid::CannotConstrain {
                    field: "guided_json",
                    why: "no grammar engine".into(),
                },
                "guided_json",
                "This model cannot constrain its output: no grammar engine",
            ),
            (
                Invalid::CannotFollow {
                    field: "guided_regex".into(),
                    why: "too large".into(),
                },
                "guided_regex",
                "`guided_regex` cannot be followed: too large",
            ),
            (Invalid::ToolsUnconstrainable("x".into()), "tools", "x"),
            (
                Invalid::ToolSchema {
                    index: 2,
                    why: "bad".into(),
                },
                "tools[2].function.parameters",
                "`tools[2].function.parameters` is not a usable JSON Schema: bad",
            ),
            (
                Invalid::NoToolFormat { model: "m".into() },
                "tools",
                "The chat template of `m` does not say how the model calls tools",
            ),
            (Invalid::LogitBiasNotObject, "logit_bias", "a JSON object"),
            (
                Invalid::LogitBiasKey("x".into()),
                "logit_bias",
                "key `x` is not a token id.",
            ),
            (
                Invalid::LogitBiasOutsideVocab { id: 9, vocab: 5 },
                "logit_bias",
                "names token 9, outside the vocabulary (size 5).",
            ),
            (
                Invalid::LogitBiasValue {
                    id: 1,
                    got: "200".into(),
                },
                "logit_bias",
                "for token 1 must be a number from -100 to 100, got 200.",
            ),
            (
                Invalid::JsonSchemaNotObject,
                "response_format.json_schema",
                "`json_schema` must be an object",
            ),
            (
                Invalid::SchemaNotObject,
                "response_format.json_schema.schema",
                "`schema` must be a JSON Schema object.",
            ),
            (
                Invalid::ResponseFormatType("xml".into()),
                "response_format",
                "type `xml` is not supported",
            ),
            (
                Invalid::ResponseFormatNoType,
                "response_format",
                "needs a `type`",
            ),
            (
                Invalid::StructuredOutputsNotObject,
                "structured_outputs",
                "must be an object",
            ),
            (
                Invalid::StructuredOutputsKey("jsn".into()),
                "structured_outputs.jsn",
                "`structured_outputs.jsn` is not supported",
            ),
            (
                Invalid::ConstraintValue {
                    field: "guided_choice",
                    what: "a non-empty list of non-empty strings",
                },
                "guided_choice",
                "`guided_choice` must be a non-empty list of non-empty strings.",
            ),
            (Invalid::ToolsNotArray, "tools", "`tools` must be an array."),
            (
                Invalid::ToolType { index: 1 },
                "tools[1].type",
                "type `function`",
            ),
            (
                Invalid::ToolFunction { index: 0 },
                "tools[0].function",
                "`function` object",
            ),
            (
                Invalid::FunctionName {
                    index: 0,
                    got: "a b".into(),
                },
                "tools[0].function.name",
                "got `a b`.",
            ),
            (
                Invalid::DuplicateTool {
                    index: 1,
                    name: "f".into(),
                },
                "tools[1].function.name",
                "Two tools are named `f`.",
            ),
            (
                Invalid::ToolParameters { index: 3 },
                "tools[3].function.parameters",
                "`parameters` must be a JSON Schema object.",
            ),
            (
                Invalid::ToolChoiceWithoutTools,
                "tool_choice",
                "needs `tools`",
            ),
            (
                Invalid::ToolChoiceNotATool("g".into()),
                "tool_choice",
                "names `g`, which is not among `tools`.",
            ),
            (
                Invalid::ParallelToolCalls,
                "parallel_tool_calls",
                "true or false",
            ),
            (
                Invalid::ToolChoiceValue("x".into()),
                "tool_choice",
                "got `x`.",
            ),
            (
                Invalid::ToolChoiceNamed,
                "tool_choice",
                r#"A named `tool_choice` is {"type": "function", "function": {"name": ...}}."#,
            ),
            (Invalid::EmptyPrompt, "prompt", "The prompt is empty."),
            (
                Invalid::DeprecatedFunctions("function_call"),
                "function_call",
                "`function_call` is the deprecated form of tools",
            ),
            (
                Invalid::BestOf(1),
                "best_of",
                "`best_of` other than `n` (1) is not supported",
            ),
            (
                Invalid::OnePrompt(3),
                "prompt",
                "Send one prompt per request (got 3).",
            ),
        ];
        for (e, param, text) in cases.into_iter().chain(shapes) {
            let api = ApiError::from(e.clone());
            assert_eq!(api.status, StatusCode::BAD_REQUEST, "{e:?}");
            assert_eq!(api.kind, "invalid_request_error", "{e:?}");
            assert_eq!(api.param.as_deref(), Some(param), "{e:?}");
            assert!(api.message.contains(text), "{e:?}: {}", api.message);
            assert_eq!(api.code, None, "{e:?}");
        }
    }

    #[test]
    fn huge_client_text_is_quoted_short() {
        let huge = "r".repeat(1 << 20);
        for e in [
            Invalid::Role {
                message: 0,
                role: huge.clone(),
            },
            Invalid::LogitBiasValue {
                id: 0,
                got: huge.clone(),
            },
            Invalid::StructuredOutputsKey(huge.clone()),
            Invalid::ToolChoiceValue(huge.clone()),
        ] {
            let api = ApiError::from(e);
            assert!(api.message.len() < 400, "{} bytes", api.message.len());
            assert!(api.message.contains("(1048576 bytes)"), "{}", api.message);
            assert!(api.param.as_ref().is_some_and(|p| p.len() < 400));
        }
    }
}
