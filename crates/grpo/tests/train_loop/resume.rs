//! Runs stopped and resumed equal uninterrupted ones exactly (full, LoRA, TRL 1.16's options,
//! bf16), what checkpoints hold (the best one, model only, none).

use super::*;

#[test]
fn resumed_run_equals_uninterrupted_run() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    tiny_model(&model);
    // beta > 0 and two iterations exercise the reference and old log-probs too.
    let extra = "beta = 0.04\nnum_iterations = 2\nsteps_per_generation = 2";

    let full = tmp.path().join("full");
    let out = train(&config(&model, &full, extra), &RunControl::default()).unwrap();
    assert_eq!(out.steps, 4);
    assert!(!out.interrupted);

    let part = tmp.path().join("part");
    let ctl = RunControl {
        max_rounds_this_run: Some(1),
        ..Default::default()
    };
    let first = train(&config(&model, &part, extra), &ctl).unwrap();
    assert!(first.interrupted);
    assert_eq!(first.steps, 2);
    let resumed = train(
        &config(&model, &part, extra),
        &RunControl {
            resume: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(resumed.steps, 4);

    let (a, b) = (
        weights(&full.join("checkpoint-4")),
        weights(&part.join("checkpoint-4")),
    );
    assert_eq!(a.len(), b.len());
    for (k, v) in &a {
        assert_eq!(v, &b[k], "{k} differs after resume");
    }
    // The weights did change during training.
    let base = weights(&model);
    assert!(base.iter().any(|(k, v)| v != &a[k]));
    assert_eq!(metrics(&full), metrics(&part));
    let m = metrics(&full);
    for key in [
        "loss",
        "kl",
        "reward",
        "grad_norm",
        "clip_ratio/region_mean",
        "entropy",
        "eval/accuracy",
    ] {
        assert!(
            m.iter().any(|l| l.get(key).is_some_and(|v| !v.is_null())),
            "metric {key} missing"
        );
    }
    // Checkpoint contents.
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "optimizer.safetensors",
        "trainer_state.json",
        "config.toml",
    ] {
        assert!(full.join("checkpoint-4").join(f).exists(), "{f}");
    }
    assert!(full.join("completions.jsonl").exists());
    // groups.jsonl (seed 003's per-group log), the same rows when resumed (here every group's
    // rewards are equal: the random model never answers right).
    check_groups_log(&full);
    assert_eq!(
        jsonl(&full.join("groups.jsonl")),
        jsonl(&part.join("groups.jsonl"))
    );
    assert!(full.join("eval/step-4.jsonl").exists());
    assert!(std::fs::read_dir(full.join("tb")).unwrap().count() >= 1);
}

/// LoRA: only adapters train (PEFT files in the checkpoint, no full weights), the reference is
/// the base with adapters off (the KL grows from 0), dropout is seeded, and a resumed run equals
/// the uninterrupted one exactly.
#[test]
fn lora_run_trains_adapters_and_resumes_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    tiny_model(&model);
    let extra = "beta = 0.04\nnum_iterations = 2\nsteps_per_generation = 2\n\
                 lora.r = 4\nlora.alpha = 8\nlora.dropout = 0.1\n\
                 lora.target_modules = [\"q_proj\", \"v_proj\", \"down_proj\"]";
    let full = tmp.path().join("full");
    let out = train(&config(&model, &full, extra), &RunControl::default()).unwrap();
    assert_eq!(out.steps, 4);
    let part = tmp.path().join("part");
    let ctl = RunControl {
        max_rounds_this_run: Some(1),
        ..Default::default()
    };
    assert!(
        train(&config(&model, &part, extra), &ctl)
            .unwrap()
            .interrupted
    );
    let resume = RunControl {
        resume: true,
        ..Default::default()
    };
    assert_eq!(
        train(&config(&model, &part, extra), &resume).unwrap().steps,
        4
    );

    let ck = full.join("checkpoint-4");
    for f in [
        "adapter_config.json",
        "adapter_model.safetensors",
        "optimizer.safetensors",
        "tokenizer.json",
    ] {
        assert!(ck.join(f).exists(), "{f}");
    }
    assert!(
        !ck.join("model.safetensors").exists(),
        "a LoRA checkpoint holds adapters only"
    );
    let a = adapter_tensors(&ck);
    assert_eq!(
        a,
        adapter_tensors(&part.join("checkpoint-4")),
        "resume changed the adapters"
    );
    assert_eq!(metrics(&full), metrics(&part));
    // 2 layers x (q, v, down) x (A, B); every B moved away from its zero start.
    assert_eq!(a.len(), 12);
    for (k, v) in &a {
        if k.ends_with("lora_B.weight") {
            assert!(v.iter().any(|x| *x != 0.0), "{k} did not train");
        }
    }
    let kl: Vec<f64> = metrics(&full)
        .iter()
        .filter_map(|l| l.get("kl").and_then(|v| v.as_f64()))
        .collect();
    assert_eq!(kl[0], 0.0, "the first step's policy is the base: KL 0");
    assert!(kl.iter().any(|&k| k > 0.0), "{kl:?}");
    // The checkpoint samples and exports like any model.
    let (m, _) = grpo::export::load_for_inference(
        Some(&ck.display().to_string()),
        Some(&model.display().to_string()),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    assert_eq!(m.config().num_layers, 2);
}

/// `metric_for_best_model`: the best checkpoint is recorded in the trainer state, survives
/// `save_total_limit`, and is what a run directory stands for in `grpo export` / `eval`.
#[test]
fn the_best_checkpoint_is_kept_and_named() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    tiny_model(&model);
    let out = tmp.path().join("run");
    // A lower completion length is "better" here: a metric that changes from step to step.
    let extra = "save_total_limit = 1\nmetric_for_best_model = \"completions/mean_length\"\n\
                 greater_is_better = false\nload_best_model_at_end = true";
    let cfg = config_with(&model, &out, extra, &["--save_steps=1", "--eval_steps=1"]);
    let o = train(&cfg, &RunControl::default()).unwrap();
    let lens: Vec<f64> = metrics(&out)
        .iter()
        .filter_map(|m| m["completions/mean_length"].as_f64())
        .collect();
    assert_eq!(lens.len(), 4);
    let best_i = (0..4)
        .min_by(|&a, &b| lens[a].partial_cmp(&lens[b]).unwrap().then(a.cmp(&b)))
        .unwrap();
    let best = out.join(format!("checkpoint-{}", best_i + 1));
    assert_eq!(o.best_checkpoint.as_deref(), Some(best.as_path()));
    assert!(best.is_dir(), "the best survives save_total_limit = 1");
    assert!(out.join("checkpoint-4").is_dir(), "and so does the newest");
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("checkpoint-4/trainer_state.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(state["best_model_checkpoint"], best.display().to_string());
    assert_eq!(state["best_metric"].as_f64(), Some(lens[best_i]));
    assert_eq!(grpo::checkpoint::resolve_run_dir(&out).unwrap(), best);
}

/// TRL 1.16's newer options through the trainer, from a TRL-style YAML: the vespo loss with the
/// off-policy sequence mask, the high-entropy token mask and adaptive entropy control, TRL's
/// reward_funcs (accuracy on the `solution` column), the seeds' gen_batch_size, keys set to null;
/// the controller's state resumes exactly.
#[test]
fn trl_1_16_options_train_and_resume_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    tiny_model(&model);
    let data = tmp.path().join("train.jsonl");
    let rows: Vec<String> = (0..8)
        .map(|i| format!("{{\"prompt\": \"{i} + 1 =\", \"solution\": \"{}\"}}", i + 1))
        .collect();
    std::fs::write(&data, rows.join("\n")).unwrap();
    let yaml = |out: &Path| {
        format!(
            "model_name_or_path: {}\ndataset_name: {}\noutput_dir: {}\nloss_type: vespo\n\
             num_iterations: 2\nper_device_train_batch_size: 4\n\
             num_generations: 4\nmax_completion_length: 6\nlearning_rate: 1.0e-3\nmax_steps: 4\n\
             save_steps: 2\nbeta: 0.04\ntop_entropy_quantile: 0.5\noff_policy_mask_threshold: 0.0\n\
             use_adaptive_entropy: true\nentropy_coef: 0.01\nentropy_target: 100.0\n\
             entropy_coef_delta: 0.005\ngen_batch_size: 4\nreport_to: none\n\
             reward_funcs: [accuracy_reward, think_format_reward, get_soft_overlong_punishment]\n\
             rewards: [{{kind: format, name: has_s, pattern: s}}]\n\
             eval_steps: null\ndeepspeed: null\nhub_token: null\noptim: adamw_torch_fused\n\
             seed: 7\nthreads: 2\n",
            model.display(),
            data.display(),
            out.display()
        )
    };
    let load =
        |out: &Path| TrainConfig::from_str(&yaml(out), Format::Yaml, "trl.yaml", &[]).unwrap();
    let full = tmp.path().join("full");
    let cfg = load(&full);
    assert_eq!(cfg.data.answer_field, "solution");
    assert_eq!(cfg.generation.sampling_batch_size, Some(4));
    let names: Vec<&str> = cfg.rewards.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "accuracy_reward",
            "think_format_reward",
            "soft_overlong_punishment_reward",
            "has_s"
        ]
    );
    assert_eq!(train(&cfg, &RunControl::default()).unwrap().steps, 4);
    let m = metrics(&full);
    let coefs: Vec<f64> = m
        .iter()
        .filter_map(|r| r["entropy_coef"].as_f64())
        .collect();
    // Two optimizer steps per round; entropy is far below the target: +0.005 per step.
    assert_eq!(coefs.len(), 2, "{m:?}");
    assert!(
        (coefs[0] - 0.02).abs() < 1e-9 && (coefs[1] - 0.03).abs() < 1e-9,
        "{coefs:?}"
    );
    assert!(
        m[0].get("rewards/accuracy_reward/mean").is_some(),
        "{:?}",
        m[0]
    );
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(full.join("checkpoint-2/trainer_state.json")).unwrap(),
    )
    .unwrap();
    assert!(state.to_string().contains("adaptive_entropy"), "{state}");

    // Killed after the first round, resumed: the same weights and metrics.
    let part = tmp.path().join("part");
    let ctl = RunControl {
        max_rounds_this_run: Some(1),
        ..Default::default()
    };
    assert_eq!(train(&load(&part), &ctl).unwrap().steps, 2);
    let resume = RunControl {
        resume: true,
        ..Default::default()
    };
    assert_eq!(train(&load(&part), &resume).unwrap().steps, 4);
    let (a, b) = (
        weights(&full.join("checkpoint-4")),
        weights(&part.join("checkpoint-4")),
    );
    for (k, v) in &a {
        assert_eq!(v, &b[k], "{k} differs after resume");
    }
    assert_eq!(metrics(&full), metrics(&part));
}

/// `dtype = bf16`: mixed-precision training (bf16 sampling, reference and training forward
/// over f32 master parameters) trains, keeps f32 parameters and AdamW moments in its
/// checkpoints, and resumes exactly: on the CPU with AVX-512 grpo's bf16 matmuls
/// (`Compute::CpuMixed`), and on the portable path (the candle ops a GPU runs) in the rerun.
#[test]
fn bf16_mixed_precision_trains_and_resumes_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    tiny_model(&model);
    // Gradient checkpointing recomputes the bf16 blocks (any device and dtype). Rewards with a
    // spread (letters in the random model's text) give the update a signal.
    let extra = "beta = 0.04\ndtype = \"bf16\"\ngradient_checkpointing = true\n\
                 [[rewards]]\nkind = \"format\"\npattern = \"e\"\nname = \"has_e\"\n\
                 [[rewards]]\nkind = \"format\"\npattern = \"a\"\nname = \"has_a\"\n\
                 [[rewards]]\nkind = \"format\"\npattern = \"o\"\nname = \"has_o\"\n";
    let full = tmp.path().join("full");
    let out = train(&config(&model, &full, extra), &RunControl::default()).unwrap();
    assert_eq!(out.steps, 4);
    let part = tmp.path().join("part");
    let ctl = RunControl {
        max_rounds_this_run: Some(2),
        ..Default::default()
    };
    train(&config(&model, &part, extra), &ctl).unwrap();
    let resume = RunControl {
        resume: true,
        ..Default::default()
    };
    train(&config(&model, &part, extra), &resume).unwrap();
    let (a, b) = (
        weights(&full.join("checkpoint-4")),
        weights(&part.join("checkpoint-4")),
    );
    assert_eq!(a, b, "bf16 run after resume");
    assert_eq!(metrics(&full), metrics(&part));
    let base = weights(&model);
    assert!(base.iter().any(|(k, v)| v != &a[k]), "weights changed");
    for dir in [full.join("checkpoint-4")] {
        for f in ["model.safetensors", "optimizer.safetensors"] {
            let st =
                candle_core::safetensors::load(dir.join(f), &candle_core::Device::Cpu).unwrap();
            assert!(
                st.values().all(|t| t.dtype() == candle_core::DType::F32),
                "{f} is f32"
            );
        }
    }
    for l in metrics(&full).iter().filter(|l| l.get("loss").is_some()) {
        for k in ["loss", "kl", "grad_norm"] {
            let v = l[k].as_f64().unwrap();
            assert!(v.is_finite(), "{k} = {v}");
        }
    }
}

/// TRL's `save_only_model` writes checkpoints without the AdamW state, which `--resume` then
/// refuses with the reason; `save_strategy = "no"` writes none.
#[test]
fn save_only_model_and_save_strategy_no() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    tiny_model(&model);
    let out = tmp.path().join("only-model");
    let cfg = config(&model, &out, "save_only_model = true");
    train(&cfg, &RunControl::default()).unwrap();
    let ck = out.join("checkpoint-4");
    assert!(ck.join("model.safetensors").is_file());
    assert!(ck.join("trainer_state.json").is_file());
    assert!(!ck.join("optimizer.safetensors").exists());
    let e = train(
        &config_with(&model, &out, "save_only_model = true", &["--max_steps=6"]),
        &RunControl {
            resume: true,
            ..Default::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("save_only_model") && e.contains("checkpoint-4"),
        "{e}"
    );

    let out = tmp.path().join("no-save");
    let cfg = config(&model, &out, "save_strategy = \"no\"");
    let outcome = train(&cfg, &RunControl::default()).unwrap();
    assert_eq!(outcome.steps, 4);
    assert!(outcome.last_checkpoint.is_none());
    let dirs: Vec<_> = std::fs::read_dir(&out)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("checkpoint-"))
        .collect();
    assert!(dirs.is_empty(), "{dirs:?}");
}

/// The bf16 tests again on the portable path (`GRPO_KERNELS=portable`: candle's bf16 ops, the
/// path a GPU runs), which CPU mixed precision replaces in this process.
#[test]
fn bf16_tests_pass_on_the_portable_path() {
    rerun::rerun_only(
        &[("GRPO_KERNELS", "portable")],
        &[
            "gradient_checkpointing_leaves_the_update_unchanged",
            "bf16_mixed_precision_trains_and_resumes_exactly",
        ],
        2,
    );
}
