//! Rule rewards: pure functions of the completion text (and its group, prompt, answer).
//!
//! - [`AnswerMatch`]: extract an answer (last number, `\boxed{}`, `#### x`, `Answer:`,
//!   `<answer>` tags) and compare it with the reference, numerically with a tolerance or as
//!   normalized strings;
//! - [`Format`]: a regular expression (Python syntax, lookarounds included) and/or required tags;
//! - [`Length`]: DAPO's soft overlong penalty, or distance to a target length;
//! - [`repetition_penalty`]: the share of repeated n-grams, scaled to a maximum penalty;
//! - [`group_diversity`]: the share of a completion's n-grams no other completion of its group has.

use std::collections::{HashMap, HashSet};

use super::table::Table;
use crate::Result;

/// Where the answer is looked for in a completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Extract {
    /// The last number in the text.
    LastNumber,
    /// The content of the last `\boxed{...}` (nested braces allowed).
    Boxed,
    /// What follows the last `####` (GSM8K's marker), to the end of its line.
    Hashes,
    /// What follows the last `Answer:` (any case), to the end of its line.
    AnswerPrefix,
    /// The content of the last `<answer>...</answer>`.
    AnswerTag,
    /// The first of answer tag, boxed, `####`, `Answer:` that is present; else the last number.
    Auto,
    /// The reference answer appears anywhere as a standalone integer (the peer benchmark's rule).
    Contains,
}

pub const EXTRACT_CHOICES: &[(&str, Extract)] = &[
    ("auto", Extract::Auto),
    ("last_number", Extract::LastNumber),
    ("boxed", Extract::Boxed),
    ("hashes", Extract::Hashes),
    ("answer_prefix", Extract::AnswerPrefix),
    ("answer_tag", Extract::AnswerTag),
    ("contains", Extract::Contains),
];

/// `kind = "answer_match"`: 1 when the extracted answer equals the reference, else 0; NaN when the
/// example has no reference answer.
#[derive(Debug, Clone, PartialEq)]
pub struct AnswerMatch {
    pub extract: Extract,
    /// Numbers match when `|got - want| <= abs_tol + rel_tol * |want|`.
    pub abs_tol: f64,
    pub rel_tol: f64,
    /// String comparison ignores case.
    pub ignore_case: bool,
    /// Read the answer only after the last occurrence of this delimiter (e.g. `</think>`); a
    /// completion without it scores 0 (TRL's `reasoning_accuracy_reward`).
    pub after: Option<String>,
}

impl AnswerMatch {
    pub fn new(extract: Extract) -> Self {
        AnswerMatch {
            extract,
            abs_tol: 1e-6,
            rel_tol: 1e-9,
            ignore_case: true,
            after: None,
        }
    }

    pub const KEYS: &'static [&'static str] = &[
        "extract",
        "mode",
        "tolerance",
        "rel_tolerance",
        "ignore_case",
        "after",
    ];

    pub fn from_table(t: &Table) -> Result<Self> {
        // `mode` is the first release's name for `extract`.
        let key = if t.has("mode") { "mode" } else { "extract" };
        let extract = t.choice(key, Extract::LastNumber, EXTRACT_CHOICES)?;
        let d = AnswerMatch::new(extract);
        let m = AnswerMatch {
            extract,
            abs_tol: t.f64("tolerance", d.abs_tol)?,
            rel_tol: t.f64("rel_tolerance", d.rel_tol)?,
            ignore_case: t.bool("ignore_case", true)?,
            after: t.opt_str("after")?.map(str::to_string),
        };
        if m.after.as_deref() == Some("") {
            return Err(t.err("after", "must not be empty (e.g. \"</think>\")"));
        }
        if m.abs_tol < 0.0 || m.rel_tol < 0.0 {
            return Err(t.err("tolerance", "must be >= 0"));
        }
        Ok(m)
    }

    pub fn score(&self, completion: &str, answer: Option<&str>) -> f32 {
        let Some(want) = answer else {
            return f32::NAN;
        };
        let completion = match &self.after {
            None => completion,
            Some(d) => match completion.rfind(d.as_str()) {
                Some(i) => &completion[i + d.len()..],
                None => return 0.0,
            },
        };
        if self.extract == Extract::Contains {
            let want = want.trim();
            return f32::from(u8::from(
                standalone_integers(completion).iter().any(|n| n == want),
            ));
        }
        match extract_answer(completion, self.extract) {
            Some(got) => f32::from(u8::from(self.equal(&got, want))),
            None => 0.0,
        }
    }

    /// Whether an extracted answer equals the reference: as numbers when both read as one number
    /// (fractions and `\frac{a}{b}` included), else as normalized strings.
    pub fn equal(&self, got: &str, want: &str) -> bool {
        if let (Some(g), Some(w)) = (as_number(got), as_number(want)) {
            return (g - w).abs() <= self.abs_tol + self.rel_tol * w.abs();
        }
        let (g, w) = (normalize(got), normalize(want));
        if self.ignore_case {
            g.to_lowercase() == w.to_lowercase()
        } else {
            g == w
        }
    }
}

/// The answer text `how` finds in `text` (None when it finds none).
pub fn extract_answer(text: &str, how: Extract) -> Option<String> {
    match how {
        Extract::LastNumber | Extract::Contains => {
            last_number_span(text).map(|(a, b)| text[a..b].to_string())
        }
        Extract::Boxed => last_boxed(text),
        Extract::Hashes => after_last(text, "####"),
        Extract::AnswerPrefix => after_last_ci(text, "answer:"),
        Extract::AnswerTag => last_tag(text, "answer"),
        Extract::Auto => last_tag(text, "answer")
            .or_else(|| last_boxed(text))
            .or_else(|| after_last(text, "####"))
            .or_else(|| after_last_ci(text, "answer:"))
            .or_else(|| extract_answer(text, Extract::LastNumber)),
    }
}

fn rest_of_line(s: &str) -> Option<String> {
    let line = s.lines().next().unwrap_or("").trim();
    (!line.is_empty()).then(|| line.to_string())
}

fn after_last(text: &str, marker: &str) -> Option<String> {
    text.rfind(marker)
        .and_then(|i| rest_of_line(&text[i + marker.len()..]))
}

/// Like [`after_last`], ignoring ASCII case (byte offsets agree: lowercasing ASCII keeps lengths).
fn after_last_ci(text: &str, marker: &str) -> Option<String> {
    let lower = text.to_ascii_lowercase();
    lower
        .rfind(marker)
        .and_then(|i| rest_of_line(&text[i + marker.len()..]))
}

fn last_tag(text: &str, tag: &str) -> Option<String> {
    let (open, close) = (format!("<{tag}>"), format!("</{tag}>"));
    let start = text.rfind(&open)? + open.len();
    let end = text[start..].find(&close)? + start;
    let inner = text[start..end].trim();
    (!inner.is_empty()).then(|| inner.to_string())
}

/// The content of the last `\boxed{...}` or `\fbox{...}`, with nested braces.
fn last_boxed(text: &str) -> Option<String> {
    let i = text.rfind("\\boxed").or_else(|| text.rfind("\\fbox"))?;
    let rest = &text[i..];
    let open = rest.find('{')?;
    let mut depth = 0usize;
    for (j, c) in rest[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    let inner = rest[open + 1..open + j].trim();
                    return (!inner.is_empty()).then(|| inner.to_string());
                }
            }
            _ => {}
        }
    }
    None
}

/// Byte span of the last number: optional `-`, digits with `,` thousands separators, decimals.
fn last_number_span(text: &str) -> Option<(usize, usize)> {
    let b = text.as_bytes();
    let mut best = None;
    let mut i = 0;
    while i < b.len() {
        if b[i].is_ascii_digit() && (i == 0 || !b[i - 1].is_ascii_alphabetic()) {
            let mut start = i;
            if i > 0 && b[i - 1] == b'-' && (i < 2 || !b[i - 2].is_ascii_alphanumeric()) {
                start = i - 1;
            }
            let mut k = i;
            while k < b.len()
                && (b[k].is_ascii_digit()
                    || (b[k] == b',' && k + 1 < b.len() && b[k + 1].is_ascii_digit()))
            {
                k += 1;
            }
            if k + 1 < b.len() && b[k] == b'.' && b[k + 1].is_ascii_digit() {
                k += 1;
                while k < b.len() && b[k].is_ascii_digit() {
                    k += 1;
                }
            }
            best = Some((start, k));
            i = k;
        } else {
            i += 1;
        }
    }
    best
}

/// The value of a text that is one number: `1,234`, `-5`, `12.50`, `$3`, `45%`, `3/4`,
/// `\frac{3}{4}`, `\dfrac34`, with surrounding spaces, `$`s and a final period ignored.
pub fn as_number(s: &str) -> Option<f64> {
    let t = normalize(s);
    let t = t.trim_end_matches('%').trim();
    let t = t.strip_prefix('$').unwrap_or(t).trim();
    let plain = |x: &str| -> Option<f64> {
        let x = x.trim().replace(',', "");
        if x.is_empty() || x.contains(|c: char| !(c.is_ascii_digit() || ".-+".contains(c))) {
            return None;
        }
        x.parse::<f64>().ok().filter(|v| v.is_finite())
    };
    if let Some(v) = plain(t) {
        return Some(v);
    }
    let frac = t
        .strip_prefix("\\dfrac")
        .or_else(|| t.strip_prefix("\\tfrac"))
        .or_else(|| t.strip_prefix("\\frac"));
    let (neg, frac) = match t.strip_prefix("-\\frac").or(t.strip_prefix("-\\dfrac")) {
        Some(f) => (true, Some(f)),
        None => (false, frac),
    };
    if let Some(f) = frac {
        let (a, rest) = brace_or_char(f)?;
        let (b, rest) = brace_or_char(rest)?;
        if !rest.trim().is_empty() {
            return None;
        }
        let v = plain(&a)? / plain(&b)?;
        return v.is_finite().then_some(if neg { -v } else { v });
    }
    let (a, b) = t.split_once('/')?;
    let v = plain(a)? / plain(b)?;
    v.is_finite().then_some(v)
}

/// `{xy}rest` -> ("xy", "rest"); `xrest` -> ("x", "rest").
fn brace_or_char(s: &str) -> Option<(String, &str)> {
    let s = s.trim_start();
    if let Some(r) = s.strip_prefix('{') {
        let end = r.find('}')?;
        Some((r[..end].to_string(), &r[end + 1..]))
    } else {
        let c = s.chars().next()?;
        Some((c.to_string(), &s[c.len_utf8()..]))
    }
}

/// Trims spaces, surrounding `$`/`$$`, `\text{...}` wrappers, a final period, and collapses runs
/// of whitespace.
pub fn normalize(s: &str) -> String {
    let mut t = s.trim();
    while let Some(inner) = t.strip_prefix('$').and_then(|x| x.strip_suffix('$')) {
        t = inner.trim();
    }
    let mut t = t.trim_end_matches('.').trim().to_string();
    for wrapper in ["\\text{", "\\textbf{", "\\mathrm{"] {
        if let Some(inner) = t.strip_prefix(wrapper).and_then(|x| x.strip_suffix('}')) {
            t = inner.trim().to_string();
        }
    }
    t.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Integers as Python's `re.findall(r"(?<![\d.])-?\d+(?![\d])", text.replace(",", ""))` finds them.
pub fn standalone_integers(text: &str) -> Vec<String> {
    let c: Vec<char> = text.chars().filter(|&ch| ch != ',').collect();
    let mut out = vec![];
    let mut i = 0;
    while i < c.len() {
        let prev_ok = i == 0 || !(c[i - 1].is_ascii_digit() || c[i - 1] == '.');
        let mut j = i;
        if c[j] == '-' {
            j += 1;
        }
        if prev_ok && j < c.len() && c[j].is_ascii_digit() {
            let mut k = j;
            while k < c.len() && c[k].is_ascii_digit() {
                k += 1;
            }
            out.push(c[i..k].iter().collect());
            i = k;
        } else {
            i += 1;
        }
    }
    out
}

/// Python's `re.match(r"^\s*-?\d+\s*\.?\s*$", text)`.
pub fn is_integer_only(text: &str) -> bool {
    let t = text.trim();
    let t = t.strip_suffix('.').map_or(t, str::trim_end);
    let t = t.strip_prefix('-').unwrap_or(t);
    !t.is_empty() && t.chars().all(|c| c.is_ascii_digit())
}

/// [`is_integer_only`], or one equation whose right side is the integer and whose left side
/// holds only numbers and arithmetic ("34 + 30 = 64", "= 64", "(3 * 4) - 2 = 10."), with
/// nothing else around it, on one line: the answer, shown worked or not, and no words.
pub fn is_integer_or_equation(text: &str) -> bool {
    if is_integer_only(text) {
        return true;
    }
    let Some((lhs, rhs)) = text.rsplit_once('=') else {
        return false;
    };
    let arithmetic = |c: char| c.is_ascii_digit() || c.is_whitespace() || "+-*/x×÷().,".contains(c);
    is_integer_only(rhs) && lhs.chars().all(arithmetic) && !text.trim().contains('\n')
}

/// How much of a completion its last number is: 1 for a bare integer ([`is_integer_only`]),
/// else the number's characters over the trimmed completion's ("34 + 30 = 64": 2 of 12), 0
/// without a number. `integer_only` with `graded = true` pays this share of its value, so that
/// every correct answer earns a little and the shortest earn most: a format reward that acts
/// before any completion is bare.
pub fn answer_share(text: &str) -> f32 {
    if is_integer_only(text) {
        return 1.0;
    }
    let t = text.trim();
    match last_number_span(t) {
        Some((a, b)) => {
            let number = t[a..b].chars().count() as f32;
            (number / t.chars().count().max(1) as f32).min(1.0)
        }
        None => 0.0,
    }
}

/// `kind = "format"`: `value` when the completion matches `pattern` (searched, Python syntax;
/// write `^...$` for a whole match; `.` matches newlines unless `dotall = false`) and contains
/// every `required_tags` pair `<t>...</t>` in the given order. With `partial = true` and tags,
/// the share of tags present is paid instead of all or nothing.
#[derive(Debug, Clone)]
pub struct Format {
    pub pattern: Option<fancy_regex::Regex>,
    pub tags: Vec<String>,
    pub partial: bool,
    pub value: f32,
}

impl Format {
    pub const KEYS: &'static [&'static str] =
        &["pattern", "required_tags", "dotall", "partial", "value"];

    pub fn from_table(t: &Table) -> Result<Self> {
        let dotall = t.bool("dotall", true)?;
        let pattern = t
            .opt_str("pattern")?
            .map(|p| {
                let src = if dotall {
                    format!("(?s){p}")
                } else {
                    p.to_string()
                };
                fancy_regex::Regex::new(&src)
                    .map_err(|e| t.err("pattern", format!("not a valid regular expression: {e}")))
            })
            .transpose()?;
        // An absent key means none (documented); none with no pattern is refused below.
        let tags = t.opt_strs("required_tags")?.unwrap_or_default();
        if pattern.is_none() && tags.is_empty() {
            return Err(t.err(
                "pattern",
                "a format reward needs `pattern` (a regular expression) or `required_tags`",
            ));
        }
        if let Some(bad) = tags
            .iter()
            .find(|s| s.is_empty() || s.contains(['<', '>', '/']))
        {
            return Err(t.err(
                "required_tags",
                format!("`{bad}`: give tag names without brackets, e.g. [\"think\", \"answer\"]"),
            ));
        }
        Ok(Format {
            pattern,
            tags,
            partial: t.bool("partial", false)?,
            value: t.f32("value", 1.0)?,
        })
    }

    pub fn score(&self, completion: &str) -> f32 {
        let pattern_ok = self
            .pattern
            .as_ref()
            .is_none_or(|re| re.is_match(completion).unwrap_or(false));
        if self.tags.is_empty() {
            return if pattern_ok { self.value } else { 0.0 };
        }
        // Tags in order: each <t>...</t> pair must start after the previous one ended.
        let mut pos = 0;
        let mut found = 0usize;
        for tag in &self.tags {
            let (open, close) = (format!("<{tag}>"), format!("</{tag}>"));
            let Some(o) = completion[pos..].find(&open).map(|i| i + pos) else {
                break;
            };
            let Some(c) = completion[o + open.len()..]
                .find(&close)
                .map(|i| i + o + open.len())
            else {
                break;
            };
            found += 1;
            pos = c + close.len();
        }
        if !pattern_ok {
            0.0
        } else if found == self.tags.len() {
            self.value
        } else if self.partial {
            self.value * found as f32 / self.tags.len() as f32
        } else {
            0.0
        }
    }
}

/// Equal options: the same pattern text (regexes compare by source), tags, partial and value.
impl PartialEq for Format {
    fn eq(&self, other: &Self) -> bool {
        self.pattern.as_ref().map(fancy_regex::Regex::as_str)
            == other.pattern.as_ref().map(fancy_regex::Regex::as_str)
            && self.tags == other.tags
            && self.partial == other.partial
            && self.value == other.value
    }
}

/// `kind = "length"`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Length {
    /// DAPO's soft overlong punishment over `max_length` tokens with a `cache` buffer: 0 up to
    /// `max_length - cache`, falling linearly to -1 at `max_length`, -1 beyond.
    Overlong { max_length: usize, cache: usize },
    /// `-|len - target| / target`: 0 at the target length.
    Target { target: usize },
}

impl Length {
    pub const KEYS: &'static [&'static str] = &["mode", "max_length", "cache_length", "target"];

    /// `max_completion_length` is the default `max_length`.
    pub fn from_table(t: &Table, max_completion_length: usize) -> Result<Self> {
        #[derive(Clone, Copy)]
        enum M {
            Overlong,
            Target,
        }
        let m = t.choice(
            "mode",
            M::Overlong,
            &[("overlong", M::Overlong), ("target", M::Target)],
        )?;
        match m {
            M::Overlong => {
                let max_length = t.usize("max_length", max_completion_length)?;
                let cache = t.usize("cache_length", max_length / 4)?;
                if cache == 0 || cache > max_length {
                    return Err(t.err(
                        "cache_length",
                        format!(
                            "must be in 1..={max_length} (max_length); DAPO uses max_length / 4"
                        ),
                    ));
                }
                Ok(Length::Overlong { max_length, cache })
            }
            M::Target => {
                let target = t
                    .opt_usize("target")?
                    .ok_or_else(|| t.err("target", "missing: the target length in tokens"))?;
                if target == 0 {
                    return Err(t.err("target", "must be > 0"));
                }
                Ok(Length::Target { target })
            }
        }
    }

    pub fn score(&self, tokens: usize) -> f32 {
        match *self {
            Length::Overlong { max_length, cache } => {
                let free = max_length - cache;
                if tokens <= free {
                    0.0
                } else if tokens <= max_length {
                    (free as f32 - tokens as f32) / cache as f32
                } else {
                    -1.0
                }
            }
            Length::Target { target } => -(tokens as f32 - target as f32).abs() / target as f32,
        }
    }
}

/// Lowercased words' n-grams.
fn ngrams(text: &str, n: usize) -> Vec<Vec<String>> {
    let words: Vec<String> = text.split_whitespace().map(str::to_lowercase).collect();
    if words.len() < n {
        return vec![];
    }
    words.windows(n).map(<[String]>::to_vec).collect()
}

/// `kind = "repetition"`: `max_penalty * (1 - distinct n-grams / n-grams)` over lowercased
/// words; 0 for a completion shorter than `n` words. `max_penalty` is negative.
/// `kind = "equation"`: 1 when the whole text (spaces ignored) is a true equation of integers
/// `a op b = c` with op one of `+ - * /` (exact integer division), else 0. The verifier of the
/// built-in fill-in task: it checks a filled line without knowing the original.
pub fn equation_holds(text: &str) -> f32 {
    let t: String = text.chars().filter(|c| !c.is_whitespace()).collect();
    let Some((lhs, rhs)) = t.split_once('=') else {
        return 0.0;
    };
    let int = |s: &str| -> Option<i64> {
        let digits = s.strip_prefix('-').unwrap_or(s);
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) || digits.len() > 15 {
            return None;
        }
        s.parse().ok()
    };
    // The operator: the first + - * / after the first character (a leading '-' is a sign).
    let Some((i, op)) = lhs
        .char_indices()
        .skip(1)
        .find(|(_, c)| "+-*/".contains(*c))
    else {
        return 0.0;
    };
    let (Some(a), Some(b), Some(c)) = (int(&lhs[..i]), int(&lhs[i + 1..]), int(rhs)) else {
        return 0.0;
    };
    let value = match op {
        '+' => a.checked_add(b),
        '-' => a.checked_sub(b),
        '*' => a.checked_mul(b),
        _ => (b != 0 && a % b == 0).then(|| a / b),
    };
    f32::from(u8::from(value == Some(c)))
}

/// `kind = "sides_match"`: 1 when the text has exactly one `=` and the two sides are equal and
/// not empty, else 0. The verifier of the built-in fill-in task (copies `w=w`).
pub fn sides_match(text: &str) -> f32 {
    match text.split_once('=') {
        Some((a, b)) if !a.is_empty() && a == b => 1.0,
        _ => 0.0,
    }
}

/// `kind = "think_format"`: 1 when the text opens with `<think>`, has no second `<think>`, and
/// closes the reasoning with `</think>` (TRL's `think_format_reward`), else 0.
pub fn think_format(text: &str) -> f32 {
    let ok = text
        .strip_prefix("<think>")
        .is_some_and(|rest| !rest.contains("<think>") && rest.contains("</think>"));
    f32::from(u8::from(ok))
}

pub fn repetition_penalty(text: &str, n: usize, max_penalty: f32) -> f32 {
    let grams = ngrams(text, n);
    if grams.is_empty() {
        return 0.0;
    }
    let distinct: HashSet<&Vec<String>> = grams.iter().collect();
    max_penalty * (1.0 - distinct.len() as f32 / grams.len() as f32)
}

/// `kind = "diversity"`: for each completion, the share of its distinct n-grams that no other
/// completion of the same group contains (1: nothing in common; 0: all shared, or empty).
/// `groups[i]` is completion i's group.
pub fn group_diversity(texts: &[&str], groups: &[usize], n: usize) -> Vec<f32> {
    let sets: Vec<HashSet<Vec<String>>> = texts
        .iter()
        .map(|t| ngrams(t, n).into_iter().collect())
        .collect();
    // How many completions of each group hold each n-gram.
    let mut counts: HashMap<(usize, &Vec<String>), usize> = HashMap::new();
    for (s, &g) in sets.iter().zip(groups) {
        for gram in s {
            *counts.entry((g, gram)).or_default() += 1;
        }
    }
    sets.iter()
        .zip(groups)
        .map(|(s, &g)| {
            if s.is_empty() {
                return 0.0;
            }
            let own = s.iter().filter(|gram| counts[&(g, *gram)] == 1).count();
            own as f32 / s.len() as f32
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn think_format_as_trl() {
        // TRL's docstring examples, and its regex's edges: one opening tag at the very start.
        for (text, want) in [
            (
                "<think>\nThis is my reasoning.\n</think>\nThis is my answer.",
                1.0,
            ),
            ("<think>\nThis is my reasoning.\nThis is my answer.", 0.0),
            ("<think>a</think>", 1.0),
            (" <think>a</think>", 0.0),
            ("<think>a<think>b</think>", 0.0),
            ("<think>a</think> then <think>", 0.0),
            ("</think><think>", 0.0),
        ] {
            assert_eq!(think_format(text), want, "{text:?}");
        }
    }

    #[test]
    fn answer_after_the_reasoning_delimiter() {
        let m = AnswerMatch {
            after: Some("</think>".into()),
            ..AnswerMatch::new(Extract::Boxed)
        };
        let want = Some("\\frac{1}{3}");
        // TRL's reasoning_accuracy_reward docstring: 1, 0, 0.
        let c = [
            "<think> Reasoning content </think> The final answer is \\boxed{\\frac{1}{3}}",
            "<think> Reasoning content </think> The final answer is \\boxed{\\frac{1}{2}}",
            "<think> Reasoning content with partial answers \\boxed{\\frac{1}{3}} but no final answer",
        ];
        let got: Vec<f32> = c.iter().map(|t| m.score(t, want)).collect();
        assert_eq!(got, vec![1.0, 0.0, 0.0]);
    }

    #[test]
    fn sides_match_or_not() {
        for (t, want) in [
            ("abc=abc", 1.0),
            ("abc=abd", 0.0),
            ("=", 0.0),
            ("a=a=a", 0.0),
            ("abc", 0.0),
        ] {
            assert_eq!(sides_match(t), want, "{t}");
        }
    }

    #[test]
    fn equations_hold_or_not() {
        for (t, want) in [
            ("37+45=82", 1.0),
            ("37 + 45 = 82", 1.0),
            ("37+45=83", 0.0),
            ("90-45=45", 1.0),
            ("-3+5=2", 1.0),
            ("6*7=42", 1.0),
            ("7/2=3", 0.0),
            ("8/2=4", 1.0),
            ("37+45=", 0.0),
            ("37+=82", 0.0),
            ("3a+4=7", 0.0),
            ("37+45", 0.0),
            ("1+1=2=2", 0.0),
            ("", 0.0),
        ] {
            assert_eq!(equation_holds(t), want, "{t}");
        }
    }

    fn am(x: Extract) -> AnswerMatch {
        AnswerMatch::new(x)
    }

    #[test]
    fn extraction_cases() {
        use Extract::*;
        let cases: &[(&str, Extract, Option<&str>)] = &[
            ("so 3 + 4 = 7.", LastNumber, Some("7")),
            ("It is -5.", LastNumber, Some("-5")),
            ("costs 1,234.50 dollars", LastNumber, Some("1,234.50")),
            ("x2 and y", LastNumber, None),
            ("no digits", LastNumber, None),
            ("so \\boxed{\\frac{1}{2}} done", Boxed, Some("\\frac{1}{2}")),
            ("\\boxed{3} then \\boxed{ 42 }", Boxed, Some("42")),
            ("\\boxed{", Boxed, None),
            ("work\n#### 72\n", Hashes, Some("72")),
            ("#### 1\n#### 2", Hashes, Some("2")),
            ("The answer: 12 apples", AnswerPrefix, Some("12 apples")),
            ("ANSWER: Paris\nmore", AnswerPrefix, Some("Paris")),
            ("<answer> 9 </answer>", AnswerTag, Some("9")),
            ("<answer>1</answer><answer>2</answer>", AnswerTag, Some("2")),
            ("<answer></answer>", AnswerTag, None),
            ("<think>5</think><answer>6</answer> 7", Auto, Some("6")),
            ("\\boxed{8} #### 9", Auto, Some("8")),
            ("blah 3 then 4", Auto, Some("4")),
        ];
        for (text, how, want) in cases {
            assert_eq!(
                extract_answer(text, *how).as_deref(),
                *want,
                "{text:?} {how:?}"
            );
        }
    }

    #[test]
    fn numbers_and_strings_compare() {
        let m = am(Extract::Auto);
        for (got, want, eq) in [
            ("1,234", "1234", true),
            ("$12.00", "12", true),
            ("\\frac{1}{2}", "0.5", true),
            ("\\dfrac34", "0.75", true),
            ("3/4", "\\frac{3}{4}", true),
            ("-\\frac{1}{4}", "-0.25", true),
            ("50%", "50", true),
            ("0.1", "0.10000001", true),
            ("0.1", "0.2", false),
            ("Paris.", "paris", true),
            ("$x + 1$", "x  + 1", true),
            ("\\text{blue}", "Blue", true),
            ("red", "blue", false),
        ] {
            assert_eq!(m.equal(got, want), eq, "{got} vs {want}");
        }
        let strict = AnswerMatch {
            ignore_case: false,
            ..am(Extract::Auto)
        };
        assert!(!strict.equal("Paris", "paris"));
        let loose = AnswerMatch {
            abs_tol: 0.01,
            ..am(Extract::Auto)
        };
        assert!(loose.equal("3.141", "3.14159"));
        assert!(!m.equal("3.141", "3.14159"));
    }

    #[test]
    fn answer_match_scores() {
        let m = am(Extract::Auto);
        assert_eq!(m.score("<answer>42</answer>", Some("42")), 1.0);
        assert_eq!(m.score("<answer>41</answer> 42", Some("42")), 0.0);
        assert_eq!(m.score("nothing here", Some("42")), 0.0);
        assert!(m.score("42", None).is_nan());
        let c = am(Extract::Contains);
        assert_eq!(c.score("42 is wrong, it is 41", Some("42")), 1.0);
        assert_eq!(c.score("4.42", Some("42")), 0.0);
    }

    #[test]
    fn standalone_integers_match_the_python_regex() {
        // Expected values from re.findall(r"(?<![\d.])-?\d+(?![\d])", s.replace(",", "")).
        let cases: &[(&str, &[&str])] = &[
            ("The answer is 122.", &["122"]),
            ("59 + 63 = 122", &["59", "63", "122"]),
            ("1,234 apples", &["1234"]),
            ("12.5 and 3", &["12", "3"]),
            ("-5 or 5-3", &["-5", "5", "3"]),
            ("x2 y", &["2"]),
            ("no numbers", &[]),
            ("v1.2.3", &["1"]),
        ];
        for (s, want) in cases {
            assert_eq!(standalone_integers(s), want.to_vec(), "{s}");
        }
    }

    fn format(pattern: Option<&str>, tags: &[&str], partial: bool) -> Format {
        Format {
            pattern: pattern.map(|p| fancy_regex::Regex::new(&format!("(?s){p}")).unwrap()),
            tags: tags.iter().map(|s| s.to_string()).collect(),
            partial,
            value: 1.0,
        }
    }

    /// The integer alone, or an equation that ends in it with nothing else.
    #[test]
    fn integer_or_equation_of_completions() {
        for (text, want) in [
            ("64", true),
            (" 64.\n", true),
            ("34 + 30 = 64", true),
            ("34+30=64.", true),
            ("= 64", true),
            ("(3 * 4) - 2 = 10", true),
            ("34 + 30 = 64 birds", false),
            ("Sam has 34 + 30 = 64", false),
            ("34 + 30 =\n64", false),
            ("34 + 30 = 64\n\nSo 64", false),
            ("a = 64", false),
            ("34 + 30 = ", false),
            ("", false),
        ] {
            assert_eq!(is_integer_or_equation(text), want, "{text:?}");
        }
    }

    /// `integer_only`'s graded share, with an f32 twin of its arithmetic: a bare integer is 1,
    /// an equation the number's share of its characters, text without a number 0.
    #[test]
    fn answer_share_of_completions() {
        for (text, want) in [
            ("64", 1.0),
            (" 64. ", 1.0),
            ("-3", 1.0),
            ("34 + 30 = 64", 2.0 / 12.0),
            ("The answer is 64.", 2.0 / 17.0),
            ("  sum: 1,234  ", 5.0 / 10.0),
            ("no number", 0.0),
            ("", 0.0),
        ] {
            let got = answer_share(text);
            assert!(
                (got - want as f32).abs() < 1e-6,
                "{text:?}: {got} vs {want}"
            );
        }
    }

    #[test]
    fn format_pattern_and_tags() {
        let f = format(
            Some(r"^<think>.*</think>\s*<answer>.*</answer>$"),
            &[],
            false,
        );
        assert_eq!(f.score("<think>a\nb</think>\n<answer>3</answer>"), 1.0);
        assert_eq!(f.score("<think>a</think> 3"), 0.0);
        assert_eq!(f.score("x <think>a</think><answer>3</answer>"), 0.0);
        // Python-only syntax (a lookahead) works.
        let look = format(Some(r"^(?=.*\d).*$"), &[], false);
        assert_eq!(look.score("abc 1"), 1.0);
        assert_eq!(look.score("abc"), 0.0);
        let tags = format(None, &["think", "answer"], false);
        assert_eq!(tags.score("<think>x</think><answer>1</answer>"), 1.0);
        assert_eq!(tags.score("<answer>1</answer><think>x</think>"), 0.0);
        assert_eq!(tags.score("<think>x</think>"), 0.0);
        let partial = format(None, &["think", "answer"], true);
        assert_eq!(partial.score("<think>x</think>"), 0.5);
        assert_eq!(partial.score("<think>x"), 0.0);
    }

    /// The plain-f32 twin of DAPO's soft overlong punishment, written from the paper's formula.
    fn overlong_twin(len: f32, lmax: f32, cache: f32) -> f32 {
        if len <= lmax - cache {
            0.0
        } else if len <= lmax {
            ((lmax - cache) - len) / cache
        } else {
            -1.0
        }
    }

    #[test]
    fn length_rewards() {
        let l = Length::Overlong {
            max_length: 100,
            cache: 20,
        };
        for len in [0usize, 50, 80, 81, 90, 100, 101, 500] {
            assert_eq!(
                l.score(len),
                overlong_twin(len as f32, 100.0, 20.0),
                "{len}"
            );
        }
        assert_eq!(l.score(90), -0.5);
        let t = Length::Target { target: 50 };
        assert_eq!(t.score(50), 0.0);
        assert_eq!(t.score(25), -0.5);
        assert_eq!(t.score(100), -1.0);
    }

    #[test]
    fn repetition_and_diversity() {
        assert_eq!(repetition_penalty("a b c d", 2, -1.0), 0.0);
        // "a b" x3, "b a" x2: 2 distinct of 5.
        assert!((repetition_penalty("a b a b a B", 2, -1.0) + 0.6).abs() < 1e-6);
        assert_eq!(repetition_penalty("one", 3, -1.0), 0.0);
        let texts = ["the cat sat", "the cat ran", "a dog barked", "the cat sat"];
        let d = group_diversity(&texts, &[0, 0, 0, 1], 2);
        // "the cat sat": {the cat, cat sat}; "the cat" is shared with text 1 -> 1/2.
        assert_eq!(d, vec![0.5, 0.5, 1.0, 1.0]);
        let same = group_diversity(&["x y", "x y"], &[0, 0], 2);
        assert_eq!(same, vec![0.0, 0.0]);
        assert_eq!(group_diversity(&["x"], &[0], 2), vec![0.0]);
    }
}
