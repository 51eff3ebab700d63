//! Tool calls as the model writes them, and their check against the tools' JSON schemas.
//!
//! A model family writes calls at the end of an assistant turn in the format its chat template
//! (and its tool-use training) uses:
//! - [`CallFormat::Hermes`] (Qwen2/2.5/3, Hermes, SmolLM3, ...): one or more
//!   `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; the last one may be
//!   unclosed when generation stopped on the `</tool_call>` stop string.
//! - [`CallFormat::Llama3`] (Llama 3.1-3.3 JSON tool calling): the whole turn is
//!   `{"name": ..., "parameters": {...}}`, several such objects separated by `;`, or a JSON list
//!   of them, optionally after `<|python_tag|>` and before `<|eom_id|>` / `<|eot_id|>`.
//! - [`CallFormat::Mistral`]: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v3), or
//!   `[TOOL_CALLS]name[ARGS]{...}` repeated per call, possibly with `[CALL_ID]id` (v11+).
//!
//! [`parse_turn`] reads a turn into [`TurnCalls`]; [`check_call`] validates a call's arguments.

use serde_json::{Map, Value};

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";
const LLAMA_END_TAGS: [&str; 2] = ["<|eom_id|>", "<|eot_id|>"];
const MISTRAL_TAG: &str = "[TOOL_CALLS]";
const MISTRAL_ARGS: &str = "[ARGS]";
const MISTRAL_CALL_ID: &str = "[CALL_ID]";

/// How a model family writes tool calls, chosen once from the chat template's source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CallFormat {
    /// `<tool_call>{json}</tool_call>` blocks (Qwen2/2.5/3, Hermes, SmolLM3, ...).
    #[serde(alias = "qwen")]
    Hermes,
    /// Llama 3.x JSON tool calling: the turn is the call's JSON.
    Llama3,
    /// `[TOOL_CALLS]` followed by a JSON list, or by `name[ARGS]{json}`.
    Mistral,
}

impl CallFormat {
    /// The format a chat template's source writes: contains "[TOOL_CALLS]" -> Mistral; contains
    /// "<tool_call>" -> Hermes; contains "<|python_tag|>", "ipython" or "<|eom_id|>" -> Llama3;
    /// else None.
    pub fn from_template(source: &str) -> Option<CallFormat> {
        if source.contains(MISTRAL_TAG) {
            Some(CallFormat::Mistral)
        } else if source.contains(HERMES_OPEN) {
            Some(CallFormat::Hermes)
        } else if ["<|python_tag|>", "ipython", "<|eom_id|>"]
            .iter()
            .any(|marker| source.contains(marker))
        {
            Some(CallFormat::Llama3)
        } else {
            None
        }
    }

    /// Parses "hermes" | "qwen" (alias of hermes) | "llama3" | "mistral" (a config value).
    pub fn parse(name: &str) -> Result<CallFormat, String> {
        match name {
            "hermes" | "qwen" => Ok(CallFormat::Hermes),
            "llama3" => Ok(CallFormat::Llama3),
            "mistral" => Ok(CallFormat::Mistral),
            other => Err(format!(
                "unknown tool call format `{other}`: expected one of hermes, qwen (alias of \
                 hermes), llama3, mistral"
            )),
        }
    }

    /// The stop string that ends a turn with a tool call in this format, if it has one
    /// (Hermes: "</tool_call>"); the others end with EOS / `<|eom_id|>`.
    pub fn stop_string(self) -> Option<&'static str> {
        match self {
            CallFormat::Hermes => Some(HERMES_CLOSE),
            CallFormat::Llama3 | CallFormat::Mistral => None,
        }
    }
}

/// One call the model made.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ToolCall {
    /// The tool's name, as the model wrote it.
    pub name: String,
    /// The arguments (`{}` when the model gave none).
    pub arguments: Map<String, Value>,
}

/// What a model turn asked for.
#[derive(Debug, Clone, PartialEq)]
pub enum TurnCalls {
    /// No tool call: the turn is the model's answer.
    None,
    /// One or more well-formed calls, in order.
    Calls(Vec<ToolCall>),
    /// The turn tried to call a tool but the call cannot be read; the message says why, for
    /// the model (it becomes a tool error message in the conversation).
    Malformed(String),
}

/// The calls in the model turn `text` (the turn's decoded text, special tokens possibly present).
pub fn parse_turn(format: CallFormat, text: &str) -> TurnCalls {
    let parsed = match format {
        CallFormat::Hermes => parse_hermes(text),
        CallFormat::Llama3 => parse_llama3(text),
        CallFormat::Mistral => parse_mistral(text),
    };
    match parsed {
        Ok(None) => TurnCalls::None,
        Ok(Some(calls)) => TurnCalls::Calls(calls),
        Err(message) => TurnCalls::Malformed(message),
    }
}

/// Hermes: every `<tool_call>` block; a block ends at `</tool_call>`, the next `<tool_call>`,
/// or the end of the text.
fn parse_hermes(text: &str) -> Result<Option<Vec<ToolCall>>, String> {
    let Some(start) = text.find(HERMES_OPEN) else {
        return Ok(None);
    };
    let mut rest = &text[start..];
    let mut calls = Vec::new();
    while let Some(after) = rest.strip_prefix(HERMES_OPEN) {
        let close = after.find(HERMES_CLOSE);
        let next_open = after.find(HERMES_OPEN);
        let (body, tail) = match close.filter(|&c| next_open.is_none_or(|o| c < o)) {
            Some(c) => (&after[..c], &after[c + HERMES_CLOSE.len()..]),
            None => {
                let end = next_open.unwrap_or(after.len());
                (strip_special_suffix(&after[..end]), &after[end..])
            }
        };
        let n = calls.len() + 1;
        let body = body.trim();
        if body.is_empty() {
            return Err(format!("tool call {n} is empty"));
        }
        let value: Value = serde_json::from_str(body)
            .map_err(|e| format!("tool call {n} is not valid JSON: {e}"))?;
        calls.push(call_from_value(value, n)?);
        rest = tail.find(HERMES_OPEN).map_or("", |at| &tail[at..]);
    }
    Ok(Some(calls))
}

/// `s` without trailing `<|...|>` special tokens (an end-of-turn marker after an unclosed call).
fn strip_special_suffix(s: &str) -> &str {
    let mut s = s.trim_end();
    while s.ends_with("|>") {
        match s.rfind("<|") {
            Some(at) => s = s[..at].trim_end(),
            None => break,
        }
    }
    s
}

/// Llama 3: the trimmed turn (past `<|python_tag|>`, before `<|eom_id|>`/`<|eot_id|>`) is a
/// call only if it starts with `{` or `[` or had the python tag.
fn parse_llama3(text: &str) -> Result<Option<Vec<ToolCall>>, String> {
    let mut content = text.trim();
    let tagged = content.starts_with(PYTHON_TAG);
    if tagged {
        content = content[PYTHON_TAG.len()..].trim_start();
    }
    while let Some(end) = LLAMA_END_TAGS.iter().find(|t| content.ends_with(*t)) {
        content = content[..content.len() - end.len()].trim_end();
    }
    if !tagged && !content.starts_with(['{', '[']) {
        return Ok(None);
    }
    let mut calls = Vec::new();
    let mut rest = content;
    loop {
        let n = calls.len() + 1;
        let (value, tail) = first_json(rest).map_err(|e| format!("tool call {n} is {e}"))?;
        push_calls(value, &mut calls)?;
        let tail = tail.trim_start();
        rest = match tail.strip_prefix(';') {
            Some(next) => next.trim_start(),
            None if tail.is_empty() => "",
            None => return Err(unexpected_text(calls.len(), tail)),
        };
        if rest.is_empty() {
            return Ok(Some(calls));
        }
    }
}

/// Mistral: after the first `[TOOL_CALLS]`, a JSON list (v3) or `name[ARGS]{...}` (v11+), each
/// possibly followed by another `[TOOL_CALLS]`.
fn parse_mistral(text: &str) -> Result<Option<Vec<ToolCall>>, String> {
    let Some(start) = text.find(MISTRAL_TAG) else {
        return Ok(None);
    };
    let mut rest = text[start..].trim_end();
    while let Some(r) = rest.strip_suffix("</s>") {
        rest = r.trim_end();
    }
    let mut calls = Vec::new();
    while let Some(after) = rest.strip_prefix(MISTRAL_TAG) {
        let after = after.trim_start();
        let n = calls.len() + 1;
        let tail = if after.is_empty() {
            return Err(format!("tool call {n} is empty"));
        } else if after.starts_with('{')
            || after.starts_with('[') && !after.starts_with(MISTRAL_ARGS)
        {
            let (value, tail) = first_json(after).map_err(|e| format!("tool call {n} is {e}"))?;
            push_calls(value, &mut calls)?;
            tail
        } else {
            mistral_named_call(after, &mut calls)?
        };
        rest = tail.trim_start();
    }
    if !rest.is_empty() {
        return Err(unexpected_text(calls.len(), rest));
    }
    Ok(Some(calls))
}

/// One v11+ Mistral call, `name[CALL_ID]id[ARGS]{...}` (the call id optional), pushed to
/// `calls`; returns the text after its arguments.
fn mistral_named_call<'a>(text: &'a str, calls: &mut Vec<ToolCall>) -> Result<&'a str, String> {
    let n = calls.len() + 1;
    let Some(args_at) = text.find(MISTRAL_ARGS) else {
        return Err(format!("tool call {n} has no [ARGS] after the tool name"));
    };
    let head = &text[..args_at];
    let name = head.split(MISTRAL_CALL_ID).next();
    let name = name.unwrap_or_default().trim();
    if name.is_empty() || name.contains(char::is_whitespace) {
        return Err(format!(
            "tool call {n} has no valid tool name before {MISTRAL_ARGS}: `{}`",
            snippet(head)
        ));
    }
    let (value, tail) = first_json(&text[args_at + MISTRAL_ARGS.len()..])
        .map_err(|e| format!("the arguments of tool call {n} are {e}"))?;
    let arguments = arguments_from(Some(value), n)?;
    let name = name.to_string();
    calls.push(ToolCall { name, arguments });
    Ok(tail)
}

/// The first JSON value in `text` and the text after it; the error completes "... is/are ".
fn first_json(text: &str) -> Result<(Value, &str), String> {
    let mut values = serde_json::Deserializer::from_str(text).into_iter::<Value>();
    match values.next() {
        None => Err("empty".to_string()),
        Some(Err(e)) => Err(format!("not valid JSON: {e}")),
        Some(Ok(value)) => Ok((value, &text[values.byte_offset()..])),
    }
}

/// Pushes the call `value` is, or the calls in it if it is a list.
fn push_calls(value: Value, calls: &mut Vec<ToolCall>) -> Result<(), String> {
    match value {
        Value::Array(items) if items.is_empty() => {
            Err(format!("tool call {} is an empty list", calls.len() + 1))
        }
        Value::Array(items) => items.into_iter().try_for_each(|item| {
            let n = calls.len() + 1;
            calls.push(call_from_value(item, n)?);
            Ok(())
        }),
        other => {
            let n = calls.len() + 1;
            calls.push(call_from_value(other, n)?);
            Ok(())
        }
    }
}

/// Call `n` (1-based) from its JSON: `{"name": ..., "arguments" | "parameters": ...}`.
fn call_from_value(value: Value, n: usize) -> Result<ToolCall, String> {
    let mut object = match value {
        Value::Object(object) => object,
        other => {
            return Err(format!(
                "tool call {n} is {}, not a JSON object",
                kind(&other)
            ))
        }
    };
    let name = match object.remove("name") {
        Some(Value::String(name)) if !name.trim().is_empty() => name,
        _ => return Err(format!("tool call {n} has no \"name\" string")),
    };
    let arguments = object.remove("arguments");
    let arguments = arguments_from(arguments.or_else(|| object.remove("parameters")), n)?;
    Ok(ToolCall { name, arguments })
}

/// Call `n`'s arguments: an object, a string holding one, or nothing / null (no arguments).
fn arguments_from(value: Option<Value>, n: usize) -> Result<Map<String, Value>, String> {
    match value {
        None | Some(Value::Null) => Ok(Map::new()),
        Some(Value::Object(arguments)) => Ok(arguments),
        Some(Value::String(text)) if text.trim().is_empty() => Ok(Map::new()),
        Some(Value::String(text)) => match serde_json::from_str::<Value>(&text) {
            Ok(Value::Object(arguments)) => Ok(arguments),
            Ok(other) => Err(format!(
                "the arguments of tool call {n} are a string holding {}, not a JSON object",
                kind(&other)
            )),
            Err(e) => Err(format!(
                "the arguments of tool call {n} are a string that is not valid JSON: {e}"
            )),
        },
        Some(other) => Err(format!(
            "the arguments of tool call {n} are {}, not a JSON object",
            kind(&other)
        )),
    }
}

fn unexpected_text(after: usize, text: &str) -> String {
    let text = snippet(text);
    format!("unexpected text after tool call {after}: `{text}`")
}

/// `text`, cut to its first 40 characters.
fn snippet(text: &str) -> String {
    let mut chars = text.chars();
    let head: String = chars.by_ref().take(40).collect();
    if chars.next().is_some() {
        format!("{head}...")
    } else {
        head
    }
}

/// `value` for a message: its kind and (cut) JSON text, as in `a string "3"`.
fn describe(value: &Value) -> String {
    match value {
        Value::Null => "null".to_string(),
        _ => format!("{} {}", kind(value), snippet(&value.to_string())),
    }
}

/// The JSON kind of `value`, with its article ("a string").
fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(n) if n.is_f64() => "a number",
        Value::Number(_) => "an integer",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Why a call cannot be run, as a kind (for metrics) and a message (for the model).
#[derive(Debug, Clone, PartialEq)]
pub struct CallError {
    /// "unknown_tool" or "arguments".
    pub kind: &'static str,
    /// What is wrong, for the model.
    pub message: String,
}

/// A [`CallError`] of `kind`.
pub(crate) fn call_error(kind: &'static str, message: impl Into<String>) -> CallError {
    CallError {
        kind,
        message: message.into(),
    }
}

/// Checks `call` against the known tools' JSON schemas (`tools`: OpenAI/HF function-schema
/// objects, `{"type": "function", "function": {"name", "description", "parameters"}}`; a bare
/// `{"name", "parameters"}` is accepted too). Errors: kind "unknown_tool", or kind "arguments"
/// (missing required, unexpected, wrong type, not in enum).
pub fn check_call(call: &ToolCall, tools: &[Value]) -> Result<(), CallError> {
    let functions = tools.iter().map(|t| t.get("function").unwrap_or(t));
    let named = functions.filter_map(|f| Some((f.get("name")?.as_str()?, f)));
    let names: Vec<(&str, &Value)> = named.collect();
    let Some((_, function)) = names.iter().find(|(name, _)| *name == call.name) else {
        let names: Vec<&str> = names.iter().map(|(name, _)| *name).collect();
        let message = if names.is_empty() {
            format!("unknown tool `{}`: no tools are available", call.name)
        } else {
            let (name, names) = (&call.name, names.join(", "));
            format!("unknown tool `{name}`; the available tools are: {names}")
        };
        return Err(CallError {
            kind: "unknown_tool",
            message,
        });
    };
    let parameters = function.get("parameters").unwrap_or(&Value::Null);
    check_object(&call.arguments, parameters, "").map_err(|message| CallError {
        kind: "arguments",
        message: format!("tool `{}`: {message}", call.name),
    })
}

/// Checks an object's keys against `schema`'s "required", "properties" and
/// "additionalProperties"; `path` names the object ("" for the arguments themselves).
fn check_object(object: &Map<String, Value>, schema: &Value, path: &str) -> Result<(), String> {
    let required = schema.get("required").and_then(Value::as_array);
    let missing: Vec<String> = required
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .filter(|key| !object.contains_key(*key))
        .map(|key| format!("`{}`", join(path, key)))
        .collect();
    if !missing.is_empty() {
        let (s, missing) = (if missing.len() > 1 { "s" } else { "" }, missing.join(", "));
        return Err(format!("missing required argument{s} {missing}"));
    }
    let properties = schema.get("properties").and_then(Value::as_object);
    let additional = schema.get("additionalProperties");
    for (key, value) in object {
        let at = join(path, key);
        match (properties.and_then(|p| p.get(key)), additional) {
            (Some(property), _) => check_value(value, property, &at)?,
            (None, Some(extra @ Value::Object(_))) => check_value(value, extra, &at)?,
            (None, Some(Value::Bool(true))) => {}
            (None, Some(Value::Bool(false))) => return Err(unexpected_argument(&at, properties)),
            (None, _) if properties.is_some() => return Err(unexpected_argument(&at, properties)),
            (None, _) => {}
        }
    }
    Ok(())
}

fn unexpected_argument(at: &str, properties: Option<&Map<String, Value>>) -> String {
    let known: Vec<&str> = properties
        .into_iter()
        .flatten()
        .map(|(k, _)| k.as_str())
        .collect();
    if known.is_empty() {
        return format!("unexpected argument `{at}`: no arguments are accepted here");
    }
    let known = known.join(", ");
    format!("unexpected argument `{at}`; the accepted arguments are: {known}")
}

/// Checks `value` against `schema`'s "nullable", "type", "enum", "anyOf", "items" and (for
/// objects) properties.
fn check_value(value: &Value, schema: &Value, path: &str) -> Result<(), String> {
    if value.is_null() && schema.get("nullable") == Some(&Value::Bool(true)) {
        return Ok(());
    }
    if let Some(types) = schema.get("type") {
        check_type(value, types, path)?;
    }
    if let Some(Value::Array(options)) = schema.get("enum") {
        if !options.iter().any(|option| same_value(option, value)) {
            let options: Vec<String> = options.iter().map(Value::to_string).collect();
            let (options, got) = (options.join(", "), snippet(&value.to_string()));
            return Err(format!(
                "argument `{path}` must be one of {options}, got {got}"
            ));
        }
    }
    if let Some(Value::Array(choices)) = schema.get("anyOf") {
        let errors: Vec<String> = choices
            .iter()
            .filter_map(|s| check_value(value, s, path).err())
            .collect();
        if !choices.is_empty() && errors.len() == choices.len() {
            return Err(errors.join("; or "));
        }
    }
    match value {
        Value::Array(items) => match schema.get("items") {
            Some(item_schema @ Value::Object(_)) => items
                .iter()
                .enumerate()
                .try_for_each(|(i, item)| check_value(item, item_schema, &format!("{path}[{i}]"))),
            _ => Ok(()),
        },
        Value::Object(object) => check_object(object, schema, path),
        _ => Ok(()),
    }
}

/// Checks `value` against a "type": one type name or a list of them.
fn check_type(value: &Value, types: &Value, path: &str) -> Result<(), String> {
    let names: Vec<&str> = match types {
        Value::String(name) => vec![name.as_str()],
        Value::Array(names) => names.iter().filter_map(Value::as_str).collect(),
        _ => return Ok(()),
    };
    if names.is_empty() || names.iter().any(|name| has_type(value, name)) {
        return Ok(());
    }
    let (names, got) = (names.join(" or "), describe(value));
    Err(format!(
        "argument `{path}` must be of type {names}, got {got}"
    ))
}

/// Whether `value` is of the JSON schema type `name` (unknown type names accept anything).
fn has_type(value: &Value, name: &str) -> bool {
    match name {
        "string" => value.is_string(),
        "integer" => {
            let whole = |f: f64| f.is_finite() && f.fract() == 0.0;
            value.is_i64() || value.is_u64() || value.as_f64().is_some_and(whole)
        }
        "number" => value.is_number(),
        "boolean" => value.is_boolean(),
        "array" => value.is_array(),
        "object" => value.is_object(),
        "null" => value.is_null(),
        _ => true,
    }
}

/// JSON equality, with numbers compared by value (3 == 3.0).
fn same_value(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        _ => a == b,
    }
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use CallFormat::{Hermes, Llama3, Mistral};

    fn call(name: &str, arguments: Value) -> ToolCall {
        let arguments = arguments.as_object().cloned().unwrap();
        let name = name.to_string();
        ToolCall { name, arguments }
    }

    const QWEN_TWO: &str = r#"<think>
I need the weather and the time.
</think>

<tool_call>
{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}
</tool_call>
<tool_call>
{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}
</tool_call><|im_end|>"#;

    #[test]
    fn parses_calls_in_each_format() {
        let weather = json!({"location": "Paris", "unit": "celsius"});
        let weather = call("get_weather", weather);
        let time = call("get_time", json!({"tz": "Europe/Paris"}));
        let now = call("now", json!({}));
        let add = call("add", json!({"a": 2, "b": "[TOOL_CALLS]"}));
        let cases = [
            // Hermes / Qwen: single, several, arguments as a string, none, "parameters", unclosed.
            (Hermes, "I'll check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call>", vec![weather.clone()]),
            (Hermes, QWEN_TWO, vec![weather.clone(), time.clone()]),
            (Hermes, r#"<tool_call>{"name": "get_time", "arguments": "{\"tz\": \"Europe/Paris\"}"}</tool_call>"#, vec![time.clone()]),
            (Hermes, r#"<tool_call>{"name": "now"}</tool_call>"#, vec![now.clone()]),
            (Hermes, r#"<tool_call> {"name": "get_time", "parameters": {"tz": "Europe/Paris"}} </tool_call>"#, vec![time.clone()]),
            (Hermes, "Let me see.\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": \"Europe/Paris\"}}\n", vec![time.clone()]),
            (Hermes, r#"<tool_call>{"name": "now", "arguments": {}}<|im_end|>"#, vec![now.clone()]),
            // Llama 3.x: tagged, plain, ";"-separated, a list, no parameters.
            (Llama3, r#"<|python_tag|>{"name": "get_weather", "parameters": {"location": "Paris", "unit": "celsius"}}<|eom_id|>"#, vec![weather.clone()]),
            (Llama3, r#"  {"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}<|eot_id|>"#, vec![weather.clone()]),
            (Llama3, r#"{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}; {"name": "now", "parameters": {}}"#, vec![time.clone(), now.clone()]),
            (Llama3, r#"[{"name": "get_time", "parameters": "{\"tz\": \"Europe/Paris\"}"}, {"name": "now"}]"#, vec![time.clone(), now.clone()]),
            // Mistral: v3 list, v11 `name[ARGS]`, repeated, with a call id.
            (Mistral, r#"[TOOL_CALLS] [{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}]</s>"#, vec![weather.clone()]),
            (Mistral, r#"Sure.[TOOL_CALLS][{"name": "get_time", "arguments": "{\"tz\": \"Europe/Paris\"}"}, {"name": "now"}]"#, vec![time.clone(), now.clone()]),
            (Mistral, r#"[TOOL_CALLS]get_weather[ARGS]{"location": "Paris", "unit": "celsius"}</s>"#, vec![weather.clone()]),
            (Mistral, r#"[TOOL_CALLS]now[ARGS]{}[TOOL_CALLS]add[ARGS]{"a": 2, "b": "[TOOL_CALLS]"}"#, vec![now.clone(), add]),
            (Mistral, r#"[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{"tz": "Europe/Paris"}"#, vec![time]),
        ];
        for (format, text, expected) in cases {
            assert_eq!(
                parse_turn(format, text),
                TurnCalls::Calls(expected),
                "{text}"
            );
        }
    }

    #[test]
    fn answers_without_calls() {
        let cases = [
            (Hermes, "The answer is {x: 42}; no tools needed."),
            (Llama3, "The capital of France is Paris.<|eot_id|>"),
            (Llama3, "In Rust, {let x = 1;} is a block."),
            (Mistral, "Paris is the capital of France.</s>"),
        ];
        for (format, text) in cases {
            assert_eq!(parse_turn(format, text), TurnCalls::None, "{text}");
        }
    }

    #[test]
    fn malformed_calls_say_why() {
        let cases = [
            (Hermes, "<tool_call>\n{\"name\": \"add\" \"arguments\": {}}\n</tool_call>", "tool call 1 is not valid JSON: expected `,` or `}` at line 1 column 16"),
            (Hermes, "<tool_call>{\"name\": \"a\"}</tool_call>\n<tool_call>{\"name\": \"b\", \"arguments\": {</tool_call>", "tool call 2 is not valid JSON: EOF"),
            (Hermes, r#"<tool_call>{"function": "add", "arguments": {}}</tool_call>"#, "tool call 1 has no \"name\" string"),
            (Hermes, "<tool_call>[1, 2]</tool_call>", "tool call 1 is an array, not a JSON object"),
            (Hermes, "<tool_call>\n</tool_call>", "tool call 1 is empty"),
            (Hermes, r#"<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>"#, "the arguments of tool call 1 are an array, not"),
            (Hermes, r#"<tool_call>{"name": "add", "arguments": "{a: 1}"}"#, "the arguments of tool call 1 are a string that is not valid JSON"),
            (Llama3, r#"{"name": "get_weather", "parameters": {"location": "Paris"}"#, "tool call 1 is not valid JSON: EOF"),
            (Llama3, r#"{"parameters": {"location": "Paris"}}"#, "tool call 1 has no \"name\" string"),
            (Llama3, r#"<|python_tag|>brave_search.call(query="weather")<|eom_id|>"#, "tool call 1 is not valid JSON"),
            (Llama3, r#"{"name": "f", "parameters": {}} Hope this helps!"#, "unexpected text after tool call 1: `Hope this helps!`"),
            (Llama3, "[]", "tool call 1 is an empty list"),
            (Mistral, r#"[TOOL_CALLS][{"name": "f", "arguments": {"location": Paris}}]"#, "tool call 1 is not valid JSON: expected value"),
            (Mistral, r#"[TOOL_CALLS]get_weather[ARGS]{"location": "Paris",}"#, "the arguments of tool call 1 are not valid JSON"),
            (Mistral, r#"[TOOL_CALLS][{"name": "now"}, {"arguments": {}}]"#, "tool call 2 has no \"name\" string"),
            (Mistral, "[TOOL_CALLS][ARGS]{}", "tool call 1 has no valid tool name before [ARGS]"),
            (Mistral, "[TOOL_CALLS]get_weather{}", "tool call 1 has no [ARGS] after the tool name"),
            (Mistral, "Let me check.[TOOL_CALLS]</s>", "tool call 1 is empty"),
        ];
        for (format, text, expected) in cases {
            match parse_turn(format, text) {
                TurnCalls::Malformed(message) => {
                    assert!(message.starts_with(expected), "{message}")
                }
                other => panic!("{format:?}: {text}: expected a malformed call, got {other:?}"),
            }
        }
    }

    #[test]
    fn formats_from_templates_and_names() {
        let templates = [
            r#"and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "#,
            r#"{{- "Environment: ipython\n" }}{{- "<|python_tag|>" + tool_call.name + ".call(" }}"#,
            r#"{%- elif message.role == "tool" or message.role == "ipython" %}"#,
            r#"{%- elif message.tool_calls is defined %}{{- "[TOOL_CALLS] [" }}"#,
            r#"{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"#,
        ];
        let detected = templates.map(CallFormat::from_template);
        let expected = [
            Some(Hermes),
            Some(Llama3),
            Some(Llama3),
            Some(Mistral),
            None,
        ];
        assert_eq!(detected, expected);
        let names = ["qwen", "hermes", "llama3", "mistral"].map(CallFormat::parse);
        assert_eq!(names, [Ok(Hermes), Ok(Hermes), Ok(Llama3), Ok(Mistral)]);
        let error = CallFormat::parse("chatml").unwrap_err();
        assert!(
            error.starts_with("unknown tool call format `chatml`"),
            "{error}"
        );
        assert_eq!(Hermes.stop_string(), Some("</tool_call>"));
        assert_eq!((Llama3.stop_string(), Mistral.stop_string()), (None, None));
        let alias: CallFormat = serde_json::from_value(json!("qwen")).unwrap();
        assert_eq!(alias, Hermes);
        assert_eq!(serde_json::to_value(Llama3).unwrap(), json!("llama3"));
    }

    fn check(name: &str, arguments: Value) -> Result<(), CallError> {
        let tools = [
            json!({"type": "function", "function": {"name": "get_weather",
                "description": "Get the weather.", "parameters": {"type": "object", "properties": {
                    "location": {"type": "string", "description": "The city"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer"}, "threshold": {"type": "number"},
                    "note": {"type": ["string", "null"]},
                    "hours": {"type": "array", "items": {"type": "integer"}},
                    "tz": {"type": "string", "nullable": true}},
                "required": ["location"]}}}),
            json!({"type": "function", "function": {"name": "echo", "parameters": {
                "type": "object", "properties": {"text": {"type": "string"}},
                "additionalProperties": true}}}),
        ];
        check_call(&call(name, arguments), &tools)
    }

    #[test]
    fn check_call_accepts_valid_calls() {
        let full = json!({"location": "Paris", "unit": "celsius", "days": 3.0, "threshold": 2,
                          "note": null, "hours": [6, 12], "tz": null});
        assert_eq!(check("get_weather", full), Ok(()));
        let note = json!({"location": "Paris", "note": "hi"});
        assert_eq!(check("get_weather", note), Ok(()));
        assert_eq!(check("echo", json!({"text": "hi", "extra": 1})), Ok(()));
    }

    #[test]
    fn check_call_rejects_bad_calls() {
        let error = check("get_wether", json!({})).unwrap_err();
        assert_eq!(error.kind, "unknown_tool");
        let expected = "unknown tool `get_wether`; the available tools are: get_weather, echo";
        assert_eq!(error.message, expected);
        let error = check_call(&call("f", json!({})), &[]).unwrap_err();
        assert_eq!(error.message, "unknown tool `f`: no tools are available");
        let missing = check("get_weather", json!({"unit": "celsius"})).unwrap_err();
        let expected = "tool `get_weather`: missing required argument `location`";
        assert_eq!(
            (missing.kind, missing.message.as_str()),
            ("arguments", expected)
        );
        let cases = [
            (
                json!({"city": "Paris"}),
                "unexpected argument `city`; the accepted arguments are: ",
            ),
            (
                json!({"days": "3"}),
                "argument `days` must be of type integer, got a string \"3\"",
            ),
            (
                json!({"days": 2.5}),
                "argument `days` must be of type integer, got a number 2.5",
            ),
            (
                json!({"days": null}),
                "argument `days` must be of type integer, got null",
            ),
            (
                json!({"unit": "kelvin"}),
                "argument `unit` must be one of \"celsius\", \"fahrenheit\", got \"kelvin\"",
            ),
            (
                json!({"note": 5}),
                "argument `note` must be of type string or null, got an integer 5",
            ),
            (
                json!({"hours": [6, "noon"]}),
                "argument `hours[1]` must be of type integer, got a string",
            ),
        ];
        for (mut arguments, expected) in cases {
            arguments["location"] = json!("Paris");
            let error = check("get_weather", arguments).unwrap_err();
            let expected = format!("tool `get_weather`: {expected}");
            assert_eq!(error.kind, "arguments");
            assert!(error.message.starts_with(&expected), "{}", error.message);
        }
    }
}
