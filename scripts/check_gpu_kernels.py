"""Checks grpo's CUDA kernels' source on a CPU against torch: scripts/gpu_kernels_emu.cpp compiles
kernels.cu as C++ and runs each block's threads as OS threads (__syncthreads a barrier), this
compares the outputs, attention's log-sum-exp and every gradient with torch autograd's.
    /opt/peers/venv/bin/python scripts/check_gpu_kernels.py     (needs g++ and torch)
The GPU itself runs the same source through NVRTC; crates/grpo/tests/cuda/ checks it there."""
import os, subprocess, sys, tempfile
import numpy as np
import torch

ROOT = os.path.dirname(os.path.abspath(__file__))
MASK = -1e30


def build():
    exe = os.path.join(tempfile.gettempdir(), "grpo_gpu_kernels_emu")
    subprocess.run(["g++", "-O2", "-std=c++20", "-pthread", "-x", "c++", "-o", exe,
                    os.path.join(ROOT, "gpu_kernels_emu.cpp")], check=True)
    return exe


def case(exe, dtype, B, H, Hkv, S, Tk, D, seed, tc=False):
    g = torch.Generator().manual_seed(seed)
    tdt = torch.float32 if dtype == "f32" else torch.bfloat16
    q = torch.randn(B, H, S, D, generator=g).to(tdt)
    k = torch.randn(B, Hkv, Tk, D, generator=g).to(tdt)
    v = torch.randn(B, Hkv, Tk, D, generator=g).to(tdt)
    dout = torch.randn(B, H, S, D, generator=g).to(tdt)
    mask = torch.zeros(B, S, Tk)
    mask[-1, :, :2] = MASK  # the last row is left-padded by two slots
    scale = D ** -0.5
    # A query whose visible keys are all padding is a padding position: its loss and so its
    # output gradient are 0 in training (its log-sum-exp, -1e30 + log n, rounds to -1e30).
    visible = (torch.arange(Tk)[None, :] <= (Tk - S + torch.arange(S))[:, None])  # [S, Tk]
    dead = ((mask == 0) & visible).sum(-1) == 0  # [B, S]
    dout = dout.masked_fill(dead[:, None, :, None], 0)
    with tempfile.TemporaryDirectory() as d:
        raw = lambda t: (t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy())
        for name, t in [("q", q), ("k", k), ("v", v), ("dout", dout), ("mask", mask)]:
            raw(t.contiguous()).tofile(os.path.join(d, name + ".bin"))
        subprocess.run([exe, d, dtype, *map(str, [B, H, Hkv, S, Tk, D]), repr(scale)]
                       + (["tc"] if tc else []), check=True)
        def back(name, shape, bf):
            a = np.fromfile(os.path.join(d, name + ".bin"), dtype=np.int16 if bf else np.float32)
            t = torch.from_numpy(a.copy())
            return (t.view(torch.bfloat16).float() if bf else t).reshape(shape)
        bf = dtype == "bf16"
        got = {"o": back("o", q.shape, bf), "lse": back("lse", (B, H, S), False),
               "dq": back("dq", q.shape, bf), "dk": back("dk", k.shape, bf), "dv": back("dv", v.shape, bf)}
    qf, kf, vf = (t.float().requires_grad_() for t in (q, k, v))
    rep = lambda t: t.repeat_interleave(H // Hkv, dim=1)
    z = qf @ rep(kf).transpose(-1, -2) * scale + mask[:, None]
    causal = torch.arange(Tk)[None, :] > (Tk - S + torch.arange(S))[:, None]
    z = z.masked_fill(causal, float("-inf"))
    lse = torch.logsumexp(z, -1)
    o = torch.softmax(z, -1) @ rep(vf)
    o.backward(dout.float())
    want = {"o": o.detach(), "lse": lse.detach(), "dq": qf.grad, "dk": kf.grad, "dv": vf.grad}
    tol = 1e-4 if dtype == "f32" else 3e-2
    worst = 0.0
    for name, w in want.items():
        err = ((got[name] - w).abs().max() / w.abs().max().clamp(min=1)).item()
        worst = max(worst, err)
        status = "ok" if err < tol else "FAIL"
        print(f"{dtype}{' tensor cores' if tc else ''} B{B} H{H}/{Hkv} S{S} Tk{Tk} D{D} {name}: "
              f"{err:.2e} {status}")
        if err >= tol:
            sys.exit(1)
    return worst


def swiglu(exe, dtype, n, inter, seed):
    g = torch.Generator().manual_seed(seed)
    tdt = torch.float32 if dtype == "f32" else torch.bfloat16
    gu = (torch.randn(n, 2 * inter, generator=g) * 3).to(tdt)
    dy = torch.randn(n, inter, generator=g).to(tdt)
    bf = dtype == "bf16"
    raw = lambda t: (t.view(torch.int16).numpy() if bf else t.numpy())
    with tempfile.TemporaryDirectory() as d:
        raw(gu).tofile(os.path.join(d, "gu.bin"))
        raw(dy).tofile(os.path.join(d, "dy.bin"))
        subprocess.run([exe, "swiglu", d, dtype, str(n), str(inter)], check=True)
        def back(name, shape):
            a = torch.from_numpy(np.fromfile(os.path.join(d, name + ".bin"),
                                             dtype=np.int16 if bf else np.float32).copy())
            return (a.view(torch.bfloat16).float() if bf else a).reshape(shape)
        y, dgu = back("y", (n, inter)), back("dgu", (n, 2 * inter))
    x = gu.float().requires_grad_()
    want = torch.nn.functional.silu(x[:, :inter]) * x[:, inter:]
    want.backward(dy.float())
    tol = 1e-5 if dtype == "f32" else 1e-2
    for name, a, w in [("y", y, want.detach()), ("dgu", dgu, x.grad)]:
        err = ((a - w).abs().max() / w.abs().max().clamp(min=1)).item()
        status = "ok" if err < tol else "FAIL"
        print(f"{dtype} swiglu N{n} I{inter} {name}: {err:.2e} {status}")
        if err >= tol:
            sys.exit(1)


def rmsnorm(exe, dtype, n, h, seed):
    g_ = torch.Generator().manual_seed(seed)
    tdt = torch.float32 if dtype == "f32" else torch.bfloat16
    x = (torch.randn(n, h, generator=g_) * 2).to(tdt)
    w = (1 + torch.randn(h, generator=g_) * 0.1).to(tdt)
    g = torch.randn(n, h, generator=g_).to(tdt)
    eps = 1e-5
    bf = dtype == "bf16"
    raw = lambda t: (t.view(torch.int16).numpy() if bf else t.numpy())
    with tempfile.TemporaryDirectory() as d:
        for name, t in [("x", x), ("w", w), ("g", g)]:
            raw(t.contiguous()).tofile(os.path.join(d, name + ".bin"))
        subprocess.run([exe, "rmsnorm", d, dtype, str(n), str(h), repr(eps)], check=True)
        def back(name, f32=False):
            a = torch.from_numpy(np.fromfile(os.path.join(d, name + ".bin"),
                                             dtype=np.int16 if bf and not f32 else np.float32).copy())
            return (a.view(torch.bfloat16).float() if bf and not f32 else a).reshape(n, h)
        y, dx, gn = back("y"), back("dx"), back("gn", True)
    # HF's LlamaRMSNorm: f32 statistics, the normalized row in the input's dtype, times the weight.
    xf, wf = x.float().requires_grad_(), w.float().requires_grad_()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    want = wf * normed
    want.backward(g.float())
    tol = 1e-5 if dtype == "f32" else 2e-2
    dw = gn.sum(0)
    for name, a, e in [("y", y, want.detach()), ("dx", dx, xf.grad), ("dw", dw, wf.grad)]:
        err = ((a - e).abs().max() / e.abs().max().clamp(min=1)).item()
        status = "ok" if err < tol else "FAIL"
        print(f"{dtype} rmsnorm N{n} H{h} {name}: {err:.2e} {status}")
        if err >= tol:
            sys.exit(1)


def rope(exe, dtype, b, t, h, d, extra, seed):
    g_ = torch.Generator().manual_seed(seed)
    tdt = torch.float32 if dtype == "f32" else torch.bfloat16
    xs = h * d + extra  # the rows of the joined projection: q's columns, then others
    x = torch.randn(b, t, xs, generator=g_).to(tdt)
    ang = torch.rand(b, t, d // 2, generator=g_) * 6
    cos, sin = ang.cos().to(tdt), ang.sin().to(tdt)
    gy = torch.randn(b, h, t, d, generator=g_).to(tdt)
    bf = dtype == "bf16"
    raw = lambda t_: (t_.view(torch.int16).numpy() if bf else t_.numpy())
    with tempfile.TemporaryDirectory() as dd:
        for name, t_ in [("x", x), ("cos", cos), ("sin", sin), ("g", gy)]:
            raw(t_.contiguous()).tofile(os.path.join(dd, name + ".bin"))
        subprocess.run([exe, "rope", dd, dtype, *map(str, [b, t, h, d, xs])], check=True)
        def back(name, shape):
            a = torch.from_numpy(np.fromfile(os.path.join(dd, name + ".bin"),
                                             dtype=np.int16 if bf else np.float32).copy())
            return (a.view(torch.bfloat16).float() if bf else a).reshape(shape)
        y, dx = back("y", (b, h, t, d)), back("dx", (b, t, h * d))
    xf = x[:, :, : h * d].float().requires_grad_()
    xh = xf.reshape(b, t, h, d).transpose(1, 2)  # [B, H, T, D]
    c, s = cos.float()[:, None], sin.float()[:, None]
    x1, x2 = xh[..., : d // 2], xh[..., d // 2:]
    want = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)
    want.backward(gy.float())
    tol = 1e-5 if dtype == "f32" else 1e-2
    for name, a, e in [("y", y, want.detach()), ("dx", dx, xf.grad)]:
        err = ((a - e).abs().max() / e.abs().max().clamp(min=1)).item()
        status = "ok" if err < tol else "FAIL"
        print(f"{dtype} rope B{b} T{t} H{h} D{d} {name}: {err:.2e} {status}")
        if err >= tol:
            sys.exit(1)


def head(exe, dtype, c, v, temp, seed):
    g_ = torch.Generator().manual_seed(seed)
    tdt = torch.float32 if dtype == "f32" else torch.bfloat16
    z = (torch.randn(c, v, generator=g_) * 4).to(tdt)
    y = torch.randint(0, v, (c,), generator=g_, dtype=torch.int64)
    g = torch.randn(c, 2, generator=g_)
    bf = dtype == "bf16"
    with tempfile.TemporaryDirectory() as d:
        (z.view(torch.int16).numpy() if bf else z.numpy()).tofile(os.path.join(d, "z.bin"))
        y.to(torch.int32).numpy().astype(np.uint32).tofile(os.path.join(d, "y.bin"))
        g.numpy().tofile(os.path.join(d, "g.bin"))
        subprocess.run([exe, "head", d, dtype, str(c), str(v), repr(1.0 / temp)], check=True)
        out = torch.from_numpy(np.fromfile(os.path.join(d, "out.bin"), dtype=np.float32).copy()).reshape(c, 2)
        lse = torch.from_numpy(np.fromfile(os.path.join(d, "lse.bin"), dtype=np.float32).copy())
        a = torch.from_numpy(np.fromfile(os.path.join(d, "dz.bin"), dtype=np.int16 if bf else np.float32).copy())
        dz = (a.view(torch.bfloat16).float() if bf else a).reshape(c, v)
    zf = z.float().requires_grad_()
    t = zf / temp
    logp = torch.log_softmax(t, -1)
    lp = logp.gather(1, y[:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)
    (lp * g[:, 0] + ent * g[:, 1]).sum().backward()
    tol = 1e-5 if dtype == "f32" else 1e-2
    for name, got, want in [("lp", out[:, 0], lp.detach()), ("entropy", out[:, 1], ent.detach()),
                            ("lse", lse, torch.logsumexp(t, -1).detach()), ("dz", dz, zf.grad)]:
        err = ((got - want).abs().max() / want.abs().max().clamp(min=1)).item()
        status = "ok" if err < tol else "FAIL"
        print(f"{dtype} head C{c} V{v} T{temp} {name}: {err:.2e} {status}")
        if err >= tol:
            sys.exit(1)


def decode(exe, dtype, B, H, Hkv, Tk, maxT, D, seed, warp=False):
    g_ = torch.Generator().manual_seed(seed)
    tdt = torch.float32 if dtype == "f32" else torch.bfloat16
    q = torch.randn(B, H, D, generator=g_).to(tdt)
    k = torch.randn(B, Hkv, maxT, D, generator=g_).to(tdt)
    v = torch.randn(B, Hkv, maxT, D, generator=g_).to(tdt)
    mask = torch.zeros(B, Tk)
    mask[0, :3] = MASK  # row 0 left-padded by three slots
    scale = D ** -0.5
    bf = dtype == "bf16"
    raw = lambda t: (t.view(torch.int16).numpy() if bf else t.numpy())
    with tempfile.TemporaryDirectory() as d:
        for name, t in [("q", q), ("k", k), ("v", v)]:
            raw(t.contiguous()).tofile(os.path.join(d, name + ".bin"))
        mask.numpy().tofile(os.path.join(d, "mask.bin"))
        subprocess.run([exe, "decode", d, dtype, *map(str, [B, H, Hkv, Tk, maxT, D]), repr(scale)]
                       + (["warp"] if warp else []), check=True)
        a = torch.from_numpy(np.fromfile(os.path.join(d, "o.bin"), dtype=np.int16 if bf else np.float32).copy())
        o = (a.view(torch.bfloat16).float() if bf else a).reshape(B, H, D)
    rep = lambda t: t.float()[:, :, :Tk].repeat_interleave(H // Hkv, dim=1)  # [B, H, Tk, D]
    z = torch.einsum("bhd,bhjd->bhj", q.float(), rep(k)) * scale + mask[:, None]
    want = torch.einsum("bhj,bhjd->bhd", torch.softmax(z, -1), rep(v))
    err = ((o - want).abs().max() / want.abs().max().clamp(min=1)).item()
    tol = 1e-5 if dtype == "f32" else 1e-2
    status = "ok" if err < tol else "FAIL"
    print(f"{dtype} decode{' warp' if warp else ''} B{B} H{H}/{Hkv} Tk{Tk}/{maxT} D{D} o: {err:.2e} {status}")
    if err >= tol:
        sys.exit(1)


def compare(label, pairs, tol):
    """Each (name, got, want): the largest error relative to max(|want|, 1); exits on a failure."""
    for name, got, want in pairs:
        err = ((got - want).abs().max() / want.abs().max().clamp(min=1)).item()
        status = "ok" if err < tol else "FAIL"
        print(f"{label} {name}: {err:.2e} {status}")
        if err >= tol:
            sys.exit(1)


def rope_append(exe, dtype, b, h, hkv, d, extra, slots, slot, seed):
    g_ = torch.Generator().manual_seed(seed)
    tdt = torch.float32 if dtype == "f32" else torch.bfloat16
    bf = dtype == "bf16"
    xs = (h + 2 * hkv) * d + extra
    x = torch.randn(b, 1, xs, generator=g_).to(tdt)
    ang = torch.rand(b, 1, d // 2, generator=g_) * 6
    cos, sin = ang.cos().to(tdt), ang.sin().to(tdt)
    kc = torch.randn(b, hkv, slots, d, generator=g_).to(tdt)
    vc = torch.randn(b, hkv, slots, d, generator=g_).to(tdt)
    raw = lambda t_: (t_.view(torch.int16).numpy() if bf else t_.numpy())
    with tempfile.TemporaryDirectory() as dd:
        for name, t_ in [("x", x), ("cos", cos), ("sin", sin), ("kc", kc), ("vc", vc)]:
            raw(t_.contiguous()).tofile(os.path.join(dd, name + ".bin"))
        subprocess.run([exe, "rope_append", dd, dtype, *map(str, [b, h, hkv, d, xs, slots, slot])], check=True)
        def back(name, shape):
            a = torch.from_numpy(np.fromfile(os.path.join(dd, name + ".bin"),
                                             dtype=np.int16 if bf else np.float32).copy())
            return (a.view(torch.bfloat16).float() if bf else a).reshape(shape)
        q, kc2, vc2 = back("q", (b, h, 1, d)), back("kc_out", kc.shape), back("vc_out", vc.shape)
    def rot(part, heads):  # [B, 1, heads*D] -> [B, heads, 1, D]
        xh = part.float().reshape(b, 1, heads, d).transpose(1, 2)
        c, s_ = cos.float()[:, None], sin.float()[:, None]
        x1, x2 = xh[..., : d // 2], xh[..., d // 2:]
        return torch.cat([x1 * c - x2 * s_, x2 * c + x1 * s_], -1)
    want_k, want_v = kc.float().clone(), vc.float().clone()
    want_k[:, :, slot] = rot(x[:, :, h * d:(h + hkv) * d], hkv)[:, :, 0]
    want_v[:, :, slot] = x[:, :, (h + hkv) * d:(h + 2 * hkv) * d].float().reshape(b, hkv, d)
    compare(f"{dtype} rope_append B{b} H{h}/{hkv} D{d} slot {slot}/{slots}",
            [("q", q, rot(x[:, :, : h * d], h)), ("kc", kc2, want_k), ("vc", vc2, want_v)],
            1e-5 if dtype == "f32" else 1e-2)


def add_rms(exe, dtype, n, h, seed):
    g_ = torch.Generator().manual_seed(seed)
    tdt = torch.float32 if dtype == "f32" else torch.bfloat16
    bf = dtype == "bf16"
    x, a = torch.randn(n, h, generator=g_).to(tdt), torch.randn(n, h, generator=g_).to(tdt)
    w = (1 + 0.3 * torch.randn(h, generator=g_)).to(tdt)
    raw = lambda t_: (t_.view(torch.int16).numpy() if bf else t_.numpy())
    with tempfile.TemporaryDirectory() as dd:
        for name, t_ in [("x", x), ("a", a), ("w", w)]:
            raw(t_.contiguous()).tofile(os.path.join(dd, name + ".bin"))
        subprocess.run([exe, "add_rms", dd, dtype, str(n), str(h), "1e-5"], check=True)
        def back(name):
            r = torch.from_numpy(np.fromfile(os.path.join(dd, name + ".bin"),
                                             dtype=np.int16 if bf else np.float32).copy())
            return (r.view(torch.bfloat16).float() if bf else r).reshape(n, h)
        got_s, got_y = back("s"), back("y")
    s_ = x + a  # in the dtype, as candle's add rounds
    sf = s_.float()
    normed = (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(tdt)  # HF's LlamaRMSNorm
    want_y = (w * normed).float()
    compare(f"{dtype} add_rms N{n} H{h}", [("sum", got_s, sf), ("y", got_y, want_y)],
            1e-5 if dtype == "f32" else 1e-2)


def sumsq(exe, n, blocks, seed):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    with tempfile.TemporaryDirectory() as d:
        x.numpy().tofile(os.path.join(d, "x.bin"))
        subprocess.run([exe, "sumsq", d, str(n), str(blocks)], check=True)
        parts = np.fromfile(os.path.join(d, "out.bin"), dtype=np.float32)
    got, want = float(parts.astype(np.float64).sum()), float((x.double() ** 2).sum())
    err = abs(got - want) / want
    status = "ok" if err < 1e-6 else "FAIL"
    print(f"sumsq N{n} over {blocks} blocks: {err:.2e} {status}")
    if err >= 1e-6:
        sys.exit(1)


def adamw(exe, n, steps, gs, seed):
    g_ = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=g_)
    grads = torch.randn(steps, n, generator=g_)
    lr, b1, b2, eps, wd = 1e-3, 0.9, 0.999, 1e-8, 0.01
    with tempfile.TemporaryDirectory() as d:
        p0.numpy().tofile(os.path.join(d, "p.bin"))
        grads.numpy().tofile(os.path.join(d, "g.bin"))
        subprocess.run([exe, "adamw", d, str(n), str(steps), *map(repr, [lr, b1, b2, eps, wd, gs])], check=True)
        got = {k: torch.from_numpy(np.fromfile(os.path.join(d, f + ".bin"), dtype=np.float32).copy())
               for k, f in [("p", "p_out"), ("m", "m"), ("v", "v")]}
    p = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, foreach=False)
    for t in range(steps):
        p.grad = grads[t] * gs  # the clipping factor, as clip_grad_norm_ scales the gradient
        opt.step()
    st = opt.state[p]
    # grpo (the CPU's fused step and this kernel alike) forms 1 - beta2 from beta2 in f32:
    # 0.00099998713 for 0.999, which puts ~1.3e-5 on v relative to torch's.
    for k, want, tol in [("p", p.detach(), 1e-5), ("m", st["exp_avg"], 1e-5), ("v", st["exp_avg_sq"], 3e-5)]:
        err = ((got[k] - want).abs().max() / want.abs().max()).item()
        status = "ok" if err < tol else "FAIL"
        print(f"adamw N{n} x{steps} gs{gs} {k}: {err:.2e} {status}")
        if err >= tol:
            sys.exit(1)


if __name__ == "__main__":
    exe = build()
    for dtype in ["f32", "bf16"]:
        case(exe, dtype, 2, 6, 2, 7, 9, 64, 0)     # grouped heads, a key prefix, left padding
        case(exe, dtype, 2, 4, 4, 40, 40, 64, 1)   # square causal, more than one block of queries
        case(exe, dtype, 1, 2, 1, 5, 5, 128, 2)    # head_dim 128
        swiglu(exe, dtype, 7, 300, 3)
        rmsnorm(exe, dtype, 5, 300, 6)
        rope(exe, dtype, 2, 5, 3, 64, 128, 7)      # a view of the joined projection
        head(exe, dtype, 3, 1000, 0.7, 9)          # the LM head's log-softmax, tempered
        decode(exe, dtype, 2, 6, 2, 300, 320, 64, 10)  # one query over a cache view, grouped
        case(exe, dtype, 2, 3, 1, 70, 75, 64, 8)   # several key and query tiles, a partial one
    case(exe, "f32", 2, 4, 2, 9, 9, 16, 4)         # the tiny fixtures' head sizes
    case(exe, "bf16", 2, 4, 2, 9, 11, 32, 5)
    decode(exe, "bf16", 1, 2, 1, 7, 9, 128, 11)
    decode(exe, "f32", 2, 4, 2, 5, 5, 16, 12)
    decode(exe, "bf16", 3, 4, 4, 37, 40, 64, 13)   # one query head per kv head (SmolLM2-1.7B's)
    decode(exe, "bf16", 1, 16, 2, 130, 140, 32, 14)  # eight query heads per kv head
    decode(exe, "f32", 1, 3, 1, 300, 301, 128, 15)
    decode(exe, "bf16", 2, 2, 1, 1, 8, 16, 16)     # a single slot
    # attn_decode_warp: the same cases
    for dtype in ["f32", "bf16"]:
        decode(exe, dtype, 2, 6, 2, 300, 320, 64, 10, warp=True)
    decode(exe, "bf16", 1, 2, 1, 7, 9, 128, 11, warp=True)
    decode(exe, "f32", 2, 4, 2, 5, 5, 16, 12, warp=True)
    decode(exe, "bf16", 3, 4, 4, 37, 40, 64, 13, warp=True)
    decode(exe, "bf16", 1, 16, 2, 130, 140, 32, 14, warp=True)
    decode(exe, "f32", 1, 3, 1, 300, 301, 128, 15, warp=True)
    decode(exe, "bf16", 2, 2, 1, 1, 8, 16, 16, warp=True)
    decode(exe, "bf16", 3, 3, 3, 2, 8, 16, 24, warp=True)  # fewer slots than a warp's groups
    for dtype in ["f32", "bf16"]:
        rope_append(exe, dtype, 3, 6, 2, 64, 0, 10, 7, 18)   # grouped heads, a middle slot
        rope_append(exe, dtype, 2, 4, 4, 32, 96, 5, 0, 19)   # a wider row (xs), the first slot
        add_rms(exe, dtype, 5, 300, 20)
    # attention_tc.cu: the tensor-core kernels (bf16), their mma.sync and shuffles emulated.
    case(exe, "bf16", 2, 6, 2, 7, 9, 64, 0, tc=True)
    case(exe, "bf16", 2, 4, 4, 40, 40, 64, 1, tc=True)
    case(exe, "bf16", 1, 2, 1, 5, 5, 128, 2, tc=True)
    case(exe, "bf16", 2, 3, 1, 70, 75, 64, 8, tc=True)
    case(exe, "bf16", 1, 2, 2, 130, 140, 64, 23, tc=True)  # three query tiles, a key prefix
    case(exe, "bf16", 2, 4, 2, 9, 11, 32, 5, tc=True)
    case(exe, "bf16", 2, 4, 2, 9, 9, 16, 4, tc=True)
    adamw(exe, 1000, 3, 0.7, 17)
    sumsq(exe, 70001, 16, 21)   # more elements than the grid's threads
    sumsq(exe, 100, 16, 22)     # fewer: most blocks write 0
    print("all kernels agree with torch")
