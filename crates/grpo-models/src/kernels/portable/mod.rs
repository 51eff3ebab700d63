//! The portable path: candle ops only, on every device candle runs on (a GPU's fallback where
//! grpo's GPU kernels do not apply, and what CI runs on the CPU with `kernels = "portable"`).
//! - [`ops`]: the layers' ops as differentiable compositions (RMSNorm, LayerNorm, softmax, RoPE).
//! - [`chunked_attention`]: attention over query chunks that keeps no `[B, H, S, Tk]` tensor.
//! - [`recompute`]: a result computed outside the graph, recorded with a backward in candle ops.
//! - [`tensor_ops`]: small helpers (matmul operands, reduction dtypes).

pub mod chunked_attention;
pub mod ops;
pub mod recompute;
pub mod tensor_ops;

pub use ops::{apply_rope, layer_norm_diff, rms_norm_diff, rms_norm_recomputed, softmax};
