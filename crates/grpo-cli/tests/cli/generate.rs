//! `grpo generate`: its options, the default model's JSON lines, stop strings, clear errors,
//! plain log lines.

use super::*;

#[test]
fn help_explains_every_generate_option() {
    let o = grpo(&["generate", "--help"]);
    assert!(o.status.success());
    let h = String::from_utf8_lossy(&o.stdout);
    for opt in [
        "--model",
        "--prompt",
        "--prompts",
        "--chat",
        "--system",
        "--num-samples",
        "--max-new-tokens",
        "--min-new-tokens",
        "--temperature",
        "--top-k",
        "--top-p",
        "--min-p",
        "--repetition-penalty",
        "--stop",
        "--seed",
        "--json",
        "--dtype",
        "--device",
        "--threads",
    ] {
        assert!(h.contains(opt), "--help lacks {opt}");
    }
}

#[test]
fn generate_with_the_default_model_prints_json_lines() {
    let fetched = grpo_models::hub::download_or_skip(
        "the default model",
        grpo_models::hub::ensure_default_gguf(),
    );
    if fetched.is_none() {
        return;
    }
    let o = grpo(&[
        "generate",
        "--prompt",
        "What is 17 + 25?",
        "--chat",
        "-n",
        "2",
        "--max-new-tokens",
        "12",
        "--temperature",
        "0",
        "--json",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    for (i, l) in lines.iter().enumerate() {
        assert_eq!(l["sample_index"], i);
        // transformers' greedy answer for this prompt (tests/fixtures/smollm2/greedy.json).
        assert_eq!(l["completion"], "17 + 25 = 32.");
        assert_eq!(l["stop_reason"], "eos");
        let ids = l["completion_ids"].as_array().unwrap();
        assert_eq!(ids.len(), l["logprobs"].as_array().unwrap().len());
        assert!(l["prompt"]
            .as_str()
            .unwrap()
            .contains("<|im_start|>user\nWhat is 17 + 25?"));
    }
}

#[test]
fn stop_strings_end_the_completion() {
    let o = grpo(&[
        "generate",
        "--prompt",
        "What is 17 + 25?",
        "--chat",
        "--max-new-tokens",
        "12",
        "--temperature",
        "0",
        "--json",
        "--stop",
        " =",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let l: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&o.stdout).lines().next().unwrap()).unwrap();
    assert_eq!(l["stop_reason"], "stop_string");
    assert_eq!(l["completion"], "17 + 25 =");
}

#[test]
fn bad_input_gives_a_clear_error_and_exit_code() {
    let o = grpo(&["generate", "--model", "/no/such/model", "--prompt", "hi"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("/no/such/model"), "{}", stderr(&o));

    // A model directory without a tokenizer.
    let o = grpo(&[
        "generate",
        "--model",
        &fixture("tiny/llama"),
        "--prompt",
        "hi",
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("tokenizer"), "{}", stderr(&o));

    // A malformed prompts file names the file and line.
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("prompts.jsonl");
    std::fs::write(&p, "{\"prompt\": \"ok\"}\n{\"question\": 1}\n").unwrap();
    let o = grpo(&["generate", "--prompts", p.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("prompts.jsonl:2"), "{}", stderr(&o));

    let o = grpo(&["generate", "--prompt", "hi", "--top-p", "0"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("top_p"), "{}", stderr(&o));

    let o = grpo(&["generate", "--prompt", "hi", "--dtype", "f8"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--dtype"), "{}", stderr(&o));
}

#[test]
fn log_lines_are_not_coloured_when_stderr_is_not_a_terminal() {
    let dir = tempfile::tempdir().unwrap();
    // A truncated last line: the report is written and the problem logged as a warning.
    std::fs::write(
        dir.path().join("metrics.jsonl"),
        "{\"step\":1,\"reward\":0.5}\n{\"step\":2,\"rew",
    )
    .unwrap();
    let res = Command::new(env!("CARGO_BIN_EXE_grpo"))
        .args(["report", &dir.path().display().to_string()])
        .env("RUST_LOG", "warn")
        .env_remove("NO_COLOR")
        .output()
        .expect("run grpo");
    let err = stderr(&res);
    assert!(res.status.success(), "{err}");
    assert!(
        err.contains("WARN") && err.contains("line 2 is truncated"),
        "{err}"
    );
    assert!(!err.contains("\x1b["), "{err:?}");
}
