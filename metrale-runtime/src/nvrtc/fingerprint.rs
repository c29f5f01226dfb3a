//! What the compile cache's key holds beyond the program itself: which NVRTC
//! build is loaded, and what the include folders hold.
//!
//! - **The library.** `nvrtcVersion` says major.minor only (13.0.48 and 13.0.88
//!   both say 13.0). The key holds the loaded file's GNU build ID instead (the
//!   linker's hash of the build, in an ELF note: read from the file's program
//!   headers, a few KiB, once per process), for libnvrtc (found by the address
//!   of one of its functions, so a library the system loader searched for is
//!   covered too) and for the builtins library metrale loaded beside it. A file
//!   without a build ID is named by its resolved path, size, and modification
//!   and change times instead. The limit: the file is read after it was loaded,
//!   so a library replaced on disk while this process runs is judged by the new
//!   file; and builtins that NVRTC opens by name itself (a library loaded by
//!   name, not path) are not in the key (NVRTC takes builtins of its own
//!   version only).
//! - **The include folders.** NVRTC says which files it read through no call
//!   of the 13.0 API (no dependency list), so every file under each
//!   `--include-path` / `-I` folder is listed in the key, in name order, with
//!   its size, modification time and change time (nanoseconds; symbolic links
//!   followed, with the target each link names, and each folder walked once, a
//!   second visit naming the folder by device and inode), and so is every file
//!   under each `--pch-dir` folder; the files named by `--pre-include`
//!   (`-include`) and `--use-pch` are listed by name with the same size and
//!   times. A header edited, added or removed
//!   changes the key; the change time catches an edit that restores the size
//!   and the modification time. The limits: a file's contents are not read (an
//!   edit that keeps size and both times is not seen, which ordinary programs
//!   cannot do), headers included by an absolute path or from the working
//!   folder are not covered, and each lookup walks the folders (a cost that
//!   grows with their files). A folder tree of more than `MAX_FILES` files, or
//!   nested deeper than 32 folders, is not listed: such a program is compiled
//!   every time, never cached.

use std::collections::HashSet;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use super::error::NvrtcError;
use super::program;

/// Most files listed under a program's include folders; past it the program is
/// not cached.
pub const MAX_FILES: usize = 100_000;
/// Deepest folder nesting walked under an include folder.
const MAX_DEPTH: usize = 32;

/// A length-prefixed encoding (as the cache's key writer).
#[derive(Default)]
pub(super) struct Listing(pub(super) Vec<u8>);

impl Listing {
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn i64(&mut self, v: i64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn bytes(&mut self, b: &[u8]) {
        self.u64(b.len() as u64);
        self.0.extend_from_slice(b);
    }
}

/// The loaded NVRTC's identity, computed once per process.
pub(super) fn library_identity() -> Result<&'static [u8], NvrtcError> {
    static IDENTITY: OnceLock<Vec<u8>> = OnceLock::new();
    let lib = program::library()?;
    Ok(IDENTITY.get_or_init(|| {
        let mut w = Listing::default();
        match lib.version() {
            Some((major, minor)) => {
                w.u64(u64::from(major));
                w.u64(u64::from(minor));
            }
            None => w.bytes(b"unknown version"),
        }
        let file = lib
            .nvrtcVersion()
            .ok()
            .and_then(|f| loaded_file(f as *const std::ffi::c_void))
            .unwrap_or_else(|| PathBuf::from(lib.path()));
        w.bytes(b"nvrtc");
        file_identity(&mut w, &file);
        match lib.builtins_path() {
            Some(b) => {
                w.bytes(b"builtins");
                file_identity(&mut w, Path::new(b));
            }
            None => w.bytes(b"builtins opened by NVRTC"),
        }
        w.0
    }))
}

/// The file the loaded object holding `addr` came from.
#[cfg(unix)]
fn loaded_file(addr: *const std::ffi::c_void) -> Option<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    // SAFETY: Dl_info is pointers only; all null is a valid value to overwrite.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr looks `addr` up in the loader's tables (it does not read the
    // memory at it) and writes one Dl_info.
    if unsafe { libc::dladdr(addr, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname is the loader's NUL-terminated name of the object, valid
    // while it stays loaded; NVRTC's table keeps it loaded for the process, and
    // the name is copied at once.
    let name = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) };
    let path = PathBuf::from(std::ffi::OsStr::from_bytes(name.to_bytes()));
    (!path.as_os_str().is_empty()).then_some(path)
}

#[cfg(not(unix))]
fn loaded_file(_addr: *const std::ffi::c_void) -> Option<PathBuf> {
    None
}

/// The build ID of the file at `path`, else its resolved path, size and times.
fn file_identity(w: &mut Listing, path: &Path) {
    if let Some(id) = build_id(path) {
        w.bytes(b"build id");
        w.bytes(&id);
        return;
    }
    let resolved = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    w.bytes(b"file");
    w.bytes(resolved.as_os_str().as_encoded_bytes());
    match std::fs::metadata(&resolved) {
        Ok(m) => metadata(w, &m),
        Err(e) => w.bytes(format!("unreadable: {:?}", e.kind()).as_bytes()),
    }
}

/// The GNU build ID in the ELF64 file at `path` (its PT_NOTE segments).
fn build_id(path: &Path) -> Option<Vec<u8>> {
    const PT_NOTE: u32 = 4;
    const NT_GNU_BUILD_ID: u32 = 3;
    let mut f = std::fs::File::open(path).ok()?;
    let mut header = [0u8; 64];
    f.read_exact(&mut header).ok()?;
    // ELF64, little-endian.
    if &header[..4] != b"\x7fELF" || header[4] != 2 || header[5] != 1 {
        return None;
    }
    let u16_at =
        |b: &[u8], at: usize| Some(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?));
    let u32_at =
        |b: &[u8], at: usize| Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?));
    let u64_at =
        |b: &[u8], at: usize| Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?));
    let phoff = u64_at(&header, 0x20)?;
    let (phentsize, phnum) = (u16_at(&header, 0x36)?, u16_at(&header, 0x38)?);
    if phentsize != 56 {
        return None;
    }
    let mut phdrs = vec![0u8; usize::from(phnum) * 56];
    f.seek(SeekFrom::Start(phoff)).ok()?;
    f.read_exact(&mut phdrs).ok()?;
    for ph in phdrs.chunks_exact(56) {
        if u32_at(ph, 0)? != PT_NOTE {
            continue;
        }
        let (offset, size) = (u64_at(ph, 8)?, u64_at(ph, 0x20)?);
        if size > 1 << 16 {
            continue;
        }
        let mut notes = vec![0u8; usize::try_from(size).ok()?];
        f.seek(SeekFrom::Start(offset)).ok()?;
        f.read_exact(&mut notes).ok()?;
        // Notes: namesz, descsz, type, then name and desc, each padded to 4.
        let mut at = 0usize;
        while at + 12 <= notes.len() {
            let namesz = usize::try_from(u32_at(&notes, at)?).ok()?;
            let descsz = usize::try_from(u32_at(&notes, at + 4)?).ok()?;
            let kind = u32_at(&notes, at + 8)?;
            let name_at = at + 12;
            let desc_at = name_at.checked_add(namesz.checked_add(3)? & !3)?;
            let end = desc_at.checked_add(descsz.checked_add(3)? & !3)?;
            let name = notes.get(name_at..name_at + namesz)?;
            if kind == NT_GNU_BUILD_ID && name == b"GNU\0" && descsz > 0 {
                return notes.get(desc_at..desc_at + descsz).map(<[u8]>::to_vec);
            }
            at = end;
        }
    }
    None
}

/// Size, modification and change times (seconds and nanoseconds).
fn metadata(w: &mut Listing, m: &std::fs::Metadata) {
    w.u64(m.len());
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        w.i64(m.mtime());
        w.i64(m.mtime_nsec());
        w.i64(m.ctime());
        w.i64(m.ctime_nsec());
    }
    #[cfg(not(unix))]
    {
        let since = |t: std::io::Result<std::time::SystemTime>| {
            t.ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_nanos() as u64)
        };
        w.u64(since(m.modified()));
    }
}

/// The include folders named by NVRTC options: `--include-path=D`,
/// `--include-path D`, `-ID` and `-I D`.
fn include_folders(options: &[String]) -> Vec<&str> {
    let mut out = Vec::new();
    let mut it = options.iter();
    while let Some(o) = it.next() {
        if let Some(d) = o.strip_prefix("--include-path=") {
            out.push(d);
        } else if o == "--include-path" || o == "-I" {
            if let Some(d) = it.next() {
                out.push(d.as_str());
            }
        } else if let Some(d) = o.strip_prefix("-I") {
            out.push(d);
        }
    }
    out
}

/// The value of an option spelled `--name=V`, `-name=V`, `--name V` or
/// `-name V`, for each of `names` (given without dashes), in order.
fn option_values<'a>(options: &'a [String], names: &[&str]) -> Vec<&'a str> {
    let mut out = Vec::new();
    let mut it = options.iter();
    while let Some(o) = it.next() {
        let Some(bare) = o.strip_prefix("--").or_else(|| o.strip_prefix('-')) else {
            continue;
        };
        for name in names {
            if let Some(v) = bare.strip_prefix(name) {
                if let Some(v) = v.strip_prefix('=') {
                    out.push(v);
                } else if v.is_empty() {
                    if let Some(v) = it.next() {
                        out.push(v.as_str());
                    }
                }
                break;
            }
        }
    }
    out
}

/// Files NVRTC reads by name through an option: `--pre-include` (`-include`)
/// and `--use-pch` (`-use-pch`).
fn named_files(options: &[String]) -> Vec<&str> {
    option_values(options, &["pre-include", "include", "use-pch"])
}

/// Folders NVRTC looks for precompiled headers in: `--pch-dir` (`-pch-dir`).
fn pch_folders(options: &[String]) -> Vec<&str> {
    option_values(options, &["pch-dir"])
}

/// Every file under the include folders of `options`, for the key, and the
/// files and folders other options name (`--pre-include`, `--use-pch`,
/// `--pch-dir`); `None` when the folders hold more than `MAX_FILES` files or
/// nest deeper than `MAX_DEPTH` (the program is not cached).
pub(super) fn include_listing(options: &[String]) -> Option<Vec<u8>> {
    let mut w = Listing::default();
    let folders = include_folders(options);
    let pch = pch_folders(options);
    w.u64(folders.len() as u64);
    w.u64(pch.len() as u64);
    let mut files = 0usize;
    for folder in folders.into_iter().chain(pch) {
        w.bytes(folder.as_bytes());
        let mut seen = HashSet::new();
        walk(
            &mut w,
            Path::new(folder),
            Path::new(""),
            0,
            &mut seen,
            &mut files,
        )?;
    }
    let named = named_files(options);
    w.u64(named.len() as u64);
    for file in named {
        // Relative names are NVRTC's to resolve (the working folder): listed
        // as the process sees them.
        let path = Path::new(file);
        w.bytes(file.as_bytes());
        link_target(&mut w, path);
        match std::fs::metadata(path) {
            Ok(m) => metadata(&mut w, &m),
            Err(e) => w.bytes(format!("unreadable: {:?}", e.kind()).as_bytes()),
        }
    }
    Some(w.0)
}

/// Where a symbolic link at `path` points (nothing for anything else), so that
/// re-pointing a link changes the key.
fn link_target(w: &mut Listing, path: &Path) {
    if let Ok(target) = std::fs::read_link(path) {
        w.bytes(b"link to");
        w.bytes(target.as_os_str().as_encoded_bytes());
    }
}

/// A folder's identity, to walk each once (a link back up is not a loop).
#[cfg(unix)]
fn folder_id(m: &std::fs::Metadata) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    Some((m.dev(), m.ino()))
}

#[cfg(not(unix))]
fn folder_id(_m: &std::fs::Metadata) -> Option<(u64, u64)> {
    None
}

fn walk(
    w: &mut Listing,
    root: &Path,
    rel: &Path,
    depth: usize,
    seen: &mut HashSet<(u64, u64)>,
    files: &mut usize,
) -> Option<()> {
    let here = root.join(rel);
    let entries = match std::fs::read_dir(&here) {
        Ok(e) => e,
        Err(e) => {
            // What NVRTC finds too: nothing to read there.
            w.bytes(rel.as_os_str().as_encoded_bytes());
            w.bytes(format!("unreadable folder: {:?}", e.kind()).as_bytes());
            return Some(());
        }
    };
    if let Some(id) = std::fs::metadata(&here).ok().as_ref().and_then(folder_id) {
        if !seen.insert(id) {
            // Which folder: a link re-pointed at another folder walked already
            // changes the key.
            w.bytes(rel.as_os_str().as_encoded_bytes());
            w.bytes(b"folder walked already");
            w.u64(id.0);
            w.u64(id.1);
            return Some(());
        }
    }
    let mut names: Vec<_> = entries.flatten().map(|e| e.file_name()).collect();
    names.sort();
    for name in names {
        let path = rel.join(&name);
        link_target(w, &root.join(&path));
        match std::fs::metadata(root.join(&path)) {
            Ok(m) if m.is_dir() => {
                w.bytes(path.as_os_str().as_encoded_bytes());
                w.bytes(b"folder");
                if depth + 1 >= MAX_DEPTH {
                    return None;
                }
                walk(w, root, &path, depth + 1, seen, files)?;
            }
            Ok(m) => {
                *files += 1;
                if *files > MAX_FILES {
                    return None;
                }
                w.bytes(path.as_os_str().as_encoded_bytes());
                w.bytes(b"file");
                metadata(w, &m);
            }
            Err(e) => {
                w.bytes(path.as_os_str().as_encoded_bytes());
                w.bytes(format!("unreadable: {:?}", e.kind()).as_bytes());
            }
        }
    }
    Some(())
}

#[cfg(test)]
mod tests {
    use super::{include_folders, include_listing, MAX_DEPTH};

    fn temp(tag: &str) -> std::path::PathBuf {
        let d =
            std::env::temp_dir().join(format!("metrale-fingerprint-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap_or_default();
        d
    }

    fn listing(dir: &std::path::Path) -> Option<Vec<u8>> {
        include_listing(&[format!("--include-path={}", dir.display())])
    }

    /// A link back up is walked once, not for ever; a missing folder is listed
    /// as missing, not an error.
    #[cfg(unix)]
    #[test]
    fn a_link_loop_ends_and_a_missing_folder_is_listed() {
        let d = temp("loop");
        std::fs::write(d.join("a.h"), "").unwrap_or_default();
        std::fs::create_dir_all(d.join("sub")).unwrap_or_default();
        let _ = std::os::unix::fs::symlink(&d, d.join("sub").join("up"));
        let once = listing(&d);
        assert!(once.is_some());
        assert_eq!(listing(&d), once, "the same listing twice");
        assert!(listing(&d.join("nothing-here")).is_some());
        let _ = std::fs::remove_dir_all(&d);
    }

    /// Deeper than the walk goes: not listed, so not cached (never a partial
    /// listing that would miss a change further down).
    #[test]
    fn folders_nested_too_deep_are_not_listed() {
        let d = temp("deep");
        let mut deep = d.clone();
        for i in 0..MAX_DEPTH {
            deep = deep.join(format!("{i}"));
        }
        std::fs::create_dir_all(&deep).unwrap_or_default();
        assert_eq!(listing(&d), None);
        assert!(listing(&d.join("0").join("1")).is_some());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn include_folders_in_every_spelling() {
        let o = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let opts = o(&[
            "--gpu-architecture=sm_90",
            "--include-path=/a",
            "-I/b",
            "-I",
            "/c",
            "--include-path",
            "/d",
            "--std=c++17",
        ]);
        assert_eq!(include_folders(&opts), ["/a", "/b", "/c", "/d"]);
    }

    #[test]
    fn named_files_and_pch_folders_in_every_spelling() {
        let o = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let opts = o(&[
            "--pre-include=/a.h",
            "-include",
            "/b.h",
            "--use-pch=/c.pch",
            "-include-path=/not-a-file",
            "--pch-dir=/p",
            "-pch-dir",
            "/q",
            "--pch",
        ]);
        assert_eq!(super::named_files(&opts), ["/a.h", "/b.h", "/c.pch"]);
        assert_eq!(super::pch_folders(&opts), ["/p", "/q"]);
    }
}
