//! GPT-2 (`GPT2LMHeadModel`) with HF weight names: `transformer.h.N.attn.c_attn.weight`, ...
//! HF stores GPT-2's projections as `Conv1D` weights `[in, out]`, which is already the layout
//! [`Linear`] computes with: the checkpoint tensors are used as they are.

use candle_core::{Module, Result, Tensor};
use candle_nn::VarBuilder;

use std::sync::Arc;

use super::checkpointing::{checkpoint, CheckpointGrads};
use super::config::ModelConfig;
use super::layers::{AttnMask, Embedding, LayerNorm, Linear, Mode, ProjMut};
use crate::kernels::attention::attention;
use crate::kernels::grad_sink::GradSink;
use crate::kernels::Compute;
use crate::kv_cache::KvCache;

/// HF `Conv1D`: weight `[in, out]`, bias `[out]`.
fn conv1d(in_dim: usize, out_dim: usize, vb: VarBuilder, compute: Compute) -> Result<Linear> {
    let w = vb.get((in_dim, out_dim), "weight")?;
    let b = vb.get(out_dim, "bias")?;
    Ok(Linear::from_in_out(w, Some(b))?.with_compute(compute))
}

#[derive(Debug, Clone)]
pub struct Attention {
    c_attn: Linear,
    c_proj: Linear,
    num_heads: usize,
    head_dim: usize,
    compute: Compute,
}

impl Attention {
    fn load(cfg: &ModelConfig, vb: VarBuilder, compute: Compute) -> Result<Self> {
        let h = cfg.hidden_size;
        let q = cfg.build_quantized;
        Ok(Self {
            c_attn: conv1d(h, 3 * h, vb.pp("c_attn"), compute)?.quantized_if(q)?,
            c_proj: conv1d(h, h, vb.pp("c_proj"), compute)?.quantized_if(q)?,
            num_heads: cfg.num_heads,
            head_dim: cfg.head_dim,
            compute,
        })
    }

    fn forward(
        &self,
        x: &Tensor,
        mask: &AttnMask,
        cache: Option<(&KvCache, usize)>,
        mode: Mode,
    ) -> Result<Tensor> {
        let (b, s, h) = x.dims3()?;
        let (nh, hd) = (self.num_heads, self.head_dim);
        let qkv = self.c_attn.forward(x)?; // [B, S, 3H]
        let split = |i: usize| -> Result<Tensor> {
            qkv.narrow(2, i * h, h)?
                .reshape((b, s, nh, hd))?
                .transpose(1, 2) // [B, nh, S, hd]
        };
        let (q, k, v) = (split(0)?, split(1)?, split(2)?);
        let (k, v) = match cache {
            Some((c, layer)) => c.append(layer, &k, &v)?,
            None => (k, v),
        };
        let y = attention(&q, &k, &v, mask, mode, self.compute)?; // [B, S, H]
        self.c_proj.forward(&y)
    }
}

#[derive(Debug, Clone)]
pub struct Mlp {
    c_fc: Linear,
    c_proj: Linear,
}

impl Mlp {
    fn load(cfg: &ModelConfig, vb: VarBuilder, compute: Compute) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        Ok(Self {
            c_fc: conv1d(h, i, vb.pp("c_fc"), compute)?.quantized_if(cfg.build_quantized)?,
            c_proj: conv1d(i, h, vb.pp("c_proj"), compute)?.quantized_if(cfg.build_quantized)?,
        })
    }
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // candle's `gelu` is the tanh approximation, i.e. HF's `gelu_new`.
        self.c_proj.forward(&self.c_fc.forward(x)?.gelu()?)
    }
}

#[derive(Debug, Clone)]
pub struct Block {
    ln_1: LayerNorm,
    attn: Attention,
    ln_2: LayerNorm,
    mlp: Mlp,
}

impl Block {
    fn load(cfg: &ModelConfig, vb: VarBuilder, compute: Compute) -> Result<Self> {
        Ok(Self {
            ln_1: LayerNorm::load(cfg.hidden_size, cfg.norm_eps, vb.pp("ln_1"))?,
            attn: Attention::load(cfg, vb.pp("attn"), compute)?,
            ln_2: LayerNorm::load(cfg.hidden_size, cfg.norm_eps, vb.pp("ln_2"))?,
            mlp: Mlp::load(cfg, vb.pp("mlp"), compute)?,
        })
    }

    fn forward(
        &self,
        x: &Tensor,
        mask: &AttnMask,
        cache: Option<(&KvCache, usize)>,
        mode: Mode,
    ) -> Result<Tensor> {
        let x = (x + self
            .attn
            .forward(&self.ln_1.forward(x, mode)?, mask, cache, mode)?)?;
        &x + self.mlp.forward(&self.ln_2.forward(&x, mode)?)?
    }
}

#[derive(Debug, Clone)]
pub struct Model {
    wte: Embedding,
    wpe: Embedding,
    h: Vec<Block>,
    ln_f: LayerNorm,
    lm_head: Tensor,
    n_positions: usize,
}

impl Model {
    /// Attaches `sink` to every projection whose parameters it holds; returns how many.
    pub fn attach_grad_sink(&mut self, sink: &GradSink) -> Result<usize> {
        let mut n = self.wte.attach_grad_sink(sink)? as usize;
        n += self.wpe.attach_grad_sink(sink)? as usize;
        for b in &mut self.h {
            n += b.attn.c_attn.attach_grad_sink(sink)? as usize;
            n += b.attn.c_proj.attach_grad_sink(sink)? as usize;
            n += b.mlp.c_fc.attach_grad_sink(sink)? as usize;
            n += b.mlp.c_proj.attach_grad_sink(sink)? as usize;
        }
        Ok(n)
    }

    /// `vb` is rooted at the checkpoint root (keys `transformer.*`, optional `lm_head.weight`).
    pub fn load(cfg: &ModelConfig, vb: VarBuilder, compute: Compute) -> Result<Self> {
        let t = vb.pp("transformer");
        let wte = t
            .pp("wte")
            .get((cfg.vocab_size, cfg.hidden_size), "weight")?;
        let wpe = t
            .pp("wpe")
            .get((cfg.max_position_embeddings, cfg.hidden_size), "weight")?;
        let h = (0..cfg.num_layers)
            .map(|i| Block::load(cfg, t.pp("h").pp(i), compute))
            .collect::<Result<Vec<_>>>()?;
        let lm_head = if cfg.tie_word_embeddings {
            wte.clone()
        } else {
            vb.pp("lm_head")
                .get((cfg.vocab_size, cfg.hidden_size), "weight")?
        };
        Ok(Self {
            wte: Embedding::new(wte),
            wpe: Embedding::new(wpe),
            h,
            ln_f: LayerNorm::load(cfg.hidden_size, cfg.norm_eps, t.pp("ln_f"))?,
            lm_head,
            n_positions: cfg.max_position_embeddings,
        })
    }

    pub fn lm_head(&self) -> &Tensor {
        &self.lm_head
    }

    /// Every projection with its HF module path.
    pub fn projections_mut(&mut self) -> Vec<(Vec<String>, ProjMut<'_>)> {
        let mut out = Vec::with_capacity(self.h.len() * 4);
        for (i, b) in self.h.iter_mut().enumerate() {
            let p = format!("transformer.h.{i}");
            out.push((
                vec![format!("{p}.attn.c_attn")],
                ProjMut::Single(&mut b.attn.c_attn),
            ));
            out.push((
                vec![format!("{p}.attn.c_proj")],
                ProjMut::Single(&mut b.attn.c_proj),
            ));
            out.push((
                vec![format!("{p}.mlp.c_fc")],
                ProjMut::Single(&mut b.mlp.c_fc),
            ));
            out.push((
                vec![format!("{p}.mlp.c_proj")],
                ProjMut::Single(&mut b.mlp.c_proj),
            ));
        }
        out
    }

    pub fn max_positions(&self) -> usize {
        self.n_positions
    }

    /// Same contract as [`super::llama::Model::forward_hidden`].
    pub fn forward_hidden(
        &self,
        ids: &Tensor,
        positions: &Tensor,
        mask: &AttnMask,
        cache: Option<&mut KvCache>,
        mode: Mode,
        ckpt: Option<&Arc<CheckpointGrads>>,
    ) -> Result<Tensor> {
        let mut x = (self.wte.forward(ids)? + self.wpe.forward(positions)?)?; // [B, S, H]
        let s = ids.dim(1)?;
        for (i, block) in self.h.iter().enumerate() {
            x = match (ckpt, &cache) {
                (Some(g), None) if mode == Mode::Train => {
                    let (b, m) = (block.clone(), mask.clone());
                    checkpoint(&x, g, move |h| b.forward(h, &m, None, Mode::Train))?
                }
                _ => {
                    let c = cache.as_deref().map(|c| (c, i));
                    block.forward(&x, mask, c, mode)?
                }
            };
        }
        if let Some(c) = cache {
            c.advance(s);
        }
        self.ln_f.forward(&x, mode)
    }
}
