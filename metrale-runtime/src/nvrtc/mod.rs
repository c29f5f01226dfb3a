//! Run-time compilation (feature `nvrtc`): CUDA C++ compiled by NVRTC into PTX,
//! cubin or LTO-IR, LTO-IR linked by nvJitLink, and a content-addressed cache of
//! both.
//!
//! This room owns:
//! - [`Program`] (`program.rs`): source, name, headers, typed options, name
//!   expressions; [`Program::compile`] / [`Program::compile_for`] give a
//!   [`Compiled`] (`output.rs`): owned bytes that [`MetraleRegistry::load_into`](crate::MetraleRegistry::load_into)
//!   loads directly, the log of warnings, and the lowered names.
//! - [`Linker`] (`link.rs`): LTO-IR, cubin, PTX and fatbin objects linked into one
//!   cubin for one architecture.
//! - [`CompileCache`] (`cache.rs`): outputs keyed by everything that decides them,
//!   in memory (bounded) and, opt-in, in a folder; `fingerprint.rs` gives the
//!   key the loaded NVRTC build (build IDs) and the include folders' listing.
//! - [`NvrtcError`] (`error.rs`): the room's error data, which fills the crate's
//!   library-error shape ([`LibraryFailure`](crate::error::LibraryFailure)), and
//!   the one function that turns it into a [`MetraleError`](crate::MetraleError).
//!
//! Invariants:
//! - NVRTC and nvJitLink handles never leave the call that created them: they
//!   are created, used and destroyed on one thread inside one function (neither
//!   library's handles are thread-safe). Every public type of the room is plain
//!   data, `Send` and `Sync` without an `unsafe impl`.
//! - What the driver will be given (PTX, cubin) has passed [`crate::blob`]'s
//!   checks before a [`Compiled`] or a linked cubin is returned.
//! - A failed compile carries NVRTC's status, the whole program log and the
//!   program's name; a failed link the linker's status and error log.
//! - The cache never hands out an entry that does not match its key and its
//!   checksum: such an entry is compiled again and replaced.
//!
//! It sits on floor 3 beside `module`: it produces blobs and uses only the
//! context's limits (for [`Program::compile_for`]) and `blob`'s checks.

mod cache;
mod error;
mod fingerprint;
mod link;
mod output;
mod program;

use std::fmt;

pub use cache::{CacheStats, CompileCache};
pub use error::{LibraryStatus, NvrtcError};
pub use link::{LinkInput, Linked, Linker};
pub use output::Compiled;
pub use program::{nvrtc_version, supported_archs, CompileOption, Program};

/// What to compile (or link) for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Target {
    /// A real architecture, `sm_XX` (90 for `sm_90`): the output is a cubin.
    Sm(u32),
    /// A virtual architecture, `compute_XX`: the output is PTX.
    Compute(u32),
}

impl Target {
    /// The architecture number (90 for both `sm_90` and `compute_90`).
    pub fn arch(self) -> u32 {
        match self {
            Target::Sm(a) | Target::Compute(a) => a,
        }
    }
}

impl fmt::Display for Target {
    /// `sm_90` / `compute_90`, as NVRTC's `--gpu-architecture` takes it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Sm(a) => write!(f, "sm_{a}"),
            Target::Compute(a) => write!(f, "compute_{a}"),
        }
    }
}
