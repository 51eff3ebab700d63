//! Small tensor helpers shared by the layers and the chunked attention (a module below both, so
//! that neither imports the other).

use candle_core::{DType, Result, Tensor};

/// The dtype to do softmax-like reductions in: half types are upcast to f32, others kept.
pub fn reduce_dtype(d: DType) -> DType {
    match d {
        DType::BF16 | DType::F16 => DType::F32,
        d => d,
    }
}

/// `t` [B, H, M, N] as a matmul operand: returned as is when candle's CPU matmul accepts its
/// strides (rows contiguous and batch dims mergeable, e.g. a prefix view of the KV cache), else
/// made contiguous. Avoids copying the cache at every decoding step.
pub fn matmul_operand(t: &Tensor) -> Result<Tensor> {
    let d = t.dims();
    let s = t.stride();
    let ok = d.len() == 4
        && (s[3] == 1 || d[3] == 1)
        && (s[2] == d[3] || d[2] == 1)
        && (s[0] == s[1] * d[1] || d[0] == 1 || d[1] == 1);
    if ok {
        Ok(t.clone())
    } else {
        t.contiguous()
    }
}
