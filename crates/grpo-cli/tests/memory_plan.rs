//! `grpo plan` against measured peaks: for three CPU shapes, the plan's peak (`--format json`)
//! and the peak resident set of `grpo train` for one step with the same arguments, read from
//! that child's own rusage (`wait4`), so the shapes can share one test binary.
//!
//! The shapes keep the planned terms well above the process's fixed part (peaks of 0.5-0.65
//! GB) and run in a few seconds each: SmolLM2's 49,152-token vocabulary on
//! - a wide model (hidden 256, 4 layers) trained in full with a KL to the reference,
//! - a deep one (hidden 128, 16 layers) trained in full without a reference,
//! - the wide one with LoRA (r = 16, every projection) and a KL.
//!
//! Each is one micro-batch of 16 completions of 16 tokens in one pass, f32 on the fused CPU
//! kernels. The plan must be within 10% of the measured peak.

use std::path::Path;
use std::process::{Command, Stdio};

#[path = "../../grpo/tests/support/tiny_llama.rs"]
mod support;

#[path = "support/plan_shapes.rs"]
mod plan_shapes;
use plan_shapes::{COMMON, DEEP, WIDE};

/// Runs `grpo` with `args` to the end; returns its peak resident set in bytes (this child's
/// alone) and its stderr.
fn run_measured(args: &[String], dir: &Path) -> (u64, String) {
    let bin = env!("CARGO_BIN_EXE_grpo");
    let err_path = dir.join("stderr.txt");
    let err = std::fs::File::create(&err_path).unwrap();
    // Reaped by `wait4` below, which also returns this child's own rusage.
    #[allow(clippy::zombie_processes)]
    let child = Command::new(bin)
        .args(args)
        .stdout(Stdio::null())
        .stderr(err)
        .spawn()
        .unwrap();
    let mut status = 0;
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: waits for our own child; `status` and `usage` are valid to write into.
    let pid = unsafe { libc::wait4(child.id() as libc::pid_t, &mut status, 0, &mut usage) };
    assert_eq!(pid, child.id() as libc::pid_t, "wait4 failed");
    let stderr = std::fs::read_to_string(&err_path).unwrap_or_default();
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "grpo {args:?} failed: {stderr}"
    );
    (usage.ru_maxrss as u64 * 1024, stderr) // kilobytes on Linux
}

/// The plan's peak in bytes for `args`.
fn planned(args: &[String]) -> serde_json::Value {
    let o = Command::new(env!("CARGO_BIN_EXE_grpo"))
        .arg("plan")
        .args(args)
        .arg("--format=json")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// Plans and runs one shape; returns (planned, measured) peaks in MB.
fn check(name: &str, shape: support::Shape, extra: &[&str], tmp: &Path) -> (f64, f64) {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    let model = tmp.join(format!("model-{name}"));
    support::random_llama(&model, &fixtures, shape);
    let mut args: Vec<String> = COMMON.iter().chain(extra).map(|s| s.to_string()).collect();
    args.push(format!("--model={}", model.display()));
    let plan = planned(&args);
    assert_eq!(plan["pass"]["passes"], 1, "{name}: {plan}");
    let out = tmp.join(format!("run-{name}"));
    let mut train: Vec<String> = vec!["train".into(), "--max_steps=1".into()];
    train.extend(args);
    train.extend(
        [
            "--save_strategy=no",
            "--eval_steps=0",
            "--report_to=none",
            "--threads=2",
        ]
        .map(String::from),
    );
    train.push(format!("--output_dir={}", out.display()));
    let (peak, stderr) = run_measured(&train, tmp);
    // The random model writes every completion to its full length, as the plan assumes.
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap_or_default();
    assert!(
        metrics.contains("\"completions/mean_length\":16.0"),
        "{name}: {metrics}\n{stderr}"
    );
    let planned = plan["peak_bytes"].as_f64().unwrap() / 1e6;
    (planned, peak as f64 / 1e6)
}

#[test]
fn the_plan_is_within_ten_percent_of_measured_cpu_peaks() {
    let tmp = tempfile::tempdir().unwrap();
    let lora = [
        "--beta=0.04",
        "--lora.r=16",
        "--lora.target_modules=all-linear",
    ];
    let cases: [(&str, support::Shape, &[&str]); 3] = [
        ("wide-full-kl", WIDE, &["--beta=0.04"]),
        ("deep-full", DEEP, &["--beta=0"]),
        ("wide-lora-kl", WIDE, &lora),
    ];
    let mut results = Vec::new();
    for (name, shape, extra) in cases {
        let (plan, peak) = check(name, shape, extra, tmp.path());
        let off = 100.0 * (plan / peak - 1.0);
        eprintln!("{name}: planned {plan:.0} MB, measured {peak:.0} MB ({off:+.1}%)");
        results.push((name, off));
    }
    for (name, off) in &results {
        assert!(
            off.abs() <= 10.0,
            "{name}: the plan is {off:+.1}% off: {results:?}"
        );
    }
}
