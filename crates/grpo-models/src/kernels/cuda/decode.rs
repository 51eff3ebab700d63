//! A decoding step's attention on the GPU: one query per row over the KV cache's views.

use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
use candle_core::{DType, Result, Tensor};

use super::launch::{cuda, launch, name, output, smem_limit, Scalar};
use super::{takes, HEAD_DIMS};
use crate::kernels::DecodeKernel;

/// Single-query attention for a decoding step: `q` [B, H, 1, D], `k`/`v` [B, Hkv, Tk, D]
/// views of the KV cache (rows of D contiguous elements, the same strides for both), `mask`
/// additive [B, 1, 1, Tk] f32 -> [B, 1, H*D], one kernel reading the cache in 16-byte
/// loads (`GRPO_GPU_DECODE` chooses which, [`DecodeKernel`]). With `shared` (each row's
/// leader [B] u32 on the device, and an end slot), slots before the end are read from the
/// row's leader: the rows of one prompt hold the same keys and values there, and read one
/// copy between them. `None` where it does not apply (rows not 16-byte aligned, scores
/// beyond the shared memory, or `GRPO_GPU_DECODE=ops`).
pub fn decode_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Tensor,
    scale: f64,
    shared: Option<(&Tensor, usize)>,
) -> Result<Option<Tensor>> {
    decode_attention_with(q, k, v, mask, scale, decode_kernel(), shared)
}

/// [`decode_attention`] with the given kernel (for timing and checking both).
pub fn decode_attention_with(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Tensor,
    scale: f64,
    kernel: DecodeKernel,
    shared: Option<(&Tensor, usize)>,
) -> Result<Option<Tensor>> {
    let (b, h, s, d) = q.dims4()?;
    let (hkv, tk) = (k.dim(1)?, k.dim(2)?);
    let dt = q.dtype();
    let (ks, vs) = (k.stride(), v.stride());
    let vec = 16 / dt.size_in_bytes(); // elements per 16-byte load
    let aligned = |t: &Tensor| {
        t.layout().start_offset().is_multiple_of(vec)
            && t.stride()[..2].iter().all(|x| x.is_multiple_of(vec))
    };
    let g = h / hkv.max(1);
    let rows = 256 / (d / vec).max(1); // slot groups of the value pass
    let smem = match kernel {
        DecodeKernel::Warp => 0,
        _ => ((g * d + g * tk + 256 + rows * d + g) * 4) as u32,
    };
    let applies = takes(q)
        && kernel != DecodeKernel::Ops
        && s == 1
        && k.dtype() == dt
        && v.dtype() == dt
        && HEAD_DIMS.contains(&d)
        && hkv > 0
        && h % hkv == 0
        && k.dims() == v.dims()
        && ks == vs
        && ks[3] == 1
        && (tk == 1 || ks[2] == d)
        && aligned(k)
        && aligned(v)
        && mask.elem_count() == b * tk
        && shared.is_none_or(|(l, end)| {
            l.dtype() == DType::U32
                && l.elem_count() == b
                && end <= tk
                && l.device().same_device(q.device())
        })
        && smem <= (48 << 10).max(smem_limit(&cuda(q)?));
    if !applies {
        return Ok(None);
    }
    let q = q.contiguous()?;
    let mask = mask
        .broadcast_as((b, 1, 1, tk))?
        .to_dtype(DType::F32)?
        .contiguous()?;
    let o = output((b, 1, h * d), dt, q.device())?;
    // Without a shared prompt, a leader tensor is still an argument: no slot is below 0.
    let (leader, end) = match shared {
        Some((l, e)) => (l.contiguous()?, e),
        None => (Tensor::zeros(1, DType::U32, q.device())?, 0),
    };
    let i = |x: usize| Scalar::I32(x as i32);
    let (ks0, ks1, sc) = (
        Scalar::I64(ks[0] as i64),
        Scalar::I64(ks[1] as i64),
        Scalar::F32(scale as f32),
    );
    let (kernel_name, cfg, scalars) = match kernel {
        DecodeKernel::Warp => (
            name("decode_warp", dt, d),
            LaunchConfig {
                grid_dim: ((b * h).div_ceil(4) as u32, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            },
            vec![i(h), i(hkv), i(b), i(tk), ks0, ks1, sc, i(end)],
        ),
        _ => (
            name("decode", dt, d),
            LaunchConfig {
                grid_dim: ((b * hkv) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: smem,
            },
            vec![i(h), i(hkv), i(tk), ks0, ks1, sc, i(end)],
        ),
    };
    launch(
        &cuda(&q)?,
        &kernel_name,
        cfg,
        &[&q, k, v, &mask, &leader, &o],
        &scalars,
    )?;
    Ok(Some(o))
}

/// What runs a decoding step's attention (`GRPO_GPU_DECODE`, read once with the other
/// switches): `warp` (unset) the warp kernel, `kernel` the block kernel, `ops` candle's batched
/// matmuls.
fn decode_kernel() -> DecodeKernel {
    crate::kernels::gpu_switches().decode
}
