//! Kernel modules shipped in the initramfs, loaded by PID 1 before it mounts anything.
//!
//! Owns: reading [`ORDER_FILE`] and `finit_module`-ing each listed module in that order, with
//! the `<module>.<param>=<value>` words of the kernel command line as its parameters (what
//! `modprobe` would pass). The image builder writes the list dependencies first (see
//! `xtask/src/images/modules.rs`), so no dependency resolution happens here. A built kernel
//! has everything built in and its initramfs no list: then nothing happens.
//! Never: loads a module from anywhere but the initramfs, or stops the boot on a failed load
//! (a missing driver shows up as the missing device's own error, e.g. no root disk).

use std::ffi::CString;
use std::path::Path;

/// The load order: one path per line, relative to [`DIR`], dependencies before dependants.
pub const ORDER_FILE: &str = "/lib/modules/tryboxi.order";
pub const DIR: &str = "/lib/modules";

/// The module name a file stands for: `virtio-mmio.ko` and `virtio_mmio.ko` are `virtio_mmio`.
pub fn module_name(path: &str) -> String {
    let file = path.rsplit('/').next().unwrap_or(path);
    file.strip_suffix(".ko").unwrap_or(file).replace('-', "_")
}

/// The parameters for `module` from the kernel command line, space separated:
/// `virtio_mmio.device=512@0xfeb00e00:12` gives `device=512@0xfeb00e00:12` for `virtio_mmio`.
pub fn params_for(module: &str, cmdline: &str) -> String {
    cmdline
        .split_whitespace()
        .filter_map(|w| {
            let (m, rest) = w.split_once('.')?;
            let (_, _) = rest.split_once('=')?;
            (m.replace('-', "_") == module).then_some(rest)
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Load every module [`ORDER_FILE`] lists; returns (loaded, already there). Failures are
/// written to the console and skipped.
pub fn load_all(cmdline: &str) -> (usize, usize) {
    let Ok(order) = std::fs::read_to_string(ORDER_FILE) else {
        return (0, 0);
    };
    let (mut loaded, mut present) = (0, 0);
    for rel in order.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let name = module_name(rel);
        match load_one(&Path::new(DIR).join(rel), &params_for(&name, cmdline)) {
            Ok(()) => loaded += 1,
            Err(nix::Error::EEXIST) => present += 1,
            Err(e) => super::init::console(&format!("tryboxi: module {name}: {e}")),
        }
    }
    (loaded, present)
}

fn load_one(path: &Path, params: &str) -> Result<(), nix::Error> {
    let f = std::fs::File::open(path)
        .map_err(|e| nix::Error::from_raw(e.raw_os_error().unwrap_or(libc::EIO)))?;
    let params = CString::new(params).map_err(|_| nix::Error::EINVAL)?;
    nix::kmod::finit_module(&f, &params, nix::kmod::ModuleInitFlags::empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_kernel_convention() {
        assert_eq!(
            module_name("kernel/drivers/virtio/virtio_mmio.ko"),
            "virtio_mmio"
        );
        assert_eq!(module_name("nf-nat.ko"), "nf_nat");
    }

    #[test]
    fn params_are_the_modules_own_cmdline_words() {
        let c = "console=ttyS0 virtio_mmio.device=512@0xfeb00e00:12 quiet \
                 virtio-mmio.device=512@0xfeb00c00:11 virtio_blk.queue_depth=8 tryboxi.root=x \
                 virtio_mmio.bogus";
        assert_eq!(
            params_for("virtio_mmio", c),
            "device=512@0xfeb00e00:12 device=512@0xfeb00c00:11"
        );
        assert_eq!(params_for("virtio_blk", c), "queue_depth=8");
        assert_eq!(params_for("overlay", c), "");
    }

    #[test]
    fn without_a_list_nothing_is_loaded() {
        // The host running the tests has no /lib/modules/tryboxi.order (only our initramfs has).
        if Path::new(ORDER_FILE).exists() {
            println!("skipped: {ORDER_FILE} exists on this machine");
            return;
        }
        assert_eq!(load_all(""), (0, 0));
    }
}
