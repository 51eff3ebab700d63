//! The plan's terms, one function per phase; each term says which code it follows.

use grpo_models::kernels::Compute;

use super::{
    BatchShape, Phase, PlanInput, Term, CPU_PROCESS_BYTES, GPU_PROCESS_BYTES, MPI_RANK_BYTES,
};
use crate::logprobs::{activation_bytes_per_token, DEFAULT_CHUNK_ROWS};
use crate::optim::zero::WINDOW;

/// Rows of the LM head's chunks off the fused CPU path: `[rows, V]` f32 logits of
/// `CHUNK_BYTES` (the portable path, a reference pass) or of the GPU's training budget.
fn head_chunk_rows(compute: Compute, vocab: usize, training: bool) -> usize {
    let bytes = match (compute, training) {
        (Compute::Gpu, true) => crate::logprobs::GPU_TRAIN_HEAD_CHUNK_BYTES,
        _ => grpo_models::kernels::portable::chunked_attention::CHUNK_BYTES,
    };
    (bytes / (4 * vocab.max(1))).max(1)
}

/// A training pass: what the update's forward chunks hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct PassShape {
    /// Tokens through the blocks (each group's prompt once, plus its completions).
    pub tokens: usize,
    /// Completion tokens (rows through the LM head).
    pub completion_tokens: usize,
    /// Passes per micro-batch.
    pub passes: usize,
    /// The token budget the passes were cut to (`forward_chunk_tokens`).
    pub budget: usize,
}

/// The largest pass of a micro-batch under a budget of `budget` tokens, as
/// [`crate::logprobs::forward_chunks`] cuts it for a forward that lays packs in `one_row` or in
/// padded rows: whole groups (prompt once, G completions; the prompt in each completion's row
/// where the group gets a row per completion) while they fit; a group longer than the budget
/// split between its completions, its prompt counted in each part (in each row).
pub fn pass_shape(b: &BatchShape, budget: usize, one_row: bool) -> PassShape {
    let (lp, lc) = (b.prompt_tokens, b.completion_tokens.max(1));
    let group_rows = b.micro_batch.min(b.generations).max(1);
    let groups = (b.micro_batch / group_rows).max(1);
    let per_row = crate::logprobs::group_per_row(lp, std::iter::repeat_n(lc, group_rows), one_row);
    let prompts = |rows: usize| if per_row { rows * lp } else { lp };
    let group_tokens = prompts(group_rows) + group_rows * lc;
    let budget = budget.max(1);
    if group_tokens > budget {
        let row = if per_row { lp + lc } else { lc };
        let k = (budget.saturating_sub(lp + lc) / row + 1).clamp(1, group_rows);
        return PassShape {
            tokens: prompts(k) + k * lc,
            completion_tokens: k * lc,
            passes: groups * group_rows.div_ceil(k),
            budget,
        };
    }
    let per_pass = (budget / group_tokens).clamp(1, groups);
    PassShape {
        tokens: per_pass * group_tokens,
        completion_tokens: per_pass * group_rows * lc,
        passes: groups.div_ceil(per_pass),
        budget,
    }
}

/// `forward_chunk_tokens`: the config's, else the trainer's default for the compute
/// ([`crate::logprobs::default_chunk_tokens`]), with the memory left after the `held` bytes as
/// the free memory the trainer measures at the start.
pub(super) fn forward_chunk_tokens(input: &PlanInput, held: u64) -> usize {
    if let Some(n) = input.batch.forward_chunk_tokens {
        return n;
    }
    let c = &input.model.config;
    crate::logprobs::default_chunk_tokens(
        input.compute,
        input.memory.map(|m| m.saturating_sub(held)),
        (c.hidden_size, c.intermediate_size, c.num_layers),
        act_bytes(input),
        input.gradient_checkpointing,
        c.approx_params(),
        lora_activation_bytes(input),
    )
}

/// Bytes of a frozen copy's elements: the compute dtype's, but f32 under CPU mixed precision
/// (`Compute::storage_dtype`: its weights and activations stay f32).
fn storage_bytes(input: &PlanInput) -> u64 {
    match input.compute {
        Compute::CpuMixed => 4,
        _ => input.dtype_bytes as u64,
    }
}

/// Bytes of an activation element (as [`storage_bytes`]).
fn act_bytes(input: &PlanInput) -> usize {
    storage_bytes(input) as usize
}

/// Trainable parameters: every tensor (full fine-tuning) or the adapters.
pub(super) fn trainable(input: &PlanInput) -> u64 {
    match &input.lora {
        Some(l) => l.trainable,
        None => input.model.params(),
    }
}

/// `x / N` when ZeRO stage `from` or higher shards it over `N` ranks.
fn shard(input: &PlanInput, bytes: u64, from: u8) -> u64 {
    match input.zero_stage >= from && input.world_size > 1 {
        true => bytes.div_ceil(input.world_size as u64),
        false => bytes,
    }
}

fn term(name: &'static str, phase: Phase, bytes: u64, how: String) -> Term {
    Term {
        name,
        phase,
        bytes,
        how,
    }
}

/// What a rank holds for the whole run.
///
/// - process: [`CPU_PROCESS_BYTES`] / [`GPU_PROCESS_BYTES`]; a CPU rank of several adds
///   [`MPI_RANK_BYTES`].
/// - policy weights: the trainer's `Var`s (`train/setup.rs`, `policy_parameters`), f32 whatever
///   the compute dtype (AdamW steps f32 masters); with LoRA the adapters, plus the frozen base
///   built in the storage dtype (QLoRA: its projections quantized).
/// - reference: full fine-tuning with a KL term builds a second model from the loaded tensors in
///   the storage dtype (`CausalLmPolicy::load`); under CPU mixed precision it also packs bf16
///   panels of every projection and the head; `sync_ref_model` keeps the f32 tensors too. With
///   LoRA the reference is the frozen base (adapters off): nothing more.
/// - AdamW moments: two f32 buffers per trainable element (`optim.rs`, `Moments::zeros`).
pub(super) fn always(input: &PlanInput) -> Vec<Term> {
    let m = &input.model;
    let (p, sb) = (m.params(), storage_bytes(input));
    let on_gpu = input.compute.on_gpu();
    let process = match on_gpu {
        true => GPU_PROCESS_BYTES,
        false => CPU_PROCESS_BYTES,
    };
    let mut out = vec![term(
        "process",
        Phase::Always,
        process,
        match on_gpu {
            true => "CUDA context, workspaces, pool rounding (assumed)".into(),
            false => "binary, tokenizer, data, threads, allocator (calibrated)".into(),
        },
    )];
    if input.world_size > 1 && !on_gpu {
        out.push(term(
            "MPI",
            Phase::Always,
            MPI_RANK_BYTES,
            "Open MPI's libraries, shared memory, collectives (calibrated)".into(),
        ));
    }
    let n = trainable(input);
    let masters = shard(input, 4 * n, 3);
    match &input.lora {
        None => out.push(term(
            "policy weights",
            Phase::Always,
            masters,
            format!("{p} params x 4 B (f32 masters){}", zero_note(input, 3)),
        )),
        Some(l) => {
            let proj: u64 = m.projections().iter().map(|(_, e)| e).sum();
            let base = match l.quantized_bits {
                Some(bits) => (proj as f64 * bits / 8.0) as u64 + (p - proj) * sb,
                None => p * sb,
            };
            out.push(term(
                "frozen base",
                Phase::Always,
                base,
                format!(
                    "{p} params x {sb} B{}",
                    match l.quantized_bits {
                        Some(b) => format!(", projections at {b} bits"),
                        None => String::new(),
                    }
                ),
            ));
            out.push(term(
                "LoRA adapters",
                Phase::Always,
                masters,
                format!("{n} params x 4 B (f32){}", zero_note(input, 3)),
            ));
        }
    }
    if input.reference && input.lora.is_none() {
        let panels = match input.compute {
            Compute::CpuMixed => 2 * reference_panel_elems(input),
            _ => 0,
        };
        let sync = match input.sync_ref_model {
            true => 4 * p,
            false => 0,
        };
        out.push(term(
            "reference",
            Phase::Always,
            p * sb + panels + sync,
            format!(
                "{p} params x {sb} B{}{}",
                if panels > 0 { " + bf16 panels" } else { "" },
                if sync > 0 {
                    " + f32 copy (sync_ref_model)"
                } else {
                    ""
                }
            ),
        ));
    }
    out.push(term(
        "AdamW moments",
        Phase::Always,
        shard(input, 8 * n, 1),
        format!("{n} params x 2 x 4 B{}", zero_note(input, 1)),
    ));
    out
}

/// The elements `pack_for_decoding` packs: every projection and the LM head.
fn reference_panel_elems(input: &PlanInput) -> u64 {
    let proj: u64 = input.model.projections().iter().map(|(_, e)| e).sum();
    proj + input.model.head_elems()
}

fn zero_note(input: &PlanInput, from: u8) -> String {
    match input.zero_stage >= from && input.world_size > 1 {
        true => format!(" / {} ranks", input.world_size),
        false => String::new(),
    }
}

/// What sampling a round adds (`train/round.rs`, `sample`; `grpo-models/src/sampler`).
///
/// - sampler copy: `Policy::freeze` builds a model over the current weights. On the fused CPU
///   path it packs every projection and the head for the decoding GEMM (`pack_for_decoding`,
///   f32 panels, bf16 under mixed precision), unless `gradient_checkpointing` asks it to save
///   memory; then (and on a GPU in f32) only the joined q/k/v and gate/up weights are new
///   copies, the rest shares the policy's tensors. A GPU in bf16 casts every tensor. LoRA merges
///   the adapters into copies of the projections they touch (and packs the whole base on the
///   fused CPU path). QLoRA's quantized base takes no merge (`CausalLm::merge_lora` attaches the
///   adapters): nothing is copied, or on the fused CPU path its projections packed as they are
///   quantized and the head as dense panels. ZeRO-3 gathers the whole model for it.
/// - KV cache: the prompts' cache (prompts of the pass x longest prompt) and the batched cache
///   of every sequence of the pass (longest prompt + `max_completion_length` slots), keys and
///   values of every layer in the storage dtype (`sampler::batch_cache`).
/// - logits: one step's `[sequences, V]` f32, and their host copy on the fused CPU path.
pub(super) fn rollout(input: &PlanInput) -> Vec<Term> {
    let (m, b) = (&input.model, &input.batch);
    let c = &m.config;
    let sb = storage_bytes(input);
    let seqs = match b.sampling_batch {
        0 => b.round_sequences,
        cap => b
            .round_sequences
            .min((cap / b.generations).max(1) * b.generations),
    }
    .max(1) as u64;
    let prompts = seqs.div_ceil(b.generations as u64);
    let per_token = (c.num_layers * 2 * c.num_kv_heads * c.head_dim) as u64 * sb;
    let (lp, lc) = (b.prompt_tokens as u64, b.completion_tokens as u64);
    let kv = per_token * (prompts * lp + seqs * (lp + lc));
    let host = if input.compute.is_fused() { 2 } else { 1 };
    let logits = host * seqs * c.vocab_size as u64 * 4;
    vec![
        sampler_copy(input),
        term(
            "KV cache",
            Phase::Rollout,
            kv,
            format!(
                "{seqs} seqs x ({lp} + {lc}) tokens x {} layers x 2 x {} kv heads x {} x {sb} B",
                c.num_layers, c.num_kv_heads, c.head_dim
            ),
        ),
        term(
            "sampling logits",
            Phase::Rollout,
            logits,
            format!("{host} x {seqs} x {} vocab x 4 B", c.vocab_size),
        ),
    ]
}

/// The policy frozen for sampling (see [`rollout`]); taken again for the old log-probs.
fn sampler_copy(input: &PlanInput) -> Term {
    let m = &input.model;
    let sb = storage_bytes(input);
    let packs = input.compute.packs_for_decoding() && !input.gradient_checkpointing;
    let panel = match input.compute.bf16_matmuls() {
        true => 2,
        false => sb,
    };
    let quant_bits = input.lora.as_ref().and_then(|l| l.quantized_bits);
    let (bytes, how) = match (&input.lora, packs, quant_bits) {
        // QLoRA: a quantized base takes no merge (its adapters stay attached); packing copies
        // its projections as quantized panels and the head as dense ones.
        (Some(_), true, Some(bits)) => {
            let proj: u64 = m.projections().iter().map(|(_, e)| e).sum();
            (
                (proj as f64 * bits / 8.0) as u64 + m.head_elems() * panel,
                format!("projections packed at {bits} bits, head at {panel} B"),
            )
        }
        (_, true, _) => (
            reference_panel_elems(input) * panel,
            format!("projections + head packed, {panel} B"),
        ),
        (None, false, _) if input.zero_stage >= 3 && input.world_size > 1 => (
            m.params() * sb,
            format!("the whole model gathered, {sb} B (ZeRO-3)"),
        ),
        (None, false, _) if sb != 4 => (m.params() * sb, format!("every tensor cast to {sb} B")),
        (None, false, _) => (m.joined_elems() * 4, "joined q/k/v, gate/up copies".into()),
        (Some(_), false, Some(_)) => (0, "none: adapters attached to the quantized base".into()),
        (Some(l), false, None) => (
            l.merged_elems * sb,
            format!("merged copies of the adapted projections, {sb} B"),
        ),
    };
    term("sampler copy", Phase::Rollout, bytes, how)
}

/// The old-policy and reference log-probs (`train/round.rs`, `log_probs`), when the update is
/// off-policy or a reference is read: forwards without a graph over passes of
/// `forward_chunk_tokens`. The sampler copy is kept for the old log-probs
/// when the update is off-policy. A pass holds one block's tensors at a time (its input, the
/// norm, q/k/v and the attention's output, the MLP's 2 x intermediate and intermediate: ~6
/// hidden- and 3 intermediate-wide per token) and one chunk of the LM head's logits (256 rows on
/// the fused CPU path, `CHUNK_BYTES` elsewhere) with its log-softmax.
pub(super) fn log_probs(input: &PlanInput, chunk: usize) -> Vec<Term> {
    let c = &input.model.config;
    let ab = act_bytes(input) as u64;
    let mut out = Vec::new();
    if !(input.needs_old || input.reference) {
        return out;
    }
    if input.needs_old {
        let mut s = sampler_copy(input);
        s.phase = Phase::LogProbs;
        out.push(s);
    }
    let tokens = (chunk as u64).min(pass_tokens_all(&input.batch));
    let acts = tokens * (6 * c.hidden_size + 3 * c.intermediate_size) as u64 * ab;
    let rows = match input.compute.is_fused() {
        true => DEFAULT_CHUNK_ROWS,
        false => head_chunk_rows(input.compute, c.vocab_size, false),
    } as u64;
    let rows = rows.min(tokens.max(1));
    out.push(term(
        "forward (no graph)",
        Phase::LogProbs,
        acts + 2 * rows * c.vocab_size as u64 * 4,
        format!("{tokens} tokens x one block + 2 x {rows} x vocab x 4 B logits"),
    ));
    out
}

/// Tokens of all of a rank's round in one pass (the log-probs' passes are at most this).
fn pass_tokens_all(b: &BatchShape) -> u64 {
    let groups = b.round_sequences.div_ceil(b.generations.max(1)) as u64;
    groups * b.prompt_tokens as u64 + b.round_sequences as u64 * b.completion_tokens as u64
}

/// What the update adds (`train/update.rs`, `policy_gradients`; `train/policy.rs`,
/// `for_update`).
///
/// - gradients: one f32 per trainable element (the gradient sinks' accumulators and candle's
///   gradients, summed over the micro-batches). ZeRO-2 reduce-scatters them only once candle's
///   backward has made them all, so a rank holds them whole as at stage 0. ZeRO-3 keeps this
///   rank's range of the summed gradients (the blocks' are reduce-scattered as each block's
///   backward runs) and the gradients of the parameters outside the blocks whole (candle's,
///   and on the fused CPU path the sink's too; `train/policy.rs`, `sharded_forward`).
/// - reduce buffer (ZeRO-2 and 3 on several ranks): the largest window of gradients
///   sent at once (`optim/zero.rs`, `windows`: [`WINDOW`] elements, or a larger tensor alone).
/// - training copy: a GPU in bf16 casts every parameter to bf16 for the pass; on the CPU (f32
///   or mixed) the training forward reads the f32 masters. ZeRO-3 gathers two blocks at a time.
/// - activations: what a pass keeps for its backward, `activation_bytes_per_token` x the pass's
///   tokens (`logprobs`: ~16 hidden- and 6 intermediate-wide per block, or each block's input
///   plus one recomputed block with `gradient_checkpointing`), plus LoRA's adapters' own
///   ([`super::ModelShapes::lora_activation_elems`]).
/// - LM-head logits: on the fused CPU path autograd keeps every 256-row chunk's f32 logits of
///   the pass for the fused log-softmax's backward (`completion tokens x V x 4`), and the
///   backward holds one chunk's gradient; elsewhere the head is recomputed in chunks
///   (`head_logprobs_recomputed`): a chunk's logits and gradient on a GPU, ~4 chunk-sized
///   tensors on the portable path.
pub(super) fn update(input: &PlanInput, pass: &PassShape) -> Vec<Term> {
    let c = &input.model.config;
    let n = trainable(input);
    let mut out = gradients(input, n);
    if let Some(t) = training_copy(input) {
        out.push(t);
    }
    let shape = (c.hidden_size, c.intermediate_size, c.num_layers);
    let per_token =
        activation_bytes_per_token(shape, act_bytes(input), input.gradient_checkpointing)
            + lora_activation_bytes(input);
    out.push(term(
        "activations",
        Phase::Update,
        pass.tokens as u64 * per_token,
        format!(
            "{} tokens/pass x {} KiB/token{}",
            pass.tokens,
            per_token / 1024,
            if input.gradient_checkpointing {
                " (checkpointed)"
            } else {
                ""
            }
        ),
    ));
    let (v, m) = (c.vocab_size as u64, pass.completion_tokens as u64);
    let (bytes, how) = match input.compute.is_fused() {
        true => {
            let chunk = m.min(DEFAULT_CHUNK_ROWS as u64);
            (
                (m + chunk) * v * 4,
                format!("({m} kept + {chunk} grad) rows x {v} vocab x 4 B"),
            )
        }
        false => {
            let rows = (head_chunk_rows(input.compute, c.vocab_size, true) as u64).min(m.max(1));
            let live = if input.compute.on_gpu() { 2 } else { 4 };
            (
                live * rows * v * 4,
                format!("{live} x {rows} rows x {v} vocab x 4 B (recomputed)"),
            )
        }
    };
    out.push(term("LM-head logits", Phase::Update, bytes, how));
    out
}

/// The update's gradient terms (see [`update`]) for `n` trainable elements.
fn gradients(input: &PlanInput, n: u64) -> Vec<Term> {
    let sharded = input.world_size > 1 && input.zero_stage >= 2;
    let grads = match sharded && input.zero_stage >= 3 && input.lora.is_none() {
        true => {
            let outer = input.model.params() - input.model.block_elems();
            let copies = if input.compute.is_fused() { 2 } else { 1 };
            term(
                "gradients",
                Phase::Update,
                shard(input, 4 * n, 3) + copies * 4 * outer,
                format!(
                    "{n} params x 4 B{} + {copies} x {outer} outside the blocks x 4 B",
                    zero_note(input, 3)
                ),
            )
        }
        false => term(
            "gradients",
            Phase::Update,
            4 * n,
            format!(
                "{n} params x 4 B{}",
                if sharded {
                    " (whole until reduced)"
                } else {
                    ""
                }
            ),
        ),
    };
    let mut out = vec![grads];
    if sharded {
        let largest = match input.lora {
            None => input.model.largest_elems(),
            Some(_) => 0,
        };
        let window = largest.max((WINDOW as u64).min(n));
        out.push(term(
            "reduce buffer",
            Phase::Update,
            4 * window,
            format!("{window} values x 4 B (the largest window sent)"),
        ));
    }
    out
}

/// Bytes per token LoRA's adapters add to a pass's kept activations (in f32: the adapters
/// compute in f32); with `gradient_checkpointing` only one block's worth is kept at a time.
fn lora_activation_bytes(input: &PlanInput) -> u64 {
    let Some(l) = &input.lora else {
        return 0;
    };
    crate::logprobs::lora_activation_bytes(
        l.activation_elems,
        input.model.config.num_layers,
        input.gradient_checkpointing,
    )
}

/// The training forward's own copy of the weights, when it has one (see [`update`]).
fn training_copy(input: &PlanInput) -> Option<Term> {
    let m = &input.model;
    let sb = storage_bytes(input);
    let gathered = input.zero_stage >= 3 && input.world_size > 1;
    let (bytes, how) = match (&input.lora, input.compute.on_gpu() && sb != 4) {
        (None, true) if !gathered => (m.params() * sb, format!("every parameter cast to {sb} B")),
        (None, _) if gathered => {
            let c = &m.config;
            let block = (m.params() - m.head_elems()) / c.num_layers.max(1) as u64;
            (
                (2 * block + m.head_elems()) * sb,
                "two blocks + head gathered (ZeRO-3)".to_string(),
            )
        }
        _ => return None,
    };
    Some(term("training copy", Phase::Update, bytes, how))
}
