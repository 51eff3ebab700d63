//! `zero_stage = 3`'s blocks ([`BlockExchange`], grpo_models' [`BlockParams`]): block `i`'s
//! parameters gathered whole for each use, its gradients reduce-scattered into this rank's range
//! after each backward and summed there over the optimizer step.
//!
//! The collectives overlap the compute. A thread of the exchange's own (the courier) runs them
//! in the order they are asked for, which is the same on every rank:
//! - a block's gradients are handed to it and the backward goes on to the next block at once;
//! - while block `i` computes, the courier already gathers the block the pass will need next
//!   (`i + 1` in the forward, `i - 1` in the backward), so two blocks' parameters are alive at a
//!   time, as DeepSpeed's prefetch keeps them.
//!
//! MPI is initialized for serialized calls from any thread: the training loop's own
//! collectives never run while the courier works, since [`BlockExchange::flush`] waits for it
//! after each backward and no prefetch is left after a forward or a backward.
//! `GRPO_ZERO3_OVERLAP=0` runs every collective on the calling thread instead (for comparison).

use std::collections::HashMap;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::Tensor;
use grpo_models::models::checkpointing::BlockParams;

use super::zero3::ShardedParams;
use crate::{Error, Result};

/// What the courier is asked to do, in order.
enum Job {
    Gather(Vec<usize>, Sender<Result<Vec<Tensor>>>),
    Reduce(Vec<usize>, Vec<Tensor>),
    /// Replies once every job before it has run, with the first reduce that failed since.
    Flush(Sender<Result<()>>),
}

/// The thread that runs an exchange's collectives ([`Job`]s), and where to send them.
struct Courier {
    jobs: Sender<Job>,
}

impl Courier {
    fn start(params: Arc<ShardedParams>, acc: Arc<Mutex<Vec<f32>>>) -> Result<Courier> {
        let (jobs, rx) = channel::<Job>();
        std::thread::Builder::new()
            .name("zero3-courier".into())
            .spawn(move || courier(rx, &params, &acc))
            .map_err(|e| Error::Distributed(format!("cannot start zero 3's courier: {e}")))?;
        Ok(Courier { jobs })
    }

    fn send(&self, job: Job) -> Result<()> {
        self.jobs
            .send(job)
            .map_err(|_| Error::Distributed("zero 3's courier stopped".into()))
    }
}

/// The courier's loop: until the exchange is dropped.
fn courier(rx: Receiver<Job>, params: &ShardedParams, acc: &Mutex<Vec<f32>>) {
    let mut failed: Option<Error> = None;
    for job in rx {
        match job {
            Job::Gather(idx, reply) => {
                let _ = reply.send(params.gather(&idx));
            }
            Job::Reduce(idx, grads) if failed.is_none() => {
                let done = lock(acc).and_then(|mut a| params.reduce_into(&idx, &grads, &mut a));
                failed = done.err();
            }
            Job::Reduce(..) => {}
            Job::Flush(reply) => {
                let _ = reply.send(failed.take().map_or(Ok(()), Err));
            }
        }
    }
}

fn lock(acc: &Mutex<Vec<f32>>) -> Result<MutexGuard<'_, Vec<f32>>> {
    acc.lock()
        .map_err(|_| Error::Invariant("zero 3: gradient accumulator poisoned".into()))
}

/// The gather asked for ahead of use, and the last block gathered (which way the pass goes).
#[derive(Default)]
struct Prefetch {
    last: Option<usize>,
    pending: Option<(usize, Receiver<Result<Vec<Tensor>>>)>,
}

/// The blocks of a model over [`ShardedParams`] (see the module doc).
pub struct BlockExchange {
    params: Arc<ShardedParams>,
    /// Each block's parameter indices (ascending).
    blocks: Vec<Vec<usize>>,
    /// This rank's range of the step's gradients so far (`[range]`).
    acc: Arc<Mutex<Vec<f32>>>,
    /// None: every collective on the calling thread (`GRPO_ZERO3_OVERLAP=0`).
    courier: Option<Courier>,
    prefetch: Mutex<Prefetch>,
}

impl std::fmt::Debug for BlockExchange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockExchange")
            .field("blocks", &self.blocks.len())
            .field("overlapped", &self.courier.is_some())
            .finish()
    }
}

impl BlockExchange {
    /// The blocks of `params`: parameter `j` is in block `block_of(name_j)`; `blocks` of them.
    pub fn new(
        params: Arc<ShardedParams>,
        blocks: usize,
        block_of: impl Fn(&str) -> Option<usize>,
    ) -> Result<BlockExchange> {
        let mut idx = vec![Vec::new(); blocks];
        for (j, n) in params.names().iter().enumerate() {
            if let Some(b) = block_of(n).filter(|&b| b < blocks) {
                idx[b].push(j);
            }
        }
        let acc = Arc::new(Mutex::new(vec![0.0; params.shard().range().len()]));
        let overlap = std::env::var("GRPO_ZERO3_OVERLAP").map_or(true, |v| v != "0");
        let courier = match overlap {
            true => Some(Courier::start(params.clone(), acc.clone())?),
            false => None,
        };
        Ok(BlockExchange {
            params,
            blocks: idx,
            acc,
            courier,
            prefetch: Mutex::new(Prefetch::default()),
        })
    }

    /// Whether parameter `j` belongs to a block.
    pub fn in_block(&self, j: usize) -> bool {
        self.blocks.iter().any(|b| b.contains(&j))
    }

    /// Waits until every gradient handed over so far is summed into the step's; the first
    /// reduce that failed is the error. The loop's own collectives may run after it.
    pub fn flush(&self) -> Result<()> {
        let Some(c) = &self.courier else {
            return Ok(());
        };
        let (tx, rx) = channel();
        c.send(Job::Flush(tx))?;
        rx.recv()
            .map_err(|_| Error::Distributed("zero 3's courier stopped".into()))?
    }

    /// Adds the world's gradients of parameters `idx` (outside the blocks) into the step's.
    pub fn reduce_outer(&self, idx: &[usize], grads: &[Tensor]) -> Result<()> {
        self.flush()?;
        self.params.reduce_into(idx, grads, &mut lock(&self.acc)?)
    }

    /// The step's gradients of this rank's range, summed over the world; the accumulator
    /// starts again from zero.
    pub fn take(&self) -> Result<Vec<f32>> {
        self.flush()?;
        let mut acc = lock(&self.acc)?;
        let n = acc.len();
        Ok(std::mem::replace(&mut *acc, vec![0.0; n]))
    }

    /// A forward pass's collectives without a pass (a rank whose part of a micro-batch has
    /// fewer forward chunks than another's): each block gathered in the forward's order.
    pub fn idle_forward(&self) -> Result<()> {
        for i in 0..self.blocks.len() {
            self.gather_block(i)?;
        }
        Ok(())
    }

    /// The backward half of [`Self::idle_forward`]: each block gathered and its (zero)
    /// gradients reduced in the backward's order, then [`Self::flush`].
    pub fn idle_backward(&self) -> Result<()> {
        for i in (0..self.blocks.len()).rev() {
            let zeros = self
                .gather_block(i)?
                .iter()
                .map(Tensor::zeros_like)
                .collect::<candle_core::Result<Vec<_>>>()?;
            self.reduce_block(i, zeros)?;
        }
        self.flush()
    }

    /// Block `i`'s parameters, whole (in its parameters' order): the prefetched gather when it
    /// is this block's, then the next block's gather asked for ahead.
    fn gather_block(&self, i: usize) -> Result<Vec<Tensor>> {
        let idx = self.block(i)?;
        let Some(c) = &self.courier else {
            return self.params.gather(idx);
        };
        let mut p = self
            .prefetch
            .lock()
            .map_err(|_| Error::Invariant("zero 3: prefetch state poisoned".into()))?;
        let asked = match p.pending.take() {
            Some((j, rx)) if j == i => rx,
            Some((_, rx)) => {
                // Every rank guessed the same wrong block: take it, and ask for this one.
                wait(rx)?;
                self.ask(c, idx)?
            }
            None => self.ask(c, idx)?,
        };
        let got = wait(asked)?;
        let n = self.blocks.len();
        // A backward goes down from the last block (gathered twice in a row there).
        let down = p
            .last
            .is_some_and(|l| l == i + 1 || (l == i && i + 1 == n && n > 1));
        let next = match down {
            true => i.checked_sub(1),
            false => (i + 1 < n).then_some(i + 1),
        };
        p.last = Some(i);
        if let Some(j) = next {
            p.pending = Some((j, self.ask(c, self.block(j)?)?));
        }
        Ok(got)
    }

    fn ask(&self, c: &Courier, idx: &[usize]) -> Result<Receiver<Result<Vec<Tensor>>>> {
        let (tx, rx) = channel();
        c.send(Job::Gather(idx.to_vec(), tx))?;
        Ok(rx)
    }

    /// Hands block `i`'s gradients (in its parameters' order) to be reduced into the step's.
    fn reduce_block(&self, i: usize, grads: Vec<Tensor>) -> Result<()> {
        let idx = self.block(i)?;
        match &self.courier {
            Some(c) => c.send(Job::Reduce(idx.to_vec(), grads)),
            None => self.params.reduce_into(idx, &grads, &mut lock(&self.acc)?),
        }
    }

    fn block(&self, i: usize) -> Result<&[usize]> {
        self.blocks
            .get(i)
            .map(Vec::as_slice)
            .ok_or_else(|| Error::Invariant(format!("zero 3: no block {i}")))
    }
}

fn wait(rx: Receiver<Result<Vec<Tensor>>>) -> Result<Vec<Tensor>> {
    rx.recv()
        .map_err(|_| Error::Distributed("zero 3's courier stopped".into()))?
}

impl BlockParams for BlockExchange {
    fn gather(&self, i: usize) -> candle_core::Result<HashMap<String, Tensor>> {
        let tensors = self.gather_block(i).map_err(candle)?;
        let names = self.params.names();
        let idx = self.block(i).map_err(candle)?;
        Ok(idx.iter().map(|&j| names[j].clone()).zip(tensors).collect())
    }

    fn gradients(&self, i: usize, mut grads: HashMap<String, Tensor>) -> candle_core::Result<()> {
        let names = self.params.names();
        let ordered = self
            .block(i)
            .map_err(candle)?
            .iter()
            .map(|&j| {
                grads.remove(&names[j]).ok_or_else(|| {
                    candle_core::Error::Msg(format!("zero 3: no gradient for {}", names[j]))
                })
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        self.reduce_block(i, ordered).map_err(candle)
    }
}

fn candle(e: Error) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::zero::test_world::Threads;
    use crate::optim::Ranks;
    use candle_core::Device;

    /// Two blocks of two parameters and one outer parameter.
    fn params() -> Vec<(String, Tensor)> {
        [
            ("model.embed_tokens.weight", 6),
            ("model.layers.0.a", 5),
            ("model.layers.0.b", 3),
            ("model.layers.1.a", 5),
            ("model.layers.1.b", 3),
        ]
        .iter()
        .enumerate()
        .map(|(i, &(n, len))| {
            let v: Vec<f32> = (0..len).map(|j| (10 * i + j) as f32).collect();
            (
                n.to_string(),
                Tensor::from_vec(v, len, &Device::Cpu).unwrap(),
            )
        })
        .collect()
    }

    /// A forward and backward pass's calls, as the model makes them, with the courier (the
    /// prefetches in between) and without: the same gathered blocks on every rank, and the
    /// same summed gradients; the idle passes of a rank without rows join the same collectives.
    #[test]
    fn passes_gather_and_reduce_the_same_with_and_without_the_courier() {
        let block_of = grpo_models::models::checkpointing::block_of;
        for overlap in [true, false] {
            let handles: Vec<_> = Threads::world(3)
                .into_iter()
                .map(|w| {
                    std::thread::spawn(move || {
                        let w = Arc::new(w);
                        let p = Arc::new(ShardedParams::new(&params(), w.clone()).unwrap());
                        let mut ex = BlockExchange::new(p.clone(), 2, block_of).unwrap();
                        if !overlap {
                            ex.courier = None;
                        }
                        for _pass in 0..2 {
                            if w.rank() == 2 {
                                ex.idle_forward().unwrap();
                                ex.idle_backward().unwrap();
                                continue;
                            }
                            for i in 0..2 {
                                let b = BlockParams::gather(&ex, i).unwrap();
                                let want = &params()[1 + 2 * i].1;
                                let got = &b[&format!("model.layers.{i}.a")];
                                assert_eq!(
                                    got.to_vec1::<f32>().unwrap(),
                                    want.to_vec1::<f32>().unwrap()
                                );
                            }
                            for i in [1, 0] {
                                let b = BlockParams::gather(&ex, i).unwrap();
                                let g: HashMap<String, Tensor> = b
                                    .into_iter()
                                    .map(|(k, t)| (k, t.ones_like().unwrap()))
                                    .collect();
                                ex.gradients(i, g).unwrap();
                            }
                            ex.flush().unwrap();
                        }
                        let outer = [p.gather(&[0]).unwrap()[0].ones_like().unwrap()];
                        ex.reduce_outer(&[0], &outer).unwrap();
                        (w.rank(), ex.take().unwrap(), p.shard().range())
                    })
                })
                .collect();
            for h in handles {
                let (rank, acc, range) = h.join().unwrap();
                // Blocks: 2 passes x 2 ranks with rows; the embedding: once from each of 3.
                let want: Vec<f32> = range.map(|e| if e < 6 { 3.0 } else { 4.0 }).collect();
                assert_eq!(acc, want, "rank {rank}, overlap {overlap}");
            }
        }
    }
}
