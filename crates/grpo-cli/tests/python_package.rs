//! The Python package (crates/grpo-py) from `cargo test`: built with maturin into the test
//! Python's virtual environment, then its pytest suite (crates/grpo-py/tests), which compares
//! GRPOTrainer runs with this crate's `grpo` binary. Needs a Python in a virtual environment
//! with `pytest`, `maturin` and `datasets` (`GRPO_TEST_PYTHON`, else `python3`); without one the
//! test says so and passes, unless `GRPO_REQUIRE_PYTHON_PACKAGE=1` (set by `.ci/run`, which
//! installs them into .ci/venv).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

const MODULES: &str = "pytest, maturin, datasets";

/// The test Python and its environment's prefix, or None (skipped unless required).
fn python() -> Option<(String, PathBuf)> {
    let required = std::env::var("GRPO_REQUIRE_PYTHON_PACKAGE").is_ok_and(|v| v == "1");
    let candidates = [
        std::env::var("GRPO_TEST_PYTHON").ok(),
        Some("python3".into()),
    ];
    for p in candidates.into_iter().flatten() {
        let probe = format!(
            "import sys, {MODULES}; print(sys.prefix if sys.prefix != sys.base_prefix else '')"
        );
        let out = Command::new(&p)
            .args(["-c", &probe])
            .stderr(Stdio::null())
            .output();
        let Ok(out) = out else { continue };
        let prefix = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if out.status.success() && !prefix.is_empty() {
            return Some((p, PathBuf::from(prefix)));
        }
    }
    assert!(
        !required,
        "GRPO_REQUIRE_PYTHON_PACKAGE=1 but no Python in a virtual environment with {MODULES} \
         (set GRPO_TEST_PYTHON; .ci/run installs them into .ci/venv)"
    );
    eprintln!("SKIPPED: no Python in a virtual environment with {MODULES} (set GRPO_TEST_PYTHON)");
    None
}

#[test]
fn the_python_packages_tests_pass() {
    let Some((python, venv)) = python() else {
        return;
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    // The target directory this test was built in: cargo holds no lock on it while tests run, and
    // grpo-py resolves its dependencies as this build did (its Cargo.toml says how), so maturin
    // compiles only pyo3 and the extension module.
    let target = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("CARGO_TARGET_TMPDIR is inside the target directory");
    let mut maturin = Command::new(&python);
    maturin
        .args(["-m", "maturin", "develop", "-q", "-m"])
        .arg(root.join("crates/grpo-py/Cargo.toml"));
    // Without the variables cargo set for this test (CARGO_MANIFEST_DIR, CARGO_PKG_NAME, ...):
    // build scripts that watch them (ring's) would take them for a change and build again, here
    // and in the next build of the test suite. The user's own (CARGO_HOME, CARGO_NET_OFFLINE, ...)
    // stay.
    for (key, _) in std::env::vars_os() {
        if key.to_str().is_some_and(set_by_cargo_test) {
            maturin.env_remove(key);
        }
    }
    let built = maturin
        .env("VIRTUAL_ENV", &venv)
        .env("CARGO_TARGET_DIR", target)
        .status()
        .expect("run maturin");
    assert!(built.success(), "maturin could not build crates/grpo-py");
    let tests = Command::new(&python)
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
        .arg(root.join("crates/grpo-py/tests"))
        .env("GRPO_BIN", env!("CARGO_BIN_EXE_grpo"))
        .env("GRPO_REQUIRE_PYTHON_PACKAGE", "1")
        .status()
        .expect("run pytest");
    assert!(
        tests.success(),
        "the Python package's tests failed (output above)"
    );
}

/// Whether cargo sets the environment variable `key` for the test processes it runs.
fn set_by_cargo_test(key: &str) -> bool {
    const SET: [&str; 7] = [
        "CARGO_MANIFEST_DIR",
        "CARGO_MANIFEST_PATH",
        "CARGO_MANIFEST_LINKS",
        "CARGO_CRATE_NAME",
        "CARGO_PRIMARY_PACKAGE",
        "CARGO_TARGET_TMPDIR",
        "CARGO_RUSTC_CURRENT_DIR",
    ];
    key.starts_with("CARGO_PKG_") || key.starts_with("CARGO_BIN_") || SET.contains(&key)
}
