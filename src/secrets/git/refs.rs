//! Push patterns: which refs a grant's `--push` patterns let a push update.
//!
//! Syntax (checked by [`validate_pattern`] when a grant is made; an invalid pattern matches
//! nothing):
//! - a pattern names refs by `/`-separated segments; one without a `refs/` prefix is a branch
//!   pattern (`agent/*` means `refs/heads/agent/*`); tags and every other namespace need an
//!   explicit `refs/...` pattern (`refs/tags/v*`);
//! - `*` inside a segment matches any run of characters other than `/` (`agent/*` matches
//!   `agent/x`, not `agent/x/y`; `fix-*` matches `fix-1`);
//! - `**` as the whole last segment matches one or more segments (`agent/**` matches
//!   `agent/x` and `agent/x/y`, not `agent` itself); `**` anywhere else is invalid;
//! - a pattern starting with `!` denies what it matches, and a deny wins over every allow.
//!
//! No `?`, no character classes. Matching is case-sensitive, as git ref names are.
//! Only well-formed ref names ([`ref_name_ok`], a strict subset of `git check-ref-format`) are
//! ever allowed, so `refs/heads/agent/../main` cannot sneak through a pattern.

/// Why a pattern is invalid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PatternError {
    #[error("empty push pattern")]
    Empty,
    #[error("push pattern {0:?}: empty segment, `.` or `..`")]
    BadSegment(String),
    #[error("push pattern {0:?}: `**` must be the whole last segment")]
    BadDoubleStar(String),
    #[error("push pattern {0:?}: characters git does not allow in ref names")]
    BadChar(String),
}

/// Checks a push pattern's syntax (see the module docs).
pub fn validate_pattern(pattern: &str) -> Result<(), PatternError> {
    let body = pattern.strip_prefix('!').unwrap_or(pattern);
    if body.is_empty() {
        return Err(PatternError::Empty);
    }
    if body
        .bytes()
        .any(|b| b < 0x20 || b == 0x7f || b" ~^:?[\\".contains(&b))
    {
        return Err(PatternError::BadChar(pattern.to_owned()));
    }
    let segs: Vec<&str> = body.split('/').collect();
    for (i, s) in segs.iter().enumerate() {
        if s.is_empty() || *s == "." || *s == ".." {
            return Err(PatternError::BadSegment(pattern.to_owned()));
        }
        if s.contains("**") && (*s != "**" || i + 1 != segs.len()) {
            return Err(PatternError::BadDoubleStar(pattern.to_owned()));
        }
    }
    Ok(())
}

/// `name` is a well-formed ref name under `refs/` (a strict subset of `git check-ref-format`):
/// at least `refs/x/y`, no empty, `.`-leading or `.lock`-ending segment, no `..`, `@{`,
/// control characters, space, `~^:?*[\`, no trailing `.`.
pub fn ref_name_ok(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("refs/") else {
        return false;
    };
    if name.contains("..")
        || name.contains("@{")
        || name.ends_with('.')
        || name
            .bytes()
            .any(|b| b <= 0x20 || b == 0x7f || b"~^:?*[\\".contains(&b))
    {
        return false;
    }
    let segs: Vec<&str> = rest.split('/').collect();
    segs.len() >= 2
        && segs
            .iter()
            .all(|s| !s.is_empty() && !s.starts_with('.') && !s.ends_with(".lock"))
}

/// `*` within one segment (no `/` in `seg` or `pat`): greedy match with backtracking to the
/// last star, O(len(seg) * stars).
fn segment_matches(pat: &[u8], seg: &[u8]) -> bool {
    let (mut p, mut s) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while s < seg.len() {
        if p < pat.len() && pat[p] == b'*' {
            star = Some((p, s));
            p += 1;
        } else if p < pat.len() && pat[p] == seg[s] {
            p += 1;
            s += 1;
        } else if let Some((sp, ss)) = star {
            p = sp + 1;
            s = ss + 1;
            star = Some((sp, ss + 1));
        } else {
            return false;
        }
    }
    pat[p..].iter().all(|&c| c == b'*')
}

/// The full ref pattern a push pattern (without its `!`) stands for.
fn full_pattern(pattern: &str) -> String {
    if pattern.starts_with("refs/") {
        pattern.to_owned()
    } else {
        format!("refs/heads/{pattern}")
    }
}

/// One pattern (without its `!`) matches the well-formed ref `name`.
pub fn pattern_matches(pattern: &str, name: &str) -> bool {
    if validate_pattern(pattern).is_err() || !ref_name_ok(name) {
        return false;
    }
    let full = full_pattern(pattern);
    let pats: Vec<&str> = full.split('/').collect();
    let segs: Vec<&str> = name.split('/').collect();
    if pats.last() == Some(&"**") {
        let fixed = pats.len() - 1;
        return segs.len() > fixed
            && pats[..fixed]
                .iter()
                .zip(&segs)
                .all(|(p, s)| segment_matches(p.as_bytes(), s.as_bytes()));
    }
    pats.len() == segs.len()
        && pats
            .iter()
            .zip(&segs)
            .all(|(p, s)| segment_matches(p.as_bytes(), s.as_bytes()))
}

/// The short name git prints for a ref (`refs/heads/main` -> `main`, `refs/tags/v1` -> `v1`).
pub fn short_name(name: &str) -> &str {
    name.strip_prefix("refs/heads/")
        .or_else(|| name.strip_prefix("refs/tags/"))
        .unwrap_or(name)
}

/// Decides one ref against a grant's patterns: `Ok` if an allow pattern matches and no `!`
/// pattern does; otherwise the reason git will print after `[remote rejected]`.
pub fn check_ref(patterns: &[String], name: &str) -> Result<(), String> {
    let allowed = patterns.iter().filter(|p| !p.starts_with('!'));
    let listed = allowed.clone().cloned().collect::<Vec<_>>().join(", ");
    let shown = short_name(name);
    if !ref_name_ok(name) {
        return Err(format!("tryboxi: {shown:?} is not a valid ref name"));
    }
    if let Some(deny) = patterns
        .iter()
        .filter_map(|p| p.strip_prefix('!'))
        .find(|p| pattern_matches(p, name))
    {
        return Err(format!(
            "tryboxi: push to {shown} is not allowed (denied by !{deny}); allowed: {listed}"
        ));
    }
    if allowed.clone().any(|p| pattern_matches(p, name)) {
        return Ok(());
    }
    if listed.is_empty() {
        return Err("tryboxi: pushes are not allowed for this repository".into());
    }
    Err(format!(
        "tryboxi: push to {shown} is not allowed; allowed: {listed}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pats(p: &[&str]) -> Vec<String> {
        p.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_branch_pattern_matches_within_one_segment() {
        assert!(pattern_matches("agent/*", "refs/heads/agent/x"));
        assert!(pattern_matches("agent/*", "refs/heads/agent/fix-1.2"));
        assert!(!pattern_matches("agent/*", "refs/heads/agent/x/y"));
        assert!(!pattern_matches("agent/*", "refs/heads/agent"));
        assert!(!pattern_matches("agent/*", "refs/heads/agentx/y"));
        assert!(!pattern_matches("agent/*", "refs/tags/agent/x"));
        assert!(!pattern_matches("agent/*", "refs/heads/main"));
        assert!(pattern_matches("fix-*-ok", "refs/heads/fix-12-ok"));
        assert!(pattern_matches("fix-*-ok", "refs/heads/fix--ok"));
        assert!(!pattern_matches("fix-*-ok", "refs/heads/fix-12-okay"));
        assert!(pattern_matches("a*b*c", "refs/heads/aXbYbZc"));
        assert!(!pattern_matches("a*b*c", "refs/heads/aXbYbZ"));
        assert!(pattern_matches("main", "refs/heads/main"));
        assert!(!pattern_matches("main", "refs/heads/Main"));
        assert!(!pattern_matches("main", "refs/heads/main2"));
    }

    #[test]
    fn double_star_matches_one_or_more_trailing_segments() {
        assert!(pattern_matches("agent/**", "refs/heads/agent/x"));
        assert!(pattern_matches("agent/**", "refs/heads/agent/x/y/z"));
        assert!(!pattern_matches("agent/**", "refs/heads/agent"));
        assert!(!pattern_matches("agent/**/x", "refs/heads/agent/a/x"));
        assert!(validate_pattern("agent/**/x").is_err());
        assert!(validate_pattern("agent/a**").is_err());
    }

    #[test]
    fn other_namespaces_need_an_explicit_refs_pattern() {
        assert!(!pattern_matches("*", "refs/tags/v1"));
        assert!(pattern_matches("*", "refs/heads/v1"));
        assert!(pattern_matches("refs/tags/v*", "refs/tags/v1"));
        assert!(!pattern_matches("refs/tags/v*", "refs/heads/v1"));
        assert!(!pattern_matches("**", "refs/notes/x"));
        assert!(pattern_matches("refs/**", "refs/notes/commits"));
    }

    #[test]
    fn malformed_ref_names_never_match() {
        for bad in [
            "refs/heads/agent/../main",
            "refs/heads/agent//x",
            "refs/heads/agent/.x",
            "refs/heads/agent/x.lock",
            "refs/heads/agent/x.",
            "refs/heads/agent/x@{1}",
            "refs/heads/agent/x y",
            "refs/heads/agent/x\ny",
            "refs/heads/agent/x~1",
            "refs/heads/agent/",
            "refs/heads",
            "HEAD",
            "heads/agent/x",
        ] {
            assert!(!ref_name_ok(bad), "{bad:?}");
            assert!(!pattern_matches("agent/**", bad), "{bad:?}");
            assert!(!pattern_matches("refs/**", bad), "{bad:?}");
            assert!(check_ref(&pats(&["refs/**"]), bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn deny_wins_over_allow() {
        let p = pats(&["agent/**", "!agent/release/*"]);
        assert!(check_ref(&p, "refs/heads/agent/x").is_ok());
        assert!(check_ref(&p, "refs/heads/agent/release/x/y").is_ok());
        let e = check_ref(&p, "refs/heads/agent/release/1").unwrap_err();
        assert!(e.contains("denied by !agent/release/*"), "{e}");
        // A deny alone allows nothing.
        assert!(check_ref(&pats(&["!main"]), "refs/heads/x").is_err());
    }

    #[test]
    fn the_reason_names_the_branch_and_the_allowed_patterns() {
        let e = check_ref(&pats(&["agent/*"]), "refs/heads/main").unwrap_err();
        assert_eq!(e, "tryboxi: push to main is not allowed; allowed: agent/*");
        let e = check_ref(&[], "refs/heads/agent/x").unwrap_err();
        assert!(e.contains("not allowed for this repository"), "{e}");
        assert_eq!(short_name("refs/tags/v1"), "v1");
        assert_eq!(short_name("refs/notes/x"), "refs/notes/x");
    }

    #[test]
    fn invalid_patterns_are_reported_and_match_nothing() {
        for bad in [
            "",
            "!",
            "agent//x",
            "agent/../x",
            "./x",
            "a b",
            "a:b",
            "a[b]",
            "a\\b",
        ] {
            assert!(validate_pattern(bad).is_err(), "{bad:?}");
            assert!(!pattern_matches(bad, "refs/heads/a"), "{bad:?}");
        }
        for good in ["agent/*", "!agent/x", "refs/tags/v*", "main", "agent/**"] {
            assert_eq!(validate_pattern(good), Ok(()), "{good:?}");
        }
    }
}
