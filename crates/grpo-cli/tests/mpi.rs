//! Data-parallel training on MPI (`--features mpi`; `.ci/run` installs Open MPI and runs these):
//! `mpirun -np 2` with 1 thread per rank against 1 process with 2 threads on the same global batch
//! (the one process's per-device batch is the two ranks' together) on a tiny model. Rewards and
//! advantages are the same to the bit (each group is sampled from the same seed on whichever rank
//! owns it), losses and KL to float tolerance, parameters after 3 steps within 1e-5 relative.
#![cfg(feature = "mpi")]

use std::path::PathBuf;
use std::process::Command;

#[path = "../../grpo/tests/support/tiny_llama.rs"]
mod support;

#[path = "support/ranks.rs"]
mod ranks;
use ranks::{args, assert_same_run, metrics};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn grpo() -> &'static str {
    env!("CARGO_BIN_EXE_grpo")
}

/// `grpo train` with `args`, alone or under `mpirun -np ranks`.
fn train(ranks: usize, args: &[String]) {
    let out = launch(ranks, args);
    assert!(
        out.status.success(),
        "{ranks} rank(s) failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn launch(ranks: usize, args: &[String]) -> std::process::Output {
    let mut cmd = if ranks == 1 {
        Command::new(grpo())
    } else {
        let mut c = Command::new("mpirun");
        c.args([
            "-np",
            &ranks.to_string(),
            "--oversubscribe",
            "--bind-to",
            "none",
        ])
        .args(["-x", "RAYON_NUM_THREADS=1", grpo()]);
        c
    };
    cmd.arg("train")
        .args(args)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
        .env("NO_COLOR", "1");
    cmd.output().expect("mpirun (Open MPI) is installed")
}

#[test]
fn two_ranks_train_as_one_process_does() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    support::tiny_llama(&model, &fixtures());
    for (name, extra) in [
        // With evaluation: the held-out prompts are shared out and the answers gathered.
        (
            "dapo-beta-eval",
            &[
                "--beta=0.04",
                "--num_iterations=2",
                "--eval_steps=1",
                "--eval_num_samples=2",
                "--eval_k=1,2",
            ][..],
        ),
        (
            "batch-bnpo",
            &["--scale_rewards=batch", "--loss_type=bnpo"][..],
        ),
        // LoRA dropout draws its masks per rank (the same distribution, other draws): off here.
        (
            "grpo-lora",
            &[
                "--loss_type=grpo",
                "--lora.r=4",
                "--lora.target_modules=all-linear",
                "--lora.dropout=0",
            ][..],
        ),
    ] {
        let one = tmp.path().join(format!("{name}-1"));
        let two = tmp.path().join(format!("{name}-2"));
        train(1, &args(&model, &one, 8, 2, extra));
        train(2, &args(&model, &two, 4, 1, extra));
        assert_same_run(&one, &two, 3);
        if name.ends_with("eval") {
            let rows = std::fs::read_to_string(two.join("eval/step-0.jsonl")).unwrap();
            assert_eq!(rows.lines().count(), 4, "every held-out prompt, once");
        }
        // Rank 0 alone wrote the run.
        assert!(two.join("config.toml").is_file() && !two.join("rank1").exists());
    }
}

#[test]
fn two_ranks_run_agent_episodes_as_one_process_does() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    support::tiny_llama(&model, &fixtures());
    let repo = fixtures().join("../..");
    let tools = format!(
        "--tools={}:calculator",
        repo.join("examples/agents/calculator.py").display()
    );
    let template = format!(
        "--chat_template={}",
        repo.join("examples/templates/chatml_tools.jinja").display()
    );
    // Each rank runs its own tool processes; the episodes of a group, sampled on whichever rank
    // owns it, are the same, and so are their rewards, advantages and agent metrics.
    let extra = [
        tools.as_str(),
        template.as_str(),
        "--max_tool_calling_iterations=2",
        "--eval_steps=1",
        "--eval_num_samples=2",
    ];
    let one = tmp.path().join("agent-1");
    let two = tmp.path().join("agent-2");
    train(1, &args(&model, &one, 8, 2, &extra));
    train(2, &args(&model, &two, 4, 1, &extra));
    assert_same_run(&one, &two, 3);
    let m = metrics(&two);
    assert!(
        m.iter()
            .any(|r| r["agent/turns_per_episode"].as_f64() >= Some(1.0)),
        "no agent metrics: {m:?}"
    );
}

#[test]
fn a_two_rank_checkpoint_resumes_in_one_process_and_back() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    support::tiny_llama(&model, &fixtures());
    let extra = ["--beta=0.04"];
    let straight = tmp.path().join("straight");
    train(1, &args(&model, &straight, 8, 2, &extra));
    // 2 ranks to step 1, 1 process to step 2, 2 ranks to step 3.
    let mixed = tmp.path().join("mixed");
    let upto = |n: usize| format!("--max_steps={n}");
    let mut a = args(&model, &mixed, 4, 1, &extra);
    a.push(upto(1));
    train(2, &a);
    let mut a = args(&model, &mixed, 8, 2, &extra);
    a.extend([upto(2), "--resume_from_checkpoint=true".into()]);
    train(1, &a);
    let mut a = args(&model, &mixed, 4, 1, &extra);
    a.extend([upto(3), "--resume_from_checkpoint=true".into()]);
    train(2, &a);
    assert_same_run(&straight, &mixed, 3);
}

/// A rank that fails ends the job, naming itself and the cause. What would make the ranks take
/// different numbers of collective calls (`dynamic_sampling`, `drop_zero_std_groups`: each rank
/// drops its own groups) is refused before training, not ended by the collective watchdog.
#[test]
fn a_failing_rank_ends_the_job_naming_itself() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    support::tiny_llama(&model, &fixtures());
    for key in ["dynamic_sampling", "drop_zero_std_groups"] {
        let started = std::time::Instant::now();
        let flag = format!("--{key}=true");
        let out = launch(
            2,
            &args(&model, &tmp.path().join(key), 4, 1, &[flag.as_str()]),
        );
        assert!(!out.status.success());
        let e = String::from_utf8_lossy(&out.stderr);
        assert!(
            e.contains("grpo rank") && e.contains("of 2") && e.contains(key),
            "{e}"
        );
        assert!(e.contains("not supported across 2 ranks"), "{e}");
        assert!(
            !e.contains("GRPO_MPI_TIMEOUT"),
            "the watchdog ended it: {e}"
        );
        assert!(
            started.elapsed().as_secs() < 120,
            "{key}: {:?}",
            started.elapsed()
        );
    }
}

/// Several GPUs (`--features nccl`, opt-in: it needs two CUDA devices and fails, saying so, with
/// fewer): two ranks on two GPUs, gradients summed by NCCL, train as one process on one GPU
/// does on the same global batch, to the tolerances of the CPU case above.
///   cargo test --release --features nccl,mpi -p grpo-cli --test mpi two_gpus
#[cfg(feature = "nccl")]
#[test]
fn two_gpus_with_nccl_train_as_one_gpu_does() {
    if let Err(e) = candle_core::Device::new_cuda(1) {
        panic!("fewer than two CUDA devices ({e}): this opt-in check needs two GPUs");
    }
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    support::tiny_llama(&model, &fixtures());
    let extra = ["--device=cuda", "--beta=0.04"];
    let one = tmp.path().join("one-gpu");
    let two = tmp.path().join("two-gpus");
    train(1, &args(&model, &one, 8, 2, &extra));
    train(2, &args(&model, &two, 4, 1, &extra));
    assert_same_run(&one, &two, 3);
}

/// A rank killed mid-step (SIGKILL at its first micro-batch, as the OOM killer or a lost node
/// does) ends the whole job through mpirun, which names it, well within the collective timeout.
#[test]
fn a_rank_killed_mid_step_ends_the_job() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    support::tiny_llama(&model, &fixtures());
    let started = std::time::Instant::now();
    // Rank 1 alone gets the fault: a shell sets it from Open MPI's rank variable.
    let only_rank_1 = "if [ \"$OMPI_COMM_WORLD_RANK\" = 1 ]; then \
                       export GRPO_FAULTS='update.micro_batch=return(kill)'; fi; exec \"$0\" \"$@\"";
    let out = Command::new("mpirun")
        .args(["-np", "2", "--oversubscribe", "--bind-to", "none"])
        .args(["-x", "RAYON_NUM_THREADS=1", "-x", "GRPO_MPI_TIMEOUT=600"])
        .args(["sh", "-c", only_rank_1, grpo(), "train"])
        .args(args(&model, &tmp.path().join("killed"), 4, 1, &[]))
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
        .env("NO_COLOR", "1")
        .env_remove("GRPO_FAULTS")
        .output()
        .expect("mpirun (Open MPI) is installed");
    let e = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{e}");
    assert!(e.contains("rank 1") && e.contains("signal 9"), "{e}");
    assert!(
        !e.contains("GRPO_MPI_TIMEOUT"),
        "the watchdog ended it: {e}"
    );
    assert!(
        started.elapsed().as_secs() < 60,
        "{:?}: {e}",
        started.elapsed()
    );
}
