//! Agents: multi-turn episodes in which the model calls tools or acts in an environment.
//!
//! An episode alternates model turns with tool turns until the model answers without a tool
//! call, the environment says it is done, or a cap is reached (`max_tool_calling_iterations`,
//! `max_episode_tokens`). The sampler ([`grpo_models::sampler::episodes`]) only sees prefills
//! and stops; this module is the edge: it parses the model's tool calls ([`calls`]), runs them
//! ([`tools`]: the user's Python functions and environment classes, in processes of their own),
//! and renders their results as the model's chat template writes tool messages ([`template`]).
//! An environment program or service ([`program_env`]) is the other [`AgentWorld`]: every model
//! turn is an action, and each observation continues the episode as a user message.
//! The trainer sees one token sequence per episode and a mask of the tokens the model sampled
//! ([`crate::rollout::AgentTrace`]).

pub mod calls;
mod episode;
pub mod program_env;
pub mod template;
pub mod tools;
pub mod traces;
pub mod transcript;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde_json::Value;

use crate::data::Example;
use crate::rollout::{Episode, GroupSampler};
use crate::Result;
use calls::CallFormat;
use grpo_models::sampler::{GenStats, PromptInput, SamplingParams};
use grpo_models::tokenizer::Tokenizer;
use program_env::ProgramEnv;
use template::ToolTurns;
use tools::ToolHost;

/// Where an agent's episodes act, resolved once at set-up.
#[derive(Debug)]
pub enum AgentWorld {
    /// Python tools and an environment class (`tools`, `environment_factory`): the model's
    /// tool calls, written in `format`, are parsed and run.
    Tools {
        host: Arc<ToolHost>,
        format: CallFormat,
    },
    /// An environment program or service (`environment_command`, `environment_url`): every
    /// model turn is an action.
    Program(Arc<ProgramEnv>),
}

/// The reward an environment program's steps sum to (`rewards/environment/mean`).
pub const PROGRAM_REWARD: &str = "environment";

/// What an agent run needs, resolved once at set-up.
#[derive(Debug)]
pub struct Agent {
    pub world: AgentWorld,
    /// Every tool's JSON schema (functions, then the environment's methods; none for a program).
    pub schemas: Vec<Value>,
    pub turns: ToolTurns,
    /// Turns that call tools (or observations that continue a program's episode), at most
    /// (TRL's `max_tool_calling_iterations`).
    pub max_iterations: usize,
    /// Tokens after the prompt, model and tool tokens together, at most.
    pub max_tokens: usize,
    /// The tokenizer, with the tools in its chat template's variables.
    pub tok: Tokenizer,
    system_prompt: Option<String>,
    max_prompt_length: Option<usize>,
    /// The environment class's target, when there is one.
    environment: Option<String>,
    next_id: AtomicU64,
}

/// How an agent run was configured (from the `[agent]` keys).
#[derive(Debug, Clone)]
pub struct AgentOptions {
    pub format: Option<CallFormat>,
    pub max_iterations: usize,
    pub max_tokens: usize,
    /// Names the model (and where its template came from) in errors.
    pub model: String,
    /// How prompts are rendered (`system_prompt`, `max_prompt_length`): an environment's
    /// observation re-renders its episode's prompt.
    pub system_prompt: Option<String>,
    pub max_prompt_length: Option<usize>,
    /// The environment class (`environment_factory`), for its reward's name.
    pub environment: Option<String>,
}

impl Agent {
    /// Starts the tools, puts their schemas into `tok`'s chat template (returned, for the
    /// prompts), and checks that the template renders them and their results.
    pub fn start(tools: ToolHost, tok: Tokenizer, o: &AgentOptions) -> Result<(Agent, Tokenizer)> {
        let schemas = tools.schemas();
        let names: Vec<String> = schemas.iter().filter_map(schema_name).collect();
        let tok = tok.with_template_var("tools", Value::Array(schemas.clone()));
        let what = format!("model {}", o.model);
        // A template without tools is the first thing to fix, so it is checked first.
        let turns = ToolTurns::new(&tok, &names, &what)?;
        let format = match o.format {
            Some(f) => f,
            None => tok
                .chat_template_source()
                .and_then(CallFormat::from_template)
                .ok_or_else(|| {
                    crate::Error::config(
                        "tool_call_format",
                        format!(
                            "{what}: its chat template does not say how it writes tool calls; \
                             set tool_call_format = \"hermes\", \"llama3\" or \"mistral\""
                        ),
                    )
                })?,
        };
        let agent = Agent {
            world: AgentWorld::Tools {
                host: Arc::new(tools),
                format,
            },
            schemas,
            turns,
            max_iterations: o.max_iterations,
            max_tokens: o.max_tokens,
            tok: tok.clone(),
            system_prompt: o.system_prompt.clone(),
            max_prompt_length: o.max_prompt_length,
            environment: o.environment.clone(),
            next_id: AtomicU64::new(0),
        };
        Ok((agent, tok))
    }

    /// An agent acting in an environment program or service: checks that `tok`'s chat template
    /// renders observations (user messages after an assistant turn). `o.format` is not used.
    pub fn start_environment(env: ProgramEnv, tok: Tokenizer, o: &AgentOptions) -> Result<Agent> {
        let turns = ToolTurns::for_environment(&tok, &format!("model {}", o.model))?;
        Ok(Agent {
            world: AgentWorld::Program(Arc::new(env)),
            schemas: vec![],
            turns,
            max_iterations: o.max_iterations,
            max_tokens: o.max_tokens,
            tok,
            system_prompt: o.system_prompt.clone(),
            max_prompt_length: o.max_prompt_length,
            environment: o.environment.clone(),
            next_id: AtomicU64::new(0),
        })
    }

    /// The Python tool host (None for an environment program).
    pub fn tool_host(&self) -> Option<&Arc<ToolHost>> {
        match &self.world {
            AgentWorld::Tools { host, .. } => Some(host),
            AgentWorld::Program(_) => None,
        }
    }

    /// How the model writes tool calls (None for an environment program: no calls).
    pub fn format(&self) -> Option<CallFormat> {
        match &self.world {
            AgentWorld::Tools { format, .. } => Some(*format),
            AgentWorld::Program(_) => None,
        }
    }

    /// Whether episodes are reset with their dataset row (an environment class or program).
    pub fn has_environment(&self) -> bool {
        match &self.world {
            AgentWorld::Tools { host, .. } => host.has_environment(),
            AgentWorld::Program(_) => true,
        }
    }

    /// The reward an environment with a `get_reward` method gives: named after its class; an
    /// environment program's is [`PROGRAM_REWARD`], the sum of its steps' rewards.
    pub fn environment_reward_name(&self) -> Option<String> {
        let host = match &self.world {
            AgentWorld::Tools { host, .. } => host,
            AgentWorld::Program(_) => return Some(PROGRAM_REWARD.into()),
        };
        let env = self.environment.as_deref()?;
        host.env_has_reward().then(|| {
            let class = env.rsplit([':', '.']).next().unwrap_or(env);
            class.to_string()
        })
    }

    /// The rewards the environment's side gives, in the order of
    /// [`crate::rollout::AgentTrace::env_rewards`] (the index of [`RewardFn::Environment`]).
    ///
    /// [`RewardFn::Environment`]: crate::rewards::RewardFn::Environment
    pub fn environment_rewards(&self) -> Vec<EnvironmentReward> {
        let get_reward = self
            .environment_reward_name()
            .map(EnvironmentReward::GetReward);
        let functions = self
            .tool_host()
            .map(|t| t.env_reward_functions().to_vec())
            .unwrap_or_default();
        get_reward
            .into_iter()
            .chain(functions.into_iter().map(EnvironmentReward::Function))
            .collect()
    }

    fn new_episode_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// The stop strings a turn needs on top of the run's (Hermes: `</tool_call>`, so that a
    /// call's turn ends where its tool runs).
    pub fn stop_strings(&self) -> Vec<String> {
        self.format()
            .and_then(CallFormat::stop_string)
            .map(|s| vec![s.to_string()])
            .unwrap_or_default()
    }

    /// Samples `g` episodes of each prompt (`seeds[i]` seeds prompt i's group, as
    /// [`crate::rollout::rollout`] does); every reward NaN (not scored yet). With an environment,
    /// each episode's instance is reset with its dataset row first, and an observation it
    /// returns is appended to the prompt's last user message (TRL's `environment_factory`); a
    /// group whose observations differ samples each episode from its own prompt.
    #[allow(clippy::too_many_arguments)]
    pub fn rollout(
        &self,
        model: &dyn GroupSampler,
        examples: &[usize],
        prompt_ids: Vec<Vec<u32>>,
        seeds: &[u64],
        g: usize,
        params: &SamplingParams,
        data: &[Example],
    ) -> Result<(Vec<Episode>, GenStats)> {
        let mut params = params.clone();
        for s in self.stop_strings() {
            if !params.stop_strings.contains(&s) {
                params.stop_strings.push(s);
            }
        }
        let mut host = episode::Host::new(self, examples.len() * g);
        // Each episode's prompt: its group's, or its own when its environment's observation
        // makes it one.
        let mut prompts: Vec<Vec<u32>> = prompt_ids
            .iter()
            .flat_map(|p| std::iter::repeat_n(p.clone(), g))
            .collect();
        let mut row_values: Vec<Value> = vec![];
        if self.has_environment() {
            let rows: Vec<&Example> = examples
                .iter()
                .flat_map(|&e| std::iter::repeat_n(&data[e], g))
                .collect();
            row_values = rows.iter().map(|ex| episode::row_json(ex)).collect();
            let observations = host.reset_environments(&row_values);
            for (i, obs) in observations.iter().enumerate() {
                if let Some(o) = obs {
                    prompts[i] = self.prompt_with(rows[i], o)?;
                }
            }
        }
        let shared = prompts
            .chunks(g)
            .all(|grp| grp.iter().all(|p| *p == grp[0]));
        let inputs: Vec<PromptInput> = match shared {
            true => prompts
                .chunks(g)
                .zip(seeds)
                .map(|(grp, &seed)| PromptInput {
                    ids: grp[0].clone(),
                    seed,
                })
                .collect(),
            // One prompt per episode, seeded by (group seed, sample index).
            false => prompts
                .iter()
                .enumerate()
                .map(|(i, p)| PromptInput {
                    ids: p.clone(),
                    seed: grpo_models::seeding::mix_seed(seeds[i / g], (i % g) as u64),
                })
                .collect(),
        };
        let n = if shared { g } else { 1 };
        let sampled =
            model.sample_episodes(&self.tok, &inputs, n, &params, self.max_tokens, &mut host);
        host.close_environments(&row_values);
        host.close_program_episodes();
        let (groups, stats) = sampled?;
        let flat: Vec<_> = groups.into_iter().flatten().collect();
        Ok((host.episodes(flat, g, examples, prompts), stats))
    }

    /// `ex`'s prompt ids with `observation` appended to its last user message (TRL appends it
    /// with no separator).
    fn prompt_with(&self, ex: &Example, observation: &str) -> Result<Vec<u32>> {
        let mut ex = ex.clone();
        match &mut ex.prompt {
            crate::data::Prompt::Text(t) => t.push_str(observation),
            crate::data::Prompt::Messages(ms) => {
                match ms.iter_mut().rev().find(|m| m.role == "user") {
                    Some(m) => m.content.push_str(observation),
                    None => ms.push(grpo_models::tokenizer::ChatMessage::user(observation)),
                }
            }
        }
        ex.tokens = None;
        crate::data::prompt_ids(
            &self.tok,
            &ex,
            self.system_prompt.as_deref(),
            self.max_prompt_length,
        )
    }
}

/// A reward scored where the environment instances live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EnvironmentReward {
    /// The environment's `get_reward()`: one more reward, named after the class (TRL).
    GetReward(String),
    /// A `kind = "python"` reward function (its target) that takes `environments`.
    Function(String),
}

/// A poisoned lock's data is still consistent here (every critical section writes whole values):
/// taken as it is.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A tool schema's function name.
pub(crate) fn schema_name(s: &Value) -> Option<String> {
    s.get("function")
        .unwrap_or(s)
        .get("name")
        .and_then(Value::as_str)
        .map(str::to_owned)
}

/// A round's agent metrics (`agent/*`): turns, tool calls (in all and per tool), tool errors (in
/// all and per kind), tool seconds, sampled and tool tokens per episode, and the share of
/// episodes a cap ended. Empty for single-turn episodes.
pub fn round_metrics(episodes: &[Episode]) -> Vec<(String, f64)> {
    let traces: Vec<&crate::rollout::AgentTrace> =
        episodes.iter().filter_map(|e| e.agent.as_ref()).collect();
    if traces.is_empty() {
        return vec![];
    }
    let n = traces.len() as f64;
    let mean = |f: &dyn Fn(&crate::rollout::AgentTrace) -> f64| {
        traces.iter().map(|t| f(t)).sum::<f64>() / n
    };
    let mut m = vec![
        (
            "agent/turns_per_episode".to_string(),
            mean(&|t| t.turns as f64),
        ),
        (
            "agent/tool_calls_per_episode".into(),
            mean(&|t| t.tool_calls.len() as f64),
        ),
        (
            "agent/tool_errors_per_episode".into(),
            mean(&|t| t.tool_errors.len() as f64),
        ),
        (
            "agent/tool_seconds_per_episode".into(),
            mean(&|t| t.tool_secs),
        ),
        (
            "agent/episodes_calling_tools".into(),
            mean(&|t| (!t.tool_calls.is_empty()) as u8 as f64),
        ),
        (
            "agent/episodes_cut".into(),
            mean(&|t| t.cut.is_some() as u8 as f64),
        ),
        (
            "agent/tool_tokens_per_episode".into(),
            mean(&|t| t.sampled.iter().filter(|&&s| !s).count() as f64),
        ),
    ];
    let mut by = |prefix: &str, names: &dyn Fn(&crate::rollout::AgentTrace) -> &Vec<String>| {
        let mut counts: std::collections::BTreeMap<&str, f64> = Default::default();
        for t in &traces {
            for k in names(t) {
                *counts.entry(k.as_str()).or_default() += 1.0;
            }
        }
        for (k, c) in counts {
            m.push((format!("{prefix}/{k}"), c / n));
        }
    };
    by("agent/tool_calls", &|t| &t.tool_calls);
    by("agent/tool_errors", &|t| &t.tool_errors);
    m
}

/// One supervised warm-up trace: the prompt, then a call of the tool, the tool's real answer,
/// and the final answer, with the tokens the model is to learn marked.
#[derive(Debug, Clone, PartialEq)]
pub struct Trace {
    pub prompt_ids: Vec<u32>,
    pub completion_ids: Vec<u32>,
    /// Per completion token: the model's (learned) or the tool's (context only).
    pub sampled: Vec<bool>,
}

impl Agent {
    /// Tool-use traces for the built-in arithmetic task's first `count` `examples` (with
    /// `prompt_ids`, already rendered with the tools): the model calls the first tool with the
    /// problem's expression (`a op b` from the example's fields), the tool answers (run for real,
    /// as many calls at once as there are tool processes), and the model answers with the tool's
    /// result and `eos`. Examples the tool cannot answer are left out.
    pub fn arithmetic_traces(
        &self,
        examples: &[Example],
        prompt_ids: &[Vec<u32>],
        count: usize,
        eos: u32,
    ) -> Result<Vec<Trace>> {
        let calls = examples
            .iter()
            .take(count)
            .map(|ex| self.warmup_call(ex))
            .collect::<Result<Vec<_>>>()?;
        let tools = self.tool_host().ok_or_else(|| {
            crate::Error::config(
                "sft_warmup_steps",
                "the warm-up's traces call tools; an environment program has none",
            )
        })?;
        let processes = tools.pids().len().max(1);
        let results: Vec<Option<String>> = std::thread::scope(|s| {
            let per = calls.len().div_ceil(processes).max(1);
            let handles: Vec<_> = calls
                .chunks(per)
                .map(|chunk| {
                    s.spawn(move || {
                        chunk
                            .iter()
                            .map(|c| tools.call(self.new_episode_id(), c).ok())
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().unwrap_or_default())
                .collect()
        });
        let mut out = Vec::with_capacity(calls.len());
        for ((call, result), prompt) in calls.iter().zip(results).zip(prompt_ids) {
            let Some(result) = result else { continue };
            let text = format!(
                "<tool_call>\n{}\n</tool_call>",
                serde_json::json!({"name": call.name, "arguments": call.arguments})
            );
            let first = self.tok.encode(&text, false)?;
            let inserted = self
                .turns
                .continuation_ids("", std::slice::from_ref(&result))?;
            let mut last = self.tok.encode(result.trim(), false)?;
            last.push(eos);
            let sampled: Vec<bool> = std::iter::repeat_n(true, first.len())
                .chain(std::iter::repeat_n(false, inserted.len()))
                .chain(std::iter::repeat_n(true, last.len()))
                .collect();
            out.push(Trace {
                prompt_ids: prompt.clone(),
                completion_ids: [first, inserted, last].concat(),
                sampled,
            });
        }
        Ok(out)
    }

    /// The warm-up's call for an arithmetic problem: the first tool (one argument, in the
    /// `hermes` format) with the problem's expression.
    fn warmup_call(&self, ex: &Example) -> Result<calls::ToolCall> {
        let bad = |m: &str| crate::Error::config("sft_warmup_steps", m.to_string());
        if self.format() != Some(CallFormat::Hermes) {
            return Err(bad(
                "the warm-up's traces are written in the hermes tool-call format",
            ));
        }
        let (name, arg) = self
            .schemas
            .first()
            .and_then(|s| {
                let f = s.get("function").unwrap_or(s);
                let name = f.get("name")?.as_str()?.to_string();
                let props = f.get("parameters")?.get("properties")?.as_object()?;
                let (arg, _) = props.iter().next()?;
                (props.len() == 1).then(|| (name, arg.clone()))
            })
            .ok_or_else(|| {
                bad("the warm-up needs a first tool with one argument (the expression)")
            })?;
        let m = &ex.metadata;
        let (Some(a), Some(b), Some(op)) = (m.get("a"), m.get("b"), m.get("op")) else {
            return Err(bad(
                "the warm-up's traces are made from the built-in arithmetic task (unset train_file)",
            ));
        };
        let mut arguments = serde_json::Map::new();
        arguments.insert(
            arg,
            Value::String(format!("{a} {} {b}", op.as_str().unwrap_or("+"))),
        );
        Ok(calls::ToolCall { name, arguments })
    }
}
