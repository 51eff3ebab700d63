//! What the tests of several ranks share (`mpi.rs` under mpirun, `launch.rs` without MPI): the
//! arguments of a tiny run, its metrics and weights, and the check that a run of several ranks is
//! the one-process run on the same global batch.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub fn metrics(dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

pub fn weights(dir: &Path) -> HashMap<String, Vec<f32>> {
    let file = ["model.safetensors", "adapter_model.safetensors"]
        .iter()
        .map(|f| dir.join(f))
        .find(|f| f.is_file())
        .unwrap();
    let t = candle_core::safetensors::load(file, &candle_core::Device::Cpu).unwrap();
    t.into_iter()
        .map(|(k, v)| {
            let v = v.to_dtype(candle_core::DType::F32).unwrap();
            (k, v.flatten_all().unwrap().to_vec1().unwrap())
        })
        .collect()
}

/// The same run: identical rewards and advantage statistics, close losses, close weights.
pub fn assert_same_run(one: &Path, two: &Path, step: usize) {
    let (a, b) = (metrics(one), metrics(two));
    assert_eq!(a.len(), b.len(), "{a:?}\n{b:?}");
    assert!(
        a.iter()
            .any(|x| x["frac_reward_zero_std"].as_f64() < Some(1.0)),
        "no group had a signal: {a:?}"
    );
    for (x, y) in a.iter().zip(&b) {
        for (k, v) in x.as_object().unwrap() {
            let Some(v) = v.as_f64() else { continue };
            let timing = k.starts_with("time") || k.contains("seconds");
            if timing || k.starts_with("memory") || k == "tokens_per_second" {
                continue;
            }
            let w = y[k]
                .as_f64()
                .unwrap_or_else(|| panic!("{k} missing with 2 ranks"));
            // KL in the reward: the combined reward and its advantages carry the log-probs'
            // float tolerance; each reward function's scores stay exact.
            let kl_run = x.get("kl_reward/coef").is_some();
            let kl_shaped = kl_run
                && (k.starts_with("reward") || k.starts_with("advantage"))
                && !k.starts_with("rewards/");
            let exact = (k.starts_with("reward")
                || k.starts_with("completions/")
                || k == "frac_reward_zero_std"
                || k.starts_with("advantage"))
                && !kl_shaped;
            // Near zero, relative to the scale of what cancels there: advantages are O(1)
            // (KL in the reward moves their zero mean, and the loss's, by the log-probs' noise).
            let floor = if kl_run { 0.1 } else { 1e-2 };
            let tol = if exact {
                0.0
            } else {
                1e-4 * v.abs().max(floor)
            };
            assert!(
                (v - w).abs() <= tol,
                "step {}: {k} = {v} vs {w} with 2 ranks",
                x["step"]
            );
        }
    }
    let ck = format!("checkpoint-{step}");
    let (wa, wb) = (weights(&one.join(&ck)), weights(&two.join(&ck)));
    assert_eq!(wa.len(), wb.len());
    // Evaluations before training saw the same model: the same answers, written once.
    let e0 = |d: &Path| std::fs::read_to_string(d.join("eval/step-0.jsonl")).ok();
    assert_eq!(e0(one), e0(two), "eval answers before training");
    // Relative to the parameter's norm: ||a - b|| / ||a||, the worst tensor.
    let mut worst = (0f64, String::new());
    for (k, va) in &wa {
        let vb = &wb[k];
        let n: f64 = va
            .iter()
            .map(|&x| (x as f64).powi(2))
            .sum::<f64>()
            .sqrt()
            .max(1e-12);
        let d: f64 = va
            .iter()
            .zip(vb)
            .map(|(&x, &y)| (x as f64 - y as f64).powi(2))
            .sum::<f64>()
            .sqrt();
        if d / n > worst.0 {
            worst = (d / n, k.clone());
        }
    }
    eprintln!(
        "{}: parameters within {:.2e} (relative, {})",
        two.display(),
        worst.0,
        worst.1
    );
    // And training moved them (the comparison is not of two untouched models).
    let first = weights(&one.join(format!("checkpoint-{}", step - 1)));
    let moved = wa.iter().any(|(k, v)| v != &first[k]);
    assert!(moved, "{}: the parameters did not change", one.display());
    assert!(
        worst.0 < 1e-5,
        "parameters differ by {:e} (relative) in {}",
        worst.0,
        worst.1
    );
}

/// A config with rewards that differ within groups even for a random tiny model (so that every
/// step has advantages to follow): a format rule and group diversity.
pub fn config_file(dir: &Path) -> PathBuf {
    let path = dir.join("run.toml");
    std::fs::write(
        &path,
        "[[rewards]]\nkind = \"format\"\npattern = \"[xzqjkv]\"\n\
         [[rewards]]\nkind = \"diversity\"\nweight = 0.5\n",
    )
    .unwrap();
    path
}

pub fn args(
    model: &Path,
    out: &Path,
    per_device: usize,
    threads: usize,
    extra: &[&str],
) -> Vec<String> {
    let mut a: Vec<String> = [
        format!(
            "--config={}",
            config_file(model.parent().unwrap()).display()
        ),
        format!("--model={}", model.display()),
        format!("--output_dir={}", out.display()),
        format!("--per_device_train_batch_size={per_device}"),
        format!("--threads={threads}"),
        "--num_generations=4".into(),
        "--max_completion_length=6".into(),
        "--learning_rate=1e-4".into(),
        "--lr_scheduler_type=constant".into(),
        "--max_steps=3".into(),
        "--save_steps=1".into(),
        "--eval_steps=0".into(),
        "--report_to=none".into(),
        "--task.train_size=40".into(),
        "--task.eval_size=4".into(),
        "--seed=5".into(),
    ]
    .into();
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}
