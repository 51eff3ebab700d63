//! Options shared by every command that loads a model.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use clap::Args;
use grpo::weights::LoadedModel;

#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// Model: a local HF directory (config.json + safetensors + tokenizer.json), a .gguf file, or a
    /// Hugging Face hub id (owner/name). Default: SmolLM2-135M-Instruct, fetched once and cached.
    #[arg(long, short = 'm')]
    pub model: Option<String>,
    /// Weight precision: f32 or bf16.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Device: cpu, or cuda / cuda:N when built with `--features cuda`.
    #[arg(long, default_value = "cpu")]
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

    pub fn device(&self) -> Result<Device> {
        let d = self.device.as_str();
        if d == "cpu" {
            return Ok(Device::Cpu);
        }
        if let Some(rest) = d.strip_prefix("cuda") {
            let ordinal = match rest.strip_prefix(':') {
                Some(n) => n
                    .parse::<usize>()
                    .with_context(|| format!("--device {d}: bad GPU index"))?,
                None if rest.is_empty() => 0,
                None => bail!("--device {d}: expected cpu, cuda or cuda:N"),
            };
            if !candle_core::utils::cuda_is_available() {
                bail!("--device {d}: this grpo was built without CUDA; rebuild with `cargo build --release --features cuda`");
            }
            return Device::new_cuda(ordinal).with_context(|| format!("--device {d}"));
        }
        bail!("--device {d}: expected cpu, cuda or cuda:N")
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
        let source = grpo::hub::resolve_model(self.model.as_deref())?;
        let t0 = Instant::now();
        let m = grpo::weights::load_model(&source, dtype, &device)?;
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
    pub fn load_model(&self) -> Result<(grpo::models::CausalLm, LoadedModel)> {
        let is_adapter = self
            .model
            .as_deref()
            .is_some_and(|m| grpo::lora::is_adapter_dir(std::path::Path::new(m)));
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
    grpo::threads::set_global_threads(n).map_err(|e| e.to_string())
}
