//! The Hugging Face hub: its settings, client, errors, and downloads checked against the hub's
//! own hashes.

use std::collections::{BTreeSet, HashMap};
use std::fs::{self};
use std::io::{self, IsTerminal};
use std::path::{Component, Path, PathBuf};

use hf_hub::api::sync::{ApiBuilder, ApiError};
use hf_hub::{Cache, Repo, RepoType};
use sha2::Digest;
use tracing::{info, warn};

use super::pypi::{digest_file, http_agent, sha256_file};
use super::{
    cache_dir, DEFAULT_HF_ENDPOINT, HUB_OPTIONAL_FILES, SAFETENSORS_INDEX, SAFETENSORS_SINGLE,
};
use crate::error::{Error, Result};

/// Where and how to talk to the hub.
#[derive(Debug, Clone)]
pub(super) struct HubSettings {
    pub(super) endpoint: String,
    /// hf-hub's cache (the directory holding `models--owner--name`).
    pub(super) cache: PathBuf,
    pub(super) token: Option<String>,
    pub(super) progress: bool,
    /// `HF_HUB_OFFLINE=1`: only the cache is used.
    pub(super) offline: bool,
}

impl HubSettings {
    /// `HF_ENDPOINT`, `HF_HUB_CACHE` / `HF_HOME`, `HF_TOKEN`, as the Python tools read them.
    pub(super) fn from_env() -> Self {
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
    pub(super) fn client(&self) -> std::result::Result<hf_hub::api::sync::Api, ApiError> {
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
pub(super) fn http_status(err: &ApiError) -> Option<u16> {
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
pub(super) struct HubFileHash {
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

pub(super) fn parse_hub_file_hashes(
    text: &str,
) -> std::result::Result<HashMap<String, HubFileHash>, String> {
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
pub(super) fn git_blob_id(path: &Path) -> io::Result<String> {
    let len = fs::metadata(path)?.len();
    let mut hasher = sha1::Sha1::new();
    hasher.update(format!("blob {len}\0").as_bytes());
    digest_file(path, hasher)
}

/// Checks a file just downloaded from the hub against the hub's own hash of it: the LFS sha256
/// where the hub gives one (weights, data shards), else the git blob id. A mismatch deletes the
/// download (so that the next try fetches it again) and is an error naming the file.
pub(super) fn verify_hub_file(
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
pub(super) struct VerifiedFetch<'a> {
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
    pub(super) fn new(
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
    pub(super) fn get(
        &mut self,
        name: &str,
        failed: impl FnOnce(ApiError) -> Error,
    ) -> Result<PathBuf> {
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
pub(super) fn fetch_from_hub(id: &str, hub: &HubSettings) -> Result<PathBuf> {
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
pub(super) fn shard_names(index: &Path) -> Result<Vec<String>> {
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
pub(super) fn cached_snapshot(cache: &Path, id: &str) -> Option<PathBuf> {
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
