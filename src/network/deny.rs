//! [`DenyAll`]: the gate of a sandbox that has no policy — nothing leaves the VM.
//!
//! Every connect and first-bytes check is denied; DNS questions get a REFUSED answer at once
//! (so tools fail fast instead of timing out); outcomes are logged.

use futures_util::future::BoxFuture;

use super::gate::{ConnectVerdict, Flow, FlowEvent, Gate, InspectVerdict};

pub struct DenyAll;

const REASON: &str = "this sandbox has no network policy: all egress is denied";

impl Gate for DenyAll {
    fn connect(&self, _: &Flow) -> ConnectVerdict {
        ConnectVerdict::Deny {
            reason: REASON.into(),
        }
    }

    fn inspect(&self, _: &Flow, _: &[u8]) -> InspectVerdict {
        InspectVerdict::Deny {
            reason: REASON.into(),
            host: None,
        }
    }

    fn dns(&self, query: Vec<u8>) -> BoxFuture<'static, Option<Vec<u8>>> {
        Box::pin(async move { refused(&query) })
    }

    fn record(&self, event: FlowEvent) {
        tracing::debug!(?event, "network flow");
    }
}

/// A REFUSED answer to `query`: its header and question, QR set, RCODE 5, no records.
pub fn refused(query: &[u8]) -> Option<Vec<u8>> {
    if query.len() < 12 || query[2] & 0x80 != 0 {
        return None;
    }
    let mut i = 12;
    let qdcount = u16::from_be_bytes([query[4], query[5]]);
    if qdcount != 1 {
        i = 12;
    } else {
        loop {
            let l = *query.get(i)? as usize;
            i += 1;
            if l == 0 {
                break;
            }
            if l & 0xc0 != 0 {
                return None;
            }
            i += l;
        }
        i += 4;
        if i > query.len() {
            return None;
        }
    }
    let mut out = query[..i].to_vec();
    // QR = 1, keep opcode and RD; RA = 0; RCODE = 5 (REFUSED).
    out[2] = (out[2] | 0x80) & 0xf9 | (query[2] & 0x01);
    out[3] = 5;
    let qd = if qdcount == 1 { 1u16 } else { 0 };
    out[4..6].copy_from_slice(&qd.to_be_bytes());
    out[6..12].fill(0);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::network::gate::Proto;

    #[test]
    fn deny_all_denies_and_refuses_dns() {
        let f = Flow {
            proto: Proto::Tcp,
            src: "10.0.2.15:40000".parse().unwrap(),
            dst: "192.0.2.1:443".parse().unwrap(),
        };
        assert!(matches!(DenyAll.connect(&f), ConnectVerdict::Deny { .. }));
        assert!(matches!(
            DenyAll.inspect(&f, b"x"),
            InspectVerdict::Deny { .. }
        ));
        let q = b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x07example\x03com\x00\x00\x01\x00\x01";
        let a = refused(q).unwrap();
        assert_eq!(&a[..2], &[0x12, 0x34]);
        assert_eq!(a[2] & 0x80, 0x80, "a response");
        assert_eq!(a[2] & 0x01, 0x01, "RD copied");
        assert_eq!(a[3] & 0x0f, 5, "REFUSED");
        assert_eq!(&a[12..], &q[12..]);
        assert!(refused(&a).is_none(), "never answers an answer");
        assert!(refused(&q[..8]).is_none());
    }
}
