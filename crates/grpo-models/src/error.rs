//! The library's error type. Every variant that comes from user input names the file, tensor or key
//! it is about, so the binary can print it as is.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A problem with a file the user gave us (missing, unreadable, malformed).
    #[error("{}: {msg}", path.display())]
    File { path: PathBuf, msg: String },

    /// A model checkpoint problem: a missing or misshapen tensor, an unsupported architecture.
    #[error("model: {0}")]
    Model(String),

    /// Tokenizer or chat-template problem.
    #[error("tokenizer: {0}")]
    Tokenizer(String),

    /// An invalid option; `key` is the option's name as the user writes it.
    #[error("option `{key}`: {msg}")]
    Config { key: String, msg: String },

    /// Fetching a model (package registry or hub) failed.
    #[error("download: {0}")]
    Download(String),

    /// Generation input problem (empty prompt, prompt longer than the context, ...).
    #[error("generate: {0}")]
    Generate(String),

    /// A reward's scorer (a program or an HTTP endpoint) cannot be started or keeps failing;
    /// `name` is the reward's name.
    #[error("reward `{name}`: {msg}")]
    Reward { name: String, msg: String },

    #[error("io: {context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },

    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn file(path: impl Into<PathBuf>, msg: impl std::fmt::Display) -> Self {
        Error::File {
            path: path.into(),
            msg: msg.to_string(),
        }
    }
    pub fn io(context: impl std::fmt::Display, source: std::io::Error) -> Self {
        Error::Io {
            context: context.to_string(),
            source,
        }
    }
    pub fn reward(name: impl Into<String>, msg: impl std::fmt::Display) -> Self {
        Error::Reward {
            name: name.into(),
            msg: msg.to_string(),
        }
    }
    pub fn config(key: impl Into<String>, msg: impl std::fmt::Display) -> Self {
        Error::Config {
            key: key.into(),
            msg: msg.to_string(),
        }
    }
}

/// Levenshtein distance, for "did you mean" suggestions.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, &cb) in b.iter().enumerate() {
            cur[j + 1] = (prev[j] + usize::from(ca != cb))
                .min(prev[j + 1] + 1)
                .min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

/// The candidate closest to `key` when it is close enough to be a typo.
pub fn nearest<'a>(key: &str, candidates: &[&'a str]) -> Option<&'a str> {
    candidates
        .iter()
        .map(|k| (edit_distance(key, k), *k))
        .min()
        .filter(|(d, k)| *d <= 3 || k.contains(key))
        .map(|(_, k)| k)
}
