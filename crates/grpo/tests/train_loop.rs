//! The training loop end to end on a tiny random Llama with SmolLM2's real tokenizer and chat
//! template: it runs, logs, checkpoints in a layout we load back, and a run stopped after step k
//! and resumed equals the uninterrupted run exactly (weights and metrics).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use grpo::config::{Format, TrainConfig};
use grpo::train::{train, RunControl};
use grpo_models::hub::ModelSource;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

#[path = "support/rerun.rs"]
#[allow(dead_code)]
mod rerun;
#[path = "support/tiny_llama.rs"]
mod support;

/// A 2-layer Llama (hidden 32) over SmolLM2's vocabulary, fixed random weights.
fn tiny_model(dir: &Path) {
    support::tiny_llama(dir, &fixtures());
}

fn config(model: &Path, out: &Path, extra: &str) -> TrainConfig {
    config_with(model, out, extra, &[])
}

/// [`config`] with `--key=value` overrides.
fn config_with(model: &Path, out: &Path, extra: &str, overrides: &[&str]) -> TrainConfig {
    let text = format!(
        "model = \"{}\"\noutput_dir = \"{}\"\nnum_generations = 4\nper_device_train_batch_size = 4\n\
         gradient_accumulation_steps = 2\nmax_completion_length = 6\nlearning_rate = 1e-3\n\
         lr_scheduler_type = \"cosine\"\nwarmup_steps = 1\nmax_steps = 4\nsave_steps = 2\nthreads = 2\n\
         eval_steps = 2\neval_num_prompts = 3\nreport_to = [\"tensorboard\"]\n{extra}\n\
         [task]\ntrain_size = 20\neval_size = 5\n",
        model.display(),
        out.display()
    );
    let overrides: Vec<String> = overrides.iter().map(|o| o.to_string()).collect();
    TrainConfig::from_str(&text, Format::Toml, "test", &overrides).unwrap()
}

fn metrics(dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            let o = v.as_object_mut().unwrap();
            o.retain(|k, _| {
                !k.starts_with("time") && !k.starts_with("memory/") && k != "tokens_per_second"
            });
            v
        })
        .collect()
}

fn weights(dir: &Path) -> HashMap<String, Vec<f32>> {
    let m = grpo_models::weights::load_model(
        &ModelSource::HfDir(dir.to_path_buf()),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    m.tensors
        .into_iter()
        .map(|(k, v)| (k, v.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect()
}

#[test]
fn resumed_run_equals_uninterrupted_run() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    tiny_model(&model);
    // beta > 0 and two iterations exercise the reference and old log-probs too.
    let extra = "beta = 0.04\nnum_iterations = 2\nsteps_per_generation = 2";

    let full = tmp.path().join("full");
    let out = train(&config(&model, &full, extra), &RunControl::default()).unwrap();
    assert_eq!(out.steps, 4);
    assert!(!out.interrupted);

    let part = tmp.path().join("part");
    let ctl = RunControl {
        max_rounds_this_run: Some(1),
        ..Default::default()
    };
    let first = train(&config(&model, &part, extra), &ctl).unwrap();
    assert!(first.interrupted);
    assert_eq!(first.steps, 2);
    let resumed = train(
        &config(&model, &part, extra),
        &RunControl {
            resume: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(resumed.steps, 4);

    let (a, b) = (
        weights(&full.join("checkpoint-4")),
        weights(&part.join("checkpoint-4")),
    );
    assert_eq!(a.len(), b.len());
    for (k, v) in &a {
        assert_eq!(v, &b[k], "{k} differs after resume");
    }
    // The weights did change during training.
    let base = weights(&model);
    assert!(base.iter().any(|(k, v)| v != &a[k]));
    assert_eq!(metrics(&full), metrics(&part));
    let m = metrics(&full);
    for key in [
        "loss",
        "kl",
        "reward",
        "grad_norm",
        "clip_ratio/region_mean",
        "entropy",
        "eval/accuracy",
    ] {
        assert!(
            m.iter().any(|l| l.get(key).is_some_and(|v| !v.is_null())),
            "metric {key} missing"
        );
    }
    // Checkpoint contents.
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "optimizer.safetensors",
        "trainer_state.json",
        "config.toml",
    ] {
        assert!(full.join("checkpoint-4").join(f).exists(), "{f}");
    }
    assert!(full.join("completions.jsonl").exists());
    // groups.jsonl (seed 003's per-group log), the same rows when resumed (here every group's
    // rewards are equal: the random model never answers right).
    check_groups_log(&full);
    assert_eq!(
        jsonl(&full.join("groups.jsonl")),
        jsonl(&part.join("groups.jsonl"))
    );
    assert!(full.join("eval/step-4.jsonl").exists());
    assert!(std::fs::read_dir(full.join("tb")).unwrap().count() >= 1);
}

/// `groups.jsonl` against `completions.jsonl` in `dir` (groups of 4): one row per group, its
/// reward mean and advantage mean / std those of its completions, std ~1 where the rewards spread
/// (`scale_rewards = group`). Returns how many groups had a spread.
fn check_groups_log(dir: &Path) -> usize {
    let comps = jsonl(&dir.join("completions.jsonl"));
    let groups = jsonl(&dir.join("groups.jsonl"));
    assert_eq!(groups.len() * 4, comps.len());
    let f = |v: &serde_json::Value| v.as_f64().unwrap();
    let mean = |x: &[f64]| x.iter().sum::<f64>() / x.len() as f64;
    let std = |x: &[f64]| {
        let m = mean(x);
        (x.iter().map(|v| (v - m).powi(2)).sum::<f64>() / (x.len() - 1) as f64).sqrt()
    };
    let mut spread = 0;
    for (gr, c) in groups.iter().zip(comps.chunks(4)) {
        assert_eq!(gr["step"], c[0]["step"]);
        let rewards: Vec<f64> = c.iter().map(|x| f(&x["reward"])).collect();
        let adv: Vec<f64> = c.iter().map(|x| f(&x["advantage"])).collect();
        assert!(
            (f(&gr["reward_mean"]) - mean(&rewards)).abs() < 1e-5,
            "{gr}"
        );
        assert!(f(&gr["advantage_mean"]).abs() < 1e-5, "{gr}");
        assert!((f(&gr["advantage_std"]) - std(&adv)).abs() < 1e-4, "{gr}");
        assert_eq!(gr["scorable"], 4);
        if gr["zero_std"] == false {
            spread += 1;
            assert!((f(&gr["advantage_std"]) - 1.0).abs() < 1e-2, "{gr}");
        }
    }
    spread
}

fn jsonl(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// `grpo::eval` on the built-in task's held-out problems: every metric is there and in [0, 1],
/// pass@k grows with k and equals what the logged rows give, one row per prompt with n
/// completions, and a prompt's samples do not depend on which other prompts are evaluated.
#[test]
fn eval_on_the_builtin_task_reports_pass_at_k() {
    let tmp = tempfile::tempdir().unwrap();
    let model_dir = tmp.path().join("model");
    tiny_model(&model_dir);
    let cfg = TrainConfig::from_str(
        "max_completion_length = 6\neval_num_samples = 8\neval_k = [1, 4, 8]\n\
         [task]\ntrain_size = 20\neval_size = 10\n",
        Format::Toml,
        "test",
        &[],
    )
    .unwrap();
    let examples = grpo::inputs::held_out_examples(&cfg).unwrap();
    assert_eq!(examples.len(), 10);
    let rewards = grpo::inputs::config_rewards(&cfg, &Device::Cpu).unwrap();
    let (model, tok, eos) = grpo::eval::load_inference_model(
        Some(model_dir.to_str().unwrap()),
        None,
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let opts = cfg.eval_options(eos);
    let run = |opts: &grpo::eval::EvalOptions| {
        let mut rows = vec![];
        let mut sink = |r: &serde_json::Value| {
            rows.push(r.clone());
            Ok(())
        };
        let report =
            grpo::eval::evaluate(&model, &tok, &examples, &rewards, opts, Some(&mut sink)).unwrap();
        (report, rows)
    };
    // 8 samples: 8 prompts per batch, so two batches.
    let (report, rows) = run(&opts);
    assert_eq!((report.num_prompts, report.num_samples), (10, 8));
    assert_eq!(report.num_scored, 10);
    let get = |k: &str| report.get(k).unwrap_or_else(|| panic!("{k} missing"));
    let keys = [
        "eval/pass@1",
        "eval/pass@4",
        "eval/pass@8",
        "eval/mean_accuracy",
        "eval/accuracy",
        "eval/reward/correct",
        "eval/reward/format",
    ];
    for k in keys {
        assert!((0.0..=1.0).contains(&get(k)), "{k} = {}", get(k));
    }
    assert!(get("eval/pass@1") <= get("eval/pass@4") && get("eval/pass@4") <= get("eval/pass@8"));
    assert!((get("eval/pass@1") - get("eval/mean_accuracy")).abs() < 1e-12);

    assert_eq!(rows.len(), 10);
    let (mut pass4, mut greedy_ok, mut correct_sum) = (0.0, 0usize, 0.0);
    for (row, ex) in rows.iter().zip(&examples) {
        assert_eq!(row["answer"].as_str(), ex.answer.as_deref());
        let comps = row["completions"].as_array().unwrap();
        assert_eq!(comps.len(), 8);
        let c = comps
            .iter()
            .filter(|c| c["correct"].as_bool().unwrap())
            .count();
        assert_eq!(row["num_correct"], c);
        pass4 += grpo::eval::pass_at_k(8, c, 4);
        for comp in comps {
            assert!(comp["text"].is_string() && comp["stop_reason"].is_string());
            correct_sum += comp["rewards"]["correct"].as_f64().unwrap();
        }
        greedy_ok += usize::from(row["greedy"]["correct"].as_bool().unwrap());
    }
    assert!((get("eval/pass@4") - pass4 / 10.0).abs() < 1e-9);
    assert!((get("eval/accuracy") - greedy_ok as f64 / 10.0).abs() < 1e-12);
    assert!((get("eval/reward/correct") - correct_sum / 80.0).abs() < 1e-9);

    // Seeded per prompt: the first 3 prompts alone get the same answers.
    let few = grpo::eval::EvalOptions {
        num_prompts: Some(3),
        ..opts.clone()
    };
    let (r3, rows3) = run(&few);
    assert_eq!(r3.num_prompts, 3);
    assert_eq!(rows3[..], rows[..3]);

    // The batch bound changes how many prompts are sampled at once, never an answer: 8 prompts
    // a call above; here 3 (24 completions), and one (a bound below a group; a memory bound of
    // a 1-token training pass).
    let b = opts.batch;
    for batch in [
        grpo::eval::BatchBound {
            max: 24,
            round: 24,
            ..b
        },
        grpo::eval::BatchBound {
            max: 1,
            round: 1,
            ..b
        },
        grpo::eval::BatchBound {
            pass_tokens: 1,
            round: 1,
            ..b
        },
    ] {
        let (rb, rows_b) = run(&grpo::eval::EvalOptions {
            batch,
            ..opts.clone()
        });
        assert_eq!(rows_b, rows, "{batch:?}");
        assert_eq!(rb, report, "{batch:?}");
    }

    // Greedy only: no pass@k; rewards are the greedy completions' means.
    let greedy = grpo::eval::EvalOptions {
        num_samples: 0,
        ..opts
    };
    let (rg, rows_g) = run(&greedy);
    assert!(rg.get("eval/pass@1").is_none() && rg.get("eval/mean_accuracy").is_none());
    assert_eq!(rg.get("eval/accuracy"), report.get("eval/accuracy"));
    assert!(rows_g[0]["completions"].as_array().unwrap().is_empty());
    assert_eq!(rows_g[0]["greedy"], rows[0]["greedy"]);
}

/// Periodic eval during training: `eval/step-N.jsonl` holds one row per held-out prompt with
/// its samples, and metrics.jsonl has pass@k beside greedy accuracy.
#[test]
fn eval_steps_log_samples_and_pass_at_k() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    tiny_model(&model);
    let out_dir = tmp.path().join("run");
    let mut cfg = config(
        &model,
        &out_dir,
        "eval_num_samples = 2\neval_k = [1, 2]\neval_temperature = 0.8",
    );
    cfg.run.max_steps = Some(2);
    let out = train(&cfg, &RunControl::default()).unwrap();
    let last = out.last_eval.unwrap();
    assert!(last.iter().any(|(k, _)| k == "eval/pass@2"));
    for step in [0, 2] {
        let rows = jsonl(&out_dir.join(format!("eval/step-{step}.jsonl")));
        assert_eq!(rows.len(), 3, "eval_num_prompts = 3");
        for r in &rows {
            assert_eq!(r["completions"].as_array().unwrap().len(), 2);
            assert!(r["greedy"]["text"].is_string());
            assert!(r["prompt"].is_string() && r["answer"].is_string());
        }
    }
    let m = metrics(&out_dir);
    for step in [0, 2] {
        let line = m
            .iter()
            .find(|l| l["step"] == step && l.get("eval/pass@1").is_some());
        let line = line.unwrap_or_else(|| panic!("no eval metrics at step {step}"));
        for k in [
            "eval/pass@1",
            "eval/pass@2",
            "eval/mean_accuracy",
            "eval/accuracy",
        ] {
            let v = line[k].as_f64().unwrap();
            assert!((0.0..=1.0).contains(&v), "{k} = {v}");
        }
    }
}

#[test]
fn every_loss_type_and_kl_mode_trains() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    tiny_model(&model);
    for (i, extra) in [
        "loss_type = \"grpo\"\nscale_rewards = \"batch\"",
        "loss_type = \"bnpo\"\nimportance_sampling_level = \"sequence\"\nnum_iterations = 2",
        "loss_type = \"dr_grpo\"\nscale_rewards = \"none\"\nmask_truncated_completions = true",
        "kl_coef = 0.05\nkl_target = 0.1\nentropy_coef = 0.01\ndrop_zero_std_groups = true",
        "sync_ref_model = true\nref_model_sync_steps = 1\nbeta = 0.1\nreward_std_floor = 0.1\nnormalize_advantages_batch = true",
        // GDPO aggregation over rule rewards, and a composite whose coherence term needs the
        // reference model although no KL is configured.
        "multi_objective_aggregation = \"normalize_then_sum\"\n\
         [[rewards]]\nkind = \"answer_match\"\nextract = \"auto\"\n\
         [[rewards]]\nkind = \"composite\"\ncoherence = 0.1\n\
         [rewards.diversity]\nkind = \"diversity\"\n\
         [[rewards]]\nkind = \"length\"\ncache_length = 3\n\
         [[rewards]]\nkind = \"repetition\"\nn = 2",
    ]
    .iter()
    .enumerate()
    {
        let out_dir = tmp.path().join(format!("r{i}"));
        let mut cfg = config(&model, &out_dir, extra);
        cfg.run.max_steps = Some(2);
        cfg.logging.eval_steps = 0;
        let out = train(&cfg, &RunControl::default()).unwrap_or_else(|e| panic!("{extra}: {e}"));
        assert_eq!(out.steps, 2, "{extra}");
        let m = metrics(&out_dir);
        assert!(
            m.iter().all(|l| l.get("loss").is_none_or(|v| v.as_f64().is_some_and(f64::is_finite))),
            "{extra}: {m:?}"
        );
        if extra.contains("composite") {
            // The coherence term was computed: the composite is never missing.
            let train_lines: Vec<_> = m.iter().filter(|l| l.get("loss").is_some()).collect();
            assert!(!train_lines.is_empty());
            for l in train_lines {
                assert_eq!(l["rewards/composite/missing"].as_f64(), Some(0.0), "{l}");
            }
        }
    }
}

/// The judge reward on the tiny model: batched (left-padded) scoring equals one-at-a-time
/// scoring, yes/no renormalization is complementary, and expected scores stay in range.
#[test]
fn judge_reward_is_consistent() {
    use grpo::data::{Example, Prompt};
    use grpo::rewards::{parse_rewards, RewardContext, ScoreItem};
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    tiny_model(&model);
    let m = model.display();
    let tables: Vec<serde_json::Value> = serde_json::from_str(&format!(
        r#"[{{"kind": "judge", "model": "{m}", "yes": "Yes", "no": "No", "batch_size": 1, "name": "b1"}},
            {{"kind": "judge", "model": "{m}", "yes": "Yes", "no": "No", "batch_size": 3, "name": "b3"}},
            {{"kind": "judge", "model": "{m}", "yes": "No", "no": "Yes", "name": "flip"}},
            {{"kind": "judge", "model": "{m}", "yes": "Yes", "name": "raw"}},
            {{"kind": "judge", "model": "{m}", "mode": "expected_score", "scores": ["1", "2", "3"], "name": "ev"}}]"#
    ))
    .unwrap();
    let ctx = RewardContext {
        max_completion_length: 8,
        device: Device::Cpu,
    };
    let rewards = parse_rewards(&tables, &ctx).unwrap();
    let ex = |p: &str, a: Option<&str>| Example {
        prompt: Prompt::Text(p.into()),
        answer: a.map(str::to_owned),
        metadata: Default::default(),
        origin: "t".into(),
        tokens: None,
    };
    let exs = [
        ex("What is 2 + 2?", Some("4")),
        ex("Name a colour, please, in one word.", None),
        ex("Hi", Some("hello")),
    ];
    let comps = ["4", "Blue, I think, is a fine colour.", "Hello there"];
    let items: Vec<ScoreItem> = exs
        .iter()
        .zip(comps)
        .map(|(e, c)| ScoreItem::new(e, c))
        .collect();
    let s: Vec<Vec<f32>> = rewards.iter().map(|r| r.score(&items).unwrap()).collect();
    for (i, &b1) in s[0].iter().enumerate() {
        assert!((b1 - s[1][i]).abs() < 1e-5, "batched {} vs {b1}", s[1][i]);
        assert!((b1 + s[2][i] - 1.0).abs() < 1e-5);
        assert!(b1 > 0.0 && b1 < 1.0);
        assert!(s[3][i] > 0.0 && s[3][i] < 1.0);
        assert!((1.0..=3.0).contains(&s[4][i]), "{}", s[4][i]);
    }
    // Different inputs give different judgements.
    assert!((s[0][0] - s[0][1]).abs() > 1e-6);
    // A word that is several tokens is named in the error.
    let bad: Vec<serde_json::Value> = serde_json::from_str(&format!(
        r#"[{{"kind": "judge", "model": "{m}", "yes": "Yes indeed, certainly"}}]"#
    ))
    .unwrap();
    let e = parse_rewards(&bad, &ctx).unwrap_err().to_string();
    assert!(e.contains("rewards[0].yes") && e.contains("tokens"), "{e}");
}

#[test]
fn forward_chunks_leave_the_update_unchanged() {
    // Splitting micro-batches into small forward chunks (here: a group split between chunks too)
    // must give the same loss, statistics and gradient as one forward per micro-batch.
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    tiny_model(&model);
    for (i, extra) in [
        "loss_type = \"grpo\"\nbeta = 0.04\nentropy_coef = 0.01",
        "loss_type = \"bnpo\"\nimportance_sampling_level = \"sequence\"",
        "loss_type = \"dr_grpo\"",
        "loss_type = \"dapo\"\nbeta = 0.04",
    ]
    .iter()
    .enumerate()
    {
        let run = |chunk: usize| {
            let out_dir = tmp.path().join(format!("c{i}-{chunk}"));
            let mut cfg = config(&model, &out_dir, extra);
            cfg.run.max_steps = Some(1);
            cfg.logging.eval_steps = 0;
            cfg.update.forward_chunk_tokens = Some(chunk);
            train(&cfg, &RunControl::default()).unwrap_or_else(|e| panic!("{extra}: {e}"));
            metrics(&out_dir)
                .into_iter()
                .find(|l| l.get("loss").is_some())
                .unwrap()
        };
        let (whole, chunked) = (run(100_000), run(12));
        for key in ["loss", "grad_norm", "kl", "entropy", "mean_log_prob"] {
            let (a, b) = (whole[key].as_f64(), chunked[key].as_f64());
            let (Some(a), Some(b)) = (a, b) else {
                assert_eq!(a, b, "{extra}: {key}");
                continue;
            };
            assert!(
                (a - b).abs() <= 1e-4 * a.abs().max(1e-3),
                "{extra}: {key} {a} (one forward) vs {b} (chunked)"
            );
        }
    }
}

/// Rewards scored group by group on the scoring thread while sampling goes on give the same
/// episodes and scores as sampling first and scoring after; every group is reported once.
#[test]
fn early_scoring_equals_scoring_after_sampling() {
    use grpo::data::{Example, Prompt};
    use grpo::rewards::{parse_rewards, RewardContext};
    use grpo::rollout::{rollout, rollout_scoring_early, score};
    use grpo_models::sampler::{generate, generate_streaming, PromptInput, SamplingParams};
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    tiny_model(&dir);
    let m = grpo_models::weights::load_model(&ModelSource::HfDir(dir), DType::F32, &Device::Cpu)
        .unwrap();
    let tok = m.tokenizer().unwrap().clone();
    let model = m.build().unwrap();
    let data: Vec<Example> = ["one", "two two", "three three three"]
        .iter()
        .map(|p| Example {
            prompt: Prompt::Text(p.to_string()),
            answer: Some("3".into()),
            metadata: Default::default(),
            origin: "t".into(),
            tokens: None,
        })
        .collect();
    let ids: Vec<Vec<u32>> = data
        .iter()
        .map(|e| grpo::data::prompt_ids(&tok, e, None, None).unwrap())
        .collect();
    // Stop strings end some samples early, so groups finish at different steps.
    let params = SamplingParams {
        max_new_tokens: 10,
        temperature: 1.0,
        stop_strings: vec!["e".into(), "a".into()],
        ..Default::default()
    };
    let inputs: Vec<PromptInput> = ids
        .iter()
        .enumerate()
        .map(|(i, p)| PromptInput {
            ids: p.clone(),
            seed: i as u64,
        })
        .collect();
    let (plain, _) = generate(&model, Some(&tok), &inputs, 4, &params).unwrap();
    let mut seen = vec![0usize; 12];
    let (streamed, _) =
        generate_streaming(&model, Some(&tok), &inputs, 4, &params, &mut |p, g, c| {
            seen[p * 4 + g] += 1;
            assert_eq!(c.text, plain[p][g].text);
            Ok(())
        })
        .unwrap();
    assert_eq!(seen, vec![1; 12], "every sample is reported once");
    let texts = |g: &Vec<Vec<grpo_models::sampler::Completion>>| -> Vec<String> {
        g.iter().flatten().map(|c| c.text.clone()).collect()
    };
    assert_eq!(texts(&plain), texts(&streamed));

    let tables: Vec<serde_json::Value> = serde_json::from_str(
        r#"[{"kind": "answer_match"}, {"kind": "diversity", "n": 1},
            {"kind": "length", "max_length": 10, "cache_length": 5},
            {"kind": "composite", "quality": {"kind": "length", "max_length": 10, "cache_length": 5},
             "diversity": {"kind": "diversity"}}]"#,
    )
    .unwrap();
    let ctx = RewardContext {
        max_completion_length: 10,
        device: Device::Cpu,
    };
    let rewards = parse_rewards(&tables, &ctx).unwrap();
    let examples = [0usize, 1, 2];
    let seeds = [0u64, 1, 2];
    let (mut after, _) = rollout(&model, &tok, &examples, ids.clone(), &seeds, 4, &params).unwrap();
    score(&mut after, &data, &rewards, &[0, 1, 2, 3], None).unwrap();
    let (early_eps, _, early) = rollout_scoring_early(
        &model,
        &tok,
        &examples,
        ids,
        &seeds,
        4,
        &params,
        &data,
        &rewards,
        &[true, true, false, true],
    )
    .unwrap();
    assert_eq!(early_eps.len(), 12);
    // Some samples stopped early, others ran to the limit: completions finished at different steps.
    let lens: std::collections::BTreeSet<usize> =
        early_eps.iter().map(|e| e.completion_ids.len()).collect();
    assert!(lens.len() > 2, "{lens:?}");
    for (i, (a, e)) in after.iter().zip(&early_eps).enumerate() {
        assert_eq!(a.text, e.text);
        assert_eq!(early.scores[i][..2], a.rewards[..2], "episode {i}");
        assert!(
            early.scores[i][2].is_nan(),
            "the late reward is left for later"
        );
        assert_eq!(early.scores[i][3], a.rewards[3], "episode {i}");
    }
    assert!(early.secs[2] == 0.0);
}

/// Trains the tiny model for 2 steps (no eval) with `extra` config and returns the 2 training
/// steps' metric lines.
fn two_steps(extra: &str) -> Vec<serde_json::Value> {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    tiny_model(&model);
    let out_dir = tmp.path().join("run");
    let mut cfg = config(&model, &out_dir, extra);
    cfg.run.max_steps = Some(2);
    cfg.logging.eval_steps = 0;
    let out = train(&cfg, &RunControl::default()).unwrap();
    assert_eq!(out.steps, 2);
    let steps: Vec<_> = metrics(&out_dir)
        .into_iter()
        .filter(|l| l.get("loss").is_some())
        .collect();
    assert_eq!(steps.len(), 2);
    steps
}

/// A short run whose reward is a frozen sequence classifier (the tiny BERT fixture's
/// "positive" probability of the completion).
#[test]
fn classifier_reward_trains() {
    let bert = fixtures().join("rewards/bert");
    let extra = format!(
        "[[rewards]]\nkind = \"classifier\"\nmodel = \"{}\"\nlabel = \"positive\"\n\
         output = \"probability\"\nname = \"positive\"",
        bert.display()
    );
    let steps = two_steps(&extra);
    for l in steps {
        let mean = l["rewards/positive/mean"].as_f64().unwrap();
        assert!(mean > 0.0 && mean < 1.0, "{l}");
        assert_eq!(l["rewards/positive/missing"].as_f64(), Some(0.0));
        assert!(l["loss"].as_f64().unwrap().is_finite());
    }
}

/// A short run whose reward comes from the user's scorer program (the repository's example
/// Python scorer, speaking JSON lines), overlapped with sampling.
#[test]
fn command_reward_trains() {
    if std::process::Command::new("python3")
        .arg("--version")
        .output()
        .is_err()
    {
        no_python("no python3 on this machine");
        return;
    }
    let scorer =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/scorers/answer_scorer.py");
    let extra = format!(
        "[[rewards]]\nkind = \"command\"\ncommand = [\"python3\", \"{}\"]\nname = \"scored\"\ntimeout_s = 30\n\
         [[rewards]]\nkind = \"length\"",
        scorer.display()
    );
    let steps = two_steps(&extra);
    for l in steps {
        // Every built-in task example has an answer: the scorer answered every completion.
        assert_eq!(l["rewards/scored/missing"].as_f64(), Some(0.0), "{l}");
        let mean = l["rewards/scored/mean"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&mean), "{l}");
        assert_eq!(l["scorer/scored/timeouts"].as_f64(), Some(0.0));
        assert_eq!(l["scorer/scored/restarts"].as_f64(), Some(0.0));
    }
}

fn adapter_tensors(dir: &Path) -> Vec<(String, Vec<f32>)> {
    grpo::peft::load_peft(dir, &Device::Cpu)
        .unwrap()
        .tensors
        .into_iter()
        .map(|(k, v)| (k, v.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect()
}

/// LoRA: only adapters train (PEFT files in the checkpoint, no full weights), the reference is
/// the base with adapters off (the KL grows from 0), dropout is seeded, and a resumed run equals
/// the uninterrupted one exactly.
#[test]
fn lora_run_trains_adapters_and_resumes_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    tiny_model(&model);
    let extra = "beta = 0.04\nnum_iterations = 2\nsteps_per_generation = 2\n\
                 lora.r = 4\nlora.alpha = 8\nlora.dropout = 0.1\n\
                 lora.target_modules = [\"q_proj\", \"v_proj\", \"down_proj\"]";
    let full = tmp.path().join("full");
    let out = train(&config(&model, &full, extra), &RunControl::default()).unwrap();
    assert_eq!(out.steps, 4);
    let part = tmp.path().join("part");
    let ctl = RunControl {
        max_rounds_this_run: Some(1),
        ..Default::default()
    };
    assert!(
        train(&config(&model, &part, extra), &ctl)
            .unwrap()
            .interrupted
    );
    let resume = RunControl {
        resume: true,
        ..Default::default()
    };
    assert_eq!(
        train(&config(&model, &part, extra), &resume).unwrap().steps,
        4
    );

    let ck = full.join("checkpoint-4");
    for f in [
        "adapter_config.json",
        "adapter_model.safetensors",
        "optimizer.safetensors",
        "tokenizer.json",
    ] {
        assert!(ck.join(f).exists(), "{f}");
    }
    assert!(
        !ck.join("model.safetensors").exists(),
        "a LoRA checkpoint holds adapters only"
    );
    let a = adapter_tensors(&ck);
    assert_eq!(
        a,
        adapter_tensors(&part.join("checkpoint-4")),
        "resume changed the adapters"
    );
    assert_eq!(metrics(&full), metrics(&part));
    // 2 layers x (q, v, down) x (A, B); every B moved away from its zero start.
    assert_eq!(a.len(), 12);
    for (k, v) in &a {
        if k.ends_with("lora_B.weight") {
            assert!(v.iter().any(|x| *x != 0.0), "{k} did not train");
        }
    }
    let kl: Vec<f64> = metrics(&full)
        .iter()
        .filter_map(|l| l.get("kl").and_then(|v| v.as_f64()))
        .collect();
    assert_eq!(kl[0], 0.0, "the first step's policy is the base: KL 0");
    assert!(kl.iter().any(|&k| k > 0.0), "{kl:?}");
    // The checkpoint samples and exports like any model.
    let (m, _) = grpo::export::load_for_inference(
        Some(&ck.display().to_string()),
        Some(&model.display().to_string()),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    assert_eq!(m.config().num_layers, 2);
}

/// QLoRA on the tiny model: the base kept in Q8_0 / Q4_0 / NF4, adapters on every projection
/// train.
#[test]
fn qlora_run_trains() {
    for q in ["q8_0", "q4_0", "nf4"] {
        let steps = two_steps(&format!(
            "beta = 0.04\nlora.r = 4\nlora.target_modules = \"all-linear\"\nbase_quantization = \"{q}\""
        ));
        for l in &steps {
            assert!(l["loss"].as_f64().is_some_and(f64::is_finite), "{q}: {l}");
            assert!(l["grad_norm"].as_f64().is_some_and(|g| g > 0.0), "{q}: {l}");
        }
    }
}

/// Gradient checkpointing recomputes each block in the backward: same losses and gradient
/// norms (to rounding), for full fine-tuning and for LoRA with dropout (the recomputed block
/// draws the mask its forward drew), and off the fused CPU path (bf16: the candle ops a GPU
/// runs, with the chunked attention inside the recomputed block).
///
/// Under CPU mixed precision (bf16 on a CPU with AVX-512, the fused kernels) the bf16 case is
/// left to the portable rerun (`bf16_tests_pass_on_the_portable_path`): checkpointing also
/// turns off packing for decoding, the sampler then sums its products in another order, and
/// rounding the products' inputs to bf16 turns those last-bit differences into other samples.
#[test]
fn gradient_checkpointing_leaves_the_update_unchanged() {
    let mixed = grpo_models::kernels::Compute::resolve(&Device::Cpu, DType::BF16).bf16_matmuls();
    for base in [
        "beta = 0.04",
        "beta = 0.04\nlora.r = 4\nlora.dropout = 0.2\nlora.target_modules = \"all-linear\"",
        "beta = 0.04\ndtype = \"bf16\"",
    ] {
        if mixed && base.contains("bf16") {
            continue;
        }
        let plain = two_steps(base);
        let ckpt = two_steps(&format!("{base}\ngradient_checkpointing = true"));
        for (a, b) in plain.iter().zip(&ckpt) {
            for k in ["loss", "grad_norm", "kl", "reward"] {
                let (x, y) = (a[k].as_f64().unwrap(), b[k].as_f64().unwrap());
                assert!(
                    (x - y).abs() <= 1e-5 * x.abs().max(1e-3),
                    "{base}: {k} {x} vs {y} with checkpointing"
                );
            }
        }
    }
}

/// DAPO's dynamic sampling: groups whose rewards all equal are dropped and more prompts sampled,
/// at most `dynamic_sampling_max_passes` extra passes; what happened is logged per round.
#[test]
fn dynamic_sampling_replaces_groups_without_signal() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    tiny_model(&model);
    let run = |name: &str, extra: &str| {
        let out = tmp.path().join(name);
        let extra = format!("dynamic_sampling = true\n{extra}");
        let cfg = config_with(&model, &out, &extra, &["--max_steps=2", "--eval_steps=0"]);
        let o = train(&cfg, &RunControl::default()).unwrap();
        assert_eq!(o.steps, 2);
        metrics(&out)
    };
    let get = |m: &serde_json::Value, k: &str| m[k].as_f64().unwrap_or_else(|| panic!("{k}: {m}"));

    // The random model never answers right: every group of the built-in rewards is all zeros,
    // so each round samples 1 + 2 passes of 2 prompts, keeps nothing and makes no update.
    let two_passes = "dynamic_sampling_max_passes = 2\n";
    for m in run("flat", two_passes) {
        assert_eq!(get(&m, "dynamic_sampling/groups_sampled"), 6.0, "{m}");
        assert_eq!(get(&m, "dynamic_sampling/groups_dropped"), 6.0, "{m}");
        assert_eq!(get(&m, "dynamic_sampling/groups_kept"), 0.0, "{m}");
        assert!(m.get("loss").is_none(), "no update without signal: {m}");
    }
    // Whether the random text starts with a letter varies within most groups: the round is
    // filled with groups that carry a signal, and it updates.
    let varied = "[[rewards]]\nkind = \"format\"\npattern = '^[A-Za-z]'\n";
    for m in run("varied", &format!("{two_passes}{varied}")) {
        let sampled = get(&m, "dynamic_sampling/groups_sampled");
        assert_eq!(get(&m, "dynamic_sampling/groups_kept"), 2.0, "{m}");
        assert!(sampled >= 2.0 && sampled - get(&m, "dynamic_sampling/groups_dropped") >= 2.0);
        assert_eq!(get(&m, "frac_reward_zero_std"), 0.0, "{m}");
        assert!(get(&m, "loss").is_finite());
    }
    // The kept groups are what groups.jsonl logs: each with a spread, advantages of std ~1.
    let dir = tmp.path().join("varied");
    let spread = check_groups_log(&dir);
    assert_eq!(spread, jsonl(&dir.join("groups.jsonl")).len());
    assert!(spread > 0);

    // One oversampled pass and no extra ones: ceil(2 x 2.5) = 5 prompts in the first pass.
    let once = "dynamic_sampling_max_passes = 0\ndynamic_sampling_oversample = 2.5\n";
    for m in run("flat_once", once) {
        assert_eq!(get(&m, "dynamic_sampling/groups_sampled"), 5.0, "{m}");
        assert_eq!(get(&m, "dynamic_sampling/groups_kept"), 0.0, "{m}");
    }
    // With a signal, at most P = 2 of the 5 are kept, the first in order, and the round trains.
    for m in run("varied_once", &format!("{once}{varied}")) {
        assert_eq!(get(&m, "dynamic_sampling/groups_sampled"), 5.0, "{m}");
        let kept = get(&m, "dynamic_sampling/groups_kept");
        let with_signal = 5.0 - get(&m, "dynamic_sampling/groups_dropped");
        assert_eq!(kept, with_signal.min(2.0), "{m}");
        if kept > 0.0 {
            assert!(get(&m, "loss").is_finite(), "{m}");
        }
    }
    let bad = "dynamic_sampling = true\ndynamic_sampling_oversample = 0.5\n";
    let err = TrainConfig::from_str(bad, Format::Toml, "bad.toml", &[]).unwrap_err();
    let err = format!("{err:#}");
    assert!(
        err.contains("dynamic_sampling_oversample") && err.contains(">= 1"),
        "{err}"
    );
}

/// `metric_for_best_model`: the best checkpoint is recorded in the trainer state, survives
/// `save_total_limit`, and is what a run directory stands for in `grpo export` / `eval`.
#[test]
fn the_best_checkpoint_is_kept_and_named() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    tiny_model(&model);
    let out = tmp.path().join("run");
    // A lower completion length is "better" here: a metric that changes from step to step.
    let extra = "save_total_limit = 1\nmetric_for_best_model = \"completions/mean_length\"\n\
                 greater_is_better = false\nload_best_model_at_end = true";
    let cfg = config_with(&model, &out, extra, &["--save_steps=1", "--eval_steps=1"]);
    let o = train(&cfg, &RunControl::default()).unwrap();
    let lens: Vec<f64> = metrics(&out)
        .iter()
        .filter_map(|m| m["completions/mean_length"].as_f64())
        .collect();
    assert_eq!(lens.len(), 4);
    let best_i = (0..4)
        .min_by(|&a, &b| lens[a].partial_cmp(&lens[b]).unwrap().then(a.cmp(&b)))
        .unwrap();
    let best = out.join(format!("checkpoint-{}", best_i + 1));
    assert_eq!(o.best_checkpoint.as_deref(), Some(best.as_path()));
    assert!(best.is_dir(), "the best survives save_total_limit = 1");
    assert!(out.join("checkpoint-4").is_dir(), "and so does the newest");
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("checkpoint-4/trainer_state.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(state["best_model_checkpoint"], best.display().to_string());
    assert_eq!(state["best_metric"].as_f64(), Some(lens[best_i]));
    assert_eq!(grpo::checkpoint::resolve_run_dir(&out).unwrap(), best);
}

/// A `trl grpo --config` YAML, written as TRL's docs write one (script, model and training
/// arguments in one file), trains; the keys grpo cannot honour are listed, not refused.
#[test]
fn a_trl_grpo_yaml_trains() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    tiny_model(&model);
    // A dataset directory laid out as the hub lays one out: data/<split>-*.parquet would do too.
    let ds = tmp.path().join("my-dataset");
    std::fs::create_dir_all(&ds).unwrap();
    let rows: Vec<String> = (0..8)
        .map(|i| {
            format!(
                "{{\"prompt\": \"What is {i} + 1?\", \"answer\": \"{}\"}}",
                i + 1
            )
        })
        .collect();
    std::fs::write(ds.join("train.jsonl"), rows.join("\n")).unwrap();
    std::fs::write(ds.join("test.jsonl"), rows[..3].join("\n")).unwrap();
    let out = tmp.path().join("out");
    let yaml = format!(
        "# Model arguments\nmodel_name_or_path: {}\nmodel_revision: main\ntorch_dtype: bfloat16\n\
         attn_implementation: flash_attention_2\ntrust_remote_code: false\nuse_peft: true\n\
         lora_r: 8\nlora_alpha: 16\nlora_target_modules: all-linear\nload_in_4bit: false\n\
         # Script arguments\ndataset_name: {}\ndataset_train_split: train\ndataset_test_split: test\n\
         # Training arguments\noutput_dir: {}\nlearning_rate: 1.0e-05\nlr_scheduler_type: cosine\n\
         warmup_ratio: 0.1\nper_device_train_batch_size: 4\nnum_generations: 4\n\
         max_completion_length: 6\nmax_steps: 2\nlogging_steps: 1\nsave_strategy: \"no\"\n\
         save_steps: 2\nbf16: true\ngradient_checkpointing: true\nreport_to: none\nseed: 42\n\
         resume_from_checkpoint: false\nuse_vllm: false\n",
        model.display(),
        ds.display(),
        out.display()
    );
    let cfg = TrainConfig::from_str(&yaml, Format::Yaml, "trl.yaml", &[]).unwrap();
    assert_eq!(
        cfg.data.train_file.as_deref(),
        Some(ds.join("train.jsonl").as_path())
    );
    assert_eq!(
        cfg.data.eval_file.as_deref(),
        Some(ds.join("test.jsonl").as_path())
    );
    assert!(cfg.logging.report_to.is_empty() && !cfg.resume_from_checkpoint);
    // TRL's bf16 = true (and torch_dtype: bfloat16) is dtype = auto on the CPU, not ignored.
    assert_eq!(cfg.run.dtype, grpo::config::DTypeOpt::Auto);
    assert!(!cfg.ignored_keys.iter().any(|i| i == "bf16"));
    for k in ["attn_implementation", "trust_remote_code", "use_vllm"] {
        assert!(
            cfg.ignored_keys.iter().any(|i| i == k),
            "{k}: {:?}",
            cfg.ignored_keys
        );
        assert!(!grpo::config::ignore_reason(k).is_empty());
    }
    let o = train(&cfg, &RunControl::default()).unwrap();
    assert_eq!(o.steps, 2);
    // TRL's save_strategy "no" is honoured (issue 33; it was ignored and a checkpoint written).
    assert!(!out.join("checkpoint-2").exists());
    assert!(o.last_checkpoint.is_none());

    // What grpo cannot do is a clear error naming the key.
    for (from, to, want) in [
        (
            "model_revision: main",
            "model_revision: v1.0",
            "download the revision",
        ),
        ("use_peft: true", "use_peft: true\nuse_dora: true", "DoRA"),
        (
            "resume_from_checkpoint: false",
            "resume_from_checkpoint: some/dir",
            "--resume",
        ),
    ] {
        let e = TrainConfig::from_str(&yaml.replace(from, to), Format::Yaml, "t", &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains(want), "{e}");
    }
    let e = TrainConfig::from_str("dataset_name: trl-lib/tldr\n", Format::Yaml, "t", &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("dataset_name") && e.contains("download"), "{e}");
    let c = TrainConfig::from_str(
        &yaml.replace("load_in_4bit: false", "load_in_4bit: true"),
        Format::Yaml,
        "t",
        &[],
    )
    .unwrap();
    assert!(c.ignored_keys.iter().any(|k| k == "load_in_4bit"));
    assert_eq!(
        c.lora.base_quantization,
        Some(grpo_models::models::QuantType::Nf4)
    );
}

/// An HTTP endpoint that answers every request with an empty 200 (so every reward it is asked for
/// is missing): enough for runs that need an endpoint that is up. Returns `http://ADDR`.
fn unscoring_endpoint() -> String {
    use std::io::{BufRead, BufReader, Read, Write};
    static URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    URL.get_or_init(|| {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let mut r = BufReader::new(conn.try_clone().unwrap());
                let mut len = 0usize;
                loop {
                    let mut h = String::new();
                    if r.read_line(&mut h).unwrap_or(0) == 0 || h.trim().is_empty() {
                        break;
                    }
                    if let Some((k, v)) = h.split_once(':') {
                        if k.eq_ignore_ascii_case("content-length") {
                            len = v.trim().parse().unwrap_or(0);
                        }
                    }
                }
                let mut body = vec![0; len];
                let _ = r.read_exact(&mut body);
                let mut w = conn;
                let _ = write!(
                    w,
                    "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}"
                );
            }
        });
        url
    })
    .clone()
}

/// A planted secret (a reward's header and env values) appears in no file a run writes: config.toml,
/// the checkpoint, metrics, completions, the logs (issue 34).
#[test]
fn no_file_a_run_writes_holds_a_planted_secret() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    tiny_model(&model);
    let out = tmp.path().join("out");
    let text = format!(
        "model = {:?}\noutput_dir = {:?}\nnum_generations = 4\nper_device_train_batch_size = 4\n\
         max_completion_length = 4\nmax_steps = 1\nsave_steps = 1\neval_steps = 0\n\
         report_to = [\"tensorboard\"]\n[task]\ntrain_size = 8\neval_size = 2\n\
         [[rewards]]\nkind = \"format\"\nname = \"has_s\"\npattern = \"s\"\n\
         [[rewards]]\nkind = \"http\"\nname = \"judge\"\nurl = \"{}/score\"\n\
         headers = {{ Authorization = \"Bearer planted-secret-1\" }}\n\
         [[rewards]]\nkind = \"command\"\nname = \"cmd\"\ncommand = [\"sh\", \"-c\", \"cat > /dev/null\"]\n\
         timeout_s = 1\nenv = {{ API_KEY = \"planted-secret-2\" }}\n",
        model.display().to_string(),
        out.display().to_string(),
        unscoring_endpoint(),
    );
    let cfg = TrainConfig::from_str(&text, Format::Toml, "t", &[]).unwrap();
    assert_eq!(train(&cfg, &RunControl::default()).unwrap().steps, 1);
    // The same run against an endpoint nobody listens on fails before training (issue 34),
    // naming the reward and the address.
    let dead = text.replace(&unscoring_endpoint(), "http://127.0.0.1:9");
    let dead_out = tmp.path().join("dead");
    let dead = dead.replace(
        &format!("{:?}", out.display().to_string()),
        &format!("{:?}", dead_out.display().to_string()),
    );
    let cfg = TrainConfig::from_str(&dead, Format::Toml, "t", &[]).unwrap();
    let e = train(&cfg, &RunControl::default()).unwrap_err().to_string();
    assert!(
        e.contains("`judge`")
            && e.contains("http://127.0.0.1:9/score")
            && e.contains("does not answer"),
        "{e}"
    );
    assert!(!dead_out.join("metrics.jsonl").exists());
    let mut files = vec![];
    let mut dirs = vec![out.clone()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            match e.path().is_dir() {
                true => dirs.push(e.path()),
                false => files.push(e.path()),
            }
        }
    }
    assert!(
        files
            .iter()
            .any(|f| f.ends_with("checkpoint-1/config.toml")),
        "{files:?}"
    );
    for f in &files {
        let bytes = std::fs::read(f).unwrap();
        let text = String::from_utf8_lossy(&bytes);
        assert!(
            !text.contains("planted-secret"),
            "{} holds a secret",
            f.display()
        );
    }
}

/// A reward missing for every completion (here: answer_match on prompts without answers) is
/// warned about each round and stops the run after max_bad_steps rounds in a row, naming the
/// reward, instead of training on nothing (issue 34).
#[test]
fn a_reward_missing_everywhere_stops_the_run() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    tiny_model(&model);
    let data = tmp.path().join("train.jsonl");
    let rows: Vec<String> = (0..8)
        .map(|i| format!("{{\"prompt\": \"{i} + 1 =\"}}"))
        .collect();
    std::fs::write(&data, rows.join("\n")).unwrap();
    let text = format!(
        "model = {:?}\ntrain_file = {:?}\noutput_dir = {:?}\nnum_generations = 4\n\
         per_device_train_batch_size = 4\nmax_completion_length = 4\nmax_steps = 6\n\
         max_bad_steps = 2\nsave_steps = 0\neval_steps = 0\nreport_to = \"none\"\n\
         [[rewards]]\nkind = \"answer_match\"\nname = \"correct\"\n\
         [[rewards]]\nkind = \"format\"\nname = \"has_s\"\npattern = \"s\"\n",
        model.display().to_string(),
        data.display().to_string(),
        tmp.path().join("out").display().to_string()
    );
    let cfg = TrainConfig::from_str(&text, Format::Toml, "t", &[]).unwrap();
    let e = train(&cfg, &RunControl::default()).unwrap_err().to_string();
    assert!(
        e.contains("`correct`") && e.contains("every completion") && e.contains("2 rounds"),
        "{e}"
    );
    // One round was trained before the second all-missing round stopped it.
    let m = std::fs::read_to_string(tmp.path().join("out/metrics.jsonl")).unwrap();
    assert_eq!(
        m.lines().filter(|l| l.contains("\"loss\"")).count(),
        1,
        "{m}"
    );
}

/// Each example config of a seed's scenario (examples/configs/) trains on a tiny model, with the
/// fixture BERT classifier standing in for the toxicity classifier.
#[test]
fn the_seed_example_configs_train() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    tiny_model(&model);
    let prompts = tmp.path().join("toxic_prompts.jsonl");
    std::fs::write(
        &prompts,
        "{\"prompt\": \"You are such a\"}\n{\"prompt\": \"I really think that\"}\n",
    )
    .unwrap();
    let classifier = fixtures().join("rewards/bert");
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/configs");
    for name in ["toxicity", "composite", "math_qlora"] {
        let text = std::fs::read_to_string(examples.join(format!("{name}.toml")))
            .unwrap()
            .replace(
                "\"toxicity-classifier/\"",
                &format!("{:?}", classifier.display().to_string()),
            )
            .replace(
                "\"toxic_prompts.jsonl\"",
                &format!("{:?}", prompts.display().to_string()),
            );
        let out = tmp.path().join(name);
        let overrides: Vec<String> = [
            format!("--model={}", model.display()),
            format!("--output_dir={}", out.display()),
            "--max_steps=1".into(),
            "--per_device_train_batch_size=8".into(),
            "--num_generations=8".into(),
            "--max_completion_length=6".into(),
            "--eval_num_samples=2".into(),
            "--eval_k=1,2".into(),
            "--report_to=none".into(),
            "--wandb_log=false".into(),
            "--task.train_size=8".into(),
            "--task.eval_size=2".into(),
            "--threads=2".into(),
        ]
        .into();
        let cfg = TrainConfig::from_str(&text, Format::Toml, name, &overrides)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        if name == "toxicity" {
            // What seed 000 turns on (issue 34).
            assert_eq!(cfg.loss.reward_std_floor, Some(0.1));
            assert!(cfg.loss.normalize_advantages_batch);
            assert_eq!(cfg.loss.advantage_epsilon, 1e-8);
            assert_eq!(cfg.loss.entropy_coef, 0.01);
            assert!(cfg.loss.kl_target.is_some() && cfg.loss.kl_coef > 0.0);
        }
        let o = train(&cfg, &RunControl::default()).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(o.steps, 1, "{name}");
        let m = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
        let want = match name {
            "toxicity" => "rewards/toxicity/mean",
            "composite" => "rewards/composite/mean",
            _ => "rewards/correctness/mean",
        };
        assert!(m.contains(want), "{name}: {m}");
    }
}

/// TRL 1.16's newer options through the trainer, from a TRL-style YAML: the vespo loss with the
/// off-policy sequence mask, the high-entropy token mask and adaptive entropy control, TRL's
/// reward_funcs (accuracy on the `solution` column), the seeds' gen_batch_size, keys set to null;
/// the controller's state resumes exactly.
#[test]
fn trl_1_16_options_train_and_resume_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    tiny_model(&model);
    let data = tmp.path().join("train.jsonl");
    let rows: Vec<String> = (0..8)
        .map(|i| format!("{{\"prompt\": \"{i} + 1 =\", \"solution\": \"{}\"}}", i + 1))
        .collect();
    std::fs::write(&data, rows.join("\n")).unwrap();
    let yaml = |out: &Path| {
        format!(
            "model_name_or_path: {}\ndataset_name: {}\noutput_dir: {}\nloss_type: vespo\n\
             num_iterations: 2\nper_device_train_batch_size: 4\n\
             num_generations: 4\nmax_completion_length: 6\nlearning_rate: 1.0e-3\nmax_steps: 4\n\
             save_steps: 2\nbeta: 0.04\ntop_entropy_quantile: 0.5\noff_policy_mask_threshold: 0.0\n\
             use_adaptive_entropy: true\nentropy_coef: 0.01\nentropy_target: 100.0\n\
             entropy_coef_delta: 0.005\ngen_batch_size: 4\nreport_to: none\n\
             reward_funcs: [accuracy_reward, think_format_reward, get_soft_overlong_punishment]\n\
             rewards: [{{kind: format, name: has_s, pattern: s}}]\n\
             eval_steps: null\ndeepspeed: null\nhub_token: null\noptim: adamw_torch_fused\n\
             seed: 7\nthreads: 2\n",
            model.display(),
            data.display(),
            out.display()
        )
    };
    let load =
        |out: &Path| TrainConfig::from_str(&yaml(out), Format::Yaml, "trl.yaml", &[]).unwrap();
    let full = tmp.path().join("full");
    let cfg = load(&full);
    assert_eq!(cfg.data.answer_field, "solution");
    assert_eq!(cfg.generation.sampling_batch_size, Some(4));
    let names: Vec<&str> = cfg.rewards.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "accuracy_reward",
            "think_format_reward",
            "soft_overlong_punishment_reward",
            "has_s"
        ]
    );
    assert_eq!(train(&cfg, &RunControl::default()).unwrap().steps, 4);
    let m = metrics(&full);
    let coefs: Vec<f64> = m
        .iter()
        .filter_map(|r| r["entropy_coef"].as_f64())
        .collect();
    // Two optimizer steps per round; entropy is far below the target: +0.005 per step.
    assert_eq!(coefs.len(), 2, "{m:?}");
    assert!(
        (coefs[0] - 0.02).abs() < 1e-9 && (coefs[1] - 0.03).abs() < 1e-9,
        "{coefs:?}"
    );
    assert!(
        m[0].get("rewards/accuracy_reward/mean").is_some(),
        "{:?}",
        m[0]
    );
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(full.join("checkpoint-2/trainer_state.json")).unwrap(),
    )
    .unwrap();
    assert!(state.to_string().contains("adaptive_entropy"), "{state}");

    // Killed after the first round, resumed: the same weights and metrics.
    let part = tmp.path().join("part");
    let ctl = RunControl {
        max_rounds_this_run: Some(1),
        ..Default::default()
    };
    assert_eq!(train(&load(&part), &ctl).unwrap().steps, 2);
    let resume = RunControl {
        resume: true,
        ..Default::default()
    };
    assert_eq!(train(&load(&part), &resume).unwrap().steps, 4);
    let (a, b) = (
        weights(&full.join("checkpoint-4")),
        weights(&part.join("checkpoint-4")),
    );
    for (k, v) in &a {
        assert_eq!(v, &b[k], "{k} differs after resume");
    }
    assert_eq!(metrics(&full), metrics(&part));
}

/// `dtype = bf16`: mixed-precision training (bf16 sampling, reference and training forward
/// over f32 master parameters) trains, keeps f32 parameters and AdamW moments in its
/// checkpoints, and resumes exactly: on the CPU with AVX-512 grpo's bf16 matmuls
/// (`Compute::CpuMixed`), and on the portable path (the candle ops a GPU runs) in the rerun.
#[test]
fn bf16_mixed_precision_trains_and_resumes_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    tiny_model(&model);
    // Gradient checkpointing recomputes the bf16 blocks (any device and dtype). Rewards with a
    // spread (letters in the random model's text) give the update a signal.
    let extra = "beta = 0.04\ndtype = \"bf16\"\ngradient_checkpointing = true\n\
                 [[rewards]]\nkind = \"format\"\npattern = \"e\"\nname = \"has_e\"\n\
                 [[rewards]]\nkind = \"format\"\npattern = \"a\"\nname = \"has_a\"\n\
                 [[rewards]]\nkind = \"format\"\npattern = \"o\"\nname = \"has_o\"\n";
    let full = tmp.path().join("full");
    let out = train(&config(&model, &full, extra), &RunControl::default()).unwrap();
    assert_eq!(out.steps, 4);
    let part = tmp.path().join("part");
    let ctl = RunControl {
        max_rounds_this_run: Some(2),
        ..Default::default()
    };
    train(&config(&model, &part, extra), &ctl).unwrap();
    let resume = RunControl {
        resume: true,
        ..Default::default()
    };
    train(&config(&model, &part, extra), &resume).unwrap();
    let (a, b) = (
        weights(&full.join("checkpoint-4")),
        weights(&part.join("checkpoint-4")),
    );
    assert_eq!(a, b, "bf16 run after resume");
    assert_eq!(metrics(&full), metrics(&part));
    let base = weights(&model);
    assert!(base.iter().any(|(k, v)| v != &a[k]), "weights changed");
    for dir in [full.join("checkpoint-4")] {
        for f in ["model.safetensors", "optimizer.safetensors"] {
            let st =
                candle_core::safetensors::load(dir.join(f), &candle_core::Device::Cpu).unwrap();
            assert!(
                st.values().all(|t| t.dtype() == candle_core::DType::F32),
                "{f} is f32"
            );
        }
    }
    for l in metrics(&full).iter().filter(|l| l.get("loss").is_some()) {
        for k in ["loss", "kl", "grad_norm"] {
            let v = l[k].as_f64().unwrap();
            assert!(v.is_finite(), "{k} = {v}");
        }
    }
}

/// TRL's `save_only_model` writes checkpoints without the AdamW state, which `--resume` then
/// refuses with the reason; `save_strategy = "no"` writes none.
#[test]
fn save_only_model_and_save_strategy_no() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    tiny_model(&model);
    let out = tmp.path().join("only-model");
    let cfg = config(&model, &out, "save_only_model = true");
    train(&cfg, &RunControl::default()).unwrap();
    let ck = out.join("checkpoint-4");
    assert!(ck.join("model.safetensors").is_file());
    assert!(ck.join("trainer_state.json").is_file());
    assert!(!ck.join("optimizer.safetensors").exists());
    let e = train(
        &config_with(&model, &out, "save_only_model = true", &["--max_steps=6"]),
        &RunControl {
            resume: true,
            ..Default::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("save_only_model") && e.contains("checkpoint-4"),
        "{e}"
    );

    let out = tmp.path().join("no-save");
    let cfg = config(&model, &out, "save_strategy = \"no\"");
    let outcome = train(&cfg, &RunControl::default()).unwrap();
    assert_eq!(outcome.steps, 4);
    assert!(outcome.last_checkpoint.is_none());
    let dirs: Vec<_> = std::fs::read_dir(&out)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("checkpoint-"))
        .collect();
    assert!(dirs.is_empty(), "{dirs:?}");
}

/// The bf16 tests again on the portable path (`GRPO_KERNELS=portable`: candle's bf16 ops, the
/// path a GPU runs), which CPU mixed precision replaces in this process.
#[test]
fn bf16_tests_pass_on_the_portable_path() {
    rerun::rerun_only(
        &[("GRPO_KERNELS", "portable")],
        &[
            "gradient_checkpointing_leaves_the_update_unchanged",
            "bf16_mixed_precision_trains_and_resumes_exactly",
        ],
        2,
    );
}

/// `temperature_warmup_steps`: the rounds sample at temperatures moving linearly from
/// `temperature_warmup_start` to `temperature` (logged as `sampling/temperature`), after
/// `temperature_warmup_hold_steps` at the start, and a warm-up that starts at `temperature` trains
/// exactly as no warm-up does.
#[test]
fn temperature_warmup_moves_the_sampling_temperature() {
    let warm = two_steps(
        "temperature = 1.0\ntemperature_warmup_steps = 2\ntemperature_warmup_start = 0.5",
    );
    let temps: Vec<f64> = warm
        .iter()
        .map(|l| l["sampling/temperature"].as_f64().unwrap())
        .collect();
    assert_eq!(temps, vec![0.5, 0.75]);
    // A hold of one step keeps the first two rounds at the start.
    let held = two_steps(
        "temperature = 1.0\ntemperature_warmup_steps = 2\ntemperature_warmup_start = 0.5\n\
         temperature_warmup_hold_steps = 1",
    );
    let temps: Vec<f64> = held
        .iter()
        .map(|l| l["sampling/temperature"].as_f64().unwrap())
        .collect();
    assert_eq!(temps, vec![0.5, 0.5]);
    let plain = two_steps("temperature = 1.0");
    let flat = two_steps(
        "temperature = 1.0\ntemperature_warmup_steps = 2\ntemperature_warmup_start = 1.0",
    );
    assert!(plain
        .iter()
        .all(|l| l.get("sampling/temperature").is_none()));
    for (a, b) in plain.iter().zip(&flat) {
        let mut b = b.clone();
        b.as_object_mut().unwrap().remove("sampling/temperature");
        assert_eq!(a, &b);
    }
    assert_ne!(
        warm[0]["entropy"], plain[0]["entropy"],
        "a colder round samples and scores under another distribution"
    );
}

/// `dtype = "auto"` trains exactly as the dtype it resolves to: f32 on a CPU without bf16
/// products in grpo's kernels, f32 or bf16 (by the CPU's measured rates) where it has them.
#[test]
fn auto_dtype_trains_as_the_dtype_it_picks() {
    let auto = two_steps("dtype = \"auto\"");
    let f32 = two_steps("dtype = \"f32\"");
    let isa = grpo_models::kernels::Isa::active();
    if isa < grpo_models::kernels::Isa::Avx512Bf16 {
        assert_eq!(
            auto, f32,
            "no bf16 products on this CPU ({isa}): auto is f32"
        );
        return;
    }
    let bf16 = two_steps("dtype = \"bf16\"");
    assert_ne!(f32, bf16, "the two dtypes train differently");
    assert!(auto == f32 || auto == bf16, "auto trains as f32 or as bf16");
}

/// No Python here: a skip, or under `GRPO_REQUIRE_PYTHON=1` (set by `.ci/run`) a failure.
fn no_python(why: &str) {
    assert!(
        std::env::var("GRPO_REQUIRE_PYTHON").map_or(true, |v| v != "1"),
        "GRPO_REQUIRE_PYTHON=1 but {why}"
    );
    eprintln!("skipped: {why}");
}
