//! Evaluation on held-out prompts, for the trainer's periodic eval (`eval_steps`) and `grpo eval`.
//!
//! Per prompt: `n` sampled completions (`num_samples`, seeded per prompt, so the same samples are
//! drawn at every eval of a run and a completion never depends on the batch), and optionally one
//! greedy completion. Every completion is scored by every reward. Metrics:
//!
//! - `eval/pass@<k>` for each requested k: the unbiased estimator ([`pass_at_k`]) averaged over
//!   the prompts;
//! - `eval/mean_accuracy`: the share of the n samples that are correct (over all prompts);
//! - `eval/accuracy`: greedy accuracy, the share of prompts whose greedy completion is correct;
//! - `eval/reward/<name>`: each reward's mean over the sampled completions, or over the greedy
//!   ones when `num_samples` is 0 (missing scores left out; NaN when every score is missing).
//!
//! *Correct* means the reward the config names (`correctness_reward`, any kind: a Python
//! function, a scorer program, a model) scores at least `correctness_threshold` (1.0); when none is
//! named, every accuracy reward ([`Reward::is_accuracy`], i.e. `answer_match`, which scores 0 or 1)
//! scores more than 0.5. When one of them is missing (NaN: the row has no reference answer, the
//! scorer could not score it) correctness is unknown and the prompt is left out of the accuracy
//! metrics and pass@k (its row says `"correct": null`). With no accuracy reward at all and none
//! named, pass@k and the accuracies are not defined: they are omitted, with a warning.
//!
//! Each prompt gives one JSON row (`eval/step-N.jsonl` in training, `--out` of `grpo eval`):
//! `{"prompt", "answer", "origin", "completions": [{"text", "rewards": {name: score or null},
//! "correct", "stop_reason"}], "num_correct", "greedy": {"text", "rewards", "correct",
//! "stop_reason"} or null}`; an agent's completions also carry their episode's `messages`,
//! `tool_errors` and `cut`, as `completions.jsonl` does.

use std::sync::Once;
use std::time::Instant;

use candle_core::{DType, Device};
use serde_json::Value;

use crate::data::{self, Example};
use crate::rewards::Reward;
use crate::rollout::{self, Episode, GroupSampler};
use crate::{Error, Result};
use grpo_models::models::CausalLm;
use grpo_models::sampler::SamplingParams;
use grpo_models::seeding::mix_seed;
use grpo_models::tokenizer::Tokenizer;

mod report;
#[cfg(test)]
mod tests;

pub use report::EvalReport;
use report::{correctness, prompt_row, Tally};

/// Unbiased pass@k of one prompt with `n` samples of which `c` are correct: the probability that
/// k samples drawn without replacement from the n include a correct one, `1 - C(n-c, k) / C(n, k)`
/// (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"), computed as
/// `1 - prod_{i=n-c+1}^{n} (1 - k/i)`, which needs no large binomials.
///
/// Edge cases: `k = 0` or `n = 0` gives 0; `c > n` counts as `c = n`; `k > n` is no estimate
/// (option validation rejects it, see [`check_ks`]) and is computed as `k = n`: 1 when any sample
/// is correct, else 0.
pub fn pass_at_k(n: usize, c: usize, k: usize) -> f64 {
    let c = c.min(n);
    if n == 0 || k == 0 || c == 0 {
        return 0.0;
    }
    let k = k.min(n);
    if n - c < k {
        // Every draw of k samples includes a correct one.
        return 1.0;
    }
    let all_wrong: f64 = (n - c + 1..=n).map(|i| 1.0 - k as f64 / i as f64).product();
    1.0 - all_wrong
}

/// Checks the requested ks against the samples per prompt: each k must be in `1..=n`. With
/// `n = 0` (greedy only) no pass@k is computed and the ks are not checked. Errors name `k_key`
/// (and `n_key` in the fix), so the config and the command line can each use their own names.
pub fn check_ks(ks: &[usize], n: usize, k_key: &str, n_key: &str) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    for &k in ks {
        if k == 0 {
            return Err(Error::config(
                k_key,
                "pass@0 is not defined: each k must be >= 1",
            ));
        }
        if k > n {
            return Err(Error::config(
                k_key,
                format!(
                    "pass@{k} needs at least {k} samples per prompt, but {n_key} is {n}: \
                     raise {n_key} to {k} or leave {k} out of {k_key}"
                ),
            ));
        }
    }
    Ok(())
}

/// Completions sampled at once at most, whatever the memory allows: at 64 rows the CPU's
/// decoding of a 135M model is bound by its arithmetic, not by reading the weights, so larger
/// batches would only hold more memory.
pub const MAX_BATCH_COMPLETIONS: usize = 64;

pub use crate::rollout::MemoryCosts;

/// What bounds the completions evaluation samples at once (in whole prompts: `n` samples of a
/// prompt are sampled together, and a call has at least one prompt): as many as a training pass's
/// activations would take ([`BatchBound::completions`]), never fewer than a training round
/// samples at once, never more than `max`. Training's peak already holds both, so evaluation
/// does not peak above it for its sampling. A completion does not depend on the bound.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BatchBound {
    /// Tokens of a training pass (`forward_chunk_tokens`, as the run resolved it).
    pub pass_tokens: usize,
    /// Training checkpoints activations (its passes keep far less per token).
    pub gradient_checkpointing: bool,
    /// Completions a training round samples at once on one process (`generation_batch_size`, or
    /// `sampling_batch_size` when smaller).
    pub round: usize,
    /// At most this many ([`MAX_BATCH_COMPLETIONS`], or `sampling_batch_size` when smaller).
    pub max: usize,
}

impl BatchBound {
    /// Completions that may be sampled at once when a call's longest prompt has `prompt_len`
    /// tokens and each completion up to `max_new` (with `costs` None: `max`).
    pub fn completions(
        &self,
        costs: Option<&MemoryCosts>,
        prompt_len: usize,
        max_new: usize,
    ) -> usize {
        let fit = costs.map_or(usize::MAX, |c| {
            let budget = c.pass_per_token.saturating_mul(self.pass_tokens as u64);
            let per_sequence = c.kv_per_position * (prompt_len + max_new) as u64 + c.logits;
            usize::try_from(budget / per_sequence.max(1)).unwrap_or(usize::MAX)
        });
        fit.max(self.round).min(self.max)
    }
}

/// Splits prompts of `lens` tokens (in order) into consecutive sampling calls of whole prompts,
/// `n` completions each (at least one prompt a call), within what `bound` allows for the call's
/// longest prompt.
fn batches(
    lens: &[usize],
    n: usize,
    max_new: usize,
    bound: &BatchBound,
    costs: Option<&MemoryCosts>,
) -> Vec<std::ops::Range<usize>> {
    let n = n.max(1);
    let mut out = vec![];
    let mut start = 0;
    while start < lens.len() {
        let (mut end, mut longest) = (start + 1, lens[start]);
        while end < lens.len() {
            let l = longest.max(lens[end]);
            if (end + 1 - start) * n > bound.completions(costs, l, max_new) {
                break;
            }
            (end, longest) = (end + 1, l);
        }
        out.push(start..end);
        start = end;
    }
    out
}

/// Evaluation's progress on the console: a bar on a terminal, else a line every 30 seconds
/// (none on the processes of a shard but the first).
struct Progress {
    bar: Option<indicatif::ProgressBar>,
    total: usize,
    t0: Instant,
    last_line: Instant,
}

impl Progress {
    fn new(total: usize, shown: bool) -> Self {
        let bar = shown.then(|| {
            let bar = indicatif::ProgressBar::new(total as u64);
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "eval {bar:30} {pos}/{len} prompts  {elapsed_precise} < {eta_precise}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            bar
        });
        let now = Instant::now();
        Progress {
            bar,
            total,
            t0: now,
            last_line: now,
        }
    }

    fn set(&mut self, done: usize) {
        let Some(bar) = &self.bar else { return };
        bar.set_position(done as u64);
        if bar.is_hidden() && done < self.total && self.last_line.elapsed().as_secs() >= 30 {
            self.last_line = Instant::now();
            let el = self.t0.elapsed().as_secs_f64();
            let eta = el / done.max(1) as f64 * (self.total - done) as f64;
            tracing::info!(
                "eval: {done}/{} prompts, {}, eta {}",
                self.total,
                minutes(el),
                minutes(eta)
            );
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

/// `1m12s`, `45s`.
fn minutes(s: f64) -> String {
    let s = s.round() as u64;
    match s / 60 {
        0 => format!("{s}s"),
        m => format!("{m}m{:02}s", s % 60),
    }
}

/// How to evaluate.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalOptions {
    /// Sampled completions per prompt (n); 0: none (greedy only).
    pub num_samples: usize,
    /// Report pass@k for each of these (each in `1..=num_samples`, see [`check_ks`]).
    pub ks: Vec<usize>,
    /// Also one greedy completion per prompt (`eval/accuracy`).
    pub greedy: bool,
    /// Evaluate only the first N prompts (None: all).
    pub num_prompts: Option<usize>,
    /// Prompt i's samples are seeded by `mix_seed(seed, i)`.
    pub seed: u64,
    /// How the n samples are drawn (temperature, top-k/p, max_new_tokens, stop strings, EOS ids);
    /// the greedy completion uses the same with temperature 0.
    pub sampling: SamplingParams,
    /// System message put before each prompt (unless it has one).
    pub system_prompt: Option<String>,
    /// Prompts longer than this are truncated from the left.
    pub max_prompt_length: Option<usize>,
    /// The reward that decides correctness; None: the accuracy rewards (see the module docs).
    pub correctness: Option<Correctness>,
    /// What bounds the completions sampled at once.
    pub batch: BatchBound,
}

/// The reward that decides whether a completion is correct (`correctness_reward`,
/// `correctness_threshold`): correct when `reward` scores at least `threshold`.
#[derive(Debug, Clone, PartialEq)]
pub struct Correctness {
    /// The reward's name, as its metrics show it.
    pub reward: String,
    pub threshold: f64,
}

/// Default of `correctness_threshold`: a reward that gives 1 for a correct answer.
pub const CORRECTNESS_THRESHOLD: f64 = 1.0;

impl Correctness {
    /// The index of the reward in `rewards`; an error naming `key` (the config's key or the
    /// command line's flag) and listing the rewards when there is none of that name.
    pub fn index(&self, rewards: &[Reward], key: &str) -> Result<usize> {
        check_correctness_reward(&self.reward, rewards.iter().map(|r| r.name.as_str()), key)
    }
}

/// The position of `name` among the reward `names`; an error naming `key` and listing the
/// names when it is not one of them.
pub fn check_correctness_reward<'a>(
    name: &str,
    names: impl IntoIterator<Item = &'a str>,
    key: &str,
) -> Result<usize> {
    let names: Vec<&str> = names.into_iter().collect();
    names.iter().position(|n| *n == name).ok_or_else(|| {
        let list = names
            .iter()
            .map(|n| format!("`{n}`"))
            .collect::<Vec<_>>()
            .join(", ");
        Error::config(
            key,
            format!("`{name}` is not one of the run's rewards; they are: {list}"),
        )
    })
}

impl EvalOptions {
    /// Checks the options; errors use the config's key names.
    pub fn validate(&self) -> Result<()> {
        check_ks(&self.ks, self.num_samples, "eval_k", "eval_num_samples")?;
        if self.num_samples == 0 && !self.greedy {
            return Err(Error::config(
                "eval_num_samples",
                "0 samples and no greedy completion leave nothing to evaluate",
            ));
        }
        self.sampling.validate()
    }

    /// The requested ks, sorted, without duplicates; none when there are no samples.
    fn sorted_ks(&self) -> Vec<usize> {
        if self.num_samples == 0 {
            return vec![];
        }
        let mut ks = self.ks.clone();
        ks.sort_unstable();
        ks.dedup();
        ks
    }
}

static NO_ACCURACY_REWARD: Once = Once::new();

/// Where each prompt's log row goes.
pub type RowSink<'a> = &'a mut dyn FnMut(&Value) -> Result<()>;

/// Evaluates `model` on the first `opts.num_prompts` of `examples` (see the module docs); each
/// prompt's row goes to `out` as soon as its batch is scored.
pub fn evaluate(
    model: &dyn GroupSampler,
    tok: &Tokenizer,
    examples: &[Example],
    rewards: &[Reward],
    opts: &EvalOptions,
    mut out: Option<RowSink<'_>>,
) -> Result<EvalReport> {
    evaluate_sharded(model, tok, examples, rewards, opts, out.take(), None)
}

/// [`evaluate`], the prompts shared among the processes of `shard` (every process gets the
/// whole report; give `out` on one of them).
pub fn evaluate_sharded(
    model: &dyn GroupSampler,
    tok: &Tokenizer,
    examples: &[Example],
    rewards: &[Reward],
    opts: &EvalOptions,
    out: Option<RowSink<'_>>,
    shard: Option<EvalShard<'_>>,
) -> Result<EvalReport> {
    evaluate_agent(model, tok, examples, rewards, opts, out, shard, None)
}

/// [`evaluate_sharded`], each sample an episode of `agent`'s tools when one is given (its
/// correctness that of the episode's final answer).
#[allow(clippy::too_many_arguments)]
pub fn evaluate_agent(
    model: &dyn GroupSampler,
    tok: &Tokenizer,
    examples: &[Example],
    rewards: &[Reward],
    opts: &EvalOptions,
    out: Option<RowSink<'_>>,
    shard: Option<EvalShard<'_>>,
    agent: Option<&crate::agents::Agent>,
) -> Result<EvalReport> {
    opts.validate()?;
    let total = opts
        .num_prompts
        .unwrap_or(examples.len())
        .min(examples.len());
    let judge = correctness_rewards(opts, rewards)?;
    let run = EvalRun {
        model,
        tok,
        examples,
        rewards,
        opts,
        agent,
    };
    // This process's prompts: all of them, or every size-th from its rank.
    let (rank, size) = shard.as_ref().map_or((0, 1), |s| (s.rank, s.size));
    let indices: Vec<usize> = (0..total).filter(|i| i % size == rank).collect();
    let (mut sampled_all, mut greedy_all) = run.sample(&indices, rank, total)?;
    // Every process's answers, then the tally in prompt order (as one process makes it).
    if let Some(s) = &shard {
        for eps in [&mut sampled_all, &mut greedy_all] {
            let mine = rollout::encode_episodes(eps)?;
            let mut gathered = vec![];
            for (r, b) in (s.gather)(mine)?.into_iter().enumerate() {
                gathered.extend(rollout::decode_episodes(&b, &format!("rank {r}"))?);
            }
            gathered.sort_by_key(|e| e.group);
            *eps = gathered;
        }
    }
    run.tally(total, &sampled_all, &greedy_all, &judge, out)
}

/// The rewards that decide correctness (indices into the rewards), and the score they must reach
/// (None: more than 0.5, the accuracy rewards); warns once when there are none.
fn correctness_rewards(
    opts: &EvalOptions,
    rewards: &[Reward],
) -> Result<(Vec<usize>, Option<f32>)> {
    // The scores compare as f32 (a threshold of 0.7 admits a score of 0.7).
    let (acc, at_least): (Vec<usize>, Option<f32>) = match &opts.correctness {
        Some(c) => (
            vec![c.index(rewards, "correctness_reward")?],
            Some(c.threshold as f32),
        ),
        None => (
            (0..rewards.len())
                .filter(|&k| rewards[k].is_accuracy())
                .collect(),
            None,
        ),
    };
    if acc.is_empty() {
        NO_ACCURACY_REWARD.call_once(|| {
            tracing::warn!(
                "eval: no accuracy reward (kind = \"answer_match\") and no correctness_reward, \
                 so correctness, pass@k and accuracy are not reported; only the mean of each \
                 reward is"
            )
        });
    }
    Ok((acc, at_least))
}

/// One evaluation's model, prompts, rewards and options.
struct EvalRun<'a> {
    model: &'a dyn GroupSampler,
    tok: &'a Tokenizer,
    examples: &'a [Example],
    rewards: &'a [Reward],
    opts: &'a EvalOptions,
    agent: Option<&'a crate::agents::Agent>,
}

impl EvalRun<'_> {
    /// Samples and scores the prompts `indices` (of `total`) in batches: their `n` samples and
    /// their greedy completions, each tagged with its prompt's index. Progress shows on `rank` 0.
    fn sample(
        &self,
        indices: &[usize],
        rank: usize,
        total: usize,
    ) -> Result<(Vec<Episode>, Vec<Episode>)> {
        let (model, tok, examples, rewards, opts) =
            (self.model, self.tok, self.examples, self.rewards, self.opts);
        let n = opts.num_samples;
        let all: Vec<usize> = (0..rewards.len()).collect();
        let greedy_params = SamplingParams {
            temperature: 0.0,
            ..opts.sampling.clone()
        };
        let all_ids = indices
            .iter()
            .map(|&i| {
                data::prompt_ids(
                    tok,
                    &examples[i],
                    opts.system_prompt.as_deref(),
                    opts.max_prompt_length,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let lens: Vec<usize> = all_ids.iter().map(Vec::len).collect();
        let costs = model.memory_costs(opts.batch.gradient_checkpointing);
        let calls = batches(
            &lens,
            n,
            opts.sampling.max_new_tokens,
            &opts.batch,
            costs.as_ref(),
        );
        let mut progress = Progress::new(indices.len(), rank == 0);
        let mut sampled_all: Vec<Episode> = vec![];
        let mut greedy_all: Vec<Episode> = vec![];
        for call in calls {
            let chunk = &indices[call.clone()];
            let ids = all_ids[call.clone()].to_vec();
            // A prompt's samples depend on its index only, wherever it is evaluated.
            let seeds: Vec<u64> = chunk
                .iter()
                .map(|&i| mix_seed(opts.seed, i as u64))
                .collect();
            let tag = |mut eps: Vec<Episode>| {
                for e in &mut eps {
                    e.group = chunk[e.group];
                }
                eps
            };
            let sample = |ids: Vec<Vec<u32>>, n: usize, params: &SamplingParams| match self.agent {
                Some(a) => a.rollout(model, chunk, ids, &seeds, n, params, examples),
                None => rollout::rollout(model, tok, chunk, ids, &seeds, n, params),
            };
            if n > 0 {
                let (mut eps, _) = sample(ids.clone(), n, &opts.sampling)?;
                rollout::score(&mut eps, examples, rewards, &all, None)?;
                sampled_all.extend(tag(eps));
            }
            if opts.greedy {
                let (mut eps, _) = sample(ids, 1, &greedy_params)?;
                rollout::score(&mut eps, examples, rewards, &all, None)?;
                greedy_all.extend(tag(eps));
            }
            progress.set(call.end);
            tracing::debug!(
                "eval: {} of {total} prompts ({} at once)",
                chunk[chunk.len() - 1] + 1,
                chunk.len()
            );
        }
        drop(progress);
        Ok((sampled_all, greedy_all))
    }

    /// The tally of the first `total` prompts' samples and greedy completions (in prompt order),
    /// correct as `judge` ([`correctness_rewards`]) says; each prompt's row goes to `out`.
    fn tally(
        &self,
        total: usize,
        sampled_all: &[Episode],
        greedy_all: &[Episode],
        judge: &(Vec<usize>, Option<f32>),
        mut out: Option<RowSink<'_>>,
    ) -> Result<EvalReport> {
        let (examples, rewards, n) = (self.examples, self.rewards, self.opts.num_samples);
        let (acc, at_least) = (&judge.0, judge.1);
        let names = rewards.iter().map(|r| r.name.clone()).collect();
        let mut tally = Tally::new(n, self.opts.sorted_ks(), names);
        for i in 0..total {
            let samples =
                &sampled_all[(i * n).min(sampled_all.len())..((i + 1) * n).min(sampled_all.len())];
            let correct: Vec<Option<bool>> = samples
                .iter()
                .map(|e| correctness(&e.rewards, acc, at_least))
                .collect();
            let g = greedy_all
                .get(i)
                .map(|e| (e, correctness(&e.rewards, acc, at_least)));
            let scores: Vec<&[f32]> = samples.iter().map(|e| e.rewards.as_slice()).collect();
            tally.add(&correct, &scores, g.map(|(e, c)| (c, e.rewards.as_slice())));
            if let Some(f) = out.as_mut() {
                f(&prompt_row(&examples[i], rewards, samples, &correct, g))?;
            }
        }
        Ok(tally.report())
    }
}

/// Evaluation shared among the processes of a data-parallel run: this one's `rank` of `size`
/// evaluates every `size`-th prompt, and `gather` brings every process's bytes (in rank order).
pub struct EvalShard<'a> {
    pub rank: usize,
    pub size: usize,
    pub gather: &'a dyn Fn(Vec<u8>) -> Result<Vec<Vec<u8>>>,
}

/// A model to evaluate or sample from, with its tokenizer and EOS ids: `spec` as `--model` takes
/// it (an HF directory, a full fine-tune's checkpoint directory included, a `.gguf` file, a hub
/// id, or None for the default model), or a LoRA checkpoint directory (`adapter_config.json`)
/// loaded over its base (`base` wins over the base the adapter names); see
/// [`crate::export::load_for_inference`].
pub fn load_inference_model(
    spec: Option<&str>,
    base: Option<&str>,
    dtype: DType,
    device: &Device,
) -> Result<(CausalLm, Tokenizer, Vec<u32>)> {
    let (mut model, mut loaded) = crate::export::load_for_inference(spec, base, dtype, device)?;
    model.pack_for_decoding()?;
    loaded.tokenizer()?;
    let tok = loaded
        .tokenizer
        .take()
        .ok_or_else(|| Error::file(&loaded.origin, "no tokenizer found"))?;
    Ok((model, tok, loaded.eos_token_ids))
}
