//! Parity with transformers on SmolLM2 (fixtures made with transformers 5 from the same model),
//! for both the HF directory and the GGUF path, plus error cases.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use candle_core::quantized::gguf_file::{Content, Value as GgufValue, VersionedMagic};
use serde::Deserialize;

use super::{ChatMessage, Tokenizer};

const FIXTURE_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/smollm2");

#[derive(Deserialize)]
struct Parity {
    cases: Vec<Case>,
    chat: Vec<ChatCase>,
}

#[derive(Deserialize)]
struct Case {
    text: String,
    add_special_tokens: bool,
    ids: Vec<u32>,
    decoded: String,
}

#[derive(Deserialize)]
struct ChatCase {
    messages: Vec<ChatMessage>,
    add_generation_prompt: bool,
    text: String,
    ids: Vec<u32>,
}

fn parity() -> &'static Parity {
    static P: OnceLock<Parity> = OnceLock::new();
    P.get_or_init(|| {
        let path = Path::new(FIXTURE_DIR).join("tokenizer_parity.json");
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    })
}

/// The SmolLM2-135M-Instruct GGUF: `$GRPO_TEST_GGUF`, else the default model from the hub cache.
/// `None` (the test skips, saying so) when it cannot be downloaded.
fn smollm2_gguf() -> Option<PathBuf> {
    match std::env::var_os("GRPO_TEST_GGUF") {
        Some(p) if !p.is_empty() => Some(PathBuf::from(p)),
        _ => crate::hub::download_or_skip("the default model", crate::hub::ensure_default_gguf()),
    }
}

fn hf() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        Tokenizer::from_hf_dir(Path::new(FIXTURE_DIR)).unwrap_or_else(|e| panic!("{e}"))
    })
}

fn gguf_content(path: &Path) -> Content {
    let mut f = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    Content::read(&mut f).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The default model's tokenizer, `None` when it cannot be downloaded (the test skips).
fn gguf() -> Option<&'static Tokenizer> {
    static T: OnceLock<Option<Tokenizer>> = OnceLock::new();
    T.get_or_init(|| {
        let path = smollm2_gguf()?;
        Some(Tokenizer::from_gguf(&gguf_content(&path), &path).unwrap_or_else(|e| panic!("{e}")))
    })
    .as_ref()
}

fn check_cases(tok: &Tokenizer, what: &str) {
    for case in &parity().cases {
        let ids = tok.encode(&case.text, case.add_special_tokens).unwrap();
        assert_eq!(
            ids, case.ids,
            "{what}: ids of {:?} (add_special_tokens={})",
            case.text, case.add_special_tokens
        );
        let decoded = tok.decode(&case.ids, false).unwrap();
        assert_eq!(decoded, case.decoded, "{what}: decode of {:?}", case.text);
    }
}

fn check_chat(tok: &Tokenizer, what: &str) {
    assert!(tok.has_chat_template(), "{what}");
    for case in &parity().chat {
        let text = tok
            .apply_chat_template(&case.messages, case.add_generation_prompt)
            .unwrap();
        assert_eq!(text, case.text, "{what}: chat text of {:?}", case.messages);
        let ids = tok
            .encode_chat(&case.messages, case.add_generation_prompt)
            .unwrap();
        assert_eq!(ids, case.ids, "{what}: chat ids of {:?}", case.messages);
    }
}

fn check_specials(tok: &Tokenizer, what: &str) {
    assert_eq!(tok.vocab_size(), 49152, "{what}");
    assert_eq!(tok.bos_token_id(), Some(1), "{what}");
    assert_eq!(tok.eos_token_id(), Some(2), "{what}");
    assert_eq!(tok.pad_token_id(), Some(2), "{what}");
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(2), "{what}");
    assert_eq!(tok.token_to_id("Ġhave"), Some(457), "{what}");
    assert_eq!(
        tok.id_to_token(0).as_deref(),
        Some("<|endoftext|>"),
        "{what}"
    );
    assert_eq!(tok.id_to_token(905).as_deref(), Some("Ġworld"), "{what}");
    assert_eq!(tok.id_to_token(1_000_000), None, "{what}");
    // SmolLM2 adds no BOS/EOS, even with add_special_tokens.
    assert_eq!(
        tok.encode("Hello world", true).unwrap(),
        vec![19556, 905],
        "{what}"
    );
    assert_eq!(tok.encode("", true).unwrap(), Vec::<u32>::new(), "{what}");
    // Skipping special tokens.
    let ids = tok.encode("<|im_start|>user\nhi<|im_end|>", false).unwrap();
    assert_eq!(tok.decode(&ids, true).unwrap(), "user\nhi", "{what}");
}

#[test]
fn hf_dir_matches_transformers() {
    check_cases(hf(), "hf dir");
}

#[test]
fn hf_dir_chat_matches_transformers() {
    check_chat(hf(), "hf dir");
}

#[test]
fn hf_dir_special_tokens() {
    check_specials(hf(), "hf dir");
}

#[test]
fn gguf_matches_transformers() {
    let Some(g) = gguf() else { return };
    check_cases(g, "gguf");
}

#[test]
fn gguf_chat_matches_transformers() {
    let Some(g) = gguf() else { return };
    check_chat(g, "gguf");
}

#[test]
fn gguf_special_tokens() {
    let Some(g) = gguf() else { return };
    check_specials(g, "gguf");
}

/// Beyond the fixture: the two paths agree on more text, except where the fixture's
/// tokenizer.json differs from SmolLM2's own (see `gguf_smollm_splits_digits`).
#[test]
fn gguf_agrees_with_hf_dir() {
    let texts = [
        "Hello, world! 1 + 2 = 3",
        "  two leading spaces",
        "tabs\tand\nnewlines\r\n",
        "<|im_start|>assistant\nSure: x=42<|im_end|><|endoftext|>",
        "<jupyter_code>print('hi')<jupyter_output>",
        "Ünïcödé ✓ 🤗 日本語",
        "The year 1999 and 2000.",
    ];
    let Some(g) = gguf() else { return };
    for t in texts {
        assert_eq!(
            g.encode(t, false).unwrap(),
            hf().encode(t, false).unwrap(),
            "{t:?}"
        );
    }
}

/// SmolLM2's own tokenizer.json (and llama.cpp's "smollm") splits every digit off before the
/// byte-level regex: Sequence[Digits(individual_digits=true), ByteLevel]. The fixture's
/// tokenizer.json was written by transformers from the GGUF, and transformers' GGUF loader drops
/// that Digits step. The two differ only on runs of 2+ whitespace characters before a digit.
#[test]
fn gguf_smollm_splits_digits() {
    // With Digits first, "a  1" is "a", "  ", "1" -> [a, ĠĠ, 1].
    let Some(g) = gguf() else { return };
    assert_eq!(g.encode("a  1", false).unwrap(), vec![81, 256, 33]);
    // The fixture's plain ByteLevel makes it "a", " ", " 1" -> [a, Ġ, Ġ, 1].
    assert_eq!(hf().encode("a  1", false).unwrap(), vec![81, 216, 216, 33]);
}

#[test]
fn missing_tokenizer_json_names_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let err = Tokenizer::from_hf_dir(dir.path()).unwrap_err().to_string();
    let want = dir.path().join("tokenizer.json");
    assert!(err.contains(&want.display().to_string()), "{err}");
    assert!(err.contains("not found"), "{err}");
}

#[test]
fn malformed_tokenizer_json() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tokenizer.json"), "{\"model\": [1, 2").unwrap();
    let err = Tokenizer::from_hf_dir(dir.path()).unwrap_err().to_string();
    assert!(err.contains("tokenizer.json"), "{err}");
    assert!(err.contains("not a valid tokenizer.json"), "{err}");
}

/// A temp directory with the fixture's tokenizer.json and the given tokenizer_config.json.
fn dir_with_config(config: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        Path::new(FIXTURE_DIR).join("tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .unwrap();
    std::fs::write(dir.path().join("tokenizer_config.json"), config).unwrap();
    dir
}

#[test]
fn malformed_tokenizer_config() {
    let dir = dir_with_config("{\"chat_template\": ");
    let err = Tokenizer::from_hf_dir(dir.path()).unwrap_err().to_string();
    assert!(err.contains("tokenizer_config.json"), "{err}");
}

#[test]
fn no_template_says_how_to_fix() {
    let dir =
        dir_with_config(r#"{"eos_token": {"content": "<|im_end|>", "__type": "AddedToken"}}"#);
    let tok = Tokenizer::from_hf_dir(dir.path()).unwrap();
    assert!(!tok.has_chat_template());
    assert_eq!(tok.eos_token_id(), Some(2));
    assert_eq!(tok.bos_token_id(), None);
    let err = tok
        .apply_chat_template(&[ChatMessage::user("hi")], true)
        .unwrap_err()
        .to_string();
    assert!(err.contains("--no-chat"), "{err}");
    assert!(tok.encode_chat(&[ChatMessage::user("hi")], true).is_err());
    // A template can still be supplied.
    let tok = tok
        .with_chat_template("{{ messages[0].content }}!", "test")
        .unwrap();
    assert_eq!(
        tok.apply_chat_template(&[ChatMessage::user("hi")], true)
            .unwrap(),
        "hi!"
    );
}

#[test]
fn template_raise_exception_is_an_error() {
    let dir = dir_with_config(
        r#"{"bos_token": "<|im_start|>", "chat_template": "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}{{ bos_token }}{{ messages[0]['content'] }}"}"#,
    );
    let tok = Tokenizer::from_hf_dir(dir.path()).unwrap();
    let ok = tok
        .apply_chat_template(&[ChatMessage::user("hey")], false)
        .unwrap();
    assert_eq!(ok, "<|im_start|>hey");
    let err = tok
        .apply_chat_template(&[ChatMessage::system("s"), ChatMessage::user("u")], false)
        .unwrap_err()
        .to_string();
    assert!(err.contains("System role not supported"), "{err}");
}

#[test]
fn bad_template_fails_at_load_naming_its_file() {
    let dir = dir_with_config(r#"{"chat_template": "{% for m in messages %}{{ m.content }}"}"#);
    let err = Tokenizer::from_hf_dir(dir.path()).unwrap_err().to_string();
    assert!(err.contains("tokenizer_config.json"), "{err}");
    assert!(err.contains("does not compile"), "{err}");
}

#[test]
fn named_templates_and_jinja_file() {
    // A list of named templates: "default" is used.
    let dir = dir_with_config(
        r#"{"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ messages|length }}"}]}"#,
    );
    let tok = Tokenizer::from_hf_dir(dir.path()).unwrap();
    assert_eq!(
        tok.apply_chat_template(&[ChatMessage::user("x")], false)
            .unwrap(),
        "D1"
    );
    // chat_template.jinja takes priority over the config, as in transformers; booleans print
    // as Python's.
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "J{{ add_generation_prompt }}\n",
    )
    .unwrap();
    let tok = Tokenizer::from_hf_dir(dir.path()).unwrap();
    assert_eq!(
        tok.apply_chat_template(&[ChatMessage::user("x")], true)
            .unwrap(),
        "JTrue"
    );
    // No "default": no template, and the error says why.
    let dir = dir_with_config(r#"{"chat_template": [{"name": "tool_use", "template": "T"}]}"#);
    let tok = Tokenizer::from_hf_dir(dir.path()).unwrap();
    let err = tok
        .apply_chat_template(&[ChatMessage::user("x")], false)
        .unwrap_err()
        .to_string();
    assert!(err.contains("tool_use"), "{err}");
}

#[test]
fn config_special_token_missing_from_vocab_is_added() {
    let dir = dir_with_config(r#"{"pad_token": "<|my_pad|>"}"#);
    let tok = Tokenizer::from_hf_dir(dir.path()).unwrap();
    assert_eq!(tok.pad_token_id(), Some(49152));
    assert_eq!(tok.vocab_size(), 49153);
    assert_eq!(tok.encode("a<|my_pad|>", false).unwrap(), vec![81, 49152]);
}

// ---- GGUF metadata built in memory ----

fn strings(v: &[&str]) -> GgufValue {
    GgufValue::Array(
        v.iter()
            .map(|s| GgufValue::String((*s).to_owned()))
            .collect(),
    )
}

fn content(entries: Vec<(&str, GgufValue)>) -> Content {
    Content {
        magic: VersionedMagic::GgufV3,
        metadata: entries
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect::<HashMap<_, _>>(),
        tensor_infos: HashMap::new(),
        tensor_data_offset: 0,
    }
}

/// A small byte-level vocabulary: all 256 byte symbols, some merges, a control token (BOS), and a
/// user-defined token whose text is outside the byte alphabet.
fn tiny_gguf(pre: &str, extra: Vec<(&str, GgufValue)>) -> Content {
    let alphabet = super::gguf::tests_support::byte_symbols();
    let mut tokens: Vec<String> = vec!["<s>".to_owned()];
    tokens.extend(alphabet.iter().map(|c| c.to_string()));
    let merged = ["12", "123", "45", "Ġa", "ab", "Ġab"];
    tokens.extend(merged.iter().map(|s| s.to_string()));
    tokens.push("<tool call>".to_owned());
    let mut types = vec![3i32];
    types.extend(std::iter::repeat_n(1, tokens.len() - 2));
    types.push(4);
    let token_refs: Vec<&str> = tokens.iter().map(String::as_str).collect();
    let mut entries = vec![
        ("tokenizer.ggml.model", GgufValue::String("gpt2".into())),
        ("tokenizer.ggml.pre", GgufValue::String(pre.into())),
        ("tokenizer.ggml.tokens", strings(&token_refs)),
        (
            "tokenizer.ggml.token_type",
            GgufValue::Array(types.into_iter().map(GgufValue::I32).collect()),
        ),
        (
            "tokenizer.ggml.merges",
            strings(&["1 2", "12 3", "4 5", "Ġ a", "a b", "Ġa b"]),
        ),
        ("tokenizer.ggml.bos_token_id", GgufValue::U32(0)),
        ("tokenizer.ggml.eos_token_id", GgufValue::U32(0)),
    ];
    entries.extend(extra);
    content(entries)
}

fn id(tok: &Tokenizer, s: &str) -> u32 {
    tok.token_to_id(s)
        .unwrap_or_else(|| panic!("no token {s:?}"))
}

#[test]
fn gguf_without_tokenizer_metadata() {
    let c = content(vec![(
        "general.architecture",
        GgufValue::String("llama".into()),
    )]);
    let err = Tokenizer::from_gguf(&c, Path::new("/x/model.gguf"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("/x/model.gguf"), "{err}");
    assert!(err.contains("tokenizer.ggml.model"), "{err}");
}

#[test]
fn gguf_unknown_pre_is_refused() {
    let c = tiny_gguf("mystery-bpe", vec![]);
    let err = Tokenizer::from_gguf(&c, Path::new("m.gguf"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("mystery-bpe"), "{err}");
    assert!(err.contains("tokenizer.json"), "{err}");
}

#[test]
fn gguf_sentencepiece_is_refused() {
    let c = content(vec![
        ("tokenizer.ggml.model", GgufValue::String("llama".into())),
        ("tokenizer.ggml.tokens", strings(&["<unk>", "<s>", "</s>"])),
    ]);
    let err = Tokenizer::from_gguf(&c, Path::new("m.gguf"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("SentencePiece"), "{err}");
}

#[test]
fn gguf_bad_metadata_types_are_errors() {
    let c = tiny_gguf(
        "gpt2",
        vec![("tokenizer.ggml.bos_token_id", GgufValue::String("0".into()))],
    );
    let err = Tokenizer::from_gguf(&c, Path::new("m.gguf"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("tokenizer.ggml.bos_token_id"), "{err}");
    let c = tiny_gguf(
        "gpt2",
        vec![("tokenizer.ggml.eos_token_id", GgufValue::U32(100_000))],
    );
    let err = Tokenizer::from_gguf(&c, Path::new("m.gguf"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("out of range"), "{err}");
    let c = tiny_gguf(
        "gpt2",
        vec![("tokenizer.ggml.merges", strings(&["nospace"]))],
    );
    let err = Tokenizer::from_gguf(&c, Path::new("m.gguf"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("tokenizer.ggml.merges"), "{err}");
    let c = tiny_gguf(
        "gpt2",
        vec![("tokenizer.ggml.add_space_prefix", GgufValue::Bool(true))],
    );
    assert!(Tokenizer::from_gguf(&c, Path::new("m.gguf")).is_ok());
    let c = tiny_gguf(
        "qwen2",
        vec![("tokenizer.ggml.add_space_prefix", GgufValue::Bool(true))],
    );
    let err = Tokenizer::from_gguf(&c, Path::new("m.gguf"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("add_space_prefix"), "{err}");
}

#[test]
fn gguf_bos_and_added_tokens() {
    let c = tiny_gguf(
        "gpt2",
        vec![("tokenizer.ggml.add_bos_token", GgufValue::Bool(true))],
    );
    let tok = Tokenizer::from_gguf(&c, Path::new("m.gguf")).unwrap();
    let (bos, ab, gab) = (0, id(&tok, "ab"), id(&tok, "Ġab"));
    assert_eq!(tok.encode("ab ab", false).unwrap(), vec![ab, gab]);
    assert_eq!(tok.encode("ab ab", true).unwrap(), vec![bos, ab, gab]);
    assert_eq!(tok.encode("", true).unwrap(), vec![bos]);
    // The control token is matched whole and skipped on request.
    assert_eq!(tok.encode("<s>ab", false).unwrap(), vec![bos, ab]);
    assert_eq!(tok.decode(&[bos, ab, gab], true).unwrap(), "ab ab");
    assert_eq!(tok.decode(&[bos, ab, gab], false).unwrap(), "<s>ab ab");
    // The user-defined token keeps the file's id though its text is not byte-level spelled.
    let tool = (tok.vocab_size() - 1) as u32;
    assert_eq!(tok.token_to_id("<tool call>"), Some(tool));
    assert_eq!(tok.encode("ab<tool call>", false).unwrap(), vec![ab, tool]);
    assert_eq!(tok.decode(&[ab, tool], true).unwrap(), "ab<tool call>");
    // No prefix space is added.
    assert_eq!(tok.encode("a", false).unwrap(), vec![id(&tok, "a")]);
    assert!(!tok.has_chat_template());
}

#[test]
fn gguf_pre_tokenizers_split_digits_as_their_models_do() {
    let digits = |pre: &str| {
        let tok = Tokenizer::from_gguf(&tiny_gguf(pre, vec![]), Path::new("m.gguf")).unwrap();
        let ids = tok.encode("1234512", false).unwrap();
        ids.iter()
            .map(|&i| tok.id_to_token(i).unwrap())
            .collect::<Vec<_>>()
    };
    // GPT-2: digits run together, then the merges apply.
    assert_eq!(digits("gpt2"), ["123", "45", "12"]);
    // Llama 3: groups of up to three digits ("123", "451", "2").
    assert_eq!(digits("llama-bpe"), ["123", "45", "1", "2"]);
    // Qwen2, SmolLM, StarCoder: one digit at a time.
    let singles = ["1", "2", "3", "4", "5", "1", "2"];
    assert_eq!(digits("qwen2"), singles);
    assert_eq!(digits("smollm"), singles);
    assert_eq!(digits("starcoder"), singles);
    let tok = Tokenizer::from_gguf(&tiny_gguf("llama-bpe", vec![]), Path::new("m.gguf")).unwrap();
    assert_eq!(
        tok.decode(&tok.encode(" ab 1234 x\n\n", false).unwrap(), false)
            .unwrap(),
        " ab 1234 x\n\n"
    );
}

#[test]
fn gguf_chat_template_compiles_at_load() {
    let c = tiny_gguf(
        "gpt2",
        vec![(
            "tokenizer.chat_template",
            GgufValue::String("{% if %}".into()),
        )],
    );
    let err = Tokenizer::from_gguf(&c, Path::new("/m/x.gguf"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("/m/x.gguf"), "{err}");
    assert!(err.contains("tokenizer.chat_template"), "{err}");
    let c = tiny_gguf(
        "gpt2",
        vec![(
            "tokenizer.chat_template",
            GgufValue::String("{{ bos_token }}{{ messages[0].content }}".into()),
        )],
    );
    let tok = Tokenizer::from_gguf(&c, Path::new("m.gguf")).unwrap();
    assert_eq!(
        tok.apply_chat_template(&[ChatMessage::user("ab")], true)
            .unwrap(),
        "<s>ab"
    );
    assert_eq!(
        tok.encode_chat(&[ChatMessage::user("ab")], true).unwrap(),
        vec![0, id(&tok, "ab")]
    );
}

#[test]
fn tokenizer_is_send_and_sync() {
    fn check<T: Send + Sync + Clone + std::fmt::Debug>() {}
    check::<Tokenizer>();
    let dbg = format!("{:?}", hf());
    assert!(dbg.contains("vocab_size: 49152"), "{dbg}");
}
