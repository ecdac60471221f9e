//! Local user accounts, read from `/etc/passwd` as a file, never through NSS.
//!
//! The release binary is statically linked, and a static glibc's NSS `dlopen`s the modules
//! `nsswitch.conf` names for any lookup the `files` module does not answer: Debian 12's
//! default `passwd: files systemd` then crashes the process inside `libnss_systemd.so.2`
//! (measured: a fresh machine's root daemon died with a segfault on its first create, looking
//! up the not-yet-made `tryboxi-vm` user; `tryboxi doctor` died the same way). So every user
//! lookup of the daemon, CLI and installer goes through here (`clippy.toml` forbids
//! `nix::unistd::User`/`Group` lookups elsewhere). Users only a directory service knows are not
//! found in the file are asked of `getent` (a separate, dynamically linked program).
//!
//! Never: allocates past its bounds (the file is read up to [`MAX_PASSWD_BYTES`], at most
//! [`MAX_USERS`] entries).

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// The password file.
pub const PASSWD: &str = "/etc/passwd";
/// Most entries read from the password file.
pub const MAX_USERS: usize = 100_000;
/// Largest password file read (bigger ones are read up to here).
pub const MAX_PASSWD_BYTES: u64 = 16 << 20;

/// One `name:pw:uid:gid:gecos:home:shell` line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Account {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: PathBuf,
}

/// Every well-formed entry of the password file (none when it cannot be read).
pub fn all() -> Vec<Account> {
    parse(&read(Path::new(PASSWD)))
}

/// The entry named `name`: from the file, else from `getent passwd` (see [`getent`]).
pub fn by_name(name: &str) -> Option<Account> {
    all()
        .into_iter()
        .find(|a| a.name == name)
        .or_else(|| getent(name).filter(|a| a.name == name))
}

/// The first entry with uid `uid`: from the file, else from `getent passwd` (see [`getent`]).
pub fn by_uid(uid: u32) -> Option<Account> {
    find_uid(&all(), uid)
}

/// The first entry of `file` (what [`all`] read) with uid `uid`, else `getent passwd`'s.
pub fn find_uid(file: &[Account], uid: u32) -> Option<Account> {
    file.iter()
        .find(|a| a.uid == uid)
        .cloned()
        .or_else(|| getent(&uid.to_string()).filter(|a| a.uid == uid))
}

/// A user only a directory service knows (LDAP, sssd, systemd's dynamic users): asked of
/// `getent passwd KEY`, a dynamically linked program whose NSS works, so this process never
/// loads an NSS module. Blocking (a directory service may be slow); `None` when `getent` is
/// missing, fails or says nothing.
fn getent(key: &str) -> Option<Account> {
    use crate::oom::ResetOomScore as _;
    if key.is_empty() || key.starts_with('-') {
        return None;
    }
    let out = std::process::Command::new("getent")
        .reset_oom_score()
        .args(["passwd", "--", key])
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    parse(&out.stdout).into_iter().next()
}

fn read(path: &Path) -> Vec<u8> {
    use std::io::Read as _;
    let mut text = Vec::new();
    if let Ok(f) = std::fs::File::open(path) {
        let _ = f.take(MAX_PASSWD_BYTES).read_to_end(&mut text);
    }
    text
}

/// The well-formed entries of a password file's text: comments, short lines, non-numeric ids
/// and non-UTF-8 names are skipped; the home is kept as given (it may be relative or empty).
pub fn parse(text: &[u8]) -> Vec<Account> {
    text.split(|&b| b == b'\n')
        .filter(|l| !l.starts_with(b"#"))
        .filter_map(|l| {
            let f: Vec<&[u8]> = l.splitn(7, |&b| b == b':').collect();
            if f.len() < 6 {
                return None;
            }
            let num = |b: &[u8]| std::str::from_utf8(b).ok()?.parse::<u32>().ok();
            Some(Account {
                name: std::str::from_utf8(f[0]).ok()?.to_owned(),
                uid: num(f[2])?,
                gid: num(f[3])?,
                home: PathBuf::from(OsStr::from_bytes(f[5])),
            })
        })
        .take(MAX_USERS)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_come_from_well_formed_lines_only() {
        let text = b"root:x:0:0:root:/root:/bin/bash\n# c:x:1:1::/nope:\n\
                     me:x:1000:1001:Me,,,:/home/me:/bin/sh\nbroken\nodd:x:2:2::relative:\n\
                     bad:x:uid:3::/b:\nshort:x:4:4\n\
                     nologin:x:65534:65534::/nonexistent:/usr/sbin/nologin";
        let a = parse(text);
        let names: Vec<&str> = a.iter().map(|a| a.name.as_str()).collect();
        assert_eq!(names, ["root", "me", "odd", "nologin"]);
        assert_eq!(
            a[1],
            Account {
                name: "me".into(),
                uid: 1000,
                gid: 1001,
                home: "/home/me".into()
            }
        );
        assert_eq!(a[2].home, Path::new("relative"));
    }

    #[test]
    fn a_user_not_in_the_file_is_asked_of_getent_and_an_unknown_one_is_none() {
        // `getent` answers from the same file here; what matters is that the answer is parsed
        // and checked against the key, and that nothing is found for an unknown key.
        assert_eq!(getent("0").map(|a| a.name), Some("root".to_owned()));
        assert_eq!(getent("no-such-user-tryboxi"), None);
        assert_eq!(getent("-x"), None, "never an option to getent");
    }

    #[test]
    fn this_machines_root_is_found_by_name_and_uid() {
        let root = by_uid(0).expect("uid 0 in /etc/passwd");
        assert_eq!(root.name, "root");
        assert_eq!(by_name("root"), Some(root));
        assert_eq!(by_name("no-such-user-tryboxi"), None);
    }

    #[test]
    fn a_huge_password_file_is_read_up_to_the_bound() {
        let line = b"u:x:1:1::/h:/bin/sh\n";
        let text: Vec<u8> = line.repeat(MAX_USERS + 10);
        assert_eq!(parse(&text).len(), MAX_USERS);
    }
}
