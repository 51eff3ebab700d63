//! Rewards in the loop: the judge, early scoring, classifier and command rewards, missing
//! rewards, dynamic sampling.

use super::*;

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
