//! Training across processes without MPI: the ranks that `torchrun`, Kubernetes' PyTorchJob or a
//! Slurm script start with `RANK`, `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` set find each
//! other over TCP (`std::net`). Every rank connects to rank 0, which checks their ranks and world
//! sizes and tells each where its ring neighbour listens; then each rank connects to the next.
//!
//! Small collectives (sums of a few `f64`, gathers of bytes) go through rank 0, which adds the
//! ranks' values in rank order and sends every rank the same result. Gradients are summed by a
//! ring all-reduce: a reduce-scatter, after which rank `r` holds the sum of part `r` (added up on
//! that rank alone, in a fixed order), then an all-gather that copies each summed part to every
//! rank, so every rank ends with the same bits. Each step sends one part to the next rank while
//! receiving one from the previous: `2 (N - 1) / N` times the gradient bytes per rank, as MPI's
//! ring does.
//!
//! Nothing waits forever: the rendezvous waits at most `GRPO_RENDEZVOUS_TIMEOUT` seconds (default
//! 300) and names what it waited for; each read and write of a collective waits at most the
//! collective timeout (`GRPO_COLLECTIVE_TIMEOUT`, or `GRPO_MPI_TIMEOUT`; default 1800 s); a peer
//! that closed its connection (it failed or was killed) is an error at once.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::ops::Range;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use candle_core::Tensor;

use super::world::{collective_timeout, World, WorldHandle};
use crate::{Error, Result};

/// How long the ranks wait for each other at the start unless `GRPO_RENDEZVOUS_TIMEOUT` says.
pub const RENDEZVOUS_TIMEOUT_S: u64 = 300;

/// The first bytes of every rendezvous message (a grpo rank, this protocol's version).
const MAGIC: &[u8; 8] = b"grpo-tc1";

/// Values per write or read of the ring (4 MiB).
const CHUNK: usize = 1 << 20;

/// Where and how the ranks of an environment launch meet.
#[derive(Debug, Clone)]
pub struct Rendezvous {
    /// This process's rank (`RANK`), `0..size`.
    pub rank: usize,
    /// How many processes train together (`WORLD_SIZE`).
    pub size: usize,
    /// Rank 0's host (`MASTER_ADDR`).
    pub host: String,
    /// The port rank 0 listens on.
    pub port: u16,
    /// Where the port came from, for messages (`MASTER_PORT`, `GRPO_MASTER_PORT`, ...).
    pub port_from: String,
    /// How long the ranks wait for each other at the start.
    pub wait: Duration,
    /// How long one read or write of a collective waits.
    pub timeout: Duration,
}

impl Rendezvous {
    /// The launch the environment describes: `WORLD_SIZE` > 1 with `RANK`, `MASTER_ADDR` and
    /// `MASTER_PORT`; `None` for one process (`WORLD_SIZE` unset or 1), or when `RANK` is unset
    /// under an MPI launcher (which numbers the ranks itself).
    pub fn from_env() -> Result<Option<Rendezvous>> {
        let mut r = match parse(|k| std::env::var(k).ok())? {
            Some(r) => r,
            None => return Ok(None),
        };
        r.timeout = Duration::from_secs(collective_timeout());
        Ok(Some(r))
    }
}

/// [`Rendezvous::from_env`] over the variables `get` returns.
fn parse(get: impl Fn(&str) -> Option<String>) -> Result<Option<Rendezvous>> {
    let var = |k: &str| {
        get(k)
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
    };
    let number = |k: &str, v: &str| {
        v.parse::<usize>()
            .map_err(|_| Error::config(k, format!("{k}=`{v}` is not a whole number")))
    };
    let Some(ws) = var("WORLD_SIZE") else {
        return Ok(None);
    };
    let size = number("WORLD_SIZE", &ws)?;
    if size <= 1 {
        return Ok(None);
    }
    let Some(rank) = var("RANK") else {
        if super::world::launcher_world_size().is_some() {
            return Ok(None);
        }
        return Err(Error::config(
            "RANK",
            format!(
                "WORLD_SIZE={size} is set but RANK is not: a launch of several processes sets \
                 RANK (0..{size}), MASTER_ADDR and MASTER_PORT in each (torchrun does)"
            ),
        ));
    };
    let rank = number("RANK", &rank)?;
    if rank >= size {
        return Err(Error::config(
            "RANK",
            format!("RANK={rank} is not below WORLD_SIZE={size}"),
        ));
    }
    let missing = |k: &str| {
        Error::config(
            k,
            format!(
                "RANK and WORLD_SIZE={size} are set but {k} is not: MASTER_ADDR and MASTER_PORT \
                 name where rank 0 listens (torchrun sets both; e.g. MASTER_ADDR=node0 \
                 MASTER_PORT=29500)"
            ),
        )
    };
    let host = var("MASTER_ADDR").ok_or_else(|| missing("MASTER_ADDR"))?;
    let master_port = var("MASTER_PORT").ok_or_else(|| missing("MASTER_PORT"))?;
    let port_number = |k: &str, v: &str| {
        v.parse::<u16>()
            .ok()
            .filter(|&p| p > 0)
            .ok_or_else(|| Error::config(k, format!("{k}=`{v}` is not a port (1..65535)")))
    };
    let master = port_number("MASTER_PORT", &master_port)?;
    // torchrun's agent serves its own store on MASTER_PORT (and says so): grpo takes the next.
    let agent_store = var("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v == "True");
    let (port, port_from) = match var("GRPO_MASTER_PORT") {
        Some(v) => (
            port_number("GRPO_MASTER_PORT", &v)?,
            "GRPO_MASTER_PORT".to_string(),
        ),
        None if agent_store => (
            master.checked_add(1).ok_or_else(|| {
                Error::config(
                    "MASTER_PORT",
                    "MASTER_PORT + 1 is not a port: set GRPO_MASTER_PORT",
                )
            })?,
            format!(
                "MASTER_PORT + 1: torchrun's own store listens on MASTER_PORT={master}; \
                 GRPO_MASTER_PORT sets another"
            ),
        ),
        None => (master, "MASTER_PORT".to_string()),
    };
    let wait = match var("GRPO_RENDEZVOUS_TIMEOUT") {
        None => RENDEZVOUS_TIMEOUT_S,
        Some(v) => v.parse::<u64>().ok().filter(|&s| s > 0).ok_or_else(|| {
            Error::config(
                "GRPO_RENDEZVOUS_TIMEOUT",
                format!(
                    "GRPO_RENDEZVOUS_TIMEOUT=`{v}` is not a number of seconds (unset: \
                     {RENDEZVOUS_TIMEOUT_S})"
                ),
            )
        })?,
    };
    Ok(Some(Rendezvous {
        rank,
        size,
        host,
        port,
        port_from,
        wait: Duration::from_secs(wait),
        timeout: Duration::from_secs(1800),
    }))
}

/// This process's rank when the environment describes a launch of several processes (`RANK`
/// with `WORLD_SIZE` > 1), before any connection is made.
pub fn env_rank() -> Option<usize> {
    Rendezvous::from_env().ok().flatten().map(|r| r.rank)
}

/// The cores a rank takes by default: all it may run on, shared among the processes of its node
/// when the launcher says how many there are (`LOCAL_WORLD_SIZE`, which torchrun sets; it binds
/// no process to cores, as `mpirun` and `srun` do).
pub fn cores_per_rank() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let local = std::env::var("LOCAL_WORLD_SIZE")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or(1);
    (cores / local).max(1)
}

/// What a collective is, sent ahead of its data so that ranks in different collectives fail
/// with a message instead of reading each other's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    SumF64 = 1,
    GatherBytes = 2,
    SumF32 = 3,
    ReduceScatter = 4,
    GatherF32 = 5,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::SumF64 => "a sum of f64",
            Op::GatherBytes => "a gather of bytes",
            Op::SumF32 => "a sum of f32 (gradients)",
            Op::ReduceScatter => "a reduce-scatter",
            Op::GatherF32 => "a gather of f32",
        }
    }

    fn from_byte(b: u8) -> Option<Op> {
        [
            Op::SumF64,
            Op::GatherBytes,
            Op::SumF32,
            Op::ReduceScatter,
            Op::GatherF32,
        ]
        .into_iter()
        .find(|o| *o as u8 == b)
    }
}

/// The ranks of a launch without MPI, connected over TCP (see the module's documentation).
pub struct TcpWorld {
    rank: usize,
    size: usize,
    /// Rank 0: a connection to each other rank (`star[r - 1]` to rank `r`); any other rank: its
    /// connection to rank 0.
    star: Vec<TcpStream>,
    /// The ring: to the next rank, and from the previous one.
    next: TcpStream,
    prev: TcpStream,
    timeout: Duration,
    /// One collective at a time.
    busy: Mutex<()>,
    /// NCCL for gradients on a GPU, bootstrapped over this world.
    #[cfg(feature = "nccl")]
    nccl: super::nccl::LazyComm,
}

impl TcpWorld {
    /// Meets the other ranks as `rv` says: rank 0 listens, the others connect (retrying while
    /// rank 0 is not up yet), all within `rv.wait`.
    pub fn connect(rv: &Rendezvous) -> Result<TcpWorld> {
        let listener = match rv.rank {
            0 => Some(bind_master(rv)?),
            _ => None,
        };
        Self::start(rv, listener)
    }

    /// [`TcpWorld::connect`], rank 0 taking connections on `listener` (tests bind port 0).
    fn start(rv: &Rendezvous, listener: Option<TcpListener>) -> Result<TcpWorld> {
        let (rank, n) = (rv.rank, rv.size);
        if n < 2 || rank >= n {
            return Err(Error::invariant(format!(
                "a TCP world of rank {rank} of {n} (needs 2 or more ranks)"
            )));
        }
        let deadline = Instant::now() + rv.wait;
        let (star, ring, table) = match listener {
            Some(l) => meet_as_rank_0(rv, l, deadline)?,
            None => meet_rank_0(rv, deadline)?,
        };
        // The ring: connect to the next rank's ring port, take the previous rank's connection.
        let deadline = Instant::now() + rv.wait;
        let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
        let (host, port) = &table[next];
        let to_next = connect_until(host, *port, deadline).map_err(|e| {
            Error::distributed(format!(
                "rank {rank} of {n}: could not reach rank {next} at {host}:{port} (its ring port) \
                 within {} s: {e}",
                rv.wait.as_secs()
            ))
        })?;
        let mut hello = MAGIC.to_vec();
        hello.extend((rank as u32).to_le_bytes());
        (&to_next)
            .write_all(&hello)
            .map_err(|e| Error::distributed(format!("rank {rank}: to rank {next}: {e}")))?;
        let from_prev = accept_until(&ring, deadline).map_err(|_| {
            Error::distributed(format!(
                "rank {rank} of {n}: rank {prev} never connected to this rank's ring port within \
                 {} s (GRPO_RENDEZVOUS_TIMEOUT sets the wait)",
                rv.wait.as_secs()
            ))
        })?;
        from_prev
            .0
            .set_read_timeout(Some(rv.wait))
            .map_err(|e| Error::io("ring", e))?;
        let mut got = [0u8; 12];
        let said = (&from_prev.0)
            .read_exact(&mut got)
            .ok()
            .filter(|_| &got[..8] == MAGIC)
            .map(|_| u32::from_le_bytes([got[8], got[9], got[10], got[11]]) as usize);
        if said != Some(prev) {
            return Err(Error::distributed(format!(
                "rank {rank} of {n}: the connection to this rank's ring port from {} is not rank \
                 {prev}'s",
                from_prev.1
            )));
        }
        let world = TcpWorld {
            rank,
            size: n,
            star,
            next: to_next,
            prev: from_prev.0,
            timeout: rv.timeout,
            busy: Mutex::new(()),
            #[cfg(feature = "nccl")]
            nccl: Default::default(),
        };
        for s in world.star.iter().chain([&world.next, &world.prev]) {
            s.set_nodelay(true)
                .and_then(|_| s.set_read_timeout(Some(rv.timeout)))
                .and_then(|_| s.set_write_timeout(Some(rv.timeout)))
                .map_err(|e| Error::io("socket options", e))?;
        }
        Ok(world)
    }

    /// The error of a read or write with `peer` during `op`.
    fn link_error(&self, peer: usize, op: Op, e: io::Error) -> Error {
        use io::ErrorKind::*;
        let what = op.name();
        Error::distributed(match e.kind() {
            UnexpectedEof | ConnectionReset | ConnectionAborted | BrokenPipe | NotConnected => {
                format!("rank {peer} closed its connection (it failed or was killed), in {what}")
            }
            WouldBlock | TimedOut => format!(
                "waited more than {} s for rank {peer} in {what}: it is stuck or gone \
                 (GRPO_COLLECTIVE_TIMEOUT sets the limit)",
                self.timeout.as_secs()
            ),
            _ => format!("the connection with rank {peer} failed in {what}: {e}"),
        })
    }

    fn send(&self, to: &TcpStream, peer: usize, op: Op, bytes: &[u8]) -> Result<()> {
        let mut w = to;
        w.write_all(bytes).map_err(|e| self.link_error(peer, op, e))
    }

    fn recv(&self, from: &TcpStream, peer: usize, op: Op, buf: &mut [u8]) -> Result<()> {
        let mut r = from;
        r.read_exact(buf).map_err(|e| self.link_error(peer, op, e))
    }

    /// Reads a message header from `peer`: it must be `op`'s; returns its length.
    fn recv_header(&self, from: &TcpStream, peer: usize, op: Op) -> Result<usize> {
        let mut h = [0u8; 9];
        self.recv(from, peer, op, &mut h)?;
        if h[0] != op as u8 {
            let theirs = Op::from_byte(h[0]).map_or("an unknown collective", Op::name);
            return Err(Error::distributed(format!(
                "rank {peer} is in {theirs} while rank {} is in {}: the ranks took different \
                 paths",
                self.rank,
                op.name()
            )));
        }
        let mut n = [0u8; 8];
        n.copy_from_slice(&h[1..]);
        Ok(u64::from_le_bytes(n) as usize)
    }

    /// Every rank's `mine` goes to rank 0, which makes one result of them all (index = rank) and
    /// sends it to every rank.
    fn through_rank_0(
        &self,
        op: Op,
        mine: Vec<u8>,
        combine: impl FnOnce(Vec<Vec<u8>>) -> Result<Vec<u8>>,
    ) -> Result<Vec<u8>> {
        let framed = |b: &[u8]| {
            let mut f = Vec::with_capacity(9 + b.len());
            f.push(op as u8);
            f.extend((b.len() as u64).to_le_bytes());
            f.extend_from_slice(b);
            f
        };
        if self.rank == 0 {
            let mut all = vec![mine];
            for (i, s) in self.star.iter().enumerate() {
                let len = self.recv_header(s, i + 1, op)?;
                let mut b = vec![0u8; len];
                self.recv(s, i + 1, op, &mut b)?;
                all.push(b);
            }
            let out = combine(all)?;
            let msg = framed(&out);
            for (i, s) in self.star.iter().enumerate() {
                self.send(s, i + 1, op, &msg)?;
            }
            Ok(out)
        } else {
            let s = &self.star[0];
            self.send(s, 0, op, &framed(&mine))?;
            let len = self.recv_header(s, 0, op)?;
            let mut out = vec![0u8; len];
            self.recv(s, 0, op, &mut out)?;
            Ok(out)
        }
    }

    fn gather_bytes(&self, mine: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        let out = self.through_rank_0(Op::GatherBytes, mine, |all| {
            let mut out = Vec::new();
            for b in &all {
                out.extend((b.len() as u64).to_le_bytes());
                out.extend_from_slice(b);
            }
            Ok(out)
        })?;
        let mut parts = Vec::with_capacity(self.size);
        let mut rest = &out[..];
        for _ in 0..self.size {
            let bad = || Error::distributed("rank 0 sent a gather of bytes cut short");
            let len = rest
                .get(..8)
                .ok_or_else(bad)?
                .try_into()
                .map(u64::from_le_bytes)
                .map_err(|_| bad())? as usize;
            let b = rest.get(8..8 + len).ok_or_else(bad)?;
            parts.push(b.to_vec());
            rest = &rest[8 + len..];
        }
        Ok(parts)
    }

    /// The ring over `xs`, cut into `parts` (rank `r` owns `parts[r]`): with `reduce`, a
    /// reduce-scatter after which rank `r`'s part holds the sum of every rank's; with `gather`,
    /// an all-gather that copies each rank's part to every rank.
    fn ring(
        &self,
        op: Op,
        xs: &mut [f32],
        parts: &[Range<usize>],
        reduce: bool,
        gather: bool,
    ) -> Result<()> {
        let (r, n) = (self.rank, self.size);
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        // The ranks agree on the collective and its length.
        let mut h = vec![op as u8];
        h.extend((xs.len() as u64).to_le_bytes());
        self.send(&self.next, next, op, &h)?;
        let len = self.recv_header(&self.prev, prev, op)?;
        if len != xs.len() {
            return Err(Error::distributed(format!(
                "rank {prev} has {len} values in {}, rank {r} has {}",
                op.name(),
                xs.len()
            )));
        }
        // Step s of the reduce-scatter: part r - s - 1 goes to the next rank, part r - s - 2
        // comes from the previous one and is added in; after n - 1 steps part r is summed here.
        if reduce {
            for s in 0..n - 1 {
                let send = parts[(r + 2 * n - s - 1) % n].clone();
                let recv = parts[(r + 2 * n - s - 2) % n].clone();
                self.exchange(op, xs, send, recv, true)?;
            }
        }
        // Step s of the all-gather: part r - s goes on, part r - s - 1 arrives and is copied.
        if gather {
            for s in 0..n - 1 {
                let send = parts[(r + 2 * n - s) % n].clone();
                let recv = parts[(r + 2 * n - s - 1) % n].clone();
                self.exchange(op, xs, send, recv, false)?;
            }
        }
        Ok(())
    }

    /// Sends `xs[send]` to the next rank while receiving `xs[recv]` from the previous one
    /// (added to what is there, or copied over it).
    fn exchange(
        &self,
        op: Op,
        xs: &mut [f32],
        send: Range<usize>,
        recv: Range<usize>,
        add: bool,
    ) -> Result<()> {
        let (out, into) = disjoint(xs, send, recv);
        let (next, prev) = (
            (self.rank + 1) % self.size,
            (self.rank + self.size - 1) % self.size,
        );
        std::thread::scope(|s| {
            let sender = s.spawn(|| write_f32s(&self.next, out));
            let got = read_f32s(&self.prev, into, add);
            if got.is_err() {
                // The sender may be blocked on a rank that waits for us: unblock it.
                let _ = self.next.shutdown(Shutdown::Both);
            }
            let sent = sender
                .join()
                .map_err(|_| Error::invariant("the ring's sending thread panicked"))?;
            got.map_err(|e| self.link_error(prev, op, e))?;
            sent.map_err(|e| self.link_error(next, op, e))
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ()> {
        self.busy.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// `xs[a]` to read and `xs[b]` to write (two ranges that do not overlap).
fn disjoint(xs: &mut [f32], a: Range<usize>, b: Range<usize>) -> (&[f32], &mut [f32]) {
    if a.end <= b.start {
        let (lo, hi) = xs.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.end - b.start])
    } else {
        let (lo, hi) = xs.split_at_mut(a.start);
        (&hi[..a.end - a.start], &mut lo[b])
    }
}

fn write_f32s(mut w: &TcpStream, xs: &[f32]) -> io::Result<()> {
    let mut buf = Vec::with_capacity(CHUNK.min(xs.len()) * 4);
    for c in xs.chunks(CHUNK) {
        buf.clear();
        for x in c {
            buf.extend_from_slice(&x.to_le_bytes());
        }
        w.write_all(&buf)?;
    }
    Ok(())
}

fn read_f32s(mut r: &TcpStream, into: &mut [f32], add: bool) -> io::Result<()> {
    let mut buf = vec![0u8; CHUNK.min(into.len()) * 4];
    for c in into.chunks_mut(CHUNK) {
        let b = &mut buf[..c.len() * 4];
        r.read_exact(b)?;
        let values = b
            .chunks_exact(4)
            .map(|q| f32::from_le_bytes([q[0], q[1], q[2], q[3]]));
        if add {
            c.iter_mut().zip(values).for_each(|(x, v)| *x += v);
        } else {
            c.iter_mut().zip(values).for_each(|(x, v)| *x = v);
        }
    }
    Ok(())
}

/// `len` values cut into `n` parts as even as can be, in order.
fn even_parts(len: usize, n: usize) -> Vec<Range<usize>> {
    (0..n).map(|i| len * i / n..len * (i + 1) / n).collect()
}

/// Consecutive parts of the given sizes.
fn parts_of(counts: &[usize]) -> Vec<Range<usize>> {
    let mut start = 0;
    counts
        .iter()
        .map(|&c| {
            start += c;
            start - c..start
        })
        .collect()
}

/// Rank 0's listener: every interface of `MASTER_ADDR`'s address family, on the port.
fn bind_master(rv: &Rendezvous) -> Result<TcpListener> {
    let v6 = (rv.host.as_str(), rv.port)
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .is_some_and(|a| a.is_ipv6());
    let any: SocketAddr = match v6 {
        true => (std::net::Ipv6Addr::UNSPECIFIED, rv.port).into(),
        false => (std::net::Ipv4Addr::UNSPECIFIED, rv.port).into(),
    };
    TcpListener::bind(any).map_err(|e| {
        Error::distributed(format!(
            "rank 0 of {} cannot listen on port {} ({}): {e}{}",
            rv.size,
            rv.port,
            rv.port_from,
            match e.kind() {
                io::ErrorKind::AddrInUse =>
                    ": another program (or an earlier run) holds it; pick a free port",
                _ => "",
            }
        ))
    })
}

/// Connects to `host:port`, retrying until `deadline` (the peer may not be listening yet, its
/// name may not resolve yet); the last error when it never answered.
fn connect_until(host: &str, port: u16, deadline: Instant) -> io::Result<TcpStream> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let tried = (host, port).to_socket_addrs().and_then(|addrs| {
            let mut last = io::Error::new(io::ErrorKind::NotFound, "no address");
            for a in addrs {
                let wait = left.clamp(Duration::from_millis(10), Duration::from_secs(5));
                match TcpStream::connect_timeout(&a, wait) {
                    Ok(s) => return Ok(s),
                    Err(e) => last = e,
                }
            }
            Err(last)
        });
        match tried {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

/// The next connection to `listener` before `deadline` (blocking), with its address.
fn accept_until(listener: &TcpListener, deadline: Instant) -> io::Result<(TcpStream, SocketAddr)> {
    listener.set_nonblocking(true)?;
    loop {
        match listener.accept() {
            Ok((s, from)) => {
                s.set_nonblocking(false)?;
                return Ok((s, from));
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(io::Error::new(io::ErrorKind::TimedOut, "nobody connected"));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// Where each rank's ring port is: (host, port), in rank order.
type Table = Vec<(String, u16)>;

/// What the rendezvous leaves a rank: its connections through rank 0, its ring listener, and
/// where every rank's ring port is.
type Met = (Vec<TcpStream>, TcpListener, Table);

/// Rank 0's side of the rendezvous: takes one connection from each other rank, checks what it
/// says, and answers every rank with the table of ring ports (or the error that stopped it).
fn meet_as_rank_0(rv: &Rendezvous, listener: TcpListener, deadline: Instant) -> Result<Met> {
    let n = rv.size;
    let local = listener.local_addr().map_err(|e| Error::io("listen", e))?;
    let ring = TcpListener::bind(SocketAddr::new(
        match local.ip().is_ipv6() {
            true => std::net::Ipv6Addr::UNSPECIFIED.into(),
            false => std::net::Ipv4Addr::UNSPECIFIED.into(),
        },
        0,
    ))
    .map_err(|e| Error::io("listen for the ring", e))?;
    let ring_port = ring.local_addr().map_err(|e| Error::io("ring", e))?.port();
    let mut peers: Vec<Option<(TcpStream, String, u16)>> = (0..n).map(|_| None).collect();
    // An error goes to every rank that connected (and to the one connecting), then is rank 0's.
    let fail = |peers: &[Option<(TcpStream, String, u16)>],
                connecting: Option<&TcpStream>,
                msg: String|
     -> Result<Met> {
        let mut reply = MAGIC.to_vec();
        reply.push(1);
        reply.extend((msg.len() as u32).to_le_bytes());
        reply.extend(msg.as_bytes());
        let connected = peers.iter().flatten().map(|(s, _, _)| s);
        for s in connected.chain(connecting) {
            let _ = (&*s).write_all(&reply);
        }
        Err(Error::distributed(msg))
    };
    while peers[1..].iter().any(Option::is_none) {
        let (s, from) = match accept_until(&listener, deadline) {
            Ok(c) => c,
            Err(e) if e.kind() == io::ErrorKind::TimedOut => {
                let missing: Vec<String> = (1..n)
                    .filter(|&r| peers[r].is_none())
                    .map(|r| r.to_string())
                    .collect();
                return fail(
                    &peers,
                    None,
                    format!(
                        "rank 0 of {n} waited {} s at {}:{} (MASTER_ADDR; port from {}) for \
                         rank(s) {}, which never connected: are they started, with the same \
                         MASTER_ADDR, MASTER_PORT and WORLD_SIZE, and can they reach this host? \
                         (GRPO_RENDEZVOUS_TIMEOUT sets the wait)",
                        rv.wait.as_secs(),
                        rv.host,
                        rv.port,
                        rv.port_from,
                        missing.join(", ")
                    ),
                );
            }
            Err(e) => return Err(Error::io("rendezvous: accept", e)),
        };
        let hello = read_hello(&s);
        let Some((rank, size, port)) = hello else {
            return fail(
                &peers,
                Some(&s),
                format!(
                    "rank 0: a connection from {from} to port {} did not introduce itself as a \
                     grpo rank (another program, or another grpo version, uses this port?)",
                    rv.port
                ),
            );
        };
        if size != n {
            return fail(
                &peers,
                Some(&s),
                format!(
                    "rank {rank} (at {from}) was started with WORLD_SIZE={size}, rank 0 with \
                     WORLD_SIZE={n}: every rank needs the same WORLD_SIZE"
                ),
            );
        }
        if rank == 0 || rank >= n {
            return fail(
                &peers,
                Some(&s),
                format!(
                    "a process at {from} says it is rank {rank} of {n}, but rank 0 is this one: \
                     RANK must be 1..{} in the others",
                    n - 1
                ),
            );
        }
        if let Some((_, other, _)) = &peers[rank] {
            return fail(
                &peers,
                Some(&s),
                format!(
                    "two processes (at {other} and {from}) say they are rank {rank}: each needs \
                     its own RANK"
                ),
            );
        }
        peers[rank] = Some((s, from.ip().to_string(), port));
    }
    let mut table: Table = vec![(rv.host.clone(), ring_port)];
    let mut star = Vec::with_capacity(n - 1);
    for (s, host, port) in peers.into_iter().flatten() {
        table.push((host, port));
        star.push(s);
    }
    let mut reply = MAGIC.to_vec();
    reply.push(0);
    for (host, port) in &table {
        reply.extend((host.len() as u16).to_le_bytes());
        reply.extend(host.as_bytes());
        reply.extend(port.to_le_bytes());
    }
    for (i, s) in star.iter().enumerate() {
        (&*s).write_all(&reply).map_err(|e| {
            Error::distributed(format!(
                "rank 0: rank {} closed its connection during the rendezvous: {e}",
                i + 1
            ))
        })?;
    }
    Ok((star, ring, table))
}

/// What a rank says when it connects to rank 0: (rank, world size, ring port); None when it is
/// not a grpo rank.
fn read_hello(s: &TcpStream) -> Option<(usize, usize, u16)> {
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    let mut b = [0u8; 18];
    (&*s).read_exact(&mut b).ok()?;
    if &b[..8] != MAGIC {
        return None;
    }
    let rank = u32::from_le_bytes(b[8..12].try_into().ok()?) as usize;
    let size = u32::from_le_bytes(b[12..16].try_into().ok()?) as usize;
    let port = u16::from_le_bytes(b[16..18].try_into().ok()?);
    Some((rank, size, port))
}

/// A rank other than 0: connects to rank 0 (retrying until `deadline`), says who it is and
/// where its ring port is, and receives the table of ring ports.
fn meet_rank_0(rv: &Rendezvous, deadline: Instant) -> Result<Met> {
    let (rank, n) = (rv.rank, rv.size);
    let at = format!(
        "{}:{} (MASTER_ADDR; port from {})",
        rv.host, rv.port, rv.port_from
    );
    let s = connect_until(&rv.host, rv.port, deadline).map_err(|e| {
        Error::distributed(format!(
            "rank {rank} of {n}: rank 0 never answered at {at} within {} s (last: {e}): is it \
             started, with the same MASTER_ADDR and MASTER_PORT? (GRPO_RENDEZVOUS_TIMEOUT sets \
             the wait)",
            rv.wait.as_secs()
        ))
    })?;
    // The ring port, on the interface rank 0 is reached through.
    let local = s.local_addr().map_err(|e| Error::io("rendezvous", e))?;
    let ring = TcpListener::bind(SocketAddr::new(local.ip(), 0))
        .map_err(|e| Error::io("listen for the ring", e))?;
    let ring_port = ring.local_addr().map_err(|e| Error::io("ring", e))?.port();
    let mut hello = MAGIC.to_vec();
    hello.extend((rank as u32).to_le_bytes());
    hello.extend((n as u32).to_le_bytes());
    hello.extend(ring_port.to_le_bytes());
    let broken = |e: io::Error| {
        Error::distributed(match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => format!(
                "rank {rank} of {n}: rank 0 at {at} took the connection but did not answer \
                 within {} s",
                rv.wait.as_secs() + 10
            ),
            _ => format!(
                "rank {rank} of {n}: rank 0 at {at} closed the connection during the rendezvous \
                 (it failed: see its error): {e}"
            ),
        })
    };
    (&s).write_all(&hello).map_err(broken)?;
    // Rank 0 answers within its own wait, which started before this connection.
    s.set_read_timeout(Some(rv.wait + Duration::from_secs(10)))
        .map_err(|e| Error::io("rendezvous", e))?;
    let mut head = [0u8; 9];
    (&s).read_exact(&mut head).map_err(broken)?;
    if &head[..8] != MAGIC {
        return Err(Error::distributed(format!(
            "rank {rank} of {n}: what listens at {at} is not grpo's rank 0"
        )));
    }
    let mut r = &s;
    let mut take = |k: usize| -> Result<Vec<u8>> {
        let mut b = vec![0u8; k];
        r.read_exact(&mut b).map_err(broken)?;
        Ok(b)
    };
    if head[8] != 0 {
        let len = u32::from_le_bytes(take(4)?.try_into().unwrap_or_default()) as usize;
        let msg = String::from_utf8_lossy(&take(len.min(1 << 16))?).into_owned();
        return Err(Error::distributed(format!(
            "rank {rank} of {n}: rank 0 stopped the rendezvous: {msg}"
        )));
    }
    let mut table = Table::with_capacity(n);
    for _ in 0..n {
        let len = u16::from_le_bytes(take(2)?.try_into().unwrap_or_default()) as usize;
        let host = String::from_utf8_lossy(&take(len)?).into_owned();
        let port = u16::from_le_bytes(take(2)?.try_into().unwrap_or_default());
        table.push((host, port));
    }
    Ok((vec![s], ring, table))
}

impl World for TcpWorld {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn sum_f64(&self, xs: &mut [f64]) -> Result<()> {
        let _one = self.lock();
        let mine: Vec<u8> = xs.iter().flat_map(|x| x.to_le_bytes()).collect();
        let len = mine.len();
        let out = self.through_rank_0(Op::SumF64, mine, |all| {
            // Rank order: 0 + 1 + 2 + ..., the one result every rank receives.
            let mut acc: Vec<f64> = decode_f64(&all[0]);
            for (r, b) in all.iter().enumerate().skip(1) {
                if b.len() != len {
                    return Err(Error::distributed(format!(
                        "rank {r} sums {} values, rank 0 sums {}",
                        b.len() / 8,
                        len / 8
                    )));
                }
                acc.iter_mut().zip(decode_f64(b)).for_each(|(a, x)| *a += x);
            }
            Ok(acc.iter().flat_map(|x| x.to_le_bytes()).collect())
        })?;
        if out.len() != len {
            return Err(Error::distributed(format!(
                "rank 0 sent a sum of {} values, rank {} sums {}",
                out.len() / 8,
                self.rank,
                len / 8
            )));
        }
        xs.copy_from_slice(&decode_f64(&out));
        Ok(())
    }
    fn sum_f32(&self, xs: &mut [f32]) -> Result<()> {
        let _one = self.lock();
        self.ring(Op::SumF32, xs, &even_parts(xs.len(), self.size), true, true)
    }
    fn sum_grads(&self, grads: &mut [Tensor]) -> Result<()> {
        // Gradients on a GPU: NCCL sums them there, its communicator bootstrapped over TCP.
        #[cfg(feature = "nccl")]
        if let Some(dev) = super::nccl::cuda_device(grads) {
            let comm = self.nccl.get(self, &dev)?;
            for g in grads.iter_mut() {
                *g = comm.sum(g)?;
            }
            return Ok(());
        }
        super::world::sum_in_buckets(self, grads)
    }
    fn reduce_scatter_f32(&self, xs: &[f32], counts: &[usize]) -> Result<Vec<f32>> {
        if counts.len() != self.size || counts.iter().sum::<usize>() != xs.len() {
            return Err(Error::invariant(format!(
                "reduce-scatter of {} values in parts {counts:?} over {} ranks",
                xs.len(),
                self.size
            )));
        }
        let _one = self.lock();
        let parts = parts_of(counts);
        let mut all = xs.to_vec();
        self.ring(Op::ReduceScatter, &mut all, &parts, true, false)?;
        Ok(all[parts[self.rank].clone()].to_vec())
    }
    fn all_gather_f32(&self, mine: &[f32]) -> Result<Vec<f32>> {
        let _one = self.lock();
        let counts: Vec<usize> = self
            .gather_bytes((mine.len() as u64).to_le_bytes().to_vec())?
            .iter()
            .map(|b| b.as_slice().try_into().map(u64::from_le_bytes).unwrap_or(0) as usize)
            .collect();
        let parts = parts_of(&counts);
        let mut all = vec![0f32; counts.iter().sum()];
        all[parts[self.rank].clone()].copy_from_slice(mine);
        self.ring(Op::GatherF32, &mut all, &parts, false, true)?;
        Ok(all)
    }
    fn all_gather_bytes(&self, mine: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        let _one = self.lock();
        self.gather_bytes(mine)
    }
}

fn decode_f64(b: &[u8]) -> Vec<f64> {
    b.chunks_exact(8)
        .map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
        .collect()
}

impl WorldHandle for TcpWorld {
    /// Exits: the closed connections stop the other ranks at their next read.
    fn abort_job(&self, code: i32) {
        std::process::exit(code)
    }
    fn as_world(&self) -> &dyn World {
        self
    }
}

#[cfg(test)]
mod tests;
