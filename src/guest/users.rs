//! Guest users for `ExecSpec::user`: a name looked up in `/etc/passwd` (uid, primary gid,
//! home) and `/etc/group` (supplementary groups), and the privilege drop applied in the
//! child between fork and exec.
//!
//! Owns nothing but the parsing; the files are read whole, bounded in size.

use std::path::Path;

pub use crate::rpc::msg::{MAX_USER_NAME as MAX_NAME, valid_user_name as valid_name};

/// Largest `/etc/passwd` or `/etc/group` read.
const MAX_FILE: u64 = 4 << 20;
/// Most supplementary groups kept (Linux's NGROUPS_MAX is 65536; a real user has a few).
const MAX_GROUPS: usize = 256;

/// Who a command runs as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestUser {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups, the primary one included.
    pub groups: Vec<u32>,
    pub home: String,
}

fn read_bounded(path: &Path) -> Result<String, String> {
    use std::io::Read as _;
    let f =
        std::fs::File::open(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mut s = String::new();
    f.take(MAX_FILE)
        .read_to_string(&mut s)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    Ok(s)
}

/// Look `name` up in `<root>/etc/passwd` and `<root>/etc/group`.
pub fn lookup(root: &Path, name: &str) -> Result<GuestUser, String> {
    if !valid_name(name) {
        return Err(format!(
            "invalid user name `{name}` (at most {MAX_NAME} bytes of [a-z_][a-z0-9_-]*)"
        ));
    }
    let passwd = read_bounded(&root.join("etc/passwd"))?;
    let user = passwd
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            (f.len() >= 7 && f[0] == name).then(|| {
                Some(GuestUser {
                    name: name.to_owned(),
                    uid: f[2].parse().ok()?,
                    gid: f[3].parse().ok()?,
                    groups: Vec::new(),
                    home: f[5].to_owned(),
                })
            })
        })
        .flatten()
        .ok_or_else(|| format!("no user `{name}` in the guest's /etc/passwd"))?;
    let mut groups = vec![user.gid];
    // A missing /etc/group only means no supplementary groups.
    let group = read_bounded(&root.join("etc/group")).unwrap_or_default();
    for l in group.lines() {
        let f: Vec<&str> = l.split(':').collect();
        if f.len() < 4 || !f[3].split(',').any(|m| m == name) {
            continue;
        }
        if let Ok(gid) = f[2].parse::<u32>()
            && !groups.contains(&gid)
            && groups.len() < MAX_GROUPS
        {
            groups.push(gid);
        }
    }
    Ok(GuestUser { groups, ..user })
}

/// Become `u` in a forked child: supplementary groups, then gid, then uid (the order matters:
/// each later call needs the privilege the earlier ones still have).
///
/// Only async-signal-safe calls (setgroups, setgid, setuid); `groups` was allocated before
/// the fork.
pub fn drop_to(uid: u32, gid: u32, groups: &[u32]) -> std::io::Result<()> {
    // SAFETY: setgroups reads `groups.len()` gid_t values from a live slice; setgid/setuid take
    // plain integers. All three are async-signal-safe.
    unsafe {
        if libc::setgroups(groups.len() as _, groups.as_ptr()) < 0
            || libc::setgid(gid) < 0
            || libc::setuid(uid) < 0
        {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_bounded_and_plain() {
        for ok in ["user", "_apt", "www-data", "a1", &"u".repeat(32)] {
            assert!(valid_name(ok), "{ok}");
        }
        for bad in [
            "",
            "User",
            "1a",
            "a b",
            "a:b",
            "../x",
            &"u".repeat(33),
            "-x",
        ] {
            assert!(!valid_name(bad), "{bad}");
        }
    }

    #[test]
    fn lookup_reads_passwd_and_groups() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("etc")).unwrap();
        std::fs::write(
            dir.path().join("etc/passwd"),
            "root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/bash\nbad:x:nope:1::/:/bin/sh\n",
        )
        .unwrap();
        std::fs::write(
            dir.path().join("etc/group"),
            "root:x:0:\nsudo:x:27:user\nuser:x:1000:\naudio:x:29:other,user\n",
        )
        .unwrap();
        let u = lookup(dir.path(), "user").unwrap();
        assert_eq!((u.uid, u.gid, u.home.as_str()), (1000, 1000, "/home/user"));
        assert_eq!(u.groups, vec![1000, 27, 29]);
        let e = lookup(dir.path(), "nobody").unwrap_err();
        assert!(e.contains("no user `nobody`"), "{e}");
        assert!(lookup(dir.path(), "bad").is_err());
        assert!(lookup(dir.path(), "Root").unwrap_err().contains("invalid"));
    }
}
