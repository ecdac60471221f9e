//! Parses an HTTP request (method, path, JSON body) into one [`Action`]. No business logic:
//! everything after parsing happens in `handlers` and the service.

use hyper::Method;

use super::response::ApiError;
use crate::api;
use crate::ids;

/// Everything the API can be asked to do.
#[derive(Debug)]
pub enum Action {
    Health,
    OpenApi,
    CreateSandbox(api::CreateSandboxRequest),
    ListSandboxes,
    GetSandbox(String),
    DeleteSandbox(String),
    Exec(String, api::ExecRequest, StreamFormat),
}

/// How a streamed response is framed: NDJSON by default, server-sent events when the client
/// sends `Accept: text/event-stream`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamFormat {
    Ndjson,
    Sse,
}

impl StreamFormat {
    pub fn from_accept(accept: Option<&str>) -> StreamFormat {
        match accept {
            Some(a) if a.contains("text/event-stream") => StreamFormat::Sse,
            _ => StreamFormat::Ndjson,
        }
    }
}

/// Every route the router knows, as `(method, OpenAPI path template)`. Tested against
/// `api/openapi.yaml` in both directions.
#[cfg(test)]
pub const ROUTES: &[(&str, &str)] = &[
    ("GET", "/v1/health"),
    ("GET", "/v1/openapi.yaml"),
    ("POST", "/v1/sandboxes"),
    ("GET", "/v1/sandboxes"),
    ("GET", "/v1/sandboxes/{id}"),
    ("DELETE", "/v1/sandboxes/{id}"),
    ("POST", "/v1/sandboxes/{id}/exec"),
];

/// Turn method + path + body into an action, or a 400/404/405 error.
pub fn parse(
    method: &Method,
    path: &str,
    format: StreamFormat,
    body: &[u8],
) -> Result<Action, ApiError> {
    let segs: Vec<&str> = path.trim_end_matches('/').split('/').skip(1).collect();
    match (method, segs.as_slice()) {
        (&Method::GET, ["v1", "health"]) => Ok(Action::Health),
        (&Method::GET, ["v1", "openapi.yaml"]) => Ok(Action::OpenApi),
        (&Method::POST, ["v1", "sandboxes"]) => Ok(Action::CreateSandbox(json(body)?)),
        (&Method::GET, ["v1", "sandboxes"]) => Ok(Action::ListSandboxes),
        (&Method::GET, ["v1", "sandboxes", id]) => Ok(Action::GetSandbox(sandbox_id(id)?)),
        (&Method::DELETE, ["v1", "sandboxes", id]) => Ok(Action::DeleteSandbox(sandbox_id(id)?)),
        (&Method::POST, ["v1", "sandboxes", id, "exec"]) => {
            Ok(Action::Exec(sandbox_id(id)?, json(body)?, format))
        }
        (_, ["v1", "health" | "openapi.yaml"])
        | (_, ["v1", "sandboxes"])
        | (_, ["v1", "sandboxes", _])
        | (_, ["v1", "sandboxes", _, "exec"]) => Err(ApiError::method_not_allowed(method)),
        _ => Err(ApiError::not_found(format!("no such API route: {path}"))),
    }
}

fn json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::bad_request("the request needs a JSON body"));
    }
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("malformed JSON body: {e}")))
}

/// A syntactically invalid id can never exist: answer 404 like any unknown sandbox.
fn sandbox_id(id: &str) -> Result<String, ApiError> {
    if ids::is_valid(ids::SANDBOX, id) {
        Ok(id.to_owned())
    } else {
        Err(ApiError::not_found(format!("no sandbox `{id}`")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_nd(m: &Method, p: &str, b: &[u8]) -> Result<Action, ApiError> {
        parse(m, p, StreamFormat::Ndjson, b)
    }

    #[test]
    fn accept_header_picks_sse() {
        assert_eq!(
            StreamFormat::from_accept(Some("text/event-stream")),
            StreamFormat::Sse
        );
        assert_eq!(
            StreamFormat::from_accept(Some("application/x-ndjson")),
            StreamFormat::Ndjson
        );
        assert_eq!(StreamFormat::from_accept(None), StreamFormat::Ndjson);
    }

    #[test]
    fn malformed_json_is_a_bad_request() {
        let e = parse_nd(&Method::POST, "/v1/sandboxes", b"{not json").unwrap_err();
        assert_eq!(e.status, hyper::StatusCode::BAD_REQUEST);
        assert_eq!(e.code, "bad_request");
    }

    #[test]
    fn unknown_route_is_404_and_wrong_method_405() {
        assert_eq!(
            parse_nd(&Method::GET, "/v2/x", b"").unwrap_err().status,
            404
        );
        assert_eq!(
            parse_nd(&Method::PUT, "/v1/sandboxes", b"")
                .unwrap_err()
                .status,
            405
        );
    }

    #[test]
    fn path_traversal_ids_never_reach_the_service() {
        let e = parse_nd(&Method::DELETE, "/v1/sandboxes/..", b"").unwrap_err();
        assert_eq!(e.status, 404);
        let e = parse_nd(&Method::GET, "/v1/sandboxes/sbx_%2e%2e", b"").unwrap_err();
        assert_eq!(e.status, 404);
    }

    /// (method, path template) pairs documented in `api/openapi.yaml`.
    fn documented_routes() -> Vec<(String, String)> {
        let docs = yaml_rust2::YamlLoader::load_from_str(crate::daemon::OPENAPI_YAML).unwrap();
        let paths = docs[0]["paths"].as_hash().expect("paths");
        let mut out = Vec::new();
        for (p, ops) in paths {
            for (m, _) in ops.as_hash().unwrap() {
                let m = m.as_str().unwrap();
                if m != "parameters" {
                    out.push((m.to_uppercase(), p.as_str().unwrap().to_owned()));
                }
            }
        }
        out
    }

    #[test]
    fn openapi_documents_exactly_the_routes_the_router_serves() {
        let mut documented = documented_routes();
        documented.sort();
        let mut served: Vec<(String, String)> = ROUTES
            .iter()
            .map(|(m, p)| (m.to_string(), p.to_string()))
            .collect();
        served.sort();
        assert_eq!(documented, served);
        // And each documented route really parses (not 404/405) with a sample id and body.
        let id = crate::ids::new_id(crate::ids::SANDBOX);
        for (m, p) in &documented {
            let path = p.replace("{id}", &id);
            let method: Method = m.parse().unwrap();
            let body: &[u8] = match (m.as_str(), p.as_str()) {
                ("POST", "/v1/sandboxes") => br#"{"workspace":{"host_path":"/tmp"}}"#,
                ("POST", _) => br#"{"cmd":"true"}"#,
                _ => b"",
            };
            parse_nd(&method, &path, body).unwrap_or_else(|e| panic!("{m} {p}: {e:?}"));
        }
    }

    #[test]
    fn exec_parses() {
        let id = crate::ids::new_id(crate::ids::SANDBOX);
        let a = parse_nd(
            &Method::POST,
            &format!("/v1/sandboxes/{id}/exec"),
            br#"{"cmd":"true"}"#,
        )
        .unwrap();
        assert!(
            matches!(a, Action::Exec(ref i, ref r, StreamFormat::Ndjson) if *i == id && r.cmd.as_deref() == Some("true"))
        );
    }
}
