//! Typed kernel arguments: [`KernelArg`] (a value or a device memory handle, with
//! the size the kernel receives) and [`KernelArgs`] (tuples of up to 16, packed
//! into the driver's `void**` array on the stack).

use std::ffi::c_void;

use metrale_cuda_sys::CUdeviceptr;

use crate::memory::{
    DeviceBuffer, DevicePod, DeviceRepr, DeviceSlice, DeviceSliceMut, DeviceSymbol, GrowableBuffer,
    ManagedBuffer,
};

/// One kernel argument: something whose bytes are passed by pointer to the driver.
///
/// # Safety
/// `param_ptr` must return a pointer to `SIZE` bytes of this value, valid while
/// `self` is borrowed, laid out as the kernel's matching parameter expects.
pub unsafe trait KernelArg {
    /// The bytes the kernel receives (checked against its parameter layout).
    const SIZE: usize;
    /// Pointer to the argument's bytes.
    fn param_ptr(&self) -> *mut c_void;
}

// SAFETY: a DeviceRepr value is passed by its own bytes.
unsafe impl<T: DeviceRepr> KernelArg for T {
    const SIZE: usize = std::mem::size_of::<T>();
    #[inline]
    fn param_ptr(&self) -> *mut c_void {
        (self as *const T).cast_mut().cast()
    }
}

/// Device memory handles are passed as their address: a `CUdeviceptr` field the
/// handle holds for as long as it is borrowed.
macro_rules! pointer_arg {
    ($([$($gen:tt)*] $ty:ty),* $(,)?) => { $(
        // SAFETY: `device_ptr_ref` points at the handle's own CUdeviceptr field.
        unsafe impl<$($gen)*> KernelArg for $ty {
            const SIZE: usize = std::mem::size_of::<CUdeviceptr>();
            #[inline]
            fn param_ptr(&self) -> *mut c_void {
                (self.device_ptr_ref() as *const CUdeviceptr).cast_mut().cast()
            }
        }
    )* };
}
pointer_arg!(
    [T: DeviceRepr] &DeviceBuffer<T>,
    [T: DeviceRepr] &mut DeviceBuffer<T>,
    ['a, T: DeviceRepr] DeviceSlice<'a, T>,
    ['a, 'b, T: DeviceRepr] &'b DeviceSlice<'a, T>,
    ['a, T: DeviceRepr] DeviceSliceMut<'a, T>,
    ['a, 'b, T: DeviceRepr] &'b mut DeviceSliceMut<'a, T>,
    [T: DevicePod] &ManagedBuffer<T>,
    [T: DevicePod] &mut ManagedBuffer<T>,
    [T: DeviceRepr] &DeviceSymbol<T>,
    [T: DeviceRepr] &GrowableBuffer<T>,
    [T: DeviceRepr] &mut GrowableBuffer<T>,
);
#[cfg(unix)]
pointer_arg!(
    [T: DeviceRepr] &crate::memory::IpcBuffer<T>,
    [T: DeviceRepr] &mut crate::memory::IpcBuffer<T>,
);

/// A kernel's whole argument list: a tuple of up to 16 [`KernelArg`]s, or `()`.
///
/// # Safety
/// `with_params` must pass `f` an array holding one valid [`KernelArg::param_ptr`]
/// per element, in order, and `SIZES` must list each element's `SIZE`.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a kernel argument list",
    label = "expected a tuple of kernel arguments",
    note = "pass a tuple of up to 16 arguments: values (`DeviceRepr`), `&buf`, `&mut buf`, or slices: `(&a, &mut b, n)`; one argument is `(x,)`"
)]
pub unsafe trait KernelArgs {
    /// Each argument's size in bytes, in order.
    const SIZES: &'static [usize];
    /// Call `f` with the packed `void*` array (on the stack).
    fn with_params<R>(&self, f: impl FnOnce(&mut [*mut c_void]) -> R) -> R;
}

macro_rules! impl_kernel_args {
    ($n:literal; $($t:ident . $i:tt),*) => {
        // SAFETY: one pointer per tuple element, in order, borrowed from `self`.
        unsafe impl<$($t: KernelArg),*> KernelArgs for ($($t,)*) {
            const SIZES: &'static [usize] = &[$($t::SIZE),*];
            #[inline]
            fn with_params<R>(&self, f: impl FnOnce(&mut [*mut c_void]) -> R) -> R {
                let mut params: [*mut c_void; $n] = [$(self.$i.param_ptr()),*];
                f(&mut params)
            }
        }
    };
}

// SAFETY: no arguments, an empty array.
unsafe impl KernelArgs for () {
    const SIZES: &'static [usize] = &[];
    #[inline]
    fn with_params<R>(&self, f: impl FnOnce(&mut [*mut c_void]) -> R) -> R {
        f(&mut [])
    }
}
impl_kernel_args!(1; A.0);
impl_kernel_args!(2; A.0, B.1);
impl_kernel_args!(3; A.0, B.1, C.2);
impl_kernel_args!(4; A.0, B.1, C.2, D.3);
impl_kernel_args!(5; A.0, B.1, C.2, D.3, E.4);
impl_kernel_args!(6; A.0, B.1, C.2, D.3, E.4, F.5);
impl_kernel_args!(7; A.0, B.1, C.2, D.3, E.4, F.5, G.6);
impl_kernel_args!(8; A.0, B.1, C.2, D.3, E.4, F.5, G.6, H.7);
impl_kernel_args!(9; A.0, B.1, C.2, D.3, E.4, F.5, G.6, H.7, I.8);
impl_kernel_args!(10; A.0, B.1, C.2, D.3, E.4, F.5, G.6, H.7, I.8, J.9);
impl_kernel_args!(11; A.0, B.1, C.2, D.3, E.4, F.5, G.6, H.7, I.8, J.9, K.10);
impl_kernel_args!(12; A.0, B.1, C.2, D.3, E.4, F.5, G.6, H.7, I.8, J.9, K.10, L.11);
impl_kernel_args!(13; A.0, B.1, C.2, D.3, E.4, F.5, G.6, H.7, I.8, J.9, K.10, L.11, M.12);
impl_kernel_args!(14; A.0, B.1, C.2, D.3, E.4, F.5, G.6, H.7, I.8, J.9, K.10, L.11, M.12, N.13);
impl_kernel_args!(15; A.0, B.1, C.2, D.3, E.4, F.5, G.6, H.7, I.8, J.9, K.10, L.11, M.12, N.13, O.14);
impl_kernel_args!(16; A.0, B.1, C.2, D.3, E.4, F.5, G.6, H.7, I.8, J.9, K.10, L.11, M.12, N.13, O.14, P.15);
