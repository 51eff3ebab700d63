//! One running scorer process: spawned in its minimal environment and sandbox, fed by a writer
//! thread, read line by line (bounded) by reader threads, killed with its process group.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStderr, ChildStdin, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::protocol::lock;

use super::sandbox;
use super::spec::{CommandSpec, BASE_ENV};
use crate::{Error, Result};

const STDERR_TAIL: usize = 20;

pub(crate) enum Out {
    Line(String),
    Eof,
}

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
    pub(super) failures_in_a_row: usize,
}

impl Proc {
    pub(crate) fn spawn(spec: &CommandSpec, name: &str) -> Result<Proc> {
        let mut cmd = scorer_command(spec);
        let mut child = cmd.spawn().map_err(|e| start_error(&e, spec, name))?;
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

        let in_tx = write_lines(thread("in"), stdin).map_err(spawn_err)?;
        let out_rx = read_answers(thread("out"), stdout, name).map_err(spawn_err)?;
        let (tail, done_rx) = read_stderr(thread("err"), stderr, name).map_err(spawn_err)?;

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

/// The scorer's command: its program (a relative path with a slash taken from its `cwd`), pipes,
/// working directory, minimal environment and sandbox.
fn scorer_command(spec: &CommandSpec) -> Command {
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
    cmd
}

/// The error for a scorer that cannot be started, with a hint at the likely cause.
fn start_error(e: &std::io::Error, spec: &CommandSpec, name: &str) -> Error {
    let hint = match e.kind() {
        std::io::ErrorKind::NotFound => {
            " (is the program installed and on PATH, or a path that exists?)"
        }
        std::io::ErrorKind::PermissionDenied => " (is the file executable?)",
        _ if spec.no_network => " (no_network is set: the network namespace may be refused)",
        _ => "",
    };
    Error::reward(
        name,
        format!("cannot start scorer `{}`: {e}{hint}", spec.display()),
    )
}

/// Starts the thread writing the lines sent to the returned channel to the scorer's stdin; it
/// stops when the channel closes or the scorer stops reading.
fn write_lines(thread: std::thread::Builder, stdin: ChildStdin) -> std::io::Result<Sender<String>> {
    let (in_tx, in_rx) = mpsc::channel::<String>();
    thread.spawn(move || {
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
    })?;
    Ok(in_tx)
}

/// Starts the thread reading the scorer's stdout: each line, then `Eof` (at the end of stdout,
/// or after a line over [`MAX_ANSWER_LINE`], which ends the scorer as a crash).
fn read_answers(
    thread: std::thread::Builder,
    stdout: ChildStdout,
    name: &str,
) -> std::io::Result<Receiver<Out>> {
    let (out_tx, out_rx) = mpsc::channel();
    let name_out = name.to_owned();
    thread.spawn(move || {
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
    })?;
    Ok(out_rx)
}

/// The last lines of a scorer's stderr, and a channel that disconnects when all of it is read.
type StderrTail = (Arc<Mutex<VecDeque<String>>>, Receiver<()>);

/// Starts the thread reading the scorer's stderr: each line logged, the last [`STDERR_TAIL`]
/// kept for error messages.
fn read_stderr(
    thread: std::thread::Builder,
    stderr: ChildStderr,
    name: &str,
) -> std::io::Result<StderrTail> {
    let tail = Arc::new(Mutex::new(VecDeque::new()));
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let (tail2, name2) = (tail.clone(), name.to_owned());
    thread.spawn(move || {
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
    })?;
    Ok((tail, done_rx))
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
