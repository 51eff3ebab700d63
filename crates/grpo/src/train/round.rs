//! Steps 1-3 of a round: sample `P` prompts x `G` completions with the current policy, take the
//! old (sampling-policy) and reference log-probs, score every reward. With dynamic sampling
//! (DAPO) groups whose rewards all equal are dropped and more prompts are sampled until `P`
//! groups carry a signal, for at most `max_extra` extra passes.

use std::time::Instant;

use super::policy::Policy;
use super::setup::Run;
use super::shard::{gather_episodes, owned_groups};
use super::world::World;
use crate::advantages::{combine_rewards, groups_with_signal};
use crate::loss::KlMode;
use crate::rollout::{self, Episode, GroupSampler};
use crate::seeding::mix_seed;
use crate::Result;

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
    /// Seconds sampling, taking log-probs, and scoring (what scoring added to the step).
    pub t_generate: f64,
    pub t_reference: f64,
    pub t_score: f64,
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
        self.t_generate += other.t_generate;
        self.t_reference += other.t_reference;
        self.t_score += other.t_score;
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

/// Whether each group of `episodes` carries a signal (its combined rewards differ).
fn signal(episodes: &[Episode], weights: &[f32], g: usize) -> Result<Vec<bool>> {
    let per_func: Vec<f32> = episodes
        .iter()
        .flat_map(|e| e.rewards.iter().copied())
        .collect();
    Ok(groups_with_signal(&combine_rewards(&per_func, weights)?, g))
}

/// Samples, takes log-probs and scores the round's `P` groups; with dynamic sampling, drops the
/// groups without signal and samples more until `P` carry one or `max_extra_passes` extra
/// passes ran.
pub fn sample_round<P: Policy>(r: &mut Run<P>, world: &dyn World) -> Result<Sampled> {
    let (p, g, max_extra) = (r.p, r.g, r.max_extra_passes);
    let seeds: Vec<u64> = (0..p)
        .map(|i| mix_seed(r.cfg.run.seed, r.state.round * p as u64 + i as u64))
        .collect();
    let mut round = sample_pass(r, &seeds, world)?;
    if !r.dynamic_sampling {
        return Ok(round);
    }
    let keep = signal(&round.episodes, &r.weights, g)?;
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
        let keep = signal(&more.episodes, &r.weights, g)?;
        more.groups_sampled = keep.len();
        more.groups_dropped = keep.iter().filter(|k| !**k).count();
        let room = p - round.episodes.len() / g;
        more.retain_groups(g, &keep, room);
        round.extend(more, g);
    }
    if round.episodes.len() < p * g {
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
        cfg.update.per_device_train_batch_size / r.g,
        world.size(),
        world.rank(),
    );
    let batch_idx: Vec<usize> = mine.iter().map(|&i| all_idx[i]).collect();
    let seeds: Vec<u64> = mine.iter().map(|&i| seeds[i]).collect();
    let prompt_ids: Vec<Vec<u32>> = batch_idx
        .iter()
        .zip(&seeds)
        .map(|(&i, &seed)| match &r.fill {
            // A fill-in input masked on the fly: its masks drawn from the prompt's seed.
            Some(f) => f.input(&r.train_ids[i], seed),
            None => r.train_ids[i].clone(),
        })
        .collect();
    let (mut episodes, gen_stats, early) = rollout::rollout_scoring_early(
        &sampler,
        &r.tok,
        &batch_idx,
        prompt_ids,
        &seeds,
        r.g,
        &r.sampling,
        &r.data.train,
        &r.data.rewards,
        &r.early_rewards,
    )?;
    let t_generate = t0.elapsed().as_secs_f64() - early.wait_s;
    super::trace_memory("rollout");
    crate::faults::kill_point("train.sampled");

    // 2. Old (sampling-policy) and reference log-probs, without a graph.
    let t0 = Instant::now();
    let pairs: Vec<(&[u32], &[u32])> = episodes
        .iter()
        .map(|e| (e.prompt_ids.as_slice(), e.completion_ids.as_slice()))
        .collect();
    let kl_in_reward = matches!(cfg.loss.kl(), KlMode::Reward { .. });
    let chunk = r.update.forward_chunk_tokens;
    let old_logps = match r.needs_old || kl_in_reward {
        true => {
            Some(sampler.sequence_logprobs(&pairs, r.pad, cfg.generation.temperature, chunk)?)
        }
        false => None,
    };
    drop(sampler);
    let ref_logps = r
        .reference
        .logprobs(&pairs, r.pad, cfg.generation.temperature, chunk)?;
    let t_reference = t0.elapsed().as_secs_f64();
    super::trace_memory("old/reference log-probs");

    // 3. Score the rest (coherence rewards read the reference's mean log-prob).
    let t0 = Instant::now();
    let ref_means: Option<Vec<f32>> = ref_logps.as_ref().filter(|_| r.rewards_need_ref).map(|rl| {
        rl.iter()
            .map(|l| l.iter().sum::<f32>() / l.len().max(1) as f32)
            .collect()
    });
    let wait_s = early.wait_s;
    let reward_secs = rollout::score_rest(
        &mut episodes,
        early,
        &r.early_rewards,
        &r.data.train,
        &r.data.rewards,
        ref_means.as_deref(),
    )?;
    // What scoring added to the step: waiting for the early scorer, then the late rewards.
    let t_score = wait_s + t0.elapsed().as_secs_f64();
    crate::faults::kill_point("train.scored");
    if crate::faults::fires("rewards.inf") {
        if let Some(x) = episodes.first_mut().and_then(|e| e.rewards.first_mut()) {
            *x = f32::INFINITY;
        }
    }
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
            t_generate,
            t_reference,
            t_score,
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
    let spread = |local: Option<Vec<Vec<f32>>>| {
        local.map(|l| {
            let mut it = l.into_iter();
            gathered
                .iter()
                .map(|e| match own[e.group] {
                    true => it.next().unwrap_or_default(),
                    false => vec![],
                })
                .collect()
        })
    };
    Ok(Sampled {
        groups_sampled: n_all,
        old_logps: spread(old_logps),
        ref_logps: spread(ref_logps),
        episodes: gathered,
        reward_secs,
        generated_tokens: generated[0] as usize,
        t_generate,
        t_reference,
        t_score,
        groups_dropped: 0,
        own,
    })
}
