//! The report's tests: synthetic runs written to a temporary directory, reported, and the page
//! and plots checked.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::html::duration;
use super::plots::{axis_number, pass_at_k_keys, Line, Series, HEIGHT, WIDTH};
use super::*;
use super::{num, truncate_middle};

/// A synthetic run of `steps` steps with every metric the trainer logs, eval rows (one before
/// training on a row of its own), nulls, completions and an eval file.
fn synthetic_run(dir: &Path, steps: u64) {
    let mut metrics = String::new();
    metrics.push_str(
        "{\"step\":0,\"time\":1000.0,\"eval/accuracy\":0.1,\"eval/pass@1\":0.1,\"eval/pass@4\":0.25,\
         \"eval/pass@8\":0.3,\"eval/mean_accuracy\":0.12,\"eval/reward/answer_match\":0.1,\
         \"eval/reward/format\":0.05}\n",
    );
    for s in 1..=steps {
        let t = s as f64 / steps as f64;
        let mut o = serde_json::json!({
            "step": s, "time": 1000.0 + 12.0 * s as f64,
            "reward": 0.2 + 0.6 * t, "reward_std": 0.3 - 0.1 * t,
            "rewards/answer_match/mean": 0.1 + 0.7 * t, "rewards/answer_match/std": 0.3,
            "rewards/format/mean": 0.5 + 0.4 * t, "rewards/format/std": 0.2,
            "kl": 0.001 * s as f64, "loss": 0.01 - 0.005 * t, "pg_loss": 0.008 - 0.004 * t,
            "entropy": 1.2 - 0.5 * t,
            "completions/mean_length": 120.0 - 40.0 * t,
            "completions/min_length": 30.0, "completions/max_length": 256.0,
            "clip_ratio/low_mean": 0.001 * t, "clip_ratio/high_mean": 0.002 * t,
            "clip_ratio/region_mean": 0.003 * t, "grad_norm": 0.5 + t,
            "learning_rate": 1e-6 * (1.0 - t),
            "time/generate": 6.0, "time/score": 0.5, "time/reference": 1.5,
            "time/update": 3.0, "time/step": 11.5,
        });
        if s == 2 {
            // Non-finite values are written as null.
            o["kl"] = Value::Null;
            o["reward_std"] = Value::Null;
        }
        if s % 5 == 0 {
            for (k, v) in [
                ("eval/accuracy", 0.1 + 0.5 * t),
                ("eval/pass@1", 0.1 + 0.5 * t),
                ("eval/pass@4", 0.25 + 0.5 * t),
                ("eval/pass@8", 0.3 + 0.5 * t),
                ("eval/mean_accuracy", 0.12 + 0.5 * t),
                ("eval/reward/answer_match", 0.1 + 0.5 * t),
                ("eval/reward/format", 0.05 + 0.8 * t),
            ] {
                o[k] = v.into();
            }
        }
        metrics.push_str(&format!("{o}\n"));
    }
    std::fs::write(dir.join("metrics.jsonl"), metrics).unwrap();

    let mut comps = String::new();
    for s in 1..=steps {
        for i in 0..4 {
            let r = (s as f64 * 7.0 + i as f64 * 3.0) % 10.0 / 10.0;
            let o = serde_json::json!({
                "step": s, "prompt": format!("What is {s} + {i}? Say <b>it</b> & stop"),
                "completion": format!("<think>s{s} i{i}</think><answer>{}</answer>", s + i),
                "stop_reason": "eos",
                "rewards": {"answer_match": r, "format": if i == 3 { Value::Null } else { 1.0.into() }},
                "reward": r, "advantage": r - 0.5,
            });
            comps.push_str(&format!("{o}\n"));
        }
    }
    // A completion with the best reward whose text needs escaping.
    comps.push_str(
        "{\"step\":3,\"prompt\":\"p\",\"completion\":\"BEST <script>alert(1)</script> & more\",\
         \"stop_reason\":\"eos\",\"rewards\":{\"answer_match\":1.0},\"reward\":5.0,\"advantage\":1.5}\n\
         {\"step\":3,\"prompt\":\"p\",\"completion\":\"WORST \\\"quoted\\\"\",\"stop_reason\":\"length\",\
         \"rewards\":{\"answer_match\":0.0},\"reward\":-5.0,\"advantage\":-1.5}\n\
         {\"step\":3,\"prompt\":\"p\",\"completion\":\"unscored\",\"stop_reason\":\"eos\",\
         \"rewards\":{\"answer_match\":null},\"reward\":null,\"advantage\":0.0}\n",
    );
    std::fs::write(dir.join("completions.jsonl"), comps).unwrap();

    std::fs::create_dir_all(dir.join("eval")).unwrap();
    std::fs::write(
        dir.join("eval/step-5.jsonl"),
        "{\"prompt\":\"2+2?\",\"answer\":4,\"completion\":\"<answer>4</answer>\",\
         \"rewards\":{\"answer_match\":1.0,\"format\":1.0}}\n\
         {\"prompt\":\"3+3?\",\"answer\":\"6\",\"completion\":\"seven\",\
         \"rewards\":{\"answer_match\":0.0,\"format\":null}}\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("config.toml"),
        "learning_rate = 1e-6\nsystem_prompt = \"<think>\"\n",
    )
    .unwrap();
}

const ALL_PLOTS: [&str; 12] = [
    "reward.png",
    "rewards_per_function.png",
    "eval.png",
    "eval_rewards.png",
    "kl.png",
    "loss.png",
    "entropy.png",
    "length.png",
    "clip_ratio.png",
    "grad_norm.png",
    "learning_rate.png",
    "time.png",
];

/// Decodes a plot and checks it is a full-size picture with more than one colour.
fn check_png(path: &Path) {
    let bytes = std::fs::read(path).unwrap();
    assert!(
        bytes.starts_with(b"\x89PNG\r\n\x1a\n"),
        "{}",
        path.display()
    );
    assert!(
        bytes.len() > 8_000,
        "{} is {} bytes",
        path.display(),
        bytes.len()
    );
    let img = image::load_from_memory(&bytes).unwrap().to_rgb8();
    assert_eq!(img.dimensions(), (WIDTH, HEIGHT));
    let colours: BTreeSet<[u8; 3]> = img.pixels().map(|p| p.0).collect();
    assert!(
        colours.len() > 20,
        "{}: {} colours",
        path.display(),
        colours.len()
    );
}

#[test]
fn report_writes_html_and_every_plot() {
    let dir = tempfile::tempdir().unwrap();
    synthetic_run(dir.path(), 30);
    let s = write_report(dir.path()).unwrap();
    assert_eq!(s.html, dir.path().join("report.html"));
    assert!(s.skipped.is_empty(), "{:?}", s.skipped);
    assert!(s.warnings.is_empty(), "{:?}", s.warnings);
    let names: Vec<String> = s
        .plots
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ALL_PLOTS);
    for p in &s.plots {
        assert_eq!(p.parent().unwrap(), dir.path().join("plots"));
        check_png(p);
    }
    let html = std::fs::read_to_string(&s.html).unwrap();
    assert_eq!(html.matches("src=\"data:image/png;base64,").count(), 12);
    // Best and worst completions, escaped.
    assert!(html.contains("BEST &lt;script&gt;alert(1)&lt;/script&gt; &amp; more"));
    assert!(!html.contains("<script>"));
    assert!(html.contains("WORST &quot;quoted&quot;"));
    assert!(html.contains("Say &lt;b&gt;it&lt;/b&gt; &amp; stop"));
    assert!(html.contains("Best 5 by reward") && html.contains("Worst 5 by reward"));
    // Summary: steps, last eval, times; config collapsed; eval answers.
    assert!(html.contains("30 (steps 1 to 30)"), "{html}");
    assert!(html.contains("eval/pass@8 (step 30)"));
    assert!(html.contains("training time (sum of time/step)</th><td class=\"n\">5m 45s"));
    assert!(html.contains("123 (1 without a reward)"));
    assert!(html.contains("<details><summary><code>config.toml</code>"));
    assert!(html.contains("system_prompt = &quot;&lt;think&gt;&quot;"));
    assert!(html.contains("step 5 (2 answers)"));
    assert!(html.contains("&lt;answer&gt;4&lt;/answer&gt;"));
}

#[test]
fn a_fill_in_run_gets_its_fill_panel() {
    let dir = tempfile::tempdir().unwrap();
    let rows: Vec<String> = (1..=20)
        .map(|i| {
            let x = i as f64 / 20.0;
            serde_json::json!({"step": i, "reward": x, "fill/masked_positions": 3.0,
                               "fill/accuracy": 0.5 + x / 3.0, "fill/judge_score": 0.6 + x / 4.0})
            .to_string()
        })
        .collect();
    std::fs::write(dir.path().join("metrics.jsonl"), rows.join("\n") + "\n").unwrap();
    let s = write_report(dir.path()).unwrap();
    let fill = dir.path().join("plots/fill.png");
    assert!(s.plots.contains(&fill), "{:?}", s.plots);
    check_png(&fill);
    let html = std::fs::read_to_string(&s.html).unwrap();
    assert!(html.contains("judge score and fill accuracy"));
}

#[test]
fn completion_text_is_escaped() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("metrics.jsonl"),
        "{\"step\":1,\"reward\":1.0}\n",
    )
    .unwrap();
    let text = "<script>alert(\"x\")</script> & 'y'";
    let sample = serde_json::json!({
        "step": 1, "prompt": text, "completion": text, "stop_reason": text,
        "rewards": {text: 1.0}, "reward": 1.0, "advantage": 0.0,
    });
    std::fs::write(dir.path().join("completions.jsonl"), format!("{sample}\n")).unwrap();
    let answer = serde_json::json!({
        "prompt": text, "answer": text, "completion": text, "rewards": {text: 1.0},
    });
    std::fs::create_dir(dir.path().join("eval")).unwrap();
    std::fs::write(dir.path().join("eval/step-1.jsonl"), format!("{answer}\n")).unwrap();
    std::fs::write(
        dir.path().join("config.toml"),
        format!("system_prompt = {text:?}\n"),
    )
    .unwrap();

    let html = std::fs::read_to_string(write_report(dir.path()).unwrap().html).unwrap();
    assert!(
        !html.contains("<script") && !html.contains("\"x\""),
        "{html}"
    );
    let escaped = "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; &#x27;y&#x27;";
    // Samples: reward name, stop reason, prompt, completion. Eval: the reward name in both
    // tables, prompt, answer, completion.
    assert_eq!(html.matches(escaped).count(), 9, "{html}");
    assert!(html.contains(
        "system_prompt = &quot;&lt;script&gt;alert(\\&quot;x\\&quot;)&lt;/script&gt; &amp; &#x27;y&#x27;&quot;"
    ));
    // A `/` is left as it is (in text and in the base64 of the plots).
    assert!(!html.contains("&#x2f;"));
}

#[test]
fn best_and_worst_do_not_overlap_in_a_small_run() {
    let mut s = Samples::default();
    for (i, r) in [0.1, 0.9, 0.5, f64::NAN, 0.3].into_iter().enumerate() {
        s.add(Sample {
            line: i + 1,
            step: Some(1),
            prompt: String::new(),
            completion: String::new(),
            stop_reason: String::new(),
            rewards: Vec::new(),
            reward: r,
            advantage: 0.0,
            episode: None,
        });
    }
    s.finish();
    let best: Vec<f64> = s.best.iter().map(|x| x.reward).collect();
    assert_eq!(best, [0.9, 0.5, 0.3, 0.1]);
    assert!(s.worst.is_empty());
    assert_eq!((s.total, s.unscored), (5, 1));
}

#[test]
fn a_missing_or_empty_metrics_file_names_it() {
    let dir = tempfile::tempdir().unwrap();
    let e = write_report(dir.path()).unwrap_err().to_string();
    assert!(
        e.contains("metrics.jsonl") && e.contains("not found"),
        "{e}"
    );
    std::fs::write(dir.path().join("metrics.jsonl"), "\n").unwrap();
    let e = write_report(dir.path()).unwrap_err().to_string();
    assert!(e.contains("metrics.jsonl") && e.contains("empty"), "{e}");
    std::fs::write(dir.path().join("metrics.jsonl"), "{\"reward\": 1}\n").unwrap();
    let e = write_report(dir.path()).unwrap_err().to_string();
    assert!(e.contains("metrics.jsonl") && e.contains("step"), "{e}");
}

#[test]
fn one_step_run_with_a_truncated_last_line_reports_with_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("metrics.jsonl"),
        "{\"step\":1,\"reward\":0.5,\"reward_std\":0.1,\"kl\":null,\"time/generate\":2.0}\n\
         {\"step\":2,\"rew",
    )
    .unwrap();
    let out = dir.path().join("out");
    let s = write_report_to(dir.path(), &out).unwrap();
    assert_eq!(s.html, out.join("report.html"));
    assert_eq!(s.warnings.len(), 1, "{:?}", s.warnings);
    assert!(
        s.warnings[0].contains("line 2 is truncated"),
        "{:?}",
        s.warnings
    );
    let names: Vec<String> = s
        .plots
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["reward.png", "time.png"]);
    for p in &s.plots {
        check_png(p);
    }
    // KL is only null: skipped, and the page says so.
    assert!(
        s.skipped.iter().any(|t| t.starts_with("KL")),
        "{:?}",
        s.skipped
    );
    let html = std::fs::read_to_string(&s.html).unwrap();
    assert!(html.contains("Not plotted, no data in <code>metrics.jsonl</code>"));
    assert!(html.contains("<code>kl</code>"));
    assert!(html.contains("line 2 is truncated"));
    assert!(html.contains("No <code>completions.jsonl</code>"));
    assert!(html.contains("No <code>config.toml</code>"));
}

#[test]
fn a_later_report_removes_plots_that_lost_their_data() {
    let dir = tempfile::tempdir().unwrap();
    synthetic_run(dir.path(), 3);
    write_report(dir.path()).unwrap();
    assert!(dir.path().join("plots/kl.png").exists());
    std::fs::write(
        dir.path().join("metrics.jsonl"),
        "{\"step\":1,\"reward\":1}\n",
    )
    .unwrap();
    write_report(dir.path()).unwrap();
    assert!(!dir.path().join("plots/kl.png").exists());
    assert!(dir.path().join("plots/reward.png").exists());
}

#[test]
fn a_null_breaks_the_line_and_an_absent_value_does_not() {
    let rows = [
        "{\"step\":1,\"kl\":0.1}",
        "{\"step\":2}",
        "{\"step\":3,\"kl\":0.3}",
        "{\"step\":4,\"kl\":null}",
        "{\"step\":5,\"kl\":0.5}",
    ];
    let m = Metrics {
        rows: rows
            .iter()
            .map(|r| Metrics::row(serde_json::from_str(r).unwrap()).unwrap())
            .collect(),
    };
    let s = Series::collect(&m, &Line::new("KL", "kl")).unwrap();
    let segs: Vec<Vec<f64>> = s
        .segments()
        .iter()
        .map(|seg| seg.iter().map(|p| p.x).collect())
        .collect();
    assert_eq!(segs, [vec![1.0, 3.0], vec![5.0]]);
}

#[test]
fn pass_at_k_is_ordered_by_k() {
    let keys: BTreeSet<&str> = ["eval/pass@16", "eval/pass@4", "eval/pass@1", "eval/pass@x"]
        .into_iter()
        .collect();
    let ks: Vec<u64> = pass_at_k_keys(&keys).into_iter().map(|(k, _)| k).collect();
    assert_eq!(ks, [1, 4, 16]);
}

#[test]
fn text_helpers() {
    assert_eq!(truncate_middle("short", 2, 2), "short");
    let long = "a".repeat(50) + &"b".repeat(50);
    assert_eq!(truncate_middle(&long, 3, 2), "aaa […95 characters…] bb");
    assert_eq!(axis_number(0.0, 1.0), "0");
    assert_eq!(axis_number(3.5e-18, 0.04), "0");
    assert_eq!(axis_number(0.25, 1.0), "0.25");
    assert_eq!(axis_number(-0.01, 0.04), "-0.01");
    assert_eq!(axis_number(12.5, 1.0), "12.5");
    assert_eq!(axis_number(2e-6, 1e-6), "2.0e-6");
    assert_eq!(duration(345.0), "5m 45s");
    assert_eq!(duration(3725.0), "1h 02m 05s");
    assert_eq!(num(f64::NAN), "–");
}

#[test]
fn health_warnings_and_the_best_checkpoint_are_shown() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("metrics.jsonl"),
        "{\"step\":1,\"reward\":1.0}\n{\"step\":2,\"reward\":1.0,\"health/low_entropy\":1.0}\n",
    )
    .unwrap();
    let row = serde_json::json!({"step": 2, "kind": "low_entropy", "message": "entropy 0.010 is below 0.05"});
    std::fs::write(dir.path().join("health.jsonl"), format!("{row}\n")).unwrap();
    for step in [1, 2] {
        let ckpt = dir.path().join(format!("checkpoint-{step}"));
        std::fs::create_dir(&ckpt).unwrap();
        let best = dir.path().join("checkpoint-1").display().to_string();
        let st = serde_json::json!({"step": step, "best_model_checkpoint": best});
        std::fs::write(ckpt.join("trainer_state.json"), st.to_string()).unwrap();
    }
    let html = std::fs::read_to_string(write_report(dir.path()).unwrap().html).unwrap();
    assert!(html.contains("<h2>Health warnings</h2>"), "{html}");
    assert!(
        html.contains("step 2: entropy 0.010 is below 0.05"),
        "{html}"
    );
    assert!(
        html.contains("<tr><th>best checkpoint</th><td class=\"n\">checkpoint-1</td></tr>"),
        "{html}"
    );
}

/// `tests/fixtures/report/agent_run`: a hand-written agent run (6 steps of `agent/*` metrics
/// after two warm-up rows; three episodes: one right, one whose tool raised on an argument full
/// of HTML, one cut by the cap after a call that did not parse).
fn agent_fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/report/agent_run")
}

const AGENT_PLOTS: [&str; 5] = [
    "agent_calls.png",
    "agent_errors.png",
    "agent_rates.png",
    "agent_tokens.png",
    "agent_tool_time.png",
];

#[test]
fn an_agent_run_shows_episodes_turn_by_turn_and_the_agent_curves() {
    let out = tempfile::tempdir().unwrap();
    let s = write_report_to(&agent_fixture(), out.path()).unwrap();
    assert!(s.warnings.is_empty(), "{:?}", s.warnings);
    for p in AGENT_PLOTS {
        let path = out.path().join("plots").join(p);
        assert!(s.plots.contains(&path), "{p} not in {:?}", s.plots);
        check_png(&path);
    }
    let html = std::fs::read_to_string(&s.html).unwrap();
    // The agent section: its table, then its plots, before the episodes.
    let section = html
        .find("<h2>Agent: tool use</h2>")
        .expect("an agent section");
    let episodes = html.find("<h2>Sample episodes</h2>").unwrap();
    assert!(section < episodes);
    let agent_part = &html[section..episodes];
    assert_eq!(agent_part.matches("<img ").count(), 5, "{agent_part}");
    assert!(agent_part.contains(
        "<th>tool calls per episode</th><td class=\"n\">0.600</td><td class=\"n\">1.100</td>"
    ));
    assert!(agent_part.contains("<th>share of episodes cut by a cap</th>"));
    // Warm-up rows are not training steps.
    assert!(html.contains("6 (steps 1 to 6)"), "{html}");

    // Each episode: the prompt's messages, then the turns, in order, labelled by role.
    assert!(html.contains("<th>episode, turn by turn</th>"));
    // The best episode comes first (three episodes: all among the best, none among the worst).
    assert!(!html.contains("<h3>Worst"));
    let best = &html[episodes..];
    let order = [
        "<div class=\"msg system\"><div class=\"role\">system</div><div class=\"content\">You are a careful calculator agent.</div>",
        "<div class=\"msg user\"><div class=\"role\">user</div><div class=\"content\">What is 123 * 456?</div>",
        "<div class=\"msg assistant\"><div class=\"role\">assistant</div>",
        "<div class=\"call\">&rarr; <code>calculator(expression=&quot;123 * 456&quot;)</code></div>",
        "<div class=\"msg tool\"><div class=\"role\">tool · calculator</div><div class=\"content\">56088</div>",
        "<div class=\"content\">The answer is 56088.</div>",
    ];
    let at: Vec<usize> = order
        .iter()
        .map(|b| best.find(b).unwrap_or_else(|| panic!("{b} not in {best}")))
        .collect();
    assert!(at.windows(2).all(|w| w[0] < w[1]), "{at:?}");

    // The tool's error is marked and the episode's error kinds and cut are shown.
    assert!(html.contains(
        "<div class=\"msg tool error\"><div class=\"role\">tool · calculator (error)</div>\
         <div class=\"content\">Error: ValueError: invalid syntax in &#x27;1 &lt; 2 &amp;&amp; &lt;script&gt;&#x27;</div>"
    ), "{html}");
    assert!(html.contains("<div class=\"warn\">tool errors: raised</div>"));
    assert!(html.contains("<div class=\"warn\">tool errors: parse</div>"));
    assert!(
        html.contains("<div class=\"warn\">cut by <code>max_tool_calling_iterations</code></div>")
    );
    assert!(html.contains("<div class=\"msg tool error\"><div class=\"role\">tool (error)</div>"));
    // Model output is escaped everywhere: the call's arguments, the turns, the prompt, the raw text.
    assert!(html.contains(
        "<code>calculator(expression=&quot;1 &lt; 2 &amp;&amp; &lt;script&gt;alert(1)&lt;/script&gt;&quot;)</code>"
    ));
    assert!(html.contains("I don&#x27;t know &lt;em&gt;sorry&lt;/em&gt;"));
    assert!(html.contains("Answer &lt;b&gt;yes&lt;/b&gt; or &quot;no&quot;."));
    assert!(!html.contains("<script") && !html.contains("<em>") && !html.contains("<b>"));
    assert!(html.contains("<summary>the episode as one text</summary>"));
}

#[test]
fn a_run_without_agent_metrics_has_no_agent_section() {
    let dir = tempfile::tempdir().unwrap();
    synthetic_run(dir.path(), 3);
    let s = write_report(dir.path()).unwrap();
    let html = std::fs::read_to_string(&s.html).unwrap();
    assert!(!html.contains("Agent"), "{html}");
    assert!(!html.contains("class=\"msg"));
    assert!(html.contains("<h2>Sample completions</h2>") && html.contains("<th>completion</th>"));
    assert!(s
        .plots
        .iter()
        .all(|p| !p.to_string_lossy().contains("agent_")));
    assert!(
        s.skipped.iter().all(|t| !t.starts_with("Agent")),
        "{:?}",
        s.skipped
    );
}

#[test]
fn eval_rows_show_their_greedy_or_first_sampled_completion() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("metrics.jsonl"),
        "{\"step\":1,\"reward\":1.0}\n",
    )
    .unwrap();
    std::fs::create_dir(dir.path().join("eval")).unwrap();
    // The rows `grpo::eval` writes: samples in `completions`, the greedy one in `greedy`.
    let greedy = serde_json::json!({"prompt": "2+2?", "answer": "4", "completions": [],
        "greedy": {"text": "GREEDY <4>", "rewards": {"correct": 1.0}, "correct": true}});
    let sampled = serde_json::json!({"prompt": "3+3?", "answer": "6", "greedy": null,
        "completions": [{"text": "SAMPLED 7", "rewards": {"correct": 0.0}, "correct": false}]});
    std::fs::write(
        dir.path().join("eval/step-1.jsonl"),
        format!("{greedy}\n{sampled}\n"),
    )
    .unwrap();
    let html = std::fs::read_to_string(write_report(dir.path()).unwrap().html).unwrap();
    assert!(
        html.contains("<th>correct</th></tr><tr><td class=\"n\">0.500</td>"),
        "{html}"
    );
    assert!(
        html.contains("<td class=\"text\">GREEDY &lt;4&gt;</td>"),
        "{html}"
    );
    assert!(html.contains("<td class=\"text\">SAMPLED 7</td>"), "{html}");
}

#[test]
fn a_count_logged_only_when_not_zero_is_zero_beside_its_total() {
    let rows = [
        "{\"step\":1,\"agent/tool_errors_per_episode\":0.0}",
        "{\"step\":2,\"agent/tool_errors_per_episode\":0.5,\"agent/tool_errors/parse\":0.5}",
        "{\"step\":3,\"agent/tool_errors_per_episode\":0.0}",
        "{\"step\":4,\"reward\":1.0}",
    ];
    let m = Metrics {
        rows: rows
            .iter()
            .map(|r| Metrics::row(serde_json::from_str(r).unwrap()).unwrap())
            .collect(),
    };
    let line =
        Line::new("parse", "agent/tool_errors/parse").zero_beside("agent/tool_errors_per_episode");
    let s = Series::collect(&m, &line).unwrap();
    let xy: Vec<(f64, f64)> = s.points.iter().map(|p| (p.x, p.y)).collect();
    assert_eq!(xy, [(1.0, 0.0), (2.0, 0.5), (3.0, 0.0)]);
}
