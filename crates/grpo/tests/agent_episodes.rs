//! The multi-turn sampler (`grpo_models::sampler::episodes`) on a tiny random Llama: each turn's
//! inserted tokens are prefilled onto the row's own keys and values, so an episode's sampled
//! log-probs must equal a plain forward over the whole episode's tokens, on the fused decoding
//! step and on the tensor path; an episode must not depend on the rest of the batch; the budget
//! of tokens must end an episode.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use grpo::logprobs::next_token_logprobs;
use grpo_models::hub::ModelSource;
use grpo_models::models::{CausalLm, Mode, SeqBatch};
use grpo_models::sampler::episodes::{generate_episodes, EpisodeTokens, TurnHost};
use grpo_models::sampler::{Completion, PromptInput, SamplingParams};
use grpo_models::tokenizer::Tokenizer;
use grpo_models::weights::load_model;

#[path = "support/tiny_llama.rs"]
mod support;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// Every turn goes on until the episode has `turns` model turns; row r's inserted turn is
/// `1 + r % 4` tokens (different lengths in one batch), made from the row's own last token so
/// that it depends on what the row sampled.
struct Scripted {
    turns: usize,
    seen: Vec<usize>,
    last: Vec<u32>,
    ended: Vec<(usize, usize)>,
}

impl TurnHost for Scripted {
    fn turn_ended(
        &mut self,
        row: usize,
        prompt: usize,
        sample: usize,
        turn: &Completion,
    ) -> grpo_models::Result<bool> {
        if self.seen.len() <= row {
            self.seen.resize(row + 1, 0);
            self.last.resize(row + 1, 0);
        }
        self.seen[row] += 1;
        self.last[row] = *turn.ids.last().unwrap();
        self.ended.push((prompt, sample));
        Ok(self.seen[row] < self.turns)
    }

    fn continuations(&mut self, rows: &[usize]) -> grpo_models::Result<Vec<Option<Vec<u32>>>> {
        Ok(rows
            .iter()
            .map(|&r| {
                Some(
                    (0..1 + r % 4)
                        .map(|j| 100 + self.last[r] % 50 + j as u32)
                        .collect(),
                )
            })
            .collect())
    }
}

fn tiny() -> (CausalLm, Tokenizer, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    support::tiny_llama(dir.path(), &fixtures());
    let m = load_model(
        &ModelSource::HfDir(dir.path().to_path_buf()),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let tok = m.tokenizer().unwrap().clone();
    (m.build().unwrap(), tok, dir)
}

fn params(max_new: usize) -> SamplingParams {
    SamplingParams {
        max_new_tokens: max_new,
        temperature: 0.8,
        // A token the random model samples now and then ends some turns early.
        eos_token_ids: vec![2, 7, 11, 13],
        ..Default::default()
    }
}

fn prompts() -> Vec<PromptInput> {
    vec![
        PromptInput {
            ids: vec![5, 17, 33, 2, 90],
            seed: 3,
        },
        PromptInput {
            ids: vec![8, 9],
            seed: 4,
        },
        PromptInput {
            ids: vec![40, 41, 42, 43, 44, 45, 46, 47],
            seed: 5,
        },
    ]
}

fn episodes(
    model: &CausalLm,
    tok: &Tokenizer,
    prompts: &[PromptInput],
    turns: usize,
    max_tokens: usize,
) -> Vec<Vec<EpisodeTokens>> {
    let mut host = Scripted {
        turns,
        seen: vec![],
        last: vec![],
        ended: vec![],
    };
    let (out, stats) =
        generate_episodes(model, tok, prompts, 4, &params(6), max_tokens, &mut host).unwrap();
    let sampled: usize = out
        .iter()
        .flatten()
        .map(|e| e.sampled.iter().filter(|&&s| s).count())
        .sum();
    assert_eq!(stats.generated_tokens, sampled);
    out
}

/// Sampled log-probs against a forward over prompt + episode, at the sampled positions.
fn check_logprobs(
    model: &CausalLm,
    prompts: &[PromptInput],
    out: &[Vec<EpisodeTokens>],
    what: &str,
) {
    for (p, group) in prompts.iter().zip(out) {
        for e in group {
            assert_eq!(e.ids.len(), e.sampled.len());
            assert_eq!(e.ids.len(), e.logprobs.len());
            let seq = [p.ids.clone(), e.ids.clone()].concat();
            let batch = SeqBatch::right_padded(&[seq], 0, &Device::Cpu).unwrap();
            let lp = next_token_logprobs(model, &batch, 0.8, Mode::Infer).unwrap();
            let lp = lp.to_vec2::<f32>().unwrap().remove(0);
            let lp = &lp[p.ids.len() - 1..];
            for (j, (&s, &got)) in e.sampled.iter().zip(&e.logprobs).enumerate() {
                if s {
                    assert!(
                        (lp[j] - got).abs() < 1e-4,
                        "{what}: token {j} of {:?}: sampler {got} vs forward {}",
                        e.ids,
                        lp[j]
                    );
                } else {
                    assert_eq!(got, 0.0);
                }
            }
        }
    }
}

#[test]
fn episode_logprobs_equal_a_forward_over_the_whole_episode() {
    let (plain, tok, _dir) = tiny();
    let mut packed = plain.clone();
    packed.pack_for_decoding().unwrap();
    for (model, what) in [(&plain, "tensor path"), (&packed, "fused decoding")] {
        let out = episodes(model, &tok, &prompts(), 3, 200);
        for e in out.iter().flatten() {
            assert_eq!(e.turns, 3, "every episode runs its 3 turns: {e:?}");
            let inserted = e.sampled.iter().filter(|&&s| !s).count();
            assert!(inserted >= 2, "two inserted turns: {e:?}");
            assert!(!e.out_of_tokens);
        }
        check_logprobs(model, &prompts(), &out, what);
    }
}

#[test]
fn an_episode_does_not_depend_on_the_rest_of_the_batch() {
    let (model, tok, _dir) = tiny();
    let all = episodes(&model, &tok, &prompts(), 3, 200);
    let alone = episodes(&model, &tok, &prompts()[1..2], 3, 200);
    // Rows are numbered in the batch and the scripted host's inserted length depends on the
    // row's number mod 4: prompt 1's rows (4..8 in the batch, 0..4 alone) get the same ones.
    for s in 0..4 {
        let (in_batch, by_itself) = (&all[1][s], &alone[0][s]);
        assert_eq!(
            in_batch.ids, by_itself.ids,
            "sample {s} depends on the batch"
        );
        let d = in_batch
            .logprobs
            .iter()
            .zip(&by_itself.logprobs)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(d < 1e-4, "sample {s}: log-probs differ by {d}");
    }
    // The same prompt batch, sampled again, is the same.
    assert_eq!(all, episodes(&model, &tok, &prompts(), 3, 200));
}

#[test]
fn the_token_budget_ends_episodes() {
    let (model, tok, _dir) = tiny();
    let out = episodes(&model, &tok, &prompts(), 10, 14);
    for e in out.iter().flatten() {
        assert!(
            e.ids.len() <= 14,
            "{} tokens over a budget of 14",
            e.ids.len()
        );
        assert!(e.out_of_tokens || e.turns == 10, "{e:?}");
    }
    assert!(out.iter().flatten().any(|e| e.out_of_tokens));
    check_logprobs(&model, &prompts(), &out, "budget");
}

// ---------------------------------------------------------------------------------------------
// The agents' host: tool calls parsed, run in Python, their results rendered by the template.

use grpo::agents::tools::{ToolHost, ToolSpec};
use grpo::agents::{Agent, AgentOptions, EnvironmentReward};
use grpo::data::Example;
use grpo::rollout::GroupSampler;
use grpo_models::sampler::episodes::EpisodeTokens as Tokens;
use grpo_models::sampler::{GenStats, StopReason};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A sampler that writes fixed turns: `turns[i]` is the text of every episode's turn i.
struct Scripted2 {
    turns: Vec<String>,
}

impl GroupSampler for Scripted2 {
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
    ) -> grpo::Result<(Vec<Vec<Tokens>>, GenStats)> {
        let rows = prompts.len() * n;
        let mut eps: Vec<Tokens> = (0..rows)
            .map(|_| Tokens {
                ids: vec![],
                sampled: vec![],
                logprobs: vec![],
                turns: 0,
                stop_reason: StopReason::Eos,
                out_of_tokens: false,
            })
            .collect();
        let mut live: Vec<usize> = (0..rows).collect();
        for text in &self.turns {
            let ids = tok.encode(text, false).unwrap();
            let stop_reason = match text.ends_with("<|im_end|>") {
                true => StopReason::Eos,
                false => StopReason::StopString,
            };
            let c = Completion {
                text: tok.decode(&ids, true).unwrap(),
                logprobs: vec![-0.5; ids.len()],
                ids: ids.clone(),
                stop_reason,
            };
            let mut going = vec![];
            for &r in &live {
                let e = &mut eps[r];
                e.ids.extend(&ids);
                e.sampled.extend(vec![true; ids.len()]);
                e.logprobs.extend(&c.logprobs);
                e.turns += 1;
                e.stop_reason = stop_reason;
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

fn calculator_agent(tok: Tokenizer) -> (Agent, Tokenizer) {
    let template =
        std::fs::read_to_string(repo().join("examples/templates/chatml_tools.jinja")).unwrap();
    let tok = tok
        .with_chat_template(&template, "chatml_tools.jinja")
        .unwrap();
    let calc = repo().join("examples/agents/calculator.py");
    let host = ToolHost::start(ToolSpec::new(
        vec![format!("{}:calculator", calc.display())],
        None,
    ))
    .unwrap();
    let o = AgentOptions {
        format: None,
        max_iterations: 2,
        max_tokens: 400,
        model: "tiny".into(),
        system_prompt: None,
        max_prompt_length: None,
        environment: None,
    };
    Agent::start(host, tok, &o).unwrap()
}

fn example() -> Example {
    Example {
        prompt: grpo::data::Prompt::Text("What is 12 * 34?".into()),
        answer: Some("408".into()),
        metadata: Default::default(),
        origin: "test:1".into(),
        tokens: None,
    }
}

#[test]
fn the_host_runs_tools_and_renders_their_results_as_the_template_does() {
    let (_, tok, _dir) = tiny();
    let (agent, tok) = calculator_agent(tok);
    // The tools are in the prompt.
    let prompt = tok
        .apply_chat_template(&[grpo_models::tokenizer::ChatMessage::user("hi")], true)
        .unwrap();
    assert!(prompt.contains("\"name\": \"calculator\""), "{prompt}");
    // In the order transformers' get_json_schema writes them (as apply_chat_template(tools=)
    // renders them), not sorted.
    assert!(
        prompt.contains(
            "{\"type\": \"function\", \"function\": {\"name\": \"calculator\", \"description\": "
        ),
        "{prompt}"
    );
    let sampler = Scripted2 {
        turns: vec![
            "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"12 * 34\"}}\n</tool_call>".into(),
            "<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expr\": 1}}\n</tool_call>".into(),
            "The answer is 408.<|im_end|>".into(),
        ],
    };
    let params = SamplingParams::default();
    let (eps, _) = agent
        .rollout(
            &sampler,
            &[0],
            vec![vec![1, 2, 3]],
            &[7],
            2,
            &params,
            &[example()],
        )
        .unwrap();
    assert_eq!(eps.len(), 2);
    let e = &eps[0];
    let t = e.agent.as_ref().unwrap();
    assert_eq!(t.turns, 3);
    assert_eq!(t.tool_calls, vec!["calculator", "calculator"]);
    assert_eq!(t.tool_errors, vec!["arguments"]);
    assert_eq!(e.text, "The answer is 408.");
    let roles: Vec<&str> = t
        .messages
        .iter()
        .map(|m| m["role"].as_str().unwrap())
        .collect();
    assert_eq!(
        roles,
        ["assistant", "tool", "assistant", "tool", "assistant"]
    );
    assert_eq!(t.messages[1]["content"], "408");
    // The inserted tokens are the template's tool turn, around the tool's result.
    let inserted: Vec<u32> = e
        .completion_ids
        .iter()
        .zip(&t.sampled)
        .filter(|(_, &s)| !s)
        .map(|(&id, _)| id)
        .collect();
    let text = tok.decode(&inserted, false).unwrap();
    assert!(
        text.starts_with("<|im_end|>\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
        "{text:?}"
    );
    assert!(text.contains("Error: tool `calculator`"), "{text:?}");
    // A TRL-style Python reward function gets the episode as conversational completions.
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("rewards.py");
    std::fs::write(
        &f,
        "def used_tool(prompts, completions, **kw):\n    \
         return [1.0 if isinstance(c, list) and c[1]['role'] == 'tool' and c[1]['content'] == '408'\n            \
         and c[0]['tool_calls'][0]['function']['name'] == 'calculator' else 0.0 for c in completions]\n",
    )
    .unwrap();
    let table =
        serde_json::json!({"kind": "python", "function": format!("{}:used_tool", f.display())});
    let rewards = grpo::rewards::build_rewards(
        &grpo::rewards::parse_specs(&[table], 64).unwrap(),
        &Device::Cpu,
    )
    .unwrap();
    let mut scored = eps.clone();
    grpo::rollout::score(&mut scored, &[example()], &rewards, &[0], None).unwrap();
    assert_eq!(
        scored[0].rewards,
        [1.0],
        "the reward function saw {:?}",
        t.messages
    );
    let m: std::collections::HashMap<String, f64> =
        grpo::agents::round_metrics(&eps).into_iter().collect();
    assert_eq!(m["agent/turns_per_episode"], 3.0);
    assert_eq!(m["agent/tool_calls/calculator"], 2.0);
    assert_eq!(m["agent/tool_errors/arguments"], 1.0);
}

#[test]
fn a_template_without_tools_is_refused_naming_the_key() {
    let (_, tok, _dir) = tiny();
    let calc = repo().join("examples/agents/calculator.py");
    let host = ToolHost::start(ToolSpec::new(
        vec![format!("{}:calculator", calc.display())],
        None,
    ))
    .unwrap();
    let o = AgentOptions {
        format: Some(grpo::agents::calls::CallFormat::Hermes),
        max_iterations: 2,
        max_tokens: 400,
        model: "tiny".into(),
        system_prompt: None,
        max_prompt_length: None,
        environment: None,
    };
    let e = Agent::start(host, tok, &o).unwrap_err().to_string();
    assert!(
        e.contains("ignores `tools`") && e.contains("chat_template"),
        "{e}"
    );
}

#[test]
fn training_with_tools_runs_and_logs_agent_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    support::tiny_llama(&model, &fixtures());
    let out = dir.path().join("out");
    let text = format!(
        "model = \"{}\"\noutput_dir = \"{}\"\nnum_generations = 4\nper_device_train_batch_size = 8\n\
         max_completion_length = 6\nmax_steps = 2\nsave_steps = 0\nthreads = 2\nlearning_rate = 1e-3\n\
         report_to = []\ntools = [\"{}:calculator\"]\nchat_template = \"{}\"\n\
         max_tool_calling_iterations = 2\nsft_warmup_steps = 3\nsft_warmup_learning_rate = 1e-2\n\
         eval_steps = 2\neval_num_samples = 0\n[task]\ntrain_size = 8\neval_size = 2\nops = [\"*\"]\n",
        model.display(),
        out.display(),
        repo().join("examples/agents/calculator.py").display(),
        repo().join("examples/templates/chatml_tools.jinja").display(),
    );
    let cfg =
        grpo::config::TrainConfig::from_str(&text, grpo::config::Format::Toml, "t", &[]).unwrap();
    let done = grpo::train::train(&cfg, &grpo::train::RunControl::default()).unwrap();
    assert_eq!(done.steps, 2);
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let rows: Vec<serde_json::Value> = metrics
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // The supervised warm-up: 3 steps before GRPO's first, their cross-entropy falling (the
    // same 8 traces each step: 8 problems, 8 a step).
    let ce: Vec<f64> = rows
        .iter()
        .filter_map(|r| r["warmup/cross_entropy"].as_f64())
        .collect();
    assert_eq!(ce.len(), 3, "{metrics}");
    assert!(ce[2] < ce[0], "warm-up cross-entropy {ce:?}");
    let first = rows
        .iter()
        .find(|r| r["agent/turns_per_episode"].is_number())
        .unwrap();
    assert!(
        first["agent/turns_per_episode"].as_f64().unwrap() >= 1.0,
        "{first}"
    );
    // Evaluation ran (episodes, the tools in the prompt).
    assert!(
        rows.iter().any(|r| r["eval/accuracy"].is_number()),
        "{metrics}"
    );
    // completions.jsonl shows each episode turn by turn.
    let samples = std::fs::read_to_string(out.join("completions.jsonl")).unwrap();
    let line: serde_json::Value = serde_json::from_str(samples.lines().next().unwrap()).unwrap();
    assert_eq!(line["messages"][0]["role"], "assistant", "{line}");
    // So do the evaluation's answers.
    let evals = std::fs::read_to_string(out.join("eval/step-0.jsonl")).unwrap();
    let row: serde_json::Value = serde_json::from_str(evals.lines().next().unwrap()).unwrap();
    assert_eq!(row["greedy"]["messages"][0]["role"], "assistant", "{row}");
}

/// A TRL-style environment class: `reset(**row)` with the dataset row, a public method as its
/// tool, `get_reward()` as a reward. `numbered` makes each instance's observation its own.
fn env_agent(tok: Tokenizer, numbered: bool) -> (Agent, Tokenizer, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let obs = match numbered {
        true => "f' (table {Guess.made})'",
        false => "' (you may guess)'",
    };
    std::fs::write(
        dir.path().join("env.py"),
        format!(
            "class Guess:\n    made = 0\n\n    def __init__(self):\n        Guess.made += 1\n        \
             self.target, self.guesses = None, 0\n\n    def reset(self, **row):\n        \
             self.target, self.guesses = row['answer'], 0\n        return {obs}\n\n    \
             def guess(self, value: str) -> str:\n        \"\"\"Guesses the answer.\n\n        \
             Args:\n            value: The guess.\n        \"\"\"\n        self.guesses += 1\n        \
             return 'right' if value == self.target else 'wrong'\n\n    def get_reward(self):\n        \
             return 1.0 if self.guesses == 1 else 0.0\n\n\n\
             # TRL passes `environments=` to reward functions: this one is scored by the tool host.\n\
             def guessed(environments, prompts, completions, answer, **kwargs):\n    \
             return [e.guesses + 10 * (a == '408') + 100 * len(c) + 1000 * isinstance(p, list)\n            \
             for e, p, c, a in zip(environments, prompts, completions, answer)]\n\n\n\
             # No `environments`: served by grpo's reward adapter.\n\
             def plain(completions, **kwargs):\n    return [0.5 for _ in completions]\n"
        ),
    )
    .unwrap();
    let template =
        std::fs::read_to_string(repo().join("examples/templates/chatml_tools.jinja")).unwrap();
    let tok = tok
        .with_chat_template(&template, "chatml_tools.jinja")
        .unwrap();
    let target = format!("{}:Guess", dir.path().join("env.py").display());
    let mut spec = ToolSpec::new(vec![], Some(target.clone()));
    spec.processes = 1;
    let env_py = dir.path().join("env.py").display().to_string();
    spec.reward_functions = vec![format!("{env_py}:guessed"), format!("{env_py}:plain")];
    let host = ToolHost::start(spec).unwrap();
    let o = AgentOptions {
        format: None,
        max_iterations: 2,
        max_tokens: 400,
        model: "tiny".into(),
        system_prompt: None,
        max_prompt_length: None,
        environment: Some(target),
    };
    let (agent, tok) = Agent::start(host, tok, &o).unwrap();
    (agent, tok, dir)
}

#[test]
fn an_environment_class_runs_as_trl_runs_it() {
    let (_, tok, _dir) = tiny();
    let (agent, tok, _env) = env_agent(tok, false);
    assert_eq!(agent.environment_reward_name().as_deref(), Some("Guess"));
    // get_reward, then the reward function that takes `environments` (not `plain`).
    let sources = agent.environment_rewards();
    assert_eq!(sources.len(), 2, "{sources:?}");
    assert_eq!(sources[0], EnvironmentReward::GetReward("Guess".into()));
    assert!(
        matches!(&sources[1], EnvironmentReward::Function(f) if f.ends_with("env.py:guessed")),
        "{sources:?}"
    );
    let sampler = Scripted2 {
        turns: vec![
            "<tool_call>\n{\"name\": \"guess\", \"arguments\": {\"value\": \"408\"}}\n</tool_call>"
                .into(),
            "Done.<|im_end|>".into(),
        ],
    };
    let ex = example();
    let prompt = grpo::data::prompt_ids(&tok, &ex, None, None).unwrap();
    let (eps, _) = agent
        .rollout(
            &sampler,
            &[0],
            vec![prompt],
            &[7],
            3,
            &SamplingParams::default(),
            &[ex],
        )
        .unwrap();
    assert_eq!(eps.len(), 3);
    for e in &eps {
        // reset's observation is appended to the last user message (TRL), the same for the group.
        let shown = tok.decode(&e.prompt_ids, false).unwrap();
        assert!(
            shown.contains("What is 12 * 34? (you may guess)<|im_end|>"),
            "{shown}"
        );
        assert_eq!(e.prompt_ids, eps[0].prompt_ids);
        let t = e.agent.as_ref().unwrap();
        assert_eq!(t.messages[1]["content"], "right");
        assert_eq!(t.tool_calls, ["guess"]);
        // guessed: 1 guess + 10 (the answer column) + 100 * 3 messages (assistant, tool,
        // assistant), the prompt a string (not messages: + 0), computed on the episode's own
        // instance.
        assert_eq!(t.env_rewards, [Some(1.0), Some(311.0)]);
    }
    // The environment's rewards are rewards like the others.
    let reward = |name: &str, k| grpo::rewards::Reward {
        name: name.into(),
        func: grpo::rewards::RewardFn::Environment(k),
        weight: 1.0,
    };
    let rewards = [reward("Guess", 0), reward("guessed", 1)];
    let mut scored = eps.clone();
    grpo::rollout::score(&mut scored, &[example()], &rewards, &[0, 1], None).unwrap();
    assert!(scored.iter().all(|e| e.rewards == [1.0, 311.0]));
}

#[test]
fn episodes_whose_observations_differ_each_sample_from_their_own_prompt() {
    let (_, tok, _dir) = tiny();
    let (agent, tok, _env) = env_agent(tok, true);
    let sampler = Scripted2 {
        turns: vec!["No tools needed.<|im_end|>".into()],
    };
    let ex = example();
    let prompt = grpo::data::prompt_ids(&tok, &ex, None, None).unwrap();
    let (eps, _) = agent
        .rollout(
            &sampler,
            &[0],
            vec![prompt],
            &[7],
            3,
            &SamplingParams::default(),
            &[ex],
        )
        .unwrap();
    let shown: Vec<String> = eps
        .iter()
        .map(|e| tok.decode(&e.prompt_ids, false).unwrap())
        .collect();
    assert!(
        shown.iter().all(|s| s.contains("What is 12 * 34? (table ")),
        "{shown:?}"
    );
    assert!(shown[0] != shown[1] && shown[1] != shown[2], "{shown:?}");
    assert!(eps.iter().all(|e| e.group == 0 && e.example == 0));
    // Never guessed: reward 0.
    assert!(eps
        .iter()
        .all(|e| e.agent.as_ref().unwrap().env_rewards[0] == Some(0.0)));
}

#[test]
fn training_with_an_environment_and_lora_runs_and_scores_its_reward() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    support::tiny_llama(&model, &fixtures());
    let (_, tok, _d) = tiny();
    // Each instance's observation its own: every episode samples from its own prompt.
    let (_agent, _tok, env) = env_agent(tok, true);
    let out = dir.path().join("out");
    let text = format!(
        "model = \"{}\"\noutput_dir = \"{}\"\nnum_generations = 4\nper_device_train_batch_size = 8\n\
         max_completion_length = 6\nmax_steps = 2\nsave_steps = 0\nthreads = 2\nlearning_rate = 1e-3\n\
         report_to = []\nenvironment_factory = \"{env_py}:Guess\"\nchat_template = \"{}\"\n\
         [lora]\nr = 4\n[task]\ntrain_size = 8\neval_size = 2\n\
         [[rewards]]\nkind = \"answer_match\"\n\
         [[rewards]]\nkind = \"python\"\nfunction = \"{env_py}:guessed\"\n\
         [[rewards]]\nkind = \"python\"\nfunction = \"{env_py}:plain\"\n",
        model.display(),
        out.display(),
        repo().join("examples/templates/chatml_tools.jinja").display(),
        env_py = env.path().join("env.py").display(),
    );
    let cfg =
        grpo::config::TrainConfig::from_str(&text, grpo::config::Format::Toml, "t", &[]).unwrap();
    let done = grpo::train::train(&cfg, &grpo::train::RunControl::default()).unwrap();
    assert_eq!(done.steps, 2);
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    // The environment's reward is scored as `Guess` (never guessed: 0).
    assert!(metrics.contains("\"rewards/Guess/mean\":0.0"), "{metrics}");
    // `guessed` takes `environments`: scored by the tool host on each episode's instance (at
    // least 100 per message of the episode); `plain` by the reward adapter.
    let first: serde_json::Value = metrics
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|r| r["rewards/guessed/mean"].is_number())
        .unwrap_or_else(|| panic!("no rewards/guessed/mean: {metrics}"));
    assert!(
        first["rewards/guessed/mean"].as_f64().unwrap() >= 100.0,
        "{first}"
    );
    assert_eq!(first["rewards/plain/mean"].as_f64(), Some(0.5), "{first}");
    // LoRA: the run trained adapters.
    assert!(out.join("checkpoint-2/adapter_model.safetensors").is_file());
}

/// Weights of a checkpoint, by name.
fn checkpoint_weights(dir: &Path) -> Vec<(String, Vec<f32>)> {
    let m = load_model(
        &ModelSource::HfDir(dir.to_path_buf()),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let mut w: Vec<(String, Vec<f32>)> = m
        .tensors
        .into_iter()
        .map(|(k, v)| (k, v.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect();
    w.sort_by(|a, b| a.0.cmp(&b.0));
    w
}

#[test]
fn an_agent_run_resumed_mid_run_equals_the_uninterrupted_one() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    support::tiny_llama(&model, &fixtures());
    let cfg = |out: &Path| {
        let text = format!(
            "model = \"{}\"\noutput_dir = \"{}\"\nnum_generations = 4\nper_device_train_batch_size = 8\n\
             max_completion_length = 24\nmax_steps = 4\nsave_steps = 2\nthreads = 2\nlearning_rate = 1e-3\n\
             report_to = []\ntools = [\"{}:calculator\"]\nchat_template = \"{}\"\n\
             sft_warmup_steps = 4\nsft_warmup_learning_rate = 1e-2\n\
             [task]\ntrain_size = 16\neval_size = 2\nops = [\"*\"]\n",
            model.display(),
            out.display(),
            repo().join("examples/agents/calculator.py").display(),
            repo().join("examples/templates/chatml_tools.jinja").display(),
        );
        grpo::config::TrainConfig::from_str(&text, grpo::config::Format::Toml, "t", &[]).unwrap()
    };
    let (full, part) = (dir.path().join("full"), dir.path().join("part"));
    let ctl = grpo::train::RunControl::default;
    assert_eq!(grpo::train::train(&cfg(&full), &ctl()).unwrap().steps, 4);
    let first = grpo::train::RunControl {
        max_rounds_this_run: Some(2),
        ..ctl()
    };
    assert!(grpo::train::train(&cfg(&part), &first).unwrap().interrupted);
    let again = grpo::train::RunControl {
        resume: true,
        ..ctl()
    };
    assert_eq!(grpo::train::train(&cfg(&part), &again).unwrap().steps, 4);
    assert!(
        checkpoint_weights(&full.join("checkpoint-4"))
            == checkpoint_weights(&part.join("checkpoint-4")),
        "weights differ after resume"
    );
    let rows = |d: &Path| -> Vec<serde_json::Value> {
        std::fs::read_to_string(d.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
                v.as_object_mut().unwrap().retain(|k, _| {
                    !k.starts_with("time")
                        && !k.starts_with("memory/")
                        && k != "tokens_per_second"
                        && !k.starts_with("agent/tool_seconds")
                        // Health checks start afresh in a resumed run (not trainer state).
                        && !k.starts_with("health/")
                });
                v
            })
            .collect()
    };
    assert_eq!(rows(&full), rows(&part));
}

/// The calculator conversation of `example()` in TRL's SFT form.
const TRACE_LINE: &str = r#"{"messages": [{"role": "user", "content": "What is 12 * 34?"}, {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12 * 34"}}}]}, {"role": "tool", "name": "calculator", "content": "408"}, {"role": "assistant", "content": "408"}]}"#;

#[test]
fn warm_up_traces_from_a_file_are_the_built_in_ones_for_the_same_conversation() {
    let (_, tok, _d) = tiny();
    let (agent, tok) = calculator_agent(tok);
    let mut ex = example();
    for (k, v) in [
        ("a", serde_json::json!(12)),
        ("b", serde_json::json!(34)),
        ("op", serde_json::json!("*")),
    ] {
        ex.metadata.insert(k.into(), v);
    }
    let prompt = grpo::data::prompt_ids(&tok, &ex, None, None).unwrap();
    let eos = tok.eos_token_id().unwrap();
    let built = agent.arithmetic_traces(&[ex], &[prompt], 1, eos).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("traces.jsonl");
    std::fs::write(&file, format!("{TRACE_LINE}\n\n")).unwrap();
    let conversations = grpo::agents::traces::read_conversations(&file).unwrap();
    let from_file = agent.conversation_traces(&conversations, eos).unwrap();
    assert_eq!(from_file, built);
    // Only the model's tokens are learned: the call, then the answer; the tool turn is not.
    let s = &from_file[0].sampled;
    assert!(s[0] && *s.last().unwrap() && s.iter().any(|&x| !x), "{s:?}");

    // A bad line is named by file and line.
    std::fs::write(&file, format!("{TRACE_LINE}\n{{\"messages\": []}}\n")).unwrap();
    let e = grpo::agents::traces::read_conversations(&file)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("sft_warmup_file") && e.contains("traces.jsonl:2"),
        "{e}"
    );
}

#[test]
fn the_warm_up_trains_on_a_file_of_conversations() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    support::tiny_llama(&model, &fixtures());
    let traces = dir.path().join("traces.jsonl");
    std::fs::write(&traces, format!("{TRACE_LINE}\n")).unwrap();
    let out = dir.path().join("out");
    let text = format!(
        "model = \"{}\"\noutput_dir = \"{}\"\nnum_generations = 4\nper_device_train_batch_size = 8\n\
         max_completion_length = 6\nmax_steps = 1\nsave_steps = 0\nthreads = 2\n\
         report_to = []\ntools = [\"{}:calculator\"]\nchat_template = \"{}\"\n\
         sft_warmup_steps = 3\nsft_warmup_learning_rate = 1e-2\nsft_warmup_file = \"{}\"\n\
         eval_steps = 0\n[task]\ntrain_size = 8\neval_size = 2\n",
        model.display(),
        out.display(),
        repo().join("examples/agents/calculator.py").display(),
        repo().join("examples/templates/chatml_tools.jinja").display(),
        traces.display(),
    );
    let cfg =
        grpo::config::TrainConfig::from_str(&text, grpo::config::Format::Toml, "t", &[]).unwrap();
    grpo::train::train(&cfg, &grpo::train::RunControl::default()).unwrap();
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let ce: Vec<f64> = metrics
        .lines()
        .filter_map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["warmup/cross_entropy"].as_f64()
        })
        .collect();
    // The one conversation, 8 times a step: learned quickly.
    assert_eq!(ce.len(), 3, "{metrics}");
    assert!(ce[2] < ce[0], "warm-up cross-entropy {ce:?}");
}

#[test]
fn dynamic_sampling_samples_more_episodes_until_groups_have_signal() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    support::tiny_llama(&model, &fixtures());
    let out = dir.path().join("out");
    // Rewards that differ within groups even for the random tiny model (a letter in the
    // answer, group diversity), so kept groups exist; every round logs what dynamic sampling did.
    let text = format!(
        "model = \"{}\"\noutput_dir = \"{}\"\nnum_generations = 4\nper_device_train_batch_size = 8\n\
         max_completion_length = 6\nmax_steps = 2\nsave_steps = 0\nthreads = 2\n\
         report_to = []\ntools = [\"{}:calculator\"]\nchat_template = \"{}\"\n\
         max_tool_calling_iterations = 1\ndynamic_sampling = true\neval_steps = 0\n\
         [task]\ntrain_size = 16\neval_size = 2\n\
         [[rewards]]\nkind = \"format\"\npattern = \"[xzqjkv]\"\n\
         [[rewards]]\nkind = \"diversity\"\nweight = 0.5\n",
        model.display(),
        out.display(),
        repo().join("examples/agents/calculator.py").display(),
        repo().join("examples/templates/chatml_tools.jinja").display(),
    );
    let cfg =
        grpo::config::TrainConfig::from_str(&text, grpo::config::Format::Toml, "t", &[]).unwrap();
    let done = grpo::train::train(&cfg, &grpo::train::RunControl::default()).unwrap();
    assert_eq!(done.steps, 2);
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let rows: Vec<serde_json::Value> = metrics
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|r: &serde_json::Value| r["dynamic_sampling/groups_sampled"].is_number())
        .collect();
    assert_eq!(rows.len(), 2, "{metrics}");
    for r in &rows {
        let n = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("no {k}: {r}"));
        let (sampled, dropped) = (
            n("dynamic_sampling/groups_sampled"),
            n("dynamic_sampling/groups_dropped"),
        );
        assert!(sampled >= 2.0 && dropped < sampled, "{r}");
        assert!(n("dynamic_sampling/groups_kept") >= 1.0, "{r}");
        // The round's episodes are agent episodes.
        assert!(n("agent/turns_per_episode") >= 1.0, "{r}");
    }
}
