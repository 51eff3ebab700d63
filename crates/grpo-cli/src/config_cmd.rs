//! `grpo config`: every training key with its default and meaning, or a resolved config.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

use grpo::config::{ignored_trl_keys, reference, TrainConfig};

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
    let (config, t) =
        crate::common::config_and_trailing(a.config, &a.overrides, &["print", "resolve"])?;
    if a.resolve || t.flag("resolve") {
        let cfg =
            TrainConfig::load(config.as_deref(), &t.overrides).context("invalid configuration")?;
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
    println!("\n{}", ignored_note());
    Ok(())
}

/// The TRL/HF keys accepted and ignored with a warning, from the list the config uses (a
/// hand-written sentence here once named `report_to` and `gradient_checkpointing` long after
/// they became real keys).
fn ignored_note() -> String {
    let mut out =
        String::from("TRL/HF keys that do not apply here are accepted and ignored with a warning:");
    let mut line = String::new();
    for k in ignored_trl_keys()
        .iter()
        .copied()
        .chain(["vllm_*", "ddp_*", "dataloader_*"])
    {
        if !line.is_empty() && line.len() + k.len() + 2 > 96 {
            out.push_str(&format!("\n {line},"));
            line.clear();
        }
        if !line.is_empty() {
            line.push_str(", ");
        }
        line.push_str(k);
    }
    out.push_str(&format!("\n {line}."));
    out.push_str("\ndocs/config.md lists every TRL key with what grpo does with it.");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ignored_note_lists_exactly_the_ignored_keys() {
        let note = ignored_note();
        let listed: Vec<&str> = note
            .split_once(':')
            .map_or("", |(_, l)| l)
            .split_once("\ndocs/")
            .map_or("", |(l, _)| l)
            .split([',', '.', '\n', ' '])
            .filter(|w| !w.is_empty())
            .collect();
        assert!(
            listed.contains(&"fp16") && listed.contains(&"use_vllm"),
            "{note}"
        );
        for k in reference() {
            assert!(!listed.contains(&k.key), "{} is a real key: {note}", k.key);
        }
        assert_eq!(listed.len(), ignored_trl_keys().len() + 3, "{note}");
    }
}
