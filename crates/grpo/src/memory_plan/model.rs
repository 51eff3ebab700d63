//! A model's tensor shapes for the memory plan, read without loading any weight: from the
//! safetensors headers of an HF directory (8 bytes of length, then JSON), from a GGUF's tensor
//! table, or, for a directory with only `config.json`, from the architecture itself.

use std::io::Read;
use std::path::Path;

use grpo_models::hub::ModelSource;
use grpo_models::models::{Arch, ModelConfig};

use crate::{Error, Result};

/// Where a model's shapes were read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ShapeSource {
    /// The safetensors headers (every tensor as stored).
    SafetensorsHeader,
    /// A GGUF's tensor table.
    Gguf,
    /// `config.json` alone: the tensors its architecture has.
    Architecture,
}

/// Projections the trainer builds as one joined weight from separately stored parts (q/k/v, and
/// gate/up): a frozen model holds a joined copy of them ([`ModelShapes::joined_elems`]).
const JOINED_PARTS: [&str; 5] = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"];

/// Every linear projection of the blocks, by its HF module name (what LoRA targets; the LM
/// head and the embeddings are not among them).
const PROJECTIONS: [&str; 12] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "qkv_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "gate_up_proj",
    "c_attn",
    "c_proj",
    "c_fc",
];

/// A model's config and the shape of every checkpoint tensor (HF names).
#[derive(Debug, Clone)]
pub struct ModelShapes {
    pub config: ModelConfig,
    /// (HF tensor name, shape).
    pub tensors: Vec<(String, Vec<usize>)>,
    pub source: ShapeSource,
}

impl ModelShapes {
    /// The shapes of `source`'s model, without reading its weights.
    pub fn read(source: &ModelSource) -> Result<ModelShapes> {
        match source {
            ModelSource::HfDir(dir) => Self::read_hf_dir(dir),
            ModelSource::Gguf(path) => Self::read_gguf(path),
        }
    }

    /// An HF directory: `config.json`, and the safetensors headers when there are weights.
    fn read_hf_dir(dir: &Path) -> Result<ModelShapes> {
        let config = ModelConfig::from_hf_file(&dir.join("config.json"))?;
        let files = safetensors_files(dir)?;
        if files.is_empty() {
            return Ok(Self::from_architecture(config));
        }
        let mut tensors = Vec::new();
        for f in &files {
            tensors.extend(safetensors_shapes(f)?);
        }
        tensors.sort();
        Ok(ModelShapes {
            config,
            tensors,
            source: ShapeSource::SafetensorsHeader,
        })
    }

    /// A GGUF: its metadata and tensor table (GGUF names; the plan only needs their sizes).
    fn read_gguf(path: &Path) -> Result<ModelShapes> {
        let (_, content) = grpo_models::weights::open_gguf(path)?;
        let config = ModelConfig::from_gguf(&content.metadata, path)?;
        let mut tensors: Vec<(String, Vec<usize>)> = content
            .tensor_infos
            .iter()
            .map(|(n, t)| (gguf_to_hf_name(n), t.shape.dims().to_vec()))
            .collect();
        tensors.sort();
        Ok(ModelShapes {
            config,
            tensors,
            source: ShapeSource::Gguf,
        })
    }

    /// The tensors `config`'s architecture has (Llama family and GPT-2), HF names.
    pub fn from_architecture(config: ModelConfig) -> ModelShapes {
        let c = &config;
        let (v, h, i) = (c.vocab_size, c.hidden_size, c.intermediate_size);
        let (q, kv) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        let mut t: Vec<(String, Vec<usize>)> = Vec::new();
        let mut add = |n: String, s: &[usize]| t.push((n, s.to_vec()));
        if c.arch == Arch::Gpt2 {
            add("wte.weight".into(), &[v, h]);
            add("wpe.weight".into(), &[c.max_position_embeddings, h]);
            for l in 0..c.num_layers {
                let p = format!("h.{l}");
                for (n, s) in [
                    ("attn.c_attn", [h, 3 * h]),
                    ("attn.c_proj", [h, h]),
                    ("mlp.c_fc", [h, i]),
                    ("mlp.c_proj", [i, h]),
                ] {
                    add(format!("{p}.{n}.weight"), &s);
                    add(format!("{p}.{n}.bias"), &[s[1]]);
                }
                for n in ["ln_1", "ln_2"] {
                    add(format!("{p}.{n}.weight"), &[h]);
                    add(format!("{p}.{n}.bias"), &[h]);
                }
            }
            add("ln_f.weight".into(), &[h]);
            add("ln_f.bias".into(), &[h]);
        } else {
            add("model.embed_tokens.weight".into(), &[v, h]);
            if !c.tie_word_embeddings {
                add("lm_head.weight".into(), &[v, h]);
            }
            add("model.norm.weight".into(), &[h]);
            let norms: &[&str] = match c.extras.sandwich_norms {
                true => &[
                    "input_layernorm",
                    "post_attention_layernorm",
                    "pre_feedforward_layernorm",
                    "post_feedforward_layernorm",
                ],
                false => &["input_layernorm", "post_attention_layernorm"],
            };
            for l in 0..c.num_layers {
                let p = format!("model.layers.{l}");
                for (n, s) in [
                    ("self_attn.q_proj", [q, h]),
                    ("self_attn.k_proj", [kv, h]),
                    ("self_attn.v_proj", [kv, h]),
                    ("self_attn.o_proj", [h, q]),
                    ("mlp.gate_proj", [i, h]),
                    ("mlp.up_proj", [i, h]),
                    ("mlp.down_proj", [h, i]),
                ] {
                    add(format!("{p}.{n}.weight"), &s);
                }
                if c.attention_bias {
                    for (n, o) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
                        add(format!("{p}.self_attn.{n}.bias"), &[o]);
                    }
                }
                if c.qk_norm {
                    add(format!("{p}.self_attn.q_norm.weight"), &[c.head_dim]);
                    add(format!("{p}.self_attn.k_norm.weight"), &[c.head_dim]);
                }
                for n in norms {
                    add(format!("{p}.{n}.weight"), &[h]);
                }
            }
        }
        t.sort();
        ModelShapes {
            config,
            tensors: t,
            source: ShapeSource::Architecture,
        }
    }

    /// Elements of every tensor.
    pub fn params(&self) -> u64 {
        self.tensors.iter().map(|(_, s)| elems(s)).sum()
    }

    /// The block projections' weights: (HF module name, elements), in name order.
    pub fn projections(&self) -> Vec<(String, u64)> {
        self.projection_dims()
            .into_iter()
            .map(|(module, i, o)| (module, i as u64 * o as u64))
            .collect()
    }

    /// Elements of the projections a frozen model joins from separate parts (q/k/v, gate/up):
    /// building a model without a graph copies them into one weight each.
    pub fn joined_elems(&self) -> u64 {
        self.projections()
            .iter()
            .filter(|(m, _)| {
                m.rsplit('.')
                    .next()
                    .is_some_and(|l| JOINED_PARTS.contains(&l))
            })
            .map(|(_, n)| n)
            .sum()
    }

    /// Elements of the transformer blocks' tensors (`model.layers.N.*`): what ZeRO-3 gathers a
    /// block at a time. The rest (embedding, final norm, LM head) it gathers for a whole step.
    pub fn block_elems(&self) -> u64 {
        self.tensors
            .iter()
            .filter(|(n, _)| n.contains("layers."))
            .map(|(_, s)| elems(s))
            .sum()
    }

    /// Elements of the largest tensor.
    pub fn largest_elems(&self) -> u64 {
        self.tensors
            .iter()
            .map(|(_, s)| elems(s))
            .max()
            .unwrap_or(0)
    }

    /// Elements of the LM head as the model multiplies with it (the embedding when tied).
    pub fn head_elems(&self) -> u64 {
        (self.config.vocab_size * self.config.hidden_size) as u64
    }

    /// Elements of LoRA adapters of rank `r` on the projections `targets` selects
    /// (`r x in` for A plus `out x r` for B per adapted projection).
    pub fn lora_elems(&self, r: usize, targets: &dyn Fn(&str) -> bool) -> u64 {
        self.projection_dims()
            .iter()
            .filter(|(m, _, _)| targets(m))
            .map(|(_, i, o)| (r * (i + o)) as u64)
            .sum()
    }

    /// Elements of the dense weights merging adapters into the projections `targets` selects
    /// copies: a joined q/k/v (or gate/up) weight is copied whole when one of its parts is
    /// adapted.
    pub fn merged_elems(&self, targets: &dyn Fn(&str) -> bool) -> u64 {
        let mut groups: std::collections::BTreeMap<String, (u64, bool)> = Default::default();
        for (module, n) in self.projections() {
            let (prefix, leaf) = module.rsplit_once('.').unwrap_or(("", module.as_str()));
            let key = match leaf {
                "q_proj" | "k_proj" | "v_proj" => format!("{prefix}.qkv"),
                "gate_proj" | "up_proj" => format!("{prefix}.gate_up"),
                _ => module.clone(),
            };
            let g = groups.entry(key).or_insert((0, false));
            g.0 += n;
            g.1 |= targets(&module);
        }
        groups
            .values()
            .filter(|(_, hit)| *hit)
            .map(|(n, _)| n)
            .sum()
    }

    /// Elements per token that LoRA's adapters keep for the backward in a training pass, over
    /// all layers (`models/lora.rs`, `LoraAdapter::forward`; `layers`, `FusedLinear::forward`):
    /// each adapted projection keeps its output (one recorded node, 1 x out), with dropout
    /// autograd's graph instead: `x A^T B^T`, its scaled copy and the sum with the base output
    /// (3 x out), the mask and the masked input (2 x in); an adapted gate/up joins its parts
    /// again for the activation (2 x intermediate).
    pub fn lora_activation_elems(&self, targets: &dyn Fn(&str) -> bool, dropout: bool) -> u64 {
        lora_activation_elems(
            &self.projection_dims(),
            targets,
            dropout,
            self.config.intermediate_size,
        )
    }

    /// (module, in, out) of each projection, HF layout `[out, in]` (GPT-2's Conv1D `[in, out]`).
    fn projection_dims(&self) -> Vec<(String, usize, usize)> {
        let conv1d = self.config.arch == Arch::Gpt2;
        self.tensors
            .iter()
            .filter(|(_, s)| s.len() == 2)
            .filter_map(|(n, s)| {
                let module = n.strip_suffix(".weight")?;
                let leaf = module.rsplit('.').next()?;
                let (i, o) = if conv1d { (s[0], s[1]) } else { (s[1], s[0]) };
                PROJECTIONS
                    .contains(&leaf)
                    .then(|| (module.to_string(), i, o))
            })
            .collect()
    }
}

/// [`ModelShapes::lora_activation_elems`] over the projections `(module, in, out)` of a model
/// whose MLP is `intermediate` wide (the trainer sizes its passes by it too).
pub fn lora_activation_elems(
    projections: &[(String, usize, usize)],
    targets: &dyn Fn(&str) -> bool,
    dropout: bool,
    intermediate: usize,
) -> u64 {
    let mut joined_mlp = std::collections::BTreeSet::new();
    let mut n = 0;
    for (module, i, o) in projections.iter().filter(|(m, _, _)| targets(m)) {
        n += if dropout { 3 * o + 2 * i } else { *o };
        let (prefix, leaf) = module.rsplit_once('.').unwrap_or(("", module.as_str()));
        if leaf == "gate_proj" || leaf == "up_proj" {
            joined_mlp.insert(prefix.to_string());
        }
    }
    (n + joined_mlp.len() * 2 * intermediate) as u64
}

fn elems(shape: &[usize]) -> u64 {
    shape.iter().map(|&d| d as u64).product()
}

/// llama.cpp's tensor names carry the projection as `attn_q`, `ffn_up`, ...: mapped to HF leaf
/// names so that the projections are recognised (only sizes matter here).
fn gguf_to_hf_name(n: &str) -> String {
    const MAP: [(&str, &str); 8] = [
        ("attn_q.", "self_attn.q_proj."),
        ("attn_k.", "self_attn.k_proj."),
        ("attn_v.", "self_attn.v_proj."),
        ("attn_output.", "self_attn.o_proj."),
        ("attn_qkv.", "self_attn.qkv_proj."),
        ("ffn_gate.", "mlp.gate_proj."),
        ("ffn_up.", "mlp.up_proj."),
        ("ffn_down.", "mlp.down_proj."),
    ];
    MAP.iter()
        .find(|(g, _)| n.contains(g))
        .map_or_else(|| n.to_string(), |(g, h)| n.replacen(g, h, 1))
}

/// The safetensors files of an HF directory (`model.safetensors`, or the shards its index
/// names); none when it has only `config.json`.
fn safetensors_files(dir: &Path) -> Result<Vec<std::path::PathBuf>> {
    let has_weights = dir.join("model.safetensors").is_file()
        || dir.join("model.safetensors.index.json").is_file();
    match has_weights {
        true => Ok(grpo_models::files::safetensors_files(dir)?),
        false => Ok(vec![]),
    }
}

/// (name, shape) of every tensor in a safetensors file, from its header only.
pub fn safetensors_shapes(path: &Path) -> Result<Vec<(String, Vec<usize>)>> {
    let mut f =
        std::fs::File::open(path).map_err(|e| Error::file(path, format!("cannot open: {e}")))?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len)
        .map_err(|e| Error::file(path, format!("not a safetensors file: {e}")))?;
    let len = u64::from_le_bytes(len);
    // A header is JSON of a few hundred bytes per tensor; 100 MB would be a corrupt file.
    if len > 100 << 20 {
        return Err(Error::file(
            path,
            format!("not a safetensors file: a header of {len} bytes"),
        ));
    }
    let mut header = vec![0u8; len as usize];
    f.read_exact(&mut header)
        .map_err(|e| Error::file(path, format!("truncated safetensors header: {e}")))?;
    let v: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&header)
        .map_err(|e| Error::file(path, format!("invalid safetensors header: {e}")))?;
    let mut out = Vec::with_capacity(v.len());
    for (name, t) in v.iter().filter(|(n, _)| *n != "__metadata__") {
        let shape = t
            .get("shape")
            .and_then(|s| s.as_array())
            .and_then(|s| s.iter().map(|d| d.as_u64().map(|d| d as usize)).collect())
            .ok_or_else(|| Error::file(path, format!("tensor `{name}` has no valid shape")))?;
        out.push((name.clone(), shape));
    }
    Ok(out)
}
