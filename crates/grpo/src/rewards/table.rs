//! One `[[rewards]]` table, read with the key named in every error (`rewards[2].timeout_s`).

use serde_json::{Map, Value};

use crate::{Error, Result};

/// A reward table and its index; unknown keys are rejected when it is made.
pub struct Table<'a> {
    obj: &'a Map<String, Value>,
    /// How the table is named in errors: `rewards[2]`, `rewards[0].quality`.
    path: String,
}

impl<'a> Table<'a> {
    /// Checks that every key of `obj` is in `allowed` (plus `kind`, `name` and `weight`, which
    /// every reward takes), suggesting the nearest allowed key for a typo.
    pub fn new(obj: &'a Map<String, Value>, path: String, allowed: &[&str]) -> Result<Self> {
        let t = Table { obj, path };
        let all: Vec<&str> = ["kind", "name", "weight"]
            .iter()
            .chain(allowed)
            .copied()
            .collect();
        if let Some(k) = obj.keys().find(|k| !all.contains(&k.as_str())) {
            let kind = obj.get("kind").and_then(Value::as_str).unwrap_or("?");
            let hint = grpo_models::error::nearest(k, &all)
                .map(|n| format!(" (did you mean `{n}`?)"))
                // No near name: the message leaves the hint out.
                .unwrap_or_default();
            return Err(t.err(
                k,
                format!(
                    "unknown key for kind {kind}{hint}; allowed: {}",
                    all.join(", ")
                ),
            ));
        }
        Ok(t)
    }

    /// `rewards[i].key`
    pub fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.path)
    }
    /// The table's own name in errors (`rewards[i]`).
    pub fn path(&self) -> &str {
        &self.path
    }
    /// A nested table (`[rewards.quality]`), if present.
    pub fn sub(&self, k: &str) -> Result<Option<&'a Map<String, Value>>> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::Object(m)) => Ok(Some(m)),
            Some(v) => Err(self.err(k, format!("expected a table, got {v}"))),
        }
    }
    pub fn err(&self, k: &str, msg: impl std::fmt::Display) -> Error {
        Error::config(self.key(k), msg)
    }
    pub fn get(&self, k: &str) -> Option<&'a Value> {
        self.obj.get(k).filter(|v| !v.is_null())
    }
    pub fn has(&self, k: &str) -> bool {
        self.get(k).is_some()
    }

    pub fn opt_f64(&self, k: &str) -> Result<Option<f64>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite())
                .map(Some)
                .ok_or_else(|| self.err(k, format!("expected a number, got {v}"))),
        }
    }
    pub fn f64(&self, k: &str, default: f64) -> Result<f64> {
        Ok(self.opt_f64(k)?.unwrap_or(default))
    }
    pub fn f32(&self, k: &str, default: f32) -> Result<f32> {
        Ok(self.opt_f64(k)?.map_or(default, |x| x as f32))
    }
    pub fn opt_usize(&self, k: &str) -> Result<Option<usize>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|x| Some(x as usize))
                .ok_or_else(|| self.err(k, format!("expected a whole number >= 0, got {v}"))),
        }
    }
    pub fn usize(&self, k: &str, default: usize) -> Result<usize> {
        Ok(self.opt_usize(k)?.unwrap_or(default))
    }
    pub fn opt_bool(&self, k: &str) -> Result<Option<bool>> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.err(k, format!("expected true or false, got {v}"))),
        }
    }
    pub fn bool(&self, k: &str, default: bool) -> Result<bool> {
        Ok(self.opt_bool(k)?.unwrap_or(default))
    }
    pub fn opt_str(&self, k: &str) -> Result<Option<&'a str>> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.as_str())),
            Some(v) => Err(self.err(k, format!("expected a string, got {v}"))),
        }
    }
    pub fn str(&self, k: &str, default: &'a str) -> Result<&'a str> {
        Ok(self.opt_str(k)?.unwrap_or(default))
    }
    /// A required string.
    pub fn req_str(&self, k: &str, what: &str) -> Result<&'a str> {
        self.opt_str(k)?
            .ok_or_else(|| self.err(k, format!("missing: {what}")))
    }
    /// A list of strings; a single string is a list of one.
    pub fn opt_strs(&self, k: &str) -> Result<Option<Vec<String>>> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(vec![s.clone()])),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| {
                    v.as_str()
                        .map(str::to_owned)
                        .ok_or_else(|| self.err(k, format!("expected strings, got {v}")))
                })
                .collect::<Result<Vec<_>>>()
                .map(Some),
            Some(v) => Err(self.err(k, format!("expected a list of strings, got {v}"))),
        }
    }
    /// One of `choices`, or `default` when unset.
    pub fn choice<T: Copy>(&self, k: &str, default: T, choices: &[(&str, T)]) -> Result<T> {
        match self.opt_str(k)? {
            None => Ok(default),
            Some(s) => choices
                .iter()
                .find(|(n, _)| *n == s)
                .map(|(_, v)| *v)
                .ok_or_else(|| {
                    let names: Vec<&str> = choices.iter().map(|(n, _)| *n).collect();
                    self.err(k, format!("`{s}`: use one of {}", names.join(", ")))
                }),
        }
    }
}
