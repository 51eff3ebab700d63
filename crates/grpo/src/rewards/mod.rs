//! Reward functions: each scores a batch of completions (with their prompts, reference answers
//! and metadata) with one number each, or NaN when it cannot ("missing": left out of the group's
//! statistics).
//!
//! Configured as `[[rewards]]` tables, in two steps: [`parse_specs`] reads each table into a
//! [`RewardSpec`] when the config is read (each kind's options are read by its own module through
//! [`table::Table`], which names `rewards[i].key` in every error), and [`RewardSpec::build`]
//! starts scorer programs and loads reward models when a run starts.

pub mod command;
pub mod host;
pub mod judge;
pub mod models;
pub mod rules;
pub mod table;

use std::time::Instant;

use serde_json::{Map, Value};

use self::rules::{AnswerMatch, Extract, Format, Length};
use self::table::Table;

use crate::data::{Example, Prompt};
use crate::{Error, Result};

/// One completion to score, with everything a reward may look at. The items of one group
/// (same prompt) are contiguous and share `group`.
#[derive(Debug, Clone, Copy)]
pub struct ScoreItem<'a> {
    /// The prompt as the dataset gave it: text or chat messages.
    pub prompt: &'a Prompt,
    pub completion: &'a str,
    /// The completion's token ids (the EOS, when sampled, last), where the trainer has them.
    pub completion_ids: Option<&'a [u32]>,
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
    /// An agent's episode as messages (assistant turns with their tool calls, tool results):
    /// what TRL's conversational `completions` hold. `completion` is then its final answer.
    pub messages: Option<&'a [Value]>,
    /// What the episode's environment rewarded it with ([`RewardFn::Environment`]'s index;
    /// None: missing).
    pub env_rewards: &'a [Option<f32>],
}

impl<'a> ScoreItem<'a> {
    /// An item for `completion` of `ex` (group 0, no token count, no reference log-prob).
    pub fn new(ex: &'a Example, completion: &'a str) -> Self {
        ScoreItem {
            prompt: &ex.prompt,
            completion,
            completion_ids: None,
            answer: ex.answer.as_deref(),
            metadata: &ex.metadata,
            group: 0,
            completion_tokens: 0,
            ref_mean_logp: None,
            messages: None,
            env_rewards: &[],
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

/// What a reward computes.
#[derive(Debug)]
pub enum RewardFn {
    AnswerMatch(AnswerMatch),
    /// `value` if the whole completion is just an integer (optionally followed by a period);
    /// with `only_if_correct`, only when that integer is also the right answer. With `graded`,
    /// a completion that is more than its last number is paid `value` times the share of its
    /// characters that number is ([`rules::answer_share`]), so that shorter answers earn more.
    /// With `equation`, an equation that ends in the integer and holds nothing else ("34 + 30 =
    /// 64") counts as the integer alone ([`rules::is_integer_or_equation`]).
    IntegerOnly {
        value: f32,
        only_if_correct: bool,
        graded: bool,
        equation: bool,
    },
    Format(Format),
    /// See [`rules::equation_holds`].
    Equation,
    /// See [`rules::sides_match`].
    SidesMatch,
    /// See [`rules::think_format`].
    ThinkFormat,
    Length(Length),
    /// See [`rules::repetition_penalty`].
    Repetition {
        n: usize,
        max_penalty: f32,
    },
    /// See [`rules::group_diversity`].
    Diversity {
        n: usize,
    },
    Composite(Box<Composite>),
    Judge(Box<judge::Judge>),
    Classifier(Box<models::ClassifierReward>),
    Embedding(Box<models::EmbeddingReward>),
    /// The user's scorer program (JSON lines over stdin/stdout).
    Command(Box<command::CommandScorer>),
    /// The user's scorer behind an HTTP endpoint.
    Http(Box<command::HttpScorer>),
    /// An agent's environment's reward k (TRL's `environment_factory`: its `get_reward()`, or
    /// a reward function that takes `environments`, called where the instances live):
    /// [`ScoreItem::env_rewards`]`[k]`, missing when it gave none.
    Environment(usize),
    /// Computed by the program grpo runs in (the Python package's reward functions).
    Host(std::sync::Arc<dyn host::HostReward>),
}

/// `kind = "composite"`: a weighted sum of a quality, a safety and a diversity reward (each any
/// reward table, its `weight` the term's weight) and coherence, the reference model's mean
/// per-token log-prob of the completion, weighted by `coherence`. Missing terms are left out;
/// NaN when every term is missing.
#[derive(Debug)]
pub struct Composite {
    pub terms: Vec<Reward>,
    pub coherence: f32,
}

#[derive(Debug)]
pub struct Reward {
    pub name: String,
    pub func: RewardFn,
    pub weight: f32,
}

impl Reward {
    /// `{name: score}` of one completion's scores (null where a reward is missing), as the
    /// completion and evaluation logs write them.
    pub fn named_scores(rewards: &[Reward], scores: &[f32]) -> serde_json::Value {
        let m: serde_json::Map<String, serde_json::Value> = rewards
            .iter()
            .zip(scores)
            .map(|(r, &s)| {
                let v = if s.is_finite() {
                    serde_json::json!(s)
                } else {
                    serde_json::Value::Null
                };
                (r.name.clone(), v)
            })
            .collect();
        serde_json::Value::Object(m)
    }

    /// One score per item (NaN: missing).
    pub fn score(&self, items: &[ScoreItem]) -> Result<Vec<f32>> {
        let each = |f: &dyn Fn(&ScoreItem) -> f32| Ok(items.iter().map(f).collect());
        match &self.func {
            RewardFn::AnswerMatch(m) => each(&|it| m.score(it.completion, it.answer)),
            RewardFn::IntegerOnly {
                value,
                only_if_correct,
                graded,
                equation,
            } => {
                let correct = AnswerMatch::new(Extract::LastNumber);
                each(&|it| {
                    let whole = match equation {
                        true => rules::is_integer_or_equation(it.completion),
                        false => rules::is_integer_only(it.completion),
                    };
                    let share = match (whole, graded) {
                        (true, _) => 1.0,
                        (false, true) => rules::answer_share(it.completion),
                        (false, false) => 0.0,
                    };
                    let ok = !only_if_correct || correct.score(it.completion, it.answer) == 1.0;
                    if ok {
                        *value * share
                    } else {
                        0.0
                    }
                })
            }
            RewardFn::Format(f) => each(&|it| f.score(it.completion)),
            RewardFn::Equation => each(&|it| rules::equation_holds(it.completion)),
            RewardFn::SidesMatch => each(&|it| rules::sides_match(it.completion)),
            RewardFn::ThinkFormat => each(&|it| rules::think_format(it.completion)),
            RewardFn::Length(l) => each(&|it| l.score(it.completion_tokens)),
            RewardFn::Repetition { n, max_penalty } => {
                each(&|it| rules::repetition_penalty(it.completion, *n, *max_penalty))
            }
            RewardFn::Diversity { n } => {
                let texts: Vec<&str> = items.iter().map(|it| it.completion).collect();
                let groups: Vec<usize> = items.iter().map(|it| it.group).collect();
                Ok(rules::group_diversity(&texts, &groups, *n))
            }
            RewardFn::Composite(c) => c.score(items),
            RewardFn::Judge(j) => j.score(items),
            RewardFn::Classifier(c) => c.score(items),
            RewardFn::Embedding(e) => e.score(items),
            RewardFn::Command(c) => c.score(items),
            RewardFn::Http(h) => h.score(items),
            RewardFn::Host(h) => h.score(items),
            RewardFn::Environment(k) => each(&|it| {
                it.env_rewards
                    .get(*k)
                    .copied()
                    .flatten()
                    .unwrap_or(f32::NAN)
            }),
        }
    }

    /// The function of a `kind = "python"` reward ([`command::CommandSpec::python_function`]).
    pub fn python_function(&self) -> Option<&str> {
        match &self.func {
            RewardFn::Command(c) => c.spec().python_function(),
            _ => None,
        }
    }

    /// Whether a model or the user's scorer gives the score (a fill-in run's judge).
    pub fn is_judge(&self) -> bool {
        matches!(
            self.func,
            RewardFn::Judge(_)
                | RewardFn::Classifier(_)
                | RewardFn::Command(_)
                | RewardFn::Http(_)
                | RewardFn::Host(_)
        )
    }

    /// Whether this reward measures correctness (its mean is reported as accuracy).
    pub fn is_accuracy(&self) -> bool {
        matches!(
            self.func,
            RewardFn::AnswerMatch(_) | RewardFn::Equation | RewardFn::SidesMatch
        )
    }

    /// Whether the reward reads [`ScoreItem::ref_mean_logp`] (the trainer then computes the
    /// reference log-probs before scoring).
    pub fn needs_ref_logp(&self) -> bool {
        match &self.func {
            RewardFn::Composite(c) => {
                c.coherence != 0.0 || c.terms.iter().any(Reward::needs_ref_logp)
            }
            _ => false,
        }
    }

    /// Whether the reward may score groups on a second thread while sampling goes on: scorer
    /// programs and rule rewards; not model rewards, not the host's (on the CPU they would only compete with the
    /// sampler for cores) and not rewards that need the reference model's log-probs.
    pub fn overlaps_sampling(&self) -> bool {
        match &self.func {
            RewardFn::Judge(_) | RewardFn::Classifier(_) | RewardFn::Embedding(_) => false,
            // A host's functions get the whole round in one call, as TRL calls them.
            RewardFn::Host(_) => false,
            RewardFn::Composite(c) => {
                !self.needs_ref_logp() && c.terms.iter().all(Reward::overlaps_sampling)
            }
            _ => true,
        }
    }

    /// Before training: an HTTP scorer's endpoint answers ([`command::HttpScorer::probe`]); a
    /// scorer program was already watched for an exit at start. Other rewards are local.
    pub fn check_reachable(&self) -> Result<()> {
        match &self.func {
            RewardFn::Http(h) => h.probe(),
            RewardFn::Composite(c) => c.terms.iter().try_for_each(Reward::check_reachable),
            _ => Ok(()),
        }
    }

    /// Counts of a scorer program's or endpoint's answers by outcome, since it started.
    pub fn scorer_stats(&self) -> Option<command::ScorerStats> {
        match &self.func {
            RewardFn::Command(c) => Some(c.stats()),
            RewardFn::Http(h) => Some(h.stats()),
            _ => None,
        }
    }

    /// Whether the reward compares the completions of a group (it needs the whole group at once).
    pub fn is_group_reward(&self) -> bool {
        match &self.func {
            RewardFn::Diversity { .. } => true,
            RewardFn::Composite(c) => c.terms.iter().any(Reward::is_group_reward),
            _ => false,
        }
    }

    /// Whether the reward reads [`ScoreItem::completion_tokens`].
    pub fn needs_token_counts(&self) -> bool {
        match &self.func {
            RewardFn::Length(_) => true,
            RewardFn::Composite(c) => c.terms.iter().any(Reward::needs_token_counts),
            _ => false,
        }
    }
}

impl Composite {
    fn score(&self, items: &[ScoreItem]) -> Result<Vec<f32>> {
        let mut parts: Vec<(f32, Vec<f32>)> = self
            .terms
            .iter()
            .map(|r| Ok((r.weight, r.score(items)?)))
            .collect::<Result<_>>()?;
        if self.coherence != 0.0 {
            let coh = items
                .iter()
                .map(|it| it.ref_mean_logp.unwrap_or(f32::NAN))
                .collect();
            parts.push((self.coherence, coh));
        }
        let weights: Vec<f32> = parts.iter().map(|p| p.0).collect();
        let per_item: Vec<f32> = (0..items.len())
            .flat_map(|i| parts.iter().map(move |p| p.1[i]))
            .collect();
        crate::advantages::combine_rewards(&per_item, &weights)
    }
}

/// What parsing and building a reward may need from the run (see [`parse_rewards`]).
#[derive(Debug, Clone)]
pub struct RewardContext {
    /// The default `max_length` of length rewards.
    pub max_completion_length: usize,
    /// Where reward models run.
    pub device: candle_core::Device,
}

/// Kinds and the keys each takes (besides `kind`, `name`, `weight`).
const KINDS: &[(&str, &[&str])] = &[
    ("answer_match", AnswerMatch::KEYS),
    (
        "integer_only",
        &["value", "only_if_correct", "graded", "equation"],
    ),
    ("format", Format::KEYS),
    ("equation", &[]),
    ("sides_match", &[]),
    ("think_format", &[]),
    ("length", Length::KEYS),
    ("repetition", &["n", "max_penalty"]),
    ("diversity", &["n"]),
    (
        "composite",
        &["quality", "safety", "diversity", "coherence"],
    ),
    ("judge", judge::JudgeSpec::KEYS),
    ("classifier", models::ClassifierSpec::KEYS),
    ("embedding", models::EmbeddingSpec::KEYS),
    ("command", command::CommandSpec::KEYS),
    ("python", command::CommandSpec::PYTHON_KEYS),
    ("http", command::HttpSpec::KEYS),
];

/// One `[[rewards]]` table, parsed and checked: every option read and validated, nothing started
/// or loaded yet. Made when the config is read ([`parse_specs`]), so a typo fails there;
/// [`RewardSpec::build`] later starts scorer programs and loads reward models.
#[derive(Debug, Clone, PartialEq)]
pub struct RewardSpec {
    pub name: String,
    pub weight: f32,
    /// How the table is named in errors: `rewards[2]`, `rewards[0].quality`.
    pub path: String,
    pub kind: RewardKind,
}

/// A reward kind with its options.
#[derive(Debug, Clone, PartialEq)]
pub enum RewardKind {
    AnswerMatch(AnswerMatch),
    /// See [`RewardFn::IntegerOnly`].
    IntegerOnly {
        value: f32,
        only_if_correct: bool,
        graded: bool,
        equation: bool,
    },
    Format(Format),
    Equation,
    SidesMatch,
    ThinkFormat,
    Length(Length),
    Repetition {
        n: usize,
        max_penalty: f32,
    },
    Diversity {
        n: usize,
    },
    /// See [`Composite`].
    Composite {
        terms: Vec<RewardSpec>,
        coherence: f32,
    },
    Judge(judge::JudgeSpec),
    Classifier(models::ClassifierSpec),
    Embedding(models::EmbeddingSpec),
    Command(command::CommandSpec),
    Http(command::HttpSpec),
}

/// `[[rewards]]` tables -> specs (`max_completion_length`: the default `max_length` of length
/// rewards). Errors name the table and key (`rewards[2].timeout_s`); names must be distinct.
pub fn parse_specs(tables: &[Value], max_completion_length: usize) -> Result<Vec<RewardSpec>> {
    let specs = tables
        .iter()
        .enumerate()
        .map(|(i, t)| RewardSpec::parse(t, format!("rewards[{i}]"), max_completion_length))
        .collect::<Result<Vec<_>>>()?;
    let mut seen = std::collections::HashSet::new();
    for (i, r) in specs.iter().enumerate() {
        if !seen.insert(r.name.as_str()) {
            return Err(Error::config(
                format!("rewards[{i}].name"),
                format!(
                    "two rewards are named `{}`; give each a distinct `name` (metrics use it)",
                    r.name
                ),
            ));
        }
    }
    Ok(specs)
}

/// Specs -> rewards: starts scorer programs, loads reward and judge models on `device`.
pub fn build_rewards(specs: &[RewardSpec], device: &candle_core::Device) -> Result<Vec<Reward>> {
    specs.iter().map(|s| s.build(device)).collect()
}

/// `[[rewards]]` tables -> rewards: [`parse_specs`] then [`build_rewards`].
pub fn parse_rewards(tables: &[Value], ctx: &RewardContext) -> Result<Vec<Reward>> {
    build_rewards(
        &parse_specs(tables, ctx.max_completion_length)?,
        &ctx.device,
    )
}

impl RewardSpec {
    /// One table; `path` names it in errors.
    pub fn parse(v: &Value, path: String, max_completion_length: usize) -> Result<Self> {
        let obj = v
            .as_object()
            .ok_or_else(|| Error::config(&path, "must be a table"))?;
        let kinds: Vec<&str> = KINDS.iter().map(|k| k.0).collect();
        let kind = obj.get("kind").and_then(Value::as_str).ok_or_else(|| {
            Error::config(
                format!("{path}.kind"),
                format!("missing: one of {}", kinds.join(", ")),
            )
        })?;
        let Some((_, keys)) = KINDS.iter().find(|k| k.0 == kind) else {
            let hint = grpo_models::error::nearest(kind, &kinds)
                .map(|n| format!(" (did you mean `{n}`?)"))
                // No near name: the message leaves the hint out.
                .unwrap_or_default();
            return Err(Error::config(
                format!("{path}.kind"),
                format!(
                    "`{kind}` is not a reward kind{hint}; use one of {}",
                    kinds.join(", ")
                ),
            ));
        };
        let t = Table::new(obj, path.clone(), keys)?;
        let parsed = match kind {
            "answer_match" => RewardKind::AnswerMatch(AnswerMatch::from_table(&t)?),
            "integer_only" => RewardKind::IntegerOnly {
                value: t.f32("value", 0.1)?,
                only_if_correct: t.bool("only_if_correct", false)?,
                graded: t.bool("graded", false)?,
                equation: t.bool("equation", false)?,
            },
            "format" => RewardKind::Format(Format::from_table(&t)?),
            "equation" => RewardKind::Equation,
            "sides_match" => RewardKind::SidesMatch,
            "think_format" => RewardKind::ThinkFormat,
            "length" => RewardKind::Length(Length::from_table(&t, max_completion_length)?),
            "repetition" => {
                let max_penalty = t.f32("max_penalty", -1.0)?;
                if max_penalty > 0.0 {
                    return Err(t.err("max_penalty", "must be <= 0 (it is a penalty)"));
                }
                RewardKind::Repetition {
                    n: ngram_size(&t, 3)?,
                    max_penalty,
                }
            }
            "diversity" => RewardKind::Diversity {
                n: ngram_size(&t, 2)?,
            },
            "composite" => {
                let mut terms = vec![];
                for k in ["quality", "safety", "diversity"] {
                    if let Some(sub) = t.sub(k)? {
                        let mut r = RewardSpec::parse(
                            &Value::Object(sub.clone()),
                            t.key(k),
                            max_completion_length,
                        )?;
                        if !sub.contains_key("name") {
                            r.name = k.to_string();
                        }
                        terms.push(r);
                    }
                }
                let coherence = t.f32("coherence", 0.0)?;
                if terms.is_empty() && coherence == 0.0 {
                    return Err(t.err(
                        "quality",
                        "a composite reward needs at least one of the tables quality, safety, \
                         diversity, or a `coherence` weight",
                    ));
                }
                RewardKind::Composite { terms, coherence }
            }
            "judge" => RewardKind::Judge(judge::JudgeSpec::from_table(&t)?),
            "classifier" => RewardKind::Classifier(models::ClassifierSpec::from_table(&t)?),
            "embedding" => RewardKind::Embedding(models::EmbeddingSpec::from_table(&t)?),
            "command" => RewardKind::Command(command::CommandSpec::from_table(&t)?),
            "python" => RewardKind::Command(command::CommandSpec::from_python_table(&t)?),
            "http" => RewardKind::Http(command::HttpSpec::from_table(&t)?),
            _ => unreachable!("kinds are checked above"),
        };
        // A Python function is named after itself, as TRL names its reward functions.
        let default_name = match (kind, t.opt_str("function")?) {
            ("python", Some(f)) => f.rsplit([':', '.']).next().unwrap_or(kind),
            _ => kind,
        };
        Ok(RewardSpec {
            name: t.str("name", default_name)?.to_string(),
            weight: t.f32("weight", 1.0)?,
            path,
            kind: parsed,
        })
    }

    /// The reward: starts its scorer program or loads its model on `device` (errors name the
    /// reward or its table's key).
    pub fn build(&self, device: &candle_core::Device) -> Result<Reward> {
        let func = match &self.kind {
            RewardKind::AnswerMatch(m) => RewardFn::AnswerMatch(m.clone()),
            &RewardKind::IntegerOnly {
                value,
                only_if_correct,
                graded,
                equation,
            } => RewardFn::IntegerOnly {
                value,
                only_if_correct,
                graded,
                equation,
            },
            RewardKind::Format(f) => RewardFn::Format(f.clone()),
            RewardKind::Equation => RewardFn::Equation,
            RewardKind::SidesMatch => RewardFn::SidesMatch,
            RewardKind::ThinkFormat => RewardFn::ThinkFormat,
            RewardKind::Length(l) => RewardFn::Length(*l),
            &RewardKind::Repetition { n, max_penalty } => RewardFn::Repetition { n, max_penalty },
            &RewardKind::Diversity { n } => RewardFn::Diversity { n },
            RewardKind::Composite { terms, coherence } => {
                RewardFn::Composite(Box::new(Composite {
                    terms: build_rewards(terms, device)?,
                    coherence: *coherence,
                }))
            }
            RewardKind::Judge(j) => {
                RewardFn::Judge(Box::new(judge::Judge::load(j, &self.path, device)?))
            }
            RewardKind::Classifier(c) => RewardFn::Classifier(Box::new(
                models::ClassifierReward::load(c, &self.path, device)?,
            )),
            RewardKind::Embedding(e) => {
                RewardFn::Embedding(Box::new(models::EmbeddingReward::load(e, device)?))
            }
            RewardKind::Command(c) => RewardFn::Command(Box::new(command::CommandScorer::start(
                c.clone(),
                &self.name,
            )?)),
            RewardKind::Http(h) => {
                RewardFn::Http(Box::new(command::HttpScorer::start(h.clone(), &self.name)?))
            }
        };
        Ok(Reward {
            name: self.name.clone(),
            func,
            weight: self.weight,
        })
    }
}

fn ngram_size(t: &Table, default: usize) -> Result<usize> {
    let n = t.usize("n", default)?;
    if n == 0 {
        return Err(t.err("n", "the n-gram size must be >= 1"));
    }
    Ok(n)
}

/// Scores of every item under every reward: `[item][reward]`, and the seconds each reward took.
pub fn score_all(rewards: &[Reward], items: &[ScoreItem]) -> Result<(Vec<Vec<f32>>, Vec<f64>)> {
    score_refs(&rewards.iter().collect::<Vec<_>>(), items)
}

/// [`score_all`] over borrowed rewards.
pub fn score_refs(rewards: &[&Reward], items: &[ScoreItem]) -> Result<(Vec<Vec<f32>>, Vec<f64>)> {
    let mut out = vec![Vec::with_capacity(rewards.len()); items.len()];
    let mut secs = Vec::with_capacity(rewards.len());
    for r in rewards {
        let t = Instant::now();
        let scores = r.score(items)?;
        if scores.len() != items.len() {
            return Err(Error::reward(
                &r.name,
                format!(
                    "returned {} scores for {} completions",
                    scores.len(),
                    items.len()
                ),
            ));
        }
        for (row, s) in out.iter_mut().zip(scores) {
            row.push(s);
        }
        secs.push(t.elapsed().as_secs_f64());
    }
    Ok((out, secs))
}

/// The built-in task's rewards: correctness of the last number, and a small bonus for answering
/// with the right number and no words: alone, or at the end of the sum written out ("34 + 30 =
/// 64"; a bare-number-only bonus never acted, as SmolLM2-135M never answers a bare right number).
/// (An unconditional format bonus was hacked within 10 steps: the policy learned to print a
/// bare, wrong integer for a sure 0.1 and stopped computing.)
pub fn builtin_task_rewards() -> Vec<Reward> {
    vec![
        Reward {
            name: "correct".into(),
            func: RewardFn::AnswerMatch(AnswerMatch::new(Extract::LastNumber)),
            weight: 1.0,
        },
        Reward {
            name: "format".into(),
            func: RewardFn::IntegerOnly {
                value: 0.1,
                only_if_correct: true,
                graded: false,
                equation: true,
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
            func: RewardFn::AnswerMatch(AnswerMatch::new(Extract::Contains)),
            weight: 1.0,
        },
        Reward {
            name: "format".into(),
            func: RewardFn::IntegerOnly {
                value: 0.1,
                only_if_correct: false,
                graded: false,
                equation: false,
            },
            weight: 1.0,
        },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::Prompt;

    fn ex(ans: Option<&str>) -> Example {
        Example {
            prompt: Prompt::Text("q".into()),
            answer: ans.map(str::to_owned),
            metadata: Default::default(),
            origin: "t".into(),
            tokens: None,
        }
    }

    fn one(r: &Reward, text: &str, e: &Example) -> f32 {
        r.score(&[ScoreItem::new(e, text)]).unwrap()[0]
    }

    fn ctx() -> RewardContext {
        RewardContext {
            max_completion_length: 64,
            device: candle_core::Device::Cpu,
        }
    }

    fn parse(json: &str) -> Result<Vec<Reward>> {
        let t: Vec<Value> = serde_json::from_str(json).unwrap();
        parse_rewards(&t, &ctx())
    }

    #[test]
    fn answer_match_modes() {
        let last = &builtin_task_rewards()[0];
        let contains = &peer_addition_rewards()[0];
        let e = ex(Some("122"));
        assert_eq!(one(last, "59 + 63 = 122", &e), 1.0);
        assert_eq!(one(last, "122 is wrong, it is 121", &e), 0.0);
        assert_eq!(one(contains, "122 is wrong, it is 121", &e), 1.0);
        assert_eq!(one(last, "The answer is 122.0.", &e), 1.0);
        assert_eq!(one(last, "1,234", &ex(Some("1234"))), 1.0);
        assert_eq!(one(last, "It is -5.", &ex(Some("-5"))), 1.0);
        assert_eq!(one(last, "nothing", &e), 0.0);
        assert!(one(last, "122", &ex(None)).is_nan());
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
            assert_eq!(one(f, s, &ex(None)), if ok { 0.1 } else { 0.0 }, "{s:?}");
        }
    }

    #[test]
    fn builtin_format_bonus_needs_the_right_answer() {
        let f = &builtin_task_rewards()[1];
        let e = ex(Some("122"));
        assert_eq!(one(f, "122", &e), 0.1);
        assert_eq!(one(f, "121", &e), 0.0);
        // The sum written out, with no words, counts as the number (issue 35); words do not.
        assert_eq!(one(f, "59 + 63 = 122", &e), 0.1);
        assert_eq!(one(f, "59 + 63 = 121", &e), 0.0);
        assert_eq!(one(f, "59 + 63 = 122 apples", &e), 0.0);
        assert_eq!(one(&peer_addition_rewards()[1], "121", &e), 0.1);
        assert_eq!(one(&peer_addition_rewards()[1], "59 + 63 = 122", &e), 0.0);
    }

    #[test]
    fn parse_reward_tables() {
        let r = parse(
            r#"[{"kind": "answer_match", "mode": "contains", "weight": 2.0},
                {"kind": "integer_only", "value": 0.5, "name": "fmt"},
                {"kind": "answer_match", "extract": "boxed", "tolerance": 0.01, "name": "boxed"},
                {"kind": "format", "pattern": "^<a>.*</a>$", "required_tags": ["a"]},
                {"kind": "length", "max_length": 40, "cache_length": 10},
                {"kind": "repetition", "n": 2, "max_penalty": -0.5},
                {"kind": "diversity"}]"#,
        )
        .unwrap();
        assert!(matches!(&r[0].func, RewardFn::AnswerMatch(m) if m.extract == Extract::Contains));
        assert_eq!(r[0].weight, 2.0);
        assert_eq!(r[1].name, "fmt");
        assert!(
            matches!(&r[2].func, RewardFn::AnswerMatch(m) if m.extract == Extract::Boxed && m.abs_tol == 0.01)
        );
        assert!(matches!(
            r[4].func,
            RewardFn::Length(Length::Overlong {
                max_length: 40,
                cache: 10
            })
        ));
        assert!(r[4].needs_token_counts() && !r[0].needs_token_counts());
        let default_len = parse(r#"[{"kind": "length"}]"#).unwrap();
        assert!(matches!(
            default_len[0].func,
            RewardFn::Length(Length::Overlong {
                max_length: 64,
                cache: 16
            })
        ));
        for (bad, key) in [
            (r#"[{"kind": "bogus"}]"#, "rewards[0].kind"),
            (
                r#"[{"kind": "answer_matc"}]"#,
                "did you mean `answer_match`",
            ),
            (
                r#"[{"kind": "answer_match", "mode": "x"}]"#,
                "rewards[0].mode",
            ),
            (
                r#"[{"kind": "integer_only", "pattern": "x"}]"#,
                "rewards[0].pattern",
            ),
            (
                r#"[{"kind": "format", "patern": "x"}]"#,
                "did you mean `pattern`",
            ),
            (r#"[{"kind": "format"}]"#, "rewards[0].pattern"),
            (
                r#"[{"kind": "format", "pattern": "(unclosed"}]"#,
                "not a valid regular",
            ),
            (
                r#"[{"kind": "format", "required_tags": ["<a>"]}]"#,
                "without brackets",
            ),
            (
                r#"[{"kind": "length", "cache_length": 0}]"#,
                "rewards[0].cache_length",
            ),
            (
                r#"[{"kind": "length", "mode": "target"}]"#,
                "rewards[0].target",
            ),
            (
                r#"[{"kind": "repetition", "max_penalty": 1}]"#,
                "must be <= 0",
            ),
            (r#"[{"kind": "diversity", "n": 0}]"#, "rewards[0].n"),
            (
                r#"[{"kind": "answer_match", "weight": "x"}]"#,
                "rewards[0].weight",
            ),
            (r#"[{}]"#, "rewards[0].kind"),
            (r#"[1]"#, "rewards[0]"),
            (
                r#"[{"kind": "diversity"}, {"kind": "diversity"}]"#,
                "rewards[1].name",
            ),
            (r#"[{"kind": "composite"}]"#, "rewards[0].quality"),
            (
                r#"[{"kind": "composite", "safety": {"kind": "format"}}]"#,
                "rewards[0].safety.pattern",
            ),
        ] {
            let e = match parse(bad) {
                Ok(_) => panic!("{bad} parsed"),
                Err(e) => e.to_string(),
            };
            assert!(e.contains(key), "{bad}: {e}");
        }
    }

    #[test]
    fn specs_start_and_load_nothing_until_built() {
        let t: Vec<Value> = serde_json::from_str(
            r#"[{"kind": "command", "command": "/no/such/scorer --x", "name": "mine"},
                {"kind": "classifier", "model": "/no/such/dir", "label": 2},
                {"kind": "judge", "model": "/no/such/judge", "yes": ["Yes", " yes"]},
                {"kind": "composite", "quality": {"kind": "answer_match"}, "coherence": 0.5}]"#,
        )
        .unwrap();
        let specs = parse_specs(&t, 64).unwrap();
        let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["mine", "classifier", "judge", "composite"]);
        assert!(matches!(
            &specs[1].kind,
            RewardKind::Classifier(c) if c.label == Some(models::LabelRef::Index(2))
        ));
        // A composite term is named after its slot unless it has a name.
        let RewardKind::Composite { terms, .. } = &specs[3].kind else {
            panic!("{:?}", specs[3].kind)
        };
        assert_eq!(
            (terms[0].name.as_str(), terms[0].path.as_str()),
            ("quality", "rewards[3].quality")
        );
        // Building is what starts the scorer; its error names the reward.
        let e = specs[0].build(&candle_core::Device::Cpu).unwrap_err();
        assert!(e.to_string().contains("mine"), "{e}");
        let built = build_rewards(&specs[3..], &candle_core::Device::Cpu).unwrap();
        assert!(built[0].needs_ref_logp());
        // Options that need no model are checked when parsed.
        for (bad, key) in [
            (
                r#"[{"kind": "classifier", "model": "m", "label": -1}]"#,
                "rewards[0].label",
            ),
            (
                r#"[{"kind": "judge", "template": "{{ x"}]"#,
                "rewards[0].template",
            ),
            (r#"[{"kind": "judge", "chat": "yes"}]"#, "rewards[0].chat"),
            (
                r#"[{"kind": "embedding", "batch_size": -2}]"#,
                "rewards[0].batch_size",
            ),
            (r#"[{"kind": "http", "url": "ftp://x"}]"#, "rewards[0].url"),
        ] {
            let t: Vec<Value> = serde_json::from_str(bad).unwrap();
            let e = parse_specs(&t, 64).unwrap_err().to_string();
            assert!(e.contains(key), "{bad}: {e}");
        }
    }

    #[test]
    fn composite_sums_terms_and_coherence() {
        let r = parse(
            r#"[{"kind": "composite", "coherence": 0.5,
                 "quality": {"kind": "answer_match"},
                 "diversity": {"kind": "diversity", "n": 1, "weight": 0.25}}]"#,
        )
        .unwrap();
        assert!(r[0].needs_ref_logp());
        let e = ex(Some("7"));
        let mut a = ScoreItem::new(&e, "x 7");
        a.ref_mean_logp = Some(-2.0);
        let mut b = ScoreItem::new(&e, "x 8");
        b.ref_mean_logp = Some(-1.0);
        let c = ScoreItem::new(&e, "y 8"); // no reference log-prob: that term is left out
        let s = r[0].score(&[a, b, c]).unwrap();
        // a: quality 1, diversity {x,7}: 7 is its own -> 0.5, coherence -2.
        assert_eq!(s[0], 1.0 + 0.25 * 0.5 - 1.0);
        // b: quality 0, diversity {x, 8}: x shared with a, 8 with c -> 0.
        assert_eq!(s[1], -0.5);
        // c: quality 0, diversity {y, 8}: y own -> 0.5; no coherence.
        assert_eq!(s[2], 0.125);
        let no_answer = ex(None);
        let d = ScoreItem::new(&no_answer, "z");
        let only_quality =
            parse(r#"[{"kind": "composite", "quality": {"kind": "answer_match"}}]"#).unwrap();
        assert!(only_quality[0].score(&[d]).unwrap()[0].is_nan());
    }

    #[test]
    fn score_all_is_item_major_with_timings() {
        let r = builtin_task_rewards();
        let e = ex(Some("3"));
        let items = [ScoreItem::new(&e, "3"), ScoreItem::new(&e, "1 + 2 = 4")];
        let (s, secs) = score_all(&r, &items).unwrap();
        assert_eq!(s, vec![vec![1.0, 0.1], vec![0.0, 0.0]]);
        assert_eq!(secs.len(), 2);
    }
}
