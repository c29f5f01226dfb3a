//! Where code loads: what each piece of the file is ([`Code`]: PTX, a cubin, a
//! fatbin entry) and the rules that say which GPUs and drivers take it.

use metrale_runtime::{blob, BlobKind};

use super::{elf, ptx};

/// One piece of code in the file.
pub(super) enum Code {
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
pub(super) struct Rule {
    pub(super) what: String,
    pub(super) min: (u32, u32),
    /// Inclusive upper bound; `None`: every newer GPU.
    pub(super) max: Option<(u32, u32)>,
    pub(super) driver: Option<(u32, u32)>,
}

/// The CUDA release whose driver first JIT-compiles PTX ISA `isa`.
pub(super) fn cuda_for_isa(isa: (u32, u32)) -> Option<(u32, u32)> {
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
pub(super) fn parse_arch(arch: &str) -> Option<(u32, u32, String)> {
    let digits = arch
        .strip_prefix("sm_")
        .or_else(|| arch.strip_prefix("compute_"))?;
    let n: String = digits.chars().take_while(char::is_ascii_digit).collect();
    let suffix = digits[n.len()..].to_owned();
    let v: u32 = n.parse().ok()?;
    Some((v / 10, v % 10, suffix))
}

pub(super) fn cc((a, b): (u32, u32)) -> String {
    format!("sm_{a}{b}")
}

pub(super) fn rules(code: &[Code]) -> Vec<Rule> {
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

pub(super) fn rule_text(r: &Rule) -> String {
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

pub(super) fn not_loading(rules: &[Rule]) -> Vec<String> {
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

pub(super) fn analyse(kind: BlobKind, data: &[u8]) -> Vec<Code> {
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
pub(super) fn fatbin_entries(data: &[u8]) -> Vec<Code> {
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
