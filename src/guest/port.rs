//! The guest end of the agent channel: a named virtio-serial port.
//!
//! Owns finding, opening and re-arming the port. The port can be opened by one process only
//! (EBUSY), so it stays open for the agent's life; when the host side disconnects reads return
//! EOF and we wait (poll) for the next host connection. Never used in tests.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

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

/// A full-duplex async stream over a duplicate of the port's descriptor.
///
/// Not tokio's pipe types: a virtio port returns at most one buffer per `read` even when more is
/// queued, and tokio takes a short read as "drained" and waits for an edge that never comes.
/// This stream reads until `EAGAIN` before waiting.
pub fn stream(fd: &OwnedFd) -> std::io::Result<PortStream> {
    let dup = fd.as_fd().try_clone_to_owned()?;
    // SAFETY: `dup` is a valid descriptor owned by the AsyncFd for its whole life, and an
    // OwnedFd always reports the same raw descriptor.
    let fd = unsafe { AsyncFd::register(dup) }?;
    Ok(PortStream { fd })
}

pub struct PortStream {
    fd: AsyncFd<OwnedFd>,
}

fn cvt(n: isize) -> std::io::Result<usize> {
    if n < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

impl AsyncRead for PortStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        loop {
            let mut guard = ready!(self.fd.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            let r = guard.try_io(|fd| {
                // SAFETY: reads into the initialized, exclusively borrowed `unfilled` slice.
                cvt(unsafe {
                    libc::read(fd.as_raw_fd(), unfilled.as_mut_ptr().cast(), unfilled.len())
                })
            });
            match r {
                Ok(Ok(n)) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                Err(_would_block) => continue,
            }
        }
    }
}

impl AsyncWrite for PortStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        loop {
            let mut guard = ready!(self.fd.poll_write_ready(cx))?;
            // SAFETY: writes from the borrowed `data` slice.
            let r = guard.try_io(|fd| {
                cvt(unsafe { libc::write(fd.as_raw_fd(), data.as_ptr().cast(), data.len()) })
            });
            match r {
                Ok(res) => return Poll::Ready(res),
                Err(_would_block) => continue,
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}
