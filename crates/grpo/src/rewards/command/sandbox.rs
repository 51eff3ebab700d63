//! Process group, resource limits and network namespace, set between fork and exec.

use std::process::{Child, Command};

use super::CommandSpec;

/// The scorer gets its own process group (so that it can be killed with everything it
/// started), and the spec's limits. Runs in the child before exec: system calls only, no
/// allocation.
pub(super) fn apply(cmd: &mut Command, spec: &CommandSpec) {
    use std::os::unix::process::CommandExt;
    let cpu = spec.cpu_seconds;
    let mem = spec.memory_mb.map(|mb| mb.saturating_mul(1 << 20));
    let net = spec.no_network.then(UserMaps::current);
    // SAFETY: the closure only makes async-signal-safe system calls on data prepared
    // before the fork.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setpgid(0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if let Some(s) = cpu {
                // SIGXCPU at `s` seconds, SIGKILL one second later if that is ignored.
                limit(libc::RLIMIT_CPU, s, s.saturating_add(1))?;
            }
            if let Some(b) = mem {
                limit(libc::RLIMIT_AS, b, b)?;
            }
            if let Some(maps) = &net {
                unshare_net(maps)?;
            }
            Ok(())
        });
    }
}

#[cfg(target_os = "linux")]
type Resource = libc::__rlimit_resource_t;
#[cfg(not(target_os = "linux"))]
type Resource = libc::c_int;

/// Lowers a limit (never above the current hard limit, which cannot be raised).
fn limit(res: Resource, soft: u64, hard: u64) -> std::io::Result<()> {
    let mut cur = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain system calls on a local struct.
    unsafe {
        if libc::getrlimit(res, &mut cur) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let max = (hard as libc::rlim_t).min(cur.rlim_max);
        let new = libc::rlimit {
            rlim_cur: (soft as libc::rlim_t).min(max),
            rlim_max: max,
        };
        if libc::setrlimit(res, &new) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// The uid/gid maps that keep our ids inside a new user namespace (needed when we are not
/// privileged enough to make a network namespace directly).
pub(super) struct UserMaps {
    uid: Vec<u8>,
    gid: Vec<u8>,
}

impl UserMaps {
    pub(super) fn current() -> Self {
        // SAFETY: getuid/getgid cannot fail.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        UserMaps {
            uid: format!("{uid} {uid} 1\n").into_bytes(),
            gid: format!("{gid} {gid} 1\n").into_bytes(),
        }
    }
}

#[cfg(target_os = "linux")]
fn unshare_net(maps: &UserMaps) -> std::io::Result<()> {
    // SAFETY: system calls only; paths are static C strings, contents prepared before fork.
    unsafe {
        if libc::unshare(libc::CLONE_NEWNET) == 0 {
            return Ok(());
        }
        let direct = std::io::Error::last_os_error();
        if libc::unshare(libc::CLONE_NEWUSER | libc::CLONE_NEWNET) != 0 {
            return Err(direct);
        }
        write_file(c"/proc/self/setgroups", b"deny");
        write_file(c"/proc/self/uid_map", &maps.uid);
        write_file(c"/proc/self/gid_map", &maps.gid);
    }
    Ok(())
}

#[cfg(not(target_os = "linux"))]
fn unshare_net(_: &UserMaps) -> std::io::Result<()> {
    Err(std::io::Error::from(std::io::ErrorKind::Unsupported))
}

#[cfg(target_os = "linux")]
unsafe fn write_file(path: &std::ffi::CStr, data: &[u8]) {
    let fd = libc::open(path.as_ptr(), libc::O_WRONLY);
    if fd >= 0 {
        libc::write(fd, data.as_ptr().cast(), data.len());
        libc::close(fd);
    }
}

/// Whether a child can get a new network namespace here: a fork that only tries it.
pub(crate) fn probe_no_network() -> std::io::Result<()> {
    use std::os::unix::process::CommandExt;
    let exe = std::env::current_exe().unwrap_or_else(|_| "/bin/sh".into());
    let maps = UserMaps::current();
    let mut cmd = Command::new(exe);
    cmd.stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    // SAFETY: system calls only; on success the child leaves before exec with _exit.
    unsafe {
        cmd.pre_exec(move || {
            unshare_net(&maps)?;
            libc::_exit(0)
        });
    }
    let mut child = cmd.spawn()?;
    let _ = child.wait();
    Ok(())
}

/// SIGKILL to the scorer's process group: the scorer and whatever it started that is still
/// running. Linux does not hand out a process id again while a group of that id has
/// members, so right after the scorer was reaped this still reaches only its leftovers; the
/// caller sends it once, at the first kill.
pub(super) fn kill_group(child: &Child) {
    let pid = child.id() as libc::pid_t;
    if pid > 0 {
        // SAFETY: a signal to the group the scorer leads (setpgid in `apply`).
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
        }
    }
}
