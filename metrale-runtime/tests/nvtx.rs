//! The `nvtx` room against the stand-in NVTX tool (`metrale-fakecuda/src/fakenvtx.c`,
//! which records every call it receives), on CPU.
//!
//! A tool is attached once per process, so each group runs in a child process
//! of this test binary: `attached::` with the stand-in named by
//! `NVTX_INJECTION64_PATH` (and the stand-in driver for the CUDA handles),
//! `no_tool::` with the variable unset, `init_fails::` with the stand-in built
//! so that its init returns 0, `hostile::` with the stand-in built hostile. The parent tests run the groups and check that
//! every test of each passed.
#![cfg(feature = "nvtx")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::process::Command;

use metrale_fakecuda::{FakeNvtx, NvtxKind, NvtxRecord};
use metrale_runtime::nvtx::{self, Color, Domain, EventAttributes, Injection};

const GROUP: &str = "METRALE_NVTX_TEST_GROUP";
const TOOL_VAR: &str = "NVTX_INJECTION64_PATH";

/// Run the tests of `group` in a child with `tool` attached (none for `None`);
/// check that exactly `expected` of them ran and all passed.
fn run_group(group: &str, tool: Option<&Path>, expected: usize) {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([&format!("{group}::"), "--test-threads=1"])
        .env(GROUP, group)
        .env("METRALE_LIBCUDA_PATH", metrale_fakecuda::library_path());
    match tool {
        Some(path) => cmd.env(TOOL_VAR, path),
        None => cmd.env_remove(TOOL_VAR),
    };
    let out = cmd.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "group {group} failed:\n{text}");
    let ran = format!("test result: ok. {expected} passed; 0 failed");
    assert!(
        text.contains(&ran),
        "group {group}: expected {expected} passing tests:\n{text}"
    );
}

/// Whether this process is the child running `group`.
fn in_group(group: &str) -> bool {
    std::env::var(GROUP).is_ok_and(|g| g == group)
}

#[test]
fn with_the_stand_in_tool() {
    if std::env::var(GROUP).is_err() {
        run_group("attached", Some(metrale_fakecuda::nvtx_library_path()), 10);
    }
}

#[test]
fn with_no_tool_every_call_is_a_no_op() {
    if std::env::var(GROUP).is_err() {
        run_group("no_tool", None, 1);
    }
}

#[test]
fn with_a_tool_whose_init_returns_0_every_call_is_a_no_op() {
    if std::env::var(GROUP).is_err() {
        run_group(
            "init_fails",
            Some(metrale_fakecuda::nvtx_failing_library_path()),
            1,
        );
    }
}

#[test]
fn with_a_hostile_tool_calls_stay_contained() {
    if std::env::var(GROUP).is_err() {
        run_group(
            "hostile",
            Some(metrale_fakecuda::nvtx_hostile_library_path()),
            1,
        );
    }
}

/// Every call of the API once (on the stand-in driver's device 0 for the names).
fn call_everything() {
    let attrs = EventAttributes::new()
        .message("m")
        .color(Color::rgb(1, 2, 3))
        .payload(1u64)
        .category(1);
    nvtx::mark("m");
    nvtx::mark_with(&attrs);
    assert_eq!(nvtx::range_push("r"), None);
    assert_eq!(nvtx::range_push_with(&attrs), None);
    assert_eq!(nvtx::range_pop(), None);
    assert_eq!(nvtx::range_pop(), None);
    drop(nvtx::range("g"));
    drop(nvtx::range_with(&attrs));
    let id = nvtx::range_start("s");
    assert_eq!(id.value(), 0);
    id.end();
    nvtx::range_end(nvtx::range_start_with(&attrs));
    nvtx::name_category(1, "c");
    nvtx::name_os_thread(1, "t");
    nvtx::name_current_thread("t");
    let d = Domain::new("d");
    assert!(d.raw().is_null());
    let s = d.register_string("s");
    d.mark(&EventAttributes::new().registered(&s));
    assert_eq!(d.range_push(&attrs), None);
    assert_eq!(d.range_pop(), None);
    drop(d.range(&attrs));
    d.range_end(d.range_start(&attrs));
    d.name_category(1, "c");
    drop(s);
    drop(d);
    let ctx = metrale_runtime::context(0).unwrap();
    let stream = metrale_runtime::CudaStream::new(&ctx).unwrap();
    let event = metrale_runtime::CudaEvent::new(&ctx).unwrap();
    nvtx::name_device(&metrale_runtime::Device::get(0).unwrap(), "dev");
    nvtx::name_context(&ctx, "ctx");
    nvtx::name_stream(&stream, "stream");
    nvtx::name_event(&event, "event");
}

mod no_tool {
    use super::*;

    #[test]
    fn nothing_is_recorded() {
        if !in_group("no_tool") {
            return;
        }
        call_everything();
        assert_eq!(*nvtx::injection(), Injection::NoTool);
        assert!(!nvtx::is_attached());
        // The stand-in, opened here but never attached, received nothing.
        let fake = FakeNvtx::open(metrale_fakecuda::nvtx_library_path());
        assert_eq!(fake.inits(), 0);
        assert_eq!(fake.count(), 0);
    }
}

mod init_fails {
    use super::*;

    #[test]
    fn nothing_is_recorded() {
        if !in_group("init_fails") {
            return;
        }
        call_everything();
        let path = metrale_fakecuda::nvtx_failing_library_path();
        assert_eq!(
            *nvtx::injection(),
            Injection::InitFailed {
                path: path.to_path_buf()
            }
        );
        let fake = FakeNvtx::open(path);
        assert_eq!(fake.inits(), 1, "the tool's init ran once");
        assert_eq!(fake.count(), 0, "none of its entries was called");
    }
}

/// Issue 40 item 13: a hostile tool (`-DFAKENVTX_HOSTILE`). During its init it
/// asks for tables with null out-pointers and unknown module and export-table
/// ids, and calls back into the process (the hook below makes NVTX calls and
/// asks how attaching went, on the attaching thread); it leaves the CORE
/// marks null; after its init every push writes another pop into the table
/// it kept. Held: the unknown ids are refused with nothing written, the calls
/// made during the init are no-ops (no deadlock, nothing recorded, the
/// answer is "no tool" until the init has returned), null entries are
/// no-ops, and writes after the init are never seen.
mod hostile {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

    static HOOK_RAN: AtomicBool = AtomicBool::new(false);
    static NO_TOOL_DURING_INIT: AtomicBool = AtomicBool::new(false);
    /// What a push made inside the init returned (-2: none, -1: `None`).
    static PUSHED_DURING_INIT: AtomicI32 = AtomicI32::new(-2);

    extern "C" fn during_init() {
        nvtx::mark("during init");
        let pushed = nvtx::range_push("during init");
        PUSHED_DURING_INIT.store(pushed.map_or(-1, |l| l as i32), Ordering::SeqCst);
        let _ = nvtx::range_pop();
        let d = Domain::new("during init");
        drop(d.range(&EventAttributes::new().message("x")));
        drop(d);
        NO_TOOL_DURING_INIT.store(
            *nvtx::injection() == Injection::NoTool && !nvtx::is_attached(),
            Ordering::SeqCst,
        );
        HOOK_RAN.store(true, Ordering::SeqCst);
    }

    #[test]
    fn held_a_hostile_tool_is_contained() {
        if !in_group("hostile") {
            return;
        }
        let path = metrale_fakecuda::nvtx_hostile_library_path();
        let fake = FakeNvtx::open(path);
        fake.set_init_hook(during_init);
        // The first call attaches: the tool's init runs the hook.
        nvtx::mark("first");
        assert!(
            HOOK_RAN.load(Ordering::SeqCst),
            "the tool's init called back"
        );
        assert!(
            NO_TOOL_DURING_INIT.load(Ordering::SeqCst),
            "during the init the answer was not yet in"
        );
        assert_eq!(
            PUSHED_DURING_INIT.load(Ordering::SeqCst),
            -1,
            "a push during the init is a no-op"
        );
        assert_eq!(
            *nvtx::injection(),
            Injection::Attached {
                path: path.to_path_buf()
            }
        );
        assert_eq!(fake.inits(), 1);
        assert_eq!(fake.hostile_surprises(), 0, "unknown ids were refused");
        assert_eq!(
            fake.count(),
            0,
            "nothing reached the tool during its init, and its null marks are no-ops"
        );
        nvtx::mark_with(&EventAttributes::new().message("m"));
        assert_eq!(fake.count(), 0, "the cleared MarkEx is a no-op");
        // Each push makes the tool write another pop into the table it kept.
        for _ in 0..3 {
            assert_eq!(nvtx::range_push("r"), Some(0));
            assert_eq!(nvtx::range_pop(), Some(0));
        }
        assert_eq!(fake.redirected_pops(), 0, "a write after the init was seen");
        let kinds: Vec<NvtxKind> = fake.records().iter().map(|r| r.kind().unwrap()).collect();
        assert_eq!(kinds, [NvtxKind::Push, NvtxKind::Pop].repeat(3));
    }
}

mod attached {
    use super::*;
    use std::ptr;

    fn fake() -> FakeNvtx {
        assert!(nvtx::is_attached(), "{}", nvtx::injection());
        let fake = FakeNvtx::open(metrale_fakecuda::nvtx_library_path());
        fake.reset();
        fake
    }

    fn kinds(records: &[NvtxRecord]) -> Vec<NvtxKind> {
        records.iter().map(|r| r.kind().unwrap()).collect()
    }

    #[test]
    fn the_tool_is_attached_once() {
        if !in_group("attached") {
            return;
        }
        let fake = fake();
        assert_eq!(fake.inits(), 1);
        assert!(nvtx::injection().to_string().contains("attached"));
    }

    #[test]
    fn ranges_nest_per_thread() {
        if !in_group("attached") {
            return;
        }
        let fake = fake();
        {
            let _outer = nvtx::range("outer");
            assert_eq!(fake.depth(ptr::null()), 1);
            {
                let _inner = nvtx::range("inner");
                assert_eq!(fake.depth(ptr::null()), 2);
                // Another thread has its own stack.
                std::thread::spawn(|| {
                    let fake = FakeNvtx::open(metrale_fakecuda::nvtx_library_path());
                    assert_eq!(nvtx::range_push("elsewhere"), Some(0));
                    assert_eq!(fake.depth(ptr::null()), 1);
                    assert_eq!(nvtx::range_pop(), Some(0));
                })
                .join()
                .unwrap();
            }
            assert_eq!(fake.depth(ptr::null()), 1);
        }
        assert_eq!(fake.depth(ptr::null()), 0);
        assert_eq!(nvtx::range_push("a"), Some(0));
        assert_eq!(nvtx::range_push("b"), Some(1));
        assert_eq!(nvtx::range_pop(), Some(1));
        assert_eq!(nvtx::range_pop(), Some(0));
        assert_eq!(nvtx::range_pop(), None, "nothing left to pop");
        let r = fake.records();
        use NvtxKind::*;
        assert_eq!(
            kinds(&r),
            [Push, Push, Push, Pop, Pop, Pop, Push, Push, Pop, Pop, Pop]
        );
        let messages: Vec<String> = r.iter().map(NvtxRecord::message).collect();
        assert_eq!(&messages[..3], ["outer", "inner", "elsewhere"]);
        assert_eq!(
            (r[0].level, r[1].level, r[4].level, r[5].level),
            (0, 1, 1, 0)
        );
        assert_eq!(r[0].attributes_size, 0, "a plain push has no attributes");
    }

    #[test]
    fn started_ranges_may_end_on_another_thread() {
        if !in_group("attached") {
            return;
        }
        let fake = fake();
        let id = nvtx::range_start("load");
        assert_ne!(id.value(), 0);
        std::thread::spawn(move || id.end()).join().unwrap();
        let second = nvtx::range_start_with(&EventAttributes::new().message("two").payload(2u32));
        nvtx::range_end(second);
        let r = fake.records();
        use NvtxKind::*;
        assert_eq!(kinds(&r), [RangeStart, RangeEnd, RangeStart, RangeEnd]);
        assert_eq!((r[0].handle, r[1].handle), (id.value(), id.value()));
        assert_eq!(r[0].message(), "load");
        assert_eq!((r[2].handle, r[3].handle), (second.value(), second.value()));
        assert_eq!(
            (r[2].message().as_str(), r[2].payload_type, r[2].payload),
            ("two", 4, 2)
        );
    }

    #[test]
    fn marks_carry_colors_categories_and_payloads() {
        if !in_group("attached") {
            return;
        }
        let fake = fake();
        nvtx::mark("plain");
        let base = EventAttributes::new().message("m").category(9);
        nvtx::mark_with(&base.color(Color::argb(0x80ff_0010)).payload(u64::MAX));
        nvtx::mark_with(&base.payload(-5i64));
        nvtx::mark_with(&base.payload(0.25f64));
        nvtx::mark_with(&base.payload(7u32));
        nvtx::mark_with(&base.payload(-7i32));
        nvtx::mark_with(&base.payload(1.5f32));
        nvtx::mark_with(&EventAttributes::new());
        let r = fake.records();
        assert!(r.iter().all(|r| r.kind() == Some(NvtxKind::Mark)));
        assert_eq!(r[0].message(), "plain");
        assert_eq!((r[0].message_type, r[0].attributes_size), (0, 0));
        assert_eq!((r[1].color_type, r[1].color), (1, 0x80ff_0010));
        assert_eq!((r[2].color_type, r[2].color), (0, 0), "no color set");
        assert!(r[1..7]
            .iter()
            .all(|r| r.category == 9 && r.message() == "m"));
        assert!(r[1..8].iter().all(|r| r.attributes_size
            == i32::from(metrale_runtime::sys::nvtx::EVENT_ATTRIB_STRUCT_SIZE)));
        let payloads: Vec<(i32, u64)> = r[1..8]
            .iter()
            .map(|r| (r.payload_type, r.payload))
            .collect();
        assert_eq!(
            payloads,
            [
                (1, u64::MAX),
                (2, (-5i64) as u64),
                (3, 0.25f64.to_bits()),
                (4, 7),
                (5, u64::from((-7i32) as u32)),
                (6, u64::from(1.5f32.to_bits())),
                (0, 0),
            ]
        );
        assert_eq!((r[7].message_type, r[7].category), (0, 0));
    }

    #[test]
    fn categories_are_named() {
        if !in_group("attached") {
            return;
        }
        let fake = fake();
        nvtx::name_category(3, "io");
        nvtx::mark_with(&EventAttributes::new().category(3).message("read"));
        let r = fake.records();
        assert_eq!(kinds(&r), [NvtxKind::NameCategory, NvtxKind::Mark]);
        assert_eq!((r[0].category, r[0].message().as_str()), (3, "io"));
        assert_eq!(r[1].category, 3);
    }

    #[test]
    fn domains_group_ranges_marks_categories_and_strings() {
        if !in_group("attached") {
            return;
        }
        let fake = fake();
        let domain = Domain::new("metrale-test");
        let raw: *const std::ffi::c_void = domain.raw().cast_const().cast();
        assert!(!raw.is_null());
        assert_eq!(fake.domain_name(raw).as_deref(), Some("metrale-test"));
        assert_eq!(domain.name(), "metrale-test");
        domain.name_category(4, "kv");
        let decode = domain.register_string("decode");
        assert_eq!(decode.text(), "decode");
        {
            let _r = domain.range(&EventAttributes::new().registered(&decode).category(4));
            assert_eq!(fake.depth(raw), 1);
            assert_eq!(fake.depth(ptr::null()), 0, "the core stack is separate");
        }
        assert_eq!(fake.depth(raw), 0);
        domain.mark(
            &EventAttributes::new()
                .message("tick")
                .color(Color::rgb(0, 0, 255)),
        );
        let id = domain.range_start(&EventAttributes::new().registered(&decode));
        domain.range_end(id);
        // Outside its domain a registered string goes as its text.
        nvtx::mark_with(&EventAttributes::new().registered(&decode));
        drop(decode);
        drop(domain);
        let r = fake.records();
        use NvtxKind::*;
        assert_eq!(
            kinds(&r),
            [
                DomainCreate,
                NameCategory,
                RegisterString,
                Push,
                Pop,
                Mark,
                RangeStart,
                RangeEnd,
                Mark,
                DomainDestroy
            ]
        );
        let handle = raw as u64;
        assert!(r[1..8].iter().all(|r| r.domain == handle));
        assert_eq!((r[1].category, r[1].message().as_str()), (4, "kv"));
        assert_eq!(
            (r[3].message_type, r[3].message().as_str(), r[3].category),
            (3, "decode", 4)
        );
        assert_eq!((r[5].color, r[5].message().as_str()), (0xff00_00ff, "tick"));
        assert_eq!(r[6].message_type, 3);
        assert_eq!(r[7].handle, id.value());
        assert_eq!(
            (r[8].domain, r[8].message_type, r[8].message().as_str()),
            (0, 1, "decode")
        );
        assert_eq!(r[9].domain, handle);
    }

    #[test]
    fn threads_devices_contexts_streams_and_events_are_named() {
        if !in_group("attached") {
            return;
        }
        let fake = fake();
        nvtx::name_os_thread(42, "worker");
        nvtx::name_current_thread("main");
        let ctx = metrale_runtime::context(1).unwrap();
        let stream = metrale_runtime::CudaStream::new(&ctx).unwrap();
        let event = metrale_runtime::CudaEvent::new(&ctx).unwrap();
        let device = metrale_runtime::Device::get(1).unwrap();
        nvtx::name_device(&device, "gpu1");
        nvtx::name_context(&ctx, "ctx1");
        nvtx::name_stream(&stream, "copies");
        nvtx::name_event(&event, "ready");
        let r = fake.records();
        use NvtxKind::*;
        assert_eq!(
            kinds(&r),
            [
                NameThread,
                NameThread,
                NameDevice,
                NameContext,
                NameStream,
                NameEvent
            ]
        );
        assert_eq!((r[0].handle, r[0].message().as_str()), (42, "worker"));
        let tid = nvtx::current_thread_id().expect("Linux");
        assert_eq!(
            (r[1].handle, r[1].message().as_str()),
            (u64::from(tid), "main")
        );
        assert_eq!(r[2].handle, device.raw() as u64);
        assert_eq!(r[3].handle, ctx.raw() as u64);
        assert_eq!(r[4].handle, stream.raw() as u64);
        assert_eq!(r[5].handle, event.raw() as u64);
        let names: Vec<String> = r[2..].iter().map(NvtxRecord::message).collect();
        assert_eq!(names, ["gpu1", "ctx1", "copies", "ready"]);
    }

    #[test]
    fn long_texts_and_interior_nuls() {
        if !in_group("attached") {
            return;
        }
        let fake = fake();
        let long = "x".repeat(300);
        nvtx::mark(&long);
        nvtx::mark("cut\0here");
        nvtx::mark_with(&EventAttributes::new().message(&"y".repeat(200)));
        let d = Domain::new("nul\0name");
        let s = d.register_string("reg\0istered");
        assert_eq!(s.text(), "reg");
        let r = fake.records();
        // The stand-in keeps 119 bytes of a message.
        assert_eq!(r[0].message(), &long[..119]);
        assert_eq!(r[1].message(), "cut");
        assert_eq!(r[2].message(), "y".repeat(119));
        assert_eq!(r[3].message(), "nul");
        assert_eq!(r[4].message(), "reg");
    }

    #[test]
    fn guards_pop_on_unwind() {
        if !in_group("attached") {
            return;
        }
        let fake = fake();
        let result = std::panic::catch_unwind(|| {
            let _r = nvtx::range("doomed");
            panic!("inside a range");
        });
        assert!(result.is_err());
        assert_eq!(fake.depth(ptr::null()), 0);
        assert_eq!(kinds(&fake.records()), [NvtxKind::Push, NvtxKind::Pop]);
    }

    #[test]
    fn many_threads_at_once() {
        if !in_group("attached") {
            return;
        }
        let fake = fake();
        let threads: Vec<_> = (0..8)
            .map(|i| {
                std::thread::spawn(move || {
                    for _ in 0..100 {
                        let _r = nvtx::range(&format!("t{i}"));
                        nvtx::mark("m");
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(fake.count(), 8 * 100 * 3);
        assert_eq!(fake.depth(ptr::null()), 0);
    }
}
