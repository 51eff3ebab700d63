//! Fill-in GRPO end to end on tiny fixtures: the BERT masked-LM generator of
//! `tests/fixtures/fillin/bert_mlm` against the frozen BERT judge of `tests/fixtures/rewards/bert`
//! (same tokenizer family). The loop's GRPO core trains it: the judge's score rises, the KL to the
//! frozen initial generator is logged, checkpoints are HF masked-LM directories, and a run stopped
//! and resumed equals the uninterrupted one exactly.

use std::path::{Path, PathBuf};

use candle_core::Device;
use grpo::config::{Format, TrainConfig};
use grpo::train::{train, RunControl};
use grpo_models::models::masked_lm::MaskedLm;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// Masked inputs over the fixture tokenizer's vocabulary.
const PROMPTS: &[&str] = &[
    "The quick brown [MASK] jumps over the [MASK] dog.",
    "The cat sat on the [MASK] while the [MASK] slept.",
    "Good answers are [MASK]. Bad answers ramble on and [MASK].",
    "This response is [MASK], correct and [MASK].",
    "What is 17 plus 25? The answer is [MASK].",
    "[MASK] models score completions; higher is [MASK].",
    "That reply was [MASK], wrong and far too [MASK]!",
    "A helpful answer explains the [MASK] step by [MASK].",
];

fn write_data(dir: &Path) -> PathBuf {
    let path = dir.join("masked.jsonl");
    let rows: Vec<String> = PROMPTS
        .iter()
        .map(|p| serde_json::json!({ "prompt": p }).to_string())
        .collect();
    std::fs::write(&path, rows.join("\n") + "\n").unwrap();
    path
}

fn config(out: &Path, data: &Path, overrides: &[&str]) -> TrainConfig {
    let text = format!(
        "policy = \"fill_in\"\nmodel = \"{}\"\noutput_dir = \"{}\"\ntrain_file = \"{}\"\n\
         num_generations = 4\nper_device_train_batch_size = 16\nlearning_rate = 1e-2\n\
         temperature = 0.8\ntop_p = 0.95\nbeta = 0.04\nmax_steps = 12\nsave_steps = 4\n\
         eval_steps = 12\neval_file = \"{}\"\nthreads = 2\nlogging_steps = 1\n\
         [[rewards]]\nkind = \"format\"\nname = \"digit\"\npattern = \"[0-9]\"\n\
         [[rewards]]\nkind = \"classifier\"\nname = \"judge\"\nweight = 0.1\nmodel = \"{}\"\n\
         label = \"positive\"\ninput = \"completion\"\noutput = \"probability\"\n",
        fixtures().join("fillin/bert_mlm").display(),
        out.display(),
        data.display(),
        data.display(),
        fixtures().join("rewards/bert").display(),
    );
    let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    TrainConfig::from_str(&text, Format::Toml, "fill_in_test", &o).unwrap()
}

fn metrics(dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            v.as_object_mut().unwrap().retain(|k, _| {
                !k.starts_with("time") && !k.starts_with("memory/") && k != "tokens_per_second"
            });
            v
        })
        .collect()
}

fn weights(dir: &Path) -> Vec<(String, Vec<f32>)> {
    let (t, _) = MaskedLm::read_tensors(dir, &Device::Cpu).unwrap();
    let mut v: Vec<(String, Vec<f32>)> = t
        .into_iter()
        .map(|(k, t)| (k, t.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

#[test]
fn fill_in_grpo_raises_the_judge_score_and_resumes_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let data = write_data(tmp.path());
    let full = tmp.path().join("full");
    let out = train(&config(&full, &data, &[]), &RunControl::default()).unwrap();
    assert_eq!(out.steps, 12);
    let m = metrics(&full);
    let m_all = m.clone();
    // A verifier the fills can satisfy (a digit in the filled text) and a frozen judge scoring
    // the filled text. The verifier's score of greedy fills of the held-out inputs rises.
    let eval = |step: u64, name: &str| {
        m.iter()
            .find(|r| r["step"] == step && r.get(name).is_some())
            .and_then(|r| r[name].as_f64())
            .unwrap()
    };
    let (before, after) = (eval(0, "eval/reward/digit"), eval(12, "eval/reward/digit"));
    assert!(
        after >= before + 0.25,
        "greedy fills: {before:.3} -> {after:.3}"
    );
    let m: Vec<serde_json::Value> = m.into_iter().filter(|r| r.get("kl").is_some()).collect();
    let mean = |rows: &[serde_json::Value], k: &str| {
        rows.iter().map(|r| r[k].as_f64().unwrap()).sum::<f64>() / rows.len() as f64
    };
    let (first, last) = (&m[..3], &m[m.len() - 3..]);
    assert!(
        mean(last, "rewards/digit/mean") > mean(first, "rewards/digit/mean") + 0.2,
        "sampled fills: {:.3} -> {:.3}",
        mean(first, "rewards/digit/mean"),
        mean(last, "rewards/digit/mean")
    );
    // The judge scored every filled text (a probability).
    for r in &m {
        let j = r["rewards/judge/mean"].as_f64().unwrap();
        assert!(j > 0.0 && j < 1.0, "{j}");
    }
    // The KL to the frozen initial generator is part of the loss and grows from 0.
    assert!(m[0]["kl"].as_f64().unwrap().abs() < 1e-6);
    assert!(m.last().unwrap()["kl"].as_f64().unwrap() > 0.0);
    // Completions are the filled inputs, masks gone.
    let comps = std::fs::read_to_string(full.join("completions.jsonl")).unwrap();
    let c: serde_json::Value = serde_json::from_str(comps.lines().next().unwrap()).unwrap();
    let text = c["completion"].as_str().unwrap();
    assert!(
        !text.contains("[MASK]") && text.contains("jumps over"),
        "{text}"
    );

    // A checkpoint is a masked-LM directory that loads as the generator did.
    let ck = out.last_checkpoint.unwrap();
    assert!(ck.ends_with("checkpoint-12"));
    MaskedLm::load(&ck, &Device::Cpu).unwrap();
    assert!(ck.join("tokenizer.json").is_file());

    // Stopped after 4 steps (a checkpoint), resumed to 12: the same weights and metrics.
    let split = tmp.path().join("split");
    let ctl = RunControl {
        max_rounds_this_run: Some(4),
        ..Default::default()
    };
    train(&config(&split, &data, &[]), &ctl).unwrap();
    let resumed = RunControl {
        resume: true,
        ..Default::default()
    };
    train(&config(&split, &data, &[]), &resumed).unwrap();
    let resumed_m = metrics(&split);
    assert_eq!(resumed_m.len(), m_all.len(), "rows");
    for (a, b) in resumed_m.iter().zip(&m_all) {
        for (k, v) in b.as_object().unwrap() {
            assert_eq!(&a[k], v, "resumed metric {k} at step {} differs", b["step"]);
        }
        assert_eq!(a, b);
    }
    assert_eq!(
        weights(&split.join("checkpoint-12")),
        weights(&ck),
        "resumed weights differ"
    );
}

#[test]
fn a_fill_in_run_without_a_generator_or_with_a_causal_one_says_what_loads() {
    let tmp = tempfile::tempdir().unwrap();
    let data = write_data(tmp.path());
    let base = format!(
        "policy = \"fill_in\"\noutput_dir = \"{}\"\ntrain_file = \"{}\"\nmax_steps = 1\n",
        tmp.path().join("o").display(),
        data.display()
    );
    let cfg =
        |extra: &str| TrainConfig::from_str(&format!("{base}{extra}"), Format::Toml, "t", &[]);
    // No generator, or no reward: the config names the key.
    let e = cfg("").unwrap_err().to_string();
    assert!(e.contains("model") && e.contains("masked-LM"), "{e}");
    let gen = fixtures().join("fillin/bert_mlm");
    let e = cfg(&format!("model = \"{}\"\n", gen.display()))
        .unwrap_err()
        .to_string();
    assert!(e.contains("judge") && e.contains("[[rewards]]"), "{e}");
    let judge = format!(
        "judge = \"{}\"\n",
        fixtures().join("rewards/bert").display()
    );
    // A causal LM as the generator.
    let c = cfg(&format!(
        "{judge}model = \"{}\"\n",
        fixtures().join("tiny/llama").display()
    ))
    .unwrap();
    let e = train(&c, &RunControl::default()).unwrap_err().to_string();
    assert!(e.contains("causal LM"), "{e}");
    // The seed's PyTorch checkpoint: which formats load and how to convert.
    let pt = tmp.path().join("checkpoint.pt");
    std::fs::write(&pt, b"not a model").unwrap();
    let c = cfg(&format!(
        "{judge}generator_checkpoint = \"{}\"\n",
        pt.display()
    ))
    .unwrap();
    let e = train(&c, &RunControl::default()).unwrap_err().to_string();
    assert!(
        e.contains("checkpoint.pt") && e.contains("save_pretrained") && e.contains("ForMaskedLM"),
        "{e}"
    );
    // A judge given by path rewards the fills (its label `positive` is its last one).
    let c = cfg(&format!("{judge}model = \"{}\"\n", gen.display())).unwrap();
    train(&c, &RunControl::default()).unwrap();
    let m = std::fs::read_to_string(tmp.path().join("o/metrics.jsonl")).unwrap();
    // The judge alone: `sides_match` belongs to the built-in task.
    assert!(
        m.contains("rewards/judge/mean") && !m.contains("rewards/sides_match/mean"),
        "{m}"
    );
}

/// Unmasked sentences over the fixture tokenizer's vocabulary, one per line.
const TEXTS: &[&str] = &[
    "The quick brown fox jumps over the lazy dog.",
    "The cat sat on the mat while the dog slept.",
    "Good answers are short. Bad answers ramble on and on.",
    "This response is helpful, correct and clear.",
    "What is 17 plus 25? The answer is 42.",
    "Reward models score completions; higher is better.",
    "That reply was rude, wrong and far too long!",
    "A helpful answer explains the method step by step.",
];

#[test]
fn a_text_corpus_is_masked_on_the_fly_with_fill_metrics_and_resumes_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let corpus = tmp.path().join("corpus.txt");
    std::fs::write(&corpus, TEXTS.join("\n") + "\n").unwrap();
    let cfg = |out: &Path| {
        let text = format!(
            "policy = \"fill_in\"\nmodel = \"{}\"\njudge = \"{}\"\noutput_dir = \"{}\"\n\
             train_file = \"{}\"\neval_file = \"{}\"\nmask_ratio = \"0.2..0.4\"\n\
             mask_span = \"1..2\"\nnum_generations = 4\nper_device_train_batch_size = 16\n\
             learning_rate = 1e-3\nbeta = 0.1\nmax_steps = 4\nsave_steps = 2\neval_steps = 4\n\
             threads = 2\n",
            fixtures().join("fillin/bert_mlm").display(),
            fixtures().join("rewards/bert").display(),
            out.display(),
            corpus.display(),
            corpus.display(),
        );
        TrainConfig::from_str(&text, Format::Toml, "t", &[]).unwrap()
    };
    let full = tmp.path().join("full");
    train(&cfg(&full), &RunControl::default()).unwrap();
    let m = metrics(&full);
    let steps: Vec<&serde_json::Value> = m.iter().filter(|r| r.get("loss").is_some()).collect();
    assert_eq!(steps.len(), 4);
    for r in &steps {
        let acc = r["fill/accuracy"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&acc), "{acc}");
        assert!(r["fill/masked_positions"].as_f64().unwrap() >= 1.0);
        // The seed's names beside grpo's.
        assert_eq!(r["mean_reward"], r["reward"]);
        assert_eq!(r["std_reward"], r["reward_std"]);
        assert_eq!(r["mean_advantage"], r["advantage_mean"]);
        assert_eq!(r["mean_kl"], r["kl"]);
        assert_eq!(r["fill/judge_score"], r["rewards/judge/mean"]);
        for k in ["loss", "pg_loss", "kl_penalty", "mean_log_prob"] {
            assert!(r[k].is_number(), "{k}");
        }
    }
    // Logged samples show the masked input and its fill.
    let comps = std::fs::read_to_string(full.join("completions.jsonl")).unwrap();
    let c: serde_json::Value = serde_json::from_str(comps.lines().next().unwrap()).unwrap();
    let (prompt, fill) = (
        c["prompt"].as_str().unwrap(),
        c["completion"].as_str().unwrap(),
    );
    assert!(
        prompt.contains("[MASK]") && !fill.contains("[MASK]"),
        "{prompt} -> {fill}"
    );
    // Held-out inputs are masked once: both evaluations fill the same inputs.
    let eval_prompts = |step: u64| -> Vec<String> {
        std::fs::read_to_string(full.join(format!("eval/step-{step}.jsonl")))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["prompt"].to_string())
            .collect()
    };
    let (e0, e4) = (eval_prompts(0), eval_prompts(4));
    assert!(
        !e0.is_empty() && e0.iter().all(|p| p.contains("[MASK]")),
        "{e0:?}"
    );
    assert_eq!(e0, e4);

    // Stopped at step 2 and resumed: the masks drawn after the resume are the same.
    let split = tmp.path().join("split");
    let ctl = RunControl {
        max_rounds_this_run: Some(2),
        ..Default::default()
    };
    train(&cfg(&split), &ctl).unwrap();
    let resumed = RunControl {
        resume: true,
        ..Default::default()
    };
    train(&cfg(&split), &resumed).unwrap();
    assert_eq!(metrics(&split), m);
    assert_eq!(
        weights(&split.join("checkpoint-4")),
        weights(&full.join("checkpoint-4"))
    );
}

#[test]
fn fill_in_inputs_and_judges_that_cannot_work_are_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let gen = fixtures().join("fillin/bert_mlm");
    let judge = fixtures().join("rewards/bert");
    let unmasked = tmp.path().join("unmasked.jsonl");
    std::fs::write(
        &unmasked,
        "{\"prompt\": \"The cat sat on the [MASK].\"}\n{\"prompt\": \"No mask here.\"}\n",
    )
    .unwrap();
    let cfg = |extra: &str| {
        TrainConfig::from_str(
            &format!(
                "policy = \"fill_in\"\nmodel = \"{}\"\noutput_dir = \"{}\"\n\
                 train_file = \"{}\"\nmax_steps = 1\nnum_generations = 2\n\
                 per_device_train_batch_size = 4\n{extra}",
                gen.display(),
                tmp.path().join("o").display(),
                unmasked.display()
            ),
            Format::Toml,
            "t",
            &[],
        )
    };
    // A row without a mask and no masking configured: the row and the fix.
    let c = cfg(&format!("judge = \"{}\"\n", judge.display())).unwrap();
    let e = train(&c, &RunControl::default()).unwrap_err().to_string();
    assert!(
        e.contains("unmasked.jsonl:2") && e.contains("mask_ratio") && e.contains("[MASK]"),
        "{e}"
    );
    // A judge whose tokenizer is not the generator's.
    let other = tmp.path().join("judge");
    std::fs::create_dir(&other).unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer_config.json"] {
        std::fs::copy(judge.join(f), other.join(f)).unwrap();
    }
    std::fs::copy(
        fixtures().join("fillin/roberta_mlm/tokenizer.json"),
        other.join("tokenizer.json"),
    )
    .unwrap();
    let c = cfg(&format!(
        "judge = \"{}\"\nmask_ratio = 0.3\n",
        other.display()
    ));
    let e = match c {
        Ok(c) => train(&c, &RunControl::default()).unwrap_err().to_string(),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains("judge") && e.contains("tokenizer differs") && e.contains("--generator"),
        "{e}"
    );
    // Masking keys where they do not apply.
    let e = TrainConfig::from_str("mask_ratio = 0.2\n", Format::Toml, "t", &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("mask_ratio") && e.contains("fill_in"), "{e}");
    let e = cfg(&format!("judge = \"{}\"\nmask_span = 3\n", judge.display()))
        .unwrap_err()
        .to_string();
    assert!(e.contains("mask_span") && e.contains("mask_ratio"), "{e}");
    let e = cfg(&format!(
        "judge = \"{}\"\nmask_ratio = 1.5\n",
        judge.display()
    ))
    .unwrap_err()
    .to_string();
    assert!(e.contains("mask_ratio"), "{e}");
}
