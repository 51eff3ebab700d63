//! Launched as clusters launch jobs, without MPI (the default build): each process gets `RANK`,
//! `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT`, as torchrun, Kubernetes' PyTorchJob and Slurm
//! scripts set them, and the ranks meet over TCP at rank 0. Two ranks with 1 thread each train as
//! one process with 2 threads does on the same global batch (the checks of `mpi.rs`); a launch
//! that misses a rank, a rank killed mid-step and a rank that fails each stop every rank with an
//! error that names what it waited for, in seconds, not at the collective timeout.

use std::fs::File;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::Instant;

#[path = "../../grpo/tests/support/tiny_llama.rs"]
mod support;

#[path = "support/ranks.rs"]
mod ranks;
use ranks::{args, assert_same_run};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// A port nobody listens on now.
fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// How one rank ended: its status, stderr and how long it ran.
struct Ended {
    status: ExitStatus,
    stderr: String,
    seconds: f64,
}

/// `grpo train args` as ranks `ranks` of a world of `size` meeting at `port`, each with its
/// environment plus `env(rank)`; waits for all of them. Output goes to files in `logs` (a pipe
/// left unread could stop a rank that the others wait for).
fn launch(
    logs: &Path,
    size: usize,
    ranks: &[usize],
    port: u16,
    args: &[String],
    env: impl Fn(usize) -> Vec<(&'static str, String)>,
) -> Vec<Ended> {
    std::fs::create_dir_all(logs).unwrap();
    let started = Instant::now();
    let children: Vec<_> = ranks
        .iter()
        .map(|&r| {
            let err = logs.join(format!("rank{r}.stderr"));
            let mut c = Command::new(env!("CARGO_BIN_EXE_grpo"));
            c.arg("train")
                .args(args)
                .env("RANK", r.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("WORLD_SIZE", size.to_string())
                .env("LOCAL_WORLD_SIZE", size.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("RAYON_NUM_THREADS", "1")
                .env("NO_COLOR", "1")
                // Bounds on a broken test, far above what a working one takes.
                .env("GRPO_RENDEZVOUS_TIMEOUT", "120")
                .env("GRPO_COLLECTIVE_TIMEOUT", "300")
                .stdout(Stdio::from(
                    File::create(logs.join(format!("rank{r}.stdout"))).unwrap(),
                ))
                .stderr(Stdio::from(File::create(&err).unwrap()));
            for k in [
                "GRPO_FAULTS",
                "GRPO_MASTER_PORT",
                "TORCHELASTIC_USE_AGENT_STORE",
                "OMPI_COMM_WORLD_SIZE",
                "PMI_SIZE",
                "PMIX_SIZE",
                "SLURM_NTASKS",
            ] {
                c.env_remove(k);
            }
            c.envs(env(r));
            (c.spawn().unwrap(), err)
        })
        .collect();
    children
        .into_iter()
        .map(|(mut child, err)| {
            let status = child.wait().unwrap();
            Ended {
                status,
                stderr: std::fs::read_to_string(err).unwrap(),
                seconds: started.elapsed().as_secs_f64(),
            }
        })
        .collect()
}

fn train_one_process(args: &[String]) {
    let out = Command::new(env!("CARGO_BIN_EXE_grpo"))
        .arg("train")
        .args(args)
        .env("NO_COLOR", "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn two_ranks_over_tcp_train_as_one_process_does() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    support::tiny_llama(&model, &fixtures());
    for (name, extra) in [
        // Evaluation shares the held-out prompts out and gathers the answers (bytes through
        // rank 0); the update sums f64 counts through rank 0 and gradients around the ring.
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
        train_one_process(&args(&model, &one, 8, 2, extra));
        let ended = launch(
            &tmp.path().join(format!("{name}-logs")),
            2,
            &[0, 1],
            free_port(),
            &args(&model, &two, 4, 1, extra),
            |_| vec![],
        );
        for (r, e) in ended.iter().enumerate() {
            assert!(e.status.success(), "rank {r}: {}", e.stderr);
        }
        assert_same_run(&one, &two, 3);
        // Rank 0 alone wrote the run; rank 1 logged only warnings, each line naming it.
        assert!(two.join("config.toml").is_file() && !two.join("rank1").exists());
        let r1 = &ended[1].stderr;
        assert!(r1.lines().all(|l| l.starts_with("rank 1: ")), "{r1}");
    }
}

/// `WORLD_SIZE=2` with one rank started: rank 0 gives up after `GRPO_RENDEZVOUS_TIMEOUT`
/// naming where it listened and the rank it waited for; a rank 1 whose rank 0 never comes says
/// where it looked.
#[test]
fn a_launch_that_misses_a_rank_fails_in_time_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let a = vec![format!("--output_dir={}", out.display())];
    let short = |_| vec![("GRPO_RENDEZVOUS_TIMEOUT", "5".to_string())];
    let (p0, p1) = (free_port(), free_port());
    let (zero, one) = std::thread::scope(|s| {
        let zero = s.spawn(|| launch(&tmp.path().join("a"), 2, &[0], p0, &a, short));
        let one = s.spawn(|| launch(&tmp.path().join("b"), 2, &[1], p1, &a, short));
        (zero.join().unwrap(), one.join().unwrap())
    });
    let (zero, one) = (&zero[0], &one[0]);
    assert!(!zero.status.success() && !one.status.success());
    let e = &zero.stderr;
    assert!(
        e.contains(&format!("127.0.0.1:{p0}"))
            && e.contains("MASTER_ADDR")
            && e.contains("for rank(s) 1,")
            && e.contains("GRPO_RENDEZVOUS_TIMEOUT"),
        "{e}"
    );
    let e = &one.stderr;
    assert!(
        e.contains("rank 1 of 2: rank 0 never answered") && e.contains(&format!("127.0.0.1:{p1}")),
        "{e}"
    );
    for r in [zero, one] {
        assert!(r.seconds < 20.0, "took {} s", r.seconds);
    }
    assert!(!out.exists(), "nothing is written");
}

/// A rank killed mid-step (SIGKILL at its first micro-batch, as the OOM killer does) and a rank
/// that fails (its model's weights are broken) each stop rank 0 at its next collective, naming the rank,
/// in seconds, far below the collective timeout.
#[test]
fn a_rank_killed_or_failing_mid_run_stops_the_others_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    support::tiny_llama(&model, &fixtures());
    let a = args(&model, &tmp.path().join("killed"), 4, 1, &[]);
    let killed = launch(
        &tmp.path().join("k"),
        2,
        &[0, 1],
        free_port(),
        &a,
        |r| match r {
            1 => vec![("GRPO_FAULTS", "update.micro_batch=return(kill)".into())],
            _ => vec![],
        },
    );
    assert_eq!(killed[1].status.signal(), Some(9), "{}", killed[1].stderr);
    let e = &killed[0].stderr;
    assert!(!killed[0].status.success(), "{e}");
    assert!(
        e.contains("error: grpo rank 0 of 2:")
            && e.contains("rank 1 closed its connection (it failed or was killed)"),
        "{e}"
    );
    assert!(
        killed[0].seconds < 60.0,
        "took {} s: {e}",
        killed[0].seconds
    );

    // Rank 1 alone cannot load its model's weights (a file broken on one node).
    let broken = tmp.path().join("broken");
    std::fs::create_dir_all(&broken).unwrap();
    for f in std::fs::read_dir(&model).unwrap() {
        let f = f.unwrap().path();
        let to = broken.join(f.file_name().unwrap());
        match f.extension().is_some_and(|x| x == "safetensors") {
            true => std::fs::write(to, b"not weights").unwrap(),
            false => drop(std::fs::copy(&f, to).unwrap()),
        }
    }
    let a = args(&model, &tmp.path().join("failed"), 4, 1, &[]);
    let mut a1 = a.clone();
    a1.push(format!("--model={}", broken.display()));
    let port = free_port();
    let ended = std::thread::scope(|s| {
        let zero = s.spawn(|| launch(&tmp.path().join("f0"), 2, &[0], port, &a, |_| vec![]));
        let one = s.spawn(|| launch(&tmp.path().join("f1"), 2, &[1], port, &a1, |_| vec![]));
        [zero.join().unwrap(), one.join().unwrap()]
    });
    let (zero, one) = (&ended[0][0], &ended[1][0]);
    assert!(!one.status.success() && !zero.status.success());
    assert!(
        one.stderr.contains("error: grpo rank 1 of 2:"),
        "{}",
        one.stderr
    );
    assert!(
        zero.stderr.contains("error: grpo rank 0 of 2:")
            && zero.stderr.contains("rank 1 closed its connection"),
        "{}",
        zero.stderr
    );
    assert!(zero.seconds < 60.0, "took {} s", zero.seconds);
}

/// Several GPUs without MPI (`--features nccl`, opt-in: it needs two CUDA devices and fails,
/// saying so, with fewer): two ranks on two GPUs, NCCL's communicator bootstrapped over TCP,
/// train as one process on one GPU does on the same global batch.
///   cargo test --release --features nccl -p grpo-cli --test launch two_gpus
#[cfg(feature = "nccl")]
#[test]
fn two_gpus_over_tcp_with_nccl_train_as_one_gpu_does() {
    if let Err(e) = candle_core::Device::new_cuda(1) {
        panic!("fewer than two CUDA devices ({e}): this opt-in check needs two GPUs");
    }
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    support::tiny_llama(&model, &fixtures());
    let extra = ["--device=cuda", "--beta=0.04"];
    let one = tmp.path().join("one-gpu");
    let two = tmp.path().join("two-gpus");
    train_one_process(&args(&model, &one, 8, 2, &extra));
    let ended = launch(
        &tmp.path().join("logs"),
        2,
        &[0, 1],
        free_port(),
        &args(&model, &two, 4, 1, &extra),
        |_| vec![],
    );
    for (r, e) in ended.iter().enumerate() {
        assert!(e.status.success(), "rank {r}: {}", e.stderr);
    }
    assert_same_run(&one, &two, 3);
}
