//! `--objective causal`: a small Llama causal LM trained by next-token prediction.

use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;

use super::tokenizer::{char_tokenizer_config, tokenize_corpus, Objective};
use super::{
    cross_entropy, normal_tensor, read_corpus, run_steps, split_held_out, Params, PretrainOptions,
    PretrainStep, Staging, CLS, PAD, SEP,
};
use crate::Result;
use grpo_models::seeding::mix_seed;

/// `config.json` of a Llama causal LM of these sizes (tied embeddings; `[CLS]` is BOS, `[SEP]`
/// EOS, `[PAD]` padding).
pub fn llama_config(vocab: usize, o: &PretrainOptions) -> serde_json::Value {
    json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": o.hidden,
        "intermediate_size": 4 * o.hidden,
        "num_hidden_layers": o.layers,
        "num_attention_heads": o.heads,
        "num_key_value_heads": o.heads,
        "hidden_act": "silu",
        "max_position_embeddings": o.max_len,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": true,
        "attention_bias": false,
        "mlp_bias": false,
        "bos_token_id": CLS,
        "eos_token_id": SEP,
        "pad_token_id": PAD,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
        "grpo_pretrain": {"objective": "causal"}
    })
}

/// Llama's initialisation: matrices and embeddings N(0, 0.02), RMSNorm weights 1. Sorted by
/// name.
fn init_llama(
    cfg: &serde_json::Value,
    seed: u64,
    device: &Device,
) -> Result<Vec<(String, Tensor)>> {
    let get = |k: &str| cfg[k].as_u64().unwrap_or(0) as usize;
    let (v, h, i) = (
        get("vocab_size"),
        get("hidden_size"),
        get("intermediate_size"),
    );
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut out = vec![(
        "model.embed_tokens.weight".to_string(),
        normal_tensor(&[v, h], &mut rng, device)?,
    )];
    for l in 0..get("num_hidden_layers") {
        let b = format!("model.layers.{l}");
        for (name, o_, i_) in [
            ("self_attn.q_proj", h, h),
            ("self_attn.k_proj", h, h),
            ("self_attn.v_proj", h, h),
            ("self_attn.o_proj", h, h),
            ("mlp.gate_proj", i, h),
            ("mlp.up_proj", i, h),
            ("mlp.down_proj", h, i),
        ] {
            out.push((
                format!("{b}.{name}.weight"),
                normal_tensor(&[o_, i_], &mut rng, device)?,
            ));
        }
        for n in ["input_layernorm", "post_attention_layernorm"] {
            out.push((
                format!("{b}.{n}.weight"),
                Tensor::ones(h, DType::F32, device)?,
            ));
        }
    }
    out.push((
        "model.norm.weight".into(),
        Tensor::ones(h, DType::F32, device)?,
    ));
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// Next-token cross-entropy [] and greedy next-token accuracy of `model` on `rows`
/// (`[CLS] tokens [SEP]`: every token after the first is a target).
fn next_token_loss(
    model: &grpo_models::models::CausalLm,
    rows: &[&Vec<u32>],
) -> Result<(Tensor, f64)> {
    let seqs: Vec<Vec<u32>> = rows.iter().map(|r| r.to_vec()).collect();
    let batch = grpo_models::models::SeqBatch::right_padded(&seqs, PAD, model.device())?;
    let h = model.forward_hidden(&batch, grpo_models::models::Mode::Train)?; // [B, T, H]
    let (b, t, hd) = h.dims3()?;
    let (mut idx, mut targets) = (Vec::new(), Vec::new());
    for (i, r) in seqs.iter().enumerate() {
        for p in 0..r.len().saturating_sub(1) {
            idx.push((i * t + p) as u32);
            targets.push(r[p + 1]);
        }
    }
    let idx = Tensor::from_vec(idx, targets.len(), model.device())?;
    let h = h.reshape((b * t, hd))?.index_select(&idx, 0)?; // [N, H]
    let logits = model.head_logits(&h)?; // [N, V]
    cross_entropy(&logits, &targets)
}

/// Trains a small Llama causal LM on the corpus (next-token prediction over `[CLS] line [SEP]`,
/// the tokenizer `o.tokenizer` says) and saves it in `o.out` as a `LlamaForCausalLM` directory
/// that `grpo train` and `grpo generate` load as any causal model. The held-out accuracy is
/// greedy next-token accuracy.
pub fn pretrain_causal(
    o: &PretrainOptions,
    on_step: &mut dyn FnMut(&PretrainStep),
) -> Result<Vec<PretrainStep>> {
    o.validate()?;
    let staging = Staging::new(&o.out)?;
    let device = Device::Cpu;
    let lines = read_corpus(&o.data)?;
    let corpus = tokenize_corpus(o, &lines, Objective::Causal)?;
    let (train, held) = split_held_out(corpus.rows);
    let cfg_json = llama_config(corpus.vocab_size, o);
    staging.json("config.json", &cfg_json)?;
    staging.json("tokenizer.json", &corpus.tokenizer)?;
    let mut tok_cfg = char_tokenizer_config(o.max_len);
    tok_cfg["bos_token"] = json!("[CLS]");
    tok_cfg["eos_token"] = json!("[SEP]");
    staging.json("tokenizer_config.json", &tok_cfg)?;
    staging.json(
        "generation_config.json",
        &json!({"bos_token_id": CLS, "eos_token_id": SEP, "pad_token_id": PAD}),
    )?;
    let cfg = grpo_models::models::ModelConfig::from_hf_file(&staging.tmp.join("config.json"))?;
    let mut params = Params::new(init_llama(&cfg_json, mix_seed(o.seed, 2), &device)?)?;
    let build = |p: &Params, track: bool| {
        grpo_models::models::CausalLm::from_tensors(&cfg, p.tensors(track), DType::F32, &device)
    };
    let mut rng = ChaCha8Rng::seed_from_u64(mix_seed(o.seed, 3));
    let log = run_steps(
        o,
        &mut params,
        &mut |_, p| {
            let rows: Vec<&Vec<u32>> = (0..o.batch_size)
                .map(|_| &train[rng.random_range(0..train.len())])
                .collect();
            Ok(next_token_loss(&build(p, true)?, &rows)?.0)
        },
        &mut |p| {
            let model = build(p, false)?;
            let (mut right, mut total) = (0.0, 0usize);
            for chunk in held.chunks(64) {
                let rows: Vec<&Vec<u32>> = chunk.iter().collect();
                let n: usize = rows.iter().map(|r| r.len() - 1).sum();
                right += next_token_loss(&model, &rows)?.1 * n as f64;
                total += n;
            }
            Ok(right / total.max(1) as f64)
        },
        on_step,
        &staging,
    )?;
    staging.finish(&params, &log)?;
    Ok(log)
}
