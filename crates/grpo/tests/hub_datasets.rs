//! `dataset_name` as a hub id: the split is fetched through the hub client (from a mock hub on
//! 127.0.0.1 set as HF_ENDPOINT) into the hub cache, trains, and is found again offline; hub
//! downloads (datasets and models) are checked against the hub's hashes. One test in its own
//! process, since it sets the HF_* environment.

use std::path::{Path, PathBuf};

use grpo::config::{Format, TrainConfig};
use grpo::train::{train, RunControl};

#[path = "support/mock_hub.rs"]
mod mock_hub;
#[path = "support/tiny_llama.rs"]
mod support;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

#[test]
fn a_hub_dataset_is_fetched_trained_on_and_found_offline() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    support::tiny_llama(&model, &fixtures());
    let rows: Vec<String> = (0..8)
        .map(|i| format!("{{\"prompt\": \"{i} + 1 =\", \"solution\": \"{}\"}}", i + 1))
        .collect();
    let train_rows = rows.join("\n").into_bytes();
    let test_rows = rows[..2].join("\n").into_bytes();
    let endpoint = mock_hub::serve_dataset(
        "someone/tiny-math",
        vec![
            ("README.md".into(), b"# tiny".to_vec()),
            ("data/train-00000-of-00001.jsonl".into(), b"{}".to_vec()),
            ("data/train.jsonl".into(), train_rows.clone()),
            ("data/test-00000-of-00001.parquet".into(), test_rows.clone()),
            // A configuration whose train split is in two shards (issue 33).
            (
                "shards/train-00000-of-00002.jsonl".into(),
                rows[..5].join("\n").into_bytes(),
            ),
            (
                "shards/train-00001-of-00002.jsonl".into(),
                rows[5..].join("\n").into_bytes(),
            ),
        ],
    );
    let home = tmp.path().join("hf");
    std::env::set_var("HF_ENDPOINT", &endpoint);
    std::env::set_var("HF_HOME", &home);
    std::env::remove_var("HF_HUB_OFFLINE");
    let out = tmp.path().join("out");
    let yaml = format!(
        "model_name_or_path: {}\ndataset_name: someone/tiny-math\ndataset_train_split: train\n\
         output_dir: {}\nper_device_train_batch_size: 4\nnum_generations: 4\n\
         max_completion_length: 4\nmax_steps: 1\nreport_to: none\nreward_funcs: [accuracy_reward]\n\
         threads: 2\n",
        model.display(),
        out.display()
    );
    let cfg = TrainConfig::from_str(&yaml, Format::Yaml, "trl.yaml", &[]).unwrap();
    let file = cfg.data.train_file.clone().unwrap();
    assert!(
        file.starts_with(home.join("hub/datasets--someone--tiny-math")),
        "{file:?}"
    );
    assert_eq!(std::fs::read(&file).unwrap(), train_rows);
    assert_eq!(train(&cfg, &RunControl::default()).unwrap().steps, 1);

    // dataset_config: the configuration's two shards, fetched and read as one split.
    let sharded = yaml
        .replace(
            "dataset_train_split: train\n",
            "dataset_train_split: train\ndataset_config: shards\n",
        )
        .replace(
            &out.display().to_string(),
            &tmp.path().join("out-shards").display().to_string(),
        );
    let cfg = TrainConfig::from_str(&sharded, Format::Yaml, "trl.yaml", &[]).unwrap();
    let pattern = cfg.data.train_file.clone().unwrap();
    assert!(pattern.ends_with("shards/train-*.jsonl"), "{pattern:?}");
    let fields = grpo::inputs::data_fields(&cfg);
    assert_eq!(
        grpo::data::load_examples(&pattern, &fields)
            .unwrap()
            .examples
            .len(),
        8
    );
    assert_eq!(train(&cfg, &RunControl::default()).unwrap().steps, 1);

    // The test split is the one parquet shard; offline, both come from the cache.
    let with_test = format!("{yaml}dataset_test_split: test\n");
    let cfg = TrainConfig::from_str(&with_test, Format::Yaml, "trl.yaml", &[]).unwrap();
    assert_eq!(
        std::fs::read(cfg.data.eval_file.unwrap()).unwrap(),
        test_rows
    );
    std::env::set_var("HF_HUB_OFFLINE", "1");
    let cfg = TrainConfig::from_str(&with_test, Format::Yaml, "trl.yaml", &[]).unwrap();
    assert_eq!(cfg.data.train_file.unwrap(), file);
    // A split nobody fetched, offline: the error says so and names the key.
    let e = TrainConfig::from_str(
        &format!("{yaml}dataset_test_split: validation\n"),
        Format::Yaml,
        "trl.yaml",
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("dataset_name") && e.contains("HF_HUB_OFFLINE"),
        "{e}"
    );
    std::env::remove_var("HF_HUB_OFFLINE");
    // An unknown dataset: the hub's 404, named.
    let e = TrainConfig::from_str(
        &yaml.replace("someone/tiny-math", "someone/nothing-here"),
        Format::Yaml,
        "trl.yaml",
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("someone/nothing-here") && e.contains("404"),
        "{e}"
    );

    // Every download is checked against the hub's hashes (issue 34): a data file whose git blob
    // id is not the hub's is refused, named, and deleted from the cache.
    let liar = mock_hub::serve(
        "datasets",
        "someone/altered",
        vec![("data/train.jsonl".into(), train_rows.clone())],
        &["data/train.jsonl"],
    );
    std::env::set_var("HF_ENDPOINT", &liar);
    let e = TrainConfig::from_str(
        &yaml.replace("someone/tiny-math", "someone/altered"),
        Format::Yaml,
        "trl.yaml",
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("data/train.jsonl of dataset `someone/altered`: its git blob id is"),
        "{e}"
    );
    let snapshot = home.join(format!(
        "hub/datasets--someone--altered/snapshots/{}",
        mock_hub::SHA
    ));
    assert!(!snapshot.join("data/train.jsonl").exists());

    // A model by hub id: fetched, each file checked (the weights by their LFS sha256), loaded;
    // a model whose weights do not match is refused the same way.
    let files: Vec<(String, Vec<u8>)> = std::fs::read_dir(&model)
        .unwrap()
        .map(|e| e.unwrap())
        .map(|e| {
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    for (id, lie) in [
        ("someone/tiny-llama", None),
        ("someone/altered-llama", Some("model.safetensors")),
    ] {
        let endpoint = mock_hub::serve("models", id, files.clone(), lie.as_slice());
        std::env::set_var("HF_ENDPOINT", &endpoint);
        let r = grpo_models::hub::resolve_model(Some(id));
        match lie {
            None => {
                let src = r.unwrap();
                let m = grpo_models::weights::load_model(
                    &src,
                    candle_core::DType::F32,
                    &candle_core::Device::Cpu,
                )
                .unwrap();
                assert_eq!(m.config.num_layers, 2);
            }
            Some(f) => {
                let e = r.unwrap_err().to_string();
                assert!(
                    e.contains(&format!("{f} of model `{id}`: its sha256 is")),
                    "{e}"
                );
            }
        }
    }
}
