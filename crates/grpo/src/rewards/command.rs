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

mod http;
mod protocol;
mod sandbox;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;
use tracing::{info, warn};

pub use http::{HttpScorer, HttpSpec};
pub use protocol::ScorerStats;
use protocol::{
    excerpt, lock, numbered_requests, parse_answers, unit_line, units, Answer, Miss, Tally,
};

use super::table::Table;
use super::ScoreItem;
use crate::{Error, Result};

// ---------------------------------------------------------------------------------------------
// Options

/// The table keys of a scorer program's kind: its own (`$own`) and the process options every
/// scorer program takes ([`CommandSpec::with_options`]).
macro_rules! process_keys {
    ($($own:literal),*) => {
        &[
            $($own,)*
            "timeout_s",
            "processes",
            "max_in_flight",
            "batch_size",
            "cwd",
            "env",
            "inherit_env",
            "max_restarts",
            "cpu_seconds",
            "memory_mb",
            "no_network",
        ]
    };
}

/// The options of a `kind = "command"` reward.
#[derive(Debug, Clone, PartialEq)]
pub struct CommandSpec {
    /// Program and arguments (`command = ["python3", "score.py"]`, or one string split on
    /// whitespace).
    pub command: Vec<String>,
    /// How long the scorer may go without answering while requests wait (`timeout_s`, default 30).
    pub timeout: Duration,
    /// Copies of the scorer run in parallel (default 1).
    pub processes: usize,
    /// Requests written to one process before waiting for answers (default 64).
    pub max_in_flight: usize,
    /// Requests per line: 1 = one JSON object per line, N > 1 = a JSON array of up to N (default 1).
    pub batch_size: usize,
    /// Working directory of the scorer (default: ours).
    pub cwd: Option<PathBuf>,
    /// Environment variables set for the scorer.
    pub env: Vec<(String, String)>,
    /// Variables of the trainer's environment passed on as they are, besides [`BASE_ENV`]
    /// (`inherit_env = ["CUDA_VISIBLE_DEVICES", "PYTHONPATH"]`). Nothing else is: a scorer
    /// does not see the trainer's tokens and keys.
    pub inherit_env: Vec<String>,
    /// Restarts in a row without an answer before `score()` gives up (default 5).
    pub max_restarts: usize,
    /// RLIMIT_CPU for the scorer and each process it starts: CPU seconds over its whole lifetime.
    pub cpu_seconds: Option<u64>,
    /// RLIMIT_AS for the scorer and each process it starts, in MiB.
    pub memory_mb: Option<u64>,
    /// Run the scorer in a new network namespace (no network but its own loopback).
    pub no_network: bool,
}

impl CommandSpec {
    /// The keys of a `kind = "command"` table besides `kind`, `name` and `weight`.
    pub const KEYS: &'static [&'static str] = process_keys!("command");
    /// A spec with every option at its default.
    pub fn new(command: Vec<String>) -> Self {
        CommandSpec {
            command,
            timeout: Duration::from_secs(30),
            processes: 1,
            max_in_flight: 64,
            batch_size: 1,
            cwd: None,
            env: vec![],
            inherit_env: vec![],
            max_restarts: 5,
            cpu_seconds: None,
            memory_mb: None,
            no_network: false,
        }
    }

    /// Reads a table made with `Table::new(obj, path, CommandSpec::KEYS)`.
    pub fn from_table(t: &Table) -> Result<Self> {
        let command = match t.get("command") {
            None => return Err(t.err(
                "command",
                "missing: the scorer program and its arguments, e.g. [\"python3\", \"score.py\"]",
            )),
            Some(Value::String(s)) => s.split_whitespace().map(str::to_owned).collect(),
            // The key is set, so opt_strs gives a list or an error.
            Some(_) => t.opt_strs("command")?.unwrap_or_default(),
        };
        if command.is_empty() || command[0].is_empty() {
            return Err(t.err(
                "command",
                "is empty: give the scorer program and its arguments",
            ));
        }
        CommandSpec::new(command).with_options(t, 1)
    }

    /// The keys of a `kind = "python"` table besides `kind`, `name` and `weight`: the
    /// function, the interpreter, and a command's process options.
    pub const PYTHON_KEYS: &'static [&'static str] = process_keys!("function", "python");
    /// A TRL-style Python reward function, `f(prompts, completions, answer=..., **columns) ->
    /// list[float | None]`, served unchanged by grpo's adapter (`examples/scorers/trl_adapter.py`,
    /// embedded) through the scorer protocol: `function` is `path/to/file.py:name`, `pkg.module:name`
    /// or TRL's dotted `pkg.module.name`; `python` the interpreter (default `GRPO_PYTHON`, else
    /// `python3`). The function gets up to `batch_size` (default 64) completions per call; a call
    /// that raises loses only its batch (missing rewards) and the adapter is restarted. The
    /// adapter sees the user's Python environment ([`PYTHON_ENV`]: `PYTHONPATH`, `VIRTUAL_ENV`,
    /// `CONDA_PREFIX`) besides [`BASE_ENV`], as TRL runs the function in the user's process.
    pub fn from_python_table(t: &Table) -> Result<Self> {
        let function = t.opt_str("function")?.ok_or_else(|| {
            t.err(
                "function",
                "missing: the reward function, as path/to/file.py:name or module.name",
            )
        })?;
        let target = python_target(function).map_err(|m| t.err("function", m))?;
        let python = match t.opt_str("python")? {
            Some(p) => p.to_string(),
            None => std::env::var("GRPO_PYTHON").unwrap_or_else(|_| "python3".into()),
        };
        let command = vec![python, "-c".into(), TRL_ADAPTER.into(), target];
        let mut spec = CommandSpec::new(command).with_options(t, 64)?;
        // The user's own code, run as TRL runs it: it imports what their PYTHONPATH and
        // virtualenv give (third-party scorer programs get only what they name).
        let named = std::mem::take(&mut spec.inherit_env);
        spec.inherit_env = PYTHON_ENV.iter().map(|s| s.to_string()).collect();
        spec.inherit_env.extend(
            named
                .into_iter()
                .filter(|k| !PYTHON_ENV.contains(&k.as_str())),
        );
        Ok(spec)
    }

    /// The function a `kind = "python"` reward serves (`file.py:name`, `module:name`); None
    /// for other scorer programs.
    pub fn python_function(&self) -> Option<&str> {
        match self.command.as_slice() {
            [_, c, source, target] if c == "-c" && source == TRL_ADAPTER => Some(target),
            _ => None,
        }
    }

    /// The process options every scorer program takes, from its table.
    fn with_options(self, t: &Table, default_batch: usize) -> Result<Self> {
        let mut spec = self;
        spec.timeout = timeout(t)?;
        spec.processes = at_least_one(t, "processes", 1)?;
        spec.max_in_flight = at_least_one(t, "max_in_flight", 64)?;
        spec.batch_size = at_least_one(t, "batch_size", default_batch)?;
        spec.cwd = t.opt_str("cwd")?.map(PathBuf::from);
        spec.env = string_table(t, "env")?;
        // An absent key means none (documented default).
        spec.inherit_env = t.opt_strs("inherit_env")?.unwrap_or_default();
        spec.max_restarts = t.usize("max_restarts", 5)?;
        spec.cpu_seconds = positive(t, "cpu_seconds")?;
        spec.memory_mb = positive(t, "memory_mb")?;
        spec.no_network = t.bool("no_network", false)?;
        Ok(spec)
    }

    /// The command as messages show it (an inline script as `<script>`).
    fn display(&self) -> String {
        let shown: Vec<&str> = self
            .command
            .iter()
            .map(|a| {
                if a.contains('\n') {
                    "<script>"
                } else {
                    a.as_str()
                }
            })
            .collect();
        shown.join(" ")
    }
}

/// Whether an I/O error ran out of time (HTTP scorers' and environment services' requests).
pub(crate) use http::is_timeout_io;
/// Whether a new network namespace can be made here (what `no_network` needs).
pub(crate) use sandbox::probe_no_network;

/// What `kind = "python"` serves: examples/scorers/trl_adapter.py, run with `python -c`.
const TRL_ADAPTER: &str = include_str!("../../../../examples/scorers/trl_adapter.py");

/// `function` as the adapter loads it (`FILE.py:NAME` or `MODULE:NAME`): TRL's dotted
/// `pkg.module.name` becomes `pkg.module:name`.
pub fn python_target(function: &str) -> std::result::Result<String, String> {
    let (where_, name) = match function.rsplit_once(':') {
        Some(x) => x,
        None => function.rsplit_once('.').ok_or_else(|| {
            format!(
                "`{function}`: give the module or file too, as TRL does: my_rewards.{function} \
                 or path/to/my_rewards.py:{function}"
            )
        })?,
    };
    let ident = |s: &str| {
        !s.is_empty()
            && !s.starts_with(|c: char| c.is_ascii_digit())
            && s.chars().all(|c| c.is_alphanumeric() || c == '_')
    };
    if where_.is_empty() || !ident(name) {
        return Err(format!(
            "`{function}`: expected path/to/file.py:function, module:function or module.function"
        ));
    }
    Ok(format!("{where_}:{name}"))
}

fn timeout(t: &Table) -> Result<Duration> {
    let s = t.f64("timeout_s", 30.0)?;
    if !(s > 0.0 && s <= 1e6) {
        return Err(t.err("timeout_s", format!("{s}: must be > 0 seconds")));
    }
    Ok(Duration::from_secs_f64(s))
}

fn at_least_one(t: &Table, k: &str, default: usize) -> Result<usize> {
    let n = t.usize(k, default)?;
    if n == 0 {
        return Err(t.err(k, "must be at least 1"));
    }
    Ok(n)
}

fn positive(t: &Table, k: &str) -> Result<Option<u64>> {
    match t.opt_usize(k)? {
        Some(0) => Err(t.err(k, "must be at least 1 (leave it out for no limit)")),
        n => Ok(n.map(|n| n as u64)),
    }
}

/// A table of strings (`env = { HOME = "/tmp" }`); numbers and booleans are taken as their text.
fn string_table(t: &Table, k: &str) -> Result<Vec<(String, String)>> {
    match t.get(k) {
        None => Ok(vec![]),
        Some(Value::Object(m)) => m
            .iter()
            .map(|(name, v)| {
                let v = match v {
                    Value::String(s) => s.clone(),
                    Value::Number(n) => n.to_string(),
                    Value::Bool(b) => b.to_string(),
                    other => {
                        return Err(t.err(
                            &format!("{k}.{name}"),
                            format!("expected a string, got {other}"),
                        ))
                    }
                };
                Ok((name.clone(), v))
            })
            .collect(),
        Some(v) => Err(t.err(
            k,
            format!("expected a table of strings like {{ NAME = \"value\" }}, got {v}"),
        )),
    }
}

// ---------------------------------------------------------------------------------------------
// Scorer processes

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
const STDERR_TAIL: usize = 20;

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

/// One `score()` call: the work queue and results, shared by the processes' threads.
struct Call<'a> {
    spec: &'a CommandSpec,
    name: &'a str,
    requests: &'a [String],
    base: u64,
    max_in_flight: usize,
    queue: Mutex<VecDeque<Vec<usize>>>,
    tally: Mutex<Tally>,
    abort: AtomicBool,
}

/// A line written and not fully answered.
struct Sent {
    /// Items of the line still waiting for an answer.
    items: Vec<usize>,
    at: Instant,
}

impl Call<'_> {
    /// Feeds one process from the queue until the queue is empty and all its requests are
    /// settled.
    fn run(&self, p: &mut Proc) -> Result<()> {
        // Between calls the process may have died (or left lines behind): start afresh.
        let mut dead = p.exit_status().is_some();
        while let Ok(o) = p.output.try_recv() {
            match o {
                Out::Line(l) if !l.trim().is_empty() => lock(&self.tally)
                    .garbage_line(format!("answer outside a request: {}", excerpt(&l))),
                Out::Line(_) => {}
                Out::Eof => dead = true,
            }
        }
        if dead {
            let status = p.reap(Duration::from_secs(1));
            warn!(
                "reward `{}`: scorer (pid {}) exited while idle ({}); starting it again. Last stderr lines:\n{}",
                self.name,
                p.child.id(),
                status,
                p.stderr_tail()
            );
            self.restart(p)?;
        }

        let batched = self.spec.batch_size > 1;
        let mut sent: BTreeMap<u64, Sent> = BTreeMap::new(); // by write order
        let mut line_of: HashMap<usize, u64> = HashMap::new(); // item -> its line
        let mut seq = 0u64;
        let mut last_answer = Instant::now();
        loop {
            if self.abort.load(Ordering::Relaxed) {
                return Ok(());
            }
            // Write while there is room.
            while line_of.len() < self.max_in_flight {
                let unit = {
                    let mut q = lock(&self.queue);
                    match q.pop_front() {
                        Some(u)
                            if line_of.is_empty()
                                || line_of.len() + u.len() <= self.max_in_flight =>
                        {
                            u
                        }
                        Some(u) => {
                            q.push_front(u);
                            break;
                        }
                        None => break,
                    }
                };
                p.send(unit_line(&unit, self.requests, batched));
                for &i in &unit {
                    line_of.insert(i, seq);
                }
                sent.insert(
                    seq,
                    Sent {
                        items: unit,
                        at: Instant::now(),
                    },
                );
                seq += 1;
            }
            let Some(oldest) = sent.values().next() else {
                return Ok(());
            };
            let deadline = oldest.at.max(last_answer) + self.spec.timeout;
            let now = Instant::now();
            if now >= deadline {
                self.hung(p, &mut sent, &mut line_of)?;
                last_answer = Instant::now();
                continue;
            }
            match p
                .output
                .recv_timeout((deadline - now).min(Duration::from_millis(100)))
            {
                Ok(Out::Line(l)) => {
                    if self.answer(&l, &mut sent, &mut line_of) {
                        last_answer = Instant::now();
                        p.failures_in_a_row = 0;
                    }
                }
                Ok(Out::Eof) | Err(RecvTimeoutError::Disconnected) => {
                    self.crashed(p, &mut sent, &mut line_of)?;
                    last_answer = Instant::now();
                }
                Err(RecvTimeoutError::Timeout) => {}
            }
        }
    }

    /// Takes an answer line; true when it answered at least one pending request.
    fn answer(
        &self,
        line: &str,
        sent: &mut BTreeMap<u64, Sent>,
        line_of: &mut HashMap<usize, u64>,
    ) -> bool {
        if line.trim().is_empty() {
            return false;
        }
        let (answers, is_array) = parse_answers(line);
        let mut tally = lock(&self.tally);
        let mut touched = vec![];
        for a in answers {
            match a {
                Answer::Bad(what) => tally.garbage_line(what),
                Answer::For { id, outcome, note } => {
                    let item = id
                        .checked_sub(self.base)
                        .map(|i| i as usize)
                        .filter(|i| line_of.contains_key(i));
                    let Some(item) = item else {
                        tally.garbage_line(format!(
                            "unknown id {id} (not waiting for an answer): {}",
                            excerpt(line)
                        ));
                        continue;
                    };
                    // `item` was checked to be in line_of just above.
                    let s = line_of.remove(&item).unwrap_or_default();
                    if let Some(entry) = sent.get_mut(&s) {
                        entry.items.retain(|&i| i != item);
                        if entry.items.is_empty() {
                            sent.remove(&s);
                        }
                    }
                    touched.push(s);
                    if let Some(n) = note {
                        tally.show_garbage(n);
                    }
                    tally.set(item, outcome);
                }
            }
        }
        // An array answers a whole batch line: requests of it that it left out are garbage.
        if is_array && self.spec.batch_size > 1 {
            for s in &touched {
                if let Some(entry) = sent.remove(s) {
                    let ids: Vec<u64> = entry.items.iter().map(|&i| self.base + i as u64).collect();
                    tally.show_garbage(format!("the answer to a batch lacked ids {ids:?}"));
                    for i in entry.items {
                        line_of.remove(&i);
                        tally.set(i, Err(Miss::Garbage));
                    }
                }
            }
        }
        !touched.is_empty()
    }

    /// No answer for `timeout`: the oldest line is missing, the rest is sent again to a fresh
    /// process.
    fn hung(
        &self,
        p: &mut Proc,
        sent: &mut BTreeMap<u64, Sent>,
        line_of: &mut HashMap<usize, u64>,
    ) -> Result<()> {
        let Some((_, oldest)) = sent.pop_first() else {
            return Ok(());
        };
        let ids: Vec<u64> = oldest.items.iter().map(|&i| self.base + i as u64).collect();
        {
            let mut tally = lock(&self.tally);
            for &i in &oldest.items {
                tally.set(i, Err(Miss::Timeout));
            }
        }
        let again: Vec<Vec<usize>> = std::mem::take(sent)
            .into_values()
            .map(|s| s.items)
            .collect();
        line_of.clear();
        warn!(
            "reward `{}`: scorer (pid {}) answered nothing for {:.1} s; request id(s) {:?} missing (timeout); \
             killing it and sending its {} other unanswered request(s) to a new one",
            self.name,
            p.child.id(),
            self.spec.timeout.as_secs_f64(),
            ids,
            again.iter().map(Vec::len).sum::<usize>()
        );
        {
            let mut q = lock(&self.queue);
            for u in again.into_iter().rev() {
                q.push_front(u);
            }
        }
        p.kill();
        self.restart(p)
    }

    /// The process is gone: what it had not answered is missing; start it again.
    fn crashed(
        &self,
        p: &mut Proc,
        sent: &mut BTreeMap<u64, Sent>,
        line_of: &mut HashMap<usize, u64>,
    ) -> Result<()> {
        let status = p.reap(Duration::from_secs(1));
        let pending: Vec<usize> = std::mem::take(sent)
            .into_values()
            .flat_map(|s| s.items)
            .collect();
        line_of.clear();
        {
            let mut tally = lock(&self.tally);
            for &i in &pending {
                tally.set(i, Err(Miss::Crash));
            }
        }
        warn!(
            "reward `{}`: scorer (pid {}) exited ({}) with {} request(s) unanswered: missing (crash); \
             starting it again. Last stderr lines:\n{}",
            self.name,
            p.child.id(),
            status,
            pending.len(),
            p.stderr_tail()
        );
        self.restart(p)
    }

    /// Replaces a dead or killed process with a new one, unless it keeps failing.
    fn restart(&self, p: &mut Proc) -> Result<()> {
        let failures = p.failures_in_a_row + 1;
        p.failures_in_a_row = failures;
        p.kill();
        if failures > self.spec.max_restarts {
            return Err(Error::reward(
                self.name,
                format!(
                    "scorer `{}` keeps crashing: it failed {failures} times in a row without \
                     answering (max_restarts = {}). Its last stderr lines:\n{}",
                    self.spec.display(),
                    self.spec.max_restarts,
                    p.stderr_tail()
                ),
            ));
        }
        let mut fresh = Proc::spawn(self.spec, self.name)?;
        fresh.failures_in_a_row = failures;
        *p = fresh;
        lock(&self.tally).restarts += 1;
        Ok(())
    }
}

pub(crate) enum Out {
    Line(String),
    Eof,
}

/// The trainer's variables every scorer gets (where set): what finds programs and libraries and
/// sets the locale. Others only through `inherit_env` or `env` (and [`PYTHON_ENV`] for the
/// user's own Python code).
pub const BASE_ENV: [&str; 9] = [
    "PATH",
    "HOME",
    "USER",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "TZ",
    "TMPDIR",
    "LD_LIBRARY_PATH",
];

/// The trainer's variables that find the user's Python code and packages (where set), passed on
/// besides [`BASE_ENV`] to the processes that run the user's own Python: `kind = "python"`
/// rewards, agents' tools and environments.
pub const PYTHON_ENV: [&str; 3] = ["PYTHONPATH", "VIRTUAL_ENV", "CONDA_PREFIX"];

/// The longest answer line kept from a scorer's stdout; a longer one ends the scorer as a crash.
const MAX_ANSWER_LINE: usize = 16 << 20;
/// The longest stderr line kept (the rest of the line is dropped).
const MAX_STDERR_LINE: usize = 64 << 10;

/// Reads one line into `buf`, keeping at most `max` bytes of it (the rest, up to the newline, is
/// read and dropped): (bytes read, whether the line was cut). Memory stays bounded whatever a
/// scorer prints.
fn read_line_bounded(
    r: &mut impl BufRead,
    buf: &mut Vec<u8>,
    max: usize,
) -> std::io::Result<(usize, bool)> {
    let (mut read, mut cut) = (0, false);
    loop {
        let (done, used) = {
            let avail = r.fill_buf()?;
            if avail.is_empty() {
                return Ok((read, cut));
            }
            let (line, done) = match avail.iter().position(|&b| b == b'\n') {
                Some(i) => (&avail[..=i], true),
                None => (avail, false),
            };
            let room = max.saturating_sub(buf.len());
            if line.len() > room {
                cut = true;
            }
            buf.extend_from_slice(&line[..line.len().min(room)]);
            (done, line.len())
        };
        r.consume(used);
        read += used;
        if done {
            return Ok((read, cut));
        }
    }
}

/// One running scorer process and the threads that feed it and read it.
pub(crate) struct Proc {
    pub(crate) child: Child,
    /// Lines for the writer thread; dropping it closes the scorer's stdin.
    input: Option<Sender<String>>,
    /// Lines the scorer wrote to stdout, then `Eof`.
    pub(crate) output: Receiver<Out>,
    stderr: Arc<Mutex<VecDeque<String>>>,
    /// Disconnects when the stderr thread has read everything.
    stderr_done: Receiver<()>,
    reaped: Option<ExitStatus>,
    /// The process group was sent SIGKILL. Done once: later, after the scorer is reaped and its
    /// group empty, its id may be given to another process.
    group_killed: bool,
    /// Failures (crash, hang, exit while idle) since the last answer.
    failures_in_a_row: usize,
}

impl Proc {
    pub(crate) fn spawn(spec: &CommandSpec, name: &str) -> Result<Proc> {
        let mut program = PathBuf::from(&spec.command[0]);
        // A relative path with a slash is relative to the scorer's working directory.
        if let Some(dir) = &spec.cwd {
            if program.is_relative() && program.components().count() > 1 {
                program = dir.join(program);
            }
        }
        let mut cmd = Command::new(&program);
        cmd.args(&spec.command[1..])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(dir) = &spec.cwd {
            cmd.current_dir(dir);
        }
        // A minimal environment: the trainer's tokens and keys (HF_TOKEN, WANDB_API_KEY, cloud
        // credentials) stay out of a scorer's reach unless a reward names them.
        cmd.env_clear();
        for k in BASE_ENV
            .iter()
            .copied()
            .chain(spec.inherit_env.iter().map(String::as_str))
        {
            if let Some(v) = std::env::var_os(k) {
                cmd.env(k, v);
            }
        }
        cmd.envs(spec.env.iter().map(|(k, v)| (k, v)));
        sandbox::apply(&mut cmd, spec);
        let mut child = cmd.spawn().map_err(|e| {
            let hint = match e.kind() {
                std::io::ErrorKind::NotFound => {
                    " (is the program installed and on PATH, or a path that exists?)"
                }
                std::io::ErrorKind::PermissionDenied => " (is the file executable?)",
                _ if spec.no_network => {
                    " (no_network is set: the network namespace may be refused)"
                }
                _ => "",
            };
            Error::reward(
                name,
                format!("cannot start scorer `{}`: {e}{hint}", spec.display()),
            )
        })?;
        let (Some(stdin), Some(stdout), Some(stderr)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(Error::reward(name, "scorer started without its pipes"));
        };
        let pid = child.id();
        let thread = |what: &str| std::thread::Builder::new().name(format!("scorer-{pid}-{what}"));
        let spawn_err = |e: std::io::Error| Error::io(format!("reward `{name}`: scorer thread"), e);

        let (in_tx, in_rx) = mpsc::channel::<String>();
        thread("in")
            .spawn(move || {
                let mut stdin = stdin;
                for line in in_rx {
                    if stdin
                        .write_all(line.as_bytes())
                        .and_then(|_| stdin.flush())
                        .is_err()
                    {
                        break;
                    }
                }
            })
            .map_err(spawn_err)?;

        let (out_tx, out_rx) = mpsc::channel();
        let name_out = name.to_owned();
        thread("out")
            .spawn(move || {
                let mut r = BufReader::new(stdout);
                let mut buf = vec![];
                loop {
                    buf.clear();
                    match read_line_bounded(&mut r, &mut buf, MAX_ANSWER_LINE) {
                        Ok((0, _)) | Err(_) => {
                            let _ = out_tx.send(Out::Eof);
                            return;
                        }
                        Ok((_, true)) => {
                            // The scorer's memory, not the trainer's: stop reading it; its
                            // pending requests count as crashed and it is started again.
                            warn!(
                                reward = %name_out,
                                "scorer wrote an answer line over {} MB: treated as a crash",
                                MAX_ANSWER_LINE >> 20
                            );
                            let _ = out_tx.send(Out::Eof);
                            return;
                        }
                        Ok(_) => {
                            let s = String::from_utf8_lossy(&buf);
                            let s = s.trim_end_matches(['\n', '\r']).to_owned();
                            if out_tx.send(Out::Line(s)).is_err() {
                                return;
                            }
                        }
                    }
                }
            })
            .map_err(spawn_err)?;

        let tail = Arc::new(Mutex::new(VecDeque::new()));
        let (done_tx, done_rx) = mpsc::channel::<()>();
        let (tail2, name2) = (tail.clone(), name.to_owned());
        thread("err")
            .spawn(move || {
                let _done = done_tx;
                let mut r = BufReader::new(stderr);
                let mut buf = vec![];
                while let Ok((n, cut)) = read_line_bounded(&mut r, &mut buf, MAX_STDERR_LINE) {
                    if n == 0 {
                        break;
                    }
                    let mut line = String::from_utf8_lossy(&buf).trim_end().to_owned();
                    if cut {
                        line.push_str(" [line cut: over 64 KB]");
                    }
                    buf.clear();
                    info!(reward = %name2, "scorer: {line}");
                    let mut t = lock(&tail2);
                    if t.len() == STDERR_TAIL {
                        t.pop_front();
                    }
                    t.push_back(line);
                }
                // Whatever a scorer writes without a final newline is kept too (bounded).
                let _ = r.take(MAX_STDERR_LINE as u64).read_to_end(&mut buf);
            })
            .map_err(spawn_err)?;

        Ok(Proc {
            child,
            input: Some(in_tx),
            output: out_rx,
            stderr: tail,
            stderr_done: done_rx,
            reaped: None,
            group_killed: false,
            failures_in_a_row: 0,
        })
    }

    pub(crate) fn send(&self, mut line: String) {
        line.push('\n');
        if let Some(tx) = &self.input {
            // A failed send means the writer stopped (the scorer closed stdin or died); the
            // reader then reports the end of stdout and the requests count as crashed.
            let _ = tx.send(line);
        }
    }

    pub(crate) fn exit_status(&mut self) -> Option<ExitStatus> {
        if self.reaped.is_some() {
            return self.reaped;
        }
        match self.child.try_wait() {
            Ok(Some(s)) => {
                self.reaped = Some(s);
                Some(s)
            }
            _ => None,
        }
    }

    /// Waits up to `grace` for the process to exit on its own, then kills it; describes the exit.
    pub(crate) fn reap(&mut self, grace: Duration) -> String {
        let t0 = Instant::now();
        while self.exit_status().is_none() && t0.elapsed() < grace {
            std::thread::sleep(Duration::from_millis(5));
        }
        let alive = self.exit_status().is_none();
        self.kill();
        self.wait_stderr(Duration::from_millis(300));
        match self.reaped {
            Some(s) if !alive => describe(s),
            _ => "closed its stdout; killed".into(),
        }
    }

    pub(crate) fn wait_stderr(&self, d: Duration) {
        let _ = self.stderr_done.recv_timeout(d);
    }

    pub(crate) fn stderr_tail(&self) -> String {
        let t = lock(&self.stderr);
        if t.is_empty() {
            "(none)".into()
        } else {
            t.iter()
                .map(|l| format!("  {l}"))
                .collect::<Vec<_>>()
                .join("\n")
        }
    }

    /// Kills the scorer and every process it started (its process group), and reaps it.
    pub(crate) fn kill(&mut self) {
        self.input = None;
        if !self.group_killed {
            sandbox::kill_group(&self.child);
            self.group_killed = true;
        }
        let _ = self.child.kill();
        if let Ok(s) = self.child.wait() {
            self.reaped = Some(s);
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // Close stdin first: a scorer that finishes on EOF gets a moment to do so.
        self.input = None;
        let t0 = Instant::now();
        while self.exit_status().is_none() && t0.elapsed() < Duration::from_millis(100) {
            std::thread::sleep(Duration::from_millis(2));
        }
        self.kill();
    }
}

pub(crate) fn describe(s: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    if let Some(code) = s.code() {
        return format!("exit status {code}");
    }
    match s.signal() {
        Some(sig) => {
            let what = match sig {
                libc::SIGXCPU => " SIGXCPU: cpu_seconds used up",
                libc::SIGKILL => " SIGKILL: killed, e.g. a limit or out of memory",
                libc::SIGSEGV => " SIGSEGV",
                libc::SIGABRT => " SIGABRT",
                libc::SIGTERM => " SIGTERM",
                _ => "",
            };
            format!("killed by signal {sig}{what}")
        }
        None => format!("{s}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_targets_read_as_trl_names_them() {
        for (f, want) in [
            ("my_rewards.correctness", "my_rewards:correctness"),
            ("pkg.sub.fn_2", "pkg.sub:fn_2"),
            ("path/to/file.py:score", "path/to/file.py:score"),
            ("pkg.module:score", "pkg.module:score"),
        ] {
            assert_eq!(python_target(f).unwrap(), want);
        }
        for bad in ["correctness", "file.py:", ":f", "m.2f", "a.b-c"] {
            assert!(python_target(bad).is_err(), "{bad}");
        }
    }
    use serde_json::Map;

    fn table_of(json: &str) -> Map<String, Value> {
        serde_json::from_str(json).unwrap()
    }

    fn command_spec(json: &str) -> Result<CommandSpec> {
        let obj = table_of(json);
        CommandSpec::from_table(&Table::new(&obj, "rewards[3]".into(), CommandSpec::KEYS)?)
    }

    #[test]
    fn command_options_and_defaults() {
        let s =
            command_spec(r#"{"kind": "command", "command": "python3  score.py --fast"}"#).unwrap();
        assert_eq!(s.command, ["python3", "score.py", "--fast"]);
        assert_eq!(s, CommandSpec::new(s.command.clone()));
        assert_eq!(s.timeout, Duration::from_secs(30));
        assert_eq!(
            (s.processes, s.max_in_flight, s.batch_size, s.max_restarts),
            (1, 64, 1, 5)
        );

        let s = command_spec(
            r#"{"kind": "command", "name": "judge", "weight": 2, "command": ["python3", "my score.py"],
                "timeout_s": 0.5, "processes": 2, "max_in_flight": 4, "batch_size": 8, "cwd": "/tmp",
                "env": {"A": "x", "N": 3}, "max_restarts": 0, "cpu_seconds": 10, "memory_mb": 512,
                "no_network": true}"#,
        )
        .unwrap();
        assert_eq!(s.command, ["python3", "my score.py"]);
        assert_eq!(s.timeout, Duration::from_millis(500));
        assert_eq!((s.processes, s.max_in_flight, s.batch_size), (2, 4, 8));
        assert_eq!(s.cwd, Some(PathBuf::from("/tmp")));
        assert_eq!(s.env, [("A".into(), "x".into()), ("N".into(), "3".into())]);
        assert_eq!(
            (s.max_restarts, s.cpu_seconds, s.memory_mb),
            (0, Some(10), Some(512))
        );
        assert!(s.no_network);
    }

    /// The user's own reward functions see their Python environment (issue 57); a third-party
    /// scorer program only what it names.
    #[test]
    fn python_rewards_inherit_the_python_environment_and_programs_do_not() {
        let obj = table_of(
            r#"{"kind": "python", "function": "my_rewards.correct",
                "inherit_env": ["HF_HOME", "PYTHONPATH"]}"#,
        );
        let t = Table::new(&obj, "rewards[0]".into(), CommandSpec::PYTHON_KEYS).unwrap();
        let s = CommandSpec::from_python_table(&t).unwrap();
        assert_eq!(
            s.inherit_env,
            ["PYTHONPATH", "VIRTUAL_ENV", "CONDA_PREFIX", "HF_HOME"]
        );
        let s = command_spec(r#"{"kind": "command", "command": "python3 score.py"}"#).unwrap();
        assert!(s.inherit_env.is_empty());
    }

    #[test]
    fn command_option_errors_name_the_key() {
        for (json, key, says) in [
            (
                r#"{"kind": "command", "comand": "x"}"#,
                "rewards[3].comand",
                "did you mean `command`",
            ),
            (r#"{"kind": "command"}"#, "rewards[3].command", "missing"),
            (
                r#"{"kind": "command", "command": ""}"#,
                "rewards[3].command",
                "empty",
            ),
            (
                r#"{"kind": "command", "command": []}"#,
                "rewards[3].command",
                "empty",
            ),
            (
                r#"{"kind": "command", "command": 5}"#,
                "rewards[3].command",
                "list of strings",
            ),
            (
                r#"{"kind": "command", "command": ["a", 1]}"#,
                "rewards[3].command",
                "expected strings",
            ),
            (
                r#"{"kind": "command", "command": "a", "timeout_s": "1"}"#,
                "rewards[3].timeout_s",
                "number",
            ),
            (
                r#"{"kind": "command", "command": "a", "timeout_s": 0}"#,
                "rewards[3].timeout_s",
                "> 0",
            ),
            (
                r#"{"kind": "command", "command": "a", "processes": 0}"#,
                "rewards[3].processes",
                "at least 1",
            ),
            (
                r#"{"kind": "command", "command": "a", "batch_size": 1.5}"#,
                "rewards[3].batch_size",
                "whole number",
            ),
            (
                r#"{"kind": "command", "command": "a", "max_in_flight": -1}"#,
                "rewards[3].max_in_flight",
                "whole number",
            ),
            (
                r#"{"kind": "command", "command": "a", "env": ["A=1"]}"#,
                "rewards[3].env",
                "table of strings",
            ),
            (
                r#"{"kind": "command", "command": "a", "env": {"A": [1]}}"#,
                "rewards[3].env.A",
                "string",
            ),
            (
                r#"{"kind": "command", "command": "a", "cpu_seconds": 0}"#,
                "rewards[3].cpu_seconds",
                "at least 1",
            ),
            (
                r#"{"kind": "command", "command": "a", "no_network": "yes"}"#,
                "rewards[3].no_network",
                "true or false",
            ),
            (
                r#"{"kind": "command", "command": "a", "cwd": 1}"#,
                "rewards[3].cwd",
                "string",
            ),
        ] {
            let e = command_spec(json).unwrap_err().to_string();
            assert!(
                e.contains(&format!("`{key}`")) && e.contains(says),
                "{json}: {e}"
            );
        }
    }

    #[test]
    fn scorers_can_be_shared_between_threads() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<CommandScorer>();
        send_sync::<HttpScorer>();
    }
}
