//! Swap files: one private, already-unlinked file per directory, and the growth of its
//! reserved (fallocated) region. The only place the swap tier opens files or asks the file
//! system for space.
//!
//! # Note [private swap files]
//! A swap file holds activations: nobody else may read it, and nothing may outlive the
//! process, even after SIGKILL. So the file is made with `O_TMPFILE` (anonymous from the start,
//! never linked into the directory) and mode 0600. Where the file system refuses `O_TMPFILE`,
//! a fresh `spillover-swap-<pid>-<n>-<random>` is created with `O_CREAT | O_EXCL | O_NOFOLLOW`
//! (so a planted file or symlink is never opened) and unlinked at once; only a kill between
//! those two calls can leave it behind. Directories given as symlinks are followed: the
//! directory is resolved once with `canonicalize` at open and the resolved path is what error
//! messages name.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::error::{Error, Result};
use crate::extent::GRANULE;

/// The reserved region grows by at least this much at a time, so fallocate is rare.
const RESERVE_STEP: u64 = 64 << 20;

/// One directory's swap file.
#[derive(Debug)]
pub(crate) struct SwapFile {
    fd: OwnedFd,
    /// The directory, resolved (symlinks followed).
    pub dir: PathBuf,
    /// What error messages name: the directory for an `O_TMPFILE` file, else the unlinked name.
    pub path: PathBuf,
    /// Opened with `O_DIRECT`.
    pub direct: bool,
    /// False once the file system answered EOPNOTSUPP: space is then only a file size.
    fallocate: AtomicBool,
}

/// Check a swap directory and resolve it: it must exist and be a directory.
pub(crate) fn resolve_dir(dir: &Path) -> Result<PathBuf> {
    let resolved = match std::fs::canonicalize(dir) {
        Ok(p) => p,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(Error::Invalid(format!(
                "swap directory {} does not exist: create it (mkdir -p) or point \
                 SPILLOVER_NVME_PATH at an existing directory",
                dir.display()
            )))
        }
        Err(e) => {
            return Err(Error::Io {
                op: "resolve swap directory",
                path: dir.to_path_buf(),
                offset: 0,
                source: e,
            })
        }
    };
    let meta = std::fs::metadata(&resolved).map_err(|e| Error::Io {
        op: "stat swap directory",
        path: resolved.clone(),
        offset: 0,
        source: e,
    })?;
    if !meta.is_dir() {
        return Err(Error::Invalid(format!(
            "swap directory {} is not a directory; point SPILLOVER_NVME_PATH at a directory \
             (one per drive, comma-separated)",
            dir.display()
        )));
    }
    Ok(resolved)
}

/// What opening a swap file gave, besides the file.
pub(crate) struct Opened {
    pub file: SwapFile,
    /// Set when O_DIRECT was refused and buffered I/O was accepted instead.
    pub warning: Option<String>,
}

impl SwapFile {
    /// Create the private swap file in `dir` (already resolved). See Note [private swap files].
    /// With O_DIRECT refused (EINVAL at open or at the first aligned write), this is an error
    /// unless `allow_buffered`, in which case the file is buffered and a warning is returned.
    pub fn create(dir: &Path, allow_buffered: bool) -> Result<Opened> {
        let direct_err = match open_private(dir, true) {
            Ok((fd, path)) => match probe_direct(&fd) {
                Ok(()) => {
                    return Ok(Opened {
                        file: SwapFile::new(fd, dir, path, true),
                        warning: None,
                    })
                }
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => e,
                Err(e) => {
                    return Err(Error::Io {
                        op: "write (O_DIRECT probe)",
                        path,
                        offset: 0,
                        source: e,
                    })
                }
            },
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => e,
            Err(e) => return Err(open_error(dir, e)),
        };
        // EINVAL: either O_DIRECT or O_TMPFILE is refused; a buffered open tells which.
        let (fd, path) = open_private(dir, false).map_err(|e| open_error(dir, e))?;
        if !allow_buffered {
            return Err(Error::Invalid(format!(
                "swap directory {} does not support O_DIRECT ({direct_err}); use a directory \
                 on a local file system (ext4, xfs) or allow buffered I/O (allow_buffered)",
                dir.display()
            )));
        }
        let warning = format!(
            "spillover: {} does not support O_DIRECT ({direct_err}); the swap file there uses \
             buffered I/O, which goes through the page cache (more RAM, less predictable speed)",
            dir.display()
        );
        Ok(Opened {
            file: SwapFile::new(fd, dir, path, false),
            warning: Some(warning),
        })
    }

    fn new(fd: OwnedFd, dir: &Path, path: PathBuf, direct: bool) -> SwapFile {
        SwapFile {
            fd,
            dir: dir.to_path_buf(),
            path,
            direct,
            fallocate: AtomicBool::new(true),
        }
    }

    pub fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Make `[from, to)` usable (file size and, where the file system allows, allocated blocks),
    /// reserving up to `limit` when that is cheap. Returns the new reserved end (>= `to`).
    /// ENOSPC becomes [`Error::OutOfSpace`] with the directory's free space from statvfs.
    pub fn reserve(&self, from: u64, to: u64, limit: u64) -> Result<u64> {
        debug_assert!(from < to && to <= limit);
        let generous = to.max(from.saturating_add(RESERVE_STEP)).min(limit);
        let mut target = generous;
        loop {
            match self.grow(from, target) {
                Ok(()) => return Ok(target),
                Err(e) if e.raw_os_error() == Some(libc::ENOSPC) && target > to => target = to,
                Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => {
                    return Err(Error::OutOfSpace {
                        path: self.dir.clone(),
                        need: to - from,
                        free: free_bytes(&self.dir).unwrap_or(0),
                    })
                }
                Err(e) => {
                    return Err(Error::Io {
                        op: "fallocate",
                        path: self.path.clone(),
                        offset: from,
                        source: e,
                    })
                }
            }
        }
    }

    fn grow(&self, from: u64, to: u64) -> io::Result<()> {
        if self.fallocate.load(Ordering::Relaxed) {
            // SAFETY: fallocate on a file descriptor we own; no memory is passed.
            let r = unsafe {
                libc::fallocate(
                    self.raw_fd(),
                    0,
                    from as libc::off_t,
                    (to - from) as libc::off_t,
                )
            };
            if r == 0 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EOPNOTSUPP) {
                return Err(e);
            }
            // The file system cannot preallocate: space is claimed by the writes themselves
            // (ENOSPC then comes from a write, mapped the same way).
            self.fallocate.store(false, Ordering::Relaxed);
        }
        // SAFETY: as above; ftruncate only changes the size of our own file.
        let r = unsafe { libc::ftruncate(self.raw_fd(), to as libc::off_t) };
        if r == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }
}

/// Bytes an unprivileged writer may still use in the file system holding `dir`.
pub(crate) fn free_bytes(dir: &Path) -> io::Result<u64> {
    let c = CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))?;
    // SAFETY: statvfs is plain old data; all-zero is a valid value to be overwritten.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a statvfs we own.
    let r = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

fn open_error(dir: &Path, e: io::Error) -> Error {
    match e.raw_os_error() {
        Some(libc::EACCES | libc::EPERM | libc::EROFS) => Error::Invalid(format!(
            "swap directory {} is not writable ({e}); make it writable or choose another \
             directory in SPILLOVER_NVME_PATH",
            dir.display()
        )),
        _ => Error::Io {
            op: "create swap file",
            path: dir.to_path_buf(),
            offset: 0,
            source: e,
        },
    }
}

fn cpath(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))
}

fn open_raw(path: &CString, flags: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: `path` is NUL-terminated; the mode argument is read only with O_CREAT/O_TMPFILE.
    let fd = unsafe {
        libc::open(
            path.as_ptr(),
            flags | libc::O_CLOEXEC,
            0o600 as libc::c_uint,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by open and is owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Open an anonymous file in `dir` (see Note [private swap files]); returns it and the path
/// error messages should name.
fn open_private(dir: &Path, direct: bool) -> io::Result<(OwnedFd, PathBuf)> {
    let direct_flag = if direct { libc::O_DIRECT } else { 0 };
    match open_raw(&cpath(dir)?, libc::O_TMPFILE | libc::O_RDWR | direct_flag) {
        Ok(fd) => return Ok((fd, dir.to_path_buf())),
        // EISDIR: a kernel older than O_TMPFILE; EOPNOTSUPP: a file system without it.
        Err(e) if matches!(e.raw_os_error(), Some(libc::EISDIR | libc::EOPNOTSUPP)) => {}
        Err(e) => return Err(e),
    }
    open_named(dir, direct_flag)
}

/// The fallback of Note [private swap files]: a fresh random name, opened exclusively, unlinked.
fn open_named(dir: &Path, direct_flag: libc::c_int) -> io::Result<(OwnedFd, PathBuf)> {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let flags = libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_RDWR | direct_flag;
    for _ in 0..64 {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let name = format!(
            "spillover-swap-{}-{}-{:08x}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed),
            nanos.wrapping_mul(2654435761)
        );
        let path = dir.join(name);
        let c = cpath(&path)?;
        match open_raw(&c, flags) {
            Ok(fd) => {
                // SAFETY: `c` is NUL-terminated; unlinking the name we just created.
                if unsafe { libc::unlink(c.as_ptr()) } != 0 {
                    return Err(io::Error::last_os_error());
                }
                let mut shown = path.into_os_string();
                shown.push(" (deleted)");
                return Ok((fd, shown.into()));
            }
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => continue,
            Err(e) => {
                // O_DIRECT is checked after the file is made: don't leave it behind.
                if direct_flag != 0 && e.raw_os_error() == Some(libc::EINVAL) {
                    // SAFETY: `c` is NUL-terminated; the name is ours (O_EXCL, random).
                    unsafe { libc::unlink(c.as_ptr()) };
                }
                return Err(e);
            }
        }
    }
    Err(io::Error::new(
        io::ErrorKind::AlreadyExists,
        "could not find a free spillover-swap-* name",
    ))
}

/// Some file systems accept O_DIRECT at open and refuse it at the first I/O: write one aligned
/// granule at offset 0 to find out now rather than on the first real write. The file is left
/// empty again.
fn probe_direct(fd: &OwnedFd) -> io::Result<()> {
    let layout = std::alloc::Layout::from_size_align(GRANULE as usize, GRANULE as usize)
        .expect("granule layout");
    // SAFETY: the layout has a non-zero size.
    let buf = unsafe { std::alloc::alloc_zeroed(layout) };
    if buf.is_null() {
        std::alloc::handle_alloc_error(layout);
    }
    // SAFETY: `buf` holds GRANULE initialised bytes, aligned to GRANULE, for this call only.
    let r = unsafe { libc::pwrite(fd.as_raw_fd(), buf.cast(), GRANULE as usize, 0) };
    let res = if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    };
    // SAFETY: allocated above with the same layout; pwrite has returned, so nothing uses it.
    unsafe { std::alloc::dealloc(buf, layout) };
    res?;
    // SAFETY: truncating our own file back to empty.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    fn check_private(fd: &OwnedFd, dir: &Path) {
        let f = std::fs::File::from(fd.try_clone().unwrap());
        let m = f.metadata().unwrap();
        assert_eq!(m.mode() & 0o777, 0o600);
        assert_eq!(m.nlink(), 0, "the swap file has no name");
        assert_eq!(std::fs::read_dir(dir).unwrap().count(), 0);
    }

    #[test]
    fn tmpfile_and_named_fallback_are_private_and_unlinked() {
        let dir = std::env::temp_dir().join(format!("spillover-file-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for direct in [true, false] {
            let flag = if direct { libc::O_DIRECT } else { 0 };
            match open_private(&dir, direct) {
                Ok((fd, _)) => check_private(&fd, &dir),
                Err(e) if direct && e.raw_os_error() == Some(libc::EINVAL) => continue,
                Err(e) => panic!("{e}"),
            }
            let (fd, shown) = open_named(&dir, flag).unwrap();
            assert!(shown.to_string_lossy().ends_with(" (deleted)"), "{shown:?}");
            check_private(&fd, &dir);
        }
        std::fs::remove_dir(&dir).unwrap();
    }
}
