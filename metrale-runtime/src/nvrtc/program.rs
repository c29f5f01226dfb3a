//! [`Program`]: a CUDA C++ source with its headers, options and name expressions;
//! compiling it ([`Program::compile`]) into a [`Compiled`].
//!
//! The NVRTC program handle exists only inside one compile call (created, used and
//! destroyed there, on the calling thread): NVRTC programs are not thread-safe, and
//! no metrale type ever holds one. `Program` and `Compiled` are plain data, so they
//! are `Send` and `Sync` without any `unsafe impl`.

use std::ffi::{c_char, CString};

use metrale_cuda_sys::nvrtc::{self as rtc, nvrtcProgram, nvrtcResult, Nvrtc};

use crate::context::AsContext;
use crate::error::Result;

use super::error::{into_error, LibraryStatus, NvrtcError};
use super::output::Compiled;
use super::Target;

/// One compiler option. The common ones are typed; [`CompileOption::Raw`] passes
/// any other NVRTC option as written.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CompileOption {
    /// `--std=<std>` (`c++17`, `c++20`).
    Std(String),
    /// `--device-as-default-execution-space` (`-default-device`).
    DefaultDevice,
    /// `--use_fast_math`.
    FastMath,
    /// `--generate-line-info` (`-lineinfo`).
    LineInfo,
    /// `--device-debug` (`-G`).
    DeviceDebug,
    /// `--define-macro=NAME` or `--define-macro=NAME=VALUE` (`-D`).
    Define(String, Option<String>),
    /// `--include-path=<dir>` (`-I`).
    IncludePath(String),
    /// `--maxrregcount=<n>`.
    MaxRegisters(u32),
    /// `--dlink-time-opt` (`-dlto`): emit LTO-IR for nvJitLink instead of code.
    Lto,
    /// Any other option, exactly as NVRTC takes it.
    Raw(String),
}

impl CompileOption {
    fn render(&self) -> String {
        match self {
            CompileOption::Std(s) => format!("--std={s}"),
            CompileOption::DefaultDevice => "--device-as-default-execution-space".to_owned(),
            CompileOption::FastMath => "--use_fast_math".to_owned(),
            CompileOption::LineInfo => "--generate-line-info".to_owned(),
            CompileOption::DeviceDebug => "--device-debug".to_owned(),
            CompileOption::Define(name, None) => format!("--define-macro={name}"),
            CompileOption::Define(name, Some(v)) => format!("--define-macro={name}={v}"),
            CompileOption::IncludePath(dir) => format!("--include-path={dir}"),
            CompileOption::MaxRegisters(n) => format!("--maxrregcount={n}"),
            CompileOption::Lto => "--dlink-time-opt".to_owned(),
            CompileOption::Raw(s) => s.clone(),
        }
    }
}

/// A CUDA C++ program to compile at run time: its source and name, the headers it
/// includes by name, options, and name expressions whose lowered (mangled) names
/// are read back after compiling (template kernels).
///
/// ```no_run
/// use metrale_runtime::nvrtc::{Program, Target};
/// # fn main() -> metrale_runtime::Result<()> {
/// let out = Program::new("scale.cu", r#"
///     template <typename T> __global__ void scale(T* x, T a, unsigned n) {
///         unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
///         if (i < n) x[i] *= a;
///     }"#)
///     .std("c++17")
///     .name_expression("scale<float>")
///     .compile(Target::Sm(90))?;
/// println!("{} -> {:?}", "scale<float>", out.lowered_name("scale<float>"));
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Program {
    pub(crate) name: String,
    pub(crate) source: String,
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) options: Vec<CompileOption>,
    pub(crate) name_expressions: Vec<String>,
    pub(crate) emit_ptx: bool,
}

impl Program {
    /// A program named `name` (what the log and errors call it, `saxpy.cu`).
    pub fn new(name: impl Into<String>, source: impl Into<String>) -> Program {
        Program {
            name: name.into(),
            source: source.into(),
            headers: Vec::new(),
            options: Vec::new(),
            name_expressions: Vec::new(),
            emit_ptx: false,
        }
    }

    /// A header the source can `#include "name"`, given as text.
    pub fn header(mut self, name: impl Into<String>, text: impl Into<String>) -> Program {
        self.headers.push((name.into(), text.into()));
        self
    }

    /// Add an option.
    pub fn option(mut self, option: CompileOption) -> Program {
        self.options.push(option);
        self
    }

    /// `--std=<std>`.
    pub fn std(self, std: impl Into<String>) -> Program {
        self.option(CompileOption::Std(std.into()))
    }

    /// Functions without an execution space are `__device__`.
    pub fn default_device(self) -> Program {
        self.option(CompileOption::DefaultDevice)
    }

    /// `--use_fast_math`.
    pub fn fast_math(self) -> Program {
        self.option(CompileOption::FastMath)
    }

    /// `--generate-line-info`.
    pub fn line_info(self) -> Program {
        self.option(CompileOption::LineInfo)
    }

    /// `--device-debug` (`-G`).
    pub fn device_debug(self) -> Program {
        self.option(CompileOption::DeviceDebug)
    }

    /// `#define name value` (or `#define name` for `None`) before the source.
    pub fn define(self, name: impl Into<String>, value: Option<&str>) -> Program {
        self.option(CompileOption::Define(name.into(), value.map(str::to_owned)))
    }

    /// A folder searched for `#include`s (NVRTC reads it itself).
    pub fn include_path(self, dir: impl Into<String>) -> Program {
        self.option(CompileOption::IncludePath(dir.into()))
    }

    /// At most `n` registers per thread.
    pub fn max_registers(self, n: u32) -> Program {
        self.option(CompileOption::MaxRegisters(n))
    }

    /// Emit LTO-IR (`-dlto`) for [`Linker`](super::Linker) instead of PTX/cubin.
    pub fn lto(self) -> Program {
        self.option(CompileOption::Lto)
    }

    /// Any other NVRTC option, as written (`-Xptxas=-v`).
    pub fn raw_option(self, option: impl Into<String>) -> Program {
        self.option(CompileOption::Raw(option.into()))
    }

    /// Ask for the PTX too when compiling for a real architecture (`sm_XX`), whose
    /// output is otherwise the cubin alone.
    pub fn emit_ptx(mut self) -> Program {
        self.emit_ptx = true;
        self
    }

    /// An expression naming a `__global__` function or `__device__` variable
    /// (`scale<float>`, `&table<4>`) whose lowered name
    /// [`Compiled::lowered_name`] gives after compiling.
    pub fn name_expression(mut self, expression: impl Into<String>) -> Program {
        self.name_expressions.push(expression.into());
        self
    }

    /// The program's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The options as NVRTC is given them for `target`.
    pub fn rendered_options(&self, target: Target) -> Vec<String> {
        let mut out = Vec::with_capacity(self.options.len() + 1);
        out.push(format!("--gpu-architecture={target}"));
        out.extend(self.options.iter().map(CompileOption::render));
        out
    }

    pub(crate) fn is_lto(&self) -> bool {
        self.options.contains(&CompileOption::Lto)
    }

    /// Compile for `target`. A real architecture (`sm_90`) gives a cubin (and the
    /// PTX after [`Program::emit_ptx`]), a virtual one (`compute_90`) PTX, and
    /// [`Program::lto`] LTO-IR. The log of a successful compile (warnings) is kept
    /// on the output.
    ///
    /// # Errors
    /// The library's load error; an input with an interior NUL; a failed compile
    /// with NVRTC's status and the whole program log.
    pub fn compile(&self, target: Target) -> Result<Compiled> {
        compile(self, target).map_err(into_error)
    }

    /// Compile for the device of `ctx` (a context, a host or a stream): its
    /// architecture when NVRTC supports it, else PTX for the newest virtual
    /// architecture NVRTC has below it (which the driver compiles when loading).
    ///
    /// # Errors
    /// As [`Program::compile`].
    pub fn compile_for(&self, ctx: &impl AsContext) -> Result<Compiled> {
        let cc = ctx.context().limits().compute_capability;
        let target = device_target(cc).map_err(into_error)?;
        self.compile(target)
    }
}

/// The target for a device of compute capability `cc`: see [`Program::compile_for`].
pub(crate) fn device_target(cc: (u32, u32)) -> std::result::Result<Target, NvrtcError> {
    let arch = cc.0 * 10 + cc.1;
    let supported = supported_archs_raw()?;
    if supported.is_empty() || supported.contains(&arch) {
        return Ok(Target::Sm(arch));
    }
    match supported.iter().copied().filter(|&a| a < arch).max() {
        Some(below) => Ok(Target::Compute(below)),
        None => Err(NvrtcError::Invalid {
            subject: format!("device of compute capability {}.{}", cc.0, cc.1),
            reason: format!("the loaded NVRTC supports no architecture at or below sm_{arch} (it has {supported:?})"),
        }),
    }
}

/// The architectures the loaded NVRTC compiles for (`nvrtcGetSupportedArchs`).
///
/// # Errors
/// The library's load error, or the failed call.
pub fn supported_archs() -> Result<Vec<u32>> {
    supported_archs_raw().map_err(into_error)
}

fn supported_archs_raw() -> std::result::Result<Vec<u32>, NvrtcError> {
    let lib = library()?;
    let subject = || "supported architectures".to_owned();
    let mut n = 0;
    check(
        lib,
        "nvrtcGetNumSupportedArchs",
        subject,
        // SAFETY: writes one int.
        |f: rtc::PFN_nvrtcGetNumSupportedArchs| unsafe { f(&mut n) },
        Nvrtc::nvrtcGetNumSupportedArchs,
    )?;
    let mut archs = vec![0i32; usize::try_from(n).unwrap_or(0)];
    check(
        lib,
        "nvrtcGetSupportedArchs",
        subject,
        // SAFETY: the buffer holds the count NVRTC just reported.
        |f: rtc::PFN_nvrtcGetSupportedArchs| unsafe { f(archs.as_mut_ptr()) },
        Nvrtc::nvrtcGetSupportedArchs,
    )?;
    Ok(archs
        .into_iter()
        .filter_map(|a| u32::try_from(a).ok())
        .collect())
}

/// The loaded NVRTC's version (major and minor; NVRTC reports no patch level).
///
/// # Errors
/// The library's load error.
pub fn nvrtc_version() -> Result<crate::Version> {
    let lib = library().map_err(into_error)?;
    lib.version().map(crate::Version::from).ok_or_else(|| {
        into_error(NvrtcError::MissingSymbol {
            missing: sys_missing(lib, "nvrtcVersion"),
            subject: "NVRTC version".to_owned(),
        })
    })
}

fn sys_missing(lib: &Nvrtc, name: &'static str) -> metrale_cuda_sys::LibraryMissingSymbol {
    metrale_cuda_sys::LibraryMissingSymbol {
        library: "NVRTC",
        name,
        version: lib.version(),
    }
}

pub(crate) fn library() -> std::result::Result<&'static Nvrtc, NvrtcError> {
    rtc::nvrtc().map_err(|e| NvrtcError::Unavailable(e.clone()))
}

/// Look `get` up in `lib`, call it through `call`, and check its status; the
/// subject is formatted only on failure.
fn check<F>(
    lib: &'static Nvrtc,
    name: &'static str,
    subject: impl Fn() -> String,
    call: impl FnOnce(F) -> nvrtcResult,
    get: fn(&Nvrtc) -> std::result::Result<F, metrale_cuda_sys::LibraryMissingSymbol>,
) -> std::result::Result<(), NvrtcError> {
    let f = get(lib).map_err(|missing| NvrtcError::MissingSymbol {
        missing,
        subject: subject(),
    })?;
    let status = call(f);
    if status.is_success() {
        Ok(())
    } else {
        Err(NvrtcError::Call {
            call: name,
            status: LibraryStatus::Nvrtc(status),
            subject: subject(),
        })
    }
}

/// An NVRTC program handle, destroyed on drop; never leaves the compile call.
struct Handle {
    lib: &'static Nvrtc,
    prog: nvrtcProgram,
}

impl Drop for Handle {
    fn drop(&mut self) {
        if let Ok(f) = self.lib.nvrtcDestroyProgram() {
            // SAFETY: `prog` was created by nvrtcCreateProgram and is destroyed
            // once, here.
            let status = unsafe { f(&mut self.prog) };
            if !status.is_success() {
                crate::error::report_line(format_args!(
                    "nvrtcDestroyProgram failed: {}",
                    LibraryStatus::Nvrtc(status)
                ));
            }
        }
    }
}

fn c_string(subject: &str, what: &str, text: &str) -> std::result::Result<CString, NvrtcError> {
    CString::new(text).map_err(|e| NvrtcError::Invalid {
        subject: format!("program '{subject}'"),
        reason: format!("{what} has a NUL byte at offset {}", e.nul_position()),
    })
}

/// Read one of NVRTC's size-then-bytes outputs; `None` when NVRTC has none of
/// that kind for this program.
fn read_output(
    h: &Handle,
    subject: &dyn Fn() -> String,
    names: (&'static str, &'static str),
    size_fn: std::result::Result<
        unsafe extern "C" fn(nvrtcProgram, *mut usize) -> nvrtcResult,
        metrale_cuda_sys::LibraryMissingSymbol,
    >,
    data_fn: std::result::Result<
        unsafe extern "C" fn(nvrtcProgram, *mut c_char) -> nvrtcResult,
        metrale_cuda_sys::LibraryMissingSymbol,
    >,
) -> std::result::Result<Vec<u8>, NvrtcError> {
    let missing = |missing| NvrtcError::MissingSymbol {
        missing,
        subject: subject(),
    };
    let failed = |call, status| NvrtcError::Call {
        call,
        status: LibraryStatus::Nvrtc(status),
        subject: subject(),
    };
    let size_f = size_fn.map_err(missing)?;
    let data_f = data_fn.map_err(missing)?;
    let mut size = 0usize;
    // SAFETY: a live program; writes one size_t.
    let status = unsafe { size_f(h.prog, &mut size) };
    if !status.is_success() {
        return Err(failed(names.0, status));
    }
    let mut bytes = vec![0u8; size];
    if size > 0 {
        // SAFETY: the buffer holds the `size` bytes NVRTC just reported.
        let status = unsafe { data_f(h.prog, bytes.as_mut_ptr().cast()) };
        if !status.is_success() {
            return Err(failed(names.1, status));
        }
    }
    Ok(bytes)
}

fn strip_nul(mut bytes: Vec<u8>) -> Vec<u8> {
    while bytes.last() == Some(&0) {
        bytes.pop();
    }
    bytes
}

pub(crate) fn compile(p: &Program, target: Target) -> std::result::Result<Compiled, NvrtcError> {
    let lib = library()?;
    let subject = || format!("program '{}'", p.name);
    let source = c_string(&p.name, "the source", &p.source)?;
    let name = c_string(&p.name, "the name", &p.name)?;
    let mut header_texts = Vec::with_capacity(p.headers.len());
    let mut header_names = Vec::with_capacity(p.headers.len());
    for (n, text) in &p.headers {
        header_names.push(c_string(&p.name, "a header's name", n)?);
        header_texts.push(c_string(&p.name, &format!("header '{n}'"), text)?);
    }
    let options = p
        .rendered_options(target)
        .iter()
        .map(|o| c_string(&p.name, "an option", o))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let expressions = p
        .name_expressions
        .iter()
        .map(|e| c_string(&p.name, "a name expression", e))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let too_many = |what: &str| NvrtcError::Invalid {
        subject: subject(),
        reason: format!("too many {what}"),
    };
    let n_headers = i32::try_from(header_texts.len()).map_err(|_| too_many("headers"))?;
    let n_options = i32::try_from(options.len()).map_err(|_| too_many("options"))?;
    let text_ptrs: Vec<*const c_char> = header_texts.iter().map(|c| c.as_ptr()).collect();
    let name_ptrs: Vec<*const c_char> = header_names.iter().map(|c| c.as_ptr()).collect();
    let option_ptrs: Vec<*const c_char> = options.iter().map(|c| c.as_ptr()).collect();

    let mut prog: nvrtcProgram = std::ptr::null_mut();
    check(
        lib,
        "nvrtcCreateProgram",
        subject,
        // SAFETY: every pointer is a live NUL-terminated string; the two arrays
        // hold `n_headers` entries each; NVRTC copies what it keeps.
        |f: rtc::PFN_nvrtcCreateProgram| unsafe {
            f(
                &mut prog,
                source.as_ptr(),
                name.as_ptr(),
                n_headers,
                text_ptrs.as_ptr(),
                name_ptrs.as_ptr(),
            )
        },
        Nvrtc::nvrtcCreateProgram,
    )?;
    let h = Handle { lib, prog };
    for e in &expressions {
        check(
            lib,
            "nvrtcAddNameExpression",
            subject,
            // SAFETY: a live program and a NUL-terminated expression (copied).
            |f: rtc::PFN_nvrtcAddNameExpression| unsafe { f(h.prog, e.as_ptr()) },
            Nvrtc::nvrtcAddNameExpression,
        )?;
    }
    let compile_f = lib
        .nvrtcCompileProgram()
        .map_err(|missing| NvrtcError::MissingSymbol {
            missing,
            subject: subject(),
        })?;
    // SAFETY: a live program; `n_options` NUL-terminated strings that outlive the call.
    let status = unsafe { compile_f(h.prog, n_options, option_ptrs.as_ptr()) };
    let log = read_output(
        &h,
        &subject,
        ("nvrtcGetProgramLogSize", "nvrtcGetProgramLog"),
        lib.nvrtcGetProgramLogSize(),
        lib.nvrtcGetProgramLog(),
    );
    if !status.is_success() {
        let log = match log {
            Ok(bytes) => String::from_utf8_lossy(&strip_nul(bytes)).into_owned(),
            Err(e) => format!("(the log could not be read: {e})"),
        };
        return Err(NvrtcError::Compile {
            program: p.name.clone(),
            target,
            status,
            log,
        });
    }
    let log = String::from_utf8_lossy(&strip_nul(log?)).into_owned();

    let lto = p.is_lto();
    let (mut ptx, mut cubin, mut lto_ir) = (None, None, None);
    if lto {
        lto_ir = Some(read_output(
            &h,
            &subject,
            ("nvrtcGetLTOIRSize", "nvrtcGetLTOIR"),
            lib.nvrtcGetLTOIRSize(),
            lib.nvrtcGetLTOIR(),
        )?);
    } else {
        if matches!(target, Target::Sm(_)) {
            cubin = Some(read_output(
                &h,
                &subject,
                ("nvrtcGetCUBINSize", "nvrtcGetCUBIN"),
                lib.nvrtcGetCUBINSize(),
                lib.nvrtcGetCUBIN(),
            )?);
        }
        if p.emit_ptx || matches!(target, Target::Compute(_)) {
            ptx = Some(strip_nul(read_output(
                &h,
                &subject,
                ("nvrtcGetPTXSize", "nvrtcGetPTX"),
                lib.nvrtcGetPTXSize(),
                lib.nvrtcGetPTX(),
            )?));
        }
    }

    let mut lowered = Vec::with_capacity(expressions.len());
    for (e, c) in p.name_expressions.iter().zip(&expressions) {
        let mut out: *const c_char = std::ptr::null();
        check(
            lib,
            "nvrtcGetLoweredName",
            || format!("program '{}', name expression '{e}'", p.name),
            // SAFETY: a live, compiled program; NVRTC writes a pointer to a string
            // it owns until the program is destroyed (copied just below).
            |f: rtc::PFN_nvrtcGetLoweredName| unsafe { f(h.prog, c.as_ptr(), &mut out) },
            Nvrtc::nvrtcGetLoweredName,
        )?;
        let name = if out.is_null() {
            String::new()
        } else {
            // SAFETY: non-null, NUL-terminated, alive until `h` drops below.
            unsafe { std::ffi::CStr::from_ptr(out) }
                .to_string_lossy()
                .into_owned()
        };
        lowered.push((e.clone(), name));
    }
    drop(h);

    // What the driver will be given passes metrale's blob checks before anyone
    // can load it.
    for blob in [&cubin, &ptx].into_iter().flatten() {
        crate::blob::prepare(&p.name, blob).map_err(|e| NvrtcError::Invalid {
            subject: subject(),
            reason: format!("NVRTC's output fails the blob checks: {e}"),
        })?;
    }
    Ok(Compiled {
        name: p.name.clone(),
        target,
        ptx,
        cubin,
        lto_ir,
        log,
        lowered,
    })
}
