//! GPU checks, opt-in: compiled only with `--features cuda`, and skipped (with a message) where
//! no CUDA device answers. CI has no GPU; run them on a GPU machine with
//!   cargo test --release --features cuda -p grpo --test cuda
//! They load the tiny transformers fixtures onto the GPU and compare logits and greedy decoding
//! with transformers' (as `tiny_models.rs` does on the CPU), and check that training on the GPU
//! gives every parameter a gradient.
#![cfg(feature = "cuda")]

use std::path::PathBuf;

use candle_core::{DType, Device, Var};
use grpo::hub::ModelSource;
use grpo::logprobs::next_token_logprobs;
use grpo::models::{CausalLm, Mode, SeqBatch};
use grpo::sampler::{generate, PromptInput, SamplingParams};
use grpo::weights::load_model;
use serde_json::Value;

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
