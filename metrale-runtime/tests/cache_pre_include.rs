//! Review regression test (wt-review1): a file NVRTC reads through an option
//! other than `-I` / `--include-path` is not in the compile cache's key.
//! `--pre-include=<file>` (`-include`) is one: editing that header still hits
//! and the cache hands out the old build. The same holds for PCH options
//! (`--use-pch`, `--pch-dir`) and headers reached by `#include "../x.h"` out of
//! an include folder. Needs NVRTC (`METRALE_LIBNVRTC_PATH`); skipped without it.
#![cfg(feature = "nvrtc")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use metrale_runtime::nvrtc::{CompileCache, Program, Target};

fn dir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("metrale-review-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn value_of(c: &metrale_runtime::nvrtc::Compiled) -> String {
    let ptx = c
        .ptx()
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .unwrap_or_default();
    ptx.lines()
        .filter(|l| l.contains("mov.b32") || l.contains("mov.u32") || l.contains("st.global"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// `--pre-include=<file>` (NVRTC's `-include`) is read by NVRTC but not in the key.
#[test]
fn pre_include_edit_misses() {
    let d = dir("preinc");
    let h = d.join("v.h");
    std::fs::write(&h, "#define V 1\n").unwrap();
    let p = Program::new(
        "k.cu",
        "extern \"C\" __global__ void k(int* x) { x[0] = V; }\n",
    )
    .raw_option(format!("--pre-include={}", h.display()));
    let cache = CompileCache::new();
    let a = match cache.compile(&p, Target::Compute(90)) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("skipped: NVRTC did not compile: {e}");
            return;
        }
    };
    std::fs::write(&h, "#define V 7\n").unwrap();
    let fresh = p.compile(Target::Compute(90)).unwrap();
    let b = cache.compile(&p, Target::Compute(90)).unwrap();
    eprintln!(
        "first: {}\nfresh: {}\ncached: {}",
        value_of(&a),
        value_of(&fresh),
        value_of(&b)
    );
    assert_eq!(
        value_of(&b),
        value_of(&fresh),
        "cache served a build of the old pre-included header"
    );
}

/// A link to a folder that sorts after its target is listed only as "folder
/// walked already", without saying which folder: re-pointing `current` from
/// `1.0` to `2.0` keeps the key, and the cache serves the `1.0` build.
#[cfg(unix)]
#[test]
fn a_repointed_folder_link_misses() {
    let d = dir("relink");
    for (v, n) in [("1.0", 1), ("2.0", 2)] {
        std::fs::create_dir_all(d.join(v)).unwrap();
        std::fs::write(d.join(v).join("v.h"), format!("#define V {n}\n")).unwrap();
    }
    std::os::unix::fs::symlink("1.0", d.join("current")).unwrap();
    let p = Program::new(
        "k.cu",
        "#include \"current/v.h\"\nextern \"C\" __global__ void k(int* x) { x[0] = V; }\n",
    )
    .include_path(d.to_str().unwrap());
    let cache = CompileCache::new();
    let a = match cache.compile(&p, Target::Compute(90)) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("skipped: NVRTC did not compile: {e}");
            return;
        }
    };
    std::fs::remove_file(d.join("current")).unwrap();
    std::os::unix::fs::symlink("2.0", d.join("current")).unwrap();
    let fresh = p.compile(Target::Compute(90)).unwrap();
    let b = cache.compile(&p, Target::Compute(90)).unwrap();
    eprintln!(
        "first: {}\nfresh: {}\ncached: {}",
        value_of(&a),
        value_of(&fresh),
        value_of(&b)
    );
    assert_eq!(
        value_of(&b),
        value_of(&fresh),
        "cache served the build of the old link target"
    );
}
