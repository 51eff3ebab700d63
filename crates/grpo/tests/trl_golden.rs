//! Golden tests against TRL and torch (fixtures from scripts/make_grpo_fixtures.py, see
//! tests/fixtures/grpo/README.md): advantages, the GRPO loss and the gradient of every model
//! parameter for each loss_type x beta x num_iterations x importance-sampling level (plus a
//! temperature and a mask_truncated_completions case), one AdamW trajectory with clipping, and
//! the LR schedules. The gradients are pinned twice: through the model's forward directly (both
//! packings, with and without the gradient sink), and through the trainer's own update.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor, Var};
use grpo::advantages::ScaleRewards;
use grpo::advantages::{combine_rewards, decoupled_advantages, group_advantages, AdvantageOptions};
use grpo::logprobs::{completion_logprobs, Entropy, Packing};
use grpo::loss::{grpo_loss, AdaptiveEntropy, LossInputs, LossOptions, Reduction, VespoParams};
use grpo::optim::LrSchedule;
use grpo::optim::{clip_factor, lr_lambda, AdamW, AdamWConfig};
use grpo::rollout::{TrainBatch, TrainRow};
use grpo::train::{
    policy_gradients, update_policy, update_round, CausalLmPolicy, Schedule, SingleProcess,
    StepCounter, UpdateOptions,
};
use grpo_models::hub::ModelSource;
use grpo_models::kernels::grad_sink::GradSink;
use grpo_models::kernels::Compute;
use grpo_models::models::{CausalLm, Mode};
use serde_json::Value;

#[path = "support/diff.rs"]
mod diff;
use diff::max_diff as max_abs_diff;
#[path = "support/rerun.rs"]
mod rerun;

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

/// Largest absolute difference between two tensors of one shape.
/// The largest |a - b| over the elements, relative to the largest |b| when that is above 1
/// (gradients of a few units carry f32 summation-order noise of about 1e-5; the tests allow
/// 2e-5: over the 62 cases the noise reaches 1.2e-5 (luspo, whose per-sequence sums make larger
/// gradients), while a wrong term moves some gradient by 1e-3 or more).
fn grad_diff(a: &Tensor, b: &Tensor) -> f32 {
    let scale = b
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    max_abs_diff(a, b) / scale.max(1.0)
}

/// The fixture model's parameters as a full fine-tuning policy (names sorted, as the trainer's).
fn fixture_policy(m: &grpo_models::weights::LoadedModel) -> CausalLmPolicy {
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
            epsilon: grpo::advantages::STD_EPS,
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
    let m = grpo_models::weights::load_model(
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
    assert_eq!(cases.len(), 62);
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
            // The sink is fused CPU code: on the portable kernels nothing attaches.
            let fused = grpo_models::kernels::kernels() == grpo_models::kernels::Kernels::Fused;
            assert_eq!(model.attach_grad_sink(&sink).unwrap() > 0, fused);
        }
        let t = case["temperature"].as_f64().unwrap();
        let (logps, ents) = completion_logprobs(
            &model,
            &p_of,
            &c_of,
            0,
            t,
            Mode::Train,
            entropy_mode(case),
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
        // Relative to the largest |log-prob| (about 11 over this vocabulary): TRL's own runs of
        // the script differ from each other by 1e-5 there.
        let scale = (want_lp.abs().unwrap() * &mask)
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
            .max(1.0);
        assert!(
            d / scale < 2e-6,
            "{name}: log-probs differ from TRL's by {d}"
        );
        let old = (!case["old_logps"].is_null()).then(|| grid(&case["old_logps"]));
        let refl = (!case["ref_logps"].is_null()).then(|| grid(&case["ref_logps"]));
        let opts = loss_options(case);
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
                entropies: ents.as_ref(),
                entropy_threshold: None,
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
            let d = grad_diff(got, &grads_want[&format!("{name}/{k}")]);
            assert!(
                d < 2e-5,
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
        let (norm, scale) = clip_factor(&grads, 0.5, Compute::Portable).unwrap();
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

/// The rows of the fixture's batch as the trainer's `TrainBatch`: 2 prompts x 4 completions, with
/// the case's advantages (`group` scaling), truncation mask and old / reference log-probs.
fn fixture_batch(c: &Value, case: &Value, adv: &[f32]) -> TrainBatch {
    let prompts = ids(&c["prompts"]);
    let comps = ids(&c["completions"]);
    let mask = case["completion_mask"].as_array().unwrap();
    let rows_of = |k: &str| -> Option<Vec<Vec<f32>>> {
        (!case[k].is_null()).then(|| case[k].as_array().unwrap().iter().map(f32s).collect())
    };
    let (old, refl) = (rows_of("old_logps"), rows_of("ref_logps"));
    TrainBatch {
        rows: comps
            .iter()
            .enumerate()
            .map(|(i, comp)| {
                let cut = |v: &Vec<Vec<f32>>| v[i][..comp.len()].to_vec();
                TrainRow {
                    prompt_ids: prompts[i / 4].clone(),
                    completion_ids: comp.clone(),
                    // TRL masks a truncated completion's every token (mask_truncated_completions).
                    active: f32s(&mask[i]).iter().any(|&m| m > 0.0),
                    advantage: adv[i],
                    old_logps: old.as_ref().map(cut),
                    ref_logps: refl.as_ref().map(cut),
                    sampled: None,
                }
            })
            .collect(),
    }
}

/// Entropies with a gradient when the case has an entropy bonus, detached for the entropy mask.
fn entropy_mode(case: &Value) -> Entropy {
    if case["entropy_coef"].as_f64().unwrap_or(0.0) != 0.0 {
        Entropy::WithGrad
    } else if case["top_entropy_quantile"].is_f64() {
        Entropy::Detached
    } else {
        Entropy::Skip
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
        // The script's default; cispo cases give their own (TRL's epsilon_max).
        epsilon_high: case["epsilon_high"].as_f64().unwrap_or(0.28),
        delta: None,
        beta: case["beta"].as_f64().unwrap(),
        entropy_coef: case["entropy_coef"].as_f64().unwrap_or(0.0),
        use_bias_correction_kl: true, // TRL 1.16's default
        sapo_temperature_pos: 1.0,    // TRL 1.16's defaults
        sapo_temperature_neg: 1.05,
        vespo: VespoParams::default(),
        top_entropy_quantile: case["top_entropy_quantile"].as_f64().unwrap_or(1.0),
        off_policy_mask_threshold: case["off_policy_mask_threshold"].as_f64(),
    }
}

/// The trainer's own update ([`policy_gradients`] / [`update_policy`], the code `grpo train`
/// runs: gradient sinks, packed groups, chunked forwards) against TRL's loss and gradients for
/// every case; then one [`update_policy`] step moves the parameters as AdamW (pinned to torch
/// above) moves them with TRL's gradients.
#[test]
fn the_trainers_update_equals_trl() {
    let c = json("cases.json");
    let m = grpo_models::weights::load_model(
        &ModelSource::HfDir(dir().join("model")),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let grads_want =
        candle_core::safetensors::load(dir().join("grads.safetensors"), &Device::Cpu).unwrap();
    let lc = c["max_completion_length"].as_u64().unwrap() as usize;
    let adv = f32s(&c["advantages"]["group"]);
    let policy = || fixture_policy(&m);
    let cases = c["cases"].as_array().unwrap();
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let batch = fixture_batch(&c, case, &adv);
        let opts = UpdateOptions {
            loss: loss_options(case),
            entropy: match entropy_mode(case) {
                Entropy::Skip => Entropy::Detached,
                e => e,
            },
            temperature: case["temperature"].as_f64().unwrap(),
            pad: 0,
            forward_chunk_tokens: 1024,
            max_grad_norm: 1.0,
            gradient_checkpointing: false,
            seed: 0,
            micro_batch: 8,
            accumulation_steps: 1,
            steps_per_generation: 1,
            num_iterations: case["num_iterations"].as_u64().unwrap() as usize,
            max_completion_length: lc,
            max_bad_steps: 3,
        };
        let red = Reduction {
            accumulation_steps: 1,
            max_completion_length: lc,
            dapo_tokens: case["num_items_in_batch"].as_f64().unwrap(),
            micro: None,
        };
        let p = policy();
        let all_rows = 0..batch.rows.len();
        let window = std::slice::from_ref(&all_rows);
        let (grads, st) =
            policy_gradients(&p, &batch, window, &red, &opts, 0, &SingleProcess).unwrap();
        let want = case["loss"].as_f64().unwrap();
        assert!(
            (st.loss - want).abs() < 1e-5,
            "{name}: loss {} vs TRL {want}",
            st.loss
        );
        for (k, g) in p.names.iter().zip(&grads) {
            let d = grad_diff(g, &grads_want[&format!("{name}/{k}")]);
            assert!(
                d < 2e-5,
                "{name}: gradient of {k} differs from TRL's by {d}"
            );
        }

        // One optimizer step through update_policy, beside AdamW fed TRL's gradients.
        let cfg = AdamWConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        };
        let lr = 1e-3;
        let mut opt = AdamW::new(
            p.names
                .iter()
                .cloned()
                .zip(p.vars.iter().cloned())
                .collect(),
            cfg,
        )
        .unwrap();
        let st = update_policy(
            &p,
            &mut opt,
            &batch,
            window,
            &red,
            &opts,
            lr,
            0,
            &SingleProcess,
        )
        .unwrap();
        let q = policy();
        let trl: Vec<Tensor> = q
            .names
            .iter()
            .map(|k| grads_want[&format!("{name}/{k}")].clone())
            .collect();
        let (norm, scale) = clip_factor(&trl, 1.0, Compute::Portable).unwrap();
        assert!(
            st.finite && (st.grad_norm - norm).abs() < 1e-4 * norm.max(1.0),
            "{name}: grad norm {} vs {norm}",
            st.grad_norm
        );
        let mut opt_q = AdamW::new(
            q.names
                .iter()
                .cloned()
                .zip(q.vars.iter().cloned())
                .collect(),
            cfg,
        )
        .unwrap();
        opt_q.step(&trl, lr, scale).unwrap();
        for ((k, a), (b, g)) in p.names.iter().zip(&p.vars).zip(q.vars.iter().zip(&trl)) {
            let (a, b, g) = (
                a.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                b.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                g.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            );
            for ((x, y), g) in a.iter().zip(&b).zip(&g) {
                // Adam's first step is lr x g/|g|: only well-conditioned entries are compared.
                if g.abs() > 1e-4 {
                    let tol = 2.0 * f32::EPSILON * y.abs().max(1.0); // 2 ulp
                    assert!(
                        (x - y).abs() <= tol,
                        "{name}: {k} after the step: {x} vs {y}"
                    );
                }
            }
        }
    }
}

/// TRL's structure of a round: `num_iterations` passes over the batch, each split into optimizer
/// steps of `gradient_accumulation_steps` micro-batches; the run's last step ends the round.
#[test]
fn update_round_walks_passes_and_accumulation_windows() {
    let c = json("cases.json");
    let m = grpo_models::weights::load_model(
        &ModelSource::HfDir(dir().join("model")),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let policy = fixture_policy(&m);
    let case = &c["cases"][2]; // two iterations: old log-probs given
    let batch = fixture_batch(&c, case, &f32s(&c["advantages"]["group"]));
    let opts = UpdateOptions {
        loss: loss_options(case),
        entropy: Entropy::Detached,
        temperature: 1.0,
        pad: 0,
        forward_chunk_tokens: 1024,
        max_grad_norm: 1.0,
        gradient_checkpointing: false,
        seed: 0,
        micro_batch: 2,
        accumulation_steps: 2,
        steps_per_generation: 4,
        num_iterations: 2,
        max_completion_length: 6,
        max_bad_steps: 3,
    };
    let mut opt = AdamW::new(
        policy
            .names
            .iter()
            .cloned()
            .zip(policy.vars.iter().cloned())
            .collect(),
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        },
    )
    .unwrap();
    let schedule = Schedule {
        learning_rate: 1e-3,
        kind: LrSchedule::Linear,
        warmup_steps: 0,
        total_steps: 3,
    };
    let (mut step, mut nonfinite) = (0u64, 0usize);
    let mut seen = vec![];
    let stats = update_round(
        &policy,
        &mut opt,
        &batch,
        &opts,
        &schedule,
        StepCounter {
            step: &mut step,
            consecutive_nonfinite: &mut nonfinite,
            skipped_steps: &mut 0,
            adaptive_entropy: None,
        },
        &SingleProcess,
        &mut |s| seen.push(s),
    )
    .unwrap();
    // 4 micro-batches of 2 -> 2 steps per pass, 2 passes -> 4 steps, cut at total_steps = 3.
    assert_eq!(seen, vec![1, 2, 3]);
    assert_eq!((step, nonfinite, stats.len()), (3, 0, 3));
    // The learning rate follows the schedule, step by step.
    let lrs: Vec<f64> = stats.iter().map(|s| s.lr).collect();
    assert_eq!(lrs, vec![1e-3, 1e-3 * 2.0 / 3.0, 1e-3 / 3.0]);
    assert!(stats.iter().all(|s| s.finite && s.grad_norm > 0.0));
}

/// Adaptive entropy control against TRL's controller: four optimizer steps on the fixed batch,
/// the coefficient applied (0 before the first measurement) and moved after each step.
#[test]
fn adaptive_entropy_control_equals_trl() {
    let c = json("cases.json");
    let a = &c["adaptive_entropy"];
    let m = grpo_models::weights::load_model(
        &ModelSource::HfDir(dir().join("model")),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let model =
        CausalLm::from_tensors(&m.config, m.tensors.clone(), DType::F32, &Device::Cpu).unwrap();
    let prompts = ids(&c["prompts"]);
    let comps = ids(&c["completions"]);
    let p_of: Vec<&[u32]> = (0..comps.len())
        .map(|i| prompts[i / 4].as_slice())
        .collect();
    let c_of: Vec<&[u32]> = comps.iter().map(|x| x.as_slice()).collect();
    let lc = c["max_completion_length"].as_u64().unwrap() as usize;
    let adv = Tensor::new(f32s(&c["advantages"]["group"]), &Device::Cpu).unwrap();
    let (logps, ents) = completion_logprobs(
        &model,
        &p_of,
        &c_of,
        0,
        1.0,
        Mode::Train,
        Entropy::WithGrad,
        Packing::PerRow,
    )
    .unwrap();
    let mask = Tensor::new(
        c_of.iter()
            .map(|x| {
                (0..lc)
                    .map(|t| f32::from(t < x.len()))
                    .collect::<Vec<f32>>()
            })
            .collect::<Vec<_>>(),
        &Device::Cpu,
    )
    .unwrap();
    let mut ae = AdaptiveEntropy {
        coef: a["entropy_coef"].as_f64().unwrap(),
        last_entropy: None,
        min: 0.0,
        max: a["entropy_coef_max"].as_f64().unwrap(),
        delta: a["entropy_coef_delta"].as_f64().unwrap(),
        target: a["entropy_target"].as_f64().unwrap(),
    };
    let mut case = a.clone();
    case["entropy_coef"] = Value::from(0.0);
    for (i, (want_loss, want_coef)) in f32s(&a["losses"])
        .into_iter()
        .zip(f32s(&a["coefs"]))
        .enumerate()
    {
        let opts = LossOptions {
            entropy_coef: ae.apply_coef(),
            ..loss_options(&case)
        };
        let red = Reduction {
            accumulation_steps: 1,
            max_completion_length: lc,
            dapo_tokens: mask.sum_all().unwrap().to_scalar::<f32>().unwrap() as f64,
            micro: None,
        };
        let out = grpo_loss(
            &LossInputs {
                logps: &logps,
                old_logps: None,
                ref_logps: None,
                advantages: &adv,
                mask: &mask,
                entropies: ents.as_ref(),
                entropy_threshold: None,
            },
            &opts,
            &red,
        )
        .unwrap();
        let loss = out.loss.to_scalar::<f32>().unwrap();
        assert!(
            (loss - want_loss).abs() < 1e-5,
            "step {i}: loss {loss} vs TRL {want_loss}"
        );
        ae.update((out.bonus_entropy_sum / out.bonus_tokens) as f64);
        assert!(
            (ae.coef as f32 - want_coef).abs() < 1e-7,
            "step {i}: coef {} vs TRL {want_coef}",
            ae.coef
        );
    }
    let last = a["last_entropy"].as_f64().unwrap();
    assert!((ae.last_entropy.unwrap() - last).abs() < 1e-4 * last);
}

/// This file's tests again, in a child process with ("GRPO_KERNELS", "portable").
#[test]
fn every_golden_test_passes_on_the_portable_kernels() {
    rerun::rerun_with(&[("GRPO_KERNELS", "portable")], 3);
}
