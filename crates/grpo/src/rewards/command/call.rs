//! One `score()` call: the work queue shared by the processes' threads, each feeding its
//! process, collecting answers, and restarting it on a crash or hang.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::RecvTimeoutError;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tracing::warn;

use super::protocol::{excerpt, lock, parse_answers, unit_line, Answer, Miss, Tally};

use super::process::{Out, Proc};
use super::spec::CommandSpec;
use crate::{Error, Result};

/// One `score()` call: the work queue and results, shared by the processes' threads.
pub(super) struct Call<'a> {
    pub(super) spec: &'a CommandSpec,
    pub(super) name: &'a str,
    pub(super) requests: &'a [String],
    pub(super) base: u64,
    pub(super) max_in_flight: usize,
    pub(super) queue: Mutex<VecDeque<Vec<usize>>>,
    pub(super) tally: Mutex<Tally>,
    pub(super) abort: AtomicBool,
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
    pub(super) fn run(&self, p: &mut Proc) -> Result<()> {
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
