//! [`DeviceSymbol`]: a typed view of a module's `__device__` global.

use std::any::Any;
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use metrale_cuda_sys::CUdeviceptr;

use super::{sealed, DeviceMemory, DeviceMemoryMut, DevicePod, DeviceRepr};
use crate::context::CudaContext;
use crate::error::{invalid_arg, ErrorKind, Result};
use crate::stream::CudaStream;

/// A `__device__` global of a loaded module, seen as `len` elements of `T` (one
/// for a scalar, `N` for an array). Its size was checked against `T` when it was
/// looked up; it keeps its module loaded.
///
/// Read and write it with its own methods (which wait), or use it like any device
/// memory: as a copy source or target ([`CudaStream::copy_h2d_pinned`] for an async
/// write), or a kernel argument.
///
/// ```no_run
/// # use metrale_runtime::MetraleRegistry;
/// # fn main() -> metrale_runtime::Result<()> {
/// # let reg = MetraleRegistry::load(0, &[("tq", b"...")])?;
/// // __device__ float tq_plus::d_innerq_scale[64]; (a C++ namespace: mangled name)
/// let scale = reg.symbol_array::<f32>("tq", "_ZN7tq_plus14d_innerq_scaleE", 64)?;
/// scale.write(reg.stream(), &[1.0; 64])?;
/// assert_eq!(scale.read(reg.stream())?, vec![1.0; 64]);
/// # Ok(()) }
/// ```
pub struct DeviceSymbol<T: DeviceRepr> {
    ptr: CUdeviceptr,
    len: usize,
    ctx: Arc<CudaContext>,
    name: Arc<str>,
    _module: Arc<dyn Any + Send + Sync>,
    _elem: PhantomData<T>,
}

impl<T: DeviceRepr> DeviceSymbol<T> {
    /// A view of `len` elements at `ptr`, checked against the symbol's `bytes`.
    pub(crate) fn new(
        ptr: CUdeviceptr,
        bytes: usize,
        len: usize,
        ctx: &Arc<CudaContext>,
        (module, symbol): (&str, &str),
        keep: Arc<dyn Any + Send + Sync>,
    ) -> Result<DeviceSymbol<T>> {
        let type_bytes = len.checked_mul(std::mem::size_of::<T>());
        if type_bytes != Some(bytes) {
            return Err(ErrorKind::SymbolSize {
                module: module.to_owned(),
                symbol: symbol.to_owned(),
                symbol_bytes: bytes,
                type_name: std::any::type_name::<T>(),
                elements: len,
                type_bytes: type_bytes.unwrap_or(usize::MAX),
            }
            .into());
        }
        super::device::check_alignment::<T>(ptr, symbol)?;
        Ok(DeviceSymbol {
            ptr,
            len,
            ctx: Arc::clone(ctx),
            name: Arc::from(format!("{module}::{symbol}")),
            _module: keep,
            _elem: PhantomData,
        })
    }

    /// `module::symbol`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the symbol has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address.
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// Write `values` (all `len` elements), ordered on `stream`, and wait.
    ///
    /// # Errors
    /// As [`CudaStream::copy_h2d`].
    pub fn write(&self, stream: &CudaStream, values: &[T]) -> Result<()> {
        let mut view = self.view();
        stream.copy_h2d(values, &mut view)
    }

    /// Write a scalar symbol (`len` 1), ordered on `stream`, and wait.
    ///
    /// # Errors
    /// As [`DeviceSymbol::write`].
    pub fn set(&self, stream: &CudaStream, value: T) -> Result<()> {
        self.write(stream, std::slice::from_ref(&value))
    }

    fn view(&self) -> SymbolView<'_, T> {
        SymbolView(self)
    }
}

impl<T: DevicePod> DeviceSymbol<T> {
    /// All elements, read after the work already on `stream`.
    ///
    /// # Errors
    /// As [`CudaStream::to_vec`].
    pub fn read(&self, stream: &CudaStream) -> Result<Vec<T>> {
        stream.to_vec(self)
    }

    /// The value of a scalar symbol (`len` 1), read after the work on `stream`.
    ///
    /// # Errors
    /// `InvalidArgument` for an array symbol; as [`DeviceSymbol::read`].
    pub fn get(&self, stream: &CudaStream) -> Result<T> {
        let mut v = self.read(stream)?;
        match (v.pop(), v.is_empty()) {
            (Some(x), true) => Ok(x),
            _ => Err(invalid_arg(format!(
                "{}: get() of a symbol of {} elements; use read()",
                self.name, self.len
            ))),
        }
    }
}

/// Writes through a shared symbol handle: the symbol is module memory, shared by
/// design (several handles may name it); writes are ordered on streams.
struct SymbolView<'a, T: DeviceRepr>(&'a DeviceSymbol<T>);

impl<T: DeviceRepr> sealed::Sealed for SymbolView<'_, T> {
    fn address_ref(&self) -> &CUdeviceptr {
        &self.0.ptr
    }
}
impl<T: DeviceRepr> DeviceMemory<T> for SymbolView<'_, T> {
    fn device_ptr(&self) -> CUdeviceptr {
        self.0.ptr
    }
    fn len(&self) -> usize {
        self.0.len
    }
    fn memory_context(&self) -> &Arc<CudaContext> {
        &self.0.ctx
    }
    fn describe(&self) -> String {
        self.0.describe()
    }
}
impl<T: DeviceRepr> sealed::SealedMut for SymbolView<'_, T> {}
impl<T: DeviceRepr> DeviceMemoryMut<T> for SymbolView<'_, T> {}

impl<T: DeviceRepr> sealed::Sealed for DeviceSymbol<T> {
    fn address_ref(&self) -> &CUdeviceptr {
        &self.ptr
    }
}
impl<T: DeviceRepr> DeviceMemory<T> for DeviceSymbol<T> {
    fn device_ptr(&self) -> CUdeviceptr {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn memory_context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    fn describe(&self) -> String {
        format!(
            "symbol {} ({} x {})",
            self.name,
            self.len,
            std::any::type_name::<T>()
        )
    }
}
impl<T: DeviceRepr> sealed::SealedMut for DeviceSymbol<T> {}
impl<T: DeviceRepr> DeviceMemoryMut<T> for DeviceSymbol<T> {}

impl<T: DeviceRepr> fmt::Debug for DeviceSymbol<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceSymbol")
            .field("name", &self.name)
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}
