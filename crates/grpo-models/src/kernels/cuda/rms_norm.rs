//! RMSNorm on the GPU, forward and backward, and a decoding step's residual add with its norm.

use std::sync::Arc;

use candle_core::{DType, Result, Tensor};

use super::launch::{cuda, launch, norm_config, output, suffix, Scalar};
use super::takes;
use crate::kernels::portable::recompute::{attach, Backward};

/// Whether the RMSNorm kernels take `x` and `w` (under [`crate::kernels::Compute::Gpu`]).
pub fn rms_norm_takes(x: &Tensor, w: &Tensor) -> bool {
    takes(x) && w.dtype() == x.dtype() && w.rank() == 1
}

/// RMSNorm of `x` [.., H] by `w` [H] as HF computes it (f32 statistics, the normalized row
/// rounded to `x`'s dtype, then times `w`), one kernel each way; the backward keeps only `x`
/// and `w` (where [`rms_norm_takes`] holds; the caller checks).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let y = rms_norm_raw(x, w, eps)?;
    attach(&y, &[x, w], Arc::new(RmsNormBackward { eps }))
}

/// [`rms_norm`]'s forward kernel alone: no graph.
pub fn rms_norm_raw(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let h = x.dim(candle_core::D::Minus1)?;
    let rows = x.elem_count() / h.max(1);
    let (xd, wd) = (x.detach().contiguous()?, w.detach().contiguous()?);
    let y = output(x.shape(), x.dtype(), x.device())?;
    let kernel = format!("rms_norm_fwd_{}", suffix(x.dtype()));
    let scalars = [Scalar::I32(h as i32), Scalar::F32(eps as f32)];
    launch(
        &cuda(x)?,
        &kernel,
        norm_config(rows),
        &[&xd, &wd, &y],
        &scalars,
    )?;
    Ok(y)
}

/// [`rms_norm`]'s backward: the gradients of `x` [.., H] (its dtype) and of `w` [H] (its
/// dtype) from the output's gradient `grad`, one kernel and one GEMM (no graph).
pub fn rms_norm_backward(
    x: &Tensor,
    w: &Tensor,
    grad: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    let h = w.dim(0)?;
    let rows = x.elem_count() / h.max(1);
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    let g = grad.to_dtype(x.dtype())?.contiguous()?;
    let dx = output(x.shape(), x.dtype(), x.device())?;
    let gn = output((rows, h), DType::F32, x.device())?; // [N, H] f32
    let kernel = format!("rms_norm_bwd_{}", suffix(x.dtype()));
    let scalars = [Scalar::I32(h as i32), Scalar::F32(eps as f32)];
    launch(
        &cuda(&x)?,
        &kernel,
        norm_config(rows),
        &[&x, &w, &g, &dx, &gn],
        &scalars,
    )?;
    // dw: the column sums of gn, as one GEMM.
    let ones = Tensor::ones((1, rows), DType::F32, x.device())?;
    let dw = ones.matmul(&gn)?.reshape(h)?.to_dtype(w.dtype())?; // [H]
    Ok((dx, dw))
}

struct RmsNormBackward {
    eps: f64,
}

impl Backward for RmsNormBackward {
    fn name(&self) -> &'static str {
        "gpu-rms-norm"
    }

    fn backward(
        &self,
        inputs: &[Tensor],
        _wanted: &[bool],
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        let [x, w] = inputs else {
            candle_core::bail!("gpu rms-norm: two inputs expected");
        };
        let (dx, dw) = rms_norm_backward(x, w, grad, self.eps)?;
        Ok(vec![Some(dx), Some(dw)])
    }
}

/// A decoding step's residual add and the RMSNorm after it, one kernel: `x`, `a` [.., H],
/// weight `w` [H] -> (x + a, RMSNorm(x + a) w as [`rms_norm`] computes it). Not recorded for
/// a backward; `None` where it does not apply.
pub fn add_rms_norm(
    x: &Tensor,
    a: &Tensor,
    w: &Tensor,
    eps: f64,
) -> Result<Option<(Tensor, Tensor)>> {
    let h = x.dim(candle_core::D::Minus1)?;
    if !(rms_norm_takes(x, w) && a.dtype() == x.dtype() && a.dims() == x.dims()) || w.dim(0)? != h {
        return Ok(None);
    }
    let rows = x.elem_count() / h.max(1);
    let (xd, ad, wd) = (x.contiguous()?, a.contiguous()?, w.contiguous()?);
    let (sum, y) = (
        output(x.shape(), x.dtype(), x.device())?,
        output(x.shape(), x.dtype(), x.device())?,
    );
    let scalars = [Scalar::I32(h as i32), Scalar::F32(eps as f32)];
    launch(
        &cuda(x)?,
        &format!("add_rms_norm_{}", suffix(x.dtype())),
        norm_config(rows),
        &[&xd, &ad, &wd, &sum, &y],
        &scalars,
    )?;
    Ok(Some((sum, y)))
}
