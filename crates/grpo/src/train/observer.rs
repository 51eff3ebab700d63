//! What a program running training in its own process hears of the run: the Python package's
//! callbacks (`on_step_end`, `on_log`, `on_evaluate`, `on_save`). Calls come from the thread that
//! runs the loop, on the main rank: `on_train_begin` once set up; then in this order within a round: `on_step_end` once per optimizer
//! step, then `on_log` (when the round is logged, with its evaluation's metrics), `on_evaluate`
//! (when it evaluated), `on_save` (when it saved a checkpoint). To stop the run, an observer sets
//! [`super::RunControl::stop`]: the round ends with a checkpoint.

use std::path::Path;

/// Hooks into a run; each does nothing unless implemented.
pub trait Observer: Send + Sync {
    /// The run is set up: it trains to `total_steps` optimizer steps, from `step` (a resumed
    /// run's).
    fn on_train_begin(&self, _total_steps: u64, _step: u64) {}
    /// Optimizer step `step` (counted from 1) is done.
    fn on_step_end(&self, _step: u64) {}
    /// A logged row of metrics (what `metrics.jsonl` gets) at `step`.
    fn on_log(&self, _step: u64, _metrics: &[(String, f64)]) {}
    /// Evaluation on the held-out prompts at `step` (0: before training).
    fn on_evaluate(&self, _step: u64, _metrics: &[(String, f64)]) {}
    /// A checkpoint of `step` was written into `dir`.
    fn on_save(&self, _step: u64, _dir: &Path) {}
}
