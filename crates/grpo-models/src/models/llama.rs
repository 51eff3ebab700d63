//! Llama-family decoder (Llama 2/3.x, SmolLM2, TinyLlama, Qwen2/2.5, Qwen3), one struct per HF
//! module with HF weight names: `model.layers.N.self_attn.q_proj.weight`, ... Qwen2's q/k/v biases
//! and Qwen3's per-head q/k RMSNorm are flags on the config, not separate code paths.

use candle_core::{Module, Result, Tensor};
use candle_nn::VarBuilder;

use std::sync::Arc;

use super::checkpointing::{checkpoint, CheckpointGrads};
use super::config::ModelConfig;
use super::grad_sink::GradSink;
use super::layers::{
    attention, linear, linear_parts, rope_heads, AttnMask, Embedding, FusedLinear, Linear, Mode,
    ProjMut, RmsNorm, Rope,
};
use crate::kernels::Compute;
use crate::kv_cache::KvCache;

#[derive(Debug, Clone)]
pub struct Attention {
    /// q_proj, k_proj, v_proj as one GEMM.
    qkv_proj: FusedLinear,
    o_proj: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    compute: Compute,
}

impl Attention {
    fn load(cfg: &ModelConfig, vb: VarBuilder, compute: Compute) -> Result<Self> {
        let (h, nh, nkv, hd) = (
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        );
        let (q_norm, k_norm) = if cfg.qk_norm {
            (
                Some(RmsNorm::load(hd, cfg.norm_eps, vb.pp("q_norm"), compute)?),
                Some(RmsNorm::load(hd, cfg.norm_eps, vb.pp("k_norm"), compute)?),
            )
        } else {
            (None, None)
        };
        Ok(Self {
            qkv_proj: FusedLinear::new(vec![
                linear_parts(h, nh * hd, cfg.attention_bias, vb.pp("q_proj"))?,
                linear_parts(h, nkv * hd, cfg.attention_bias, vb.pp("k_proj"))?,
                linear_parts(h, nkv * hd, cfg.attention_bias, vb.pp("v_proj"))?,
            ])?
            .with_compute(compute)
            .quantized_if(cfg.build_quantized)?,
            o_proj: linear(nh * hd, h, cfg.mlp_bias, vb.pp("o_proj"))?
                .with_compute(compute)
                .quantized_if(cfg.build_quantized)?,
            q_norm,
            k_norm,
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: hd,
            compute,
        })
    }

    /// `x` [B, S, H]; `cos`/`sin` [B, S, D/2]; `mask` over Tk key slots. With a cache, the new keys
    /// are written into it and attention reads all cached slots; without, Tk = S.
    fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: &AttnMask,
        cache: Option<(&KvCache, usize)>,
        mode: Mode,
    ) -> Result<Tensor> {
        let (b, s, _) = x.dims3()?;
        let (nh, nkv, hd) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let qkv = self.qkv_proj.forward(x)?; // views [B, S, H*D], [B, S, Hkv*D] x 2
        let normed = |t: &Tensor, n: &Option<RmsNorm>, heads: usize| -> Result<Tensor> {
            match n {
                Some(n) => {
                    n.forward(&t.reshape((b, s, heads, hd))?, mode)?
                        .reshape((b, s, heads * hd))
                }
                None => Ok(t.clone()),
            }
        };
        let q = normed(&qkv[0], &self.q_norm, nh)?;
        let k = normed(&qkv[1], &self.k_norm, nkv)?;
        let q = rope_heads(&q, cos, sin, nh, mode, self.compute)?; // [B, H, S, D]
        let k = rope_heads(&k, cos, sin, nkv, mode, self.compute)?; // [B, Hkv, S, D]
        let v = qkv[2].reshape((b, s, nkv, hd))?.transpose(1, 2)?; // [B, Hkv, S, D]
        let (k, v) = match cache {
            Some((c, layer)) => c.append(layer, &k, &v)?, // [B, Hkv, Tk, D]
            None => (k, v),
        };
        let y = attention(&q, &k, &v, mask, mode, self.compute)?; // [B, S, H*D]
        self.o_proj.forward(&y)
    }
}

#[derive(Debug, Clone)]
pub struct Mlp {
    /// gate_proj and up_proj as one GEMM.
    gate_up_proj: FusedLinear,
    down_proj: Linear,
    compute: Compute,
}

impl Mlp {
    fn load(cfg: &ModelConfig, vb: VarBuilder, compute: Compute) -> Result<Self> {
        let (h, i, b) = (cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias);
        Ok(Self {
            gate_up_proj: FusedLinear::new(vec![
                linear_parts(h, i, b, vb.pp("gate_proj"))?,
                linear_parts(h, i, b, vb.pp("up_proj"))?,
            ])?
            .with_compute(compute)
            .quantized_if(cfg.build_quantized)?,
            down_proj: linear(i, h, b, vb.pp("down_proj"))?
                .with_compute(compute)
                .quantized_if(cfg.build_quantized)?,
            compute,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if self.compute.fuses(x) {
            let gu = self.gate_up_proj.forward_joined(x)?; // [B, S, 2I]
            return self.down_proj.forward(&super::fused::silu_mul(&gu)?);
        }
        let gu = self.gate_up_proj.forward(x)?;
        self.down_proj.forward(&(gu[0].silu()? * &gu[1])?)
    }
}

#[derive(Debug, Clone)]
pub struct DecoderLayer {
    self_attn: Attention,
    mlp: Mlp,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
}

impl DecoderLayer {
    fn load(cfg: &ModelConfig, vb: VarBuilder, compute: Compute) -> Result<Self> {
        Ok(Self {
            self_attn: Attention::load(cfg, vb.pp("self_attn"), compute)?,
            mlp: Mlp::load(cfg, vb.pp("mlp"), compute)?,
            input_layernorm: RmsNorm::load(
                cfg.hidden_size,
                cfg.norm_eps,
                vb.pp("input_layernorm"),
                compute,
            )?,
            post_attention_layernorm: RmsNorm::load(
                cfg.hidden_size,
                cfg.norm_eps,
                vb.pp("post_attention_layernorm"),
                compute,
            )?,
        })
    }

    fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: &AttnMask,
        cache: Option<(&KvCache, usize)>,
        mode: Mode,
    ) -> Result<Tensor> {
        let h = self.input_layernorm.forward(x, mode)?;
        let x = (x + self.self_attn.forward(&h, cos, sin, mask, cache, mode)?)?;
        let h = self.post_attention_layernorm.forward(&x, mode)?;
        x + self.mlp.forward(&h)?
    }
}

/// `LlamaForCausalLM` / `Qwen2ForCausalLM` / `Qwen3ForCausalLM`.
#[derive(Debug, Clone)]
pub struct Model {
    embed_tokens: Embedding,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: Tensor,
    rope: Rope,
}

impl Model {
    /// `vb` is rooted at the checkpoint root (keys `model.*`, `lm_head.weight`); the layers run
    /// `compute`'s code.
    pub fn load(cfg: &ModelConfig, vb: VarBuilder, compute: Compute) -> Result<Self> {
        let m = vb.pp("model");
        let embed = m
            .pp("embed_tokens")
            .get((cfg.vocab_size, cfg.hidden_size), "weight")?;
        let layers = (0..cfg.num_layers)
            .map(|i| DecoderLayer::load(cfg, m.pp("layers").pp(i), compute))
            .collect::<Result<Vec<_>>>()?;
        let lm_head = if cfg.tie_word_embeddings {
            embed.clone()
        } else {
            vb.pp("lm_head")
                .get((cfg.vocab_size, cfg.hidden_size), "weight")?
        };
        Ok(Self {
            embed_tokens: Embedding::new(embed),
            layers,
            norm: RmsNorm::load(cfg.hidden_size, cfg.norm_eps, m.pp("norm"), compute)?,
            lm_head,
            rope: Rope::new(cfg, vb.device())?,
        })
    }

    pub fn lm_head(&self) -> &Tensor {
        &self.lm_head
    }

    /// Attaches `sink` to every projection whose parameters it holds; returns how many.
    pub fn attach_grad_sink(&mut self, sink: &GradSink) -> Result<usize> {
        let mut n = self.embed_tokens.attach_grad_sink(sink)? as usize;
        for l in &mut self.layers {
            n += l.self_attn.qkv_proj.attach_grad_sink(sink)? as usize;
            n += l.self_attn.o_proj.attach_grad_sink(sink)? as usize;
            n += l.mlp.gate_up_proj.attach_grad_sink(sink)? as usize;
            n += l.mlp.down_proj.attach_grad_sink(sink)? as usize;
        }
        Ok(n)
    }

    /// Every projection with its HF module path(s).
    pub fn projections_mut(&mut self) -> Vec<(Vec<String>, ProjMut<'_>)> {
        let mut out = Vec::with_capacity(self.layers.len() * 4);
        for (i, l) in self.layers.iter_mut().enumerate() {
            let p = format!("model.layers.{i}");
            let names = |parts: &[&str]| -> Vec<String> {
                parts.iter().map(|n| format!("{p}.{n}")).collect()
            };
            let attn = &mut l.self_attn;
            out.push((
                names(&["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
                ProjMut::Fused(&mut attn.qkv_proj),
            ));
            out.push((
                names(&["self_attn.o_proj"]),
                ProjMut::Single(&mut attn.o_proj),
            ));
            out.push((
                names(&["mlp.gate_proj", "mlp.up_proj"]),
                ProjMut::Fused(&mut l.mlp.gate_up_proj),
            ));
            out.push((
                names(&["mlp.down_proj"]),
                ProjMut::Single(&mut l.mlp.down_proj),
            ));
        }
        out
    }

    pub fn max_positions(&self) -> usize {
        self.rope.max_positions()
    }

    /// The weights as the fused CPU decoding step takes them, when every projection is packed
    /// with nothing added to it and the norms are f32 ([`super::decode_cpu`]); else `None`.
    pub fn decode_plan(&self) -> Result<Option<super::decode_cpu::Plan>> {
        let Some(first) = self.layers.first() else {
            return Ok(None);
        };
        let a = &first.self_attn;
        let (heads, kv_heads, head_dim) = (a.num_heads, a.num_kv_heads, a.head_dim);
        let (intermediate, hidden) = first.mlp.down_proj.dims()?; // (in, out)
        let eps = self.norm.eps() as f32;
        let mut layers = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            let at = &l.self_attn;
            let norm_of = |n: &Option<RmsNorm>| -> Result<Option<Option<Vec<f32>>>> {
                match n {
                    Some(n) => Ok(n.host_weight()?.map(Some)),
                    None => Ok(Some(None)),
                }
            };
            let norms = (
                l.input_layernorm.host_weight()?,
                l.post_attention_layernorm.host_weight()?,
                norm_of(&at.q_norm)?,
                norm_of(&at.k_norm)?,
            );
            let projs = (
                at.qkv_proj.packed_parts()?,
                at.o_proj.packed_parts()?,
                l.mlp.gate_up_proj.packed_parts()?,
                l.mlp.down_proj.packed_parts()?,
            );
            let same_eps = [&l.input_layernorm, &l.post_attention_layernorm]
                .into_iter()
                .chain(at.q_norm.iter())
                .chain(at.k_norm.iter())
                .all(|n| n.eps() as f32 == eps);
            match (norms, projs, same_eps) {
                (
                    (
                        Some(input_layernorm),
                        Some(post_attention_layernorm),
                        Some(q_norm),
                        Some(k_norm),
                    ),
                    (Some(qkv), Some(o), Some(gate_up), Some(down)),
                    true,
                ) => layers.push(super::decode_cpu::LayerPlan {
                    input_layernorm,
                    post_attention_layernorm,
                    q_norm,
                    k_norm,
                    qkv,
                    o,
                    gate_up,
                    down,
                }),
                _ => return Ok(None),
            }
        }
        let Some(norm) = self.norm.host_weight()? else {
            return Ok(None);
        };
        let (cos, sin) = self.rope.tables_all();
        Ok(Some(super::decode_cpu::Plan {
            layers,
            norm,
            eps,
            heads,
            kv_heads,
            head_dim,
            hidden,
            intermediate,
            embed: self.embed_tokens.weight().clone(),
            cos: cos.clone(),
            sin: sin.clone(),
        }))
    }

    /// Final hidden states [B, S, H] for `ids` [B, S] at `positions` [B, S] with `mask`
    /// over Tk key slots. Without a cache this is the all-position training forward (Tk = S); with one
    /// it is the incremental decoding forward and the cache is advanced by S.
    pub fn forward_hidden(
        &self,
        ids: &Tensor,
        positions: &Tensor,
        mask: &AttnMask,
        cache: Option<&mut KvCache>,
        mode: Mode,
        ckpt: Option<&Arc<CheckpointGrads>>,
    ) -> Result<Tensor> {
        let mut x = self.embed_tokens.forward(ids)?; // [B, S, H]
        let (cos, sin) = self.rope.tables(positions, x.dtype())?; // [B, S, D/2]
        let s = ids.dim(1)?;
        for (i, layer) in self.layers.iter().enumerate() {
            x = match (ckpt, &cache) {
                (Some(g), None) if mode == Mode::Train => {
                    let (l, c, sn, m) = (layer.clone(), cos.clone(), sin.clone(), mask.clone());
                    checkpoint(&x, g, move |h| l.forward(h, &c, &sn, &m, None, Mode::Train))?
                }
                _ => {
                    let c = cache.as_deref().map(|c| (c, i));
                    layer.forward(&x, &cos, &sin, mask, c, mode)?
                }
            };
        }
        if let Some(c) = cache {
            c.advance(s);
        }
        self.norm.forward(&x, mode)
    }
}
