//! An environment program's episodes ([`AgentWorld::Program`]): every model turn is an action.
//!
//! When a row's turn ends, its step starts on a thread of its own (the whole turn's text is the
//! action) while the other rows decode. When every row's turn has ended, each step's
//! observation continues its episode as a user message rendered by the chat template
//! ([`crate::agents::template::ToolTurns::observation`]), unless the environment said `done`,
//! the step failed, or `max_tool_calling_iterations` observations were already inserted (the
//! last turn is still stepped, for its reward). The steps' rewards sum to the episode's
//! environment reward, which is missing when no step gave one or a request of the episode
//! failed. Steps count as tool calls named `step` in the agent metrics.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use serde_json::{json, Value};

use super::{Host, RowState};
use crate::agents::calls::CallError;
use crate::agents::program_env::{ProgramEnv, Step};
use crate::agents::AgentWorld;
use grpo_models::sampler::Completion;

/// The name steps are counted under (`agent/tool_calls/step`).
const STEP: &str = "step";

/// One step's outcome, from its thread.
struct Stepped {
    outcome: Result<Step, CallError>,
    secs: f64,
}

/// An episode's side in the environment program.
#[derive(Default)]
pub(super) struct ProgramRow {
    /// Its reset succeeded (so it is closed at the end).
    reset: bool,
    /// A request of the episode failed: it has no environment any more, and no reward.
    failed: bool,
    /// The step of its last turn, while it runs.
    pending: Option<JoinHandle<Stepped>>,
    /// The steps' rewards so far (None: none given yet).
    reward: Option<f64>,
}

fn internal() -> CallError {
    CallError {
        kind: "internal",
        message: "the environment's thread panicked".into(),
    }
}

impl Host<'_> {
    /// Resets every episode's environment with its dataset row, all at once (the programs'
    /// processes or the service's permits bound how many run together): each episode's first
    /// observation (None: none, or the reset failed, recorded as a tool error).
    pub(super) fn reset_programs(
        &mut self,
        env: &Arc<ProgramEnv>,
        rows: &[Value],
    ) -> Vec<Option<String>> {
        let env: &ProgramEnv = env;
        let outcomes: Vec<Result<Option<String>, CallError>> = std::thread::scope(|s| {
            let handles: Vec<_> = (self.rows.iter().zip(rows))
                .map(|(st, row)| {
                    let id = st.id;
                    s.spawn(move || env.reset(id, row))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err(internal())))
                .collect()
        });
        (self.rows.iter_mut().zip(outcomes))
            .map(|(st, outcome)| match outcome {
                Ok(obs) => {
                    st.program.reset = true;
                    obs
                }
                Err(e) => {
                    st.tool_errors.push(e.kind.to_string());
                    st.program.failed = true;
                    None
                }
            })
            .collect()
    }

    /// Row `row`'s turn ended: records it and starts its step. Whether the episode goes on.
    pub(super) fn program_turn(
        &mut self,
        env: &Arc<ProgramEnv>,
        row: usize,
        turn: &Completion,
    ) -> bool {
        let max = self.agent.max_iterations;
        let st = &mut self.rows[row];
        st.messages
            .push(json!({"role": "assistant", "content": turn.text}));
        // Without an environment (its reset or a step failed) there is nothing to act in.
        if st.program.failed || !st.program.reset {
            return false;
        }
        let (env, id, action) = (Arc::clone(env), st.id, turn.text.clone());
        st.program.pending = Some(std::thread::spawn(move || {
            let t0 = Instant::now();
            let outcome = env.step(id, &action);
            Stepped {
                outcome,
                secs: t0.elapsed().as_secs_f64(),
            }
        }));
        if st.iterations >= max {
            st.cut = Some("max_tool_calling_iterations".into());
            return false;
        }
        st.iterations += 1;
        true
    }

    /// Every row's turn has ended: each waiting row's observation as its next tokens, or None
    /// where its episode ends (done, or its step failed).
    pub(super) fn program_continuations(
        &mut self,
        rows: &[usize],
    ) -> grpo_models::Result<Vec<Option<Vec<u32>>>> {
        let mut out = Vec::with_capacity(rows.len());
        for &r in rows {
            let st = &mut self.rows[r];
            out.push(match finish_step(st) {
                Some(obs) => Some(self.agent.turns.observation_ids(&st.sampled_close, &obs)?),
                None => None,
            });
        }
        Ok(out)
    }

    /// After sampling: the last turns' steps are waited for, every episode whose reset
    /// succeeded is closed (all at once), and each gets its summed reward.
    pub(in crate::agents) fn close_program_episodes(&mut self) {
        let AgentWorld::Program(env) = &self.agent.world else {
            return;
        };
        for st in &mut self.rows {
            finish_step(st);
        }
        let env: &ProgramEnv = env;
        std::thread::scope(|s| {
            for st in self.rows.iter().filter(|st| st.program.reset) {
                let id = st.id;
                s.spawn(move || env.close(id));
            }
        });
        for st in &mut self.rows {
            let p = &st.program;
            let reward = match p.failed {
                true => None,
                false => p.reward.map(|r| r as f32),
            };
            st.env_rewards = vec![reward];
        }
    }
}

/// Waits for the row's step, when one runs, and records it: its reward, its observation as a
/// user message, its error. The observation when the episode goes on.
fn finish_step(st: &mut RowState) -> Option<String> {
    let handle = st.program.pending.take()?;
    let Stepped { outcome, secs } = handle.join().unwrap_or_else(|_| Stepped {
        outcome: Err(internal()),
        secs: 0.0,
    });
    st.tool_calls.push(STEP.into());
    st.tool_secs += secs;
    let step = match outcome {
        Ok(step) => step,
        Err(e) => {
            st.tool_errors.push(e.kind.to_string());
            st.program.failed = true;
            return None;
        }
    };
    if let Some(r) = step.reward {
        *st.program.reward.get_or_insert(0.0) += f64::from(r);
    }
    if step.done {
        if let Some(obs) = &step.observation {
            st.messages.push(json!({"role": "user", "content": obs}));
        }
        // Over on its own, even on the last turn the cap allowed.
        st.cut = None;
        return None;
    }
    // Going on: the user turn is inserted even when empty.
    let obs = step.observation.unwrap_or_default();
    st.messages.push(json!({"role": "user", "content": obs}));
    Some(obs)
}
