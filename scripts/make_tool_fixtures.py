#!/usr/bin/env python3
"""Golden fixtures for grpo's loss over multi-turn episodes (tool tokens masked), made with TRL.

Usage:
    /opt/peers/venv/bin/python scripts/make_tool_fixtures.py [--out tests/fixtures/grpo_tools]

Reads the tiny Llama of tests/fixtures/grpo/model (made by make_grpo_fixtures.py; not remade here)
and writes (deterministic; rerunning gives byte-identical files):
  cases.json        the fixed batch (2 prompts x 4 episodes whose completions mix the model's tokens
                    with tool tokens), TRL's advantages and, per loss case, the options, TRL's
                    loss and per-token log-probs
  grads.safetensors gradient of each case's loss w.r.t. every model parameter, named
                    "<case name>/<HF parameter name>"

How each number is obtained: TRL's own `GRPOTrainer._compute_loss` on a trainer built over the
tiny model (one per configuration), called with the fixed batch and a `tool_mask` input, as
`_generate_and_score_completions` hands it over when the trainer has `tools=`: 1 on the model's
tokens, 0 on a tool's, right-padded with 1; with `mask_truncated_completions` a truncated row's
tool_mask is zeroed too; `num_items_in_batch` = (completion_mask * tool_mask).sum().
"""

import argparse
import json
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)
torch.use_deterministic_algorithms(True)

import trl  # noqa: E402
from datasets import Dataset  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoTokenizer, LlamaForCausalLM  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.trainer.utils import nanstd  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODEL = os.path.join(ROOT, "tests", "fixtures", "grpo", "model")

PROMPTS = [[5, 9, 13, 17, 21], [6, 10, 14, 18, 22, 26, 30]]
# Each episode's completion as segments (ids, 1 = sampled by the model / 0 = a tool's tokens).
# Tool segments sit at different places; episode 1 and 7 have two; 2 and 5 have none; 3 ends on a
# tool segment (TRL cuts the turn after it: max_completion_length reached); 3 and 4 end without
# EOS (truncated).
EPISODES = [
    [([31, 32, 33], 1), ([60, 61, 62], 0), ([34, 35, 2], 1)],
    [([36, 37], 1), ([58, 59], 0), ([38], 1), ([57, 56, 55], 0), ([39, 40, 2], 1)],
    [([41, 42, 43, 44, 2], 1)],
    [([45, 46, 47, 48], 1), ([54, 53, 52, 51, 50, 49, 48, 47], 0)],
    [([11, 12], 1), ([13, 14, 15, 16], 0), ([17, 18, 19, 20, 21, 22], 1)],
    [([23, 2], 1)],
    [([24, 25, 26, 27], 1), ([28, 29], 0), ([30, 2], 1)],
    [([3, 4], 1), ([7, 8, 9], 0), ([10, 11], 1), ([12, 13], 0), ([2], 1)],
]
LC = 12  # max_completion_length
G = 4
REWARDS = [1.0, 0.0, 0.5, 0.0, 0.2, 1.0, 0.0, 0.7]

# Each case: loss options (epsilon 0.2, epsilon_high 0.28, temperature 1 unless given).
CASES = [
    dict(loss_type="dapo", beta=0.0, num_iterations=1, importance_sampling_level="token"),
    dict(loss_type="grpo", beta=0.04, num_iterations=1, importance_sampling_level="token"),
    dict(loss_type="bnpo", beta=0.0, num_iterations=2, importance_sampling_level="token"),
    dict(loss_type="dapo", beta=0.04, num_iterations=2, importance_sampling_level="token",
         top_entropy_quantile=0.5),
    dict(loss_type="grpo", beta=0.0, num_iterations=2, importance_sampling_level="sequence",
         mask_truncated_completions=True, entropy_coef=0.01),
]


def f32(x):
    """A float list (nested) as the shortest decimals that identify its float32 values."""
    if isinstance(x, list):
        return [f32(v) for v in x]
    return float(str(np.float32(x)))


def episodes():
    comps = [[t for ids, _ in ep for t in ids] for ep in EPISODES]
    tool = [[s for ids, s in ep for _ in ids] for ep in EPISODES]
    assert all(len(c) <= LC for c in comps) and all(0 not in c for c in comps)
    return comps, tool


def trl_advantages():
    """TRL's group advantages (scale_rewards "group") of one reward function."""
    r = torch.tensor(REWARDS, dtype=torch.float32)
    mean = torch.nanmean(r.view(-1, G), dim=1).repeat_interleave(G)
    std = nanstd(r.view(-1, G), dim=1).repeat_interleave(G)
    return torch.nan_to_num((r - mean) / (std + 1e-4), nan=0.0)


def make_trainer(model, tok, tmp, **kw):
    kw = {"epsilon": 0.2, "epsilon_high": 0.28, **kw}
    args = GRPOConfig(
        output_dir=tmp, per_device_train_batch_size=8, num_generations=G, max_completion_length=LC,
        use_cpu=True, report_to="none", bf16=False, logging_steps=1, gradient_checkpointing=False,
        **kw,
    )
    ds = Dataset.from_dict({"prompt": ["a"] * 8})
    return GRPOTrainer(model=model, reward_funcs=[lambda completions, **k: [0.0] * len(completions)],
                       args=args, train_dataset=ds, processing_class=tok)


def case_name(c):
    name = "{loss_type}-b{beta}-it{num_iterations}-{importance_sampling_level}".format(**c)
    if c["mask_truncated_completions"]:
        name += "-masktrunc"
    for key, tag in (("top_entropy_quantile", "teq"), ("entropy_coef", "ent")):
        if key in c:
            name += f"-{tag}{c[key]}"
    return name


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "fixtures", "grpo_tools"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(os.path.join(ROOT, "tests", "fixtures", "smollm2"))
    comps, tool = episodes()
    t = lambda x, dt=torch.long: torch.tensor(x, dtype=dt)  # noqa: E731
    lp = max(len(p) for p in PROMPTS)
    prompt_ids = [[0] * (lp - len(PROMPTS[i // G])) + PROMPTS[i // G] for i in range(len(comps))]
    prompt_mask = [[0] * (lp - len(PROMPTS[i // G])) + [1] * len(PROMPTS[i // G]) for i in range(len(comps))]
    comp_ids = [c + [0] * (LC - len(c)) for c in comps]
    comp_mask = [[1] * len(c) + [0] * (LC - len(c)) for c in comps]
    tool_mask = [m + [1] * (LC - len(m)) for m in tool]  # TRL pads tool_mask with 1
    truncated = torch.tensor([c[-1] != 2 for c in comps])
    adv = trl_advantages()
    out = {
        "trl_version": trl.__version__, "prompts": PROMPTS, "completions": comps, "tool_mask": tool,
        "max_completion_length": LC, "rewards": REWARDS, "advantages": f32(adv.tolist()),
        "truncated": truncated.tolist(), "cases": [],
    }
    # A reference model: the same architecture with perturbed weights (as make_grpo_fixtures.py).
    ref = LlamaForCausalLM.from_pretrained(MODEL, attn_implementation="eager")
    torch.manual_seed(1)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    # Old log-probs = current + noise, large enough that many ratios are clipped.
    old_noise = torch.randn(8, LC, generator=torch.Generator().manual_seed(2)) * 0.3
    grads = {}
    with tempfile.TemporaryDirectory() as tmp:
        for c in CASES:
            c = {"temperature": 1.0, "mask_truncated_completions": False, **c}
            name = case_name(c)
            policy = LlamaForCausalLM.from_pretrained(MODEL, attn_implementation="eager")
            policy.train()
            trainer = make_trainer(policy, tok, tmp, **c)
            cm, tm = t(comp_mask), t(tool_mask)
            if c["mask_truncated_completions"]:  # as _generate_and_score_completions does
                cm = cm * (~truncated).unsqueeze(1).long()
                tm = tm * (~truncated).unsqueeze(1).long()
            loss_mask = cm * tm
            inputs = {
                "prompt_ids": t(prompt_ids), "prompt_mask": t(prompt_mask),
                "completion_ids": t(comp_ids), "completion_mask": cm, "tool_mask": tm,
                "advantages": adv.clone(), "num_items_in_batch": loss_mask.sum(),
            }
            input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
            attn = torch.cat([inputs["prompt_mask"], cm], 1)  # tool tokens are attended
            with torch.no_grad():
                cur, _, _ = trainer._get_per_token_logps_and_entropies(policy, input_ids, attn, LC)
                ref_trainer = make_trainer(ref, tok, tmp, **c)
                ref_lp, _, _ = ref_trainer._get_per_token_logps_and_entropies(ref, input_ids, attn, LC)
            clipped = None
            if c["num_iterations"] == 2:
                old = (cur + old_noise).detach()
                inputs["old_per_token_logps"] = old
                # Tokens whose ratio is clipped (TRL's is_region_clipped), sampled and tool ones.
                lr = cur - old
                if c["importance_sampling_level"] == "sequence":
                    lr = ((lr * loss_mask).sum(-1) / loss_mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
                r, a_ = torch.exp(lr), adv.unsqueeze(1)
                region = (((r < 0.8) & (a_ < 0)) | ((r > 1.28) & (a_ > 0))).expand(8, LC)
                clipped = {"sampled": int((region & (loss_mask > 0)).sum()),
                           "tool": int((region & (cm > 0) & (tm == 0)).sum())}
            if c["beta"] > 0:
                inputs["ref_per_token_logps"] = ref_lp.detach()
            policy.zero_grad()
            trainer.current_gradient_accumulation_steps = 1  # one micro-batch per optimizer step
            loss = trainer._compute_loss(policy, inputs)
            loss.backward()
            for n, p in policy.named_parameters():
                grads[f"{name}/{n}"] = p.grad.detach().clone().contiguous()
            entry = dict(c)
            entry.update({
                "name": name,
                "loss": f32(loss.item()),
                "completion_mask": cm.tolist(),
                "loss_mask": loss_mask.tolist(),
                "logps": f32(cur.tolist()),
                "old_logps": f32(inputs["old_per_token_logps"].tolist()) if clipped is not None else None,
                "ref_logps": f32(ref_lp.tolist()) if c["beta"] > 0 else None,
                "num_items_in_batch": int(loss_mask.sum()),
                "clipped_tokens": clipped,
            })
            out["cases"].append(entry)
    save_file(grads, os.path.join(a.out, "grads.safetensors"))
    with open(os.path.join(a.out, "cases.json"), "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote {len(out['cases'])} loss cases to {a.out}")


if __name__ == "__main__":
    main()
