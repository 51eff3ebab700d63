//! Hub datasets (`dataset_name` = a hub id): finding a split's files and fetching them.

use std::fs::{self};
use std::path::PathBuf;

use hf_hub::{Cache, Repo, RepoType};
use tracing::{info, warn};

use super::hf::{http_status, HubSettings, VerifiedFetch};
use crate::error::{Error, Result};

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
