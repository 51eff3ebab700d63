//! Tiny random Llama / Llama-3 / Qwen2 / Qwen3 / GPT-2 / Mistral (sliding window) / Phi-3 /
//! Phi-4-mini (partial RoPE, tied) / Gemma 2 / Gemma 3 checkpoints made by
//! `scripts/make_fixtures.py` with transformers: our logits, log-probs and greedy decoding must match
//! theirs; every parameter must receive a gradient; analytic gradients must match finite differences.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor, Var};
use grpo::logprobs::next_token_logprobs;
use grpo_models::hub::ModelSource;
use grpo_models::models::{CausalLm, Mode, SeqBatch};
use grpo_models::sampler::{generate, PromptInput, SamplingParams};
use grpo_models::weights::{load_model, LoadedModel};
use serde_json::Value;

#[path = "tiny_models/bf16.rs"]
mod bf16;
#[path = "tiny_models/decoding.rs"]
mod decoding;
#[path = "tiny_models/gradients.rs"]
mod gradients;

#[path = "support/archs.rs"]
mod archs;
#[path = "support/long_rows.rs"]
mod long_rows;
#[path = "support/rerun.rs"]
mod rerun;
use archs::{ARCHS, LATER};

fn fixture_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tiny")
        .join(name)
}

fn load(name: &str, dtype: DType) -> (LoadedModel, Value) {
    let dir = fixture_dir(name);
    let m = load_model(&ModelSource::HfDir(dir.clone()), dtype, &Device::Cpu).unwrap();
    let text = std::fs::read_to_string(dir.join("expected.json")).unwrap();
    (m, serde_json::from_str(&text).unwrap())
}

fn ids2(v: &Value) -> Vec<Vec<u32>> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect()
        })
        .collect()
}

fn f32_rows(v: &Value) -> Vec<Option<Vec<f32>>> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|r| {
            r.as_array()
                .map(|r| r.iter().map(|x| x.as_f64().unwrap() as f32).collect())
        })
        .collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The model with its projections and LM head packed for the decoding GEMM, where the kernel
/// runs (AVX-512); elsewhere packing is a no-op.
fn packed_model(m: &LoadedModel) -> CausalLm {
    let mut model = m.build().unwrap();
    let n = model.pack_for_decoding().unwrap();
    match grpo_models::kernels::Compute::resolve(&candle_core::Device::Cpu, candle_core::DType::F32)
        .packs_for_decoding()
    {
        true => assert!(n > 4, "only {n} weights packed"),
        false => assert_eq!(n, 0),
    }
    // The fused decoding step computes the Llama layout, a window on every layer included;
    // GPT-2, partial RoPE and Gemma's layers decode through the tensor path.
    let cfg = model.config();
    let llama_family = !matches!(
        cfg.arch,
        grpo_models::models::Arch::Gpt2
            | grpo_models::models::Arch::Gemma2
            | grpo_models::models::Arch::Gemma3
    ) && cfg.extras.rotary_dim.is_none();
    assert_eq!(
        model.fused_decoding(),
        llama_family
            && grpo_models::kernels::Compute::resolve(
                &candle_core::Device::Cpu,
                candle_core::DType::F32
            )
            .packs_for_decoding()
    );
    model
}

/// Variables for every checkpoint tensor, and a model over them.
fn trainable(m: &LoadedModel, dtype: DType) -> (CausalLm, HashMap<String, Var>) {
    let vars: HashMap<String, Var> = m
        .tensors
        .iter()
        .map(|(k, t)| {
            (
                k.clone(),
                Var::from_tensor(&t.to_dtype(dtype).unwrap()).unwrap(),
            )
        })
        .collect();
    (build(m, &vars, dtype), vars)
}

/// A model over the current values of `vars` (a built model holds a snapshot of its weights).
fn build(m: &LoadedModel, vars: &HashMap<String, Var>, dtype: DType) -> CausalLm {
    let tensors = vars
        .iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
        .collect();
    CausalLm::from_tensors(&m.config, tensors, dtype, &Device::Cpu).unwrap()
}

fn padded_batch() -> SeqBatch {
    SeqBatch::from_parts(
        vec![vec![0, 0, 11, 200, 47, 3, 99], vec![5, 6, 7, 8, 9, 10, 250]],
        vec![vec![0, 0, 0, 1, 2, 3, 4], vec![0, 1, 2, 3, 4, 5, 6]],
        vec![
            vec![false, false, true, true, true, true, true],
            vec![true; 7],
        ],
        &Device::Cpu,
    )
    .unwrap()
}

/// A scalar loss touching every position: weighted sum of valid next-token log-probs.
fn loss(model: &CausalLm, batch: &SeqBatch) -> Tensor {
    let lp = next_token_logprobs(model, batch, 0.7, Mode::Train).unwrap(); // [B, T-1]
    let (b, t) = lp.dims2().unwrap();
    let w: Vec<f64> = (0..b * t)
        .map(|i| {
            let (r, c) = (i / t, i % t);
            if batch.valid[r][c + 1] && batch.valid[r][c] {
                1.0 + 0.1 * i as f64
            } else {
                0.0
            }
        })
        .collect();
    let w = Tensor::from_vec(w, (b, t), &Device::Cpu)
        .unwrap()
        .to_dtype(lp.dtype())
        .unwrap();
    (lp * w).unwrap().sum_all().unwrap()
}

/// The later families keep HF module names: PEFT's default LoRA targets name projections of
/// theirs (Phi-3's fused `qkv_proj` as one), an attached adapter moves the logits and merging it
/// gives the same logits; a checkpoint written in HF layout loads back to the same logits.
#[test]
fn later_families_keep_hf_names_for_lora_and_checkpoints() {
    use grpo_models::models::LoraAdapter;
    for name in LATER {
        let (m, exp) = load(name, DType::F32);
        let mut model = m.build().unwrap();
        let batch = SeqBatch::right_padded(&ids2(&exp["input_ids"]), 0, &Device::Cpu).unwrap();
        let logits = |model: &CausalLm| {
            let h = model.forward_hidden(&batch, Mode::Infer).unwrap();
            model
                .logits(&h)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        let base = logits(&model);
        let targets = grpo::peft::default_targets(m.config.arch);
        let mut adapters = HashMap::new();
        for (module, i, o) in model.projection_shapes().unwrap() {
            if targets.iter().any(|t| module.ends_with(&format!(".{t}"))) {
                let a = Tensor::randn(0f32, 0.1, (4, i), &Device::Cpu).unwrap();
                let b = Tensor::randn(0f32, 0.1, (o, 4), &Device::Cpu).unwrap();
                adapters.insert(module, LoraAdapter::new(a, b, 2.0, None).unwrap());
            }
        }
        let per_layer = if m.config.arch == grpo_models::models::Arch::Phi3 {
            1
        } else {
            2
        };
        assert_eq!(
            adapters.len(),
            per_layer * m.config.num_layers,
            "{name}: {targets:?}"
        );
        assert_eq!(model.set_lora(&adapters).unwrap(), adapters.len());
        let attached = logits(&model);
        assert!(
            max_diff(&attached, &base) > 1e-3,
            "{name}: the adapters change nothing"
        );
        let mut merged = m.build().unwrap();
        merged.merge_lora(&adapters).unwrap();
        let d = max_diff(&logits(&merged), &attached);
        assert!(d < 1e-4, "{name}: merged adapters differ by {d}");

        let dir = tempfile::tempdir().unwrap();
        let mut tensors: Vec<(String, Tensor)> = m
            .tensors
            .iter()
            .map(|(k, t)| (k.clone(), t.clone()))
            .collect();
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        let export = grpo::checkpoint::HfExport {
            config: &m.config,
            tensors: &tensors,
            tokenizer: None,
            generation_config: None,
            eos_token_ids: &m.eos_token_ids,
        };
        grpo::checkpoint::write_hf_model(dir.path(), &export).unwrap();
        let back = load_model(
            &ModelSource::HfDir(dir.path().into()),
            DType::F32,
            &Device::Cpu,
        )
        .unwrap();
        assert_eq!(back.config.arch, m.config.arch);
        let d = max_diff(&logits(&back.build().unwrap()), &base);
        assert_eq!(
            d, 0.0,
            "{name}: the written checkpoint's logits differ by {d}"
        );
    }
}

/// This file's tests again, in a child process with ("GRPO_KERNELS", "portable").
#[test]
fn every_transformers_test_passes_on_the_portable_kernels() {
    rerun::rerun_with(&[("GRPO_KERNELS", "portable")], 3);
}

/// This file's tests again, in a child process with ("GRPO_ISA", "avx2").
#[test]
fn every_transformers_test_passes_with_the_avx2_kernels() {
    rerun::rerun_with(&[("GRPO_ISA", "avx2")], 3);
}
