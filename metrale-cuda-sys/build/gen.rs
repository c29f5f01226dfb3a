//! The one bindgen configuration for every header the crate binds (`cuda.h`, with
//! the `nvrtc` feature `nvrtc.h` and `nvJitLink.h`, with `nccl` `nccl.h`, with
//! `cublas` `cublas_api.h` and `cublasLt.h`, with `nvtx` NVTX v3's
//! `nvToolsExt.h`), and the one pass that turns bindgen's
//! `extern "C"` block into a run-time loaded function table.
//!
//! NVTX is header-only (a tool fills the entries; nothing is resolved from a
//! library), so its spec keeps only the types it names ([`Spec::types_only`]) and
//! gets no table.
//!
//! A header differs from another only by its [`Spec`]: which file's declarations
//! are kept, what the table and its owner are called, which enum is the status
//! type and how a missing symbol is reported.
//!
//! Used by `build.rs` when the `bindgen` feature is on; `scripts/regen-bindings.sh`
//! goes through that same path to rewrite the committed `src/*bindings.rs`, so the
//! committed files and a feature build can never be configured differently.
//!
//! bindgen is asked for unformatted output (`Formatter::None`): one token per word,
//! separated by single spaces. That makes the post-processing below a plain scan
//! over tokens, and formatting is left to `rustfmt` in the script.

use std::fmt::Write as _;
use std::path::Path;

/// Minor version of the Rust release bindgen writes for (1.82: `unsafe extern`).
const RUST_TARGET_MINOR: u64 = 82;

/// What makes one header's bindings different from another's.
pub struct Spec {
    /// The header file bindgen reads (`cuda.h`); only its declarations are kept.
    pub header: &'static str,
    /// What the first line of the generated file calls the header.
    pub describes: &'static str,
    /// The crate-private table struct (`DriverFns`).
    pub table: &'static str,
    /// The public type that owns the table and gets one accessor per function,
    /// as a path from the crate root (`crate::Driver`).
    pub owner: &'static str,
    /// The enum type every function returns (`cudaError_enum`); it gets `name()`.
    pub status: &'static str,
    /// What the library is, in the resolve function's safety text.
    pub library: &'static str,
    /// The expression an accessor returns for an absent symbol, `{name}` standing
    /// for the symbol's name; its type is the accessor's error type `{error}`.
    pub missing: &'static str,
    /// The accessor's error type (a path from the crate root).
    pub error: &'static str,
    /// What the accessor's docs call the loaded library (`driver`).
    pub loaded: &'static str,
    /// A folder of the crate searched after the header's own (`nccl_stub`: the
    /// stand-ins for the CUDA runtime headers `nccl.h` includes), if any.
    pub stub_include: Option<&'static str>,
    /// The crate's wrapper header that includes [`header`](Spec::header).
    pub wrapper: &'static str,
    /// The header's own include-folder variable, tried before the CUDA ones.
    pub include_var: Option<&'static str>,
    /// The bindings file written (`src/<file>` when committed).
    pub file: &'static str,
    /// For a header whose functions are not resolved from a library (NVTX): the
    /// types and constants kept (regular expressions, matched whole), with what
    /// they use; no function table and no status names are made, and `table`,
    /// `owner`, `status`, `missing`, `error` and `loaded` are unused.
    pub types_only: Option<&'static [&'static str]>,
    /// What is kept of the header. Empty: every declaration of the header
    /// file. Otherwise only the functions, types and constants whose names
    /// match one of these patterns (bindgen's allowlist regexes, e.g.
    /// `cublasGemm.*`), plus what those use.
    pub only: Items,
    /// Patterns of items never generated here (bindgen's blocklist), e.g. the
    /// types of another header whose bindings are imported by [`prelude`](Spec::prelude).
    pub block: &'static [&'static str],
    /// Headers (file names) whose declarations are never generated here.
    pub block_headers: &'static [&'static str],
    /// Lines put at the top of the generated module (imports of the types
    /// blocked here), or `""`.
    pub prelude: &'static str,
    /// Whether the status type is declared in this header, so its `name()` is
    /// generated here; `false` when it comes from another header's bindings.
    pub status_names: bool,
}

/// The items of a header that [`Spec::only`] keeps (bindgen allowlist patterns).
pub struct Items {
    /// Functions.
    pub functions: &'static [&'static str],
    /// Types (structs, enums, typedefs).
    pub types: &'static [&'static str],
    /// Constants (`#define`d numbers, variables).
    pub vars: &'static [&'static str],
}

/// Every declaration of the header file: [`Spec::only`] for most headers.
pub const WHOLE_HEADER: Items = Items {
    functions: &[],
    types: &[],
    vars: &[],
};

/// `cuda.h`: the driver API.
pub const CUDA: Spec = Spec {
    header: "cuda.h",
    describes: "the pinned CUDA header",
    table: "DriverFns",
    owner: "crate::Driver",
    status: "cudaError_enum",
    library: "a CUDA driver library",
    missing: "crate::MissingSymbol { name: \"{name}\" }",
    error: "crate::MissingSymbol",
    loaded: "driver",
    stub_include: None,
    wrapper: "wrapper.h",
    include_var: None,
    file: "bindings.rs",
    types_only: None,
    only: WHOLE_HEADER,
    block: &[],
    block_headers: &[],
    prelude: "",
    status_names: true,
};

/// `nvrtc.h`: the run-time compiler.
pub const NVRTC: Spec = Spec {
    header: "nvrtc.h",
    describes: "the pinned NVRTC header",
    table: "NvrtcFns",
    owner: "crate::nvrtc::Nvrtc",
    status: "nvrtcResult",
    library: "an NVRTC library",
    missing: "self.missing(\"{name}\")",
    error: "crate::LibraryMissingSymbol",
    loaded: "library",
    stub_include: None,
    wrapper: "nvrtc_wrapper.h",
    include_var: Some("METRALE_NVRTC_INCLUDE_DIR"),
    file: "nvrtc_bindings.rs",
    types_only: None,
    only: WHOLE_HEADER,
    block: &[],
    block_headers: &[],
    prelude: "",
    status_names: true,
};

/// `nvJitLink.h`: the JIT linker.
pub const NVJITLINK: Spec = Spec {
    header: "nvJitLink.h",
    describes: "the pinned nvJitLink header",
    table: "NvJitLinkFns",
    owner: "crate::nvjitlink::NvJitLink",
    status: "nvJitLinkResult",
    library: "an nvJitLink library",
    missing: "self.missing(\"{name}\")",
    error: "crate::LibraryMissingSymbol",
    loaded: "library",
    stub_include: None,
    wrapper: "nvjitlink_wrapper.h",
    include_var: Some("METRALE_NVJITLINK_INCLUDE_DIR"),
    file: "nvjitlink_bindings.rs",
    types_only: None,
    only: WHOLE_HEADER,
    block: &[],
    block_headers: &[],
    prelude: "",
    status_names: true,
};

/// `nccl.h`: collective communication (feature `nccl`).
pub const NCCL: Spec = Spec {
    header: "nccl.h",
    describes: "the pinned NCCL header",
    table: "NcclFns",
    owner: "crate::nccl::Nccl",
    status: "ncclResult_t",
    library: "an NCCL library",
    missing: "self.missing(\"{name}\")",
    error: "crate::LibraryMissingSymbol",
    loaded: "library",
    stub_include: Some("nccl_stub"),
    wrapper: "nccl_wrapper.h",
    include_var: Some("METRALE_NCCL_INCLUDE_DIR"),
    file: "nccl_bindings.rs",
    types_only: None,
    only: WHOLE_HEADER,
    block: &[],
    block_headers: &[],
    prelude: "",
    status_names: true,
};

/// The NVTX v3 types the injection protocol and the calls use (feature `nvtx`).
const NVTX_TYPES: &[&str] = &[
    "NVTX_VERSION",
    "nvtxEventAttributes_v2",
    "nvtxEventAttributes_t",
    "nvtxColorType_t",
    "nvtxMessageType_t",
    "nvtxMessageValue_t",
    "nvtxPayloadType_t",
    "nvtxRangeId_t",
    "nvtxDomainHandle_t",
    "nvtxStringHandle_t",
    "NvtxCallbackModule",
    "NvtxCallbackIdCore",
    "NvtxCallbackIdCore2",
    "NvtxCallbackIdCuda",
    "NvtxCallbackIdCudaRt",
    "NvtxCallbackIdOpenCL",
    "NvtxCallbackIdSync",
    "NvtxExportTableID",
    "NvtxFunctionPointer",
    "NvtxFunctionTable",
    "NvtxExportTableCallbacks",
    "NvtxExportTableVersionInfo",
    "NvtxGetExportTableFunc_t",
    "NvtxInitializeInjectionNvtxFunc_t",
    "nvtx(MarkEx|MarkA|RangeStartEx|RangeStartA|RangeEnd|RangePushEx|RangePushA|RangePop)_impl_fntype",
    "nvtx(NameCategoryA|NameOsThreadA)_impl_fntype",
    "nvtxDomain(MarkEx|RangeStartEx|RangeEnd|RangePushEx|RangePop|NameCategoryA)_impl_fntype",
    "nvtxDomain(RegisterStringA|CreateA|Destroy)_impl_fntype",
    "nvtxNameCu(Device|Context|Stream|Event)A_fakeimpl_fntype",
];

/// NVTX v3 (`nvToolsExt.h` and `nvToolsExtCuda.h`): the types only (feature `nvtx`).
pub const NVTX: Spec = Spec {
    header: "nvtx3/nvToolsExt.h",
    describes: "the pinned NVTX v3 headers",
    table: "",
    owner: "",
    status: "",
    library: "",
    missing: "",
    error: "",
    loaded: "",
    stub_include: None,
    wrapper: "nvtx_wrapper.h",
    include_var: Some("METRALE_NVTX_INCLUDE_DIR"),
    file: "nvtx_bindings.rs",
    types_only: Some(NVTX_TYPES),
    only: WHOLE_HEADER,
    block: &[],
    block_headers: &[],
    prelude: "",
    status_names: true,
};

/// `cublas_api.h`: plain cuBLAS, the v2 API (feature `cublas`): the handle,
/// stream, workspace, math and pointer modes, status texts, and every GEMM.
pub const CUBLAS: Spec = Spec {
    header: "cublas_api.h",
    describes: "the pinned cuBLAS header",
    table: "CublasFns",
    owner: "crate::cublas::Cublas",
    status: "cublasStatus_t",
    library: "a cuBLAS library",
    missing: "self.missing(\"{name}\")",
    error: "crate::LibraryMissingSymbol",
    loaded: "library",
    stub_include: Some("cublas_stub"),
    wrapper: "cublas_wrapper.h",
    include_var: Some("METRALE_CUBLAS_INCLUDE_DIR"),
    file: "cublas_bindings.rs",
    types_only: None,
    only: Items {
        functions: &[
            "cublasCreate_v2",
            "cublasDestroy_v2",
            "cublasGetVersion_v2",
            "cublasGetProperty",
            "cublasGetCudartVersion",
            "cublasGetStatusName",
            "cublasGetStatusString",
            "cublasSetStream_v2",
            "cublasGetStream_v2",
            "cublasSetWorkspace_v2",
            "cublasSetMathMode",
            "cublasGetMathMode",
            "cublasSetPointerMode_v2",
            "cublasGetPointerMode_v2",
            "cublasSetAtomicsMode",
            "cublasGetAtomicsMode",
            "cublas[SDCZH]gemm.*",
            "cublasGemm.*",
            "cublasCgemm3m.*",
            "cublasZgemm3m.*",
        ],
        types: &["cublas.*_t", "cudaDataType.*", "libraryPropertyType.*"],
        vars: &["CUBLAS_VER.*", "CUBLAS_VERSION"],
    },
    block: &[],
    block_headers: &[],
    prelude: "",
    status_names: true,
};

/// `cublasLt.h`: cuBLASLt (feature `cublas`), the whole header but its logger's
/// `FILE*` entry point; the types it shares with `cublas_api.h` are those of
/// [`CUBLAS`]'s bindings.
pub const CUBLASLT: Spec = Spec {
    header: "cublasLt.h",
    describes: "the pinned cuBLASLt header",
    table: "CublasLtFns",
    owner: "crate::cublas::CublasLt",
    status: "cublasStatus_t",
    library: "a cuBLASLt library",
    missing: "self.missing(\"{name}\")",
    error: "crate::LibraryMissingSymbol",
    loaded: "library",
    stub_include: Some("cublas_stub"),
    wrapper: "cublaslt_wrapper.h",
    include_var: Some("METRALE_CUBLAS_INCLUDE_DIR"),
    file: "cublaslt_bindings.rs",
    types_only: None,
    only: WHOLE_HEADER,
    block: &[
        "cublasLtLoggerSetFile",
        "FILE",
        "_IO_.*",
        "__off_t",
        "__off64_t",
    ],
    block_headers: &[
        "cublas_api.h",
        "driver_types.h",
        "library_types.h",
        "cuComplex.h",
        "cuda_fp16.h",
        "cuda_bf16.h",
    ],
    prelude: "#[allow(unused_imports)] use crate::cublas::{cublasStatus_t, cublasComputeType_t, \
              cublasOperation_t, cudaDataType, cudaDataType_t, cudaStream_t, CUstream_st, \
              libraryPropertyType, libraryPropertyType_t};",
    status_names: false,
};

/// Every header the crate binds, with whether this build binds it (its feature).
pub const SPECS: [(bool, &Spec); 7] = [
    (true, &CUDA),
    (cfg!(feature = "nvrtc"), &NVRTC),
    (cfg!(feature = "nvrtc"), &NVJITLINK),
    (cfg!(feature = "nccl"), &NCCL),
    (cfg!(feature = "cublas"), &CUBLAS),
    (cfg!(feature = "cublas"), &CUBLASLT),
    (cfg!(feature = "nvtx"), &NVTX),
];

/// Run bindgen on `wrapper` (which includes `spec.header`) with `include_dir` on
/// the include path and return the complete text of the bindings module.
pub fn generate(spec: &Spec, wrapper: &Path, include_dir: &Path) -> Result<String, String> {
    let target = bindgen::RustTarget::stable(RUST_TARGET_MINOR, 0)
        .map_err(|e| format!("bindgen rust target 1.{RUST_TARGET_MINOR}: {e}"))?;
    let mut builder = bindgen::Builder::default()
        .header(wrapper.to_string_lossy())
        .clang_arg(format!("-I{}", include_dir.display()));
    if let Some(stub) = spec.stub_include {
        let crate_dir = wrapper.parent().unwrap_or(Path::new("."));
        builder = builder.clang_arg(format!("-I{}", crate_dir.join(stub).display()));
    }
    builder = match spec.types_only {
        // The named items and what they use.
        Some(items) => items.iter().fold(builder, |b, item| {
            b.allowlist_type(item).allowlist_var(item)
        }),
        None => allowlist(builder, spec),
    };
    let bindings = builder
        .rust_target(target)
        // Newtype enums: a status a newer driver returns is a value, never UB.
        .default_enum_style(bindgen::EnumVariation::NewType {
            is_bitfield: false,
            is_global: false,
        })
        .derive_default(true)
        .generate_comments(false)
        .layout_tests(true)
        .merge_extern_blocks(true)
        .size_t_is_usize(true)
        .formatter(bindgen::Formatter::None)
        .generate()
        .map_err(|e| format!("bindgen failed on {}: {e}", wrapper.display()))?;
    postprocess(spec, &bindings.to_string())
}

/// A header's allowlist and blocklists: every declaration of the header file
/// (libc typedefs it needs come along), or with [`Spec::only`] the items
/// matching its patterns and what they use; never [`Spec::block`]'s items or
/// [`Spec::block_headers`]' declarations.
fn allowlist(mut builder: bindgen::Builder, spec: &Spec) -> bindgen::Builder {
    let only = &spec.only;
    if only.functions.is_empty() && only.types.is_empty() && only.vars.is_empty() {
        builder = builder.allowlist_file(file_pattern(spec.header));
    } else {
        for f in only.functions {
            builder = builder.allowlist_function(f);
        }
        for t in only.types {
            builder = builder.allowlist_type(t);
        }
        for v in only.vars {
            builder = builder.allowlist_var(v);
        }
    }
    for item in spec.block {
        builder = builder.blocklist_item(item);
    }
    for header in spec.block_headers {
        builder = builder.blocklist_file(file_pattern(header));
    }
    builder
}

/// bindgen's pattern for the file `header` in any folder.
fn file_pattern(header: &str) -> String {
    format!(r".*[/\\]{}", header.replace('.', r"\."))
}

/// One function declaration from bindgen's extern block.
struct Decl<'a> {
    name: &'a str,
    /// `(args) -> ret`, exactly as bindgen wrote it (parameter names kept, which
    /// fn-pointer types allow).
    signature: &'a str,
}

fn postprocess(spec: &Spec, raw: &str) -> Result<String, String> {
    if spec.types_only.is_some() {
        let header_end = raw.find("*/").map_or(0, |i| i + 2);
        return Ok(format!(
            "// Generated by metrale-cuda-sys/build/gen.rs from {} \
             (scripts/regen-bindings.sh). Do not edit.\n{}\n",
            spec.describes,
            raw[header_end..].trim()
        ));
    }
    const OPEN: &str = "unsafe extern \"C\" {";
    let start = raw
        .find(OPEN)
        .ok_or("no extern block in bindgen output (did the header declare any function?)")?;
    let body_start = start + OPEN.len();
    let body_len = matching_close(&raw[body_start..], '{', '}')
        .ok_or("unbalanced braces in bindgen's extern block")?;
    let body = &raw[body_start..body_start + body_len];
    if raw[body_start + body_len + 1..].contains(OPEN) {
        return Err("more than one extern block: merge_extern_blocks is off?".into());
    }
    let decls = parse_decls(body)?;
    let statuses = if spec.status_names {
        parse_status_constants(raw, spec.status)?
    } else {
        Vec::new()
    };

    let mut out = String::with_capacity(raw.len() + decls.len() * 600);
    let _ = writeln!(
        out,
        "// Generated by metrale-cuda-sys/build/gen.rs from {} \
         (scripts/regen-bindings.sh). Do not edit.",
        spec.describes
    );
    if !spec.prelude.is_empty() {
        out.push_str(spec.prelude);
        out.push('\n');
    }
    let header_end = raw.find("*/").map_or(0, |i| i + 2);
    out.push_str(raw[header_end..start].trim());
    out.push('\n');
    out.push_str(raw[body_start + body_len + 1..].trim());
    out.push('\n');
    emit_table(&mut out, spec, &decls);
    if spec.status_names {
        emit_status_names(&mut out, spec.status, &statuses);
    }
    Ok(out)
}

/// Length of the text up to (not including) the bracket that closes the one
/// already open before `s` starts.
fn matching_close(s: &str, open: char, close: char) -> Option<usize> {
    let mut depth = 1usize;
    for (i, c) in s.char_indices() {
        if c == open {
            depth += 1;
        } else if c == close {
            depth -= 1;
            if depth == 0 {
                return Some(i);
            }
        }
    }
    None
}

fn parse_decls(body: &str) -> Result<Vec<Decl<'_>>, String> {
    let mut decls = Vec::new();
    let mut rest = body.trim();
    while !rest.is_empty() {
        let after = rest
            .strip_prefix("pub fn ")
            .ok_or_else(|| format!("unexpected item in extern block: {}", head(rest)))?;
        let name_end = after
            .find(" (")
            .ok_or_else(|| format!("no argument list: {}", head(after)))?;
        let name = &after[..name_end];
        let sig_start = name_end + 1;
        let args_len = matching_close(&after[sig_start + 1..], '(', ')')
            .ok_or_else(|| format!("unbalanced argument list for {name}"))?;
        let semi = after[sig_start + 1 + args_len..]
            .find(';')
            .ok_or_else(|| format!("no `;` after {name}"))?;
        let sig_end = sig_start + 1 + args_len + semi;
        let signature = after[sig_start..sig_end].trim();
        if signature.contains("...") {
            return Err(format!("{name} is variadic; the table cannot hold it"));
        }
        decls.push(Decl { name, signature });
        rest = after[sig_end + 1..].trim_start();
    }
    Ok(decls)
}

/// `(name, value)` for every associated constant of the status enum type `ty`.
fn parse_status_constants<'a>(raw: &'a str, ty: &str) -> Result<Vec<(&'a str, u64)>, String> {
    let open = format!("impl {ty} {{");
    let start = raw
        .find(&open)
        .ok_or_else(|| format!("no {ty} constants found"))?
        + open.len();
    let len =
        matching_close(&raw[start..], '{', '}').ok_or_else(|| format!("unbalanced {ty} impl"))?;
    let mut out: Vec<(&str, u64)> = Vec::new();
    for item in raw[start..start + len].split(';') {
        let item = item.trim();
        if item.is_empty() {
            continue;
        }
        let rest = item
            .strip_prefix("pub const ")
            .ok_or_else(|| format!("unexpected item in {ty} impl: {}", head(item)))?;
        let name = rest.split(' ').next().unwrap_or_default();
        let value = rest
            .rsplit_once('(')
            .and_then(|(_, v)| v.trim_end_matches(')').trim().parse::<u64>().ok())
            .ok_or_else(|| format!("cannot read the value of {name}"))?;
        if !out.iter().any(|&(_, v)| v == value) {
            out.push((name, value));
        }
    }
    Ok(out)
}

fn head(s: &str) -> &str {
    let end = s.char_indices().nth(80).map_or(s.len(), |(i, _)| i);
    &s[..end]
}

fn emit_table(out: &mut String, spec: &Spec, decls: &[Decl<'_>]) {
    let table = spec.table;
    let n = decls.len();
    out.push_str("\n/* Function table. */\n");
    for d in decls {
        let _ = writeln!(
            out,
            "#[doc = \"Signature of `{0}`.\"] pub type PFN_{0} = unsafe extern \"C\" fn {1};",
            d.name, d.signature
        );
    }
    let _ = writeln!(
        out,
        "/// Number of functions declared by the header the bindings were made from.\n\
         pub const FUNCTION_COUNT: usize = {n};"
    );
    out.push_str("/// Names of the functions in the table, in header order.\n");
    let _ = write!(out, "pub const FUNCTION_NAMES: [&str; {n}] = [");
    for d in decls {
        let _ = write!(out, "\"{}\",", d.name);
    }
    out.push_str("];\n");

    let _ = write!(
        out,
        "/// One entry per header function; `None` where the loaded library lacks it.\n\
         pub struct {table} {{"
    );
    for d in decls {
        let _ = write!(out, "{0}: Option<PFN_{0}>,", d.name);
    }
    out.push_str("}\n");

    let _ = write!(
        out,
        "impl crate::library::sealed::Sealed for {table} {{}}\n\
         impl crate::Table for {table} {{\n\
         const FUNCTION_NAMES: &'static [&'static str] = &FUNCTION_NAMES;\n\
         /// Resolve every entry in `lib`; a missing symbol leaves `None`.\n\
         ///\n/// # Safety\n\
         /// `lib` must be {} whose exported functions have the \
         signatures of the header these bindings were generated from.\n\
         unsafe fn resolve(lib: &::libloading::Library) -> Self {{\n\
         // SAFETY: the caller promises the symbols have the declared types; each \
         is read as `Option<PFN_x>`, so a null address is `None`, never a null fn \
         pointer, and a symbol absent or null is kept as `None` and never called.\n\
         unsafe {{ Self {{",
        spec.library
    );
    for d in decls {
        let _ = write!(
            out,
            "{0}: lib.get::<Option<PFN_{0}>>(b\"{0}\\0\").ok().and_then(|s| *s),",
            d.name
        );
    }
    out.push_str("} } }\n");
    out.push_str(
        "/// Whether each entry of [`FUNCTION_NAMES`] was found, in the same order.\n\
         fn presence(&self) -> Vec<bool> { vec![",
    );
    for d in decls {
        let _ = write!(out, "self.{}.is_some(),", d.name);
    }
    out.push_str("] } }\n");

    let _ = writeln!(out, "impl {} {{", spec.owner);
    let error = spec.error;
    let short = error.rsplit("::").next().unwrap_or(error);
    let loaded = spec.loaded;
    for d in decls {
        let missing = spec.missing.replace("{name}", d.name);
        let _ = write!(
            out,
            "/// `{0}`, or [`{short}`]({error}) when the loaded {loaded} lacks it.\n\
             #[inline] pub fn {0}(&self) -> Result<PFN_{0}, {error}> {{ \
             match self.fns.{0} {{ Some(f) => Ok(f), None => Err({missing}) }} }}\n",
            d.name
        );
    }
    out.push_str("}\n");
}

fn emit_status_names(out: &mut String, ty: &str, statuses: &[(&str, u64)]) {
    let example = statuses.get(1).map_or("", |&(name, _)| name);
    let _ = write!(
        out,
        "impl {ty} {{\n\
         /// The constant's name (`\"{example}\"`), or `None` for a \
         status this header does not define.\n\
         pub const fn name(self) -> Option<&'static str> {{ match self.0 {{"
    );
    for (name, value) in statuses {
        let _ = write!(out, "{value} => Some(\"{name}\"),");
    }
    out.push_str("_ => None, } } }\n");
}
