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
use serde_json::{json, Map, Value};

use crate::data::{self, Example};
use crate::rewards::Reward;
use crate::rollout::{self, Episode, GroupSampler};
use crate::{Error, Result};
use grpo_models::models::CausalLm;
use grpo_models::sampler::SamplingParams;
use grpo_models::seeding::mix_seed;
use grpo_models::tokenizer::Tokenizer;

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

/// What an evaluation found.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalReport {
    /// Metrics in a fixed order: pass@k (k ascending), mean_accuracy, accuracy, reward/<name>.
    pub metrics: Vec<(String, f64)>,
    /// Prompts evaluated.
    pub num_prompts: usize,
    /// Prompts whose samples could all be judged correct or not (the pass@k denominator).
    pub num_scored: usize,
    /// Sampled completions per prompt.
    pub num_samples: usize,
}

impl EvalReport {
    /// A metric by name.
    pub fn get(&self, name: &str) -> Option<f64> {
        self.metrics.iter().find(|(n, _)| n == name).map(|m| m.1)
    }

    /// The metrics and counts as one JSON object (NaN as null).
    pub fn to_json(&self) -> Value {
        let mut m = Map::new();
        for (k, v) in &self.metrics {
            m.insert(k.clone(), num_or_null(*v));
        }
        m.insert("num_prompts".into(), json!(self.num_prompts));
        m.insert("num_scored".into(), json!(self.num_scored));
        m.insert("num_samples".into(), json!(self.num_samples));
        Value::Object(m)
    }

    /// A readable table of the metrics.
    pub fn table(&self) -> String {
        let w = self
            .metrics
            .iter()
            .map(|(k, _)| k.len())
            .max()
            .unwrap_or(6)
            .max(6);
        let mut out = format!(
            "{} prompts ({} with a judgeable answer), {} samples each\n",
            self.num_prompts, self.num_scored, self.num_samples
        );
        for (k, v) in &self.metrics {
            let v = if v.is_finite() {
                format!("{v:.4}")
            } else {
                "missing".into()
            };
            out.push_str(&format!("{k:<w$}  {v:>8}\n"));
        }
        out
    }
}

fn num_or_null(x: f64) -> Value {
    serde_json::Number::from_f64(x).map_or(Value::Null, Value::Number)
}

/// Whether a completion is correct: every reward of `acc` (indices into `scores`) scores at
/// least `at_least` (the correctness reward), or more than 0.5 without it (the accuracy rewards).
/// None when `acc` is empty or one of its scores is missing.
fn correctness(scores: &[f32], acc: &[usize], at_least: Option<f32>) -> Option<bool> {
    if acc.is_empty() {
        return None;
    }
    let mut all = true;
    for &k in acc {
        let s = *scores.get(k)?;
        if s.is_nan() {
            return None;
        }
        all &= match at_least {
            Some(t) => s >= t,
            None => s > 0.5,
        };
    }
    Some(all)
}

/// Running sums over the prompts of an evaluation.
#[derive(Debug, Clone)]
struct Tally {
    n: usize,
    ks: Vec<usize>,
    reward_names: Vec<String>,
    prompts: usize,
    /// Prompts whose n samples all have a known correctness.
    scored: usize,
    pass_sums: Vec<f64>,
    correct_samples: usize,
    greedy_scored: usize,
    greedy_correct: usize,
    /// Per reward: (sum, count) of finite scores.
    reward_sums: Vec<(f64, usize)>,
}

impl Tally {
    fn new(n: usize, ks: Vec<usize>, reward_names: Vec<String>) -> Self {
        Tally {
            n,
            pass_sums: vec![0.0; ks.len()],
            ks,
            reward_sums: vec![(0.0, 0); reward_names.len()],
            reward_names,
            prompts: 0,
            scored: 0,
            correct_samples: 0,
            greedy_scored: 0,
            greedy_correct: 0,
        }
    }

    /// One prompt: its samples' correctness and scores, its greedy completion's.
    fn add(
        &mut self,
        correct: &[Option<bool>],
        scores: &[&[f32]],
        greedy: Option<(Option<bool>, &[f32])>,
    ) {
        self.prompts += 1;
        if self.n > 0 {
            if let Some(flags) = correct.iter().copied().collect::<Option<Vec<bool>>>() {
                let c = flags.iter().filter(|&&b| b).count();
                self.scored += 1;
                self.correct_samples += c;
                for (sum, &k) in self.pass_sums.iter_mut().zip(&self.ks) {
                    *sum += pass_at_k(self.n, c, k);
                }
            }
        }
        if let Some((Some(ok), _)) = greedy {
            self.greedy_scored += 1;
            self.greedy_correct += usize::from(ok);
        }
        // Mean rewards: over the samples, or the greedy completion when there are none.
        let rows: Vec<&[f32]> = match (self.n, greedy) {
            (0, Some((_, g))) => vec![g],
            _ => scores.to_vec(),
        };
        for row in rows {
            for (acc, &s) in self.reward_sums.iter_mut().zip(row) {
                if s.is_finite() {
                    acc.0 += s as f64;
                    acc.1 += 1;
                }
            }
        }
    }

    fn report(&self) -> EvalReport {
        let mut m: Vec<(String, f64)> = vec![];
        if self.scored > 0 {
            for (k, s) in self.ks.iter().zip(&self.pass_sums) {
                m.push((format!("eval/pass@{k}"), s / self.scored as f64));
            }
            m.push((
                "eval/mean_accuracy".into(),
                self.correct_samples as f64 / (self.scored * self.n) as f64,
            ));
        }
        if self.greedy_scored > 0 {
            m.push((
                "eval/accuracy".into(),
                self.greedy_correct as f64 / self.greedy_scored as f64,
            ));
        }
        for (name, (s, c)) in self.reward_names.iter().zip(&self.reward_sums) {
            let mean = if *c > 0 { s / *c as f64 } else { f64::NAN };
            m.push((format!("eval/reward/{name}"), mean));
        }
        EvalReport {
            metrics: m,
            num_prompts: self.prompts,
            num_scored: self.scored,
            num_samples: self.n,
        }
    }
}

/// `{name: score or null}`.
/// One completion of a log row.
fn completion_json(rewards: &[Reward], ep: &Episode, correct: Option<bool>) -> Value {
    let mut c = json!({
        "text": ep.text,
        "rewards": Reward::named_scores(rewards, &ep.rewards),
        "correct": correct,
        "stop_reason": ep.stop_reason,
    });
    // An agent's episode turn by turn, as completions.jsonl has it.
    if let Some(a) = &ep.agent {
        c["messages"] = json!(a.messages);
        c["tool_errors"] = json!(a.tool_errors);
        c["cut"] = json!(a.cut);
    }
    c
}

/// The log row of one prompt (see the module docs).
fn prompt_row(
    ex: &Example,
    rewards: &[Reward],
    samples: &[Episode],
    correct: &[Option<bool>],
    greedy: Option<(&Episode, Option<bool>)>,
) -> Value {
    let num_correct = correct
        .iter()
        .copied()
        .collect::<Option<Vec<bool>>>()
        .filter(|_| !samples.is_empty())
        .map(|f| f.iter().filter(|&&b| b).count());
    json!({
        "prompt": data::prompt_text(ex),
        "answer": ex.answer,
        "origin": ex.origin,
        "completions": samples
            .iter()
            .zip(correct)
            .map(|(ep, &c)| completion_json(rewards, ep, c))
            .collect::<Vec<_>>(),
        "num_correct": num_correct,
        "greedy": greedy.map(|(ep, c)| completion_json(rewards, ep, c)),
    })
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
    mut out: Option<RowSink<'_>>,
    shard: Option<EvalShard<'_>>,
    agent: Option<&crate::agents::Agent>,
) -> Result<EvalReport> {
    opts.validate()?;
    let n = opts.num_samples;
    let total = opts
        .num_prompts
        .unwrap_or(examples.len())
        .min(examples.len());
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
    let all: Vec<usize> = (0..rewards.len()).collect();
    let greedy_params = SamplingParams {
        temperature: 0.0,
        ..opts.sampling.clone()
    };
    // This process's prompts: all of them, or every size-th from its rank.
    let (rank, size) = shard.as_ref().map_or((0, 1), |s| (s.rank, s.size));
    let indices: Vec<usize> = (0..total).filter(|i| i % size == rank).collect();
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
        let sample = |ids: Vec<Vec<u32>>, n: usize, params: &SamplingParams| match agent {
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
    let names = rewards.iter().map(|r| r.name.clone()).collect();
    let mut tally = Tally::new(n, opts.sorted_ks(), names);
    for i in 0..total {
        let samples =
            &sampled_all[(i * n).min(sampled_all.len())..((i + 1) * n).min(sampled_all.len())];
        let correct: Vec<Option<bool>> = samples
            .iter()
            .map(|e| correctness(&e.rewards, &acc, at_least))
            .collect();
        let g = greedy_all
            .get(i)
            .map(|e| (e, correctness(&e.rewards, &acc, at_least)));
        let scores: Vec<&[f32]> = samples.iter().map(|e| e.rewards.as_slice()).collect();
        tally.add(&correct, &scores, g.map(|(e, c)| (c, e.rewards.as_slice())));
        if let Some(f) = out.as_mut() {
            f(&prompt_row(&examples[i], rewards, samples, &correct, g))?;
        }
    }
    Ok(tally.report())
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

#[cfg(test)]
mod tests {
    use super::*;

    /// C(n, k) in plain f64 (exact for the small n used here).
    fn binom(n: usize, k: usize) -> f64 {
        if k > n {
            return 0.0;
        }
        (0..k).fold(1.0, |acc, i| acc * (n - i) as f64 / (i + 1) as f64)
    }

    /// The textbook form, 1 - C(n-c, k) / C(n, k).
    fn pass_at_k_combinatorial(n: usize, c: usize, k: usize) -> f64 {
        1.0 - binom(n - c, k) / binom(n, k)
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-12
    }

    #[test]
    fn pass_at_k_matches_hand_computed_values() {
        // n = 5, c = 2, k = 1: 1 - C(3,1)/C(5,1) = 1 - 3/5.
        assert!(close(pass_at_k(5, 2, 1), 0.4));
        // k = 2: 1 - C(3,2)/C(5,2) = 1 - 3/10.
        assert!(close(pass_at_k(5, 2, 2), 0.7));
        // No correct sample: 0 for every k; all correct: 1.
        for k in 1..=4 {
            assert_eq!(pass_at_k(4, 0, k), 0.0);
            assert_eq!(pass_at_k(4, 4, k), 1.0);
        }
        // n = 10, c = 3, k = 4: 1 - C(7,4)/C(10,4) = 1 - 35/210.
        assert!(close(pass_at_k(10, 3, 4), 1.0 - 35.0 / 210.0));
        // pass@1 is the share of correct samples.
        assert!(close(pass_at_k(8, 3, 1), 3.0 / 8.0));
        // Fewer wrong samples than k: every draw has a correct one.
        assert_eq!(pass_at_k(5, 3, 3), 1.0);
    }

    #[test]
    fn pass_at_k_edge_cases_are_as_documented() {
        assert_eq!(pass_at_k(0, 0, 1), 0.0);
        assert_eq!(pass_at_k(5, 2, 0), 0.0);
        // c > n counts as c = n.
        assert_eq!(pass_at_k(3, 7, 2), 1.0);
        // k > n counts as k = n.
        assert_eq!(pass_at_k(3, 1, 10), 1.0);
        assert_eq!(pass_at_k(3, 0, 10), 0.0);
    }

    #[test]
    fn pass_at_k_equals_the_combinatorial_form_on_a_grid() {
        for n in 1..=30 {
            for c in 0..=n {
                let mut prev = 0.0;
                for k in 1..=n {
                    let p = pass_at_k(n, c, k);
                    let want = pass_at_k_combinatorial(n, c, k);
                    assert!((p - want).abs() < 1e-9, "n={n} c={c} k={k}: {p} vs {want}");
                    assert!((0.0..=1.0).contains(&p));
                    assert!(p >= prev - 1e-12, "not monotone in k at n={n} c={c} k={k}");
                    prev = p;
                }
            }
        }
        // Large n stays finite and exact where binomials would overflow f64.
        let p = pass_at_k(2000, 1, 1000);
        assert!(close(p, 0.5), "{p}");
    }

    #[test]
    fn ks_are_checked_against_the_samples() {
        assert!(check_ks(&[1, 4, 8], 8, "eval_k", "eval_num_samples").is_ok());
        // Greedy only: no pass@k, nothing to check.
        assert!(check_ks(&[4], 0, "eval_k", "eval_num_samples").is_ok());
        let e = check_ks(&[1, 8], 4, "--k", "--num-samples")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`--k`") && e.contains("pass@8") && e.contains("raise --num-samples to 8"),
            "{e}"
        );
        let e = check_ks(&[0], 4, "eval_k", "eval_num_samples")
            .unwrap_err()
            .to_string();
        assert!(e.contains("`eval_k`"), "{e}");
    }

    /// SmolLM2-135M in f32 (30 layers, 3 KV heads of 64, hidden 576, MLP 1536, vocabulary
    /// 49152), as `GroupSampler::memory_costs` gives it.
    fn smollm2_costs(gradient_checkpointing: bool) -> MemoryCosts {
        MemoryCosts {
            kv_per_position: 2 * 2 * 30 * 3 * 64 * 4,
            logits: 2 * 4 * 49152,
            pass_per_token: crate::logprobs::activation_bytes_per_token(
                (576, 1536, 30),
                4,
                gradient_checkpointing,
            ),
        }
    }

    fn bound(pass_tokens: usize, gradient_checkpointing: bool, round: usize) -> BatchBound {
        BatchBound {
            pass_tokens,
            gradient_checkpointing,
            round,
            max: MAX_BATCH_COMPLETIONS,
        }
    }

    #[test]
    fn the_bound_is_what_a_training_pass_holds_within_the_round_and_the_cap() {
        let c = smollm2_costs(false);
        // A 1024-token pass keeps 2.26 GB (30 x (16 x 576 + 6 x 1536) floats a token); a
        // sequence of 100 + 128 positions holds 21 MB of KV cache and 0.4 MB of logits: room
        // for 105, capped at 64.
        assert_eq!(c.pass_per_token * 1024, 2_264_924_160);
        let b = bound(1024, false, 16);
        assert_eq!(b.completions(Some(&c), 100, 128), 64);
        // 2048 new tokens: 198 MB a sequence, 11 fit; 512-token passes: 5, below the round's 16.
        assert_eq!(bound(1024, false, 4).completions(Some(&c), 100, 2048), 11);
        assert_eq!(bound(512, false, 16).completions(Some(&c), 100, 2048), 16);
        assert_eq!(bound(512, false, 4).completions(Some(&c), 100, 2048), 5);
        // With checkpointing a pass keeps 13x less: 8 sequences at 228 positions, so the round's.
        let gc = smollm2_costs(true);
        assert_eq!(bound(1024, true, 1).completions(Some(&gc), 100, 128), 8);
        assert_eq!(bound(1024, true, 16).completions(Some(&gc), 100, 128), 16);
        // sampling_batch_size (the cap) wins over the round; no KV cache: the cap.
        let small = BatchBound { max: 8, ..b };
        assert_eq!(small.completions(Some(&c), 100, 128), 8);
        assert_eq!(b.completions(None, 100, 128), 64);
    }

    #[test]
    fn batches_are_whole_prompts_within_the_bound_of_their_longest() {
        let b = bound(1024, false, 16);
        let c = smollm2_costs(false);
        // Short prompts: 64 completions a call, 8 prompts of 8.
        let calls = batches(&[50; 20], 8, 128, &b, Some(&c));
        assert_eq!(calls, [0..8, 8..16, 16..20]);
        // Greedy only (n = 0) counts as one completion a prompt.
        assert_eq!(batches(&[50; 100], 0, 128, &b, Some(&c)), [0..64, 64..100]);
        // Long completions: 11 fit, 2 prompts of 4; a long prompt (4 fit) closes its call early.
        let b4 = bound(1024, false, 4);
        let calls = batches(&[100, 100, 100, 3000, 100], 4, 2048, &b4, Some(&c));
        assert_eq!(calls, [0..2, 2..3, 3..4, 4..5]);
        // More samples than the bound allows: one prompt a call, never none.
        assert_eq!(
            batches(&[10; 3], 100, 128, &b, Some(&c)),
            [0..1, 1..2, 2..3]
        );
        assert!(batches(&[], 8, 128, &b, Some(&c)).is_empty());
    }

    #[test]
    fn durations_read_as_minutes_and_seconds() {
        assert_eq!(minutes(45.2), "45s");
        assert_eq!(minutes(72.0), "1m12s");
        assert_eq!(minutes(3605.0), "60m05s");
    }

    #[test]
    fn a_correctness_reward_must_be_one_of_the_rewards() {
        let names = ["correct", "format"];
        assert_eq!(
            check_correctness_reward("format", names, "correctness_reward").unwrap(),
            1
        );
        let e = check_correctness_reward("corect", names, "--correctness-reward")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--correctness-reward") && e.contains("`corect`"),
            "{e}"
        );
        assert!(e.contains("`correct`, `format`"), "{e}");
    }

    #[test]
    fn correctness_needs_every_accuracy_reward() {
        assert_eq!(correctness(&[1.0, 0.1], &[0], None), Some(true));
        assert_eq!(correctness(&[0.0, 0.1], &[0], None), Some(false));
        assert_eq!(correctness(&[1.0, 0.0], &[0, 1], None), Some(false));
        assert_eq!(correctness(&[f32::NAN, 1.0], &[0], None), None);
        assert_eq!(correctness(&[1.0], &[], None), None);
        // A named correctness reward: its score at least the threshold, compared as f32.
        assert_eq!(
            correctness(&[0.1, 0.7], &[1], Some(0.7_f64 as f32)),
            Some(true)
        );
        assert_eq!(correctness(&[0.1, 0.6], &[1], Some(0.7)), Some(false));
        assert_eq!(correctness(&[0.9, 1.0], &[1], Some(1.0)), Some(true));
        assert_eq!(correctness(&[1.0, f32::NAN], &[1], Some(0.5)), None);
    }

    fn names() -> Vec<String> {
        vec!["correct".into(), "format".into()]
    }

    #[test]
    fn tally_averages_pass_at_k_over_prompts() {
        let mut t = Tally::new(4, vec![1, 2, 4], names());
        // Prompt A: 1 of 4 correct; prompt B: 4 of 4.
        let (r1, r0): (&[f32], &[f32]) = (&[1.0, 0.1], &[0.0, 0.0]);
        let a = [Some(true), Some(false), Some(false), Some(false)];
        t.add(&a, &[r1, r0, r0, r0], Some((Some(false), r0)));
        t.add(&[Some(true); 4], &[r1; 4], Some((Some(true), r1)));
        // A prompt without a reference answer counts in nothing but the prompt count.
        let nan: &[f32] = &[f32::NAN, 0.0];
        t.add(&[None; 4], &[nan; 4], Some((None, nan)));
        let r = t.report();
        assert_eq!((r.num_prompts, r.num_scored, r.num_samples), (3, 2, 4));
        let get = |k: &str| r.get(k).unwrap();
        assert!(close(get("eval/pass@1"), (0.25 + 1.0) / 2.0));
        // Prompt A: 1 - C(3,2)/C(4,2) = 0.5.
        assert!(close(get("eval/pass@2"), (0.5 + 1.0) / 2.0));
        assert!(close(get("eval/pass@4"), 1.0));
        assert!(close(get("eval/mean_accuracy"), 5.0 / 8.0));
        assert!(close(get("eval/accuracy"), 0.5));
        // Over the 8 judged samples (the NaNs are left out).
        assert!(close(get("eval/reward/correct"), 5.0 / 8.0));
        assert!((get("eval/reward/format") - 0.5 / 12.0).abs() < 1e-6);
        let order: Vec<&str> = r.metrics.iter().map(|m| m.0.as_str()).collect();
        assert_eq!(
            order,
            [
                "eval/pass@1",
                "eval/pass@2",
                "eval/pass@4",
                "eval/mean_accuracy",
                "eval/accuracy",
                "eval/reward/correct",
                "eval/reward/format"
            ]
        );
        let j = r.to_json();
        assert_eq!(j["num_prompts"], 3);
        assert!(r.table().contains("eval/pass@2"));
    }

    #[test]
    fn greedy_only_means_rewards_over_greedy_completions() {
        let mut t = Tally::new(0, vec![], names());
        t.add(&[], &[], Some((Some(true), &[1.0, 0.1])));
        t.add(&[], &[], Some((Some(false), &[0.0, 0.0])));
        let r = t.report();
        assert_eq!(r.get("eval/pass@1"), None);
        assert_eq!(r.get("eval/mean_accuracy"), None);
        assert_eq!(r.get("eval/accuracy"), Some(0.5));
        assert_eq!(r.get("eval/reward/correct"), Some(0.5));
        // No score at all: the mean is missing (null in JSON), not 0.
        let mut t = Tally::new(0, vec![], names());
        t.add(&[], &[], None);
        let r = t.report();
        assert!(r.get("eval/reward/correct").unwrap().is_nan());
        assert!(r.to_json()["eval/reward/correct"].is_null());
        assert!(r.table().contains("missing"));
    }
}
