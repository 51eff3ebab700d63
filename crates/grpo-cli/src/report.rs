//! Run report: `report.html` and `plots/*.png` from a run directory.
//!
//! Reads what the trainer writes ([`grpo::logs`]): `metrics.jsonl` (required),
//! `completions.jsonl`, `eval/step-N.jsonl` and `config.toml` (all optional), and writes one
//! self-contained HTML file (the plots are embedded as base64 PNG data URIs, so the file can be
//! mailed alone) plus the same plots as PNG files in `plots/`.
//!
//! The page is the minijinja template `report.html.j2`, rendered with HTML auto-escaping from
//! plain serializable views of the run (`PageView`): every number is formatted here, every text
//! is escaped there.
//!
//! Plots are drawn with `plotters` (bitmap backend, PNG encoder); text goes through `ab_glyph`
//! with an embedded font, so nothing depends on fontconfig or system fonts. The font is Noto Sans
//! Regular from the `ttf-noto-sans` crate (crate MIT/Apache-2.0; the font file itself is under the
//! Apache License 2.0, which the crate ships as `assets/LICENSE-2.0.txt`).

mod agent;
mod html;
mod plots;
/// Keeps the first `head` and last `tail` characters of a long text (a completion's answer is at
/// its end), marking what was cut.
pub(crate) fn truncate_middle(s: &str, head: usize, tail: usize) -> String {
    let n = s.chars().count();
    if n <= head + tail + 20 {
        return s.to_string();
    }
    let start: String = s.chars().take(head).collect();
    let end: String = s.chars().skip(n - tail).collect();
    format!("{start} […{} characters…] {end}", n - head - tail)
}

/// A number for a table cell (three decimals, so a column lines up); "–" for none.
pub(crate) fn num(v: f64) -> String {
    if !v.is_finite() {
        "–".into()
    } else if v.abs() >= 1000.0 {
        format!("{v:.0}")
    } else if v != 0.0 && v.abs() < 1e-3 {
        format!("{v:.2e}")
    } else {
        format!("{v:.3}")
    }
}

pub(crate) fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

#[cfg(test)]
mod tests;

use std::collections::{BTreeSet, HashMap};
use std::io::BufRead;
use std::path::{Path, PathBuf};

use serde_json::Value;

use grpo::train::names;
use grpo::{Error, Result};

use html::{read_health, Page};
use plots::{plot_specs, register_font};

/// What [`write_report`] wrote.
#[derive(Debug, Clone)]
pub struct ReportSummary {
    /// The HTML report.
    pub html: PathBuf,
    /// Every PNG written, in report order.
    pub plots: Vec<PathBuf>,
    /// Titles of the plots left out because their metrics are absent from `metrics.jsonl`.
    pub skipped: Vec<String>,
    /// Problems that did not stop the report (malformed or truncated lines).
    #[cfg_attr(not(test), allow(dead_code))] // logged as they are found; the tests read them
    pub warnings: Vec<String>,
}

/// Writes `run_dir/report.html` and `run_dir/plots/*.png`.
pub fn write_report(run_dir: &Path) -> Result<ReportSummary> {
    write_report_to(run_dir, run_dir)
}

/// Reads the run in `run_dir` and writes `out_dir/report.html` and `out_dir/plots/*.png`.
pub fn write_report_to(run_dir: &Path, out_dir: &Path) -> Result<ReportSummary> {
    let mut warnings = Vec::new();
    let metrics = Metrics::read(&run_dir.join("metrics.jsonl"), &mut warnings)?;
    let samples = Samples::read(&run_dir.join("completions.jsonl"), &mut warnings)?;
    let evals = read_evals(&run_dir.join("eval"), &mut warnings)?;
    let config = read_optional(&run_dir.join("config.toml"))?;
    let health = read_health(&run_dir.join("health.jsonl"));
    let best = grpo::checkpoint::best_checkpoint(run_dir).ok().flatten();

    let plots_dir = out_dir.join("plots");
    std::fs::create_dir_all(&plots_dir)
        .map_err(|e| Error::io(format!("cannot create {}", plots_dir.display()), e))?;
    register_font(&plots_dir)?;
    let mut plots = Vec::new();
    // The agent's curves (agent runs only) after the others.
    let agent_specs = agent::plot_specs(&metrics.keys());
    for spec in plot_specs(&metrics).into_iter().chain(agent_specs) {
        plots.push(spec.render(&metrics, &plots_dir)?);
    }
    let page = Page {
        run_dir,
        metrics: &metrics,
        samples: &samples,
        evals: &evals,
        config: config.as_deref(),
        plots: &plots,
        warnings: &warnings,
        health: &health,
        best: best.as_deref(),
    };
    let html_path = out_dir.join("report.html");
    let html = page
        .html()
        .map_err(|e| Error::file(&html_path, format!("cannot render the report: {e:#}")))?;
    std::fs::write(&html_path, html)
        .map_err(|e| Error::io(format!("cannot write {}", html_path.display()), e))?;
    for w in &warnings {
        tracing::warn!("report: {w}");
    }
    Ok(ReportSummary {
        html: html_path,
        plots: plots
            .iter()
            .filter_map(|p| p.png.as_ref().map(|(path, _)| path.clone()))
            .collect(),
        skipped: plots
            .iter()
            .filter(|p| p.png.is_none())
            .map(|p| p.title.clone())
            .collect(),
        warnings,
    })
}

// ------------------------------------------------------------------------------------ inputs

/// One line of `metrics.jsonl`: null (a non-finite value) is NaN.
struct Row {
    step: u64,
    values: HashMap<String, f64>,
    time: Option<f64>,
}

/// `metrics.jsonl`, sorted by step.
struct Metrics {
    rows: Vec<Row>,
}

type JsonObject = serde_json::Map<String, Value>;

/// Splits a JSON-lines file into parsed objects, 1-based line numbers, and the numbers of the
/// lines that are not JSON objects (blank lines are ignored).
fn json_lines(bytes: &[u8]) -> (Vec<(usize, JsonObject)>, Vec<usize>) {
    let mut good = Vec::new();
    let mut bad = Vec::new();
    for (i, line) in bytes.split(|&b| b == b'\n').enumerate() {
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        match serde_json::from_slice::<Value>(line) {
            Ok(Value::Object(o)) => good.push((i + 1, o)),
            _ => bad.push(i + 1),
        }
    }
    (good, bad)
}

/// The warning for skipped lines; a bad last line is most likely a write cut short.
fn skipped_lines_warning(path: &Path, bad: &[usize], last_line: usize) -> Option<String> {
    match bad {
        [] => None,
        [n] if *n == last_line => Some(format!(
            "{}: line {n} is truncated or not JSON: skipped",
            path.display()
        )),
        _ => {
            let shown: Vec<String> = bad.iter().take(10).map(usize::to_string).collect();
            let more = if bad.len() > 10 { ", ..." } else { "" };
            Some(format!(
                "{}: {} line(s) are not JSON objects and were skipped (line {}{more})",
                path.display(),
                bad.len(),
                shown.join(", ")
            ))
        }
    }
}

fn last_line_number(bytes: &[u8]) -> usize {
    let trimmed = bytes.trim_ascii_end();
    trimmed.split(|&b| b == b'\n').count()
}

impl Metrics {
    fn read(path: &Path, warnings: &mut Vec<String>) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => Error::file(
                path,
                "not found: is this a run directory (the trainer's output_dir)?",
            ),
            _ => Error::file(path, format!("cannot read: {e}")),
        })?;
        if bytes.trim_ascii().is_empty() {
            return Err(Error::file(path, "is empty: the run logged no metrics yet"));
        }
        let (objects, mut bad) = json_lines(&bytes);
        let mut rows = Vec::with_capacity(objects.len());
        for (line, obj) in objects {
            match Self::row(obj) {
                Some(r) => rows.push(r),
                None => bad.push(line),
            }
        }
        bad.sort_unstable();
        warnings.extend(skipped_lines_warning(path, &bad, last_line_number(&bytes)));
        if rows.is_empty() {
            return Err(Error::file(path, "has no line with a `step`"));
        }
        rows.sort_by_key(|r| r.step);
        Ok(Self { rows })
    }

    fn row(obj: JsonObject) -> Option<Row> {
        let step = obj.get("step").and_then(Value::as_u64)?;
        let time = obj.get("time").and_then(Value::as_f64);
        let values = obj
            .into_iter()
            .filter(|(k, _)| k != "step" && k != "time")
            .filter_map(|(k, v)| match v {
                Value::Null => Some((k, f64::NAN)),
                Value::Number(n) => n.as_f64().map(|x| (k, x)),
                _ => None,
            })
            .collect();
        Some(Row { step, values, time })
    }

    fn get(row: &Row, key: &str) -> Option<f64> {
        row.values.get(key).copied().filter(|v| v.is_finite())
    }

    /// Every metric name, sorted.
    fn keys(&self) -> BTreeSet<&str> {
        self.rows
            .iter()
            .flat_map(|r| r.values.keys().map(String::as_str))
            .collect()
    }

    fn has(&self, key: &str) -> bool {
        self.rows.iter().any(|r| Self::get(r, key).is_some())
    }

    /// Rows of training steps (not the eval-only rows, such as the one before training, nor the
    /// supervised warm-up's `warmup/*` rows, logged at step 0).
    fn train_rows(&self) -> impl Iterator<Item = &Row> {
        self.rows.iter().filter(|r| {
            r.values
                .keys()
                .any(|k| !k.starts_with(names::EVAL_PREFIX) && !k.starts_with("warmup/"))
        })
    }

    /// The finite values of `key`, with their steps.
    fn values(&self, key: &str) -> Vec<(u64, f64)> {
        self.rows
            .iter()
            .filter_map(|r| Self::get(r, key).map(|v| (r.step, v)))
            .collect()
    }

    /// The last row with any `eval/` metric.
    fn last_eval(&self) -> Option<&Row> {
        self.rows.iter().rev().find(|r| {
            r.values
                .iter()
                .any(|(k, v)| k.starts_with(names::EVAL_PREFIX) && v.is_finite())
        })
    }
}

/// One line of `completions.jsonl`.
#[derive(Debug, Clone)]
struct Sample {
    line: usize,
    step: Option<u64>,
    prompt: String,
    completion: String,
    stop_reason: String,
    rewards: Vec<(String, Option<f64>)>,
    reward: f64,
    advantage: f64,
    /// An agent's episode turn by turn (rows with `messages`).
    episode: Option<agent::EpisodeLog>,
}

impl Sample {
    fn parse(line: usize, o: &JsonObject) -> Self {
        let text = |k: &str| match o.get(k) {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Null) | None => String::new(),
            Some(v) => v.to_string(),
        };
        let num = |k: &str| o.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN);
        let rewards = match o.get("rewards") {
            Some(Value::Object(m)) => m.iter().map(|(k, v)| (k.clone(), v.as_f64())).collect(),
            _ => Vec::new(),
        };
        Self {
            line,
            step: o.get("step").and_then(Value::as_u64),
            prompt: text("prompt"),
            completion: text("completion"),
            stop_reason: text("stop_reason"),
            rewards,
            reward: num(names::REWARD),
            advantage: num("advantage"),
            episode: agent::EpisodeLog::parse(o),
        }
    }
}

/// How many of the best and worst completions the report shows.
const SHOWN_SAMPLES: usize = 5;

/// The best and worst completions of `completions.jsonl` by `reward`, kept while streaming (the
/// file holds every logged completion of the run and can be large).
#[derive(Default)]
struct Samples {
    found: bool,
    total: usize,
    unscored: usize,
    best: Vec<Sample>,
    worst: Vec<Sample>,
    reward_names: Vec<String>,
    /// Some completion is an agent's episode: the samples are shown turn by turn.
    agent: bool,
}

/// Best first: higher reward, then the later step.
fn better(a: &Sample, b: &Sample) -> std::cmp::Ordering {
    b.reward.total_cmp(&a.reward).then(b.step.cmp(&a.step))
}

/// Worst first: lower reward, then the later step.
fn worse(a: &Sample, b: &Sample) -> std::cmp::Ordering {
    a.reward.total_cmp(&b.reward).then(b.step.cmp(&a.step))
}

fn keep_top(v: &mut Vec<Sample>, s: Sample, order: fn(&Sample, &Sample) -> std::cmp::Ordering) {
    v.push(s);
    if v.len() > 8 * SHOWN_SAMPLES {
        v.sort_by(order);
        v.truncate(SHOWN_SAMPLES);
    }
}

impl Samples {
    fn read(path: &Path, warnings: &mut Vec<String>) -> Result<Self> {
        let file = match std::fs::File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Self::default()),
            Err(e) => return Err(Error::file(path, format!("cannot read: {e}"))),
        };
        let mut out = Self {
            found: true,
            ..Self::default()
        };
        let mut bad = Vec::new();
        let mut last_line = 0;
        for (i, line) in std::io::BufReader::new(file).split(b'\n').enumerate() {
            let line = line.map_err(|e| Error::file(path, format!("cannot read: {e}")))?;
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            last_line = i + 1;
            match serde_json::from_slice::<Value>(&line) {
                Ok(Value::Object(o)) => out.add(Sample::parse(i + 1, &o)),
                _ => bad.push(i + 1),
            }
        }
        warnings.extend(skipped_lines_warning(path, &bad, last_line));
        out.finish();
        Ok(out)
    }

    fn add(&mut self, s: Sample) {
        self.total += 1;
        self.agent |= s.episode.is_some();
        for (name, _) in &s.rewards {
            if !self.reward_names.contains(name) {
                self.reward_names.push(name.clone());
            }
        }
        if !s.reward.is_finite() {
            self.unscored += 1;
            return;
        }
        keep_top(&mut self.best, s.clone(), better);
        keep_top(&mut self.worst, s, worse);
    }

    /// Sorts and cuts both lists; a completion shown among the best is not repeated among the
    /// worst (in a run with fewer than twice [`SHOWN_SAMPLES`] completions).
    fn finish(&mut self) {
        self.best.sort_by(better);
        self.best.truncate(SHOWN_SAMPLES);
        self.worst.sort_by(worse);
        let best: BTreeSet<usize> = self.best.iter().map(|s| s.line).collect();
        self.worst.retain(|s| !best.contains(&s.line));
        self.worst.truncate(SHOWN_SAMPLES);
    }
}

/// One `eval/step-N.jsonl`.
struct EvalFile {
    step: u64,
    path: PathBuf,
    answers: Vec<JsonObject>,
}

/// Every `eval/step-N.jsonl`, by step; an absent `eval/` is no evaluation.
fn read_evals(dir: &Path, warnings: &mut Vec<String>) -> Result<Vec<EvalFile>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::file(dir, format!("cannot list: {e}"))),
    };
    let mut out = Vec::new();
    for entry in entries {
        let path = entry
            .map_err(|e| Error::file(dir, format!("cannot list: {e}")))?
            .path();
        let Some(step) = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix("step-")?.strip_suffix(".jsonl"))
            .and_then(|n| n.parse::<u64>().ok())
        else {
            continue;
        };
        let bytes =
            std::fs::read(&path).map_err(|e| Error::file(&path, format!("cannot read: {e}")))?;
        let (answers, bad) = json_lines(&bytes);
        warnings.extend(skipped_lines_warning(&path, &bad, last_line_number(&bytes)));
        out.push(EvalFile {
            step,
            path,
            answers: answers.into_iter().map(|(_, o)| o).collect(),
        });
    }
    out.sort_by_key(|e| e.step);
    Ok(out)
}

fn read_optional(path: &Path) -> Result<Option<String>> {
    match std::fs::read(path) {
        Ok(b) => Ok(Some(String::from_utf8_lossy(&b).into_owned())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::file(path, format!("cannot read: {e}"))),
    }
}
