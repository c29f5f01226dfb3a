//! The compile cache: hits and misses in memory and on disk, damaged entries,
//! include folders and the NVRTC build in the key.

use std::sync::Arc;

use metrale_runtime::nvrtc::{CacheStats, CompileCache, Program, Target};

use crate::compile::SAXPY;
use crate::harness::{run_child, Test};

pub fn tests() -> Vec<Test> {
    vec![
        Test {
            name: "cache::memory_hit_and_miss",
            run: memory_hit_and_miss,
        },
        Test {
            name: "cache::every_key_part_matters",
            run: every_key_part_matters,
        },
        Test {
            name: "cache::disk_hit_across_caches",
            run: disk_hit_across_caches,
        },
        Test {
            name: "cache::corrupt_entries_are_replaced",
            run: corrupt_entries_are_replaced,
        },
        Test {
            name: "cache::memory_budget_is_kept",
            run: memory_budget_is_kept,
        },
        Test {
            name: "cache::a_header_changed_under_an_include_folder_misses",
            run: a_header_changed_under_an_include_folder_misses,
        },
        Test {
            name: "cache::another_nvrtc_build_misses",
            run: another_nvrtc_build_misses,
        },
    ]
}

/// A child: compile one program through a disk cache in `METRALE_TEST_CACHE_DIR`
/// and print how it was answered.
pub fn cache_compile_and_print() {
    let dir = std::env::var("METRALE_TEST_CACHE_DIR").unwrap();
    let cache = CompileCache::new().on_disk(dir).unwrap();
    match cache.compile(&Program::new("saxpy.cu", SAXPY), Target::Sm(90)) {
        Ok(_) => {
            let s = cache.stats();
            println!("misses {} disk hits {}", s.misses, s.disk_hits);
        }
        Err(e) => println!("error: {e}"),
    }
}

/// Headers NVRTC reads itself from a folder are part of the key: an edit, an
/// edit that restores the size and the modification time, and a new file each
/// miss, in memory and on disk.
fn a_header_changed_under_an_include_folder_misses() {
    let dir = folder("include");
    let inc = dir.join("inc");
    std::fs::create_dir_all(inc.join("sub")).unwrap();
    let header = inc.join("sub").join("v.h");
    std::fs::write(&header, "#define V 1\n").unwrap();
    let p = Program::new(
        "inc.cu",
        "#include \"sub/v.h\"\nextern \"C\" __global__ void k(int* x) { x[0] = V; }\n",
    )
    .include_path(inc.to_str().unwrap());
    let disk = dir.join("cache");
    let cache = CompileCache::new().on_disk(&disk).unwrap();
    cache.compile(&p, Target::Sm(90)).unwrap();
    cache.compile(&p, Target::Sm(90)).unwrap();
    assert_eq!(cache.stats(), stats(1, 0, 1, 0));
    let first_path = cache.entry_path(&p, Target::Sm(90)).unwrap().unwrap();

    // Same size, new text: a miss in memory and on disk.
    std::fs::write(&header, "#define V 2\n").unwrap();
    let changed = cache.compile(&p, Target::Sm(90)).unwrap();
    assert_eq!(cache.stats(), stats(1, 0, 2, 0), "an edited header hit");
    assert_ne!(
        cache.entry_path(&p, Target::Sm(90)).unwrap().unwrap(),
        first_path
    );
    let fresh = CompileCache::new().on_disk(&disk).unwrap();
    assert_eq!(*fresh.compile(&p, Target::Sm(90)).unwrap(), *changed);
    assert_eq!(
        fresh.stats(),
        stats(0, 1, 0, 0),
        "the edited header's own entry"
    );

    // Back to the first text with the first modification time: the change time
    // still tells them apart (the entry of the first text is not handed out for
    // what may be other bytes).
    let before = std::fs::metadata(&header).unwrap().modified().unwrap();
    std::fs::write(&header, "#define V 3\n").unwrap();
    std::fs::File::options()
        .write(true)
        .open(&header)
        .unwrap()
        .set_modified(before)
        .unwrap();
    cache.compile(&p, Target::Sm(90)).unwrap();
    assert_eq!(
        cache.stats().misses,
        3,
        "size and mtime restored, still a miss"
    );

    // A new file in the folder is a miss too (it may shadow an include).
    std::fs::write(inc.join("other.h"), "").unwrap();
    cache.compile(&p, Target::Sm(90)).unwrap();
    assert_eq!(cache.stats().misses, 4, "a new header hit");
    cache.compile(&p, Target::Sm(90)).unwrap();
    assert_eq!(cache.stats().memory_hits, 2, "nothing changed: a hit");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A copy of `lib` with one byte of its GNU build ID changed: the same code,
/// told apart as another build.
fn with_other_build_id(lib: &[u8]) -> Vec<u8> {
    // A note header: namesz 4, descsz, type 3 (NT_GNU_BUILD_ID), then "GNU\0".
    let tail = [3u8, 0, 0, 0, b'G', b'N', b'U', 0];
    let at = lib
        .windows(tail.len())
        .position(|w| w == tail)
        .filter(|&at| at >= 8 && lib[at - 8..at - 4] == [4, 0, 0, 0])
        .expect("a GNU build ID note");
    let mut out = lib.to_vec();
    out[at + tail.len()] ^= 0xff;
    out
}

/// The key holds the loaded NVRTC's build, not only its major.minor: a copy of
/// the same library at another path still hits, a library of another build
/// (same version, another build ID) misses. Each in a child process, through one
/// disk cache.
fn another_nvrtc_build_misses() {
    let Some(dir) = std::env::var_os("METRALE_LIBNVRTC_PATH")
        .filter(|p| !p.is_empty())
        .and_then(|p| {
            std::path::PathBuf::from(p)
                .parent()
                .map(std::path::PathBuf::from)
        })
    else {
        println!("    (METRALE_LIBNVRTC_PATH unset: no library file to copy)");
        return;
    };
    let root = folder("build");
    let cache_dir = root.join("cache");
    let lib_in = |name: &str, bytes: &[u8]| {
        let d = root.join(name);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("libnvrtc.so.13"), bytes).unwrap();
        for entry in std::fs::read_dir(&dir).unwrap().flatten() {
            let n = entry.file_name();
            if n.to_string_lossy().starts_with("libnvrtc-builtins.so") {
                std::fs::copy(entry.path(), d.join(&n)).unwrap();
            }
        }
        d.join("libnvrtc.so.13")
    };
    let original = std::fs::read(dir.join("libnvrtc.so.13")).unwrap();
    let copy = lib_in("copy", &original);
    let other = lib_in("other", &with_other_build_id(&original));
    drop(original);
    let run = |lib: &std::path::Path| {
        let out = run_child(
            "cache_compile_and_print",
            &[
                ("METRALE_LIBNVRTC_PATH", lib.to_str().unwrap()),
                ("METRALE_TEST_CACHE_DIR", cache_dir.to_str().unwrap()),
                ("LD_LIBRARY_PATH", ""),
            ],
        );
        let said = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        assert!(
            out.status.success(),
            "child failed: {said}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        said
    };
    let here = dir.join("libnvrtc.so.13");
    assert_eq!(run(&here), "misses 1 disk hits 0");
    assert_eq!(run(&here), "misses 0 disk hits 1");
    assert_eq!(
        run(&copy),
        "misses 0 disk hits 1",
        "the same build elsewhere"
    );
    assert_eq!(run(&other), "misses 1 disk hits 0", "another build hit");
    assert_eq!(run(&other), "misses 0 disk hits 1");
    let _ = std::fs::remove_dir_all(&root);
}

fn folder(tag: &str) -> std::path::PathBuf {
    let dir =
        std::env::temp_dir().join(format!("metrale-nvrtc-cache-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn stats(memory_hits: u64, disk_hits: u64, misses: u64, replaced_corrupt: u64) -> CacheStats {
    CacheStats {
        memory_hits,
        disk_hits,
        misses,
        replaced_corrupt,
    }
}

fn memory_hit_and_miss() {
    let cache = CompileCache::new();
    let p = Program::new("saxpy.cu", SAXPY);
    let first = cache.compile(&p, Target::Sm(90)).unwrap();
    assert_eq!(cache.stats(), stats(0, 0, 1, 0));
    let again = cache.compile(&p, Target::Sm(90)).unwrap();
    assert!(Arc::ptr_eq(&first, &again));
    assert_eq!(cache.stats(), stats(1, 0, 1, 0));
    let other = cache.compile(&p, Target::Sm(80)).unwrap();
    assert_eq!(other.cubin_arch(), Some(80));
    assert_eq!(cache.stats(), stats(1, 0, 2, 0));
    // A failed compile is not kept.
    let bad = Program::new("bad.cu", "nope");
    assert!(cache.compile(&bad, Target::Sm(90)).is_err());
    assert!(cache.compile(&bad, Target::Sm(90)).is_err());
    assert_eq!(cache.stats().misses, 2);
    assert_eq!(cache.entry_path(&p, Target::Sm(90)).unwrap(), None);
}

fn every_key_part_matters() {
    let cache = CompileCache::new();
    let base = Program::new(
        "k.cu",
        "#include \"h.h\"\nextern \"C\" __global__ void k(int* x) { x[0] = V; }\n",
    )
    .header("h.h", "#define V 1\n");
    let variants = [
        base.clone(),
        Program::new(
            "k2.cu",
            "#include \"h.h\"\nextern \"C\" __global__ void k(int* x) { x[0] = V; }\n",
        )
        .header("h.h", "#define V 1\n"),
        Program::new(
            "k.cu",
            "#include \"h.h\"\nextern \"C\" __global__ void k(int* x) { x[0] = V + 1; }\n",
        )
        .header("h.h", "#define V 1\n"),
        Program::new(
            "k.cu",
            "#include \"h.h\"\nextern \"C\" __global__ void k(int* x) { x[0] = V; }\n",
        )
        .header("h.h", "#define V 2\n"),
        base.clone().define("X", None),
        base.clone().emit_ptx(),
        base.clone().name_expression("k"),
    ];
    for v in &variants {
        cache.compile(v, Target::Sm(90)).unwrap();
    }
    cache.compile(&base, Target::Compute(90)).unwrap();
    assert_eq!(cache.stats(), stats(0, 0, variants.len() as u64 + 1, 0));
    for v in &variants {
        cache.compile(v, Target::Sm(90)).unwrap();
    }
    assert_eq!(cache.stats().memory_hits, variants.len() as u64);
}

fn disk_hit_across_caches() {
    let dir = folder("disk");
    let p = Program::new("saxpy.cu", SAXPY)
        .emit_ptx()
        .name_expression("saxpy");
    let first = CompileCache::new().on_disk(&dir).unwrap();
    let compiled = first.compile(&p, Target::Sm(90)).unwrap();
    let path = first.entry_path(&p, Target::Sm(90)).unwrap().unwrap();
    assert!(path.is_file(), "{path:?}");
    assert!(path.starts_with(&dir));
    // No temporary file is left behind.
    let files: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
    assert_eq!(files.len(), 1, "{files:?}");

    let second = CompileCache::new().on_disk(&dir).unwrap();
    let loaded = second.compile(&p, Target::Sm(90)).unwrap();
    assert_eq!(second.stats(), stats(0, 1, 0, 0));
    assert_eq!(*loaded, *compiled);
    assert_eq!(loaded.lowered_name("saxpy"), Some("saxpy"));
    second.compile(&p, Target::Sm(90)).unwrap();
    assert_eq!(second.stats(), stats(1, 1, 0, 0));
    second.clear_memory();
    second.compile(&p, Target::Sm(90)).unwrap();
    assert_eq!(second.stats(), stats(1, 2, 0, 0));
    let _ = std::fs::remove_dir_all(&dir);
}

fn corrupt_entries_are_replaced() {
    let dir = folder("corrupt");
    let p = Program::new("saxpy.cu", SAXPY);
    let writer = CompileCache::new().on_disk(&dir).unwrap();
    let good = writer.compile(&p, Target::Sm(90)).unwrap();
    let path = writer.entry_path(&p, Target::Sm(90)).unwrap().unwrap();
    let whole = std::fs::read(&path).unwrap();

    let damages: Vec<(&str, Vec<u8>)> = vec![
        ("truncated", whole[..whole.len() / 2].to_vec()),
        ("one byte short", whole[..whole.len() - 1].to_vec()),
        ("flipped byte", {
            let mut b = whole.clone();
            let mid = b.len() / 2;
            b[mid] ^= 0x40;
            b
        }),
        ("appended", {
            let mut b = whole.clone();
            b.extend_from_slice(b"junk");
            b
        }),
        ("empty", Vec::new()),
        ("not an entry", b"hello".to_vec()),
    ];
    for (what, bytes) in damages {
        std::fs::write(&path, &bytes).unwrap();
        let reader = CompileCache::new().on_disk(&dir).unwrap();
        let out = reader.compile(&p, Target::Sm(90)).unwrap();
        assert_eq!(reader.stats(), stats(0, 0, 1, 1), "{what}");
        assert_eq!(*out, *good, "{what}");
        // Replaced: the file is whole again and a fresh cache hits it.
        assert_eq!(std::fs::read(&path).unwrap(), whole, "{what}");
        let fresh = CompileCache::new().on_disk(&dir).unwrap();
        fresh.compile(&p, Target::Sm(90)).unwrap();
        assert_eq!(fresh.stats(), stats(0, 1, 0, 0), "{what}");
    }
    // An entry of another key under this key's name is not used.
    let other = Program::new("other.cu", SAXPY);
    let other_path = writer.entry_path(&other, Target::Sm(90)).unwrap().unwrap();
    writer.compile(&other, Target::Sm(90)).unwrap();
    std::fs::copy(&other_path, &path).unwrap();
    let reader = CompileCache::new().on_disk(&dir).unwrap();
    let out = reader.compile(&p, Target::Sm(90)).unwrap();
    assert_eq!(out.name(), "saxpy.cu");
    assert_eq!(reader.stats(), stats(0, 0, 1, 1));
    let _ = std::fs::remove_dir_all(&dir);
}

fn memory_budget_is_kept() {
    let p = Program::new("saxpy.cu", SAXPY);
    // Too small for any entry: nothing is kept, every call compiles.
    let tiny = CompileCache::with_memory_limit(16);
    tiny.compile(&p, Target::Sm(90)).unwrap();
    tiny.compile(&p, Target::Sm(90)).unwrap();
    assert_eq!(tiny.stats(), stats(0, 0, 2, 0));
    // Room for about one: the least recently used goes.
    let one = p.clone().compile(Target::Sm(90)).unwrap();
    let budget = one.size_bytes() + 1500;
    let cache = CompileCache::with_memory_limit(budget);
    cache.compile(&p, Target::Sm(90)).unwrap();
    cache.compile(&p, Target::Sm(80)).unwrap();
    cache.compile(&p, Target::Sm(80)).unwrap();
    assert_eq!(cache.stats(), stats(1, 0, 2, 0));
    cache.compile(&p, Target::Sm(90)).unwrap();
    assert_eq!(cache.stats(), stats(1, 0, 3, 0));
}
