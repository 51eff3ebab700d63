//! The config's tests of TRL's keys: TRL's defaults and YAML, its generation and template
//! kwargs, the seeds' names, and the defaults a TRL config relies on.

use super::*;

#[test]
fn defaults_follow_trl() {
    let c = load("", Format::Toml, &[]).unwrap();
    assert_eq!(c.generation.num_generations, 8);
    assert_eq!(c.generation.max_completion_length, 256);
    assert_eq!(c.update.learning_rate, 1e-6);
    assert_eq!(c.loss.beta, 0.0);
    assert_eq!(c.loss.kl(), KlMode::None);
    assert_eq!(c.loss.epsilon, 0.2);
    assert_eq!(c.loss.options().epsilon_high, 0.2);
    assert_eq!(c.loss.loss_type, LossType::Dapo);
    assert_eq!(c.loss.scale_rewards, ScaleRewards::Group);
    assert_eq!(c.update.lr_scheduler_type, LrSchedule::Linear);
    assert_eq!(c.update.per_device_train_batch_size, 8);
    assert_eq!(c.generation_batch_size, 8);
    assert_eq!(c.prompts_per_step(), 1);
    assert_eq!(c.data.max_prompt_length, Some(512));
    assert_eq!(c.update.max_grad_norm, 1.0);
}

#[test]
fn trl_yaml_loads_and_ignores_what_does_not_apply() {
    let y = "learning_rate: 1.0e-06\nbf16: true\nreport_to: none\ngradient_checkpointing: true\n\
             num_generations: 4\nper_device_train_batch_size: 16\nloss_type: dr_grpo\nscale_rewards: false\n\
             use_vllm: false\nmax_completion_length: 128\n";
    let c = load(y, Format::Yaml, &[]).unwrap();
    assert_eq!(c.loss.loss_type, LossType::DrGrpo);
    assert_eq!(c.loss.scale_rewards, ScaleRewards::None);
    // TRL's bf16 = true is dtype = auto on the CPU (bf16 where its bf16 products are faster),
    // bf16 on a GPU.
    assert_eq!(c.run.dtype, DTypeOpt::Auto);
    assert_eq!(c.prompts_per_step(), 4);
    assert_eq!(c.ignored_keys, vec!["use_vllm"]);
    let g = load(y, Format::Yaml, &["--device=cuda"]).unwrap();
    assert_eq!(g.run.dtype, DTypeOpt::Bf16);
    assert_eq!(g.ignored_keys, vec!["use_vllm"]);
    // The same for the model arguments' torch_dtype.
    let t = load("torch_dtype: bfloat16\n", Format::Yaml, &[]).unwrap();
    assert_eq!((t.run.dtype, t.ignored_keys.len()), (DTypeOpt::Auto, 0));
    let t = load(
        "torch_dtype: bfloat16\n",
        Format::Yaml,
        &["--device=cuda:1"],
    )
    .unwrap();
    assert_eq!((t.run.dtype, t.ignored_keys.len()), (DTypeOpt::Bf16, 0));
    let t = load("torch_dtype: float32\n", Format::Yaml, &[]).unwrap();
    assert_eq!((t.run.dtype, t.ignored_keys.len()), (DTypeOpt::F32, 0));
    assert!(c.update.gradient_checkpointing, "a real key now");
    assert!(c.logging.report_to.is_empty());
    // TRL's PEFT switches map onto lora.*.
    let p = "use_peft: true
lora_alpha: 64
lora_target_modules: [q_proj, k_proj]
";
    let c = load(p, Format::Yaml, &[]).unwrap();
    let l = c.lora.adapters().unwrap();
    assert_eq!((l.r, l.alpha), (16, 64.0));
    assert_eq!(l.target_modules, vec!["q_proj", "k_proj"]);
    let c = load(
        "",
        Format::Toml,
        &["--lora.r=8", "--lora.target_modules=q_proj,v_proj"],
    )
    .unwrap();
    let l = c.lora.adapters().unwrap();
    assert_eq!((l.r, l.alpha, l.target_modules.len()), (8, 16.0, 2));
    assert!(load("", Format::Toml, &[])
        .unwrap()
        .lora
        .adapters()
        .is_none());
    // QLoRA without adapters, and LoRA with a synced reference, are refused naming the key.
    for (o, key) in [
        (&["--base_quantization=q4_0"][..], "base_quantization"),
        (
            &["--lora.r=4", "--sync_ref_model=true"][..],
            "sync_ref_model",
        ),
        (&["--lora.r=4", "--lora.dropout=1.5"][..], "lora.dropout"),
        (
            &["--lora.r=4", "--base_quantization=q3_k"][..],
            "base_quantization",
        ),
    ] {
        let e = load("", Format::Toml, o).unwrap_err().to_string();
        assert!(e.contains(key), "{o:?}: {e}");
    }
}

#[test]
fn ignored_trl_keys_are_not_keys() {
    for k in ignored_trl_keys() {
        assert!(
            !KEYS.iter().any(|d| d.key == k),
            "{k} is a key and in IGNORED"
        );
    }
    for k in ["report_to", "gradient_checkpointing"] {
        assert!(
            KEYS.iter().any(|d| d.key == k) && !ignored_trl_keys().contains(&k),
            "{k}"
        );
    }
    let c = load(
        "report_to = [\"jsonl\"]\ngradient_checkpointing = true\nfp16 = false",
        Format::Toml,
        &[],
    )
    .unwrap();
    assert_eq!(c.ignored_keys, vec!["fp16"]);
    assert!(c.update.gradient_checkpointing && c.logging.report_to.is_empty());
}

#[test]
fn trl_generation_and_template_kwargs_map_onto_grpo() {
    let y = "generation_kwargs:\n  temperature: 0.7\n  top_k: 20\n  max_new_tokens: 64\n  \
             do_sample: true\nchat_template_kwargs:\n  enable_thinking: false\n\
             num_generations_eval: 6\n";
    let c = load(y, Format::Yaml, &[]).unwrap();
    assert_eq!(
        (
            c.generation.temperature,
            c.generation.top_k,
            c.generation.max_completion_length
        ),
        (0.7, 20, 64)
    );
    assert_eq!(c.logging.eval_num_samples, 6);
    assert_eq!(
        c.chat_template_kwargs["enable_thinking"],
        Value::Bool(false)
    );
    // Into config.toml and back.
    let back = TrainConfig::from_str(&c.to_toml(), Format::Toml, "t", &[]).unwrap();
    assert_eq!(back.chat_template_kwargs, c.chat_template_kwargs);
    let e = load("generation_kwargs:\n  num_beams: 4\n", Format::Yaml, &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("generation_kwargs.num_beams"), "{e}");
}

#[test]
fn the_seeds_ppo_era_names_work() {
    for k in ["cliprange", "clip_eps", "clip_range"] {
        let c = load(&format!("{k} = 0.1\n"), Format::Toml, &[]).unwrap();
        assert_eq!(c.loss.epsilon, 0.1, "{k}");
    }
    let c = load(
        "save_freq = 5\ninit_kl_coef = 0.05\ntarget_kl = 6.0\nhorizon = 5000\n",
        Format::Toml,
        &[],
    )
    .unwrap();
    assert_eq!(c.logging.save_steps, 5);
    let KlMode::Reward { coef, adaptive } = c.loss.kl() else {
        panic!("{:?}", c.loss.kl())
    };
    assert_eq!(coef, 0.05);
    let a = adaptive.unwrap();
    assert_eq!((a.target, a.horizon), (6.0, 5000.0));
    // TRL PPOConfig's adap_kl_ctrl: on with its default target, or off (a fixed coef).
    let c = load(
        "init_kl_coef = 0.2\nadap_kl_ctrl = true\n",
        Format::Toml,
        &[],
    )
    .unwrap();
    assert!(matches!(c.loss.kl(), KlMode::Reward { adaptive: Some(a), .. } if a.target == 6.0));
    let c = load(
        "init_kl_coef = 0.2\nadap_kl_ctrl = false\ntarget_kl = 3.0\ngen_batch_size = 8\n",
        Format::Toml,
        &[],
    )
    .unwrap();
    assert!(matches!(c.loss.kl(), KlMode::Reward { adaptive: None, coef } if coef == 0.2));
    assert_eq!(c.generation.sampling_batch_size, Some(8));
}

#[test]
fn the_fill_in_seeds_names_work() {
    let c = load(
        "policy = \"fill_in\"\ngenerator_checkpoint = \"gen\"\njudge_checkpoint = \"judge\"\n\
         group_size = 16\nkl_beta = 0.2\nout_dir = \"out-grpo\"\nsave_interval = 7\n\
         eval_interval = 7\nlearning_rate = 5e-6\nper_device_train_batch_size = 32\n",
        Format::Toml,
        &[],
    )
    .unwrap();
    assert_eq!(c.run.model.as_deref(), Some("gen"));
    assert_eq!(c.run.judge.as_deref(), Some(Path::new("judge")));
    assert_eq!((c.generation.num_generations, c.loss.beta), (16, 0.2));
    assert_eq!(c.run.output_dir, PathBuf::from("out-grpo"));
    assert_eq!((c.logging.save_steps, c.logging.eval_steps), (7, 7));
    // On the command line too, as the seed's README runs it.
    let c = TrainConfig::load(
        None,
        &[
            "--policy=fill_in".into(),
            "--group_size=16".into(),
            "--kl_beta=0.2".into(),
            "--learning_rate=5e-6".into(),
        ],
    )
    .unwrap();
    assert_eq!(
        (
            c.generation.num_generations,
            c.loss.beta,
            c.update.learning_rate
        ),
        (16, 0.2, 5e-6)
    );
    // The example config with the seed's defaults loads.
    let c = load(
        include_str!("../../../../../examples/configs/fill_in.toml"),
        Format::Toml,
        &["--group_size=16", "--kl_beta=0.2"],
    )
    .unwrap();
    assert_eq!(c.run.policy, PolicyType::FillIn);
    assert_eq!(
        (
            c.generation.num_generations,
            c.loss.beta,
            c.generation.temperature,
            c.generation.top_p
        ),
        (16, 0.2, 0.8, 0.95)
    );
    assert_eq!(c.update.lr_scheduler_type, LrSchedule::Cosine);
}

#[test]
fn a_trl_config_is_told_which_differing_defaults_it_relies_on() {
    // A TRL YAML that sets two of the keys whose defaults differ: the others are listed.
    let c = load(
        "learning_rate: 1.0e-5\nmax_completion_length: 512\nlogging_steps: 10\n",
        Format::Yaml,
        &[],
    )
    .unwrap();
    assert_eq!(
        c.trl_defaults_relied_on,
        [
            "num_train_epochs",
            "max_prompt_length",
            "gradient_checkpointing",
            "log_completions",
            "report_to",
            "output_dir"
        ]
    );
    // A TOML of grpo's own keys is not a TRL config; one naming a TRL-only key is.
    assert!(load("beta = 0.04", Format::Toml, &[])
        .unwrap()
        .trl_defaults_relied_on
        .is_empty());
    let c = load("use_vllm = false", Format::Toml, &["--num_train_epochs=3"]).unwrap();
    assert!(c.trl_defaults_relied_on.contains(&"report_to"));
    assert!(!c.trl_defaults_relied_on.contains(&"num_train_epochs"));
    // max_steps sizes the run: num_train_epochs is not relied on.
    let c = load("use_vllm = false", Format::Toml, &["--max_steps=5"]).unwrap();
    assert!(!c.trl_defaults_relied_on.contains(&"num_train_epochs"));
    // Every listed key is a grpo key, with the default the table says.
    for (key, ours, _, _) in DEFAULT_DIFFERENCES {
        let doc = KEYS.iter().find(|k| k.key == *key).unwrap();
        let shown = doc.default.trim_matches('"');
        assert!(
            shown == *ours || doc.default == *ours || shown.trim_end_matches(".0") == *ours,
            "{key}: table says {ours}, the key's default is {}",
            doc.default
        );
    }
}
