//! Rewards computed by the user's own scorer: a long-lived child process that speaks JSON lines
//! on stdin/stdout (`kind = "command"`, any language), or an HTTP endpoint (`kind = "http"`).
//! The protocol is in `docs/reward-protocol.md`; in short, one request per completion
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

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde_json::Value;
use tracing::{info, warn};

use super::table::Table;
use super::ScoreItem;
use crate::{Error, Result};

/// Counters over a scorer's lifetime. Every request ends up in exactly one of `scored`, `null`,
/// `timeout`, `crash`, `garbage` and `http_error`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ScorerStats {
    /// Completions sent for scoring.
    pub requests: u64,
    /// Completions that got a number.
    pub scored: u64,
    /// Missing: the scorer answered `"reward": null`.
    pub null: u64,
    /// Missing: no answer within `timeout_s`.
    pub timeout: u64,
    /// Missing: the scorer process exited or closed stdout before answering.
    pub crash: u64,
    /// Missing: the answer was not a number, or a batch's answer lacked the request.
    pub garbage: u64,
    /// Missing (HTTP): an error status or a failed connection.
    pub http_error: u64,
    /// Answer lines or bodies that could not be used at all: not JSON, no id, an unknown id.
    pub garbage_lines: u64,
    /// Scorer processes started again after a crash or a hang.
    pub restarts: u64,
}

impl ScorerStats {
    /// Requests that got no number, all causes together.
    pub fn missing(&self) -> u64 {
        self.null + self.timeout + self.crash + self.garbage + self.http_error
    }

    fn add(&mut self, o: &ScorerStats) {
        self.requests += o.requests;
        self.scored += o.scored;
        self.null += o.null;
        self.timeout += o.timeout;
        self.crash += o.crash;
        self.garbage += o.garbage;
        self.http_error += o.http_error;
        self.garbage_lines += o.garbage_lines;
        self.restarts += o.restarts;
    }
}

// ---------------------------------------------------------------------------------------------
// Options

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
    /// Extra environment variables.
    pub env: Vec<(String, String)>,
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
    pub const KEYS: &'static [&'static str] = &[
        "command",
        "timeout_s",
        "processes",
        "max_in_flight",
        "batch_size",
        "cwd",
        "env",
        "max_restarts",
        "cpu_seconds",
        "memory_mb",
        "no_network",
    ];

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
            max_restarts: 5,
            cpu_seconds: None,
            memory_mb: None,
            no_network: false,
        }
    }

    /// Reads a table made with `Table::new(obj, i, CommandSpec::KEYS)`.
    pub fn from_table(t: &Table) -> Result<Self> {
        let command = match t.get("command") {
            None => return Err(t.err(
                "command",
                "missing: the scorer program and its arguments, e.g. [\"python3\", \"score.py\"]",
            )),
            Some(Value::String(s)) => s.split_whitespace().map(str::to_owned).collect(),
            Some(_) => t.opt_strs("command")?.unwrap_or_default(),
        };
        if command.is_empty() || command[0].is_empty() {
            return Err(t.err(
                "command",
                "is empty: give the scorer program and its arguments",
            ));
        }
        let mut spec = CommandSpec::new(command);
        spec.timeout = timeout(t)?;
        spec.processes = at_least_one(t, "processes", 1)?;
        spec.max_in_flight = at_least_one(t, "max_in_flight", 64)?;
        spec.batch_size = at_least_one(t, "batch_size", 1)?;
        spec.cwd = t.opt_str("cwd")?.map(PathBuf::from);
        spec.env = string_table(t, "env")?;
        spec.max_restarts = t.usize("max_restarts", 5)?;
        spec.cpu_seconds = positive(t, "cpu_seconds")?;
        spec.memory_mb = positive(t, "memory_mb")?;
        spec.no_network = t.bool("no_network", false)?;
        Ok(spec)
    }

    fn display(&self) -> String {
        self.command.join(" ")
    }
}

/// The options of a `kind = "http"` reward.
#[derive(Debug, Clone, PartialEq)]
pub struct HttpSpec {
    /// Where the requests are POSTed (`http://` or `https://`).
    pub url: String,
    /// Per HTTP request, connection to last byte (`timeout_s`, default 30).
    pub timeout: Duration,
    /// HTTP requests at the same time (default 8).
    pub max_in_flight: usize,
    /// Requests per body: 1 = a JSON object, N > 1 = a JSON array of up to N (default 1).
    pub batch_size: usize,
    /// Extra headers (`Authorization`, ...).
    pub headers: Vec<(String, String)>,
}

impl HttpSpec {
    /// The keys of a `kind = "http"` table besides `kind`, `name` and `weight`.
    pub const KEYS: &'static [&'static str] =
        &["url", "timeout_s", "max_in_flight", "batch_size", "headers"];

    /// A spec with every option at its default.
    pub fn new(url: impl Into<String>) -> Self {
        HttpSpec {
            url: url.into(),
            timeout: Duration::from_secs(30),
            max_in_flight: 8,
            batch_size: 1,
            headers: vec![],
        }
    }

    /// Reads a table made with `Table::new(obj, i, HttpSpec::KEYS)`.
    pub fn from_table(t: &Table) -> Result<Self> {
        let url = t.req_str(
            "url",
            "the scorer's address, e.g. \"http://127.0.0.1:8000/score\"",
        )?;
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            return Err(t.err(
                "url",
                format!("`{url}` must start with http:// or https://"),
            ));
        }
        let mut spec = HttpSpec::new(url);
        spec.timeout = timeout(t)?;
        spec.max_in_flight = at_least_one(t, "max_in_flight", 8)?;
        spec.batch_size = at_least_one(t, "batch_size", 1)?;
        spec.headers = string_table(t, "headers")?;
        Ok(spec)
    }
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
// Protocol: requests, answers, and the per-call bookkeeping both scorer kinds share

/// Why a request got no number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Miss {
    Null,
    Timeout,
    Crash,
    Garbage,
    HttpError,
}

type Outcome = std::result::Result<f32, Miss>;

/// One request as a JSON object (one line, no newline).
fn request_json(id: u64, item: &ScoreItem) -> String {
    serde_json::json!({
        "id": id,
        "prompt": item.prompt_json(),
        "completion": item.completion,
        "answer": item.answer,
        "metadata": item.metadata,
    })
    .to_string()
}

/// What one answer line (or HTTP body) says.
enum Answer {
    /// An answer for request `id`; `note` explains a garbage reward.
    For {
        id: u64,
        outcome: Outcome,
        note: Option<String>,
    },
    /// Nothing usable (not JSON, not an object, no id).
    Bad(String),
}

/// Parses a line: one response object, or an array of them. Returns the answers and whether the
/// line was an array (the answer to a batch line).
fn parse_answers(text: &str) -> (Vec<Answer>, bool) {
    let v: Value = match serde_json::from_str(text.trim()) {
        Ok(v) => v,
        Err(_) => {
            return (
                vec![Answer::Bad(format!("not JSON: {}", excerpt(text)))],
                false,
            )
        }
    };
    match v {
        Value::Array(a) => (a.iter().map(|r| parse_one(r, text)).collect(), true),
        r => (vec![parse_one(&r, text)], false),
    }
}

fn parse_one(r: &Value, line: &str) -> Answer {
    let Some(obj) = r.as_object() else {
        return Answer::Bad(format!(
            "expected {{\"id\": .., \"reward\": ..}}, got {}",
            excerpt(line)
        ));
    };
    let Some(id) = obj.get("id").and_then(Value::as_u64) else {
        return Answer::Bad(format!("no numeric \"id\": {}", excerpt(line)));
    };
    let (outcome, note) = match obj.get("reward") {
        Some(Value::Null) => (Err(Miss::Null), None),
        Some(Value::Number(n)) => match n.as_f64().map(|x| x as f32).filter(|x| x.is_finite()) {
            Some(x) => (Ok(x), None),
            None => (
                Err(Miss::Garbage),
                Some(format!("id {id}: reward {n} is not a finite f32")),
            ),
        },
        Some(other) => (
            Err(Miss::Garbage),
            Some(format!(
                "id {id}: reward {other} is not a number (use null for missing)"
            )),
        ),
        None => (
            Err(Miss::Garbage),
            Some(format!("id {id}: no \"reward\" in {}", excerpt(line))),
        ),
    };
    Answer::For { id, outcome, note }
}

fn excerpt(s: &str) -> String {
    const MAX: usize = 200;
    let s = s.trim_end();
    if s.len() <= MAX {
        return format!("{s:?}");
    }
    let mut end = MAX;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{:?}... ({} bytes)", &s[..end], s.len())
}

/// One call's results, shared by the threads that talk to the processes (or HTTP).
struct Tally {
    out: Vec<Option<Outcome>>,
    garbage_lines: u64,
    restarts: u64,
    /// The first few garbage lines and non-numeric rewards, shown in the warning.
    garbage_shown: Vec<String>,
    /// The first few HTTP errors, shown in the warning.
    errors_shown: Vec<String>,
}

const SHOWN: usize = 3;

impl Tally {
    fn new(n: usize) -> Self {
        Tally {
            out: vec![None; n],
            garbage_lines: 0,
            restarts: 0,
            garbage_shown: vec![],
            errors_shown: vec![],
        }
    }
    fn set(&mut self, idx: usize, o: Outcome) {
        if self.out[idx].is_none() {
            self.out[idx] = Some(o);
        }
    }
    fn garbage_line(&mut self, what: String) {
        self.garbage_lines += 1;
        self.show_garbage(what);
    }
    fn show_garbage(&mut self, what: String) {
        if self.garbage_shown.len() < SHOWN {
            self.garbage_shown.push(what);
        }
    }
    fn show_error(&mut self, what: String) {
        if self.errors_shown.len() < SHOWN {
            self.errors_shown.push(what);
        }
    }

    /// Rewards (NaN where missing), added to `stats`, with one warning summing up what went wrong.
    fn finish(self, name: &str, stats: &Mutex<ScorerStats>) -> Vec<f32> {
        let mut s = ScorerStats {
            requests: self.out.len() as u64,
            garbage_lines: self.garbage_lines,
            restarts: self.restarts,
            ..Default::default()
        };
        let rewards = self
            .out
            .iter()
            .map(|o| match o {
                Some(Ok(x)) => {
                    s.scored += 1;
                    *x
                }
                Some(Err(m)) => {
                    match m {
                        Miss::Null => s.null += 1,
                        Miss::Timeout => s.timeout += 1,
                        Miss::Crash => s.crash += 1,
                        Miss::Garbage => s.garbage += 1,
                        Miss::HttpError => s.http_error += 1,
                    }
                    f32::NAN
                }
                // Every request is settled before a call returns its rewards; count a gap as
                // a crash rather than invent a number.
                None => {
                    s.crash += 1;
                    f32::NAN
                }
            })
            .collect();
        if s.missing() > 0 {
            warn!(
                "reward `{name}`: {} of {} rewards missing (null {}, timeout {}, crash {}, garbage {}, http_error {})",
                s.missing(),
                s.requests,
                s.null,
                s.timeout,
                s.crash,
                s.garbage,
                s.http_error
            );
        }
        if !self.garbage_shown.is_empty() {
            warn!(
                "reward `{name}`: {} unusable answer line(s) and {} non-numeric reward(s); first ones: {}",
                s.garbage_lines,
                s.garbage,
                self.garbage_shown.join(" | ")
            );
        }
        if !self.errors_shown.is_empty() {
            warn!(
                "reward `{name}`: HTTP errors: {}",
                self.errors_shown.join(" | ")
            );
        }
        lock(stats).add(&s);
        rewards
    }
}

/// Item indices grouped into lines of `batch_size`.
fn units(n: usize, batch_size: usize) -> VecDeque<Vec<usize>> {
    (0..n)
        .collect::<Vec<_>>()
        .chunks(batch_size)
        .map(<[usize]>::to_vec)
        .collect()
}

/// The line (or body) for a unit: one object, or an array when batching.
fn unit_line(unit: &[usize], requests: &[String], batched: bool) -> String {
    if batched {
        let parts: Vec<&str> = unit.iter().map(|&i| requests[i].as_str()).collect();
        format!("[{}]", parts.join(","))
    } else {
        requests[unit[0]].clone()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
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
        let base = self
            .next_id
            .fetch_add(items.len() as u64, Ordering::Relaxed);
        let requests: Vec<String> = items
            .iter()
            .enumerate()
            .map(|(i, it)| request_json(base + i as u64, it))
            .collect();
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

enum Out {
    Line(String),
    Eof,
}

/// One running scorer process and the threads that feed it and read it.
struct Proc {
    child: Child,
    /// Lines for the writer thread; dropping it closes the scorer's stdin.
    input: Option<Sender<String>>,
    /// Lines the scorer wrote to stdout, then `Eof`.
    output: Receiver<Out>,
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
    fn spawn(spec: &CommandSpec, name: &str) -> Result<Proc> {
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
        thread("out")
            .spawn(move || {
                let mut r = BufReader::new(stdout);
                let mut buf = vec![];
                loop {
                    buf.clear();
                    match r.read_until(b'\n', &mut buf) {
                        Ok(0) | Err(_) => {
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
                while matches!(r.read_until(b'\n', &mut buf), Ok(n) if n > 0) {
                    let line = String::from_utf8_lossy(&buf).trim_end().to_owned();
                    buf.clear();
                    info!(reward = %name2, "scorer: {line}");
                    let mut t = lock(&tail2);
                    if t.len() == STDERR_TAIL {
                        t.pop_front();
                    }
                    t.push_back(line);
                }
                // Whatever a scorer writes without a final newline is kept too.
                let _ = r.read_to_end(&mut buf);
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

    fn send(&self, mut line: String) {
        line.push('\n');
        if let Some(tx) = &self.input {
            // A failed send means the writer stopped (the scorer closed stdin or died); the
            // reader then reports the end of stdout and the requests count as crashed.
            let _ = tx.send(line);
        }
    }

    fn exit_status(&mut self) -> Option<ExitStatus> {
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
    fn reap(&mut self, grace: Duration) -> String {
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

    fn wait_stderr(&self, d: Duration) {
        let _ = self.stderr_done.recv_timeout(d);
    }

    fn stderr_tail(&self) -> String {
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
    fn kill(&mut self) {
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

fn describe(s: ExitStatus) -> String {
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

/// Process group, resource limits and network namespace, set between fork and exec.
mod sandbox {
    use std::process::{Child, Command};

    use super::CommandSpec;

    /// The scorer gets its own process group (so that it can be killed with everything it
    /// started), and the spec's limits. Runs in the child before exec: system calls only, no
    /// allocation.
    pub(super) fn apply(cmd: &mut Command, spec: &CommandSpec) {
        use std::os::unix::process::CommandExt;
        let cpu = spec.cpu_seconds;
        let mem = spec.memory_mb.map(|mb| mb.saturating_mul(1 << 20));
        let net = spec.no_network.then(UserMaps::current);
        // SAFETY: the closure only makes async-signal-safe system calls on data prepared
        // before the fork.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setpgid(0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if let Some(s) = cpu {
                    // SIGXCPU at `s` seconds, SIGKILL one second later if that is ignored.
                    limit(libc::RLIMIT_CPU, s, s.saturating_add(1))?;
                }
                if let Some(b) = mem {
                    limit(libc::RLIMIT_AS, b, b)?;
                }
                if let Some(maps) = &net {
                    unshare_net(maps)?;
                }
                Ok(())
            });
        }
    }

    #[cfg(target_os = "linux")]
    type Resource = libc::__rlimit_resource_t;
    #[cfg(not(target_os = "linux"))]
    type Resource = libc::c_int;

    /// Lowers a limit (never above the current hard limit, which cannot be raised).
    fn limit(res: Resource, soft: u64, hard: u64) -> std::io::Result<()> {
        let mut cur = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: plain system calls on a local struct.
        unsafe {
            if libc::getrlimit(res, &mut cur) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            let max = (hard as libc::rlim_t).min(cur.rlim_max);
            let new = libc::rlimit {
                rlim_cur: (soft as libc::rlim_t).min(max),
                rlim_max: max,
            };
            if libc::setrlimit(res, &new) != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        Ok(())
    }

    /// The uid/gid maps that keep our ids inside a new user namespace (needed when we are not
    /// privileged enough to make a network namespace directly).
    pub(super) struct UserMaps {
        uid: Vec<u8>,
        gid: Vec<u8>,
    }

    impl UserMaps {
        pub(super) fn current() -> Self {
            // SAFETY: getuid/getgid cannot fail.
            let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
            UserMaps {
                uid: format!("{uid} {uid} 1\n").into_bytes(),
                gid: format!("{gid} {gid} 1\n").into_bytes(),
            }
        }
    }

    #[cfg(target_os = "linux")]
    fn unshare_net(maps: &UserMaps) -> std::io::Result<()> {
        // SAFETY: system calls only; paths are static C strings, contents prepared before fork.
        unsafe {
            if libc::unshare(libc::CLONE_NEWNET) == 0 {
                return Ok(());
            }
            let direct = std::io::Error::last_os_error();
            if libc::unshare(libc::CLONE_NEWUSER | libc::CLONE_NEWNET) != 0 {
                return Err(direct);
            }
            write_file(c"/proc/self/setgroups", b"deny");
            write_file(c"/proc/self/uid_map", &maps.uid);
            write_file(c"/proc/self/gid_map", &maps.gid);
        }
        Ok(())
    }

    #[cfg(not(target_os = "linux"))]
    fn unshare_net(_: &UserMaps) -> std::io::Result<()> {
        Err(std::io::Error::from(std::io::ErrorKind::Unsupported))
    }

    #[cfg(target_os = "linux")]
    unsafe fn write_file(path: &std::ffi::CStr, data: &[u8]) {
        let fd = libc::open(path.as_ptr(), libc::O_WRONLY);
        if fd >= 0 {
            libc::write(fd, data.as_ptr().cast(), data.len());
            libc::close(fd);
        }
    }

    /// Whether a child can get a new network namespace here: a fork that only tries it.
    pub(super) fn probe_no_network() -> std::io::Result<()> {
        use std::os::unix::process::CommandExt;
        let exe = std::env::current_exe().unwrap_or_else(|_| "/bin/sh".into());
        let maps = UserMaps::current();
        let mut cmd = Command::new(exe);
        cmd.stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        // SAFETY: system calls only; on success the child leaves before exec with _exit.
        unsafe {
            cmd.pre_exec(move || {
                unshare_net(&maps)?;
                libc::_exit(0)
            });
        }
        let mut child = cmd.spawn()?;
        let _ = child.wait();
        Ok(())
    }

    /// SIGKILL to the scorer's process group: the scorer and whatever it started that is still
    /// running. Linux does not hand out a process id again while a group of that id has
    /// members, so right after the scorer was reaped this still reaches only its leftovers; the
    /// caller sends it once, at the first kill.
    pub(super) fn kill_group(child: &Child) {
        let pid = child.id() as libc::pid_t;
        if pid > 0 {
            // SAFETY: a signal to the group the scorer leads (setpgid in `apply`).
            unsafe {
                libc::kill(-pid, libc::SIGKILL);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// HTTP

/// The scorer as an HTTP endpoint: each request (or batch) is POSTed as the JSON body.
pub struct HttpScorer {
    spec: HttpSpec,
    name: String,
    agent: ureq::Agent,
    next_id: AtomicU64,
    stats: Mutex<ScorerStats>,
}

impl HttpScorer {
    /// Prepares the client; nothing is sent until `score`.
    pub fn start(spec: HttpSpec, name: &str) -> Result<Self> {
        // A scorer endpoint is usually local: proxy variables meant for downloads are not used.
        let agent = ureq::AgentBuilder::new()
            .try_proxy_from_env(false)
            .timeout(spec.timeout)
            .max_idle_connections_per_host(spec.max_in_flight)
            .user_agent(concat!("grpo/", env!("CARGO_PKG_VERSION")))
            .build();
        Ok(HttpScorer {
            spec,
            name: name.to_owned(),
            agent,
            next_id: AtomicU64::new(0),
            stats: Mutex::new(ScorerStats::default()),
        })
    }

    /// One reward per item, NaN where the endpoint answered null or garbage, returned an error
    /// status, could not be reached or did not answer within `timeout_s` (each counted and
    /// warned about).
    pub fn score(&self, items: &[ScoreItem]) -> Result<Vec<f32>> {
        if items.is_empty() {
            return Ok(vec![]);
        }
        let base = self
            .next_id
            .fetch_add(items.len() as u64, Ordering::Relaxed);
        let requests: Vec<String> = items
            .iter()
            .enumerate()
            .map(|(i, it)| request_json(base + i as u64, it))
            .collect();
        let queue = Mutex::new(units(items.len(), self.spec.batch_size));
        let tally = Mutex::new(Tally::new(items.len()));
        let workers = self.spec.max_in_flight.min(lock(&queue).len());
        std::thread::scope(|s| {
            for _ in 0..workers {
                s.spawn(|| loop {
                    let Some(unit) = lock(&queue).pop_front() else {
                        return;
                    };
                    self.post(&unit, &requests, base, &tally);
                });
            }
        });
        let tally = tally.into_inner().unwrap_or_else(|e| e.into_inner());
        Ok(tally.finish(&self.name, &self.stats))
    }

    fn post(&self, unit: &[usize], requests: &[String], base: u64, tally: &Mutex<Tally>) {
        let batched = self.spec.batch_size > 1;
        let body = unit_line(unit, requests, batched);
        let mut req = self
            .agent
            .post(&self.spec.url)
            .set("Content-Type", "application/json");
        for (k, v) in &self.spec.headers {
            req = req.set(k, v);
        }
        let fail = |miss: Miss, what: String| {
            let mut t = lock(tally);
            t.show_error(what);
            for &i in unit {
                t.set(i, Err(miss));
            }
        };
        let text = match req.send_string(&body) {
            Ok(resp) => match resp.into_string() {
                Ok(t) => t,
                Err(e) => {
                    let miss = if is_timeout_io(&e) {
                        Miss::Timeout
                    } else {
                        Miss::HttpError
                    };
                    return fail(miss, format!("reading the answer: {e}"));
                }
            },
            Err(ureq::Error::Status(code, resp)) => {
                let body = resp.into_string().unwrap_or_default();
                return fail(
                    Miss::HttpError,
                    format!("status {code}: {}", excerpt(&body)),
                );
            }
            Err(ureq::Error::Transport(t)) => {
                let timed_out = std::error::Error::source(&t)
                    .and_then(|s| s.downcast_ref::<std::io::Error>())
                    .is_some_and(is_timeout_io);
                let miss = if timed_out {
                    Miss::Timeout
                } else {
                    Miss::HttpError
                };
                return fail(miss, format!("{}: {t}", self.spec.url));
            }
        };
        let (answers, _) = parse_answers(&text);
        let mut t = lock(tally);
        let mut left: Vec<usize> = unit.to_vec();
        for a in answers {
            match a {
                Answer::Bad(what) => t.garbage_line(what),
                Answer::For { id, outcome, note } => {
                    let pos = id
                        .checked_sub(base)
                        .and_then(|i| left.iter().position(|&j| j as u64 == i));
                    let Some(pos) = pos else {
                        t.garbage_line(format!(
                            "unknown id {id} (not in this request): {}",
                            excerpt(&text)
                        ));
                        continue;
                    };
                    let item = left.swap_remove(pos);
                    if let Some(n) = note {
                        t.show_garbage(n);
                    }
                    t.set(item, outcome);
                }
            }
        }
        if !left.is_empty() {
            let ids: Vec<u64> = left.iter().map(|&i| base + i as u64).collect();
            t.show_garbage(format!("the answer lacked ids {ids:?}"));
            for i in left {
                t.set(i, Err(Miss::Garbage));
            }
        }
    }

    /// Counters since start.
    pub fn stats(&self) -> ScorerStats {
        *lock(&self.stats)
    }
}

fn is_timeout_io(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Map;

    fn table_of(json: &str) -> Map<String, Value> {
        serde_json::from_str(json).unwrap()
    }

    fn command_spec(json: &str) -> Result<CommandSpec> {
        let obj = table_of(json);
        CommandSpec::from_table(&Table::new(&obj, 3, CommandSpec::KEYS)?)
    }

    fn http_spec(json: &str) -> Result<HttpSpec> {
        let obj = table_of(json);
        HttpSpec::from_table(&Table::new(&obj, 1, HttpSpec::KEYS)?)
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
    fn http_options_and_errors() {
        let s = http_spec(
            r#"{"kind": "http", "url": "http://127.0.0.1:9/score", "timeout_s": 2, "batch_size": 4,
                "headers": {"Authorization": "Bearer t"}}"#,
        )
        .unwrap();
        assert_eq!(s.url, "http://127.0.0.1:9/score");
        assert_eq!(
            (s.timeout, s.max_in_flight, s.batch_size),
            (Duration::from_secs(2), 8, 4)
        );
        assert_eq!(s.headers, [("Authorization".into(), "Bearer t".into())]);
        for (json, key, says) in [
            (r#"{"kind": "http"}"#, "rewards[1].url", "missing"),
            (
                r#"{"kind": "http", "url": "localhost:80"}"#,
                "rewards[1].url",
                "http://",
            ),
            (
                r#"{"kind": "http", "url": "http://x", "headers": "a"}"#,
                "rewards[1].headers",
                "table",
            ),
            (
                r#"{"kind": "http", "url": "http://x", "max_in_flight": 0}"#,
                "rewards[1].max_in_flight",
                "at least 1",
            ),
            (
                r#"{"kind": "http", "url": "http://x", "command": "a"}"#,
                "rewards[1].command",
                "unknown key",
            ),
        ] {
            let e = http_spec(json).unwrap_err().to_string();
            assert!(
                e.contains(&format!("`{key}`")) && e.contains(says),
                "{json}: {e}"
            );
        }
    }

    #[test]
    fn answers_are_parsed_by_id_and_kind() {
        let one = |line: &str| {
            let (mut a, arr) = parse_answers(line);
            assert!(!arr && a.len() == 1, "{line}");
            a.remove(0)
        };
        assert!(
            matches!(one(r#"{"id": 3, "reward": 0.5}"#), Answer::For { id: 3, outcome: Ok(x), note: None } if x == 0.5)
        );
        assert!(
            matches!(one(r#"{"reward": 1, "id": 4}"#), Answer::For { id: 4, outcome: Ok(x), .. } if x == 1.0)
        );
        assert!(matches!(
            one(r#"{"id": 3, "reward": null}"#),
            Answer::For {
                outcome: Err(Miss::Null),
                note: None,
                ..
            }
        ));
        for garbage in [
            r#"{"id": 3, "reward": "0.5"}"#,
            r#"{"id": 3, "reward": true}"#,
            r#"{"id": 3}"#,
            r#"{"id": 3, "reward": 1e300}"#,
        ] {
            assert!(
                matches!(
                    one(garbage),
                    Answer::For {
                        id: 3,
                        outcome: Err(Miss::Garbage),
                        note: Some(_)
                    }
                ),
                "{garbage}"
            );
        }
        for bad in [
            "hello",
            r#"{"id": "3", "reward": 1}"#,
            r#"{"id": -1, "reward": 1}"#,
            "17",
            r#"{"id": 3, "reward": NaN}"#,
        ] {
            assert!(matches!(one(bad), Answer::Bad(_)), "{bad}");
        }
        let (a, arr) = parse_answers(r#"[{"id": 1, "reward": 1}, {"id": 0, "reward": 0}, 5]"#);
        assert!(arr && a.len() == 3);
        assert!(matches!(a[2], Answer::Bad(_)));
    }

    #[test]
    fn scorers_can_be_shared_between_threads() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<CommandScorer>();
        send_sync::<HttpScorer>();
    }

    #[test]
    fn units_and_lines() {
        let reqs: Vec<String> = (0..5).map(|i| format!("{{\"id\":{i}}}")).collect();
        let u = units(5, 2);
        assert_eq!(u, [vec![0, 1], vec![2, 3], vec![4]]);
        assert_eq!(unit_line(&u[0], &reqs, true), r#"[{"id":0},{"id":1}]"#);
        assert_eq!(unit_line(&u[2], &reqs, true), r#"[{"id":4}]"#);
        assert_eq!(unit_line(&[3], &reqs, false), r#"{"id":3}"#);
    }

    #[test]
    fn request_lines_carry_the_item() {
        let ex = crate::data::Example {
            prompt: crate::data::Prompt::Text("What is 2 + 2?".into()),
            answer: Some("4".into()),
            metadata: table_of(r#"{"level": 1}"#),
            origin: "t".into(),
        };
        let line = request_json(17, &ScoreItem::new(&ex, "It is 4."));
        let v: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"id": 17, "prompt": "What is 2 + 2?", "completion": "It is 4.",
                               "answer": "4", "metadata": {"level": 1}})
        );
        assert!(!line.contains('\n'));
    }
}
