//! Golden tests against TRL and torch (fixtures from scripts/make_grpo_fixtures.py, see
//! tests/fixtures/grpo/README.md): advantages, the GRPO loss and the gradient of every model
//! parameter for each loss_type x beta x num_iterations x importance-sampling level (plus a
//! temperature and a mask_truncated_completions case), one AdamW trajectory with clipping, and
//! the LR schedules.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor, Var};
use grpo::advantages::ScaleRewards;
use grpo::advantages::{combine_rewards, decoupled_advantages, group_advantages, AdvantageOptions};
use grpo::hub::ModelSource;
use grpo::logprobs::{completion_logprobs, Entropy, Packing};
use grpo::loss::{grpo_loss, LossInputs, LossOptions, Reduction};
use grpo::loss::{IsLevel, LossType};
use grpo::models::grad_sink::GradSink;
use grpo::models::{CausalLm, Mode};
use grpo::optim::LrSchedule;
use grpo::optim::{clip_factor, lr_lambda, AdamW, AdamWConfig};
use serde_json::Value;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/grpo")
}

fn json(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join(name)).unwrap()).unwrap()
}

fn f32s(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().map_or(f32::NAN, |f| f as f32))
        .collect()
}

fn grid(v: &Value) -> Tensor {
    let rows: Vec<Vec<f32>> = v.as_array().unwrap().iter().map(f32s).collect();
    Tensor::new(rows, &Device::Cpu).unwrap()
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

#[test]
fn advantages_equal_trl() {
    let c = json("cases.json");
    let per_func: Vec<f32> = c["rewards_per_func"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(f32s)
        .collect();
    let rewards = combine_rewards(&per_func, &f32s(&c["reward_weights"])).unwrap();
    let want_r = f32s(&c["rewards"]);
    for (a, b) in rewards.iter().zip(&want_r) {
        assert!(
            (a.is_nan() && b.is_nan()) || (a - b).abs() < 1e-6,
            "{a} vs {b}"
        );
    }
    for (name, scale) in [
        ("group", ScaleRewards::Group),
        ("batch", ScaleRewards::Batch),
        ("none", ScaleRewards::None),
    ] {
        let opts = AdvantageOptions {
            scale,
            std_floor: None,
            normalize_batch: false,
        };
        let got = group_advantages(&rewards, 4, &opts).unwrap().advantages;
        let want = f32s(&c["advantages"][name]);
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!((a - b).abs() < 1e-5, "{name} [{i}]: {a} vs TRL {b}");
        }
    }
}

#[test]
fn normalize_then_sum_advantages_equal_trl() {
    let c = json("cases.json");
    let per_func: Vec<f32> = c["rewards_per_func"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(f32s)
        .collect();
    let got = decoupled_advantages(&per_func, &f32s(&c["reward_weights"]), 4)
        .unwrap()
        .advantages;
    let want = f32s(&c["advantages_normalize_then_sum"]);
    assert_eq!(got.len(), want.len());
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        assert!((a - b).abs() < 1e-5, "[{i}]: {a} vs TRL {b}");
    }
}

#[test]
fn loss_and_every_gradient_equal_trl() {
    let c = json("cases.json");
    let m = grpo::weights::load_model(
        &ModelSource::HfDir(dir().join("model")),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let grads_want =
        candle_core::safetensors::load(dir().join("grads.safetensors"), &Device::Cpu).unwrap();
    let prompts = ids(&c["prompts"]);
    let comps = ids(&c["completions"]);
    let lc = c["max_completion_length"].as_u64().unwrap() as usize;
    let adv = Tensor::new(f32s(&c["advantages"]["group"]), &Device::Cpu).unwrap();
    let p_of: Vec<&[u32]> = (0..comps.len())
        .map(|i| prompts[i / 4].as_slice())
        .collect();
    let c_of: Vec<&[u32]> = comps.iter().map(|x| x.as_slice()).collect();
    let cases = c["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 34);
    for (ci, case) in cases.iter().enumerate() {
        let name = case["name"].as_str().unwrap();
        // Both layouts are pinned to TRL: groups packed behind one prompt, and one row each.
        let packing = if ci % 2 == 0 {
            Packing::SharedPrompt
        } else {
            Packing::PerRow
        };
        let vars: HashMap<String, Var> = m
            .tensors
            .iter()
            .map(|(k, t)| (k.clone(), Var::from_tensor(t).unwrap()))
            .collect();
        let mut model = CausalLm::from_tensors(
            &m.config,
            vars.iter()
                .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
                .collect(),
            DType::F32,
            &Device::Cpu,
        )
        .unwrap();
        // The trainer's projection-gradient sink, pinned too (every other pair of cases, so that
        // it meets both packings).
        let list: Vec<Var> = vars.values().cloned().collect();
        let sink = GradSink::new(&list);
        if ci % 4 >= 2 {
            assert!(model.attach_grad_sink(&sink).unwrap() > 0);
        }
        let t = case["temperature"].as_f64().unwrap();
        let (logps, _) = completion_logprobs(
            &model,
            &p_of,
            &c_of,
            0,
            t,
            Mode::Train,
            Entropy::Skip,
            packing,
        )
        .unwrap();
        assert_eq!(logps.dims(), &[8, lc]);
        let mask = grid(&case["completion_mask"]);
        // Our forward equals transformers' at every completion token that counts. (TRL masks
        // truncated completions out of attention too, so their log-probs differ; they carry no
        // loss either way.)
        let want_lp = grid(&case["logps"]);
        let d = ((logps.detach() - &want_lp).unwrap() * &mask)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(d < 1e-5, "{name}: log-probs differ from TRL's by {d}");
        let old = (!case["old_logps"].is_null()).then(|| grid(&case["old_logps"]));
        let refl = (!case["ref_logps"].is_null()).then(|| grid(&case["ref_logps"]));
        let opts = LossOptions {
            loss_type: match case["loss_type"].as_str().unwrap() {
                "grpo" => LossType::Grpo,
                "bnpo" => LossType::Bnpo,
                "dr_grpo" => LossType::DrGrpo,
                _ => LossType::Dapo,
            },
            importance_sampling_level: if case["importance_sampling_level"] == "sequence" {
                IsLevel::Sequence
            } else {
                IsLevel::Token
            },
            epsilon_low: 0.2,
            epsilon_high: 0.28,
            delta: None,
            beta: case["beta"].as_f64().unwrap(),
            entropy_coef: 0.0,
            use_bias_correction_kl: true, // TRL 1.16's default
        };
        let red = Reduction {
            accumulation_steps: 1,
            max_completion_length: lc,
            dapo_tokens: case["num_items_in_batch"].as_f64().unwrap(),
            micro: None,
        };
        let out = grpo_loss(
            &LossInputs {
                logps: &logps,
                old_logps: old.as_ref(),
                ref_logps: refl.as_ref(),
                advantages: &adv,
                mask: &mask,
                entropies: None,
            },
            &opts,
            &red,
        )
        .unwrap();
        let loss = out.loss.to_scalar::<f32>().unwrap();
        let want = case["loss"].as_f64().unwrap() as f32;
        assert!(
            (loss - want).abs() < 1e-5,
            "{name}: loss {loss} vs TRL {want}"
        );
        let g = out.loss.backward().unwrap();
        for (k, v) in &vars {
            let sunk = sink.take(v).unwrap();
            let got = sunk
                .as_ref()
                .or_else(|| g.get(v))
                .unwrap_or_else(|| panic!("{name}: no gradient for {k}"));
            let want = &grads_want[&format!("{name}/{k}")];
            let d = (got - want)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(
                d < 1e-5,
                "{name}: gradient of {k} differs from TRL's by {d}"
            );
        }
    }
}

#[test]
fn adamw_with_clipping_and_schedules_equal_torch() {
    let a = json("adamw.json");
    let shapes: Vec<Vec<usize>> = a["shapes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            s.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as usize)
                .collect()
        })
        .collect();
    let flat = |v: &Value| -> Vec<f32> {
        fn walk(v: &Value, out: &mut Vec<f32>) {
            match v {
                Value::Array(a) => a.iter().for_each(|x| walk(x, out)),
                x => out.push(x.as_f64().unwrap() as f32),
            }
        }
        let mut out = vec![];
        walk(v, &mut out);
        out
    };
    let vars: Vec<Var> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            Var::from_tensor(
                &Tensor::from_vec(flat(&a["init"][i]), s.as_slice(), &Device::Cpu).unwrap(),
            )
            .unwrap()
        })
        .collect();
    let mut opt = AdamW::new(
        vars.iter()
            .enumerate()
            .map(|(i, v)| (format!("p{i}"), v.clone()))
            .collect(),
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        },
    )
    .unwrap();
    for (k, step) in a["steps"].as_array().unwrap().iter().enumerate() {
        let grads: Vec<Tensor> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| {
                Tensor::from_vec(flat(&step["grads"][i]), s.as_slice(), &Device::Cpu).unwrap()
            })
            .collect();
        let (norm, scale) = clip_factor(&grads, 0.5).unwrap();
        assert!(
            (norm - step["total_norm"].as_f64().unwrap()).abs() < 1e-5,
            "step {k}: norm"
        );
        opt.step(&grads, 1e-3, scale).unwrap();
        for (i, v) in vars.iter().enumerate() {
            let got = v.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            for (x, y) in got.iter().zip(flat(&step["params"][i])) {
                assert!((x - y).abs() < 1e-6, "step {k} param {i}: {x} vs torch {y}");
            }
        }
    }
    let sched = &a["schedules"];
    for (name, kind) in [
        ("constant", LrSchedule::Constant),
        ("constant_with_warmup", LrSchedule::ConstantWithWarmup),
        ("linear", LrSchedule::Linear),
        ("cosine", LrSchedule::Cosine),
    ] {
        for (s, want) in sched["lr"][name].as_array().unwrap().iter().enumerate() {
            let got = 1e-3 * lr_lambda(kind, s as u64, 3, 10);
            assert!(
                (got - want.as_f64().unwrap()).abs() < 1e-12,
                "{name} step {s}: {got} vs {want}"
            );
        }
    }
}
