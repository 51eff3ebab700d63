//! `grpo export`: a checkpoint as a Hugging Face model directory (LoRA adapters merged into
//! their base with `--merge`), or any model `--model` takes (a GGUF included) as HF safetensors.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

#[derive(Args, Debug)]
#[command(after_help = "Examples:\n  \
    grpo export --checkpoint runs/x/checkpoint-200 --merge --out merged/   # LoRA: base + adapters -> HF weights\n  \
    grpo export --checkpoint runs/x/checkpoint-200 --out adapter/          # LoRA: the PEFT adapter files only\n  \
    grpo export --checkpoint model.gguf --out hf/                           # dequantized HF copy of a GGUF\n  \
    grpo export --checkpoint runs/x --merge --dtype bf16 --max-shard-size 2GB --out merged/   # bf16, sharded")]
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
    /// Weight dtype of the written model: f32, bf16 or f16 (config.json says which).
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Split the weights into shards of at most this size (e.g. 2GB, 500MB, as transformers'
    /// max_shard_size), with model.safetensors.index.json. Default: one file.
    #[arg(long)]
    max_shard_size: Option<String>,
}

/// "2GB", "500MB", "64KB" (decimal, as transformers reads them; GiB/MiB/KiB binary) or bytes.
fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let units: [(&str, u64); 7] = [
        ("GIB", 1 << 30),
        ("MIB", 1 << 20),
        ("KIB", 1 << 10),
        ("GB", 1_000_000_000),
        ("MB", 1_000_000),
        ("KB", 1_000),
        ("B", 1),
    ];
    let upper = t.to_ascii_uppercase();
    let (num, mult) = units
        .iter()
        .find_map(|(u, m)| upper.strip_suffix(u).map(|n| (n.trim().to_string(), *m)))
        .unwrap_or((upper.clone(), 1));
    let n: f64 = num
        .parse()
        .ok()
        .filter(|n: &f64| *n > 0.0)
        .with_context(|| {
            format!("--max-shard-size {s}: give a size such as 2GB, 500MB or a byte count")
        })?;
    Ok((n * mult as f64) as u64)
}

pub fn run(a: ExportArgs) -> Result<()> {
    let dtype = match a.dtype.as_str() {
        "f32" | "float32" => candle_core::DType::F32,
        "bf16" | "bfloat16" => candle_core::DType::BF16,
        "f16" | "float16" => candle_core::DType::F16,
        other => anyhow::bail!("--dtype {other}: use f32, bf16 or f16"),
    };
    let opts = grpo::export::ExportOptions {
        dtype,
        max_shard_bytes: a.max_shard_size.as_deref().map(parse_size).transpose()?,
    };
    let s = grpo::export::export(&a.checkpoint, &a.out, a.merge, a.base.as_deref(), &opts)
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
