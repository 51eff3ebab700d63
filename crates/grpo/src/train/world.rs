//! The seam for data-parallel training: the processes of one run, through which gradients, token
//! counts and metrics are reduced. One process ([`SingleProcess`]) is the default world; with the
//! `mpi` feature, a run started by `mpirun` or `srun` trains across ranks ([`MpiWorld`]), and one
//! started as torchrun starts processes (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`) over
//! TCP (`TcpWorld`), without touching the loop; `launch::from_launcher` picks the world.

use std::sync::Arc;

use candle_core::Tensor;
use grpo_models::kernels::{device_kind, DeviceKind};

use crate::optim::zero::{with_host_f32, CopyFrom};
use crate::optim::zero3::SharedRanks;
#[cfg(feature = "mpi")]
use crate::Error;
use crate::Result;

/// The processes of one training run (shared with the thread pool the run executes on).
pub trait World: Sync {
    /// This process's rank, `0..size`.
    fn rank(&self) -> usize;
    /// How many processes train together.
    fn size(&self) -> usize;
    /// Sums `xs` element-wise over every process, in place (token counts, metric sums).
    fn sum_f64(&self, xs: &mut [f64]) -> Result<()>;
    /// Sums `xs` element-wise over every process, in place (gradients, on the host).
    fn sum_f32(&self, xs: &mut [f32]) -> Result<()>;
    /// Every process's `mine`, in rank order.
    fn all_gather_bytes(&self, mine: Vec<u8>) -> Result<Vec<Vec<u8>>>;
    /// Sums each gradient over every process, in place, before clipping and the optimizer step:
    /// buckets of whole tensors (a larger tensor alone), each summed by one [`World::sum_f32`].
    fn sum_grads(&self, grads: &mut [Tensor]) -> Result<()> {
        sum_in_buckets(self, grads)
    }
    /// This process's part `counts[rank]` of the element-wise sum of `xs` over every process
    /// (parts in rank order; ZeRO-2's reduce-scatter). Default: the whole sum, then the part.
    fn reduce_scatter_f32(&self, xs: &[f32], counts: &[usize]) -> Result<Vec<f32>> {
        let mut all = xs.to_vec();
        self.sum_f32(&mut all)?;
        let start: usize = counts[..self.rank()].iter().sum();
        Ok(all[start..start + counts[self.rank()]].to_vec())
    }
    /// Every process's `mine`, concatenated in rank order (ZeRO's parameter gather).
    fn all_gather_f32(&self, mine: &[f32]) -> Result<Vec<f32>> {
        let bytes: Vec<u8> = mine.iter().flat_map(|x| x.to_le_bytes()).collect();
        let mut out = Vec::new();
        for b in self.all_gather_bytes(bytes)? {
            out.extend(
                b.chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            );
        }
        Ok(out)
    }
    /// Whether this process writes logs, metrics and checkpoints.
    fn is_main(&self) -> bool {
        self.rank() == 0
    }
    /// The largest of the processes' `x`.
    fn max_usize(&self, x: usize) -> Result<usize> {
        let all = self.all_gather_bytes((x as u64).to_le_bytes().to_vec())?;
        Ok(all
            .iter()
            .filter_map(|b| Some(u64::from_le_bytes(b.as_slice().try_into().ok()?) as usize))
            .fold(x, usize::max))
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
    fn sum_f32(&self, _xs: &mut [f32]) -> Result<()> {
        Ok(())
    }
    fn sum_grads(&self, _grads: &mut [Tensor]) -> Result<()> {
        Ok(())
    }
    fn all_gather_bytes(&self, mine: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        Ok(vec![mine])
    }
}

/// Gradients are summed in buckets of this many values (one all-reduce each).
const BUCKET: usize = 1 << 22;

/// `grads` summed over `world` in buckets of whole tensors (a larger tensor alone), each by one
/// [`World::sum_f32`] on the host. A gradient that is a contiguous f32 tensor on the CPU is
/// summed in its own storage when it fills a bucket alone (the embedding's, the largest), and
/// written back in place from a shared bucket: one bucket-sized buffer at most beside the
/// gradients (each copy of a 200 MB embedding gradient was a copy of the peak).
pub(super) fn sum_in_buckets<W: World + ?Sized>(world: &W, grads: &mut [Tensor]) -> Result<()> {
    let mut i = 0;
    while i < grads.len() {
        let mut j = i;
        let mut n = 0;
        while j < grads.len() && (j == i || n + grads[j].elem_count() <= BUCKET) {
            n += grads[j].elem_count();
            j += 1;
        }
        if j == i + 1 && on_host_f32(&grads[i]) {
            grads[i].inplace_op1(&SumInPlace(world))?;
            i = j;
            continue;
        }
        let mut buf: Vec<f32> = Vec::with_capacity(n);
        for g in &grads[i..j] {
            with_host_f32(g, |xs| {
                buf.extend_from_slice(xs);
                Ok(())
            })?;
        }
        world.sum_f32(&mut buf)?;
        let mut off = 0;
        for g in &mut grads[i..j] {
            let k = g.elem_count();
            match on_host_f32(g) {
                true => g.inplace_op1(&CopyFrom(&buf[off..off + k]))?,
                false => {
                    *g = Tensor::from_slice(&buf[off..off + k], g.shape(), g.device())?
                        .to_dtype(g.dtype())?
                }
            }
            off += k;
        }
        i = j;
    }
    Ok(())
}

/// Whether `t` is a contiguous f32 tensor on the CPU (its storage is one f32 slice).
fn on_host_f32(t: &Tensor) -> bool {
    device_kind(t.device()) == DeviceKind::Cpu
        && t.dtype() == candle_core::DType::F32
        && t.is_contiguous()
}

/// [`World::sum_f32`] over a contiguous f32 CPU tensor's own storage.
struct SumInPlace<'a, W: ?Sized>(&'a W);

impl<W: World + ?Sized> candle_core::InplaceOp1 for SumInPlace<'_, W> {
    fn name(&self) -> &'static str {
        "sum-over-ranks"
    }
    fn cpu_fwd(
        &self,
        s: &mut candle_core::CpuStorage,
        l: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        let (candle_core::CpuStorage::F32(v), Some((a, b))) = (s, l.contiguous_offsets()) else {
            candle_core::bail!("sum over ranks: contiguous f32 tensors only");
        };
        self.0
            .sum_f32(&mut v[a..b])
            .map_err(|e| candle_core::Error::Msg(e.to_string()))
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

/// This process's rank among those of its node, as the launcher says (0 without one; torchrun's
/// `LOCAL_RANK` first: under `srun torchrun`, Slurm's is the agent's).
pub fn local_rank() -> usize {
    [
        "LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "MPI_LOCALRANKID",
        "PMIX_LOCAL_RANK",
        "SLURM_LOCALID",
    ]
    .iter()
    .find_map(|k| std::env::var(k).ok()?.trim().parse::<usize>().ok())
    .unwrap_or(0)
}

/// The GPU a rank trains on with `device = "cuda:N"`: one process per GPU, so GPU
/// `N + local rank`, unless the launcher gave each process a single visible GPU
/// (`CUDA_VISIBLE_DEVICES` with one entry, as `srun --gpus-per-task=1` does): then that one.
pub fn rank_gpu(configured: usize, world_size: usize) -> usize {
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    gpu_of(configured, world_size, local_rank(), visible.as_deref())
}

fn gpu_of(configured: usize, world_size: usize, local: usize, visible: Option<&str>) -> usize {
    let one_visible =
        visible.is_some_and(|v| v.split(',').filter(|s| !s.trim().is_empty()).count() == 1);
    match world_size > 1 && !one_visible {
        true => configured + local,
        false => configured,
    }
}

/// The ranks of an MPI job (`mpirun`, `srun`, any PMIx launcher), through the `mpi` crate.
#[cfg(feature = "mpi")]
pub struct MpiWorld {
    _universe: mpi::environment::Universe,
    comm: mpi::topology::SimpleCommunicator,
    /// When the collective in progress started (seconds since start; 0: none): a watchdog ends
    /// the job when one waits longer than the timeout (a rank stuck, or gone without a word).
    waiting_since: std::sync::Arc<std::sync::atomic::AtomicU64>,
    start: std::time::Instant,
    /// NCCL for gradients on a GPU (the `nccl` feature): one communicator per process, made at
    /// the first all-reduce of CUDA gradients, its unique id sent from rank 0 over MPI.
    #[cfg(feature = "nccl")]
    nccl: super::nccl::LazyComm,
}

/// How long a rank may wait in one collective before the job is ended (`GRPO_COLLECTIVE_TIMEOUT`,
/// or `GRPO_MPI_TIMEOUT`, in seconds; default 30 minutes: rank 0's evaluation keeps the others
/// waiting at the next one).
pub(super) fn collective_timeout() -> u64 {
    ["GRPO_COLLECTIVE_TIMEOUT", "GRPO_MPI_TIMEOUT"]
        .iter()
        .find_map(|k| std::env::var(k).ok()?.trim().parse().ok())
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
            .ok_or_else(|| Error::distributed("MPI was already initialized in this process"))?;
        let comm = universe.world();
        let world = MpiWorld {
            _universe: universe,
            comm,
            waiting_since: Default::default(),
            start: std::time::Instant::now(),
            #[cfg(feature = "nccl")]
            nccl: Default::default(),
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
    fn sum_f32(&self, xs: &mut [f32]) -> Result<()> {
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
        // Gradients on a GPU: NCCL sums them there, one all-reduce per tensor, no host copy.
        #[cfg(feature = "nccl")]
        if let Some(dev) = super::nccl::cuda_device(grads) {
            let comm = self.nccl.get(self, &dev)?;
            for g in grads.iter_mut() {
                *g = self.timed(|| comm.sum(g))?;
            }
            return Ok(());
        }
        sum_in_buckets(self, grads)
    }
    fn reduce_scatter_f32(&self, xs: &[f32], counts: &[usize]) -> Result<Vec<f32>> {
        use mpi::collective::SystemOperation;
        use mpi::raw::AsRaw;
        use mpi::traits::Equivalence;
        if counts.len() != self.size() || counts.iter().sum::<usize>() != xs.len() {
            return Err(Error::Invariant(format!(
                "reduce-scatter: {} values in parts {counts:?} over {} ranks",
                xs.len(),
                self.size()
            )));
        }
        let counts = mpi_counts(counts)?;
        let mut out = vec![0f32; counts[self.rank()] as usize];
        // SAFETY: `xs` holds the sum of `counts` f32 values and `out` this rank's count of them;
        // every rank passes the same counts (the parts of one split), as MPI requires.
        let rc = self.timed(|| unsafe {
            mpi::ffi::MPI_Reduce_scatter(
                xs.as_ptr().cast(),
                out.as_mut_ptr().cast(),
                counts.as_ptr(),
                f32::equivalent_datatype().as_raw(),
                SystemOperation::sum().as_raw(),
                self.comm.as_raw(),
            )
        });
        if rc != 0 {
            // (Not MPI_SUCCESS: MPI's default handler has usually ended the job already.)
            return Err(Error::distributed(format!(
                "MPI_Reduce_scatter failed ({rc})"
            )));
        }
        Ok(out)
    }
    fn all_gather_f32(&self, mine: &[f32]) -> Result<Vec<f32>> {
        use mpi::datatype::PartitionMut;
        use mpi::traits::CommunicatorCollectives;
        use mpi::Count;
        let mut counts: Vec<Count> = vec![0; self.size()];
        let len = mpi_counts(&[mine.len()])?;
        self.timed(|| self.comm.all_gather_into(&len[..], &mut counts[..]));
        let displs = mpi_counts(
            &counts
                .iter()
                .scan(0usize, |acc, &c| {
                    let d = *acc;
                    *acc += c as usize;
                    Some(d)
                })
                .collect::<Vec<_>>(),
        )?;
        let total: usize = counts.iter().map(|&c| c as usize).sum();
        let mut out = vec![0f32; total];
        {
            let mut part = PartitionMut::new(&mut out[..], &counts[..], &displs[..]);
            self.timed(|| self.comm.all_gather_varcount_into(mine, &mut part));
        }
        Ok(out)
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

/// `counts` as MPI's (C int) counts, or an error for a part past their range.
#[cfg(feature = "mpi")]
fn mpi_counts(counts: &[usize]) -> Result<Vec<mpi::Count>> {
    counts
        .iter()
        .map(|&c| {
            mpi::Count::try_from(c).map_err(|_| {
                Error::distributed(format!(
                    "{c} values in one MPI call: more than it can count"
                ))
            })
        })
        .collect()
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

/// `world` as a sharded parameter store's collectives ([`crate::optim::zero3`]), shared with
/// the models it builds.
pub fn shared_ranks(world: &dyn World) -> SharedRanks {
    // SAFETY: the world is made before a run and dropped after it (the CLI's and the Python
    // package's `train` own it across `Run::start` .. the end of the loop), and the sharded
    // parameters, the models built over them and their graphs all live inside the run. The
    // world is `Sync`; its collectives are called from the thread that runs the steps.
    let world: &'static dyn World = unsafe { std::mem::transmute::<&dyn World, _>(world) };
    Arc::new(WorldRanks(world))
}

/// A borrowed world as [`crate::optim::Ranks`] (see [`shared_ranks`]).
struct WorldRanks(&'static dyn World);

// SAFETY: see `shared_ranks`: the world outlives every user and is `Sync`.
unsafe impl Send for WorldRanks {}

impl crate::optim::Ranks for WorldRanks {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn size(&self) -> usize {
        self.0.size()
    }
    fn sum_f64(&self, xs: &mut [f64]) -> Result<()> {
        self.0.sum_f64(xs)
    }
    fn sum_grads(&self, grads: &mut [Tensor]) -> Result<()> {
        self.0.sum_grads(grads)
    }
    fn reduce_scatter_f32(&self, xs: &[f32], counts: &[usize]) -> Result<Vec<f32>> {
        self.0.reduce_scatter_f32(xs, counts)
    }
    fn all_gather_f32(&self, mine: &[f32]) -> Result<Vec<f32>> {
        self.0.all_gather_f32(mine)
    }
}

#[cfg(test)]
mod tests {
    use super::gpu_of;

    #[test]
    fn each_rank_of_a_node_takes_its_own_gpu() {
        assert_eq!(gpu_of(0, 1, 0, None), 0);
        assert_eq!(gpu_of(0, 4, 3, None), 3);
        assert_eq!(gpu_of(2, 4, 1, Some("0,1,2,3")), 3);
        // srun --gpus-per-task=1: each process sees one GPU, ordinal 0.
        assert_eq!(gpu_of(0, 4, 3, Some("3")), 0);
    }
}
