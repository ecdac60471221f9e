//! Boots the real agent as PID 1 in QEMU (TCG) and drives it with the real client.
//! Ignored by default: needs a kernel, an initramfs with this binary as /init, and a rootfs:
//!
//! ```sh
//! TRYBOXI_TEST_KERNEL=vmlinuz TRYBOXI_TEST_INITRD=initramfs.cpio.gz TRYBOXI_TEST_ROOTFS=rootfs.ext4 \
//!   cargo test --lib vm_tests -- --ignored --nocapture
//! ```

use crate::rpc::{AgentClient, ExecEvent, ExecRequest};
use std::time::{Duration, Instant};

fn env(k: &str) -> String {
    std::env::var(k).unwrap_or_else(|_| panic!("set {k}"))
}

async fn output(c: &AgentClient, shell: &str) -> (String, Option<i32>) {
    let mut s = c
        .exec(ExecRequest {
            shell: Some(shell.into()),
            ..Default::default()
        })
        .await
        .unwrap();
    let (mut out, mut code) = (Vec::new(), None);
    while let Some(ev) = tokio::time::timeout(Duration::from_secs(60), s.next())
        .await
        .unwrap()
    {
        match ev.unwrap() {
            ExecEvent::Stdout(b) | ExecEvent::Stderr(b) => out.extend(b),
            ExecEvent::Exit { code: c, .. } => code = c,
            ExecEvent::Started { .. } => {}
        }
    }
    (String::from_utf8_lossy(&out).into_owned(), code)
}

#[tokio::test]
#[ignore = "boots a VM; needs TRYBOXI_TEST_KERNEL/INITRD/ROOTFS"]
async fn boots_in_qemu_and_runs_commands() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("agent.sock");
    let log = dir.path().join("console.log");
    let t0 = Instant::now();
    let mut qemu = tokio::process::Command::new("qemu-system-x86_64")
        .args([
            "-M",
            "microvm,acpi=off",
            "-accel",
            "tcg",
            "-cpu",
            "max",
            "-m",
            "512",
            "-smp",
            "2",
        ])
        .args(["-nodefaults", "-no-user-config", "-nographic", "-no-reboot"])
        .args([
            "-kernel",
            &env("TRYBOXI_TEST_KERNEL"),
            "-initrd",
            &env("TRYBOXI_TEST_INITRD"),
        ])
        .args([
            "-append",
            "console=ttyS0 reboot=t panic=-1 no_timer_check tryboxi.root=/dev/vda tryboxi.hostname=vmtest",
        ])
        .arg("-serial")
        .arg(format!("file:{}", log.display()))
        .arg("-drive")
        .arg(format!(
            "file={},format=raw,if=none,id=root,snapshot=on",
            env("TRYBOXI_TEST_ROOTFS")
        ))
        .args([
            "-device",
            "virtio-blk-device,drive=root",
            "-device",
            "virtio-serial-device",
        ])
        .arg("-chardev")
        .arg(format!(
            "socket,id=ag,path={},server=on,wait=off",
            sock.display()
        ))
        .args(["-device", "virtserialport,chardev=ag,name=tryboxi.agent"])
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let c = match AgentClient::connect_unix(&sock, Duration::from_secs(60)).await {
        Ok(c) => c,
        Err(e) => panic!(
            "{e}\nconsole:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        ),
    };
    eprintln!(
        "agent {} answered {:?} after launch",
        c.agent_version(),
        t0.elapsed()
    );
    eprintln!("ping: {:?}", c.ping().await.unwrap());
    let (uname, code) = output(&c, "uname -a").await;
    eprintln!("uname -a: {uname}");
    assert!(uname.starts_with("Linux vmtest "), "{uname}");
    assert_eq!(code, Some(0));
    let (info, _) = output(&c, "echo $$ $PWD; cat /proc/1/comm; mount | grep -c -E ' / | /dev/pts | /tmp | /sys/fs/cgroup '; tty; ip -o link 2>/dev/null | head -1; true").await;
    eprintln!("env: {info}");
    assert!(info.contains("/workspace"), "{info}");
    let t = Instant::now();
    for _ in 0..10 {
        output(&c, "true").await;
    }
    eprintln!("exec of true: {:?} each", t.elapsed() / 10);

    // Cut the connection mid-output and pick it up on a new one.
    let mut s = c
        .exec(ExecRequest {
            shell: Some("seq 1 200000".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    let mut out = Vec::new();
    while out.len() < 10_000 {
        if let Some(Ok(ExecEvent::Stdout(b))) = s.next().await {
            out.extend(b);
        }
    }
    let (id, from) = (s.exec_id(), s.next_seq());
    drop((s, c));
    let c = AgentClient::connect_unix(&sock, Duration::from_secs(30))
        .await
        .unwrap();
    let mut s = c.resume(id, from).await.unwrap();
    while let Some(ev) = tokio::time::timeout(Duration::from_secs(60), s.next())
        .await
        .unwrap()
    {
        if let ExecEvent::Stdout(b) = ev.unwrap() {
            out.extend(b);
        }
    }
    let expected: String = (1..=200_000).map(|i| format!("{i}\n")).collect();
    assert_eq!(out.len(), expected.len());
    assert!(out == expected.as_bytes());
    eprintln!("replay after reconnect: {} bytes intact", out.len());

    output(&c, "head -c 1048576 /dev/zero > /workspace/blob").await;
    let t = Instant::now();
    assert_eq!(
        c.read_file("/workspace/blob", u64::MAX).await.unwrap(),
        vec![0u8; 1 << 20]
    );
    eprintln!("1 MiB read_file over virtio-serial: {:?}", t.elapsed());
    for size in [4_000usize, 40_000, 400_000] {
        let t = Instant::now();
        let r = tokio::time::timeout(
            Duration::from_secs(30),
            c.write_file("/workspace/up", &vec![1u8; size], 0o644),
        )
        .await;
        eprintln!("{size} B write_file: {:?}", t.elapsed());
        r.expect("write_file stalled").unwrap();
        assert_eq!(
            c.read_file("/workspace/up", u64::MAX).await.unwrap(),
            vec![1u8; size]
        );
    }

    c.shutdown().await.unwrap();
    let st = tokio::time::timeout(Duration::from_secs(30), qemu.wait())
        .await
        .unwrap()
        .unwrap();
    eprintln!("qemu exited {st} after {:?}", t0.elapsed());
}
