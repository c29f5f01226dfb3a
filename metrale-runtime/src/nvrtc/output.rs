//! [`Compiled`]: what one compile produced (PTX, cubin, LTO-IR as owned bytes,
//! the log, the lowered names); a [`NamedBlob`] the registry loads directly.

use std::fmt;

use crate::module::NamedBlob;

use super::Target;

/// What one compile produced, as owned bytes.
///
/// It is a [`NamedBlob`] (the program's name, and the cubin, else the PTX), so
/// [`MetraleRegistry::load_into`](crate::MetraleRegistry::load_into) loads it
/// directly.
#[derive(Clone, PartialEq, Eq)]
pub struct Compiled {
    pub(crate) name: String,
    pub(crate) target: Target,
    pub(crate) ptx: Option<Vec<u8>>,
    pub(crate) cubin: Option<Vec<u8>>,
    pub(crate) lto_ir: Option<Vec<u8>>,
    pub(crate) log: String,
    pub(crate) lowered: Vec<(String, String)>,
}

impl Compiled {
    /// The program's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// What it was compiled for.
    pub fn target(&self) -> Target {
        self.target
    }

    /// The PTX text (without a trailing NUL), when it was produced.
    pub fn ptx(&self) -> Option<&[u8]> {
        self.ptx.as_deref()
    }

    /// The ELF cubin, when compiled for a real architecture.
    pub fn cubin(&self) -> Option<&[u8]> {
        self.cubin.as_deref()
    }

    /// The LTO-IR, when compiled with [`Program::lto`](super::Program::lto).
    pub fn lto_ir(&self) -> Option<&[u8]> {
        self.lto_ir.as_deref()
    }

    /// The program log of the successful compile (warnings); empty when there were
    /// none.
    pub fn log(&self) -> &str {
        &self.log
    }

    /// The lowered (mangled) name of a name expression added with
    /// [`Program::name_expression`](super::Program::name_expression), as written there.
    pub fn lowered_name(&self, expression: &str) -> Option<&str> {
        self.lowered
            .iter()
            .find(|(e, _)| e == expression)
            .map(|(_, l)| l.as_str())
    }

    /// Every name expression and its lowered name, in the order added.
    pub fn lowered_names(&self) -> impl Iterator<Item = (&str, &str)> {
        self.lowered.iter().map(|(e, l)| (e.as_str(), l.as_str()))
    }

    /// The architecture the cubin's ELF header records (90 for sm_90).
    pub fn cubin_arch(&self) -> Option<u32> {
        self.cubin
            .as_deref()
            .and_then(crate::blob::elf_info)
            .map(crate::blob::ElfInfo::sm)
    }

    /// The blob a module is loaded from: the cubin, else the PTX; empty for an
    /// LTO-IR-only output (link it first).
    pub fn blob(&self) -> &[u8] {
        self.cubin
            .as_deref()
            .or(self.ptx.as_deref())
            .unwrap_or_default()
    }

    /// Bytes held, all outputs and the log together.
    pub fn size_bytes(&self) -> usize {
        [&self.ptx, &self.cubin, &self.lto_ir]
            .iter()
            .map(|o| o.as_ref().map_or(0, Vec::len))
            .sum::<usize>()
            + self.log.len()
            + self
                .lowered
                .iter()
                .map(|(e, l)| e.len() + l.len())
                .sum::<usize>()
    }
}

impl NamedBlob for Compiled {
    fn name(&self) -> &str {
        &self.name
    }
    fn bytes(&self) -> &[u8] {
        self.blob()
    }
}

impl fmt::Debug for Compiled {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let len = |o: &Option<Vec<u8>>| o.as_ref().map(Vec::len);
        f.debug_struct("Compiled")
            .field("name", &self.name)
            .field("target", &self.target)
            .field("ptx_bytes", &len(&self.ptx))
            .field("cubin_bytes", &len(&self.cubin))
            .field("lto_ir_bytes", &len(&self.lto_ir))
            .field("log", &self.log)
            .field("lowered", &self.lowered)
            .finish()
    }
}
