//! The LM head's log-softmax, gather and entropy on the GPU, and its backward.

use candle_core::{DType, Result, Tensor};

use super::launch::{cuda, launch, norm_config, output, suffix, Scalar};
use super::takes;

/// Whether the LM head's log-softmax kernels take `logits` [c, V] (on a GPU, f32 or bf16).
pub fn head_takes(logits: &Tensor) -> bool {
    takes(logits) && logits.rank() == 2
}

/// Row of `targets` [c] u32 in `logits` [c, V] -> ([c, 2] f32: log-prob and entropy of
/// `softmax(logits * inv_t)`, [c, 1] f32 log-sum-exps), one kernel (no graph).
pub fn head_logprobs(logits: &Tensor, targets: &Tensor, inv_t: f32) -> Result<(Tensor, Tensor)> {
    let (c, v) = logits.dims2()?;
    let (z, y) = (
        logits.contiguous()?,
        targets.to_dtype(DType::U32)?.contiguous()?,
    );
    let out = output((c, 2), DType::F32, z.device())?;
    let lse = output((c, 1), DType::F32, z.device())?;
    let kernel = format!("head_fwd_{}", suffix(z.dtype()));
    let scalars = [Scalar::I32(v as i32), Scalar::F32(inv_t)];
    launch(
        &cuda(&z)?,
        &kernel,
        norm_config(c),
        &[&z, &y, &out, &lse],
        &scalars,
    )?;
    Ok((out, lse))
}

/// The gradient of `logits` [c, V] (in their dtype) from the rows' gradients `g` [c, 2] of
/// [`head_logprobs`]'s `out` (the entropy's only `with_entropy`), given its `out` and `lse`.
pub fn head_logprobs_backward(
    logits: &Tensor,
    targets: &Tensor,
    lse: &Tensor,
    g: &Tensor,
    out: &Tensor,
    inv_t: f32,
    with_entropy: bool,
) -> Result<Tensor> {
    let (c, v) = logits.dims2()?;
    let (z, y) = (
        logits.contiguous()?,
        targets.to_dtype(DType::U32)?.contiguous()?,
    );
    let f = |t: &Tensor| t.to_dtype(DType::F32)?.contiguous();
    let (lse, g, out) = (f(lse)?, f(g)?, f(out)?);
    let dz = output((c, v), z.dtype(), z.device())?;
    let kernel = format!("head_bwd_{}", suffix(z.dtype()));
    let scalars = [
        Scalar::I32(v as i32),
        Scalar::F32(inv_t),
        Scalar::I32(with_entropy as i32),
    ];
    launch(
        &cuda(&z)?,
        &kernel,
        norm_config(c),
        &[&z, &y, &lse, &g, &out, &dz],
        &scalars,
    )?;
    Ok(dz)
}
