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

use std::collections::{BTreeSet, HashMap};
use std::fmt::Display;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use base64::Engine as _;
use minijinja::{AutoEscape, Environment, HtmlEscape, Output, State, UndefinedBehavior};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use serde::Serialize;
use serde_json::Value;

use grpo::train::names::{self, TIME_PARTS};
use grpo::{Error, Result};

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
    for spec in plot_specs(&metrics) {
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

    /// Rows of training steps (not the eval-only rows, such as the one before training).
    fn train_rows(&self) -> impl Iterator<Item = &Row> {
        self.rows
            .iter()
            .filter(|r| r.values.keys().any(|k| !k.starts_with(names::EVAL_PREFIX)))
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

// ------------------------------------------------------------------------------------- plots

const WIDTH: u32 = 960;
const HEIGHT: u32 = 540;
/// The family name the embedded font is registered under.
const FONT: &str = "sans-serif";

/// matplotlib's "tab10" colours: distinct, and readable on white.
const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

fn color(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

/// Registers the embedded font with plotters, once per process.
fn register_font(plots_dir: &Path) -> Result<()> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| {
        plotters::style::register_font(FONT, FontStyle::Normal, ttf_noto_sans::REGULAR).is_ok()
    });
    if ok {
        Ok(())
    } else {
        Err(Error::file(
            plots_dir,
            "the embedded plot font cannot be loaded",
        ))
    }
}

fn draw_err<E: Display>(path: &Path) -> impl Fn(E) -> Error + '_ {
    move |e| Error::file(path, format!("cannot draw the plot: {e}"))
}

/// The shaded band around a line.
#[derive(Clone)]
enum Band {
    None,
    /// mean ± the metric with this key.
    Std(String),
    /// Between two metrics (min and max).
    Range(String, String),
}

/// One line of a plot: a metric, its legend label, and an optional band.
#[derive(Clone)]
struct Line {
    label: String,
    key: String,
    band: Band,
    /// Dashed, so that a solid line it coincides with stays visible (accuracy is pass@1).
    dashed: bool,
}

impl Line {
    fn new(label: impl Into<String>, key: impl Into<String>) -> Self {
        Self {
            label: label.into(),
            key: key.into(),
            band: Band::None,
            dashed: false,
        }
    }
    fn dashed(mut self) -> Self {
        self.dashed = true;
        self
    }
    fn band(mut self, band: Band) -> Self {
        self.band = band;
        self
    }
}

enum Kind {
    Lines(Vec<Line>),
    /// Stacked bars of the `time/` parts of a step.
    TimeSplit,
}

/// One PNG of the report.
struct PlotSpec {
    file: &'static str,
    title: String,
    y_desc: &'static str,
    kind: Kind,
    /// Fix the y axis to [0, 1] when every value lies in it (accuracies).
    unit_range: bool,
}

/// A plot as the page shows it: the PNG (path and bytes), or the metrics it lacked.
struct Plot {
    title: String,
    png: Option<(PathBuf, Vec<u8>)>,
    wanted: Vec<String>,
}

/// The metric keys drawn per reward function: `rewards/<name>/mean`.
fn reward_names(keys: &BTreeSet<&str>) -> Vec<String> {
    keys.iter()
        .filter_map(|k| k.strip_prefix("rewards/")?.strip_suffix("/mean"))
        .map(str::to_string)
        .collect()
}

/// `eval/pass@k` keys, by k.
fn pass_at_k_keys(keys: &BTreeSet<&str>) -> Vec<(u64, String)> {
    let mut out: Vec<(u64, String)> = keys
        .iter()
        .filter_map(|k| {
            let n = k.strip_prefix(names::EVAL_PASS_AT)?.parse::<u64>().ok()?;
            Some((n, k.to_string()))
        })
        .collect();
    out.sort();
    out
}

fn line_plot(file: &'static str, title: &str, y_desc: &'static str, lines: Vec<Line>) -> PlotSpec {
    PlotSpec {
        file,
        title: title.to_string(),
        y_desc,
        kind: Kind::Lines(lines),
        unit_range: false,
    }
}

/// Every plot of the report, in page order.
fn plot_specs(m: &Metrics) -> Vec<PlotSpec> {
    let keys = m.keys();
    let per_reward = reward_names(&keys)
        .into_iter()
        .map(|n| {
            let band = Band::Std(names::reward_std(&n));
            Line::new(n.clone(), names::reward_mean(&n)).band(band)
        })
        .collect();
    let mut eval: Vec<Line> = pass_at_k_keys(&keys)
        .into_iter()
        .map(|(k, key)| Line::new(format!("pass@{k}"), key))
        .collect();
    eval.push(Line::new("accuracy", names::EVAL_ACCURACY).dashed());
    eval.push(Line::new("mean accuracy", names::EVAL_MEAN_ACCURACY).dashed());
    let eval_rewards = keys
        .iter()
        .filter_map(|k| k.strip_prefix(names::EVAL_REWARD_PREFIX))
        .map(|n| Line::new(n, format!("{}{n}", names::EVAL_REWARD_PREFIX)))
        .collect();
    let mut specs = vec![
        line_plot(
            "reward.png",
            "Reward (mean ± std over the step's completions)",
            "reward",
            vec![Line::new("reward", names::REWARD).band(Band::Std(names::REWARD_STD.into()))],
        ),
        line_plot(
            "rewards_per_function.png",
            "Reward per function (mean ± std)",
            "score",
            per_reward,
        ),
        PlotSpec {
            unit_range: true,
            ..line_plot(
                "eval.png",
                "Evaluation: pass@k and accuracy",
                "fraction of eval prompts",
                eval,
            )
        },
        line_plot(
            "eval_rewards.png",
            "Evaluation: mean reward per function",
            "score",
            eval_rewards,
        ),
        line_plot(
            "kl.png",
            "KL divergence to the reference model",
            "KL",
            vec![Line::new("KL", names::KL)],
        ),
        line_plot(
            "loss.png",
            "Loss",
            "loss",
            vec![
                Line::new("loss", names::LOSS),
                Line::new("policy-gradient loss", names::PG_LOSS),
            ],
        ),
        line_plot(
            "entropy.png",
            "Policy entropy (mean per token)",
            "entropy (nats)",
            vec![Line::new("entropy", names::ENTROPY)],
        ),
        line_plot(
            "length.png",
            "Completion length (mean, band: min to max)",
            "tokens",
            vec![
                Line::new("mean length", names::MEAN_LENGTH).band(Band::Range(
                    names::MIN_LENGTH.into(),
                    names::MAX_LENGTH.into(),
                )),
            ],
        ),
        line_plot(
            "clip_ratio.png",
            "Clipped probability ratios",
            "fraction of tokens",
            vec![
                Line::new("low", names::CLIP_LOW),
                Line::new("high", names::CLIP_HIGH),
                Line::new("region", names::CLIP_REGION),
            ],
        ),
        line_plot(
            "grad_norm.png",
            "Gradient norm",
            "norm",
            vec![Line::new("gradient norm", names::GRAD_NORM)],
        ),
        line_plot(
            "learning_rate.png",
            "Learning rate",
            "learning rate",
            vec![Line::new("learning rate", names::LEARNING_RATE)],
        ),
        PlotSpec {
            file: "time.png",
            title: "Time per step".into(),
            y_desc: "seconds",
            kind: Kind::TimeSplit,
            unit_range: false,
        },
    ];
    // A fill-in run's own curves (the judge's score, fills equal to the original).
    if keys.contains(grpo::fill_in::FILL_MASKED_POSITIONS) {
        specs.insert(
            2,
            PlotSpec {
                unit_range: true,
                ..line_plot(
                    "fill.png",
                    "Fill-in: judge score and fill accuracy against the original",
                    "score / fraction of masked tokens",
                    vec![
                        Line::new("judge score", grpo::fill_in::FILL_JUDGE_SCORE),
                        Line::new("fill accuracy", grpo::fill_in::FILL_ACCURACY),
                    ],
                )
            },
        );
    }
    specs
}

impl PlotSpec {
    fn render(&self, m: &Metrics, dir: &Path) -> Result<Plot> {
        let path = dir.join(self.file);
        let wanted: Vec<String> = match &self.kind {
            Kind::Lines(lines) => lines.iter().map(|l| l.key.clone()).collect(),
            Kind::TimeSplit => TIME_PARTS.iter().map(|p| format!("time/{p}")).collect(),
        };
        let mut plot = Plot {
            title: self.title.clone(),
            png: None,
            wanted,
        };
        let drawn = match &self.kind {
            Kind::Lines(lines) => {
                let series: Vec<Series> =
                    lines.iter().filter_map(|l| Series::collect(m, l)).collect();
                if !series.is_empty() {
                    self.draw_lines(&path, &series)?;
                }
                !series.is_empty()
            }
            Kind::TimeSplit => {
                let bars = time_bars(m);
                if !bars.is_empty() {
                    self.draw_time(&path, &bars)?;
                }
                !bars.is_empty()
            }
        };
        if drawn {
            let png = std::fs::read(&path)
                .map_err(|e| Error::file(&path, format!("cannot read: {e}")))?;
            plot.png = Some((path, png));
        } else {
            // A plot from an earlier report of this run would be stale now.
            let _ = std::fs::remove_file(&path);
        }
        Ok(plot)
    }

    /// The titled drawing area and, with more than one entry, a legend panel on its right.
    fn areas<'a>(
        &self,
        root: &Area<'a>,
        labels: &[&str],
        path: &Path,
    ) -> Result<(Area<'a>, Option<Area<'a>>)> {
        root.fill(&WHITE).map_err(draw_err(path))?;
        let area = root
            .titled(&self.title, (FONT, 26))
            .map_err(draw_err(path))?;
        if labels.len() < 2 {
            return Ok((area, None));
        }
        let mut widest = 0;
        for l in labels {
            let (w, _) = root
                .estimate_text_size(l, &legend_font())
                .map_err(draw_err(path))?;
            widest = widest.max(w);
        }
        let panel = (widest + 56).clamp(110, 300);
        let (plot, legend) = area.split_horizontally(WIDTH - panel);
        Ok((plot, Some(legend)))
    }

    fn draw_lines(&self, path: &Path, series: &[Series]) -> Result<()> {
        let root = BitMapBackend::new(path, (WIDTH, HEIGHT)).into_drawing_area();
        let labels: Vec<&str> = series.iter().map(|s| s.label.as_str()).collect();
        let (area, legend) = self.areas(&root, &labels, path)?;
        let (x, y) = line_ranges(series, self.unit_range);
        let mut chart = chart(&area, x, y, path)?;
        mesh(&mut chart, self.y_desc, path)?;
        for (i, s) in series.iter().enumerate() {
            s.draw(&mut chart, color(i), path)?;
        }
        if let Some(legend) = legend {
            let entries: Vec<(&str, RGBColor, Swatch)> = series
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    let swatch = if s.dashed {
                        Swatch::Dashed
                    } else {
                        Swatch::Line
                    };
                    (s.label.as_str(), color(i), swatch)
                })
                .collect();
            draw_legend(&legend, &entries, path)?;
        }
        root.present().map_err(draw_err(path))
    }

    fn draw_time(&self, path: &Path, bars: &[TimeBar]) -> Result<()> {
        let root = BitMapBackend::new(path, (WIDTH, HEIGHT)).into_drawing_area();
        let with_other = bars.iter().any(|b| b.parts[TIME_PARTS.len()] > 0.0);
        let n_parts = TIME_PARTS.len() + usize::from(with_other);
        let labels: Vec<&str> = TIME_PARTS
            .iter()
            .copied()
            .chain(std::iter::once("other"))
            .take(n_parts)
            .collect();
        let (area, legend) = self.areas(&root, &labels, path)?;
        let half = bar_half_width(bars);
        let x0 = bars.first().map_or(0.0, |b| b.step) - half * 1.5;
        let x1 = bars.last().map_or(1.0, |b| b.step) + half * 1.5;
        let top = bars
            .iter()
            .map(|b| b.parts.iter().sum::<f64>())
            .fold(0.0, f64::max);
        let top = if top > 0.0 { top * 1.05 } else { 1.0 };
        let mut chart = chart(&area, x0..x1, 0.0..top, path)?;
        mesh(&mut chart, self.y_desc, path)?;
        let rects = bars.iter().flat_map(|b| {
            let mut base = 0.0;
            b.parts[..n_parts]
                .iter()
                .enumerate()
                .map(move |(i, &h)| {
                    let r = Rectangle::new(
                        [(b.step - half, base), (b.step + half, base + h)],
                        color(i).filled(),
                    );
                    base += h;
                    r
                })
                .collect::<Vec<_>>()
        });
        chart.draw_series(rects).map_err(draw_err(path))?;
        if let Some(legend) = legend {
            let entries: Vec<(&str, RGBColor, Swatch)> = labels
                .iter()
                .enumerate()
                .map(|(i, l)| (*l, color(i), Swatch::Box))
                .collect();
            draw_legend(&legend, &entries, path)?;
        }
        root.present().map_err(draw_err(path))
    }
}

/// A PNG's drawing area (pixel coordinates).
type Area<'a> = DrawingArea<BitMapBackend<'a>, Shift>;

type Chart<'a, 'b> = ChartContext<
    'a,
    BitMapBackend<'b>,
    Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
>;

fn chart<'a, 'b>(
    area: &'a Area<'b>,
    x: std::ops::Range<f64>,
    y: std::ops::Range<f64>,
    path: &Path,
) -> Result<Chart<'a, 'b>> {
    ChartBuilder::on(area)
        .margin_left(10)
        .margin_right(24)
        .margin_top(6)
        .margin_bottom(10)
        .x_label_area_size(52)
        .y_label_area_size(84)
        .build_cartesian_2d(x, y)
        .map_err(draw_err(path))
}

fn mesh(chart: &mut Chart, y_desc: &str, path: &Path) -> Result<()> {
    let x = chart.x_range();
    let y = chart.y_range();
    let y_span = y.end - y.start;
    // Integer steps: no more labels than steps, so none repeats.
    let x_labels = ((x.end - x.start).floor() as usize + 1).clamp(2, 10);
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc(y_desc)
        .x_labels(x_labels)
        .y_labels(8)
        .x_label_formatter(&|v| format!("{}", v.round() as i64))
        .y_label_formatter(&|v| axis_number(*v, y_span))
        .label_style((FONT, 17))
        .axis_desc_style((FONT, 19))
        .bold_line_style(RGBColor(220, 220, 220))
        .light_line_style(RGBColor(243, 243, 243))
        .max_light_lines(4)
        .axis_style(RGBColor(90, 90, 90))
        .draw()
        .map_err(draw_err(path))
}

fn legend_font() -> TextStyle<'static> {
    (FONT, 18).into_font().color(&BLACK)
}

/// How a legend entry shows its series.
#[derive(Clone, Copy)]
enum Swatch {
    Line,
    Dashed,
    Box,
}

/// The legend as a list beside the chart, so it never covers data.
fn draw_legend(area: &Area, entries: &[(&str, RGBColor, Swatch)], path: &Path) -> Result<()> {
    let font = legend_font();
    for (i, (label, c, swatch)) in entries.iter().enumerate() {
        let y = 24 + 30 * i as i32;
        let line = |x0, x1| PathElement::new(vec![(x0, y), (x1, y)], c.stroke_width(3));
        match swatch {
            Swatch::Box => area.draw(&Rectangle::new([(6, y - 7), (30, y + 7)], c.filled())),
            Swatch::Line => area.draw(&line(6, 30)),
            Swatch::Dashed => area
                .draw(&line(6, 14))
                .and_then(|_| area.draw(&line(21, 30))),
        }
        .map_err(draw_err(path))?;
        let text = Text::new(
            label.to_string(),
            (38, y),
            font.pos(Pos::new(HPos::Left, VPos::Center)),
        );
        area.draw(&text).map_err(draw_err(path))?;
    }
    Ok(())
}

/// A y-axis tick label: few digits, scientific only for very small or large values; `span` is the
/// axis' range, against which rounding noise (3.5e-18 for 0) is 0.
fn axis_number(v: f64, span: f64) -> String {
    let a = v.abs();
    let s = if a <= span.abs() * 1e-9 {
        return "0".into();
    } else if !(1e-3..1e5).contains(&a) {
        return format!("{v:.1e}");
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else if a >= 0.01 {
        format!("{v:.3}")
    } else {
        format!("{v:.4}")
    };
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// A point of a line, with its band when the band's metrics are there.
struct Point {
    x: f64,
    y: f64,
    band: Option<(f64, f64)>,
    /// A logged null (non-finite value) comes before this point: the line breaks there. A step
    /// without the metric at all (evaluation runs every few steps) does not break it.
    gap_before: bool,
}

/// The data of one line.
struct Series {
    label: String,
    points: Vec<Point>,
    dashed: bool,
}

/// Lines with at most this many points get a marker on every point (evaluations are sparse).
const MARKERS_UP_TO: usize = 40;

impl Series {
    /// The line's finite points, or None when it has none.
    fn collect(m: &Metrics, line: &Line) -> Option<Self> {
        let mut points = Vec::new();
        let mut gap = false;
        for r in &m.rows {
            let Some(&y) = r.values.get(&line.key) else {
                continue;
            };
            if !y.is_finite() {
                gap = true;
                continue;
            }
            let band = match &line.band {
                Band::None => None,
                Band::Std(k) => Metrics::get(r, k).map(|s| (y - s, y + s)),
                Band::Range(lo, hi) => Metrics::get(r, lo).zip(Metrics::get(r, hi)),
            };
            points.push(Point {
                x: r.step as f64,
                y,
                band,
                gap_before: std::mem::take(&mut gap),
            });
        }
        (!points.is_empty()).then(|| Self {
            label: line.label.clone(),
            points,
            dashed: line.dashed,
        })
    }

    /// The line's pieces between logged nulls.
    fn segments(&self) -> Vec<&[Point]> {
        self.points.chunk_by(|_, b| !b.gap_before).collect()
    }

    /// Contiguous runs of points that have a band.
    fn band_runs(&self) -> Vec<Vec<(f64, f64, f64)>> {
        let mut runs = vec![Vec::new()];
        for p in &self.points {
            match p.band {
                Some((lo, hi)) if !p.gap_before => {
                    if let Some(r) = runs.last_mut() {
                        r.push((p.x, lo, hi));
                    }
                }
                Some((lo, hi)) => runs.push(vec![(p.x, lo, hi)]),
                None => runs.push(Vec::new()),
            }
        }
        runs.retain(|r| !r.is_empty());
        runs
    }

    fn draw(&self, chart: &mut Chart, c: RGBColor, path: &Path) -> Result<()> {
        for run in self.band_runs() {
            if let [(x, lo, hi)] = run[..] {
                // One point: a bar from low to high.
                chart
                    .draw_series(std::iter::once(PathElement::new(
                        vec![(x, lo), (x, hi)],
                        c.mix(0.35).stroke_width(6),
                    )))
                    .map_err(draw_err(path))?;
                continue;
            }
            let mut outline: Vec<(f64, f64)> = run.iter().map(|&(x, _, hi)| (x, hi)).collect();
            outline.extend(run.iter().rev().map(|&(x, lo, _)| (x, lo)));
            chart
                .draw_series(std::iter::once(Polygon::new(outline, c.mix(0.18).filled())))
                .map_err(draw_err(path))?;
        }
        // Markers on sparse lines, and on a point with no neighbour to draw a line to.
        let sparse = self.points.len() <= MARKERS_UP_TO;
        for seg in self.segments() {
            let xy = seg.iter().map(|p| (p.x, p.y));
            if self.dashed {
                chart.draw_series(DashedLineSeries::new(xy.clone(), 10, 6, c.stroke_width(2)))
            } else {
                chart.draw_series(LineSeries::new(xy.clone(), c.stroke_width(2)))
            }
            .map_err(draw_err(path))?;
            if sparse || seg.len() == 1 {
                chart
                    .draw_series(xy.map(|p| Circle::new(p, 3, c.filled())))
                    .map_err(draw_err(path))?;
            }
        }
        Ok(())
    }
}

/// Pads a [lo, hi] data range so lines do not touch the frame; a flat range gets a width.
fn padded(lo: f64, hi: f64) -> std::ops::Range<f64> {
    let span = hi - lo;
    if span > 0.0 {
        (lo - span * 0.05)..(hi + span * 0.05)
    } else {
        let pad = (lo.abs() * 0.1).max(1e-3);
        (lo - pad)..(hi + pad)
    }
}

fn line_ranges(
    series: &[Series],
    unit_range: bool,
) -> (std::ops::Range<f64>, std::ops::Range<f64>) {
    let points = series.iter().flat_map(|s| &s.points);
    let (mut x0, mut x1) = (f64::INFINITY, f64::NEG_INFINITY);
    let (mut y0, mut y1) = (f64::INFINITY, f64::NEG_INFINITY);
    for p in points {
        x0 = x0.min(p.x);
        x1 = x1.max(p.x);
        let (lo, hi) = p.band.unwrap_or((p.y, p.y));
        y0 = y0.min(p.y).min(lo);
        y1 = y1.max(p.y).max(hi);
    }
    let x = if x1 > x0 {
        let pad = (x1 - x0) * 0.02;
        (x0 - pad)..(x1 + pad)
    } else {
        (x0 - 1.0)..(x1 + 1.0)
    };
    let y = if unit_range && y0 >= 0.0 && y1 <= 1.0 {
        -0.02..1.02
    } else {
        padded(y0, y1)
    };
    (x, y)
}

/// One bar of the time plot: the step and its parts (TIME_PARTS, then "other").
struct TimeBar {
    step: f64,
    parts: [f64; TIME_PARTS.len() + 1],
}

/// Bars for the rows with any time part; a missing part is 0.
fn time_bars(m: &Metrics) -> Vec<TimeBar> {
    m.rows
        .iter()
        .filter_map(|r| {
            let mut parts = [0.0; TIME_PARTS.len() + 1];
            let mut any = false;
            for (i, p) in TIME_PARTS.iter().enumerate() {
                if let Some(v) = Metrics::get(r, &format!("time/{p}")) {
                    parts[i] = v.max(0.0);
                    any = true;
                }
            }
            let sum: f64 = parts.iter().sum();
            if let Some(total) = Metrics::get(r, names::TIME_STEP) {
                parts[TIME_PARTS.len()] = (total - sum).max(0.0);
            }
            any.then_some(TimeBar {
                step: r.step as f64,
                parts,
            })
        })
        .collect()
}

/// Bars take 80% of the smallest gap between logged steps; many bars touch (gaps of a pixel or
/// two between hundreds of bars would only add noise).
fn bar_half_width(bars: &[TimeBar]) -> f64 {
    let fill = if bars.len() > 100 { 0.5 } else { 0.4 };
    let gap = bars
        .windows(2)
        .map(|w| w[1].step - w[0].step)
        .filter(|g| *g > 0.0)
        .fold(f64::INFINITY, f64::min);
    if gap.is_finite() {
        gap * fill
    } else {
        fill
    }
}

// -------------------------------------------------------------------------------------- html

/// The page, rendered by minijinja; the name ends in `.html`, so every value is HTML-escaped.
const TEMPLATE_NAME: &str = "report.html";
const TEMPLATE: &str = include_str!("report.html.j2");

/// minijinja's formatter, except that a `/` in a string stays `/`: its HTML escaping also writes
/// `/` as `&#x2f;`, which text and quoted attributes do not need and which makes the page source
/// (a completion's `</answer>`, the base64 of the plots) hard to read. Undoing it is exact: the
/// escaper writes every `&` of the input as `&amp;`, so `&#x2f;` in its output can only be a `/`.
fn html_formatter(
    out: &mut Output,
    state: &State,
    value: &minijinja::Value,
) -> std::result::Result<(), minijinja::Error> {
    match value.as_str() {
        Some(s) if state.auto_escape() == AutoEscape::Html && !value.is_safe() => {
            let escaped = HtmlEscape(s).to_string().replace("&#x2f;", "/");
            out.write_str(&escaped).map_err(minijinja::Error::from)
        }
        _ => minijinja::escape_formatter(out, state, value),
    }
}

fn render_page(page: &PageView) -> std::result::Result<String, minijinja::Error> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_keep_trailing_newline(true);
    // A name the template misspells is an error, not an empty cell.
    env.set_undefined_behavior(UndefinedBehavior::Strict);
    env.set_formatter(html_formatter);
    env.add_template(TEMPLATE_NAME, TEMPLATE)?;
    env.get_template(TEMPLATE_NAME)?.render(page)
}

/// Keeps the first `head` and last `tail` characters of a long text (a completion's answer is at
/// its end), marking what was cut.
fn truncate_middle(s: &str, head: usize, tail: usize) -> String {
    let n = s.chars().count();
    if n <= head + tail + 20 {
        return s.to_string();
    }
    let start: String = s.chars().take(head).collect();
    let end: String = s.chars().skip(n - tail).collect();
    format!("{start} […{} characters…] {end}", n - head - tail)
}

/// A number for a table cell (three decimals, so a column lines up); "–" for none.
fn num(v: f64) -> String {
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

fn duration(secs: f64) -> String {
    if !secs.is_finite() {
        return "–".into();
    }
    let s = secs.round() as u64;
    match s {
        _ if secs < 60.0 => format!("{secs:.1} s"),
        _ if s < 3600 => format!("{}m {:02}s", s / 60, s % 60),
        _ => format!("{}h {:02}m {:02}s", s / 3600, s % 3600 / 60, s % 60),
    }
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

/// One health warning the trainer wrote (`health.jsonl`).
#[derive(Serialize)]
struct HealthRow {
    step: u64,
    message: String,
}

/// The trainer's health warnings, in order (none when the file is missing or unreadable).
fn read_health(path: &Path) -> Vec<HealthRow> {
    let Ok(bytes) = std::fs::read(path) else {
        return vec![];
    };
    json_lines(&bytes)
        .0
        .into_iter()
        .map(|(_, o)| HealthRow {
            step: o.get("step").and_then(Value::as_u64).unwrap_or(0),
            message: o
                .get("message")
                .and_then(Value::as_str)
                // Rows grpo writes always have a message; a row without one still shows its step.
                .unwrap_or_default()
                .to_string(),
        })
        .collect()
}

/// Everything the HTML page shows.
struct Page<'a> {
    run_dir: &'a Path,
    metrics: &'a Metrics,
    samples: &'a Samples,
    evals: &'a [EvalFile],
    config: Option<&'a str>,
    plots: &'a [Plot],
    warnings: &'a [String],
    health: &'a [HealthRow],
    /// The best checkpoint the run recorded (`metric_for_best_model`).
    best: Option<&'a Path>,
}

/// What the template reads: every value is text as shown (numbers formatted, long texts cut).
#[derive(Serialize)]
struct PageView<'a> {
    name: String,
    run_dir: String,
    warnings: &'a [String],
    health: &'a [HealthRow],
    summary: Vec<SummaryRow>,
    figures: Vec<Figure>,
    not_plotted: Vec<NotPlotted<'a>>,
    samples: SamplesView,
    eval: Option<EvalView>,
    config: Option<&'a str>,
}

#[derive(Serialize)]
struct SummaryRow {
    label: String,
    value: String,
}

/// A plot embedded as a base64 PNG.
#[derive(Serialize)]
struct Figure {
    title: String,
    file: String,
    png_base64: String,
}

/// A plot left out, with the metrics it wanted.
#[derive(Serialize)]
struct NotPlotted<'a> {
    title: &'a str,
    keys: &'a [String],
}

#[derive(Serialize)]
struct SamplesView {
    found: bool,
    reward_names: Vec<String>,
    best: Vec<SampleRow>,
    worst: Vec<SampleRow>,
}

#[derive(Serialize)]
struct SampleRow {
    step: String,
    reward: String,
    advantage: String,
    /// One cell per name of [`SamplesView::reward_names`].
    rewards: Vec<String>,
    stop_reason: String,
    prompt: String,
    completion: String,
}

/// The last eval file's answers.
#[derive(Serialize)]
struct EvalView {
    files: Vec<EvalFileCount>,
    step: u64,
    path: String,
    reward_names: Vec<String>,
    reward_means: Vec<String>,
    /// The number of answers in the file; `answers` holds the first few.
    total: usize,
    answers: Vec<AnswerRow>,
}

#[derive(Serialize)]
struct EvalFileCount {
    step: u64,
    answers: usize,
}

#[derive(Serialize)]
struct AnswerRow {
    prompt: String,
    answer: String,
    /// One cell per name of [`EvalView::reward_names`].
    rewards: Vec<String>,
    completion: String,
}

impl Page<'_> {
    fn html(&self) -> std::result::Result<String, minijinja::Error> {
        let name = self.run_dir.file_name().map_or_else(
            || self.run_dir.display().to_string(),
            |n| n.to_string_lossy().into(),
        );
        let (figures, not_plotted) = self.plots();
        render_page(&PageView {
            name,
            run_dir: self.run_dir.display().to_string(),
            warnings: self.warnings,
            health: self.health,
            summary: self.summary(),
            figures,
            not_plotted,
            samples: self.samples(),
            eval: self.eval(),
            config: self.config,
        })
    }

    fn summary(&self) -> Vec<SummaryRow> {
        let m = self.metrics;
        let mut rows = Vec::new();
        let mut row = |label: String, value: String| rows.push(SummaryRow { label, value });
        let steps: Vec<u64> = m.train_rows().map(|r| r.step).collect();
        match (steps.first(), steps.last()) {
            (Some(a), Some(b)) => row(
                "training steps logged".into(),
                format!("{} (steps {a} to {b})", steps.len()),
            ),
            _ => row("training steps logged".into(), "0".into()),
        }
        if let Some(b) = self.best {
            row(
                "best checkpoint".into(),
                b.file_name()
                    .map_or_else(String::new, |n| n.to_string_lossy().into_owned()),
            );
        }
        let rewards: Vec<f64> = m
            .values(names::REWARD)
            .into_iter()
            .map(|(_, v)| v)
            .collect();
        if !rewards.is_empty() {
            let w = (rewards.len() / 5).clamp(1, 10);
            let first = mean(&rewards[..w]);
            let last = mean(&rewards[rewards.len() - w..]);
            row(
                format!("reward, mean of the first {w} logged step(s)"),
                num(first),
            );
            row(
                format!("reward, mean of the last {w} logged step(s)"),
                num(last),
            );
            row("reward change".into(), format!("{:+.3}", last - first));
        }
        if let Some(r) = m.last_eval() {
            let mut evals: Vec<(&String, &f64)> = r
                .values
                .iter()
                .filter(|(k, v)| k.starts_with(names::EVAL_PREFIX) && v.is_finite())
                .collect();
            evals.sort_by_key(|(k, _)| eval_order(k));
            for (k, v) in evals {
                row(format!("{k} (step {})", r.step), num(*v));
            }
        }
        let sum = |key: &str| m.values(key).iter().map(|(_, v)| v).sum::<f64>();
        if m.has(names::TIME_STEP) {
            row(
                "training time (sum of time/step)".into(),
                duration(sum(names::TIME_STEP)),
            );
        }
        if m.has(names::TIME_EVAL) {
            row(
                "evaluation time (sum of time/eval)".into(),
                duration(sum(names::TIME_EVAL)),
            );
        }
        let times: Vec<f64> = m.rows.iter().filter_map(|r| r.time).collect();
        if let (Some(a), Some(b)) = (
            times.iter().copied().reduce(f64::min),
            times.iter().copied().reduce(f64::max),
        ) {
            row("wall clock, first to last log line".into(), duration(b - a));
        }
        if self.samples.found {
            row(
                "completions logged".into(),
                format!(
                    "{} ({} without a reward)",
                    self.samples.total, self.samples.unscored
                ),
            );
        }
        rows
    }

    /// The plots drawn, and those left out for want of data.
    fn plots(&self) -> (Vec<Figure>, Vec<NotPlotted<'_>>) {
        let b64 = base64::engine::general_purpose::STANDARD;
        let mut figures = Vec::new();
        let mut missing = Vec::new();
        for p in self.plots {
            match &p.png {
                Some((path, png)) => figures.push(Figure {
                    title: p.title.clone(),
                    file: path
                        .file_name()
                        .map(|f| f.to_string_lossy().into_owned())
                        // The plot's path is the run's plot folder joined with a file name.
                        .unwrap_or_default(),
                    png_base64: b64.encode(png),
                }),
                None => missing.push(NotPlotted {
                    title: &p.title,
                    keys: &p.wanted,
                }),
            }
        }
        (figures, missing)
    }

    fn samples(&self) -> SamplesView {
        let s = self.samples;
        let rows = |rows: &[Sample]| {
            rows.iter()
                .map(|r| sample_row(r, &s.reward_names))
                .collect()
        };
        SamplesView {
            found: s.found,
            reward_names: s.reward_names.clone(),
            best: rows(&s.best),
            worst: rows(&s.worst),
        }
    }

    fn eval(&self) -> Option<EvalView> {
        let last = self.evals.last()?;
        let names = eval_reward_names(&last.answers);
        let reward_means = names
            .iter()
            .map(|n| {
                let v: Vec<f64> = last
                    .answers
                    .iter()
                    .filter_map(|a| a.get("rewards")?.get(n)?.as_f64())
                    .collect();
                num(if v.is_empty() { f64::NAN } else { mean(&v) })
            })
            .collect();
        Some(EvalView {
            files: self
                .evals
                .iter()
                .map(|e| EvalFileCount {
                    step: e.step,
                    answers: e.answers.len(),
                })
                .collect(),
            step: last.step,
            path: last.path.display().to_string(),
            total: last.answers.len(),
            answers: last
                .answers
                .iter()
                .take(SHOWN_EVAL_ANSWERS)
                .map(|a| answer_row(a, &names))
                .collect(),
            reward_means,
            reward_names: names,
        })
    }
}

/// Summary order of eval metrics: accuracy first, then pass@k by k, then the rest by name.
fn eval_order(k: &str) -> (u8, u64, String) {
    if k == names::EVAL_ACCURACY || k == names::EVAL_MEAN_ACCURACY {
        (0, 0, k.to_string())
    } else if let Some(n) = k
        .strip_prefix(names::EVAL_PASS_AT)
        .and_then(|n| n.parse().ok())
    {
        (1, n, String::new())
    } else {
        (2, 0, k.to_string())
    }
}

fn sample_row(s: &Sample, names: &[String]) -> SampleRow {
    SampleRow {
        step: s.step.map_or_else(|| "–".into(), |v| v.to_string()),
        reward: num(s.reward),
        advantage: num(s.advantage),
        rewards: names
            .iter()
            .map(|n| {
                let v = s.rewards.iter().find(|(k, _)| k == n).and_then(|(_, v)| *v);
                num(v.unwrap_or(f64::NAN))
            })
            .collect(),
        stop_reason: s.stop_reason.clone(),
        prompt: truncate_middle(&s.prompt, 150, 250),
        completion: truncate_middle(&s.completion, 700, 300),
    }
}

/// Reward names of eval answers, in first-seen order.
fn eval_reward_names(answers: &[JsonObject]) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for a in answers {
        if let Some(Value::Object(r)) = a.get("rewards") {
            for k in r.keys() {
                if !names.contains(k) {
                    names.push(k.clone());
                }
            }
        }
    }
    names
}

/// How many eval answers the report shows.
const SHOWN_EVAL_ANSWERS: usize = 5;

fn answer_row(a: &JsonObject, names: &[String]) -> AnswerRow {
    let text = |k: &str| match a.get(k) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Null) | None => String::new(),
        Some(v) => v.to_string(),
    };
    AnswerRow {
        prompt: truncate_middle(&text("prompt"), 150, 250),
        answer: truncate_middle(&text("answer"), 100, 50),
        rewards: names
            .iter()
            .map(|n| {
                let v = a
                    .get("rewards")
                    .and_then(|r| r.get(n))
                    .and_then(Value::as_f64);
                num(v.unwrap_or(f64::NAN))
            })
            .collect(),
        completion: truncate_middle(&text("completion"), 700, 300),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A synthetic run of `steps` steps with every metric the trainer logs, eval rows (one before
    /// training on a row of its own), nulls, completions and an eval file.
    fn synthetic_run(dir: &Path, steps: u64) {
        let mut metrics = String::new();
        metrics.push_str(
            "{\"step\":0,\"time\":1000.0,\"eval/accuracy\":0.1,\"eval/pass@1\":0.1,\"eval/pass@4\":0.25,\
             \"eval/pass@8\":0.3,\"eval/mean_accuracy\":0.12,\"eval/reward/answer_match\":0.1,\
             \"eval/reward/format\":0.05}\n",
        );
        for s in 1..=steps {
            let t = s as f64 / steps as f64;
            let mut o = serde_json::json!({
                "step": s, "time": 1000.0 + 12.0 * s as f64,
                "reward": 0.2 + 0.6 * t, "reward_std": 0.3 - 0.1 * t,
                "rewards/answer_match/mean": 0.1 + 0.7 * t, "rewards/answer_match/std": 0.3,
                "rewards/format/mean": 0.5 + 0.4 * t, "rewards/format/std": 0.2,
                "kl": 0.001 * s as f64, "loss": 0.01 - 0.005 * t, "pg_loss": 0.008 - 0.004 * t,
                "entropy": 1.2 - 0.5 * t,
                "completions/mean_length": 120.0 - 40.0 * t,
                "completions/min_length": 30.0, "completions/max_length": 256.0,
                "clip_ratio/low_mean": 0.001 * t, "clip_ratio/high_mean": 0.002 * t,
                "clip_ratio/region_mean": 0.003 * t, "grad_norm": 0.5 + t,
                "learning_rate": 1e-6 * (1.0 - t),
                "time/generate": 6.0, "time/score": 0.5, "time/reference": 1.5,
                "time/update": 3.0, "time/step": 11.5,
            });
            if s == 2 {
                // Non-finite values are written as null.
                o["kl"] = Value::Null;
                o["reward_std"] = Value::Null;
            }
            if s % 5 == 0 {
                for (k, v) in [
                    ("eval/accuracy", 0.1 + 0.5 * t),
                    ("eval/pass@1", 0.1 + 0.5 * t),
                    ("eval/pass@4", 0.25 + 0.5 * t),
                    ("eval/pass@8", 0.3 + 0.5 * t),
                    ("eval/mean_accuracy", 0.12 + 0.5 * t),
                    ("eval/reward/answer_match", 0.1 + 0.5 * t),
                    ("eval/reward/format", 0.05 + 0.8 * t),
                ] {
                    o[k] = v.into();
                }
            }
            metrics.push_str(&format!("{o}\n"));
        }
        std::fs::write(dir.join("metrics.jsonl"), metrics).unwrap();

        let mut comps = String::new();
        for s in 1..=steps {
            for i in 0..4 {
                let r = (s as f64 * 7.0 + i as f64 * 3.0) % 10.0 / 10.0;
                let o = serde_json::json!({
                    "step": s, "prompt": format!("What is {s} + {i}? Say <b>it</b> & stop"),
                    "completion": format!("<think>s{s} i{i}</think><answer>{}</answer>", s + i),
                    "stop_reason": "eos",
                    "rewards": {"answer_match": r, "format": if i == 3 { Value::Null } else { 1.0.into() }},
                    "reward": r, "advantage": r - 0.5,
                });
                comps.push_str(&format!("{o}\n"));
            }
        }
        // A completion with the best reward whose text needs escaping.
        comps.push_str(
            "{\"step\":3,\"prompt\":\"p\",\"completion\":\"BEST <script>alert(1)</script> & more\",\
             \"stop_reason\":\"eos\",\"rewards\":{\"answer_match\":1.0},\"reward\":5.0,\"advantage\":1.5}\n\
             {\"step\":3,\"prompt\":\"p\",\"completion\":\"WORST \\\"quoted\\\"\",\"stop_reason\":\"length\",\
             \"rewards\":{\"answer_match\":0.0},\"reward\":-5.0,\"advantage\":-1.5}\n\
             {\"step\":3,\"prompt\":\"p\",\"completion\":\"unscored\",\"stop_reason\":\"eos\",\
             \"rewards\":{\"answer_match\":null},\"reward\":null,\"advantage\":0.0}\n",
        );
        std::fs::write(dir.join("completions.jsonl"), comps).unwrap();

        std::fs::create_dir_all(dir.join("eval")).unwrap();
        std::fs::write(
            dir.join("eval/step-5.jsonl"),
            "{\"prompt\":\"2+2?\",\"answer\":4,\"completion\":\"<answer>4</answer>\",\
             \"rewards\":{\"answer_match\":1.0,\"format\":1.0}}\n\
             {\"prompt\":\"3+3?\",\"answer\":\"6\",\"completion\":\"seven\",\
             \"rewards\":{\"answer_match\":0.0,\"format\":null}}\n",
        )
        .unwrap();
        std::fs::write(
            dir.join("config.toml"),
            "learning_rate = 1e-6\nsystem_prompt = \"<think>\"\n",
        )
        .unwrap();
    }

    const ALL_PLOTS: [&str; 12] = [
        "reward.png",
        "rewards_per_function.png",
        "eval.png",
        "eval_rewards.png",
        "kl.png",
        "loss.png",
        "entropy.png",
        "length.png",
        "clip_ratio.png",
        "grad_norm.png",
        "learning_rate.png",
        "time.png",
    ];

    /// Decodes a plot and checks it is a full-size picture with more than one colour.
    fn check_png(path: &Path) {
        let bytes = std::fs::read(path).unwrap();
        assert!(
            bytes.starts_with(b"\x89PNG\r\n\x1a\n"),
            "{}",
            path.display()
        );
        assert!(
            bytes.len() > 8_000,
            "{} is {} bytes",
            path.display(),
            bytes.len()
        );
        let img = image::load_from_memory(&bytes).unwrap().to_rgb8();
        assert_eq!(img.dimensions(), (WIDTH, HEIGHT));
        let colours: BTreeSet<[u8; 3]> = img.pixels().map(|p| p.0).collect();
        assert!(
            colours.len() > 20,
            "{}: {} colours",
            path.display(),
            colours.len()
        );
    }

    #[test]
    fn report_writes_html_and_every_plot() {
        let dir = tempfile::tempdir().unwrap();
        synthetic_run(dir.path(), 30);
        let s = write_report(dir.path()).unwrap();
        assert_eq!(s.html, dir.path().join("report.html"));
        assert!(s.skipped.is_empty(), "{:?}", s.skipped);
        assert!(s.warnings.is_empty(), "{:?}", s.warnings);
        let names: Vec<String> = s
            .plots
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ALL_PLOTS);
        for p in &s.plots {
            assert_eq!(p.parent().unwrap(), dir.path().join("plots"));
            check_png(p);
        }
        let html = std::fs::read_to_string(&s.html).unwrap();
        assert_eq!(html.matches("src=\"data:image/png;base64,").count(), 12);
        // Best and worst completions, escaped.
        assert!(html.contains("BEST &lt;script&gt;alert(1)&lt;/script&gt; &amp; more"));
        assert!(!html.contains("<script>"));
        assert!(html.contains("WORST &quot;quoted&quot;"));
        assert!(html.contains("Say &lt;b&gt;it&lt;/b&gt; &amp; stop"));
        assert!(html.contains("Best 5 by reward") && html.contains("Worst 5 by reward"));
        // Summary: steps, last eval, times; config collapsed; eval answers.
        assert!(html.contains("30 (steps 1 to 30)"), "{html}");
        assert!(html.contains("eval/pass@8 (step 30)"));
        assert!(html.contains("training time (sum of time/step)</th><td class=\"n\">5m 45s"));
        assert!(html.contains("123 (1 without a reward)"));
        assert!(html.contains("<details><summary><code>config.toml</code>"));
        assert!(html.contains("system_prompt = &quot;&lt;think&gt;&quot;"));
        assert!(html.contains("step 5 (2 answers)"));
        assert!(html.contains("&lt;answer&gt;4&lt;/answer&gt;"));
    }

    #[test]
    fn a_fill_in_run_gets_its_fill_panel() {
        let dir = tempfile::tempdir().unwrap();
        let rows: Vec<String> = (1..=20)
            .map(|i| {
                let x = i as f64 / 20.0;
                serde_json::json!({"step": i, "reward": x, "fill/masked_positions": 3.0,
                                   "fill/accuracy": 0.5 + x / 3.0, "fill/judge_score": 0.6 + x / 4.0})
                .to_string()
            })
            .collect();
        std::fs::write(dir.path().join("metrics.jsonl"), rows.join("\n") + "\n").unwrap();
        let s = write_report(dir.path()).unwrap();
        let fill = dir.path().join("plots/fill.png");
        assert!(s.plots.contains(&fill), "{:?}", s.plots);
        check_png(&fill);
        let html = std::fs::read_to_string(&s.html).unwrap();
        assert!(html.contains("judge score and fill accuracy"));
    }

    #[test]
    fn completion_text_is_escaped() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("metrics.jsonl"),
            "{\"step\":1,\"reward\":1.0}\n",
        )
        .unwrap();
        let text = "<script>alert(\"x\")</script> & 'y'";
        let sample = serde_json::json!({
            "step": 1, "prompt": text, "completion": text, "stop_reason": text,
            "rewards": {text: 1.0}, "reward": 1.0, "advantage": 0.0,
        });
        std::fs::write(dir.path().join("completions.jsonl"), format!("{sample}\n")).unwrap();
        let answer = serde_json::json!({
            "prompt": text, "answer": text, "completion": text, "rewards": {text: 1.0},
        });
        std::fs::create_dir(dir.path().join("eval")).unwrap();
        std::fs::write(dir.path().join("eval/step-1.jsonl"), format!("{answer}\n")).unwrap();
        std::fs::write(
            dir.path().join("config.toml"),
            format!("system_prompt = {text:?}\n"),
        )
        .unwrap();

        let html = std::fs::read_to_string(write_report(dir.path()).unwrap().html).unwrap();
        assert!(
            !html.contains("<script") && !html.contains("\"x\""),
            "{html}"
        );
        let escaped = "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; &#x27;y&#x27;";
        // Samples: reward name, stop reason, prompt, completion. Eval: the reward name in both
        // tables, prompt, answer, completion.
        assert_eq!(html.matches(escaped).count(), 9, "{html}");
        assert!(html.contains(
            "system_prompt = &quot;&lt;script&gt;alert(\\&quot;x\\&quot;)&lt;/script&gt; &amp; &#x27;y&#x27;&quot;"
        ));
        // A `/` is left as it is (in text and in the base64 of the plots).
        assert!(!html.contains("&#x2f;"));
    }

    #[test]
    fn best_and_worst_do_not_overlap_in_a_small_run() {
        let mut s = Samples::default();
        for (i, r) in [0.1, 0.9, 0.5, f64::NAN, 0.3].into_iter().enumerate() {
            s.add(Sample {
                line: i + 1,
                step: Some(1),
                prompt: String::new(),
                completion: String::new(),
                stop_reason: String::new(),
                rewards: Vec::new(),
                reward: r,
                advantage: 0.0,
            });
        }
        s.finish();
        let best: Vec<f64> = s.best.iter().map(|x| x.reward).collect();
        assert_eq!(best, [0.9, 0.5, 0.3, 0.1]);
        assert!(s.worst.is_empty());
        assert_eq!((s.total, s.unscored), (5, 1));
    }

    #[test]
    fn a_missing_or_empty_metrics_file_names_it() {
        let dir = tempfile::tempdir().unwrap();
        let e = write_report(dir.path()).unwrap_err().to_string();
        assert!(
            e.contains("metrics.jsonl") && e.contains("not found"),
            "{e}"
        );
        std::fs::write(dir.path().join("metrics.jsonl"), "\n").unwrap();
        let e = write_report(dir.path()).unwrap_err().to_string();
        assert!(e.contains("metrics.jsonl") && e.contains("empty"), "{e}");
        std::fs::write(dir.path().join("metrics.jsonl"), "{\"reward\": 1}\n").unwrap();
        let e = write_report(dir.path()).unwrap_err().to_string();
        assert!(e.contains("metrics.jsonl") && e.contains("step"), "{e}");
    }

    #[test]
    fn one_step_run_with_a_truncated_last_line_reports_with_a_warning() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("metrics.jsonl"),
            "{\"step\":1,\"reward\":0.5,\"reward_std\":0.1,\"kl\":null,\"time/generate\":2.0}\n\
             {\"step\":2,\"rew",
        )
        .unwrap();
        let out = dir.path().join("out");
        let s = write_report_to(dir.path(), &out).unwrap();
        assert_eq!(s.html, out.join("report.html"));
        assert_eq!(s.warnings.len(), 1, "{:?}", s.warnings);
        assert!(
            s.warnings[0].contains("line 2 is truncated"),
            "{:?}",
            s.warnings
        );
        let names: Vec<String> = s
            .plots
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["reward.png", "time.png"]);
        for p in &s.plots {
            check_png(p);
        }
        // KL is only null: skipped, and the page says so.
        assert!(
            s.skipped.iter().any(|t| t.starts_with("KL")),
            "{:?}",
            s.skipped
        );
        let html = std::fs::read_to_string(&s.html).unwrap();
        assert!(html.contains("Not plotted, no data in <code>metrics.jsonl</code>"));
        assert!(html.contains("<code>kl</code>"));
        assert!(html.contains("line 2 is truncated"));
        assert!(html.contains("No <code>completions.jsonl</code>"));
        assert!(html.contains("No <code>config.toml</code>"));
    }

    #[test]
    fn a_later_report_removes_plots_that_lost_their_data() {
        let dir = tempfile::tempdir().unwrap();
        synthetic_run(dir.path(), 3);
        write_report(dir.path()).unwrap();
        assert!(dir.path().join("plots/kl.png").exists());
        std::fs::write(
            dir.path().join("metrics.jsonl"),
            "{\"step\":1,\"reward\":1}\n",
        )
        .unwrap();
        write_report(dir.path()).unwrap();
        assert!(!dir.path().join("plots/kl.png").exists());
        assert!(dir.path().join("plots/reward.png").exists());
    }

    #[test]
    fn a_null_breaks_the_line_and_an_absent_value_does_not() {
        let rows = [
            "{\"step\":1,\"kl\":0.1}",
            "{\"step\":2}",
            "{\"step\":3,\"kl\":0.3}",
            "{\"step\":4,\"kl\":null}",
            "{\"step\":5,\"kl\":0.5}",
        ];
        let m = Metrics {
            rows: rows
                .iter()
                .map(|r| Metrics::row(serde_json::from_str(r).unwrap()).unwrap())
                .collect(),
        };
        let s = Series::collect(&m, &Line::new("KL", "kl")).unwrap();
        let segs: Vec<Vec<f64>> = s
            .segments()
            .iter()
            .map(|seg| seg.iter().map(|p| p.x).collect())
            .collect();
        assert_eq!(segs, [vec![1.0, 3.0], vec![5.0]]);
    }

    #[test]
    fn pass_at_k_is_ordered_by_k() {
        let keys: BTreeSet<&str> = ["eval/pass@16", "eval/pass@4", "eval/pass@1", "eval/pass@x"]
            .into_iter()
            .collect();
        let ks: Vec<u64> = pass_at_k_keys(&keys).into_iter().map(|(k, _)| k).collect();
        assert_eq!(ks, [1, 4, 16]);
    }

    #[test]
    fn text_helpers() {
        assert_eq!(truncate_middle("short", 2, 2), "short");
        let long = "a".repeat(50) + &"b".repeat(50);
        assert_eq!(truncate_middle(&long, 3, 2), "aaa […95 characters…] bb");
        assert_eq!(axis_number(0.0, 1.0), "0");
        assert_eq!(axis_number(3.5e-18, 0.04), "0");
        assert_eq!(axis_number(0.25, 1.0), "0.25");
        assert_eq!(axis_number(-0.01, 0.04), "-0.01");
        assert_eq!(axis_number(12.5, 1.0), "12.5");
        assert_eq!(axis_number(2e-6, 1e-6), "2.0e-6");
        assert_eq!(duration(345.0), "5m 45s");
        assert_eq!(duration(3725.0), "1h 02m 05s");
        assert_eq!(num(f64::NAN), "–");
    }

    #[test]
    fn health_warnings_and_the_best_checkpoint_are_shown() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("metrics.jsonl"),
            "{\"step\":1,\"reward\":1.0}\n{\"step\":2,\"reward\":1.0,\"health/low_entropy\":1.0}\n",
        )
        .unwrap();
        let row = serde_json::json!({"step": 2, "kind": "low_entropy", "message": "entropy 0.010 is below 0.05"});
        std::fs::write(dir.path().join("health.jsonl"), format!("{row}\n")).unwrap();
        for step in [1, 2] {
            let ckpt = dir.path().join(format!("checkpoint-{step}"));
            std::fs::create_dir(&ckpt).unwrap();
            let best = dir.path().join("checkpoint-1").display().to_string();
            let st = serde_json::json!({"step": step, "best_model_checkpoint": best});
            std::fs::write(ckpt.join("trainer_state.json"), st.to_string()).unwrap();
        }
        let html = std::fs::read_to_string(write_report(dir.path()).unwrap().html).unwrap();
        assert!(html.contains("<h2>Health warnings</h2>"), "{html}");
        assert!(
            html.contains("step 2: entropy 0.010 is below 0.05"),
            "{html}"
        );
        assert!(
            html.contains("<tr><th>best checkpoint</th><td class=\"n\">checkpoint-1</td></tr>"),
            "{html}"
        );
    }
}
