//! Guest RAM files: copying the allocated parts of a (sparse) RAM file, and removing one.
//!
//! A VM's RAM file is as large as its memory but sparse: only pages the guest touched take
//! space. Freezing it for a snapshot copies only the data extents (`SEEK_DATA`/`SEEK_HOLE`)
//! with `copy_file_range`, so the cost follows what the guest used, not its memory size.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;

use crate::vmm::VmmError;

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> VmmError + '_ {
    move |source| VmmError::Io {
        path: path.to_owned(),
        source,
    }
}

/// `lseek(fd, off, whence)`; `None` at end of file (ENXIO).
fn seek(f: &File, off: u64, whence: libc::c_int) -> std::io::Result<Option<u64>> {
    // SAFETY: lseek on a file descriptor we own; no memory is passed.
    let r = unsafe { libc::lseek(f.as_raw_fd(), off as libc::off_t, whence) };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ENXIO) {
            return Ok(None);
        }
        return Err(e);
    }
    Ok(Some(r as u64))
}

/// Copy `len` bytes at `off` from `src` to the same offset in `dst`.
fn copy_range(src: &File, dst: &File, off: u64, len: u64) -> std::io::Result<()> {
    // The range's blocks first, as unwritten extents (the same blocks the copy takes anyway):
    // writes into allocated blocks skip ext4's per-page delayed allocation. Measured on a
    // 68 MiB RAM file of 1,238 extents: 30-40 instead of 33-43 ms of CPU. Where the file
    // system cannot (EOPNOTSUPP), the copy allocates as it goes.
    // SAFETY: fallocate on a descriptor we own, with integers.
    let r = unsafe {
        libc::fallocate(
            dst.as_raw_fd(),
            libc::FALLOC_FL_KEEP_SIZE,
            off as libc::off_t,
            len as libc::off_t,
        )
    };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EOPNOTSUPP) {
            return Err(e);
        }
    }
    let mut done = 0u64;
    while done < len {
        let mut in_off = (off + done) as libc::loff_t;
        let mut out_off = in_off;
        let want = (len - done).min(1 << 30) as usize;
        // SAFETY: both descriptors are open files we own; the offsets are valid pointers to
        // locals that the kernel updates.
        let n = unsafe {
            libc::copy_file_range(
                src.as_raw_fd(),
                &mut in_off,
                dst.as_raw_fd(),
                &mut out_off,
                want,
                0,
            )
        };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        if n == 0 {
            break;
        }
        done += n as u64;
    }
    Ok(())
}

/// Copy the RAM file `src` of a running (paused) VM to `dst` (replaced atomically), keeping
/// holes. Returns the bytes copied (what the guest used; see [`copy_data`]).
pub fn copy_sparse(src: &Path, dst: &Path) -> Result<u64, VmmError> {
    let from = File::open(src).map_err(io(src))?;
    let size = from.metadata().map_err(io(src))?.len();
    let tmp = dst.with_extension("tmp");
    let to = File::create(&tmp).map_err(io(&tmp))?;
    to.set_len(size).map_err(io(&tmp))?;
    let copied = copy_data(&from, src, &to, dst, true)?;
    std::fs::rename(&tmp, dst).map_err(io(dst))?;
    Ok(copied)
}

/// Copy the data extents of `from` (at `src`) to the same offsets of `to` (at `dst`).
///
/// `live`: `from` is a running VM's own RAM file. That file is reserved with unwritten extents
/// ([`preallocate`]), and `SEEK_DATA` counts an unwritten range as data wherever the page cache
/// holds a page of it. Read-ahead puts zero pages there around every page the guest faults in
/// (and around every range a copy reads), so a scan of a live RAM file found nearly all of it
/// "data": a snapshot a second after boot copied all 512 MiB instead of the 72 the guest used,
/// and every restore and fork of it copied them again. So data in unwritten extents (FIEMAP)
/// goes through [`copy_reserved`], which skips what is provably zeros without reading it;
/// data in written extents goes by `copy_file_range` as before. Nothing is dropped from the
/// cache and no writeback is started (dropping the reserve's cache with
/// `POSIX_FADV_DONTNEED` worked too, but it started the writeback of every dirty guest page
/// inside the paused window: snapshots took 1.3x; reading all of it to skip zero pages took
/// 0.7 s right after boot). A frozen RAM file (not `live`) has real holes, which no cached page
/// turns into data.
fn copy_data(from: &File, src: &Path, to: &File, dst: &Path, live: bool) -> Result<u64, VmmError> {
    let size = from.metadata().map_err(io(src))?.len();
    let t0 = std::time::Instant::now();
    let unwritten = match live {
        true => super::fiemap::unwritten_ranges(from).unwrap_or_else(|e| {
            tracing::debug!(src = %src.display(), error = %e, "no FIEMAP: cached zero pages of the reserve are copied too");
            Vec::new()
        }),
        false => Vec::new(),
    };
    let mut u = unwritten.iter().peekable();
    let mut copied = 0u64;
    let mut pos = 0u64;
    while pos < size {
        let Some(data) = seek(from, pos, libc::SEEK_DATA).map_err(io(src))? else {
            break;
        };
        let end = seek(from, data, libc::SEEK_HOLE)
            .map_err(io(src))?
            .unwrap_or(size);
        // Split [data, end) at the unwritten ranges (both lists are in file order).
        let mut at = data;
        while at < end {
            while u.peek().is_some_and(|(o, l)| o + l <= at) {
                u.next();
            }
            let (piece_end, in_reserve) = match u.peek() {
                Some(&&(o, l)) if o <= at => ((o + l).min(end), true),
                Some(&&(o, _)) => (o.min(end), false),
                None => (end, false),
            };
            copied += if in_reserve {
                copy_reserved(from, to, at, piece_end - at).map_err(io(dst))?
            } else {
                copy_range(from, to, at, piece_end - at).map_err(io(dst))?;
                piece_end - at
            };
            at = piece_end;
        }
        pos = end;
    }
    tracing::debug!(src = %src.display(), live, copied, us = t0.elapsed().as_micros() as u64, "RAM file copied");
    Ok(copied)
}

/// Copy `len` bytes at `off` of a live RAM file's reserve (unwritten extents, as FIEMAP said)
/// from `src` to `dst`, in 2 MiB pieces (`cachestat(2)` counts their dirty and writeback
/// pages): a piece all of whose pages are dirty or under writeback is guest data and goes by
/// `copy_file_range`; a piece with none, which FIEMAP asked after that still shows all
/// unwritten, holds only zeros and is skipped; any other piece is read and its non-zero pages
/// written ([`copy_nonzero`]).
///
/// Why skipping is safe: the VM is paused, so nothing dirties a page during the copy. Over an
/// unwritten extent a page holds data only once the guest wrote it, and then it is dirty, or
/// under writeback until ext4 has converted the extent to written (ext4 ends the writeback of
/// a bio into unwritten extents only after the conversion). Extents never go back from written
/// to unwritten (the reserve only fills holes). So a page clean at the `cachestat` and in an
/// extent still unwritten after it was never written: it reads as zero. Without `cachestat`
/// (Linux before 6.5) every piece is read.
fn copy_reserved(src: &File, dst: &File, off: u64, len: u64) -> std::io::Result<u64> {
    const PIECE: u64 = 2 << 20;
    let end = off + len;
    let mut written = 0u64;
    let mut at = off;
    let mut buf = Vec::new();
    while at < end {
        let n = (PIECE - at % PIECE).min(end - at);
        match cache_state(src, at, n) {
            // Every page is guest data (a restored VM's RAM is dirty pages over the reserve):
            // copied in the kernel, no zero page along.
            Ok(c) if c.busy_pages * 4096 >= n => {
                copy_range(src, dst, at, n)?;
                written += n;
            }
            Ok(c)
                if c.busy_pages == 0
                    && super::fiemap::all_unwritten(src, at, n).unwrap_or(false) => {}
            _ => written += copy_nonzero(src, dst, at, n, &mut buf)?,
        }
        at += n;
    }
    Ok(written)
}

/// `cachestat(2)` (Linux 6.5; the same number on every architecture since 4.20's table).
const SYS_CACHESTAT: libc::c_long = 451;

/// What the page cache holds of a range.
pub(super) struct CacheState {
    /// Pages dirty or under writeback.
    pub(super) busy_pages: u64,
    /// Pages in the cache (read by tests).
    #[cfg(test)]
    pub(super) cached_pages: u64,
}

/// Whether any cached page of `[off, off + len)` of `f` is dirty or under writeback.
#[cfg(test)]
fn cache_busy(f: &File, off: u64, len: u64) -> std::io::Result<bool> {
    cache_state(f, off, len).map(|c| c.busy_pages > 0)
}

/// The cached, dirty and writeback page counts of `[off, off + len)` of `f`.
pub(super) fn cache_state(f: &File, off: u64, len: u64) -> std::io::Result<CacheState> {
    #[repr(C)]
    struct Range {
        off: u64,
        len: u64,
    }
    #[repr(C)]
    #[derive(Default)]
    struct Stat {
        nr_cache: u64,
        nr_dirty: u64,
        nr_writeback: u64,
        nr_evicted: u64,
        nr_recently_evicted: u64,
    }
    let range = Range { off, len };
    let mut st = Stat::default();
    // SAFETY: cachestat reads `range` and writes one `struct cachestat` into `st`, both live
    // locals of the kernel's layout; `f` is an open file we own.
    let r = unsafe {
        libc::syscall(
            SYS_CACHESTAT,
            f.as_raw_fd(),
            &range as *const Range,
            &mut st as *mut Stat,
            0u32,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(CacheState {
        busy_pages: st.nr_dirty + st.nr_writeback,
        #[cfg(test)]
        cached_pages: st.nr_cache,
    })
}

/// Copy the non-zero 4 KiB pages of `len` bytes at `off` from `src` to the same offsets of
/// `dst` (zero pages stay holes there), through `buf` (made 256 KiB on first use, reused by
/// the caller's next call). Returns the bytes written.
fn copy_nonzero(
    src: &File,
    dst: &File,
    off: u64,
    len: u64,
    buf: &mut Vec<u8>,
) -> std::io::Result<u64> {
    use std::os::unix::fs::FileExt;
    const PAGE: usize = 4096;
    buf.resize(256 * 1024, 0);
    let mut written = 0u64;
    let mut done = 0u64;
    while done < len {
        let want = (len - done).min(buf.len() as u64) as usize;
        let got = src.read_at(&mut buf[..want], off + done)?;
        if got == 0 {
            break;
        }
        // Runs of non-zero pages, written one run at a time.
        let mut i = 0;
        while i < got {
            let page_end = (i + PAGE).min(got);
            if buf[i..page_end].iter().all(|b| *b == 0) {
                i = page_end;
                continue;
            }
            let start = i;
            while i < got && buf[i..(i + PAGE).min(got)].iter().any(|b| *b != 0) {
                i = (i + PAGE).min(got);
            }
            dst.write_all_at(&buf[start..i], off + done + start as u64)?;
            written += (i - start) as u64;
        }
        done += got as u64;
    }
    Ok(written)
}

/// A RAM file being filled in place: [`fill_in_place`] makes `dst` a new file (a new inode: a
/// VM still mapping the old one keeps it) of `src`'s size at once, so a QEMU can be launched
/// on it while the data is copied on a blocking thread; [`Filling::wait`] before the VM's
/// state is loaded (device state refers to guest RAM).
pub struct Filling {
    task: tokio::task::JoinHandle<Result<u64, VmmError>>,
    dst: std::path::PathBuf,
}

/// Start filling `dst` from the RAM file `src` (see [`Filling`]).
pub fn fill_in_place(src: &Path, dst: &Path) -> Result<Filling, VmmError> {
    let from = File::open(src).map_err(io(src))?;
    let size = from.metadata().map_err(io(src))?.len();
    remove(dst)?;
    let to = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(dst)
        .map_err(io(dst))?;
    to.set_len(size).map_err(io(dst))?;
    let (s, d) = (src.to_path_buf(), dst.to_path_buf());
    let task = tokio::task::spawn_blocking(move || copy_data(&from, &s, &to, &d, false));
    Ok(Filling {
        task,
        dst: dst.to_path_buf(),
    })
}

impl Filling {
    /// Wait until the copy is done; the bytes copied.
    pub async fn wait(self) -> Result<u64, VmmError> {
        self.task.await.map_err(|e| VmmError::Io {
            path: self.dst,
            source: std::io::Error::other(e),
        })?
    }
}

/// [`copy_sparse`] on a blocking thread: copying a RAM file takes tens of milliseconds and must
/// not hold up the runtime thread other sandboxes' requests run on.
pub async fn copy_sparse_async(src: &Path, dst: &Path) -> Result<u64, VmmError> {
    let (s, d) = (src.to_path_buf(), dst.to_path_buf());
    tokio::task::spawn_blocking(move || copy_sparse(&s, &d))
        .await
        .map_err(|e| VmmError::Io {
            path: dst.to_path_buf(),
            source: std::io::Error::other(e),
        })?
}

/// Reserve the blocks of the VM's own RAM file at `path` (`size` bytes; made if absent) before
/// QEMU maps it. QEMU maps guest RAM from this file shared: a page the guest touches first
/// takes a block then, and on a full filesystem that page fault is a SIGBUS that kills QEMU (a
/// guest filling the data root with its own disk writes did exactly that). Reserved blocks are
/// unwritten extents (no data is written; `SEEK_DATA` skips them where the page cache holds
/// nothing, and [`copy_sparse`] drops the zero pages read-ahead left there first, so a snapshot
/// copies only what the guest used); a full filesystem then fails the start with ENOSPC.
/// `Ok(false)` when the filesystem cannot reserve (EOPNOTSUPP): the file stays sparse.
pub fn preallocate(path: &Path, size: u64) -> Result<bool, VmmError> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)
        .map_err(io(path))?;
    match nix::fcntl::fallocate(
        &f,
        nix::fcntl::FallocateFlags::empty(),
        0,
        size as libc::off_t,
    ) {
        Ok(()) => Ok(true),
        Err(nix::errno::Errno::EOPNOTSUPP) => Ok(false),
        Err(e) => Err(io(path)(std::io::Error::from(e))),
    }
}

/// Reserve again the blocks of a running VM's own RAM file that free page reporting gave
/// back: QEMU discards a page the guest reported free by punching a hole in the file, which
/// frees its memory and its reserved block at once. Allocating the holes again (`fallocate`
/// mode 0 allocates only what is missing, as unwritten extents: no page cache, so the memory
/// stays freed, and no data changes) restores [`preallocate`]'s promise. Never creates a
/// file (a clone running on a borrowed file has none of its own). Returns the bytes that were
/// missing (0 when the file is whole or absent); an error when they cannot be reserved (a
/// full filesystem): the VM runs on, exposed until room comes back.
pub fn rereserve(path: &Path) -> Result<u64, VmmError> {
    use std::os::unix::fs::MetadataExt;
    let f = match std::fs::OpenOptions::new().write(true).open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(io(path)(e)),
    };
    let md = f.metadata().map_err(io(path))?;
    let held = md.blocks().saturating_mul(512);
    if held >= md.len() {
        return Ok(0);
    }
    match nix::fcntl::fallocate(
        &f,
        nix::fcntl::FallocateFlags::empty(),
        0,
        md.len() as libc::off_t,
    ) {
        Ok(()) | Err(nix::errno::Errno::EOPNOTSUPP) => Ok(md.len() - held),
        Err(e) => Err(io(path)(std::io::Error::from(e))),
    }
}

/// Give back the blocks [`preallocate`] reserved but the guest never wrote (a VM paused to
/// disk keeps only its data): every range `SEEK_HOLE` reports is punched. Such a range reads
/// as zeros either way (an unwritten extent, or a page cache page the kernel counts as data
/// is not in it: dirty and read pages are reported as data), so nothing is lost. Best effort:
/// the bytes given back, 0 when the filesystem cannot punch.
pub fn release_reserve(path: &Path) -> u64 {
    let Ok(f) = std::fs::OpenOptions::new().write(true).open(path) else {
        return 0;
    };
    let size = f.metadata().map(|m| m.len()).unwrap_or(0);
    let mut freed = 0u64;
    let mut pos = 0u64;
    while pos < size {
        let Ok(Some(hole)) = seek(&f, pos, libc::SEEK_HOLE) else {
            break;
        };
        if hole >= size {
            break;
        }
        let end = seek(&f, hole, libc::SEEK_DATA)
            .ok()
            .flatten()
            .unwrap_or(size);
        let flags = nix::fcntl::FallocateFlags::FALLOC_FL_PUNCH_HOLE
            | nix::fcntl::FallocateFlags::FALLOC_FL_KEEP_SIZE;
        if nix::fcntl::fallocate(&f, flags, hole as libc::off_t, (end - hole) as libc::off_t)
            .is_err()
        {
            break;
        }
        freed += end - hole;
        pos = end;
    }
    freed
}

/// Bytes of `path` that hold data (`SEEK_DATA` extents): what [`copy_sparse`] would copy.
/// Blocks [`preallocate`] reserved are not data until the guest writes them (a read of one
/// brings a zero page into the page cache, which then counts). 0 for a missing file.
pub fn data_bytes(path: &Path) -> u64 {
    let Ok(f) = File::open(path) else {
        return 0;
    };
    let size = f.metadata().map(|m| m.len()).unwrap_or(0);
    let mut total = 0u64;
    let mut pos = 0u64;
    while pos < size {
        let Ok(Some(data)) = seek(&f, pos, libc::SEEK_DATA) else {
            break;
        };
        let end = seek(&f, data, libc::SEEK_HOLE)
            .ok()
            .flatten()
            .unwrap_or(size);
        total += end.saturating_sub(data);
        pos = end.max(data + 1);
    }
    total
}

/// Remove a RAM file if it exists.
pub fn remove(path: &Path) -> Result<(), VmmError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io(path)(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Seek, SeekFrom, Write};

    #[test]
    fn copies_data_and_keeps_holes() {
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("a.ram");
        let mut f = File::create(&src).unwrap();
        f.set_len(64 << 20).unwrap();
        f.seek(SeekFrom::Start(1 << 20)).unwrap();
        f.write_all(&[7u8; 8192]).unwrap();
        f.seek(SeekFrom::Start(40 << 20)).unwrap();
        f.write_all(b"tail").unwrap();
        drop(f);
        let dst = d.path().join("b.ram");
        let n = copy_sparse(&src, &dst).unwrap();
        assert!((8192..8 << 20).contains(&n), "copied {n}");
        let a = std::fs::read(&src).unwrap();
        let b = std::fs::read(&dst).unwrap();
        assert_eq!(a.len(), b.len());
        assert!(a == b);
        use std::os::unix::fs::MetadataExt;
        assert!(std::fs::metadata(&dst).unwrap().blocks() * 512 < 8 << 20);
    }

    #[test]
    fn preallocated_ram_keeps_its_data_and_counts_only_written_extents() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("mem.ram");
        std::fs::write(&p, b"").unwrap();
        let mut f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
        f.set_len(32 << 20).unwrap();
        f.seek(SeekFrom::Start(5 << 20)).unwrap();
        f.write_all(&[9u8; 4096]).unwrap();
        drop(f);
        assert!(
            preallocate(&p, 32 << 20).unwrap(),
            "this filesystem cannot fallocate"
        );
        use std::os::unix::fs::MetadataExt;
        let md = std::fs::metadata(&p).unwrap();
        assert_eq!(md.len(), 32 << 20);
        // Every block reserved: a first touch of any page cannot meet a full filesystem.
        assert!(
            md.blocks() * 512 >= 32 << 20,
            "{} bytes reserved",
            md.blocks() * 512
        );
        // Only the written extent counts as data (before anything reads the rest: a read
        // brings zero pages into the page cache, and those count).
        let n = data_bytes(&p);
        assert!((4096..=1 << 20).contains(&n), "{n} data bytes");
        // Giving the reserve back keeps the data and frees the rest.
        assert!(release_reserve(&p) >= 30 << 20);
        let md = std::fs::metadata(&p).unwrap();
        assert_eq!(md.len(), 32 << 20);
        assert!(
            md.blocks() * 512 <= 1 << 20,
            "{} bytes kept",
            md.blocks() * 512
        );
        let all = std::fs::read(&p).unwrap();
        assert_eq!(&all[5 << 20..(5 << 20) + 4096], &[9u8; 4096][..]);
        assert!(all[..5 << 20].iter().all(|b| *b == 0));
        // A file made by it is the VM's size and owner-only.
        let q = d.path().join("new.ram");
        preallocate(&q, 8 << 20).unwrap();
        let md = std::fs::metadata(&q).unwrap();
        assert_eq!((md.len(), md.mode() & 0o777), (8 << 20, 0o600));
        assert_eq!(data_bytes(&q), 0);
        // A page written into the reserve (as a guest does: dirty in the page cache, its
        // extent still unwritten on disk) is data, and giving the reserve back keeps it.
        let mut f = std::fs::OpenOptions::new().write(true).open(&q).unwrap();
        f.seek(SeekFrom::Start(3 << 20)).unwrap();
        f.write_all(&[7u8; 8192]).unwrap();
        drop(f);
        assert_eq!(data_bytes(&q), 8192);
        assert!(release_reserve(&q) >= 7 << 20);
        let all = std::fs::read(&q).unwrap();
        assert_eq!(&all[3 << 20..(3 << 20) + 8192], &[7u8; 8192][..]);
        assert_eq!(all.iter().filter(|b| **b != 0).count(), 8192);
        assert_eq!(data_bytes(&d.path().join("missing")), 0);
    }

    #[test]
    fn cachestat_sees_dirty_pages_until_they_are_written_back() {
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&[1u8; 8192]).unwrap();
        assert!(cache_busy(&f, 0, 8192).expect("cachestat (Linux 6.5)"));
        assert!(!cache_busy(&f, 8192, 8192).unwrap());
        f.sync_all().unwrap();
        assert!(!cache_busy(&f, 0, 8192).unwrap());
    }

    #[test]
    fn a_copy_of_a_reserved_file_skips_the_zero_pages_read_ahead_left_in_the_cache() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("mem.ram");
        assert!(
            preallocate(&p, 64 << 20).unwrap(),
            "this filesystem cannot fallocate"
        );
        // A MiB written back to disk long ago (a written extent: copied as it is).
        let mut f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
        f.seek(SeekFrom::Start(32 << 20)).unwrap();
        f.write_all(&[3u8; 1 << 20]).unwrap();
        f.sync_all().unwrap();
        drop(f);
        // What a running VM's file looks like: read-ahead around the guest's faults filled
        // the page cache with zero pages (here: all of it), and the guest wrote a few pages.
        let all = std::fs::read(&p).unwrap();
        assert_eq!(all.iter().filter(|b| **b != 0).count(), 1 << 20);
        assert!(
            data_bytes(&p) >= 60 << 20,
            "read-ahead made it data: {}",
            data_bytes(&p)
        );
        let mut f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
        for page in [3u64, 1000, 9000, 16000] {
            f.seek(SeekFrom::Start(page * 4096)).unwrap();
            f.write_all(&[page as u8 | 1; 4096]).unwrap();
        }
        // A whole 2 MiB piece of guest data, dirty (as a restored VM's RAM is).
        f.seek(SeekFrom::Start(40 << 20)).unwrap();
        f.write_all(&[9u8; 2 << 20]).unwrap();
        drop(f);
        let dst = d.path().join("frozen.ram");
        let n = copy_sparse(&p, &dst).unwrap();
        assert!(
            ((3 << 20) + 4 * 4096..=4 << 20).contains(&n),
            "copied {n} bytes of a file with 3 MiB + 16 KiB written"
        );
        assert!(std::fs::read(&p).unwrap() == std::fs::read(&dst).unwrap());
        use std::os::unix::fs::MetadataExt;
        assert!(std::fs::metadata(&dst).unwrap().blocks() * 512 <= 4 << 20);
    }

    #[test]
    fn a_punched_reserve_is_reserved_again_keeping_data_and_holes_read_zero() {
        use std::os::unix::fs::MetadataExt;
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("mem.ram");
        assert!(preallocate(&p, 16 << 20).unwrap(), "no fallocate here");
        let mut f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
        f.seek(SeekFrom::Start(2 << 20)).unwrap();
        f.write_all(&[5u8; 8192]).unwrap();
        f.seek(SeekFrom::Start(9 << 20)).unwrap();
        f.write_all(&[6u8; 4 << 20]).unwrap();
        // What QEMU does with a reported free range: punch it.
        let flags = nix::fcntl::FallocateFlags::FALLOC_FL_PUNCH_HOLE
            | nix::fcntl::FallocateFlags::FALLOC_FL_KEEP_SIZE;
        nix::fcntl::fallocate(&f, flags, 9 << 20, 4 << 20).unwrap();
        drop(f);
        let blocks = |p: &Path| std::fs::metadata(p).unwrap().blocks() * 512;
        assert!(blocks(&p) <= 12 << 20, "{} held", blocks(&p));
        let missing = rereserve(&p).unwrap();
        assert!(missing >= 4 << 20, "{missing} missing");
        assert!(blocks(&p) >= 16 << 20, "{} held", blocks(&p));
        // Whole again: nothing to do.
        assert_eq!(rereserve(&p).unwrap(), 0);
        // The data stays, the punched range reads zero and is not data (a snapshot skips it).
        let all = std::fs::read(&p).unwrap();
        assert_eq!(&all[2 << 20..(2 << 20) + 8192], &[5u8; 8192][..]);
        assert_eq!(all.iter().filter(|b| **b != 0).count(), 8192);
        // A missing file is not made.
        let none = d.path().join("absent.ram");
        assert_eq!(rereserve(&none).unwrap(), 0);
        assert!(!none.exists());
    }

    #[tokio::test]
    async fn fills_a_new_inode_in_place_and_the_old_one_stays_intact() {
        use std::io::Read;
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("snap.ram");
        let mut f = File::create(&src).unwrap();
        f.set_len(16 << 20).unwrap();
        f.seek(SeekFrom::Start(3 << 20)).unwrap();
        f.write_all(&[9u8; 4096]).unwrap();
        drop(f);
        // The VM being replaced still has the old file open.
        let dst = d.path().join("mem.ram");
        std::fs::write(&dst, b"old VM's memory").unwrap();
        let mut old = File::open(&dst).unwrap();
        let filling = fill_in_place(&src, &dst).unwrap();
        // Sized at once, before the data is there: a QEMU can map it now.
        assert_eq!(std::fs::metadata(&dst).unwrap().len(), 16 << 20);
        let n = filling.wait().await.unwrap();
        assert!((4096..1 << 20).contains(&n), "copied {n}");
        assert!(std::fs::read(&dst).unwrap() == std::fs::read(&src).unwrap());
        let mut was = String::new();
        old.read_to_string(&mut was).unwrap();
        assert_eq!(was, "old VM's memory");
        // A missing source is an error before anything is removed.
        std::fs::write(d.path().join("keep.ram"), b"x").unwrap();
        assert!(fill_in_place(&d.path().join("nope"), &d.path().join("keep.ram")).is_err());
        assert_eq!(std::fs::read(d.path().join("keep.ram")).unwrap(), b"x");
    }
}
