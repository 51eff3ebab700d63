//! How a round's groups are shared among the ranks of a data-parallel run, and how the ranks'
//! scored episodes come together again.
//!
//! Each rank samples an even share of a pass's groups ([`sampled_groups`]); the scored episodes
//! and their log-prob rows are gathered to every rank; then the round's groups are dealt out for
//! training ([`trained_groups`]).
//!
//! A global micro-batch is `size` ranks' micro-batches side by side: with `gpm` groups per rank
//! per micro-batch, global micro-batch `m` holds groups `m * size * gpm ..`, of which rank `r`
//! owns the `r`-th run of `gpm`. So rank `r`'s `m`-th micro-batch is its part of the one-process
//! run's `m`-th micro-batch (per-device rows x ranks), and the summed gradients are that run's.

use super::world::World;
use crate::rollout::{decode_episodes, encode_episodes, Episode};
use crate::{Error, Result};

/// The global indices of the groups rank `rank` of `size` owns among `p`, in order; `gpm` groups
/// per rank per micro-batch.
pub fn owned_groups(p: usize, gpm: usize, size: usize, rank: usize) -> Vec<usize> {
    let gpm = gpm.max(1);
    (0..p)
        .filter(|&i| (i % (gpm * size)) / gpm == rank)
        .collect()
}

/// The groups rank `rank` of `size` samples among a pass's `n`: an even, contiguous share
/// (sizes differ by one at most). Which rank samples a group changes nothing in it (each group
/// is sampled from its own seed), and the round's groups are dealt out for training afterwards
/// ([`trained_groups`]), so the sampling is shared evenly whatever the micro-batches.
pub fn sampled_groups(n: usize, size: usize, rank: usize) -> Vec<usize> {
    let size = size.max(1);
    (n * rank / size..n * (rank + 1) / size).collect()
}

/// Every rank's scored episodes, in global group order (`G` per group). `mine` are this rank's,
/// their `group` the global index.
pub fn gather_episodes(world: &dyn World, mine: &[Episode]) -> Result<Vec<Episode>> {
    let mut all = vec![];
    for (rank, b) in world
        .all_gather_bytes(encode_episodes(mine)?)?
        .into_iter()
        .enumerate()
    {
        all.extend(decode_episodes(&b, &format!("rank {rank}"))?);
    }
    // Stable: a group's completions keep their sample order.
    all.sort_by_key(|e| e.group);
    Ok(all)
}

/// Every rank's log-prob rows, in the order [`gather_episodes`] puts their episodes: `groups[i]`
/// is the global group of this rank's row `i` (rows of one group in sample order).
pub fn gather_rows(
    world: &dyn World,
    groups: &[usize],
    rows: &[Vec<f32>],
) -> Result<Vec<Vec<f32>>> {
    let mut mine = Vec::new();
    for (&g, row) in groups.iter().zip(rows) {
        mine.extend((g as u64).to_le_bytes());
        mine.extend((row.len() as u64).to_le_bytes());
        mine.extend(row.iter().flat_map(|x| x.to_le_bytes()));
    }
    let mut all: Vec<(usize, Vec<f32>)> = Vec::new();
    for (rank, b) in world.all_gather_bytes(mine)?.into_iter().enumerate() {
        let bad = || Error::distributed(format!("rank {rank} sent a truncated log-prob row"));
        let mut rest = b.as_slice();
        while !rest.is_empty() {
            let word = |r: &[u8]| -> Option<usize> {
                Some(u64::from_le_bytes(r.get(..8)?.try_into().ok()?) as usize)
            };
            let (g, n) = (
                word(rest).ok_or_else(bad)?,
                word(&rest[8..]).ok_or_else(bad)?,
            );
            let body = rest.get(16..16 + 4 * n).ok_or_else(bad)?;
            let row = body
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            all.push((g, row));
            rest = &rest[16 + 4 * n..];
        }
    }
    // Stable, as the episodes' sort: a group's rows keep their sample order.
    all.sort_by_key(|(g, _)| *g);
    Ok(all.into_iter().map(|(_, r)| r).collect())
}

/// Which of a round's `keep.len()` groups rank `rank` of `size` trains on: the kept ones (those
/// `keep` says yes to, in order) dealt out as [`owned_groups`] deals a pass's, so that the
/// world's `m`-th micro-batch is the one-process run's `m`-th whatever groups were left out.
pub fn trained_groups(keep: &[bool], gpm: usize, size: usize, rank: usize) -> Vec<bool> {
    let kept: Vec<usize> = (0..keep.len()).filter(|&i| keep[i]).collect();
    let mut own = vec![false; keep.len()];
    for j in owned_groups(kept.len(), gpm, size, rank) {
        own[kept[j]] = true;
    }
    own
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_own_their_part_of_each_global_micro_batch() {
        // 8 groups, 2 per rank per micro-batch, 2 ranks: micro 0 = 0..4, micro 1 = 4..8.
        assert_eq!(owned_groups(8, 2, 2, 0), vec![0, 1, 4, 5]);
        assert_eq!(owned_groups(8, 2, 2, 1), vec![2, 3, 6, 7]);
        // Every group exactly once, over any world.
        for size in 1..5 {
            let mut all: Vec<usize> = (0..size)
                .flat_map(|r| owned_groups(12, 3, size, r))
                .collect();
            all.sort();
            assert_eq!(all, (0..12).collect::<Vec<_>>());
        }
        assert_eq!(owned_groups(4, 1, 1, 0), vec![0, 1, 2, 3]);
    }

    #[test]
    fn each_rank_samples_an_even_share_of_a_pass() {
        // Dynamic sampling's first pass of 12 groups over 2 ranks: 6 each (the micro-batch
        // layout would give rank 0 eight).
        assert_eq!(sampled_groups(12, 2, 0), (0..6).collect::<Vec<_>>());
        assert_eq!(sampled_groups(12, 2, 1), (6..12).collect::<Vec<_>>());
        for (n, size) in [(7, 3), (2, 4), (12, 1)] {
            let parts: Vec<Vec<usize>> = (0..size).map(|r| sampled_groups(n, size, r)).collect();
            assert_eq!(parts.concat(), (0..n).collect::<Vec<_>>());
            let lens = parts.iter().map(Vec::len);
            assert!(lens.clone().max().unwrap() - lens.min().unwrap() <= 1);
        }
    }

    #[test]
    fn the_kept_groups_are_dealt_out_as_a_pass_is() {
        // Groups 1 and 4 left out: the kept 0,2,3,5,6,7 dealt 1 per rank per micro-batch.
        let keep = [true, false, true, true, false, true, true, true];
        let own = |rank| trained_groups(&keep, 1, 2, rank);
        let idx = |v: Vec<bool>| (0..v.len()).filter(|&i| v[i]).collect::<Vec<_>>();
        assert_eq!(idx(own(0)), vec![0, 3, 6]);
        assert_eq!(idx(own(1)), vec![2, 5, 7]);
        assert_eq!(idx(trained_groups(&keep, 2, 1, 0)), vec![0, 2, 3, 5, 6, 7]);
    }

    #[test]
    fn log_prob_rows_come_back_in_group_order() {
        use crate::train::world::SingleProcess;
        let rows = vec![vec![1.0, 2.0], vec![], vec![3.5], vec![-1.0, f32::NAN]];
        let got = gather_rows(&SingleProcess, &[4, 4, 1, 1], &rows).unwrap();
        assert_eq!(got[0], vec![3.5]);
        assert!(got[1][0] == -1.0 && got[1][1].is_nan());
        assert_eq!(got[2..], [vec![1.0, 2.0], vec![]]);
    }

    #[test]
    fn episodes_round_trip_in_group_order_with_missing_rewards() {
        use crate::train::world::SingleProcess;
        use grpo_models::sampler::StopReason;
        let e = |group: usize, r: f32| Episode {
            example: group * 10,
            group,
            prompt_ids: vec![1, 2],
            completion_ids: vec![3],
            text: "x\u{e9}".into(),
            stop_reason: StopReason::Eos,
            rewards: vec![r, f32::NAN],
            agent: None,
        };
        let got = gather_episodes(&SingleProcess, &[e(3, 1.0), e(1, 0.5), e(3, 2.0)]).unwrap();
        assert_eq!(
            got.iter()
                .map(|x| (x.group, x.rewards[0]))
                .collect::<Vec<_>>(),
            vec![(1, 0.5), (3, 1.0), (3, 2.0)]
        );
        assert!(got[0].rewards[1].is_nan() && got[0].text == "x\u{e9}");
    }
}
