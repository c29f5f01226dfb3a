//! The code of a replay in flight (found in review): an executable graph held
//! its kernels' code, but a replay queued behind slow work did not, so
//! dropping the executable and the registry unloaded the module under it. The
//! graph now holds each kernel table through a user object (the driver keeps
//! it for every launch in flight); on a driver without user objects a host
//! function after each replay holds it. `defect_*`: failing on the code
//! reviewed; `held_*`: the fallback (the old-driver stand-in, in a child).

use std::sync::mpsc;
use std::time::Duration;

use crate::common::*;
use crate::harness::{run_child, Child, Test};

/// Capture one `vec_add` on `s`, instantiate it, block `s` behind a host
/// function, replay, drop the executable and the registry, then let the work
/// run. Returns (kernels run after their module went, modules unloaded while
/// the replay waited, host functions the replay queued).
fn replay_behind_slow_work() -> (i64, i64, i64) {
    let reg = setup();
    let s = CudaStream::new(reg.ctx()).unwrap();
    let n = 64u32;
    let a = DeviceBuffer::<f32>::alloc(&s, n as usize).unwrap();
    let mut c = DeviceBuffer::<f32>::alloc(&s, n as usize).unwrap();
    let cfg = LaunchConfig::for_num_elems(n as usize, 32).unwrap();
    let f = vec_add(&reg);
    let graph = s
        .capture(|s| -> Result<()> {
            // SAFETY: the stand-in only records the arguments.
            unsafe { reg.launch(f, cfg, s, (&a, &a, &mut c, n)) }
        })
        .unwrap();
    let exec = graph.instantiate().unwrap();
    drop(graph);
    let (go, wait) = mpsc::channel::<()>();
    s.launch_host_fn(move || {
        let _ = wait.recv_timeout(Duration::from_secs(10));
    })
    .unwrap();
    let host_fns = fake().calls("cuLaunchHostFunc");
    // SAFETY: a and c outlive the replay (synchronised below).
    unsafe { exec.launch(&s) }.unwrap();
    let per_replay = fake().calls("cuLaunchHostFunc") - host_fns;
    let unloads = || fake().calls("cuModuleUnload") + fake().calls("cuLibraryUnload");
    let before = unloads();
    drop(exec);
    drop(reg);
    let while_waiting = unloads() - before;
    go.send(()).unwrap();
    s.synchronize().unwrap();
    let run_unloaded = fake().kernels_run_unloaded();
    // The hold went with the replay: the module is unloaded by now.
    assert_eq!(
        unloads() - before,
        1,
        "the module is unloaded after the replay"
    );
    drop((a, c, s));
    release(0);
    assert_eq!(fake().live(Live::Modules), 0, "modules left loaded");
    assert_eq!(fake().user_objects(), 0, "user objects left");
    (run_unloaded, while_waiting, per_replay)
}

/// A replay queued behind slow work keeps its kernels' code loaded after the
/// executable and the registry are dropped (held by the driver through the
/// graph's user objects, with no host function per replay).
fn defect_a_replay_in_flight_keeps_its_code_after_executable_and_registry_go() {
    let (run_unloaded, while_waiting, per_replay) = replay_behind_slow_work();
    assert_eq!(
        run_unloaded, 0,
        "a replayed kernel ran after its module was unloaded"
    );
    assert_eq!(while_waiting, 0, "unloaded while the replay waited");
    assert_eq!(per_replay, 0, "held by user objects, not a host function");
}

/// On a driver without user objects the same replay keeps its code through
/// the host function queued after it (one per replay, shared with the other
/// holds of the executable).
fn held_without_user_objects_a_replay_in_flight_keeps_its_code() {
    let old = metrale_fakecuda::old_library_path().to_str().unwrap();
    let out = run_child(
        "replay_code_on_old_driver",
        &[("METRALE_LIBCUDA_PATH", old)],
    );
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "run unloaded 0, unloaded while waiting 0, host functions per replay 1"
    );
}

fn child_replay_code_on_old_driver() {
    let (run_unloaded, while_waiting, per_replay) = replay_behind_slow_work();
    println!(
        "run unloaded {run_unloaded}, unloaded while waiting {while_waiting}, \
         host functions per replay {per_replay}"
    );
}

pub fn children() -> Vec<Child> {
    vec![Child {
        name: "replay_code_on_old_driver",
        run: child_replay_code_on_old_driver,
    }]
}

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "replay_code::defect_a_replay_in_flight_keeps_its_code_after_executable_and_registry_go",
            run: defect_a_replay_in_flight_keeps_its_code_after_executable_and_registry_go,
        },
        Test {
            name: "replay_code::held_without_user_objects_a_replay_in_flight_keeps_its_code",
            run: held_without_user_objects_a_replay_in_flight_keeps_its_code,
        },
    ]
}
