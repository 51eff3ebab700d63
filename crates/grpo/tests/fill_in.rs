//! Fill-in GRPO end to end on tiny fixtures: the BERT masked-LM generator of
//! `tests/fixtures/fillin/bert_mlm` against the frozen BERT judge of `tests/fixtures/rewards/bert`
//! (same tokenizer family). The loop's GRPO core trains it: the judge's score rises, the KL to the
//! frozen initial generator is logged, checkpoints are HF masked-LM directories, and a run stopped
//! and resumed equals the uninterrupted one exactly.

use std::path::{Path, PathBuf};

use candle_core::Device;
use grpo::config::{Format, TrainConfig};
use grpo::models::masked_lm::MaskedLm;
use grpo::train::{train, RunControl};

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
    assert!(
        m.contains("rewards/judge/mean") && m.contains("rewards/sides_match/mean"),
        "{m}"
    );
}
