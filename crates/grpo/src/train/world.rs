//! The seam for data-parallel training: the processes of one run, through which gradients, token
//! counts and metrics are reduced. One process ([`SingleProcess`]) is the default world; with the
//! `mpi` feature, a run started by `mpirun` or `srun` trains across ranks ([`MpiWorld`]) without
//! touching the loop.

use candle_core::Tensor;

use crate::{Error, Result};

/// The processes of one training run (shared with the thread pool the run executes on).
pub trait World: Sync {
    /// This process's rank, `0..size`.
    fn rank(&self) -> usize;
    /// How many processes train together.
    fn size(&self) -> usize;
    /// Sums `xs` element-wise over every process, in place (token counts, metric sums).
    fn sum_f64(&self, xs: &mut [f64]) -> Result<()>;
    /// Sums each gradient over every process, in place, before clipping and the optimizer step.
    fn sum_grads(&self, grads: &mut [Tensor]) -> Result<()>;
    /// Every process's `mine`, in rank order.
    fn all_gather_bytes(&self, mine: Vec<u8>) -> Result<Vec<Vec<u8>>>;
    /// Whether this process writes logs, metrics and checkpoints.
    fn is_main(&self) -> bool {
        self.rank() == 0
    }
    /// Whether `flag` is set on any process.
    fn any(&self, flag: bool) -> Result<bool> {
        let mut x = [f64::from(u8::from(flag))];
        self.sum_f64(&mut x)?;
        Ok(x[0] > 0.0)
    }
}

/// One process: every reduction is the identity.
#[derive(Debug, Clone, Copy, Default)]
pub struct SingleProcess;

impl World for SingleProcess {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn sum_f64(&self, _xs: &mut [f64]) -> Result<()> {
        Ok(())
    }
    fn sum_grads(&self, _grads: &mut [Tensor]) -> Result<()> {
        Ok(())
    }
    fn all_gather_bytes(&self, mine: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        Ok(vec![mine])
    }
}

/// The world size a launcher announces in the environment (Open MPI, MPICH/Hydra, PMIx, Slurm),
/// when it is more than one process; read before MPI starts, so that a run without a launcher
/// never starts MPI.
pub fn launcher_world_size() -> Option<usize> {
    [
        "OMPI_COMM_WORLD_SIZE",
        "PMI_SIZE",
        "PMIX_SIZE",
        "MPI_LOCALNRANKS",
        "SLURM_NTASKS",
    ]
    .iter()
    .find_map(|k| std::env::var(k).ok()?.trim().parse::<usize>().ok())
    .filter(|&n| n > 1)
}

/// Gradients are summed in buckets of this many values (one all-reduce each).
#[cfg(feature = "mpi")]
const BUCKET: usize = 1 << 22;

/// The ranks of an MPI job (`mpirun`, `srun`, any PMIx launcher), through the `mpi` crate.
#[cfg(feature = "mpi")]
pub struct MpiWorld {
    _universe: mpi::environment::Universe,
    comm: mpi::topology::SimpleCommunicator,
    /// When the collective in progress started (seconds since start; 0: none): a watchdog ends
    /// the job when one waits longer than the timeout (a rank stuck, or gone without a word).
    waiting_since: std::sync::Arc<std::sync::atomic::AtomicU64>,
    start: std::time::Instant,
}

/// How long a rank may wait in one collective before the job is ended (`GRPO_MPI_TIMEOUT`, in
/// seconds; default 30 minutes: rank 0's evaluation keeps the others waiting at the next one).
#[cfg(feature = "mpi")]
fn collective_timeout() -> u64 {
    std::env::var("GRPO_MPI_TIMEOUT")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .filter(|&s: &u64| s > 0)
        .unwrap_or(1800)
}

// SAFETY: MPI was started with MPI_THREAD_SERIALIZED, which allows calls from any thread as
// long as no two run at once; only the training thread calls, one collective after another.
#[cfg(feature = "mpi")]
unsafe impl Sync for MpiWorld {}
#[cfg(feature = "mpi")]
unsafe impl Send for MpiWorld {}

#[cfg(feature = "mpi")]
impl MpiWorld {
    /// Starts MPI (calls come from one thread at a time: the training thread).
    pub fn init() -> Result<Self> {
        use mpi::Threading;
        let (universe, _) = mpi::initialize_with_threading(Threading::Serialized)
            .ok_or_else(|| Error::Generate("MPI was already initialized in this process".into()))?;
        let comm = universe.world();
        let world = MpiWorld {
            _universe: universe,
            comm,
            waiting_since: Default::default(),
            start: std::time::Instant::now(),
        };
        world.watch(collective_timeout());
        Ok(world)
    }

    /// Starts the watchdog thread.
    fn watch(&self, timeout: u64) {
        use mpi::traits::Communicator;
        use std::sync::atomic::Ordering;
        let since = self.waiting_since.clone();
        let start = self.start;
        let rank = self.comm.rank();
        std::thread::spawn(move || loop {
            std::thread::sleep(std::time::Duration::from_secs(1));
            let t = since.load(Ordering::Relaxed);
            if t > 0 && start.elapsed().as_secs().saturating_sub(t) > timeout {
                eprintln!(
                    "error: grpo rank {rank}: waited more than {timeout} s for the other ranks \
                     (one is stuck or gone); ending the job (GRPO_MPI_TIMEOUT sets the limit)"
                );
                // Another rank may be the stuck one: end the whole job from here.
                // SAFETY: MPI_Abort may be called from any thread; it does not return.
                unsafe {
                    mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, 1);
                }
            }
        });
    }

    /// Runs collective `f` under the watchdog.
    fn timed<T>(&self, f: impl FnOnce() -> T) -> T {
        use std::sync::atomic::Ordering;
        self.waiting_since
            .store(self.start.elapsed().as_secs().max(1), Ordering::Relaxed);
        let out = f();
        self.waiting_since.store(0, Ordering::Relaxed);
        out
    }

    /// Ends the whole job with `code` (a failing rank takes the others down instead of leaving
    /// them waiting in a collective).
    pub fn abort(&self, code: i32) -> ! {
        use mpi::traits::Communicator;
        self.comm.abort(code)
    }
}

#[cfg(feature = "mpi")]
impl World for MpiWorld {
    fn rank(&self) -> usize {
        use mpi::traits::Communicator;
        self.comm.rank() as usize
    }
    fn size(&self) -> usize {
        use mpi::traits::Communicator;
        self.comm.size() as usize
    }
    fn sum_f64(&self, xs: &mut [f64]) -> Result<()> {
        use mpi::collective::SystemOperation;
        use mpi::traits::CommunicatorCollectives;
        let send = xs.to_vec();
        self.timed(|| {
            self.comm
                .all_reduce_into(&send[..], xs, SystemOperation::sum())
        });
        Ok(())
    }
    fn sum_grads(&self, grads: &mut [Tensor]) -> Result<()> {
        use mpi::collective::SystemOperation;
        use mpi::traits::CommunicatorCollectives;
        // Buckets of whole tensors (a larger tensor alone), each summed by one all-reduce.
        let mut i = 0;
        while i < grads.len() {
            let mut j = i;
            let mut n = 0;
            while j < grads.len() && (j == i || n + grads[j].elem_count() <= BUCKET) {
                n += grads[j].elem_count();
                j += 1;
            }
            let mut send: Vec<f32> = Vec::with_capacity(n);
            for g in &grads[i..j] {
                send.extend(
                    g.flatten_all()?
                        .to_dtype(candle_core::DType::F32)?
                        .to_vec1::<f32>()?,
                );
            }
            let mut recv = vec![0f32; n];
            self.timed(|| {
                self.comm
                    .all_reduce_into(&send[..], &mut recv[..], SystemOperation::sum())
            });
            drop(send);
            let mut off = 0;
            for g in &mut grads[i..j] {
                let k = g.elem_count();
                let t = Tensor::from_slice(&recv[off..off + k], g.shape(), g.device())?
                    .to_dtype(g.dtype())?;
                *g = t;
                off += k;
            }
            i = j;
        }
        Ok(())
    }
    fn all_gather_bytes(&self, mine: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        use mpi::datatype::PartitionMut;
        use mpi::traits::CommunicatorCollectives;
        use mpi::Count;
        let size = self.size();
        let mut counts: Vec<Count> = vec![0; size];
        let len = [mine.len() as Count];
        self.timed(|| self.comm.all_gather_into(&len[..], &mut counts[..]));
        let displs: Vec<Count> = counts
            .iter()
            .scan(0, |acc, &c| {
                let d = *acc;
                *acc += c;
                Some(d)
            })
            .collect();
        let total: usize = counts.iter().map(|&c| c as usize).sum();
        let mut buf = vec![0u8; total];
        {
            let mut part = PartitionMut::new(&mut buf[..], &counts[..], &displs[..]);
            self.timed(|| self.comm.all_gather_varcount_into(&mine[..], &mut part));
        }
        Ok(counts
            .iter()
            .zip(&displs)
            .map(|(&c, &d)| buf[d as usize..(d + c) as usize].to_vec())
            .collect())
    }
}

/// The world a run trains in: MPI's when a launcher started several processes, else this one
/// process. Without the `mpi` feature, a multi-process launch is an error (each process would
/// train alone and write the same output).
pub fn from_launcher() -> Result<Box<dyn WorldHandle>> {
    match launcher_world_size() {
        None => Ok(Box::new(SingleProcess)),
        #[cfg(feature = "mpi")]
        Some(_) => Ok(Box::new(MpiWorld::init()?)),
        #[cfg(not(feature = "mpi"))]
        Some(n) => Err(Error::config(
            "mpirun",
            format!(
                "this grpo was started as one of {n} processes, but it was built without MPI: \
                 rebuild with `cargo build --release --features mpi` (needs Open MPI or MPICH, see \
                 docs/distributed.md), or run it without a launcher"
            ),
        )),
    }
}

/// A world that can also end the job (see [`MpiWorld::abort`]).
pub trait WorldHandle: World {
    /// Ends every process of the run after this one failed (one process: returns).
    fn abort_job(&self, code: i32);
    fn as_world(&self) -> &dyn World;
}

impl WorldHandle for SingleProcess {
    fn abort_job(&self, _code: i32) {}
    fn as_world(&self) -> &dyn World {
        self
    }
}

#[cfg(feature = "mpi")]
impl WorldHandle for MpiWorld {
    fn abort_job(&self, code: i32) {
        self.abort(code)
    }
    fn as_world(&self) -> &dyn World {
        self
    }
}
