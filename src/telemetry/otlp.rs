//! OTLP/HTTP (protobuf) export of finished traces (`tryboxi serve --otlp-endpoint URL`), with
//! the OpenTelemetry crates: `opentelemetry-otlp`'s span exporter over a hyper client.
//!
//! A finished trace becomes one OpenTelemetry trace: a root span (`sandbox.create` for `sbx_…`,
//! `exec.request` for `exe_…`) over the whole operation, with each phase as a child. The
//! trace id is derived from the tryboxi id, so a trace is findable by it (attribute
//! `tryboxi.id`). Export runs on a tokio task fed by a bounded queue; when the collector is
//! slow or down, traces are dropped and counted (`tryboxi_errors_total{kind="otlp_export"}`),
//! never waited for. Never: blocks a request on the collector.

use std::borrow::Cow;
use std::time::{Duration, UNIX_EPOCH};

use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState,
};
use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{SpanData, SpanEvents, SpanExporter as _, SpanLinks};
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;

use super::traces::{Exporter, Trace};

/// Traces waiting for export; more are dropped.
const QUEUE: usize = 256;
const TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum OtlpError {
    #[error("--otlp-endpoint `{0}` is not an http:// URL (e.g. http://127.0.0.1:4318)")]
    BadUrl(String),
    #[error("cannot set up OTLP export to {url}: {message}")]
    Setup { url: String, message: String },
    #[error("OTLP export needs a tokio runtime (start it from the daemon)")]
    NoRuntime,
}

/// The collector's traces URL: `/v1/traces` is added unless the URL already names a path.
pub fn traces_url(base: &str) -> Result<String, OtlpError> {
    let rest = base
        .strip_prefix("http://")
        .ok_or_else(|| OtlpError::BadUrl(base.to_owned()))?;
    if rest.is_empty() || rest.starts_with('/') {
        return Err(OtlpError::BadUrl(base.to_owned()));
    }
    Ok(match rest.split_once('/') {
        Some((_, path)) if !path.is_empty() => base.to_owned(),
        _ => format!("{}/v1/traces", base.trim_end_matches('/')),
    })
}

struct Otlp {
    tx: mpsc::Sender<Trace>,
}

impl Exporter for Otlp {
    fn export(&self, trace: &Trace) {
        if self.tx.try_send(trace.clone()).is_err() {
            super::metrics::error(super::metrics::ErrorKind::OtlpExport);
        }
    }
}

/// Start exporting to `url` (call inside the daemon's tokio runtime).
pub fn exporter(url: &str) -> Result<Box<dyn Exporter>, OtlpError> {
    let endpoint = traces_url(url)?;
    let handle = tokio::runtime::Handle::try_current().map_err(|_| OtlpError::NoRuntime)?;
    let client = opentelemetry_http::hyper::HyperClient::with_default_connector(TIMEOUT, None);
    let mut exp = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(client)
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(endpoint.clone())
        .with_timeout(TIMEOUT)
        .build()
        .map_err(|e| OtlpError::Setup {
            url: endpoint.clone(),
            message: e.to_string(),
        })?;
    exp.set_resource(
        &Resource::builder_empty()
            .with_service_name("tryboxi")
            .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
            .build(),
    );
    let (tx, mut rx) = mpsc::channel::<Trace>(QUEUE);
    handle.spawn(async move {
        while let Some(t) = rx.recv().await {
            if let Err(e) = exp.export(to_span_data(&t)).await {
                super::metrics::error(super::metrics::ErrorKind::OtlpExport);
                tracing::warn!(error = %e, trace = %t.id, "OTLP export failed");
            }
        }
    });
    tracing::info!(endpoint = %endpoint, "exporting traces over OTLP/HTTP");
    Ok(Box::new(Otlp { tx }))
}

fn digest(parts: &[&[u8]]) -> [u8; 32] {
    let mut h = Sha256::new();
    for p in parts {
        h.update(p);
    }
    h.finalize().into()
}

fn span_id(trace: &str, i: usize) -> SpanId {
    let d = digest(&[trace.as_bytes(), &i.to_le_bytes()]);
    let mut b = [0u8; 8];
    b.copy_from_slice(&d[..8]);
    b[0] |= 1; // never the invalid all-zero id
    SpanId::from_bytes(b)
}

/// One OpenTelemetry trace: a root span over the operation, each phase a child.
pub fn to_span_data(t: &Trace) -> Vec<SpanData> {
    let Some(start) = t.spans.iter().map(|s| s.start_unix_ns).min() else {
        return Vec::new();
    };
    let end = t
        .spans
        .iter()
        .map(|s| s.start_unix_ns + s.duration_ns)
        .max()
        .unwrap_or(start);
    let mut tid = [0u8; 16];
    tid.copy_from_slice(&digest(&[t.id.as_bytes()])[..16]);
    tid[0] |= 1;
    let trace_id = TraceId::from_bytes(tid);
    let at = |ns: u64| UNIX_EPOCH + Duration::from_nanos(ns);
    let ctx = |sid| {
        SpanContext::new(
            trace_id,
            sid,
            TraceFlags::SAMPLED,
            false,
            TraceState::default(),
        )
    };
    let scope = InstrumentationScope::builder("tryboxi")
        .with_version(env!("CARGO_PKG_VERSION"))
        .build();
    let root_id = span_id(&t.id, 0);
    let root_name = if t.id.starts_with("exe_") {
        "exec.request"
    } else {
        "sandbox.create"
    };
    let mut out = vec![SpanData {
        span_context: ctx(root_id),
        parent_span_id: SpanId::INVALID,
        parent_span_is_remote: false,
        span_kind: SpanKind::Internal,
        name: Cow::Borrowed(root_name),
        start_time: at(start),
        end_time: at(end),
        attributes: vec![KeyValue::new("tryboxi.id", t.id.clone())],
        dropped_attributes_count: 0,
        events: SpanEvents::default(),
        links: SpanLinks::default(),
        status: Status::Unset,
        instrumentation_scope: scope.clone(),
    }];
    for (i, s) in t.spans.iter().enumerate() {
        let mut attributes = vec![KeyValue::new("tryboxi.id", t.id.clone())];
        attributes.extend(
            s.attrs
                .iter()
                .map(|(k, v)| KeyValue::new(format!("tryboxi.{k}"), v.clone())),
        );
        out.push(SpanData {
            span_context: ctx(span_id(&t.id, i + 1)),
            parent_span_id: root_id,
            parent_span_is_remote: false,
            span_kind: SpanKind::Internal,
            name: Cow::Owned(s.name.clone()),
            start_time: at(s.start_unix_ns),
            end_time: at(s.start_unix_ns + s.duration_ns),
            attributes,
            dropped_attributes_count: 0,
            events: SpanEvents::default(),
            links: SpanLinks::default(),
            status: Status::Unset,
            instrumentation_scope: scope.clone(),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::traces::Span;

    #[test]
    fn endpoint_gets_the_traces_path_unless_it_has_one() {
        assert_eq!(
            traces_url("http://127.0.0.1:4318").unwrap(),
            "http://127.0.0.1:4318/v1/traces"
        );
        assert_eq!(
            traces_url("http://h:4318/").unwrap(),
            "http://h:4318/v1/traces"
        );
        assert_eq!(traces_url("http://h/custom").unwrap(), "http://h/custom");
        assert!(traces_url("https://h").is_err());
        assert!(traces_url("h:4318").is_err());
    }

    #[test]
    fn a_trace_becomes_a_root_with_one_child_per_phase() {
        let t = Trace {
            id: "exe_0123456789abcdef".into(),
            finished: true,
            spans: vec![
                Span {
                    name: "exec.spawn".into(),
                    start_unix_ns: 1_000,
                    duration_ns: 500,
                    attrs: Default::default(),
                },
                Span {
                    name: "exec".into(),
                    start_unix_ns: 1_500,
                    duration_ns: 2_000,
                    attrs: [("exit_code".to_owned(), "3".to_owned())].into(),
                },
            ],
        };
        let d = to_span_data(&t);
        assert_eq!(d.len(), 3);
        let root = &d[0];
        assert_eq!(root.name, "exec.request");
        assert_eq!(
            root.end_time.duration_since(root.start_time).unwrap(),
            Duration::from_nanos(2_500)
        );
        for child in &d[1..] {
            assert_eq!(child.parent_span_id, root.span_context.span_id());
            assert_eq!(child.span_context.trace_id(), root.span_context.trace_id());
            assert!(child.span_context.is_valid());
        }
        assert!(
            d[2].attributes
                .iter()
                .any(|kv| kv.key.as_str() == "tryboxi.exit_code")
        );
        // Same id, same trace id: findable again.
        assert_eq!(
            to_span_data(&t)[0].span_context.trace_id(),
            root.span_context.trace_id()
        );
    }
}
