//! The seams between sampling, scoring and the loss: rollout produces [`Episode`]s (one per
//! completion, grouped by prompt), rewards fill in their scores, and the update consumes a
//! [`TrainBatch`] (token ids, masks, advantages, old and reference log-probs).

use std::time::Instant;

use candle_core::{Device, Tensor};

use crate::data::Example;
use crate::rewards::{Reward, ScoreItem};
use crate::{Error, Result};
use grpo_models::models::CausalLm;
use grpo_models::sampler::episodes::{self, EpisodeTokens, TurnHost};
use grpo_models::sampler::{self, Completion, GenStats, PromptInput, SamplingParams, StopReason};
use grpo_models::tokenizer::Tokenizer;

/// One sampled completion of one prompt.
#[derive(Debug, Clone)]
pub struct Episode {
    /// Index of the prompt in the dataset.
    pub example: usize,
    /// Index of the prompt within this step's batch (its group).
    pub group: usize,
    pub prompt_ids: Vec<u32>,
    /// Completion ids; the EOS token, when sampled, is the last one.
    pub completion_ids: Vec<u32>,
    pub text: String,
    pub stop_reason: StopReason,
    /// One score per reward function (NaN = missing).
    pub rewards: Vec<f32>,
    /// A multi-turn episode ([`crate::agents`]): per completion token, whether the model sampled
    /// it (false: a tool's or environment's token, in the context but out of the loss), and the
    /// turns as messages. `None` for a single-turn completion.
    pub agent: Option<AgentTrace>,
}

/// What a multi-turn episode adds to its [`Episode`].
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AgentTrace {
    /// Per completion token: sampled by the model (true) or inserted by a tool turn (false).
    pub sampled: Vec<bool>,
    /// The episode after the prompt as chat messages (`assistant`, `tool`, ...), in TRL's
    /// conversational form.
    pub messages: Vec<serde_json::Value>,
    /// Model turns.
    pub turns: usize,
    /// Tool calls made, by tool name (in call order, repeats counted).
    pub tool_calls: Vec<String>,
    /// Tool errors, by kind (`parse`, `unknown_tool`, `arguments`, `raised`, `timeout`, ...).
    pub tool_errors: Vec<String>,
    /// Seconds the episode's tools took.
    pub tool_secs: f64,
    /// The environment's rewards (its `get_reward()`, then the reward functions that take
    /// `environments`; see [`crate::agents::Agent::environment_rewards`]); None: missing.
    pub env_rewards: Vec<Option<f32>>,
    /// Why a cap ended the episode (`max_tool_calling_iterations`, `max_episode_tokens`), if one
    /// did.
    pub cut: Option<String>,
}

impl Episode {
    /// Completion tokens the model sampled (tool tokens left out).
    pub fn sampled_tokens(&self) -> usize {
        match &self.agent {
            Some(a) => a.sampled.iter().filter(|&&s| s).count(),
            None => self.completion_ids.len(),
        }
    }

    pub fn truncated(&self) -> bool {
        self.stop_reason == StopReason::Length
    }
}

/// An episode on the wire between processes (rewards as bits: NaN means missing, and JSON has no
/// NaN).
#[derive(serde::Serialize, serde::Deserialize)]
struct EpisodeWire {
    example: usize,
    group: usize,
    prompt_ids: Vec<u32>,
    completion_ids: Vec<u32>,
    text: String,
    stop_reason: StopReason,
    rewards: Vec<u32>,
    #[serde(default)]
    agent: Option<AgentTrace>,
}

/// `episodes` as bytes for another process ([`decode_episodes`] reads them back exactly).
pub fn encode_episodes(episodes: &[Episode]) -> Result<Vec<u8>> {
    let wire: Vec<EpisodeWire> = episodes
        .iter()
        .map(|e| EpisodeWire {
            example: e.example,
            group: e.group,
            prompt_ids: e.prompt_ids.clone(),
            completion_ids: e.completion_ids.clone(),
            text: e.text.clone(),
            stop_reason: e.stop_reason,
            rewards: e.rewards.iter().map(|r| r.to_bits()).collect(),
            agent: e.agent.clone(),
        })
        .collect();
    serde_json::to_vec(&wire)
        .map_err(|e| Error::distributed(format!("cannot encode episodes to send: {e}")))
}

/// Episodes from [`encode_episodes`]'s bytes; `from` names the sender in errors.
pub fn decode_episodes(bytes: &[u8], from: &str) -> Result<Vec<Episode>> {
    let wire: Vec<EpisodeWire> = serde_json::from_slice(bytes)
        .map_err(|e| Error::distributed(format!("cannot decode {from}'s episodes: {e}")))?;
    Ok(wire
        .into_iter()
        .map(|w| Episode {
            example: w.example,
            group: w.group,
            prompt_ids: w.prompt_ids,
            completion_ids: w.completion_ids,
            text: w.text,
            stop_reason: w.stop_reason,
            rewards: w.rewards.into_iter().map(f32::from_bits).collect(),
            agent: w.agent,
        })
        .collect())
}

/// What sampling holds per sequence, and a training pass per token, on a model
/// ([`GroupSampler::memory_costs`]; evaluation bounds its sampling
/// calls with them).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MemoryCosts {
    /// Bytes per position of a sampled sequence: its keys and values in every layer, twice (the
    /// batched cache is built from the prompts' and copied again as finished rows leave it).
    pub kv_per_position: u64,
    /// Bytes per sampled sequence for its logits at a step (the device's row and the host's).
    pub logits: u64,
    /// Bytes a training pass keeps per token ([`crate::logprobs::activation_bytes_per_token`]).
    pub pass_per_token: u64,
}

/// What rollout samples from: a policy frozen at its current weights (and the reference model,
/// which only scores). The causal LM samples with the KV-cached batched sampler.
pub trait GroupSampler {
    /// Samples `n` completions of each prompt; `on_done(prompt, sample, completion)` receives
    /// each completion as soon as it has finished. Returns them `[prompt][sample]`.
    fn sample_groups(
        &self,
        tok: &Tokenizer,
        prompts: &[PromptInput],
        n: usize,
        params: &SamplingParams,
        on_done: &mut dyn FnMut(usize, usize, &Completion) -> Result<()>,
    ) -> Result<(Vec<Vec<Completion>>, GenStats)>;

    /// Samples `n` multi-turn episodes of each prompt, `host` answering each turn (agents);
    /// each at most `max_tokens` tokens after its prompt.
    fn sample_episodes(
        &self,
        _tok: &Tokenizer,
        _prompts: &[PromptInput],
        _n: usize,
        _params: &SamplingParams,
        _max_tokens: usize,
        _host: &mut dyn TurnHost,
    ) -> Result<(Vec<Vec<EpisodeTokens>>, GenStats)> {
        Err(Error::config(
            "tools",
            "this policy samples single completions: tools and environments need policy = \"causal_lm\"",
        ))
    }

    /// Per-token log-probs `[N][len]` of `rows` (prompt, completion), without a graph, in forward
    /// passes of at most `chunk_tokens` tokens.
    fn sequence_logprobs(
        &self,
        rows: &[(&[u32], &[u32])],
        pad: u32,
        temperature: f64,
        chunk_tokens: usize,
    ) -> Result<Vec<Vec<f32>>>;

    /// What sampling holds per sequence, and a training pass per token, on this model (for
    /// bounding evaluation's sampling by memory); None: no KV
    /// cache to bound.
    fn memory_costs(&self, _gradient_checkpointing: bool) -> Option<MemoryCosts> {
        None
    }
}

impl GroupSampler for CausalLm {
    fn sample_groups(
        &self,
        tok: &Tokenizer,
        prompts: &[PromptInput],
        n: usize,
        params: &SamplingParams,
        on_done: &mut dyn FnMut(usize, usize, &Completion) -> Result<()>,
    ) -> Result<(Vec<Vec<Completion>>, GenStats)> {
        sampler::generate_streaming(self, Some(tok), prompts, n, params, on_done)
    }

    fn sample_episodes(
        &self,
        tok: &Tokenizer,
        prompts: &[PromptInput],
        n: usize,
        params: &SamplingParams,
        max_tokens: usize,
        host: &mut dyn TurnHost,
    ) -> Result<(Vec<Vec<EpisodeTokens>>, GenStats)> {
        episodes::generate_episodes(self, tok, prompts, n, params, max_tokens, host)
    }

    fn sequence_logprobs(
        &self,
        rows: &[(&[u32], &[u32])],
        pad: u32,
        temperature: f64,
        chunk_tokens: usize,
    ) -> Result<Vec<Vec<f32>>> {
        crate::logprobs::sequence_logprobs(self, rows, pad, temperature, chunk_tokens)
    }

    fn memory_costs(&self, gradient_checkpointing: bool) -> Option<MemoryCosts> {
        let c = self.config();
        let bytes = self.dtype().size_in_bytes() as u64;
        Some(MemoryCosts {
            // Keys and values of every layer; twice, as the batched cache is copied from the
            // prompts' and again when finished rows are dropped.
            kv_per_position: 2 * (2 * c.num_layers * c.num_kv_heads * c.head_dim) as u64 * bytes,
            // A step's logits row in f32, on the device and on the host.
            logits: 2 * 4 * c.vocab_size as u64,
            pass_per_token: crate::logprobs::activation_bytes_per_token(
                (c.hidden_size, c.intermediate_size, c.num_layers),
                bytes as usize,
                gradient_checkpointing,
            ),
        })
    }
}

/// Samples `g` completions for each prompt. `seeds[i]` seeds prompt i's group, so a
/// completion depends only on (seed, prompt, sample index), never on the rest of the batch.
/// Returns `P * G` episodes, group-major, with every reward NaN (not scored yet).
pub fn rollout(
    model: &dyn GroupSampler,
    tok: &Tokenizer,
    examples: &[usize],
    prompt_ids: Vec<Vec<u32>>,
    seeds: &[u64],
    g: usize,
    params: &SamplingParams,
) -> Result<(Vec<Episode>, GenStats)> {
    let (eps, stats, _) = rollout_scoring_early(
        model,
        tok,
        examples,
        prompt_ids,
        seeds,
        g,
        params,
        &[],
        &[],
        &[],
    )?;
    Ok((eps, stats))
}

/// What [`rollout`] samples from.
struct Sampler<'a> {
    model: &'a dyn GroupSampler,
    tok: &'a Tokenizer,
    examples: &'a [usize],
    prompt_ids: &'a [Vec<u32>],
    seeds: &'a [u64],
    g: usize,
    params: &'a SamplingParams,
}

impl Sampler<'_> {
    /// Samples; `on_done` receives each episode (group-major index, episode) as soon as its
    /// sample has finished.
    fn run(
        &self,
        on_done: &mut dyn FnMut(usize, Episode) -> Result<()>,
    ) -> Result<(Vec<Episode>, GenStats)> {
        let inputs: Vec<PromptInput> = self
            .prompt_ids
            .iter()
            .zip(self.seeds)
            .map(|(ids, &seed)| PromptInput {
                ids: ids.clone(),
                seed,
            })
            .collect();
        let episode_of = |group: usize, c: &Completion| Episode {
            example: self.examples[group],
            group,
            prompt_ids: self.prompt_ids[group].clone(),
            completion_ids: c.ids.clone(),
            text: c.text.clone(),
            stop_reason: c.stop_reason,
            rewards: vec![],
            agent: None,
        };
        let g = self.g;
        let (groups, stats) = self.model.sample_groups(
            self.tok,
            &inputs,
            g,
            self.params,
            &mut |group, sample, c| on_done(group * g + sample, episode_of(group, c)),
        )?;
        let p = self.examples.len();
        if groups.len() != p || groups.iter().any(|c| c.len() != g) {
            return Err(Error::Invariant(format!(
                "expected {p} x {g} completions, got {:?}",
                groups.iter().map(Vec::len).collect::<Vec<_>>()
            )));
        }
        let episodes = groups
            .iter()
            .enumerate()
            .flat_map(|(group, comps)| comps.iter().map(move |c| (group, c)))
            .map(|(group, c)| episode_of(group, c))
            .collect();
        Ok((episodes, stats))
    }
}

/// Rewards scored while sampling still runs.
#[derive(Debug, Clone, Default)]
pub struct EarlyScores {
    /// `[episode][reward]`: the early rewards' scores, NaN for the others.
    pub scores: Vec<Vec<f32>>,
    /// Seconds each reward spent scoring (0 for the others).
    pub secs: Vec<f64>,
    /// Seconds between the end of sampling and the end of early scoring.
    pub wait_s: f64,
}

impl EarlyScores {
    /// Nothing scored early: `n` episodes, `rewards` rewards.
    pub fn none(n: usize, rewards: usize) -> EarlyScores {
        EarlyScores {
            scores: vec![vec![f32::NAN; rewards]; n],
            secs: vec![0.0; rewards],
            wait_s: 0.0,
        }
    }
}

/// [`rollout`], with the rewards marked in `early` scored on a second thread while sampling goes
/// on: per-completion rewards as soon as each completion has finished (several at once when they
/// queue up), group rewards (diversity) as soon as the whole group has. A scorer program then
/// works while the model decodes.
#[allow(clippy::too_many_arguments)]
pub fn rollout_scoring_early(
    model: &dyn GroupSampler,
    tok: &Tokenizer,
    examples: &[usize],
    prompt_ids: Vec<Vec<u32>>,
    seeds: &[u64],
    g: usize,
    params: &SamplingParams,
    data: &[Example],
    rewards: &[Reward],
    early: &[bool],
) -> Result<(Vec<Episode>, GenStats, EarlyScores)> {
    let sampler = Sampler {
        model,
        tok,
        examples,
        prompt_ids: &prompt_ids,
        seeds,
        g,
        params,
    };
    let nr = rewards.len();
    let n = examples.len() * g;
    if !early.iter().any(|&e| e) {
        let (eps, stats) = sampler.run(&mut |_, _| Ok(()))?;
        let early = EarlyScores {
            scores: vec![vec![f32::NAN; nr]; eps.len()],
            secs: vec![0.0; nr],
            wait_s: 0.0,
        };
        return Ok((eps, stats, early));
    }
    let per_item: Vec<usize> = (0..nr)
        .filter(|&k| early[k] && !rewards[k].is_group_reward())
        .collect();
    let per_group: Vec<usize> = (0..nr)
        .filter(|&k| early[k] && rewards[k].is_group_reward())
        .collect();
    let (tx, rx) = std::sync::mpsc::channel::<(usize, Episode)>();
    std::thread::scope(|scope| {
        let scorer = scope.spawn(move || -> Result<(Vec<Vec<f32>>, Vec<f64>)> {
            let mut scores = vec![vec![f32::NAN; nr]; n];
            let mut secs = vec![0.0; nr];
            let mut groups: Vec<Vec<(usize, Episode)>> = vec![vec![]; examples.len()];
            let mut run =
                |which: &[usize], part: Vec<(usize, Episode)>, scores: &mut Vec<Vec<f32>>| {
                    let (idx, mut eps): (Vec<usize>, Vec<Episode>) = part.into_iter().unzip();
                    let s = score(&mut eps, data, rewards, which, None)?;
                    for (i, ep) in idx.iter().zip(&eps) {
                        for &k in which {
                            scores[*i][k] = ep.rewards[k];
                        }
                    }
                    for &k in which {
                        secs[k] += s[k];
                    }
                    Ok::<_, Error>(eps)
                };
            while let Ok(first) = rx.recv() {
                // Everything that finished meanwhile goes in one call (one batch for a scorer).
                let mut batch = vec![first];
                batch.extend(rx.try_iter());
                let done: Vec<(usize, Episode)> = if per_item.is_empty() {
                    batch
                } else {
                    let idx: Vec<usize> = batch.iter().map(|b| b.0).collect();
                    let eps = run(&per_item, batch, &mut scores)?;
                    idx.into_iter().zip(eps).collect()
                };
                if per_group.is_empty() {
                    continue;
                }
                for (i, ep) in done {
                    let gi = ep.group;
                    groups[gi].push((i, ep));
                    if groups[gi].len() == g {
                        let whole = std::mem::take(&mut groups[gi]);
                        run(&per_group, whole, &mut scores)?;
                    }
                }
            }
            Ok((scores, secs))
        });
        // A send fails only when the scorer has stopped with an error, which `join` reports.
        let sampled = sampler.run(&mut |i, ep| {
            let _ = tx.send((i, ep));
            Ok(())
        });
        drop(tx);
        let t = Instant::now();
        let joined = scorer
            .join()
            .map_err(|_| Error::invariant("the reward scoring thread panicked"))?;
        let wait_s = t.elapsed().as_secs_f64();
        let (eps, stats) = sampled?;
        let (scores, secs) = joined?;
        Ok((
            eps,
            stats,
            EarlyScores {
                scores,
                secs,
                wait_s,
            },
        ))
    })
}

/// Scores `episodes` with the rewards `which` (indices into `rewards`), writing into each
/// episode's `rewards` (sized to all rewards, NaN where not scored); returns seconds per reward
/// (0 for the others). `ref_mean_logps[i]`, when given, is episode i's mean reference log-prob
/// (coherence rewards).
pub fn score(
    episodes: &mut [Episode],
    data: &[Example],
    rewards: &[Reward],
    which: &[usize],
    ref_mean_logps: Option<&[f32]>,
) -> Result<Vec<f64>> {
    let items: Vec<ScoreItem> = episodes
        .iter()
        .enumerate()
        .map(|(i, ep)| ScoreItem {
            group: ep.group,
            completion_tokens: ep.completion_ids.len(),
            completion_ids: Some(&ep.completion_ids),
            ref_mean_logp: ref_mean_logps.map(|m| m[i]),
            messages: ep.agent.as_ref().map(|a| a.messages.as_slice()),
            env_rewards: ep.agent.as_ref().map_or(&[], |a| a.env_rewards.as_slice()),
            ..ScoreItem::new(&data[ep.example], &ep.text)
        })
        .collect();
    let chosen: Vec<&Reward> = which.iter().map(|&k| &rewards[k]).collect();
    let (scores, secs) = crate::rewards::score_refs(&chosen, &items)?;
    let mut all_secs = vec![0.0; rewards.len()];
    for (&k, s) in which.iter().zip(secs) {
        all_secs[k] = s;
    }
    for (ep, s) in episodes.iter_mut().zip(scores) {
        if ep.rewards.len() != rewards.len() {
            ep.rewards = vec![f32::NAN; rewards.len()];
        }
        for (&k, v) in which.iter().zip(s) {
            ep.rewards[k] = v;
        }
    }
    Ok(all_secs)
}

/// Scores `episodes` with the rewards that were not scored while sampling ran (`early[k]` false),
/// now that the reference's mean log-probs exist (coherence rewards), and puts the early scores
/// in; every episode then holds every reward. Returns seconds per reward, both parts together.
pub fn score_rest(
    episodes: &mut [Episode],
    early_scores: EarlyScores,
    early: &[bool],
    data: &[Example],
    rewards: &[Reward],
    ref_mean_logps: Option<&[f32]>,
) -> Result<Vec<f64>> {
    for (ep, s) in episodes.iter_mut().zip(early_scores.scores) {
        ep.rewards = s;
    }
    let late: Vec<usize> = (0..rewards.len()).filter(|&k| !early[k]).collect();
    let late_secs = score(episodes, data, rewards, &late, ref_mean_logps)?;
    Ok(late_secs
        .iter()
        .zip(&early_scores.secs)
        .map(|(a, b)| a + b)
        .collect())
}

/// One completion as the loss sees it.
#[derive(Debug, Clone)]
pub struct TrainRow {
    pub prompt_ids: Vec<u32>,
    pub completion_ids: Vec<u32>,
    /// Whether the completion's tokens count in the loss (false: a truncated completion with
    /// `mask_truncated_completions`).
    pub active: bool,
    pub advantage: f32,
    /// Per completion token, under the policy that sampled it (when off-policy updates need it).
    pub old_logps: Option<Vec<f32>>,
    /// Per completion token, under the reference model (when beta > 0).
    pub ref_logps: Option<Vec<f32>>,
    /// Per completion token, whether it counts in the loss, the KL and the entropy (false: a tool's
    /// or environment's token of a multi-turn episode, TRL's `tool_mask`); `None`: every token.
    pub sampled: Option<Vec<bool>>,
}

impl TrainRow {
    /// Completion tokens that count in the loss.
    pub fn loss_tokens(&self) -> usize {
        match (&self.sampled, self.active) {
            (_, false) => 0,
            (Some(s), true) => s.iter().filter(|&&x| x).count(),
            (None, true) => self.completion_ids.len(),
        }
    }
}

/// A generation batch ready for the update.
#[derive(Debug, Clone, Default)]
pub struct TrainBatch {
    pub rows: Vec<TrainRow>,
}

/// Tensors of one micro-batch, `[N, Tc]` right-padded.
pub struct MicroBatch<'a> {
    pub prompts: Vec<&'a [u32]>,
    pub completions: Vec<&'a [u32]>,
    /// [N, Tc] f32
    pub mask: Tensor,
    /// [N] f32
    pub advantages: Tensor,
    /// [N, Tc] f32
    pub old_logps: Option<Tensor>,
    /// [N, Tc] f32
    pub ref_logps: Option<Tensor>,
}

impl TrainBatch {
    /// The rows of a round: each episode with its advantage and log-probs, leaving out the
    /// episodes `keep` says no to (`drop_zero_std_groups`); a truncated completion's tokens do
    /// not count when `mask_truncated` (`mask_truncated_completions`).
    pub fn from_round(
        episodes: &[Episode],
        advantages: &[f32],
        keep: &dyn Fn(&Episode) -> bool,
        mask_truncated: bool,
        old_logps: Option<&[Vec<f32>]>,
        ref_logps: Option<&[Vec<f32>]>,
    ) -> TrainBatch {
        TrainBatch {
            rows: episodes
                .iter()
                .enumerate()
                .filter(|(_, e)| keep(e))
                .map(|(i, e)| TrainRow {
                    prompt_ids: e.prompt_ids.clone(),
                    completion_ids: e.completion_ids.clone(),
                    active: !(mask_truncated && e.truncated()),
                    advantage: advantages[i],
                    old_logps: old_logps.map(|o| o[i].clone()),
                    ref_logps: ref_logps.map(|r| r[i].clone()),
                    sampled: e.agent.as_ref().map(|a| a.sampled.clone()),
                })
                .collect(),
        }
    }

    /// Completion tokens that count in the loss (TRL's `num_items_in_batch`).
    pub fn active_tokens(&self) -> usize {
        self.active_tokens_in(0..self.rows.len())
    }

    /// Active completion tokens of rows `range`.
    pub fn active_tokens_in(&self, range: std::ops::Range<usize>) -> usize {
        self.rows[range].iter().map(TrainRow::loss_tokens).sum()
    }

    /// Rows `range` as tensors on `dev`.
    pub fn micro(&self, range: std::ops::Range<usize>, dev: &Device) -> Result<MicroBatch<'_>> {
        let rows = &self.rows[range];
        let n = rows.len();
        let tc = rows
            .iter()
            .map(|r| r.completion_ids.len())
            .max()
            .unwrap_or(0);
        let grid = |f: &dyn Fn(&TrainRow) -> Option<&Vec<f32>>| -> Result<Option<Tensor>> {
            if rows.iter().any(|r| f(r).is_none()) {
                return Ok(None);
            }
            let mut v = vec![0f32; n * tc];
            for (i, r) in rows.iter().enumerate() {
                if let Some(x) = f(r) {
                    v[i * tc..i * tc + x.len()].copy_from_slice(x);
                }
            }
            Ok(Some(Tensor::from_vec(v, (n, tc), dev)?))
        };
        let mut mask = vec![0f32; n * tc];
        for (i, r) in rows.iter().enumerate() {
            if !r.active {
                continue;
            }
            let row = &mut mask[i * tc..i * tc + r.completion_ids.len()];
            match &r.sampled {
                Some(s) => row
                    .iter_mut()
                    .zip(s)
                    .for_each(|(m, &x)| *m = if x { 1.0 } else { 0.0 }),
                None => row.fill(1.0),
            }
        }
        Ok(MicroBatch {
            prompts: rows.iter().map(|r| r.prompt_ids.as_slice()).collect(),
            completions: rows.iter().map(|r| r.completion_ids.as_slice()).collect(),
            mask: Tensor::from_vec(mask, (n, tc), dev)?,
            advantages: Tensor::from_vec(rows.iter().map(|r| r.advantage).collect(), n, dev)?,
            old_logps: grid(&|r| r.old_logps.as_ref())?,
            ref_logps: grid(&|r| r.ref_logps.as_ref())?,
        })
    }
}
