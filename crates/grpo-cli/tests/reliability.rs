//! Faults that long runs on shared machines meet, each reproduced on a tiny model through the
//! `grpo` binary: SIGKILL at random moments then `--resume` (bit-identical to an uninterrupted
//! run), SIGTERM/SIGINT preemption, a full disk during a checkpoint, NaN and Inf steps, and a
//! 300-step soak whose memory, open files and child processes must stay flat.
//!
//! Faults inside the process come from fail points (`GRPO_FAULTS`, see `grpo_models::faults`):
//! the process SIGKILLs itself at a named point, a write fails as on a full disk, or a step's
//! numbers go NaN. External kills are real `kill -9`s after a random delay.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};

#[path = "../../grpo/tests/support/tiny_llama.rs"]
mod support;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn tiny_model(dir: &Path) -> PathBuf {
    let m = dir.join("model");
    support::tiny_llama(&m, &fixtures());
    m
}

/// A run config: 6 steps of 2 prompts x 4 completions, a checkpoint every 2 steps, an eval every
/// 3, every completion logged; `extra` lines replace the keys they set and may add tables.
fn write_config(dir: &Path, model: &Path, out: &Path, extra: &str) -> PathBuf {
    let p = dir.join(format!(
        "{}.toml",
        out.file_name().unwrap().to_string_lossy()
    ));
    let base = format!(
        "model = \"{}\"\noutput_dir = \"{}\"\nmax_steps = 6\nnum_generations = 4\n\
         per_device_train_batch_size = 8\nmax_completion_length = 6\nlearning_rate = 1e-3\n\
         save_steps = 2\neval_steps = 3\neval_num_prompts = 2\nlog_completions = true\n\
         report_to = \"none\"\nthreads = 1\nseed = 5\n",
        model.display(),
        out.display()
    );
    let (top, tables) = extra.split_once("[[").map_or((extra, ""), |(a, b)| (a, b));
    let key = |l: &str| l.split('=').next().unwrap_or_default().trim().to_string();
    let given: Vec<String> = top.lines().map(key).collect();
    let mut text: String = base
        .lines()
        .filter(|l| !given.contains(&key(l)))
        .map(|l| format!("{l}\n"))
        .collect();
    text.push_str(top);
    text.push_str("\n[task]\ntrain_size = 16\neval_size = 4\n");
    if !tables.is_empty() {
        text.push_str(&format!("[[{tables}"));
    }
    std::fs::write(&p, text).unwrap();
    p
}

fn grpo(config: &Path, extra_args: &[&str], faults: Option<&str>) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_grpo"));
    c.args(["train", "--config", &config.display().to_string()])
        .args(extra_args)
        .env("RUST_LOG", "warn")
        .env_remove("GRPO_FAULTS")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(f) = faults {
        c.env("GRPO_FAULTS", f);
    }
    c
}

fn run(config: &Path, extra_args: &[&str], faults: Option<&str>) -> Output {
    grpo(config, extra_args, faults).output().unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn has_checkpoint(out: &Path) -> bool {
    std::fs::read_dir(out)
        .into_iter()
        .flatten()
        .flatten()
        .any(|e| e.file_name().to_string_lossy().starts_with("checkpoint-"))
}

/// A JSON-lines file's rows without the fields that differ between identical runs (wall
/// times, memory, throughput).
fn rows(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            if let Some(m) = v.as_object_mut() {
                m.retain(|k, _| {
                    !(k == "time"
                        || k.starts_with("time/")
                        || k.starts_with("memory/")
                        || k == "tokens_per_second")
                });
            }
            v
        })
        .collect()
}

/// Everything a finished run leaves that must not depend on how often it was killed.
fn assert_same_run(a: &Path, b: &Path, what: &str) {
    for f in ["metrics.jsonl", "completions.jsonl"] {
        assert_eq!(rows(&a.join(f)), rows(&b.join(f)), "{what}: {f}");
    }
    for step in [0, 3, 6] {
        let f = format!("eval/step-{step}.jsonl");
        assert_eq!(rows(&a.join(&f)), rows(&b.join(&f)), "{what}: {f}");
    }
    for f in [
        "model.safetensors",
        "optimizer.safetensors",
        "trainer_state.json",
    ] {
        let p = Path::new("checkpoint-6").join(f);
        assert!(
            std::fs::read(a.join(&p)).unwrap() == std::fs::read(b.join(&p)).unwrap(),
            "{what}: {} differs",
            p.display()
        );
    }
    let leftovers: Vec<String> = std::fs::read_dir(b)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".tmp") || n.starts_with(".old"))
        .collect();
    assert!(leftovers.is_empty(), "{what}: left {leftovers:?}");
}

/// Points where the process kills itself, and how often each is passed in a 6-step run.
const KILL_POINTS: &[(&str, u32)] = &[
    ("train.sampled", 6),
    ("train.scored", 6),
    ("update.micro_batch", 6),
    ("update.before_step", 6),
    ("checkpoint.model_written", 3),
    ("checkpoint.before_rename", 3),
];

/// SIGKILL at random moments (inside sampling, scoring, the update, a checkpoint write, or after
/// a random delay), then `--resume`, until the run is done: the result equals an uninterrupted
/// run's bit for bit. At least 20 kills; `GRPO_KILL_SEED` replays a sequence.
#[test]
fn kill_nine_anywhere_then_resume_is_bit_identical() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_model(tmp.path());
    let reference = tmp.path().join("reference");
    let cfg = write_config(tmp.path(), &model, &reference, "");
    let t0 = Instant::now();
    let o = run(&cfg, &[], None);
    assert!(o.status.success(), "{}", text(&o));
    let full_run = t0.elapsed();

    let seed: u64 = std::env::var("GRPO_KILL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("kill sequence seed {seed} (GRPO_KILL_SEED={seed} replays it)");
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let (mut kills, mut scenarios, mut resumes) = (Vec::new(), 0, 0);
    while kills.len() < 20 {
        scenarios += 1;
        let out = tmp.path().join(format!("killed-{scenarios}"));
        let cfg = write_config(tmp.path(), &model, &out, "");
        let mut attempts = 0;
        loop {
            attempts += 1;
            assert!(attempts < 60, "scenario {scenarios}: no end in sight");
            let resume = has_checkpoint(&out);
            let args: &[&str] = if resume { &["--resume"] } else { &[] };
            resumes += resume as usize;
            // Half the attempts die at a fail point, a third after a random delay, the rest
            // run to the end.
            let roll: f64 = rng.random();
            let (faults, delay) = if roll < 0.5 {
                let (point, passes) = KILL_POINTS[rng.random_range(0..KILL_POINTS.len())];
                let skip = rng.random_range(0..passes);
                (Some(format!("{point}={skip}*off->return(kill)")), None)
            } else if roll < 0.85 {
                let ms = rng.random_range(50..full_run.as_millis().max(100) as u64);
                (None, Some(Duration::from_millis(ms)))
            } else {
                (None, None)
            };
            let mut child = grpo(&cfg, args, faults.as_deref()).spawn().unwrap();
            if let Some(d) = delay {
                let start = Instant::now();
                while start.elapsed() < d {
                    if child.try_wait().unwrap().is_some() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                let _ = child.kill(); // SIGKILL
            }
            let o = child.wait_with_output().unwrap();
            use std::os::unix::process::ExitStatusExt;
            match o.status.signal() {
                Some(9) => kills.push(
                    faults
                        .clone()
                        .map(|f| f.split('=').next().unwrap_or_default().to_string())
                        .unwrap_or_else(|| "random delay".into()),
                ),
                Some(s) => panic!("signal {s}: {}", text(&o)),
                None => {
                    assert!(o.status.success(), "attempt {attempts}: {}", text(&o));
                    // A fault that was never reached, or a delay longer than the run.
                    if out.join("checkpoint-6").is_dir() {
                        break;
                    }
                }
            }
        }
        assert_same_run(&reference, &out, &format!("scenario {scenarios}"));
    }
    let mut by_kind = std::collections::BTreeMap::new();
    for k in &kills {
        *by_kind.entry(k.as_str()).or_insert(0) += 1;
    }
    eprintln!(
        "{} kills in {scenarios} runs, {resumes} resumes, every run bit-identical to the \
         uninterrupted one; kills by point: {by_kind:?}",
        kills.len()
    );
}

/// Wait until `path` has a line (the first logged step).
fn wait_for_line(path: &Path, child: &mut std::process::Child) {
    let t0 = Instant::now();
    while std::fs::read_to_string(path).map_or(true, |m| m.lines().count() < 2) {
        assert!(child.try_wait().unwrap().is_none(), "the run ended early");
        assert!(t0.elapsed().as_secs() < 120, "no step logged");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// SIGTERM (Slurm, Kubernetes) and SIGINT (Ctrl-C) finish the step, save a checkpoint and exit
/// 75 (EX_TEMPFAIL: not finished, requeue; issue 34 changed this from 0), or 0 with
/// `GRPO_PREEMPTED_EXIT_CODE=0`, and the run resumes from it; with `save_on_signal = false` they
/// end the process at once.
#[test]
fn sigterm_and_sigint_checkpoint_and_exit_75() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_model(tmp.path());
    for (sig, name) in [(libc::SIGTERM, "SIGTERM"), (libc::SIGINT, "SIGINT")] {
        let out = tmp.path().join(name);
        let cfg = write_config(
            tmp.path(),
            &model,
            &out,
            "max_steps = 100000\nsave_steps = 0\neval_steps = 0",
        );
        // SIGINT's run asks for a finished run's status.
        let mut cmd = grpo(&cfg, &[], None);
        if sig == libc::SIGINT {
            cmd.env("GRPO_PREEMPTED_EXIT_CODE", "0");
        }
        let mut child = cmd.spawn().unwrap();
        wait_for_line(&out.join("metrics.jsonl"), &mut child);
        let t0 = Instant::now();
        // SAFETY: a signal to our own child.
        unsafe { libc::kill(child.id() as i32, sig) };
        let o = child.wait_with_output().unwrap();
        let took = t0.elapsed();
        let want = if sig == libc::SIGINT { 0 } else { 75 };
        assert_eq!(o.status.code(), Some(want), "{name}: {}", text(&o));
        assert!(!text(&o).contains("error:"), "{name}: {}", text(&o));
        assert!(text(&o).contains("interrupted"), "{}", text(&o));
        let saved: Vec<_> = std::fs::read_dir(&out)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("checkpoint-"))
            .collect();
        assert_eq!(saved.len(), 1, "{name}: one checkpoint at the stop");
        eprintln!(
            "{name} to exit {want} with a checkpoint: {:.2} s",
            took.as_secs_f64()
        );
        assert!(took < Duration::from_secs(30), "{name}: {took:?}");
        // It resumes from there.
        let step: u64 = saved[0]
            .file_name()
            .to_string_lossy()
            .trim_start_matches("checkpoint-")
            .parse()
            .unwrap();
        let o = run(
            &cfg,
            &["--resume", &format!("--max_steps={}", step + 1)],
            None,
        );
        assert!(o.status.success(), "{name}: resume: {}", text(&o));
        assert!(out.join(format!("checkpoint-{}", step + 1)).is_dir());
    }
    // save_on_signal = false: the default action, no checkpoint.
    let out = tmp.path().join("no-save");
    let cfg = write_config(
        tmp.path(),
        &model,
        &out,
        "max_steps = 100000\nsave_steps = 0\neval_steps = 0\nsave_on_signal = false",
    );
    let mut child = grpo(&cfg, &[], None).spawn().unwrap();
    wait_for_line(&out.join("metrics.jsonl"), &mut child);
    // SAFETY: as above.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let o = child.wait_with_output().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(o.status.signal(), Some(libc::SIGTERM), "{}", text(&o));
    assert!(!has_checkpoint(&out));
}

/// A full disk while a checkpoint is written: a clear error naming the file and the last good
/// checkpoint, that checkpoint intact (the run resumes from it to the same end), the metrics
/// already written kept, no half-written directory left.
#[test]
fn a_full_disk_fails_the_checkpoint_and_keeps_the_last_one() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_model(tmp.path());
    let reference = tmp.path().join("reference");
    let o = run(&write_config(tmp.path(), &model, &reference, ""), &[], None);
    assert!(o.status.success(), "{}", text(&o));

    let out = tmp.path().join("full");
    let cfg = write_config(tmp.path(), &model, &out, "");
    let o = run(&cfg, &[], Some("write=return(tmp-checkpoint-4-)"));
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(
        t.contains("No space left on device") && t.contains("the last good checkpoint is"),
        "{t}"
    );
    assert!(t.contains("checkpoint-2"), "{t}");
    assert!(!t.contains("panicked"), "{t}");
    assert!(out.join("checkpoint-2").is_dir() && !out.join("checkpoint-4").exists());
    let steps: Vec<u64> = rows(&out.join("metrics.jsonl"))
        .iter()
        .map(|r| r["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, [0, 1, 2, 3, 4], "the metrics written are kept");
    let names: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(!names.iter().any(|n| n.starts_with(".tmp")), "{names:?}");
    // Space again: the run resumes from checkpoint-2 and ends as the uninterrupted one.
    let o = run(&cfg, &["--resume"], None);
    assert!(o.status.success(), "{}", text(&o));
    assert_same_run(&reference, &out, "after a full disk");
}

/// The optimizer-step metrics of each logged step.
fn metric(out: &Path, key: &str) -> Vec<f64> {
    rows(&out.join("metrics.jsonl"))
        .iter()
        .filter(|r| r["step"].as_u64().unwrap() > 0)
        .map(|r| r[key].as_f64().unwrap_or(f64::NAN))
        .collect()
}

/// A NaN in the gradient, the loss or the log-probs, or an infinite reward, at step 2: that
/// step's update is skipped (weights and AdamW moments exactly as after step 1), counted in
/// `skipped_steps`, and step 3 trains again. Always NaN: the run stops after `max_bad_steps`.
#[test]
fn nan_and_inf_steps_are_skipped_counted_and_stop_the_run_when_they_persist() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_model(tmp.path());
    for point in [
        "update.nan_grad",
        "update.nan_loss",
        "update.nan_logits",
        "rewards.inf",
    ] {
        let out = tmp.path().join(point);
        let cfg = write_config(
            tmp.path(),
            &model,
            &out,
            // A reward that differs within groups, so that every step has a gradient.
            "max_steps = 3\nsave_steps = 1\neval_steps = 0\nsave_total_limit = 5\n\
             [[rewards]]\nkind = \"format\"\npattern = '^\\S'\n",
        );
        let o = run(&cfg, &[], Some(&format!("{point}=1*off->1*return")));
        assert!(o.status.success(), "{point}: {}", text(&o));
        assert_eq!(metric(&out, "skipped_steps"), [0.0, 1.0, 1.0], "{point}");
        let bytes = |c: &str, f: &str| std::fs::read(out.join(c).join(f)).unwrap();
        for f in ["model.safetensors", "optimizer.safetensors"] {
            assert!(
                bytes("checkpoint-1", f) == bytes("checkpoint-2", f),
                "{point}: {f} changed in the skipped step"
            );
            assert!(
                bytes("checkpoint-2", f) != bytes("checkpoint-3", f),
                "{point}: step 3 trains"
            );
        }
        let state: serde_json::Value =
            serde_json::from_slice(&bytes("checkpoint-3", "trainer_state.json")).unwrap();
        assert_eq!(state["skipped_steps"], 1, "{point}");
        assert_eq!(state["optimizer_steps"], 2, "{point}: AdamW stepped twice");
    }
    let out = tmp.path().join("always");
    let cfg = write_config(
        tmp.path(),
        &model,
        &out,
        "max_steps = 10\nsave_steps = 0\neval_steps = 0\nmax_bad_steps = 2",
    );
    let o = run(&cfg, &[], Some("update.nan_loss=return"));
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(
        t.contains("2 steps in a row skipped") && t.contains("max_bad_steps"),
        "{t}"
    );
    assert!(!t.contains("panicked"), "{t}");
}

/// 300 steps with a scorer program and a checkpoint every 25: resident memory at the end within
/// 5% of step 50, open file descriptors and child processes constant, every step logging the
/// same number of lines. (The first checkpoint write raises the high-water mark once, by its
/// serialization buffers, which the allocator keeps for the next one; it comes before step 50.)
#[test]
fn a_300_step_soak_does_not_grow() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny_model(tmp.path());
    let out = tmp.path().join("soak");
    let scorer = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples/scorers/answer_scorer.py")
        .canonicalize()
        .unwrap();
    let cfg = write_config(
        tmp.path(),
        &model,
        &out,
        &format!(
            "max_steps = 300\nsave_steps = 25\nsave_total_limit = 1\neval_steps = 0\n\
             num_generations = 2\nper_device_train_batch_size = 4\nmax_completion_length = 4\n\
             [[rewards]]\nkind = \"command\"\ncommand = [\"python3\", \"{}\"]\n",
            scorer.display()
        ),
    );
    // Transparent huge pages are collapsed by the kernel in the background and move resident
    // memory in 2 MB steps at moments of its choosing, whatever the process does: they are off
    // for this run (the flag is inherited by the child), so that what is measured is grpo's.
    // SAFETY: sets a flag of this process; no memory is touched.
    unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) };
    let t0 = Instant::now();
    let o = run(&cfg, &[], None);
    assert!(o.status.success(), "{}", text(&o));
    let r = rows(&out.join("metrics.jsonl"));
    let at = |step: u64, k: &str| {
        r.iter()
            .find(|x| x["step"] == step)
            .and_then(|x| x[k].as_f64())
            .unwrap_or_else(|| panic!("no {k} at step {step}"))
    };
    // `rows` drops memory/*: read them from the file as written.
    let raw: Vec<serde_json::Value> = std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let mem = |step: u64, k: &str| {
        raw.iter()
            .find(|x| x["step"] == step)
            .and_then(|x| x[k].as_f64())
            .unwrap_or_else(|| panic!("no {k} at step {step}"))
    };
    let (rss50, rss300) = (mem(50, "memory/rss_gb"), mem(300, "memory/rss_gb"));
    let trend: Vec<String> = (1..=6)
        .map(|k| format!("{:.1}", mem(k * 50, "memory/rss_gb") * 1e3))
        .collect();
    eprintln!("soak: rss every 50 steps (MB): {}", trend.join(", "));
    let (fd50, fd300) = (mem(50, "memory/open_fds"), mem(300, "memory/open_fds"));
    let (ch50, ch300) = (
        mem(50, "memory/child_processes"),
        mem(300, "memory/child_processes"),
    );
    let mut per_step = vec![0usize; 301];
    for l in std::fs::read_to_string(out.join("completions.jsonl"))
        .unwrap()
        .lines()
    {
        let s = serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
            .as_u64()
            .unwrap();
        per_step[s as usize] += 1;
    }
    let per_step = &per_step[1..];
    eprintln!(
        "soak: 300 steps in {:.0} s; rss {:.1} MB at step 50, {:.1} MB at step 300 ({:+.2}%); \
         open fds {fd50} -> {fd300}; child processes {ch50} -> {ch300}; metrics lines {}; \
         completions per step {:?}",
        t0.elapsed().as_secs_f64(),
        rss50 * 1e3,
        rss300 * 1e3,
        (rss300 / rss50 - 1.0) * 100.0,
        r.len(),
        per_step
            .iter()
            .filter(|&&n| n > 0)
            .min()
            .zip(per_step.iter().max())
    );
    assert!(at(300, "step") == 300.0);
    assert!(rss300 <= rss50 * 1.05, "rss {rss50} -> {rss300}");
    assert_eq!(fd50, fd300, "open file descriptors");
    assert_eq!(ch50, ch300, "child processes");
    assert!(ch50 >= 1.0, "the scorer runs as a child");
    assert_eq!(r.len(), 300, "one metrics line per step");
    let logged: Vec<usize> = per_step.iter().copied().filter(|&n| n > 0).collect();
    assert!(logged.len() >= 30, "{per_step:?}");
    assert!(logged.iter().all(|&n| n == logged[0]), "{per_step:?}");
}
