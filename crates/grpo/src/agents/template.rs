//! Tool turns as the model's chat template writes them.
//!
//! An episode's tokens are never re-rendered: the model's own tokens stay as it sampled them, and
//! what follows a turn is the difference the chat template makes when the conversation grows by
//! the turn's tool messages. That difference is found once, by rendering short conversations
//! with marker texts (`[user]`, `[user, assistant]`, `[user, assistant, tool x n]`) and taking
//! what each adds to the one before: what closes an assistant turn (ChatML: `<|im_end|>\n`),
//! and the text from there to the next assistant header with a marker where each tool result
//! goes. A template that renders no tool messages, or ignores `tools`, is refused before
//! training.
//!
//! An environment program's observations continue an episode as user messages: the text from a
//! closed assistant turn to the next assistant header around one user message is found the same
//! way (`[user, assistant]` against `[user, assistant, user]`).

use std::collections::HashMap;
use std::sync::Mutex;

use grpo_models::tokenizer::{ChatMessage, Tokenizer};

use crate::{Error, Result};

const USER: &str = "GRPOUSERMARK";
const CONTENT: &str = "GRPOCONTENTMARK";
const OBSERVATION: &str = "GRPOOBSERVATIONMARK";

fn result_mark(i: usize) -> String {
    format!("GRPORESULTMARK{i}END")
}

/// The text around an episode's tool turns, from the chat template.
#[derive(Debug)]
pub struct ToolTurns {
    tok: Tokenizer,
    /// What closes an assistant turn after its content.
    close: String,
    /// By the number of tool messages: the text after a closed assistant turn to the next
    /// assistant header, split at the tool results (n + 1 pieces).
    blocks: Mutex<HashMap<usize, Vec<String>>>,
    /// The text after a closed assistant turn to the next assistant header, split at a user
    /// message's content (2 pieces; rendered once).
    user: Mutex<Option<[String; 2]>>,
    /// Where the template came from, for errors.
    what: String,
}

impl ToolTurns {
    /// Checks that `tok`'s chat template (its `tools` variable already set) renders the tools
    /// (their names appear in a rendered prompt) and tool messages; `what` names the model and
    /// the key to change in errors.
    pub fn new(tok: &Tokenizer, tool_names: &[String], what: &str) -> Result<ToolTurns> {
        let refuse = |why: String| {
            Error::config(
                "tools",
                format!(
                    "{what}: {why}; set chat_template to a template file that renders `tools` \
                     and tool messages (examples/templates/chatml_tools.jinja is one for \
                     ChatML models such as SmolLM2)"
                ),
            )
        };
        if !tok.has_chat_template() {
            return Err(refuse("the model has no chat template".into()));
        }
        let render = |msgs: &[ChatMessage], gen: bool| {
            tok.apply_chat_template(msgs, gen)
                .map_err(|e| refuse(format!("its chat template fails: {e}")))
        };
        let user = [ChatMessage::user(USER)];
        let prompt = render(&user, true)?;
        if let Some(missing) = tool_names.iter().find(|n| !prompt.contains(n.as_str())) {
            return Err(refuse(format!(
                "its chat template ignores `tools` (tool `{missing}` is not in a rendered prompt)"
            )));
        }
        let turns = Self::with_close(tok, &prompt, what).map_err(refuse)?;
        turns.block(1).map_err(|e| refuse(e.to_string()))?;
        Ok(turns)
    }

    /// For an environment program's episodes: checks that `tok`'s chat template renders an
    /// assistant turn and a user message after it (the observation); `what` names the model in
    /// errors, which name `chat_template`.
    pub fn for_environment(tok: &Tokenizer, what: &str) -> Result<ToolTurns> {
        let refuse = |why: String| {
            Error::config(
                "chat_template",
                format!(
                    "{what}: {why}; an environment's observations are user messages: set \
                     chat_template to a template file that renders user and assistant turns"
                ),
            )
        };
        if !tok.has_chat_template() {
            return Err(refuse("the model has no chat template".into()));
        }
        let prompt = tok
            .apply_chat_template(&[ChatMessage::user(USER)], true)
            .map_err(|e| refuse(format!("its chat template fails: {e}")))?;
        let turns = Self::with_close(tok, &prompt, what).map_err(refuse)?;
        turns.user_block().map_err(|e| refuse(e.to_string()))?;
        Ok(turns)
    }

    /// Learns what closes an assistant turn, from the rendered `prompt` (`[user]` with the
    /// generation prompt) and the same conversation with an assistant turn.
    fn with_close(tok: &Tokenizer, prompt: &str, what: &str) -> std::result::Result<Self, String> {
        let msgs = [ChatMessage::user(USER), ChatMessage::assistant(CONTENT)];
        let with_turn = tok
            .apply_chat_template(&msgs, false)
            .map_err(|e| format!("its chat template fails: {e}"))?;
        let close = match with_turn.strip_prefix(prompt) {
            Some(rest) => rest.strip_prefix(CONTENT).map(str::to_owned),
            None => None,
        }
        .ok_or_else(|| {
            "its chat template does not render an assistant turn as its generation prompt \
             followed by the content"
                .to_string()
        })?;
        Ok(ToolTurns {
            tok: tok.clone(),
            close,
            blocks: Mutex::new(HashMap::new()),
            user: Mutex::new(None),
            what: what.to_string(),
        })
    }

    /// The pieces around one user message after a closed assistant turn (rendered once).
    fn user_block(&self) -> Result<[String; 2]> {
        let mut user = self.user.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(b) = user.as_ref() {
            return Ok(b.clone());
        }
        let mut msgs = vec![ChatMessage::user(USER), ChatMessage::assistant(CONTENT)];
        let closed = self.tok.apply_chat_template(&msgs, false)?;
        msgs.push(ChatMessage::user(OBSERVATION));
        let full = self.tok.apply_chat_template(&msgs, true)?;
        let pieces = full
            .strip_prefix(&closed)
            .and_then(|rest| rest.split_once(OBSERVATION))
            .map(|(before, after)| [before.to_string(), after.to_string()])
            .ok_or_else(|| {
                Error::config(
                    "chat_template",
                    format!(
                        "{}: its chat template does not render a user message after an \
                         assistant turn",
                        self.what
                    ),
                )
            })?;
        *user = Some(pieces.clone());
        Ok(pieces)
    }

    /// The text that follows a model turn with an environment's `observation`: what closes the
    /// turn (less the end-of-turn token the model sampled, `sampled_close`), the observation as
    /// a user message, and the next assistant header.
    pub fn observation(&self, sampled_close: &str, observation: &str) -> Result<String> {
        let [before, after] = self.user_block()?;
        let close = self
            .close
            .strip_prefix(sampled_close)
            .unwrap_or(&self.close);
        Ok(format!("{close}{before}{observation}{after}"))
    }

    /// The observation's continuation, as tokens.
    pub fn observation_ids(&self, sampled_close: &str, observation: &str) -> Result<Vec<u32>> {
        self.tok
            .encode(&self.observation(sampled_close, observation)?, false)
    }

    /// The pieces around `n` tool results (rendered once per `n`).
    fn block(&self, n: usize) -> Result<Vec<String>> {
        let mut blocks = self.blocks.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(b) = blocks.get(&n) {
            return Ok(b.clone());
        }
        let mut msgs = vec![ChatMessage::user(USER), ChatMessage::assistant(CONTENT)];
        let closed = self.tok.apply_chat_template(&msgs, false)?;
        msgs.extend((0..n).map(|i| ChatMessage::new("tool", result_mark(i))));
        let full = self.tok.apply_chat_template(&msgs, true)?;
        let bad = || {
            Error::config(
                "tools",
                format!(
                    "{}: its chat template does not render {n} tool message(s) after an \
                     assistant turn",
                    self.what
                ),
            )
        };
        let mut rest = full.strip_prefix(&closed).ok_or_else(bad)?;
        let mut pieces = Vec::with_capacity(n + 1);
        for i in 0..n {
            let mark = result_mark(i);
            let at = rest.find(&mark).ok_or_else(bad)?;
            pieces.push(rest[..at].to_string());
            rest = &rest[at + mark.len()..];
        }
        pieces.push(rest.to_string());
        blocks.insert(n, pieces.clone());
        Ok(pieces)
    }

    /// The text that follows a model turn with the tool results `results` (in call order): what
    /// closes the turn (less the end-of-turn token the model sampled, `sampled_close`), the tool
    /// messages, and the next assistant header.
    pub fn continuation(&self, sampled_close: &str, results: &[String]) -> Result<String> {
        let pieces = self.block(results.len().max(1))?;
        let close = self
            .close
            .strip_prefix(sampled_close)
            .unwrap_or(&self.close);
        let mut text = close.to_string();
        for (i, piece) in pieces.iter().enumerate() {
            text.push_str(piece);
            if let Some(r) = results.get(i) {
                text.push_str(r);
            }
        }
        Ok(text)
    }

    /// The continuation's tokens.
    pub fn continuation_ids(&self, sampled_close: &str, results: &[String]) -> Result<Vec<u32>> {
        self.tok
            .encode(&self.continuation(sampled_close, results)?, false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn result_marks_are_distinct_and_not_prefixes() {
        let (a, b) = (result_mark(1), result_mark(10));
        assert!(!b.starts_with(&a) && !a.starts_with(&b));
    }
}
