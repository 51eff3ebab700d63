//! AdamW (torch's update, decoupled weight decay) with state that can be saved and restored,
//! global-norm gradient clipping, and HF's learning-rate schedules.
//!
//! Written here rather than taken from candle-nn: candle-nn's `AdamW` has no way to save or load
//! its moments (so no exact resume), allocates about 14 temporaries per parameter per step, and
//! silently skips parameters without a gradient. On the CPU this one keeps the moments in host
//! memory and updates each parameter in one fused pass (clip scale, decay, both moments, the
//! step) in place; on a GPU, and under `kernels = "portable"`, the moments are tensors on the
//! parameter's device and the same formula runs as candle ops there (no host round trip). A
//! missing gradient is an error. Its state can be sharded over the ranks of a run ([`zero`]:
//! `zero_stage`), each rank stepping its own range of the parameters.

pub mod exchange;
pub mod zero;
pub mod zero3;

use std::cell::RefCell;
use std::ops::Range;

use candle_core::{CpuStorage, Layout, Tensor, Var};
use grpo_models::kernels::{device_kind, Compute, DeviceKind};
use rayon::prelude::*;

use crate::named::named_enum;
use crate::{Error, Result};
use zero::Alone;
pub use zero::{Gradients, Ranks, Shard, ZeroStage};

named_enum! {
    /// HF learning-rate schedules (`lr_scheduler_type`).
    pub enum LrSchedule {
        Constant = "constant",
        ConstantWithWarmup = "constant_with_warmup",
        Linear = "linear",
        Cosine = "cosine",
    }
}

/// Trainable parameters by name, as tensors that track gradients (`track`: a forward over them
/// builds a graph back to the `Var`s) or detached (sampling, scoring, saving).
pub fn var_tensors<T: FromIterator<(String, Tensor)>>(
    names: &[String],
    vars: &[candle_core::Var],
    track: bool,
) -> T {
    names
        .iter()
        .zip(vars)
        .map(|(n, v)| {
            let t = v.as_tensor();
            (n.clone(), if track { t.clone() } else { t.detach() })
        })
        .collect()
}

/// AdamW hyper-parameters (torch names).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

/// One trainable parameter and its moments.
struct Slot {
    name: String,
    var: Var,
    /// How its step runs: in place on the CPU ([`Compute::is_fused`]), as one kernel on a GPU
    /// ([`Compute::Gpu`]), else as candle ops.
    compute: Compute,
    /// The elements of the parameter (flattened) this rank steps and keeps moments for: all of
    /// them, unless the state is sharded ([`zero`]), when it may be a part or none.
    part: Range<usize>,
    moments: Moments,
}

impl Slot {
    /// Whether this rank steps the whole parameter.
    fn whole(&self) -> bool {
        self.part.len() == self.var.elem_count()
    }
}

/// AdamW's first and second moments of one parameter's part (see [`Slot::part`]).
enum Moments {
    /// In host memory, updated by the fused in-place step (f32 CPU parameters).
    Host {
        exp_avg: Vec<f32>,
        exp_avg_sq: Vec<f32>,
    },
    /// f32 tensors on the parameter's device, updated by candle ops (GPU, portable kernels):
    /// the parameter's shape for the whole of it, flat (`[part]`) for a part.
    Device { exp_avg: Tensor, exp_avg_sq: Tensor },
}

impl Moments {
    fn zeros(var: &Var, compute: Compute, part: &Range<usize>) -> Result<Moments> {
        Ok(if compute.is_fused() {
            Moments::Host {
                exp_avg: vec![0.0; part.len()],
                exp_avg_sq: vec![0.0; part.len()],
            }
        } else {
            let shape = match part.len() == var.elem_count() {
                true => var.shape().clone(),
                false => part.len().into(),
            };
            // Two buffers: the GPU's AdamW kernel updates both in place.
            let z = || Tensor::zeros(&shape, candle_core::DType::F32, var.device());
            Moments::Device {
                exp_avg: z()?,
                exp_avg_sq: z()?,
            }
        })
    }

    /// The first (`second` false) or second moment as one host slice handed to `f` (a copy
    /// for a tensor).
    fn with_host<T>(&self, second: bool, f: impl FnOnce(&[f32]) -> Result<T>) -> Result<T> {
        match self {
            Moments::Host {
                exp_avg,
                exp_avg_sq,
            } => f(if second { exp_avg_sq } else { exp_avg }),
            Moments::Device {
                exp_avg,
                exp_avg_sq,
            } => {
                let t = if second { exp_avg_sq } else { exp_avg };
                f(&t.flatten_all()?.to_vec1::<f32>()?)
            }
        }
    }
}

/// AdamW over named `Var`s (f32).
pub struct AdamW {
    cfg: AdamWConfig,
    slots: Vec<Slot>,
    /// Optimizer steps taken (torch's `step` state; bias corrections use it).
    step: u64,
    /// How much of the state each rank keeps (`zero_stage`), and its range of the parameters
    /// (all of them when not sharded).
    stage: ZeroStage,
    shard: Shard,
    /// Stage 3: the sharded parameters whose range the one flat slot is ([`zero3`]).
    flat: Option<std::sync::Arc<zero3::ShardedParams>>,
}

/// The scalars of one AdamW step of one parameter.
#[derive(Debug, Clone, Copy)]
struct StepScalars {
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
    bias_correction1: f32,
    bias_correction2_sqrt: f32,
    /// Gradient clipping factor (1 = none).
    grad_scale: f32,
}

impl StepScalars {
    /// The step as candle ops on the parameter's device: `(p, exp_avg, exp_avg_sq)` after it.
    /// The same formula, operation for operation, as [`FusedStep::apply`].
    fn tensors(
        &self,
        p: &Tensor,
        g: &Tensor,
        m: &Tensor,
        v: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let scalar = |x: f32| Tensor::new(x, p.device());
        let gi = g.broadcast_mul(&scalar(self.grad_scale)?)?; // [..] f32
        let p = p.broadcast_mul(&scalar(1.0 - self.lr * self.weight_decay)?)?;
        let m = (m + (&gi - m)?.broadcast_mul(&scalar(1.0 - self.beta1)?)?)?;
        let v = (v.broadcast_mul(&scalar(self.beta2)?)?
            + gi.broadcast_mul(&scalar(1.0 - self.beta2)?)?.mul(&gi)?)?;
        let denom = v
            .sqrt()?
            .broadcast_div(&scalar(self.bias_correction2_sqrt)?)?
            .broadcast_add(&scalar(self.eps)?)?;
        let step_size = scalar(self.lr / self.bias_correction1)?;
        let p = (p - m.broadcast_mul(&step_size)?.div(&denom)?)?;
        Ok((p, m, v))
    }
}

#[cfg(feature = "cuda")]
impl StepScalars {
    /// The step as one GPU kernel, in place on `p`, `m` and `v` (the formula of
    /// [`FusedStep::apply`]); false where grpo's kernels do not take these tensors.
    fn on_gpu(&self, p: &Tensor, g: &Tensor, m: &Tensor, v: &Tensor) -> Result<bool> {
        let s = grpo_models::kernels::cuda::AdamWScalars {
            grad_scale: self.grad_scale,
            decay: 1.0 - self.lr * self.weight_decay,
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            bias_correction2_sqrt: self.bias_correction2_sqrt,
            step_size: self.lr / self.bias_correction1,
        };
        Ok(grpo_models::kernels::cuda::adamw_step(p, g, m, v, &s)?)
    }
}

/// The update of one parameter's part, run in place on its storage: the elements from
/// `offset` on, as many as the gradient has (all of them when not sharded).
struct FusedStep<'a> {
    exp_avg: RefCell<&'a mut [f32]>,
    exp_avg_sq: RefCell<&'a mut [f32]>,
    s: StepScalars,
    offset: usize,
}

impl FusedStep<'_> {
    /// torch.optim.AdamW (single-tensor path) on plain slices.
    fn apply(&self, p: &mut [f32], g: &[f32]) {
        let mut m_ref = self.exp_avg.borrow_mut();
        let mut v_ref = self.exp_avg_sq.borrow_mut();
        let (m, v): (&mut [f32], &mut [f32]) = (&mut m_ref, &mut v_ref);
        let s = &self.s;
        let step_size = s.lr / s.bias_correction1;
        let decay = 1.0 - s.lr * s.weight_decay;
        let (b1, b2, eps, gs, bc2) = (
            s.beta1,
            s.beta2,
            s.eps,
            s.grad_scale,
            s.bias_correction2_sqrt,
        );
        const CHUNK: usize = 1 << 14;
        p.par_chunks_mut(CHUNK)
            .zip(g.par_chunks(CHUNK))
            .zip(m.par_chunks_mut(CHUNK))
            .zip(v.par_chunks_mut(CHUNK))
            .for_each(|(((p, g), m), v)| {
                for i in 0..p.len() {
                    let gi = g[i] * gs;
                    p[i] *= decay;
                    m[i] += (gi - m[i]) * (1.0 - b1);
                    v[i] = v[i] * b2 + (1.0 - b2) * gi * gi;
                    let denom = v[i].sqrt() / bc2 + eps;
                    p[i] -= step_size * m[i] / denom;
                }
            });
    }
}

/// [`FusedStep`] with the gradient given as a host slice (this rank's part of a reduce-scatter):
/// one operand, the parameter.
struct FusedStepOf<'o, 'a>(&'o FusedStep<'a>, &'o [f32]);

impl candle_core::InplaceOp1 for FusedStepOf<'_, '_> {
    fn name(&self) -> &'static str {
        "adamw-step"
    }
    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> candle_core::Result<()> {
        let (CpuStorage::F32(p), Some((a, b))) = (s, l.contiguous_offsets()) else {
            candle_core::bail!("adamw: contiguous f32 parameters only");
        };
        let (g, at) = (self.1, self.0.offset);
        let Some(p) = p[a..b].get_mut(at..at + g.len()) else {
            candle_core::bail!("adamw: a part of {} from {at} of {}", g.len(), b - a);
        };
        self.0.apply(p, g);
        Ok(())
    }
}

/// The f32 slices of an in-place op's two contiguous CPU operands, or an error naming `op`.
fn f32_pair<'a>(
    op: &str,
    s1: &'a mut CpuStorage,
    l1: &Layout,
    s2: &'a CpuStorage,
    l2: &Layout,
) -> candle_core::Result<(&'a mut [f32], &'a [f32])> {
    let (CpuStorage::F32(a), CpuStorage::F32(b)) = (s1, s2) else {
        candle_core::bail!("{op}: f32 tensors only");
    };
    let (Some((a0, a1)), Some((b0, b1))) = (l1.contiguous_offsets(), l2.contiguous_offsets())
    else {
        candle_core::bail!("{op}: contiguous tensors only");
    };
    Ok((&mut a[a0..a1], &b[b0..b1]))
}

impl candle_core::InplaceOp2 for FusedStep<'_> {
    fn name(&self) -> &'static str {
        "adamw-step"
    }
    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<()> {
        let (p, g) = f32_pair("adamw", s1, l1, s2, l2)?;
        let Some(p) = p.get_mut(self.offset..self.offset + g.len()) else {
            candle_core::bail!(
                "adamw: a part of {} from {} of {}",
                g.len(),
                self.offset,
                p.len()
            );
        };
        self.apply(p, g);
        Ok(())
    }
}

impl AdamW {
    /// Moments start at zero. Parameters must be f32. Not sharded: every rank keeps the whole
    /// state and steps every parameter.
    pub fn new(params: Vec<(String, Var)>, cfg: AdamWConfig) -> Result<Self> {
        Self::sharded(params, cfg, ZeroStage::Off, &Alone)
    }

    /// [`Self::new`] with the state sharded over `world` as `stage` says ([`zero`]): stage 1
    /// and 2 keep the moments of this rank's range of the parameters only (in one process,
    /// all of them: the unsharded optimizer).
    pub fn sharded<R: Ranks + ?Sized>(
        params: Vec<(String, Var)>,
        cfg: AdamWConfig,
        stage: ZeroStage,
        world: &R,
    ) -> Result<Self> {
        let total = params.iter().map(|(_, v)| v.elem_count()).sum();
        let shard = match stage {
            ZeroStage::Off => Shard::whole(total),
            ZeroStage::Moments | ZeroStage::Gradients | ZeroStage::Params => {
                Shard::new(total, world.rank(), world.size())
            }
        };
        let mine = shard.range();
        let mut slots = Vec::with_capacity(params.len());
        let mut offset = 0;
        for (name, var) in params {
            if var.dtype() != candle_core::DType::F32 {
                return Err(Error::config(
                    "dtype",
                    format!(
                        "trainable parameter {name} is {:?}; training keeps parameters in f32",
                        var.dtype()
                    ),
                ));
            }
            let n = var.elem_count();
            // This rank's elements of the parameter, in its own (flat) indices.
            let start = mine.start.clamp(offset, offset + n) - offset;
            let end = mine.end.clamp(offset, offset + n) - offset;
            offset += n;
            let part = start..end;
            let compute = Compute::resolve(var.device(), var.dtype());
            let moments = Moments::zeros(&var, compute, &part)?;
            slots.push(Slot {
                name,
                var,
                compute,
                part,
                moments,
            });
        }
        Ok(Self {
            cfg,
            slots,
            step: 0,
            stage,
            shard,
            flat: None,
        })
    }

    /// Stage 3: AdamW over this rank's range of the sharded `params`, one flat parameter
    /// stepped in place ([`zero3`]); its checkpoints hold every parameter's moments whole.
    pub fn over_sharded(
        params: std::sync::Arc<zero3::ShardedParams>,
        cfg: AdamWConfig,
    ) -> Result<Self> {
        let flat = vec![("zero3".to_string(), params.mine().clone())];
        let mut opt = Self::sharded(flat, cfg, ZeroStage::Off, &Alone)?;
        opt.stage = ZeroStage::Params;
        opt.flat = Some(params);
        Ok(opt)
    }

    /// How its parameters' arithmetic runs (the first's: a run keeps them on one device).
    pub fn compute(&self) -> Compute {
        self.slots.first().map_or(Compute::Portable, |s| s.compute)
    }

    pub fn steps_taken(&self) -> u64 {
        self.step
    }

    /// Parameter names, in order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.slots.iter().map(|s| s.name.as_str())
    }

    /// How the state is sharded, and this rank's range of the flattened parameters.
    pub fn sharding(&self) -> (ZeroStage, &Shard) {
        match &self.flat {
            Some(p) => (self.stage, p.shard()),
            None => (self.stage, &self.shard),
        }
    }

    /// Bytes of the moments this rank keeps (f32: 8 bytes per element of its range).
    pub fn state_bytes(&self) -> usize {
        self.slots.iter().map(|s| 8 * s.part.len()).sum()
    }

    /// One step with `grads` aligned with the parameters (same order as `new`), scaled by
    /// `grad_scale` (the clipping factor) first. One process: the state is not sharded.
    pub fn step(&mut self, grads: &[Tensor], lr: f64, grad_scale: f32) -> Result<()> {
        self.update(Gradients::Full(grads.to_vec()), lr, grad_scale, &Alone)
    }

    /// The world's gradients, as this optimizer's stage takes them: each gradient summed over
    /// the world (`zero_stage` 0 and 1), or this rank's part of their sums (2: a reduce-scatter).
    /// Every rank calls it.
    pub fn reduce<R: Ranks + ?Sized>(
        &self,
        mut grads: Vec<Tensor>,
        world: &R,
    ) -> Result<Gradients> {
        if self.flat.is_some() {
            // Stage 3: the training step already reduce-scattered every gradient into this
            // rank's range, the gradient of the one flat parameter.
            let [g] = grads.as_slice() else {
                return Err(Error::Invariant(format!(
                    "adamw: zero 3 takes its range's gradient, got {} tensors",
                    grads.len()
                )));
            };
            return Ok(Gradients::Part(g.flatten_all()?.to_vec1::<f32>()?));
        }
        if self.stage == ZeroStage::Gradients && self.shard.parts() > 1 {
            return Ok(Gradients::Part(zero::reduce_scatter(
                grads,
                &self.shard,
                world,
            )?));
        }
        world.sum_grads(&mut grads)?;
        Ok(Gradients::Full(grads))
    }

    /// The global L2 norm of the world's `grads` and the factor that clips it to `max_norm`
    /// ([`clip_factor`]; for a part, from every rank's sum of squares).
    pub fn clip<R: Ranks + ?Sized>(
        &self,
        grads: &Gradients,
        max_norm: f64,
        world: &R,
    ) -> Result<(f64, f32)> {
        match grads {
            Gradients::Full(g) => clip_factor(g, max_norm, self.compute()),
            Gradients::Part(p) => zero::clip_part(p, max_norm, world),
        }
    }

    /// One step with the world's `grads` (from [`Self::reduce`]) at `lr`, scaled by
    /// `grad_scale` first: this rank's range of the parameters, then, when the state is
    /// sharded, every rank's ranges gathered into every rank's parameters. Every rank calls it.
    pub fn update<R: Ranks + ?Sized>(
        &mut self,
        grads: Gradients,
        lr: f64,
        grad_scale: f32,
        world: &R,
    ) -> Result<()> {
        if self.shard.parts() != 1 && self.shard.parts() != world.size() {
            return Err(Error::Invariant(format!(
                "adamw: state sharded over {} ranks, stepped in a world of {}",
                self.shard.parts(),
                world.size()
            )));
        }
        self.step += 1;
        let s = self.scalars(lr, grad_scale);
        match grads {
            Gradients::Full(grads) => {
                if grads.len() != self.slots.len() {
                    return Err(Error::Invariant(format!(
                        "adamw: {} gradients for {} parameters",
                        grads.len(),
                        self.slots.len()
                    )));
                }
                for (slot, grad) in self.slots.iter_mut().zip(grads) {
                    if grad.shape() != slot.var.shape() {
                        return Err(Error::Invariant(format!(
                            "adamw: gradient of {} has shape {:?}, parameter {:?}",
                            slot.name,
                            grad.shape(),
                            slot.var.shape()
                        )));
                    }
                    let g = match slot.whole() {
                        true => grad,
                        false => grad
                            .flatten_all()?
                            .narrow(0, slot.part.start, slot.part.len())?,
                    };
                    step_part(slot, &g, s)?;
                }
            }
            Gradients::Part(part) => {
                if part.len() != self.shard.range().len() {
                    return Err(Error::Invariant(format!(
                        "adamw: a gradient part of {} for a range of {}",
                        part.len(),
                        self.shard.range().len()
                    )));
                }
                let mut at = 0;
                for slot in self.slots.iter_mut().filter(|s| !s.part.is_empty()) {
                    let n = slot.part.len();
                    step_host_part(slot, &part[at..at + n], s)?;
                    at += n;
                }
            }
        }
        if self.shard.parts() > 1 {
            self.gather_parameters(world)?;
        }
        Ok(())
    }

    /// The scalars of the next step (its bias corrections count `self.step`).
    fn scalars(&self, lr: f64, grad_scale: f32) -> StepScalars {
        let t = self.step as i32;
        let c = self.cfg;
        StepScalars {
            lr: lr as f32,
            beta1: c.beta1 as f32,
            beta2: c.beta2 as f32,
            eps: c.eps as f32,
            weight_decay: c.weight_decay as f32,
            bias_correction1: (1.0 - c.beta1.powi(t)) as f32,
            bias_correction2_sqrt: (1.0 - c.beta2.powi(t)).sqrt() as f32,
            grad_scale,
        }
    }

    /// The moments as named tensors (`exp_avg.<param>`, `exp_avg_sq.<param>`), for checkpoints.
    /// A sharded state is consolidated over the world first ([`Self::consolidated_state`]).
    pub fn state_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        if self.shard.parts() > 1 {
            return Err(Error::Invariant(
                "adamw: a sharded state is saved through consolidated_state".into(),
            ));
        }
        let cpu = candle_core::Device::Cpu;
        let mut out = Vec::with_capacity(2 * self.slots.len());
        for s in &self.slots {
            let shape = s.var.shape();
            let (m, v) = match &s.moments {
                Moments::Host {
                    exp_avg,
                    exp_avg_sq,
                } => (
                    Tensor::from_slice(exp_avg, shape, &cpu)?,
                    Tensor::from_slice(exp_avg_sq, shape, &cpu)?,
                ),
                Moments::Device {
                    exp_avg,
                    exp_avg_sq,
                } => (exp_avg.to_device(&cpu)?, exp_avg_sq.to_device(&cpu)?),
            };
            out.push((format!("exp_avg.{}", s.name), m));
            out.push((format!("exp_avg_sq.{}", s.name), v));
        }
        Ok(out)
    }

    /// Restores moments saved by [`Self::state_tensors`] (whole tensors, whichever world saved
    /// them) and the step count; a sharded state keeps this rank's part of each.
    pub fn load_state(
        &mut self,
        state: &std::collections::HashMap<String, Tensor>,
        steps_taken: u64,
    ) -> Result<()> {
        if let Some(p) = &self.flat {
            let mut flat = std::collections::HashMap::new();
            for prefix in ["exp_avg", "exp_avg_sq"] {
                flat.insert(format!("{prefix}.zero3"), p.range_of(state, prefix)?);
            }
            let p = p.clone();
            self.flat = None;
            let loaded = self.load_state(&flat, steps_taken);
            self.flat = Some(p);
            return loaded;
        }
        for s in &mut self.slots {
            let read = |prefix: &str| -> Result<Tensor> {
                let key = format!("{prefix}.{}", s.name);
                let t = state
                    .get(&key)
                    .ok_or_else(|| Error::Model(format!("optimizer state has no tensor {key}")))?;
                if t.shape() != s.var.shape() {
                    return Err(Error::Model(format!(
                        "optimizer state {key} has shape {:?}, parameter {:?}",
                        t.shape(),
                        s.var.shape()
                    )));
                }
                let t = t.to_dtype(candle_core::DType::F32)?;
                Ok(match s.part.len() == s.var.elem_count() {
                    true => t,
                    false => t.flatten_all()?.narrow(0, s.part.start, s.part.len())?,
                })
            };
            let (m, v) = (read("exp_avg")?, read("exp_avg_sq")?);
            match &mut s.moments {
                Moments::Host {
                    exp_avg,
                    exp_avg_sq,
                } => {
                    *exp_avg = m.flatten_all()?.to_vec1()?;
                    *exp_avg_sq = v.flatten_all()?.to_vec1()?;
                }
                Moments::Device {
                    exp_avg,
                    exp_avg_sq,
                } => {
                    *exp_avg = m.to_device(s.var.device())?.contiguous()?;
                    *exp_avg_sq = v.to_device(s.var.device())?.contiguous()?;
                }
            }
        }
        self.step = steps_taken;
        Ok(())
    }
}

/// [`step_part`] with the part's gradient on the host (`[part]`, a reduce-scatter's): on the
/// CPU in place without a copy of it, elsewhere through a tensor.
fn step_host_part(slot: &mut Slot, g: &[f32], s: StepScalars) -> Result<()> {
    let cpu = device_kind(slot.var.device()) == DeviceKind::Cpu && slot.var.is_contiguous();
    if let (
        Moments::Host {
            exp_avg,
            exp_avg_sq,
        },
        true,
    ) = (&mut slot.moments, cpu)
    {
        let op = FusedStep {
            exp_avg: RefCell::new(exp_avg),
            exp_avg_sq: RefCell::new(exp_avg_sq),
            s,
            offset: slot.part.start,
        };
        slot.var.as_tensor().inplace_op1(&FusedStepOf(&op, g))?;
        return Ok(());
    }
    let g = Tensor::from_slice(g, g.len(), slot.var.device())?;
    step_part(slot, &g, s)
}

/// One AdamW step of `slot`'s part with its gradient `g`: the parameter's shape when the part
/// is the whole parameter, else flat (`[part]`). The same arithmetic either way, element for
/// element: in place on the CPU, one kernel on a GPU, else candle ops.
fn step_part(slot: &mut Slot, g: &Tensor, s: StepScalars) -> Result<()> {
    if slot.part.is_empty() {
        return Ok(());
    }
    let g = g.to_dtype(candle_core::DType::F32)?.contiguous()?;
    let whole = slot.whole();
    match &mut slot.moments {
        Moments::Host {
            exp_avg,
            exp_avg_sq,
        } => {
            let op = FusedStep {
                exp_avg: RefCell::new(exp_avg),
                exp_avg_sq: RefCell::new(exp_avg_sq),
                s,
                offset: slot.part.start,
            };
            if device_kind(slot.var.device()) == DeviceKind::Cpu && slot.var.is_contiguous() {
                slot.var.as_tensor().inplace_op2(&g, &op)?;
            } else {
                let mut p = slot.var.flatten_all()?.to_vec1::<f32>()?;
                op.apply(
                    &mut p[slot.part.clone()],
                    &g.flatten_all()?.to_vec1::<f32>()?,
                );
                let dev = slot.var.device().clone();
                slot.var
                    .set(&Tensor::from_vec(p, slot.var.shape(), &dev)?)?;
            }
        }
        Moments::Device {
            exp_avg,
            exp_avg_sq,
        } if whole => {
            #[cfg(feature = "cuda")]
            if slot.compute.on_gpu() && s.on_gpu(slot.var.as_tensor(), &g, exp_avg, exp_avg_sq)? {
                return Ok(());
            }
            let (p, m, v) = s.tensors(slot.var.as_tensor(), &g, exp_avg, exp_avg_sq)?;
            slot.var.set(&p)?;
            (*exp_avg, *exp_avg_sq) = (m, v);
        }
        Moments::Device {
            exp_avg,
            exp_avg_sq,
        } => {
            // A part: stepped as a copy, written back into the parameter's storage.
            let flat = slot.var.as_tensor().flatten_all()?; // [n], the parameter's storage
            let p = flat.narrow(0, slot.part.start, slot.part.len())?.copy()?; // [part]
            #[cfg(feature = "cuda")]
            if slot.compute.on_gpu() && s.on_gpu(&p, &g, exp_avg, exp_avg_sq)? {
                flat.slice_set(&p, 0, slot.part.start)?;
                return Ok(());
            }
            let (p, m, v) = s.tensors(&p, &g, exp_avg, exp_avg_sq)?;
            flat.slice_set(&p, 0, slot.part.start)?;
            (*exp_avg, *exp_avg_sq) = (m, v);
        }
    }
    Ok(())
}

/// `acc += g` in place for contiguous f32 tensors on the CPU, otherwise `acc + g` (a new tensor).
/// Gradient accumulation over forward chunks: the in-place add keeps one accumulator per
/// parameter instead of allocating a third model-sized buffer at every chunk.
pub fn accumulate(acc: Tensor, g: &Tensor) -> Result<Tensor> {
    struct AddAssign;
    impl candle_core::InplaceOp2 for AddAssign {
        fn name(&self) -> &'static str {
            "add-assign"
        }
        fn cpu_fwd(
            &self,
            s1: &mut CpuStorage,
            l1: &Layout,
            s2: &CpuStorage,
            l2: &Layout,
        ) -> candle_core::Result<()> {
            let (a, b) = f32_pair("add-assign", s1, l1, s2, l2)?;
            if a.len() != b.len() {
                candle_core::bail!("add-assign: {} vs {} elements", a.len(), b.len());
            }
            a.par_chunks_mut(1 << 16)
                .zip(b.par_chunks(1 << 16))
                .for_each(|(x, y)| x.iter_mut().zip(y).for_each(|(x, y)| *x += y));
            Ok(())
        }
    }
    let in_place = device_kind(acc.device()) == DeviceKind::Cpu
        && acc.dtype() == candle_core::DType::F32
        && g.dtype() == candle_core::DType::F32
        && acc.is_contiguous()
        && g.is_contiguous()
        && acc.shape() == g.shape()
        && !acc.track_op();
    if in_place {
        acc.inplace_op2(g, &AddAssign)?;
        Ok(acc)
    } else {
        Ok((acc + g)?)
    }
}

/// Global L2 norm of `grads` (as torch's `clip_grad_norm_` computes it) and the factor to scale
/// them by so the norm is at most `max_norm` (1 when already below, or when `max_norm` <= 0).
/// Under [`Compute::Gpu`] (the optimizer's, [`AdamW::compute`]) the sums of squares are grpo's
/// kernel.
pub fn clip_factor(grads: &[Tensor], max_norm: f64, compute: Compute) -> Result<(f64, f32)> {
    #[cfg(feature = "cuda")]
    if compute.on_gpu() {
        if let Some(sums) = grpo_models::kernels::cuda::sum_squares(grads)? {
            return Ok(clip_of(sums.iter().sum::<f64>().sqrt(), max_norm));
        }
    }
    #[cfg(not(feature = "cuda"))]
    let _ = compute;
    // Each gradient's sum of squares stays on its device; one read brings them all back (a GPU
    // waited for the host once per parameter before).
    let sums = grads
        .iter()
        .map(|g| g.to_dtype(candle_core::DType::F32)?.sqr()?.sum_all())
        .collect::<candle_core::Result<Vec<_>>>()?; // [] f32 each
    let sums: Vec<f32> = match sums.is_empty() {
        true => Vec::new(),
        false => Tensor::stack(&sums, 0)?.to_vec1()?,
    };
    let sq = sums.iter().fold(0f64, |acc, &s| acc + s as f64);
    Ok(clip_of(sq.sqrt(), max_norm))
}

/// The norm and torch's clipping factor for it.
fn clip_of(norm: f64, max_norm: f64) -> (f64, f32) {
    if max_norm <= 0.0 {
        return (norm, 1.0);
    }
    let coef = (max_norm / (norm + 1e-6)).min(1.0);
    (norm, coef as f32)
}

/// HF's learning-rate schedules: the multiplier of the base rate at optimizer step `step`
/// (0-based: the first step uses `step = 0`, so with warmup it runs at rate 0, as in HF).
pub fn lr_lambda(schedule: LrSchedule, step: u64, warmup: u64, total: u64) -> f64 {
    let (s, w, t) = (step as f64, warmup as f64, total as f64);
    let warm = || {
        if step < warmup {
            Some(s / w.max(1.0))
        } else {
            None
        }
    };
    match schedule {
        LrSchedule::Constant => 1.0,
        LrSchedule::ConstantWithWarmup => warm().unwrap_or(1.0),
        LrSchedule::Linear => warm().unwrap_or_else(|| ((t - s) / (t - w).max(1.0)).max(0.0)),
        LrSchedule::Cosine => warm().unwrap_or_else(|| {
            let progress = (s - w) / (t - w).max(1.0);
            (0.5 * (1.0 + (std::f64::consts::PI * progress).cos())).max(0.0)
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Plain twin of torch's AdamW step.
    #[allow(clippy::too_many_arguments)]
    fn adamw_slow(
        p: &mut [f32],
        g: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        t: i32,
        lr: f32,
        c: AdamWConfig,
    ) {
        for i in 0..p.len() {
            p[i] *= 1.0 - lr * c.weight_decay as f32;
            m[i] = c.beta1 as f32 * m[i] + (1.0 - c.beta1 as f32) * g[i];
            v[i] = c.beta2 as f32 * v[i] + (1.0 - c.beta2 as f32) * g[i] * g[i];
            let mh = m[i] / (1.0 - (c.beta1 as f32).powi(t));
            let vh = v[i] / (1.0 - (c.beta2 as f32).powi(t));
            p[i] -= lr * mh / (vh.sqrt() + c.eps as f32);
        }
    }

    #[test]
    fn fused_step_matches_plain_twin_and_state_round_trips() {
        let cfg = AdamWConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        };
        let init = vec![0.5f32, -1.0, 2.0, 0.0, 3.0];
        let var = Var::new(init.as_slice(), &Device::Cpu).unwrap();
        let mut opt = AdamW::new(vec![("w".into(), var.clone())], cfg).unwrap();
        let (mut p, mut m, mut v) = (init.clone(), vec![0f32; 5], vec![0f32; 5]);
        for t in 1..=3 {
            let g: Vec<f32> = (0..5).map(|i| (i as f32 - 2.0) * 0.3 * t as f32).collect();
            let gt = Tensor::new(g.as_slice(), &Device::Cpu).unwrap();
            opt.step(&[gt], 1e-2, 1.0).unwrap();
            adamw_slow(&mut p, &g, &mut m, &mut v, t, 1e-2, cfg);
            let got = var.to_vec1::<f32>().unwrap();
            for (a, b) in got.iter().zip(&p) {
                assert!((a - b).abs() < 1e-6, "step {t}: {a} vs {b}");
            }
        }
        let state: std::collections::HashMap<_, _> =
            opt.state_tensors().unwrap().into_iter().collect();
        let var2 = Var::new(var.to_vec1::<f32>().unwrap().as_slice(), &Device::Cpu).unwrap();
        let mut opt2 = AdamW::new(vec![("w".into(), var2.clone())], cfg).unwrap();
        opt2.load_state(&state, 3).unwrap();
        let g = Tensor::new(&[0.1f32, 0.2, -0.3, 0.4, 0.0], &Device::Cpu).unwrap();
        opt.step(std::slice::from_ref(&g), 1e-2, 0.5).unwrap();
        opt2.step(&[g], 1e-2, 0.5).unwrap();
        assert_eq!(
            var.to_vec1::<f32>().unwrap(),
            var2.to_vec1::<f32>().unwrap()
        );
    }

    #[test]
    fn accumulate_adds_in_place_and_falls_back_for_views() {
        let dev = candle_core::Device::Cpu;
        let a = Tensor::new(&[[1f32, 2.], [3., 4.]], &dev).unwrap();
        let b = Tensor::new(&[[10f32, 20.], [30., 40.]], &dev).unwrap();
        let sum = accumulate(a.copy().unwrap(), &b).unwrap();
        assert_eq!(
            sum.to_vec2::<f32>().unwrap(),
            vec![vec![11., 22.], vec![33., 44.]]
        );
        // A transposed view is not added in place (that would add in the wrong order).
        let sum = accumulate(a.t().unwrap(), &b).unwrap();
        assert_eq!(
            sum.to_vec2::<f32>().unwrap(),
            vec![vec![11., 23.], vec![32., 44.]]
        );
    }

    #[test]
    fn clipping_and_schedules() {
        let g = [Tensor::new(&[3f32, 4.0], &Device::Cpu).unwrap()];
        let (norm, f) = clip_factor(&g, 1.0, Compute::Portable).unwrap();
        assert!((norm - 5.0).abs() < 1e-9);
        assert!((f - 0.2).abs() < 1e-6);
        assert_eq!(clip_factor(&g, 10.0, Compute::Portable).unwrap().1, 1.0);
        assert_eq!(lr_lambda(LrSchedule::Linear, 0, 2, 10), 0.0);
        assert_eq!(lr_lambda(LrSchedule::Linear, 1, 2, 10), 0.5);
        assert_eq!(lr_lambda(LrSchedule::Linear, 2, 2, 10), 1.0);
        assert_eq!(lr_lambda(LrSchedule::Linear, 6, 2, 10), 0.5);
        assert!((lr_lambda(LrSchedule::Cosine, 6, 2, 10) - 0.5).abs() < 1e-12);
        assert_eq!(lr_lambda(LrSchedule::Constant, 0, 2, 10), 1.0);
        assert_eq!(lr_lambda(LrSchedule::ConstantWithWarmup, 1, 4, 10), 0.25);
    }
}
