//! Experiment trackers (`report_to`): besides `metrics.jsonl` (always written) and TensorBoard
//! (`tensorboard`), a run's config, every logged step's metrics and its sampled completions go
//! to MLflow (`mlflow`: its REST API at `MLFLOW_TRACKING_URI`, see [`mlflow`]), Weights &
//! Biases (`wandb`) and Trackio (`trackio`): the user's own `wandb` / `trackio` package, fed JSON
//! lines by a small bridge process, see [`bridge`].
//!
//! A tracker never costs the run: one that cannot start or fails later is a warning saying how to
//! fix it, and the run goes on without it. The ids of a run's tracker runs are kept in
//! `output_dir/trackers.json`, so `--resume` continues the same MLflow / W&B run.

pub mod bridge;
pub mod mlflow;

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::{Error, Result};

/// What trackers are told about a run when it starts.
#[derive(Debug, Clone)]
pub struct RunInfo {
    pub output_dir: PathBuf,
    /// `run_name` (default: the output directory's name).
    pub run_name: String,
    /// Every resolved config key and its value.
    pub config: serde_json::Map<String, Value>,
    /// A resumed run: continue the tracker runs recorded in `trackers.json`.
    pub resume: bool,
    /// `wandb_project` (else `WANDB_PROJECT`, else "grpo").
    pub wandb_project: Option<String>,
    /// HF's `project`: the Trackio project ("huggingface" unless set).
    pub project: String,
}

/// One tracker.
pub trait Tracker {
    fn name(&self) -> &'static str;
    /// One logged step's metrics (non-finite values are skipped).
    fn log(&mut self, step: u64, metrics: &[(String, f64)]) -> Result<()>;
    /// A sampled completion (a row of `completions.jsonl`), for trackers with tables.
    fn log_completion(&mut self, _row: &Value) -> Result<()> {
        Ok(())
    }
    /// The run is over: files to keep with it, then close.
    fn finish(&mut self, artifacts: &[PathBuf]) -> Result<()>;
}

/// The trackers of a run; a failing one is dropped with a warning.
#[derive(Default)]
pub struct Trackers {
    list: Vec<Box<dyn Tracker>>,
}

impl Trackers {
    /// Starts the trackers `report_to` names (`tensorboard`, `jsonl` and `none` are not
    /// trackers here). A tracker that cannot start is a warning.
    pub fn open(report_to: &[String], info: &RunInfo) -> Trackers {
        let mut list: Vec<Box<dyn Tracker>> = Vec::new();
        for kind in report_to {
            let started: Result<Box<dyn Tracker>> = match kind.as_str() {
                "mlflow" => mlflow::MlflowTracker::start(info).map(|t| Box::new(t) as _),
                "wandb" => bridge::BridgeTracker::start(bridge::Library::Wandb, info)
                    .map(|t| Box::new(t) as _),
                "trackio" => bridge::BridgeTracker::start(bridge::Library::Trackio, info)
                    .map(|t| Box::new(t) as _),
                _ => continue,
            };
            match started {
                Ok(t) => {
                    tracing::info!("report_to {kind}: logging this run");
                    list.push(t);
                }
                Err(e) => tracing::warn!(
                    "report_to {kind}: not logging to it ({e}); metrics.jsonl has every step"
                ),
            }
        }
        Trackers { list }
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    fn each(&mut self, what: &str, f: &mut dyn FnMut(&mut dyn Tracker) -> Result<()>) {
        self.list.retain_mut(|t| match f(t.as_mut()) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(
                    "report_to {}: {what} failed ({e}); the run goes on without it, \
                     metrics.jsonl has every step",
                    t.name()
                );
                false
            }
        });
    }

    pub fn log(&mut self, step: u64, metrics: &[(String, f64)]) {
        self.each("logging metrics", &mut |t| t.log(step, metrics));
    }

    pub fn log_completion(&mut self, row: &Value) {
        self.each("logging a completion", &mut |t| t.log_completion(row));
    }

    pub fn finish(&mut self, artifacts: &[PathBuf]) {
        self.each("finishing", &mut |t| t.finish(artifacts));
        self.list.clear();
    }
}

/// `output_dir/trackers.json`: the tracker runs of this output directory.
pub fn state_path(output_dir: &Path) -> PathBuf {
    output_dir.join("trackers.json")
}

/// The entry `key` of `trackers.json` (null when absent or unreadable).
pub fn read_state(output_dir: &Path, key: &str) -> Value {
    std::fs::read_to_string(state_path(output_dir))
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .and_then(|v| v.get(key).cloned())
        .unwrap_or(Value::Null)
}

/// Sets the entry `key` of `trackers.json` (written to a temporary file, then renamed).
pub fn write_state(output_dir: &Path, key: &str, value: Value) -> Result<()> {
    let path = state_path(output_dir);
    let mut all = std::fs::read_to_string(&path)
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .filter(Value::is_object)
        .unwrap_or_else(|| Value::Object(Default::default()));
    all[key] = value;
    let tmp = path.with_extension("json.tmp");
    grpo_models::files::write_file(&tmp, all.to_string().as_bytes())?;
    std::fs::rename(&tmp, &path).map_err(|e| Error::file(&path, format!("cannot write: {e}")))
}

/// Sends `file` (the run report) to the trackers of the run in `output_dir` that keep files.
/// A failure is a warning.
pub fn upload_artifact(output_dir: &Path, file: &Path) {
    if let Err(e) = mlflow::upload_to_recorded_run(output_dir, file) {
        tracing::warn!("report_to mlflow: cannot upload {} ({e})", file.display());
    }
}
