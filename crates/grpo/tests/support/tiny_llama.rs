//! A tiny random Llama for tests, shared by the library's and the CLI's test crates
//! (`#[path]`-included): 2 layers, hidden 32, SmolLM2's vocabulary, tokenizer and chat template.

use std::path::Path;

use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};

/// A Llama's shape: hidden size, intermediate size, layers, heads, kv heads, head dim.
#[allow(dead_code)]
pub type Shape = (usize, usize, usize, usize, usize, usize);

/// The tiny model's shape.
#[allow(dead_code)]
pub const TINY: Shape = (32, 64, 2, 4, 2, 8);

/// Writes the model into `dir` (config.json, model.safetensors, tokenizer files); `fixtures` is
/// the repository's `tests/fixtures`. Weights come from a fixed seed.
#[allow(dead_code)]
pub fn tiny_llama(dir: &Path, fixtures: &Path) {
    random_llama(dir, fixtures, TINY);
}

/// [`tiny_llama`] of another shape (SmolLM2's vocabulary and tokenizer).
#[allow(dead_code)]
pub fn random_llama(dir: &Path, fixtures: &Path, shape: Shape) {
    std::fs::create_dir_all(dir).unwrap();
    let vocab = 49152usize;
    let (h, inter, layers, heads, kv, hd) = shape;
    // Projections' uniform range, narrower for wider models so that activations keep their size
    // (0.3 at the tiny model's width).
    let proj_scale = 0.3 * (32.0 / h as f32).sqrt();
    let cfg = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 512,
        "tie_word_embeddings": true, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu"
    });
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let mut t = |shape: &[usize], scale: f32, offset: f32| {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| offset + (rng.random::<f32>() - 0.5) * 2.0 * scale)
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    };
    let mut m = std::collections::HashMap::new();
    m.insert(
        "model.embed_tokens.weight".to_string(),
        t(&[vocab, h], 0.5, 0.0),
    );
    m.insert("model.norm.weight".to_string(), t(&[h], 0.1, 1.0));
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        for (n, s) in [
            ("self_attn.q_proj", [heads * hd, h]),
            ("self_attn.k_proj", [kv * hd, h]),
            ("self_attn.v_proj", [kv * hd, h]),
            ("self_attn.o_proj", [h, heads * hd]),
            ("mlp.gate_proj", [inter, h]),
            ("mlp.up_proj", [inter, h]),
            ("mlp.down_proj", [h, inter]),
        ] {
            m.insert(format!("{p}.{n}.weight"), t(&s, proj_scale, 0.0));
        }
        for n in ["input_layernorm", "post_attention_layernorm"] {
            m.insert(format!("{p}.{n}.weight"), t(&[h], 0.1, 1.0));
        }
    }
    candle_core::safetensors::save(&m, dir.join("model.safetensors")).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixtures.join("smollm2").join(f), dir.join(f)).unwrap();
    }
}
