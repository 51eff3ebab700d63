//! Rewards the embedding program computes: the Python package's reward functions, called in its
//! own process ([`RewardFn::Host`](super::RewardFn::Host)). The library only asks for scores; how
//! a host calls its functions (and what it does when one raises) is the host's.

use super::ScoreItem;
use crate::Result;

/// A reward computed by the host. `score` gets the completions of a batch (the groups of one
/// round, or of one group when scored while sampling goes on) and returns one score each (NaN:
/// missing). It may be called from a thread other than the one that started the run.
pub trait HostReward: Send + Sync + std::fmt::Debug {
    fn score(&self, items: &[ScoreItem]) -> Result<Vec<f32>>;
}
