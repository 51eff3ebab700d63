//! The external, preallocated key/value cache used by the decoding forward.
//!
//! Each layer owns two tensors `[B, Hkv, T_max, D]` allocated once. All rows share the slot index:
//! a decoding step writes every row's new key at slot `len` with one in-place copy, and attention
//! reads the `[0, len)` prefix as a strided view (no concatenation). Rows of different prompt
//! lengths are left-padded; the sampler masks the padding slots.
//!
//! The sampler starts a cache with room for a few hundred tokens, not the longest completion, and
//! grows it as decoding goes ([`KvCache::reserve`]): with rows dropped once they finish, the cache
//! then holds about what the live rows use, not rows x the longest completion.

use candle_core::{DType, Device, Result, Tensor};

#[derive(Debug, Clone)]
pub struct KvCache {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    len: usize,
}

impl KvCache {
    /// A zeroed cache for `layers` layers of `[batch, kv_heads, max_len, head_dim]`.
    pub fn new(
        layers: usize,
        batch: usize,
        kv_heads: usize,
        max_len: usize,
        head_dim: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let mut k = Vec::with_capacity(layers);
        let mut v = Vec::with_capacity(layers);
        for _ in 0..layers {
            k.push(Tensor::zeros(
                (batch, kv_heads, max_len, head_dim),
                dtype,
                device,
            )?);
            v.push(Tensor::zeros(
                (batch, kv_heads, max_len, head_dim),
                dtype,
                device,
            )?);
        }
        Ok(Self { k, v, len: 0 })
    }

    /// A cache from already-filled contiguous layer tensors with `len` valid slots.
    pub fn from_parts(k: Vec<Tensor>, v: Vec<Tensor>, len: usize) -> Result<Self> {
        for t in k.iter().chain(v.iter()) {
            if !t.is_contiguous() || t.rank() != 4 || t.dim(2)? < len {
                candle_core::bail!("kv cache parts must be contiguous [B, Hkv, T_max >= len, D]");
            }
        }
        Ok(Self { k, v, len })
    }

    /// Number of filled slots (the same for every row).
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn capacity(&self) -> usize {
        self.k.first().map(|t| t.dims()[2]).unwrap_or(0)
    }
    pub fn batch(&self) -> usize {
        self.k.first().map(|t| t.dims()[0]).unwrap_or(0)
    }
    pub fn num_layers(&self) -> usize {
        self.k.len()
    }

    /// Writes `k_new`/`v_new` [B, Hkv, S, D] of `layer` at slots `[len, len + S)` in place and
    /// returns views of slots `[0, len + S)`. Call [`KvCache::advance`] once all layers are done.
    pub fn append(&self, layer: usize, k_new: &Tensor, v_new: &Tensor) -> Result<(Tensor, Tensor)> {
        let s = k_new.dim(2)?;
        if self.len + s > self.capacity() {
            candle_core::bail!(
                "kv cache full: {} + {s} slots > capacity {}",
                self.len,
                self.capacity()
            );
        }
        let (k, v) = (&self.k[layer], &self.v[layer]);
        k.slice_set(&k_new.contiguous()?, 2, self.len)?;
        v.slice_set(&v_new.contiguous()?, 2, self.len)?;
        Ok((k.narrow(2, 0, self.len + s)?, v.narrow(2, 0, self.len + s)?))
    }

    /// Makes room for slots `[len, need)`: when the capacity is short, every layer moves to new
    /// tensors of `min(limit, max(need, 1.5 x capacity, capacity + GROW_MIN))` slots (the filled
    /// prefix copied, the rest zeroed), so that a cache grown one slot at a time is copied
    /// O(log) times. `limit` is the most slots the cache will ever need. Layer by layer, so that
    /// the cache is never held twice.
    pub fn reserve(&mut self, need: usize, limit: usize) -> Result<()> {
        let cap = self.capacity();
        if need <= cap {
            return Ok(());
        }
        let grown = grown_capacity(cap, need, limit);
        let len = self.len;
        let grow = |t: &Tensor| -> Result<Tensor> {
            let (b, h, _, d) = t.dims4()?;
            let out = Tensor::zeros((b, h, grown, d), t.dtype(), t.device())?; // [B, Hkv, grown, D]
            if len > 0 {
                out.slice_set(&t.narrow(2, 0, len)?.contiguous()?, 2, 0)?;
            }
            Ok(out)
        };
        for t in self.k.iter_mut().chain(self.v.iter_mut()) {
            *t = grow(t)?;
        }
        Ok(())
    }

    /// Every layer's key and value tensors `[B, Hkv, T_max, D]`, all slots.
    pub fn layer_tensors(&self) -> (&[Tensor], &[Tensor]) {
        (&self.k, &self.v)
    }

    pub fn advance(&mut self, s: usize) {
        self.len += s;
    }

    /// Layer `layer`'s filled prefix `[B, Hkv, len, D]`.
    pub fn layer(&self, layer: usize) -> Result<(Tensor, Tensor)> {
        Ok((
            self.k[layer].narrow(2, 0, self.len)?,
            self.v[layer].narrow(2, 0, self.len)?,
        ))
    }

    /// Keeps only `rows` (in that order), in new contiguous tensors of the same capacity. Used to
    /// drop finished rows. Layer by layer, each old tensor freed as its successor is made, so
    /// that the cache is never held twice.
    pub fn keep_rows(&mut self, rows: &[u32]) -> Result<()> {
        let Some(first) = self.k.first() else {
            return Ok(());
        };
        let idx = Tensor::new(rows, first.device())?;
        for t in self.k.iter_mut().chain(self.v.iter_mut()) {
            *t = t.index_select(&idx, 0)?; // [rows, Hkv, T_max, D]
        }
        Ok(())
    }
}

/// Fewest slots a growing cache adds at once.
pub const GROW_MIN: usize = 256;

/// The capacity [`KvCache::reserve`] grows `cap` to for `need` slots, at most `limit` (never
/// below `need`).
fn grown_capacity(cap: usize, need: usize, limit: usize) -> usize {
    let step = (cap / 2).max(GROW_MIN);
    (cap + step).min(limit).max(need)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn append_writes_in_place_and_keep_rows_keeps_order() {
        let dev = Device::Cpu;
        let mut c = KvCache::new(1, 3, 1, 4, 2, DType::F32, &dev).unwrap();
        let k = Tensor::new(&[[[[1f32, 1.]]], [[[2., 2.]]], [[[3., 3.]]]], &dev).unwrap();
        let (kv, _) = c.append(0, &k, &k).unwrap();
        assert_eq!(kv.dims(), &[3, 1, 1, 2]);
        c.advance(1);
        let (kv, _) = c.append(0, &(k.clone() * 10.).unwrap(), &k).unwrap();
        c.advance(1);
        assert_eq!(kv.dims(), &[3, 1, 2, 2]);
        let mut sel = c.clone();
        sel.keep_rows(&[2, 0]).unwrap();
        let (ks, _) = sel.layer(0).unwrap();
        let got = ks.squeeze(1).unwrap().to_vec3::<f32>().unwrap();
        let want = vec![
            vec![vec![3., 3.], vec![30., 30.]],
            vec![vec![1., 1.], vec![10., 10.]],
        ];
        assert_eq!(got, want);
        let z = Tensor::zeros((3, 1, 3, 2), DType::F32, &dev).unwrap();
        assert!(
            c.append(0, &z, &z).is_err(),
            "writing past capacity must fail"
        );
    }

    /// Plain twin of the growth rule: +50% or +GROW_MIN slots, whichever is more, capped.
    #[test]
    fn growth_is_geometric_capped_and_never_short() {
        assert_eq!(grown_capacity(100, 101, 10_000), 100 + GROW_MIN);
        assert_eq!(grown_capacity(1000, 1001, 10_000), 1500);
        assert_eq!(grown_capacity(1000, 1001, 1200), 1200);
        assert_eq!(grown_capacity(1000, 2500, 10_000), 2500);
        assert_eq!(
            grown_capacity(1000, 1300, 1100),
            1300,
            "need wins over limit"
        );
        // Growing one slot at a time from 300 to 4096 copies the cache a handful of times.
        let (mut cap, mut grows) = (300, 0);
        for need in 301..=4096 {
            if need > cap {
                cap = grown_capacity(cap, need, 4096);
                grows += 1;
            }
        }
        assert_eq!((cap, grows), (4096, 6));
    }

    #[test]
    fn reserve_keeps_the_filled_slots_and_zeroes_the_rest() {
        let dev = Device::Cpu;
        let mut c = KvCache::new(2, 2, 1, 2, 1, DType::F32, &dev).unwrap();
        let k = Tensor::new(&[[[[1f32], [2.]]], [[[3.], [4.]]]], &dev).unwrap(); // [2, 1, 2, 1]
        for layer in 0..2 {
            c.append(layer, &k, &(&k * 10.).unwrap()).unwrap();
        }
        c.advance(2);
        c.reserve(2, 10).unwrap();
        assert_eq!(c.capacity(), 2, "no growth when the room is there");
        c.reserve(3, 10).unwrap();
        assert_eq!(c.capacity(), 10);
        assert_eq!(c.len(), 2);
        let (ks, vs) = c.layer_tensors();
        let all_k = ks[1].flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let mut want = vec![0f32; 20];
        want[..2].copy_from_slice(&[1., 2.]);
        want[10..12].copy_from_slice(&[3., 4.]);
        assert_eq!(all_k, want);
        let v0 = vs[0].narrow(2, 0, 2).unwrap().flatten_all().unwrap();
        assert_eq!(v0.to_vec1::<f32>().unwrap(), vec![10., 20., 30., 40.]);
        let one = Tensor::new(&[[[[5f32]]], [[[6.]]]], &dev).unwrap();
        let (kv, _) = c.append(0, &one, &one).unwrap();
        assert_eq!(kv.dims(), &[2, 1, 3, 1], "appends go on after growth");
        // keep_rows keeps the capacity.
        c.advance(1);
        c.keep_rows(&[1]).unwrap();
        let sel = c;
        assert_eq!((sel.capacity(), sel.len(), sel.batch()), (10, 3, 1));
        let (k0, _) = sel.layer(0).unwrap();
        assert_eq!(
            k0.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            vec![3., 4., 6.]
        );
    }
}
