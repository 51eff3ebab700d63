//! The bad-input corpus: every case runs the `grpo` binary as a user would, with one thing wrong
//! (a config, a dataset, a model file, a reward, an argument, a checkpoint), and must end with a
//! non-zero exit code and one error message that names the file, key or line, with no panic and
//! no backtrace (`RUST_BACKTRACE=1` is set, as on many developer machines), and must leave nothing
//! in `output_dir` that a later `--resume` would take for a checkpoint.
//!
//! Each case: a name, what it writes into its own directory, the arguments (`{d}` is that
//! directory, `{model}` a tiny Llama with SmolLM2's tokenizer, `{fx}` tests/fixtures), and the
//! fragments the message must contain.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

#[path = "../../grpo/tests/support/tiny_llama.rs"]
mod support;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// The shared tiny model (made once per test process).
fn model() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = tempfile::tempdir().unwrap();
        support::tiny_llama(&d.path().join("m"), &fixtures());
        d
    })
    .path()
    .join("m")
    .leak()
}

/// A small valid run config (append lines to break it).
const BASE: &str = "model = \"{model}\"\noutput_dir = \"{d}/out\"\nmax_steps = 1\n\
num_generations = 2\nper_device_train_batch_size = 2\nmax_completion_length = 2\n\
report_to = \"none\"\neval_steps = 0\nthreads = 1\n";
const TASK: &str = "[task]\ntrain_size = 4\neval_size = 2\n";

type Setup = Box<dyn Fn(&Path) + Send + Sync>;

struct Case {
    name: &'static str,
    setup: Setup,
    args: Vec<&'static str>,
    expect: Vec<&'static str>,
}

fn fill(s: &str, d: &Path) -> String {
    s.replace("{d}", &d.display().to_string())
        .replace("{model}", &model().display().to_string())
        .replace("{fx}", &fixtures().display().to_string())
}

/// `run.toml` = the base config, `extra` top-level lines, then the built-in task's table and
/// `tables` (e.g. `[[rewards]]`).
fn toml(extra: &'static str, tables: &'static str) -> Setup {
    Box::new(move |d| {
        let text = format!("{BASE}{extra}\n{TASK}{tables}");
        std::fs::write(d.join("run.toml"), fill(&text, d)).unwrap();
    })
}

fn file(name: &'static str, bytes: impl Fn() -> Vec<u8> + Send + Sync + 'static) -> Setup {
    Box::new(move |d| {
        let p = d.join(name);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, bytes()).unwrap();
    })
}

fn both(a: Setup, b: Setup) -> Setup {
    Box::new(move |d| {
        a(d);
        b(d);
    })
}

fn nothing() -> Setup {
    Box::new(|_| {})
}

/// A copy of the tiny model in `{d}/m`, changed by `edit`.
fn model_copy(edit: impl Fn(&Path) + Send + Sync + 'static) -> Setup {
    Box::new(move |d| {
        let m = d.join("m");
        std::fs::create_dir_all(&m).unwrap();
        for e in std::fs::read_dir(model()).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), m.join(e.file_name())).unwrap();
        }
        edit(&m);
    })
}

fn edit_json(p: &Path, f: impl Fn(&mut serde_json::Value)) {
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(p, v.to_string()).unwrap();
}

/// The model's tensors rewritten by `f` (names -> tensors).
fn edit_tensors(m: &Path, f: impl Fn(&mut std::collections::HashMap<String, candle_core::Tensor>)) {
    let p = m.join("model.safetensors");
    let mut t = candle_core::safetensors::load(&p, &candle_core::Device::Cpu).unwrap();
    f(&mut t);
    candle_core::safetensors::save(&t, &p).unwrap();
}

/// A GGUF file (version 3) with no metadata and one tensor `w` [4] of ggml type `dtype`.
fn gguf_with_type(dtype: u32) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(1u64.to_le_bytes()); // tensors
    b.extend(0u64.to_le_bytes()); // metadata entries
    b.extend(1u64.to_le_bytes());
    b.extend(b"w");
    b.extend(1u32.to_le_bytes()); // dims
    b.extend(4u64.to_le_bytes());
    b.extend(dtype.to_le_bytes());
    b.extend(0u64.to_le_bytes()); // offset
    while !b.len().is_multiple_of(32) {
        b.push(0);
    }
    b.extend([0u8; 64]);
    b
}

/// A run directory with a checkpoint made by a real one-step run (then broken by `edit`).
fn checkpoint(edit: impl Fn(&Path) + Send + Sync + 'static) -> Setup {
    Box::new(move |d| {
        toml("save_steps = 1", "")(d);
        let o = Command::new(env!("CARGO_BIN_EXE_grpo"))
            .args([
                "train",
                "--config",
                &d.join("run.toml").display().to_string(),
            ])
            .env("RUST_LOG", "error")
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        edit(&d.join("out").join("checkpoint-1"));
    })
}

fn cases() -> Vec<Case> {
    let c = |name, setup, args: &[&'static str], expect: &[&'static str]| Case {
        name,
        setup,
        args: args.to_vec(),
        expect: expect.to_vec(),
    };
    let train = &["train", "--config", "{d}/run.toml"];
    let resolve = &["config", "--resolve", "--config", "{d}/run.toml"];
    vec![
        // ---- configs
        c("unknown key", toml("learning_rat = 1e-5", ""), resolve, &["learning_rat", "learning_rate"]),
        c("wrong type", toml("learning_rate = \"fast\"", ""), resolve, &["learning_rate"]),
        c("zero generations", toml("num_generations = 0", ""), resolve, &["num_generations"]),
        c("batch not whole groups", toml("per_device_train_batch_size = 3", ""), resolve, &["per_device_train_batch_size"]),
        c("bad TOML", toml("max_steps = = 3", ""), resolve, &["run.toml", "line"]),
        c("duplicate TOML key", toml("seed = 1\nseed = 2", ""), resolve, &["run.toml", "seed"]),
        c("bad YAML", file("run.yaml", || b"max_steps: 3\n  seed: [1\n".to_vec()), &["config", "--resolve", "--config", "{d}/run.yaml"], &["run.yaml", "line"]),
        c("YAML list at the top", file("run.yaml", || b"- a\n- b\n".to_vec()), &["config", "--resolve", "--config", "{d}/run.yaml"], &["run.yaml", "table"]),
        c("unknown config format", file("run.json", || b"{}".to_vec()), &["config", "--resolve", "--config", "{d}/run.json"], &["run.json", ".toml"]),
        c("missing config file", nothing(), train, &["run.toml", "cannot read"]),
        c("unknown loss type", toml("loss_type = \"foo\"", ""), resolve, &["loss_type", "foo"]),
        c("unknown scheduler", toml("lr_scheduler_type = \"nope\"", ""), resolve, &["lr_scheduler_type"]),
        c("negative epsilon", toml("epsilon = -0.2", ""), resolve, &["epsilon"]),
        c("zero temperature", toml("temperature = 0.0", ""), resolve, &["temperature"]),
        c("top_p above 1", toml("top_p = 1.5", ""), resolve, &["top_p"]),
        c("negative beta", toml("beta = -1.0", ""), resolve, &["beta"]),
        c("unknown tracker", toml("report_to = [\"nonsense\"]", ""), resolve, &["report_to", "nonsense"]),
        c("unknown device", toml("device = \"tpu\"", ""), resolve, &["device", "tpu"]),
        c("unknown dtype", toml("dtype = \"f8\"", ""), resolve, &["dtype", "f8"]),
        c("override not a number", toml("", ""), &["config", "--resolve", "--config", "{d}/run.toml", "--max_steps=abc"], &["max_steps"]),
        c("rewards as an override", toml("", ""), &["config", "--resolve", "--config", "{d}/run.toml", "--rewards=x"], &["rewards", "config file"]),
        c("unknown override", toml("", ""), &["config", "--resolve", "--config", "{d}/run.toml", "--learnin_rate=1"], &["learnin_rate"]),
        c("override without value", toml("", ""), &["config", "--resolve", "--config", "{d}/run.toml", "--learning_rate"], &["learning_rate", "=VALUE"]),
        c("unknown generation_kwargs key", toml("generation_kwargs = { beams = 4 }", ""), resolve, &["generation_kwargs", "beams"]),
        c("DoRA", toml("use_dora = true", ""), resolve, &["use_dora"]),
        c("resume from a path", toml("resume_from_checkpoint = \"x/checkpoint-3\"", ""), resolve, &["resume_from_checkpoint"]),
        c("another model revision", toml("model_revision = \"dev\"", ""), resolve, &["model_revision"]),
        c("save_total_limit zero", toml("save_total_limit = -3", ""), resolve, &["save_total_limit"]),
        c("warmup ratio above 1", toml("warmup_ratio = 2.0", ""), resolve, &["warmup_ratio"]),
        c("LoRA alpha without rank", toml("lora_alpha = \"x\"", ""), resolve, &["lora"]),
        c("bf16 and dtype", toml("bf16 = true\ndtype = \"f32\"", ""), resolve, &["bf16", "dtype"]),
        c("fill-in policy on a causal LM", toml("policy = \"fill_in\"", ""), train, &["config.json", "masked-LM"]),
        c("bad fault spec", toml("", ""), &["config", "--print"], &["GRPO_FAULTS"]),
        c("bad instruction set", toml("", ""), &["config", "--print"], &["GRPO_ISA", "avx2"]),
        c("bad kernel set in the environment", toml("", ""), &["config", "--print"], &["GRPO_KERNELS", "portable"]),
        c("bad kernels key", toml("kernels = \"gpu\"", ""), resolve, &["kernels", "portable"]),
        // ---- datasets
        c("empty train file", both(toml("train_file = \"{d}/t.jsonl\"", ""), file("t.jsonl", Vec::new)), train, &["t.jsonl", "no usable rows"]),
        c("missing prompt field", both(toml("train_file = \"{d}/t.jsonl\"", ""), file("t.jsonl", || b"{\"prompt\": \"a\"}\n{\"question\": \"b\"}\n".to_vec())), train, &["t.jsonl", "line 2", "prompt"]),
        c("invalid JSON line", both(toml("train_file = \"{d}/t.jsonl\"", ""), file("t.jsonl", || b"{\"prompt\": \"a\"}\n{\"prompt\": \n".to_vec())), train, &["t.jsonl", "line 2", "invalid JSON"]),
        c("invalid UTF-8", both(toml("train_file = \"{d}/t.jsonl\"", ""), file("t.jsonl", || b"{\"prompt\": \"a\"}\n{\"prompt\": \"\xff\xfe\"}\n".to_vec())), train, &["t.jsonl", "line 2", "UTF-8"]),
        c("a 50 MB line", both(toml("train_file = \"{d}/t.jsonl\"", ""), file("t.jsonl", || { let mut v = b"{\"prompt\": \"".to_vec(); v.resize(50_000_000, b'a'); v.extend(b"\"}\n"); v })), train, &["t.jsonl", "line 1", "MB"]),
        c("a JSON array", both(toml("train_file = \"{d}/t.json\"", ""), file("t.json", || b"[\n{\"prompt\": \"a\"}\n]\n".to_vec())), train, &["t.json", "line 1"]),
        c("ragged CSV", both(toml("train_file = \"{d}/t.csv\"", ""), file("t.csv", || b"prompt,answer\na,1\nb,2,3\n".to_vec())), train, &["t.csv", "line 3"]),
        c("CSV without the prompt column", both(toml("train_file = \"{d}/t.csv\"", ""), file("t.csv", || b"question,answer\na,1\n".to_vec())), train, &["t.csv", "prompt"]),
        c("Parquet prompt of integers", toml("train_file = \"{fx}/data/wrong_types.parquet\"", ""), train, &["wrong_types.parquet", "prompt"]),
        c("Parquet messages of strings", toml("train_file = \"{fx}/data/wrong_types.parquet\"\nprompt_field = \"messages\"", ""), train, &["wrong_types.parquet", "messages"]),
        c("not a Parquet file", both(toml("train_file = \"{d}/t.parquet\"", ""), file("t.parquet", || b"PAR1 not really".to_vec())), train, &["t.parquet", "Parquet"]),
        c("missing train file", toml("train_file = \"{d}/nope.jsonl\"", ""), train, &["nope.jsonl"]),
        c("unknown dataset format", both(toml("train_file = \"{d}/t.xml\"", ""), file("t.xml", || b"<a/>".to_vec())), train, &["t.xml", ".jsonl"]),
        c("blank text file", both(toml("train_file = \"{d}/t.txt\"", ""), file("t.txt", || b"\n  \n\n".to_vec())), train, &["t.txt", "no usable rows"]),
        c("messages not objects", both(toml("train_file = \"{d}/t.jsonl\"", ""), file("t.jsonl", || b"{\"prompt\": [1, 2]}\n".to_vec())), train, &["t.jsonl", "line 1"]),
        c("missing eval file", toml("eval_file = \"{d}/nope.jsonl\"", ""), &["train", "--config", "{d}/run.toml", "--eval_steps=1"], &["nope.jsonl"]),
        c("dataset directory without the split", both(toml("dataset_name = \"{d}/ds\"", ""), file("ds/test.jsonl", || b"{\"prompt\": \"a\"}\n".to_vec())), train, &["ds", "train"]),
        // ---- models
        c("missing model directory", toml("", ""), &["train", "--config", "{d}/run.toml", "--model={d}/nope"], &["nope"]),
        c("no weights", model_copy(|m| std::fs::remove_file(m.join("model.safetensors")).unwrap()), &["generate", "--model", "{d}/m", "--prompt", "hi"], &["safetensors"]),
        c("truncated safetensors", model_copy(|m| { let p = m.join("model.safetensors"); let b = std::fs::read(&p).unwrap(); std::fs::write(&p, &b[..b.len() / 2]).unwrap(); }), &["generate", "--model", "{d}/m", "--prompt", "hi"], &["model.safetensors"]),
        c("safetensors header garbage", model_copy(|m| std::fs::write(m.join("model.safetensors"), [255u8; 64]).unwrap()), &["generate", "--model", "{d}/m", "--prompt", "hi"], &["model.safetensors"]),
        c("tensor shapes against the config", model_copy(|m| edit_json(&m.join("config.json"), |v| v["hidden_size"] = 48.into())), &["generate", "--model", "{d}/m", "--prompt", "hi"], &["shape"]),
        c("missing tensor", model_copy(|m| edit_tensors(m, |t| { t.remove("model.layers.1.mlp.down_proj.weight"); })), &["generate", "--model", "{d}/m", "--prompt", "hi"], &["model.layers.1.mlp.down_proj.weight"]),
        c("config.json not JSON", model_copy(|m| std::fs::write(m.join("config.json"), "{ not json").unwrap()), &["generate", "--model", "{d}/m", "--prompt", "hi"], &["config.json"]),
        c("unknown architecture", model_copy(|m| edit_json(&m.join("config.json"), |v| { v["model_type"] = "mamba".into(); v["architectures"] = serde_json::json!(["MambaForCausalLM"]); })), &["generate", "--model", "{d}/m", "--prompt", "hi"], &["mamba"]),
        c("GGUF bad magic", file("m.gguf", || b"GGML\x03\x00\x00\x00 and more bytes here".to_vec()), &["generate", "--model", "{d}/m.gguf", "--prompt", "hi"], &["m.gguf", "GGUF"]),
        c("GGUF truncated", file("m.gguf", || gguf_with_type(0)[..30].to_vec()), &["generate", "--model", "{d}/m.gguf", "--prompt", "hi"], &["m.gguf"]),
        c("GGUF unknown tensor type", file("m.gguf", || gguf_with_type(99)), &["generate", "--model", "{d}/m.gguf", "--prompt", "hi"], &["m.gguf", "99"]),
        c("GGUF empty file", file("m.gguf", Vec::new), &["generate", "--model", "{d}/m.gguf", "--prompt", "hi"], &["m.gguf"]),
        c("tokenizer larger than the embedding", model_copy(|m| { edit_json(&m.join("config.json"), |v| v["vocab_size"] = 1000.into()); edit_tensors(m, |t| { let e = t["model.embed_tokens.weight"].narrow(0, 0, 1000).unwrap(); t.insert("model.embed_tokens.weight".into(), e); }); }), &["generate", "--model", "{d}/m", "--prompt", "hi"], &["vocab"]),
        c("broken chat template", model_copy(|m| edit_json(&m.join("tokenizer_config.json"), |v| v["chat_template"] = "{% for m in messages %}{{ m.content }".into())), &["generate", "--model", "{d}/m", "--prompt", "hi", "--chat"], &["template"]),
        c("chat template that raises", model_copy(|m| edit_json(&m.join("tokenizer_config.json"), |v| v["chat_template"] = "{{ raise_exception('roles must alternate') }}".into())), &["generate", "--model", "{d}/m", "--prompt", "hi", "--chat"], &["roles must alternate"]),
        c("missing tokenizer", model_copy(|m| std::fs::remove_file(m.join("tokenizer.json")).unwrap()), &["generate", "--model", "{d}/m", "--prompt", "hi"], &["tokenizer"]),
        c("corrupt tokenizer", model_copy(|m| std::fs::write(m.join("tokenizer.json"), "{\"model\": 3}").unwrap()), &["generate", "--model", "{d}/m", "--prompt", "hi"], &["tokenizer.json"]),
        c("PyTorch pickle only", model_copy(|m| { std::fs::remove_file(m.join("model.safetensors")).unwrap(); std::fs::write(m.join("pytorch_model.bin"), b"PK").unwrap(); }), &["generate", "--model", "{d}/m", "--prompt", "hi"], &["pytorch_model.bin"]),
        c("LoRA target that does not exist", toml("lora_r = 4\nlora_target_modules = [\"w_in\"]", ""), train, &["w_in"]),
        // ---- rewards
        c("unknown reward kind", toml("", "[[rewards]]\nkind = \"nope\"\n"), resolve, &["rewards", "nope"]),
        c("reward without kind", toml("", "[[rewards]]\nweight = 1.0\n"), resolve, &["rewards", "kind"]),
        c("bad regex", toml("", "[[rewards]]\nkind = \"format\"\npattern = \"(unclosed\"\n"), resolve, &["pattern"]),
        c("unknown reward option", toml("", "[[rewards]]\nkind = \"answer_match\"\nfuzzy = true\n"), resolve, &["fuzzy"]),
        c("unknown answer extraction", toml("", "[[rewards]]\nkind = \"answer_match\"\nextract = \"psychic\"\n"), resolve, &["extract", "psychic"]),
        c("command scorer without command", toml("", "[[rewards]]\nkind = \"command\"\n"), resolve, &["command"]),
        c("command scorer not found", toml("", "[[rewards]]\nkind = \"command\"\ncommand = [\"/nonexistent/scorer\"]\n"), train, &["/nonexistent/scorer"]),
        c("http reward bad URL", toml("", "[[rewards]]\nkind = \"http\"\nurl = \"ftp://x\"\n"), resolve, &["url"]),
        c("classifier model missing", toml("", "[[rewards]]\nkind = \"classifier\"\nmodel = \"{d}/nope\"\n"), train, &["nope"]),
        c("reward weights count", toml("reward_weights = [1.0, 2.0, 3.0]", "[[rewards]]\nkind = \"answer_match\"\n"), train, &["reward_weights"]),
        c("length reward negative", toml("", "[[rewards]]\nkind = \"length\"\nmax_length = -5\n"), resolve, &["max_length"]),
        c("duplicate reward names", toml("", "[[rewards]]\nkind = \"answer_match\"\nname = \"a\"\n[[rewards]]\nkind = \"answer_match\"\nname = \"a\"\n"), resolve, &["a"]),
        c("python reward function misnamed", toml("reward_funcs = [\"my.module:2bad\"]", ""), resolve, &["my.module:2bad", "module.function"]),
        c("unknown TRL reward", toml("reward_funcs = [\"psychic_reward\"]", ""), resolve, &["psychic_reward"]),
        // ---- command-line arguments
        c("resume without a checkpoint", nothing(), &["train", "--model={model}", "--output_dir={d}/typo/dir", "--resume"], &["typo/dir", "--resume"]),
        c("stray argument", toml("", ""), &["train", "--config", "{d}/run.toml", "stray"], &["stray"]),
        c("config without value", nothing(), &["train", "--max_steps=1", "--config"], &["--config"]),
        c("config given twice", nothing(), &["train", "--config", "a.toml", "--config=b.toml"], &["--config", "multiple times"]),
        c("generate dtype", nothing(), &["generate", "--model", "{model}", "--dtype", "f8", "--prompt", "hi"], &["--dtype", "f8"]),
        c("generate on CUDA without CUDA", nothing(), &["generate", "--model", "{model}", "--device", "cuda", "--prompt", "hi"], &["cuda"]),
        c("generate fill with a causal LM", nothing(), &["generate", "--model", "{model}", "--fill", "a[MASK]c"], &["config.json", "masked-LM"]),
        c("export missing checkpoint", nothing(), &["export", "--checkpoint", "{d}/nope", "--out", "{d}/x"], &["nope"]),
        c("report of a missing run", nothing(), &["report", "{d}/nope"], &["nope"]),
        c("rewards check missing samples", nothing(), &["rewards", "check", "--samples", "{d}/nope.jsonl"], &["nope.jsonl"]),
        c("eval k above samples", nothing(), &["eval", "--model", "{model}", "--k", "8", "--num_samples", "2"], &["--k"]),
        c("generate prompts file missing", nothing(), &["generate", "--model", "{model}", "--prompts", "{d}/nope.jsonl"], &["nope.jsonl"]),
        // ---- checkpoints
        c("half-written checkpoint", checkpoint(|c| std::fs::remove_file(c.join("optimizer.safetensors")).unwrap()), &["train", "--config", "{d}/run.toml", "--resume", "--max_steps=2"], &["checkpoint-1", "optimizer.safetensors"]),
        c("trainer state corrupt", checkpoint(|c| std::fs::write(c.join("trainer_state.json"), "{").unwrap()), &["train", "--config", "{d}/run.toml", "--resume", "--max_steps=2"], &["trainer_state.json"]),
        c("optimizer state of the wrong shape", checkpoint(|c| { let p = c.join("optimizer.safetensors"); let mut t = candle_core::safetensors::load(&p, &candle_core::Device::Cpu).unwrap(); let k = t.keys().find(|k| k.contains("q_proj")).unwrap().clone(); t.insert(k, candle_core::Tensor::zeros(3, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap()); candle_core::safetensors::save(&t, &p).unwrap(); }), &["train", "--config", "{d}/run.toml", "--resume", "--max_steps=2"], &["optimizer.safetensors", "shape"]),
        c("checkpoint of another model", checkpoint(|c| edit_tensors(c, |t| { let k = t.keys().find(|k| k.contains("gate_proj")).unwrap().clone(); t.insert(k, candle_core::Tensor::zeros((3, 3), candle_core::DType::F32, &candle_core::Device::Cpu).unwrap()); })), &["train", "--config", "{d}/run.toml", "--resume", "--max_steps=2"], &["checkpoint-1", "shape"]),
        c("eval of a broken checkpoint", checkpoint(|c| std::fs::write(c.join("model.safetensors"), b"").unwrap()), &["eval", "--model", "{d}/out/checkpoint-1", "--k", "1", "--num_samples", "1"], &["model.safetensors"]),
        c("export of a broken checkpoint", checkpoint(|c| std::fs::write(c.join("config.json"), b"[]").unwrap()), &["export", "--checkpoint", "{d}/out/checkpoint-1", "--out", "{d}/x"], &["config.json"]),
    ]
}

/// What a run left in `dir/out` that `--resume` would take for a checkpoint.
fn checkpoints(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir.join("out"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("checkpoint-"))
        .collect();
    v.sort();
    v
}

fn run_case(case: &Case, root: &Path) -> Result<(), String> {
    let d = root.join(case.name.replace(' ', "_"));
    std::fs::create_dir_all(&d).unwrap();
    (case.setup)(&d);
    let before = checkpoints(&d);
    let args: Vec<String> = case.args.iter().map(|a| fill(a, &d)).collect();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_grpo"));
    cmd.args(&args)
        .current_dir(&d)
        .env("RUST_BACKTRACE", "1")
        .env("RUST_LOG", "error")
        .env("GRPO_CACHE_DIR", d.join("cache"))
        .env("HF_HUB_OFFLINE", "1");
    match case.name {
        "bad fault spec" => cmd.env("GRPO_FAULTS", "write"),
        "bad instruction set" => cmd.env("GRPO_ISA", "sse9"),
        "bad kernel set in the environment" => cmd.env("GRPO_KERNELS", "gpu"),
        _ => &mut cmd,
    };
    let o = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    let why = |w: &str| Err(format!("{}: {w}\n--- stderr:\n{err}", case.name));
    let code = o.status.code();
    if o.status.success() {
        return why("exited 0");
    }
    if code == Some(101) || err.contains("panicked") {
        return why("panicked");
    }
    if code.is_none() {
        return why("killed by a signal");
    }
    if err.contains("stack backtrace") || err.contains("Stack backtrace") || err.contains("   0: ")
    {
        return why("printed a backtrace");
    }
    let errors = err
        .lines()
        .filter(|l| l.starts_with("error:") || l.starts_with("error["))
        .count();
    if errors != 1 {
        return why(&format!("{errors} error lines, expected one"));
    }
    for f in &case.expect {
        let f = fill(f, &d);
        if !err.contains(&f) {
            return why(&format!("the message does not contain `{f}`"));
        }
    }
    if checkpoints(&d) != before {
        return why(&format!(
            "left checkpoints: {:?} (before: {before:?})",
            checkpoints(&d)
        ));
    }
    Ok(())
}

/// Every case of the corpus, two at a time; the failures are listed together.
#[test]
fn every_bad_input_is_a_clear_error() {
    let root = tempfile::tempdir().unwrap();
    model();
    let cases = cases();
    let n = cases.len();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let failures = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let Some(case) = cases.get(i) else { break };
                if let Err(e) = run_case(case, root.path()) {
                    failures.lock().unwrap().push(e);
                }
            });
        }
    });
    let failures = failures.into_inner().unwrap();
    eprintln!("bad-input corpus: {n} cases, {} failed", failures.len());
    assert!(n >= 80, "the corpus has {n} cases");
    assert!(
        failures.is_empty(),
        "{} of {n} cases failed:\n\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}

/// Names are unique (each case gets its own directory).
#[test]
fn case_names_are_unique() {
    let mut names: Vec<&str> = cases().iter().map(|c| c.name).collect();
    let n = names.len();
    names.sort();
    names.dedup();
    assert_eq!(names.len(), n);
}
