use super::*;

/// `n` ranks over loopback, each on its own thread running `f`; their results in rank order.
fn ranks<T: Send>(n: usize, f: impl Fn(&TcpWorld) -> T + Sync) -> Vec<T> {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let rv = |rank| Rendezvous {
        rank,
        size: n,
        host: "127.0.0.1".into(),
        port,
        port_from: "MASTER_PORT".into(),
        wait: Duration::from_secs(20),
        timeout: Duration::from_secs(20),
    };
    let mut listener = Some(listener);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|r| {
                let l = listener.take().filter(|_| r == 0);
                let rv = rv(r);
                let f = &f;
                s.spawn(move || f(&TcpWorld::start(&rv, l).unwrap()))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Rank `r`'s values: of all magnitudes and signs, so that the order of the sums shows.
fn values(r: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let x = ((i * 7919 + r * 104729) % 1000) as f32 / 997.0 - 0.5;
            x * 10f32.powi((i % 9) as i32 - 4)
        })
        .collect()
}

#[test]
fn the_ring_sums_to_the_same_bits_on_every_rank() {
    for n in [2, 3, 4] {
        // Lengths shorter than the world, uneven parts, and more than one chunk.
        for len in [0, 1, n + 1, 1000, CHUNK + 17] {
            let sums = ranks(n, |w| {
                let mut xs = values(w.rank(), len);
                w.sum_f32(&mut xs).unwrap();
                xs
            });
            for s in &sums[1..] {
                let same = s
                    .iter()
                    .zip(&sums[0])
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same && s.len() == len,
                    "{n} ranks, {len} values: ranks differ"
                );
            }
            let each: Vec<Vec<f32>> = (0..n).map(|r| values(r, len)).collect();
            for (i, &got) in sums[0].iter().enumerate() {
                let want: f64 = each.iter().map(|v| v[i] as f64).sum();
                let tol = 1e-6 * each.iter().map(|v| v[i].abs() as f64).sum::<f64>();
                assert!((got as f64 - want).abs() <= tol, "{n} ranks, value {i}");
            }
        }
    }
}

#[test]
fn small_collectives_go_through_rank_0_and_agree() {
    let out = ranks(3, |w| {
        let r = w.rank();
        let mut x = [r as f64 + 0.1, 1e16, -(r as f64)];
        w.sum_f64(&mut x).unwrap();
        let gathered = w.all_gather_bytes(vec![r as u8; r]).unwrap();
        let flag = w.any(r == 2).unwrap();
        let counts = [2, 0, 3];
        let mine = values(r, 5);
        let part = w.reduce_scatter_f32(&mine, &counts).unwrap();
        let all = w.all_gather_f32(&vec![r as f32; r + 1]).unwrap();
        (x, gathered, flag, part, all)
    });
    for (r, (x, gathered, flag, part, all)) in out.iter().enumerate() {
        assert_eq!(x.map(f64::to_bits), out[0].0.map(f64::to_bits));
        assert_eq!(x[0], ((0.1 + 1.1) + 2.1), "rank order");
        assert_eq!(*gathered, vec![vec![], vec![1], vec![2, 2]]);
        assert!(*flag);
        let start = [0, 2, 2][r];
        let want: Vec<f32> = (0..part.len())
            .map(|i| (0..3).map(|q| values(q, 5)[start + i]).sum())
            .collect();
        assert_eq!(part.len(), [2, 0, 3][r]);
        for (a, b) in part.iter().zip(&want) {
            assert!((a - b).abs() < 1e-6, "rank {r}: {part:?} vs {want:?}");
        }
        assert_eq!(*all, vec![0., 1., 1., 2., 2., 2.]);
    }
}

#[test]
fn a_rank_that_is_gone_is_an_error_naming_it() {
    let out = ranks(2, |w| match w.rank() {
        // Rank 1 leaves (its sockets close when its world is dropped).
        1 => Ok(()),
        _ => {
            std::thread::sleep(Duration::from_millis(200));
            let mut x = vec![1f32; 10];
            w.sum_f32(&mut x)
        }
    });
    let e = out[0].as_ref().unwrap_err().to_string();
    assert!(
        e.contains("rank 1 closed its connection (it failed or was killed)"),
        "{e}"
    );
}

#[test]
fn a_rendezvous_that_misses_a_rank_says_which() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let rv = |rank| Rendezvous {
        rank,
        size: 3,
        host: "127.0.0.1".into(),
        port,
        port_from: "MASTER_PORT".into(),
        wait: Duration::from_secs(1),
        timeout: Duration::from_secs(1),
    };
    let started = Instant::now();
    let (zero, one) = std::thread::scope(|s| {
        let zero = s.spawn(|| TcpWorld::start(&rv(0), Some(listener)).err());
        let one = s.spawn(|| TcpWorld::start(&rv(1), None).err());
        (zero.join().unwrap(), one.join().unwrap())
    });
    let zero = zero.unwrap().to_string();
    assert!(zero.contains(&format!("127.0.0.1:{port}")), "{zero}");
    assert!(
        zero.contains("for rank(s) 2,") && zero.contains("rank 0 of 3"),
        "{zero}"
    );
    // Rank 1 had connected: rank 0 tells it why the rendezvous stopped.
    let one = one.unwrap().to_string();
    assert!(
        one.contains("rank 0 stopped the rendezvous") && one.contains("rank(s) 2"),
        "{one}"
    );
    assert!(started.elapsed() < Duration::from_secs(10));
    // Nobody listening: rank 1 gives up, naming where it looked.
    let e = TcpWorld::start(&rv(1), None).err().unwrap().to_string();
    assert!(
        e.contains("rank 0 never answered") && e.contains(&port.to_string()),
        "{e}"
    );
}

#[test]
fn a_rank_with_another_world_size_is_refused() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let rv = |rank, size| Rendezvous {
        rank,
        size,
        host: "127.0.0.1".into(),
        port,
        port_from: "MASTER_PORT".into(),
        wait: Duration::from_secs(5),
        timeout: Duration::from_secs(5),
    };
    let (zero, one) = std::thread::scope(|s| {
        let zero = s.spawn(|| TcpWorld::start(&rv(0, 2), Some(listener)).err());
        let one = s.spawn(|| TcpWorld::start(&rv(1, 3), None).err());
        (zero.join().unwrap(), one.join().unwrap())
    });
    for e in [zero.unwrap().to_string(), one.unwrap().to_string()] {
        assert!(
            e.contains("WORLD_SIZE=3") && e.contains("WORLD_SIZE=2"),
            "{e}"
        );
    }
}

#[test]
fn the_environment_names_what_is_missing() {
    let env = |pairs: Vec<(&'static str, &'static str)>| {
        move |k: &str| {
            pairs
                .iter()
                .find(|(a, _)| *a == k)
                .map(|(_, v)| v.to_string())
        }
    };
    assert!(parse(env(vec![])).unwrap().is_none());
    assert!(parse(env(vec![("WORLD_SIZE", "1"), ("RANK", "0")]))
        .unwrap()
        .is_none());
    let e = parse(env(vec![("WORLD_SIZE", "2"), ("RANK", "1")])).unwrap_err();
    assert!(e.to_string().contains("MASTER_ADDR"), "{e}");
    let e = parse(env(vec![("WORLD_SIZE", "2"), ("RANK", "2")])).unwrap_err();
    assert!(e.to_string().contains("RANK=2"), "{e}");
    let e = parse(env(vec![
        ("WORLD_SIZE", "2"),
        ("RANK", "0"),
        ("MASTER_ADDR", "h"),
        ("MASTER_PORT", "29500"),
        ("GRPO_RENDEZVOUS_TIMEOUT", "soon"),
    ]))
    .unwrap_err();
    assert!(e.to_string().contains("GRPO_RENDEZVOUS_TIMEOUT"), "{e}");
    let base = [
        ("WORLD_SIZE", "4"),
        ("RANK", "3"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "29500"),
    ];
    let r = parse(env(base.to_vec())).unwrap().unwrap();
    assert_eq!(
        (r.rank, r.size, r.host.as_str(), r.port),
        (3, 4, "node0", 29500)
    );
    assert_eq!(r.wait, Duration::from_secs(RENDEZVOUS_TIMEOUT_S));
    // Under torchrun its agent's store holds MASTER_PORT: grpo listens on the next port.
    let mut t = base.to_vec();
    t.push(("TORCHELASTIC_USE_AGENT_STORE", "True"));
    let r = parse(env(t)).unwrap().unwrap();
    assert_eq!(r.port, 29501);
    let mut t = base.to_vec();
    t.extend([
        ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ("GRPO_MASTER_PORT", "4000"),
    ]);
    let r = parse(env(t)).unwrap().unwrap();
    assert_eq!(r.port, 4000);
}
