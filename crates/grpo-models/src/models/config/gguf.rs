//! A model configuration from GGUF metadata: the hyper-parameters under `<arch>.*`, and for
//! the later families (Mistral, Phi-3, Gemma 2/3) the `config.json` they would have, with
//! llama.cpp's defaults where the file is silent.

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file;

use super::*;
use crate::{Error, Result};

impl ModelConfig {
    /// Reads the model hyper-parameters from GGUF metadata (`<arch>.block_count`, ...).
    pub fn from_gguf(md: &HashMap<String, gguf_file::Value>, path: &Path) -> Result<Self> {
        Self::from_gguf_with_factors(md, path, None, None)
    }

    /// [`Self::from_gguf`] with Phi-3's LongRoPE factors, which GGUF keeps as tensors
    /// (`rope_factors_short` / `rope_factors_long`). Mistral (a `llama` file with a sliding
    /// window), Phi-3 and Gemma 2/3 files are read as llama.cpp reads them, into the `config.json`
    /// transformers would take for the same model, which is then read as any other.
    pub fn from_gguf_with_factors(
        md: &HashMap<String, gguf_file::Value>,
        path: &Path,
        short_factor: Option<&[f64]>,
        long_factor: Option<&[f64]>,
    ) -> Result<Self> {
        let arch_name = gguf_str(md, "general.architecture", path)?;
        let window_key = format!("{arch_name}.attention.sliding_window");
        let mistral = arch_name == "llama" && md.contains_key(&window_key);
        if mistral || matches!(arch_name.as_str(), "phi3" | "gemma2" | "gemma3") {
            let json = hf_json_from_gguf(md, &arch_name, path, short_factor, long_factor)?;
            return Self::from_hf_json(&json.to_string(), path);
        }
        let arch = match arch_name.as_str() {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            "gpt2" => Arch::Gpt2,
            other => {
                return Err(Error::file(
                    path,
                    format!(
                        "unsupported GGUF architecture `{other}`. Supported: {SUPPORTED_ARCHS}"
                    ),
                ))
            }
        };
        let key = |k: &str| format!("{arch_name}.{k}");
        let hidden = gguf_usize(md, &key("embedding_length"), path)?;
        let heads = gguf_usize(md, &key("attention.head_count"), path)?;
        let kv_heads = gguf_usize_opt(md, &key("attention.head_count_kv"))?.unwrap_or(heads);
        if heads == 0 || kv_heads == 0 || heads % kv_heads != 0 {
            return Err(Error::file(
                path,
                format!("head_count ({heads}) must be a positive multiple of head_count_kv ({kv_heads})"),
            ));
        }
        let head_dim = match gguf_usize_opt(md, &key("attention.key_length"))? {
            Some(d) => d,
            None => hidden / heads,
        };
        let vocab_size = gguf_vocab_size(md, &arch_name, path)?;
        let eos = gguf_usize_opt(md, "tokenizer.ggml.eos_token_id")?.map(|x| x as u32);
        let bos = gguf_usize_opt(md, "tokenizer.ggml.bos_token_id")?.map(|x| x as u32);
        let is_gpt2 = arch == Arch::Gpt2;
        let norm_key = if is_gpt2 {
            "attention.layer_norm_epsilon"
        } else {
            "attention.layer_norm_rms_epsilon"
        };
        Ok(ModelConfig {
            arch,
            vocab_size,
            hidden_size: hidden,
            intermediate_size: gguf_usize(md, &key("feed_forward_length"), path)?,
            num_layers: gguf_usize(md, &key("block_count"), path)?,
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim,
            norm_eps: gguf_f64_opt(md, &key(norm_key))?.unwrap_or(1e-5),
            rope_theta: gguf_f64_opt(md, &key("rope.freq_base"))?.unwrap_or(10000.0),
            rope_scaling: None,
            rope_freq_factors: None,
            max_position_embeddings: gguf_usize_opt(md, &key("context_length"))?.unwrap_or(2048),
            // Decided by the presence of `output.weight` when the tensors are loaded.
            tie_word_embeddings: true,
            attention_bias: is_gpt2 || arch == Arch::Qwen2,
            mlp_bias: is_gpt2,
            qk_norm: arch == Arch::Qwen3,
            bos_token_id: bos,
            eos_token_ids: eos.into_iter().collect(),
            build_quantized: None,
            extras: DecoderExtras {
                rope_linear_factor: gguf_linear_factor(md, &arch_name)?,
                ..DecoderExtras::default()
            },
        })
    }
}

/// The factor of linear RoPE scaling in GGUF metadata (`<arch>.rope.scaling.type = "linear"`).
fn gguf_linear_factor(
    md: &HashMap<String, gguf_file::Value>,
    arch_name: &str,
) -> Result<Option<f64>> {
    match md.get(&format!("{arch_name}.rope.scaling.type")) {
        Some(gguf_file::Value::String(t)) if t == "linear" => {
            gguf_f64_opt(md, &format!("{arch_name}.rope.scaling.factor"))
        }
        _ => Ok(None),
    }
}

/// `<arch>.vocab_size`, else the length of the tokenizer's token list.
fn gguf_vocab_size(
    md: &HashMap<String, gguf_file::Value>,
    arch_name: &str,
    path: &Path,
) -> Result<usize> {
    let key = format!("{arch_name}.vocab_size");
    if let Some(v) = gguf_usize_opt(md, &key)? {
        return Ok(v);
    }
    match md.get("tokenizer.ggml.tokens") {
        Some(v) => v
            .to_vec()
            .map(|v| v.len())
            .map_err(|e| Error::file(path, format!("tokenizer.ggml.tokens is not an array: {e}"))),
        None => Err(Error::file(
            path,
            format!("missing `{key}` and `tokenizer.ggml.tokens`"),
        )),
    }
}

/// The attention-score scale llama.cpp gives a Gemma 2/3 model, as `query_pre_attn_scalar`
/// (scores are scaled by its inverse square root). llama.cpp keeps no key for it: it takes
/// `hidden / heads` for the 27B models (which it knows by their layer count) and `head_dim` for
/// every other, which is what each released Gemma's config says.
pub fn llama_cpp_gemma_query_scalar(
    arch: Arch,
    layers: usize,
    hidden: usize,
    heads: usize,
    head_dim: usize,
) -> f64 {
    let is_27b = match arch {
        Arch::Gemma2 => layers == 46,
        Arch::Gemma3 => layers == 62,
        _ => false,
    };
    match is_27b {
        true => (hidden / heads.max(1)) as f64,
        false => head_dim as f64,
    }
}

/// The layers llama.cpp makes sliding when a file does not list them: every other one from the
/// first (Gemma 2), five of every six (Gemma 3).
pub fn llama_cpp_sliding_layers(arch: Arch, layers: usize) -> Vec<bool> {
    let every = match arch {
        Arch::Gemma2 => 2,
        _ => 6,
    };
    (0..layers).map(|i| i % every < every - 1).collect()
}

/// The `config.json` of a Mistral (`llama` with a sliding window), Phi-3 or Gemma 2/3 GGUF file,
/// with llama.cpp's defaults where the file is silent.
fn hf_json_from_gguf(
    md: &HashMap<String, gguf_file::Value>,
    arch_name: &str,
    path: &Path,
    short_factor: Option<&[f64]>,
    long_factor: Option<&[f64]>,
) -> Result<serde_json::Value> {
    use serde_json::json;
    let key = |k: &str| format!("{arch_name}.{k}");
    let hidden = gguf_usize(md, &key("embedding_length"), path)?;
    let heads = gguf_usize(md, &key("attention.head_count"), path)?;
    let layers = gguf_usize(md, &key("block_count"), path)?;
    let head_dim = match gguf_usize_opt(md, &key("attention.key_length"))? {
        Some(d) => d,
        None => hidden / heads.max(1),
    };
    let context = gguf_usize_opt(md, &key("context_length"))?.unwrap_or(2048);
    let theta = gguf_f64_opt(md, &key("rope.freq_base"))?.unwrap_or(10000.0);
    let window = gguf_usize_opt(md, &key("attention.sliding_window"))?;
    let mut v = json!({
        "vocab_size": gguf_vocab_size(md, arch_name, path)?,
        "hidden_size": hidden,
        "intermediate_size": gguf_usize(md, &key("feed_forward_length"), path)?,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": gguf_usize_opt(md, &key("attention.head_count_kv"))?.unwrap_or(heads),
        "head_dim": head_dim,
        "rms_norm_eps": gguf_f64_opt(md, &key("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-6),
        "rope_theta": theta,
        "max_position_embeddings": context,
        // Set from the presence of `output.weight` once the tensors are read.
        "tie_word_embeddings": true,
        "bos_token_id": gguf_usize_opt(md, "tokenizer.ggml.bos_token_id")?,
        "eos_token_id": gguf_usize_opt(md, "tokenizer.ggml.eos_token_id")?,
        "dtype": "float32",
    });
    let arch = match arch_name {
        "phi3" => Arch::Phi3,
        "gemma2" => Arch::Gemma2,
        "gemma3" => Arch::Gemma3,
        _ => Arch::Mistral,
    };
    let (class, model_type) = match arch {
        Arch::Phi3 => ("Phi3ForCausalLM", "phi3"),
        Arch::Gemma2 => ("Gemma2ForCausalLM", "gemma2"),
        Arch::Gemma3 => ("Gemma3ForCausalLM", "gemma3_text"),
        _ => ("MistralForCausalLM", "mistral"),
    };
    v["architectures"] = json!([class]);
    v["model_type"] = json!(model_type);
    if let Some(f) = gguf_linear_factor(md, arch_name)? {
        v["rope_scaling"] = json!({"rope_type": "linear", "factor": f, "rope_theta": theta});
    }
    match arch {
        Arch::Mistral => {
            v["hidden_act"] = json!("silu");
            v["sliding_window"] = json!(window);
        }
        Arch::Phi3 => {
            v["hidden_act"] = json!("silu");
            v["sliding_window"] = json!(window);
            phi3_rope_from_gguf(
                &mut v,
                md,
                arch_name,
                (head_dim, context, theta),
                short_factor,
                long_factor,
            )?;
        }
        _ => gemma_from_gguf(
            &mut v,
            md,
            arch_name,
            arch,
            (layers, hidden, heads, head_dim),
            window,
            path,
        )?,
    }
    Ok(v)
}

fn gguf_str(md: &HashMap<String, gguf_file::Value>, key: &str, path: &Path) -> Result<String> {
    match md.get(key) {
        Some(gguf_file::Value::String(s)) => Ok(s.clone()),
        Some(v) => Err(Error::file(
            path,
            format!("metadata `{key}` should be a string, found {v:?}"),
        )),
        None => Err(Error::file(path, format!("missing metadata key `{key}`"))),
    }
}

/// Any integer-typed GGUF value as usize.
pub fn gguf_value_usize(v: &gguf_file::Value) -> Option<usize> {
    use gguf_file::Value as V;
    match *v {
        V::U8(x) => Some(x as usize),
        V::U16(x) => Some(x as usize),
        V::U32(x) => Some(x as usize),
        V::U64(x) => Some(x as usize),
        V::I8(x) if x >= 0 => Some(x as usize),
        V::I16(x) if x >= 0 => Some(x as usize),
        V::I32(x) if x >= 0 => Some(x as usize),
        V::I64(x) if x >= 0 => Some(x as usize),
        _ => None,
    }
}

fn gguf_usize_opt(md: &HashMap<String, gguf_file::Value>, key: &str) -> Result<Option<usize>> {
    match md.get(key) {
        None => Ok(None),
        Some(v) => gguf_value_usize(v)
            .map(Some)
            .ok_or_else(|| Error::Model(format!("GGUF metadata `{key}` is not an integer: {v:?}"))),
    }
}

fn gguf_usize(md: &HashMap<String, gguf_file::Value>, key: &str, path: &Path) -> Result<usize> {
    gguf_usize_opt(md, key)?
        .ok_or_else(|| Error::file(path, format!("missing metadata key `{key}`")))
}

fn gguf_f64_opt(md: &HashMap<String, gguf_file::Value>, key: &str) -> Result<Option<f64>> {
    use gguf_file::Value as V;
    match md.get(key) {
        None => Ok(None),
        Some(V::F32(x)) => Ok(Some(*x as f64)),
        Some(V::F64(x)) => Ok(Some(*x)),
        Some(v) => Err(Error::Model(format!(
            "GGUF metadata `{key}` is not a float: {v:?}"
        ))),
    }
}

/// Phi-3's partial rotary factor and its `longrope` scaling (from the factors' tensors) into
/// `v`, from the GGUF metadata.
fn phi3_rope_from_gguf(
    v: &mut serde_json::Value,
    md: &HashMap<String, gguf_file::Value>,
    arch_name: &str,
    (head_dim, context, theta): (usize, usize, f64),
    short_factor: Option<&[f64]>,
    long_factor: Option<&[f64]>,
) -> Result<()> {
    use serde_json::json;
    let key = |k: &str| format!("{arch_name}.{k}");
    let rotary = gguf_usize_opt(md, &key("rope.dimension_count"))?.unwrap_or(head_dim);
    v["partial_rotary_factor"] = json!(rotary as f64 / head_dim as f64);
    if let Some(short) = short_factor {
        let original =
            gguf_usize_opt(md, &key("rope.scaling.original_context_length"))?.unwrap_or(context);
        let mut rope = json!({
            "rope_type": "longrope",
            "rope_theta": theta,
            "short_factor": short,
            "long_factor": long_factor.unwrap_or(short),
            "original_max_position_embeddings": original,
        });
        if let Some(a) = gguf_f64_opt(md, &key("rope.scaling.attn_factor"))? {
            rope["attention_factor"] = json!(a);
        }
        v["rope_scaling"] = rope;
        v["original_max_position_embeddings"] = json!(original);
    }
    Ok(())
}

/// Gemma 2/3's keys into `v`, from the GGUF metadata with llama.cpp's defaults: the
/// activation, the query scalar, the sliding window and which layers slide, softcapping and
/// Gemma 3's local RoPE base.
fn gemma_from_gguf(
    v: &mut serde_json::Value,
    md: &HashMap<String, gguf_file::Value>,
    arch_name: &str,
    arch: Arch,
    (layers, hidden, heads, head_dim): (usize, usize, usize, usize),
    window: Option<usize>,
    path: &Path,
) -> Result<()> {
    use serde_json::json;
    let key = |k: &str| format!("{arch_name}.{k}");
    v["hidden_activation"] = json!("gelu_pytorch_tanh");
    v["query_pre_attn_scalar"] = json!(llama_cpp_gemma_query_scalar(
        arch, layers, hidden, heads, head_dim
    ));
    let window = match (window, arch) {
        (Some(w), _) => w,
        // llama.cpp's default for Gemma 2; Gemma 3 files must say.
        (None, Arch::Gemma2) => 4096,
        (None, _) => gguf_usize(md, &key("attention.sliding_window"), path)?,
    };
    v["sliding_window"] = json!(window);
    let sliding = match md.get(&key("attention.sliding_window_pattern")) {
        None => llama_cpp_sliding_layers(arch, layers),
        Some(gguf_file::Value::Array(a)) => a
            .iter()
            .map(|x| x.to_bool().map_err(|e| Error::file(path, e.to_string())))
            .collect::<Result<Vec<bool>>>()?,
        Some(n) => {
            let every = gguf_value_usize(n).filter(|&n| n > 0).ok_or_else(|| {
                Error::file(
                    path,
                    format!(
                        "`{}` is neither a layer list nor a period",
                        key("attention.sliding_window_pattern")
                    ),
                )
            })?;
            (0..layers).map(|i| i % every < every - 1).collect()
        }
    };
    let types: Vec<&str> = sliding
        .iter()
        .map(|&s| match s {
            true => "sliding_attention",
            false => "full_attention",
        })
        .collect();
    v["layer_types"] = json!(types);
    let (attn_cap, final_cap) = match arch {
        // llama.cpp's defaults for Gemma 2; Gemma 3 has none.
        Arch::Gemma2 => (Some(50.0), Some(30.0)),
        _ => (None, None),
    };
    v["attn_logit_softcapping"] =
        json!(gguf_f64_opt(md, &key("attn_logit_softcapping"))?.or(attn_cap));
    v["final_logit_softcapping"] =
        json!(gguf_f64_opt(md, &key("final_logit_softcapping"))?.or(final_cap));
    if arch == Arch::Gemma3 {
        v["rope_local_base_freq"] =
            json!(gguf_f64_opt(md, &key("rope.freq_base_swa"))?.unwrap_or(10000.0));
    }
    Ok(())
}
