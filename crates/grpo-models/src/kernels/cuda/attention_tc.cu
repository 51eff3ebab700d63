// Attention on tensor cores: kernels.cu's three attention kernels (forward, dQ, dK/dV) for bf16,
// with the same arguments, layouts and results, whose products run as mma.sync.m16n8k16 (bf16
// in, f32 sums; sm_80 and later). NVRTC compiles this file after kernels.cu (whose helpers it
// uses) into a module of its own for compute_80, so that a card without bf16 tensor cores still
// loads kernels.cu's module.
//
// A block of 4 warps holds 64 queries (forward, dQ) or 64 keys (dK/dV), 16 rows per warp, and
// walks the other side in tiles of 64 through shared memory, bf16, row-major (a product that
// needs a tile transposed reads its fragments with ldmatrix .trans). A warp keeps its own rows'
// operands as A fragments in registers, and its scores, probabilities and outputs as C
// fragments: a row's softmax statistics are reduced over the 4 lanes that hold it. Scores and
// probabilities are f32; the probabilities (and dS) are rounded to bf16 to enter the next
// product, as FlashAttention 2 does. The scale multiplies the f32 scores (kernels.cu scales q).

#define TC_T 64    // rows per block, and per tile of the other side
#define TC_TH 128  // threads per block: 4 warps of 16 rows
#define TC_P 8     // a shared row's padding (bf16): the fragments' 32-bit reads hit 32 banks

// The fragments of mma.m16n8k16 (PTX ISA, "Matrix Fragments for mma.m16n8k16"), lane = 4 g + t:
// A (16 x 16): a[0] = (A[g][2t], A[g][2t + 1]), a[1] = the same of row g + 8, a[2] = of columns
// 2t + 8 and 2t + 9, a[3] = both; B (16 x 8): b[0] = (B[2t][g], B[2t + 1][g]), b[1] = rows + 8;
// C (16 x 8, f32): c[0], c[1] = C[g][2t], C[g][2t + 1]; c[2], c[3] = the same of row g + 8.
// The first element of a pair is the low half of its register.
__device__ __forceinline__ void mma_bf16(float c[4], const unsigned a[4], const unsigned b[2]) {
#ifdef __CUDA_ARCH__
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    emu_mma_bf16(c, a, b);
#endif
}

// The sum (or maximum) of v over the 4 lanes of a quad (same g): the lanes holding one row.
__device__ __forceinline__ float quad_sum(float v) {
    v += lane_xor(v, 1);
    return v + lane_xor(v, 2);
}
__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, lane_xor(v, 1));
    return fmaxf(v, lane_xor(v, 2));
}

__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    return (unsigned)to_bf16(lo) | ((unsigned)to_bf16(hi) << 16);
}

// The A fragments of rows r0 .. r0 + 16 of src [.., D] (row r at src + (base + r) * D; rows from
// `rows` on are zeros): a[kk] covers columns 16 kk .. 16 kk + 16.
template <int D>
__device__ void frag_rows(const bf16_t* src, long base, int r0, int rows, unsigned a[D / 16][4]) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
        for (int x = 0; x < 4; ++x) {
            const int r = r0 + g + (x & 1) * 8, c = kk * 16 + 2 * t + (x >> 1) * 8;
            const bf16_t* p = src + (base + r) * D + c;
            a[kk][x] = r < rows ? (unsigned)p[0] | ((unsigned)p[1] << 16) : 0u;
        }
}

// The B fragment of columns n0 .. n0 + 8 and rows k0 .. k0 + 16 of a matrix B stored with its
// columns as rows of `s` (B[k][n] = s[n * stride + k]; stride even): two 32-bit reads.
__device__ __forceinline__ void frag_b(const bf16_t* s, int stride, int n0, int k0, unsigned b[2]) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const bf16_t* p = s + (n0 + g) * stride + k0 + 2 * t;
    b[0] = *(const unsigned*)p;
    b[1] = *(const unsigned*)(p + 8);
}

// The same fragment of a matrix B stored with its rows as rows of `s` (B[k][n] =
// s[k * stride + n]; rows 16-byte aligned): ldmatrix's transposing load, lanes 0 .. 15 giving
// the addresses of rows k0 .. k0 + 16 (PTX ISA, ldmatrix .x2 .trans: lane 4 g + t receives
// elements (2t, g) and (2t + 1, g) of each 8 x 8 matrix, which is B's fragment).
__device__ __forceinline__ void frag_bt(const bf16_t* s, int stride, int n0, int k0,
                                        unsigned b[2]) {
    const bf16_t* p = s + (k0 + threadIdx.x % 16) * stride + n0;
#ifdef __CUDA_ARCH__
    unsigned a;
    asm volatile("{ .reg .u64 g; cvta.to.shared.u64 g, %1; cvt.u32.u64 %0, g; }"
                 : "=r"(a) : "l"(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];"
                 : "=r"(b[0]), "=r"(b[1]) : "r"(a));
#else
    emu_ldmatrix_x2_trans(p, stride, b);
#endif
}

// A (16 x 16) fragments from a warp's C fragments of 16 rows x 16 columns (c0: columns 0..8,
// c1: columns 8..16), rounded to bf16: how probabilities enter the next product.
__device__ __forceinline__ void frag_from_c(const float c0[4], const float c1[4], unsigned a[4]) {
    a[0] = pack_bf16(c0[0], c0[1]);
    a[1] = pack_bf16(c0[2], c0[3]);
    a[2] = pack_bf16(c1[0], c1[1]);
    a[3] = pack_bf16(c1[2], c1[3]);
}

// s = A T^T: the warp's 16 rows (A fragments `a`, over D) against the TC_T rows of a shared
// tile [TC_T][D + TC_P]; s[n] holds the C fragment of columns 8n .. 8n + 8.
template <int D>
__device__ __forceinline__ void tile_scores(const unsigned a[D / 16][4], const bf16_t* tile,
                                            float s[TC_T / 8][4]) {
#pragma unroll
    for (int n = 0; n < TC_T / 8; ++n) {
#pragma unroll
        for (int x = 0; x < 4; ++x) s[n][x] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            unsigned bb[2];
            frag_b(tile, D + TC_P, n * 8, kk * 16, bb);
            mma_bf16(s[n], a[kk], bb);
        }
    }
}

// acc += C T: the warp's 16 x TC_T C fragments `c` (rounded to bf16) times a shared tile
// [TC_T][D + TC_P]; acc[n] holds the C fragment of columns 8n .. 8n + 8 of D.
template <int D>
__device__ __forceinline__ void tile_accumulate(float acc[D / 8][4], const float c[TC_T / 8][4],
                                                const bf16_t* tile) {
#pragma unroll
    for (int kk = 0; kk < TC_T / 16; ++kk) {
        unsigned a[4];
        frag_from_c(c[2 * kk], c[2 * kk + 1], a);
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            unsigned bb[2];
            frag_bt(tile, D + TC_P, n * 8, kk * 16, bb);
            mma_bf16(acc[n], a, bb);
        }
    }
}

// Zeros for a warp's accumulators of 16 rows x D.
template <int D>
__device__ __forceinline__ void zero_rows(float acc[D / 8][4]) {
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
#pragma unroll
        for (int x = 0; x < 4; ++x) acc[n][x] = 0.f;
}

// Row r (0: the lane's row g, 1: g + 8) of a warp's accumulators times `mul` into dst [.., D]
// at `row` (the row's index in dst).
template <int D>
__device__ __forceinline__ void store_row(bf16_t* dst, long row, const float acc[D / 8][4], int r,
                                          float mul) {
    const int t = threadIdx.x % 4;
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
#pragma unroll
        for (int x = 0; x < 2; ++x) st(dst, row * D + n * 8 + 2 * t + x, acc[n][2 * r + x] * mul);
}

// Rows row0 .. row0 + TC_T of src [.., D] into dst [TC_T][D + TC_P] (rows from `valid` on are
// zeros): 16-byte reads when the rows are 16-byte aligned, else 2-byte ones.
template <int D>
__device__ void tile_in(const bf16_t* src, long row0, int valid, bf16_t* dst) {
    constexpr int N = 8;  // bf16 per 16 bytes
    if (((unsigned long long)(src + row0 * D) & 15) == 0) {
        for (int e = threadIdx.x; e < TC_T * D / N; e += TC_TH) {
            const int r = e / (D / N), c = (e % (D / N)) * N;
            uint4 u = {0u, 0u, 0u, 0u};
            if (r < valid) u = *(const uint4*)(src + (row0 + r) * D + c);
            *(uint4*)(dst + r * (D + TC_P) + c) = u;
        }
        return;
    }
    for (int e = threadIdx.x; e < TC_T * D; e += TC_TH) {
        const int r = e / D, c = e % D;
        dst[r * (D + TC_P) + c] = r < valid ? src[(row0 + r) * D + c] : (bf16_t)0;
    }
}

// Forward: o and lse. Grid: (ceil(S / TC_T), B * H), TC_TH threads.
template <int D>
__device__ void attn_fwd_tc(const bf16_t* q, const bf16_t* k, const bf16_t* v, const float* mask,
                            bf16_t* o, float* lse, int H, int Hkv, int S, int Tk, float scale) {
    extern __shared__ float sm[];
    constexpr int KD = D / 16, NT = TC_T / 8, ND = D / 8;
    bf16_t* ks = (bf16_t*)sm;             // [TC_T][D + TC_P] keys
    bf16_t* vs = ks + TC_T * (D + TC_P);  // [TC_T][D + TC_P] values
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int bh = blockIdx.y, b = bh / H, h = bh % H, hk = h / (H / Hkv);
    const int i0 = blockIdx.x * TC_T, r0 = i0 + (threadIdx.x / 32) * 16;  // the warp's rows
    const long qo = (long)bh * S, ko = ((long)b * Hkv + hk) * Tk;
    unsigned qa[KD][4];
    frag_rows<D>(q, qo, r0, S, qa);
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f}, acc[ND][4];
    zero_rows<D>(acc);
    const int kend = imin(Tk, Tk - S + i0 + TC_T);
    for (int j0 = 0; j0 < kend; j0 += TC_T) {
        __syncthreads();
        tile_in<D>(k, ko + j0, imin(TC_T, Tk - j0), ks);
        tile_in<D>(v, ko + j0, imin(TC_T, Tk - j0), vs);
        __syncthreads();
        float s[NT][4];
        tile_scores<D>(qa, ks, s);
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int x = 0; x < 4; ++x) {
                const int i = r0 + g + (x >> 1) * 8, j = j0 + n * 8 + 2 * t + (x & 1);
                s[n][x] = visible(i, j, S, Tk) ? s[n][x] * scale + mask[((long)b * S + i) * Tk + j]
                                               : NEG_INF;
                mx[x >> 1] = fmaxf(mx[x >> 1], s[n][x]);
            }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mx[r] = quad_max(mx[r]);
            const float c0 = mx[r] == NEG_INF ? 1.f : __expf(m[r] - mx[r]);
            l[r] *= c0;
#pragma unroll
            for (int n = 0; n < ND; ++n) {
                acc[n][2 * r] *= c0;
                acc[n][2 * r + 1] *= c0;
            }
            m[r] = mx[r];
        }
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int x = 0; x < 4; ++x) {
                const float p = s[n][x] == NEG_INF ? 0.f : __expf(s[n][x] - mx[x >> 1]);
                l[x >> 1] += p;
                s[n][x] = p;
            }
        tile_accumulate<D>(acc, s, vs);  // O += P V
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] = quad_sum(l[r]);
        const int i = r0 + g + r * 8;
        if (i >= S) continue;
        store_row<D>(o, qo + i, acc, r, l[r] > 0.f ? 1.f / l[r] : 0.f);
        if (t == 0) lse[qo + i] = m[r] + logf(l[r]);
    }
}

// Backward for queries: delta = rowsum(dO * O) (kept for the dK/dV kernel), and
// dQ = scale * sum_j P (dO.v_j - delta) k_j. Grid: (ceil(S / TC_T), B * H), TC_TH threads.
template <int D>
__device__ void attn_bwd_dq_tc(const bf16_t* q, const bf16_t* k, const bf16_t* v,
                               const float* mask, const bf16_t* o, const bf16_t* dout,
                               const float* lse, float* delta, bf16_t* dq, int H, int Hkv, int S,
                               int Tk, float scale) {
    extern __shared__ float sm[];
    constexpr int KD = D / 16, NT = TC_T / 8, ND = D / 8;
    bf16_t* ks = (bf16_t*)sm;             // [TC_T][D + TC_P] keys
    bf16_t* vs = ks + TC_T * (D + TC_P);  // [TC_T][D + TC_P] values
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int bh = blockIdx.y, b = bh / H, h = bh % H, hk = h / (H / Hkv);
    const int i0 = blockIdx.x * TC_T, r0 = i0 + (threadIdx.x / 32) * 16;
    const long qo = (long)bh * S, ko = ((long)b * Hkv + hk) * Tk;
    unsigned qa[KD][4], ga[KD][4];
    frag_rows<D>(q, qo, r0, S, qa);
    frag_rows<D>(dout, qo, r0, S, ga);
    float dl[2], li[2], acc[ND][4];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int i = r0 + g + r * 8;
        float x = 0.f;
        if (i < S)
            for (int c = t; c < D; c += 4) x += ld(dout, (qo + i) * D + c) * ld(o, (qo + i) * D + c);
        dl[r] = quad_sum(x);
        li[r] = i < S ? lse[qo + i] : 0.f;
        if (t == 0 && i < S) delta[qo + i] = dl[r];
    }
    zero_rows<D>(acc);
    const int kend = imin(Tk, Tk - S + i0 + TC_T);
    for (int j0 = 0; j0 < kend; j0 += TC_T) {
        __syncthreads();
        tile_in<D>(k, ko + j0, imin(TC_T, Tk - j0), ks);
        tile_in<D>(v, ko + j0, imin(TC_T, Tk - j0), vs);
        __syncthreads();
        float s[NT][4], dp[NT][4];
        tile_scores<D>(qa, ks, s);   // Q K^T
        tile_scores<D>(ga, vs, dp);  // dO V^T
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int x = 0; x < 4; ++x) {
                const int i = r0 + g + (x >> 1) * 8, j = j0 + n * 8 + 2 * t + (x & 1);
                const float p = visible(i, j, S, Tk)
                    ? __expf(s[n][x] * scale + mask[((long)b * S + i) * Tk + j] - li[x >> 1])
                    : 0.f;
                s[n][x] = p * (dp[n][x] - dl[x >> 1]);  // dS
            }
        tile_accumulate<D>(acc, s, ks);  // dQ += dS K
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int i = r0 + g + r * 8;
        if (i < S) store_row<D>(dq, qo + i, acc, r, scale);
    }
}

// Backward for keys: over the g query heads that read a key and the queries that reach it,
// dV_j = sum P dO_i and dK_j = scale * sum P (dO_i.v_j - delta_i) q_i. A block holds 64 keys of
// one (b, kv head), a warp 16 of them (its C fragments' rows are keys, its columns queries).
// Grid: (ceil(Tk / TC_T), B * Hkv), TC_TH threads.
template <int D>
__device__ void attn_bwd_dkv_tc(const bf16_t* q, const bf16_t* k, const bf16_t* v,
                                const float* mask, const bf16_t* dout, const float* lse,
                                const float* delta, bf16_t* dk, bf16_t* dv, int H, int Hkv, int S,
                                int Tk, float scale) {
    extern __shared__ float sm[];
    constexpr int KD = D / 16, NT = TC_T / 8, ND = D / 8;
    bf16_t* qs = (bf16_t*)sm;             // [TC_T][D + TC_P] queries
    bf16_t* gs = qs + TC_T * (D + TC_P);  // [TC_T][D + TC_P] dO
    float* ls = (float*)(gs + TC_T * (D + TC_P));  // [TC_T] the queries' lse
    float* dls = ls + TC_T;                        // [TC_T] their delta
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int bk = blockIdx.y, b = bk / Hkv, hk = bk % Hkv, gq = H / Hkv;
    const int j0 = blockIdx.x * TC_T, c0 = j0 + (threadIdx.x / 32) * 16;  // the warp's keys
    const long ko = (long)bk * Tk;
    unsigned ka[KD][4], va[KD][4];
    frag_rows<D>(k, ko, c0, Tk, ka);
    frag_rows<D>(v, ko, c0, Tk, va);
    float ak[ND][4], av[ND][4];
    zero_rows<D>(ak);
    zero_rows<D>(av);
    const int istart = imax(0, j0 - (Tk - S));
    for (int hh = hk * gq; hh < (hk + 1) * gq; ++hh) {
        const long qo = ((long)b * H + hh) * S;
        for (int i0 = istart; i0 < S; i0 += TC_T) {
            __syncthreads();
            const int rows = imin(TC_T, S - i0);
            tile_in<D>(q, qo + i0, rows, qs);
            tile_in<D>(dout, qo + i0, rows, gs);
            for (int e = threadIdx.x; e < TC_T; e += TC_TH) {
                ls[e] = e < rows ? lse[qo + i0 + e] : 0.f;
                dls[e] = e < rows ? delta[qo + i0 + e] : 0.f;
            }
            __syncthreads();
            float s[NT][4], dp[NT][4];
            tile_scores<D>(ka, qs, s);   // K Q^T
            tile_scores<D>(va, gs, dp);  // V dO^T
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int x = 0; x < 4; ++x) {
                    const int j = c0 + g + (x >> 1) * 8, c = n * 8 + 2 * t + (x & 1), i = i0 + c;
                    const float p = visible(i, j, S, Tk)
                        ? __expf(s[n][x] * scale + mask[((long)b * S + i) * Tk + j] - ls[c])
                        : 0.f;
                    s[n][x] = p;                       // P^T
                    dp[n][x] = p * (dp[n][x] - dls[c]);  // dS^T
                }
            tile_accumulate<D>(av, s, gs);   // dV += P^T dO
            tile_accumulate<D>(ak, dp, qs);  // dK += dS^T Q
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int j = c0 + g + r * 8;
        if (j >= Tk) continue;
        store_row<D>(dk, ko + j, ak, r, scale);
        store_row<D>(dv, ko + j, av, r, 1.f);
    }
}

#define TC_INSTANCES(D)                                                                            \
extern "C" __global__ void __launch_bounds__(TC_TH) attn_fwd_tc_bf16_##D(const bf16_t* q,        \
        const bf16_t* k, const bf16_t* v, const float* mask, bf16_t* o, float* lse, int H,         \
        int Hkv, int S, int Tk, float scale) {                                                     \
    attn_fwd_tc<D>(q, k, v, mask, o, lse, H, Hkv, S, Tk, scale);                                   \
}                                                                                                  \
extern "C" __global__ void __launch_bounds__(TC_TH) attn_bwd_dq_tc_bf16_##D(const bf16_t* q,     \
        const bf16_t* k, const bf16_t* v, const float* mask, const bf16_t* o,                      \
        const bf16_t* dout, const float* lse, float* delta, bf16_t* dq, int H, int Hkv, int S,     \
        int Tk, float scale) {                                                                     \
    attn_bwd_dq_tc<D>(q, k, v, mask, o, dout, lse, delta, dq, H, Hkv, S, Tk, scale);               \
}                                                                                                  \
extern "C" __global__ void __launch_bounds__(TC_TH) attn_bwd_dkv_tc_bf16_##D(const bf16_t* q,    \
        const bf16_t* k, const bf16_t* v, const float* mask, const bf16_t* dout,                   \
        const float* lse, const float* delta, bf16_t* dk, bf16_t* dv, int H, int Hkv, int S,       \
        int Tk, float scale) {                                                                     \
    attn_bwd_dkv_tc<D>(q, k, v, mask, dout, lse, delta, dk, dv, H, Hkv, S, Tk, scale);             \
}

TC_INSTANCES(16)
TC_INSTANCES(32)
TC_INSTANCES(64)
TC_INSTANCES(128)
