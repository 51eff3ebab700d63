//! ZeRO stage 3 (`zero_stage = 3`; FSDP's `FULL_SHARD`): the parameters themselves are sharded.
//! Each rank keeps only its range of the flattened f32 parameters ([`ShardedParams`], the same
//! split as the moments' in stages 1 and 2), and AdamW steps that range alone: its moments,
//! gradients and parameters are all 1/N of the model's.
//!
//! Whole parameters exist only while they are used:
//! - the training forward and backward gather one transformer block at a time
//!   ([`super::exchange::BlockExchange`], through gradient checkpointing's recomputation: the block is gathered
//!   for its forward, freed, gathered again for its recomputed backward), and each block's
//!   gradients are reduce-scattered into this rank's range as soon as its backward has run
//!   (the exchange overlapped with the backward: a thread of its own runs the collectives,
//!   and prefetches the next block while this one computes);
//! - the parameters outside the blocks (embedding, final norm, LM head) are gathered for an
//!   optimizer step, and their gradients reduce-scattered at its end;
//! - sampling and scoring gather the whole weights once per pass (TRL's
//!   `ds3_gather_for_generation`), and checkpoints gather them to write ordinary HF files.
//!
//! Every gather and reduce-scatter is a collective: every rank runs the same ones in the same
//! order. A rank with fewer forward passes in a micro-batch than another takes the difference
//! as idle passes ([`super::exchange::BlockExchange::idle_forward`]).

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use candle_core::{DType, Device, Shape, Tensor, Var};

use super::zero::{reduce_window, windows, with_host_f32, Ranks, Shard};
use crate::{Error, Result};

/// The world a [`ShardedParams`] gathers and reduces through.
pub type SharedRanks = Arc<dyn Ranks + Send + Sync>;

/// The trainable parameters, sharded: their names and shapes, and this rank's range of their
/// flattened concatenation (in this order), as one flat f32 `Var` that AdamW steps in place.
pub struct ShardedParams {
    names: Vec<String>,
    shapes: Vec<Shape>,
    /// Where each parameter starts in the flattened concatenation, then the total.
    offsets: Vec<usize>,
    shard: Shard,
    /// This rank's range, `[range]` f32 on the parameters' device.
    mine: Var,
    device: Device,
    ranks: SharedRanks,
}

impl std::fmt::Debug for ShardedParams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedParams")
            .field("parameters", &self.names.len())
            .field("shard", &self.shard)
            .finish()
    }
}

impl ShardedParams {
    /// Keeps this rank's range of `params` (whole f32 tensors, in the optimizer's order); the
    /// caller drops the whole tensors afterwards.
    pub fn new(params: &[(String, Tensor)], ranks: SharedRanks) -> Result<ShardedParams> {
        let device = params
            .first()
            .map_or(Device::Cpu, |(_, t)| t.device().clone());
        let mut offsets = vec![0];
        for (name, t) in params {
            if t.dtype() != DType::F32 {
                return Err(Error::config(
                    "zero_stage",
                    format!(
                        "parameter {name} is {:?}; training keeps them in f32",
                        t.dtype()
                    ),
                ));
            }
            offsets.push(offsets[offsets.len() - 1] + t.elem_count());
        }
        let r = &ranks;
        let shard = Shard::new(offsets[params.len()], r.rank(), r.size());
        let range = shard.range();
        let mut pieces = Vec::new();
        for (i, (_, t)) in params.iter().enumerate() {
            let (lo, hi) = overlap(&(offsets[i]..offsets[i + 1]), &range);
            if hi > lo {
                let flat = t.flatten_all()?; // [n] f32
                pieces.push(flat.narrow(0, lo - offsets[i], hi - lo)?.copy()?);
            }
        }
        let mine = match pieces.is_empty() {
            true => Tensor::zeros(0, DType::F32, &device)?,
            false => Tensor::cat(&pieces, 0)?,
        };
        Ok(ShardedParams {
            names: params.iter().map(|(n, _)| n.clone()).collect(),
            shapes: params.iter().map(|(_, t)| t.shape().clone()).collect(),
            offsets,
            shard,
            mine: Var::from_tensor(&mine)?,
            device,
            ranks,
        })
    }

    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// How the flattened parameters are split over the ranks.
    pub fn shard(&self) -> &Shard {
        &self.shard
    }

    /// This rank's range of the parameters (`[range]` f32), which AdamW steps in place.
    pub fn mine(&self) -> &Var {
        &self.mine
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Parameter `i`'s elements in the flattened concatenation.
    fn span(&self, i: usize) -> Range<usize> {
        self.offsets[i]..self.offsets[i + 1]
    }

    /// Parameters `idx` (ascending) gathered whole from every rank, in the order of `idx`:
    /// one all-gather per run of consecutive parameters (a window of at most a few million
    /// values for long runs). Every rank calls it with the same `idx`.
    pub fn gather(&self, idx: &[usize]) -> Result<Vec<Tensor>> {
        let mine = self.mine.as_tensor();
        let range = self.shard.range();
        let mut out = Vec::with_capacity(idx.len());
        for run in runs(idx) {
            let sizes: Vec<usize> = run.clone().map(|i| self.span(i).len()).collect();
            for (params, window) in windows(&sizes) {
                let start = self.offsets[run.start];
                let window = start + window.start..start + window.end;
                let (lo, hi) = overlap(&window, &range);
                let part = mine.narrow(0, lo - range.start, hi - lo)?; // [mine ∩ window]
                let all = with_host_f32(&part, |xs| self.ranks.all_gather_f32(xs))?;
                if all.len() != window.len() {
                    return Err(Error::Invariant(format!(
                        "zero 3: gathered {} parameter values for a window of {}",
                        all.len(),
                        window.len()
                    )));
                }
                // One storage for the window's parameters, each a view of it.
                let all = Tensor::from_vec(all, window.len(), &self.device)?; // [window] f32
                for i in params.map(|p| run.start + p) {
                    let s = self.span(i);
                    let flat = all.narrow(0, s.start - window.start, s.len())?; // [n] f32
                    out.push(flat.reshape(&self.shapes[i])?);
                }
            }
        }
        Ok(out)
    }

    /// Every parameter, whole, by name (a collective: sampling, checkpoints).
    pub fn gather_all(&self) -> Result<Vec<(String, Tensor)>> {
        let idx: Vec<usize> = (0..self.names.len()).collect();
        Ok(self.names.iter().cloned().zip(self.gather(&idx)?).collect())
    }

    /// Adds this rank's range of the world's sum of `grads` (the gradients of parameters `idx`,
    /// ascending, in that order) into `acc` (`[range]`): one reduce-scatter per window.
    /// Every rank calls it with the same `idx`.
    pub fn reduce_into(&self, idx: &[usize], grads: &[Tensor], acc: &mut [f32]) -> Result<()> {
        if grads.len() != idx.len() || acc.len() != self.shard.range().len() {
            return Err(Error::Invariant(format!(
                "zero 3: {} gradients for {} parameters, an accumulator of {} for a range of {}",
                grads.len(),
                idx.len(),
                acc.len(),
                self.shard.range().len()
            )));
        }
        let range = self.shard.range();
        let mut at = 0;
        for run in runs(idx) {
            let sizes: Vec<usize> = run.clone().map(|i| self.span(i).len()).collect();
            for (params, window) in windows(&sizes) {
                let start = self.offsets[run.start];
                let window = start + window.start..start + window.end;
                let grads_here = &grads[at..at + params.len()];
                at += params.len();
                let counts = self.shard.counts_in(&window);
                let part = reduce_window(grads_here, window.len(), &counts, &*self.ranks)?;
                let (lo, _) = overlap(&window, &range);
                let dst = &mut acc[lo - range.start..];
                for (a, g) in dst.iter_mut().zip(&part) {
                    *a += g;
                }
            }
        }
        Ok(())
    }

    /// Every parameter's value of the flat per-element state `values` (`[range]`, this rank's:
    /// e.g. an AdamW moment), gathered whole and named `{prefix}.{name}`, on the main rank
    /// (`None` on the others). A collective.
    pub fn consolidate(
        &self,
        prefix: &str,
        values: &[f32],
    ) -> Result<Option<Vec<(String, Tensor)>>> {
        let flat = Var::from_slice(values, values.len(), &Device::Cpu)?;
        let copy = ShardedParams {
            names: self.names.clone(),
            shapes: self.shapes.clone(),
            offsets: self.offsets.clone(),
            shard: self.shard.clone(),
            mine: flat,
            device: Device::Cpu,
            ranks: self.ranks.clone(),
        };
        let all = copy.gather_all()?;
        Ok(self.ranks.is_main().then(|| {
            all.into_iter()
                .map(|(n, t)| (format!("{prefix}.{n}"), t))
                .collect()
        }))
    }

    /// This rank's range of whole per-parameter tensors `{prefix}.{name}` in `state` (a
    /// checkpoint's moments, whichever world wrote them), flat `[range]` f32 on the CPU.
    pub fn range_of(&self, state: &HashMap<String, Tensor>, prefix: &str) -> Result<Tensor> {
        let range = self.shard.range();
        let mut pieces = Vec::new();
        for (i, name) in self.names.iter().enumerate() {
            let key = format!("{prefix}.{name}");
            let t = state
                .get(&key)
                .ok_or_else(|| Error::Model(format!("optimizer state has no tensor {key}")))?;
            if t.shape() != &self.shapes[i] {
                return Err(Error::Model(format!(
                    "optimizer state {key} has shape {:?}, parameter {:?}",
                    t.shape(),
                    self.shapes[i]
                )));
            }
            let (lo, hi) = overlap(&self.span(i), &range);
            if hi > lo {
                let flat = t.to_dtype(DType::F32)?.flatten_all()?; // [n] f32
                pieces.push(
                    flat.narrow(0, lo - self.offsets[i], hi - lo)?
                        .to_device(&Device::Cpu)?,
                );
            }
        }
        Ok(match pieces.is_empty() {
            true => Tensor::zeros(0, DType::F32, &Device::Cpu)?,
            false => Tensor::cat(&pieces, 0)?,
        })
    }
}

/// `a ∩ b` as `(start, end)`, both within `b` (`start == end` when they do not meet).
fn overlap(a: &Range<usize>, b: &Range<usize>) -> (usize, usize) {
    let lo = a.start.clamp(b.start, b.end);
    (lo, a.end.clamp(b.start, b.end).max(lo))
}

/// `idx` (ascending) cut into runs of consecutive indices.
fn runs(idx: &[usize]) -> Vec<Range<usize>> {
    let mut out: Vec<Range<usize>> = Vec::new();
    for &i in idx {
        match out.last_mut() {
            Some(r) if r.end == i => r.end += 1,
            _ => out.push(i..i + 1),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::zero::test_world::Threads;

    #[test]
    fn runs_and_overlaps() {
        assert_eq!(runs(&[0, 1, 2, 5, 6, 9]), vec![0..3, 5..7, 9..10]);
        assert_eq!(overlap(&(0..5), &(3..9)), (3, 5));
        assert_eq!(overlap(&(0..3), &(4..9)), (4, 4));
        assert_eq!(overlap(&(10..12), &(4..9)), (9, 9));
    }

    fn params() -> Vec<(String, Tensor)> {
        [(2usize, 3usize), (1, 5), (4, 1), (3, 3)]
            .iter()
            .enumerate()
            .map(|(i, &(a, b))| {
                let v: Vec<f32> = (0..a * b).map(|j| (i * 100 + j) as f32).collect();
                (
                    format!("p{i}"),
                    Tensor::from_vec(v, (a, b), &Device::Cpu).unwrap(),
                )
            })
            .collect()
    }

    /// On 1 to 4 thread ranks: gathers give back the whole parameters, reduce-scatters sum
    /// each rank's gradients into its range, and a moment consolidates into whole tensors
    /// that `range_of` cuts back into every rank's range.
    #[test]
    fn gathers_and_reduces_over_thread_ranks() {
        for n in 1..=4 {
            let handles: Vec<_> = Threads::world(n)
                .into_iter()
                .map(|w| {
                    std::thread::spawn(move || {
                        let w = Arc::new(w);
                        let p = ShardedParams::new(&params(), w.clone()).unwrap();
                        let got = p.gather(&[0, 1, 3]).unwrap();
                        let all = params();
                        for (g, i) in got.iter().zip([0, 1, 3]) {
                            let want = all[i].1.to_vec2::<f32>().unwrap();
                            assert_eq!(g.to_vec2::<f32>().unwrap(), want);
                        }
                        let grads: Vec<Tensor> = params()
                            .iter()
                            .map(|(_, t)| (t.ones_like().unwrap() * (w.rank() + 1) as f64).unwrap())
                            .collect();
                        let mut acc = vec![0f32; p.shard().range().len()];
                        p.reduce_into(&[0, 1, 2, 3], &grads, &mut acc).unwrap();
                        let sum = (n * (n + 1) / 2) as f32;
                        assert!(acc.iter().all(|&a| a == sum), "{acc:?}");
                        let mine: Vec<f32> = p.mine().to_vec1().unwrap();
                        let whole = p.consolidate("exp_avg", &mine).unwrap();
                        let whole = match whole {
                            Some(v) => v,
                            None => return (w.rank(), None),
                        };
                        let map: HashMap<String, Tensor> = whole.into_iter().collect();
                        (
                            w.rank(),
                            Some(
                                p.range_of(&map, "exp_avg")
                                    .unwrap()
                                    .to_vec1::<f32>()
                                    .unwrap()
                                    == mine,
                            ),
                        )
                    })
                })
                .collect();
            for h in handles {
                let (rank, same) = h.join().unwrap();
                assert_eq!(same.is_some(), rank == 0);
                assert!(same.unwrap_or(true));
            }
        }
    }

    /// AdamW over the sharded parameters (stage 3) on 2 and 3 thread ranks steps as the
    /// unsharded optimizer does on the world's summed gradients (to float tolerance: the norm
    /// is summed from the ranks' parts), and consolidates its moments into the unsharded ones,
    /// which load back into any world's ranges.
    #[test]
    fn stage_three_adamw_steps_as_the_unsharded_one() {
        use crate::optim::{clip_factor, AdamW, AdamWConfig};
        let cfg = AdamWConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        };
        fn grads(r: usize, t: usize) -> Vec<Tensor> {
            params()
                .iter()
                .map(|(_, p)| (p.sin().unwrap() * ((r + t + 1) as f64 * 0.01)).unwrap())
                .collect()
        }
        for n in [2, 3] {
            let vars: Vec<(String, Var)> = params()
                .into_iter()
                .map(|(k, t)| (k, Var::from_tensor(&t).unwrap()))
                .collect();
            let mut one = AdamW::new(vars.clone(), cfg).unwrap();
            for t in 0..3 {
                let mut sum = grads(0, t);
                for r in 1..n {
                    for (s, g) in sum.iter_mut().zip(grads(r, t)) {
                        *s = (&*s + g).unwrap();
                    }
                }
                let (_, scale) = clip_factor(&sum, 1.0, one.compute()).unwrap();
                one.step(&sum, 1e-2, scale).unwrap();
            }
            let want: Vec<Vec<f32>> = vars
                .iter()
                .map(|(_, v)| v.flatten_all().unwrap().to_vec1().unwrap())
                .collect();
            let state = one.state_tensors().unwrap();
            let handles: Vec<_> = Threads::world(n)
                .into_iter()
                .map(|w| {
                    std::thread::spawn(move || {
                        let w = Arc::new(w);
                        let p = Arc::new(ShardedParams::new(&params(), w.clone()).unwrap());
                        let mut opt = AdamW::over_sharded(p.clone(), cfg).unwrap();
                        for t in 0..3 {
                            let mut acc = vec![0f32; p.shard().range().len()];
                            p.reduce_into(&[0, 1, 2, 3], &grads(w.rank(), t), &mut acc)
                                .unwrap();
                            let len = acc.len();
                            let g = Tensor::from_vec(acc, len, &Device::Cpu).unwrap();
                            let g = opt.reduce(vec![g], &*w).unwrap();
                            let (_, scale) = opt.clip(&g, 1.0, &*w).unwrap();
                            opt.update(g, 1e-2, scale, &*w).unwrap();
                        }
                        let all = p.gather_all().unwrap();
                        let got: Vec<Vec<f32>> = all
                            .iter()
                            .map(|(_, t)| t.flatten_all().unwrap().to_vec1().unwrap())
                            .collect();
                        (got, opt.consolidated_state(&*w).unwrap())
                    })
                })
                .collect();
            let close = |a: &[f32], b: &[f32]| {
                a.iter()
                    .zip(b)
                    .all(|(x, y)| (x - y).abs() <= 1e-5 * y.abs().max(1e-2))
            };
            for (rank, h) in handles.into_iter().enumerate() {
                let (got, moments) = h.join().unwrap();
                for (a, b) in got.iter().zip(&want) {
                    assert!(close(a, b), "{n} ranks: {a:?} vs {b:?}");
                }
                assert_eq!(moments.is_some(), rank == 0);
                let Some(moments) = moments else { continue };
                let m: HashMap<String, Tensor> = moments.into_iter().collect();
                assert_eq!(m.len(), state.len());
                for (k, t) in &state {
                    let a: Vec<f32> = m[k].flatten_all().unwrap().to_vec1().unwrap();
                    let b: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
                    assert_eq!(m[k].shape(), t.shape(), "{k}");
                    assert!(close(&a, &b), "{k}: {a:?} vs {b:?}");
                }
            }
            // The unsharded moments load into a stage-3 optimizer in one process.
            let alone = Arc::new(Threads::world(1).pop().unwrap());
            let p = Arc::new(ShardedParams::new(&params(), alone).unwrap());
            let mut opt = AdamW::over_sharded(p, cfg).unwrap();
            let map: HashMap<String, Tensor> = state.iter().cloned().collect();
            opt.load_state(&map, 3).unwrap();
            assert_eq!(opt.steps_taken(), 3);
            assert_eq!(opt.state_bytes(), 8 * 24);
        }
    }
}
