//! `metrale inspect FILE`: what a PTX, cubin or fatbin holds and where it loads.
//!
//! Everything the file says about itself is read without a driver: the blob is
//! first checked as loading checks it ([`metrale_runtime::blob::check`]), then
//! PTX directives, a cubin's `.nv.info` records and a fatbin's entry headers are
//! read ([`ptx`], [`elf`]). With a driver (unless `--offline`) the blob is also
//! loaded on every GPU, and each kernel's attributes are asked of the driver
//! (`cuFuncGetAttribute`, `cuFuncGetParamInfo`): for PTX, registers and memory
//! are the JIT's choice, so only the driver knows them.

mod elf;
mod ptx;

use std::fmt::Write as _;

use metrale_runtime::{blob, BlobKind, MetraleRegistry};

use crate::json::Json;
use crate::{bytes, cuda_version, Outcome, FAILED, NO_DRIVER};

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

/// One piece of code in the file.
enum Code {
    Ptx {
        isa: Option<(u32, u32)>,
        /// `sm_90` / `sm_90a` / `compute_90`.
        target: Option<String>,
        parsed: Option<ptx::Ptx>,
        /// Why the text was not read (a compressed fatbin entry).
        unread: Option<String>,
    },
    Cubin(elf::Cubin),
}

/// Where a piece of code runs: compute capabilities and the driver it needs.
struct Rule {
    what: String,
    min: (u32, u32),
    /// Inclusive upper bound; `None`: every newer GPU.
    max: Option<(u32, u32)>,
    driver: Option<(u32, u32)>,
}

/// The CUDA release whose driver first JIT-compiles PTX ISA `isa`.
fn cuda_for_isa(isa: (u32, u32)) -> Option<(u32, u32)> {
    Some(match isa {
        (6, m @ 0..=2) => (9, m),
        (6, 3) => (10, 0),
        (6, 4) => (10, 1),
        (6, 5) => (10, 2),
        (7, m @ 0..=8) => (11, m),
        (8, m @ 0..=5) => (12, m),
        (8, 6) => (12, 7),
        (8, 7) => (12, 8),
        (8, 8) => (12, 9),
        (9, m @ 0..=1) => (13, m),
        _ => return None,
    })
}

/// `sm_90a` as (9, 0, "a").
fn parse_arch(arch: &str) -> Option<(u32, u32, String)> {
    let digits = arch
        .strip_prefix("sm_")
        .or_else(|| arch.strip_prefix("compute_"))?;
    let n: String = digits.chars().take_while(char::is_ascii_digit).collect();
    let suffix = digits[n.len()..].to_owned();
    let v: u32 = n.parse().ok()?;
    Some((v / 10, v % 10, suffix))
}

fn cc((a, b): (u32, u32)) -> String {
    format!("sm_{a}{b}")
}

fn rules(code: &[Code]) -> Vec<Rule> {
    let mut out = Vec::new();
    for c in code {
        match c {
            Code::Cubin(cubin) => {
                let arch = cubin
                    .arch
                    .clone()
                    .unwrap_or_else(|| format!("sm_{}", cubin.sm));
                let (major, minor) = (cubin.sm / 10, cubin.sm % 10);
                let specific = parse_arch(&arch).is_some_and(|(_, _, s)| s == "a");
                out.push(Rule {
                    what: format!("cubin {arch}"),
                    min: (major, minor),
                    max: Some(if specific { (major, minor) } else { (major, 9) }),
                    driver: cubin.toolkit.map(|(m, _)| (m, 0)),
                });
            }
            Code::Ptx { isa, target, .. } => {
                let Some((major, minor, suffix)) = target.as_deref().and_then(parse_arch) else {
                    continue;
                };
                let isa_text = isa.map_or("PTX".to_owned(), |(a, b)| format!("PTX {a}.{b}"));
                out.push(Rule {
                    what: format!("{isa_text} for {}", target.as_deref().unwrap_or("?")),
                    min: (major, minor),
                    max: match suffix.as_str() {
                        "a" => Some((major, minor)),
                        "f" => Some((major, 9)),
                        _ => None,
                    },
                    driver: isa.and_then(cuda_for_isa),
                });
            }
        }
    }
    out
}

fn rule_text(r: &Rule) -> String {
    let devices = match r.max {
        Some(max) if max == r.min => format!("on {} only", cc(r.min)),
        Some(max) => format!("on {}..{}", cc(r.min), cc(max)),
        None => format!("on {} and every newer GPU (JIT)", cc(r.min)),
    };
    let driver = match r.driver {
        Some((a, b)) => format!(", with a driver of CUDA {a}.{b} or newer"),
        None => String::new(),
    };
    format!("{}: {devices}{driver}", r.what)
}

fn not_loading(rules: &[Rule]) -> Vec<String> {
    let mut out = Vec::new();
    let Some(lowest) = rules.iter().map(|r| r.min).min() else {
        return out;
    };
    out.push(format!("GPUs older than {}", cc(lowest)));
    if rules.iter().all(|r| r.max.is_some()) {
        if let Some(top) = rules.iter().filter_map(|r| r.max).max() {
            out.push(format!(
                "GPUs newer than {} (no PTX for the driver to compile)",
                cc(top)
            ));
        }
    }
    out
}

fn analyse(kind: BlobKind, data: &[u8]) -> Vec<Code> {
    match kind {
        BlobKind::Ptx => {
            let text = String::from_utf8_lossy(data);
            let parsed = ptx::parse(text.trim_end_matches('\0'));
            let target = parsed.targets.first().cloned();
            vec![Code::Ptx {
                isa: parsed.version,
                target,
                parsed: Some(parsed),
                unread: None,
            }]
        }
        BlobKind::Cubin => {
            let sm = blob::cubin_sm(data).unwrap_or(0);
            vec![Code::Cubin(elf::parse(data, sm))]
        }
        BlobKind::Fatbin => fatbin_entries(data),
        // `check` unpacks a bundle to its entry, whose kind it reports.
        _ => Vec::new(),
    }
}

/// A fatbin's entries: kind u16, header size u32 at 4, payload size u64 at 8,
/// PTX ISA minor/major u16 at 24/26, architecture u32 at 28, flags u64 at 40,
/// uncompressed size u64 at 56.
fn fatbin_entries(data: &[u8]) -> Vec<Code> {
    let u16_at = |at: usize| {
        data.get(at..at + 2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
    };
    let u32_at = |at: usize| {
        data.get(at..at + 4)
            .and_then(|b| b.try_into().ok())
            .map(u32::from_le_bytes)
    };
    let u64_at = |at: usize| {
        data.get(at..at + 8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
    };
    let mut out = Vec::new();
    let (Some(header), Some(payload)) = (u16_at(6), u64_at(8)) else {
        return out;
    };
    let end = usize::from(header).saturating_add(usize::try_from(payload).unwrap_or(0));
    let mut at = usize::from(header);
    while at < end {
        let (Some(kind), Some(entry_header), Some(size)) =
            (u16_at(at), u32_at(at + 4), u64_at(at + 8))
        else {
            break;
        };
        let start = at + entry_header as usize;
        let Some(body) = data.get(start..start.saturating_add(size as usize)) else {
            break;
        };
        let arch = u32_at(at + 28).unwrap_or(0);
        let flags = u64_at(at + 40).unwrap_or(0);
        let compressed = if body.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
            Some("zstd")
        } else if flags & 0x2000 != 0 {
            Some("LZ4")
        } else {
            None
        };
        match kind {
            1 => {
                let isa = u16_at(at + 26)
                    .zip(u16_at(at + 24))
                    .map(|(a, b)| (u32::from(a), u32::from(b)));
                let (parsed, unread) = match compressed {
                    Some(how) => (
                        None,
                        Some(format!(
                            "compressed ({how}, {} bytes of text): its kernels are not read",
                            u64_at(at + 56).unwrap_or(0)
                        )),
                    ),
                    None => (
                        Some(ptx::parse(
                            String::from_utf8_lossy(body).trim_end_matches('\0'),
                        )),
                        None,
                    ),
                };
                out.push(Code::Ptx {
                    isa: parsed.as_ref().and_then(|p| p.version).or(isa),
                    target: parsed
                        .as_ref()
                        .and_then(|p| p.targets.first().cloned())
                        .or_else(|| Some(format!("sm_{arch}"))),
                    parsed,
                    unread,
                });
            }
            2 if compressed.is_none() && blob::check("", body).is_ok() => {
                out.push(Code::Cubin(elf::parse(
                    body,
                    blob::cubin_sm(body).unwrap_or(arch),
                )));
            }
            2 => out.push(Code::Cubin(elf::Cubin {
                sm: arch,
                kernels: Vec::new(),
                ..elf::Cubin::default()
            })),
            _ => {}
        }
        at = start.saturating_add(size as usize);
    }
    out
}

fn params_text(params: &[Param]) -> String {
    let cells: Vec<String> = params
        .iter()
        .map(|p| format!("{}:{}", p.offset, p.size))
        .collect();
    cells.join(" ")
}

fn opt(v: Option<u64>, unit: &str) -> String {
    v.map_or("?".to_owned(), |n| format!("{n}{unit}"))
}

fn kernel_text(out: &mut String, k: &Kernel, from_ptx: bool) {
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

fn kernel_json(k: &Kernel) -> Json {
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

/// One kernel as the driver sees it: its name, the attributes as JSON (or the
/// failure), and the text line.
type DriverKernel = (String, Result<Json, String>, String);

/// What the driver said on one GPU.
struct OnDevice {
    ordinal: usize,
    name: String,
    cc: (i32, i32),
    loaded: Result<Vec<DriverKernel>, String>,
}

fn on_devices(
    module: &str,
    data: &[u8],
    static_names: &[String],
) -> Result<(i32, Vec<OnDevice>), String> {
    let count = metrale_runtime::device_count().map_err(|e| e.to_string())?;
    let d = metrale_runtime::sys::driver().map_err(|e| e.to_string())?;
    let mut version = 0;
    if let Ok(f) = d.cuDriverGetVersion() {
        // SAFETY: cuDriverGetVersion writes one int.
        let _ = unsafe { f(&mut version) };
    }
    let mut out = Vec::new();
    for ordinal in 0..count {
        let (name, cc) = match metrale_runtime::Device::get(ordinal) {
            Ok(dev) => (
                dev.name().to_owned(),
                dev.compute_capability().unwrap_or((0, 0)),
            ),
            Err(e) => (format!("? ({e})"), (0, 0)),
        };
        let loaded = MetraleRegistry::load(ordinal, &[(module, data)])
            .map_err(|e| e.to_string())
            .map(|reg| {
                let names = reg
                    .function_names(module)
                    .ok()
                    .filter(|n| !n.is_empty())
                    .unwrap_or_else(|| static_names.to_vec());
                names
                    .into_iter()
                    .map(|n| {
                        let r = reg.function(module, &n).map_err(|e| e.to_string()).and_then(|f| {
                            let a = f.attributes().map_err(|e| e.to_string())?;
                            let params = f.params().map(|ps| {
                                Json::Arr(
                                    ps.iter()
                                        .map(|p| Json::obj().with("offset", p.offset).with("size", p.size))
                                        .collect(),
                                )
                            });
                            let text = format!(
                                "registers {}, static shared {} B, local {} B, max threads {}, parameters {}",
                                a.num_regs,
                                a.static_shared_bytes,
                                a.local_bytes,
                                a.max_threads_per_block,
                                match f.params() {
                                    Some(ps) => {
                                        let cells: Vec<String> =
                                            ps.iter().map(|p| format!("{}:{}", p.offset, p.size)).collect();
                                        if cells.is_empty() { "none".to_owned() } else { cells.join(" ") }
                                    }
                                    None => "unknown (cuFuncGetParamInfo needs CUDA 12.4)".to_owned(),
                                }
                            );
                            Ok((
                                Json::obj()
                                    .with("registers", a.num_regs)
                                    .with("static_shared_bytes", a.static_shared_bytes)
                                    .with("local_bytes", a.local_bytes)
                                    .with("max_threads", a.max_threads_per_block)
                                    .with("ptx_version", a.ptx_version)
                                    .with("binary_version", a.binary_version)
                                    .with("params", params),
                                text,
                            ))
                        });
                        match r {
                            Ok((j, t)) => (n, Ok(j), t),
                            Err(e) => (n, Err(e.clone()), e),
                        }
                    })
                    .collect()
            });
        out.push(OnDevice {
            ordinal,
            name,
            cc,
            loaded,
        });
    }
    Ok((version, out))
}

/// `metrale inspect FILE`.
pub fn run(path: &std::path::Path, offline: bool) -> Outcome {
    // The name as text (a name that is not UTF-8 is shown lossily).
    let file = path.to_string_lossy();
    let failed = |why: String| Outcome {
        text: String::new(),
        json: Json::obj()
            .with("file", file.as_ref())
            .with("error", why.as_str()),
        error: Some(why),
        code: FAILED,
    };
    let data = match std::fs::read(path) {
        Ok(d) => d,
        Err(e) => return failed(format!("cannot read {file}: {e}")),
    };
    let module = path.file_name().map_or_else(
        || file.clone().into_owned(),
        |n| n.to_string_lossy().into_owned(),
    );
    let outer = BlobKind::of(&data);
    let kind = match blob::check(&module, &data) {
        Ok(k) => k,
        Err(e) => return failed(e.to_string()),
    };
    let code = analyse(kind, if outer == kind { &data } else { &[] });
    // Anything without a binary magic counts as PTX to the loader; text without a
    // `.version` directive is not PTX at all.
    if let [Code::Ptx { isa: None, .. }] = code.as_slice() {
        return failed(format!(
            "{module}: not a kernel blob: no PTX `.version` directive, and neither a cubin's \
             ELF magic nor a fatbin's"
        ));
    }
    let mut text = String::new();
    let _ = writeln!(text, "file: {module} ({})", bytes(data.len() as u64));
    let kind_text = if outer == kind {
        kind.label().to_owned()
    } else {
        format!("{} holding a {}", outer.label(), kind.label())
    };
    let _ = writeln!(text, "kind: {kind_text}");
    let mut code_json = Vec::new();
    let mut static_names: Vec<String> = Vec::new();
    for c in &code {
        let _ = writeln!(text);
        match c {
            Code::Ptx {
                isa,
                target,
                parsed,
                unread,
            } => {
                let isa_text = isa.map_or("?".to_owned(), |(a, b)| format!("{a}.{b}"));
                let targets = parsed
                    .as_ref()
                    .map(|p| p.targets.join(", "))
                    .or_else(|| target.clone())
                    .unwrap_or_default();
                let _ = writeln!(text, "PTX: ISA {isa_text}, target {targets}");
                if let Some(why) = unread {
                    let _ = writeln!(text, "  {why}");
                }
                let kernels = parsed
                    .as_ref()
                    .map(|p| p.kernels.as_slice())
                    .unwrap_or_default();
                if parsed.is_some() {
                    let _ = writeln!(text, "  kernels: {}", kernels.len());
                }
                for k in kernels {
                    kernel_text(&mut text, k, true);
                    if !static_names.contains(&k.name) {
                        static_names.push(k.name.clone());
                    }
                }
                code_json.push(
                    Json::obj()
                        .with("kind", "PTX")
                        .with("isa", isa.map(|(a, b)| format!("{a}.{b}")))
                        .with(
                            "targets",
                            Json::Arr(match parsed {
                                Some(p) => {
                                    p.targets.iter().map(|t| Json::from(t.as_str())).collect()
                                }
                                None => target.iter().map(|t| Json::from(t.as_str())).collect(),
                            }),
                        )
                        .with("address_size", parsed.as_ref().and_then(|p| p.address_size))
                        .with("unread", unread.clone())
                        .with(
                            "kernels",
                            parsed
                                .as_ref()
                                .map(|p| Json::Arr(p.kernels.iter().map(kernel_json).collect())),
                        ),
                );
            }
            Code::Cubin(cubin) => {
                let arch = cubin
                    .arch
                    .clone()
                    .unwrap_or_else(|| format!("sm_{}", cubin.sm));
                let toolkit = cubin.toolkit.map(|(a, b)| format!("{a}.{b}"));
                let _ = writeln!(
                    text,
                    "SASS: {arch}{}",
                    toolkit
                        .as_ref()
                        .map_or(String::new(), |t| format!(" (built by CUDA {t})"))
                );
                let _ = writeln!(text, "  kernels: {}", cubin.kernels.len());
                for k in &cubin.kernels {
                    kernel_text(&mut text, k, false);
                    if !static_names.contains(&k.name) {
                        static_names.push(k.name.clone());
                    }
                }
                code_json.push(
                    Json::obj()
                        .with("kind", "cubin")
                        .with("arch", arch.as_str())
                        .with("toolkit", toolkit)
                        .with(
                            "kernels",
                            Json::Arr(cubin.kernels.iter().map(kernel_json).collect()),
                        ),
                );
            }
        }
    }
    let rules = rules(&code);
    let _ = writeln!(text);
    let _ = writeln!(text, "loads:");
    for r in &rules {
        let _ = writeln!(text, "  {}", rule_text(r));
    }
    let refused = not_loading(&rules);
    if !refused.is_empty() {
        let _ = writeln!(text, "does not load on:");
        for r in &refused {
            let _ = writeln!(text, "  {r}");
        }
    }
    let mut json = Json::obj()
        .with("file", module.as_str())
        .with("bytes", data.len())
        .with("kind", kind_text.as_str())
        .with("code", Json::Arr(code_json))
        .with(
            "loads",
            Json::Arr(
                rules
                    .iter()
                    .map(|r| {
                        Json::obj()
                            .with("code", r.what.as_str())
                            .with("min", cc(r.min))
                            .with("max", r.max.map(cc))
                            .with("driver", r.driver.map(|(a, b)| format!("{a}.{b}")))
                    })
                    .collect(),
            ),
        )
        .with(
            "does_not_load",
            Json::Arr(refused.iter().map(|s| Json::from(s.as_str())).collect()),
        );
    let _ = writeln!(text);
    if offline {
        let _ = writeln!(text, "driver: not asked (--offline)");
        return Outcome {
            text,
            json: json.with("driver", Json::Null),
            error: None,
            code: 0,
        };
    }
    match on_devices(&module, &data, &static_names) {
        Ok((version, devices)) => {
            let _ = writeln!(text, "driver: CUDA {} ({version})", cuda_version(version));
            let have = (
                u32::try_from(version / 1000).unwrap_or(0),
                u32::try_from(version % 1000 / 10).unwrap_or(0),
            );
            let mut driver_checks = Vec::new();
            for r in &rules {
                if let Some(need) = r.driver {
                    let ok = have >= need;
                    let _ = writeln!(
                        text,
                        "  {}: needs CUDA {}.{}: {}",
                        r.what,
                        need.0,
                        need.1,
                        if ok {
                            "this driver has it"
                        } else {
                            "this driver is older and will refuse it"
                        }
                    );
                    driver_checks.push(
                        Json::obj()
                            .with("code", r.what.as_str())
                            .with("needs", format!("{}.{}", need.0, need.1))
                            .with("ok", ok),
                    );
                }
            }
            let mut devices_json = Vec::new();
            let mut shown = false;
            for dev in &devices {
                let head = format!(
                    "device {} ({}, sm_{}{})",
                    dev.ordinal, dev.name, dev.cc.0, dev.cc.1
                );
                match &dev.loaded {
                    Ok(kernels) => {
                        let _ = writeln!(text, "  {head}: loads");
                        // Kernels as the driver sees them, on the first GPU that
                        // loads the file (the JSON has every GPU's).
                        if !shown {
                            for (name, _, line) in kernels {
                                let _ = writeln!(text, "    {name}: {line}");
                            }
                            shown = true;
                        }
                        devices_json.push(
                            Json::obj()
                                .with("ordinal", dev.ordinal)
                                .with("loads", true)
                                .with(
                                    "kernels",
                                    Json::Arr(
                                        kernels
                                            .iter()
                                            .map(|(n, r, _)| match r {
                                                Ok(j) => j.clone().with("name", n.as_str()),
                                                Err(e) => Json::obj()
                                                    .with("name", n.as_str())
                                                    .with("error", e.as_str()),
                                            })
                                            .collect(),
                                    ),
                                ),
                        );
                    }
                    Err(e) => {
                        let _ = writeln!(text, "  {head}: does not load: {e}");
                        devices_json.push(
                            Json::obj()
                                .with("ordinal", dev.ordinal)
                                .with("loads", false)
                                .with("error", e.as_str()),
                        );
                    }
                }
            }
            json = json.with(
                "driver",
                Json::obj()
                    .with("version", version)
                    .with("devices", Json::Arr(devices_json)),
            );
            Outcome {
                text,
                json,
                error: None,
                code: 0,
            }
        }
        Err(e) => {
            let _ = writeln!(
                text,
                "driver: not loaded; registers, memory and max threads as the driver sees them need one"
            );
            Outcome {
                text,
                json: json.with("driver", Json::obj().with("error", e.as_str())),
                error: Some(e),
                code: NO_DRIVER,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ptx(isa: (u32, u32), target: &str) -> Code {
        Code::Ptx {
            isa: Some(isa),
            target: Some(target.to_owned()),
            parsed: None,
            unread: None,
        }
    }

    #[test]
    fn where_code_loads() {
        let cubin = Code::Cubin(elf::Cubin {
            sm: 86,
            arch: Some("sm_86".to_owned()),
            toolkit: Some((12, 4)),
            kernels: Vec::new(),
        });
        let r = rules(&[cubin]);
        assert_eq!(
            rule_text(&r[0]),
            "cubin sm_86: on sm_86..sm_89, with a driver of CUDA 12.0 or newer"
        );
        assert_eq!(
            not_loading(&r),
            [
                "GPUs older than sm_86",
                "GPUs newer than sm_89 (no PTX for the driver to compile)"
            ]
        );
        let r = rules(&[
            ptx((8, 7), "sm_90a"),
            ptx((8, 8), "sm_100f"),
            ptx((7, 8), "sm_80"),
        ]);
        assert_eq!(
            rule_text(&r[0]),
            "PTX 8.7 for sm_90a: on sm_90 only, with a driver of CUDA 12.8 or newer"
        );
        assert_eq!(
            rule_text(&r[1]),
            "PTX 8.8 for sm_100f: on sm_100..sm_109, with a driver of CUDA 12.9 or newer"
        );
        assert_eq!(
            rule_text(&r[2]),
            "PTX 7.8 for sm_80: on sm_80 and every newer GPU (JIT), with a driver of CUDA 11.8 or newer"
        );
        assert_eq!(not_loading(&r), ["GPUs older than sm_80"]);
        assert_eq!(cuda_for_isa((6, 3)), Some((10, 0)));
        assert_eq!(cuda_for_isa((9, 9)), None);
    }
}
