//! One round of GRPO on one screen: [`grpo_round`] samples `P` prompts x `G` completions with
//! the current policy, scores them, turns the rewards into group-relative advantages, and takes
//! the round's optimizer steps (the GRPO loss and its gradients, then AdamW), in that order,
//! each phase a call away. The phases take what they read and return what they produce:
//! [`Episodes`](super::round::Episodes) -> [`Scored`] -> [`RoundBatch`] -> one [`StepStats`] per
//! optimizer step.

use std::time::Instant;

use super::policy::Policy;
use super::round::{advantages, log_probs, sample, score, Passes, RoundBatch, Scored};
use super::setup::Run;
use super::update::{
    dropout_stream, optimizer_step, policy_gradients, skip_round, StepCounter, StepStats,
    UpdatePlan,
};
use super::world::World;
use super::Console;
use crate::{Error, Result};

/// What a round produced: its scored completions, their advantages and batch, and the
/// statistics of its optimizer steps.
pub struct Round {
    pub scored: Scored,
    pub batch: RoundBatch,
    pub steps: Vec<StepStats>,
}

/// One round: sample -> score -> advantages -> loss -> optimizer step. The one place the step
/// counter moves.
pub fn grpo_round<P: Policy>(
    r: &mut Run<P>,
    world: &dyn World,
    console: &Console,
) -> Result<Round> {
    let t_round = Instant::now();
    r.opts
        .set_temperature(r.cfg.generation.temperature_at(r.state.step));

    // 1-3. Sample with the current policy (rewards that allow it score each group on a second
    //      thread as soon as it has finished), take old and reference log-probs, score the rest.
    //      Dynamic sampling: more passes until P groups carry a signal.
    let (mut passes, mut kept) = (Passes::new(r), None);
    while let Some(seeds) = passes.next(r, kept.as_ref()) {
        let (episodes, sampler) = sample(r, &seeds, world)?; // this rank's groups
        let logps = log_probs(r, sampler, &episodes.episodes)?; // [N][len] old and reference
        let pass = score(r, episodes, logps, world)?; // every reward; the world's groups
        kept = Some(passes.keep(&r.opts.weights, kept, pass)?);
    }
    let mut scored = kept.ok_or_else(|| Error::invariant("a round sampled no pass"))?;

    // 4. Rewards -> group-relative advantages (KL in the reward when so configured), and the
    //    rows this rank trains on.
    let batch = advantages(r, &scored, world)?;

    // 5. The optimizer steps: per window of micro-batches (TRL's num_iterations x
    //    steps_per_generation), the GRPO loss and its gradients, then AdamW. A reward of +/-inf
    //    skips them (as a NaN loss does); a round whose groups all tied has none.
    let t0 = Instant::now();
    let o = &r.opts;
    let mut counter = StepCounter {
        step: &mut r.state.step,
        consecutive_nonfinite: &mut r.state.consecutive_nonfinite,
        skipped_steps: &mut r.state.skipped_steps,
        adaptive_entropy: r.state.adaptive_entropy.as_mut(),
    };
    let mut steps = Vec::new();
    if let Some(why) = &batch.unusable {
        let max_bad = o.update.max_bad_steps;
        steps = skip_round(o.updates_per_round, &o.schedule, counter, why, max_bad)?;
    } else {
        let plan = UpdatePlan::new(&batch.train, &o.update, world)?;
        if plan.is_empty() {
            console.say(format!(
                "step {}: every group had equal rewards; no update this round",
                *counter.step + 1
            ));
            *counter.step = (*counter.step + o.updates_per_round).min(o.schedule.total_steps);
        }
        for window in plan.windows() {
            let step = *counter.step;
            if step >= o.schedule.total_steps {
                break;
            }
            let opts = counter.options(&o.update);
            let (train, red) = (&batch.train, &plan.reduction);
            let stream = dropout_stream(step);
            let (grads, st) =
                policy_gradients(&r.policy, train, window, red, &opts, stream, world)?;
            let st = optimizer_step(&mut r.opt, grads, st, o.schedule.lr(step), &opts, world)?;
            steps.push(counter.count(st, &o.update, world)?);
            console.set_position(*counter.step);
        }
    }
    console.set_position(r.state.step);
    super::end_phase("update", &super::policy_device(&r.policy));
    r.state.round += 1;
    sync_reference(r)?;
    scored.times.update = t0.elapsed().as_secs_f64();
    scored.times.step = t_round.elapsed().as_secs_f64();
    Ok(Round {
        scored,
        batch,
        steps,
    })
}

/// TRL's `sync_ref_model`: the policy mixed into the reference every `ref_model_sync_steps`.
fn sync_reference<P: Policy>(r: &mut Run<P>) -> Result<()> {
    let loss = &r.cfg.loss;
    if loss.sync_ref_model
        && r.state
            .step
            .is_multiple_of(loss.ref_model_sync_steps as u64)
    {
        r.reference.sync(&r.policy, loss.ref_model_mixup_alpha)?;
    }
    Ok(())
}
