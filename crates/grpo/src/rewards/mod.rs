//! Reward functions: each scores a batch of completions (with their prompts, reference answers
//! and metadata) with one number each, or NaN when it cannot ("missing": left out of the group's
//! statistics).
//!
//! Configured as `[[rewards]]` tables (see [`parse_rewards`]); each kind's options are read by its
//! own module through [`table::Table`], which names `rewards[i].key` in every error.

pub mod command;
pub mod table;

use serde_json::{Map, Value};

use crate::data::{Example, Prompt};
use crate::{Error, Result};

/// One completion to score, with everything a reward may look at. The items of one group
/// (same prompt) are contiguous and share `group`.
#[derive(Debug, Clone, Copy)]
pub struct ScoreItem<'a> {
    /// The prompt as the dataset gave it: text or chat messages.
    pub prompt: &'a Prompt,
    pub completion: &'a str,
    /// The example's reference answer.
    pub answer: Option<&'a str>,
    /// The example's other fields.
    pub metadata: &'a Map<String, Value>,
    /// Index of the item's group within the batch.
    pub group: usize,
    /// Number of completion tokens (for length rewards).
    pub completion_tokens: usize,
    /// The reference model's mean per-token log-prob of the completion, when the trainer computed
    /// it (rewards that ask for it through `needs_ref_logp`).
    pub ref_mean_logp: Option<f32>,
}

impl<'a> ScoreItem<'a> {
    /// An item for `completion` of `ex` (group 0, no token count, no reference log-prob).
    pub fn new(ex: &'a Example, completion: &'a str) -> Self {
        ScoreItem {
            prompt: &ex.prompt,
            completion,
            answer: ex.answer.as_deref(),
            metadata: &ex.metadata,
            group: 0,
            completion_tokens: 0,
            ref_mean_logp: None,
        }
    }

    /// The prompt as one string: the text, or the last user message of a conversation.
    pub fn prompt_text(&self) -> &'a str {
        match self.prompt {
            Prompt::Text(t) => t,
            Prompt::Messages(ms) => ms
                .iter()
                .rev()
                .find(|m| m.role == "user")
                .or(ms.last())
                .map_or("", |m| m.content.as_str()),
        }
    }

    /// The prompt as JSON: a string, or a list of `{role, content}` messages (TRL's formats).
    pub fn prompt_json(&self) -> Value {
        match self.prompt {
            Prompt::Text(t) => Value::String(t.clone()),
            Prompt::Messages(ms) => Value::Array(
                ms.iter()
                    .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
                    .collect(),
            ),
        }
    }
}

/// How an answer is found in a completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatchMode {
    /// The last number in the text (`1,234` and `-5` and `12.0` understood) equals the answer.
    LastNumber,
    /// The answer appears anywhere as a standalone integer (the peer benchmark's rule).
    Contains,
}

#[derive(Debug, Clone, PartialEq)]
pub enum RewardFn {
    /// 1 if the completion's answer equals the example's, else 0; NaN without a reference answer.
    AnswerMatch { mode: MatchMode },
    /// `value` if the whole completion is just an integer (optionally followed by a period);
    /// with `only_if_correct`, only when that integer is also the right answer.
    IntegerOnly { value: f32, only_if_correct: bool },
}

#[derive(Debug, Clone, PartialEq)]
pub struct Reward {
    pub name: String,
    pub func: RewardFn,
    pub weight: f32,
}

impl Reward {
    pub fn score(&self, completion: &str, example: &Example) -> f32 {
        match &self.func {
            RewardFn::AnswerMatch { mode } => match &example.answer {
                None => f32::NAN,
                Some(ans) => {
                    let ok = match mode {
                        MatchMode::LastNumber => last_number_matches(completion, ans),
                        MatchMode::Contains => standalone_integers(completion)
                            .iter()
                            .any(|n| n == ans.trim()),
                    };
                    if ok {
                        1.0
                    } else {
                        0.0
                    }
                }
            },
            RewardFn::IntegerOnly {
                value,
                only_if_correct,
            } => {
                let correct = || {
                    example
                        .answer
                        .as_deref()
                        .is_some_and(|a| last_number_matches(completion, a))
                };
                if is_integer_only(completion) && (!only_if_correct || correct()) {
                    *value
                } else {
                    0.0
                }
            }
        }
    }

    /// Whether this reward measures correctness (its mean is reported as accuracy).
    pub fn is_accuracy(&self) -> bool {
        matches!(self.func, RewardFn::AnswerMatch { .. })
    }
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

/// Numbers in reading order: optional `-`, digits with `,` separators, optional decimals.
pub fn numbers(text: &str) -> Vec<f64> {
    let c: Vec<char> = text.chars().collect();
    let mut out = vec![];
    let mut i = 0;
    while i < c.len() {
        if c[i].is_ascii_digit() {
            let neg = i > 0 && c[i - 1] == '-' && (i < 2 || !c[i - 2].is_ascii_alphanumeric());
            let word = i > 0 && c[i - 1].is_ascii_alphabetic();
            let mut s = String::new();
            let mut k = i;
            while k < c.len()
                && (c[k].is_ascii_digit()
                    || (c[k] == ',' && k + 1 < c.len() && c[k + 1].is_ascii_digit()))
            {
                if c[k] != ',' {
                    s.push(c[k]);
                }
                k += 1;
            }
            if k + 1 < c.len() && c[k] == '.' && c[k + 1].is_ascii_digit() {
                s.push('.');
                k += 1;
                while k < c.len() && c[k].is_ascii_digit() {
                    s.push(c[k]);
                    k += 1;
                }
            }
            if !word {
                if let Ok(v) = s.parse::<f64>() {
                    out.push(if neg { -v } else { v });
                }
            }
            i = k;
        } else {
            i += 1;
        }
    }
    out
}

fn last_number_matches(text: &str, answer: &str) -> bool {
    let last = numbers(text).last().copied();
    match (last, numbers(answer).first().copied()) {
        (Some(got), Some(want))
            if answer.trim().parse::<f64>().is_ok() || numbers(answer).len() == 1 =>
        {
            (got - want).abs() <= 1e-9 * want.abs().max(1.0)
        }
        _ => text
            .trim()
            .trim_end_matches('.')
            .eq_ignore_ascii_case(answer.trim()),
    }
}

/// Python's `re.match(r"^\s*-?\d+\s*\.?\s*$", text)`.
pub fn is_integer_only(text: &str) -> bool {
    let t = text.trim();
    let t = t.strip_suffix('.').map_or(t, str::trim_end);
    let t = t.strip_prefix('-').unwrap_or(t);
    !t.is_empty() && t.chars().all(|c| c.is_ascii_digit())
}

/// The built-in task's rewards: correctness of the last number, and a small bonus for answering
/// with the right number alone. (An unconditional format bonus was hacked within 10 steps: the
/// policy learned to print a bare, wrong integer for a sure 0.1 and stopped computing.)
pub fn builtin_task_rewards() -> Vec<Reward> {
    vec![
        Reward {
            name: "correct".into(),
            func: RewardFn::AnswerMatch {
                mode: MatchMode::LastNumber,
            },
            weight: 1.0,
        },
        Reward {
            name: "format".into(),
            func: RewardFn::IntegerOnly {
                value: 0.1,
                only_if_correct: true,
            },
            weight: 1.0,
        },
    ]
}

/// The peer benchmark's rewards (`bench/peers/addition_task.py`), exactly.
pub fn peer_addition_rewards() -> Vec<Reward> {
    vec![
        Reward {
            name: "correctness".into(),
            func: RewardFn::AnswerMatch {
                mode: MatchMode::Contains,
            },
            weight: 1.0,
        },
        Reward {
            name: "format".into(),
            func: RewardFn::IntegerOnly {
                value: 0.1,
                only_if_correct: false,
            },
            weight: 1.0,
        },
    ]
}

/// `[[rewards]]` tables -> rewards.
pub fn parse_rewards(tables: &[Value]) -> Result<Vec<Reward>> {
    tables
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let key = |k: &str| format!("rewards[{i}].{k}");
            let obj = t
                .as_object()
                .ok_or_else(|| Error::config(format!("rewards[{i}]"), "must be a table"))?;
            let kind = obj.get("kind").and_then(Value::as_str).ok_or_else(|| {
                Error::config(key("kind"), "missing: one of answer_match, integer_only")
            })?;
            let allowed: &[&str] = match kind {
                "answer_match" => &["kind", "mode", "weight", "name"],
                "integer_only" => &["kind", "value", "only_if_correct", "weight", "name"],
                other => {
                    return Err(Error::config(
                        key("kind"),
                        format!("`{other}` is not a reward kind; use answer_match or integer_only"),
                    ))
                }
            };
            if let Some(k) = obj.keys().find(|k| !allowed.contains(&k.as_str())) {
                return Err(Error::config(
                    key(k),
                    format!(
                        "unknown key for kind {kind}; allowed: {}",
                        allowed.join(", ")
                    ),
                ));
            }
            let num = |k: &str, d: f64| -> Result<f64> {
                match obj.get(k) {
                    None => Ok(d),
                    Some(v) => v.as_f64().ok_or_else(|| {
                        Error::config(key(k), format!("expected a number, got {v}"))
                    }),
                }
            };
            let func = if kind == "answer_match" {
                let mode = match obj
                    .get("mode")
                    .and_then(Value::as_str)
                    .unwrap_or("last_number")
                {
                    "last_number" => MatchMode::LastNumber,
                    "contains" => MatchMode::Contains,
                    other => {
                        return Err(Error::config(
                            key("mode"),
                            format!("`{other}`: use last_number or contains"),
                        ))
                    }
                };
                RewardFn::AnswerMatch { mode }
            } else {
                let only_if_correct = match obj.get("only_if_correct") {
                    None => false,
                    Some(Value::Bool(b)) => *b,
                    Some(v) => {
                        return Err(Error::config(
                            key("only_if_correct"),
                            format!("expected true or false, got {v}"),
                        ))
                    }
                };
                RewardFn::IntegerOnly {
                    value: num("value", 0.1)? as f32,
                    only_if_correct,
                }
            };
            let name = obj
                .get("name")
                .and_then(Value::as_str)
                .unwrap_or(kind)
                .to_string();
            Ok(Reward {
                name,
                func,
                weight: num("weight", 1.0)? as f32,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ex(ans: Option<&str>) -> Example {
        Example {
            prompt: crate::data::Prompt::Text("q".into()),
            answer: ans.map(str::to_owned),
            metadata: Default::default(),
            origin: "t".into(),
        }
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
            assert_eq!(
                standalone_integers(s),
                want.iter().map(|x| x.to_string()).collect::<Vec<_>>(),
                "{s}"
            );
        }
    }

    #[test]
    fn answer_match_modes() {
        let last = &builtin_task_rewards()[0];
        let contains = &peer_addition_rewards()[0];
        let e = ex(Some("122"));
        assert_eq!(last.score("59 + 63 = 122", &e), 1.0);
        assert_eq!(last.score("122 is wrong, it is 121", &e), 0.0);
        assert_eq!(contains.score("122 is wrong, it is 121", &e), 1.0);
        assert_eq!(last.score("The answer is 122.0.", &e), 1.0);
        assert_eq!(last.score("1,234", &ex(Some("1234"))), 1.0);
        assert_eq!(last.score("It is -5.", &ex(Some("-5"))), 1.0);
        assert_eq!(last.score("nothing", &e), 0.0);
        assert!(last.score("122", &ex(None)).is_nan());
        assert!(last.is_accuracy() && !builtin_task_rewards()[1].is_accuracy());
    }

    #[test]
    fn integer_only_matches_the_python_regex() {
        let f = &peer_addition_rewards()[1];
        for (s, ok) in [
            ("122", true),
            (" 122 \n", true),
            ("122.", true),
            ("-7 .", true),
            ("122!", false),
            ("The answer is 122", false),
            ("", false),
            ("12 3", false),
            ("1.5", false),
        ] {
            assert_eq!(f.score(s, &ex(None)), if ok { 0.1 } else { 0.0 }, "{s:?}");
        }
    }

    #[test]
    fn builtin_format_bonus_needs_the_right_answer() {
        let f = &builtin_task_rewards()[1];
        let e = ex(Some("122"));
        assert_eq!(f.score("122", &e), 0.1);
        assert_eq!(f.score("121", &e), 0.0);
        assert_eq!(f.score("59 + 63 = 122", &e), 0.0);
        assert_eq!(peer_addition_rewards()[1].score("121", &e), 0.1);
    }

    #[test]
    fn parse_reward_tables() {
        let t: Vec<Value> = serde_json::from_str(
            r#"[{"kind": "answer_match", "mode": "contains", "weight": 2.0}, {"kind": "integer_only", "value": 0.5, "name": "fmt"}]"#,
        )
        .unwrap();
        let r = parse_rewards(&t).unwrap();
        assert_eq!(
            r[0].func,
            RewardFn::AnswerMatch {
                mode: MatchMode::Contains
            }
        );
        assert_eq!(r[0].weight, 2.0);
        assert_eq!(r[1].name, "fmt");
        for bad in [
            r#"[{"kind": "bogus"}]"#,
            r#"[{"kind": "answer_match", "mode": "x"}]"#,
            r#"[{"kind": "integer_only", "pattern": "x"}]"#,
            r#"[{}]"#,
        ] {
            let t: Vec<Value> = serde_json::from_str(bad).unwrap();
            let e = parse_rewards(&t).unwrap_err().to_string();
            assert!(e.contains("rewards[0]"), "{e}");
        }
    }
}
