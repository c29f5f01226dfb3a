//! The checks every GEMM call makes before the library sees it: each buffer
//! ([`Operand`]) against its operand's type, length, alignment and device, D
//! against overlap with A and B, the stream's device, and the extras
//! ([`MatmulExtras`]: bias, FP8 scales) a problem asks for.
//!
//! Invariants: a call that passed [`check`] cannot make the library read or
//! write outside the buffers it was given; every refusal names the call, the
//! problem, the operand, what was expected and what was given.

use std::sync::Arc;

use crate::context::CudaContext;
use crate::error::Result;
use crate::memory::{note_use_parts, DeviceMemory, Uses};
use crate::stream::CudaStream;

use super::error::refused;
use super::plan::{Problem, ScaleMode, OPERANDS};
use super::{BlasElement, DataType};

/// One buffer as a call checks it: its address, length, element type,
/// context and use record.
#[derive(Clone, Copy)]
pub(crate) struct Operand<'a> {
    pub(crate) ptr: u64,
    pub(crate) len: usize,
    pub(crate) ty: DataType,
    pub(crate) ctx: &'a Arc<CudaContext>,
    /// The buffer's use record (`None`: memory that keeps none).
    pub(crate) uses: Option<&'a Uses>,
}

impl<'a> Operand<'a> {
    pub(crate) fn of<T: BlasElement>(mem: &'a (impl DeviceMemory<T> + ?Sized)) -> Operand<'a> {
        Operand {
            ptr: mem.device_ptr(),
            len: mem.len(),
            ty: T::DATA_TYPE,
            ctx: mem.memory_context(),
            uses: mem.uses(),
        }
    }

    /// Note that work queued on `stream` uses this buffer (the buffer's use
    /// record, as `memory::note_use` does for a whole buffer): a buffer
    /// allocated in stream order elsewhere is waited for, and its free is
    /// ordered after this use.
    pub(crate) fn note_use(&self, stream: &CudaStream) -> Result<()> {
        note_use_parts(self.uses, self.ctx, stream)
    }

    /// Bytes from the address to the end of `elements` elements.
    fn end(&self, elements: u64) -> u64 {
        self.ptr
            .saturating_add(elements.saturating_mul(self.ty.size() as u64))
    }
}

/// The per-call extras of a plan with an epilogue bias or FP8 scales: device
/// buffers, checked against the plan like the matrices.
#[derive(Default, Clone, Copy)]
pub struct MatmulExtras<'a> {
    pub(crate) bias: Option<Operand<'a>>,
    pub(crate) scales: [Option<Operand<'a>>; 4],
    /// Whether any extra was given (so a call without any skips them in one
    /// test).
    pub(crate) any: bool,
}

impl<'a> MatmulExtras<'a> {
    /// No extras.
    pub fn new() -> MatmulExtras<'a> {
        MatmulExtras::default()
    }

    /// Note a use on `stream` of every extra given (after [`check`]).
    pub(crate) fn note_uses(&self, stream: &CudaStream) -> Result<()> {
        if !self.any {
            return Ok(());
        }
        for o in self.bias.iter().chain(self.scales.iter().flatten()) {
            o.note_use(stream)?;
        }
        Ok(())
    }

    /// The epilogue's bias vector (`m` elements per batch, of the plan's bias type).
    #[must_use]
    pub fn bias<T: BlasElement>(mut self, bias: &'a impl DeviceMemory<T>) -> MatmulExtras<'a> {
        self.bias = Some(Operand::of(bias));
        self.any = true;
        self
    }

    /// A's scale: one f32 (tensor mode) or `m` (outer-vector mode).
    #[must_use]
    pub fn a_scale(mut self, s: &'a impl DeviceMemory<f32>) -> MatmulExtras<'a> {
        self.scales[0] = Some(Operand::of(s));
        self.any = true;
        self
    }

    /// B's scale: one f32 (tensor mode) or `n` (outer-vector mode).
    #[must_use]
    pub fn b_scale(mut self, s: &'a impl DeviceMemory<f32>) -> MatmulExtras<'a> {
        self.scales[1] = Some(Operand::of(s));
        self.any = true;
        self
    }

    /// C's scale (one f32; FP8 output only).
    #[must_use]
    pub fn c_scale(mut self, s: &'a impl DeviceMemory<f32>) -> MatmulExtras<'a> {
        self.scales[2] = Some(Operand::of(s));
        self.any = true;
        self
    }

    /// D's scale (one f32; FP8 output only).
    #[must_use]
    pub fn d_scale(mut self, s: &'a impl DeviceMemory<f32>) -> MatmulExtras<'a> {
        self.scales[3] = Some(Operand::of(s));
        self.any = true;
        self
    }
}

/// Every rule a call's buffers must keep against the problem `p` of a handle
/// in `ctx`, before the library's `call`.
pub(crate) fn check(
    p: &Problem,
    ctx: &Arc<CudaContext>,
    stream: &CudaStream,
    ops: &[Operand<'_>; 4],
    extras: &MatmulExtras<'_>,
    in_place: bool,
    call: &'static str,
) -> Result<()> {
    let refuse = |what: &str, reason: String| {
        refused(
            call,
            format!("device {} {p}, {what}", ctx.ordinal()),
            reason,
        )
    };
    if !stream.context().same(ctx) {
        return Err(refuse(
            "the stream",
            format!(
                "the stream is of device {}, the plan of device {}",
                stream.ordinal(),
                ctx.ordinal()
            ),
        ));
    }
    if in_place && (p.layouts[2] != p.layouts[3] || p.types[2] != p.types[3]) {
        return Err(refuse(
            "operand D",
            format!(
                "in place, C and D must have one layout and type; the plan has C {} {} and D {} {}",
                p.layouts[2],
                p.types[2].name(),
                p.layouts[3],
                p.types[3].name()
            ),
        ));
    }
    for (i, o) in ops.iter().enumerate() {
        let l = p.layouts[i];
        // The operand's name is only written on a refusal (this runs per call).
        check_operand(ctx, o, p.types[i], p.lens[i], p.alignment).map_err(|r| {
            refuse(
                &format!("operand {}", OPERANDS[i]),
                format!("{r} (layout {l})"),
            )
        })?;
    }
    let [a, b, c, d] = *ops;
    let d_len = p.lens[3];
    for (i, o) in [a, b].iter().enumerate() {
        let len = p.lens[i];
        if overlaps(o, len, &d, d_len) {
            return Err(refuse(
                "operand D",
                format!(
                    "D ({:#x}..{:#x}) overlaps {} ({:#x}..{:#x}); D may share memory with C only",
                    d.ptr,
                    d.end(d_len),
                    OPERANDS[i],
                    o.ptr,
                    o.end(len)
                ),
            ));
        }
    }
    let c_len = p.lens[2];
    if overlaps(&c, c_len, &d, d_len) && !(c.ptr == d.ptr && p.layouts[2] == p.layouts[3]) {
        return Err(refuse(
            "operand D",
            "D overlaps C without being C (the same address and layout)".into(),
        ));
    }
    if p.extras || extras.any {
        check_extras(p, ctx, extras, &refuse)?;
    }
    Ok(())
}

/// The bias and FP8 scales of a call against those its problem asks for.
fn check_extras(
    p: &Problem,
    ctx: &Arc<CudaContext>,
    extras: &MatmulExtras<'_>,
    refuse: &impl Fn(&str, String) -> crate::error::MetraleError,
) -> Result<()> {
    // The epilogue's bias.
    match (p.bias_len(), extras.bias) {
        (Some(len), Some(o)) => {
            let t = p.bias_type.unwrap_or(p.types[3]);
            check_operand(ctx, &o, t, len, t.size())
                .map_err(|r| refuse("the bias", format!("{r} (one per row of D, m = {})", p.m)))?;
        }
        (Some(len), None) => {
            return Err(refuse(
                "the bias",
                format!(
                    "epilogue {:?} needs a bias vector of {len} elements (MatmulExtras::bias)",
                    p.epilogue
                ),
            ))
        }
        (None, Some(_)) => {
            return Err(refuse(
                "the bias",
                format!("a bias was given, but epilogue {:?} has none", p.epilogue),
            ))
        }
        (None, None) => {}
    }
    // FP8 scales: exactly those the plan asks for.
    let wanted = [
        p.scales[0].map(|m| if m == ScaleMode::OuterVector { p.m } else { 1 }),
        p.scales[1].map(|m| if m == ScaleMode::OuterVector { p.n } else { 1 }),
        p.c_scale.then_some(1),
        p.d_scale.then_some(1),
    ];
    // The scale's name is only written on a refusal (this runs per call).
    let what = |i: usize| format!("{}'s scale", OPERANDS[i]);
    for i in 0..4 {
        match (wanted[i], extras.scales[i]) {
            (Some(len), Some(o)) => {
                check_operand(ctx, &o, DataType::F32, len, 4).map_err(|r| refuse(&what(i), r))?
            }
            (Some(len), None) => {
                return Err(refuse(
                    &what(i),
                    format!(
                        "the plan scales {} and needs {len} f32 on the device",
                        OPERANDS[i]
                    ),
                ))
            }
            (None, Some(_)) => {
                return Err(refuse(
                    &what(i),
                    if i == 3 && !p.types[3].is_fp8() {
                        format!(
                            "a D scale is only for an FP8 output, and D is {}",
                            p.types[3].name()
                        )
                    } else {
                        format!("the plan has no {} scale (MatmulDesc)", OPERANDS[i])
                    },
                ))
            }
            (None, None) => {}
        }
    }
    Ok(())
}

/// One buffer against its expected type, length (elements), alignment and
/// context: what is wrong, if anything.
fn check_operand(
    ctx: &Arc<CudaContext>,
    o: &Operand<'_>,
    ty: DataType,
    len: u64,
    alignment: usize,
) -> std::result::Result<(), String> {
    if o.ty != ty {
        return Err(format!(
            "expected {} elements, the buffer holds {}",
            ty.name(),
            o.ty.name()
        ));
    }
    if !o.ctx.same(ctx) {
        return Err(format!(
            "the buffer is on device {}, the plan on device {}",
            o.ctx.ordinal(),
            ctx.ordinal()
        ));
    }
    if (o.len as u64) < len {
        return Err(format!(
            "needs at least {len} elements, the buffer has {}",
            o.len
        ));
    }
    if !o.ptr.is_multiple_of(alignment as u64) {
        return Err(format!(
            "the address {:#x} is not {alignment}-byte aligned, as the plan's algorithm needs",
            o.ptr
        ));
    }
    Ok(())
}

/// Whether the `a_len` elements at `a` and the `b_len` at `b` share a byte.
fn overlaps(a: &Operand<'_>, a_len: u64, b: &Operand<'_>, b_len: u64) -> bool {
    ranges_overlap((a.ptr, a.end(a_len)), (b.ptr, b.end(b_len)))
}

/// Whether two byte ranges `[start, end)` share a byte.
fn ranges_overlap(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.1 && b.0 < a.1
}

#[cfg(test)]
mod tests {
    use super::ranges_overlap;

    #[test]
    fn ranges_overlap_only_when_they_share_a_byte() {
        assert!(ranges_overlap((0, 16), (8, 24)));
        assert!(ranges_overlap((8, 24), (0, 16)));
        assert!(ranges_overlap((0, 16), (4, 8)), "inside");
        assert!(!ranges_overlap((0, 16), (16, 32)), "adjacent");
        assert!(!ranges_overlap((16, 32), (0, 16)));
    }
}
