//! `grpo export`: a checkpoint as a Hugging Face model directory (LoRA adapters merged into
//! their base with `--merge`), or any model `--model` takes (a GGUF included) as HF safetensors.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

#[derive(Args, Debug)]
#[command(after_help = "Examples:\n  \
    grpo export --checkpoint runs/x/checkpoint-200 --merge --out merged/   # LoRA: base + adapters -> HF weights\n  \
    grpo export --checkpoint runs/x/checkpoint-200 --out adapter/          # LoRA: the PEFT adapter files only\n  \
    grpo export --checkpoint model.gguf --out hf/                           # dequantized HF copy of a GGUF")]
pub struct ExportArgs {
    /// A checkpoint directory (full weights, or a LoRA adapter: adapter_config.json), or any
    /// model `--model` takes (HF directory, .gguf file).
    #[arg(long)]
    checkpoint: PathBuf,
    /// Output directory (created; must not hold a model).
    #[arg(long)]
    out: PathBuf,
    /// LoRA checkpoints: add the adapters into the base weights (`W + alpha/r B A`) so that
    /// transformers loads the result with no peft. Without it the adapter files are copied.
    /// A QLoRA run's base is quantized and dequantized first, as training saw it.
    #[arg(long)]
    merge: bool,
    /// LoRA checkpoints: the base model (default: the adapter's base_model_name_or_path).
    #[arg(long)]
    base: Option<String>,
}

pub fn run(a: ExportArgs) -> Result<()> {
    let s = grpo::export::export(&a.checkpoint, &a.out, a.merge, a.base.as_deref())
        .with_context(|| format!("cannot export {}", a.checkpoint.display()))?;
    if s.merged_adapters > 0 {
        eprintln!(
            "merged {} LoRA adapters into the base weights",
            s.merged_adapters
        );
    }
    let mut files = s.files.clone();
    files.sort();
    for f in files {
        println!("{}", f.display());
    }
    Ok(())
}
