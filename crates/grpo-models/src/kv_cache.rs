//! The external, preallocated key/value cache used by the decoding forward.
//!
//! Each layer owns two tensors `[B, Hkv, T_max, D]` allocated once. All rows share the slot index:
//! a decoding step writes every row's new key at slot `len` with one in-place copy, and attention
//! reads the `[0, len)` prefix as a strided view (no concatenation, no reallocation). Rows of
//! different prompt lengths are left-padded; the sampler masks the padding slots.

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

    /// Keeps only `rows` (in that order), as a new contiguous cache. Used to drop finished rows.
    pub fn select_rows(&self, rows: &[u32]) -> Result<Self> {
        let device = self.k[0].device();
        let idx = Tensor::new(rows, device)?;
        let pick = |t: &Tensor| t.index_select(&idx, 0);
        Ok(Self {
            k: self.k.iter().map(pick).collect::<Result<_>>()?,
            v: self.v.iter().map(pick).collect::<Result<_>>()?,
            len: self.len,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn append_writes_in_place_and_select_rows_keeps_order() {
        let dev = Device::Cpu;
        let mut c = KvCache::new(1, 3, 1, 4, 2, DType::F32, &dev).unwrap();
        let k = Tensor::new(&[[[[1f32, 1.]]], [[[2., 2.]]], [[[3., 3.]]]], &dev).unwrap();
        let (kv, _) = c.append(0, &k, &k).unwrap();
        assert_eq!(kv.dims(), &[3, 1, 1, 2]);
        c.advance(1);
        let (kv, _) = c.append(0, &(k.clone() * 10.).unwrap(), &k).unwrap();
        c.advance(1);
        assert_eq!(kv.dims(), &[3, 1, 2, 2]);
        let sel = c.select_rows(&[2, 0]).unwrap();
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
}
