//! Which world a process trains in, from what its launcher set in the environment: torchrun's
//! variables ([`TcpWorld`]), an MPI launcher's ([`MpiWorld`](super::world::MpiWorld)), or none
//! (one process).

use super::tcp_world::{Rendezvous, TcpWorld};
#[cfg(feature = "mpi")]
use super::world::MpiWorld;
use super::world::{launcher_world_size, SingleProcess, WorldHandle};
#[cfg(not(feature = "mpi"))]
use crate::Error;
use crate::Result;

/// The world a run trains in, the first that applies:
/// 1. `RANK` and `WORLD_SIZE` > 1 in the environment (torchrun, PyTorchJob, a script): the ranks
///    meet over TCP at `MASTER_ADDR:MASTER_PORT` ([`TcpWorld`]). No MPI launcher sets these, and
///    under `srun torchrun` Slurm's own variables count the agents, not the ranks.
/// 2. An MPI launcher's variables (`mpirun`, `srun`): MPI's world. Without the `mpi` feature this
///    is an error (each process would train alone and write the same output).
/// 3. Otherwise this one process.
pub fn from_launcher() -> Result<Box<dyn WorldHandle>> {
    if let Some(rv) = Rendezvous::from_env()? {
        return Ok(Box::new(TcpWorld::connect(&rv)?));
    }
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
                 docs/distributed.md), launch it without MPI (RANK, WORLD_SIZE, MASTER_ADDR and \
                 MASTER_PORT, as torchrun sets them), or run it without a launcher"
            ),
        )),
    }
}
