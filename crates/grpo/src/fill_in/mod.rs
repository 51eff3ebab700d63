//! Fill-in policies: a masked-LM generator fills every masked position of its input in one
//! parallel step (a single-step diffusion model). To GRPO a fill is a completion like any other:
//! the *prompt* is the masked input's ids, the *completion* the tokens sampled at its masked
//! positions in order, so episodes, advantages and the loss are the causal LM's. What differs is
//! here: sampling (one forward per input serves its whole group, since every sample of a group
//! sees the same input) and the log-probs (log pi of each sampled token at its masked position).
//!
//! Special tokens (padding, `[CLS]`, `[MASK]`, ...) are never sampled: their logits are pushed
//! to [`MASK_VALUE`] before the temperature, in the sampler and in the trainer alike, so the
//! log-probs the two compute are of the same distribution.
//!
//! What is fill-in lives under this module, so the causal path names none of it:
//! - this file: masking, [`FillInputs`] (a run's masked inputs and fill metrics), the sampler
//!   ([`FillInModel`]) and the trainer's log-probs ([`fill_logprobs`]);
//! - [`task`]: the built-in fill-in task (masked copies `w=w`) and its rewards;
//! - [`pretrain`]: `grpo pretrain`, the supervised pretrainer of small generators, judges and
//!   causal LMs (the built-in fill-in task's models come from it).
//!
//! The policy kind itself, `FillInPolicy` behind the loop's `Policy` seam, is
//! `crate::train::FillInPolicy` (`train/fill_in.rs`): it implements the loop's traits, so it sits
//! with the loop, which this module (used by the data and rewards below the loop) cannot import.

pub mod pretrain;
pub mod task;

use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

use candle_core::{Device, Tensor, D};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub use crate::config::Masking;
use crate::logprobs::{unpad_rows, Entropy};
use crate::rollout::GroupSampler;
use crate::{Error, Result};
use grpo_models::kernels::cpu::fused_attention::MASK_VALUE;
use grpo_models::models::masked_lm::{pad_batch, MaskedLm, MlmTokenizer};
use grpo_models::sampler::{
    choose_token, Completion, GenStats, PromptInput, SamplingParams, StopReason,
};
use grpo_models::seeding::mix_seed;
use grpo_models::tokenizer::Tokenizer;

/// Positions of `mask_id` in `ids`.
pub fn masked_positions(ids: &[u32], mask_id: u32) -> Vec<usize> {
    ids.iter()
        .enumerate()
        .filter(|(_, &t)| t == mask_id)
        .map(|(i, _)| i)
        .collect()
}

/// `ids` with its masked positions replaced by `fills`, in order.
pub fn fill(ids: &[u32], mask_id: u32, fills: &[u32]) -> Vec<u32> {
    let mut it = fills.iter();
    ids.iter()
        .map(|&t| match t == mask_id {
            true => it.next().copied().unwrap_or(t),
            false => t,
        })
        .collect()
}

/// Masks `ids` (`[CLS] chars [SEP]`) for one diffusion-style example: a ratio drawn uniformly
/// from `ratio`, at least one masked character, positions chosen uniformly without replacement
/// among the characters. Returns the masked ids, the masked positions (ascending) and the
/// original tokens there.
pub fn mask_example(
    ids: &[u32],
    ratio: (f64, f64),
    mask_id: u32,
    specials: &[u32],
    rng: &mut impl Rng,
) -> (Vec<u32>, Vec<usize>, Vec<u32>) {
    let content: Vec<usize> = (0..ids.len())
        .filter(|&i| !specials.contains(&ids[i]))
        .collect();
    let r = if ratio.1 > ratio.0 {
        rng.random_range(ratio.0..=ratio.1)
    } else {
        ratio.0
    };
    let k = ((r * content.len() as f64).round() as usize)
        .max(1)
        .min(content.len());
    let mut chosen: Vec<usize> = rand::seq::index::sample(rng, content.len(), k)
        .into_iter()
        .map(|j| content[j])
        .collect();
    chosen.sort_unstable();
    let mut masked = ids.to_vec();
    let targets = chosen.iter().map(|&p| ids[p]).collect();
    for &p in &chosen {
        masked[p] = mask_id;
    }
    (masked, chosen, targets)
}

/// `ids` masked as `m` says, with the draw's own `seed`: a ratio from `m.ratio`, at least one
/// token, never a special token; spans of consecutive content tokens from random starts until
/// the ratio is reached (the last span cut to fit). Spans of 1 are positions drawn without
/// replacement ([`mask_example`], as pretraining masks).
pub fn mask_tokens(
    ids: &[u32],
    m: &Masking,
    mask_id: u32,
    specials: &[u32],
    seed: u64,
) -> Vec<u32> {
    let mut rng = ChaCha8Rng::seed_from_u64(mix_seed(m.seed, seed));
    if m.span == (1, 1) {
        return mask_example(ids, m.ratio, mask_id, specials, &mut rng).0;
    }
    let content: Vec<usize> = (0..ids.len())
        .filter(|&i| !specials.contains(&ids[i]) && ids[i] != mask_id)
        .collect();
    let mut out = ids.to_vec();
    if content.is_empty() {
        return out;
    }
    let r = match m.ratio.1 > m.ratio.0 {
        true => rng.random_range(m.ratio.0..=m.ratio.1),
        false => m.ratio.0,
    };
    let k = ((r * content.len() as f64).round() as usize).clamp(1, content.len());
    let mut masked = vec![false; content.len()];
    let mut left = k;
    // Starts in a random order: every content position is tried at most once, so this ends.
    for start in rand::seq::index::sample(&mut rng, content.len(), content.len()) {
        if left == 0 {
            break;
        }
        let len = rng.random_range(m.span.0..=m.span.1);
        let end = (start + len).min(content.len());
        for m in masked[start..end].iter_mut() {
            if left > 0 && !*m {
                *m = true;
                left -= 1;
            }
        }
    }
    for (j, &p) in content.iter().enumerate() {
        if masked[j] {
            out[p] = mask_id;
        }
    }
    out
}

/// The share of `fills` equal to the `original` tokens at the masked positions of `masked`
/// (`None` when the original does not align with the input).
pub fn fill_accuracy(masked: &[u32], mask_id: u32, fills: &[u32], original: &[u32]) -> Option<f64> {
    if original.len() != masked.len() {
        return None;
    }
    let pos = masked_positions(masked, mask_id);
    if pos.is_empty() || pos.len() != fills.len() {
        return None;
    }
    let right = pos
        .iter()
        .zip(fills)
        .filter(|(&p, &f)| original[p] == f)
        .count();
    Some(right as f64 / pos.len() as f64)
}

/// Metric names of a fill-in run (also in [`crate::train::names`]).
pub const FILL_MASKED_POSITIONS: &str = "fill/masked_positions";
pub const FILL_ACCURACY: &str = "fill/accuracy";
pub const FILL_JUDGE_SCORE: &str = "fill/judge_score";

/// A fill-in run's inputs: masked on the fly when `masking` is set, else as the dataset gives
/// them (every one must hold a mask token), with each input's original tokens where known
/// (for fill accuracy): the unmasked input, or an answer that tokenizes to the input's length.
#[derive(Debug, Clone)]
pub struct FillInputs {
    pub mask_id: u32,
    specials: Vec<u32>,
    masking: Option<Masking>,
    originals: Vec<Option<Vec<u32>>>,
}

/// Seed salt of the held-out inputs' fixed masks.
const EVAL_MASK_SALT: u64 = 0x4556_414c;

impl FillInputs {
    /// Checks the training inputs (`ids`, tokenized from `examples`) and keeps their originals.
    pub fn new(
        masking: Option<Masking>,
        mask_id: u32,
        specials: &[u32],
        tok: &Tokenizer,
        examples: &[crate::data::Example],
        ids: &[Vec<u32>],
    ) -> Result<Self> {
        let mut originals = Vec::with_capacity(ids.len());
        for (ex, ids) in examples.iter().zip(ids) {
            originals.push(match masking {
                Some(_) => {
                    if ids.contains(&mask_id) {
                        return Err(Error::file(
                            &ex.origin,
                            "the input already holds mask tokens, and mask_ratio masks inputs on \
                             the fly: give unmasked text, or unset mask_ratio to fill the \
                             dataset's own masks",
                        ));
                    }
                    Some(ids.clone())
                }
                None => {
                    if !ids.contains(&mask_id) {
                        return Err(Error::file(
                            &ex.origin,
                            format!(
                                "the input has no mask token (write `{}` where the generator \
                                 fills), or set mask_ratio (e.g. mask_ratio = 0.15) to mask text \
                                 inputs on the fly",
                                tok.id_to_token(mask_id).unwrap_or_else(|| "[MASK]".into())
                            ),
                        ));
                    }
                    match &ex.answer {
                        Some(a) => tok.encode(a, true).ok().filter(|o| o.len() == ids.len()),
                        None => None,
                    }
                }
            });
        }
        Ok(Self {
            mask_id,
            specials: specials.to_vec(),
            masking,
            originals,
        })
    }

    /// The input a draw of training example `example` (tokens `ids`) fills: masked with the
    /// draw's `seed` when masking on the fly, else as it is.
    pub fn input(&self, ids: &[u32], seed: u64) -> Vec<u32> {
        match &self.masking {
            Some(m) => mask_tokens(ids, m, self.mask_id, &self.specials, seed),
            None => ids.to_vec(),
        }
    }

    /// Held-out examples masked once (fixed masks, the same every evaluation) when masking on
    /// the fly; their answer is the original text unless they have one.
    pub fn mask_held_out(
        &self,
        tok: &Tokenizer,
        examples: &mut [crate::data::Example],
        max_len: Option<usize>,
    ) -> Result<()> {
        let Some(m) = &self.masking else {
            return Ok(());
        };
        for (i, ex) in examples.iter_mut().enumerate() {
            let ids = crate::data::prompt_ids(tok, ex, None, max_len)?;
            let masked = mask_tokens(
                &ids,
                m,
                self.mask_id,
                &self.specials,
                mix_seed(EVAL_MASK_SALT, i as u64),
            );
            if ex.answer.is_none() {
                ex.answer = Some(crate::data::prompt_text(ex));
            }
            ex.prompt = crate::data::Prompt::Text(self.display(tok, &masked)?);
            ex.tokens = Some(masked);
        }
        Ok(())
    }

    /// An input as text, its mask tokens written out (`12+[MASK]4=...`).
    pub fn display(&self, tok: &Tokenizer, ids: &[u32]) -> Result<String> {
        let mask = tok
            .id_to_token(self.mask_id)
            .unwrap_or_else(|| "[MASK]".into());
        let mut out = String::new();
        let mut run: Vec<u32> = Vec::new();
        for &t in ids {
            if t == self.mask_id {
                out.push_str(&tok.decode(&run, true)?);
                out.push_str(&mask);
                run.clear();
            } else {
                run.push(t);
            }
        }
        out.push_str(&tok.decode(&run, true)?);
        Ok(out)
    }

    /// Fill metrics of a round: masked positions per input and, where originals are known,
    /// the share of fills equal to them.
    pub fn metrics(&self, episodes: &[crate::rollout::Episode]) -> Vec<(String, f64)> {
        let n = episodes.len().max(1) as f64;
        let masked: f64 = episodes
            .iter()
            .map(|e| e.completion_ids.len() as f64)
            .sum::<f64>()
            / n;
        let acc: Vec<f64> = episodes
            .iter()
            .filter_map(|e| {
                let orig = self.originals.get(e.example)?.as_ref()?;
                fill_accuracy(&e.prompt_ids, self.mask_id, &e.completion_ids, orig)
            })
            .collect();
        let mut m = vec![(FILL_MASKED_POSITIONS.to_string(), masked)];
        if !acc.is_empty() {
            m.push((
                FILL_ACCURACY.to_string(),
                acc.iter().sum::<f64>() / acc.len() as f64,
            ));
        }
        m
    }
}

/// A masked LM as a fill-in generator: the model, its mask and padding ids, and the logit bias
/// that keeps special tokens out of fills.
#[derive(Debug, Clone)]
pub struct FillInModel {
    pub lm: MaskedLm,
    pub mask_id: u32,
    pub pad_id: u32,
    /// [V] f32: 0, or MASK_VALUE at special tokens.
    banned: Tensor,
}

/// Logits at the masked positions of distinct inputs: `[M, V]` and, per input, its first row.
struct MaskedLogits {
    logits: Tensor,
    offsets: Vec<usize>,
}

impl FillInModel {
    /// `special_ids`: tokens fills never take (the mask id among them).
    pub fn new(lm: MaskedLm, mask_id: u32, special_ids: &[u32], device: &Device) -> Result<Self> {
        let v = lm.config().vocab_size;
        let mut bias = vec![0f32; v];
        for &s in special_ids.iter().chain([&mask_id]) {
            if let Some(b) = bias.get_mut(s as usize) {
                *b = MASK_VALUE;
            }
        }
        Ok(Self {
            pad_id: lm.config().pad_token_id,
            lm,
            mask_id,
            banned: Tensor::from_vec(bias, v, device)?,
        })
    }

    /// One forward over `inputs` (distinct masked inputs), logits at their masked positions
    /// with special tokens banned.
    fn masked_logits(&self, inputs: &[&[u32]]) -> Result<MaskedLogits> {
        let batch = pad_batch(inputs, self.pad_id);
        let t = batch.ids.first().map_or(0, Vec::len);
        let mut positions = Vec::new();
        let mut offsets = Vec::with_capacity(inputs.len());
        for (b, ids) in inputs.iter().enumerate() {
            offsets.push(positions.len());
            positions.extend(
                masked_positions(ids, self.mask_id)
                    .into_iter()
                    .map(|p| (b * t + p) as u32),
            );
        }
        if positions.is_empty() {
            return Err(Error::Generate(
                "no masked position in the batch: a fill-in input needs at least one mask token"
                    .into(),
            ));
        }
        let hidden = self.lm.hidden_at(&batch, &positions)?; // [M, H]
        let logits = self
            .lm
            .head_logits(&hidden)? // [M, V]
            .broadcast_add(&self.banned)?;
        Ok(MaskedLogits { logits, offsets })
    }
}

/// Loads an HF masked-LM directory as a fill-in generator (detached weights) with its tokenizer.
pub fn load_generator(dir: &Path, device: &Device) -> Result<(FillInModel, Tokenizer)> {
    let lm = MaskedLm::load(dir, device)?;
    let mt = MlmTokenizer::load(dir, lm.config().max_len())?;
    let model = FillInModel::new(lm, mt.mask_id(), mt.special_ids(), device)?;
    Ok((model, Tokenizer::from_hf_dir(dir)?))
}

/// Distinct inputs of `prompts` (a group's rows share theirs) and, per row, its input's index.
fn distinct<'a>(prompts: &[&'a [u32]]) -> (Vec<&'a [u32]>, Vec<usize>) {
    let mut index: HashMap<&[u32], usize> = HashMap::new();
    let mut uniq = Vec::new();
    let which = prompts
        .iter()
        .map(|&p| {
            *index.entry(p).or_insert_with(|| {
                uniq.push(p);
                uniq.len() - 1
            })
        })
        .collect();
    (uniq, which)
}

/// Per-token log-probs `[N, Tc]` of fills `completions[i]` of inputs `prompts[i]` under
/// `softmax(logits / temperature)` at the masked positions (special tokens banned), zero past
/// each row's fill; with `entropy`, the entropies `[N, Tc]` of those distributions too. A graph
/// reaches the parameters when the model was built over tracked tensors.
pub fn fill_logprobs(
    model: &FillInModel,
    prompts: &[&[u32]],
    completions: &[&[u32]],
    temperature: f64,
    entropy: Entropy,
) -> Result<(Tensor, Option<Tensor>)> {
    let (uniq, which) = distinct(prompts);
    let ml = model.masked_logits(&uniq)?;
    let (m, v) = ml.logits.dims2()?;
    let counts: Vec<usize> = uniq
        .iter()
        .map(|p| masked_positions(p, model.mask_id).len())
        .collect();
    let n = completions.len();
    let tc = completions
        .iter()
        .map(|c| c.len())
        .max()
        .unwrap_or(0)
        .max(1);
    // Row i, token j: flat index (its input's j-th masked row) * V + fill; padding reads entry 0
    // and is zeroed by `valid`.
    let (mut lp_idx, mut ent_idx, mut valid) =
        (vec![0u32; n * tc], vec![0u32; n * tc], vec![0f32; n * tc]);
    for (i, c) in completions.iter().enumerate() {
        let u = which[i];
        if c.len() != counts[u] {
            return Err(Error::Invariant(format!(
                "fill {i} has {} tokens for an input with {} masked positions",
                c.len(),
                counts[u]
            )));
        }
        for (j, &tok) in c.iter().enumerate() {
            if tok as usize >= v {
                return Err(Error::Invariant(format!(
                    "fill token {tok} is outside the vocabulary ({v})"
                )));
            }
            let row = ml.offsets[u] + j;
            lp_idx[i * tc + j] = (row * v) as u32 + tok;
            ent_idx[i * tc + j] = row as u32;
            valid[i * tc + j] = 1.0;
        }
    }
    let dev = ml.logits.device();
    let t = if temperature > 0.0 { temperature } else { 1.0 };
    let z = (&ml.logits / t)?; // [M, V]
    let max = z.max_keepdim(D::Minus1)?.detach(); // [M, 1]
    let shifted = z.broadcast_sub(&max)?;
    let e = shifted.exp()?; // [M, V]
    let sum = e.sum_keepdim(D::Minus1)?; // [M, 1]
    let logp = shifted.broadcast_sub(&sum.log()?)?; // [M, V]
    let valid = Tensor::from_vec(valid, (n, tc), dev)?; // [N, Tc]
    let lp_idx = Tensor::from_vec(lp_idx, n * tc, dev)?;
    let lp = logp
        .flatten_all()?
        .index_select(&lp_idx, 0)?
        .reshape((n, tc))?
        .mul(&valid)?; // [N, Tc]
    let ent = match entropy {
        Entropy::Skip => None,
        _ => {
            let p = e.broadcast_div(&sum)?; // [M, V]
            let h = (p * &logp)?.sum(D::Minus1)?.neg()?; // [M]
            let h = if entropy == Entropy::Detached {
                h.detach()
            } else {
                h
            };
            let ent_idx = Tensor::from_vec(ent_idx, n * tc, dev)?;
            Some(h.index_select(&ent_idx, 0)?.reshape((n, tc))?.mul(&valid)?) // [N, Tc]
        }
    };
    debug_assert_eq!(
        m,
        ml.offsets.last().map_or(0, |o| o + counts[uniq.len() - 1])
    );
    Ok((lp, ent))
}

impl GroupSampler for FillInModel {
    /// Every masked position of each input at once, `n` fills per input: one forward per input
    /// (the group's samples share it), then per sample its own RNG seeded from (input seed,
    /// sample index), so a fill does not depend on the rest of the batch. `max_new_tokens`,
    /// stop strings and EOS do not apply.
    fn sample_groups(
        &self,
        tok: &Tokenizer,
        prompts: &[PromptInput],
        n: usize,
        params: &SamplingParams,
        on_done: &mut dyn FnMut(usize, usize, &Completion) -> Result<()>,
    ) -> Result<(Vec<Vec<Completion>>, GenStats)> {
        let t0 = Instant::now();
        let inputs: Vec<&[u32]> = prompts.iter().map(|p| p.ids.as_slice()).collect();
        for (i, ids) in inputs.iter().enumerate() {
            if !ids.contains(&self.mask_id) {
                return Err(Error::Generate(format!(
                    "input {i} has no mask token: nothing to fill"
                )));
            }
        }
        let ml = self.masked_logits(&inputs)?;
        let rows = ml.logits.to_vec2::<f32>()?; // [M][V]
        let prefill_s = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let mut scratch = Vec::new();
        let mut out = Vec::with_capacity(prompts.len());
        let mut generated = 0;
        for (i, p) in prompts.iter().enumerate() {
            let k = masked_positions(&p.ids, self.mask_id).len();
            let mut group = Vec::with_capacity(n);
            for g in 0..n {
                let mut rng = ChaCha8Rng::seed_from_u64(mix_seed(p.seed, g as u64));
                let (mut ids, mut logprobs) = (Vec::with_capacity(k), Vec::with_capacity(k));
                for row in &rows[ml.offsets[i]..ml.offsets[i] + k] {
                    let (t, lp) = choose_token(row, &[], false, params, &mut rng, &mut scratch);
                    ids.push(t);
                    logprobs.push(lp);
                }
                generated += k;
                let text = tok.decode(&fill(&p.ids, self.mask_id, &ids), true)?;
                let c = Completion {
                    ids,
                    text,
                    logprobs,
                    stop_reason: StopReason::Eos,
                };
                on_done(i, g, &c)?;
                group.push(c);
            }
            out.push(group);
        }
        let decode_s = t1.elapsed().as_secs_f64();
        Ok((
            out,
            GenStats {
                prefill_s,
                decode_s,
                sample_s: decode_s,
                issue_s: 0.0,
                prompt_tokens: inputs.iter().map(|p| p.len()).sum(),
                generated_tokens: generated,
                decode_steps: 1,
                compactions: 0,
            },
        ))
    }

    fn sequence_logprobs(
        &self,
        rows: &[(&[u32], &[u32])],
        _pad: u32,
        temperature: f64,
        chunk_tokens: usize,
    ) -> Result<Vec<Vec<f32>>> {
        // Chunks of whole inputs (consecutive rows sharing one) of at most `chunk_tokens` input
        // tokens, each input's forward done once.
        let mut out = Vec::with_capacity(rows.len());
        let mut start = 0;
        while start < rows.len() {
            let mut end = start;
            let mut tokens = 0;
            while end < rows.len() {
                let new_input = end == start || rows[end].0 != rows[end - 1].0;
                let add = if new_input { rows[end].0.len() } else { 0 };
                if end > start && new_input && tokens + add > chunk_tokens.max(1) {
                    break;
                }
                tokens += add;
                end += 1;
            }
            let prompts: Vec<&[u32]> = rows[start..end].iter().map(|r| r.0).collect();
            let comps: Vec<&[u32]> = rows[start..end].iter().map(|r| r.1).collect();
            let (lp, _) = fill_logprobs(self, &prompts, &comps, temperature, Entropy::Skip)?;
            let lens: Vec<usize> = comps.iter().map(|c| c.len()).collect();
            out.extend(unpad_rows(&lp, &lens)?);
            start = end;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Var;
    use grpo_models::models::masked_lm::masked_lm_config;
    use std::path::PathBuf;

    fn fixture(name: &str) -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/fillin")
            .join(name)
    }

    fn model(name: &str, track: bool) -> (FillInModel, Tokenizer, Vec<Var>, Vec<String>) {
        let dir = fixture(name);
        let cfg = masked_lm_config(&dir).unwrap();
        let (tensors, origin) = MaskedLm::read_tensors(&dir, &Device::Cpu).unwrap();
        let mut names: Vec<String> = tensors.keys().cloned().collect();
        names.sort();
        let vars: Vec<Var> = names
            .iter()
            .map(|n| Var::from_tensor(&tensors[n]).unwrap())
            .collect();
        let map = names
            .iter()
            .zip(&vars)
            .map(|(n, v)| {
                let t = v.as_tensor();
                (n.clone(), if track { t.clone() } else { t.detach() })
            })
            .collect();
        let lm = MaskedLm::from_tensors(&cfg, map, &origin).unwrap();
        let mt = MlmTokenizer::load(&dir, cfg.max_len()).unwrap();
        let fm = FillInModel::new(lm, mt.mask_id(), mt.special_ids(), &Device::Cpu).unwrap();
        let tok = Tokenizer::from_hf_dir(&dir).unwrap();
        (fm, tok, vars, names)
    }

    /// Plain-f32 twin: log softmax(z / T)[target] and the entropy of softmax(z / T).
    fn logprob_entropy_slow(z: &[f32], target: usize, t: f32) -> (f32, f32) {
        let z: Vec<f32> = z.iter().map(|x| x / t).collect();
        let m = z.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let s: f32 = z.iter().map(|x| (x - m).exp()).sum();
        let lse = m + s.ln();
        let h = -z
            .iter()
            .map(|x| {
                let lp = x - lse;
                lp.exp() * lp
            })
            .sum::<f32>();
        (z[target] - lse, h)
    }

    fn inputs(tok: &Tokenizer, mask: &str) -> Vec<Vec<u32>> {
        [
            format!("The quick brown {mask} jumps over the {mask} dog."),
            format!("{mask} cat sat on the {mask}."),
        ]
        .iter()
        .map(|t| tok.encode(t, true).unwrap())
        .collect()
    }

    #[test]
    fn fill_logprobs_equal_a_plain_f32_twin_and_reach_every_parameter() {
        for name in ["bert_mlm", "roberta_mlm", "distilbert_mlm"] {
            let (fm, tok, vars, names) = model(name, true);
            let mask = tok.id_to_token(fm.mask_id).unwrap();
            let ins = inputs(&tok, &mask);
            // Two rows per input (a group of 2), fills of ordinary tokens.
            let fills: Vec<Vec<u32>> = [(0, 5u32), (0, 9), (1, 11), (1, 13)]
                .iter()
                .map(|&(i, base)| {
                    let k = masked_positions(&ins[i], fm.mask_id).len();
                    (0..k as u32).map(|j| base + 7 * j).collect()
                })
                .collect();
            let prompts: Vec<&[u32]> = [0, 0, 1, 1].iter().map(|&i| ins[i].as_slice()).collect();
            let comps: Vec<&[u32]> = fills.iter().map(Vec::as_slice).collect();
            let temp = 0.8;
            let (lp, ent) = fill_logprobs(&fm, &prompts, &comps, temp, Entropy::WithGrad).unwrap();
            let (lp_v, ent_v) = (
                lp.to_vec2::<f32>().unwrap(),
                ent.as_ref().unwrap().to_vec2::<f32>().unwrap(),
            );
            // The twin: full logits of each input, banned specials, per position.
            let specials: Vec<u32> = (0..fm.lm.config().vocab_size as u32)
                .filter(|&t| {
                    fm.banned
                        .get(t as usize)
                        .unwrap()
                        .to_scalar::<f32>()
                        .unwrap()
                        < 0.0
                })
                .collect();
            assert!(specials.contains(&fm.mask_id));
            for (r, (&p, c)) in prompts.iter().zip(&comps).enumerate() {
                let batch = pad_batch(&[p], fm.pad_id);
                let logits = fm.lm.logits(&batch).unwrap().get(0).unwrap(); // [T, V]
                for (j, pos) in masked_positions(p, fm.mask_id).into_iter().enumerate() {
                    let mut z = logits.get(pos).unwrap().to_vec1::<f32>().unwrap();
                    for &s in &specials {
                        z[s as usize] += MASK_VALUE;
                    }
                    let (want_lp, want_h) = logprob_entropy_slow(&z, c[j] as usize, temp as f32);
                    assert!((lp_v[r][j] - want_lp).abs() < 1e-4, "{name} [{r},{j}]");
                    assert!((ent_v[r][j] - want_h).abs() < 1e-4, "{name} H[{r},{j}]");
                }
                for j in c.len()..lp_v[r].len() {
                    assert_eq!((lp_v[r][j], ent_v[r][j]), (0.0, 0.0), "padding is zero");
                }
            }
            // A loss over both reaches every parameter.
            let loss = (lp.sum_all().unwrap() + ent.unwrap().sum_all().unwrap()).unwrap();
            let grads = loss.backward().unwrap();
            for (n, v) in names.iter().zip(&vars) {
                let g = grads.get(v.as_tensor());
                let norm = g.map_or(0.0, |g| {
                    g.sqr()
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .to_scalar::<f32>()
                        .unwrap()
                });
                assert!(norm > 0.0, "{name}: no gradient for {n}");
            }
        }
    }

    #[test]
    fn sampling_is_per_sample_seeded_and_its_logprobs_are_the_trainers() {
        let (fm, tok, _, _) = model("bert_mlm", false);
        let mask = tok.id_to_token(fm.mask_id).unwrap();
        let ins = inputs(&tok, &mask);
        let params = SamplingParams {
            temperature: 0.8,
            top_p: 0.95,
            ..SamplingParams::default()
        };
        let prompts: Vec<PromptInput> = ins
            .iter()
            .enumerate()
            .map(|(i, ids)| PromptInput {
                ids: ids.clone(),
                seed: 100 + i as u64,
            })
            .collect();
        let mut seen = 0;
        let (out, stats) = fm
            .sample_groups(&tok, &prompts, 4, &params, &mut |_, _, _| {
                seen += 1;
                Ok(())
            })
            .unwrap();
        assert_eq!((seen, out.len(), out[0].len()), (8, 2, 4));
        assert_eq!(
            stats.generated_tokens,
            4 * ins
                .iter()
                .map(|i| masked_positions(i, fm.mask_id).len())
                .sum::<usize>()
        );
        // The same input alone, same seed: the same fills (no dependence on the batch).
        let (alone, _) = fm
            .sample_groups(&tok, &prompts[1..], 4, &params, &mut |_, _, _| Ok(()))
            .unwrap();
        assert_eq!(
            alone[0].iter().map(|c| &c.ids).collect::<Vec<_>>(),
            out[1].iter().map(|c| &c.ids).collect::<Vec<_>>()
        );
        // Samples of a group differ (random fills), never take a special token, and the text
        // is the filled input.
        assert!(out[0].iter().any(|c| c.ids != out[0][0].ids));
        for c in out.iter().flatten() {
            assert!(c.ids.iter().all(|&t| fm
                .banned
                .get(t as usize)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
                == 0.0));
            assert!(!c.text.contains(&mask), "{}", c.text);
        }
        // The sampler's log-probs are the trainer's (same distribution, same temperature).
        let ins = &ins;
        let rows: Vec<(&[u32], &[u32])> = out
            .iter()
            .enumerate()
            .flat_map(|(i, g)| g.iter().map(move |c| (ins[i].as_slice(), c.ids.as_slice())))
            .collect();
        let lps = fm.sequence_logprobs(&rows, 0, 0.8, 8).unwrap();
        for ((_, c), lp) in rows.iter().zip(out.iter().flatten()).zip(&lps) {
            assert_eq!(lp.len(), c.ids.len());
            for (a, b) in lp.iter().zip(&c.logprobs) {
                assert!((a - b).abs() < 1e-4, "{a} vs {b}");
            }
        }
        // Greedy fills: the argmax, the same for every sample.
        let greedy = SamplingParams {
            temperature: 0.0,
            ..params
        };
        let (g, _) = fm
            .sample_groups(&tok, &prompts, 2, &greedy, &mut |_, _, _| Ok(()))
            .unwrap();
        assert_eq!(g[0][0].ids, g[0][1].ids);
    }

    #[test]
    fn fills_that_do_not_match_their_input_are_errors() {
        let (fm, tok, _, _) = model("distilbert_mlm", false);
        let mask = tok.id_to_token(fm.mask_id).unwrap();
        let ins = inputs(&tok, &mask);
        let e = fill_logprobs(&fm, &[&ins[0]], &[&[5u32][..]], 1.0, Entropy::Skip)
            .unwrap_err()
            .to_string();
        assert!(e.contains("masked positions"), "{e}");
        let plain = tok.encode("no masks here", true).unwrap();
        let e = fm
            .sample_groups(
                &tok,
                &[PromptInput {
                    ids: plain,
                    seed: 0,
                }],
                1,
                &SamplingParams::default(),
                &mut |_, _, _| Ok(()),
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("no mask token"), "{e}");
    }

    #[test]
    fn fill_puts_tokens_at_the_masks_in_order() {
        assert_eq!(fill(&[1, 9, 2, 9, 3], 9, &[7, 8]), vec![1, 7, 2, 8, 3]);
        assert_eq!(masked_positions(&[1, 9, 2, 9, 3], 9), vec![1, 3]);
    }

    #[test]
    fn masks_on_the_fly_follow_ratio_spans_and_seed() {
        // [CLS] 40 content tokens [SEP]; specials 0..5, mask 4.
        let ids: Vec<u32> = std::iter::once(2)
            .chain((0..40).map(|i| 10 + i % 7))
            .chain(std::iter::once(3))
            .collect();
        let specials = [0, 1, 2, 3, 4];
        for span in [(1, 1), (3, 3), (2, 5)] {
            let m = Masking {
                ratio: (0.25, 0.25),
                span,
                seed: 5,
            };
            for seed in 0..20u64 {
                let out = mask_tokens(&ids, &m, 4, &specials, seed);
                let pos = masked_positions(&out, 4);
                assert_eq!(pos.len(), 10, "{span:?}: the ratio of 40 content tokens");
                assert!(out[0] == 2 && out[41] == 3, "specials never masked");
                for (i, (&a, &b)) in ids.iter().zip(&out).enumerate() {
                    assert!(b == 4 || a == b, "{i}: unmasked tokens kept");
                }
                // Same seed, same masks; spans of 3 come in runs (the last may be cut).
                assert_eq!(out, mask_tokens(&ids, &m, 4, &specials, seed));
                if span == (3, 3) {
                    let runs = pos.windows(2).filter(|w| w[1] != w[0] + 1).count() + 1;
                    assert!(runs <= 4, "{pos:?}");
                }
            }
            assert_ne!(
                mask_tokens(&ids, &m, 4, &specials, 1),
                mask_tokens(&ids, &m, 4, &specials, 2),
                "draws differ"
            );
        }
        // A range: between its ends, at least one token.
        let m = Masking {
            ratio: (0.01, 0.5),
            span: (1, 2),
            seed: 0,
        };
        for seed in 0..50u64 {
            let k = masked_positions(&mask_tokens(&ids, &m, 4, &specials, seed), 4).len();
            assert!((1..=20).contains(&k), "{k}");
        }
    }

    #[test]
    fn fill_accuracy_counts_fills_equal_to_the_original() {
        let original = [2, 10, 11, 12, 3];
        let masked = [2, 4, 11, 4, 3];
        assert_eq!(fill_accuracy(&masked, 4, &[10, 99], &original), Some(0.5));
        assert_eq!(fill_accuracy(&masked, 4, &[10, 12], &original), Some(1.0));
        assert_eq!(fill_accuracy(&masked, 4, &[10], &original), None);
        assert_eq!(fill_accuracy(&masked, 4, &[10, 12], &original[..4]), None);
    }

    #[test]
    fn padded_batches_give_each_input_its_own_logits() {
        for name in ["bert_mlm", "roberta_mlm", "distilbert_mlm"] {
            let (fm, tok, _, _) = model(name, false);
            let mask = tok.id_to_token(fm.mask_id).unwrap();
            let texts = [
                format!("The {mask} sat."),
                format!("A much longer line where the {mask} jumps over the lazy {mask} today."),
                format!("{mask} answers {mask} short."),
            ];
            let ids: Vec<Vec<u32>> = texts.iter().map(|t| tok.encode(t, true).unwrap()).collect();
            let refs: Vec<&[u32]> = ids.iter().map(|v| v.as_slice()).collect();
            let batched = fm
                .masked_logits(&refs)
                .unwrap()
                .logits
                .to_vec2::<f32>()
                .unwrap();
            let mut alone = Vec::new();
            for r in &refs {
                alone.extend(
                    fm.masked_logits(&[r])
                        .unwrap()
                        .logits
                        .to_vec2::<f32>()
                        .unwrap(),
                );
            }
            assert_eq!(batched.len(), alone.len());
            for (a, b) in batched.iter().zip(&alone) {
                let d = a
                    .iter()
                    .zip(b)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0f32, f32::max);
                assert!(d < 1e-4, "{name}: padded row differs by {d}");
            }
        }
    }
}
