//! [`Linker`]: device objects (LTO-IR above all) linked by nvJitLink into one
//! cubin for one architecture.
//!
//! The nvJitLink handle exists only inside [`Linker::link`], on the calling thread
//! (nvJitLink handles are not thread-safe); `Linker` itself is plain data.

use std::ffi::{c_char, CString};

use metrale_cuda_sys::nvjitlink::{
    self as jit, nvJitLinkHandle, nvJitLinkInputType, nvJitLinkResult, NvJitLink,
};
use metrale_cuda_sys::LibraryMissingSymbol;

use crate::error::Result;

use super::error::{into_error, NvrtcError};
use super::{Compiled, Target};

/// What kind of object an input is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LinkInput {
    /// LTO-IR (NVRTC with `-dlto`).
    LtoIr,
    /// An ELF cubin.
    Cubin,
    /// PTX text.
    Ptx,
    /// A fatbin.
    Fatbin,
}

impl LinkInput {
    fn raw(self) -> nvJitLinkInputType {
        match self {
            LinkInput::LtoIr => nvJitLinkInputType::NVJITLINK_INPUT_LTOIR,
            LinkInput::Cubin => nvJitLinkInputType::NVJITLINK_INPUT_CUBIN,
            LinkInput::Ptx => nvJitLinkInputType::NVJITLINK_INPUT_PTX,
            LinkInput::Fatbin => nvJitLinkInputType::NVJITLINK_INPUT_FATBIN,
        }
    }
}

/// Objects to link into one cubin for an architecture.
///
/// ```no_run
/// use metrale_runtime::nvrtc::{Linker, Program, Target};
/// # fn main() -> metrale_runtime::Result<()> {
/// let a = Program::new("a.cu", "extern __device__ float twice(float);\n\
///     extern \"C\" __global__ void k(float* x) { x[0] = twice(x[0]); }")
///     .raw_option("-rdc=true").lto().compile(Target::Sm(90))?;
/// let b = Program::new("b.cu", "__device__ float twice(float v) { return 2 * v; }")
///     .raw_option("-rdc=true").lto().compile(Target::Sm(90))?;
/// let linked = Linker::new(Target::Sm(90)).add_compiled(&a)?.add_compiled(&b)?.link()?;
/// assert!(!linked.cubin().is_empty());
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Linker {
    target: Target,
    options: Vec<String>,
    inputs: Vec<(LinkInput, String, Vec<u8>)>,
}

/// The result of a link: one cubin, and the linker's info log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Linked {
    cubin: Vec<u8>,
    info_log: String,
}

impl Linked {
    /// The linked cubin (it passed metrale's blob checks).
    pub fn cubin(&self) -> &[u8] {
        &self.cubin
    }

    /// The cubin, owned.
    pub fn into_cubin(self) -> Vec<u8> {
        self.cubin
    }

    /// What the linker said on success (empty when nothing).
    pub fn info_log(&self) -> &str {
        &self.info_log
    }
}

impl Linker {
    /// A link for `target` (a real architecture: the output is a cubin).
    pub fn new(target: Target) -> Linker {
        Linker {
            target,
            options: Vec::new(),
            inputs: Vec::new(),
        }
    }

    /// Any nvJitLink option, as written (`-O3`, `-lineinfo`).
    pub fn option(mut self, option: impl Into<String>) -> Linker {
        self.options.push(option.into());
        self
    }

    /// Add an object of `kind` named `name` (for the log).
    pub fn add(
        mut self,
        kind: LinkInput,
        name: impl Into<String>,
        bytes: impl Into<Vec<u8>>,
    ) -> Linker {
        self.inputs.push((kind, name.into(), bytes.into()));
        self
    }

    /// Add what a compile produced: its LTO-IR, else its cubin, else its PTX.
    ///
    /// # Errors
    /// A [`Compiled`] with none of them.
    pub fn add_compiled(self, compiled: &Compiled) -> Result<Linker> {
        let (kind, bytes) = if let Some(ir) = compiled.lto_ir() {
            (LinkInput::LtoIr, ir)
        } else if let Some(cubin) = compiled.cubin() {
            (LinkInput::Cubin, cubin)
        } else if let Some(ptx) = compiled.ptx() {
            (LinkInput::Ptx, ptx)
        } else {
            return Err(into_error(NvrtcError::Invalid {
                subject: format!("link input '{}'", compiled.name()),
                reason: "the compile produced nothing to link".to_owned(),
            }));
        };
        Ok(self.add(kind, compiled.name(), bytes))
    }

    /// Link everything into one cubin.
    ///
    /// # Errors
    /// The library's load error; nothing to link; a failed call with its status
    /// and the linker's error log.
    pub fn link(&self) -> Result<Linked> {
        link(self).map_err(into_error)
    }
}

struct Handle {
    lib: &'static NvJitLink,
    h: nvJitLinkHandle,
}

impl Drop for Handle {
    fn drop(&mut self) {
        if let Ok(f) = self.lib.__nvJitLinkDestroy_13_0() {
            // SAFETY: created by nvJitLinkCreate, destroyed once, here.
            let status = unsafe { f(&mut self.h) };
            if !status.is_success() {
                crate::error::report_line(format_args!("nvJitLinkDestroy failed: {status}"));
            }
        }
    }
}

fn link(l: &Linker) -> std::result::Result<Linked, NvrtcError> {
    let lib = jit::nvjitlink().map_err(|e| NvrtcError::Unavailable(e.clone()))?;
    let subject = || {
        let names: Vec<&str> = l.inputs.iter().map(|(_, n, _)| n.as_str()).collect();
        format!("link of [{}] for {}", names.join(", "), l.target)
    };
    if l.inputs.is_empty() {
        return Err(NvrtcError::Invalid {
            subject: subject(),
            reason: "nothing to link".to_owned(),
        });
    }
    let missing = |missing: LibraryMissingSymbol| NvrtcError::MissingSymbol {
        missing,
        subject: subject(),
    };
    let mut options = vec![format!("-arch=sm_{}", l.target.arch())];
    if l.inputs.iter().any(|(k, _, _)| *k == LinkInput::LtoIr) {
        options.push("-lto".to_owned());
    }
    options.extend(l.options.iter().cloned());
    let options = options
        .iter()
        .map(|o| {
            CString::new(o.as_str()).map_err(|_| NvrtcError::Invalid {
                subject: subject(),
                reason: format!("option {o:?} has a NUL byte"),
            })
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let option_ptrs: Vec<*const c_char> = options.iter().map(|c| c.as_ptr()).collect();
    let n_options = u32::try_from(option_ptrs.len()).unwrap_or(u32::MAX);

    let create = lib.__nvJitLinkCreate_13_0().map_err(missing)?;
    let mut raw: nvJitLinkHandle = std::ptr::null_mut();
    // SAFETY: `n_options` live NUL-terminated strings; writes one handle.
    let status = unsafe { create(&mut raw, n_options, option_ptrs.as_ptr()) };
    if !status.is_success() {
        return Err(NvrtcError::Link {
            call: "__nvJitLinkCreate_13_0",
            status,
            subject: subject(),
            log: String::new(),
        });
    }
    let h = Handle { lib, h: raw };
    let fail = |h: &Handle, call: &'static str, status: nvJitLinkResult| NvrtcError::Link {
        call,
        status,
        subject: subject(),
        log: read_log(h, true).unwrap_or_default(),
    };

    let add = lib.__nvJitLinkAddData_13_0().map_err(missing)?;
    for (kind, name, bytes) in &l.inputs {
        let cname = CString::new(name.as_str()).map_err(|_| NvrtcError::Invalid {
            subject: subject(),
            reason: format!("input name {name:?} has a NUL byte"),
        })?;
        // PTX is handed over NUL-terminated (nvJitLink reads text to its NUL).
        let mut owned;
        let data: &[u8] = if *kind == LinkInput::Ptx && bytes.last() != Some(&0) {
            owned = Vec::with_capacity(bytes.len() + 1);
            owned.extend_from_slice(bytes);
            owned.push(0);
            &owned
        } else {
            bytes
        };
        // SAFETY: a live handle; `data` is `data.len()` readable bytes, copied by
        // nvJitLink; the name is NUL-terminated.
        let status = unsafe {
            add(
                h.h,
                kind.raw(),
                data.as_ptr().cast(),
                data.len(),
                cname.as_ptr(),
            )
        };
        if !status.is_success() {
            return Err(fail(&h, "__nvJitLinkAddData_13_0", status));
        }
    }
    let complete = lib.__nvJitLinkComplete_13_0().map_err(missing)?;
    // SAFETY: a live handle.
    let status = unsafe { complete(h.h) };
    if !status.is_success() {
        return Err(fail(&h, "__nvJitLinkComplete_13_0", status));
    }
    let size_f = lib.__nvJitLinkGetLinkedCubinSize_13_0().map_err(missing)?;
    let data_f = lib.__nvJitLinkGetLinkedCubin_13_0().map_err(missing)?;
    let mut size = 0usize;
    // SAFETY: a live, completed handle; writes one size_t.
    let status = unsafe { size_f(h.h, &mut size) };
    if !status.is_success() {
        return Err(fail(&h, "__nvJitLinkGetLinkedCubinSize_13_0", status));
    }
    let mut cubin = vec![0u8; size];
    // SAFETY: the buffer holds the `size` bytes just reported.
    let status = unsafe { data_f(h.h, cubin.as_mut_ptr().cast()) };
    if !status.is_success() {
        return Err(fail(&h, "__nvJitLinkGetLinkedCubin_13_0", status));
    }
    let info_log = read_log(&h, false).unwrap_or_default();
    drop(h);
    crate::blob::prepare("linked cubin", &cubin).map_err(|e| NvrtcError::Invalid {
        subject: subject(),
        reason: format!("nvJitLink's output fails the blob checks: {e}"),
    })?;
    Ok(Linked { cubin, info_log })
}

/// The error log (`error`) or the info log of a link; `None` when unreadable.
fn read_log(h: &Handle, error: bool) -> Option<String> {
    let (size_f, data_f) = if error {
        (
            h.lib.__nvJitLinkGetErrorLogSize_13_0().ok()?,
            h.lib.__nvJitLinkGetErrorLog_13_0().ok()?,
        )
    } else {
        (
            h.lib.__nvJitLinkGetInfoLogSize_13_0().ok()?,
            h.lib.__nvJitLinkGetInfoLog_13_0().ok()?,
        )
    };
    let mut size = 0usize;
    // SAFETY: a live handle; writes one size_t.
    if !unsafe { size_f(h.h, &mut size) }.is_success() {
        return None;
    }
    if size == 0 {
        return Some(String::new());
    }
    let mut buf = vec![0u8; size];
    // SAFETY: the buffer holds the `size` bytes just reported.
    if !unsafe { data_f(h.h, buf.as_mut_ptr().cast()) }.is_success() {
        return None;
    }
    while buf.last() == Some(&0) {
        buf.pop();
    }
    Some(String::from_utf8_lossy(&buf).into_owned())
}
