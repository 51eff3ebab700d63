//! Rows decoding in lockstep over one batched cache: the decoding loop of a completion and of
//! each turn of an episode.

use std::time::Instant;

use rayon::prelude::*;

use super::{step_row, step_rows_on_device, GenStats, Row, SamplingParams};
use crate::kv_cache::KvCache;
use crate::models::{AttnMask, CausalLm, SharedPrefix};
use crate::tokenizer::Tokenizer;
use crate::Result;

/// Rows decoding in lockstep over one batched cache (see [`Lanes::decode`]).
pub(super) struct Lanes<'a> {
    pub(super) model: &'a CausalLm,
    pub(super) params: &'a SamplingParams,
    pub(super) tokenizer: Option<&'a Tokenizer>,
    /// Rows of one prompt hold its prefill's keys and values in slots `..end` (the first turn):
    /// attention then reads them once per group.
    pub(super) shared_end: Option<usize>,
    /// Prompts (groups) of the rows.
    pub(super) groups: usize,
    pub(super) stats: &'a mut GenStats,
}

impl Lanes<'_> {
    /// Decodes rows `batch` (each with its first token chosen; row `r`'s keys in `cache` row
    /// `i` where `batch[i] == r`, from slot `rows[r].pad` on) until every one is done or has its
    /// `limit` of tokens. `report` runs after each step; `leaving(cache, i, r, row)` just before
    /// row `r` leaves the cache as cache row `i` (a finished row dropped once finished rows are a
    /// quarter of the batch, and every row at the end).
    pub(super) fn decode(
        &mut self,
        rows: &mut [Row],
        mut batch: Vec<usize>,
        mut cache: KvCache,
        report: &mut dyn FnMut(&[Row]) -> Result<()>,
        leaving: &mut dyn FnMut(&KvCache, usize, usize, &Row) -> Result<()>,
    ) -> Result<()> {
        let (model, params, tokenizer) = (self.model, self.params, self.tokenizer);
        let device = model.device().clone();
        let on_device = !model.compute().is_fused();
        let max_steps = batch
            .iter()
            .map(|&r| rows[r].limit.saturating_sub(rows[r].tokens.len()))
            .max()
            .unwrap_or(0);
        let slots = cache.len() + max_steps; // the most the cache will hold
        for _step in 0..max_steps {
            cache.reserve(cache.len() + 1, slots)?;
            let b = batch.len();
            let ids: Vec<u32> = batch
                .iter()
                .map(|&r| *rows[r].tokens.last().unwrap_or(&0))
                .collect();
            let pos: Vec<u32> = batch
                .iter()
                .map(|&r| (rows[r].start + rows[r].tokens.len() - 1) as u32)
                .collect();
            let pads: Vec<usize> = batch.iter().map(|&r| rows[r].pad).collect();
            let shared = self.shared_end.map(|end| {
                // Rows of one prompt hold its prefill's keys and values in slots ..end:
                // attention reads them once per group, from the group's first row in the batch.
                let mut first_of = vec![usize::MAX; self.groups];
                let leader: Vec<usize> = batch
                    .iter()
                    .enumerate()
                    .map(|(i, &r)| {
                        let f = &mut first_of[rows[r].prompt];
                        if *f == usize::MAX {
                            *f = i;
                        }
                        *f
                    })
                    .collect();
                SharedPrefix { leader, end }
            });
            let mask = AttnMask::LeftPad(pads, shared);
            if on_device {
                let ti = Instant::now();
                let logits = model.decode_logits_tensor(&ids, &pos, &mask, &mut cache)?; // [b, V]
                self.stats.issue_s += ti.elapsed().as_secs_f64();
                self.stats.decode_steps += 1;
                if crate::kernels::profiling() {
                    device.synchronize()?; // the forward's time is decode_s - sample_s
                }
                let ts = Instant::now();
                step_rows_on_device(rows, &batch, &logits, params, tokenizer)?;
                self.stats.sample_s += ts.elapsed().as_secs_f64();
            } else {
                let logits = model.decode_logits(&ids, &pos, &mask, &mut cache)?; // [b*V]
                self.stats.decode_steps += 1;
                let ts = Instant::now();
                let v = logits.len() / b;
                let mut slot_of = vec![usize::MAX; rows.len()];
                batch.iter().enumerate().for_each(|(i, &r)| slot_of[r] = i);
                rows.par_iter_mut()
                    .enumerate()
                    .filter(|(r, row)| row.done.is_none() && slot_of[*r] != usize::MAX)
                    .try_for_each(|(r, row)| {
                        let i = slot_of[r];
                        step_row(row, &logits[i * v..(i + 1) * v], params, tokenizer)
                    })?;
                self.stats.sample_s += ts.elapsed().as_secs_f64();
            }
            report(rows)?;
            let finished = batch.iter().filter(|&&r| rows[r].done.is_some()).count();
            if finished == batch.len() {
                break;
            }
            // Drop finished rows once they are a quarter of the batch: the copy costs about as
            // much as a few steps of decoding the dead rows would.
            if finished > 0 && finished * 4 >= batch.len() {
                let mut keep: Vec<u32> = Vec::with_capacity(batch.len());
                for (i, &r) in batch.iter().enumerate() {
                    match rows[r].done {
                        None => keep.push(i as u32),
                        Some(_) => leaving(&cache, i, r, &rows[r])?,
                    }
                }
                cache.keep_rows(&keep)?;
                batch.retain(|&r| rows[r].done.is_none());
                self.stats.compactions += 1;
            }
        }
        for (i, &r) in batch.iter().enumerate() {
            leaving(&cache, i, r, &rows[r])?;
        }
        Ok(())
    }
}
