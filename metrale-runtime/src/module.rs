//! Loading kernel code: one checked blob into a module of one context
//! (`cuModuleLoadDataEx`) or into a context-independent library
//! (`cuLibraryLoadData`, CUDA 12.0+), with the JIT log and an architecture hint on
//! failure; and `ModuleSet`, the named, loaded code of one registry.
//!
//! Invariants:
//! - Every blob passes `blob::prepare` before the driver sees it.
//! - A `ModuleSet` is built completely before it is shared and never changes
//!   afterwards; names are unique and indexed, so loading and looking up cost the
//!   same per module for 5 modules or 5,000.
//! - A set built from modules belongs to one context, and unloads them under that
//!   context's release rule; a set built from libraries belongs to no context and
//!   serves every device. Each handle is unloaded once, when the last holder goes.
//!   A load that fails at blob k unloads blobs 0..k.

use std::collections::HashMap;
use std::ffi::{c_char, c_uint, c_void, CStr, CString};
use std::sync::Arc;

use metrale_cuda_sys::{
    self as sys, CUdeviceptr, CUfunction, CUjit_option, CUkernel, CUlibrary, CUmodule, CUresult,
};

use crate::blob::{self, BlobKind};
use crate::context::{CudaContext, Generation};
use crate::error::{cu, invalid_arg, report_drop_failures, CallError, ErrorKind, NameKind, Result};

/// Bytes of each JIT log buffer (info and error) passed to the driver.
const JIT_LOG_BYTES: usize = 16 * 1024;
/// At most this many bytes of a JIT log go into an error.
const JIT_LOG_IN_ERROR: usize = 4 * 1024;

/// Loaded code of one blob.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Code {
    /// A module of the set's context.
    Module(CUmodule),
    /// A context-independent library.
    Library(CUlibrary),
}

/// One named, loaded blob.
pub(crate) struct Loaded {
    pub name: Box<str>,
    pub kind: BlobKind,
    pub code: Code,
}

/// Who a set's code belongs to.
enum Owner {
    /// Modules of this context (made in that generation), unloaded under its
    /// release rule.
    Context(Arc<CudaContext>, Generation),
    /// Libraries, unloaded through the driver alone.
    Driver(&'static sys::Driver),
}

/// The loaded code of one registry (or, for libraries, of one model on every
/// device), by name.
pub(crate) struct ModuleSet {
    list: Vec<Loaded>,
    index: HashMap<Box<str>, usize>,
    owner: Owner,
}

// SAFETY: the handles are written while the set is built, before it is shared, and
// unloaded only in Drop; shared access reads them and passes them to the driver, which
// is thread-safe for module, library and kernel handles.
unsafe impl Send for ModuleSet {}
// SAFETY: as for Send.
unsafe impl Sync for ModuleSet {}

/// One blob to load: a name and its bytes, borrowed or owned.
pub(crate) type Blob<'a> = (&'a str, &'a [u8]);

/// A named kernel blob, as the loading functions take them: `(name, bytes)` with
/// any string and byte container (`(&str, &[u8])`, `(String, Vec<u8>)`, ...), or a
/// reference to one.
pub trait NamedBlob {
    /// The module name.
    fn name(&self) -> &str;
    /// The blob (PTX, cubin, fatbin or clang offload bundle).
    fn bytes(&self) -> &[u8];
}

impl<N: AsRef<str>, B: AsRef<[u8]>> NamedBlob for (N, B) {
    fn name(&self) -> &str {
        self.0.as_ref()
    }
    fn bytes(&self) -> &[u8] {
        self.1.as_ref()
    }
}

impl<T: NamedBlob + ?Sized> NamedBlob for &T {
    fn name(&self) -> &str {
        (**self).name()
    }
    fn bytes(&self) -> &[u8] {
        (**self).bytes()
    }
}

impl ModuleSet {
    /// Load every blob as a module of `ctx`.
    pub(crate) fn load_modules(ctx: &Arc<CudaContext>, blobs: &[Blob<'_>]) -> Result<ModuleSet> {
        let mut set = ModuleSet::empty(
            Owner::Context(Arc::clone(ctx), ctx.generation()),
            blobs.len(),
        );
        for &(name, bytes) in blobs {
            set.check_new_name(name)?;
            // On error `set` drops here and unloads what was loaded so far.
            let (raw, kind) = load(ctx.driver(), Target::Module(ctx), name, bytes)?;
            set.push(name, kind, Code::Module(raw as CUmodule));
        }
        Ok(set)
    }

    /// Load every blob as a context-independent library (`cuLibraryLoadData`).
    pub(crate) fn load_libraries(
        driver: &'static sys::Driver,
        blobs: &[Blob<'_>],
    ) -> Result<ModuleSet> {
        let mut set = ModuleSet::empty(Owner::Driver(driver), blobs.len());
        for &(name, bytes) in blobs {
            set.check_new_name(name)?;
            let (raw, kind) = load(driver, Target::Library, name, bytes)?;
            set.push(name, kind, Code::Library(raw as CUlibrary));
        }
        Ok(set)
    }

    fn empty(owner: Owner, capacity: usize) -> ModuleSet {
        ModuleSet {
            list: Vec::with_capacity(capacity),
            index: HashMap::with_capacity(capacity),
            owner,
        }
    }

    fn check_new_name(&self, name: &str) -> Result<()> {
        if self.index.contains_key(name) {
            return Err(invalid_arg(format!("module '{name}' is listed twice")));
        }
        Ok(())
    }

    fn push(&mut self, name: &str, kind: BlobKind, code: Code) {
        self.index.insert(name.into(), self.list.len());
        self.list.push(Loaded {
            name: name.into(),
            kind,
            code,
        });
    }

    /// The modules, in load order.
    pub(crate) fn list(&self) -> &[Loaded] {
        &self.list
    }

    /// The index of module `name`.
    pub(crate) fn position(&self, name: &str) -> Option<usize> {
        self.index.get(name).copied()
    }

    /// Whether the set holds libraries (usable on any device).
    pub(crate) fn is_library(&self) -> bool {
        matches!(self.owner, Owner::Driver(_))
    }

    /// Index of `module`, or [`ErrorKind::NotFound`] naming what was looked for.
    pub(crate) fn require(&self, module: &str, looking_for: Option<&str>) -> Result<usize> {
        self.position(module).ok_or_else(|| {
            ErrorKind::NotFound {
                kind: NameKind::Module,
                module: module.to_owned(),
                name: looking_for.map(str::to_owned),
                call: None,
                status: None,
            }
            .into()
        })
    }

    /// The function `name` of module `index` in `ctx` (which must be current):
    /// `cuModuleGetFunction`, or `cuLibraryGetKernel` + `cuKernelGetFunction`.
    pub(crate) fn function(
        &self,
        d: &'static sys::Driver,
        index: usize,
        name: &CStr,
    ) -> Result<CUfunction, CallError> {
        let mut func: CUfunction = std::ptr::null_mut();
        match self.list[index].code {
            // SAFETY: writes one handle; the module is loaded, the name NUL-terminated.
            Code::Module(m) => unsafe { cu!(d, cuModuleGetFunction(&mut func, m, name.as_ptr())) }?,
            Code::Library(lib) => {
                let mut kernel: CUkernel = std::ptr::null_mut();
                // SAFETY: writes one handle; the library is loaded, the name NUL-terminated.
                unsafe { cu!(d, cuLibraryGetKernel(&mut kernel, lib, name.as_ptr())) }?;
                // SAFETY: writes the kernel's function in the current context.
                unsafe { cu!(d, cuKernelGetFunction(&mut func, kernel)) }?;
            }
        }
        Ok(func)
    }

    /// The `__device__` symbol `name` of module `index` in the current context.
    pub(crate) fn global(
        &self,
        d: &'static sys::Driver,
        index: usize,
        name: &CStr,
    ) -> Result<(CUdeviceptr, usize), CallError> {
        let (mut ptr, mut bytes): (CUdeviceptr, usize) = (0, 0);
        match self.list[index].code {
            // SAFETY: writes an address and a size; the module is loaded.
            Code::Module(m) => unsafe {
                cu!(
                    d,
                    cuModuleGetGlobal_v2(&mut ptr, &mut bytes, m, name.as_ptr())
                )
            }?,
            // SAFETY: as above, for the library's module in the current context.
            Code::Library(lib) => unsafe {
                cu!(
                    d,
                    cuLibraryGetGlobal(&mut ptr, &mut bytes, lib, name.as_ptr())
                )
            }?,
        }
        Ok((ptr, bytes))
    }

    /// The kernel names of module `index` (CUDA 12.4+ for modules, 12.? for
    /// libraries: a missing symbol otherwise).
    pub(crate) fn kernel_names(
        &self,
        d: &'static sys::Driver,
        index: usize,
    ) -> Result<Vec<String>, CallError> {
        let mut count: c_uint = 0;
        let mut names = Vec::new();
        let copy = |name: *const c_char, names: &mut Vec<String>| {
            if !name.is_null() {
                // SAFETY: non-null, NUL-terminated, owned by the driver while the code
                // is loaded; copied out at once.
                names.push(
                    unsafe { CStr::from_ptr(name) }
                        .to_string_lossy()
                        .into_owned(),
                );
            }
        };
        match self.list[index].code {
            Code::Module(m) => {
                // SAFETY: writes one unsigned int for a loaded module.
                unsafe { cu!(d, cuModuleGetFunctionCount(&mut count, m)) }?;
                let mut funcs: Vec<CUfunction> = vec![std::ptr::null_mut(); count as usize];
                // SAFETY: the array has exactly `count` slots.
                unsafe { cu!(d, cuModuleEnumerateFunctions(funcs.as_mut_ptr(), count, m)) }?;
                for f in funcs {
                    let mut name: *const c_char = std::ptr::null();
                    // SAFETY: writes a pointer to the driver's own name.
                    unsafe { cu!(d, cuFuncGetName(&mut name, f)) }?;
                    copy(name, &mut names);
                }
            }
            Code::Library(lib) => {
                // SAFETY: writes one unsigned int for a loaded library.
                unsafe { cu!(d, cuLibraryGetKernelCount(&mut count, lib)) }?;
                let mut kernels: Vec<CUkernel> = vec![std::ptr::null_mut(); count as usize];
                // SAFETY: the array has exactly `count` slots.
                unsafe {
                    cu!(
                        d,
                        cuLibraryEnumerateKernels(kernels.as_mut_ptr(), count, lib)
                    )
                }?;
                for k in kernels {
                    let mut name: *const c_char = std::ptr::null();
                    // SAFETY: writes a pointer to the driver's own name.
                    unsafe { cu!(d, cuKernelGetName(&mut name, k)) }?;
                    copy(name, &mut names);
                }
            }
        }
        Ok(names)
    }
}

impl Drop for ModuleSet {
    fn drop(&mut self) {
        if self.list.is_empty() {
            return;
        }
        let list = std::mem::take(&mut self.list);
        let unload = |d: &'static sys::Driver, failures: &mut Vec<CallError>| {
            for m in &list {
                // SAFETY: each handle was loaded into this set and is unloaded once.
                let result = unsafe {
                    match m.code {
                        Code::Module(raw) => cu!(d, cuModuleUnload(raw)),
                        Code::Library(raw) => cu!(d, cuLibraryUnload(raw)),
                    }
                };
                if let Err(e) = result {
                    failures.push(e);
                }
            }
        };
        match &self.owner {
            Owner::Context(ctx, made) => ctx.release_with(
                *made,
                format_args!("unloading kernel modules on device {}", ctx.ordinal()),
                unload,
            ),
            Owner::Driver(d) => {
                let mut failures = Vec::new();
                unload(d, &mut failures);
                report_drop_failures(format_args!("unloading kernel libraries"), &failures);
            }
        }
    }
}

/// Where a blob is loaded.
enum Target<'a> {
    Module(&'a CudaContext),
    Library,
}

/// Check `blob` and load it, capturing the JIT logs; the raw handle and the kind.
fn load(
    d: &'static sys::Driver,
    target: Target<'_>,
    name: &str,
    blob: &[u8],
) -> Result<(*mut c_void, BlobKind)> {
    let image = blob::prepare(name, blob)?;
    let mut error_log = vec![0u8; JIT_LOG_BYTES];
    let mut info_log = vec![0u8; JIT_LOG_BYTES];
    let mut options: [CUjit_option; 4] = [
        CUjit_option::CU_JIT_INFO_LOG_BUFFER,
        CUjit_option::CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES,
        CUjit_option::CU_JIT_ERROR_LOG_BUFFER,
        CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
    ];
    // Sizes travel in the pointer-sized slots, as the driver API specifies.
    let mut values: [*mut c_void; 4] = [
        info_log.as_mut_ptr().cast(),
        JIT_LOG_BYTES as *mut c_void,
        error_log.as_mut_ptr().cast(),
        JIT_LOG_BYTES as *mut c_void,
    ];
    let code = image.bytes.as_ptr().cast::<c_void>();
    let n = options.len() as c_uint;
    let mut raw: *mut c_void = std::ptr::null_mut();
    let (call, loaded) = match target {
        Target::Module(ctx) => {
            let bound = ctx.bind_fast();
            let result = bound.and_then(|()| {
                let mut module: CUmodule = std::ptr::null_mut();
                // SAFETY: `image` was checked by `blob::prepare` (PTX NUL-terminated,
                // binary headers within bounds) and outlives the call; both log buffers
                // are JIT_LOG_BYTES long as declared; the context is current.
                let r = unsafe {
                    cu!(
                        d,
                        cuModuleLoadDataEx(
                            &mut module,
                            code,
                            n,
                            options.as_mut_ptr(),
                            values.as_mut_ptr()
                        )
                    )
                };
                raw = module.cast();
                r
            });
            ("cuModuleLoadDataEx", result)
        }
        Target::Library => {
            let mut lib: CUlibrary = std::ptr::null_mut();
            // SAFETY: as for modules; no library options; no context is needed.
            let result = unsafe {
                cu!(
                    d,
                    cuLibraryLoadData(
                        &mut lib,
                        code,
                        options.as_mut_ptr(),
                        values.as_mut_ptr(),
                        n,
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                        0
                    )
                )
            };
            raw = lib.cast();
            ("cuLibraryLoadData", result)
        }
    };
    match loaded {
        Ok(()) => Ok((raw, image.kind)),
        Err(CallError::Status {
            call: failed,
            status,
        }) if failed == call => {
            let log = log_text(&error_log);
            Err(ErrorKind::ModuleLoad {
                module: name.to_owned(),
                call,
                status,
                image: format!("{} of {} bytes", image.kind.label(), blob.len()),
                hint: arch_hint(&target, &image, status),
                jit_log: (!log.is_empty()).then_some(log),
            }
            .into())
        }
        Err(e) => Err(e.about(format_args!("module '{name}'"))),
    }
}

/// For a binary that has no code for this device: what it was built for.
fn arch_hint(target: &Target<'_>, image: &blob::Image<'_>, status: CUresult) -> Option<String> {
    let Target::Module(ctx) = target else {
        return None;
    };
    let (major, minor) = ctx.limits().compute_capability;
    let device = format!("the device is sm_{major}{minor}");
    match image.kind {
        BlobKind::Cubin => {
            let sm = blob::elf_info(&image.bytes)?.sm();
            (sm != major * 10 + minor).then(|| format!("the cubin was built for sm_{sm}, {device}"))
        }
        BlobKind::Fatbin if status == CUresult::CUDA_ERROR_NO_BINARY_FOR_GPU => {
            Some(format!("the fatbin has no code {device} can run"))
        }
        _ => None,
    }
}

/// The text of a JIT log buffer: up to its NUL, trimmed, at most
/// [`JIT_LOG_IN_ERROR`] bytes (cut at a character boundary, marked when cut).
pub(crate) fn log_text(buf: &[u8]) -> String {
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let text = String::from_utf8_lossy(&buf[..end]);
    let text = text.trim();
    if text.len() <= JIT_LOG_IN_ERROR {
        return text.to_owned();
    }
    let mut cut = JIT_LOG_IN_ERROR;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    format!(
        "{}\n[... log cut at {JIT_LOG_IN_ERROR} bytes]",
        &text[..cut]
    )
}

/// `name` as a C string for a lookup in `module`, or [`ErrorKind::InvalidName`].
pub(crate) fn c_name(module: &str, name: &str) -> Result<CString> {
    CString::new(name).map_err(|e| {
        ErrorKind::InvalidName {
            module: module.to_owned(),
            name: name.to_owned(),
            nul_at: e.nul_position(),
        }
        .into()
    })
}

#[cfg(test)]
#[path = "tests/module.rs"]
mod tests;
