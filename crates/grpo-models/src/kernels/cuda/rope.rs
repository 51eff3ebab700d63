//! Rotate-half RoPE on the GPU, forward and backward, and a decoding step's RoPE with its
//! append to the KV cache.

use std::sync::Arc;

use candle_core::{DType, Result, Tensor};

use super::launch::{cuda, elementwise, launch, output, suffix, Scalar};
use super::takes;
use crate::kernels::portable::recompute::{attach, Backward};

/// A decoding step's q, k and v in one kernel: `joined` [B, 1, (H + 2 Hkv) D] (the joined
/// projection's output, unit last stride), `cos`/`sin` [B, 1, D/2] -> q [B, H, 1, D]
/// rotated; k rotated and v written into slot `slot` of the caches `kc`/`vc`
/// [B, Hkv, slots, D] (contiguous) in place. Replaces two RoPE launches, a copy of v and
/// the caches' two writes. `None` (nothing written) where it does not apply.
#[allow(clippy::too_many_arguments)]
pub fn rope_append(
    joined: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    heads: usize,
    kv_heads: usize,
    kc: &Tensor,
    vc: &Tensor,
    slot: usize,
) -> Result<Option<Tensor>> {
    let (Ok((b, t, w)), Ok((kb, hkv, slots, d))) = (joined.dims3(), kc.dims4()) else {
        return Ok(None);
    };
    let dt = joined.dtype();
    let same = |x: &Tensor| x.dtype() == dt && x.device().same_device(joined.device());
    let applies = takes(joined)
        && t == 1
        && d.is_multiple_of(2)
        && hkv == kv_heads
        && w == (heads + 2 * hkv) * d
        && kb == b
        && slot < slots
        && kc.dims() == vc.dims()
        && kc.is_contiguous()
        && vc.is_contiguous()
        && [kc, vc, cos, sin].iter().all(|x| same(x))
        && cos.dims() == [b, 1, d / 2]
        && sin.dims() == [b, 1, d / 2]
        && joined.stride()[2] == 1;
    if !applies {
        return Ok(None);
    }
    let (cos, sin) = (cos.contiguous()?, sin.contiguous()?);
    let q = output((b, heads, 1, d), dt, joined.device())?;
    let n = b * (heads + 2 * hkv) * d / 2;
    let i = |x: usize| Scalar::I32(x as i32);
    let scalars = [
        Scalar::I64(n as i64),
        i(heads),
        i(hkv),
        i(d),
        Scalar::I64(joined.stride()[0] as i64),
        Scalar::I64((slots * d) as i64),
        i(slot),
    ];
    launch(
        &cuda(joined)?,
        &format!("rope_append_{}", suffix(dt)),
        elementwise(n),
        &[&joined.detach(), &cos, &sin, &q, kc, vc],
        &scalars,
    )?;
    Ok(Some(q))
}

/// Rotate-half RoPE of `x` [B, T, H*D] (a view of the joined projection: rows a stride
/// apart, last dim contiguous) by tables `cos`/`sin` [B, T, D/2] -> [B, H, T, D] contiguous,
/// one kernel each way (recorded in the graph when `x` is), or `None` where the kernel does
/// not apply (the caller runs candle ops).
pub fn rope_heads(x: &Tensor, cos: &Tensor, sin: &Tensor, heads: usize) -> Result<Option<Tensor>> {
    match rope_heads_raw(x, cos, sin, heads)? {
        Some((y, cos, sin)) => Ok(Some(attach(&y, &[x], Arc::new(RopeBackward { cos, sin }))?)),
        None => Ok(None),
    }
}

/// [`rope_heads`]'s forward kernel alone (no graph): the result and the contiguous tables
/// its backward ([`rope_backward`]) takes.
pub fn rope_heads_raw(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    heads: usize,
) -> Result<Option<(Tensor, Tensor, Tensor)>> {
    let Ok((b, t, hd)) = x.dims3() else {
        return Ok(None);
    };
    let d = hd / heads.max(1);
    let st = x.stride();
    let applies = takes(x)
        && heads > 0
        && d.is_multiple_of(2)
        && d * heads == hd
        && cos.dtype() == x.dtype()
        && sin.dtype() == x.dtype()
        && cos.dims() == [b, t, d / 2]
        && sin.dims() == [b, t, d / 2]
        && st[2] == 1
        && (b == 1 || t == 1 || st[0] == t * st[1]);
    if !applies {
        return Ok(None);
    }
    let (cos, sin) = (cos.contiguous()?, sin.contiguous()?);
    let y = output((b, heads, t, d), x.dtype(), x.device())?;
    let n = y.elem_count() / 2;
    let xs = if t == 1 { st[0] } else { st[1] }; // elements from one (b, t) row to the next
    let [a, b_, c, e] = rope_scalars(n, t, heads, d);
    let scalars = [a, b_, c, e, Scalar::I64(xs as i64)];
    let kernel = format!("rope_fwd_{}", suffix(x.dtype()));
    // The view is passed from its first element with its row stride (`launch` reads the
    // storage from the layout's start offset).
    launch(
        &cuda(x)?,
        &kernel,
        elementwise(n),
        &[&x.detach(), &cos, &sin, &y],
        &scalars,
    )?;
    Ok(Some((y, cos, sin)))
}

/// RoPE's backward: the gradient `grad` [B, H, T, D] of [`rope_heads_raw`]'s output ->
/// the input's [B, T, H*D] (contiguous), one kernel; `cos`/`sin` as that returned them.
pub fn rope_backward(grad: &Tensor, cos: &Tensor, sin: &Tensor, dt: DType) -> Result<Tensor> {
    let (b, h, t, d) = grad.dims4()?;
    let g = grad.to_dtype(dt)?.contiguous()?;
    let dx = output((b, t, h * d), dt, g.device())?;
    let n = g.elem_count() / 2;
    let scalars = rope_scalars(n, t, h, d);
    let kernel = format!("rope_bwd_{}", suffix(dt));
    launch(
        &cuda(&g)?,
        &kernel,
        elementwise(n),
        &[&g, cos, sin, &dx],
        &scalars,
    )?;
    Ok(dx)
}

/// The RoPE kernels' shared scalars: pairs, positions, heads, head size.
fn rope_scalars(n: usize, t: usize, h: usize, d: usize) -> [Scalar; 4] {
    let i = |x: usize| Scalar::I32(x as i32);
    [Scalar::I64(n as i64), i(t), i(h), i(d)]
}

struct RopeBackward {
    cos: Tensor,
    sin: Tensor,
}

impl Backward for RopeBackward {
    fn name(&self) -> &'static str {
        "gpu-rope"
    }

    fn backward(
        &self,
        inputs: &[Tensor],
        _wanted: &[bool],
        out: &Tensor,
        grad: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        let [x] = inputs else {
            candle_core::bail!("gpu rope: one input expected");
        };
        let _ = out;
        Ok(vec![Some(rope_backward(
            grad,
            &self.cos,
            &self.sin,
            x.dtype(),
        )?)])
    }
}
