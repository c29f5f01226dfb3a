//! `metrale doctor`: the driver library (what was asked for, the file it is, its
//! version), every GPU, and each companion library: found or not, where, its
//! version, the names tried, and the variable that picks the file.

use std::fmt::Write as _;

use metrale_cuda_sys as sys;
use metrale_cuda_sys::{nccl, nvjitlink, nvrtc, LibraryLoadError, LoadAttempt};

use crate::json::Json;
use crate::{cuda_version, devices, locate, Outcome, NO_DRIVER};

/// Driver functions whose absence explains a refusal later: newer APIs metrale
/// uses where the driver has them.
const TELLING_FUNCTIONS: &[(&str, &str)] = &[
    (
        "cuLaunchKernelEx",
        "launch attributes and clusters (CUDA 12.0)",
    ),
    (
        "cuLibraryLoadData",
        "context-independent loading (CUDA 12.0)",
    ),
    ("cuTensorMapEncodeTiled", "tensor maps (CUDA 12.0)"),
    (
        "cuFuncGetParamInfo",
        "checked parameter layouts (CUDA 12.4)",
    ),
    (
        "cuModuleEnumerateFunctions",
        "listing a module's kernels (CUDA 12.4)",
    ),
    ("cuGreenCtxCreate", "green contexts (CUDA 12.4)"),
];

/// The names a loader tries: the variable's file when it is set (and then only
/// it), else the default names.
fn candidates(env_var: &str, names: &[&str]) -> (Vec<String>, Option<String>) {
    match std::env::var(env_var) {
        Ok(path) if !path.is_empty() => (vec![path.clone()], Some(path)),
        _ => (names.iter().map(|n| (*n).to_owned()).collect(), None),
    }
}

/// The candidates up to and including the one that loaded.
fn tried_until(candidates: &[String], loaded: &str) -> Vec<String> {
    let end = candidates
        .iter()
        .position(|c| c == loaded)
        .map_or(candidates.len(), |i| i + 1);
    candidates[..end].to_vec()
}

fn attempts_json(attempts: &[LoadAttempt]) -> Json {
    Json::Arr(
        attempts
            .iter()
            .map(|a| {
                Json::obj()
                    .with("name", a.candidate.as_str())
                    .with("error", a.message.as_str())
            })
            .collect(),
    )
}

fn names_json(names: &[String]) -> Json {
    Json::Arr(names.iter().map(|n| Json::from(n.as_str())).collect())
}

/// One library's report: loaded (where, version) or not (every try).
struct Library {
    name: &'static str,
    env_var: &'static str,
    set_to: Option<String>,
    result: Result<(String, String, Option<String>), Vec<LoadAttempt>>,
    tried: Vec<String>,
    note: Option<String>,
}

impl Library {
    fn text(&self, out: &mut String) {
        match &self.result {
            Ok((given, path, version)) => {
                let _ = writeln!(out, "{}: found", self.name);
                if given != path {
                    let _ = writeln!(out, "  loaded as: {given}");
                }
                let _ = writeln!(out, "  path:      {path}");
                let _ = writeln!(
                    out,
                    "  version:   {}",
                    version
                        .as_deref()
                        .unwrap_or("unknown (the library does not say)")
                );
                let _ = writeln!(out, "  tried:     {}", self.tried.join(", "));
            }
            Err(attempts) => {
                let _ = writeln!(out, "{}: not found", self.name);
                let _ = writeln!(out, "  tried:");
                for a in attempts {
                    let _ = writeln!(out, "    {}: {}", a.candidate, a.message);
                }
            }
        }
        if let Some(note) = &self.note {
            let _ = writeln!(out, "  note:      {note}");
        }
        match (&self.set_to, &self.result) {
            (Some(path), _) => {
                let _ = writeln!(out, "  {} is set: {path}", self.env_var);
            }
            (None, Err(_)) => {
                let _ = writeln!(out, "  fix:       set {} to the library file", self.env_var);
            }
            (None, Ok(_)) => {
                let _ = writeln!(out, "  another file: set {}", self.env_var);
            }
        }
    }

    fn json(&self) -> Json {
        let mut j = Json::obj()
            .with("library", self.name)
            .with("found", self.result.is_ok());
        match &self.result {
            Ok((given, path, version)) => {
                j = j
                    .with("loaded_as", given.as_str())
                    .with("path", path.as_str())
                    .with("version", version.clone())
                    .with("tried", names_json(&self.tried));
            }
            Err(attempts) => j = j.with("tried", attempts_json(attempts)),
        }
        j.with("env_var", self.env_var)
            .with("env_value", self.set_to.clone())
            .with("note", self.note.clone())
    }
}

fn companion(
    name: &'static str,
    env_var: &'static str,
    names: &[&str],
    loaded: Result<(String, Option<usize>, Option<String>), &LibraryLoadError>,
) -> Library {
    let (candidates, set_to) = candidates(env_var, names);
    match loaded {
        Ok((given, addr, version)) => Library {
            name,
            env_var,
            set_to,
            tried: tried_until(&candidates, &given),
            result: Ok((given.clone(), locate::resolve(&given, addr), version)),
            note: None,
        },
        Err(e) => Library {
            name,
            env_var,
            set_to,
            tried: candidates,
            result: Err(e.attempts.clone()),
            note: e.companion_of.as_ref().map(|(companion, at)| {
                format!("{at} loaded, but not {companion}, which it opens by name when it compiles; put it beside the library")
            }),
        },
    }
}

fn libraries() -> Vec<Library> {
    let nvrtc = nvrtc::nvrtc().map(|l| {
        let addr = l.nvrtcVersion().ok().map(|f| f as usize);
        let version = l.version().map(|(a, b)| format!("{a}.{b}"));
        (l.path().to_owned(), addr, version)
    });
    let nvjitlink = nvjitlink::nvjitlink().map(|l| {
        let addr = l.nvJitLinkVersion().ok().map(|f| f as usize);
        let version = l.version().map(|(a, b)| format!("{a}.{b}"));
        (l.path().to_owned(), addr, version)
    });
    let nccl = nccl::nccl().map(|l| {
        let addr = l.ncclGetVersion().ok().map(|f| f as usize);
        let version = l.version().map(|(a, b, c)| format!("{a}.{b}.{c}"));
        (l.path().to_owned(), addr, version)
    });
    let mut nvrtc = companion(
        "NVRTC",
        nvrtc::LIBNVRTC_PATH_VAR,
        nvrtc::DEFAULT_LIBRARY_NAMES,
        nvrtc,
    );
    if let Ok(Some(builtins)) = nvrtc::nvrtc().map(|l| l.builtins_path()) {
        nvrtc.note = Some(format!("builtins loaded beside it: {builtins}"));
    }
    vec![
        nvrtc,
        companion(
            "nvJitLink",
            nvjitlink::LIBNVJITLINK_PATH_VAR,
            nvjitlink::DEFAULT_LIBRARY_NAMES,
            nvjitlink,
        ),
        companion(
            "NCCL",
            nccl::LIBNCCL_PATH_VAR,
            nccl::DEFAULT_LIBRARY_NAMES,
            nccl,
        ),
    ]
}

/// `metrale doctor`.
pub fn run() -> Outcome {
    let mut text = String::new();
    let (candidates, set_to) = candidates(sys::LIBCUDA_PATH_VAR, sys::DEFAULT_LIBRARY_NAMES);
    let mut driver_json = Json::obj().with("env_var", sys::LIBCUDA_PATH_VAR);
    driver_json = driver_json.with("env_value", set_to.clone());
    let mut code = 0;
    let mut error = None;
    let mut gpus_json = Json::Null;
    match sys::driver() {
        Ok(d) => {
            let given = d.path();
            let addr = d.cuInit().ok().map(|f| f as usize);
            let path = locate::resolve(given, addr);
            let mut version = 0;
            let version = match d.cuDriverGetVersion() {
                // SAFETY: cuDriverGetVersion writes one int; it needs no cuInit.
                Ok(f) => match unsafe { f(&mut version) } {
                    s if s.is_success() => Ok(version),
                    s => Err(format!("cuDriverGetVersion failed: {s}")),
                },
                Err(e) => Err(e.to_string()),
            };
            let tried = tried_until(&candidates, given);
            let _ = writeln!(text, "driver: found");
            if given != path {
                let _ = writeln!(text, "  loaded as: {given}");
            }
            let _ = writeln!(text, "  path:      {path}");
            match &version {
                Ok(v) => {
                    let _ = writeln!(text, "  version:   CUDA {} ({v})", cuda_version(*v));
                }
                Err(e) => {
                    let _ = writeln!(text, "  version:   unknown: {e}");
                }
            }
            let _ = writeln!(text, "  tried:     {}", tried.join(", "));
            let lacking: Vec<(&str, &str)> = TELLING_FUNCTIONS
                .iter()
                .copied()
                .filter(|(f, _)| d.has_function(f) == Some(false))
                .collect();
            for (f, what) in &lacking {
                let _ = writeln!(text, "  lacks:     {f}: {what}");
            }
            match &set_to {
                Some(p) => {
                    let _ = writeln!(text, "  {} is set: {p}", sys::LIBCUDA_PATH_VAR);
                }
                None => {
                    let _ = writeln!(text, "  another file: set {}", sys::LIBCUDA_PATH_VAR);
                }
            }
            driver_json = driver_json
                .with("found", true)
                .with("loaded_as", given)
                .with("path", path.as_str())
                .with("version", version.as_ref().ok().copied())
                .with("version_error", version.as_ref().err().cloned())
                .with("tried", names_json(&tried))
                .with(
                    "lacks",
                    Json::Arr(lacking.iter().map(|(f, _)| Json::from(*f)).collect()),
                );
            let _ = writeln!(text);
            match devices::gpus() {
                Ok(gpus) => {
                    let _ = writeln!(text, "GPUs: {}", gpus.len());
                    for g in &gpus {
                        let _ = writeln!(text, "  {}", g.line());
                    }
                    if gpus.is_empty() {
                        code = crate::FAILED;
                        error = Some("the driver reports no GPU".to_owned());
                    }
                    gpus_json = Json::Arr(gpus.iter().map(devices::Gpu::json).collect());
                }
                Err(e) => {
                    let _ = writeln!(text, "GPUs: none usable: {e}");
                    code = crate::FAILED;
                    error = Some(e.to_string());
                    gpus_json = Json::obj().with("error", e.to_string());
                }
            }
        }
        Err(e) => {
            let _ = writeln!(text, "driver: not found");
            let _ = writeln!(text, "  tried:");
            for a in &e.attempts {
                let _ = writeln!(text, "    {}: {}", a.candidate, a.message);
            }
            match &set_to {
                Some(p) => {
                    let _ = writeln!(
                        text,
                        "  {} is set: {p} (only it is tried)",
                        sys::LIBCUDA_PATH_VAR
                    );
                }
                None => {
                    let _ = writeln!(
                        text,
                        "  fix:       install the NVIDIA driver, or set {} to the driver library file",
                        sys::LIBCUDA_PATH_VAR
                    );
                }
            }
            let _ = writeln!(text);
            let _ = writeln!(text, "GPUs: unknown (no driver)");
            driver_json = driver_json
                .with("found", false)
                .with("tried", attempts_json(&e.attempts));
            code = NO_DRIVER;
            error = Some(e.to_string());
        }
    }
    let libs = libraries();
    for lib in &libs {
        let _ = writeln!(text);
        lib.text(&mut text);
    }
    let json = Json::obj()
        .with("driver", driver_json)
        .with("gpus", gpus_json)
        .with(
            "libraries",
            Json::Arr(libs.iter().map(Library::json).collect()),
        )
        .with("error", error.clone());
    Outcome {
        text,
        json,
        error,
        code,
    }
}
