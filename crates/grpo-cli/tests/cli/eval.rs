//! `grpo eval`: its options, pass@k as JSON with every answer written, k checked, any reward as
//! the correctness reward.

use super::*;

#[test]
fn help_explains_every_eval_option() {
    let o = grpo(&["eval", "--help"]);
    assert!(o.status.success());
    let h = String::from_utf8_lossy(&o.stdout);
    for opt in [
        "--model",
        "--base",
        "--data",
        "--prompt-field",
        "--answer-field",
        "--rewards-config",
        "--k",
        "--num-samples",
        "--num_samples",
        "--temperature",
        "--top-p",
        "--top-k",
        "--max-new-tokens",
        "--no-greedy",
        "--num-prompts",
        "--seed",
        "--system-prompt",
        "--correctness-reward",
        "--correctness-threshold",
        "--out",
        "--json",
        "pass@K",
    ] {
        assert!(h.contains(opt), "--help lacks {opt}");
    }
}

/// `grpo eval` on a tiny model and the built-in task: metrics as JSON, one row per prompt.
#[test]
fn eval_prints_pass_at_k_as_json_and_writes_every_answer() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    tiny_model(&model);
    let rows_path = tmp.path().join("answers.jsonl");
    let o = grpo(&[
        "eval",
        "--model",
        model.to_str().unwrap(),
        "--k",
        "1,2",
        "--num_samples",
        "2",
        "--max-new-tokens",
        "4",
        "--num-prompts",
        "3",
        "--threads",
        "2",
        "--out",
        rows_path.to_str().unwrap(),
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let m: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    for k in [
        "eval/pass@1",
        "eval/pass@2",
        "eval/mean_accuracy",
        "eval/accuracy",
        "eval/reward/correct",
        "eval/reward/format",
    ] {
        let v = m[k].as_f64().unwrap_or_else(|| panic!("{k} missing: {m}"));
        assert!((0.0..=1.0).contains(&v), "{k} = {v}");
    }
    assert_eq!(m["num_prompts"], 3);
    assert_eq!(m["num_samples"], 2);
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(&rows_path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 3);
    for r in &rows {
        assert_eq!(r["completions"].as_array().unwrap().len(), 2);
        assert!(r["greedy"]["text"].is_string());
        assert!(r["answer"].is_string());
    }
    // The table form.
    let o = grpo(&[
        "eval",
        "--model",
        model.to_str().unwrap(),
        "--num-samples",
        "0",
        "--max-new-tokens",
        "4",
        "--num-prompts",
        "2",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("eval/accuracy") && !out.contains("pass@"),
        "{out}"
    );
}

/// Bad eval options are refused before any model is loaded, naming the option.
#[test]
fn eval_rejects_k_above_num_samples() {
    let o = grpo(&[
        "eval",
        "--model",
        "/no/such/model",
        "--k",
        "1,8",
        "--num_samples",
        "4",
    ]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains("`--k`") && e.contains("pass@8") && e.contains("--num-samples"),
        "{e}"
    );
    assert!(!e.contains("/no/such/model"), "{e}");
    let o = grpo(&["eval", "--num-samples", "0", "--no-greedy"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("nothing to evaluate"), "{}", stderr(&o));
    // The same rule in a training config names its key.
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("run.toml");
    std::fs::write(&cfg, "eval_num_samples = 2\neval_k = [1, 4]\n").unwrap();
    let o = grpo(&["eval", "--rewards-config", cfg.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("`eval_k`"), "{}", stderr(&o));
}

/// A Python reward function as the correctness reward (issue 57): `grpo eval
/// --correctness-reward NAME --correctness-threshold T` reports pass@k and the accuracies from
/// it (a completion is correct when it scores >= T), which a run with no answer_match reward
/// otherwise cannot; a name that is not one of the rewards is an error listing them.
#[test]
fn eval_takes_any_reward_as_the_correctness_reward() {
    let Some(python) = reward_python() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    tiny_model(&model);
    std::fs::write(
        tmp.path().join("checks.py"),
        "def thirds(completions, **kwargs):\n    return [len(c) % 3 / 2 for c in completions]\n",
    )
    .unwrap();
    let cfg = tmp.path().join("run.toml");
    std::fs::write(
        &cfg,
        "[[rewards]]\nkind = \"python\"\nfunction = \"checks.py:thirds\"\n",
    )
    .unwrap();
    let eval = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_grpo"))
            .args(["eval", "--model", model.to_str().unwrap()])
            .args(["--rewards-config", cfg.to_str().unwrap()])
            .args(["--k", "1,4", "--num-samples", "4", "--num-prompts", "3"])
            .args(["--max-new-tokens", "4", "--threads", "2", "--json"])
            .args(extra)
            .current_dir(tmp.path())
            .env("RUST_LOG", "warn")
            .env("GRPO_PYTHON", &python)
            .output()
            .unwrap()
    };
    let metrics = |o: &Output| -> serde_json::Value {
        assert!(o.status.success(), "{}", stderr(o));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    // No answer_match reward and none named: only the reward's mean.
    let m = metrics(&eval(&[]));
    assert!(
        m["eval/reward/thirds"].is_number() && m["eval/accuracy"].is_null(),
        "{m}"
    );
    let rows = tmp.path().join("rows.jsonl");
    let o = eval(&[
        "--correctness-reward",
        "thirds",
        "--correctness-threshold",
        "0.5",
        "--out",
        rows.to_str().unwrap(),
    ]);
    let m = metrics(&o);
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(&rows)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let (mut correct, mut greedy) = (0, 0);
    for r in &rows {
        for c in r["completions"].as_array().unwrap() {
            let ok = c["rewards"]["thirds"].as_f64().unwrap() >= 0.5;
            assert_eq!(c["correct"], ok, "{c}");
            correct += usize::from(ok);
        }
        let ok = r["greedy"]["rewards"]["thirds"].as_f64().unwrap() >= 0.5;
        assert_eq!(r["greedy"]["correct"], ok);
        greedy += usize::from(ok);
    }
    let get = |k: &str| m[k].as_f64().unwrap_or_else(|| panic!("{k} missing: {m}"));
    assert!((get("eval/mean_accuracy") - correct as f64 / 12.0).abs() < 1e-9);
    assert!((get("eval/pass@1") - correct as f64 / 12.0).abs() < 1e-9);
    assert!((get("eval/accuracy") - greedy as f64 / 3.0).abs() < 1e-9);
    assert!(get("eval/pass@4") >= get("eval/pass@1"));
    // The same from the config's keys (threshold 1.0 unless set).
    std::fs::write(
        &cfg,
        "correctness_reward = \"thirds\"\n\
         [[rewards]]\nkind = \"python\"\nfunction = \"checks.py:thirds\"\n",
    )
    .unwrap();
    let m = metrics(&eval(&[]));
    assert!(
        m["eval/pass@4"].is_number() && m["eval/accuracy"].is_number(),
        "{m}"
    );
    // A wrong name: the flag's error, and the config key's (before a model is loaded).
    let o = eval(&["--correctness-reward", "thrids"]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains("--correctness-reward") && e.contains("`thrids`") && e.contains("`thirds`"),
        "{e}"
    );
    std::fs::write(
        &cfg,
        "correctness_reward = \"thrids\"\n\
         [[rewards]]\nkind = \"python\"\nfunction = \"checks.py:thirds\"\n",
    )
    .unwrap();
    let e = stderr(&eval(&[]));
    assert!(
        e.contains("`correctness_reward`") && e.contains("`thrids`") && e.contains("`thirds`"),
        "{e}"
    );
}
