//! Log-probs, entropies, packing and chunking against plain twins and the graph path.
use super::*;
use candle_core::{Device, Var};

/// Plain-f32 twin: log softmax(logits / T)[target] for one row.
fn logprob_slow(logits: &[f32], target: usize, t: f32) -> f32 {
    let z: Vec<f32> = logits.iter().map(|x| x / t).collect();
    let m = z.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let lse = z.iter().map(|x| (x - m).exp()).sum::<f32>().ln() + m;
    z[target] - lse
}

/// The budget: half the free memory, capped at twice the f32 training state.
#[test]
fn the_activation_budget_is_capped_by_the_model_state() {
    let gb = 1u64 << 30;
    assert_eq!(activation_budget(136 * gb, 135_000_000), 32 * 135_000_000);
    assert_eq!(activation_budget(8 * gb, 1_700_000_000), 4 * gb);
}

/// The GPU's layout: the kit's 16 x 8 x 256 batch behind ~52-token prompts scores 5.8x fewer
/// keys with a row per completion; a long prompt with short completions keeps its group's row.
#[test]
fn a_row_per_completion_only_where_it_scores_fewer_keys() {
    assert!(per_row_scores_fewer(16, 52 + 8 * 256, 128, 52 + 256));
    assert!(!per_row_scores_fewer(16, 1000 + 8 * 100, 128, 1000 + 100));
    // One completion per prompt: the same rows either way, no change.
    assert!(!per_row_scores_fewer(8, 300, 8, 300));
}

/// Off the fused CPU path packs share right-padded rows as long as the longest, first fit by
/// decreasing length: uneven packs fill rows instead of each padding to the longest, packs of
/// one length keep a row each in order, and the fused path keeps one row.
#[test]
fn uneven_packs_share_rows_as_long_as_the_longest() {
    assert_eq!(
        pack_rows(&[100, 20, 30, 50, 100, 60], false),
        [0, 3, 2, 3, 1, 2]
    );
    assert_eq!(pack_rows(&[7, 7, 7], false), [0, 1, 2]);
    assert_eq!(pack_rows(&[7, 3, 9], true), [0, 0, 0]);
    // No row is longer than the longest pack, and the rows' padding is what first fit leaves.
    let lens = [
        512, 31, 77, 400, 12, 256, 199, 480, 5, 64, 300, 111, 90, 45, 333, 128,
    ];
    let rows = pack_rows(&lens, false);
    let n_rows = rows.iter().max().unwrap() + 1;
    let mut used = vec![0; n_rows];
    for (&r, &l) in rows.iter().zip(&lens) {
        used[r] += l;
    }
    assert!(used.iter().all(|&u| u <= 512), "{used:?}");
    assert_eq!(n_rows, 6, "{used:?}"); // 3,043 tokens in 6 rows of 512 instead of 16
}

/// Issue 59's long, uneven shapes laid out for a GPU: 16 prompts of 63 tokens x 8 completions
/// whose lengths spread as the bench's random model ends them (exponential at 2.77 / cap, cut at
/// the cap), in passes of the 1.7B H200 budget (13,926 tokens). A padded row per pack computed
/// 3.1x the shared rows' tokens at cap 1024 (173k against 56k) and 1.6x at cap 4096 (361k
/// against 227k); the shared rows are 9% and 17% padding (51k and 188k real tokens).
#[test]
fn uneven_long_completions_share_rows_instead_of_padding() {
    use rand::{Rng, SeedableRng};
    for (cap, at_least) in [(1024usize, 2.5), (4096, 1.5)] {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(cap as u64);
        let prompts: Vec<Vec<u32>> = (0..16).map(|p| vec![p as u32 + 1; 63]).collect();
        let comps: Vec<Vec<u32>> = (0..128)
            .map(|_| {
                let u: f64 = rng.random::<f64>().max(1e-12);
                let len = (-u.ln() * cap as f64 / 2.77) as usize;
                vec![7; len.clamp(1, cap)]
            })
            .collect();
        let pr: Vec<&[u32]> = (0..128).map(|i| prompts[i / 8].as_slice()).collect();
        let cr: Vec<&[u32]> = comps.iter().map(|c| c.as_slice()).collect();
        let (mut padded_each, mut padded_shared, mut real) = (0, 0, 0);
        for r in forward_chunks(&pr, &cr, 13_926, false) {
            let (p, c) = (&pr[r.clone()], &cr[r]);
            let units = packs(p, c, Packing::SharedPrompt, false);
            let lens: Vec<usize> = units.iter().map(|u| pack_len(p, c, u)).collect();
            padded_each += lens.len() * lens.iter().max().unwrap();
            let rows = PackedRows::new(p, c, &units, false).unwrap();
            padded_shared += rows.ids.len() * rows.t;
            real += lens.iter().sum::<usize>();
        }
        let gain = padded_each as f64 / padded_shared as f64;
        assert!(
            gain >= at_least,
            "cap {cap}: {padded_each} vs {padded_shared}"
        );
        assert!(
            padded_shared * 4 <= real * 5,
            "cap {cap}: {padded_shared} for {real}"
        );
    }
}

/// The device-sized pass: SmolLM2-135M's shape in bf16 with checkpointing keeps ~87 KB per
/// token (30 x 576 + 24 x 576 + 8 x 1536 floats), so 8 GB holds ~99k tokens; without it
/// ~1.1 MB, ~7.6k tokens; a tiny budget still gets the CPU default and a huge one the cap.
#[test]
fn device_sized_passes_follow_the_model_and_the_budget() {
    let cfg = (576, 1536, 30); // hidden, intermediate, layers
    let gb = 1u64 << 30;
    let per_ckpt = (30 * 576 + 24 * 576 + 8 * 1536) * 2;
    assert_eq!(
        tokens_for_memory(cfg, 2, true, 8 * gb),
        (8 * gb) as usize / per_ckpt
    );
    let per_full = 30 * (16 * 576 + 6 * 1536) * 2;
    assert_eq!(
        tokens_for_memory(cfg, 2, false, 8 * gb),
        (8 * gb) as usize / per_full
    );
    assert_eq!(
        tokens_for_memory(cfg, 4, false, 1 << 20),
        DEFAULT_FORWARD_CHUNK_TOKENS
    );
    assert_eq!(tokens_for_memory(cfg, 2, true, 1 << 50), 1 << 20);
}

/// The unset pass size by compute: f32 on the fused CPU path keeps its cache-sized passes
/// whatever memory is free; CPU mixed precision takes the smaller passes; off the fused path
/// the free memory sizes them, and the CPU default stands in when it is unknown.
#[test]
fn unset_passes_follow_the_compute() {
    use grpo_models::kernels::Compute;
    let (cfg, params, gb) = ((576, 1536, 30), 135_000_000, 1u64 << 30);
    let chunk = |c, free| default_chunk_tokens(c, free, cfg, 4, false, params, 0);
    assert_eq!(
        chunk(Compute::CpuFused, Some(64 * gb)),
        DEFAULT_FORWARD_CHUNK_TOKENS
    );
    assert_eq!(
        chunk(Compute::CpuMixed, Some(64 * gb)),
        MIXED_FORWARD_CHUNK_TOKENS
    );
    const { assert!(MIXED_FORWARD_CHUNK_TOKENS < DEFAULT_FORWARD_CHUNK_TOKENS) };
    let budget = activation_budget(64 * gb, params);
    for c in [Compute::Gpu, Compute::Portable] {
        assert_eq!(
            chunk(c, Some(64 * gb)),
            tokens_for_memory(cfg, 4, false, budget)
        );
        assert_eq!(chunk(c, None), DEFAULT_FORWARD_CHUNK_TOKENS);
    }
}

/// LoRA's adapters shrink the unset pass on a GPU by what they keep per token (the same bytes
/// `grpo plan` counts), all of it without checkpointing and one layer's share with it.
#[test]
fn lora_activations_shrink_the_unset_pass() {
    use grpo_models::kernels::Compute;
    let (cfg, params, gb) = ((4096, 14336, 32), 7_400_000_000u64, 1u64 << 30);
    let (free, elems) = (120 * gb, 5_000_000u64);
    for ckpt in [false, true] {
        let lora = lora_activation_bytes(elems, 32, ckpt);
        assert_eq!(lora, if ckpt { 4 * elems / 32 } else { 4 * elems });
        let per_token = activation_bytes_per_token(cfg, 2, ckpt);
        let with = default_chunk_tokens(Compute::Gpu, Some(free), cfg, 2, ckpt, params, lora);
        let want = (activation_budget(free, params) / (per_token + lora)) as usize;
        assert_eq!(with, want.clamp(DEFAULT_FORWARD_CHUNK_TOKENS, 1 << 20));
        let without = default_chunk_tokens(Compute::Gpu, Some(free), cfg, 2, ckpt, params, 0);
        assert!(with < without, "{ckpt}: {with} vs {without}");
    }
}

/// Passes of whole groups within the budget, counted as one row or padded rows hold them.
#[test]
fn forward_chunks_keep_groups_whole_and_respect_the_budget() {
    let p1 = [1u32, 2, 3, 4];
    let p2 = [5u32, 6];
    let c: Vec<Vec<u32>> = [3, 2, 5, 1, 4, 4].iter().map(|&l| vec![9; l]).collect();
    let prompts: Vec<&[u32]> = vec![&p1, &p1, &p1, &p2, &p2, &p2];
    let comps: Vec<&[u32]> = c.iter().map(|v| v.as_slice()).collect();
    let chunks = |budget| forward_chunks(&prompts, &comps, budget, true);
    // Groups cost 4+3+2+5 = 14 and 2+1+4+4 = 11.
    assert_eq!(chunks(100), vec![0..6]);
    assert_eq!(chunks(14), vec![0..3, 3..6]);
    // A group over budget splits between completions: [4+3+2], [4+5], then group 2 whole.
    assert_eq!(chunks(11), vec![0..2, 2..3, 3..6]);
    assert_eq!(chunks(1), (0..6).map(|i| i..i + 1).collect::<Vec<_>>());
    assert!(forward_chunks(&[], &[], 10, true).is_empty());

    // In padded rows a group laid out a row per completion counts its prompt in every row:
    // group 2 (3 x 6^2 = 108 keys against 11^2 = 121) costs 3 x 2 + 9 = 15 tokens, not 11, and
    // splits by rows (2+1 + 2+4, then 2+4); group 1 (3 x 9^2 = 243 against 14^2) keeps its row.
    assert!(!per_row(4, &comps[..3], false) && per_row(2, &comps[3..], false));
    assert!(!per_row(2, &comps[3..], true));
    assert_eq!(
        forward_chunks(&prompts, &comps, 14, false),
        vec![0..3, 3..5, 5..6]
    );
    assert_eq!(forward_chunks(&prompts, &comps, 29, false), vec![0..6]);
    assert_eq!(
        forward_chunks(&prompts, &comps, 28, false),
        vec![0..3, 3..6]
    );
    let packs = packs(&prompts, &comps, Packing::SharedPrompt, false);
    assert_eq!(packs, vec![0..3, 3..4, 4..5, 5..6]);
}

/// The recomputed head gives the graph path's log-probs, entropies and gradients (of the
/// hidden states and the head, through log-probs and a differentiable entropy), in chunks
/// that do not divide the rows, and no head gradient when the head is frozen.
#[test]
fn recomputed_head_logprobs_match_the_graph_path_with_gradients() {
    let dev = Device::Cpu;
    let (n, h, v) = (7, 5, 11);
    let hidden = Var::randn(0f32, 1.0, (n, h), &dev).unwrap();
    let w = Var::randn(0f32, 1.0, (v, h), &dev).unwrap();
    let targets = Tensor::new(&[0u32, 3, 10, 5, 5, 1, 9], &dev).unwrap();
    let c1 = Tensor::randn(0f32, 1.0, n, &dev).unwrap();
    let c2 = Tensor::randn(0f32, 1.0, n, &dev).unwrap();
    let diff = |a: &Tensor, b: &Tensor| -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar()
            .unwrap()
    };
    for (t, chunk) in [(1.0, 3), (0.7, 100), (0.0, 1)] {
        let loss = |(lp, ent): (Tensor, Option<Tensor>)| {
            let a = (lp * &c1).unwrap().sum_all().unwrap();
            (a + (ent.unwrap() * &c2).unwrap().sum_all().unwrap()).unwrap()
        };
        let (lp0, e0) =
            token_logprobs_entropy(&hidden, &w, &targets, t, chunk, Entropy::WithGrad).unwrap();
        let (lp1, e1) =
            token_logprobs_entropy_recomputed(&hidden, &w, &targets, t, chunk, Entropy::WithGrad)
                .unwrap();
        assert!(diff(&lp0, &lp1) < 1e-5 && diff(e0.as_ref().unwrap(), e1.as_ref().unwrap()) < 1e-5);
        let g0 = loss((lp0, e0)).backward().unwrap();
        let g1 = loss((lp1, e1)).backward().unwrap();
        for x in [&hidden, &w] {
            // Relative to the gradient's size: the inputs are random, and at t = 0.7 an entry
            // reaches ~10, where f32 sums in another order differ by ~1e-5 (seen: 1.24e-5).
            let (a, b) = (g0.get(x).unwrap(), g1.get(x).unwrap());
            let scale = 1.0 + diff(a, &a.zeros_like().unwrap());
            let d = diff(a, b);
            assert!(
                d < 1e-5 * scale,
                "t {t}, chunk {chunk}: {d} (scale {scale})"
            );
        }
    }
    // The head's gradient into an accumulator instead of the graph (a GPU sink's route,
    // here on the CPU), the head a non-leaf (a cast of a parameter, as a bf16 model holds
    // it) that nothing else reads: the backward runs, and the accumulator holds the graph
    // path's gradient.
    let wv = Var::randn(0f32, 1.0, (v, h), &dev).unwrap();
    let cast = (wv.as_tensor() * 1.0).unwrap();
    let sink = grpo_models::kernels::grad_sink::GradSink::on_device(&[(&wv, &cast)]);
    let acc = sink
        .weight_grad(&cast)
        .expect("an accumulator for the head");
    let (lp0, _) = token_logprobs_entropy(&hidden, &cast, &targets, 0.8, 3, Entropy::Skip).unwrap();
    let g0 = (lp0 * &c1).unwrap().sum_all().unwrap().backward().unwrap();
    let (lp1, _) = head_logprobs_recomputed(
        &hidden,
        &cast,
        &targets,
        0.8,
        3,
        Entropy::Skip,
        Some(acc),
        Compute::Portable,
    )
    .unwrap();
    let g1 = (lp1 * &c1).unwrap().sum_all().unwrap().backward().unwrap();
    assert!(
        g1.get(wv.as_tensor()).is_none(),
        "the head's gradient left the graph"
    );
    let taken = sink
        .take(&wv)
        .unwrap()
        .expect("the accumulated head gradient");
    assert!(diff(g0.get(wv.as_tensor()).unwrap(), &taken) < 1e-5);
    assert!(diff(g0.get(&hidden).unwrap(), g1.get(&hidden).unwrap()) < 1e-5);
    let frozen = w.as_tensor().detach();
    let (lp, ent) =
        token_logprobs_entropy_recomputed(&hidden, &frozen, &targets, 1.0, 4, Entropy::Detached)
            .unwrap();
    assert!(!ent.unwrap().track_op());
    let g = lp.sum_all().unwrap().backward().unwrap();
    assert!(g.get(&hidden).is_some() && g.get(&frozen).is_none());
}

#[test]
fn chunked_logprobs_match_plain_twin_and_have_gradients() {
    let dev = Device::Cpu;
    let (n, h, v) = (7, 5, 11);
    let hidden = Var::randn(0f32, 1.0, (n, h), &dev).unwrap();
    let w = Var::randn(0f32, 1.0, (v, h), &dev).unwrap();
    let targets = Tensor::new(&[0u32, 3, 10, 5, 5, 1, 9], &dev).unwrap();
    for (t, chunk) in [(1.0, 3), (0.7, 100), (0.0, 1)] {
        let lp = token_logprobs(&hidden, &w, &targets, t, chunk).unwrap();
        let got = lp.to_vec1::<f32>().unwrap();
        let logits = hidden
            .matmul(&w.t().unwrap())
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        let tt = if t > 0.0 { t as f32 } else { 1.0 };
        for i in 0..n {
            let want = logprob_slow(
                &logits[i],
                targets.to_vec1::<u32>().unwrap()[i] as usize,
                tt,
            );
            assert!(
                (got[i] - want).abs() < 1e-5,
                "row {i}: {} vs {want}",
                got[i]
            );
        }
        let grads = lp.sum_all().unwrap().backward().unwrap();
        assert!(grads.get(&hidden).is_some() && grads.get(&w).is_some());
    }
}
