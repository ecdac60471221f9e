use std::os::unix::fs::symlink;

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};

use super::*;

fn params(cn: &str, ca: bool) -> CertificateParams {
    let mut p = CertificateParams::default();
    p.distinguished_name.push(DnType::CommonName, cn);
    if ca {
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    }
    p
}

fn pem(p: CertificateParams) -> String {
    p.self_signed(&KeyPair::generate().unwrap()).unwrap().pem()
}

fn ca(cn: &str) -> String {
    pem(params(cn, true))
}

fn reasons(h: &HostCas) -> String {
    h.skipped
        .iter()
        .map(|s| format!("{}: {}", s.file.display(), s.reason))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn ca_certificates_are_taken_with_their_cn_and_file() {
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("corp.crt"), ca("Corp Proxy CA")).unwrap();
    // Two in one file, the .pem extension, any case.
    std::fs::write(
        d.path().join("two.PEM"),
        format!("{}{}", ca("Second CA"), ca("Third CA")),
    )
    .unwrap();
    // One level of subdirectory, as update-ca-certificates reads it.
    std::fs::create_dir(d.path().join("sub")).unwrap();
    std::fs::write(d.path().join("sub/deep.crt"), ca("Sub CA")).unwrap();
    // Other names are not candidates.
    std::fs::write(d.path().join("README"), ca("Not Read CA")).unwrap();
    std::fs::write(d.path().join("x.crt.bak"), ca("Not Read Either")).unwrap();
    let h = read_dirs(&[d.path().to_path_buf(), PathBuf::from("/nonexistent/tbx")]);
    assert_eq!(
        h.dirs,
        vec![d.path().to_path_buf()],
        "missing dirs are passed over"
    );
    let got: Vec<_> = h.cas.iter().map(|c| c.subject.as_str()).collect();
    assert_eq!(got, ["Corp Proxy CA", "Sub CA", "Second CA", "Third CA"]);
    assert!(h.skipped.is_empty(), "{}", reasons(&h));
    assert_eq!(h.cas[0].file, d.path().join("corp.crt"));
    // The PEM written out is the same certificate.
    let der = CertificateDer::from_pem_slice(h.cas[0].pem.as_bytes()).unwrap();
    assert_eq!(
        CertificateDer::from_pem_slice(ca_bytes(&d.path().join("corp.crt")).as_slice()).unwrap(),
        der
    );
    let block = h.pem_block("# tbx:");
    assert!(block.starts_with(&format!(
        "# tbx: host CA Corp Proxy CA ({})\n-----BEGIN CERTIFICATE-----\n",
        d.path().join("corp.crt").display()
    )));
    assert_eq!(block.matches("BEGIN CERTIFICATE").count(), 4);
    assert!(h.describe()[0].starts_with("CN=Corp Proxy CA ("));
}

fn ca_bytes(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap()
}

#[test]
fn non_ca_certificates_and_garbage_are_left_out_with_a_reason() {
    let d = tempfile::tempdir().unwrap();
    std::fs::write(
        d.path().join("a-leaf.crt"),
        pem(params("leaf.example", false)),
    )
    .unwrap();
    let mut no_sign = params("No CertSign CA", true);
    no_sign.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    std::fs::write(d.path().join("b-nosign.crt"), pem(no_sign)).unwrap();
    let mut old = params("Expired CA", true);
    old.not_before = rcgen::date_time_ymd(2000, 1, 1);
    old.not_after = rcgen::date_time_ymd(2001, 1, 1);
    std::fs::write(d.path().join("c-expired.crt"), pem(old)).unwrap();
    std::fs::write(
        d.path().join("d-garbage.crt"),
        b"\x00\x01not a certificate at all",
    )
    .unwrap();
    std::fs::write(
        d.path().join("e-badder.pem"),
        "-----BEGIN CERTIFICATE-----\naGVsbG8gd29ybGQ=\n-----END CERTIFICATE-----\n",
    )
    .unwrap();
    std::fs::write(
        d.path().join("f-badb64.pem"),
        "-----BEGIN CERTIFICATE-----\n!!!!\n-----END CERTIFICATE-----\n",
    )
    .unwrap();
    std::fs::write(d.path().join("g-empty.crt"), b"").unwrap();
    // A CA next to its private key: the certificate is taken, the key never.
    let key = KeyPair::generate().unwrap();
    let cert = params("Keyed CA", true).self_signed(&key).unwrap();
    std::fs::write(
        d.path().join("h-keyed.pem"),
        format!("{}{}", key.serialize_pem(), cert.pem()),
    )
    .unwrap();
    let h = read_dirs(&[d.path().to_path_buf()]);
    let got: Vec<_> = h.cas.iter().map(|c| c.subject.as_str()).collect();
    assert_eq!(got, ["Keyed CA"], "{}", reasons(&h));
    assert!(!h.pem_block("#").contains("PRIVATE KEY"));
    let r = reasons(&h);
    for (file, why) in [
        ("a-leaf.crt", "not a CA certificate"),
        ("b-nosign.crt", "keyCertSign"),
        ("c-expired.crt", "not valid now"),
        ("d-garbage.crt", "no PEM certificate"),
        ("e-badder.pem", "not an X.509 certificate"),
        ("f-badb64.pem", "bad PEM"),
        ("g-empty.crt", "no PEM certificate"),
    ] {
        assert!(
            h.skipped
                .iter()
                .any(|s| s.file.ends_with(file) && s.reason.contains(why)),
            "{file}: {why}\n{r}"
        );
    }
}

#[test]
fn oversize_files_and_too_many_files_are_bounded() {
    let d = tempfile::tempdir().unwrap();
    let mut big = ca("Big CA").into_bytes();
    big.resize(MAX_FILE as usize + 1, b'\n');
    std::fs::write(d.path().join("big.crt"), &big).unwrap();
    let h = read_dirs(&[d.path().to_path_buf()]);
    assert!(h.cas.is_empty());
    assert!(
        h.skipped[0].reason.contains("larger than"),
        "{}",
        reasons(&h)
    );

    let d = tempfile::tempdir().unwrap();
    let one = ca("Many CA");
    for i in 0..MAX_FILES + 5 {
        std::fs::write(d.path().join(format!("{i:04}.crt")), &one).unwrap();
    }
    let h = read_dirs(&[d.path().to_path_buf()]);
    assert_eq!(h.cas.len(), 1, "the same certificate is taken once");
    assert!(
        h.skipped
            .iter()
            .any(|s| s.reason.contains(&format!("more than {MAX_FILES} files"))),
        "{}",
        reasons(&h)
    );

    let d = tempfile::tempdir().unwrap();
    let many: String = (0..MAX_CAS + 2).map(|i| ca(&format!("CA {i}"))).collect();
    std::fs::write(d.path().join("many.crt"), many).unwrap();
    let h = read_dirs(&[d.path().to_path_buf()]);
    assert_eq!(h.cas.len(), MAX_CAS);
    assert_eq!(h.skipped.len(), 2, "{}", reasons(&h));
}

#[test]
fn symlinks_to_files_are_followed_other_links_are_not() {
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("real.crt"), ca("Linked CA")).unwrap();
    std::fs::create_dir(outside.path().join("dir")).unwrap();
    std::fs::write(outside.path().join("dir/in-linked-dir.crt"), ca("Dir CA")).unwrap();
    nix::unistd::mkfifo(
        &outside.path().join("fifo"),
        nix::sys::stat::Mode::from_bits_truncate(0o600),
    )
    .unwrap();
    std::fs::write(outside.path().join("secret.txt"), "hunter2").unwrap();

    let d = tempfile::tempdir().unwrap();
    symlink(outside.path().join("real.crt"), d.path().join("a-link.crt")).unwrap();
    symlink(
        outside.path().join("gone.crt"),
        d.path().join("b-dangling.crt"),
    )
    .unwrap();
    symlink(outside.path().join("fifo"), d.path().join("c-fifo.crt")).unwrap();
    symlink(
        outside.path().join("secret.txt"),
        d.path().join("d-other.crt"),
    )
    .unwrap();
    symlink(outside.path().join("dir"), d.path().join("e-linked-dir")).unwrap();
    // A loop through a directory link is never walked.
    symlink(d.path(), d.path().join("f-loop")).unwrap();
    let h = read_dirs(&[d.path().to_path_buf()]);
    let got: Vec<_> = h.cas.iter().map(|c| c.subject.as_str()).collect();
    assert_eq!(got, ["Linked CA"], "{}", reasons(&h));
    let r = reasons(&h);
    assert!(r.contains("b-dangling.crt: cannot open"), "{r}");
    assert!(r.contains("c-fifo.crt: not a regular file"), "{r}");
    assert!(r.contains("d-other.crt: no PEM certificate"), "{r}");
    assert!(!r.contains("hunter2") && !h.pem_block("#").contains("hunter2"));
}

#[test]
fn an_empty_or_missing_directory_adds_nothing() {
    let d = tempfile::tempdir().unwrap();
    let h = read_dirs(&[d.path().to_path_buf()]);
    assert_eq!(h.dirs.len(), 1);
    assert!(h.cas.is_empty() && h.skipped.is_empty());
    assert_eq!(h.pem_block("#"), "");
    let h = read_dirs(&[]);
    assert!(h.dirs.is_empty() && h.cas.is_empty());
    let h = read_dirs(&[d.path().join("nope")]);
    assert!(h.dirs.is_empty() && h.cas.is_empty() && h.skipped.is_empty());
}
