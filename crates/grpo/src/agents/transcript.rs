//! An agent episode as text: its logged messages turn by turn (trackers' tables, the report).

use serde_json::Value;

/// A tool call of a logged message as `name(key=value, ...)`, the values as JSON. Takes OpenAI's
/// `{"function": {"name", "arguments"}}` (what `completions.jsonl` holds) or a flat `{"name",
/// "arguments"}`, the arguments an object or a JSON string; other arguments are written as given.
pub fn tool_call_text(call: &Value) -> String {
    let f = call.get("function").unwrap_or(call);
    let name = f.get("name").and_then(Value::as_str).unwrap_or("?");
    let parsed = match f.get("arguments") {
        Some(Value::String(s)) => {
            serde_json::from_str::<Value>(s).unwrap_or(Value::String(s.clone()))
        }
        Some(a) => a.clone(),
        None => Value::Null,
    };
    let args = match parsed {
        Value::Object(m) => m
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(", "),
        Value::Null => String::new(),
        Value::String(s) => s,
        other => other.to_string(),
    };
    format!("{name}({args})")
}

/// An agent episode's messages (the `messages` of a `completions.jsonl` row) as text, turn by
/// turn, for trackers' tables, whose cells are text: each message under a `[role]` line
/// (`[tool calculator]` for a tool's result), an assistant's tool calls as `-> name(arguments)`.
pub fn episode_text(messages: &[Value]) -> String {
    let mut out = String::new();
    for m in messages {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("?");
        match m.get("name").and_then(Value::as_str) {
            Some(n) if role == "tool" && !n.is_empty() => out.push_str(&format!("[tool {n}]\n")),
            _ => out.push_str(&format!("[{role}]\n")),
        }
        let content = match m.get("content") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join("\n"),
            Some(Value::Null) | None => String::new(),
            Some(v) => v.to_string(),
        };
        if !content.is_empty() {
            out.push_str(&content);
            out.push('\n');
        }
        for c in m
            .get("tool_calls")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            out.push_str(&format!("-> {}\n", tool_call_text(c)));
        }
    }
    out.truncate(out.trim_end().len());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_calls_and_episodes_as_text() {
        let call = serde_json::json!({"type": "function",
            "function": {"name": "calculator", "arguments": {"expression": "12 * 3", "digits": 2}}});
        assert_eq!(
            tool_call_text(&call),
            "calculator(expression=\"12 * 3\", digits=2)"
        );
        let string_args = serde_json::json!({"name": "search", "arguments": "{\"q\": \"a<b\"}"});
        assert_eq!(tool_call_text(&string_args), "search(q=\"a<b\")");
        let raw = serde_json::json!({"name": "f", "arguments": "not json"});
        assert_eq!(tool_call_text(&raw), "f(not json)");
        assert_eq!(tool_call_text(&serde_json::json!({"name": "now"})), "now()");

        let messages = serde_json::json!([
            {"role": "assistant", "content": "<tool_call>...</tool_call>", "tool_calls": [call]},
            {"role": "tool", "name": "calculator", "content": "Error: boom"},
            {"role": "assistant", "content": [{"type": "text", "text": "36"}]},
        ]);
        assert_eq!(
            episode_text(messages.as_array().unwrap()),
            "[assistant]\n<tool_call>...</tool_call>\n-> calculator(expression=\"12 * 3\", digits=2)\n\
             [tool calculator]\nError: boom\n[assistant]\n36"
        );
    }
}
