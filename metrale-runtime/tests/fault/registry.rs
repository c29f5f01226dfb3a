//! The registry: bad input, partial loads, memoized lookups and handle provenance,
//! large registries, run-time blobs.

use std::sync::{Arc, OnceLock};
use std::time::Instant;

use crate::common::*;
use crate::harness::Test;

fn bad_inputs_are_named_and_harmless() {
    let reg = setup();
    let garbage: &[u8] = &[0x13, 0x37, 0xff, 0x00, 0x42, 0x99];
    let e = MetraleRegistry::load(0, &[("garbage", garbage)]).unwrap_err();
    assert!(
        e.to_string().starts_with("garbage: PTX is not valid UTF-8"),
        "{e}"
    );
    let truncated = &CUBIN[..CUBIN.len() / 2];
    let e = MetraleRegistry::load(0, &[("half", truncated)]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "half: malformed cubin: section headers lie past the end of the blob (truncated?)"
    );
    let e = MetraleRegistry::load(0, &[("a", PTX), ("a", PTX)]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid argument: module 'a' is listed twice"
    );
    let e = reg.function("kernels", "vec\0add").unwrap_err();
    assert_eq!(
        e.to_string(),
        "kernels::vec\\0add: name has an interior NUL byte at offset 3"
    );
    assert_eq!(
        fake().live(Live::Modules),
        1,
        "only the registry's own module is loaded"
    );
    launch_vec_add(&reg);
    done(reg);
}

fn failure_mid_list_unloads_the_loaded_modules() {
    let reg = setup();
    let before = fake().live(Live::Modules);
    let bad = b".version 9.0\nsyntax error\n";
    let e = MetraleRegistry::load(
        0,
        &[("one", PTX), ("two", PTX), ("three", bad), ("four", PTX)],
    )
    .unwrap_err();
    assert!(
        matches!(
        e.kind(),
        ErrorKind::ModuleLoad { module, .. } if module == "three"),
        "{e}"
    );
    assert_eq!(fake().live(Live::Modules), before);
    // The same through an injected driver failure on the second module.
    fake().fail("cuModuleLoadDataEx", 2, 2, Some(1));
    let e = MetraleRegistry::load(0, &[("one", PTX), ("two", PTX)]).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("two: cuModuleLoadDataEx failed: CUDA_ERROR_OUT_OF_MEMORY (2)"),
        "{e}"
    );
    assert_eq!(fake().live(Live::Modules), before);
    done(reg);
}

fn registries_share_one_host_and_lookups_memoize() {
    let reg = setup();
    let other = MetraleRegistry::load(0, &[("kernels", PTX)]).unwrap();
    assert!(Arc::ptr_eq(reg.host(), other.host()));
    assert_eq!(fake().primary_refs(), 1, "one retain for the shared host");
    assert_eq!(reg.module_names().collect::<Vec<_>>(), ["kernels"]);
    assert!(reg.has_module("kernels") && !reg.has_module("other"));

    let cache = OnceLock::new();
    let calls = fake().calls("cuModuleGetFunction");
    let f1 = reg
        .raw_function_cached(&cache, "kernels", "vec_add")
        .unwrap();
    let f2 = reg
        .raw_function_cached(&cache, "kernels", "vec_add")
        .unwrap();
    assert_eq!(f1, f2);
    let plain1 = reg.function("kernels", "vec_add").unwrap();
    let plain2 = reg.function("kernels", "vec_add").unwrap();
    assert_eq!(plain1.raw(), f1);
    assert_eq!(plain2.as_raw(), f1.as_raw());
    assert_eq!(
        fake().calls("cuModuleGetFunction"),
        calls + 1,
        "the driver is asked once per registry and kernel"
    );
    let typed = OnceLock::new();
    let t1 = reg.function_cached(&typed, "kernels", "empty").unwrap();
    let t2 = reg.function_cached(&typed, "kernels", "empty").unwrap();
    assert_eq!(t1.raw(), t2.raw());
    assert_eq!(t1.name(), "kernels::empty");
    assert_eq!(fake().calls("cuModuleGetFunction"), calls + 2);
    drop((plain1, plain2, t1, t2, typed));
    // An error is not cached.
    let failing = OnceLock::new();
    assert!(reg
        .raw_function_cached(&failing, "kernels", "nope")
        .is_err());
    assert!(failing.get().is_none());

    // Each registry has its own modules.
    assert_eq!(fake().live(Live::Modules), 2);
    drop(other);
    assert_eq!(fake().live(Live::Modules), 1);
    done(reg);
}

/// The seed's `static` cache filled by registry A, then used with registry B:
/// before, B's safe lookup returned A's (unloaded) handle.
fn a_cached_handle_never_crosses_registries() {
    static RAW: OnceLock<RawCudaFunc> = OnceLock::new();
    // Outlives registry A like a static would (a static CudaFunction would keep A's
    // module loaded for the rest of this process).
    let func_cache: OnceLock<CudaFunction> = OnceLock::new();
    let a = setup();
    let fa = a.raw_function_cached(&RAW, "kernels", "vec_add").unwrap();
    let ta = a
        .function_cached(&func_cache, "kernels", "vec_add")
        .unwrap();
    drop(ta);
    drop(a);
    let b = MetraleRegistry::load(0, &[("kernels", PTX)]).unwrap();
    let fb = b.raw_function_cached(&RAW, "kernels", "vec_add").unwrap();
    assert_ne!(fb, fa, "B must not hand out A's stale handle");
    let tb = b
        .function_cached(&func_cache, "kernels", "vec_add")
        .unwrap();
    assert_eq!(tb.raw(), fb, "B's own kernel, not A's");
    // Launching B's handle works; A's stale handle is refused, naming it.
    launch_vec_add(&b);
    let buf = DeviceBuffer::<f32>::alloc(b.stream(), 4).unwrap();
    let cfg = LaunchConfig::new((1, 1, 1), (4, 1, 1), 0).unwrap();
    let launches = fake().launches();
    // SAFETY: refused before the driver.
    let e = unsafe { b.launch(fa, cfg, b.stream(), (&buf, &buf, &buf, 4u32)) }.unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::ForeignHandle { .. }), "{e}");
    assert!(
        e.to_string()
            .contains("the handle comes from another registry"),
        "{e}"
    );
    assert_eq!(fake().launches(), launches);
    // A live foreign registry's handle is named by its kernel.
    let c = MetraleRegistry::load(0, &[("other", PTX)]).unwrap();
    let fc = c.function("other", "empty").unwrap().raw();
    // SAFETY: refused before the driver.
    let e = unsafe { b.launch_on_stream(fc, cfg, b.stream(), &mut []) }.unwrap_err();
    assert_eq!(
        e.to_string(),
        "kernel 'other::empty': the handle comes from another registry (or one that was dropped); \
         look the kernel up through this registry"
    );
    drop((buf, tb, c, func_cache));
    done(b);
}

fn a_function_keeps_its_module_loaded_after_the_registry_goes() {
    let reg = setup();
    let f = reg.function("kernels", "vec_add").unwrap();
    drop(reg);
    assert_eq!(
        fake().live(Live::Modules),
        1,
        "the function still holds its module"
    );
    assert_eq!(f.attributes().unwrap().ptx_version, 90);
    drop(f);
    release(0);
    assert_eq!(fake().live(Live::Modules), 0);
    assert_eq!(fake().primary_refs(), 0);
}

/// Modules read from "disk" at run time: owned names and bytes, nothing leaked.
fn registries_load_owned_names_and_blobs() {
    fake().reset();
    let blobs: Vec<(String, Vec<u8>)> = (0..3)
        .map(|i| (format!("module_{i}"), PTX.to_vec()))
        .collect();
    let reg = MetraleRegistry::load_into(host(0).unwrap(), &blobs).unwrap();
    assert_eq!(
        reg.module_names().collect::<Vec<_>>(),
        ["module_0", "module_1", "module_2"]
    );
    reg.function("module_2", "vec_add").unwrap();
    let borrowed: Vec<(&str, &[u8])> = vec![("x", PTX)];
    let reg2 = MetraleRegistry::load_into(host(0).unwrap(), &borrowed).unwrap();
    assert!(reg2.has_module("x"));
    drop(reg2);
    done(Arc::new(reg));
}

/// A registry of thousands of modules loads and looks up at the per-module cost
/// (the duplicate check and the module lookup are hashed, not scanned).
fn large_registries_load_and_look_up_per_module() {
    fake().reset();
    let tiny = b".version 8.0\n.visible .entry k(\n.param .u64 k_param_0\n)\n{ ret; }\n";
    let time = |n: usize| {
        let blobs: Vec<(String, &[u8])> = (0..n).map(|i| (format!("m{i}"), &tiny[..])).collect();
        let t = Instant::now();
        let reg = MetraleRegistry::load_into(host(0).unwrap(), &blobs).unwrap();
        for i in (0..n).step_by(7) {
            reg.function(&format!("m{i}"), "k").unwrap();
        }
        let per_module = t.elapsed().as_secs_f64() / n as f64;
        // The duplicate of the last name is found without scanning the list.
        let mut dup = blobs.clone();
        dup.push((format!("m{}", n - 1), &tiny[..]));
        let e = MetraleRegistry::load_into(host(0).unwrap(), &dup).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("invalid argument: module 'm{}' is listed twice", n - 1)
        );
        drop(reg);
        per_module
    };
    let small = time(250);
    let large = time(10_000);
    eprintln!(
        "    per module: {:.2} us at 250 modules, {:.2} us at 10000",
        small * 1e6,
        large * 1e6
    );
    // Linear scans would make the large one ~20x slower per module; allow noise.
    assert!(
        large < small * 4.0,
        "per-module cost grew from {small:e} s to {large:e} s"
    );
    release(0);
    assert_eq!(fake().live(Live::Modules), 0);
}

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "registry::bad_inputs_are_named_and_harmless",
            run: bad_inputs_are_named_and_harmless,
        },
        Test {
            name: "registry::failure_mid_list_unloads_the_loaded_modules",
            run: failure_mid_list_unloads_the_loaded_modules,
        },
        Test {
            name: "registry::registries_share_one_host_and_lookups_memoize",
            run: registries_share_one_host_and_lookups_memoize,
        },
        Test {
            name: "registry::a_cached_handle_never_crosses_registries",
            run: a_cached_handle_never_crosses_registries,
        },
        Test {
            name: "registry::a_function_keeps_its_module_loaded_after_the_registry_goes",
            run: a_function_keeps_its_module_loaded_after_the_registry_goes,
        },
        Test {
            name: "registry::registries_load_owned_names_and_blobs",
            run: registries_load_owned_names_and_blobs,
        },
        Test {
            name: "registry::large_registries_load_and_look_up_per_module",
            run: large_registries_load_and_look_up_per_module,
        },
    ]
}
