//! The keeper: one process answers the trapped discards of every QEMU a daemon starts.
//!
//! Each QEMU's seccomp listener (see the parent module) goes to the keeper over a control
//! socket (`SOCK_SEQPACKET`): one message per QEMU, its pid and RAM file's path as the payload
//! and two descriptors (the listener, QEMU's pidfd) as `SCM_RIGHTS`. The keeper polls its
//! control socket and every listener and pidfd it holds, answers each trapped call, and drops a
//! QEMU once its pidfd says it exited (or its listener hangs up). Each round answers at most
//! one call per QEMU, so a QEMU taken over by its guest that traps calls without end slows
//! only itself.
//!
//! The keeper is this binary again, under the name [`KEEPER_NAME`], in a session of its own and
//! not the daemon's child (it forks once and its first process exits): it outlives the daemon,
//! so a QEMU the next daemon adopts keeps giving freed memory back. When the daemon that
//! started it is gone (its control socket hung up), it serves the QEMUs it holds and exits
//! after the last one; the next daemon starts a keeper of its own at its first QEMU.
//!
//! Launching a QEMU costs one `sendmsg` to the keeper. A process per QEMU (the first design)
//! cost about 5 ms of CPU at each launch (the fork of the daemon, the exec and relocation of
//! this static binary, its exit), which a restore on a 2-core host waited for, and one more
//! process per sandbox.
//!
//! Where a keeper could not fetch QEMU's descriptors (an unprivileged daemon under Yama's
//! ptrace restrictions), the same loop runs on a thread of the daemon instead: freed memory is
//! given back while that daemon runs. A keeper that dies (or cannot start) costs the QEMUs it
//! held their discards (the trapped call fails, the reserve holds); the next launch starts a
//! new one.
//!
//! Owns: the keeper process, its control protocol and loop, and the daemon's side of it (one
//! thread that hands QEMUs over, starting the keeper first when there is none).

use super::Watched;
use std::ffi::OsString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::sync::mpsc;

/// argv[0] of the keeper process (`lib.rs` dispatches on it).
pub const KEEPER_NAME: &str = "tryboxi-discard-keeper";
/// Longest RAM file path a control message carries.
const MAX_PATH: usize = 4096;
/// QEMUs one keeper holds at most; a hand-over past it is refused (that QEMU's discards fail).
const MAX_WATCHED: usize = 8192;
/// Descriptors per control message: the listener, then QEMU's pidfd.
const FDS: usize = 2;

/// One QEMU on its way to the keeper.
struct Handoff {
    listener: OwnedFd,
    pidfd: crate::vmm::pidfd::Pidfd,
    ram: PathBuf,
}

/// The daemon's hand-over thread, started at the first [`keep`].
static CLIENT: OnceLock<mpsc::Sender<Handoff>> = OnceLock::new();

/// Hand QEMU `pid`'s trap `listener` to the keeper; `ram` is the VM's RAM file and `tag` names
/// the daemon's data root on the keeper's command line (for `ps`). Returns at once: the keeper
/// (started first when there is none) gets it from a thread of its own, and QEMU's trapped
/// calls wait in the listener's queue meanwhile.
pub(crate) fn keep(listener: OwnedFd, pid: u32, ram: PathBuf, tag: &Path) -> io::Result<()> {
    // Opened while QEMU is our unreaped child: the pid is QEMU's.
    let Some(pidfd) = crate::vmm::pidfd::Pidfd::open(pid)? else {
        return Ok(());
    };
    let h = Handoff {
        listener,
        pidfd,
        ram,
    };
    let tx = CLIENT.get_or_init(|| {
        let (tx, rx) = mpsc::channel();
        let tag = tag.as_os_str().to_owned();
        // A thread that cannot start leaves the receiver dropped: every send below fails
        // and serves on a thread of its own instead.
        let _ = std::thread::Builder::new()
            .name("discard-handover".into())
            .stack_size(256 * 1024)
            .spawn(move || hand_over(rx, tag));
        tx
    });
    if let Err(mpsc::SendError(h)) = tx.send(h) {
        serve_alone(h);
    }
    Ok(())
}

/// The hand-over thread: each QEMU goes to the keeper (started when there is none, or again
/// when the one we had is gone); when none can be had, to a thread of the daemon.
fn hand_over(rx: mpsc::Receiver<Handoff>, tag: OsString) {
    let mut conn: Option<OwnedFd> = None;
    for h in rx {
        let pid = h.pidfd.pid();
        let mut sent = false;
        // Twice: the keeper we had may have died since the last hand-over.
        for _ in 0..2 {
            if conn.is_none() {
                match start(&tag) {
                    Ok(c) => conn = Some(c),
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot start the discard keeper: a thread of the daemon answers (until a restart)");
                        break;
                    }
                }
            }
            let Some(c) = &conn else { break };
            match send(c, &h) {
                Ok(()) => {
                    sent = true;
                    break;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    tracing::warn!(
                        pid,
                        "the discard keeper is not reading: a thread of the daemon answers this QEMU"
                    );
                    break;
                }
                Err(e) => {
                    tracing::debug!(pid, error = %e, "the discard keeper is gone: starting another");
                    conn = None;
                }
            }
        }
        if sent {
            tracing::debug!(pid, "QEMU handed to the discard keeper");
        } else {
            serve_alone(h);
        }
    }
}

/// A loop of its own on a thread of the daemon for one QEMU (no keeper could take it).
fn serve_alone(h: Handoff) {
    let pid = h.pidfd.pid();
    let w = Watched::new(h.listener, h.pidfd, h.ram);
    if let Err(e) = std::thread::Builder::new()
        .name(format!("qemu-discard-{pid}"))
        .stack_size(64 * 1024)
        .spawn(move || run(None, vec![w]))
    {
        tracing::warn!(pid, error = %e, "no thread to answer QEMU's discards: they fail until its next start");
    }
}

/// Answer the trapped calls of QEMU `pid` on `listener` from a thread of this process until it
/// exits (the unit tests' way, whose binary is not tryboxi).
#[cfg(test)]
pub(crate) fn serve(listener: OwnedFd, pid: u32, ram: PathBuf) -> io::Result<()> {
    let Some(pidfd) = crate::vmm::pidfd::Pidfd::open(pid)? else {
        return Ok(());
    };
    serve_alone(Handoff {
        listener,
        pidfd,
        ram,
    });
    Ok(())
}

/// A new keeper with its control socket; our end of it. A process when it may fetch QEMU's
/// descriptors, else a thread of the daemon.
fn start(tag: &std::ffi::OsStr) -> io::Result<OwnedFd> {
    let (ours, theirs) = seqpacket_pair()?;
    if keeper_may_fetch() {
        let mut child = spawn_keeper(theirs, tag)?;
        // Its first process exits once the keeper runs (forked off, not our child).
        let st = child.wait()?;
        if !st.success() {
            return Err(io::Error::other(format!("the keeper exited: {st}")));
        }
        tracing::debug!("discard keeper started");
    } else {
        std::thread::Builder::new()
            .name("discard-keeper".into())
            .stack_size(256 * 1024)
            .spawn(move || run(Some(theirs), Vec::new()))?;
        tracing::debug!(
            "discard keeper started on a thread of the daemon (no descriptor fetching from another process here)"
        );
    }
    Ok(ours)
}

fn seqpacket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
    Ok(socketpair(
        AddressFamily::Unix,
        SockType::SeqPacket,
        None,
        SockFlag::SOCK_CLOEXEC,
    )?)
}

/// Whether a keeper (not an ancestor of QEMU) may `pidfd_getfd` from QEMU: always as root
/// (`CAP_SYS_PTRACE`); as another user only where Yama does not restrict ptrace to
/// descendants (`kernel.yama.ptrace_scope` absent or 0).
fn keeper_may_fetch() -> bool {
    // SAFETY: geteuid has no arguments and cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope").map_or(true, |s| s.trim() == "0")
}

/// `/proc/self/exe` as [`KEEPER_NAME`] `TAG`, its control socket on stdin, in a session of its
/// own.
fn spawn_keeper(control: OwnedFd, tag: &std::ffi::OsStr) -> io::Result<std::process::Child> {
    use std::os::unix::process::CommandExt as _;
    let mut cmd = std::process::Command::new("/proc/self/exe");
    cmd.arg0(KEEPER_NAME)
        .arg(tag)
        .stdin(std::process::Stdio::from(control))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    // SAFETY: the closure runs in the forked child before exec and only calls setsid(2)
    // (async-signal-safe).
    unsafe {
        cmd.pre_exec(|| {
            // Its own session, as QEMU's: a signal to the daemon's group does not reach it.
            if libc::setsid() < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd.spawn()
}

/// Send one QEMU to the keeper on `conn` (never blocks: a full queue is `WouldBlock`).
fn send(conn: &OwnedFd, h: &Handoff) -> io::Result<()> {
    use nix::sys::socket::{ControlMessage, MsgFlags, UnixAddr, sendmsg};
    use std::os::unix::ffi::OsStrExt;
    let path = h.ram.as_os_str().as_bytes();
    if path.len() > MAX_PATH {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "RAM file path too long",
        ));
    }
    let pid = h.pidfd.pid().to_le_bytes();
    let fds: [RawFd; FDS] = [h.listener.as_raw_fd(), h.pidfd.as_raw_fd()];
    sendmsg::<UnixAddr>(
        conn.as_raw_fd(),
        &[io::IoSlice::new(&pid), io::IoSlice::new(path)],
        &[ControlMessage::ScmRights(&fds)],
        MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL,
        None,
    )?;
    Ok(())
}

/// What one read of the control socket brought.
enum Control {
    /// A QEMU to watch.
    Qemu(Watched),
    /// A malformed message (dropped, with any descriptors it carried).
    Bad,
    /// The daemon closed its end.
    Closed,
}

/// Read one message from the control socket.
fn recv(conn: RawFd) -> Control {
    use nix::sys::socket::{ControlMessageOwned, MsgFlags, UnixAddr, recvmsg};
    let mut payload = vec![0u8; 4 + MAX_PATH];
    let mut space = nix::cmsg_space!([RawFd; FDS]);
    let mut iov = [io::IoSliceMut::new(&mut payload)];
    let msg = match recvmsg::<UnixAddr>(
        conn,
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC | MsgFlags::MSG_DONTWAIT,
    ) {
        Ok(m) => m,
        Err(nix::errno::Errno::EINTR | nix::errno::Errno::EAGAIN) => return Control::Bad,
        Err(_) => return Control::Closed,
    };
    if msg.bytes == 0 {
        return Control::Closed;
    }
    // Every descriptor that came, owned now (closed with this vector on any early return).
    let mut fds: Vec<OwnedFd> = Vec::new();
    if let Ok(cmsgs) = msg.cmsgs() {
        for c in cmsgs {
            if let ControlMessageOwned::ScmRights(raw) = c {
                // SAFETY: descriptors the kernel just installed in this process for this
                // message; nothing else owns them.
                fds.extend(
                    raw.into_iter()
                        .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
                );
            }
        }
    }
    let (n, truncated) = (
        msg.bytes,
        msg.flags
            .intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC),
    );
    if truncated || n < 4 || fds.len() != FDS {
        return Control::Bad;
    }
    let pid = u32::from_le_bytes([payload[0], payload[1], payload[2], payload[3]]);
    let ram = PathBuf::from(
        <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(&payload[4..n]),
    );
    let mut fds = fds.into_iter();
    let (Some(listener), Some(pidfd)) = (fds.next(), fds.next()) else {
        return Control::Bad;
    };
    Control::Qemu(Watched::new(
        listener,
        crate::vmm::pidfd::Pidfd::from_owned(pidfd, pid),
        ram,
    ))
}

/// The keeper's loop: take QEMUs from `control` (while the daemon holds its end) and answer
/// the trapped calls of every QEMU in `watched`; return once the daemon is gone and no QEMU is
/// left.
fn run(mut control: Option<OwnedFd>, mut watched: Vec<Watched>) {
    let mut fds: Vec<libc::pollfd> = Vec::new();
    loop {
        if control.is_none() && watched.is_empty() {
            return;
        }
        fds.clear();
        let pfd = |fd: RawFd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // Slot 0: the control socket, or -1 (poll skips it) once the daemon is gone.
        fds.push(pfd(control.as_ref().map_or(-1, |c| c.as_raw_fd())));
        for w in &watched {
            fds.push(pfd(w.listener_fd()));
            fds.push(pfd(w.pidfd_fd()));
        }
        // SAFETY: poll reads and writes the `fds.len()` pollfds of the vector.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
        if r < 0 {
            if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return;
        }
        // Answer first, then drop the QEMUs that are gone (indices stay valid meanwhile).
        let mut gone = vec![false; watched.len()];
        for (i, w) in watched.iter_mut().enumerate() {
            let (l, p) = (fds[1 + 2 * i].revents, fds[2 + 2 * i].revents);
            // QEMU gone (its pidfd readable), or no task left under the filter.
            let hung = p != 0 || l & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0;
            gone[i] = hung || (l & libc::POLLIN != 0 && !w.answer_one());
        }
        let mut i = 0;
        watched.retain(|w| {
            let keep = !gone[i];
            i += 1;
            if !keep {
                tracing::debug!(
                    pid = w.pid(),
                    zeroed = w.zeroed,
                    "QEMU gone: its discards are no longer answered"
                );
            }
            keep
        });
        let c = fds[0].revents;
        if let Some(conn) = &control
            && c != 0
        {
            match recv(conn.as_raw_fd()) {
                Control::Qemu(w) if watched.len() < MAX_WATCHED => watched.push(w),
                Control::Qemu(_) | Control::Bad => {}
                Control::Closed => control = None,
            }
            if c & libc::POLLIN == 0 && c & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0 {
                control = None;
            }
        }
    }
}

/// The keeper process: `KEEPER_NAME TAG`, its control socket on stdin (checked to be a
/// socket). Detaches (fork; the first process exits) and serves until the daemon is gone and
/// the last QEMU it was given has exited.
pub fn keeper_main() -> std::process::ExitCode {
    use std::process::ExitCode;
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if args.len() != 2 {
        eprintln!("usage: {KEEPER_NAME} DATA_ROOT (started by the tryboxi daemon)");
        return ExitCode::from(2);
    }
    let is_socket = std::fs::read_link("/proc/self/fd/0")
        .is_ok_and(|l| l.to_string_lossy().starts_with("socket:"));
    if !is_socket {
        eprintln!("{KEEPER_NAME}: descriptor 0 must be the daemon's control socket");
        return ExitCode::from(2);
    }
    // SAFETY: checked above to be an open socket; nothing else in this process owns it.
    let control = unsafe { OwnedFd::from_raw_fd(0) };
    // SAFETY: fork in a process with one thread (nothing was started yet).
    match unsafe { libc::fork() } {
        -1 => return ExitCode::FAILURE,
        0 => {}
        _ => return ExitCode::SUCCESS,
    }
    run(Some(control), Vec::new());
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_control_message_carries_a_qemu_and_a_malformed_one_is_dropped() {
        let (a, b) = seqpacket_pair().unwrap();
        // This process stands in for QEMU: its pidfd, and a socket as the "listener".
        let pidfd = crate::vmm::pidfd::Pidfd::from_owned(
            // SAFETY: pidfd_open on our own pid, flags 0; a new descriptor or -1.
            unsafe {
                let fd = libc::syscall(libc::SYS_pidfd_open, std::process::id(), 0);
                assert!(fd >= 0);
                OwnedFd::from_raw_fd(fd as RawFd)
            },
            std::process::id(),
        );
        let (l, _keep) = seqpacket_pair().unwrap();
        let h = Handoff {
            listener: l,
            pidfd,
            ram: PathBuf::from("/var/lib/tryboxi/sandboxes/sbx_1/mem.ram"),
        };
        send(&a, &h).unwrap();
        match recv(b.as_raw_fd()) {
            Control::Qemu(w) => {
                assert_eq!(w.pid(), std::process::id());
                assert_eq!(w.ram, h.ram);
            }
            _ => panic!("the hand-over did not arrive"),
        }
        // A message without descriptors is dropped, and the socket still works after it.
        // SAFETY: send on a socket we own, from a buffer on this frame.
        let n = unsafe { libc::send(a.as_raw_fd(), [1u8, 2, 3, 4, 5].as_ptr().cast(), 5, 0) };
        assert_eq!(n, 5);
        assert!(matches!(recv(b.as_raw_fd()), Control::Bad));
        let long = Handoff {
            ram: PathBuf::from("x".repeat(MAX_PATH + 1)),
            ..h
        };
        assert!(send(&a, &long).is_err(), "an over-long path was sent");
        drop(a);
        assert!(matches!(recv(b.as_raw_fd()), Control::Closed));
    }

    #[test]
    fn one_loop_answers_the_qemus_handed_over_and_ends_after_the_last() {
        use std::os::unix::fs::MetadataExt;
        let d = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let (a, b) = seqpacket_pair().unwrap();
        let keeper = std::thread::spawn(move || run(Some(b), Vec::new()));
        // Two QEMU stand-ins, each blocked in its trapped punch of its own RAM file.
        let mut kids = Vec::new();
        for i in 0..2 {
            let ram = d.path().join(format!("mem{i}.ram"));
            let f = std::fs::File::create(&ram).unwrap();
            nix::fcntl::fallocate(&f, nix::fcntl::FallocateFlags::empty(), 0, 8 << 20).unwrap();
            let (c, listener) = super::super::tests::trapped_punch(&ram, 2 << 20);
            let pidfd = crate::vmm::pidfd::Pidfd::open(c.id()).unwrap().unwrap();
            send(
                &a,
                &Handoff {
                    listener,
                    pidfd,
                    ram: ram.clone(),
                },
            )
            .unwrap();
            kids.push((c, f));
        }
        for (mut c, f) in kids {
            assert!(c.wait().unwrap().success(), "a punch was not answered");
            // Zeroed, not punched: the blocks stay the VM's.
            assert_eq!(f.metadata().unwrap().blocks() * 512, 8 << 20);
        }
        // The daemon goes; the keeper has no QEMU left (both exited): it ends.
        drop(a);
        keeper.join().unwrap();
    }

    /// A QEMU its guest took over can trap discards without end; the keeper answers one call
    /// per QEMU per round, so another QEMU's call is still answered meanwhile.
    #[test]
    fn a_qemu_that_floods_its_trap_does_not_starve_another() {
        use std::os::unix::fs::MetadataExt;
        let d = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let junk = d.path().join("junk");
        std::fs::write(&junk, vec![1u8; 1 << 20]).unwrap();
        let (a, b) = seqpacket_pair().unwrap();
        let keeper = std::thread::spawn(move || run(Some(b), Vec::new()));
        let mut cmd = std::process::Command::new("sh");
        cmd.arg("-c")
            .arg(format!(
                "while :; do fallocate --punch-hole --offset 0 --length 4096 {}; done",
                junk.display()
            ))
            .stderr(std::process::Stdio::null());
        let (mut flood, fl) = super::super::tests::trapped(cmd);
        let hand = |c: &std::process::Child, listener: OwnedFd, ram: &Path| {
            let pidfd = crate::vmm::pidfd::Pidfd::open(c.id()).unwrap().unwrap();
            let h = Handoff {
                listener,
                pidfd,
                ram: ram.to_owned(),
            };
            send(&a, &h).unwrap();
        };
        hand(&flood, fl, &junk);
        let ram = d.path().join("mem.ram");
        let f = std::fs::File::create(&ram).unwrap();
        nix::fcntl::fallocate(&f, nix::fcntl::FallocateFlags::empty(), 0, 8 << 20).unwrap();
        let (mut c, listener) = super::super::tests::trapped_punch(&ram, 2 << 20);
        hand(&c, listener, &ram);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        let st = loop {
            if let Some(st) = c.try_wait().unwrap() {
                break Some(st);
            }
            if std::time::Instant::now() > deadline {
                break None;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        };
        let _ = flood.kill();
        let _ = flood.wait();
        if st.is_none() {
            let _ = c.kill();
        }
        assert!(
            st.is_some_and(|s| s.success()),
            "starved by the flood: {st:?}"
        );
        assert_eq!(f.metadata().unwrap().blocks() * 512, 8 << 20);
        drop(a);
        keeper.join().unwrap();
    }

    #[test]
    fn the_loop_ends_when_the_daemon_is_gone_and_no_qemu_is_left() {
        let (a, b) = seqpacket_pair().unwrap();
        let t = std::thread::spawn(move || run(Some(b), Vec::new()));
        drop(a);
        t.join().unwrap();
    }
}
