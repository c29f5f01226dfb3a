//! How an operand is stored ([`MatrixLayout`]: size, leading dimension,
//! order, batches), what is done to the product ([`Epilogue`]) and how an FP8
//! operand is scaled ([`ScaleMode`]).
//!
//! Invariants: a layout's extent and required length are computed with
//! checked arithmetic (`None` on overflow, which the problem's check refuses).

use std::fmt;

use super::Order;

/// The layout of one operand: its stored size, leading dimension, order and
/// batches (counts and strides in elements).
///
/// The constructors take `usize`, as buffer lengths are; a count beyond what
/// cuBLASLt holds (a batch count above `i32::MAX`, a leading dimension or
/// stride above `i64::MAX`) is kept as "too large" and refused by the plan's
/// check, naming the limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MatrixLayout {
    /// Rows as stored.
    pub rows: u64,
    /// Columns as stored.
    pub cols: u64,
    /// Elements from one column to the next ([`Order::Col`]) or one row to
    /// the next ([`Order::Row`]).
    pub ld: u64,
    /// The storage order.
    pub order: Order,
    /// How many matrices (1: not batched).
    pub batch_count: u32,
    /// Elements from one matrix of the batch to the next (0: every batch
    /// reads the same matrix; not for D).
    pub batch_stride: u64,
}

/// A `usize` count as the `u64` cuBLASLt takes (lossless: `usize` is at most
/// 64 bits on every target metrale builds for).
pub(crate) const fn wide(x: usize) -> u64 {
    x as u64
}

/// A `usize` count as a `u32` field, `u32::MAX` when it does not fit (above
/// the `i32::MAX` the check allows, so refused there).
pub(crate) const fn narrow(x: usize) -> u32 {
    if x > u32::MAX as usize {
        u32::MAX
    } else {
        x as u32
    }
}

impl MatrixLayout {
    /// A packed column-major `rows x cols` matrix (`ld = rows`), not batched.
    pub const fn col_major(rows: usize, cols: usize) -> MatrixLayout {
        let (rows, cols) = (wide(rows), wide(cols));
        MatrixLayout {
            rows,
            cols,
            ld: rows,
            order: Order::Col,
            batch_count: 1,
            batch_stride: 0,
        }
    }

    /// A packed row-major `rows x cols` matrix (`ld = cols`), not batched.
    pub const fn row_major(rows: usize, cols: usize) -> MatrixLayout {
        let (rows, cols) = (wide(rows), wide(cols));
        MatrixLayout {
            rows,
            cols,
            ld: cols,
            order: Order::Row,
            batch_count: 1,
            batch_stride: 0,
        }
    }

    /// This layout with leading dimension `ld`.
    #[must_use]
    pub const fn with_ld(mut self, ld: usize) -> MatrixLayout {
        self.ld = wide(ld);
        self
    }

    /// This layout as a batch of `count` matrices `stride` elements apart.
    #[must_use]
    pub const fn with_batch(mut self, count: usize, stride: usize) -> MatrixLayout {
        self.batch_count = narrow(count);
        self.batch_stride = wide(stride);
        self
    }

    /// Elements one matrix spans from its first to its last element (`None`
    /// when that overflows).
    pub fn extent(&self) -> Option<u64> {
        let (lines, within) = match self.order {
            Order::Col => (self.cols, self.rows),
            Order::Row => (self.rows, self.cols),
        };
        lines
            .checked_sub(1)?
            .checked_mul(self.ld)?
            .checked_add(within)
    }

    /// Elements a buffer must hold for every matrix of the batch (`None` when
    /// that overflows).
    pub fn required_len(&self) -> Option<u64> {
        let last = u64::from(self.batch_count.checked_sub(1)?).checked_mul(self.batch_stride)?;
        last.checked_add(self.extent()?)
    }

    /// The rule `ld` must keep: `None` when it holds, else what is wrong.
    pub(crate) fn ld_problem(&self) -> Option<String> {
        let (need, what) = match self.order {
            Order::Col => (self.rows, "rows"),
            Order::Row => (self.cols, "columns"),
        };
        (self.ld < need.max(1)).then(|| {
            format!(
                "ld {} is less than its {what} ({need}) in {:?} order",
                self.ld, self.order
            )
        })
    }
}

impl fmt::Display for MatrixLayout {
    /// `64x32 col ld 64` (and `, batch 8 stride 2048`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let order = match self.order {
            Order::Col => "col",
            Order::Row => "row",
        };
        write!(f, "{}x{} {order} ld {}", self.rows, self.cols, self.ld)?;
        if self.batch_count != 1 {
            write!(
                f,
                ", batch {} stride {}",
                self.batch_count, self.batch_stride
            )?;
        }
        Ok(())
    }
}

/// What is done to the product before it is written to D.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Epilogue {
    /// Nothing (`CUBLASLT_EPILOGUE_DEFAULT`).
    #[default]
    None,
    /// `max(x, 0)`.
    Relu,
    /// GELU (tanh approximation).
    Gelu,
    /// `x + bias[row]`: a bias vector of one element per row of D (`m`).
    Bias,
    /// `max(x + bias[row], 0)`.
    ReluBias,
    /// `gelu(x + bias[row])`.
    GeluBias,
}

impl Epilogue {
    /// The library's code.
    pub const fn raw(self) -> u32 {
        match self {
            Epilogue::None => 1,
            Epilogue::Relu => 2,
            Epilogue::Bias => 4,
            Epilogue::ReluBias => 6,
            Epilogue::Gelu => 32,
            Epilogue::GeluBias => 36,
        }
    }

    /// Whether it takes a bias vector.
    pub const fn has_bias(self) -> bool {
        matches!(
            self,
            Epilogue::Bias | Epilogue::ReluBias | Epilogue::GeluBias
        )
    }
}

/// How an FP8 operand's scale is given (a device pointer at each call).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ScaleMode {
    /// One f32 for the whole tensor (`CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F`).
    Tensor,
    /// One f32 per row of op(A), or per column of op(B)
    /// (`CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F`; cuBLAS 12.9+ on GPUs
    /// that support it: the heuristic finds no algorithm elsewhere).
    OuterVector,
}

impl ScaleMode {
    /// The library's code.
    pub const fn raw(self) -> i32 {
        match self {
            ScaleMode::Tensor => 0,
            ScaleMode::OuterVector => 3,
        }
    }
}

/// How an algorithm that splits the `k` dimension (split-K) may add up its
/// partial products, and so how exact a plan's result is.
///
/// The default, [`Reduction::Exact`], lets the heuristic choose only
/// algorithms that add partial sums in the compute type (f32 for every
/// default plan) or do not split at all
/// (`CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK` = compute type): the result
/// is rounded to D's type once, at the end. This is PyTorch's behaviour with
/// `allow_bf16_reduced_precision_reduction` (and its f16 twin) set to `False`.
///
/// [`Reduction::ReducedPrecision`] allows every scheme, including partial
/// sums added in D's type (in place in D, or in the workspace): for bf16 or
/// f16 outputs each partial sum is rounded, so elements can be several ulps
/// off; it is sometimes faster. PyTorch's default (`True`) is this.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Reduction {
    /// Partial sums in the compute type, or no split (the default).
    #[default]
    Exact,
    /// Any reduction scheme, including partial sums in the output type.
    ReducedPrecision,
}

impl Reduction {
    /// The `CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK` it sets: the compute
    /// type's scheme only (no split is always allowed), or every scheme.
    pub const fn scheme_mask(self) -> u32 {
        match self {
            // CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE (| SCHEME_NONE, which is 0).
            Reduction::Exact => 2,
            // CUBLASLT_REDUCTION_SCHEME_MASK: in place, compute type, output type.
            Reduction::ReducedPrecision => 7,
        }
    }
}
