// Runs grpo's CUDA kernels (crates/grpo-models/src/kernels/cuda/*.cu) on the CPU for
// scripts/check_gpu_kernels.py: a block's threads are OS threads sharing the block's shared memory,
// __syncthreads is a barrier (a thread that returns drops out of it, as on a GPU), blocks run one
// after another.
//   gpu_kernels_emu DIR DTYPE B H HKV S TK D SCALE [tc] [shift]
// reads DIR/{q,k,v,mask,dout}.bin, writes DIR/{o,lse,dq,dk,dv}.bin (DTYPE f32 or bf16 as u16;
// `tc`: attention_tc.cu's tensor-core kernels, bf16 only, their mma, ldmatrix and lane shuffles
// emulated; `shift`: the inputs one element off 16-byte alignment);
//   gpu_kernels_emu swiglu DIR DTYPE N I
// reads DIR/{gu,dy}.bin, writes DIR/{y,dgu}.bin;
//   gpu_kernels_emu rmsnorm DIR DTYPE N H EPS
// reads DIR/{x,w,g}.bin, writes DIR/{y,dx,gn}.bin;
//   gpu_kernels_emu rope DIR DTYPE B T H D XS
// reads DIR/{x,cos,sin,g}.bin (x [B, T, XS], its first H*D columns rotated), writes DIR/{y,dx}.bin;
//   gpu_kernels_emu head DIR DTYPE C V INV_T
// reads DIR/{z,y,g}.bin (logits [C, V], targets u32, gradients [C, 2] f32), writes
// DIR/{out,lse,dz}.bin (the entropy's gradient included);
//   gpu_kernels_emu decode DIR DTYPE B H HKV TK MAXT D SCALE [warp] [shared=N]
// reads DIR/{q,k,v,mask}.bin (caches [B, HKV, MAXT, D], the first TK slots read), writes DIR/o.bin
// (`warp`: attn_decode_warp, else attn_decode; `shared=N`: slots < N of row b from row leader[b],
// DIR/leader.bin u32 [B]);
//   gpu_kernels_emu rope_append DIR DTYPE B H HKV D XS SLOTS SLOT
// reads DIR/{x,cos,sin,kc,vc}.bin, writes DIR/{q,kc_out,vc_out}.bin;
//   gpu_kernels_emu add_rms DIR DTYPE N H EPS
// reads DIR/{x,a,w}.bin, writes DIR/{s,y}.bin;
//   gpu_kernels_emu sumsq DIR N BLOCKS
// reads DIR/x.bin, writes DIR/out.bin (the blocks' partial sums of squares);
//   gpu_kernels_emu adamw DIR N STEPS LR B1 B2 EPS WD GS
// reads DIR/{p,g}.bin (g [STEPS, N]), writes DIR/{p_out,m,v}.bin.
//   gpu_kernels_emu nf4 DIR DTYPE N
// reads DIR/{packed,absmax,code}.bin (u8 [ceil(N/2)], f32 [ceil(N/64)], f32 [16]), writes
// DIR/out.bin (N values).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <barrier>
#include <memory>
#include <string>
#include <thread>
#include <vector>
#define __device__
#define __forceinline__ inline
#define __global__
#define __launch_bounds__(x)
#define __shared__
struct Dim3 { int x, y, z; };
struct uint4 { unsigned x, y, z, w; };
static Dim3 blockIdx, blockDim, gridDim;
thread_local Dim3 threadIdx;
float sm[1 << 20];
static std::barrier<>* block_barrier;
#define __syncthreads() block_barrier->arrive_and_wait()
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
static inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
#define __expf expf
// A warp's collective operations (attention_tc.cu): each lane posts its operands to the warp's
// slot, waits for the other 31, computes its own results from all of them, and waits again
// before the slot is reused. Warp w of a block is threads 32 w .. 32 w + 31.
static std::barrier<>* warp_barrier[32];
static unsigned warp_a[32][32][4], warp_b[32][32][2];
static float warp_v[32][32];
static inline void warp_sync() { warp_barrier[threadIdx.x / 32]->arrive_and_wait(); }
static float emu_bf16(unsigned r, int hi) { return __uint_as_float(((r >> (hi * 16)) & 0xffffu) << 16); }
// mma.m16n8k16 (bf16 in, f32 sums): D = A B + C over the fragments' documented lane layout.
static void emu_mma_bf16(float c[4], const unsigned a[4], const unsigned b[2]) {
    const int w = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    for (int x = 0; x < 4; ++x) warp_a[w][lane][x] = a[x];
    for (int x = 0; x < 2; ++x) warp_b[w][lane][x] = b[x];
    warp_sync();
    float d[4];
    for (int x = 0; x < 4; ++x) {
        const int row = g + (x >> 1) * 8, col = 2 * t + (x & 1);
        float acc = c[x];
        for (int kx = 0; kx < 16; ++kx) {
            // A[row][kx]: lane 4 (row % 8) + (kx % 8) / 2, register (kx >= 8) * 2 + (row >= 8).
            const float av = emu_bf16(warp_a[w][4 * (row % 8) + (kx % 8) / 2][(kx >= 8) * 2 + (row >= 8)], kx & 1);
            // B[kx][col]: lane 4 col + (kx % 8) / 2, register kx >= 8.
            const float bv = emu_bf16(warp_b[w][4 * col + (kx % 8) / 2][kx >= 8], kx & 1);
            acc += av * bv;
        }
        d[x] = acc;
    }
    warp_sync();
    for (int x = 0; x < 4; ++x) c[x] = d[x];
}
// ldmatrix .x2 .trans (b16): lanes 0 .. 15 give the addresses of the rows of two 8 x 8 matrices
// (8 contiguous elements each); lane 4 g + t receives elements (2t, g) and (2t + 1, g) of each.
static const unsigned short* warp_rows[32][32];
static void emu_ldmatrix_x2_trans(const unsigned short* p, int, unsigned b[2]) {
    const int w = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    warp_rows[w][lane] = p;
    warp_sync();
    for (int i = 0; i < 2; ++i)
        b[i] = (unsigned)warp_rows[w][8 * i + 2 * t][g] | ((unsigned)warp_rows[w][8 * i + 2 * t + 1][g] << 16);
    warp_sync();
}
static float emu_lane_xor(float v, int m) {
    const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
    warp_v[w][lane] = v;
    warp_sync();
    const float r = warp_v[w][lane ^ m];
    warp_sync();
    return r;
}
#include "../crates/grpo-models/src/kernels/cuda/kernels.cu"
#include "../crates/grpo-models/src/kernels/cuda/attention_tc.cu"

template <typename T> std::vector<T> rd(const std::string& p, size_t n) {
    std::vector<T> v(n);
    FILE* f = fopen(p.c_str(), "rb");
    if (!f || fread(v.data(), sizeof(T), n, f) != n) { fprintf(stderr, "read %s\n", p.c_str()); exit(1); }
    fclose(f);
    return v;
}
template <typename T> void wr(const std::string& p, const std::vector<T>& v) {
    FILE* f = fopen(p.c_str(), "wb");
    fwrite(v.data(), sizeof(T), v.size(), f);
    fclose(f);
}
template <typename F> void launch(int gx, int gy, int bx, F f) {
    blockDim = {bx, 1, 1};
    gridDim = {gx, gy, 1};
    for (int y = 0; y < gy; ++y)
        for (int x = 0; x < gx; ++x) {
            blockIdx = {x, y, 0};
            std::barrier<> bar(bx);
            block_barrier = &bar;
            std::vector<std::unique_ptr<std::barrier<>>> warps;
            for (int w = 0; w < (bx + 31) / 32; ++w) {
                warps.push_back(std::make_unique<std::barrier<>>(std::min(32, bx - 32 * w)));
                warp_barrier[w] = warps.back().get();
            }
            std::vector<std::thread> threads;
            for (int t = 0; t < bx; ++t)
                threads.emplace_back([&, t] {
                    threadIdx = {t, 0, 0};
                    f();
                    bar.arrive_and_drop();
                    warp_barrier[t / 32]->arrive_and_drop();
                });
            for (auto& th : threads) th.join();
        }
}
template <typename T, int D> void run(const std::string& dir, int B, int H, int Hkv, int S, int Tk, float sc, bool tc, bool shift) {
    size_t nq = (size_t)B * H * S * D, nk = (size_t)B * Hkv * Tk * D;
    // `shift`: the inputs one element past an aligned address (the kernels' unaligned paths).
    auto in = [&](const char* name, size_t n) {
        auto x = rd<T>(dir + "/" + name + ".bin", n);
        if (shift) x.insert(x.begin(), T{});
        return x;
    };
    const size_t at = shift ? 1 : 0;
    auto q_ = in("q", nq), k_ = in("k", nk), v_ = in("v", nk), dout_ = in("dout", nq);
    struct View { T* p; T* data() { return p; } };
    View q{q_.data() + at}, k{k_.data() + at}, v{v_.data() + at}, dout{dout_.data() + at};
    auto mask = rd<float>(dir + "/mask.bin", (size_t)B * S * Tk);
    std::vector<T> o(nq), dq(nq), dk(nk), dv(nk);
    std::vector<float> lse((size_t)B * H * S), delta((size_t)B * H * S);
    const int AT_ = 64, TH = 256;
    if constexpr (sizeof(T) == 2) if (tc) {  // attention_tc.cu's kernels: 4 warps a block
        launch((S + AT_ - 1) / AT_, B * H, TC_TH, [&] { attn_fwd_tc<D>(q.data(), k.data(), v.data(), mask.data(), o.data(), lse.data(), H, Hkv, S, Tk, sc); });
        launch((S + AT_ - 1) / AT_, B * H, TC_TH, [&] { attn_bwd_dq_tc<D>(q.data(), k.data(), v.data(), mask.data(), o.data(), dout.data(), lse.data(), delta.data(), dq.data(), H, Hkv, S, Tk, sc); });
        launch((Tk + AT_ - 1) / AT_, B * Hkv, TC_TH, [&] { attn_bwd_dkv_tc<D>(q.data(), k.data(), v.data(), mask.data(), dout.data(), lse.data(), delta.data(), dk.data(), dv.data(), H, Hkv, S, Tk, sc); });
        wr(dir + "/o.bin", o); wr(dir + "/lse.bin", lse); wr(dir + "/dq.bin", dq); wr(dir + "/dk.bin", dk); wr(dir + "/dv.bin", dv);
        return;
    }
    launch((S + AT_ - 1) / AT_, B * H, TH, [&] { attn_fwd<T, D>(q.data(), k.data(), v.data(), mask.data(), o.data(), lse.data(), H, Hkv, S, Tk, sc); });
    launch((S + AT_ - 1) / AT_, B * H, TH, [&] { attn_bwd_dq<T, D>(q.data(), k.data(), v.data(), mask.data(), o.data(), dout.data(), lse.data(), delta.data(), dq.data(), H, Hkv, S, Tk, sc); });
    launch((Tk + AT_ - 1) / AT_, B * Hkv, TH, [&] { attn_bwd_dkv<T, D>(q.data(), k.data(), v.data(), mask.data(), dout.data(), lse.data(), delta.data(), dk.data(), dv.data(), H, Hkv, S, Tk, sc); });
    wr(dir + "/o.bin", o); wr(dir + "/lse.bin", lse); wr(dir + "/dq.bin", dq); wr(dir + "/dk.bin", dk); wr(dir + "/dv.bin", dv);
}
template <typename T> void run_swiglu(const std::string& dir, long n, int inter) {
    auto gu = rd<T>(dir + "/gu.bin", n * 2 * inter), dy = rd<T>(dir + "/dy.bin", n * inter);
    std::vector<T> y(n * inter), dgu(n * 2 * inter);
    const int T_ = 256;
    const int blocks = (int)((n * inter + T_ - 1) / T_);
    launch(blocks, 1, T_, [&] { swiglu_fwd<T>(gu.data(), y.data(), n * inter, inter); });
    launch(blocks, 1, T_, [&] { swiglu_bwd<T>(gu.data(), dy.data(), dgu.data(), n * inter, inter); });
    wr(dir + "/y.bin", y); wr(dir + "/dgu.bin", dgu);
}
template <typename T> void run_nf4(const std::string& dir, long n) {
    const long bytes = (n + 1) / 2;
    auto packed = rd<unsigned char>(dir + "/packed.bin", bytes);
    auto absmax = rd<float>(dir + "/absmax.bin", (n + 63) / 64), code = rd<float>(dir + "/code.bin", 16);
    std::vector<T> out(n);
    launch((int)((bytes + 255) / 256), 1, 256, [&] { nf4_dequant<T>(packed.data(), absmax.data(), code.data(), out.data(), n); });
    wr(dir + "/out.bin", out);
}
template <typename T> void run_rms(const std::string& dir, long n, int h, float eps) {
    auto x = rd<T>(dir + "/x.bin", n * h), w = rd<T>(dir + "/w.bin", h), g = rd<T>(dir + "/g.bin", n * h);
    std::vector<T> y(n * h), dx(n * h);
    std::vector<float> gn(n * h);
    launch((int)n, 1, NORM_THREADS, [&] { rms_norm_fwd<T>(x.data(), w.data(), y.data(), h, eps); });
    launch((int)n, 1, NORM_THREADS, [&] { rms_norm_bwd<T>(x.data(), w.data(), g.data(), dx.data(), gn.data(), h, eps); });
    wr(dir + "/y.bin", y); wr(dir + "/dx.bin", dx); wr(dir + "/gn.bin", gn);
}
template <typename T> void run_rope(const std::string& dir, int b, int t, int h, int d, long xs) {
    auto x = rd<T>(dir + "/x.bin", (size_t)b * t * xs), cs = rd<T>(dir + "/cos.bin", (size_t)b * t * d / 2);
    auto sn = rd<T>(dir + "/sin.bin", (size_t)b * t * d / 2), g = rd<T>(dir + "/g.bin", (size_t)b * h * t * d);
    std::vector<T> y((size_t)b * h * t * d), dx((size_t)b * t * h * d);
    const long n = (long)b * h * t * (d / 2);
    const int blocks = (int)((n + 255) / 256);
    launch(blocks, 1, 256, [&] { rope<T>(x.data(), cs.data(), sn.data(), y.data(), n, t, h, d, xs, false); });
    launch(blocks, 1, 256, [&] { rope<T>(g.data(), cs.data(), sn.data(), dx.data(), n, t, h, d, (long)h * d, true); });
    wr(dir + "/y.bin", y); wr(dir + "/dx.bin", dx);
}
// A decoding step: x [B, 1, XS] (q, k, v heads first), cos/sin [B, 1, D/2], caches kc/vc
// [B, HKV, SLOTS, D] read from DIR and written back with slot SLOT filled; q [B, H, 1, D].
template <typename T> void run_rope_append(const std::string& dir, int b, int h, int hkv, int d, long xs, int slots, int slot) {
    auto x = rd<T>(dir + "/x.bin", (size_t)b * xs), cs = rd<T>(dir + "/cos.bin", (size_t)b * d / 2);
    auto sn = rd<T>(dir + "/sin.bin", (size_t)b * d / 2);
    auto kc = rd<T>(dir + "/kc.bin", (size_t)b * hkv * slots * d), vc = rd<T>(dir + "/vc.bin", (size_t)b * hkv * slots * d);
    std::vector<T> q((size_t)b * h * d);
    const long n = (long)b * (h + 2 * hkv) * (d / 2);
    launch((int)((n + 255) / 256), 1, 256, [&] {
        rope_append<T>(x.data(), cs.data(), sn.data(), q.data(), kc.data(), vc.data(), n, h, hkv, d, xs, (long)slots * d, slot);
    });
    wr(dir + "/q.bin", q); wr(dir + "/kc_out.bin", kc); wr(dir + "/vc_out.bin", vc);
}
// The residual add and RMSNorm: x, a [N, H], w [H] -> s, y.
template <typename T> void run_add_rms(const std::string& dir, long n, int h, float eps) {
    auto x = rd<T>(dir + "/x.bin", n * h), a = rd<T>(dir + "/a.bin", n * h), w = rd<T>(dir + "/w.bin", h);
    std::vector<T> sum(n * h), y(n * h);
    launch((int)n, 1, NORM_THREADS, [&] { add_rms_norm<T>(x.data(), a.data(), w.data(), sum.data(), y.data(), h, eps); });
    wr(dir + "/s.bin", sum); wr(dir + "/y.bin", y);
}
template <typename T> void run_head(const std::string& dir, long c, int v, float inv_t) {
    auto z = rd<T>(dir + "/z.bin", c * v), g = rd<float>(dir + "/g.bin", c * 2);
    auto y = rd<unsigned int>(dir + "/y.bin", c);
    std::vector<float> out(c * 2), lse(c);
    std::vector<T> dz(c * v);
    launch((int)c, 1, NORM_THREADS, [&] { head_fwd<T>(z.data(), y.data(), out.data(), lse.data(), v, inv_t); });
    launch((int)c, 1, NORM_THREADS, [&] { head_bwd<T>(z.data(), y.data(), lse.data(), g.data(), out.data(), dz.data(), v, inv_t, 1); });
    wr(dir + "/out.bin", out); wr(dir + "/lse.bin", lse); wr(dir + "/dz.bin", dz);
}
template <typename T, int D> void run_decode(const std::string& dir, int B, int H, int Hkv, int Tk, int maxT, float sc, bool warp, int shared) {
    // k/v: caches [B, Hkv, maxT, D] of which the first Tk slots are read (a view, as the sampler's).
    auto q = rd<T>(dir + "/q.bin", (size_t)B * H * D), k = rd<T>(dir + "/k.bin", (size_t)B * Hkv * maxT * D);
    auto v = rd<T>(dir + "/v.bin", (size_t)B * Hkv * maxT * D), mask = rd<float>(dir + "/mask.bin", (size_t)B * Tk);
    std::vector<T> o((size_t)B * H * D);
    // A shared prompt: slots < shared of row b read from row leader[b] (DIR/leader.bin, u32 [B]).
    std::vector<unsigned int> leader = shared > 0 ? rd<unsigned int>(dir + "/leader.bin", B) : std::vector<unsigned int>{0};
    const long sh = (long)maxT * D, sb = (long)Hkv * sh;
    if (warp)  // a warp per (row, query head), 4 a block
        launch((B * H + 3) / 4, 1, 128, [&] { attn_decode_warp<T, D>(q.data(), k.data(), v.data(), mask.data(), o.data(), H, Hkv, B, Tk, sb, sh, sc, leader.data(), shared); });
    else
        launch(B * Hkv, 1, NORM_THREADS, [&] { attn_decode<T, D>(q.data(), k.data(), v.data(), mask.data(), o.data(), H, Hkv, Tk, sb, sh, sc, leader.data(), shared); });
    wr(dir + "/o.bin", o);
}
// AdamW: STEPS steps of the kernel over p [N] with gradients g [STEPS, N] (torch's bias
// corrections for steps 1..STEPS), moments from zero; writes p, m, v.
void run_adamw(const std::string& dir, long n, int steps, float lr, float b1, float b2, float eps,
               float wd, float gs) {
    auto p = rd<float>(dir + "/p.bin", n), g = rd<float>(dir + "/g.bin", n * steps);
    std::vector<float> m(n), v(n);
    for (int t = 1; t <= steps; ++t) {
        const float bc1 = 1.f - powf(b1, t), bc2 = sqrtf(1.f - powf(b2, t));
        const float* gt = g.data() + (t - 1) * n;
        launch((int)((n + 255) / 256), 1, 256, [&] {
            adamw_f32(p.data(), gt, m.data(), v.data(), n, gs, 1.f - lr * wd, b1, b2, eps, bc2, lr / bc1);
        });
    }
    wr(dir + "/p_out.bin", p); wr(dir + "/m.bin", m); wr(dir + "/v.bin", v);
}
// Sums of squares over a fixed grid of BLOCKS blocks: x [N] f32 -> partials [BLOCKS].
void run_sumsq(const std::string& dir, long n, int blocks) {
    auto x = rd<float>(dir + "/x.bin", n);
    std::vector<float> out(blocks);
    launch(blocks, 1, NORM_THREADS, [&] { sumsq_f32(x.data(), out.data(), n); });
    wr(dir + "/out.bin", out);
}
int main(int argc, char** argv) {
    if (argc == 5 && std::string(argv[1]) == "sumsq") {
        run_sumsq(argv[2], atol(argv[3]), atoi(argv[4]));
        return 0;
    }
    if (argc == 11 && std::string(argv[1]) == "adamw") {
        run_adamw(argv[2], atol(argv[3]), atoi(argv[4]), atof(argv[5]), atof(argv[6]), atof(argv[7]),
                  atof(argv[8]), atof(argv[9]), atof(argv[10]));
        return 0;
    }
    if (argc >= 11 && std::string(argv[1]) == "decode") {
        std::string dir = argv[2], dt = argv[3];
        int B = atoi(argv[4]), H = atoi(argv[5]), Hkv = atoi(argv[6]), Tk = atoi(argv[7]), maxT = atoi(argv[8]), D = atoi(argv[9]);
        float sc = atof(argv[10]);
        bool ok = false;
        bool warp = false;
        int shared = 0;
        for (int a = 11; a < argc; ++a) {
            const std::string s = argv[a];
            if (s == "warp") warp = true;
            else if (s.rfind("shared=", 0) == 0) shared = atoi(s.c_str() + 7);
            else { fprintf(stderr, "decode: unknown option %s\n", s.c_str()); return 2; }
        }
#define DEC(T, NAME, DD) if (dt == NAME && D == DD) { run_decode<T, DD>(dir, B, H, Hkv, Tk, maxT, sc, warp, shared); ok = true; }
        DEC(float, "f32", 16) DEC(float, "f32", 32) DEC(float, "f32", 64) DEC(float, "f32", 128)
        DEC(bf16_t, "bf16", 16) DEC(bf16_t, "bf16", 32) DEC(bf16_t, "bf16", 64) DEC(bf16_t, "bf16", 128)
        if (!ok) { fprintf(stderr, "unsupported decode %s D=%d\n", dt.c_str(), D); return 2; }
        return 0;
    }
    if (argc == 7 && std::string(argv[1]) == "head") {
        std::string dir = argv[2], dt = argv[3];
        long c = atol(argv[4]); int v = atoi(argv[5]); float inv_t = atof(argv[6]);
        if (dt == "f32") run_head<float>(dir, c, v, inv_t); else run_head<bf16_t>(dir, c, v, inv_t);
        return 0;
    }
    if (argc == 11 && std::string(argv[1]) == "rope_append") {
        std::string dir = argv[2], dt = argv[3];
        int b = atoi(argv[4]), h = atoi(argv[5]), hkv = atoi(argv[6]), d = atoi(argv[7]);
        long xs = atol(argv[8]); int slots = atoi(argv[9]), slot = atoi(argv[10]);
        if (dt == "f32") run_rope_append<float>(dir, b, h, hkv, d, xs, slots, slot);
        else run_rope_append<bf16_t>(dir, b, h, hkv, d, xs, slots, slot);
        return 0;
    }
    if (argc == 7 && std::string(argv[1]) == "add_rms") {
        std::string dir = argv[2], dt = argv[3];
        long n = atol(argv[4]); int h = atoi(argv[5]); float eps = atof(argv[6]);
        if (dt == "f32") run_add_rms<float>(dir, n, h, eps); else run_add_rms<bf16_t>(dir, n, h, eps);
        return 0;
    }
    if (argc == 9 && std::string(argv[1]) == "rope") {
        std::string dir = argv[2], dt = argv[3];
        int b = atoi(argv[4]), t = atoi(argv[5]), h = atoi(argv[6]), d = atoi(argv[7]); long xs = atol(argv[8]);
        if (dt == "f32") run_rope<float>(dir, b, t, h, d, xs); else run_rope<bf16_t>(dir, b, t, h, d, xs);
        return 0;
    }
    if (argc == 7 && std::string(argv[1]) == "rmsnorm") {
        std::string dir = argv[2], dt = argv[3];
        long n = atol(argv[4]); int h = atoi(argv[5]); float eps = atof(argv[6]);
        if (dt == "f32") run_rms<float>(dir, n, h, eps); else run_rms<bf16_t>(dir, n, h, eps);
        return 0;
    }
    if (argc == 5 && std::string(argv[1]) == "nf4") {
        std::string dir = argv[2], dt = argv[3];
        long n = atol(argv[4]);
        if (dt == "f32") run_nf4<float>(dir, n); else run_nf4<bf16_t>(dir, n);
        return 0;
    }
    if (argc == 6 && std::string(argv[1]) == "swiglu") {
        std::string dir = argv[2], dt = argv[3];
        long n = atol(argv[4]); int inter = atoi(argv[5]);
        if (dt == "f32") run_swiglu<float>(dir, n, inter); else run_swiglu<bf16_t>(dir, n, inter);
        return 0;
    }
    bool tc = false, shift = false;
    for (int a = 10; a < argc; ++a) {
        const std::string s = argv[a];
        if (s == "tc") tc = true;
        else if (s == "shift") shift = true;
        else { fprintf(stderr, "usage: DIR DTYPE B H HKV S TK D SCALE [tc] [shift]\n"); return 2; }
    }
    if (argc < 10) { fprintf(stderr, "usage: DIR DTYPE B H HKV S TK D SCALE [tc] [shift]\n"); return 2; }
    std::string dir = argv[1], dt = argv[2];
    int B = atoi(argv[3]), H = atoi(argv[4]), Hkv = atoi(argv[5]), S = atoi(argv[6]), Tk = atoi(argv[7]), D = atoi(argv[8]);
    float sc = atof(argv[9]);
    bool ok = false;
#define ATT(T, NAME, DD) if (dt == NAME && D == DD) { run<T, DD>(dir, B, H, Hkv, S, Tk, sc, tc, shift); ok = true; }
    ATT(float, "f32", 16) ATT(float, "f32", 32) ATT(float, "f32", 64) ATT(float, "f32", 128)
    ATT(bf16_t, "bf16", 16) ATT(bf16_t, "bf16", 32) ATT(bf16_t, "bf16", 64) ATT(bf16_t, "bf16", 128)
    if (!ok) { fprintf(stderr, "unsupported %s D=%d\n", dt.c_str(), D); return 2; }
    return 0;
}
