//! Tests of the scorer program options: TRL-style function names, defaults, errors naming the key.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::Value;

use super::*;
use crate::rewards::table::Table;

#[test]
fn python_targets_read_as_trl_names_them() {
    for (f, want) in [
        ("my_rewards.correctness", "my_rewards:correctness"),
        ("pkg.sub.fn_2", "pkg.sub:fn_2"),
        ("path/to/file.py:score", "path/to/file.py:score"),
        ("pkg.module:score", "pkg.module:score"),
    ] {
        assert_eq!(python_target(f).unwrap(), want);
    }
    for bad in ["correctness", "file.py:", ":f", "m.2f", "a.b-c"] {
        assert!(python_target(bad).is_err(), "{bad}");
    }
}
use serde_json::Map;

fn table_of(json: &str) -> Map<String, Value> {
    serde_json::from_str(json).unwrap()
}

fn command_spec(json: &str) -> Result<CommandSpec> {
    let obj = table_of(json);
    CommandSpec::from_table(&Table::new(&obj, "rewards[3]".into(), CommandSpec::KEYS)?)
}

#[test]
fn command_options_and_defaults() {
    let s = command_spec(r#"{"kind": "command", "command": "python3  score.py --fast"}"#).unwrap();
    assert_eq!(s.command, ["python3", "score.py", "--fast"]);
    assert_eq!(s, CommandSpec::new(s.command.clone()));
    assert_eq!(s.timeout, Duration::from_secs(30));
    assert_eq!(
        (s.processes, s.max_in_flight, s.batch_size, s.max_restarts),
        (1, 64, 1, 5)
    );

    let s = command_spec(
        r#"{"kind": "command", "name": "judge", "weight": 2, "command": ["python3", "my score.py"],
            "timeout_s": 0.5, "processes": 2, "max_in_flight": 4, "batch_size": 8, "cwd": "/tmp",
            "env": {"A": "x", "N": 3}, "max_restarts": 0, "cpu_seconds": 10, "memory_mb": 512,
            "no_network": true}"#,
    )
    .unwrap();
    assert_eq!(s.command, ["python3", "my score.py"]);
    assert_eq!(s.timeout, Duration::from_millis(500));
    assert_eq!((s.processes, s.max_in_flight, s.batch_size), (2, 4, 8));
    assert_eq!(s.cwd, Some(PathBuf::from("/tmp")));
    assert_eq!(s.env, [("A".into(), "x".into()), ("N".into(), "3".into())]);
    assert_eq!(
        (s.max_restarts, s.cpu_seconds, s.memory_mb),
        (0, Some(10), Some(512))
    );
    assert!(s.no_network);
}

/// The user's own reward functions see their Python environment (issue 57); a third-party
/// scorer program only what it names.
#[test]
fn python_rewards_inherit_the_python_environment_and_programs_do_not() {
    let obj = table_of(
        r#"{"kind": "python", "function": "my_rewards.correct",
            "inherit_env": ["HF_HOME", "PYTHONPATH"]}"#,
    );
    let t = Table::new(&obj, "rewards[0]".into(), CommandSpec::PYTHON_KEYS).unwrap();
    let s = CommandSpec::from_python_table(&t).unwrap();
    assert_eq!(
        s.inherit_env,
        ["PYTHONPATH", "VIRTUAL_ENV", "CONDA_PREFIX", "HF_HOME"]
    );
    let s = command_spec(r#"{"kind": "command", "command": "python3 score.py"}"#).unwrap();
    assert!(s.inherit_env.is_empty());
}

#[test]
fn command_option_errors_name_the_key() {
    for (json, key, says) in [
        (
            r#"{"kind": "command", "comand": "x"}"#,
            "rewards[3].comand",
            "did you mean `command`",
        ),
        (r#"{"kind": "command"}"#, "rewards[3].command", "missing"),
        (
            r#"{"kind": "command", "command": ""}"#,
            "rewards[3].command",
            "empty",
        ),
        (
            r#"{"kind": "command", "command": []}"#,
            "rewards[3].command",
            "empty",
        ),
        (
            r#"{"kind": "command", "command": 5}"#,
            "rewards[3].command",
            "list of strings",
        ),
        (
            r#"{"kind": "command", "command": ["a", 1]}"#,
            "rewards[3].command",
            "expected strings",
        ),
        (
            r#"{"kind": "command", "command": "a", "timeout_s": "1"}"#,
            "rewards[3].timeout_s",
            "number",
        ),
        (
            r#"{"kind": "command", "command": "a", "timeout_s": 0}"#,
            "rewards[3].timeout_s",
            "> 0",
        ),
        (
            r#"{"kind": "command", "command": "a", "processes": 0}"#,
            "rewards[3].processes",
            "at least 1",
        ),
        (
            r#"{"kind": "command", "command": "a", "batch_size": 1.5}"#,
            "rewards[3].batch_size",
            "whole number",
        ),
        (
            r#"{"kind": "command", "command": "a", "max_in_flight": -1}"#,
            "rewards[3].max_in_flight",
            "whole number",
        ),
        (
            r#"{"kind": "command", "command": "a", "env": ["A=1"]}"#,
            "rewards[3].env",
            "table of strings",
        ),
        (
            r#"{"kind": "command", "command": "a", "env": {"A": [1]}}"#,
            "rewards[3].env.A",
            "string",
        ),
        (
            r#"{"kind": "command", "command": "a", "cpu_seconds": 0}"#,
            "rewards[3].cpu_seconds",
            "at least 1",
        ),
        (
            r#"{"kind": "command", "command": "a", "no_network": "yes"}"#,
            "rewards[3].no_network",
            "true or false",
        ),
        (
            r#"{"kind": "command", "command": "a", "cwd": 1}"#,
            "rewards[3].cwd",
            "string",
        ),
    ] {
        let e = command_spec(json).unwrap_err().to_string();
        assert!(
            e.contains(&format!("`{key}`")) && e.contains(says),
            "{json}: {e}"
        );
    }
}

#[test]
fn scorers_can_be_shared_between_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<CommandScorer>();
    send_sync::<HttpScorer>();
}
