//! Writing a model as one GGUF file that llama.cpp (and so Ollama) runs: the inverse of
//! [`crate::weights`]' GGUF loader. HF names become llama.cpp's (`blk.N.attn_q`, ...), Llama's Q/K
//! rows take llama.cpp's interleaved RoPE order, the config becomes `<arch>.*` metadata and the
//! tokenizer `tokenizer.*` metadata. The container (GGUF v3: header, metadata, tensor infos,
//! 32-byte aligned data) is candle's writer; Q8_0 blocks are candle's quantizer.

use std::collections::HashMap;
use std::io::{Seek, SeekFrom, Write};
use std::path::Path;

use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{DType, Tensor};

use crate::models::config::{llama_cpp_gemma_query_scalar, llama_cpp_sliding_layers};
use crate::models::layers::rope_inv_freq;
use crate::models::{Arch, ModelConfig};
use crate::tokenizer::Tokenizer;
use crate::weights::{gguf_name, llama_cpp_permutes_qk};
use crate::{Error, Result};

/// The type of a GGUF file's weight matrices (llama.cpp's `--outtype`); norms, biases and other
/// 1-D tensors are always F32, as llama.cpp's converter writes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufType {
    F32,
    F16,
    Bf16,
    /// Blocks of 32 int8 weights and one f16 scale. A matrix whose rows are not a whole number
    /// of blocks is written as F16 instead.
    Q8_0,
}

impl GgufType {
    /// `f32`, `f16`, `bf16` or `q8_0`.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Self::F32,
            "f16" | "float16" => Self::F16,
            "bf16" | "bfloat16" => Self::Bf16,
            "q8_0" => Self::Q8_0,
            _ => return None,
        })
    }

    fn ggml(self) -> GgmlDType {
        match self {
            Self::F32 => GgmlDType::F32,
            Self::F16 => GgmlDType::F16,
            Self::Bf16 => GgmlDType::BF16,
            Self::Q8_0 => GgmlDType::Q8_0,
        }
    }

    /// llama.cpp's `general.file_type` (`LLAMA_FTYPE_*`).
    fn file_type(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q8_0 => 7,
            Self::Bf16 => 32,
        }
    }
}

/// What [`write_gguf`] wrote.
#[derive(Debug, Clone)]
pub struct GgufSummary {
    /// Tensors written.
    pub tensors: usize,
    /// Q8_0 only: matrices written as F16 because their rows are not whole 32-weight blocks.
    pub f16_fallbacks: usize,
    /// The tokenizer was written (llama.cpp needs one; grpo loads a file without).
    pub has_tokenizer: bool,
    /// What llama.cpp will run differently from transformers and grpo (a sliding window it
    /// ignores, a layer pattern it fixes), for the user to read.
    pub warnings: Vec<String>,
}

/// llama.cpp's Q/K row permutation (`[h, 2, d/2] -> [h, d/2, 2]` per head: HF's rotate-half
/// RoPE becomes interleaved pairs), as its converter applies it to Llama weights and biases.
/// [`crate::weights::unpermute_qk`] undoes it.
pub fn permute_qk(t: &Tensor, heads: usize) -> Result<Tensor> {
    let dims = t.dims().to_vec();
    let rows = dims[0];
    if heads == 0 || !rows.is_multiple_of(2 * heads) {
        return Err(Error::Model(format!(
            "cannot permute a tensor of shape {dims:?} for {heads} heads"
        )));
    }
    let half = rows / heads / 2;
    let rest: usize = dims[1..].iter().product();
    Ok(t.reshape((heads, 2, half, rest))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(dims)?)
}

/// GGUF metadata entries, in the order they are written.
type Metadata = Vec<(String, Value)>;

/// llama.cpp's architecture for a family: Mistral's files are `llama` ones (llama.cpp's
/// converter writes them so).
fn gguf_arch(arch: Arch) -> &'static str {
    match arch {
        Arch::Llama | Arch::Mistral => "llama",
        Arch::Qwen2 => "qwen2",
        Arch::Qwen3 => "qwen3",
        Arch::Phi3 => "phi3",
        Arch::Gemma2 => "gemma2",
        Arch::Gemma3 => "gemma3",
        Arch::Gpt2 => "gpt2",
    }
}

/// How much Gemma's queries are scaled in the file so that llama.cpp's fixed score scale
/// ([`llama_cpp_gemma_query_scalar`]) gives the model's own `query_pre_attn_scalar^-1/2`: 1 for
/// every released Gemma.
fn gemma_query_factor(config: &ModelConfig) -> Option<f64> {
    let own = config.extras.query_pre_attn_scalar?;
    let theirs = llama_cpp_gemma_query_scalar(
        config.arch,
        config.num_layers,
        config.hidden_size,
        config.num_heads,
        config.head_dim,
    );
    (own != theirs).then(|| (theirs / own).sqrt())
}

/// The `general.architecture` name and the model's `<arch>.*` metadata, and what llama.cpp will
/// run differently from grpo and transformers (warnings for the user: the file itself is exact,
/// and grpo loads it back as the model it is).
fn model_metadata(
    config: &ModelConfig,
    name: &str,
    outtype: GgufType,
) -> Result<(Metadata, Vec<String>)> {
    let arch = gguf_arch(config.arch);
    check_graph(config, arch)?;
    let gemma = matches!(config.arch, Arch::Gemma2 | Arch::Gemma3);
    let u = u32_value;
    let key = |k: &str| format!("{arch}.{k}");
    let extras = &config.extras;
    let mut warnings = vec![];
    // Phi-3's LongRoPE: the file keeps the long factors too when the source config has them, so
    // llama.cpp can run past the pretraining length as transformers does.
    let long_factor = long_rope_long_factor(config);
    let context = match (&extras.long_rope, &long_factor) {
        (Some(_), Some(_)) => source_usize(config, "max_position_embeddings")
            .unwrap_or(config.max_position_embeddings),
        _ => config.max_position_embeddings,
    };
    let mut md = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        ("general.name".into(), Value::String(name.into())),
        ("general.file_type".into(), Value::U32(outtype.file_type())),
        ("general.quantization_version".into(), Value::U32(2)),
        (key("vocab_size"), u(config.vocab_size)?),
        (key("context_length"), u(context)?),
        (key("embedding_length"), u(config.hidden_size)?),
        (key("block_count"), u(config.num_layers)?),
        (key("feed_forward_length"), u(config.intermediate_size)?),
        (key("attention.head_count"), u(config.num_heads)?),
        (key("attention.head_count_kv"), u(config.num_kv_heads)?),
    ];
    if config.arch == Arch::Gpt2 {
        md.push((
            key("attention.layer_norm_epsilon"),
            Value::F32(config.norm_eps as f32),
        ));
        return Ok((md, warnings));
    }
    md.extend([
        (key("attention.key_length"), u(config.head_dim)?),
        (key("attention.value_length"), u(config.head_dim)?),
        (
            key("rope.dimension_count"),
            u(extras.rotary_dim.unwrap_or(config.head_dim))?,
        ),
        (key("rope.freq_base"), Value::F32(config.rope_theta as f32)),
        (
            key("attention.layer_norm_rms_epsilon"),
            Value::F32(config.norm_eps as f32),
        ),
    ]);
    if let Some(f) = extras.rope_linear_factor {
        md.push((key("rope.scaling.type"), Value::String("linear".into())));
        md.push((key("rope.scaling.factor"), Value::F32(f as f32)));
    }
    if let Some(l) = &extras.long_rope {
        md.push((
            key("rope.scaling.original_context_length"),
            u(l.original_max_position_embeddings)?,
        ));
        md.push((
            key("rope.scaling.attn_factor"),
            Value::F32(l.attention_factor as f32),
        ));
    }
    let window = extras.sliding_window;
    if let Some(w) = window {
        md.push((key("attention.sliding_window"), u(w)?));
        let ignored = match config.arch {
            Arch::Mistral => Some("has no sliding window in its llama graph"),
            Arch::Phi3 => Some("turns Phi-3's sliding window off"),
            _ => None,
        };
        if let (Some(why), true) = (ignored, w < context) {
            warnings.push(format!(
                "llama.cpp {why}: past {w} tokens it attends to every earlier token, where \
                 transformers and grpo (which loads this file with its window) attend to the \
                 last {w}"
            ));
        }
    }
    if gemma {
        gemma_metadata(config, arch, context, &mut md, &mut warnings)?;
    }
    Ok((md, warnings))
}

/// What llama.cpp's graph for `arch` cannot hold: projection biases (but Qwen2's and GPT-2's), and
/// Gemma 2's own lm_head.
fn check_graph(config: &ModelConfig, arch: &str) -> Result<()> {
    let biases_ok = matches!(config.arch, Arch::Qwen2 | Arch::Gpt2);
    if !biases_ok && (config.mlp_bias || config.attention_bias) {
        return Err(Error::Model(format!(
            "GGUF export: llama.cpp's {arch} graph has no projection biases, and this model has some"
        )));
    }
    if config.arch == Arch::Gemma2 && !config.tie_word_embeddings {
        return Err(Error::Model(
            "GGUF export: llama.cpp's gemma2 graph ties the output layer to the embeddings, and this model has its own lm_head".into(),
        ));
    }
    Ok(())
}

/// `x` as GGUF's u32 metadata.
fn u32_value(x: usize) -> Result<Value> {
    u32::try_from(x)
        .map(Value::U32)
        .map_err(|_| Error::Model(format!("{x} does not fit GGUF's u32 metadata")))
}

/// Gemma 2's and 3's `<arch>.*` metadata (sliding window and its layer pattern, logit
/// soft-capping, Gemma 3's local RoPE base), appended to `md`, and what llama.cpp runs
/// differently, appended to `warnings`.
fn gemma_metadata(
    config: &ModelConfig,
    arch: &str,
    context: usize,
    md: &mut Metadata,
    warnings: &mut Vec<String>,
) -> Result<()> {
    let u = u32_value;
    let key = |k: &str| format!("{arch}.{k}");
    let extras = &config.extras;
    let window = extras.sliding_window;
    if window.is_none() {
        // llama.cpp's Gemma graphs always slide (Gemma 2 at 4096 when the file does not
        // say): a window as long as the context is none.
        md.push((key("attention.sliding_window"), u(context)?));
    }
    let sliding: Vec<bool> = match extras.sliding_layers.is_empty() {
        true => vec![false; config.num_layers],
        false => extras.sliding_layers.clone(),
    };
    if window.is_some() && sliding != llama_cpp_sliding_layers(config.arch, config.num_layers) {
        warnings.push(format!(
            "llama.cpp fixes which {arch} layers slide ({}); this model's are {:?}, which \
             the file records for grpo but llama.cpp ignores",
            match config.arch {
                Arch::Gemma2 => "every other one from the first",
                _ => "five of every six",
            },
            sliding
                .iter()
                .enumerate()
                .filter(|(_, &s)| s)
                .map(|(i, _)| i)
                .collect::<Vec<_>>()
        ));
    }
    md.push((
        key("attention.sliding_window_pattern"),
        Value::Array(sliding.into_iter().map(Value::Bool).collect()),
    ));
    for (k, cap) in [
        ("attn_logit_softcapping", extras.attn_softcap),
        ("final_logit_softcapping", extras.final_softcap),
    ] {
        match (cap, config.arch) {
            (Some(c), _) => md.push((key(k), Value::F32(c as f32))),
            (None, Arch::Gemma2) => warnings.push(format!(
                "this model has no {k}; llama.cpp's gemma2 graph applies its default"
            )),
            _ => {}
        }
    }
    if config.arch == Arch::Gemma3 {
        let local = extras.rope_local_theta.unwrap_or(10000.0);
        md.push((key("rope.freq_base_swa"), Value::F32(local as f32)));
        if local != 10000.0 {
            warnings.push(format!(
                "llama.cpp's gemma3 graph fixes the sliding layers' RoPE base at 10000; this \
                 model's is {local}"
            ));
        }
        if extras.attn_softcap.is_some() || extras.final_softcap.is_some() {
            warnings.push("llama.cpp's gemma3 graph has no logit soft-capping".into());
        }
    }
    Ok(())
}

/// A number from the source `config.json` (Phi-3's `max_position_embeddings`, which grpo caps).
fn source_usize(config: &ModelConfig, k: &str) -> Option<usize> {
    Some(config.extras.source.as_ref()?.get(k)?.as_u64()? as usize)
}

/// Phi-3's LongRoPE `long_factor`, from the source `config.json` (grpo itself runs the short
/// factors only).
fn long_rope_long_factor(config: &ModelConfig) -> Option<Vec<f32>> {
    config.extras.long_rope.as_ref()?;
    let src = config.extras.source.as_ref()?;
    let rope = ["rope_scaling", "rope_parameters"]
        .iter()
        .filter_map(|k| src.get(*k))
        .find(|r| r.get("long_factor").is_some())?;
    rope.get("long_factor")?
        .as_array()?
        .iter()
        .map(|x| x.as_f64().map(|x| x as f32))
        .collect()
}

/// Llama 3 RoPE scaling as llama.cpp takes it: per-frequency divisors in a `rope_freqs.weight`
/// tensor (`[head_dim / 2]`, F32), the plain inverse frequencies over the scaled ones.
fn rope_freqs(config: &ModelConfig) -> Result<Option<Tensor>> {
    let factors: Vec<f32> = match (&config.rope_freq_factors, config.rope_scaling) {
        (Some(f), _) => f.iter().map(|&x| x as f32).collect(),
        (None, Some(s)) => {
            let plain = rope_inv_freq(config.head_dim, config.rope_theta, None);
            let scaled = rope_inv_freq(config.head_dim, config.rope_theta, Some(s));
            plain
                .iter()
                .zip(&scaled)
                .map(|(p, s)| (p / s) as f32)
                .collect()
        }
        (None, None) => return Ok(None),
    };
    let n = factors.len();
    Ok(Some(Tensor::from_vec(
        factors,
        n,
        &candle_core::Device::Cpu,
    )?))
}

/// The 1-D F32 tensors that carry RoPE factors: Llama 3's scaling as `rope_freqs`, Phi-3's
/// LongRoPE as `rope_factors_short` (and `rope_factors_long` when the source config has them).
fn rope_factor_tensors(config: &ModelConfig) -> Result<Vec<(String, Tensor)>> {
    let cpu = candle_core::Device::Cpu;
    let mut out = vec![];
    if let Some(f) = rope_freqs(config)? {
        out.push(("rope_freqs.weight".to_string(), f));
    }
    if let Some(l) = &config.extras.long_rope {
        let short: Vec<f32> = l.short_factor.iter().map(|&x| x as f32).collect();
        let n = short.len();
        out.push((
            "rope_factors_short.weight".into(),
            Tensor::from_vec(short, n, &cpu)?,
        ));
        if let Some(long) = long_rope_long_factor(config).filter(|f| f.len() == n) {
            out.push((
                "rope_factors_long.weight".into(),
                Tensor::from_vec(long, n, &cpu)?,
            ));
        }
    }
    Ok(out)
}

/// Writes `config` + `tensors` (HF names and layout; any dtype) + `tokenizer` as a GGUF file at
/// `path` (through a temporary file beside it, renamed when complete). Matrices are written as
/// `outtype`, everything 1-D as F32. Without a tokenizer the file has no `tokenizer.*` metadata:
/// grpo loads it, llama.cpp does not. Each family's tensors take llama.cpp's form: Llama's and
/// Mistral's Q/K rows its RoPE order, Gemma's norms `1 + w` (and its queries the scale llama.cpp
/// cannot be told), GPT-2's Conv1D weights `[out, in]`.
pub fn write_gguf(
    path: &Path,
    config: &ModelConfig,
    tensors: &HashMap<String, Tensor>,
    tokenizer: Option<&Tokenizer>,
    name: &str,
    outtype: GgufType,
) -> Result<GgufSummary> {
    let (mut metadata, warnings) = model_metadata(config, name, outtype)?;
    if let Some(tok) = tokenizer {
        metadata.extend(tok.gguf_metadata(config.vocab_size)?);
        // The model's EOS when the tokenizer names none (generation_config.json's).
        if tok.eos_token_id().is_none() {
            if let Some(&eos) = config.eos_token_ids.first() {
                metadata.push(("tokenizer.ggml.eos_token_id".into(), Value::U32(eos)));
            }
        }
    }

    // llama.cpp's order: embeddings, blocks in order, final norm, output.
    let mut named: Vec<(String, &String, bool)> = Vec::with_capacity(tensors.len());
    for hf in tensors.keys() {
        if config.tie_word_embeddings && hf == "lm_head.weight" {
            continue;
        }
        let (g, conv1d) = gguf_name(config.arch, hf).ok_or_else(|| {
            Error::Model(format!("GGUF export: tensor `{hf}` has no llama.cpp name"))
        })?;
        named.push((g, hf, conv1d));
    }
    let rank = |g: &str| -> (usize, usize, String) {
        match g.strip_prefix("blk.").and_then(|r| r.split_once('.')) {
            Some((l, rest)) => (1, l.parse().unwrap_or(0), rest.to_owned()),
            None if g.starts_with("token_embd") || g.starts_with("position_embd") => {
                (0, 0, g.to_owned())
            }
            None => (2, 0, g.to_owned()),
        }
    };
    named.sort_by_key(|(g, _, _)| rank(g));

    let q_factor = gemma_query_factor(config);
    let mut qtensors: Vec<(String, QTensor)> = Vec::with_capacity(named.len() + 2);
    let mut f16_fallbacks = 0;
    for (g, hf, conv1d) in &named {
        let mut t = tensors[*hf]
            .to_device(&candle_core::Device::Cpu)?
            .to_dtype(DType::F32)?;
        if llama_cpp_permutes_qk(config.arch) {
            if hf.contains("self_attn.q_proj.") {
                t = permute_qk(&t, config.num_heads)?;
            } else if hf.contains("self_attn.k_proj.") {
                t = permute_qk(&t, config.num_kv_heads)?;
            }
        }
        if config.extras.norm_plus_one && hf.ends_with("norm.weight") {
            t = t.affine(1.0, 1.0)?;
        }
        if let Some(c) = q_factor {
            // Gemma 3 scales q through its norm (after which a scaled q_proj would not show),
            // Gemma 2 through q_proj.
            let q = match config.qk_norm {
                true => "self_attn.q_norm.weight",
                false => "self_attn.q_proj.weight",
            };
            if hf.ends_with(q) {
                t = t.affine(c, 0.0)?;
            }
        }
        if *conv1d {
            t = t.t()?.contiguous()?;
        }
        let ty = if t.rank() < 2 {
            GgmlDType::F32
        } else if outtype == GgufType::Q8_0
            && !t.dim(1)?.is_multiple_of(GgmlDType::Q8_0.block_size())
        {
            // As llama.cpp's converter does for rows that are not whole blocks.
            f16_fallbacks += 1;
            GgmlDType::F16
        } else {
            outtype.ggml()
        };
        let q = QTensor::quantize(&t.contiguous()?, ty)
            .map_err(|e| Error::Model(format!("GGUF export: cannot convert `{hf}`: {e}")))?;
        qtensors.push((g.clone(), q));
    }
    for (g, f) in rope_factor_tensors(config)? {
        qtensors.push((g, QTensor::quantize(&f, GgmlDType::F32)?));
    }

    let tmp = path.with_extension("gguf.partial");
    let write = || -> std::result::Result<(), Box<dyn std::error::Error>> {
        let mut f = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
        let md: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let ts: Vec<(&str, &QTensor)> = qtensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
        gguf_file::write(&mut f, &md, &ts)?;
        // candle stamps version 2; version 3 only added big-endian files, so a little-endian v2
        // file is byte for byte a v3 one. llama.cpp's own writer says 3.
        f.seek(SeekFrom::Start(4))?;
        f.write_all(&3u32.to_le_bytes())?;
        f.flush()?;
        f.get_ref().sync_all()?;
        Ok(())
    };
    if let Err(e) = write() {
        let _ = std::fs::remove_file(&tmp);
        return Err(Error::file(path, format!("cannot write: {e}")));
    }
    std::fs::rename(&tmp, path).map_err(|e| Error::file(path, format!("cannot write: {e}")))?;
    Ok(GgufSummary {
        tensors: qtensors.len(),
        f16_fallbacks,
        has_tokenizer: tokenizer.is_some(),
        warnings,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::{hf_name, unpermute_qk};
    use candle_core::Device;

    #[test]
    fn names_invert_the_readers() {
        for hf in [
            "model.embed_tokens.weight",
            "model.norm.weight",
            "lm_head.weight",
            "model.layers.11.input_layernorm.weight",
            "model.layers.0.self_attn.q_proj.bias",
            "model.layers.3.self_attn.k_norm.weight",
            "model.layers.2.mlp.down_proj.weight",
        ] {
            let (g, conv) = gguf_name(Arch::Llama, hf).unwrap();
            assert!(!conv);
            assert_eq!(
                hf_name(Arch::Llama, &g),
                Some((hf.to_owned(), false)),
                "{g}"
            );
        }
        assert_eq!(
            gguf_name(Arch::Llama, "model.layers.0.self_attn.q_proj.weight").unwrap(),
            ("blk.0.attn_q.weight".into(), false)
        );
        assert_eq!(
            gguf_name(Arch::Llama, "model.layers.x.mlp.up_proj.weight"),
            None
        );
        assert_eq!(gguf_name(Arch::Llama, "transformer.wte.weight"), None);
        // The other families' own names, both ways.
        for (arch, hf, g, conv) in [
            (
                Arch::Phi3,
                "model.layers.1.self_attn.qkv_proj.weight",
                "blk.1.attn_qkv.weight",
                false,
            ),
            (
                Arch::Phi3,
                "model.layers.0.mlp.gate_up_proj.weight",
                "blk.0.ffn_up.weight",
                false,
            ),
            (
                Arch::Gemma2,
                "model.layers.2.pre_feedforward_layernorm.weight",
                "blk.2.ffn_norm.weight",
                false,
            ),
            (
                Arch::Gemma2,
                "model.layers.2.post_attention_layernorm.weight",
                "blk.2.post_attention_norm.weight",
                false,
            ),
            (
                Arch::Gemma3,
                "model.layers.0.post_feedforward_layernorm.weight",
                "blk.0.post_ffw_norm.weight",
                false,
            ),
            (
                Arch::Gemma3,
                "model.layers.0.self_attn.k_norm.weight",
                "blk.0.attn_k_norm.weight",
                false,
            ),
            (
                Arch::Gpt2,
                "transformer.h.3.attn.c_attn.weight",
                "blk.3.attn_qkv.weight",
                true,
            ),
            (
                Arch::Gpt2,
                "transformer.h.3.attn.c_attn.bias",
                "blk.3.attn_qkv.bias",
                false,
            ),
            (
                Arch::Gpt2,
                "transformer.wpe.weight",
                "position_embd.weight",
                false,
            ),
        ] {
            assert_eq!(gguf_name(arch, hf), Some((g.to_owned(), conv)), "{hf}");
            assert_eq!(hf_name(arch, g), Some((hf.to_owned(), conv)), "{g}");
        }
        assert_eq!(
            gguf_name(Arch::Phi3, "model.layers.0.mlp.up_proj.weight"),
            None
        );
    }

    #[test]
    fn permute_is_undone_by_unpermute() {
        let w = Tensor::arange(0f32, 60.0, &Device::Cpu)
            .unwrap()
            .reshape((12, 5))
            .unwrap();
        let p = permute_qk(&w, 3).unwrap();
        assert_ne!(p.to_vec2::<f32>().unwrap(), w.to_vec2::<f32>().unwrap());
        let back = unpermute_qk(&p, 3).unwrap();
        assert_eq!(back.to_vec2::<f32>().unwrap(), w.to_vec2::<f32>().unwrap());
        let b = Tensor::arange(0f32, 12.0, &Device::Cpu).unwrap();
        let back = unpermute_qk(&permute_qk(&b, 2).unwrap(), 2).unwrap();
        assert_eq!(back.to_vec1::<f32>().unwrap(), b.to_vec1::<f32>().unwrap());
    }

    #[test]
    fn llama3_scaling_becomes_rope_freqs() {
        let mut c = ModelConfig {
            arch: Arch::Llama,
            vocab_size: 16,
            hidden_size: 32,
            intermediate_size: 64,
            num_layers: 1,
            num_heads: 2,
            num_kv_heads: 2,
            head_dim: 16,
            norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: None,
            rope_freq_factors: None,
            max_position_embeddings: 64,
            tie_word_embeddings: true,
            attention_bias: false,
            mlp_bias: false,
            qk_norm: false,
            bos_token_id: None,
            eos_token_ids: vec![],
            build_quantized: None,
            extras: Default::default(),
        };
        assert!(rope_freqs(&c).unwrap().is_none());
        c.rope_scaling = Some(crate::models::config::Llama3RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        });
        let f: Vec<f32> = rope_freqs(&c).unwrap().unwrap().to_vec1().unwrap();
        assert_eq!(f.len(), c.head_dim / 2);
        assert_eq!(f[0], 1.0);
        assert!((f[f.len() - 1] - 8.0).abs() < 1e-5, "{f:?}");
    }
}
