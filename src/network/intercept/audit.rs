//! The request-body audit: a request body is watched, unchanged, for the placeholders of
//! secrets that do not serve the host it goes to (agents echo tool output to their model);
//! each one found is reported once per body (`secret.in_body`, never refused). WebSocket
//! messages get the same audit in `ws_watch.rs`.
//!
//! Owns: one Aho-Corasick matcher per body and a carry shorter than the longest placeholder.
//! Never: changes or holds the body.

use std::sync::Arc;

use super::Interceptor;
use super::body::{BoxError, Transform};
use super::swap::Blocked;

/// Watches a request body for the placeholders of secrets that do not serve the host: passed
/// through unchanged, each one found is reported once at the end (`secret.in_body`).
pub struct Audit {
    icpt: Arc<Interceptor>,
    host: String,
    names: Vec<String>,
    ac: aho_corasick::AhoCorasick,
    max_len: usize,
    carry: Vec<u8>,
    found: Vec<bool>,
}

impl Audit {
    fn new(icpt: Arc<Interceptor>, host: &str, found: Vec<(String, String)>) -> Option<Audit> {
        if found.is_empty() {
            return None;
        }
        let ac = aho_corasick::AhoCorasick::builder()
            .ascii_case_insensitive(true)
            .build(found.iter().map(|(_, p)| p))
            .ok()?;
        Some(Audit {
            icpt,
            host: host.to_owned(),
            max_len: found.iter().map(|(_, p)| p.len()).max().unwrap_or(1),
            found: vec![false; found.len()],
            names: found.into_iter().map(|(n, _)| n).collect(),
            ac,
            carry: Vec::new(),
        })
    }
}

impl Transform for Audit {
    fn push(&mut self, chunk: &[u8]) -> Result<Vec<u8>, BoxError> {
        let mut buf = std::mem::take(&mut self.carry);
        buf.extend_from_slice(chunk);
        for m in self.ac.find_iter(&buf) {
            self.found[m.pattern().as_usize()] = true;
        }
        let keep = buf.len().min(self.max_len.saturating_sub(1));
        self.carry = buf[buf.len() - keep..].to_vec();
        Ok(chunk.to_vec())
    }
    fn finish(&mut self) -> Result<Vec<u8>, BoxError> {
        for (i, hit) in self.found.iter().enumerate() {
            if *hit {
                let b = Blocked {
                    secret: self.names[i].clone(),
                    position: "body".into(),
                    refused: false,
                };
                self.icpt.blocked(&b, &self.host);
            }
        }
        self.found.iter_mut().for_each(|f| *f = false);
        Ok(Vec::new())
    }
}

/// The request-body audit of a flow to `host`, if any secret does not serve it.
pub fn audit(
    icpt: &Arc<Interceptor>,
    snap: &crate::secrets::Snapshot,
    host: &str,
) -> Option<Audit> {
    let others = snap
        .bindings
        .iter()
        .filter(|b| !b.serves(host))
        .map(|b| (b.name.clone(), b.placeholder.clone()))
        .collect();
    Audit::new(icpt.clone(), host, others)
}
