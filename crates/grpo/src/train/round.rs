//! The phases of a round before the update, each taking what it reads and returning what it
//! produces: [`sample`] (this rank's groups rolled out with the current policy, rewards that
//! allow it scored while sampling runs) -> [`log_probs`] (old and reference) -> [`score`] (every
//! reward; the world's groups gathered: a [`Scored`] pass) -> [`advantages`] (group-relative,
//! and this rank's [`TrainBatch`]: a [`RoundBatch`]). [`Passes`] plans the sampling passes:
//! one, or under dynamic sampling (DAPO) more until `P` groups carry a signal (their rewards
//! differ), for at most `max_extra_passes` extra passes. `step::grpo_round` calls them
//! in order.

use std::time::Instant;

use super::policy::Policy;
use super::probe;
use super::setup::Run;
use super::shard::{gather_episodes, gather_rows, sampled_groups, trained_groups};
use super::world::World;
use crate::advantages::{
    check_group_spread, combine_rewards, groups_with_signal, round_advantages, Advantages,
    RewardAggregation,
};
use crate::loss::{kl_reward_penalty, KlMode};
use crate::rewards::Reward;
use crate::rollout::{self, Episode, GroupSampler, TrainBatch};
use crate::{Error, Result};
use grpo_models::seeding::mix_seed;

/// Seconds of each part of a round.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RoundTimes {
    pub generate: f64,
    pub score: f64,
    pub reference: f64,
    pub update: f64,
    pub step: f64,
}

/// What a round sampled, scored and kept (a pass's, then the round's).
#[derive(Debug, Default)]
pub struct Scored {
    /// Group-major, `G` per group; `Episode::group` is the index among the kept groups.
    pub episodes: Vec<Episode>,
    /// Per completion token, when the round needs them (off-policy updates, KL in the reward).
    pub old_logps: Option<Vec<Vec<f32>>>,
    /// Per completion token, when a KL term or a reward needs the reference.
    pub ref_logps: Option<Vec<Vec<f32>>>,
    /// Seconds each reward spent scoring.
    pub reward_secs: Vec<f64>,
    pub generated_tokens: usize,
    /// Seconds sampling, taking log-probs, and scoring (what scoring added to the step); the
    /// update's and the whole step's are filled in by the loop.
    pub times: RoundTimes,
    /// Dynamic sampling: groups sampled, dropped (all rewards equal) and kept.
    pub groups_sampled: usize,
    pub groups_dropped: usize,
}

impl Scored {
    /// Appends `other`'s groups (of `g` completions) after this one's.
    fn extend(&mut self, mut other: Scored, g: usize) {
        let offset = self.episodes.len() / g;
        for e in &mut other.episodes {
            e.group += offset;
        }
        self.episodes.append(&mut other.episodes);
        for (a, b) in [
            (&mut self.old_logps, other.old_logps),
            (&mut self.ref_logps, other.ref_logps),
        ] {
            if let (Some(a), Some(mut b)) = (a.as_mut(), b) {
                a.append(&mut b);
            }
        }
        for (a, b) in self.reward_secs.iter_mut().zip(other.reward_secs) {
            *a += b;
        }
        self.generated_tokens += other.generated_tokens;
        self.times.generate += other.times.generate;
        self.times.reference += other.times.reference;
        self.times.score += other.times.score;
        self.groups_sampled += other.groups_sampled;
        self.groups_dropped += other.groups_dropped;
    }

    /// Keeps the groups `keep` says yes to (in order, at most `max`), renumbered.
    fn retain_groups(&mut self, g: usize, keep: &[bool], max: usize) {
        let chosen: Vec<usize> = (0..keep.len()).filter(|&i| keep[i]).take(max).collect();
        let take = |v: &mut Vec<Vec<f32>>| {
            let old = std::mem::take(v);
            *v = chosen
                .iter()
                .flat_map(|&gi| old[gi * g..(gi + 1) * g].to_vec())
                .collect();
        };
        if let Some(v) = self.old_logps.as_mut() {
            take(v);
        }
        if let Some(v) = self.ref_logps.as_mut() {
            take(v);
        }
        let old = std::mem::take(&mut self.episodes);
        self.episodes = chosen
            .iter()
            .enumerate()
            .flat_map(|(new, &gi)| {
                old[gi * g..(gi + 1) * g].iter().cloned().map(move |mut e| {
                    e.group = new;
                    e
                })
            })
            .collect();
    }
}

/// A round's batch: the advantages of its scored completions and what this rank trains on.
pub struct RoundBatch {
    /// Combined rewards and group-relative advantages, per completion.
    pub adv: Advantages,
    /// KL in the reward: the round's mean sequence KL.
    pub kl_reward_seq_kl: Option<f64>,
    /// This rank's rows: its part of the round's groups, those `drop_zero_std_groups` leaves
    /// out left out before the groups are dealt out to the ranks.
    pub train: TrainBatch,
    /// Why the round cannot train (a reward of +/-inf), when it cannot.
    pub unusable: Option<String>,
}

/// Rewards -> group-relative advantages (KL in the reward when so configured; the adaptive
/// controller moves), checked, then this rank's [`TrainBatch`]. Every rank holds the world's
/// scored episodes and log-probs, so all of this is the one-process run's on every rank.
pub fn advantages<P: Policy>(
    r: &mut Run<P>,
    scored: &Scored,
    world: &dyn World,
) -> Result<RoundBatch> {
    let cfg = r.cfg;
    let (episodes, g) = (&scored.episodes, r.opts.g);
    check_missing_rewards(r, episodes)?;
    let p = episodes.len() / g;
    let per_func: Vec<f32> = episodes
        .iter()
        .flat_map(|e| e.rewards.iter().copied())
        .collect();
    let kl_penalty = match (&cfg.loss.kl(), &scored.old_logps, &scored.ref_logps) {
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
        &r.opts.weights,
        kl_penalty.as_ref().map(|k| k.0.as_slice()),
        g,
        cfg.loss.multi_objective_aggregation,
        &r.opts.adv,
    )?;
    check_round_invariants(episodes, p, g, &adv.advantages, r.opts.adv.normalize_batch)?;
    if cfg.loss.multi_objective_aggregation == RewardAggregation::SumThenNormalize {
        check_group_spread(&adv.rewards, &adv.advantages, g, &r.opts.adv)?;
    }
    // The groups trained on, dealt out to the ranks (all of them to one process).
    let kept: Vec<bool> = (0..p)
        .map(|i| !(cfg.loss.drop_zero_std_groups && adv.zero_std[i]))
        .collect();
    let gpm = cfg.update.per_device_train_batch_size / g;
    let own = trained_groups(&kept, gpm, world.size(), world.rank());
    let train = TrainBatch::from_round(
        episodes,
        &adv.advantages,
        &|e| own[e.group],
        cfg.loss.mask_truncated_completions,
        scored.old_logps.as_deref().filter(|_| r.opts.needs_old),
        scored.ref_logps.as_deref().filter(|_| r.opts.kl_needs_ref),
    );
    Ok(RoundBatch {
        unusable: infinite_reward(episodes, &r.data.rewards),
        kl_reward_seq_kl: kl_penalty.map(|k| k.1),
        adv,
        train,
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

/// Whether each group of `episodes` carries a signal (its combined rewards differ).
fn signal(episodes: &[Episode], weights: &[f32], g: usize) -> Result<Vec<bool>> {
    let per_func: Vec<f32> = episodes
        .iter()
        .flat_map(|e| e.rewards.iter().copied())
        .collect();
    Ok(groups_with_signal(&combine_rewards(&per_func, weights)?, g))
}

/// The sampling passes of a round, each a list of per-prompt seeds. The first samples `P`
/// prompts, or under dynamic sampling `ceil(P x oversample)`; dynamic sampling drops the groups
/// without signal and samples `P` more until `P` groups carry one or `max_extra_passes` extra
/// passes ran.
pub struct Passes {
    p: usize,
    g: usize,
    dynamic: bool,
    max_extra: usize,
    extra: usize,
}

impl Passes {
    pub fn new<P: Policy>(r: &Run<P>) -> Passes {
        Passes {
            p: r.opts.p,
            g: r.opts.g,
            dynamic: r.opts.dynamic_sampling,
            max_extra: r.opts.max_extra_passes,
            extra: 0,
        }
    }

    /// The next pass's seeds, given the groups `kept` so far (None before the first pass); None
    /// when the round has its groups.
    pub fn next<P: Policy>(&mut self, r: &mut Run<P>, kept: Option<&Scored>) -> Option<Vec<u64>> {
        let p = self.p;
        let Some(kept) = kept else {
            return Some(first_pass_seeds(r, self.dynamic));
        };
        let short = kept.episodes.len() < p * self.g;
        if !self.dynamic || !short {
            return None;
        }
        if self.extra >= self.max_extra {
            // A short round is news only when extra passes were allowed to fill it (the
            // metrics log every round's groups_kept).
            if self.max_extra > 0 {
                tracing::warn!(
                    "dynamic sampling: {} of {p} groups carry a signal after {} extra passes; updating on those",
                    kept.episodes.len() / self.g,
                    self.max_extra
                );
            }
            return None;
        }
        // Extra passes draw their own streams (exact resume: the count is trainer state).
        let n = r.state.extra_passes;
        r.state.extra_passes += 1;
        self.extra += 1;
        Some(
            (0..p)
                .map(|i| mix_seed(r.cfg.run.seed ^ 0x4459_4e53, n * p as u64 + i as u64))
                .collect(),
        )
    }

    /// The round's groups after `pass`: under dynamic sampling, `pass`'s groups with a signal
    /// are appended to `kept`'s, up to `P`; otherwise the pass is the round.
    pub fn keep(&self, weights: &[f32], kept: Option<Scored>, mut pass: Scored) -> Result<Scored> {
        if !self.dynamic {
            return Ok(pass);
        }
        let g = self.g;
        let keep = signal(&pass.episodes, weights, g)?;
        pass.groups_sampled = keep.len();
        pass.groups_dropped = keep.iter().filter(|k| !**k).count();
        Ok(match kept {
            None => {
                pass.retain_groups(g, &keep, self.p);
                pass
            }
            Some(mut kept) => {
                let room = self.p - kept.episodes.len() / g;
                pass.retain_groups(g, &keep, room);
                kept.extend(pass, g);
                kept
            }
        })
    }
}

/// The first pass's seeds: one per prompt, numbered by round. Dynamic sampling's oversampled
/// prompts beyond `P` draw a stream of their own (the first `P` keep theirs, so oversample = 1
/// is the plain pass).
fn first_pass_seeds<P: Policy>(r: &Run<P>, dynamic: bool) -> Vec<u64> {
    let p = r.opts.p;
    let mut seeds: Vec<u64> = (0..p)
        .map(|i| mix_seed(r.cfg.run.seed, r.state.round * p as u64 + i as u64))
        .collect();
    let first = match dynamic {
        true => ((p as f64 * r.opts.oversample).ceil() as usize).max(p),
        false => p,
    };
    let extra_first = (first - p) as u64;
    seeds.extend((0..extra_first).map(|j| {
        mix_seed(
            r.cfg.run.seed ^ 0x4f56_4552,
            r.state.round * extra_first + j,
        )
    }));
    seeds
}

/// A pass's rollout: this rank's groups of the pass's prompts, sampled with the current policy.
pub struct Episodes {
    /// This rank's episodes, group-major, `G` per group (`Episode::group` counts this rank's).
    pub episodes: Vec<Episode>,
    /// The rewards scored while sampling ran, and which.
    early: rollout::EarlyScores,
    early_rewards: Vec<bool>,
    /// This rank's groups among the pass's, and how many the pass has in the world.
    mine: Vec<usize>,
    groups: usize,
    generated_tokens: usize,
    /// Seconds sampling took (less the wait for the early scorer).
    generate_s: f64,
}

/// Rolls out this rank's groups of `seeds.len()` prompts from the order, `G` completions each
/// (rewards that allow it scored on a second thread while sampling runs); also returns the
/// policy frozen for sampling, which takes the old log-probs next.
pub fn sample<P: Policy>(
    r: &mut Run<P>,
    seeds: &[u64],
    world: &dyn World,
) -> Result<(Episodes, P::Frozen)> {
    let cfg = r.cfg;
    let t0 = Instant::now();
    let sampler = r.policy.freeze(cfg.update.gradient_checkpointing)?;
    let all_idx = r.state.order.next_batch(seeds.len());
    let mine = sampled_groups(seeds.len(), world.size(), world.rank());
    let batch_idx: Vec<usize> = mine.iter().map(|&i| all_idx[i]).collect();
    let seeds: Vec<u64> = mine.iter().map(|&i| seeds[i]).collect();
    let prompt_ids: Vec<Vec<u32>> = batch_idx
        .iter()
        .zip(&seeds)
        .map(|(&i, &seed)| r.policy.round_input(&r.train_ids[i], seed))
        .collect();
    // Agents' episodes are scored once they are over (after the log-probs, with the rest).
    let early_rewards = match &r.agent {
        Some(_) => vec![false; r.data.rewards.len()],
        None => r.opts.early_rewards.clone(),
    };
    let (episodes, gen_stats, early) = match &r.agent {
        Some(agent) => {
            let (eps, stats) = agent.rollout(
                &sampler,
                &batch_idx,
                prompt_ids,
                &seeds,
                r.opts.g,
                &r.opts.sampling,
                &r.data.train,
            )?;
            let unscored = rollout::EarlyScores::none(eps.len(), r.data.rewards.len());
            (eps, stats, unscored)
        }
        None => rollout::rollout_scoring_early(
            &sampler,
            &r.tok,
            &batch_idx,
            prompt_ids,
            &seeds,
            r.opts.g,
            &r.opts.sampling,
            &r.data.train,
            &r.data.rewards,
            &early_rewards,
        )?,
    };
    let generate_s = t0.elapsed().as_secs_f64() - early.wait_s;
    super::profile::rollout(&gen_stats);
    super::end_phase("rollout", &super::policy_device(&r.policy));
    probe::kill_point("train.sampled");
    let episodes = Episodes {
        episodes,
        early,
        early_rewards,
        mine,
        groups: all_idx.len(),
        generated_tokens: gen_stats.generated_tokens,
        generate_s,
    };
    Ok((episodes, sampler))
}

/// Per completion token of a pass's episodes: the sampling policy's log-probs (when the update
/// is off-policy or the KL is in the reward) and the reference's (when a KL term or a reward
/// needs them), taken without a graph.
pub struct LogProbs {
    pub old: Option<Vec<Vec<f32>>>,
    pub reference: Option<Vec<Vec<f32>>>,
    /// Seconds both took.
    pub seconds: f64,
}

/// The old (with `sampler`, the policy frozen as it sampled, then dropped) and reference
/// log-probs of `episodes`.
pub fn log_probs<P: Policy>(
    r: &Run<P>,
    sampler: P::Frozen,
    episodes: &[Episode],
) -> Result<LogProbs> {
    let t0 = Instant::now();
    let pairs: Vec<(&[u32], &[u32])> = episodes
        .iter()
        .map(|e| (e.prompt_ids.as_slice(), e.completion_ids.as_slice()))
        .collect();
    let kl_in_reward = matches!(r.cfg.loss.kl(), KlMode::Reward { .. });
    let (chunk, temperature) = (
        r.opts.update.forward_chunk_tokens,
        r.opts.sampling.temperature,
    );
    let old = match r.opts.needs_old || kl_in_reward {
        true => Some(sampler.sequence_logprobs(&pairs, r.pad, temperature, chunk)?),
        false => None,
    };
    drop(sampler);
    let t_old = t0.elapsed().as_secs_f64();
    let reference = r.reference.logprobs(&pairs, r.pad, temperature, chunk)?;
    let seconds = t0.elapsed().as_secs_f64();
    super::profile::log_probs(t_old, seconds - t_old, &pairs, chunk);
    super::end_phase("old/reference log-probs", &super::policy_device(&r.policy));
    Ok(LogProbs {
        old,
        reference,
        seconds,
    })
}

/// Scores a pass: every reward not scored while sampling (coherence rewards read the
/// reference's mean log-prob); across ranks, the world's scored episodes are gathered, in
/// global group order (log-probs stay with their rank).
pub fn score<P: Policy>(
    r: &Run<P>,
    pass: Episodes,
    logps: LogProbs,
    world: &dyn World,
) -> Result<Scored> {
    let t0 = Instant::now();
    let ref_means: Option<Vec<f32>> = logps
        .reference
        .as_ref()
        .filter(|_| r.opts.rewards_need_ref)
        .map(|rl| {
            rl.iter()
                .map(|l| l.iter().sum::<f32>() / l.len().max(1) as f32)
                .collect()
        });
    let Episodes {
        mut episodes,
        early,
        early_rewards,
        mine,
        groups,
        generated_tokens,
        generate_s,
    } = pass;
    let wait_s = early.wait_s;
    let reward_secs = rollout::score_rest(
        &mut episodes,
        early,
        &early_rewards,
        &r.data.train,
        &r.data.rewards,
        ref_means.as_deref(),
    )?;
    // What scoring added to the step: waiting for the early scorer, then the late rewards.
    let score_s = wait_s + t0.elapsed().as_secs_f64();
    probe::scored(&mut episodes);
    let scored = Scored {
        groups_sampled: groups,
        episodes,
        old_logps: logps.old,
        ref_logps: logps.reference,
        reward_secs,
        generated_tokens,
        times: RoundTimes {
            generate: generate_s,
            reference: logps.seconds,
            score: score_s,
            ..Default::default()
        },
        groups_dropped: 0,
    };
    match world.size() {
        1 => Ok(scored),
        _ => gather(scored, &mine, world),
    }
}

/// The world's scored episodes of a pass and their log-prob rows, in global group order, from
/// this rank's (its groups `mine`); the generated tokens summed.
fn gather(mut local: Scored, mine: &[usize], world: &dyn World) -> Result<Scored> {
    for e in &mut local.episodes {
        e.group = mine[e.group];
    }
    let groups: Vec<usize> = local.episodes.iter().map(|e| e.group).collect();
    let gathered = gather_episodes(world, &local.episodes)?;
    let mut generated = [local.generated_tokens as f64];
    world.sum_f64(&mut generated)?;
    let rows = |rows: Option<Vec<Vec<f32>>>| -> Result<Option<Vec<Vec<f32>>>> {
        rows.map(|l| gather_rows(world, &groups, &l)).transpose()
    };
    Ok(Scored {
        old_logps: rows(local.old_logps.take())?,
        ref_logps: rows(local.ref_logps.take())?,
        episodes: gathered,
        generated_tokens: generated[0] as usize,
        ..local
    })
}

/// A reward missing for every completion of a round (a scorer that answers nothing usable, an
/// endpoint that is down) is warned about; `max_bad_steps` such rounds in a row stop the run
/// with an error naming the reward and what its scorer reported, instead of training on.
fn check_missing_rewards<P: Policy>(r: &mut Run<P>, episodes: &[Episode]) -> Result<()> {
    let limit = r.cfg.update.max_bad_steps.max(1);
    for (k, reward) in r.data.rewards.iter().enumerate() {
        let all_missing = !episodes.is_empty() && episodes.iter().all(|e| e.rewards[k].is_nan());
        let streak = &mut r.missing_streak[k];
        *streak = if all_missing { *streak + 1 } else { 0 };
        if *streak == 0 {
            continue;
        }
        let causes = match reward.scorer_stats() {
            Some(st) => format!(
                "its scorer so far: {} timeouts, {} crashes, {} garbage answers, {} null answers, \
                 {} HTTP errors, {} restarts",
                st.timeout,
                st.crash,
                st.garbage + st.garbage_lines,
                st.null,
                st.http_error,
                st.restarts
            ),
            None => "it returned no number for any completion".to_string(),
        };
        if *streak >= limit {
            return Err(Error::Training(format!(
                "reward `{}` was missing for every completion in {streak} rounds in a row \
                 ({causes}): stopping rather than training on nothing. Check the scorer or \
                 endpoint; max_bad_steps (now {limit}) sets how many rounds are tolerated",
                reward.name
            )));
        }
        tracing::warn!(
            "reward `{}` is missing for every completion of this round ({causes}); {} more such \
             rounds in a row stop the run",
            reward.name,
            limit - *streak
        );
    }
    Ok(())
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
        return Err(Error::Invariant(format!(
            "{} completions and {} advantages for {p} prompts x {g}",
            episodes.len(),
            advantages.len()
        )));
    }
    for (gi, group) in episodes.chunks(g).enumerate() {
        // An agent's episodes may each have their own prompt (their environment's observation
        // appended): they share the dataset row.
        let same = |e: &Episode| match e.agent {
            Some(_) => e.example == group[0].example,
            None => e.prompt_ids == group[0].prompt_ids,
        };
        if group.iter().any(|e| e.group != gi || !same(e)) {
            return Err(Error::Invariant(format!("group {gi} mixes prompts")));
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
                return Err(Error::Invariant(format!(
                    "advantages of group {gi} sum to {s}, not 0"
                )));
            }
        }
    }
    Ok(())
}
