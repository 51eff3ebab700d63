//! The `grpo` binary as a user runs it: the default model (fetched once into the cache), JSON
//! output, stop strings, and clear errors with a non-zero exit code.

use std::path::PathBuf;
use std::process::{Command, Output};

fn grpo(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_grpo"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run grpo")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn fixture(p: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(p)
        .display()
        .to_string()
}

#[test]
fn help_explains_every_generate_option() {
    let o = grpo(&["generate", "--help"]);
    assert!(o.status.success());
    let h = String::from_utf8_lossy(&o.stdout);
    for opt in [
        "--model",
        "--prompt",
        "--prompts",
        "--chat",
        "--system",
        "--num-samples",
        "--max-new-tokens",
        "--min-new-tokens",
        "--temperature",
        "--top-k",
        "--top-p",
        "--min-p",
        "--repetition-penalty",
        "--stop",
        "--seed",
        "--json",
        "--dtype",
        "--device",
        "--threads",
    ] {
        assert!(h.contains(opt), "--help lacks {opt}");
    }
}

#[test]
fn generate_with_the_default_model_prints_json_lines() {
    let fetched = grpo_models::hub::download_or_skip(
        "the default model",
        grpo_models::hub::ensure_default_gguf(),
    );
    if fetched.is_none() {
        return;
    }
    let o = grpo(&[
        "generate",
        "--prompt",
        "What is 17 + 25?",
        "--chat",
        "-n",
        "2",
        "--max-new-tokens",
        "12",
        "--temperature",
        "0",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    for (i, l) in lines.iter().enumerate() {
        assert_eq!(l["sample_index"], i);
        // transformers' greedy answer for this prompt (tests/fixtures/smollm2/greedy.json).
        assert_eq!(l["completion"], "17 + 25 = 32.");
        assert_eq!(l["stop_reason"], "eos");
        let ids = l["completion_ids"].as_array().unwrap();
        assert_eq!(ids.len(), l["logprobs"].as_array().unwrap().len());
        assert!(l["prompt"]
            .as_str()
            .unwrap()
            .contains("<|im_start|>user\nWhat is 17 + 25?"));
    }
}

#[test]
fn stop_strings_end_the_completion() {
    let o = grpo(&[
        "generate",
        "--prompt",
        "What is 17 + 25?",
        "--chat",
        "--max-new-tokens",
        "12",
        "--temperature",
        "0",
        "--json",
        "--stop",
        " =",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let l: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&o.stdout).lines().next().unwrap()).unwrap();
    assert_eq!(l["stop_reason"], "stop_string");
    assert_eq!(l["completion"], "17 + 25 =");
}

#[test]
fn bad_input_gives_a_clear_error_and_exit_code() {
    let o = grpo(&["generate", "--model", "/no/such/model", "--prompt", "hi"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("/no/such/model"), "{}", stderr(&o));

    // A model directory without a tokenizer.
    let o = grpo(&[
        "generate",
        "--model",
        &fixture("tiny/llama"),
        "--prompt",
        "hi",
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("tokenizer"), "{}", stderr(&o));

    // A malformed prompts file names the file and line.
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("prompts.jsonl");
    std::fs::write(&p, "{\"prompt\": \"ok\"}\n{\"question\": 1}\n").unwrap();
    let o = grpo(&["generate", "--prompts", p.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("prompts.jsonl:2"), "{}", stderr(&o));

    let o = grpo(&["generate", "--prompt", "hi", "--top-p", "0"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("top_p"), "{}", stderr(&o));

    let o = grpo(&["generate", "--prompt", "hi", "--dtype", "f8"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--dtype"), "{}", stderr(&o));
}

#[test]
fn config_print_lists_every_key_and_bad_configs_name_the_key() {
    let o = grpo(&["config", "--print"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    for key in [
        "num_generations",
        "beta",
        "loss_type",
        "scale_rewards",
        "learning_rate",
        "task.train_size",
    ] {
        assert!(out.contains(key), "{key} missing from:\n{out}");
    }
    // report_to and gradient_checkpointing are real keys, not in the list of ignored ones.
    let ignored = out
        .split("ignored with a warning:")
        .nth(1)
        .expect("the ignored keys are listed");
    assert!(
        ignored.contains("bf16") && ignored.contains("use_vllm"),
        "{out}"
    );
    for real in ["report_to", "gradient_checkpointing", "device"] {
        assert!(!ignored.contains(&format!(" {real},")), "{real} in:\n{out}");
        assert!(
            out.contains(&format!("\n  {real} ")),
            "{real} missing from:\n{out}"
        );
    }
    let o = grpo(&[
        "config",
        "--resolve",
        "--num_generations=4",
        "--per_device_train_batch_size=8",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("num_generations = 4"));
    assert!(!String::from_utf8_lossy(&o.stdout).contains("\ndevice"));

    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("run.toml");
    std::fs::write(&cfg, "num_generation = 4\n").unwrap();
    let o = grpo(&["train", "--config", cfg.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(
        e.contains("num_generation") && e.contains("did you mean `num_generations`"),
        "{e}"
    );
    let o = grpo(&["train", "--num_generations=3"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("whole groups"), "{}", stderr(&o));
    let o = grpo(&[
        "train",
        "--config",
        dir.path().join("missing.toml").to_str().unwrap(),
    ]);
    assert!(stderr(&o).contains("missing.toml"), "{}", stderr(&o));
}

/// A reward table is checked when the config is read: `grpo config --resolve` names the bad
/// reward without loading a model.
#[test]
fn config_resolve_checks_the_reward_tables() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("run.toml");
    let c = cfg.to_str().unwrap();
    std::fs::write(
        &cfg,
        "[[rewards]]\nkind = \"answer_match\"\n[[rewards]]\nkind = \"fromat\"\npattern = \"x\"\n",
    )
    .unwrap();
    let o = grpo(&["config", "--resolve", "--config", c]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(
        e.contains("rewards[1].kind") && e.contains("did you mean `format`"),
        "{e}"
    );
    std::fs::write(
        &cfg,
        "[[rewards]]\nkind = \"command\"\ncommand = \"python3 score.py\"\ntimeout = 5\n",
    )
    .unwrap();
    let o = grpo(&["config", "--resolve", "--config", c]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(
        e.contains("rewards[0].timeout") && e.contains("did you mean `timeout_s`"),
        "{e}"
    );
    // A good table resolves (nothing is started) and is printed as given.
    std::fs::write(
        &cfg,
        "[[rewards]]\nkind = \"command\"\ncommand = \"no-such-scorer\"\ntimeout_s = 5\n",
    )
    .unwrap();
    let o = grpo(&["config", "--resolve", "--config", c]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains(
            "[[rewards]]\ncommand = \"no-such-scorer\"\nkind = \"command\"\ntimeout_s = 5\n"
        ),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
}

#[test]
fn rewards_check_prints_a_table_and_json() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("run.toml");
    std::fs::write(
        &cfg,
        "[[rewards]]\nkind = \"answer_match\"\nextract = \"answer_tag\"\n\
         [[rewards]]\nkind = \"format\"\nrequired_tags = [\"think\", \"answer\"]\nweight = 0.2\n",
    )
    .unwrap();
    let samples = dir.path().join("samples.jsonl");
    std::fs::write(
        &samples,
        "{\"prompt\": \"What is 6 x 7?\", \"answer\": 42, \"completion\": \"<think>6*7</think><answer>42</answer>\"}\n\
         {\"prompt\": \"What is 6 x 7?\", \"answer\": 42, \"completion\": \"It is 41\"}\n\
         {\"prompt\": \"Say hi\", \"completion\": \"<think>x</think><answer>hi</answer>\"}\n",
    )
    .unwrap();
    let (c, s) = (cfg.display().to_string(), samples.display().to_string());
    let o = grpo(&["rewards", "check", "--config", &c, "--samples", &s]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    for want in [
        "answer_match",
        "format",
        "samples.jsonl:1",
        "missing",
        "total",
    ] {
        assert!(out.contains(want), "{want} not in:\n{out}");
    }
    let o = grpo(&[
        "rewards",
        "check",
        "--config",
        &c,
        "--samples",
        &s,
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let rows: Vec<serde_json::Value> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 3);
    assert_eq!(rows[0]["rewards"]["answer_match"], 1.0);
    assert!((rows[0]["total"].as_f64().unwrap() - 1.2).abs() < 1e-6);
    assert_eq!(rows[1]["total"], 0.0);
    assert!(rows[2]["rewards"]["answer_match"].is_null());
    // A bad reward table names its key; a sample without a completion names its line.
    std::fs::write(&cfg, "[[rewards]]\nkind = \"format\"\npatern = \"x\"\n").unwrap();
    let o = grpo(&["rewards", "check", "--config", &c, "--samples", &s]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("rewards[0].patern"), "{}", stderr(&o));
    std::fs::write(&samples, "{\"prompt\": \"x\"}\n").unwrap();
    let o = grpo(&["rewards", "check", "--samples", &s]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("samples.jsonl:1: missing `completion`"),
        "{}",
        stderr(&o)
    );
}

/// The Python that runs reward functions (`GRPO_TEST_PYTHON`, else `python3`), or None with a
/// line saying the test was skipped.
fn reward_python() -> Option<String> {
    let python = std::env::var("GRPO_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    if Command::new(&python).arg("-c").arg("1").output().is_err() {
        no_python(&format!(
            "no `{python}` to run the reward functions (set GRPO_TEST_PYTHON)"
        ));
        return None;
    }
    Some(python)
}

/// A TRL user's reward functions, unchanged: a file written as TRL's docs write one (two
/// functions, one reading a dataset column), named in `reward_funcs` as a dotted import path and
/// as `file.py:function`, give through `grpo rewards check` exactly what calling them in Python
/// gives.
#[test]
fn trl_python_reward_functions_score_as_in_python() {
    let Some(python) = reward_python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("my_rewards.py"),
        r#"import re


def format_reward(completions, **kwargs):
    """1 when the completion is <think>...</think><answer>...</answer>."""
    pattern = r"^<think>.*?</think>\s*<answer>.*?</answer>$"
    return [1.0 if re.match(pattern, c, re.DOTALL) else 0.0 for c in completions]


def level_bonus(prompts, completions, level, **kwargs):
    """Reads the dataset column `level`; None (no score) for a completion without a digit."""
    return [None if not any(ch.isdigit() for ch in c) else 0.5 * lv + len(p) / 100
            for p, c, lv in zip(prompts, completions, level)]
"#,
    )
    .unwrap();
    let rows = [
        (
            r#"What is 6 x 7?"#,
            "<think>6*7</think><answer>42</answer>",
            1,
        ),
        ("Say hi", "hi there", 2),
        ("What is 2 + 2?", "It is 4", 3),
    ];
    let mut samples = String::new();
    for (p, c, l) in rows {
        samples += &serde_json::json!({"prompt": p, "completion": c, "level": l}).to_string();
        samples.push('\n');
    }
    std::fs::write(dir.path().join("samples.jsonl"), &samples).unwrap();
    std::fs::write(
        dir.path().join("run.yaml"),
        "reward_funcs:\n  - my_rewards.format_reward\n  - my_rewards.py:level_bonus\n",
    )
    .unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_grpo"))
        .args([
            "rewards",
            "check",
            "--config",
            "run.yaml",
            "--samples",
            "samples.jsonl",
            "--json",
        ])
        .current_dir(dir.path())
        .env("RUST_LOG", "warn")
        .env("GRPO_PYTHON", &python)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let got: Vec<serde_json::Value> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // The same functions called in Python, as TRL calls them.
    let o = Command::new(&python)
        .arg("-c")
        .arg(
            "import json, my_rewards\n\
             rows = [json.loads(l) for l in open('samples.jsonl')]\n\
             kw = dict(prompts=[r['prompt'] for r in rows], completions=[r['completion'] for r in rows],\n\
                       level=[r['level'] for r in rows])\n\
             print(json.dumps({'format_reward': my_rewards.format_reward(**kw),\n\
                               'level_bonus': my_rewards.level_bonus(**kw)}))",
        )
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let want: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(got.len(), rows.len());
    for (i, row) in got.iter().enumerate() {
        for name in ["format_reward", "level_bonus"] {
            let (g, w) = (&row["rewards"][name], &want[name][i]);
            match w.as_f64() {
                Some(w) => assert!(
                    (g.as_f64().unwrap() - w).abs() < 1e-6,
                    "{name}[{i}]: {g} vs {w}"
                ),
                None => assert!(g.is_null(), "{name}[{i}]: {g}, Python says None"),
            }
        }
    }
    // A bare name that is neither TRL's nor a path says how to name a function.
    std::fs::write(dir.path().join("run.yaml"), "reward_funcs: [level_bonus]\n").unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_grpo"))
        .args([
            "rewards",
            "check",
            "--config",
            "run.yaml",
            "--samples",
            "samples.jsonl",
        ])
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("reward_funcs") && stderr(&o).contains("my_rewards.level_bonus"),
        "{}",
        stderr(&o)
    );
}

/// `reward_funcs: [my_rewards.correct]` with my_rewards.py importable only through
/// `PYTHONPATH`, as TRL's docs have it (issue 57): the adapter sees the user's PYTHONPATH, so the
/// module imports; without it, the error names the module.
#[test]
fn python_reward_functions_import_through_the_users_pythonpath() {
    let Some(python) = reward_python() else {
        return;
    };
    let (lib, run) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    std::fs::write(
        lib.path().join("my_rewards.py"),
        "def correct(completions, answer, **kwargs):\n    \
         return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]\n",
    )
    .unwrap();
    std::fs::write(
        run.path().join("samples.jsonl"),
        "{\"prompt\": \"2+2?\", \"answer\": \"4\", \"completion\": \"4\"}\n\
         {\"prompt\": \"2+3?\", \"answer\": \"5\", \"completion\": \"6\"}\n",
    )
    .unwrap();
    std::fs::write(
        run.path().join("run.yaml"),
        "reward_funcs:\n  - my_rewards.correct\n",
    )
    .unwrap();
    let check = |pythonpath: Option<&std::path::Path>, extra: &[&str]| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_grpo"));
        c.args(["rewards", "check", "--config", "run.yaml"])
            .args(["--samples", "samples.jsonl", "--json"])
            .args(extra)
            .current_dir(run.path())
            .env("RUST_LOG", "warn")
            .env("GRPO_PYTHON", &python)
            .env_remove("PYTHONPATH");
        if let Some(p) = pythonpath {
            c.env("PYTHONPATH", p);
        }
        c.output().unwrap()
    };
    let rows = |o: &Output| -> Vec<serde_json::Value> {
        assert!(o.status.success(), "{}", stderr(o));
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let got = rows(&check(Some(lib.path()), &[]));
    assert_eq!(got.len(), 2);
    assert_eq!(got[0]["rewards"]["correct"], 1.0);
    assert_eq!(got[1]["rewards"]["correct"], 0.0);
    // `--reward_funcs a b` replaces the file's list, as in TRL (it used to append: "two
    // rewards are named `correct`").
    let extra = [
        "--reward_funcs",
        "my_rewards.correct",
        "think_format_reward",
    ];
    let got = rows(&check(Some(lib.path()), &extra));
    let names: Vec<&String> = got[0]["rewards"].as_object().unwrap().keys().collect();
    assert_eq!(names, ["correct", "think_format_reward"]);
    let o = check(None, &[]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("No module named 'my_rewards'"),
        "{}",
        stderr(&o)
    );
}

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

#[path = "../../grpo/tests/support/tiny_llama.rs"]
mod support;

fn tiny_model(dir: &std::path::Path) {
    support::tiny_llama(dir, std::path::Path::new(&fixture("")));
}

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

/// `grpo export`: a PEFT adapter merged into its base, the adapter files alone, and the errors.
#[test]
fn export_merges_lora_adapters_into_hf_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let adapter = fixture("lora/llama_qv");
    let base = fixture("tiny/llama");
    let merged = tmp.path().join("merged");
    let m = merged.display().to_string();
    let o = grpo(&[
        "export",
        "--checkpoint",
        &adapter,
        "--base",
        &base,
        "--merge",
        "--out",
        &m,
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("merged 6 LoRA adapters"),
        "{}",
        stderr(&o)
    );
    for f in ["config.json", "model.safetensors", "generation_config.json"] {
        assert!(merged.join(f).is_file(), "{f}");
    }
    // An occupied output directory is refused, naming it.
    let o = grpo(&[
        "export",
        "--checkpoint",
        &adapter,
        "--base",
        &base,
        "--merge",
        "--out",
        &m,
    ]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("already holds a model"),
        "{}",
        stderr(&o)
    );
    // Without --merge: the adapter files.
    let only = tmp.path().join("adapter");
    let o = grpo(&[
        "export",
        "--checkpoint",
        &adapter,
        "--out",
        &only.display().to_string(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(only.join("adapter_config.json").is_file());
    assert!(only.join("adapter_model.safetensors").is_file());
    // A base that is not there: the error says to pass --base.
    let o = grpo(&[
        "export",
        "--checkpoint",
        &adapter,
        "--base",
        "/nonexistent/base",
        "--merge",
        "--out",
        &tmp.path().join("x").display().to_string(),
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--base"), "{}", stderr(&o));
}

/// `grpo export --format gguf`: a PEFT adapter merged into its base as one GGUF file, and the
/// errors (a type GGUF has no use for, an existing file, q8_0 without `--format gguf`).
#[test]
fn export_writes_merged_lora_adapters_as_gguf() {
    let tmp = tempfile::tempdir().unwrap();
    let adapter = fixture("lora/llama_qv");
    let base = fixture("tiny/llama");
    let out = tmp.path().join("merged.gguf").display().to_string();
    let args = |outtype: &'static str, out: &str| {
        let v: Vec<String> = [
            "export",
            "--checkpoint",
            &adapter,
            "--base",
            &base,
            "--format",
            "gguf",
            "--outtype",
            outtype,
            "--out",
            out,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        v
    };
    let run = |a: Vec<String>| grpo(&a.iter().map(String::as_str).collect::<Vec<_>>());
    let o = run(args("q8_0", &out));
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("merged 6 LoRA adapters"),
        "{}",
        stderr(&o)
    );
    // The tiny fixture has no tokenizer: grpo loads the file, llama.cpp would not.
    assert!(stderr(&o).contains("no tokenizer"), "{}", stderr(&o));
    let bytes = std::fs::read(&out).unwrap();
    assert_eq!(&bytes[..4], b"GGUF");
    assert_eq!(u32::from_le_bytes(bytes[4..8].try_into().unwrap()), 3);
    let o = run(args("q8_0", &out));
    assert!(!o.status.success());
    assert!(stderr(&o).contains("already exists"), "{}", stderr(&o));
    let o = run(args(
        "q4_k",
        &tmp.path().join("x.gguf").display().to_string(),
    ));
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--outtype q4_k"), "{}", stderr(&o));
    let o = grpo(&[
        "export",
        "--checkpoint",
        &base,
        "--dtype",
        "q8_0",
        "--out",
        &tmp.path().join("hf").display().to_string(),
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--format gguf"), "{}", stderr(&o));
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

#[test]
fn log_lines_are_not_coloured_when_stderr_is_not_a_terminal() {
    let dir = tempfile::tempdir().unwrap();
    // A truncated last line: the report is written and the problem logged as a warning.
    std::fs::write(
        dir.path().join("metrics.jsonl"),
        "{\"step\":1,\"reward\":0.5}\n{\"step\":2,\"rew",
    )
    .unwrap();
    let res = Command::new(env!("CARGO_BIN_EXE_grpo"))
        .args(["report", &dir.path().display().to_string()])
        .env("RUST_LOG", "warn")
        .env_remove("NO_COLOR")
        .output()
        .expect("run grpo");
    let err = stderr(&res);
    assert!(res.status.success(), "{err}");
    assert!(
        err.contains("WARN") && err.contains("line 2 is truncated"),
        "{err}"
    );
    assert!(!err.contains("\x1b["), "{err:?}");
}

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

/// No Python here: a skip, or under `GRPO_REQUIRE_PYTHON=1` (set by `.ci/run`) a failure.
fn no_python(why: &str) {
    assert!(
        std::env::var("GRPO_REQUIRE_PYTHON").map_or(true, |v| v != "1"),
        "GRPO_REQUIRE_PYTHON=1 but {why}"
    );
    eprintln!("skipped: {why}");
}
