//! What the guest's WebSocket frames are watched for, besides the swap ([`super::ws::WsSwap`]
//! feeds every data message's unmasked payload here, swapped or not):
//! - the placeholders of secrets that do NOT serve the host: passed through unchanged and
//!   audited once per message (`secret.in_body`, position `websocket frame`), as request
//!   bodies are;
//! - the placeholders of the secrets swapped in the frames (`--in-body` secrets serving the
//!   host): each message that carried one marks its secret used (`secret ls`, "last used"), as
//!   a swapped request does.
//!
//! Owns: one Aho-Corasick matcher per kind, a carry shorter than the longest placeholder (so a
//! placeholder split across frames or reads is found), one flag per secret per message.
//! Never: changes a byte, or holds more than that carry.

use std::sync::Arc;

use super::Interceptor;
use super::swap::Blocked;
use crate::secrets::Snapshot;

/// Placeholders watched for in one kind.
struct Watch {
    names: Vec<String>,
    ac: aho_corasick::AhoCorasick,
    max_len: usize,
    carry: Vec<u8>,
    seen: Vec<bool>,
}

impl Watch {
    fn new(pairs: Vec<(String, String)>) -> Option<Watch> {
        if pairs.is_empty() {
            return None;
        }
        let ac = aho_corasick::AhoCorasick::builder()
            .ascii_case_insensitive(true)
            .build(pairs.iter().map(|(_, p)| p))
            .ok()?;
        Some(Watch {
            max_len: pairs.iter().map(|(_, p)| p.len()).max().unwrap_or(1),
            seen: vec![false; pairs.len()],
            names: pairs.into_iter().map(|(n, _)| n).collect(),
            ac,
            carry: Vec::new(),
        })
    }

    /// The secrets first seen in this message by `chunk`.
    fn feed(&mut self, chunk: &[u8]) -> Vec<usize> {
        let mut buf = std::mem::take(&mut self.carry);
        buf.extend_from_slice(chunk);
        let mut new = Vec::new();
        for m in self.ac.find_iter(&buf) {
            let i = m.pattern().as_usize();
            if !self.seen[i] {
                self.seen[i] = true;
                new.push(i);
            }
        }
        let keep = buf.len().min(self.max_len.saturating_sub(1));
        self.carry = buf[buf.len() - keep..].to_vec();
        new
    }

    fn end_message(&mut self) {
        self.carry.clear();
        self.seen.iter_mut().for_each(|s| *s = false);
    }
}

/// The watch on the guest's frames of one WebSocket connection to `host`.
pub struct FrameWatch {
    icpt: Arc<Interceptor>,
    host: String,
    others: Option<Watch>,
    swapped: Option<Watch>,
}

impl FrameWatch {
    /// For a connection to `host` whose frames have the placeholders of `swapped` (indices
    /// into `snap.bindings`) swapped; `None` when there is nothing to watch.
    pub fn new(
        icpt: Arc<Interceptor>,
        snap: &Snapshot,
        host: &str,
        swapped: &[usize],
    ) -> Option<FrameWatch> {
        let pair = |b: &crate::secrets::Binding| (b.name.clone(), b.placeholder.clone());
        let others = Watch::new(
            snap.bindings
                .iter()
                .filter(|b| !b.serves(host))
                .map(pair)
                .collect(),
        );
        let swapped = Watch::new(
            swapped
                .iter()
                .filter_map(|&i| snap.bindings.get(i))
                .map(pair)
                .collect(),
        );
        if others.is_none() && swapped.is_none() {
            return None;
        }
        Some(FrameWatch {
            icpt,
            host: host.to_owned(),
            others,
            swapped,
        })
    }

    /// A piece of a data message's payload, unmasked, before any swap.
    pub fn feed(&mut self, plain: &[u8]) {
        if let Some(w) = &mut self.others {
            for i in w.feed(plain) {
                let b = Blocked {
                    secret: w.names[i].clone(),
                    position: "websocket frame".into(),
                    refused: false,
                };
                self.icpt.blocked(&b, &self.host);
            }
        }
        if let Some(w) = &mut self.swapped {
            for i in w.feed(plain) {
                self.icpt.used(&w.names[i]);
            }
        }
    }

    /// The message ended: a placeholder in the next one is reported again.
    pub fn end_message(&mut self) {
        for w in [&mut self.others, &mut self.swapped].into_iter().flatten() {
            w.end_message();
        }
    }
}
