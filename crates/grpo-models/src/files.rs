//! Files of a Hugging Face model directory: the safetensors shards (or a PyTorch `.bin`), JSON
//! configs and `tokenizer.json`. Shared by the causal-LM loader ([`crate::weights`]) and the
//! reward-model encoders ([`crate::models::encoder`], [`crate::models::seq_cls`]).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

use crate::{Error, Result};

/// Reads `path` as JSON.
pub fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::file(path, format!("cannot read: {e}")))?;
    serde_json::from_str(&text).map_err(|e| Error::file(path, format!("invalid JSON: {e}")))
}

/// The safetensors files of an HF directory: `model.safetensors`, or the shards listed in
/// `model.safetensors.index.json`.
pub fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let v = read_json(&index)?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| Error::file(&index, "missing object `weight_map`"))?;
        let mut files: Vec<PathBuf> = Vec::new();
        for f in map.values().filter_map(|f| f.as_str()) {
            // A shard is a file of the model directory, never a path out of it.
            let plain = Path::new(f)
                .components()
                .all(|c| matches!(c, std::path::Component::Normal(_)));
            if !plain {
                return Err(Error::file(
                    &index,
                    format!("shard `{f}` is not a file name inside the model directory"),
                ));
            }
            files.push(dir.join(f));
        }
        files.sort();
        files.dedup();
        for f in &files {
            if !f.is_file() {
                return Err(Error::file(
                    f,
                    "shard listed in model.safetensors.index.json is missing",
                ));
            }
        }
        return Ok(files);
    }
    let hint = if dir.join("pytorch_model.bin").exists() {
        " (found pytorch_model.bin: convert it to safetensors, e.g. with transformers' save_pretrained(safe_serialization=True))"
    } else {
        ""
    };
    Err(Error::file(
        dir,
        format!("no model.safetensors or model.safetensors.index.json{hint}"),
    ))
}

/// All tensors of an HF directory as f32 on `device`: `model.safetensors`, the shards of
/// `model.safetensors.index.json`, or `pytorch_model.bin`. Returns them with the file they came
/// from (the index for shards), for error messages. Old checkpoints' LayerNorm `gamma`/`beta`
/// are renamed `weight`/`bias`, as transformers does.
pub(crate) fn read_weights(
    dir: &Path,
    device: &Device,
) -> Result<(HashMap<String, Tensor>, PathBuf)> {
    let mut tensors = HashMap::new();
    let origin;
    let bin = dir.join("pytorch_model.bin");
    let has_safetensors = dir.join("model.safetensors").is_file()
        || dir.join("model.safetensors.index.json").is_file();
    if !has_safetensors && bin.is_file() {
        let all = candle_core::pickle::read_all(&bin)
            .map_err(|e| Error::file(&bin, format!("cannot read the PyTorch checkpoint: {e}")))?;
        for (name, t) in all {
            let t = t.to_dtype(DType::F32)?.to_device(device)?;
            tensors.insert(name, t);
        }
        origin = bin;
    } else if !has_safetensors {
        return Err(Error::file(
            dir,
            "no model.safetensors, model.safetensors.index.json or pytorch_model.bin",
        ));
    } else {
        let files = safetensors_files(dir)?;
        origin = match files.as_slice() {
            [one] => one.clone(),
            _ => dir.join("model.safetensors.index.json"),
        };
        for file in files {
            // SAFETY: read-only mapping of a file we do not modify (see weights.rs).
            let st = unsafe { candle_core::safetensors::MmapedSafetensors::new(&file) }
                .map_err(|e| Error::file(&file, format!("not a valid safetensors file: {e}")))?;
            for (name, _) in st.tensors() {
                let t = st
                    .load(&name, device)
                    .map_err(|e| Error::file(&file, format!("cannot read tensor `{name}`: {e}")))?;
                tensors.insert(name, t.to_dtype(DType::F32)?);
            }
        }
    }
    let tensors = tensors
        .into_iter()
        .map(|(k, v)| {
            let k = match k.rsplit_once('.') {
                Some((m, "gamma")) => format!("{m}.weight"),
                Some((m, "beta")) => format!("{m}.bias"),
                _ => k,
            };
            (k, v)
        })
        .collect();
    Ok((tensors, origin))
}

/// Loads `dir/tokenizer.json`, or says how to make one.
pub(crate) fn require_tokenizer_json(dir: &Path) -> Result<PathBuf> {
    let path = dir.join("tokenizer.json");
    if path.is_file() {
        return Ok(path);
    }
    Err(Error::file(
        dir,
        "no tokenizer.json: reward models are tokenized with the fast tokenizer file. Write it \
         with transformers: `AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)`",
    ))
}

/// Writes `bytes` to `path` and syncs it to disk.
pub fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    if let Some(e) = crate::faults::write_error(path) {
        return Err(Error::file(path, format!("cannot write: {e}")));
    }
    let mut f =
        std::fs::File::create(path).map_err(|e| Error::file(path, format!("cannot write: {e}")))?;
    f.write_all(bytes)
        .and_then(|_| f.sync_all())
        .map_err(|e| Error::file(path, format!("cannot write: {e}")))
}

/// Writes `path` whole or not at all: into a temporary file beside it, synced, then renamed over
/// it (a kill or a full disk leaves the old file as it was).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let name = path
        .file_name()
        .map_or_else(|| "file".into(), |n| n.to_string_lossy().into_owned());
    let tmp = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    write_file(&tmp, bytes)
        .and_then(|_| {
            std::fs::rename(&tmp, path)
                .map_err(|e| Error::file(path, format!("cannot replace: {e}")))
        })
        .inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
}

/// Writes `tensors` (moved to the CPU, contiguous) as one safetensors file and syncs it. The
/// header's metadata says `{"format": "pt"}`, as transformers writes it (older transformers
/// releases refuse files without it).
pub fn save_tensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<()> {
    let map: HashMap<String, Tensor> = tensors
        .iter()
        .map(|(n, t)| Ok((n.clone(), t.to_device(&Device::Cpu)?.contiguous()?)))
        .collect::<candle_core::Result<_>>()?;
    if let Some(e) = crate::faults::write_error(path) {
        return Err(Error::file(path, format!("cannot write: {e}")));
    }
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(map.iter(), Some(metadata), path)
        .map_err(|e| Error::file(path, format!("cannot write: {e}")))?;
    std::fs::File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(|e| Error::file(path, format!("cannot sync: {e}")))
}

#[cfg(test)]
pub(crate) mod proptests {
    use super::*;
    use proptest::prelude::*;
    use proptest::test_runner::RngSeed;

    /// The same cases on every run, so that CI cannot fail by chance; `PROPTEST_RNG_SEED=N`
    /// explores others.
    pub(crate) fn seed() -> RngSeed {
        match ProptestConfig::default().rng_seed {
            RngSeed::Random => RngSeed::Fixed(0x6772_706f),
            s => s,
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 2000,
            rng_seed: seed(),
            ..ProptestConfig::default()
        })]

        /// Any bytes as model.safetensors: an error or tensors, never a panic. The header length
        /// and its JSON are the parts a corrupt file gets wrong, so half the cases keep a
        /// plausible length prefix.
        #[test]
        fn safetensors_of_any_bytes_never_panic(
            body in proptest::collection::vec(any::<u8>(), 0..256),
            json in "\\{\"[a-z]{1,3}\":\\{\"dtype\":\"(F32|F16|BF16|I64|U8|XX)\",\"shape\":\\[[0-9]{1,3}(,[0-9]{1,2})?\\],\"data_offsets\":\\[[0-9]{1,3},[0-9]{1,3}\\]\\}\\}",
            structured in any::<bool>(),
        ) {
            let dir = tempfile::tempdir().unwrap();
            let bytes = if structured {
                let mut b = (json.len() as u64).to_le_bytes().to_vec();
                b.extend(json.as_bytes());
                b.extend(&body);
                b
            } else {
                body
            };
            std::fs::write(dir.path().join("model.safetensors"), bytes).unwrap();
            let _ = read_weights(dir.path(), &Device::Cpu);
        }
    }
}
