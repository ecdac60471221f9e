//! Sanitizing `.git/config` before it goes into a VM.
//!
//! Removed: `[credential]` sections (helpers, usernames), `http.extraHeader` and
//! `http.<url>.extraHeader` (auth headers), `[include]`/`[includeIf]` (they pull in files the
//! VM must not see), `core.askPass`, `core.sshCommand`, and user:password in URLs. Everything
//! else (remotes, branches, core settings) is kept so `git status`/`log`/`diff` work in the VM.
//! Pure text in, text out; never reads other files.

/// Section names (lower case, before any subsection) dropped entirely.
const DROPPED_SECTIONS: &[&str] = &["credential", "include", "includeif"];

/// `section.key` pairs (lower case) dropped wherever they appear (any subsection).
const DROPPED_KEYS: &[(&str, &str)] = &[
    ("http", "extraheader"),
    ("core", "askpass"),
    ("core", "sshcommand"),
];

/// Return `config` with credentials and includes removed.
pub fn sanitize(config: &str) -> String {
    let mut out = String::with_capacity(config.len());
    let mut section = String::new();
    let mut drop_section = false;
    for line in config.lines() {
        let t = line.trim_start();
        if t.starts_with('[') {
            // `[name]`, `[name "sub"]` or the old `[name.sub]`; a key may follow on the same line.
            let end = t.find(']').unwrap_or(t.len());
            let head = &t[1..end];
            let name = head
                .split(|c: char| c.is_whitespace() || c == '.' || c == '"')
                .next()
                .unwrap_or("")
                .to_ascii_lowercase();
            section = name;
            drop_section = DROPPED_SECTIONS.contains(&section.as_str());
            if !drop_section {
                out.push_str(&t[..(end + 1).min(t.len())]);
                out.push('\n');
                let rest = t.get(end + 1..).unwrap_or("").trim();
                if !rest.is_empty()
                    && let Some(l) = sanitize_key_line(&section, rest)
                {
                    out.push_str(&l);
                    out.push('\n');
                }
            }
            continue;
        }
        if drop_section {
            continue;
        }
        if t.is_empty() || t.starts_with('#') || t.starts_with(';') {
            out.push_str(line);
            out.push('\n');
            continue;
        }
        if let Some(l) = sanitize_key_line(&section, line) {
            out.push_str(&l);
            out.push('\n');
        }
    }
    out
}

fn sanitize_key_line(section: &str, line: &str) -> Option<String> {
    let key = line
        .trim_start()
        .split(|c: char| c == '=' || c.is_whitespace())
        .next()
        .unwrap_or("")
        .to_ascii_lowercase();
    if DROPPED_KEYS.contains(&(section, key.as_str())) {
        return None;
    }
    Some(strip_url_credentials(line))
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
mod tests {
    use super::*;

    #[test]
    fn credentials_headers_and_includes_are_removed_and_the_rest_kept() {
        let input = r#"[core]
	repositoryformatversion = 0
	sshCommand = ssh -i ~/.ssh/deploy
	askpass = /usr/bin/secret-askpass
[remote "origin"]
	url = https://alice:ghp_SECRET@github.com/acme/app.git
	fetch = +refs/heads/*:refs/remotes/origin/*
[credential]
	helper = store
[credential "https://github.com"]
	username = alice
[http "https://github.com/"]
	extraheader = AUTHORIZATION: basic c2VjcmV0
	sslVerify = true
[http]
	extraHeader = Authorization: Bearer xyz
[include]
	path = ~/.gitconfig-secrets
[includeIf "gitdir:~/work/"]
	path = ~/.gitconfig-work
[branch "main"]
	remote = origin
"#;
        let out = sanitize(input);
        for gone in [
            "SECRET",
            "alice",
            "helper",
            "extraheader",
            "extraHeader",
            "gitconfig-secrets",
            "gitconfig-work",
            "sshCommand",
            "askpass",
            "[credential",
            "[include",
        ] {
            assert!(!out.contains(gone), "`{gone}` survived:\n{out}");
        }
        for kept in [
            "repositoryformatversion = 0",
            "url = https://github.com/acme/app.git",
            "fetch = +refs/heads/*:refs/remotes/origin/*",
            "sslVerify = true",
            "[branch \"main\"]",
            "remote = origin",
        ] {
            assert!(out.contains(kept), "`{kept}` lost:\n{out}");
        }
    }

    #[test]
    fn url_without_credentials_is_unchanged() {
        assert_eq!(
            strip_url_credentials("url = git@github.com:a/b.git"),
            "url = git@github.com:a/b.git"
        );
        assert_eq!(
            strip_url_credentials("url = ssh://git@host/x"),
            "url = ssh://git@host/x"
        );
        assert_eq!(
            strip_url_credentials("url = ssh://git:pw@host/x"),
            "url = ssh://host/x"
        );
        assert_eq!(
            strip_url_credentials("url = https://TOKEN@host/x"),
            "url = https://host/x"
        );
        assert_eq!(strip_url_credentials("x = https://h/p"), "x = https://h/p");
    }
}
