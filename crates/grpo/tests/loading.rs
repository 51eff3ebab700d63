//! Loading paths and bad input: sharded safetensors, GGUF files of every architecture (written here
//! from the tiny HF fixtures the way llama.cpp lays them out), bf16, and clear errors for broken
//! checkpoints.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use grpo_models::hub::ModelSource;
use grpo_models::models::{Arch, Mode, SeqBatch};
use grpo_models::weights::{hf_name, load_model, LoadedModel};

fn fixture_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tiny")
        .join(name)
}

fn load_dir(dir: &Path, dtype: DType) -> grpo::Result<LoadedModel> {
    load_model(&ModelSource::HfDir(dir.to_path_buf()), dtype, &Device::Cpu)
}

fn logits(m: &LoadedModel) -> Vec<f32> {
    let model = m.build().unwrap();
    let batch = SeqBatch::right_padded(&[vec![3, 17, 99, 4, 250, 31]], 0, &Device::Cpu).unwrap();
    let h = model.forward_hidden(&batch, Mode::Infer).unwrap();
    model
        .logits(&h)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Copies a fixture directory into a temp dir so a test can break it.
fn copy_fixture(name: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(fixture_dir(name)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), tmp.path().join(e.file_name())).unwrap();
    }
    tmp
}

#[test]
fn sharded_safetensors_load_like_a_single_file() {
    let orig = load_dir(&fixture_dir("llama"), DType::F32).unwrap();
    let tmp = copy_fixture("llama");
    std::fs::remove_file(tmp.path().join("model.safetensors")).unwrap();
    let mut names: Vec<&String> = orig.tensors.keys().collect();
    names.sort();
    let (a, b) = names.split_at(names.len() / 2);
    let mut weight_map = serde_json::Map::new();
    for (file, part) in [
        ("model-00001-of-00002.safetensors", a),
        ("model-00002-of-00002.safetensors", b),
    ] {
        let m: HashMap<String, Tensor> = part
            .iter()
            .map(|k| ((*k).clone(), orig.tensors[*k].clone()))
            .collect();
        candle_core::safetensors::save(&m, tmp.path().join(file)).unwrap();
        for k in part {
            weight_map.insert((*k).clone(), file.into());
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(
        tmp.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    let sharded = load_dir(tmp.path(), DType::F32).unwrap();
    assert_eq!(logits(&orig), logits(&sharded));
}

#[test]
fn bf16_weights_give_close_logits() {
    let f = load_dir(&fixture_dir("qwen2"), DType::F32).unwrap();
    let b = load_dir(&fixture_dir("qwen2"), DType::BF16).unwrap();
    let d = max_diff(&logits(&f), &logits(&b));
    assert!(d < 0.25, "bf16 logits differ from f32 by {d}");
}

/// Writes `m` as a GGUF file the way llama.cpp's converter lays it out: GGUF names, Q/K rows
/// permuted for llama, GPT-2 Conv1D weights as [out, in], hyper-parameters in metadata.
fn write_gguf(m: &LoadedModel, path: &Path) {
    let c = &m.config;
    let arch = c.arch.name();
    // Inverse of the loader's name map, built from it.
    let mut to_gguf: HashMap<String, (String, bool)> = HashMap::new();
    let parts = [
        "attn_norm",
        "ffn_norm",
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "attn_q_norm",
        "attn_k_norm",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
        "attn_qkv",
    ];
    let mut candidates: Vec<String> = ["token_embd", "position_embd", "output_norm", "output"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    for l in 0..c.num_layers {
        candidates.extend(parts.iter().map(|p| format!("blk.{l}.{p}")));
    }
    for cand in candidates {
        for ext in ["weight", "bias"] {
            let g = format!("{cand}.{ext}");
            if let Some((hf, conv)) = hf_name(c.arch, &g) {
                to_gguf.insert(hf, (g, conv));
            }
        }
    }
    let permute = |t: &Tensor, heads: usize| -> Tensor {
        let dims = t.dims().to_vec();
        let rest: usize = dims[1..].iter().product();
        t.reshape((heads, 2, dims[0] / heads / 2, rest))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
            .reshape(dims)
            .unwrap()
    };
    let mut tensors: Vec<(String, QTensor)> = vec![];
    for (hf, t) in &m.tensors {
        let (g, conv) = to_gguf
            .get(hf)
            .unwrap_or_else(|| panic!("no GGUF name for {hf}"))
            .clone();
        let mut t = t.clone();
        if c.arch == Arch::Llama && hf.contains("q_proj") {
            t = permute(&t, c.num_heads);
        } else if c.arch == Arch::Llama && hf.contains("k_proj") {
            t = permute(&t, c.num_kv_heads);
        }
        if conv {
            t = t.t().unwrap().contiguous().unwrap();
        }
        tensors.push((g, QTensor::quantize(&t, GgmlDType::F32).unwrap()));
    }
    use gguf_file::Value as V;
    let norm_key = if c.arch == Arch::Gpt2 {
        "attention.layer_norm_epsilon"
    } else {
        "attention.layer_norm_rms_epsilon"
    };
    let md: Vec<(String, V)> = vec![
        ("general.architecture".into(), V::String(arch.into())),
        (format!("{arch}.block_count"), V::U32(c.num_layers as u32)),
        (
            format!("{arch}.embedding_length"),
            V::U32(c.hidden_size as u32),
        ),
        (
            format!("{arch}.feed_forward_length"),
            V::U32(c.intermediate_size as u32),
        ),
        (
            format!("{arch}.attention.head_count"),
            V::U32(c.num_heads as u32),
        ),
        (
            format!("{arch}.attention.head_count_kv"),
            V::U32(c.num_kv_heads as u32),
        ),
        (
            format!("{arch}.attention.key_length"),
            V::U32(c.head_dim as u32),
        ),
        (
            format!("{arch}.rope.freq_base"),
            V::F32(c.rope_theta as f32),
        ),
        (format!("{arch}.{norm_key}"), V::F32(c.norm_eps as f32)),
        (
            format!("{arch}.context_length"),
            V::U32(c.max_position_embeddings as u32),
        ),
        (format!("{arch}.vocab_size"), V::U32(c.vocab_size as u32)),
        ("tokenizer.ggml.eos_token_id".into(), V::U32(2)),
    ];
    let md_refs: Vec<(&str, &V)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut f, &md_refs, &t_refs).unwrap();
}

#[test]
fn gguf_files_of_every_architecture_load_like_hf() {
    for name in ["llama", "qwen2", "qwen3", "gpt2"] {
        let hf = load_dir(&fixture_dir(name), DType::F32).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join(format!("{name}.gguf"));
        write_gguf(&hf, &path);
        let g = load_model(&ModelSource::Gguf(path), DType::F32, &Device::Cpu).unwrap();
        assert_eq!(
            g.config.tie_word_embeddings, hf.config.tie_word_embeddings,
            "{name}"
        );
        assert_eq!(g.eos_token_ids, vec![2]);
        let d = max_diff(&logits(&hf), &logits(&g));
        assert!(d < 1e-5, "{name}: GGUF logits differ from HF by {d}");
    }
}

/// Overwrites one key of `dir/config.json`.
fn set_config_key(dir: &Path, key: &str, value: serde_json::Value) {
    let cfg = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    v[key] = value;
    std::fs::write(&cfg, v.to_string()).unwrap();
}

fn err_of(r: grpo::Result<LoadedModel>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn broken_checkpoints_give_clear_errors() {
    // Missing config.json.
    let tmp = copy_fixture("llama");
    std::fs::remove_file(tmp.path().join("config.json")).unwrap();
    let e = err_of(load_dir(tmp.path(), DType::F32));
    assert!(e.contains("config.json"), "{e}");

    // Truncated safetensors.
    let tmp = copy_fixture("llama");
    let p = tmp.path().join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    let e = err_of(load_dir(tmp.path(), DType::F32));
    assert!(e.contains("model.safetensors"), "{e}");

    // No weights at all.
    std::fs::remove_file(&p).unwrap();
    let e = err_of(load_dir(tmp.path(), DType::F32));
    assert!(e.contains("no model.safetensors"), "{e}");

    // Unknown architecture.
    let tmp = copy_fixture("llama");
    let cfg = tmp.path().join("config.json");
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(
        &cfg,
        text.replace("\"llama\"", "\"mamba\"")
            .replace("LlamaForCausalLM", "MambaForCausalLM"),
    )
    .unwrap();
    let e = err_of(load_dir(tmp.path(), DType::F32));
    assert!(e.contains("mamba") && e.contains("Supported"), "{e}");

    // Config and weights disagree: the error names the tensor.
    let tmp = copy_fixture("llama");
    set_config_key(tmp.path(), "intermediate_size", serde_json::json!(96));
    let e = err_of(load_dir(tmp.path(), DType::F32).and_then(|m| m.build().map(|_| m)));
    assert!(e.contains("mlp") && e.contains("96"), "{e}");

    // Untied config without lm_head.
    let tmp = copy_fixture("qwen2");
    set_config_key(tmp.path(), "tie_word_embeddings", serde_json::json!(false));
    let e = err_of(load_dir(tmp.path(), DType::F32));
    assert!(e.contains("lm_head"), "{e}");

    // A tokenizer that does not belong to the model (49152 tokens vs a 256-token vocabulary).
    let tmp = copy_fixture("llama");
    let smol = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/smollm2");
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(smol.join(f), tmp.path().join(f)).unwrap();
    }
    let e = err_of(load_dir(tmp.path(), DType::F32));
    assert!(
        e.contains("tokenizer") && e.contains("49152") && e.contains("256"),
        "{e}"
    );

    // A file that is not GGUF.
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("x.gguf");
    std::fs::write(&p, b"not a gguf file at all").unwrap();
    let e = err_of(load_model(&ModelSource::Gguf(p), DType::F32, &Device::Cpu));
    assert!(e.contains("x.gguf") && e.contains("GGUF"), "{e}");
}

#[test]
fn bad_prompts_give_clear_errors() {
    use grpo_models::sampler::{generate, PromptInput, SamplingParams};
    let m = load_dir(&fixture_dir("gpt2"), DType::F32).unwrap();
    let model = m.build().unwrap();
    let p = SamplingParams {
        max_new_tokens: 4,
        ..Default::default()
    };
    let run = |ids: Vec<u32>, p: &SamplingParams| {
        generate(&model, None, &[PromptInput { ids, seed: 0 }], 1, p)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    assert!(run(vec![], &p).contains("empty"));
    // GPT-2 fixture has 128 positions.
    let e = run(vec![5; 126], &p);
    assert!(
        e.contains("126") && e.contains("128") && e.contains("max_new_tokens"),
        "{e}"
    );
    assert!(run(vec![999], &p).contains("999"));
    let bad = SamplingParams {
        temperature: -1.0,
        ..p.clone()
    };
    assert!(run(vec![5], &bad).contains("temperature"));
}
