#!/usr/bin/env python3
"""Golden fixtures for grpo's GRPO math, made with TRL and torch.

Usage:
    /opt/peers/venv/bin/python scripts/make_grpo_fixtures.py [--out tests/fixtures/grpo]

Writes (deterministic; rerunning gives byte-identical files):
  model/{config.json, model.safetensors}   a tiny random Llama (vocab 64, hidden 16, 2 layers)
  cases.json        the fixed batch, rewards, TRL's advantages and, per loss case (grpo, bnpo, dr_grpo,
                    dapo, cispo, sapo), the options,
                    TRL's loss and per-token log-probs
  grads.safetensors gradient of each case's loss w.r.t. every model parameter, named
                    "<case name>/<HF parameter name>"
  adamw.json        torch.optim.AdamW with clip_grad_norm_ over 3 steps; transformers' LR schedules

How each number is obtained:
  * loss, log-probs, gradients: TRL's own `GRPOTrainer._compute_loss` on a trainer built over the
    tiny model (one trainer per configuration), called with the fixed batch.
  * advantages: TRL computes them inline in `_generate_and_score_completions`, which also samples;
    the script applies the same steps with TRL's own `nanstd` helper (weighted `nansum` of reward
    functions, unscorable rows NaN, group `nanmean`, group or batch `nanstd`, `/ (std + 1e-4)`
    unless scale_rewards == "none", then `nan_to_num`); likewise TRL's
    `multi_objective_aggregation = "normalize_then_sum"` branch (per-function group normalization,
    weighted nansum, batch normalization).
"""

import argparse
import json
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

torch.set_num_threads(2)
torch.use_deterministic_algorithms(True)

from datasets import Dataset  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, get_scheduler  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.trainer.utils import nanstd  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def tiny_model(out_dir):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=4, max_position_embeddings=64,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.8, 1.2)
    model.save_pretrained(out_dir, safe_serialization=True)
    return model


def batch():
    """P=2 prompts x G=4 completions; prompts left-padded (TRL), completions right-padded."""
    prompts = [[5, 9, 13, 17, 21], [6, 10, 14, 18, 22, 26, 30]]
    comps = [
        [31, 32, 33, 2],            # ended by EOS
        [34, 35, 36, 37, 38, 39],   # hit max length (truncated)
        [40, 41, 2],
        [42, 43, 44, 45, 46, 47],   # truncated
        [48, 49, 50, 51, 2],
        [52, 2],
        [53, 54, 55, 56, 57, 58],   # truncated
        [59, 60, 61, 62, 2],
    ]
    lc = 6
    lp = max(len(p) for p in prompts)
    prompt_ids, prompt_mask, comp_ids, comp_mask = [], [], [], []
    for i, c in enumerate(comps):
        p = prompts[i // 4]
        prompt_ids.append([0] * (lp - len(p)) + p)
        prompt_mask.append([0] * (lp - len(p)) + [1] * len(p))
        comp_ids.append(c + [0] * (lc - len(c)))
        comp_mask.append([1] * len(c) + [0] * (lc - len(c)))
    return prompts, comps, prompt_ids, prompt_mask, comp_ids, comp_mask, lc


# Per-function rewards [8, 2]; weights [1.0, 0.5]. Row 5 has one missing value; group 1's
# combined rewards are constant except for that row (exercises NaN handling).
REWARDS = [
    [1.0, 0.1], [0.0, 0.0], [1.0, 0.0], [0.0, 0.1],
    [0.5, 0.2], [float("nan"), 0.2], [0.5, 0.2], [0.5, 0.2],
]
WEIGHTS = [1.0, 0.5]


def trl_advantages(scale):
    r = torch.tensor(REWARDS, dtype=torch.float32)
    w = torch.tensor(WEIGHTS)
    unscorable = torch.isnan(r).all(dim=1)
    rewards = (r * w.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    g = 4
    mean = torch.nanmean(rewards.view(-1, g), dim=1).repeat_interleave(g)
    if scale in ("group", "none"):
        std = nanstd(rewards.view(-1, g), dim=1).repeat_interleave(g)
    else:
        std = nanstd(rewards).expand_as(rewards)
    adv = rewards - mean
    if scale != "none":
        adv = adv / (std + 1e-4)
    return torch.nan_to_num(adv, nan=0.0), rewards


def trl_normalize_then_sum():
    """TRL's multi_objective_aggregation == "normalize_then_sum" steps (GDPO), with TRL's nanstd."""
    r = torch.tensor(REWARDS, dtype=torch.float32)
    w = torch.tensor(WEIGHTS)
    g, f = 4, r.shape[1]
    unscorable = torch.isnan(r).all(dim=1)
    grouped = r.view(-1, g, f)
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = nanstd(grouped, dim=1, keepdim=True)
    reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, f)
    rewards = (reward_k * w.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    std = nanstd(rewards).expand_as(rewards)
    adv = (rewards - torch.nanmean(rewards)) / (std + 1e-4)
    return torch.nan_to_num(adv, nan=0.0)


def make_trainer(model, tok, tmp, **kw):
    kw = {"epsilon": 0.2, "epsilon_high": 0.28, **kw}
    args = GRPOConfig(
        output_dir=tmp, per_device_train_batch_size=8, num_generations=4, max_completion_length=6,
        use_cpu=True, report_to="none", bf16=False, logging_steps=1, gradient_checkpointing=False,
        **kw,
    )
    ds = Dataset.from_dict({"prompt": ["a"] * 8})
    return GRPOTrainer(model=model, reward_funcs=[lambda completions, **k: [0.0] * len(completions)],
                       args=args, train_dataset=ds, processing_class=tok)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "fixtures", "grpo"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    model_dir = os.path.join(a.out, "model")
    model = tiny_model(model_dir)
    for f in ("generation_config.json",):
        p = os.path.join(model_dir, f)
        if os.path.exists(p):
            os.remove(p)
    tok = AutoTokenizer.from_pretrained(os.path.join(ROOT, "tests", "fixtures", "smollm2"))
    prompts, comps, prompt_ids, prompt_mask, comp_ids, comp_mask, lc = batch()
    t = lambda x, dt=torch.long: torch.tensor(x, dtype=dt)  # noqa: E731
    adv_group, rewards = trl_advantages("group")
    out = {
        "prompts": prompts, "completions": comps, "max_completion_length": lc,
        "rewards_per_func": [[None if x != x else x for x in row] for row in REWARDS],
        "reward_weights": WEIGHTS,
        "rewards": [None if x != x else x for x in rewards.tolist()],
        "advantages": {s: trl_advantages(s)[0].tolist() for s in ("group", "batch", "none")},
        "advantages_normalize_then_sum": trl_normalize_then_sum().tolist(),
        "cases": [],
    }
    # A reference model: the same architecture with perturbed weights.
    ref = LlamaForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    torch.manual_seed(1)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    grads = {}
    noise_gen = torch.Generator().manual_seed(2)
    old_noise = torch.randn(8, lc, generator=noise_gen) * 0.05
    cases = []
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        for beta in (0.0, 0.04):
            for iters in (1, 2):
                for level in ("token", "sequence"):
                    cases.append(dict(loss_type=loss_type, beta=beta, num_iterations=iters,
                                      importance_sampling_level=level, temperature=1.0,
                                      mask_truncated_completions=False))
    cases.append(dict(loss_type="dapo", beta=0.04, num_iterations=1, importance_sampling_level="token",
                      temperature=0.7, mask_truncated_completions=False))
    cases.append(dict(loss_type="dapo", beta=0.04, num_iterations=2, importance_sampling_level="token",
                      temperature=1.0, mask_truncated_completions=True))
    # TRL 1.16's cispo (epsilon_high is its epsilon_max; 1.02 so that some weights are clipped)
    # and sapo (its default temperatures 1.0 / 1.05).
    for loss_type, extra in (("cispo", dict(epsilon_high=1.02)), ("sapo", {})):
        for beta in (0.0, 0.04):
            for iters in (1, 2):
                for level in ("token", "sequence"):
                    cases.append(dict(loss_type=loss_type, beta=beta, num_iterations=iters,
                                      importance_sampling_level=level, temperature=1.0,
                                      mask_truncated_completions=False, **extra))
    # TRL 1.16's token masks (top_entropy_quantile, off_policy_mask_threshold), the entropy bonus,
    # and the luspo and vespo losses.
    base = dict(temperature=1.0, mask_truncated_completions=False)
    for extra in (
        dict(loss_type="dapo", beta=0.04, num_iterations=2, importance_sampling_level="token",
             top_entropy_quantile=0.5),
        dict(loss_type="grpo", beta=0.0, num_iterations=1, importance_sampling_level="token",
             top_entropy_quantile=0.2),
        dict(loss_type="dapo", beta=0.0, num_iterations=1, importance_sampling_level="token",
             entropy_coef=0.01),
        dict(loss_type="grpo", beta=0.04, num_iterations=2, importance_sampling_level="token",
             top_entropy_quantile=0.5, entropy_coef=0.01),
        dict(loss_type="dapo", beta=0.04, num_iterations=2, importance_sampling_level="token",
             off_policy_mask_threshold=0.0),
        dict(loss_type="grpo", beta=0.0, num_iterations=2, importance_sampling_level="sequence",
             off_policy_mask_threshold=0.0),
        dict(loss_type="vespo", beta=0.0, num_iterations=1, importance_sampling_level="token"),
        dict(loss_type="vespo", beta=0.0, num_iterations=2, importance_sampling_level="token"),
        dict(loss_type="vespo", beta=0.04, num_iterations=2, importance_sampling_level="token"),
        dict(loss_type="luspo", beta=0.0, num_iterations=2, importance_sampling_level="sequence"),
        dict(loss_type="luspo", beta=0.04, num_iterations=1, importance_sampling_level="sequence"),
        dict(loss_type="luspo", beta=0.0, num_iterations=2, importance_sampling_level="token"),
    ):
        cases.append({**base, **extra})
    with tempfile.TemporaryDirectory() as tmp:
        for c in cases:
            name = "{loss_type}-b{beta}-it{num_iterations}-{importance_sampling_level}-T{temperature}".format(**c)
            if c["mask_truncated_completions"]:
                name += "-masktrunc"
            for key, tag in (("top_entropy_quantile", "teq"), ("entropy_coef", "ent"),
                             ("off_policy_mask_threshold", "opm")):
                if key in c:
                    name += f"-{tag}{c[key]}"
            policy = LlamaForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
            policy.train()
            kw = dict(c)
            trainer = make_trainer(policy, tok, tmp, **kw)
            cm = t(comp_mask)
            if c["mask_truncated_completions"]:
                truncated = torch.tensor([len(x) == lc and x[-1] != 2 for x in comps])
                cm = cm * (~truncated).unsqueeze(1).long()
            inputs = {
                "prompt_ids": t(prompt_ids), "prompt_mask": t(prompt_mask),
                "completion_ids": t(comp_ids), "completion_mask": cm,
                "advantages": adv_group.clone(),
                "num_items_in_batch": cm.sum(),
            }
            input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
            attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
            with torch.no_grad():
                cur, _, _ = trainer._get_per_token_logps_and_entropies(policy, input_ids, attn, lc)
                ref_trainer = make_trainer(ref, tok, tmp, **kw)
                ref_lp, _, _ = ref_trainer._get_per_token_logps_and_entropies(ref, input_ids, attn, lc)
            if c["num_iterations"] == 2:
                inputs["old_per_token_logps"] = (cur + old_noise).detach()
            if c["beta"] > 0:
                inputs["ref_per_token_logps"] = ref_lp.detach()
            policy.zero_grad()
            # Set by Trainer's training loop; one micro-batch per optimizer step here.
            trainer.current_gradient_accumulation_steps = 1
            loss = trainer._compute_loss(policy, inputs)
            loss.backward()
            for n, p in policy.named_parameters():
                grads[f"{name}/{n}"] = p.grad.detach().clone().contiguous()
            entry = dict(c)
            entry.update({
                "name": name,
                "loss": loss.item(),
                "completion_mask": cm.tolist(),
                "logps": cur.tolist(),
                "old_logps": inputs["old_per_token_logps"].tolist() if "old_per_token_logps" in inputs else None,
                "ref_logps": ref_lp.tolist() if c["beta"] > 0 else None,
                "num_items_in_batch": int(cm.sum()),
            })
            out["cases"].append(entry)
        # Adaptive entropy control: TRL's controller over three calls on the fixed batch (one
        # optimizer step each), the coefficient starting at 0.01 and the target above the entropy.
        policy = LlamaForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
        policy.train()
        ada = dict(loss_type="dapo", beta=0.0, num_iterations=1, importance_sampling_level="token",
                   use_adaptive_entropy=True, entropy_coef=0.01, entropy_coef_delta=0.005,
                   entropy_coef_max=0.02, entropy_target=100.0)
        trainer = make_trainer(policy, tok, tmp, **ada)
        trainer.current_gradient_accumulation_steps = 1
        cm = t(comp_mask)
        inputs = {
            "prompt_ids": t(prompt_ids), "prompt_mask": t(prompt_mask),
            "completion_ids": t(comp_ids), "completion_mask": cm,
            "advantages": adv_group.clone(), "num_items_in_batch": cm.sum(),
        }
        losses, coefs = [], []
        for _ in range(4):
            losses.append(trainer._compute_loss(policy, inputs).item())
            coefs.append(trainer.entropy_coef)
        out["adaptive_entropy"] = dict(ada, losses=losses, coefs=coefs,
                                       last_entropy=trainer._last_world_entropy)
    save_file(grads, os.path.join(a.out, "grads.safetensors"))
    with open(os.path.join(a.out, "cases.json"), "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)

    # AdamW + clipping, and LR schedules.
    torch.manual_seed(3)
    shapes = [(4, 3), (5,), (2, 2, 2)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    init = [p.detach().clone().tolist() for p in params]
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                            foreach=False, fused=False)
    steps = []
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape)
        grads_before = [p.grad.detach().clone().tolist() for p in params]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=0.5)
        opt.step()
        steps.append({
            "grads": grads_before, "total_norm": norm.item(),
            "params": [p.detach().clone().tolist() for p in params],
            "exp_avg": [opt.state[p]["exp_avg"].tolist() for p in params],
            "exp_avg_sq": [opt.state[p]["exp_avg_sq"].tolist() for p in params],
        })
    sched = {}
    for kind in ("constant", "constant_with_warmup", "linear", "cosine"):
        o = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
        s = get_scheduler(kind, o, num_warmup_steps=3, num_training_steps=10)
        lrs = []
        for _ in range(10):
            lrs.append(o.param_groups[0]["lr"])
            o.step()
            s.step()
        sched[kind] = lrs
    with open(os.path.join(a.out, "adamw.json"), "w") as f:
        json.dump({"shapes": shapes, "init": init, "lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                   "weight_decay": 0.01, "max_norm": 0.5, "steps": steps,
                   "schedules": {"warmup": 3, "total": 10, "lr": sched}}, f, indent=1)
    print(f"wrote {len(out['cases'])} loss cases to {a.out}")


if __name__ == "__main__":
    main()
