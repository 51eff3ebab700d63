//! Using what training wrote: loading a checkpoint (full weights, or LoRA adapters over their
//! base) for sampling and evaluation, and `grpo export` (HF safetensors or one GGUF file for
//! llama.cpp, adapters merged).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

use crate::checkpoint::{resolve_run_dir, HfExport};
use crate::peft::{self, LoadedAdapter};
use crate::{Error, Result};
use grpo_models::gguf_write::{write_gguf, GgufSummary, GgufType};
use grpo_models::hub;
use grpo_models::models::{CausalLm, QuantProj, QuantType};
use grpo_models::weights::{load_model, LoadedModel};

/// The base quantization a LoRA checkpoint was trained on (its `config.toml`), if any.
pub fn checkpoint_base_quantization(dir: &Path) -> Result<Option<QuantType>> {
    let path = dir.join("config.toml");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(None);
    };
    let t: toml::Table =
        toml::from_str(&text).map_err(|e| Error::file(&path, format!("invalid TOML: {e}")))?;
    match t.get("base_quantization").and_then(|v| v.as_str()) {
        None | Some("none") => Ok(None),
        Some(s) => serde_json::from_value(serde_json::Value::String(s.into()))
            .map(Some)
            .map_err(|_| Error::file(&path, format!("unknown base_quantization `{s}`"))),
    }
}

/// The `model` a grpo checkpoint's `config.toml` trained on (`Some(None)`: the default model);
/// `None` when `dir` has no readable config.toml (not a grpo checkpoint).
fn checkpoint_model(dir: &Path) -> Option<Option<String>> {
    let text = std::fs::read_to_string(dir.join("config.toml")).ok()?;
    let v: toml::Value = toml::from_str(&text).ok()?;
    Some(v.get("model").and_then(|m| m.as_str()).map(str::to_owned))
}

/// The base model a LoRA adapter names (or `base_override`), loaded in f32.
fn load_base(
    dir: &Path,
    adapter: &LoadedAdapter,
    base_override: Option<&str>,
) -> Result<LoadedModel> {
    // A grpo checkpoint knows the model it trained on (`model` in its config.toml; unset: the
    // embedded default): that wins over `base_model_name_or_path`, which names the hub id of
    // hub and default models so that the adapter loads elsewhere.
    if base_override.is_none() {
        // (A relative path there that does not resolve from here falls through.)
        if let Some(Ok(source)) = checkpoint_model(dir).map(|m| hub::resolve_model(m.as_deref())) {
            return load_model(&source, DType::F32, &Device::Cpu);
        }
    }
    let spec = base_override
        .map(str::to_owned)
        .or_else(|| adapter.base_model.clone())
        .ok_or_else(|| {
            Error::file(
                dir.join(peft::ADAPTER_CONFIG),
                "names no base_model_name_or_path: give the base model with --base",
            )
        })?;
    let source = hub::resolve_model(Some(&spec)).map_err(|e| {
        Error::file(
            dir.join(peft::ADAPTER_CONFIG),
            format!("its base model `{spec}` cannot be loaded ({e}); give it with --base"),
        )
    })?;
    load_model(&source, DType::F32, &Device::Cpu)
}

/// A model to sample from: `spec` as `--model` takes it, or a LoRA checkpoint directory
/// (adapter_config.json), loaded over its base (`base_override` wins over the base the adapter
/// names) with the base quantized as it was in training. Returns the model and the loaded base
/// (tokenizer, EOS ids).
pub fn load_for_inference(
    spec: Option<&str>,
    base_override: Option<&str>,
    dtype: DType,
    device: &Device,
) -> Result<(CausalLm, LoadedModel)> {
    // A run directory stands for its best (else newest) checkpoint.
    let resolved = match spec {
        Some(s) if Path::new(s).is_dir() => Some(resolve_run_dir(Path::new(s))?),
        _ => None,
    };
    let resolved = resolved.as_ref().map(|p| p.to_string_lossy().into_owned());
    let spec = resolved.as_deref().or(spec);
    if let Some(dir) = spec.map(Path::new).filter(|p| peft::is_adapter_dir(p)) {
        let adapter = peft::load_peft(dir, device)?;
        let base = load_base(dir, &adapter, base_override)?;
        let mut model = base.build()?;
        if let Some(q) = checkpoint_base_quantization(dir)? {
            model.quantize_projections(q)?;
        }
        model.set_lora(&peft::adapters(&adapter.tensors, &adapter.config, None)?)?;
        return Ok((model, base));
    }
    let source = hub::resolve_model(spec)?;
    let base = load_model(&source, dtype, device)?;
    Ok((base.build()?, base))
}

/// What `grpo export` wrote.
#[derive(Debug)]
pub struct ExportSummary {
    pub out: PathBuf,
    /// Adapters merged into the base weights (0 for a full checkpoint).
    pub merged_adapters: usize,
    /// Files written.
    pub files: Vec<PathBuf>,
}

/// Replaces each projection weight by its quantize-dequantize round trip (what a QLoRA run's
/// frozen base computed with), so merged adapters sit on the weights they were trained on.
fn round_trip_quantization(
    tensors: &mut HashMap<String, Tensor>,
    model: &CausalLm,
    q: QuantType,
) -> Result<()> {
    for (module, _, _) in model.projection_shapes()? {
        let key = format!("{module}.weight");
        if let Some(w) = tensors.get(&key) {
            let w = if model.config().arch == grpo_models::models::Arch::Gpt2 {
                w.t()?
            } else {
                w.clone()
            };
            let mut d = QuantProj::quantize(&w, q)?.dequantize()?;
            if model.config().arch == grpo_models::models::Arch::Gpt2 {
                d = d.t()?.contiguous()?;
            }
            tensors.insert(key, d);
        }
    }
    Ok(())
}

/// `grpo export`: writes `checkpoint` as an HF model directory at `out`. A LoRA checkpoint is
/// merged into its base when `merge` (HF weights that transformers loads with no peft), else its
/// adapter files are copied. A full checkpoint (or any model `--model` takes, a GGUF included)
/// is written as HF safetensors.
pub fn export(
    checkpoint: &Path,
    out: &Path,
    merge: bool,
    base_override: Option<&str>,
    opts: &ExportOptions,
) -> Result<ExportSummary> {
    // A run directory stands for its best (else newest) checkpoint.
    let checkpoint = &resolve_run_dir(checkpoint)?;
    if out.join("model.safetensors").exists() || out.join(peft::ADAPTER_WEIGHTS).exists() {
        return Err(Error::file(
            out,
            "already holds a model; choose an empty directory",
        ));
    }
    if !merge && peft::is_adapter_dir(checkpoint) {
        // Read first, so that a broken adapter is refused rather than copied.
        peft::load_peft(checkpoint, &Device::Cpu)?;
        std::fs::create_dir_all(out)
            .map_err(|e| Error::file(out, format!("cannot create: {e}")))?;
        let mut files = vec![];
        for f in [
            peft::ADAPTER_CONFIG,
            peft::ADAPTER_WEIGHTS,
            "tokenizer.json",
            "tokenizer_config.json",
        ] {
            let src = checkpoint.join(f);
            if src.is_file() {
                let dst = out.join(f);
                std::fs::copy(&src, &dst)
                    .map_err(|e| Error::file(&dst, format!("cannot write: {e}")))?;
                files.push(dst);
            }
        }
        return Ok(ExportSummary {
            out: out.to_path_buf(),
            merged_adapters: 0,
            files,
        });
    }
    let (base, tensors, merged) = merged_weights(checkpoint, base_override)?;
    write_merged(out, &base, tensors, merged, opts)
}

/// The weights a checkpoint stands for, in HF names and f32: a full checkpoint's own (any model
/// `--model` takes), or a LoRA checkpoint's adapters merged into its base (quantized and
/// dequantized first where a QLoRA run trained on a quantized base). Returns the base (config,
/// tokenizer, EOS ids), the tensors and the number of adapters merged.
fn merged_weights(
    checkpoint: &Path,
    base_override: Option<&str>,
) -> Result<(LoadedModel, HashMap<String, Tensor>, usize)> {
    let device = Device::Cpu;
    if !peft::is_adapter_dir(checkpoint) {
        let spec = checkpoint.to_string_lossy().to_string();
        let base = load_model(&hub::resolve_model(Some(&spec))?, DType::F32, &device)?;
        let tensors = base.tensors.clone();
        return Ok((base, tensors, 0));
    }
    let adapter = peft::load_peft(checkpoint, &device)?;
    let base = load_base(checkpoint, &adapter, base_override)?;
    let mut tensors = base.tensors.clone();
    if let Some(q) = checkpoint_base_quantization(checkpoint)? {
        round_trip_quantization(&mut tensors, &base.build()?, q)?;
    }
    let adapters = peft::adapters(&adapter.tensors, &adapter.config, None)?;
    peft::merge_into(&mut tensors, &base.config, &adapters)?;
    Ok((base, tensors, adapters.len()))
}

/// `grpo export --format gguf`: writes `checkpoint` as one GGUF file at `out` that llama.cpp and
/// Ollama run, matrices as `outtype`. A LoRA checkpoint is always merged into its base (as
/// [`export`] with `merge`). The tokenizer goes into the file's metadata; a model without one is
/// written all the same (grpo loads it; llama.cpp needs a tokenizer) and the summary says so.
pub fn export_gguf(
    checkpoint: &Path,
    out: &Path,
    base_override: Option<&str>,
    outtype: GgufType,
) -> Result<(ExportSummary, GgufSummary)> {
    let checkpoint = &resolve_run_dir(checkpoint)?;
    if out.is_dir() {
        return Err(Error::file(
            out,
            "is a directory; a GGUF export is one file: give its path (e.g. model.gguf)",
        ));
    }
    if out.exists() {
        return Err(Error::file(out, "already exists; choose a new file name"));
    }
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::file(dir, format!("cannot create: {e}")))?;
    }
    let (base, tensors, merged) = merged_weights(checkpoint, base_override)?;
    let name = checkpoint
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    let g = write_gguf(
        out,
        &base.config,
        &tensors,
        base.tokenizer.as_ref(),
        &name,
        outtype,
    )?;
    Ok((
        ExportSummary {
            out: out.to_path_buf(),
            merged_adapters: merged,
            files: vec![out.to_path_buf()],
        },
        g,
    ))
}

/// How `grpo export` writes weights.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ExportOptions {
    /// f32 (default), bf16 or f16.
    pub dtype: DType,
    /// Split the weights into shards of at most this many bytes (with an index file).
    pub max_shard_bytes: Option<u64>,
}

impl Default for ExportOptions {
    fn default() -> Self {
        Self {
            dtype: DType::F32,
            max_shard_bytes: None,
        }
    }
}

fn write_merged(
    out: &Path,
    base: &LoadedModel,
    tensors: HashMap<String, Tensor>,
    merged: usize,
    opts: &ExportOptions,
) -> Result<ExportSummary> {
    let mut named: Vec<(String, Tensor)> = tensors.into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    std::fs::create_dir_all(out).map_err(|e| Error::file(out, format!("cannot create: {e}")))?;
    let generation = crate::checkpoint::source_generation_config(&base.origin);
    crate::checkpoint::write_hf_model_as(
        out,
        &HfExport {
            config: &base.config,
            tensors: &named,
            tokenizer: base.tokenizer.as_ref(),
            generation_config: generation.as_ref(),
            eos_token_ids: &base.eos_token_ids,
        },
        Some(opts.dtype),
        opts.max_shard_bytes,
    )?;
    let files = std::fs::read_dir(out)
        .map_err(|e| Error::file(out, format!("cannot list: {e}")))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    Ok(ExportSummary {
        out: out.to_path_buf(),
        merged_adapters: merged,
        files,
    })
}
