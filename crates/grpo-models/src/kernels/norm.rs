//! RMSNorm, the op: the dispatch from a model's [`Compute`] to the fused CPU kernel, grpo's GPU
//! kernel, or candle ops (with a recorded backward in training, candle's fused kernel in
//! inference).

use candle_core::{Result, Tensor};

use crate::kernels::portable::rms_norm_recomputed;
use crate::kernels::{Compute, Mode};

/// `w * x / sqrt(mean(x^2) + eps)` over the last dim of `x`.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64, mode: Mode, compute: Compute) -> Result<Tensor> {
    match mode {
        Mode::Infer => candle_nn::ops::rms_norm(&x.contiguous()?, w, eps as f32),
        Mode::Train if compute.fuses(x) => crate::kernels::cpu::fused::rms_norm(x, w, eps),
        #[cfg(feature = "cuda")]
        Mode::Train if compute.on_gpu() && crate::kernels::cuda::rms_norm_takes(x, w) => {
            crate::kernels::cuda::rms_norm(x, w, eps)
        }
        Mode::Train => rms_norm_recomputed(x, w, eps),
    }
}

/// The residual sum `x + a` and [`rms_norm`] of it: one kernel on a GPU in inference (a
/// decoding step's add and post-attention norm), else the add then the norm.
pub fn add_rms_norm(
    x: &Tensor,
    a: &Tensor,
    w: &Tensor,
    eps: f64,
    mode: Mode,
    compute: Compute,
) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if mode == Mode::Infer && compute.on_gpu() {
        if let Some(pair) = crate::kernels::cuda::add_rms_norm(x, a, w, eps)? {
            return Ok(pair);
        }
    }
    let sum = (x + a)?;
    let y = rms_norm(&sum, w, eps, mode, compute)?;
    Ok((sum, y))
}
