//! Error texts are composed without a space before a colon and without doubled
//! spaces: every string literal of the crate's source is read (the pieces every
//! text is made of), and `stream.subject("")`, the one piece that used to end
//! in a space, is checked where it is used, in the fault-injection suite.

use std::path::Path;

/// The string literals of `src` (ordinary and raw; a `\` line continuation
/// skips the next line's indentation, as the compiler does), with their lines.
fn literals(src: &str) -> Vec<(usize, String)> {
    let b = src.as_bytes();
    let (mut i, mut out) = (0, Vec::new());
    let line = |at: usize| src[..at].matches('\n').count() + 1;
    while i < b.len() {
        if src[i..].starts_with("//") {
            i = src[i..].find('\n').map_or(b.len(), |j| i + j);
        } else if src[i..].starts_with("/*") {
            i = src[i..].find("*/").map_or(b.len(), |j| i + j + 2);
        } else if b[i] == b'r'
            && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_'))
            && src[i + 1..].trim_start_matches('#').starts_with('"')
        {
            let hashes = src[i + 1..].len() - src[i + 1..].trim_start_matches('#').len();
            let start = i + 2 + hashes;
            let close = format!("\"{}", "#".repeat(hashes));
            let end = src[start..].find(&close).map_or(b.len(), |j| start + j);
            out.push((line(i), src[start..end].to_owned()));
            i = end + close.len();
        } else if b[i] == b'"' {
            let (mut j, mut text) = (i + 1, String::new());
            while j < b.len() && b[j] != b'"' {
                if b[j] == b'\\' && b.get(j + 1) == Some(&b'\n') {
                    j += 2;
                    while j < b.len() && b[j].is_ascii_whitespace() {
                        j += 1;
                    }
                } else if b[j] == b'\\' {
                    text.push_str(&src[j..j + 2]);
                    j += 2;
                } else {
                    let c = src[j..].chars().next().unwrap();
                    text.push(c);
                    j += c.len_utf8();
                }
            }
            out.push((line(i), text));
            i = j + 1;
        } else if b[i] == b'\'' && b.get(i + 1) == Some(&b'\\') {
            i = src[i + 2..].find('\'').map_or(b.len(), |j| i + 3 + j);
        } else if b[i] == b'\'' && b.get(i + 2) == Some(&b'\'') {
            i += 3;
        } else {
            i += src[i..].chars().next().map_or(1, char::len_utf8);
        }
    }
    out
}

fn visit(dir: &Path, found: &mut Vec<String>, files: &mut usize) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n != "tests") {
                visit(&path, found, files);
            }
        } else if path.extension().is_some_and(|e| e == "rs") {
            *files += 1;
            let src = std::fs::read_to_string(&path).unwrap();
            for (line, text) in literals(&src) {
                if text.contains(" :") || text.contains("  ") {
                    found.push(format!("{}:{line}: {text:?}", path.display()));
                }
            }
        }
    }
}

#[test]
fn no_literal_has_a_space_before_a_colon_or_a_double_space() {
    let (mut found, mut files) = (Vec::new(), 0);
    visit(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        &mut found,
        &mut files,
    );
    assert!(files > 50, "{files} files read");
    assert!(found.is_empty(), "{}", found.join("\n"));
    // The reader itself: a continuation's indentation is not a double space.
    let sample = "let a = \"x: \\\n        y\"; let b = r#\"p  q\"#;";
    assert_eq!(
        literals(sample),
        [(1, "x: y".to_owned()), (2, "p  q".to_owned())]
    );
}

/// The launch check compares the count and each size, not alignment (the
/// fault-injection test `args::alignment_is_left_to_the_drivers_offsets` pins
/// the behaviour): no doc may say otherwise.
#[test]
fn no_doc_says_a_launch_compares_alignment() {
    let wrong = [
        "alignment are checked",
        "alignments are checked",
        "alignments against",
        "offset a multiple of the argument's alignment",
        "offset that is a multiple of it (checked",
    ];
    let mut texts = Vec::new();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for dir in ["src", "src/launch", "src/graph", "src/guide"] {
        for entry in std::fs::read_dir(root.join(dir)).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "rs" || e == "md") {
                texts.push((path.clone(), std::fs::read_to_string(&path).unwrap()));
            }
        }
    }
    // The workspace's README (absent from the packaged crate, which checks
    // its own sources only).
    if let Ok(readme) = std::fs::read_to_string(root.join("../README.md")) {
        texts.push((root.join("../README.md"), readme));
    }
    for (path, text) in texts {
        // Doc comments joined into running text.
        let flat = text
            .lines()
            .map(|l| {
                l.trim()
                    .trim_start_matches("///")
                    .trim_start_matches("//!")
                    .trim()
            })
            .collect::<Vec<_>>()
            .join(" ");
        for w in wrong {
            assert!(!flat.contains(w), "{}: says {w:?}", path.display());
        }
    }
}
