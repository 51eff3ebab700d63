//! The seam between the loop and the model being trained. A [`Policy`] owns the trainable
//! parameters and gives the loop what GRPO needs of it: a frozen copy that samples groups and
//! scores log-probs (rollout, old log-probs, evaluation), a differentiable forward for the update,
//! and the files of a checkpoint. The causal LM ([`CausalLmPolicy`], full fine-tuning or LoRA over
//! a frozen base) is the default kind, the fill-in generator ([`super::FillInPolicy`]) the
//! other; what a kind does to its inputs, logs and metrics beyond GRPO's core are the trait's
//! provided methods. The frozen reference model is a [`Reference`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};

use crate::checkpoint::{AdapterExport, HfExport, ModelFiles};
use crate::flops::FlopShape;
use crate::logprobs::{completion_logprobs, Entropy, Packing};
use crate::optim::exchange::BlockExchange;
use crate::optim::var_tensors;
use crate::optim::zero3::{ShardedParams, SharedRanks};
use crate::peft::{self, LoraConfig};
use crate::rewards::Reward;
use crate::rollout::{Episode, GroupSampler, MicroBatch};
use crate::{Error, Result};
use grpo_models::kernels::grad_sink::GradSink;
use grpo_models::models::checkpointing::{block_of, BlockParams, CheckpointGrads};
use grpo_models::models::{CausalLm, Mode, ModelConfig};
use grpo_models::tokenizer::Tokenizer;

use super::StepMetrics;

/// A trainable policy.
pub trait Policy {
    /// The policy at its current weights, without a graph.
    type Frozen: GroupSampler;
    /// One optimizer step's differentiable forward.
    type Train: TrainForward;

    /// Names of the trainable parameters (checkpoint keys), in the order of [`Self::vars`].
    fn names(&self) -> &[String];
    fn vars(&self) -> &[Var];
    /// A frozen copy for sampling and scoring; `save_memory` trades sampling speed for memory.
    fn freeze(&self, save_memory: bool) -> Result<Self::Frozen>;
    /// A differentiable forward over the parameters. Random choices inside it (LoRA dropout)
    /// are drawn from `dropout_seed`, so a resumed run repeats them.
    fn for_update(&self, dropout_seed: u64, gradient_checkpointing: bool) -> Result<Self::Train>;
    /// The model part of a checkpoint over `tensors` (from [`Self::named_tensors`]).
    fn model_files<'a>(
        &'a self,
        tensors: &'a [(String, Tensor)],
        tok: &'a Tokenizer,
    ) -> ModelFiles<'a>;
    /// A frozen model over full-model `tensors` (checkpoint names): the reference after
    /// `sync_ref_model` mixes the policy into it.
    fn frozen_from(&self, tensors: HashMap<String, Tensor>) -> Result<Self::Frozen>;

    /// Tokens per forward/backward pass when `forward_chunk_tokens` is unset.
    fn forward_chunk_tokens(&self, _gradient_checkpointing: bool) -> usize {
        crate::logprobs::DEFAULT_FORWARD_CHUNK_TOKENS
    }

    /// What sizes a training pass's model FLOPs (the update's throughput and MFU); `None`: not
    /// counted for this policy kind.
    fn flop_shape(&self) -> Option<FlopShape> {
        None
    }

    /// The input sampled for a training prompt's group: the prompt itself, or what the policy
    /// kind makes of it (a fill-in generator's input masked on the fly from the group's `seed`).
    fn round_input(&self, prompt_ids: &[u32], _seed: u64) -> Vec<u32> {
        prompt_ids.to_vec()
    }

    /// Metrics of the policy kind for a round (a fill-in run's `fill/*`), given the round's own.
    fn round_metrics(
        &self,
        _m: &StepMetrics,
        _episodes: &[Episode],
        _rewards: &[Reward],
    ) -> Vec<(String, f64)> {
        vec![]
    }

    /// An episode's prompt as the logs show it, when the policy kind shows it its own way (a
    /// fill-in input with its masks written out); `None`: the dataset's prompt text.
    fn shown_prompt(&self, _tok: &Tokenizer, _e: &Episode) -> Result<Option<String>> {
        Ok(None)
    }

    /// The parameters by name, detached (gathered whole when they are sharded: then every
    /// rank calls it at the same point).
    fn named_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(self
            .names()
            .iter()
            .zip(self.vars())
            .map(|(n, v)| (n.clone(), v.as_tensor().detach()))
            .collect())
    }

    /// The device the parameters live on.
    fn device(&self) -> Device {
        self.vars()
            .first()
            .map_or(Device::Cpu, |v| v.device().clone())
    }

    /// `zero_stage = 3`: keeps only this rank's range of the parameters, gathered through
    /// `ranks` whenever they are used ([`crate::optim::zero3`]). Default: refused.
    fn shard_parameters(&mut self, _ranks: SharedRanks) -> Result<()> {
        Err(Error::config(
            "zero_stage",
            "3 shards a causal LM's parameters; this policy kind trains whole: use 0, 1 or 2",
        ))
    }

    /// The sharded parameters after [`Self::shard_parameters`] (then [`Self::vars`] is empty).
    fn sharded(&self) -> Option<&Arc<ShardedParams>> {
        None
    }
}

/// What the update needs of a differentiable forward.
pub trait TrainForward {
    /// Per-token log-probs `[n, Tc]` of the micro-batch's completions (and entropies when
    /// `entropy` asks), with a graph back to the parameters.
    fn logprobs(
        &self,
        mb: &MicroBatch,
        pad: u32,
        temperature: f64,
        entropy: Entropy,
    ) -> Result<(Tensor, Option<Tensor>)>;
    /// The gradient of `v` that the last backward left outside candle's store (blocks recomputed
    /// by gradient checkpointing), taken out.
    fn take_chunk_grad(&self, v: &Var) -> Result<Option<Tensor>>;
    /// The gradient of `v` accumulated outside autograd over the whole step (projection weights'
    /// gradient sinks), taken out.
    fn take_step_grad(&self, v: &Var) -> Result<Option<Tensor>>;
    /// `zero_stage = 3`'s side of the step: the blocks' exchange and the parameters gathered
    /// for it (None: the policy's own [`Policy::vars`] are trained).
    fn sharded(&self) -> Option<&ShardedStep> {
        None
    }
    /// Whether [`Self::logprobs`] lays every pack into one row (a group's prompt counted once
    /// when passes are sized: [`crate::logprobs::forward_chunks`]).
    fn one_row(&self) -> bool {
        true
    }
}

/// A `zero_stage = 3` optimizer step's parameters: the blocks, gathered one at a time through
/// `exchange` (which sums their gradients into this rank's range during the backward), and the
/// other parameters (embedding, final norm, LM head), gathered for the step as `outer_vars`.
pub struct ShardedStep {
    pub exchange: Arc<BlockExchange>,
    /// The outer parameters' indices among the policy's names, their names and their `Var`s.
    outer_idx: Vec<usize>,
    pub outer_names: Vec<String>,
    pub outer_vars: Vec<Var>,
}

impl ShardedStep {
    /// The step's gradient of this rank's range, summed over the world (`[range]`): the outer
    /// parameters' gradients `grads` (of `outer_vars`) reduce-scattered into the blocks'.
    /// Every rank calls it.
    pub fn finish(&self, grads: &[Tensor]) -> Result<Tensor> {
        self.exchange.reduce_outer(&self.outer_idx, grads)?;
        let part = self.exchange.take()?;
        let n = part.len();
        Ok(Tensor::from_vec(part, n, &Device::Cpu)?)
    }
}

/// A causal LM: every base tensor trained (full fine-tuning), or LoRA adapters over a frozen base.
pub struct CausalLmPolicy {
    pub cfg: ModelConfig,
    /// HF tensor names (full fine-tuning) or PEFT adapter keys (LoRA).
    pub names: Vec<String>,
    pub vars: Vec<Var>,
    pub device: Device,
    /// The models' compute dtype (`dtype`): f32, or bf16 weights and activations built from
    /// the f32 master parameters (the cast is part of the graph, so gradients reach them in
    /// f32; log-softmax and the loss run in f32).
    pub dtype: DType,
    /// LoRA: the frozen base model (with adapters off it is also the reference) and the options.
    pub lora: Option<(CausalLm, LoraConfig)>,
    /// `zero_stage = 3`: this rank's range of the parameters (`vars` is then empty).
    pub sharded: Option<Arc<ShardedParams>>,
    /// What LoRA checkpoints name as their base (`base_model_name_or_path`).
    pub base_model_name: String,
    /// The source model's `generation_config.json`, carried into checkpoints.
    pub generation_config: Option<serde_json::Value>,
}

impl CausalLmPolicy {
    fn tensors(&self, track: bool) -> Result<Vec<(String, Tensor)>> {
        match &self.sharded {
            Some(p) => p.gather_all(),
            None => Ok(var_tensors(&self.names, &self.vars, track)),
        }
    }

    /// A model over the current parameters: with a graph (`track`) or detached.
    fn build(&self, track: bool, dropout: Option<(u64, Arc<AtomicU64>)>) -> Result<CausalLm> {
        match &self.lora {
            None => {
                let tensors: HashMap<String, Tensor> = self.tensors(track)?.into_iter().collect();
                CausalLm::from_tensors(&self.cfg, tensors, self.dtype, &self.device)
            }
            Some((base, lcfg)) => {
                let mut m = base.clone();
                let adapters = peft::adapters(&self.tensors(track)?, lcfg, dropout)?;
                if track {
                    m.set_lora(&adapters)?;
                } else {
                    // Sampling and scoring: adapters merged into (copies of) the dense weights
                    // they touch, no extra matmuls per decoded token.
                    m.merge_lora(&adapters)?;
                }
                Ok(m)
            }
        }
    }
}

impl Policy for CausalLmPolicy {
    type Frozen = CausalLm;
    type Train = CausalLmForward;

    fn names(&self) -> &[String] {
        &self.names
    }

    fn vars(&self) -> &[Var] {
        &self.vars
    }

    /// Packed for the decoding GEMM (`models::packed`) unless `save_memory` (gradient
    /// checkpointing asked for): with LoRA the packed copy of the whole base (the size of the f32
    /// model) would then set the run's peak memory.
    fn freeze(&self, save_memory: bool) -> Result<CausalLm> {
        let mut m = self.build(false, None)?;
        if !save_memory {
            m.pack_for_decoding()?;
        }
        Ok(m)
    }

    fn for_update(
        &self,
        dropout_seed: u64,
        gradient_checkpointing: bool,
    ) -> Result<CausalLmForward> {
        if let Some(p) = &self.sharded {
            return self.sharded_forward(p);
        }
        let clock = Arc::new(AtomicU64::new(0));
        // Projection weights' gradients go straight into f32 accumulators (the fused CPU code,
        // or cuBLAS on a GPU); the rest (embedding, norms, biases, LoRA adapters) through
        // candle's autograd, or, for blocks recomputed by gradient checkpointing, into the
        // checkpoint store. The portable CPU path keeps candle's autograd throughout.
        let compute = grpo_models::kernels::Compute::resolve(&self.device, self.dtype);
        let (mut model, sink) = match (&self.lora, compute) {
            (None, grpo_models::kernels::Compute::Gpu) => {
                // Each parameter cast to the compute dtype once, here, so that the sink knows
                // the tensors the model's projections hold.
                let tensors = self
                    .tensors(true)?
                    .into_iter()
                    .map(|(n, t)| Ok((n, t.to_dtype(self.dtype)?)))
                    .collect::<Result<Vec<(String, Tensor)>>>()?;
                let pairs: Vec<(&Var, &Tensor)> = self
                    .vars
                    .iter()
                    .zip(tensors.iter().map(|(_, t)| t))
                    .collect();
                let sink = GradSink::on_gpu(&pairs);
                let tensors: HashMap<String, Tensor> = tensors.into_iter().collect();
                let model = CausalLm::from_tensors(&self.cfg, tensors, self.dtype, &self.device)?;
                (model, sink)
            }
            _ => {
                let model = self.build(true, Some((dropout_seed, clock.clone())))?;
                let sink = match compute.is_fused() {
                    true => GradSink::new(&self.vars).with_bf16_matmuls(compute.bf16_matmuls()),
                    false => GradSink::default(),
                };
                (model, sink)
            }
        };
        if self.lora.is_none() && (compute.is_fused() || compute.on_gpu()) {
            model.attach_grad_sink(&sink)?;
        }
        let ckpt = match gradient_checkpointing {
            true => Some(CheckpointGrads::new(&self.vars, &self.device)?),
            false => None,
        };
        model.set_checkpointing(ckpt.clone());
        Ok(CausalLmForward {
            model,
            dropout_clock: clock,
            sink,
            ckpt,
            sharded: None,
        })
    }

    fn named_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        self.tensors(false)
    }

    fn device(&self) -> Device {
        self.device.clone()
    }

    fn shard_parameters(&mut self, ranks: SharedRanks) -> Result<()> {
        if self.lora.is_some() || self.cfg.arch == grpo_models::models::Arch::Gpt2 {
            return Err(Error::config(
                "zero_stage",
                format!(
                    "3 shards the blocks of a Llama-family model trained in full; this run \
                     trains {}: use 2",
                    match &self.lora {
                        Some(_) => "LoRA adapters".to_string(),
                        None => format!("a {} model", self.cfg.arch.name()),
                    }
                ),
            ));
        }
        let params = ShardedParams::new(&self.tensors(false)?, ranks)?;
        self.vars.clear();
        self.sharded = Some(Arc::new(params));
        Ok(())
    }

    fn sharded(&self) -> Option<&Arc<ShardedParams>> {
        self.sharded.as_ref()
    }

    /// [`crate::logprobs::default_chunk_tokens`] for this model, its compute, its adapters
    /// (what `grpo plan` counts for them) and the device's free memory now.
    fn forward_chunk_tokens(&self, gradient_checkpointing: bool) -> usize {
        let lora = self.lora.as_ref().map_or(0, |(base, l)| {
            let projections = base.projection_shapes().unwrap_or_default();
            let elems = crate::memory_plan::lora_activation_elems(
                &projections,
                &|m| l.targets(m),
                l.dropout > 0.0,
                self.cfg.intermediate_size,
            );
            crate::logprobs::lora_activation_bytes(
                elems,
                self.cfg.num_layers,
                gradient_checkpointing,
            )
        });
        crate::logprobs::default_chunk_tokens(
            grpo_models::kernels::Compute::resolve(&self.device, self.dtype),
            grpo_models::kernels::free_memory(&self.device),
            (
                self.cfg.hidden_size,
                self.cfg.intermediate_size,
                self.cfg.num_layers,
            ),
            self.dtype.size_in_bytes(),
            gradient_checkpointing,
            self.cfg.approx_params(),
            lora,
        )
    }

    fn frozen_from(&self, tensors: HashMap<String, Tensor>) -> Result<CausalLm> {
        CausalLm::from_tensors(&self.cfg, tensors, self.dtype, &self.device)
    }

    fn flop_shape(&self) -> Option<FlopShape> {
        Some(FlopShape::of(&self.cfg, self.lora.is_none()))
    }

    fn model_files<'a>(
        &'a self,
        tensors: &'a [(String, Tensor)],
        tok: &'a Tokenizer,
    ) -> ModelFiles<'a> {
        match &self.lora {
            None => ModelFiles::Full(HfExport {
                config: &self.cfg,
                tensors,
                tokenizer: Some(tok),
                generation_config: self.generation_config.as_ref(),
                eos_token_ids: &self.cfg.eos_token_ids,
            }),
            Some((_, lcfg)) => ModelFiles::Adapter(AdapterExport {
                config: lcfg,
                model_config: &self.cfg,
                base_model: &self.base_model_name,
                tensors,
                tokenizer: Some(tok),
            }),
        }
    }
}

impl CausalLmPolicy {
    /// `zero_stage = 3`'s training forward: the outer parameters gathered for the step as
    /// fresh `Var`s, the blocks gathered one at a time by the model through a
    /// [`BlockExchange`] (inside gradient checkpointing's recomputation). Every rank calls it.
    fn sharded_forward(&self, p: &Arc<ShardedParams>) -> Result<CausalLmForward> {
        let layers = self.cfg.num_layers;
        let exchange = Arc::new(BlockExchange::new(p.clone(), layers, block_of)?);
        let outer_idx: Vec<usize> = (0..p.names().len())
            .filter(|&j| !exchange.in_block(j))
            .collect();
        let outer_names: Vec<String> = outer_idx.iter().map(|&j| p.names()[j].clone()).collect();
        let outer_vars = p
            .gather(&outer_idx)?
            .iter()
            .map(Var::from_tensor)
            .collect::<candle_core::Result<Vec<_>>>()?;
        let tensors: HashMap<String, Tensor> = outer_names
            .iter()
            .cloned()
            .zip(outer_vars.iter().map(|v| v.as_tensor().clone()))
            .collect();
        let blocks: Arc<dyn BlockParams> = exchange.clone();
        let mut model =
            CausalLm::with_sharded_blocks(&self.cfg, tensors, blocks, self.dtype, &self.device)?;
        // The embedding's and the LM head's gradients as in stage 0 (a sink on the fused CPU
        // path); the blocks' go to the exchange.
        let compute = grpo_models::kernels::Compute::resolve(&self.device, self.dtype);
        let sink = match compute.is_fused() {
            true => GradSink::new(&outer_vars).with_bf16_matmuls(compute.bf16_matmuls()),
            false => GradSink::default(),
        };
        if compute.is_fused() {
            model.attach_grad_sink(&sink)?;
        }
        let ckpt = CheckpointGrads::new(&outer_vars, &self.device)?;
        model.set_checkpointing(Some(ckpt.clone()));
        Ok(CausalLmForward {
            model,
            dropout_clock: Arc::new(AtomicU64::new(0)),
            sink,
            ckpt: Some(ckpt),
            sharded: Some(ShardedStep {
                exchange,
                outer_idx,
                outer_names,
                outer_vars,
            }),
        })
    }
}

/// The causal LM's differentiable forward for one optimizer step.
pub struct CausalLmForward {
    model: CausalLm,
    /// LoRA dropout masks: advanced once per forward pass.
    dropout_clock: Arc<AtomicU64>,
    sink: GradSink,
    ckpt: Option<Arc<CheckpointGrads>>,
    sharded: Option<ShardedStep>,
}

impl TrainForward for CausalLmForward {
    fn logprobs(
        &self,
        mb: &MicroBatch,
        pad: u32,
        temperature: f64,
        entropy: Entropy,
    ) -> Result<(Tensor, Option<Tensor>)> {
        self.dropout_clock.fetch_add(1, Ordering::Relaxed);
        completion_logprobs(
            &self.model,
            &mb.prompts,
            &mb.completions,
            pad,
            temperature,
            Mode::Train,
            entropy,
            Packing::SharedPrompt,
        )
    }

    fn one_row(&self) -> bool {
        crate::logprobs::one_row(self.model.compute())
    }

    fn take_chunk_grad(&self, v: &Var) -> Result<Option<Tensor>> {
        match &self.ckpt {
            Some(c) => Ok(c.take(v)?),
            None => Ok(None),
        }
    }

    fn take_step_grad(&self, v: &Var) -> Result<Option<Tensor>> {
        Ok(self.sink.take(v)?)
    }

    fn sharded(&self) -> Option<&ShardedStep> {
        self.sharded.as_ref()
    }
}

/// The frozen reference model, when a KL term or a reward needs it.
pub struct Reference<F> {
    pub model: Option<F>,
    /// Its HF-layout tensors, kept only when the policy is mixed into it (`sync_ref_model`).
    pub tensors: Option<HashMap<String, Tensor>>,
}

impl<F: GroupSampler> Reference<F> {
    /// Per-token log-probs of `rows` under the reference (None without one).
    pub fn logprobs(
        &self,
        rows: &[(&[u32], &[u32])],
        pad: u32,
        temperature: f64,
        chunk_tokens: usize,
    ) -> Result<Option<Vec<Vec<f32>>>> {
        match &self.model {
            Some(m) => Ok(Some(m.sequence_logprobs(
                rows,
                pad,
                temperature,
                chunk_tokens,
            )?)),
            None => Ok(None),
        }
    }

    /// TRL's reference sync: `ref = alpha * policy + (1 - alpha) * ref`.
    pub fn sync<P: Policy<Frozen = F>>(&mut self, policy: &P, alpha: f64) -> Result<()> {
        let Some(rt) = self.tensors.as_mut() else {
            return Ok(());
        };
        for (n, v) in policy.named_tensors()? {
            if let Some(r) = rt.get_mut(&n) {
                *r = ((v * alpha)? + (r.clone() * (1.0 - alpha))?)?;
            }
        }
        self.model = Some(policy.frozen_from(rt.clone())?);
        Ok(())
    }
}
