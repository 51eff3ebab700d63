//! `grpo generate --tools`: sample episodes in which the model calls tools, to try a model with
//! tools by hand (the same episodes training samples, docs/agents.md).

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use grpo::agents::tools::{ToolHost, ToolSpec};
use grpo::agents::{Agent, AgentOptions};
use grpo::data::{Example, Prompt};
use grpo_models::models::CausalLm;
use grpo_models::sampler::SamplingParams;
use grpo_models::tokenizer::Tokenizer;

/// What `grpo generate --tools` was asked for.
pub struct ToolRun<'a> {
    pub tools: &'a [String],
    pub max_tool_calls: usize,
    pub max_new_tokens: usize,
    pub system: Option<&'a str>,
    /// Episodes per prompt.
    pub n: usize,
    pub seed: u64,
    pub json: bool,
    /// The model as `--model` named it, for messages.
    pub model: String,
}

/// `tok` with the chat template of `path`, when given.
pub fn with_template(tok: Tokenizer, path: Option<&PathBuf>) -> Result<Tokenizer> {
    let Some(p) = path else { return Ok(tok) };
    let text =
        std::fs::read_to_string(p).with_context(|| format!("--chat-template {}", p.display()))?;
    Ok(tok.with_chat_template(&text, &p.display().to_string())?)
}

/// Samples `a.n` episodes of each prompt with the tools of `a.tools` and prints them turn by
/// turn (or one JSON object per episode, with its messages, under `--json`).
pub fn run(
    a: &ToolRun<'_>,
    model: &CausalLm,
    tok: Tokenizer,
    prompts: Vec<Prompt>,
    params: &SamplingParams,
) -> Result<()> {
    let targets = a
        .tools
        .iter()
        .map(|t| grpo::rewards::command::python_target(t).map_err(anyhow::Error::msg))
        .collect::<Result<Vec<_>>>()
        .context("--tools")?;
    let host = ToolHost::start(ToolSpec::new(targets, None))?;
    let opts = AgentOptions {
        format: None,
        max_iterations: a.max_tool_calls,
        max_tokens: a.max_new_tokens * (a.max_tool_calls + 1),
        model: a.model.clone(),
        system_prompt: a.system.map(str::to_owned),
        max_prompt_length: None,
        environment: None,
    };
    let (agent, tok) = Agent::start(host, tok, &opts)?;
    let data: Vec<Example> = prompts
        .into_iter()
        .enumerate()
        .map(|(i, prompt)| Example {
            prompt,
            answer: None,
            metadata: Default::default(),
            origin: format!("prompt {i}"),
            tokens: None,
        })
        .collect();
    let ids = data
        .iter()
        .map(|ex| grpo::data::prompt_ids(&tok, ex, a.system, None))
        .collect::<grpo::Result<Vec<_>>>()?;
    let index: Vec<usize> = (0..data.len()).collect();
    let seeds: Vec<u64> = index
        .iter()
        .map(|&i| grpo_models::seeding::mix_seed(a.seed, i as u64))
        .collect();
    let (episodes, _) = agent.rollout(model, &index, ids, &seeds, a.n, params, &data)?;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    for (i, e) in episodes.iter().enumerate() {
        let Some(t) = &e.agent else { continue };
        if a.json {
            let line = serde_json::json!({
                "prompt_index": e.group,
                "sample_index": i % a.n.max(1),
                "messages": t.messages,
                "answer": e.text,
                "turns": t.turns,
                "tool_calls": t.tool_calls,
                "tool_errors": t.tool_errors,
                "cut": t.cut,
            });
            writeln!(out, "{line}")?;
            continue;
        }
        writeln!(
            out,
            "--- prompt {}, sample {} ({} turns, {} tool calls) ---",
            e.group,
            i % a.n.max(1),
            t.turns,
            t.tool_calls.len()
        )?;
        for m in &t.messages {
            let role = m["role"].as_str().unwrap_or("?");
            writeln!(out, "[{role}] {}", m["content"].as_str().unwrap_or(""))?;
        }
    }
    Ok(())
}
