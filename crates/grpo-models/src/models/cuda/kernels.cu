// grpo's GPU kernels, compiled at run time by NVRTC (no headers): f32 arithmetic over bf16 or f32
// tensors. The Rust twin of each kernel is in `fused_gpu.rs`, where they are launched.
//
// Attention: FlashAttention's plan (scores never stored, one log-sum-exp per query kept for the
// backward) written plainly, one thread per query (forward, dQ) or per key (dK, dV).
// q [B, H, S, D], k/v [B, Hkv, Tk, D], o/dO [B, H, S, D], mask [B, S, Tk] f32 additive,
// lse/delta [B, H, S] f32. Query i reads key slots 0 ..= Tk - S + i (causal), the mask adds on top.
//
// SwiGLU: gu [N, 2I] (gate, then up, per row) -> silu(gate) * up [N, I], and its backward.

typedef unsigned short bf16_t;

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }

__device__ __forceinline__ float ld(const float* p, long i) { return p[i]; }
__device__ __forceinline__ float ld(const bf16_t* p, long i) {
    return __uint_as_float(((unsigned int)p[i]) << 16);
}
__device__ __forceinline__ void st(float* p, long i, float x) { p[i] = x; }
__device__ __forceinline__ void st(bf16_t* p, long i, float x) {
    unsigned int u = __float_as_uint(x);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) {
        p[i] = (bf16_t)((u >> 16) | 0x40u);  // NaN stays NaN
        return;
    }
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    p[i] = (bf16_t)(u >> 16);
}

// Forward: o and lse. Block: QT queries of one (b, h); q rows in shared memory (stride D + 1).
template <typename T, int D>
__device__ void attn_fwd(const T* q, const T* k, const T* v, const float* mask, T* o, float* lse,
                         int H, int Hkv, int S, int Tk, float scale) {
    extern __shared__ float sm[];
    const int bh = blockIdx.y, b = bh / H, h = bh % H, hk = h / (H / Hkv);
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    float* qs = sm + threadIdx.x * (D + 1);
    const long qo = ((long)bh * S + i) * D;
    if (i < S) {
#pragma unroll
        for (int d = 0; d < D; ++d) qs[d] = ld(q, qo + d) * scale;
    }
    if (i >= S) return;
    const long ko = ((long)b * Hkv + hk) * Tk * D;
    const float* mrow = mask + ((long)b * S + i) * Tk;
    const int end = imin(Tk, Tk - S + i + 1);
    float m = __int_as_float(0xff800000), l = 0.f, acc[D];
#pragma unroll
    for (int d = 0; d < D; ++d) acc[d] = 0.f;
    for (int j = 0; j < end; ++j) {
        const long kj = ko + (long)j * D;
        float z = 0.f;
#pragma unroll
        for (int d = 0; d < D; ++d) z += qs[d] * ld(k, kj + d);
        z += mrow[j];
        const float mn = fmaxf(m, z);
        const float c = __expf(m - mn), p = __expf(z - mn);
        l = l * c + p;
#pragma unroll
        for (int d = 0; d < D; ++d) acc[d] = acc[d] * c + p * ld(v, kj + d);
        m = mn;
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
    for (int d = 0; d < D; ++d) st(o, qo + d, acc[d] * inv);
    lse[(long)bh * S + i] = m + logf(l);
}

// Backward, per query: delta = rowsum(dO * O), dQ = scale * sum_j P (dO.v_j - delta) k_j.
template <typename T, int D>
__device__ void attn_bwd_dq(const T* q, const T* k, const T* v, const float* mask, const T* o,
                            const T* dout, const float* lse, float* delta, T* dq, int H, int Hkv,
                            int S, int Tk, float scale) {
    extern __shared__ float sm[];
    const int bh = blockIdx.y, b = bh / H, h = bh % H, hk = h / (H / Hkv);
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    float* qs = sm + threadIdx.x * (2 * D + 1);
    float* gs = qs + D;
    const long qo = ((long)bh * S + i) * D;
    if (i >= S) return;
    float dl = 0.f;
#pragma unroll
    for (int d = 0; d < D; ++d) {
        qs[d] = ld(q, qo + d) * scale;
        gs[d] = ld(dout, qo + d);
        dl += gs[d] * ld(o, qo + d);
    }
    delta[(long)bh * S + i] = dl;
    const float li = lse[(long)bh * S + i];
    const long ko = ((long)b * Hkv + hk) * Tk * D;
    const float* mrow = mask + ((long)b * S + i) * Tk;
    const int end = imin(Tk, Tk - S + i + 1);
    float acc[D];
#pragma unroll
    for (int d = 0; d < D; ++d) acc[d] = 0.f;
    for (int j = 0; j < end; ++j) {
        const long kj = ko + (long)j * D;
        float z = 0.f, dp = 0.f;
#pragma unroll
        for (int d = 0; d < D; ++d) {
            z += qs[d] * ld(k, kj + d);
            dp += gs[d] * ld(v, kj + d);
        }
        const float p = __expf(z + mrow[j] - li);
        const float ds = p * (dp - dl);
#pragma unroll
        for (int d = 0; d < D; ++d) acc[d] += ds * ld(k, kj + d);
    }
#pragma unroll
    for (int d = 0; d < D; ++d) st(dq, qo + d, acc[d] * scale);
}

// Backward, per key of one (b, kv head): over the g query heads that read it and the queries
// that reach it, dV_j = sum P dO_i (DK false) or dK_j = scale * sum P (dO_i.v_j - delta_i) q_i
// (DK true): two launches, so that a thread accumulates D numbers, not 2D.
template <typename T, int D, bool DK>
__device__ void attn_bwd_kv(const T* q, const T* k, const T* v, const float* mask, const T* dout,
                            const float* lse, const float* delta, T* dkv, int H, int Hkv, int S,
                            int Tk, float scale) {
    extern __shared__ float sm[];
    const int bk = blockIdx.y, b = bk / Hkv, hk = bk % Hkv, g = H / Hkv;
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    float* ks = sm + threadIdx.x * (2 * D + 1);
    float* vs = ks + D;
    const long kj = ((long)bk * Tk + j) * D;
    if (j >= Tk) return;
#pragma unroll
    for (int d = 0; d < D; ++d) {
        ks[d] = ld(k, kj + d) * scale;
        vs[d] = DK ? ld(v, kj + d) : 0.f;
    }
    float acc[D];
#pragma unroll
    for (int d = 0; d < D; ++d) acc[d] = 0.f;
    const int start = imax(0, j - (Tk - S));
    for (int hh = hk * g; hh < (hk + 1) * g; ++hh) {
        const long ho = ((long)b * H + hh) * S;
        for (int i = start; i < S; ++i) {
            const long qi = (ho + i) * D;
            float z = 0.f, dp = 0.f;
#pragma unroll
            for (int d = 0; d < D; ++d) {
                z += ks[d] * ld(q, qi + d);
                if (DK) dp += vs[d] * ld(dout, qi + d);
            }
            const float p = __expf(z + mask[((long)b * S + i) * Tk + j] - lse[ho + i]);
            if (DK) {
                const float ds = p * (dp - delta[ho + i]);
#pragma unroll
                for (int d = 0; d < D; ++d) acc[d] += ds * ld(q, qi + d);
            } else {
#pragma unroll
                for (int d = 0; d < D; ++d) acc[d] += p * ld(dout, qi + d);
            }
        }
    }
#pragma unroll
    for (int d = 0; d < D; ++d) st(dkv, kj + d, DK ? acc[d] * scale : acc[d]);
}

#define INSTANCES(T, NAME, D)                                                                      \
extern "C" __global__ void attn_fwd_##NAME##_##D(const T* q, const T* k, const T* v,               \
        const float* mask, T* o, float* lse, int H, int Hkv, int S, int Tk, float scale) {         \
    attn_fwd<T, D>(q, k, v, mask, o, lse, H, Hkv, S, Tk, scale);                                   \
}                                                                                                  \
extern "C" __global__ void attn_bwd_dq_##NAME##_##D(const T* q, const T* k, const T* v,            \
        const float* mask, const T* o, const T* dout, const float* lse, float* delta, T* dq,       \
        int H, int Hkv, int S, int Tk, float scale) {                                              \
    attn_bwd_dq<T, D>(q, k, v, mask, o, dout, lse, delta, dq, H, Hkv, S, Tk, scale);               \
}                                                                                                  \
extern "C" __global__ void attn_bwd_dk_##NAME##_##D(const T* q, const T* k, const T* v,            \
        const float* mask, const T* dout, const float* lse, const float* delta, T* dk,             \
        int H, int Hkv, int S, int Tk, float scale) {                                              \
    attn_bwd_kv<T, D, true>(q, k, v, mask, dout, lse, delta, dk, H, Hkv, S, Tk, scale);            \
}                                                                                                  \
extern "C" __global__ void attn_bwd_dv_##NAME##_##D(const T* q, const T* k, const T* v,            \
        const float* mask, const T* dout, const float* lse, const float* delta, T* dv,             \
        int H, int Hkv, int S, int Tk, float scale) {                                              \
    attn_bwd_kv<T, D, false>(q, k, v, mask, dout, lse, delta, dv, H, Hkv, S, Tk, scale);           \
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
