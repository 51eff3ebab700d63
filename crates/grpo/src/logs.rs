//! Metrics sinks: `metrics.jsonl` (one JSON object per logged step), TensorBoard event files, and
//! free-form JSON-lines files (completions, eval answers).
//!
//! The TensorBoard writer is hand-written (about 60 lines): an event file is TFRecord framing
//! (length, masked CRC-32C of the length, payload, masked CRC-32C of the payload) around `Event`
//! protobufs, and a scalar needs only four protobuf fields. The available crates pull in a whole
//! protobuf stack for this.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::{Error, Result};

/// Writes metrics of a run directory.
pub struct MetricsWriter {
    dir: PathBuf,
    jsonl: File,
    tb: Option<File>,
    /// MLflow, W&B: every logged step and completion goes to them too.
    trackers: crate::trackers::Trackers,
}

fn open_append(path: &Path) -> Result<File> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)
            .map_err(|e| Error::io(format!("cannot create {}", parent.display()), e))?;
    }
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| Error::io(format!("cannot open {}", path.display()), e))
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl MetricsWriter {
    /// Opens (appending) `dir/metrics.jsonl` and, when `tensorboard`, a new event file in `dir/tb/`.
    pub fn open(dir: &Path, tensorboard: bool) -> Result<Self> {
        let jsonl = open_append(&dir.join("metrics.jsonl"))?;
        let tb = if tensorboard {
            let host =
                std::fs::read_to_string("/etc/hostname").unwrap_or_else(|_| "localhost".into());
            let name = format!("events.out.tfevents.{}.{}.grpo", now() as u64, host.trim());
            let mut f = open_append(&dir.join("tb").join(name))?;
            let first = tb::event(now(), 0, Some("brain.Event:2"), &[]);
            tb::write_record(&mut f, &first)
                .map_err(|e| Error::io("cannot write the TensorBoard file", e))?;
            Some(f)
        } else {
            None
        };
        Ok(Self {
            dir: dir.to_path_buf(),
            jsonl,
            tb,
            trackers: Default::default(),
        })
    }

    /// A writer that writes nothing anywhere (the ranks of a data-parallel run other than 0).
    pub fn discard() -> Result<Self> {
        let jsonl = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/null")
            .map_err(|e| Error::io("cannot open /dev/null", e))?;
        Ok(Self {
            dir: std::env::temp_dir(),
            jsonl,
            tb: None,
            trackers: Default::default(),
        })
    }

    /// Sends what is logged from now on to `trackers` too.
    pub fn with_trackers(mut self, trackers: crate::trackers::Trackers) -> Self {
        self.trackers = trackers;
        self
    }

    /// The run is over: the trackers get the run's files and close.
    pub fn finish(&mut self) {
        let files = ["config.toml", "metrics.jsonl", "completions.jsonl"].map(|f| self.dir.join(f));
        self.trackers.finish(&files);
    }

    /// One line of `metrics.jsonl` and one TensorBoard scalar per metric (non-finite values are
    /// written as null to the JSON and skipped in TensorBoard).
    pub fn log(&mut self, step: u64, metrics: &[(String, f64)]) -> Result<()> {
        let mut obj = serde_json::Map::new();
        obj.insert("step".into(), step.into());
        obj.insert("time".into(), now().into());
        for (k, v) in metrics {
            obj.insert(
                k.clone(),
                serde_json::Number::from_f64(*v).map_or(Value::Null, Value::Number),
            );
        }
        let line = Value::Object(obj).to_string();
        writeln!(self.jsonl, "{line}").map_err(|e| {
            Error::io(
                format!("cannot write {}", self.dir.join("metrics.jsonl").display()),
                e,
            )
        })?;
        if let Some(f) = &mut self.tb {
            let scalars: Vec<(&str, f32)> = metrics
                .iter()
                .filter(|(_, v)| v.is_finite())
                .map(|(k, v)| (k.as_str(), *v as f32))
                .collect();
            let ev = tb::event(now(), step as i64, None, &scalars);
            tb::write_record(f, &ev)
                .map_err(|e| Error::io("cannot write the TensorBoard file", e))?;
        }
        self.trackers.log(step, metrics);
        Ok(())
    }

    /// Appends a JSON line to `dir/<file>`.
    pub fn log_json(&mut self, file: &str, value: &Value) -> Result<()> {
        if file == "completions.jsonl" {
            self.trackers.log_completion(value);
        }
        let path = self.dir.join(file);
        let mut f = open_append(&path)?;
        writeln!(f, "{value}").map_err(|e| Error::io(format!("cannot write {}", path.display()), e))
    }
}

/// For resume: drops the lines of `metrics.jsonl`, `completions.jsonl`, `groups.jsonl` and
/// `health.jsonl` with `step` > `step`, and a last line cut short by a kill; deletes
/// `eval/step-N.jsonl` for N > `step`; drops the TensorBoard events (`tb/`) of later steps and a
/// record cut short. So a resumed run does not log the same steps twice. Files are replaced
/// atomically.
pub fn truncate_after(dir: &Path, step: u64) -> Result<()> {
    retain_steps(dir, |s| s <= step)
}

/// For a fresh run in an `output_dir` that holds an earlier run's logs: drops every logged step
/// of `metrics.jsonl`, `completions.jsonl`, `groups.jsonl`, `health.jsonl` and `eval/`, and the
/// earlier run's TensorBoard event files, so the two runs' lines and curves do not mix. Returns whether there
/// was anything to drop.
pub fn clear_logs(dir: &Path) -> Result<bool> {
    let events = tb_files(dir);
    let had = dir.join("metrics.jsonl").is_file()
        || dir.join("completions.jsonl").is_file()
        || !events.is_empty();
    retain_steps(dir, |_| false)?;
    for f in events {
        std::fs::remove_file(&f)
            .map_err(|e| Error::io(format!("cannot delete {}", f.display()), e))?;
    }
    Ok(had)
}

/// The TensorBoard event files grpo wrote in `dir/tb/`.
fn tb_files(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut files: Vec<_> = std::fs::read_dir(dir.join("tb"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("events.out.tfevents."))
        })
        .collect();
    files.sort();
    files
}

/// Keeps the records of a TensorBoard event file whose event's step passes `keep` (an event
/// without a step, as the file-version header, is step 0), byte for byte; a record cut short
/// by a kill ends the file.
fn retain_tb_steps(path: &Path, keep: &impl Fn(u64) -> bool) -> Result<()> {
    let bytes =
        std::fs::read(path).map_err(|e| Error::io(format!("cannot read {}", path.display()), e))?;
    let mut kept = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i + 12 <= bytes.len() {
        let mut len = [0u8; 8];
        len.copy_from_slice(&bytes[i..i + 8]);
        let n = u64::from_le_bytes(len) as usize;
        let end = match (i + 12).checked_add(n).and_then(|e| e.checked_add(4)) {
            Some(e) if e <= bytes.len() => e,
            _ => break,
        };
        if keep(tb::event_step(&bytes[i + 12..i + 12 + n]).unwrap_or(0)) {
            kept.extend_from_slice(&bytes[i..end]);
        }
        i = end;
    }
    grpo_models::files::write_atomic(path, &kept)
}

fn retain_steps(dir: &Path, keep: impl Fn(u64) -> bool) -> Result<()> {
    for name in [
        "metrics.jsonl",
        "completions.jsonl",
        "groups.jsonl",
        "health.jsonl",
    ] {
        let path = dir.join(name);
        let Ok(f) = File::open(&path) else { continue };
        let mut kept = String::new();
        for line in BufReader::new(f).lines() {
            let line = line.map_err(|e| Error::io(format!("cannot read {}", path.display()), e))?;
            // A line that is not JSON was cut short by a kill: it goes.
            let Ok(v) = serde_json::from_str::<Value>(&line) else {
                continue;
            };
            if v.get("step").and_then(Value::as_u64).is_none_or(&keep) {
                kept.push_str(&line);
                kept.push('\n');
            }
        }
        grpo_models::files::write_atomic(&path, kept.as_bytes())?;
    }
    for f in tb_files(dir) {
        retain_tb_steps(&f, &keep)?;
    }
    let eval = dir.join("eval");
    for e in std::fs::read_dir(&eval).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let n = name
            .strip_prefix("step-")
            .and_then(|r| r.strip_suffix(".jsonl"))
            .and_then(|n| n.parse::<u64>().ok());
        if n.is_some_and(|n| !keep(n)) {
            std::fs::remove_file(e.path())
                .map_err(|err| Error::io(format!("cannot delete {}", e.path().display()), err))?;
        }
    }
    Ok(())
}

/// TensorBoard event encoding.
pub mod tb {
    use std::io::Write;

    fn varint(mut v: u64, out: &mut Vec<u8>) {
        while v >= 0x80 {
            out.push((v as u8) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }
    fn tag(field: u32, wire: u32, out: &mut Vec<u8>) {
        varint(((field << 3) | wire) as u64, out);
    }
    fn bytes(field: u32, b: &[u8], out: &mut Vec<u8>) {
        tag(field, 2, out);
        varint(b.len() as u64, out);
        out.extend_from_slice(b);
    }

    /// `Event { wall_time = 1 (double), step = 2 (int64), file_version = 3 (string),
    /// summary = 5 (Summary { repeated Value value = 1 { tag = 1, simple_value = 2 (float) } }) }`.
    pub fn event(
        wall_time: f64,
        step: i64,
        file_version: Option<&str>,
        scalars: &[(&str, f32)],
    ) -> Vec<u8> {
        let mut out = Vec::new();
        tag(1, 1, &mut out);
        out.extend_from_slice(&wall_time.to_le_bytes());
        tag(2, 0, &mut out);
        varint(step as u64, &mut out);
        if let Some(v) = file_version {
            bytes(3, v.as_bytes(), &mut out);
        }
        if !scalars.is_empty() {
            let mut summary = Vec::new();
            for (name, x) in scalars {
                let mut value = Vec::new();
                bytes(1, name.as_bytes(), &mut value);
                tag(2, 5, &mut value);
                value.extend_from_slice(&x.to_le_bytes());
                bytes(1, &value, &mut summary);
            }
            bytes(5, &summary, &mut out);
        }
        out
    }

    /// The `step` (field 2) of an encoded event, if it has one.
    pub fn event_step(ev: &[u8]) -> Option<u64> {
        fn read_varint(b: &[u8], i: &mut usize) -> Option<u64> {
            let (mut v, mut shift) = (0u64, 0);
            loop {
                let byte = *b.get(*i)?;
                *i += 1;
                v |= u64::from(byte & 0x7f) << shift;
                if byte < 0x80 {
                    return Some(v);
                }
                shift += 7;
                if shift > 63 {
                    return None;
                }
            }
        }
        let mut i = 0;
        while i < ev.len() {
            let key = read_varint(ev, &mut i)?;
            match (key >> 3, key & 7) {
                (2, 0) => return read_varint(ev, &mut i),
                (_, 0) => {
                    read_varint(ev, &mut i)?;
                }
                (_, 1) => i += 8,
                (_, 5) => i += 4,
                (_, 2) => {
                    let n = read_varint(ev, &mut i)? as usize;
                    i = i.checked_add(n)?;
                }
                _ => return None,
            }
        }
        None
    }

    pub fn masked_crc(data: &[u8]) -> u32 {
        let c = crc32c::crc32c(data);
        (c.rotate_right(15)).wrapping_add(0xa282_ead8)
    }

    /// TFRecord framing.
    pub fn write_record(w: &mut impl Write, data: &[u8]) -> std::io::Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        w.write_all(&len)?;
        w.write_all(&masked_crc(&len).to_le_bytes())?;
        w.write_all(data)?;
        w.write_all(&masked_crc(data).to_le_bytes())?;
        w.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Minimal reader: records (checking both CRCs) -> (step, [(tag, value)]).
    fn read_events(bytes: &[u8]) -> Vec<(i64, Vec<(String, f32)>)> {
        fn varint(b: &[u8], i: &mut usize) -> u64 {
            let (mut v, mut s) = (0u64, 0);
            loop {
                let x = b[*i];
                *i += 1;
                v |= ((x & 0x7f) as u64) << s;
                s += 7;
                if x < 0x80 {
                    return v;
                }
            }
        }
        fn fields(b: &[u8]) -> Vec<(u32, Vec<u8>)> {
            let mut i = 0;
            let mut out = vec![];
            while i < b.len() {
                let k = varint(b, &mut i);
                let (f, w) = ((k >> 3) as u32, k & 7);
                let v = match w {
                    0 => {
                        let s = i;
                        varint(b, &mut i);
                        b[s..i].to_vec()
                    }
                    1 => {
                        i += 8;
                        b[i - 8..i].to_vec()
                    }
                    5 => {
                        i += 4;
                        b[i - 4..i].to_vec()
                    }
                    2 => {
                        let n = varint(b, &mut i) as usize;
                        i += n;
                        b[i - n..i].to_vec()
                    }
                    _ => panic!("wire type {w}"),
                };
                out.push((f, v));
            }
            out
        }
        let mut i = 0;
        let mut out = vec![];
        while i < bytes.len() {
            let len_b = &bytes[i..i + 8];
            let len = u64::from_le_bytes(len_b.try_into().unwrap()) as usize;
            assert_eq!(
                u32::from_le_bytes(bytes[i + 8..i + 12].try_into().unwrap()),
                tb::masked_crc(len_b)
            );
            let data = &bytes[i + 12..i + 12 + len];
            assert_eq!(
                u32::from_le_bytes(bytes[i + 12 + len..i + 16 + len].try_into().unwrap()),
                tb::masked_crc(data)
            );
            i += 16 + len;
            let mut step = 0;
            let mut scalars = vec![];
            for (f, v) in fields(data) {
                if f == 2 {
                    step = varint(&v, &mut 0) as i64;
                }
                if f == 5 {
                    for (_, val) in fields(&v) {
                        let fs = fields(&val);
                        let name = String::from_utf8(fs[0].1.clone()).unwrap();
                        let x = f32::from_le_bytes(fs[1].1.clone().try_into().unwrap());
                        scalars.push((name, x));
                    }
                }
            }
            out.push((step, scalars));
        }
        out
    }

    #[test]
    fn jsonl_tensorboard_and_truncation() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = MetricsWriter::open(dir.path(), true).unwrap();
        w.log(1, &[("reward".into(), 0.5), ("loss".into(), f64::NAN)])
            .unwrap();
        w.log(2, &[("reward".into(), 0.75), ("time/generate".into(), 3.0)])
            .unwrap();
        w.log_json(
            "completions.jsonl",
            &serde_json::json!({"step": 2, "completion": "x"}),
        )
        .unwrap();
        let lines: Vec<Value> = std::fs::read_to_string(dir.path().join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["reward"], 0.5);
        assert!(lines[0]["loss"].is_null());
        let tbdir = dir.path().join("tb");
        let f = std::fs::read_dir(&tbdir)
            .unwrap()
            .next()
            .unwrap()
            .unwrap()
            .path();
        let events = read_events(&std::fs::read(f).unwrap());
        assert_eq!(events.len(), 3);
        assert_eq!(events[1], (1, vec![("reward".to_string(), 0.5)]));
        assert_eq!(events[2].1[1], ("time/generate".to_string(), 3.0));
        truncate_after(dir.path(), 1).unwrap();
        let n = std::fs::read_to_string(dir.path().join("metrics.jsonl"))
            .unwrap()
            .lines()
            .count();
        assert_eq!(n, 1);
        // TensorBoard too: the header and step 1 stay, byte for byte (CRCs still check); a
        // record cut short by a kill goes.
        let tb_file = tb_files(dir.path()).remove(0);
        let events = read_events(&std::fs::read(&tb_file).unwrap());
        assert_eq!(events.len(), 2);
        assert_eq!(events[1], (1, vec![("reward".to_string(), 0.5)]));
        let whole = std::fs::read(&tb_file).unwrap();
        let mut cut = whole.clone();
        cut.extend_from_slice(&[9, 0, 0, 0, 0, 0, 0, 0, 1, 2]);
        std::fs::write(&tb_file, &cut).unwrap();
        truncate_after(dir.path(), 1).unwrap();
        assert_eq!(std::fs::read(&tb_file).unwrap(), whole);
        assert_eq!(
            std::fs::read_to_string(dir.path().join("completions.jsonl")).unwrap(),
            ""
        );
        // A kill mid-line, and eval answers of steps after the checkpoint.
        let m = dir.path().join("metrics.jsonl");
        let before = std::fs::read_to_string(&m).unwrap();
        std::fs::write(&m, format!("{before}{{\"step\":2,\"rew")).unwrap();
        std::fs::create_dir_all(dir.path().join("eval")).unwrap();
        for n in [0, 1, 2, 10] {
            std::fs::write(dir.path().join(format!("eval/step-{n}.jsonl")), "{}\n").unwrap();
        }
        truncate_after(dir.path(), 1).unwrap();
        assert_eq!(std::fs::read_to_string(&m).unwrap(), before);
        let mut left: Vec<String> = std::fs::read_dir(dir.path().join("eval"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["step-0.jsonl", "step-1.jsonl"]);
        // A fresh run in the same directory: the earlier run's event files go.
        assert!(clear_logs(dir.path()).unwrap());
        assert!(tb_files(dir.path()).is_empty());
    }
}
