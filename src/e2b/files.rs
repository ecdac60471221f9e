//! envd's plain-HTTP `/files`: `GET /files?path=P` (raw bytes) and `POST /files?path=P`
//! (`multipart/form-data`, one part per file whose filename is the destination path when `path`
//! is absent; or `application/octet-stream`, optionally `Content-Encoding: gzip`).
//!
//! Owns: parsing those bodies (multipart in `upload.rs`, bounded per file and in all; gzip
//! decoded with a cap, so a small bomb cannot fill memory), the owner of written files (the
//! request's user), and the answers' shapes (`[{"name","type":"file","path"}]`; errors as
//! `{"code","message"}`). Writes go through the service, which refuses stored secret values.

use std::io::Read as _;

use bytes::Bytes;
use futures_util::StreamExt as _;
use http_body_util::BodyExt as _;
use hyper::body::Incoming;
use hyper::header::{self, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{Value, json};

use super::{E2bError, Face, guest_path};
use crate::daemon::response::Body;
use crate::service::e2b::E2bSandbox;

pub async fn handle(req: Request<Incoming>, face: &Face, rec: &E2bSandbox) -> Response<Body> {
    let r = match *req.method() {
        Method::GET => read(req, face, rec).await,
        Method::POST => write(req, face, rec).await,
        _ => Err(E2bError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "use GET or POST on /files",
        )),
    };
    r.unwrap_or_else(E2bError::into_response)
}

struct Query {
    path: Option<String>,
    user: String,
}

fn query(req: &Request<Incoming>) -> Result<Query, E2bError> {
    let mut path = None;
    let mut user = None;
    for (k, v) in form_urlencoded::parse(req.uri().query().unwrap_or("").as_bytes()) {
        match k.as_ref() {
            "path" => path = Some(v.into_owned()),
            "username" if !v.is_empty() => user = Some(v.into_owned()),
            _ => {}
        }
    }
    let user = match user {
        Some(u) => u,
        None => super::request_user(req.headers())
            .map_err(|e| E2bError::new(StatusCode::BAD_REQUEST, e.message))?,
    };
    if user.len() > 32
        || !user
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-')
    {
        return Err(E2bError::new(StatusCode::BAD_REQUEST, "bad username"));
    }
    Ok(Query { path, user })
}

/// The user's (uid, gid) and home in the guest.
async fn owner(
    face: &Face,
    rec: &E2bSandbox,
    user: &str,
) -> Result<((u32, u32), String), E2bError> {
    let acc = face.svc.vm_accounts(&rec.sandbox_id).await?;
    let u = acc.user(user).ok_or_else(|| {
        E2bError::new(
            StatusCode::BAD_REQUEST,
            format!("the sandbox has no user `{user}`"),
        )
    })?;
    Ok(((u.uid, u.gid), u.home.clone()))
}

fn path_err(e: super::connect::ConnectError) -> E2bError {
    E2bError::new(StatusCode::BAD_REQUEST, e.message)
}

async fn read(
    req: Request<Incoming>,
    face: &Face,
    rec: &E2bSandbox,
) -> Result<Response<Body>, E2bError> {
    let q = query(&req)?;
    let (_, home) = owner(face, rec, &q.user).await?;
    let p = guest_path(q.path.as_deref().unwrap_or(""), &home).map_err(path_err)?;
    let data = face.svc.vm_read(&rec.sandbox_id, &p).await?;
    Ok(Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .body(http_body_util::Full::new(Bytes::from(data)).boxed())
        .unwrap_or_else(|_| super::empty(StatusCode::INTERNAL_SERVER_ERROR)))
}

async fn write(
    req: Request<Incoming>,
    face: &Face,
    rec: &E2bSandbox,
) -> Result<Response<Body>, E2bError> {
    let q = query(&req)?;
    let (own, home) = owner(face, rec, &q.user).await?;
    let max = face.svc.max_file_bytes();
    let ctype = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let gzip = req
        .headers()
        .get(header::CONTENT_ENCODING)
        .is_some_and(|v| v == HeaderValue::from_static("gzip"));
    let mut written: Vec<Value> = Vec::new();
    if ctype.starts_with("multipart/form-data") {
        let boundary = multer::parse_boundary(&ctype)
            .map_err(|e| E2bError::new(StatusCode::BAD_REQUEST, format!("multipart: {e}")))?;
        let stream = req.into_body().into_data_stream();
        for part in super::upload::multipart(stream, boundary, q.path.as_deref(), max).await? {
            written.push(put(face, rec, &part.dest, &home, own, &part.data).await?);
        }
    } else {
        let dest = q.path.clone().ok_or_else(|| {
            E2bError::new(
                StatusCode::BAD_REQUEST,
                "`path` is required for a raw upload",
            )
        })?;
        let limit = max.saturating_add(1) as usize;
        let mut body = Vec::new();
        let mut stream = req.into_body().into_data_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| E2bError::new(StatusCode::BAD_REQUEST, e.to_string()))?;
            if body.len() + chunk.len() > limit {
                return Err(too_big(max));
            }
            body.extend_from_slice(&chunk);
        }
        let data = if gzip { gunzip(&body, max)? } else { body };
        written.push(put(face, rec, &dest, &home, own, &data).await?);
    }
    if written.is_empty() {
        return Err(E2bError::new(
            StatusCode::BAD_REQUEST,
            "no file in the upload",
        ));
    }
    Ok(super::json(StatusCode::OK, &written))
}

fn too_big(max: u64) -> E2bError {
    E2bError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        format!("a file is over the limit of {max} bytes (sync.max_file_mib)"),
    )
}

/// Decode gzip, refusing more than `max` bytes out.
fn gunzip(data: &[u8], max: u64) -> Result<Vec<u8>, E2bError> {
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(data)
        .take(max.saturating_add(1))
        .read_to_end(&mut out)
        .map_err(|e| E2bError::new(StatusCode::BAD_REQUEST, format!("gzip: {e}")))?;
    if out.len() as u64 > max {
        return Err(too_big(max));
    }
    Ok(out)
}

async fn put(
    face: &Face,
    rec: &E2bSandbox,
    dest: &str,
    home: &str,
    own: (u32, u32),
    data: &[u8],
) -> Result<Value, E2bError> {
    let p = guest_path(dest, home).map_err(path_err)?;
    face.svc
        .vm_write(&rec.sandbox_id, &p, data, Some(own))
        .await?;
    let name = p.rsplit('/').next().unwrap_or("").to_owned();
    Ok(json!({ "name": name, "type": "file", "path": p }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gzip_is_decoded_and_bombs_are_cut_off() {
        use std::io::Write as _;
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        enc.write_all(&vec![b'a'; 100_000]).unwrap();
        let gz = enc.finish().unwrap();
        assert_eq!(gunzip(&gz, 100_000).unwrap().len(), 100_000);
        let e = gunzip(&gz, 99_999).unwrap_err();
        assert_eq!(e.status, StatusCode::PAYLOAD_TOO_LARGE);
        assert!(gunzip(b"not gzip", 10).is_err());
    }
}
