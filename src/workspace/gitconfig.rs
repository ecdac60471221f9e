//! Sanitizing git config files before they go into a VM: `.git/config`, the configs of
//! submodules (`.git/modules/**/config`), of nested repositories (`**/.git/config`), worktree
//! configs (`config.worktree`) and the `config` of a bare repository in the tree.
//!
//! Removed, because they carry a secret or name a command (which would hold inline secrets,
//! and must not run host tools in the VM):
//! - whole sections: `credential` (helpers, user names), `include`/`includeIf` (they pull in
//!   files the VM must not see), `filter` (clean/smudge/process commands), `pager`, `gpg`
//!   (signing programs and key commands), `sendemail` (`smtpPass`, `smtpServer` may be a
//!   program, `toCmd`, `ccCmd`), `imap` (`pass`, `tunnel`), `difftool`/`mergetool` (`cmd`),
//!   `browser`, `man`, `instaweb`, `web`;
//! - keys in any subsection: `core.askPass`, `core.sshCommand`, `core.fsmonitor`,
//!   `core.hooksPath`, `core.editor`, `core.pager`, `core.gitProxy`,
//!   `core.alternateRefsCommand`, `http.extraHeader`, `http.cookieFile`, `http.sslKey`,
//!   `http.sslCert`, `http.proxySSLKey`, `http.proxySSLCert`, `diff.external`,
//!   `diff.<driver>.command`/`textconv`, `merge.<driver>.driver`, `sequence.editor`,
//!   `remote.<name>.uploadpack`/`receivepack`, `trailer.<token>.command`/`cmd`,
//!   `uploadpack.packObjectsHook`;
//! - any key whose name says it is a secret (`*password*`, `*passwd*`, `*token*`,
//!   `*secret*`, `*apikey*`, `*api-key*`, `*pass`), shell aliases (`alias.x = !cmd`) and
//!   `submodule.<name>.update = !cmd`;
//! - user info in every URL, in values and in section headers (`[url "https://u:T@h/"]`).
//!
//! A removed value's continuation lines (a line ending in `\`) go with it. Everything else
//! (remotes, branches, core settings) is kept so `git status`/`log`/`diff` work in the VM.
//! [`sanitize`] is pure text in, text out; [`is_git_config`] only stats the host tree.

use std::path::Path;

/// Section names (lower case, before any subsection) dropped entirely.
const DROPPED_SECTIONS: &[&str] = &[
    "credential",
    "include",
    "includeif",
    "filter",
    "pager",
    "gpg",
    "sendemail",
    "imap",
    "difftool",
    "mergetool",
    "browser",
    "man",
    "instaweb",
    "web",
];

/// `section.key` pairs (lower case) dropped wherever they appear (any subsection).
const DROPPED_KEYS: &[(&str, &str)] = &[
    ("core", "askpass"),
    ("core", "sshcommand"),
    ("core", "fsmonitor"),
    ("core", "hookspath"),
    ("core", "editor"),
    ("core", "pager"),
    ("core", "gitproxy"),
    ("core", "alternaterefscommand"),
    ("http", "extraheader"),
    ("http", "cookiefile"),
    ("http", "sslkey"),
    ("http", "sslcert"),
    ("http", "proxysslkey"),
    ("http", "proxysslcert"),
    ("diff", "external"),
    ("diff", "command"),
    ("diff", "textconv"),
    ("merge", "driver"),
    ("sequence", "editor"),
    ("remote", "uploadpack"),
    ("remote", "receivepack"),
    ("trailer", "command"),
    ("trailer", "cmd"),
    ("uploadpack", "packobjectshook"),
];

/// A key whose name says it holds a secret (any section).
fn secret_key(key: &str) -> bool {
    ["password", "passwd", "token", "secret", "apikey", "api-key"]
        .iter()
        .any(|w| key.contains(w))
        || key.ends_with("pass")
}

/// Whether `rel` (a host file of the synced tree) is a git config file to sanitize: a
/// `config` or `config.worktree` inside a `.git` directory (any depth: submodules, nested
/// repos, worktrees), or the `config` of a directory laid out as a bare repository.
pub fn is_git_config(root: &Path, rel: &str) -> bool {
    let (dir, name) = rel.rsplit_once('/').unwrap_or(("", rel));
    if name != "config" && name != "config.worktree" {
        return false;
    }
    if dir.split('/').any(super::gitmeta::is_dotgit_name) {
        return true;
    }
    let d = root.join(dir);
    let has = |n: &str| std::fs::symlink_metadata(d.join(n)).is_ok();
    has("HEAD") && ((has("objects") && has("refs")) || has("commondir"))
}

/// Whether a config line's value goes on to the next line (ends in an unescaped `\`).
fn continues(line: &str) -> bool {
    let n = line.len() - line.trim_end_matches('\\').len();
    n % 2 == 1
}

/// End of a section header starting at `t[0] == '['`: the index of its `]` (after a quoted
/// subsection, which may hold `]`), or `t.len()` if there is none.
fn header_end(t: &str) -> usize {
    let b = t.as_bytes();
    let mut i = 1;
    let mut quoted = false;
    while i < b.len() {
        match b[i] {
            b'\\' if quoted => i += 1,
            b'"' => quoted = !quoted,
            b']' if !quoted => return i,
            _ => {}
        }
        i += 1;
    }
    t.len()
}

/// Return `config` with credentials, commands and includes removed.
pub fn sanitize(config: &str) -> String {
    let mut out = String::with_capacity(config.len());
    let mut section = String::new();
    let mut drop_section = false;
    // Inside a multi-line value: whether its lines are dropped.
    let mut continuing: Option<bool> = None;
    for line in config.lines() {
        if let Some(dropping) = continuing {
            continuing = continues(line).then_some(dropping);
            if !dropping {
                out.push_str(&strip_url_credentials(line));
                out.push('\n');
            }
            continue;
        }
        let t = line.trim_start();
        if t.starts_with('[') {
            // `[name]`, `[name "sub"]` or the old `[name.sub]`; a key may follow on the same line.
            let end = header_end(t);
            let head = &t[1..end];
            section = head
                .split(|c: char| c.is_whitespace() || c == '.' || c == '"')
                .next()
                .unwrap_or("")
                .to_ascii_lowercase();
            drop_section = DROPPED_SECTIONS.contains(&section.as_str());
            let rest = t.get(end + 1..).unwrap_or("").trim();
            if drop_section {
                continuing = continues(rest).then_some(true);
                continue;
            }
            out.push_str(&strip_url_credentials(&t[..(end + 1).min(t.len())]));
            out.push('\n');
            if !rest.is_empty() {
                let (l, more) = sanitize_key_line(&section, rest);
                continuing = more;
                if let Some(l) = l {
                    out.push_str(&l);
                    out.push('\n');
                }
            }
            continue;
        }
        if drop_section {
            continuing = continues(line).then_some(true);
            continue;
        }
        if t.is_empty() || t.starts_with('#') || t.starts_with(';') {
            out.push_str(line);
            out.push('\n');
            continue;
        }
        let (l, more) = sanitize_key_line(&section, line);
        continuing = more;
        if let Some(l) = l {
            out.push_str(&l);
            out.push('\n');
        }
    }
    out
}

/// The line to keep (if any) and, when the value continues on the next line, whether the
/// continuation is dropped.
fn sanitize_key_line(section: &str, line: &str) -> (Option<String>, Option<bool>) {
    let t = line.trim_start();
    let key = t
        .split(|c: char| c == '=' || c.is_whitespace())
        .next()
        .unwrap_or("")
        .to_ascii_lowercase();
    let value = t
        .split_once('=')
        .map(|(_, v)| v.trim_start().trim_start_matches('"'))
        .unwrap_or("");
    let drop = DROPPED_KEYS.contains(&(section, key.as_str()))
        || secret_key(&key)
        || (section == "alias" && value.starts_with('!'))
        || (section == "submodule" && key == "update" && value.starts_with('!'));
    let more = continues(line).then_some(drop);
    if drop {
        return (None, more);
    }
    (Some(strip_url_credentials(line)), more)
}

/// `https://user:token@host/x` -> `https://host/x` (anywhere in the line). For http(s) any
/// user info goes (tokens are often the user name); for other schemes (`ssh://git@host`) only
/// a `user:password` pair.
pub fn strip_url_credentials(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut rest = line;
    while let Some(i) = rest.find("://") {
        let (before, after) = rest.split_at(i + 3);
        out.push_str(before);
        let scheme: String = before[..i]
            .chars()
            .rev()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '+' || *c == '-')
            .collect::<String>()
            .chars()
            .rev()
            .collect::<String>()
            .to_ascii_lowercase();
        let end = after
            .find(|c: char| c == '/' || c.is_whitespace() || c == '"')
            .unwrap_or(after.len());
        let authority = &after[..end];
        match authority.rfind('@') {
            Some(at)
                if scheme.starts_with("http")
                    || scheme.starts_with("ftp")
                    || authority[..at].contains(':') =>
            {
                out.push_str(&authority[at + 1..])
            }
            _ => out.push_str(authority),
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
#[path = "gitconfig_tests.rs"]
mod tests;
