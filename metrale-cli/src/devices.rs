//! `metrale devices`: each GPU (name, compute capability, memory, SMs) and the
//! peer matrix; [`gpus`] is shared with `doctor`.

use std::fmt::Write as _;

use metrale_runtime::sys::CUdevice_attribute as A;
use metrale_runtime::{Device, MetraleError};

use crate::json::Json;
use crate::{bytes, Outcome, FAILED, NO_DRIVER};

/// What is reported about one GPU.
pub struct Gpu {
    device: Device,
    cc: (i32, i32),
    memory: usize,
    sms: i32,
    uuid: Option<String>,
}

impl Gpu {
    /// `0: NVIDIA H200, sm_90, 139.8 GiB, 132 SMs`.
    pub fn line(&self) -> String {
        format!(
            "{}: {}, sm_{}{}, {}, {} SMs",
            self.device.ordinal(),
            self.device.name(),
            self.cc.0,
            self.cc.1,
            bytes(self.memory as u64),
            self.sms
        )
    }

    /// The same as JSON.
    pub fn json(&self) -> Json {
        Json::obj()
            .with("ordinal", self.device.ordinal())
            .with("name", self.device.name())
            .with("compute_capability", format!("{}.{}", self.cc.0, self.cc.1))
            .with("memory_bytes", self.memory)
            .with("sm_count", self.sms)
            .with("uuid", self.uuid.clone())
    }
}

fn uuid_text(b: [u8; 16]) -> String {
    let hex: Vec<String> = b.iter().map(|x| format!("{x:02x}")).collect();
    let h = hex.concat();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// Every GPU the driver reports (initialising it).
///
/// # Errors
/// Loading or initialising the driver, or a failing query.
pub fn gpus() -> Result<Vec<Gpu>, MetraleError> {
    Device::all()?
        .into_iter()
        .map(|device| {
            Ok(Gpu {
                cc: device.compute_capability()?,
                memory: device.total_memory()?,
                sms: device.attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
                uuid: device.uuid().ok().map(uuid_text),
                device,
            })
        })
        .collect()
}

/// `metrale devices`.
pub fn run() -> Outcome {
    let gpus = match gpus() {
        Ok(g) => g,
        Err(e) => {
            let code = if e.is_unavailable() {
                NO_DRIVER
            } else {
                FAILED
            };
            return Outcome {
                text: String::new(),
                json: Json::obj().with("error", e.to_string()),
                error: Some(e.to_string()),
                code,
            };
        }
    };
    let mut text = String::new();
    let _ = writeln!(
        text,
        "{:<3} {:<32} {:<6} {:>10} {:>5}  UUID",
        "#", "name", "cc", "memory", "SMs"
    );
    for g in &gpus {
        let _ = writeln!(
            text,
            "{:<3} {:<32} {:<6} {:>10} {:>5}  {}",
            g.device.ordinal(),
            g.device.name(),
            format!("{}.{}", g.cc.0, g.cc.1),
            bytes(g.memory as u64),
            g.sms,
            g.uuid.as_deref().unwrap_or("-")
        );
    }
    // The peer matrix: row = from, column = to. `P` peer access, `A` with native
    // atomics, `-` none, `X` the device itself.
    let mut matrix = Vec::new();
    let mut failure = None;
    if gpus.len() == 1 {
        let _ = writeln!(text);
        let _ = writeln!(text, "peer access: one GPU, no peers");
    }
    if gpus.len() > 1 {
        let _ = writeln!(text);
        let _ = writeln!(
            text,
            "peer access (row reads column): A = with native atomics, P = access, - = none"
        );
        let _ = write!(text, "    ");
        for to in &gpus {
            let _ = write!(text, " {:>3}", to.device.ordinal());
        }
        let _ = writeln!(text);
        for from in &gpus {
            let _ = write!(text, "{:>3} ", from.device.ordinal());
            let mut row = Vec::new();
            for to in &gpus {
                let cell = if from.device.ordinal() == to.device.ordinal() {
                    row.push(Json::Null);
                    "X".to_owned()
                } else {
                    match from.device.peer_link(&to.device) {
                        Ok(link) => {
                            row.push(
                                Json::obj()
                                    .with("access", link.access_supported)
                                    .with("native_atomics", link.native_atomics)
                                    .with("performance_rank", link.performance_rank),
                            );
                            match (link.access_supported, link.native_atomics) {
                                (true, true) => "A".to_owned(),
                                (true, false) => "P".to_owned(),
                                _ => "-".to_owned(),
                            }
                        }
                        Err(e) => {
                            row.push(Json::obj().with("error", e.to_string()));
                            failure.get_or_insert(e.to_string());
                            "?".to_owned()
                        }
                    }
                };
                let _ = write!(text, " {cell:>3}");
            }
            let _ = writeln!(text);
            matrix.push(Json::Arr(row));
        }
    }
    let json = Json::obj()
        .with("gpus", Json::Arr(gpus.iter().map(Gpu::json).collect()))
        .with("peer_matrix", Json::Arr(matrix));
    Outcome {
        text,
        json,
        code: if failure.is_some() { FAILED } else { 0 },
        error: failure,
    }
}
