//! NCCL between the GPUs of a run: one process per GPU, the communicator bootstrapped over
//! whichever world runs (MPI, or TCP for a launch without MPI): rank 0 makes NCCL's unique id
//! and every rank receives it through the world's gather. Built with the `nccl` feature; NCCL
//! itself is loaded at run time (cudarc's dynamic loading).

use std::sync::OnceLock;

use candle_core::cuda_backend::cudarc::nccl::safe::{Comm, Id, ReduceOp};
use candle_core::{CudaDevice, CudaStorage, DType, Device, Storage, Tensor};

use super::World;
use crate::{Error, Result};

pub struct DeviceComm {
    comm: Comm,
    dev: CudaDevice,
}

fn err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Distributed(format!(
        "NCCL {what}: {e:?} (is libnccl installed, one GPU per rank?)"
    ))
}

/// The GPU `grads` are on (None: on the host).
pub fn cuda_device(grads: &[Tensor]) -> Option<CudaDevice> {
    match grads.first().map(|g| g.device()) {
        Some(Device::Cuda(dev)) => Some(dev.clone()),
        _ => None,
    }
}

/// A process's communicator, made at its first all-reduce of CUDA gradients.
#[derive(Default)]
pub struct LazyComm(OnceLock<DeviceComm>);

// SAFETY: the communicator is used by the training thread only, one collective after another
// (as the worlds' own collectives are); NCCL allows a communicator to be used from any thread
// as long as no two calls on it run at once.
unsafe impl Sync for LazyComm {}
unsafe impl Send for LazyComm {}

impl LazyComm {
    /// The communicator, made on first use (a collective: every rank calls it at the same point).
    pub fn get(&self, world: &dyn World, dev: &CudaDevice) -> Result<&DeviceComm> {
        if let Some(c) = self.0.get() {
            return Ok(c);
        }
        let c = DeviceComm::new(world, dev)?;
        Ok(self.0.get_or_init(|| c))
    }
}

impl DeviceComm {
    /// Collective: every rank calls it at the same point (its first gradient all-reduce).
    pub fn new(world: &dyn World, dev: &CudaDevice) -> Result<DeviceComm> {
        let mine = match world.rank() {
            0 => {
                let id = Id::new().map_err(|e| err("unique id", e))?;
                id.internal().iter().map(|&c| c as u8).collect()
            }
            _ => Vec::new(),
        };
        let all = world.all_gather_bytes(mine)?;
        let bytes = all
            .first()
            .filter(|b| b.len() == 128)
            .ok_or_else(|| Error::distributed("NCCL: rank 0 sent no unique id of 128 bytes"))?;
        let mut internal = [0 as std::ffi::c_char; 128];
        for (d, &b) in internal.iter_mut().zip(bytes) {
            *d = b as std::ffi::c_char;
        }
        let comm = Comm::from_rank(
            dev.cuda_stream(),
            world.rank(),
            world.size(),
            Id::uninit(internal),
        )
        .map_err(|e| err("communicator", e))?;
        Ok(DeviceComm {
            comm,
            dev: dev.clone(),
        })
    }

    /// `g` summed over every rank (f32; the result keeps `g`'s dtype and shape).
    pub fn sum(&self, g: &Tensor) -> Result<Tensor> {
        let x = g.to_dtype(DType::F32)?.contiguous()?; // [..] f32 on this GPU
        let n = x.elem_count();
        let out = {
            let (st, l) = x.storage_and_layout();
            let Storage::Cuda(cs) = &*st else {
                return Err(Error::distributed("NCCL: a gradient is not on the GPU"));
            };
            let src = cs.as_cuda_slice::<f32>()?;
            let src = src.slice(l.start_offset()..l.start_offset() + n);
            let mut out = self
                .dev
                .cuda_stream()
                .alloc_zeros::<f32>(n)
                .map_err(|e| err("allocation", e))?;
            self.comm
                .all_reduce(&src, &mut out, &ReduceOp::Sum)
                .map_err(|e| err("all-reduce", e))?;
            out
        };
        let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(out, self.dev.clone()));
        let t = Tensor::from_storage(
            storage,
            g.shape(),
            candle_core::op::BackpropOp::none(),
            false,
        );
        Ok(t.to_dtype(g.dtype())?)
    }
}
