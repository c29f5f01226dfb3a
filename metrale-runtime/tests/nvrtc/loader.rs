//! The loaders' failures, each in a child process (the tables load once per
//! process): a missing library lists every try, NVRTC without its builtins, a
//! library that lacks the functions.

use std::path::PathBuf;

use metrale_runtime::nvrtc::{Program, Target};

use crate::harness::{run_child, Child, Test};

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "loader::missing_library_lists_every_try",
            run: missing_library_lists_every_try,
        },
        Test {
            name: "loader::builtins_not_found_is_named",
            run: builtins_not_found_is_named,
        },
        Test {
            name: "loader::missing_symbol_is_typed",
            run: missing_symbol_is_typed,
        },
    ]
}

pub fn children() -> Vec<Child> {
    vec![
        Child {
            name: "compile_and_print",
            run: compile_and_print,
        },
        Child {
            name: "link_and_print",
            run: link_and_print,
        },
    ]
}

/// Compile a small program; print the outcome on stdout (the parent reads it).
fn compile_and_print() {
    match Program::new("child.cu", "extern \"C\" __global__ void k() {}").compile(Target::Sm(90)) {
        Ok(out) => println!("compiled {} bytes", out.cubin().map_or(0, <[u8]>::len)),
        Err(e) => println!("error: {e}"),
    }
}

fn link_and_print() {
    let linker = metrale_runtime::nvrtc::Linker::new(Target::Sm(90)).add(
        metrale_runtime::nvrtc::LinkInput::Ptx,
        "x.ptx",
        b".version 8.0\n.target sm_90\n.address_size 64\n".to_vec(),
    );
    match linker.link() {
        Ok(l) => println!("linked {} bytes", l.cubin().len()),
        Err(e) => println!("error: {e}"),
    }
}

fn child_says(env: &[(&str, &str)], scenario: &str) -> String {
    let out = run_child(scenario, env);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "child failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!stdout.contains("panicked"), "{stdout}");
    stdout.trim().to_owned()
}

fn lib_dir() -> Option<PathBuf> {
    std::env::var_os("METRALE_LIBNVRTC_PATH")
        .filter(|p| !p.is_empty())
        .and_then(|p| PathBuf::from(p).parent().map(PathBuf::from))
}

fn missing_library_lists_every_try() {
    let said = child_says(
        &[("METRALE_LIBNVRTC_PATH", "/nonexistent/libnvrtc.so.13")],
        "compile_and_print",
    );
    assert!(
        said.starts_with(
            "error: could not load the NVRTC library; tried `/nonexistent/libnvrtc.so.13`: "
        ),
        "{said}"
    );
    assert!(
        said.ends_with("set METRALE_LIBNVRTC_PATH to the library file"),
        "{said}"
    );
    let said = child_says(
        &[(
            "METRALE_LIBNVJITLINK_PATH",
            "/nonexistent/libnvJitLink.so.13",
        )],
        "link_and_print",
    );
    assert!(said.starts_with("error: could not load the nvJitLink library; tried `/nonexistent/libnvJitLink.so.13`: "), "{said}");
    // Without the variable: every soname, in order (unless this machine has one).
    let said = child_says(
        &[("METRALE_LIBNVRTC_PATH", ""), ("LD_LIBRARY_PATH", "")],
        "compile_and_print",
    );
    if said.starts_with("error: could not load") {
        let at = |s: &str| {
            said.find(s)
                .unwrap_or_else(|| panic!("{s} not tried: {said}"))
        };
        assert!(at("`libnvrtc.so.13`") < at("`libnvrtc.so.12`"));
        assert!(at("`libnvrtc.so.12`") < at("`libnvrtc.so`:"));
    }
}

fn builtins_not_found_is_named() {
    let Some(dir) = lib_dir() else {
        println!("    (METRALE_LIBNVRTC_PATH unset: the libraries come from the loader path; nothing to copy)");
        return;
    };
    let lone = std::env::temp_dir().join(format!("metrale-nvrtc-lone-{}", std::process::id()));
    std::fs::create_dir_all(&lone).unwrap();
    let copy = lone.join("libnvrtc.so.13");
    std::fs::copy(dir.join("libnvrtc.so.13"), &copy).unwrap();
    let said = child_says(
        &[
            ("METRALE_LIBNVRTC_PATH", copy.to_str().unwrap()),
            ("LD_LIBRARY_PATH", ""),
        ],
        "compile_and_print",
    );
    let lone_text = lone.display().to_string();
    assert!(
        said.starts_with(&format!(
            "error: NVRTC at `{}` loaded, but not libnvrtc-builtins.so.",
            copy.display()
        )),
        "{said}"
    );
    assert!(
        said.contains(&format!("`{lone_text}/libnvrtc-builtins.so.")),
        "{said}"
    );
    assert!(said.contains("Put libnvrtc-builtins.so."), "{said}");
    // With the builtins beside it, the same copy compiles.
    for entry in std::fs::read_dir(&dir).unwrap().flatten() {
        let name = entry.file_name();
        if name.to_string_lossy().starts_with("libnvrtc-builtins.so") {
            std::fs::copy(entry.path(), lone.join(&name)).unwrap();
        }
    }
    let said = child_says(
        &[
            ("METRALE_LIBNVRTC_PATH", copy.to_str().unwrap()),
            ("LD_LIBRARY_PATH", ""),
        ],
        "compile_and_print",
    );
    assert!(said.starts_with("compiled "), "{said}");
    let _ = std::fs::remove_dir_all(&lone);
}

fn missing_symbol_is_typed() {
    let Some(dir) = lib_dir() else {
        println!("    (METRALE_LIBNVRTC_PATH unset: no folder to take a stand-in from)");
        return;
    };
    // nvJitLink's library as NVRTC: it loads (the builtins are beside it) and
    // exports none of NVRTC's functions.
    let wrong = dir.join("libnvJitLink.so.13");
    let said = child_says(
        &[("METRALE_LIBNVRTC_PATH", wrong.to_str().unwrap())],
        "compile_and_print",
    );
    assert_eq!(
        said,
        "error: program 'child.cu': the loaded NVRTC library does not export `nvrtcCreateProgram` \
         (its version is unknown: it does not say)"
    );
    let said = child_says(
        &[(
            "METRALE_LIBNVJITLINK_PATH",
            dir.join("libnvrtc.so.13").to_str().unwrap(),
        )],
        "link_and_print",
    );
    assert!(
        said.starts_with("error: link of [x.ptx] for sm_90: the loaded nvJitLink library does not export `__nvJitLinkCreate_13_0`"),
        "{said}"
    );
}
