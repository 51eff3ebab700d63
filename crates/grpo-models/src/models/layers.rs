//! Building blocks shared by the model files, each with two implementations picked by [`Mode`]:
//! differentiable (composed of candle ops that all record a backward) and fused (candle's fast
//! kernels, which record no backward and silently drop gradients). Training uses `Mode::Train`;
//! sampling and reference/old log-probs use `Mode::Infer`. Tests check the two agree.

use std::sync::Arc;

use candle_core::{DType, Device, Module, Result, Tensor, D};
use candle_nn::VarBuilder;

use super::config::{Llama3RopeScaling, ModelConfig};
use super::decode_cpu::ProjLora;
use super::fused_attention::Spans;
use super::grad_sink::{GradSink, SinkProj};
use super::lora::LoraAdapter;
use super::packed::PackedWeight;
use super::quant::{QuantProj, QuantType};
pub use super::tensor_ops::{matmul_operand, reduce_dtype};
use crate::kernels::Compute;

/// Which kernels a forward pass uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Only ops with a backward: gradients reach every parameter.
    Train,
    /// Fused kernels without backward: faster, for tensors that need no gradient.
    Infer,
}

/// The additive mask value of disallowed attention positions (defined with the attention kernels).
pub use super::fused_attention::MASK_VALUE;

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
    /// adapter): for blocks that run their projections' GEMMs themselves ([`super::grad_sink`]).
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
    /// as quantized panels ([`super::packed_quant`]) instead. Returns whether it did. The
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
    pub fn packed_parts(&self) -> Result<Option<super::decode_cpu::Proj>> {
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
        Ok(Some(super::decode_cpu::Proj {
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
                super::gemm_bf16::matmul(x, wt)?
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
    pub fn packed_parts(&self) -> Result<Option<super::decode_cpu::Proj>> {
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
    lookup: Option<crate::models::grad_sink::SinkLookup>,
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
        self.lookup = crate::models::grad_sink::SinkLookup::new(sink, &self.weight)?;
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

/// RMSNorm as in HF Llama: `w * x / sqrt(mean(x^2) + eps)`.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    weight: Tensor,
    eps: f64,
    compute: Compute,
}

impl RmsNorm {
    /// The weight as host floats, when it is f32.
    pub fn host_weight(&self) -> Result<Option<Vec<f32>>> {
        match self.weight.dtype() {
            DType::F32 => Ok(Some(self.weight.flatten_all()?.to_vec1()?)),
            _ => Ok(None),
        }
    }
    pub fn eps(&self) -> f64 {
        self.eps
    }
    /// The weight the norm multiplies by (in the compute dtype).
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }
    pub fn new(weight: Tensor, eps: f64, compute: Compute) -> Self {
        Self {
            weight,
            eps,
            compute,
        }
    }
    pub fn load(size: usize, eps: f64, vb: VarBuilder, compute: Compute) -> Result<Self> {
        Ok(Self::new(vb.get(size, "weight")?, eps, compute))
    }
    /// Gemma's RMSNorm, which scales by `1 + w`: the same norm over the weight `w + 1` (the
    /// gradient reaches the stored `w` through the add).
    pub fn load_plus_one(size: usize, eps: f64, vb: VarBuilder, compute: Compute) -> Result<Self> {
        Ok(Self::new((vb.get(size, "weight")? + 1.0)?, eps, compute))
    }
    /// The residual sum `x + a` and this norm of it: one kernel on a GPU in inference (a
    /// decoding step's add and post-attention norm), else the add then [`Self::forward`].
    pub fn forward_added(&self, x: &Tensor, a: &Tensor, mode: Mode) -> Result<(Tensor, Tensor)> {
        #[cfg(feature = "cuda")]
        if mode == Mode::Infer && self.compute.on_gpu() {
            let fused = super::fused_gpu::add_rms_norm(x, a, &self.weight, self.eps)?;
            if let Some(pair) = fused {
                return Ok(pair);
            }
        }
        let sum = (x + a)?;
        let y = self.forward(&sum, mode)?;
        Ok((sum, y))
    }
    pub fn forward(&self, x: &Tensor, mode: Mode) -> Result<Tensor> {
        match mode {
            Mode::Infer => {
                candle_nn::ops::rms_norm(&x.contiguous()?, &self.weight, self.eps as f32)
            }
            Mode::Train if self.compute.fuses(x) => {
                super::fused::rms_norm(x, &self.weight, self.eps)
            }
            #[cfg(feature = "cuda")]
            Mode::Train
                if self.compute.on_gpu() && super::fused_gpu::rms_norm_takes(x, &self.weight) =>
            {
                super::fused_gpu::rms_norm(x, &self.weight, self.eps)
            }
            Mode::Train => rms_norm_recomputed(x, &self.weight, self.eps),
        }
    }
}

/// Differentiable RMSNorm over the last dim, computed in f32 like HF.
pub fn rms_norm_diff(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let xf = x.to_dtype(reduce_dtype(dtype))?;
    let inv = (xf.sqr()?.mean_keepdim(D::Minus1)? + eps)?
        .sqrt()?
        .recip()?; // [.., 1]
    let normed = xf.broadcast_mul(&inv)?.to_dtype(dtype)?;
    normed.broadcast_mul(w)
}

/// [`rms_norm_diff`]'s value, recorded in the graph with a backward written out
/// ([`super::recompute`]): the backward keeps only `x` and `w` (which the graph holds anyway),
/// not the five or so f32 intermediates of [`rms_norm_diff`] per call, the largest share of a
/// training pass's kept activations off the fused CPU path after attention and the LM head. With
/// `n = x r`, `r = 1 / sqrt(mean(x^2) + eps)` and `y = n w`: `dw = sum(g n)`,
/// `dx = r (g w - n mean(g w n))`, in f32 (f64 stays f64).
pub fn rms_norm_recomputed(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let y = rms_norm_diff(&x.detach(), &w.detach(), eps)?;
    super::recompute::attach(&y, &[x, w], Arc::new(RmsNormBackward { eps }))
}

struct RmsNormBackward {
    eps: f64,
}

impl super::recompute::Backward for RmsNormBackward {
    fn name(&self) -> &'static str {
        "rms-norm"
    }

    fn backward(
        &self,
        inputs: &[Tensor],
        wanted: &[bool],
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        let [x, w] = inputs else {
            candle_core::bail!("rms-norm: two inputs expected");
        };
        let f = reduce_dtype(x.dtype());
        let xf = x.to_dtype(f)?; // [.., H]
        let r = (xf.sqr()?.mean_keepdim(D::Minus1)? + self.eps)?
            .sqrt()?
            .recip()?; // [.., 1]
        let n = xf.broadcast_mul(&r)?; // [.., H]
        let dw = match wanted[1] {
            true => {
                let h = w.dim(0)?;
                let gn = (grad * n.to_dtype(x.dtype())?)?.to_dtype(f)?; // [.., H]
                Some(gn.reshape(((), h))?.sum(0)?.to_dtype(w.dtype())?) // [H]
            }
            false => None,
        };
        let dn = grad.broadcast_mul(w)?.to_dtype(f)?; // [.., H]
        let proj = (&dn * &n)?.mean_keepdim(D::Minus1)?; // [.., 1]
        let dx = (dn - n.broadcast_mul(&proj)?)?.broadcast_mul(&r)?;
        Ok(vec![Some(dx.to_dtype(x.dtype())?), dw])
    }
}

/// LayerNorm with weight and bias (GPT-2).
#[derive(Debug, Clone)]
pub struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f64,
}

impl LayerNorm {
    pub fn load(size: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            weight: vb.get(size, "weight")?,
            bias: vb.get(size, "bias")?,
            eps,
        })
    }
    pub fn forward(&self, x: &Tensor, mode: Mode) -> Result<Tensor> {
        match mode {
            Mode::Infer => candle_nn::ops::layer_norm(
                &x.contiguous()?,
                &self.weight,
                &self.bias,
                self.eps as f32,
            ),
            Mode::Train => layer_norm_diff(x, &self.weight, &self.bias, self.eps),
        }
    }
}

/// Differentiable LayerNorm over the last dim (biased variance, like torch).
pub fn layer_norm_diff(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let xf = x.to_dtype(reduce_dtype(dtype))?;
    let mean = xf.mean_keepdim(D::Minus1)?;
    let centered = xf.broadcast_sub(&mean)?;
    let var = centered.sqr()?.mean_keepdim(D::Minus1)?;
    let normed = centered.broadcast_div(&(var + eps)?.sqrt()?)?;
    normed.to_dtype(dtype)?.broadcast_mul(w)?.broadcast_add(b)
}

/// Softmax over the last dim.
pub fn softmax(x: &Tensor, mode: Mode) -> Result<Tensor> {
    match mode {
        Mode::Infer => candle_nn::ops::softmax_last_dim(&x.contiguous()?),
        Mode::Train => {
            // The max is a constant shift: detaching it leaves the gradient exact.
            let max = x.max_keepdim(D::Minus1)?.detach();
            let e = x.broadcast_sub(&max)?.exp()?;
            e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
        }
    }
}

/// Rotary position embedding tables, `[max_pos, head_dim / 2]` each, f32 (HF computes RoPE in f32).
#[derive(Debug, Clone)]
pub struct Rope {
    cos: Tensor,
    sin: Tensor,
}

/// HF's inverse frequencies, with Llama 3 scaling when configured.
pub fn rope_inv_freq(head_dim: usize, theta: f64, scaling: Option<Llama3RopeScaling>) -> Vec<f64> {
    let inv: Vec<f64> = (0..head_dim / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f64 / head_dim as f64))
        .collect();
    let Some(s) = scaling else { return inv };
    let old = s.original_max_position_embeddings as f64;
    let low_wavelen = old / s.low_freq_factor;
    let high_wavelen = old / s.high_freq_factor;
    inv.into_iter()
        .map(|f| {
            let wavelen = 2.0 * std::f64::consts::PI / f;
            if wavelen < high_wavelen {
                f
            } else if wavelen > low_wavelen {
                f / s.factor
            } else {
                let smooth =
                    (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
                (1.0 - smooth) * f / s.factor + smooth * f
            }
        })
        .collect()
}

impl Rope {
    /// The model's tables (its global layers', with linear scaling where it has one).
    pub fn new(cfg: &ModelConfig, device: &Device) -> Result<Self> {
        Self::with_theta(cfg, cfg.rope_theta, cfg.extras.rope_linear_factor, device)
    }

    /// The tables for base `theta` (Gemma 3's local layers have their own, unscaled) over the
    /// rotated dims (`rotary_dim`, all of the head unless partial), positions divided by
    /// `linear` when given.
    pub fn with_theta(
        cfg: &ModelConfig,
        theta: f64,
        linear: Option<f64>,
        device: &Device,
    ) -> Result<Self> {
        let dim = cfg.extras.rotary_dim.unwrap_or(cfg.head_dim);
        let half = dim / 2;
        let mut inv = rope_inv_freq(dim, theta, cfg.rope_scaling);
        if let Some(f) = linear {
            inv.iter_mut().for_each(|x| *x /= f);
        }
        if let Some(factors) = &cfg.rope_freq_factors {
            if factors.len() != inv.len() {
                candle_core::bail!(
                    "rope_freqs has {} factors, expected head_dim / 2 = {}",
                    factors.len(),
                    inv.len()
                );
            }
            inv.iter_mut().zip(factors).for_each(|(f, d)| *f /= d);
        }
        // Phi-3's LongRoPE within its pretraining length: frequencies divided by the short
        // factors, cos and sin scaled.
        let mut gain = 1f32;
        if let Some(l) = &cfg.extras.long_rope {
            if l.short_factor.len() != inv.len() {
                candle_core::bail!(
                    "longrope has {} short factors, expected {}",
                    l.short_factor.len(),
                    inv.len()
                );
            }
            inv.iter_mut()
                .zip(&l.short_factor)
                .for_each(|(f, s)| *f /= s);
            gain = l.attention_factor as f32;
        }
        // HF multiplies f32 positions by f32 inverse frequencies.
        let inv32: Vec<f32> = inv.iter().map(|&x| x as f32).collect();
        let n = cfg.max_position_embeddings;
        let mut cos = Vec::with_capacity(n * half);
        let mut sin = Vec::with_capacity(n * half);
        for p in 0..n {
            for &f in &inv32 {
                let a = p as f32 * f;
                cos.push(a.cos() * gain);
                sin.push(a.sin() * gain);
            }
        }
        Ok(Self {
            cos: Tensor::from_vec(cos, (n, half), device)?,
            sin: Tensor::from_vec(sin, (n, half), device)?,
        })
    }

    pub fn max_positions(&self) -> usize {
        self.cos.dims()[0]
    }

    /// The tables `[max_pos, head_dim / 2]` (cos, sin).
    pub fn tables_all(&self) -> (&Tensor, &Tensor) {
        (&self.cos, &self.sin)
    }

    /// cos and sin for `positions` [B, T] u32: each [B, T, head_dim / 2] in `dtype`.
    pub fn tables(&self, positions: &Tensor, dtype: DType) -> Result<(Tensor, Tensor)> {
        let (b, t) = positions.dims2()?;
        let flat = positions.flatten_all()?;
        let half = self.cos.dim(1)?;
        let cos = self.cos.index_select(&flat, 0)?.reshape((b, t, half))?;
        let sin = self.sin.index_select(&flat, 0)?.reshape((b, t, half))?;
        Ok((cos.to_dtype(dtype)?, sin.to_dtype(dtype)?))
    }
}

/// Applies rotate-half RoPE (HF / GPT-NeoX layout) to `x` [B, H, T, D] with tables [B, T, D/2].
pub fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor, mode: Mode) -> Result<Tensor> {
    match mode {
        Mode::Infer => candle_nn::rotary_emb::rope(&x.contiguous()?, cos, sin),
        Mode::Train => {
            let d = x.dim(D::Minus1)?;
            let half = d / 2;
            let cos = cos.unsqueeze(1)?; // [B, 1, T, D/2]
            let sin = sin.unsqueeze(1)?;
            let x1 = x.narrow(D::Minus1, 0, half)?;
            let x2 = x.narrow(D::Minus1, half, half)?;
            let a = (x1.broadcast_mul(&cos)? - x2.broadcast_mul(&sin)?)?;
            let b = (x2.broadcast_mul(&cos)? + x1.broadcast_mul(&sin)?)?;
            Tensor::cat(&[a, b], D::Minus1)
        }
    }
}

/// RoPE on `x` [B, T, H*D] (a narrow of the fused q/k/v projection), returning [B, H, T, D]
/// contiguous: the fused kernel for f32 on the CPU, grpo's kernel on a GPU, else a reshape,
/// transpose and [`apply_rope`].
pub fn rope_heads(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    heads: usize,
    mode: Mode,
    compute: Compute,
) -> Result<Tensor> {
    if compute.fuses(x) {
        return super::fused::rope_heads(x, cos, sin, heads);
    }
    #[cfg(feature = "cuda")]
    if compute.on_gpu() {
        if let Some(y) = super::fused_gpu::rope_heads(x, cos, sin, heads)? {
            return Ok(y);
        }
    }
    let (b, t, hd) = x.dims3()?;
    let x = x.reshape((b, t, heads, hd / heads))?.transpose(1, 2)?; // [B, H, T, D]
    apply_rope(&x, cos, sin, mode)
}

/// How attention is masked.
#[derive(Debug, Clone)]
pub enum AttnMask {
    /// Additive `[B, 1, S, Tk]` f32 (0 or [`MASK_VALUE`]).
    Dense(Tensor),
    /// A dense mask with its key runs read once for every layer (see [`AttnMask::dense`]).
    Spanned(Tensor, Arc<Spans>),
    /// One query per row (decoding): row `b` attends key slots `pad[b]..Tk` (left padding).
    /// With a [`SharedPrefix`], rows of a group read their common prompt slots from one row.
    LeftPad(Vec<usize>, Option<SharedPrefix>),
    /// A GPU's decoding step: [`AttnMask::LeftPad`] as a dense additive `[B, 1, 1, Tk]` f32 mask
    /// (built once per step) with its [`SharedPrefix`] on the device: each row's leader `[B]`
    /// u32, and the shared slots' end (without a prefix, each row its own leader over 0 slots).
    SharedDense(Tensor, Tensor, usize),
}

/// Rows of a decoding batch that hold the same keys and values in slots `pad[b]..end` (one
/// prompt's, copied from one prefill into each of its samples' rows): row `b` reads those slots
/// from row `leader[b]` (itself for the first row of a group), so that a group's G rows read their
/// prompt once between them and the rest stays in cache. Slots from `end` on are each row's own.
#[derive(Debug, Clone, PartialEq)]
pub struct SharedPrefix {
    pub leader: Vec<usize>,
    pub end: usize,
}

impl SharedPrefix {
    /// Whether it can serve rows with left padding `pad` over `slots` cached key slots: one
    /// leader per row, each a row of the batch with the same padding (the same prompt), and the
    /// shared slots inside the cache. Attention ignores a prefix that does not fit.
    pub fn fits(&self, pad: &[usize], slots: usize) -> bool {
        let b = pad.len();
        self.leader.len() == b
            && self.end <= slots
            && self
                .leader
                .iter()
                .zip(pad)
                .all(|(&l, &p)| l < b && pad[l] == p)
    }
}

impl AttnMask {
    /// A dense additive mask `[B, 1, S, Tk]`; on the CPU its key runs are read here, once, for the
    /// fused attention of every layer.
    pub fn dense(mask: Tensor) -> Result<Self> {
        Ok(match mask.device().is_cpu() {
            true => {
                let spans = Arc::new(Spans::new(&mask)?);
                AttnMask::Spanned(mask, spans)
            }
            false => AttnMask::Dense(mask),
        })
    }

    /// `self` with sliding-window attention: a key `window` or more positions before its query
    /// is masked too. Without a cache (`first_slot` None) the distance is that of the batch's
    /// `positions` [B, S] (keys are the queries), so a packed continuation counts from its own
    /// prompt as it would alone; over a cache (or without positions) it is the distance of key
    /// slots, queries at slots `first_slot..first_slot + S` (the sampler writes each row's
    /// tokens in consecutive slots).
    /// Still 0 / [`MASK_VALUE`], so the fused attention's key runs express it.
    pub fn windowed(
        &self,
        window: usize,
        positions: Option<&Tensor>,
        first_slot: Option<usize>,
    ) -> Result<AttnMask> {
        let dense = match self {
            AttnMask::LeftPad(pad, shared) => {
                // One query, at slot `first_slot`: keys from slot first_slot + 1 - window on.
                let from = (first_slot.unwrap_or(0) + 1).saturating_sub(window);
                let pad = pad.iter().map(|&p| p.max(from)).collect();
                return Ok(AttnMask::LeftPad(pad, shared.clone()));
            }
            AttnMask::Dense(m) | AttnMask::Spanned(m, _) | AttnMask::SharedDense(m, ..) => m,
        };
        let (b, _, s, tk) = dense.dims4()?;
        let dev = dense.device();
        let slots = |from: usize, n: usize| -> Result<Tensor> {
            Tensor::arange(from as u32, (from + n) as u32, dev)?
                .to_dtype(DType::F32)?
                .unsqueeze(0)?
                .broadcast_as((b, n))
        };
        let (pq, pk) = match (first_slot, positions) {
            (None, Some(p)) if tk == s => {
                let p = p.to_dtype(DType::F32)?; // [B, S]
                (p.clone(), p)
            }
            _ => (slots(first_slot.unwrap_or(0), s)?, slots(0, tk)?), // [B, S], [B, Tk]
        };
        let far = pq
            .unsqueeze(2)?
            .broadcast_sub(&pk.unsqueeze(1)?)?
            .ge(window as f64)?; // [B, S, Tk]
        let masked = Tensor::full(MASK_VALUE, (b, s, tk), dev)?;
        let extra = far
            .where_cond(&masked, &masked.zeros_like()?)?
            .unsqueeze(1)?
            .to_dtype(dense.dtype())?; // [B, 1, S, Tk]
        AttnMask::dense(dense.minimum(&extra)?)
    }

    /// The additive mask `[B, 1, S, Tk]` for `s` queries over `tk` key slots.
    pub(crate) fn to_dense(&self, s: usize, tk: usize, device: &Device) -> Result<Tensor> {
        match self {
            AttnMask::Dense(m) | AttnMask::Spanned(m, _) | AttnMask::SharedDense(m, ..) => {
                Ok(m.clone())
            }
            AttnMask::LeftPad(pad, _) => {
                let valid: Vec<Vec<bool>> = pad
                    .iter()
                    .map(|&p| (0..tk).map(|j| j >= p).collect())
                    .collect();
                build_mask(&valid, tk - s, s, tk, device)
            }
        }
    }
}

/// Attention with Gemma 2's score softcapping, `cap * tanh(score * scale / cap)` before the
/// mask, as candle ops on every device: no fused kernel has the cap. `q` [B, H, S, D],
/// `k`/`v` [B, Hkv, Tk, D]; returns [B, S, H*D].
pub fn softcapped_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &AttnMask,
    scale: f64,
    cap: f64,
    mode: Mode,
) -> Result<Tensor> {
    let (b, h, s, d) = q.dims4()?;
    let (hkv, tk) = (k.dim(1)?, k.dim(2)?);
    let g = h / hkv;
    let dense = mask.to_dense(s, tk, q.device())?; // [B, 1, S, Tk]
                                                   // Query heads h = j*g + i all read kv head j: fold the group into the query axis.
    let q = q.contiguous()?.reshape((b, hkv, g * s, d))?; // [B, Hkv, g*S, D]
    let scores = q.matmul(&matmul_operand(k)?.t()?)?; // [B, Hkv, g*S, Tk]
    let scores = scores.to_dtype(reduce_dtype(scores.dtype()))?;
    let scores = (((scores * scale)? / cap)?.tanh()? * cap)?;
    let mask = dense.to_dtype(scores.dtype())?;
    let mask = mask
        .unsqueeze(2)?
        .broadcast_as((b, 1, g, s, tk))?
        .reshape((b, 1, g * s, tk))?;
    let probs = softmax(&scores.broadcast_add(&mask)?, mode)?.to_dtype(v.dtype())?;
    let out = probs.matmul(&matmul_operand(v)?)?; // [B, Hkv, g*S, D]
    out.reshape((b, h, s, d))?
        .transpose(1, 2)? // [B, S, H, D]
        .reshape((b, s, h * d))
}

/// Scaled dot-product attention with grouped KV heads, without copying K/V per group.
///
/// `q` [B, H, S, D], `k`/`v` [B, Hkv, Tk, D]. Returns [B, S, H*D]. Single-query decoding on CPU
/// f32 takes a fused kernel ([`decode_attention_cpu`]), several queries on CPU f32 the fused
/// kernel with a backward ([`super::fused_attention`]); other devices and dtypes go through matmuls.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &AttnMask,
    mode: Mode,
    compute: Compute,
) -> Result<Tensor> {
    let (b, h, s, d) = q.dims4()?;
    let tk = k.dim(2)?;
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    let shared_dev = match mask {
        AttnMask::SharedDense(_, leader, end) => Some((leader, *end)),
        _ => None,
    };
    let (dense, spans) = match mask {
        AttnMask::Dense(m) | AttnMask::SharedDense(m, ..) => (m.clone(), None),
        AttnMask::Spanned(m, sp) => (m.clone(), Some(sp.clone())),
        AttnMask::LeftPad(pad, shared) => {
            if mode == Mode::Infer && s == 1 {
                if let Some(out) = decode_attention_cpu(q, k, v, pad, shared.as_ref(), compute)? {
                    return Ok(out);
                }
            }
            let valid: Vec<Vec<bool>> = pad
                .iter()
                .map(|&p| (0..tk).map(|j| j >= p).collect())
                .collect();
            (build_mask(&valid, tk - 1, 1, tk, q.device())?, None)
        }
    };
    let hkv = k.dim(1)?;
    let g = h / hkv;
    let scale = 1.0 / (d as f64).sqrt();
    #[cfg(feature = "cuda")]
    if s == 1 && mode == Mode::Infer && compute.on_gpu() {
        // A GPU's decoding step: one kernel over the KV cache's views.
        if let Some(out) = super::fused_gpu::decode_attention(q, k, v, &dense, scale, shared_dev)? {
            return Ok(out); // [B, 1, H*D]
        }
    }
    if s > 1 && compute.fuses(q) && compute.fuses(k) && compute.fuses(v) {
        let spans = match spans {
            Some(sp) if sp.dims() == (b, s, tk) => sp,
            _ => Arc::new(Spans::new(&dense.broadcast_as((b, 1, s, tk))?)?),
        };
        return super::fused_attention::attention(q, k, v, &spans, scale);
    }
    if s > 1 && !compute.fuses(q) {
        // The portable path (a GPU's): query chunks, no [B, H, S, Tk] kept for the backward.
        let record = mode == Mode::Train;
        let out = super::chunked_attention::attention(q, k, v, &dense, scale, record, compute)?;
        return out
            .transpose(1, 2)? // [B, S, H, D]
            .reshape((b, s, h * d));
    }
    // Query heads h = j*g + i all read kv head j: fold the group into the query axis.
    let q = q.contiguous()?.reshape((b, hkv, g * s, d))?; // [B, Hkv, g*S, D]
    let k = matmul_operand(k)?;
    let probs = if compute.fuses(&q) {
        let raw = q.matmul(&k.t()?)?; // [B, Hkv, g*S, Tk]
        super::fused::masked_softmax(&raw, &dense, scale, s)?
    } else {
        let scores = (q.matmul(&k.t()?)? * scale)?; // [B, Hkv, g*S, Tk]
        let scores = scores.to_dtype(reduce_dtype(scores.dtype()))?;
        let mask = dense.to_dtype(scores.dtype())?;
        let mask = if g == 1 {
            mask
        } else {
            mask.unsqueeze(2)?
                .broadcast_as((b, 1, g, s, tk))?
                .reshape((b, 1, g * s, tk))?
        };
        let scores = scores.broadcast_add(&mask)?;
        softmax(&scores, mode)?.to_dtype(v.dtype())?
    };
    let out = probs.matmul(&matmul_operand(v)?)?; // [B, Hkv, g*S, D]
    out.reshape((b, h, s, d))?
        .transpose(1, 2)? // [B, S, H, D]
        .reshape((b, s, h * d))
}

/// Fused single-query attention for decoding, reading the KV cache views in place: for each row
/// and kv head, the g query heads score the unmasked key slots, softmax, and weight the values.
/// `q` [B, H, 1, D]; `k`/`v` [B, Hkv, Tk, D] with unit last stride. With `shared`, a row reads
/// slots `pad..end` from its group's leader row (see [`SharedPrefix`]). Returns `None` (caller
/// falls back to matmuls) unless everything is f32 on the CPU.
pub fn decode_attention_cpu(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    pad: &[usize],
    shared: Option<&SharedPrefix>,
    compute: Compute,
) -> Result<Option<Tensor>> {
    use candle_core::{CpuStorage, Storage};
    use rayon::prelude::*;
    if !compute.fuses(q) || !compute.fuses(k) {
        return Ok(None);
    }
    let (b, h, _, d) = q.dims4()?;
    let (_, hkv, tk, _) = k.dims4()?;
    if k.stride()[3] != 1
        || k.stride()[2] != d
        || k.stride() != v.stride()
        || v.stride()[3] != 1
        || pad.len() != b
        || pad.iter().any(|&p| p >= tk)
    {
        return Ok(None);
    }
    let shared = shared.filter(|sp| sp.fits(pad, tk));
    let g = h / hkv;
    let scale = 1.0 / (d as f32).sqrt();
    let q = q.contiguous()?;
    let (qs, ql) = q.storage_and_layout();
    let (ks, kl) = k.storage_and_layout();
    let (vs, vl) = v.storage_and_layout();
    let (
        Storage::Cpu(CpuStorage::F32(qd)),
        Storage::Cpu(CpuStorage::F32(kd)),
        Storage::Cpu(CpuStorage::F32(vd)),
    ) = (&*qs, &*ks, &*vs)
    else {
        return Ok(None);
    };
    let qd = &qd[ql.start_offset()..];
    let (kd, vd) = (&kd[kl.start_offset()..], &vd[vl.start_offset()..]);
    let st = kl.stride();
    let (sb, sh) = (st[0], st[1]);
    let mut out = vec![0f32; b * h * d];
    out.par_chunks_mut(g * d).enumerate().for_each(|(bj, o)| {
        let (bi, j) = (bj / hkv, bj % hkv);
        let p0 = pad[bi].min(tk);
        let qg = &qd[(bi * h + j * g) * d..(bi * h + (j + 1) * g) * d];
        let slots = |row: usize, from: usize, to: usize| {
            let (a, e) = (row * sb + j * sh + from * d, row * sb + j * sh + to * d);
            (&kd[a..e], &vd[a..e])
        };
        match shared {
            Some(sp) if sp.end > p0 && sp.leader[bi] != bi => {
                let segs = [slots(sp.leader[bi], p0, sp.end), slots(bi, sp.end, tk)];
                super::fused_attention::decode_head(qg, &segs, scale, o, d);
            }
            _ => super::fused_attention::decode_head(qg, &[slots(bi, p0, tk)], scale, o, d),
        }
    });
    drop((qs, ks, vs));
    Ok(Some(Tensor::from_vec(out, (b, 1, h * d), q.device())?))
}

/// Additive attention mask [B, 1, S, Tk] for queries at key slots `q_slots[b][s]` attending to key
/// slots `0..Tk` that are valid (`key_valid[b][j]`) and not after the query (causal by slot).
pub fn build_mask(
    key_valid: &[Vec<bool>],
    q_slot_start: usize,
    s: usize,
    tk: usize,
    device: &Device,
) -> Result<Tensor> {
    let b = key_valid.len();
    let mut m = vec![0f32; b * s * tk];
    for (bi, valid) in key_valid.iter().enumerate() {
        for si in 0..s {
            let q_slot = q_slot_start + si;
            let row = &mut m[(bi * s + si) * tk..(bi * s + si + 1) * tk];
            for (j, x) in row.iter_mut().enumerate() {
                let ok = j <= q_slot && valid.get(j).copied().unwrap_or(false);
                if !ok {
                    *x = MASK_VALUE;
                }
            }
        }
    }
    Tensor::from_vec(m, (b, 1, s, tk), device)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The largest |a - b| (f32 tensors): shared by the models' unit tests.
    pub(crate) fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    /// Rows 0-2 share one prompt (slots 1..5 equal, slot 0 padding), row 3 is another prompt:
    /// reading the shared slots from the leader gives what each row's own copy gives, and a
    /// leader with another padding is not used.
    #[test]
    fn decode_attention_reads_a_shared_prompt_from_its_leader() {
        if crate::kernels::kernels() == crate::kernels::Kernels::Portable {
            return; // a test of the CPU kernel, which the portable kernels do not run
        }
        let dev = Device::Cpu;
        let (b, hkv, g, tk, d) = (4, 2, 3, 9, 64);
        let prompt = Tensor::randn(0f32, 1.0, (1, hkv, 5, d), &dev).unwrap();
        let mut ks = vec![];
        let mut vs = vec![];
        for r in 0..b {
            let own = Tensor::randn(0f32, 1.0, (1, hkv, tk - 5, d), &dev).unwrap();
            let pre = match r {
                3 => Tensor::randn(0f32, 1.0, (1, hkv, 5, d), &dev).unwrap(),
                _ => prompt.clone(),
            };
            ks.push(Tensor::cat(&[&pre, &own], 2).unwrap());
            let own_v = Tensor::randn(0f32, 1.0, (1, hkv, tk - 5, d), &dev).unwrap();
            let pre_v = (&pre * 0.5).unwrap();
            vs.push(Tensor::cat(&[&pre_v, &own_v], 2).unwrap());
        }
        let k = Tensor::cat(&ks, 0).unwrap(); // [B, Hkv, Tk, D]
        let v = Tensor::cat(&vs, 0).unwrap();
        let q = Tensor::randn(0f32, 1.0, (b, hkv * g, 1, d), &dev).unwrap();
        let pad = vec![1, 1, 1, 2];
        let run = |shared: Option<(Vec<usize>, usize)>| {
            let sp = shared.map(|(leader, end)| SharedPrefix { leader, end });
            decode_attention_cpu(&q, &k, &v, &pad, sp.as_ref(), Compute::CpuFused)
                .unwrap()
                .unwrap()
        };
        let own = run(None);
        assert!(max_abs_diff(&own, &run(Some((vec![0, 0, 0, 3], 5)))) < 1e-6);
        // Row 3 named row 0 as its leader, but its padding differs: the sharing is refused.
        assert!(max_abs_diff(&own, &run(Some((vec![0, 0, 0, 0], 5)))) < 1e-6);
        // A leader whose slots differ changes the result (the leader's slots are really read).
        assert!(max_abs_diff(&own, &run(Some((vec![0, 0, 0, 3], 6)))) > 1e-3);
    }

    /// The recorded RMSNorm: the same value as the graph twin, bit for bit, and the gradients of
    /// x and w within 1e-5 (f32) through a weighted sum; no weight gradient when it is frozen;
    /// bf16 within bf16 rounding.
    #[test]
    fn recomputed_rms_norm_equals_the_graph_twin_with_gradients() {
        let dev = Device::Cpu;
        let x = candle_core::Var::randn(0f32, 1.0, (2, 3, 8), &dev).unwrap();
        let w = candle_core::Var::randn(1f32, 0.2, 8, &dev).unwrap();
        let c = Tensor::randn(0f32, 1.0, (2, 3, 8), &dev).unwrap();
        let want = rms_norm_diff(&x, &w, 1e-5).unwrap();
        let got = rms_norm_recomputed(&x, &w, 1e-5).unwrap();
        assert_eq!(
            want.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            got.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        );
        let gw = (&want * &c).unwrap().sum_all().unwrap().backward().unwrap();
        let gg = (&got * &c).unwrap().sum_all().unwrap().backward().unwrap();
        for v in [&x, &w] {
            let d = max_abs_diff(gw.get(v).unwrap(), gg.get(v).unwrap());
            assert!(d < 1e-5, "{d}");
        }
        let frozen = w.as_tensor().detach();
        let g = rms_norm_recomputed(&x, &frozen, 1e-5)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        assert!(g.get(&x).is_some() && g.get(&frozen).is_none());
        let bf = |t: &Tensor| t.to_dtype(DType::BF16).unwrap();
        let yb = rms_norm_recomputed(&bf(&x), &bf(&w), 1e-5).unwrap();
        let gb = (yb.to_dtype(DType::F32).unwrap() * &c)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let d = max_abs_diff(gb.get(&x).unwrap(), gw.get(&x).unwrap());
        assert!(d < 5e-2, "bf16 dx {d}");
    }

    #[test]
    fn fused_and_differentiable_kernels_agree() {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (2, 3, 5, 8), &dev).unwrap();
        let w = Tensor::randn(1f32, 0.1, 8, &dev).unwrap();
        let b = Tensor::randn(0f32, 0.1, 8, &dev).unwrap();
        let rms = RmsNorm::new(w.clone(), 1e-5, Compute::resolve(&dev, DType::F32));
        assert!(
            max_abs_diff(
                &rms.forward(&x, Mode::Train).unwrap(),
                &rms.forward(&x, Mode::Infer).unwrap()
            ) < 1e-5
        );
        let ln = LayerNorm {
            weight: w,
            bias: b,
            eps: 1e-5,
        };
        assert!(
            max_abs_diff(
                &ln.forward(&x, Mode::Train).unwrap(),
                &ln.forward(&x, Mode::Infer).unwrap()
            ) < 1e-5
        );
        assert!(
            max_abs_diff(
                &softmax(&x, Mode::Train).unwrap(),
                &softmax(&x, Mode::Infer).unwrap()
            ) < 1e-6
        );
        let pos = Tensor::new(&[[0u32, 1, 2, 3, 4], [7, 8, 9, 10, 11]], &dev).unwrap();
        let cfg = ModelConfig {
            arch: super::super::config::Arch::Llama,
            vocab_size: 4,
            hidden_size: 24,
            intermediate_size: 4,
            num_layers: 1,
            num_heads: 3,
            num_kv_heads: 3,
            head_dim: 8,
            norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: None,
            rope_freq_factors: None,
            max_position_embeddings: 32,
            tie_word_embeddings: true,
            attention_bias: false,
            mlp_bias: false,
            qk_norm: false,
            bos_token_id: None,
            eos_token_ids: vec![],
            build_quantized: None,
            extras: Default::default(),
        };
        let rope = Rope::new(&cfg, &dev).unwrap();
        let (c, s) = rope.tables(&pos, DType::F32).unwrap();
        let a = apply_rope(&x, &c, &s, Mode::Train).unwrap();
        let f = apply_rope(&x, &c, &s, Mode::Infer).unwrap();
        assert!(max_abs_diff(&a, &f) < 1e-5);
    }

    /// The window masks keys `window` or more positions back: by positions without a cache
    /// (a packed continuation counts from its prompt), by slots over one, as raised left padding
    /// when decoding; what the mask already masked stays masked.
    #[test]
    fn windowed_mask_masks_keys_a_window_back() {
        let dev = Device::Cpu;
        // One row: a prompt at positions 0..3, then a continuation at 3, 4 that sees the prompt
        // and itself, and a second continuation at 3 that sees only the prompt and itself.
        let pos = Tensor::new(&[[0u32, 1, 2, 3, 4, 3]], &dev).unwrap();
        let sees = [
            vec![0],
            vec![0, 1],
            vec![0, 1, 2],
            vec![0, 1, 2, 3],
            vec![0, 1, 2, 3, 4],
            vec![0, 1, 2, 5],
        ];
        let mut m = vec![MASK_VALUE; 36];
        for (q, ks) in sees.iter().enumerate() {
            ks.iter().for_each(|&k| m[q * 6 + k] = 0.0);
        }
        let mask = AttnMask::dense(Tensor::from_vec(m, (1, 1, 6, 6), &dev).unwrap()).unwrap();
        let allowed = |mask: &AttnMask| -> Vec<Vec<usize>> {
            let AttnMask::Spanned(t, _) = mask else {
                panic!("a dense mask on the CPU is spanned")
            };
            let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let tk = t.dim(3).unwrap();
            v.chunks(tk)
                .map(|r| (0..tk).filter(|&k| r[k] == 0.0).collect())
                .collect()
        };
        let by_pos = mask.windowed(2, Some(&pos), None).unwrap();
        let want: Vec<Vec<usize>> = vec![
            vec![0],
            vec![0, 1],
            vec![1, 2],
            vec![2, 3],
            vec![3, 4],
            vec![2, 5],
        ];
        assert_eq!(allowed(&by_pos), want);
        // Over a cache: 2 queries at slots 4, 5 of 6 key slots, all keys valid.
        let cached = AttnMask::dense(build_mask(&[vec![true; 6]], 4, 2, 6, &dev).unwrap()).unwrap();
        let by_slot = cached.windowed(3, None, Some(4)).unwrap();
        assert_eq!(allowed(&by_slot), vec![vec![2, 3, 4], vec![3, 4, 5]]);
        // Decoding at slot 6 (7 key slots) with window 3: keys from slot 4 on.
        let pads = AttnMask::LeftPad(vec![0, 5], None);
        match pads.windowed(3, None, Some(6)).unwrap() {
            AttnMask::LeftPad(p, None) => assert_eq!(p, vec![4, 5]),
            other => panic!("{other:?}"),
        }
    }

    /// Softcapped attention against a plain f32 twin (grouped heads, a masked key); a cap far
    /// above the scores gives plain attention.
    #[test]
    fn softcapped_attention_matches_plain_twin() {
        let dev = Device::Cpu;
        let (h, hkv, s, d) = (4, 2, 3, 4);
        let q = (Tensor::randn(0f32, 1.0, (1, h, s, d), &dev).unwrap() * 3.0).unwrap();
        let k = Tensor::randn(0f32, 1.0, (1, hkv, s, d), &dev).unwrap();
        let v = Tensor::randn(0f32, 1.0, (1, hkv, s, d), &dev).unwrap();
        let valid = vec![vec![false, true, true]];
        let mask = AttnMask::Dense(build_mask(&valid, 0, s, s, &dev).unwrap());
        let (scale, cap) = (0.4, 2.0);
        let got = softcapped_attention(&q, &k, &v, &mask, scale, cap, Mode::Train).unwrap();
        let got = got.flatten_all().unwrap().to_vec1::<f32>().unwrap(); // [S, H*D]
        let at = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let (qv, kv, vv) = (at(&q), at(&k), at(&v));
        for hi in 0..h {
            let j = hi / (h / hkv);
            for si in 1..s {
                let keys: Vec<usize> = (1..=si).collect();
                let scores: Vec<f32> = keys
                    .iter()
                    .map(|&t| {
                        let dot: f32 = (0..d)
                            .map(|x| qv[(hi * s + si) * d + x] * kv[(j * s + t) * d + x])
                            .sum();
                        cap as f32 * (dot * scale as f32 / cap as f32).tanh()
                    })
                    .collect();
                let mx = scores.iter().cloned().fold(f32::MIN, f32::max);
                let e: Vec<f32> = scores.iter().map(|x| (x - mx).exp()).collect();
                let z: f32 = e.iter().sum();
                for x in 0..d {
                    let want: f32 = keys
                        .iter()
                        .zip(&e)
                        .map(|(&t, w)| w / z * vv[(j * s + t) * d + x])
                        .sum();
                    let g = got[si * h * d + hi * d + x];
                    assert!((g - want).abs() < 1e-5, "{g} vs {want}");
                }
            }
        }
        let uncapped = softcapped_attention(&q, &k, &v, &mask, 0.5, 1e9, Mode::Infer).unwrap();
        let plain = attention(&q, &k, &v, &mask, Mode::Infer, Compute::Portable).unwrap();
        assert!(max_abs_diff(&uncapped, &plain) < 1e-5);
    }

    /// Plain-f32 twin of RMSNorm for one row.
    fn rms_norm_slow(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
        let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
        let r = 1.0 / (ms + eps).sqrt();
        x.iter().zip(w).map(|(v, w)| v * r * w).collect()
    }

    #[test]
    fn rms_norm_matches_plain_twin() {
        let dev = Device::Cpu;
        let x = vec![0.5f32, -1.0, 2.0, 0.25];
        let w = vec![1.0f32, 0.5, -1.0, 2.0];
        let t = rms_norm_diff(
            &Tensor::new(x.as_slice(), &dev)
                .unwrap()
                .unsqueeze(0)
                .unwrap(),
            &Tensor::new(w.as_slice(), &dev).unwrap(),
            1e-5,
        )
        .unwrap()
        .squeeze(0)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
        for (a, b) in t.iter().zip(rms_norm_slow(&x, &w, 1e-5)) {
            assert!((a - b).abs() < 1e-6);
        }
    }

    #[test]
    fn llama3_scaling_changes_only_low_frequencies() {
        let s = Llama3RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 32,
        };
        let plain = rope_inv_freq(16, 500000.0, None);
        let scaled = rope_inv_freq(16, 500000.0, Some(s));
        assert_eq!(plain[0], scaled[0]); // highest frequency untouched
        let last = plain.len() - 1;
        assert!((scaled[last] - plain[last] / 8.0).abs() < 1e-15); // lowest divided by factor
    }
}
