//! `grpo generate`: sample completions for prompts given on the command line or in a JSONL file.

use std::io::{BufRead, Write};
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use grpo_models::sampler::{self, PromptInput, SamplingParams};
use grpo_models::tokenizer::{ChatMessage, Tokenizer};

use crate::common::ModelArgs;

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// A prompt (repeatable).
    #[arg(long, short = 'p')]
    pub prompt: Vec<String>,
    /// A JSONL file of prompts: each line an object with "prompt" (a string) or "messages"
    /// (a list of {"role", "content"}; always rendered with the chat template).
    #[arg(long)]
    pub prompts: Option<PathBuf>,
    /// Render plain prompts as a user message with the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// System prompt added before the user message (implies --chat).
    #[arg(long)]
    pub system: Option<String>,
    /// Completions per prompt.
    #[arg(short = 'n', long = "num-samples", default_value_t = 1)]
    pub n: usize,
    #[arg(long, default_value_t = 256)]
    pub max_new_tokens: usize,
    /// Suppress EOS until this many tokens were generated.
    #[arg(long, default_value_t = 0)]
    pub min_new_tokens: usize,
    /// Sampling temperature; 0 = greedy.
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f64,
    /// Keep only the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Nucleus sampling mass (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f64,
    /// Drop tokens below min_p x the top token's probability (0 = off).
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f64,
    /// Penalise tokens already in the prompt or completion (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f64,
    /// Stop when the completion contains this string (repeatable; kept in the output).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Seed; each (prompt, sample) gets its own stream derived from it.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// A masked input for a masked-LM generator (repeatable): every mask token in it (`[MASK]`
    /// or `<mask>`, the tokenizer's) is filled at once; --model must be a *ForMaskedLM directory.
    #[arg(long)]
    pub fill: Vec<String>,
    /// Print one JSON object per completion instead of text.
    #[arg(long)]
    pub json: bool,
    /// Agents: a Python tool the model may call (repeatable): path/to/file.py:name or
    /// module.name. Each sample is then an episode of model and tool turns (docs/agents.md).
    #[arg(long)]
    pub tools: Vec<String>,
    /// A Jinja chat template file used instead of the model's (with --tools: one that renders
    /// `tools` and tool messages, e.g. examples/templates/chatml_tools.jinja).
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
    /// With --tools: turns that call tools, at most, per episode.
    #[arg(long, default_value_t = 5)]
    pub max_tool_calls: usize,
}

/// A prompt as read from the command line or a file.
pub enum PromptSpec {
    Text(String),
    Messages(Vec<ChatMessage>),
}

pub fn read_prompts_jsonl(path: &PathBuf) -> Result<Vec<PromptSpec>> {
    let f =
        std::fs::File::open(path).with_context(|| format!("{}: cannot open", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in std::io::BufReader::new(f).lines().enumerate() {
        let line =
            line.with_context(|| format!("{}: cannot read line {}", path.display(), i + 1))?;
        if line.trim().is_empty() {
            continue;
        }
        let where_ = || format!("{}:{}", path.display(), i + 1);
        let v: serde_json::Value =
            serde_json::from_str(&line).with_context(|| format!("{}: invalid JSON", where_()))?;
        if let Some(p) = v.get("prompt").and_then(|p| p.as_str()) {
            out.push(PromptSpec::Text(p.to_string()));
        } else if let Some(m) = v.get("messages") {
            let msgs: Vec<ChatMessage> = serde_json::from_value(m.clone()).with_context(|| {
                format!(
                    "{}: \"messages\" must be a list of {{\"role\", \"content\"}}",
                    where_()
                )
            })?;
            out.push(PromptSpec::Messages(msgs));
        } else {
            bail!(
                "{}: expected a \"prompt\" string or a \"messages\" list",
                where_()
            );
        }
    }
    Ok(out)
}

/// Token ids of a prompt, rendering the chat template where asked.
pub fn encode_prompt(
    tok: &Tokenizer,
    spec: &PromptSpec,
    chat: bool,
    system: Option<&str>,
) -> Result<Vec<u32>> {
    let messages = match spec {
        PromptSpec::Messages(m) => m.clone(),
        PromptSpec::Text(t) if chat || system.is_some() => {
            let mut m = Vec::new();
            if let Some(s) = system {
                m.push(ChatMessage {
                    role: "system".into(),
                    content: s.into(),
                });
            }
            m.push(ChatMessage {
                role: "user".into(),
                content: t.clone(),
            });
            m
        }
        PromptSpec::Text(t) => return Ok(tok.encode(t, true)?),
    };
    Ok(tok.encode_chat(&messages, true)?)
}

pub fn sampling_params(a: &GenerateArgs, eos: Vec<u32>) -> SamplingParams {
    SamplingParams {
        max_new_tokens: a.max_new_tokens,
        min_new_tokens: a.min_new_tokens,
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        repetition_penalty: a.repetition_penalty,
        stop_strings: a.stop.clone(),
        eos_token_ids: eos,
        max_batch_sequences: 0,
    }
}

pub fn run(a: GenerateArgs) -> Result<()> {
    if !a.fill.is_empty() {
        return run_fill(a);
    }
    let mut specs: Vec<PromptSpec> = a.prompt.iter().cloned().map(PromptSpec::Text).collect();
    if let Some(p) = &a.prompts {
        specs.extend(read_prompts_jsonl(p)?);
    }
    if specs.is_empty() {
        bail!("no prompts: pass --prompt TEXT or --prompts FILE.jsonl");
    }
    let params = sampling_params(&a, vec![]);
    params.validate()?;
    let (model, loaded) = a.model.load_model()?;
    let tok = loaded.tokenizer()?;
    if !a.tools.is_empty() {
        let tok = crate::generate_tools::with_template(tok.clone(), a.chat_template.as_ref())?;
        let params = SamplingParams {
            eos_token_ids: loaded.eos_token_ids.clone(),
            ..params
        };
        let run = crate::generate_tools::ToolRun {
            tools: &a.tools,
            max_tool_calls: a.max_tool_calls,
            max_new_tokens: a.max_new_tokens,
            system: a.system.as_deref(),
            n: a.n,
            seed: a.seed,
            json: a.json,
            model: a
                .model
                .model
                .clone()
                .unwrap_or_else(|| "SmolLM2-135M-Instruct".into()),
        };
        let prompts = specs
            .into_iter()
            .map(|s| match s {
                PromptSpec::Text(t) => grpo::data::Prompt::Text(t),
                PromptSpec::Messages(m) => grpo::data::Prompt::Messages(m),
            })
            .collect();
        return crate::generate_tools::run(&run, &model, tok, prompts, &params);
    }
    let params = SamplingParams {
        eos_token_ids: loaded.eos_token_ids.clone(),
        ..params
    };
    let mut inputs = Vec::with_capacity(specs.len());
    for (i, s) in specs.iter().enumerate() {
        let ids = encode_prompt(tok, s, a.chat, a.system.as_deref())
            .with_context(|| format!("prompt {i}"))?;
        if ids.is_empty() {
            bail!("prompt {i} is empty after tokenization");
        }
        inputs.push(PromptInput {
            ids,
            seed: grpo_models::seeding::mix_seed(a.seed, i as u64),
        });
    }
    let (groups, stats) = sampler::generate(&model, Some(tok), &inputs, a.n, &params)?;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    for (pi, group) in groups.iter().enumerate() {
        let prompt_text = tok.decode(&inputs[pi].ids, false)?;
        for (si, c) in group.iter().enumerate() {
            if a.json {
                let line = serde_json::json!({
                    "prompt_index": pi,
                    "sample_index": si,
                    "prompt": prompt_text,
                    "completion": c.text,
                    "completion_ids": c.ids,
                    "logprobs": c.logprobs,
                    "stop_reason": c.stop_reason,
                    "num_tokens": c.ids.len(),
                });
                writeln!(out, "{line}")?;
            } else {
                writeln!(
                    out,
                    "--- prompt {pi}, sample {si} ({} tokens, {:?}) ---\n{}",
                    c.ids.len(),
                    c.stop_reason,
                    c.text
                )?;
            }
        }
    }
    let decode_tps = stats.generated_tokens as f64 / stats.decode_s.max(1e-9);
    tracing::info!(
        "{} prompts x {} samples: {} tokens in {:.2}s ({:.1} tokens/s; prefill {:.2}s, sampling {:.2}s)",
        inputs.len(),
        a.n,
        stats.generated_tokens,
        stats.prefill_s + stats.decode_s,
        decode_tps,
        stats.prefill_s,
        stats.sample_s
    );
    Ok(())
}

/// `--fill`: every masked position of each input sampled at once by a masked-LM generator.
fn run_fill(a: GenerateArgs) -> Result<()> {
    if !a.prompt.is_empty() || a.prompts.is_some() {
        bail!("--fill samples fills of masked inputs; --prompt/--prompts are for causal LMs");
    }
    let params = SamplingParams {
        max_new_tokens: 1,
        ..sampling_params(&a, vec![])
    };
    params.validate()?;
    let Some(spec) = a.model.model.as_deref() else {
        bail!("--fill needs --model DIR: a masked-LM generator (BERT, RoBERTa, DistilBERT *ForMaskedLM)");
    };
    let dir = PathBuf::from(spec);
    if !dir.is_dir() {
        bail!("--model {spec}: a masked-LM generator is an HF directory (config.json, model.safetensors, tokenizer.json)");
    }
    let device = a.model.device()?;
    let (model, tok) = grpo::fill_in::load_generator(&dir, &device)?;
    let mut inputs = Vec::with_capacity(a.fill.len());
    for (i, text) in a.fill.iter().enumerate() {
        let ids = tok.encode(text, true)?;
        if !ids.contains(&model.mask_id) {
            // Only used in the message below.
            let mask = tok.id_to_token(model.mask_id).unwrap_or_default();
            bail!("--fill {i} ({text:?}) has no mask token: write {mask} where a token is to be filled");
        }
        inputs.push(PromptInput {
            ids,
            seed: grpo_models::seeding::mix_seed(a.seed, i as u64),
        });
    }
    use grpo::rollout::GroupSampler;
    let (groups, _) = model.sample_groups(&tok, &inputs, a.n, &params, &mut |_, _, _| Ok(()))?;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    for (pi, group) in groups.iter().enumerate() {
        for (si, c) in group.iter().enumerate() {
            if a.json {
                let fills: Vec<String> = c
                    .ids
                    .iter()
                    .map(|&t| {
                        tok.id_to_token(t).with_context(|| {
                            format!(
                                "--fill {pi}: the model chose token id {t}, which the tokenizer \
                                 in {} does not have: the model's vocab_size (config.json) is \
                                 larger than its tokenizer's; use a tokenizer.json that covers \
                                 every id",
                                dir.display()
                            )
                        })
                    })
                    .collect::<Result<_>>()?;
                let line = serde_json::json!({
                    "input_index": pi,
                    "sample_index": si,
                    "input": a.fill[pi],
                    "filled": c.text,
                    "fill_tokens": fills,
                    "fill_ids": c.ids,
                    "logprobs": c.logprobs,
                });
                writeln!(out, "{line}")?;
            } else {
                writeln!(out, "{}", c.text)?;
            }
        }
    }
    Ok(())
}
