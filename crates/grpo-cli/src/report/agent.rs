//! Agent runs in the report: each logged episode turn by turn (the `messages`, `tool_errors` and
//! `cut` of an agent's `completions.jsonl` row, see `grpo::train` `log_completions`), and the
//! `agent/*` curves (`grpo::agents::round_metrics`) in a section of their own.

use std::collections::BTreeSet;

use serde::Serialize;
use serde_json::Value;

use grpo::train::names;

use super::plots::{line_plot, Line, PlotSpec};
use super::{mean, num, truncate_middle, JsonObject, Metrics, Sample};

/// The metrics of `grpo::agents::round_metrics`, each a mean over a step's episodes.
const AGENT_PREFIX: &str = "agent/";
const TURNS: &str = "agent/turns_per_episode";
const TOOL_CALLS: &str = "agent/tool_calls_per_episode";
const TOOL_ERRORS: &str = "agent/tool_errors_per_episode";
const TOOL_SECONDS: &str = "agent/tool_seconds_per_episode";
const TOOL_TOKENS: &str = "agent/tool_tokens_per_episode";
const CALLING: &str = "agent/episodes_calling_tools";
const CUT: &str = "agent/episodes_cut";
/// `agent/tool_calls/<tool>` and `agent/tool_errors/<kind>`.
const CALLS_BY_TOOL: &str = "agent/tool_calls/";
const ERRORS_BY_KIND: &str = "agent/tool_errors/";

// ---------------------------------------------------------------------------------- episodes

/// One message of an episode, in TRL's conversational form.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Message {
    role: String,
    /// A tool message's tool.
    name: String,
    content: String,
    /// An assistant's tool calls, each as `name(arguments)` (`grpo::agents::transcript::tool_call_text`).
    calls: Vec<String>,
}

/// What an agent's row of `completions.jsonl` adds to a completion.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct EpisodeLog {
    /// The episode after the prompt: assistant turns and tool results.
    messages: Vec<Message>,
    /// Kinds of the episode's tool errors (`parse`, `arguments`, ...).
    tool_errors: Vec<String>,
    /// The cap that ended the episode, if one did.
    cut: Option<String>,
}

/// A JSON value as text: a string as it is, null as nothing, anything else as JSON.
fn text_of(v: Option<&Value>) -> String {
    match v {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Null) | None => String::new(),
        Some(v) => v.to_string(),
    }
}

impl EpisodeLog {
    /// The episode of a row, or None for a row without `messages` (a single-turn completion).
    pub(super) fn parse(o: &JsonObject) -> Option<Self> {
        let messages = o.get("messages")?.as_array()?;
        let tool_errors = match o.get("tool_errors") {
            Some(Value::Array(a)) => a.iter().map(|v| text_of(Some(v))).collect(),
            _ => Vec::new(),
        };
        Some(Self {
            messages: messages.iter().map(Message::parse).collect(),
            tool_errors,
            cut: Some(text_of(o.get("cut"))).filter(|c| !c.is_empty()),
        })
    }
}

impl Message {
    fn parse(v: &Value) -> Self {
        let content = match v.get("content") {
            // Content parts (`[{"type": "text", "text": ...}]`): their texts.
            Some(Value::Array(parts)) => parts
                .iter()
                .map(|p| {
                    p.get("text")
                        .map_or_else(|| p.to_string(), |t| text_of(Some(t)))
                })
                .collect::<Vec<_>>()
                .join("\n"),
            c => text_of(c),
        };
        let calls = match v.get("tool_calls") {
            Some(Value::Array(cs)) => cs
                .iter()
                .map(grpo::agents::transcript::tool_call_text)
                .collect(),
            _ => Vec::new(),
        };
        let role = text_of(v.get("role"));
        Self {
            role: if role.is_empty() { "?".into() } else { role },
            name: text_of(v.get("name")),
            content,
            calls,
        }
    }

    fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.into(),
            name: String::new(),
            content: content.into(),
            calls: Vec::new(),
        }
    }
}

const ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];

/// `role: content` at the start of a line of a logged prompt.
fn role_line(line: &str) -> Option<(&'static str, &str)> {
    ROLES.iter().find_map(|&r| {
        let rest = line.strip_prefix(r)?.strip_prefix(':')?;
        Some((r, rest.strip_prefix(' ').unwrap_or(rest)))
    })
}

/// The logged prompt as messages: a conversational prompt is logged as `role: content` lines
/// (`grpo::data::prompt_text`), a text prompt is the user's message.
fn prompt_messages(prompt: &str) -> Vec<Message> {
    if prompt.lines().next().and_then(role_line).is_none() {
        return vec![Message::new("user", prompt)];
    }
    let mut out: Vec<Message> = Vec::new();
    for line in prompt.lines() {
        match (role_line(line), out.last_mut()) {
            (Some((role, content)), _) => out.push(Message::new(role, content)),
            (None, Some(m)) => {
                m.content.push('\n');
                m.content.push_str(line);
            }
            (None, None) => {}
        }
    }
    out
}

/// One message block of the page.
#[derive(Debug, Serialize)]
pub(super) struct MessageView {
    /// The CSS class: the role when it is a known one.
    class: &'static str,
    /// The role, and a tool message's tool.
    label: String,
    content: String,
    calls: Vec<String>,
    /// A tool message that reports an error (`Error: ...`).
    error: bool,
}

/// An episode as the page shows it: the prompt's messages, then the episode's.
#[derive(Debug, Serialize)]
pub(super) struct EpisodeView {
    messages: Vec<MessageView>,
    /// The tool errors' kinds, joined; empty when none.
    tool_errors: String,
    /// The cap that ended the episode; empty when none did.
    cut: String,
    /// The episode as one text (`completion`), cut in the middle.
    text: String,
}

fn message_view(m: &Message, head: usize, tail: usize) -> MessageView {
    let class = ROLES.into_iter().find(|&r| r == m.role).unwrap_or("other");
    let label = match (m.role.as_str(), m.name.is_empty()) {
        ("tool", false) => format!("tool · {}", m.name),
        _ => m.role.clone(),
    };
    MessageView {
        class,
        label,
        content: truncate_middle(&m.content, head, tail),
        calls: m
            .calls
            .iter()
            .map(|c| truncate_middle(c, 200, 100))
            .collect(),
        error: m.role == "tool" && m.content.trim_start().starts_with("Error"),
    }
}

/// The turn-by-turn view of a sample; a sample without messages shows its completion as the
/// assistant's one turn.
pub(super) fn episode_view(s: &Sample) -> EpisodeView {
    let mut messages: Vec<MessageView> = prompt_messages(&s.prompt)
        .iter()
        .map(|m| message_view(m, 300, 300))
        .collect();
    match &s.episode {
        Some(e) => messages.extend(e.messages.iter().map(|m| message_view(m, 700, 300))),
        None => messages.push(message_view(
            &Message::new("assistant", &s.completion),
            700,
            300,
        )),
    }
    let (tool_errors, cut) = s.episode.as_ref().map_or_else(Default::default, |e| {
        (e.tool_errors.join(", "), e.cut.clone().unwrap_or_default())
    });
    EpisodeView {
        messages,
        tool_errors,
        cut,
        text: truncate_middle(&s.completion, 700, 300),
    }
}

// ------------------------------------------------------------------------------------ curves

/// Whether the run logged any `agent/*` metric.
pub(super) fn is_agent_run(keys: &BTreeSet<&str>) -> bool {
    keys.iter().any(|k| k.starts_with(AGENT_PREFIX))
}

fn agent_plot(file: &'static str, title: &str, y_desc: &'static str, lines: Vec<Line>) -> PlotSpec {
    PlotSpec {
        agent: true,
        ..line_plot(file, title, y_desc, lines)
    }
}

/// The agent section's plots; none for a run without `agent/*` metrics.
pub(super) fn plot_specs(keys: &BTreeSet<&str>) -> Vec<PlotSpec> {
    if !is_agent_run(keys) {
        return Vec::new();
    }
    // Counts per tool and per kind are logged only in the steps that have some.
    let by = |prefix: &str, label: &str, total: &str| -> Vec<Line> {
        keys.iter()
            .filter_map(|k| k.strip_prefix(prefix))
            .map(|n| Line::new(format!("{label}{n}"), format!("{prefix}{n}")).zero_beside(total))
            .collect()
    };
    let mut calls = vec![
        Line::new("turns", TURNS),
        Line::new("tool calls", TOOL_CALLS),
    ];
    let per_tool = by(CALLS_BY_TOOL, "calls of ", TOOL_CALLS);
    if per_tool.len() > 1 {
        calls.extend(per_tool);
    }
    // The total last and dashed, so that a kind it coincides with stays visible.
    let mut errors = by(ERRORS_BY_KIND, "", TOOL_ERRORS);
    errors.push(Line::new("all kinds", TOOL_ERRORS).dashed());
    vec![
        agent_plot(
            "agent_calls.png",
            "Agent: turns and tool calls per episode",
            "per episode",
            calls,
        ),
        agent_plot(
            "agent_errors.png",
            "Agent: tool errors per episode, by kind",
            "per episode",
            errors,
        ),
        PlotSpec {
            unit_range: true,
            ..agent_plot(
                "agent_rates.png",
                "Agent: episodes calling tools, cut by a cap; eval accuracy",
                "fraction",
                vec![
                    Line::new("calling tools", CALLING),
                    Line::new("cut by a cap", CUT),
                    Line::new("eval accuracy", names::EVAL_ACCURACY).dashed(),
                ],
            )
        },
        agent_plot(
            "agent_tokens.png",
            "Agent: tokens per episode, the model's and the tools'",
            "tokens",
            vec![
                Line::new("model (mean length)", names::MEAN_LENGTH),
                Line::new("tools", TOOL_TOKENS),
            ],
        ),
        agent_plot(
            "agent_tool_time.png",
            "Agent: tool time per episode",
            "seconds",
            vec![Line::new("tool time", TOOL_SECONDS)],
        ),
    ]
}

/// One row of the agent section's table: a metric early and late in the run.
#[derive(Debug, Serialize)]
pub(super) struct AgentRow {
    label: &'static str,
    first: String,
    last: String,
}

/// The agent metrics' means over the first and the last `w` logged steps (`w` returned).
pub(super) fn summary(m: &Metrics) -> (usize, Vec<AgentRow>) {
    let rows = [
        ("turns per episode", TURNS),
        ("tool calls per episode", TOOL_CALLS),
        ("tool errors per episode", TOOL_ERRORS),
        ("share of episodes calling tools", CALLING),
        ("share of episodes cut by a cap", CUT),
        ("tool seconds per episode", TOOL_SECONDS),
    ];
    let n = m.values(TURNS).len();
    let w = (n / 5).clamp(1, 10);
    let out = rows
        .into_iter()
        .filter_map(|(label, key)| {
            let v: Vec<f64> = m.values(key).into_iter().map(|(_, v)| v).collect();
            let w = w.min(v.len());
            (w > 0).then(|| AgentRow {
                label,
                first: num(mean(&v[..w])),
                last: num(mean(&v[v.len() - w..])),
            })
        })
        .collect();
    (w, out)
}

#[cfg(test)]
mod tests {
    use super::super::plots::Kind;
    use super::*;
    use grpo::rollout::{AgentTrace, Episode};
    use grpo_models::sampler::StopReason;
    use serde_json::json;

    #[test]
    fn the_curves_read_the_names_the_agent_loop_logs() {
        // Through JSON, so that a field added to the trace does not break this test (both names
        // of the environment's rewards: serde ignores the one the trace does not have).
        let trace: AgentTrace = serde_json::from_value(json!({
            "sampled": [true, false], "messages": [], "turns": 2, "tool_calls": ["calculator"],
            "tool_errors": ["parse"], "tool_secs": 0.5, "env_reward": null, "env_rewards": [],
            "cut": "max_tool_calling_iterations"}))
        .unwrap();
        let episode = Episode {
            example: 0,
            group: 0,
            prompt_ids: vec![1],
            completion_ids: vec![2, 3],
            text: String::new(),
            stop_reason: StopReason::Eos,
            rewards: vec![],
            agent: Some(trace),
        };
        let logged: Vec<String> = grpo::agents::round_metrics(&[episode])
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        let read = [
            TURNS,
            TOOL_CALLS,
            TOOL_ERRORS,
            TOOL_SECONDS,
            TOOL_TOKENS,
            CALLING,
            CUT,
        ];
        for k in read {
            assert!(logged.iter().any(|l| l == k), "{k} not in {logged:?}");
        }
        assert!(
            logged.contains(&format!("{CALLS_BY_TOOL}calculator")),
            "{logged:?}"
        );
        assert!(
            logged.contains(&format!("{ERRORS_BY_KIND}parse")),
            "{logged:?}"
        );
        // Every name the loop logs is drawn by one of the agent plots.
        let keys: BTreeSet<&str> = logged.iter().map(String::as_str).collect();
        let drawn: Vec<String> = plot_specs(&keys)
            .iter()
            .flat_map(|s| match &s.kind {
                Kind::Lines(ls) => ls.iter().map(|l| l.key.clone()).collect(),
                _ => vec![],
            })
            .collect();
        for k in &logged {
            let per_tool = k.starts_with(CALLS_BY_TOOL); // drawn only with two tools or more
            assert!(per_tool || drawn.contains(k), "{k} is not drawn");
        }
    }

    #[test]
    fn a_run_without_agent_metrics_has_no_agent_plots() {
        let keys: BTreeSet<&str> = ["reward", "kl", "eval/accuracy"].into_iter().collect();
        assert!(plot_specs(&keys).is_empty());
    }

    #[test]
    fn a_logged_prompt_splits_into_its_messages() {
        let m = prompt_messages("system: Be brief.\nuser: What is\n12 * 3?");
        let roles: Vec<(&str, &str)> = m
            .iter()
            .map(|m| (m.role.as_str(), m.content.as_str()))
            .collect();
        assert_eq!(
            roles,
            [("system", "Be brief."), ("user", "What is\n12 * 3?")]
        );
        let text = prompt_messages("What is 12 * 3?\nuser: not a role here");
        assert_eq!(
            text,
            [Message::new(
                "user",
                "What is 12 * 3?\nuser: not a role here"
            )]
        );
    }

    #[test]
    fn an_episode_row_parses_and_a_plain_row_has_no_episode() {
        let row = json!({"messages": [
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "calc", "arguments": {"x": 1}}}]},
            {"role": "tool", "name": "calc", "content": "Error: boom"},
            {"content": [{"type": "text", "text": "part"}]}],
            "tool_errors": ["raised"], "cut": null});
        let e = EpisodeLog::parse(row.as_object().unwrap()).unwrap();
        assert_eq!(e.messages[0].calls, ["calc(x=1)"]);
        assert_eq!(
            (e.messages[1].name.as_str(), e.messages[2].role.as_str()),
            ("calc", "?")
        );
        assert_eq!(e.messages[2].content, "part");
        assert_eq!(
            (e.tool_errors.clone(), e.cut.clone()),
            (vec!["raised".into()], None)
        );
        let v = message_view(&e.messages[1], 10, 10);
        assert!(
            v.error && v.class == "tool" && v.label == "tool · calc",
            "{v:?}"
        );
        assert!(EpisodeLog::parse(json!({"completion": "x"}).as_object().unwrap()).is_none());
    }
}
