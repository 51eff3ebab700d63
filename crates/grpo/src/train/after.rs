//! Steps 6-7 of a round, after its update: log its metrics (evaluating on the held-out prompts
//! every `eval_steps`), watch its health, log its completions, and save a checkpoint every
//! `save_steps`, at the end, and when the run is asked to stop.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use serde_json::json;

use super::health::{Health, HealthOptions};
use super::metrics::{names, StepMetrics, WorldMemory};
use super::observer::Observer;
use super::policy::Policy;
use super::round::RoundBatch;
use super::setup::Run;
use super::step::Round;
use super::world::World;
use super::{Console, RunControl, TrainOutcome};
use crate::config::SaveStrategy;
use crate::data;
use crate::optim::AdamW;
use crate::rewards::Reward;
use crate::rollout::Episode;
use crate::{Error, Result};

/// Rounds between the checks that every rank holds the same parameters.
const CHECKSUM_ROUNDS: u64 = 10;

/// What the run keeps across rounds for logging and its outcome.
pub struct AfterRound {
    health: Health,
    /// `eval_steps` > 0 and there are held-out prompts.
    evaluates: bool,
    rounds_this_run: u64,
    last_checkpoint: Option<PathBuf>,
    last_eval: Option<Vec<(String, f64)>>,
    /// Told of each step, log, evaluation and checkpoint (on the main rank).
    observer: Option<Arc<dyn Observer>>,
    /// The last step the observer was told of.
    observed_step: u64,
}

impl AfterRound {
    pub fn new<P: Policy>(r: &Run<P>, observer: Option<Arc<dyn Observer>>) -> AfterRound {
        AfterRound {
            health: Health::new(HealthOptions::default()),
            evaluates: r.cfg.logging.eval_steps > 0 && !r.data.eval.is_empty(),
            rounds_this_run: 0,
            last_checkpoint: r.resumed_from.clone(),
            last_eval: None,
            observer,
            observed_step: r.state.step,
        }
    }

    /// Runs `f` on the observer, when there is one.
    fn tell(&self, f: impl FnOnce(&dyn Observer)) {
        if let Some(o) = &self.observer {
            f(o.as_ref());
        }
    }

    /// A fresh run's evaluation of the model it starts from (step 0), when evaluation is on.
    pub fn before_training<P: Policy>(
        &mut self,
        r: &mut Run<P>,
        world: &dyn World,
        console: &Console,
    ) -> Result<()> {
        if !self.evaluates || r.state.step != 0 {
            return Ok(());
        }
        let ev = evaluate(r, 0, world, console)?;
        let acc = ev
            .iter()
            .find(|(n, _)| n == names::EVAL_ACCURACY)
            .map_or(f64::NAN, |x| x.1);
        console.say(format!("step    0  eval acc {acc:.3} (before training)"));
        r.metrics.log(0, &ev)?;
        self.tell(|o| {
            o.on_log(0, &ev);
            o.on_evaluate(0, &ev);
        });
        Ok(())
    }

    /// Logs the round that just updated: its metrics (and the held-out evaluation every
    /// `eval_steps`), health warnings, sampled completions; tells the observer. Returns the
    /// metrics, which decide the best checkpoint.
    pub fn log<P: Policy>(
        &mut self,
        r: &mut Run<P>,
        round: &Round,
        world: &dyn World,
        console: &Console,
    ) -> Result<StepMetrics> {
        let cfg = r.cfg;
        let main = world.is_main();
        self.rounds_this_run += 1;
        let mut m = StepMetrics::of_round(r, &round.scored, &round.batch, &round.steps);
        if world.size() > 1 {
            m.world_memory = Some(world_memory(&r.opt, &r.policy, world)?);
        }
        let step = r.state.step;
        for s in self.observed_step + 1..=step {
            self.tell(|o| o.on_step_end(s));
        }
        self.observed_step = step;
        let at_end = step >= r.opts.schedule.total_steps;
        if self.evaluates && (step.is_multiple_of(cfg.logging.eval_steps as u64) || at_end) {
            let t0 = Instant::now();
            let ev = evaluate(r, step, world, console)?;
            m.eval_seconds = Some(t0.elapsed().as_secs_f64());
            m.eval = ev.clone();
            self.last_eval = Some(ev);
        }
        let warnings = self.health.check(step, &m);
        m.health = warnings.iter().map(|w| w.kind.name()).collect();
        if main
            && cfg.logging.logging_steps > 0
            && (step.is_multiple_of(cfg.logging.logging_steps as u64) || at_end)
        {
            let pairs = m.pairs();
            r.metrics.log(step, &pairs)?;
            console.say(m.console_line(step));
            self.tell(|o| o.on_log(step, &pairs));
        }
        if !m.eval.is_empty() {
            self.tell(|o| o.on_evaluate(step, &m.eval));
        }
        for w in warnings.iter().filter(|_| main) {
            console.say(format!("warning: {}", w.message));
            let row = json!({"step": w.step, "kind": w.kind.name(), "message": w.message});
            r.metrics.log_json("health.jsonl", &row)?;
        }
        let completions_due = r
            .state
            .round
            .is_multiple_of(cfg.logging.log_completions_steps.max(1) as u64)
            || r.state.round == 1;
        if main && cfg.logging.log_completions && completions_due {
            log_completions(r, &round.scored.episodes, &round.batch, console)?;
        }
        Ok(m)
    }

    /// Saves a checkpoint when one is due (every `save_steps`, at the end, and when asked to
    /// stop; `m` says whether it is the best so far). Returns whether the run stops here (asked
    /// to, before its last step).
    pub fn checkpoint<P: Policy>(
        &mut self,
        r: &mut Run<P>,
        m: &StepMetrics,
        ctl: &RunControl,
        world: &dyn World,
        console: &Console,
    ) -> Result<bool> {
        let cfg = r.cfg;
        let main = world.is_main();
        let step = r.state.step;
        let at_end = step >= r.opts.schedule.total_steps;
        // 7. Checkpoint (every save_steps, at the end, and when asked to stop).
        // Any rank asked to stop (Slurm's SIGTERM): every rank stops after this round.
        let stop_now = world.any(ctl.stop.load(Ordering::SeqCst))?
            || ctl
                .max_rounds_this_run
                .is_some_and(|k| self.rounds_this_run >= k);
        if world.size() > 1 && (r.state.round.is_multiple_of(CHECKSUM_ROUNDS) || at_end) {
            check_same_parameters(&r.policy, world)?;
        }
        let periodic = cfg.logging.save_steps > 0
            && crossed(
                step,
                r.opts.updates_per_round,
                cfg.logging.save_steps as u64,
            );
        let saves = cfg.logging.save_strategy != SaveStrategy::No;
        // Every rank knows a checkpoint is due (the world's stop flag): a sharded optimizer
        // state is gathered by all of them, then the main rank writes it.
        let due = saves && (periodic || at_end || stop_now);
        let (tensors, optimizer) = match due {
            true => (r.policy.named_tensors()?, r.optimizer_state(world)?),
            false => (vec![], None),
        };
        if main && due {
            // metric_for_best_model: this checkpoint is the best when this round's eval is.
            let new_best = r
                .opts
                .best
                .as_ref()
                .and_then(|b| b.improved_by(m, &r.state));
            let dir = r.save(new_best, &tensors, optimizer.as_deref())?;
            console.say(format!("saved {}", dir.display()));
            self.tell(|o| o.on_save(step, &dir));
            self.last_checkpoint = Some(dir);
        }
        // An observer may ask to stop when told of the checkpoint (a callback's on_save).
        // (`ctl.observer`, which every rank has, so that every rank takes part.)
        let stop_now = match (stop_now, &ctl.observer) {
            (false, Some(_)) => world.any(ctl.stop.load(Ordering::SeqCst))?,
            _ => stop_now,
        };
        Ok(stop_now && !at_end)
    }

    /// The run's outcome, after its last round; the trackers are closed.
    pub fn finish<P: Policy>(
        self,
        r: &mut Run<P>,
        interrupted: bool,
        world: &dyn World,
    ) -> TrainOutcome {
        if world.is_main() {
            r.metrics.finish();
        }
        let best_checkpoint = r.state.best_model_checkpoint.as_ref().map(PathBuf::from);
        if let (Some(b), Some(dir)) = (&r.opts.best, &best_checkpoint) {
            tracing::info!(
                "best checkpoint: {} ({} = {:.4} at step {})",
                dir.display(),
                b.metric,
                r.state.best_metric.unwrap_or(f64::NAN),
                r.state.best_global_step.unwrap_or(0)
            );
        }
        TrainOutcome {
            steps: r.state.step,
            last_checkpoint: self.last_checkpoint,
            best_checkpoint,
            interrupted,
            last_eval: self.last_eval,
        }
    }
}

/// Whether the optimizer steps of the round just done crossed a multiple of `every`.
pub(super) fn crossed(step: u64, per_round: u64, every: u64) -> bool {
    let before = step.saturating_sub(per_round);
    step / every > before / every
}

/// The memory of the world's ranks: the largest peak resident set (each rank's own, gathered:
/// every rank calls it), and the optimizer state and trainable parameters the main rank keeps.
fn world_memory<P: Policy>(opt: &AdamW, policy: &P, world: &dyn World) -> Result<WorldMemory> {
    let params = match policy.sharded() {
        Some(p) => p.mine().elem_count(),
        None => policy.vars().iter().map(|v| v.elem_count()).sum(),
    };
    let peak = grpo_models::threads::rss_gb().map_or(f64::NAN, |(_, peak)| peak);
    let all = world.all_gather_bytes(peak.to_le_bytes().to_vec())?;
    let peaks = all
        .iter()
        .filter_map(|b| Some(f64::from_le_bytes(b.as_slice().try_into().ok()?)));
    Ok(WorldMemory {
        rss_peak_gb_max_rank: peaks.fold(f64::NAN, f64::max),
        optimizer_state_gb: opt.state_bytes() as f64 / 1e9,
        parameters_gb: 4.0 * params as f64 / 1e9,
    })
}

/// Every rank's parameters must be the same after each update; a rank that drifted (a
/// non-deterministic reduction, a bad node) is an error naming it, not a silent divergence.
fn check_same_parameters<P: Policy>(policy: &P, world: &dyn World) -> Result<()> {
    if policy.sharded().is_some() {
        // `zero_stage = 3`: each rank holds its own range, and nothing else.
        return Ok(());
    }
    let mut sum = 0f64;
    for v in policy.vars() {
        let x: Vec<f32> = v
            .flatten_all()?
            .to_dtype(candle_core::DType::F32)?
            .to_vec1()?;
        sum += x
            .iter()
            .enumerate()
            .map(|(i, &x)| x as f64 * (1.0 + (i % 7) as f64))
            .sum::<f64>();
    }
    let all = world.all_gather_bytes(sum.to_le_bytes().to_vec())?;
    let sums: Vec<f64> = all
        .iter()
        .enumerate()
        .map(|(r, b)| {
            let bytes: [u8; 8] = b.as_slice().try_into().map_err(|_| {
                Error::Distributed(format!(
                    "rank {r} sent a parameter checksum of {} bytes, not 8: the ranks run \
                     different grpo builds or the transport corrupted it",
                    b.len()
                ))
            })?;
            Ok(f64::from_le_bytes(bytes))
        })
        .collect::<Result<_>>()?;
    if let Some(r) = sums.iter().position(|&s| s.to_bits() != sums[0].to_bits()) {
        return Err(Error::Distributed(format!(
            "rank {r}'s parameters differ from rank 0's (checksums {:e} and {:e}): the ranks \
             diverged; stopping",
            sums[r], sums[0]
        )));
    }
    Ok(())
}

/// Evaluation on the held-out prompts as the config's `eval_*` keys say (see [`crate::eval`]):
/// pass@k, sampled and greedy accuracy, mean rewards. Every answer goes to `eval/step-N.jsonl`.
/// Across ranks the prompts are shared out and the answers gathered; rank 0 writes them. Its
/// sampling calls are bounded by the memory of a training pass of the size the run resolved
/// ([`crate::eval::BatchBound`]); its progress bar takes the training bar's place meanwhile.
fn evaluate<P: Policy>(
    r: &mut Run<P>,
    step: u64,
    world: &dyn World,
    console: &Console,
) -> Result<Vec<(String, f64)>> {
    let model = r.policy.freeze(r.cfg.update.gradient_checkpointing)?;
    let mut opts = r.cfg.eval_options(r.opts.sampling.eos_token_ids.clone());
    opts.batch.pass_tokens = r.opts.update.forward_chunk_tokens;
    let file = format!("eval/step-{step}.jsonl");
    let metrics = &mut r.metrics;
    let mut log = |row: &serde_json::Value| metrics.log_json(&file, row);
    let gather = |b: Vec<u8>| world.all_gather_bytes(b);
    let shard = (world.size() > 1).then_some(crate::eval::EvalShard {
        rank: world.rank(),
        size: world.size(),
        gather: &gather,
    });
    let report = console.suspend(|| {
        crate::eval::evaluate_agent(
            &model,
            &r.tok,
            &r.data.eval,
            &r.data.rewards,
            &opts,
            world
                .is_main()
                .then_some(&mut log as crate::eval::RowSink<'_>),
            shard,
            r.agent.as_ref(),
        )
    })?;
    super::trace_memory("evaluation", &super::policy_device(&r.policy));
    Ok(report.metrics)
}

/// Every completion of the round to `completions.jsonl`, each group's statistics to
/// `groups.jsonl`, and a few completions on the console.
fn log_completions<P: Policy>(
    r: &mut Run<P>,
    episodes: &[Episode],
    batch: &RoundBatch,
    console: &Console,
) -> Result<()> {
    let (rewards, advantages) = (&batch.adv.rewards, &batch.adv.advantages);
    for (i, e) in episodes.iter().enumerate() {
        let mut line = json!({
            "step": r.state.step,
            "prompt": prompt_shown(r, e)?,
            "completion": e.text,
            "stop_reason": e.stop_reason,
            "rewards": Reward::named_scores(&r.data.rewards, &e.rewards),
            "reward": rewards[i],
            "advantage": advantages[i],
        });
        // An agent's episode turn by turn, with roles and tool calls.
        if let Some(a) = &e.agent {
            line["messages"] = json!(a.messages);
            line["tool_errors"] = json!(a.tool_errors);
            line["cut"] = json!(a.cut);
        }
        r.metrics.log_json("completions.jsonl", &line)?;
    }
    // Seed 003's per-group validation log: one row per group.
    let stats = crate::advantages::group_stats(rewards, advantages, r.opts.g);
    for (gi, st) in stats.iter().enumerate() {
        let e = &episodes[gi * r.opts.g];
        r.metrics.log_json(
            "groups.jsonl",
            &json!({
                "step": r.state.step,
                "group": gi,
                "prompt": prompt_shown(r, e)?,
                "reward_mean": st.reward_mean,
                "reward_std": st.reward_std,
                "advantage_mean": st.advantage_mean,
                "advantage_std": st.advantage_std,
                "scorable": st.scorable,
                "zero_std": batch.adv.zero_std[gi],
            }),
        )?;
    }
    for e in episodes
        .iter()
        .step_by(r.opts.g)
        .take(r.cfg.logging.num_completions_to_print)
    {
        console.say(format!(
            "  sample: {:?} -> {:?} (rewards {:?})",
            prompt_shown(r, e)?.chars().take(80).collect::<String>(),
            e.text.chars().take(120).collect::<String>(),
            e.rewards
        ));
    }
    Ok(())
}

/// The prompt of an episode as logs show it: the policy kind's way ([`Policy::shown_prompt`]),
/// else the dataset's prompt.
fn prompt_shown<P: Policy>(r: &Run<P>, e: &Episode) -> Result<String> {
    match r.policy.shown_prompt(&r.tok, e)? {
        Some(shown) => Ok(shown),
        None => Ok(data::prompt_text(&r.data.train[e.example])),
    }
}
