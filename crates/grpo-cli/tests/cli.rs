//! The `grpo` binary as a user runs it: the default model (fetched once into the cache), JSON
//! output, stop strings, and clear errors with a non-zero exit code.

use std::path::PathBuf;
use std::process::{Command, Output};

#[path = "cli/config.rs"]
mod config;
#[path = "cli/eval.rs"]
mod eval;
#[path = "cli/export.rs"]
mod export;
#[path = "cli/fill_in.rs"]
mod fill_in;
#[path = "cli/generate.rs"]
mod generate;
#[path = "cli/train.rs"]
mod train;

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

#[path = "../../grpo/tests/support/tiny_llama.rs"]
mod support;

fn tiny_model(dir: &std::path::Path) {
    support::tiny_llama(dir, std::path::Path::new(&fixture("")));
}

/// No Python here: a skip, or under `GRPO_REQUIRE_PYTHON=1` (set by `.ci/run`) a failure.
fn no_python(why: &str) {
    assert!(
        std::env::var("GRPO_REQUIRE_PYTHON").map_or(true, |v| v != "1"),
        "GRPO_REQUIRE_PYTHON=1 but {why}"
    );
    eprintln!("skipped: {why}");
}
