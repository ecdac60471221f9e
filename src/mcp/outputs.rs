//! Command output kept after an `exec` so the model can page through what did not fit in the
//! tool result (`read_output`). In memory, bounded: the last [`KEEP`] execs, at most
//! [`CAP`] bytes per stream (the rest is counted, not kept). Gone when the server exits.

use std::collections::VecDeque;

use super::ToolError;

/// How many execs' output is kept.
pub const KEEP: usize = 16;
/// Bytes kept per stream of one exec.
pub const CAP: usize = 16 << 20;

/// One stream of one exec, as it arrives.
#[derive(Debug, Default)]
pub struct Captured {
    pub bytes: Vec<u8>,
    /// Bytes that arrived beyond [`CAP`] and were dropped.
    pub dropped: u64,
}

impl Captured {
    pub fn push(&mut self, chunk: &[u8]) {
        let room = CAP.saturating_sub(self.bytes.len());
        let take = room.min(chunk.len());
        self.bytes.extend_from_slice(&chunk[..take]);
        self.dropped += (chunk.len() - take) as u64;
    }

    pub fn total(&self) -> u64 {
        self.bytes.len() as u64 + self.dropped
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Stream {
    Stdout,
    Stderr,
}

struct Entry {
    id: String,
    stdout: Captured,
    stderr: Captured,
}

#[derive(Default)]
pub struct Outputs {
    next: u64,
    entries: VecDeque<Entry>,
}

/// A page of kept output.
#[derive(Debug, serde::Serialize)]
pub struct Page {
    pub output_id: String,
    pub offset: u64,
    /// Where the next page starts, or `null` at the end.
    pub next_offset: Option<u64>,
    /// Bytes kept for this stream.
    pub total_bytes: u64,
    pub text: String,
}

impl Outputs {
    /// Keep an exec's output; returns its `output_id`.
    pub fn insert(&mut self, stdout: Captured, stderr: Captured) -> String {
        self.next += 1;
        let id = format!("out_{}", self.next);
        if self.entries.len() == KEEP {
            self.entries.pop_front();
        }
        self.entries.push_back(Entry {
            id: id.clone(),
            stdout,
            stderr,
        });
        id
    }

    pub fn page(
        &self,
        id: &str,
        stream: Stream,
        offset: u64,
        limit: u64,
    ) -> Result<Page, ToolError> {
        let e = self.entries.iter().find(|e| e.id == id).ok_or_else(|| {
            ToolError::Other(format!(
                "No kept output `{id}`: only the last {KEEP} execs of this MCP session are kept."
            ))
        })?;
        let buf = match stream {
            Stream::Stdout => &e.stdout.bytes,
            Stream::Stderr => &e.stderr.bytes,
        };
        let start = usize::try_from(offset).unwrap_or(usize::MAX).min(buf.len());
        let want = usize::try_from(limit).unwrap_or(usize::MAX);
        let mut end = start.saturating_add(want).min(buf.len());
        // Do not cut a UTF-8 character in two: end the page before it.
        if let Err(err) = std::str::from_utf8(&buf[start..end])
            && err.error_len().is_none()
            && err.valid_up_to() > 0
        {
            end = start + err.valid_up_to();
        }
        Ok(Page {
            output_id: id.to_owned(),
            offset: start as u64,
            next_offset: (end < buf.len()).then_some(end as u64),
            total_bytes: buf.len() as u64,
            text: String::from_utf8_lossy(&buf[start..end]).into_owned(),
        })
    }
}

/// What of a stream goes into the tool result: all of it when it fits in `limit` bytes, else
/// its head and tail (the end of a log is usually what matters) and a note on what was left out.
pub fn excerpt(bytes: &[u8], limit: usize) -> (String, Option<u64>) {
    if bytes.len() <= limit {
        return (String::from_utf8_lossy(bytes).into_owned(), None);
    }
    let head = limit / 4;
    let tail = limit - head;
    let omitted = (bytes.len() - head - tail) as u64;
    let text = format!(
        "{}\n[... {omitted} bytes omitted ...]\n{}",
        String::from_utf8_lossy(&bytes[..head]),
        String::from_utf8_lossy(&bytes[bytes.len() - tail..])
    );
    (text, Some(omitted))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn captured(s: &str) -> Captured {
        let mut c = Captured::default();
        c.push(s.as_bytes());
        c
    }

    #[test]
    fn pages_cover_the_output_exactly_once() {
        let mut o = Outputs::default();
        let text: String = (0..1000).map(|i| format!("line {i} é\n")).collect();
        let id = o.insert(captured(&text), Captured::default());
        let mut got = String::new();
        let mut off = 0;
        loop {
            let p = o.page(&id, Stream::Stdout, off, 333).unwrap();
            got.push_str(&p.text);
            match p.next_offset {
                Some(n) => off = n,
                None => break,
            }
        }
        assert_eq!(got, text, "no byte lost or doubled, no character split");
    }

    #[test]
    fn only_the_last_execs_are_kept() {
        let mut o = Outputs::default();
        let first = o.insert(captured("a"), Captured::default());
        for _ in 0..KEEP {
            o.insert(captured("b"), Captured::default());
        }
        assert!(o.page(&first, Stream::Stdout, 0, 10).is_err());
    }

    #[test]
    fn excerpt_keeps_head_and_tail_and_counts_the_rest() {
        let bytes: Vec<u8> = (0..10_000u32).map(|i| b'a' + (i % 26) as u8).collect();
        let (text, omitted) = excerpt(&bytes, 1000);
        assert_eq!(omitted, Some(9000));
        assert!(text.starts_with(std::str::from_utf8(&bytes[..250]).unwrap()));
        assert!(text.ends_with(std::str::from_utf8(&bytes[10_000 - 750..]).unwrap()));
        assert_eq!(excerpt(b"short", 1000), ("short".into(), None));
    }

    #[test]
    fn capture_beyond_the_cap_is_counted_not_kept() {
        let mut c = Captured::default();
        c.push(&vec![b'x'; CAP - 1]);
        c.push(b"yz");
        assert_eq!(c.bytes.len(), CAP);
        assert_eq!(c.dropped, 1);
        assert_eq!(c.total(), CAP as u64 + 1);
    }
}
