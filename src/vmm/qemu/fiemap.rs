//! Which parts of a file are reserved but never written: its unwritten extents, from the
//! `FS_IOC_FIEMAP` ioctl.
//!
//! Owns: the ioctl and its structures (`linux/fiemap.h`). [`super::ramfile`] uses it to find a
//! live RAM file's reserve, whose cached zero pages a snapshot skips instead of copying.

use std::fs::File;
use std::os::fd::AsRawFd;

/// `struct fiemap` without its trailing extent array (the size the ioctl number encodes).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct Header {
    start: u64,
    length: u64,
    flags: u32,
    mapped_extents: u32,
    extent_count: u32,
    reserved: u32,
}

/// `struct fiemap_extent`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct Extent {
    logical: u64,
    physical: u64,
    length: u64,
    reserved64: [u64; 2],
    flags: u32,
    reserved: [u32; 3],
}

/// Extents asked for per call.
const BATCH: usize = 128;

/// A header followed by room for [`BATCH`] extents, as the kernel fills it.
#[repr(C)]
struct Request {
    header: Header,
    extents: [Extent; BATCH],
}

const FIEMAP_EXTENT_LAST: u32 = 0x1;
const FIEMAP_EXTENT_UNWRITTEN: u32 = 0x800;

nix::ioctl_readwrite!(fs_ioc_fiemap, b'f', 11, Header);

/// At most this many extents are looked at (a RAM file of 64 GiB in 4 KiB extents is 16 M):
/// past it the rest of the file is left as it is.
const MAX_EXTENTS: usize = 1 << 24;
/// At most this many ranges are returned (16 MiB): the guest decides the layout (a page written
/// in every other one makes as many ranges as pages). Past it the rest of the file counts as
/// written, which costs a bigger copy, never a wrong one.
const MAX_RANGES: usize = 1 << 20;

/// The `(offset, length)` ranges of `f` in unwritten extents, in file order. An error when the
/// file system has no FIEMAP (tmpfs, for one).
pub fn unwritten_ranges(f: &File) -> std::io::Result<Vec<(u64, u64)>> {
    unwritten_in(f, 0, u64::MAX, MAX_RANGES)
}

/// Whether all of `[off, off + len)` lies in unwritten extents.
pub fn all_unwritten(f: &File, off: u64, len: u64) -> std::io::Result<bool> {
    let mut at = off;
    for (o, l) in unwritten_in(f, off, len, MAX_RANGES)? {
        if o > at {
            return Ok(false);
        }
        at = at.max(o + l);
        if at >= off + len {
            return Ok(true);
        }
    }
    Ok(at >= off + len)
}

/// The unwritten ranges of the extents that overlap `[start, start + length)`, merged; the
/// first `max_ranges` of them.
fn unwritten_in(
    f: &File,
    start: u64,
    length: u64,
    max_ranges: usize,
) -> std::io::Result<Vec<(u64, u64)>> {
    let end = start.saturating_add(length);
    let mut out: Vec<(u64, u64)> = Vec::new();
    let mut req = Box::new(Request {
        header: Header::default(),
        extents: [Extent::default(); BATCH],
    });
    let mut pos = start;
    let mut seen = 0usize;
    loop {
        req.header = Header {
            start: pos,
            length: end - pos,
            extent_count: BATCH as u32,
            ..Header::default()
        };
        // SAFETY: `req` is a `struct fiemap` header followed by room for `extent_count`
        // extents, as the ioctl expects; the kernel writes at most that many. The descriptor is
        // an open file we own.
        unsafe { fs_ioc_fiemap(f.as_raw_fd(), (&mut req.header) as *mut Header) }
            .map_err(std::io::Error::from)?;
        let n = (req.header.mapped_extents as usize).min(BATCH);
        if n == 0 {
            return Ok(out);
        }
        for e in &req.extents[..n] {
            if e.flags & FIEMAP_EXTENT_UNWRITTEN != 0 && e.length > 0 {
                match out.last_mut() {
                    Some(last) if last.0 + last.1 == e.logical => last.1 += e.length,
                    _ => {
                        if out.len() >= max_ranges {
                            return Ok(out);
                        }
                        out.push((e.logical, e.length));
                    }
                }
            }
            if e.flags & FIEMAP_EXTENT_LAST != 0 {
                return Ok(out);
            }
        }
        seen += n;
        let last = &req.extents[n - 1];
        let next = last.logical.saturating_add(last.length);
        if next <= pos || next >= end || seen >= MAX_EXTENTS {
            return Ok(out);
        }
        pos = next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Seek, SeekFrom, Write};

    #[test]
    fn the_header_and_extent_match_the_kernel_layout() {
        assert_eq!(std::mem::size_of::<Header>(), 32);
        assert_eq!(std::mem::size_of::<Extent>(), 56);
    }

    #[test]
    fn reserved_ranges_are_unwritten_and_written_ones_are_not() {
        let mut f = tempfile::tempfile().unwrap();
        f.set_len(8 << 20).unwrap();
        // The temporary directory is on the data root's kind of file system (ext4 here), as
        // the RAM file tests assume.
        nix::fcntl::fallocate(&f, nix::fcntl::FallocateFlags::empty(), 0, 8 << 20)
            .expect("this file system cannot fallocate");
        // Written and flushed: that extent is no longer unwritten.
        f.seek(SeekFrom::Start(1 << 20)).unwrap();
        f.write_all(&[5u8; 1 << 20]).unwrap();
        f.sync_all().unwrap();
        let r = unwritten_ranges(&f).expect("FIEMAP on this file system");
        assert!(all_unwritten(&f, 2 << 20, 6 << 20).unwrap());
        assert!(all_unwritten(&f, 0, 1 << 20).unwrap());
        assert!(!all_unwritten(&f, 0, 2 << 20).unwrap());
        assert!(!all_unwritten(&f, (1 << 20) + 4096, 4096).unwrap());
        let total: u64 = r.iter().map(|x| x.1).sum();
        assert_eq!(total, 7 << 20, "{r:?}");
        assert!(
            r.iter().all(|(o, l)| o + l <= 1 << 20 || *o >= 2 << 20),
            "the written MiB is not unwritten: {r:?}"
        );
    }

    #[test]
    fn a_guest_made_checkerboard_returns_at_most_the_cap() {
        // Every other 64 KiB written back: as many unwritten ranges as written ones.
        let mut f = tempfile::tempfile().unwrap();
        nix::fcntl::fallocate(&f, nix::fcntl::FallocateFlags::empty(), 0, 4 << 20)
            .expect("this file system cannot fallocate");
        for i in (0..64u64).step_by(2) {
            f.seek(SeekFrom::Start(i << 16)).unwrap();
            f.write_all(&[1u8; 1 << 16]).unwrap();
        }
        f.sync_all().unwrap();
        let all = unwritten_in(&f, 0, u64::MAX, MAX_RANGES).unwrap();
        assert_eq!(all.len(), 32, "{all:?}");
        let capped = unwritten_in(&f, 0, u64::MAX, 5).unwrap();
        assert_eq!(capped, all[..5]);
    }
}
