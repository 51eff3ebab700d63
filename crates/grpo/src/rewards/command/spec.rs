//! The options of a scorer program (`kind = "command"` and `kind = "python"` rewards): the
//! table keys, their defaults and checks, and the environment a scorer gets.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::Value;

use crate::rewards::table::Table;
use crate::Result;

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
    pub(super) fn display(&self) -> String {
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

/// What `kind = "python"` serves: examples/scorers/trl_adapter.py, run with `python -c`.
const TRL_ADAPTER: &str = include_str!("../../../../../examples/scorers/trl_adapter.py");

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

pub(super) fn timeout(t: &Table) -> Result<Duration> {
    let s = t.f64("timeout_s", 30.0)?;
    if !(s > 0.0 && s <= 1e6) {
        return Err(t.err("timeout_s", format!("{s}: must be > 0 seconds")));
    }
    Ok(Duration::from_secs_f64(s))
}

pub(super) fn at_least_one(t: &Table, k: &str, default: usize) -> Result<usize> {
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
pub(super) fn string_table(t: &Table, k: &str) -> Result<Vec<(String, String)>> {
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
