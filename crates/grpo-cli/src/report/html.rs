//! The report's page: plain serializable views of the run (`PageView`), rendered by the
//! minijinja template `report.html.j2` with HTML auto-escaping.

use std::path::Path;

use base64::Engine as _;
use minijinja::{AutoEscape, Environment, HtmlEscape, Output, State, UndefinedBehavior};
use serde::Serialize;
use serde_json::Value;

use grpo::train::names;

use super::agent::{self, AgentRow, EpisodeView};
use super::plots::Plot;
use super::{
    json_lines, mean, num, truncate_middle, EvalFile, JsonObject, Metrics, Sample, Samples,
};

/// The page, rendered by minijinja; the name ends in `.html`, so every value is HTML-escaped.
const TEMPLATE_NAME: &str = "report.html";
const TEMPLATE: &str = include_str!("../report.html.j2");

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

pub(super) fn duration(secs: f64) -> String {
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

/// One health warning the trainer wrote (`health.jsonl`).
#[derive(Serialize)]
pub(super) struct HealthRow {
    step: u64,
    message: String,
}

/// The trainer's health warnings, in order (none when the file is missing or unreadable).
pub(super) fn read_health(path: &Path) -> Vec<HealthRow> {
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
pub(super) struct Page<'a> {
    pub(super) run_dir: &'a Path,
    pub(super) metrics: &'a Metrics,
    pub(super) samples: &'a Samples,
    pub(super) evals: &'a [EvalFile],
    pub(super) config: Option<&'a str>,
    pub(super) plots: &'a [Plot],
    pub(super) warnings: &'a [String],
    pub(super) health: &'a [HealthRow],
    /// The best checkpoint the run recorded (`metric_for_best_model`).
    pub(super) best: Option<&'a Path>,
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
    /// The agent section (`agent/*` metrics), when the run has one.
    agent: Option<AgentView>,
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
    /// The completions are agent episodes: shown turn by turn.
    agent: bool,
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
    /// In an agent run: the prompt and the episode turn by turn.
    episode: Option<EpisodeView>,
}

/// The agent curves and their first and last values.
#[derive(Serialize)]
struct AgentView {
    figures: Vec<Figure>,
    /// How many logged steps the first and last means cover.
    window: usize,
    rows: Vec<AgentRow>,
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
    pub(super) fn html(&self) -> std::result::Result<String, minijinja::Error> {
        let name = self.run_dir.file_name().map_or_else(
            || self.run_dir.display().to_string(),
            |n| n.to_string_lossy().into(),
        );
        let (figures, agent_figures, not_plotted) = self.plots();
        let agent = agent::is_agent_run(&self.metrics.keys()).then(|| {
            let (window, rows) = agent::summary(self.metrics);
            AgentView {
                figures: agent_figures,
                window,
                rows,
            }
        });
        render_page(&PageView {
            name,
            run_dir: self.run_dir.display().to_string(),
            warnings: self.warnings,
            health: self.health,
            summary: self.summary(),
            figures,
            not_plotted,
            agent,
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

    /// The plots drawn (the main ones, then the agent section's), and those left out for want of
    /// data.
    fn plots(&self) -> (Vec<Figure>, Vec<Figure>, Vec<NotPlotted<'_>>) {
        let b64 = base64::engine::general_purpose::STANDARD;
        let (mut figures, mut agent_figures) = (Vec::new(), Vec::new());
        let mut missing = Vec::new();
        for p in self.plots {
            let shown_in = if p.agent {
                &mut agent_figures
            } else {
                &mut figures
            };
            match &p.png {
                Some((path, png)) => shown_in.push(Figure {
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
        (figures, agent_figures, missing)
    }

    fn samples(&self) -> SamplesView {
        let s = self.samples;
        let rows = |rows: &[Sample]| {
            rows.iter()
                .map(|r| sample_row(r, &s.reward_names, s.agent))
                .collect()
        };
        SamplesView {
            found: s.found,
            agent: s.agent,
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
                    .filter_map(|a| shown_completion(a).get("rewards")?.get(n)?.as_f64())
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

fn sample_row(s: &Sample, names: &[String], agent: bool) -> SampleRow {
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
        episode: agent.then(|| agent::episode_view(s)),
    }
}

/// The completion an eval row shows: its greedy one, else its first sample (`grpo::eval`'s rows:
/// `{"prompt", "answer", "completions": [{"text", "rewards", ...}], "greedy": {...} or null}`),
/// else the row itself (a row with its own `completion` and `rewards`).
fn shown_completion(a: &JsonObject) -> &JsonObject {
    a.get("greedy")
        .and_then(Value::as_object)
        .or_else(|| a.get("completions")?.get(0)?.as_object())
        .unwrap_or(a)
}

/// Reward names of eval answers, in first-seen order.
fn eval_reward_names(answers: &[JsonObject]) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for a in answers {
        if let Some(Value::Object(r)) = shown_completion(a).get("rewards") {
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
    let text_of = |o: &JsonObject, k: &str| match o.get(k) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Null) | None => String::new(),
        Some(v) => v.to_string(),
    };
    let text = |k: &str| text_of(a, k);
    let shown = shown_completion(a);
    let completion = match shown.get("text") {
        Some(_) => text_of(shown, "text"),
        None => text_of(shown, "completion"),
    };
    AnswerRow {
        prompt: truncate_middle(&text("prompt"), 150, 250),
        answer: truncate_middle(&text("answer"), 100, 50),
        rewards: names
            .iter()
            .map(|n| {
                let v = shown
                    .get("rewards")
                    .and_then(|r| r.get(n))
                    .and_then(Value::as_f64);
                num(v.unwrap_or(f64::NAN))
            })
            .collect(),
        completion: truncate_middle(&completion, 700, 300),
    }
}
