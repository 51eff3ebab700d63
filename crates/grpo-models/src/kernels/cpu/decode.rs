//! The fused decoding step of the Llama family on the CPU (f32, packed weights): one new token
//! per row through every layer and the LM head, computed by a team of the thread pool's threads
//! that meet at spin barriers between phases.
//!
//! The tensor path (`models::CausalLm::forward_cached`) runs a dozen small parallel ops per layer,
//! each a fork and join of the pool with a sleeping worker to wake, and cores sit idle between
//! them (bench/README.md). Here every thread takes an equal share of
//! each phase and goes straight on to the next once the others are done with the current one:
//! - rows: residual add and RMSNorm, SiLU(gate) * up;
//! - (row, KV head) pairs: q/k norms (Qwen3), RoPE, and attention over the cache
//!   ([`crate::kernels::cpu::fused_attention::decode_head`]), reading a group's shared prompt from its leader;
//! - column panels: the packed projections ([`PackedWeight::panels_simd`], AVX2 or AVX-512) and their biases.
//!
//! Each element is computed with the same operations in the same order as on the tensor path, so
//! the two agree to rounding (tests compare logits and the cache). The step's new keys and
//! values are kept aside during the step (the cache's storage is only read meanwhile) and written
//! into the cache after it.

use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use candle_core::{bail, CpuStorage, DType, Result, Storage, Tensor};

use crate::kernels::cpu::packed::{share, PackedWeight, PANEL};
use crate::kernels::mask::SharedPrefix;
use crate::kv_cache::KvCache;

/// What the fused step reads of a LoRA adapter (`models::LoraAdapter` is one): `A` [r, in],
/// `B` [out, r], the scale, whether it drops out its input, and its (in, out) sizes.
pub trait LowRank {
    fn a(&self) -> &Tensor;
    fn b(&self) -> &Tensor;
    fn scale(&self) -> f64;
    fn has_dropout(&self) -> bool;
    fn dims(&self) -> Result<(usize, usize)>;
}

/// A packed projection, its bias, and the LoRA adapters left on it (QLoRA's: a quantized base
/// cannot take them merged).
#[derive(Debug)]
pub struct Proj {
    pub w: Arc<PackedWeight>,
    pub bias: Option<Vec<f32>>,
    pub lora: Option<ProjLora>,
}

/// The LoRA adapters of a packed projection's parts as one low-rank product added after the
/// bias: `y += ((x A^T) B^T) * scale`, as `models::LoraAdapter::forward` computes each
/// (no dropout: a sampling model's adapters). `A` stacks the parts' `A`s ([R, in]); `B` is
/// block diagonal ([out, R]: part `i`'s rows see only its own rank), so each output column sums
/// its own part's rank in order and adds zeros for the others'.
#[derive(Debug)]
pub struct ProjLora {
    /// [in -> R]
    pub a: PackedWeight,
    /// [R -> out]
    pub b: PackedWeight,
    /// Per output column: its part's scale (0 for parts without an adapter).
    pub scale: Vec<f32>,
}

impl ProjLora {
    /// From each part's adapter (or none) and output size, for a projection of `in_dim` inputs;
    /// `None` when no part has one, or one drops out its input or is not f32 on the CPU.
    pub fn new<L: LowRank>(parts: &[(Option<&L>, usize)], in_dim: usize) -> Result<Option<Self>> {
        let host = |t: &Tensor| -> Result<Option<Vec<f32>>> {
            match t.device().is_cpu() && t.dtype() == DType::F32 {
                true => Ok(Some(t.flatten_all()?.to_vec1()?)),
                false => Ok(None),
            }
        };
        let rank: usize = parts
            .iter()
            .flat_map(|(l, _)| l.map(|l| l.a().dim(0)))
            .sum::<Result<_>>()?;
        let out: usize = parts.iter().map(|(_, o)| o).sum();
        if rank == 0
            || parts
                .iter()
                .any(|(l, _)| l.is_some_and(|l| l.has_dropout()))
        {
            return Ok(None);
        }
        let (mut a, mut b) = (Vec::with_capacity(rank * in_dim), vec![0f32; out * rank]);
        let mut scale = vec![0f32; out];
        let (mut r0, mut o0) = (0, 0);
        for (lora, o) in parts {
            if let Some(l) = lora {
                let (Some(la), Some(lb)) = (host(l.a())?, host(l.b())?) else {
                    return Ok(None);
                };
                let r = l.a().dim(0)?;
                if l.dims()? != (in_dim, *o) {
                    bail!(
                        "adapter shape {:?} does not match its part's ({in_dim}, {o})",
                        l.dims()?
                    );
                }
                a.extend_from_slice(&la); // [r, in]
                for (j, row) in lb.chunks_exact(r).enumerate() {
                    b[(o0 + j) * rank + r0..(o0 + j) * rank + r0 + r].copy_from_slice(row);
                }
                scale[o0..o0 + o].fill(l.scale() as f32);
                r0 += r;
            }
            o0 += o;
        }
        let dev = candle_core::Device::Cpu;
        Ok(Some(ProjLora {
            a: PackedWeight::from_out_in(&Tensor::from_vec(a, (rank, in_dim), &dev)?)?,
            b: PackedWeight::from_out_in(&Tensor::from_vec(b, (out, rank), &dev)?)?,
            scale,
        }))
    }
}

/// One decoder layer's weights for the fused step.
#[derive(Debug)]
pub struct LayerPlan {
    pub input_layernorm: Vec<f32>,
    pub post_attention_layernorm: Vec<f32>,
    /// Qwen3's per-head q/k RMSNorm weights.
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    /// q, k, v side by side.
    pub qkv: Proj,
    pub o: Proj,
    /// gate, up side by side.
    pub gate_up: Proj,
    pub down: Proj,
}

/// The whole model's weights for the fused step, built once by
/// `models::CausalLm::pack_for_decoding`.
#[derive(Debug)]
pub struct Plan {
    pub layers: Vec<LayerPlan>,
    pub norm: Vec<f32>,
    pub eps: f32,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub hidden: usize,
    pub intermediate: usize,
    /// `[vocab, hidden]`
    pub embed: Tensor,
    /// RoPE tables `[max_pos, head_dim / 2]`.
    pub cos: Tensor,
    pub sin: Tensor,
}

impl Plan {
    /// Whether the shapes fit together (a plan that does not is never used).
    pub fn consistent(&self, head: &PackedWeight) -> bool {
        let (h, nh, nkv, d, i) = (
            self.hidden,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.intermediate,
        );
        let norm_ok = |n: &Option<Vec<f32>>| n.as_ref().is_none_or(|w| w.len() == d);
        let proj_ok = |p: &Proj, k: usize, n: usize| {
            p.w.dims() == (k, n)
                && p.bias.as_ref().is_none_or(|b| b.len() == n)
                && p.lora.as_ref().is_none_or(|l| {
                    let r = l.a.dims().1;
                    l.a.dims() == (k, r) && l.b.dims() == (r, n) && l.scale.len() == n
                })
        };
        nkv > 0
            && nh % nkv == 0
            && d % 2 == 0
            && self.norm.len() == h
            && head.dims().0 == h
            && self.embed.dims() == [head.dims().1, h]
            && self.cos.dims2().is_ok_and(|(_, c)| c == d / 2)
            && self.cos.dims() == self.sin.dims()
            && [&self.embed, &self.cos, &self.sin]
                .iter()
                .all(|t| t.dtype() == DType::F32 && t.device().is_cpu())
            && self.layers.iter().all(|l| {
                l.input_layernorm.len() == h
                    && l.post_attention_layernorm.len() == h
                    && norm_ok(&l.q_norm)
                    && norm_ok(&l.k_norm)
                    && proj_ok(&l.qkv, h, (nh + 2 * nkv) * d)
                    && proj_ok(&l.o, nh * d, h)
                    && proj_ok(&l.gate_up, h, 2 * i)
                    && proj_ok(&l.down, i, h)
            })
    }
}

/// A barrier for the step's team: threads spin (then yield) until all have arrived. Once a thread
/// has failed, waits return at once so that the others finish instead of waiting forever.
struct SpinBarrier {
    n: usize,
    count: AtomicUsize,
    generation: AtomicUsize,
    failed: AtomicBool,
}

/// Spins before a waiting thread starts yielding its core.
const SPINS: u32 = 1 << 16;

impl SpinBarrier {
    fn new(n: usize) -> Self {
        Self {
            n,
            count: AtomicUsize::new(0),
            generation: AtomicUsize::new(0),
            failed: AtomicBool::new(false),
        }
    }

    fn wait(&self) {
        if self.failed.load(Ordering::Relaxed) {
            return;
        }
        let g = self.generation.load(Ordering::Acquire);
        if self.count.fetch_add(1, Ordering::AcqRel) + 1 == self.n {
            self.count.store(0, Ordering::Relaxed);
            self.generation.store(g.wrapping_add(1), Ordering::Release);
            return;
        }
        let mut spins = 0u32;
        while self.generation.load(Ordering::Acquire) == g {
            if self.failed.load(Ordering::Relaxed) {
                return;
            }
            if spins < SPINS {
                std::hint::spin_loop();
                spins += 1;
            } else {
                std::thread::yield_now();
            }
        }
    }
}

/// A buffer that the team's threads write in disjoint parts between barriers.
#[derive(Clone, Copy)]
struct Shared {
    ptr: *mut f32,
    len: usize,
}
// SAFETY: threads access disjoint ranges between barriers (see each phase in `step`).
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

impl Shared {
    fn of(v: &mut [f32]) -> Self {
        Self {
            ptr: v.as_mut_ptr(),
            len: v.len(),
        }
    }
    /// # Safety
    /// No other thread may access `r` until the next barrier.
    #[allow(clippy::mut_from_ref)]
    unsafe fn get_mut(&self, r: Range<usize>) -> &mut [f32] {
        assert!(r.start <= r.end && r.end <= self.len);
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(r.start), r.len()) }
    }
    /// # Safety
    /// No thread may write `r` until the next barrier.
    unsafe fn get(&self, r: Range<usize>) -> &[f32] {
        assert!(r.start <= r.end && r.end <= self.len);
        unsafe { std::slice::from_raw_parts(self.ptr.add(r.start), r.len()) }
    }
}

/// HF / candle RMSNorm of one row: `w * x / sqrt(mean(x^2) + eps)`, summed in order like
/// candle's kernel.
fn rms_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let sum2 = x.iter().map(|&v| v * v).sum::<f32>();
    let m = (sum2 / x.len() as f32 + eps).sqrt();
    for ((o, &v), &a) in out.iter_mut().zip(x).zip(w) {
        *o = v / m * a;
    }
}

/// RMSNorm of one head in place.
fn rms_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    let sum2 = x.iter().map(|&v| v * v).sum::<f32>();
    let m = (sum2 / x.len() as f32 + eps).sqrt();
    for (v, &a) in x.iter_mut().zip(w) {
        *v = *v / m * a;
    }
}

/// Rotate-half RoPE of one head in place, as [`crate::kernels::cpu::fused::rope_heads`] computes it.
fn rope_in_place(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = x.len() / 2;
    let (a, b) = x.split_at_mut(half);
    for i in 0..half {
        let (x1, x2) = (a[i], b[i]);
        a[i] = x1 * cos[i] - x2 * sin[i];
        b[i] = x2 * cos[i] + x1 * sin[i];
    }
}

/// The contiguous f32 data of a CPU tensor, or `None`.
fn host_f32<'a>(st: &'a Storage, t: &Tensor) -> Option<&'a [f32]> {
    let l = t.layout();
    match (st, l.contiguous_offsets()) {
        (Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) => v.get(a..b),
        _ => None,
    }
}

/// One decoding step: `ids`/`positions` one per row, row `b` attending cache slots
/// `pad[b]..len` and its new token; a group's shared prompt read from its leader (`shared`).
/// Returns the logits `[B, vocab]` and advances the cache by one slot, or `None` (nothing done)
/// when the cache does not suit the fused path (not f32 on the CPU, not contiguous, full).
#[allow(clippy::too_many_arguments)]
pub fn step(
    plan: &Plan,
    head: &PackedWeight,
    ids: &[u32],
    positions: &[u32],
    pad: &[usize],
    shared: Option<&SharedPrefix>,
    cache: &mut KvCache,
) -> Result<Option<Vec<f32>>> {
    let b = ids.len();
    let (nkv, d) = (plan.kv_heads, plan.head_dim);
    let vocab = head.dims().1;
    let (len, tmax, layers) = (cache.len(), cache.capacity(), plan.layers.len());
    if !takes(plan, head, ids, positions, pad, cache)? {
        return Ok(None);
    }
    let shared = shared.filter(|sp| sp.fits(pad, len));

    // Read access to the weights' and the cache's storage for the whole step.
    let (ks, vs) = cache.layer_tensors();
    let want = [b, nkv, tmax, d];
    if ks.iter().chain(vs).any(|t| t.dims() != want) {
        return Ok(None);
    }
    let tensors: Vec<&Tensor> = [&plan.embed, &plan.cos, &plan.sin]
        .into_iter()
        .chain(ks)
        .chain(vs)
        .collect();
    let guards: Vec<_> = tensors.iter().map(|t| t.storage_and_layout().0).collect();
    let Some(data) = guards
        .iter()
        .zip(&tensors)
        .map(|(st, t)| host_f32(st, t))
        .collect::<Option<Vec<&[f32]>>>()
    else {
        return Ok(None);
    };
    let (kc, vc) = data[3..].split_at(layers);
    let mut bufs = Buffers::new(plan, b, vocab);
    let team = Team::new(
        plan,
        head,
        (ids, positions, pad, shared),
        &data,
        (kc, vc),
        &mut bufs,
        len,
        tmax,
    );

    let nt = rayon::current_num_threads().max(1);
    let bar = SpinBarrier::new(nt);
    rayon::broadcast(|ctx| {
        let run = catch_unwind(AssertUnwindSafe(|| {
            team.run(ctx.index(), ctx.num_threads(), &bar)
        }));
        if run.is_err() {
            bar.failed.store(true, Ordering::Relaxed);
        }
    });
    if bar.failed.load(Ordering::Relaxed) {
        bail!("the fused decoding step failed (a worker thread panicked)");
    }
    let mut logits = bufs.logits;
    // SAFETY: the head's GEMM wrote every panel's columns of all `b` rows, all `vocab` columns.
    unsafe { logits.set_len(b * vocab) };
    drop(data);
    drop(guards);
    let (knew, vnew) = (bufs.knew, bufs.vnew);
    let dev = candle_core::Device::Cpu;
    for l in 0..layers {
        let at = l * b * nkv * d..(l + 1) * b * nkv * d;
        let kt = Tensor::from_slice(&knew[at.clone()], (b, nkv, 1, d), &dev)?;
        let vt = Tensor::from_slice(&vnew[at], (b, nkv, 1, d), &dev)?;
        cache.append(l, &kt, &vt)?;
    }
    cache.advance(1);
    Ok(Some(logits))
}

/// Whether [`step`] takes this batch (the rows, the cache's state, an AVX2 or AVX-512 CPU);
/// an error for a position past the model's or a token outside its vocabulary.
fn takes(
    plan: &Plan,
    head: &PackedWeight,
    ids: &[u32],
    positions: &[u32],
    pad: &[usize],
    cache: &KvCache,
) -> Result<bool> {
    let b = ids.len();
    let vocab = head.dims().1;
    let (len, tmax, layers) = (cache.len(), cache.capacity(), plan.layers.len());
    if b == 0
        || positions.len() != b
        || pad.len() != b
        || cache.batch() != b
        || cache.num_layers() != layers
        || len >= tmax
        || pad.iter().any(|&p| p > len)
        || crate::kernels::Isa::active() < crate::kernels::Isa::Avx2
    {
        return Ok(false);
    }
    let max_pos = plan.cos.dim(0)?;
    if let Some(&p) = positions.iter().find(|&&p| p as usize >= max_pos) {
        bail!("decoding position {p} is past the model's {max_pos} positions");
    }
    if let Some(&t) = ids.iter().find(|&&t| t as usize >= vocab) {
        bail!("token id {t} is outside the vocabulary of {vocab}");
    }
    Ok(true)
}

/// The step's buffers, which the team's phases write in disjoint parts.
struct Buffers {
    x: Vec<f32>,      // [B, H] residual stream
    hn: Vec<f32>,     // [B, H] normed
    qkv: Vec<f32>,    // [B, (H + 2 Hkv) D]
    att: Vec<f32>,    // [B, H D]
    dn: Vec<f32>,     // [B, H] attention / MLP output
    gu: Vec<f32>,     // [B, 2I]
    act: Vec<f32>,    // [B, I]
    knew: Vec<f32>,   // [L, B, Hkv, D]
    vnew: Vec<f32>,   // [L, B, Hkv, D]
    logits: Vec<f32>, // [B, V], written by the head's GEMM only
}

impl Buffers {
    fn new(plan: &Plan, b: usize, vocab: usize) -> Self {
        let (h, nh, nkv, d, inter) = (
            plan.hidden,
            plan.heads,
            plan.kv_heads,
            plan.head_dim,
            plan.intermediate,
        );
        let (nqkv, layers) = ((nh + 2 * nkv) * d, plan.layers.len());
        Buffers {
            x: vec![0f32; b * h],
            hn: vec![0f32; b * h],
            qkv: vec![0f32; b * nqkv],
            att: vec![0f32; b * nh * d],
            dn: vec![0f32; b * h],
            gu: vec![0f32; b * 2 * inter],
            act: vec![0f32; b * inter],
            knew: vec![0f32; layers * b * nkv * d],
            vnew: vec![0f32; layers * b * nkv * d],
            logits: Vec::with_capacity(b * vocab),
        }
    }
}

/// The step's state as the team's threads share it: the plan, the batch, the weights' and the
/// cache's host data, and [`Buffers`] as [`Shared`] views.
struct Team<'a> {
    plan: &'a Plan,
    head: &'a PackedWeight,
    ids: &'a [u32],
    positions: &'a [u32],
    pad: &'a [usize],
    shared: Option<&'a SharedPrefix>,
    embed: &'a [f32],
    cos: &'a [f32],
    sin: &'a [f32],
    kc: &'a [&'a [f32]],
    vc: &'a [&'a [f32]],
    /// Rows, hidden size, query heads, KV heads, head size, MLP size, query heads per KV
    /// head, the joined q/k/v width, cached slots, the cache's capacity.
    b: usize,
    h: usize,
    nh: usize,
    nkv: usize,
    d: usize,
    inter: usize,
    g: usize,
    nqkv: usize,
    len: usize,
    tmax: usize,
    scale: f32,
    eps: f32,
    /// AVX2 or AVX-512, which the CPU runs ([`takes`] checked).
    isa: crate::kernels::Isa,
    x: Shared,
    hn: Shared,
    qkv: Shared,
    att: Shared,
    dn: Shared,
    gu: Shared,
    act: Shared,
    knew: Shared,
    vnew: Shared,
    logits: Shared,
}

/// The batch's ids, positions, left padding and shared prompt.
type Batch<'a> = (&'a [u32], &'a [u32], &'a [usize], Option<&'a SharedPrefix>);

impl<'a> Team<'a> {
    #[allow(clippy::too_many_arguments)]
    fn new(
        plan: &'a Plan,
        head: &'a PackedWeight,
        (ids, positions, pad, shared): Batch<'a>,
        data: &'a [&'a [f32]],
        (kc, vc): (&'a [&'a [f32]], &'a [&'a [f32]]),
        bufs: &mut Buffers,
        len: usize,
        tmax: usize,
    ) -> Self {
        let (nh, nkv, d) = (plan.heads, plan.kv_heads, plan.head_dim);
        let b = ids.len();
        Team {
            plan,
            head,
            ids,
            positions,
            pad,
            shared,
            embed: data[0],
            cos: data[1],
            sin: data[2],
            kc,
            vc,
            b,
            h: plan.hidden,
            nh,
            nkv,
            d,
            inter: plan.intermediate,
            g: nh / nkv,
            nqkv: (nh + 2 * nkv) * d,
            len,
            tmax,
            scale: 1.0 / (d as f32).sqrt(),
            eps: plan.eps,
            isa: crate::kernels::Isa::active(),
            x: Shared::of(&mut bufs.x),
            hn: Shared::of(&mut bufs.hn),
            qkv: Shared::of(&mut bufs.qkv),
            att: Shared::of(&mut bufs.att),
            dn: Shared::of(&mut bufs.dn),
            gu: Shared::of(&mut bufs.gu),
            act: Shared::of(&mut bufs.act),
            knew: Shared::of(&mut bufs.knew),
            vnew: Shared::of(&mut bufs.vnew),
            // SAFETY: only the head's GEMM writes it, every element (checked by `set_len`).
            logits: Shared {
                ptr: bufs.logits.as_mut_ptr(),
                len: b * head.dims().1,
            },
        }
    }

    /// `y[.., cols of this thread's panels] = x W (+ bias)`.
    /// An adapter's low rank (`x A^T`, all of it, per thread: a few hundred thousand FMAs) and
    /// its product with this thread's panels of `B` go through `lora_buf`, the thread's own.
    ///
    /// # Safety
    /// `x` holds `b` rows of the weight's `in`, `y` is `b` rows of its `out`; between two
    /// barriers thread `t` alone writes its panels' columns of `y`, and no thread writes `x`.
    unsafe fn gemm(
        &self,
        p: &Proj,
        x: Shared,
        y: Shared,
        t: usize,
        nt: usize,
        lora_buf: &mut (Vec<f32>, Vec<f32>),
    ) {
        let (b, isa) = (self.b, self.isa);
        let (k, n) = p.w.dims();
        let panels = share(p.w.panel_count(), t, nt);
        p.w.panels_simd(isa, x.get(0..b * k), 0..b, panels.clone(), y.ptr);
        let cols = (panels.start * PANEL).min(n)..(panels.end * PANEL).min(n);
        if let Some(bias) = &p.bias {
            for r in 0..b {
                let yr = y.get_mut(r * n + cols.start..r * n + cols.end);
                yr.iter_mut()
                    .zip(&bias[cols.clone()])
                    .for_each(|(v, c)| *v += c);
            }
        }
        if let Some(l) = &p.lora {
            let rank = l.a.dims().1;
            let (h, lo) = lora_buf;
            h.resize(b * rank, 0.0);
            lo.resize(b * n, 0.0);
            l.a.panels_simd(
                isa,
                x.get(0..b * k),
                0..b,
                0..l.a.panel_count(),
                h.as_mut_ptr(),
            );
            l.b.panels_simd(isa, h, 0..b, panels.clone(), lo.as_mut_ptr());
            for r in 0..b {
                let yr = y.get_mut(r * n + cols.start..r * n + cols.end);
                let lr = &lo[r * n + cols.start..r * n + cols.end];
                for ((v, u), s) in yr.iter_mut().zip(lr).zip(&l.scale[cols.clone()]) {
                    *v += u * s;
                }
            }
        }
    }

    /// Rows `rows` of the residual stream: `x += dn` (when `add`), then `hn = norm(x) * w`.
    ///
    /// # Safety
    /// Between two barriers, no other thread touches these rows of `x` and `hn`, and no thread
    /// writes `dn`.
    unsafe fn add_norm(&self, rows: Range<usize>, add: bool, w: &[f32]) {
        let h = self.h;
        for r in rows {
            let xr = self.x.get_mut(r * h..(r + 1) * h);
            if add {
                let dr = self.dn.get(r * h..(r + 1) * h);
                xr.iter_mut().zip(dr).for_each(|(a, c)| *a += c);
            }
            rms_row(xr, w, self.eps, self.hn.get_mut(r * h..(r + 1) * h));
        }
    }

    /// Layer `l`'s attention for this thread's (row, KV head) pairs: q/k norms, RoPE, the new
    /// key and value aside, and the pair's query heads over the cache and the new slot.
    ///
    /// # Safety
    /// Between two barriers, this thread alone writes its pairs' parts of `att`, `knew` and
    /// `vnew`, and no thread writes `qkv`.
    unsafe fn attend(&self, l: usize, lp: &LayerPlan, t: usize, nt: usize, qbuf: &mut [f32]) {
        let (b, nh, nkv, d, g, nqkv) = (self.b, self.nh, self.nkv, self.d, self.g, self.nqkv);
        let (len, tmax, half, eps) = (self.len, self.tmax, d / 2, self.eps);
        let (kc, vc) = (self.kc, self.vc);
        for u in share(b * nkv, t, nt) {
            let (bi, j) = (u / nkv, u % nkv);
            let row = self.qkv.get(bi * nqkv..(bi + 1) * nqkv);
            let p = self.positions[bi] as usize;
            let (cs, sn) = (
                &self.cos[p * half..(p + 1) * half],
                &self.sin[p * half..(p + 1) * half],
            );
            qbuf.copy_from_slice(&row[j * g * d..(j + 1) * g * d]);
            for qh in qbuf.chunks_exact_mut(d) {
                if let Some(w) = &lp.q_norm {
                    rms_in_place(qh, w, eps);
                }
                rope_in_place(qh, cs, sn);
            }
            let slot = ((l * b + bi) * nkv + j) * d..((l * b + bi) * nkv + j + 1) * d;
            let kn = self.knew.get_mut(slot.clone());
            kn.copy_from_slice(&row[(nh + j) * d..(nh + j + 1) * d]);
            if let Some(w) = &lp.k_norm {
                rms_in_place(kn, w, eps);
            }
            rope_in_place(kn, cs, sn);
            let vn = self.vnew.get_mut(slot.clone());
            vn.copy_from_slice(&row[(nh + nkv + j) * d..(nh + nkv + j + 1) * d]);
            let (kn, vn) = (self.knew.get(slot.clone()), self.vnew.get(slot));
            let cached = |row: usize, from: usize, to: usize| {
                let base = (row * nkv + j) * tmax;
                let r = (base + from) * d..(base + to) * d;
                (&kc[l][r.clone()], &vc[l][r])
            };
            let p0 = self.pad[bi];
            let out = self
                .att
                .get_mut(bi * nh * d + j * g * d..bi * nh * d + (j + 1) * g * d);
            match self.shared {
                Some(sp) if sp.end > p0 && sp.leader[bi] != bi => {
                    let segs = [
                        cached(sp.leader[bi], p0, sp.end),
                        cached(bi, sp.end, len),
                        (kn, vn),
                    ];
                    crate::kernels::cpu::fused_attention::decode_head(
                        qbuf, &segs, self.scale, out, d,
                    );
                }
                _ => {
                    let segs = [cached(bi, p0, len), (kn, vn)];
                    crate::kernels::cpu::fused_attention::decode_head(
                        qbuf, &segs, self.scale, out, d,
                    );
                }
            }
        }
    }

    /// Thread `t` of `nt`: the whole step, phase by phase, with `bar` between the phases.
    fn run(&self, t: usize, nt: usize, bar: &SpinBarrier) {
        let (b, h, inter) = (self.b, self.h, self.inter);
        let rows = share(b, t, nt);
        let mut qbuf = vec![0f32; self.g * self.d];
        let mut lb = (Vec::new(), Vec::new());
        // SAFETY (all phases): each phase writes only this thread's share (rows, (row, KV head)
        // pairs, or panel columns) of its output buffer and reads buffers that no thread writes
        // in that phase; `bar.wait()` separates the phases.
        unsafe {
            for r in rows.clone() {
                let id = self.ids[r] as usize;
                self.x
                    .get_mut(r * h..(r + 1) * h)
                    .copy_from_slice(&self.embed[id * h..(id + 1) * h]);
            }
            for (l, lp) in self.plan.layers.iter().enumerate() {
                self.add_norm(rows.clone(), l > 0, &lp.input_layernorm);
                bar.wait();
                self.gemm(&lp.qkv, self.hn, self.qkv, t, nt, &mut lb);
                bar.wait();
                self.attend(l, lp, t, nt, &mut qbuf);
                bar.wait();
                self.gemm(&lp.o, self.att, self.dn, t, nt, &mut lb);
                bar.wait();
                self.add_norm(rows.clone(), true, &lp.post_attention_layernorm);
                bar.wait();
                self.gemm(&lp.gate_up, self.hn, self.gu, t, nt, &mut lb);
                bar.wait();
                for r in rows.clone() {
                    let gr = self.gu.get(r * 2 * inter..(r + 1) * 2 * inter);
                    let (gate, up) = gr.split_at(inter);
                    crate::kernels::cpu::vmath::silu_mul(
                        gate,
                        up,
                        self.act.get_mut(r * inter..(r + 1) * inter),
                    );
                }
                bar.wait();
                self.gemm(&lp.down, self.act, self.dn, t, nt, &mut lb);
                bar.wait();
            }
            self.add_norm(rows, true, &self.plan.norm);
            bar.wait();
            self.head.panels_simd(
                self.isa,
                self.hn.get(0..b * h),
                0..b,
                share(self.head.panel_count(), t, nt),
                self.logits.ptr,
            );
        }
    }
}
