//! Causal language models with two explicit forwards:
//! - [`CausalLm::forward_hidden`]: all positions of a [`SeqBatch`], differentiable in
//!   [`Mode::Train`] (training), or with fused kernels in [`Mode::Infer`] (reference log-probs);
//! - [`CausalLm::forward_cached`]: an incremental step over an external [`KvCache`] (sampling).
//!
//! Both return final hidden states; the LM head is applied separately ([`CausalLm::logits`]) so
//! callers can apply it only where they need logits (the last position when sampling, completion
//! positions when training).
//!
//! [`encoder`] holds the frozen reward models: BERT-like sequence classifiers, decoder
//! (Llama / Qwen2) sequence classifiers built on [`CausalLm`], and the sentence embedder.

pub mod checkpointing;
pub mod config;
pub mod encoder;
pub mod gpt2;
pub mod layers;
pub mod llama;
pub mod lora;
pub mod masked_lm;
mod seq_cls;
mod sharded;

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;

pub use checkpointing::{block_of, BlockParams};
pub use config::{Arch, ModelConfig};
pub use layers::{AttnMask, Mode, ProjMut, SharedPrefix};
pub use lora::{LoraAdapter, LoraDropout};
// Frozen quantized projections are a kernel of the CPU ([`crate::kernels::cpu::quant`]); the
// models name their kinds here.
pub use crate::kernels::cpu::quant::{QuantProj, QuantType};

use crate::kernels::cpu::{decode as decode_cpu, gemm_bf16, packed};
use crate::kernels::{grad_sink, Compute};
use crate::kv_cache::KvCache;
use crate::{Error, Result};

#[derive(Debug, Clone)]
enum Inner {
    Llama(llama::Model),
    Gpt2(gpt2::Model),
}

/// A loaded causal LM: configuration plus weights.
#[derive(Debug, Clone)]
pub struct CausalLm {
    cfg: ModelConfig,
    inner: Inner,
    dtype: DType,
    device: Device,
    /// Which code the layers run, resolved once when the model is built.
    compute: Compute,
    /// The LM head with its weight's gradient into a [`grad_sink::GradSink`], once attached.
    head: Option<grad_sink::SinkProj>,
    /// Per-block activation checkpointing of training forwards, when set.
    ckpt: Option<std::sync::Arc<checkpointing::CheckpointGrads>>,
    /// The LM head weight's accumulator in a GPU gradient sink ([`Self::head_grad`]).
    head_grad: Option<grad_sink::WeightGrad>,
    /// The LM head in the decoding GEMM's panels ([`Self::pack_for_decoding`]).
    head_packed: Option<std::sync::Arc<packed::PackedWeight>>,
    /// The fused CPU decoding step's weights ([`Self::pack_for_decoding`]); dropped whenever the
    /// projections may change.
    decoder: Option<std::sync::Arc<decode_cpu::Plan>>,
}

impl CausalLm {
    /// Builds the model from HF-named tensors (`model.layers.0.self_attn.q_proj.weight`, ...).
    /// Tensors that are candle `Var`s stay tracked, so the same map serves training.
    pub fn from_tensors(
        cfg: &ModelConfig,
        tensors: HashMap<String, Tensor>,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let vb = VarBuilder::from_tensors(tensors, dtype, device);
        Self::load(cfg, vb)
    }

    /// Builds the model from a `VarBuilder` rooted at the checkpoint root. Its [`Compute`] is
    /// resolved here, once, from the device, the dtype and the kernel set.
    pub fn load(cfg: &ModelConfig, vb: VarBuilder) -> Result<Self> {
        let compute = Compute::resolve(vb.device(), vb.dtype());
        Self::load_with(cfg, vb, compute)
    }

    /// [`Self::load`] running `compute`'s code (tests pick the portable code this way without
    /// changing the process's kernel set).
    pub(crate) fn load_with(cfg: &ModelConfig, vb: VarBuilder, compute: Compute) -> Result<Self> {
        let device = vb.device().clone();
        // CPU mixed precision keeps f32 weights and activations (bf16 only inside products).
        let dtype = compute.storage_dtype(vb.dtype());
        let vb = vb.set_dtype(dtype);
        let built = match cfg.arch {
            Arch::Llama
            | Arch::Qwen2
            | Arch::Qwen3
            | Arch::Mistral
            | Arch::Phi3
            | Arch::Gemma2
            | Arch::Gemma3 => llama::Model::load(cfg, vb, compute).map(Inner::Llama),
            Arch::Gpt2 => gpt2::Model::load(cfg, vb, compute).map(Inner::Gpt2),
        };
        let inner = built
            .map_err(|e| Error::Model(format!("cannot build {} model: {e}", cfg.arch.name())))?;
        Ok(Self::assembled(cfg, inner, dtype, device, compute))
    }

    fn assembled(
        cfg: &ModelConfig,
        inner: Inner,
        dtype: DType,
        device: Device,
        compute: Compute,
    ) -> Self {
        Self {
            cfg: cfg.clone(),
            inner,
            dtype,
            device,
            compute,
            head: None,
            ckpt: None,
            head_grad: None,
            head_packed: None,
            decoder: None,
        }
    }

    /// A Llama-family model whose blocks' parameters come from `blocks` for each training
    /// forward (ZeRO-3): `outer` holds every other parameter (embedding, final norm, LM head
    /// when untied) by checkpoint name. It runs training forwards only (Mode::Train, no KV
    /// cache) with checkpointing set (`set_checkpointing(Some(..))`); anything else is an error
    /// saying so. GPT-2 is refused with a clear error.
    ///
    /// Each block's forward gathers its parameters, runs without a graph and drops them; its
    /// recomputation in the backward gathers them again and hands their gradients to
    /// [`BlockParams::gradients`] (see [`checkpointing::checkpoint_sharded`]). The outer
    /// parameters' gradients go where a full model's go (candle's graph, or an attached sink).
    pub fn with_sharded_blocks(
        cfg: &ModelConfig,
        outer: HashMap<String, Tensor>,
        blocks: std::sync::Arc<dyn BlockParams>,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let compute = Compute::resolve(device, dtype);
        Self::sharded_with(cfg, outer, blocks, dtype, device, compute)
    }

    /// [`Self::with_sharded_blocks`] running `compute`'s code.
    pub(crate) fn sharded_with(
        cfg: &ModelConfig,
        outer: HashMap<String, Tensor>,
        blocks: std::sync::Arc<dyn BlockParams>,
        dtype: DType,
        device: &Device,
        compute: Compute,
    ) -> Result<Self> {
        let refuse = |why: String| Err(Error::Model(format!("sharded blocks (ZeRO-3): {why}")));
        if cfg.arch == Arch::Gpt2 {
            return refuse("GPT-2 is not supported, only Llama-family models".into());
        }
        if cfg.build_quantized.is_some() {
            return refuse("quantized blocks cannot be trained".into());
        }
        if let Some(n) = outer.keys().find(|n| block_of(n).is_some()) {
            return refuse(format!("`{n}` is a block parameter, not an outer one"));
        }
        let dtype = compute.storage_dtype(dtype);
        let vb = VarBuilder::from_tensors(outer, dtype, device);
        let sharded = sharded::Sharded::new(cfg, blocks, compute, dtype, device);
        let inner = llama::Model::load_sharded(cfg, vb, compute, sharded).map_err(|e| {
            Error::Model(format!(
                "cannot build {} model with sharded blocks: {e}",
                cfg.arch.name()
            ))
        })?;
        Ok(Self::assembled(
            cfg,
            Inner::Llama(inner),
            dtype,
            device.clone(),
            compute,
        ))
    }

    /// Sends the weight gradients of every projection whose parameter `sink` holds to the sink
    /// (see [`grad_sink`]); returns how many projections were attached. For training forwards
    /// on the CPU in f32; other projections keep candle's autograd.
    pub fn attach_grad_sink(&mut self, sink: &grad_sink::GradSink) -> Result<usize> {
        self.decoder = None;
        let n = match &mut self.inner {
            Inner::Llama(m) => m.attach_grad_sink(sink),
            Inner::Gpt2(m) => m.attach_grad_sink(sink),
        };
        let err =
            |e: candle_core::Error| Error::Model(format!("cannot attach the gradient sink: {e}"));
        let n = n.map_err(err)?;
        // On a GPU the head stays a plain matmul (the recomputed log-prob kernels take it);
        // its weight gradient goes to the sink through [`Self::head_grad`].
        let w = self.lm_head().clone();
        (self.head, self.head_grad) = match self.compute {
            Compute::Gpu => (None, sink.weight_grad(&w)),
            _ => (
                grad_sink::SinkProj::new(sink, &[(&w, &w)]).map_err(err)?,
                None,
            ),
        };
        Ok(n + usize::from(self.head.is_some()))
    }

    /// Every projection with its HF module path(s) (`model.layers.0.self_attn.q_proj`, ...).
    pub fn projections_mut(&mut self) -> Vec<(Vec<String>, ProjMut<'_>)> {
        self.decoder = None;
        match &mut self.inner {
            Inner::Llama(m) => m.projections_mut(),
            Inner::Gpt2(m) => m.projections_mut(),
        }
    }

    /// (HF module path, in, out) of every projection, in model order.
    pub fn projection_shapes(&self) -> Result<Vec<(String, usize, usize)>> {
        let mut m = self.clone();
        let mut out = Vec::new();
        for (names, p) in m.projections_mut() {
            let dims = match p {
                ProjMut::Single(l) => vec![l.dims()?],
                ProjMut::Fused(f) => f.part_dims()?,
            };
            for (n, (i, o)) in names.into_iter().zip(dims) {
                out.push((n, i, o));
            }
        }
        Ok(out)
    }

    /// Attaches `adapters` by HF module path; every other projection gets none (an empty map
    /// switches adapters off). Returns how many were attached; a name that matches no
    /// projection is an error.
    pub fn set_lora(&mut self, adapters: &HashMap<String, LoraAdapter>) -> Result<usize> {
        let mut n = 0;
        let err = |e: candle_core::Error| Error::Model(format!("LoRA: {e}"));
        for (names, p) in self.projections_mut() {
            match p {
                ProjMut::Single(l) => {
                    let a = adapters.get(&names[0]).cloned();
                    n += usize::from(a.is_some());
                    l.set_lora(a).map_err(err)?;
                }
                ProjMut::Fused(f) => {
                    for (k, name) in names.iter().enumerate() {
                        let a = adapters.get(name).cloned();
                        n += usize::from(a.is_some());
                        f.set_lora(k, a).map_err(err)?;
                    }
                }
            }
        }
        if n != adapters.len() {
            let known: Vec<String> = self
                .projection_shapes()?
                .into_iter()
                .map(|(n, _, _)| n)
                .collect();
            let missing: Vec<&String> = adapters.keys().filter(|k| !known.contains(k)).collect();
            return Err(Error::Model(format!(
                "LoRA adapters for modules the model does not have: {missing:?}"
            )));
        }
        Ok(n)
    }

    /// Adds each adapter's `scale * B A` into its frozen projection weight (new copies of the
    /// merged weights only), for fast sampling; adapters on quantized weights are attached
    /// instead. Returns how many were merged.
    pub fn merge_lora(&mut self, adapters: &HashMap<String, LoraAdapter>) -> Result<usize> {
        let err = |e: candle_core::Error| Error::Model(format!("LoRA merge: {e}"));
        let mut merged = 0;
        let mut attach = HashMap::new();
        for (names, p) in self.projections_mut() {
            if !names.iter().any(|n| adapters.contains_key(n)) {
                continue;
            }
            match merge_projection(p, &names, adapters).map_err(err)? {
                Some(n) => merged += n,
                None => {
                    for n in &names {
                        if let Some(a) = adapters.get(n) {
                            attach.insert(n.clone(), a.clone());
                        }
                    }
                }
            }
        }
        if !attach.is_empty() {
            self.set_lora(&attach)?;
        }
        Ok(merged)
    }

    /// Keeps every projection's (frozen) weight quantized to `kind`; returns how many.
    pub fn quantize_projections(&mut self, kind: QuantType) -> Result<usize> {
        self.use_quantized(&HashMap::new(), kind)
    }

    /// Like [`Self::quantize_projections`], taking weights already quantized (a GGUF's, as they
    /// are) from `given` by HF weight name (`<module>.weight`); the rest are quantized to `kind`.
    /// Returns how many projections took a given weight.
    pub fn use_quantized(
        &mut self,
        given: &HashMap<String, QuantProj>,
        kind: QuantType,
    ) -> Result<usize> {
        let mut n = 0;
        for (names, p) in self.projections_mut() {
            let found: Vec<&QuantProj> = names
                .iter()
                .filter_map(|m| given.get(&format!("{m}.weight")))
                .collect();
            let all = found.len() == names.len();
            let r = match (p, all) {
                (ProjMut::Single(l), true) => l.set_quantized(found[0].clone()),
                (ProjMut::Fused(f), true) => f.set_quantized(&found),
                (ProjMut::Single(l), false) => l.quantize(kind),
                (ProjMut::Fused(f), false) => f.quantize(kind),
            };
            r.map_err(|e| Error::Model(format!("cannot quantize {}: {e}", names[0])))?;
            n += usize::from(all);
        }
        Ok(n)
    }

    /// Repacks every detached f32 projection and the LM head into the decoding GEMM's panels
    /// ([`packed`]), which multiply the few rows of a decoding step 1.5-3x faster than candle's
    /// GEMM. For sampling and scoring models only: packed projections have no backward, and
    /// their dense copies are dropped. A no-op where the kernel is unavailable (no AVX-512, not
    /// f32 on the CPU). Returns how many weights were packed.
    pub fn pack_for_decoding(&mut self) -> Result<usize> {
        let err = |e: candle_core::Error| Error::Model(format!("cannot pack for decoding: {e}"));
        let mut n = 0;
        for (_, p) in self.projections_mut() {
            let packed = match p {
                ProjMut::Single(l) => l.pack(),
                ProjMut::Fused(f) => f.pack(),
            };
            n += usize::from(packed.map_err(err)?);
        }
        let w = self.lm_head();
        if n > 0 && self.head.is_none() && !w.track_op() {
            let head = match self.compute.bf16_matmuls() {
                true => packed::PackedWeight::from_out_in_bf16(w),
                false => packed::PackedWeight::from_out_in(w),
            };
            self.head_packed = Some(std::sync::Arc::new(head.map_err(err)?));
            n += 1;
        }
        if let (Inner::Llama(m), Some(head)) = (&self.inner, &self.head_packed) {
            let plan = m.decode_plan().map_err(err)?;
            self.decoder = plan.filter(|p| p.consistent(head)).map(std::sync::Arc::new);
        }
        Ok(n)
    }

    /// Whether decoding steps take the fused CPU path ([`decode_cpu`]): a Llama-family model
    /// packed by [`Self::pack_for_decoding`] with nothing attached to its projections since.
    pub fn fused_decoding(&self) -> bool {
        self.decoder.is_some()
    }

    /// Decodes through the tensor path from now on (for comparisons and benchmarks).
    pub fn disable_fused_decoding(&mut self) {
        self.decoder = None;
    }

    /// One decoding step of one token per row: `ids` and `positions` [B], `mask` over the
    /// `cache.len() + 1` key slots. Writes the new keys and values into the cache, advances it,
    /// and returns the logits [B * vocab] (f32). Takes the fused CPU step when the model has one
    /// ([`Self::fused_decoding`]) and the mask is left padding, else [`Self::forward_cached`] and
    /// [`Self::logits`].
    pub fn decode_logits(
        &self,
        ids: &[u32],
        positions: &[u32],
        mask: &AttnMask,
        cache: &mut KvCache,
    ) -> Result<Vec<f32>> {
        // A window on every layer (Mistral) is left padding to the fused step.
        let windowed;
        let mask = match (&self.inner, mask) {
            (Inner::Llama(m), AttnMask::LeftPad(..)) => match m.uniform_window() {
                Some(w) => {
                    windowed = mask.windowed(w, None, Some(cache.len()))?;
                    &windowed
                }
                None => mask,
            },
            _ => mask,
        };
        if let (Some(plan), Some(head), AttnMask::LeftPad(pad, shared)) =
            (&self.decoder, &self.head_packed, mask)
        {
            let err = |e: candle_core::Error| Error::Model(format!("decoding step: {e}"));
            let done = decode_cpu::step(plan, head, ids, positions, pad, shared.as_ref(), cache);
            if let Some(logits) = done.map_err(err)? {
                return Ok(logits);
            }
        }
        Ok(self
            .decode_logits_tensor(ids, positions, mask, cache)?
            .flatten_all()?
            .to_vec1()?) // [B*V]
    }

    /// [`CausalLm::decode_logits`] as a tensor on the model's device (candle ops only), for a
    /// sampler that chooses tokens there: [B, V] in the model's dtype.
    pub fn decode_logits_tensor(
        &self,
        ids: &[u32],
        positions: &[u32],
        mask: &AttnMask,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        let b = ids.len();
        let ids = Tensor::from_vec(ids.to_vec(), (b, 1), &self.device)?;
        let pos = Tensor::from_vec(positions.to_vec(), (b, 1), &self.device)?;
        let h = self.forward_cached(&ids, &pos, mask, cache)?; // [B, 1, H]
        self.logits(&h.squeeze(1)?) // [B, V]
    }

    /// Bytes held by quantized projection weights.
    pub fn quantized_bytes(&self) -> usize {
        let mut m = self.clone();
        m.projections_mut()
            .into_iter()
            .map(|(_, p)| match p {
                ProjMut::Single(l) => l.quantized().map_or(0, |q| q.size_in_bytes()),
                ProjMut::Fused(f) => f.quantized().map_or(0, |q| q.size_in_bytes()),
            })
            .sum()
    }

    /// Recompute each block in the backward of training forwards (CPU, f32) instead of keeping
    /// its activations; the recomputed blocks' parameter gradients go to `grads`.
    pub fn set_checkpointing(
        &mut self,
        grads: Option<std::sync::Arc<checkpointing::CheckpointGrads>>,
    ) {
        self.ckpt = grads;
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn device(&self) -> &Device {
        &self.device
    }
    /// The longest sequence the model's positions allow.
    pub fn max_positions(&self) -> usize {
        match &self.inner {
            Inner::Llama(m) => m.max_positions(),
            Inner::Gpt2(m) => m.max_positions(),
        }
    }

    /// The LM head weight `[vocab, hidden]` (the embedding when tied).
    pub fn lm_head(&self) -> &Tensor {
        match &self.inner {
            Inner::Llama(m) => m.lm_head(),
            Inner::Gpt2(m) => m.lm_head(),
        }
    }

    /// All-position forward: final hidden states [B, T, H].
    pub fn forward_hidden(&self, batch: &SeqBatch, mode: Mode) -> Result<Tensor> {
        let mask = AttnMask::dense(batch.mask.clone())?;
        Ok(self.hidden(&batch.ids, &batch.positions, &mask, None, mode)?)
    }

    /// Incremental forward over `cache`: `ids`/`positions` [B, S]; `mask` covers the
    /// `cache.len() + S` key slots (dense `[B, 1, S, Tk]`, or left-padding counts when S = 1).
    /// Writes the new keys and values into the cache and advances it. Returns [B, S, H].
    pub fn forward_cached(
        &self,
        ids: &Tensor,
        positions: &Tensor,
        mask: &AttnMask,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        Ok(self.hidden(ids, positions, mask, Some(cache), Mode::Infer)?)
    }

    fn hidden(
        &self,
        ids: &Tensor,
        positions: &Tensor,
        mask: &AttnMask,
        cache: Option<&mut KvCache>,
        mode: Mode,
    ) -> candle_core::Result<Tensor> {
        match &self.inner {
            Inner::Llama(m) => {
                m.forward_hidden(ids, positions, mask, cache, mode, self.ckpt.as_ref())
            }
            Inner::Gpt2(m) => {
                m.forward_hidden(ids, positions, mask, cache, mode, self.ckpt.as_ref())
            }
        }
    }

    /// LM head for training: `h` [N, H] -> logits [N, V], through the gradient sink when one is
    /// attached (the weight's gradient then goes to its accumulator), else a plain matmul.
    pub fn head_logits(&self, h: &Tensor) -> Result<Tensor> {
        let logits = self.head_logits_uncapped(h)?;
        self.softcap(logits)
    }

    /// `cap * tanh(logits / cap)` when the model caps its logits (Gemma 2), else `logits`.
    fn softcap(&self, logits: Tensor) -> Result<Tensor> {
        match self.cfg.extras.final_softcap {
            Some(cap) => Ok(((logits / cap)?.tanh()? * cap)?),
            None => Ok(logits),
        }
    }

    fn head_logits_uncapped(&self, h: &Tensor) -> Result<Tensor> {
        let w = self.lm_head();
        if let Some(p) = &self.head {
            return Ok(p.forward(h)?);
        }
        if let (Some(p), false) = (&self.head_packed, h.track_op()) {
            return Ok(p.forward(h)?);
        }
        // A frozen head under a graph (LoRA): the input's gradient only, no [vocab, hidden] one.
        if !w.track_op() && h.track_op() && self.compute.fuses(h) {
            if let Some(p) = grad_sink::SinkProj::frozen(&[w], self.compute)? {
                return Ok(p.forward(h)?);
            }
        }
        if self.compute.bf16_matmuls() && !h.track_op() && self.compute.fuses(h) {
            return Ok(gemm_bf16::matmul(h, &w.t()?)?);
        }
        Ok(h.matmul(&w.t()?)?)
    }

    /// Which code the model runs: grpo's fused CPU kernels or the portable candle ops.
    pub fn compute(&self) -> Compute {
        self.compute
    }

    /// The LM head's weight [V, H] when the head is a plain matmul by it (no gradient sink
    /// attached): for callers that compute the head themselves (recomputed log-probs).
    pub fn plain_head(&self) -> Option<&Tensor> {
        let plain = self.head.is_none() && self.cfg.extras.final_softcap.is_none();
        plain.then(|| self.lm_head())
    }

    /// Where a training forward's LM head weight gradient goes instead of candle's graph: the
    /// weight's accumulator in a GPU gradient sink attached to this model (`None` elsewhere).
    pub fn head_grad(&self) -> Option<&grad_sink::WeightGrad> {
        self.head_grad.as_ref()
    }

    /// LM head: hidden [..., H] -> logits [..., V] (f32; f64 stays f64).
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        let dims = hidden.dims();
        let Some((&h, lead)) = dims.split_last().filter(|(&h, _)| h > 0) else {
            return Err(Error::Model(format!(
                "LM head: hidden states of shape {dims:?} have no hidden dimension"
            )));
        };
        let n: usize = lead.iter().product();
        let logits = match (&self.head_packed, hidden.track_op()) {
            // CPU mixed precision: the head multiplies in bf16 wherever it runs.
            _ if self.compute.bf16_matmuls() => {
                self.head_logits_uncapped(&hidden.reshape((n, h))?)?
            }
            (Some(p), false) => p.forward(&hidden.reshape((n, h))?)?,
            _ => hidden.reshape((n, h))?.matmul(&self.lm_head().t()?)?,
        }; // [N, V]
        let mut shape = lead.to_vec();
        shape.push(self.lm_head().dim(0)?);
        let logits = logits.reshape(shape)?;
        self.softcap(logits.to_dtype(layers::reduce_dtype(logits.dtype()))?)
    }

    /// A zeroed decoding cache for `batch` rows of up to `max_len` tokens.
    pub fn new_cache(&self, batch: usize, max_len: usize) -> Result<KvCache> {
        Ok(KvCache::new(
            self.cfg.num_layers,
            batch,
            self.cfg.num_kv_heads,
            max_len,
            self.cfg.head_dim,
            self.dtype,
            &self.device,
        )?)
    }
}

/// A padded batch of token sequences for the all-position forward.
#[derive(Debug, Clone)]
pub struct SeqBatch {
    /// [B, T] u32
    pub ids: Tensor,
    /// [B, T] u32: position of each token within its own sequence.
    pub positions: Tensor,
    /// [B, 1, T, T] f32 additive: causal, padding keys masked.
    pub mask: Tensor,
    /// Which slots hold real tokens.
    pub valid: Vec<Vec<bool>>,
}

impl SeqBatch {
    /// Left-pads `seqs` to a common length with `pad_id`; each sequence's positions start at 0.
    pub fn left_padded(seqs: &[Vec<u32>], pad_id: u32, device: &Device) -> Result<Self> {
        Self::padded(seqs, pad_id, true, device)
    }

    /// Right-pads `seqs` to a common length with `pad_id`.
    pub fn right_padded(seqs: &[Vec<u32>], pad_id: u32, device: &Device) -> Result<Self> {
        Self::padded(seqs, pad_id, false, device)
    }

    fn padded(seqs: &[Vec<u32>], pad_id: u32, left: bool, device: &Device) -> Result<Self> {
        let t = seqs.iter().map(|s| s.len()).max().unwrap_or(0);
        let mut ids = Vec::with_capacity(seqs.len());
        let mut pos = Vec::with_capacity(seqs.len());
        let mut valid = Vec::with_capacity(seqs.len());
        for s in seqs {
            let pad = t - s.len();
            let real_pos: Vec<u32> = (0..s.len() as u32).collect();
            let (i, p, v) = (vec![pad_id; pad], vec![0; pad], vec![false; pad]);
            if left {
                ids.push([i, s.clone()].concat());
                pos.push([p, real_pos].concat());
                valid.push([v, vec![true; s.len()]].concat());
            } else {
                ids.push([s.clone(), i].concat());
                pos.push([real_pos, p].concat());
                valid.push([vec![true; s.len()], v].concat());
            }
        }
        Self::from_parts(ids, pos, valid, device)
    }

    /// From explicit ids, positions and validity, all `[B][T]`.
    pub fn from_parts(
        ids: Vec<Vec<u32>>,
        positions: Vec<Vec<u32>>,
        valid: Vec<Vec<bool>>,
        device: &Device,
    ) -> Result<Self> {
        let b = ids.len();
        let t = ids.first().map(|r| r.len()).unwrap_or(0);
        if b == 0 || t == 0 {
            return Err(Error::ModelInput(
                "an empty batch (no sequences, or only empty ones)".into(),
            ));
        }
        let rect = |n: usize| n == t;
        if !ids.iter().all(|r| rect(r.len()))
            || positions.len() != b
            || !positions.iter().all(|r| rect(r.len()))
            || valid.len() != b
            || !valid.iter().all(|r| rect(r.len()))
        {
            return Err(Error::Invariant(
                "a sequence batch's ids, positions and valid must all be [B][T]".into(),
            ));
        }
        let mask = layers::build_mask(&valid, 0, t, t, device)?;
        let flat = |v: Vec<Vec<u32>>| v.into_iter().flatten().collect::<Vec<u32>>();
        Ok(Self {
            ids: Tensor::from_vec(flat(ids), (b, t), device)?,
            positions: Tensor::from_vec(flat(positions), (b, t), device)?,
            mask,
            valid,
        })
    }

    /// Rows that each hold one or more packs of a shared prefix followed by several independent
    /// continuations (a prompt and its group's completions): `segments[b][t]` is `(pack, seg)`,
    /// the token's pack within the row and 0 for prefix tokens or `i + 1` for continuation `i`.
    /// A token attends causally to its pack's prefix and to the earlier tokens of its own
    /// segment, never to another continuation or pack, so each continuation sees exactly what it
    /// would see alone behind the prefix (give it the positions it would have there). Rows are
    /// right-padded with `pad_id`; padding queries attend only to slot 0.
    pub fn prefix_shared(
        ids: Vec<Vec<u32>>,
        positions: Vec<Vec<u32>>,
        segments: Vec<Vec<(u32, u32)>>,
        pad_id: u32,
        device: &Device,
    ) -> Result<Self> {
        let b = ids.len();
        let t = ids.iter().map(|r| r.len()).max().unwrap_or(0);
        if b == 0 || t == 0 {
            return Err(Error::ModelInput(
                "an empty batch (no sequences, or only empty ones)".into(),
            ));
        }
        if positions.len() != b
            || segments.len() != b
            || ids
                .iter()
                .zip(positions.iter().zip(&segments))
                .any(|(i, (p, s))| p.len() != i.len() || s.len() != i.len())
        {
            return Err(Error::Invariant(
                "a prefix-shared batch's ids, positions and segments must have the same shape"
                    .into(),
            ));
        }
        let mut mask = vec![layers::MASK_VALUE; b * t * t];
        for (bi, seg) in segments.iter().enumerate() {
            let n = seg.len();
            for q in 0..t {
                let row = &mut mask[(bi * t + q) * t..(bi * t + q + 1) * t];
                if q >= n {
                    row[0] = 0.0;
                    continue;
                }
                let (pack, own) = seg[q];
                // Tokens of one pack are consecutive: scan back to the pack's first token.
                for k in (0..=q).rev() {
                    let (p, sk) = seg[k];
                    if p != pack {
                        break;
                    }
                    if sk == 0 || sk == own {
                        row[k] = 0.0;
                    }
                }
            }
        }
        let pad = |mut r: Vec<u32>, v: u32| {
            r.resize(t, v);
            r
        };
        let valid = ids
            .iter()
            .map(|r| (0..t).map(|j| j < r.len()).collect())
            .collect();
        let ids: Vec<u32> = ids.into_iter().flat_map(|r| pad(r, pad_id)).collect();
        let positions: Vec<u32> = positions.into_iter().flat_map(|r| pad(r, 0)).collect();
        Ok(Self {
            ids: Tensor::from_vec(ids, (b, t), device)?,
            positions: Tensor::from_vec(positions, (b, t), device)?,
            mask: Tensor::from_vec(mask, (b, 1, t, t), device)?,
            valid,
        })
    }

    pub fn dims(&self) -> (usize, usize) {
        let d = self.ids.dims();
        (d[0], d[1])
    }
}

/// Merges `adapters` of one projection (its parts `names`) into a copy of its weight: how many
/// were merged, or `None` where its base takes no delta (quantized), before any is made (a dense
/// `scale * B A` each).
fn merge_projection(
    p: ProjMut<'_>,
    names: &[String],
    adapters: &HashMap<String, LoraAdapter>,
) -> candle_core::Result<Option<usize>> {
    let quantized = match &p {
        ProjMut::Single(l) => l.quantized().is_some(),
        ProjMut::Fused(f) => f.quantized().is_some(),
    };
    if quantized {
        return Ok(None);
    }
    let deltas: Vec<Option<Tensor>> = names
        .iter()
        .map(|n| adapters.get(n).map(|a| a.delta_weight()).transpose())
        .collect::<candle_core::Result<_>>()?;
    let done = match p {
        ProjMut::Single(l) => match &deltas[0] {
            Some(d) => l.add_to_weight(d)?,
            None => true,
        },
        ProjMut::Fused(f) => f.add_to_weight(&deltas)?,
    };
    Ok(done.then(|| deltas.iter().flatten().count()))
}
