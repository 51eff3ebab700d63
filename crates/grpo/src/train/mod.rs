//! The GRPO training loop, top to bottom: rollout, score, advantages, update, log, checkpoint.
//!
//! One *round* = one generation batch: `P` prompts x `G` completions, sampled with the current
//! policy, scored, turned into advantages, then used for `num_iterations x steps_per_generation /
//! gradient_accumulation_steps` optimizer steps of `gradient_accumulation_steps` micro-batches of
//! `per_device_train_batch_size` completions each (TRL's semantics). Checkpoints and resume happen
//! at round boundaries, so a resumed run replays exactly what the uninterrupted one does.
//!
//! Each step of a round is one call into the module that owns it; this file only orders them.
//! Set-up (model, policy, optimizer, reference, resume) is [`setup`], the update [`update`], what
//! a round logs [`metrics`]; the [`Policy`] and [`World`] traits are the seams for other kinds of
//! policy and for data-parallel runs.

mod fill_in;
mod health;
mod metrics;
mod policy;
mod round;
mod setup;
mod shard;
mod update;
mod world;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use serde_json::json;

pub use fill_in::{FillInForward, FillInPolicy};
pub use health::{Health, HealthKind, HealthOptions, HealthWarning};
pub use metrics::{names, RewardMetrics, RoundTimes, StepMetrics, UpdateMetrics};
pub use policy::{CausalLmForward, CausalLmPolicy, Policy, Reference, TrainForward};
pub use setup::{update_options, BestModel, LoadPolicy, Loaded, TrainerState};
pub use update::{
    policy_gradients, skip_round, update_policy, update_round, Schedule, StepCounter, StepStats,
    UpdateOptions,
};
#[cfg(feature = "mpi")]
pub use world::MpiWorld;
pub use world::{launcher_world_size, SingleProcess, World};

use crate::advantages::round_advantages;
use crate::config::{PolicyType, TrainConfig};
use crate::data;
use crate::loss::{kl_reward_penalty, KlMode};
use crate::rewards::Reward;
use crate::rollout::{Episode, TrainBatch};
use crate::{Error, Result};
use setup::Run;

/// How the run is controlled from outside.
#[derive(Debug, Clone, Default)]
pub struct RunControl {
    /// Continue from the newest checkpoint in `output_dir`.
    pub resume: bool,
    /// Set (e.g. by Ctrl-C) to stop after the current round, saving a checkpoint.
    pub stop: Arc<AtomicBool>,
    /// Stop after this many rounds of this invocation (tests: "kill" a run after step k).
    pub max_rounds_this_run: Option<u64>,
}

/// What a finished run reports.
#[derive(Debug, Clone)]
pub struct TrainOutcome {
    /// Optimizer steps done in total (including before a resume).
    pub steps: u64,
    pub last_checkpoint: Option<PathBuf>,
    /// The best checkpoint by `metric_for_best_model`, when the run has one.
    pub best_checkpoint: Option<PathBuf>,
    pub interrupted: bool,
    /// The last eval metrics, if any eval ran.
    pub last_eval: Option<Vec<(String, f64)>>,
}

/// Runs GRPO training as configured, in this process.
pub fn train(cfg: &TrainConfig, ctl: &RunControl) -> Result<TrainOutcome> {
    // The world: this process, or every rank of an MPI launch.
    let world = world::from_launcher()?;
    let w = world.as_world();
    // A rank's threads default to the cores the launcher bound it to.
    let threads = cfg.run.threads.or_else(|| {
        (w.size() > 1).then(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
    });
    if let Some(n) = threads {
        if let Err(e) = crate::threads::set_global_threads(n) {
            tracing::warn!("threads: {e}");
        }
    }
    let out = crate::threads::on_pool(|| match cfg.run.policy {
        PolicyType::CausalLm => run::<CausalLmPolicy>(cfg, ctl, w),
        PolicyType::FillIn => run::<FillInPolicy>(cfg, ctl, w),
    });
    if let (Err(e), true) = (&out, w.size() > 1) {
        // One rank failing ends the job, naming itself, instead of leaving the others waiting.
        eprintln!("error: grpo rank {} of {}: {e}", w.rank(), w.size());
        world.abort_job(1);
    }
    out
}

fn run<P: LoadPolicy>(
    cfg: &TrainConfig,
    ctl: &RunControl,
    world: &dyn World,
) -> Result<TrainOutcome> {
    let mut r = Run::<P>::start(cfg, ctl.resume, world)?;
    let main = world.is_main();
    let (p, g) = (r.p, r.g);
    let total_steps = r.schedule.total_steps;
    let bar = progress_bar(total_steps, r.state.step);
    let mut last_ckpt = r.resumed_from.clone();
    let mut last_eval = None;
    let mut rounds_this_run = 0u64;
    let mut interrupted = false;
    let mut health = Health::new(HealthOptions::default());
    let evaluates = cfg.logging.eval_steps > 0 && !r.data.eval.is_empty();
    if evaluates && r.state.step == 0 {
        let ev = evaluate(&mut r, 0, world)?;
        let acc = ev
            .iter()
            .find(|(n, _)| n == names::EVAL_ACCURACY)
            .map_or(f64::NAN, |x| x.1);
        if main {
            say(
                &bar,
                format!("step    0  eval acc {acc:.3} (before training)"),
            );
        }
        r.metrics.log(0, &ev)?;
    }
    tracing::info!(
        "training: {total_steps} steps, {p} prompts x {g} completions per round, {} optimizer step(s) per round, output {}",
        r.updates_per_round,
        cfg.run.output_dir.display()
    );

    while r.state.step < total_steps {
        let t_round = Instant::now();
        // 1-3. Rollout with the current policy (rewards that allow it score each group on a
        //      second thread as soon as it has finished), old and reference log-probs, scores;
        //      with dynamic sampling, more prompts until P groups carry a signal.
        let sampled = round::sample_round(&mut r, world)?;
        let (episodes, old_logps, ref_logps) =
            (&sampled.episodes, &sampled.old_logps, &sampled.ref_logps);
        let p = episodes.len() / g;

        // 4. Rewards -> group-relative advantages (KL in the reward when so configured).
        let per_func: Vec<f32> = episodes
            .iter()
            .flat_map(|e| e.rewards.iter().copied())
            .collect();
        let kl_penalty = match (&cfg.loss.kl(), &old_logps, &ref_logps) {
            (KlMode::Reward { coef, .. }, Some(old), Some(refl)) => Some(kl_reward_penalty(
                old,
                refl,
                *coef,
                r.state.adaptive_kl.as_mut(),
            )),
            _ => None,
        };
        let adv = round_advantages(
            &per_func,
            &r.weights,
            kl_penalty.as_ref().map(|k| k.0.as_slice()),
            g,
            cfg.loss.multi_objective_aggregation,
            &r.adv_opts,
        )?;
        check_round_invariants(episodes, p, g, &adv.advantages, r.adv_opts.normalize_batch)?;
        let batch = TrainBatch::from_round(
            episodes,
            &adv.advantages,
            // This rank's groups (all of them in one process).
            &|e| sampled.own[e.group] && !(cfg.loss.drop_zero_std_groups && adv.zero_std[e.group]),
            cfg.loss.mask_truncated_completions,
            old_logps.as_deref().filter(|_| r.needs_old),
            ref_logps.as_deref().filter(|_| r.kl_needs_ref),
        );

        // 5. Update: optimizer steps over the batch, then (TRL) mix the policy into the reference.
        //    An infinite reward skips the round's update (a bad step, as a NaN loss is).
        let t0 = Instant::now();
        let counter = StepCounter {
            step: &mut r.state.step,
            consecutive_nonfinite: &mut r.state.consecutive_nonfinite,
            skipped_steps: &mut r.state.skipped_steps,
            adaptive_entropy: r.state.adaptive_entropy.as_mut(),
        };
        let steps = if let Some(why) = infinite_reward(episodes, &r.data.rewards) {
            skip_round(
                r.updates_per_round,
                &r.schedule,
                counter,
                &why,
                r.update.max_bad_steps,
            )?
        } else {
            if batch.rows.is_empty() {
                if main {
                    say(
                        &bar,
                        format!(
                            "step {}: every group had equal rewards; no update this round",
                            *counter.step + 1
                        ),
                    );
                }
                *counter.step = (*counter.step + r.updates_per_round).min(total_steps);
            }
            update_round(
                &r.policy,
                &mut r.opt,
                &batch,
                &r.update,
                &r.schedule,
                counter,
                world,
                &mut |s| bar.set_position(s),
            )?
        };
        bar.set_position(r.state.step);
        let t_update = t0.elapsed().as_secs_f64();
        trace_memory("update");
        r.state.round += 1;
        rounds_this_run += 1;
        if cfg.loss.sync_ref_model
            && r.state
                .step
                .is_multiple_of(cfg.loss.ref_model_sync_steps as u64)
        {
            r.reference
                .sync(&r.policy, cfg.loss.ref_model_mixup_alpha)?;
        }

        // 6. Log (and evaluate on the held-out prompts every eval_steps).
        let mut m = StepMetrics::of_round(
            episodes,
            metrics::RoundFacts {
                adv: &adv,
                rewards: metrics::reward_metrics(episodes, &r.data.rewards, &sampled.reward_secs),
                update: metrics::update_metrics(
                    &steps,
                    r.update.loss.beta,
                    cfg.loss.entropy_coef != 0.0 || cfg.loss.use_adaptive_entropy,
                ),
                kl_reward_seq_kl: kl_penalty.map(|k| k.1),
                kl_reward_coef: r.state.adaptive_kl.as_ref().map(|a| a.coef),
                times: RoundTimes {
                    generate: sampled.t_generate,
                    score: sampled.t_score,
                    reference: sampled.t_reference,
                    update: t_update,
                    step: t_round.elapsed().as_secs_f64(),
                },
                generated_tokens: sampled.generated_tokens,
                dynamic_sampling: r.dynamic_sampling.then_some(metrics::DynamicSampling {
                    groups_sampled: sampled.groups_sampled,
                    groups_dropped: sampled.groups_dropped,
                    groups_kept: p,
                }),
                epoch: r.state.order.epoch() as f64,
            },
        );
        if let Some(f) = &r.fill {
            m.policy = metrics::fill_in_metrics(&m, f, episodes, &r.data.rewards);
        }
        let at_end = r.state.step >= total_steps;
        if evaluates && (r.state.step.is_multiple_of(cfg.logging.eval_steps as u64) || at_end) {
            let t0 = Instant::now();
            let step = r.state.step;
            let ev = evaluate(&mut r, step, world)?;
            m.eval_seconds = Some(t0.elapsed().as_secs_f64());
            m.eval = ev.clone();
            last_eval = Some(ev);
        }
        m.skipped_steps = r.state.skipped_steps;
        let warnings = health.check(r.state.step, &m);
        m.health = warnings.iter().map(|w| w.kind.name()).collect();
        if world.is_main()
            && cfg.logging.logging_steps > 0
            && (r
                .state
                .step
                .is_multiple_of(cfg.logging.logging_steps as u64)
                || at_end)
        {
            r.metrics.log(r.state.step, &m.pairs())?;
            say(&bar, m.console_line(r.state.step));
        }
        for w in warnings.iter().filter(|_| world.is_main()) {
            say(&bar, format!("warning: {}", w.message));
            let row = json!({"step": w.step, "kind": w.kind.name(), "message": w.message});
            r.metrics.log_json("health.jsonl", &row)?;
        }
        let completions_due = r
            .state
            .round
            .is_multiple_of(cfg.logging.log_completions_steps.max(1) as u64)
            || r.state.round == 1;
        if world.is_main() && cfg.logging.log_completions && completions_due {
            log_completions(&mut r, episodes, &adv.rewards, &adv.advantages, &bar)?;
        }

        // 7. Checkpoint (every save_steps, at the end, and when asked to stop).
        // Any rank asked to stop (Slurm's SIGTERM): every rank stops after this round.
        let stop_now = world.any(ctl.stop.load(Ordering::SeqCst))?
            || ctl
                .max_rounds_this_run
                .is_some_and(|k| rounds_this_run >= k);
        if world.size() > 1 && (r.state.round.is_multiple_of(CHECKSUM_ROUNDS) || at_end) {
            check_same_parameters(&r.policy, world)?;
        }
        let periodic = cfg.logging.save_steps > 0
            && crossed(
                r.state.step,
                r.updates_per_round,
                cfg.logging.save_steps as u64,
            );
        if world.is_main() && (periodic || at_end || stop_now) {
            // metric_for_best_model: this checkpoint is the best when this round's eval is.
            let new_best = r.best.as_ref().and_then(|b| b.improved_by(&m, &r.state));
            let dir = r.save(new_best)?;
            say(&bar, format!("saved {}", dir.display()));
            last_ckpt = Some(dir);
        }
        if stop_now && !at_end {
            interrupted = true;
            break;
        }
    }
    bar.finish_and_clear();
    if world.is_main() {
        r.metrics.finish();
    }
    let best_checkpoint = r.state.best_model_checkpoint.as_ref().map(PathBuf::from);
    if let (Some(b), Some(dir)) = (&r.best, &best_checkpoint) {
        tracing::info!(
            "best checkpoint: {} ({} = {:.4} at step {})",
            dir.display(),
            b.metric,
            r.state.best_metric.unwrap_or(f64::NAN),
            r.state.best_global_step.unwrap_or(0)
        );
    }
    Ok(TrainOutcome {
        steps: r.state.step,
        last_checkpoint: last_ckpt,
        best_checkpoint,
        interrupted,
        last_eval,
    })
}

/// Why a round's rewards cannot train (a reward of +/-inf: a scorer's overflow), naming the
/// reward and the completion. NaN is a reward's "no score" (TRL's None) and is left out of the
/// group's statistics instead.
fn infinite_reward(episodes: &[Episode], rewards: &[Reward]) -> Option<String> {
    episodes.iter().enumerate().find_map(|(i, e)| {
        let j = e.rewards.iter().position(|x| x.is_infinite())?;
        let name = rewards.get(j).map_or("?", |r| r.name.as_str());
        Some(format!(
            "reward `{name}` is {} for completion {i} of the round",
            e.rewards[j]
        ))
    })
}

/// Rounds between the checks that every rank holds the same parameters.
const CHECKSUM_ROUNDS: u64 = 10;

/// Every rank's parameters must be the same after each update; a rank that drifted (a
/// non-deterministic reduction, a bad node) is an error naming it, not a silent divergence.
fn check_same_parameters<P: Policy>(policy: &P, world: &dyn World) -> Result<()> {
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
        .map(|b| f64::from_le_bytes(b.as_slice().try_into().unwrap_or([0; 8])))
        .collect();
    if let Some(r) = sums.iter().position(|&s| s.to_bits() != sums[0].to_bits()) {
        return Err(Error::Generate(format!(
            "rank {r}'s parameters differ from rank 0's (checksums {:e} and {:e}): the ranks \
             diverged; stopping",
            sums[r], sums[0]
        )));
    }
    Ok(())
}

/// Evaluation on the held-out prompts as the config's `eval_*` keys say (see [`crate::eval`]):
/// pass@k, sampled and greedy accuracy, mean rewards. Every answer goes to `eval/step-N.jsonl`.
/// Across ranks the prompts are shared out and the answers gathered; rank 0 writes them.
fn evaluate<P: Policy>(r: &mut Run<P>, step: u64, world: &dyn World) -> Result<Vec<(String, f64)>> {
    let model = r.policy.freeze(r.cfg.update.gradient_checkpointing)?;
    let opts = r.cfg.eval_options(r.sampling.eos_token_ids.clone());
    let file = format!("eval/step-{step}.jsonl");
    let metrics = &mut r.metrics;
    let mut log = |row: &serde_json::Value| metrics.log_json(&file, row);
    let gather = |b: Vec<u8>| world.all_gather_bytes(b);
    let shard = (world.size() > 1).then_some(crate::eval::EvalShard {
        rank: world.rank(),
        size: world.size(),
        gather: &gather,
    });
    let report = crate::eval::evaluate_sharded(
        &model,
        &r.tok,
        &r.data.eval,
        &r.data.rewards,
        &opts,
        world
            .is_main()
            .then_some(&mut log as crate::eval::RowSink<'_>),
        shard,
    )?;
    Ok(report.metrics)
}

/// Every completion of the round to `completions.jsonl`, and a few on the console.
fn log_completions<P: Policy>(
    r: &mut Run<P>,
    episodes: &[Episode],
    rewards: &[f32],
    advantages: &[f32],
    bar: &indicatif::ProgressBar,
) -> Result<()> {
    for (i, e) in episodes.iter().enumerate() {
        r.metrics.log_json(
            "completions.jsonl",
            &json!({
                "step": r.state.step,
                "prompt": prompt_shown(r, e)?,
                "completion": e.text,
                "stop_reason": e.stop_reason,
                "rewards": Reward::named_scores(&r.data.rewards, &e.rewards),
                "reward": rewards[i],
                "advantage": advantages[i],
            }),
        )?;
    }
    for e in episodes
        .iter()
        .step_by(r.g)
        .take(r.cfg.logging.num_completions_to_print)
    {
        say(
            bar,
            format!(
                "  sample: {:?} -> {:?} (rewards {:?})",
                prompt_shown(r, e)?.chars().take(80).collect::<String>(),
                e.text.chars().take(120).collect::<String>(),
                e.rewards
            ),
        );
    }
    Ok(())
}

/// The prompt of an episode as logs show it: a fill-in input with its masks written out, else
/// the dataset's prompt.
fn prompt_shown<P: Policy>(r: &Run<P>, e: &Episode) -> Result<String> {
    match &r.fill {
        Some(f) => f.display(&r.tok, &e.prompt_ids),
        None => Ok(data::prompt_text(&r.data.train[e.example])),
    }
}

fn progress_bar(total_steps: u64, step: u64) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(total_steps);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:30} {pos}/{len} steps  {elapsed_precise} < {eta_precise}  {msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_position(step);
    bar
}

/// A console line above the progress bar (plain stderr when there is no terminal).
fn say(bar: &indicatif::ProgressBar, line: impl AsRef<str>) {
    if bar.is_hidden() {
        eprintln!("{}", line.as_ref());
    } else {
        bar.println(line.as_ref());
    }
}

/// Current and peak RSS at `phase`, at debug level (`--log-level debug`).
fn trace_memory(phase: &str) {
    if let Some((cur, peak)) = crate::threads::rss_gb() {
        tracing::debug!("memory after {phase}: rss {cur:.2} GB, peak {peak:.2} GB");
    }
}

/// Whether the optimizer steps of the round just done crossed a multiple of `every`.
fn crossed(step: u64, per_round: u64, every: u64) -> bool {
    let before = step.saturating_sub(per_round);
    step / every > before / every
}

/// Per-round invariants, reported as errors: P x G completions, each group from one prompt,
/// normalized groups' advantages summing to about 0 (unless re-normalized over the batch).
fn check_round_invariants(
    episodes: &[Episode],
    p: usize,
    g: usize,
    advantages: &[f32],
    normalize_batch: bool,
) -> Result<()> {
    if episodes.len() != p * g || advantages.len() != p * g {
        return Err(Error::Generate(format!(
            "invariant: {} completions and {} advantages for {p} prompts x {g}",
            episodes.len(),
            advantages.len()
        )));
    }
    for (gi, group) in episodes.chunks(g).enumerate() {
        if group
            .iter()
            .any(|e| e.group != gi || e.prompt_ids != group[0].prompt_ids)
        {
            return Err(Error::Generate(format!(
                "invariant: group {gi} mixes prompts"
            )));
        }
    }
    if !normalize_batch {
        for (gi, a) in advantages.chunks(g).enumerate() {
            let s: f32 = a.iter().sum();
            let scale: f32 = a.iter().map(|x| x.abs()).sum::<f32>().max(1.0);
            // Missing rewards (advantage 0, excluded from the mean) keep the sum at 0 too. The
            // bound allows f32 rounding of the group mean divided by a near-zero std (rewards
            // that tie up to float noise, e.g. a judge's scores of identical fills).
            if s.abs() > 1e-2 * scale {
                return Err(Error::Generate(format!(
                    "invariant: advantages of group {gi} sum to {s}, not 0"
                )));
            }
        }
    }
    Ok(())
}
