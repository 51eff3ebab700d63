//! `grpo export`: a checkpoint as a Hugging Face model directory (LoRA adapters merged into
//! their base with `--merge`), or any model `--model` takes (a GGUF included) as HF safetensors;
//! with `--format gguf`, as one GGUF file that llama.cpp and Ollama run.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

#[derive(Args, Debug)]
#[command(after_help = "Examples:\n  \
    grpo export --checkpoint runs/x/checkpoint-200 --merge --out merged/   # LoRA: base + adapters -> HF weights\n  \
    grpo export --checkpoint runs/x/checkpoint-200 --out adapter/          # LoRA: the PEFT adapter files only\n  \
    grpo export --checkpoint model.gguf --out hf/                           # dequantized HF copy of a GGUF\n  \
    grpo export --checkpoint runs/x --merge --dtype bf16 --max-shard-size 2GB --out merged/   # bf16, sharded\n  \
    grpo export --checkpoint runs/x --format gguf --out model.gguf          # llama.cpp / Ollama, f16\n  \
    grpo export --checkpoint runs/x --format gguf --outtype q8_0 --out model-q8_0.gguf")]
pub struct ExportArgs {
    /// A checkpoint directory (full weights, or a LoRA adapter: adapter_config.json), or any
    /// model `--model` takes (HF directory, .gguf file).
    #[arg(long)]
    checkpoint: PathBuf,
    /// Output directory (created; must not hold a model); with `--format gguf`, the file.
    #[arg(long)]
    out: PathBuf,
    /// `hf`: config.json + safetensors + tokenizer files, for transformers (and grpo).
    /// `gguf`: one file for llama.cpp and Ollama (and grpo); LoRA adapters are always merged.
    #[arg(long, default_value = "hf", value_parser = ["hf", "gguf"])]
    format: String,
    /// LoRA checkpoints: add the adapters into the base weights (`W + alpha/r B A`) so that
    /// transformers loads the result with no peft. Without it the adapter files are copied.
    /// A QLoRA run's base is quantized and dequantized first, as training saw it.
    #[arg(long)]
    merge: bool,
    /// LoRA checkpoints: the base model (default: the adapter's base_model_name_or_path).
    #[arg(long)]
    base: Option<String>,
    /// Weight type of the written model. hf: f32 (default), bf16 or f16 (config.json says
    /// which). gguf (also spelled --outtype, as llama.cpp's converter): f16 (default), q8_0,
    /// bf16 or f32 for the matrices; norms stay f32.
    #[arg(long, visible_alias = "outtype")]
    dtype: Option<String>,
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
    if a.format == "gguf" {
        return run_gguf(a);
    }
    let dtype = match a.dtype.as_deref().unwrap_or("f32") {
        "f32" | "float32" => candle_core::DType::F32,
        "bf16" | "bfloat16" => candle_core::DType::BF16,
        "f16" | "float16" => candle_core::DType::F16,
        "q8_0" => anyhow::bail!("--dtype q8_0 is for GGUF files: add --format gguf"),
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

fn run_gguf(a: ExportArgs) -> Result<()> {
    let spelled = a.dtype.as_deref().unwrap_or("f16");
    let outtype = grpo_models::gguf_write::GgufType::parse(spelled)
        .with_context(|| format!("--outtype {spelled}: use f16, q8_0, bf16 or f32"))?;
    if a.max_shard_size.is_some() {
        anyhow::bail!("--max-shard-size is for HF exports; a GGUF export is one file");
    }
    let (s, g) = grpo::export::export_gguf(&a.checkpoint, &a.out, a.base.as_deref(), outtype)
        .with_context(|| format!("cannot export {}", a.checkpoint.display()))?;
    if s.merged_adapters > 0 {
        eprintln!(
            "merged {} LoRA adapters into the base weights",
            s.merged_adapters
        );
    }
    if g.f16_fallbacks > 0 {
        eprintln!(
            "note: {} matrices whose rows are not whole 32-weight blocks were written as f16",
            g.f16_fallbacks
        );
    }
    for w in &g.warnings {
        eprintln!("warning: {w}");
    }
    if !g.has_tokenizer {
        eprintln!(
            "warning: the model has no tokenizer, so the file has none: grpo loads it, llama.cpp does not"
        );
    }
    println!("{}", s.out.display());
    Ok(())
}
