//! `grpo train`, `grpo report` and `grpo bench-ops`: the TRL-style example, checkpoints, metrics
//! and the report, the kernels' equality, launches without MPI.

use super::*;

/// examples/configs/trl_grpo.yaml, a config written as TRL's docs write one with its reward
/// functions in a Python file, trains as shipped from the repository's root (here on a tiny model,
/// one step).
#[test]
fn the_trl_style_example_trains_as_shipped() {
    let Some(python) = reward_python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    tiny_model(&model);
    let out = dir.path().join("run");
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let o = Command::new(env!("CARGO_BIN_EXE_grpo"))
        .args(["train", "--config", "examples/configs/trl_grpo.yaml"])
        .arg(format!("--model={}", model.display()))
        .arg(format!("--output_dir={}", out.display()))
        .args([
            "--max_steps=1",
            "--per_device_train_batch_size=8",
            "--max_completion_length=6",
            "--task.train_size=16",
            "--task.eval_size=4",
            "--threads=2",
            "--eval_steps=1",
            "--eval_num_samples=2",
            "--eval_k=1,2",
            "--correctness_reward=correct",
        ])
        .current_dir(&root)
        .env("RUST_LOG", "warn")
        .env("GRPO_PYTHON", &python)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let m = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let last: serde_json::Value = serde_json::from_str(m.lines().last().unwrap()).unwrap();
    for k in ["rewards/correct/mean", "rewards/short_answer/mean"] {
        assert!(last[k].as_f64().is_some(), "{k} not in {last}");
    }
    // Its Python `correct` as the correctness reward: evaluation in training reports pass@k and
    // accuracy from it.
    let evals: Vec<serde_json::Value> = m
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|r: &serde_json::Value| r.get("eval/pass@2").is_some())
        .collect();
    assert!(!evals.is_empty(), "no eval/pass@2 in {m}");
    for k in ["eval/pass@1", "eval/mean_accuracy", "eval/accuracy"] {
        assert!(evals[0][k].as_f64().is_some(), "{k} not in {}", evals[0]);
    }
    assert!(out.join("checkpoint-1").is_dir());
}

#[test]
fn report_writes_html_and_plots_and_names_a_missing_metrics_file() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    std::fs::create_dir(&run).unwrap();
    std::fs::write(
        run.join("metrics.jsonl"),
        "{\"step\":0,\"eval/accuracy\":0.2,\"eval/pass@1\":0.2,\"eval/pass@4\":0.5}\n\
         {\"step\":1,\"reward\":0.5,\"reward_std\":0.2,\"kl\":null,\"loss\":0.1}\n\
         {\"step\":2,\"reward\":0.7,\"reward_std\":0.1,\"kl\":0.01,\"loss\":0.05,\
         \"eval/accuracy\":0.4,\"eval/pass@1\":0.4,\"eval/pass@4\":0.7}\n",
    )
    .unwrap();
    std::fs::write(
        run.join("completions.jsonl"),
        "{\"step\":1,\"prompt\":\"2+2?\",\"completion\":\"<answer>4</answer>\",\
         \"stop_reason\":\"eos\",\"rewards\":{\"answer_match\":1.0},\"reward\":1.0,\"advantage\":0.5}\n",
    )
    .unwrap();
    let out = dir.path().join("out");
    let (r, o) = (run.display().to_string(), out.display().to_string());
    let res = grpo(&["report", &r, "--out", &o]);
    assert!(res.status.success(), "{}", stderr(&res));
    let printed: Vec<PathBuf> = String::from_utf8_lossy(&res.stdout)
        .lines()
        .map(PathBuf::from)
        .collect();
    assert_eq!(printed[0], out.join("report.html"));
    for png in ["reward.png", "eval.png", "kl.png", "loss.png"] {
        assert!(
            printed.contains(&out.join("plots").join(png)),
            "{printed:?}"
        );
    }
    for p in &printed {
        assert!(p.is_file(), "{}", p.display());
    }
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    assert!(html.contains("&lt;answer&gt;4&lt;/answer&gt;"));
    assert!(!run.join("report.html").exists());

    // Not a run directory: the error names the file.
    let d = dir.path().display().to_string();
    let res = grpo(&["report", &d]);
    assert!(!res.status.success());
    assert!(stderr(&res).contains("metrics.jsonl"), "{}", stderr(&res));

    let res = grpo(&["report", "--help"]);
    let help = String::from_utf8_lossy(&res.stdout);
    assert!(help.contains("RUN_DIR") && help.contains("--out"), "{help}");
}

/// `grpo train` end to end from the command line on a tiny model: it trains, checkpoints, and
/// writes the run report (the report is the binary's job, after the library's loop).
#[test]
fn train_writes_checkpoints_metrics_and_the_report() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    tiny_model(&model);
    let out = tmp.path().join("run");
    let cfg = tmp.path().join("run.toml");
    std::fs::write(
        &cfg,
        format!(
            "model = \"{}\"\noutput_dir = \"{}\"\nnum_generations = 4\nper_device_train_batch_size = 8\n\
             max_completion_length = 4\nlearning_rate = 1e-3\nmax_steps = 2\nsave_steps = 1\n\
             save_total_limit = 1\nthreads = 2\neval_steps = 2\neval_num_prompts = 2\n\
             [task]\ntrain_size = 16\neval_size = 4\n",
            model.display(),
            out.display()
        ),
    )
    .unwrap();
    let o = grpo(&["train", "--config", cfg.to_str().unwrap(), "--seed=3"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("2 steps; last checkpoint"), "{stdout}");
    assert!(out.join("checkpoint-2/model.safetensors").is_file());
    assert!(
        !out.join("checkpoint-1").exists(),
        "save_total_limit = 1 keeps one"
    );
    let lines = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let steps: Vec<u64> = lines
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(steps, vec![0, 1, 2]);
    assert!(out.join("report.html").is_file());
    assert!(out.join("plots").join("reward.png").is_file());
}

/// The same tiny run three ways: the AVX2 variants of grpo's kernels give the same weights bit
/// for bit as the best the CPU has (they run the same operations in the same order), and
/// `--kernels=portable` (the candle ops a GPU runs) trains too, saying so in its log, also with
/// an NF4 base (QLoRA) and top-k / top-p sampling.
#[test]
fn train_at_avx2_is_bit_identical_and_the_portable_kernels_train() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    tiny_model(&model);
    let run = |name: &str, env: &[(&str, &str)], extra: &[&str]| {
        let out = tmp.path().join(name);
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_grpo"));
        cmd.args(["train", "--max_steps=2", "--num_generations=4"])
            .args([
                "--per_device_train_batch_size=8",
                "--max_completion_length=4",
            ])
            .args(["--learning_rate=1e-3", "--save_steps=2", "--threads=2"])
            .args([
                "--eval_steps=0",
                "--task.train_size=16",
                "--task.eval_size=4",
            ])
            // The default's dynamic sampling would keep no group of a random model: every
            // round is trained on, as before it.
            .args(["--dynamic_sampling=false", "--temperature=1.0"])
            // The default's dtype = "auto" would pick bf16 where the CPU has bf16 products, and
            // f32 under GRPO_ISA=avx2: the comparison is of the f32 arithmetic.
            .arg("--dtype=f32")
            .arg(format!("--model={}", model.display()))
            .arg(format!("--output_dir={}", out.display()))
            .args(extra)
            .env("RUST_LOG", "info");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let o = cmd.output().unwrap();
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        (out.join("checkpoint-2"), stderr(&o))
    };
    let weights = |(dir, log): (std::path::PathBuf, String)| {
        (std::fs::read(dir.join("model.safetensors")).unwrap(), log)
    };
    let (best, log) = weights(run("best", &[], &[]));
    assert!(log.contains("kernels: fused"), "{log}");
    if grpo_models::kernels::Isa::detected() >= grpo_models::kernels::Isa::Avx2 {
        let (avx2, log) = weights(run("avx2", &[("GRPO_ISA", "avx2")], &[]));
        assert!(
            log.contains("kernels: fused (CPU instruction set avx2)"),
            "{log}"
        );
        assert!(avx2 == best, "GRPO_ISA=avx2 changed the trained weights");
    }
    let (portable, log) = weights(run("portable", &[], &["--kernels=portable"]));
    assert!(log.contains("kernels: portable"), "{log}");
    assert_eq!(portable.len(), best.len());
    // QLoRA and truncated sampling on the portable path: the base dequantized by candle ops on
    // the device, tokens chosen on the device.
    let (dir, log) = run(
        "qlora",
        &[],
        &[
            "--kernels=portable",
            "--lora.r=4",
            "--base_quantization=nf4",
            "--top_k=8",
            "--top_p=0.9",
        ],
    );
    assert!(log.contains("kernels: portable"), "{log}");
    assert!(dir.join("adapter_model.safetensors").is_file(), "{log}");
}

/// Started by a launcher as one of several processes, a grpo built without MPI stops with the
/// fix instead of training alone (every process would write the same directory).
#[cfg(not(feature = "mpi"))]
#[test]
fn a_launch_of_several_processes_without_mpi_says_to_rebuild() {
    let tmp = tempfile::tempdir().unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_grpo"))
        .args(["train", "--max_steps=1"])
        .arg(format!("--output_dir={}", tmp.path().join("out").display()))
        .env("OMPI_COMM_WORLD_SIZE", "2")
        .env("OMPI_COMM_WORLD_RANK", "1")
        .output()
        .unwrap();
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains("--features mpi") && e.contains("2 processes"),
        "{e}"
    );
    assert!(!tmp.path().join("out").exists(), "nothing is written");
}

/// `grpo bench ops` times every piece of a layer, forward and forward + backward, one JSON line
/// each (here on the CPU at a tiny batch; on a GPU build `--device cuda`).
#[test]
fn bench_ops_reports_every_piece_of_a_layer() {
    let o = grpo(&[
        "bench", "ops", "--shape", "135m", "--rows", "2", "--seq", "8", "--reps", "1", "--dtype",
        "f32",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let ops: Vec<String> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("a JSON line");
            assert!(v["fwd_ms"].as_f64().is_some_and(|t| t >= 0.0), "{l}");
            v["op"].as_str().expect("op").to_string()
        })
        .collect();
    for want in [
        "qkv_proj",
        "rms_norm",
        "rope_q",
        "attention",
        "decode_attention",
        "swiglu",
        "layer",
        "layer_without_attention",
        "lm_head_logprobs",
    ] {
        assert!(ops.iter().any(|o| o == want), "no {want} in {ops:?}");
    }
    let bad = grpo(&["bench", "ops", "--shape", "7b"]);
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--shape"));
}
