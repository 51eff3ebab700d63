//! What a run reads besides the model: its prompt sets and its reward functions, loaded one way
//! for `grpo train`, `grpo eval` and `grpo rewards check`.

use std::path::Path;

use candle_core::Device;

use crate::config::{PolicyType, TrainConfig};
use crate::data::{self, Example};
use crate::rewards::{self, Reward};
use crate::{Error, Result};

/// The prompt sets and rewards of a run.
pub struct RunData {
    pub train: Vec<Example>,
    pub eval: Vec<Example>,
    pub rewards: Vec<Reward>,
}

/// Training prompts (`train_file`, else the built-in task's training problems), held-out prompts
/// (`eval_file`, else the built-in task's held-out problems; none for a `train_file` without an
/// `eval_file`) and the rewards ([`config_rewards`]), each scorer endpoint checked to answer.
pub fn load_run_data(cfg: &TrainConfig, device: &Device) -> Result<RunData> {
    let (train, mut eval) = match &cfg.data.train_file {
        Some(p) => (load_examples(cfg, p)?, vec![]),
        None => builtin_task(cfg)?,
    };
    if let Some(p) = &cfg.data.eval_file {
        eval = load_examples(cfg, p)?;
    }
    let rewards = config_rewards(cfg, device)?;
    for r in &rewards {
        r.check_reachable()?;
    }
    Ok(RunData {
        train,
        eval,
        rewards,
    })
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
