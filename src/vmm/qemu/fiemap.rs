//! Which parts of a file are reserved but never written: its unwritten extents, from the
//! `FS_IOC_FIEMAP` ioctl.
//!
//! Owns: the ioctl and its structures (`linux/fiemap.h`). [`super::ramfile`] uses it to drop
//! cached zero pages over a RAM file's reserve without touching the cache of written data.

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

/// The `(offset, length)` ranges of `f` in unwritten extents, in file order. An error when the
/// file system has no FIEMAP (tmpfs, for one).
pub fn unwritten_ranges(f: &File) -> std::io::Result<Vec<(u64, u64)>> {
    unwritten_in(f, 0, u64::MAX)
}

/// Whether all of `[off, off + len)` lies in unwritten extents.
pub fn all_unwritten(f: &File, off: u64, len: u64) -> std::io::Result<bool> {
    let mut at = off;
    for (o, l) in unwritten_in(f, off, len)? {
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

/// The unwritten ranges of the extents that overlap `[start, start + length)`, merged.
fn unwritten_in(f: &File, start: u64, length: u64) -> std::io::Result<Vec<(u64, u64)>> {
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
                    _ => out.push((e.logical, e.length)),
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
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f");
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&p)
            .unwrap();
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
}
