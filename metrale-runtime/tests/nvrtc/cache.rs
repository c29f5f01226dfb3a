//! The compile cache: hits and misses in memory and on disk, damaged entries.

use std::sync::Arc;

use metrale_runtime::nvrtc::{CacheStats, CompileCache, Program, Target};

use crate::compile::SAXPY;
use crate::harness::Test;

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
    ]
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
