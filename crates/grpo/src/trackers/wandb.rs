//! Weights & Biases through the user's own `wandb` installation: grpo starts a small bridge
//! (`wandb_bridge.py`, run by `GRPO_PYTHON`, else `python3`) and feeds it JSON lines, as it feeds
//! command scorers. W&B's own settings apply (`WANDB_PROJECT`, `WANDB_MODE=offline`,
//! `WANDB_DIR`, `WANDB_API_KEY`, ...); `wandb_project` and `run_name` in the config name the
//! project and run. The run id is kept in `trackers.json`, so `--resume` continues the same run.
//! Each logged step's sampled completions go with it as a table (`completions`).

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};

use serde_json::{json, Value};

use super::{read_state, write_state, RunInfo, Tracker};
use crate::{Error, Result};

const BRIDGE: &str = include_str!("wandb_bridge.py");

/// The bridge process of one W&B run.
pub struct WandbTracker {
    child: Child,
    stdin: ChildStdin,
}

/// A new run id: 8 characters of [a-z0-9], from the clock and the process.
fn new_id() -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut x = crate::seeding::mix_seed(t, u64::from(std::process::id()));
    (0..8)
        .map(|_| {
            let c = b"abcdefghijklmnopqrstuvwxyz0123456789"[(x % 36) as usize] as char;
            x /= 36;
            c
        })
        .collect()
}

impl WandbTracker {
    pub fn start(info: &RunInfo) -> Result<Self> {
        let python = std::env::var("GRPO_PYTHON").unwrap_or_else(|_| "python3".into());
        let mut child = Command::new(&python)
            .arg("-u")
            .arg("-c")
            .arg(BRIDGE)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| {
                let why = format!(
                    "cannot start `{python}` for the W&B bridge ({e}): install Python with \
                     wandb, or set GRPO_PYTHON"
                );
                Error::tracker("wandb", why)
            })?;
        let (Some(mut stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(Error::tracker("wandb", "the W&B bridge has no pipes"));
        };
        let recorded = read_state(&info.output_dir, "wandb");
        let id = match (info.resume, recorded["id"].as_str()) {
            (true, Some(id)) => id.to_string(),
            _ => new_id(),
        };
        let project = info
            .wandb_project
            .clone()
            .or_else(|| std::env::var("WANDB_PROJECT").ok())
            .unwrap_or_else(|| "grpo".into());
        let init = json!({"init": {"project": project, "name": info.run_name, "id": id,
                                    "config": info.config}});
        writeln!(stdin, "{init}")
            .map_err(|e| Error::tracker("wandb", format!("the W&B bridge stopped: {e}")))?;
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .map_err(|e| Error::tracker("wandb", format!("the W&B bridge stopped: {e}")))?;
        let answer: Value = serde_json::from_str(line.trim()).unwrap_or(Value::Null);
        if let Some(err) = answer["error"].as_str() {
            let _ = child.wait();
            return Err(Error::tracker("wandb", err));
        }
        if answer["ok"] != Value::Bool(true) {
            let _ = child.kill();
            return Err(Error::tracker(
                "wandb",
                format!("the W&B bridge did not start (answer {:?})", line.trim()),
            ));
        }
        write_state(
            &info.output_dir,
            "wandb",
            json!({"id": id, "project": project}),
        )?;
        Ok(WandbTracker { child, stdin })
    }

    fn send(&mut self, msg: &Value) -> Result<()> {
        writeln!(self.stdin, "{msg}").map_err(|e| {
            Error::tracker(
                "wandb",
                format!("the W&B bridge stopped ({e}); its error is printed above"),
            )
        })
    }
}

impl Tracker for WandbTracker {
    fn name(&self) -> &'static str {
        "wandb"
    }

    fn log(&mut self, step: u64, metrics: &[(String, f64)]) -> Result<()> {
        let m: serde_json::Map<String, Value> = metrics
            .iter()
            .filter(|(_, v)| v.is_finite())
            .map(|(k, v)| (k.clone(), json!(v)))
            .collect();
        self.send(&json!({"log": m, "step": step}))
    }

    fn log_completion(&mut self, row: &Value) -> Result<()> {
        self.send(&json!({ "row": row }))
    }

    fn finish(&mut self, _artifacts: &[std::path::PathBuf]) -> Result<()> {
        self.send(&json!({"finish": 0}))?;
        let status = self
            .child
            .wait()
            .map_err(|e| Error::tracker("wandb", format!("the W&B bridge: {e}")))?;
        match status.success() {
            true => Ok(()),
            false => Err(Error::tracker(
                "wandb",
                format!("the W&B bridge ended with {status}; its error is printed above"),
            )),
        }
    }
}

impl Drop for WandbTracker {
    fn drop(&mut self) {
        // A run that ends without `finish` (an error): the bridge sees its input close.
        let _ = self.child.try_wait();
    }
}
