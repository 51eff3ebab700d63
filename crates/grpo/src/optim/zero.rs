//! Sharded optimizer state (`zero_stage`, DeepSpeed ZeRO's stages; FSDP's `SHARD_GRAD_OP` is
//! stage 2). The trainable parameters, flattened and concatenated in the optimizer's order, are
//! split into one contiguous range per rank, of near-equal lengths ([`Shard`]); rank `r` keeps
//! AdamW's moments for range `r` only.
//!
//! - Stage 1: the gradients are summed over the world as in stage 0, clipped by their global
//!   norm; each rank steps its range with the same fused update (so the numbers are stage 0's to
//!   the bit), then the ranges are gathered so that every rank holds the whole updated
//!   parameters for its next forward.
//! - Stage 2: each rank receives only its range of the summed gradients (a reduce-scatter, and
//!   the full gradients are freed bucket by bucket as they are sent); the global norm comes from
//!   every rank's sum of squares. Then as stage 1.
//! - Stage 3: the parameters sharded too ([`super::zero3`]).
//!
//! Checkpoints stay consolidated: [`AdamW::consolidated_state`] gathers each moment whole, so the
//! main rank writes the `optimizer.safetensors` of an unsharded run, which any world size and
//! stage resumes from ([`AdamW::load_state`] keeps its range).

use std::ops::Range;

use candle_core::{CpuStorage, DType, Layout, Storage, Tensor, Var};
use grpo_models::kernels::{device_kind, DeviceKind};

use super::{clip_of, AdamW};
use crate::{Error, Result};

/// The processes an optimizer's state is sharded over, and the collectives its step needs (the
/// training loop's `train::World` is one). Every rank calls each at the same point.
pub trait Ranks {
    /// This process's rank, `0..size`.
    fn rank(&self) -> usize;
    /// How many processes train together.
    fn size(&self) -> usize;
    /// Whether this process writes checkpoints.
    fn is_main(&self) -> bool {
        self.rank() == 0
    }
    /// Sums `xs` element-wise over every process, in place.
    fn sum_f64(&self, xs: &mut [f64]) -> Result<()>;
    /// Sums each gradient over every process, in place.
    fn sum_grads(&self, grads: &mut [Tensor]) -> Result<()>;
    /// This process's part `counts[rank]` of the element-wise sum of `xs` over every process.
    fn reduce_scatter_f32(&self, xs: &[f32], counts: &[usize]) -> Result<Vec<f32>>;
    /// Every process's `mine`, concatenated in rank order.
    fn all_gather_f32(&self, mine: &[f32]) -> Result<Vec<f32>>;
}

/// One process: every collective is the identity.
pub(super) struct Alone;

impl Ranks for Alone {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn sum_f64(&self, _xs: &mut [f64]) -> Result<()> {
        Ok(())
    }
    fn sum_grads(&self, _grads: &mut [Tensor]) -> Result<()> {
        Ok(())
    }
    fn reduce_scatter_f32(&self, xs: &[f32], _counts: &[usize]) -> Result<Vec<f32>> {
        Ok(xs.to_vec())
    }
    fn all_gather_f32(&self, mine: &[f32]) -> Result<Vec<f32>> {
        Ok(mine.to_vec())
    }
}

/// How much of the training state each rank keeps (`zero_stage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ZeroStage {
    /// 0: every rank keeps the whole state and takes the whole step.
    #[default]
    Off,
    /// 1: AdamW's moments sharded.
    Moments,
    /// 2: moments and gradients sharded.
    Gradients,
    /// 3: the parameters sharded too, gathered block by block ([`super::zero3`]).
    Params,
}

impl ZeroStage {
    /// The stage of `zero_stage = n`.
    pub fn from_number(n: i64) -> std::result::Result<ZeroStage, String> {
        match n {
            0 => Ok(ZeroStage::Off),
            1 => Ok(ZeroStage::Moments),
            2 => Ok(ZeroStage::Gradients),
            3 => Ok(ZeroStage::Params),
            n => Err(format!("must be 0, 1, 2 or 3, got {n}")),
        }
    }

    pub fn number(self) -> usize {
        match self {
            ZeroStage::Off => 0,
            ZeroStage::Moments => 1,
            ZeroStage::Gradients => 2,
            ZeroStage::Params => 3,
        }
    }
}

/// The split of `total` flattened parameters into contiguous ranges, one per rank in rank
/// order, of near-equal lengths (the first `total % ranks` one element longer); and this rank's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shard {
    rank: usize,
    /// Where each rank's range starts, then `total`.
    bounds: Vec<usize>,
}

impl Shard {
    /// Rank `rank` of `ranks`' range of `total` elements.
    pub fn new(total: usize, rank: usize, ranks: usize) -> Shard {
        let ranks = ranks.max(1);
        let (base, extra) = (total / ranks, total % ranks);
        let bounds = (0..=ranks)
            .map(|r| r * base + r.min(extra))
            .collect::<Vec<_>>();
        Shard {
            rank: rank.min(ranks - 1),
            bounds,
        }
    }

    /// One range: everything (the unsharded state).
    pub fn whole(total: usize) -> Shard {
        Shard::new(total, 0, 1)
    }

    /// How many ranks share the state.
    pub fn parts(&self) -> usize {
        self.bounds.len() - 1
    }

    /// All the flattened elements.
    pub fn total(&self) -> usize {
        self.bounds[self.parts()]
    }

    /// This rank's range.
    pub fn range(&self) -> Range<usize> {
        self.range_of(self.rank)
    }

    /// Rank `r`'s range.
    pub fn range_of(&self, r: usize) -> Range<usize> {
        self.bounds[r]..self.bounds[r + 1]
    }

    /// How many elements of `window` each rank owns, in rank order (they tile it).
    pub fn counts_in(&self, window: &Range<usize>) -> Vec<usize> {
        (0..self.parts())
            .map(|r| {
                let o = self.range_of(r);
                o.end
                    .min(window.end)
                    .saturating_sub(o.start.max(window.start))
            })
            .collect()
    }
}

/// The world's gradients, as an optimizer's stage takes them ([`AdamW::reduce`]).
#[derive(Debug)]
pub enum Gradients {
    /// Every parameter's gradient summed over the world, in the optimizer's order.
    Full(Vec<Tensor>),
    /// This rank's range of the flattened gradients, summed over the world (stage 2).
    Part(Vec<f32>),
}

/// Parameters are reduced and gathered in windows of whole parameters of at most this many
/// elements (a larger one alone): one collective each, and at most a window's copy alive.
pub const WINDOW: usize = 1 << 22;

/// Consecutive parameters of `sizes` elements grouped into windows of at most [`WINDOW`]
/// elements (a larger one alone): each window's parameter indices and flat element range.
pub(super) fn windows(sizes: &[usize]) -> Vec<(Range<usize>, Range<usize>)> {
    let mut out = Vec::new();
    let (mut i, mut at) = (0, 0);
    while i < sizes.len() {
        let (mut j, mut n) = (i, 0);
        while j < sizes.len() && (j == i || n + sizes[j] <= WINDOW) {
            n += sizes[j];
            j += 1;
        }
        out.push((i..j, at..at + n));
        (i, at) = (j, at + n);
    }
    out
}

/// Stage 2: this rank's range of `grads` (this rank's gradients, in the optimizer's order)
/// summed over the world. Each window of gradients is sent by one reduce-scatter, then freed.
pub(super) fn reduce_scatter<R: Ranks + ?Sized>(
    grads: Vec<Tensor>,
    shard: &Shard,
    world: &R,
) -> Result<Vec<f32>> {
    let sizes: Vec<usize> = grads.iter().map(Tensor::elem_count).collect();
    if sizes.iter().sum::<usize>() != shard.total() {
        return Err(Error::Invariant(format!(
            "zero: gradients of {} elements for parameters of {}",
            sizes.iter().sum::<usize>(),
            shard.total()
        )));
    }
    let mut part = Vec::with_capacity(shard.range().len());
    let mut grads = grads.into_iter();
    for (params, range) in windows(&sizes) {
        let counts = shard.counts_in(&range);
        // This window's gradients, freed once sent.
        let window: Vec<Tensor> = grads.by_ref().take(params.len()).collect();
        let mine = reduce_window(&window, range.len(), &counts, world)?;
        drop(window);
        part.extend_from_slice(&mine);
    }
    if part.len() != shard.range().len() {
        return Err(Error::Invariant(format!(
            "zero: received {} gradient values for a range of {}",
            part.len(),
            shard.range().len()
        )));
    }
    Ok(part)
}

/// One window's reduce-scatter: `grads` (whole parameters, `len` elements together) summed over
/// the world, this rank's `counts` share returned. A gradient alone in its window is sent from
/// its own storage; several are first copied into one buffer.
pub(super) fn reduce_window<R: Ranks + ?Sized>(
    grads: &[Tensor],
    len: usize,
    counts: &[usize],
    world: &R,
) -> Result<Vec<f32>> {
    let sent: usize = grads.iter().map(Tensor::elem_count).sum();
    if sent != len {
        return Err(Error::Invariant(format!(
            "zero: gradients of {sent} values for a window of {len}"
        )));
    }
    match grads {
        [g] => with_host_f32(g, |xs| world.reduce_scatter_f32(xs, counts)),
        many => {
            let mut buf: Vec<f32> = Vec::with_capacity(len);
            for g in many {
                with_host_f32(g, |xs| {
                    buf.extend_from_slice(xs);
                    Ok(())
                })?;
            }
            world.reduce_scatter_f32(&buf, counts)
        }
    }
}

/// The global L2 norm of the gradients of which `part` is this rank's range (the world's sum of
/// the ranks' sums of squares) and torch's clipping factor for it.
pub(super) fn clip_part<R: Ranks + ?Sized>(
    part: &[f32],
    max_norm: f64,
    world: &R,
) -> Result<(f64, f32)> {
    let mut sq = [part.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>()];
    world.sum_f64(&mut sq)?;
    Ok(clip_of(sq[0].sqrt(), max_norm))
}

impl AdamW {
    /// After each rank stepped its range: every rank's ranges gathered into every rank's
    /// parameters, a window of parameters per all-gather.
    pub(super) fn gather_parameters<R: Ranks + ?Sized>(&mut self, world: &R) -> Result<()> {
        let sizes: Vec<usize> = self.slots.iter().map(|s| s.var.elem_count()).collect();
        for (params, range) in windows(&sizes) {
            let slots = &self.slots[params];
            let all = match slots {
                [s] => with_host_f32(s.var.as_tensor(), |p| {
                    world.all_gather_f32(&p[s.part.clone()])
                })?,
                many => {
                    let mut mine = Vec::new();
                    for s in many {
                        with_host_f32(s.var.as_tensor(), |p| {
                            mine.extend_from_slice(&p[s.part.clone()]);
                            Ok(())
                        })?;
                    }
                    world.all_gather_f32(&mine)?
                }
            };
            if all.len() != range.len() {
                return Err(Error::Invariant(format!(
                    "zero: gathered {} parameter values for a window of {}",
                    all.len(),
                    range.len()
                )));
            }
            let mut at = 0;
            for s in slots {
                let n = s.var.elem_count();
                // A parameter this rank stepped whole is already up to date.
                if !s.whole() {
                    write_flat(&s.var, &all[at..at + n])?;
                }
                at += n;
            }
        }
        Ok(())
    }

    /// The moments as [`AdamW::state_tensors`] names them, whole, on the main rank (`None` on
    /// the others): a sharded state is gathered parameter by parameter, so every rank calls it
    /// (an unsharded one is read on the main rank alone).
    pub fn consolidated_state<R: Ranks + ?Sized>(
        &self,
        world: &R,
    ) -> Result<Option<Vec<(String, Tensor)>>> {
        if let (Some(p), [s]) = (&self.flat, self.slots.as_slice()) {
            let m = s
                .moments
                .with_host(false, |m| p.consolidate("exp_avg", m))?;
            let v = s
                .moments
                .with_host(true, |v| p.consolidate("exp_avg_sq", v))?;
            return Ok(m.zip(v).map(|(m, v)| m.into_iter().chain(v).collect()));
        }
        if self.shard.parts() == 1 {
            return match world.is_main() {
                true => self.state_tensors().map(Some),
                false => Ok(None),
            };
        }
        let cpu = candle_core::Device::Cpu;
        let mut out = Vec::with_capacity(2 * self.slots.len());
        for s in &self.slots {
            for (prefix, second) in [("exp_avg", false), ("exp_avg_sq", true)] {
                let all = s.moments.with_host(second, |m| world.all_gather_f32(m))?;
                if all.len() != s.var.elem_count() {
                    return Err(Error::Invariant(format!(
                        "zero: gathered {} values of {prefix}.{}, of {} elements",
                        all.len(),
                        s.name,
                        s.var.elem_count()
                    )));
                }
                if world.is_main() {
                    let t = Tensor::from_vec(all, s.var.shape(), &cpu)?;
                    out.push((format!("{prefix}.{}", s.name), t));
                }
            }
        }
        Ok(world.is_main().then_some(out))
    }
}

/// `t`'s values, flat, as one f32 slice handed to `f`: its own storage where it is a contiguous
/// f32 tensor on the CPU (no copy: a gradient or parameter of hundreds of MB), else a host copy.
pub(crate) fn with_host_f32<T>(t: &Tensor, f: impl FnOnce(&[f32]) -> Result<T>) -> Result<T> {
    {
        let (st, l) = t.storage_and_layout();
        if let (Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) = (&*st, l.contiguous_offsets()) {
            return f(&v[a..b]);
        }
    }
    f(&t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?)
}

/// Writes `values` (flat, f32) into `var`: in place on the CPU, elsewhere through a tensor.
fn write_flat(var: &Var, values: &[f32]) -> Result<()> {
    if device_kind(var.device()) == DeviceKind::Cpu && var.is_contiguous() {
        var.as_tensor().inplace_op1(&CopyFrom(values))?;
    } else {
        var.set(&Tensor::from_slice(values, var.shape(), var.device())?)?;
    }
    Ok(())
}

/// An in-place copy of a host slice into a contiguous f32 CPU tensor.
pub(crate) struct CopyFrom<'a>(pub(crate) &'a [f32]);

impl candle_core::InplaceOp1 for CopyFrom<'_> {
    fn name(&self) -> &'static str {
        "copy-from"
    }
    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> candle_core::Result<()> {
        let (CpuStorage::F32(v), Some((a, b))) = (s, l.contiguous_offsets()) else {
            candle_core::bail!("copy-from: contiguous f32 tensors only");
        };
        if b - a != self.0.len() {
            candle_core::bail!("copy-from: {} values into {}", self.0.len(), b - a);
        }
        v[a..b].copy_from_slice(self.0);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::test_world::Threads;
    use super::*;
    use crate::optim::AdamWConfig;
    use candle_core::{Device, Var};
    use std::sync::Arc;

    #[test]
    fn ranges_tile_the_parameters_in_near_equal_parts() {
        for (total, ranks) in [(10, 3), (3, 4), (0, 2), (7, 1), (1 << 20, 8)] {
            let shards: Vec<Shard> = (0..ranks).map(|r| Shard::new(total, r, ranks)).collect();
            let mut at = 0;
            for s in &shards {
                let r = s.range();
                assert_eq!(r.start, at, "{total} over {ranks}");
                at = r.end;
                assert!(r.len() == total / ranks || r.len() == total / ranks + 1);
            }
            assert_eq!(at, total);
        }
        let s = Shard::new(10, 1, 3); // 0..4, 4..7, 7..10
        assert_eq!(s.range(), 4..7);
        assert_eq!(s.counts_in(&(2..8)), vec![2, 3, 1]);
        assert_eq!(s.counts_in(&(8..10)), vec![0, 0, 2]);
        assert_eq!(Shard::whole(5).counts_in(&(1..4)), vec![3]);
    }

    #[test]
    fn windows_hold_whole_parameters() {
        let w = windows(&[3, WINDOW, 2, 2, WINDOW - 4, 1]);
        let params: Vec<_> = w.iter().map(|(p, _)| p.clone()).collect();
        assert_eq!(params, vec![0..1, 1..2, 2..5, 5..6]);
        assert_eq!(w[2].1, WINDOW + 3..2 * WINDOW + 3);
    }

    #[test]
    fn stages_read_0_to_3() {
        for n in 0..=3 {
            assert_eq!(ZeroStage::from_number(n).unwrap().number() as i64, n);
        }
        let e = ZeroStage::from_number(4).unwrap_err();
        assert!(e.contains("0, 1, 2 or 3"), "{e}");
        assert!(ZeroStage::from_number(-1).is_err());
    }

    const CFG: AdamWConfig = AdamWConfig {
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
    };

    /// Three parameters of 5, 7 and 1 elements (13: ranges that cut through them).
    fn params() -> Vec<(String, Var)> {
        [5usize, 7, 1]
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let v: Vec<f32> = (0..n).map(|j| (i * 10 + j) as f32 * 0.1 - 0.4).collect();
                (
                    format!("p{i}"),
                    Var::new(v.as_slice(), &Device::Cpu).unwrap(),
                )
            })
            .collect()
    }

    /// Rank `r`'s gradients at step `t`: the world's sum differs per element and per step.
    fn grads(r: usize, t: usize) -> Vec<Tensor> {
        [5usize, 7, 1]
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let g: Vec<f32> = (0..n)
                    .map(|j| ((i + j + r) as f32 * 0.37 + t as f32).sin())
                    .collect();
                Tensor::new(g.as_slice(), &Device::Cpu).unwrap()
            })
            .collect()
    }

    fn values(ps: &[(String, Var)]) -> Vec<Vec<f32>> {
        ps.iter().map(|(_, v)| v.to_vec1().unwrap()).collect()
    }

    /// The unsharded optimizer on the world's summed gradients: parameters and moments after 3
    /// steps, clipped to norm 1.
    fn unsharded(n: usize) -> (Vec<Vec<f32>>, Vec<(String, Tensor)>) {
        let ps = params();
        let mut opt = AdamW::new(ps.clone(), CFG).unwrap();
        for t in 0..3 {
            let mut sum = grads(0, t);
            for r in 1..n {
                for (s, g) in sum.iter_mut().zip(grads(r, t)) {
                    *s = (&*s + g).unwrap();
                }
            }
            let (_, scale) = super::super::clip_factor(&sum, 1.0, opt.compute()).unwrap();
            opt.step(&sum, 1e-2, scale).unwrap();
        }
        (values(&ps), opt.state_tensors().unwrap())
    }

    /// `stage` on `n` thread ranks, as `optimizer_step` runs it: parameters after 3 steps (the
    /// same on every rank) and the main rank's consolidated moments.
    fn sharded(stage: ZeroStage, n: usize) -> (Vec<Vec<f32>>, Vec<(String, Tensor)>) {
        let handles: Vec<_> = Threads::world(n)
            .into_iter()
            .map(|w| {
                std::thread::spawn(move || {
                    let ps = params();
                    let mut opt = AdamW::sharded(ps.clone(), CFG, stage, &w).unwrap();
                    assert!(opt.state_bytes() <= 8 * 13usize.div_ceil(n));
                    for t in 0..3 {
                        let g = opt.reduce(grads(w.rank, t), &w).unwrap();
                        let (_, scale) = opt.clip(&g, 1.0, &w).unwrap();
                        opt.update(g, 1e-2, scale, &w).unwrap();
                    }
                    (values(&ps), opt.consolidated_state(&w).unwrap())
                })
            })
            .collect();
        let out: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        for (p, _) in &out {
            assert_eq!(p, &out[0].0, "every rank holds the same parameters");
        }
        assert!(out[1..].iter().all(|(_, s)| s.is_none()));
        let (p, s) = out.into_iter().next().unwrap();
        (p, s.unwrap())
    }

    fn flat(state: &[(String, Tensor)]) -> Vec<(String, Vec<f32>)> {
        state
            .iter()
            .map(|(k, t)| (k.clone(), t.flatten_all().unwrap().to_vec1().unwrap()))
            .collect()
    }

    /// Stage 1 is stage 0 to the bit (the same sums, the same fused step per element); stage 2
    /// to float tolerance (its norm is summed in another order); both consolidate the moments
    /// into what the unsharded optimizer saves.
    #[test]
    fn sharded_steps_match_the_unsharded_optimizer() {
        for n in [2, 3] {
            let (p0, s0) = unsharded(n);
            let (p1, s1) = sharded(ZeroStage::Moments, n);
            assert_eq!(p1, p0, "stage 1 on {n} ranks");
            assert_eq!(flat(&s1), flat(&s0), "stage 1 moments on {n} ranks");
            let (p2, s2) = sharded(ZeroStage::Gradients, n);
            let close = |a: &[f32], b: &[f32]| {
                a.iter()
                    .zip(b)
                    .all(|(x, y)| (x - y).abs() <= 1e-6 * y.abs().max(1e-3))
            };
            for (a, b) in p2.iter().zip(&p0) {
                assert!(close(a, b), "stage 2 on {n} ranks: {a:?} vs {b:?}");
            }
            for ((ka, a), (kb, b)) in flat(&s2).iter().zip(&flat(&s0)) {
                assert_eq!(ka, kb);
                assert!(close(a, b), "{ka} on {n} ranks: {a:?} vs {b:?}");
            }
        }
    }

    /// A consolidated checkpoint resumes on another world size: 3 ranks' moments loaded by 2
    /// ranks (each its range) step as the unsharded optimizer does.
    #[test]
    fn a_consolidated_state_loads_on_another_world_size() {
        let (_, s3) = sharded(ZeroStage::Moments, 3);
        let state: std::collections::HashMap<String, Tensor> = s3.into_iter().collect();
        let state = Arc::new(state);
        let start = params();
        let one = {
            let ps = params();
            let mut opt = AdamW::new(ps.clone(), CFG).unwrap();
            opt.load_state(&state, 3).unwrap();
            opt.step(&grads(0, 9), 1e-2, 1.0).unwrap();
            values(&ps)
        };
        let handles: Vec<_> = Threads::world(2)
            .into_iter()
            .map(|w| {
                let state = state.clone();
                std::thread::spawn(move || {
                    let ps = params();
                    let mut opt = AdamW::sharded(ps.clone(), CFG, ZeroStage::Moments, &w).unwrap();
                    opt.load_state(&state, 3).unwrap();
                    // Rank 0 holds the whole gradient, rank 1 zeros: the sum is rank 0's.
                    let g: Vec<Tensor> = grads(0, 9)
                        .into_iter()
                        .map(|g| {
                            if w.rank == 0 {
                                g
                            } else {
                                g.zeros_like().unwrap()
                            }
                        })
                        .collect();
                    let g = opt.reduce(g, &w).unwrap();
                    opt.update(g, 1e-2, 1.0, &w).unwrap();
                    values(&ps)
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), one);
        }
        assert_ne!(one, values(&start));
        // A sharded optimizer is not stepped in a world it was not split for.
        let two = Threads::world(2);
        let mut opt = AdamW::sharded(params(), CFG, ZeroStage::Moments, &two[0]).unwrap();
        assert!(opt.step(&grads(0, 0), 1e-2, 1.0).is_err());
        // In one process, any stage is the unsharded optimizer.
        let opt = AdamW::sharded(params(), CFG, ZeroStage::Gradients, &Alone).unwrap();
        assert_eq!(opt.state_bytes(), 8 * 13);
    }
}

/// A world of threads for the sharding tests.
#[cfg(test)]
pub(crate) mod test_world {
    use super::*;
    use std::sync::{Arc, Barrier, Mutex};

    /// An in-memory world of `n` ranks, each a thread: every collective is a barrier around a
    /// shared table of the ranks' contributions (f32 sums in f32, in rank order).
    pub(crate) struct Threads {
        pub(crate) rank: usize,
        pub(crate) n: usize,
        barrier: Arc<Barrier>,
        table: Arc<Mutex<Vec<Vec<f64>>>>,
    }

    impl Threads {
        pub(crate) fn world(n: usize) -> Vec<Threads> {
            let barrier = Arc::new(Barrier::new(n));
            let table = Arc::new(Mutex::new(vec![Vec::new(); n]));
            (0..n)
                .map(|rank| Threads {
                    rank,
                    n,
                    barrier: barrier.clone(),
                    table: table.clone(),
                })
                .collect()
        }

        /// Every rank's `mine`, in rank order (f32 values are exact as f64).
        fn gather(&self, mine: Vec<f64>) -> Vec<Vec<f64>> {
            self.table.lock().unwrap()[self.rank] = mine;
            self.barrier.wait();
            let all = self.table.lock().unwrap().clone();
            self.barrier.wait();
            all
        }

        fn sum_f32(&self, xs: &mut [f32]) {
            let all = self.gather(xs.iter().map(|&x| x as f64).collect());
            for (i, x) in xs.iter_mut().enumerate() {
                *x = all.iter().map(|v| v[i] as f32).sum();
            }
        }
    }

    impl Ranks for Threads {
        fn rank(&self) -> usize {
            self.rank
        }
        fn size(&self) -> usize {
            self.n
        }
        fn sum_f64(&self, xs: &mut [f64]) -> Result<()> {
            let all = self.gather(xs.to_vec());
            for (i, x) in xs.iter_mut().enumerate() {
                *x = all.iter().map(|v| v[i]).sum();
            }
            Ok(())
        }
        fn sum_grads(&self, grads: &mut [Tensor]) -> Result<()> {
            for g in grads.iter_mut() {
                let mut v = g.flatten_all()?.to_vec1::<f32>()?;
                self.sum_f32(&mut v);
                *g = Tensor::from_vec(v, g.shape(), g.device())?;
            }
            Ok(())
        }
        fn reduce_scatter_f32(&self, xs: &[f32], counts: &[usize]) -> Result<Vec<f32>> {
            let mut all = xs.to_vec();
            self.sum_f32(&mut all);
            let start: usize = counts[..self.rank].iter().sum();
            Ok(all[start..start + counts[self.rank]].to_vec())
        }
        fn all_gather_f32(&self, mine: &[f32]) -> Result<Vec<f32>> {
            let all = self.gather(mine.iter().map(|&x| x as f64).collect());
            Ok(all.concat().into_iter().map(|x| x as f32).collect())
        }
    }
}
