//! Options that train: every loss type and KL mode, forward chunks, QLoRA, gradient
//! checkpointing, a TRL YAML, the seeds' configs, the temperature warm-up, `dtype = auto`, and no
//! written file holding a secret.

use super::*;

#[test]
fn every_loss_type_and_kl_mode_trains() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    tiny_model(&model);
    for (i, extra) in [
        "loss_type = \"grpo\"\nscale_rewards = \"batch\"",
        "loss_type = \"bnpo\"\nimportance_sampling_level = \"sequence\"\nnum_iterations = 2",
        "loss_type = \"dr_grpo\"\nscale_rewards = \"none\"\nmask_truncated_completions = true",
        "kl_coef = 0.05\nkl_target = 0.1\nentropy_coef = 0.01\ndrop_zero_std_groups = true",
        "sync_ref_model = true\nref_model_sync_steps = 1\nbeta = 0.1\nreward_std_floor = 0.1\nnormalize_advantages_batch = true",
        // GDPO aggregation over rule rewards, and a composite whose coherence term needs the
        // reference model although no KL is configured.
        "multi_objective_aggregation = \"normalize_then_sum\"\n\
         [[rewards]]\nkind = \"answer_match\"\nextract = \"auto\"\n\
         [[rewards]]\nkind = \"composite\"\ncoherence = 0.1\n\
         [rewards.diversity]\nkind = \"diversity\"\n\
         [[rewards]]\nkind = \"length\"\ncache_length = 3\n\
         [[rewards]]\nkind = \"repetition\"\nn = 2",
    ]
    .iter()
    .enumerate()
    {
        let out_dir = tmp.path().join(format!("r{i}"));
        let mut cfg = config(&model, &out_dir, extra);
        cfg.run.max_steps = Some(2);
        cfg.logging.eval_steps = 0;
        let out = train(&cfg, &RunControl::default()).unwrap_or_else(|e| panic!("{extra}: {e}"));
        assert_eq!(out.steps, 2, "{extra}");
        let m = metrics(&out_dir);
        assert!(
            m.iter().all(|l| l.get("loss").is_none_or(|v| v.as_f64().is_some_and(f64::is_finite))),
            "{extra}: {m:?}"
        );
        if extra.contains("composite") {
            // The coherence term was computed: the composite is never missing.
            let train_lines: Vec<_> = m.iter().filter(|l| l.get("loss").is_some()).collect();
            assert!(!train_lines.is_empty());
            for l in train_lines {
                assert_eq!(l["rewards/composite/missing"].as_f64(), Some(0.0), "{l}");
            }
        }
    }
}

#[test]
fn forward_chunks_leave_the_update_unchanged() {
    // Splitting micro-batches into small forward chunks (here: a group split between chunks too)
    // must give the same loss, statistics and gradient as one forward per micro-batch.
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    tiny_model(&model);
    for (i, extra) in [
        "loss_type = \"grpo\"\nbeta = 0.04\nentropy_coef = 0.01",
        "loss_type = \"bnpo\"\nimportance_sampling_level = \"sequence\"",
        "loss_type = \"dr_grpo\"",
        "loss_type = \"dapo\"\nbeta = 0.04",
    ]
    .iter()
    .enumerate()
    {
        let run = |chunk: usize| {
            let out_dir = tmp.path().join(format!("c{i}-{chunk}"));
            let mut cfg = config(&model, &out_dir, extra);
            cfg.run.max_steps = Some(1);
            cfg.logging.eval_steps = 0;
            cfg.update.forward_chunk_tokens = Some(chunk);
            train(&cfg, &RunControl::default()).unwrap_or_else(|e| panic!("{extra}: {e}"));
            metrics(&out_dir)
                .into_iter()
                .find(|l| l.get("loss").is_some())
                .unwrap()
        };
        let (whole, chunked) = (run(100_000), run(12));
        for key in ["loss", "grad_norm", "kl", "entropy", "mean_log_prob"] {
            let (a, b) = (whole[key].as_f64(), chunked[key].as_f64());
            let (Some(a), Some(b)) = (a, b) else {
                assert_eq!(a, b, "{extra}: {key}");
                continue;
            };
            assert!(
                (a - b).abs() <= 1e-4 * a.abs().max(1e-3),
                "{extra}: {key} {a} (one forward) vs {b} (chunked)"
            );
        }
    }
}

/// QLoRA on the tiny model: the base kept in Q8_0 / Q4_0 / NF4, adapters on every projection
/// train.
#[test]
fn qlora_run_trains() {
    for q in ["q8_0", "q4_0", "nf4"] {
        let steps = two_steps(&format!(
            "beta = 0.04\nlora.r = 4\nlora.target_modules = \"all-linear\"\nbase_quantization = \"{q}\""
        ));
        for l in &steps {
            assert!(l["loss"].as_f64().is_some_and(f64::is_finite), "{q}: {l}");
            assert!(l["grad_norm"].as_f64().is_some_and(|g| g > 0.0), "{q}: {l}");
        }
    }
}

/// Gradient checkpointing recomputes each block in the backward: same losses and gradient
/// norms (to rounding), for full fine-tuning and for LoRA with dropout (the recomputed block
/// draws the mask its forward drew), and off the fused CPU path (bf16: the candle ops a GPU
/// runs, with the chunked attention inside the recomputed block).
///
/// Under CPU mixed precision (bf16 on a CPU with AVX-512, the fused kernels) the bf16 case is
/// left to the portable rerun (`bf16_tests_pass_on_the_portable_path`): checkpointing also
/// turns off packing for decoding, the sampler then sums its products in another order, and
/// rounding the products' inputs to bf16 turns those last-bit differences into other samples.
#[test]
fn gradient_checkpointing_leaves_the_update_unchanged() {
    let mixed = grpo_models::kernels::Compute::resolve(&Device::Cpu, DType::BF16).bf16_matmuls();
    for base in [
        "beta = 0.04",
        "beta = 0.04\nlora.r = 4\nlora.dropout = 0.2\nlora.target_modules = \"all-linear\"",
        "beta = 0.04\ndtype = \"bf16\"",
    ] {
        if mixed && base.contains("bf16") {
            continue;
        }
        let plain = two_steps(base);
        let ckpt = two_steps(&format!("{base}\ngradient_checkpointing = true"));
        for (a, b) in plain.iter().zip(&ckpt) {
            for k in ["loss", "grad_norm", "kl", "reward"] {
                let (x, y) = (a[k].as_f64().unwrap(), b[k].as_f64().unwrap());
                assert!(
                    (x - y).abs() <= 1e-5 * x.abs().max(1e-3),
                    "{base}: {k} {x} vs {y} with checkpointing"
                );
            }
        }
    }
}

/// A `trl grpo --config` YAML, written as TRL's docs write one (script, model and training
/// arguments in one file), trains; the keys grpo cannot honour are listed, not refused.
#[test]
fn a_trl_grpo_yaml_trains() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    tiny_model(&model);
    // A dataset directory laid out as the hub lays one out: data/<split>-*.parquet would do too.
    let ds = tmp.path().join("my-dataset");
    std::fs::create_dir_all(&ds).unwrap();
    let rows: Vec<String> = (0..8)
        .map(|i| {
            format!(
                "{{\"prompt\": \"What is {i} + 1?\", \"answer\": \"{}\"}}",
                i + 1
            )
        })
        .collect();
    std::fs::write(ds.join("train.jsonl"), rows.join("\n")).unwrap();
    std::fs::write(ds.join("test.jsonl"), rows[..3].join("\n")).unwrap();
    let out = tmp.path().join("out");
    let yaml = format!(
        "# Model arguments\nmodel_name_or_path: {}\nmodel_revision: main\ntorch_dtype: bfloat16\n\
         attn_implementation: flash_attention_2\ntrust_remote_code: false\nuse_peft: true\n\
         lora_r: 8\nlora_alpha: 16\nlora_target_modules: all-linear\nload_in_4bit: false\n\
         # Script arguments\ndataset_name: {}\ndataset_train_split: train\ndataset_test_split: test\n\
         # Training arguments\noutput_dir: {}\nlearning_rate: 1.0e-05\nlr_scheduler_type: cosine\n\
         warmup_ratio: 0.1\nper_device_train_batch_size: 4\nnum_generations: 4\n\
         max_completion_length: 6\nmax_steps: 2\nlogging_steps: 1\nsave_strategy: \"no\"\n\
         save_steps: 2\nbf16: true\ngradient_checkpointing: true\nreport_to: none\nseed: 42\n\
         resume_from_checkpoint: false\nuse_vllm: false\n",
        model.display(),
        ds.display(),
        out.display()
    );
    let cfg = TrainConfig::from_str(&yaml, Format::Yaml, "trl.yaml", &[]).unwrap();
    assert_eq!(
        cfg.data.train_file.as_deref(),
        Some(ds.join("train.jsonl").as_path())
    );
    assert_eq!(
        cfg.data.eval_file.as_deref(),
        Some(ds.join("test.jsonl").as_path())
    );
    assert!(cfg.logging.report_to.is_empty() && !cfg.resume_from_checkpoint);
    // TRL's bf16 = true (and torch_dtype: bfloat16) is dtype = auto on the CPU, not ignored.
    assert_eq!(cfg.run.dtype, grpo::config::DTypeOpt::Auto);
    assert!(!cfg.ignored_keys.iter().any(|i| i == "bf16"));
    for k in ["attn_implementation", "trust_remote_code", "use_vllm"] {
        assert!(
            cfg.ignored_keys.iter().any(|i| i == k),
            "{k}: {:?}",
            cfg.ignored_keys
        );
        assert!(!grpo::config::ignore_reason(k).is_empty());
    }
    let o = train(&cfg, &RunControl::default()).unwrap();
    assert_eq!(o.steps, 2);
    // TRL's save_strategy "no" is honoured (issue 33; it was ignored and a checkpoint written).
    assert!(!out.join("checkpoint-2").exists());
    assert!(o.last_checkpoint.is_none());

    // What grpo cannot do is a clear error naming the key.
    for (from, to, want) in [
        (
            "model_revision: main",
            "model_revision: v1.0",
            "download the revision",
        ),
        ("use_peft: true", "use_peft: true\nuse_dora: true", "DoRA"),
        (
            "resume_from_checkpoint: false",
            "resume_from_checkpoint: some/dir",
            "--resume",
        ),
    ] {
        let e = TrainConfig::from_str(&yaml.replace(from, to), Format::Yaml, "t", &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains(want), "{e}");
    }
    let e = TrainConfig::from_str("dataset_name: trl-lib/tldr\n", Format::Yaml, "t", &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("dataset_name") && e.contains("download"), "{e}");
    let c = TrainConfig::from_str(
        &yaml.replace("load_in_4bit: false", "load_in_4bit: true"),
        Format::Yaml,
        "t",
        &[],
    )
    .unwrap();
    assert!(c.ignored_keys.iter().any(|k| k == "load_in_4bit"));
    assert_eq!(
        c.lora.base_quantization,
        Some(grpo_models::models::QuantType::Nf4)
    );
}

/// A planted secret (a reward's header and env values) appears in no file a run writes: config.toml,
/// the checkpoint, metrics, completions, the logs (issue 34).
#[test]
fn no_file_a_run_writes_holds_a_planted_secret() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    tiny_model(&model);
    let out = tmp.path().join("out");
    let text = format!(
        "model = {:?}\noutput_dir = {:?}\nnum_generations = 4\nper_device_train_batch_size = 4\n\
         max_completion_length = 4\nmax_steps = 1\nsave_steps = 1\neval_steps = 0\n\
         report_to = [\"tensorboard\"]\n[task]\ntrain_size = 8\neval_size = 2\n\
         [[rewards]]\nkind = \"format\"\nname = \"has_s\"\npattern = \"s\"\n\
         [[rewards]]\nkind = \"http\"\nname = \"judge\"\nurl = \"{}/score\"\n\
         headers = {{ Authorization = \"Bearer planted-secret-1\" }}\n\
         [[rewards]]\nkind = \"command\"\nname = \"cmd\"\ncommand = [\"sh\", \"-c\", \"cat > /dev/null\"]\n\
         timeout_s = 1\nenv = {{ API_KEY = \"planted-secret-2\" }}\n",
        model.display().to_string(),
        out.display().to_string(),
        unscoring_endpoint(),
    );
    let cfg = TrainConfig::from_str(&text, Format::Toml, "t", &[]).unwrap();
    assert_eq!(train(&cfg, &RunControl::default()).unwrap().steps, 1);
    // The same run against an endpoint nobody listens on fails before training (issue 34),
    // naming the reward and the address.
    let dead = text.replace(&unscoring_endpoint(), "http://127.0.0.1:9");
    let dead_out = tmp.path().join("dead");
    let dead = dead.replace(
        &format!("{:?}", out.display().to_string()),
        &format!("{:?}", dead_out.display().to_string()),
    );
    let cfg = TrainConfig::from_str(&dead, Format::Toml, "t", &[]).unwrap();
    let e = train(&cfg, &RunControl::default()).unwrap_err().to_string();
    assert!(
        e.contains("`judge`")
            && e.contains("http://127.0.0.1:9/score")
            && e.contains("does not answer"),
        "{e}"
    );
    assert!(!dead_out.join("metrics.jsonl").exists());
    let mut files = vec![];
    let mut dirs = vec![out.clone()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            match e.path().is_dir() {
                true => dirs.push(e.path()),
                false => files.push(e.path()),
            }
        }
    }
    assert!(
        files
            .iter()
            .any(|f| f.ends_with("checkpoint-1/config.toml")),
        "{files:?}"
    );
    for f in &files {
        let bytes = std::fs::read(f).unwrap();
        let text = String::from_utf8_lossy(&bytes);
        assert!(
            !text.contains("planted-secret"),
            "{} holds a secret",
            f.display()
        );
    }
}

/// Each example config of a seed's scenario (examples/configs/) trains on a tiny model, with the
/// fixture BERT classifier standing in for the toxicity classifier.
#[test]
fn the_seed_example_configs_train() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    tiny_model(&model);
    let prompts = tmp.path().join("toxic_prompts.jsonl");
    std::fs::write(
        &prompts,
        "{\"prompt\": \"You are such a\"}\n{\"prompt\": \"I really think that\"}\n",
    )
    .unwrap();
    let classifier = fixtures().join("rewards/bert");
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/configs");
    for name in ["toxicity", "composite", "math_qlora"] {
        let text = std::fs::read_to_string(examples.join(format!("{name}.toml")))
            .unwrap()
            .replace(
                "\"toxicity-classifier/\"",
                &format!("{:?}", classifier.display().to_string()),
            )
            .replace(
                "\"toxic_prompts.jsonl\"",
                &format!("{:?}", prompts.display().to_string()),
            );
        let out = tmp.path().join(name);
        let overrides: Vec<String> = [
            format!("--model={}", model.display()),
            format!("--output_dir={}", out.display()),
            "--max_steps=1".into(),
            "--per_device_train_batch_size=8".into(),
            "--num_generations=8".into(),
            "--max_completion_length=6".into(),
            "--eval_num_samples=2".into(),
            "--eval_k=1,2".into(),
            "--report_to=none".into(),
            "--wandb_log=false".into(),
            "--task.train_size=8".into(),
            "--task.eval_size=2".into(),
            "--threads=2".into(),
        ]
        .into();
        let cfg = TrainConfig::from_str(&text, Format::Toml, name, &overrides)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        if name == "toxicity" {
            // What seed 000 turns on (issue 34).
            assert_eq!(cfg.loss.reward_std_floor, Some(0.1));
            assert!(cfg.loss.normalize_advantages_batch);
            assert_eq!(cfg.loss.advantage_epsilon, 1e-8);
            assert_eq!(cfg.loss.entropy_coef, 0.01);
            assert!(cfg.loss.kl_target.is_some() && cfg.loss.kl_coef > 0.0);
        }
        let o = train(&cfg, &RunControl::default()).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(o.steps, 1, "{name}");
        let m = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
        let want = match name {
            "toxicity" => "rewards/toxicity/mean",
            "composite" => "rewards/composite/mean",
            _ => "rewards/correctness/mean",
        };
        assert!(m.contains(want), "{name}: {m}");
    }
}

/// `temperature_warmup_steps`: the rounds sample at temperatures moving linearly from
/// `temperature_warmup_start` to `temperature` (logged as `sampling/temperature`), after
/// `temperature_warmup_hold_steps` at the start, and a warm-up that starts at `temperature` trains
/// exactly as no warm-up does.
#[test]
fn temperature_warmup_moves_the_sampling_temperature() {
    let warm = two_steps(
        "temperature = 1.0\ntemperature_warmup_steps = 2\ntemperature_warmup_start = 0.5",
    );
    let temps: Vec<f64> = warm
        .iter()
        .map(|l| l["sampling/temperature"].as_f64().unwrap())
        .collect();
    assert_eq!(temps, vec![0.5, 0.75]);
    // A hold of one step keeps the first two rounds at the start.
    let held = two_steps(
        "temperature = 1.0\ntemperature_warmup_steps = 2\ntemperature_warmup_start = 0.5\n\
         temperature_warmup_hold_steps = 1",
    );
    let temps: Vec<f64> = held
        .iter()
        .map(|l| l["sampling/temperature"].as_f64().unwrap())
        .collect();
    assert_eq!(temps, vec![0.5, 0.5]);
    let plain = two_steps("temperature = 1.0");
    let flat = two_steps(
        "temperature = 1.0\ntemperature_warmup_steps = 2\ntemperature_warmup_start = 1.0",
    );
    assert!(plain
        .iter()
        .all(|l| l.get("sampling/temperature").is_none()));
    for (a, b) in plain.iter().zip(&flat) {
        let mut b = b.clone();
        b.as_object_mut().unwrap().remove("sampling/temperature");
        assert_eq!(a, &b);
    }
    assert_ne!(
        warm[0]["entropy"], plain[0]["entropy"],
        "a colder round samples and scores under another distribution"
    );
}

/// `dtype = "auto"` trains exactly as the dtype it resolves to: f32 on a CPU without bf16
/// products in grpo's kernels, f32 or bf16 (by the CPU's measured rates) where it has them.
#[test]
fn auto_dtype_trains_as_the_dtype_it_picks() {
    let auto = two_steps("dtype = \"auto\"");
    let f32 = two_steps("dtype = \"f32\"");
    let isa = grpo_models::kernels::Isa::active();
    if isa < grpo_models::kernels::Isa::Avx512Bf16 {
        assert_eq!(
            auto, f32,
            "no bf16 products on this CPU ({isa}): auto is f32"
        );
        return;
    }
    let bf16 = two_steps("dtype = \"bf16\"");
    assert_ne!(f32, bf16, "the two dtypes train differently");
    assert!(auto == f32 || auto == bf16, "auto trains as f32 or as bf16");
}
