//! The seams between sampling, scoring and the loss: rollout produces [`Episode`]s (one per
//! completion, grouped by prompt), rewards fill in their scores, and the update consumes a
//! [`TrainBatch`] (token ids, masks, advantages, old and reference log-probs).

use candle_core::{Device, Tensor};

use crate::data::Example;
use crate::models::CausalLm;
use crate::rewards::{Reward, ScoreItem};
use crate::sampler::{self, Completion, GenStats, PromptInput, SamplingParams, StopReason};
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

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
}

impl Episode {
    pub fn truncated(&self) -> bool {
        self.stop_reason == StopReason::Length
    }
}

/// Samples `g` completions for each prompt. `seeds[i]` seeds prompt i's group, so a
/// completion depends only on (seed, prompt, sample index), never on the rest of the batch.
/// Returns `P * G` episodes, group-major.
pub fn rollout(
    model: &CausalLm,
    tok: &Tokenizer,
    examples: &[usize],
    prompt_ids: Vec<Vec<u32>>,
    seeds: &[u64],
    g: usize,
    params: &SamplingParams,
) -> Result<(Vec<Episode>, GenStats)> {
    let inputs: Vec<PromptInput> = prompt_ids
        .iter()
        .zip(seeds)
        .map(|(ids, &seed)| PromptInput {
            ids: ids.clone(),
            seed,
        })
        .collect();
    let (groups, stats) = sampler::generate(model, Some(tok), &inputs, g, params)?;
    if groups.len() != examples.len() || groups.iter().any(|c| c.len() != g) {
        return Err(Error::Generate(format!(
            "invariant: expected {} x {g} completions, got {:?}",
            examples.len(),
            groups.iter().map(Vec::len).collect::<Vec<_>>()
        )));
    }
    let mut episodes = Vec::with_capacity(examples.len() * g);
    for (group, (comps, ids)) in groups.into_iter().zip(prompt_ids).enumerate() {
        for Completion {
            ids: completion_ids,
            text,
            stop_reason,
            ..
        } in comps
        {
            episodes.push(Episode {
                example: examples[group],
                group,
                prompt_ids: ids.clone(),
                completion_ids,
                text,
                stop_reason,
                rewards: vec![],
            });
        }
    }
    Ok((episodes, stats))
}

/// Scores every episode with every reward function; returns seconds spent per function.
/// `ref_mean_logps[i]`, when given, is episode i's mean reference log-prob (coherence rewards).
pub fn score(
    episodes: &mut [Episode],
    data: &[Example],
    rewards: &[Reward],
    ref_mean_logps: Option<&[f32]>,
) -> Result<Vec<f64>> {
    let items: Vec<ScoreItem> = episodes
        .iter()
        .enumerate()
        .map(|(i, ep)| ScoreItem {
            group: ep.group,
            completion_tokens: ep.completion_ids.len(),
            ref_mean_logp: ref_mean_logps.map(|m| m[i]),
            ..ScoreItem::new(&data[ep.example], &ep.text)
        })
        .collect();
    let (scores, secs) = crate::rewards::score_all(rewards, &items)?;
    for (ep, s) in episodes.iter_mut().zip(scores) {
        ep.rewards = s;
    }
    Ok(secs)
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
    /// Completion tokens that count in the loss (TRL's `num_items_in_batch`).
    pub fn active_tokens(&self) -> usize {
        self.active_tokens_in(0..self.rows.len())
    }

    /// Active completion tokens of rows `range`.
    pub fn active_tokens_in(&self, range: std::ops::Range<usize>) -> usize {
        self.rows[range]
            .iter()
            .filter(|r| r.active)
            .map(|r| r.completion_ids.len())
            .sum()
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
            if r.active {
                mask[i * tc..i * tc + r.completion_ids.len()].fill(1.0);
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

/// Rows of a `[N, Tc]` tensor cut to each completion's length.
pub fn unpad_rows(x: &Tensor, lens: &[usize]) -> Result<Vec<Vec<f32>>> {
    let rows = x.to_dtype(candle_core::DType::F32)?.to_vec2::<f32>()?;
    Ok(rows
        .into_iter()
        .zip(lens)
        .map(|(mut r, &l)| {
            r.truncate(l);
            r
        })
        .collect())
}
