//! What a run reads besides the model: its prompt sets and its reward functions, loaded one way
//! for `grpo train`, `grpo eval` and `grpo rewards check`.

use std::path::Path;

use candle_core::Device;

use crate::agents::calls::CallFormat;
use crate::agents::program_env::{EnvSpec, ProgramEnv, Transport};
use crate::agents::tools::{ToolHost, ToolSpec};
use crate::agents::{Agent, AgentOptions, EnvironmentReward};
use crate::config::{PolicyType, TrainConfig};
use crate::data::{self, Example};
use crate::rewards::{self, Reward, RewardKind};
use crate::{Error, Result};
use grpo_models::tokenizer::Tokenizer;

/// The prompt sets and rewards of a run.
pub struct RunData {
    pub train: Vec<Example>,
    pub eval: Vec<Example>,
    pub rewards: Vec<Reward>,
}

/// What the program grpo runs in (the Python package) gives a run besides its config: prompt
/// sets built in memory and reward functions of its own. Empty for `grpo train`.
#[derive(Clone, Default)]
pub struct HostInputs {
    /// Training prompts (replace `train_file` and the built-in task).
    pub train: Option<Vec<Example>>,
    /// Held-out prompts (replace `eval_file`).
    pub eval: Option<Vec<Example>>,
    /// The host's rewards, each at its place among the config's.
    pub rewards: Vec<HostRewardAt>,
}

/// A host reward and where it goes in the run's list of rewards.
#[derive(Clone)]
pub struct HostRewardAt {
    /// Its index in the run's rewards (the config's rewards fill the other places, in order).
    pub position: usize,
    pub name: String,
    pub weight: f32,
    pub func: std::sync::Arc<dyn rewards::host::HostReward>,
}

impl std::fmt::Debug for HostInputs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostInputs")
            .field("train", &self.train.as_ref().map(Vec::len))
            .field("eval", &self.eval.as_ref().map(Vec::len))
            .field(
                "rewards",
                &self.rewards.iter().map(|r| &r.name).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl HostInputs {
    /// The config's rewards with the host's put at their places. A host that gives rewards and a
    /// config with none: only the host's (not the built-in task's).
    pub fn rewards(&self, cfg: &TrainConfig, device: &Device) -> Result<Vec<Reward>> {
        let mut all = match self.rewards.is_empty() || !cfg.rewards.is_empty() {
            true => config_rewards(cfg, device)?,
            false => vec![],
        };
        for h in &self.rewards {
            let reward = Reward {
                name: h.name.clone(),
                func: rewards::RewardFn::Host(h.func.clone()),
                weight: h.weight,
            };
            all.insert(h.position.min(all.len()), reward);
        }
        Ok(all)
    }
}

/// Training prompts (the host's, else `train_file`, else the built-in task's training problems),
/// held-out prompts (the host's, else `eval_file`, else the built-in task's held-out problems;
/// none for training prompts of the user's without held-out ones) and the rewards
/// ([`HostInputs::rewards`]), each scorer endpoint checked to answer.
pub fn load_run_data(cfg: &TrainConfig, device: &Device, host: &HostInputs) -> Result<RunData> {
    let (train, mut eval) = match (&host.train, &cfg.data.train_file) {
        (Some(t), _) => (t.clone(), vec![]),
        (None, Some(p)) => (load_examples(cfg, p)?, vec![]),
        (None, None) => builtin_task(cfg)?,
    };
    if let Some(e) = &host.eval {
        eval = e.clone();
    } else if let Some(p) = &cfg.data.eval_file {
        eval = load_examples(cfg, p)?;
    }
    let rewards = host.rewards(cfg, device)?;
    for r in &rewards {
        r.check_reachable()?;
    }
    Ok(RunData {
        train,
        eval,
        rewards,
    })
}

/// The training prompts of a config alone (no rewards started): `train_file`, else the built-in
/// task's (what `grpo plan` measures prompt lengths on).
pub fn train_examples(cfg: &TrainConfig) -> Result<Vec<Example>> {
    match &cfg.data.train_file {
        Some(p) => load_examples(cfg, p),
        None => Ok(builtin_task(cfg)?.0),
    }
}

/// The held-out prompts of a training config: `eval_file` when set, else the built-in arithmetic
/// task's held-out problems (`task.*` keys).
pub fn held_out_examples(cfg: &TrainConfig) -> Result<Vec<Example>> {
    if let Some(p) = &cfg.data.eval_file {
        return load_examples(cfg, p);
    }
    Ok(builtin_task(cfg)?.1)
}

/// The built-in task of the config's policy kind: arithmetic questions for a causal LM, masked
/// copies (`w=w`) for a fill-in generator. `(train, eval)`.
fn builtin_task(cfg: &TrainConfig) -> Result<(Vec<Example>, Vec<Example>)> {
    match cfg.run.policy {
        PolicyType::CausalLm => data::arithmetic::make_task(&cfg.data.task().params()),
        PolicyType::FillIn => {
            crate::fill_in::task::make(&cfg.data.task().params(), cfg.data.task().mask_ratio)
        }
    }
}

/// The fields a config reads prompt rows with: `prompt_field`, `answer_field`, `skip_bad_rows`.
pub fn data_fields(cfg: &TrainConfig) -> data::DataFields {
    data::DataFields {
        prompt_field: cfg.data.prompt_field.clone(),
        answer_field: cfg.data.answer_field.clone(),
        skip_bad_rows: cfg.data.skip_bad_rows,
    }
}

/// Rows of a prompt file, read with the config's [`data_fields`] (skipped rows are counted in a
/// warning).
pub fn load_examples(cfg: &TrainConfig, path: &Path) -> Result<Vec<Example>> {
    let loaded = data::load_examples(path, &data_fields(cfg))?;
    if let Some(first) = loaded.skipped.first() {
        tracing::warn!(
            "{}: skipped {} bad rows (skip_bad_rows = true); first: {first}",
            path.display(),
            loaded.skipped.len()
        );
    }
    Ok(loaded.examples)
}

/// A config's `[[rewards]]` (parsed when the config was read), built on `device`: scorer
/// programs started, reward models loaded. The built-in task's rewards when it has none.
pub fn config_rewards(cfg: &TrainConfig, device: &Device) -> Result<Vec<Reward>> {
    if cfg.rewards.is_empty() {
        return match cfg.run.policy {
            PolicyType::CausalLm => Ok(rewards::builtin_task_rewards()),
            PolicyType::FillIn => {
                let judge = match &cfg.run.judge {
                    Some(j) => j.clone(),
                    None => {
                        crate::fill_in::pretrain::builtin_fill_in_models(&cfg.data.task(), true)?.1
                    }
                };
                crate::fill_in::task::builtin_rewards(&judge, cfg.data.train_file.is_none(), device)
            }
        };
    }
    rewards::build_rewards(&cfg.rewards, device)
}

/// The weight of each reward: `reward_weights` when set (one per reward), else each reward's own
/// `weight`.
pub fn reward_weights(cfg: &TrainConfig, rewards: &[Reward]) -> Result<Vec<f32>> {
    match &cfg.data.reward_weights {
        Some(w) if w.len() != rewards.len() => Err(Error::config(
            "reward_weights",
            format!("{} weights for {} reward functions", w.len(), rewards.len()),
        )),
        Some(w) => Ok(w.iter().map(|&x| x as f32).collect()),
        None => Ok(rewards.iter().map(|r| r.weight).collect()),
    }
}

/// The rewards the environment's side gives ([`Agent::environment_rewards`]) in `rewards`: an
/// environment with a reward method adds one (TRL: one more reward function, weight 1, named
/// after the environment); a Python reward function that takes `environments` is then scored
/// where the instances live (its adapter process is stopped).
pub fn environment_rewards(agent: &Agent, rewards: &mut Vec<Reward>) {
    for (k, source) in agent.environment_rewards().into_iter().enumerate() {
        let func = rewards::RewardFn::Environment(k);
        match source {
            EnvironmentReward::GetReward(name) => rewards.push(Reward {
                name,
                func,
                weight: 1.0,
            }),
            EnvironmentReward::Function(target) => {
                let mine = rewards
                    .iter_mut()
                    .filter(|r| r.python_function() == Some(target.as_str()));
                for r in mine {
                    r.func = rewards::RewardFn::Environment(k);
                }
            }
        }
    }
}

/// The model's tokenizer as the config sets it: `chat_template_kwargs`, and `chat_template` (a
/// template file) in place of the model's.
pub fn configured_tokenizer(cfg: &TrainConfig, tok: Tokenizer) -> Result<Tokenizer> {
    let tok = tok.with_template_kwargs(&cfg.chat_template_kwargs);
    let Some(path) = &cfg.agent.chat_template else {
        return Ok(tok);
    };
    let text = std::fs::read_to_string(path).map_err(|e| {
        Error::config(
            "chat_template",
            format!("cannot read {}: {e}", path.display()),
        )
    })?;
    tok.with_chat_template(&text, &path.display().to_string())
}

/// The run's agent, when the config gives tools or an environment (else `tok` as it is). The
/// tools start here, so that a missing module, a tool without a docstring or a template without
/// tool support stops the run before training.
pub fn agent(cfg: &TrainConfig, tok: Tokenizer) -> Result<(Option<Agent>, Tokenizer)> {
    let a = &cfg.agent;
    if let Some(transport) = program_transport(cfg) {
        return Ok((Some(program_agent(cfg, &tok, transport)?), tok));
    }
    if a.tools.is_empty() && a.environment_factory.is_none() {
        return Ok((None, tok));
    }
    let target = |key: &str, t: &str| {
        crate::rewards::command::python_target(t).map_err(|m| Error::config(key, m))
    };
    let tools = a
        .tools
        .iter()
        .map(|t| target("tools", t))
        .collect::<Result<Vec<_>>>()?;
    let environment = a
        .environment_factory
        .as_deref()
        .map(|t| target("environment_factory", t))
        .transpose()?;
    // With an environment, the Python reward functions that take `environments` are called
    // where the instances live (TRL passes `environments=` to every reward function).
    let reward_functions = cfg
        .rewards
        .iter()
        .filter_map(|r| match &r.kind {
            RewardKind::Command(c) if environment.is_some() => c.python_function(),
            _ => None,
        })
        .map(str::to_owned)
        .collect();
    let spec = ToolSpec {
        reward_functions,
        timeout: std::time::Duration::from_secs_f64(a.tool_timeout_s),
        max_result_chars: a.tool_max_result_chars,
        cpu_seconds: a.tool_cpu_seconds.map(|s| s as u64),
        memory_mb: a.tool_memory_mb.map(|m| m as u64),
        no_network: a.tool_no_network,
        processes: a.tool_max_concurrency,
        ..ToolSpec::new(tools, environment)
    };
    let host = ToolHost::start(spec)?;
    let max_iterations = a.max_tool_calling_iterations.unwrap_or(5);
    let per_turn = cfg.generation.max_completion_length;
    let opts = AgentOptions {
        format: a
            .tool_call_format
            .as_deref()
            .map(CallFormat::parse)
            .transpose()
            .map_err(|m| Error::config("tool_call_format", m))?,
        max_iterations,
        max_tokens: a
            .max_episode_tokens
            .unwrap_or(per_turn * (max_iterations + 1)),
        model: cfg
            .run
            .model
            .clone()
            .unwrap_or_else(|| "SmolLM2-135M-Instruct".into()),
        system_prompt: cfg.data.system_prompt.clone(),
        max_prompt_length: cfg.data.max_prompt_length,
        environment: a.environment_factory.clone(),
    };
    let (agent, tok) = Agent::start(host, tok, &opts)?;
    tracing::info!(
        "agent: tools {} ({} format), at most {} tool turns and {} tokens an episode",
        agent
            .schemas
            .iter()
            .filter_map(crate::agents::schema_name)
            .collect::<Vec<_>>()
            .join(", "),
        agent
            .format()
            .map_or(String::new(), |f| format!("{f:?}").to_lowercase()),
        agent.max_iterations,
        agent.max_tokens
    );
    Ok((Some(agent), tok))
}

/// Where the config's environment program or service is (`environment_command`,
/// `environment_url`; the config's checks allow one at most).
fn program_transport(cfg: &TrainConfig) -> Option<Transport> {
    let a = &cfg.agent;
    match (&a.environment_url, a.environment_command.is_empty()) {
        (Some(url), _) => Some(Transport::Http(url.clone())),
        (None, false) => Some(Transport::Command(a.environment_command.clone())),
        (None, true) => None,
    }
}

/// An agent acting in an environment program or service: the programs are started (or the
/// service is asked whether it answers) here, so that one that cannot run stops the run before
/// training, naming its key.
fn program_agent(cfg: &TrainConfig, tok: &Tokenizer, transport: Transport) -> Result<Agent> {
    let a = &cfg.agent;
    let spec = EnvSpec {
        processes: a.tool_max_concurrency,
        timeout: std::time::Duration::from_secs_f64(a.tool_timeout_s),
        max_observation_chars: a.tool_max_result_chars,
        // The tools' sandbox, for a program (a service runs where it runs).
        cpu_seconds: a.tool_cpu_seconds.map(|s| s as u64),
        memory_mb: a.tool_memory_mb.map(|m| m as u64),
        no_network: a.tool_no_network,
        ..EnvSpec::new(transport)
    };
    let env = ProgramEnv::start(spec)?;
    let max_iterations = a.max_tool_calling_iterations.unwrap_or(5);
    let per_turn = cfg.generation.max_completion_length;
    let opts = AgentOptions {
        format: None,
        max_iterations,
        max_tokens: (a.max_episode_tokens).unwrap_or(per_turn * (max_iterations + 1)),
        model: (cfg.run.model.clone()).unwrap_or_else(|| "SmolLM2-135M-Instruct".into()),
        system_prompt: cfg.data.system_prompt.clone(),
        max_prompt_length: cfg.data.max_prompt_length,
        environment: None,
    };
    let shown = env.describe();
    let agent = Agent::start_environment(env, tok.clone(), &opts)?;
    tracing::info!(
        "agent: environment {shown}, at most {} observations and {} tokens an episode",
        agent.max_iterations,
        agent.max_tokens
    );
    Ok(agent)
}
