//! How long a server connection may wait for a request: a header once it has begun, and the
//! next request between two.
//!
//! hyper has one timer for both (`header_read_timeout` runs from the end of a response to the
//! end of the next header), so a short slowloris bound also closes idle keep-alive connections
//! early. Clients pool connections for longer (reqwest and Go keep them 90 s), and one that
//! writes a request on a pooled connection just as the server closes it gets a reset: a POST is
//! not retried, and the caller sees `Connection reset by peer`. The E2B SDK hits it every time
//! its `run_code(timeout=5)` times out: its deadline is 10 s, the server's was 10 s, and its
//! next request took the connection the previous one had left idle at the same moment.
//!
//! So the listeners keep the two apart, with hyper's own timer off:
//! - from opening, and from the first byte of each later request: its whole header within
//!   `header` (slowloris);
//! - between requests (the previous response has ended, nothing of the next has come): `idle`;
//! - while a request is answered: no limit (event and exec streams are never cut).
//!
//! Owns: [`Timed`] (a connection's IO, whose reads fail with `TimedOut` once the current
//! deadline has passed, which ends the connection) and [`Phase`] (how the service says a
//! request began and, by the drop of its response body, that it ended).

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use hyper::Response;
use hyper::body::{Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

use super::response::Body;

/// The two bounds of a listener (`[http] header_timeout_s`, `idle_timeout_s`).
#[derive(Debug, Clone, Copy)]
pub struct Deadlines {
    pub header: Duration,
    pub idle: Duration,
}

impl Deadlines {
    pub fn from_config(cfg: &crate::config::HttpConfig) -> Self {
        Deadlines {
            header: Duration::from_secs(cfg.header_timeout_s.max(1)),
            idle: Duration::from_secs(cfg.idle_timeout_s.max(1)),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    /// A header is due by then (the connection has just opened, or a request has begun).
    Header(Instant),
    /// Between requests: the next must begin by then.
    Idle(Instant),
    /// This many requests are being answered.
    Busy(u32),
}

#[derive(Debug)]
struct Inner {
    state: State,
    /// The task waiting on a read, woken when the state changes its deadline.
    reader: Option<Waker>,
}

#[derive(Debug)]
struct Shared {
    d: Deadlines,
    inner: Mutex<Inner>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Nothing panics while holding it; a poisoned lock still holds a valid state.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The service's side of one connection.
#[derive(Debug, Clone)]
pub struct Phase(Arc<Shared>);

impl Phase {
    /// A request's header has been read: no deadline until its response ends.
    pub fn request_started(&self) {
        let mut g = self.0.lock();
        g.state = match g.state {
            State::Busy(n) => State::Busy(n.saturating_add(1)),
            State::Header(_) | State::Idle(_) => State::Busy(1),
        };
    }

    /// `resp` with a body that, when dropped (hyper has sent it, or the connection ended),
    /// starts the idle deadline.
    pub fn response(&self, resp: Response<Body>) -> Response<Body> {
        let ends = Ends(self.0.clone());
        resp.map(|inner| http_body_util::BodyExt::boxed(Guarded { inner, _ends: ends }))
    }
}

/// Marks the end of one request's answer.
#[derive(Debug)]
struct Ends(Arc<Shared>);

impl Drop for Ends {
    fn drop(&mut self) {
        let idle = self.0.d.idle;
        let mut g = self.0.lock();
        if let State::Busy(n) = g.state {
            g.state = match n {
                0 | 1 => State::Idle(Instant::now() + idle),
                n => State::Busy(n - 1),
            };
            if let Some(w) = g.reader.take() {
                w.wake();
            }
        }
    }
}

struct Guarded {
    inner: Body,
    _ends: Ends,
}

impl hyper::body::Body for Guarded {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A connection's IO under the listener's deadlines.
pub struct Timed<S> {
    io: S,
    shared: Arc<Shared>,
    sleep: Pin<Box<Sleep>>,
}

/// Put `io` under `d`: the header deadline runs from now.
pub fn timed<S>(io: S, d: Deadlines) -> (Timed<S>, Phase) {
    let first = Instant::now() + d.header;
    let shared = Arc::new(Shared {
        d,
        inner: Mutex::new(Inner {
            state: State::Header(first),
            reader: None,
        }),
    });
    let timed = Timed {
        io,
        shared: shared.clone(),
        sleep: Box::pin(tokio::time::sleep_until(first)),
    };
    (timed, Phase(shared))
}

impl<S: AsyncRead + Unpin> AsyncRead for Timed<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let read = Pin::new(&mut this.io).poll_read(cx, buf);
        let got = buf.filled().len() > before;
        let deadline = {
            let mut g = this.shared.lock();
            if got && let State::Idle(_) = g.state {
                g.state = State::Header(Instant::now() + this.shared.d.header);
            }
            let deadline = match g.state {
                State::Header(t) | State::Idle(t) => Some(t),
                State::Busy(_) => None,
            };
            if read.is_pending() {
                g.reader = Some(cx.waker().clone());
            }
            deadline
        };
        if read.is_ready() {
            return read;
        }
        if let Some(t) = deadline {
            if this.sleep.deadline() != t {
                this.sleep.as_mut().reset(t);
            }
            if this.sleep.as_mut().poll(cx).is_ready() {
                let what = match this.shared.lock().state {
                    State::Idle(_) => "no request came within the idle timeout",
                    _ => "the request header did not arrive within the header timeout",
                };
                return Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, what)));
            }
        }
        Poll::Pending
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Timed<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
#[path = "keepalive_tests.rs"]
mod tests;
