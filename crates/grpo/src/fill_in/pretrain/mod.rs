//! `grpo pretrain`: small models trained from a text file on the CPU in minutes.
//!
//! `--objective mlm`: a masked-LM generator, trained as a single-step diffusion model: each
//! example gets its own mask ratio, drawn from a range, and the model learns to fill every
//! masked position at once. `--objective judge`: a classifier telling real lines from lines the
//! generator filled, the frozen judge of fill-in GRPO ([`pretrain_judge`]).
//!
//! The model is a BERT masked LM (`BertForMaskedLM`, tied decoder) with a char-level tokenizer
//! (`[PAD] [UNK] [CLS] [SEP] [MASK]` then the corpus's characters), saved as an HF directory
//! (config.json, model.safetensors, tokenizer.json, tokenizer_config.json) that grpo's loader,
//! and transformers, load as any other masked LM. Training: AdamW, cosine schedule with warm-up,
//! cross-entropy at the masked positions; held-out fill accuracy is measured on a fixed set of
//! masked lines.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor, Var, D};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub use crate::fill_in::mask_example;
use crate::optim::{clip_factor, lr_lambda, var_tensors, AdamW, AdamWConfig, LrSchedule};
use crate::{Error, Result};
use grpo_models::files::{save_tensors, write_file};

mod causal;
mod judge;
mod mlm;
mod tokenizer;

pub use causal::{llama_config, pretrain_causal};
pub use judge::{pretrain_judge, JUDGE_LABELS};
pub use mlm::{bert_mlm_config, pretrain_mlm};
pub use tokenizer::{char_tokenizer_json, char_vocab, Objective};

/// The char tokenizer's special tokens, in id order.
pub const SPECIALS: [&str; 5] = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"];
const PAD: u32 = 0;
const CLS: u32 = 2;
const SEP: u32 = 3;
const MASK: u32 = 4;

/// What `grpo pretrain` trains (sizes, steps, optimizer, masking).
#[derive(Debug, Clone)]
pub struct PretrainOptions {
    /// One example per line (blank lines skipped).
    pub data: PathBuf,
    pub out: PathBuf,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    /// Longest example in tokens, [CLS] and [SEP] included; longer lines are cut.
    pub max_len: usize,
    pub steps: u64,
    pub batch_size: usize,
    pub learning_rate: f64,
    pub warmup_steps: u64,
    /// Each example's mask ratio is drawn uniformly from this range.
    pub mask_ratio: (f64, f64),
    pub seed: u64,
    /// Held-out fill accuracy every this many steps (0: only at the end).
    pub eval_every: u64,
    /// The tokenizer made from the corpus (`--objective mlm` and `causal`).
    pub tokenizer: TokenizerKind,
    /// A loadable copy of the model every this many steps (0: none), in `checkpoint-N/` of the
    /// output (of the temporary directory the model is written to, while it is being written).
    pub save_every: u64,
}

/// The tokenizer `grpo pretrain` makes from its corpus.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizerKind {
    /// One token per character.
    Chars,
    /// Byte-level BPE learned from the corpus (the `tokenizers` crate's trainer), this many
    /// tokens in all.
    Bpe { vocab_size: usize },
}

impl PretrainOptions {
    fn validate(&self) -> Result<()> {
        let bad = |k: &str, m: &str| Err(Error::config(k, m));
        let (lo, hi) = self.mask_ratio;
        if !(lo > 0.0 && lo <= hi && hi <= 1.0) {
            return bad(
                "--mask-ratio",
                "must be a ratio in (0, 1] or a range LO..HI with 0 < LO <= HI <= 1",
            );
        }
        if self.heads == 0 || !self.hidden.is_multiple_of(self.heads) {
            return bad("--heads", "must divide --hidden");
        }
        if self.max_len < 3 {
            return bad(
                "--max-len",
                "must be at least 3 ([CLS], one character, [SEP])",
            );
        }
        if let TokenizerKind::Bpe { vocab_size } = self.tokenizer {
            if vocab_size <= 256 + SPECIALS.len() {
                return bad(
                    "--vocab-size",
                    "a byte-level BPE starts from 256 byte tokens and 5 specials: give more than 261",
                );
            }
        }
        if self.steps == 0 || self.batch_size == 0 || self.layers == 0 {
            return bad(
                "--steps",
                "--steps, --batch-size and --layers must be at least 1",
            );
        }
        Ok(())
    }
}

/// One line of the pretraining log.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PretrainStep {
    pub step: u64,
    pub loss: f64,
    pub learning_rate: f64,
    pub grad_norm: f64,
    /// Held-out accuracy when measured: the share of masked characters filled right (greedy)
    /// for a generator, of lines classified right for a judge.
    pub eval_accuracy: Option<f64>,
}

/// Lines of a text corpus: the non-blank lines of `path`, right-trimmed.
pub fn read_corpus(path: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::file(path, format!("cannot read the corpus: {e}")))?;
    let lines: Vec<String> = text
        .lines()
        .map(|l| l.trim_end().to_string())
        .filter(|l| !l.trim().is_empty())
        .collect();
    if lines.is_empty() {
        return Err(Error::file(
            path,
            "the corpus is empty: pretraining needs text, one example per line",
        ));
    }
    Ok(lines)
}

/// BERT's initialisation (transformers' `_init_weights`): matrices and embeddings N(0, 0.02),
/// biases 0, LayerNorm weights 1. The encoder under `bert.`, then the head: a masked-LM head with
/// a tied decoder (`labels` None) or a pooler and a classifier over `labels` labels. Sorted by
/// name.
fn init_bert(
    cfg: &serde_json::Value,
    labels: Option<usize>,
    seed: u64,
    device: &Device,
) -> Result<Vec<(String, Tensor)>> {
    let get = |k: &str| cfg[k].as_u64().unwrap_or(0) as usize;
    let (v, h, i, p, t) = (
        get("vocab_size"),
        get("hidden_size"),
        get("intermediate_size"),
        get("max_position_embeddings"),
        get("type_vocab_size"),
    );
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut out = Vec::new();
    let mut normal = |name: String, shape: &[usize], rng: &mut ChaCha8Rng| -> Result<()> {
        out.push((name, normal_tensor(shape, rng, device)?));
        Ok(())
    };
    let mut fixed = Vec::new();
    let mut constant = |name: String, n: usize, value: f32| {
        fixed.push((name, n, value));
    };
    let e = "bert.embeddings";
    normal(format!("{e}.word_embeddings.weight"), &[v, h], &mut rng)?;
    normal(format!("{e}.position_embeddings.weight"), &[p, h], &mut rng)?;
    normal(
        format!("{e}.token_type_embeddings.weight"),
        &[t, h],
        &mut rng,
    )?;
    constant(format!("{e}.LayerNorm.weight"), h, 1.0);
    constant(format!("{e}.LayerNorm.bias"), h, 0.0);
    for l in 0..get("num_hidden_layers") {
        let b = format!("bert.encoder.layer.{l}");
        for (name, o, i_) in [
            ("attention.self.query", h, h),
            ("attention.self.key", h, h),
            ("attention.self.value", h, h),
            ("attention.output.dense", h, h),
            ("intermediate.dense", i, h),
            ("output.dense", h, i),
        ] {
            normal(format!("{b}.{name}.weight"), &[o, i_], &mut rng)?;
            constant(format!("{b}.{name}.bias"), o, 0.0);
        }
        for ln in ["attention.output.LayerNorm", "output.LayerNorm"] {
            constant(format!("{b}.{ln}.weight"), h, 1.0);
            constant(format!("{b}.{ln}.bias"), h, 0.0);
        }
    }
    match labels {
        None => {
            let c = "cls.predictions";
            normal(format!("{c}.transform.dense.weight"), &[h, h], &mut rng)?;
            constant(format!("{c}.transform.dense.bias"), h, 0.0);
            constant(format!("{c}.transform.LayerNorm.weight"), h, 1.0);
            constant(format!("{c}.transform.LayerNorm.bias"), h, 0.0);
            constant(format!("{c}.bias"), v, 0.0);
        }
        Some(n) => {
            normal("bert.pooler.dense.weight".into(), &[h, h], &mut rng)?;
            constant("bert.pooler.dense.bias".into(), h, 0.0);
            normal("classifier.weight".into(), &[n, h], &mut rng)?;
            constant("classifier.bias".into(), n, 0.0);
        }
    }
    for (name, n, value) in fixed {
        out.push((name, Tensor::full(value, n, device)?));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// Trainable parameters (from an initialisation) and their AdamW.
struct Params {
    names: Vec<String>,
    vars: Vec<Var>,
    opt: AdamW,
}

impl Params {
    fn new(init: Vec<(String, Tensor)>) -> Result<Self> {
        let names: Vec<String> = init.iter().map(|(n, _)| n.clone()).collect();
        let vars = init
            .iter()
            .map(|(_, t)| Var::from_tensor(t))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let opt = AdamW::new(
            names.iter().cloned().zip(vars.iter().cloned()).collect(),
            AdamWConfig {
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.01,
            },
        )?;
        Ok(Self { names, vars, opt })
    }

    /// By name: tracking gradients (`track`) or detached.
    fn tensors(&self, track: bool) -> HashMap<String, Tensor> {
        var_tensors(&self.names, &self.vars, track)
    }

    /// Backward from `loss`, clip to norm 1, one AdamW step at `lr`; returns the norm.
    fn step(&mut self, loss: &Tensor, lr: f64) -> Result<f64> {
        let grads = loss.backward()?;
        let g: Vec<Tensor> = self
            .vars
            .iter()
            .map(|v| match grads.get(v.as_tensor()) {
                Some(g) => Ok(g.clone()),
                None => Ok(v.as_tensor().zeros_like()?),
            })
            .collect::<Result<_>>()?;
        let (norm, scale) = clip_factor(&g, 1.0, self.opt.compute())?;
        self.opt.step(&g, lr, scale)?;
        Ok(norm)
    }
}

/// A model directory being written: files go to a temporary sibling, renamed into place at the
/// end, so an interrupted run leaves nothing half-written at `out`.
struct Staging {
    tmp: PathBuf,
    out: PathBuf,
}

impl Staging {
    fn new(out: &Path) -> Result<Self> {
        if out.join("model.safetensors").exists() {
            return Err(Error::file(
                out,
                "already holds a model; choose a new --out directory",
            ));
        }
        let tmp = out.with_extension(format!("tmp-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp)
            .map_err(|e| Error::file(&tmp, format!("cannot create: {e}")))?;
        Ok(Self {
            tmp,
            out: out.to_path_buf(),
        })
    }

    fn json(&self, name: &str, v: &serde_json::Value) -> Result<()> {
        write_file(
            &self.tmp.join(name),
            // Serializing a serde_json::Value cannot fail.
            &serde_json::to_vec_pretty(v).unwrap_or_default(),
        )
    }

    /// A loadable copy of the model so far in `checkpoint-{step}/` (written to a temporary
    /// sibling, then renamed): the files written so far, the weights and the log.
    fn checkpoint(&self, step: u64, params: &Params, log: &[PretrainStep]) -> Result<()> {
        let dir = self.tmp.join(format!("checkpoint-{step}"));
        let part = self.tmp.join(format!("checkpoint-{step}.part"));
        let _ = std::fs::remove_dir_all(&part);
        std::fs::create_dir_all(&part)
            .map_err(|e| Error::file(&part, format!("cannot create: {e}")))?;
        for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
            let from = self.tmp.join(f);
            if from.is_file() {
                std::fs::copy(&from, part.join(f))
                    .map_err(|e| Error::file(&from, format!("cannot copy: {e}")))?;
            }
        }
        write_weights_and_log(&part, params, log)?;
        std::fs::rename(&part, &dir).map_err(|e| {
            Error::file(&dir, format!("cannot move the checkpoint into place: {e}"))
        })?;
        tracing::info!("checkpoint: {}", dir.display());
        Ok(())
    }

    /// Writes the weights and the log, then moves the directory into place.
    fn finish(self, params: &Params, log: &[PretrainStep]) -> Result<()> {
        write_weights_and_log(&self.tmp, params, log)?;
        if self.out.exists() {
            std::fs::remove_dir(&self.out).map_err(|e| {
                Error::file(
                    &self.out,
                    format!("cannot replace (it must be empty or absent): {e}"),
                )
            })?;
        }
        std::fs::rename(&self.tmp, &self.out)
            .map_err(|e| Error::file(&self.out, format!("cannot move the model into place: {e}")))
    }
}

/// `model.safetensors` and `pretrain_log.jsonl` in `dir`.
fn write_weights_and_log(dir: &Path, params: &Params, log: &[PretrainStep]) -> Result<()> {
    let tensors: Vec<(String, Tensor)> = params.tensors(false).into_iter().collect();
    save_tensors(&dir.join("model.safetensors"), &tensors)?;
    let lines: Vec<String> = log
        .iter()
        // A row of plain numbers always serializes (a NaN is written as null).
        .map(|r| serde_json::to_string(r).unwrap_or_default())
        .collect();
    write_file(
        &dir.join("pretrain_log.jsonl"),
        (lines.join("\n") + "\n").as_bytes(),
    )
}

/// The steps of a pretraining run: `loss_of(step, params)` gives the step's loss (with a graph),
/// `evaluate(params)` the held-out accuracy, measured every `eval_every` steps and at the end.
fn run_steps(
    o: &PretrainOptions,
    params: &mut Params,
    loss_of: &mut dyn FnMut(u64, &Params) -> Result<Tensor>,
    evaluate: &mut dyn FnMut(&Params) -> Result<f64>,
    on_step: &mut dyn FnMut(&PretrainStep),
    staging: &Staging,
) -> Result<Vec<PretrainStep>> {
    let mut log = Vec::new();
    for step in 0..o.steps {
        let loss = loss_of(step, params)?;
        let lr = o.learning_rate * lr_lambda(LrSchedule::Cosine, step, o.warmup_steps, o.steps);
        let norm = params.step(&loss, lr)?;
        let done = step + 1;
        let eval_now = done == o.steps || (o.eval_every > 0 && done.is_multiple_of(o.eval_every));
        let row = PretrainStep {
            step: done,
            loss: loss.to_dtype(DType::F64)?.to_scalar::<f64>()?,
            learning_rate: lr,
            grad_norm: norm,
            eval_accuracy: match eval_now {
                true => Some(evaluate(params)?),
                false => None,
            },
        };
        on_step(&row);
        log.push(row);
        if o.save_every > 0 && done.is_multiple_of(o.save_every) && done < o.steps {
            staging.checkpoint(done, params, &log)?;
        }
    }
    Ok(log)
}

/// Every 20th line held out (at most 200), the rest for training (all of them when that would
/// leave none).
fn split_held_out(rows: Vec<Vec<u32>>) -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
    let (mut train, mut held) = (Vec::new(), Vec::new());
    for (i, r) in rows.into_iter().enumerate() {
        if i % 20 == 19 && held.len() < 200 {
            held.push(r);
        } else {
            train.push(r);
        }
    }
    if train.is_empty() {
        train = held.clone();
    }
    (train, held)
}

/// Mean cross-entropy [] of `logits` [N, V] against `targets` (N), and the share of rows whose
/// argmax is the target.
fn cross_entropy(logits: &Tensor, targets: &[u32]) -> Result<(Tensor, f64)> {
    let dev = logits.device().clone();
    let lp = candle_nn::ops::log_softmax(logits, D::Minus1)?; // [N, V]
    let n = targets.len();
    let tgt = Tensor::from_slice(targets, (n, 1), &dev)?; // [N, 1]
    let loss = lp.gather(&tgt, 1)?.mean_all()?.neg()?; // []
    let argmax = logits.argmax(D::Minus1)?.to_vec1::<u32>()?;
    let right = argmax.iter().zip(targets).filter(|(a, b)| a == b).count();
    Ok((loss, right as f64 / n.max(1) as f64))
}

/// N(0, 0.02) values of `shape` (Box-Muller over `rng`).
fn normal_tensor(shape: &[usize], rng: &mut ChaCha8Rng, device: &Device) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let vals: Vec<f32> = (0..n)
        .map(|_| {
            let (u1, u2): (f64, f64) = (rng.random::<f64>().max(1e-12), rng.random());
            ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos() * 0.02) as f32
        })
        .collect();
    Ok(Tensor::from_vec(vals, shape, device)?)
}

/// The generator and judge of the built-in fill-in task (`grpo train --policy=fill_in`): made by
/// [`pretrain_mlm`] and [`pretrain_judge`] from the task's training lines the first time,
/// then reused from the cache (`$GRPO_CACHE_DIR/fill_in/<key>/`, the key a hash of the task and
/// these settings). Returns (generator, judge) directories.
pub fn builtin_fill_in_models(
    task: &crate::config::TaskConfig,
    need_judge: bool,
) -> Result<(PathBuf, PathBuf)> {
    let p = task.params();
    let (lines, _) = super::task::lines(&p)?;
    let base = PretrainOptions {
        data: PathBuf::new(),
        out: PathBuf::new(),
        hidden: 64,
        layers: 3,
        heads: 4,
        max_len: 24,
        steps: 600,
        batch_size: 64,
        learning_rate: 1e-3,
        warmup_steps: 100,
        mask_ratio: (0.1, 0.9),
        seed: 42,
        eval_every: 200,
        tokenizer: TokenizerKind::Chars,
        save_every: 0,
    };
    let judge_steps = 6000;
    // FNV-1a over everything the models depend on: stable across builds and toolchains.
    let key = format!(
        "v4\n{base:?}\n{judge_steps}\n{:?}\n{}",
        task.mask_ratio,
        lines.join("\n")
    );
    let hash = key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    let dir = grpo_models::hub::cache_dir()
        .join("fill_in")
        .join(format!("{hash:016x}"));
    let (gen, judge) = (dir.join("generator"), dir.join("judge"));
    let done = |d: &Path| d.join("model.safetensors").is_file();
    if done(&gen) && (done(&judge) || !need_judge) {
        // A run loads both (its rewards, then its policy): the second call only looks.
        return Ok((gen, judge));
    }
    let corpus = dir.join("lines.txt");
    std::fs::create_dir_all(&dir).map_err(|e| Error::file(&dir, format!("cannot create: {e}")))?;
    write_file(&corpus, (lines.join("\n") + "\n").as_bytes())?;
    fn log(what: &'static str) -> impl FnMut(&PretrainStep) {
        move |r: &PretrainStep| {
            if let Some(acc) = r.eval_accuracy {
                tracing::info!(
                    "{what}: step {:>4}  loss {:.4}  held-out accuracy {acc:.3}",
                    r.step,
                    r.loss
                );
            }
        }
    }
    if !done(&gen) {
        tracing::info!(
            "fill-in task: pretraining the generator ({} steps; cached in {})",
            base.steps,
            dir.display()
        );
        let o = PretrainOptions {
            data: corpus.clone(),
            out: gen.clone(),
            ..base.clone()
        };
        pretrain_mlm(&o, &mut log("generator"))?;
    }
    if need_judge && !done(&judge) {
        tracing::info!("fill-in task: pretraining the judge ({judge_steps} steps)");
        let o = PretrainOptions {
            data: corpus,
            out: judge.clone(),
            steps: judge_steps,
            mask_ratio: task.mask_ratio,
            ..base
        };
        pretrain_judge(&o, &gen, &mut log("judge"))?;
    }
    Ok((gen, judge))
}

#[cfg(test)]
mod tests {
    use super::*;
    use grpo_models::tokenizer::Tokenizer;

    fn opts(dir: &Path, data: PathBuf) -> PretrainOptions {
        PretrainOptions {
            data,
            out: dir.join("gen"),
            hidden: 32,
            layers: 2,
            heads: 4,
            max_len: 24,
            steps: 150,
            batch_size: 32,
            learning_rate: 3e-3,
            warmup_steps: 10,
            mask_ratio: (0.1, 0.5),
            seed: 7,
            eval_every: 50,
            tokenizer: TokenizerKind::Chars,
            save_every: 0,
        }
    }

    /// Sums "a+b=c" of one-digit numbers: learnable structure for a tiny model.
    fn corpus(dir: &Path) -> PathBuf {
        corpus_of(dir, 10)
    }

    /// Sums "a+b=c" of numbers below `n`.
    fn corpus_of(dir: &Path, n: u32) -> PathBuf {
        let mut lines = Vec::new();
        for a in 0..n {
            for b in 0..n {
                lines.push(format!("{a}+{b}={}", a + b));
            }
        }
        let p = dir.join("sums.txt");
        std::fs::write(&p, lines.join("\n")).unwrap();
        p
    }

    #[test]
    fn the_char_tokenizer_round_trips_and_keeps_masks() {
        let dir = tempfile::tempdir().unwrap();
        let vocab = char_vocab(&["ab c".to_string(), "cab!".into()]);
        assert_eq!(&vocab[..5], &SPECIALS.map(String::from));
        std::fs::write(
            dir.path().join("tokenizer.json"),
            serde_json::to_vec(&char_tokenizer_json(&vocab)).unwrap(),
        )
        .unwrap();
        let tok = Tokenizer::from_hf_dir(dir.path()).unwrap();
        let ids = tok.encode("ab[MASK] c", true).unwrap();
        let space = vocab.iter().position(|t| t == " ").unwrap() as u32;
        assert_eq!(ids.first(), Some(&CLS));
        assert_eq!(ids.last(), Some(&SEP));
        assert!(ids.contains(&MASK) && ids.contains(&space), "{ids:?}");
        assert_eq!(ids.len(), 2 + 5);
        assert_eq!(tok.decode(&ids, true).unwrap(), "ab c");
    }

    #[test]
    fn masks_cover_the_ratio_and_never_specials() {
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let ids = [CLS, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, SEP];
        for _ in 0..50 {
            let (m, pos, tgt) =
                mask_example(&ids, (0.2, 0.6), MASK, &[PAD, CLS, SEP, MASK], &mut rng);
            assert!((2..=6).contains(&pos.len()), "{pos:?}");
            assert!(pos.iter().all(|&p| p > 0 && p < ids.len() - 1));
            assert_eq!(pos.iter().map(|&p| ids[p]).collect::<Vec<_>>(), tgt);
            assert_eq!(m.iter().filter(|&&t| t == MASK).count(), pos.len());
        }
    }

    #[test]
    fn pretraining_learns_to_fill_and_saves_a_loadable_masked_lm() {
        let dir = tempfile::tempdir().unwrap();
        let o = opts(dir.path(), corpus(dir.path()));
        let log = pretrain_mlm(&o, &mut |_| {}).unwrap();
        let accs: Vec<f64> = log.iter().filter_map(|r| r.eval_accuracy).collect();
        assert_eq!(accs.len(), 3);
        let first = log[0].loss;
        let last = log.last().unwrap().loss;
        assert!(last < first * 0.6, "loss {first} -> {last}");
        assert!(accs[2] > 0.4, "held-out fill accuracy {accs:?}");
        // An HF masked-LM directory: grpo loads it as a fill-in generator.
        let (model, tok) = crate::fill_in::load_generator(&o.out, &Device::Cpu).unwrap();
        assert_eq!(model.mask_id, MASK);
        assert_eq!(
            tok.decode(&tok.encode("3+4=7", true).unwrap(), true)
                .unwrap(),
            "3+4=7"
        );
        // A second run into the same directory is refused, not overwritten.
        let e = pretrain_mlm(&o, &mut |_| {}).unwrap_err().to_string();
        assert!(e.contains("already holds a model"), "{e}");
    }

    #[test]
    fn a_bpe_generator_and_a_causal_lm_pretrain_and_load_with_checkpoints() {
        let dir = tempfile::tempdir().unwrap();
        let data = corpus_of(dir.path(), 30);
        // A masked LM over a BPE tokenizer learned from the corpus.
        let o = PretrainOptions {
            tokenizer: TokenizerKind::Bpe { vocab_size: 300 },
            steps: 60,
            save_every: 30,
            eval_every: 0,
            ..opts(dir.path(), data.clone())
        };
        let log = pretrain_mlm(&o, &mut |_| {}).unwrap();
        assert!(log.last().unwrap().loss < log[0].loss, "{log:?}");
        let (model, tok) = crate::fill_in::load_generator(&o.out, &Device::Cpu).unwrap();
        assert_eq!(model.mask_id, MASK);
        let ids = tok.encode("12+17=29", true).unwrap();
        assert!(ids.len() < 10, "merges learned: {ids:?}");
        assert_eq!((ids[0], *ids.last().unwrap()), (CLS, SEP));
        assert_eq!(tok.decode(&ids, true).unwrap(), "12+17=29");
        assert!(tok.vocab_size() <= 300);
        // The checkpoint of step 30 loads as well; the last step is the model itself.
        crate::fill_in::load_generator(&o.out.join("checkpoint-30"), &Device::Cpu).unwrap();
        assert!(!o.out.join("checkpoint-60").exists());

        // A causal LM (chars): it learns the next character; it loads as a causal model whose
        // tokenizer starts texts with BOS and does not end them with EOS.
        let c = PretrainOptions {
            out: dir.path().join("causal"),
            steps: 150,
            ..opts(dir.path(), data)
        };
        let log = pretrain_causal(&c, &mut |_| {}).unwrap();
        let accs: Vec<f64> = log.iter().filter_map(|r| r.eval_accuracy).collect();
        // Chance is 1 in 16 characters; the sums' structure is learned.
        assert!(accs[accs.len() - 1] > 0.4, "{accs:?}");
        assert!(log.last().unwrap().loss < log[0].loss * 0.7, "{log:?}");
        let loaded = grpo_models::weights::load_model(
            &grpo_models::hub::ModelSource::HfDir(c.out.clone()),
            DType::F32,
            &Device::Cpu,
        )
        .unwrap();
        let tok = loaded.tokenizer.clone().unwrap();
        let lm = grpo_models::models::CausalLm::from_tensors(
            &loaded.config,
            loaded.tensors,
            DType::F32,
            &Device::Cpu,
        )
        .unwrap();
        assert_eq!(lm.config().vocab_size, tok.vocab_size());
        assert_eq!(loaded.eos_token_ids, vec![SEP]);
        assert_eq!(tok.encode("1+2=3", true).unwrap()[0], CLS);
        assert_ne!(*tok.encode("1+2=3", true).unwrap().last().unwrap(), SEP);
        assert_eq!(tok.eos_token_id(), Some(SEP));
    }

    #[test]
    fn a_judge_tells_real_lines_from_an_early_generators_fills() {
        // Lines of one repeated character: an untrained generator's fills stand out.
        let dir = tempfile::tempdir().unwrap();
        let lines: Vec<String> = ('a'..='z')
            .chain('0'..='9')
            .flat_map(|c| (4..=20).map(move |n| c.to_string().repeat(n)))
            .collect();
        let data = dir.path().join("runs.txt");
        std::fs::write(&data, lines.join("\n")).unwrap(); // 612 lines, 30 held out
        let gen = PretrainOptions {
            steps: 5,
            ..opts(dir.path(), data.clone())
        };
        pretrain_mlm(&gen, &mut |_| {}).unwrap();
        let judge = PretrainOptions {
            out: dir.path().join("judge"),
            steps: 100,
            eval_every: 0,
            mask_ratio: (0.2, 0.5),
            ..opts(dir.path(), data)
        };
        let log = pretrain_judge(&judge, &gen.out, &mut |_| {}).unwrap();
        let acc = log.last().unwrap().eval_accuracy.unwrap();
        eprintln!(
            "judge: loss {:.3} -> {:.3}, held-out accuracy {acc:.3}",
            log[0].loss,
            log.last().unwrap().loss
        );
        assert!(acc > 0.7, "held-out judge accuracy {acc}");
        // A classifier reward loads it: labels by name, the generator's tokenizer.
        let c = grpo_models::models::encoder::SequenceClassifier::load(&judge.out, &Device::Cpu)
            .unwrap();
        assert_eq!(c.labels(), JUDGE_LABELS);
        let real = c.logits(&[("aaaa", None), ("aaba", None)], 2).unwrap();
        assert_eq!(real.len(), 2);
    }

    #[test]
    fn an_empty_corpus_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("empty.txt");
        std::fs::write(&p, "\n  \n").unwrap();
        let e = pretrain_mlm(&opts(dir.path(), p), &mut |_| {})
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("empty.txt") && e.contains("corpus is empty"),
            "{e}"
        );
    }
}
