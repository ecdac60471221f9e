//! envd's `filesystem.EntryInfo` in proto3-JSON, from a guest `FileStat`: the type enum by name,
//! `ls -l` permissions, the Go `os.FileMode` bits envd reports, `int64` size as a string, RFC
//! 3339 times, defaults omitted.

use serde_json::{Map, Value, json};

/// `filesystem.FileType`
pub fn file_type(kind: crate::rpc::msg::FileKind) -> &'static str {
    use crate::rpc::msg::FileKind as K;
    match kind {
        K::File => "FILE_TYPE_FILE",
        K::Dir => "FILE_TYPE_DIRECTORY",
        K::Symlink => "FILE_TYPE_SYMLINK",
        K::Other => "FILE_TYPE_UNSPECIFIED",
    }
}

/// `ls -l` style permissions of a kind and mode (`drwxr-xr-x`).
pub fn permissions(kind: crate::rpc::msg::FileKind, mode: u32) -> String {
    use crate::rpc::msg::FileKind as K;
    let mut s = String::with_capacity(10);
    s.push(match kind {
        K::Dir => 'd',
        K::Symlink => 'l',
        K::File => '-',
        K::Other => '?',
    });
    let bits = [
        (0o400, 'r'),
        (0o200, 'w'),
        (0o100, 'x'),
        (0o040, 'r'),
        (0o020, 'w'),
        (0o010, 'x'),
        (0o004, 'r'),
        (0o002, 'w'),
        (0o001, 'x'),
    ];
    for (bit, c) in bits {
        s.push(if mode & bit != 0 { c } else { '-' });
    }
    s
}

/// RFC 3339 of seconds since the epoch.
pub fn timestamp(secs: i64) -> String {
    crate::service::rfc3339(secs)
}

/// `filesystem.EntryInfo`
pub struct Entry<'a> {
    pub name: &'a str,
    pub path: &'a str,
    pub stat: &'a crate::rpc::msg::FileStat,
    pub owner: String,
    pub group: String,
}

impl Entry<'_> {
    pub fn to_json(&self) -> Value {
        use crate::rpc::msg::FileKind as K;
        let st = self.stat;
        let mut m = Map::new();
        m.insert("name".into(), json!(self.name));
        if st.kind != K::Other {
            m.insert("type".into(), json!(file_type(st.kind)));
        }
        m.insert("path".into(), json!(self.path));
        if st.size != 0 {
            m.insert("size".into(), json!(st.size.to_string()));
        }
        // envd reports the Go `os.FileMode`: permission bits plus a type bit.
        let type_bit: u32 = match st.kind {
            K::Dir => 1 << 31,
            K::Symlink => 1 << 27,
            _ => 0,
        };
        let mode = st.mode | type_bit;
        if mode != 0 {
            m.insert("mode".into(), json!(mode));
        }
        m.insert("permissions".into(), json!(permissions(st.kind, st.mode)));
        m.insert("owner".into(), json!(self.owner));
        m.insert("group".into(), json!(self.group));
        m.insert("modifiedTime".into(), json!(timestamp(st.mtime)));
        if let Some(t) = &st.link {
            m.insert("symlinkTarget".into(), json!(t));
            m.insert("isSymlink".into(), json!(true));
        }
        Value::Object(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rpc::msg::{FileKind, FileStat};

    #[test]
    fn entries_carry_int64_as_string_enums_by_name_and_permissions() {
        let st = FileStat {
            kind: FileKind::Symlink,
            size: 12,
            mode: 0o777,
            mtime: 0,
            uid: 1000,
            gid: 1000,
            link: Some("/etc".into()),
        };
        let e = Entry {
            name: "l",
            path: "/home/user/l",
            stat: &st,
            owner: "user".into(),
            group: "user".into(),
        }
        .to_json();
        assert_eq!(e["size"], "12");
        assert_eq!(e["type"], "FILE_TYPE_SYMLINK");
        assert_eq!(e["permissions"], "lrwxrwxrwx");
        assert_eq!(e["symlinkTarget"], "/etc");
        assert_eq!(e["isSymlink"], true);
        assert_eq!(e["modifiedTime"], "1970-01-01T00:00:00Z");
        assert_eq!(permissions(FileKind::Dir, 0o750), "drwxr-x---");
    }
}
