//! `grpo config`: every training key with its default and meaning, or a resolved config.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

use grpo::config::{reference, TrainConfig};

#[derive(Args, Debug)]
pub struct ConfigArgs {
    /// Print every key, its type, default and what it does.
    #[arg(long)]
    print: bool,
    /// Print the fully resolved config (defaults + file + overrides) as TOML.
    #[arg(long)]
    resolve: bool,
    /// Config file to resolve (.toml/.yaml); without it, the embedded default.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Overrides, `--key=value`.
    #[arg(value_name = "--KEY=VALUE", allow_hyphen_values = true, trailing_var_arg = true, num_args = 0..)]
    overrides: Vec<String>,
}

pub fn run(a: ConfigArgs) -> Result<()> {
    if a.resolve {
        let cfg = TrainConfig::load(a.config.as_deref(), &a.overrides)
            .context("invalid configuration")?;
        print!("{}", cfg.to_toml());
        return Ok(());
    }
    let keys = reference();
    let w_key = keys.iter().map(|k| k.key.len()).max().unwrap_or(0);
    let w_def = keys
        .iter()
        .map(|k| k.default.len().max(5))
        .max()
        .unwrap_or(0)
        .min(24);
    let mut section = "";
    for k in &keys {
        if k.section != section {
            section = k.section;
            println!("\n[{section}]");
        }
        let default = if k.default.is_empty() {
            "unset"
        } else {
            k.default
        };
        println!(
            "  {:w_key$}  {:w_def$}  {}  ({})",
            k.key, default, k.help, k.kind
        );
    }
    println!("\nTRL/HF keys such as bf16, report_to, gradient_checkpointing or use_vllm are accepted and ignored with a warning.");
    Ok(())
}
