//! The report's plots: one PNG per [`PlotSpec`], drawn with `plotters` on a bitmap, text through
//! the embedded font (see the parent module).

use std::collections::BTreeSet;
use std::fmt::Display;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use grpo::train::names::{self, TIME_PARTS};
use grpo::{Error, Result};

use super::Metrics;

pub(super) const WIDTH: u32 = 960;
pub(super) const HEIGHT: u32 = 540;
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
pub(super) fn register_font(plots_dir: &Path) -> Result<()> {
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
pub(super) enum Band {
    None,
    /// mean ± the metric with this key.
    Std(String),
    /// Between two metrics (min and max).
    Range(String, String),
}

/// One line of a plot: a metric, its legend label, and an optional band.
#[derive(Clone)]
pub(super) struct Line {
    label: String,
    pub(super) key: String,
    band: Band,
    /// Dashed, so that a solid line it coincides with stays visible (accuracy is pass@1).
    dashed: bool,
    /// A row that has this metric but not the line's counts as 0 (a count logged only when it
    /// is not 0, such as `agent/tool_errors/<kind>`).
    zero_beside: Option<String>,
}

impl Line {
    pub(super) fn new(label: impl Into<String>, key: impl Into<String>) -> Self {
        Self {
            label: label.into(),
            key: key.into(),
            band: Band::None,
            dashed: false,
            zero_beside: None,
        }
    }
    pub(super) fn dashed(mut self) -> Self {
        self.dashed = true;
        self
    }
    fn band(mut self, band: Band) -> Self {
        self.band = band;
        self
    }
    /// 0 in the rows that have `key` and not the line's metric.
    pub(super) fn zero_beside(mut self, key: &str) -> Self {
        self.zero_beside = Some(key.to_string());
        self
    }
}

pub(super) enum Kind {
    Lines(Vec<Line>),
    /// Stacked bars of the `time/` parts of a step.
    TimeSplit,
}

/// One PNG of the report.
pub(super) struct PlotSpec {
    pub(super) file: &'static str,
    pub(super) title: String,
    pub(super) y_desc: &'static str,
    pub(super) kind: Kind,
    /// Fix the y axis to [0, 1] when every value lies in it (accuracies).
    pub(super) unit_range: bool,
    /// In the page's agent section (`agent/*` curves), not among the main plots.
    pub(super) agent: bool,
}

/// A plot as the page shows it: the PNG (path and bytes), or the metrics it lacked.
pub(super) struct Plot {
    pub(super) title: String,
    pub(super) png: Option<(PathBuf, Vec<u8>)>,
    pub(super) wanted: Vec<String>,
    pub(super) agent: bool,
}

/// The metric keys drawn per reward function: `rewards/<name>/mean`.
fn reward_names(keys: &BTreeSet<&str>) -> Vec<String> {
    keys.iter()
        .filter_map(|k| k.strip_prefix("rewards/")?.strip_suffix("/mean"))
        .map(str::to_string)
        .collect()
}

/// `eval/pass@k` keys, by k.
pub(super) fn pass_at_k_keys(keys: &BTreeSet<&str>) -> Vec<(u64, String)> {
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

pub(super) fn line_plot(
    file: &'static str,
    title: &str,
    y_desc: &'static str,
    lines: Vec<Line>,
) -> PlotSpec {
    PlotSpec {
        file,
        title: title.to_string(),
        y_desc,
        kind: Kind::Lines(lines),
        unit_range: false,
        agent: false,
    }
}

/// Every plot of the report, in page order.
pub(super) fn plot_specs(m: &Metrics) -> Vec<PlotSpec> {
    let keys = m.keys();
    let mut specs = reward_specs(&keys);
    specs.extend(eval_specs(&keys));
    specs.extend(training_specs());
    // A fill-in run's own curves (the judge's score, fills equal to the original).
    if keys.contains(grpo::fill_in::FILL_MASKED_POSITIONS) {
        specs.insert(2, fill_in_spec());
    }
    specs
}

/// The rewards: their sum, and each function's.
fn reward_specs(keys: &BTreeSet<&str>) -> Vec<PlotSpec> {
    let per_reward = reward_names(keys)
        .into_iter()
        .map(|n| {
            let band = Band::Std(names::reward_std(&n));
            Line::new(n.clone(), names::reward_mean(&n)).band(band)
        })
        .collect();
    vec![
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
    ]
}

/// Evaluation: pass@k and the accuracies, and each reward's mean.
fn eval_specs(keys: &BTreeSet<&str>) -> Vec<PlotSpec> {
    let mut eval: Vec<Line> = pass_at_k_keys(keys)
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
    vec![
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
    ]
}

/// The training curves: KL, loss, entropy, length, clipping, gradient norm, learning rate, time.
fn training_specs() -> Vec<PlotSpec> {
    vec![
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
            agent: false,
        },
    ]
}

/// A fill-in run's curves: the judge's score and the fills equal to the original.
fn fill_in_spec() -> PlotSpec {
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
    }
}

impl PlotSpec {
    pub(super) fn render(&self, m: &Metrics, dir: &Path) -> Result<Plot> {
        let path = dir.join(self.file);
        let wanted: Vec<String> = match &self.kind {
            Kind::Lines(lines) => lines.iter().map(|l| l.key.clone()).collect(),
            Kind::TimeSplit => TIME_PARTS.iter().map(|p| format!("time/{p}")).collect(),
        };
        let mut plot = Plot {
            title: self.title.clone(),
            png: None,
            wanted,
            agent: self.agent,
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
pub(super) fn axis_number(v: f64, span: f64) -> String {
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
pub(super) struct Point {
    pub(super) x: f64,
    pub(super) y: f64,
    pub(super) band: Option<(f64, f64)>,
    /// A logged null (non-finite value) comes before this point: the line breaks there. A step
    /// without the metric at all (evaluation runs every few steps) does not break it.
    pub(super) gap_before: bool,
}

/// The data of one line.
pub(super) struct Series {
    pub(super) label: String,
    pub(super) points: Vec<Point>,
    pub(super) dashed: bool,
}

/// Lines with at most this many points get a marker on every point (evaluations are sparse).
const MARKERS_UP_TO: usize = 40;

impl Series {
    /// The line's finite points, or None when it has none.
    pub(super) fn collect(m: &Metrics, line: &Line) -> Option<Self> {
        let mut points = Vec::new();
        let mut gap = false;
        for r in &m.rows {
            let zero = line
                .zero_beside
                .as_ref()
                .filter(|k| r.values.contains_key(*k));
            let Some(y) = r.values.get(&line.key).copied().or(zero.map(|_| 0.0)) else {
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
    pub(super) fn segments(&self) -> Vec<&[Point]> {
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
