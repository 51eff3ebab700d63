//! A QLoRA base's NF4 weight dequantized on the GPU in one kernel (`nf4_dequant_*` in
//! kernels.cu): the quantized bytes and block scales in, the weight in the compute dtype out.
//! candle's ops take seven passes over the weight for the same values (a byte-to-index cast, two
//! table gathers, a stack, the scales' product, a cast); this one reads half a byte and writes
//! one value per weight.

use candle_core::{DType, Result, Tensor};

use super::launch::{cuda, elementwise, launch, output, suffix, Scalar};

/// `packed` [ceil(n/2)] u8 (two NF4 codes a byte, the first in the high nibble), `absmax`
/// [ceil(n/64)] f32 and `code` [16] f32 (the NF4 values) -> the first `n` values [n] in `dtype`
/// (f32 or bf16), each `code * absmax` in f32 rounded once: the values of
/// `Nf4::dequantize_into`, then cast.
pub fn nf4_dequantize(
    packed: &Tensor,
    absmax: &Tensor,
    code: &Tensor,
    n: usize,
    dtype: DType,
) -> Result<Tensor> {
    if packed.dtype() != DType::U8 || absmax.dtype() != DType::F32 || code.dtype() != DType::F32 {
        candle_core::bail!("nf4 dequantize: u8 codes, f32 scales and an f32 table expected");
    }
    if packed.elem_count() < n.div_ceil(2) || absmax.elem_count() < n.div_ceil(64) {
        candle_core::bail!(
            "nf4 dequantize: {} bytes and {} scales for {n} values",
            packed.elem_count(),
            absmax.elem_count()
        );
    }
    if code.elem_count() != 16 || !matches!(dtype, DType::F32 | DType::BF16) {
        candle_core::bail!("nf4 dequantize: a 16-value table and an f32 or bf16 output expected");
    }
    let (packed, absmax, code) = (
        packed.contiguous()?,
        absmax.contiguous()?,
        code.contiguous()?,
    );
    let out = output(n, dtype, packed.device())?; // [n]
    let kernel = format!("nf4_dequant_{}", suffix(dtype));
    launch(
        &cuda(&packed)?,
        &kernel,
        elementwise(n.div_ceil(2)),
        &[&packed, &absmax, &code, &out],
        &[Scalar::I64(n as i64)],
    )?;
    Ok(out)
}
