//! The guest end of the agent channel: a named virtio-serial port.
//!
//! Owns finding, opening and re-arming the port. The port can be opened by one process only
//! (EBUSY), so it stays open for the agent's life. Its stream never ends: while no host is
//! connected, reads and writes wait for the next one (see [`stream`]). Never used in tests.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};

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
///
/// It never reports end of stream. With no host connected a read returns 0, but that is not the
/// end: the port lives as long as the agent, and the guest can even see the "host closed" event
/// of an earlier host late, after it has read the next host's first frames (control events and
/// data travel on separate queues). Ending the connection there made the agent take that host's
/// next request for a protocol error (no `Hello` first) and drop it, and the host waited for an
/// answer forever. So the connection's state lasts until the next host's `Hello`
/// ([`ServeEnd::Rehello`](super::server::ServeEnd::Rehello)), across any disconnect.
///
/// While no host is connected the port polls `EPOLLHUP`, which tokio keeps as a final "closed"
/// readiness: a registration that saw it would report ready forever (a busy loop). So after
/// seeing it the stream waits [`NO_HOST_RETRY`] without the registration, then registers the
/// descriptor afresh and tries again.
pub fn stream(fd: &OwnedFd) -> std::io::Result<PortStream> {
    let base = fd.as_fd().try_clone_to_owned()?;
    Ok(PortStream {
        rd: register(&base, Interest::READABLE)?,
        wr: register(&base, Interest::WRITABLE)?,
        base,
        rd_wait: None,
        wr_wait: None,
    })
}

/// How often a stream without a host looks again.
const NO_HOST_RETRY: Duration = Duration::from_millis(50);

/// One registration per direction, so renewing one never drops the other's waiting task.
fn register(base: &OwnedFd, interest: Interest) -> std::io::Result<AsyncFd<OwnedFd>> {
    let dup = base.as_fd().try_clone_to_owned()?;
    // SAFETY: `dup` is a valid descriptor owned by the AsyncFd for its whole life, and an
    // OwnedFd always reports the same raw descriptor.
    Ok(unsafe { AsyncFd::register_with_interest(dup, interest) }?)
}

pub struct PortStream {
    /// A descriptor of the port kept to register afresh from.
    base: OwnedFd,
    /// Registered for reading only, and for writing only.
    rd: AsyncFd<OwnedFd>,
    wr: AsyncFd<OwnedFd>,
    /// Set while reading (writing) waits for a host to come back.
    rd_wait: Option<Pin<Box<tokio::time::Sleep>>>,
    wr_wait: Option<Pin<Box<tokio::time::Sleep>>>,
}

fn cvt(n: isize) -> std::io::Result<usize> {
    if n < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// What one non-blocking attempt on the port gave.
enum Attempt {
    Done(std::io::Result<usize>),
    /// `EAGAIN`; `stale` if the registration has seen a hang-up (its readiness is useless now).
    WouldBlock {
        stale: bool,
    },
}

impl AsyncRead for PortStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        loop {
            if let Some(w) = this.rd_wait.as_mut() {
                ready!(w.as_mut().poll(cx));
                this.rd_wait = None;
                this.rd = register(&this.base, Interest::READABLE)?;
            }
            let unfilled = buf.initialize_unfilled();
            let want = unfilled.len();
            let attempt = {
                let mut guard = ready!(this.rd.poll_read_ready(cx))?;
                let stale = guard.ready().is_read_closed();
                match guard.try_io(|fd| {
                    // SAFETY: reads into the initialized, exclusively borrowed `unfilled` slice.
                    cvt(unsafe {
                        libc::read(fd.as_raw_fd(), unfilled.as_mut_ptr().cast(), unfilled.len())
                    })
                }) {
                    Ok(r) => Attempt::Done(r),
                    Err(_would_block) => Attempt::WouldBlock { stale },
                }
            };
            match attempt {
                // No host connected and nothing queued: wait for one (see `stream`).
                Attempt::Done(Ok(0)) if want > 0 => {
                    this.rd_wait = Some(Box::pin(tokio::time::sleep(NO_HOST_RETRY)));
                }
                Attempt::Done(Ok(n)) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Attempt::Done(Err(e)) => return Poll::Ready(Err(e)),
                // A host is connected (else the read would have returned 0), but this
                // registration saw it away: register again and wait for data properly.
                Attempt::WouldBlock { stale: true } => {
                    this.rd = register(&this.base, Interest::READABLE)?;
                }
                Attempt::WouldBlock { stale: false } => {}
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
        let this = self.get_mut();
        loop {
            if let Some(w) = this.wr_wait.as_mut() {
                ready!(w.as_mut().poll(cx));
                this.wr_wait = None;
                this.wr = register(&this.base, Interest::WRITABLE)?;
            }
            let attempt = {
                let mut guard = ready!(this.wr.poll_write_ready(cx))?;
                let stale = guard.ready().is_write_closed();
                // SAFETY: writes from the borrowed `data` slice.
                match guard.try_io(|fd| {
                    cvt(unsafe { libc::write(fd.as_raw_fd(), data.as_ptr().cast(), data.len()) })
                }) {
                    Ok(r) => Attempt::Done(r),
                    Err(_would_block) => Attempt::WouldBlock { stale },
                }
            };
            match attempt {
                Attempt::Done(r) => return Poll::Ready(r),
                // No host (writes block until one connects): look again shortly.
                Attempt::WouldBlock { stale: true } => {
                    this.wr_wait = Some(Box::pin(tokio::time::sleep(NO_HOST_RETRY)));
                }
                Attempt::WouldBlock { stale: false } => {}
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
