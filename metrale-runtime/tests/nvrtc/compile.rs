//! Compiling and linking real programs.

use metrale_runtime::nvrtc::{Linker, NvrtcError, Program, Target};
use metrale_runtime::BlobKind;

use crate::elf;
use crate::harness::Test;

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "compile::ptx_and_cubin_for_sm80_and_sm90",
            run: ptx_and_cubin_for_sm80_and_sm90,
        },
        Test {
            name: "compile::virtual_target_gives_ptx_only",
            run: virtual_target_gives_ptx_only,
        },
        Test {
            name: "compile::template_kernels_and_lowered_names",
            run: template_kernels_and_lowered_names,
        },
        Test {
            name: "compile::headers_by_name",
            run: headers_by_name,
        },
        Test {
            name: "compile::typed_options_reach_nvrtc",
            run: typed_options_reach_nvrtc,
        },
        Test {
            name: "compile::syntax_error_carries_log_and_line",
            run: syntax_error_carries_log_and_line,
        },
        Test {
            name: "compile::warnings_are_kept_on_success",
            run: warnings_are_kept_on_success,
        },
        Test {
            name: "compile::lto_ir_links_into_a_cubin",
            run: lto_ir_links_into_a_cubin,
        },
        Test {
            name: "compile::link_failures_carry_the_log",
            run: link_failures_carry_the_log,
        },
        Test {
            name: "compile::inputs_with_nul_are_refused",
            run: inputs_with_nul_are_refused,
        },
        Test {
            name: "compile::supported_archs_and_version",
            run: supported_archs_and_version,
        },
    ]
}

pub const SAXPY: &str = r#"
extern "C" __global__ void saxpy(float a, const float* x, float* y, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
extern "C" __global__ void mixed(double d, char c, const int* p, unsigned long long u) {
    if (p == nullptr) return;
}
"#;

fn nvrtc_error(e: &metrale_runtime::MetraleError) -> &NvrtcError {
    e.as_nvrtc()
        .unwrap_or_else(|| panic!("not an NVRTC error: {e}"))
}

fn ptx_and_cubin_for_sm80_and_sm90() {
    for arch in [80, 90] {
        let out = Program::new("saxpy.cu", SAXPY)
            .emit_ptx()
            .compile(Target::Sm(arch))
            .unwrap();
        let cubin = out.cubin().expect("a cubin for a real architecture");
        assert_eq!(BlobKind::of(cubin), BlobKind::Cubin);
        assert_eq!(out.cubin_arch(), Some(arch), "{out:?}");
        let ptx = std::str::from_utf8(out.ptx().expect("PTX was asked for")).unwrap();
        assert_eq!(BlobKind::of(ptx.as_bytes()), BlobKind::Ptx);
        assert!(ptx.contains(&format!(".target sm_{arch}")), "{ptx}");
        assert!(ptx.contains(".entry saxpy"), "{ptx}");
        assert!(out.lto_ir().is_none());
        assert_eq!(out.log(), "");
        assert_eq!(out.target(), Target::Sm(arch));
        assert_eq!(elf::kernels(cubin), ["mixed", "saxpy"]);
        assert_eq!(elf::param_sizes(cubin, "saxpy"), [4, 8, 8, 4]);
        assert_eq!(elf::param_sizes(cubin, "mixed"), [8, 1, 8, 8]);
        // The registry takes it as a named blob: name and cubin.
        use metrale_runtime::NamedBlob;
        assert_eq!(out.name(), "saxpy.cu");
        assert_eq!(NamedBlob::bytes(&out), cubin);
    }
    // Without emit_ptx a real target gives the cubin alone.
    let out = Program::new("saxpy.cu", SAXPY)
        .compile(Target::Sm(90))
        .unwrap();
    assert!(out.ptx().is_none() && out.cubin().is_some());
}

fn virtual_target_gives_ptx_only() {
    let out = Program::new("saxpy.cu", SAXPY)
        .compile(Target::Compute(80))
        .unwrap();
    assert!(out.cubin().is_none());
    let ptx = out.ptx().unwrap();
    assert!(String::from_utf8_lossy(ptx).contains(".target sm_80"));
    assert_eq!(metrale_runtime::NamedBlob::bytes(&out), ptx);
}

const TEMPLATE: &str = r#"
template <typename T>
__global__ void scale(T* x, T a, unsigned n) {
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] * a;
}
template <int N> __device__ int table[N];
"#;

fn template_kernels_and_lowered_names() {
    let out = Program::new("scale.cu", TEMPLATE)
        .name_expression("scale<float>")
        .name_expression("scale<double>")
        .name_expression("&table<4>")
        .compile(Target::Sm(90))
        .unwrap();
    let f = out.lowered_name("scale<float>").unwrap();
    let d = out.lowered_name("scale<double>").unwrap();
    assert_eq!(f, "_Z5scaleIfEvPT_S0_j");
    assert_eq!(d, "_Z5scaleIdEvPT_S0_j");
    assert_eq!(out.lowered_name("&table<4>"), Some("_Z5tableILi4EE"));
    assert_eq!(out.lowered_name("scale<int>"), None);
    let names: Vec<(&str, &str)> = out.lowered_names().collect();
    assert_eq!(names.len(), 3);
    let cubin = out.cubin().unwrap();
    let mut expected = vec![d.to_owned(), f.to_owned()];
    expected.sort();
    assert_eq!(elf::kernels(cubin), expected);
    assert_eq!(elf::param_sizes(cubin, f), [8, 4, 4]);
    assert_eq!(elf::param_sizes(cubin, d), [8, 8, 4]);
    // A name expression that names nothing fails the compile, with a log.
    let e = Program::new("scale.cu", TEMPLATE)
        .name_expression("no_such_kernel<float>")
        .compile(Target::Sm(90))
        .unwrap_err();
    assert!(matches!(nvrtc_error(&e), NvrtcError::Compile { .. }), "{e}");
}

fn headers_by_name() {
    let out = Program::new(
        "main.cu",
        "#include \"consts.h\"\n#include <sub/twice.h>\n\
         extern \"C\" __global__ void k(int* x) { x[0] = twice(ANSWER); }\n",
    )
    .header("consts.h", "#define ANSWER 21\n")
    .header(
        "sub/twice.h",
        "__device__ int twice(int v) { return 2 * v; }\n",
    )
    .compile(Target::Sm(90))
    .unwrap();
    assert_eq!(elf::kernels(out.cubin().unwrap()), ["k"]);
    // Without the header: a compile error naming it.
    let e = Program::new("main.cu", "#include \"consts.h\"\n")
        .compile(Target::Sm(90))
        .unwrap_err();
    assert!(e.to_string().contains("consts.h"), "{e}");
}

fn typed_options_reach_nvrtc() {
    let dir = std::env::temp_dir().join(format!("metrale-nvrtc-inc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("from_disk.h"), "#define FROM_DISK 7\n").unwrap();
    let src = "#include \"from_disk.h\"\n\
        #if FROM_DISK != 7 || LEVEL != 3 || !defined(FLAG)\n#error options lost\n#endif\n\
        #if __cplusplus < 201703L\n#error not c++17\n#endif\n\
        int helper(int v) { return v + 1; }\n\
        extern \"C\" __global__ void k(float* x) { x[0] = __expf(x[0]) + helper(1); }\n";
    let out = Program::new("opts.cu", src)
        .include_path(dir.to_str().unwrap())
        .define("LEVEL", Some("3"))
        .define("FLAG", None)
        .std("c++17")
        .default_device()
        .fast_math()
        .line_info()
        .max_registers(32)
        .emit_ptx()
        .compile(Target::Sm(90))
        .unwrap();
    assert_eq!(elf::kernels(out.cubin().unwrap()), ["k"]);
    let ptx = String::from_utf8_lossy(out.ptx().unwrap()).into_owned();
    assert!(
        ptx.contains(".loc"),
        "line info should put .loc lines in the PTX"
    );
    let debug = Program::new("dbg.cu", SAXPY)
        .device_debug()
        .compile(Target::Sm(90))
        .unwrap();
    assert!(elf::sections(debug.cubin().unwrap())
        .iter()
        .any(|s| s.name.starts_with(".debug")));
    let p = Program::new("opts.cu", "")
        .define("A", Some("1"))
        .raw_option("-Xptxas=-v");
    assert_eq!(
        p.rendered_options(Target::Compute(80)),
        [
            "--gpu-architecture=compute_80",
            "--define-macro=A=1",
            "-Xptxas=-v"
        ]
    );
    // A raw option NVRTC does not know: its status, named.
    let e = Program::new("opts.cu", SAXPY)
        .raw_option("--no-such-option")
        .compile(Target::Sm(90))
        .unwrap_err();
    let text = e.to_string();
    assert!(text.contains("NVRTC_ERROR_INVALID_OPTION (5)"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

fn syntax_error_carries_log_and_line() {
    let src = "extern \"C\" __global__ void k(int* x) {\n    int y = 1\n    x[0] = y;\n}\n";
    let e = Program::new("broken.cu", src)
        .compile(Target::Sm(90))
        .unwrap_err();
    let NvrtcError::Compile {
        program,
        target,
        status,
        log,
    } = nvrtc_error(&e)
    else {
        panic!("expected a compile error: {e}");
    };
    assert_eq!(program, "broken.cu");
    assert_eq!(*target, Target::Sm(90));
    assert_eq!(status.0, 6);
    assert!(log.contains("broken.cu(3): error"), "{log}");
    let text = e.to_string();
    assert!(
        text.starts_with(
            "program 'broken.cu': nvrtcCompileProgram failed: NVRTC_ERROR_COMPILATION (6) [sm_90]\nprogram log:\n"
        ),
        "{text}"
    );
    assert!(text.contains("broken.cu(3): error"), "{text}");
    assert_eq!(nvrtc_error(&e).log(), Some(log.as_str()));
}

fn warnings_are_kept_on_success() {
    let src = "extern \"C\" __global__ void k(int* x) { int unused; x[0] = 1; }\n";
    let out = Program::new("warn.cu", src)
        .compile(Target::Sm(90))
        .unwrap();
    assert!(out.log().contains("warn.cu(1): warning"), "{:?}", out.log());
    assert!(out.log().contains("unused"), "{:?}", out.log());
}

pub const LTO_A: &str = "extern __device__ float twice(float v);\n\
    extern \"C\" __global__ void twice_all(float* x, unsigned n) {\n\
        unsigned i = blockIdx.x * blockDim.x + threadIdx.x;\n\
        if (i < n) x[i] = twice(x[i]);\n\
    }\n";
pub const LTO_B: &str = "__device__ float twice(float v) { return 2.0f * v; }\n";

fn lto_ir_links_into_a_cubin() {
    for arch in [80, 90] {
        let a = Program::new("a.cu", LTO_A)
            .raw_option("--relocatable-device-code=true")
            .lto()
            .compile(Target::Sm(arch))
            .unwrap();
        let b = Program::new("b.cu", LTO_B)
            .raw_option("--relocatable-device-code=true")
            .lto()
            .compile(Target::Sm(arch))
            .unwrap();
        let ir = a.lto_ir().expect("LTO-IR with -dlto");
        assert!(!ir.is_empty());
        assert!(a.cubin().is_none() && a.ptx().is_none());
        assert!(metrale_runtime::NamedBlob::bytes(&a).is_empty());
        let linked = Linker::new(Target::Sm(arch))
            .add_compiled(&a)
            .unwrap()
            .add_compiled(&b)
            .unwrap()
            .link()
            .unwrap();
        let cubin = linked.cubin();
        assert_eq!(BlobKind::of(cubin), BlobKind::Cubin);
        assert_eq!(elf::kernels(cubin), ["twice_all"]);
        assert_eq!(elf::param_sizes(cubin, "twice_all"), [8, 4]);
    }
}

fn link_failures_carry_the_log() {
    // `twice` is declared and never defined: the link fails with a log naming it.
    let a = Program::new("a.cu", LTO_A)
        .raw_option("--relocatable-device-code=true")
        .lto()
        .compile(Target::Sm(90))
        .unwrap();
    let e = Linker::new(Target::Sm(90))
        .add_compiled(&a)
        .unwrap()
        .link()
        .unwrap_err();
    let NvrtcError::Link { call, log, .. } = nvrtc_error(&e) else {
        panic!("expected a link error: {e}");
    };
    assert_eq!(*call, "__nvJitLinkComplete_13_0");
    assert!(log.contains("twice"), "{log}");
    let text = e.to_string();
    assert!(
        text.starts_with(
            "link of [a.cu] for sm_90: __nvJitLinkComplete_13_0 failed: NVJITLINK_ERROR_"
        ),
        "{text}"
    );
    // Nothing to link is refused before the library.
    let e = Linker::new(Target::Sm(90)).link().unwrap_err();
    assert!(e.to_string().ends_with("nothing to link"), "{e}");
    // Plain PTX and cubin objects link too.
    let ptx = Program::new("p.cu", SAXPY)
        .compile(Target::Compute(90))
        .unwrap();
    let cubin = Program::new("c.cu", TEMPLATE)
        .name_expression("scale<float>")
        .raw_option("--relocatable-device-code=true")
        .compile(Target::Sm(90))
        .unwrap();
    let linked = Linker::new(Target::Sm(90))
        .add_compiled(&ptx)
        .unwrap()
        .add_compiled(&cubin)
        .unwrap()
        .link()
        .unwrap();
    let kernels = elf::kernels(linked.cubin());
    assert!(kernels.contains(&"saxpy".to_owned()), "{kernels:?}");
    assert!(
        kernels.contains(&"_Z5scaleIfEvPT_S0_j".to_owned()),
        "{kernels:?}"
    );
}

fn inputs_with_nul_are_refused() {
    let e = Program::new("nul.cu", "int a;\0int b;")
        .compile(Target::Sm(90))
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "program 'nul.cu': the source has a NUL byte at offset 6"
    );
    let e = Program::new("nul.cu", SAXPY)
        .header("h\0.h", "")
        .compile(Target::Sm(90))
        .unwrap_err();
    assert!(
        e.to_string().contains("a header's name has a NUL byte"),
        "{e}"
    );
}

fn supported_archs_and_version() {
    let archs = metrale_runtime::nvrtc::supported_archs().unwrap();
    assert!(archs.contains(&80) && archs.contains(&90), "{archs:?}");
    let v = metrale_runtime::nvrtc::nvrtc_version().unwrap();
    assert!(v >= metrale_runtime::Version::new(12, 0, 0), "{v}");
    assert_eq!(Target::Sm(90).to_string(), "sm_90");
    assert_eq!(Target::Compute(80).to_string(), "compute_80");
    assert_eq!(Target::Compute(80).arch(), 80);
}
