//! Options shared by every command that loads a model.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use clap::Args;
use grpo_models::weights::LoadedModel;

#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// Model: a local HF directory (config.json + safetensors + tokenizer.json), a .gguf file, or a
    /// Hugging Face hub id (owner/name). Default: SmolLM2-135M-Instruct, fetched once and cached.
    #[arg(long, short = 'm')]
    pub model: Option<String>,
    /// Weight precision: f32 or bf16.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Device: auto (a GPU when this build has CUDA and one answers, else the CPU), cpu, or
    /// cuda / cuda:N when built with `--features cuda`.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// CPU threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
}

impl ModelArgs {
    pub fn dtype(&self) -> Result<DType> {
        match self.dtype.as_str() {
            "f32" | "float32" => Ok(DType::F32),
            "bf16" | "bfloat16" => Ok(DType::BF16),
            other => bail!("--dtype {other}: expected f32 or bf16"),
        }
    }

    /// The device `--device` names, as the config's `device` key reads it.
    pub fn device(&self) -> Result<Device> {
        let d = self.device.as_str();
        let spec: grpo::config::DeviceSpec = d
            .parse()
            .map_err(|e: String| anyhow::anyhow!("--device {d}: {e}"))?;
        let device = spec.device().with_context(|| format!("--device {d}"))?;
        tracing::debug!("device: {device:?} (--device {d})");
        Ok(device)
    }

    /// Sets the CPU thread count for candle and rayon; call before any tensor work.
    pub fn init_threads(&self) {
        if let Some(n) = self.threads {
            // Single-threaded at this point: nothing else reads the environment concurrently.
            std::env::set_var("RAYON_NUM_THREADS", n.to_string());
            let _ = rayon_global(n);
        }
    }

    /// Resolves, fetches if needed, and loads the model.
    pub fn load(&self) -> Result<LoadedModel> {
        self.init_threads();
        let dtype = self.dtype()?;
        let device = self.device()?;
        let source = grpo_models::hub::resolve_model(self.model.as_deref())?;
        let t0 = Instant::now();
        let m = grpo_models::weights::load_model(&source, dtype, &device)?;
        tracing::info!(
            "loaded {} ({}, {} layers, vocab {}) in {:.1}s",
            m.origin.display(),
            m.config.arch.name(),
            m.config.num_layers,
            m.config.vocab_size,
            t0.elapsed().as_secs_f64()
        );
        Ok(m)
    }
}

impl ModelArgs {
    /// The model to sample from, with its loaded base (tokenizer, EOS ids): like [`Self::load`],
    /// and a LoRA checkpoint directory (adapter_config.json) loads over its base.
    pub fn load_model(&self) -> Result<(grpo_models::models::CausalLm, LoadedModel)> {
        let is_adapter = self
            .model
            .as_deref()
            .is_some_and(|m| grpo::peft::is_adapter_dir(std::path::Path::new(m)));
        if !is_adapter {
            let m = self.load()?;
            let mut model = m.build()?;
            model.pack_for_decoding()?;
            return Ok((model, m));
        }
        self.init_threads();
        let (mut model, base) = grpo::export::load_for_inference(
            self.model.as_deref(),
            None,
            self.dtype()?,
            &self.device()?,
        )?;
        tracing::info!("loaded LoRA adapters over {}", base.origin.display());
        model.pack_for_decoding()?;
        Ok((model, base))
    }
}

fn rayon_global(n: usize) -> std::result::Result<(), String> {
    grpo_models::threads::set_global_threads(n).map_err(|e| e.to_string())
}

/// A command's trailing words after clap: the `--key=value` overrides, with the command's own
/// flags and options pulled out wherever they stand (clap stops at the first override, so
/// `grpo train --max_steps=4 --resume` must find `--resume` here).
#[derive(Debug, Default)]
pub struct Trailing {
    pub overrides: Vec<String>,
    /// The command's flags that were given (`resume`).
    pub flags: Vec<&'static str>,
    /// The command's options that were given, with their values (`config`).
    pub options: Vec<(&'static str, String)>,
}

impl Trailing {
    pub fn flag(&self, name: &str) -> bool {
        self.flags.contains(&name)
    }

    pub fn option(&self, name: &str) -> Option<&str> {
        self.options
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Splits `words` into overrides and the command's `flags` / `options`, as `trl grpo` parses
/// them: a key may be spelled with dashes (`--learning-rate`, as `--learning_rate`), and an
/// override's value may be the next word (`--temperature -1`, `--seed 3`) or, for a list, the
/// next words (`--reward_funcs accuracy_reward format_reward`, passed on as one comma-separated
/// value): the words after a `--key` without `=` that do not start with `--` are its value. A
/// word that is neither is an error naming it.
pub fn split_trailing(
    words: &[String],
    flags: &[&'static str],
    options: &[&'static str],
) -> Result<Trailing> {
    let mut out = Trailing::default();
    let mut i = 0;
    let is_value = |w: &String| !w.starts_with("--");
    while i < words.len() {
        let w = &words[i];
        let Some(body) = w.strip_prefix("--") else {
            bail!(
                "unexpected argument `{w}`: settings are given as --key=value (e.g. --learning_rate=1e-5)"
            );
        };
        let (name, inline) = match body.split_once('=') {
            Some((n, v)) => (n, Some(v.to_string())),
            None => (body, None),
        };
        let canon = name.replace('-', "_");
        let next = words.get(i + 1).filter(|w| is_value(w)).cloned();
        // Every value word after a `--key` without `=`: one for a scalar, several for a list.
        let values: Vec<&String> = words[i + 1..].iter().take_while(|w| is_value(w)).collect();
        if let Some(f) = flags.iter().find(|f| **f == canon) {
            if inline.is_some() {
                bail!("--{name} takes no value");
            }
            out.flags.push(f);
            i += 1;
        } else if let Some(o) = options.iter().find(|o| **o == canon) {
            let (value, used) = match (inline, next) {
                (Some(v), _) => (v, 1),
                (None, Some(v)) => (v, 2),
                (None, None) => bail!("--{name} needs a value: --{name} PATH"),
            };
            if out.option(o).is_some() {
                bail!("--{name} is given twice");
            }
            out.options.push((o, value));
            i += used;
        } else {
            match inline {
                Some(v) => {
                    out.overrides.push(format!("--{canon}={v}"));
                    i += 1;
                }
                None if values.is_empty() => {
                    out.overrides.push(format!("--{canon}"));
                    i += 1;
                }
                None => {
                    let joined: Vec<&str> = values.iter().map(|v| v.as_str()).collect();
                    out.overrides
                        .push(format!("--{canon}={}", joined.join(",")));
                    i += 1 + values.len();
                }
            }
        }
    }
    Ok(out)
}

/// The config file (`--config` before or among the overrides) and the trailing words, split as
/// [`split_trailing`] does with the command's `flags`.
pub fn config_and_trailing(
    config: Option<std::path::PathBuf>,
    words: &[String],
    flags: &[&'static str],
) -> Result<(Option<std::path::PathBuf>, Trailing)> {
    let t = split_trailing(words, flags, &["config"])?;
    let config = match (config, t.option("config")) {
        (Some(_), Some(_)) => bail!("--config is given twice"),
        (Some(c), None) => Some(c),
        (None, c) => c.map(std::path::PathBuf::from),
    };
    Ok((config, t))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn flags_and_options_anywhere_and_values_as_next_words() {
        let t = split_trailing(
            &words("--max_steps=4 --output_dir=x --resume --temperature -1 --config a.toml --seed 3 --use_peft"),
            &["resume"],
            &["config"],
        )
        .unwrap();
        assert!(t.flag("resume"));
        assert_eq!(t.option("config"), Some("a.toml"));
        assert_eq!(
            t.overrides,
            words("--max_steps=4 --output_dir=x --temperature=-1 --seed=3 --use_peft")
        );
        // As `trl grpo`: dashes in keys, a list as the next words.
        let t = split_trailing(
            &words("--learning-rate 1e-5 --reward_funcs accuracy_reward format_reward --log-completions"),
            &[],
            &[],
        )
        .unwrap();
        assert_eq!(
            t.overrides,
            words("--learning_rate=1e-5 --reward_funcs=accuracy_reward,format_reward --log_completions")
        );
        let e = split_trailing(&words("--seed=1 stray"), &[], &[]).unwrap_err();
        assert!(e.to_string().contains("unexpected argument `stray`"), "{e}");
        let e = split_trailing(&words("--config"), &[], &["config"]).unwrap_err();
        assert!(e.to_string().contains("--config needs a value"), "{e}");
        let e = split_trailing(&words("--resume=1"), &["resume"], &[]).unwrap_err();
        assert!(e.to_string().contains("takes no value"), "{e}");
    }
}
