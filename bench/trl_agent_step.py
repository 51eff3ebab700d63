#!/usr/bin/env python3
"""TRL 1.16's GRPOTrainer with `tools=[calculator]`: the peer of grpo's agent step (issue 56).

Run with the peer venv (/opt/peers/venv/bin/python); bench/agent_vs_trl.sh runs it right after
grpo's agent step, from the same start weights, on the same prompts, in the same shape:

  /opt/peers/venv/bin/python bench/trl_agent_step.py --model CKPT --prompts-file PROMPTS.jsonl \
      --steps 4 [--bf16] [--threads 2]

What it matches in grpo's run (examples/configs/agent_calculator.toml with bench/agent_step.sh's
flags):
- the model: `--model` is an HF directory; bench/agent_vs_trl.sh passes the checkpoint grpo wrote
  after its supervised warm-up (the model then calls its tool), and grpo's step starts from the
  same checkpoint with no warm-up of its own;
- the tool: the same Python function (`--tool`, default bench/agent_tools/fast.py:calculator,
  grpo's `tools=`), TRL's `tools=[calculator]`, `max_tool_calling_iterations=3`;
- the chat template: examples/templates/chatml_tools.jinja as the tokenizer's chat_template (with
  one addition, below);
- the prompts: grpo's built-in task (three-digit multiplications, phrasings of
  crates/grpo/src/data.rs `arithmetic::phrase`) as a user message. `--prompts-file` (JSONL of
  `{"prompt": question, "answer": "..."}`, in step order) gives the exact prompts grpo sampled,
  which bench/agent_vs_trl.sh extracts from grpo's completions.jsonl; TRL takes them in order
  (`shuffle_dataset=False`: step k gets rows 8k..8k+7). Without it the script makes problems of
  the same kind from `--seed` (same distribution, not the same problems);
- the rewards: grpo's built-in `correct` (1 when the last number of the final assistant message
  equals the answer; grpo's `last_number_span` and tolerance) and `format` (0.1 when correct and
  the final message is a bare integer or one arithmetic equation ending in it), each weight 1;
- the shape: 8 prompts x 8 episodes a step (one generation round, one optimizer step), sampling at
  temperature 1 (top_p 1, top_k 0), loss_type dapo, beta 0 (no reference model), lr 1e-5 cosine
  over `--steps`, AdamW without weight decay, clip 1.0, epsilon 0.2, one iteration, seed 42;
- the precision: `--bf16` is TRL's bf16 mixed precision (torch's CPU autocast to bf16: weights
  and AdamW in f32), the counterpart of grpo's `dtype = auto`, which takes bf16 products on a CPU
  with AVX512-BF16 (bench/agent_vs_trl.sh passes it when grpo's log says so); without it, f32.

What differs, because TRL has no such setting:
- TRL's `max_completion_length` is the whole episode's budget (the model's turns and the tool
  results), and by default also each turn's `max_new_tokens`. grpo caps each turn at
  `max_completion_length` (48) and the episode at `max_episode_tokens` (unset: 48 x (3 + 1) =
  192). This script sets TRL's `max_completion_length` to the episode's 192
  (`--max-completion-length`) and each turn's `max_new_tokens` to 48 through
  `generation_kwargs` (`--max-turn-tokens`; 0: TRL's default, the episode's budget), so both cap
  a turn and an episode alike.
- grpo ends a hermes turn at `</tool_call>` and inserts the turn's end (`<|im_end|>`) with the
  tool result; TRL samples until EOS, so TRL's model writes the `<|im_end|>` itself (one more
  sampled token per call; the warmed-up model does).
- grpo leaves groups whose rewards are all equal out of the update (`drop_zero_std_groups =
  true` in the example's config); TRL runs its forward and backward over all 64 episodes (their
  advantage is 0). Pass `--drop_zero_std_groups=false` to grpo through GRPO_ARGS for the same work.
- TRL runs the tools in its own process, one call after another, after the whole batch's turn;
  grpo runs them in `tool_max_concurrency` (4) processes while the other rows decode.
- TRL trains with gradient checkpointing (its default; faster and smaller here, see the peer
  README); grpo does not by default.

What TRL 1.16 needed to parse and render tool calls for SmolLM2 with this template:
1. A `response_template` on the tokenizer. GRPOTrainer parses each turn with
   `tokenizer.parse_response(ids, prefix=prompt_ids, tools=tools)` (transformers >= 5.13's
   new-style parser) and only runs tools found in the parsed message's `tool_calls`. When the
   tokenizer has none, it calls `trl.chat_template_utils.add_response_schema`, which only knows
   the templates of a few families (Qwen, Llama 3.x, GLM, GPT-OSS, ...) and raises "Unrecognized
   chat template" for ours. The script sets `HERMES_CHATML_RESPONSE_TEMPLATE` below: TRL's own
   `qwen3_template` (the same ChatML turns and Hermes `<tool_call>{json}</tool_call>` blocks)
   without its `<think>` field (SmolLM2 never thinks). Then TRL skips add_response_schema.
2. A template that renders an assistant message's `tool_calls`. GRPOTrainer refuses a template
   unless `supports_tool_calling` finds a tool call's name and arguments in the rendering of
   `user -> assistant(tool_calls) -> tool`, and renders such a conversation again to find the
   tokens that follow a tool-calling turn (`_get_tool_suffix_ids`). chatml_tools.jinja renders
   only an assistant message's `content` (grpo never re-renders the model's turns: they are
   tokens), so the script adds, in the assistant branch, each of `message.tool_calls` as
   `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` after the content (the
   format the template's system prompt asks for). A message without `tool_calls` (every prompt,
   every tool message) renders byte for byte as before, so prompts and the inserted tool turns
   are the tokens grpo uses: after the model's `<|im_end|>`,
   `\\n<|im_start|>user\\n<tool_response>\\n{result}\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n`.
   The template stays prefix-preserving (`is_chat_template_prefix_preserving`), so TRL keeps it
   instead of swapping in a training template of its own.
3. The same prompt text as grpo's: grpo keeps JSON objects in their order (serde_json's
   `preserve_order`, since 2026-12-04), so its prompt lists each tool schema as transformers'
   `get_json_schema` builds it (`{"type": "function", "function": {"name": ...`), as TRL's does;
   the script checks that TRL's prompt equals the plain template's rendering of the schema (what
   grpo renders). `--sort-tool-keys 1` renders `tool | tojson(sort_keys=True)` instead, for a
   grpo built before that change (which sorted the keys).
4. Nothing else: `<|im_end|>` is the tokenizer's EOS and pad token, so each turn stops there, and
   TRL's tool loop concatenates token ids (prompt + turns + tool suffix) without re-tokenizing.

Per step it prints one JSON line (phases timed by wall clock here, as trl_grpo_bench.py does):
  step_s      the optimizer step (rollout + update)
  gen_s       model.generate() over all turns (TRL's _generate_single_turn, called once per turn)
  tool_s      time inside the tool function
  reward_s    reward functions
  rollout_s   TRL's _generate_and_score_completions (turns, tools, parsing, rewards)
  train_s     step_s - rollout_s (forward, loss, backward, clip, AdamW)
  turns_per_episode, tool_calls_per_episode (TRL's tools/call_frequency), episodes_calling_tools,
  tool_failure_frequency, reward, correct, format, completion mean length (model tokens), ...
and a summary line at the end (medians over steps, and over steps after the first).
"""
import argparse
import functools
import importlib.util
import json
import os
import random
import re
import resource
import statistics
import sys
import time
from collections import defaultdict

import torch
import transformers
import trl
from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback
from transformers.trainer_callback import PrinterCallback
from transformers.utils import get_json_schema
from trl import GRPOConfig, GRPOTrainer
from trl.chat_template_utils import (
    is_chat_template_prefix_preserving,
    parse_response,
    supports_tool_calling,
)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PEERS_SRC = os.environ.get("PEERS_SRC", os.path.join(ROOT, "..", "shared", "bench", "peers"))

# TRL's qwen3_template (trl/chat_template_utils.py) without the <think> field: ChatML assistant
# turns with Hermes tool calls, `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`.
HERMES_CHATML_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {
            "close_pattern": r"<\|im_end\|>\s*",
            "content": "text",
        },
    },
}

# chatml_tools.jinja's generic turn, and the same turn with an assistant's tool calls rendered.
_TURN = "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
_TURN_WITH_CALLS = (
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{%- if message['role'] == 'assistant' and message.tool_calls is defined and message.tool_calls %}"
    "{%- for call in message.tool_calls %}"
    "{%- set f = call.function if call.function is defined else call %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' }}"
    "{%- if f.arguments is string %}{{- f.arguments }}{%- else %}{{- f.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
)


_TOOL_JSON = "tool | tojson }}"


def trl_chat_template(path, sort_tool_keys=True):
    """chatml_tools.jinja with an assistant message's `tool_calls` rendered, and (sort_tool_keys)
    each tool's schema written with sorted keys, as grpo writes it (see the docstring)."""
    src = open(path).read()
    if src.count(_TURN) != 1:
        raise SystemExit(f"{path}: expected its generic turn line once, to add tool_calls to it: {_TURN}")
    src = src.replace(_TURN, _TURN_WITH_CALLS)
    if sort_tool_keys:
        if src.count(_TOOL_JSON) != 1:
            raise SystemExit(f"{path}: expected `{_TOOL_JSON}` once, to sort the schema's keys")
        src = src.replace(_TOOL_JSON, "tool | tojson(sort_keys=True) }}")
    return src


def sorted_json(x):
    return json.loads(json.dumps(x, sort_keys=True))


def load_tool(spec):
    """`path.py:function` (grpo's `tools =` syntax) or `module:function`."""
    target, _, name = spec.rpartition(":")
    if target.endswith(".py"):
        mod_spec = importlib.util.spec_from_file_location(os.path.basename(target)[:-3] + "_tool", target)
        mod = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(mod)
    else:
        mod = importlib.import_module(target)
    return getattr(mod, name)


# --- grpo's built-in task and rewards (crates/grpo/src/data.rs, crates/grpo/src/rewards/) ---------

def phrase(a, b, k):
    plain = [
        f"What is {a} * {b}? Answer with just the number.",
        f"Compute {a} * {b}. Reply with only the number.",
        f"Calculate {a} * {b}. Give only the final number.",
        f"{a} * {b} = ? Answer with just the number.",
    ]
    word = [
        f"A box holds {b} pencils. How many pencils are in {a} boxes? Answer with just the number.",
        f"Each of {a} students brings {b} cookies. How many cookies are there? Answer with just the number.",
        f"A bus has {a} rows of {b} seats. How many seats are there? Reply with only the number.",
        f"Mia saves {b} coins a day for {a} days. How many coins does she save? Give only the number.",
    ]
    return plain[k] if k < 4 else word[k - 4]


def make_problems(n, seed):
    """Three-digit multiplications phrased as grpo's task phrases them (not grpo's RNG: the same
    kind of problems, not the same ones; pass --prompts-file for those)."""
    rng = random.Random(seed)
    seen, out = set(), []
    while len(out) < n:
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        out.append({"prompt": phrase(a, b, rng.randrange(8)), "answer": str(a * b)})
    return out


def last_number(text):
    """grpo's last_number_span: optional '-', digits with ',' separators, decimals; not after a letter."""
    best, i, n = None, 0, len(text)
    while i < n:
        c = text[i]
        if c.isascii() and c.isdigit() and (i == 0 or not (text[i - 1].isascii() and text[i - 1].isalpha())):
            start = i
            if i > 0 and text[i - 1] == "-" and (i < 2 or not (text[i - 2].isascii() and text[i - 2].isalnum())):
                start = i - 1
            k = i
            while k < n and ((text[k].isascii() and text[k].isdigit())
                             or (text[k] == "," and k + 1 < n and text[k + 1].isdigit())):
                k += 1
            if k + 1 < n and text[k] == "." and text[k + 1].isdigit():
                k += 1
                while k < n and text[k].isdigit():
                    k += 1
            best, i = text[start:k], k
        else:
            i += 1
    return best


def is_integer_only(text):
    t = text.strip()
    t = t[:-1].rstrip() if t.endswith(".") else t
    t = t[1:] if t.startswith("-") else t
    return bool(t) and all(c.isascii() and c.isdigit() for c in t)


def is_integer_or_equation(text):
    if is_integer_only(text):
        return True
    if "=" not in text:
        return False
    lhs, rhs = text.rsplit("=", 1)
    ok = lambda c: (c.isascii() and c.isdigit()) or c.isspace() or c in "+-*/x×÷().,"  # noqa: E731
    return is_integer_only(rhs) and all(ok(c) for c in lhs) and "\n" not in text.strip()


def final_text(completion):
    """The episode's text as grpo's rewards see it: the last assistant message."""
    if isinstance(completion, str):
        return completion
    for m in reversed(completion):
        if m.get("role") == "assistant":
            return m.get("content") or ""
    return ""


def is_correct(text, answer):
    got = last_number(text)
    if got is None:
        return False
    try:
        g, w = float(got.replace(",", "")), float(answer)
    except ValueError:
        return False
    return abs(g - w) <= 1e-6 + 1e-9 * abs(w)


def correct(completions, answer, **kw):
    return [float(is_correct(final_text(c), a)) for c, a in zip(completions, answer)]


def format_reward(completions, answer, **kw):
    out = []
    for c, a in zip(completions, answer):
        t = final_text(c)
        out.append(0.1 if is_correct(t, a) and is_integer_or_equation(t) else 0.0)
    return out


format_reward.__name__ = "format"  # grpo's reward names: rewards/correct, rewards/format


# --- timing ----------------------------------------------------------------------------------------

def rss_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


PHASE = defaultdict(float)


def timed_tool(fn):
    """The tool, timed (its name, signature, type hints and docstring, so its schema, unchanged)."""
    @functools.wraps(fn)
    def tool(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            PHASE["tool_s"] += time.perf_counter() - t
            PHASE["tool_calls_run"] += 1
    return tool


class TimedGRPOTrainer(GRPOTrainer):
    def __init__(self, *a, **kw):
        self.samples = []
        super().__init__(*a, **kw)

    def _timed(self, key, fn, *a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            PHASE[key] += time.perf_counter() - t

    def _generate_single_turn(self, prompt_ids, *a, **kw):
        out = self._timed("gen_s", super()._generate_single_turn, prompt_ids, *a, **kw)
        ids = out[0]
        PHASE["gen_calls"] += 1
        PHASE["gen_rows"] += len(ids)
        PHASE["gen_tokens"] += sum(len(c) for c in ids)
        PHASE["gen_slot_tokens"] += len(ids) * max((len(c) for c in ids), default=0)
        return out

    def _tool_call_loop(self, *a, **kw):
        return self._timed("tool_loop_s", super()._tool_call_loop, *a, **kw)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        n = len(completions)
        calls = [sum(len(m.get("tool_calls") or []) for m in c if m.get("role") == "assistant") for c in completions]
        tools = [sum(1 for m in c if m.get("role") == "tool") for c in completions]
        turns = [sum(1 for m in c if m.get("role") == "assistant") for c in completions]
        PHASE["episodes"] += n
        PHASE["episode_turns"] += sum(turns)
        PHASE["episode_tool_results"] += sum(tools)
        PHASE["episode_calls_written"] += sum(calls)
        PHASE["episodes_calling_tools"] += sum(1 for t in tools if t)
        if not self.samples:  # the first episode that called a tool (else the first), and its tokens
            i = next((i for i, t in enumerate(tools) if t), 0)
            self.samples.append({"messages": completions[i],
                                 "tokens": self._tokenizer.decode(completion_ids_list[i], skip_special_tokens=False)})
        return self._timed("reward_s", super()._calculate_rewards, inputs, prompts, completions,
                           completion_ids_list)

    def _generate_and_score_completions(self, *a, **kw):
        return self._timed("rollout_s", super()._generate_and_score_completions, *a, **kw)


class StepReporter(TrainerCallback):
    def __init__(self, cpuwatch, quiet_threshold, quiet_max_wait):
        self.trainer, self.cpuwatch = None, cpuwatch
        self.quiet_threshold, self.quiet_max_wait = quiet_threshold, quiet_max_wait
        self.rows, self.pending, self.waited, self.t0, self.region = [], None, 0.0, 0.0, None

    def on_step_begin(self, args, state, control, **kw):
        self.waited = 0.0
        if self.cpuwatch and self.quiet_threshold > 0:
            self.waited = self.cpuwatch.wait_quiet(self.quiet_threshold, max_wait=self.quiet_max_wait)
        PHASE.clear()
        self.trainer.samples.clear()
        self.region = self.cpuwatch.Region() if self.cpuwatch else None
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        step_s = time.perf_counter() - self.t0
        foreign = self.region.stop()["foreign_cpu"] if self.region else None
        ph = dict(PHASE)
        eps = max(ph.get("episodes", 0), 1)
        rollout, gen = ph.get("rollout_s", 0.0), ph.get("gen_s", 0.0)
        sample = self.trainer.samples[0] if self.trainer.samples else None
        self.pending = {
            "step": state.global_step,
            "step_s": round(step_s, 3),
            "gen_s": round(gen, 3),
            "tool_s": round(ph.get("tool_s", 0.0), 4),
            "reward_s": round(ph.get("reward_s", 0.0), 4),
            "rollout_s": round(rollout, 3),
            "rollout_other_s": round(rollout - gen - ph.get("tool_s", 0.0) - ph.get("reward_s", 0.0), 3),
            "train_s": round(step_s - rollout, 3),
            "gen_share": round(gen / step_s, 3) if step_s else None,
            "gen_turn_batches": int(ph.get("gen_calls", 0)),
            "gen_tokens": int(ph.get("gen_tokens", 0)),
            "gen_slot_tokens": int(ph.get("gen_slot_tokens", 0)),
            "gen_tokens_per_s": round(ph.get("gen_tokens", 0) / gen, 1) if gen else None,
            "turns_per_episode": round(ph.get("episode_turns", 0) / eps, 3),
            "tool_results_per_episode": round(ph.get("episode_tool_results", 0) / eps, 3),
            "episodes_calling_tools": round(ph.get("episodes_calling_tools", 0) / eps, 3),
            "tool_calls_run": int(ph.get("tool_calls_run", 0)),
            "rss_mb": round(rss_mb(), 1),
            "foreign_cpu": round(foreign, 3) if foreign is not None else None,
            "quiet_wait_s": round(self.waited, 1),
            "sample": sample["messages"] if sample is not None else None,
            "sample_tokens": sample["tokens"][:600] if sample is not None else None,
        }

    def on_log(self, args, state, control, logs=None, **kw):
        if self.pending is None or logs is None or "reward" not in logs:
            return
        keep = {
            "tools/call_frequency": "tool_calls_per_episode",
            "tools/failure_frequency": "tool_failure_frequency",
            "reward": "reward", "reward_std": "reward_std",
            "rewards/correct/mean": "correct", "rewards/format/mean": "format",
            "frac_reward_zero_std": "frac_reward_zero_std", "loss": "loss", "grad_norm": "grad_norm",
            "learning_rate": "learning_rate", "entropy": "entropy",
            "completions/mean_length": "completion_mean_length",
            "completions/max_length": "completion_max_length",
            "completions/clipped_ratio": "clipped_ratio",
        }
        row = dict(self.pending)
        for k, name in keep.items():
            if k in logs:
                v = logs[k]
                row[name] = float(f"{float(v):.5g}") if isinstance(v, (int, float)) else v
        print(json.dumps(row), flush=True)
        self.rows.append(row)
        self.pending = None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF directory (grpo's checkpoint after the warm-up)")
    ap.add_argument("--tokenizer", default=None, help="default: --model")
    ap.add_argument("--chat-template", default=os.path.join(ROOT, "examples", "templates", "chatml_tools.jinja"))
    ap.add_argument("--tool", default=os.path.join(HERE, "agent_tools", "fast.py") + ":calculator")
    ap.add_argument("--sort-tool-keys", type=int, default=0, choices=[0, 1],
                    help="write each tool's schema with sorted keys in the prompt, as grpo did before 2026-12-04")
    ap.add_argument("--prompts-file", default=None, help="JSONL {prompt, answer} in step order (grpo's)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step")
    ap.add_argument("--generations", type=int, default=8, help="episodes per prompt")
    ap.add_argument("--max-completion-length", type=int, default=192,
                    help="TRL's episode budget (grpo: 48 a turn x (3 + 1) turns)")
    ap.add_argument("--max-turn-tokens", type=int, default=48,
                    help="each turn's max_new_tokens (grpo's max_completion_length); 0: TRL's default")
    ap.add_argument("--max-tool-calling-iterations", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--lr-scheduler", default="cosine")
    ap.add_argument("--beta", type=float, default=0.0)
    ap.add_argument("--loss-type", default="dapo")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--bf16", action="store_true", help="TRL's bf16 mixed precision (CPU autocast)")
    ap.add_argument("--grad-ckpt", type=int, default=1, choices=[0, 1])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quiet-threshold", type=float, default=0.05,
                    help="before each step wait until other processes use < this CPU share (0: never)")
    ap.add_argument("--quiet-max-wait", type=float, default=60.0)
    ap.add_argument("--output-dir", default="/tmp/trl_agent_step_out")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    try:
        sys.path.insert(0, PEERS_SRC)
        import cpuwatch  # the peers' contention meter
    except ImportError:
        cpuwatch = None

    n = args.steps * args.prompts
    if args.prompts_file:
        rows = [json.loads(line) for line in open(args.prompts_file) if line.strip()]
        if len(rows) < n:
            raise SystemExit(f"{args.prompts_file}: {len(rows)} prompts, {n} needed")
        rows = rows[:n]
    else:
        rows = make_problems(n, args.seed)
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": str(r["answer"])}
                            for r in rows])

    tok = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    tok.chat_template = trl_chat_template(args.chat_template, bool(args.sort_tool_keys))
    tok.response_template = HERMES_CHATML_RESPONSE_TEMPLATE
    tool = load_tool(args.tool)
    timed = timed_tool(tool)
    # The checks GRPOTrainer makes, up front, with what they found.
    assert get_json_schema(timed) == get_json_schema(tool), "timing the tool changed its schema"
    checks = {
        "supports_tool_calling": supports_tool_calling(tok),
        "prefix_preserving": is_chat_template_prefix_preserving(tok),
    }
    plain = open(args.chat_template).read()
    probe = [{"role": "user", "content": rows[0]["prompt"]}]
    rendered = tok.apply_chat_template(probe, tools=[tool], add_generation_prompt=True, tokenize=False)
    grpo_schema = sorted_json(get_json_schema(tool)) if args.sort_tool_keys else get_json_schema(tool)
    checks["prompt_renders_as_grpo_template"] = rendered == tok.apply_chat_template(
        probe, tools=[grpo_schema], add_generation_prompt=True, tokenize=False, chat_template=plain)
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123 * 456"}}\n</tool_call><|im_end|>'
    parsed = parse_response(tok, tok(call)["input_ids"], prefix=tok(rendered)["input_ids"], tools=[tool])
    checks["parses_a_call"] = parsed.get("tool_calls") == [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "123 * 456"}}}]
    if not all(checks.values()):
        raise SystemExit(f"TRL cannot run this template's tool calls: {checks}; parsed {parsed}")

    n_completions = args.prompts * args.generations
    cfg = GRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=n_completions,
        gradient_accumulation_steps=1,
        num_generations=args.generations,
        max_completion_length=args.max_completion_length,
        max_tool_calling_iterations=args.max_tool_calling_iterations,
        generation_kwargs={"max_new_tokens": args.max_turn_tokens} if args.max_turn_tokens > 0 else None,
        temperature=args.temperature, top_p=1.0, top_k=0,
        beta=args.beta,
        loss_type=args.loss_type,
        scale_rewards="group",
        epsilon=0.2,
        num_iterations=1,
        learning_rate=args.lr,
        lr_scheduler_type=args.lr_scheduler,
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=args.bf16, fp16=False,
        seed=args.seed, data_seed=args.seed,
        shuffle_dataset=False,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        model_init_kwargs={"dtype": "float32"},
        gradient_checkpointing=bool(args.grad_ckpt),
    )
    reporter = StepReporter(cpuwatch, args.quiet_threshold, args.quiet_max_wait)
    trainer = TimedGRPOTrainer(
        model=args.model,
        reward_funcs=[correct, format_reward],
        args=cfg,
        train_dataset=ds,
        processing_class=tok,
        tools=[timed],
        callbacks=[reporter],
    )
    reporter.trainer = trainer
    trainer.remove_callback(PrinterCallback)
    torch.set_num_threads(args.threads)
    setup_s = time.perf_counter() - t_start
    print(json.dumps({
        "event": "setup_done", "setup_s": round(setup_s, 1), "checks": checks,
        "response_template": getattr(trainer._tokenizer, "response_template", None) is HERMES_CHATML_RESPONSE_TEMPLATE,
        "training_chat_template_swapped": trainer.chat_template is not None,
        "eos_token_ids": trainer.eos_token_ids,
        "max_new_tokens": trainer.generation_config.max_new_tokens, "threads": torch.get_num_threads(),
        "prompt_tokens": len(tok(rendered)["input_ids"]), "prompt_tools_line": rendered.split("<tools>\n")[1][:120],
        "rss_mb": round(rss_mb(), 1),
        "policy_dtype": str(next(trainer.model.parameters()).dtype), "bf16_autocast": args.bf16,
    }), flush=True)

    t_train = time.perf_counter()
    trainer.train()
    train_wall = time.perf_counter() - t_train

    rows = reporter.rows
    after_first = rows[1:] if len(rows) > 1 else rows

    def med(xs):
        xs = [x for x in xs if x is not None]
        return round(statistics.median(xs), 3) if xs else None

    def mean(xs):
        xs = [x for x in xs if x is not None]
        return round(statistics.mean(xs), 4) if xs else None

    summary = {
        "event": "summary",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__},
        "config": {"model": args.model, "tool": args.tool, "steps": args.steps, "prompts": args.prompts,
                   "generations": args.generations, "max_completion_length": args.max_completion_length,
                   "max_turn_tokens": args.max_turn_tokens,
                   "max_tool_calling_iterations": args.max_tool_calling_iterations, "lr": args.lr,
                   "lr_scheduler": args.lr_scheduler, "beta": args.beta, "loss_type": args.loss_type,
                   "bf16": args.bf16, "grad_ckpt": bool(trainer.args.gradient_checkpointing),
                   "threads": args.threads, "seed": args.seed, "prompts_file": args.prompts_file},
        "steps_logged": len(rows),
        "step_s_median": med(r["step_s"] for r in rows),
        "step_s_median_excl_first": med(r["step_s"] for r in after_first),
        "gen_s_median": med(r["gen_s"] for r in rows),
        "gen_s_median_excl_first": med(r["gen_s"] for r in after_first),
        "train_s_median_excl_first": med(r["train_s"] for r in after_first),
        "tool_s_median": med(r["tool_s"] for r in rows),
        "tool_calls_per_episode_mean": mean(r.get("tool_calls_per_episode") for r in rows),
        "turns_per_episode_mean": mean(r["turns_per_episode"] for r in rows),
        "episodes_calling_tools_mean": mean(r["episodes_calling_tools"] for r in rows),
        "tool_failure_frequency_mean": mean(r.get("tool_failure_frequency") for r in rows),
        "correct_per_step": [r.get("correct") for r in rows],
        "foreign_cpu_per_step": [r["foreign_cpu"] for r in rows],
        "setup_s": round(setup_s, 1),
        "train_wall_s": round(train_wall, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
