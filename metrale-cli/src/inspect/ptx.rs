//! What PTX text says about itself: `.version`, `.target`, and each `.entry` with
//! its parameters laid out as the driver lays them out (each at the next offset
//! aligned to its alignment: `.align N` when given, else its size) and its
//! launch-bound directives.

use super::kernel::{Kernel, Param};

/// A PTX module's header and kernels.
#[derive(Debug, Default)]
pub struct Ptx {
    /// `.version` (major, minor).
    pub version: Option<(u32, u32)>,
    /// `.target` entries (`sm_90a`, `texmode_independent`, ...).
    pub targets: Vec<String>,
    /// `.address_size`.
    pub address_size: Option<u32>,
    /// The `.entry` functions, in file order.
    pub kernels: Vec<Kernel>,
}

fn strip_comments(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("//").into_iter().chain(rest.find("/*")).min() {
        out.push_str(&rest[..at]);
        if rest[at..].starts_with("//") {
            rest = rest[at..].find('\n').map_or("", |nl| &rest[at + nl..]);
        } else {
            rest = rest[at + 2..]
                .find("*/")
                .map_or("", |end| &rest[at + 2 + end + 2..]);
        }
    }
    out.push_str(rest);
    out
}

/// Size in bytes of a PTX scalar type (`.u64`, `.f16x2`, `.b8`, ...).
fn type_size(ty: &str) -> Option<u64> {
    let t = ty.strip_prefix('.')?;
    let (base, lanes) = match t.split_once('x') {
        Some((b, n)) => (b, n.parse::<u64>().ok()?),
        None => (t, 1),
    };
    let bits: u64 = match base {
        "pred" => return None,
        _ if base.len() > 1 => {
            // ASCII letters only: a byte count, so the split is always at a
            // character boundary (a non-ASCII letter ends the kind and fails below).
            let (kind, width) =
                base.split_at(base.bytes().take_while(u8::is_ascii_alphabetic).count());
            if !matches!(kind, "b" | "u" | "s" | "f" | "bf" | "e4m3" | "e5m2") {
                return None;
            }
            width.parse::<u64>().ok()?
        }
        _ => return None,
    };
    (bits / 8).checked_mul(lanes)
}

/// One `.param ...` declaration: (size, alignment).
fn param(decl: &str) -> Option<(u64, u64)> {
    let tokens: Vec<&str> = decl.split_whitespace().collect();
    let mut align = None;
    let mut ty = None;
    let mut i = 0;
    while i < tokens.len() {
        match tokens[i] {
            ".align" => {
                align = tokens.get(i + 1).and_then(|n| n.parse::<u64>().ok());
                i += 1;
            }
            t if t.starts_with('.') && ty.is_none() => ty = type_size(t),
            _ => {}
        }
        i += 1;
    }
    let elem = ty?;
    let name = tokens.last()?;
    let count = match name.split_once('[') {
        Some((_, n)) => n.trim_end_matches(']').parse::<u64>().ok()?,
        None => 1,
    };
    Some((elem.checked_mul(count)?, align.unwrap_or(elem).max(1)))
}

fn dims(text: &str) -> Option<u64> {
    let mut product = 1u64;
    let mut any = false;
    for n in text.split(',') {
        product = product.checked_mul(n.trim().parse::<u64>().ok()?)?;
        any = true;
    }
    any.then_some(product)
}

/// Read the PTX `text`.
pub fn parse(text: &str) -> Ptx {
    let text = strip_comments(text);
    let mut ptx = Ptx::default();
    for line in text.lines() {
        let line = line.trim();
        if let Some(v) = line.strip_prefix(".version") {
            let v = v.trim();
            if let Some((a, b)) = v.split_once('.') {
                ptx.version = a.parse().ok().zip(b.parse().ok());
            }
        } else if let Some(t) = line.strip_prefix(".target") {
            ptx.targets.extend(
                t.split(',')
                    .map(|s| s.trim().to_owned())
                    .filter(|s| !s.is_empty()),
            );
        } else if let Some(n) = line.strip_prefix(".address_size") {
            ptx.address_size = n.trim().parse().ok();
        }
    }
    let mut rest = text.as_str();
    while let Some(at) = rest.find(".entry") {
        rest = &rest[at + ".entry".len()..];
        let name: String = rest
            .trim_start()
            .chars()
            .take_while(|c| !c.is_whitespace() && *c != '(' && *c != '{')
            .collect();
        let body_at = rest.find('{').unwrap_or(rest.len());
        let head = &rest[..body_at];
        let mut kernel = Kernel {
            name,
            ..Kernel::default()
        };
        let (params_text, directives) = match (head.find('('), head.rfind(')')) {
            (Some(open), Some(close)) if open < close => {
                (&head[open + 1..close], &head[close + 1..])
            }
            _ => ("", head),
        };
        let mut offset = 0u64;
        for decl in params_text.split(',') {
            let decl = decl.trim();
            if decl.is_empty() {
                continue;
            }
            let Some((size, align)) = param(decl.strip_prefix(".param").unwrap_or(decl)) else {
                kernel.note = Some(format!("a parameter this tool cannot size: `{decl}`"));
                break;
            };
            let Some(at) = offset.div_ceil(align).checked_mul(align) else {
                kernel.note = Some(format!("a parameter offset past 2^64 bytes: `{decl}`"));
                break;
            };
            let Some(end) = at.checked_add(size) else {
                kernel.note = Some(format!("a parameter ending past 2^64 bytes: `{decl}`"));
                break;
            };
            kernel.params.push(Param { offset: at, size });
            offset = end;
        }
        for directive in directives.split('.').map(str::trim) {
            if let Some(d) = directive.strip_prefix("maxntid") {
                kernel.max_threads = dims(d);
            } else if let Some(d) = directive.strip_prefix("reqntid") {
                kernel.max_threads = dims(d);
            } else if let Some(d) = directive.strip_prefix("maxnreg") {
                kernel.max_registers = d.trim().parse().ok();
            }
        }
        ptx.kernels.push(kernel);
        rest = &rest[body_at..];
    }
    ptx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lays_out_parameters_and_reads_bounds() {
        let p = parse(
            ".version 8.5\n.target sm_90a, debug // c\n.address_size 64\n\
             .visible .entry k(\n .param .u32 k_0,\n .param .align 16 .b8 k_1[20],\n .param .f16 k_2\n)\n\
             .maxntid 128, 2, 1\n.maxnreg 64\n{\n ret;\n}\n",
        );
        assert_eq!(p.version, Some((8, 5)));
        assert_eq!(p.targets, ["sm_90a", "debug"]);
        assert_eq!(p.address_size, Some(64));
        let k = &p.kernels[0];
        assert_eq!(k.name, "k");
        let layout: Vec<(u64, u64)> = k.params.iter().map(|p| (p.offset, p.size)).collect();
        assert_eq!(layout, [(0, 4), (16, 20), (36, 2)]);
        assert_eq!(k.max_threads, Some(256));
        assert_eq!(k.max_registers, Some(64));
    }
}
