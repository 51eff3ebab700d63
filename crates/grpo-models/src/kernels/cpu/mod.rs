//! grpo's hand-written CPU kernels (f32, and bf16 products with f32 sums), each compiled per
//! instruction set ([`crate::kernels::Isa`]) and run under [`crate::kernels::Compute::CpuFused`]
//! or [`crate::kernels::Compute::CpuMixed`]:
//! - [`fused`]: RMSNorm, masked softmax, SiLU, RoPE and the LM head's log-softmax with entropy,
//!   each with a hand-written backward; [`fused_attention`]: attention over the mask's key runs,
//!   and single-query decoding attention; [`vmath`]: the vectorized `exp` and row kernels.
//! - [`packed`], [`packed_quant`], [`panels`]: the decoding GEMM over weights packed in column
//!   panels (f32, quantized); [`gemm_bf16`]: the bf16 GEMM of CPU mixed precision (AMX tiles
//!   where the CPU has them); [`quant`]: frozen quantized projections with a backward.
//! - [`decode`]: the fused decoding step of the Llama family, a thread team over every layer.

pub mod decode;
pub mod fused;
pub mod fused_attention;
pub mod gemm_bf16;
pub mod packed;
pub mod packed_quant;
pub mod panels;
pub mod quant;
pub mod vmath;

/// The `gemm` crate's parallelism for the CPU's large products: candle's thread count.
pub(crate) fn gemm_threads() -> gemm::Parallelism {
    match candle_core::utils::get_num_threads() {
        0 | 1 => gemm::Parallelism::None,
        n => gemm::Parallelism::Rayon(n),
    }
}
