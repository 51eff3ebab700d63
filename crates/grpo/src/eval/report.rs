//! What an evaluation found: the running tally over the prompts, the report of metrics it
//! makes, and each prompt's log row.

use serde_json::{json, Map, Value};

use super::pass_at_k;
use crate::data::{self, Example};
use crate::rewards::Reward;
use crate::rollout::Episode;

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
pub(super) fn correctness(scores: &[f32], acc: &[usize], at_least: Option<f32>) -> Option<bool> {
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
pub(super) struct Tally {
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
    pub(super) fn new(n: usize, ks: Vec<usize>, reward_names: Vec<String>) -> Self {
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
    pub(super) fn add(
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

    pub(super) fn report(&self) -> EvalReport {
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
pub(super) fn prompt_row(
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
