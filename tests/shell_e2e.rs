//! Interactive sessions in a real VM, driven through a real pseudo-terminal as a user's
//! terminal would: `tryboxi shell` (size, resize, Ctrl-C to the guest, the detach keys),
//! `tryboxi attach` of the detached shell (interactive again, exit status), `exec -it`, and
//! `exec -i` with piped input.

mod common;

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{BIN, Daemon, SMALL_VMS, create, vm_daemon, wait_bounded};
use nix::pty::{Winsize, openpty};

/// The CLI running on the slave side of a pty we hold the master of.
struct Term {
    master: File,
    child: Child,
    out: Arc<Mutex<Vec<u8>>>,
    /// Output before this offset has been matched already.
    seen: usize,
}

fn winsize(rows: u16, cols: u16) -> Winsize {
    Winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    }
}

impl Term {
    fn spawn(d: &Daemon, args: &[&str], rows: u16, cols: u16) -> Term {
        let pty = openpty(Some(&winsize(rows, cols)), None).expect("openpty");
        let slave: OwnedFd = pty.slave;
        let mut cmd = Command::new(BIN);
        cmd.args(args)
            .env("TRYBOXI_HOME", d.home.path())
            .env("TERM", "xterm")
            .stdin(Stdio::from(slave.try_clone().unwrap()))
            .stdout(Stdio::from(slave.try_clone().unwrap()))
            .stderr(Stdio::from(slave));
        // SAFETY: between fork and exec only async-signal-safe calls: setsid and ioctl make the
        // pty (already on fd 0) the child's controlling terminal, so it gets SIGWINCH.
        unsafe {
            cmd.pre_exec(|| {
                nix::unistd::setsid().map_err(std::io::Error::from)?;
                if libc::ioctl(0, libc::TIOCSCTTY, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().expect("spawn the CLI on a pty");
        let master = File::from(pty.master);
        let out = Arc::new(Mutex::new(Vec::new()));
        let mut reader = master.try_clone().unwrap();
        let sink = out.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            // EIO once the last slave descriptor closes (the CLI exited).
            while let Ok(n) = reader.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        });
        Term {
            master,
            child,
            out,
            seen: 0,
        }
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.out.lock().unwrap()).into_owned()
    }

    /// Wait up to `within` until the output after the last match holds `needle`.
    fn wait_for(&mut self, needle: &str, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        loop {
            {
                let out = self.out.lock().unwrap();
                let tail = &out[self.seen.min(out.len())..];
                if let Some(i) = tail
                    .windows(needle.len())
                    .position(|w| w == needle.as_bytes())
                {
                    self.seen += i + needle.len();
                    return true;
                }
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Wait (bounded) until the output after the last match holds `needle`.
    fn expect(&mut self, needle: &str, d: &Daemon) {
        assert!(
            self.wait_for(needle, Duration::from_secs(120)),
            "no `{needle}` on the terminal; it shows:\n{}\n--- daemon log ---\n{}",
            self.text(),
            d.log_tail(40)
        );
    }

    fn send(&mut self, bytes: &[u8]) {
        self.master.write_all(bytes).unwrap();
        self.master.flush().unwrap();
    }

    fn resize(&self, rows: u16, cols: u16) {
        let ws = winsize(rows, cols);
        // SAFETY: TIOCSWINSZ reads one `winsize` from a struct we own; the fd is our master.
        let r = unsafe { libc::ioctl(self.master.as_raw_fd(), libc::TIOCSWINSZ, &ws) };
        assert_eq!(r, 0, "TIOCSWINSZ: {}", std::io::Error::last_os_error());
    }

    /// The CLI's exit code (bounded wait).
    fn exit_code(&mut self) -> Option<i32> {
        wait_bounded(&mut self.child, Duration::from_secs(120)).code()
    }
}

#[test]
fn shell_and_exec_it_work_as_a_terminal_session() {
    let Some(d) = vm_daemon(SMALL_VMS) else {
        return;
    };
    let ws = tempfile::tempdir().unwrap();
    let id = create(&d, ws.path());

    // A shell of the terminal's size; needles are split in the typed command (`ar""med`) so
    // the echo of what is typed never matches, only the command's output does.
    let mut t = Term::spawn(&d, &["shell", &id], 30, 100);
    t.send(b"stty size; tty; echo sh\"\"ell-$TERM\r");
    t.expect("30 100", &d);
    t.expect("/dev/pts/", &d);
    t.expect("shell-xterm", &d);

    // The window changes size: the guest's terminal follows.
    t.resize(40, 120);
    // The resize is a request of its own: ask until the guest sees it (bounded).
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        t.send(b"echo si\"\"ze=$(stty size)=\r");
        if t.wait_for("size=40 120=", Duration::from_secs(5)) {
            break;
        }
        assert!(Instant::now() < deadline, "no resize:\n{}", t.text());
    }

    // Ctrl-C reaches the foreground job in the guest (a byte to its terminal, signalled by the
    // guest's line discipline), not this CLI.
    t.send(b"sh -c 'trap \"echo got\"\"-int; exit 0\" INT; echo ar\"\"med; while :; do sleep 0.1; done'\r");
    t.expect("armed", &d);
    t.send(b"\x03");
    t.expect("got-int", &d);
    t.send(b"echo st\"\"ill-here\r");
    t.expect("still-here", &d);

    // Ctrl-P Ctrl-Q detaches: the CLI exits 0, the shell runs on.
    t.send(b"\x10\x11");
    t.expect("detached", &d);
    assert_eq!(t.exit_code(), Some(0), "{}", t.text());
    let out = d.cli(&["execs", &id]);
    let listing = String::from_utf8_lossy(&out.stdout).into_owned();
    let exec_id = listing
        .lines()
        .find(|l| l.contains("\tshell\t"))
        .and_then(|l| l.split('\t').next())
        .unwrap_or_else(|| panic!("the detached shell is not listed:\n{listing}"))
        .to_owned();

    // Reattached from a terminal it is interactive again, and its exit status is ours.
    let mut t = Term::spawn(&d, &["attach", "--no-replay", &exec_id], 24, 80);
    t.send(b"echo re\"\"attached $(stty size)\r");
    t.expect("reattached 24 80", &d);
    t.send(b"exit 7\r");
    assert_eq!(t.exit_code(), Some(7), "{}", t.text());

    // `exec -it`: a command on a pty, raw mode, exit status carried.
    let mut t = Term::spawn(
        &d,
        &[
            "exec",
            "-it",
            &id,
            "--",
            "sh",
            "-c",
            "read x; echo got-$x; exit 5",
        ],
        24,
        80,
    );
    t.send(b"typed\r");
    t.expect("got-typed", &d);
    assert_eq!(t.exit_code(), Some(5), "{}", t.text());

    // `exec -i` without a terminal: input streamed as read, its end closes the command's stdin.
    let mut child = Command::new(BIN)
        .args(["exec", "-i", &id, "--", "sh", "-c", "cat; echo end"])
        .env("TRYBOXI_HOME", d.home.path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"line one\nline two\n")
        .unwrap();
    let status = wait_bounded(&mut child, Duration::from_secs(120));
    let mut out = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    assert!(status.success(), "{out}\n{}", d.log_tail(30));
    assert_eq!(out, "line one\nline two\nend\n");
}
