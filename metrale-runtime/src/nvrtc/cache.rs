//! [`CompileCache`]: compile outputs keyed by everything that decides them.
//!
//! The key is the program's name, source, headers (names and text), options, name
//! expressions and PTX request, the target, the loaded NVRTC build (its version
//! and the build IDs of libnvrtc and its builtins) and a listing of every file
//! under the program's include folders (names, sizes, modification and change
//! times), each length-prefixed; what those two cover and what they do not is
//! in `fingerprint.rs`. An entry is found by a 128-bit hash of
//! the key and kept with the key itself, which is compared in full before an
//! entry is used, so a hash collision is a miss, never a wrong program. A
//! program whose include folders hold more than
//! [`CompileCache::MAX_INCLUDE_FILES`] files is compiled every time (counted as a
//! miss), never cached.
//!
//! In memory the cache holds at most a byte budget (outputs, logs and keys
//! counted; least recently used entries go first). On disk (opt-in,
//! [`CompileCache::on_disk`]) each entry is one file `<hash>.nvrtc`:
//! magic, body length, body (key, then outputs), FNV-1a checksum of the body.
//! Files are written to a temporary name in the same folder and renamed, so a
//! reader sees a whole file or none; a file that is short, long, fails its
//! checksum, fails to parse or holds another key is compiled again and replaced,
//! never loaded. The folder grows by one file per distinct program and target and
//! is never pruned by metrale (delete it to empty it). The checksum catches
//! accidental damage, not tampering: the folder must be as trusted as the code.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use crate::context::AsContext;
use crate::error::Result;

use super::error::{into_error, NvrtcError};
use super::fingerprint;
use super::output::Compiled;
use super::program::{self, Program};
use super::Target;

/// The default in-memory budget: 64 MiB.
const DEFAULT_MEMORY_BYTES: usize = 64 << 20;
const MAGIC: &[u8; 8] = b"MTRLRTC1";

/// How a cache has been used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheStats {
    /// Answered from memory.
    pub memory_hits: u64,
    /// Answered from the folder.
    pub disk_hits: u64,
    /// Compiled.
    pub misses: u64,
    /// Entries on disk found damaged (or of another key) and replaced.
    pub replaced_corrupt: u64,
}

struct Entry {
    key: Vec<u8>,
    value: Arc<Compiled>,
    last_used: u64,
    bytes: usize,
}

#[derive(Default)]
struct Memory {
    entries: HashMap<u128, Entry>,
    bytes: usize,
    clock: u64,
}

/// A cache of compile outputs, in memory and optionally in a folder. `Sync`: one
/// cache can serve several threads (compiles run outside its lock).
///
/// An entry is used only for the same program (name, source, headers, options,
/// name expressions, PTX request), target and NVRTC build: the loaded libnvrtc
/// and builtins are told apart by their GNU build IDs (by resolved path, size
/// and file times where a library has none), so 13.0.48 and 13.0.88 never share
/// an entry. Every file under the program's include folders (`-I`,
/// [`Program::include_path`]) is part of the key by name, size, modification
/// and change time, so a header changed there is a miss.
///
/// What the key does not see: a header's bytes (an edit that keeps its size and
/// both times; ordinary programs cannot set the change time), headers
/// included by an absolute path or from the working folder, builtins that NVRTC
/// opens by name itself (a library loaded by name, not by path), and a library
/// replaced on disk after this process loaded it. Each lookup lists the include
/// folders, which costs a file-status call per file there; a program whose
/// folders hold more than [`CompileCache::MAX_INCLUDE_FILES`] files, or nest
/// deeper than 32 folders, is compiled every time instead.
pub struct CompileCache {
    memory: Mutex<Memory>,
    limit: usize,
    folder: Option<PathBuf>,
    memory_hits: AtomicU64,
    disk_hits: AtomicU64,
    misses: AtomicU64,
    replaced: AtomicU64,
}

impl Default for CompileCache {
    fn default() -> Self {
        CompileCache::new()
    }
}

impl std::fmt::Debug for CompileCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompileCache")
            .field("limit", &self.limit)
            .field("folder", &self.folder)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl CompileCache {
    /// Most files listed under a program's include folders; a program with more
    /// is compiled every time, never cached.
    pub const MAX_INCLUDE_FILES: usize = fingerprint::MAX_FILES;

    /// An in-memory cache of at most 64 MiB.
    pub fn new() -> CompileCache {
        CompileCache::with_memory_limit(DEFAULT_MEMORY_BYTES)
    }

    /// An in-memory cache of at most `bytes` (0 keeps nothing in memory).
    pub fn with_memory_limit(bytes: usize) -> CompileCache {
        CompileCache {
            memory: Mutex::new(Memory::default()),
            limit: bytes,
            folder: None,
            memory_hits: AtomicU64::new(0),
            disk_hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            replaced: AtomicU64::new(0),
        }
    }

    /// Also keep entries in `folder` (created when missing), across processes.
    ///
    /// # Errors
    /// The folder cannot be created.
    pub fn on_disk(mut self, folder: impl AsRef<Path>) -> Result<CompileCache> {
        let folder = folder.as_ref();
        std::fs::create_dir_all(folder).map_err(|e| {
            into_error(NvrtcError::Cache {
                path: folder.display().to_string(),
                reason: format!("cannot create the folder: {e}"),
            })
        })?;
        self.folder = Some(folder.to_path_buf());
        Ok(self)
    }

    /// The outputs of compiling `program` for `target`: from memory, else from the
    /// folder, else compiled (and stored in both).
    ///
    /// # Errors
    /// As [`Program::compile`]. A failed compile is not cached.
    pub fn compile(&self, program: &Program, target: Target) -> Result<Arc<Compiled>> {
        self.get(program, target).map_err(into_error)
    }

    /// As [`CompileCache::compile`], for the device of `ctx` (the target
    /// [`Program::compile_for`] picks): a context, a host or a stream, as
    /// everything else takes it.
    ///
    /// # Errors
    /// As [`Program::compile`].
    pub fn compile_for(&self, program: &Program, ctx: &impl AsContext) -> Result<Arc<Compiled>> {
        let cc = ctx.context().limits().compute_capability;
        let target = program::device_target(cc).map_err(into_error)?;
        self.compile(program, target)
    }

    /// Counts of hits, misses and replaced entries so far.
    pub fn stats(&self) -> CacheStats {
        CacheStats {
            memory_hits: self.memory_hits.load(Ordering::Relaxed),
            disk_hits: self.disk_hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            replaced_corrupt: self.replaced.load(Ordering::Relaxed),
        }
    }

    /// Forget what is in memory (the folder is kept).
    pub fn clear_memory(&self) {
        let mut m = self.memory.lock().unwrap_or_else(PoisonError::into_inner);
        m.entries.clear();
        m.bytes = 0;
    }

    /// The file an entry for `program` and `target` lives in (whether or not it
    /// exists yet); `None` without a folder, or for a program that is not cached
    /// (see [`CompileCache::MAX_INCLUDE_FILES`]).
    ///
    /// # Errors
    /// The library's load error (the key holds its version).
    pub fn entry_path(&self, program: &Program, target: Target) -> Result<Option<PathBuf>> {
        let key = key_bytes(program, target).map_err(into_error)?;
        Ok(key.and_then(|key| self.file_of(hash128(&key))))
    }

    fn file_of(&self, hash: u128) -> Option<PathBuf> {
        self.folder
            .as_ref()
            .map(|f| f.join(format!("{hash:032x}.nvrtc")))
    }

    fn get(
        &self,
        program: &Program,
        target: Target,
    ) -> std::result::Result<Arc<Compiled>, NvrtcError> {
        let Some(key) = key_bytes(program, target)? else {
            // Not cached: compiled every time.
            self.misses.fetch_add(1, Ordering::Relaxed);
            return Ok(Arc::new(program::compile(program, target)?));
        };
        let hash = hash128(&key);
        if let Some(hit) = self.memory_hit(hash, &key) {
            self.memory_hits.fetch_add(1, Ordering::Relaxed);
            return Ok(hit);
        }
        let file = self.file_of(hash);
        if let Some(path) = &file {
            match read_entry(path, &key) {
                Read::Hit(compiled) => {
                    self.disk_hits.fetch_add(1, Ordering::Relaxed);
                    let value = Arc::new(compiled);
                    self.remember(hash, key, &value);
                    return Ok(value);
                }
                Read::Absent => {}
                Read::Corrupt => {
                    self.replaced.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        let value = Arc::new(program::compile(program, target)?);
        self.misses.fetch_add(1, Ordering::Relaxed);
        if let Some(path) = &file {
            if let Err(e) = write_entry(path, &key, &value) {
                // The compile succeeded; losing the disk copy costs a compile
                // later, not this caller's result.
                crate::error::report_line(format_args!(
                    "compile cache: cannot write {}: {e}",
                    path.display()
                ));
            }
        }
        self.remember(hash, key, &value);
        Ok(value)
    }

    fn memory_hit(&self, hash: u128, key: &[u8]) -> Option<Arc<Compiled>> {
        let mut m = self.memory.lock().unwrap_or_else(PoisonError::into_inner);
        m.clock += 1;
        let now = m.clock;
        let e = m.entries.get_mut(&hash)?;
        if e.key != key {
            return None;
        }
        e.last_used = now;
        Some(Arc::clone(&e.value))
    }

    fn remember(&self, hash: u128, key: Vec<u8>, value: &Arc<Compiled>) {
        let bytes = key.len() + value.size_bytes();
        if bytes > self.limit {
            return;
        }
        let mut m = self.memory.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(old) = m.entries.remove(&hash) {
            m.bytes -= old.bytes;
        }
        while m.bytes + bytes > self.limit {
            let Some(oldest) = m
                .entries
                .iter()
                .min_by_key(|(_, e)| e.last_used)
                .map(|(h, _)| *h)
            else {
                break;
            };
            if let Some(e) = m.entries.remove(&oldest) {
                m.bytes -= e.bytes;
            }
        }
        m.clock += 1;
        let last_used = m.clock;
        m.bytes += bytes;
        m.entries.insert(
            hash,
            Entry {
                key,
                value: Arc::clone(value),
                last_used,
                bytes,
            },
        );
    }
}

/// Everything that decides a compile's outputs, length-prefixed; `None` for a
/// program that is not cached (include folders too large to list).
pub(crate) fn key_bytes(
    p: &Program,
    target: Target,
) -> std::result::Result<Option<Vec<u8>>, NvrtcError> {
    let library = fingerprint::library_identity()?;
    let options = p.rendered_options(target);
    let Some(includes) = fingerprint::include_listing(&options) else {
        return Ok(None);
    };
    let mut w = Writer::default();
    w.bytes(b"metrale nvrtc key 2");
    w.bytes(library);
    w.bytes(target.to_string().as_bytes());
    w.bytes(p.name.as_bytes());
    w.bytes(p.source.as_bytes());
    w.u64(p.headers.len() as u64);
    for (name, text) in &p.headers {
        w.bytes(name.as_bytes());
        w.bytes(text.as_bytes());
    }
    w.u64(options.len() as u64);
    for o in &options {
        w.bytes(o.as_bytes());
    }
    w.bytes(&includes);
    w.u64(p.name_expressions.len() as u64);
    for e in &p.name_expressions {
        w.bytes(e.as_bytes());
    }
    w.u64(u64::from(p.emit_ptx));
    Ok(Some(w.0))
}

/// FNV-1a, 64 bits, from `basis`.
fn fnv64(bytes: &[u8], basis: u64) -> u64 {
    let mut h = basis;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

const FNV_BASIS: u64 = 0xcbf2_9ce4_8422_2325;

/// Two FNV-1a hashes of different bases: a file name, not a proof (keys are
/// compared in full).
fn hash128(key: &[u8]) -> u128 {
    (u128::from(fnv64(key, FNV_BASIS)) << 64) | u128::from(fnv64(key, 0x6c62_272e_07bb_0142))
}

#[derive(Default)]
struct Writer(Vec<u8>);

impl Writer {
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn bytes(&mut self, b: &[u8]) {
        self.u64(b.len() as u64);
        self.0.extend_from_slice(b);
    }
    fn opt(&mut self, b: Option<&[u8]>) {
        match b {
            Some(b) => {
                self.u64(1);
                self.bytes(b);
            }
            None => self.u64(0),
        }
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn u64(&mut self) -> Option<u64> {
        let (head, rest) = self.0.split_first_chunk::<8>()?;
        self.0 = rest;
        Some(u64::from_le_bytes(*head))
    }
    fn bytes(&mut self) -> Option<&'a [u8]> {
        let n = usize::try_from(self.u64()?).ok()?;
        if n > self.0.len() {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }
    fn string(&mut self) -> Option<String> {
        String::from_utf8(self.bytes()?.to_vec()).ok()
    }
    fn opt(&mut self) -> Option<Option<Vec<u8>>> {
        match self.u64()? {
            0 => Some(None),
            1 => Some(Some(self.bytes()?.to_vec())),
            _ => None,
        }
    }
}

fn encode(key: &[u8], c: &Compiled) -> Vec<u8> {
    let mut body = Writer::default();
    body.bytes(key);
    body.bytes(c.name.as_bytes());
    let (kind, arch) = match c.target {
        Target::Sm(a) => (0, a),
        Target::Compute(a) => (1, a),
    };
    body.u64(kind);
    body.u64(u64::from(arch));
    body.opt(c.ptx.as_deref());
    body.opt(c.cubin.as_deref());
    body.opt(c.lto_ir.as_deref());
    body.bytes(c.log.as_bytes());
    body.u64(c.lowered.len() as u64);
    for (e, l) in &c.lowered {
        body.bytes(e.as_bytes());
        body.bytes(l.as_bytes());
    }
    let body = body.0;
    let mut out = Vec::with_capacity(body.len() + 24);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    out.extend_from_slice(&body);
    out.extend_from_slice(&fnv64(&body, FNV_BASIS).to_le_bytes());
    out
}

/// The entry in `file`, when it is whole, its checksum holds and its key is `key`.
fn decode(file: &[u8], key: &[u8]) -> Option<Compiled> {
    let rest = file.strip_prefix(MAGIC)?;
    let (len, rest) = rest.split_first_chunk::<8>()?;
    let len = usize::try_from(u64::from_le_bytes(*len)).ok()?;
    if rest.len() != len.checked_add(8)? {
        return None;
    }
    let (body, sum) = rest.split_at(len);
    if sum != fnv64(body, FNV_BASIS).to_le_bytes() {
        return None;
    }
    let mut r = Reader(body);
    if r.bytes()? != key {
        return None;
    }
    let name = r.string()?;
    let target = match (r.u64()?, u32::try_from(r.u64()?).ok()?) {
        (0, a) => Target::Sm(a),
        (1, a) => Target::Compute(a),
        _ => return None,
    };
    let (ptx, cubin, lto_ir) = (r.opt()?, r.opt()?, r.opt()?);
    let log = r.string()?;
    let n = r.u64()?;
    let mut lowered = Vec::new();
    for _ in 0..n {
        lowered.push((r.string()?, r.string()?));
    }
    if !r.0.is_empty() {
        return None;
    }
    // What the driver will be given passes the blob checks again: a cache entry
    // is trusted no more than a fresh compile.
    for blob in [&cubin, &ptx].into_iter().flatten() {
        crate::blob::prepare(&name, blob).ok()?;
    }
    Some(Compiled {
        name,
        target,
        ptx,
        cubin,
        lto_ir,
        log,
        lowered,
    })
}

enum Read {
    Hit(Compiled),
    Absent,
    Corrupt,
}

fn read_entry(path: &Path, key: &[u8]) -> Read {
    match std::fs::read(path) {
        Ok(bytes) => decode(&bytes, key).map_or(Read::Corrupt, Read::Hit),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Read::Absent,
        Err(_) => Read::Corrupt,
    }
}

fn write_entry(path: &Path, key: &[u8], value: &Compiled) -> std::io::Result<()> {
    use std::io::Write as _;
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let tmp = path.with_extension(format!("{}.{n}.tmp", std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&encode(key, value))?;
        drop(f);
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}
