use super::*;
use crate::kernels::portable::{apply_rope, rms_norm_diff, softmax};
use crate::models::config::Llama3RopeScaling;
use crate::models::ModelConfig;
use candle_core::Device;

pub(crate) use crate::kernels::portable::ops::tests::max_abs_diff;

#[test]
fn fused_and_differentiable_kernels_agree() {
    let dev = Device::Cpu;
    let x = Tensor::randn(0f32, 1.0, (2, 3, 5, 8), &dev).unwrap();
    let w = Tensor::randn(1f32, 0.1, 8, &dev).unwrap();
    let b = Tensor::randn(0f32, 0.1, 8, &dev).unwrap();
    let rms = RmsNorm::new(w.clone(), 1e-5, Compute::resolve(&dev, DType::F32));
    assert!(
        max_abs_diff(
            &rms.forward(&x, Mode::Train).unwrap(),
            &rms.forward(&x, Mode::Infer).unwrap()
        ) < 1e-5
    );
    let ln = LayerNorm {
        weight: w,
        bias: b,
        eps: 1e-5,
    };
    assert!(
        max_abs_diff(
            &ln.forward(&x, Mode::Train).unwrap(),
            &ln.forward(&x, Mode::Infer).unwrap()
        ) < 1e-5
    );
    assert!(
        max_abs_diff(
            &softmax(&x, Mode::Train).unwrap(),
            &softmax(&x, Mode::Infer).unwrap()
        ) < 1e-6
    );
    let pos = Tensor::new(&[[0u32, 1, 2, 3, 4], [7, 8, 9, 10, 11]], &dev).unwrap();
    let cfg = ModelConfig {
        arch: super::super::config::Arch::Llama,
        vocab_size: 4,
        hidden_size: 24,
        intermediate_size: 4,
        num_layers: 1,
        num_heads: 3,
        num_kv_heads: 3,
        head_dim: 8,
        norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: None,
        rope_freq_factors: None,
        max_position_embeddings: 32,
        tie_word_embeddings: true,
        attention_bias: false,
        mlp_bias: false,
        qk_norm: false,
        bos_token_id: None,
        eos_token_ids: vec![],
        build_quantized: None,
        extras: Default::default(),
    };
    let rope = Rope::new(&cfg, &dev).unwrap();
    let (c, s) = rope.tables(&pos, DType::F32).unwrap();
    let a = apply_rope(&x, &c, &s, Mode::Train).unwrap();
    let f = apply_rope(&x, &c, &s, Mode::Infer).unwrap();
    assert!(max_abs_diff(&a, &f) < 1e-5);
}

/// Plain-f32 twin of RMSNorm for one row.
fn rms_norm_slow(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let r = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(v, w)| v * r * w).collect()
}

#[test]
fn rms_norm_matches_plain_twin() {
    let dev = Device::Cpu;
    let x = vec![0.5f32, -1.0, 2.0, 0.25];
    let w = vec![1.0f32, 0.5, -1.0, 2.0];
    let t = rms_norm_diff(
        &Tensor::new(x.as_slice(), &dev)
            .unwrap()
            .unsqueeze(0)
            .unwrap(),
        &Tensor::new(w.as_slice(), &dev).unwrap(),
        1e-5,
    )
    .unwrap()
    .squeeze(0)
    .unwrap()
    .to_vec1::<f32>()
    .unwrap();
    for (a, b) in t.iter().zip(rms_norm_slow(&x, &w, 1e-5)) {
        assert!((a - b).abs() < 1e-6);
    }
}

#[test]
fn llama3_scaling_changes_only_low_frequencies() {
    let s = Llama3RopeScaling {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 32,
    };
    let plain = rope_inv_freq(16, 500000.0, None);
    let scaled = rope_inv_freq(16, 500000.0, Some(s));
    assert_eq!(plain[0], scaled[0]); // highest frequency untouched
    let last = plain.len() - 1;
    assert!((scaled[last] - plain[last] / 8.0).abs() < 1e-15); // lowest divided by factor
}
