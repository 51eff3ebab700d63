//! The gated MLP's activation (SwiGLU, `silu(gate) * up`), the op: which kernel runs a model's
//! MLP block under its [`Compute`].

use candle_core::{Result, Tensor};

use crate::kernels::grad_sink::SinkProj;
use crate::kernels::Compute;

/// How a SwiGLU MLP block runs ([`plan`]).
pub enum SwiGlu<'a> {
    /// The whole block as one recorded op through the GPU gradient sinks of its gate/up and
    /// down projections ([`crate::kernels::grad_sink::sink_mlp`]): training on a GPU.
    Block(&'a SinkProj, &'a SinkProj),
    /// The joined gate/up projection, then [`activate`] (one kernel), then the down projection.
    Joined(Compute),
    /// The gate and up projections apart, then candle ops (the caller's).
    Parts,
}

/// The plan for an MLP block whose input is `x`, under `compute`, with the GPU gradient sinks
/// of its projections (`gate_up`, `down`) where they have them: the fused CPU kernel, else on a
/// GPU the one-op block in training or grpo's kernel where it takes `x`, else candle ops.
pub fn plan<'a>(
    x: &Tensor,
    compute: Compute,
    gate_up: Option<&'a SinkProj>,
    down: Option<&'a SinkProj>,
) -> SwiGlu<'a> {
    if compute.fuses(x) {
        return SwiGlu::Joined(compute);
    }
    #[cfg(feature = "cuda")]
    if compute.on_gpu() {
        if let (Some(gu), Some(down), true) = (gate_up, down, x.track_op()) {
            return SwiGlu::Block(gu, down);
        }
        if crate::kernels::cuda::takes(x) {
            return SwiGlu::Joined(compute);
        }
    }
    let _ = (gate_up, down);
    SwiGlu::Parts
}

/// `silu(gate) * up` of the joined projection `gu` [.., 2I] (gate, then up) -> [.., I], by the
/// kernel [`plan`] chose ([`SwiGlu::Joined`]'s compute).
pub fn activate(gu: &Tensor, compute: Compute) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if compute.on_gpu() {
        return crate::kernels::cuda::swiglu(gu);
    }
    let _ = compute;
    crate::kernels::cpu::fused::silu_mul(gu)
}

/// [`SwiGlu::Block`]: the whole block `down(silu(x Wg) * (x Wu))` as one recorded op.
pub fn block(x: &Tensor, gate_up: &SinkProj, down: &SinkProj) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    return crate::kernels::grad_sink::sink_mlp(x, gate_up, down);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (x, gate_up, down);
        candle_core::bail!("the one-op MLP block runs on a GPU only")
    }
}
