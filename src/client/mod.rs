//! Typed HTTP client for the daemon, used by the CLI and the MCP server (and public: the
//! library's Rust SDK): over its unix socket, or over TCP (`TRYBOXI_URL`, TLS with a pinned
//! certificate off loopback; see `transport`). Requests and responses are the [`crate::api`]
//! types the daemon itself uses; an exec's events come as they happen ([`ExecEvents::next`],
//! or as a `futures` stream with [`ExecEvents::into_stream`]).

pub(crate) mod transport;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::api;
use crate::config::Paths;
use transport::Endpoint;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot reach the tryboxi daemon at {socket}: {source}. Start it with `tryboxi serve`")]
    Unreachable {
        /// The unix socket, or the `TRYBOXI_URL`.
        socket: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{code}: {message}")]
    Api {
        status: StatusCode,
        code: String,
        message: String,
    },
    /// The daemon refuses this client's uid (`uid_not_allowed`): its message, as it is, names
    /// the uid and the config key that would let it in.
    #[error("{0}")]
    NotAllowed(String),
    #[error("talking to the daemon: {0}")]
    Protocol(String),
}

#[derive(Debug, Clone)]
pub struct Client {
    endpoint: Arc<Endpoint>,
    /// Sent as `x-tryboxi-face` (`mcp` for the MCP server).
    face: Option<&'static str>,
}

impl Client {
    /// A client of the daemon listening on this unix socket.
    pub fn new(socket: &Path) -> Client {
        Client {
            endpoint: Arc::new(Endpoint::Unix(socket.to_path_buf())),
            face: None,
        }
    }

    /// The client the CLI would use: the daemon `TRYBOXI_URL` names (with `TRYBOXI_TOKEN`,
    /// and `TRYBOXI_FINGERPRINT` for https), else the unix socket of the data root
    /// (`TRYBOXI_HOME`, else `/var/lib/tryboxi` as root, else `~/.local/share/tryboxi`).
    pub fn discover() -> Result<Client, ClientError> {
        let paths = Paths::discover().map_err(|e| ClientError::Protocol(e.to_string()))?;
        Client::from_env(&paths).map_err(ClientError::Protocol)
    }

    /// A client of the daemon `TRYBOXI_URL` names (with `TRYBOXI_TOKEN`, and
    /// `TRYBOXI_FINGERPRINT` for https), else of this data root's unix socket.
    pub(crate) fn from_env(paths: &Paths) -> Result<Client, String> {
        Ok(Client {
            endpoint: Arc::new(Endpoint::from_env(paths)?),
            face: None,
        })
    }

    /// Say which face this client is (the daemon refuses some routes to `mcp`).
    pub fn with_face(mut self, face: &'static str) -> Client {
        self.face = Some(face);
        self
    }

    async fn request(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<Response<Incoming>, ClientError> {
        let stream = self.endpoint.connect().await?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| ClientError::Protocol(e.to_string()))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let (host, token) = self.endpoint.headers();
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header("host", host);
        if let Some(t) = token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        if let Some(f) = self.face {
            req = req.header(api::CLIENT_FACE_HEADER, f);
        }
        if body.is_some() {
            req = req.header("content-type", "application/json");
        }
        let req = req
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .map_err(|e| ClientError::Protocol(e.to_string()))?;
        let resp = sender
            .send_request(req)
            .await
            .map_err(|e| ClientError::Protocol(e.to_string()))?;
        if resp.status().is_success() {
            return Ok(resp);
        }
        let status = resp.status();
        let bytes = collect(resp).await?;
        Err(match serde_json::from_slice::<api::ErrorBody>(&bytes) {
            Ok(e) if e.error.code == api::UID_NOT_ALLOWED => {
                ClientError::NotAllowed(e.error.message)
            }
            Ok(e) => ClientError::Api {
                status,
                code: e.error.code,
                message: e.error.message,
            },
            Err(_) => ClientError::Api {
                status,
                code: status.as_str().into(),
                message: String::from_utf8_lossy(&bytes).into_owned(),
            },
        })
    }

    pub async fn get<T: DeserializeOwned>(&self, path: &str) -> Result<T, ClientError> {
        let resp = self.request(Method::GET, path, None).await?;
        decode(&collect(resp).await?)
    }

    pub async fn send<B: Serialize, T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
    ) -> Result<T, ClientError> {
        let body = body.map(|b| serde_json::to_vec(b).expect("API types serialize"));
        let resp = self.request(method, path, body).await?;
        decode(&collect(resp).await?)
    }

    /// A GET whose body is read as it arrives (server-sent events).
    pub async fn get_stream(&self, path: &str) -> Result<Incoming, ClientError> {
        Ok(self.request(Method::GET, path, None).await?.into_body())
    }

    /// `POST /v1/sandboxes`: boots a VM; returns when it is ready (or failed to boot).
    pub async fn create(
        &self,
        req: &api::CreateSandboxRequest,
    ) -> Result<api::Sandbox, ClientError> {
        self.send(Method::POST, "/v1/sandboxes", Some(req)).await
    }

    /// `GET /v1/sandboxes`.
    pub async fn list(&self) -> Result<api::SandboxList, ClientError> {
        self.get("/v1/sandboxes").await
    }

    /// `GET /v1/sandboxes/{id}`.
    pub async fn sandbox(&self, id: &str) -> Result<api::Sandbox, ClientError> {
        self.get(&format!("/v1/sandboxes/{}", seg(id))).await
    }

    /// `DELETE /v1/sandboxes/{id}`.
    pub async fn remove(&self, id: &str) -> Result<api::Sandbox, ClientError> {
        self.send::<(), _>(Method::DELETE, &format!("/v1/sandboxes/{}", seg(id)), None)
            .await
    }

    /// `GET /v1/sandboxes/{id}/diff[?stat=true][&path=P...]`.
    pub async fn diff(
        &self,
        id: &str,
        stat: bool,
        paths: &[String],
    ) -> Result<api::DiffReport, ClientError> {
        let mut query: Vec<String> = Vec::new();
        if stat {
            query.push("stat=true".into());
        }
        query.extend(paths.iter().map(|p| format!("path={}", qv(p))));
        let mut path = format!("/v1/sandboxes/{}/diff", seg(id));
        if !query.is_empty() {
            path.push('?');
            path.push_str(&query.join("&"));
        }
        self.get(&path).await
    }

    /// `POST /v1/sandboxes/{id}/apply`.
    pub async fn apply(
        &self,
        id: &str,
        req: &api::ApplyRequest,
    ) -> Result<api::ApplyReport, ClientError> {
        let path = format!("/v1/sandboxes/{}/apply", seg(id));
        self.send(Method::POST, &path, Some(req)).await
    }

    /// `POST /v1/sandboxes/{id}/pull`.
    pub async fn pull(
        &self,
        id: &str,
        req: &api::ApplyRequest,
    ) -> Result<api::ApplyReport, ClientError> {
        let path = format!("/v1/sandboxes/{}/pull", seg(id));
        self.send(Method::POST, &path, Some(req)).await
    }

    /// `POST /v1/artifacts/{art_id}/undo`.
    pub async fn undo(
        &self,
        artifact_id: &str,
        force: bool,
        within: Vec<String>,
    ) -> Result<api::UndoReport, ClientError> {
        let path = format!("/v1/artifacts/{}/undo", seg(artifact_id));
        let req = api::UndoRequest { force, within };
        self.send(Method::POST, &path, Some(&req)).await
    }

    /// `GET /v1/sandboxes/{id}/files?path=/abs`.
    pub async fn read_file(&self, id: &str, path: &str) -> Result<api::FileContent, ClientError> {
        self.get(&format!(
            "/v1/sandboxes/{}/files?path={}",
            seg(id),
            qv(path)
        ))
        .await
    }

    /// `GET /v1/sandboxes/{id}/ports`.
    pub async fn ports(&self, id: &str) -> Result<api::PortList, ClientError> {
        self.get(&format!("/v1/sandboxes/{}/ports", seg(id))).await
    }

    /// `POST /v1/sandboxes/{id}/ports`.
    pub async fn expose_port(
        &self,
        id: &str,
        req: &api::ExposePortRequest,
    ) -> Result<api::ExposedPort, ClientError> {
        self.send(
            Method::POST,
            &format!("/v1/sandboxes/{}/ports", seg(id)),
            Some(req),
        )
        .await
    }

    /// `POST /v1/sandboxes/{id}/snapshots`: checkpoint memory, device state and disk.
    pub async fn snapshot(
        &self,
        id: &str,
        req: &api::SnapshotRequest,
    ) -> Result<api::Snapshot, ClientError> {
        let path = format!("/v1/sandboxes/{}/snapshots", seg(id));
        self.send(Method::POST, &path, Some(req)).await
    }

    /// `GET /v1/sandboxes/{id}/snapshots`, oldest first.
    pub async fn snapshots(&self, id: &str) -> Result<api::SnapshotList, ClientError> {
        self.get(&format!("/v1/sandboxes/{}/snapshots", seg(id)))
            .await
    }

    /// `DELETE /v1/sandboxes/{id}/snapshots/{snapshot}` (id or name); sandboxes started from it
    /// keep running.
    pub async fn delete_snapshot(
        &self,
        id: &str,
        snapshot: &str,
    ) -> Result<api::Snapshot, ClientError> {
        let path = format!("/v1/sandboxes/{}/snapshots/{}", seg(id), seg(snapshot));
        self.send::<(), _>(Method::DELETE, &path, None).await
    }

    /// `POST /v1/sandboxes/{id}/restore`: `snapshot` is an id or a name.
    pub async fn restore(&self, id: &str, snapshot: &str) -> Result<api::Sandbox, ClientError> {
        let path = format!("/v1/sandboxes/{}/restore", seg(id));
        let req = api::RestoreRequest {
            snapshot: snapshot.to_owned(),
            reboot: false,
        };
        self.send(Method::POST, &path, Some(&req)).await
    }

    /// `POST /v1/sandboxes/{id}/fork`.
    pub async fn fork(
        &self,
        id: &str,
        req: &api::ForkRequest,
    ) -> Result<api::ForkResult, ClientError> {
        let path = format!("/v1/sandboxes/{}/fork", seg(id));
        self.send(Method::POST, &path, Some(req)).await
    }

    /// `POST /v1/sandboxes/{id}/pause`: to disk; the next use resumes it.
    pub async fn pause(&self, id: &str) -> Result<api::Sandbox, ClientError> {
        let path = format!("/v1/sandboxes/{}/pause", seg(id));
        self.send::<(), _>(Method::POST, &path, None).await
    }

    /// `POST /v1/sandboxes/{id}/pause` with options (`keep_memory: false`: the disk alone;
    /// the next start boots afresh on it).
    pub async fn pause_with(
        &self,
        id: &str,
        req: &api::PauseRequest,
    ) -> Result<api::Sandbox, ClientError> {
        let path = format!("/v1/sandboxes/{}/pause", seg(id));
        self.send(Method::POST, &path, Some(req)).await
    }

    /// `POST /v1/sandboxes/{id}/resume` (`reboot: true`: boot afresh on its disk).
    pub async fn resume(
        &self,
        id: &str,
        req: &api::ResumeRequest,
    ) -> Result<api::Sandbox, ClientError> {
        let path = format!("/v1/sandboxes/{}/resume", seg(id));
        self.send(Method::POST, &path, Some(req)).await
    }

    /// `GET /v1/execs/{id}`: an exec, running or ended.
    pub async fn exec_info(&self, exec_id: &str) -> Result<api::ExecInfo, ClientError> {
        self.get(&format!("/v1/execs/{}", seg(exec_id))).await
    }

    /// `GET /v1/execs/{id}/output`: a piece of an exec's kept output from `offset`
    /// (`stream` = output|stdout|stderr), waiting up to `wait_ms` at the end of a running one.
    pub async fn exec_output(
        &self,
        exec_id: &str,
        stream: &str,
        offset: u64,
        wait_ms: u64,
        max_bytes: u64,
    ) -> Result<api::ExecOutput, ClientError> {
        self.get(&format!(
            "/v1/execs/{}/output?stream={}&offset={offset}&wait_ms={wait_ms}&max_bytes={max_bytes}",
            seg(exec_id),
            qv(stream)
        ))
        .await
    }

    /// `POST /v1/execs/{id}/signal`: a signal to the exec's process group; the exec after it.
    pub async fn signal_exec(
        &self,
        exec_id: &str,
        signal: api::SignalSpec,
    ) -> Result<api::ExecInfo, ClientError> {
        let path = format!("/v1/execs/{}/signal", seg(exec_id));
        let req = api::ExecSignalRequest { signal };
        self.send(Method::POST, &path, Some(&req)).await
    }

    /// `PUT /v1/sandboxes/{id}/files?path=/abs` with the content as the body. Whatever JSON
    /// the daemon answers with is ignored (success is the 2xx).
    pub async fn write_file(&self, id: &str, file: &api::FileContent) -> Result<(), ClientError> {
        let route = format!("/v1/sandboxes/{}/files?path={}", seg(id), qv(&file.path));
        let body = serde_json::to_vec(file).expect("API types serialize");
        let resp = self.request(Method::PUT, &route, Some(body)).await?;
        collect(resp).await.map(|_| ())
    }

    /// Start an exec; read its events with [`ExecEvents::next`].
    pub async fn exec(&self, id: &str, req: &api::ExecRequest) -> Result<ExecEvents, ClientError> {
        let body = serde_json::to_vec(req).expect("API types serialize");
        let resp = self
            .request(
                Method::POST,
                &format!("/v1/sandboxes/{}/exec", seg(id)),
                Some(body),
            )
            .await?;
        Ok(ExecEvents {
            body: resp.into_body(),
            buf: Vec::new(),
        })
    }

    /// `POST /v1/execs/{id}/attach`: `started`, the replay (with `replay`), then live events.
    pub async fn attach(&self, exec_id: &str, replay: bool) -> Result<ExecEvents, ClientError> {
        let body = serde_json::to_vec(&api::AttachRequest { replay }).expect("API types serialize");
        let resp = self
            .request(
                Method::POST,
                &format!("/v1/execs/{}/attach", seg(exec_id)),
                Some(body),
            )
            .await?;
        Ok(ExecEvents {
            body: resp.into_body(),
            buf: Vec::new(),
        })
    }
}

/// NDJSON exec events as they arrive.
pub struct ExecEvents {
    body: Incoming,
    buf: Vec<u8>,
}

impl ExecEvents {
    /// The events as a stream (`futures_util::StreamExt::next`); it ends after the last one.
    pub fn into_stream(
        self,
    ) -> futures_util::stream::BoxStream<'static, Result<api::ExecEvent, ClientError>> {
        use futures_util::StreamExt as _;
        futures_util::stream::unfold(Some(self), |state| async move {
            let mut events = state?;
            match events.next().await {
                Ok(Some(ev)) => Some((Ok(ev), Some(events))),
                Ok(None) => None,
                Err(e) => Some((Err(e), None)),
            }
        })
        .boxed()
    }

    /// The next event; `None` once the stream has ended.
    pub async fn next(&mut self) -> Result<Option<api::ExecEvent>, ClientError> {
        loop {
            if let Some(nl) = self.buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=nl).collect();
                return decode(&line).map(Some);
            }
            match self.body.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.buf.extend_from_slice(&data);
                    }
                }
                Some(Err(e)) => {
                    return Err(ClientError::Protocol(format!("exec stream broke: {e}")));
                }
                None if self.buf.is_empty() => return Ok(None),
                None => return Err(ClientError::Protocol("exec stream ended mid-line".into())),
            }
        }
    }
}

/// Characters left as they are in a path segment or query value: RFC 3986 unreserved, and `/`
/// in query values (file paths read better that way).
const SEGMENT: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~');
const QUERY_VALUE: &percent_encoding::AsciiSet = &SEGMENT.remove(b'/');

/// One path segment (an id), so a hostile id cannot reach another route.
fn seg(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, SEGMENT).to_string()
}

fn qv(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, QUERY_VALUE).to_string()
}

async fn collect(resp: Response<Incoming>) -> Result<Bytes, ClientError> {
    Ok(resp
        .into_body()
        .collect()
        .await
        .map_err(|e| ClientError::Protocol(e.to_string()))?
        .to_bytes())
}

fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ClientError> {
    serde_json::from_slice(bytes)
        .map_err(|e| ClientError::Protocol(format!("unexpected reply: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_paths_are_escaped_in_routes() {
        assert_eq!(seg("sbx_1/../x"), "sbx_1%2F..%2Fx");
        assert_eq!(qv("/workspace/a b&c=d.txt"), "/workspace/a%20b%26c%3Dd.txt");
    }
}
