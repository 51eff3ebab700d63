//! The GPU's one-op training layer against candle ops, with every gradient.

use super::*;

/// A Llama layer's training forward as one recorded op (`gpu_layer.rs`: its own backward, the
/// projections' weight gradients into GPU sinks) against the same layer in candle ops with
/// candle's autograd: the output, the input's gradient, every weight's and what the forward
/// keeps; a small layer in f32 and bf16, and SmolLM2-135M's and SmolLM2-1.7B's layer sizes in
/// bf16 (the check training runs once per shape before it uses the op). Its first H200 run
/// failed by 1.3-2.0 of the largest value: the check then gave the layer an all-zero mask,
/// against which candle's chunked attention is not causal (gpu_layer.rs's docs).
#[test]
fn gpu_layer_op_equals_candle_ops_with_every_gradient() {
    let dev = gpu();
    use grpo_models::kernels::gpu_layer::{check, check_dtype, tolerance, worst, LayerShape};
    let (f, b) = check(&dev).unwrap();
    eprintln!("layer op against candle ops, of each tensor's largest value: f32 {f:?}; bf16 {b:?}");
    assert!(worst(&f) < 1e-4, "f32: {f:?}");
    assert!(worst(&b) < 3e-2, "bf16: {b:?}");
    let shape = |hidden, heads, kv_heads, intermediate| LayerShape {
        hidden,
        heads,
        kv_heads,
        head_dim: 64,
        intermediate,
    };
    for (name, s) in [
        ("135M", shape(576, 9, 3, 1536)),
        ("1.7B", shape(2048, 32, 32, 8192)),
    ] {
        let e = check_dtype(&dev, DType::BF16, s).unwrap();
        eprintln!("layer op against candle ops, {name} layer, bf16: {e:?}");
        assert!(worst(&e) < tolerance(DType::BF16), "{name} bf16: {e:?}");
    }
}
