//! `metrale inspect FILE`: what a PTX, cubin or fatbin holds and where it loads.
//!
//! Everything the file says about itself is read without a driver: the blob is
//! first checked as loading checks it ([`metrale_runtime::blob::check`]), then
//! PTX directives, a cubin's `.nv.info` records and a fatbin's entry headers are
//! read ([`ptx`], [`elf`]). With a driver (unless `--offline`) the blob is also
//! loaded on every GPU, and each kernel's attributes are asked of the driver
//! (`cuFuncGetAttribute`, `cuFuncGetParamInfo`): for PTX, registers and memory
//! are the JIT's choice, so only the driver knows them.
//!
//! `kernel.rs` owns what a kernel is and how it is shown; `ptx.rs` and `elf.rs`
//! read the file; `rules.rs` says where each piece loads; `device.rs` asks the
//! driver; `mod.rs` puts the report together.

mod device;
mod elf;
mod kernel;
mod ptx;
mod rules;

use std::fmt::Write as _;

use metrale_runtime::{blob, BlobKind};

use crate::json::Json;
use crate::{bytes, cuda_version, Outcome, FAILED, NO_DRIVER};
use device::on_devices;
use kernel::{kernel_json, kernel_text};
use rules::{analyse, cc, not_loading, rule_text, rules, Code};

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
    // The names in `static_names`, for a lookup that stays linear.
    let mut seen: std::collections::HashSet<String> = std::collections::HashSet::new();
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
                    if seen.insert(k.name.clone()) {
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
                    if seen.insert(k.name.clone()) {
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
    use super::rules::cuda_for_isa;
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
