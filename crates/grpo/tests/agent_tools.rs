//! The tool host (`grpo::agents::tools`) against real Python tools and environments: small files
//! written into a temp dir (skipped, with the reason printed, where no `python3` is installed).

use std::path::Path;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use grpo::agents::calls::ToolCall;
use grpo::agents::tools::{ToolHost, ToolSpec, MAX_START_FAILURES};
use serde_json::{json, Value};

/// The real interpreter behind `python3` (not a pyenv shim), or None.
fn python() -> Option<&'static str> {
    static PY: OnceLock<Option<String>> = OnceLock::new();
    PY.get_or_init(|| {
        let out = std::process::Command::new("python3")
            .args(["-c", "import sys; print(sys.executable)"])
            .output()
            .ok()?;
        let exe = String::from_utf8(out.stdout).ok()?.trim().to_owned();
        (out.status.success() && !exe.is_empty()).then_some(exe)
    })
    .as_deref()
}

macro_rules! need_python {
    () => {
        match python() {
            Some(p) => p,
            None => {
                no_python("no python3 on PATH (these tests run Python tools)");
                return;
            }
        }
    };
}

/// A temp dir holding `files` (name, source).
fn dir_with(files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (name, source) in files {
        let path = dir.path().join(name);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, source).unwrap();
    }
    dir
}

fn spec(py: &str, dir: &Path, tools: &[&str], env: Option<&str>) -> ToolSpec {
    let mut s = ToolSpec::new(
        tools.iter().map(|t| t.to_string()).collect(),
        env.map(str::to_owned),
    );
    s.python = py.to_owned();
    s.cwd = Some(dir.to_owned());
    s.processes = 1;
    s
}

fn call(name: &str, arguments: Value) -> ToolCall {
    let Value::Object(arguments) = arguments else {
        panic!("arguments must be an object")
    };
    ToolCall {
        name: name.into(),
        arguments,
    }
}

const TOOLS: &str = r#"
import os, sys, time
from typing import Literal, Optional

def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum.
    """
    return a + b

def search(query: str, limit: int = 5, lang: Optional[Literal["en", "fr"]] = None, tags: list[str] = []) -> list[str]:
    """Searches the notes.

    Args:
        query: The text to look for, on
            two lines.
        limit: How many results at most.
        lang: The language (choices: ["en", "fr"])
        tags: Tags the notes must have.

    Returns:
        The matching notes.
    """
    return [query] * limit

def fail(x: str):
    """Always raises.

    Args:
        x: Ignored.
    """
    raise ValueError(f"bad input {x}")

def sleep(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "slept"

def shout(n: int) -> str:
    """Prints a lot to stdout, then returns.

    Args:
        n: Characters to print.
    """
    print("x" * n)
    sys.stdout.write('{"id": 0, "result": "fake"}\n')
    os.write(1, b'{"id": 1, "result": "fake"}\n')
    try:
        input()
    except EOFError:
        pass
    return "done"

def long_text(n: int) -> str:
    """Returns a long text.

    Args:
        n: Its length.
    """
    return "y" * n

class Point:
    def __init__(self, x, y):
        self.x, self.y = x, y
    def __str__(self):
        return f"Point({self.x}, {self.y})"

def point(kind: str):
    """Returns something.

    Args:
        kind: Which thing.
    """
    return {"point": Point(1, 2), "dict": {"a": [1, 2]}, "none": None, "float": 0.5}[kind]

def die(code: int):
    """Exits the process at once.

    Args:
        code: The exit status.
    """
    os._exit(code)

def vanish() -> str:
    """Deletes its own file, then exits: the process cannot be started again.
    """
    os.remove(__file__)
    os._exit(1)
"#;

#[test]
fn a_tool_returns_its_result_as_text() {
    let py = need_python!();
    let dir = dir_with(&[("tools.py", TOOLS)]);
    let host =
        ToolHost::start(spec(py, dir.path(), &["tools.py:add", "tools.point"], None)).unwrap();
    assert_eq!(
        host.call(0, &call("add", json!({"a": 40, "b": 2})))
            .unwrap(),
        "42"
    );
    for (kind, want) in [
        ("point", "Point(1, 2)"),
        ("dict", r#"{"a": [1, 2]}"#),
        ("none", "null"),
        ("float", "0.5"),
    ] {
        assert_eq!(
            host.call(7, &call("point", json!({"kind": kind}))).unwrap(),
            want
        );
    }
    let e = host.call(0, &call("nope", json!({}))).unwrap_err();
    assert_eq!(e.kind, "unknown_tool");
    assert!(e.message.contains("add, point"), "{}", e.message);
    assert!(!host.has_environment() && !host.env_has_reward());
    let st = host.stats();
    assert_eq!(
        (st.calls, st.errors.get("unknown_tool"), st.restarts),
        (6, Some(&1), 0)
    );
}

#[test]
fn schemas_are_what_transformers_writes() {
    let py = need_python!();
    let dir = dir_with(&[("tools.py", TOOLS)]);
    let host = ToolHost::start(spec(
        py,
        dir.path(),
        &["tools.py:search", "tools.py:add"],
        None,
    ))
    .unwrap();
    // transformers 5.23 `get_json_schema(search)`, verbatim.
    let search = json!({"type": "function", "function": {"name": "search",
        "description": "Searches the notes.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": "The text to look for, on two lines."},
            "limit": {"type": "integer", "description": "How many results at most."},
            "lang": {"type": "string", "enum": ["en", "fr"], "nullable": true, "description": "The language"},
            "tags": {"type": "array", "items": {"type": "string"}, "description": "Tags the notes must have."}},
            "required": ["query"]},
        "return": {"type": "array", "items": {"type": "string"}, "description": "The matching notes."}}});
    let schemas = host.schemas();
    assert_eq!(schemas.len(), 2);
    assert_eq!(schemas[0], search);
    assert_eq!(schemas[1]["function"]["name"], "add");
    assert_eq!(
        schemas[1]["function"]["parameters"]["required"],
        json!(["a", "b"])
    );
    assert_eq!(
        host.call(0, &call("search", json!({"query": "q", "limit": 2})))
            .unwrap(),
        r#"["q", "q"]"#
    );
}

#[test]
fn raised_errors_and_wrong_arguments_are_call_errors() {
    let py = need_python!();
    let dir = dir_with(&[("tools.py", TOOLS)]);
    let host = ToolHost::start(spec(
        py,
        dir.path(),
        &["tools.py:fail", "tools.py:add"],
        None,
    ))
    .unwrap();
    let e = host
        .call(0, &call("fail", json!({"x": "here"})))
        .unwrap_err();
    assert_eq!(e.kind, "raised");
    assert!(
        e.message.starts_with("ValueError: bad input here"),
        "{}",
        e.message
    );
    assert!(e.message.contains("in fail"), "{}", e.message);
    for args in [json!({"a": 1}), json!({"a": 1, "b": 2, "c": 3})] {
        let e = host.call(0, &call("add", args)).unwrap_err();
        assert_eq!(e.kind, "arguments", "{}", e.message);
        assert!(e.message.contains("add"), "{}", e.message);
    }
    // The process is still the same one.
    assert_eq!(
        host.call(0, &call("add", json!({"a": 1, "b": 2}))).unwrap(),
        "3"
    );
    assert_eq!(host.stats().restarts, 0);
}

#[test]
fn a_timeout_kills_the_tool_and_the_next_call_works() {
    let py = need_python!();
    let dir = dir_with(&[("tools.py", TOOLS)]);
    let mut s = spec(py, dir.path(), &["tools.py:sleep", "tools.py:add"], None);
    s.timeout = Duration::from_secs(1);
    let host = ToolHost::start(s).unwrap();
    let pid = host.pids()[0];
    let t0 = Instant::now();
    let e = host
        .call(0, &call("sleep", json!({"seconds": 30})))
        .unwrap_err();
    assert_eq!(e.kind, "timeout", "{}", e.message);
    assert_eq!(
        host.call(0, &call("add", json!({"a": 1, "b": 1}))).unwrap(),
        "2"
    );
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert_ne!(host.pids()[0], pid);
    let st = host.stats();
    assert_eq!((st.restarts, st.errors.get("timeout")), (1, Some(&1)));
}

fn rss_kb() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

#[test]
fn printing_cannot_break_the_protocol_and_results_are_cut() {
    let py = need_python!();
    let dir = dir_with(&[("tools.py", TOOLS)]);
    let mut s = spec(
        py,
        dir.path(),
        &["tools.py:shout", "tools.py:long_text"],
        None,
    );
    s.timeout = Duration::from_secs(60);
    s.max_result_chars = 100;
    let host = ToolHost::start(s).unwrap();
    let before = rss_kb();
    // 100 MB on one stdout line: it goes to stderr, read in bounded pieces.
    assert_eq!(
        host.call(0, &call("shout", json!({"n": 100_000_000})))
            .unwrap(),
        "done"
    );
    assert!(
        rss_kb() < before + 64 * 1024,
        "{before} kB -> {} kB",
        rss_kb()
    );
    let text = host
        .call(0, &call("long_text", json!({"n": 10_000_000})))
        .unwrap();
    assert_eq!(text, format!("{}... [cut: 9999900 chars]", "y".repeat(100)));
    assert_eq!(host.stats().restarts, 0);
}

#[test]
fn a_crash_is_reported_and_the_process_restarted() {
    let py = need_python!();
    let dir = dir_with(&[("tools.py", TOOLS)]);
    let host = ToolHost::start(spec(
        py,
        dir.path(),
        &["tools.py:die", "tools.py:add"],
        None,
    ))
    .unwrap();
    let e = host.call(0, &call("die", json!({"code": 3}))).unwrap_err();
    assert_eq!(e.kind, "crash");
    assert!(e.message.contains("exit status 3"), "{}", e.message);
    assert_eq!(
        host.call(0, &call("add", json!({"a": 2, "b": 2}))).unwrap(),
        "4"
    );
    assert_eq!(host.stats().restarts, 1);
}

#[test]
fn a_process_that_cannot_start_again_gives_crashes_not_hangs() {
    let py = need_python!();
    let dir = dir_with(&[("tools.py", TOOLS)]);
    let host = ToolHost::start(spec(
        py,
        dir.path(),
        &["tools.py:vanish", "tools.py:add"],
        None,
    ))
    .unwrap();
    let t0 = Instant::now();
    assert_eq!(
        host.call(0, &call("vanish", json!({}))).unwrap_err().kind,
        "crash"
    );
    let mut messages = vec![];
    for _ in 0..MAX_START_FAILURES + 2 {
        let e = host
            .call(0, &call("add", json!({"a": 1, "b": 1})))
            .unwrap_err();
        assert_eq!(e.kind, "crash", "{}", e.message);
        messages.push(e.message);
    }
    assert!(
        messages[0].contains("exited at start (exit status 2)"),
        "{messages:?}"
    );
    assert!(
        messages.last().unwrap().contains("cannot be started again"),
        "{messages:?}"
    );
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
}

fn start_error(py: &str, dir: &Path, tools: &[&str], env: Option<&str>) -> String {
    ToolHost::start(spec(py, dir, tools, env))
        .unwrap_err()
        .to_string()
}

#[test]
fn start_errors_name_the_option_and_the_cause() {
    let py = need_python!();
    let other = "def add(x: int) -> int:\n    \"\"\"Other add.\n\n    Args:\n        x: x\n    \"\"\"\n    return x\n";
    let dir = dir_with(&[
        ("tools.py", TOOLS),
        ("other.py", other),
        ("broken.py", "import no_such_module_here\n"),
        ("undocumented.py", "def f(a: int):\n    return a\n"),
        (
            "envs.py",
            "class NoReset:\n    def step(self, a: int):\n        return a\n",
        ),
    ]);
    let e = start_error(py, dir.path(), &["tools.py:add", "other.py:add"], None);
    assert!(
        e.contains("option `tools`") && e.contains("two tools are named `add`"),
        "{e}"
    );
    assert!(
        e.contains("tools.py:add") && e.contains("other.py:add"),
        "{e}"
    );
    let e = start_error(py, dir.path(), &["broken.py:f"], None);
    assert!(
        e.contains("option `tools`") && e.contains("No module named 'no_such_module_here'"),
        "{e}"
    );
    let e = start_error(py, dir.path(), &["undocumented.py:f"], None);
    assert!(
        e.contains("option `tools`") && e.contains("no docstring"),
        "{e}"
    );
    let e = start_error(py, dir.path(), &["tools.py:nothing"], None);
    assert!(e.contains("has no attribute `nothing`"), "{e}");
    let e = start_error(py, dir.path(), &["add"], None);
    assert!(
        e.contains("option `tools`") && e.contains("give the module"),
        "{e}"
    );
    let e = start_error(py, dir.path(), &[], Some("envs.py:NoReset"));
    assert!(
        e.contains("option `environment_factory`") && e.contains("`reset`"),
        "{e}"
    );
}

const ENV: &str = r#"
import time

class Counter:
    """Counts to a target given by the dataset row."""

    def __init__(self):
        self.count = 0
        self.target = None

    def reset(self, target: int = 0, **row):
        self.count = 0
        self.target = target
        return f"Reach {target}."

    def increment(self, by: int) -> int:
        """Adds to the counter.

        Args:
            by: How much to add.
        """
        self.count += by
        return self.count

    def wait(self, seconds: float) -> str:
        """Waits.

        Args:
            seconds: How long.
        """
        time.sleep(seconds)
        return "waited"

    def get_reward(self) -> float:
        return 1.0 if self.count == self.target else 0.0

    def _helper(self):
        return None

class Quiet:
    def reset(self):
        pass

    def look(self) -> str:
        """Looks around."""
        return "nothing"
"#;

#[test]
fn environments_keep_one_instance_per_episode() {
    let py = need_python!();
    let dir = dir_with(&[("tools.py", TOOLS), ("env.py", ENV)]);
    let mut s = spec(py, dir.path(), &["tools.py:add"], Some("env.py:Counter"));
    s.processes = 2;
    let host = ToolHost::start(s).unwrap();
    assert!(host.has_environment() && host.env_has_reward());
    let schemas = host.schemas();
    let names: Vec<&str> = schemas
        .iter()
        .map(|s| s["function"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["add", "increment", "wait"]);
    let increment = &host.schemas()[1];
    assert_eq!(
        increment["function"]["parameters"],
        json!({"type": "object", "properties": {"by": {"type": "integer", "description": "How much to add."}}, "required": ["by"]})
    );

    // Episodes 0 and 2 share process 0, episode 1 has process 1.
    for (episode, target) in [(0, 5), (1, 3), (2, 1)] {
        let row = json!({"prompt": "count", "target": target});
        assert_eq!(
            host.reset(episode, &row).unwrap().as_deref(),
            Some(&*format!("Reach {target}."))
        );
    }
    let inc = |episode, by| {
        host.call(episode, &call("increment", json!({"by": by})))
            .unwrap()
    };
    assert_eq!(inc(0, 3), "3");
    assert_eq!(inc(1, 1), "1");
    assert_eq!(inc(2, 1), "1");
    assert_eq!(inc(0, 2), "5");
    assert_eq!(
        host.call(1, &call("add", json!({"a": 1, "b": 2}))).unwrap(),
        "3"
    );
    assert_eq!(reward(&host, 0), Some(1.0));
    assert_eq!(reward(&host, 1), Some(0.0));
    assert_eq!(reward(&host, 2), Some(1.0));

    host.close(0);
    let e = host
        .call(0, &call("increment", json!({"by": 1})))
        .unwrap_err();
    assert_eq!(e.kind, "environment_lost", "{}", e.message);
    assert_eq!(reward(&host, 0), None);
    // A new episode reuses the closed one's instance, reset.
    assert_eq!(
        host.reset(4, &json!({"target": 1})).unwrap().as_deref(),
        Some("Reach 1.")
    );
    assert_eq!(inc(4, 1), "1");
    assert_eq!(inc(2, 1), "2");
    let e = host
        .call(1, &call("increment", json!({"by": "one"})))
        .unwrap_err();
    assert_eq!(e.kind, "raised", "{}", e.message);
    let st = host.stats();
    assert_eq!((st.resets, st.restarts, st.environments_lost), (4, 0, 0));
}

#[test]
fn a_reset_that_does_not_take_the_row_is_an_error() {
    let py = need_python!();
    let dir = dir_with(&[("env.py", ENV)]);
    let host = ToolHost::start(spec(py, dir.path(), &[], Some("env.py:Quiet"))).unwrap();
    assert!(!host.env_has_reward());
    let e = host.reset(0, &json!({"prompt": "hi"})).unwrap_err();
    assert_eq!(e.kind, "env_reset");
    assert!(e.message.contains("**kwargs"), "{}", e.message);
    assert_eq!(host.reset(0, &json!({})).unwrap(), None);
    assert_eq!(host.call(0, &call("look", json!({}))).unwrap(), "nothing");
    assert_eq!(reward(&host, 0), None);
}

#[test]
fn a_timeout_loses_the_environments_of_its_process() {
    let py = need_python!();
    let dir = dir_with(&[("env.py", ENV)]);
    let mut s = spec(py, dir.path(), &[], Some("env.py:Counter"));
    s.timeout = Duration::from_secs(1);
    let host = ToolHost::start(s).unwrap();
    for episode in [1, 2] {
        host.reset(episode, &json!({"target": 2})).unwrap();
    }
    let e = host
        .call(1, &call("wait", json!({"seconds": 30})))
        .unwrap_err();
    assert_eq!(e.kind, "timeout");
    let e = host
        .call(2, &call("increment", json!({"by": 1})))
        .unwrap_err();
    assert_eq!(e.kind, "environment_lost", "{}", e.message);
    host.reset(3, &json!({"target": 2})).unwrap();
    assert_eq!(
        host.call(3, &call("increment", json!({"by": 2}))).unwrap(),
        "2"
    );
    assert_eq!(reward(&host, 3), Some(1.0));
    let st = host.stats();
    assert_eq!((st.restarts, st.environments_lost), (1, 2));
}

#[test]
fn modules_are_found_through_pythonpath() {
    let py = need_python!();
    let lib = dir_with(&[
        ("pkg/__init__.py", ""),
        ("pkg/my_tools.py", TOOLS),
        ("my_tools.py", TOOLS),
    ]);
    let elsewhere = tempfile::tempdir().unwrap();
    let mut s = spec(
        py,
        elsewhere.path(),
        &["my_tools.add", "pkg.my_tools.fail"],
        None,
    );
    s.env = vec![("PYTHONPATH".into(), lib.path().display().to_string())];
    let host = ToolHost::start(s).unwrap();
    assert_eq!(
        host.call(0, &call("add", json!({"a": 1, "b": 41})))
            .unwrap(),
        "42"
    );
    assert_eq!(
        host.call(0, &call("fail", json!({"x": "1"})))
            .unwrap_err()
            .kind,
        "raised"
    );
    // Without it, the module is not found.
    let e = start_error(py, elsewhere.path(), &["my_tools.add"], None);
    assert!(e.contains("No module named 'my_tools'"), "{e}");
}

#[test]
fn calls_run_in_parallel_up_to_the_processes() {
    let py = need_python!();
    let dir = dir_with(&[("tools.py", TOOLS)]);
    let mut s = spec(py, dir.path(), &["tools.py:sleep"], None);
    s.processes = 4;
    let host = ToolHost::start(s).unwrap();
    let t0 = Instant::now();
    std::thread::scope(|scope| {
        for episode in 0..4 {
            let host = &host;
            scope.spawn(move || {
                let r = host.call(episode, &call("sleep", json!({"seconds": 0.5})));
                assert_eq!(r.unwrap(), "slept");
            });
        }
    });
    assert!(
        t0.elapsed() < Duration::from_millis(1800),
        "{:?}",
        t0.elapsed()
    );
    assert_eq!(host.stats().calls, 4);
}

const GREEDY: &str = r#"
import socket


def spin() -> str:
    """Burns CPU forever."""
    while True:
        pass


def alloc() -> str:
    """Allocates a gigabyte."""
    return str(len(bytearray(1 << 30)))


def connect(port: int) -> str:
    """Connects to a local port.

    Args:
        port: The port.
    """
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return "connected"
    except OSError as e:
        return f"refused: {e}"
"#;

#[test]
fn cpu_and_memory_limits_cost_the_call_not_the_run() {
    let py = need_python!();
    let dir = dir_with(&[("greedy.py", GREEDY)]);
    let mut s = spec(py, dir.path(), &["greedy.py:spin", "greedy.py:alloc"], None);
    s.cpu_seconds = Some(1);
    s.memory_mb = Some(400);
    s.timeout = Duration::from_secs(20);
    let host = ToolHost::start(s.clone()).unwrap();
    let t0 = Instant::now();
    let e = host.call(0, &call("spin", json!({}))).unwrap_err();
    // RLIMIT_CPU kills the process after about a second of CPU, long before the timeout.
    assert_eq!(e.kind, "crash", "{}", e.message);
    assert!(t0.elapsed() < Duration::from_secs(15), "{:?}", t0.elapsed());
    let e = host.call(0, &call("alloc", json!({}))).unwrap_err();
    assert_eq!(
        e.kind, "raised",
        "MemoryError is raised in the tool: {}",
        e.message
    );
    assert!(e.message.contains("MemoryError"), "{}", e.message);
    assert_eq!(host.stats().restarts, 1);

    // Without the limits the same tool allocates the gigabyte (the limit is what stopped it).
    s.cpu_seconds = None;
    s.memory_mb = None;
    let host = ToolHost::start(s).unwrap();
    assert_eq!(
        host.call(0, &call("alloc", json!({}))).unwrap(),
        "1073741824"
    );
}

#[test]
fn tool_no_network_takes_the_network_away() {
    let py = need_python!();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || for _ in listener.incoming() {});
    let dir = dir_with(&[("greedy.py", GREEDY)]);
    let mut s = spec(py, dir.path(), &["greedy.py:connect"], None);
    let host = ToolHost::start(s.clone()).unwrap();
    let reach = json!({ "port": port });
    assert_eq!(
        host.call(0, &call("connect", reach.clone())).unwrap(),
        "connected"
    );
    s.no_network = true;
    match ToolHost::start(s) {
        Ok(host) => {
            let out = host.call(0, &call("connect", reach)).unwrap();
            assert!(
                out.starts_with("refused"),
                "tool_no_network did not cut the network: {out}"
            );
        }
        Err(e) => {
            let e = e.to_string();
            assert!(
                e.contains("tool_no_network") && e.contains("namespace"),
                "{e}"
            );
            eprintln!("skipped: this sandbox allows no network namespace: {e}");
        }
    }
}

/// The environment's `get_reward()` of `episode` (the first of its rewards).
fn reward(host: &ToolHost, episode: u64) -> Option<f32> {
    let row = json!({});
    host.env_rewards(episode, &row, &[])
        .first()
        .copied()
        .flatten()
}

const ENV_REWARDS: &str = r#"
def distance(environments, completions, target, **kwargs):
    return [float(t - e.count) - len(c) for e, c, t in zip(environments, completions, target)]

def raises(environments, **kwargs):
    raise ValueError("no score today")

def not_a_number(environments, **kwargs):
    return ["high"]

def two_scores(environments, **kwargs):
    return [1.0, 2.0]

def without(completions, **kwargs):
    return [0.0 for _ in completions]
"#;

#[test]
fn reward_functions_taking_environments_score_on_the_instances() {
    let py = need_python!();
    let dir = dir_with(&[("env.py", ENV), ("rw.py", ENV_REWARDS)]);
    let mut s = spec(py, dir.path(), &[], Some("env.py:Counter"));
    s.reward_functions = [
        "distance",
        "raises",
        "without",
        "not_a_number",
        "two_scores",
    ]
    .iter()
    .map(|f| format!("rw.py:{f}"))
    .collect();
    let host = ToolHost::start(s).unwrap();
    // `without` has no `environments` parameter: grpo's reward adapter scores it.
    let listed: Vec<&str> = host
        .env_reward_functions()
        .iter()
        .map(String::as_str)
        .collect();
    assert_eq!(
        listed,
        [
            "rw.py:distance",
            "rw.py:raises",
            "rw.py:not_a_number",
            "rw.py:two_scores"
        ]
    );
    let row = json!({"prompt": "count", "target": 5});
    host.reset(0, &row).unwrap();
    host.call(0, &call("increment", json!({"by": 2}))).unwrap();
    let messages = [json!({"role": "assistant", "content": "2"})];
    // get_reward (not reached: 0), then 5 - 2 - one message; a function that raises, returns a
    // word or two scores for one episode costs its own score only.
    assert_eq!(
        host.env_rewards(0, &row, &messages),
        [Some(0.0), Some(2.0), None, None, None]
    );
    // An episode without an instance (never reset) gets no scores, and no crash.
    assert_eq!(host.env_rewards(9, &row, &messages), [None; 5]);
    assert!(host.stats().errors["raised"] >= 3, "{:?}", host.stats());
}

/// No Python here: a skip, or under `GRPO_REQUIRE_PYTHON=1` (set by `.ci/run`) a failure.
fn no_python(why: &str) {
    assert!(
        std::env::var("GRPO_REQUIRE_PYTHON").map_or(true, |v| v != "1"),
        "GRPO_REQUIRE_PYTHON=1 but {why}"
    );
    eprintln!("skipped: {why}");
}
