//! Per-token log-probabilities from the all-position forward, with the same temperature as the
//! sampler: `log softmax(h W^T / T)[target]`.
//!
//! The LM head is applied in chunks of rows, so at most `[chunk, vocab]` logits exist at a time in a
//! forward without gradient. (In a differentiable forward candle's autograd keeps each chunk's
//! logits for the backward pass; the memory-lean fused backward belongs to the trainer.)

use candle_core::{Tensor, D};

use crate::models::layers::reduce_dtype;

use crate::models::{CausalLm, Mode, SeqBatch};
use crate::Result;

/// Rows of hidden states per LM-head chunk.
pub const DEFAULT_CHUNK_ROWS: usize = 256;

/// `hidden` [N, H], `lm_head` [V, H], `targets` [N] u32 -> log-probs [N] f32.
/// `temperature` <= 0 is treated as 1 (greedy sampling reports log-probs at T = 1).
pub fn token_logprobs(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &Tensor,
    temperature: f64,
    chunk_rows: usize,
) -> Result<Tensor> {
    let (lp, _) = token_logprobs_entropy(
        hidden,
        lm_head,
        targets,
        temperature,
        chunk_rows,
        Entropy::Skip,
    )?;
    Ok(lp)
}

/// Log-prob of every next token of `batch`: entry `[b, t]` is `log p(ids[b, t+1] | ids[b, ..=t])`.
/// Entries whose target is padding are computed but meaningless; mask them with `batch.valid`.
/// Returns [B, T-1] f32.
pub fn next_token_logprobs(
    model: &CausalLm,
    batch: &SeqBatch,
    temperature: f64,
    mode: Mode,
) -> Result<Tensor> {
    let (b, t) = batch.dims();
    let hidden = model.forward_hidden(batch, mode)?; // [B, T, H]
    let h = hidden.dim(2)?;
    let hidden = hidden.narrow(1, 0, t - 1)?.reshape((b * (t - 1), h))?; // [B*(T-1), H]
    let targets = batch.ids.narrow(1, 1, t - 1)?.flatten_all()?; // [B*(T-1)]
    let lp = token_logprobs(
        &hidden,
        model.lm_head(),
        &targets,
        temperature,
        DEFAULT_CHUNK_ROWS,
    )?;
    Ok(lp.reshape((b, t - 1))?)
}

/// What to do about per-token entropies of the sampling distribution.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Entropy {
    Skip,
    /// Computed for logging only: no gradient.
    Detached,
    /// Differentiable (an entropy bonus is part of the loss).
    WithGrad,
}

/// Like [`token_logprobs`], also returning per-row entropies `[N]` of `softmax(logits / T)`
/// (`lse - sum(p * z)`), each chunk's logits used for both.
pub fn token_logprobs_entropy(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &Tensor,
    temperature: f64,
    chunk_rows: usize,
    entropy: Entropy,
) -> Result<(Tensor, Option<Tensor>)> {
    let n = hidden.dim(0)?;
    let t = if temperature > 0.0 { temperature } else { 1.0 };
    let chunk = chunk_rows.max(1);
    let w_t = lm_head.t()?; // [H, V]
    let (mut lps, mut ents) = (Vec::new(), Vec::new());
    let mut start = 0;
    while start < n {
        let len = chunk.min(n - start);
        let h = hidden.narrow(0, start, len)?; // [c, H]
        let y = targets.narrow(0, start, len)?; // [c]
        start += len;
        let logits = h.matmul(&w_t)?;
        let z = (logits.to_dtype(reduce_dtype(logits.dtype()))? / t)?; // [c, V] f32
        let max = z.max_keepdim(D::Minus1)?.detach(); // [c, 1]
        let shifted = z.broadcast_sub(&max)?;
        let e = shifted.exp()?; // [c, V]
        let sum = e.sum_keepdim(D::Minus1)?; // [c, 1]
        let lse_shifted = sum.log()?; // [c, 1]
        let picked = shifted.gather(&y.unsqueeze(1)?, 1)?; // [c, 1]
        lps.push((picked - &lse_shifted)?.squeeze(1)?);
        if entropy == Entropy::Skip {
            continue;
        }
        // H = lse - sum(p z) = log(sum e) - sum(e * shifted) / sum(e)   (shift-invariant)
        let (e, shifted, sum, lse_shifted) = match entropy {
            Entropy::WithGrad => (e, shifted, sum, lse_shifted),
            _ => (
                e.detach(),
                shifted.detach(),
                sum.detach(),
                lse_shifted.detach(),
            ),
        };
        let pz = ((e * shifted)?.sum_keepdim(D::Minus1)? / sum)?; // [c, 1]
        ents.push((lse_shifted - pz)?.squeeze(1)?);
    }
    let ents = if entropy == Entropy::Skip {
        None
    } else {
        Some(Tensor::cat(&ents, 0)?)
    };
    Ok((Tensor::cat(&lps, 0)?, ents))
}

/// Log-probs (and optionally entropies) of completion tokens, `[N, Tc]` right-padded with zeros.
/// Row `i` is `prompts[i] ++ completions[i]`; the LM head is applied only at the positions that
/// predict completion tokens, so no logits are computed for prompt or padding positions.
pub fn completion_logprobs(
    model: &CausalLm,
    prompts: &[&[u32]],
    completions: &[&[u32]],
    pad_id: u32,
    temperature: f64,
    mode: Mode,
    entropy: Entropy,
) -> Result<(Tensor, Option<Tensor>)> {
    let n = prompts.len();
    let tc = completions.iter().map(|c| c.len()).max().unwrap_or(0);
    let seqs: Vec<Vec<u32>> = prompts
        .iter()
        .zip(completions)
        .map(|(p, c)| [*p, *c].concat())
        .collect();
    let dev = model.device().clone();
    let batch = SeqBatch::right_padded(&seqs, pad_id, &dev)?;
    let (_, t) = batch.dims();
    // Row of the flattened hidden states that predicts each completion token, and the scatter
    // index back into [N, Tc] (padding slots point at an extra zero entry, M).
    let mut rows = Vec::new();
    let mut targets = Vec::new();
    for (i, (p, c)) in prompts.iter().zip(completions).enumerate() {
        for (j, &tok) in c.iter().enumerate() {
            rows.push((i * t + p.len() - 1 + j) as u32);
            targets.push(tok);
        }
    }
    let m = rows.len();
    let mut scatter = vec![m as u32; n * tc];
    let mut k = 0;
    for (i, c) in completions.iter().enumerate() {
        for j in 0..c.len() {
            scatter[i * tc + j] = k as u32;
            k += 1;
        }
    }
    let hidden = model.forward_hidden(&batch, mode)?; // [N, T, H]
    let h = hidden.dim(2)?;
    let picked = hidden
        .reshape((n * t, h))?
        .index_select(&Tensor::from_vec(rows, m, &dev)?, 0)?; // [M, H]
    let targets = Tensor::from_vec(targets, m, &dev)?;
    let (lp, ent) = token_logprobs_entropy(
        &picked,
        model.lm_head(),
        &targets,
        temperature,
        DEFAULT_CHUNK_ROWS,
        entropy,
    )?; // [M]
    let scatter = Tensor::from_vec(scatter, n * tc, &dev)?;
    let to_grid = |x: Tensor| -> Result<Tensor> {
        let zero = Tensor::zeros(1, x.dtype(), &dev)?;
        Ok(Tensor::cat(&[&x, &zero], 0)?
            .index_select(&scatter, 0)?
            .reshape((n, tc))?) // [N, Tc]
    };
    Ok((to_grid(lp)?, ent.map(to_grid).transpose()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// Plain-f32 twin: log softmax(logits / T)[target] for one row.
    fn logprob_slow(logits: &[f32], target: usize, t: f32) -> f32 {
        let z: Vec<f32> = logits.iter().map(|x| x / t).collect();
        let m = z.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let lse = z.iter().map(|x| (x - m).exp()).sum::<f32>().ln() + m;
        z[target] - lse
    }

    #[test]
    fn chunked_logprobs_match_plain_twin_and_have_gradients() {
        let dev = Device::Cpu;
        let (n, h, v) = (7, 5, 11);
        let hidden = Var::randn(0f32, 1.0, (n, h), &dev).unwrap();
        let w = Var::randn(0f32, 1.0, (v, h), &dev).unwrap();
        let targets = Tensor::new(&[0u32, 3, 10, 5, 5, 1, 9], &dev).unwrap();
        for (t, chunk) in [(1.0, 3), (0.7, 100), (0.0, 1)] {
            let lp = token_logprobs(&hidden, &w, &targets, t, chunk).unwrap();
            let got = lp.to_vec1::<f32>().unwrap();
            let logits = hidden
                .matmul(&w.t().unwrap())
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            let tt = if t > 0.0 { t as f32 } else { 1.0 };
            for i in 0..n {
                let want = logprob_slow(
                    &logits[i],
                    targets.to_vec1::<u32>().unwrap()[i] as usize,
                    tt,
                );
                assert!(
                    (got[i] - want).abs() < 1e-5,
                    "row {i}: {} vs {want}",
                    got[i]
                );
            }
            let grads = lp.sum_all().unwrap().backward().unwrap();
            assert!(grads.get(&hidden).is_some() && grads.get(&w).is_some());
        }
    }
}
