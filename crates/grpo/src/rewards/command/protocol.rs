//! What scorer programs and endpoints are sent and answer (docs/rewards.md (Scorer programs)), and the
//! bookkeeping of one `score()` call that both scorer kinds share.

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard};

use serde_json::Value;
use tracing::warn;

use crate::rewards::ScoreItem;

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

    pub(super) fn add(&mut self, o: &ScorerStats) {
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

/// Why a request got no number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Miss {
    Null,
    Timeout,
    Crash,
    Garbage,
    HttpError,
}

pub(super) type Outcome = std::result::Result<f32, Miss>;

/// Requests for `items` with fresh ids from `next_id` (unique over the scorer's lifetime); returns
/// the first id and the request lines.
pub(super) fn numbered_requests(
    next_id: &std::sync::atomic::AtomicU64,
    items: &[ScoreItem],
) -> (u64, Vec<String>) {
    let base = next_id.fetch_add(items.len() as u64, std::sync::atomic::Ordering::Relaxed);
    let lines = items
        .iter()
        .enumerate()
        .map(|(i, it)| request_json(base + i as u64, it))
        .collect();
    (base, lines)
}

/// One request as a JSON object (one line, no newline).
pub(super) fn request_json(id: u64, item: &ScoreItem) -> String {
    let mut r = serde_json::json!({
        "id": id,
        "prompt": item.prompt_json(),
        "completion": item.completion,
        "answer": item.answer,
        "metadata": item.metadata,
    });
    // An agent's episode: its turns as messages too (TRL's conversational completions).
    if let Some(m) = item.messages {
        r["completion_messages"] = Value::Array(m.to_vec());
    }
    r.to_string()
}

/// What one answer line (or HTTP body) says.
pub(super) enum Answer {
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
pub(super) fn parse_answers(text: &str) -> (Vec<Answer>, bool) {
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

pub(super) fn excerpt(s: &str) -> String {
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
pub(super) struct Tally {
    out: Vec<Option<Outcome>>,
    garbage_lines: u64,
    pub(super) restarts: u64,
    /// The first few garbage lines and non-numeric rewards, shown in the warning.
    garbage_shown: Vec<String>,
    /// The first few HTTP errors, shown in the warning.
    errors_shown: Vec<String>,
}

const SHOWN: usize = 3;

impl Tally {
    pub(super) fn new(n: usize) -> Self {
        Tally {
            out: vec![None; n],
            garbage_lines: 0,
            restarts: 0,
            garbage_shown: vec![],
            errors_shown: vec![],
        }
    }
    pub(super) fn set(&mut self, idx: usize, o: Outcome) {
        if self.out[idx].is_none() {
            self.out[idx] = Some(o);
        }
    }
    pub(super) fn garbage_line(&mut self, what: String) {
        self.garbage_lines += 1;
        self.show_garbage(what);
    }
    pub(super) fn show_garbage(&mut self, what: String) {
        if self.garbage_shown.len() < SHOWN {
            self.garbage_shown.push(what);
        }
    }
    pub(super) fn show_error(&mut self, what: String) {
        if self.errors_shown.len() < SHOWN {
            self.errors_shown.push(what);
        }
    }

    /// Rewards (NaN where missing), added to `stats`, with one warning summing up what went wrong.
    pub(super) fn finish(self, name: &str, stats: &Mutex<ScorerStats>) -> Vec<f32> {
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
pub(super) fn units(n: usize, batch_size: usize) -> VecDeque<Vec<usize>> {
    (0..n)
        .collect::<Vec<_>>()
        .chunks(batch_size)
        .map(<[usize]>::to_vec)
        .collect()
}

/// The line (or body) for a unit: one object, or an array when batching.
pub(super) fn unit_line(unit: &[usize], requests: &[String], batched: bool) -> String {
    if batched {
        let parts: Vec<&str> = unit.iter().map(|&i| requests[i].as_str()).collect();
        format!("[{}]", parts.join(","))
    } else {
        requests[unit[0]].clone()
    }
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Map;

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
            metadata: serde_json::from_str::<Map<String, Value>>(r#"{"level": 1}"#).unwrap(),
            origin: "t".into(),
            tokens: None,
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
