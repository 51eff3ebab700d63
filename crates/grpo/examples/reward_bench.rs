//! Times one reward (any `[[rewards]]` kind: a scorer program, an HTTP endpoint, a built-in rule)
//! over a file of completions (used by bench/reward_throughput.sh; not a benchmark of record by
//! itself).
//!
//!     cargo run --release -p grpo --example reward_bench -- completions.jsonl reward.toml CASE [REPS]
//!
//! `completions.jsonl`: `{"prompt": ..., "completion": ..., "answer": ...}` per line;
//! `reward.toml`: the body of one `[[rewards]]` table. Prints one JSON line: start-up time, the time
//! of each `score()` over all completions, the best, completions per second, the mean reward and the
//! scorer's counters.
use std::time::Instant;

use anyhow::{bail, Context};
use grpo::data::{Example, Prompt};
use grpo::rewards::{parse_rewards, RewardContext, ScoreItem};
use serde_json::{Map, Value};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [completions, config, case, rest @ ..] = args.as_slice() else {
        bail!("usage: reward_bench COMPLETIONS.jsonl REWARD.toml CASE [REPS]");
    };
    let reps: usize = match rest.first() {
        Some(r) => r
            .parse()
            .with_context(|| format!("REPS `{r}` is not a number"))?,
        None => 3,
    };

    let text = std::fs::read_to_string(completions).with_context(|| completions.clone())?;
    let mut examples = vec![];
    let mut outputs = vec![];
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let row: Map<String, Value> =
            serde_json::from_str(line).with_context(|| format!("{completions}:{}", i + 1))?;
        let field = |k: &str| row.get(k).and_then(Value::as_str).map(str::to_owned);
        let (Some(prompt), Some(completion)) = (field("prompt"), field("completion")) else {
            bail!(
                "{completions}:{}: needs \"prompt\" and \"completion\" strings",
                i + 1
            );
        };
        examples.push(Example {
            prompt: Prompt::Text(prompt),
            answer: field("answer"),
            metadata: Map::new(),
            origin: format!("{completions}:{}", i + 1),
            tokens: None,
        });
        outputs.push(completion);
    }
    let items: Vec<ScoreItem> = examples
        .iter()
        .zip(&outputs)
        .map(|(e, c)| ScoreItem::new(e, c))
        .collect();

    let toml_text = std::fs::read_to_string(config).with_context(|| config.clone())?;
    let table: toml::Table = toml::from_str(&toml_text).with_context(|| config.clone())?;
    let obj: Map<String, Value> = serde_json::from_value(serde_json::to_value(table)?)?;
    let mut obj = obj;
    obj.entry("name")
        .or_insert_with(|| Value::String(case.clone()));
    let ctx = RewardContext {
        max_completion_length: 256,
        device: candle_core::Device::Cpu,
    };
    let t0 = Instant::now();
    let mut parsed = parse_rewards(&[Value::Object(obj)], &ctx)?;
    let scorer = parsed.pop().context("no reward")?;
    let start_s = t0.elapsed().as_secs_f64();

    let mut times = vec![];
    let mut rewards = vec![];
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        rewards = scorer.score(&items)?;
        times.push(t.elapsed().as_secs_f64());
    }
    let best = times.iter().copied().fold(f64::INFINITY, f64::min);
    let scored: Vec<f32> = rewards.iter().copied().filter(|x| !x.is_nan()).collect();
    let mean = scored.iter().sum::<f32>() / scored.len().max(1) as f32;
    let out = serde_json::json!({
        "bench": "reward",
        "case": case,
        "n": items.len(),
        "start_s": round(start_s),
        "score_s": times.iter().map(|&t| round(t)).collect::<Vec<_>>(),
        "best_s": round(best),
        "per_s": (items.len() as f64 / best * 10.0).round() / 10.0,
        "mean_reward": mean,
        "missing": rewards.len() - scored.len(),
        "stats": scorer.scorer_stats().map(|s| format!("{s:?}")),
    });
    println!("{out}");
    Ok(())
}

fn round(x: f64) -> f64 {
    (x * 1e6).round() / 1e6
}
