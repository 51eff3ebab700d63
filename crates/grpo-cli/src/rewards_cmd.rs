//! `grpo rewards check`: score a file of completions with a run's configured rewards.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};

use crate::rewards_check::check_samples;
use grpo::config::TrainConfig;

#[derive(Subcommand, Debug)]
pub enum RewardsCommand {
    /// Score a file of completions with the config's [[rewards]] and print a table, to test
    /// rewards before training.
    #[command(
        after_help = "The samples file is JSONL, CSV or Parquet, read like a prompt dataset \
    (the config's prompt_field and answer_field; other fields go to the rewards as metadata) plus a \
    `completion` field with the text to score. Optional fields: `group` (an integer: rows of one \
    group, for group rewards such as diversity; without it, consecutive rows with the same prompt \
    form a group) and `completion_tokens` (token count for length rewards; without it, the config's \
    model tokenizer counts them). Example row:\n  \
    {\"prompt\": \"What is 2 + 2?\", \"answer\": \"4\", \"completion\": \"2 + 2 = 4\"}"
    )]
    Check(CheckArgs),
}

#[derive(Args, Debug)]
pub struct CheckArgs {
    /// Config file (.toml, .yaml) whose [[rewards]] to use; without it, the built-in task's rewards.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Completions to score (.jsonl, .csv or .parquet).
    #[arg(long)]
    samples: PathBuf,
    /// Print one JSON object per sample instead of the table.
    #[arg(long)]
    json: bool,
    /// Overrides, `--key=value`.
    #[arg(value_name = "--KEY=VALUE", allow_hyphen_values = true, trailing_var_arg = true, num_args = 0..)]
    overrides: Vec<String>,
}

pub fn run(cmd: RewardsCommand) -> Result<()> {
    let RewardsCommand::Check(a) = cmd;
    let (config, t) = crate::common::config_and_trailing(a.config, &a.overrides, &["json"])?;
    let json = a.json || t.flag("json");
    let cfg =
        TrainConfig::load(config.as_deref(), &t.overrides).context("invalid configuration")?;
    let report = check_samples(&cfg, &a.samples)?;
    if json {
        for line in report.json_lines() {
            println!("{line}");
        }
    } else {
        print!("{}", report.table());
    }
    Ok(())
}
