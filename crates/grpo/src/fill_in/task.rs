//! The built-in fill-in task: copies, `w=w` with `w` a random word of 3 to 6 letters from `a` to
//! `h`, each line with some characters replaced by `[MASK]`. A rule checks a filled line on its
//! own (`sides_match`: are the two sides equal?); the answer is the original line. Where both a
//! letter and its copy are masked, any letter is right as long as both fills agree, which a
//! single-step generator sampling every position independently does not ensure: that is what
//! GRPO has to teach it.
//!
//! Its rewards: [`builtin_rewards`].

use std::collections::HashSet;

use rand::{Rng, SeedableRng};

use crate::data::arithmetic::TaskParams;
use crate::data::{Example, Prompt};
use crate::rewards::Reward;
use crate::{Error, Result};
use grpo_models::seeding::mix_seed;

/// The mask token the built-in task writes (the char tokenizer's).
pub const MASK: &str = "[MASK]";
const LETTERS: &[u8] = b"abcdefgh";

/// The task's lines, `(train, eval)`, distinct, from `p.seed` (`train_size`, `eval_size`).
pub fn lines(p: &TaskParams) -> Result<(Vec<String>, Vec<String>)> {
    let possible: usize = (3..=6).map(|n| LETTERS.len().pow(n)).sum();
    let want = p.train_size + p.eval_size;
    if want > possible / 2 {
        return Err(Error::config(
            "task.train_size",
            format!("{want} lines from {possible} possible: ask for fewer"),
        ));
    }
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(mix_seed(p.seed, 0xf111));
    let mut seen = HashSet::new();
    let mut all = Vec::with_capacity(want);
    while all.len() < want {
        let n = rng.random_range(3..=6);
        let w: String = (0..n)
            .map(|_| LETTERS[rng.random_range(0..LETTERS.len())] as char)
            .collect();
        if seen.insert(w.clone()) {
            all.push(format!("{w}={w}"));
        }
    }
    let train = all.split_off(p.eval_size);
    Ok((train, all))
}

/// `line` with a share of its characters, drawn uniformly from `ratio` (at least one), replaced
/// by [`MASK`], positions uniform without replacement.
pub fn mask_line(line: &str, ratio: (f64, f64), rng: &mut impl Rng) -> String {
    let chars: Vec<char> = line.chars().collect();
    let r = if ratio.1 > ratio.0 {
        rng.random_range(ratio.0..=ratio.1)
    } else {
        ratio.0
    };
    let k = ((r * chars.len() as f64).round() as usize).clamp(1, chars.len().max(1));
    let chosen: HashSet<usize> = rand::seq::index::sample(rng, chars.len(), k.min(chars.len()))
        .into_iter()
        .collect();
    chars
        .iter()
        .enumerate()
        .map(|(i, c)| match chosen.contains(&i) {
            true => MASK.to_string(),
            false => c.to_string(),
        })
        .collect()
}

/// `(train, eval)` masked examples: each line masked once with its own seed.
pub fn make(p: &TaskParams, ratio: (f64, f64)) -> Result<(Vec<Example>, Vec<Example>)> {
    let (train, eval) = lines(p)?;
    let mk = |split: &str, salt: u64, lines: Vec<String>| -> Vec<Example> {
        lines
            .into_iter()
            .enumerate()
            .map(|(i, l)| {
                let mut rng =
                    rand_chacha::ChaCha8Rng::seed_from_u64(mix_seed(p.seed ^ salt, i as u64));
                Example {
                    prompt: Prompt::Text(mask_line(&l, ratio, &mut rng)),
                    answer: Some(l),
                    metadata: Default::default(),
                    origin: format!("fill_in:{split}:{i}"),
                    tokens: None,
                }
            })
            .collect()
    };
    Ok((mk("train", 1, train), mk("eval", 2, eval)))
}

/// The built-in fill-in task's rewards: the judge at `judge` (a classifier; its probability
/// that the filled line is `real`) is what is trained on; `sides_match`, whether the filled copy
/// `w=w` has equal sides, has weight 0: it measures (as eval accuracy) without being optimised,
/// so that reward hacking of the judge shows up. On the user's inputs (`builtin_task` false)
/// the judge alone.
pub fn builtin_rewards(
    judge: &std::path::Path,
    builtin_task: bool,
    device: &candle_core::Device,
) -> Result<Vec<Reward>> {
    // The label `real` (a judge `grpo pretrain` made), else the judge's last label.
    let config = judge.join("config.json");
    let json = grpo_models::files::read_json(&config)?;
    let labels: Vec<String> = json
        .get("id2label")
        .and_then(|m| m.as_object())
        .map(|m| {
            let mut v: Vec<(usize, String)> = m
                .iter()
                .filter_map(|(k, v)| Some((k.parse().ok()?, v.as_str()?.to_string())))
                .collect();
            v.sort();
            v.into_iter().map(|x| x.1).collect()
        })
        // No id2label: the labels have no names; they are counted below.
        .unwrap_or_default();
    // As the classifier counts its labels: id2label's, else num_labels, else 2 (transformers).
    let count = match labels.len() {
        0 => json
            .get("num_labels")
            .and_then(|n| n.as_u64())
            .map_or(2, |n| n as usize),
        n => n,
    };
    let label = match labels.iter().any(|l| l == "real") {
        true => serde_json::json!("real"),
        false => serde_json::json!(count.max(2) - 1),
    };
    let mut tables = vec![
        serde_json::json!({"kind": "classifier", "name": "judge", "model": judge.display().to_string(),
                           "label": label, "input": "completion", "output": "probability"}),
    ];
    if builtin_task {
        tables.push(serde_json::json!({"kind": "sides_match", "weight": 0.0}));
    }
    crate::rewards::build_rewards(&crate::rewards::parse_specs(&tables, 1)?, device)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fill_task_masks_copies() {
        let p = crate::data::arithmetic::TaskParams {
            train_size: 50,
            eval_size: 10,
            min_operand: 10,
            max_operand: 99,
            ops: vec!['+'],
            seed: 3,
        };
        let (train, eval) = make(&p, (0.2, 0.5)).unwrap();
        assert_eq!((train.len(), eval.len()), (50, 10));
        let mut originals = std::collections::HashSet::new();
        for e in train.iter().chain(&eval) {
            let original = e.answer.as_deref().unwrap();
            assert!(originals.insert(original.to_string()), "distinct lines");
            assert_eq!(
                crate::rewards::rules::sides_match(original),
                1.0,
                "{original}"
            );
            let Prompt::Text(masked) = &e.prompt else {
                panic!()
            };
            let n = masked.matches(MASK).count();
            assert!(
                n >= 1 && masked.replace(MASK, "?").len() == original.len(),
                "{masked}"
            );
        }
        // Deterministic.
        assert_eq!(make(&p, (0.2, 0.5)).unwrap().0[7].prompt, train[7].prompt);
    }
}
