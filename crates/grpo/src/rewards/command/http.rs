//! `kind = "http"`: the scorer as an HTTP endpoint that each request (or batch) is POSTed to.

use std::sync::atomic::AtomicU64;
use std::sync::Mutex;
use std::time::Duration;

use super::protocol::{
    excerpt, lock, numbered_requests, parse_answers, unit_line, units, Answer, Miss, ScorerStats,
    Tally,
};
use super::spec::{at_least_one, string_table, timeout};
use crate::rewards::table::Table;
use crate::rewards::ScoreItem;
use crate::Result;

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

    /// Reads a table made with `Table::new(obj, path, HttpSpec::KEYS)`.
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

/// The scorer as an HTTP endpoint: each request (or batch) is POSTed as the JSON body.
pub struct HttpScorer {
    spec: HttpSpec,
    name: String,
    agent: ureq::Agent,
    next_id: AtomicU64,
    stats: Mutex<ScorerStats>,
}

impl std::fmt::Debug for HttpScorer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpScorer")
            .field("name", &self.name)
            .field("spec", &self.spec)
            .finish_non_exhaustive()
    }
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

    /// Whether the endpoint answers at all, before training: one GET of `url` (any HTTP status
    /// counts, as the endpoint may take POSTs only), so that a server that is down or a wrong
    /// address fails the run at start instead of as missing rewards at the first step. Nothing
    /// is scored.
    pub fn probe(&self) -> Result<()> {
        let mut req = self.agent.get(&self.spec.url);
        for (k, v) in &self.spec.headers {
            req = req.set(k, v);
        }
        match req.call() {
            Ok(_) | Err(ureq::Error::Status(..)) => Ok(()),
            Err(ureq::Error::Transport(t)) => Err(crate::Error::reward(
                &self.name,
                format!(
                    "the endpoint {} does not answer ({t}); start the scorer before training, or \
                     fix the reward's `url`",
                    self.spec.url
                ),
            )),
        }
    }

    /// One reward per item, NaN where the endpoint answered null or garbage, returned an error
    /// status, could not be reached or did not answer within `timeout_s` (each counted and
    /// warned about).
    pub fn score(&self, items: &[ScoreItem]) -> Result<Vec<f32>> {
        if items.is_empty() {
            return Ok(vec![]);
        }
        let (base, requests) = numbered_requests(&self.next_id, items);
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
                // The body only adds detail to the message; the status is the error.
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

/// Whether an I/O error is a read or connect that ran out of time.
pub(crate) fn is_timeout_io(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Map, Value};

    fn http_spec(json: &str) -> Result<HttpSpec> {
        let obj: Map<String, Value> = serde_json::from_str(json).unwrap();
        HttpSpec::from_table(&Table::new(&obj, "rewards[1]".into(), HttpSpec::KEYS)?)
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
}
