//! Agents' supervised warm-up: before GRPO, `sft_warmup_steps` optimizer steps of supervised
//! fine-tuning on tool-use traces ([`crate::agents::Agent::arithmetic_traces`]), so that a model
//! that never calls a tool on its own starts GRPO knowing the call format.
//!
//! Supervised fine-tuning is the GRPO update on fixed rows: every trace with advantage 1, on
//! policy (the ratio is 1 and its gradient that of the log-prob), the token-mean reduction
//! (`dapo` with one micro-batch per step), no KL, log-probs at temperature 1, tool tokens out of
//! the loss: its gradient is that of the mean cross-entropy of the model's tokens. It has its own
//! AdamW (GRPO's starts fresh after it) and does not count as GRPO steps.

use super::policy::Policy;
use super::setup::Run;
use super::update::{update_round, Schedule, StepCounter};
use super::world::World;
use super::Console;
use crate::loss::{LossOptions, LossType};
use crate::optim::LrSchedule;
use crate::rollout::{TrainBatch, TrainRow};
use crate::Result;

/// Runs the warm-up when the config asks for one and the run starts fresh.
pub(super) fn sft_warmup<P: Policy>(
    r: &mut Run<P>,
    world: &dyn World,
    console: &Console,
) -> Result<()> {
    let (cfg, steps) = (r.cfg, r.cfg.agent.sft_warmup_steps);
    let Some(agent) = r
        .agent
        .as_ref()
        .filter(|_| steps > 0 && r.resumed_from.is_none())
    else {
        return Ok(());
    };
    let eos = r
        .opts
        .sampling
        .eos_token_ids
        .first()
        .copied()
        .unwrap_or(r.pad);
    let per_step = cfg.update.per_device_train_batch_size;
    // The file's conversations, or as many traces of the built-in task as the warm-up's steps
    // read (each problem once, when there are enough).
    let traces = match &cfg.agent.sft_warmup_file {
        Some(path) => {
            let conversations = crate::agents::traces::read_conversations(path)?;
            agent.conversation_traces(&conversations, eos)?
        }
        None => agent.arithmetic_traces(&r.data.train, &r.train_ids, steps * per_step, eos)?,
    };
    if traces.is_empty() {
        return Err(crate::Error::config(
            "sft_warmup_steps",
            "no warm-up trace could be made: the tool answered none of the problems",
        ));
    }
    let mut opts = r.opts.update.clone();
    opts.loss = LossOptions {
        loss_type: LossType::Dapo,
        beta: 0.0,
        ..opts.loss.clone()
    };
    (opts.temperature, opts.num_iterations) = (1.0, 1);
    (
        opts.micro_batch,
        opts.accumulation_steps,
        opts.steps_per_generation,
    ) = (per_step, 1, 1);
    let schedule = Schedule {
        learning_rate: cfg
            .agent
            .sft_warmup_learning_rate
            .unwrap_or(cfg.update.learning_rate),
        kind: LrSchedule::Constant,
        warmup_steps: 0,
        total_steps: steps as u64,
    };
    let mut opt = super::setup::new_optimizer(cfg, &r.policy, world)?;
    console.say(format!(
        "warm-up: {steps} supervised steps on {} tool-use traces ({per_step} a step)",
        traces.len()
    ));
    let (mut step, mut bad, mut skipped) = (0u64, 0usize, 0u64);
    while step < steps as u64 {
        let at = step as usize * per_step;
        let batch = TrainBatch {
            rows: (at..at + per_step)
                .map(|i| &traces[i % traces.len()])
                .map(|t| TrainRow {
                    prompt_ids: t.prompt_ids.clone(),
                    completion_ids: t.completion_ids.clone(),
                    active: true,
                    advantage: 1.0,
                    old_logps: None,
                    ref_logps: None,
                    sampled: Some(t.sampled.clone()),
                })
                .collect(),
        };
        let counter = StepCounter {
            step: &mut step,
            consecutive_nonfinite: &mut bad,
            skipped_steps: &mut skipped,
            adaptive_entropy: None,
        };
        let stats = update_round(
            &r.policy,
            &mut opt,
            &batch,
            &opts,
            &schedule,
            counter,
            world,
            &mut |_| {},
        )?;
        if let Some(s) = stats.last() {
            // The policy loss at ratio 1 is -1 whatever the model; the cross-entropy of the
            // model's tokens is minus their mean log-prob.
            let ce = -s.mean_logp;
            r.metrics.log(
                0,
                &[
                    ("warmup/step".to_string(), step as f64),
                    ("warmup/cross_entropy".to_string(), ce),
                ],
            )?;
            if step % 5 == 0 || step == steps as u64 {
                console.say(format!("warm-up step {step:>4}  cross-entropy {ce:.4}"));
            }
        }
    }
    Ok(())
}
