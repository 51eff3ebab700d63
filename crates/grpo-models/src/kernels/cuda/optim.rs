//! The optimizer's kernels: AdamW in place, an f32 accumulate, the gradients' sums of squares.

use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
use candle_core::{DType, Result, Tensor};

use super::launch::{cuda, elementwise, launch, output, Scalar};
use super::takes;

/// AdamW in place, one kernel per parameter with its scalars as arguments (candle ops took
/// ~20 launches and 7 scalar uploads a parameter): `p` (the parameter's storage), `m`, `v`
/// updated; `g` read; all f32, contiguous, on the GPU. Returns false (nothing done) where it
/// does not apply, so the caller runs its candle ops.
pub fn adamw_step(
    p: &Tensor,
    g: &Tensor,
    m: &Tensor,
    v: &Tensor,
    s: &super::AdamWScalars,
) -> Result<bool> {
    let n = p.elem_count();
    let fits = |t: &Tensor| {
        t.device().is_cuda() && t.dtype() == DType::F32 && t.is_contiguous() && t.elem_count() == n
    };
    if !(fits(p) && fits(g) && fits(m) && fits(v)) {
        return Ok(false);
    }
    let f = Scalar::F32;
    let scalars = [
        Scalar::I64(n as i64),
        f(s.grad_scale),
        f(s.decay),
        f(s.beta1),
        f(s.beta2),
        f(s.eps),
        f(s.bias_correction2_sqrt),
        f(s.step_size),
    ];
    // The kernel writes p, m and v in place: the same storage the parameter's `Var::set`
    // would have written into.
    launch(
        &cuda(p)?,
        "adamw_f32",
        elementwise(n),
        &[p, g, m, v],
        &scalars,
    )?;
    Ok(true)
}

/// `acc += x` in place: `acc` f32 and `x` bf16, contiguous, of one element count (one
/// kernel). Returns whether it ran (`false`: the tensors do not fit).
pub fn add_into_f32(acc: &Tensor, x: &Tensor) -> Result<bool> {
    let n = acc.elem_count();
    let ok = acc.device().is_cuda()
        && acc.dtype() == DType::F32
        && x.dtype() == DType::BF16
        && acc.is_contiguous()
        && x.is_contiguous()
        && x.elem_count() == n;
    if !ok {
        return Ok(false);
    }
    // The kernel writes `acc` in place (the caller owns it exclusively).
    launch(
        &cuda(acc)?,
        "acc_add_bf16",
        elementwise(n),
        &[acc, x],
        &[Scalar::I64(n as i64)],
    )?;
    Ok(true)
}

/// Blocks of the sums of squares' fixed grid ([`sum_squares`]).
const SUMSQ_BLOCKS: usize = 256;

/// Each tensor's sum of squares (f64, from f32 partial sums added in a fixed order), the
/// gradients of a step on the GPU: one kernel per tensor over a fixed grid and one read of
/// all the partials (candle's `sum_all` runs on one block). `None` where grpo's kernels do not take them.
pub fn sum_squares(ts: &[Tensor]) -> Result<Option<Vec<f64>>> {
    let Some(first) = ts.first() else {
        return Ok(Some(Vec::new()));
    };
    if !(takes(first) && ts.iter().all(|t| t.device().same_device(first.device()))) {
        return Ok(None);
    }
    let dev = first.device();
    let partial = output((ts.len(), SUMSQ_BLOCKS), DType::F32, dev)?; // [k, blocks] f32
    for (i, t) in ts.iter().enumerate() {
        let x = t.to_dtype(DType::F32)?.contiguous()?;
        let n = x.elem_count();
        let out = partial.narrow(0, i, 1)?;
        let cfg = LaunchConfig {
            grid_dim: (SUMSQ_BLOCKS as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 256 * 4,
        };
        launch(
            &cuda(&x)?,
            "sumsq_f32",
            cfg,
            &[&x, &out],
            &[Scalar::I64(n as i64)],
        )?;
    }
    let rows = partial.to_vec2::<f32>()?;
    Ok(Some(
        rows.iter()
            .map(|r| r.iter().fold(0f64, |a, &p| a + p as f64))
            .collect(),
    ))
}
