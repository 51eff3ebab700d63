//! Weights & Biases and Trackio (HF's local-first tracker) through the user's own `wandb` /
//! `trackio` installation: grpo starts a small bridge (`bridge.py`, run by `GRPO_PYTHON`, else
//! `python3`) and feeds it JSON lines, as it feeds command scorers. The libraries' own settings
//! apply (`WANDB_PROJECT`, `WANDB_MODE=offline`, `WANDB_DIR`, `WANDB_API_KEY`, ...;
//! `TRACKIO_DIR`); `wandb_project` (W&B), `project` (Trackio, HF's key) and `run_name` in the
//! config name the project and run. The run's id (Trackio: its name) is kept in `trackers.json`,
//! so `--resume` continues the same run. Each logged step's sampled completions go with it as a
//! table (`completions`); an agent's episode has its messages there as JSON (`messages`) and as
//! text turn by turn, with roles and tool calls (`episode`).

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};

use serde_json::{json, Value};

use super::{read_state, write_state, RunInfo, Tracker};
use crate::{Error, Result};

const BRIDGE: &str = include_str!("bridge.py");

/// The Python package a bridge drives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Library {
    Wandb,
    Trackio,
}

impl Library {
    /// The `report_to` name, the package's and the `trackers.json` entry's.
    pub fn name(self) -> &'static str {
        match self {
            Library::Wandb => "wandb",
            Library::Trackio => "trackio",
        }
    }

    fn shown(self) -> &'static str {
        match self {
            Library::Wandb => "W&B",
            Library::Trackio => "Trackio",
        }
    }
}

/// The bridge process of one W&B or Trackio run.
pub struct BridgeTracker {
    library: Library,
    child: Child,
    stdin: ChildStdin,
}

/// A new run id: 8 characters of [a-z0-9], from the clock and the process.
fn new_id() -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut x = grpo_models::seeding::mix_seed(t, u64::from(std::process::id()));
    (0..8)
        .map(|_| {
            let c = b"abcdefghijklmnopqrstuvwxyz0123456789"[(x % 36) as usize] as char;
            x /= 36;
            c
        })
        .collect()
}

impl BridgeTracker {
    pub fn start(library: Library, info: &RunInfo) -> Result<Self> {
        let (name, shown) = (library.name(), library.shown());
        let python = std::env::var("GRPO_PYTHON").unwrap_or_else(|_| "python3".into());
        let mut child = Command::new(&python)
            .arg("-u")
            .arg("-c")
            .arg(BRIDGE)
            .arg(name)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| {
                let why = format!(
                    "cannot start `{python}` for the {shown} bridge ({e}): install Python with \
                     {name}, or set GRPO_PYTHON"
                );
                Error::tracker(name, why)
            })?;
        let (Some(mut stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(Error::tracker(
                name,
                format!("the {shown} bridge has no pipes"),
            ));
        };
        let recorded = read_state(&info.output_dir, name);
        let resumed = recorded["id"].as_str().filter(|_| info.resume);
        let (project, id) = match library {
            Library::Wandb => (
                info.wandb_project
                    .clone()
                    .or_else(|| std::env::var("WANDB_PROJECT").ok())
                    .unwrap_or_else(|| "grpo".into()),
                resumed.map_or_else(new_id, String::from),
            ),
            // Trackio knows runs by name: a resumed run continues the recorded one.
            Library::Trackio => (
                info.project.clone(),
                resumed.map_or_else(|| info.run_name.clone(), String::from),
            ),
        };
        let run_name = match library {
            Library::Trackio => &id,
            Library::Wandb => &info.run_name,
        };
        let init = json!({"init": {"project": project, "name": run_name, "id": id,
                                    "config": info.config, "resume": resumed.is_some()}});
        let stopped =
            |e: std::io::Error| Error::tracker(name, format!("the {shown} bridge stopped: {e}"));
        writeln!(stdin, "{init}").map_err(stopped)?;
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .map_err(stopped)?;
        let answer: Value = serde_json::from_str(line.trim()).unwrap_or(Value::Null);
        if let Some(err) = answer["error"].as_str() {
            let _ = child.wait();
            return Err(Error::tracker(name, err));
        }
        if answer["ok"] != Value::Bool(true) {
            let _ = child.kill();
            return Err(Error::tracker(
                name,
                format!(
                    "the {shown} bridge did not start (answer {:?})",
                    line.trim()
                ),
            ));
        }
        write_state(
            &info.output_dir,
            name,
            json!({"id": id, "project": project}),
        )?;
        Ok(BridgeTracker {
            library,
            child,
            stdin,
        })
    }

    fn send(&mut self, msg: &Value) -> Result<()> {
        let (name, shown) = (self.library.name(), self.library.shown());
        writeln!(self.stdin, "{msg}").map_err(|e| {
            Error::tracker(
                name,
                format!("the {shown} bridge stopped ({e}); its error is printed above"),
            )
        })
    }
}

/// A row of `completions.jsonl` as a row of the `completions` table: an agent's episode gets an
/// `episode` column, its messages as text turn by turn ([`crate::agents::transcript::episode_text`]), beside
/// the `messages` column that holds them as JSON.
fn table_row(row: &Value) -> Value {
    let mut row = row.clone();
    if let Some(messages) = row.get("messages").and_then(Value::as_array) {
        let text = crate::agents::transcript::episode_text(messages);
        row["episode"] = Value::String(text);
    }
    row
}

impl Tracker for BridgeTracker {
    fn name(&self) -> &'static str {
        self.library.name()
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
        self.send(&json!({ "row": table_row(row) }))
    }

    fn finish(&mut self, _artifacts: &[std::path::PathBuf]) -> Result<()> {
        self.send(&json!({"finish": 0}))?;
        let (name, shown) = (self.library.name(), self.library.shown());
        let status = self
            .child
            .wait()
            .map_err(|e| Error::tracker(name, format!("the {shown} bridge: {e}")))?;
        match status.success() {
            true => Ok(()),
            false => Err(Error::tracker(
                name,
                format!("the {shown} bridge ended with {status}; its error is printed above"),
            )),
        }
    }
}

impl Drop for BridgeTracker {
    fn drop(&mut self) {
        // A run that ends without `finish` (an error): the bridge sees its input close.
        let _ = self.child.try_wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_agent_row_gets_its_episode_as_text_and_a_plain_row_is_unchanged() {
        let plain = json!({"step": 1, "prompt": "p", "completion": "c", "reward": 1.0});
        assert_eq!(table_row(&plain), plain);
        let agent = json!({"step": 1, "prompt": "p", "completion": "c", "messages": [
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "calc", "arguments": {"x": 1}}}]},
            {"role": "tool", "name": "calc", "content": "2"}]});
        let row = table_row(&agent);
        assert_eq!(row["episode"], "[assistant]\n-> calc(x=1)\n[tool calc]\n2");
        assert_eq!(row["messages"], agent["messages"]);
    }
}
