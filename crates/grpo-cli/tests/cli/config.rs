//! `grpo config` and `grpo rewards`: every key listed, bad configs naming the key, reward
//! tables checked, Python reward functions scored as in Python.

use super::*;

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
