//! Runs the current test binary again under other kernel settings (`GRPO_KERNELS`, `GRPO_ISA`),
//! so that the golden tests of one file also pin the portable path (the candle ops a GPU runs)
//! and each CPU instruction-set variant. The rerun is marked by `GRPO_TEST_RERUN`, in which the
//! calling test returns at once.

/// Whether this process is such a rerun.
pub fn is_rerun() -> bool {
    std::env::var_os("GRPO_TEST_RERUN").is_some()
}

/// Runs every test of this binary again with `env` set (nothing when this is a rerun, or when
/// `env` asks for an instruction set above what the CPU runs); panics with the output unless
/// the rerun passes and runs at least `min_tests` tests.
pub fn rerun_with(env: &[(&str, &str)], min_tests: usize) {
    rerun_only(env, &[], min_tests)
}

/// [`rerun_with`] for the tests whose names contain one of `filters` (all when empty).
pub fn rerun_only(env: &[(&str, &str)], filters: &[&str], min_tests: usize) {
    if is_rerun() {
        return;
    }
    if let Some((_, isa)) = env.iter().find(|(k, _)| *k == "GRPO_ISA") {
        let want = grpo_models::kernels::Isa::parse(isa).unwrap().unwrap();
        if want.usable() != want {
            eprintln!("GRPO_ISA={isa}: this CPU does not run it; rerun skipped");
            return;
        }
    }
    let exe = std::env::current_exe().unwrap();
    let mut cmd = std::process::Command::new(&exe);
    cmd.env("GRPO_TEST_RERUN", "1")
        .arg("--test-threads=2")
        .args(filters);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let t = std::time::Instant::now();
    let out = cmd.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let passed = text
        .lines()
        .find_map(|l| l.strip_prefix("test result: ok. "))
        .and_then(|l| l.split(' ').next()?.parse::<usize>().ok());
    assert!(
        out.status.success() && passed.is_some_and(|n| n >= min_tests),
        "rerun with {env:?} failed:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!(
        "rerun with {env:?}: {} tests passed in {:.1} s",
        passed.unwrap_or(0),
        t.elapsed().as_secs_f64()
    );
}
