//! Batched, KV-cached, group-aware sampling.
//!
//! For P prompts and G samples each: all prompts are prefilled once, in one forward, left-padded to
//! the longest; each prompt's keys/values are then copied into its G rows of one batched cache, so
//! that every decoding step writes all rows at the same slot with one in-place copy. Each row has its
//! own RNG seeded from (prompt seed, sample index), so a completion does not depend on what else is
//! in the batch. Finished rows are dropped from the cache once enough of them have finished.
//!
//! Log-probs: each sampled token's log-prob is `log softmax(logits / T)` of the model's raw logits,
//! i.e. under the sampling temperature but *before* the repetition penalty and top-k / top-p / min-p
//! truncation. This is the quantity the trainer's forward computes (same temperature), so the two can
//! be compared directly. With T = 0 (greedy) the log-prob is taken at T = 1.
//!
//! Tokens are chosen on the host from each step's logits when grpo's fused CPU kernels run (f32
//! on the CPU), and on the logits' device otherwise ([`device`]: a GPU, bf16, `kernels =
//! "portable"`), where only a few hundred numbers per row come back instead of the vocabulary.
//! Both draw the row's one uniform per token from the row's RNG and pick by inverse CDF.

mod device;
pub mod episodes;
mod lanes;

use lanes::Lanes;

use crate::seeding::mix_seed;
use std::time::Instant;

use candle_core::Tensor;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use crate::kernels::cpu::vmath;
use crate::kv_cache::KvCache;
use crate::models::{AttnMask, CausalLm, SeqBatch};
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

/// How to sample. Defaults follow HF `generate` / TRL where they have the option.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub max_new_tokens: usize,
    /// EOS is suppressed until this many tokens were generated (HF `min_new_tokens`).
    pub min_new_tokens: usize,
    /// 0 means greedy.
    pub temperature: f64,
    /// 0 disables.
    pub top_k: usize,
    /// 1 disables.
    pub top_p: f64,
    /// 0 disables.
    pub min_p: f64,
    /// 1 disables (HF / CTRL semantics: divide positive logits, multiply negative ones).
    pub repetition_penalty: f64,
    /// Generation stops once the completion text contains one of these (kept in the output).
    pub stop_strings: Vec<String>,
    pub eos_token_ids: Vec<u32>,
    /// Sequences decoded at once, in whole groups (at least one group); 0: every prompt's group
    /// together. Bounds the KV cache's memory; a completion does not depend on it.
    pub max_batch_sequences: usize,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            max_new_tokens: 256,
            min_new_tokens: 0,
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            stop_strings: vec![],
            eos_token_ids: vec![],
            max_batch_sequences: 0,
        }
    }
}

impl SamplingParams {
    /// Checks ranges; the key names are the CLI's / TRL's.
    pub fn validate(&self) -> Result<()> {
        let bad = |k: &str, m: &str| Err(Error::config(k, m));
        if self.max_new_tokens == 0 {
            return bad("max_new_tokens", "must be at least 1");
        }
        if self.min_new_tokens > self.max_new_tokens {
            return bad("min_new_tokens", "must not exceed max_new_tokens");
        }
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad("temperature", "must be >= 0 (0 = greedy)");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", "must be in (0, 1]");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", "must be in [0, 1]");
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return bad("repetition_penalty", "must be > 0 (1 = off)");
        }
        if self.stop_strings.iter().any(|s| s.is_empty()) {
            return bad("stop_strings", "must not contain an empty string");
        }
        Ok(())
    }
}

/// Why a completion ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// An EOS token was sampled (it is the last id of the completion).
    Eos,
    /// The text contains a stop string.
    StopString,
    /// `max_new_tokens` reached.
    Length,
}

/// One prompt to sample from.
#[derive(Debug, Clone)]
pub struct PromptInput {
    pub ids: Vec<u32>,
    /// Seed of this prompt's group; sample g uses a seed derived from (seed, g).
    pub seed: u64,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct Completion {
    pub ids: Vec<u32>,
    /// Decoded without special tokens (empty when no tokenizer was given).
    pub text: String,
    /// Log-prob of each sampled token (see the module docs for which distribution).
    pub logprobs: Vec<f32>,
    pub stop_reason: StopReason,
}

/// Where the time went.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct GenStats {
    pub prefill_s: f64,
    pub decode_s: f64,
    /// Part of decode_s spent choosing tokens on the CPU (logit processing, sampling).
    pub sample_s: f64,
    /// Where tokens are chosen on the logits' device (a GPU): the host's time to issue the
    /// decoding steps' forwards, without waiting for them. Near the forwards' time (decode_s -
    /// sample_s under `GRPO_PROFILE`) when decoding waits on the host's launches, well below it
    /// when it waits on the device. 0 elsewhere.
    pub issue_s: f64,
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub decode_steps: usize,
    pub compactions: usize,
}

impl GenStats {
    /// Adds another pass's figures.
    pub fn add(&mut self, o: &GenStats) {
        self.prefill_s += o.prefill_s;
        self.decode_s += o.decode_s;
        self.sample_s += o.sample_s;
        self.issue_s += o.issue_s;
        self.prompt_tokens += o.prompt_tokens;
        self.generated_tokens += o.generated_tokens;
        self.decode_steps += o.decode_steps;
        self.compactions += o.compactions;
    }
}

struct Row {
    prompt: usize,
    rng: ChaCha8Rng,
    /// Prompt ids followed by generated ids (for the repetition penalty).
    seen: Vec<u32>,
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    done: Option<StopReason>,
    /// Scratch buffer for logit processing.
    scratch: Vec<f32>,
    text_len: usize,
    /// Tokens this row may sample (in this turn of an episode).
    limit: usize,
    /// Position of the first token sampled (in this turn): the tokens before it in its sequence.
    start: usize,
    /// Key slots of the batched cache before this row's first token (left padding).
    pad: usize,
}

/// Samples `n` completions for each prompt. Returns them grouped by prompt, in sample order.
pub fn generate(
    model: &CausalLm,
    tokenizer: Option<&Tokenizer>,
    prompts: &[PromptInput],
    n: usize,
    params: &SamplingParams,
) -> Result<(Vec<Vec<Completion>>, GenStats)> {
    // On a pool worker, so that the caller does its share of every parallel kernel.
    crate::threads::on_pool(|| {
        generate_streaming(model, tokenizer, prompts, n, params, &mut |_, _, _| Ok(()))
    })
}

/// [`generate`], calling `on_done(prompt index, sample index, completion)` as soon as a sample
/// has finished, while the others are still being decoded (each sample once; the ones that run
/// to `max_new_tokens` are reported after the last step).
pub fn generate_streaming(
    model: &CausalLm,
    tokenizer: Option<&Tokenizer>,
    prompts: &[PromptInput],
    n: usize,
    params: &SamplingParams,
    on_done: &mut dyn FnMut(usize, usize, &Completion) -> Result<()>,
) -> Result<(Vec<Vec<Completion>>, GenStats)> {
    check_prompts(model, tokenizer, prompts, n, params, params.max_new_tokens)?;
    let mut stats = GenStats::default();
    if prompts.is_empty() {
        return Ok((vec![], stats));
    }
    let cap = params.max_batch_sequences;
    if cap > 0 && prompts.len() * n > cap {
        // Whole groups per pass; each pass is an independent call.
        let per = (cap / n).max(1);
        let one_pass = SamplingParams {
            max_batch_sequences: 0,
            ..params.clone()
        };
        let mut groups = Vec::with_capacity(prompts.len());
        for (c, chunk) in prompts.chunks(per).enumerate() {
            let base = c * per;
            let (g, s) =
                generate_streaming(model, tokenizer, chunk, n, &one_pass, &mut |gi, si, x| {
                    on_done(base + gi, si, x)
                })?;
            groups.extend(g);
            stats.add(&s);
        }
        return Ok((groups, stats));
    }
    // 1-2. Prefill every prompt once; each row's first token from its prompt's last logits.
    let (mut rows, prompt_cache, lmax) =
        start_rows(model, tokenizer, prompts, n, params, &mut stats)?;
    let t1 = Instant::now();

    // Finished samples' completions, each reported once through `on_done`.
    let mut out: Vec<Option<Completion>> = (0..rows.len()).map(|_| None).collect();
    let mut report = |rows: &[Row], out: &mut [Option<Completion>], all: bool| -> Result<()> {
        for (r, slot) in out.iter_mut().enumerate() {
            if slot.is_some() || !(all || rows[r].done.is_some()) {
                continue;
            }
            let c = completion_of(&rows[r], tokenizer)?;
            on_done(rows[r].prompt, r % n, &c)?;
            *slot = Some(c);
        }
        Ok(())
    };
    report(&rows, &mut out, false)?;

    // 3. Batched cache: each row gets its prompt's (left-padded) keys and values, plus room.
    let batch: Vec<usize> = (0..rows.len())
        .filter(|&r| rows[r].done.is_none())
        .collect();
    if !batch.is_empty() {
        let cache = batch_cache(model, &prompt_cache, &rows, &batch, params)?;
        drop(prompt_cache);
        // 4. Decode until every row is done.
        let mut lanes = Lanes {
            model,
            params,
            tokenizer,
            shared_end: Some(lmax),
            groups: prompts.len(),
            stats: &mut stats,
        };
        lanes.decode(
            &mut rows,
            batch,
            cache,
            &mut |rows| report(rows, &mut out, false),
            &mut |_, _, _, _| Ok(()),
        )?;
    }
    stats.decode_s = t1.elapsed().as_secs_f64();

    // 5. Collect (rows that ran to max_new_tokens are reported now).
    report(&rows, &mut out, true)?;
    stats.generated_tokens = rows.iter().map(|r| r.tokens.len()).sum();
    let mut all = out.into_iter().flatten();
    let groups = (0..prompts.len())
        .map(|_| all.by_ref().take(n).collect())
        .collect();
    Ok((groups, stats))
}

/// The checks every sampling call makes before it starts: the parameters, and each prompt (not
/// empty, inside the vocabulary, and room for `new_tokens` after it in the model's context).
fn check_prompts(
    model: &CausalLm,
    tokenizer: Option<&Tokenizer>,
    prompts: &[PromptInput],
    n: usize,
    params: &SamplingParams,
    new_tokens: usize,
) -> Result<()> {
    params.validate()?;
    if n == 0 {
        return Err(Error::config("num_generations", "must be at least 1"));
    }
    if !params.stop_strings.is_empty() && tokenizer.is_none() {
        return Err(Error::config("stop_strings", "need a tokenizer"));
    }
    let vocab = model.config().vocab_size;
    let ctx = model.max_positions();
    for (i, p) in prompts.iter().enumerate() {
        if p.ids.is_empty() {
            return Err(Error::Generate(format!("prompt {i} is empty")));
        }
        if p.ids.len() + new_tokens > ctx {
            return Err(Error::Generate(format!(
                "prompt {i} has {} tokens; with {new_tokens} new tokens (max_new_tokens, or an episode's budget) that exceeds the model's context of {ctx} positions: shorten the prompt or lower max_new_tokens",
                p.ids.len()
            )));
        }
        if let Some(&bad) = p.ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::Generate(format!(
                "prompt {i} contains token id {bad}, outside the model's vocabulary of {vocab}"
            )));
        }
    }
    Ok(())
}

/// Steps 1-2 of sampling: prefills every prompt once, all in one forward, left-padded to the
/// longest, and chooses each row's first token from its prompt's last logits. Returns the rows
/// (prompt-major, `n` per prompt), the prompts' cache and the longest prompt's length.
fn start_rows(
    model: &CausalLm,
    tokenizer: Option<&Tokenizer>,
    prompts: &[PromptInput],
    n: usize,
    params: &SamplingParams,
    stats: &mut GenStats,
) -> Result<(Vec<Row>, KvCache, usize)> {
    let device = model.device().clone();
    let t0 = Instant::now();
    let lmax = prompts.iter().map(|p| p.ids.len()).max().unwrap_or(0);
    let seqs: Vec<Vec<u32>> = prompts.iter().map(|p| p.ids.clone()).collect();
    let pre = SeqBatch::left_padded(&seqs, 0, &device)?;
    let mut prompt_cache = model.new_cache(prompts.len(), lmax)?;
    let h = model.forward_cached(
        &pre.ids,
        &pre.positions,
        &AttnMask::dense(pre.mask.clone())?,
        &mut prompt_cache,
    )?; // [P, Lmax, H]
    let last = h.narrow(1, lmax - 1, 1)?.squeeze(1)?; // [P, H]
    let first = model.logits(&last)?; // [P, V]
    stats.prompt_tokens = seqs.iter().map(|s| s.len()).sum();
    drop(h);
    stats.prefill_s = t0.elapsed().as_secs_f64();

    let mut rows: Vec<Row> = Vec::with_capacity(prompts.len() * n);
    for (pi, p) in prompts.iter().enumerate() {
        for g in 0..n {
            rows.push(Row {
                prompt: pi,
                rng: ChaCha8Rng::seed_from_u64(mix_seed(p.seed, g as u64)),
                seen: p.ids.clone(),
                tokens: Vec::with_capacity(params.max_new_tokens),
                logprobs: Vec::with_capacity(params.max_new_tokens),
                done: None,
                scratch: Vec::new(),
                text_len: 0,
                limit: params.max_new_tokens,
                start: p.ids.len(),
                pad: lmax - p.ids.len(),
            });
        }
    }
    // Row r takes its first token from its prompt's logits.
    let of_prompt: Vec<usize> = rows.iter().map(|r| r.prompt).collect();
    let all: Vec<usize> = (0..rows.len()).collect();
    let ts = Instant::now();
    first_tokens(
        model, &mut rows, &all, &first, &of_prompt, params, tokenizer,
    )?;
    stats.sample_s += ts.elapsed().as_secs_f64();
    Ok((rows, prompt_cache, lmax))
}

/// Chooses the next token of each of `rows` `which[i]` from row `logit_row[i]` of `logits`
/// [N, V], on the logits' device off the fused CPU path, on the host on it.
fn first_tokens(
    model: &CausalLm,
    rows: &mut [Row],
    which: &[usize],
    logits: &Tensor,
    logit_row: &[usize],
    params: &SamplingParams,
    tokenizer: Option<&Tokenizer>,
) -> Result<()> {
    if !model.compute().is_fused() {
        let idx: Vec<u32> = logit_row.iter().map(|&i| i as u32).collect();
        let idx = Tensor::from_vec(idx, which.len(), logits.device())?;
        return step_rows_on_device(
            rows,
            which,
            &logits.index_select(&idx, 0)?,
            params,
            tokenizer,
        );
    }
    let all_logits: Vec<f32> = logits.flatten_all()?.to_vec1()?; // [N*V]
    let v = all_logits.len() / logits.dim(0)?.max(1);
    let mut at = vec![usize::MAX; rows.len()];
    which.iter().zip(logit_row).for_each(|(&r, &l)| at[r] = l);
    rows.par_iter_mut()
        .enumerate()
        .filter(|(r, _)| at[*r] != usize::MAX)
        .try_for_each(|(r, row)| {
            let a = at[r] * v;
            step_row(row, &all_logits[a..a + v], params, tokenizer)
        })
}

/// The finished (or length-stopped) completion of `row`.
fn completion_of(row: &Row, tokenizer: Option<&Tokenizer>) -> Result<Completion> {
    Ok(Completion {
        ids: row.tokens.clone(),
        text: match tokenizer {
            Some(t) => t.decode(&row.tokens, true)?,
            None => String::new(),
        },
        logprobs: row.logprobs.clone(),
        stop_reason: row.done.unwrap_or(StopReason::Length),
    })
}

/// The batched cache for `batch` rows: each row's prompt keys/values (already left-padded by the
/// prefill), followed by room for the first generated tokens (it grows as decoding goes on).
fn batch_cache(
    model: &CausalLm,
    prompt_cache: &KvCache,
    rows: &[Row],
    batch: &[usize],
    params: &SamplingParams,
) -> Result<KvCache> {
    let cfg = model.config();
    let device = model.device();
    let idx: Vec<u32> = batch.iter().map(|&r| rows[r].prompt as u32).collect();
    let idx = Tensor::new(idx.as_slice(), device)?;
    let room = Tensor::zeros(
        (
            batch.len(),
            cfg.num_kv_heads,
            first_room(params.max_new_tokens),
            cfg.head_dim,
        ),
        model.dtype(),
        device,
    )?;
    let mut ks = Vec::with_capacity(cfg.num_layers);
    let mut vs = Vec::with_capacity(cfg.num_layers);
    for layer in 0..cfg.num_layers {
        let (k, v) = prompt_cache.layer(layer)?; // [P, Hkv, Lmax, D]
        ks.push(Tensor::cat(&[&k.index_select(&idx, 0)?, &room], 2)?); // [b, Hkv, Lmax+N, D]
        vs.push(Tensor::cat(&[&v.index_select(&idx, 0)?, &room], 2)?);
    }
    Ok(KvCache::from_parts(ks, vs, prompt_cache.len())?)
}

/// Slots a decoding cache starts with for up to `tokens` new tokens: [`KvCache::reserve`] adds
/// the rest if the rows get that far.
fn first_room(tokens: usize) -> usize {
    tokens.min(crate::kv_cache::GROW_MIN)
}

/// Chooses the next token of `row` from its raw `logits` and updates its stop state.
fn step_row(
    row: &mut Row,
    logits: &[f32],
    params: &SamplingParams,
    tokenizer: Option<&Tokenizer>,
) -> Result<()> {
    let suppress_eos = row.tokens.len() < params.min_new_tokens;
    let (tok, lp) = choose_token(
        logits,
        &row.seen,
        suppress_eos,
        params,
        &mut row.rng,
        &mut row.scratch,
    );
    advance(row, tok, lp, suppress_eos, params, tokenizer)
}

/// [`step_row`] for the rows `batch` (not yet done ones; done ones are skipped and draw nothing),
/// whose logits are the rows of `logits` [batch.len(), V], with the tokens chosen on its device.
fn step_rows_on_device(
    rows: &mut [Row],
    batch: &[usize],
    logits: &Tensor,
    params: &SamplingParams,
    tokenizer: Option<&Tokenizer>,
) -> Result<()> {
    let greedy = params.temperature <= 0.0;
    let mut draws = Vec::with_capacity(batch.len());
    for &r in batch {
        let row = &mut rows[r];
        let live = row.done.is_none();
        draws.push(match live && !greedy {
            true => row.rng.random::<f64>(),
            false => 0.0,
        });
    }
    let picks = {
        let view: Vec<device::DeviceRow<'_>> = batch
            .iter()
            .zip(&draws)
            .map(|(&r, &u)| device::DeviceRow {
                seen: &rows[r].seen,
                suppress_eos: rows[r].tokens.len() < params.min_new_tokens,
                u,
            })
            .collect();
        device::choose_tokens(logits, &view, params)?
    };
    let mut pick_of = vec![None; rows.len()];
    batch
        .iter()
        .zip(picks)
        .for_each(|(&r, p)| pick_of[r] = Some(p));
    rows.par_iter_mut()
        .zip(pick_of)
        .filter(|(row, p)| row.done.is_none() && p.is_some())
        .try_for_each(|(row, p)| {
            // Rows without a pick were filtered out just above.
            let (tok, lp) =
                p.ok_or_else(|| Error::invariant("a sampling row to advance has no token"))?;
            let suppress_eos = row.tokens.len() < params.min_new_tokens;
            advance(row, tok, lp, suppress_eos, params, tokenizer)
        })
}

/// Appends the chosen token `tok` (log-prob `lp`) to `row` and updates its stop state.
fn advance(
    row: &mut Row,
    tok: u32,
    lp: f32,
    suppress_eos: bool,
    params: &SamplingParams,
    tokenizer: Option<&Tokenizer>,
) -> Result<()> {
    row.tokens.push(tok);
    row.logprobs.push(lp);
    row.seen.push(tok);
    if !suppress_eos && params.eos_token_ids.contains(&tok) {
        row.done = Some(StopReason::Eos);
    } else if let (false, Some(t)) = (params.stop_strings.is_empty(), tokenizer) {
        let text = t.decode(&row.tokens, false)?;
        let longest = params
            .stop_strings
            .iter()
            .map(|s| s.len())
            .max()
            .unwrap_or(0);
        let mut from = row.text_len.saturating_sub(longest);
        while !text.is_char_boundary(from) {
            from -= 1;
        }
        if params
            .stop_strings
            .iter()
            .any(|s| text[from..].contains(s.as_str()))
        {
            row.done = Some(StopReason::StopString);
        }
        row.text_len = text.len();
    }
    if row.done.is_none() && row.tokens.len() >= row.limit {
        row.done = Some(StopReason::Length);
    }
    Ok(())
}

/// One token from raw logits: repetition penalty, EOS suppression, temperature, top-k, top-p,
/// min-p (HF's order), then a draw from `rng`. Returns the token and its log-prob (module docs).
///
/// In the common case (no repetition penalty) one exp pass over the vocabulary serves both the
/// log-prob normaliser and the draw.
pub fn choose_token(
    logits: &[f32],
    seen: &[u32],
    suppress_eos: bool,
    params: &SamplingParams,
    rng: &mut impl Rng,
    scratch: &mut Vec<f32>,
) -> (u32, f32) {
    let greedy = params.temperature <= 0.0;
    let t = if greedy {
        1.0
    } else {
        params.temperature as f32
    };
    let penalised = params.repetition_penalty != 1.0;
    // Raw probabilities (unnormalised) at temperature t, and their sum for the log-prob.
    let m = vmath::max(logits);
    scratch.clear();
    scratch.resize(logits.len(), 0.0);
    let raw_sum = vmath::exp_scaled(logits, m, t, scratch);
    let logprob = |tok: usize| (logits[tok] - m) / t - raw_sum.ln() as f32;
    if penalised {
        // Penalised logits, then their probabilities (a second pass, only in this case).
        scratch.clear();
        scratch.extend_from_slice(logits);
        let p = params.repetition_penalty as f32;
        let mut done = std::collections::HashSet::with_capacity(seen.len());
        for &s in seen {
            if let Some(v) = scratch.get_mut(s as usize) {
                if done.insert(s) {
                    *v = if *v < 0.0 { *v * p } else { *v / p };
                }
            }
        }
        let m2 = vmath::max(scratch);
        scratch
            .iter_mut()
            .for_each(|v| *v = vmath::exp((*v - m2) / t));
    }
    if suppress_eos {
        for &e in &params.eos_token_ids {
            if let Some(v) = scratch.get_mut(e as usize) {
                *v = 0.0;
            }
        }
    }
    let tok = if greedy {
        greedy_token(logits, seen, suppress_eos, params)
    } else if params.top_k > 0 || params.top_p < 1.0 || params.min_p > 0.0 {
        sample_truncated(scratch, params, rng)
    } else {
        sample_full(scratch, rng)
    };
    (tok as u32, logprob(tok))
}

/// Argmax of the processed logits (penalty applied, suppressed EOS excluded), compared as logits
/// so that near-ties are not merged by exp underflow.
fn greedy_token(
    logits: &[f32],
    seen: &[u32],
    suppress_eos: bool,
    params: &SamplingParams,
) -> usize {
    let p = params.repetition_penalty as f32;
    let seen: std::collections::HashSet<u32> = if p != 1.0 {
        seen.iter().copied().collect()
    } else {
        Default::default()
    };
    let mut best = (0usize, f32::NEG_INFINITY);
    for (i, &x) in logits.iter().enumerate() {
        if suppress_eos && params.eos_token_ids.contains(&(i as u32)) {
            continue;
        }
        let v = if seen.contains(&(i as u32)) {
            if x < 0.0 {
                x * p
            } else {
                x / p
            }
        } else {
            x
        };
        if v > best.1 {
            best = (i, v);
        }
    }
    best.0
}

/// Inverse-CDF draw from unnormalised probabilities.
fn sample_full(p: &[f32], rng: &mut impl Rng) -> usize {
    pick(p, rng.random::<f64>()).0
}

/// Where `target` (an amount of `p`'s mass) falls: the index of the first positive entry whose
/// cumulative sum exceeds it, and how much of the draw is left inside that entry (the last
/// positive entry, and all of it, when rounding carries the draw past the end).
fn scan(p: &[f32], target: f64) -> (usize, f64) {
    let mut left = target;
    let mut last = (0, 0.0);
    for (i, &x) in p.iter().enumerate() {
        if x > 0.0 {
            if left < x as f64 {
                return (i, left);
            }
            left -= x as f64;
            last = (i, x as f64);
        }
    }
    last
}

/// Where the draw `u` in [0, 1) falls in `p`'s mass (see [`scan`]): the host sampler's draw
/// over the vocabulary, and the device sampler's choice of a block from the block sums.
fn pick(p: &[f32], u: f64) -> (usize, f64) {
    let total: f64 = p.iter().map(|&x| x as f64).sum();
    scan(p, u * total)
}

/// top-k, then top-p on the renormalised rest, then min-p, then a draw.
fn sample_truncated(p: &[f32], params: &SamplingParams, rng: &mut impl Rng) -> usize {
    let v = p.len();
    let mut idx: Vec<u32> = (0..v as u32).collect();
    let by_prob_desc = |a: &u32, b: &u32| p[*b as usize].total_cmp(&p[*a as usize]);
    // Candidates sorted by probability, descending: only as many as needed.
    let k = if params.top_k > 0 {
        params.top_k.min(v)
    } else {
        v
    };
    let want = if params.top_p < 1.0 || k < v {
        k.min(1024)
    } else {
        v
    };
    if want < v {
        idx.select_nth_unstable_by(want - 1, by_prob_desc);
        idx.truncate(want);
    }
    idx.sort_unstable_by(by_prob_desc);
    if idx.len() < k && params.top_p < 1.0 {
        // The nucleus might need more than the partial sort kept: check its mass, else sort all.
        let kept: f64 = idx.iter().map(|&i| p[i as usize] as f64).sum();
        let all: f64 = p.iter().map(|&x| x as f64).sum();
        if kept < params.top_p * all {
            idx = (0..v as u32).collect();
            idx.sort_unstable_by(by_prob_desc);
        }
    }
    idx.truncate(k);
    if params.top_p < 1.0 {
        let mass: f64 = idx.iter().map(|&i| p[i as usize] as f64).sum();
        let mut acc = 0.0;
        let mut keep = idx.len();
        for (j, &i) in idx.iter().enumerate() {
            acc += p[i as usize] as f64;
            // HF keeps the smallest set whose mass reaches top_p (at least one token).
            if acc >= params.top_p * mass {
                keep = j + 1;
                break;
            }
        }
        idx.truncate(keep.max(1));
    }
    if params.min_p > 0.0 {
        let top = p[idx[0] as usize];
        let floor = params.min_p as f32 * top;
        idx.retain(|&i| p[i as usize] >= floor);
    }
    let total: f64 = idx.iter().map(|&i| p[i as usize] as f64).sum();
    let mut u = rng.random::<f64>() * total;
    for &i in &idx {
        u -= p[i as usize] as f64;
        if u < 0.0 {
            return i as usize;
        }
    }
    idx[idx.len() - 1] as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> SamplingParams {
        SamplingParams {
            eos_token_ids: vec![0],
            ..Default::default()
        }
    }

    #[test]
    fn greedy_picks_argmax_and_reports_t1_logprob() {
        let p = SamplingParams {
            temperature: 0.0,
            ..params()
        };
        let logits = [1.0f32, 3.0, 2.0];
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let (tok, lp) = choose_token(&logits, &[], false, &p, &mut rng, &mut vec![]);
        assert_eq!(tok, 1);
        let z: f32 = logits.iter().map(|x| x.exp()).sum();
        assert!((lp - (3.0f32.exp() / z).ln()).abs() < 1e-6);
    }

    #[test]
    fn top_k_and_top_p_and_min_p_restrict_support() {
        let logits: Vec<f32> = vec![0.0, 5.0, 4.9, 1.0, -2.0, 4.0];
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let check = |p: SamplingParams, allowed: &[u32], rng: &mut ChaCha8Rng| {
            for _ in 0..300 {
                let (tok, _) = choose_token(&logits, &[], false, &p, rng, &mut vec![]);
                assert!(allowed.contains(&tok), "{tok} not in {allowed:?} for {p:?}");
            }
        };
        check(
            SamplingParams {
                top_k: 2,
                ..params()
            },
            &[1, 2],
            &mut rng,
        );
        // probs ~ [.., .41, .37, .., .., .15]: 0.7 needs the top two.
        check(
            SamplingParams {
                top_p: 0.7,
                ..params()
            },
            &[1, 2],
            &mut rng,
        );
        check(
            SamplingParams {
                min_p: 0.5,
                ..params()
            },
            &[1, 2],
            &mut rng,
        );
        check(
            SamplingParams {
                min_p: 0.3,
                ..params()
            },
            &[1, 2, 5],
            &mut rng,
        );
    }

    #[test]
    fn sampling_follows_the_distribution() {
        let logits = [0.0f32, (3.0f32).ln()]; // p = [0.25, 0.75]
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let p = params();
        let ones = (0..4000)
            .filter(|_| choose_token(&logits, &[], false, &p, &mut rng, &mut vec![]).0 == 1)
            .count();
        assert!((2850..3150).contains(&ones), "{ones}");
    }

    #[test]
    fn repetition_penalty_and_eos_suppression() {
        let p = SamplingParams {
            temperature: 0.0,
            repetition_penalty: 4.0,
            ..params()
        };
        let logits = [10.0f32, 3.0, 2.0];
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        // EOS (id 0) suppressed: token 1 wins; seen token 1 is penalised 3 -> 0.75: token 2 wins.
        assert_eq!(
            choose_token(&logits, &[], true, &p, &mut rng, &mut vec![]).0,
            1
        );
        assert_eq!(
            choose_token(&logits, &[1], true, &p, &mut rng, &mut vec![]).0,
            2
        );
    }

    #[test]
    fn validate_names_the_option() {
        let e = SamplingParams {
            top_p: 0.0,
            ..params()
        }
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("top_p"));
        let e = SamplingParams {
            max_new_tokens: 0,
            ..params()
        }
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("max_new_tokens"));
    }

    #[test]
    fn scan_never_lands_on_a_zero() {
        assert_eq!(scan(&[0.0, 1.0, 0.0, 1.0, 0.0], 0.0), (1, 0.0));
        assert_eq!(scan(&[0.0, 1.0, 0.0, 1.0, 0.0], 1.0), (3, 0.0));
        // Past the end (rounding): the last positive entry, all of it.
        assert_eq!(scan(&[0.0, 1.0, 0.0, 1.0, 0.0], 2.5), (3, 1.0));
    }
}
