//! Steps 1-4 of a round: sample `P` prompts x `G` completions with the current policy, take the
//! old (sampling-policy) and reference log-probs, score every reward ([`sample_round`]; with
//! dynamic sampling (DAPO) groups whose rewards all equal are dropped and more prompts are
//! sampled until `P` groups carry a signal, for at most `max_extra_passes` extra passes), then
//! turn the rewards into group-relative advantages and this rank's [`TrainBatch`]
//! ([`score_round`]).

use std::time::Instant;

use super::policy::Policy;
use super::setup::Run;
use super::shard::{gather_episodes, owned_groups};
use super::update::{skip_round, update_round, StepCounter, StepStats};
use super::world::World;
use super::Console;
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

/// What a round sampled, scored and kept.
#[derive(Debug, Default)]
pub struct Sampled {
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
    /// Per group: whether this rank trains on it (every group in one process). Episodes are
    /// the world's; log-probs are filled for this rank's own episodes only.
    pub own: Vec<bool>,
}

impl Sampled {
    /// Appends `other`'s groups (of `g` completions) after this one's.
    fn extend(&mut self, mut other: Sampled, g: usize) {
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
        self.own.append(&mut other.own);
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
        self.own = chosen.iter().map(|&gi| self.own[gi]).collect();
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

/// What step 4 made of a sampled round.
pub struct Scored {
    /// Combined rewards and group-relative advantages, per completion.
    pub adv: Advantages,
    /// KL in the reward: the round's mean sequence KL.
    pub kl_reward_seq_kl: Option<f64>,
    /// This rank's rows: its own groups, less those `drop_zero_std_groups` leaves out.
    pub batch: TrainBatch,
    /// Why the round cannot train (a reward of +/-inf), when it cannot.
    pub unusable: Option<String>,
}

/// Step 4: rewards -> group-relative advantages (KL in the reward when so configured; the
/// adaptive controller moves), checked, then this rank's [`TrainBatch`].
pub fn score_round<P: Policy>(r: &mut Run<P>, sampled: &Sampled) -> Result<Scored> {
    let cfg = r.cfg;
    let (episodes, g) = (&sampled.episodes, r.opts.g);
    check_missing_rewards(r, episodes)?;
    let p = episodes.len() / g;
    let per_func: Vec<f32> = episodes
        .iter()
        .flat_map(|e| e.rewards.iter().copied())
        .collect();
    let kl_penalty = match (&cfg.loss.kl(), &sampled.old_logps, &sampled.ref_logps) {
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
    let batch = TrainBatch::from_round(
        episodes,
        &adv.advantages,
        // This rank's groups (all of them in one process).
        &|e| sampled.own[e.group] && !(cfg.loss.drop_zero_std_groups && adv.zero_std[e.group]),
        cfg.loss.mask_truncated_completions,
        sampled.old_logps.as_deref().filter(|_| r.opts.needs_old),
        sampled.ref_logps.as_deref().filter(|_| r.opts.kl_needs_ref),
    );
    Ok(Scored {
        unusable: infinite_reward(episodes, &r.data.rewards),
        kl_reward_seq_kl: kl_penalty.map(|k| k.1),
        adv,
        batch,
    })
}

/// Step 5: the round's optimizer steps, the one place the step counter moves. A round that
/// cannot train (`unusable`) counts its steps as bad ones; a round without a row to train on
/// (every group's rewards equal, each dropped) moves the counter past its steps without an AdamW
/// step; any other runs its updates. Then (TRL) the policy is mixed into the reference every
/// `ref_model_sync_steps`.
pub fn step_round<P: Policy>(
    r: &mut Run<P>,
    scored: &Scored,
    world: &dyn World,
    console: &Console,
) -> Result<Vec<StepStats>> {
    let o = &r.opts;
    let counter = StepCounter {
        step: &mut r.state.step,
        consecutive_nonfinite: &mut r.state.consecutive_nonfinite,
        skipped_steps: &mut r.state.skipped_steps,
        adaptive_entropy: r.state.adaptive_entropy.as_mut(),
    };
    let steps = match &scored.unusable {
        Some(why) => skip_round(
            o.updates_per_round,
            &o.schedule,
            counter,
            why,
            o.update.max_bad_steps,
        )?,
        None => {
            if scored.batch.rows.is_empty() {
                console.say(format!(
                    "step {}: every group had equal rewards; no update this round",
                    *counter.step + 1
                ));
                *counter.step = (*counter.step + o.updates_per_round).min(o.schedule.total_steps);
            }
            update_round(
                &r.policy,
                &mut r.opt,
                &scored.batch,
                &o.update,
                &o.schedule,
                counter,
                world,
                &mut |s| console.set_position(s),
            )?
        }
    };
    console.set_position(r.state.step);
    super::end_phase("update", &super::policy_device(&r.policy));
    r.state.round += 1;
    let cfg = r.cfg;
    if cfg.loss.sync_ref_model
        && r.state
            .step
            .is_multiple_of(cfg.loss.ref_model_sync_steps as u64)
    {
        r.reference
            .sync(&r.policy, cfg.loss.ref_model_mixup_alpha)?;
    }
    Ok(steps)
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

/// Samples, takes log-probs and scores the round's `P` groups; with dynamic sampling, samples
/// `ceil(P x oversample)` groups in the first pass, drops the groups without signal and samples
/// more until `P` carry one or `max_extra_passes` extra passes ran.
pub fn sample_round<P: Policy>(r: &mut Run<P>, world: &dyn World) -> Result<Sampled> {
    let (p, g, max_extra) = (r.opts.p, r.opts.g, r.opts.max_extra_passes);
    let mut seeds: Vec<u64> = (0..p)
        .map(|i| mix_seed(r.cfg.run.seed, r.state.round * p as u64 + i as u64))
        .collect();
    // Dynamic sampling's oversampled first pass: the prompts beyond P draw a stream of their
    // own, numbered by round (the first P keep theirs, so oversample = 1 is the plain pass).
    let first = match r.opts.dynamic_sampling {
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
    let mut round = sample_pass(r, &seeds, world)?;
    if !r.opts.dynamic_sampling {
        return Ok(round);
    }
    let keep = signal(&round.episodes, &r.opts.weights, g)?;
    round.groups_sampled = keep.len();
    round.groups_dropped = keep.iter().filter(|k| !**k).count();
    round.retain_groups(g, &keep, p);
    let mut extra = 0;
    while round.episodes.len() < p * g && extra < max_extra {
        // Extra passes draw their own streams (exact resume: the count is trainer state).
        let n = r.state.extra_passes;
        let seeds: Vec<u64> = (0..p)
            .map(|i| mix_seed(r.cfg.run.seed ^ 0x4459_4e53, n * p as u64 + i as u64))
            .collect();
        r.state.extra_passes += 1;
        extra += 1;
        let mut more = sample_pass(r, &seeds, world)?;
        let keep = signal(&more.episodes, &r.opts.weights, g)?;
        more.groups_sampled = keep.len();
        more.groups_dropped = keep.iter().filter(|k| !**k).count();
        let room = p - round.episodes.len() / g;
        more.retain_groups(g, &keep, room);
        round.extend(more, g);
    }
    // A short round is news only when extra passes were allowed to fill it (the metrics log
    // every round's groups_kept).
    if round.episodes.len() < p * g && max_extra > 0 {
        tracing::warn!(
            "dynamic sampling: {} of {p} groups carry a signal after {max_extra} extra passes; updating on those",
            round.episodes.len() / g
        );
    }
    Ok(round)
}

/// One pass: `seeds.len()` prompts from the order, `G` completions each (rewards that allow it
/// scored on a second thread while sampling runs), log-probs, every reward. Across ranks each
/// samples and scores its own groups, and the scored episodes are gathered.
fn sample_pass<P: Policy>(r: &mut Run<P>, seeds: &[u64], world: &dyn World) -> Result<Sampled> {
    let cfg = r.cfg;
    // 1. Rollout with the current policy: the world's prompts, this rank's groups.
    let t0 = Instant::now();
    let sampler = r.policy.freeze(cfg.update.gradient_checkpointing)?;
    let all_idx = r.state.order.next_batch(seeds.len());
    let mine = owned_groups(
        seeds.len(),
        cfg.update.per_device_train_batch_size / r.opts.g,
        world.size(),
        world.rank(),
    );
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
    let (mut episodes, gen_stats, early) = match &r.agent {
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
    let t_generate = t0.elapsed().as_secs_f64() - early.wait_s;
    super::profile::rollout(&gen_stats);
    super::end_phase("rollout", &super::policy_device(&r.policy));
    grpo_models::faults::kill_point("train.sampled");

    // 2. Old (sampling-policy) and reference log-probs, without a graph.
    let t0 = Instant::now();
    let pairs: Vec<(&[u32], &[u32])> = episodes
        .iter()
        .map(|e| (e.prompt_ids.as_slice(), e.completion_ids.as_slice()))
        .collect();
    let kl_in_reward = matches!(cfg.loss.kl(), KlMode::Reward { .. });
    let chunk = r.opts.update.forward_chunk_tokens;
    let old_logps = match r.opts.needs_old || kl_in_reward {
        true => {
            Some(sampler.sequence_logprobs(&pairs, r.pad, r.opts.sampling.temperature, chunk)?)
        }
        false => None,
    };
    drop(sampler);
    let t_old = t0.elapsed().as_secs_f64();
    let ref_logps = r
        .reference
        .logprobs(&pairs, r.pad, r.opts.sampling.temperature, chunk)?;
    let t_reference = t0.elapsed().as_secs_f64();
    super::profile::log_probs(t_old, t_reference - t_old, &pairs, chunk);
    super::end_phase("old/reference log-probs", &super::policy_device(&r.policy));

    // 3. Score the rest (coherence rewards read the reference's mean log-prob).
    let t0 = Instant::now();
    let ref_means: Option<Vec<f32>> =
        ref_logps
            .as_ref()
            .filter(|_| r.opts.rewards_need_ref)
            .map(|rl| {
                rl.iter()
                    .map(|l| l.iter().sum::<f32>() / l.len().max(1) as f32)
                    .collect()
            });
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
    let t_score = wait_s + t0.elapsed().as_secs_f64();
    grpo_models::faults::kill_point("train.scored");
    if grpo_models::faults::fires("rewards.inf") {
        if let Some(x) = episodes.first_mut().and_then(|e| e.rewards.first_mut()) {
            *x = f32::INFINITY;
        }
    }
    let times = RoundTimes {
        generate: t_generate,
        reference: t_reference,
        score: t_score,
        ..Default::default()
    };
    let mut generated = [gen_stats.generated_tokens as f64];
    let n_all = all_idx.len();
    if world.size() == 1 {
        return Ok(Sampled {
            groups_sampled: n_all,
            episodes,
            old_logps,
            ref_logps,
            reward_secs,
            generated_tokens: gen_stats.generated_tokens,
            times,
            groups_dropped: 0,
            own: vec![true; n_all],
        });
    }
    // 4. The world's scored episodes, in global group order; log-probs stay with their rank.
    for e in &mut episodes {
        e.group = mine[e.group];
    }
    let gathered = gather_episodes(world, &episodes)?;
    world.sum_f64(&mut generated)?;
    let mut own = vec![false; n_all];
    for &i in &mine {
        own[i] = true;
    }
    // This rank's log-prob rows, one per episode it sampled, in order, placed at its episodes
    // among the gathered ones (other ranks' rows stay empty: they are never read here).
    let spread = |local: Option<Vec<Vec<f32>>>| -> Result<Option<Vec<Vec<f32>>>> {
        let Some(l) = local else { return Ok(None) };
        let have = l.len();
        let mut it = l.into_iter();
        let rows = gathered
            .iter()
            .map(|e| match own[e.group] {
                true => it.next().ok_or_else(|| {
                    Error::Invariant(format!(
                        "{have} log-prob rows for this rank's episodes, fewer than it sampled"
                    ))
                }),
                false => Ok(vec![]),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Some(rows))
    };
    Ok(Sampled {
        groups_sampled: n_all,
        old_logps: spread(old_logps)?,
        ref_logps: spread(ref_logps)?,
        episodes: gathered,
        reward_secs,
        generated_tokens: generated[0] as usize,
        times,
        groups_dropped: 0,
        own,
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
