//! Llama-family decoder (Llama 2/3.x, SmolLM2, TinyLlama, Qwen2/2.5, Qwen3, Mistral, Phi-3,
//! Gemma 2/3), one struct per HF module with HF weight names:
//! `model.layers.N.self_attn.q_proj.weight`, ... Qwen2's q/k/v biases, Qwen3's per-head q/k
//! RMSNorm and the later families' additions ([`super::config::DecoderExtras`]: sliding windows,
//! Phi-3's fused `qkv_proj` / `gate_up_proj` and partial RoPE, Gemma's norms, GeGLU, score scale
//! and softcapping) are fields of the config, not separate code paths.
//!
//! What the fused CPU kernels cannot express takes the candle-op composition, on every device:
//! partial RoPE, softcapped attention. Sliding windows are masks, which the fused attention
//! reads as it reads any mask.

use candle_core::{Module, Result, Tensor};
use candle_nn::VarBuilder;

use std::collections::HashMap;
use std::sync::Arc;

use super::checkpointing::{checkpoint, checkpoint_sharded, CheckpointGrads};
use super::config::{Activation, ModelConfig};
use super::layers::{
    linear, linear_parts, AttnMask, Embedding, FusedLinear, Linear, Mode, ProjMut, RmsNorm, Rope,
};
use super::sharded::Sharded;
use crate::kernels::attention::{attention, softcapped_attention};
use crate::kernels::grad_sink::GradSink;
use crate::kernels::mlp;
use crate::kernels::portable::apply_rope;
#[cfg(feature = "cuda")]
use crate::kernels::rope;
use crate::kernels::rope::rope_heads;
use crate::kernels::Compute;
use crate::kv_cache::KvCache;

/// An RMSNorm of `size` as the family stores it (Gemma's scales by `1 + w`).
fn rms_norm(cfg: &ModelConfig, size: usize, vb: VarBuilder, compute: Compute) -> Result<RmsNorm> {
    match cfg.extras.norm_plus_one {
        true => RmsNorm::load_plus_one(size, cfg.norm_eps, vb, compute),
        false => RmsNorm::load(size, cfg.norm_eps, vb, compute),
    }
}

/// `n` outputs of a projection: its parts, or one joined part cut into `outs` (Phi-3's
/// `qkv_proj` / `gate_up_proj`).
fn split_parts(parts: Vec<Tensor>, outs: &[usize]) -> Result<Vec<Tensor>> {
    if parts.len() == outs.len() {
        return Ok(parts);
    }
    let last = parts[0].rank() - 1;
    let mut start = 0;
    let mut out = Vec::with_capacity(outs.len());
    for &n in outs {
        out.push(parts[0].narrow(last, start, n)?);
        start += n;
    }
    Ok(out)
}

#[derive(Debug, Clone)]
pub struct Attention {
    /// q_proj, k_proj, v_proj as one GEMM (Phi-3: its one `qkv_proj`).
    qkv_proj: FusedLinear,
    o_proj: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    /// Leading dims of each head that RoPE rotates (< head_dim: partial RoPE).
    rotary_dim: usize,
    /// The score scale (`head_dim^-1/2`, or Gemma's `query_pre_attn_scalar^-1/2`).
    scale: f64,
    softcap: Option<f64>,
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
                Some(rms_norm(cfg, hd, vb.pp("q_norm"), compute)?),
                Some(rms_norm(cfg, hd, vb.pp("k_norm"), compute)?),
            )
        } else {
            (None, None)
        };
        let bias = cfg.attention_bias;
        let parts = match cfg.extras.fused_proj_names {
            true => vec![linear_parts(
                h,
                (nh + 2 * nkv) * hd,
                bias,
                vb.pp("qkv_proj"),
            )?],
            false => vec![
                linear_parts(h, nh * hd, bias, vb.pp("q_proj"))?,
                linear_parts(h, nkv * hd, bias, vb.pp("k_proj"))?,
                linear_parts(h, nkv * hd, bias, vb.pp("v_proj"))?,
            ],
        };
        let scale = match cfg.extras.query_pre_attn_scalar {
            Some(s) => 1.0 / s.sqrt(),
            None => 1.0 / (hd as f64).sqrt(),
        };
        Ok(Self {
            qkv_proj: FusedLinear::new(parts)?
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
            rotary_dim: cfg.extras.rotary_dim.unwrap_or(hd),
            scale,
            softcap: cfg.extras.attn_softcap,
            compute,
        })
    }

    /// RoPE on `x` [B, S, heads*D] -> [B, heads, S, D]; a partial RoPE rotates the leading
    /// `rotary_dim` dims of each head and passes the rest (candle ops).
    fn rope(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        heads: usize,
        mode: Mode,
    ) -> Result<Tensor> {
        let (hd, rd) = (self.head_dim, self.rotary_dim);
        if rd == hd {
            return rope_heads(x, cos, sin, heads, mode, self.compute);
        }
        let (b, s, _) = x.dims3()?;
        let x = x.reshape((b, s, heads, hd))?.transpose(1, 2)?; // [B, heads, S, D]
        let rot = apply_rope(&x.narrow(3, 0, rd)?.contiguous()?, cos, sin, mode)?;
        Tensor::cat(&[&rot, &x.narrow(3, rd, hd - rd)?], 3)?.contiguous()
    }

    /// `x` [B, S, H]; `cos`/`sin` [B, S, R/2]; `mask` over Tk key slots. With a cache, the new keys
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
        #[cfg(feature = "cuda")]
        if let (Some((c, layer)), 1, None, None) = (cache, s, &self.q_norm, &self.k_norm) {
            // A GPU's decoding step: q rotated, k and v into the cache, one kernel.
            if self.rotary_dim == hd {
                let (kc, vc) = c.layer_tensors();
                let (kc, vc) = (&kc[layer], &vc[layer]);
                let joined = || self.qkv_proj.forward_joined(x); // [B, 1, (H + 2 Hkv) D]
                let q =
                    rope::rope_append(joined, cos, sin, nh, nkv, kc, vc, c.len(), self.compute)?;
                if let Some(q) = q {
                    let (k, v) = (kc.narrow(2, 0, c.len() + 1)?, vc.narrow(2, 0, c.len() + 1)?);
                    return self.attend(&q, &k, &v, mask, mode); // [B, 1, hidden]
                }
            }
        }
        let outs = [nh * hd, nkv * hd, nkv * hd];
        let qkv = split_parts(self.qkv_proj.forward(x)?, &outs)?; // [B, S, H*D], [B, S, Hkv*D] x 2
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
        let q = self.rope(&q, cos, sin, nh, mode)?; // [B, H, S, D]
        let k = self.rope(&k, cos, sin, nkv, mode)?; // [B, Hkv, S, D]
        let v = qkv[2].reshape((b, s, nkv, hd))?.transpose(1, 2)?; // [B, Hkv, S, D]
        let (k, v) = match cache {
            Some((c, layer)) => c.append(layer, &k, &v)?, // [B, Hkv, Tk, D]
            None => (k, v),
        };
        self.attend(&q, &k, &v, mask, mode)
    }

    /// Attention of `q` [B, H, S, D] over `k`/`v` [B, Hkv, Tk, D], then the output projection
    /// -> [B, S, hidden].
    fn attend(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: &AttnMask,
        mode: Mode,
    ) -> Result<Tensor> {
        let y = match self.softcap {
            Some(cap) => softcapped_attention(q, k, v, mask, self.scale, cap, mode)?,
            None => {
                // `attention` scales by head_dim^-1/2: fold any other scale into q.
                let fold = self.scale * (self.head_dim as f64).sqrt();
                let scaled;
                let q = match (fold - 1.0).abs() > 1e-12 {
                    true => {
                        scaled = (q * fold)?;
                        &scaled
                    }
                    false => q,
                };
                attention(q, k, v, mask, mode, self.compute)?
            }
        }; // [B, S, H*D]
        self.o_proj.forward(&y)
    }
}

#[derive(Debug, Clone)]
pub struct Mlp {
    /// gate_proj and up_proj as one GEMM (Phi-3: its one `gate_up_proj`).
    gate_up_proj: FusedLinear,
    down_proj: Linear,
    intermediate: usize,
    activation: Activation,
    compute: Compute,
}

impl Mlp {
    fn load(cfg: &ModelConfig, vb: VarBuilder, compute: Compute) -> Result<Self> {
        let (h, i, b) = (cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias);
        let parts = match cfg.extras.fused_proj_names {
            true => vec![linear_parts(h, 2 * i, b, vb.pp("gate_up_proj"))?],
            false => vec![
                linear_parts(h, i, b, vb.pp("gate_proj"))?,
                linear_parts(h, i, b, vb.pp("up_proj"))?,
            ],
        };
        Ok(Self {
            gate_up_proj: FusedLinear::new(parts)?
                .with_compute(compute)
                .quantized_if(cfg.build_quantized)?,
            down_proj: linear(i, h, b, vb.pp("down_proj"))?
                .with_compute(compute)
                .quantized_if(cfg.build_quantized)?,
            intermediate: i,
            activation: cfg.extras.activation,
            compute,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if self.activation == Activation::Silu {
            let sinks = (self.gate_up_proj.gpu_sink(), self.down_proj.gpu_sink());
            match mlp::plan(x, self.compute, sinks.0, sinks.1) {
                // Training on a GPU: the whole block as one recorded op.
                mlp::SwiGlu::Block(gu, down) => return mlp::block(x, gu, down),
                mlp::SwiGlu::Joined(compute) => {
                    let gu = self.gate_up_proj.forward_joined(x)?; // [B, S, 2I]
                    return self.down_proj.forward(&mlp::activate(&gu, compute)?);
                }
                mlp::SwiGlu::Parts => {}
            }
        }
        let i = self.intermediate;
        let gu = split_parts(self.gate_up_proj.forward(x)?, &[i, i])?;
        let gate = match self.activation {
            Activation::Silu => gu[0].silu()?,
            // candle's `gelu` is the tanh approximation (`gelu_pytorch_tanh`).
            Activation::GeluTanh => gu[0].gelu()?,
        };
        self.down_proj.forward(&(gate * &gu[1])?)
    }
}

#[derive(Debug, Clone)]
pub struct DecoderLayer {
    self_attn: Attention,
    mlp: Mlp,
    input_layernorm: RmsNorm,
    /// Llama: the norm before the MLP. Gemma: the norm of the attention's output.
    post_attention_layernorm: RmsNorm,
    /// Gemma's sandwich norms: before the MLP and on its output.
    pre_feedforward_layernorm: Option<RmsNorm>,
    post_feedforward_layernorm: Option<RmsNorm>,
}

impl DecoderLayer {
    fn load(cfg: &ModelConfig, vb: VarBuilder, compute: Compute) -> Result<Self> {
        let h = cfg.hidden_size;
        let (pre_ff, post_ff) = match cfg.extras.sandwich_norms {
            true => (
                Some(rms_norm(
                    cfg,
                    h,
                    vb.pp("pre_feedforward_layernorm"),
                    compute,
                )?),
                Some(rms_norm(
                    cfg,
                    h,
                    vb.pp("post_feedforward_layernorm"),
                    compute,
                )?),
            ),
            false => (None, None),
        };
        Ok(Self {
            self_attn: Attention::load(cfg, vb.pp("self_attn"), compute)?,
            mlp: Mlp::load(cfg, vb.pp("mlp"), compute)?,
            input_layernorm: rms_norm(cfg, h, vb.pp("input_layernorm"), compute)?,
            post_attention_layernorm: rms_norm(cfg, h, vb.pp("post_attention_layernorm"), compute)?,
            pre_feedforward_layernorm: pre_ff,
            post_feedforward_layernorm: post_ff,
        })
    }

    /// Attaches `sink` to every projection whose parameters it holds; returns how many.
    fn attach_grad_sink(&mut self, sink: &GradSink) -> Result<usize> {
        let mut n = self.self_attn.qkv_proj.attach_grad_sink(sink)? as usize;
        n += self.self_attn.o_proj.attach_grad_sink(sink)? as usize;
        n += self.mlp.gate_up_proj.attach_grad_sink(sink)? as usize;
        n += self.mlp.down_proj.attach_grad_sink(sink)? as usize;
        Ok(n)
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
        #[cfg(feature = "cuda")]
        if mode == Mode::Train && cache.is_none() && x.track_op() {
            // Training on a GPU: the whole layer as one recorded op where it applies.
            if let Some(y) = self.gpu_layer(x, cos, sin, mask)? {
                return Ok(y);
            }
        }
        let h = self.input_layernorm.forward(x, mode)?;
        let a = self.self_attn.forward(&h, cos, sin, mask, cache, mode)?;
        match (
            &self.pre_feedforward_layernorm,
            &self.post_feedforward_layernorm,
        ) {
            (Some(pre), Some(post)) => {
                let x = (x + self.post_attention_layernorm.forward(&a, mode)?)?;
                let m = self.mlp.forward(&pre.forward(&x, mode)?)?;
                x + post.forward(&m, mode)?
            }
            _ => {
                let (x, h) = self.post_attention_layernorm.forward_added(x, &a, mode)?;
                x + self.mlp.forward(&h)?
            }
        }
    }
}

#[cfg(feature = "cuda")]
impl DecoderLayer {
    /// The layer's training forward as [`crate::kernels::gpu_layer::GpuLayer`] (one recorded op) when
    /// it is a plain Llama layer on a GPU whose projections all have GPU sinks (no bias,
    /// adapter, q/k norm, softcapping, partial RoPE or sandwich norm; SiLU), its mask dense and
    /// the op passed its check; else `None` (the caller runs candle's graph).
    fn gpu_layer(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: &AttnMask,
    ) -> Result<Option<Tensor>> {
        let a = &self.self_attn;
        let plain = self.pre_feedforward_layernorm.is_none()
            && self.post_feedforward_layernorm.is_none()
            && a.q_norm.is_none()
            && a.k_norm.is_none()
            && a.softcap.is_none()
            && a.rotary_dim == a.head_dim
            && self.mlp.activation == Activation::Silu;
        let sinks = (
            a.qkv_proj.gpu_sink(),
            a.o_proj.gpu_sink(),
            self.mlp.gate_up_proj.gpu_sink(),
            self.mlp.down_proj.gpu_sink(),
        );
        let (Some(qkv), Some(o), Some(gate_up), Some(down)) = sinks else {
            return Ok(None);
        };
        let dense = match mask {
            AttnMask::Dense(m) | AttnMask::Spanned(m, _) => m,
            _ => return Ok(None),
        };
        let shape = crate::kernels::gpu_layer::LayerShape {
            hidden: x.dim(candle_core::D::Minus1)?,
            heads: a.num_heads,
            kv_heads: a.num_kv_heads,
            head_dim: a.head_dim,
            intermediate: down.in_dim(),
        };
        if !plain || !crate::kernels::gpu_layer::usable(a.compute, x.device(), shape, x.dtype()) {
            return Ok(None);
        }
        let layer = crate::kernels::gpu_layer::GpuLayer {
            qkv: qkv.clone(),
            o: o.clone(),
            gate_up: gate_up.clone(),
            down: down.clone(),
            heads: a.num_heads,
            kv_heads: a.num_kv_heads,
            head_dim: a.head_dim,
            scale: a.scale,
            eps_in: self.input_layernorm.eps(),
            eps_post: self.post_attention_layernorm.eps(),
        };
        layer.forward(
            x,
            self.input_layernorm.weight(),
            self.post_attention_layernorm.weight(),
            cos,
            sin,
            dense,
        )
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
    /// The sliding layers' tables when their RoPE base differs (Gemma 3).
    rope_local: Option<Rope>,
    /// The window and, per layer, whether it slides (empty: none does).
    sliding_window: Option<usize>,
    sliding: Vec<bool>,
    /// Embeddings are multiplied by this (Gemma).
    embed_scale: Option<f64>,
    /// HF module names of the fused projections (Phi-3) instead of the parts'.
    fused_proj_names: bool,
    /// The fused decoding step computes this model ([`Self::decode_plan`]): no partial RoPE,
    /// softcapping, Gemma layer or window that differs between layers.
    plain_decoder: bool,
    /// The blocks when their parameters live elsewhere (ZeRO-3; `layers` is then empty).
    sharded: Option<Arc<Sharded>>,
}

impl Model {
    /// `vb` is rooted at the checkpoint root (keys `model.*`, `lm_head.weight`); the layers run
    /// `compute`'s code.
    pub fn load(cfg: &ModelConfig, vb: VarBuilder, compute: Compute) -> Result<Self> {
        let layers = (0..cfg.num_layers)
            .map(|i| DecoderLayer::load(cfg, vb.pp("model").pp("layers").pp(i), compute))
            .collect::<Result<Vec<_>>>()?;
        Self::assemble(cfg, vb, compute, layers, None)
    }

    /// The model without its blocks' parameters, which `sharded` fetches for each training
    /// forward (ZeRO-3): `vb` holds the rest (embedding, final norm, untied LM head).
    pub(super) fn load_sharded(
        cfg: &ModelConfig,
        vb: VarBuilder,
        compute: Compute,
        sharded: Sharded,
    ) -> Result<Self> {
        Self::assemble(cfg, vb, compute, vec![], Some(Arc::new(sharded)))
    }

    fn assemble(
        cfg: &ModelConfig,
        vb: VarBuilder,
        compute: Compute,
        layers: Vec<DecoderLayer>,
        sharded: Option<Arc<Sharded>>,
    ) -> Result<Self> {
        let m = vb.pp("model");
        let embed = m
            .pp("embed_tokens")
            .get((cfg.vocab_size, cfg.hidden_size), "weight")?;
        let lm_head = if cfg.tie_word_embeddings {
            embed.clone()
        } else {
            vb.pp("lm_head")
                .get((cfg.vocab_size, cfg.hidden_size), "weight")?
        };
        let x = &cfg.extras;
        // A window as long as the positions masks nothing.
        let window = x
            .sliding_window
            .filter(|&w| w < cfg.max_position_embeddings);
        let sliding = match window {
            Some(_) => x.sliding_layers.clone(),
            None => vec![],
        };
        let rope_local = match (x.rope_local_theta, sliding.iter().any(|&s| s)) {
            (Some(t), true) => Some(Rope::with_theta(cfg, t, None, vb.device())?),
            _ => None,
        };
        let uniform_window = sliding.iter().all(|&s| s) || sliding.iter().all(|&s| !s);
        let plain_decoder = uniform_window
            && x.rotary_dim.is_none()
            && !x.norm_plus_one
            && x.embed_scale.is_none()
            && x.activation == Activation::Silu
            && !x.sandwich_norms
            && x.query_pre_attn_scalar.is_none()
            && x.attn_softcap.is_none()
            && x.final_softcap.is_none();
        Ok(Self {
            embed_tokens: Embedding::new(embed),
            layers,
            norm: rms_norm(cfg, cfg.hidden_size, m.pp("norm"), compute)?,
            lm_head,
            rope: Rope::new(cfg, vb.device())?,
            rope_local,
            sliding_window: window.filter(|_| sliding.iter().any(|&s| s)),
            sliding,
            embed_scale: x.embed_scale,
            fused_proj_names: x.fused_proj_names,
            plain_decoder,
            sharded,
        })
    }

    pub fn lm_head(&self) -> &Tensor {
        &self.lm_head
    }

    /// Attaches `sink` to every projection whose parameters it holds; returns how many.
    pub fn attach_grad_sink(&mut self, sink: &GradSink) -> Result<usize> {
        let mut n = self.embed_tokens.attach_grad_sink(sink)? as usize;
        for l in &mut self.layers {
            n += l.attach_grad_sink(sink)?;
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
            let (qkv, gate_up): (&[&str], &[&str]) = match self.fused_proj_names {
                true => (&["self_attn.qkv_proj"], &["mlp.gate_up_proj"]),
                false => (
                    &["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                    &["mlp.gate_proj", "mlp.up_proj"],
                ),
            };
            out.push((names(qkv), ProjMut::Fused(&mut attn.qkv_proj)));
            out.push((
                names(&["self_attn.o_proj"]),
                ProjMut::Single(&mut attn.o_proj),
            ));
            out.push((names(gate_up), ProjMut::Fused(&mut l.mlp.gate_up_proj)));
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

    /// The window every layer attends through, when all do (Mistral): the fused decoding step
    /// then takes it as left padding ([`AttnMask::windowed`]).
    pub fn uniform_window(&self) -> Option<usize> {
        self.sliding_window
            .filter(|_| self.sliding.iter().all(|&s| s))
    }

    /// The weights as the fused CPU decoding step takes them, when every projection is packed
    /// with nothing added to it and the norms are f32 ([`crate::kernels::cpu::decode`]); else `None`.
    pub fn decode_plan(&self) -> Result<Option<crate::kernels::cpu::decode::Plan>> {
        let Some(first) = self.layers.first().filter(|_| self.plain_decoder) else {
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
                ) => layers.push(crate::kernels::cpu::decode::LayerPlan {
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
        Ok(Some(crate::kernels::cpu::decode::Plan {
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
        let trains = mode == Mode::Train && cache.is_none() && ckpt.is_some();
        if self.sharded.is_some() && !trains {
            candle_core::bail!("{}", Sharded::REFUSED);
        }
        let mut x = self.embed_tokens.forward(ids)?; // [B, S, H]
        if let Some(scale) = self.embed_scale {
            // HF rounds the scale to the activations' dtype first.
            let scale = Tensor::new(scale as f32, x.device())?.to_dtype(x.dtype())?;
            x = x.broadcast_mul(&scale)?;
        }
        let (cos, sin) = self.rope.tables(positions, x.dtype())?; // [B, S, R/2]
        let local = match &self.rope_local {
            Some(r) => Some(r.tables(positions, x.dtype())?),
            None => None,
        };
        let s = ids.dim(1)?;
        // Off the fused CPU path every layer would turn left padding into a dense mask on the
        // host and upload it (a GPU's decoding step did that once per layer): do it once here.
        // On a GPU the prompt's shared slots go along as each row's leader, on the device.
        let compute = self.layers.first().map(|l| l.self_attn.compute);
        let dense_once;
        let mask = match (mask, cache.as_deref(), self.sliding_window) {
            (AttnMask::LeftPad(..), Some(c), None) => {
                match mask.for_every_layer(s, c.len() + s, ids.device(), compute)? {
                    Some(m) => {
                        dense_once = m;
                        &dense_once
                    }
                    None => mask,
                }
            }
            _ => mask,
        };
        let windowed = match self.sliding_window {
            Some(w) => {
                Some(mask.windowed(w, Some(positions), cache.as_deref().map(|c| c.len()))?)
            }
            None => None,
        };
        let blocks = match &self.sharded {
            Some(sh) => sh.num_layers(),
            None => self.layers.len(),
        };
        for i in 0..blocks {
            let slides = self.sliding.get(i).copied().unwrap_or(false);
            let mask = match (&windowed, slides) {
                (Some(w), true) => w,
                _ => mask,
            };
            let (cos, sin) = match (&local, slides) {
                (Some((c, s)), true) => (c, s),
                _ => (&cos, &sin),
            };
            x = match (&self.sharded, ckpt, &cache, self.layers.get(i)) {
                (Some(sh), Some(g), None, _) if mode == Mode::Train => {
                    sharded_block(sh, i, &x, g, cos, sin, mask)?
                }
                (Some(_), ..) => candle_core::bail!("{}", Sharded::REFUSED),
                (None, Some(g), None, Some(layer)) if mode == Mode::Train => {
                    let (l, c, sn, m) = (layer.clone(), cos.clone(), sin.clone(), mask.clone());
                    checkpoint(&x, g, move |h| l.forward(h, &c, &sn, &m, None, Mode::Train))?
                }
                (None, _, _, Some(layer)) => {
                    let c = cache.as_deref().map(|c| (c, i));
                    layer.forward(&x, cos, sin, mask, c, mode)?
                }
                (None, _, _, None) => candle_core::bail!("no layer {i}"),
            };
        }
        if let Some(c) = cache {
            c.advance(s);
        }
        self.norm.forward(&x, mode)
    }
}

/// Block `i`'s training forward over `x` [B, S, H] with its parameters from `sh` (ZeRO-3),
/// checkpointed ([`checkpoint_sharded`]); its RoPE tables `cos`/`sin` and mask are chosen by
/// the caller, as for a kept layer -> [B, S, H].
fn sharded_block(
    sh: &Sharded,
    i: usize,
    x: &Tensor,
    grads: &Arc<CheckpointGrads>,
    cos: &Tensor,
    sin: &Tensor,
    mask: &AttnMask,
) -> Result<Tensor> {
    let (cfg, compute, dtype, device) = (sh.cfg.clone(), sh.compute, sh.dtype, sh.device.clone());
    let (c, s, m) = (cos.clone(), sin.clone(), mask.clone());
    let block = move |tensors: HashMap<String, Tensor>,
                      sink: Option<&GradSink>,
                      h: &Tensor|
          -> Result<Tensor> {
        let vb = VarBuilder::from_tensors(tensors, dtype, &device);
        let mut layer = DecoderLayer::load(&cfg, vb.pp("model").pp("layers").pp(i), compute)?;
        if let Some(sink) = sink {
            layer.attach_grad_sink(sink)?;
        }
        layer.forward(h, &c, &s, &m, None, Mode::Train) // [B, S, H]
    };
    checkpoint_sharded(x, grads, &sh.blocks, i, compute, dtype, block)
}
