//! The package's callbacks as a run's [`grpo::train::Observer`]: each hook calls the same-named
//! method of the Python object (`grpo._trainer._Observer`), which updates `trainer.state` and
//! calls the user's `TrainerCallback`s. A true return asks the run to stop at the end of the
//! round (`control.should_training_stop`); an exception is kept, stops the run, and is raised
//! from `train()`.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use pyo3::prelude::*;

use crate::{keep_raised, Raised};

pub struct PyObserver {
    obj: Py<PyAny>,
    stop: Arc<AtomicBool>,
    raised: Raised,
}

impl PyObserver {
    pub fn new(obj: Py<PyAny>, stop: Arc<AtomicBool>, raised: Raised) -> Self {
        PyObserver { obj, stop, raised }
    }

    fn call<'py, A>(&self, py: Python<'py>, method: &str, args: A)
    where
        A: pyo3::call::PyCallArgs<'py>,
    {
        let out = self
            .obj
            .bind(py)
            .call_method1(method, args)
            .and_then(|r| r.is_truthy());
        match out {
            Ok(false) => {}
            Ok(true) => self.stop.store(true, Ordering::SeqCst),
            Err(e) => {
                keep_raised(&self.raised, e);
                self.stop.store(true, Ordering::SeqCst);
            }
        }
    }
}

impl grpo::train::Observer for PyObserver {
    fn on_train_begin(&self, total_steps: u64, step: u64) {
        Python::attach(|py| self.call(py, "on_train_begin", (total_steps, step)));
    }

    fn on_step_end(&self, step: u64) {
        Python::attach(|py| self.call(py, "on_step_end", (step,)));
    }

    fn on_log(&self, step: u64, metrics: &[(String, f64)]) {
        Python::attach(|py| self.call(py, "on_log", (step, metrics.to_vec())));
    }

    fn on_evaluate(&self, step: u64, metrics: &[(String, f64)]) {
        Python::attach(|py| self.call(py, "on_evaluate", (step, metrics.to_vec())));
    }

    fn on_save(&self, step: u64, dir: &Path) {
        let dir = dir.display().to_string();
        Python::attach(|py| self.call(py, "on_save", (step, dir)));
    }
}
