//! A body adapter that runs every data chunk (and the trailers) through a [`Transform`]: the
//! request-body swap and the response decoder + scrubber.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::BodyExt as _;
use http_body_util::combinators::UnsyncBoxBody;
use hyper::HeaderMap;
use hyper::body::{Body, Frame, SizeHint};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// The body type on both sides of the proxy.
pub type ProxyBody = UnsyncBoxBody<Bytes, BoxError>;

pub fn full(b: impl Into<Bytes>) -> ProxyBody {
    http_body_util::Full::new(b.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

pub fn boxed<B>(b: B) -> ProxyBody
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    b.map_err(Into::into).boxed_unsync()
}

/// A stateful rewrite of a byte stream.
pub trait Transform: Send + 'static {
    fn push(&mut self, chunk: &[u8]) -> Result<Vec<u8>, BoxError>;
    /// The rest, at the end of the data.
    fn finish(&mut self) -> Result<Vec<u8>, BoxError>;
    fn trailers(&mut self, _t: &mut HeaderMap) {}
}

impl Transform for super::scrub::StreamReplace {
    fn push(&mut self, chunk: &[u8]) -> Result<Vec<u8>, BoxError> {
        Ok(super::scrub::StreamReplace::push(self, chunk))
    }
    fn finish(&mut self) -> Result<Vec<u8>, BoxError> {
        Ok(super::scrub::StreamReplace::finish(self))
    }
}

pub struct TransformBody<T> {
    inner: ProxyBody,
    t: T,
    trailers: Option<HeaderMap>,
    ended: bool,
}

impl<T: Transform> TransformBody<T> {
    pub fn new(inner: ProxyBody, t: T) -> TransformBody<T> {
        TransformBody {
            inner,
            t,
            trailers: None,
            ended: false,
        }
    }
}

impl<T: Transform + Unpin> Body for TransformBody<T> {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        loop {
            if let Some(t) = this.trailers.take() {
                return Poll::Ready(Some(Ok(Frame::trailers(t))));
            }
            if this.ended {
                return Poll::Ready(None);
            }
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e))),
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(d) => {
                        let out = this.t.push(&d)?;
                        if !out.is_empty() {
                            return Poll::Ready(Some(Ok(Frame::data(out.into()))));
                        }
                    }
                    Err(frame) => {
                        if let Ok(mut tr) = frame.into_trailers() {
                            this.ended = true;
                            this.t.trailers(&mut tr);
                            this.trailers = Some(tr);
                            let out = this.t.finish()?;
                            if !out.is_empty() {
                                return Poll::Ready(Some(Ok(Frame::data(out.into()))));
                            }
                        }
                    }
                },
                Poll::Ready(None) => {
                    this.ended = true;
                    let out = this.t.finish()?;
                    if !out.is_empty() {
                        return Poll::Ready(Some(Ok(Frame::data(out.into()))));
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended && self.trailers.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}
