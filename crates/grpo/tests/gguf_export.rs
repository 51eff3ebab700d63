//! `grpo export --format gguf` on a tiny random Llama with SmolLM2's tokenizer: the file loads
//! back in grpo with the exported weights exactly (f16 rounding, q8_0 blocks), the same tokenizer
//! and the same greedy tokens; and, where a Python with the `gguf` package and llama-cpp-python
//! is there (`GRPO_TEST_PYTHON`, else `python3`), llama.cpp reads it and decodes the tokens grpo
//! decodes. Every other family (Llama 3, Qwen2/3, Mistral, Phi-3, Phi-4-mini, Gemma 2/3, GPT-2)
//! round-trips through grpo from the tiny fixtures, and llama.cpp runs each as grpo does. Without
//! that Python those tests say they were skipped, unless `GRPO_REQUIRE_GGUF=1` (set by `.ci/run`,
//! which installs them) makes it a failure.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use grpo::export::export_gguf;
use grpo_models::gguf_write::GgufType;
use grpo_models::hub::ModelSource;
use grpo_models::models::{CausalLm, Mode, SeqBatch};
use grpo_models::sampler::{generate, PromptInput, SamplingParams};
use grpo_models::tokenizer::ChatMessage;
use grpo_models::weights::{load_model, LoadedModel};

#[path = "support/diff.rs"]
mod diff;
use diff::max_diff;
#[path = "support/archs.rs"]
mod archs;
#[path = "support/tiny_llama.rs"]
mod support;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// Greedy tokens to decode in every comparison.
const N: usize = 16;

fn tiny(dir: &Path) -> LoadedModel {
    support::tiny_llama(dir, &fixtures());
    load_model(
        &ModelSource::HfDir(dir.to_path_buf()),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap()
}

fn prompt(m: &LoadedModel) -> Vec<u32> {
    let msgs = [ChatMessage::user("What is 12 + 30? Answer briefly.")];
    m.tokenizer().unwrap().encode_chat(&msgs, true).unwrap()
}

/// `n` greedy tokens (no EOS stop: every comparison is over all of them).
fn greedy(model: &CausalLm, prompt: &[u32], n: usize) -> Vec<u32> {
    let params = SamplingParams {
        max_new_tokens: n,
        temperature: 0.0,
        eos_token_ids: vec![],
        ..Default::default()
    };
    let input = PromptInput {
        ids: prompt.to_vec(),
        seed: 0,
    };
    let (out, _) = generate(model, None, &[input], 1, &params).unwrap();
    out[0][0].ids.clone()
}

/// The logits that chose each of `tokens` after `prompt` (teacher-forced), `[n][vocab]`.
fn step_logits(model: &CausalLm, prompt: &[u32], tokens: &[u32]) -> Vec<Vec<f32>> {
    let seq = [prompt, tokens].concat();
    let batch = SeqBatch::right_padded(&[seq], 0, &Device::Cpu).unwrap();
    let h = model.forward_hidden(&batch, Mode::Infer).unwrap(); // [1, T, H]
    let h = h
        .narrow(1, prompt.len() - 1, tokens.len())
        .unwrap()
        .squeeze(0)
        .unwrap();
    model.head_logits(&h).unwrap().to_vec2().unwrap() // [n, V]
}

/// Top-1 minus top-2 logit.
fn margin(logits: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::MIN, f32::MIN);
    for &x in logits {
        if x > a {
            (a, b) = (x, a);
        } else if x > b {
            b = x;
        }
    }
    a - b
}

/// What a tensor becomes in a GGUF of type `ty`: matrices in `ty`, the rest f32.
fn as_written(t: &Tensor, ty: GgmlDType) -> Tensor {
    if t.rank() < 2 {
        return t.clone();
    }
    QTensor::quantize(t, ty)
        .unwrap()
        .dequantize(&Device::Cpu)
        .unwrap()
}

fn export(dir: &Path, out: &Path, ty: GgufType) -> LoadedModel {
    let (s, g) = export_gguf(dir, out, None, ty).unwrap();
    assert_eq!(s.merged_adapters, 0);
    assert!(g.has_tokenizer);
    assert_eq!(g.f16_fallbacks, 0);
    load_model(
        &ModelSource::Gguf(out.to_path_buf()),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap()
}

#[test]
fn gguf_exports_load_back_with_the_same_weights_tokenizer_and_tokens() {
    let tmp = tempfile::tempdir().unwrap();
    let hf = tiny(&tmp.path().join("hf"));
    let prompt = prompt(&hf);
    let hf_model = hf.build().unwrap();
    let want = greedy(&hf_model, &prompt, N);
    let want_logits = step_logits(&hf_model, &prompt, &want);

    for (ty, ggml) in [
        (GgufType::F32, GgmlDType::F32),
        (GgufType::F16, GgmlDType::F16),
        (GgufType::Bf16, GgmlDType::BF16),
        (GgufType::Q8_0, GgmlDType::Q8_0),
    ] {
        let out = tmp.path().join(format!("tiny-{ty:?}.gguf"));
        let g = export(&tmp.path().join("hf"), &out, ty);
        // The config and every tensor as written: f16 rounding or q8_0 blocks of HF's weights
        // (Q/K rows permuted for llama.cpp and back), norms f32.
        // (GGUF keeps eps and theta as f32, as llama.cpp reads them.)
        let (mut a, mut b) = (hf.config.clone(), g.config.clone());
        (a.eos_token_ids, b.eos_token_ids) = (vec![], vec![]);
        a.norm_eps = a.norm_eps as f32 as f64;
        a.rope_theta = a.rope_theta as f32 as f64;
        assert_eq!(a, b, "{ty:?}");
        assert_eq!(g.eos_token_ids, hf.eos_token_ids, "{ty:?}");
        assert_eq!(g.tensors.len(), hf.tensors.len(), "{ty:?}");
        for (k, t) in &hf.tensors {
            let d = max_diff(&g.tensors[k], &as_written(t, ggml));
            assert_eq!(d, 0.0, "{ty:?}: {k} differs by {d}");
        }
        // The tokenizer from the file's metadata: the same ids, chat template and special tokens.
        let (ht, gt) = (hf.tokenizer().unwrap(), g.tokenizer().unwrap());
        for text in [
            "Hello world, 12345 tokens!",
            "  spaces\n\ttabs <|im_end|> é日本",
        ] {
            assert_eq!(
                gt.encode(text, true).unwrap(),
                ht.encode(text, true).unwrap()
            );
        }
        assert_eq!(
            gt.encode_chat(
                &[ChatMessage::user("What is 12 + 30? Answer briefly.")],
                true
            )
            .unwrap(),
            prompt
        );
        assert_eq!(gt.vocab_size(), ht.vocab_size());
        assert_eq!(gt.eos_token_id(), ht.eos_token_id());
        assert_eq!(gt.pad_token_id(), ht.pad_token_id());

        let model = g.build().unwrap();
        let got = greedy(&model, &prompt, N);
        let logits = step_logits(&model, &prompt, &got);
        let worst = logits[0]
            .iter()
            .zip(&want_logits[0])
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        let spread = want_logits[0].iter().fold(0f32, |m, x| m.max(x.abs()));
        eprintln!(
            "{ty:?}: first-step logits differ from f32 HF by at most {worst} (max |logit| {spread}); tokens {got:?}"
        );
        match ty {
            // f32 is HF's weights exactly; f16 rounds each weight by at most 2^-11 relative:
            // the same greedy tokens on this prompt.
            GgufType::F32 | GgufType::F16 => assert_eq!(got, want, "{ty:?}"),
            // bf16 rounds each weight by up to 2^-9 relative; q8_0 moves it by up to half a
            // step, 1/254 of its block's largest (the loaded weights are exactly those, asserted
            // above). At hidden size 32 few terms average that out, and the logits move by up
            // to 1.3% of their range (q8_0; 3% allowed). The
            // tokens are the same until a step where f32's top two logits are closer than twice
            // the largest logit change there, the only way greedy can pick another token.
            _ => {
                assert!(worst < 0.03 * spread, "{ty:?}: {worst} vs {spread}");
                let same = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
                if same < N {
                    let moved = logits[same]
                        .iter()
                        .zip(&want_logits[same])
                        .map(|(a, b)| (a - b).abs())
                        .fold(0f32, f32::max);
                    let m = margin(&want_logits[same]);
                    assert!(
                        m <= 2.0 * moved,
                        "{ty:?}: step {same}: margin {m}, moved {moved}"
                    );
                }
                assert!(same >= 4, "{ty:?}: only {same} tokens agree");
            }
        }
        if ty == GgufType::F16 {
            // A GGUF exports to GGUF again (its tokenizer rebuilt from the file's metadata) to
            // the same weights.
            let again = tmp.path().join("again.gguf");
            let g2 = export(&out, &again, GgufType::F16);
            for (k, t) in &g.tensors {
                assert_eq!(max_diff(&g2.tensors[k], t), 0.0, "re-export: {k}");
            }
            let t2 = g2.tokenizer().unwrap();
            assert_eq!(
                t2.encode("Hello world, 12345!", true).unwrap(),
                ht.encode("Hello world, 12345!", true).unwrap()
            );
            // An existing file is refused.
            let e = export_gguf(&out, &again, None, GgufType::F16).unwrap_err();
            assert!(e.to_string().contains("already exists"), "{e}");
        }
    }
}

/// Logits of `m` on `ids` (right-padded), `[B*T, V]`.
fn all_logits(m: &LoadedModel, ids: &[Vec<u32>]) -> Tensor {
    let batch = SeqBatch::right_padded(ids, 0, &Device::Cpu).unwrap();
    let model = m.build().unwrap();
    let h = model.forward_hidden(&batch, Mode::Infer).unwrap(); // [B, T, H]
    let (b, t, d) = h.dims3().unwrap();
    model.head_logits(&h.reshape((b * t, d)).unwrap()).unwrap() // [B*T, V]
}

/// A copy of the tiny fixture `name` with its `config.json` changed by `patch` (keys replaced;
/// `tie_word_embeddings: true` also drops `lm_head`), to vary what the fixtures do not.
fn patched_fixture(name: &str, dir: &Path, patch: serde_json::Value) {
    let src = fixtures().join("tiny").join(name);
    std::fs::create_dir_all(dir).unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    for (k, v) in patch.as_object().unwrap() {
        cfg[k] = v.clone();
    }
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let mut t =
        candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu).unwrap();
    if cfg["tie_word_embeddings"] == true {
        t.remove("lm_head.weight");
    }
    candle_core::safetensors::save(&t, dir.join("model.safetensors")).unwrap();
}

/// Every architecture, from the tiny fixtures (no tokenizer: grpo loads such a file, llama.cpp
/// would not): Llama, Llama 3 (its RoPE scaling as `rope_freqs`), Qwen2 (q/k/v biases), Qwen3
/// (q/k norms), Mistral (its window kept for grpo), Phi-3 (fused projections; Phi-4-mini's
/// partial rotary and LongRoPE factors), Gemma 2 (softcaps, a query scale llama.cpp cannot be
/// told, folded into q_proj) and Gemma 3 (its own layer pattern and local RoPE base, recorded)
/// and GPT-2. f32 files give the HF model's logits. Gemma 2 with its own lm_head is refused
/// (llama.cpp ties it), and tied it round-trips.
#[test]
fn every_architecture_round_trips() {
    let tmp = tempfile::tempdir().unwrap();
    let tied_gemma2 = tmp.path().join("gemma2-tied");
    patched_fixture(
        "gemma2",
        &tied_gemma2,
        serde_json::json!({"tie_word_embeddings": true}),
    );
    for name in archs::ARCHS.into_iter().chain(["gemma2-tied"]) {
        let dir = match name {
            "gemma2-tied" => tied_gemma2.clone(),
            _ => fixtures().join("tiny").join(name),
        };
        let out = tmp.path().join(format!("{name}.gguf"));
        let r = export_gguf(&dir, &out, None, GgufType::F32);
        if name == "gemma2" {
            let e = r.unwrap_err().to_string();
            assert!(e.contains("ties the output layer"), "{e}");
            continue;
        }
        let (_, summary) = r.unwrap();
        assert!(!summary.has_tokenizer);
        // What llama.cpp runs differently is said: the fixtures' 4-token windows on Mistral and
        // Phi-3, Gemma 3's three-layer pattern.
        let warned = |w: &str| summary.warnings.iter().any(|x| x.contains(w));
        match name {
            "mistral" => assert!(warned("no sliding window"), "{:?}", summary.warnings),
            "phi3" => assert!(
                warned("turns Phi-3's sliding window off"),
                "{:?}",
                summary.warnings
            ),
            "gemma3" | "gemma3_linear" => {
                assert!(warned("five of every six"), "{:?}", summary.warnings)
            }
            _ => assert!(
                summary.warnings.is_empty(),
                "{name}: {:?}",
                summary.warnings
            ),
        }
        let hf = load_model(&ModelSource::HfDir(dir.clone()), DType::F32, &Device::Cpu).unwrap();
        let g = load_model(&ModelSource::Gguf(out), DType::F32, &Device::Cpu).unwrap();
        assert_eq!(g.config.arch, hf.config.arch, "{name}");
        assert_eq!(
            g.config.tie_word_embeddings, hf.config.tie_word_embeddings,
            "{name}"
        );
        assert_eq!(
            g.config.extras.sliding_window, hf.config.extras.sliding_window,
            "{name}"
        );
        assert_eq!(
            g.config.extras.sliding_layers, hf.config.extras.sliding_layers,
            "{name}"
        );
        assert_eq!(
            g.config.rope_scaling.is_some() || g.config.rope_freq_factors.is_some(),
            name == "llama3"
        );
        assert_eq!(
            g.config.extras.long_rope.is_some(),
            name == "phi4mini",
            "{name}"
        );
        assert_eq!(
            g.config.extras.rope_linear_factor, hf.config.extras.rope_linear_factor,
            "{name}"
        );
        let expected: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(
                fixtures()
                    .join("tiny")
                    .join(name.trim_end_matches("-tied"))
                    .join("expected.json"),
            )
            .unwrap(),
        )
        .unwrap();
        let ids: Vec<Vec<u32>> = serde_json::from_value(expected["input_ids"].clone()).unwrap();
        let d = max_diff(&all_logits(&g, &ids), &all_logits(&hf, &ids));
        assert!(d < 1e-4, "{name}: GGUF logits differ by {d}");
        // A GGUF read back exports to the same file (its config.json form included).
        let again = tmp.path().join(format!("{name}-again.gguf"));
        export_gguf(
            &tmp.path().join(format!("{name}.gguf")),
            &again,
            None,
            GgufType::F32,
        )
        .unwrap();
        let g2 = load_model(&ModelSource::Gguf(again), DType::F32, &Device::Cpu).unwrap();
        let d = max_diff(&all_logits(&g2, &ids), &all_logits(&g, &ids));
        assert!(d < 1e-5, "{name}: re-exported GGUF logits differ by {d}");
    }
}

/// A Python with `gguf` and `llama_cpp`, or None (skipped, unless `GRPO_REQUIRE_GGUF=1`).
fn python() -> Option<String> {
    let candidates = [
        std::env::var("GRPO_TEST_PYTHON").ok(),
        Some("python3".to_string()),
    ];
    for p in candidates.into_iter().flatten() {
        let ok = Command::new(&p)
            .args(["-c", "import gguf, llama_cpp"])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            return Some(p);
        }
    }
    let required = std::env::var("GRPO_REQUIRE_GGUF").is_ok_and(|v| v == "1");
    assert!(
        !required,
        "GRPO_REQUIRE_GGUF=1 but no Python with gguf and llama-cpp-python (set GRPO_TEST_PYTHON)"
    );
    eprintln!(
        "skipped: no Python with gguf and llama-cpp-python, so llama.cpp did not read grpo's GGUF \
         (set GRPO_TEST_PYTHON)"
    );
    None
}

/// `tests/tools/check_gguf.py` on `file`: the gguf package's view of it, llama.cpp's greedy
/// tokens after `prompt` and its logits with `forced` fed instead (`what` names the case).
fn check_gguf(
    py: &str,
    file: &Path,
    prompt: &[u32],
    forced: &[u32],
    what: &str,
) -> serde_json::Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/tools/check_gguf.py");
    let run = Command::new(py)
        .arg(&script)
        .arg(file)
        .arg(serde_json::to_string(prompt).unwrap())
        .arg(N.to_string())
        .arg(serde_json::to_string(forced).unwrap())
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{what}: check_gguf.py failed (CHECK_GGUF_VERBOSE=1 shows llama.cpp's log):\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    serde_json::from_slice(&run.stdout).unwrap()
}

#[test]
fn llama_cpp_decodes_grpo_gguf_exports_as_grpo_does() {
    let Some(py) = python() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let hf = tiny(&tmp.path().join("hf"));
    let prompt = prompt(&hf);
    for (ty, matrix_type) in [
        (GgufType::F32, "F32"),
        (GgufType::F16, "F16"),
        (GgufType::Q8_0, "Q8_0"),
    ] {
        let out = tmp.path().join(format!("tiny-{ty:?}.gguf"));
        let g = export(&tmp.path().join("hf"), &out, ty);
        // grpo's greedy tokens on its own load of the file, and the logits behind them.
        let model = g.build().unwrap();
        let want = greedy(&model, &prompt, N);
        let want_logits = step_logits(&model, &prompt, &want);
        let v = check_gguf(&py, &out, &prompt, &want, &format!("{ty:?}"));

        // The gguf package: a v3 llama file with llama.cpp's names, shapes and types, whose
        // data dequantizes to what grpo loaded (sums: the Q/K row order does not change them).
        assert_eq!(v["version"], 3);
        assert_eq!(v["arch"], "llama");
        let tensors = v["tensors"].as_object().unwrap();
        assert_eq!(tensors.len(), 2 + 9 * g.config.num_layers, "{tensors:?}");
        for (name, t) in tensors {
            let matrix = t["shape"].as_array().unwrap().len() == 2;
            let want_type = if matrix { matrix_type } else { "F32" };
            assert_eq!(t["type"], want_type, "{ty:?}: {name}");
            let (hf_name, _) = grpo_models::weights::hf_name(g.config.arch, name).unwrap();
            let mine: f64 = g.tensors[&hf_name]
                .to_dtype(DType::F64)
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar()
                .unwrap();
            let theirs = t["sum"].as_f64().unwrap();
            assert!(
                (mine - theirs).abs() < 1e-6 * (1.0 + mine.abs()),
                "{ty:?}: {name}: {mine} vs {theirs}"
            );
        }
        assert_eq!(
            tensors["token_embd.weight"]["shape"],
            serde_json::json!([g.config.hidden_size, g.config.vocab_size])
        );

        // llama.cpp's logits on grpo's tokens, step by step, within a tolerance of grpo's:
        // llama.cpp keeps its KV cache in f16 (0.1% of the logits' range here, 0.3% allowed);
        // with q8_0 weights ggml also rounds the activations to q8_0 blocks before each
        // product, which moves the logits about as much as quantizing the weights did (2.2% of
        // their range at hidden size 32, where few terms average it out; 4% allowed).
        let forced = v["forced_logits"].as_array().unwrap();
        let spread = want_logits[0].iter().fold(0f32, |m, x| m.max(x.abs()));
        let tolerance = spread
            * match ty {
                GgufType::Q8_0 => 4e-2,
                _ => 3e-3,
            };
        let moved: Vec<f32> = forced
            .iter()
            .zip(&want_logits)
            .map(|(l, w)| {
                l.as_array()
                    .unwrap()
                    .iter()
                    .zip(w)
                    .map(|(a, b)| (a.as_f64().unwrap() as f32 - b).abs())
                    .fold(0f32, f32::max)
            })
            .collect();
        let worst = moved.iter().copied().fold(0f32, f32::max);
        assert!(
            worst < tolerance,
            "{ty:?}: llama.cpp's logits differ by {worst} (allowed {tolerance})"
        );

        // llama.cpp's own greedy tokens: grpo's, until a step where grpo's top two logits are
        // closer than the logits moved there, the only way greedy can go another way.
        let got: Vec<u32> = v["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        let same = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
        eprintln!(
            "{ty:?}: llama.cpp's logits on grpo's tokens differ by at most {worst} (max |logit| \
             {spread}); {same} of {N} greedy tokens the same: {got:?} vs {want:?}"
        );
        if same < N {
            let m = margin(&want_logits[same]);
            assert!(
                m <= 2.0 * moved[same],
                "{ty:?}: llama.cpp chose {} at step {same} where grpo's top two logits are {m} apart and moved by {}",
                got[same],
                moved[same]
            );
        }
        if ty != GgufType::Q8_0 {
            assert_eq!(got, want, "{ty:?}");
        }
    }
}

/// A random model of the tiny fixture `name`'s family and shape with SmolLM2's vocabulary and
/// tokenizer (llama.cpp needs one), its config changed by `patch` (`num_hidden_layers` may grow:
/// layer 0's tensors are repeated). Weights come from a fixed seed, norms near their identity.
fn random_family(name: &str, dir: &Path, patch: serde_json::Value) {
    use rand::{Rng, SeedableRng};
    let src = fixtures().join("tiny").join(name);
    std::fs::create_dir_all(dir).unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let vocab = 49152usize;
    cfg["vocab_size"] = vocab.into();
    for (k, v) in patch.as_object().unwrap() {
        cfg[k] = v.clone();
    }
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let layers = cfg["num_hidden_layers"]
        .as_u64()
        .or(cfg["n_layer"].as_u64())
        .unwrap() as usize;
    let gemma = name.starts_with("gemma");
    let fixture =
        candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut shapes: Vec<(String, Vec<usize>)> = vec![];
    for (k, t) in &fixture {
        let mut dims = t.dims().to_vec();
        if [
            "model.embed_tokens.weight",
            "lm_head.weight",
            "transformer.wte.weight",
        ]
        .contains(&k.as_str())
        {
            dims[0] = vocab;
        }
        if k == "lm_head.weight" && cfg["tie_word_embeddings"] == true {
            continue;
        }
        match k.split_once(".layers.0.").or(k.split_once(".h.0.")) {
            Some((pre, rest)) => {
                let sep = if k.contains(".layers.0.") {
                    "layers"
                } else {
                    "h"
                };
                for l in 0..layers {
                    shapes.push((format!("{pre}.{sep}.{l}.{rest}"), dims.clone()));
                }
            }
            None if k.contains(".layers.") || k.contains(".h.") => {}
            None => shapes.push((k.clone(), dims)),
        }
    }
    shapes.sort();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    let mut m = std::collections::HashMap::new();
    for (k, dims) in shapes {
        let (scale, offset) =
            if k.ends_with("norm.weight") || k.contains(".ln_") && k.ends_with(".weight") {
                (0.1, if gemma { 0.0 } else { 1.0 })
            } else if k.ends_with(".bias") || k.contains("wpe") {
                (0.1, 0.0)
            } else if k.contains("embed_tokens") || k.contains("wte") || k.contains("lm_head") {
                (0.5, 0.0)
            } else {
                (0.3 * (32.0f32 / 64.0).sqrt(), 0.0)
            };
        let n: usize = dims.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| offset + (rng.random::<f32>() - 0.5) * 2.0 * scale)
            .collect();
        m.insert(k, Tensor::from_vec(v, dims, &Device::Cpu).unwrap());
    }
    candle_core::safetensors::save(&m, dir.join("model.safetensors")).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixtures().join("smollm2").join(f), dir.join(f)).unwrap();
    }
}

/// llama.cpp runs every family grpo exports as grpo runs the file: random models of each tiny
/// fixture's shape (SmolLM2's tokenizer), in configurations llama.cpp can hold: Mistral's and
/// Phi-3's windows longer than the test (llama.cpp has none for them), Gemma 3 with six layers
/// (llama.cpp's fixed pattern: five sliding, one global). The windows that remain (Gemma's 4
/// tokens) are shorter than the prompt, so they are exercised; so are Gemma 2's soft-caps, the
/// query scale both Gemmas fold in, Phi-4-mini's partial rotary and LongRoPE short factors, Llama
/// 3's rope_freqs, Qwen2's biases and GPT-2's learned positions.
#[test]
fn llama_cpp_runs_every_family_as_grpo_does() {
    let Some(py) = python() else { return };
    let tmp = tempfile::tempdir().unwrap();
    // Gemma 3 in llama.cpp's fixed pattern: five sliding layers, then a global one.
    let gemma3_six_layers = serde_json::json!({
        "num_hidden_layers": 6,
        "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention",
            "sliding_attention", "sliding_attention", "full_attention"],
        "sliding_window_pattern": 6, "_sliding_window_pattern": 6,
    });
    let families = [
        ("llama3", "llama", serde_json::json!({})),
        ("qwen2", "qwen2", serde_json::json!({})),
        ("qwen3", "qwen3", serde_json::json!({})),
        (
            "mistral",
            "llama",
            serde_json::json!({"sliding_window": 4096}),
        ),
        ("phi3", "phi3", serde_json::json!({"sliding_window": null})),
        // llama.cpp takes the long factors when its context (which it rounds up to 256) is
        // past the original length; within it, both run the short ones.
        (
            "phi4mini",
            "phi3",
            serde_json::json!({
                "max_position_embeddings": 1024, "original_max_position_embeddings": 256,
                "rope_parameters": {
                    "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
                    "short_factor": [1.0, 1.25, 1.5, 2.0, 3.0, 5.0],
                    "original_max_position_embeddings": 256, "partial_rotary_factor": 0.75,
                    "rope_theta": 10000.0, "rope_type": "longrope",
                },
            }),
        ),
        (
            "gemma2",
            "gemma2",
            serde_json::json!({"tie_word_embeddings": true}),
        ),
        ("gemma3", "gemma3", gemma3_six_layers.clone()),
        // Gemma 3 4B and larger: linear RoPE scaling on the global layer.
        ("gemma3_linear", "gemma3", gemma3_six_layers.clone()),
        ("gpt2", "gpt2", serde_json::json!({})),
    ];
    for (i, (name, arch, patch)) in families.into_iter().enumerate() {
        // Not named after the family: llama.cpp gives a model *named* like Phi-3 Phi-3's special
        // tokens, which SmolLM2's tokenizer lacks.
        let dir = tmp.path().join(format!("model{i}"));
        random_family(name, &dir, patch);
        let out = tmp.path().join(format!("model{i}.gguf"));
        let (_, summary) = export_gguf(&dir, &out, None, GgufType::F32).unwrap();
        assert!(
            summary.warnings.is_empty(),
            "{name}: {:?}",
            summary.warnings
        );
        let g = load_model(&ModelSource::Gguf(out.clone()), DType::F32, &Device::Cpu).unwrap();
        let prompt = prompt(&g);
        let model = g.build().unwrap();
        let want = greedy(&model, &prompt, N);
        let want_logits = step_logits(&model, &prompt, &want);
        // The file is the HF model: grpo's logits from either agree.
        let hf = load_model(&ModelSource::HfDir(dir.clone()), DType::F32, &Device::Cpu).unwrap();
        let hf_logits = step_logits(&hf.build().unwrap(), &prompt, &want);
        let d = want_logits
            .iter()
            .flatten()
            .zip(hf_logits.iter().flatten())
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            d < 1e-4,
            "{name}: the GGUF's logits differ from HF's by {d}"
        );

        let v = check_gguf(&py, &out, &prompt, &want, name);
        assert_eq!(v["arch"], arch, "{name}");
        for t in v["tensors"].as_object().unwrap().keys() {
            assert!(
                grpo_models::weights::hf_name(g.config.arch, t).is_some() || t.starts_with("rope_"),
                "{name}: {t}"
            );
        }
        // llama.cpp's logits on grpo's tokens: within its f16 KV cache's rounding (0.3% of the
        // logits' range allowed, as for Llama above).
        let spread = want_logits[0].iter().fold(0f32, |m, x| m.max(x.abs()));
        let worst = v["forced_logits"]
            .as_array()
            .unwrap()
            .iter()
            .zip(&want_logits)
            .flat_map(|(l, w)| {
                l.as_array()
                    .unwrap()
                    .iter()
                    .zip(w)
                    .map(|(a, b)| (a.as_f64().unwrap() as f32 - b).abs())
                    .collect::<Vec<_>>()
            })
            .fold(0f32, f32::max);
        let got: Vec<u32> = v["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        eprintln!(
            "{name}: llama.cpp's logits differ from grpo's by at most {worst} (max |logit| {spread}); tokens {got:?} vs {want:?}"
        );
        assert!(
            worst < 3e-3 * spread,
            "{name}: llama.cpp's logits differ by {worst} (max |logit| {spread})"
        );
        assert_eq!(got, want, "{name}");
    }
}
