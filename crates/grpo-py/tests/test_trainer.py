"""The Python package against TRL's API: the quickstart's shape, reward functions' arguments as
TRL 1.16 passes them (tests/fixtures/python/trl_reward_kwargs.json), callbacks, resume, Ctrl-C,
bad input, evaluation, and a Python run against the same `grpo train` run, bit for bit."""

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import FIXTURES, ROOT, ROWS, small_config

import grpo
from grpo import GRPOConfig, GRPOTrainer, TrainerCallback

sys.path.insert(0, os.path.join(ROOT, "scripts"))
from trl_kwargs_types import describe  # noqa: E402 (the fixture's own types)

with open(os.path.join(FIXTURES, "python", "trl_reward_kwargs.json")) as f:
    TRL = json.load(f)


def need(module):
    """`module`, or a skip; under CI's require switch (GRPO_REQUIRE_PYTHON_PACKAGE=1) its
    absence fails."""
    if os.environ.get("GRPO_REQUIRE_PYTHON_PACKAGE"):
        return __import__(module)
    return pytest.importorskip(module)


def dumps(value):
    return json.dumps(value, sort_keys=True)


def length_reward(completions, **kwargs):
    """Varies with the text, so that the policy gets gradients."""
    return [float(len(str(c)) % 5) for c in completions]


def trainer(tiny_model, out, reward_funcs=length_reward, dataset=ROWS, **fields):
    args = GRPOConfig(**small_config(out, **fields))
    return GRPOTrainer(model=tiny_model, reward_funcs=reward_funcs, args=args,
                       train_dataset=dataset)


def test_quickstart_shape_trains_logs_and_saves(tiny_model, tmp_path):
    datasets = need("datasets")
    dataset = datasets.Dataset.from_list(ROWS)

    def reward_num_unique_chars(completions, **kwargs):
        return [len(set(c)) for c in completions]

    training_args = GRPOConfig(**small_config(tmp_path / "run", learning_rate=1e-3))
    t = GRPOTrainer(model=tiny_model, reward_funcs=reward_num_unique_chars,
                    args=training_args, train_dataset=dataset)
    out = t.train()
    assert out.global_step == 2 and t.state.global_step == 2 and t.state.max_steps == 2
    assert [h["step"] for h in t.state.log_history] == [1, 2]
    assert "rewards/reward_num_unique_chars/mean" in t.state.log_history[0]
    assert os.path.isfile(tmp_path / "run" / "checkpoint-2" / "model.safetensors")
    saved = t.save_model(tmp_path / "final")
    assert sorted(os.listdir(saved)) == sorted(
        n for n in os.listdir(tmp_path / "run" / "checkpoint-2")
        if n not in ("optimizer.safetensors", "trainer_state.json", "config.toml"))
    assert grpo.__version__ == "0.1.0"


@pytest.mark.parametrize("kind", ["standard", "conversational"])
def test_reward_functions_get_trls_keyword_arguments(tiny_model, tmp_path, kind):
    got = {}

    def sync_recorder(**kwargs):
        got.setdefault("sync", {**kwargs, "_step": kwargs["trainer_state"].global_step})
        return [0.0] * len(kwargs["prompts"])

    async def async_recorder(**kwargs):
        await asyncio.sleep(0)
        got.setdefault("async", {**kwargs, "_step": kwargs["trainer_state"].global_step})
        return [0.0] * len(kwargs["prompts"])

    rows = ROWS if kind == "standard" else [
        dict(r, prompt=[{"role": "user", "content": r["prompt"]}]) for r in ROWS]
    t = trainer(tiny_model, tmp_path / kind, [sync_recorder, async_recorder], rows,
                max_steps=1)
    t.train()
    for name in ("sync", "async"):
        want, kwargs = TRL[kind][name], got[name]
        step = kwargs.pop("_step")
        assert sorted(kwargs) == want["kwargs"]
        assert {k: describe(v) for k, v in kwargs.items()} == want["types"]
        # The same items, the G completions of a prompt side by side (the order of the groups
        # is the sampler's).
        assert sorted(dumps(p) for p in kwargs["prompts"]) == sorted(
            dumps(p) for p in want["prompts"])
        assert kwargs["prompts"][0] == kwargs["prompts"][1]
        for col in ("answer", "level", "tags"):
            pairs = sorted(dumps([p, c]) for p, c in zip(kwargs["prompts"], kwargs[col]))
            assert pairs == sorted(dumps([p, c]) for p, c in
                                   zip(want["prompts"], want["columns"][col]))
        state = kwargs["trainer_state"]
        assert step == want["trainer_state"]["global_step"]
        assert sorted(f.name for f in dataclasses.fields(state)) == \
            want["trainer_state"]["attributes"]
        assert all(len(ids) == 8 or ids[-1] == 2 for ids in kwargs["completion_ids"])
        if kind == "conversational":
            assert all(c[0]["role"] == "assistant" and len(c) == 1
                       for c in kwargs["completions"])


def test_async_reward_functions_are_awaited_together(tiny_model, tmp_path):
    events = {}

    def waits_for(other):
        async def reward(completions, **kwargs):
            loop_events = events.setdefault(id(asyncio.get_running_loop()), {
                "a": asyncio.Event(), "b": asyncio.Event()})
            mine = "a" if other == "b" else "b"
            loop_events[mine].set()
            await asyncio.wait_for(loop_events[other].wait(), timeout=5)
            return [1.0] * len(completions)
        reward.__name__ = f"waits_for_{other}"
        return reward

    # Each sets its own event and waits for the other's: only together do both finish.
    t = trainer(tiny_model, tmp_path / "run", [waits_for("b"), waits_for("a")], max_steps=1)
    t.train()
    assert t.state.log_history[0]["rewards/waits_for_a/mean"] == 1.0


def test_callbacks_fire_in_order_and_can_stop_the_run(tiny_model, tmp_path):
    seen = []

    class Recorder(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            seen.append(("begin", state.global_step, state.max_steps))

        def on_step_end(self, args, state, control, **kw):
            seen.append(("step_end", state.global_step))

        def on_log(self, args, state, control, logs=None, **kw):
            seen.append(("log", logs["step"]))

        def on_evaluate(self, args, state, control, metrics=None, **kw):
            seen.append(("evaluate", state.global_step, "eval_reward_length_reward" in metrics))

        def on_save(self, args, state, control, **kw):
            seen.append(("save", state.global_step))
            if state.global_step == 2:
                control.should_training_stop = True

        def on_train_end(self, args, state, control, **kw):
            seen.append(("end", state.global_step))

    args = GRPOConfig(**small_config(tmp_path / "run", max_steps=4, eval_steps=2,
                                     eval_num_samples=2, eval_k=[1]))
    t = GRPOTrainer(model=tiny_model, reward_funcs=length_reward, args=args,
                    train_dataset=ROWS, eval_dataset=ROWS, callbacks=[Recorder])
    out = t.train()
    assert out.metrics["interrupted"] and out.global_step == 2
    assert seen == [
        ("begin", 0, 4), ("log", 0), ("evaluate", 0, True),
        ("step_end", 1), ("log", 1), ("save", 1),
        ("step_end", 2), ("log", 2), ("evaluate", 2, True), ("save", 2),
        ("end", 2),
    ]


def test_resume_continues_exactly(tiny_model, tmp_path):
    whole = trainer(tiny_model, tmp_path / "whole", learning_rate=1e-3, max_steps=3)
    whole.train()

    class StopAfterOne(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            control.should_training_stop = True

    args = GRPOConfig(**small_config(tmp_path / "part", learning_rate=1e-3, max_steps=3))
    first = GRPOTrainer(model=tiny_model, reward_funcs=length_reward, args=args,
                        train_dataset=ROWS, callbacks=[StopAfterOne()])
    assert first.train().global_step == 1
    again = trainer(tiny_model, tmp_path / "part", learning_rate=1e-3, max_steps=3)
    with pytest.raises(ValueError, match="newest checkpoint"):
        again.train(resume_from_checkpoint=str(tmp_path / "nowhere"))
    assert again.train(resume_from_checkpoint=True).global_step == 3
    a = (tmp_path / "whole" / "checkpoint-3" / "model.safetensors").read_bytes()
    b = (tmp_path / "part" / "checkpoint-3" / "model.safetensors").read_bytes()
    assert a == b


def test_ctrl_c_stops_at_a_step_boundary_with_a_checkpoint(tiny_model, tmp_path):
    marker = tmp_path / "stepped"
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from conftest import ROWS, small_config
        from grpo import GRPOConfig, GRPOTrainer, TrainerCallback

        class Mark(TrainerCallback):
            def on_step_end(self, args, state, control, **kw):
                open({str(marker)!r}, "w").write(str(state.global_step))

        def slow(completions, **kw):
            import time; time.sleep(0.2)
            return [float(len(c) % 3) for c in completions]

        args = GRPOConfig(**small_config({str(tmp_path / "run")!r}, max_steps=200,
                                         save_steps=1000))
        t = GRPOTrainer(model={tiny_model!r}, reward_funcs=slow, args=args, train_dataset=ROWS,
                        callbacks=[Mark()])
        out = t.train()
        print("RESULT", out.global_step, out.metrics["interrupted"])
    """)
    # A shell's background job (`cmd &` without job control, as CI may be started) inherits
    # SIGINT ignored, and Python then installs no Ctrl-C handler: the child gets SIGINT's
    # default back, as a terminal's foreground process has it.
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 60
    while not marker.exists() and time.time() < deadline and p.poll() is None:
        time.sleep(0.05)
    assert marker.exists(), p.communicate()[1][-2000:]
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err[-2000:]
    steps, interrupted = out.split("RESULT")[1].split()
    assert interrupted == "True" and 1 <= int(steps) < 200
    assert "stop requested" in err
    assert os.path.isfile(tmp_path / "run" / f"checkpoint-{steps}" / "optimizer.safetensors")


def test_python_run_equals_the_cli_run(tiny_model, tmp_path, grpo_binary):
    """The same run from GRPOTrainer (reward function in process, dataset in memory) and from
    `grpo train` (the function in a file as `reward_funcs`, the rows in a JSONL file): the same
    checkpoints and metrics, bit for bit (timings aside)."""
    work = tmp_path / "cli"
    work.mkdir()
    (work / "rewards.py").write_text(textwrap.dedent("""
        def length_reward(completions, **kwargs):
            return [float(len(str(c)) % 5) for c in completions]
    """))
    (work / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    fields = small_config("out", learning_rate=1e-3, max_steps=3, beta=0.04)
    config = dict(fields, model=tiny_model, train_file="rows.jsonl",
                  reward_funcs=["rewards.py:length_reward"])
    (work / "run.yaml").write_text(json.dumps(config))
    env = dict(os.environ, GRPO_PYTHON=sys.executable)
    cli = subprocess.run([grpo_binary, "train", "--config", "run.yaml"], cwd=work, env=env,
                         capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr[-3000:]
    t = trainer(tiny_model, tmp_path / "py", learning_rate=1e-3, max_steps=3, beta=0.04)
    t.train()

    def metrics(run):
        rows = [json.loads(x) for x in open(run / "metrics.jsonl")]
        # Timings, memory, and the scorer process's counters (the CLI's reward runs in one).
        return [{k: v for k, v in r.items()
                 if not k.startswith(("time/", "memory/", "scorer/"))
                 and k not in ("time", "tokens_per_second")} for r in rows]

    assert metrics(work / "out") == metrics(tmp_path / "py")
    for step in (1, 2, 3):
        for name in ("model.safetensors", "optimizer.safetensors"):
            a = (work / "out" / f"checkpoint-{step}" / name).read_bytes()
            b = (tmp_path / "py" / f"checkpoint-{step}" / name).read_bytes()
            assert a == b, f"checkpoint-{step}/{name}"
    assert metrics(tmp_path / "py")[-1]["grad_norm"] > 0


def test_evaluate_reports_pass_at_k(tiny_model, tmp_path):
    def exact(completions, answer, **kw):
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

    args = GRPOConfig(**small_config(tmp_path / "run", max_steps=1, eval_num_samples=2,
                                     eval_k=[1, 2], correctness_reward="exact"))
    t = GRPOTrainer(model=tiny_model, reward_funcs=exact, args=args, train_dataset=ROWS,
                    eval_dataset=ROWS)
    before = t.evaluate()
    t.train()
    after = t.evaluate()
    for m in (before, after):
        assert {"eval_pass@1", "eval_pass@2", "eval_accuracy"} <= set(m)
        assert 0.0 <= m["eval_pass@2"] <= 1.0


def test_reward_errors_missing_loses_only_the_batch(tiny_model, tmp_path):
    def flaky(completions, **kw):
        raise RuntimeError("scorer down")

    with pytest.warns(UserWarning, match="scorer down"):
        t = trainer(tiny_model, tmp_path / "run", [length_reward, flaky], max_steps=1,
                    reward_errors="missing")
        t.train()
    assert t.state.log_history[0]["rewards/flaky/missing"] == 4.0  # of 4 completions
    assert t.state.log_history[0]["rewards/length_reward/missing"] == 0.0


# Bad input: a Python exception naming the problem, before training where it can be.

def test_a_raising_reward_stops_the_run_with_its_traceback(tiny_model, tmp_path):
    def broken(completions, **kw):
        return {}["no such key"]

    t = trainer(tiny_model, tmp_path / "run", broken)
    with pytest.raises(KeyError, match="no such key") as e:
        t.train()
    assert any(tb.name == "broken" for tb in e.traceback)


@pytest.mark.parametrize("returns, error, match", [
    (lambda n: [0.0] * (n + 1), ValueError, "returned 5 rewards, but 4 were expected"),
    (lambda n: "good", TypeError, "returned str"),
    (lambda n: ["x"] * n, TypeError, "for completion 0"),
])
def test_a_reward_that_returns_the_wrong_thing_is_named(tiny_model, tmp_path, returns, error,
                                                        match):
    def bad(completions, **kw):
        return returns(len(completions))

    with pytest.raises(error, match=match):
        trainer(tiny_model, tmp_path / "run", bad).train()


def test_bad_input_is_refused_before_training(tiny_model, tmp_path):
    def no_kwargs(x):
        return [0.0]

    with pytest.raises(TypeError, match="no_kwargs"):
        trainer(tiny_model, tmp_path / "a", no_kwargs)
    with pytest.raises(ValueError, match="prompt"):
        trainer(tiny_model, tmp_path / "b", dataset=[{"question": "1 + 1?"}])
    with pytest.raises(ValueError, match="num_generatoins"):
        GRPOConfig(output_dir=str(tmp_path), num_generatoins=4)
    with pytest.raises(ValueError, match="learning_rate"):
        GRPOConfig(output_dir=str(tmp_path), learning_rate="fast")
    with pytest.raises(ValueError, match="model"):
        GRPOTrainer(model=str(tmp_path / "no-such-model"), reward_funcs=length_reward,
                    args=GRPOConfig(**small_config(tmp_path / "c")), train_dataset=ROWS)
    with pytest.warns(UserWarning, match="use_vllm"):
        GRPOConfig(output_dir=str(tmp_path), use_vllm=True)


def test_config_fields_read_back_resolved():
    args = GRPOConfig(output_dir="runs/x", learning_rate=1e-6, num_generations=4)
    assert args.learning_rate == 1e-6 and args.num_generations == 4
    assert args.beta == 0.0 and args.output_dir == "runs/x"
    args.max_steps = 7
    assert args.max_steps == 7
    with pytest.raises(ValueError, match="num_generations"):
        args.num_generations = 0


def test_peft_config_trains_a_lora_adapter(tiny_model, tmp_path):
    class LoraConfig:  # what peft.LoraConfig holds (the package reads its attributes)
        r, lora_alpha, lora_dropout = 4, 8, 0.0
        target_modules = ["q_proj", "v_proj"]

    args = GRPOConfig(**small_config(tmp_path / "run", max_steps=1))
    t = GRPOTrainer(model=tiny_model, reward_funcs=length_reward, args=args, train_dataset=ROWS,
                    peft_config=LoraConfig())
    t.train()
    adapter = json.load(open(tmp_path / "run" / "checkpoint-1" / "adapter_config.json"))
    assert (adapter["r"], adapter["lora_alpha"]) == (4, 8)
    assert sorted(adapter["target_modules"]) == ["q_proj", "v_proj"]


def test_none_is_missing_and_weights_combine_rewards(tiny_model, tmp_path):
    def one(completions, **kw):
        return [1.0] * len(completions)

    def half_missing(completions, **kw):
        return [None if i % 2 else 2.0 for i in range(len(completions))]

    t = trainer(tiny_model, tmp_path / "run", [one, half_missing], max_steps=1,
                reward_weights=[1.0, 0.5])
    t.train()
    row = t.state.log_history[0]
    assert row["rewards/half_missing/missing"] == 2.0
    assert row["rewards/half_missing/mean"] == 2.0
    # Missing scores count as 0 in the weighted sum (TRL's nansum): 1 + 0.5 x 2 on half of them.
    assert row["reward"] == pytest.approx((4 * 1.0 + 2 * 0.5 * 2.0) / 4)


def test_training_releases_the_gil(tiny_model, tmp_path):
    import threading

    ticks, done = [0], threading.Event()

    def count():
        while not done.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    counter = threading.Thread(target=count)
    counter.start()
    t = trainer(tiny_model, tmp_path / "run", max_steps=4)
    t0 = time.time()
    t.train()
    elapsed = time.time() - t0
    done.set()
    counter.join()
    # The counter ran all along (a held GIL would stall it for the whole of each step).
    assert ticks[0] > 0.3 * elapsed / 0.0015


def test_tools_train_an_agent_from_python(tiny_model, tmp_path):
    """TRL's tools=: a function from a module file runs in grpo's tool processes."""
    import importlib.util

    (tmp_path / "my_tools.py").write_text(textwrap.dedent('''
        def add(a: int, b: int) -> int:
            """Adds two integers.

            Args:
                a: The first integer.
                b: The second integer.
            """
            return a + b
    '''))
    spec = importlib.util.spec_from_file_location("my_tools", tmp_path / "my_tools.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    template = os.path.join(ROOT, "examples", "templates", "chatml_tools.jinja")
    rows = [dict(r, prompt=[{"role": "user", "content": r["prompt"]}]) for r in ROWS]
    args = GRPOConfig(**small_config(tmp_path / "run", max_steps=1, chat_template=template,
                                     max_tool_calling_iterations=2))
    t = GRPOTrainer(model=tiny_model, reward_funcs=length_reward, args=args, train_dataset=rows,
                    tools=[module.add])
    t.train()
    assert "agent/turns_per_episode" in t.state.log_history[0]

    def nested():
        def inner():
            pass
        return inner

    with pytest.raises(TypeError, match="top level"):
        GRPOTrainer(model=tiny_model, reward_funcs=length_reward, args=args, train_dataset=rows,
                    tools=[nested()])


def test_a_raising_callback_stops_the_run_with_a_checkpoint_and_its_exception(tiny_model,
                                                                               tmp_path):
    class Broken(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if state.global_step == 1:
                raise RuntimeError("callback broke")

    args = GRPOConfig(**small_config(tmp_path / "run", max_steps=3, save_steps=1000))
    t = GRPOTrainer(model=tiny_model, reward_funcs=length_reward, args=args, train_dataset=ROWS,
                    callbacks=[Broken()])
    with pytest.raises(RuntimeError, match="callback broke"):
        t.train()
    # The round that raised ended the run with its checkpoint, as a stop does.
    assert os.path.isfile(tmp_path / "run" / "checkpoint-1" / "optimizer.safetensors")
    assert not os.path.exists(tmp_path / "run" / "checkpoint-2")
