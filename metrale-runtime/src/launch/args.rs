//! Typed kernel arguments: [`KernelArg`] (a value or a device memory handle, with
//! the size and alignment the kernel receives), [`NullPtr`], and [`KernelArgs`]
//! (tuples of up to 24, packed into the driver's `void**` array on the stack; the
//! run-time list is in `arg_list.rs`), with the [`ArgLayout`] a launch checks.
//!
//! Why `KernelArg` has a kind parameter: a value is an argument through
//! `T: DeviceRepr`, device memory through `&M` and `&mut M` for every memory type
//! `M` (generic ones included: `&impl DeviceMemory<T>`). Rust cannot hold both
//! as impls of one trait (another crate could make a reference `DeviceRepr`), so
//! the two are impls of `KernelArg<ByValue>` and `KernelArg<ByAddress>`, and a
//! tuple's kinds are inferred: nothing of it exists at run time.

use std::ffi::c_void;

use metrale_cuda_sys::CUdeviceptr;

use crate::memory::{DeviceRepr, DeviceSlice, DeviceSliceMut, Sealed, SealedMut};

/// The kind of a [`KernelArg`] passed by its own bytes: a `DeviceRepr` value,
/// [`NullPtr`], a tensor map, or your own `KernelArg` type (the default kind).
#[derive(Debug)]
pub enum ByValue {}

/// The kind of a [`KernelArg`] that is device memory passed as its address:
/// `&m` (a `const T*`) and `&mut m` (a `T*`) of metrale's memory, and slices.
#[derive(Debug)]
pub enum ByAddress {}

/// One kernel argument: something whose bytes are passed by pointer to the driver.
///
/// - a value `v` of a [`DeviceRepr`] type (`7u32`, `2.5f32`, your `#[repr(C)]`
///   struct), by its bytes;
/// - `&m` of any device memory `m: impl DeviceMemory<T>` (buffers, slices, views,
///   managed buffers, symbols, growable and IPC buffers, NCCL buffers,
///   registrations and windows, `&dyn DeviceMemory<T>`) as a `const T*`, and
///   `&mut m` of any `m: impl DeviceMemoryMut<T>` as a `T*`;
///   [`DeviceSlice`] and [`DeviceSliceMut`] also by value;
/// - [`NullPtr`], and a `&TensorMap` by value.
///
/// `Kind` ([`ByValue`] or [`ByAddress`]) only tells the two families apart for
/// the compiler, which infers it; write `A: KernelArg<K>` with a generic `K` to
/// accept both.
///
/// # Safety
/// `param_ptr` must return a pointer to `SIZE` bytes of this value, valid while
/// `self` is borrowed, laid out as the kernel's matching parameter expects.
/// `ALIGN` must be a power of two.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a kernel argument",
    label = "not a kernel argument",
    note = "a kernel argument is a value of a `DeviceRepr` type (`7u32`, `2.5f32`), `&m` of metrale device memory (`&buf`, `&slice`, `&impl DeviceMemory<T>`: a `const T*`), `&mut m` of writable memory (`&mut impl DeviceMemoryMut<T>`: a `T*`), a slice, `NullPtr` or `&TensorMap`; host memory and host references are never arguments"
)]
pub unsafe trait KernelArg<Kind = ByValue> {
    /// The bytes the kernel receives (checked against its parameter layout).
    const SIZE: usize;
    /// The alignment of the argument's type, in bytes: how a
    /// [`KernelArgList`](crate::KernelArgList) stores it. A launch does not
    /// compare it with the parameter's offset (it copies the bytes to the offset
    /// the driver reports). The default is 1.
    const ALIGN: usize = 1;
    /// Pointer to the argument's bytes.
    fn param_ptr(&self) -> *mut c_void;
}

// SAFETY: a DeviceRepr value is passed by its own bytes; a type's alignment is a
// power of two.
unsafe impl<T: DeviceRepr> KernelArg for T {
    const SIZE: usize = std::mem::size_of::<T>();
    const ALIGN: usize = std::mem::align_of::<T>();
    #[inline]
    fn param_ptr(&self) -> *mut c_void {
        (self as *const T).cast_mut().cast()
    }
}

/// Device memory handles are passed as their address: a `CUdeviceptr` field the
/// handle holds for as long as it is borrowed.
macro_rules! address_arg {
    ($([$($gen:tt)*] $ty:ty),* $(,)?) => { $(
        // SAFETY: `address_ref` points at a CUdeviceptr field of the handle
        // (or, for a registration or window, of the buffer it borrows), valid
        // while the handle is borrowed; a pointer is 8 bytes, 8-aligned.
        unsafe impl<$($gen)*> KernelArg<ByAddress> for $ty {
            const SIZE: usize = std::mem::size_of::<CUdeviceptr>();
            const ALIGN: usize = std::mem::align_of::<CUdeviceptr>();
            #[inline]
            fn param_ptr(&self) -> *mut c_void {
                (self.address_ref() as *const CUdeviceptr).cast_mut().cast()
            }
        }
    )* };
}
address_arg!(
    [M: Sealed + ?Sized] &M,
    [M: SealedMut + ?Sized] &mut M,
    ['a, T: DeviceRepr] DeviceSlice<'a, T>,
    ['a, T: DeviceRepr] DeviceSliceMut<'a, T>,
);

/// A null device pointer argument: the 8 zero bytes of a kernel's pointer
/// parameter (`float* = nullptr`), in a tuple (`(&a, NullPtr, n)`) or a
/// [`KernelArgList`](crate::KernelArgList). Sized and aligned as a pointer, so the
/// launch check takes it where a pointer is expected, unlike a `0u32`.
///
/// ```
/// use metrale_runtime::{KernelArg, NullPtr};
/// assert_eq!((NullPtr::SIZE, NullPtr::ALIGN), (8, 8));
/// assert_eq!(NullPtr.address(), 0);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct NullPtr;

/// What a [`NullPtr`] argument points the driver at.
static NULL_DEVICE_PTR: CUdeviceptr = 0;

impl NullPtr {
    /// The address it passes: 0.
    pub const fn address(self) -> CUdeviceptr {
        0
    }
}

// SAFETY: the pointer is to a static zero address (8 bytes, never written: the
// driver only reads argument bytes), valid for the whole program.
unsafe impl KernelArg for NullPtr {
    const SIZE: usize = std::mem::size_of::<CUdeviceptr>();
    const ALIGN: usize = std::mem::align_of::<CUdeviceptr>();
    #[inline]
    fn param_ptr(&self) -> *mut c_void {
        (&NULL_DEVICE_PTR as *const CUdeviceptr).cast_mut().cast()
    }
}

/// The sizes and alignments of an argument list, in order. A launch checks the
/// count and each size against the kernel's parameter layout; alignment is not
/// compared (the launch copies each argument's bytes to the offset the driver
/// reports, which is not always a multiple of the declared alignment).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArgLayout<'a> {
    sizes: &'a [usize],
    aligns: &'a [usize],
}

impl<'a> ArgLayout<'a> {
    /// A layout of `sizes.len()` arguments; `aligns` gives the alignment of the
    /// first `aligns.len()` of them (as many as are known).
    pub const fn new(sizes: &'a [usize], aligns: &'a [usize]) -> ArgLayout<'a> {
        ArgLayout { sizes, aligns }
    }

    /// Each argument's size in bytes.
    pub const fn sizes(&self) -> &'a [usize] {
        self.sizes
    }

    /// Each argument's alignment in bytes (as many as are known).
    pub const fn aligns(&self) -> &'a [usize] {
        self.aligns
    }
}

/// A kernel's whole argument list: a tuple of up to 24 [`KernelArg`]s, `()`, or a
/// list built at run time (`&`[`KernelArgList`](crate::KernelArgList)).
///
/// # Safety
/// `with_params` must pass `f` an array holding one valid pointer per argument,
/// in order, each to that argument's bytes (for a tuple: each element's
/// [`KernelArg::param_ptr`]), valid during the call. [`KernelArgs::layout`] must
/// list each argument's size (and, where it lists one, its alignment) and the
/// same number of arguments: for a tuple, each element's `SIZE` in `SIZES` (and
/// `ALIGN` in `ALIGNS`).
///
/// `Kinds` is inferred (the kinds of a tuple's elements, `()` for a list): a
/// generic launcher writes `fn go<A: KernelArgs<K>, K>(args: A)`.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a kernel argument list",
    label = "expected a tuple of kernel arguments",
    note = "pass a tuple of up to 24 arguments: values (`DeviceRepr`), `&buf`, `&mut buf`, slices or `NullPtr`: `(&a, &mut b, n)`; one argument is `(x,)`; or a `&KernelArgList` built at run time"
)]
pub unsafe trait KernelArgs<Kinds> {
    /// Each argument's size in bytes, in order, when the list's shape is fixed at
    /// compile time (tuples). Empty for a run-time list, which reports its sizes
    /// through [`KernelArgs::layout`] (what launches check).
    const SIZES: &'static [usize];
    /// Each argument's alignment in bytes, in order, as `SIZES` (reported, not
    /// compared at launch). The default is empty.
    const ALIGNS: &'static [usize] = &[];
    /// Call `f` with the packed `void*` array.
    fn with_params<R>(&self, f: impl FnOnce(&mut [*mut c_void]) -> R) -> R;
    /// The sizes (checked at launch) and alignments (reported): by default
    /// `SIZES` and `ALIGNS`.
    #[inline]
    fn layout(&self) -> ArgLayout<'_> {
        ArgLayout::new(Self::SIZES, Self::ALIGNS)
    }
}

macro_rules! impl_kernel_args {
    ($n:literal; $($t:ident $k:ident . $i:tt),*) => {
        // SAFETY: one pointer per tuple element, in order, borrowed from `self`;
        // the layout is each element's own SIZE and ALIGN.
        unsafe impl<$($t: KernelArg<$k>, $k),*> KernelArgs<($($k,)*)> for ($($t,)*) {
            const SIZES: &'static [usize] = &[$(<$t as KernelArg<$k>>::SIZE),*];
            const ALIGNS: &'static [usize] = &[$(<$t as KernelArg<$k>>::ALIGN),*];
            #[inline]
            fn with_params<Out>(&self, f: impl FnOnce(&mut [*mut c_void]) -> Out) -> Out {
                let mut params: [*mut c_void; $n] = [$(self.$i.param_ptr()),*];
                f(&mut params)
            }
        }
    };
}

// SAFETY: no arguments, an empty array.
unsafe impl KernelArgs<()> for () {
    const SIZES: &'static [usize] = &[];
    #[inline]
    fn with_params<R>(&self, f: impl FnOnce(&mut [*mut c_void]) -> R) -> R {
        f(&mut [])
    }
}
impl_kernel_args!(1; A KA.0);
impl_kernel_args!(2; A KA.0, B KB.1);
impl_kernel_args!(3; A KA.0, B KB.1, C KC.2);
impl_kernel_args!(4; A KA.0, B KB.1, C KC.2, D KD.3);
impl_kernel_args!(5; A KA.0, B KB.1, C KC.2, D KD.3, E KE.4);
impl_kernel_args!(6; A KA.0, B KB.1, C KC.2, D KD.3, E KE.4, F KF.5);
impl_kernel_args!(7; A KA.0, B KB.1, C KC.2, D KD.3, E KE.4, F KF.5, G KG.6);
impl_kernel_args!(8; A KA.0, B KB.1, C KC.2, D KD.3, E KE.4, F KF.5, G KG.6, H KH.7);
impl_kernel_args!(9; A KA.0, B KB.1, C KC.2, D KD.3, E KE.4, F KF.5, G KG.6, H KH.7, I KI.8);
impl_kernel_args!(10; A KA.0, B KB.1, C KC.2, D KD.3, E KE.4, F KF.5, G KG.6, H KH.7, I KI.8, J KJ.9);
impl_kernel_args!(11; A KA.0, B KB.1, C KC.2, D KD.3, E KE.4, F KF.5, G KG.6, H KH.7, I KI.8, J KJ.9, K KK.10);
impl_kernel_args!(12; A KA.0, B KB.1, C KC.2, D KD.3, E KE.4, F KF.5, G KG.6, H KH.7, I KI.8, J KJ.9, K KK.10, L KL.11);
impl_kernel_args!(13; A KA.0, B KB.1, C KC.2, D KD.3, E KE.4, F KF.5, G KG.6, H KH.7, I KI.8, J KJ.9, K KK.10, L KL.11, M KM.12);
impl_kernel_args!(14; A KA.0, B KB.1, C KC.2, D KD.3, E KE.4, F KF.5, G KG.6, H KH.7, I KI.8, J KJ.9, K KK.10, L KL.11, M KM.12, N KN.13);
impl_kernel_args!(15; A KA.0, B KB.1, C KC.2, D KD.3, E KE.4, F KF.5, G KG.6, H KH.7, I KI.8, J KJ.9, K KK.10, L KL.11, M KM.12, N KN.13, O KO.14);
impl_kernel_args!(16; A KA.0, B KB.1, C KC.2, D KD.3, E KE.4, F KF.5, G KG.6, H KH.7, I KI.8, J KJ.9, K KK.10, L KL.11, M KM.12, N KN.13, O KO.14, P KP.15);
impl_kernel_args!(17; A KA.0, B KB.1, C KC.2, D KD.3, E KE.4, F KF.5, G KG.6, H KH.7, I KI.8, J KJ.9, K KK.10, L KL.11, M KM.12, N KN.13, O KO.14, P KP.15, Q KQ.16);
impl_kernel_args!(18; A KA.0, B KB.1, C KC.2, D KD.3, E KE.4, F KF.5, G KG.6, H KH.7, I KI.8, J KJ.9, K KK.10, L KL.11, M KM.12, N KN.13, O KO.14, P KP.15, Q KQ.16, R KR.17);
impl_kernel_args!(19; A KA.0, B KB.1, C KC.2, D KD.3, E KE.4, F KF.5, G KG.6, H KH.7, I KI.8, J KJ.9, K KK.10, L KL.11, M KM.12, N KN.13, O KO.14, P KP.15, Q KQ.16, R KR.17, S KS.18);
impl_kernel_args!(20; A KA.0, B KB.1, C KC.2, D KD.3, E KE.4, F KF.5, G KG.6, H KH.7, I KI.8, J KJ.9, K KK.10, L KL.11, M KM.12, N KN.13, O KO.14, P KP.15, Q KQ.16, R KR.17, S KS.18, T KT.19);
impl_kernel_args!(21; A KA.0, B KB.1, C KC.2, D KD.3, E KE.4, F KF.5, G KG.6, H KH.7, I KI.8, J KJ.9, K KK.10, L KL.11, M KM.12, N KN.13, O KO.14, P KP.15, Q KQ.16, R KR.17, S KS.18, T KT.19, U KU.20);
impl_kernel_args!(22; A KA.0, B KB.1, C KC.2, D KD.3, E KE.4, F KF.5, G KG.6, H KH.7, I KI.8, J KJ.9, K KK.10, L KL.11, M KM.12, N KN.13, O KO.14, P KP.15, Q KQ.16, R KR.17, S KS.18, T KT.19, U KU.20, V KV.21);
impl_kernel_args!(23; A KA.0, B KB.1, C KC.2, D KD.3, E KE.4, F KF.5, G KG.6, H KH.7, I KI.8, J KJ.9, K KK.10, L KL.11, M KM.12, N KN.13, O KO.14, P KP.15, Q KQ.16, R KR.17, S KS.18, T KT.19, U KU.20, V KV.21, W KW.22);
impl_kernel_args!(24; A KA.0, B KB.1, C KC.2, D KD.3, E KE.4, F KF.5, G KG.6, H KH.7, I KI.8, J KJ.9, K KK.10, L KL.11, M KM.12, N KN.13, O KO.14, P KP.15, Q KQ.16, R KR.17, S KS.18, T KT.19, U KU.20, V KV.21, W KW.22, X KX.23);
