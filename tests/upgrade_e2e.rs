//! New guest images installed under live state (issue 18 item 10): a paused sandbox's disk
//! keeps the base it was made on and resumes with its files; new sandboxes boot the new set;
//! the older set goes once nothing uses it.
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{BIN, Daemon, artifacts, first_word, new_home, ok, sh_out};

fn install(home: &Path, dest: &Path, art: &Path) -> String {
    ok(Command::new(BIN)
        .args([
            "install",
            "--no-service",
            "--prefix",
            "/opt/tb",
            "--destdir",
        ])
        .arg(dest)
        .arg("--artifacts")
        .arg(art)
        .env("TRYBOXI_HOME", home)
        .output()
        .unwrap())
}

fn current(home: &Path) -> PathBuf {
    let name = std::fs::read_to_string(home.join("artifacts/images.current")).unwrap();
    home.join("artifacts").join(name.trim())
}

/// The bottom of a disk chain: the file QEMU reads where no layer has the block.
fn chain_base(disk: &Path) -> PathBuf {
    let o = Command::new("qemu-img")
        .args(["info", "-U", "--backing-chain", "--output=json"])
        .arg(disk)
        .output()
        .expect("qemu-img");
    assert!(o.status.success(), "{o:?}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    PathBuf::from(
        v.as_array().unwrap().last().unwrap()["filename"]
            .as_str()
            .unwrap(),
    )
}

/// A second image set: the same files (hard links), but a rootfs that differs (1 MiB longer,
/// so its size and sha256 change), with its manifest updated.
fn another_set(art: &Path, into: &Path) -> PathBuf {
    let (from, to) = (art.join("images"), into.join("images"));
    std::fs::create_dir_all(&to).unwrap();
    for e in std::fs::read_dir(&from).unwrap().flatten() {
        let name = e.file_name();
        if name == "rootfs.ext4" || name == "manifest.json" {
            continue;
        }
        std::fs::hard_link(e.path(), to.join(&name)).unwrap();
    }
    let rootfs = to.join("rootfs.ext4");
    let o = Command::new("cp")
        .arg("--sparse=always")
        .arg(from.join("rootfs.ext4"))
        .arg(&rootfs)
        .output()
        .unwrap();
    assert!(o.status.success(), "{o:?}");
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&rootfs)
        .unwrap();
    let len = f.metadata().unwrap().len() + (1 << 20);
    f.set_len(len).unwrap();
    drop(f);
    let o = Command::new("sha256sum").arg(&rootfs).output().unwrap();
    let sha = String::from_utf8_lossy(&o.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_owned();
    let mut m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(from.join("manifest.json")).unwrap()).unwrap();
    for a in m["artifacts"].as_array_mut().unwrap() {
        if a["name"] == "rootfs" {
            a["size"] = len.into();
            a["sha256"] = sha.clone().into();
        }
    }
    std::fs::write(to.join("manifest.json"), m.to_string()).unwrap();
    into.to_owned()
}

#[test]
fn new_images_leave_a_paused_sandbox_on_its_base_and_the_old_set_goes_after() {
    let Some(art) = artifacts() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let dest = tmp.path().join("dest");
    let home = new_home();
    let out = install(home.path(), &dest, &art);
    let first = current(home.path());
    assert!(first.join("rootfs.ext4").is_file(), "{out}");
    let first_len = std::fs::metadata(first.join("rootfs.ext4")).unwrap().len();

    // The daemon runs on the installed images (no `--artifacts`).
    let d = Daemon::start_in(home, None, &[], &[]);
    let o = d.cli(&["create"]);
    let id = first_word(&o);
    assert!(id.starts_with("sbx_"), "{o:?}\n{}", d.log_text());
    assert_eq!(
        sh_out(&d, &id, "echo kept > /root/f; sync; echo ok").1,
        "ok\n"
    );
    ok(d.cli(&["pause", &id]));
    let old_disk = d.root().join("sandboxes").join(&id).join("disk.qcow2");
    assert!(chain_base(&old_disk).starts_with(&first));

    // New images, installed while the daemon runs and the sandbox is paused.
    let art2 = another_set(&art, &tmp.path().join("art2"));
    let out = install(d.root(), &dest, &art2);
    let second = current(d.root());
    assert_ne!(second, first, "{out}");
    assert!(out.contains("keeping the older set"), "{out}");
    // The paused sandbox's base is still the file it was made on, unchanged.
    let base = chain_base(&old_disk);
    assert!(base.starts_with(&first), "{}", base.display());
    assert_eq!(std::fs::metadata(&base).unwrap().len(), first_len);
    // It resumes with its files.
    ok(d.cli(&["resume", &id]));
    assert_eq!(sh_out(&d, &id, "cat /root/f").1, "kept\n");

    // A new sandbox boots the new set.
    let o = d.cli(&["create"]);
    let id2 = first_word(&o);
    assert!(id2.starts_with("sbx_"), "{o:?}\n{}", d.log_text());
    assert_eq!(sh_out(&d, &id2, "echo ok").1, "ok\n");
    let disk2 = d.root().join("sandboxes").join(&id2).join("disk.qcow2");
    assert!(
        chain_base(&disk2).starts_with(&second),
        "{}",
        chain_base(&disk2).display()
    );

    // `gc` keeps the older set while the first sandbox lives, and removes it after.
    let out = ok(d.cli(&["gc"]));
    assert!(first.exists(), "{out}");
    ok(d.cli(&["rm", &id]));
    let out = ok(d.cli(&["gc"]));
    assert!(!first.exists(), "{out}");
    assert!(out.contains("image_set"), "{out}");
    assert_eq!(sh_out(&d, &id2, "echo still").1, "still\n");
}
