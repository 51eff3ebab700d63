use super::*;
use grpo_models::models::ModelConfig;

/// A Llama of vocabulary 1000, hidden 64, MLP 128, 2 layers, 4 heads of 16, 2 kv heads, tied.
fn shapes() -> ModelShapes {
    let json = r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "tie_word_embeddings": true}"#;
    let cfg = ModelConfig::from_hf_json(json, std::path::Path::new("config.json")).unwrap();
    ModelShapes::from_architecture(cfg)
}

fn batch() -> BatchShape {
    BatchShape {
        prompt_tokens: 20,
        completion_tokens: 10,
        generations: 4,
        micro_batch: 8,
        round_sequences: 16,
        sampling_batch: 0,
        forward_chunk_tokens: Some(1024),
    }
}

fn input(compute: Compute) -> PlanInput {
    PlanInput {
        model: shapes(),
        compute,
        dtype_bytes: 4,
        lora: None,
        reference: false,
        sync_ref_model: false,
        needs_old: false,
        gradient_checkpointing: false,
        world_size: 1,
        zero_stage: 0,
        batch: batch(),
        memory: None,
    }
}

fn bytes(p: &Plan, name: &str) -> u64 {
    p.terms
        .iter()
        .filter(|t| t.name == name)
        .map(|t| t.bytes)
        .sum()
}

#[test]
fn the_architecture_counts_what_approx_params_counts_plus_the_norms() {
    let s = shapes();
    // Blocks: q 64x64, k and v 32x64, o 64x64, gate/up/down 128x64; embedding 1000x64.
    let block = 64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 128 * 64;
    assert_eq!(s.config.approx_params(), 2 * block + 64_000);
    assert_eq!(s.params(), s.config.approx_params() + 2 * 2 * 64 + 64);
    assert_eq!(s.projections().len(), 14);
    // q, k, v, gate, up of both layers.
    assert_eq!(s.joined_elems(), 2 * (64 * 64 + 2 * 32 * 64 + 2 * 128 * 64));
    // r = 8 on q and v: A [8, 64] + B [out, 8].
    let qv = |m: &str| m.ends_with("q_proj") || m.ends_with("v_proj");
    assert_eq!(s.lora_elems(8, &qv), 2 * (8 * (64 + 64) + 8 * (64 + 32)));
    // A merge into q or v copies the whole joined q/k/v of each layer.
    assert_eq!(s.merged_elems(&qv), 2 * (64 * 64 + 2 * 32 * 64));
}

#[test]
fn a_pass_takes_whole_groups_and_splits_a_group_longer_than_the_budget() {
    // Groups of 20 + 4 x 10 = 60 tokens; 2 per micro-batch. In padded rows too: a row per
    // completion scores no fewer keys (4 x 30^2 = 60^2), so the group keeps its row.
    for one_row in [true, false] {
        let p = pass_shape(&batch(), 1024, one_row);
        assert_eq!((p.tokens, p.completion_tokens, p.passes), (120, 80, 1));
        let p = pass_shape(&batch(), 100, one_row);
        assert_eq!((p.tokens, p.completion_tokens, p.passes), (60, 40, 2));
        // 45 tokens: the prompt and 2 completions per part, 2 parts per group.
        let p = pass_shape(&batch(), 45, one_row);
        assert_eq!((p.tokens, p.completion_tokens, p.passes), (40, 20, 4));
        // Never less than one completion.
        let p = pass_shape(&batch(), 5, one_row);
        assert_eq!((p.tokens, p.completion_tokens, p.passes), (30, 10, 8));
    }
}

/// Completions of 100 behind prompts of 20: in padded rows a row each (4 x 120^2 keys against
/// 420^2), so a group holds 4 x 120 = 480 tokens, not 420, and a part of a group repeats the
/// prompt in each row, as `forward_chunks` counts them.
#[test]
fn a_pass_in_padded_rows_counts_a_prompt_per_row() {
    let b = BatchShape {
        completion_tokens: 100,
        ..batch()
    };
    let p = pass_shape(&b, 1024, true);
    assert_eq!((p.tokens, p.completion_tokens, p.passes), (840, 800, 1));
    let p = pass_shape(&b, 1024, false);
    assert_eq!((p.tokens, p.completion_tokens, p.passes), (960, 800, 1));
    let p = pass_shape(&b, 500, false);
    assert_eq!((p.tokens, p.completion_tokens, p.passes), (480, 400, 2));
    let p = pass_shape(&b, 300, false);
    assert_eq!((p.tokens, p.completion_tokens, p.passes), (240, 200, 4));
}

/// Full fine-tuning on the fused CPU path, by hand: the f32 masters, two moments, and an update
/// of gradients, activations and the kept logits of 80 completion tokens (one 80-row chunk
/// of gradient).
#[test]
fn the_fused_cpu_plan_adds_up_by_hand() {
    let i = input(Compute::CpuFused);
    let p = plan(&i).unwrap();
    let n = i.model.params();
    assert_eq!(bytes(&p, "policy weights"), 4 * n);
    assert_eq!(bytes(&p, "AdamW moments"), 8 * n);
    assert_eq!(bytes(&p, "reference"), 0);
    assert_eq!(bytes(&p, "gradients"), 4 * n);
    let per_token = 2 * (16 * 64 + 6 * 128) * 4;
    assert_eq!(bytes(&p, "activations"), 120 * per_token);
    assert_eq!(bytes(&p, "LM-head logits"), (80 + 80) * 1000 * 4);
    // KV: 4 prompts x 20 + 16 x 30 slots, 2 layers x 2 x 2 heads x 16 x 4 B each.
    assert_eq!(
        bytes(&p, "KV cache"),
        (4 * 20 + 16 * 30) * 2 * 2 * 2 * 16 * 4
    );
    assert_eq!(p.peak_phase, Phase::Update);
    let update = 4 * n + 120 * per_token + 160 * 4000;
    assert_eq!(p.peak_bytes, CPU_PROCESS_BYTES + 12 * n + update);
}

#[test]
fn a_reference_and_lora_change_what_is_held() {
    let mut i = input(Compute::CpuFused);
    i.reference = true;
    let n = i.model.params();
    assert_eq!(bytes(&plan(&i).unwrap(), "reference"), 4 * n);
    // Under CPU mixed precision the reference keeps f32 weights and bf16 panels.
    i.compute = Compute::CpuMixed;
    i.dtype_bytes = 2;
    let proj: u64 = i.model.projections().iter().map(|(_, e)| e).sum();
    assert_eq!(
        bytes(&plan(&i).unwrap(), "reference"),
        4 * n + 2 * (proj + 64_000)
    );
    // LoRA: the reference is the frozen base; moments and gradients are the adapters'.
    i.compute = Compute::CpuFused;
    i.dtype_bytes = 4;
    i.lora = Some(LoraPlan {
        trainable: 1000,
        merged_elems: 5000,
        quantized_bits: None,
        activation_elems: 0,
    });
    let p = plan(&i).unwrap();
    assert_eq!(bytes(&p, "reference"), 0);
    assert_eq!(bytes(&p, "frozen base"), 4 * n);
    assert_eq!(bytes(&p, "AdamW moments"), 8000);
    assert_eq!(bytes(&p, "gradients"), 4000);
    assert_eq!(p.trainable, 1000);
}

#[test]
fn qloras_sampler_copies_no_projection() {
    // What `Policy::freeze` holds for sampling with adapters (`CausalLm::merge_lora`): LoRA's
    // merged projections, QLoRA's quantized base as it is (tests/lora.rs
    // `merging_matches_peft_merge_and_unload`: merging into a quantized base attaches).
    let lora = |bits| LoraPlan {
        trainable: 1000,
        merged_elems: 5000,
        quantized_bits: bits,
        activation_elems: 0,
    };
    let copy = |compute, bits, ckpt| {
        let mut i = input(compute);
        i.lora = Some(lora(bits));
        i.gradient_checkpointing = ckpt;
        i.dtype_bytes = if compute == Compute::Gpu { 2 } else { 4 };
        bytes(&plan(&i).unwrap(), "sampler copy")
    };
    let m = shapes();
    let proj: u64 = m.projections().iter().map(|(_, e)| e).sum();
    assert_eq!(copy(Compute::Gpu, None, false), 5000 * 2);
    assert_eq!(copy(Compute::Gpu, Some(4.5), false), 0);
    assert_eq!(copy(Compute::Portable, Some(4.5), true), 0);
    // The fused CPU path packs for decoding: the quantized projections as quantized panels, the
    // head as f32 panels; with gradient checkpointing it packs nothing.
    assert_eq!(
        copy(Compute::CpuFused, Some(4.5), false),
        (proj as f64 * 4.5 / 8.0) as u64 + m.head_elems() * 4
    );
    assert_eq!(
        copy(Compute::CpuFused, None, false),
        (proj + m.head_elems()) * 4
    );
    assert_eq!(copy(Compute::CpuFused, Some(4.5), true), 0);
}

#[test]
fn zero_stages_shard_moments_then_gradients_then_weights() {
    let mut i = input(Compute::Gpu);
    i.dtype_bytes = 2;
    i.world_size = 8;
    let n = i.model.params();
    let at = |i: &PlanInput, s: u8, name: &str| {
        let mut i = i.clone();
        i.zero_stage = s;
        bytes(&plan(&i).unwrap(), name)
    };
    assert_eq!(at(&i, 0, "AdamW moments"), 8 * n);
    assert_eq!(at(&i, 1, "AdamW moments"), (8 * n).div_ceil(8));
    assert_eq!(at(&i, 1, "gradients"), 4 * n);
    // Stage 2: whole until candle's backward has made them all, and one window of them sent
    // at a time (here the model is smaller than a window: all of it).
    assert_eq!(at(&i, 2, "gradients"), 4 * n);
    assert_eq!(at(&i, 2, "reduce buffer"), 4 * n);
    assert_eq!(at(&i, 2, "policy weights"), 4 * n);
    assert_eq!(at(&i, 3, "policy weights"), (4 * n).div_ceil(8));
    // Stage 3: this rank's range, and what lies outside the blocks whole (on a GPU candle's
    // gradients alone; the fused CPU path's sink keeps a second copy).
    let outer = n - i.model.block_elems();
    assert!(outer > 0 && outer < n);
    assert_eq!(at(&i, 3, "gradients"), (4 * n).div_ceil(8) + 4 * outer);
    assert_eq!(at(&i, 1, "reduce buffer"), 0);
    // Open MPI's part is host memory: a CPU rank's, not a GPU's.
    assert_eq!(at(&i, 0, "MPI"), 0);
    let mut cpu = input(Compute::CpuFused);
    cpu.world_size = 2;
    assert_eq!(at(&cpu, 0, "MPI"), super::MPI_RANK_BYTES);
    // One rank: nothing to shard.
    i.world_size = 1;
    assert_eq!(at(&i, 3, "AdamW moments"), 8 * n);
}

#[test]
fn the_gpu_default_pass_is_sized_by_the_memory_left() {
    let mut i = input(Compute::Gpu);
    i.dtype_bytes = 2;
    i.batch.forward_chunk_tokens = None;
    i.batch.micro_batch = 4096;
    i.batch.generations = 4096;
    i.memory = Some(80 << 30);
    let p = plan(&i).unwrap();
    // The cap of twice the f32 state (16 B a parameter) binds for a small model.
    let params = i.model.config.approx_params();
    let per_token = crate::logprobs::activation_bytes_per_token((64, 128, 2), 2, false);
    let want = ((32 * params) / per_token) as usize;
    assert_eq!(
        p.pass.budget,
        want.max(crate::logprobs::DEFAULT_FORWARD_CHUNK_TOKENS)
    );
}

#[test]
fn bad_inputs_are_errors_naming_the_key() {
    let mut i = input(Compute::CpuFused);
    i.zero_stage = 4;
    assert!(plan(&i).unwrap_err().to_string().contains("zero_stage"));
    i.zero_stage = 0;
    i.world_size = 0;
    assert!(plan(&i).unwrap_err().to_string().contains("world_size"));
    assert!(card_memory("h300")
        .unwrap_err()
        .to_string()
        .contains("h100-80gb"));
    assert!(parse_bytes("80 parsecs")
        .unwrap_err()
        .to_string()
        .contains("80GiB"));
    assert!(parse_bytes("-1GB").is_err());
}

#[test]
fn sizes_parse_and_verdicts_read() {
    assert_eq!(parse_bytes("80GiB").unwrap(), 80 << 30);
    assert_eq!(parse_bytes("24GB").unwrap(), 24_000_000_000);
    assert_eq!(parse_bytes("1.5 MiB").unwrap(), 3 << 19);
    assert_eq!(parse_bytes("4096").unwrap(), 4096);
    assert_eq!(card_memory("H100-80GB").unwrap(), 80 << 30);
    assert!(verdict(50, 100).starts_with("fits"));
    assert!(verdict(95, 100).starts_with("tight"));
    assert!(verdict(150, 100).starts_with("does not fit"));
}

#[test]
fn a_safetensors_header_gives_the_shapes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    let t = candle_core::Tensor::zeros((3, 5), candle_core::DType::F32, &candle_core::Device::Cpu)
        .unwrap();
    candle_core::safetensors::save(
        &std::collections::HashMap::from([("w".to_string(), t)]),
        &path,
    )
    .unwrap();
    assert_eq!(
        safetensors_shapes(&path).unwrap(),
        vec![("w".to_string(), vec![3, 5])]
    );
    std::fs::write(&path, b"\x05\x00\x00\x00\x00\x00\x00\x00{bad}").unwrap();
    let e = safetensors_shapes(&path).unwrap_err().to_string();
    assert!(e.contains("model.safetensors"), "{e}");
}
