//! `--objective judge`: the classifier telling real lines from lines a generator filled, the
//! frozen judge of fill-in GRPO.

use std::path::Path;

use candle_core::{Device, Tensor, D};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;

use super::{
    init_bert, read_corpus, run_steps, split_held_out, Params, PretrainOptions, PretrainStep,
    Staging, PAD,
};
use crate::fill_in::{mask_example, FillInModel};
use crate::{Error, Result};
use grpo_models::files::write_file;
use grpo_models::models::encoder::{ClassifierNet, EncoderConfig, EncoderKind};
use grpo_models::models::masked_lm::{pad_batch, MlmTokenizer};
use grpo_models::seeding::mix_seed;
use grpo_models::tokenizer::Tokenizer;

/// The judge's labels, in id order.
pub const JUDGE_LABELS: [&str; 2] = ["filled", "real"];

/// Trains a judge: a BERT sequence classifier telling real lines of `o.data` (label `real`) from
/// lines whose masked characters `generator` filled (label `filled`; a fill that reproduces the
/// line exactly counts as real). Masks follow `o.mask_ratio`; fills are sampled at temperature 1.
/// The judge shares the generator's tokenizer; it is saved in `o.out` as a
/// `BertForSequenceClassification` directory that `kind = "classifier"` rewards load.
pub fn pretrain_judge(
    o: &PretrainOptions,
    generator: &Path,
    on_step: &mut dyn FnMut(&PretrainStep),
) -> Result<Vec<PretrainStep>> {
    o.validate()?;
    let device = Device::Cpu;
    let (gen, tok) = crate::fill_in::load_generator(generator, &device)?;
    let staging = Staging::new(&o.out)?;
    let lines = read_corpus(&o.data)?;
    let max_len = o.max_len.min(gen.lm.config().max_len());
    let rows = lines
        .iter()
        .map(|l| encode_cut(&tok, l, max_len))
        .collect::<Result<Vec<_>>>()?;
    let (train, held) = split_held_out(rows);
    let specials = MlmTokenizer::load(generator, max_len)?
        .special_ids()
        .to_vec();
    let faker = Faker {
        gen: &gen,
        tok: &tok,
        specials: &specials,
        mask_ratio: o.mask_ratio,
    };
    let mut eval_rng = ChaCha8Rng::seed_from_u64(mix_seed(o.seed, 1));
    let held = held_out_examples(&faker, &held, o.seed, &mut eval_rng)?;

    let cfg_json = stage_judge_files(&staging, generator, o)?;
    let cfg = EncoderConfig::from_json(
        EncoderKind::Bert,
        &cfg_json,
        &staging.tmp.join("config.json"),
    )?;
    let mut params = Params::new(init_bert(&cfg_json, Some(2), mix_seed(o.seed, 2), &device)?)?;
    let origin = staging.tmp.clone();
    let build =
        |p: &Params, track: bool| ClassifierNet::from_tensors(&cfg, 2, p.tensors(track), &origin);
    let mut rng = ChaCha8Rng::seed_from_u64(mix_seed(o.seed, 3));
    let log = run_steps(
        o,
        &mut params,
        &mut |step, p| {
            let picked: Vec<usize> = (0..o.batch_size)
                .map(|_| rng.random_range(0..train.len()))
                .collect();
            let rows: Vec<(&[u32], bool, u64)> = picked
                .iter()
                .enumerate()
                .map(|(i, &k)| {
                    let seed = mix_seed(o.seed, (step + 1) * 1_000_003 + i as u64);
                    (train[k].as_slice(), i % 2 == 1, seed)
                })
                .collect();
            let rows = faker.make(&rows, &mut rng)?;
            Ok(judge_loss(&build(p, true)?, &rows)?.0)
        },
        &mut |p| {
            let net = build(p, false)?;
            let (mut right, mut total) = (0.0, 0usize);
            for chunk in held.chunks(64) {
                right += judge_loss(&net, chunk)?.1 * chunk.len() as f64;
                total += chunk.len();
            }
            Ok(right / total.max(1) as f64)
        },
        on_step,
        &staging,
    )?;
    staging.finish(&params, &log)?;
    Ok(log)
}

/// `line` in the generator's tokens, cut to `max_len` keeping its last token (the end marker).
fn encode_cut(tok: &Tokenizer, line: &str, max_len: usize) -> Result<Vec<u32>> {
    let mut ids = tok.encode(line, true)?;
    if ids.len() > max_len {
        let last = ids[ids.len() - 1];
        ids.truncate(max_len - 1);
        ids.push(last);
    }
    Ok(ids)
}

/// Makes the judge's examples: real lines, and lines the generator filled.
struct Faker<'a> {
    gen: &'a FillInModel,
    tok: &'a Tokenizer,
    /// The generator's special token ids, never masked.
    specials: &'a [u32],
    mask_ratio: (f64, f64),
}

impl Faker<'_> {
    /// Half real, half filled by the generator: (ids, label). `rows` are (ids, fake, seed); the
    /// fakes of a batch are masked in row order, then filled in one batched forward (each fill
    /// seeded by its row's seed).
    fn make(
        &self,
        rows: &[(&[u32], bool, u64)],
        rng: &mut ChaCha8Rng,
    ) -> Result<Vec<(Vec<u32>, u32)>> {
        let gen = self.gen;
        let mut inputs = Vec::new();
        for &(ids, fake, seed) in rows {
            if fake {
                let (masked, _, _) =
                    mask_example(ids, self.mask_ratio, gen.mask_id, self.specials, rng);
                inputs.push(grpo_models::sampler::PromptInput { ids: masked, seed });
            }
        }
        let params = grpo_models::sampler::SamplingParams {
            temperature: 1.0,
            max_new_tokens: 1,
            ..Default::default()
        };
        use crate::rollout::GroupSampler;
        let fills = match inputs.is_empty() {
            true => vec![],
            false => {
                gen.sample_groups(self.tok, &inputs, 1, &params, &mut |_, _, _| Ok(()))?
                    .0
            }
        };
        let mut fakes = inputs.iter().zip(fills);
        Ok(rows
            .iter()
            .map(
                |&(ids, fake, _)| match fake.then(|| fakes.next()).flatten() {
                    Some((input, f)) => {
                        let filled = crate::fill_in::fill(&input.ids, gen.mask_id, &f[0].ids);
                        let label = u32::from(filled == ids);
                        (filled, label)
                    }
                    None => (ids.to_vec(), 1),
                },
            )
            .collect())
    }
}

/// The held-out examples, made once: every second line filled, each fill seeded by its index.
fn held_out_examples(
    faker: &Faker,
    held: &[Vec<u32>],
    seed: u64,
    rng: &mut ChaCha8Rng,
) -> Result<Vec<(Vec<u32>, u32)>> {
    let mut held_rows = Vec::with_capacity(held.len());
    for (c, chunk) in held.chunks(64).enumerate() {
        let rows: Vec<(&[u32], bool, u64)> = chunk
            .iter()
            .enumerate()
            .map(|(j, ids)| {
                let i = c * 64 + j;
                (ids.as_slice(), i % 2 == 1, mix_seed(seed, 1000 + i as u64))
            })
            .collect();
        held_rows.extend(faker.make(&rows, rng)?);
    }
    Ok(held_rows)
}

/// Writes the judge's `config.json` and copies the generator's tokenizer files into the staging
/// directory; returns the config.
fn stage_judge_files(
    staging: &Staging,
    generator: &Path,
    o: &PretrainOptions,
) -> Result<serde_json::Value> {
    let gen_cfg = grpo_models::files::read_json(&generator.join("config.json"))?;
    let cfg_json = bert_judge_config(&gen_cfg, o);
    staging.json("config.json", &cfg_json)?;
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        let from = generator.join(f);
        if from.is_file() {
            let bytes = std::fs::read(&from)
                .map_err(|e| Error::file(&from, format!("cannot read: {e}")))?;
            write_file(&staging.tmp.join(f), &bytes)?;
        }
    }
    Ok(cfg_json)
}

/// Mean cross-entropy [] and accuracy of the judge `net` on labelled `rows`.
fn judge_loss(net: &ClassifierNet, rows: &[(Vec<u32>, u32)]) -> Result<(Tensor, f64)> {
    let ids: Vec<&[u32]> = rows.iter().map(|r| r.0.as_slice()).collect();
    let logits = net.logits(&pad_batch(&ids, PAD))?; // [B, 2]
    let labels: Vec<u32> = rows.iter().map(|r| r.1).collect();
    let lp = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
    let y = Tensor::from_slice(&labels, (labels.len(), 1), logits.device())?;
    let loss = lp.gather(&y, 1)?.mean_all()?.neg()?;
    let pred = logits.argmax(D::Minus1)?.to_vec1::<u32>()?;
    let right = pred.iter().zip(&labels).filter(|(a, b)| a == b).count();
    Ok((loss, right as f64 / labels.len().max(1) as f64))
}

/// `config.json` of the judge: a BERT classifier (labels [`JUDGE_LABELS`]) over the generator's
/// vocabulary and positions.
fn bert_judge_config(gen: &serde_json::Value, o: &PretrainOptions) -> serde_json::Value {
    json!({
        "architectures": ["BertForSequenceClassification"],
        "model_type": "bert",
        "vocab_size": gen["vocab_size"],
        "hidden_size": o.hidden,
        "num_hidden_layers": o.layers,
        "num_attention_heads": o.heads,
        "intermediate_size": 4 * o.hidden,
        "hidden_act": "gelu",
        "max_position_embeddings": gen["max_position_embeddings"],
        "type_vocab_size": 2,
        "layer_norm_eps": 1e-12,
        "pad_token_id": PAD,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "classifier_dropout": null,
        "initializer_range": 0.02,
        "position_embedding_type": "absolute",
        "id2label": {"0": JUDGE_LABELS[0], "1": JUDGE_LABELS[1]},
        "label2id": {JUDGE_LABELS[0]: 0, JUDGE_LABELS[1]: 1},
        "grpo_pretrain": {"objective": "judge", "mask_ratio": [o.mask_ratio.0, o.mask_ratio.1]}
    })
}
