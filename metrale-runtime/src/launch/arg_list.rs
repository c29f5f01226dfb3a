//! [`KernelArgList`]: a kernel's arguments built at run time (from a manifest, from
//! the kernel's own parameter layout), checked at launch exactly as a tuple is.
//!
//! Invariants:
//! - The list owns a copy of each argument's bytes, each at an offset of its own
//!   storage aligned as the argument (up to 64 bytes); the borrows the arguments
//!   carried (`&buf`, `&mut buf`, slices, tensor maps) are held for the list's
//!   lifetime `'a`, so the memory they name cannot be dropped, or used mutably
//!   elsewhere, while the list may still be launched.
//! - Launching allocates nothing: the pointer array the driver reads is kept in
//!   the list with room for every argument, and filled per launch. Only a
//!   re-entrant use of one list (a launch from inside its own `with_params`) makes
//!   a temporary array.
//! - `clear` and `recycle` keep every allocation: a list rebuilt to the same shape
//!   allocates nothing.

use std::cell::Cell;
use std::ffi::c_void;
use std::fmt;
use std::marker::PhantomData;

use super::args::{ArgLayout, KernelArg, KernelArgs, NullPtr};
use super::tensor_map::{TensorElement, TensorMap};
use crate::error::{invalid_arg, Result};

/// The storage's unit: 64 bytes at a 64-byte aligned address, so each argument
/// can be stored aligned as its type (tensor maps included).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Block([u8; BLOCK]);

const BLOCK: usize = 64;

/// The largest alignment [`KernelArgList::push_bytes`] accepts (a kernel
/// parameter's alignment is far below it).
pub const MAX_ARG_ALIGN: usize = 4096;

/// A kernel's arguments built at run time: typed values, metrale's device memory
/// (with the same borrows a tuple takes), null pointers, tensor maps by value and
/// raw bytes of a stated size and alignment. Launched as `&list` wherever a tuple
/// goes ([`CudaStream::launch`](crate::CudaStream::launch), the registry's
/// `launch`, graph kernel nodes and their updates) and checked the same way
/// against the kernel's parameter layout: the count and each size. Alignment
/// is not compared at launch (each argument's bytes go to the offset the driver
/// reports); it is kept to store each argument aligned as its type, and
/// [`set`](KernelArgList::set) compares it with the argument it replaces.
///
/// Each argument's bytes are copied when it is pushed (a device address, for
/// memory). Build it once and launch it many times: launching allocates nothing, and
/// [`clear`](KernelArgList::clear) (or [`recycle`](KernelArgList::recycle), to
/// borrow other memory) keeps its allocations, so a list rebuilt to the same shape
/// allocates nothing either. [`set`](KernelArgList::set) replaces one argument in
/// place. A list is `Send`, not `Sync`: one thread launches it at a time.
///
/// ```
/// use metrale_runtime::{KernelArgList, NullPtr};
/// let mut args = KernelArgList::new();
/// args.push(7u32).push(2.5f64).push(NullPtr);
/// args.push_bytes(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], 4)?; // a struct { int x, y, z; }
/// assert_eq!(args.len(), 4);
/// assert_eq!(args.sizes(), [4, 8, 8, 12]);
/// assert_eq!(args.aligns(), [4, 8, 8, 4]);
/// args.set(0, 9u32)?;                                    // same size and alignment
/// assert!(args.set(0, 9u64).is_err());                   // not a u32 any more
/// # Ok::<(), metrale_runtime::MetraleError>(())
/// ```
pub struct KernelArgList<'a> {
    storage: Vec<Block>,
    /// Bytes of `storage` in use.
    used: usize,
    offsets: Vec<usize>,
    sizes: Vec<usize>,
    aligns: Vec<usize>,
    /// The pointer array of a launch, taken out for the call and put back after;
    /// its capacity covers every argument.
    scratch: Cell<Vec<*mut c_void>>,
    /// The borrows of the memory the arguments name.
    _borrows: PhantomData<&'a ()>,
}

// SAFETY: the list owns plain bytes; the raw pointers in `scratch` point into its
// own storage and are rewritten before every use, so moving the list to another
// thread moves everything they point to with it. The borrows it holds are only of
// device addresses (never dereferenced on the host).
unsafe impl Send for KernelArgList<'_> {}

impl Default for KernelArgList<'_> {
    fn default() -> Self {
        KernelArgList::new()
    }
}

impl fmt::Debug for KernelArgList<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KernelArgList")
            .field("sizes", &self.sizes)
            .field("aligns", &self.aligns)
            .finish()
    }
}

impl<'a> KernelArgList<'a> {
    /// An empty list (allocates nothing until the first push).
    pub fn new() -> KernelArgList<'a> {
        KernelArgList {
            storage: Vec::new(),
            used: 0,
            offsets: Vec::new(),
            sizes: Vec::new(),
            aligns: Vec::new(),
            scratch: Cell::new(Vec::new()),
            _borrows: PhantomData,
        }
    }

    /// An empty list with room for `args` arguments of `bytes` bytes in all.
    pub fn with_capacity(args: usize, bytes: usize) -> KernelArgList<'a> {
        let mut list = KernelArgList::new();
        list.reserve(args, bytes);
        list
    }

    /// Room for `args` more arguments of `bytes` more bytes (alignment padding
    /// aside).
    pub fn reserve(&mut self, args: usize, bytes: usize) {
        let blocks = self.used.saturating_add(bytes).div_ceil(BLOCK);
        self.storage
            .reserve(blocks.saturating_sub(self.storage.len()));
        self.offsets.reserve(args);
        self.sizes.reserve(args);
        self.aligns.reserve(args);
        let want = self.offsets.len().saturating_add(args);
        let scratch = self.scratch.get_mut();
        scratch.reserve(want.saturating_sub(scratch.len()));
    }

    /// Append an argument: a value (`DeviceRepr`: `7u32`, `2.5f64`, a `#[repr(C)]`
    /// struct), device memory as its address (`&buf`, `&mut buf`, a slice, with
    /// the borrow held as long as the list), [`NullPtr`], or a `&TensorMap` — any
    /// [`KernelArg`], with the size and alignment it has in a tuple.
    pub fn push<A: KernelArg<K> + 'a, K>(&mut self, arg: A) -> &mut Self {
        self.append(&arg, A::SIZE, A::ALIGN);
        self
    }

    /// Append a null device pointer (8 zero bytes, aligned as a pointer).
    pub fn push_null(&mut self) -> &mut Self {
        self.push(NullPtr)
    }

    /// Append a tensor map by value (its 128 bytes, 64-byte aligned, as a
    /// `const __grid_constant__ CUtensorMap` parameter takes it). The list holds
    /// the borrow of the memory the map describes, not of the map.
    pub fn push_tensor_map<T: TensorElement>(&mut self, map: &TensorMap<'a, T>) -> &mut Self {
        self.append(&map, <&TensorMap<'a, T>>::SIZE, <&TensorMap<'a, T>>::ALIGN);
        self
    }

    /// Append `bytes` as one argument aligned to `align` bytes (a struct the list
    /// has no Rust type for: `push_bytes(&s, 4)` for `struct { int x, y, z; }`).
    ///
    /// # Errors
    /// `InvalidArgument` when `bytes` is empty (a kernel parameter has at least one
    /// byte) or `align` is not a power of two up to [`MAX_ARG_ALIGN`]; the list is
    /// unchanged.
    pub fn push_bytes(&mut self, bytes: &[u8], align: usize) -> Result<&mut Self> {
        let index = self.len();
        check_bytes(index, bytes.len(), align)?;
        self.append_bytes(bytes, align);
        Ok(self)
    }

    /// Replace argument `index` with `arg`, which must have the same size and
    /// alignment (a new scalar or buffer for the next launch, nothing allocated).
    ///
    /// # Errors
    /// `InvalidArgument` for an index past the end or a different size or
    /// alignment, saying which; the list is unchanged.
    pub fn set<A: KernelArg<K> + 'a, K>(&mut self, index: usize, arg: A) -> Result<()> {
        self.check_slot(index, A::SIZE, A::ALIGN)?;
        let src = param_bytes(&arg, A::SIZE);
        let at = self.offsets[index];
        self.bytes_mut()[at..at + A::SIZE].copy_from_slice(src);
        Ok(())
    }

    /// Replace argument `index` with `bytes` of alignment `align`, as
    /// [`KernelArgList::set`].
    ///
    /// # Errors
    /// As [`KernelArgList::set`].
    pub fn set_bytes(&mut self, index: usize, bytes: &[u8], align: usize) -> Result<()> {
        self.check_slot(index, bytes.len(), align)?;
        let at = self.offsets[index];
        self.bytes_mut()[at..at + bytes.len()].copy_from_slice(bytes);
        Ok(())
    }

    /// Number of arguments.
    pub fn len(&self) -> usize {
        self.offsets.len()
    }

    /// Whether the list has no arguments.
    pub fn is_empty(&self) -> bool {
        self.offsets.is_empty()
    }

    /// Each argument's size in bytes.
    pub fn sizes(&self) -> &[usize] {
        &self.sizes
    }

    /// Each argument's alignment in bytes.
    pub fn aligns(&self) -> &[usize] {
        &self.aligns
    }

    /// The bytes of argument `index` (`None` past the end).
    pub fn arg_bytes(&self, index: usize) -> Option<&[u8]> {
        let (&at, &size) = (self.offsets.get(index)?, self.sizes.get(index)?);
        self.bytes().get(at..at + size)
    }

    /// Remove every argument, keeping the allocations (the borrows stay held
    /// until the list is dropped; [`KernelArgList::recycle`] ends them).
    pub fn clear(&mut self) {
        self.used = 0;
        self.offsets.clear();
        self.sizes.clear();
        self.aligns.clear();
    }

    /// This list, emptied, for arguments of another lifetime: the borrows end and
    /// the allocations are kept.
    pub fn recycle<'b>(mut self) -> KernelArgList<'b> {
        self.clear();
        KernelArgList {
            storage: self.storage,
            used: 0,
            offsets: self.offsets,
            sizes: self.sizes,
            aligns: self.aligns,
            scratch: self.scratch,
            _borrows: PhantomData,
        }
    }

    fn check_slot(&self, index: usize, size: usize, align: usize) -> Result<()> {
        let (Some(&had), Some(&had_align)) = (self.sizes.get(index), self.aligns.get(index)) else {
            return Err(invalid_arg(format!(
                "kernel argument list: no argument {index} to replace (the list has {})",
                self.len()
            )));
        };
        check_bytes(index, size, align)?;
        if had != size || had_align != align {
            return Err(invalid_arg(format!(
                "kernel argument list: argument {index} is {had} bytes aligned to {had_align}, \
                 its replacement {size} bytes aligned to {align}"
            )));
        }
        Ok(())
    }

    fn append<A: KernelArg<K>, K>(&mut self, arg: &A, size: usize, align: usize) {
        self.append_bytes(param_bytes(arg, size), align);
    }

    fn append_bytes(&mut self, bytes: &[u8], align: usize) {
        let place = align.clamp(1, BLOCK);
        let at = self.used.next_multiple_of(place);
        let end = at + bytes.len();
        let blocks = end.div_ceil(BLOCK);
        if self.storage.len() < blocks {
            self.storage.resize(blocks, Block([0; BLOCK]));
        }
        self.bytes_mut()[at..end].copy_from_slice(bytes);
        self.used = end;
        self.offsets.push(at);
        self.sizes.push(bytes.len());
        self.aligns.push(align);
        let n = self.offsets.len();
        let scratch = self.scratch.get_mut();
        scratch.reserve(n.saturating_sub(scratch.len()));
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `Block` is a `repr(C)` byte array with no padding, so the
        // storage's blocks are `len * BLOCK` initialised bytes, borrowed with `self`.
        unsafe {
            std::slice::from_raw_parts(
                self.storage.as_ptr().cast::<u8>(),
                self.storage.len() * BLOCK,
            )
        }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, borrowed mutably with `self`.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.storage.as_mut_ptr().cast::<u8>(),
                self.storage.len() * BLOCK,
            )
        }
    }
}

/// The `size` bytes a kernel argument passes.
fn param_bytes<A: KernelArg<K>, K>(arg: &A, size: usize) -> &[u8] {
    // SAFETY: the KernelArg contract: `param_ptr` points to `SIZE` (= `size`) bytes
    // of the value, valid while `arg` is borrowed, which the result is.
    unsafe { std::slice::from_raw_parts(arg.param_ptr().cast::<u8>().cast_const(), size) }
}

fn check_bytes(index: usize, size: usize, align: usize) -> Result<()> {
    if size == 0 {
        return Err(invalid_arg(format!(
            "kernel argument list: argument {index} has no bytes (a kernel parameter has at least one)"
        )));
    }
    if !align.is_power_of_two() || align > MAX_ARG_ALIGN {
        return Err(invalid_arg(format!(
            "kernel argument list: argument {index}: alignment {align} is not a power of two \
             from 1 to {MAX_ARG_ALIGN}"
        )));
    }
    Ok(())
}

// SAFETY: one pointer per argument, in order, each to that argument's bytes in the
// list's storage (offsets and sizes recorded when it was pushed lie inside it),
// valid while the list is borrowed, which covers the call; `layout` lists the same
// arguments' sizes and alignments.
unsafe impl KernelArgs<()> for &KernelArgList<'_> {
    const SIZES: &'static [usize] = &[];

    #[inline]
    fn with_params<R>(&self, f: impl FnOnce(&mut [*mut c_void]) -> R) -> R {
        let list: &KernelArgList<'_> = self;
        // Taken out of the cell: a re-entrant use finds it empty and fills its own.
        let mut ptrs = list.scratch.take();
        ptrs.clear();
        let base = list.storage.as_ptr().cast::<u8>();
        ptrs.extend(
            list.offsets
                .iter()
                .map(|&at| base.wrapping_add(at).cast_mut().cast::<c_void>()),
        );
        let out = f(&mut ptrs);
        list.scratch.set(ptrs);
        out
    }

    #[inline]
    fn layout(&self) -> ArgLayout<'_> {
        ArgLayout::new(&self.sizes, &self.aligns)
    }
}
