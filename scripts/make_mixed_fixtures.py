#!/usr/bin/env python3
"""Reference for grpo's CPU mixed precision (`dtype = "bf16"` on a CPU with AVX-512).

Usage:
    /opt/peers/venv/bin/python scripts/make_mixed_fixtures.py [--out tests/fixtures/mixed]

grpo keeps f32 weights and activations and rounds only the inputs of each projection's products
to bf16, summing in f32: forward `y = bf16(x) bf16(W)^T`, backward `dX = bf16(dY) bf16(W)` and
`dW = bf16(dY)^T bf16(X)`. This script computes the same thing with torch in f32 (every
`nn.Linear` of the tiny Llama fixture, the tied LM head included, replaced by an autograd function
that rounds its operands so), and writes the logits, the loss and every parameter's gradient
for the batch and loss of `tests/tiny_models.rs` (`padded_batch`, `loss`: temperature 0.7,
weights `1 + 0.1 i` on valid next-token log-probs). It also writes the same in plain f32, so the
Rust test can check that it tells the two apart.

Writes `llama_bf16.safetensors` under --out (tensors: `logits`, `loss`, `grad.<name>`, and
`f32.logits`, `f32.loss`, `f32.grad.<name>`). Deterministic: 1 thread, fixed inputs.
"""

import argparse
import os

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bf(t):
    return t.to(torch.bfloat16).to(torch.float32)


class RoundedLinear(torch.autograd.Function):
    """y = bf16(x) bf16(W)^T (+ b); dX = bf16(dY) bf16(W); dW = bf16(dY)^T bf16(X)."""

    @staticmethod
    def forward(ctx, x, w, b):
        xr, wr = bf(x), bf(w)
        ctx.save_for_backward(xr, wr)
        ctx.has_bias = b is not None
        y = xr @ wr.t()
        return y + b if b is not None else y

    @staticmethod
    def backward(ctx, gy):
        xr, wr = ctx.saved_tensors
        g = bf(gy)
        gx = g @ wr
        g2 = g.reshape(-1, g.shape[-1])
        gw = g2.t() @ xr.reshape(-1, xr.shape[-1])
        gb = gy.reshape(-1, gy.shape[-1]).sum(0) if ctx.has_bias else None
        return gx, gw, gb


def run(model, rounded):
    if rounded:
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.forward = lambda x, m=m: RoundedLinear.apply(x, m.weight, m.bias)
    ids = torch.tensor([[0, 0, 11, 200, 47, 3, 99], [5, 6, 7, 8, 9, 10, 250]])
    pos = torch.tensor([[0, 0, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6]])
    valid = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1] * 7])
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=valid, position_ids=pos).logits  # [B, T, V]
    lp = torch.log_softmax(logits[:, :-1] / 0.7, dim=-1)
    lp = lp.gather(-1, ids[:, 1:, None])[..., 0]  # [B, T-1]
    b, t = lp.shape
    w = torch.zeros(b, t)
    for i in range(b * t):
        r, c = divmod(i, t)
        if valid[r, c + 1] and valid[r, c]:
            w[r, c] = 1.0 + 0.1 * i
    loss = (lp * w).sum()
    loss.backward()
    out = {"logits": logits.detach().contiguous(), "loss": loss.detach().reshape(1)}
    for name, p in model.named_parameters():
        out["grad." + name] = p.grad.detach().contiguous()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "tests/fixtures/mixed"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    src = os.path.join(ROOT, "tests/fixtures/tiny/llama")
    tensors = {}
    for rounded, prefix in [(True, ""), (False, "f32.")]:
        model = AutoModelForCausalLM.from_pretrained(
            src, torch_dtype=torch.float32, attn_implementation="eager"
        )
        model.eval()  # no dropout; gradients still flow
        for k, v in run(model, rounded).items():
            tensors[prefix + k] = v
    d = (tensors["logits"] - tensors["f32.logits"]).abs().max().item()
    assert d > 1e-4, f"bf16 rounding changed the logits by only {d}"
    os.makedirs(args.out, exist_ok=True)
    save_file(tensors, os.path.join(args.out, "llama_bf16.safetensors"))
    print(f"wrote {len(tensors)} tensors; bf16 vs f32 logits differ by up to {d:.3g}")


if __name__ == "__main__":
    main()
