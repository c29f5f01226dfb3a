//! What one kernel is, as the file says it ([`Kernel`], [`Param`]), and how it
//! is shown as text and JSON.

use std::fmt::Write as _;

use crate::json::Json;

/// One kernel parameter: offset and size in the parameter buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Param {
    /// Byte offset.
    pub offset: u64,
    /// Size in bytes.
    pub size: u64,
}

/// What the file says about one kernel (`None`: it does not say).
#[derive(Debug, Default, Clone)]
pub struct Kernel {
    /// The kernel's name.
    pub name: String,
    /// Its parameters, in order.
    pub params: Vec<Param>,
    /// The parameter buffer's size (`EIATTR_CBANK_PARAM_SIZE`).
    pub param_bytes: Option<u64>,
    /// Registers per thread.
    pub registers: Option<u64>,
    /// A register limit (`.maxnreg`, `EIATTR_MAXREG_COUNT`).
    pub max_registers: Option<u64>,
    /// Static shared memory, bytes.
    pub static_shared: Option<u64>,
    /// Local memory (stack frame) per thread, bytes.
    pub local: Option<u64>,
    /// Threads per block the code was bounded to (`.maxntid`, `.reqntid`).
    pub max_threads: Option<u64>,
    /// Something the tool could not read.
    pub note: Option<String>,
}

pub(super) fn params_text(params: &[Param]) -> String {
    let cells: Vec<String> = params
        .iter()
        .map(|p| format!("{}:{}", p.offset, p.size))
        .collect();
    cells.join(" ")
}

pub(super) fn opt(v: Option<u64>, unit: &str) -> String {
    v.map_or("?".to_owned(), |n| format!("{n}{unit}"))
}

pub(super) fn kernel_text(out: &mut String, k: &Kernel, from_ptx: bool) {
    // The end of the last parameter; a sum past u64 (a hand-made file) shows
    // as a note instead of a number.
    let size = match k.param_bytes {
        Some(n) => n.to_string(),
        None => k.params.last().map_or("0".to_owned(), |p| {
            p.offset
                .checked_add(p.size)
                .map_or("past 2^64".to_owned(), |n| n.to_string())
        }),
    };
    let _ = writeln!(out, "  {}", k.name);
    let params = if k.params.is_empty() {
        "none".to_owned()
    } else {
        params_text(&k.params)
    };
    let _ = writeln!(out, "    parameters (offset:size): {params} ({size} bytes)");
    let resources = if from_ptx {
        "registers, shared and local memory: the JIT decides (needs a driver)".to_owned()
    } else {
        format!(
            "registers {}, static shared {}, local {}",
            opt(k.registers, ""),
            opt(k.static_shared, " B"),
            opt(k.local, " B")
        )
    };
    let threads = k
        .max_threads
        .map_or("unbounded".to_owned(), |n| n.to_string());
    let limit = k
        .max_registers
        .map_or(String::new(), |r| format!(", register limit {r}"));
    let _ = writeln!(out, "    {resources}; max threads {threads}{limit}");
    if let Some(note) = &k.note {
        let _ = writeln!(out, "    note: {note}");
    }
}

pub(super) fn kernel_json(k: &Kernel) -> Json {
    Json::obj()
        .with("name", k.name.as_str())
        .with(
            "params",
            Json::Arr(
                k.params
                    .iter()
                    .map(|p| Json::obj().with("offset", p.offset).with("size", p.size))
                    .collect(),
            ),
        )
        .with("param_bytes", k.param_bytes)
        .with("registers", k.registers)
        .with("max_registers", k.max_registers)
        .with("static_shared_bytes", k.static_shared)
        .with("local_bytes", k.local)
        .with("max_threads", k.max_threads)
        .with("note", k.note.clone())
}
