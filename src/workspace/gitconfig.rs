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
//! Lines are grouped into entries as git reads them: a value goes on to the next line when it
//! ends in an unescaped `\\` outside a comment (`#`/`;` outside double quotes end the value at
//! the end of their line), and a removed value's continuation lines go with it. A value whose
//! decoded text holds a URL with credentials is written back on one line without them. From
//! the first line git could not parse (it would refuse the file), the rest is left out. Everything else
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

/// End of a section header starting at `t[0] == '['`: the index of its `]` (after a quoted
/// subsection, which may hold `]`), or `None` if there is none (git refuses such a file).
fn header_end(t: &str) -> Option<usize> {
    let b = t.as_bytes();
    let mut i = 1;
    let mut quoted = false;
    while i < b.len() {
        match b[i] {
            b'\\' if quoted => i += 1,
            b'"' => quoted = !quoted,
            b']' if !quoted => return Some(i),
            _ => {}
        }
        i += 1;
    }
    None
}

/// What replaces everything from the first line git itself could not parse: git refuses the
/// whole file, so nothing after that point is useful in the VM, and nothing unvetted goes.
const UNPARSED: &str = "# tryboxi: the rest of this file was left out (git cannot parse it)\n";

/// A comment line, a blank line or a comment after a section header.
fn is_comment(t: &str) -> bool {
    t.is_empty() || t.starts_with('#') || t.starts_with(';')
}

/// One `key [= value]` entry read as git reads it: the key (as written) and its value
/// decoded (`None` for a bare boolean key), and how many continuation lines it took.
struct KeyEntry<'a> {
    key: &'a str,
    value: Option<String>,
    extra_lines: usize,
}

/// Read the entry starting at `first` (the key at its start), continued on `following` lines
/// when a value ends in an unescaped `\` (outside a comment). Like git's `parse_value`: `#`
/// and `;` outside double quotes start a comment that ends the value at the end of its line
/// (a `\` there does not continue it); quotes may hold `#`/`;` and go on over continuations;
/// `\\`, `\"`, `\t`, `\b`, `\n` are escapes, any other escape is an error. `None`: git would
/// refuse the file here.
fn read_entry<'a>(first: &'a str, following: &[&str]) -> Option<KeyEntry<'a>> {
    let key_len = first
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
        .unwrap_or(first.len());
    let key = &first[..key_len];
    if !key.starts_with(|c: char| c.is_ascii_alphabetic()) {
        return None;
    }
    let after = first[key_len..].trim_start_matches([' ', '\t']);
    if after.is_empty() {
        return Some(KeyEntry {
            key,
            value: None,
            extra_lines: 0,
        });
    }
    let mut line = after.strip_prefix('=')?;
    let (mut value, mut quoted, mut space, mut extra_lines) = (String::new(), false, 0, 0);
    loop {
        let mut continued = false;
        let mut chars = line.chars();
        while let Some(c) = chars.next() {
            if !quoted && matches!(c, ' ' | '\t' | '\r') {
                if !value.is_empty() {
                    space += 1;
                }
                continue;
            }
            if !quoted && (c == '#' || c == ';') {
                break; // a comment: the rest of this line, never continued
            }
            value.extend(std::iter::repeat_n(' ', space));
            space = 0;
            match c {
                '\\' => match chars.next() {
                    None => {
                        continued = true;
                        break;
                    }
                    Some('t') => value.push('\t'),
                    Some('b') => value.push('\u{8}'),
                    Some('n') => value.push('\n'),
                    Some(e @ ('\\' | '"')) => value.push(e),
                    Some(_) => return None,
                },
                '"' => quoted = !quoted,
                c => value.push(c),
            }
        }
        match following.get(extra_lines).filter(|_| continued) {
            Some(next) => {
                line = next;
                extra_lines += 1;
            }
            // A quote still open at the end of the value: git refuses the file.
            None if quoted => return None,
            None => {
                return Some(KeyEntry {
                    key,
                    value: Some(value),
                    extra_lines,
                });
            }
        }
    }
}

/// `v` as a double-quoted git config value.
fn quote(v: &str) -> String {
    let mut out = String::with_capacity(v.len() + 2);
    out.push('"');
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Return `config` with credentials, commands and includes removed.
pub fn sanitize(config: &str) -> String {
    let lines: Vec<&str> = config.lines().collect();
    let mut out = String::with_capacity(config.len());
    let mut section = String::new();
    let mut drop_section = false;
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let t = line.trim_start();
        if is_comment(t) {
            if !drop_section {
                out.push_str(&strip_url_credentials(line));
                out.push('\n');
            }
            i += 1;
            continue;
        }
        // The entry's first line as it is kept (indentation and all).
        let mut first = line;
        if t.starts_with('[') {
            // `[name]`, `[name "sub"]` or the old `[name.sub]`; a key may follow on the same line.
            let Some(end) = header_end(t) else {
                out.push_str(UNPARSED);
                break;
            };
            let head = &t[1..end];
            section = head
                .split(|c: char| c.is_whitespace() || c == '.' || c == '"')
                .next()
                .unwrap_or("")
                .to_ascii_lowercase();
            drop_section = DROPPED_SECTIONS.contains(&section.as_str());
            if !drop_section {
                out.push_str(&strip_url_credentials(&t[..=end]));
                out.push('\n');
            }
            first = t[end + 1..].trim_start();
            if is_comment(first) {
                i += 1;
                continue;
            }
        }
        let Some(entry) = read_entry(first.trim_start(), &lines[i + 1..]) else {
            out.push_str(UNPARSED);
            break;
        };
        let rest = &lines[i + 1..i + 1 + entry.extra_lines];
        i += 1 + entry.extra_lines;
        if drop_section || drops(&section, &entry) {
            continue;
        }
        let kept: Vec<String> = std::iter::once(&first)
            .chain(rest)
            .map(|l| strip_url_credentials(l))
            .collect();
        // The value as git reads the kept lines must hold no credentials either (a URL split
        // over a continuation, or escaped): else it is written back on one line without them.
        let still = |v: &str| strip_url_credentials(v) != v;
        let refs: Vec<&str> = kept.iter().map(String::as_str).collect();
        let reread = read_entry(refs[0].trim_start(), &refs[1..]);
        // Kept lines that no longer parse are written back on one line too.
        let clean = reread.is_some_and(|e| e.value.is_none_or(|a| !still(&a)));
        match entry.value.as_deref() {
            Some(v) if still(v) && !clean => {
                out.push_str(&format!(
                    "\t{} = {}\n",
                    entry.key,
                    quote(&strip_url_credentials(v))
                ));
            }
            _ => {
                for l in kept {
                    out.push_str(&l);
                    out.push('\n');
                }
            }
        }
    }
    out
}

/// Whether the entry is dropped in `section` (lower case).
fn drops(section: &str, entry: &KeyEntry) -> bool {
    let key = entry.key.to_ascii_lowercase();
    let value = entry.value.as_deref().unwrap_or("");
    DROPPED_KEYS.contains(&(section, key.as_str()))
        || secret_key(&key)
        || (section == "alias" && value.starts_with('!'))
        || (section == "submodule" && key == "update" && value.starts_with('!'))
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
