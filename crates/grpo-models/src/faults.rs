//! Fault injection for the reliability tests: named points in the code where a test makes the
//! process kill itself, a file write fail as on a full disk, or a step's numbers go NaN, so that
//! what a real fault would do is reproduced on demand. Built on the `fail` crate's fail points.
//!
//! `GRPO_FAULTS="name=actions;name=actions"` configures them at start (the `fail` crate's action
//! syntax: `3*off->return(kill)` triggers from the fourth time on). Unconfigured, a point costs
//! one map lookup. Points:
//!
//! | point | `return(...)` argument | effect |
//! | --- | --- | --- |
//! | `write` | a part of the file's path | that write fails with "No space left on device" |
//! | `checkpoint.model_written`, `checkpoint.before_rename`, `train.sampled`, `train.scored`, `update.micro_batch`, `update.before_step` | `kill` | the process SIGKILLs itself there |
//! | `update.nan_grad`, `update.nan_loss`, `update.nan_logits`, `rewards.inf` | (none) | that step's gradient, loss, log-probs or first reward becomes non-finite |

use std::path::Path;

/// The environment variable that configures the fail points.
pub const ENV: &str = "GRPO_FAULTS";

/// Reads [`ENV`] and configures the fail points it names; an error names the bad entry.
pub fn init_from_env() -> Result<(), String> {
    let Ok(spec) = std::env::var(ENV) else {
        return Ok(());
    };
    for entry in spec.split(';').map(str::trim).filter(|e| !e.is_empty()) {
        let (name, actions) = entry
            .split_once('=')
            .ok_or_else(|| format!("{ENV}: `{entry}` is not name=actions"))?;
        fail::cfg(name.trim(), actions.trim()).map_err(|e| format!("{ENV}: `{entry}`: {e}"))?;
    }
    Ok(())
}

/// The argument of point `name` when it triggers now.
fn triggered(name: &str) -> Option<String> {
    // A point set without an argument triggers with an empty one.
    fail::eval(name, |arg| arg.unwrap_or_default())
}

/// A point where a test may kill the process (`return(kill)`): SIGKILL, as `kill -9` does.
pub fn kill_point(name: &str) {
    if triggered(name).is_some_and(|a| a == "kill") {
        tracing::debug!("fault {name}: SIGKILL");
        // SAFETY: sends a signal to this process; no memory is touched.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
    }
}

/// Whether point `name` triggers now (a NaN step, an infinite reward).
pub fn fires(name: &str) -> bool {
    triggered(name).is_some()
}

/// The error a write of `path` fails with when the `write` point names a part of its path: the
/// one a full disk gives.
pub fn write_error(path: &Path) -> Option<std::io::Error> {
    let part = triggered("write")?;
    path.to_string_lossy()
        .contains(part.as_str())
        .then(|| std::io::Error::from_raw_os_error(libc::ENOSPC))
}
