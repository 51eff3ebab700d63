use super::*;

fn fixture(name: &str) -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tiny")
        .join(name)
        .join("config.json");
    std::fs::read_to_string(p).unwrap()
}

/// What each later family's tiny config resolves to, and that a checkpoint's config.json
/// reads back to the same config.
#[test]
fn later_families_resolve_their_additions() {
    let p = Path::new("config.json");
    let read = |name: &str| ModelConfig::from_hf_json(&fixture(name), p).unwrap();
    let m = read("mistral");
    assert_eq!(m.arch, Arch::Mistral);
    assert_eq!(m.extras.sliding_window, Some(4));
    assert_eq!(m.extras.sliding_layers, vec![true; 2]);
    let p3 = read("phi3");
    assert!(p3.extras.fused_proj_names && p3.extras.rotary_dim.is_none());
    assert_eq!(p3.extras.sliding_window, Some(4));
    assert_eq!(p3.extras.sliding_layers, vec![true; 2]);
    let p4 = read("phi4mini");
    let l = p4.extras.long_rope.as_ref().unwrap();
    assert_eq!(l.short_factor, vec![1.0, 1.25, 1.5, 2.0, 3.0, 5.0]);
    assert!((l.attention_factor - (1.0 + 4f64.ln() / 64f64.ln()).sqrt()).abs() < 1e-12);
    // Positions stop where the short factors stop applying.
    assert_eq!(p4.max_position_embeddings, 64);
    assert!(p4.rope_scaling.is_none());
    assert_eq!(
        (p4.extras.rotary_dim, p4.tie_word_embeddings),
        (Some(12), true)
    );
    let g2 = read("gemma2");
    assert_eq!(g2.extras.sliding_layers, vec![true, false, true]);
    assert_eq!(g2.extras.activation, Activation::GeluTanh);
    assert_eq!(
        (g2.extras.attn_softcap, g2.extras.final_softcap),
        (Some(10.0), Some(15.0))
    );
    assert_eq!(g2.extras.query_pre_attn_scalar, Some(24.0));
    assert_eq!(g2.extras.embed_scale, Some(8.0));
    assert!(g2.extras.norm_plus_one && g2.extras.sandwich_norms && !g2.qk_norm);
    assert_eq!((g2.head_dim, g2.num_heads, g2.hidden_size), (32, 4, 64));
    let g3 = read("gemma3");
    assert_eq!(g3.extras.sliding_layers, vec![true, true, false]);
    assert_eq!(
        (g3.rope_theta, g3.extras.rope_local_theta),
        (1e6, Some(1e4))
    );
    assert!(g3.qk_norm && g3.extras.attn_softcap.is_none());
    for name in ["mistral", "phi3", "phi4mini", "gemma2", "gemma3"] {
        let c = read(name);
        let back = c.to_hf_json().unwrap().to_string();
        assert_eq!(ModelConfig::from_hf_json(&back, p).unwrap(), c, "{name}");
    }
}

#[test]
fn refuses_what_the_later_families_do_not_run() {
    let p = Path::new("config.json");
    let long = serde_json::json!({
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
        "short_factor": [1.0], "long_factor": [1.0]
    });
    // LongRoPE is Phi-3's; its short factors must cover the rotary dims.
    let mut v: serde_json::Value = serde_json::from_str(&fixture("mistral")).unwrap();
    v["rope_parameters"] = long.clone();
    let err = ModelConfig::from_hf_json(&v.to_string(), p)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("longrope") && err.contains("rope_scaling"),
        "{err}"
    );
    let mut v: serde_json::Value = serde_json::from_str(&fixture("phi3")).unwrap();
    v["rope_parameters"] = long;
    let err = ModelConfig::from_hf_json(&v.to_string(), p)
        .unwrap_err()
        .to_string();
    assert!(err.contains("short_factor"), "{err}");
    let mut v: serde_json::Value = serde_json::from_str(&fixture("gemma3")).unwrap();
    v["use_bidirectional_attention"] = true.into();
    let err = ModelConfig::from_hf_json(&v.to_string(), p)
        .unwrap_err()
        .to_string();
    assert!(err.contains("use_bidirectional_attention"), "{err}");
    let mut v: serde_json::Value = serde_json::from_str(&fixture("gemma2")).unwrap();
    v["layer_types"] = serde_json::json!(["sliding_attention"]);
    let err = ModelConfig::from_hf_json(&v.to_string(), p)
        .unwrap_err()
        .to_string();
    assert!(err.contains("layer_types"), "{err}");
}

/// SmolLM2-135M's shape counts 134.48M (HF reports 134.52M with the norms).
#[test]
fn approx_params_counts_projections_and_embedding() {
    let c = ModelConfig::from_hf_json(
        r#"{"model_type":"llama","vocab_size":49152,"hidden_size":576,"intermediate_size":1536,
            "num_hidden_layers":30,"num_attention_heads":9,"num_key_value_heads":3,
            "tie_word_embeddings":true}"#,
        Path::new("config.json"),
    )
    .unwrap();
    assert_eq!(c.approx_params(), 30 * 3_538_944 + 49152 * 576);
}

#[test]
fn parses_llama_and_rejects_unknown_arch() {
    let p = Path::new("config.json");
    let c = ModelConfig::from_hf_json(
        r#"{"model_type":"llama","vocab_size":10,"hidden_size":8,"intermediate_size":16,
            "num_hidden_layers":1,"num_attention_heads":2,"num_key_value_heads":1,
            "eos_token_id":[2,3]}"#,
        p,
    )
    .unwrap();
    assert_eq!(c.arch, Arch::Llama);
    assert_eq!(c.head_dim, 4);
    assert_eq!(c.kv_groups(), 2);
    assert_eq!(c.eos_token_ids, vec![2, 3]);
    let err = ModelConfig::from_hf_json(r#"{"model_type":"mamba"}"#, p).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("config.json") && msg.contains("mamba"),
        "{msg}"
    );
    let err = ModelConfig::from_hf_json(r#"{"model_type":"llama","vocab_size":10}"#, p)
        .unwrap_err()
        .to_string();
    assert!(err.contains("hidden_size"), "{err}");
}
