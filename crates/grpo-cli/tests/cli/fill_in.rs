//! Fill-in through the binary: `grpo generate` with a masked LM, `grpo pretrain`'s generator and
//! judge, and the fill-in seed's run.

use super::*;

#[test]
fn generate_fills_masked_inputs_with_a_masked_lm() {
    let model = fixture("fillin/bert_mlm");
    let o = grpo(&[
        "generate",
        "--model",
        &model,
        "--fill",
        "The quick brown [MASK] jumps over the [MASK] dog.",
        "-n",
        "3",
        "--temperature",
        "0.8",
        "--top-p",
        "0.95",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let rows: Vec<serde_json::Value> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 3);
    for r in &rows {
        let filled = r["filled"].as_str().unwrap();
        assert!(
            !filled.contains("[MASK]") && filled.contains("jumps over"),
            "{filled}"
        );
        assert_eq!(r["fill_ids"].as_array().unwrap().len(), 2);
    }
    // No mask in the input, or a causal model: clear errors.
    let o = grpo(&["generate", "--model", &model, "--fill", "no masks here"]);
    assert!(
        !o.status.success() && stderr(&o).contains("no mask token"),
        "{}",
        stderr(&o)
    );
    let o = grpo(&[
        "generate",
        "--model",
        &fixture("tiny/llama"),
        "--fill",
        "a [MASK] b",
    ]);
    assert!(
        !o.status.success() && stderr(&o).contains("causal LM"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn pretrain_makes_a_generator_and_a_judge_that_the_other_commands_load() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("corpus.txt");
    let lines: Vec<String> = (0..200)
        .map(|i| format!("{}+{}={}", i % 17, i % 13, i % 17 + i % 13))
        .collect();
    std::fs::write(&data, lines.join("\n")).unwrap();
    let (gen, judge) = (dir.path().join("gen"), dir.path().join("judge"));
    let small = [
        "--hidden",
        "32",
        "--layers",
        "1",
        "--heads",
        "2",
        "--steps",
        "20",
        "--batch-size",
        "16",
        "--warmup-steps",
        "2",
        "--eval-every",
        "10",
    ];
    let mut args = vec![
        "pretrain",
        "--objective",
        "mlm",
        "--data",
        data.to_str().unwrap(),
        "--out",
        gen.to_str().unwrap(),
    ];
    args.extend(small);
    let o = grpo(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("held-out accuracy"));
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "pretrain_log.jsonl",
    ] {
        assert!(gen.join(f).is_file(), "{f}");
    }
    let mut args = vec![
        "pretrain",
        "--objective",
        "judge",
        "--data",
        data.to_str().unwrap(),
        "--generator",
        gen.to_str().unwrap(),
        "--out",
        judge.to_str().unwrap(),
    ];
    args.extend(small);
    let o = grpo(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(judge.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["architectures"][0], "BertForSequenceClassification");
    let o = grpo(&[
        "generate",
        "--model",
        gen.to_str().unwrap(),
        "--fill",
        "3+[MASK]=7",
        "-n",
        "2",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(String::from_utf8_lossy(&o.stdout).lines().count(), 2);
    // The judge without a generator, and an empty corpus: errors that say what to give.
    let o = grpo(&[
        "pretrain",
        "--objective",
        "judge",
        "--data",
        data.to_str().unwrap(),
        "--out",
        dir.path().join("j2").to_str().unwrap(),
    ]);
    assert!(
        !o.status.success() && stderr(&o).contains("--generator"),
        "{}",
        stderr(&o)
    );
    std::fs::write(dir.path().join("empty.txt"), "\n").unwrap();
    let o = grpo(&[
        "pretrain",
        "--objective",
        "mlm",
        "--data",
        dir.path().join("empty.txt").to_str().unwrap(),
        "--out",
        dir.path().join("g2").to_str().unwrap(),
    ]);
    assert!(
        !o.status.success() && stderr(&o).contains("corpus is empty"),
        "{}",
        stderr(&o)
    );
    // A causal LM over a BPE tokenizer, with a checkpoint; `grpo generate` samples from it.
    let causal = dir.path().join("causal");
    let mut args = vec![
        "pretrain",
        "--objective",
        "causal",
        "--tokenizer",
        "bpe",
        "--vocab-size",
        "300",
        "--save-every",
        "10",
        "--data",
        data.to_str().unwrap(),
        "--out",
        causal.to_str().unwrap(),
    ];
    args.extend(small);
    let o = grpo(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(causal.join("checkpoint-10/model.safetensors").is_file());
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(causal.join("config.json")).unwrap())
            .unwrap();
    assert_eq!(cfg["architectures"][0], "LlamaForCausalLM");
    let o = grpo(&[
        "generate",
        "--model",
        causal.to_str().unwrap(),
        "--prompt",
        "3+4=",
        "--max-new-tokens",
        "4",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let mut args = vec![
        "pretrain",
        "--objective",
        "mlm",
        "--tokenizer",
        "bpe",
        "--vocab-size",
        "100",
        "--data",
    ];
    let g3 = dir.path().join("g3");
    args.extend([data.to_str().unwrap(), "--out", g3.to_str().unwrap()]);
    let o = grpo(&args);
    assert!(
        !o.status.success() && stderr(&o).contains("--vocab-size"),
        "{}",
        stderr(&o)
    );
}

/// Seed 002 through the binary, as its README runs it (`--policy=fill_in --group_size=16
/// --kl_beta=0.2`), on the tiny committed BERT generator and judge so it takes seconds: the run
/// trains, logs the KL to the frozen initial generator and the judge's score, and writes an HF
/// masked-LM checkpoint.
#[test]
fn the_fill_in_seed_runs_through_the_binary() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("masked.jsonl");
    let rows: Vec<String> = [
        "The quick brown [MASK] jumps over the [MASK] dog.",
        "The cat sat on the [MASK] while the [MASK] slept.",
        "What is 17 plus 25? The answer is [MASK].",
        "A helpful answer explains the [MASK] step by [MASK].",
    ]
    .iter()
    .map(|p| serde_json::json!({ "prompt": p }).to_string())
    .collect();
    std::fs::write(&data, rows.join("\n") + "\n").unwrap();
    let out = tmp.path().join("out-grpo");
    let o = grpo(&[
        "train",
        "--policy=fill_in",
        "--group_size=16",
        "--kl_beta=0.2",
        &format!("--generator_checkpoint={}", fixture("fillin/bert_mlm")),
        &format!("--judge_checkpoint={}", fixture("rewards/bert")),
        &format!("--train_file={}", data.display()),
        &format!("--out_dir={}", out.display()),
        "--per_device_train_batch_size=32",
        "--max_steps=2",
        "--save_interval=2",
        "--eval_interval=0",
        "--threads=2",
        "--report_to=none",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let metrics: Vec<serde_json::Value> = std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(metrics.len(), 2, "{metrics:?}");
    for m in &metrics {
        assert!(m["kl"].as_f64().is_some_and(f64::is_finite), "{m}");
        assert!(
            m["reward"]
                .as_f64()
                .is_some_and(|r| (0.0..=1.0).contains(&r)),
            "{m}"
        );
        assert!(m["loss"].as_f64().is_some_and(f64::is_finite), "{m}");
    }
    let ckpt = out.join("checkpoint-2");
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ckpt.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["architectures"][0], "BertForMaskedLM");
    assert!(ckpt.join("model.safetensors").is_file());
    // 16 fills per input: each group of 16 completions in completions.jsonl shares its prompt.
    let comps = std::fs::read_to_string(out.join("completions.jsonl")).unwrap();
    let prompts: Vec<String> = comps
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["prompt"].to_string())
        .collect();
    assert_eq!(prompts.len() % 16, 0);
    for g in prompts.chunks(16) {
        assert!(g.iter().all(|p| p == &g[0]));
    }
}
