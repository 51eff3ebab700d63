//! SwiGLU (`silu(gate) * up`) on the GPU, forward and backward.

use std::sync::Arc;

use candle_core::{Result, Tensor};

use super::launch::{cuda, elementwise, launch, output, suffix, Scalar};
use crate::kernels::portable::recompute::{attach, Backward};

/// `gu` [.., 2I] (gate, then up) -> silu(gate) * up [.., I] in one kernel, recorded in the
/// graph with a one-kernel backward (where [`takes`] holds; the caller checks).
pub fn swiglu(gu: &Tensor) -> Result<Tensor> {
    let dims = gu.dims().to_vec();
    let Some((&two_i, lead)) = dims.split_last() else {
        candle_core::bail!("swiglu: a scalar input");
    };
    if two_i % 2 != 0 {
        candle_core::bail!("swiglu: the last dim ({two_i}) must be even");
    }
    let mut out_dims = lead.to_vec();
    out_dims.push(two_i / 2);
    let x = gu.detach().contiguous()?;
    let y = output(out_dims, x.dtype(), x.device())?;
    let n = y.elem_count();
    let kernel = format!("swiglu_fwd_{}", suffix(x.dtype()));
    let scalars = [Scalar::I64(n as i64), Scalar::I32((two_i / 2) as i32)];
    launch(&cuda(&x)?, &kernel, elementwise(n), &[&x, &y], &scalars)?;
    attach(&y, &[gu], Arc::new(SwigluBackward))
}

struct SwigluBackward;

impl Backward for SwigluBackward {
    fn name(&self) -> &'static str {
        "gpu-swiglu"
    }

    fn backward(
        &self,
        inputs: &[Tensor],
        _wanted: &[bool],
        out: &Tensor,
        grad: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        let [gu] = inputs else {
            candle_core::bail!("gpu swiglu: one input expected");
        };
        let _ = out;
        Ok(vec![Some(swiglu_backward(gu, grad)?)])
    }
}

/// SwiGLU's backward: `gu` [.., 2I] and the output's gradient `grad` [.., I] -> `dgu`
/// [.., 2I] in `gu`'s dtype, one kernel.
pub fn swiglu_backward(gu: &Tensor, grad: &Tensor) -> Result<Tensor> {
    let gu = gu.contiguous()?;
    let g = grad.to_dtype(gu.dtype())?.contiguous()?;
    let dgu = output(gu.shape(), gu.dtype(), gu.device())?;
    let (n, inter) = (g.elem_count(), g.dim(candle_core::D::Minus1)?);
    if 2 * n != gu.elem_count() {
        candle_core::bail!(
            "swiglu backward: {n} gradients for {} inputs",
            gu.elem_count()
        );
    }
    let kernel = format!("swiglu_bwd_{}", suffix(gu.dtype()));
    let scalars = [Scalar::I64(n as i64), Scalar::I32(inter as i32)];
    launch(
        &cuda(&gu)?,
        &kernel,
        elementwise(n),
        &[&gu, &g, &dgu],
        &scalars,
    )?;
    Ok(dgu)
}
