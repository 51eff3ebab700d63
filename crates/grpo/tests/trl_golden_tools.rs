//! Golden tests against TRL for multi-turn episodes (fixture from scripts/make_tool_fixtures.py,
//! see tests/fixtures/grpo_tools/README.md): completions that mix the model's tokens with a
//! tool's, which TRL 1.16 leaves out of the loss through its `tool_mask` and grpo through
//! `TrainRow::sampled`. Pinned: the loss mask and token count (`num_items_in_batch`), the
//! log-probs at every completion token (tool tokens are context), the loss and the gradient of
//! every model parameter through the trainer's own [`policy_gradients`] for five loss cases, and
//! that a tool token's old and reference log-probs weigh nothing.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor, Var};
use grpo::logprobs::{completion_logprobs, Entropy, Packing};
use grpo::loss::{LossOptions, Reduction, VespoParams};
use grpo::rollout::{TrainBatch, TrainRow};
use grpo::train::{policy_gradients, CausalLmPolicy, SingleProcess, StepStats, UpdateOptions};
use grpo_models::hub::ModelSource;
use grpo_models::models::{CausalLm, Mode};
use grpo_models::weights::LoadedModel;
use serde_json::Value;

#[path = "support/diff.rs"]
mod diff;
use diff::max_diff;
#[path = "support/rerun.rs"]
mod rerun;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/grpo_tools")
}

fn cases_json() -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join("cases.json")).unwrap()).unwrap()
}

/// The tiny Llama of the plain golden tests (the tool fixture reuses it).
fn model() -> LoadedModel {
    grpo_models::weights::load_model(
        &ModelSource::HfDir(dir().join("../grpo/model")),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap()
}

fn f32s(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn rows(v: &Value) -> Vec<Vec<f32>> {
    v.as_array().unwrap().iter().map(f32s).collect()
}

fn grid(v: &Value) -> Tensor {
    Tensor::new(rows(v), &Device::Cpu).unwrap()
}

fn ids(v: &Value) -> Vec<Vec<u32>> {
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

/// The largest |a - b| relative to the largest |b| when that is above 1 (as in trl_golden.rs).
fn grad_diff(a: &Tensor, b: &Tensor) -> f32 {
    let scale = diff::max_abs(b);
    max_diff(a, b) / scale.max(1.0)
}

/// The fixture model's parameters as a full fine-tuning policy (names sorted, as the trainer's).
fn fixture_policy(m: &LoadedModel) -> CausalLmPolicy {
    let mut names: Vec<String> = m.tensors.keys().cloned().collect();
    names.sort();
    let vars = names
        .iter()
        .map(|n| Var::from_tensor(&m.tensors[n]).unwrap())
        .collect();
    CausalLmPolicy {
        cfg: m.config.clone(),
        names,
        vars,
        device: Device::Cpu,
        dtype: DType::F32,
        lora: None,
        sharded: None,
        base_model_name: "fixture".into(),
        generation_config: None,
    }
}

/// The fixture's episodes as the trainer's rows: each with its tool mask as `sampled` (episode 2,
/// which has no tool turn, as `None`, the others `Some`), the case's old / reference log-probs,
/// and a truncated episode inactive when the case masks truncated completions.
fn tool_batch(c: &Value, case: &Value) -> TrainBatch {
    let prompts = ids(&c["prompts"]);
    let comps = ids(&c["completions"]);
    let tool = ids(&c["tool_mask"]);
    let adv = f32s(&c["advantages"]);
    let truncated: Vec<bool> = c["truncated"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_bool().unwrap())
        .collect();
    let mask_truncated = case["mask_truncated_completions"].as_bool().unwrap();
    let of = |k: &str| (!case[k].is_null()).then(|| rows(&case[k]));
    let (old, refl) = (of("old_logps"), of("ref_logps"));
    TrainBatch {
        rows: comps
            .iter()
            .enumerate()
            .map(|(i, comp)| {
                let cut = |v: &Vec<Vec<f32>>| v[i][..comp.len()].to_vec();
                TrainRow {
                    prompt_ids: prompts[i / 4].clone(),
                    completion_ids: comp.clone(),
                    active: !(mask_truncated && truncated[i]),
                    advantage: adv[i],
                    old_logps: old.as_ref().map(cut),
                    ref_logps: refl.as_ref().map(cut),
                    sampled: (i != 2).then(|| tool[i].iter().map(|&m| m == 1).collect()),
                }
            })
            .collect(),
    }
}

fn loss_options(case: &Value) -> LossOptions {
    LossOptions {
        loss_type: case["loss_type"].as_str().unwrap().parse().unwrap(),
        importance_sampling_level: case["importance_sampling_level"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap(),
        epsilon_low: 0.2,
        epsilon_high: 0.28,
        delta: None,
        beta: case["beta"].as_f64().unwrap(),
        entropy_coef: case["entropy_coef"].as_f64().unwrap_or(0.0),
        use_bias_correction_kl: true, // TRL 1.16's default
        sapo_temperature_pos: 1.0,
        sapo_temperature_neg: 1.05,
        vespo: VespoParams::default(),
        top_entropy_quantile: case["top_entropy_quantile"].as_f64().unwrap_or(1.0),
        off_policy_mask_threshold: None,
    }
}

fn update_options(c: &Value, case: &Value, forward_chunk_tokens: usize) -> UpdateOptions {
    UpdateOptions {
        loss: loss_options(case),
        entropy: if case["entropy_coef"].as_f64().unwrap_or(0.0) != 0.0 {
            Entropy::WithGrad
        } else {
            Entropy::Detached
        },
        temperature: case["temperature"].as_f64().unwrap(),
        pad: 0,
        forward_chunk_tokens,
        max_grad_norm: 1.0,
        gradient_checkpointing: false,
        seed: 0,
        micro_batch: 8,
        accumulation_steps: 1,
        steps_per_generation: 1,
        num_iterations: case["num_iterations"].as_u64().unwrap() as usize,
        max_completion_length: c["max_completion_length"].as_u64().unwrap() as usize,
        max_bad_steps: 3,
    }
}

/// The loss and gradients of the trainer's update over the whole batch (one micro-batch), the
/// normalizer counting the batch's loss tokens as the trainer does.
fn gradients(
    m: &LoadedModel,
    c: &Value,
    case: &Value,
    batch: &TrainBatch,
    chunk: usize,
) -> (Vec<String>, Vec<Tensor>, StepStats) {
    let opts = update_options(c, case, chunk);
    let red = Reduction {
        accumulation_steps: 1,
        max_completion_length: opts.max_completion_length,
        dapo_tokens: batch.active_tokens() as f64,
        micro: None,
    };
    let p = fixture_policy(m);
    let all = 0..batch.rows.len();
    let (grads, st) = policy_gradients(
        &p,
        batch,
        std::slice::from_ref(&all),
        &red,
        &opts,
        0,
        &SingleProcess,
    )
    .unwrap();
    (p.names, grads, st)
}

#[test]
fn loss_mask_and_token_count_equal_trls() {
    let c = cases_json();
    let cases = c["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 5);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let batch = tool_batch(&c, case);
        let want = case["num_items_in_batch"].as_u64().unwrap() as usize;
        assert_eq!(batch.active_tokens(), want, "{name}: num_items_in_batch");
        let mb = batch.micro(0..batch.rows.len(), &Device::Cpu).unwrap();
        let want_mask = rows(&case["loss_mask"]);
        assert_eq!(mb.mask.to_vec2::<f32>().unwrap(), want_mask, "{name}: mask");
        for (i, (r, m)) in batch.rows.iter().zip(&want_mask).enumerate() {
            let n = m.iter().filter(|&&x| x > 0.0).count();
            assert_eq!(r.loss_tokens(), n, "{name}: row {i}");
        }
    }
}

/// Tool tokens are context: our forward equals transformers' at every completion token, the
/// model's and the tools' alike (TRL's attention covers both).
#[test]
fn log_probs_equal_trl_at_model_and_tool_tokens() {
    let c = cases_json();
    let m = model();
    let model =
        CausalLm::from_tensors(&m.config, m.tensors.clone(), DType::F32, &Device::Cpu).unwrap();
    let prompts = ids(&c["prompts"]);
    let comps = ids(&c["completions"]);
    let p_of: Vec<&[u32]> = (0..8).map(|i| prompts[i / 4].as_slice()).collect();
    let c_of: Vec<&[u32]> = comps.iter().map(|x| x.as_slice()).collect();
    for packing in [Packing::SharedPrompt, Packing::PerRow] {
        let (logps, _) = completion_logprobs(
            &model,
            &p_of,
            &c_of,
            0,
            1.0,
            Mode::Train,
            Entropy::Skip,
            packing,
        )
        .unwrap();
        for case in c["cases"].as_array().unwrap() {
            let name = case["name"].as_str().unwrap();
            // TRL leaves a masked truncated completion out of attention too: compare where the
            // completion mask (not the loss mask) is 1.
            let mask = grid(&case["completion_mask"]);
            let want = grid(&case["logps"]);
            let d = ((&logps - &want).unwrap() * &mask).unwrap();
            let scale = diff::max_abs(&(&want * &mask).unwrap()).max(1.0);
            let d = diff::max_abs(&d) / scale;
            assert!(d < 2e-6, "{name} ({packing:?}): log-probs differ by {d}");
        }
    }
}

/// The trainer's update against TRL's `_compute_loss` + `backward()` with a `tool_mask`, whole
/// and in forward chunks of one completion (where each chunk's normalizers count the
/// micro-batch's loss tokens, tool tokens left out).
#[test]
fn loss_and_every_gradient_equal_trl_with_tool_tokens_masked() {
    let c = cases_json();
    let m = model();
    let want_grads =
        candle_core::safetensors::load(dir().join("grads.safetensors"), &Device::Cpu).unwrap();
    for case in c["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let batch = tool_batch(&c, case);
        let want = case["loss"].as_f64().unwrap();
        for chunk in [1024, 1] {
            let (names, grads, st) = gradients(&m, &c, case, &batch, chunk);
            assert!(
                (st.loss - want).abs() < 1e-5,
                "{name} (chunk {chunk}): loss {} vs TRL {want}",
                st.loss
            );
            for (k, g) in names.iter().zip(&grads) {
                let d = grad_diff(g, &want_grads[&format!("{name}/{k}")]);
                assert!(
                    d < 2e-5,
                    "{name} (chunk {chunk}): gradient of {k} differs from TRL's by {d}"
                );
            }
            // TRL's clip_ratio/region_mean: clipped model tokens over the loss tokens (token
            // level; a sequence-level ratio is one per sequence).
            if let Some(clipped) = case["clipped_tokens"].as_object() {
                if case["importance_sampling_level"] == "token" {
                    let n = clipped["sampled"].as_f64().unwrap();
                    let share = n / case["num_items_in_batch"].as_f64().unwrap();
                    assert!(n > 0.0, "{name}: the fixture clips no ratio");
                    assert!(
                        (st.clip_region - share).abs() < 1e-6,
                        "{name}: clipped share {} vs TRL {share}",
                        st.clip_region
                    );
                }
            }
        }
        // The tool mask matters here: counting the tool tokens moves the loss away from TRL's.
        let mut unmasked = batch.clone();
        unmasked.rows.iter_mut().for_each(|r| r.sampled = None);
        let (_, _, st) = gradients(&m, &c, case, &unmasked, 1024);
        assert!(
            (st.loss - want).abs() > 1e-3,
            "{name}: the loss ignores the tool tokens even unmasked ({} vs {want})",
            st.loss
        );
    }
}

/// A tool token's old and reference log-probs weigh nothing: moving them (far enough to clip
/// every ratio and change every KL term) leaves the loss and every gradient bit for bit as they
/// were. (The tool tokens' ids do matter: later tokens attend to them.)
#[test]
fn tool_tokens_old_and_ref_log_probs_weigh_nothing() {
    let c = cases_json();
    let m = model();
    let tool = ids(&c["tool_mask"]);
    let mut seen = 0;
    for case in c["cases"].as_array().unwrap() {
        if case["old_logps"].is_null() {
            continue;
        }
        let name = case["name"].as_str().unwrap();
        let batch = tool_batch(&c, case);
        let mut moved = batch.clone();
        for (r, t) in moved.rows.iter_mut().zip(&tool) {
            for (k, _) in t.iter().enumerate().filter(|(_, &s)| s == 0) {
                r.old_logps.as_mut().unwrap()[k] += 3.0;
                if let Some(x) = r.ref_logps.as_mut() {
                    x[k] -= 2.0;
                }
            }
        }
        let (names, a, sa) = gradients(&m, &c, case, &batch, 1024);
        let (_, b, sb) = gradients(&m, &c, case, &moved, 1024);
        assert_eq!(sa.loss.to_bits(), sb.loss.to_bits(), "{name}: loss");
        assert_eq!(sa.kl.to_bits(), sb.kl.to_bits(), "{name}: kl");
        for ((k, x), y) in names.iter().zip(&a).zip(&b) {
            assert_eq!(max_diff(x, y), 0.0, "{name}: gradient of {k}");
        }
        seen += 1;
    }
    assert_eq!(seen, 3);
}

/// This file's tests again, in a child process with ("GRPO_KERNELS", "portable").
#[test]
fn every_tool_golden_test_passes_on_the_portable_kernels() {
    rerun::rerun_with(&[("GRPO_KERNELS", "portable")], 4);
}
