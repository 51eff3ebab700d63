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

    /// Generation input problem (empty prompt, prompt longer than the context, a fill-in input
    /// without a mask token, ...).
    #[error("generate: {0}")]
    Generate(String),

    /// Input a model cannot run on (an empty batch, a text with no tokens to score): the data
    /// given to a forward pass, not the checkpoint or an option.
    #[error("model input: {0}")]
    ModelInput(String),

    /// Saving, loading, rotating or resuming a checkpoint (its weights, `trainer_state.json`,
    /// the optimizer state); `path` is the checkpoint (or output) directory.
    #[error("checkpoint {}: {msg}", path.display())]
    Checkpoint { path: PathBuf, msg: String },

    /// The processes of a distributed run (MPI ranks, NCCL) disagree, or a collective failed.
    #[error("distributed: {0}")]
    Distributed(String),

    /// A training run cannot go on (e.g. too many non-finite steps in a row).
    #[error("training: {0}")]
    Training(String),

    /// An experiment tracker (W&B, MLflow, TensorBoard) failed; `name` is the tracker.
    #[error("tracker {name}: {msg}")]
    Tracker { name: String, msg: String },

    /// An internal consistency check failed: a bug in grpo, not in the user's input.
    #[error(
        "internal error: {0} (a bug in grpo, not in your input or config: please report it with \
         the command and config that hit it; GRPO_BACKTRACE=1 adds a backtrace)"
    )]
    Invariant(String),

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
    pub fn checkpoint(path: impl Into<PathBuf>, msg: impl std::fmt::Display) -> Self {
        Error::Checkpoint {
            path: path.into(),
            msg: msg.to_string(),
        }
    }
    pub fn tracker(name: impl Into<String>, msg: impl std::fmt::Display) -> Self {
        Error::Tracker {
            name: name.into(),
            msg: msg.to_string(),
        }
    }
    pub fn model_input(msg: impl std::fmt::Display) -> Self {
        Error::ModelInput(msg.to_string())
    }
    pub fn distributed(msg: impl std::fmt::Display) -> Self {
        Error::Distributed(msg.to_string())
    }
    pub fn training(msg: impl std::fmt::Display) -> Self {
        Error::Training(msg.to_string())
    }
    pub fn invariant(msg: impl std::fmt::Display) -> Self {
        Error::Invariant(msg.to_string())
    }
}

/// The candidate closest to `key` (Levenshtein distance over chars) when it is close enough to
/// be a typo.
pub fn nearest<'a>(key: &str, candidates: &[&'a str]) -> Option<&'a str> {
    candidates
        .iter()
        .map(|k| (strsim::levenshtein(key, k), *k))
        .min()
        .filter(|(d, k)| *d <= 3 || k.contains(key))
        .map(|(_, k)| k)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_say_what_failed() {
        let e = Error::checkpoint("/out/checkpoint-30", "not saved: disk full");
        assert_eq!(
            e.to_string(),
            "checkpoint /out/checkpoint-30: not saved: disk full"
        );
        let e = Error::tracker("mlflow", "runs/create: HTTP 500");
        assert_eq!(e.to_string(), "tracker mlflow: runs/create: HTTP 500");
        let e = Error::invariant("group 3 mixes prompts").to_string();
        assert!(e.starts_with("internal error: group 3 mixes prompts (a bug in grpo"));
        assert!(e.contains("please report it"));
        assert_eq!(
            Error::distributed("rank 1 diverged").to_string(),
            "distributed: rank 1 diverged"
        );
        assert_eq!(
            Error::training("3 steps skipped").to_string(),
            "training: 3 steps skipped"
        );
        assert_eq!(
            Error::model_input("empty batch").to_string(),
            "model input: empty batch"
        );
    }

    #[test]
    fn nearest_suggests_typos_only() {
        let keys = ["num_generations", "learning_rate", "timeout_s"];
        assert_eq!(nearest("num_generation", &keys), Some("num_generations"));
        assert_eq!(nearest("learnin_rat", &keys), Some("learning_rate"));
        assert_eq!(nearest("timeout", &keys), Some("timeout_s"));
        assert_eq!(nearest("xyzzy_plugh_frobnicate", &keys), None);
    }
}
