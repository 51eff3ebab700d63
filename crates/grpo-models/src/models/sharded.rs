//! The blocks of a Llama-family model whose parameters live elsewhere (ZeRO-3): each training
//! forward builds block `i` from [`BlockParams::gather`]'s tensors, runs it checkpointed
//! ([`super::checkpointing::checkpoint_sharded`]) and drops it; its recomputation hands the
//! block's gradients back through [`BlockParams::gradients`] (the loop is
//! [`super::llama::Model::forward_hidden`]'s). See [`super::CausalLm::with_sharded_blocks`].

use std::sync::Arc;

use candle_core::{DType, Device};

use super::checkpointing::BlockParams;
use super::config::ModelConfig;
use crate::kernels::Compute;

/// Where a [`super::llama::Model`]'s blocks come from when it keeps none.
#[derive(Debug, Clone)]
pub struct Sharded {
    pub(super) blocks: Arc<dyn BlockParams>,
    pub(super) cfg: ModelConfig,
    pub(super) compute: Compute,
    /// The dtype the blocks' weights are built in (the model's storage dtype,
    /// [`Compute::storage_dtype`]).
    pub(super) dtype: DType,
    pub(super) device: Device,
}

impl Sharded {
    /// What a forward other than a checkpointed training one gets.
    pub const REFUSED: &'static str = "a model with sharded blocks (ZeRO-3) runs training \
        forwards only: Mode::Train, no KV cache, with checkpointing set (set_checkpointing)";

    /// Blocks of `cfg` from `blocks`, built in `dtype` (the storage dtype) on `device` to run
    /// `compute`'s code.
    pub fn new(
        cfg: &ModelConfig,
        blocks: Arc<dyn BlockParams>,
        compute: Compute,
        dtype: DType,
        device: &Device,
    ) -> Self {
        Self {
            blocks,
            cfg: cfg.clone(),
            compute,
            dtype,
            device: device.clone(),
        }
    }

    pub fn num_layers(&self) -> usize {
        self.cfg.num_layers
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Mutex;

    use candle_core::{Result, Tensor, Var, D};
    use candle_nn::VarBuilder;

    use super::*;
    use crate::kernels::grad_sink::GradSink;
    use crate::models::checkpointing::block_of;
    use crate::models::checkpointing::CheckpointGrads;
    use crate::models::config::{Arch, DecoderExtras};
    use crate::models::Mode;
    use crate::models::{CausalLm, SeqBatch};

    /// Serves blocks from a full map of parameters and keeps the gradients handed back.
    #[derive(Debug)]
    struct Served {
        tensors: HashMap<String, Tensor>,
        grads: Mutex<HashMap<String, Tensor>>,
        /// Every call, in order: (gather?, block).
        calls: Mutex<Vec<(bool, usize)>>,
    }

    impl Served {
        fn new(tensors: HashMap<String, Tensor>) -> Self {
            Self {
                tensors,
                grads: Mutex::new(HashMap::new()),
                calls: Mutex::new(vec![]),
            }
        }
    }

    impl BlockParams for Served {
        fn gather(&self, i: usize) -> Result<HashMap<String, Tensor>> {
            self.calls.lock().unwrap().push((true, i));
            Ok(self
                .tensors
                .iter()
                .filter(|(n, _)| block_of(n) == Some(i))
                .map(|(n, t)| (n.clone(), t.detach()))
                .collect())
        }

        fn gradients(&self, i: usize, grads: HashMap<String, Tensor>) -> Result<()> {
            self.calls.lock().unwrap().push((false, i));
            let mine = self.gather(i)?;
            self.calls.lock().unwrap().pop();
            assert_eq!(
                grads.len(),
                mine.len(),
                "block {i}: one gradient per parameter"
            );
            let mut store = self.grads.lock().unwrap();
            for (n, g) in grads {
                assert_eq!(g.dtype(), DType::F32, "{n}");
                assert_eq!(g.dims(), mine[&n].dims(), "{n}");
                let sum = match store.remove(&n) {
                    Some(acc) => (acc + g)?,
                    None => g,
                };
                store.insert(n, sum);
            }
            Ok(())
        }
    }

    /// Three layers, a window on layers 0 and 2 with their own RoPE base, q/k norms, q/k/v
    /// biases and an untied head: every per-layer choice the loop makes.
    fn tiny() -> ModelConfig {
        ModelConfig {
            arch: Arch::Qwen3,
            vocab_size: 11,
            hidden_size: 16,
            intermediate_size: 24,
            num_layers: 3,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 4,
            norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: None,
            rope_freq_factors: None,
            max_position_embeddings: 32,
            tie_word_embeddings: false,
            attention_bias: true,
            mlp_bias: false,
            qk_norm: true,
            bos_token_id: None,
            eos_token_ids: vec![],
            build_quantized: None,
            extras: DecoderExtras {
                sliding_window: Some(3),
                sliding_layers: vec![true, false, true],
                rope_local_theta: Some(1000.0),
                ..Default::default()
            },
        }
    }

    /// Random f32 parameters of `cfg` by checkpoint name.
    fn params(cfg: &ModelConfig, dev: &Device) -> HashMap<String, Tensor> {
        let (h, i, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
        let (q, kv, hd) = (
            cfg.num_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
            cfg.head_dim,
        );
        let mut shapes: Vec<(String, Vec<usize>)> = vec![
            ("model.embed_tokens.weight".into(), vec![v, h]),
            ("model.norm.weight".into(), vec![h]),
            ("lm_head.weight".into(), vec![v, h]),
        ];
        for l in 0..cfg.num_layers {
            let p = |n: &str| format!("model.layers.{l}.{n}");
            shapes.extend([
                (p("input_layernorm.weight"), vec![h]),
                (p("post_attention_layernorm.weight"), vec![h]),
                (p("self_attn.q_proj.weight"), vec![q, h]),
                (p("self_attn.q_proj.bias"), vec![q]),
                (p("self_attn.k_proj.weight"), vec![kv, h]),
                (p("self_attn.k_proj.bias"), vec![kv]),
                (p("self_attn.v_proj.weight"), vec![kv, h]),
                (p("self_attn.v_proj.bias"), vec![kv]),
                (p("self_attn.o_proj.weight"), vec![h, q]),
                (p("self_attn.q_norm.weight"), vec![hd]),
                (p("self_attn.k_norm.weight"), vec![hd]),
                (p("mlp.gate_proj.weight"), vec![i, h]),
                (p("mlp.up_proj.weight"), vec![i, h]),
                (p("mlp.down_proj.weight"), vec![h, i]),
            ]);
        }
        shapes
            .into_iter()
            .enumerate()
            .map(|(k, (n, s))| {
                let (mean, spread) = match n.ends_with("norm.weight") {
                    true => (1.0, 0.2),
                    false => (0.0, 0.5),
                };
                (n, uniform(&s, k as u64, mean, spread, dev))
            })
            .collect()
    }

    /// Reproducible values `mean + spread * u`, u uniform in [-1, 1), of `shape`.
    fn uniform(shape: &[usize], seed: u64, mean: f32, spread: f32, dev: &Device) -> Tensor {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                mean + spread * ((x >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
            })
            .collect();
        Tensor::from_vec(v, shape, dev).unwrap()
    }

    fn vars_of(tensors: &HashMap<String, Tensor>) -> HashMap<String, Var> {
        tensors
            .iter()
            .map(|(n, t)| (n.clone(), Var::from_tensor(&t.copy().unwrap()).unwrap()))
            .collect()
    }

    fn tensors_of(vars: &HashMap<String, Var>) -> HashMap<String, Tensor> {
        vars.iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
            .collect()
    }

    /// The sink a trainer attaches under `compute` (as `for_update` does), attached.
    fn attach_sink(
        model: &mut CausalLm,
        vars: &HashMap<String, Var>,
        compute: Compute,
    ) -> GradSink {
        let all: Vec<Var> = vars.values().cloned().collect();
        if !compute.is_fused() {
            return GradSink::default();
        }
        let sink = GradSink::new(&all).with_bf16_matmuls(compute.bf16_matmuls());
        model.attach_grad_sink(&sink).unwrap();
        sink
    }

    /// A training forward: hidden states [B, T, H] (f32) and a loss through the LM head.
    fn forward(model: &CausalLm, batch: &SeqBatch, r: &Tensor) -> (Tensor, Tensor) {
        let h = model.forward_hidden(batch, Mode::Train).unwrap(); // [B, T, H]
        let (b, t, hd) = h.dims3().unwrap();
        let logits = model.head_logits(&h.reshape((b * t, hd)).unwrap()).unwrap(); // [N, V]
        let lp = candle_nn::ops::log_softmax(&logits.to_dtype(DType::F32).unwrap(), D::Minus1);
        let loss = (lp.unwrap() * r).unwrap().sum_all().unwrap();
        (h.to_dtype(DType::F32).unwrap(), loss)
    }

    /// A Var's whole gradient: candle's, the checkpoint store's and the sink's.
    fn grad_of(
        v: &Var,
        g: &candle_core::backprop::GradStore,
        ckpt: &CheckpointGrads,
        sink: &GradSink,
    ) -> Tensor {
        let parts: Vec<Tensor> = [
            g.get(v.as_tensor()).cloned(),
            ckpt.take(v).unwrap(),
            sink.take(v).unwrap(),
        ]
        .into_iter()
        .flatten()
        .collect();
        assert!(!parts.is_empty(), "no gradient");
        parts
            .into_iter()
            .map(|t| t.to_dtype(DType::F32).unwrap())
            .reduce(|a, b| (a + b).unwrap())
            .unwrap()
    }

    /// `max |a - b| <= rel * max |b|`.
    fn assert_close(a: &Tensor, b: &Tensor, rel: f32, what: &str) {
        let diff = (a - b).unwrap().abs().unwrap().max_all().unwrap();
        let scale = b
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        let diff = diff.to_scalar::<f32>().unwrap();
        assert!(
            diff <= rel * scale.max(1e-6),
            "{what}: |diff| {diff} vs max {scale}"
        );
    }

    /// The sharded model against the ordinary checkpointed one under `compute` and `dtype`.
    fn sharded_matches_checkpointed(compute: Compute, dtype: DType, rel: f32) {
        let dev = Device::Cpu;
        let cfg = tiny();
        let full = params(&cfg, &dev);
        let batch =
            SeqBatch::left_padded(&[vec![1, 2, 3, 4, 5, 6], vec![7, 8, 9]], 0, &dev).unwrap();
        let r = uniform(&[12, cfg.vocab_size], 999, 0.0, 1.0, &dev); // [N, V]

        let vars = vars_of(&full);
        let vb = VarBuilder::from_tensors(tensors_of(&vars), dtype, &dev);
        let mut reference = CausalLm::load_with(&cfg, vb, compute).unwrap();
        let sink = attach_sink(&mut reference, &vars, compute);
        let all: Vec<Var> = vars.values().cloned().collect();
        let ckpt = CheckpointGrads::new(&all, &dev).unwrap();
        reference.set_checkpointing(Some(ckpt.clone()));

        let served = Arc::new(Served::new(full.clone()));
        let outer: HashMap<String, Tensor> = full
            .iter()
            .filter(|(n, _)| block_of(n).is_none())
            .map(|(n, t)| (n.clone(), t.clone()))
            .collect();
        let outer_vars = vars_of(&outer);
        let blocks: Arc<dyn BlockParams> = served.clone();
        let mut model =
            CausalLm::sharded_with(&cfg, tensors_of(&outer_vars), blocks, dtype, &dev, compute)
                .unwrap();
        let outer_sink = attach_sink(&mut model, &outer_vars, compute);
        let outer_all: Vec<Var> = outer_vars.values().cloned().collect();
        let outer_ckpt = CheckpointGrads::new(&outer_all, &dev).unwrap();
        model.set_checkpointing(Some(outer_ckpt.clone()));

        let (h_ref, loss_ref) = forward(&reference, &batch, &r);
        let (h, loss) = forward(&model, &batch, &r);
        assert_close(&h, &h_ref, rel, "hidden states");
        let g_ref = loss_ref.backward().unwrap();
        let g = loss.backward().unwrap();
        // Each block gathered once forward, once backward (last first), its gradients handed back.
        let calls = served.calls.lock().unwrap().clone();
        let want: Vec<(bool, usize)> = [
            (true, 0),
            (true, 1),
            (true, 2),
            (true, 2),
            (false, 2),
            (true, 1),
            (false, 1),
            (true, 0),
            (false, 0),
        ]
        .into();
        assert_eq!(calls, want);
        let handed = served.grads.lock().unwrap();
        for (n, v) in &vars {
            let want = grad_of(v, &g_ref, &ckpt, &sink);
            let got = match block_of(n) {
                Some(_) => handed[n].clone(),
                None => grad_of(&outer_vars[n], &g, &outer_ckpt, &outer_sink),
            };
            assert_close(&got, &want, rel, n);
        }
    }

    /// Every parameter's gradient of the training loss of [`forward`] for `cfg` under
    /// `compute` (f32), with or without gradient checkpointing.
    fn gradients(cfg: &ModelConfig, compute: Compute, checkpoint: bool) -> Vec<(String, Tensor)> {
        let dev = Device::Cpu;
        let vars = vars_of(&params(cfg, &dev));
        let vb = VarBuilder::from_tensors(tensors_of(&vars), DType::F32, &dev);
        let mut model = CausalLm::load_with(cfg, vb, compute).unwrap();
        let sink = attach_sink(&mut model, &vars, compute);
        let all: Vec<Var> = vars.values().cloned().collect();
        let ckpt = CheckpointGrads::new(&all, &dev).unwrap();
        if checkpoint {
            model.set_checkpointing(Some(ckpt.clone()));
        }
        // No padding: the paths differ in what a padded position's hidden state holds.
        let batch =
            SeqBatch::left_padded(&[vec![1, 2, 3, 4, 5, 6], vec![7, 8, 9, 10, 1, 2]], 0, &dev)
                .unwrap();
        let r = uniform(&[12, cfg.vocab_size], 999, 0.0, 1.0, &dev); // [N, V]
        let g = forward(&model, &batch, &r).1.backward().unwrap();
        let mut out: Vec<(String, Tensor)> = vars
            .iter()
            .map(|(n, v)| (n.clone(), grad_of(v, &g, &ckpt, &sink)))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// A model with one KV head (its keys and values `[B, 1, S, D]` views of `[B, S, 1, D]`)
    /// gets the portable path's gradients on the fused CPU kernels, with and without
    /// checkpointing. The fused kernels once refused that layout ("unexpected layout").
    #[test]
    fn one_kv_head_trains_on_the_fused_kernels() {
        let mut cfg = tiny();
        cfg.num_kv_heads = 1;
        // Named, not resolved: the portable kernels' rerun of the model tests sets
        // GRPO_KERNELS=portable, and this test is about the fused ones.
        let fused = Compute::CpuFused;
        for checkpoint in [false, true] {
            let want = gradients(&cfg, Compute::Portable, checkpoint);
            let got = gradients(&cfg, fused, checkpoint);
            assert_eq!(got.len(), want.len());
            for ((n, a), (_, b)) in got.iter().zip(&want) {
                assert_close(a, b, 1e-5, n);
            }
        }
    }

    #[test]
    fn sharded_blocks_match_checkpointing_f32() {
        let dev = Device::Cpu;
        sharded_matches_checkpointed(Compute::resolve(&dev, DType::F32), DType::F32, 1e-5);
        sharded_matches_checkpointed(Compute::Portable, DType::F32, 1e-5);
    }

    #[test]
    fn sharded_blocks_match_checkpointing_bf16() {
        let dev = Device::Cpu;
        sharded_matches_checkpointed(Compute::resolve(&dev, DType::BF16), DType::BF16, 1e-3);
        sharded_matches_checkpointed(Compute::Portable, DType::BF16, 1e-3);
    }

    #[test]
    fn sharded_blocks_refuse_what_they_cannot_run() {
        let dev = Device::Cpu;
        let cfg = tiny();
        let full = params(&cfg, &dev);
        let outer: HashMap<String, Tensor> = full
            .iter()
            .filter(|(n, _)| block_of(n).is_none())
            .map(|(n, t)| (n.clone(), t.clone()))
            .collect();
        let served: Arc<dyn BlockParams> = Arc::new(Served::new(full.clone()));
        let mut model =
            CausalLm::with_sharded_blocks(&cfg, outer.clone(), served.clone(), DType::F32, &dev)
                .unwrap();
        let batch = SeqBatch::left_padded(&[vec![1, 2, 3]], 0, &dev).unwrap();
        let refused =
            |e: crate::Error| assert!(e.to_string().contains("training forwards only"), "{e}");
        refused(model.forward_hidden(&batch, Mode::Train).unwrap_err()); // no checkpointing
        model.set_checkpointing(Some(CheckpointGrads::new(&[], &dev).unwrap()));
        refused(model.forward_hidden(&batch, Mode::Infer).unwrap_err());
        let mut cache = model.new_cache(1, 8).unwrap();
        let ids = Tensor::new(&[[1u32]], &dev).unwrap();
        let mask =
            crate::models::AttnMask::dense(Tensor::zeros((1, 1, 1, 1), DType::F32, &dev).unwrap())
                .unwrap();
        refused(
            model
                .forward_cached(&ids, &ids, &mask, &mut cache)
                .unwrap_err(),
        );
        assert!(model.forward_hidden(&batch, Mode::Train).is_ok());

        let gpt2 = ModelConfig {
            arch: Arch::Gpt2,
            ..cfg.clone()
        };
        let e =
            CausalLm::with_sharded_blocks(&gpt2, outer.clone(), served.clone(), DType::F32, &dev)
                .unwrap_err();
        assert!(e.to_string().contains("GPT-2 is not supported"), "{e}");
        let e = CausalLm::with_sharded_blocks(&cfg, full, served, DType::F32, &dev).unwrap_err();
        assert!(e.to_string().contains("is a block parameter"), "{e}");
    }

    /// A gathered tensor the block does not use gets no gradient: the backward says which.
    #[test]
    fn a_parameter_without_a_gradient_is_named() {
        let dev = Device::Cpu;
        let cfg = tiny();
        let mut full = params(&cfg, &dev);
        let extra = "model.layers.1.mlp.extra.weight";
        full.insert(extra.into(), uniform(&[3], 7, 0.0, 1.0, &dev));
        let outer: HashMap<String, Tensor> = full
            .iter()
            .filter(|(n, _)| block_of(n).is_none())
            .map(|(n, t)| (n.clone(), t.clone()))
            .collect();
        let outer_vars = vars_of(&outer);
        let served: Arc<dyn BlockParams> = Arc::new(Served::new(full));
        let mut model =
            CausalLm::with_sharded_blocks(&cfg, tensors_of(&outer_vars), served, DType::F32, &dev)
                .unwrap();
        model.set_checkpointing(Some(CheckpointGrads::new(&[], &dev).unwrap()));
        let batch = SeqBatch::left_padded(&[vec![1, 2, 3]], 0, &dev).unwrap();
        let h = model.forward_hidden(&batch, Mode::Train).unwrap(); // [1, 3, H]
        let e = h.sum_all().unwrap().backward().unwrap_err().to_string();
        assert!(e.contains(extra) && e.contains("no gradient"), "{e}");
    }
}
