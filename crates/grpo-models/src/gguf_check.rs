//! A bounds check of a GGUF file before candle reads it. candle allocates whatever length a
//! header states, so a corrupt or hostile header (a string of 2^60 bytes, a tensor larger than
//! the file) would abort the process instead of being an error that names the file. This walks
//! the header as the format defines it (magic, version, counts, metadata, tensor infos) without
//! allocating what it describes, and checks every length against the bytes the file has.

use std::io::{BufReader, Read};
use std::path::Path;

use crate::{Error, Result};

/// GGML tensor types candle reads: (type id, name, bytes per block, elements per block).
const GGML_TYPES: &[(u32, &str, u64, u64)] = &[
    (0, "F32", 4, 1),
    (1, "F16", 2, 1),
    (2, "Q4_0", 18, 32),
    (3, "Q4_1", 20, 32),
    (6, "Q5_0", 22, 32),
    (7, "Q5_1", 24, 32),
    (8, "Q8_0", 34, 32),
    (9, "Q8_1", 36, 32),
    (10, "Q2_K", 84, 256),
    (11, "Q3_K", 110, 256),
    (12, "Q4_K", 144, 256),
    (13, "Q5_K", 176, 256),
    (14, "Q6_K", 210, 256),
    (15, "Q8_K", 292, 256),
    (30, "BF16", 2, 1),
];

struct Header<R> {
    r: R,
    pos: u64,
    len: u64,
    /// Version 1 writes lengths and counts as u32.
    v1: bool,
}

impl<R: Read> Header<R> {
    fn bytes(&mut self, n: u64, what: &str) -> std::result::Result<Vec<u8>, String> {
        self.room(n, what)?;
        let mut b = vec![0u8; n as usize];
        self.r
            .read_exact(&mut b)
            .map_err(|e| format!("cannot read {what}: {e}"))?;
        self.pos += n;
        Ok(b)
    }

    fn room(&self, n: u64, what: &str) -> std::result::Result<(), String> {
        if n > self.len - self.pos {
            return Err(format!(
                "{what} needs {n} bytes at byte {} but the file has {} (truncated or corrupt)",
                self.pos, self.len
            ));
        }
        Ok(())
    }

    fn skip(&mut self, n: u64, what: &str) -> std::result::Result<(), String> {
        self.room(n, what)?;
        std::io::copy(&mut (&mut self.r).take(n), &mut std::io::sink())
            .map_err(|e| format!("cannot read {what}: {e}"))?;
        self.pos += n;
        Ok(())
    }

    fn u32(&mut self, what: &str) -> std::result::Result<u32, String> {
        let b = self.bytes(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self, what: &str) -> std::result::Result<u64, String> {
        let b = self.bytes(8, what)?;
        Ok(u64::from_le_bytes([
            b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7],
        ]))
    }

    /// A length or count (u32 in version 1).
    fn count(&mut self, what: &str) -> std::result::Result<u64, String> {
        if self.v1 {
            self.u32(what).map(u64::from)
        } else {
            self.u64(what)
        }
    }

    fn string(&mut self, what: &str) -> std::result::Result<Vec<u8>, String> {
        let n = self.count(what)?;
        self.bytes(n, what)
    }

    /// Skips a metadata value of type `t`; returns it when it is a u32 (general.alignment).
    fn value(&mut self, t: u32, key: &str, depth: u32) -> std::result::Result<Option<u64>, String> {
        let fixed = match t {
            0 | 1 | 7 => Some(1),
            2 | 3 => Some(2),
            4..=6 => Some(4),
            10..=12 => Some(8),
            _ => None,
        };
        if let Some(n) = fixed {
            let b = self.bytes(n, key)?;
            return Ok((t == 4).then(|| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as u64));
        }
        match t {
            8 => {
                let n = self.count(key)?;
                self.skip(n, key)?;
            }
            9 if depth < 4 => {
                let item = self.u32(key)?;
                let n = self.count(key)?;
                // Every item takes at least one byte.
                self.room(n, key)?;
                for _ in 0..n {
                    self.value(item, key, depth + 1)?;
                }
            }
            9 => return Err(format!("metadata `{key}`: arrays nested too deep")),
            t => return Err(format!("metadata `{key}` has an unknown value type {t}")),
        }
        Ok(None)
    }
}

/// Checks `path`'s GGUF header and that every tensor lies inside the file; the error says what
/// is wrong and where.
pub fn check_gguf(path: &Path) -> Result<()> {
    let f =
        std::fs::File::open(path).map_err(|e| Error::file(path, format!("cannot open: {e}")))?;
    let len = f
        .metadata()
        .map_err(|e| Error::file(path, format!("cannot read: {e}")))?
        .len();
    let mut h = Header {
        r: BufReader::new(f),
        pos: 0,
        len,
        v1: false,
    };
    walk(&mut h).map_err(|e| Error::file(path, format!("not a valid GGUF file: {e}")))
}

fn walk<R: Read>(h: &mut Header<R>) -> std::result::Result<(), String> {
    let magic = h.bytes(4, "the magic number")?;
    if magic != b"GGUF" {
        return Err(format!(
            "it starts with {magic:02x?}, not `GGUF` (a GGUF file starts with the bytes GGUF)"
        ));
    }
    let version = h.u32("the version")?;
    if !(1..=3).contains(&version) {
        return Err(format!("version {version}; versions 1 to 3 are read"));
    }
    h.v1 = version == 1;
    let tensors = h.count("the tensor count")?;
    let entries = h.count("the metadata count")?;
    // Every entry and tensor info takes at least 8 bytes.
    h.room(
        tensors.saturating_add(entries).saturating_mul(8),
        "the header",
    )?;
    let mut alignment = 32u64;
    for _ in 0..entries {
        let key = String::from_utf8_lossy(&h.string("a metadata key")?).into_owned();
        let t = h.u32(&key)?;
        let v = h.value(t, &key, 0)?;
        if key == "general.alignment" {
            alignment = v
                .filter(|&a| a > 0 && a.is_power_of_two())
                .ok_or_else(|| "general.alignment must be a power of two (a u32)".to_string())?;
        }
    }
    let mut infos = Vec::new();
    for _ in 0..tensors {
        let name = String::from_utf8_lossy(&h.string("a tensor name")?).into_owned();
        let dims = h.u32(&name)?;
        if dims > 4 {
            return Err(format!("tensor `{name}` has {dims} dimensions (at most 4)"));
        }
        let mut elems = 1u64;
        for _ in 0..dims {
            let d = h.count(&name)?;
            elems = elems
                .checked_mul(d)
                .ok_or_else(|| format!("tensor `{name}`: its dimensions overflow"))?;
        }
        let t = h.u32(&name)?;
        let Some(&(_, tname, bytes, block)) = GGML_TYPES.iter().find(|x| x.0 == t) else {
            let known: Vec<&str> = GGML_TYPES.iter().map(|x| x.1).collect();
            return Err(format!(
                "tensor `{name}` has GGML type {t}, which grpo cannot read (it reads {})",
                known.join(", ")
            ));
        };
        // candle reads an empty tensor through a dangling pointer cast to the block type.
        if elems == 0 {
            return Err(format!(
                "tensor `{name}` has no elements (a dimension is 0)"
            ));
        }
        if !elems.is_multiple_of(block) {
            return Err(format!(
                "tensor `{name}`: {elems} elements are not whole {tname} blocks of {block}"
            ));
        }
        let offset = h.u64(&name)?;
        infos.push((name, offset, (elems / block).saturating_mul(bytes)));
    }
    let data = h.pos.div_ceil(alignment).saturating_mul(alignment);
    for (name, offset, size) in infos {
        let end = data.saturating_add(offset).saturating_add(size);
        if end > h.len {
            return Err(format!(
                "tensor `{name}` ends at byte {end}, past the end of the file ({} bytes): the \
                 file is truncated (an interrupted download?)",
                h.len
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(bytes: &[u8]) -> std::result::Result<(), String> {
        let mut h = Header {
            r: bytes,
            pos: 0,
            len: bytes.len() as u64,
            v1: false,
        };
        walk(&mut h)
    }

    fn header(kv: &[u8], tensors: &[u8], nt: u64, nkv: u64) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend(nt.to_le_bytes());
        b.extend(nkv.to_le_bytes());
        b.extend(kv);
        b.extend(tensors);
        b
    }

    #[test]
    fn lengths_beyond_the_file_are_errors_not_allocations() {
        // A key whose length is 2^60.
        let mut kv = (1u64 << 60).to_le_bytes().to_vec();
        kv.extend(b"abc");
        let e = check(&header(&kv, &[], 0, 1)).unwrap_err();
        assert!(e.contains("truncated or corrupt"), "{e}");
        // 2^40 metadata entries in a 40-byte file.
        let e = check(&header(&[], &[], 0, 1 << 40)).unwrap_err();
        assert!(e.contains("the header"), "{e}");
        assert!(check(b"GGML").unwrap_err().contains("not `GGUF`"));
    }

    #[test]
    fn a_tensor_must_fit_in_the_file_and_have_a_known_type() {
        let tensor = |t: u32, n: u64| {
            let mut b = 1u64.to_le_bytes().to_vec();
            b.extend(b"w");
            b.extend(1u32.to_le_bytes());
            b.extend(n.to_le_bytes());
            b.extend(t.to_le_bytes());
            b.extend(0u64.to_le_bytes());
            b
        };
        let mut ok = header(&[], &tensor(0, 4), 1, 0);
        ok.resize(ok.len().div_ceil(32) * 32 + 16, 0);
        assert_eq!(check(&ok), Ok(()));
        let big = header(&[], &tensor(0, 1 << 40), 1, 0);
        assert!(check(&big).unwrap_err().contains("past the end"));
        let e = check(&header(&[], &tensor(99, 4), 1, 0)).unwrap_err();
        assert!(e.contains("GGML type 99"), "{e}");
        let e = check(&header(&[], &tensor(0, 0), 1, 0)).unwrap_err();
        assert!(e.contains("no elements"), "{e}");
    }

    mod props {
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig {
                cases: 3000,
                rng_seed: crate::files::proptests::seed(),
                ..ProptestConfig::default()
            })]

            /// Any bytes after a GGUF magic and version, checked and then (when the check
            /// passes) read by candle: an error or a file, never a panic or an abort.
            #[test]
            fn gguf_headers_of_any_bytes_never_panic(
                version in 0u32..5,
                counts in proptest::collection::vec(0u64..6, 2),
                tail in proptest::collection::vec(any::<u8>(), 0..200),
                small in proptest::collection::vec((0u64..40, 0u32..13), 0..8),
            ) {
                let mut b = b"GGUF".to_vec();
                b.extend(version.to_le_bytes());
                b.extend(counts[0].to_le_bytes());
                b.extend(counts[1].to_le_bytes());
                // Plausible small lengths and type ids, then noise.
                for (n, t) in small {
                    b.extend(n.to_le_bytes());
                    b.extend(t.to_le_bytes());
                }
                b.extend(tail);
                let dir = tempfile::tempdir().unwrap();
                let p = dir.path().join("m.gguf");
                std::fs::write(&p, &b).unwrap();
                if let Ok((mut f, content)) = crate::weights::open_gguf(&p) {
                    for name in content.tensor_infos.keys() {
                        let _ = content.tensor(&mut f, name, &candle_core::Device::Cpu);
                    }
                }
            }
        }
    }
}
