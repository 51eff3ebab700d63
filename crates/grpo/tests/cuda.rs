//! GPU checks, opt-in: compiled only with `--features cuda`, and skipped (with a message) where
//! no CUDA device answers. CI has no GPU; run them on a GPU machine with
//!   cargo test --release --features cuda -p grpo --test cuda
//! They load the tiny transformers fixtures onto the GPU and compare logits and greedy decoding
//! with transformers' (as `tiny_models.rs` does on the CPU), check that training on the GPU
//! gives every parameter a gradient, and train a tiny model for a few GRPO steps on the GPU:
//! equal to the CPU's portable path (the same candle ops) within f32 tolerances, in bf16 too,
//! and resumed exactly.
#![cfg(feature = "cuda")]

use std::path::PathBuf;

use candle_core::{DType, Device, Var};
use grpo::hub::ModelSource;
use grpo::logprobs::next_token_logprobs;
use grpo::models::{CausalLm, Mode, SeqBatch};
use grpo::sampler::{generate, PromptInput, SamplingParams};
use grpo::weights::load_model;
use serde_json::Value;

#[path = "support/tiny_llama.rs"]
mod support;

const ARCHS: [&str; 5] = ["llama", "llama3", "qwen2", "qwen3", "gpt2"];

fn gpu() -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("no CUDA device ({e}): GPU checks skipped");
            None
        }
    }
}

fn fixture(name: &str) -> (PathBuf, Value) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tiny")
        .join(name);
    let text = std::fs::read_to_string(dir.join("expected.json")).unwrap();
    (dir, serde_json::from_str(&text).unwrap())
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn gpu_logits_and_greedy_decoding_match_transformers() {
    let Some(dev) = gpu() else { return };
    for name in ARCHS {
        let (dir, exp) = fixture(name);
        let m = load_model(&ModelSource::HfDir(dir), DType::F32, &dev).unwrap();
        let model = m.build().unwrap();
        let ids: Vec<Vec<u32>> = exp["input_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(u32s)
            .collect();
        let batch = SeqBatch::right_padded(&ids, 0, &dev).unwrap();
        let h = model.forward_hidden(&batch, Mode::Infer).unwrap();
        let logits = model.logits(&h).unwrap().to_vec3::<f32>().unwrap();
        let mut worst = 0f32;
        for (b, row) in logits.iter().enumerate() {
            for (t, l) in row.iter().enumerate() {
                let want = &exp["logits"][b][t];
                for (x, w) in l.iter().zip(want.as_array().unwrap()) {
                    worst = worst.max((x - w.as_f64().unwrap() as f32).abs());
                }
            }
        }
        eprintln!("{name}: GPU logits within {worst} of transformers'");
        assert!(worst < 1e-3, "{name}: GPU logits differ by {worst}");
        let g = &exp["greedy"];
        let want = u32s(&g["new_tokens"]);
        let params = SamplingParams {
            max_new_tokens: want.len(),
            min_new_tokens: want.len(),
            temperature: 0.0,
            eos_token_ids: m.eos_token_ids.clone(),
            ..Default::default()
        };
        let prompt = [PromptInput {
            ids: u32s(&g["prompt_ids"]),
            seed: 1,
        }];
        let (out, _) = generate(&model, None, &prompt, 1, &params).unwrap();
        assert_eq!(out[0][0].ids, want, "{name}: GPU greedy tokens differ");
    }
}

#[test]
fn gpu_training_forward_gives_every_parameter_a_gradient() {
    let Some(dev) = gpu() else { return };
    for name in ARCHS {
        let (dir, _) = fixture(name);
        let m = load_model(&ModelSource::HfDir(dir), DType::F32, &dev).unwrap();
        let vars: Vec<(String, Var)> = m
            .tensors
            .iter()
            .map(|(k, t)| (k.clone(), Var::from_tensor(t).unwrap()))
            .collect();
        let tensors = vars
            .iter()
            .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
            .collect();
        let model = CausalLm::from_tensors(&m.config, tensors, DType::F32, &dev).unwrap();
        let batch = SeqBatch::right_padded(&[vec![5, 17, 33, 2, 90, 41, 7]], 0, &dev).unwrap();
        let lp = next_token_logprobs(&model, &batch, 1.0, Mode::Train).unwrap();
        let grads = lp.sum_all().unwrap().backward().unwrap();
        for (k, v) in &vars {
            let g = grads.get(v.as_tensor());
            let norm = g.map(|g| {
                g.sqr()
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap()
            });
            assert!(
                norm.is_some_and(|n| n > 0.0 && n.is_finite()),
                "{name}: {k} has no gradient on the GPU"
            );
        }
    }
}

/// A temporary directory holding the tiny Llama made for training tests (in `model/`).
fn tiny_llama_dir() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    let model = tmp.path().join("model");
    support::tiny_llama(&model, &fixtures);
    (tmp, model)
}

fn train_config(
    model: &std::path::Path,
    out: &std::path::Path,
    extra: &str,
) -> grpo::config::TrainConfig {
    let text = format!(
        "model = \"{}\"\noutput_dir = \"{}\"\nnum_generations = 4\nper_device_train_batch_size = 4\n\
         gradient_accumulation_steps = 2\nmax_completion_length = 6\nlearning_rate = 1e-3\n\
         max_steps = 4\nsave_steps = 2\nthreads = 2\nbeta = 0.04\neval_steps = 0\n\
         report_to = \"none\"\n{extra}\n[task]\ntrain_size = 20\neval_size = 5\n",
        model.display(),
        out.display()
    );
    grpo::config::TrainConfig::from_str(&text, grpo::config::Format::Toml, "test", &[]).unwrap()
}

/// metrics.jsonl's training rows, without timings and memory readings.
fn step_rows(dir: &std::path::Path) -> Vec<serde_json::Map<String, Value>> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| match serde_json::from_str::<Value>(l).unwrap() {
            Value::Object(mut o) if o.contains_key("loss") => {
                o.retain(|k, _| !k.starts_with("time") && !k.starts_with("memory/"));
                Some(o)
            }
            _ => None,
        })
        .collect()
}

fn checkpoint_weights(dir: &std::path::Path) -> std::collections::HashMap<String, Vec<f32>> {
    load_model(
        &ModelSource::HfDir(dir.to_path_buf()),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap()
    .tensors
    .into_iter()
    .map(|(k, v)| (k, v.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
    .collect()
}

/// GRPO on the GPU against the CPU's portable path (`kernels = "portable"`: the same candle
/// ops, on the CPU), 4 steps of a tiny Llama with a KL to the reference: the same completions
/// (sampling the same seeded draws from logits equal to f32 rounding; a token could flip only
/// if a draw fell within rounding of a boundary), rewards equal, loss, KL and gradient norm
/// within 1e-3 relative, weights within 1e-4. Then bf16 mixed precision trains on the GPU, and
/// a GPU run stopped after step 2 and resumed equals the uninterrupted one bit for bit.
#[test]
fn gpu_grpo_steps_equal_the_portable_cpu_path_and_resume_exactly() {
    use grpo::train::{train, RunControl};
    if gpu().is_none() {
        return;
    }
    let (tmp, model) = tiny_llama_dir();
    let (gpu_dir, cpu_dir) = (tmp.path().join("gpu"), tmp.path().join("cpu"));
    let done = train(
        &train_config(&model, &gpu_dir, "device = \"cuda\""),
        &RunControl::default(),
    )
    .unwrap();
    assert_eq!(done.steps, 4);
    train(
        &train_config(&model, &cpu_dir, "kernels = \"portable\""),
        &RunControl::default(),
    )
    .unwrap();
    let (g, c) = (step_rows(&gpu_dir), step_rows(&cpu_dir));
    assert_eq!(g.len(), c.len());
    let close = |a: &Value, b: &Value| match (a.as_f64(), b.as_f64()) {
        (Some(x), Some(y)) => (x - y).abs() <= 1e-3 * x.abs().max(y.abs()).max(1e-3),
        _ => a == b,
    };
    for (rg, rc) in g.iter().zip(&c) {
        for k in [
            "reward",
            "loss",
            "kl",
            "grad_norm",
            "completions/mean_length",
        ] {
            if let (Some(a), Some(b)) = (rg.get(k), rc.get(k)) {
                assert!(close(a, b), "step {}: {k} GPU {a} vs CPU {b}", rg["step"]);
            }
        }
    }
    let read = |d: &std::path::Path| std::fs::read_to_string(d.join("completions.jsonl")).unwrap();
    assert_eq!(
        read(&gpu_dir),
        read(&cpu_dir),
        "GPU and CPU sampled other completions"
    );
    let (wg, wc) = (
        checkpoint_weights(&gpu_dir.join("checkpoint-4")),
        checkpoint_weights(&cpu_dir.join("checkpoint-4")),
    );
    let worst = wg
        .iter()
        .flat_map(|(k, v)| v.iter().zip(&wc[k]).map(|(a, b)| (a - b).abs()))
        .fold(0f32, f32::max);
    eprintln!("GPU vs portable CPU after 4 steps: weights within {worst}");
    assert!(worst < 1e-4, "weights differ by {worst}");

    // bf16 mixed precision on the GPU: trains, finite, f32 checkpoints.
    let bf16_dir = tmp.path().join("bf16");
    train(
        &train_config(&model, &bf16_dir, "device = \"cuda\"\ndtype = \"bf16\""),
        &RunControl::default(),
    )
    .unwrap();
    for r in step_rows(&bf16_dir) {
        for k in ["loss", "kl", "grad_norm"] {
            assert!(
                r[k].as_f64().is_some_and(f64::is_finite),
                "bf16 {k}: {}",
                r[k]
            );
        }
    }

    // Resume on the GPU: 2 steps, stop, resume to 4: bit-identical.
    let part = tmp.path().join("part");
    let cfg = train_config(&model, &part, "device = \"cuda\"");
    let first = RunControl {
        max_rounds_this_run: Some(2),
        ..Default::default()
    };
    train(&cfg, &first).unwrap();
    let resume = RunControl {
        resume: true,
        ..Default::default()
    };
    train(&cfg, &resume).unwrap();
    assert!(
        checkpoint_weights(&part.join("checkpoint-4")) == wg,
        "a resumed GPU run differs from the uninterrupted one"
    );
    assert_eq!(step_rows(&part), g);
}

/// QLoRA on the GPU: the quantized base stays quantized on the device (dequantized there for each
/// forward, the input gradient through it), with top-k / top-p sampling chosen on the device;
/// 4 steps equal the CPU's portable path (the same candle ops and the same device sampler):
/// the same completions, metrics within 1e-3 relative. For NF4 and q4_0.
#[test]
fn gpu_qlora_with_truncated_sampling_equals_the_portable_cpu_path() {
    use grpo::train::{train, RunControl};
    if gpu().is_none() {
        return;
    }
    let (tmp, model) = tiny_llama_dir();
    for kind in ["nf4", "q4_0"] {
        let extra = format!(
            "base_quantization = \"{kind}\"\ntop_k = 20\ntop_p = 0.9\n[lora]\nr = 4\nalpha = 8\n"
        );
        let (gpu_dir, cpu_dir) = (
            tmp.path().join(kind),
            tmp.path().join(format!("{kind}-cpu")),
        );
        let on_gpu = format!("device = \"cuda\"\n{extra}");
        let on_cpu = format!("kernels = \"portable\"\n{extra}");
        train(
            &train_config(&model, &gpu_dir, &on_gpu),
            &RunControl::default(),
        )
        .unwrap();
        train(
            &train_config(&model, &cpu_dir, &on_cpu),
            &RunControl::default(),
        )
        .unwrap();
        let (g, c) = (step_rows(&gpu_dir), step_rows(&cpu_dir));
        assert_eq!(g.len(), 4);
        for (rg, rc) in g.iter().zip(&c) {
            for k in ["reward", "loss", "kl", "grad_norm"] {
                let (a, b) = (rg[k].as_f64().unwrap(), rc[k].as_f64().unwrap());
                assert!(
                    (a - b).abs() <= 1e-3 * a.abs().max(b.abs()).max(1e-3),
                    "{kind} step {}: {k} GPU {a} vs CPU {b}",
                    rg["step"]
                );
            }
        }
        let read =
            |d: &std::path::Path| std::fs::read_to_string(d.join("completions.jsonl")).unwrap();
        assert_eq!(read(&gpu_dir), read(&cpu_dir), "{kind}: other completions");
    }
}
