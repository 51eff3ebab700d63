//! An agent's world as a program or an HTTP service speaking a small JSON protocol
//! (`environment_command`, `environment_url`), for environments that are not Python: games,
//! compilers, sandboxes. The protocol is in `docs/agents.md` (Environments as programs or
//! services); in short, with `e` the episode and `n` a request id:
//!
//! - `{"id": n, "op": "reset", "episode": e, "row": {...}}` -> `{"id": n, "observation": str |
//!   null}` (the dataset row; the observation is appended to the prompt);
//! - `{"id": n, "op": "step", "episode": e, "action": str}` -> `{"id": n, "observation": str |
//!   null, "reward": float | null, "done": bool}` (the model's whole turn);
//! - `{"id": n, "op": "close", "episode": e}` -> `{"id": n}`;
//!
//! and any answer may be `{"id": n, "error": "message"}` instead. A close must be answered for
//! any episode: at start each program copy gets `{"id": 0, "op": "close", "episode": 0}`, and
//! one that does not answer it is refused. A program gets one request per
//! line on stdin and writes one answer per line on stdout (one request at a time per process);
//! a service gets each request POSTed as the JSON body to `{url}/reset`, `{url}/step` or
//! `{url}/close` and answers with the JSON body.
//!
//! A program runs in `processes` copies; episode `e` lives in copy `e % processes`, and every
//! request of that episode goes there (its state lives in the process). The copies run as
//! scorer programs do (`docs/security.md`): a minimal environment (plus `PYTHONPATH`,
//! `VIRTUAL_ENV`, `CONDA_PREFIX`), a process group of their own, the limits of
//! [`EnvSpec`] (CPU seconds, memory, no network), stdin and stdout for the protocol, stderr
//! logged line by line.
//!
//! Nothing an environment does is an error of the trainer: a failed request costs only its
//! episode, as a [`CallError`] of kind
//! - `timeout`: no answer within `timeout`; the process is killed with its group and started
//!   again;
//! - `crash`: the process exited (it is started again; one that exits [`MAX_START_FAILURES`]
//!   times in a row before answering anything is given up, and its requests fail at once);
//! - `garbage`: an answer line that is not a JSON object, or fields of the wrong type (the
//!   process keeps running: the episode's answer is lost, not the others' state);
//! - `output_too_large`: an answer over the bound (observations are cut to
//!   `max_observation_chars` first); the process is started again;
//! - `http_error` (services): an error status or a failed connection;
//! - `env_reset` / `env_error`: the environment answered `{"error": ...}` to a reset / a step;
//! - `environment_lost`: the episode's process was started again since its reset (its state
//!   went with the old one).

use std::collections::{BTreeMap, HashSet};
use std::io::Read;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::RecvTimeoutError;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};
use tracing::warn;

use super::calls::{call_error, CallError};
use super::lock;
use crate::rewards::command::{is_timeout_io, CommandSpec, Out, Proc, PYTHON_ENV};
use crate::{Error, Result};

/// How long a program may take, at start, to answer its first request (a slow import, a game
/// engine loading).
const START_TIMEOUT: Duration = Duration::from_secs(120);
/// The request that checks, at start, that a program answers: the close of an episode it never
/// saw (id 0; requests then count from 1).
const PROBE: &str = r#"{"id": 0, "op": "close", "episode": 0}"#;
/// Exits before any answer, in a row, after which a process is given up.
pub const MAX_START_FAILURES: usize = 3;
/// Failures warned about (then only counted).
const WARNINGS: u64 = 10;

/// Where the environment lives.
#[derive(Debug, Clone, PartialEq)]
pub enum Transport {
    /// A program and its arguments (`environment_command`), speaking JSON lines.
    Command(Vec<String>),
    /// A service's base address (`environment_url`), POSTed to at `{url}/{op}`.
    Http(String),
}

impl Transport {
    /// The config key that sets it, for errors.
    pub fn key(&self) -> &'static str {
        match self {
            Transport::Command(_) => "environment_command",
            Transport::Http(_) => "environment_url",
        }
    }
}

/// The options of an environment program or service.
#[derive(Debug, Clone, PartialEq)]
pub struct EnvSpec {
    pub transport: Transport,
    /// Program copies (each one request at a time), or requests at once to a service.
    pub processes: usize,
    /// How long one request may take.
    pub timeout: Duration,
    /// An observation is cut to this many characters, with a `... [cut: N chars]` marker.
    pub max_observation_chars: usize,
    /// A program's RLIMIT_CPU (CPU seconds over its life), as a scorer's `cpu_seconds`.
    pub cpu_seconds: Option<u64>,
    /// A program's RLIMIT_AS in MiB, as a scorer's `memory_mb`.
    pub memory_mb: Option<u64>,
    /// A program runs in a network namespace of its own, as a scorer with `no_network`.
    pub no_network: bool,
}

impl EnvSpec {
    /// A spec with the `[agent]` defaults (4 processes, 10 s, 4096 characters).
    pub fn new(transport: Transport) -> Self {
        EnvSpec {
            transport,
            processes: 4,
            timeout: Duration::from_secs(10),
            max_observation_chars: 4096,
            cpu_seconds: None,
            memory_mb: None,
            no_network: false,
        }
    }
}

/// What one step gives the episode.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    /// The next user message (None: nothing to show).
    pub observation: Option<String>,
    /// This step's reward (None: none; the episode's reward is the sum of its steps').
    pub reward: Option<f32>,
    /// The episode is over.
    pub done: bool,
}

/// Counters since start.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EnvStats {
    pub resets: u64,
    pub steps: u64,
    /// Processes started again after a timeout, exit or oversized answer.
    pub restarts: u64,
    /// Failed requests, by [`CallError`] kind.
    pub errors: BTreeMap<&'static str, u64>,
}

/// The running environment: its programs, or the client of its service.
pub struct ProgramEnv {
    spec: EnvSpec,
    backend: Backend,
    next_id: AtomicU64,
    stats: Mutex<EnvStats>,
}

impl std::fmt::Debug for ProgramEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProgramEnv")
            .field("spec", &self.spec)
            .finish_non_exhaustive()
    }
}

enum Backend {
    Programs {
        command: CommandSpec,
        slots: Vec<Mutex<Slot>>,
    },
    Http {
        agent: ureq::Agent,
        url: String,
        /// Requests that may still start (of `processes`).
        permits: Mutex<usize>,
        freed: Condvar,
    },
}

/// One program copy and the episodes whose state lives in it.
struct Slot {
    /// None once given up (`broken` says why).
    proc: Option<Proc>,
    /// Episodes reset in this very process (a restart empties it).
    episodes: HashSet<u64>,
    /// The process answered something since it started.
    answered: bool,
    /// Exits or hangs before any answer, in a row.
    start_failures: usize,
    broken: Option<String>,
}

impl ProgramEnv {
    /// Starts the programs, each of which must answer a first request (the close of an episode
    /// it never saw), or checks that the service answers at all (one GET of its address; any
    /// HTTP status counts). Errors name the key.
    pub fn start(spec: EnvSpec) -> Result<ProgramEnv> {
        let key = spec.transport.key();
        if spec.processes == 0 || spec.timeout.is_zero() {
            return Err(Error::config(key, "the processes and timeout must be > 0"));
        }
        let backend = match &spec.transport {
            Transport::Command(argv) => start_programs(argv, &spec)?,
            Transport::Http(url) => start_http(url, &spec)?,
        };
        Ok(ProgramEnv {
            spec,
            backend,
            // Id 0 was the programs' first request.
            next_id: AtomicU64::new(1),
            stats: Mutex::new(EnvStats::default()),
        })
    }

    /// The key that configured it (`environment_command` or `environment_url`).
    pub fn key(&self) -> &'static str {
        self.spec.transport.key()
    }

    /// The program and its copies, or the service's address, for the log.
    pub fn describe(&self) -> String {
        match &self.spec.transport {
            Transport::Command(argv) => {
                format!(
                    "program `{}` ({} processes)",
                    argv.join(" "),
                    self.spec.processes
                )
            }
            Transport::Http(url) => format!("service {url}"),
        }
    }

    /// Starts episode `episode` with its dataset `row`: its first observation (None: nothing to
    /// add to the prompt).
    pub fn reset(
        &self,
        episode: u64,
        row: &Value,
    ) -> std::result::Result<Option<String>, CallError> {
        lock(&self.stats).resets += 1;
        let answer = self.request(episode, "reset", json!({"row": row}));
        let out = answer.and_then(|a| {
            error_of(&a, "env_reset")?;
            self.observation_of(&a)
        });
        self.counted(episode, "reset", out)
    }

    /// One action of episode `episode` (the model's whole turn text).
    pub fn step(&self, episode: u64, action: &str) -> std::result::Result<Step, CallError> {
        lock(&self.stats).steps += 1;
        let answer = self.request(episode, "step", json!({"action": action}));
        let out = answer.and_then(|a| {
            error_of(&a, "env_error")?;
            let reward = match a.get("reward") {
                None | Some(Value::Null) => None,
                Some(Value::Number(n)) => n.as_f64().filter(|r| r.is_finite()).map(|r| r as f32),
                Some(other) => return Err(garbage(format!("reward {other} is not a number"))),
            };
            let done = match a.get("done") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(other) => return Err(garbage(format!("done {other} is not a boolean"))),
            };
            let observation = self.observation_of(&a)?;
            Ok(Step {
                observation,
                reward,
                done,
            })
        });
        self.counted(episode, "step", out)
    }

    /// Ends episode `episode`. Failures are only counted (a program's lost episode is not sent).
    pub fn close(&self, episode: u64) {
        let out = self
            .request(episode, "close", json!({}))
            .and_then(|a| error_of(&a, "env_error"));
        if let Err(e) = out {
            if e.kind != "environment_lost" {
                self.count(e.kind);
            }
        }
    }

    /// Counters since start.
    pub fn stats(&self) -> EnvStats {
        lock(&self.stats).clone()
    }

    /// The process ids of the running programs (none for a service).
    pub fn pids(&self) -> Vec<Option<u32>> {
        match &self.backend {
            Backend::Programs { slots, .. } => slots
                .iter()
                .map(|s| lock(s).proc.as_ref().map(|p| p.child.id()))
                .collect(),
            Backend::Http { .. } => vec![],
        }
    }

    /// Counts and warns about a failed request, and passes its outcome on.
    fn counted<T>(
        &self,
        episode: u64,
        op: &str,
        out: std::result::Result<T, CallError>,
    ) -> std::result::Result<T, CallError> {
        if let Err(e) = &out {
            let n = self.count(e.kind);
            if n <= WARNINGS {
                let more = if n == WARNINGS {
                    " (further ones are only counted)"
                } else {
                    ""
                };
                warn!(
                    "{}: {op} of episode {episode} failed ({}): {}{more}",
                    self.key(),
                    e.kind,
                    e.message
                );
            }
        }
        out
    }

    /// Adds one error of `kind`; the count of that kind so far.
    fn count(&self, kind: &'static str) -> u64 {
        let mut st = lock(&self.stats);
        let n = st.errors.entry(kind).or_default();
        *n += 1;
        *n
    }

    /// An answer's observation, cut to the bound.
    fn observation_of(
        &self,
        a: &Map<String, Value>,
    ) -> std::result::Result<Option<String>, CallError> {
        match a.get("observation") {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(cut(s, self.spec.max_observation_chars))),
            Some(other) => Err(garbage(format!(
                "observation {} is not a string",
                excerpt(&other.to_string())
            ))),
        }
    }

    /// Sends `{"id", "op", "episode", ...fields}` to the episode's process (or POSTs it to the
    /// service) and returns the answer object.
    fn request(
        &self,
        episode: u64,
        op: &'static str,
        fields: Value,
    ) -> std::result::Result<Map<String, Value>, CallError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut request = json!({"id": id, "op": op, "episode": episode});
        if let (Some(r), Value::Object(f)) = (request.as_object_mut(), fields) {
            r.extend(f);
        }
        match &self.backend {
            Backend::Programs { command, slots } => {
                let s = &mut lock(&slots[(episode % slots.len() as u64) as usize]);
                if op != "reset" && !s.episodes.contains(&episode) {
                    return Err(call_error(
                        "environment_lost",
                        format!("episode {episode} has no environment (its process was restarted)"),
                    ));
                }
                let answer = self.exchange(command, s, &request, id)?;
                match op {
                    "reset" => s.episodes.insert(episode),
                    "close" => s.episodes.remove(&episode),
                    _ => true,
                };
                Ok(answer)
            }
            Backend::Http {
                agent,
                url,
                permits,
                freed,
            } => {
                let _permit = Permit::take(permits, freed);
                self.post(agent, url, op, &request)
            }
        }
    }

    /// The longest answer taken (observations are cut before, so this only stops runaways).
    fn answer_limit(&self) -> usize {
        self.spec
            .max_observation_chars
            .saturating_mul(4)
            .max(1 << 20)
    }

    /// Writes one request line to the slot's process and waits for the answer with its id.
    /// Restarts the process on a timeout, an exit or an oversized answer.
    fn exchange(
        &self,
        command: &CommandSpec,
        s: &mut Slot,
        request: &Value,
        id: u64,
    ) -> std::result::Result<Map<String, Value>, CallError> {
        self.ensure_running(command, s)?;
        let limit = self.spec.timeout;
        let deadline = Instant::now() + limit;
        if let Some(p) = &s.proc {
            p.send(request.to_string());
        }
        loop {
            let Some(p) = s.proc.as_mut() else {
                return Err(call_error(
                    "crash",
                    "the environment program is not running",
                ));
            };
            let now = Instant::now();
            if now >= deadline {
                let m = format!(
                    "the environment program did not answer within {:.1} s and was stopped",
                    limit.as_secs_f64()
                );
                s.start_failures += usize::from(!s.answered);
                self.restart(command, s, &m);
                return Err(call_error("timeout", m));
            }
            match p.output.recv_timeout(deadline - now) {
                Ok(Out::Line(line)) if line.len() > self.answer_limit() => {
                    let m = format!(
                        "the environment program answered {} bytes, over the {} allowed",
                        line.len(),
                        self.answer_limit()
                    );
                    self.restart(command, s, &m);
                    return Err(call_error("output_too_large", m));
                }
                Ok(Out::Line(line)) => {
                    let Ok(Value::Object(answer)) = serde_json::from_str::<Value>(&line) else {
                        s.answered = true;
                        return Err(garbage(format!(
                            "the environment program answered {} (not a JSON object)",
                            excerpt(&line)
                        )));
                    };
                    (s.answered, s.start_failures) = (true, 0);
                    if answer.get("id").and_then(Value::as_u64) == Some(id) {
                        return Ok(answer);
                    }
                    // Otherwise a late answer to a request that already failed.
                }
                Ok(Out::Eof) | Err(RecvTimeoutError::Disconnected) => {
                    let m = self.exited(s, "during a request");
                    self.restart(command, s, &m);
                    return Err(call_error("crash", m));
                }
                Err(RecvTimeoutError::Timeout) => {}
            }
        }
    }

    /// The slot's process closed its stdout: why, for the error and the log.
    fn exited(&self, s: &mut Slot, when: &str) -> String {
        s.start_failures += usize::from(!s.answered);
        let Some(p) = s.proc.as_mut() else {
            return "the environment program is not running".into();
        };
        let status = p.reap(Duration::from_millis(500));
        format!(
            "the environment program exited {when} ({status}). Its last stderr lines:\n{}",
            p.stderr_tail()
        )
    }

    /// Before a request: a process that exited while idle is started again, and lines left
    /// from an earlier request are dropped.
    fn ensure_running(
        &self,
        command: &CommandSpec,
        s: &mut Slot,
    ) -> std::result::Result<(), CallError> {
        if let Some(p) = s.proc.as_mut() {
            let mut dead = p.exit_status().is_some();
            while let Ok(o) = p.output.try_recv() {
                dead |= matches!(o, Out::Eof);
            }
            if dead {
                let m = self.exited(s, "while idle");
                self.restart(command, s, &m);
            }
        }
        match (&s.proc, &s.broken) {
            (Some(_), _) => Ok(()),
            (None, Some(why)) => Err(call_error(
                "crash",
                format!("the environment program cannot be started again: {why}"),
            )),
            (None, None) => Err(call_error(
                "crash",
                "the environment program is not running",
            )),
        }
    }

    /// Kills the slot's process (with its group) and starts a fresh one, unless it failed
    /// [`MAX_START_FAILURES`] times in a row before answering. Its episodes are lost.
    fn restart(&self, command: &CommandSpec, s: &mut Slot, why: &str) {
        let pid = s.proc.as_ref().map(|p| p.child.id());
        if let Some(mut p) = s.proc.take() {
            p.kill();
        }
        let lost = std::mem::take(&mut s.episodes).len();
        s.answered = false;
        let broken = if s.start_failures >= MAX_START_FAILURES {
            Some(format!(
                "it exited {} times in a row before answering",
                s.start_failures
            ))
        } else {
            warn!(
                "{}: restarting the environment program (pid {pid:?}; {lost} episode(s) \
                 lost): {why}",
                self.key()
            );
            match Proc::spawn(command, "environment") {
                Ok(p) => {
                    s.proc = Some(p);
                    lock(&self.stats).restarts += 1;
                    None
                }
                Err(e) => Some(e.to_string()),
            }
        };
        if let Some(b) = broken {
            warn!(
                "{}: giving up the environment program (pid {pid:?}): {b}; then: {why}",
                self.key()
            );
            s.broken = Some(b);
        }
    }

    /// POSTs the request to `{url}/{op}` and reads the answer object.
    fn post(
        &self,
        agent: &ureq::Agent,
        url: &str,
        op: &str,
        request: &Value,
    ) -> std::result::Result<Map<String, Value>, CallError> {
        let at = format!("{}/{op}", url.trim_end_matches('/'));
        let resp = agent
            .post(&at)
            .set("Content-Type", "application/json")
            .send_string(&request.to_string());
        let resp = match resp {
            Ok(r) => r,
            Err(ureq::Error::Status(code, r)) => {
                let body = r.into_string().unwrap_or_default();
                return Err(call_error(
                    "http_error",
                    format!("{at}: status {code}: {}", excerpt(&body)),
                ));
            }
            Err(ureq::Error::Transport(t)) => {
                let timed_out = std::error::Error::source(&t)
                    .and_then(|s| s.downcast_ref::<std::io::Error>())
                    .is_some_and(is_timeout_io);
                let kind = if timed_out { "timeout" } else { "http_error" };
                return Err(call_error(kind, format!("{at}: {t}")));
            }
        };
        let limit = self.answer_limit();
        let mut body = String::new();
        let read = resp
            .into_reader()
            .take(limit as u64 + 1)
            .read_to_string(&mut body);
        match read {
            Err(e) if is_timeout_io(&e) => {
                return Err(call_error(
                    "timeout",
                    format!("{at}: reading the answer: {e}"),
                ))
            }
            Err(e) => {
                return Err(call_error(
                    "http_error",
                    format!("{at}: reading the answer: {e}"),
                ))
            }
            Ok(n) if n > limit => {
                return Err(call_error(
                    "output_too_large",
                    format!("{at}: an answer over the {limit} bytes allowed"),
                ))
            }
            Ok(_) => {}
        }
        match serde_json::from_str::<Value>(&body) {
            Ok(Value::Object(a)) => Ok(a),
            _ => Err(garbage(format!(
                "{at} answered {} (not a JSON object)",
                excerpt(&body)
            ))),
        }
    }
}

/// Spawns the program copies and checks that none exits at once.
fn start_programs(argv: &[String], spec: &EnvSpec) -> Result<Backend> {
    let key = spec.transport.key();
    if argv.first().is_none_or(|p| p.is_empty()) {
        return Err(Error::config(
            key,
            "is empty: give the program and its arguments",
        ));
    }
    let mut command = CommandSpec::new(argv.to_vec());
    command.timeout = spec.timeout;
    command.inherit_env = PYTHON_ENV.iter().map(|s| s.to_string()).collect();
    (command.cpu_seconds, command.memory_mb) = (spec.cpu_seconds, spec.memory_mb);
    command.no_network = spec.no_network;
    let spawn = || {
        Proc::spawn(&command, "environment").map_err(|e| {
            let m = e.to_string();
            let m = m
                .strip_prefix("reward `environment`: ")
                .unwrap_or(&m)
                .to_string();
            Error::config(key, m.replace("scorer", "environment program"))
        })
    };
    let mut procs = (0..spec.processes)
        .map(|_| spawn())
        .collect::<Result<Vec<_>>>()?;
    // Every copy must answer a first request: one that cannot run (a missing script, a syntax
    // error) or does not speak the protocol stops the run here.
    for p in &procs {
        p.send(PROBE.to_string());
    }
    let limit = START_TIMEOUT.max(spec.timeout);
    let deadline = Instant::now() + limit;
    for p in &mut procs {
        probe(p, deadline, limit).map_err(|why| {
            Error::config(
                key,
                format!(
                    "the environment program `{}` {why}. Its last stderr lines:\n{}",
                    argv.join(" "),
                    p.stderr_tail()
                ),
            )
        })?;
    }
    let slots = procs
        .into_iter()
        .map(|p| {
            Mutex::new(Slot {
                proc: Some(p),
                episodes: HashSet::new(),
                answered: true,
                start_failures: 0,
                broken: None,
            })
        })
        .collect();
    Ok(Backend::Programs { command, slots })
}

/// Waits for the answer to [`PROBE`]: why the program fails it, if it does.
fn probe(p: &mut Proc, deadline: Instant, limit: Duration) -> std::result::Result<(), String> {
    loop {
        let now = Instant::now();
        if now >= deadline {
            p.kill();
            let secs = limit.as_secs();
            return Err(format!(
                "did not answer its first request ({PROBE}) within {secs} s"
            ));
        }
        match p.output.recv_timeout(deadline - now) {
            Ok(Out::Line(line)) => match serde_json::from_str::<Value>(&line) {
                Ok(Value::Object(a)) if a.get("id").and_then(Value::as_u64) == Some(0) => {
                    return Ok(())
                }
                _ => {
                    p.kill();
                    return Err(format!(
                        "answered its first request ({PROBE}) with {} (not a JSON object with \
                         its id)",
                        excerpt(&line)
                    ));
                }
            },
            Ok(Out::Eof) | Err(RecvTimeoutError::Disconnected) => {
                let status = p.reap(Duration::from_secs(1));
                return Err(format!("exited at start ({status})"));
            }
            Err(RecvTimeoutError::Timeout) => {}
        }
    }
}

/// The service's client, once its address answers a GET (any status).
fn start_http(url: &str, spec: &EnvSpec) -> Result<Backend> {
    let key = spec.transport.key();
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        return Err(Error::config(
            key,
            format!("`{url}` must start with http:// or https://"),
        ));
    }
    // An environment service is usually local: proxy variables meant for downloads are not used.
    let agent = ureq::AgentBuilder::new()
        .try_proxy_from_env(false)
        .timeout(spec.timeout)
        .max_idle_connections_per_host(spec.processes)
        .user_agent(concat!("grpo/", env!("CARGO_PKG_VERSION")))
        .build();
    match agent.get(url).call() {
        Ok(_) | Err(ureq::Error::Status(..)) => {}
        Err(ureq::Error::Transport(t)) => {
            return Err(Error::config(
                key,
                format!(
                    "the environment service {url} does not answer ({t}); start it before \
                     training, or fix {key}"
                ),
            ))
        }
    }
    Ok(Backend::Http {
        agent,
        url: url.to_string(),
        permits: Mutex::new(spec.processes),
        freed: Condvar::new(),
    })
}

/// One of a service's `processes` requests at once, given back when dropped.
struct Permit<'a>(&'a Mutex<usize>, &'a Condvar);

impl<'a> Permit<'a> {
    fn take(permits: &'a Mutex<usize>, freed: &'a Condvar) -> Permit<'a> {
        let mut n = lock(permits);
        while *n == 0 {
            n = freed.wait(n).unwrap_or_else(|e| e.into_inner());
        }
        *n -= 1;
        Permit(permits, freed)
    }
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        *lock(self.0) += 1;
        self.1.notify_one();
    }
}

/// An answer's `error` (a message, or any JSON) as a [`CallError`] of `kind`.
fn error_of(a: &Map<String, Value>, kind: &'static str) -> std::result::Result<(), CallError> {
    match a.get("error") {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(m)) => Err(call_error(kind, short(m))),
        Some(other) => Err(call_error(kind, short(&other.to_string()))),
    }
}

fn garbage(message: String) -> CallError {
    call_error("garbage", message)
}

/// `s` cut to `max` characters, with the tools' marker (N: the characters left out).
fn cut(s: &str, max: usize) -> String {
    let n = s.chars().count();
    if n <= max {
        return s.to_string();
    }
    let kept: String = s.chars().take(max).collect();
    format!("{kept}... [cut: {} chars]", n - max)
}

/// The start of a text, for messages.
fn short(s: &str) -> String {
    let mut out: String = s.chars().take(200).collect();
    if s.chars().nth(200).is_some() {
        out.push_str("...");
    }
    out
}

/// The start of a text, quoted, for messages about answers.
fn excerpt(s: &str) -> String {
    format!("{:?}", short(s))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_environment_can_be_shared_between_threads() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<ProgramEnv>();
    }

    #[test]
    fn long_observations_are_cut_with_the_tools_marker() {
        assert_eq!(cut("abcdef", 10), "abcdef");
        assert_eq!(cut("abcdef", 4), "abcd... [cut: 2 chars]");
        assert_eq!(cut("ééé", 1), "é... [cut: 2 chars]");
    }

    #[test]
    fn errors_are_read_as_their_kind() {
        let a: Map<String, Value> =
            serde_json::from_str(r#"{"id": 1, "error": "no such row"}"#).unwrap();
        let e = error_of(&a, "env_reset").unwrap_err();
        assert_eq!((e.kind, e.message.as_str()), ("env_reset", "no such row"));
        let a: Map<String, Value> = serde_json::from_str(r#"{"id": 1, "error": null}"#).unwrap();
        assert!(error_of(&a, "env_error").is_ok());
    }

    #[test]
    fn bad_addresses_and_empty_commands_are_refused_naming_the_key() {
        let e = ProgramEnv::start(EnvSpec::new(Transport::Http("localhost:80".into())))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`environment_url`") && e.contains("http://"),
            "{e}"
        );
        let e = ProgramEnv::start(EnvSpec::new(Transport::Command(vec![])))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`environment_command`") && e.contains("empty"),
            "{e}"
        );
    }
}
