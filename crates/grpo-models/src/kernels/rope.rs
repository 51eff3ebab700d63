//! RoPE, the op: rotate-half RoPE of a projection's heads by the kernel a model's [`Compute`]
//! calls for (the fused CPU kernel, grpo's GPU kernel, or candle ops), and a GPU decoding step's
//! RoPE with its append to the KV cache.

use candle_core::{Result, Tensor};

use crate::kernels::portable::apply_rope;
use crate::kernels::{Compute, Mode};

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
        return crate::kernels::cpu::fused::rope_heads(x, cos, sin, heads);
    }
    #[cfg(feature = "cuda")]
    if compute.on_gpu() {
        if let Some(y) = crate::kernels::cuda::rope_heads(x, cos, sin, heads)? {
            return Ok(y);
        }
    }
    let (b, t, hd) = x.dims3()?;
    let x = x.reshape((b, t, heads, hd / heads))?.transpose(1, 2)?; // [B, H, T, D]
    apply_rope(&x, cos, sin, mode)
}

/// A GPU's decoding step under [`Compute::Gpu`]: the q/k/v projection of one token per row
/// (`joined`, [B, 1, (H + 2 Hkv) D], computed only here, where the kernel runs) -> q rotated
/// [B, H, 1, D], with k rotated and v written into the cache tensors `kc`/`vc` at slot `len`,
/// one kernel; `None` where it does not apply (the caller splits, rotates and appends with
/// the tensor path).
#[allow(clippy::too_many_arguments)]
pub fn rope_append(
    joined: impl FnOnce() -> Result<Tensor>,
    cos: &Tensor,
    sin: &Tensor,
    heads: usize,
    kv_heads: usize,
    kc: &Tensor,
    vc: &Tensor,
    len: usize,
    compute: Compute,
) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    if compute.on_gpu() {
        let joined = joined()?;
        return crate::kernels::cuda::rope_append(&joined, cos, sin, heads, kv_heads, kc, vc, len);
    }
    let _ = (joined, cos, sin, heads, kv_heads, kc, vc, len, compute);
    Ok(None)
}
