//! LoRA and QLoRA against peft: forward and adapter gradients on tiny models, PEFT's file
//! format both ways, merging, and QLoRA's backward through the quantized base.
//! Fixtures: `scripts/make_lora_fixtures.py` (peft 0.21.2, transformers 5.23, torch 2.15).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor, Var, D};
use grpo::peft;
use grpo_models::hub::ModelSource;
use grpo_models::models::{CausalLm, Mode, QuantType, SeqBatch};
use grpo_models::weights::load_model;

#[path = "support/diff.rs"]
mod diff;
use diff::{max_abs, max_diff};
#[path = "support/rerun.rs"]
mod rerun;

const CASES: &[(&str, &str)] = &[
    ("llama_qv", "llama"),
    ("qwen2_all_rslora", "qwen2"),
    ("gpt2_c_attn", "gpt2"),
];

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// Mean log-prob of each next token (the fixture script's loss), and the logits.
fn loss_and_logits(model: &CausalLm, ids: &[Vec<u32>], mode: Mode) -> (Tensor, Tensor) {
    let batch = SeqBatch::right_padded(ids, 0, &Device::Cpu).unwrap();
    let (b, t) = batch.dims();
    let h = model.forward_hidden(&batch, mode).unwrap(); // [B, T, H]
    let hd = h.dim(2).unwrap();
    let logits = model
        .head_logits(&h.reshape((b * t, hd)).unwrap())
        .unwrap()
        .reshape((b, t, ()))
        .unwrap(); // [B, T, V]
    let logp =
        candle_nn::ops::log_softmax(&logits.narrow(1, 0, t - 1).unwrap(), D::Minus1).unwrap();
    let next: Vec<u32> = ids.iter().flat_map(|r| r[1..].to_vec()).collect();
    let next = Tensor::from_vec(next, (b, t - 1, 1), &Device::Cpu).unwrap();
    let tok = logp.gather(&next, D::Minus1).unwrap(); // [B, T-1, 1]
    (tok.mean_all().unwrap(), logits)
}

struct Case {
    base: grpo_models::weights::LoadedModel,
    adapter: peft::LoadedAdapter,
    expected: HashMap<String, Tensor>,
    ids: Vec<Vec<u32>>,
}

fn load_case(case: &str, base: &str) -> Case {
    let dev = Device::Cpu;
    let base = load_model(
        &ModelSource::HfDir(fixtures().join("tiny").join(base)),
        DType::F32,
        &dev,
    )
    .unwrap();
    let dir = fixtures().join("lora").join(case);
    let adapter = peft::load_peft(&dir, &dev).unwrap();
    let expected = candle_core::safetensors::load(dir.join("expected.safetensors"), &dev).unwrap();
    let ids: Vec<Vec<u32>> = expected["input_ids"]
        .to_vec2::<i64>()
        .unwrap()
        .into_iter()
        .map(|r| r.into_iter().map(|x| x as u32).collect())
        .collect();
    Case {
        base,
        adapter,
        expected,
        ids,
    }
}

/// The adapter tensors as `Var`s, and adapters over them (tracked: gradients reach the vars).
fn tracked_adapters(
    a: &peft::LoadedAdapter,
) -> (
    Vec<(String, Var)>,
    HashMap<String, grpo_models::models::LoraAdapter>,
) {
    let vars: Vec<(String, Var)> = a
        .tensors
        .iter()
        .map(|(n, t)| (n.clone(), Var::from_tensor(t).unwrap()))
        .collect();
    let tracked: Vec<(String, Tensor)> = vars
        .iter()
        .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
        .collect();
    let adapters = peft::adapters(&tracked, &a.config, None).unwrap();
    (vars, adapters)
}

#[test]
fn forward_and_adapter_gradients_match_peft() {
    for &(case, base) in CASES {
        let c = load_case(case, base);
        let (vars, adapters) = tracked_adapters(&c.adapter);
        let mut model = c.base.build().unwrap();
        assert_eq!(model.set_lora(&adapters).unwrap(), adapters.len());
        let (loss, logits) = loss_and_logits(&model, &c.ids, Mode::Train);
        let want_loss = c.expected["loss"].to_vec1::<f32>().unwrap()[0];
        let got_loss = loss.to_scalar::<f32>().unwrap();
        assert!(
            (got_loss - want_loss).abs() < 1e-5,
            "{case}: loss {got_loss} vs {want_loss}"
        );
        // 1e-5 relative to the logits' scale: these reach about 6, where one f32 ulp is 4.8e-7
        // and the summation order of any attention kernel moves the result by ~20 ulps.
        let d = max_diff(&logits, &c.expected["logits"]);
        let scale = max_abs(&c.expected["logits"]).max(1.0);
        assert!(
            d < 1e-5 * scale,
            "{case}: logits differ by {d} (scale {scale})"
        );
        // The decoding-path kernels (fused, no backward) agree too.
        let (_, infer) = loss_and_logits(&model, &c.ids, Mode::Infer);
        let d = max_diff(&infer, &c.expected["logits"]);
        assert!(d < 1e-4, "{case}: inference logits differ by {d}");

        let grads = loss.backward().unwrap();
        let mut n = 0;
        for (name, v) in &vars {
            let want = &c.expected[&format!("grad.{name}")];
            let got = grads
                .get(v.as_tensor())
                .unwrap_or_else(|| panic!("{case}: no gradient for {name}"));
            let d = max_diff(got, want);
            assert!(
                d < 1e-5 * max_abs(want).max(1.0),
                "{case}: {name} gradient differs by {d} (max {})",
                max_abs(want)
            );
            assert!(max_abs(got) > 0.0, "{case}: {name} gradient is zero");
            n += 1;
        }
        assert_eq!(
            n,
            c.expected.keys().filter(|k| k.starts_with("grad.")).count()
        );
    }
}

#[test]
fn merging_matches_peft_merge_and_unload() {
    for &(case, base) in CASES {
        let c = load_case(case, base);
        let mut tensors = c.base.tensors.clone();
        let adapters = peft::adapters(&c.adapter.tensors, &c.adapter.config, None).unwrap();
        peft::merge_into(&mut tensors, &c.base.config, &adapters).unwrap();
        let mut n = 0;
        for (k, want) in &c.expected {
            let Some(name) = k.strip_prefix("merged.") else {
                continue;
            };
            let got = &tensors[name];
            let d = max_diff(got, want);
            assert!(d < 1e-6, "{case}: merged {name} differs by {d}");
            n += 1;
        }
        assert!(n > 0);
        // Merging into a built model (the sampler's path) gives the adapted logits too, and
        // leaves the model it was cloned from untouched.
        let base_model = c.base.build().unwrap();
        let mut m = base_model.clone();
        assert_eq!(m.merge_lora(&adapters).unwrap(), adapters.len());
        let (_, logits) = loss_and_logits(&m, &c.ids, Mode::Infer);
        let d = max_diff(&logits, &c.expected["logits"]);
        assert!(d < 1e-4, "{case}: merge_lora logits differ by {d}");
        let (_, plain) = loss_and_logits(&base_model, &c.ids, Mode::Infer);
        assert!(
            max_diff(&plain, &c.expected["logits"]) > 1e-3,
            "{case}: base changed"
        );
        // On a quantized base the adapters are attached instead: no projection is replaced by
        // a dense copy (what `grpo plan` counts as QLoRA's sampler copy), and the model is the
        // quantized base with the adapters set.
        let mut q = base_model.clone();
        q.quantize_projections(QuantType::Q8_0).unwrap();
        let mut attached = q.clone();
        let held = q.quantized_bytes();
        assert_eq!(q.merge_lora(&adapters).unwrap(), 0);
        assert_eq!(
            q.quantized_bytes(),
            held,
            "{case}: a quantized projection was replaced"
        );
        attached.set_lora(&adapters).unwrap();
        let (_, a) = loss_and_logits(&q, &c.ids, Mode::Infer);
        let (_, b) = loss_and_logits(&attached, &c.ids, Mode::Infer);
        assert_eq!(
            max_diff(&a, &b),
            0.0,
            "{case}: merging into a quantized base"
        );
        // q8_0 moves the logits by ~0.1-0.3 here, the adapters by ~2-3.
        let (off, adapted) = (
            max_diff(&plain, &c.expected["logits"]),
            max_diff(&a, &c.expected["logits"]),
        );
        assert!(
            adapted < 0.2 * off,
            "{case}: adapters lost ({adapted} vs {off})"
        );
        // The merged model alone gives the adapted logits.
        let merged =
            CausalLm::from_tensors(&c.base.config, tensors, DType::F32, &Device::Cpu).unwrap();
        let (_, logits) = loss_and_logits(&merged, &c.ids, Mode::Infer);
        let d = max_diff(&logits, &c.expected["logits"]);
        assert!(d < 1e-4, "{case}: merged logits differ by {d}");
    }
}

/// grpo's adapter files and merged export: read back here; with GRPO_LORA_CHECK_DIR set they
/// are also left there for `scripts/make_lora_fixtures.py --check DIR` (peft / transformers).
#[test]
fn saved_adapters_and_merged_exports_load_back() {
    let tmp = tempfile::tempdir().unwrap();
    let root = std::env::var_os("GRPO_LORA_CHECK_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| tmp.path().to_path_buf());
    for &(case, base) in CASES {
        let c = load_case(case, base);
        let adir = root.join(case).join("adapter");
        let _ = std::fs::remove_dir_all(&adir);
        let base_path = fixtures().join("tiny").join(base);
        peft::save_peft(
            &adir,
            &c.adapter.config,
            c.base.config.arch,
            &base_path.display().to_string(),
            &c.adapter.tensors,
        )
        .unwrap();
        // Same keys, shapes and values as peft's own file; same options.
        let back = peft::load_peft(&adir, &Device::Cpu).unwrap();
        assert_eq!(back.config, c.adapter.config);
        assert_eq!(back.tensors.len(), c.adapter.tensors.len());
        for ((n1, t1), (n2, t2)) in back.tensors.iter().zip(&c.adapter.tensors) {
            assert_eq!(n1, n2);
            assert_eq!(max_diff(t1, t2), 0.0);
        }
        // Loading for inference gives the adapted logits.
        let (model, _) = grpo::export::load_for_inference(
            Some(&adir.display().to_string()),
            None,
            DType::F32,
            &Device::Cpu,
        )
        .unwrap();
        let (_, logits) = loss_and_logits(&model, &c.ids, Mode::Infer);
        assert!(max_diff(&logits, &c.expected["logits"]) < 1e-4);
        // `grpo export --merge`: HF weights that give the same logits with no adapter.
        let mdir = root.join(case).join("merged");
        let _ = std::fs::remove_dir_all(&mdir);
        let s = grpo::export::export(&adir, &mdir, true, None, &Default::default()).unwrap();
        assert_eq!(s.merged_adapters, c.adapter.tensors.len() / 2);
        let m = load_model(&ModelSource::HfDir(mdir.clone()), DType::F32, &Device::Cpu).unwrap();
        let (_, logits) = loss_and_logits(&m.build().unwrap(), &c.ids, Mode::Infer);
        let d = max_diff(&logits, &c.expected["logits"]);
        assert!(d < 1e-4, "{case}: exported merged logits differ by {d}");
        // Without --merge the adapter files are copied; an occupied output is refused.
        let e = grpo::export::export(&adir, &mdir, true, None, &Default::default()).unwrap_err();
        assert!(e.to_string().contains("already holds a model"), "{e}");
        // bf16 in shards of at most 20 kB with an index, as transformers writes large models:
        // grpo loads it back, every tensor the merged f32 weights rounded to bf16.
        let bdir = root.join(case).join("merged-bf16");
        let _ = std::fs::remove_dir_all(&bdir);
        let opts = grpo::export::ExportOptions {
            dtype: DType::BF16,
            max_shard_bytes: Some(20_000),
        };
        grpo::export::export(&adir, &bdir, true, None, &opts).unwrap();
        let index: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(bdir.join("model.safetensors.index.json")).unwrap(),
        )
        .unwrap();
        let shards: std::collections::BTreeSet<&str> = index["weight_map"]
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_str().unwrap())
            .collect();
        assert!(shards.len() > 1, "{case}: {shards:?}");
        let cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(bdir.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(cfg["torch_dtype"], "bfloat16");
        let b = load_model(&ModelSource::HfDir(bdir.clone()), DType::F32, &Device::Cpu).unwrap();
        for (k, t) in &m.tensors {
            let want = t
                .to_dtype(DType::BF16)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            assert_eq!(max_diff(&b.tensors[k], &want), 0.0, "{case}: {k}");
        }
    }
}

/// `grpo export --format gguf` of a LoRA checkpoint: the adapters merged into the base and
/// written as one GGUF file (f32), which grpo loads back to peft's adapted logits; Llama (Q/K
/// rows permuted for llama.cpp), Qwen2 (biases) and GPT-2 (Conv1D weights transposed).
#[test]
fn merged_gguf_exports_give_the_adapted_logits() {
    let tmp = tempfile::tempdir().unwrap();
    for &(case, base) in CASES {
        let c = load_case(case, base);
        let adir = tmp.path().join(case);
        let base_path = fixtures().join("tiny").join(base);
        peft::save_peft(
            &adir,
            &c.adapter.config,
            c.base.config.arch,
            &base_path.display().to_string(),
            &c.adapter.tensors,
        )
        .unwrap();
        let out = tmp.path().join(format!("{case}.gguf"));
        let r =
            grpo::export::export_gguf(&adir, &out, None, grpo_models::gguf_write::GgufType::F32);
        let (s, g) = r.unwrap();
        assert_eq!(s.merged_adapters, c.adapter.tensors.len() / 2);
        assert!(!g.has_tokenizer);
        let m = load_model(&ModelSource::Gguf(out), DType::F32, &Device::Cpu).unwrap();
        let (_, logits) = loss_and_logits(&m.build().unwrap(), &c.ids, Mode::Infer);
        let d = max_diff(&logits, &c.expected["logits"]);
        assert!(d < 1e-4, "{case}: merged GGUF logits differ by {d}");
    }
}

/// The peft check's record: grpo's adapters loaded by peft, and grpo's merged export loaded by
/// transformers, give the fixture logits (run by hand; see the script).
#[test]
fn peft_and_transformers_accepted_grpo_files() {
    let text = std::fs::read_to_string(fixtures().join("lora/grpo_check.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    for &(case, _) in CASES {
        for k in [
            "peft_loads_grpo_adapter_max_logit_diff",
            "transformers_loads_grpo_merged_max_logit_diff",
        ] {
            let d = v[case][k].as_f64().unwrap_or(f64::NAN);
            assert!(d < 1e-4, "{case}: {k} = {d}");
        }
    }
}

/// QLoRA: gradients through the quantized base (our backward for the quantized matmul) equal
/// those through the dequantized f32 weights, for adapters in every layer.
#[test]
fn qlora_gradients_match_the_dequantized_base() {
    let c = load_case("qwen2_all_rslora", "qwen2");
    let dev = Device::Cpu;
    for kind in [
        QuantType::Q4_0,
        QuantType::Q4_1,
        QuantType::Q8_0,
        QuantType::Nf4,
    ] {
        let mut quant = c.base.build().unwrap();
        quant.quantize_projections(kind).unwrap();
        // The same base with each projection weight replaced by its dequantized value.
        let mut deq = c.base.tensors.clone();
        for (module, _, _) in quant.projection_shapes().unwrap() {
            let key = format!("{module}.weight");
            let w = &deq[&key];
            let d = grpo_models::models::QuantProj::quantize(w, kind)
                .unwrap()
                .dequantize()
                .unwrap();
            assert!(max_diff(&d, w) > 0.0, "quantization changed nothing?");
            deq.insert(key, d);
        }
        let deq = CausalLm::from_tensors(&c.base.config, deq, DType::F32, &dev).unwrap();
        let grads_of = |base: &CausalLm| {
            let (vars, adapters) = tracked_adapters(&c.adapter);
            let mut m = base.clone();
            m.set_lora(&adapters).unwrap();
            let (loss, _) = loss_and_logits(&m, &c.ids, Mode::Train);
            let g = loss.backward().unwrap();
            vars.iter()
                .map(|(n, v)| (n.clone(), g.get(v.as_tensor()).unwrap().clone()))
                .collect::<Vec<_>>()
        };
        let gq = grads_of(&quant);
        let gd = grads_of(&deq);
        for ((n, a), (_, b)) in gq.iter().zip(&gd) {
            let d = max_diff(a, b);
            assert!(
                d < 1e-5 * max_abs(b).max(1.0),
                "{kind:?} {n}: {d} (max {})",
                max_abs(b)
            );
            // Layer 0's adapters get gradients only through the quantized layers above them.
            assert!(max_abs(a) > 0.0, "{kind:?} {n}: zero gradient");
        }
        assert!(quant.quantized_bytes() > 0);
    }
}

/// Files that load everywhere, checked in committed-fixture style: `tests/fixtures/interop` holds
/// an `all-linear` adapter and its merged bf16 sharded export as grpo writes them, and what peft
/// and transformers made of them (`scripts/check_interop.py`). Here grpo writes both again (they
/// must be the bytes that were checked; GRPO_BLESS=1 rewrites them, then rerun the script), and
/// its own adapted model and export give the tokens and logits peft and transformers gave.
#[test]
fn peft_and_transformers_load_what_grpo_writes() {
    let c = load_case("qwen2_all_rslora", "qwen2");
    let dir = fixtures().join("interop");
    let tmp = tempfile::tempdir().unwrap();
    let cfg = peft::LoraConfig {
        target_modules: vec!["all-linear".into()],
        ..c.adapter.config.clone()
    };
    let adapter = tmp.path().join("adapter");
    peft::save_peft(
        &adapter,
        &cfg,
        c.base.config.arch,
        "tests/fixtures/tiny/qwen2",
        &c.adapter.tensors,
    )
    .unwrap();
    let merged = tmp.path().join("merged_bf16");
    let opts = grpo::export::ExportOptions {
        dtype: DType::BF16,
        max_shard_bytes: Some(80_000),
    };
    let base = fixtures().join("tiny/qwen2").display().to_string();
    grpo::export::export(&adapter, &merged, true, Some(&base), &opts).unwrap();
    let files = |d: &Path| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    for sub in ["adapter", "merged_bf16"] {
        let (new, old) = (tmp.path().join(sub), dir.join(sub));
        if std::env::var_os("GRPO_BLESS").is_some() {
            let _ = std::fs::remove_dir_all(&old);
            std::fs::create_dir_all(&old).unwrap();
            for f in files(&new) {
                std::fs::copy(new.join(&f), old.join(&f)).unwrap();
            }
            continue;
        }
        assert_eq!(
            files(&new),
            files(&old),
            "{sub}: the files grpo writes changed"
        );
        for f in files(&new) {
            assert!(
                std::fs::read(new.join(&f)).unwrap() == std::fs::read(old.join(&f)).unwrap(),
                "{sub}/{f} is no longer what peft/transformers checked: GRPO_BLESS=1, then \
                 scripts/check_interop.py"
            );
        }
    }
    let want: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    // peft expanded `all-linear` to the modules grpo puts adapters on.
    let model = c.base.build().unwrap();
    let mut ours: Vec<String> = peft::targeted(&model, &cfg)
        .unwrap()
        .into_iter()
        .map(|(m, _, _)| m)
        .collect();
    ours.sort();
    let theirs: Vec<String> = want["peft_lora_modules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m.as_str().unwrap().to_string())
        .collect();
    assert_eq!(ours, theirs);
    // peft's adapted logits; transformers' and peft's greedy tokens.
    let logits =
        candle_core::safetensors::load(dir.join("expected.safetensors"), &Device::Cpu).unwrap();
    let ids: Vec<u32> = want["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    let (adapted, _) = grpo::export::load_for_inference(
        Some(&dir.join("adapter").display().to_string()),
        Some(&base),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let (_, ours) = loss_and_logits(&adapted, std::slice::from_ref(&ids), Mode::Infer);
    let d = max_diff(&ours.squeeze(0).unwrap(), &logits["peft_logits"]);
    assert!(
        d < 1e-4 * max_abs(&logits["peft_logits"]).max(1.0),
        "peft logits differ by {d}"
    );
    let exported = load_model(
        &ModelSource::HfDir(dir.join("merged_bf16")),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap()
    .build()
    .unwrap();
    let greedy = |m: &CausalLm| -> Vec<u32> {
        let params = grpo_models::sampler::SamplingParams {
            max_new_tokens: 8,
            min_new_tokens: 8,
            temperature: 0.0,
            ..Default::default()
        };
        let p = [grpo_models::sampler::PromptInput {
            ids: ids.clone(),
            seed: 0,
        }];
        grpo_models::sampler::generate(m, None, &p, 1, &params)
            .unwrap()
            .0[0][0]
            .ids
            .clone()
    };
    let tokens = |k: &str| -> Vec<u32> {
        want[k]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    assert_eq!(greedy(&exported), tokens("transformers_bf16_export_greedy"));
    assert_eq!(greedy(&adapted), tokens("peft_greedy"));
}

/// This file's tests again, in a child process with ("GRPO_KERNELS", "portable").
#[test]
fn every_peft_test_passes_on_the_portable_kernels() {
    rerun::rerun_with(&[("GRPO_KERNELS", "portable")], 3);
}
