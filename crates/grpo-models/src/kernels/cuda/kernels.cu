// grpo's GPU kernels, compiled at run time by NVRTC (no headers): f32 arithmetic over bf16 or f32
// tensors. Each kernel is launched from its op's file in this folder (`attention.rs`,
// `rms_norm.rs`, ...); its plain-Rust twin is in `twins.rs`.
//
// Attention: FlashAttention's plan (scores never stored, one log-sum-exp per query kept for the
// backward), in 64 x 64 tiles through shared memory: forward and dQ per block of queries, dK and
// dV per block of keys.
// q [B, H, S, D], k/v [B, Hkv, Tk, D], o/dO [B, H, S, D], mask [B, S, Tk] f32 additive,
// lse/delta [B, H, S] f32. Query i reads key slots 0 ..= Tk - S + i (causal), the mask adds on top.
//
// SwiGLU: gu [N, 2I] (gate, then up, per row) -> silu(gate) * up [N, I], and its backward.
// RMSNorm: a block per row, forward and backward. RoPE: rotate-half over a strided [B, T, H*D]
// view into [B, H, T, D], and its backward. NF4: a QLoRA base's weight dequantized (`quant.rs`;
// its twin is `Nf4::dequantize_into`).

typedef unsigned short bf16_t;

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }

__device__ __forceinline__ float ld(const float* p, long i) { return p[i]; }
__device__ __forceinline__ float ld(const bf16_t* p, long i) {
    return __uint_as_float(((unsigned int)p[i]) << 16);
}
__device__ __forceinline__ void st(float* p, long i, float x) { p[i] = x; }
__device__ __forceinline__ bf16_t to_bf16(float x) {
    unsigned int u = __float_as_uint(x);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu))
        return (bf16_t)((u >> 16) | 0x40u);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    return (bf16_t)(u >> 16);
}
__device__ __forceinline__ void st(bf16_t* p, long i, float x) { p[i] = to_bf16(x); }

// Attention works on 64 x 64 tiles of scores: a block of 256 threads (16 x 16, tx fastest) holds
// 64 queries (forward, dQ) or 64 keys (dK/dV) and walks the other side's tiles through shared
// memory; each thread owns a 4 x 4 patch of a tile (rows ty*4 .. ty*4+3, columns tx + 16 j) and
// the matching rows x D/16 columns of the accumulated output. Shared rows are stored with a
// stride of D + 1 floats, so that 16 threads reading 16 rows at one column hit 16 banks.
#define AT 64
#define ATH 256
#define NEG_INF __int_as_float(0xff800000)

// Rows row0 .. row0 + AT of a [.., D] tensor into dst [AT][D + 1] f32 times `mul` (rows from
// `valid` on are zeros).
template <typename T, int D>
__device__ void load_rows(const T* src, long row0, int valid, float* dst, float mul) {
    for (int e = threadIdx.x; e < AT * D; e += ATH) {
        const int r = e / D, d = e % D;
        dst[r * (D + 1) + d] = r < valid ? ld(src, (row0 + r) * D + d) * mul : 0.f;
    }
}

// Whether query i (of S) may read key slot j (of Tk): causal, inside both.
__device__ __forceinline__ bool visible(int i, int j, int S, int Tk) {
    return i < S && j < Tk && j <= Tk - S + i;
}

// Sum over the 16 threads of a row group (same ty) of one value per owned row, through red
// [AT][16]: every thread of the group gets the 4 sums (or maxima).
__device__ void rows_reduce(float v[4], float* red, bool max) {
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    __syncthreads();
#pragma unroll
    for (int a = 0; a < 4; ++a) red[(ty * 4 + a) * 16 + tx] = v[a];
    __syncthreads();
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        float r = red[(ty * 4 + a) * 16];
        for (int t = 1; t < 16; ++t) {
            const float x = red[(ty * 4 + a) * 16 + t];
            r = max ? fmaxf(r, x) : r + x;
        }
        v[a] = r;
    }
}

// A thread's 4 x 4 patch of the products of two shared tiles over D: s[a][c] += sum_d
// r[ty*4 + a][d] * c[tx + 16 c][d] (rows of `r` along the patch's rows, of `c` along its columns).
template <int D>
__device__ __forceinline__ void patch_dot(const float* r, const float* c, float s[4][4]) {
    constexpr int P = D + 1;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    for (int d = 0; d < D; ++d) {
        float ra[4], cb[4];
#pragma unroll
        for (int a = 0; a < 4; ++a) ra[a] = r[(ty * 4 + a) * P + d];
#pragma unroll
        for (int b = 0; b < 4; ++b) cb[b] = c[(tx + 16 * b) * P + d];
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int b = 0; b < 4; ++b) s[a][b] += ra[a] * cb[b];
    }
}

// Two patches at once, sharing the loop: s from (r1, c1), t from (r2, c2).
template <int D>
__device__ __forceinline__ void patch_dot2(const float* r1, const float* c1, const float* r2,
                                           const float* c2, float s[4][4], float t[4][4]) {
    constexpr int P = D + 1;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    for (int d = 0; d < D; ++d) {
        float ra[4], cb[4], rc[4], cd[4];
#pragma unroll
        for (int a = 0; a < 4; ++a) {
            ra[a] = r1[(ty * 4 + a) * P + d];
            rc[a] = r2[(ty * 4 + a) * P + d];
        }
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            cb[b] = c1[(tx + 16 * b) * P + d];
            cd[b] = c2[(tx + 16 * b) * P + d];
        }
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                s[a][b] += ra[a] * cb[b];
                t[a][b] += rc[a] * cd[b];
            }
    }
}

// Forward: o and lse (FlashAttention's online softmax). Grid: (ceil(S / AT), B * H).
template <typename T, int D>
__device__ void attn_fwd(const T* q, const T* k, const T* v, const float* mask, T* o, float* lse,
                         int H, int Hkv, int S, int Tk, float scale) {
    extern __shared__ float sm[];
    constexpr int P = D + 1, DJ = D / 16;
    float* qs = sm;                    // [AT][P] queries times scale
    float* ks = qs + AT * P;           // [AT][P]
    float* vs = ks + AT * P;           // [AT][P]
    float* ps = vs + AT * P;           // [AT][AT + 1] probabilities
    float* red = ps + AT * (AT + 1);   // [AT][16]
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const int bh = blockIdx.y, b = bh / H, h = bh % H, hk = h / (H / Hkv);
    const int i0 = blockIdx.x * AT;
    const long qo = (long)bh * S, ko = ((long)b * Hkv + hk) * Tk;
    load_rows<T, D>(q, qo + i0, imin(AT, S - i0), qs, scale);
    float m[4], l[4], acc[4][DJ];
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        m[a] = NEG_INF;
        l[a] = 0.f;
#pragma unroll
        for (int c = 0; c < DJ; ++c) acc[a][c] = 0.f;
    }
    const int kend = imin(Tk, Tk - S + i0 + AT);
    for (int j0 = 0; j0 < kend; j0 += AT) {
        __syncthreads();
        load_rows<T, D>(k, ko + j0, imin(AT, Tk - j0), ks, 1.f);
        load_rows<T, D>(v, ko + j0, imin(AT, Tk - j0), vs, 1.f);
        __syncthreads();
        float s[4][4], mx[4];
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int c = 0; c < 4; ++c) s[a][c] = 0.f;
        patch_dot<D>(qs, ks, s);
#pragma unroll
        for (int a = 0; a < 4; ++a) {
            const int i = i0 + ty * 4 + a;
            mx[a] = m[a];
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int j = j0 + tx + 16 * c;
                s[a][c] = visible(i, j, S, Tk) ? s[a][c] + mask[((long)b * S + i) * Tk + j] : NEG_INF;
                mx[a] = fmaxf(mx[a], s[a][c]);
            }
        }
        rows_reduce(mx, red, true);
#pragma unroll
        for (int a = 0; a < 4; ++a) {
            const float c0 = mx[a] == NEG_INF ? 1.f : __expf(m[a] - mx[a]);
            l[a] *= c0;
#pragma unroll
            for (int c = 0; c < DJ; ++c) acc[a][c] *= c0;
            m[a] = mx[a];
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const float p = s[a][c] == NEG_INF ? 0.f : __expf(s[a][c] - mx[a]);
                l[a] += p;
                ps[(ty * 4 + a) * (AT + 1) + tx + 16 * c] = p;
            }
        }
        __syncthreads();
        for (int j = 0; j < AT; ++j) {
            float vb[DJ];
#pragma unroll
            for (int c = 0; c < DJ; ++c) vb[c] = vs[j * P + tx + 16 * c];
#pragma unroll
            for (int a = 0; a < 4; ++a) {
                const float p = ps[(ty * 4 + a) * (AT + 1) + j];
#pragma unroll
                for (int c = 0; c < DJ; ++c) acc[a][c] += p * vb[c];
            }
        }
    }
    rows_reduce(l, red, false);
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        const int i = i0 + ty * 4 + a;
        if (i >= S) continue;
        const float inv = l[a] > 0.f ? 1.f / l[a] : 0.f;
#pragma unroll
        for (int c = 0; c < DJ; ++c) st(o, (qo + i) * D + tx + 16 * c, acc[a][c] * inv);
        if (tx == 0) lse[qo + i] = m[a] + logf(l[a]);
    }
}

// Backward for queries: delta = rowsum(dO * O) (kept for the dK/dV kernel), and
// dQ = scale * sum_j P (dO.v_j - delta) k_j. Grid: (ceil(S / AT), B * H).
template <typename T, int D>
__device__ void attn_bwd_dq(const T* q, const T* k, const T* v, const float* mask, const T* o,
                            const T* dout, const float* lse, float* delta, T* dq, int H, int Hkv,
                            int S, int Tk, float scale) {
    extern __shared__ float sm[];
    constexpr int P = D + 1, DJ = D / 16;
    float* qs = sm;                    // [AT][P] queries times scale
    float* gs = qs + AT * P;           // [AT][P] dO
    float* ks = gs + AT * P;           // [AT][P]
    float* vs = ks + AT * P;           // [AT][P]
    float* ds = vs + AT * P;           // [AT][AT + 1] dS
    float* red = ds + AT * (AT + 1);   // [AT][16]
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const int bh = blockIdx.y, b = bh / H, h = bh % H, hk = h / (H / Hkv);
    const int i0 = blockIdx.x * AT;
    const long qo = (long)bh * S, ko = ((long)b * Hkv + hk) * Tk;
    const int rows = imin(AT, S - i0);
    load_rows<T, D>(q, qo + i0, rows, qs, scale);
    load_rows<T, D>(dout, qo + i0, rows, gs, 1.f);
    __syncthreads();
    float dl[4], li[4], acc[4][DJ];
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        const int i = i0 + ty * 4 + a;
        dl[a] = 0.f;
        if (i < S) {
#pragma unroll
            for (int c = 0; c < DJ; ++c)
                dl[a] += gs[(ty * 4 + a) * P + tx + 16 * c] * ld(o, (qo + i) * D + tx + 16 * c);
        }
        li[a] = i < S ? lse[qo + i] : 0.f;
#pragma unroll
        for (int c = 0; c < DJ; ++c) acc[a][c] = 0.f;
    }
    rows_reduce(dl, red, false);
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        const int i = i0 + ty * 4 + a;
        if (tx == 0 && i < S) delta[qo + i] = dl[a];
    }
    const int kend = imin(Tk, Tk - S + i0 + AT);
    for (int j0 = 0; j0 < kend; j0 += AT) {
        __syncthreads();
        load_rows<T, D>(k, ko + j0, imin(AT, Tk - j0), ks, 1.f);
        load_rows<T, D>(v, ko + j0, imin(AT, Tk - j0), vs, 1.f);
        __syncthreads();
        float s[4][4], dp[4][4];
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int c = 0; c < 4; ++c) s[a][c] = dp[a][c] = 0.f;
        patch_dot2<D>(qs, ks, gs, vs, s, dp);
#pragma unroll
        for (int a = 0; a < 4; ++a) {
            const int i = i0 + ty * 4 + a;
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int j = j0 + tx + 16 * c;
                const float p = visible(i, j, S, Tk)
                    ? __expf(s[a][c] + mask[((long)b * S + i) * Tk + j] - li[a]) : 0.f;
                ds[(ty * 4 + a) * (AT + 1) + tx + 16 * c] = p * (dp[a][c] - dl[a]);
            }
        }
        __syncthreads();
        for (int j = 0; j < AT; ++j) {
            float kb[DJ];
#pragma unroll
            for (int c = 0; c < DJ; ++c) kb[c] = ks[j * P + tx + 16 * c];
#pragma unroll
            for (int a = 0; a < 4; ++a) {
                const float x = ds[(ty * 4 + a) * (AT + 1) + j];
#pragma unroll
                for (int c = 0; c < DJ; ++c) acc[a][c] += x * kb[c];
            }
        }
    }
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        const int i = i0 + ty * 4 + a;
        if (i >= S) continue;
#pragma unroll
        for (int c = 0; c < DJ; ++c) st(dq, (qo + i) * D + tx + 16 * c, acc[a][c] * scale);
    }
}

// Backward for keys: over the g query heads that read a key and the queries that reach it,
// dV_j = sum P dO_i and dK_j = scale * sum P (dO_i.v_j - delta_i) q_i. A block holds 64 keys of
// one (b, kv head); its thread rows are keys, its columns queries. Grid: (ceil(Tk / AT), B * Hkv).
template <typename T, int D>
__device__ void attn_bwd_dkv(const T* q, const T* k, const T* v, const float* mask, const T* dout,
                             const float* lse, const float* delta, T* dk, T* dv, int H, int Hkv,
                             int S, int Tk, float scale) {
    extern __shared__ float sm[];
    constexpr int P = D + 1, DJ = D / 16;
    float* ks = sm;                    // [AT][P] keys times scale
    float* vs = ks + AT * P;           // [AT][P]
    float* qs = vs + AT * P;           // [AT][P]
    float* gs = qs + AT * P;           // [AT][P] dO
    float* ps = gs + AT * P;           // [AT][AT + 1] P^T (the mask first), keys x queries
    float* ds = ps + AT * (AT + 1);    // [AT][AT + 1] dS^T
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const int bk = blockIdx.y, b = bk / Hkv, hk = bk % Hkv, g = H / Hkv;
    const int j0 = blockIdx.x * AT;
    const long ko = (long)bk * Tk;
    load_rows<T, D>(k, ko + j0, imin(AT, Tk - j0), ks, scale);
    load_rows<T, D>(v, ko + j0, imin(AT, Tk - j0), vs, 1.f);
    float ak[4][DJ], av[4][DJ];
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
        for (int c = 0; c < DJ; ++c) ak[a][c] = av[a][c] = 0.f;
    const int istart = imax(0, j0 - (Tk - S));
    for (int hh = hk * g; hh < (hk + 1) * g; ++hh) {
        const long qo = ((long)b * H + hh) * S;
        for (int i0 = istart; i0 < S; i0 += AT) {
            __syncthreads();
            const int rows = imin(AT, S - i0);
            load_rows<T, D>(q, qo + i0, rows, qs, 1.f);
            load_rows<T, D>(dout, qo + i0, rows, gs, 1.f);
            // The mask's tile, transposed (read along keys: coalesced).
            for (int e = threadIdx.x; e < AT * AT; e += ATH) {
                const int r = e / AT, c = e % AT;  // query r, key c
                ps[c * (AT + 1) + r] = (i0 + r < S && j0 + c < Tk)
                    ? mask[((long)b * S + i0 + r) * Tk + j0 + c] : 0.f;
            }
            __syncthreads();
            float s[4][4], dp[4][4];
#pragma unroll
            for (int a = 0; a < 4; ++a)
#pragma unroll
                for (int c = 0; c < 4; ++c) s[a][c] = dp[a][c] = 0.f;
            patch_dot2<D>(ks, qs, vs, gs, s, dp);
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int i = i0 + tx + 16 * c;
                const float li = i < S ? lse[qo + i] : 0.f, dl = i < S ? delta[qo + i] : 0.f;
#pragma unroll
                for (int a = 0; a < 4; ++a) {
                    const int j = j0 + ty * 4 + a;
                    const int at = (ty * 4 + a) * (AT + 1) + tx + 16 * c;
                    const float p = visible(i, j, S, Tk) ? __expf(s[a][c] + ps[at] - li) : 0.f;
                    ps[at] = p;  // each thread reads and rewrites only its own entries
                    ds[at] = p * (dp[a][c] - dl);
                }
            }
            __syncthreads();
            for (int r = 0; r < AT; ++r) {
                float qb[DJ], gb[DJ];
#pragma unroll
                for (int c = 0; c < DJ; ++c) {
                    qb[c] = qs[r * P + tx + 16 * c];
                    gb[c] = gs[r * P + tx + 16 * c];
                }
#pragma unroll
                for (int a = 0; a < 4; ++a) {
                    const float p = ps[(ty * 4 + a) * (AT + 1) + r];
                    const float x = ds[(ty * 4 + a) * (AT + 1) + r];
#pragma unroll
                    for (int c = 0; c < DJ; ++c) {
                        av[a][c] += p * gb[c];
                        ak[a][c] += x * qb[c];
                    }
                }
            }
        }
    }
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        const int j = j0 + ty * 4 + a;
        if (j >= Tk) continue;
#pragma unroll
        for (int c = 0; c < DJ; ++c) {
            st(dk, (ko + j) * D + tx + 16 * c, ak[a][c] * scale);
            st(dv, (ko + j) * D + tx + 16 * c, av[a][c]);
        }
    }
}

#define INSTANCES(T, NAME, D)                                                                      \
extern "C" __global__ void __launch_bounds__(ATH) attn_fwd_##NAME##_##D(const T* q, const T* k,   \
        const T* v, const float* mask, T* o, float* lse, int H, int Hkv, int S, int Tk,            \
        float scale) {                                                                             \
    attn_fwd<T, D>(q, k, v, mask, o, lse, H, Hkv, S, Tk, scale);                                   \
}                                                                                                  \
extern "C" __global__ void __launch_bounds__(ATH) attn_bwd_dq_##NAME##_##D(const T* q,            \
        const T* k, const T* v, const float* mask, const T* o, const T* dout, const float* lse,    \
        float* delta, T* dq, int H, int Hkv, int S, int Tk, float scale) {                         \
    attn_bwd_dq<T, D>(q, k, v, mask, o, dout, lse, delta, dq, H, Hkv, S, Tk, scale);               \
}                                                                                                  \
extern "C" __global__ void __launch_bounds__(ATH) attn_bwd_dkv_##NAME##_##D(const T* q,           \
        const T* k, const T* v, const float* mask, const T* dout, const float* lse,                \
        const float* delta, T* dk, T* dv, int H, int Hkv, int S, int Tk, float scale) {            \
    attn_bwd_dkv<T, D>(q, k, v, mask, dout, lse, delta, dk, dv, H, Hkv, S, Tk, scale);             \
}

INSTANCES(float, f32, 16)
INSTANCES(bf16_t, bf16, 16)
INSTANCES(float, f32, 32)
INSTANCES(bf16_t, bf16, 32)
INSTANCES(float, f32, 64)
INSTANCES(bf16_t, bf16, 64)
INSTANCES(float, f32, 128)
INSTANCES(bf16_t, bf16, 128)

// SwiGLU forward, one thread per output element.
template <typename T>
__device__ void swiglu_fwd(const T* gu, T* out, long n, int inter) {
    const long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n) return;
    const long r = idx / inter, c = idx % inter;
    const float g = ld(gu, r * 2 * inter + c), u = ld(gu, r * 2 * inter + inter + c);
    const float s = 1.f / (1.f + __expf(-g));
    st(out, idx, g * s * u);
}

// SwiGLU backward: d gate = dout * up * silu'(gate), d up = dout * silu(gate).
template <typename T>
__device__ void swiglu_bwd(const T* gu, const T* dout, T* dgu, long n, int inter) {
    const long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n) return;
    const long r = idx / inter, c = idx % inter;
    const float g = ld(gu, r * 2 * inter + c), u = ld(gu, r * 2 * inter + inter + c);
    const float s = 1.f / (1.f + __expf(-g)), d = ld(dout, idx);
    st(dgu, r * 2 * inter + c, d * u * s * (1.f + g * (1.f - s)));
    st(dgu, r * 2 * inter + inter + c, d * g * s);
}

#define SWIGLU(T, NAME)                                                                            \
extern "C" __global__ void swiglu_fwd_##NAME(const T* gu, T* out, long n, int inter) {             \
    swiglu_fwd<T>(gu, out, n, inter);                                                              \
}                                                                                                  \
extern "C" __global__ void swiglu_bwd_##NAME(const T* gu, const T* dout, T* dgu, long n,           \
                                             int inter) {                                          \
    swiglu_bwd<T>(gu, dout, dgu, n, inter);                                                        \
}

SWIGLU(float, f32)
SWIGLU(bf16_t, bf16)

// RMSNorm over rows of x [N, H] with weight w [H] (HF's: the normalized row rounded to x's dtype,
// then times w), a block of NT threads per row. Forward: y = round(x r) w, r = 1/sqrt(mean(x^2) + eps).
// Backward (n = x r in f32): dx = r (g w - n mean(g w n)); gn = g round(n) per element (f32), whose
// column sums are dw.
#define NORM_THREADS 256

__device__ float block_sum(float v, float* red) {
    red[threadIdx.x] = v;
    __syncthreads();
    for (int s = NORM_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
        __syncthreads();
    }
    const float total = red[0];
    __syncthreads();
    return total;
}

template <typename T>
__device__ float row_rsqrt(const T* xr, int h, float eps, float* red) {
    float ss = 0.f;
    for (int i = threadIdx.x; i < h; i += NORM_THREADS) {
        const float v = ld(xr, i);
        ss += v * v;
    }
    return 1.f / sqrtf(block_sum(ss, red) / h + eps);
}

template <typename T>
__device__ void rms_norm_fwd(const T* x, const T* w, T* y, int h, float eps) {
    extern __shared__ float sm[];  // NORM_THREADS floats
    const long row = blockIdx.x;
    const T* xr = x + row * h;
    const float r = row_rsqrt(xr, h, eps, sm);
    T nb[1];
    for (int i = threadIdx.x; i < h; i += NORM_THREADS) {
        st(nb, 0, ld(xr, i) * r);  // rounded to T, as HF does before the weight
        st(y, row * h + i, ld(nb, 0) * ld(w, i));
    }
}

template <typename T>
__device__ void rms_norm_bwd(const T* x, const T* w, const T* g, T* dx, float* gn, int h,
                             float eps) {
    extern __shared__ float sm[];  // NORM_THREADS floats
    const long row = blockIdx.x;
    const T* xr = x + row * h;
    const T* gr = g + row * h;
    const float r = row_rsqrt(xr, h, eps, sm);
    T tb[1];
    float acc = 0.f;
    for (int i = threadIdx.x; i < h; i += NORM_THREADS) {
        const float n = ld(xr, i) * r;
        st(tb, 0, ld(gr, i) * ld(w, i));  // g w in T, as candle's op computes it
        acc += ld(tb, 0) * n;
        st(tb, 0, n);
        gn[row * h + i] = ld(gr, i) * ld(tb, 0);
    }
    const float proj = block_sum(acc, sm) / h;
    for (int i = threadIdx.x; i < h; i += NORM_THREADS) {
        const float n = ld(xr, i) * r;
        st(tb, 0, ld(gr, i) * ld(w, i));
        st(dx, row * h + i, (ld(tb, 0) - n * proj) * r);
    }
}

#define RMS_NORM(T, NAME)                                                                          \
extern "C" __global__ void rms_norm_fwd_##NAME(const T* x, const T* w, T* y, int h, float eps) {  \
    rms_norm_fwd<T>(x, w, y, h, eps);                                                              \
}                                                                                                  \
extern "C" __global__ void rms_norm_bwd_##NAME(const T* x, const T* w, const T* g, T* dx,         \
                                               float* gn, int h, float eps) {                      \
    rms_norm_bwd<T>(x, w, g, dx, gn, h, eps);                                                      \
}

RMS_NORM(float, f32)
RMS_NORM(bf16_t, bf16)

// RoPE, rotate-half (HF's): x [B, T, H*D] with rows `xs` elements apart (a view of the joined
// q/k/v projection), cos/sin [B, T, D/2] -> y [B, H, T, D]: y1 = x1 cos - x2 sin,
// y2 = x2 cos + x1 sin. Backward: dy [B, H, T, D] -> dx [B, T, H*D] (contiguous):
// dx1 = dy1 cos + dy2 sin, dx2 = dy2 cos - dy1 sin. One thread per (b, h, t, pair), n of them.
template <typename T>
__device__ void rope(const T* x, const T* cos, const T* sin, T* y, long n, int t, int h, int d,
                     long xs, bool back) {
    const long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n) return;
    const int half = d / 2, c = (int)(idx % half);
    long r = idx / half;
    const int ti = (int)(r % t);
    r /= t;
    const int hi = (int)(r % h);
    const long bi = r / h, bt = bi * t + ti;
    const float co = ld(cos, bt * half + c), si = ld(sin, bt * half + c);
    const long heads = ((bi * h + hi) * t + ti) * d, rows = bt * xs + (long)hi * d;
    if (!back) {
        const float x1 = ld(x, rows + c), x2 = ld(x, rows + half + c);
        st(y, heads + c, x1 * co - x2 * si);
        st(y, heads + half + c, x2 * co + x1 * si);
    } else {
        const float g1 = ld(x, heads + c), g2 = ld(x, heads + half + c);
        st(y, rows + c, g1 * co + g2 * si);
        st(y, rows + half + c, g2 * co - g1 * si);
    }
}

#define ROPE(T, NAME)                                                                              \
extern "C" __global__ void rope_fwd_##NAME(const T* x, const T* cos, const T* sin, T* y, long n,  \
                                           int t, int h, int d, long xs) {                         \
    rope<T>(x, cos, sin, y, n, t, h, d, xs, false);                                                \
}                                                                                                  \
extern "C" __global__ void rope_bwd_##NAME(const T* dy, const T* cos, const T* sin, T* dx, long n, \
                                           int t, int h, int d) {                                  \
    rope<T>(dy, cos, sin, dx, n, t, h, d, (long)h * d, true);                                      \
}

ROPE(float, f32)
ROPE(bf16_t, bf16)

// The LM head's log-softmax, a block of NORM_THREADS per row of logits [c, V] (the head's
// product): z = logits * inv_t in f32, lse = log sum exp z, lp = z[y] - lse and the entropy
// lse - sum softmax(z) z. out [c, 2] (lp, entropy), lse [c]. Backward, from the row's gradients
// g [c, 2] (of lp and of the entropy, used where `with_entropy`): dz = (g_lp (onehot(y) - p)
// - g_ent p (z - sum p z)) * inv_t, in the logits' dtype.
__device__ float block_max(float v, float* red) {
    red[threadIdx.x] = v;
    __syncthreads();
    for (int s = NORM_THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + s]);
        __syncthreads();
    }
    const float total = red[0];
    __syncthreads();
    return total;
}

template <typename T>
__device__ void head_fwd(const T* logits, const unsigned int* y, float* out, float* lse, int v,
                         float inv_t) {
    extern __shared__ float sm[];  // NORM_THREADS floats
    const long row = blockIdx.x;
    const T* z = logits + row * v;
    float m = NEG_INF;
    for (int i = threadIdx.x; i < v; i += NORM_THREADS) m = fmaxf(m, ld(z, i) * inv_t);
    const float mx = block_max(m, sm);
    float s = 0.f, sz = 0.f;
    for (int i = threadIdx.x; i < v; i += NORM_THREADS) {
        const float x = ld(z, i) * inv_t - mx, e = expf(x);
        s += e;
        sz += e * x;
    }
    const float total = block_sum(s, sm), weighted = block_sum(sz, sm);
    if (threadIdx.x == 0) {
        const float l = logf(total);  // lse - mx
        lse[row] = mx + l;
        out[row * 2] = ld(z, (long)y[row]) * inv_t - mx - l;
        out[row * 2 + 1] = l - weighted / total;
    }
}

template <typename T>
__device__ void head_bwd(const T* logits, const unsigned int* y, const float* lse, const float* g,
                         const float* out, T* dz, int v, float inv_t, int with_entropy) {
    const long row = blockIdx.x;
    const T* z = logits + row * v;
    const float l = lse[row], glp = g[row * 2];
    const float gent = with_entropy ? g[row * 2 + 1] : 0.f;
    const float mean = l - out[row * 2 + 1];  // sum p z
    const int yt = (int)y[row];
    for (int i = threadIdx.x; i < v; i += NORM_THREADS) {
        const float x = ld(z, i) * inv_t, p = expf(x - l);
        float d = -p * glp;
        if (i == yt) d += glp;
        if (with_entropy) d -= gent * p * (x - mean);
        st(dz, row * (long)v + i, d * inv_t);
    }
}

#define HEAD(T, NAME)                                                                              \
extern "C" __global__ void head_fwd_##NAME(const T* logits, const unsigned int* y, float* out,    \
                                           float* lse, int v, float inv_t) {                       \
    head_fwd<T>(logits, y, out, lse, v, inv_t);                                                    \
}                                                                                                  \
extern "C" __global__ void head_bwd_##NAME(const T* logits, const unsigned int* y,                \
        const float* lse, const float* g, const float* out, T* dz, int v, float inv_t,             \
        int with_entropy) {                                                                        \
    head_bwd<T>(logits, y, lse, g, out, dz, v, inv_t, with_entropy);                               \
}

HEAD(float, f32)
HEAD(bf16_t, bf16)

// 16 bytes (aligned) at p as 16 / sizeof(T) f32 values: one vector load per call (`unpack16`
// converts words already loaded).
__device__ __forceinline__ void unpack16(const float*, const uint4 u, float* x) {
    x[0] = __uint_as_float(u.x); x[1] = __uint_as_float(u.y);
    x[2] = __uint_as_float(u.z); x[3] = __uint_as_float(u.w);
}
__device__ __forceinline__ void unpack16(const bf16_t*, const uint4 u, float* x) {
    const unsigned int w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        x[2 * i] = __uint_as_float(w[i] << 16);
        x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}
template <typename T>
__device__ __forceinline__ void ld16(const T* p, float* x) {
    unpack16(p, *(const uint4*)p, x);
}

// Decoding attention, one query per row: a block of NORM_THREADS per (b, kv head) serves the
// g = H / Hkv query heads that read it, so each key and value row comes from memory once, in
// 16-byte loads. q [B, H, D] contiguous; the key and value of slot j of (b, kv head hk) at
// b*sb + hk*sh + j*D (views of the KV cache, rows 16-byte aligned); mask [B, Tk] f32 additive;
// o [B, H, D]. A shared prompt: with `leader` ([B] u32, or null), slots j < `shared` of row b are
// read from row leader[b] (the rows of one prompt hold the same keys and values there, so a
// group's rows read one copy between them, from L2). Scores: a thread per key slot holds its key row in registers and scores it for
// each head, into shared memory [g][Tk]; softmax per head; values, head by head: a thread per
// (slot group r, 16-byte column c), R slot groups (a kv head's values stay in L1 between its
// heads), summed over the groups through shared memory [R][D]. Registers do not grow with g.
// Where slot j of row b, kv head hk, starts in a cache view (see attn_decode's shared prompt).
__device__ __forceinline__ long slot_at(const unsigned int* leader, int shared, int b, int hk,
                                        int j, long sb, long sh, int D) {
    const long row = (leader && j < shared) ? (long)leader[b] : (long)b;
    return row * sb + (long)hk * sh + (long)j * D;
}

template <typename T, int D>
__device__ void attn_decode(const T* q, const T* k, const T* v, const float* mask, T* o, int H,
                            int Hkv, int Tk, long sb, long sh, float scale,
                            const unsigned int* leader, int shared) {
    constexpr int N = 16 / sizeof(T);  // elements per 16-byte load
    constexpr int C = D / N;           // loads per row
    constexpr int R = NORM_THREADS / C;
    extern __shared__ float sm[];
    const int g = H / Hkv;
    const int b = blockIdx.x / Hkv, hk = blockIdx.x % Hkv;
    float* qs = sm;                   // [g][D]
    float* sc = qs + g * D;           // [g][Tk]
    float* red = sc + g * Tk;         // [NORM_THREADS]
    float* part = red + NORM_THREADS; // [R][D]
    float* tot = part + R * D;        // [g]
    const long q0 = ((long)b * H + (long)hk * g) * D;  // this block's g query rows
    for (int i = threadIdx.x; i < g * D; i += NORM_THREADS) qs[i] = ld(q, q0 + i) * scale;
    __syncthreads();
    for (int j = threadIdx.x; j < Tk; j += NORM_THREADS) {
        uint4 kr[C];
        const long at = slot_at(leader, shared, b, hk, j, sb, sh, D);
#pragma unroll
        for (int c = 0; c < C; ++c) kr[c] = *(const uint4*)(k + at + c * N);
        const float mj = mask[(long)b * Tk + j];
        for (int i = 0; i < g; ++i) {
            float z = 0.f;
#pragma unroll
            for (int c = 0; c < C; ++c) {
                float x[N];
                unpack16(k, kr[c], x);
#pragma unroll
                for (int e = 0; e < N; ++e) z += qs[i * D + c * N + e] * x[e];
            }
            sc[i * Tk + j] = z + mj;
        }
    }
    __syncthreads();
    // Softmax per head: sc becomes exp(z - max), tot[i] its sum.
    for (int i = 0; i < g; ++i) {
        float m = NEG_INF;
        for (int j = threadIdx.x; j < Tk; j += NORM_THREADS) m = fmaxf(m, sc[i * Tk + j]);
        const float mx = block_max(m, red);
        float s = 0.f;
        for (int j = threadIdx.x; j < Tk; j += NORM_THREADS) {
            const float e = expf(sc[i * Tk + j] - mx);
            sc[i * Tk + j] = e;  // each thread rewrites only its own slots
            s += e;
        }
        const float t = block_sum(s, red);  // its barriers make every sc[i][j] visible
        if (threadIdx.x == 0) tot[i] = t;
    }
    __syncthreads();
    const int r = threadIdx.x / C, c = threadIdx.x % C;
    for (int i = 0; i < g; ++i) {
        float acc[N];
#pragma unroll
        for (int e = 0; e < N; ++e) acc[e] = 0.f;
#pragma unroll 4
        for (int j = r; j < Tk; j += R) {
            float x[N];
            ld16(v + slot_at(leader, shared, b, hk, j, sb, sh, D) + c * N, x);
            const float p = sc[i * Tk + j];
#pragma unroll
            for (int e = 0; e < N; ++e) acc[e] += p * x[e];
        }
#pragma unroll
        for (int e = 0; e < N; ++e) part[r * D + c * N + e] = acc[e];
        __syncthreads();
        for (int d = threadIdx.x; d < D; d += NORM_THREADS) {
            float s = 0.f;
            for (int rr = 0; rr < R; ++rr) s += part[rr * D + d];
            st(o, q0 + (long)i * D + d, tot[i] > 0.f ? s / tot[i] : 0.f);
        }
        __syncthreads();
    }
}

// v of lane (this lane ^ m), within the warp (every lane takes part).
__device__ __forceinline__ float lane_xor(float v, int m) {
#ifdef __CUDA_ARCH__
    float r;
    asm volatile("shfl.sync.bfly.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=f"(r) : "f"(v), "r"(m));
    return r;
#else
    return emu_lane_xor(v, m);
#endif
}

// Decoding attention, one query per row, a warp per (row, query head): 4 warps a block, the
// consecutive query heads of a kv head in consecutive warps (their reads of its rows meet in
// L1). No shared memory, no block barrier, one pass over the cache: the warp's lanes form
// G = 32 / L groups of L = D / N lanes (N elements: 16 bytes), group r takes slots r, r + G, ...,
// lane c of a group 16 bytes of each key and value row (a warp reads G whole rows, contiguous,
// per load); a score is the group's dot (shuffles), each group keeps an online softmax (max,
// sum, N accumulators a lane) over U slots at a time, and the groups merge at the end.
// Same arguments (a shared prompt too) and result as attn_decode.
template <typename T, int D>
__device__ void attn_decode_warp(const T* q, const T* k, const T* v, const float* mask, T* o,
                                 int H, int Hkv, int B, int Tk, long sb, long sh, float scale,
                                 const unsigned int* leader, int shared) {
    constexpr int N = 16 / sizeof(T), L = D / N, G = 32 / L, U = 4;
    const int lane = threadIdx.x % 32, r = lane / L, c = lane % L;
    const int pair = blockIdx.x * 4 + threadIdx.x / 32;  // (row, query head)
    if (pair >= B * H) return;  // a whole warp: no shuffle waits on it
    const int b = pair / H, h = pair % H, hk = h / (H / Hkv);
    float qr[N], acc[N];
    ld16(q + (long)pair * D + c * N, qr);
#pragma unroll
    for (int e = 0; e < N; ++e) {
        qr[e] *= scale;
        acc[e] = 0.f;
    }
    const float* mrow = mask + (long)b * Tk;
    float m = NEG_INF, l = 0.f;
    for (int i0 = 0; i0 < Tk; i0 += U * G) {  // the same trips for every lane (shuffles)
        const int j0 = i0 + r;
        uint4 kr[U], vr[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int j = j0 + u * G;
            kr[u] = vr[u] = uint4{0u, 0u, 0u, 0u};
            if (j < Tk) {
                const long at = slot_at(leader, shared, b, hk, j, sb, sh, D) + c * N;
                kr[u] = *(const uint4*)(k + at);
                vr[u] = *(const uint4*)(v + at);
            }
        }
        float z[U], mx = m;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float x[N], d = 0.f;
            unpack16(k, kr[u], x);
#pragma unroll
            for (int e = 0; e < N; ++e) d += qr[e] * x[e];
#pragma unroll
            for (int s = L / 2; s > 0; s /= 2) d += lane_xor(d, s);
            const int j = j0 + u * G;
            z[u] = j < Tk ? d + mrow[j] : NEG_INF;
            mx = fmaxf(mx, z[u]);
        }
        if (mx == NEG_INF) continue;  // the group's slots here are all beyond Tk
        const float a = __expf(m - mx);  // 0 while m is -inf
        l *= a;
#pragma unroll
        for (int e = 0; e < N; ++e) acc[e] *= a;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const float p = z[u] == NEG_INF ? 0.f : __expf(z[u] - mx);
            float x[N];
            unpack16(v, vr[u], x);
            l += p;
#pragma unroll
            for (int e = 0; e < N; ++e) acc[e] += p * x[e];
        }
        m = mx;
    }
    // Merge the groups (lanes c of groups r and r ^ s/L, s = L, 2L, ..).
#pragma unroll
    for (int s = L; s < 32; s *= 2) {
        const float mo = lane_xor(m, s), lo = lane_xor(l, s);
        const float mn = fmaxf(m, mo);
        const float a = mn == NEG_INF ? 0.f : __expf(m - mn);
        const float bo = mn == NEG_INF ? 0.f : __expf(mo - mn);
        l = l * a + lo * bo;
#pragma unroll
        for (int e = 0; e < N; ++e) acc[e] = acc[e] * a + lane_xor(acc[e], s) * bo;
        m = mn;
    }
    if (r == 0) {
        const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
        for (int e = 0; e < N; ++e) st(o, (long)pair * D + c * N + e, acc[e] * inv);
    }
}

#define DECODE(T, NAME, D)                                                                         \
extern "C" __global__ void attn_decode_##NAME##_##D(const T* q, const T* k, const T* v,           \
        const float* mask, const unsigned int* leader, T* o, int H, int Hkv, int Tk, long sb,      \
        long sh, float scale, int shared) {                                                        \
    attn_decode<T, D>(q, k, v, mask, o, H, Hkv, Tk, sb, sh, scale, leader, shared);                \
}                                                                                                  \
extern "C" __global__ void __launch_bounds__(128) attn_decode_warp_##NAME##_##D(const T* q,       \
        const T* k, const T* v, const float* mask, const unsigned int* leader, T* o, int H,        \
        int Hkv, int B, int Tk, long sb, long sh, float scale, int shared) {                       \
    attn_decode_warp<T, D>(q, k, v, mask, o, H, Hkv, B, Tk, sb, sh, scale, leader, shared);        \
}

DECODE(float, f32, 16)
DECODE(bf16_t, bf16, 16)
DECODE(float, f32, 32)
DECODE(bf16_t, bf16, 32)
DECODE(float, f32, 64)
DECODE(bf16_t, bf16, 64)
DECODE(float, f32, 128)
DECODE(bf16_t, bf16, 128)

// acc[i] += x[i] over n elements: a bf16 weight gradient added into its f32 accumulator (the
// gradient sink's alternative to a GEMM with f32 output), one thread per element.
extern "C" __global__ void acc_add_bf16(float* acc, const bf16_t* x, long n) {
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) acc[i] += ld(x, i);
}

// AdamW in place over f32 p, g, m, v of n elements, the formula of optim.rs's FusedStep::apply
// (torch's single-tensor path): g' = g gs; p *= decay; m += (g' - m)(1 - b1);
// v = v b2 + (1 - b2) g' g'; p -= step_size m / (sqrt(v) / bc2 + eps).
extern "C" __global__ void adamw_f32(float* p, const float* g, float* m, float* v, long n, float gs,
                                     float decay, float b1, float b2, float eps, float bc2,
                                     float step_size) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n;
         i += (long)gridDim.x * blockDim.x) {
        const float gi = g[i] * gs;
        const float mi = m[i] + (gi - m[i]) * (1.f - b1);
        const float vi = v[i] * b2 + (1.f - b2) * gi * gi;
        const float denom = sqrtf(vi) / bc2 + eps;
        p[i] = p[i] * decay - step_size * mi / denom;
        m[i] = mi;
        v[i] = vi;
    }
}

// A decoding step's q/k/v from the joined projection x [B, 1, (H + 2 Hkv) D] (rows xs elements
// apart), cos/sin [B, 1, D/2]: q rotated into q [B, H, 1, D]; k rotated and v copied into slot
// `slot` of the caches kc/vc [B, Hkv, slots, D] (contiguous, cs = slots * D elements per kv
// head), in place. RoPE as `rope` computes it. One thread per (b, head of H + 2 Hkv, pair).
template <typename T>
__device__ void rope_append(const T* x, const T* cos, const T* sin, T* q, T* kc, T* vc, long n,
                            int h, int hkv, int d, long xs, long cs, int slot) {
    const long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n) return;
    const int half = d / 2, c = (int)(idx % half), heads = h + 2 * hkv;
    const long r = idx / half;
    const int j = (int)(r % heads);
    const long b = r / heads;
    const long src = b * xs + (long)j * d;
    const float x1 = ld(x, src + c), x2 = ld(x, src + half + c);
    if (j >= h + hkv) {  // v: copied
        const long dst = (b * hkv + (j - h - hkv)) * cs + (long)slot * d;
        st(vc, dst + c, x1);
        st(vc, dst + half + c, x2);
        return;
    }
    const float co = ld(cos, b * half + c), si = ld(sin, b * half + c);
    T* out = j < h ? q : kc;
    const long dst = j < h ? (b * h + j) * (long)d : (b * hkv + (j - h)) * cs + (long)slot * d;
    st(out, dst + c, x1 * co - x2 * si);
    st(out, dst + half + c, x2 * co + x1 * si);
}

// The residual add and the next RMSNorm of a decoding step, per row of x, a [N, H]:
// s = x + a (rounded to T, as candle's add), y = RMSNorm(s) w as rms_norm_fwd computes it.
template <typename T>
__device__ void add_rms_norm(const T* x, const T* a, const T* w, T* s, T* y, int h, float eps) {
    extern __shared__ float sm[];  // NORM_THREADS floats
    const long row = blockIdx.x;
    float ss = 0.f;
    for (int i = threadIdx.x; i < h; i += NORM_THREADS) {
        st(s, row * h + i, ld(x, row * h + i) + ld(a, row * h + i));
        const float v = ld(s, row * h + i);
        ss += v * v;
    }
    const float r = 1.f / sqrtf(block_sum(ss, sm) / h + eps);
    T nb[1];
    for (int i = threadIdx.x; i < h; i += NORM_THREADS) {
        st(nb, 0, ld(s, row * h + i) * r);
        st(y, row * h + i, ld(nb, 0) * ld(w, i));
    }
}

#define DECODE_STEP(T, NAME)                                                                       \
extern "C" __global__ void rope_append_##NAME(const T* x, const T* cos, const T* sin, T* q, T* kc, \
        T* vc, long n, int h, int hkv, int d, long xs, long cs, int slot) {                        \
    rope_append<T>(x, cos, sin, q, kc, vc, n, h, hkv, d, xs, cs, slot);                            \
}                                                                                                  \
extern "C" __global__ void add_rms_norm_##NAME(const T* x, const T* a, const T* w, T* s, T* y,    \
                                               int h, float eps) {                                 \
    add_rms_norm<T>(x, a, w, s, y, h, eps);                                                        \
}

DECODE_STEP(float, f32)
DECODE_STEP(bf16_t, bf16)

// Sums of squares of x [n] f32 (a gradient, for the clipping norm): block i of a fixed grid of
// NORM_THREADS-thread blocks writes its partial sum to out[i] (every block writes, so `out` needs
// no fill). The caller adds the partials in a fixed order: the norm does not depend on timing.
extern "C" __global__ void sumsq_f32(const float* x, float* out, long n) {
    extern __shared__ float sm[];  // NORM_THREADS floats
    float s = 0.f;
    for (long i = (long)blockIdx.x * NORM_THREADS + threadIdx.x; i < n;
         i += (long)gridDim.x * NORM_THREADS) {
        const float v = x[i];
        s += v * v;
    }
    const float t = block_sum(s, sm);
    if (threadIdx.x == 0) out[blockIdx.x] = t;
}

// NF4 dequantization (QLoRA's frozen base, bitsandbytes' layout): packed [ceil(n / 2)] bytes, two
// codes a byte (the first value in the high nibble), absmax [ceil(n / 64)] f32 (one per block of
// 64 values), code [16] f32 (the NF4 values) -> out [n], value e = code[nibble] * absmax[e / 64]
// rounded once to T. One thread per byte.
template <typename T>
__device__ void nf4_dequant(const unsigned char* packed, const float* absmax, const float* code,
                            T* out, long n) {
    const long j = (long)blockIdx.x * blockDim.x + threadIdx.x, e = 2 * j;
    if (e >= n) return;
    const unsigned int b = packed[j];
    const float m = absmax[e / 64];
    st(out, e, code[b >> 4] * m);
    if (e + 1 < n) st(out, e + 1, code[b & 15u] * m);
}

#define NF4(T, NAME)                                                                               \
extern "C" __global__ void nf4_dequant_##NAME(const unsigned char* packed, const float* absmax,    \
                                              const float* code, T* out, long n) {                 \
    nf4_dequant<T>(packed, absmax, code, out, n);                                                  \
}

NF4(float, f32)
NF4(bf16_t, bf16)
