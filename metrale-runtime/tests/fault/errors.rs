//! Error texts and the data each error variant carries.

use crate::common::*;
use crate::harness::Test;

fn error_text_for_each_variant() {
    let reg = setup();
    let s = reg.stream();
    // DriverUnavailable: the loader's text, unchanged.
    let load = sys::LoadError {
        attempts: vec![sys::LoadAttempt {
            candidate: "libcuda.so.1".into(),
            message: "not found".into(),
        }],
    };
    assert_eq!(
        MetraleError::from(load.clone()).to_string(),
        load.to_string()
    );

    // Driver: a failed call names the call, status, description and subject.
    fake().fail("cuStreamSynchronize", 700, 1, Some(1));
    let e = s.synchronize().unwrap_err();
    let text = format!(
        "device 0 stream {:p} synchronize: cuStreamSynchronize failed: \
         CUDA_ERROR_ILLEGAL_ADDRESS (700): an illegal memory access was encountered",
        s.raw()
    );
    assert_eq!(e.to_string(), text);
    assert_eq!(format!("{e:?}"), text, "Debug prints the message");
    assert_eq!(e.status(), Some(CUresult(700)));
    assert!(matches!(
        e.kind(),
        ErrorKind::Driver {
            call: "cuStreamSynchronize",
            ..
        }
    ));

    // ModuleLoad: JIT log included, data kept apart.
    let bad = b".version 9.0\n.target sm_90\nsyntax error here\n";
    let e = MetraleRegistry::load(0, &[("broken", bad)]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "broken: cuModuleLoadDataEx failed: CUDA_ERROR_INVALID_PTX (218): a PTX JIT compilation failed \
         [PTX of 45 bytes]\nJIT error log:\nptxas application ptx input, line 3; error   : syntax error\n\
         ptxas fatal   : Ptx assembly aborted due to errors"
    );
    match e.kind() {
        ErrorKind::ModuleLoad {
            module,
            call,
            status,
            jit_log,
            ..
        } => {
            assert_eq!((module.as_str(), *call), ("broken", "cuModuleLoadDataEx"));
            assert_eq!(*status, CUresult::CUDA_ERROR_INVALID_PTX);
            assert!(jit_log.as_deref().unwrap().starts_with("ptxas application"));
        }
        other => panic!("{other}"),
    }

    // InvalidBlob.
    let e = MetraleRegistry::load(0, &[("empty", b"")]).unwrap_err();
    assert!(matches!(
        e.kind(),
        ErrorKind::InvalidBlob { module, .. } if module == "empty"));
    assert_eq!(e.to_string(), "empty: empty kernel blob");

    // NotFound: module (naming what was looked for), kernel, symbol.
    let e = reg.function("nope", "vec_add").unwrap_err();
    assert_eq!(
        e.to_string(),
        "Module 'nope' not loaded (looking up 'nope::vec_add')"
    );
    assert!(matches!(
        e.kind(),
        ErrorKind::NotFound { kind: NameKind::Module, name: Some(n), .. } if n == "vec_add"
    ));
    let e = reg.function("kernels", "missing_kernel").unwrap_err();
    assert_eq!(
        e.to_string(),
        "kernels::missing_kernel: cuModuleGetFunction failed: CUDA_ERROR_NOT_FOUND (500): named symbol not found"
    );
    assert!(matches!(
        e.kind(),
        ErrorKind::NotFound {
            kind: NameKind::Kernel,
            ..
        }
    ));
    let e = reg.device_symbol("kernels", "no_such_symbol").unwrap_err();
    assert_eq!(
        e.to_string(),
        "kernels::no_such_symbol: cuModuleGetGlobal_v2 failed: CUDA_ERROR_NOT_FOUND (500): named symbol not found"
    );
    assert!(matches!(
        e.kind(),
        ErrorKind::NotFound {
            kind: NameKind::Symbol,
            ..
        }
    ));

    // InvalidName.
    let e = reg.device_symbol("kernels", "bad\0name").unwrap_err();
    assert_eq!(
        e.to_string(),
        "kernels::bad\\0name: name has an interior NUL byte at offset 3"
    );

    // KernelLaunch: the driver's refusal, with the kernel and the shape.
    let f = reg.function("kernels", "vec_add").unwrap();
    fake().fail("cuLaunchKernel", 701, 1, Some(1));
    let cfg = LaunchConfig::new((4, 1, 1), (256, 1, 1), 0).unwrap();
    // SAFETY: the stand-in refuses before reading parameters.
    let e = unsafe { s.launch_raw(&f, cfg, &mut []) }.unwrap_err();
    assert_eq!(
        e.to_string(),
        "kernel 'kernels::vec_add': cuLaunchKernel failed: CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES (701): \
         too many resources requested for launch (grid=[4,1,1], block=[256,1,1], shared_mem=0)"
    );
    match e.kind() {
        ErrorKind::KernelLaunch {
            kernel,
            shape,
            failure: LaunchFailure::Driver { call, status },
        } => {
            assert_eq!(kernel, "kernels::vec_add");
            assert_eq!((shape.grid, shape.block), ([4, 1, 1], [256, 1, 1]));
            assert_eq!((*call, status.0), ("cuLaunchKernel", 701));
        }
        other => panic!("{other}"),
    }

    // KernelLaunch: refused before the driver.
    let before = fake().calls("cuLaunchKernel");
    // A shape no device runs cannot be built (`LaunchConfig` is closed); the
    // device's own limits are the launch's check.
    let too_big = cfg.with_shared_mem(1 << 20);
    // SAFETY: refused before any driver call.
    let e = unsafe { s.launch_raw(&f, too_big, &mut []) }.unwrap_err();
    assert_eq!(
        e.to_string(),
        "kernel 'kernels::vec_add': launch not attempted, dynamic shared memory above the \
         device's opt-in limit of 232448 bytes: (grid=[4,1,1], block=[256,1,1], shared_mem=1048576)"
    );
    assert_eq!(fake().calls("cuLaunchKernel"), before);

    // InvalidArgument: an ordinal the driver does not have.
    let e = host(5).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid argument: device ordinal 5 is out of range: the driver reports 2 CUDA device(s)"
    );

    // SymbolSize.
    let e = reg.symbol::<u32>("kernels", COUNTERS).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!("kernels::{COUNTERS}: the symbol is 64 bytes, 1 x u32 is 4")
    );

    // After all of that, the registry still works.
    launch_vec_add(&reg);
    drop(f);
    done(reg);
}

fn status_text_known_unknown_and_unnamed() {
    fake().reset();
    assert_eq!(
        cuda_error_text(CUresult(1)),
        "CUDA_ERROR_INVALID_VALUE (1): invalid argument"
    );
    assert_eq!(
        cuda_error_text(CUresult(9999)),
        "CUDA_UNKNOWN (9999): (no message)"
    );
    fake().set_error_strings(false);
    // The driver has no name: the header's constant names it; no description.
    assert_eq!(
        cuda_error_text(CUresult(218)),
        "CUDA_ERROR_INVALID_PTX (218): (no message)"
    );
    fake().set_error_strings(true);
    assert!(is_teardown_noop(CUresult(4)));
    assert!(is_teardown_noop(CUresult(201)));
    assert!(is_teardown_noop(CUresult(709)));
    assert!(!is_teardown_noop(CUresult(1)));
    assert!(!is_teardown_noop(CUresult(0)));
}

fn unknown_status_from_a_call_is_a_value() {
    let reg = setup();
    fake().fail("cuStreamSynchronize", 9999, 1, Some(1));
    let e = reg.stream_synchronize(reg.stream()).unwrap_err();
    assert_eq!(e.status(), Some(CUresult(9999)));
    assert!(
        e.to_string().ends_with(
            "synchronize: cuStreamSynchronize failed: CUDA_UNKNOWN (9999): (no message)"
        ),
        "{e}"
    );
    reg.stream_synchronize(reg.stream()).unwrap();
    done(reg);
}

fn call_errors_have_display() {
    let e = CallError::Status {
        call: "cuInit",
        status: CUresult(2),
    };
    assert_eq!(
        e.to_string(),
        "cuInit failed: CUDA_ERROR_OUT_OF_MEMORY (2): out of memory"
    );
    let _: &dyn std::error::Error = &e;
}

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "errors::text_for_each_variant",
            run: error_text_for_each_variant,
        },
        Test {
            name: "errors::status_text_known_unknown_and_unnamed",
            run: status_text_known_unknown_and_unnamed,
        },
        Test {
            name: "errors::unknown_status_from_a_call_is_a_value",
            run: unknown_status_from_a_call_is_a_value,
        },
        Test {
            name: "errors::call_errors_have_display",
            run: call_errors_have_display,
        },
    ]
}
