//! grpo inside another program (the Python package): what it asks of the library besides a
//! training run ([`crate::train::train`] with [`crate::inputs::HostInputs`]), put together here
//! from the same parts `grpo eval` uses.

use crate::config::TrainConfig;
use crate::inputs::HostInputs;
use crate::{Error, Result};

/// Evaluation of `model` (a directory, checkpoint or hub id; None: the default model) on the
/// held-out prompts (the host's, else the config's `eval_file` or built-in task) with the run's
/// rewards, as training's evaluation runs it: the config's `eval_*` keys, its chat template and
/// tools. Returns the metrics (`eval/accuracy`, `eval/pass@k`, `eval/rewards/...`).
pub fn evaluate(
    cfg: &TrainConfig,
    host: &HostInputs,
    model: Option<&str>,
) -> Result<Vec<(String, f64)>> {
    let device = cfg.run.device.device()?;
    // As in training: the user's training prompts without held-out ones have none.
    let own_train = host.train.is_some() || cfg.data.train_file.is_some();
    let examples = match (&host.eval, &cfg.data.eval_file, own_train) {
        (Some(e), _, _) => e.clone(),
        (None, Some(_), _) | (None, None, false) => crate::inputs::held_out_examples(cfg)?,
        (None, None, true) => vec![],
    };
    if examples.is_empty() {
        return Err(Error::config(
            "eval_dataset",
            "no held-out prompts: give GRPOTrainer an eval_dataset (or eval_file)",
        ));
    }
    let mut rewards = host.rewards(cfg, &device)?;
    let base = cfg.run.model.as_deref().filter(|b| Some(*b) != model);
    let (sampler, tok, eos) =
        crate::eval::load_inference_model(model, base, cfg.run.dtype.compute(), &device)?;
    let tok = crate::inputs::configured_tokenizer(cfg, tok)?;
    let (agent, tok) = crate::inputs::agent(cfg, tok)?;
    if let Some(agent) = &agent {
        crate::inputs::environment_rewards(agent, &mut rewards);
    }
    let opts = cfg.eval_options(eos);
    if let Some(c) = &opts.correctness {
        c.index(&rewards, "correctness_reward")?;
    }
    let report = crate::eval::evaluate_agent(
        &sampler,
        &tok,
        &examples,
        &rewards,
        &opts,
        None,
        None,
        agent.as_ref(),
    )?;
    Ok(report.metrics)
}
