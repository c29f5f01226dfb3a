//! What the driver says: the blob loaded on every GPU and each kernel's
//! attributes asked of it.

use metrale_runtime::MetraleRegistry;

use crate::json::Json;

/// One kernel as the driver sees it: its name, the attributes as JSON (or the
/// failure), and the text line.
pub(super) type DriverKernel = (String, Result<Json, String>, String);

/// What the driver said on one GPU.
pub(super) struct OnDevice {
    pub(super) ordinal: usize,
    pub(super) name: String,
    pub(super) cc: (i32, i32),
    pub(super) loaded: Result<Vec<DriverKernel>, String>,
}

pub(super) fn on_devices(
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
