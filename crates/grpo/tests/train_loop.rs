//! The training loop end to end on a tiny random Llama with SmolLM2's real tokenizer and chat
//! template: it runs, logs, checkpoints in a layout we load back, and a run stopped after step k
//! and resumed equals the uninterrupted run exactly (weights and metrics).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use grpo::config::{Format, TrainConfig};
use grpo::train::{train, RunControl};
use grpo_models::hub::ModelSource;

#[path = "train_loop/eval.rs"]
mod eval;
#[path = "train_loop/options.rs"]
mod options;
#[path = "train_loop/resume.rs"]
mod resume;
#[path = "train_loop/rewards.rs"]
mod rewards;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

#[path = "support/rerun.rs"]
#[allow(dead_code)]
mod rerun;
#[path = "support/tiny_llama.rs"]
mod support;

/// A 2-layer Llama (hidden 32) over SmolLM2's vocabulary, fixed random weights.
fn tiny_model(dir: &Path) {
    support::tiny_llama(dir, &fixtures());
}

fn config(model: &Path, out: &Path, extra: &str) -> TrainConfig {
    config_with(model, out, extra, &[])
}

/// [`config`] with `--key=value` overrides.
fn config_with(model: &Path, out: &Path, extra: &str, overrides: &[&str]) -> TrainConfig {
    let text = format!(
        "model = \"{}\"\noutput_dir = \"{}\"\nnum_generations = 4\nper_device_train_batch_size = 4\n\
         gradient_accumulation_steps = 2\nmax_completion_length = 6\nlearning_rate = 1e-3\n\
         lr_scheduler_type = \"cosine\"\nwarmup_steps = 1\nmax_steps = 4\nsave_steps = 2\nthreads = 2\n\
         eval_steps = 2\neval_num_prompts = 3\nreport_to = [\"tensorboard\"]\n{extra}\n\
         [task]\ntrain_size = 20\neval_size = 5\n",
        model.display(),
        out.display()
    );
    let overrides: Vec<String> = overrides.iter().map(|o| o.to_string()).collect();
    TrainConfig::from_str(&text, Format::Toml, "test", &overrides).unwrap()
}

fn metrics(dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            let o = v.as_object_mut().unwrap();
            o.retain(|k, _| {
                !k.starts_with("time") && !k.starts_with("memory/") && k != "tokens_per_second"
            });
            v
        })
        .collect()
}

fn weights(dir: &Path) -> HashMap<String, Vec<f32>> {
    let m = grpo_models::weights::load_model(
        &ModelSource::HfDir(dir.to_path_buf()),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    m.tensors
        .into_iter()
        .map(|(k, v)| (k, v.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect()
}

/// `groups.jsonl` against `completions.jsonl` in `dir` (groups of 4): one row per group, its
/// reward mean and advantage mean / std those of its completions, std ~1 where the rewards spread
/// (`scale_rewards = group`). Returns how many groups had a spread.
fn check_groups_log(dir: &Path) -> usize {
    let comps = jsonl(&dir.join("completions.jsonl"));
    let groups = jsonl(&dir.join("groups.jsonl"));
    assert_eq!(groups.len() * 4, comps.len());
    let f = |v: &serde_json::Value| v.as_f64().unwrap();
    let mean = |x: &[f64]| x.iter().sum::<f64>() / x.len() as f64;
    let std = |x: &[f64]| {
        let m = mean(x);
        (x.iter().map(|v| (v - m).powi(2)).sum::<f64>() / (x.len() - 1) as f64).sqrt()
    };
    let mut spread = 0;
    for (gr, c) in groups.iter().zip(comps.chunks(4)) {
        assert_eq!(gr["step"], c[0]["step"]);
        let rewards: Vec<f64> = c.iter().map(|x| f(&x["reward"])).collect();
        let adv: Vec<f64> = c.iter().map(|x| f(&x["advantage"])).collect();
        assert!(
            (f(&gr["reward_mean"]) - mean(&rewards)).abs() < 1e-5,
            "{gr}"
        );
        assert!(f(&gr["advantage_mean"]).abs() < 1e-5, "{gr}");
        assert!((f(&gr["advantage_std"]) - std(&adv)).abs() < 1e-4, "{gr}");
        assert_eq!(gr["scorable"], 4);
        if gr["zero_std"] == false {
            spread += 1;
            assert!((f(&gr["advantage_std"]) - 1.0).abs() < 1e-2, "{gr}");
        }
    }
    spread
}

fn jsonl(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Trains the tiny model for 2 steps (no eval) with `extra` config and returns the 2 training
/// steps' metric lines.
fn two_steps(extra: &str) -> Vec<serde_json::Value> {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    tiny_model(&model);
    let out_dir = tmp.path().join("run");
    let mut cfg = config(&model, &out_dir, extra);
    cfg.run.max_steps = Some(2);
    cfg.logging.eval_steps = 0;
    let out = train(&cfg, &RunControl::default()).unwrap();
    assert_eq!(out.steps, 2);
    let steps: Vec<_> = metrics(&out_dir)
        .into_iter()
        .filter(|l| l.get("loss").is_some())
        .collect();
    assert_eq!(steps.len(), 2);
    steps
}

fn adapter_tensors(dir: &Path) -> Vec<(String, Vec<f32>)> {
    grpo::peft::load_peft(dir, &Device::Cpu)
        .unwrap()
        .tensors
        .into_iter()
        .map(|(k, v)| (k, v.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect()
}

/// An HTTP endpoint that answers every request with an empty 200 (so every reward it is asked for
/// is missing): enough for runs that need an endpoint that is up. Returns `http://ADDR`.
fn unscoring_endpoint() -> String {
    use std::io::{BufRead, BufReader, Read, Write};
    static URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    URL.get_or_init(|| {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let mut r = BufReader::new(conn.try_clone().unwrap());
                let mut len = 0usize;
                loop {
                    let mut h = String::new();
                    if r.read_line(&mut h).unwrap_or(0) == 0 || h.trim().is_empty() {
                        break;
                    }
                    if let Some((k, v)) = h.split_once(':') {
                        if k.eq_ignore_ascii_case("content-length") {
                            len = v.trim().parse().unwrap_or(0);
                        }
                    }
                }
                let mut body = vec![0; len];
                let _ = r.read_exact(&mut body);
                let mut w = conn;
                let _ = write!(
                    w,
                    "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}"
                );
            }
        });
        url
    })
    .clone()
}

/// No Python here: a skip, or under `GRPO_REQUIRE_PYTHON=1` (set by `.ci/run`) a failure.
fn no_python(why: &str) {
    assert!(
        std::env::var("GRPO_REQUIRE_PYTHON").map_or(true, |v| v != "1"),
        "GRPO_REQUIRE_PYTHON=1 but {why}"
    );
    eprintln!("skipped: {why}");
}
