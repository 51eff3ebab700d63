//! grpo's CUDA source, run on the CPU in CI: `scripts/gpu_kernels_emu.cpp` compiles
//! `kernels/cuda/kernels.cu` and `attention_tc.cu` as C++ (a block's threads as OS threads,
//! `__syncthreads` a barrier; a warp's `mma.sync`, `ldmatrix` and lane shuffles emulated from the
//! PTX ISA's fragment layouts) and runs a kernel on inputs from files. Here its outputs are
//! compared with the kernels' Rust twins (`kernels::cuda::twin_*`, which CI compares with the
//! candle-op path): attention forward and backward (CUDA cores in f32 and bf16, tensor cores in
//! bf16), a decoding step's attention (both kernels, a shared prompt), SwiGLU, RMSNorm and RoPE;
//! and with the formulas, in f64 where they sum: the LM head's log-softmax, the residual add +
//! RMSNorm, a decoding step's q/k/v + cache write, AdamW and the clipping norm's sums of
//! squares; and NF4's dequantization with the CPU's, bit for bit: every kernel of the CUDA
//! source but `acc_add_bf16` (one add per thread). CI has no
//! GPU: this is what keeps an edit of the CUDA source honest between GPU runs
//! (`crates/grpo/tests/cuda/` runs the same source on a GPU; `scripts/check_gpu_kernels.py`
//! compares the emulator with torch, by hand).
//!
//! Needs a C++20 compiler: `g++`, or the one `CXX` names (CI's machines have g++: tokenizers'
//! esaxx and llama.cpp build with it).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use grpo_models::kernels::cuda::{
    twin_backward, twin_forward, twin_rms_norm, twin_rope, twin_swiglu, Dims,
};

/// The emulator, compiled once per test binary.
fn emulator() -> &'static Path {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let src = root.join("scripts/gpu_kernels_emu.cpp");
        // In Cargo's scratch directory for integration tests (under target/): built under this
        // process's name, then renamed into place (another test process may be building it too).
        let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
        let exe = tmp.join("gpu_kernels_emu");
        let part = tmp.join(format!("gpu_kernels_emu.{}", std::process::id()));
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
        let out = Command::new(&cxx)
            .args(["-O2", "-std=c++20", "-pthread", "-x", "c++", "-o"])
            .arg(&part)
            .arg(&src)
            .output()
            .unwrap_or_else(|e| panic!("{cxx} (a C++20 compiler, for {}): {e}", src.display()));
        assert!(
            out.status.success(),
            "{cxx} could not compile {}:\n{}",
            src.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        std::fs::rename(&part, &exe).expect("the emulator moved into place");
        exe
    })
}

/// Runs the emulator with `args` (after the data directory, or after the mode and the data
/// directory when `mode` is given) on the named inputs; returns the directory holding its outputs.
fn run(mode: Option<&str>, inputs: &[(&str, Vec<u8>)], args: &[String]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("a temp dir");
    for (name, bytes) in inputs {
        std::fs::write(dir.path().join(format!("{name}.bin")), bytes).expect("an input file");
    }
    let mut cmd = Command::new(emulator());
    if let Some(m) = mode {
        cmd.arg(m);
    }
    let out = cmd
        .arg(dir.path())
        .args(args)
        .output()
        .expect("the emulator runs");
    assert!(
        out.status.success(),
        "the emulator failed ({mode:?} {args:?}):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    dir
}

/// Deterministic normal-ish numbers (a sum of uniforms from a 64-bit LCG).
fn randn(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut uniform = move || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (s >> 40) as f32 / (1u64 << 24) as f32
    };
    (0..n)
        .map(|_| ((0..4).map(|_| uniform()).sum::<f32>() - 2.0) * 1.7 * scale)
        .collect()
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Dt {
    F32,
    Bf16,
}

impl Dt {
    fn name(self) -> &'static str {
        match self {
            Dt::F32 => "f32",
            Dt::Bf16 => "bf16",
        }
    }

    /// The values as the kernels see them (bf16: rounded to nearest even).
    fn round(self, x: &[f32]) -> Vec<f32> {
        match self {
            Dt::F32 => x.to_vec(),
            Dt::Bf16 => x
                .iter()
                .map(|v| half::bf16::from_f32(*v).to_f32())
                .collect(),
        }
    }

    fn bytes(self, x: &[f32]) -> Vec<u8> {
        match self {
            Dt::F32 => f32_bytes(x),
            Dt::Bf16 => x
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_bits().to_le_bytes())
                .collect(),
        }
    }

    fn read(self, dir: &Path, name: &str) -> Vec<f32> {
        match self {
            Dt::F32 => read_f32(dir, name),
            Dt::Bf16 => std::fs::read(dir.join(format!("{name}.bin")))
                .expect("an output file")
                .chunks_exact(2)
                .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                .collect(),
        }
    }
}

fn f32_bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn read_f32(dir: &Path, name: &str) -> Vec<f32> {
    std::fs::read(dir.join(format!("{name}.bin")))
        .expect("an output file")
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// The largest |a - e| over the largest |e| (at least 1).
fn rel(a: &[f32], e: &[f32]) -> f32 {
    assert_eq!(a.len(), e.len());
    let worst = a
        .iter()
        .zip(e)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    worst / e.iter().map(|x| x.abs()).fold(1f32, f32::max)
}

fn check(what: &str, got: &[f32], want: &[f32], tol: f32) {
    let e = rel(got, want);
    println!("{what}: {e:.2e}");
    assert!(e < tol, "{what}: {e} (tolerance {tol})");
}

/// One attention case: the three kernels (forward, dQ, dK/dV) of `kernels.cu` (or, `tc`, of
/// `attention_tc.cu`) against the twins, causal with the last row left-padded by two slots;
/// `shift`: the inputs one element off 16-byte alignment (the kernels' unaligned loads).
fn attention(dt: Dt, tc: bool, n: Dims, seed: u64) {
    attention_at(dt, tc, false, n, seed)
}

fn attention_at(dt: Dt, tc: bool, shift: bool, n: Dims, seed: u64) {
    let Dims {
        b,
        h,
        hkv,
        s,
        tk,
        d,
    } = n;
    let scale = 1.0 / (d as f32).sqrt();
    let q = dt.round(&randn(b * h * s * d, seed, 1.0));
    let k = dt.round(&randn(b * hkv * tk * d, seed + 1, 1.0));
    let v = dt.round(&randn(b * hkv * tk * d, seed + 2, 1.0));
    let mut dout = dt.round(&randn(b * h * s * d, seed + 3, 1.0));
    let mut mask = vec![0f32; b * s * tk];
    for i in 0..s {
        for j in 0..2.min(tk) {
            mask[((b - 1) * s + i) * tk + j] = -1e30;
        }
    }
    // A query that sees only padding is a padding position: its output gradient is 0 in
    // training, and its output is not compared.
    let live = |bi: usize, i: usize| (0..n_end(n, i)).any(|j| mask[(bi * s + i) * tk + j] == 0.0);
    for bi in 0..b {
        for hi in 0..h {
            for i in 0..s {
                if !live(bi, i) {
                    let at = ((bi * h + hi) * s + i) * d;
                    dout[at..at + d].iter_mut().for_each(|x| *x = 0.0);
                }
            }
        }
    }
    let mut args: Vec<String> = vec![dt.name().into()];
    args.extend([b, h, hkv, s, tk, d].iter().map(|x| x.to_string()));
    args.push(format!("{scale:?}"));
    if tc {
        args.push("tc".into());
    }
    if shift {
        args.push("shift".into());
    }
    let dir = run(
        None,
        &[
            ("q", dt.bytes(&q)),
            ("k", dt.bytes(&k)),
            ("v", dt.bytes(&v)),
            ("dout", dt.bytes(&dout)),
            ("mask", f32_bytes(&mask)),
        ],
        &args,
    );
    let (o, lse) = (dt.read(dir.path(), "o"), read_f32(dir.path(), "lse"));
    let (dq, dk, dv) = (
        dt.read(dir.path(), "dq"),
        dt.read(dir.path(), "dk"),
        dt.read(dir.path(), "dv"),
    );
    let (wo, wlse) = twin_forward(&q, &k, &v, &mask, n, scale);
    let (wdq, wdk, wdv) = twin_backward(&q, &k, &v, &mask, &wo, &dout, &wlse, n, scale);
    let keep = |x: &[f32]| -> Vec<f32> {
        x.chunks(d)
            .enumerate()
            .flat_map(|(row, r)| {
                let (bi, i) = (row / (h * s), row % s);
                let on = if live(bi, i) { 1.0 } else { 0.0 };
                r.iter().map(move |x| x * on).collect::<Vec<_>>()
            })
            .collect()
    };
    // bf16: the inputs are exact in both; the kernels round their outputs (and the tensor-core
    // ones their probabilities and dS) to bf16, ~5e-3 of the largest value at most here.
    let tol = match dt {
        Dt::F32 => 1e-4,
        Dt::Bf16 => 1.5e-2,
    };
    let what = format!(
        "{}{}{} b{b} h{h}/{hkv} s{s} tk{tk} d{d}",
        dt.name(),
        if tc { " tensor cores" } else { "" },
        if shift { " unaligned" } else { "" }
    );
    check(&format!("{what} o"), &keep(&o), &keep(&wo), tol);
    let lse_live: Vec<(f32, f32)> = lse
        .iter()
        .zip(&wlse)
        .enumerate()
        .filter(|(row, _)| live(row / (h * s), row % s))
        .map(|(_, (a, e))| (*a, *e))
        .collect();
    let (a, e): (Vec<f32>, Vec<f32>) = lse_live.into_iter().unzip();
    check(&format!("{what} lse"), &a, &e, 1e-4);
    check(&format!("{what} dq"), &dq, &wdq, tol);
    check(&format!("{what} dk"), &dk, &wdk, tol);
    check(&format!("{what} dv"), &dv, &wdv, tol);
}

/// Key slots query `i` reads (causal), as the kernels and twins count them.
fn n_end(n: Dims, i: usize) -> usize {
    (n.tk + i + 1).saturating_sub(n.s).min(n.tk)
}

fn dims(b: usize, h: usize, hkv: usize, s: usize, tk: usize, d: usize) -> Dims {
    Dims {
        b,
        h,
        hkv,
        s,
        tk,
        d,
    }
}

#[test]
fn cuda_core_attention_kernels_equal_their_twins() {
    for dt in [Dt::F32, Dt::Bf16] {
        // grouped heads, a key prefix, left padding; several query and key tiles
        attention(dt, false, dims(2, 6, 2, 7, 9, 64), 10);
        attention(dt, false, dims(1, 3, 1, 70, 75, 32), 11);
    }
    attention(Dt::F32, false, dims(2, 4, 2, 9, 9, 16), 12);
}

#[test]
fn tensor_core_attention_kernels_equal_their_twins() {
    attention(Dt::Bf16, true, dims(2, 6, 2, 7, 9, 64), 20);
    attention(Dt::Bf16, true, dims(1, 2, 2, 130, 140, 64), 21); // three query tiles
    attention(Dt::Bf16, true, dims(1, 3, 1, 70, 75, 32), 22);
    attention(Dt::Bf16, true, dims(2, 4, 2, 9, 11, 16), 23);
    attention(Dt::Bf16, true, dims(1, 2, 1, 5, 5, 128), 24);
    attention_at(Dt::Bf16, true, true, dims(2, 4, 2, 70, 75, 64), 25); // unaligned inputs
}

#[test]
fn swiglu_rms_norm_and_rope_kernels_equal_their_twins() {
    for (dt, tol) in [(Dt::F32, 1e-5f32), (Dt::Bf16, 2e-2)] {
        // SwiGLU: gu [N, 2I] -> y [N, I], d gu.
        let (rows, inter) = (7, 300);
        let gu = dt.round(&randn(rows * 2 * inter, 30, 3.0));
        let dy = dt.round(&randn(rows * inter, 31, 1.0));
        let dir = run(
            Some("swiglu"),
            &[("gu", dt.bytes(&gu)), ("dy", dt.bytes(&dy))],
            &[dt.name().into(), rows.to_string(), inter.to_string()],
        );
        let (wy, wdgu) = twin_swiglu(&gu, &dy, inter);
        check(
            &format!("{} swiglu y", dt.name()),
            &dt.read(dir.path(), "y"),
            &wy,
            tol,
        );
        check(
            &format!("{} swiglu dgu", dt.name()),
            &dt.read(dir.path(), "dgu"),
            &wdgu,
            tol,
        );

        // RMSNorm: x [N, H], w [H], g [N, H] -> y, dx, and g * normalized x (summed: dw).
        let (rows, hidden, eps) = (5, 300, 1e-5f32);
        let x = dt.round(&randn(rows * hidden, 32, 2.0));
        let w: Vec<f32> = dt.round(
            &randn(hidden, 33, 0.1)
                .iter()
                .map(|v| 1.0 + v)
                .collect::<Vec<_>>(),
        );
        let g = dt.round(&randn(rows * hidden, 34, 1.0));
        let dir = run(
            Some("rmsnorm"),
            &[
                ("x", dt.bytes(&x)),
                ("w", dt.bytes(&w)),
                ("g", dt.bytes(&g)),
            ],
            &[
                dt.name().into(),
                rows.to_string(),
                hidden.to_string(),
                format!("{eps:?}"),
            ],
        );
        let (wy, wdx, wdw) = twin_rms_norm(&x, &w, &g, eps);
        let gn = read_f32(dir.path(), "gn");
        let dw: Vec<f32> = (0..hidden)
            .map(|c| (0..rows).map(|r| gn[r * hidden + c]).sum())
            .collect();
        let name = dt.name();
        check(
            &format!("{name} rms-norm y"),
            &dt.read(dir.path(), "y"),
            &wy,
            tol,
        );
        check(
            &format!("{name} rms-norm dx"),
            &dt.read(dir.path(), "dx"),
            &wdx,
            tol,
        );
        check(&format!("{name} rms-norm dw"), &dw, &wdw, tol);

        // RoPE: x [B, T, H*D] -> y [B, H, T, D]; dy [B, H, T, D] -> dx [B, T, H*D].
        let (b, t, h, d) = (2, 5, 3, 64);
        let x = dt.round(&randn(b * t * h * d, 35, 1.0));
        let ang = randn(b * t * d / 2, 36, 1.0);
        let cos = dt.round(&ang.iter().map(|a| a.cos()).collect::<Vec<_>>());
        let sin = dt.round(&ang.iter().map(|a| a.sin()).collect::<Vec<_>>());
        let dy = dt.round(&randn(b * h * t * d, 37, 1.0));
        let dir = run(
            Some("rope"),
            &[
                ("x", dt.bytes(&x)),
                ("cos", dt.bytes(&cos)),
                ("sin", dt.bytes(&sin)),
                ("g", dt.bytes(&dy)),
            ],
            &[
                dt.name().into(),
                b.to_string(),
                t.to_string(),
                h.to_string(),
                d.to_string(),
                (h * d).to_string(),
            ],
        );
        let (wy, wdx) = twin_rope(&x, &cos, &sin, &dy, (b, t, h, d));
        check(
            &format!("{name} rope y"),
            &dt.read(dir.path(), "y"),
            &wy,
            tol,
        );
        check(
            &format!("{name} rope dx"),
            &dt.read(dir.path(), "dx"),
            &wdx,
            tol,
        );

        // RoPE of the keys as the one-op layer passes them (gpu_layer.rs): a view of the joined
        // q/k/v output [B, T, (H + 2 Hkv) D], from column H*D, its rows `width` apart.
        let (hq, hkv) = (h, 2);
        let width = (hq + 2 * hkv) * d;
        let joined = dt.round(&randn(b * t * width, 38, 1.0));
        let off = hq * d;
        let mut from_view = joined[off..].to_vec(); // what the kernel's pointer sees
        from_view.resize(b * t * width, 0.0);
        let keys: Vec<f32> = (0..b * t)
            .flat_map(|r| joined[r * width + off..r * width + off + hkv * d].to_vec())
            .collect(); // the view, contiguous [B, T, Hkv*D]
        let dk = dt.round(&randn(b * hkv * t * d, 39, 1.0));
        let dir = run(
            Some("rope"),
            &[
                ("x", dt.bytes(&from_view)),
                ("cos", dt.bytes(&cos)),
                ("sin", dt.bytes(&sin)),
                ("g", dt.bytes(&dk)),
            ],
            &[
                dt.name().into(),
                b.to_string(),
                t.to_string(),
                hkv.to_string(),
                d.to_string(),
                width.to_string(),
            ],
        );
        let (wy, wdx) = twin_rope(&keys, &cos, &sin, &dk, (b, t, hkv, d));
        check(
            &format!("{name} rope y of a joined view"),
            &dt.read(dir.path(), "y"),
            &wy,
            tol,
        );
        check(
            &format!("{name} rope dx of a joined view"),
            &dt.read(dir.path(), "dx"),
            &wdx,
            tol,
        );
    }
}

/// A decoding step's attention (`attn_decode`, or `attn_decode_warp`): one query per row over
/// the first `tk` slots of caches with `max_t` slots, rows 0 and 1 left-padded by three slots,
/// against the forward twin with one query. With `shared` (slots < `end` of row b read from row
/// `leader[b]`), the followers' own prompt slots hold other values, which must not be read: the
/// twin sees the leaders' there.
fn decode(
    dt: Dt,
    warp: bool,
    (b, h, hkv, tk, max_t, d): (usize, usize, usize, usize, usize, usize),
    shared: Option<(&[u32], usize)>,
) {
    let scale = 1.0 / (d as f32).sqrt();
    let q = dt.round(&randn(b * h * d, 40 + tk as u64, 1.0));
    let kc = dt.round(&randn(b * hkv * max_t * d, 41, 1.0));
    let vc = dt.round(&randn(b * hkv * max_t * d, 42, 1.0));
    let mut mask = vec![0f32; b * tk];
    for row in 0..2.min(b) {
        mask[row * tk..row * tk + 3.min(tk)]
            .iter_mut()
            .for_each(|m| *m = -1e30);
    }
    let mut args: Vec<String> = vec![dt.name().into()];
    args.extend([b, h, hkv, tk, max_t, d].iter().map(|x| x.to_string()));
    args.push(format!("{scale:?}"));
    if warp {
        args.push("warp".into());
    }
    let mut inputs = vec![
        ("q", dt.bytes(&q)),
        ("k", dt.bytes(&kc)),
        ("v", dt.bytes(&vc)),
        ("mask", f32_bytes(&mask)),
    ];
    if let Some((leader, end)) = shared {
        args.push(format!("shared={end}"));
        inputs.push((
            "leader",
            leader.iter().flat_map(|l| l.to_le_bytes()).collect(),
        ));
    }
    let dir = run(Some("decode"), &inputs, &args);
    // The twin reads the first tk slots of each cache row, a follower's first `end` from its
    // leader.
    let first = |c: &[f32]| -> Vec<f32> {
        let rows: Vec<&[f32]> = c.chunks(max_t * d).collect(); // [B * Hkv] rows of slots
        let mut out = Vec::with_capacity(b * hkv * tk * d);
        for bk in 0..b * hkv {
            let (bi, hk) = (bk / hkv, bk % hkv);
            for j in 0..tk {
                let src = match shared {
                    Some((leader, end)) if j < end => leader[bi] as usize * hkv + hk,
                    _ => bk,
                };
                out.extend_from_slice(&rows[src][j * d..(j + 1) * d]);
            }
        }
        out
    };
    let (want, _) = twin_forward(
        &q,
        &first(&kc),
        &first(&vc),
        &mask,
        dims(b, h, hkv, 1, tk, d),
        scale,
    );
    let tol = match dt {
        Dt::F32 => 1e-5,
        Dt::Bf16 => 1e-2,
    };
    let what = format!(
        "{} decode{}{} b{b} h{h}/{hkv} tk{tk}/{max_t} d{d} o",
        dt.name(),
        if warp { " warp" } else { "" },
        if shared.is_some() { " shared" } else { "" }
    );
    check(&what, &dt.read(dir.path(), "o"), &want, tol);
}

#[test]
fn decoding_attention_kernels_equal_the_forward_twin() {
    for warp in [false, true] {
        for dt in [Dt::F32, Dt::Bf16] {
            decode(dt, warp, (2, 6, 2, 300, 320, 64), None); // grouped heads, a cache view
        }
        decode(Dt::Bf16, warp, (3, 4, 4, 37, 40, 64), None); // one query head per kv head
        decode(Dt::Bf16, warp, (1, 16, 2, 130, 140, 32), None); // eight per kv head
        decode(Dt::F32, warp, (1, 3, 1, 9, 9, 128), None);
        decode(Dt::Bf16, warp, (2, 4, 2, 5, 8, 16), None); // fewer slots than a warp's groups
                                                           // A shared prompt: rows 0 and 1 one group (its first 20 slots from row 0), row 2 its own.
        for dt in [Dt::F32, Dt::Bf16] {
            decode(dt, warp, (3, 4, 4, 37, 40, 64), Some((&[0, 0, 2], 20)));
            decode(dt, warp, (3, 6, 2, 90, 96, 32), Some((&[0, 0, 2], 40)));
        }
    }
}

/// The LM head's log-softmax kernels (`head_fwd`, `head_bwd`): logits [C, V] at temperature
/// 1 / `inv_t`, targets, the outputs' gradient [C, 2] (log-prob, entropy) -> [C, 2], lse and
/// d logits, against the formulas in f64.
fn head(dt: Dt, (c, v, inv_t): (usize, usize, f32)) {
    let z = dt.round(&randn(c * v, 50, 4.0));
    let y: Vec<u32> = (0..c as u32).map(|i| (i * 7919 + 13) % v as u32).collect();
    let g = randn(c * 2, 51, 1.0);
    let dir = run(
        Some("head"),
        &[
            ("z", dt.bytes(&z)),
            ("y", y.iter().flat_map(|t| t.to_le_bytes()).collect()),
            ("g", f32_bytes(&g)),
        ],
        &[
            dt.name().into(),
            c.to_string(),
            v.to_string(),
            format!("{inv_t:?}"),
        ],
    );
    let (mut out, mut lse, mut dz) = (vec![0f32; 2 * c], vec![0f32; c], vec![0f32; c * v]);
    for r in 0..c {
        let t: Vec<f64> = z[r * v..(r + 1) * v]
            .iter()
            .map(|x| *x as f64 * inv_t as f64)
            .collect();
        let m = t.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let l = m + t.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
        let p: Vec<f64> = t.iter().map(|x| (x - l).exp()).collect();
        let ent = l - p.iter().zip(&t).map(|(p, x)| p * x).sum::<f64>();
        let yr = y[r] as usize;
        out[2 * r] = (t[yr] - l) as f32;
        out[2 * r + 1] = ent as f32;
        lse[r] = l as f32;
        let (g0, g1) = (g[2 * r] as f64, g[2 * r + 1] as f64);
        for i in 0..v {
            let onehot = if i == yr { 1.0 } else { 0.0 };
            // d lp / dt = onehot - p; d H / dt = -p (t - lse + H).
            let d = g0 * (onehot - p[i]) - g1 * p[i] * (t[i] - l + ent);
            dz[r * v + i] = (d * inv_t as f64) as f32;
        }
    }
    let tol = match dt {
        Dt::F32 => 1e-5,
        Dt::Bf16 => 1e-2,
    };
    let name = dt.name();
    check(
        &format!("{name} head out"),
        &read_f32(dir.path(), "out"),
        &out,
        tol,
    );
    check(
        &format!("{name} head lse"),
        &read_f32(dir.path(), "lse"),
        &lse,
        1e-5,
    );
    check(
        &format!("{name} head dz"),
        &dt.read(dir.path(), "dz"),
        &dz,
        tol,
    );
}

#[test]
fn head_add_rms_norm_and_rope_append_kernels_equal_their_references() {
    for (dt, tol) in [(Dt::F32, 1e-5f32), (Dt::Bf16, 2e-2)] {
        head(dt, (3, 1000, 1.0 / 0.7));
        let name = dt.name();

        // The residual add + RMSNorm: s = x + a (in the dtype), y = RMSNorm(s) * w.
        let (rows, hidden, eps) = (5, 300, 1e-5f32);
        let x = dt.round(&randn(rows * hidden, 60, 1.0));
        let a = dt.round(&randn(rows * hidden, 61, 1.0));
        let w = dt.round(
            &randn(hidden, 62, 0.3)
                .iter()
                .map(|v| 1.0 + v)
                .collect::<Vec<_>>(),
        );
        let dir = run(
            Some("add_rms"),
            &[
                ("x", dt.bytes(&x)),
                ("a", dt.bytes(&a)),
                ("w", dt.bytes(&w)),
            ],
            &[
                dt.name().into(),
                rows.to_string(),
                hidden.to_string(),
                format!("{eps:?}"),
            ],
        );
        let sum = dt.round(&x.iter().zip(&a).map(|(p, q)| p + q).collect::<Vec<_>>());
        let (wy, _, _) = twin_rms_norm(&sum, &w, &vec![0.0; sum.len()], eps);
        check(
            &format!("{name} add_rms sum"),
            &dt.read(dir.path(), "s"),
            &sum,
            tol,
        );
        check(
            &format!("{name} add_rms y"),
            &dt.read(dir.path(), "y"),
            &wy,
            tol,
        );

        // A decoding step's q/k/v: x [B, 1, XS] (q, k, v heads first) -> q rotated [B, H, 1, D];
        // k rotated and v written into slot `slot` of caches [B, Hkv, SLOTS, D].
        let (b, h, hkv, d, slots, slot) = (3, 6, 2, 64, 10, 7);
        let xs = (h + 2 * hkv) * d + 32;
        let x = dt.round(&randn(b * xs, 63, 1.0));
        let ang = randn(b * d / 2, 64, 2.0);
        let cos = dt.round(&ang.iter().map(|a| a.cos()).collect::<Vec<_>>());
        let sin = dt.round(&ang.iter().map(|a| a.sin()).collect::<Vec<_>>());
        let kc = dt.round(&randn(b * hkv * slots * d, 65, 1.0));
        let vc = dt.round(&randn(b * hkv * slots * d, 66, 1.0));
        let dir = run(
            Some("rope_append"),
            &[
                ("x", dt.bytes(&x)),
                ("cos", dt.bytes(&cos)),
                ("sin", dt.bytes(&sin)),
                ("kc", dt.bytes(&kc)),
                ("vc", dt.bytes(&vc)),
            ],
            &[
                dt.name().into(),
                b.to_string(),
                h.to_string(),
                hkv.to_string(),
                d.to_string(),
                xs.to_string(),
                slots.to_string(),
                slot.to_string(),
            ],
        );
        // Each part of x as [B, 1, heads*D], rotated by the RoPE twin into [B, heads, 1, D].
        let part = |from: usize, heads: usize| -> Vec<f32> {
            (0..b)
                .flat_map(|bi| x[bi * xs + from..bi * xs + from + heads * d].to_vec())
                .collect()
        };
        let rot = |p: &[f32], heads: usize| {
            twin_rope(p, &cos, &sin, &vec![0.0; p.len()], (b, 1, heads, d)).0
        };
        let want_q = rot(&part(0, h), h);
        let want_k = rot(&part(h * d, hkv), hkv);
        let v_new = part((h + hkv) * d, hkv);
        let (mut wkc, mut wvc) = (kc.clone(), vc.clone());
        for bk in 0..b * hkv {
            let at = (bk * slots + slot) * d;
            wkc[at..at + d].copy_from_slice(&want_k[bk * d..(bk + 1) * d]);
            wvc[at..at + d].copy_from_slice(&v_new[bk * d..(bk + 1) * d]);
        }
        check(
            &format!("{name} rope_append q"),
            &dt.read(dir.path(), "q"),
            &want_q,
            tol,
        );
        check(
            &format!("{name} rope_append kc"),
            &dt.read(dir.path(), "kc_out"),
            &wkc,
            tol,
        );
        check(
            &format!("{name} rope_append vc"),
            &dt.read(dir.path(), "vc_out"),
            &wvc,
            tol,
        );
    }
}

/// AdamW's kernel over three steps (torch's bias corrections, a clipping factor) against the
/// update in f64, and the clipping norm's sums of squares over a fixed grid.
#[test]
fn adamw_and_sum_of_squares_kernels_equal_their_references() {
    let (n, steps, gs) = (1000usize, 3usize, 0.7f32);
    let (lr, b1, b2, eps, wd) = (1e-3f32, 0.9f32, 0.999f32, 1e-8f32, 0.01f32);
    let p0 = randn(n, 70, 1.0);
    let grads = randn(n * steps, 71, 1.0);
    let dir = run(
        Some("adamw"),
        &[("p", f32_bytes(&p0)), ("g", f32_bytes(&grads))],
        &[
            n.to_string(),
            steps.to_string(),
            format!("{lr:?}"),
            format!("{b1:?}"),
            format!("{b2:?}"),
            format!("{eps:?}"),
            format!("{wd:?}"),
            format!("{gs:?}"),
        ],
    );
    let (mut p, mut m, mut v) = (
        p0.iter().map(|x| *x as f64).collect::<Vec<_>>(),
        vec![0f64; n],
        vec![0f64; n],
    );
    let (lr, b1, b2, eps, wd) = (lr as f64, b1 as f64, b2 as f64, eps as f64, wd as f64);
    for t in 1..=steps {
        let (bc1, bc2) = (1.0 - b1.powi(t as i32), 1.0 - b2.powi(t as i32));
        for i in 0..n {
            let g = grads[(t - 1) * n + i] as f64 * gs as f64;
            p[i] *= 1.0 - lr * wd;
            m[i] = b1 * m[i] + (1.0 - b1) * g;
            v[i] = b2 * v[i] + (1.0 - b2) * g * g;
            p[i] -= lr / bc1 * m[i] / (v[i].sqrt() / bc2.sqrt() + eps);
        }
    }
    let f = |x: &[f64]| x.iter().map(|y| *y as f32).collect::<Vec<_>>();
    // 1 - beta2 is formed in f32 by grpo (~1.3e-5 of v's value off f64's).
    check("adamw p", &read_f32(dir.path(), "p_out"), &f(&p), 1e-5);
    check("adamw m", &read_f32(dir.path(), "m"), &f(&m), 1e-5);
    let vmax = v.iter().cloned().fold(0f64, f64::max) as f32;
    let vrel: Vec<f32> = f(&v).iter().map(|x| x / vmax).collect();
    let got: Vec<f32> = read_f32(dir.path(), "v").iter().map(|x| x / vmax).collect();
    check("adamw v (over its largest)", &got, &vrel, 3e-5);

    for (n, blocks) in [(70001usize, 16usize), (100, 16)] {
        let x = randn(n, 72, 1.0);
        let dir = run(
            Some("sumsq"),
            &[("x", f32_bytes(&x))],
            &[n.to_string(), blocks.to_string()],
        );
        let parts = read_f32(dir.path(), "out");
        assert_eq!(parts.len(), blocks);
        let got: f64 = parts.iter().map(|p| *p as f64).sum();
        let want: f64 = x.iter().map(|v| (*v as f64).powi(2)).sum();
        let e = (got - want).abs() / want;
        println!("sumsq n{n} over {blocks} blocks: {e:.2e}");
        assert!(e < 1e-6, "sumsq n{n}: {e}");
    }
}

/// NF4 dequantization (QLoRA's base on a GPU) against `Nf4::dequantize_into`, bit for bit: an
/// odd count whose last block is short (a half-used last byte), in f32 and rounded to bf16.
#[test]
fn nf4_dequantization_kernel_equals_the_cpu_dequantization() {
    use grpo_models::kernels::cpu::quant::{Nf4, NF4_CODE};
    for (rows, cols) in [(7usize, 93usize), (3, 128)] {
        let n = rows * cols;
        let w = randn(n, 80 + rows as u64, 0.05);
        let q = Nf4::quantize(&w, rows, cols).expect("nf4 quantizes");
        let mut want = vec![0f32; n];
        q.dequantize_into(&mut want);
        for dt in [Dt::F32, Dt::Bf16] {
            let dir = run(
                Some("nf4"),
                &[
                    ("packed", q.packed.clone()),
                    ("absmax", f32_bytes(&q.absmax)),
                    ("code", f32_bytes(&NF4_CODE)),
                ],
                &[dt.name().to_string(), n.to_string()],
            );
            let got = dt.read(dir.path(), "out");
            let want = dt.round(&want);
            assert_eq!(got.len(), n);
            let bad = got
                .iter()
                .zip(&want)
                .position(|(a, b)| a.to_bits() != b.to_bits());
            assert!(bad.is_none(), "{dt:?} [{rows}, {cols}] differs at {bad:?}");
        }
    }
}
