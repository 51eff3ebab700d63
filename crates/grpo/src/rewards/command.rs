//! Rewards computed by the user's own scorer: a long-lived child process that speaks JSON lines
//! on stdin/stdout (`kind = "command"`, any language), or an HTTP endpoint (`kind = "http"`).
//! The protocol is in `docs/rewards.md (Scorer programs)`; in short, one request per completion
//! `{"id", "prompt", "completion", "answer", "metadata"}` and one response `{"id", "reward"}`
//! (a number, or `null` for "cannot score"), in any order.
//!
//! Whatever goes wrong is a *missing* reward (NaN, left out of the group's statistics), counted by
//! cause in [`ScorerStats`] and warned about, never a silent 0 and never a hang:
//! - `null`: the scorer answered `"reward": null`;
//! - `timeout`: the scorer answered nothing for `timeout_s` while requests were waiting. The
//!   oldest unanswered request is missing, the process is killed with everything it started, and
//!   a fresh one gets the other unanswered requests again;
//! - `crash`: the process exited (or closed stdout); the requests it had been sent and not
//!   answered are missing and it is restarted;
//! - `garbage`: the answer for a request was not a number (`"0.5"`, `true`, `NaN`), or the answer
//!   to a batch line lacked the request; lines that are not JSON or carry an unknown id are
//!   counted in `garbage_lines` and the first few are shown;
//! - `http_error` (HTTP only): an error status or a failed connection.
//!
//! A process restarted more than `max_restarts` times in a row without answering anything in
//! between makes `score()` return an error with the scorer's last stderr lines.

mod call;
mod http;
mod process;
mod protocol;
mod sandbox;
mod spec;
#[cfg(test)]
mod tests;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub use http::{HttpScorer, HttpSpec};
pub use protocol::ScorerStats;
use protocol::{lock, numbered_requests, units, Tally};

use super::ScoreItem;
use crate::{Error, Result};

use call::Call;
pub(crate) use process::{describe, Out, Proc};
pub use spec::{python_target, CommandSpec, BASE_ENV, PYTHON_ENV};

/// Whether an I/O error ran out of time (HTTP scorers' and environment services' requests).
pub(crate) use http::is_timeout_io;
/// Whether a new network namespace can be made here (what `no_network` needs).
pub(crate) use sandbox::probe_no_network;

/// The scorer program, `processes` copies of it, each fed JSON lines on stdin.
pub struct CommandScorer {
    spec: CommandSpec,
    name: String,
    procs: Vec<Mutex<Proc>>,
    next_id: AtomicU64,
    stats: Mutex<ScorerStats>,
}

impl std::fmt::Debug for CommandScorer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommandScorer")
            .field("name", &self.name)
            .field("spec", &self.spec)
            .finish_non_exhaustive()
    }
}

/// How long `start` watches the new processes for an immediate exit (a wrong path, an import
/// error) so that it is reported at start rather than as crashes at the first step.
const START_WATCH: Duration = Duration::from_millis(300);

impl CommandScorer {
    /// Starts `spec.processes` copies of the scorer. Errors name the command: it cannot be
    /// run, it exits at once (with its stderr), or `no_network` cannot be had here.
    pub fn start(spec: CommandSpec, name: &str) -> Result<Self> {
        if let Some(dir) = &spec.cwd {
            if !dir.is_dir() {
                return Err(Error::reward(
                    name,
                    format!(
                        "cwd `{}` of scorer `{}` is not a directory",
                        dir.display(),
                        spec.display()
                    ),
                ));
            }
        }
        if spec.no_network {
            sandbox::probe_no_network().map_err(|e| {
                Error::reward(
                    name,
                    format!(
                        "no_network = true, but a new network namespace cannot be created here \
                         (unshare: {e}); allow user namespaces (or run with CAP_SYS_ADMIN), or set \
                         no_network = false and isolate the scorer another way"
                    ),
                )
            })?;
        }
        let mut procs = Vec::with_capacity(spec.processes);
        for _ in 0..spec.processes {
            procs.push(Proc::spawn(&spec, name)?);
        }
        let t0 = Instant::now();
        while t0.elapsed() < START_WATCH {
            for p in &mut procs {
                if let Some(status) = p.exit_status() {
                    p.wait_stderr(Duration::from_millis(500));
                    return Err(Error::reward(
                        name,
                        format!(
                            "scorer `{}` exited at start ({}); it must keep reading requests \
                             from stdin until EOF. Its last stderr lines:\n{}",
                            spec.display(),
                            describe(status),
                            p.stderr_tail()
                        ),
                    ));
                }
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(CommandScorer {
            spec,
            name: name.to_owned(),
            procs: procs.into_iter().map(Mutex::new).collect(),
            next_id: AtomicU64::new(0),
            stats: Mutex::new(ScorerStats::default()),
        })
    }

    /// One reward per item, NaN where the scorer answered null, timed out, crashed or answered
    /// garbage (each counted in [`Self::stats`] and warned about). An error only when a scorer
    /// process keeps crashing (more than `max_restarts` restarts in a row without an answer) or
    /// cannot be started again.
    pub fn score(&self, items: &[ScoreItem]) -> Result<Vec<f32>> {
        if items.is_empty() {
            return Ok(vec![]);
        }
        let (base, requests) = numbered_requests(&self.next_id, items);
        // Each process starts with at most its share, so that a small call is spread over all.
        let share = items.len().div_ceil(self.procs.len());
        let call = Call {
            spec: &self.spec,
            name: &self.name,
            requests: &requests,
            base,
            max_in_flight: self.spec.max_in_flight.min(share).max(1),
            queue: Mutex::new(units(items.len(), self.spec.batch_size)),
            tally: Mutex::new(Tally::new(items.len())),
            abort: AtomicBool::new(false),
        };
        let results: Vec<Result<()>> = if self.procs.len() == 1 {
            vec![call.run(&mut lock(&self.procs[0]))]
        } else {
            std::thread::scope(|s| {
                let handles: Vec<_> = self
                    .procs
                    .iter()
                    .map(|p| {
                        let call = &call;
                        s.spawn(move || {
                            let r = call.run(&mut lock(p));
                            if r.is_err() {
                                call.abort.store(true, Ordering::Relaxed);
                            }
                            r
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| {
                        h.join().unwrap_or_else(|_| {
                            Err(Error::reward(&self.name, "a scorer thread panicked"))
                        })
                    })
                    .collect()
            })
        };
        let tally = call.tally.into_inner().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = results.into_iter().find_map(|r| r.err()) {
            lock(&self.stats).restarts += tally.restarts;
            return Err(e);
        }
        Ok(tally.finish(&self.name, &self.stats))
    }

    /// Counters since start.
    /// The options it was started with.
    pub fn spec(&self) -> &CommandSpec {
        &self.spec
    }

    pub fn stats(&self) -> ScorerStats {
        *lock(&self.stats)
    }

    /// The process ids of the running scorer processes (for tests and diagnostics).
    pub fn pids(&self) -> Vec<u32> {
        self.procs.iter().map(|p| lock(p).child.id()).collect()
    }
}
