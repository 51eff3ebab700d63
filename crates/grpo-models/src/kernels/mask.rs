//! Attention masks as plain data, shared by every device's kernels: the additive mask value,
//! the dense causal mask of a batch, and a decoding batch's shared prompt slots.

use candle_core::{Device, Result, Tensor};

/// Additive mask value for disallowed attention positions. Finite, so a row that is entirely
/// masked (a padding query) gives a uniform softmax instead of NaN, which would poison gradients.
pub const MASK_VALUE: f32 = -1e30;

/// Rows of a decoding batch that hold the same keys and values in slots `pad[b]..end` (one
/// prompt's, copied from one prefill into each of its samples' rows): row `b` reads those slots
/// from row `leader[b]` (itself for the first row of a group), so that a group's G rows read their
/// prompt once between them and the rest stays in cache. Slots from `end` on are each row's own.
#[derive(Debug, Clone, PartialEq)]
pub struct SharedPrefix {
    pub leader: Vec<usize>,
    pub end: usize,
}

impl SharedPrefix {
    /// Whether it can serve rows with left padding `pad` over `slots` cached key slots: one
    /// leader per row, each a row of the batch with the same padding (the same prompt), and the
    /// shared slots inside the cache. Attention ignores a prefix that does not fit.
    pub fn fits(&self, pad: &[usize], slots: usize) -> bool {
        let b = pad.len();
        self.leader.len() == b
            && self.end <= slots
            && self
                .leader
                .iter()
                .zip(pad)
                .all(|(&l, &p)| l < b && pad[l] == p)
    }
}

/// Additive attention mask [B, 1, S, Tk] for queries at key slots `q_slots[b][s]` attending to key
/// slots `0..Tk` that are valid (`key_valid[b][j]`) and not after the query (causal by slot).
pub fn build_mask(
    key_valid: &[Vec<bool>],
    q_slot_start: usize,
    s: usize,
    tk: usize,
    device: &Device,
) -> Result<Tensor> {
    let b = key_valid.len();
    let mut m = vec![0f32; b * s * tk];
    for (bi, valid) in key_valid.iter().enumerate() {
        for si in 0..s {
            let q_slot = q_slot_start + si;
            let row = &mut m[(bi * s + si) * tk..(bi * s + si + 1) * tk];
            for (j, x) in row.iter_mut().enumerate() {
                let ok = j <= q_slot && valid.get(j).copied().unwrap_or(false);
                if !ok {
                    *x = MASK_VALUE;
                }
            }
        }
    }
    Tensor::from_vec(m, (b, 1, s, tk), device)
}
