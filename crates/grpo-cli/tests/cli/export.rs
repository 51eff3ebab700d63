//! `grpo export`: LoRA adapters merged into HF weights and into GGUF.

use super::*;

/// `grpo export`: a PEFT adapter merged into its base, the adapter files alone, and the errors.
#[test]
fn export_merges_lora_adapters_into_hf_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let adapter = fixture("lora/llama_qv");
    let base = fixture("tiny/llama");
    let merged = tmp.path().join("merged");
    let m = merged.display().to_string();
    let o = grpo(&[
        "export",
        "--checkpoint",
        &adapter,
        "--base",
        &base,
        "--merge",
        "--out",
        &m,
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("merged 6 LoRA adapters"),
        "{}",
        stderr(&o)
    );
    for f in ["config.json", "model.safetensors", "generation_config.json"] {
        assert!(merged.join(f).is_file(), "{f}");
    }
    // An occupied output directory is refused, naming it.
    let o = grpo(&[
        "export",
        "--checkpoint",
        &adapter,
        "--base",
        &base,
        "--merge",
        "--out",
        &m,
    ]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("already holds a model"),
        "{}",
        stderr(&o)
    );
    // Without --merge: the adapter files.
    let only = tmp.path().join("adapter");
    let o = grpo(&[
        "export",
        "--checkpoint",
        &adapter,
        "--out",
        &only.display().to_string(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(only.join("adapter_config.json").is_file());
    assert!(only.join("adapter_model.safetensors").is_file());
    // A base that is not there: the error says to pass --base.
    let o = grpo(&[
        "export",
        "--checkpoint",
        &adapter,
        "--base",
        "/nonexistent/base",
        "--merge",
        "--out",
        &tmp.path().join("x").display().to_string(),
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--base"), "{}", stderr(&o));
}

/// `grpo export --format gguf`: a PEFT adapter merged into its base as one GGUF file, and the
/// errors (a type GGUF has no use for, an existing file, q8_0 without `--format gguf`).
#[test]
fn export_writes_merged_lora_adapters_as_gguf() {
    let tmp = tempfile::tempdir().unwrap();
    let adapter = fixture("lora/llama_qv");
    let base = fixture("tiny/llama");
    let out = tmp.path().join("merged.gguf").display().to_string();
    let args = |outtype: &'static str, out: &str| {
        let v: Vec<String> = [
            "export",
            "--checkpoint",
            &adapter,
            "--base",
            &base,
            "--format",
            "gguf",
            "--outtype",
            outtype,
            "--out",
            out,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        v
    };
    let run = |a: Vec<String>| grpo(&a.iter().map(String::as_str).collect::<Vec<_>>());
    let o = run(args("q8_0", &out));
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("merged 6 LoRA adapters"),
        "{}",
        stderr(&o)
    );
    // The tiny fixture has no tokenizer: grpo loads the file, llama.cpp would not.
    assert!(stderr(&o).contains("no tokenizer"), "{}", stderr(&o));
    let bytes = std::fs::read(&out).unwrap();
    assert_eq!(&bytes[..4], b"GGUF");
    assert_eq!(u32::from_le_bytes(bytes[4..8].try_into().unwrap()), 3);
    let o = run(args("q8_0", &out));
    assert!(!o.status.success());
    assert!(stderr(&o).contains("already exists"), "{}", stderr(&o));
    let o = run(args(
        "q4_k",
        &tmp.path().join("x.gguf").display().to_string(),
    ));
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--outtype q4_k"), "{}", stderr(&o));
    let o = grpo(&[
        "export",
        "--checkpoint",
        &base,
        "--dtype",
        "q8_0",
        "--out",
        &tmp.path().join("hf").display().to_string(),
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--format gguf"), "{}", stderr(&o));
}
