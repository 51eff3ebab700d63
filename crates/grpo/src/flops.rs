//! Model FLOPs of the update: what its throughput (`time/update_tflops`) and its model FLOPs
//! utilization (`time/update_mfu`, against the card's dense bf16 rate) count.
//!
//! The count is the work the model needs for the rows it trains on, as MFU defines it (PaLM,
//! nanoGPT): each row is its prompt and completion, as a row per completion computes it (TRL's
//! way, and grpo's on a GPU); every matmul weight costs 2 FLOPs a token forward, 2 for the
//! input's gradient and, when it trains, 2 for its own gradient; causal attention 4 FLOPs per
//! (query, key) pair and head dimension forward, twice that backward. Implementation details do
//! not count: recomputation (gradient checkpointing) adds none, and the work saved by computing a
//! group's prompt once (grpo's packing on the CPU) is not taken off. Norms, the embedding lookup
//! and LoRA's own small matmuls are left out.

use grpo_models::models::ModelConfig;

/// What a training pass over rows computes.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PassWork {
    /// Tokens through the blocks: each row's prompt and completion.
    pub tokens: u64,
    /// Rows through the LM head: the completion tokens (each predicts the next).
    pub head_rows: u64,
    /// (query, key) pairs causal attention scores: T (T + 1) / 2 for a row of T tokens.
    pub attn_pairs: u64,
}

/// The [`PassWork`] of rows `prompts[i] ++ completions[i]`.
pub fn pass_work(prompts: &[&[u32]], completions: &[&[u32]]) -> PassWork {
    let mut w = PassWork::default();
    for (p, c) in prompts.iter().zip(completions) {
        let t = (p.len() + c.len()) as u64;
        w.tokens += t;
        w.head_rows += c.len() as u64;
        w.attn_pairs += t * (t + 1) / 2;
    }
    w
}

/// What sizes a causal LM's FLOPs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FlopShape {
    /// The blocks' matmul weights, all layers.
    pub block_params: f64,
    /// The LM head's (vocabulary x hidden).
    pub head_params: f64,
    /// Layers x query heads x head dimension.
    pub attn_width: f64,
    /// The base weights train (full fine-tuning): their gradients cost a third matmul. Not with
    /// LoRA, whose frozen base only passes gradients through.
    pub trains_base: bool,
}

impl FlopShape {
    /// The shape of `cfg`'s model.
    pub fn of(cfg: &ModelConfig, trains_base: bool) -> Self {
        let head = (cfg.vocab_size * cfg.hidden_size) as f64;
        FlopShape {
            block_params: cfg.approx_params() as f64 - head,
            head_params: head,
            attn_width: (cfg.num_layers * cfg.num_heads * cfg.head_dim) as f64,
            trains_base,
        }
    }

    /// Forward + backward FLOPs of a training pass doing `w`.
    pub fn pass(&self, w: &PassWork) -> f64 {
        let per_weight = if self.trains_base { 6.0 } else { 4.0 };
        per_weight * (self.block_params * w.tokens as f64 + self.head_params * w.head_rows as f64)
            + 12.0 * self.attn_width * w.attn_pairs as f64
    }
}

/// TFLOP/s of `flops` done in `seconds`, and their share of `peak_tflops` where the card's rate
/// is known: `(tflops, mfu)`; `None` without work or time.
pub fn throughput(
    flops: f64,
    seconds: f64,
    peak_tflops: Option<f64>,
) -> Option<(f64, Option<f64>)> {
    if flops <= 0.0 || seconds <= 0.0 || !flops.is_finite() || !seconds.is_finite() {
        return None;
    }
    let tflops = flops / seconds / 1e12;
    Some((tflops, peak_tflops.filter(|p| *p > 0.0).map(|p| tflops / p)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Counted by hand: two rows of one prompt (each counts it), and a row of another.
    #[test]
    fn pass_work_counts_each_row_whole() {
        let (p1, p2) = ([1u32, 2, 3], [4u32, 5]);
        let (c1, c2, c3) = ([7u32, 8], [9u32], [6u32, 6, 6]);
        let w = pass_work(&[&p1, &p1, &p2], &[&c1, &c2, &c3]);
        // Tokens: 3 + 2, 3 + 1, 2 + 3.
        assert_eq!(w.tokens, 14);
        assert_eq!(w.head_rows, 6);
        // Pairs: rows of 5, 4 and 5 tokens: 15 + 10 + 15.
        assert_eq!(w.attn_pairs, 40);
        assert_eq!(pass_work(&[], &[]), PassWork::default());
    }

    /// SmolLM2-135M's shape: 6 FLOPs a parameter a token, plus attention; LoRA drops the base
    /// weights' gradients; the throughput and MFU divide as they say.
    #[test]
    fn flops_of_a_pass_follow_the_model_and_the_training_kind() {
        let cfg = ModelConfig::from_hf_json(
            r#"{"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
                "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
                "tie_word_embeddings": true}"#,
            std::path::Path::new("config.json"),
        )
        .unwrap();
        let full = FlopShape::of(&cfg, true);
        // 30 x (576 x 576 x 2 + 2 x 576 x 192 + 3 x 576 x 1536) and 49,152 x 576.
        assert_eq!(
            full.block_params,
            30.0 * (663_552.0 + 221_184.0 + 2_654_208.0)
        );
        assert_eq!(full.head_params, 28_311_552.0);
        assert_eq!(full.attn_width, 30.0 * 9.0 * 64.0);
        let w = PassWork {
            tokens: 1000,
            head_rows: 800,
            attn_pairs: 50_000,
        };
        let want = 6.0 * (full.block_params * 1000.0 + full.head_params * 800.0)
            + 12.0 * 17_280.0 * 50_000.0;
        assert_eq!(full.pass(&w), want);
        let lora = FlopShape::of(&cfg, false);
        let lora_want = 4.0 * (lora.block_params * 1000.0 + lora.head_params * 800.0)
            + 12.0 * 17_280.0 * 50_000.0;
        assert_eq!(lora.pass(&w), lora_want);
        assert!(lora.pass(&w) < full.pass(&w));

        let (t, mfu) = throughput(4e14, 2.0, Some(989.4)).unwrap();
        assert_eq!(t, 200.0);
        assert!((mfu.unwrap() - 200.0 / 989.4).abs() < 1e-12);
        assert_eq!(throughput(4e14, 2.0, None), Some((200.0, None)));
        assert_eq!(throughput(0.0, 2.0, Some(989.4)), None);
        assert_eq!(throughput(1e12, 0.0, None), None);
    }
}
