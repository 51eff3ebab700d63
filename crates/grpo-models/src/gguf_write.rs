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

use crate::models::layers::rope_inv_freq;
use crate::models::{Arch, ModelConfig};
use crate::tokenizer::Tokenizer;
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
}

/// llama.cpp's name for an HF tensor name of a Llama-family model (the inverse of
/// [`crate::weights::hf_name`]).
pub fn gguf_name(hf: &str) -> Option<String> {
    let (stem, ext) = hf.rsplit_once('.')?;
    if ext != "weight" && ext != "bias" {
        return None;
    }
    let top = match stem {
        "model.embed_tokens" => Some("token_embd"),
        "model.norm" => Some("output_norm"),
        "lm_head" => Some("output"),
        _ => None,
    };
    if let Some(t) = top {
        return Some(format!("{t}.{ext}"));
    }
    let (layer, part) = stem.strip_prefix("model.layers.")?.split_once('.')?;
    layer.parse::<usize>().ok()?;
    let g = match part {
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => "ffn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        _ => return None,
    };
    Some(format!("blk.{layer}.{g}.{ext}"))
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

/// The `general.architecture` name and the model's `<arch>.*` metadata.
fn model_metadata(
    config: &ModelConfig,
    name: &str,
    outtype: GgufType,
) -> Result<Vec<(String, Value)>> {
    let arch = match config.arch {
        Arch::Llama => "llama",
        Arch::Qwen2 => "qwen2",
        Arch::Qwen3 => "qwen3",
        other => {
            return Err(Error::Model(format!(
                "GGUF export supports the Llama family (llama, qwen2, qwen3), not {}",
                other.name()
            )))
        }
    };
    if config.mlp_bias || (config.attention_bias && config.arch != Arch::Qwen2) {
        return Err(Error::Model(
            "GGUF export: llama.cpp's llama and qwen3 graphs have no projection biases, and this model has some".into(),
        ));
    }
    let u = |x: usize| -> Result<Value> {
        u32::try_from(x)
            .map(Value::U32)
            .map_err(|_| Error::Model(format!("{x} does not fit GGUF's u32 metadata")))
    };
    let key = |k: &str| format!("{arch}.{k}");
    Ok(vec![
        ("general.architecture".into(), Value::String(arch.into())),
        ("general.name".into(), Value::String(name.into())),
        ("general.file_type".into(), Value::U32(outtype.file_type())),
        ("general.quantization_version".into(), Value::U32(2)),
        (key("vocab_size"), u(config.vocab_size)?),
        (key("context_length"), u(config.max_position_embeddings)?),
        (key("embedding_length"), u(config.hidden_size)?),
        (key("block_count"), u(config.num_layers)?),
        (key("feed_forward_length"), u(config.intermediate_size)?),
        (key("attention.head_count"), u(config.num_heads)?),
        (key("attention.head_count_kv"), u(config.num_kv_heads)?),
        (key("attention.key_length"), u(config.head_dim)?),
        (key("attention.value_length"), u(config.head_dim)?),
        (key("rope.dimension_count"), u(config.head_dim)?),
        (key("rope.freq_base"), Value::F32(config.rope_theta as f32)),
        (
            key("attention.layer_norm_rms_epsilon"),
            Value::F32(config.norm_eps as f32),
        ),
    ])
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

/// Writes `config` + `tensors` (HF names and layout; any dtype) + `tokenizer` as a GGUF file at
/// `path` (through a temporary file beside it, renamed when complete). Matrices are written as
/// `outtype`, everything 1-D as F32. Without a tokenizer the file has no `tokenizer.*` metadata:
/// grpo loads it, llama.cpp does not.
pub fn write_gguf(
    path: &Path,
    config: &ModelConfig,
    tensors: &HashMap<String, Tensor>,
    tokenizer: Option<&Tokenizer>,
    name: &str,
    outtype: GgufType,
) -> Result<GgufSummary> {
    let mut metadata = model_metadata(config, name, outtype)?;
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
    let mut named: Vec<(String, &String)> = Vec::with_capacity(tensors.len());
    for hf in tensors.keys() {
        if config.tie_word_embeddings && hf == "lm_head.weight" {
            continue;
        }
        let g = gguf_name(hf).ok_or_else(|| {
            Error::Model(format!("GGUF export: tensor `{hf}` has no llama.cpp name"))
        })?;
        named.push((g, hf));
    }
    let rank = |g: &str| -> (usize, usize, String) {
        match g.strip_prefix("blk.").and_then(|r| r.split_once('.')) {
            Some((l, rest)) => (1, l.parse().unwrap_or(0), rest.to_owned()),
            None if g.starts_with("token_embd") => (0, 0, g.to_owned()),
            None => (2, 0, g.to_owned()),
        }
    };
    named.sort_by_key(|(g, _)| rank(g));

    let mut qtensors: Vec<(String, QTensor)> = Vec::with_capacity(named.len() + 1);
    let mut f16_fallbacks = 0;
    for (g, hf) in &named {
        let mut t = tensors[*hf]
            .to_device(&candle_core::Device::Cpu)?
            .to_dtype(DType::F32)?;
        if config.arch == Arch::Llama {
            if hf.contains("self_attn.q_proj.") {
                t = permute_qk(&t, config.num_heads)?;
            } else if hf.contains("self_attn.k_proj.") {
                t = permute_qk(&t, config.num_kv_heads)?;
            }
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
    if let Some(f) = rope_freqs(config)? {
        qtensors.push((
            "rope_freqs.weight".into(),
            QTensor::quantize(&f, GgmlDType::F32)?,
        ));
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
            let g = gguf_name(hf).unwrap();
            assert_eq!(
                hf_name(Arch::Llama, &g),
                Some((hf.to_owned(), false)),
                "{g}"
            );
        }
        assert_eq!(
            gguf_name("model.layers.0.self_attn.q_proj.weight").unwrap(),
            "blk.0.attn_q.weight"
        );
        assert_eq!(gguf_name("model.layers.x.mlp.up_proj.weight"), None);
        assert_eq!(gguf_name("transformer.wte.weight"), None);
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
