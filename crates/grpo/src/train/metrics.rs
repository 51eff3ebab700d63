//! What one round logs, typed: [`StepMetrics`] is computed once from the round's episodes,
//! advantages and update statistics, and everything reads it: `metrics.jsonl` and TensorBoard
//! (through [`StepMetrics::pairs`]), the console line, and (by the names in [`names`]) the report.

use super::policy::Policy;
use super::round::{RoundBatch, RoundTimes, Scored};
use super::setup::Run;
use crate::advantages::nan_std;
use crate::rewards::Reward;
use crate::rollout::Episode;

use super::update::StepStats;

/// Every metric name the trainer writes, defined once. Per-reward metrics are
/// `rewards/<name>/{mean,std,missing}`, `time/reward/<name>` and `scorer/<name>/<what>`;
/// evaluation metrics start with `eval/` (see [`crate::eval`]).
pub mod names {
    pub const REWARD: &str = "reward";
    pub const REWARD_STD: &str = "reward_std";
    pub const FRAC_REWARD_ZERO_STD: &str = "frac_reward_zero_std";
    pub const ADVANTAGE_MEAN: &str = "advantage_mean";
    pub const ADVANTAGE_STD: &str = "advantage_std";
    pub const MEAN_LENGTH: &str = "completions/mean_length";
    pub const MIN_LENGTH: &str = "completions/min_length";
    pub const MAX_LENGTH: &str = "completions/max_length";
    pub const CLIPPED_RATIO: &str = "completions/clipped_ratio";
    pub const GROUPS_SAMPLED: &str = "dynamic_sampling/groups_sampled";
    pub const GROUPS_DROPPED: &str = "dynamic_sampling/groups_dropped";
    pub const GROUPS_KEPT: &str = "dynamic_sampling/groups_kept";
    pub const LOSS: &str = "loss";
    pub const PG_LOSS: &str = "pg_loss";
    pub const KL: &str = "kl";
    pub const KL_PENALTY: &str = "kl_penalty";
    pub const ENTROPY: &str = "entropy";
    pub const MEAN_LOG_PROB: &str = "mean_log_prob";
    pub const CLIP_LOW: &str = "clip_ratio/low_mean";
    pub const CLIP_HIGH: &str = "clip_ratio/high_mean";
    pub const CLIP_REGION: &str = "clip_ratio/region_mean";
    pub const GRAD_NORM: &str = "grad_norm";
    pub const LEARNING_RATE: &str = "learning_rate";
    /// The entropy bonus's coefficient after the round (TRL's name; adaptive control moves it).
    pub const ENTROPY_COEF: &str = "entropy_coef";
    pub const KL_REWARD_SEQ_KL: &str = "kl_reward/seq_kl";
    pub const KL_REWARD_COEF: &str = "kl_reward/coef";
    /// The round's sampling temperature, logged while `temperature_warmup_steps` moves it.
    pub const TEMPERATURE: &str = "sampling/temperature";
    pub const TIME_GENERATE: &str = "time/generate";
    pub const TIME_SCORE: &str = "time/score";
    pub const TIME_REFERENCE: &str = "time/reference";
    pub const TIME_UPDATE: &str = "time/update";
    pub const TIME_STEP: &str = "time/step";
    pub const TIME_EVAL: &str = "time/eval";
    /// The update's model FLOPs ([`crate::flops`]) per second of `time/update`, in TFLOP/s, on
    /// this rank's device.
    pub const TIME_UPDATE_TFLOPS: &str = "time/update_tflops";
    /// `time/update_tflops` as a share of the card's dense bf16 rate (bf16 runs on a card grpo
    /// knows: `grpo_models::kernels::bf16_peak_tflops_of`).
    pub const TIME_UPDATE_MFU: &str = "time/update_mfu";
    pub const TOKENS_PER_SECOND: &str = "tokens_per_second";
    pub const EPOCH: &str = "epoch";
    pub const RSS_PEAK_GB: &str = "memory/rss_peak_gb";
    pub const RSS_GB: &str = "memory/rss_gb";
    pub const OPEN_FDS: &str = "memory/open_fds";
    pub const CHILD_PROCESSES: &str = "memory/child_processes";
    /// Across ranks: the largest of the ranks' peak resident memory, in GB.
    pub const RSS_PEAK_GB_MAX_RANK: &str = "memory/rss_peak_gb_max_rank";
    /// Across ranks: the AdamW moments the main rank keeps (`zero_stage` shards them), in GB.
    pub const OPTIMIZER_STATE_GB: &str = "memory/optimizer_state_gb";
    /// Across ranks: the f32 trainable parameters the main rank keeps between steps
    /// (`zero_stage = 3` shards them), in GB.
    pub const PARAMETERS_GB: &str = "memory/parameters_gb";
    /// Optimizer steps skipped so far because a number was not finite (the run's total).
    pub const SKIPPED_STEPS: &str = "skipped_steps";
    /// The parts of a step, as `time/<part>`.
    pub const TIME_PARTS: [&str; 4] = ["generate", "score", "reference", "update"];
    pub const EVAL_PREFIX: &str = "eval/";
    pub const EVAL_ACCURACY: &str = "eval/accuracy";
    pub const EVAL_MEAN_ACCURACY: &str = "eval/mean_accuracy";
    pub const EVAL_PASS_AT: &str = "eval/pass@";
    pub const EVAL_REWARD_PREFIX: &str = "eval/reward/";

    pub fn reward_mean(name: &str) -> String {
        format!("rewards/{name}/mean")
    }
    pub fn reward_std(name: &str) -> String {
        format!("rewards/{name}/std")
    }
    pub fn reward_missing(name: &str) -> String {
        format!("rewards/{name}/missing")
    }
    pub fn reward_time(name: &str) -> String {
        format!("time/reward/{name}")
    }
    /// A health warning that started at this step (see [`crate::train::HealthKind`]).
    pub fn health(kind: &str) -> String {
        format!("health/{kind}")
    }
    pub fn scorer(name: &str, what: &str) -> String {
        format!("scorer/{name}/{what}")
    }
}

/// One reward function's statistics over a round.
#[derive(Debug, Clone, PartialEq)]
pub struct RewardMetrics {
    pub name: String,
    /// Mean and std of its finite scores.
    pub mean: f64,
    pub std: f64,
    /// Completions it did not score.
    pub missing: f64,
    /// Seconds it spent scoring.
    pub seconds: f64,
    /// A scorer program's running totals since it started: timeouts, crashes, garbage,
    /// http_errors, restarts.
    pub scorer: Option<[(&'static str, f64); 5]>,
}

/// The update's statistics, averaged over the round's optimizer steps.
#[derive(Debug, Clone, PartialEq)]
pub struct UpdateMetrics {
    pub loss: f64,
    pub pg_loss: f64,
    pub kl: f64,
    /// `beta x kl`.
    pub kl_penalty: f64,
    pub entropy: f64,
    pub mean_log_prob: f64,
    pub clip_low: f64,
    pub clip_high: f64,
    pub clip_region: f64,
    pub grad_norm: f64,
    /// At the last step.
    pub learning_rate: f64,
    /// After the last step, when an entropy bonus is on.
    pub entropy_coef: Option<f64>,
    /// Model FLOPs of this rank's passes, summed over the steps.
    pub flops: f64,
}

/// Dynamic sampling's groups in a round.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct DynamicSampling {
    pub groups_sampled: usize,
    /// Groups whose rewards all equal, left out.
    pub groups_dropped: usize,
    pub groups_kept: usize,
}

/// Everything a round logs.
#[derive(Debug, Clone, PartialEq)]
pub struct StepMetrics {
    pub reward: f64,
    pub reward_std: f64,
    pub rewards: Vec<RewardMetrics>,
    pub frac_reward_zero_std: f64,
    pub advantage_mean: f64,
    pub advantage_std: f64,
    pub mean_length: f64,
    pub min_length: f64,
    pub max_length: f64,
    pub clipped_ratio: f64,
    /// With dynamic sampling.
    pub dynamic_sampling: Option<DynamicSampling>,
    /// None when the round made no optimizer step.
    pub update: Option<UpdateMetrics>,
    /// KL in the reward: the round's mean sequence KL, and the adaptive coefficient.
    pub kl_reward_seq_kl: Option<f64>,
    pub kl_reward_coef: Option<f64>,
    /// The round's sampling temperature, with a temperature warm-up.
    pub temperature: Option<f64>,
    pub times: RoundTimes,
    /// The card's dense bf16 rate in TFLOP/s, in a bf16 run on a card grpo knows (for
    /// `time/update_mfu`).
    pub peak_tflops: Option<f64>,
    pub tokens_per_second: f64,
    pub epoch: f64,
    /// Memory, open files and child processes after the round.
    pub resources: Option<grpo_models::threads::ProcessResources>,
    /// Across ranks: the memory of the world (set by the caller, which holds the world).
    pub world_memory: Option<WorldMemory>,
    /// Optimizer steps skipped so far for non-finite numbers (the run's total).
    pub skipped_steps: u64,
    /// Seconds of the evaluation after this round, and its metrics (`eval/...`).
    pub eval_seconds: Option<f64>,
    pub eval: Vec<(String, f64)>,
    /// Metrics of the policy kind: a fill-in run's `fill/*` and the fill-in seed's names.
    pub policy: Vec<(String, f64)>,
    /// Kinds of the health warnings that started this round (`health/<kind>` = 1 in the
    /// metrics; see [`crate::train::HealthKind::name`]).
    pub health: Vec<&'static str>,
}

/// Memory across the ranks of a run, in GB.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WorldMemory {
    /// The largest of the ranks' peak resident sets so far.
    pub rss_peak_gb_max_rank: f64,
    /// The AdamW moments the main rank keeps.
    pub optimizer_state_gb: f64,
    /// The trainable parameters the main rank keeps between steps.
    pub parameters_gb: f64,
}

/// Mean of `xs` (0 when empty).
pub fn mean(xs: impl IntoIterator<Item = f64>) -> f64 {
    let (s, n) = xs
        .into_iter()
        .fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    if n == 0 {
        0.0
    } else {
        s / n as f64
    }
}

/// The reward functions' statistics over `episodes` (`seconds[k]` spent by reward k).
pub fn reward_metrics(
    episodes: &[Episode],
    rewards: &[Reward],
    seconds: &[f64],
) -> Vec<RewardMetrics> {
    rewards
        .iter()
        .enumerate()
        .map(|(k, r)| {
            let vals: Vec<f64> = episodes
                .iter()
                .map(|e| e.rewards[k] as f64)
                .filter(|x| x.is_finite())
                .collect();
            let v32: Vec<f32> = episodes.iter().map(|e| e.rewards[k]).collect();
            RewardMetrics {
                name: r.name.clone(),
                mean: mean(vals.iter().copied()),
                std: nan_std(&v32) as f64,
                missing: (episodes.len() - vals.len()) as f64,
                seconds: seconds[k],
                scorer: r.scorer_stats().map(|st| {
                    [
                        ("timeouts", st.timeout as f64),
                        ("crashes", st.crash as f64),
                        ("garbage", (st.garbage + st.garbage_lines) as f64),
                        ("http_errors", st.http_error as f64),
                        ("restarts", st.restarts as f64),
                    ]
                }),
            }
        })
        .collect()
}

/// The round's update statistics, averaged over its optimizer steps (None without a step).
pub fn update_metrics(
    steps: &[StepStats],
    beta: f64,
    entropy_bonus: bool,
) -> Option<UpdateMetrics> {
    if steps.is_empty() {
        return None;
    }
    let avg = |f: &dyn Fn(&StepStats) -> f64| mean(steps.iter().map(f));
    Some(UpdateMetrics {
        loss: avg(&|s| s.loss),
        pg_loss: avg(&|s| s.policy_loss),
        kl: avg(&|s| s.kl),
        kl_penalty: beta * avg(&|s| s.kl),
        entropy: avg(&|s| s.entropy),
        mean_log_prob: avg(&|s| s.mean_logp),
        clip_low: avg(&|s| s.clip_low),
        clip_high: avg(&|s| s.clip_high),
        clip_region: avg(&|s| s.clip_region),
        grad_norm: avg(&|s| s.grad_norm),
        learning_rate: steps.last().map_or(0.0, |s| s.lr),
        entropy_coef: steps
            .last()
            .filter(|_| entropy_bonus)
            .map(|s| s.entropy_coef),
        flops: steps.iter().map(|s| s.flops).sum(),
    })
}

impl StepMetrics {
    /// The metrics of a round: what it sampled and scored (with its times), its advantages, its
    /// optimizer steps, and the metrics of the policy kind.
    pub fn of_round<P: Policy>(
        r: &Run<P>,
        round: &Scored,
        batch: &RoundBatch,
        steps: &[StepStats],
    ) -> StepMetrics {
        let (episodes, adv, cfg) = (&round.episodes, &batch.adv, r.cfg);
        let lens: Vec<f64> = episodes.iter().map(|e| e.sampled_tokens() as f64).collect();
        let finite_rewards = adv
            .rewards
            .iter()
            .filter(|r| r.is_finite())
            .map(|&r| r as f64);
        let mut m = StepMetrics {
            reward: mean(finite_rewards),
            reward_std: nan_std(&adv.rewards) as f64,
            rewards: reward_metrics(episodes, &r.data.rewards, &round.reward_secs),
            frac_reward_zero_std: adv.frac_zero_std() as f64,
            advantage_mean: mean(adv.advantages.iter().map(|&a| a as f64)),
            advantage_std: nan_std(&adv.advantages) as f64,
            mean_length: mean(lens.iter().copied()),
            min_length: lens.iter().cloned().fold(f64::INFINITY, f64::min),
            max_length: lens.iter().cloned().fold(0.0, f64::max),
            clipped_ratio: episodes.iter().filter(|e| e.truncated()).count() as f64
                / episodes.len() as f64,
            dynamic_sampling: r.opts.dynamic_sampling.then_some(DynamicSampling {
                groups_sampled: round.groups_sampled,
                groups_dropped: round.groups_dropped,
                groups_kept: episodes.len() / r.opts.g,
            }),
            update: update_metrics(
                steps,
                r.opts.update.loss.beta,
                cfg.loss.entropy_coef != 0.0 || cfg.loss.adaptive_entropy().is_some(),
            ),
            kl_reward_seq_kl: batch.kl_reward_seq_kl,
            kl_reward_coef: r.state.adaptive_kl.as_ref().map(|a| a.coef),
            temperature: (cfg.generation.temperature_warmup_steps > 0)
                .then_some(r.opts.sampling.temperature),
            times: round.times,
            peak_tflops: match cfg.run.dtype == crate::config::DTypeOpt::Bf16 {
                true => grpo_models::kernels::bf16_peak_tflops(&super::policy_device(&r.policy)),
                false => None,
            },
            tokens_per_second: round.generated_tokens as f64 / round.times.step.max(1e-9),
            epoch: r.state.order.epoch() as f64,
            resources: grpo_models::threads::process_resources(),
            world_memory: None,
            skipped_steps: r.state.skipped_steps,
            eval_seconds: None,
            eval: vec![],
            policy: vec![],
            health: vec![],
        };
        m.policy = r.policy.round_metrics(&m, episodes, &r.data.rewards);
        m.policy.extend(crate::agents::round_metrics(episodes));
        m
    }

    /// Every metric as (name, value), as `metrics.jsonl` and TensorBoard get them.
    pub fn pairs(&self) -> Vec<(String, f64)> {
        use names::*;
        let mut m: Vec<(String, f64)> = Vec::new();
        let mut push = |k: &str, v: f64| m.push((k.to_string(), v));
        push(REWARD, self.reward);
        push(REWARD_STD, self.reward_std);
        for r in &self.rewards {
            push(&reward_mean(&r.name), r.mean);
            push(&reward_std(&r.name), r.std);
            push(&reward_missing(&r.name), r.missing);
            push(&reward_time(&r.name), r.seconds);
            for (what, n) in r.scorer.iter().flatten() {
                push(&scorer(&r.name, what), *n);
            }
        }
        push(FRAC_REWARD_ZERO_STD, self.frac_reward_zero_std);
        push(ADVANTAGE_MEAN, self.advantage_mean);
        push(ADVANTAGE_STD, self.advantage_std);
        push(MEAN_LENGTH, self.mean_length);
        push(MIN_LENGTH, self.min_length);
        push(MAX_LENGTH, self.max_length);
        push(CLIPPED_RATIO, self.clipped_ratio);
        if let Some(d) = &self.dynamic_sampling {
            push(GROUPS_SAMPLED, d.groups_sampled as f64);
            push(GROUPS_DROPPED, d.groups_dropped as f64);
            push(GROUPS_KEPT, d.groups_kept as f64);
        }
        if let Some(u) = &self.update {
            push(LOSS, u.loss);
            push(PG_LOSS, u.pg_loss);
            push(KL, u.kl);
            push(KL_PENALTY, u.kl_penalty);
            push(ENTROPY, u.entropy);
            push(MEAN_LOG_PROB, u.mean_log_prob);
            push(CLIP_LOW, u.clip_low);
            push(CLIP_HIGH, u.clip_high);
            push(CLIP_REGION, u.clip_region);
            push(GRAD_NORM, u.grad_norm);
            push(LEARNING_RATE, u.learning_rate);
            if let Some(c) = u.entropy_coef {
                push(ENTROPY_COEF, c);
            }
        }
        if let Some(k) = self.kl_reward_seq_kl {
            push(KL_REWARD_SEQ_KL, k);
        }
        if let Some(c) = self.kl_reward_coef {
            push(KL_REWARD_COEF, c);
        }
        if let Some(t) = self.temperature {
            push(TEMPERATURE, t);
        }
        push(TIME_GENERATE, self.times.generate);
        push(TIME_SCORE, self.times.score);
        push(TIME_REFERENCE, self.times.reference);
        push(TIME_UPDATE, self.times.update);
        push(TIME_STEP, self.times.step);
        let flops = self.update.as_ref().map_or(0.0, |u| u.flops);
        if let Some((tflops, mfu)) =
            crate::flops::throughput(flops, self.times.update, self.peak_tflops)
        {
            push(TIME_UPDATE_TFLOPS, tflops);
            if let Some(mfu) = mfu {
                push(TIME_UPDATE_MFU, mfu);
            }
        }
        push(TOKENS_PER_SECOND, self.tokens_per_second);
        push(EPOCH, self.epoch);
        if let Some(r) = self.resources {
            push(RSS_PEAK_GB, r.rss_peak_gb);
            push(RSS_GB, r.rss_gb);
            push(OPEN_FDS, r.open_fds as f64);
            push(CHILD_PROCESSES, r.child_processes as f64);
        }
        if let Some(w) = self.world_memory {
            push(RSS_PEAK_GB_MAX_RANK, w.rss_peak_gb_max_rank);
            push(OPTIMIZER_STATE_GB, w.optimizer_state_gb);
            push(PARAMETERS_GB, w.parameters_gb);
        }
        push(SKIPPED_STEPS, self.skipped_steps as f64);
        if let Some(s) = self.eval_seconds {
            push(TIME_EVAL, s);
        }
        m.extend(self.eval.iter().cloned());
        m.extend(self.policy.iter().cloned());
        for kind in &self.health {
            m.push((health(kind), 1.0));
        }
        m
    }

    /// The eval accuracy of this round, when it was evaluated.
    pub fn eval_accuracy(&self) -> Option<f64> {
        self.eval
            .iter()
            .find(|(n, _)| n == names::EVAL_ACCURACY)
            .map(|x| x.1)
    }

    /// The console line of a logged round.
    pub fn console_line(&self, step: u64) -> String {
        let u = self.update.as_ref();
        let t = &self.times;
        let mut line = format!(
            "step {:>4}  reward {:.3}  loss {:+.4}  kl {:.4}  len {:.1}  grad {:.3}  {:.1}s (gen {:.1} ref {:.1} upd {:.1})",
            step,
            self.reward,
            u.map_or(f64::NAN, |u| u.loss),
            u.map_or(f64::NAN, |u| u.kl),
            self.mean_length,
            u.map_or(f64::NAN, |u| u.grad_norm),
            t.step,
            t.generate,
            t.reference,
            t.update
        );
        if let Some(a) = self.eval_accuracy() {
            line.push_str(&format!("  eval acc {a:.3}"));
        }
        line
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics() -> StepMetrics {
        StepMetrics {
            reward: 0.5,
            reward_std: 0.25,
            rewards: vec![RewardMetrics {
                name: "correct".into(),
                mean: 0.5,
                std: 0.5,
                missing: 0.0,
                seconds: 0.01,
                scorer: None,
            }],
            frac_reward_zero_std: 0.0,
            advantage_mean: 0.0,
            advantage_std: 1.0,
            mean_length: 10.0,
            min_length: 4.0,
            max_length: 16.0,
            clipped_ratio: 0.125,
            dynamic_sampling: None,
            update: update_metrics(
                &[StepStats {
                    loss: 0.1,
                    kl: 0.02,
                    grad_norm: 0.5,
                    lr: 1e-5,
                    finite: true,
                    flops: 3e12,
                    ..Default::default()
                }],
                0.04,
                false,
            ),
            kl_reward_seq_kl: None,
            kl_reward_coef: None,
            temperature: None,
            times: RoundTimes {
                step: 2.0,
                update: 0.5,
                ..Default::default()
            },
            peak_tflops: Some(60.0),
            tokens_per_second: 100.0,
            epoch: 0.0,
            resources: None,
            world_memory: Some(WorldMemory {
                rss_peak_gb_max_rank: 1.5,
                optimizer_state_gb: 0.25,
                parameters_gb: 0.125,
            }),
            skipped_steps: 0,
            eval_seconds: Some(1.0),
            eval: vec![(names::EVAL_ACCURACY.into(), 0.75)],
            policy: vec![],
            health: vec![],
        }
    }

    #[test]
    fn pairs_name_every_metric_once() {
        let p = metrics().pairs();
        let get = |k: &str| p.iter().find(|(n, _)| n == k).map(|x| x.1);
        assert_eq!(get(names::REWARD), Some(0.5));
        assert_eq!(get("rewards/correct/mean"), Some(0.5));
        assert_eq!(get(names::KL_PENALTY), Some(0.04 * 0.02));
        assert_eq!(get(names::LEARNING_RATE), Some(1e-5));
        assert_eq!(get(names::TIME_EVAL), Some(1.0));
        assert_eq!(get(names::EVAL_ACCURACY), Some(0.75));
        assert_eq!(get(names::KL_REWARD_COEF), None);
        assert_eq!(get(names::RSS_PEAK_GB_MAX_RANK), Some(1.5));
        assert_eq!(get(names::OPTIMIZER_STATE_GB), Some(0.25));
        // 3e12 FLOPs in 0.5 s: 6 TFLOP/s, a tenth of a 60 TFLOP/s card.
        assert_eq!(get(names::TIME_UPDATE_TFLOPS), Some(6.0));
        assert_eq!(get(names::TIME_UPDATE_MFU), Some(0.1));
        let mut m = metrics();
        m.peak_tflops = None;
        let p = m.pairs();
        let get = |k: &str| p.iter().find(|(n, _)| n == k).map(|x| x.1);
        assert_eq!(get(names::TIME_UPDATE_TFLOPS), Some(6.0));
        assert_eq!(get(names::TIME_UPDATE_MFU), None);
        let p = metrics().pairs();
        let mut keys: Vec<&str> = p.iter().map(|(k, _)| k.as_str()).collect();
        keys.sort_unstable();
        let n = keys.len();
        keys.dedup();
        assert_eq!(keys.len(), n, "a metric is written twice");
    }

    #[test]
    fn console_line_shows_the_headline_numbers() {
        let line = metrics().console_line(7);
        assert!(
            line.starts_with("step    7  reward 0.500  loss +0.1000  kl 0.0200"),
            "{line}"
        );
        assert!(line.ends_with("eval acc 0.750"), "{line}");
        let mut m = metrics();
        m.update = None;
        m.eval.clear();
        assert!(
            m.console_line(1).contains("loss NaN"),
            "{}",
            m.console_line(1)
        );
    }
}
