//! Loading checkpoints into HF-named tensors: HF directories (config.json + safetensors, single or
//! sharded) and single GGUF files (every tensor type candle reads, dequantized; names mapped to HF's;
//! Q/K un-permuted where llama.cpp permutes them; GPT-2 projections back in HF's Conv1D layout).
//! Whatever the source, the result is the same [`LoadedModel`]: a config, HF-named tensors, a
//! tokenizer and the EOS ids, so everything downstream (training, export) sees one layout.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file;
use candle_core::{DType, Device, Tensor};

use crate::files::{read_json, safetensors_files};
use crate::hub::ModelSource;
use crate::models::config::token_ids_from_json;
use crate::models::{Arch, CausalLm, ModelConfig};
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

/// A checkpoint in memory, in HF layout.
#[derive(Debug, Clone)]
pub struct LoadedModel {
    pub config: ModelConfig,
    /// HF names -> tensors in the requested dtype.
    pub tensors: HashMap<String, Tensor>,
    pub tokenizer: Option<Tokenizer>,
    /// EOS ids: generation_config.json / config.json / the tokenizer's, deduplicated.
    pub eos_token_ids: Vec<u32>,
    /// Where it came from, for messages.
    pub origin: PathBuf,
    pub dtype: DType,
    pub device: Device,
}

impl LoadedModel {
    /// Builds a model over these tensors (shared storage, no copy).
    pub fn build(&self) -> Result<CausalLm> {
        CausalLm::from_tensors(&self.config, self.tensors.clone(), self.dtype, &self.device)
    }

    /// The tokenizer, or an error saying how to provide one.
    pub fn tokenizer(&self) -> Result<&Tokenizer> {
        self.tokenizer.as_ref().ok_or_else(|| {
            Error::file(
                &self.origin,
                "no tokenizer found (expected tokenizer.json in the model directory, or tokenizer metadata in the GGUF file)",
            )
        })
    }
}

/// Only the tokenizer of `source` (no weights are read).
pub fn load_tokenizer(source: &ModelSource) -> Result<Tokenizer> {
    let missing = |p: &Path| {
        Error::file(
            p,
            "no tokenizer found (expected tokenizer.json in the model directory, or tokenizer metadata in the GGUF file)",
        )
    };
    match source {
        ModelSource::HfDir(dir) if dir.join("tokenizer.json").is_file() => {
            Tokenizer::from_hf_dir(dir)
        }
        ModelSource::HfDir(dir) => Err(missing(dir)),
        ModelSource::Gguf(path) => {
            let (_, content) = open_gguf(path)?;
            if !content.metadata.contains_key("tokenizer.ggml.tokens") {
                return Err(missing(path));
            }
            Tokenizer::from_gguf(&content, path)
        }
    }
}

/// A GGUF file, its header bounds-checked ([`crate::gguf_check`]) and then read.
pub fn open_gguf(path: &Path) -> Result<(File, gguf_file::Content)> {
    crate::gguf_check::check_gguf(path)?;
    let mut file = File::open(path).map_err(|e| Error::file(path, format!("cannot open: {e}")))?;
    let content = gguf_file::Content::read(&mut file)
        .map_err(|e| Error::file(path, format!("not a valid GGUF file: {e}")))?;
    Ok((file, content))
}

/// Loads `source` with weights in `dtype` on `device`.
pub fn load_model(source: &ModelSource, dtype: DType, device: &Device) -> Result<LoadedModel> {
    let mut m = match source {
        ModelSource::HfDir(dir) => load_hf_dir(dir, dtype, device)?,
        ModelSource::Gguf(path) => load_gguf(path, dtype, device)?,
    };
    if let Some(tok) = &m.tokenizer {
        if tok.vocab_size() > m.config.vocab_size {
            return Err(Error::file(
                &m.origin,
                format!(
                    "the tokenizer has {} tokens but the model's vocabulary has only {}: they do not belong together",
                    tok.vocab_size(),
                    m.config.vocab_size
                ),
            ));
        }
        for id in [tok.eos_token_id()].into_iter().flatten() {
            if !m.eos_token_ids.contains(&id) {
                m.eos_token_ids.push(id);
            }
        }
    }
    if let Some(&bad) = m
        .eos_token_ids
        .iter()
        .find(|&&id| id as usize >= m.config.vocab_size)
    {
        return Err(Error::file(
            &m.origin,
            format!(
                "eos token id {bad} is outside the vocabulary ({})",
                m.config.vocab_size
            ),
        ));
    }
    Ok(m)
}

fn load_hf_dir(dir: &Path, dtype: DType, device: &Device) -> Result<LoadedModel> {
    let config_path = dir.join("config.json");
    let mut config = ModelConfig::from_hf_file(&config_path)?;
    let mut tensors = HashMap::new();
    for file in safetensors_files(dir)? {
        // SAFETY: the file is only read; a concurrent writer could change what we read, as with any
        // other reader, but cannot cause memory unsafety beyond that of reading a changing file.
        let st = unsafe { candle_core::safetensors::MmapedSafetensors::new(&file) }
            .map_err(|e| Error::file(&file, format!("not a valid safetensors file: {e}")))?;
        for (name, _) in st.tensors() {
            let t = st
                .load(&name, device)
                .map_err(|e| Error::file(&file, format!("cannot read tensor `{name}`: {e}")))?;
            tensors.insert(name, t.to_dtype(dtype)?);
        }
    }
    if config.arch == Arch::Gpt2 {
        tensors = normalize_gpt2_names(tensors);
    }
    if !tensors.contains_key("lm_head.weight") && !config.tie_word_embeddings {
        return Err(Error::file(
            dir,
            "config.json says tie_word_embeddings = false but the checkpoint has no lm_head.weight",
        ));
    }
    let gen_path = dir.join("generation_config.json");
    let mut eos = config.eos_token_ids.clone();
    if gen_path.is_file() {
        let g = read_json(&gen_path)?;
        for id in token_ids_from_json(g.get("eos_token_id")) {
            if !eos.contains(&id) {
                eos.push(id);
            }
        }
    }
    config.eos_token_ids = eos.clone();
    let tokenizer = if dir.join("tokenizer.json").is_file() {
        Some(Tokenizer::from_hf_dir(dir)?)
    } else {
        None
    };
    Ok(LoadedModel {
        config,
        tensors,
        tokenizer,
        eos_token_ids: eos,
        origin: dir.to_path_buf(),
        dtype,
        device: device.clone(),
    })
}

/// Old GPT-2 checkpoints have no `transformer.` prefix and carry attention-mask buffers.
fn normalize_gpt2_names(tensors: HashMap<String, Tensor>) -> HashMap<String, Tensor> {
    let prefixed = tensors.contains_key("transformer.wte.weight");
    tensors
        .into_iter()
        .filter(|(k, _)| !(k.ends_with(".attn.bias") || k.ends_with(".attn.masked_bias")))
        .map(|(k, v)| {
            if prefixed || k == "lm_head.weight" {
                (k, v)
            } else {
                (format!("transformer.{k}"), v)
            }
        })
        .collect()
}

/// llama.cpp's names for a family's tensors and HF's: the whole-model tensors (`token_embd` ->
/// `model.embed_tokens`) and the per-layer ones (`attn_q` -> `self_attn.q_proj`, under `blk.N.`
/// and `model.layers.N.`). One table per family, read one way to load a GGUF and the other way
/// to write one ([`crate::gguf_write`]), so the two cannot disagree.
struct NameTable {
    top: &'static [(&'static str, &'static str)],
    layer_prefix: &'static str,
    layer: &'static [(&'static str, &'static str)],
}

const LLAMA_TOP: &[(&str, &str)] = &[
    ("token_embd", "model.embed_tokens"),
    ("output_norm", "model.norm"),
    ("output", "lm_head"),
];

fn name_table(arch: Arch) -> NameTable {
    const ATTN: [(&str, &str); 6] = [
        ("attn_q", "self_attn.q_proj"),
        ("attn_k", "self_attn.k_proj"),
        ("attn_v", "self_attn.v_proj"),
        ("attn_output", "self_attn.o_proj"),
        ("attn_q_norm", "self_attn.q_norm"),
        ("attn_k_norm", "self_attn.k_norm"),
    ];
    let layer: &'static [(&str, &str)] = match arch {
        Arch::Llama | Arch::Mistral | Arch::Qwen2 | Arch::Qwen3 => &[
            ("attn_norm", "input_layernorm"),
            ("ffn_norm", "post_attention_layernorm"),
            ATTN[0],
            ATTN[1],
            ATTN[2],
            ATTN[3],
            ATTN[4],
            ATTN[5],
            ("ffn_gate", "mlp.gate_proj"),
            ("ffn_up", "mlp.up_proj"),
            ("ffn_down", "mlp.down_proj"),
        ],
        // Fused q/k/v and gate/up, as HF's Phi-3 stores them (gate first, as llama.cpp splits).
        Arch::Phi3 => &[
            ("attn_norm", "input_layernorm"),
            ("ffn_norm", "post_attention_layernorm"),
            ("attn_qkv", "self_attn.qkv_proj"),
            ("attn_output", "self_attn.o_proj"),
            ("ffn_up", "mlp.gate_up_proj"),
            ("ffn_down", "mlp.down_proj"),
        ],
        // Gemma's sandwich: HF's post_attention_layernorm is the attention output's norm and the
        // MLP's input norm is pre_feedforward_layernorm.
        Arch::Gemma2 | Arch::Gemma3 => &[
            ("attn_norm", "input_layernorm"),
            ("post_attention_norm", "post_attention_layernorm"),
            ("ffn_norm", "pre_feedforward_layernorm"),
            ("post_ffw_norm", "post_feedforward_layernorm"),
            ATTN[0],
            ATTN[1],
            ATTN[2],
            ATTN[3],
            ATTN[4],
            ATTN[5],
            ("ffn_gate", "mlp.gate_proj"),
            ("ffn_up", "mlp.up_proj"),
            ("ffn_down", "mlp.down_proj"),
        ],
        Arch::Gpt2 => {
            return NameTable {
                top: &[
                    ("token_embd", "transformer.wte"),
                    ("position_embd", "transformer.wpe"),
                    ("output_norm", "transformer.ln_f"),
                    ("output", "lm_head"),
                ],
                layer_prefix: "transformer.h.",
                layer: &[
                    ("attn_norm", "ln_1"),
                    ("attn_qkv", "attn.c_attn"),
                    ("attn_output", "attn.c_proj"),
                    ("ffn_norm", "ln_2"),
                    ("ffn_up", "mlp.c_fc"),
                    ("ffn_down", "mlp.c_proj"),
                ],
            }
        }
    };
    NameTable {
        top: LLAMA_TOP,
        layer_prefix: "model.layers.",
        layer,
    }
}

/// GPT-2's projections are Conv1D (`[in, out]`) in HF and `[out, in]` in GGUF.
fn is_conv1d(arch: Arch, hf: &str) -> bool {
    arch == Arch::Gpt2
        && hf.ends_with(".weight")
        && ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]
            .iter()
            .any(|p| hf.contains(&format!(".{p}.")))
}

/// Maps `name` (`<stem>.weight` / `<stem>.bias`) through `table`: GGUF -> HF when `to_hf`, else
/// HF -> GGUF.
fn map_name(table: &NameTable, name: &str, to_hf: bool) -> Option<String> {
    let (stem, ext) = name.rsplit_once('.')?;
    if ext != "weight" && ext != "bias" {
        return None;
    }
    let pick = |pairs: &[(&'static str, &'static str)], s: &str| -> Option<&'static str> {
        pairs.iter().find_map(|&(g, h)| match to_hf {
            true => (g == s).then_some(h),
            false => (h == s).then_some(g),
        })
    };
    if let Some(t) = pick(table.top, stem) {
        return Some(format!("{t}.{ext}"));
    }
    let (from_prefix, to_prefix) = match to_hf {
        true => ("blk.", table.layer_prefix),
        false => (table.layer_prefix, "blk."),
    };
    let (layer, part) = stem.strip_prefix(from_prefix)?.split_once('.')?;
    layer.parse::<usize>().ok()?;
    Some(format!(
        "{to_prefix}{layer}.{}.{ext}",
        pick(table.layer, part)?
    ))
}

/// HF name for a GGUF tensor name, and whether the tensor is a GPT-2 Conv1D weight stored
/// transposed in GGUF.
pub fn hf_name(arch: Arch, gguf: &str) -> Option<(String, bool)> {
    let hf = map_name(&name_table(arch), gguf, true)?;
    let conv = is_conv1d(arch, &hf);
    Some((hf, conv))
}

/// llama.cpp's name for an HF tensor name (the inverse of [`hf_name`]), and whether it is a GPT-2
/// Conv1D weight to transpose.
pub fn gguf_name(arch: Arch, hf: &str) -> Option<(String, bool)> {
    let g = map_name(&name_table(arch), hf, false)?;
    Some((g, is_conv1d(arch, hf)))
}

/// Whether llama.cpp stores this family's Q/K rows in its interleaved RoPE order (its `llama`
/// graph, which Mistral's files use too); the others use HF's rotate-half (NEOX) order as is.
pub fn llama_cpp_permutes_qk(arch: Arch) -> bool {
    matches!(arch, Arch::Llama | Arch::Mistral)
}

/// Undoes llama.cpp's Q/K row permutation (`[h, 2, d/2] -> [h, d/2, 2]` per head) so RoPE can use
/// HF's rotate-half layout. Works for weights `[h*d, in]` and biases `[h*d]`.
pub fn unpermute_qk(t: &Tensor, heads: usize) -> Result<Tensor> {
    let dims = t.dims().to_vec();
    let rows = dims[0];
    if heads == 0 || !rows.is_multiple_of(2 * heads) {
        return Err(Error::Model(format!(
            "cannot un-permute a tensor of shape {dims:?} for {heads} heads"
        )));
    }
    let half = rows / heads / 2;
    let rest: usize = dims[1..].iter().product();
    Ok(t.reshape((heads, half, 2, rest))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(dims)?)
}

/// The row order that undoes llama.cpp's Q/K permutation (see [`unpermute_qk`]): row `r` of
/// the HF weight is row `order[r]` of the GGUF one.
pub fn unpermute_order(rows: usize, heads: usize) -> Result<Vec<usize>> {
    if heads == 0 || !rows.is_multiple_of(2 * heads) {
        return Err(Error::Model(format!(
            "cannot un-permute {rows} rows for {heads} heads"
        )));
    }
    let half = rows / heads / 2;
    let mut order = Vec::with_capacity(rows);
    for h in 0..heads {
        for j in 0..2 {
            for k in 0..half {
                order.push(h * 2 * half + k * 2 + j);
            }
        }
    }
    Ok(order)
}

/// The projection weights of a GGUF file that are stored as `kind`, as they are (no
/// dequantization; Q/K rows un-permuted exactly), by HF weight name (HF `[out, in]` layout).
pub fn gguf_quantized_projections(
    path: &Path,
    kind: crate::models::QuantType,
) -> Result<HashMap<String, crate::models::QuantProj>> {
    let (mut file, content) = open_gguf(path)?;
    let config = ModelConfig::from_gguf(&content.metadata, path)?;
    let mut out = HashMap::new();
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    for name in names {
        let Some((hf, _)) = hf_name(config.arch, name) else {
            continue;
        };
        let is_proj = hf.ends_with("_proj.weight")
            || (config.arch == Arch::Gpt2
                && ["c_attn.weight", "c_proj.weight", "c_fc.weight"]
                    .iter()
                    .any(|s| hf.ends_with(s)));
        if !is_proj || Some(content.tensor_infos[name].ggml_dtype) != kind.ggml() {
            continue;
        }
        let q = content
            .tensor(&mut file, name, &Device::Cpu)
            .map_err(|e| Error::file(path, format!("cannot read tensor `{name}`: {e}")))?;
        let Some(mut p) = crate::models::QuantProj::from_qtensor(std::sync::Arc::new(q), kind)
        else {
            continue;
        };
        if llama_cpp_permutes_qk(config.arch) {
            let heads = if hf.contains("self_attn.q_proj.") {
                Some(config.num_heads)
            } else if hf.contains("self_attn.k_proj.") {
                Some(config.num_kv_heads)
            } else {
                None
            };
            if let Some(h) = heads {
                p = p.permute_rows(&unpermute_order(p.dims()?.0, h)?)?;
            }
        }
        out.insert(hf, p);
    }
    Ok(out)
}

/// The 1-D F32 tensors that carry RoPE factors rather than weights (`rope_freqs`: Llama 3.1's
/// per-frequency divisors; `rope_factors_short` / `_long`: Phi-3's LongRoPE), by name.
const ROPE_FACTOR_TENSORS: [&str; 3] = [
    "rope_freqs.weight",
    "rope_factors_short.weight",
    "rope_factors_long.weight",
];

fn load_gguf(path: &Path, dtype: DType, device: &Device) -> Result<LoadedModel> {
    let (mut file, content) = open_gguf(path)?;
    let mut factors: HashMap<&str, Vec<f64>> = HashMap::new();
    for name in ROPE_FACTOR_TENSORS {
        if content.tensor_infos.contains_key(name) {
            let q = content
                .tensor(&mut file, name, &Device::Cpu)
                .map_err(|e| Error::file(path, format!("cannot read tensor `{name}`: {e}")))?;
            let f: Vec<f32> = q.dequantize(&Device::Cpu)?.flatten_all()?.to_vec1()?;
            factors.insert(name, f.into_iter().map(f64::from).collect());
        }
    }
    let mut config = ModelConfig::from_gguf_with_factors(
        &content.metadata,
        path,
        factors.get("rope_factors_short.weight").map(Vec::as_slice),
        factors.get("rope_factors_long.weight").map(Vec::as_slice),
    )?;
    config.rope_freq_factors = factors.remove("rope_freqs.weight");
    let mut tensors = HashMap::new();
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    for name in names {
        if ROPE_FACTOR_TENSORS.contains(&name.as_str()) {
            continue;
        }
        let Some((hf, conv1d)) = hf_name(config.arch, name) else {
            return Err(Error::file(
                path,
                format!(
                    "unexpected tensor `{name}` for architecture {}",
                    config.arch.name()
                ),
            ));
        };
        let q = content
            .tensor(&mut file, name, device)
            .map_err(|e| Error::file(path, format!("cannot read tensor `{name}`: {e}")))?;
        let mut t = q
            .dequantize(device)
            .map_err(|e| Error::file(path, format!("cannot dequantize `{name}`: {e}")))?;
        if llama_cpp_permutes_qk(config.arch) {
            if hf.contains("self_attn.q_proj.") {
                t = unpermute_qk(&t, config.num_heads)?;
            } else if hf.contains("self_attn.k_proj.") {
                t = unpermute_qk(&t, config.num_kv_heads)?;
            }
        }
        // llama.cpp's Gemma norms hold the scale itself; HF's (and grpo's) hold scale - 1.
        if config.extras.norm_plus_one && hf.ends_with("norm.weight") {
            t = t.affine(1.0, -1.0)?;
        }
        if conv1d {
            t = t.t()?.contiguous()?;
        }
        tensors.insert(hf, t.to_dtype(dtype)?);
    }
    config.tie_word_embeddings = !tensors.contains_key("lm_head.weight");
    if let Some(serde_json::Value::Object(source)) = config.extras.source.as_mut() {
        source.insert(
            "tie_word_embeddings".into(),
            config.tie_word_embeddings.into(),
        );
    }
    let tokenizer = if content.metadata.contains_key("tokenizer.ggml.tokens") {
        Some(Tokenizer::from_gguf(&content, path)?)
    } else {
        None
    };
    let eos = config.eos_token_ids.clone();
    Ok(LoadedModel {
        config,
        tensors,
        tokenizer,
        eos_token_ids: eos,
        origin: path.to_path_buf(),
        dtype,
        device: device.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_inverts_llama_cpp_permutation() {
        // llama.cpp: w.reshape(h, 2, d/2, in).swapaxes(1, 2).reshape(...)
        let dev = Device::Cpu;
        let (h, d, inp) = (3, 4, 5);
        let w = Tensor::arange(0f32, (h * d * inp) as f32, &dev)
            .unwrap()
            .reshape((h * d, inp))
            .unwrap();
        let permuted = w
            .reshape((h, 2, d / 2, inp))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
            .reshape((h * d, inp))
            .unwrap();
        let back = unpermute_qk(&permuted, h).unwrap();
        assert_eq!(back.to_vec2::<f32>().unwrap(), w.to_vec2::<f32>().unwrap());
    }

    #[test]
    fn unpermute_order_matches_unpermute_qk() {
        let w = Tensor::arange(0f32, 24.0, &Device::Cpu)
            .unwrap()
            .reshape((12, 2))
            .unwrap();
        let want = unpermute_qk(&w, 3).unwrap().to_vec2::<f32>().unwrap();
        let order = unpermute_order(12, 3).unwrap();
        let rows = w.to_vec2::<f32>().unwrap();
        let got: Vec<Vec<f32>> = order.iter().map(|&r| rows[r].clone()).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn gguf_names_map_to_hf() {
        assert_eq!(
            hf_name(Arch::Llama, "blk.3.attn_q.weight"),
            Some(("model.layers.3.self_attn.q_proj.weight".into(), false))
        );
        assert_eq!(
            hf_name(Arch::Gpt2, "blk.0.attn_qkv.weight"),
            Some(("transformer.h.0.attn.c_attn.weight".into(), true))
        );
        assert_eq!(
            hf_name(Arch::Gpt2, "blk.0.attn_qkv.bias"),
            Some(("transformer.h.0.attn.c_attn.bias".into(), false))
        );
        assert_eq!(hf_name(Arch::Llama, "blk.0.unknown.weight"), None);
    }
}
