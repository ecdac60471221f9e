//! The `git-receive-pack` request screener and the report-status answer a refused push gets.
//!
//! A push's request body is `*shallow (command-list | push-cert) [push-options] pack`, in
//! pkt-lines (4 hex digits of length including themselves, `0000` flush). [`Screener`] is fed
//! the body as it streams and decides once the command list's flush arrives: every ref is
//! checked against the grant's patterns ([`super::refs::check_ref`]); one refused ref refuses
//! the whole push (all-or-nothing, deny wins). Whatever follows the flush (push options, the
//! pack) is not looked at.
//!
//! It is strict where git is lenient only in ways that refuse: a line git would accept but this
//! parser cannot read is refused, never let through. Bounds: at most [`MAX_PREAMBLE`] bytes
//! before the decision, [`MAX_COMMANDS`] commands, pkt-lines of at most 65,520 bytes (git's
//! own maximum), so memory is bounded whatever the body says.
//!
//! [`report`] builds the `application/x-git-receive-pack-result` body: `unpack ok` and one
//! `ng <ref> <reason>` per ref, side-band framed when the client asked for it, so `git push`
//! prints `! [remote rejected] main -> main (tryboxi: push to main is not allowed; ...)`.

use super::refs;

/// Bytes the screener reads before it must have decided.
pub const MAX_PREAMBLE: usize = 1 << 20;
/// Commands (ref updates) one push may carry.
pub const MAX_COMMANDS: usize = 10_000;
/// git's largest pkt-line, length prefix included (`LARGE_PACKET_MAX`).
pub const MAX_PKT: usize = 65_520;

/// One ref update of a push.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Command {
    pub old: String,
    pub new: String,
    pub name: String,
}

/// What the client said it understands (from the first command's `\0` list).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Capabilities(pub Vec<String>);

impl Capabilities {
    pub fn parse(list: &str) -> Capabilities {
        Capabilities(
            list.split(' ')
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect(),
        )
    }
    pub fn has(&self, name: &str) -> bool {
        self.0.iter().any(|c| c == name)
    }
    fn value(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find_map(|c| c.strip_prefix(name)?.strip_prefix('='))
    }
    /// Side-band framing the answer must use: `Some(max payload)` per pkt-line.
    fn sideband(&self) -> Option<usize> {
        if self.has("side-band-64k") {
            Some(MAX_PKT - 5)
        } else if self.has("side-band") {
            Some(1000 - 5)
        } else {
            None
        }
    }
}

/// One ref's line in a refusal report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefStatus {
    pub name: String,
    /// `None`: this ref was fine (it is refused with the push as a whole).
    pub reason: Option<String>,
}

/// A refused push: what to answer (see [`Rejection::report`]) and a message for events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    /// A one-line summary without values (for the event and the side-band message).
    pub message: String,
    /// Every ref of the push, in order; empty when the body was refused before its refs
    /// could be read (malformed, too large, a push certificate).
    pub refs: Vec<RefStatus>,
    pub capabilities: Capabilities,
}

impl Rejection {
    /// The `application/x-git-receive-pack-result` body to answer with (HTTP 200).
    pub fn report(&self) -> Vec<u8> {
        report(&self.message, &self.refs, &self.capabilities)
    }
}

/// The screener's answer so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Screen {
    /// Keep feeding (and keep holding the bytes fed so far).
    NeedMore,
    /// Every ref is allowed (or the body is git's empty probe): forward what was held and the
    /// rest of the body unread.
    Allow { commands: Vec<Command> },
    /// Answer with the rejection's report; forward nothing.
    Refuse(Rejection),
}

#[derive(Debug)]
enum State {
    Reading,
    Done(Screen),
}

/// Incremental `git-receive-pack` request screener (see the module docs).
#[derive(Debug)]
pub struct Screener {
    patterns: Vec<String>,
    state: State,
    /// The current pkt-line, header included (at most [`MAX_PKT`] bytes).
    pending: Vec<u8>,
    consumed: usize,
    commands: Vec<Command>,
    capabilities: Option<Capabilities>,
    hexsz: usize,
    saw_any: bool,
}

impl Screener {
    /// A screener for a push to a repository whose grant has these push patterns.
    pub fn new(patterns: Vec<String>) -> Screener {
        Screener {
            patterns,
            state: State::Reading,
            pending: Vec::new(),
            consumed: 0,
            commands: Vec::new(),
            capabilities: None,
            hexsz: 40,
            saw_any: false,
        }
    }

    /// Feeds the next chunk of the body. Once decided, the decision is returned again and
    /// further bytes are ignored.
    pub fn feed(&mut self, mut chunk: &[u8]) -> Screen {
        while let State::Reading = self.state {
            if chunk.is_empty() {
                return Screen::NeedMore;
            }
            self.saw_any = true;
            // Fill the header, then the rest of the line.
            let want = if self.pending.len() < 4 {
                4 - self.pending.len()
            } else {
                match pkt_len(&self.pending[..4]) {
                    Ok(n) => n - self.pending.len(),
                    Err(m) => return self.refuse(m),
                }
            };
            let take = want.min(chunk.len());
            if self.consumed + take > MAX_PREAMBLE {
                return self.refuse(format!(
                    "the push's command list is larger than {MAX_PREAMBLE} bytes"
                ));
            }
            self.pending.extend_from_slice(&chunk[..take]);
            self.consumed += take;
            chunk = &chunk[take..];
            if self.pending.len() < 4 {
                continue;
            }
            let len = match pkt_len(&self.pending[..4]) {
                Ok(n) => n,
                Err(m) => return self.refuse(m),
            };
            if self.pending.len() == len {
                let line = std::mem::take(&mut self.pending);
                self.line(&line);
            }
        }
        self.decision()
    }

    /// The body ended. An empty body or one of only `0000` (git's probe) is allowed; a body
    /// that ends inside the command list is refused.
    pub fn finish(&mut self) -> Screen {
        if let State::Reading = self.state {
            if !self.saw_any {
                self.state = State::Done(Screen::Allow { commands: vec![] });
            } else {
                return self.refuse("the push's command list ended early".into());
            }
        }
        self.decision()
    }

    fn decision(&self) -> Screen {
        match &self.state {
            State::Reading => Screen::NeedMore,
            State::Done(s) => s.clone(),
        }
    }

    fn refuse(&mut self, message: String) -> Screen {
        tracing::info!(reason = %message, "git push refused by the screener");
        self.state = State::Done(Screen::Refuse(Rejection {
            message: format!("tryboxi: {message}"),
            refs: vec![],
            capabilities: self.capabilities.clone().unwrap_or_default(),
        }));
        self.decision()
    }

    /// One whole pkt-line (header included).
    fn line(&mut self, pkt: &[u8]) {
        if pkt.len() == 4 {
            // `0000`: the end of the command list (`0001`/`0002` were refused by pkt_len).
            self.decided();
            return;
        }
        let mut data = &pkt[4..];
        if let Some(d) = data.strip_suffix(b"\n") {
            data = d;
        }
        if data.starts_with(b"shallow ") {
            let oid = &data[8..];
            if !is_hex(oid) || (oid.len() != 40 && oid.len() != 64) {
                self.refuse("a malformed shallow line".into());
            }
            return;
        }
        let (cmd, caps) = match data.iter().position(|&b| b == 0) {
            Some(i) => (&data[..i], Some(&data[i + 1..])),
            None => (data, None),
        };
        match (caps, self.capabilities.is_some(), self.commands.is_empty()) {
            (Some(c), false, true) => {
                let c = Capabilities::parse(&String::from_utf8_lossy(c));
                self.hexsz = match c.value("object-format") {
                    None | Some("sha1") => 40,
                    Some("sha256") => 64,
                    Some(_) => {
                        self.capabilities = Some(c);
                        self.refuse("an unknown object format".into());
                        return;
                    }
                };
                self.capabilities = Some(c);
            }
            (None, _, _) => {}
            _ => {
                self.refuse("capabilities after the first command".into());
                return;
            }
        }
        if cmd.starts_with(b"push-cert") {
            self.refuse("signed pushes (push certificates) are not supported".into());
            return;
        }
        if self.commands.len() >= MAX_COMMANDS {
            self.refuse(format!("a push of more than {MAX_COMMANDS} refs"));
            return;
        }
        let h = self.hexsz;
        let ok = cmd.len() > 2 * h + 2
            && cmd[h] == b' '
            && cmd[2 * h + 1] == b' '
            && is_hex(&cmd[..h])
            && is_hex(&cmd[h + 1..2 * h + 1]);
        let name = std::str::from_utf8(cmd.get(2 * h + 2..).unwrap_or_default());
        match (ok, name) {
            (true, Ok(name)) => self.commands.push(Command {
                old: String::from_utf8_lossy(&cmd[..h]).into_owned(),
                new: String::from_utf8_lossy(&cmd[h + 1..2 * h + 1]).into_owned(),
                name: name.to_owned(),
            }),
            _ => {
                self.refuse("a malformed command line".into());
            }
        }
    }

    /// The command list is complete: decide every ref, all-or-nothing.
    fn decided(&mut self) {
        let commands = std::mem::take(&mut self.commands);
        let reasons: Vec<Option<String>> = commands
            .iter()
            .map(|c| refs::check_ref(&self.patterns, &c.name).err())
            .collect();
        let bad = reasons.iter().filter(|r| r.is_some()).count();
        if bad == 0 {
            tracing::debug!(refs = commands.len(), "git push allowed");
            self.state = State::Done(Screen::Allow { commands });
            return;
        }
        let first = reasons.iter().flatten().next().cloned().unwrap_or_default();
        let message = if bad == 1 {
            first
        } else {
            format!("{first} (and {} more refused refs)", bad - 1)
        };
        tracing::info!(refs = commands.len(), refused = bad, "git push refused");
        let refs = commands
            .into_iter()
            .zip(reasons)
            .map(|(c, reason)| RefStatus {
                name: c.name,
                reason,
            })
            .collect();
        self.state = State::Done(Screen::Refuse(Rejection {
            message,
            refs,
            capabilities: self.capabilities.clone().unwrap_or_default(),
        }));
    }
}

fn is_hex(b: &[u8]) -> bool {
    b.iter().all(u8::is_ascii_hexdigit)
}

/// A pkt-line's total length from its 4-byte header: 0 and 4.. are lines (0 = flush, kept as
/// 4 bytes); delim/response-end and bad lengths are errors here.
fn pkt_len(h: &[u8]) -> Result<usize, String> {
    let s = std::str::from_utf8(h).map_err(|_| "a malformed pkt-line length".to_string())?;
    if !is_hex(h) {
        return Err("a malformed pkt-line length".into());
    }
    match usize::from_str_radix(s, 16) {
        Ok(0) => Ok(4),
        Ok(n) if (5..=MAX_PKT).contains(&n) => Ok(n),
        Ok(n) if n > MAX_PKT => Err("a pkt-line longer than git allows".into()),
        _ => Err("an unexpected pkt-line (empty, delim or response-end)".into()),
    }
}

/// One pkt-line holding `data` (`data` at most `MAX_PKT - 4` bytes).
pub fn pkt(data: &[u8]) -> Vec<u8> {
    let mut v = format!("{:04x}", data.len() + 4).into_bytes();
    v.extend_from_slice(data);
    v
}

/// Keeps a text on one line and within `max` bytes (a pkt-line holds 65,516).
fn one_line(s: &str, max: usize) -> String {
    let s: String = s
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

/// A receive-pack result body refusing a push (see the module docs): `refs` non-empty gives
/// `unpack ok` and `ng <ref> <reason>` per ref (a ref without its own reason is refused with
/// the push as a whole); `refs` empty gives `unpack <message>`. With `side-band(-64k)` the
/// report goes in band 1, preceded by `message` in band 2 (git prints it as `remote: ...`).
/// Without `report-status(-v2)` the client reads no report: only the band-2 message is sent.
pub fn report(message: &str, refs: &[RefStatus], caps: &Capabilities) -> Vec<u8> {
    let message = one_line(message, 1000);
    let mut status = Vec::new();
    if caps.has("report-status") || caps.has("report-status-v2") {
        if refs.is_empty() {
            status.extend(pkt(format!("unpack {message}\n").as_bytes()));
        } else {
            status.extend(pkt(b"unpack ok\n"));
            for r in refs {
                let reason = match &r.reason {
                    Some(m) => one_line(m, 300),
                    None => "tryboxi: refused with the rest of the push".into(),
                };
                let name = one_line(&r.name, 60_000);
                status.extend(pkt(format!("ng {name} {reason}\n").as_bytes()));
            }
        }
        status.extend(b"0000");
    }
    let Some(max) = caps.sideband() else {
        return status;
    };
    let mut out = pkt(format!("\x02{message}\n").as_bytes());
    for part in status.chunks(max) {
        let mut band = vec![1u8];
        band.extend_from_slice(part);
        out.extend(pkt(&band));
    }
    out.extend(b"0000");
    out
}
