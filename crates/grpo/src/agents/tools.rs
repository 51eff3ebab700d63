//! The user's Python tools and environment, run in long-lived Python processes (the tool host,
//! `tool_host.py`, embedded and started as `python -c`), as TRL's `GRPOTrainer(tools=[...],
//! environment_factory=...)` runs them in its own process.
//!
//! `processes` copies of the host run side by side, each busy with one call at a time. A plain
//! tool call goes to any free process (and waits for one when all are busy: that is the
//! concurrency limit); an episode's environment instance lives in process `episode % processes`,
//! and every call of that episode goes there.
//!
//! Nothing a tool does is an error of the trainer: every failure of a call is a [`CallError`]
//! the episode loop shows the model, by `kind`:
//! - `raised`: the tool raised (the message has the exception and the last traceback lines);
//! - `arguments`: the arguments do not fit the tool's signature;
//! - `unknown_tool`: no tool or environment method has that name;
//! - `timeout`: no answer within `timeout`; the process is killed with everything it started
//!   (its process group) and a fresh one is started;
//! - `crash`: the process exited during the call (`os._exit`, a segfault), or cannot be started
//!   again; it is restarted (at most [`MAX_START_FAILURES`] failed starts in a row, then its calls
//!   fail at once). Messages stay short, for the model; the exit status and the process's last
//!   stderr lines go to the log (a warning);
//! - `output_too_large`: an answer line over the bound (results are cut by the host to
//!   `max_result_chars` first, so this is rare); the process is restarted;
//! - `garbage`: an answer that is not JSON, or has no result;
//! - `environment_lost`: the episode has no environment instance (never reset, closed, or lost
//!   because its process was restarted after a timeout or crash);
//! - `env_reset`: `reset(**row)` raised or returned something other than a string or None.
//!
//! What a tool prints cannot disturb the protocol: the host answers on a copy of its original
//! stdout, and fd 1 (with `sys.stdout`) goes to stderr, which is read line by line (64 KB a
//! line at most) and logged at `info` (as the scorer programs' stderr is: `reward=tools`). Its
//! stdin is /dev/null.
//!
//! The processes get the minimal environment of scorer programs (see `docs/security.md`:
//! `PATH`, `HOME`, `USER`, the locale, `TZ`, `TMPDIR`, `LD_LIBRARY_PATH`) plus, since these are
//! the user's own Python tools and TRL runs them in the user's environment, `PYTHONPATH`,
//! `VIRTUAL_ENV` and `CONDA_PREFIX` (so that `my_tools.fn` importable through `PYTHONPATH`
//! works), the variables [`ToolSpec::inherit_env`] names, and what [`ToolSpec::env`] sets.
//! Nothing else of the trainer's (tokens, keys) is passed on.

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::RecvTimeoutError;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};
use tracing::warn;

use super::calls::{call_error, CallError, ToolCall};
use super::lock;
use crate::rewards::command::{describe, python_target, CommandSpec, Out, Proc, PYTHON_ENV};
use crate::{Error, Result};

/// The options of the tool host.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSpec {
    /// Tool functions: `path/to/file.py:fn`, `pkg.module:fn` or TRL's dotted `pkg.module.fn`.
    pub tools: Vec<String>,
    /// The environment class (or factory), named the same ways; called with no arguments.
    pub environment: Option<String>,
    /// The run's Python reward functions (`file.py:fn`, `pkg.module:fn`). With an environment,
    /// those that take an `environments` parameter are called here, where the instances live
    /// ([`ToolHost::env_reward_functions`]).
    pub reward_functions: Vec<String>,
    /// The Python interpreter (default: `GRPO_PYTHON`, else `python3`).
    pub python: String,
    /// How long one call may run (default 10 s).
    pub timeout: Duration,
    /// A tool's result is cut to this many characters, with a `... [cut: N chars]` marker
    /// (N: the characters left out; default 4096).
    pub max_result_chars: usize,
    /// Python processes, so calls at once at most (default 4).
    pub processes: usize,
    /// Working directory of the processes; relative tool paths are read from it (default: ours).
    pub cwd: Option<PathBuf>,
    /// Variables set for the processes.
    pub env: Vec<(String, String)>,
    /// Variables of the trainer's environment passed on, besides the base ones and
    /// `PYTHONPATH`, `VIRTUAL_ENV`, `CONDA_PREFIX` (e.g. an API key a tool needs).
    pub inherit_env: Vec<String>,
    /// RLIMIT_CPU of each process (CPU seconds over its life), as a scorer's `cpu_seconds`.
    pub cpu_seconds: Option<u64>,
    /// RLIMIT_AS of each process in MiB, as a scorer's `memory_mb`.
    pub memory_mb: Option<u64>,
    /// A network namespace of their own (no network), as a scorer's `no_network`.
    pub no_network: bool,
}

impl ToolSpec {
    /// A spec with every option at its default.
    pub fn new(tools: Vec<String>, environment: Option<String>) -> Self {
        ToolSpec {
            tools,
            environment,
            reward_functions: vec![],
            python: std::env::var("GRPO_PYTHON").unwrap_or_else(|_| "python3".into()),
            timeout: Duration::from_secs(10),
            max_result_chars: 4096,
            processes: 4,
            cwd: None,
            env: vec![],
            inherit_env: vec![],
            cpu_seconds: None,
            memory_mb: None,
            no_network: false,
        }
    }
}

/// What one tool call gives the model: the result text, or why there is none.
pub type CallOutcome = std::result::Result<String, CallError>;

/// Counters since start.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ToolStats {
    /// Tool calls (plain and environment methods).
    pub calls: u64,
    /// Environment resets.
    pub resets: u64,
    /// Failed calls, resets, rewards and closes, by [`CallError`] kind.
    pub errors: BTreeMap<&'static str, u64>,
    /// Processes started again after a timeout, crash or oversized answer.
    pub restarts: u64,
    /// Environment instances lost with a restarted process.
    pub environments_lost: u64,
}

/// The embedded Python side.
const TOOL_HOST: &str = include_str!("tool_host.py");
/// How long a process may take to import the tools and build the environment before its first
/// answer (a torch import can take a while).
const START_TIMEOUT: Duration = Duration::from_secs(120);
/// Failed starts in a row (exit or hang before the host is ready) after which a process is
/// given up: its calls then fail at once as `crash`.
pub const MAX_START_FAILURES: usize = 3;
/// Errors of `env_reward` warned about (then only counted).
const REWARD_WARNINGS: u64 = 5;

/// The running tool host: `processes` Python processes and what they serve.
pub struct ToolHost {
    spec: ToolSpec,
    /// How a process is started again (schemas not checked again).
    restart_command: CommandSpec,
    slots: Vec<Mutex<Slot>>,
    leases: Mutex<Leases>,
    freed: Condvar,
    next_slot: AtomicUsize,
    next_id: AtomicU64,
    tools: HashSet<String>,
    env_tools: HashSet<String>,
    schemas: Vec<Value>,
    env_has_reward: bool,
    env_reward_functions: Vec<String>,
    stats: Mutex<ToolStats>,
}

impl std::fmt::Debug for ToolHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ToolHost")
            .field("tools", &self.spec.tools)
            .field("environment", &self.spec.environment)
            .field("processes", &self.slots.len())
            .finish_non_exhaustive()
    }
}

/// One process and what lives in it.
struct Slot {
    /// Its place in `ToolHost::slots`.
    index: usize,
    /// None once given up (`broken` says why).
    proc: Option<Proc>,
    /// The host said it is ready (tools imported, environment probed).
    ready: bool,
    /// Episodes whose environment instance lives in this process.
    episodes: HashSet<u64>,
    start_failures: usize,
    broken: Option<String>,
}

/// Which processes are in use, and how many callers wait for each one in particular.
struct Leases {
    busy: Vec<bool>,
    waiting: Vec<usize>,
    broken: Vec<bool>,
}

/// Marks process `.1` free again when dropped.
struct Release<'a>(&'a ToolHost, usize);

impl Drop for Release<'_> {
    fn drop(&mut self) {
        lock(&self.0.leases).busy[self.1] = false;
        self.0.freed.notify_all();
    }
}

impl ToolHost {
    /// Starts the processes and asks the first for the schemas. Errors name the option
    /// (`tools` or `environment_factory`) and carry the Python stderr's last lines: an import
    /// error, a missing function, an environment class without `reset`, two tools with one name,
    /// a tool named like an environment method, a function without type hints or docstring.
    pub fn start(spec: ToolSpec) -> Result<ToolHost> {
        check_spec(&spec)?;
        let (first_command, restart_command) = host_commands(&spec)?;
        let spawn = |c: &CommandSpec| spawn_host(c, &spec.python);

        // The first process checks the schemas (importing transformers when it is there); the
        // others only load the tools.
        let mut procs = vec![spawn(&first_command)?];
        for _ in 1..spec.processes {
            procs.push(spawn(&restart_command)?);
        }
        let deadline = Instant::now() + START_TIMEOUT;
        for p in &mut procs {
            wait_ready(p, deadline).map_err(|m| Error::config(start_error_key(&m), m))?;
        }
        let mut host = ToolHost::with_processes(spec, restart_command, procs);
        host.read_schemas()?;
        Ok(host)
    }

    /// The host over started, ready processes; what they serve is not known yet
    /// ([`Self::read_schemas`]).
    fn with_processes(spec: ToolSpec, restart_command: CommandSpec, procs: Vec<Proc>) -> ToolHost {
        let n = procs.len();
        let slot = |(index, p)| Slot {
            index,
            proc: Some(p),
            ready: true,
            episodes: HashSet::new(),
            start_failures: 0,
            broken: None,
        };
        ToolHost {
            spec,
            restart_command,
            slots: procs
                .into_iter()
                .enumerate()
                .map(slot)
                .map(Mutex::new)
                .collect(),
            leases: Mutex::new(Leases {
                busy: vec![false; n],
                waiting: vec![0; n],
                broken: vec![false; n],
            }),
            freed: Condvar::new(),
            next_slot: AtomicUsize::new(0),
            next_id: AtomicU64::new(0),
            tools: HashSet::new(),
            env_tools: HashSet::new(),
            schemas: vec![],
            env_has_reward: false,
            env_reward_functions: vec![],
            stats: Mutex::new(ToolStats::default()),
        }
    }

    /// Asks the first process what it serves: the tools' and the environment's schemas, and the
    /// environment's rewards.
    fn read_schemas(&mut self) -> Result<()> {
        let answer = self
            .on_slot(Some(0), |s| {
                self.exchange(s, json!({"op": "describe"}), START_TIMEOUT, "describe")
            })
            .and_then(|a| error_of(&a).map(|_| a))
            .map_err(|e| {
                Error::config(
                    start_error_key(&e.message),
                    format!("the tool host: {}", e.message),
                )
            })?;
        #[derive(serde::Deserialize)]
        struct Described {
            tools: Vec<Value>,
            env_tools: Vec<Value>,
            env_has_reward: bool,
            #[serde(default)]
            env_reward_functions: Vec<String>,
        }
        let d: Described = serde_json::from_value(Value::Object(answer))
            .map_err(|e| Error::invariant(format!("the tool host's describe answer: {e}")))?;
        let name = |s: &Value| {
            s.pointer("/function/name")
                .and_then(Value::as_str)
                .map(str::to_owned)
        };
        self.tools = d.tools.iter().filter_map(name).collect();
        self.env_tools = d.env_tools.iter().filter_map(name).collect();
        self.env_has_reward = d.env_has_reward;
        self.env_reward_functions = d.env_reward_functions;
        self.schemas = d.tools.into_iter().chain(d.env_tools).collect();
        Ok(())
    }

    /// The tools' JSON schemas, as `transformers.utils.get_json_schema` writes them: the plain
    /// tools, then the environment's methods.
    pub fn schemas(&self) -> Vec<Value> {
        self.schemas.clone()
    }

    /// Whether an environment class was given.
    pub fn has_environment(&self) -> bool {
        self.spec.environment.is_some()
    }

    /// Whether the environment has a `get_reward` method.
    pub fn env_has_reward(&self) -> bool {
        self.env_has_reward
    }

    /// The reward functions of [`ToolSpec::reward_functions`] that take `environments` (TRL's
    /// `environments=`): [`ToolHost::env_reward`] scores episodes with them.
    pub fn env_reward_functions(&self) -> &[String] {
        &self.env_reward_functions
    }

    /// Runs one call: a plain tool, or the episode's environment method when `call.name` is
    /// one. Blocks at most `timeout` while the tool runs (plus the wait for a free process, and
    /// the start of a fresh one after a restart); never panics.
    pub fn call(&self, episode: u64, call: &ToolCall) -> CallOutcome {
        lock(&self.stats).calls += 1;
        let (name, what) = (&call.name, format!("tool `{}`", call.name));
        let request =
            json!({"op": "call", "episode": episode, "tool": name, "arguments": call.arguments});
        let answer = if self.tools.contains(name) {
            self.on_slot(None, |s| {
                self.exchange(s, request, self.spec.timeout, &what)
            })
        } else if self.env_tools.contains(name) {
            let mut request = request;
            request["op"] = json!("env_call");
            let i = self.slot_of(episode);
            self.on_slot(Some(i), |s| {
                self.exchange(s, request, self.spec.timeout, &what)
            })
        } else {
            let mut known: Vec<&str> = self
                .tools
                .iter()
                .chain(&self.env_tools)
                .map(String::as_str)
                .collect();
            known.sort_unstable();
            let known = known.join(", ");
            Err(call_error(
                "unknown_tool",
                format!("there is no tool named `{name}`; the tools are: {known}"),
            ))
        };
        let text = answer.and_then(|a| {
            result_of(&a)?.ok_or_else(|| call_error("garbage", "the tool host answered no result"))
        });
        if let Err(e) = &text {
            self.count(e.kind);
        }
        text
    }

    /// Starts episode `episode`: an environment instance (new, or one a closed episode left),
    /// `reset(**row)` on it; the observation it returns (TRL appends it to the last user
    /// message) or None.
    pub fn reset(
        &self,
        episode: u64,
        row: &Value,
    ) -> std::result::Result<Option<String>, CallError> {
        lock(&self.stats).resets += 1;
        let out = if self.has_environment() {
            let request = json!({"op": "reset", "episode": episode, "row": row});
            let what = format!("reset of episode {episode}");
            self.on_slot(Some(self.slot_of(episode)), |s| {
                let out = self.exchange(s, request, self.spec.timeout, &what);
                let out = out.and_then(|a| result_of(&a));
                if out.is_ok() {
                    s.episodes.insert(episode);
                }
                out
            })
        } else {
            Err(call_error(
                "env_reset",
                "no environment_factory is configured",
            ))
        };
        if let Err(e) = &out {
            self.count(e.kind);
        }
        out
    }

    /// The episode's environment rewards, in order: the environment's `get_reward()` when it
    /// has one, then each of [`ToolHost::env_reward_functions`] called with `environments=[its
    /// instance]`, `prompts`, `completions=[messages]` and the dataset `row`'s columns. None
    /// where a reward is missing: None or a non-finite number returned, or a failure (counted,
    /// and warned about a few times).
    pub fn env_rewards(&self, episode: u64, row: &Value, messages: &[Value]) -> Vec<Option<f32>> {
        let n = usize::from(self.env_has_reward) + self.env_reward_functions.len();
        if n == 0 {
            return vec![];
        }
        let request =
            json!({"op": "env_reward", "episode": episode, "row": row, "messages": messages});
        let what = format!("the rewards of episode {episode}");
        let answer = self.on_slot(Some(self.slot_of(episode)), |s| {
            self.exchange(s, request, self.spec.timeout, &what)
        });
        let answer = match answer {
            Ok(a) => a,
            Err(e) => {
                self.warn_reward(&what, &e);
                return vec![None; n];
            }
        };
        let number = |v: Option<&Value>| {
            v.and_then(Value::as_f64)
                .filter(|r| r.is_finite())
                .map(|r| r as f32)
        };
        let mut out = vec![];
        if self.env_has_reward {
            if let Err(e) = error_of(&answer) {
                self.warn_reward(&format!("get_reward of episode {episode}"), &e);
            }
            out.push(number(answer.get("reward")));
        }
        let none = vec![];
        let rewards = answer
            .get("rewards")
            .and_then(Value::as_array)
            .unwrap_or(&none);
        let errors = answer
            .get("errors")
            .and_then(Value::as_array)
            .unwrap_or(&none);
        for (k, target) in self.env_reward_functions.iter().enumerate() {
            if let Some(e) = errors.get(k).filter(|e| e.is_object()) {
                self.warn_reward(&format!("{target} on episode {episode}"), &error_from(e));
            }
            out.push(number(rewards.get(k)));
        }
        out
    }

    /// Counts a failed environment reward, warning about the first few.
    fn warn_reward(&self, what: &str, e: &CallError) {
        let n = self.count(e.kind);
        if n <= REWARD_WARNINGS {
            let more = if n == REWARD_WARNINGS {
                " (further ones are only counted)"
            } else {
                ""
            };
            warn!(
                "environment_factory: {what} failed ({}): {}{more}",
                e.kind, e.message
            );
        }
    }

    /// Ends episode `episode`: its environment instance is kept for a later episode (TRL's
    /// "construct once, reset often"). Failures are only counted.
    pub fn close(&self, episode: u64) {
        if !self.has_environment() {
            return;
        }
        let request = json!({"op": "close", "episode": episode});
        let what = format!("close of episode {episode}");
        let out = self.on_slot(Some(self.slot_of(episode)), |s| {
            if !s.episodes.remove(&episode) {
                return Ok(None);
            }
            result_of(&self.exchange(s, request, self.spec.timeout, &what)?)
        });
        if let Err(e) = out {
            self.count(e.kind);
        }
    }

    /// Counters since start.
    pub fn stats(&self) -> ToolStats {
        lock(&self.stats).clone()
    }

    /// The process ids of the running processes (for tests and diagnostics).
    pub fn pids(&self) -> Vec<Option<u32>> {
        self.slots
            .iter()
            .map(|s| lock(s).proc.as_ref().map(|p| p.child.id()))
            .collect()
    }

    fn slot_of(&self, episode: u64) -> usize {
        (episode % self.slots.len() as u64) as usize
    }

    /// Adds one error of `kind`; the count of that kind so far.
    fn count(&self, kind: &'static str) -> u64 {
        let mut st = lock(&self.stats);
        let n = st.errors.entry(kind).or_default();
        *n += 1;
        *n
    }

    /// Runs `f` on process `i` (None: any free one) once it is free, holding it meanwhile.
    fn on_slot<R>(&self, i: Option<usize>, f: impl FnOnce(&mut Slot) -> R) -> R {
        let i = self.acquire(i);
        let _release = Release(self, i);
        f(&mut lock(&self.slots[i]))
    }

    /// Marks process `i` (None: a free one, preferring those no episode waits for and that
    /// still work) busy, once it is free.
    fn acquire(&self, i: Option<usize>) -> usize {
        let n = self.slots.len();
        let mut l = lock(&self.leases);
        if let Some(i) = i {
            l.waiting[i] += 1;
            while l.busy[i] {
                l = self.freed.wait(l).unwrap_or_else(|e| e.into_inner());
            }
            l.waiting[i] -= 1;
            l.busy[i] = true;
            return i;
        }
        let first = self.next_slot.fetch_add(1, Ordering::Relaxed) % n;
        loop {
            let all_broken = l.broken.iter().all(|&b| b);
            let order = || (0..n).map(|k| (first + k) % n);
            let pick = (order().find(|&i| !l.busy[i] && l.waiting[i] == 0 && !l.broken[i]))
                .or_else(|| order().find(|&i| !l.busy[i] && (all_broken || !l.broken[i])));
            if let Some(i) = pick {
                l.busy[i] = true;
                return i;
            }
            l = self.freed.wait(l).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Sends one request and waits for its answer (at most `limit` once the process is ready).
    /// Kills and restarts the process on a timeout, an exit or an oversized answer.
    fn exchange(
        &self,
        s: &mut Slot,
        mut request: Value,
        limit: Duration,
        what: &str,
    ) -> std::result::Result<Map<String, Value>, CallError> {
        self.ensure_running(s)?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        request["id"] = json!(id);
        // A result is at most max_result_chars characters of up to 4 bytes (escapes aside).
        let answer_limit = (self.spec.max_result_chars.saturating_mul(4)).max(1 << 20);
        let mut deadline = Instant::now() + if s.ready { limit } else { START_TIMEOUT };
        if let Some(p) = &s.proc {
            p.send(request.to_string());
        }
        loop {
            let Some(p) = s.proc.as_mut() else {
                return Err(call_error("crash", "the tool process is not running"));
            };
            let now = Instant::now();
            if now >= deadline {
                let (kind, message) = if s.ready {
                    let secs = limit.as_secs_f64();
                    (
                        "timeout",
                        format!("{what} did not finish within {secs:.1} s and was stopped"),
                    )
                } else {
                    s.start_failures += 1;
                    let secs = START_TIMEOUT.as_secs();
                    (
                        "crash",
                        format!("the tool process did not start within {secs} s"),
                    )
                };
                self.restart(s, &message);
                return Err(call_error(kind, message));
            }
            match p.output.recv_timeout(deadline - now) {
                Ok(Out::Line(line)) if line.len() > answer_limit => {
                    let n = line.len();
                    let message =
                        format!("{what} answered {n} bytes, over the {answer_limit} allowed");
                    self.restart(s, &message);
                    return Err(call_error("output_too_large", message));
                }
                Ok(Out::Line(line)) => {
                    let Ok(Value::Object(answer)) = serde_json::from_str::<Value>(&line) else {
                        let start: String = line.chars().take(200).collect();
                        let m = format!("{what}: the tool host answered {start:?} (not JSON)");
                        return Err(call_error("garbage", m));
                    };
                    match answer.get("id") {
                        Some(Value::Number(n)) if n.as_u64() == Some(id) => return Ok(answer),
                        None | Some(Value::Null) if is_ready(&answer) => {
                            (s.ready, s.start_failures) = (true, 0);
                            deadline = Instant::now() + limit;
                        }
                        _ => {} // a late answer to a call that already failed
                    }
                }
                Ok(Out::Eof) | Err(RecvTimeoutError::Disconnected) => {
                    let (kind, message, details) = self.ended(s, what);
                    self.restart(s, &details);
                    return Err(call_error(kind, message));
                }
                Err(RecvTimeoutError::Timeout) => {}
            }
        }
    }

    /// The process closed its stdout: it exited (a crash), or it is still running because the
    /// reader stopped at an answer line over 16 MB. (kind, message, details for the log)
    fn ended(&self, s: &mut Slot, what: &str) -> (&'static str, String, String) {
        let Some(p) = s.proc.as_mut() else {
            let m = "the tool process is not running".to_owned();
            return ("crash", m.clone(), m);
        };
        let t0 = Instant::now();
        while p.exit_status().is_none() && t0.elapsed() < Duration::from_millis(500) {
            std::thread::sleep(Duration::from_millis(5));
        }
        let Some(status) = p.exit_status() else {
            let m = format!("{what} wrote an answer line over 16 MB");
            return ("output_too_large", m.clone(), m);
        };
        p.wait_stderr(Duration::from_millis(300));
        let (status, ready) = (describe(status), s.ready);
        s.start_failures += usize::from(!ready);
        let message = if ready {
            format!("the tool process exited during {what} ({status})")
        } else {
            format!("the tool process exited at start ({status})")
        };
        let details = format!("{message}. Its last stderr lines:\n{}", p.stderr_tail());
        ("crash", message, details)
    }

    /// Before a request: a process that exited while idle is started again, and lines left
    /// from an earlier call are dropped.
    fn ensure_running(&self, s: &mut Slot) -> std::result::Result<(), CallError> {
        if let Some(p) = s.proc.as_mut() {
            let mut dead = p.exit_status().is_some();
            while let Ok(o) = p.output.try_recv() {
                match o {
                    Out::Line(l) => {
                        if serde_json::from_str(&l).is_ok_and(|a: Map<String, Value>| is_ready(&a))
                        {
                            (s.ready, s.start_failures) = (true, 0);
                        }
                    }
                    Out::Eof => dead = true,
                }
            }
            if dead {
                let (_, _, details) = self.ended(s, "an idle moment");
                self.restart(s, &details);
            }
        }
        match (&s.proc, &s.broken) {
            (Some(_), _) => Ok(()),
            (None, Some(why)) => Err(call_error(
                "crash",
                format!("the tool process cannot be started again: {why}"),
            )),
            (None, None) => Err(call_error("crash", "the tool process is not running")),
        }
    }

    /// Kills the slot's process (with its group) and starts a fresh one, unless it failed to
    /// start [`MAX_START_FAILURES`] times in a row. The environments that lived in it are lost.
    fn restart(&self, s: &mut Slot, why: &str) {
        let pid = s.proc.as_ref().map(|p| p.child.id());
        if let Some(mut p) = s.proc.take() {
            p.kill();
        }
        let lost = std::mem::take(&mut s.episodes).len();
        s.ready = false;
        lock(&self.stats).environments_lost += lost as u64;
        let lost = match lost {
            0 => String::new(),
            n => format!("; {n} environment instance(s) lost"),
        };
        let broken = if s.start_failures >= MAX_START_FAILURES {
            Some(format!(
                "it failed to start {} times in a row",
                s.start_failures
            ))
        } else {
            warn!("tools: restarting the tool process (pid {pid:?}){lost}: {why}");
            match Proc::spawn(&self.restart_command, "tools") {
                Ok(p) => {
                    s.proc = Some(p);
                    lock(&self.stats).restarts += 1;
                    None
                }
                Err(e) => Some(e.to_string()),
            }
        };
        if let Some(b) = broken {
            warn!("tools: giving up the tool process (pid {pid:?}){lost}: {b}; then: {why}");
            lock(&self.leases).broken[s.index] = true;
            s.broken = Some(b);
        }
    }
}

/// The checks of a tool spec that need no process: something to serve, processes and a timeout,
/// an existing working directory, and a network namespace when `no_network` asks for one.
fn check_spec(spec: &ToolSpec) -> Result<()> {
    let bad = |m: String| Err(Error::config("tools", m));
    if spec.tools.is_empty() && spec.environment.is_none() {
        return bad("no tools and no environment_factory: name at least one".into());
    }
    if spec.processes == 0 || spec.timeout.is_zero() {
        return bad("the tool processes and timeout must be > 0".into());
    }
    if let Some(dir) = spec.cwd.as_ref().filter(|d| !d.is_dir()) {
        return bad(format!(
            "working directory `{}` is not a directory",
            dir.display()
        ));
    }
    if spec.no_network {
        crate::rewards::command::probe_no_network().map_err(|e| {
            Error::config(
                "tool_no_network",
                format!(
                    "a new network namespace cannot be created here (unshare: {e}); allow \
                     user namespaces (or run with CAP_SYS_ADMIN), or set tool_no_network = \
                     false and isolate the tools another way"
                ),
            )
        })?;
    }
    Ok(())
}

/// The tool host's commands: the first process's, which checks the schemas, and the one every
/// other process starts (and restarts) with. Errors name the option whose function or class name
/// cannot be read.
fn host_commands(spec: &ToolSpec) -> Result<(CommandSpec, CommandSpec)> {
    let target = |t: &String| python_target(t).map_err(|m| m.replace("my_rewards", "my_tools"));
    let tools = (spec
        .tools
        .iter()
        .map(target)
        .collect::<std::result::Result<Vec<_>, _>>())
    .map_err(|m| Error::config("tools", m))?;
    let environment = (spec.environment.as_ref().map(target).transpose())
        .map_err(|m| Error::config("environment_factory", m))?;
    let command = |check_schemas: bool| {
        let host_spec = json!({"tools": tools, "environment": environment,
            "reward_functions": spec.reward_functions,
            "max_result_chars": spec.max_result_chars, "check_schemas": check_schemas});
        let (python, source) = (spec.python.clone(), TOOL_HOST.to_owned());
        let mut c = CommandSpec::new(vec![python, "-c".into(), source, host_spec.to_string()]);
        c.timeout = spec.timeout;
        c.cwd = spec.cwd.clone();
        c.env = spec.env.clone();
        c.inherit_env = PYTHON_ENV.iter().map(|s| s.to_string()).collect();
        c.inherit_env.extend(spec.inherit_env.iter().cloned());
        (c.cpu_seconds, c.memory_mb) = (spec.cpu_seconds, spec.memory_mb);
        c.no_network = spec.no_network;
        c
    };
    Ok((command(true), command(false)))
}

/// The option a start-up error is about: the Python side prefixes its errors with it.
fn start_error_key(m: &str) -> &'static str {
    if m.contains("environment_factory:") {
        "environment_factory"
    } else if m.contains("reward_funcs:") {
        "rewards"
    } else {
        "tools"
    }
}

/// Starts one tool host process with `python`.
fn spawn_host(c: &CommandSpec, python: &str) -> Result<Proc> {
    Proc::spawn(c, "tools").map_err(|e| {
        Error::config(
            "tools",
            format!("cannot start the tool host with `{python}`: {e}"),
        )
    })
}

/// Waits for a new process's `{"ready": true}` line.
fn wait_ready(p: &mut Proc, deadline: Instant) -> std::result::Result<(), String> {
    loop {
        let now = Instant::now();
        if now >= deadline {
            p.kill();
            return Err(format!(
                "the tool host did not start within {} s (importing the tools and creating the \
                 environment). Its last stderr lines:\n{}",
                START_TIMEOUT.as_secs(),
                p.stderr_tail()
            ));
        }
        match p.output.recv_timeout(deadline - now) {
            Ok(Out::Line(l)) => {
                if serde_json::from_str(&l).is_ok_and(|a: Map<String, Value>| is_ready(&a)) {
                    return Ok(());
                }
            }
            Ok(Out::Eof) | Err(RecvTimeoutError::Disconnected) => {
                let status = p.reap(Duration::from_secs(2));
                return Err(format!(
                    "the tool host exited at start ({status}). Its last stderr lines:\n{}",
                    p.stderr_tail()
                ));
            }
            Err(RecvTimeoutError::Timeout) => {}
        }
    }
}

/// The host's first line, `{"ready": true}`.
fn is_ready(answer: &Map<String, Value>) -> bool {
    answer.get("ready") == Some(&Value::Bool(true))
}

/// An answer's `error` as a [`CallError`].
fn error_of(answer: &Map<String, Value>) -> std::result::Result<(), CallError> {
    match answer.get("error") {
        Some(e) => Err(error_from(e)),
        None => Ok(()),
    }
}

/// The tool host's `{"kind", "message"}` as a [`CallError`] (an unknown kind: `garbage`).
fn error_from(e: &Value) -> CallError {
    let kind = e.get("kind").and_then(Value::as_str).unwrap_or_default();
    let message = e.get("message").and_then(Value::as_str).unwrap_or_default();
    let kind = match kind {
        "raised" => "raised",
        "arguments" => "arguments",
        "unknown_tool" => "unknown_tool",
        "environment_lost" => "environment_lost",
        "env_reset" => "env_reset",
        other => {
            return call_error(
                "garbage",
                format!("the tool host failed ({other}): {message}"),
            )
        }
    };
    call_error(kind, message)
}

/// An answer's `error` as a [`CallError`], else its `result` (a string or null).
fn result_of(answer: &Map<String, Value>) -> std::result::Result<Option<String>, CallError> {
    error_of(answer)?;
    match answer.get("result") {
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Null) => Ok(None),
        _ => Err(call_error(
            "garbage",
            "the tool host's answer has no result string",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_can_be_shared_between_threads() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<ToolHost>();
    }

    #[test]
    fn answers_read_as_results_or_errors() {
        let read = |s: &str| result_of(&serde_json::from_str(s).unwrap());
        assert_eq!(
            read(r#"{"id":1,"result":"42"}"#).unwrap(),
            Some("42".into())
        );
        assert_eq!(read(r#"{"id":1,"result":null}"#).unwrap(), None);
        let e = read(r#"{"error":{"kind":"raised","message":"ValueError: x"}}"#).unwrap_err();
        assert_eq!((e.kind, e.message.as_str()), ("raised", "ValueError: x"));
        let e = read(r#"{"error":{"kind":"host","message":"bad op"}}"#).unwrap_err();
        assert!(e.kind == "garbage" && e.message.contains("bad op"));
        assert_eq!(read(r#"{"id":1,"result":3}"#).unwrap_err().kind, "garbage");
    }
}
