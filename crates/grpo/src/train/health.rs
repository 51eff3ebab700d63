//! Health checks that speak up: each round's [`StepMetrics`] are watched for the ways a GRPO run
//! quietly stops learning or starts to drift (entropy collapse, groups without signal, KL or
//! gradient-norm spikes, held-out accuracy falling from its best). A check warns once when its
//! condition starts and again only after it has cleared; every warning names the likely fix.

use std::collections::VecDeque;

use super::metrics::StepMetrics;

/// When the checks fire.
#[derive(Debug, Clone, PartialEq)]
pub struct HealthOptions {
    /// Entropy (nats per token) below which sampling has collapsed.
    pub entropy_floor: f64,
    /// Mean share of groups with equal rewards (no advantage) over the last `zero_std_rounds`
    /// rounds that counts as "most".
    pub zero_std_share: f64,
    pub zero_std_rounds: usize,
    /// A KL or gradient norm this many times its recent median is a spike.
    pub spike_factor: f64,
    /// Rounds of history the median is taken over (and needed before spikes are judged).
    pub spike_window: usize,
    /// Held-out accuracy this far below its best is a fall.
    pub accuracy_drop: f64,
    /// A condition that cleared and came back warns again only this many rounds after its last
    /// warning (a value hovering at a threshold would otherwise warn every few rounds).
    pub rewarn_after: u64,
}

impl Default for HealthOptions {
    fn default() -> Self {
        HealthOptions {
            entropy_floor: 0.05,
            zero_std_share: 0.6,
            zero_std_rounds: 10,
            spike_factor: 5.0,
            spike_window: 10,
            accuracy_drop: 0.1,
            rewarn_after: 20,
        }
    }
}

/// What went wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum HealthKind {
    LowEntropy,
    NoSignal,
    KlSpike,
    GradSpike,
    AccuracyFall,
    /// Agents: no episode of the round called a tool.
    NoToolCalls,
    /// Agents: every tool call of the round failed.
    ToolsFailing,
}

impl HealthKind {
    /// The metric-style name (`health/<name>`).
    pub fn name(self) -> &'static str {
        match self {
            HealthKind::LowEntropy => "low_entropy",
            HealthKind::NoSignal => "no_signal",
            HealthKind::KlSpike => "kl_spike",
            HealthKind::GradSpike => "grad_norm_spike",
            HealthKind::AccuracyFall => "accuracy_fall",
            HealthKind::NoToolCalls => "no_tool_calls",
            HealthKind::ToolsFailing => "tools_failing",
        }
    }
}

/// One warning: what, at which step, and what to do about it.
#[derive(Debug, Clone, PartialEq)]
pub struct HealthWarning {
    pub kind: HealthKind,
    pub step: u64,
    pub message: String,
}

/// Watches a run's rounds.
#[derive(Debug, Clone)]
pub struct Health {
    opts: HealthOptions,
    /// Conditions that have warned and not cleared since.
    active: Vec<HealthKind>,
    /// The step each kind last warned at.
    last_warned: Vec<(HealthKind, u64)>,
    zero_std: VecDeque<f64>,
    kls: VecDeque<f64>,
    grad_norms: VecDeque<f64>,
    /// Best held-out accuracy so far, and its step.
    best: Option<(f64, u64)>,
}

/// Median of the finite values (None when there are none).
fn median(xs: &VecDeque<f64>) -> Option<f64> {
    let mut v: Vec<f64> = xs.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

impl Health {
    pub fn new(opts: HealthOptions) -> Self {
        Health {
            opts,
            active: vec![],
            last_warned: vec![],
            zero_std: VecDeque::new(),
            kls: VecDeque::new(),
            grad_norms: VecDeque::new(),
            best: None,
        }
    }

    /// The warnings that start at this round (the conditions that held before and still hold
    /// stay quiet).
    pub fn check(&mut self, step: u64, m: &StepMetrics) -> Vec<HealthWarning> {
        let o = self.opts.clone();
        let mut now: Vec<(HealthKind, String)> = vec![];
        if let Some(u) = &m.update {
            if u.entropy.is_finite() && u.entropy < o.entropy_floor {
                now.push((
                    HealthKind::LowEntropy,
                    format!(
                        "entropy {:.3} is below {:.2}: sampling has collapsed onto few answers and most groups will carry no signal; \
                         try entropy_coef (e.g. 0.001), epsilon_high (clip-higher, e.g. 0.28), a higher temperature, or num_generations",
                        u.entropy, o.entropy_floor
                    ),
                ));
            }
        }
        self.zero_std.push_back(m.frac_reward_zero_std);
        if self.zero_std.len() > o.zero_std_rounds {
            self.zero_std.pop_front();
        }
        let share = self.zero_std.iter().sum::<f64>() / self.zero_std.len() as f64;
        if self.zero_std.len() == o.zero_std_rounds && share >= o.zero_std_share {
            now.push((
                HealthKind::NoSignal,
                format!(
                    "{:.0}% of groups were all-equal (no advantage, no learning) over the last {} rounds: \
                     try dynamic_sampling, larger num_generations, or harder prompts",
                    share * 100.0,
                    o.zero_std_rounds
                ),
            ));
        }
        if let Some(u) = &m.update {
            for (kind, value, history, what, fix) in [
                (
                    HealthKind::KlSpike,
                    u.kl,
                    &mut self.kls,
                    "KL to the reference",
                    "lower learning_rate, raise beta, or clip tighter (epsilon)",
                ),
                (
                    HealthKind::GradSpike,
                    u.grad_norm,
                    &mut self.grad_norms,
                    "gradient norm",
                    "lower learning_rate or max_grad_norm",
                ),
            ] {
                let spike = history.len() >= o.spike_window
                    && median(history).is_some_and(|med| {
                        med > 0.0 && value.is_finite() && value > o.spike_factor * med
                    });
                if spike {
                    now.push((
                        kind,
                        format!(
                            "{what} {value:.4} is {:.1}x its median over the last {} rounds: the policy may be drifting; {fix}",
                            value / median(history).unwrap_or(1.0),
                            history.len()
                        ),
                    ));
                }
                history.push_back(value);
                if history.len() > o.spike_window {
                    history.pop_front();
                }
            }
        }
        now.extend(agent_checks(m));
        if let Some(acc) = m.eval_accuracy().filter(|a| a.is_finite()) {
            match self.best {
                Some((best, at)) if acc < best - o.accuracy_drop => now.push((
                    HealthKind::AccuracyFall,
                    format!(
                        "held-out accuracy {acc:.3} is {:.1} points below its best {best:.3} (step {at}): \
                         training longer is making the model worse; keep the best checkpoint \
                         (metric_for_best_model = \"eval/accuracy\"), decay the learning rate \
                         (lr_scheduler_type = \"cosine\"), or add a KL term (beta)",
                        (best - acc) * 100.0
                    ),
                )),
                Some((best, _)) if acc <= best => {}
                _ => self.best = Some((acc, step)),
            }
        }
        let mut out = vec![];
        let firing: Vec<HealthKind> = now.iter().map(|(k, _)| *k).collect();
        for (kind, message) in now {
            let recent = self
                .last_warned
                .iter()
                .any(|&(k, at)| k == kind && step < at + o.rewarn_after);
            if !self.active.contains(&kind) && !recent {
                self.last_warned.retain(|(k, _)| *k != kind);
                self.last_warned.push((kind, step));
                out.push(HealthWarning {
                    kind,
                    step,
                    message,
                });
            }
        }
        // A condition that cleared may warn again. Accuracy only clears on an eval round.
        let evaluated = m.eval_accuracy().is_some();
        self.active
            .retain(|k| firing.contains(k) || (*k == HealthKind::AccuracyFall && !evaluated));
        for k in firing {
            if !self.active.contains(&k) {
                self.active.push(k);
            }
        }
        out
    }
}

/// An agent run's rounds: no episode called a tool, or every call failed.
fn agent_checks(m: &StepMetrics) -> Vec<(HealthKind, String)> {
    let get = |k: &str| m.policy.iter().find(|(n, _)| n == k).map(|x| x.1);
    let mut out = vec![];
    if get("agent/episodes_calling_tools") == Some(0.0) {
        out.push((
            HealthKind::NoToolCalls,
            "no episode of this round called a tool, so nothing teaches the model to use one: \
             start with a supervised warm-up (sft_warmup_steps), check that the prompt shows the \
             tools (completions.jsonl; a chat template that renders `tools`), or reward tool use"
                .to_string(),
        ));
    }
    let calls = get("agent/tool_calls_per_episode").unwrap_or(0.0);
    let errors = get("agent/tool_errors_per_episode").unwrap_or(0.0);
    if calls > 0.0 && errors >= calls {
        let kinds: Vec<String> = m
            .policy
            .iter()
            .filter_map(|(n, v)| Some((n.strip_prefix("agent/tool_errors/")?, v)))
            .map(|(k, v)| format!("{k} {v:.2}"))
            .collect();
        out.push((
            HealthKind::ToolsFailing,
            format!(
                "every tool call of this round failed (per episode: {}): the model learns only \
                 error messages; the tool messages in completions.jsonl say why (a tool that \
                 raises or times out, arguments the schema does not allow, calls that cannot be \
                 parsed)",
                kinds.join(", ")
            ),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::metrics::{names, UpdateMetrics};
    use super::super::round::RoundTimes;
    use super::*;

    fn round(entropy: f64, zero_std: f64, kl: f64, grad: f64, acc: Option<f64>) -> StepMetrics {
        StepMetrics {
            reward: 0.5,
            reward_std: 0.1,
            rewards: vec![],
            frac_reward_zero_std: zero_std,
            advantage_mean: 0.0,
            advantage_std: 1.0,
            mean_length: 10.0,
            min_length: 1.0,
            max_length: 20.0,
            clipped_ratio: 0.0,
            dynamic_sampling: None,
            update: Some(UpdateMetrics {
                loss: 0.0,
                pg_loss: 0.0,
                kl,
                kl_penalty: 0.0,
                entropy,
                mean_log_prob: -1.0,
                clip_low: 0.0,
                clip_high: 0.0,
                clip_region: 0.0,
                grad_norm: grad,
                learning_rate: 1e-5,
                entropy_coef: None,
                flops: 0.0,
            }),
            kl_reward_seq_kl: None,
            kl_reward_coef: None,
            temperature: None,
            times: RoundTimes::default(),
            peak_tflops: None,
            tokens_per_second: 0.0,
            epoch: 0.0,
            resources: None,
            world_memory: None,
            skipped_steps: 0,
            eval_seconds: None,
            eval: acc
                .map(|a| vec![(names::EVAL_ACCURACY.to_string(), a)])
                .unwrap_or_default(),
            policy: vec![],
            health: vec![],
        }
    }

    fn kinds(w: &[HealthWarning]) -> Vec<HealthKind> {
        w.iter().map(|w| w.kind).collect()
    }

    #[test]
    fn agents_without_tool_calls_or_with_failing_tools_warn() {
        let mut h = Health::new(HealthOptions::default());
        let agent = |calling: f64, calls: f64, errors: f64| {
            let mut m = round(1.0, 0.2, 0.01, 0.5, None);
            m.policy = vec![
                ("agent/episodes_calling_tools".into(), calling),
                ("agent/tool_calls_per_episode".into(), calls),
                ("agent/tool_errors_per_episode".into(), errors),
                ("agent/tool_errors/timeout".into(), errors),
            ];
            m
        };
        assert!(h.check(1, &agent(0.5, 1.0, 0.2)).is_empty());
        assert_eq!(
            kinds(&h.check(2, &agent(0.0, 0.0, 0.0))),
            [HealthKind::NoToolCalls]
        );
        let w = h.check(3, &agent(1.0, 1.0, 1.0));
        assert_eq!(kinds(&w), [HealthKind::ToolsFailing]);
        assert!(w[0].message.contains("timeout 1.00"), "{}", w[0].message);
        // A single-turn run has no agent metrics and no such warnings.
        assert!(h.check(4, &round(1.0, 0.2, 0.01, 0.5, None)).is_empty());
    }

    #[test]
    fn a_healthy_run_is_quiet() {
        let mut h = Health::new(HealthOptions::default());
        for s in 1..40 {
            let acc = (s % 5 == 0).then_some(0.5 + s as f64 / 100.0);
            assert!(h.check(s, &round(1.0, 0.2, 0.01, 0.5, acc)).is_empty());
        }
    }

    #[test]
    fn entropy_collapse_warns_once_until_it_clears() {
        let mut h = Health::new(HealthOptions::default());
        let w = h.check(1, &round(0.01, 0.0, 0.0, 0.5, None));
        assert_eq!(kinds(&w), vec![HealthKind::LowEntropy]);
        assert!(w[0].message.contains("entropy_coef"), "{}", w[0].message);
        assert!(h.check(2, &round(0.01, 0.0, 0.0, 0.5, None)).is_empty());
        assert!(h.check(3, &round(0.5, 0.0, 0.0, 0.5, None)).is_empty());
        // Back below the floor soon after: no second warning yet (it hovers at the threshold).
        assert!(h.check(4, &round(0.01, 0.0, 0.0, 0.5, None)).is_empty());
        assert!(h.check(5, &round(0.5, 0.0, 0.0, 0.5, None)).is_empty());
        assert_eq!(
            kinds(&h.check(21, &round(0.01, 0.0, 0.0, 0.5, None))),
            vec![HealthKind::LowEntropy]
        );
    }

    #[test]
    fn groups_without_signal_warn_over_a_window() {
        let mut h = Health::new(HealthOptions::default());
        // Early training: many all-wrong groups, but under 60% over 10 rounds: quiet.
        for s in 1..=20 {
            let share = if s % 2 == 0 { 0.75 } else { 0.375 };
            assert!(h.check(s, &round(1.0, share, 0.0, 0.5, None)).is_empty());
        }
        // Then mostly all-equal: rounds 12..=21 average (6 x 0.75 + 4 x 0.375) / 10 = 0.6.
        let w = h.check(21, &round(1.0, 0.75, 0.0, 0.5, None));
        assert_eq!(kinds(&w), vec![HealthKind::NoSignal]);
        assert!(
            w[0].message.contains("dynamic_sampling"),
            "{}",
            w[0].message
        );
        for s in 22..30 {
            assert!(
                h.check(s, &round(1.0, 0.75, 0.0, 0.5, None)).is_empty(),
                "{s}"
            );
        }
    }

    #[test]
    fn spikes_are_judged_against_the_recent_median() {
        let mut h = Health::new(HealthOptions::default());
        for s in 1..=10 {
            assert!(h.check(s, &round(1.0, 0.0, 0.01, 0.5, None)).is_empty());
        }
        let w = h.check(11, &round(1.0, 0.0, 0.2, 3.0, None));
        assert_eq!(kinds(&w), vec![HealthKind::KlSpike, HealthKind::GradSpike]);
        assert!(w[0].message.contains("20.0x"), "{}", w[0].message);
    }

    #[test]
    fn accuracy_falling_from_its_best_warns_with_the_best_step() {
        let mut h = Health::new(HealthOptions::default());
        assert!(h
            .check(10, &round(1.0, 0.0, 0.0, 0.5, Some(0.77)))
            .is_empty());
        assert!(h
            .check(20, &round(1.0, 0.0, 0.0, 0.5, Some(0.70)))
            .is_empty());
        let w = h.check(30, &round(1.0, 0.0, 0.0, 0.5, Some(0.60)));
        assert_eq!(kinds(&w), vec![HealthKind::AccuracyFall]);
        assert!(w[0].message.contains("step 10"), "{}", w[0].message);
        // Rounds without an eval keep it active; it warns again only after recovering.
        assert!(h.check(31, &round(1.0, 0.0, 0.0, 0.5, None)).is_empty());
        assert!(h
            .check(40, &round(1.0, 0.0, 0.0, 0.5, Some(0.58)))
            .is_empty());
        assert!(h
            .check(50, &round(1.0, 0.0, 0.0, 0.5, Some(0.75)))
            .is_empty());
        assert_eq!(
            kinds(&h.check(60, &round(1.0, 0.0, 0.0, 0.5, Some(0.6)))),
            vec![HealthKind::AccuracyFall]
        );
    }
}
