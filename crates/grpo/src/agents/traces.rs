//! The warm-up's tool-use traces from a file (`sft_warmup_file`): conversations in TRL's SFT
//! dataset forms, one JSON object per line, either
//!
//! ```json
//! {"messages": [{"role": "user", "content": "What is 12 * 34?"},
//!               {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
//!                 "function": {"name": "calculator", "arguments": {"expression": "12 * 34"}}}]},
//!               {"role": "tool", "name": "calculator", "content": "408"},
//!               {"role": "assistant", "content": "408"}]}
//! ```
//!
//! (the prompt is every message before the first assistant one) or `{"prompt": [...],
//! "completion": [...]}`. The prompt is rendered as training prompts are (with the tools); each
//! assistant turn is written as the model writes it (its text, then its calls in the `hermes`
//! format), each run of tool messages is inserted as the chat template renders tool turns
//! ([`super::template::ToolTurns`]), and the last assistant turn ends with the end-of-turn token.
//! Only assistant tokens are learned.

use std::path::Path;

use serde_json::Value;

use super::calls::CallFormat;
use super::{Agent, Trace};
use crate::data::{Example, Prompt};
use crate::{Error, Result};
use grpo_models::tokenizer::ChatMessage;

/// The key errors name.
const KEY: &str = "sft_warmup_file";

/// One conversation of the file: the prompt and what follows it.
#[derive(Debug, Clone, PartialEq)]
pub struct Conversation {
    pub prompt: Vec<ChatMessage>,
    /// Assistant and tool messages, in TRL's form (assistant `tool_calls`, tool `content`).
    pub completion: Vec<Value>,
}

/// The conversations of a JSONL file; errors name the file and line.
pub fn read_conversations(path: &Path) -> Result<Vec<Conversation>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::config(KEY, format!("cannot read {}: {e}", path.display())))?;
    let mut out = vec![];
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = |m: String| Error::config(KEY, format!("{}:{}: {m}", path.display(), i + 1));
        let v: Value = serde_json::from_str(line).map_err(|e| at(format!("not JSON: {e}")))?;
        out.push(conversation(&v).map_err(at)?);
    }
    if out.is_empty() {
        return Err(Error::config(
            KEY,
            format!("{}: no conversations", path.display()),
        ));
    }
    Ok(out)
}

/// One line: `{"messages"}` split before the first assistant message, or `{"prompt",
/// "completion"}`; the completion checked (assistant turns, tool results after calls, an
/// answer without calls last).
fn conversation(v: &Value) -> std::result::Result<Conversation, String> {
    let list = |k: &str| v.get(k).and_then(Value::as_array).cloned();
    let (prompt, completion) = match (list("messages"), list("prompt"), list("completion")) {
        (Some(all), None, None) => {
            let first = all
                .iter()
                .position(|m| m["role"] == "assistant")
                .ok_or("`messages` has no assistant message to learn")?;
            (all[..first].to_vec(), all[first..].to_vec())
        }
        (None, Some(p), Some(c)) => (p, c),
        _ => {
            return Err(
                "expected {\"messages\": [...]} or {\"prompt\": [...], \"completion\": \
                        [...]} (conversational, as TRL's SFT datasets)"
                    .into(),
            )
        }
    };
    let prompt = prompt
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let role = m["role"].as_str();
            let content = m["content"].as_str();
            match (role, content) {
                (Some(r), Some(c)) => Ok(ChatMessage::new(r, c)),
                _ => Err(format!(
                    "prompt message {i} needs string `role` and `content`"
                )),
            }
        })
        .collect::<std::result::Result<Vec<_>, String>>()?;
    if prompt.is_empty() {
        return Err("the prompt is empty".into());
    }
    check_completion(&completion)?;
    Ok(Conversation { prompt, completion })
}

fn check_completion(c: &[Value]) -> std::result::Result<(), String> {
    let calls = |m: &Value| m["tool_calls"].as_array().map_or(0, Vec::len);
    let mut expect_tools = false;
    for (i, m) in c.iter().enumerate() {
        match m["role"].as_str() {
            Some("assistant") => {
                if expect_tools {
                    return Err(format!("message {i}: an assistant turn follows tool calls that have no tool result"));
                }
                if !m["content"].is_string() && !m["content"].is_null() {
                    return Err(format!("message {i}: `content` must be a string"));
                }
                expect_tools = calls(m) > 0;
            }
            Some("tool") if m["content"].is_string() => expect_tools = false,
            Some("tool") => {
                return Err(format!(
                    "message {i}: a tool message needs string `content`"
                ))
            }
            other => {
                return Err(format!(
                    "message {i}: role {other:?} after the prompt; expected assistant or tool"
                ))
            }
        }
    }
    match c.last() {
        Some(m) if m["role"] == "assistant" && calls(m) == 0 => Ok(()),
        _ => Err("the conversation must end with an assistant answer without tool calls".into()),
    }
}

impl Agent {
    /// The warm-up's traces from conversations (see the module's doc); `eos` closes the last
    /// turn. Needs the `hermes` call format (how the calls are written).
    pub fn conversation_traces(
        &self,
        conversations: &[Conversation],
        eos: u32,
    ) -> Result<Vec<Trace>> {
        if self.format() != Some(CallFormat::Hermes) {
            return Err(Error::config(
                KEY,
                "the traces' tool calls are written in the hermes format; this run's \
                 tool_call_format is another (or its environment is a program)",
            ));
        }
        conversations.iter().map(|c| self.trace(c, eos)).collect()
    }

    fn trace(&self, c: &Conversation, eos: u32) -> Result<Trace> {
        let ex = Example {
            prompt: Prompt::Messages(c.prompt.clone()),
            answer: None,
            metadata: Default::default(),
            origin: KEY.into(),
            tokens: None,
        };
        let prompt_ids = crate::data::prompt_ids(
            &self.tok,
            &ex,
            self.system_prompt.as_deref(),
            self.max_prompt_length,
        )?;
        let (mut ids, mut sampled) = (vec![], vec![]);
        let mut push = |part: Vec<u32>, learned: bool| {
            sampled.extend(std::iter::repeat_n(learned, part.len()));
            ids.extend(part);
        };
        let mut i = 0;
        while i < c.completion.len() {
            let m = &c.completion[i];
            let last = i + 1 == c.completion.len();
            let mut turn = self.tok.encode(&assistant_text(m), false)?;
            if last {
                turn.push(eos);
            }
            push(turn, true);
            // The tool results that answer this turn's calls, inserted as the template does.
            let results: Vec<String> = c.completion[i + 1..]
                .iter()
                .take_while(|m| m["role"] == "tool")
                .map(|m| m["content"].as_str().unwrap_or_default().to_string())
                .collect();
            i += 1 + results.len();
            if !last {
                push(self.turns.continuation_ids("", &results)?, false);
            }
        }
        Ok(Trace {
            prompt_ids,
            completion_ids: ids,
            sampled,
        })
    }
}

/// An assistant message as the model writes it in the `hermes` format: its text, then each call
/// as `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`.
fn assistant_text(m: &Value) -> String {
    let mut text = m["content"].as_str().unwrap_or_default().to_string();
    for call in m["tool_calls"].as_array().into_iter().flatten() {
        let f = call.get("function").unwrap_or(call);
        // Arguments as a JSON string (OpenAI's form) or an object (TRL's).
        let arguments = match &f["arguments"] {
            Value::String(s) => serde_json::from_str(s).unwrap_or(Value::String(s.clone())),
            other => other.clone(),
        };
        let body = serde_json::json!({"name": f["name"], "arguments": arguments});
        if !text.is_empty() {
            text.push('\n');
        }
        text.push_str(&format!("<tool_call>\n{body}\n</tool_call>"));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conv(line: &str) -> std::result::Result<Conversation, String> {
        conversation(&serde_json::from_str(line).unwrap())
    }

    #[test]
    fn both_trl_forms_read_and_split_at_the_first_assistant_message() {
        let a = conv(
            r#"{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
             "function": {"name": "calc", "arguments": {"e": "1+1"}}}]},
            {"role": "tool", "name": "calc", "content": "2"}, {"role": "assistant", "content": "2"}]}"#,
        )
        .unwrap();
        assert_eq!(a.prompt.len(), 2);
        assert_eq!(a.completion.len(), 3);
        let b = conv(
            r#"{"prompt": [{"role": "user", "content": "q"}],
                "completion": [{"role": "assistant", "content": "2"}]}"#,
        )
        .unwrap();
        assert_eq!(b.completion.len(), 1);
    }

    #[test]
    fn malformed_conversations_say_what_is_wrong() {
        for (line, says) in [
            (r#"{"text": "hi"}"#, "expected"),
            (
                r#"{"messages": [{"role": "user", "content": "q"}]}"#,
                "no assistant",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "",
                "tool_calls": [{"function": {"name": "c", "arguments": {}}}]}]}"#,
                "must end with an assistant answer",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "",
                "tool_calls": [{"function": {"name": "c", "arguments": {}}}]},
                {"role": "assistant", "content": "x"}]}"#,
                "no tool result",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                {"role": "user", "content": "more"}, {"role": "assistant", "content": "b"}]}"#,
                "expected assistant or tool",
            ),
            (
                r#"{"messages": [{"role": "user"}, {"role": "assistant", "content": "a"}]}"#,
                "prompt message 0",
            ),
        ] {
            let e = conv(line).unwrap_err();
            assert!(e.contains(says), "{line}: {e}");
        }
    }

    #[test]
    fn calls_are_written_as_hermes_writes_them() {
        let m: Value = serde_json::from_str(
            r#"{"role": "assistant", "content": "Let me check.", "tool_calls": [{"type": "function",
                "function": {"name": "calc", "arguments": "{\"e\": \"1+1\"}"}}]}"#,
        )
        .unwrap();
        assert_eq!(
            assistant_text(&m),
            "Let me check.\n<tool_call>\n{\"name\":\"calc\",\"arguments\":{\"e\":\"1+1\"}}\n</tool_call>"
        );
    }
}
