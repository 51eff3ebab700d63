//! MLflow through its REST API (`MLFLOW_TRACKING_URI`, an `http(s)://` server such as
//! `mlflow server`): the experiment `MLFLOW_EXPERIMENT_NAME` (default "grpo") is found or
//! created, a run is created (or, on `--resume`, the recorded one continued), the resolved config
//! is logged as params, every logged step's metrics in one `log-batch` request, and at the end
//! `config.toml`, `metrics.jsonl`, `completions.jsonl` (and the report, once written) as
//! artifacts through the server's artifact proxy. MLflow's metric names allow letters, digits and
//! `_ - . / : space`; others are spelled out (`eval/pass@4` is `eval/pass_at_4`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};

use super::{read_state, write_state, RunInfo, Tracker};
use crate::{Error, Result};

/// A client of one MLflow server.
struct Client {
    base: String,
    agent: ureq::Agent,
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Client {
    fn new(uri: &str) -> Result<Self> {
        let base = uri.trim_end_matches('/').to_string();
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(Error::config(
                "MLFLOW_TRACKING_URI",
                format!(
                    "`{uri}`: grpo talks to an MLflow server over HTTP; start one \
                     (`mlflow server --backend-store-uri sqlite:///mlflow.db`) and set \
                     MLFLOW_TRACKING_URI=http://127.0.0.1:5000"
                ),
            ));
        }
        let agent = ureq::AgentBuilder::new()
            .timeout(Duration::from_secs(30))
            .build();
        Ok(Self { base, agent })
    }

    fn error(&self, what: &str, e: ureq::Error) -> Error {
        let why = match e {
            ureq::Error::Status(code, resp) => {
                // The body only adds detail to the message; the status is the error.
                format!("HTTP {code}: {}", resp.into_string().unwrap_or_default())
            }
            ureq::Error::Transport(t) => format!(
                "{t}; is the server up at {}? (MLFLOW_TRACKING_URI)",
                self.base
            ),
        };
        Error::tracker("mlflow", format!("{what}: {why}"))
    }

    fn post(&self, path: &str, body: &Value) -> Result<Value> {
        let url = format!("{}/api/2.0/mlflow/{path}", self.base);
        let resp = self
            .agent
            .post(&url)
            .set("Content-Type", "application/json")
            .send_string(&body.to_string())
            .map_err(|e| self.error(path, e))?;
        resp.into_json::<Value>()
            .map_err(|e| Error::tracker("mlflow", format!("{path}: unreadable answer: {e}")))
    }

    /// The id of experiment `name`, created when missing.
    fn experiment(&self, name: &str) -> Result<String> {
        let url = format!("{}/api/2.0/mlflow/experiments/get-by-name", self.base);
        match self.agent.get(&url).query("experiment_name", name).call() {
            Ok(r) => {
                let v: Value = r.into_json().map_err(|e| {
                    Error::tracker("mlflow", format!("experiments/get-by-name: {e}"))
                })?;
                if let Some(id) = v["experiment"]["experiment_id"].as_str() {
                    return Ok(id.to_string());
                }
            }
            Err(ureq::Error::Status(404, _)) => {}
            Err(e) => return Err(self.error("experiments/get-by-name", e)),
        }
        let v = self.post("experiments/create", &json!({ "name": name }))?;
        v["experiment_id"]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| Error::tracker("mlflow", format!("experiments/create: {v}")))
    }

    /// Uploads `file` as `name` into the run's artifacts (`mlflow-artifacts:/...` through the
    /// server's proxy; a local artifact root is copied into).
    fn upload(&self, artifact_uri: &str, file: &Path, name: &str) -> Result<()> {
        let bytes =
            std::fs::read(file).map_err(|e| Error::file(file, format!("cannot read: {e}")))?;
        if let Some(rest) = artifact_uri.strip_prefix("mlflow-artifacts:") {
            let url = format!(
                "{}/api/2.0/mlflow-artifacts/artifacts/{}/{name}",
                self.base,
                rest.trim_start_matches('/')
            );
            self.agent
                .put(&url)
                .send_bytes(&bytes)
                .map_err(|e| self.error("artifact upload", e))?;
            return Ok(());
        }
        let local = artifact_uri.strip_prefix("file://").unwrap_or(artifact_uri);
        if local.starts_with('/') {
            let to = Path::new(local).join(name);
            if let Some(p) = to.parent() {
                std::fs::create_dir_all(p)
                    .map_err(|e| Error::file(p, format!("cannot create: {e}")))?;
            }
            return grpo_models::files::write_file(&to, &bytes);
        }
        let why = format!(
            "artifacts at `{artifact_uri}` cannot be written by grpo; start the server with \
             artifact serving (the default of `mlflow server`)"
        );
        Err(Error::tracker("mlflow", why))
    }
}

/// An MLflow metric name for `key`.
pub fn metric_name(key: &str) -> String {
    key.replace('@', "_at_")
        .chars()
        .map(
            |c| match c.is_ascii_alphanumeric() || "_-./: ".contains(c) {
                true => c,
                false => '_',
            },
        )
        .collect()
}

/// Logs to one MLflow run.
pub struct MlflowTracker {
    client: Client,
    run_id: String,
    artifact_uri: String,
}

impl MlflowTracker {
    pub fn start(info: &RunInfo) -> Result<Self> {
        let uri = std::env::var("MLFLOW_TRACKING_URI").map_err(|_| {
            Error::config(
                "MLFLOW_TRACKING_URI",
                "is not set: point it at an MLflow server, e.g. \
                 MLFLOW_TRACKING_URI=http://127.0.0.1:5000 (`mlflow server` starts one)",
            )
        })?;
        let client = Client::new(&uri)?;
        let recorded = read_state(&info.output_dir, "mlflow");
        let resumed = (info.resume && recorded["tracking_uri"].as_str() == Some(uri.as_str()))
            .then(|| {
                Some((
                    recorded["run_id"].as_str()?.to_string(),
                    recorded["artifact_uri"].as_str()?.to_string(),
                ))
            })
            .flatten();
        let (run_id, artifact_uri) = match resumed {
            Some((id, art)) => {
                client.post("runs/update", &json!({"run_id": id, "status": "RUNNING"}))?;
                (id, art)
            }
            None => {
                let name =
                    std::env::var("MLFLOW_EXPERIMENT_NAME").unwrap_or_else(|_| "grpo".into());
                let experiment_id = client.experiment(&name)?;
                let v = client.post(
                    "runs/create",
                    &json!({
                        "experiment_id": experiment_id,
                        "run_name": info.run_name,
                        "start_time": now_ms(),
                        "tags": [{"key": "mlflow.source.name", "value": "grpo"},
                                 {"key": "grpo.output_dir", "value": info.output_dir.display().to_string()}],
                    }),
                )?;
                let run = &v["run"]["info"];
                let (Some(id), Some(art)) = (run["run_id"].as_str(), run["artifact_uri"].as_str())
                else {
                    return Err(Error::tracker("mlflow", format!("runs/create: {v}")));
                };
                let t = MlflowTracker {
                    client,
                    run_id: id.to_string(),
                    artifact_uri: art.to_string(),
                };
                t.log_params(&info.config)?;
                write_state(
                    &info.output_dir,
                    "mlflow",
                    json!({"tracking_uri": uri, "run_id": id, "artifact_uri": art,
                           "experiment_id": experiment_id}),
                )?;
                return Ok(t);
            }
        };
        Ok(MlflowTracker {
            client,
            run_id,
            artifact_uri,
        })
    }

    /// The config as params, 100 per request (MLflow's limit), values cut to 6,000 characters.
    fn log_params(&self, config: &serde_json::Map<String, Value>) -> Result<()> {
        let params: Vec<Value> = config
            .iter()
            .map(|(k, v)| {
                let text = match v {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                json!({"key": metric_name(k), "value": text.chars().take(6000).collect::<String>()})
            })
            .collect();
        for chunk in params.chunks(100) {
            self.client.post(
                "runs/log-batch",
                &json!({"run_id": self.run_id, "params": chunk}),
            )?;
        }
        Ok(())
    }
}

impl Tracker for MlflowTracker {
    fn name(&self) -> &'static str {
        "mlflow"
    }

    fn log(&mut self, step: u64, metrics: &[(String, f64)]) -> Result<()> {
        let ts = now_ms();
        let rows: Vec<Value> = metrics
            .iter()
            .filter(|(_, v)| v.is_finite())
            .map(|(k, v)| json!({"key": metric_name(k), "value": v, "timestamp": ts, "step": step}))
            .collect();
        for chunk in rows.chunks(1000) {
            self.client.post(
                "runs/log-batch",
                &json!({"run_id": self.run_id, "metrics": chunk}),
            )?;
        }
        Ok(())
    }

    fn finish(&mut self, artifacts: &[PathBuf]) -> Result<()> {
        for f in artifacts.iter().filter(|f| f.is_file()) {
            let name = f.file_name().and_then(|n| n.to_str()).unwrap_or("file");
            self.client.upload(&self.artifact_uri, f, name)?;
        }
        self.client.post(
            "runs/update",
            &json!({"run_id": self.run_id, "status": "FINISHED", "end_time": now_ms()}),
        )?;
        Ok(())
    }
}

/// Uploads `file` into the MLflow run recorded in `output_dir/trackers.json`, if any.
pub fn upload_to_recorded_run(output_dir: &Path, file: &Path) -> Result<()> {
    let rec = read_state(output_dir, "mlflow");
    let (Some(uri), Some(art)) = (rec["tracking_uri"].as_str(), rec["artifact_uri"].as_str())
    else {
        return Ok(());
    };
    let name = file.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    Client::new(uri)?.upload(art, file, name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_names_are_ones_mlflow_takes() {
        assert_eq!(metric_name("eval/pass@4"), "eval/pass_at_4");
        assert_eq!(metric_name("rewards/judge/mean"), "rewards/judge/mean");
        assert_eq!(metric_name("time/reward/x(y)"), "time/reward/x_y_");
    }

    #[test]
    fn a_tracking_uri_that_is_not_a_server_says_how_to_start_one() {
        let e = Client::new("./mlruns").err().unwrap().to_string();
        assert!(
            e.contains("MLFLOW_TRACKING_URI") && e.contains("mlflow server"),
            "{e}"
        );
    }
}
