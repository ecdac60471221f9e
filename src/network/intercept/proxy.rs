//! One intercepted flow: the upstream TLS connection (verified, its own ALPN) and a hyper
//! client on it, the guest's TLS terminated with a leaf from the sandbox CA, and a hyper server
//! (HTTP/1.1 or HTTP/2 by ALPN) whose every request is checked, swapped, forwarded and whose
//! response is scrubbed.
//!
//! Per request: CONNECT and TRACE are refused (405); Host/`:authority` must equal the SNI
//! (421 otherwise); a placeholder of a secret that does not serve this host in an
//! authorization position is refused (403, `secret.blocked`); the placeholders of the secrets
//! that serve it are swapped; the response to a request that carried a value is scrubbed
//! (identity asked upstream; gzip/deflate/br decoded; other encodings: 502). Redirects are passed
//! to the guest as they are: the client follows them with new requests, each checked again.

use std::convert::Infallible;
use std::sync::Arc;

use hyper::body::Incoming;
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper::{Method, Request, Response, StatusCode, Uri, Version};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use super::audit::audit;
use super::ws_watch::FrameWatch;
use crate::network::upstream_proxy::Dial;

use super::body::{BoxError, ProxyBody, Transform, TransformBody, boxed, full};
use super::git;
use super::grpc;
use super::scrub::{Decoder, Replacer, StreamReplace, rendered_forms};
use super::swap::{self, Blocked};
use super::ws;
use super::{InterceptError, Interceptor};
use crate::secrets::git::{self as secrets_git, Verdict as GitVerdict};

type H1 = hyper::client::conn::http1::SendRequest<ProxyBody>;
type H2 = hyper::client::conn::http2::SendRequest<ProxyBody>;

enum Sender {
    H1(H1),
    H2(H2),
}

impl Sender {
    fn is_closed(&self) -> bool {
        match self {
            Sender::H1(s) => s.is_closed(),
            Sender::H2(s) => s.is_closed(),
        }
    }
}

/// The upstream side of one flow: the first connection is the one the stack already made (to
/// the pinned address, or a tunnel through the upstream proxy); a closed one is replaced by a
/// new one opened the same way ([`Dial`]: the same address, or `CONNECT` the same name).
struct Upstream {
    dial: Dial,
    sni: String,
    /// `None`: a plaintext HTTP flow (block check only; nothing swapped or scrubbed).
    tls: Option<Arc<rustls::ClientConfig>>,
    first: std::sync::Mutex<Option<TcpStream>>,
    cur: tokio::sync::Mutex<Option<Sender>>,
}

impl Upstream {
    /// The upstream of a flow whose first connection (`upstream`) the stack already made;
    /// later ones are opened by `dial`.
    fn new(
        upstream: TcpStream,
        dial: Dial,
        sni: &str,
        tls: Option<Arc<rustls::ClientConfig>>,
    ) -> Upstream {
        Upstream {
            dial,
            sni: sni.to_owned(),
            tls,
            first: std::sync::Mutex::new(Some(upstream)),
            cur: tokio::sync::Mutex::new(None),
        }
    }

    /// The first connection if unused, else a new one.
    async fn tcp(&self) -> Result<TcpStream, InterceptError> {
        let first = self.first.lock().unwrap_or_else(|e| e.into_inner()).take();
        let tcp = match first {
            Some(s) => s,
            None => self.fresh().await?,
        };
        let _ = tcp.set_nodelay(true);
        Ok(tcp)
    }

    async fn fresh(&self) -> Result<TcpStream, InterceptError> {
        self.dial.connect().await.map_err(|e| {
            tracing::warn!(host = %self.sni, error = %e, "intercepted flow: upstream connection failed");
            InterceptError::UpstreamDial(e)
        })
    }

    async fn connect(&self) -> Result<Sender, InterceptError> {
        let tcp = self.tcp().await?;
        let Some(tls) = &self.tls else {
            let (s, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
                .await
                .map_err(InterceptError::UpstreamHttp)?;
            tokio::spawn(async move {
                if let Err(e) = conn.await {
                    tracing::debug!(error = %e, "plaintext upstream connection ended");
                }
            });
            return Ok(Sender::H1(s));
        };
        let name = rustls::pki_types::ServerName::try_from(self.sni.clone())
            .map_err(|_| InterceptError::BadSni(self.sni.clone()))?;
        let tls = tokio_rustls::TlsConnector::from(tls.clone())
            .connect(name, tcp)
            .await
            .map_err(InterceptError::UpstreamTls)?;
        let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
        let io = TokioIo::new(tls);
        if h2 {
            let (s, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
                .handshake(io)
                .await
                .map_err(InterceptError::UpstreamHttp)?;
            tokio::spawn(async move {
                if let Err(e) = conn.await {
                    tracing::debug!(error = %e, "intercepted upstream h2 connection ended");
                }
            });
            Ok(Sender::H2(s))
        } else {
            let (s, conn) = hyper::client::conn::http1::handshake(io)
                .await
                .map_err(InterceptError::UpstreamHttp)?;
            tokio::spawn(async move {
                if let Err(e) = conn.await {
                    tracing::debug!(error = %e, "intercepted upstream h1 connection ended");
                }
            });
            Ok(Sender::H1(s))
        }
    }

    /// Whether the current connection speaks HTTP/2 (connecting if needed).
    async fn send(
        &self,
        mut req: Request<ProxyBody>,
    ) -> Result<Response<Incoming>, InterceptError> {
        let mut g = self.cur.lock().await;
        if g.as_ref().is_none_or(Sender::is_closed) {
            *g = Some(self.connect().await?);
        }
        match g.as_mut() {
            Some(Sender::H2(s)) => {
                let mut s = s.clone();
                drop(g);
                *req.version_mut() = Version::HTTP_2;
                req.headers_mut().remove(header::HOST);
                let pq = req
                    .uri()
                    .path_and_query()
                    .map(|p| p.as_str().to_owned())
                    .unwrap_or_else(|| "/".into());
                *req.uri_mut() = format!("https://{}{pq}", self.sni)
                    .parse()
                    .map_err(|_| InterceptError::BadRequest("request target"))?;
                s.send_request(req)
                    .await
                    .map_err(InterceptError::UpstreamHttp)
            }
            Some(Sender::H1(s)) => {
                s.ready().await.map_err(InterceptError::UpstreamHttp)?;
                h1_target(&mut req, &self.sni)?;
                let fut = s.send_request(req);
                drop(g);
                fut.await.map_err(InterceptError::UpstreamHttp)
            }
            None => Err(InterceptError::BadRequest("no upstream")),
        }
    }

    /// Send a WebSocket handshake on a new HTTP/1.1 connection of its own (to the same
    /// address, verified the same way), kept open for the upgrade. A plaintext flow uses the
    /// connection the stack made if no request has used it yet.
    async fn send_upgrade(
        &self,
        req: Request<ProxyBody>,
    ) -> Result<Response<Incoming>, InterceptError> {
        let Some(tls) = &self.tls else {
            let tcp = self.tcp().await?;
            return upgrade_on(TokioIo::new(tcp), req, &self.sni).await;
        };
        let mut cfg = (**tls).clone();
        cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
        let tcp = self.fresh().await?;
        let _ = tcp.set_nodelay(true);
        let name = rustls::pki_types::ServerName::try_from(self.sni.clone())
            .map_err(|_| InterceptError::BadSni(self.sni.clone()))?;
        let tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
            .connect(name, tcp)
            .await
            .map_err(InterceptError::UpstreamTls)?;
        upgrade_on(TokioIo::new(tls), req, &self.sni).await
    }
}

/// Send a handshake on `io` (HTTP/1.1), the connection kept for the upgrade.
async fn upgrade_on<I>(
    io: I,
    mut req: Request<ProxyBody>,
    host: &str,
) -> Result<Response<Incoming>, InterceptError>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (mut s, conn) = hyper::client::conn::http1::handshake(io)
        .await
        .map_err(InterceptError::UpstreamHttp)?;
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!(error = %e, "upstream websocket connection ended");
        }
    });
    h1_target(&mut req, host)?;
    s.send_request(req)
        .await
        .map_err(InterceptError::UpstreamHttp)
}

/// An HTTP/1.1 request line's target (origin form) and Host.
fn h1_target(req: &mut Request<ProxyBody>, sni: &str) -> Result<(), InterceptError> {
    *req.version_mut() = Version::HTTP_11;
    let pq = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_else(|| "/".into());
    *req.uri_mut() = pq
        .parse::<Uri>()
        .map_err(|_| InterceptError::BadRequest("request target"))?;
    if !req.headers().contains_key(header::HOST) {
        let h = HeaderValue::from_str(sni).map_err(|_| InterceptError::BadSni(sni.to_owned()))?;
        req.headers_mut().insert(header::HOST, h);
    }
    Ok(())
}

struct Flow {
    icpt: Arc<Interceptor>,
    /// The TLS server name (or, on plaintext flows, the Host the gate allowed).
    sni: String,
    up: Upstream,
    plain: bool,
}

/// Serve one intercepted TLS flow until either side closes.
pub(super) async fn serve<G>(
    icpt: Arc<Interceptor>,
    guest: G,
    upstream: TcpStream,
    dial: Dial,
    sni: String,
) -> Result<(), InterceptError>
where
    G: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let up = Upstream::new(upstream, dial, &sni, Some(icpt.upstream_tls.clone()));
    // Upstream first: a host whose certificate does not verify never gets a guest handshake.
    let first = up.connect().await?;
    *up.cur.lock().await = Some(first);
    let leaf = icpt.ca.leaf(&sni)?;
    let cfg = super::tls::guest_server_config(&leaf)?;
    let tls = tokio_rustls::TlsAcceptor::from(cfg)
        .accept(guest)
        .await
        .map_err(InterceptError::GuestTls)?;
    let flow = Arc::new(Flow {
        icpt,
        sni,
        up,
        plain: false,
    });
    let svc = hyper::service::service_fn(move |req| {
        let flow = flow.clone();
        async move { Ok::<_, Infallible>(flow.handle(req).await) }
    });
    hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
        .serve_connection_with_upgrades(TokioIo::new(tls), svc)
        .await
        .map_err(InterceptError::Guest)
}

/// Serve one plaintext HTTP/1 flow to `host` (the Host the gate allowed): every request on it,
/// not only the first, must keep that Host and carry no placeholder of another host's secret.
pub(super) async fn serve_plain<G>(
    icpt: Arc<Interceptor>,
    guest: G,
    upstream: TcpStream,
    dial: Dial,
    host: String,
) -> Result<(), InterceptError>
where
    G: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let up = Upstream::new(upstream, dial, &host, None);
    let flow = Arc::new(Flow {
        icpt,
        sni: host,
        up,
        plain: true,
    });
    let svc = hyper::service::service_fn(move |req| {
        let flow = flow.clone();
        async move { Ok::<_, Infallible>(flow.handle(req).await) }
    });
    hyper::server::conn::http1::Builder::new()
        .serve_connection(TokioIo::new(guest), svc)
        .with_upgrades()
        .await
        .map_err(|e| InterceptError::Guest(Box::new(e)))
}

fn status(code: StatusCode, text: &str) -> Response<ProxyBody> {
    let mut r = Response::new(full(format!("tryboxi: {text}\n")));
    *r.status_mut() = code;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

/// `host[:port]` -> host, lowercase (IPv6 literals keep their brackets).
pub fn strip_port(a: &str) -> String {
    let a = a.trim();
    let host = match a.rsplit_once(':') {
        Some((h, p)) if !h.ends_with(']') && h.contains(':') => a.trim_end_matches(p),
        Some((h, p)) if p.bytes().all(|c| c.is_ascii_digit()) => h,
        _ => a,
    };
    host.trim_end_matches('.').to_ascii_lowercase()
}

/// Hop-by-hop headers (and the ones `connection` names) are not forwarded.
fn strip_hop_by_hop(h: &mut HeaderMap) {
    let named: Vec<HeaderName> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for n in named {
        h.remove(n);
    }
    let te_trailers = h
        .get_all(header::TE)
        .iter()
        .any(|v| v.as_bytes().eq_ignore_ascii_case(b"trailers"));
    for n in [
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "upgrade",
        "te",
    ] {
        h.remove(n);
    }
    if te_trailers {
        h.insert(header::TE, HeaderValue::from_static("trailers"));
    }
}

/// Response decoding and scrubbing.
struct Scrub {
    decoder: Option<Decoder>,
    rep: StreamReplace,
}

impl Transform for Scrub {
    fn push(&mut self, chunk: &[u8]) -> Result<Vec<u8>, BoxError> {
        let plain = match &mut self.decoder {
            Some(d) => d.push(chunk)?,
            None => chunk.to_vec(),
        };
        Ok(self.rep.push(&plain))
    }
    fn finish(&mut self) -> Result<Vec<u8>, BoxError> {
        let mut out = match &mut self.decoder {
            Some(d) => self.rep.push(&d.finish()?),
            None => Vec::new(),
        };
        out.extend(self.rep.finish());
        Ok(out)
    }
    fn trailers(&mut self, t: &mut HeaderMap) {
        scrub_headers(t, self.rep_replacer());
    }
}

impl Scrub {
    fn rep_replacer(&self) -> &Replacer {
        self.rep.replacer()
    }
}

pub(super) fn scrub_headers(h: &mut HeaderMap, r: &Replacer) {
    for v in h.values_mut() {
        if r.contains(v.as_bytes())
            && let Ok(n) = HeaderValue::from_bytes(&r.replace_all(v.as_bytes()))
        {
            *v = n;
        }
    }
}

impl Flow {
    async fn handle(&self, req: Request<Incoming>) -> Response<ProxyBody> {
        match self.handle_inner(req).await {
            Ok(r) => r,
            Err(r) => r,
        }
    }

    /// The request's host (Host or `:authority`, port stripped); it must equal the SNI.
    fn authority(&self, req: &Request<Incoming>) -> Result<String, (StatusCode, &'static str)> {
        let hosts: Vec<&HeaderValue> = req.headers().get_all(header::HOST).iter().collect();
        let from_header = match hosts.as_slice() {
            [] => None,
            [one] => {
                Some(strip_port(one.to_str().map_err(|_| {
                    (StatusCode::BAD_REQUEST, "Host is not text")
                })?))
            }
            _ => return Err((StatusCode::BAD_REQUEST, "several Host headers")),
        };
        let from_uri = req.uri().authority().map(|a| strip_port(a.as_str()));
        let host = match (from_uri, from_header) {
            (Some(u), Some(h)) if u != h => {
                return Err((
                    StatusCode::MISDIRECTED_REQUEST,
                    "request target and Host differ",
                ));
            }
            (Some(u), _) => u,
            (None, Some(h)) => h,
            (None, None) => return Err((StatusCode::BAD_REQUEST, "no Host")),
        };
        if !host.eq_ignore_ascii_case(&self.sni) {
            return Err((
                StatusCode::MISDIRECTED_REQUEST,
                "Host differs from the TLS server name",
            ));
        }
        Ok(host)
    }

    async fn handle_inner(
        &self,
        req: Request<Incoming>,
    ) -> Result<Response<ProxyBody>, Response<ProxyBody>> {
        if req.method() == Method::CONNECT || req.method() == Method::TRACE {
            return Err(status(
                StatusCode::METHOD_NOT_ALLOWED,
                "CONNECT and TRACE are refused on intercepted connections",
            ));
        }
        self.authority(&req).map_err(|(c, why)| status(c, why))?;
        let snap = self.icpt.secrets.current();
        let (mut parts, body) = req.into_parts();
        let mut body = boxed(body);
        // The git proxy decides first; an injected request's own Authorization is replaced.
        let verdict = if self.plain || snap.git.is_empty() {
            GitVerdict::NotGit
        } else {
            secrets_git::classify(&snap, &git::request_head(&snap, &self.sni, &parts))
        };
        if let GitVerdict::Inject { .. } = verdict {
            parts.headers.remove(header::AUTHORIZATION);
        }
        let blocked = {
            let hs: Vec<(&str, &[u8])> = parts
                .headers
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_bytes()))
                .collect();
            swap::find_blocked(&snap, &self.sni, hs.into_iter(), parts.uri.query())
        };
        if let Some(b) = blocked {
            self.icpt.blocked(&b, &self.sni);
            return Err(blocked_response(&b, &self.sni));
        }
        let mut inject = None;
        match verdict {
            GitVerdict::NotGit => {}
            GitVerdict::Refuse(r) => {
                self.icpt.git_refused(&self.sni, r.status, &r.message);
                return Err(git::refused(&r, &self.sni));
            }
            GitVerdict::CheckGraphql => {
                body = git::check_graphql_body(self.icpt.clone(), body, self.sni.clone()).await?
            }
            GitVerdict::Inject {
                authorization,
                push,
                repo,
            } => {
                if let Some(screener) = push {
                    body =
                        git::screen_push(self.icpt.clone(), body, screener, repo.clone()).await?;
                }
                inject = Some((authorization, repo));
            }
        }
        if let Some(a) = audit(&self.icpt, &snap, &self.sni) {
            body = boxed(TransformBody::new(body, a));
        }
        if self.plain {
            // Nothing is swapped in plaintext, a WebSocket's frames included.
            let ws_upgrade = if ws::is_upgrade(&parts) {
                parts.extensions.remove::<hyper::upgrade::OnUpgrade>()
            } else {
                None
            };
            strip_hop_by_hop(&mut parts.headers);
            let req = Request::from_parts(parts, body);
            let sent = match ws_upgrade {
                Some(_) => {
                    let mut req = req;
                    ws::restore_upgrade_headers(req.headers_mut());
                    self.up.send_upgrade(req).await
                }
                None => self.up.send(req).await,
            };
            let resp = sent.map_err(|e| {
                tracing::debug!(host = %self.sni, error = %e, "plaintext request failed upstream");
                status(StatusCode::BAD_GATEWAY, "upstream request failed")
            })?;
            if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
                let Some(guest) = ws_upgrade else {
                    return Err(status(
                        StatusCode::BAD_GATEWAY,
                        "the upstream switched protocols unasked",
                    ));
                };
                let watch = FrameWatch::new(self.icpt.clone(), &snap, &self.sni, &[]);
                return Ok(self.upgraded(resp, guest, None, String::new(), (None, watch)));
            }
            let (mut rp, rbody) = resp.into_parts();
            strip_hop_by_hop(&mut rp.headers);
            return Ok(Response::from_parts(rp, boxed(rbody)));
        }
        let ws_upgrade = if ws::is_upgrade(&parts) {
            parts.extensions.remove::<hyper::upgrade::OnUpgrade>()
        } else {
            None
        };
        let sw = swap::swap_head(&mut parts, &snap, &self.sni)
            .map_err(|e| status(StatusCode::BAD_REQUEST, &e.to_string()))?;
        strip_hop_by_hop(&mut parts.headers);
        if ws_upgrade.is_some() {
            ws::restore_upgrade_headers(&mut parts.headers);
        }
        // A git request's body (a pack) goes as it is, and so does a gRPC call's (its protobuf
        // fields carry their lengths: the secret travels in metadata).
        let grpc_req = grpc::is_grpc(&parts.headers);
        let in_body: Vec<usize> = snap
            .bindings
            .iter()
            .enumerate()
            .filter(|(_, b)| inject.is_none() && !grpc_req && b.in_body && b.serves(&self.sni))
            .map(|(i, _)| i)
            .collect();
        let body_swap = Replacer::new(
            in_body
                .iter()
                .map(|&i| {
                    let b = &snap.bindings[i];
                    (b.placeholder.as_bytes().to_vec(), b.value.bytes().to_vec())
                })
                .collect(),
        );
        if let Some(r) = &body_swap {
            parts.headers.remove(header::CONTENT_LENGTH);
            body = boxed(TransformBody::new(body, StreamReplace::new(r.clone())));
        }
        // Header and query swaps are certain: each such secret was used (`secret ls`).
        for &i in &sw.used {
            self.icpt.used(&snap.bindings[i].name);
        }
        let mut scrub_set: Vec<usize> = sw.used.clone();
        let frames_swapped = if body_swap.is_some() {
            in_body.clone()
        } else {
            Vec::new()
        };
        scrub_set.extend(in_body);
        scrub_set.sort_unstable();
        scrub_set.dedup();
        let mut forms = Vec::new();
        if let Some((authorization, repo)) = &inject {
            let mut hv = HeaderValue::from_bytes(authorization.bytes()).map_err(|_| {
                status(
                    StatusCode::BAD_REQUEST,
                    "the git token is not a header value",
                )
            })?;
            hv.set_sensitive(true);
            parts.headers.insert(header::AUTHORIZATION, hv);
            forms.extend(git::token_forms(&snap, repo));
        }
        let scrubber = Replacer::new(
            forms
                .into_iter()
                .chain(scrub_set.iter().flat_map(|&i| {
                    let b = &snap.bindings[i];
                    let basic: Vec<_> = sw
                        .basic
                        .iter()
                        .filter(|(_, ph)| {
                            ph.windows(b.placeholder.len())
                                .any(|w| w == b.placeholder.as_bytes())
                        })
                        .cloned()
                        .collect();
                    rendered_forms(b.value.bytes(), b.placeholder.as_bytes(), &basic)
                }))
                .collect(),
        );
        if scrubber.is_some() {
            parts.headers.insert(
                header::ACCEPT_ENCODING,
                HeaderValue::from_static("identity"),
            );
            if grpc_req {
                grpc::ask_identity(&mut parts.headers);
            }
        }
        let method = parts.method.clone();
        let req = Request::from_parts(parts, body);
        let sent = if ws_upgrade.is_some() {
            self.up.send_upgrade(req).await
        } else {
            self.up.send(req).await
        };
        let resp = match sent {
            Ok(r) => r,
            Err(e) => {
                tracing::debug!(host = %self.sni, %method, error = %e, "intercepted request failed upstream");
                return Err(status(StatusCode::BAD_GATEWAY, "upstream request failed"));
            }
        };
        if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
            let Some(guest) = ws_upgrade else {
                return Err(status(
                    StatusCode::BAD_GATEWAY,
                    "the upstream switched protocols unasked",
                ));
            };
            // The secrets whose values may reach the upstream: swapped in the handshake, or
            // allowed in the frames (`--in-body`).
            let names: Vec<&str> = scrub_set
                .iter()
                .map(|&i| snap.bindings[i].name.as_str())
                .collect();
            let watch = FrameWatch::new(self.icpt.clone(), &snap, &self.sni, &frames_swapped);
            return Ok(self.upgraded(resp, guest, scrubber, names.join(","), (body_swap, watch)));
        }
        let (mut rp, rbody) = resp.into_parts();
        strip_hop_by_hop(&mut rp.headers);
        let Some(scrubber) = scrubber else {
            return Ok(Response::from_parts(rp, boxed(rbody)));
        };
        let encs: Vec<&HeaderValue> = rp
            .headers
            .get_all(header::CONTENT_ENCODING)
            .iter()
            .collect();
        let enc = match encs.as_slice() {
            [] => None,
            [one] => Some(one.to_str().unwrap_or("?")),
            _ => Some("(several)"),
        };
        let decoder = match Decoder::for_encoding(enc) {
            Ok(d) => d,
            Err(e) => {
                // The encoding's name comes from upstream and could carry the value: the texts
                // go through the scrubber.
                let text = String::from_utf8_lossy(&scrubber.replace_all(e.to_string().as_bytes()))
                    .into_owned();
                tracing::warn!(host = %self.sni, error = %text, "intercepted response refused");
                return Err(status(StatusCode::BAD_GATEWAY, &text));
            }
        };
        if decoder.is_some() {
            rp.headers.remove(header::CONTENT_ENCODING);
        }
        rp.headers.remove(header::CONTENT_LENGTH);
        scrub_headers(&mut rp.headers, &scrubber);
        if grpc::is_grpc(&rp.headers) {
            let enc = rp
                .headers
                .get("grpc-encoding")
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
            let t = match (decoder, grpc::GrpcScrub::new(scrubber, enc.as_deref())) {
                (None, Some(t)) => t,
                _ => {
                    return Err(status(
                        StatusCode::BAD_GATEWAY,
                        "a gRPC response with a content-encoding cannot be scrubbed",
                    ));
                }
            };
            return Ok(Response::from_parts(
                rp,
                boxed(TransformBody::new(boxed(rbody), t)),
            ));
        }
        let t = Scrub {
            decoder,
            rep: StreamReplace::new(scrubber),
        };
        Ok(Response::from_parts(
            rp,
            boxed(TransformBody::new(boxed(rbody), t)),
        ))
    }
}

impl Flow {
    /// Answer the guest's WebSocket handshake with the upstream's 101 and relay the upgraded
    /// connection (`ws.rs`); frames toward the guest are scrubbed when a value may have been
    /// sent, and the guest's frames have placeholders swapped with `swap` (`--in-body`) and
    /// are watched by `watch` (audit, last used).
    fn upgraded(
        &self,
        mut resp: Response<Incoming>,
        guest: hyper::upgrade::OnUpgrade,
        scrubber: Option<Arc<Replacer>>,
        names: String,
        (swap, watch): (Option<Arc<Replacer>>, Option<FrameWatch>),
    ) -> Response<ProxyBody> {
        if resp
            .headers()
            .contains_key(header::SEC_WEBSOCKET_EXTENSIONS)
        {
            return status(
                StatusCode::BAD_GATEWAY,
                "the upstream chose a WebSocket extension it was not offered",
            );
        }
        let upstream = hyper::upgrade::on(&mut resp);
        let (mut rp, _) = resp.into_parts();
        strip_hop_by_hop(&mut rp.headers);
        ws::restore_upgrade_headers(&mut rp.headers);
        if let Some(s) = &scrubber {
            scrub_headers(&mut rp.headers, s);
        }
        let scrub = scrubber.and_then(|s| s.same_length()).map(|m| (m, names));
        tokio::spawn(ws::relay(
            self.icpt.clone(),
            self.sni.clone(),
            (guest, upstream),
            scrub,
            swap,
            watch,
        ));
        Response::from_parts(rp, full(""))
    }
}

fn blocked_response(b: &Blocked, host: &str) -> Response<ProxyBody> {
    status(
        StatusCode::FORBIDDEN,
        &format!(
            "the placeholder of secret {} ({}) is refused: {host} is not one of its hosts",
            b.secret, b.position
        ),
    )
}
