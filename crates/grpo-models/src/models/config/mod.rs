//! One model configuration for every supported architecture, read either from an HF `config.json`
//! or from GGUF metadata. Architecture differences are resolved here, once, into plain fields
//! (`attention_bias`, `qk_norm`, `tie_word_embeddings`, ...) so the model code never compares strings.

use std::path::Path;

use serde::Deserialize;

use crate::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Llama 2/3.x, SmolLM2, TinyLlama, Mistral-style decoders.
    Llama,
    /// Qwen2 / Qwen2.5: Llama plus q/k/v biases.
    Qwen2,
    /// Qwen3: Llama plus RMSNorm on q and k per head, explicit head_dim.
    Qwen3,
    /// GPT-2: learned positions, LayerNorm, GELU, fused c_attn.
    Gpt2,
    /// Mistral: Llama plus a sliding attention window on every layer.
    Mistral,
    /// Phi-3 / Phi-4-mini: Llama with fused `qkv_proj` and `gate_up_proj`, partial RoPE.
    Phi3,
    /// Gemma 2: (1 + w) RMSNorm, scaled embeddings, GeGLU, sandwich norms, logit softcapping,
    /// sliding window on alternating layers.
    Gemma2,
    /// Gemma 3 (text): Gemma 2 plus q/k norms and a local RoPE base on the sliding layers.
    Gemma3,
}

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Gpt2 => "gpt2",
            Arch::Mistral => "mistral",
            Arch::Phi3 => "phi3",
            Arch::Gemma2 => "gemma2",
            Arch::Gemma3 => "gemma3_text",
        }
    }

    /// Whether `model_type` names a causal LM family grpo loads.
    pub fn is_causal_model_type(model_type: &str) -> bool {
        Self::from_model_type(model_type).is_some()
    }

    fn from_model_type(model_type: &str) -> Option<Arch> {
        match model_type {
            "llama" | "smollm" | "smollm2" => Some(Arch::Llama),
            "mistral" => Some(Arch::Mistral),
            "phi3" => Some(Arch::Phi3),
            "gemma2" => Some(Arch::Gemma2),
            "gemma3_text" => Some(Arch::Gemma3),
            "qwen2" => Some(Arch::Qwen2),
            "qwen3" => Some(Arch::Qwen3),
            "gpt2" => Some(Arch::Gpt2),
            _ => None,
        }
    }
}

pub const SUPPORTED_ARCHS: &str = "llama (Llama 2/3.x, SmolLM2, TinyLlama), qwen2, qwen3, gpt2, \
     mistral, phi3 (Phi-3, Phi-4-mini), gemma2, gemma3_text (Gemma3ForCausalLM)";

/// The MLP's activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Activation {
    /// SwiGLU (`silu`).
    #[default]
    Silu,
    /// GeGLU with the tanh approximation (`gelu_pytorch_tanh`, Gemma).
    GeluTanh,
}

/// Phi-3's LongRoPE (`rope_type = "longrope"`) as transformers computes it for sequences up to
/// `original_max_position_embeddings`: inverse frequencies divided by `short_factor`, cos and sin
/// times `attention_factor`. Longer sequences would take `long_factor` for the whole sequence;
/// grpo instead caps the model's positions at `original_max_position_embeddings`.
#[derive(Debug, Clone, PartialEq)]
pub struct LongRope {
    pub short_factor: Vec<f64>,
    pub attention_factor: f64,
    pub original_max_position_embeddings: usize,
}

/// What the newer decoder families add to the Llama layout, all off by default (so Llama, Qwen
/// and GPT-2 leave it at `Default`). Read once from `config.json`; the model code reads fields.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DecoderExtras {
    /// Keys more than `window - 1` positions before a query are masked on the layers that
    /// `sliding_layers` marks (Mistral: all; Gemma 2/3: `layer_types`).
    pub sliding_window: Option<usize>,
    /// Per layer: whether it attends through the window (and takes `rope_local_theta`).
    pub sliding_layers: Vec<bool>,
    /// RoPE base of the sliding layers (Gemma 3's `rope_local_base_freq`).
    pub rope_local_theta: Option<f64>,
    /// Leading dims of each head that RoPE rotates (`partial_rotary_factor`; Phi-4-mini);
    /// `None`: all of them.
    pub rotary_dim: Option<usize>,
    /// Phi-3's LongRoPE, within the pretraining length (see [`LongRope`]).
    pub long_rope: Option<LongRope>,
    /// Linear RoPE scaling (`rope_type = "linear"`, Gemma 3 4B and larger): positions divided by
    /// this factor, on Gemma 3's global layers only (its sliding layers have their own base).
    pub rope_linear_factor: Option<f64>,
    /// q/k/v and gate/up are single HF tensors `qkv_proj` / `gate_up_proj` (Phi-3).
    pub fused_proj_names: bool,
    /// RMSNorm scales by `1 + w` (Gemma).
    pub norm_plus_one: bool,
    /// Embeddings are multiplied by this (Gemma: sqrt(hidden_size)).
    pub embed_scale: Option<f64>,
    pub activation: Activation,
    /// Norms on the attention and MLP outputs before the residual adds (Gemma 2/3:
    /// `post_attention_layernorm`, `pre_feedforward_layernorm`, `post_feedforward_layernorm`).
    pub sandwich_norms: bool,
    /// Attention scores are scaled by `query_pre_attn_scalar^-1/2` instead of `head_dim^-1/2`.
    pub query_pre_attn_scalar: Option<f64>,
    /// `cap * tanh(score / cap)` on attention scores (Gemma 2).
    pub attn_softcap: Option<f64>,
    /// `cap * tanh(logit / cap)` on the LM head's logits (Gemma 2).
    pub final_softcap: Option<f64>,
    /// The `config.json` read, written back as it was by checkpoints of these families.
    pub source: Option<serde_json::Value>,
}

/// Llama 3.x RoPE frequency scaling (`rope_scaling.rope_type = "llama3"`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// RMSNorm eps (Llama family) or LayerNorm eps (GPT-2).
    pub norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// Per-frequency divisors from a GGUF `rope_freqs.weight` (Llama 3.1 GGUFs store the Llama 3
    /// scaling this way instead of in metadata).
    pub rope_freq_factors: Option<Vec<f64>>,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry a bias (Qwen2, or Llama with `attention_bias`).
    pub attention_bias: bool,
    /// o_proj and MLP projections carry a bias (Llama `mlp_bias` only).
    pub mlp_bias: bool,
    /// Per-head RMSNorm on q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// A build option, not part of config.json: projections are quantized to this type as the
    /// model is built (a frozen QLoRA base), so their f32 weights are never all held at once.
    pub build_quantized: Option<super::QuantType>,
    /// Mistral, Phi-3 and Gemma's additions ([`DecoderExtras`]).
    pub extras: DecoderExtras,
}

/// The raw `config.json` keys we read. Unknown keys are ignored: HF configs carry many that do not
/// matter for the forward pass.
#[derive(Debug, Deserialize)]
struct RawHfConfig {
    model_type: Option<String>,
    architectures: Option<Vec<String>>,
    vocab_size: Option<usize>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<serde_json::Value>,
    rope_parameters: Option<serde_json::Value>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    bos_token_id: Option<serde_json::Value>,
    eos_token_id: Option<serde_json::Value>,
    hidden_act: Option<String>,
    hidden_activation: Option<String>,
    sliding_window: Option<usize>,
    layer_types: Option<Vec<String>>,
    sliding_window_pattern: Option<usize>,
    rope_local_base_freq: Option<f64>,
    partial_rotary_factor: Option<f64>,
    original_max_position_embeddings: Option<usize>,
    query_pre_attn_scalar: Option<f64>,
    attn_logit_softcapping: Option<f64>,
    final_logit_softcapping: Option<f64>,
    use_bidirectional_attention: Option<bool>,
    // GPT-2 names.
    n_embd: Option<usize>,
    n_layer: Option<usize>,
    n_head: Option<usize>,
    n_inner: Option<usize>,
    n_positions: Option<usize>,
    layer_norm_epsilon: Option<f64>,
    activation_function: Option<String>,
}

/// `eos_token_id` may be an int, a list of ints or null.
pub fn token_ids_from_json(v: Option<&serde_json::Value>) -> Vec<u32> {
    match v {
        Some(serde_json::Value::Number(n)) => {
            // A number that is no token id (negative) names none, as in a list below.
            n.as_u64().map(|x| vec![x as u32]).unwrap_or_default()
        }
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64().map(|x| x as u32))
            .collect(),
        _ => vec![],
    }
}

fn need<T>(v: Option<T>, key: &str, path: &Path) -> Result<T> {
    v.ok_or_else(|| Error::file(path, format!("missing key `{key}` in config.json")))
}

impl ModelConfig {
    /// The parameter count of the blocks' projections and the embedding (norms and biases left
    /// out): what sizes a model's training state.
    pub fn approx_params(&self) -> u64 {
        let (h, i) = (self.hidden_size as u64, self.intermediate_size as u64);
        let q = (self.num_heads * self.head_dim) as u64;
        let kv = (self.num_kv_heads * self.head_dim) as u64;
        let block = h * q + 2 * h * kv + q * h + 3 * h * i;
        self.num_layers as u64 * block + self.vocab_size as u64 * h
    }

    /// Reads an HF `config.json`.
    pub fn from_hf_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::file(path, format!("cannot read: {e}")))?;
        Self::from_hf_json(&text, path)
    }

    /// Parses the text of an HF `config.json`; `path` is used in error messages only.
    pub fn from_hf_json(text: &str, path: &Path) -> Result<Self> {
        let raw: RawHfConfig = serde_json::from_str(text)
            .map_err(|e| Error::file(path, format!("invalid JSON: {e}")))?;
        // No model_type: the architectures decide, else the error below.
        let model_type = raw.model_type.clone().unwrap_or_default();
        let arch = hf_arch(&raw, &model_type, path)?;
        let eos_token_ids = token_ids_from_json(raw.eos_token_id.as_ref());
        let bos_token_id = token_ids_from_json(raw.bos_token_id.as_ref())
            .first()
            .copied();
        if arch == Arch::Gpt2 {
            return gpt2_from_hf(&raw, bos_token_id, eos_token_ids, path);
        }
        let gemma = matches!(arch, Arch::Gemma2 | Arch::Gemma3);
        let activation = hf_activation(&raw, arch, path)?;
        let hidden = need(raw.hidden_size, "hidden_size", path)?;
        let heads = need(raw.num_attention_heads, "num_attention_heads", path)?;
        let kv_heads = raw.num_key_value_heads.unwrap_or(heads);
        if heads == 0 || kv_heads == 0 || heads % kv_heads != 0 {
            return Err(Error::file(
                path,
                format!(
                    "num_attention_heads ({heads}) must be a positive multiple of num_key_value_heads ({kv_heads})"
                ),
            ));
        }
        let head_dim = match raw.head_dim {
            Some(d) => d,
            None if hidden % heads == 0 => hidden / heads,
            None => {
                return Err(Error::file(
                    path,
                    format!("hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads}) and head_dim is not set"),
                ))
            }
        };
        // transformers 5 moved rope_theta/rope_scaling into `rope_parameters`.
        let rope_params = raw.rope_parameters.as_ref();
        let rope_theta = raw
            .rope_theta
            .or_else(|| rope_params?.get("rope_theta")?.as_f64())
            .unwrap_or(10000.0);
        // Gemma 3 keeps one RoPE dict per layer type.
        let global_params = rope_params.and_then(|p| p.get("full_attention"));
        let local_params = rope_params.and_then(|p| p.get("sliding_attention"));
        let rope_params = global_params.or(rope_params);
        let rope_theta = global_params
            .and_then(|p| p.get("rope_theta")?.as_f64())
            .unwrap_or(rope_theta);
        let scaling = raw.rope_scaling.as_ref().or(rope_params);
        let long_rope = match arch {
            Arch::Phi3 => parse_long_rope(&raw, scaling, path)?,
            _ => None,
        };
        let rope_scaling = match long_rope {
            Some(_) => None,
            None => parse_rope_scaling(scaling, path)?,
        };
        let extras = decoder_extras(&raw, arch, head_dim, rope_params, local_params, text, path)?;
        let max_position_embeddings = match &long_rope {
            Some(l) => l.original_max_position_embeddings,
            None => raw.max_position_embeddings.unwrap_or(2048),
        };
        if let (Some(l), Some(d)) = (&long_rope, extras.rotary_dim.or(Some(head_dim))) {
            if l.short_factor.len() != d / 2 {
                return Err(Error::file(
                    path,
                    format!(
                        "longrope short_factor has {} entries for {d} rotary dims (want {})",
                        l.short_factor.len(),
                        d / 2
                    ),
                ));
            }
        }
        let rope_linear_factor = match long_rope {
            Some(_) => None,
            None => parse_linear_factor(scaling, path)?,
        };
        let extras = DecoderExtras {
            activation,
            long_rope,
            rope_linear_factor,
            ..extras
        };
        Ok(ModelConfig {
            arch,
            vocab_size: need(raw.vocab_size, "vocab_size", path)?,
            hidden_size: hidden,
            intermediate_size: need(raw.intermediate_size, "intermediate_size", path)?,
            num_layers: need(raw.num_hidden_layers, "num_hidden_layers", path)?,
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim,
            norm_eps: raw.rms_norm_eps.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            rope_freq_factors: None,
            max_position_embeddings,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(gemma),
            attention_bias: arch == Arch::Qwen2 || raw.attention_bias.unwrap_or(false),
            mlp_bias: raw.mlp_bias.unwrap_or(false),
            qk_norm: matches!(arch, Arch::Qwen3 | Arch::Gemma3),
            bos_token_id,
            eos_token_ids,
            build_quantized: None,
            extras,
        })
    }

    /// The HF `config.json` for this model (transformers 5 layout), so that a checkpoint written
    /// from any source (a GGUF included) loads in transformers and back here.
    pub fn to_hf_json(&self) -> Result<serde_json::Value> {
        use serde_json::json;
        let eos = match self.eos_token_ids.as_slice() {
            [] => serde_json::Value::Null,
            [one] => json!(one),
            many => json!(many),
        };
        if self.rope_freq_factors.is_some() && self.rope_scaling.is_none() {
            return Err(Error::Model(
                "this model's per-frequency RoPE factors (GGUF rope_freqs) have no config.json form".into(),
            ));
        }
        if let Some(source) = &self.extras.source {
            return Ok(source.clone());
        }
        Ok(match self.arch {
            Arch::Mistral | Arch::Phi3 | Arch::Gemma2 | Arch::Gemma3 => {
                return Err(Error::Model(format!(
                    "a {} model read from elsewhere than config.json has no config.json form",
                    self.arch.name()
                )))
            }
            Arch::Gpt2 => json!({
                "architectures": ["GPT2LMHeadModel"],
                "model_type": "gpt2",
                "vocab_size": self.vocab_size,
                "n_embd": self.hidden_size,
                "n_layer": self.num_layers,
                "n_head": self.num_heads,
                "n_inner": self.intermediate_size,
                "n_positions": self.max_position_embeddings,
                "layer_norm_epsilon": self.norm_eps,
                "activation_function": "gelu_new",
                "tie_word_embeddings": self.tie_word_embeddings,
                "bos_token_id": self.bos_token_id,
                "eos_token_id": eos,
                "dtype": "float32",
            }),
            arch => {
                let mut rope = json!({"rope_type": "default", "rope_theta": self.rope_theta});
                if let Some(f) = self.extras.rope_linear_factor {
                    rope =
                        json!({"rope_type": "linear", "factor": f, "rope_theta": self.rope_theta});
                }
                if let Some(r) = &self.rope_scaling {
                    rope = json!({
                        "rope_type": "llama3",
                        "rope_theta": self.rope_theta,
                        "factor": r.factor,
                        "low_freq_factor": r.low_freq_factor,
                        "high_freq_factor": r.high_freq_factor,
                        "original_max_position_embeddings": r.original_max_position_embeddings,
                    });
                }
                let (class, model_type) = match arch {
                    Arch::Qwen2 => ("Qwen2ForCausalLM", "qwen2"),
                    Arch::Qwen3 => ("Qwen3ForCausalLM", "qwen3"),
                    _ => ("LlamaForCausalLM", "llama"),
                };
                let mut v = json!({
                    "architectures": [class],
                    "model_type": model_type,
                    "vocab_size": self.vocab_size,
                    "hidden_size": self.hidden_size,
                    "intermediate_size": self.intermediate_size,
                    "num_hidden_layers": self.num_layers,
                    "num_attention_heads": self.num_heads,
                    "num_key_value_heads": self.num_kv_heads,
                    "head_dim": self.head_dim,
                    "hidden_act": "silu",
                    "rms_norm_eps": self.norm_eps,
                    "rope_theta": self.rope_theta,
                    "rope_parameters": rope,
                    "max_position_embeddings": self.max_position_embeddings,
                    "tie_word_embeddings": self.tie_word_embeddings,
                    "bos_token_id": self.bos_token_id,
                    "eos_token_id": eos,
                    "dtype": "float32",
                });
                if arch == Arch::Llama {
                    v["attention_bias"] = json!(self.attention_bias);
                    v["mlp_bias"] = json!(self.mlp_bias);
                }
                v
            }
        })
    }

    /// Number of query heads sharing one key/value head.
    pub fn kv_groups(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }
}

/// Mistral's, Phi-3's and Gemma's additions to the Llama layout.
fn decoder_extras(
    raw: &RawHfConfig,
    arch: Arch,
    head_dim: usize,
    rope_params: Option<&serde_json::Value>,
    local_params: Option<&serde_json::Value>,
    text: &str,
    path: &Path,
) -> Result<DecoderExtras> {
    let layers = need(raw.num_hidden_layers, "num_hidden_layers", path)?;
    let gemma = matches!(arch, Arch::Gemma2 | Arch::Gemma3);
    // Which layers slide: `layer_types` when given, else the family's pattern.
    let sliding_layers = sliding_layers_of(raw, arch, layers, path)?;
    let sliding_window = match arch {
        Arch::Mistral | Arch::Phi3 | Arch::Gemma2 | Arch::Gemma3 => raw.sliding_window,
        _ => None,
    };
    if raw.use_bidirectional_attention == Some(true) {
        return Err(Error::file(
            path,
            "use_bidirectional_attention = true (an embedding model) is not a causal LM",
        ));
    }
    let sliding_layers = match sliding_window {
        Some(0) => return Err(Error::file(path, "sliding_window must be positive")),
        Some(_) => sliding_layers,
        None => vec![],
    };
    let rotary_dim = rotary_dim_of(raw, arch, head_dim, rope_params, path)?;
    let rope_local_theta = match arch {
        Arch::Gemma3 => raw
            .rope_local_base_freq
            .or_else(|| local_params?.get("rope_theta")?.as_f64())
            .or(Some(10000.0)),
        _ => None,
    };
    if let Some(local) = local_params {
        parse_rope_scaling(Some(local), path)?;
        if parse_linear_factor(Some(local), path)?.is_some() {
            return Err(Error::file(
                path,
                "linear RoPE scaling of the sliding layers is not supported (Gemma 3 scales its \
                 global layers only)",
            ));
        }
    }
    let source = match arch {
        Arch::Mistral | Arch::Phi3 | Arch::Gemma2 | Arch::Gemma3 => Some(
            serde_json::from_str(text)
                .map_err(|e| Error::file(path, format!("invalid JSON: {e}")))?,
        ),
        _ => None,
    };
    Ok(DecoderExtras {
        sliding_window,
        sliding_layers,
        rope_local_theta,
        rotary_dim,
        long_rope: None,
        rope_linear_factor: None,
        fused_proj_names: arch == Arch::Phi3,
        norm_plus_one: gemma,
        embed_scale: match gemma {
            true => Some((need(raw.hidden_size, "hidden_size", path)? as f64).sqrt()),
            false => None,
        },
        activation: Activation::Silu,
        sandwich_norms: gemma,
        query_pre_attn_scalar: match gemma {
            true => Some(raw.query_pre_attn_scalar.unwrap_or(256.0)),
            false => None,
        },
        attn_softcap: raw.attn_logit_softcapping.filter(|_| gemma),
        final_softcap: raw.final_logit_softcapping.filter(|_| gemma),
        source,
    })
}

/// Phi-3's `longrope` scaling, when `v` has it (see [`LongRope`]).
fn parse_long_rope(
    raw: &RawHfConfig,
    v: Option<&serde_json::Value>,
    path: &Path,
) -> Result<Option<LongRope>> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let kind = v.get("rope_type").or_else(|| v.get("type"));
    if !matches!(kind.and_then(|k| k.as_str()), Some("longrope" | "su")) {
        return Ok(None);
    }
    let err = |what: &str| Error::file(path, format!("rope_scaling of type longrope: {what}"));
    let short_factor = v
        .get("short_factor")
        .and_then(|x| x.as_array())
        .ok_or_else(|| err("needs `short_factor`"))?
        .iter()
        .map(|x| {
            x.as_f64()
                .ok_or_else(|| err("`short_factor` holds a non-number"))
        })
        .collect::<Result<Vec<f64>>>()?;
    let original = v
        .get("original_max_position_embeddings")
        .and_then(|x| x.as_u64())
        .map(|x| x as usize)
        .or(raw.original_max_position_embeddings)
        .ok_or_else(|| err("needs `original_max_position_embeddings`"))?;
    let max = raw.max_position_embeddings.unwrap_or(original);
    let factor = v
        .get("factor")
        .and_then(|x| x.as_f64())
        .unwrap_or(max as f64 / original as f64);
    let attention_factor = match v.get("attention_factor").and_then(|x| x.as_f64()) {
        Some(a) => a,
        None if factor <= 1.0 => 1.0,
        None => (1.0 + factor.ln() / (original as f64).ln()).sqrt(),
    };
    Ok(Some(LongRope {
        short_factor,
        attention_factor,
        original_max_position_embeddings: original,
    }))
}

/// The factor of `rope_type = "linear"` scaling, when `v` has it.
fn parse_linear_factor(v: Option<&serde_json::Value>, path: &Path) -> Result<Option<f64>> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let kind = v.get("rope_type").or_else(|| v.get("type"));
    if kind.and_then(|k| k.as_str()) != Some("linear") {
        return Ok(None);
    }
    match v.get("factor").and_then(|x| x.as_f64()) {
        Some(f) if f > 0.0 && f.is_finite() => Ok(Some(f)),
        _ => Err(Error::file(
            path,
            "rope_scaling of type linear needs a positive `factor`",
        )),
    }
}

fn parse_rope_scaling(
    v: Option<&serde_json::Value>,
    path: &Path,
) -> Result<Option<Llama3RopeScaling>> {
    let Some(v) = v else { return Ok(None) };
    if v.is_null() {
        return Ok(None);
    }
    let kind = v
        .get("rope_type")
        .or_else(|| v.get("type"))
        .and_then(|x| x.as_str())
        .unwrap_or("default");
    match kind {
        // Linear scaling is read by `parse_linear_factor`.
        "default" | "linear" => Ok(None),
        "llama3" => {
            let f = |k: &str| {
                v.get(k).and_then(|x| x.as_f64()).ok_or_else(|| {
                    Error::file(path, format!("rope_scaling of type llama3 needs `{k}`"))
                })
            };
            Ok(Some(Llama3RopeScaling {
                factor: f("factor")?,
                low_freq_factor: f("low_freq_factor")?,
                high_freq_factor: f("high_freq_factor")?,
                original_max_position_embeddings: f("original_max_position_embeddings")? as usize,
            }))
        }
        "longrope" | "su" => Err(Error::file(
            path,
            "rope_scaling (or rope_parameters) of type `longrope` is supported for phi3 only",
        )),
        other => Err(Error::file(
            path,
            format!(
                "rope_scaling type `{other}` is not supported (supported: default, linear, llama3)"
            ),
        )),
    }
}

/// The architecture of an HF `config.json`: its `model_type`, else its first `architectures`
/// entry.
fn hf_arch(raw: &RawHfConfig, model_type: &str, path: &Path) -> Result<Arch> {
    Arch::from_model_type(model_type)
        .or_else(|| {
            let first = raw.architectures.as_ref()?.first()?.to_lowercase();
            [
                ("qwen3", Arch::Qwen3),
                ("qwen2", Arch::Qwen2),
                ("gpt2", Arch::Gpt2),
                ("llama", Arch::Llama),
                ("mistral", Arch::Mistral),
                ("phi3", Arch::Phi3),
                ("gemma2", Arch::Gemma2),
                ("gemma3", Arch::Gemma3),
            ]
            .into_iter()
            .find(|(k, _)| first.starts_with(k))
            .map(|(_, a)| a)
        })
        .ok_or_else(|| {
            Error::file(
                path,
                format!(
                    "unsupported architecture: model_type `{model_type}`, architectures {:?}. \
                     Supported: {SUPPORTED_ARCHS}",
                    // Only used in the message.
                    raw.architectures.clone().unwrap_or_default()
                ),
            )
        })
}

/// GPT-2's configuration from its `config.json` (its own key names).
fn gpt2_from_hf(
    raw: &RawHfConfig,
    bos_token_id: Option<u32>,
    eos_token_ids: Vec<u32>,
    path: &Path,
) -> Result<ModelConfig> {
    let act = raw
        .activation_function
        .clone()
        .unwrap_or_else(|| "gelu_new".into());
    if !matches!(act.as_str(), "gelu_new" | "gelu_pytorch_tanh" | "gelu") {
        return Err(Error::file(
            path,
            format!("activation_function `{act}` is not supported for gpt2 (use gelu_new)"),
        ));
    }
    let hidden = need(raw.n_embd, "n_embd", path)?;
    let heads = need(raw.n_head, "n_head", path)?;
    if heads == 0 || hidden % heads != 0 {
        return Err(Error::file(
            path,
            format!("n_embd ({hidden}) must be a multiple of n_head ({heads})"),
        ));
    }
    Ok(ModelConfig {
        arch: Arch::Gpt2,
        vocab_size: need(raw.vocab_size, "vocab_size", path)?,
        hidden_size: hidden,
        intermediate_size: raw.n_inner.unwrap_or(4 * hidden),
        num_layers: need(raw.n_layer, "n_layer", path)?,
        num_heads: heads,
        num_kv_heads: heads,
        head_dim: hidden / heads,
        norm_eps: raw.layer_norm_epsilon.unwrap_or(1e-5),
        rope_theta: 0.0,
        rope_scaling: None,
        rope_freq_factors: None,
        max_position_embeddings: raw.n_positions.unwrap_or(1024),
        tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(true),
        attention_bias: true,
        mlp_bias: true,
        qk_norm: false,
        bos_token_id,
        eos_token_ids,
        build_quantized: None,
        extras: DecoderExtras::default(),
    })
}

/// The MLP's activation of a Llama-family `config.json`: SiLU, or Gemma's tanh GELU.
fn hf_activation(raw: &RawHfConfig, arch: Arch, path: &Path) -> Result<Activation> {
    let gemma = matches!(arch, Arch::Gemma2 | Arch::Gemma3);
    Ok(
        match raw.hidden_activation.as_ref().or(raw.hidden_act.as_ref()) {
            None if gemma => Activation::GeluTanh,
            None => Activation::Silu,
            Some(a) if a == "silu" && !gemma => Activation::Silu,
            Some(a) if gemma && matches!(a.as_str(), "gelu_pytorch_tanh" | "gelu_new") => {
                Activation::GeluTanh
            }
            Some(a) => {
                let want = if gemma { "gelu_pytorch_tanh" } else { "silu" };
                return Err(Error::file(
                    path,
                    format!(
                        "hidden_act `{a}` is not supported for {} (only {want})",
                        arch.name()
                    ),
                ));
            }
        },
    )
}

/// Which of `layers` layers slide: `layer_types` when given, else the family's pattern.
fn sliding_layers_of(
    raw: &RawHfConfig,
    arch: Arch,
    layers: usize,
    path: &Path,
) -> Result<Vec<bool>> {
    Ok(match (&raw.layer_types, arch) {
        (_, Arch::Llama | Arch::Qwen2 | Arch::Qwen3 | Arch::Gpt2) => vec![],
        (Some(types), _) => {
            if types.len() != layers {
                return Err(Error::file(
                    path,
                    format!(
                        "layer_types has {} entries for {layers} layers",
                        types.len()
                    ),
                ));
            }
            types
                .iter()
                .map(|t| match t.as_str() {
                    "sliding_attention" => Ok(true),
                    "full_attention" => Ok(false),
                    other => Err(Error::file(path, format!("layer_types: unknown `{other}`"))),
                })
                .collect::<Result<_>>()?
        }
        (None, Arch::Mistral | Arch::Phi3) => vec![true; layers],
        (None, Arch::Gemma2) => (0..layers).map(|i| i % 2 == 0).collect(),
        (None, _) => {
            let every = raw.sliding_window_pattern.unwrap_or(6).max(1);
            (0..layers).map(|i| (i + 1) % every != 0).collect()
        }
    })
}

/// The rotated dims of a head when only part of it is (Phi-3's `partial_rotary_factor`).
fn rotary_dim_of(
    raw: &RawHfConfig,
    arch: Arch,
    head_dim: usize,
    rope_params: Option<&serde_json::Value>,
    path: &Path,
) -> Result<Option<usize>> {
    let factor = raw
        .partial_rotary_factor
        .or_else(|| rope_params?.get("partial_rotary_factor")?.as_f64());
    Ok(match factor {
        Some(f) if arch == Arch::Phi3 && f != 1.0 => {
            let d = (head_dim as f64 * f) as usize;
            if d == 0 || !d.is_multiple_of(2) || d > head_dim {
                return Err(Error::file(
                    path,
                    format!("partial_rotary_factor {f} gives {d} rotary dims of {head_dim}"),
                ));
            }
            Some(d)
        }
        Some(f) if f != 1.0 => {
            return Err(Error::file(
                path,
                format!(
                    "partial_rotary_factor {f} is not supported for {}",
                    arch.name()
                ),
            ))
        }
        _ => None,
    })
}

mod gguf;
pub use gguf::{gguf_value_usize, llama_cpp_gemma_query_scalar, llama_cpp_sliding_layers};

#[cfg(test)]
mod tests;
