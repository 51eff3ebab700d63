//! One round of episodes: the [`TurnHost`] that reads each model turn's tool calls, runs them
//! on a thread of their own while the other rows decode, and gives the sampler the tool turn's
//! tokens; then each episode as the trainer's [`Episode`] with its [`AgentTrace`]. An
//! environment program's episodes ([`super::AgentWorld::Program`]) are hosted in [`program`].

mod program;

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use serde_json::{json, Value};

use super::calls::{check_call, parse_turn, CallError, TurnCalls};
use super::tools::ToolHost;
use super::{Agent, AgentWorld};
use crate::data::Example;
use crate::rollout::{AgentTrace, Episode};
use grpo_models::sampler::episodes::{EpisodeTokens, TurnHost};
use grpo_models::sampler::{Completion, StopReason};

/// One tool call's outcome as the conversation shows it.
struct Answered {
    name: String,
    content: String,
    /// The error's kind, when the call failed.
    error: Option<&'static str>,
    secs: f64,
}

/// A row's episode as the host follows it.
#[derive(Default)]
struct RowState {
    /// The episode's id for its tools and environment.
    id: u64,
    messages: Vec<Value>,
    tool_calls: Vec<String>,
    tool_errors: Vec<String>,
    tool_secs: f64,
    /// Turns that called tools.
    iterations: usize,
    cut: Option<String>,
    /// The end-of-turn token the model sampled, as text (a continuation leaves it out).
    sampled_close: String,
    pending: Option<JoinHandle<Vec<Answered>>>,
    /// The environment's rewards, once the episode is over ([`super::tools::ToolHost::env_rewards`]).
    env_rewards: Vec<Option<f32>>,
    /// An environment program's side of the episode.
    program: program::ProgramRow,
}

/// The host of one round's episodes (`rows` = prompts x G, prompt-major).
pub(super) struct Host<'a> {
    agent: &'a Agent,
    rows: Vec<RowState>,
}

impl<'a> Host<'a> {
    pub(super) fn new(agent: &'a Agent, rows: usize) -> Host<'a> {
        let rows = (0..rows)
            .map(|_| RowState {
                id: agent.new_episode_id(),
                ..Default::default()
            })
            .collect();
        Host { agent, rows }
    }

    /// Runs `calls` of row `row` on a thread of their own (in order), and keeps its handle.
    fn start_calls(
        &mut self,
        tools: &Arc<ToolHost>,
        row: usize,
        calls: Vec<super::calls::ToolCall>,
    ) {
        let tools = Arc::clone(tools);
        let id = self.rows[row].id;
        let schemas = self.agent.schemas.clone();
        let handle = std::thread::spawn(move || {
            calls
                .into_iter()
                .map(|call| {
                    let t0 = Instant::now();
                    let outcome = check_call(&call, &schemas).and_then(|_| tools.call(id, &call));
                    let secs = t0.elapsed().as_secs_f64();
                    match outcome {
                        Ok(content) => Answered {
                            name: call.name,
                            content,
                            error: None,
                            secs,
                        },
                        Err(CallError { kind, message }) => Answered {
                            name: call.name,
                            content: format!("Error: {message}"),
                            error: Some(kind),
                            secs,
                        },
                    }
                })
                .collect()
        });
        self.rows[row].pending = Some(handle);
    }

    /// Each episode as the trainer's [`Episode`], the host's record of it attached: `flat` in
    /// row order (`g` per group), each with its prompt.
    pub(super) fn episodes(
        mut self,
        flat: Vec<EpisodeTokens>,
        g: usize,
        examples: &[usize],
        prompts: Vec<Vec<u32>>,
    ) -> Vec<Episode> {
        flat.into_iter()
            .zip(prompts)
            .enumerate()
            .map(|(row, (e, prompt_ids))| {
                let st = std::mem::take(&mut self.rows[row]);
                let cut = match e.out_of_tokens {
                    true => Some("max_episode_tokens".into()),
                    false => st.cut,
                };
                // The answer: the last assistant message.
                let text = st
                    .messages
                    .iter()
                    .rev()
                    .find(|m| m["role"] == "assistant")
                    .and_then(|m| m["content"].as_str())
                    .unwrap_or("")
                    .to_string();
                Episode {
                    example: examples[row / g],
                    group: row / g,
                    prompt_ids,
                    completion_ids: e.ids,
                    text,
                    stop_reason: e.stop_reason,
                    rewards: vec![],
                    agent: Some(AgentTrace {
                        sampled: e.sampled,
                        messages: st.messages,
                        turns: e.turns,
                        tool_calls: st.tool_calls,
                        tool_errors: st.tool_errors,
                        tool_secs: st.tool_secs,
                        env_rewards: st.env_rewards,
                        cut,
                    }),
                }
            })
            .collect()
    }

    /// Ends every episode's environment, its rewards first (`rows`: each episode's dataset
    /// row, as [`row_json`] writes it).
    pub(super) fn close_environments(&mut self, rows: &[Value]) {
        let Some(tools) = self.agent.tool_host().filter(|t| t.has_environment()) else {
            return;
        };
        for (st, row) in self.rows.iter_mut().zip(rows) {
            st.env_rewards = tools.env_rewards(st.id, row, &st.messages);
            tools.close(st.id);
        }
    }

    /// Starts each episode's environment with its dataset row; the observation, when there is
    /// one, is what the episode starts from (`None`: the environment failed to start, recorded
    /// as a tool error).
    pub(super) fn reset_environments(&mut self, rows: &[Value]) -> Vec<Option<String>> {
        let agent = self.agent;
        let tools = match &agent.world {
            AgentWorld::Tools { host, .. } => host,
            AgentWorld::Program(env) => return self.reset_programs(env, rows),
        };
        self.rows
            .iter_mut()
            .zip(rows)
            .map(|(st, row)| match tools.reset(st.id, row) {
                Ok(obs) => obs,
                Err(e) => {
                    st.tool_errors.push(e.kind.to_string());
                    None
                }
            })
            .collect()
    }
}

impl TurnHost for Host<'_> {
    fn turn_ended(
        &mut self,
        row: usize,
        _prompt: usize,
        _sample: usize,
        turn: &Completion,
    ) -> grpo_models::Result<bool> {
        let agent = self.agent;
        let with_special = agent.tok.decode(&turn.ids, false)?;
        let st = &mut self.rows[row];
        st.sampled_close = match (turn.stop_reason, turn.ids.last()) {
            (StopReason::Eos, Some(&eos)) => agent.tok.decode(&[eos], false)?,
            _ => String::new(),
        };
        let (tools, format) = match &agent.world {
            AgentWorld::Tools { host, format } => (host, *format),
            AgentWorld::Program(env) => return Ok(self.program_turn(env, row, turn)),
        };
        let calls = parse_turn(format, &with_special);
        let mut message = json!({"role": "assistant", "content": turn.text});
        if let TurnCalls::Calls(cs) = &calls {
            message["tool_calls"] = json!(cs
                .iter()
                .map(|c| json!({"type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
                .collect::<Vec<_>>());
        }
        st.messages.push(message);
        // An answer ends the episode; so does a call cut off by the turn's length.
        let cut_call =
            turn.stop_reason == StopReason::Length && matches!(calls, TurnCalls::Malformed(_));
        if calls == TurnCalls::None || cut_call {
            return Ok(false);
        }
        if st.iterations >= agent.max_iterations {
            st.cut = Some("max_tool_calling_iterations".into());
            return Ok(false);
        }
        st.iterations += 1;
        match calls {
            TurnCalls::None => Ok(false),
            TurnCalls::Malformed(why) => {
                let answered = vec![Answered {
                    name: String::new(),
                    content: format!("Error: {why}"),
                    error: Some("parse"),
                    secs: 0.0,
                }];
                self.rows[row].pending = Some(std::thread::spawn(move || answered));
                Ok(true)
            }
            TurnCalls::Calls(cs) => {
                self.start_calls(tools, row, cs);
                Ok(true)
            }
        }
    }

    fn continuations(&mut self, rows: &[usize]) -> grpo_models::Result<Vec<Option<Vec<u32>>>> {
        if let AgentWorld::Program(_) = &self.agent.world {
            return self.program_continuations(rows);
        }
        let mut out = Vec::with_capacity(rows.len());
        for &r in rows {
            let st = &mut self.rows[r];
            let answered = match st.pending.take().map(JoinHandle::join) {
                Some(Ok(a)) => a,
                // A tool thread cannot panic (every failure is an answer); end the episode
                // rather than guess.
                Some(Err(_)) | None => {
                    st.tool_errors.push("internal".into());
                    out.push(None);
                    continue;
                }
            };
            let mut results = Vec::with_capacity(answered.len());
            for a in answered {
                if !a.name.is_empty() {
                    st.tool_calls.push(a.name.clone());
                }
                if let Some(kind) = a.error {
                    st.tool_errors.push(kind.to_string());
                }
                st.tool_secs += a.secs;
                st.messages
                    .push(json!({"role": "tool", "name": a.name, "content": a.content}));
                results.push(a.content);
            }
            let ids = self
                .agent
                .turns
                .continuation_ids(&st.sampled_close, &results)?;
            out.push(Some(ids));
        }
        Ok(out)
    }
}

/// A dataset row as an environment's `reset(**row)` gets it: every column, the prompt and the
/// answer included.
pub(super) fn row_json(ex: &Example) -> Value {
    let mut m = ex.metadata.clone();
    let item = crate::rewards::ScoreItem::new(ex, "");
    m.insert("prompt".into(), item.prompt_json());
    if let Some(a) = &ex.answer {
        m.insert("answer".into(), Value::String(a.clone()));
    }
    Value::Object(m)
}
