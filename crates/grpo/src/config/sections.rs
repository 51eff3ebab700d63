//! The keys, each declared once with its section, type, default and help. Each section is a
//! struct that serde reads from the merged values (its field's type is the key's type, read by
//! [`values::lenient`]); the same declaration gives [`reference`] (`grpo config --print`). The
//! option types of the math (`LossOptions`, `SamplingParams`, `LoraConfig`, ...) are built from
//! their section here, in one place each.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde_json::Value;

use super::values::{
    self, DTypeOpt, DeviceSpec, FromValue, MaskRatio, PolicyType, SaveStrategy, SpanLen,
};
use crate::advantages::{RewardAggregation, ScaleRewards};
use crate::loss::{
    AdaptiveEntropy, AdaptiveKlCfg, IsLevel, KlMode, LossOptions, LossType, VespoParams,
};
use crate::optim::{LrSchedule, ZeroStage};
use crate::{Error, Result};
use grpo_models::error::nearest;
use grpo_models::models::QuantType;
use grpo_models::sampler::SamplingParams;

/// One declared key (see [`sections!`]).
pub(super) struct KeyDef {
    pub key: &'static str,
    pub section: &'static str,
    /// Default as TOML text; empty = unset.
    pub default: &'static str,
    /// What an unset key reads as, when not the type's own unset value (not a default: the key
    /// stays unset in the resolved config).
    unset: &'static str,
    help: &'static str,
    /// What the key accepts, when the declaration says more than its type.
    kind: Option<&'static str>,
    type_kind: fn() -> std::borrow::Cow<'static, str>,
}

/// One documented key.
#[derive(Debug, Clone)]
pub struct KeyDoc {
    pub key: &'static str,
    /// The accepted values: `int`, `list of string`, `grpo|bnpo|dr_grpo|dapo`, ...
    pub kind: String,
    /// Default as TOML text; empty = unset.
    pub default: &'static str,
    pub help: &'static str,
    pub section: &'static str,
}

/// Declares every section and its keys once:
///
/// ```text
/// Struct section {
///     field ["dotted.key"]: Type [as "kind"] = "default as TOML" [unset "value"] [check f], "help";
/// }
/// ```
///
/// and generates one struct per section (a field per key, read by serde through
/// [`values::lenient`], then checked by `f` when given: a rule on the key alone) and the table
/// [`KEYS`] (key, section, default, help; the kind comes from
/// the type unless `as` gives it). The key is the field's name unless a dotted key is given.
macro_rules! sections {
    ($( $(#[$sm:meta])* $name:ident $section:ident {
        $( $field:ident $($key:literal)? : $ty:ty $(as $kind:literal)? = $default:literal
           $(unset $unset:literal)? $(check $check:path)?, $help:literal; )*
    } )*) => {
        $(
            $(#[$sm])*
            #[derive(Debug, Clone, PartialEq, serde::Deserialize)]
            #[serde(deny_unknown_fields)]
            // The help texts are written for `grpo config --print` (`[[rewards]]` is no link).
            #[allow(rustdoc::broken_intra_doc_links)]
            pub struct $name {
                $(
                    #[doc = $help]
                    $(#[serde(rename = $key)])?
                    #[serde(deserialize_with = "values::lenient")]
                    pub $field: $ty,
                )*
            }

            impl $name {
                /// This section's keys read from the merged values, each checked by its `check`.
                fn read(merged: &BTreeMap<String, Value>) -> Result<Self> {
                    let s: Self = read_section(stringify!($section), merged)?;
                    $(
                        let checks: &[fn(&$ty) -> std::result::Result<(), String>] =
                            &[$($check)?];
                        for check in checks {
                            check(&s.$field)
                                .map_err(|e| Error::config(sections!(@key $field $($key)?), e))?;
                        }
                    )*
                    Ok(s)
                }
            }
        )*

        /// Every key, in `grpo config --print` order.
        pub(super) const KEYS: &[KeyDef] = &[$($(
            KeyDef {
                key: sections!(@key $field $($key)?),
                section: stringify!($section),
                default: $default,
                unset: sections!(@unset $($unset)?),
                help: $help,
                kind: sections!(@kind $($kind)?),
                type_kind: <$ty as FromValue>::kind,
            },
        )*)*];

        /// Every section, read from the merged values (in section order; the first bad value
        /// is the error).
        pub(super) struct Sections {
            $(pub $section: $name,)*
        }

        impl Sections {
            pub(super) fn read(merged: &BTreeMap<String, Value>) -> Result<Self> {
                Ok(Sections { $($section: $name::read(merged)?,)* })
            }
        }
    };
    (@key $field:ident) => { stringify!($field) };
    (@key $field:ident $key:literal) => { $key };
    (@kind) => { None };
    (@kind $kind:literal) => { Some($kind) };
    (@unset) => { "" };
    (@unset $unset:literal) => { $unset };
}

/// Reads `section`'s keys with serde: unset keys are null (or their `unset` value); an error
/// names the key.
fn read_section<T: serde::de::DeserializeOwned>(
    section: &str,
    merged: &BTreeMap<String, Value>,
) -> Result<T> {
    let map: serde_json::Map<String, Value> = KEYS
        .iter()
        .filter(|k| k.section == section)
        .map(|k| {
            let v = match merged.get(k.key).filter(|v| !v.is_null()) {
                Some(v) => v.clone(),
                None if !k.unset.is_empty() => super::parse_override_value(k.unset),
                None => Value::Null,
            };
            (k.key.to_string(), v)
        })
        .collect();
    serde_path_to_error::deserialize(Value::Object(map))
        .map_err(|e| Error::config(e.path().to_string(), e.inner()))
}

/// Every key: name, type, default (as text), one-line help.
pub fn reference() -> Vec<KeyDoc> {
    KEYS.iter()
        .map(|k| KeyDoc {
            key: k.key,
            kind: k
                .kind
                .map_or_else(|| (k.type_kind)().into_owned(), str::to_owned),
            default: k.default,
            help: k.help,
            section: k.section,
        })
        .collect()
}

/// Whether `key` is one of grpo's keys.
pub(super) fn is_key(key: &str) -> bool {
    KEYS.iter().any(|d| d.key == key)
}

/// "; did you mean `key`?" for an unknown key.
pub(super) fn suggest(key: &str) -> String {
    let keys: Vec<&str> = KEYS.iter().map(|k| k.key).collect();
    match nearest(key, &keys) {
        Some(k) => format!("; did you mean `{k}`?"),
        None => "; `grpo config --print` lists every key".into(),
    }
}

sections! {
    /// `[run]` keys.
    Run run {
        judge: Option<PathBuf> = "", "fill_in: the judge (a *ForSequenceClassification directory) whose probability of the label `real` (else its last label) rewards the fills when no [[rewards]] are given (unset: the built-in task's pretrained judge)";
        policy: PolicyType = "", "what is trained: causal_lm (completions token by token; unset) or fill_in (a masked-LM generator filling every masked position at once)";
        model: Option<String> = "", "HF directory, .gguf file or hub id (unset: SmolLM2-135M-Instruct, fetched once)";
        dtype: DTypeOpt = "\"f32\"", "compute precision of sampling, the reference and the training forward: f32, bf16 (mixed precision: bf16 weights and activations, f32 master parameters, AdamW moments, log-softmax and loss), or auto (bf16 on a GPU and on a CPU whose bf16 products, AVX512_BF16 or AMX, measure at least 1.25x its f32 ones; f32 elsewhere; the log says which)";
        output_dir: PathBuf = "\"runs/grpo\"", "where metrics, samples and checkpoints go";
        seed: u64 = "42", "seeds prompt order and sampling; a run is reproducible from it";
        threads: Option<usize> = "", "CPU threads (unset: all cores)";
        device: DeviceSpec = "", "where training runs: auto (unset: a GPU when this build has CUDA and one answers, else the CPU; the run says which), cpu, cuda or cuda:N (needs a build with --features cuda)";
        kernels: Option<grpo_models::kernels::Kernels> = "", "CPU kernels: auto or fused (grpo's fused f32 kernels where they apply), or portable (candle ops only: the path a GPU runs, on the CPU); unset: GRPO_KERNELS, else fused";
        max_steps: Option<u64> = "-1", "optimizer steps to run (-1: from num_train_epochs)";
        num_train_epochs: f64 = "1.0", "passes over the prompts when max_steps is -1";
        save_on_signal: bool = "true", "SIGTERM / SIGINT (Slurm or Kubernetes preemption, Ctrl-C) finish the current step, save a checkpoint and exit 75 (EX_TEMPFAIL: not finished, requeue; GRPO_PREEMPTED_EXIT_CODE sets another, 0 the old behaviour) (false: exit at once, 143 / 130, without one)";
    }
    /// `[data]` keys.
    Data data {
        train_file: Option<PathBuf> = "", "prompts (.jsonl, .csv, .parquet, or .txt with one prompt per line; one `*` in the file name reads every matching shard, e.g. data/train-*.parquet); unset: the built-in task";
        eval_file: Option<PathBuf> = "", "held-out prompts for evaluation (the built-in task has its own)";
        prompt_field: String = "\"prompt\"", "field holding the prompt: a string or a list of {role, content} messages; a dotted path (prompt.text) reads a field of a nested record, in JSONL and Parquet";
        answer_field: String = "\"answer\"", "field holding the reference answer passed to rewards";
        system_prompt: Option<String> = "", "system message put before each prompt (unless it has one)";
        shuffle_dataset: bool = "true", "shuffle prompts each epoch (seeded)";
        skip_bad_rows: bool = "false", "skip and count malformed rows instead of stopping";
        max_prompt_length: Option<usize> = "512", "prompts longer than this are truncated from the left (-1: never)";
        task_train_size "task.train_size": usize = "2000" check values::at_least_one, "built-in task: training problems";
        task_eval_size "task.eval_size": usize = "200", "built-in task: held-out problems";
        task_min_operand "task.min_operand": i64 = "10", "built-in task: smallest operand";
        task_max_operand "task.max_operand": i64 = "99", "built-in task: largest operand";
        task_ops "task.ops": Vec<String> as "list of \"+\" \"-\" \"*\"" = "[\"+\"]" check values::task_ops, "built-in task: operations";
        task_seed "task.seed": u64 = "1234", "built-in task: problem generator seed";
        task_mask_ratio "task.mask_ratio": MaskRatio as "ratio or \"LO..HI\"" = "", "built-in fill-in task (policy = fill_in): share of each equation's characters masked, a ratio or a range drawn per example (unset: 0.1..0.5)";
        mask_ratio: Option<MaskRatio> as "ratio or \"LO..HI\"" = "", "fill_in: mask every training input on the fly, each draw its own masks (held-out inputs once, fixed): the share of its tokens masked, a ratio or a range drawn per input (unset: inputs must hold mask tokens)";
        mask_span: SpanLen as "length or \"LO..HI\"" = "", "fill_in with mask_ratio: length in tokens of each masked span, fixed or drawn per span (unset: 1)";
        mask_seed: Option<usize> = "", "fill_in with mask_ratio: seeds the masks (unset: seed)";
        reward_weights: Option<Vec<f64>> = "", "weight of each reward function (unset: each reward's own weight)";
        reward_errors: String as "raise|missing" = "\"raise\"" check values::reward_errors, "Python package: a reward function (a callable given to GRPOTrainer) that raises: raise stops the run with its traceback, as TRL does; missing loses only that batch's scores of it (missing rewards, a warning), as a scorer program's failure does";
    }
    /// `[generation]` keys.
    Generation generation {
        num_generations: usize = "8" check values::group_size, "completions per prompt (G, the group size)";
        max_completion_length: usize = "256" check values::at_least_one, "maximum new tokens per completion";
        temperature: f64 = "1.0" check values::positive, "sampling temperature (log-probs are taken at the same temperature)";
        temperature_warmup_steps: usize = "0", "optimizer steps over which the sampling temperature moves linearly from temperature_warmup_start to temperature (0: temperature throughout)";
        temperature_warmup_start: f64 = "1.0" check values::positive, "with temperature_warmup_steps: the sampling temperature of the first round";
        temperature_warmup_hold_steps: usize = "0", "with temperature_warmup_steps: optimizer steps sampled at temperature_warmup_start before the warm-up's linear move begins";
        top_p: f64 = "1.0" check values::probability, "nucleus sampling (1: off)";
        top_k: usize = "0", "top-k sampling (0: off)";
        min_p: Option<f64> = "", "min-p sampling (unset: off)";
        repetition_penalty: f64 = "1.0", "HF repetition penalty (1: off)";
        stop: Vec<String> = "[]", "stop strings (EOS always stops)";
        generation_batch_size: Option<usize> = "", "completions per generation round (default per_device_train_batch_size x steps_per_generation)";
        steps_per_generation: Option<usize> = "", "micro-batches per generation round (default gradient_accumulation_steps)";
        sampling_batch_size: Option<usize> = "" check values::whole_groups_when_set, "completions decoded at once, in whole groups (at least one): bounds the sampler's memory; completions do not depend on it (unset: a whole round at once; the seeds' gen_batch_size)";
    }
    /// `[update]` keys.
    Update update {
        per_device_train_batch_size: usize = "8" check values::at_least_one, "completions per micro-batch";
        gradient_accumulation_steps: usize = "1" check values::at_least_one, "micro-batches per optimizer step";
        forward_chunk_tokens: Option<usize> = "" check values::at_least_one_when_set, "tokens per forward/backward pass: a micro-batch is split into chunks of whole groups (the math is unchanged; lower it to save memory, raise it for fewer, larger passes); unset: 1024 under the fused CPU kernels in f32 (passes sized to the CPU's caches), 512 under CPU mixed precision (dtype = bf16 with the fused kernels on an AVX-512 CPU: half the activation memory, same speed), elsewhere (a GPU, kernels = portable, bf16 without AVX-512) as many tokens as a pass's activations fit in half the device's free memory at start, and in at most twice the model's f32 training state (16 bytes a parameter), at least 1024";
        num_iterations: usize = "1" check values::at_least_one, "updates per generation batch (mu in the paper); > 1 uses clipped ratios";
        learning_rate: f64 = "1e-6" check values::positive, "AdamW learning rate";
        adam_beta1: f64 = "0.9" check values::adam_beta, "AdamW beta1";
        adam_beta2: f64 = "0.999" check values::adam_beta, "AdamW beta2";
        adam_epsilon: f64 = "1e-8", "AdamW epsilon";
        weight_decay: f64 = "0.0", "AdamW decoupled weight decay";
        max_grad_norm: f64 = "1.0", "clip the global gradient norm (0: off)";
        lr_scheduler_type: LrSchedule = "\"linear\"", "learning-rate schedule";
        warmup_ratio: f64 = "0.0" check values::unit_interval, "share of steps spent warming up";
        warmup_steps: usize = "0", "warm-up steps (wins over warmup_ratio when > 0)";
        max_bad_steps: usize = "3", "a NaN or Inf in a step's rewards, log-probs, loss or gradients skips its update (counted in skipped_steps); this many in a row stop the run with an error";
        zero_stage: ZeroStage as "0|1|2|3" = "" unset "0", "across ranks (docs/distributed.md), how the training state is sharded, as DeepSpeed's ZeRO stages: 0 every rank keeps all of it; 1 each rank keeps AdamW's moments for its 1/N of the parameters, steps that part and the parts are gathered (the same numbers as 0, to the bit); 2 also the summed gradients, reduce-scattered instead of all-reduced (0's numbers to float tolerance); 3 the parameters too: each rank keeps 1/N of the f32 weights, each block is gathered for its forward and for gradient checkpointing's recomputation (so 3 needs gradient_checkpointing = true; full fine-tuning of a Llama-family model), its gradients reduce-scattered right after its backward, and sampling gathers the whole weights once per pass. Checkpoints are the same whatever the stage, and resume on any number of ranks (unset: 0)";
        gradient_checkpointing: bool = "false", "keep only each block's input during the forward and recompute the block in the backward (less memory, one more forward); sampling then also skips the packed copy of the weights for the decoding GEMM (slower generation, lower peak with LoRA)";
    }
    /// `[lora]` keys.
    Lora lora {
        r "lora.r": usize = "0", "LoRA rank: train adapters on a frozen base (0: full fine-tuning; TRL: lora_r)";
        alpha "lora.alpha": Option<f64> = "", "LoRA alpha; the adapter output is scaled by alpha / r (unset: 2 x r)";
        dropout "lora.dropout": f64 = "0.05", "dropout on the adapters' input during training";
        target_modules "lora.target_modules": Vec<String> = "", "projections that get adapters, by name (q_proj, v_proj, ...) or \"all-linear\" (unset: q_proj, v_proj; GPT-2: c_attn)";
        use_rslora "lora.use_rslora": bool = "false", "rank-stabilized LoRA: scale by alpha / sqrt(r)";
        base_quantization: Option<QuantType> = "\"none\"", "QLoRA: keep the frozen base quantized (needs lora.r > 0); a GGUF of the same type is used as is";
    }
    /// `[loss]` keys.
    Loss loss {
        loss_type: LossType = "\"dapo\"", "token-loss reduction, with TRL's normalizations";
        beta: f64 = "0.0" check values::non_negative, "weight of the k3 KL penalty to the reference model in the loss";
        epsilon: f64 = "0.2" check values::not_negative, "lower clipping range of the ratio";
        epsilon_high: Option<f64> = "" check values::not_negative_when_set, "upper clipping range (default: epsilon)";
        delta: Option<f64> = "", "two-sided clipping: cap on the unclipped ratio (unset: off)";
        importance_sampling_level: IsLevel = "\"token\"", "ratio per token, or per sequence (GSPO)";
        scale_rewards: ScaleRewards = "\"group\"", "std used to scale advantages (none: Dr. GRPO)";
        mask_truncated_completions: bool = "false", "leave completions that hit max_completion_length out of the loss";
        entropy_coef: f64 = "0.0", "entropy bonus weight";
        use_bias_correction_kl: bool = "true", "multiply the KL term by the importance ratio (unbiased reverse-KL gradient, TRL's default)";
        sapo_temperature_pos: f64 = "" unset "1.0", "loss_type = sapo: the gate's temperature for tokens with positive advantage (unset: 1.0)";
        sapo_temperature_neg: f64 = "" unset "1.05", "loss_type = sapo: the gate's temperature for tokens with non-positive advantage (unset: 1.05)";
        vespo_k_pos: f64 = "2.0" check values::finite, "loss_type = vespo: shape k of the Gamma weight for non-negative advantages";
        vespo_lambda_pos: f64 = "3.0" check values::finite, "loss_type = vespo: rate lambda of the Gamma weight for non-negative advantages";
        vespo_k_neg: f64 = "3.0" check values::finite, "loss_type = vespo: shape k for negative advantages";
        vespo_lambda_neg: f64 = "2.0" check values::finite, "loss_type = vespo: rate lambda for negative advantages";
        top_entropy_quantile: f64 = "1.0" check values::quantile, "keep in the policy term only this top share of each micro-batch's tokens by entropy (\"Beyond the 80/20 rule\"; 0.2 in the paper; 1: all tokens)";
        off_policy_mask_threshold: Option<f64> = "" check values::finite_when_set, "drop from the policy term sequences with a negative advantage whose mean old-minus-current log-prob exceeds this (DeepSeek-V3.2; e.g. 0.5; unset: off)";
        use_adaptive_entropy: bool = "false", "adaptive entropy control (Skywork-OR1): entropy_coef moves by entropy_coef_delta each step towards keeping the entropy above entropy_target, and applies only while the entropy is at or below it";
        entropy_coef_min: f64 = "0.0", "adaptive entropy control: smallest entropy_coef";
        entropy_coef_max: f64 = "1.0", "adaptive entropy control: largest entropy_coef";
        entropy_coef_delta: f64 = "0.005", "adaptive entropy control: change of entropy_coef per optimizer step";
        entropy_target: f64 = "0.2", "adaptive entropy control: target mean entropy per token, in nats (set it near the entropy of the first steps)";
        reward_std_floor: Option<f64> = "", "clamp each group's reward std from below before scaling";
        multi_objective_aggregation: RewardAggregation = "\"sum_then_normalize\"", "several rewards: weighted sum then advantages, or each normalized in its group, summed, normalized over the batch (GDPO)";
        normalize_advantages_batch: bool = "false", "re-normalize all advantages of a batch to mean 0, std 1";
        advantage_epsilon: f64 = "1e-4" check values::non_negative, "added to the std before dividing by it (group or batch scaling, batch re-normalization): TRL's 1e-4; seed 000 and seed 004 use 1e-8";
        drop_zero_std_groups: bool = "false", "leave groups whose rewards all equal out of the update";
        kl_coef: f64 = "0.0" check values::non_negative, "KL in the reward: reward - kl_coef x sum_t(logp - ref_logp)";
        kl_target: Option<f64> = "", "adaptive KL controller target (unset: fixed kl_coef)";
        kl_horizon: f64 = "10000.0", "adaptive KL controller horizon, in samples";
        sync_ref_model: bool = "false", "mix the policy into the reference every ref_model_sync_steps";
        ref_model_sync_steps: usize = "512" check values::at_least_one, "steps between reference syncs";
        ref_model_mixup_alpha: f64 = "0.6", "ref = alpha x policy + (1 - alpha) x ref at each sync";
    }
    /// `[agent]` keys: multi-turn episodes with tools (docs/agents.md).
    Agent agent {
        tools: Vec<String> = "[]", "agents: the model may call these Python functions during an episode, as TRL's tools= takes them (path/to/file.py:name, module:name or module.name; their JSON schemas come from type hints and docstrings, as transformers' get_json_schema builds them); [] = no tools";
        environment_factory: Option<String> = "", "agents: an environment class (path/to/env.py:Env or module.Env), as TRL's environment_factory takes it: one instance per episode, reset(**row) with the dataset row (a string it returns is appended to the prompt's last user message), its public methods as tools, and its get_reward() method, when it has one, as one more reward named after the class";
        environment_command: Vec<String> = "[]", "agents: an environment program and its arguments (e.g. [\"python3\", \"env.py\"]), any language, speaking JSON lines on stdin/stdout (docs/agents.md): reset with the dataset row (its observation is appended to the prompt's last user message), then every model turn is an action whose observation continues the episode as a user message, until done; the steps' rewards sum to a reward named environment. tool_max_concurrency copies run (episode e in copy e % copies), each request within tool_timeout_s, in the tools' sandbox (tool_cpu_seconds, tool_memory_mb, tool_no_network); a copy that dies, hangs or answers garbage costs only its episodes and is restarted; [] = none";
        environment_url: Option<String> = "", "agents: an environment service's address (http://host:port/path), speaking the environment_command protocol over HTTP: each request is POSTed as JSON to {url}/reset, {url}/step, {url}/close; checked to answer before training";
        max_tool_calling_iterations: Option<usize> = "" check values::at_least_one_when_set, "agents: turns that call tools, at most, per episode (TRL's name; unset: 5); the episode ends at the next turn that calls one";
        max_episode_tokens: Option<usize> = "" check values::at_least_one_when_set, "agents: tokens after the prompt, the model's and the tools' together, at most (unset: max_completion_length x (max_tool_calling_iterations + 1)); each model turn is at most max_completion_length";
        tool_call_format: Option<String> as "hermes|llama3|mistral" = "", "agents: how the model writes tool calls (unset: read from its chat template: <tool_call> is hermes (Qwen, SmolLM3), <|python_tag|> llama3, [TOOL_CALLS] mistral)";
        chat_template: Option<PathBuf> = "", "a Jinja chat template file used instead of the model's (agents need one that renders `tools` and tool messages; examples/templates/chatml_tools.jinja does for ChatML models such as SmolLM2)";
        tool_timeout_s: f64 = "10.0" check values::positive, "agents: seconds a tool call may take; a slower one is killed (with its process) and answers the model with a timeout error (also each request to an environment program or service)";
        tool_max_concurrency: usize = "4" check values::at_least_one, "agents: tool calls running at once (each in a Python process of its own); also an environment program's copies, or requests at once to an environment service";
        tool_max_result_chars: usize = "4096" check values::at_least_one, "agents: a tool's result (or an environment program's observation) is cut to this many characters";
        tool_cpu_seconds: Option<usize> = "" check values::at_least_one_when_set, "agents: RLIMIT_CPU of each tool process and what it starts (CPU seconds over the process's life; a process past it is killed and restarted, its call answered with an error), as a scorer's cpu_seconds (unset: no limit)";
        tool_memory_mb: Option<usize> = "" check values::at_least_one_when_set, "agents: RLIMIT_AS of each tool process and what it starts, in MiB, as a scorer's memory_mb (unset: no limit)";
        tool_no_network: bool = "false", "agents: run the tool processes in a network namespace of their own (no network but their own loopback), as a scorer's no_network";
        sft_warmup_steps: usize = "0", "agents: optimizer steps of supervised fine-tuning on tool-use traces before GRPO, in a fresh run (0: none): a small model that never calls a tool on its own learns the call format first, as agentic RL runs usually start. The traces are made from the built-in arithmetic task's training problems with the first tool (one string argument, the expression; hermes format): a call, the tool's real answer, the final answer";
        sft_warmup_file: Option<PathBuf> = "", "agents: the warm-up's traces from this JSONL file instead of the built-in task's: conversations in TRL's SFT form ({\"messages\": [...]} or {\"prompt\": [...], \"completion\": [...]}), assistant turns with tool_calls, tool results, a final answer (docs/agents.md); only the assistant's tokens are learned";
        sft_warmup_learning_rate: Option<f64> = "" check values::positive_when_set, "agents: the warm-up's constant learning rate (unset: learning_rate)";
    }
    /// `[logging]` keys.
    Logging logging {
        logging_steps: usize = "1", "log metrics every N steps";
        log_completions: bool = "true", "write prompts, completions, rewards and advantages to completions.jsonl";
        log_completions_steps: usize = "10", "every N generation rounds";
        num_completions_to_print: usize = "2", "samples shown on the console when completions are logged";
        save_steps: usize = "500", "checkpoint every N steps (0: only at the end)";
        save_strategy: SaveStrategy = "" unset "\"steps\"", "when checkpoints are written: steps (every save_steps, at the end, and when asked to stop; TRL's epoch and best save the same way) or no (never: the trained model is not saved); unset: steps";
        save_only_model: bool = "" unset "false", "checkpoints without the AdamW state (a full fine-tune's checkpoint is then a third of the size), which --resume then cannot continue from (unset: false)";
        save_total_limit: Option<usize> = "", "keep only the newest N checkpoints";
        eval_steps: usize = "0", "evaluate on the held-out prompts every N steps (0: off)";
        eval_num_prompts: Option<usize> = "", "held-out prompts per evaluation (unset: all)";
        eval_num_samples: usize = "4", "sampled completions per held-out prompt, for pass@k and eval/mean_accuracy (0: greedy only; eval_k is then ignored)";
        eval_k: Vec<usize> = "[1]", "report eval/pass@k for each k (unbiased estimator; each k <= eval_num_samples)";
        eval_temperature: Option<f64> = "" check values::greedy_or_positive, "sampling temperature of the eval samples (unset: temperature)";
        eval_greedy: bool = "true", "also one greedy completion per held-out prompt: eval/accuracy";
        correctness_reward: Option<String> = "", "the reward that decides whether a completion is correct in evaluation (pass@k, eval/mean_accuracy, eval/accuracy; in training and grpo eval), by the name its metrics show (a [[rewards]] name, a reward_funcs function's name); any kind: python, command, http, a model, a rule. Correct: its score >= correctness_threshold; unknown where it is missing. Unset: every answer_match-style reward (answer_match, equation, sides_match) scores more than 0.5";
        correctness_threshold: Option<f64> = "" check values::finite_when_set, "a completion is correct when correctness_reward scores at least this (needs correctness_reward; unset: 1.0)";
        report_to: Vec<String> as "list of tensorboard|wandb|mlflow|all|none" = "[\"tensorboard\"]", "where metrics go besides metrics.jsonl (always written): tensorboard (output_dir/tb), wandb (your wandb package; WANDB_* settings apply), mlflow (the server at MLFLOW_TRACKING_URI), all, none";
        run_name: Option<String> = "", "the run's name in W&B and MLflow (unset: the output directory's name)";
        wandb_project: Option<String> = "", "the W&B project (unset: WANDB_PROJECT, else grpo)";
        project: Option<String> = "", "the Trackio project (HF's `project`, for report_to = trackio; unset: huggingface, HF's default)";
        metric_for_best_model: Option<String> = "", "keep the best checkpoint by this logged metric (e.g. eval/accuracy; HF's eval_accuracy and accuracy mean the same): it survives save_total_limit and trainer_state.json names it (unset: off)";
        greater_is_better: Option<bool> = "", "whether a larger metric_for_best_model is better (unset: true, false for a metric named like a loss)";
        load_best_model_at_end: bool = "" unset "false", "end the run with the best checkpoint as its model (needs metric_for_best_model and save_steps a multiple of eval_steps; unset: false)";
        dynamic_sampling: bool = "" unset "false", "DAPO's dynamic sampling: drop groups whose rewards all equal and sample more prompts until the batch is full (unset: false)";
        dynamic_sampling_max_passes: usize = "" unset "4", "dynamic sampling: extra sampling passes per round at most (unset: 4)";
        dynamic_sampling_oversample: f64 = "" unset "1.0" check values::at_least_one_f, "dynamic sampling: the first pass of a round samples this many times the round's prompts in one batched pass and keeps the first with a signal, so that fewer extra passes are needed (unset: 1.0)";
    }
}

/// The built-in arithmetic task (`task.*`).
#[derive(Debug, Clone, PartialEq)]
pub struct TaskConfig {
    pub train_size: usize,
    pub eval_size: usize,
    pub min_operand: i64,
    pub max_operand: i64,
    pub ops: Vec<String>,
    pub seed: u64,
    /// The built-in fill-in task's mask ratio range (`policy = "fill_in"`).
    pub mask_ratio: (f64, f64),
}

impl TaskConfig {
    /// The built-in task generator's parameters.
    pub fn params(&self) -> crate::data::arithmetic::TaskParams {
        crate::data::arithmetic::TaskParams {
            train_size: self.train_size,
            eval_size: self.eval_size,
            min_operand: self.min_operand,
            max_operand: self.max_operand,
            ops: self.ops.iter().filter_map(|s| s.chars().next()).collect(),
            seed: self.seed,
        }
    }
}

impl Data {
    /// The built-in task's settings.
    pub fn task(&self) -> TaskConfig {
        TaskConfig {
            train_size: self.task_train_size,
            eval_size: self.task_eval_size,
            min_operand: self.task_min_operand,
            max_operand: self.task_max_operand,
            ops: self.task_ops.clone(),
            seed: self.task_seed,
            mask_ratio: self.task_mask_ratio.0,
        }
    }
}

impl Generation {
    /// The sampling temperature of the round that starts after `step` optimizer steps:
    /// `temperature_warmup_start` up to step `temperature_warmup_hold_steps`, moving linearly to
    /// `temperature` over the next `temperature_warmup_steps`, then `temperature`.
    pub fn temperature_at(&self, step: u64) -> f64 {
        let n = self.temperature_warmup_steps as u64;
        if n == 0 {
            return self.temperature;
        }
        let into = step.saturating_sub(self.temperature_warmup_hold_steps as u64);
        if into >= n {
            return self.temperature;
        }
        let f = into as f64 / n as f64;
        self.temperature_warmup_start + (self.temperature - self.temperature_warmup_start) * f
    }

    /// The sampler's parameters (at `temperature`).
    pub fn sampling(&self, eos_token_ids: Vec<u32>) -> SamplingParams {
        SamplingParams {
            max_new_tokens: self.max_completion_length,
            min_new_tokens: 0,
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p.unwrap_or(0.0),
            repetition_penalty: self.repetition_penalty,
            stop_strings: self.stop.clone(),
            eos_token_ids,
            max_batch_sequences: self.sampling_batch_size.unwrap_or(0),
        }
    }
}

impl Lora {
    /// The adapters (None: full fine-tuning, `lora.r = 0`); alpha defaults to 2 x r. Empty
    /// `target_modules` means the architecture's default (see [`crate::peft::default_targets`]).
    pub fn adapters(&self) -> Option<crate::peft::LoraConfig> {
        (self.r > 0).then(|| crate::peft::LoraConfig {
            r: self.r,
            alpha: self.alpha.unwrap_or(2.0 * self.r as f64),
            dropout: self.dropout,
            target_modules: self.target_modules.clone(),
            use_rslora: self.use_rslora,
        })
    }
}

impl Loss {
    /// Where the KL to the reference goes: the loss (`beta`), the reward (`kl_coef`, adaptive
    /// with `kl_target`), or nowhere. Both set is refused by validation.
    pub fn kl(&self) -> KlMode {
        if self.beta > 0.0 {
            KlMode::Loss { beta: self.beta }
        } else if self.kl_coef > 0.0 {
            KlMode::Reward {
                coef: self.kl_coef,
                adaptive: self.kl_target.map(|target| AdaptiveKlCfg {
                    target,
                    horizon: self.kl_horizon,
                }),
            }
        } else {
            KlMode::None
        }
    }

    /// The loss's options; `epsilon_high` unset is `epsilon`.
    pub fn options(&self) -> LossOptions {
        LossOptions {
            loss_type: self.loss_type,
            importance_sampling_level: self.importance_sampling_level,
            epsilon_low: self.epsilon,
            epsilon_high: self.epsilon_high.unwrap_or(self.epsilon),
            delta: self.delta,
            beta: self.kl().loss_beta(),
            entropy_coef: self.entropy_coef,
            use_bias_correction_kl: self.use_bias_correction_kl,
            sapo_temperature_pos: self.sapo_temperature_pos,
            sapo_temperature_neg: self.sapo_temperature_neg,
            vespo: VespoParams {
                k_pos: self.vespo_k_pos,
                lambda_pos: self.vespo_lambda_pos,
                k_neg: self.vespo_k_neg,
                lambda_neg: self.vespo_lambda_neg,
            },
            top_entropy_quantile: self.top_entropy_quantile,
            off_policy_mask_threshold: self.off_policy_mask_threshold,
        }
    }

    /// `use_adaptive_entropy`: the controller's starting state (None: a fixed entropy_coef).
    pub fn adaptive_entropy(&self) -> Option<AdaptiveEntropy> {
        self.use_adaptive_entropy.then_some(AdaptiveEntropy {
            coef: self.entropy_coef,
            last_entropy: None,
            min: self.entropy_coef_min,
            max: self.entropy_coef_max,
            delta: self.entropy_coef_delta,
            target: self.entropy_target,
        })
    }
}

impl Logging {
    /// `greater_is_better`; unset: true, false for a metric named like a loss.
    pub fn greater_is_better(&self) -> bool {
        self.greater_is_better.unwrap_or_else(|| {
            !self
                .metric_for_best_model
                .as_deref()
                .is_some_and(|m| m.contains("loss"))
        })
    }
}
