//! An agent's environment as a program or an HTTP service speaking grpo's JSON protocol
//! (`environment_command`, `environment_url`): reset with the row, every model turn a step, the
//! observations as user messages rendered by the chat template, the steps' rewards summed; and
//! every fault (down at start, a program that cannot start, one that dies, hangs or answers
//! garbage mid-run) costs only its episode.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use candle_core::{DType, Device};
use grpo::agents::program_env::{EnvSpec, ProgramEnv, Transport};
use grpo::agents::{Agent, AgentOptions, AgentWorld};
use grpo::data::Example;
use grpo::rollout::{Episode, GroupSampler};
use grpo_models::hub::ModelSource;
use grpo_models::sampler::episodes::{EpisodeTokens, TurnHost};
use grpo_models::sampler::{Completion, GenStats, PromptInput, SamplingParams, StopReason};
use grpo_models::tokenizer::Tokenizer;
use grpo_models::weights::load_model;

#[path = "support/tiny_llama.rs"]
mod support;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The tiny model's tokenizer, with SmolLM2's own (ChatML) chat template.
fn tiny_tok() -> Tokenizer {
    let dir = tempfile::tempdir().unwrap();
    support::tiny_llama(dir.path(), &fixtures());
    let m = load_model(
        &ModelSource::HfDir(dir.path().to_path_buf()),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    m.tokenizer().unwrap().clone()
}

/// A guess-the-number game in the protocol, whose rows may ask for a fault at their first step
/// (`mode`: die, hang, garbage, error).
const GAME: &str = r#"
import json, os, sys, time
games = {}
for line in sys.stdin:
    req = json.loads(line)
    op, ep = req["op"], req["episode"]
    if op == "reset":
        row = req["row"]
        games[ep] = (int(row["target"]), row.get("mode", ""))
        out = {"observation": " Guess a number 1-9."}
    elif op == "step":
        target, mode = games[ep]
        if mode == "die":
            os._exit(3)
        if mode == "hang":
            time.sleep(60)
        if mode == "garbage":
            print("I am not JSON", flush=True)
            continue
        if mode == "error":
            out = {"error": "the board is on fire"}
        else:
            guess = int(req["action"].strip() or 0)
            if guess == target:
                out = {"observation": "correct!", "reward": 1.0, "done": True}
            else:
                out = {"observation": "higher" if guess < target else "lower", "reward": -0.25, "done": False}
    else:
        games.pop(ep, None)
        out = {}
    out["id"] = req["id"]
    print(json.dumps(out), flush=True)
"#;

/// The same game behind `http.server`: POST {url}/reset, /step, /close. Prints its port.
const SERVICE: &str = r#"
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
games = {}
class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        op, ep = self.path.rsplit("/", 1)[-1], req["episode"]
        assert op == req["op"], (op, req)
        status = 200
        if op == "reset":
            games[ep] = (int(req["row"]["target"]), req["row"].get("mode", ""))
            out = {"observation": " Guess a number 1-9."}
        elif op == "step":
            guess, (target, mode) = int(req["action"].strip() or 0), games[ep]
            if mode == "hang":
                time.sleep(5)
            if mode == "garbage":
                out = "oops"
            elif mode == "fail":
                status, out = 500, {"error": "internal"}
            elif guess == target:
                out = {"observation": "correct!", "reward": 1.0, "done": True}
            else:
                out = {"observation": "higher" if guess < target else "lower", "reward": -0.25, "done": False}
        else:
            games.pop(ep, None)
            out = {}
        body = (out if isinstance(out, str) else json.dumps(out)).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
s = ThreadingHTTPServer(("127.0.0.1", 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
"#;

/// Writes the game program; its command.
fn game(dir: &Path) -> Vec<String> {
    let path = dir.join("game.py");
    std::fs::write(&path, GAME).unwrap();
    vec!["python3".into(), path.display().to_string()]
}

fn spec(transport: Transport, processes: usize, timeout_s: u64) -> EnvSpec {
    EnvSpec {
        processes,
        timeout: Duration::from_secs(timeout_s),
        ..EnvSpec::new(transport)
    }
}

fn agent(env: ProgramEnv, tok: &Tokenizer, max_iterations: usize) -> Agent {
    let o = AgentOptions {
        format: None,
        max_iterations,
        max_tokens: 400,
        model: "tiny".into(),
        system_prompt: None,
        max_prompt_length: None,
        environment: None,
    };
    Agent::start_environment(env, tok.clone(), &o).unwrap()
}

fn row(target: u32, mode: &str) -> Example {
    let mut metadata = serde_json::Map::new();
    metadata.insert("target".into(), target.into());
    metadata.insert("mode".into(), mode.into());
    Example {
        prompt: grpo::data::Prompt::Text("Play.".into()),
        answer: Some(target.to_string()),
        metadata,
        origin: "test:1".into(),
        tokens: None,
    }
}

/// A sampler that writes fixed turns: row r's turn i is `turns[r][i]` (its last one again once
/// they run out), ending with ChatML's end of turn.
struct Scripted {
    turns: Vec<Vec<&'static str>>,
}

impl GroupSampler for Scripted {
    fn sample_groups(
        &self,
        _: &Tokenizer,
        _: &[PromptInput],
        _: usize,
        _: &SamplingParams,
        _: &mut dyn FnMut(usize, usize, &Completion) -> grpo::Result<()>,
    ) -> grpo::Result<(Vec<Vec<Completion>>, GenStats)> {
        unreachable!("agents sample episodes")
    }

    fn sample_episodes(
        &self,
        tok: &Tokenizer,
        prompts: &[PromptInput],
        n: usize,
        _: &SamplingParams,
        _: usize,
        host: &mut dyn TurnHost,
    ) -> grpo::Result<(Vec<Vec<EpisodeTokens>>, GenStats)> {
        let rows = prompts.len() * n;
        let mut eps: Vec<EpisodeTokens> = (0..rows)
            .map(|_| EpisodeTokens {
                ids: vec![],
                sampled: vec![],
                logprobs: vec![],
                turns: 0,
                stop_reason: StopReason::Eos,
                out_of_tokens: false,
            })
            .collect();
        let mut live: Vec<usize> = (0..rows).collect();
        for i in 0.. {
            if live.is_empty() {
                break;
            }
            let mut going = vec![];
            for &r in &live {
                let script = &self.turns[r];
                let text = format!("{}<|im_end|>", script[i.min(script.len() - 1)]);
                let ids = tok.encode(&text, false).unwrap();
                let c = Completion {
                    text: tok.decode(&ids, true).unwrap(),
                    logprobs: vec![-0.5; ids.len()],
                    ids: ids.clone(),
                    stop_reason: StopReason::Eos,
                };
                let e = &mut eps[r];
                e.ids.extend(&ids);
                e.sampled.extend(vec![true; ids.len()]);
                e.logprobs.extend(&c.logprobs);
                e.turns += 1;
                if host.turn_ended(r, r / n, r % n, &c)? {
                    going.push(r);
                }
            }
            let conts = host.continuations(&going)?;
            live.clear();
            for (r, cont) in going.into_iter().zip(conts) {
                if let Some(t) = cont {
                    let e = &mut eps[r];
                    e.ids.extend(&t);
                    e.sampled.extend(vec![false; t.len()]);
                    e.logprobs.extend(vec![0.0; t.len()]);
                    live.push(r);
                }
            }
        }
        let mut it = eps.into_iter();
        Ok((
            (0..prompts.len())
                .map(|_| it.by_ref().take(n).collect())
                .collect(),
            GenStats::default(),
        ))
    }

    fn sequence_logprobs(
        &self,
        _: &[(&[u32], &[u32])],
        _: u32,
        _: f64,
        _: usize,
    ) -> grpo::Result<Vec<Vec<f32>>> {
        unreachable!()
    }
}

/// One episode per row (G = 1), row r written by `turns[r]`.
fn rollout(
    agent: &Agent,
    tok: &Tokenizer,
    rows: &[Example],
    turns: Vec<Vec<&'static str>>,
) -> Vec<Episode> {
    let prompts: Vec<Vec<u32>> = rows
        .iter()
        .map(|ex| grpo::data::prompt_ids(tok, ex, None, None).unwrap())
        .collect();
    let examples: Vec<usize> = (0..rows.len()).collect();
    let seeds: Vec<u64> = (0..rows.len() as u64).collect();
    let sampler = Scripted { turns };
    let (eps, _) = agent
        .rollout(
            &sampler,
            &examples,
            prompts,
            &seeds,
            1,
            &SamplingParams::default(),
            rows,
        )
        .unwrap();
    eps
}

fn trace(e: &Episode) -> &grpo::rollout::AgentTrace {
    e.agent.as_ref().unwrap()
}

/// The tokens the host inserted, as text.
fn inserted(tok: &Tokenizer, e: &Episode) -> String {
    let ids: Vec<u32> = (e.completion_ids.iter().zip(&trace(e).sampled))
        .filter(|(_, &s)| !s)
        .map(|(&id, _)| id)
        .collect();
    tok.decode(&ids, false).unwrap()
}

/// The guess game, seen through an episode: the reset observation in the prompt, each turn a
/// step, each observation a user message as the chat template writes it, the rewards summed.
fn check_game(agent: &Agent, tok: &Tokenizer) {
    let rows = [row(7, ""), row(3, "")];
    let eps = rollout(agent, tok, &rows, vec![vec!["5", "8", "7"], vec!["3"]]);
    let prompt = tok.decode(&eps[0].prompt_ids, false).unwrap();
    assert!(
        prompt.contains("Play. Guess a number 1-9.<|im_end|>"),
        "{prompt}"
    );
    let t = trace(&eps[0]);
    assert_eq!(t.turns, 3);
    let shown: Vec<(&str, &str)> = (t.messages.iter())
        .map(|m| (m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
        .collect();
    assert_eq!(
        shown,
        [
            ("assistant", "5"),
            ("user", "higher"),
            ("assistant", "8"),
            ("user", "lower"),
            ("assistant", "7"),
            ("user", "correct!")
        ]
    );
    assert_eq!(eps[0].text, "7");
    // The observations are user turns as ChatML writes them, after the sampled <|im_end|>.
    assert_eq!(
        inserted(tok, &eps[0]),
        "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n\
         \n<|im_start|>user\nlower<|im_end|>\n<|im_start|>assistant\n"
    );
    // -0.25 - 0.25 + 1: the steps' rewards summed.
    assert_eq!(t.env_rewards, [Some(0.5)]);
    assert!(t.tool_errors.is_empty() && t.cut.is_none(), "{t:?}");
    assert_eq!(t.tool_calls, ["step", "step", "step"]);
    // Right at once: one turn, nothing inserted.
    let t1 = trace(&eps[1]);
    assert_eq!((t1.turns, t1.env_rewards.as_slice()), (1, &[Some(1.0)][..]));
    assert!(t1.sampled.iter().all(|&s| s));
    // The environment's reward is a reward like the others, named `environment`.
    assert_eq!(
        agent.environment_reward_name().as_deref(),
        Some("environment")
    );
    let m: std::collections::HashMap<String, f64> =
        grpo::agents::round_metrics(&eps).into_iter().collect();
    assert_eq!(m["agent/turns_per_episode"], 2.0);
    assert_eq!(m["agent/tool_calls/step"], 2.0);
    assert!(m["agent/tool_tokens_per_episode"] > 0.0);
}

#[test]
fn a_program_environment_plays_its_episodes_through_the_chat_template() {
    let tok = tiny_tok();
    let dir = tempfile::tempdir().unwrap();
    let env = ProgramEnv::start(spec(Transport::Command(game(dir.path())), 2, 10)).unwrap();
    let agent = agent(env, &tok, 5);
    check_game(&agent, &tok);
    // And again: the processes keep serving new episodes.
    check_game(&agent, &tok);
}

#[test]
fn the_turn_cap_ends_an_episode_and_its_last_turn_still_counts() {
    let tok = tiny_tok();
    let dir = tempfile::tempdir().unwrap();
    let env = ProgramEnv::start(spec(Transport::Command(game(dir.path())), 1, 10)).unwrap();
    let agent = agent(env, &tok, 2);
    // Wrong, wrong, right on the last turn the cap allows: done, not cut.
    let eps = rollout(
        &agent,
        &tok,
        &[row(7, ""), row(7, "")],
        vec![vec!["1", "2", "7"], vec!["1"]],
    );
    let t = trace(&eps[0]);
    assert_eq!((t.turns, t.cut.as_deref()), (3, None));
    assert_eq!(t.env_rewards, [Some(0.5)]);
    // Always wrong: 3 turns (2 observations), cut by the cap, each wrong guess counted.
    let t = trace(&eps[1]);
    assert_eq!(
        (t.turns, t.cut.as_deref()),
        (3, Some("max_tool_calling_iterations"))
    );
    assert_eq!(t.env_rewards, [Some(-0.75)]);
    assert_eq!(t.messages.last().unwrap()["content"], "higher");
}

/// The game service, killed when dropped.
struct Service(std::process::Child);

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts the game service; it and its address.
fn service(dir: &Path) -> (Service, String) {
    let script = dir.join("service.py");
    std::fs::write(&script, SERVICE).unwrap();
    let mut child = std::process::Command::new("python3")
        .arg(&script)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let s = Service(child);
    let mut line = String::new();
    std::io::BufReader::new(out).read_line(&mut line).unwrap();
    (s, format!("http://127.0.0.1:{}/env", line.trim()))
}

#[test]
fn an_http_environment_service_plays_the_same_game() {
    let tok = tiny_tok();
    let dir = tempfile::tempdir().unwrap();
    let (_service, url) = service(dir.path());
    let env = ProgramEnv::start(spec(Transport::Http(url), 4, 10)).unwrap();
    let agent = agent(env, &tok, 5);
    check_game(&agent, &tok);
}

#[test]
fn a_service_that_hangs_fails_or_answers_garbage_costs_only_those_episodes() {
    let tok = tiny_tok();
    let dir = tempfile::tempdir().unwrap();
    let (_service, url) = service(dir.path());
    let env = ProgramEnv::start(spec(Transport::Http(url), 4, 1)).unwrap();
    let agent = agent(env, &tok, 5);
    let rows = [
        row(7, "hang"),
        row(7, "garbage"),
        row(7, "fail"),
        row(3, ""),
    ];
    let turns = vec![vec!["5"], vec!["5"], vec!["5"], vec!["1", "3"]];
    let t0 = Instant::now();
    let eps = rollout(&agent, &tok, &rows, turns);
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
    for (e, kind) in eps.iter().zip(["timeout", "garbage", "http_error"]) {
        let t = trace(e);
        assert_eq!(t.tool_errors, [kind], "{t:?}");
        assert_eq!((t.turns, t.env_rewards.as_slice()), (1, &[None][..]));
    }
    assert_eq!(trace(&eps[3]).env_rewards, [Some(0.75)]);
    // The run goes on.
    let eps = rollout(
        &agent,
        &tok,
        &[row(7, ""), row(3, "")],
        vec![vec!["7"], vec!["3"]],
    );
    for e in &eps {
        assert_eq!(trace(e).env_rewards, [Some(1.0)], "{:?}", trace(e));
    }
}

#[test]
fn a_service_that_is_down_at_start_is_refused_naming_the_key() {
    // A port nobody listens on: bound, then freed.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}/env");
    let e = ProgramEnv::start(spec(Transport::Http(url), 2, 2))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("option `environment_url`") && e.contains("does not answer"),
        "{e}"
    );
}

#[test]
fn a_program_that_cannot_start_is_refused_naming_the_key() {
    let missing = Transport::Command(vec!["/no/such/environment-program".into()]);
    let e = ProgramEnv::start(spec(missing, 2, 2))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("option `environment_command`") && e.contains("cannot start"),
        "{e}"
    );
    let exits = Transport::Command(vec![
        "python3".into(),
        "-c".into(),
        "import sys; sys.stderr.write('no board\\n'); sys.exit(2)".into(),
    ]);
    let e = ProgramEnv::start(spec(exits, 2, 2))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("option `environment_command`")
            && e.contains("exited at start (exit status 2)")
            && e.contains("no board"),
        "{e}"
    );
    // A program that does not speak the protocol (a banner on stdout) is refused too.
    let banner = Transport::Command(vec![
        "python3".into(),
        "-c".into(),
        "import time; print('Welcome!', flush=True); time.sleep(30)".into(),
    ]);
    let e = ProgramEnv::start(spec(banner, 1, 2))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("option `environment_command`") && e.contains("with \"Welcome!\""),
        "{e}"
    );
}

/// Row 0 (process 0) faults at its first step in `mode`; row 1 (process 1) plays normally. Only
/// row 0's episode is lost, the process is started again (unless `restarts` is false), and the
/// next round plays both rows.
fn check_fault(mode: &str, kind: &str, restarts: bool) {
    let tok = tiny_tok();
    let dir = tempfile::tempdir().unwrap();
    let env = ProgramEnv::start(spec(Transport::Command(game(dir.path())), 2, 1)).unwrap();
    let agent = agent(env, &tok, 5);
    let t0 = Instant::now();
    let eps = rollout(
        &agent,
        &tok,
        &[row(7, mode), row(3, "")],
        vec![vec!["5"], vec!["1", "3"]],
    );
    assert!(
        t0.elapsed() < Duration::from_secs(20),
        "{mode}: {:?}",
        t0.elapsed()
    );
    let lost = trace(&eps[0]);
    assert_eq!(lost.tool_errors, [kind], "{mode}: {lost:?}");
    assert_eq!(lost.env_rewards, [None], "{mode}: the reward is missing");
    assert_eq!(lost.turns, 1, "{mode}: the episode ends");
    let fine = trace(&eps[1]);
    assert!(fine.tool_errors.is_empty(), "{mode}: {fine:?}");
    assert_eq!(fine.env_rewards, [Some(0.75)], "{mode}");
    let AgentWorld::Program(env) = &agent.world else {
        unreachable!()
    };
    assert_eq!(env.stats().restarts, u64::from(restarts), "{mode}");
    assert_eq!(env.stats().errors.get(kind), Some(&1), "{mode}");
    // The run goes on: the next round's episodes (ids 2 and 3: processes 0 and 1) play.
    let eps = rollout(
        &agent,
        &tok,
        &[row(7, ""), row(3, "")],
        vec![vec!["7"], vec!["3"]],
    );
    for e in &eps {
        assert_eq!(trace(e).env_rewards, [Some(1.0)], "{mode}: {:?}", trace(e));
    }
}

#[test]
fn a_program_that_dies_mid_run_costs_only_its_episode() {
    check_fault("die", "crash", true);
}

#[test]
fn a_program_that_hangs_past_the_timeout_costs_only_its_episode() {
    check_fault("hang", "timeout", true);
}

#[test]
fn a_non_json_answer_costs_only_its_episode() {
    check_fault("garbage", "garbage", false);
}

#[test]
fn an_error_answer_costs_only_its_episode() {
    check_fault("error", "env_error", false);
}

#[test]
fn the_environment_keys_are_checked_with_the_config() {
    let load = |extra: &str| {
        grpo::config::TrainConfig::from_str(extra, grpo::config::Format::Toml, "t", &[])
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    let e = load(
        "environment_command = [\"python3\", \"env.py\"]\nenvironment_factory = \"env.py:Env\"\n",
    )
    .unwrap_err();
    assert!(
        e.contains("environment_factory and environment_command") && e.contains("set one"),
        "{e}"
    );
    let e = load("environment_url = \"http://x\"\nenvironment_command = [\"a\"]\n").unwrap_err();
    assert!(
        e.contains("option `environment_url`") && e.contains("environment_command"),
        "{e}"
    );
    let e = load("environment_url = \"localhost:8000\"\n").unwrap_err();
    assert!(
        e.contains("option `environment_url`") && e.contains("http://"),
        "{e}"
    );
    let e = load("environment_url = \"http://x\"\ntools = [\"t.py:f\"]\n").unwrap_err();
    assert!(e.contains("option `tools`"), "{e}");
    let e = load("environment_command = [\"a\"]\nsft_warmup_steps = 2\n").unwrap_err();
    assert!(e.contains("option `sft_warmup_steps`"), "{e}");
    load("environment_command = [\"python3\", \"env.py\"]\n").unwrap();
}

/// The example config (examples/configs/agent_guess_program.toml, with
/// examples/agents/guess_env.py) trains on the tiny model and logs the environment's reward and
/// the agent metrics.
#[test]
fn the_guess_program_example_trains() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    support::tiny_llama(&model, &fixtures());
    let out = tmp.path().join("out");
    let examples = repo().join("examples");
    let text = std::fs::read_to_string(examples.join("configs/agent_guess_program.toml"))
        .unwrap()
        .replace("\"examples/", &format!("\"{}/", examples.display()));
    let overrides: Vec<String> = vec![
        format!("--model={}", model.display()),
        format!("--output_dir={}", out.display()),
        "--max_steps=2".into(),
        "--max_completion_length=4".into(),
        "--report_to=none".into(),
        "--threads=2".into(),
    ];
    let cfg =
        grpo::config::TrainConfig::from_str(&text, grpo::config::Format::Toml, "t", &overrides)
            .unwrap();
    let done = grpo::train::train(&cfg, &grpo::train::RunControl::default()).unwrap();
    assert_eq!(done.steps, 2);
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let first: serde_json::Value = metrics
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|r| r["agent/turns_per_episode"].is_number())
        .unwrap();
    assert!(
        first["agent/turns_per_episode"].as_f64().unwrap() >= 1.0,
        "{first}"
    );
    assert!(
        first["agent/tool_calls/step"].as_f64().unwrap() >= 1.0,
        "{first}"
    );
    assert!(metrics.contains("rewards/environment/mean"), "{metrics}");
    // completions.jsonl shows each episode turn by turn, the observations as user messages.
    let samples = std::fs::read_to_string(out.join("completions.jsonl")).unwrap();
    let line: serde_json::Value = serde_json::from_str(samples.lines().next().unwrap()).unwrap();
    assert_eq!(line["messages"][0]["role"], "assistant", "{line}");
    assert_eq!(line["messages"][1]["role"], "user", "{line}");
}
