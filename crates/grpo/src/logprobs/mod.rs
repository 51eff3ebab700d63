//! Per-token log-probabilities from the all-position forward, with the same temperature as the
//! sampler: `log softmax(h W^T / T)[target]`.
//!
//! The LM head is applied in chunks of rows, so at most `[chunk, vocab]` logits exist at a time in a
//! forward without gradient. In a differentiable forward on the fused CPU path, autograd keeps
//! each chunk's logits for the backward; off it (a GPU, bf16, portable)
//! [`token_logprobs_entropy_recomputed`] keeps none and recomputes them in the backward.

use std::ops::Range;

use candle_core::{Tensor, D};

use grpo_models::kernels::cpu::fused;
use grpo_models::models::layers::reduce_dtype;

use crate::Result;
use grpo_models::kernels::Compute;
use grpo_models::models::{CausalLm, Mode, SeqBatch};

/// Rows of hidden states per LM-head chunk.
pub const DEFAULT_CHUNK_ROWS: usize = 256;

/// Bytes of f32 logits per chunk of a training pass's LM head under [`Compute::Gpu`]. Its
/// backward holds one chunk's logits and their gradient at once, at the step's peak (every
/// layer's kept activations are still alive then): 64 MiB chunks (341 rows of SmolLM2's
/// vocabulary) hold 128 MiB there, where chunks of the attention's 256 MiB held 0.5 GB, for a
/// few more GEMM launches of at least 341 rows each.
pub const GPU_TRAIN_HEAD_CHUNK_BYTES: usize = 64 << 20;

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
    let head = |h: &Tensor| model.head_logits(h);
    let (lp, _) = token_logprobs_entropy_with(
        &hidden,
        &head,
        &targets,
        temperature,
        DEFAULT_CHUNK_ROWS,
        Entropy::Skip,
        model.compute(),
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
    let w_t = lm_head.t()?; // [H, V]
    let head = |h: &Tensor| -> Result<Tensor> { Ok(h.matmul(&w_t)?) };
    let compute = Compute::resolve(hidden.device(), hidden.dtype());
    token_logprobs_entropy_with(
        hidden,
        &head,
        targets,
        temperature,
        chunk_rows,
        entropy,
        compute,
    )
}

/// [`token_logprobs_entropy`] with the LM head given as a function `[c, H] -> [c, V]` (the
/// model's [`CausalLm::head_logits`], which may send its gradient to a sink), its log-softmax
/// fused on the CPU under [`Compute::CpuFused`].
pub fn token_logprobs_entropy_with(
    hidden: &Tensor,
    head: &dyn Fn(&Tensor) -> Result<Tensor>,
    targets: &Tensor,
    temperature: f64,
    chunk_rows: usize,
    entropy: Entropy,
    compute: Compute,
) -> Result<(Tensor, Option<Tensor>)> {
    let n = hidden.dim(0)?;
    let t = if temperature > 0.0 { temperature } else { 1.0 };
    let chunk = chunk_rows.max(1);
    let (mut lps, mut ents) = (Vec::new(), Vec::new());
    let mut start = 0;
    while start < n {
        let len = chunk.min(n - start);
        let h = hidden.narrow(0, start, len)?; // [c, H]
        let y = targets.narrow(0, start, len)?; // [c]
        start += len;
        let logits = head(&h)?; // [c, V]
        if compute.fuses(&logits) {
            let both = fused::logprob_entropy(&logits, &y, t)?; // [c, 2]: log-prob, entropy
            lps.push(both.narrow(1, 0, 1)?.squeeze(1)?);
            match entropy {
                Entropy::Skip => {}
                Entropy::Detached => ents.push(both.narrow(1, 1, 1)?.squeeze(1)?.detach()),
                Entropy::WithGrad => ents.push(both.narrow(1, 1, 1)?.squeeze(1)?),
            }
            continue;
        }
        #[cfg(feature = "cuda")]
        if compute.on_gpu() && !logits.track_op() && grpo_models::kernels::cuda::head_takes(&logits)
        {
            // One kernel per chunk on a GPU (no graph here: a reference or old-policy pass).
            let (both, _) =
                grpo_models::kernels::cuda::head_logprobs(&logits, &y, (1.0 / t) as f32)?;
            lps.push(both.narrow(1, 0, 1)?.squeeze(1)?);
            if entropy != Entropy::Skip {
                ents.push(both.narrow(1, 1, 1)?.squeeze(1)?);
            }
            continue;
        }
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

/// Like [`token_logprobs_entropy`] for a differentiable forward that keeps no logits: each
/// chunk's `[c, V]` logits exist only while it is computed, in the forward and again in the
/// backward, which recomputes them from `hidden` and `lm_head` (the fused linear + log-softmax
/// plan of Liger's kernels, in candle ops; see [`grpo_models::kernels::portable::recompute`]). What the backward
/// keeps is `hidden`, `lm_head` and one log-sum-exp per row. `lm_head` [V, H] gets a gradient
/// only where it tracks one (a frozen head under LoRA does not).
///
/// Returns log-probs [N] f32 and, unless `entropy` is [`Entropy::Skip`], entropies [N] f32.
pub fn token_logprobs_entropy_recomputed(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &Tensor,
    temperature: f64,
    chunk_rows: usize,
    entropy: Entropy,
) -> Result<(Tensor, Option<Tensor>)> {
    head_logprobs_recomputed(
        hidden,
        lm_head,
        targets,
        temperature,
        chunk_rows,
        entropy,
        None,
        Compute::resolve(hidden.device(), hidden.dtype()),
    )
}

/// [`token_logprobs_entropy_recomputed`], the head weight's gradient added into `head_grad`
/// (a GPU sink's accumulator: one GEMM per chunk with f32 sums) instead of returned to candle's
/// graph, when given. Under [`Compute::Gpu`] the log-softmax runs as grpo's kernels.
#[allow(clippy::too_many_arguments)]
fn head_logprobs_recomputed(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &Tensor,
    temperature: f64,
    chunk_rows: usize,
    entropy: Entropy,
    head_grad: Option<grpo_models::kernels::grad_sink::WeightGrad>,
    compute: Compute,
) -> Result<(Tensor, Option<Tensor>)> {
    let op = HeadLogprobs {
        targets: targets.detach(),
        temperature: if temperature > 0.0 { temperature } else { 1.0 },
        chunk: chunk_rows.max(1),
        entropy,
        lse: Default::default(),
        head_grad,
        compute,
    };
    let (both, lse) = op.forward(&hidden.detach(), &lm_head.detach())?; // [N, 2], [N, 1]

    // With `head_grad` the head's gradient bypasses the graph: the op does not take the head as
    // a graph input (candle expects a gradient for every tracked input it reaches).
    let head = match op.head_grad {
        Some(_) => lm_head.detach(),
        None => lm_head.clone(),
    };
    let op = HeadLogprobs {
        lse: std::sync::OnceLock::from(lse),
        ..op
    };
    let both = grpo_models::kernels::portable::recompute::attach(
        &both,
        &[hidden, &head],
        std::sync::Arc::new(op),
    )?;
    let lp = both.narrow(1, 0, 1)?.squeeze(1)?; // [N]
    let ent = both.narrow(1, 1, 1)?.squeeze(1)?; // [N]
    Ok((
        lp,
        match entropy {
            Entropy::Skip => None,
            Entropy::Detached => Some(ent.detach()),
            Entropy::WithGrad => Some(ent),
        },
    ))
}

/// The recorded LM head + log-softmax + gather of [`token_logprobs_entropy_recomputed`].
struct HeadLogprobs {
    /// [N] u32.
    targets: Tensor,
    temperature: f64,
    chunk: usize,
    entropy: Entropy,
    /// [N, 1] f32: each row's log-sum-exp of `logits / T`.
    lse: std::sync::OnceLock<Tensor>,
    /// Where the head weight's gradient goes instead of the graph (a GPU sink), when set.
    head_grad: Option<grpo_models::kernels::grad_sink::WeightGrad>,
    /// The model's compute: grpo's head kernels under [`Compute::Gpu`].
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    compute: Compute,
}

impl HeadLogprobs {
    /// `logits / T`: [c, V] f32.
    fn tempered(&self, logits: &Tensor) -> candle_core::Result<Tensor> {
        logits.to_dtype(reduce_dtype(logits.dtype()))? / self.temperature
    }

    /// `[N, 2]` (log-prob, entropy or 0) and `[N, 1]` log-sum-exps, without a graph.
    fn forward(&self, hidden: &Tensor, w: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
        let n = hidden.dim(0)?;
        let (mut rows, mut lses) = (Vec::new(), Vec::new());
        let mut start = 0;
        while start < n {
            let len = self.chunk.min(n - start);
            let logits = hidden.narrow(0, start, len)?.matmul(&w.t()?)?; // [c, V]
            #[cfg(feature = "cuda")]
            if self.compute.on_gpu() && grpo_models::kernels::cuda::head_takes(&logits) {
                let y = self.targets.narrow(0, start, len)?;
                let inv_t = (1.0 / self.temperature) as f32;
                let (both, lse) = grpo_models::kernels::cuda::head_logprobs(&logits, &y, inv_t)?;
                rows.push(both);
                lses.push(lse);
                start += len;
                continue;
            }
            let z = self.tempered(&logits)?; // [c, V] f32
            let y = self.targets.narrow(0, start, len)?.unsqueeze(1)?; // [c, 1]
            let max = z.max_keepdim(D::Minus1)?; // [c, 1]
            let shifted = z.broadcast_sub(&max)?;
            let e = shifted.exp()?;
            let sum = e.sum_keepdim(D::Minus1)?; // [c, 1]
            let lse_shifted = sum.log()?;
            let lp = (shifted.gather(&y, 1)? - &lse_shifted)?; // [c, 1]
            let ent = match self.entropy {
                Entropy::Skip => lp.zeros_like()?,
                // H = log(sum e) - sum(e * shifted) / sum(e)
                _ => (&lse_shifted - ((e * &shifted)?.sum_keepdim(D::Minus1)? / &sum)?)?,
            };
            rows.push(Tensor::cat(&[&lp, &ent], 1)?);
            lses.push((max + lse_shifted)?);
            start += len;
        }
        Ok((Tensor::cat(&rows, 0)?, Tensor::cat(&lses, 0)?))
    }
}

impl grpo_models::kernels::portable::recompute::Backward for HeadLogprobs {
    fn name(&self) -> &'static str {
        "head-logprobs"
    }

    /// With `z = h W^T / T`, `p = softmax(z)`: `d lp / dz = onehot(y) - p` and
    /// `d H / dz = -p (z - sum p z)`; then `dh = dz W / T`, `dW = dz^T h / T`.
    fn backward(
        &self,
        inputs: &[Tensor],
        wanted: &[bool],
        out: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Vec<Option<Tensor>>> {
        let [hidden, w] = inputs else {
            candle_core::bail!("head log-probs: two inputs expected");
        };
        let Some(lse) = self.lse.get() else {
            candle_core::bail!("head log-probs: backward without a recorded forward");
        };
        let n = hidden.dim(0)?;
        let f = reduce_dtype(hidden.dtype());
        let grad = grad.to_dtype(f)?; // [N, 2]
        let mut dw: Option<Tensor> = None;
        let mut dhs = Vec::new();
        let mut start = 0;
        while start < n {
            let len = self.chunk.min(n - start);
            let h = hidden.narrow(0, start, len)?; // [c, H]
            let logits = h.matmul(&w.t()?)?; // [c, V]
            let dlogits = self.dlogits(&logits, start, len, lse, out, &grad)?; // [c, V]
            dhs.push(dlogits.matmul(w)?); // [c, H]
            if let Some(acc) = &self.head_grad {
                acc.add_product(&dlogits, &h)?; // dW [V, H] += dz^T h, f32 sums
            } else if wanted[1] {
                let part = dlogits.t()?.matmul(&h)?.to_dtype(f)?; // [V, H]
                dw = Some(match dw {
                    Some(acc) => (acc + part)?,
                    None => part,
                });
            }
            start += len;
        }
        let dw = dw.map(|d| d.to_dtype(w.dtype())).transpose()?;
        Ok(vec![Some(Tensor::cat(&dhs, 0)?), dw])
    }
}

impl HeadLogprobs {
    /// The gradient of rows `[start, start + len)`'s logits [c, V] (in their dtype) from the
    /// outputs' gradient `grad` [N, 2] f32: one kernel on a GPU, else candle ops.
    fn dlogits(
        &self,
        logits: &Tensor,
        start: usize,
        len: usize,
        lse: &Tensor,
        out: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Tensor> {
        #[cfg(feature = "cuda")]
        if self.compute.on_gpu() && grpo_models::kernels::cuda::head_takes(logits) {
            return grpo_models::kernels::cuda::head_logprobs_backward(
                logits,
                &self.targets.narrow(0, start, len)?,
                &lse.narrow(0, start, len)?,
                &grad.narrow(0, start, len)?,
                &out.narrow(0, start, len)?,
                (1.0 / self.temperature) as f32,
                self.entropy == Entropy::WithGrad,
            );
        }
        let with_entropy = self.entropy == Entropy::WithGrad;
        let z = self.tempered(logits)?; // [c, V] f32
        let p = z.broadcast_sub(&lse.narrow(0, start, len)?)?.exp()?; // [c, V]
        let g = grad.narrow(0, start, len)?;
        let g_lp = g.narrow(1, 0, 1)?.contiguous()?; // [c, 1]
        let y = self
            .targets
            .narrow(0, start, len)?
            .unsqueeze(1)?
            .contiguous()?; // [c, 1]
        let mut dz = p.broadcast_mul(&g_lp.neg()?)?.scatter_add(&y, &g_lp, 1)?; // [c, V]
        if with_entropy {
            let g_ent = g.narrow(1, 1, 1)?; // [c, 1]
            let ent = out
                .narrow(0, start, len)?
                .narrow(1, 1, 1)?
                .to_dtype(z.dtype())?;
            // sum p z = lse - H
            let mean_z = (lse.narrow(0, start, len)? - ent)?; // [c, 1]
            let d_ent = (p * z.broadcast_sub(&mean_z)?)?.broadcast_mul(&g_ent.neg()?)?;
            dz = (dz + d_ent)?;
        }
        (dz / self.temperature)?.to_dtype(logits.dtype()) // [c, V]
    }
}

/// Tokens per forward/backward pass under [`Compute::CpuFused`] (f32 on the CPU: passes sized to
/// the CPU's caches; [`MIXED_FORWARD_CHUNK_TOKENS`] under CPU mixed precision); also the floor
/// of the memory-sized default elsewhere, its value when free memory is unknown, and the
/// fill-in policy's.
pub const DEFAULT_FORWARD_CHUNK_TOKENS: usize = 1024;

/// Tokens per forward/backward pass under CPU mixed precision (`dtype = "bf16"` on the CPU): half
/// the activation memory of [`DEFAULT_FORWARD_CHUNK_TOKENS`], as the bf16 products run as fast
/// on 512 rows as on 1024 (bench/README.md, "Where the defaults come from", has the
/// measurement).
pub const MIXED_FORWARD_CHUNK_TOKENS: usize = 512;

/// The bytes a training pass's kept activations may take off the fused CPU path: half of the
/// device's `free` memory, and at most twice the f32 state of the model's `params` parameters
/// (weight, gradient and two AdamW moments: 16 bytes each). The cap keeps a small model's passes
/// to a few thousand tokens, still enough rows to keep a GPU's matmuls full, where half the free
/// memory alone would put a whole large micro-batch in one pass (bench/README.md, "Where the
/// defaults come from").
pub fn activation_budget(free: u64, params: u64) -> u64 {
    (free / 2).min(2 * 16 * params)
}

/// Tokens per training pass whose kept activations fit in `budget` bytes, for a model of `layers`
/// blocks of width `hidden` (MLP width `intermediate`) computing in `act_bytes`-byte floats, at least [`DEFAULT_FORWARD_CHUNK_TOKENS`] and at
/// most 2^20. Off the fused CPU path a pass keeps, per token:
/// - with `gradient_checkpointing`: each block's input (`layers x hidden`), and one block
///   recomputed with its graph and its gradients (~24 `hidden`- and 8 `intermediate`-wide);
/// - without: every block's graph (~16 `hidden`- and 6 `intermediate`-wide tensors per block).
///
/// Attention's scores and the LM head's logits are not kept (chunked and recomputed), so they
/// do not grow with the pass. Calibrated on the CPU's portable path with SmolLM2-135M's shape in
/// f32 and one 8 x 4 x 256 pass (8,500 tokens): with checkpointing the peak RSS above the static
/// state and the fixed-size chunks was ~1.5 GB (~180 KB per token; this says 173 KB); without,
/// the run passed 23.5 GB (> 2.1 MB per token; this says 2.2 MB).
pub fn tokens_for_memory(
    (h, i, l): (usize, usize, usize),
    act_bytes: usize,
    gradient_checkpointing: bool,
    budget: u64,
) -> usize {
    tokens_for_memory_with((h, i, l), act_bytes, gradient_checkpointing, budget, 0)
}

/// [`tokens_for_memory`] with `extra` bytes kept per token besides the blocks' own (LoRA's
/// adapters: [`lora_activation_bytes`]).
fn tokens_for_memory_with(
    shape: (usize, usize, usize),
    act_bytes: usize,
    gradient_checkpointing: bool,
    budget: u64,
    extra: u64,
) -> usize {
    let per_token = activation_bytes_per_token(shape, act_bytes, gradient_checkpointing) + extra;
    ((budget / per_token) as usize).clamp(DEFAULT_FORWARD_CHUNK_TOKENS, 1 << 20)
}

/// Bytes LoRA's adapters keep per token in a training pass, from the f32 elements they keep
/// per token over all `layers` (`memory_plan::lora_activation_elems`): all of them, or one
/// layer's share with `gradient_checkpointing` (only the recomputed block's graph is alive).
pub fn lora_activation_bytes(elems: u64, layers: usize, gradient_checkpointing: bool) -> u64 {
    match gradient_checkpointing {
        true => 4 * elems / layers.max(1) as u64,
        false => 4 * elems,
    }
}

/// Bytes a training pass keeps per token on a model of `shape` (hidden, intermediate, layers)
/// computing in `act_bytes`-byte floats: the model [`tokens_for_memory`] sizes passes by (at
/// least 1).
pub fn activation_bytes_per_token(
    (h, i, l): (usize, usize, usize),
    act_bytes: usize,
    gradient_checkpointing: bool,
) -> u64 {
    let floats = match gradient_checkpointing {
        true => l * h + 24 * h + 8 * i,
        false => l * (16 * h + 6 * i),
    };
    (floats * act_bytes).max(1) as u64
}

/// Tokens per training pass when `forward_chunk_tokens` is unset, for a model of `shape`
/// (hidden, intermediate, layers) and `params` parameters computing in `act_bytes`-byte floats
/// (LoRA's adapters keeping `lora_bytes` more per token) under `compute`:
/// [`DEFAULT_FORWARD_CHUNK_TOKENS`] on the fused CPU path in f32, [`MIXED_FORWARD_CHUNK_TOKENS`]
/// under CPU mixed precision, and off the fused path (a GPU, portable kernels) as many as fit a
/// share of the device's `free` memory ([`activation_budget`], [`tokens_for_memory`]; the CPU
/// default when it is unknown).
pub fn default_chunk_tokens(
    compute: grpo_models::kernels::Compute,
    free: Option<u64>,
    shape: (usize, usize, usize),
    act_bytes: usize,
    gradient_checkpointing: bool,
    params: u64,
    lora_bytes: u64,
) -> usize {
    use grpo_models::kernels::Compute;
    match (compute, free) {
        (Compute::CpuMixed, _) => MIXED_FORWARD_CHUNK_TOKENS,
        (Compute::Gpu | Compute::Portable, Some(free)) => tokens_for_memory_with(
            shape,
            act_bytes,
            gradient_checkpointing,
            activation_budget(free, params),
            lora_bytes,
        ),
        (Compute::CpuFused | Compute::Gpu | Compute::Portable, _) => DEFAULT_FORWARD_CHUNK_TOKENS,
    }
}

/// Whether a forward under `compute` lays every pack into one row (the fused CPU attention reads
/// only each token's own pack) instead of right-padded rows ([`pack_rows`]).
pub fn one_row(compute: Compute) -> bool {
    compute.is_fused()
}

/// Splits rows (`prompts[i] ++ completions[i]`, consecutive rows of a group sharing their prompt)
/// into consecutive ranges of at most `budget` tokens, counted as the forward lays them out
/// ([`one_row`]): a group's prompt once, or once per completion where the group gets a row per
/// completion ([`group_per_row`]). Whole groups stay together when they fit; a group longer than
/// the budget is split between completions (its prompt then counts in each part). A single row
/// longer than the budget gets a range of its own.
pub fn forward_chunks(
    prompts: &[&[u32]],
    completions: &[&[u32]],
    budget: usize,
    one_row: bool,
) -> Vec<std::ops::Range<usize>> {
    let n = prompts.len().min(completions.len());
    let mut out: Vec<std::ops::Range<usize>> = Vec::new();
    let (mut start, mut used) = (0, 0);
    let mut g = 0;
    while g < n {
        let mut end = g + 1;
        while end < n && prompts[end] == prompts[g] {
            end += 1;
        }
        let lp = prompts[g].len();
        let per_row = per_row(lp, &completions[g..end], one_row);
        let comps: usize = (g..end).map(|i| completions[i].len()).sum();
        let group = comps + if per_row { (end - g) * lp } else { lp };
        if used + group <= budget {
            used += group;
        } else {
            if start < g {
                out.push(start..g);
            }
            start = g;
            used = 0;
            if group <= budget {
                used = group;
            } else {
                // Completion by completion, the prompt counted once per part (once per row
                // under a row per completion).
                for (i, comp) in completions.iter().enumerate().take(end).skip(g) {
                    let c = comp.len();
                    let more = if per_row { lp + c } else { c };
                    if used > 0 && used + more > budget {
                        out.push(start..i);
                        start = i;
                        used = 0;
                    }
                    used += if used == 0 { lp + c } else { more };
                }
            }
        }
        g = end;
    }
    if start < n {
        out.push(start..n);
    }
    out
}

/// How [`completion_logprobs`] lays rows out for the forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Packing {
    /// Consecutive rows with the same prompt (a group) share one sequence: the prompt once, then
    /// each completion behind it with a mask that keeps completions apart. The prompt is computed
    /// once per group instead of once per completion, and there is no padding inside a group.
    SharedPrompt,
    /// One right-padded sequence per row (`prompt ++ completion`).
    PerRow,
}

/// Whether `n` rows of at most `own` tokens (a row per completion) score fewer attention keys than
/// `packs` rows of at most `shared` tokens (a row per group, its prompt once): on a padded batch
/// the portable attention scores `rows * T^2` keys. A group of G completions of length C behind
/// a prompt of length P shares a row of P + G C tokens, G times the work of its own rows when
/// P is short, so on a GPU a row per completion wins unless prompts dwarf completions.
fn per_row_scores_fewer(packs: usize, shared: usize, n: usize, own: usize) -> bool {
    let scores = |rows: usize, t: usize| rows as u128 * (t as u128).pow(2);
    scores(n, own) < scores(packs, shared)
}

/// Whether a group (completions of `lens` tokens behind one prompt of `prompt` tokens) gets a
/// row per completion: off `one_row` (where attention scores every key slot of a row), when that
/// scores fewer keys than the group's one row ([`per_row_scores_fewer`]).
pub fn group_per_row(
    prompt: usize,
    lens: impl Iterator<Item = usize> + Clone,
    one_row: bool,
) -> bool {
    let g = lens.clone().count();
    let (sum, longest) = (lens.clone().sum::<usize>(), lens.max().unwrap_or(0));
    !one_row && g > 1 && per_row_scores_fewer(1, prompt + sum, g, prompt + longest)
}

/// [`group_per_row`] of a group's completions.
fn per_row(prompt: usize, completions: &[&[u32]], one_row: bool) -> bool {
    group_per_row(prompt, completions.iter().map(|c| c.len()), one_row)
}

/// Runs of consecutive rows with the same prompt (a group) under [`Packing::SharedPrompt`],
/// else single rows; a group split into single rows where [`group_per_row`] says so.
fn packs(
    prompts: &[&[u32]],
    completions: &[&[u32]],
    packing: Packing,
    one_row: bool,
) -> Vec<Range<usize>> {
    let n = prompts.len();
    let mut groups: Vec<Range<usize>> = Vec::new();
    for i in 0..n {
        match groups.last_mut() {
            Some(r) if packing == Packing::SharedPrompt && prompts[r.start] == prompts[i] => {
                r.end = i + 1
            }
            _ => groups.push(i..i + 1),
        }
    }
    let mut packs = Vec::with_capacity(n);
    for r in groups {
        match per_row(prompts[r.start].len(), &completions[r.clone()], one_row) {
            true => packs.extend(r.map(|i| i..i + 1)),
            false => packs.push(r),
        }
    }
    packs
}

/// The forward row of each pack of `lens` tokens: all in row 0 (`one_row`), else first fit by
/// decreasing length into rows as long as the longest pack. Off the fused CPU path every row is
/// padded to the longest, so with uneven lengths (completions that end early beside one that
/// runs to the cap) a row per pack would mostly be padding: computed, and kept for the
/// backward, like real tokens. Packs of one length keep a row each, in order.
fn pack_rows(lens: &[usize], one_row: bool) -> Vec<usize> {
    if one_row {
        return vec![0; lens.len()];
    }
    let cap = lens.iter().copied().max().unwrap_or(0);
    let mut order: Vec<usize> = (0..lens.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(lens[i])); // stable: ties keep their order
    let (mut used, mut row): (Vec<usize>, Vec<usize>) = (Vec::new(), vec![0; lens.len()]);
    for i in order {
        let r = match used.iter().position(|&u| u + lens[i] <= cap) {
            Some(r) => r,
            None => {
                used.push(0);
                used.len() - 1
            }
        };
        used[r] += lens[i];
        row[i] = r;
    }
    row
}

/// Tokens of a pack: its prompt once, then each of its completions.
fn pack_len(prompts: &[&[u32]], completions: &[&[u32]], r: &Range<usize>) -> usize {
    prompts[r.start].len() + r.clone().map(|i| completions[i].len()).sum::<usize>()
}

/// The forward's rows for packs of (prompt, completions): token ids, positions and segments
/// (pack, and 0 for the prompt or k + 1 for its k-th completion) per row; the slot of the
/// flattened `[rows * T]` hidden states that predicts each completion token, in row-major
/// completion order, and each such token's target.
struct PackedRows {
    ids: Vec<Vec<u32>>,
    pos: Vec<Vec<u32>>,
    seg: Vec<Vec<(u32, u32)>>,
    /// Row length T.
    t: usize,
    slots: Vec<u32>,
    targets: Vec<u32>,
}

impl PackedRows {
    /// All packs in one row (`one_row`), or right-padded rows of packs ([`pack_rows`]).
    fn new(
        prompts: &[&[u32]],
        completions: &[&[u32]],
        packs: &[Range<usize>],
        one_row: bool,
    ) -> Result<PackedRows> {
        let lens: Vec<usize> = packs
            .iter()
            .map(|r| pack_len(prompts, completions, r))
            .collect();
        let row_of = pack_rows(&lens, one_row);
        let n_rows = row_of.iter().max().map_or(0, |r| r + 1);
        let mut row_len = vec![0; n_rows];
        for (&r, &l) in row_of.iter().zip(&lens) {
            row_len[r] += l;
        }
        let t = row_len.iter().copied().max().unwrap_or(0);
        let mut ids: Vec<Vec<u32>> = vec![Vec::new(); n_rows];
        let mut pos: Vec<Vec<u32>> = vec![Vec::new(); n_rows];
        let mut seg: Vec<Vec<(u32, u32)>> = vec![Vec::new(); n_rows];
        let mut packs_in_row = vec![0u32; n_rows];
        let (mut slots, mut targets) = (Vec::new(), Vec::new());
        for (r, &row) in packs.iter().zip(&row_of) {
            let pack = packs_in_row[row];
            packs_in_row[row] += 1;
            let p = prompts[r.start];
            let lp = p.len();
            if lp == 0 {
                return Err(crate::Error::ModelInput(
                    "a completion needs a non-empty prompt".into(),
                ));
            }
            let base = ids[row].len();
            let (i_row, p_row, s_row) = (&mut ids[row], &mut pos[row], &mut seg[row]);
            i_row.extend_from_slice(p);
            p_row.extend(0..lp as u32);
            s_row.extend(std::iter::repeat_n((pack, 0), lp));
            for (k, i) in r.clone().enumerate() {
                let c = completions[i];
                let off = i_row.len();
                for (j, &tok) in c.iter().enumerate() {
                    let from = if j == 0 { base + lp - 1 } else { off + j - 1 };
                    slots.push((row * t + from) as u32);
                    targets.push(tok);
                }
                i_row.extend_from_slice(c);
                p_row.extend((lp..lp + c.len()).map(|x| x as u32));
                s_row.extend(std::iter::repeat_n((pack, k as u32 + 1), c.len()));
            }
        }
        Ok(PackedRows {
            ids,
            pos,
            seg,
            t,
            slots,
            targets,
        })
    }
}

/// Log-probs (and optionally entropies) of completion tokens, `[N, Tc]` right-padded with zeros.
/// Row `i` is `prompts[i] ++ completions[i]`; the LM head is applied only at the positions that
/// predict completion tokens, so no logits are computed for prompt or padding positions.
#[allow(clippy::too_many_arguments)]
pub fn completion_logprobs(
    model: &CausalLm,
    prompts: &[&[u32]],
    completions: &[&[u32]],
    pad_id: u32,
    temperature: f64,
    mode: Mode,
    entropy: Entropy,
    packing: Packing,
) -> Result<(Tensor, Option<Tensor>)> {
    let n = prompts.len();
    let tc = completions.iter().map(|c| c.len()).max().unwrap_or(0);
    // On the CPU in f32 the fused attention reads only each token's own pack, so all packs go
    // into one row: no padding, and one large matmul per projection. Elsewhere attention scores
    // every key slot of a row, so packs go into right-padded rows as long as the longest pack,
    // short ones sharing a row (`pack_rows`).
    let one_row = one_row(model.compute());
    let packs = packs(prompts, completions, packing, one_row);
    let rows = PackedRows::new(prompts, completions, &packs, one_row)?;
    let (n_rows, t, m) = (rows.ids.len(), rows.t, rows.slots.len());
    let mut scatter = vec![m as u32; n * tc];
    let mut k = 0;
    for (i, c) in completions.iter().enumerate() {
        for j in 0..c.len() {
            scatter[i * tc + j] = k as u32;
            k += 1;
        }
    }
    let dev = model.device().clone();
    let batch = SeqBatch::prefix_shared(rows.ids, rows.pos, rows.seg, pad_id, &dev)?;
    let hidden = model.forward_hidden(&batch, mode)?; // [rows, T, H]
    let h = hidden.dim(2)?;
    let picked = hidden
        .reshape((n_rows * t, h))?
        .index_select(&Tensor::from_vec(rows.slots, m, &dev)?, 0)?; // [M, H]
    let targets = Tensor::from_vec(rows.targets, m, &dev)?; // [M]
    let (lp, ent) = head_logprobs(
        model,
        &picked,
        &targets,
        temperature,
        mode,
        entropy,
        one_row,
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

/// The LM head's log-probs (and entropies) `[M]` of `targets` at the hidden states `picked`
/// `[M, H]`. Off the fused CPU path (a GPU's) the head runs in chunks of the attention's byte
/// budget, `[rows, V]` f32 each: 1,365 rows for SmolLM2's vocabulary, where 256-row chunks cost
/// the reference pass ~1,500 small launches (rows are independent: no number changes); there a
/// training forward keeps no `[M, V]` logits (recomputed in the backward).
fn head_logprobs(
    model: &CausalLm,
    picked: &Tensor,
    targets: &Tensor,
    temperature: f64,
    mode: Mode,
    entropy: Entropy,
    one_row: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let head = |h: &Tensor| model.head_logits(h);
    let vocab = match model.plain_head() {
        Some(w) => w.dim(0)?,
        None => model.config().vocab_size,
    };
    let big_rows =
        grpo_models::kernels::portable::chunked_attention::CHUNK_BYTES / (4 * vocab.max(1));
    let train_rows = match model.compute() {
        Compute::Gpu => GPU_TRAIN_HEAD_CHUNK_BYTES / (4 * vocab.max(1)),
        _ => big_rows,
    };
    match model.plain_head() {
        Some(w) if mode == Mode::Train && !one_row => head_logprobs_recomputed(
            picked,
            w,
            targets,
            temperature,
            train_rows.max(1),
            entropy,
            model.head_grad().cloned(),
            model.compute(),
        ),
        _ => token_logprobs_entropy_with(
            picked,
            &head,
            targets,
            temperature,
            match one_row {
                true => DEFAULT_CHUNK_ROWS,
                false => big_rows.max(1),
            },
            entropy,
            model.compute(),
        ),
    }
}

/// Per-token log-probs `[N][len]` of `rows` (prompt, completion) under `model`, without a graph,
/// in packed forward chunks of at most `chunk_tokens` tokens (old-policy and reference log-probs).
pub fn sequence_logprobs(
    model: &CausalLm,
    rows: &[(&[u32], &[u32])],
    pad: u32,
    temperature: f64,
    chunk_tokens: usize,
) -> Result<Vec<Vec<f32>>> {
    let prompts: Vec<&[u32]> = rows.iter().map(|r| r.0).collect();
    let comps: Vec<&[u32]> = rows.iter().map(|r| r.1).collect();
    let mut out = Vec::with_capacity(rows.len());
    for part in forward_chunks(&prompts, &comps, chunk_tokens, one_row(model.compute())) {
        let (lp, _) = completion_logprobs(
            model,
            &prompts[part.clone()],
            &comps[part.clone()],
            pad,
            temperature,
            Mode::Infer,
            Entropy::Skip,
            Packing::SharedPrompt,
        )?; // [n, Tc] f32
        let lens: Vec<usize> = comps[part].iter().map(|c| c.len()).collect();
        out.extend(unpad_rows(&lp, &lens)?);
    }
    Ok(out)
}

/// Rows of a `[N, Tc]` tensor cut to each completion's length.
pub fn unpad_rows(x: &Tensor, lens: &[usize]) -> Result<Vec<Vec<f32>>> {
    let rows = x.to_dtype(candle_core::DType::F32)?.to_vec2::<f32>()?;
    Ok(rows
        .into_iter()
        .zip(lens)
        .map(|(mut r, &l)| {
            r.truncate(l);
            r
        })
        .collect())
}

#[cfg(test)]
mod tests;
