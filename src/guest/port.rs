//! The guest end of the agent channel: a named virtio-serial port.
//!
//! Owns finding, opening and re-arming the port. The port can be opened by one process only
//! (EBUSY), so it stays open for the agent's life; when the host side disconnects reads return
//! EOF and we wait (poll) for the next host connection. Never used in tests.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// `/dev/vportNpM` whose `/sys/class/virtio-ports/*/name` is `name`.
pub fn find(name: &str) -> Option<PathBuf> {
    let rd = std::fs::read_dir("/sys/class/virtio-ports").ok()?;
    for ent in rd.flatten() {
        let n = std::fs::read_to_string(ent.path().join("name")).unwrap_or_default();
        if n.trim() == name {
            return Some(Path::new("/dev").join(ent.file_name()));
        }
    }
    None
}

pub fn open(path: &Path) -> std::io::Result<OwnedFd> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)?;
    Ok(f.into())
}

/// Blocks until the host has connected and sent something.
pub fn wait_for_host(fd: &OwnedFd) {
    loop {
        let mut p = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        let r = unsafe { libc::poll(&mut p, 1, 1000) };
        if r > 0 && p.revents & libc::POLLIN != 0 {
            return;
        }
        if r > 0 && p.revents & (libc::POLLHUP | libc::POLLERR) != 0 {
            // No host on the other end: poll would return at once; look again shortly.
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// A full-duplex async stream over (duplicates of) the port's descriptor.
pub fn stream(
    fd: &OwnedFd,
) -> std::io::Result<impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + 'static> {
    use tokio::net::unix::pipe;
    let r = pipe::Receiver::from_owned_fd_unchecked(fd.as_fd().try_clone_to_owned()?)?;
    let w = pipe::Sender::from_owned_fd_unchecked(fd.as_fd().try_clone_to_owned()?)?;
    Ok(tokio::io::join(r, w))
}
