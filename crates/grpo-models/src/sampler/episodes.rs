//! Multi-turn episodes: the model's turns alternate with inserted turns (a tool's result, an
//! environment's observation) until the episode is over.
//!
//! The first turn is sampled as [`super::generate_streaming`] samples a completion: every prompt
//! prefilled once, its G rows decoding in lockstep over one batched cache. When a row's turn ends,
//! a [`TurnHost`] hears of it at once (its tool can run while the other rows decode) and says
//! whether the episode goes on; the row's keys and values are then kept. Once every row of the
//! turn has ended, the host gives each continuing row the tokens to insert (the tool messages
//! and the next assistant header); they are prefilled onto the row's own keys and values (its
//! last sampled token first, which the cache does not hold yet), never a re-run of the
//! conversation, and the rows' next turn decodes in lockstep again.
//!
//! Layout: between turns each row's keys and values are kept apart (`[1, Hkv, len, D]` per
//! layer). The inserted tokens of all rows are prefilled in one forward, right-padded, over a
//! cache that holds each row's past right-aligned at one slot; the rows are then re-aligned so
//! that each ends at the same slot, as the decoding step's left padding needs. Each row keeps
//! its own random stream across turns, so an episode depends on (seed, prompt, sample index)
//! and on what its tools answered, never on the rest of the batch.

use std::time::Instant;

use candle_core::Tensor;

use super::{
    batch_cache, check_prompts, completion_of, first_tokens, start_rows, Completion, GenStats,
    Lanes, PromptInput, Row, SamplingParams, StopReason,
};
use crate::kv_cache::KvCache;
use crate::models::{layers, AttnMask, CausalLm};
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

/// What drives an episode's inserted turns (the agents' edge: tool calls, environments).
pub trait TurnHost {
    /// Row `row` (`prompt`'s sample `sample`) ended a model turn. Returns whether its episode
    /// goes on (the turn called a tool whose result will follow); whatever answers it may start
    /// now, while the other rows decode.
    fn turn_ended(
        &mut self,
        row: usize,
        prompt: usize,
        sample: usize,
        turn: &Completion,
    ) -> Result<bool>;

    /// Every row of this round of turns has ended: for each of `rows` (those whose turn went on),
    /// the tokens that continue it after its last sampled token (tool messages, the next
    /// assistant header), or `None` to end the episode there.
    fn continuations(&mut self, rows: &[usize]) -> Result<Vec<Option<Vec<u32>>>>;
}

/// One finished episode: everything after the prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct EpisodeTokens {
    pub ids: Vec<u32>,
    /// Per id: sampled by the model (true) or inserted by the host (false).
    pub sampled: Vec<bool>,
    /// Per id: the sampled token's log-prob (the sampler's, see the module docs of
    /// [`super`]); 0 for inserted tokens.
    pub logprobs: Vec<f32>,
    /// Model turns.
    pub turns: usize,
    /// Why its last model turn ended.
    pub stop_reason: StopReason,
    /// The episode's token budget ended it before the host did.
    pub out_of_tokens: bool,
}

/// A row's episode so far, and its keys and values while it waits between turns.
struct Episode {
    out: EpisodeTokens,
    /// The turn that ended was reported to the host.
    reported: bool,
    goes_on: bool,
    /// Per layer (k, v) `[1, Hkv, len, D]`: the row's keys and values, all its tokens but the
    /// last sampled one.
    kv: Option<Vec<(Tensor, Tensor)>>,
}

/// Samples `n` episodes of each prompt, each at most `max_tokens` tokens after its prompt
/// (model and inserted tokens together); each model turn at most `params.max_new_tokens`.
/// Returns them grouped by prompt, in sample order.
pub fn generate_episodes(
    model: &CausalLm,
    tokenizer: &Tokenizer,
    prompts: &[PromptInput],
    n: usize,
    params: &SamplingParams,
    max_tokens: usize,
    host: &mut dyn TurnHost,
) -> Result<(Vec<Vec<EpisodeTokens>>, GenStats)> {
    check_prompts(model, Some(tokenizer), prompts, n, params, max_tokens)?;
    let mut stats = GenStats::default();
    if prompts.is_empty() {
        return Ok((vec![], stats));
    }
    let turn_params = SamplingParams {
        max_new_tokens: params.max_new_tokens.min(max_tokens),
        ..params.clone()
    };
    let mut e = Engine {
        model,
        tokenizer,
        params: &turn_params,
        max_tokens,
        n,
        eps: vec![],
    };
    let (mut rows, prompt_cache, lmax) =
        start_rows(model, Some(tokenizer), prompts, n, &turn_params, &mut stats)?;
    let t1 = Instant::now();
    e.eps = (0..rows.len())
        .map(|_| Episode {
            out: EpisodeTokens {
                ids: vec![],
                sampled: vec![],
                logprobs: vec![],
                turns: 0,
                stop_reason: StopReason::Length,
                out_of_tokens: false,
            },
            reported: false,
            goes_on: false,
            kv: None,
        })
        .collect();
    // Turn 1: as a single-turn completion, rows of a prompt sharing its prefill.
    e.report(&rows, host)?;
    for (r, row) in rows.iter().enumerate() {
        if row.done.is_some() {
            // Done at its first token: its keys and values are its prompt's.
            e.keep(&prompt_cache, row.prompt, row.pad, row.start, r)?;
        }
    }
    let batch: Vec<usize> = (0..rows.len())
        .filter(|&r| rows[r].done.is_none())
        .collect();
    if !batch.is_empty() {
        let cache = batch_cache(model, &prompt_cache, &rows, &batch, &turn_params)?;
        drop(prompt_cache);
        e.decode(
            &mut rows,
            batch,
            cache,
            Some(lmax),
            prompts.len(),
            host,
            &mut stats,
        )?;
    }
    // Later turns: the host's tokens prefilled onto each row's own keys and values.
    loop {
        let waiting: Vec<usize> = (0..rows.len()).filter(|&r| e.eps[r].goes_on).collect();
        if waiting.is_empty() {
            break;
        }
        let conts = host.continuations(&waiting)?;
        if conts.len() != waiting.len() {
            return Err(Error::Invariant(format!(
                "{} continuations for {} waiting episodes",
                conts.len(),
                waiting.len()
            )));
        }
        let live = e.next_turn(&mut rows, &waiting, conts)?;
        if live.is_empty() {
            break;
        }
        e.continue_rows(&mut rows, &live, prompts.len(), host, &mut stats)?;
    }
    stats.decode_s = t1.elapsed().as_secs_f64();
    stats.generated_tokens = e.eps.iter().map(|x| x.out.turns_tokens()).sum();
    let mut all = e.eps.into_iter().map(|x| x.out);
    let groups = (0..prompts.len())
        .map(|_| all.by_ref().take(n).collect())
        .collect();
    Ok((groups, stats))
}

impl EpisodeTokens {
    /// Tokens the model sampled.
    fn turns_tokens(&self) -> usize {
        self.sampled.iter().filter(|&&s| s).count()
    }
}

struct Engine<'a> {
    model: &'a CausalLm,
    tokenizer: &'a Tokenizer,
    params: &'a SamplingParams,
    max_tokens: usize,
    n: usize,
    eps: Vec<Episode>,
}

impl Engine<'_> {
    /// Reports every row whose turn has ended and was not reported yet: its tokens join the
    /// episode, and the host says whether it goes on.
    fn report(&mut self, rows: &[Row], host: &mut dyn TurnHost) -> Result<()> {
        for (r, row) in rows.iter().enumerate() {
            let ep = &mut self.eps[r];
            if ep.reported || row.done.is_none() {
                continue;
            }
            ep.reported = true;
            let turn = completion_of(row, Some(self.tokenizer))?;
            ep.out.ids.extend_from_slice(&turn.ids);
            ep.out
                .sampled
                .extend(std::iter::repeat_n(true, turn.ids.len()));
            ep.out.logprobs.extend_from_slice(&turn.logprobs);
            ep.out.turns += 1;
            ep.out.stop_reason = turn.stop_reason;
            ep.goes_on = host.turn_ended(r, row.prompt, r % self.n, &turn)?;
        }
        Ok(())
    }

    /// Keeps row `r`'s keys and values while it waits for its next turn, when its episode goes
    /// on: `len` slots from `from` of `cache` row `i`.
    fn keep(&mut self, cache: &KvCache, i: usize, from: usize, len: usize, r: usize) -> Result<()> {
        if self.eps[r].goes_on {
            self.eps[r].kv = Some(cut_row(cache, i, from, len)?);
        }
        Ok(())
    }

    /// Decodes `batch` to the end of its turn, reporting rows as they finish and keeping the keys
    /// and values of those whose episode goes on.
    #[allow(clippy::too_many_arguments)]
    fn decode(
        &mut self,
        rows: &mut [Row],
        batch: Vec<usize>,
        cache: KvCache,
        shared_end: Option<usize>,
        groups: usize,
        host: &mut dyn TurnHost,
        stats: &mut GenStats,
    ) -> Result<()> {
        let mut lanes = Lanes {
            model: self.model,
            params: self.params,
            tokenizer: Some(self.tokenizer),
            shared_end,
            groups,
            stats,
        };
        // Both callbacks need the engine; `decode` calls one at a time.
        let me = std::cell::RefCell::new(self);
        lanes.decode(
            rows,
            batch,
            cache,
            &mut |rows| me.borrow_mut().report(rows, host),
            &mut |cache, i, r, row| {
                // Every token of the row but its last sampled one is in the cache.
                let len = row.start + row.tokens.len() - 1;
                me.borrow_mut().keep(cache, i, row.pad, len, r)
            },
        )
    }

    /// Starts the next turn of the rows `waiting` with the host's continuations: each continuing
    /// row gets its inserted tokens (unless they would leave no room in the episode's budget) and
    /// a fresh turn. Returns the continuing rows with the tokens to prefill (its last sampled
    /// token, then the inserted ones).
    fn next_turn(
        &mut self,
        rows: &mut [Row],
        waiting: &[usize],
        conts: Vec<Option<Vec<u32>>>,
    ) -> Result<Vec<(usize, Vec<u32>)>> {
        let mut live = vec![];
        for (&r, cont) in waiting.iter().zip(conts) {
            let ep = &mut self.eps[r];
            ep.goes_on = false;
            ep.reported = false;
            let Some(inserted) = cont else {
                ep.kv = None;
                continue;
            };
            if ep.out.ids.len() + inserted.len() >= self.max_tokens {
                ep.out.out_of_tokens = true;
                ep.kv = None;
                continue;
            }
            let row = &mut rows[r];
            let last = *row.tokens.last().ok_or_else(|| {
                Error::Invariant("a turn that goes on ended without a token".into())
            })?;
            ep.out.ids.extend_from_slice(&inserted);
            ep.out
                .sampled
                .extend(std::iter::repeat_n(false, inserted.len()));
            ep.out
                .logprobs
                .extend(std::iter::repeat_n(0.0, inserted.len()));
            row.seen.extend_from_slice(&inserted);
            row.tokens.clear();
            row.logprobs.clear();
            row.done = None;
            row.text_len = 0;
            row.limit = self
                .params
                .max_new_tokens
                .min(self.max_tokens - ep.out.ids.len());
            let mut fed = Vec::with_capacity(inserted.len() + 1);
            fed.push(last);
            fed.extend(inserted);
            live.push((r, fed));
        }
        Ok(live)
    }

    /// A turn after the first: prefills each row's new tokens onto its kept keys and values (all
    /// rows in one forward), chooses its first token, and decodes the turn.
    fn continue_rows(
        &mut self,
        rows: &mut [Row],
        live: &[(usize, Vec<u32>)],
        groups: usize,
        host: &mut dyn TurnHost,
        stats: &mut GenStats,
    ) -> Result<()> {
        let t0 = Instant::now();
        let model = self.model;
        let dev = model.device().clone();
        let b = live.len();
        let kept: Vec<Vec<(Tensor, Tensor)>> = live
            .iter()
            .map(|(r, _)| {
                self.eps[*r].kv.take().ok_or_else(|| {
                    Error::Invariant(format!("episode {r} goes on without its keys and values"))
                })
            })
            .collect::<Result<_>>()?;
        let past: Vec<usize> = kept.iter().map(|kv| kv_len(kv)).collect::<Result<_>>()?;
        let new: Vec<usize> = live.iter().map(|(_, t)| t.len()).collect();
        let l = past.iter().copied().max().unwrap_or(0);
        let tmax = new.iter().copied().max().unwrap_or(0);
        // Each row's past right-aligned at slot `l`, its new tokens right-padded after it.
        let mut cache = assemble(&kept, l, l + tmax)?;
        drop(kept);
        let mut ids = vec![0u32; b * tmax];
        let mut pos = vec![0u32; b * tmax];
        let mut valid = vec![vec![false; l + tmax]; b];
        for (i, (_, toks)) in live.iter().enumerate() {
            ids[i * tmax..i * tmax + toks.len()].copy_from_slice(toks);
            for (j, p) in pos[i * tmax..(i + 1) * tmax].iter_mut().enumerate() {
                *p = (past[i] + j) as u32;
            }
            valid[i][l - past[i]..l + toks.len()].fill(true);
        }
        let mask = layers::build_mask(&valid, l, tmax, l + tmax, &dev)?; // [b, 1, tmax, l+tmax]
        let h = model.forward_cached(
            &Tensor::from_vec(ids, (b, tmax), &dev)?,
            &Tensor::from_vec(pos, (b, tmax), &dev)?,
            &AttnMask::dense(mask)?,
            &mut cache,
        )?; // [b, tmax, H]
        let at: Vec<u32> = (0..b).map(|i| (i * tmax + new[i] - 1) as u32).collect();
        let hd = h.dim(2)?;
        let last = h
            .reshape((b * tmax, hd))?
            .index_select(&Tensor::from_vec(at, b, &dev)?, 0)?; // [b, H]
        let logits = model.logits(&last)?; // [b, V]
        drop(h);
        // Re-aligned so that every row ends at one slot, as decoding's left padding needs.
        let rows_kv: Vec<Vec<(Tensor, Tensor)>> = (0..b)
            .map(|i| cut_row(&cache, i, l - past[i], past[i] + new[i]))
            .collect::<Result<_>>()?;
        drop(cache);
        let end = (0..b).map(|i| past[i] + new[i]).max().unwrap_or(0);
        let room = live.iter().map(|(r, _)| rows[*r].limit).max().unwrap_or(0);
        let mut cache = assemble(&rows_kv, end, end + super::first_room(room))?;
        drop(rows_kv);
        for (i, (r, _)) in live.iter().enumerate() {
            rows[*r].pad = end - (past[i] + new[i]);
            rows[*r].start = past[i] + new[i];
        }
        stats.prompt_tokens += new.iter().sum::<usize>();
        stats.prefill_s += t0.elapsed().as_secs_f64();
        let which: Vec<usize> = live.iter().map(|(r, _)| *r).collect();
        let ts = Instant::now();
        let order: Vec<usize> = (0..b).collect();
        first_tokens(
            model,
            rows,
            &which,
            &logits,
            &order,
            self.params,
            Some(self.tokenizer),
        )?;
        stats.sample_s += ts.elapsed().as_secs_f64();
        self.report(rows, host)?;
        let mut keep_slots = vec![];
        for (i, &r) in which.iter().enumerate() {
            match rows[r].done {
                Some(_) => self.keep(&cache, i, rows[r].pad, rows[r].start, r)?,
                None => keep_slots.push(i as u32),
            }
        }
        if keep_slots.is_empty() {
            return Ok(());
        }
        if keep_slots.len() < b {
            cache.keep_rows(&keep_slots)?;
        }
        let batch: Vec<usize> = which
            .into_iter()
            .filter(|&r| rows[r].done.is_none())
            .collect();
        self.decode(rows, batch, cache, None, groups, host, stats)
    }
}

/// Slots a row's kept keys and values hold.
fn kv_len(kv: &[(Tensor, Tensor)]) -> Result<usize> {
    match kv.first() {
        Some((k, _)) => Ok(k.dim(2)?),
        None => Err(Error::Invariant(
            "kept keys and values without a layer".into(),
        )),
    }
}

/// `len` slots from `from` of `cache` row `i`, per layer `[1, Hkv, len, D]` (a copy).
fn cut_row(cache: &KvCache, i: usize, from: usize, len: usize) -> Result<Vec<(Tensor, Tensor)>> {
    let (ks, vs) = cache.layer_tensors();
    let cut = |t: &Tensor| -> Result<Tensor> {
        Ok(t.narrow(0, i, 1)?.narrow(2, from, len)?.contiguous()?)
    };
    ks.iter()
        .zip(vs)
        .map(|(k, v)| Ok((cut(k)?, cut(v)?)))
        .collect()
}

/// A batched cache of `capacity` slots whose row `i` holds `rows[i]`'s keys and values
/// right-aligned at slot `end` (left-padded), filled up to `end`.
fn assemble(rows: &[Vec<(Tensor, Tensor)>], end: usize, capacity: usize) -> Result<KvCache> {
    let first = rows
        .first()
        .and_then(|r| r.first())
        .ok_or_else(|| Error::Invariant("no keys and values to assemble".into()))?;
    let (_, hkv, _, d) = first.0.dims4()?;
    let (dtype, dev) = (first.0.dtype(), first.0.device().clone());
    let layers = rows[0].len();
    let (mut ks, mut vs) = (Vec::with_capacity(layers), Vec::with_capacity(layers));
    for layer in 0..layers {
        let k = Tensor::zeros((rows.len(), hkv, capacity, d), dtype, &dev)?;
        let v = Tensor::zeros((rows.len(), hkv, capacity, d), dtype, &dev)?;
        for (i, row) in rows.iter().enumerate() {
            let (rk, rv) = &row[layer];
            let len = rk.dim(2)?;
            k.narrow(0, i, 1)?.slice_set(rk, 2, end - len)?;
            v.narrow(0, i, 1)?.slice_set(rv, 2, end - len)?;
        }
        ks.push(k);
        vs.push(v);
    }
    Ok(KvCache::from_parts(ks, vs, end)?)
}
