//! Trackers against the real things: a live `mlflow server` (SQLite backend, started here on
//! 127.0.0.1), the `wandb` package in offline mode and `trackio`'s local store, each run read back.
//! They need a Python with `mlflow`, `wandb` and `trackio` (`GRPO_TEST_PYTHON`, else the peers'
//! venv, else `python3`); without
//! one they say so and pass, unless `GRPO_REQUIRE_TRACKERS=1` (set by `.ci/run`, which installs
//! them) makes that a failure.

use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use grpo::config::{Format, TrainConfig};
use grpo::train::{train, RunControl};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

#[path = "support/tiny_llama.rs"]
mod support;

/// A Python that imports mlflow and wandb, or None (then the test is skipped, unless required).
fn python() -> Option<String> {
    python_with("mlflow, wandb")
}

/// A Python that imports `modules`, or None (then the test is skipped, unless required).
fn python_with(modules: &str) -> Option<String> {
    let candidates = [
        std::env::var("GRPO_TEST_PYTHON").ok(),
        Some("/opt/peers/venv/bin/python".to_string()),
        Some("python3".to_string()),
    ];
    for p in candidates.into_iter().flatten() {
        let ok = Command::new(&p)
            .args(["-c", &format!("import {modules}")])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            return Some(p);
        }
    }
    let required = std::env::var("GRPO_REQUIRE_TRACKERS").is_ok_and(|v| v == "1");
    assert!(
        !required,
        "GRPO_REQUIRE_TRACKERS=1 but no Python with {modules} (set GRPO_TEST_PYTHON)"
    );
    eprintln!("skipped: no Python with {modules} (set GRPO_TEST_PYTHON)");
    None
}

fn config(model: &Path, out: &Path, extra: &str) -> TrainConfig {
    let text = format!(
        "model = \"{}\"\noutput_dir = \"{}\"\nnum_generations = 4\nper_device_train_batch_size = 4\n\
         max_completion_length = 6\nlearning_rate = 1e-3\nmax_steps = 4\nsave_steps = 2\n\
         threads = 2\neval_steps = 0\nrun_name = \"tiny-run\"\n{extra}\n\
         [task]\ntrain_size = 20\neval_size = 5\n",
        model.display(),
        out.display()
    );
    TrainConfig::from_str(&text, Format::Toml, "test", &[]).unwrap()
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The `mlflow server` process, in a process group of its own: it starts uvicorn and huey
/// workers that outlive a kill of the parent alone (a CI run left 20 of them spinning), so the
/// whole group is killed.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let group = format!("-{}", self.0.id());
        let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn get(url: &str) -> serde_json::Value {
    ureq::get(url).call().unwrap().into_json().unwrap()
}

fn metric_rows(out: &Path) -> usize {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter(|l| l.contains("\"loss\""))
        .count()
}

#[test]
fn mlflow_gets_params_every_step_and_the_files_and_a_resume_continues_its_run() {
    let Some(py) = python() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let port = free_port();
    let db = tmp.path().join("mlflow.db");
    let _server = Server(
        Command::new(&py)
            .args(["-m", "mlflow", "server", "--backend-store-uri"])
            .arg(format!("sqlite:///{}", db.display()))
            .args([
                "--host",
                "127.0.0.1",
                "--port",
                &port.to_string(),
                "--workers",
                "1",
            ])
            .current_dir(tmp.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .unwrap(),
    );
    let base = format!("http://127.0.0.1:{port}");
    let t0 = Instant::now();
    while ureq::get(&format!("{base}/health")).call().is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "mlflow server did not start"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    std::env::set_var("MLFLOW_TRACKING_URI", &base);
    std::env::set_var("MLFLOW_EXPERIMENT_NAME", "grpo-test");
    let model = tmp.path().join("model");
    support::tiny_llama(&model, &fixtures());

    // Stopped after 2 steps, resumed to 4: one MLflow run with every step.
    let out = tmp.path().join("run");
    let cfg = config(&model, &out, "report_to = [\"mlflow\", \"tensorboard\"]");
    let ctl = RunControl {
        max_rounds_this_run: Some(2),
        ..Default::default()
    };
    train(&cfg, &ctl).unwrap();
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("trackers.json")).unwrap()).unwrap();
    let run_id = state["mlflow"]["run_id"].as_str().unwrap().to_string();
    let resume = RunControl {
        resume: true,
        ..Default::default()
    };
    train(&cfg, &resume).unwrap();
    let state2: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("trackers.json")).unwrap()).unwrap();
    assert_eq!(
        state2["mlflow"]["run_id"],
        run_id.as_str(),
        "resume continues the run"
    );

    let run = get(&format!("{base}/api/2.0/mlflow/runs/get?run_id={run_id}"));
    assert_eq!(run["run"]["info"]["status"], "FINISHED");
    assert_eq!(run["run"]["info"]["run_name"], "tiny-run");
    let params = run["run"]["data"]["params"].as_array().unwrap();
    assert!(params
        .iter()
        .any(|p| p["key"] == "learning_rate" && p["value"] == "0.001"));
    let hist = get(&format!(
        "{base}/api/2.0/mlflow/metrics/get-history?run_id={run_id}&metric_key=loss"
    ));
    let mut steps: Vec<u64> = hist["metrics"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["step"].as_u64().unwrap())
        .collect();
    steps.sort_unstable();
    steps.dedup();
    assert_eq!(steps, vec![1, 2, 3, 4]);
    let arts = get(&format!(
        "{base}/api/2.0/mlflow/artifacts/list?run_id={run_id}"
    ));
    let names: Vec<&str> = arts["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["path"].as_str().unwrap())
        .collect();
    for f in ["config.toml", "metrics.jsonl", "completions.jsonl"] {
        assert!(names.contains(&f), "{names:?}");
    }
    // TensorBoard keeps working beside it.
    assert!(std::fs::read_dir(out.join("tb")).unwrap().count() >= 1);

    // A tracker that is down never loses the run: a warning, and every step in metrics.jsonl.
    std::env::set_var(
        "MLFLOW_TRACKING_URI",
        format!("http://127.0.0.1:{}", free_port()),
    );
    let down = tmp.path().join("down");
    train(
        &config(&model, &down, "report_to = \"mlflow\""),
        &RunControl::default(),
    )
    .unwrap();
    assert_eq!(metric_rows(&down), 4);
}

#[test]
fn wandb_offline_gets_the_config_every_step_and_a_completions_table() {
    let Some(py) = python() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let wandb_dir = tmp.path().join("wandb-dir");
    std::fs::create_dir_all(&wandb_dir).unwrap();
    std::env::set_var("GRPO_PYTHON", &py);
    std::env::set_var("WANDB_MODE", "offline");
    std::env::set_var("WANDB_DIR", &wandb_dir);
    std::env::set_var("WANDB_SILENT", "true");
    let model = tmp.path().join("model");
    support::tiny_llama(&model, &fixtures());
    let out = tmp.path().join("run");
    // The seeds' names: wandb_log, wandb_project, wandb_run_name.
    let cfg = config(
        &model,
        &out,
        "wandb_log = true\nwandb_project = \"grpo-tests\"\nlog_completions_steps = 1",
    );
    assert!(cfg.logging.report_to.contains(&"wandb".to_string()));
    train(&cfg, &RunControl::default()).unwrap();

    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/tools/read_wandb_offline.py");
    let o = Command::new(&py)
        .arg(&script)
        .arg(&wandb_dir)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let recs: Vec<serde_json::Value> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let run = recs.iter().find_map(|r| r.get("run")).unwrap();
    assert_eq!(run["project"], "grpo-tests");
    assert_eq!(run["name"], "tiny-run");
    let config = recs.iter().find_map(|r| r.get("config")).unwrap();
    assert!(config.get("learning_rate").is_some(), "{config}");
    let hist: Vec<&serde_json::Value> = recs.iter().filter_map(|r| r.get("history")).collect();
    let steps: Vec<u64> = hist
        .iter()
        .filter(|h| h.get("loss").is_some())
        .map(|h| h["_step"].as_u64().unwrap_or(0))
        .collect();
    assert_eq!(steps.len(), 4, "{hist:?}");
    assert!(hist.iter().any(|h| h
        .get("completions/_type")
        .is_some_and(|t| t == "table-file")));
}

#[test]
fn report_to_values_are_checked() {
    let e = TrainConfig::from_str("report_to = \"comet\"", Format::Toml, "t", &[])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("report_to") && e.contains("unknown value `comet`"),
        "{e}"
    );
    let c = TrainConfig::from_str("report_to = \"all\"", Format::Toml, "t", &[]).unwrap();
    assert_eq!(c.logging.report_to, ["mlflow", "tensorboard", "wandb"]);
    // Trackio is a tracker since it has a bridge (it was an error before).
    let c = TrainConfig::from_str("report_to = \"trackio\"", Format::Toml, "t", &[]).unwrap();
    assert_eq!(c.logging.report_to, ["trackio"]);
    let c = TrainConfig::from_str("report_to = \"none\"", Format::Toml, "t", &[]).unwrap();
    assert!(c.logging.report_to.is_empty());
}

#[test]
fn trackio_gets_every_step_and_a_resume_continues_its_run() {
    let Some(py) = python_with("trackio") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let trackio_dir = tmp.path().join("trackio");
    let model = tmp.path().join("model");
    support::tiny_llama(&model, &fixtures());
    let out = tmp.path().join("run");
    // Both runs in this process: the bridge inherits TRACKIO_DIR and GRPO_PYTHON.
    std::env::set_var("GRPO_PYTHON", &py);
    std::env::set_var("TRACKIO_DIR", &trackio_dir);
    let extra = "report_to = \"trackio\"\nproject = \"grpo-tests\"\nlog_completions_steps = 1";
    let mut cfg = config(&model, &out, extra);
    train(&cfg, &RunControl::default()).unwrap();
    // The resumed run goes on to step 6 (the same config, max_steps raised).
    cfg.run.max_steps = Some(6);
    train(
        &cfg,
        &RunControl {
            resume: true,
            ..Default::default()
        },
    )
    .unwrap();

    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/tools/read_trackio.py");
    let o = Command::new(&py)
        .arg(&script)
        .arg("grpo-tests")
        .env("TRACKIO_DIR", &trackio_dir)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let recs: Vec<serde_json::Value> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let runs = recs.iter().find_map(|r| r.get("runs")).unwrap();
    assert_eq!(runs, &serde_json::json!(["tiny-run"]), "one run, continued");
    let steps: Vec<u64> = recs
        .iter()
        .filter_map(|r| r.get("log"))
        .filter(|l| l.get("loss").is_some())
        .map(|l| l["step"].as_u64().unwrap_or(0))
        .collect();
    assert_eq!(steps, [1, 2, 3, 4, 5, 6], "{recs:?}");
    assert!(
        recs.iter()
            .filter_map(|r| r.get("log"))
            .any(|l| l.get("completions").is_some()),
        "a completions table"
    );
}
