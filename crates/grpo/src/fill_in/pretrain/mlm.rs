//! `--objective mlm`: the masked-LM generator (a char-level or BPE BERT), trained to fill every
//! masked position at once.

use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;

use super::tokenizer::{char_tokenizer_config, tokenize_corpus, Objective};
use super::{
    cross_entropy, init_bert, read_corpus, run_steps, split_held_out, Params, PretrainOptions,
    PretrainStep, Staging, CLS, MASK, PAD, SEP,
};
use crate::fill_in::mask_example;
use crate::Result;
use grpo_models::models::masked_lm::{masked_lm_config, pad_batch, MaskedLm};
use grpo_models::seeding::mix_seed;

/// `config.json` of a BERT masked LM of these sizes.
pub fn bert_mlm_config(vocab: usize, o: &PretrainOptions) -> serde_json::Value {
    json!({
        "architectures": ["BertForMaskedLM"],
        "model_type": "bert",
        "vocab_size": vocab,
        "hidden_size": o.hidden,
        "num_hidden_layers": o.layers,
        "num_attention_heads": o.heads,
        "intermediate_size": 4 * o.hidden,
        "hidden_act": "gelu",
        "max_position_embeddings": o.max_len,
        "type_vocab_size": 2,
        "layer_norm_eps": 1e-12,
        "pad_token_id": PAD,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": true,
        "position_embedding_type": "absolute",
        "grpo_pretrain": {"objective": "mlm", "mask_ratio": [o.mask_ratio.0, o.mask_ratio.1]}
    })
}

/// A batch: right-padded masked rows, flat masked positions, their targets.
struct MaskedBatch {
    batch: grpo_models::models::encoder::EncoderBatch,
    positions: Vec<u32>,
    targets: Vec<u32>,
}

fn masked_batch(rows: &[(Vec<u32>, Vec<usize>, Vec<u32>)]) -> MaskedBatch {
    let ids: Vec<&[u32]> = rows.iter().map(|r| r.0.as_slice()).collect();
    let batch = pad_batch(&ids, PAD);
    let t = batch.ids.first().map_or(0, Vec::len);
    let mut positions = Vec::new();
    let mut targets = Vec::new();
    for (b, (_, pos, tgt)) in rows.iter().enumerate() {
        positions.extend(pos.iter().map(|&p| (b * t + p) as u32));
        targets.extend_from_slice(tgt);
    }
    MaskedBatch {
        batch,
        positions,
        targets,
    }
}

/// Mean cross-entropy [] and greedy accuracy of the model's fills of `mb`.
fn fill_loss(model: &MaskedLm, mb: &MaskedBatch) -> Result<(Tensor, f64)> {
    let logits = model.logits_at(&mb.batch, &mb.positions)?; // [N, V]
    cross_entropy(&logits, &mb.targets)
}

/// Trains a char-level BERT masked LM as `o` says and saves it in `o.out` (see [`Staging`]).
/// `on_step` receives every step's log line.
pub fn pretrain_mlm(
    o: &PretrainOptions,
    on_step: &mut dyn FnMut(&PretrainStep),
) -> Result<Vec<PretrainStep>> {
    o.validate()?;
    let staging = Staging::new(&o.out)?;
    let device = Device::Cpu;
    let lines = read_corpus(&o.data)?;
    let corpus = tokenize_corpus(o, &lines, Objective::Mlm)?;
    let (train, held) = split_held_out(corpus.rows);
    let specials = [PAD, 1, CLS, SEP, MASK];
    let mut eval_rng = ChaCha8Rng::seed_from_u64(mix_seed(o.seed, 1));
    let held: Vec<_> = held
        .iter()
        .map(|ids| mask_example(ids, o.mask_ratio, MASK, &specials, &mut eval_rng))
        .collect();

    let cfg_json = bert_mlm_config(corpus.vocab_size, o);
    staging.json("config.json", &cfg_json)?;
    staging.json("tokenizer.json", &corpus.tokenizer)?;
    staging.json("tokenizer_config.json", &char_tokenizer_config(o.max_len))?;
    let cfg = masked_lm_config(&staging.tmp)?;
    let mut params = Params::new(init_bert(&cfg_json, None, mix_seed(o.seed, 2), &device)?)?;
    let origin = staging.tmp.clone();
    let build = |p: &Params, track: bool| MaskedLm::from_tensors(&cfg, p.tensors(track), &origin);
    let mut rng = ChaCha8Rng::seed_from_u64(mix_seed(o.seed, 3));
    let log = run_steps(
        o,
        &mut params,
        &mut |_, p| {
            let rows: Vec<_> = (0..o.batch_size)
                .map(|_| {
                    let ids = &train[rng.random_range(0..train.len())];
                    mask_example(ids, o.mask_ratio, MASK, &specials, &mut rng)
                })
                .collect();
            Ok(fill_loss(&build(p, true)?, &masked_batch(&rows))?.0)
        },
        &mut |p| {
            let model = build(p, false)?;
            let (mut right, mut total) = (0.0, 0usize);
            for chunk in held.chunks(64) {
                let mb = masked_batch(chunk);
                let (_, acc) = fill_loss(&model, &mb)?;
                right += acc * mb.targets.len() as f64;
                total += mb.targets.len();
            }
            Ok(right / total.max(1) as f64)
        },
        on_step,
        &staging,
    )?;
    staging.finish(&params, &log)?;
    Ok(log)
}
