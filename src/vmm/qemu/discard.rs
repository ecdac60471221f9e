//! Free page reporting that keeps the RAM reserve: memory a guest frees goes back to the host
//! while its blocks on the data root stay the VM's.
//!
//! QEMU discards the memory a guest reports free by punching it out of the VM's RAM file
//! (`fallocate(PUNCH_HOLE | KEEP_SIZE)` on a shared file mapping). That frees the page cache,
//! which is the point, and also the blocks [`super::ramfile::preallocate`] reserved, which
//! are then free space for any writer: a later reuse of such a page on a data root that filled
//! up meanwhile needs a block it cannot get, and the VM dies of SIGBUS.
//!
//! So a seccomp filter installed in QEMU's process before `exec` hands exactly that call
//! (`fallocate` with mode `PUNCH_HOLE | KEEP_SIZE`, nothing else) to the daemon
//! (`SECCOMP_RET_USER_NOTIF`; the listener comes back to the daemon over a socket pair). For
//! the VM's own RAM file the daemon zeroes the range instead (`ZERO_RANGE | KEEP_SIZE` on
//! QEMU's own descriptor, fetched with `pidfd_getfd`): the range's page cache is dropped, so
//! the memory goes back to the host as before, and its blocks stay allocated as unwritten
//! extents (reads give zeros), so the reserve holds. The call's answer is that result. Any
//! other punch (a qcow2 layer's discards) goes ahead as asked
//! (`SECCOMP_USER_NOTIF_FLAG_CONTINUE`), and so does the RAM file's where the filesystem has no
//! zero range (tmpfs; the usage sampler's re-reserve covers it there, as before).
//!
//! The listener is held by the keeper ([`keeper`]: one process for all the QEMUs of a daemon,
//! this binary again under the name [`KEEPER_NAME`], in a session of its own), not by the
//! daemon, so it outlives a daemon restart: a QEMU the next daemon adopts keeps giving freed
//! memory back. A keeper killed (or never started) leaves the trapped call failing (ENOSYS):
//! QEMU's discards fail (it logs them) and the reserve holds, but the memory the guest frees is
//! not given back until the VM's next start (resume, restore).
//! Where the filter cannot be installed (a kernel before 5.9, no seccomp), QEMU punches as
//! before. This is not a security fence: QEMU's own seccomp filter is that; a QEMU taken over
//! by its guest can only make its own discards fail.
//!
//! Owns: the filter, its installation in the child, the listener's hand-over, and the answer
//! to one QEMU's trapped call ([`Watched`]; the keeper's loop runs many).
//! Never: any other system call of QEMU's, or a file other than the one it is asked about.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::PathBuf;

/// The one mode trapped: what QEMU's `ram_block_discard_range` uses on a shared file.
const PUNCH: u32 = (libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE) as u32;
/// What the daemon does instead on the RAM file.
const ZERO: libc::c_int = libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE;

#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: u32 = 0xC000_003E;
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: u32 = 0xC000_00B7;

/// Offsets in `struct seccomp_data`: `nr` (int), `arch` (u32), then the ip, then `args[6]`
/// (u64 each; the low half of `args[1]` first on these little-endian targets).
const NR: u32 = 0;
const ARCH: u32 = 4;
const ARG1_LOW: u32 = 16 + 8;

const fn stmt(code: u32, k: u32) -> libc::sock_filter {
    libc::sock_filter {
        code: code as u16,
        jt: 0,
        jf: 0,
        k,
    }
}

const fn jump_eq(k: u32, jt: u8, jf: u8) -> libc::sock_filter {
    libc::sock_filter {
        code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16,
        jt,
        jf,
        k,
    }
}

const LOAD: u32 = libc::BPF_LD | libc::BPF_W | libc::BPF_ABS;
const RET: u32 = libc::BPF_RET | libc::BPF_K;

/// Native `fallocate` with mode [`PUNCH`] goes to the listener; every other call is allowed.
static FILTER: [libc::sock_filter; 8] = [
    stmt(LOAD, ARCH),
    jump_eq(AUDIT_ARCH, 0, 5),
    stmt(LOAD, NR),
    jump_eq(libc::SYS_fallocate as u32, 0, 3),
    stmt(LOAD, ARG1_LOW),
    jump_eq(PUNCH, 0, 1),
    stmt(RET, libc::SECCOMP_RET_USER_NOTIF),
    stmt(RET, libc::SECCOMP_RET_ALLOW),
];

/// The filter for one QEMU about to be spawned: made before the fork, installed in the child
/// ([`DiscardTrap::install_in_child`]), its listener taken by the daemon after the spawn
/// ([`DiscardTrap::listener`]).
pub(crate) struct DiscardTrap {
    daemon_end: OwnedFd,
    child_end: OwnedFd,
}

impl DiscardTrap {
    pub(crate) fn new() -> io::Result<DiscardTrap> {
        use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
        let (daemon_end, child_end) = socketpair(
            AddressFamily::Unix,
            SockType::Datagram,
            None,
            SockFlag::SOCK_CLOEXEC,
        )?;
        Ok(DiscardTrap {
            daemon_end,
            child_end,
        })
    }

    /// What the child needs: copied into the `pre_exec` closure.
    pub(crate) fn child_part(&self) -> ChildEnd {
        ChildEnd(self.child_end.as_raw_fd())
    }
}

/// The child's end of a [`DiscardTrap`]'s socket pair (a descriptor number: the trap owns it).
#[derive(Clone, Copy)]
pub(crate) struct ChildEnd(RawFd);

impl ChildEnd {
    /// In the forked child before `exec`: install the filter and send its listener to the
    /// daemon (or, when the kernel refuses, the error number without a descriptor). Never
    /// fails the spawn: without a filter QEMU punches as it would anyway.
    ///
    /// Async-signal-safe: prctl, seccomp, sendmsg and close on data made before the fork.
    pub(crate) fn install(self) {
        // SAFETY: every call below takes plain integers or pointers to locals and statics that
        // outlive it; nothing is allocated (we are between fork and exec).
        unsafe {
            // Unprivileged filters need no_new_privs (QEMU's own filter sets it too).
            libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
            let prog = libc::sock_fprog {
                len: FILTER.len() as u16,
                filter: FILTER.as_ptr() as *mut libc::sock_filter,
            };
            let listener = libc::syscall(
                libc::SYS_seccomp,
                libc::SECCOMP_SET_MODE_FILTER,
                libc::SECCOMP_FILTER_FLAG_NEW_LISTENER,
                &prog as *const libc::sock_fprog,
            );
            let errno: i32 = if listener < 0 {
                *libc::__errno_location()
            } else {
                0
            };
            let mut payload = errno.to_ne_bytes();
            let mut iov = libc::iovec {
                iov_base: payload.as_mut_ptr().cast(),
                iov_len: payload.len(),
            };
            // Room for one descriptor's control message (CMSG_SPACE(4) is 24 on 64-bit).
            let mut control = [0u64; 4];
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            if listener >= 0 {
                let fd = listener as libc::c_int;
                msg.msg_control = control.as_mut_ptr().cast();
                msg.msg_controllen = libc::CMSG_SPACE(size_of::<libc::c_int>() as u32) as usize;
                let c = libc::CMSG_FIRSTHDR(&msg);
                (*c).cmsg_level = libc::SOL_SOCKET;
                (*c).cmsg_type = libc::SCM_RIGHTS;
                (*c).cmsg_len = libc::CMSG_LEN(size_of::<libc::c_int>() as u32) as usize;
                std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<libc::c_int>(), fd);
            }
            libc::sendmsg(self.0, &msg, libc::MSG_DONTWAIT);
            if listener >= 0 {
                libc::close(listener as libc::c_int);
            }
        }
    }
}

impl DiscardTrap {
    /// After the spawn: the listener the child sent, or why there is none.
    pub(crate) fn listener(self) -> Result<OwnedFd, String> {
        drop(self.child_end);
        let mut payload = [0u8; 4];
        let mut iov = libc::iovec {
            iov_base: payload.as_mut_ptr().cast(),
            iov_len: payload.len(),
        };
        let mut control = [0u64; 4];
        // SAFETY: msghdr is plain data; zeroed is a valid empty header.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = size_of_val(&control);
        // SAFETY: recvmsg fills the buffers `msg` points to, all of which live on this frame.
        let n = unsafe {
            libc::recvmsg(
                self.daemon_end.as_raw_fd(),
                &mut msg,
                libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC,
            )
        };
        if n < 0 {
            return Err(format!(
                "no word from the child: {}",
                io::Error::last_os_error()
            ));
        }
        // SAFETY: the control buffer was filled by recvmsg above; CMSG_FIRSTHDR checks its
        // length, and a SCM_RIGHTS message of that length carries one descriptor we now own.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            if !c.is_null()
                && (*c).cmsg_level == libc::SOL_SOCKET
                && (*c).cmsg_type == libc::SCM_RIGHTS
                && (*c).cmsg_len == libc::CMSG_LEN(size_of::<libc::c_int>() as u32) as usize
            {
                let fd = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<libc::c_int>());
                return Ok(OwnedFd::from_raw_fd(fd));
            }
        }
        let errno = i32::from_ne_bytes(payload);
        Err(format!(
            "the kernel refused the filter: {}",
            io::Error::from_raw_os_error(errno)
        ))
    }
}

/// Whether QEMU's discards keep the RAM reserve on this host (for `tryboxi doctor`): the
/// filter installs in a short-lived child, and the filesystem of `dir` (the data root) can zero
/// a range. The reason when not.
pub(crate) fn probe(dir: &std::path::Path) -> Result<(), String> {
    use std::os::unix::process::CommandExt;
    let trap = DiscardTrap::new().map_err(|e| format!("no socket pair: {e}"))?;
    let child = trap.child_part();
    let mut cmd = std::process::Command::new("true");
    // SAFETY: the closure only calls `ChildEnd::install` (async-signal-safe, see there).
    unsafe {
        cmd.pre_exec(move || {
            child.install();
            Ok(())
        });
    }
    let mut c = cmd.spawn().map_err(|e| format!("cannot run `true`: {e}"))?;
    let listener = trap.listener();
    let _ = c.wait();
    listener?;
    let f = tempfile::tempfile_in(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    // SAFETY: fallocate on a file we own, with integers.
    let r = unsafe {
        if libc::fallocate(f.as_raw_fd(), 0, 0, 4096) != 0 {
            -1
        } else {
            libc::fallocate(f.as_raw_fd(), ZERO, 0, 4096)
        }
    };
    if r != 0 {
        return Err(format!(
            "the filesystem of {} cannot zero a range ({}): discards punch the reserve and the \
             daemon reserves it again every 2 s",
            dir.display(),
            io::Error::last_os_error()
        ));
    }
    Ok(())
}

pub(crate) mod keeper;

pub use keeper::{KEEPER_NAME, keeper_main};

/// One QEMU's trapped calls: its listener, its pidfd and its RAM file (the keeper answers many
/// of these from one loop, see [`keeper`]).
pub(crate) struct Watched {
    listener: OwnedFd,
    pidfd: crate::vmm::pidfd::Pidfd,
    ram: PathBuf,
    /// (device, inode) of the RAM file, read at the first trapped call (a restore may still be
    /// making the file when QEMU starts).
    ram_id: Option<(u64, u64)>,
    zeroed: u64,
}

/// What to tell QEMU about one trapped call.
enum Answer {
    /// Done by the daemon: this result (0 or a negative errno).
    Result(i32),
    /// Let the kernel run the call as asked.
    Continue,
    /// The call is gone (QEMU died or was interrupted): nothing to answer.
    Gone,
}

impl Watched {
    pub(crate) fn new(listener: OwnedFd, pidfd: crate::vmm::pidfd::Pidfd, ram: PathBuf) -> Self {
        Watched {
            listener,
            pidfd,
            ram,
            ram_id: None,
            zeroed: 0,
        }
    }

    pub(crate) fn pid(&self) -> u32 {
        self.pidfd.pid()
    }

    /// The listener (readable: a trapped call waits; hung up: no task left under the filter).
    pub(crate) fn listener_fd(&self) -> RawFd {
        self.listener.as_raw_fd()
    }

    /// QEMU's pidfd (readable once QEMU has exited).
    pub(crate) fn pidfd_fd(&self) -> RawFd {
        self.pidfd.as_raw_fd()
    }

    /// The listener is readable: take one trapped call and answer it. `false` when the
    /// listener is broken (nothing more will come through it).
    pub(crate) fn answer_one(&mut self) -> bool {
        // SAFETY: seccomp_notif is plain data; the kernel wants it zeroed.
        let mut req: libc::seccomp_notif = unsafe { std::mem::zeroed() };
        // SAFETY: NOTIF_RECV fills the struct it points to.
        let r = unsafe {
            libc::ioctl(
                self.listener.as_raw_fd(),
                libc::SECCOMP_IOCTL_NOTIF_RECV,
                &mut req,
            )
        };
        if r < 0 {
            // Interrupted, or the caller went away before we read it: the listener is fine.
            return matches!(
                io::Error::last_os_error().raw_os_error(),
                Some(libc::EINTR | libc::ENOENT)
            );
        }
        let mut resp = libc::seccomp_notif_resp {
            id: req.id,
            val: 0,
            error: 0,
            flags: 0,
        };
        match self.answer(&req) {
            Answer::Gone => return true,
            Answer::Continue => resp.flags = libc::SECCOMP_USER_NOTIF_FLAG_CONTINUE as u32,
            Answer::Result(e) => resp.error = e,
        }
        // SAFETY: NOTIF_SEND reads the struct it points to. ENOENT (the call is gone) is
        // not ours to handle.
        unsafe {
            libc::ioctl(
                self.listener.as_raw_fd(),
                libc::SECCOMP_IOCTL_NOTIF_SEND,
                &mut resp,
            );
        }
        true
    }

    fn answer(&mut self, req: &libc::seccomp_notif) -> Answer {
        let d = &req.data;
        if d.nr != libc::SYS_fallocate as i32 || d.args[1] as u32 != PUNCH {
            return Answer::Continue;
        }
        let (Ok(fd), Ok(offset), Ok(len)) = (
            libc::c_int::try_from(d.args[0]),
            libc::off_t::try_from(d.args[2]),
            libc::off_t::try_from(d.args[3]),
        ) else {
            return Answer::Continue;
        };
        // QEMU's descriptor, as QEMU opened it.
        // SAFETY: pidfd_getfd takes a pidfd, a descriptor number and flags, and returns a new
        // descriptor (close-on-exec) or -1.
        let r = unsafe {
            libc::syscall(
                libc::SYS_pidfd_getfd,
                self.pidfd.as_raw_fd(),
                fd,
                0 as libc::c_uint,
            )
        };
        if r < 0 {
            return Answer::Continue;
        }
        // SAFETY: a new descriptor we own.
        let theirs = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(r as RawFd) });
        if !self.is_ram(&theirs) {
            return Answer::Continue;
        }
        // Still the same pending call (QEMU alive, not interrupted): then the descriptor we
        // fetched is the one it asked about.
        // SAFETY: NOTIF_ID_VALID reads the u64 it points to.
        let valid = unsafe {
            libc::ioctl(
                self.listener.as_raw_fd(),
                libc::SECCOMP_IOCTL_NOTIF_ID_VALID,
                &req.id,
            )
        };
        if valid != 0 {
            return Answer::Gone;
        }
        // SAFETY: fallocate on a descriptor we own, with integers.
        let r = unsafe { libc::fallocate(theirs.as_raw_fd(), ZERO, offset, len) };
        if r == 0 {
            self.zeroed = self.zeroed.saturating_add(len as u64);
            return Answer::Result(0);
        }
        match io::Error::last_os_error().raw_os_error() {
            // No zero range here (tmpfs): punch as asked.
            Some(libc::EOPNOTSUPP) => Answer::Continue,
            Some(e) => Answer::Result(-e),
            None => Answer::Result(-libc::EIO),
        }
    }

    /// Whether `f` is the VM's RAM file.
    fn is_ram(&mut self, f: &std::fs::File) -> bool {
        use std::os::unix::fs::MetadataExt;
        let Ok(md) = f.metadata() else { return false };
        if self.ram_id.is_none()
            && let Ok(r) = std::fs::metadata(&self.ram)
        {
            self.ram_id = Some((r.dev(), r.ino()));
        }
        self.ram_id == Some((md.dev(), md.ino()))
    }
}

#[cfg(test)]
mod tests {
    use super::keeper::serve;
    use super::*;
    use std::io::{Read, Seek, SeekFrom, Write};
    use std::os::unix::fs::MetadataExt;
    use std::os::unix::process::CommandExt;
    use std::path::Path;

    const MIB: u64 = 1 << 20;

    /// A reserved 8 MiB file (as `ramfile::preallocate` makes it) whose first 4 MiB hold data
    /// still in the page cache, as a guest's RAM file after the guest used that memory.
    fn ram_file(path: &Path) -> std::fs::File {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(path)
            .unwrap();
        nix::fcntl::fallocate(&f, nix::fcntl::FallocateFlags::empty(), 0, 8 << 20).unwrap();
        f.write_all(&vec![0x5a; 4 << 20]).unwrap();
        f
    }

    fn allocated(f: &std::fs::File) -> u64 {
        f.metadata().unwrap().blocks() * 512
    }

    fn cached(f: &std::fs::File, off: u64, len: u64) -> u64 {
        super::super::ramfile::cache_state(f, off, len)
            .expect("cachestat (Linux 6.5)")
            .cached_pages
    }

    /// `fallocate --punch-hole` of the first `len` bytes of `file` (QEMU's discard) in a child
    /// under a trap: the running child and its trap's listener.
    pub(super) fn trapped_punch(file: &Path, len: u64) -> (std::process::Child, OwnedFd) {
        let mut cmd = std::process::Command::new("fallocate");
        cmd.args(["--punch-hole", "--offset", "0", "--length"])
            .arg(len.to_string())
            .arg(file)
            .stderr(std::process::Stdio::null());
        trapped(cmd)
    }

    /// `cmd` started under a trap (its children too): the child and the trap's listener.
    pub(super) fn trapped(mut cmd: std::process::Command) -> (std::process::Child, OwnedFd) {
        let trap = DiscardTrap::new().unwrap();
        let child = trap.child_part();
        // SAFETY: the closure only calls `ChildEnd::install` (async-signal-safe, see there).
        unsafe {
            cmd.pre_exec(move || {
                child.install();
                Ok(())
            });
        }
        let c = cmd.spawn().unwrap();
        let listener = trap.listener().expect("the filter installs on this kernel");
        (c, listener)
    }

    /// `fallocate --punch-hole` (mode PUNCH_HOLE | KEEP_SIZE, QEMU's discard) of `len` bytes
    /// at 0 of `file`, run under a trap whose listener is served for `ram` (or dropped when
    /// `serve_it` is false). Its exit status.
    fn punch_under_trap(file: &Path, len: u64, ram: &Path, serve_it: bool) -> bool {
        let (mut c, listener) = trapped_punch(file, len);
        if serve_it {
            serve(listener, c.id(), ram.to_owned()).unwrap();
        } else {
            drop(listener);
        }
        c.wait().unwrap().success()
    }

    #[test]
    fn a_punch_of_the_ram_file_zeroes_the_range_and_keeps_its_blocks() {
        let d = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let ram = d.path().join("mem.ram");
        let mut f = ram_file(&ram);
        assert_eq!(allocated(&f), 8 * MIB);
        assert_eq!(cached(&f, 0, 4 * MIB), 1024);
        assert!(punch_under_trap(&ram, 2 * MIB, &ram, true));
        // The memory is given back (the range's page cache is gone), the blocks stay.
        assert_eq!(
            cached(&f, 0, 2 * MIB),
            0,
            "the discarded range is still cached"
        );
        assert_eq!(allocated(&f), 8 * MIB, "the discard gave blocks back");
        assert!(super::super::fiemap::all_unwritten(&f, 0, 2 * MIB).unwrap());
        // It reads as zeros; the rest is untouched.
        let mut buf = vec![1u8; (4 * MIB) as usize];
        f.seek(SeekFrom::Start(0)).unwrap();
        f.read_exact(&mut buf).unwrap();
        assert!(buf[..(2 * MIB) as usize].iter().all(|&b| b == 0));
        assert!(buf[(2 * MIB) as usize..].iter().all(|&b| b == 0x5a));
    }

    #[test]
    fn a_punch_of_another_file_goes_ahead_as_asked() {
        let d = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let ram = d.path().join("mem.ram");
        let _r = ram_file(&ram);
        let layer = d.path().join("disk.qcow2");
        let f = ram_file(&layer);
        assert!(punch_under_trap(&layer, 2 * MIB, &ram, true));
        assert_eq!(allocated(&f), 6 * MIB, "a layer's discard was not punched");
    }

    #[test]
    fn without_the_daemon_the_punch_fails_and_the_file_is_untouched() {
        let d = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let ram = d.path().join("mem.ram");
        let f = ram_file(&ram);
        assert!(!punch_under_trap(&ram, 2 * MIB, &ram, false));
        assert_eq!(allocated(&f), 8 * MIB);
        assert_eq!(cached(&f, 0, 4 * MIB), 1024);
    }

    #[test]
    fn the_probe_says_whether_a_filesystem_keeps_the_reserve() {
        let d = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        assert_eq!(probe(d.path()), Ok(()));
        if Path::new("/dev/shm").is_dir() {
            let e = probe(Path::new("/dev/shm")).unwrap_err();
            assert!(e.contains("cannot zero a range"), "{e}");
        }
        assert!(probe(&d.path().join("absent")).is_err());
    }

    #[test]
    fn where_no_range_can_be_zeroed_the_punch_goes_ahead() {
        // tmpfs has no zero range: the punch frees the memory (there, the blocks are memory).
        let shm = Path::new("/dev/shm");
        if !shm.is_dir() {
            println!("no /dev/shm on this host: the tmpfs case is not tried");
            return;
        }
        let d = tempfile::tempdir_in(shm).unwrap();
        let ram = d.path().join("mem.ram");
        let f = ram_file(&ram);
        assert!(punch_under_trap(&ram, 2 * MIB, &ram, true));
        assert_eq!(allocated(&f), 6 * MIB);
    }
}
