use super::*;

fn dir(path: &str, age_s: u64) -> DirInfo {
    DirInfo {
        path: PathBuf::from(path),
        name: Path::new(path)
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned(),
        age_s,
    }
}

fn snap(id: &str, sbx: &str, age_days: u64) -> SnapInfo {
    SnapInfo {
        id: id.into(),
        sandbox_id: sbx.into(),
        age_s: age_days * DAY + 1,
        dir: PathBuf::from(format!("/d/sandboxes/{sbx}/snapshots/{id}")),
    }
}

fn kinds(p: &[Planned]) -> Vec<(&str, String)> {
    p.iter()
        .map(|p| (p.kind, p.path.display().to_string()))
        .collect()
}

#[test]
fn orphan_vm_dirs_are_those_without_a_record_and_old_enough() {
    let i = Inputs {
        vm_dirs: vec![
            dir("/d/sandboxes/sbx_a", 3600),
            dir("/d/sandboxes/sbx_orphan", 3600),
            dir("/d/sandboxes/sbx_creating", 5),
        ],
        known_dirs: [PathBuf::from("/d/sandboxes/sbx_a")].into(),
        ..Default::default()
    };
    let p = plan(&i, &GcConfig::default());
    assert_eq!(
        kinds(&p),
        [("orphan_vm_dir", "/d/sandboxes/sbx_orphan".to_string())]
    );
}

#[test]
fn snapshots_by_count_and_age() {
    let cfg = GcConfig {
        snapshot_max_age_days: 10,
        keep_snapshots_per_sandbox: 2,
        backup_retention_days: 30,
    };
    let i = Inputs {
        snapshots: vec![
            snap("s1", "sbx_a", 0),
            snap("s2", "sbx_a", 1),
            snap("s3", "sbx_a", 2),
            snap("s4", "sbx_b", 20),
            snap("s5", "sbx_b", 1),
        ],
        ..Default::default()
    };
    let p = plan(&i, &cfg);
    let got: Vec<&str> = p.iter().map(|p| p.record.as_deref().unwrap()).collect();
    assert_eq!(got, ["s3", "s4"], "{p:?}");
    assert!(p[0].reason.contains("newest 2"), "{}", p[0].reason);
    assert!(p[1].reason.contains("10 days"), "{}", p[1].reason);
    // 0 = no policy: nothing goes.
    let off = GcConfig {
        snapshot_max_age_days: 0,
        keep_snapshots_per_sandbox: 0,
        backup_retention_days: 0,
    };
    assert!(plan(&i, &off).is_empty());
}

#[test]
fn golden_stale_by_key_and_untouched_when_images_unknown() {
    let key = golden_key("k", "i", "r");
    assert_eq!(key.len(), 16);
    assert_ne!(key, golden_key("k", "i", "r2"));
    let mut i = Inputs {
        golden: vec![
            dir(&format!("/d/golden/base-{key}"), 3600),
            dir("/d/golden/base-0123456789abcdef", 3600),
        ],
        golden_keys: Some(vec![key.clone()]),
        ..Default::default()
    };
    let p = plan(&i, &GcConfig::default());
    assert_eq!(
        kinds(&p),
        [("golden", "/d/golden/base-0123456789abcdef".to_string())]
    );
    i.golden_keys = None;
    assert!(plan(&i, &GcConfig::default()).is_empty());
}

#[test]
fn backups_past_retention_but_never_the_latest_undo_of_a_live_sandbox() {
    let b = |name: &str, sbx: Option<&str>, age_days: u64| BackupInfo {
        dir: dir(&format!("/d/artifacts/{name}"), age_days * DAY + 100),
        sandbox_id: sbx.map(str::to_owned),
        age_s: age_days * DAY + 100,
    };
    let i = Inputs {
        sandboxes: ["sbx_live".to_string()].into(),
        backups: vec![
            b("art_live_old", Some("sbx_live"), 90),
            b("art_live_newest", Some("sbx_live"), 60),
            b("art_live_recent", Some("sbx_gone"), 1),
            b("art_gone_old", Some("sbx_gone"), 40),
            b("art_norecord", None, 1),
        ],
        ..Default::default()
    };
    let p = plan(&i, &GcConfig::default());
    let got: Vec<String> = p
        .iter()
        .map(|p| p.path.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        got,
        ["art_live_old", "art_gone_old", "art_norecord"],
        "{p:?}"
    );
    assert_eq!(p[0].record.as_deref(), Some("art_live_old"));
    assert_eq!(p[2].record, None);
}

#[test]
fn rfc3339_parses_what_now_writes() {
    assert_eq!(parse_rfc3339("1970-01-01T00:00:00Z"), Some(0));
    assert_eq!(parse_rfc3339("2000-03-01T00:00:01Z"), Some(951_868_801));
    assert_eq!(parse_rfc3339("2026-12-02T10:00:00Z"), Some(1_796_205_600));
    assert_eq!(parse_rfc3339("nonsense"), None);
    let now = crate::service::now_rfc3339();
    let t = parse_rfc3339(&now).unwrap();
    assert!(now_s().abs_diff(t) < 5);
}

#[test]
fn disk_usage_counts_allocated_bytes() {
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("a"), vec![1u8; 10_000]).unwrap();
    std::fs::create_dir(d.path().join("sub")).unwrap();
    std::fs::write(d.path().join("sub/b"), vec![1u8; 10_000]).unwrap();
    let f = std::fs::File::create(d.path().join("sparse")).unwrap();
    f.set_len(1 << 30).unwrap();
    let n = disk_usage(d.path());
    assert!((20_000..(1 << 20)).contains(&n), "{n}");
}
