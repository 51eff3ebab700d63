//! Building blocks shared by the model files: projections ([`Linear`], [`FusedLinear`], with
//! LoRA adapters, quantized bases, gradient sinks and packed decoding weights), embeddings,
//! norms ([`RmsNorm`], [`LayerNorm`]) and RoPE tables ([`Rope`]). Each forward takes a [`Mode`]:
//! differentiable (candle ops that all record a backward, or grpo's kernels with a backward)
//! in `Mode::Train`; fused (candle's fast kernels, which record no backward) in `Mode::Infer`
//! (sampling and reference/old log-probs). The ops themselves (attention, the norms' kernels,
//! RoPE) are [`crate::kernels`]'; tests check the two modes agree.

use candle_core::{DType, Module, Result, Tensor};
use candle_nn::VarBuilder;

use super::lora::LoraAdapter;
use crate::kernels::cpu::decode::ProjLora;
use crate::kernels::cpu::packed::PackedWeight;
use crate::kernels::cpu::quant::{QuantProj, QuantType};
use crate::kernels::grad_sink::{GradSink, SinkProj};
use crate::kernels::Compute;

mod norm;
mod rope;

pub use norm::{LayerNorm, RmsNorm};
pub use rope::{rope_inv_freq, Rope};

// The kernels' types and helpers that the layers' callers name through this module.
pub use crate::kernels::attention::AttnMask;
pub use crate::kernels::mask::{build_mask, SharedPrefix, MASK_VALUE};
pub use crate::kernels::portable::tensor_ops::{matmul_operand, reduce_dtype};
pub use crate::kernels::Mode;

/// `y = x W^T + b`. The weight arrives in HF's `[out, in]` layout.
///
/// A detached weight (sampling, reference and old log-probs) is kept as a contiguous `[in, out]`
/// copy: candle's CPU GEMM then streams it without repacking it on every call (the repacking was a
/// quarter of decoding time). GPT-2's Conv1D weights are already `[in, out]`, so for them this is
/// free; for others it is one copy when the model is built.
///
/// A weight that tracks gradients (a `Var`, or ops on `Var`s) is kept as the transposed view: the
/// training forward's GEMMs have hundreds of rows, so repacking is cheap there, and a copy would
/// cost the size of the model again for as long as the graph lives. Either way a built model
/// holds a snapshot of its weights' layout: rebuild it after changing the parameters.
#[derive(Debug, Clone)]
pub struct Linear {
    base: Base,
    bias: Option<Tensor>,
    /// The parameter as stored ([out, in], or [in, out] for GPT-2's Conv1D, `from_in_out`),
    /// kept only when it tracks gradients (a detached model holds just the base).
    param: Option<Tensor>,
    /// Set by [`Linear::attach_grad_sink`]: the forward's weight gradient goes to the sink.
    sink: Option<SinkProj>,
    /// A LoRA adapter added to the output ([`Linear::set_lora`]).
    lora: Option<LoraAdapter>,
    /// Which code multiplies ([`Linear::with_compute`]; portable until the model says so).
    compute: Compute,
}

/// The weight a [`Linear`] multiplies by.
#[derive(Debug, Clone)]
enum Base {
    /// [in, out], contiguous or a transposed view
    Dense(Tensor),
    /// Frozen and quantized (QLoRA).
    Quant(QuantProj),
    /// Detached, in the decoding GEMM's panels ([`Linear::pack`]); forward only.
    Packed(std::sync::Arc<PackedWeight>),
}

impl Linear {
    /// `weight` [out, in] (HF layout), `bias` [out].
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Result<Self> {
        let (weight_t, param) = if weight.track_op() {
            (weight.t()?, Some(weight))
        } else {
            (weight.t()?.contiguous()?, None)
        };
        Ok(Self {
            base: Base::Dense(weight_t),
            bias,
            param,
            sink: None,
            lora: None,
            compute: Compute::Portable,
        })
    }
    /// `self`, multiplying with `compute`'s code (a causal LM gives its projections its own).
    pub fn with_compute(mut self, compute: Compute) -> Self {
        self.compute = compute;
        self
    }
    /// `weight` [in, out] (GPT-2's Conv1D layout, already what the GEMM wants), `bias` [out].
    pub fn from_in_out(weight: Tensor, bias: Option<Tensor>) -> Result<Self> {
        Ok(Self {
            base: Base::Dense(weight.contiguous()?),
            bias,
            param: weight.track_op().then(|| weight.clone()),
            sink: None,
            lora: None,
            compute: Compute::Portable,
        })
    }
    /// The weight in HF layout `[out, in]` (a view; dequantized when quantized).
    pub fn weight(&self) -> Result<Tensor> {
        match &self.base {
            Base::Dense(wt) => wt.t(),
            Base::Quant(q) => q.dequantize(),
            Base::Packed(p) => p.to_in_out()?.t(),
        }
    }
    /// (in, out)
    pub fn dims(&self) -> Result<(usize, usize)> {
        match &self.base {
            Base::Dense(wt) => wt.dims2(),
            Base::Quant(q) => q.dims().map(|(o, i)| (i, o)),
            Base::Packed(p) => Ok(p.dims()),
        }
    }
    /// Sends the weight's gradient to `sink` from now on, when the sink holds its parameter.
    /// Returns whether it does. The bias keeps candle's autograd.
    pub fn attach_grad_sink(&mut self, sink: &GradSink) -> Result<bool> {
        self.sink = match (&self.param, &self.base) {
            (Some(p), Base::Dense(wt)) => SinkProj::new(sink, &[(p, &wt.t()?)])?,
            _ => None,
        };
        Ok(self.sink.is_some())
    }
    /// The GPU gradient sink of this projection when it is the whole projection (no bias, no
    /// adapter): for blocks that run their projections' GEMMs themselves ([`crate::kernels::grad_sink`]).
    pub fn gpu_sink(&self) -> Option<&SinkProj> {
        match (&self.sink, &self.bias, &self.lora) {
            (Some(s), None, None) if s.on_gpu() => Some(s),
            _ => None,
        }
    }

    /// Adds `lora`'s output to this projection's (or removes the adapter with `None`).
    pub fn set_lora(&mut self, lora: Option<LoraAdapter>) -> Result<()> {
        if let Some(l) = &lora {
            if l.dims()? != self.dims()? {
                candle_core::bail!(
                    "adapter shape (in, out) {:?} does not match the projection's {:?}",
                    l.dims()?,
                    self.dims()?
                );
            }
        }
        self.lora = lora;
        Ok(())
    }
    /// Adds `delta` [out, in] (HF layout) into a frozen dense weight, in a new copy (the
    /// original may be shared with other models). Returns false for a quantized weight.
    pub fn add_to_weight(&mut self, delta: &Tensor) -> Result<bool> {
        if self.param.is_some() {
            candle_core::bail!("cannot merge into a trainable weight");
        }
        let wt = match &self.base {
            Base::Dense(wt) => wt,
            Base::Quant(_) => return Ok(false),
            Base::Packed(_) => candle_core::bail!("merge adapters before packing for decoding"),
        };
        let merged = (wt + delta.t()?.to_dtype(wt.dtype())?)?.contiguous()?; // [in, out]
        self.base = Base::Dense(merged);
        Ok(true)
    }
    /// `self`, quantized when `q` says so (model building: [`ModelConfig::build_quantized`]).
    pub fn quantized_if(mut self, q: Option<QuantType>) -> Result<Self> {
        if let Some(q) = q {
            self.quantize(q)?;
        }
        Ok(self)
    }
    /// Keeps the (frozen) weight quantized from now on; the f32 copy is dropped.
    pub fn quantize(&mut self, kind: QuantType) -> Result<()> {
        if self.param.is_some() {
            candle_core::bail!("a trainable weight cannot be quantized");
        }
        self.set_quantized(QuantProj::quantize(&self.weight()?, kind)?)
    }
    /// Uses `q` ([out, in], already quantized) as the frozen weight.
    pub fn set_quantized(&mut self, q: QuantProj) -> Result<()> {
        let (o, i) = q.dims()?;
        if (i, o) != self.dims()? {
            candle_core::bail!("quantized weight [{o}, {i}] does not match the projection");
        }
        self.base = Base::Quant(q);
        Ok(())
    }
    /// The quantized weight, when the base is quantized.
    pub fn quantized(&self) -> Option<&QuantProj> {
        match &self.base {
            Base::Quant(q) => Some(q),
            Base::Dense(_) | Base::Packed(_) => None,
        }
    }

    /// Repacks a detached f32 CPU weight into the decoding GEMM's panels (see [`PackedWeight`]),
    /// where that kernel is available; the dense copy is dropped. A quantized base is re-laid
    /// as quantized panels ([`crate::kernels::cpu::packed_quant`]) instead. Returns whether it did. The
    /// projection then has a forward only: for sampling and scoring models.
    pub fn pack(&mut self) -> Result<bool> {
        match &self.base {
            Base::Dense(wt)
                if self.param.is_none()
                    && self.sink.is_none()
                    && self.compute.fuses(wt)
                    && self.compute.packs_for_decoding() =>
            {
                let packed = match self.compute.bf16_matmuls() {
                    true => PackedWeight::from_in_out_bf16(wt)?,
                    false => PackedWeight::from_in_out(wt)?,
                };
                self.base = Base::Packed(std::sync::Arc::new(packed));
                Ok(true)
            }
            Base::Quant(q) if self.sink.is_none() && self.compute.packs_for_decoding() => {
                match PackedWeight::from_quant(q)? {
                    Some(p) => {
                        self.base = Base::Packed(std::sync::Arc::new(p));
                        Ok(true)
                    }
                    None => Ok(false),
                }
            }
            _ => Ok(false),
        }
    }

    /// The packed weight, the bias as host floats and the adapter, when this projection is
    /// packed with no gradient sink and an adapter the fused step can add (none, or one without
    /// dropout): the fused decoding step's view of it.
    pub fn packed_parts(&self) -> Result<Option<crate::kernels::cpu::decode::Proj>> {
        let (Base::Packed(p), None) = (&self.base, &self.sink) else {
            return Ok(None);
        };
        let lora = match &self.lora {
            Some(l) => match ProjLora::new(&[(Some(l), p.dims().1)], p.dims().0)? {
                Some(l) => Some(l),
                None => return Ok(None),
            },
            None => None,
        };
        Ok(Some(crate::kernels::cpu::decode::Proj {
            w: p.clone(),
            bias: match &self.bias {
                Some(b) if b.dtype() == DType::F32 => Some(b.flatten_all()?.to_vec1()?),
                Some(_) => return Ok(None),
                None => None,
            },
            lora,
        }))
    }

    /// The base projection and bias, without the adapter.
    fn forward_base(&self, x: &Tensor) -> Result<Tensor> {
        let y = match (&self.sink, &self.base) {
            (Some(op), _) => op.forward(x)?, // [.., out]
            (None, Base::Quant(q)) => q.forward(x, self.compute)?,
            (None, Base::Packed(p)) => p.forward(x)?,
            (None, Base::Dense(wt))
                if self.compute.bf16_matmuls() && !x.track_op() && self.compute.fuses(wt) =>
            {
                // CPU mixed precision, a frozen model (the reference): bf16 products.
                crate::kernels::cpu::gemm_bf16::matmul(x, wt)?
            }
            (None, Base::Dense(wt)) => {
                // A frozen weight under a graph (LoRA training, earlier layers' adapters):
                // the input's gradient only.
                let frozen = match self.param.is_none() && x.track_op() && self.compute.fuses(x) {
                    true => SinkProj::frozen(&[&wt.t()?], self.compute)?,
                    false => None,
                };
                match frozen {
                    Some(op) => op.forward(x)?,
                    None => {
                        let dims = x.dims();
                        let in_dim = dims[dims.len() - 1];
                        let rows = x.elem_count() / in_dim;
                        let out_dim = wt.dim(1)?;
                        let y = x.reshape((rows, in_dim))?.matmul(wt)?; // [N, out]
                        let mut out_shape = dims.to_vec();
                        if let Some(last) = out_shape.last_mut() {
                            *last = out_dim;
                        }
                        y.reshape(out_shape)?
                    }
                }
            }
        };
        match &self.bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = self.forward_base(x)?;
        match &self.lora {
            Some(l) => y + l.forward(x)?,
            None => Ok(y),
        }
    }
}

/// A projection of a built model, named by HF module paths (one per part of a fused one), for
/// attaching adapters or quantizing the base.
pub enum ProjMut<'a> {
    Single(&'a mut Linear),
    Fused(&'a mut FusedLinear),
}

/// Several HF projections of the same input computed as one GEMM (q/k/v, gate/up), the output
/// split back into views. Detached weights are concatenated along `out` when the model is built
/// (the same single copy [`Linear`] makes anyway); weights that track gradients are concatenated
/// at each forward (the graph needs the joined tensor), or, with a [`GradSink`] attached, never:
/// the sink's op multiplies by each part in place. Gradients reach each original tensor.
#[derive(Debug, Clone)]
pub struct FusedLinear {
    /// (weight [out_i, in], bias [out_i]) per part; kept only for weights that track gradients
    /// (detached ones live in `joined` alone, so that the model holds one copy of them).
    parts: Vec<(Tensor, Option<Tensor>)>,
    /// The joined projection, prebuilt for detached weights.
    joined: Option<Linear>,
    sink: Option<SinkProj>,
    /// On a GPU with a sink: one projection per part ([`SinkProj::split`]).
    split: Vec<SinkProj>,
    outs: Vec<usize>,
    /// A LoRA adapter per part (or none).
    loras: Vec<Option<LoraAdapter>>,
    compute: Compute,
}

impl FusedLinear {
    /// `parts`: (weight [out_i, in], bias [out_i]) in output order; biases all present or all absent.
    pub fn new(parts: Vec<(Tensor, Option<Tensor>)>) -> Result<Self> {
        let outs = parts
            .iter()
            .map(|(w, _)| w.dim(0))
            .collect::<Result<Vec<_>>>()?;
        let tracked = parts
            .iter()
            .any(|(w, b)| w.track_op() || b.as_ref().is_some_and(|b| b.track_op()));
        let (parts, joined) = if tracked {
            (parts, None)
        } else {
            (vec![], Some(Self::join(&parts)?))
        };
        let loras = vec![None; outs.len()];
        Ok(Self {
            parts,
            joined,
            sink: None,
            split: vec![],
            outs,
            loras,
            compute: Compute::Portable,
        })
    }

    /// `self`, multiplying with `compute`'s code (see [`Linear::with_compute`]).
    pub fn with_compute(mut self, compute: Compute) -> Self {
        self.compute = compute;
        self.joined = self.joined.map(|j| j.with_compute(compute));
        self
    }

    /// (in, out_i) of each part.
    pub fn part_dims(&self) -> Result<Vec<(usize, usize)>> {
        let i = match (&self.joined, self.parts.first()) {
            (Some(j), _) => j.dims()?.0,
            (None, Some((w, _))) => w.dim(1)?,
            (None, None) => 0,
        };
        Ok(self.outs.iter().map(|&o| (i, o)).collect())
    }

    /// Adds `lora`'s output to part `part`'s (or removes it with `None`).
    pub fn set_lora(&mut self, part: usize, lora: Option<LoraAdapter>) -> Result<()> {
        let dims = self.part_dims()?;
        let Some(&want) = dims.get(part) else {
            candle_core::bail!("no part {part} in a projection of {} parts", dims.len());
        };
        if let Some(l) = &lora {
            if l.dims()? != want {
                candle_core::bail!(
                    "adapter shape (in, out) {:?} does not match the projection's {want:?}",
                    l.dims()?
                );
            }
        }
        self.loras[part] = lora;
        Ok(())
    }

    /// Adds each part's `delta` [out_i, in] (or nothing) into the frozen joined weight, in a new
    /// copy. Returns false for a quantized weight.
    pub fn add_to_weight(&mut self, deltas: &[Option<Tensor>]) -> Result<bool> {
        let dims = self.part_dims()?;
        let Some(j) = &mut self.joined else {
            candle_core::bail!("cannot merge into a trainable weight");
        };
        if j.quantized().is_some() {
            return Ok(false);
        }
        // Parts without an adapter add zeros made like the adapters' deltas: on the device the
        // model runs on (a quantized base has no dense weight to ask; it was asked as the CPU,
        // which broke QLoRA on a GPU).
        let Some(like) = deltas.iter().flatten().next() else {
            return Ok(true);
        };
        let mut rows = Vec::with_capacity(dims.len());
        for ((i, o), d) in dims.iter().zip(deltas) {
            rows.push(match d {
                Some(d) => d.clone(),
                None => Tensor::zeros((*o, *i), like.dtype(), like.device())?,
            });
        }
        j.add_to_weight(&Tensor::cat(&rows, 0)?)
    }

    /// `self`, quantized when `q` says so (model building: [`ModelConfig::build_quantized`]).
    pub fn quantized_if(mut self, q: Option<QuantType>) -> Result<Self> {
        if let Some(q) = q {
            self.quantize(q)?;
        }
        Ok(self)
    }

    /// Keeps the frozen joined weight quantized (one quantized matrix for all parts).
    pub fn quantize(&mut self, kind: QuantType) -> Result<()> {
        match &mut self.joined {
            Some(j) => j.quantize(kind),
            None => candle_core::bail!("a trainable weight cannot be quantized"),
        }
    }

    /// Uses already-quantized weights, one per part in order (stacked exactly).
    pub fn set_quantized(&mut self, parts: &[&QuantProj]) -> Result<()> {
        let q = QuantProj::stack(parts)?;
        match &mut self.joined {
            Some(j) => j.set_quantized(q),
            None => candle_core::bail!("a trainable weight cannot be quantized"),
        }
    }

    /// Packs the frozen joined weight for decoding ([`Linear::pack`]); returns whether it did.
    pub fn pack(&mut self) -> Result<bool> {
        match &mut self.joined {
            Some(j) => j.pack(),
            None => Ok(false),
        }
    }

    /// The joined weight, when quantized.
    pub fn quantized(&self) -> Option<&QuantProj> {
        self.joined.as_ref().and_then(|j| j.quantized())
    }

    /// The base weight of part `part`, HF layout [out_i, in] (dequantized when quantized).
    pub fn part_weight(&self, part: usize) -> Result<Tensor> {
        if let Some((w, _)) = self.parts.get(part) {
            return Ok(w.clone());
        }
        let start: usize = self.outs[..part].iter().sum();
        match &self.joined {
            Some(j) => j.weight()?.narrow(0, start, self.outs[part]),
            None => candle_core::bail!("no part {part}"),
        }
    }

    fn joined_bias(parts: &[(Tensor, Option<Tensor>)]) -> Result<Option<Tensor>> {
        if parts.iter().all(|(_, b)| b.is_some()) {
            let bs: Vec<&Tensor> = parts.iter().filter_map(|(_, b)| b.as_ref()).collect();
            Ok(Some(Tensor::cat(&bs, 0)?))
        } else {
            Ok(None)
        }
    }

    fn join(parts: &[(Tensor, Option<Tensor>)]) -> Result<Linear> {
        let ws: Vec<&Tensor> = parts.iter().map(|(w, _)| w).collect();
        Linear::new(Tensor::cat(&ws, 0)?, Self::joined_bias(parts)?)
    }

    /// Sends the weights' gradients to `sink` from now on, when it holds every part's parameter.
    pub fn attach_grad_sink(&mut self, sink: &GradSink) -> Result<bool> {
        let pairs: Vec<(&Tensor, &Tensor)> = self.parts.iter().map(|(w, _)| (w, w)).collect();
        self.sink = SinkProj::new(sink, &pairs)?;
        self.split = match &self.sink {
            Some(s) if s.on_gpu() && self.parts.len() > 1 => s.split(),
            _ => vec![],
        };
        Ok(self.sink.is_some())
    }

    /// The GPU gradient sink over all the parts when it is the whole projection (no biases, no
    /// adapters): for blocks that run their projections' GEMMs themselves.
    pub fn gpu_sink(&self) -> Option<&SinkProj> {
        let plain =
            self.parts.iter().all(|(_, b)| b.is_none()) && self.loras.iter().all(|l| l.is_none());
        match &self.sink {
            Some(s) if plain && s.on_gpu() => Some(s),
            _ => None,
        }
    }

    /// The joined projection's packed parts ([`Linear::packed_parts`]) when it is packed and
    /// has no sink, with the parts' adapters as one low-rank product ([`ProjLora`]).
    pub fn packed_parts(&self) -> Result<Option<crate::kernels::cpu::decode::Proj>> {
        let (Some(j), None) = (&self.joined, &self.sink) else {
            return Ok(None);
        };
        let Some(mut proj) = j.packed_parts()? else {
            return Ok(None);
        };
        if self.loras.iter().any(|l| l.is_some()) {
            let parts: Vec<_> = self
                .loras
                .iter()
                .map(|l| l.as_ref())
                .zip(self.outs.iter().copied())
                .collect();
            match ProjLora::new(&parts, proj.w.dims().0)? {
                Some(l) => proj.lora = Some(l),
                None => return Ok(None),
            }
        }
        Ok(Some(proj))
    }

    /// `x` [.., in] -> [.., sum of out_i], the parts side by side.
    pub fn forward_joined(&self, x: &Tensor) -> Result<Tensor> {
        if self.loras.iter().any(|l| l.is_some()) {
            let parts = self.forward(x)?;
            return Tensor::cat(&parts, x.rank() - 1);
        }
        self.forward_base(x)
    }

    /// The base projections, side by side, without adapters.
    fn forward_base(&self, x: &Tensor) -> Result<Tensor> {
        match (&self.sink, &self.joined) {
            (Some(op), _) => {
                let y = op.forward(x)?;
                match Self::joined_bias(&self.parts)? {
                    Some(b) => y.broadcast_add(&b),
                    None => Ok(y),
                }
            }
            (None, Some(j)) => j.forward(x),
            (None, None) => Self::join(&self.parts)?
                .with_compute(self.compute)
                .forward(x),
        }
    }

    /// `x` [.., in] -> one tensor [.., out_i] per part (views of one output without adapters;
    /// on a GPU with a sink, a tensor of its own per part).
    pub fn forward(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        if !self.split.is_empty() && self.gpu_sink().is_some() {
            return self.split.iter().map(|p| p.forward(x)).collect();
        }
        let y = self.forward_base(x)?;
        let last = y.rank() - 1;
        let mut start = 0;
        let mut out = Vec::with_capacity(self.outs.len());
        for (&n, lora) in self.outs.iter().zip(&self.loras) {
            let part = y.narrow(last, start, n)?;
            out.push(match lora {
                Some(l) => (part + l.forward(x)?)?,
                None => part,
            });
            start += n;
        }
        Ok(out)
    }
}

/// Loads `<prefix>.weight` ([out, in]) and, when `bias`, `<prefix>.bias` ([out]) as raw tensors.
pub fn linear_parts(
    in_dim: usize,
    out_dim: usize,
    bias: bool,
    vb: VarBuilder,
) -> Result<(Tensor, Option<Tensor>)> {
    let weight = vb.get((out_dim, in_dim), "weight")?;
    let bias = if bias {
        Some(vb.get(out_dim, "bias")?)
    } else {
        None
    };
    Ok((weight, bias))
}

/// Loads `<prefix>.weight` ([out, in]) and, when `bias`, `<prefix>.bias` ([out]).
pub fn linear(in_dim: usize, out_dim: usize, bias: bool, vb: VarBuilder) -> Result<Linear> {
    let weight = vb.get((out_dim, in_dim), "weight")?;
    let bias = if bias {
        Some(vb.get(out_dim, "bias")?)
    } else {
        None
    };
    Linear::new(weight, bias)
}

/// Token embedding table `[vocab, hidden]`.
#[derive(Debug, Clone)]
pub struct Embedding {
    weight: Tensor,
    /// Set when the weight's gradient goes to a [`GradSink`].
    lookup: Option<crate::kernels::grad_sink::SinkLookup>,
}

impl Embedding {
    pub fn new(weight: Tensor) -> Self {
        Self {
            weight,
            lookup: None,
        }
    }
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }
    /// Sends the weight's gradient to `sink` when it holds the weight; returns whether it does.
    pub fn attach_grad_sink(&mut self, sink: &GradSink) -> Result<bool> {
        self.lookup = crate::kernels::grad_sink::SinkLookup::new(sink, &self.weight)?;
        Ok(self.lookup.is_some())
    }
    /// `ids` [B, T] u32 -> [B, T, H].
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        let h = self.weight.dim(1)?;
        let rows = match &self.lookup {
            Some(l) => l.forward(&self.weight, ids)?,
            None => self.weight.index_select(&ids.flatten_all()?, 0)?,
        }; // [B*T, H]
        rows.reshape((b, t, h))
    }
}

#[cfg(test)]
pub(crate) mod tests;
