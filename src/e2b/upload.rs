//! Parsing an envd `POST /files` multipart body (`multipart/form-data`, by `multer`) into the
//! files it carries, before anything is written to the guest.
//!
//! Owns: the bounds (each file at most `max` bytes, the whole body at most twice that or
//! 1 MiB, at most [`MAX_PARTS`] files), the destination of each file (`path` names the only
//! file, otherwise each part's filename), and the errors' statuses (400 for a malformed body,
//! 413 for one over a bound). The fuzz check of the `e2b_multipart` target is
//! [`fuzzing::multipart`].

use bytes::Bytes;
use futures_util::Stream;
use hyper::StatusCode;

use super::E2bError;

/// Most files one multipart upload may hold.
pub const MAX_PARTS: usize = 64;

/// One file of an upload: where it goes (as the client wrote it; resolved later) and its bytes.
#[derive(Debug, PartialEq, Eq)]
pub struct Part {
    pub dest: String,
    pub data: Bytes,
}

/// The files of a multipart body with `boundary`, read from `stream`. `path` (the query's)
/// names the file when there is exactly one; each file is at most `max` bytes.
pub async fn multipart<S, O, E>(
    stream: S,
    boundary: String,
    path: Option<&str>,
    max: u64,
) -> Result<Vec<Part>, E2bError>
where
    S: Stream<Item = Result<O, E>> + Send + 'static,
    O: Into<Bytes> + 'static,
    E: Into<Box<dyn std::error::Error + Send + Sync>> + 'static,
{
    let bad = |e: multer::Error| {
        let status = match e {
            multer::Error::FieldSizeExceeded { .. } | multer::Error::StreamSizeExceeded { .. } => {
                StatusCode::PAYLOAD_TOO_LARGE
            }
            _ => StatusCode::BAD_REQUEST,
        };
        E2bError::new(status, format!("multipart: {e}"))
    };
    let limits = multer::Constraints::new().size_limit(
        multer::SizeLimit::new()
            .per_field(max)
            .whole_stream(max.saturating_mul(2).max(1 << 20)),
    );
    let mut mp = multer::Multipart::with_constraints(stream, boundary, limits);
    let mut raw: Vec<(Option<String>, Bytes)> = Vec::new();
    while let Some(field) = mp.next_field().await.map_err(bad)? {
        if raw.len() == MAX_PARTS {
            return Err(E2bError::new(
                StatusCode::BAD_REQUEST,
                format!("at most {MAX_PARTS} files per upload"),
            ));
        }
        let name = field.file_name().map(str::to_owned);
        let data = field.bytes().await.map_err(bad)?;
        raw.push((name, data));
    }
    if raw.is_empty() {
        return Err(E2bError::new(
            StatusCode::BAD_REQUEST,
            "no file in the upload",
        ));
    }
    let one = raw.len() == 1;
    raw.into_iter()
        .map(|(name, data)| {
            let dest = match (path, name) {
                (Some(p), _) if one && !p.is_empty() => p.to_owned(),
                (_, Some(n)) if !n.is_empty() => n,
                _ => {
                    return Err(E2bError::new(
                        StatusCode::BAD_REQUEST,
                        "each file needs a destination: `path` (for one file) or the part's \
                         filename",
                    ));
                }
            };
            Ok(Part { dest, data })
        })
        .collect()
}

/// The check of the `e2b_multipart` fuzz target, shared with the unit tests that replay its
/// corpus (`fuzz/corpus/e2b_multipart/`) and a bounded mutated run in every `cargo test`.
#[cfg(any(test, fuzzing))]
pub mod fuzzing {
    use super::*;

    /// Input: byte 0 picks the per-file limit (`(b + 1) * 16` bytes), byte 1 where the body
    /// is cut into two chunks, then the boundary up to the first `\n`, the `path` up to the
    /// next (empty: none), and the rest is the body. Asserted beyond "no panic": an accepted
    /// upload has 1 to [`MAX_PARTS`] files, each within the limit and with a destination; a
    /// refusal is 400 or 413 with a message; parsing is deterministic.
    pub fn multipart(data: &[u8]) {
        let [lim, cut, rest @ ..] = data else {
            return;
        };
        let max = (u64::from(*lim) + 1) * 16;
        let (boundary, rest) = split_line(rest);
        let (path, body) = split_line(rest);
        let Ok(boundary) = std::str::from_utf8(boundary) else {
            return;
        };
        if boundary.is_empty() {
            return;
        }
        let path = std::str::from_utf8(path).ok().filter(|p| !p.is_empty());
        let at = if body.is_empty() {
            0
        } else {
            usize::from(*cut) % body.len()
        };
        let first = run(body, at, boundary, path, max);
        let again = run(body, at, boundary, path, max);
        assert_eq!(
            format!("{first:?}"),
            format!("{again:?}"),
            "not deterministic"
        );
        match first {
            Ok(parts) => {
                assert!(
                    (1..=MAX_PARTS).contains(&parts.len()),
                    "{} parts",
                    parts.len()
                );
                for p in &parts {
                    assert!(p.data.len() as u64 <= max, "{} > {max}", p.data.len());
                    assert!(!p.dest.is_empty(), "a file without a destination");
                }
            }
            Err(e) => {
                assert!(
                    e.status == StatusCode::BAD_REQUEST
                        || e.status == StatusCode::PAYLOAD_TOO_LARGE,
                    "status {} ({})",
                    e.status,
                    e.message
                );
                assert!(!e.message.is_empty());
            }
        }
    }

    fn run(
        body: &[u8],
        at: usize,
        boundary: &str,
        path: Option<&str>,
        max: u64,
    ) -> Result<Vec<Part>, E2bError> {
        let chunks: Vec<Result<Bytes, std::io::Error>> = vec![
            Ok(Bytes::copy_from_slice(&body[..at])),
            Ok(Bytes::copy_from_slice(&body[at..])),
        ];
        let stream = futures_util::stream::iter(chunks);
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a current-thread runtime");
        rt.block_on(super::multipart(stream, boundary.to_owned(), path, max))
    }

    fn split_line(b: &[u8]) -> (&[u8], &[u8]) {
        match b.iter().position(|&c| c == b'\n') {
            Some(i) => (&b[..i], &b[i + 1..]),
            None => (b, &[]),
        }
    }

    /// A body of `files` (filename, content) with boundary `B`, as the SDKs send it.
    #[cfg(test)]
    pub fn body(files: &[(&str, &str)]) -> String {
        let mut s = String::new();
        for (name, data) in files {
            s.push_str(&format!(
                "--B\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\n\
                 Content-Type: application/octet-stream\r\n\r\n{data}\r\n"
            ));
        }
        s.push_str("--B--\r\n");
        s
    }

    /// The seed corpus `cargo xtask fuzz` starts from: one file with and without `path`,
    /// several files, an empty filename, an oversize file, a truncated body, no parts.
    #[cfg(test)]
    pub fn seeds() -> Vec<(&'static str, Vec<u8>)> {
        let mk = |lim: u8, cut: u8, path: &str, body: &str| {
            let mut v = vec![lim, cut];
            v.extend_from_slice(format!("B\n{path}\n{body}").as_bytes());
            v
        };
        let big = "x".repeat(200);
        vec![
            (
                "one-file",
                mk(4, 7, "", &body(&[("/home/user/a.txt", "hello")])),
            ),
            (
                "one-file-path",
                mk(4, 30, "/tmp/p", &body(&[("a.txt", "hello")])),
            ),
            (
                "three-files",
                mk(
                    8,
                    90,
                    "",
                    &body(&[("/a", "1"), ("/b/c", "22"), ("d", "333")]),
                ),
            ),
            ("empty-name", mk(4, 0, "", &body(&[("", "x")]))),
            ("too-big", mk(0, 50, "", &body(&[("/a", &big)]))),
            (
                "truncated",
                mk(4, 3, "", "--B\r\nContent-Disposition: form-"),
            ),
            ("no-parts", mk(4, 2, "/x", "--B--\r\n")),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::fuzzing::{body, seeds};
    use super::*;

    fn parse(b: &str, path: Option<&str>, max: u64) -> Result<Vec<Part>, E2bError> {
        let chunks: Vec<Result<Bytes, std::io::Error>> = b
            .as_bytes()
            .chunks(7)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(multipart(
                futures_util::stream::iter(chunks),
                "B".into(),
                path,
                max,
            ))
    }

    #[test]
    fn files_get_their_destinations_and_bounds_are_kept() {
        let p = parse(&body(&[("/a", "1"), ("b/c", "22")]), None, 100).unwrap();
        assert_eq!(
            p,
            vec![
                Part {
                    dest: "/a".into(),
                    data: Bytes::from_static(b"1")
                },
                Part {
                    dest: "b/c".into(),
                    data: Bytes::from_static(b"22")
                },
            ]
        );
        // `path` names a lone file; with several, each part's filename does.
        let p = parse(&body(&[("x", "1")]), Some("/dst"), 100).unwrap();
        assert_eq!(p[0].dest, "/dst");
        let p = parse(&body(&[("/a", "1"), ("/b", "2")]), Some("/dst"), 100).unwrap();
        assert_eq!((p[0].dest.as_str(), p[1].dest.as_str()), ("/a", "/b"));
        assert_eq!(
            parse(&body(&[("", "1")]), None, 100).unwrap_err().status,
            StatusCode::BAD_REQUEST
        );
        assert_eq!(
            parse(&body(&[("/a", &"x".repeat(101))]), None, 100)
                .unwrap_err()
                .status,
            StatusCode::PAYLOAD_TOO_LARGE
        );
        assert_eq!(
            parse("--B--\r\n", Some("/x"), 100).unwrap_err().status,
            StatusCode::BAD_REQUEST
        );
        let many: Vec<(String, String)> = (0..=MAX_PARTS)
            .map(|i| (format!("/f{i}"), "x".to_owned()))
            .collect();
        let many: Vec<(&str, &str)> = many.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
        let e = parse(&body(&many), None, 100).unwrap_err();
        assert!(e.message.contains("at most"), "{}", e.message);
    }

    fn corpus() -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/e2b_multipart")
    }

    #[test]
    fn the_saved_corpus_and_mutated_seeds_pass_the_check() {
        let mut inputs: Vec<Vec<u8>> = seeds().into_iter().map(|(_, b)| b).collect();
        if let Ok(rd) = std::fs::read_dir(corpus()) {
            for e in rd.flatten() {
                inputs.push(std::fs::read(e.path()).unwrap());
            }
        }
        assert!(inputs.len() > seeds().len(), "the saved corpus is missing");
        for i in &inputs {
            fuzzing::multipart(i);
        }
        // A bounded mutated run: flip, insert and cut bytes of each seed (xorshift, seeded).
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for n in 0..1500 {
            let mut b = inputs[n % inputs.len()].clone();
            for _ in 0..(1 + next() % 4) {
                if b.is_empty() {
                    break;
                }
                let at = (next() as usize) % b.len();
                match next() % 3 {
                    0 => b[at] ^= 1 << (next() % 8),
                    1 => b.insert(at, (next() % 256) as u8),
                    _ => b.truncate(at.max(2)),
                }
            }
            fuzzing::multipart(&b);
        }
    }

    /// `cargo test --lib write_e2b_multipart_seed_corpus -- --ignored`
    #[test]
    #[ignore]
    fn write_e2b_multipart_seed_corpus() {
        std::fs::create_dir_all(corpus()).unwrap();
        for (name, b) in seeds() {
            std::fs::write(corpus().join(name), b).unwrap();
        }
    }
}
