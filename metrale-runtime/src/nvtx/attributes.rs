//! What an event carries besides its message: category, color, payload.

use metrale_cuda_sys::nvtx::{
    self as raw, nvtxColorType_t, nvtxDomainHandle_t, nvtxEventAttributes_t,
    nvtxEventAttributes_v2_payload_t, nvtxMessageType_t, nvtxMessageValue_t, nvtxPayloadType_t,
};

use super::cstr::with_cstr;
use super::RegisteredString;

/// An ARGB color (`0xAARRGGBB`), as NVTX takes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Color(u32);

impl Color {
    /// The color `0xAARRGGBB`.
    pub const fn argb(argb: u32) -> Color {
        Color(argb)
    }

    /// An opaque color from its red, green and blue parts.
    pub const fn rgb(r: u8, g: u8, b: u8) -> Color {
        Color(0xff00_0000 | ((r as u32) << 16) | ((g as u32) << 8) | (b as u32))
    }

    /// The value NVTX receives (`0xAARRGGBB`).
    pub const fn value(self) -> u32 {
        self.0
    }
}

/// A number attached to an event (NVTX's payload types).
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum Payload {
    /// `NVTX_PAYLOAD_TYPE_UNSIGNED_INT64`.
    U64(u64),
    /// `NVTX_PAYLOAD_TYPE_INT64`.
    I64(i64),
    /// `NVTX_PAYLOAD_TYPE_DOUBLE`.
    F64(f64),
    /// `NVTX_PAYLOAD_TYPE_UNSIGNED_INT32`.
    U32(u32),
    /// `NVTX_PAYLOAD_TYPE_INT32`.
    I32(i32),
    /// `NVTX_PAYLOAD_TYPE_FLOAT`.
    F32(f32),
}

macro_rules! payload_from {
    ($($ty:ty => $variant:ident),*) => {$(
        impl From<$ty> for Payload {
            fn from(v: $ty) -> Payload {
                Payload::$variant(v)
            }
        }
    )*};
}
payload_from!(u64 => U64, i64 => I64, f64 => F64, u32 => U32, i32 => I32, f32 => F32);

impl Payload {
    fn raw(self) -> (nvtxPayloadType_t, nvtxEventAttributes_v2_payload_t) {
        let mut value = nvtxEventAttributes_v2_payload_t { ullValue: 0 };
        let ty = match self {
            Payload::U64(v) => {
                value.ullValue = v;
                nvtxPayloadType_t::NVTX_PAYLOAD_TYPE_UNSIGNED_INT64
            }
            Payload::I64(v) => {
                value.llValue = v;
                nvtxPayloadType_t::NVTX_PAYLOAD_TYPE_INT64
            }
            Payload::F64(v) => {
                value.dValue = v;
                nvtxPayloadType_t::NVTX_PAYLOAD_TYPE_DOUBLE
            }
            Payload::U32(v) => {
                value.uiValue = v;
                nvtxPayloadType_t::NVTX_PAYLOAD_TYPE_UNSIGNED_INT32
            }
            Payload::I32(v) => {
                value.iValue = v;
                nvtxPayloadType_t::NVTX_PAYLOAD_TYPE_INT32
            }
            Payload::F32(v) => {
                value.fValue = v;
                nvtxPayloadType_t::NVTX_PAYLOAD_TYPE_FLOAT
            }
        };
        (ty, value)
    }
}

/// The message of an event.
#[derive(Debug, Clone, Copy, Default)]
enum Message<'a> {
    #[default]
    None,
    Text(&'a str),
    Registered(&'a RegisteredString<'a>),
}

/// What a mark or range carries: a message, a category, a color, a payload.
/// A builder; every part is optional.
///
/// ```
/// use metrale_runtime::nvtx::{self, Color, EventAttributes};
/// let step = EventAttributes::new()
///     .message("step")
///     .category(2)
///     .color(Color::rgb(0x76, 0xb9, 0x00))
///     .payload(17u64);
/// let _r = nvtx::range_with(&step);
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct EventAttributes<'a> {
    message: Message<'a>,
    category: u32,
    color: Option<Color>,
    payload: Option<Payload>,
}

impl<'a> EventAttributes<'a> {
    /// No message, category 0, no color, no payload.
    pub const fn new() -> EventAttributes<'a> {
        EventAttributes {
            message: Message::None,
            category: 0,
            color: None,
            payload: None,
        }
    }

    /// The message (cut at an interior NUL, as C reads it).
    pub const fn message(mut self, text: &'a str) -> Self {
        self.message = Message::Text(text);
        self
    }

    /// A string registered with a [`Domain`](super::Domain) as the message: with
    /// that domain's calls the tool gets the handle, with any other its text.
    pub const fn registered(mut self, string: &'a RegisteredString<'a>) -> Self {
        self.message = Message::Registered(string);
        self
    }

    /// The category (named with [`name_category`](super::name_category)).
    pub const fn category(mut self, id: u32) -> Self {
        self.category = id;
        self
    }

    /// The color.
    pub const fn color(mut self, color: Color) -> Self {
        self.color = Some(color);
        self
    }

    /// The payload (`u64`, `i64`, `f64`, `u32`, `i32` or `f32`).
    pub fn payload(mut self, value: impl Into<Payload>) -> Self {
        self.payload = Some(value.into());
        self
    }

    /// Call `f` with the NVTX structure of these attributes for a call in
    /// `domain` (null: the core calls), valid during the call.
    pub(crate) fn with_raw<R>(
        &self,
        domain: nvtxDomainHandle_t,
        f: impl FnOnce(*const nvtxEventAttributes_t) -> R,
    ) -> R {
        let (payload_type, payload) = self.payload.map_or(
            (
                nvtxPayloadType_t::NVTX_PAYLOAD_UNKNOWN,
                nvtxEventAttributes_v2_payload_t { ullValue: 0 },
            ),
            Payload::raw,
        );
        let (color_type, color) = match self.color {
            Some(c) => (nvtxColorType_t::NVTX_COLOR_ARGB, c.value()),
            None => (nvtxColorType_t::NVTX_COLOR_UNKNOWN, 0),
        };
        let mut attrs = nvtxEventAttributes_t {
            version: raw::NVTX_VERSION as u16,
            size: raw::EVENT_ATTRIB_STRUCT_SIZE,
            category: self.category,
            colorType: color_type.0 as i32,
            color,
            payloadType: payload_type.0 as i32,
            reserved0: 0,
            payload,
            messageType: nvtxMessageType_t::NVTX_MESSAGE_UNKNOWN.0 as i32,
            message: nvtxMessageValue_t {
                ascii: std::ptr::null(),
            },
        };
        let ascii = |attrs: &mut nvtxEventAttributes_t, text: *const std::ffi::c_char| {
            attrs.messageType = nvtxMessageType_t::NVTX_MESSAGE_TYPE_ASCII.0 as i32;
            attrs.message = nvtxMessageValue_t { ascii: text };
        };
        match self.message {
            Message::None => f(&attrs),
            Message::Text(text) => with_cstr(text, |p| {
                ascii(&mut attrs, p);
                f(&attrs)
            }),
            Message::Registered(s) if s.domain_handle() == domain && !domain.is_null() => {
                attrs.messageType = nvtxMessageType_t::NVTX_MESSAGE_TYPE_REGISTERED.0 as i32;
                attrs.message = nvtxMessageValue_t {
                    registered: s.handle(),
                };
                f(&attrs)
            }
            Message::Registered(s) => {
                ascii(&mut attrs, s.text_ptr());
                f(&attrs)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colors_are_argb() {
        assert_eq!(Color::rgb(0x12, 0x34, 0x56).value(), 0xff12_3456);
        assert_eq!(Color::argb(0x8000_ff00).value(), 0x8000_ff00);
    }

    #[test]
    fn the_structure_carries_every_part() {
        let attrs = EventAttributes::new()
            .message("m")
            .category(7)
            .color(Color::argb(0x0102_0304))
            .payload(-3i32);
        attrs.with_raw(std::ptr::null_mut(), |a| {
            // SAFETY: with_raw hands a structure valid during the call.
            let a = unsafe { &*a };
            assert_eq!(a.version, 3);
            assert_eq!(
                usize::from(a.size),
                std::mem::size_of::<nvtxEventAttributes_t>()
            );
            assert_eq!(a.category, 7);
            assert_eq!(a.colorType, 1);
            assert_eq!(a.color, 0x0102_0304);
            assert_eq!(a.payloadType, 5);
            // SAFETY: an i32 payload was written; the union was zeroed first.
            assert_eq!(unsafe { a.payload.ullValue }, u64::from((-3i32) as u32));
            assert_eq!(a.messageType, 1);
        });
        EventAttributes::new().with_raw(std::ptr::null_mut(), |a| {
            // SAFETY: as above.
            let a = unsafe { &*a };
            assert_eq!((a.colorType, a.payloadType, a.messageType), (0, 0, 0));
        });
    }
}
