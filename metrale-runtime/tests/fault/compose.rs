//! Issue 41, "parts that compose": the forms a new user writes first, against the
//! stand-in. Generic device memory as kernel arguments (`&impl DeviceMemory<T>`
//! as `const T*`, `&mut impl DeviceMemoryMut<T>` as `T*`, a `&` of a mutable view
//! as a read argument), a run-time argument list built in a loop over a manifest,
//! a batch of copies taken by value, captures with the user's own error type.

use crate::common::*;
use crate::harness::Test;

fn cfg() -> LaunchConfig {
    LaunchConfig::new((1, 1, 1), (32, 1, 1), 0).unwrap()
}

/// The parameters of the last launch, first 8 bytes of each.
fn recorded(n: i32) -> Vec<u64> {
    (0..n).map(|i| fake().last_param(i)).collect()
}

/// `vec_add(const float*, const float*, float*, unsigned)` over generic memory,
/// as a user's crate writes it.
fn add(
    s: &CudaStream,
    f: &CudaFunction,
    a: &impl DeviceMemory<f32>,
    b: &impl DeviceMemory<f32>,
    c: &mut impl DeviceMemoryMut<f32>,
    n: u32,
) -> Result<()> {
    // SAFETY: the stand-in only records the arguments.
    unsafe { s.launch(f, cfg(), (a, b, c, n)) }
}

fn generic_memory_passes_as_its_address() {
    let reg = setup();
    let s = reg.stream();
    let f = reg.function("kernels", "vec_add").unwrap();
    let a = DeviceBuffer::<f32>::alloc(s, 16).unwrap();
    let mut b = DeviceBuffer::<f32>::alloc(s, 16).unwrap();
    let mut c = DeviceBuffer::<f32>::alloc(s, 16).unwrap();
    let (pa, pb, pc) = (a.device_ptr(), b.device_ptr(), c.device_ptr());
    add(s, &f, &a, &b, &mut c, 16).unwrap();
    assert_eq!(recorded(4), [pa, pb, pc, 16]);
    // A mutable view is also a read argument; views of views keep their offset.
    {
        let vb = b.slice_mut(4..).unwrap();
        let mut vc = c.slice_mut(8..).unwrap();
        add(s, &f, &vb, &vb, &mut vc, 8).unwrap();
        assert_eq!(recorded(4), [pb + 16, pb + 16, pc + 32, 8]);
        // SAFETY: as above.
        unsafe { s.launch(&f, cfg(), (&vb, &a, &mut vc, 8u32)) }.unwrap();
        assert_eq!(recorded(4), [pb + 16, pa, pc + 32, 8]);
    }
    // `&` of every mutable buffer type, and a trait object.
    let dynamic: &dyn DeviceMemory<f32> = &a;
    // SAFETY: as above.
    unsafe { s.launch(&f, cfg(), (dynamic, &c, &mut b, 1u32)) }.unwrap();
    assert_eq!(recorded(4), [pa, pc, pb, 1]);
    drop((a, b, c, f));
    done(reg);
}

/// One parameter of a kernel, as a run-time manifest names it.
enum Param {
    Input(usize),
    Output,
    Len,
}

fn a_list_is_built_in_a_loop_over_a_manifest() {
    let reg = setup();
    let s = reg.stream();
    let f = reg.function("kernels", "vec_add").unwrap();
    let inputs = [
        DeviceBuffer::<f32>::alloc(s, 16).unwrap(),
        DeviceBuffer::<f32>::alloc(s, 16).unwrap(),
    ];
    let mut out = DeviceBuffer::<f32>::alloc(s, 16).unwrap();
    let po = out.device_ptr();
    let manifest = [Param::Input(1), Param::Input(0), Param::Output, Param::Len];
    {
        // The mutable borrow is taken once, before the loop; `&` of it passes as
        // the kernel's `float*` as often as the manifest names it.
        let out = out.slice_mut(..).unwrap();
        let mut args = KernelArgList::new();
        for param in &manifest {
            match param {
                Param::Input(i) => args.push(&inputs[*i]),
                Param::Output => args.push(&out),
                Param::Len => args.push(16u32),
            };
        }
        // SAFETY: as above.
        unsafe { s.launch(&f, cfg(), &args) }.unwrap();
    }
    assert_eq!(
        recorded(4),
        [inputs[1].device_ptr(), inputs[0].device_ptr(), po, 16]
    );
    drop((inputs, out, f));
    done(reg);
}

fn a_batch_taken_by_value_ends_its_borrows() {
    let reg = setup();
    let s = reg.stream();
    let dev = DeviceBuffer::from_host(s, &[1u32, 2, 3, 4, 5, 6]).unwrap();
    let mut out = vec![0u32; 6];
    let (head, tail) = out.split_at_mut(2);
    let (late, early) = (dev.slice(4..).unwrap(), dev.slice(..4).unwrap());
    let copies = vec![BatchCopy::d2h(&late, head), BatchCopy::d2h(&early, tail)];
    s.copy_batch(copies).unwrap();
    // The pairs went with the call: the destination is read at once.
    assert_eq!(out, [5, 6, 1, 2, 3, 4]);
    // By reference, as before, and as an array by value.
    let mut again = [0u32; 6];
    s.copy_batch([BatchCopy::d2h(&dev, &mut again[..])])
        .unwrap();
    assert_eq!(again, [1, 2, 3, 4, 5, 6]);
    drop(dev);
    done(reg);
}

/// No space before a colon, no doubled space.
fn tidy(e: &MetraleError) {
    let text = e.to_string();
    assert!(!text.contains(" :") && !text.contains("  "), "{text:?}");
}

fn composed_error_texts_are_tidy() {
    let reg = setup();
    let s = reg.stream();
    let dev = DeviceBuffer::<u32>::zeroed(s, 4).unwrap();
    let mut short = [0u32; 3];
    // A pair of different lengths: the stream's name, then the call.
    let e = s
        .copy_batch([BatchCopy::d2h(&dev, &mut short[..])])
        .unwrap_err();
    assert!(e.to_string().contains(": copy_batch: pair 0"), "{e}");
    tidy(&e);
    // Refusals while capturing: the stream's name, then what is refused.
    let mut host = [0u32; 4];
    let mut in_capture = Vec::new();
    let graph = s.capture(|s| {
        in_capture.push(
            s.copy_batch([BatchCopy::d2h(&dev, &mut host[..])])
                .unwrap_err(),
        );
        in_capture.push(s.launch_host_fn(|| {}).unwrap_err());
        Ok(())
    });
    drop(graph);
    assert_eq!(in_capture.len(), 2);
    for e in &in_capture {
        assert!(e.to_string().contains("is being captured"), "{e}");
        tidy(e);
    }
    drop(dev);
    done(reg);
}

/// A user's own error type, as `try_capture` takes it.
#[derive(Debug)]
enum AppError {
    Gpu(MetraleError),
    TooBig(usize),
}

impl From<MetraleError> for AppError {
    fn from(e: MetraleError) -> Self {
        AppError::Gpu(e)
    }
}

fn arenas_and_buckets_capture_with_the_users_error() {
    let reg = setup();
    let s = reg.stream();
    let f = reg.function("kernels", "vec_add").unwrap();
    let arena = CaptureArena::new(s, 1 << 20).unwrap();
    let x = arena.take::<f32>(64).unwrap();
    let mut y = arena.take::<f32>(64).unwrap();
    // The arena: the user's error comes back as it was, the capture is ended.
    let e = arena
        .try_capture(s, |_| -> Result<(), AppError> { Err(AppError::TooBig(7)) })
        .unwrap_err();
    assert!(matches!(e, AppError::TooBig(7)), "{e:?}");
    assert!(!s.is_capturing().unwrap(), "the capture was ended");
    let graph = arena
        .try_capture(s, |s| -> Result<(), AppError> {
            add(s, &f, &x, &x, &mut y, 64)?;
            Ok(())
        })
        .unwrap();
    assert_eq!(graph.nodes().unwrap().len(), 1);
    // The buckets: sizes checked as `capture` checks them, the step's error kept.
    let e = GraphBuckets::try_capture(s, &arena, &[], |_, _| -> Result<(), AppError> { Ok(()) })
        .unwrap_err();
    assert!(
        matches!(&e, AppError::Gpu(g) if g.to_string().contains("at least one")),
        "{e:?}"
    );
    let e = GraphBuckets::try_capture(s, &arena, &[1, 8, 64], |s, size| {
        if size > 8 {
            return Err(AppError::TooBig(size));
        }
        add(s, &f, &x, &x, &mut y, size as u32)?;
        Ok(())
    })
    .unwrap_err();
    assert!(matches!(e, AppError::TooBig(64)), "{e:?}");
    let buckets =
        GraphBuckets::try_capture(s, &arena, &[8, 1], |s, size| -> Result<(), AppError> {
            add(s, &f, &x, &x, &mut y, size as u32)?;
            Ok(())
        })
        .unwrap();
    assert_eq!(buckets.sizes().collect::<Vec<_>>(), [1, 8]);
    drop((buckets, graph, x, y));
    drop((arena, f));
    done(reg);
}

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "compose::generic_memory_passes_as_its_address",
            run: generic_memory_passes_as_its_address,
        },
        Test {
            name: "compose::a_list_is_built_in_a_loop_over_a_manifest",
            run: a_list_is_built_in_a_loop_over_a_manifest,
        },
        Test {
            name: "compose::a_batch_taken_by_value_ends_its_borrows",
            run: a_batch_taken_by_value_ends_its_borrows,
        },
        Test {
            name: "compose::composed_error_texts_are_tidy",
            run: composed_error_texts_are_tidy,
        },
        Test {
            name: "compose::arenas_and_buckets_capture_with_the_users_error",
            run: arenas_and_buckets_capture_with_the_users_error,
        },
    ]
}
