//! How a round's groups are shared among the ranks of a data-parallel run, and how the ranks'
//! scored episodes come together again.
//!
//! A global micro-batch is `size` ranks' micro-batches side by side: with `gpm` groups per rank
//! per micro-batch, global micro-batch `m` holds groups `m * size * gpm ..`, of which rank `r`
//! owns the `r`-th run of `gpm`. So rank `r`'s `m`-th micro-batch is its part of the one-process
//! run's `m`-th micro-batch (per-device rows x ranks), and the summed gradients are that run's.

use super::world::World;
use crate::rollout::{decode_episodes, encode_episodes, Episode};
use crate::Result;

/// The global indices of the groups rank `rank` of `size` owns among `p`, in order; `gpm` groups
/// per rank per micro-batch.
pub fn owned_groups(p: usize, gpm: usize, size: usize, rank: usize) -> Vec<usize> {
    let gpm = gpm.max(1);
    (0..p)
        .filter(|&i| (i % (gpm * size)) / gpm == rank)
        .collect()
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
