//! Tests of evaluation: pass@k against its textbook form, the batches, the tally and report.

use super::*;

/// C(n, k) in plain f64 (exact for the small n used here).
fn binom(n: usize, k: usize) -> f64 {
    if k > n {
        return 0.0;
    }
    (0..k).fold(1.0, |acc, i| acc * (n - i) as f64 / (i + 1) as f64)
}

/// The textbook form, 1 - C(n-c, k) / C(n, k).
fn pass_at_k_combinatorial(n: usize, c: usize, k: usize) -> f64 {
    1.0 - binom(n - c, k) / binom(n, k)
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-12
}

#[test]
fn pass_at_k_matches_hand_computed_values() {
    // n = 5, c = 2, k = 1: 1 - C(3,1)/C(5,1) = 1 - 3/5.
    assert!(close(pass_at_k(5, 2, 1), 0.4));
    // k = 2: 1 - C(3,2)/C(5,2) = 1 - 3/10.
    assert!(close(pass_at_k(5, 2, 2), 0.7));
    // No correct sample: 0 for every k; all correct: 1.
    for k in 1..=4 {
        assert_eq!(pass_at_k(4, 0, k), 0.0);
        assert_eq!(pass_at_k(4, 4, k), 1.0);
    }
    // n = 10, c = 3, k = 4: 1 - C(7,4)/C(10,4) = 1 - 35/210.
    assert!(close(pass_at_k(10, 3, 4), 1.0 - 35.0 / 210.0));
    // pass@1 is the share of correct samples.
    assert!(close(pass_at_k(8, 3, 1), 3.0 / 8.0));
    // Fewer wrong samples than k: every draw has a correct one.
    assert_eq!(pass_at_k(5, 3, 3), 1.0);
}

#[test]
fn pass_at_k_edge_cases_are_as_documented() {
    assert_eq!(pass_at_k(0, 0, 1), 0.0);
    assert_eq!(pass_at_k(5, 2, 0), 0.0);
    // c > n counts as c = n.
    assert_eq!(pass_at_k(3, 7, 2), 1.0);
    // k > n counts as k = n.
    assert_eq!(pass_at_k(3, 1, 10), 1.0);
    assert_eq!(pass_at_k(3, 0, 10), 0.0);
}

#[test]
fn pass_at_k_equals_the_combinatorial_form_on_a_grid() {
    for n in 1..=30 {
        for c in 0..=n {
            let mut prev = 0.0;
            for k in 1..=n {
                let p = pass_at_k(n, c, k);
                let want = pass_at_k_combinatorial(n, c, k);
                assert!((p - want).abs() < 1e-9, "n={n} c={c} k={k}: {p} vs {want}");
                assert!((0.0..=1.0).contains(&p));
                assert!(p >= prev - 1e-12, "not monotone in k at n={n} c={c} k={k}");
                prev = p;
            }
        }
    }
    // Large n stays finite and exact where binomials would overflow f64.
    let p = pass_at_k(2000, 1, 1000);
    assert!(close(p, 0.5), "{p}");
}

#[test]
fn ks_are_checked_against_the_samples() {
    assert!(check_ks(&[1, 4, 8], 8, "eval_k", "eval_num_samples").is_ok());
    // Greedy only: no pass@k, nothing to check.
    assert!(check_ks(&[4], 0, "eval_k", "eval_num_samples").is_ok());
    let e = check_ks(&[1, 8], 4, "--k", "--num-samples")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`--k`") && e.contains("pass@8") && e.contains("raise --num-samples to 8"),
        "{e}"
    );
    let e = check_ks(&[0], 4, "eval_k", "eval_num_samples")
        .unwrap_err()
        .to_string();
    assert!(e.contains("`eval_k`"), "{e}");
}

/// SmolLM2-135M in f32 (30 layers, 3 KV heads of 64, hidden 576, MLP 1536, vocabulary
/// 49152), as `GroupSampler::memory_costs` gives it.
fn smollm2_costs(gradient_checkpointing: bool) -> MemoryCosts {
    MemoryCosts {
        kv_per_position: 2 * 2 * 30 * 3 * 64 * 4,
        logits: 2 * 4 * 49152,
        pass_per_token: crate::logprobs::activation_bytes_per_token(
            (576, 1536, 30),
            4,
            gradient_checkpointing,
        ),
    }
}

fn bound(pass_tokens: usize, gradient_checkpointing: bool, round: usize) -> BatchBound {
    BatchBound {
        pass_tokens,
        gradient_checkpointing,
        round,
        max: MAX_BATCH_COMPLETIONS,
    }
}

#[test]
fn the_bound_is_what_a_training_pass_holds_within_the_round_and_the_cap() {
    let c = smollm2_costs(false);
    // A 1024-token pass keeps 2.26 GB (30 x (16 x 576 + 6 x 1536) floats a token); a
    // sequence of 100 + 128 positions holds 21 MB of KV cache and 0.4 MB of logits: room
    // for 105, capped at 64.
    assert_eq!(c.pass_per_token * 1024, 2_264_924_160);
    let b = bound(1024, false, 16);
    assert_eq!(b.completions(Some(&c), 100, 128), 64);
    // 2048 new tokens: 198 MB a sequence, 11 fit; 512-token passes: 5, below the round's 16.
    assert_eq!(bound(1024, false, 4).completions(Some(&c), 100, 2048), 11);
    assert_eq!(bound(512, false, 16).completions(Some(&c), 100, 2048), 16);
    assert_eq!(bound(512, false, 4).completions(Some(&c), 100, 2048), 5);
    // With checkpointing a pass keeps 13x less: 8 sequences at 228 positions, so the round's.
    let gc = smollm2_costs(true);
    assert_eq!(bound(1024, true, 1).completions(Some(&gc), 100, 128), 8);
    assert_eq!(bound(1024, true, 16).completions(Some(&gc), 100, 128), 16);
    // sampling_batch_size (the cap) wins over the round; no KV cache: the cap.
    let small = BatchBound { max: 8, ..b };
    assert_eq!(small.completions(Some(&c), 100, 128), 8);
    assert_eq!(b.completions(None, 100, 128), 64);
}

#[test]
fn batches_are_whole_prompts_within_the_bound_of_their_longest() {
    let b = bound(1024, false, 16);
    let c = smollm2_costs(false);
    // Short prompts: 64 completions a call, 8 prompts of 8.
    let calls = batches(&[50; 20], 8, 128, &b, Some(&c));
    assert_eq!(calls, [0..8, 8..16, 16..20]);
    // Greedy only (n = 0) counts as one completion a prompt.
    assert_eq!(batches(&[50; 100], 0, 128, &b, Some(&c)), [0..64, 64..100]);
    // Long completions: 11 fit, 2 prompts of 4; a long prompt (4 fit) closes its call early.
    let b4 = bound(1024, false, 4);
    let calls = batches(&[100, 100, 100, 3000, 100], 4, 2048, &b4, Some(&c));
    assert_eq!(calls, [0..2, 2..3, 3..4, 4..5]);
    // More samples than the bound allows: one prompt a call, never none.
    assert_eq!(
        batches(&[10; 3], 100, 128, &b, Some(&c)),
        [0..1, 1..2, 2..3]
    );
    assert!(batches(&[], 8, 128, &b, Some(&c)).is_empty());
}

#[test]
fn durations_read_as_minutes_and_seconds() {
    assert_eq!(minutes(45.2), "45s");
    assert_eq!(minutes(72.0), "1m12s");
    assert_eq!(minutes(3605.0), "60m05s");
}

#[test]
fn a_correctness_reward_must_be_one_of_the_rewards() {
    let names = ["correct", "format"];
    assert_eq!(
        check_correctness_reward("format", names, "correctness_reward").unwrap(),
        1
    );
    let e = check_correctness_reward("corect", names, "--correctness-reward")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--correctness-reward") && e.contains("`corect`"),
        "{e}"
    );
    assert!(e.contains("`correct`, `format`"), "{e}");
}

#[test]
fn correctness_needs_every_accuracy_reward() {
    assert_eq!(correctness(&[1.0, 0.1], &[0], None), Some(true));
    assert_eq!(correctness(&[0.0, 0.1], &[0], None), Some(false));
    assert_eq!(correctness(&[1.0, 0.0], &[0, 1], None), Some(false));
    assert_eq!(correctness(&[f32::NAN, 1.0], &[0], None), None);
    assert_eq!(correctness(&[1.0], &[], None), None);
    // A named correctness reward: its score at least the threshold, compared as f32.
    assert_eq!(
        correctness(&[0.1, 0.7], &[1], Some(0.7_f64 as f32)),
        Some(true)
    );
    assert_eq!(correctness(&[0.1, 0.6], &[1], Some(0.7)), Some(false));
    assert_eq!(correctness(&[0.9, 1.0], &[1], Some(1.0)), Some(true));
    assert_eq!(correctness(&[1.0, f32::NAN], &[1], Some(0.5)), None);
}

fn names() -> Vec<String> {
    vec!["correct".into(), "format".into()]
}

#[test]
fn tally_averages_pass_at_k_over_prompts() {
    let mut t = Tally::new(4, vec![1, 2, 4], names());
    // Prompt A: 1 of 4 correct; prompt B: 4 of 4.
    let (r1, r0): (&[f32], &[f32]) = (&[1.0, 0.1], &[0.0, 0.0]);
    let a = [Some(true), Some(false), Some(false), Some(false)];
    t.add(&a, &[r1, r0, r0, r0], Some((Some(false), r0)));
    t.add(&[Some(true); 4], &[r1; 4], Some((Some(true), r1)));
    // A prompt without a reference answer counts in nothing but the prompt count.
    let nan: &[f32] = &[f32::NAN, 0.0];
    t.add(&[None; 4], &[nan; 4], Some((None, nan)));
    let r = t.report();
    assert_eq!((r.num_prompts, r.num_scored, r.num_samples), (3, 2, 4));
    let get = |k: &str| r.get(k).unwrap();
    assert!(close(get("eval/pass@1"), (0.25 + 1.0) / 2.0));
    // Prompt A: 1 - C(3,2)/C(4,2) = 0.5.
    assert!(close(get("eval/pass@2"), (0.5 + 1.0) / 2.0));
    assert!(close(get("eval/pass@4"), 1.0));
    assert!(close(get("eval/mean_accuracy"), 5.0 / 8.0));
    assert!(close(get("eval/accuracy"), 0.5));
    // Over the 8 judged samples (the NaNs are left out).
    assert!(close(get("eval/reward/correct"), 5.0 / 8.0));
    assert!((get("eval/reward/format") - 0.5 / 12.0).abs() < 1e-6);
    let order: Vec<&str> = r.metrics.iter().map(|m| m.0.as_str()).collect();
    assert_eq!(
        order,
        [
            "eval/pass@1",
            "eval/pass@2",
            "eval/pass@4",
            "eval/mean_accuracy",
            "eval/accuracy",
            "eval/reward/correct",
            "eval/reward/format"
        ]
    );
    let j = r.to_json();
    assert_eq!(j["num_prompts"], 3);
    assert!(r.table().contains("eval/pass@2"));
}

#[test]
fn greedy_only_means_rewards_over_greedy_completions() {
    let mut t = Tally::new(0, vec![], names());
    t.add(&[], &[], Some((Some(true), &[1.0, 0.1])));
    t.add(&[], &[], Some((Some(false), &[0.0, 0.0])));
    let r = t.report();
    assert_eq!(r.get("eval/pass@1"), None);
    assert_eq!(r.get("eval/mean_accuracy"), None);
    assert_eq!(r.get("eval/accuracy"), Some(0.5));
    assert_eq!(r.get("eval/reward/correct"), Some(0.5));
    // No score at all: the mean is missing (null in JSON), not 0.
    let mut t = Tally::new(0, vec![], names());
    t.add(&[], &[], None);
    let r = t.report();
    assert!(r.get("eval/reward/correct").unwrap().is_nan());
    assert!(r.to_json()["eval/reward/correct"].is_null());
    assert!(r.table().contains("missing"));
}
