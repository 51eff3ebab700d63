//! `grpo rewards check`: score a file of completions with a run's configured rewards, so a user
//! can test rewards before training.
//!
//! The samples file is read like a prompt dataset (JSONL, CSV or Parquet; the config's
//! `prompt_field` and `answer_field`) with one more field, `completion`. An optional integer
//! `group` field groups rows for group rewards (diversity); without it, consecutive rows with the
//! same prompt form a group. Token counts for length rewards come from the config's model
//! tokenizer, or from an integer `completion_tokens` field when every row has one.

use std::path::Path;

use serde_json::Value;

use grpo::config::TrainConfig;
use grpo::data::{self, DataFields, Example};
use grpo::inputs;
use grpo::rewards::{score_all, Reward, ScoreItem};
use grpo::{Error, Result};
use grpo_models::hub;

/// One scored sample.
#[derive(Debug, Clone)]
pub struct CheckRow {
    /// `file:line`
    pub origin: String,
    pub completion: String,
    /// One score per reward (NaN: missing).
    pub scores: Vec<f32>,
    /// The weighted sum (missing scores left out; NaN when all are missing).
    pub total: f32,
}

/// Scores of every sample and per-reward timing.
#[derive(Debug, Clone)]
pub struct CheckReport {
    pub names: Vec<String>,
    pub weights: Vec<f32>,
    pub rows: Vec<CheckRow>,
    /// Seconds each reward took over all samples.
    pub secs: Vec<f64>,
}

/// Builds the config's rewards (or the built-in task's when it has none) as training does
/// ([`grpo::inputs`]) and scores `samples`.
pub fn check_samples(cfg: &TrainConfig, samples: &Path) -> Result<CheckReport> {
    let rewards = inputs::config_rewards(cfg, &candle_core::Device::Cpu)?;
    let weights = inputs::reward_weights(cfg, &rewards)?;
    // The config's fields, but every sample must be scored: no skipped rows.
    let fields = DataFields {
        skip_bad_rows: false,
        ..inputs::data_fields(cfg)
    };
    let mut examples = data::load_examples(samples, &fields)?.examples;
    if examples.is_empty() {
        return Err(Error::file(samples, "no samples in the file"));
    }
    // Pull the sample's own fields out of the metadata the rewards see.
    let mut completions = Vec::with_capacity(examples.len());
    let mut groups = Vec::with_capacity(examples.len());
    let mut token_counts = Vec::with_capacity(examples.len());
    for ex in examples.iter_mut() {
        let completion = match ex.metadata.remove("completion") {
            Some(Value::String(s)) => s,
            Some(v) => {
                return Err(Error::file(
                    samples,
                    format!("{}: `completion` must be a string, got {v}", ex.origin),
                ))
            }
            None => {
                return Err(Error::file(
                    samples,
                    format!(
                        "{}: missing `completion` (each sample needs the completion text to score)",
                        ex.origin
                    ),
                ))
            }
        };
        completions.push(completion);
        let group = match ex.metadata.remove("group") {
            Some(v) => Some(v.as_u64().ok_or_else(|| {
                Error::file(
                    samples,
                    format!("{}: `group` must be a whole number, got {v}", ex.origin),
                )
            })? as usize),
            None => None,
        };
        groups.push(group);
        token_counts.push(
            ex.metadata
                .remove("completion_tokens")
                .and_then(|v| v.as_u64()),
        );
    }
    let groups = resolve_groups(&examples, &groups);
    let counts: Vec<usize> = if rewards.iter().any(Reward::needs_token_counts) {
        if token_counts.iter().all(Option::is_some) {
            token_counts
                .iter()
                .map(|c| c.unwrap_or(0) as usize)
                .collect()
        } else {
            let source = hub::resolve_model(cfg.run.model.as_deref())?;
            let tok = grpo_models::weights::load_tokenizer(&source)?;
            completions
                .iter()
                .map(|c| tok.encode(c, false).map(|ids| ids.len()))
                .collect::<Result<_>>()?
        }
    } else {
        vec![0; completions.len()]
    };
    let items: Vec<ScoreItem> = examples
        .iter()
        .zip(&completions)
        .zip(groups.iter().zip(&counts))
        .map(|((ex, c), (&group, &n))| ScoreItem {
            group,
            completion_tokens: n,
            ..ScoreItem::new(ex, c)
        })
        .collect();
    let (scores, secs) = score_all(&rewards, &items)?;
    let rows = examples
        .iter()
        .zip(completions)
        .zip(scores)
        .map(|((ex, completion), s)| {
            let total = grpo::advantages::combine_rewards(&s, &weights)
                .map(|t| t[0])
                .unwrap_or(f32::NAN);
            CheckRow {
                origin: ex.origin.clone(),
                completion,
                scores: s,
                total,
            }
        })
        .collect();
    Ok(CheckReport {
        names: rewards.iter().map(|r| r.name.clone()).collect(),
        weights,
        rows,
        secs,
    })
}

/// Explicit groups where given; otherwise a new group at each change of prompt.
fn resolve_groups(examples: &[Example], explicit: &[Option<usize>]) -> Vec<usize> {
    let mut out = Vec::with_capacity(examples.len());
    let mut current = 0usize;
    for (i, ex) in examples.iter().enumerate() {
        let g = match explicit[i] {
            Some(g) => g,
            None => {
                if i > 0 && examples[i - 1].prompt != ex.prompt {
                    current += 1;
                }
                current
            }
        };
        out.push(g);
    }
    out
}

fn fmt_score(x: f32) -> String {
    if x.is_nan() {
        "missing".into()
    } else {
        format!("{x:.3}")
    }
}

fn clip(s: &str, n: usize) -> String {
    let one_line: String = s.split_whitespace().collect::<Vec<_>>().join(" ");
    if one_line.chars().count() <= n {
        one_line
    } else {
        let mut t: String = one_line.chars().take(n.saturating_sub(1)).collect();
        t.push('…');
        t
    }
}

impl CheckReport {
    /// A table: one row per sample, one column per reward, then the weighted total; then per
    /// reward its weight, mean, std, missing count and time.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let w: Vec<usize> = self.names.iter().map(|n| n.len().max(7)).collect();
        let origin_w = self
            .rows
            .iter()
            .map(|r| r.origin.len())
            .max()
            .unwrap_or(6)
            .max(6);
        out.push_str(&format!("{:<origin_w$}  {:<40}", "sample", "completion"));
        for (n, w) in self.names.iter().zip(&w) {
            out.push_str(&format!("  {n:>w$}"));
        }
        out.push_str("    total\n");
        for r in &self.rows {
            out.push_str(&format!(
                "{:<origin_w$}  {:<40}",
                r.origin,
                clip(&r.completion, 40)
            ));
            for (s, w) in r.scores.iter().zip(&w) {
                out.push_str(&format!("  {:>w$}", fmt_score(*s)));
            }
            out.push_str(&format!("  {:>7}\n", fmt_score(r.total)));
        }
        out.push_str(&format!(
            "\n{:<20} {:>7} {:>8} {:>8} {:>8} {:>10}\n",
            "reward", "weight", "mean", "std", "missing", "time (ms)"
        ));
        for (k, name) in self.names.iter().enumerate() {
            let col: Vec<f32> = self.rows.iter().map(|r| r.scores[k]).collect();
            let missing = col.iter().filter(|x| x.is_nan()).count();
            out.push_str(&format!(
                "{:<20} {:>7.3} {:>8} {:>8} {:>8} {:>10.2}\n",
                name,
                self.weights[k],
                fmt_score(grpo::advantages::nan_mean(&col)),
                fmt_score(grpo::advantages::nan_std(&col)),
                missing,
                self.secs[k] * 1e3
            ));
        }
        let totals: Vec<f32> = self.rows.iter().map(|r| r.total).collect();
        out.push_str(&format!(
            "{:<20} {:>7} {:>8} {:>8} {:>8}\n",
            "total",
            "",
            fmt_score(grpo::advantages::nan_mean(&totals)),
            fmt_score(grpo::advantages::nan_std(&totals)),
            totals.iter().filter(|x| x.is_nan()).count()
        ));
        out
    }

    /// One JSON object per sample: origin, completion, each reward (null: missing), total.
    pub fn json_lines(&self) -> Vec<Value> {
        let num = |x: f32| {
            if x.is_nan() {
                Value::Null
            } else {
                serde_json::json!(x)
            }
        };
        self.rows
            .iter()
            .map(|r| {
                let rewards: serde_json::Map<String, Value> = self
                    .names
                    .iter()
                    .zip(&r.scores)
                    .map(|(n, &s)| (n.clone(), num(s)))
                    .collect();
                serde_json::json!({
                    "sample": r.origin,
                    "completion": r.completion,
                    "rewards": rewards,
                    "total": num(r.total),
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(toml_rewards: &str) -> TrainConfig {
        TrainConfig::from_str(
            &format!("max_completion_length = 20\n{toml_rewards}"),
            grpo::config::Format::Toml,
            "run.toml",
            &[],
        )
        .unwrap()
    }

    fn samples(dir: &Path, lines: &[&str]) -> std::path::PathBuf {
        let p = dir.join("samples.jsonl");
        std::fs::write(&p, lines.join("\n")).unwrap();
        p
    }

    #[test]
    fn scores_groups_and_totals() {
        let dir = tempfile::tempdir().unwrap();
        let c = cfg(
            "[[rewards]]\nkind = \"answer_match\"\n[[rewards]]\nkind = \"diversity\"\nn = 1\nweight = 0.5\n\
             [[rewards]]\nkind = \"length\"\nmax_length = 10\ncache_length = 5\n",
        );
        let p = samples(
            dir.path(),
            &[
                r#"{"prompt": "1+1?", "answer": 2, "completion": "it is 2", "completion_tokens": 3}"#,
                r#"{"prompt": "1+1?", "answer": 2, "completion": "it is 3", "completion_tokens": 8}"#,
                r#"{"prompt": "2+2?", "answer": 4, "completion": "it is 2", "completion_tokens": 12}"#,
                r#"{"prompt": "q", "completion": "x", "completion_tokens": 1}"#,
            ],
        );
        let r = check_samples(&c, &p).unwrap();
        assert_eq!(r.names, vec!["answer_match", "diversity", "length"]);
        let s: Vec<Vec<f32>> = r.rows.iter().map(|x| x.scores.clone()).collect();
        // Rows 0 and 1 are one group: "2" and "3" are each their own word.
        assert_eq!(s[0], vec![1.0, 1.0 / 3.0, 0.0]);
        assert_eq!(s[1], vec![0.0, 1.0 / 3.0, -0.6]);
        // Row 2 is alone in its group: every word is its own.
        assert_eq!(s[2], vec![0.0, 1.0, -1.0]);
        assert!(s[3][0].is_nan());
        assert_eq!(r.rows[0].total, 1.0 + 0.5 / 3.0);
        assert_eq!(r.rows[3].total, 0.5);
        let table = r.table();
        assert!(
            table.contains("missing") && table.contains("answer_match"),
            "{table}"
        );
        assert_eq!(r.json_lines()[3]["rewards"]["answer_match"], Value::Null);
    }

    #[test]
    fn explicit_groups_and_bad_rows() {
        let dir = tempfile::tempdir().unwrap();
        let c = cfg("[[rewards]]\nkind = \"diversity\"\nn = 1\n");
        let p = samples(
            dir.path(),
            &[
                r#"{"prompt": "a", "completion": "x y", "group": 0}"#,
                r#"{"prompt": "b", "completion": "x z", "group": 0}"#,
            ],
        );
        let r = check_samples(&c, &p).unwrap();
        assert_eq!(r.rows[0].scores, vec![0.5]);
        for (line, want) in [
            (
                r#"{"prompt": "a"}"#,
                "samples.jsonl:1: missing `completion`",
            ),
            (r#"{"prompt": "a", "completion": 3}"#, "must be a string"),
            (
                r#"{"prompt": "a", "completion": "x", "group": "g"}"#,
                "`group` must be",
            ),
        ] {
            let p = samples(dir.path(), &[line]);
            let e = check_samples(&c, &p).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
    }
}
