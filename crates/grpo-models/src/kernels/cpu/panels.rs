//! The panel layout shared by the CPU's packed GEMMs (f32 decoding [`crate::kernels::cpu::packed`], quantized
//! [`crate::kernels::cpu::packed_quant`], bf16 [`crate::kernels::cpu::gemm_bf16`]): a weight's output columns in panels of
//! [`PANEL`], and work split into contiguous shares. A leaf, so that those modules need not import
//! each other for it.

/// Output columns per panel: two AVX-512 registers of f32.
pub const PANEL: usize = 32;

/// Part `t` of `n` items split into `parts` contiguous, near-equal runs.
pub(crate) fn share(n: usize, t: usize, parts: usize) -> std::ops::Range<usize> {
    n * t / parts..n * (t + 1) / parts
}
