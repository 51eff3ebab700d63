//! Evaluation in the loop: pass@k on the built-in task, and the eval steps' logs.

use super::*;

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
