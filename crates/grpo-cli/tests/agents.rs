//! `grpo generate --tools` and `grpo train` with tools, from the command line, on a tiny random
//! Llama (SmolLM2's tokenizer) with the calculator example and the ChatML tools template.

use std::path::{Path, PathBuf};
use std::process::Command;

#[path = "../../grpo/tests/support/tiny_llama.rs"]
mod support;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn tiny(dir: &Path) {
    support::tiny_llama(dir, &repo().join("tests/fixtures"));
}

#[test]
fn generate_with_tools_prints_episodes_turn_by_turn() {
    let dir = tempfile::tempdir().unwrap();
    tiny(dir.path());
    let o = Command::new(env!("CARGO_BIN_EXE_grpo"))
        .args(["generate", "--model"])
        .arg(dir.path())
        .args([
            "--prompt",
            "What is 12 * 34?",
            "-n",
            "2",
            "--max-new-tokens",
            "8",
            "--json",
        ])
        .arg("--tools")
        .arg(format!(
            "{}:calculator",
            repo().join("examples/agents/calculator.py").display()
        ))
        .arg("--chat-template")
        .arg(repo().join("examples/templates/chatml_tools.jinja"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let out = String::from_utf8_lossy(&o.stdout);
    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "{out}");
    for l in &lines {
        assert_eq!(l["messages"][0]["role"], "assistant", "{l}");
        assert!(l["turns"].as_u64().unwrap() >= 1);
    }
}

#[test]
fn generate_with_tools_refuses_a_template_without_tools() {
    let dir = tempfile::tempdir().unwrap();
    tiny(dir.path());
    let o = Command::new(env!("CARGO_BIN_EXE_grpo"))
        .args(["generate", "--model"])
        .arg(dir.path())
        .args(["--prompt", "hi", "--tools"])
        .arg(format!(
            "{}:calculator",
            repo().join("examples/agents/calculator.py").display()
        ))
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("ignores `tools`") && err.contains("chat_template"),
        "{err}"
    );
}

#[test]
fn a_tool_that_cannot_be_imported_stops_training_before_it_starts() {
    let dir = tempfile::tempdir().unwrap();
    tiny(&dir.path().join("model"));
    let o = Command::new(env!("CARGO_BIN_EXE_grpo"))
        .arg("train")
        .arg(format!("--model={}", dir.path().join("model").display()))
        .arg(format!("--output_dir={}", dir.path().join("out").display()))
        .args(["--max_steps=1", "--tools=no_such_module.calculator"])
        .arg(format!(
            "--chat_template={}",
            repo()
                .join("examples/templates/chatml_tools.jinja")
                .display()
        ))
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("tools") && err.contains("no_such_module"),
        "{err}"
    );
    assert!(!dir.path().join("out/checkpoint-1").exists());
}

#[test]
fn eval_with_a_config_that_has_tools_runs_episodes_and_reports_pass_at_k() {
    let dir = tempfile::tempdir().unwrap();
    tiny(&dir.path().join("model"));
    let cfg = dir.path().join("agent.toml");
    std::fs::write(
        &cfg,
        format!(
            "tools = [\"{}:calculator\"]\nchat_template = \"{}\"\n[task]\nops = [\"*\"]\neval_size = 3\n",
            repo().join("examples/agents/calculator.py").display(),
            repo().join("examples/templates/chatml_tools.jinja").display()
        ),
    )
    .unwrap();
    let out = dir.path().join("answers.jsonl");
    let o = Command::new(env!("CARGO_BIN_EXE_grpo"))
        .args(["eval", "--model"])
        .arg(dir.path().join("model"))
        .arg("--rewards-config")
        .arg(&cfg)
        .args([
            "--num-samples",
            "2",
            "--k",
            "1,2",
            "--max-new-tokens",
            "8",
            "--json",
            "--out",
        ])
        .arg(&out)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(report.to_string().contains("pass@2"), "{report}");
    // The prompts showed the tools.
    let rows = std::fs::read_to_string(&out).unwrap();
    assert_eq!(rows.lines().count(), 3, "{rows}");
    assert!(err.contains("agent: tools calculator"), "{err}");
}
