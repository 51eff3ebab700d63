//! A tiny random Llama for tests, shared by the library's and the CLI's test crates
//! (`#[path]`-included): 2 layers, hidden 32, SmolLM2's vocabulary, tokenizer and chat template.

use std::path::Path;

use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};

/// Writes the model into `dir` (config.json, model.safetensors, tokenizer files); `fixtures` is
/// the repository's `tests/fixtures`. Weights come from a fixed seed.
pub fn tiny_llama(dir: &Path, fixtures: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let vocab = 49152usize;
    let (h, inter, layers, heads, kv, hd) = (32usize, 64usize, 2usize, 4usize, 2usize, 8usize);
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
            m.insert(format!("{p}.{n}.weight"), t(&s, 0.3, 0.0));
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
