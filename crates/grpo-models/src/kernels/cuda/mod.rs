//! grpo's own GPU kernels (`cuda/kernels.cu`, compiled at run time by NVRTC, so the build needs
//! no CUDA compiler for them): causal attention that never stores a score matrix, forward and
//! backward, in 64 x 64 tiles of scores through shared memory; single-query attention for a
//! decoding step over the KV cache's views, a block per (row, kv head); RMSNorm,
//! RoPE and SwiGLU, each forward and backward;
//! the LM head's log-softmax + gather + entropy and its backward; a QLoRA base's NF4 weights
//! dequantized.
//!
//! The attention plan is FlashAttention's: the forward keeps the output and one log-sum-exp per
//! query; the backward recomputes each probability from it (dQ per block of queries, dK and dV
//! per block of keys). f32 arithmetic over bf16 or f32 tensors; head sizes 16, 32, 64 and 128.
//! `GRPO_GPU_KERNELS=forward` runs attention's backward as [`crate::kernels::portable::chunked_attention`]'s candle
//! ops instead; `off` (or kernels that do not apply: another head size or dtype) runs candle ops.
//! bf16 attention runs through `cuda/attention_tc.cu` where the card has bf16 tensor cores (sm_80
//! and later): the same three kernels with their products as `mma.sync`, checked against the
//! CUDA-core ones once at start; `GRPO_GPU_ATTENTION=cores` runs the CUDA-core kernels instead.
//!
//! One file per op launches its kernels: [`attention`] (forward and backward, CUDA and tensor
//! cores), [`decode`] (a decoding step's attention), [`rms_norm`], [`rope`], [`swiglu`], [`head`]
//! (the LM head's log-probs), [`optim`] (AdamW, the gradient norm) and [`quant`] (NF4
//! dequantization); [`launch`] holds what they share. The kernels' twins in plain Rust ([`twins`]: [`twin_forward`], [`twin_backward`],
//! [`twin_swiglu`], [`twin_rms_norm`], [`twin_rope`]) compute the same math and are tested against the candle-op
//! path on the CPU in CI; `scripts/check_gpu_kernels.py` runs the CUDA source itself on the CPU
//! (a block's threads as OS threads) against torch; the GPU tests (`crates/grpo/tests/cuda/`)
//! compare the kernels with candle ops on the GPU, and a GPU's training with the CPU's portable
//! path.

#[cfg(feature = "cuda")]
use std::sync::OnceLock;

#[cfg(feature = "cuda")]
mod attention;
#[cfg(feature = "cuda")]
mod decode;
#[cfg(feature = "cuda")]
mod head;
#[cfg(feature = "cuda")]
mod launch;
#[cfg(feature = "cuda")]
mod optim;
#[cfg(feature = "cuda")]
mod quant;
#[cfg(feature = "cuda")]
mod rms_norm;
#[cfg(feature = "cuda")]
mod rope;
#[cfg(feature = "cuda")]
mod swiglu;
pub mod twins;

pub use crate::kernels::DecodeKernel;
#[cfg(feature = "cuda")]
pub use attention::{
    attention, attention_chunked_backward, attention_cuda_cores, attention_raw,
    attention_tensor_cores, AttnSaved,
};
#[cfg(feature = "cuda")]
pub use decode::{decode_attention, decode_attention_with};
#[cfg(feature = "cuda")]
pub use head::{head_logprobs, head_logprobs_backward, head_takes};
#[cfg(feature = "cuda")]
pub use optim::{adamw_step, add_into_f32, sum_squares};
#[cfg(feature = "cuda")]
pub use quant::nf4_dequantize;
#[cfg(feature = "cuda")]
pub use rms_norm::{add_rms_norm, rms_norm, rms_norm_backward, rms_norm_raw, rms_norm_takes};
#[cfg(feature = "cuda")]
pub use rope::{rope_append, rope_backward, rope_heads, rope_heads_raw};
#[cfg(feature = "cuda")]
pub use swiglu::{swiglu, swiglu_backward};
pub use twins::{twin_backward, twin_forward, twin_rms_norm, twin_rope, twin_swiglu};

/// The CUDA source of grpo's GPU kernels (`kernels.cu`, run by
/// this module; compiled at run time by NVRTC, `gpu_ptx`).
pub const GPU_KERNELS_CU: &str = include_str!("kernels.cu");

/// The CUDA source of attention's tensor-core kernels (`attention_tc.cu`: bf16
/// products as `mma.sync`, sm_80 and later), compiled after [`GPU_KERNELS_CU`], whose helpers
/// it uses, into a module of its own (`gpu_tc_ptx`).
pub const GPU_ATTENTION_TC_CU: &str = include_str!("attention_tc.cu");

/// The GPU kernels' PTX, compiled from [`GPU_KERNELS_CU`] once per process (an error is kept
/// and reported once).
#[cfg(feature = "cuda")]
pub fn gpu_ptx() -> Result<&'static str, &'static str> {
    static PTX: OnceLock<Result<String, String>> = OnceLock::new();
    let r = PTX.get_or_init(|| {
        candle_core::cuda_backend::cudarc::nvrtc::compile_ptx(GPU_KERNELS_CU)
            .map(|p| p.to_src())
            .map_err(|e| format!("{e:?}"))
    });
    match r {
        Ok(s) => Ok(s.as_str()),
        Err(e) => Err(e.as_str()),
    }
}

/// The tensor-core attention kernels' PTX: [`GPU_KERNELS_CU`] and [`GPU_ATTENTION_TC_CU`]
/// compiled for compute_80 (the first architecture with bf16 `mma.sync`; a newer card's driver
/// compiles it for its own), once per process. A separate module, so that a card older than
/// sm_80 still loads [`gpu_ptx`]'s.
#[cfg(feature = "cuda")]
pub fn gpu_tc_ptx() -> Result<&'static str, &'static str> {
    use candle_core::cuda_backend::cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
    static PTX: OnceLock<Result<String, String>> = OnceLock::new();
    let r = PTX.get_or_init(|| {
        let src = format!("{GPU_KERNELS_CU}\n{GPU_ATTENTION_TC_CU}");
        let opts = CompileOptions {
            arch: Some("compute_80"),
            ..Default::default()
        };
        compile_ptx_with_opts(src, opts)
            .map(|p| p.to_src())
            .map_err(|e| format!("{e:?}"))
    });
    match r {
        Ok(s) => Ok(s.as_str()),
        Err(e) => Err(e.as_str()),
    }
}

/// Head sizes the kernels are instantiated for (16 and 32: the tiny test fixtures', so that the
/// GPU tests against transformers run through the kernels).
pub const HEAD_DIMS: [usize; 4] = [16, 32, 64, 128];

/// Shapes of one attention call: rows, query heads, kv heads, queries, key slots, head size.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dims {
    pub b: usize,
    pub h: usize,
    pub hkv: usize,
    pub s: usize,
    pub tk: usize,
    pub d: usize,
}

impl Dims {
    /// Key slots query `i` reads (causal): `0 .. Tk - S + i + 1`.
    fn end(&self, i: usize) -> usize {
        (self.tk + i + 1).saturating_sub(self.s).min(self.tk)
    }
}
/// One AdamW step's scalars for [`adamw_step`] (torch's names; `decay` = 1 - lr * weight_decay,
/// `step_size` = lr / bias_correction1).
#[derive(Debug, Clone, Copy)]
pub struct AdamWScalars {
    pub grad_scale: f32,
    pub decay: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub bias_correction2_sqrt: f32,
    pub step_size: f32,
}

/// Whether grpo's GPU kernels take `x`: on a GPU, f32 or bf16. Whether they run at all is the
/// model's [`crate::kernels::Compute`] ([`crate::kernels::Compute::on_gpu`]); each kernel also
/// checks its shapes.
pub fn takes(x: &candle_core::Tensor) -> bool {
    x.device().is_cuda()
        && matches!(
            x.dtype(),
            candle_core::DType::F32 | candle_core::DType::BF16
        )
}
