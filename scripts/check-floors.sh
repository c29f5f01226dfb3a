#!/usr/bin/env bash
# The house rule of metrale-runtime: imports run downward only, and nothing forms a circle.
#
# Reads every `crate::`, `$crate::`, `super::`, `self::` and child-module path used in
# metrale-runtime/src (use statements and inline paths; comments, doc comments and string
# literals are skipped), resolves each through the re-exports (`pub use`) to the file that
# defines the item, maps every file to its room and every room to its floor (the table below,
# which ARCHITECTURE.md copies), and fails listing
#   - every import that runs upward (a room naming a room on a higher floor),
#   - every circle between rooms of one floor,
#   - every circle between files inside one room (a `mod.rs` that only declares and re-exports
#     its children takes part in none: a re-export is a passage, not a use).
# It ends with the count line `floors: N upward imports, M circles`, exit 0 only when both are 0.
#
# Usage: scripts/check-floors.sh [-v]     (-v also prints every resolved edge)
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 - "$@" <<'PY'
import os, re, sys

VERBOSE = "-v" in sys.argv[1:]
SRC = "metrale-runtime/src"

# The floors. A room is the first module under the crate root. Keep in step with
# ARCHITECTURE.md ("Rooms and floors"); this table is the truth.
FLOORS = {
    "error": 1, "lifetime": 1,
    "blob": 2, "context": 2, "green": 2,
    "module": 3, "device": 3,
    "stream": 4, "nvrtc": 4, "nvtx": 4,
    "host": 5, "function": 5, "memory": 5,
    "launch": 6, "nccl": 6, "blas": 6,
    "registry": 7, "graph": 7,
}
# Rooms that may name anything and that nothing counts against: the crate root (it only
# declares and re-exports), the docs-only guide, and the in-crate unit tests.
EXEMPT = {"<root>", "guide", "tests"}

# ---------------------------------------------------------------------------- lexing
def strip(text):
    """Blank out comments, string, byte-string, raw-string and char literals, keeping
    offsets and newlines, so that paths are only read from code."""
    out = list(text)
    i, n = 0, len(text)

    def blank(a, b):
        for k in range(a, b):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            blank(i, j)
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            blank(i, j)
            i = j
        elif re.match(r'b?r#*"', text[i:i + 64]) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'(b?r)(#*)"', text[i:])
            close = '"' + m.group(2)
            j = text.find(close, i + len(m.group(0)))
            j = n if j < 0 else j + len(close)
            blank(i, j)
            i = j
        elif c == '"' or (c == "b" and text.startswith('b"', i) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_"))):
            j = i + (2 if c == "b" else 1)
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            blank(i, j + 1)
            i = j + 1
        elif c == "'":
            m = re.match(r"'(\\(x[0-9a-fA-F]{2}|u\{[0-9a-fA-F]+\}|.)|[^\\'\n])'", text[i:])
            if m:
                blank(i, i + len(m.group(0)))
                i += len(m.group(0))
            else:
                i += 1  # a lifetime or a label
        else:
            i += 1
    return "".join(out)

# ---------------------------------------------------------------------------- files and modules
def module_of(rel):
    """src-relative file path -> module path (tuple)."""
    parts = rel[:-3].split("/")
    if parts[-1] in ("mod", "lib"):
        parts = parts[:-1]
    return tuple(parts)

files = {}      # module path -> (file, stripped text)
path_mods = {}  # files included with #[path]: file -> module path
for root, _, names in os.walk(SRC):
    for name in sorted(names):
        if not name.endswith(".rs"):
            continue
        full = os.path.join(root, name)
        rel = os.path.relpath(full, SRC).replace(os.sep, "/")
        with open(full, encoding="utf-8") as f:
            text = f.read()
        files[rel] = strip(text)

# `#[path = "..."] mod x;` puts a file at another module path.
by_module = {}
for rel in files:
    if rel.startswith("tests/"):
        continue
    by_module[module_of(rel)] = rel
for rel, code in list(files.items()):
    raw = open(os.path.join(SRC, rel), encoding="utf-8").read()
    for m in re.finditer(r'#\[path\s*=\s*"([^"]+)"\]\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;', raw):
        target = os.path.normpath(os.path.join(os.path.dirname(rel), m.group(1))).replace(os.sep, "/")
        if rel.endswith("mod.rs") or rel == "lib.rs":
            base = module_of(rel)
        else:
            base = module_of(rel)
        by_module[base + (m.group(2),)] = target
file_module = {rel: mod for mod, rel in by_module.items()}

def room_of(rel):
    if rel.startswith("tests/"):
        return "tests"
    mod = file_module.get(rel, ())
    if len(mod) > 1 and mod[1] == "tests":
        return "tests"
    return mod[0] if mod else "<root>"

# ---------------------------------------------------------------------------- inline modules
def inline_modules(code):
    """[(start, end, name)] of `mod name { ... }` blocks in stripped code."""
    spans = []
    for m in re.finditer(r"\bmod\s+(\w+)\s*\{", code):
        depth, j = 1, m.end()
        while j < len(code) and depth:
            if code[j] == "{":
                depth += 1
            elif code[j] == "}":
                depth -= 1
            j += 1
        spans.append((m.start(), j, m.group(1)))
    return spans

def scope_at(rel, spans, pos):
    mod = file_module[rel]
    for a, b, name in spans:
        if a < pos < b:
            mod = mod + (name,)
    return mod

# ---------------------------------------------------------------------------- use trees
def split_top(s):
    parts, depth, cur = [], 0, ""
    for ch in s:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    return parts

def expand(tree, prefix=()):
    """`a::{b, c::d as e, f::*}` -> [(path tuple, alias or None)]."""
    tree = re.sub(r"\s+", " ", tree).strip()
    if not tree:
        return []
    if tree.startswith("{") and tree.endswith("}"):
        out = []
        for part in split_top(tree[1:-1]):
            out += expand(part, prefix)
        return out
    m = re.match(r"^([\w$]+(?:\s*::\s*[\w$]+)*)\s*::\s*(\{.*\}|\*)$", tree)
    if m:
        head = tuple(x.strip() for x in m.group(1).split("::"))
        if m.group(2) == "*":
            return [(prefix + head + ("*",), None)]
        return expand(m.group(2), prefix + head)
    if tree == "*":
        return [(prefix + ("*",), None)]
    alias = None
    m = re.match(r"^(.*?)\s+as\s+(\w+)$", tree)
    if m:
        tree, alias = m.group(1), m.group(2)
    path = prefix + tuple(x.strip() for x in tree.split("::"))
    if path and path[-1] == "self":
        path = path[:-1]
    return [(path, alias)]

USE_RE = re.compile(r"(?:\bpub(?:\s*\([^)]*\))?\s+)?\buse\s+([^;]+);")

def child_mods(rel):
    return set(re.findall(r"\bmod\s+(\w+)\s*;", files[rel]))

def absolute(scope, path, children):
    """Resolve the first segments of a path written in module `scope` to a crate path,
    or None when it names something outside the crate."""
    if not path:
        return None
    head = path[0]
    if head in ("crate", "$crate"):
        return tuple(path[1:])
    if head == "self":
        return scope + tuple(path[1:])
    if head == "super":
        s, rest = scope, list(path)
        while rest and rest[0] == "super":
            s, rest = s[:-1], rest[1:]
        return s + tuple(rest)
    if head in children:
        return scope + tuple(path)
    return None

# Re-exports and private imports per module, for resolution through `use`.
reexports = {}   # module -> {name: absolute path}
globs = {}       # module -> [absolute module paths]
uses = []        # (rel, absolute path, written text, is_pub_use)
for rel, code in files.items():
    if rel not in file_module:
        continue
    spans = inline_modules(code)
    children = child_mods(rel)
    for m in USE_RE.finditer(code):
        scope = scope_at(rel, spans, m.start())
        is_pub = m.group(0).lstrip().startswith("pub")
        kids = children if scope == file_module[rel] else set()
        for path, alias in expand(m.group(1)):
            ap = absolute(scope, path, kids)
            if ap is None:
                continue
            if ap and ap[-1] == "*":
                globs.setdefault(scope, []).append(ap[:-1])
            else:
                name = alias or (ap[-1] if ap else None)
                if name:
                    reexports.setdefault(scope, {})[name] = ap
            uses.append((rel, scope, ap, "::".join(path), is_pub))

def resolve(ap, depth=0):
    """A crate path -> the file that defines it (following re-exports)."""
    if depth > 20:
        return None
    if ap and ap[-1] == "*":
        ap = ap[:-1]
    # longest module prefix that is a file
    for k in range(len(ap), -1, -1):
        mod = tuple(ap[:k])
        if mod in by_module:
            rest = ap[k:]
            if not rest:
                return by_module[mod]
            name = rest[0]
            target = reexports.get(mod, {}).get(name)
            if target is not None and target != mod + (name,):
                return resolve(target + tuple(rest[1:]), depth + 1)
            if not defines(by_module[mod], name):
                for g in globs.get(mod, []):
                    if g in by_module and (name in reexports.get(g, {}) or defines(by_module[g], name)):
                        return resolve(g + (name,), depth + 1)
            return by_module[mod]
    return None

def defines(rel, name):
    return re.search(r"\b(fn|struct|enum|trait|type|const|static|union|mod|macro_rules!)\s+" + re.escape(name) + r"\b", files[rel]) is not None

# ---------------------------------------------------------------------------- edges
edges = {}  # (from file, to file) -> set of written paths
def add(rel, ap, text):
    if rel.startswith("tests/"):
        return
    to = resolve(ap)
    if to is None or to == rel:
        return
    edges.setdefault((rel, to), set()).add(text)

masked_code = {rel: USE_RE.sub(lambda m: " " * len(m.group(0)), code) for rel, code in files.items()}
for rel, scope, ap, text, is_pub in uses:
    if is_pub:
        # A re-export is a passage (uses of it resolve through it), unless the
        # file itself also uses the name it re-exports.
        name = ap[-1] if ap and ap[-1] != "*" else None
        body = re.sub(r"\bmod\s+\w+", " ", masked_code[rel])
        if not name or not re.search(r"(?<![\w:])" + re.escape(name) + r"\b", body):
            continue
    add(rel, ap, text)

INLINE_RE = re.compile(r"(?<![\w:])((?:\$crate|crate|super|self|\w+)(?:\s*::\s*(?:\w+|<))+)")
for rel, code in files.items():
    if rel not in file_module:
        continue
    spans = inline_modules(code)
    children = child_mods(rel)
    for m in INLINE_RE.finditer(masked_code[rel]):
        segs = [s.strip() for s in m.group(1).split("::")]
        segs = [s for s in segs if s and s != "<"]
        if not segs or segs[0] not in ("crate", "$crate", "super", "self") and segs[0] not in children:
            continue
        scope = scope_at(rel, spans, m.start())
        kids = children if scope == file_module[rel] else set()
        ap = absolute(scope, tuple(segs), kids)
        if ap is None:
            continue
        add(rel, ap, "::".join(segs))

# ---------------------------------------------------------------------------- checks
def floor(room):
    return FLOORS.get(room)

problems = []
unknown = sorted({room_of(f) for f in files if room_of(f) not in EXEMPT and room_of(f) not in FLOORS})
for r in unknown:
    problems.append(f"room `{r}` has no floor: add it to the table in scripts/check-floors.sh")

upward = []
for (a, b), texts in sorted(edges.items()):
    ra, rb = room_of(a), room_of(b)
    if ra in EXEMPT or rb in EXEMPT or ra == rb:
        continue
    fa, fb = floor(ra), floor(rb)
    if fa is not None and fb is not None and fb > fa:
        upward.append((a, b, ra, fa, rb, fb, texts))

def sccs(nodes, succ):
    index, low, onstack, stack, out, counter = {}, {}, set(), [], [], [0]
    def visit(v):
        index[v] = low[v] = counter[0]; counter[0] += 1
        stack.append(v); onstack.add(v)
        for w in succ.get(v, ()):
            if w not in index:
                visit(w); low[v] = min(low[v], low[w])
            elif w in onstack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop(); onstack.discard(w); comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    sys.setrecursionlimit(10000)
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out

circles = []
# rooms on one floor
room_succ = {}
for (a, b) in edges:
    ra, rb = room_of(a), room_of(b)
    if ra in EXEMPT or rb in EXEMPT or ra == rb or floor(ra) != floor(rb) or floor(ra) is None:
        continue
    room_succ.setdefault(ra, set()).add(rb)
for comp in sccs(set(room_succ) | {x for s in room_succ.values() for x in s}, room_succ):
    circles.append(("rooms on floor %d" % floor(comp[0]), comp))
# files inside one room
file_succ = {}
for (a, b) in edges:
    if room_of(a) == room_of(b) and room_of(a) not in EXEMPT:
        file_succ.setdefault(a, set()).add(b)
for comp in sccs(set(file_succ) | {x for s in file_succ.values() for x in s}, file_succ):
    circles.append(("files in room `%s`" % room_of(comp[0]), comp))

if VERBOSE:
    for (a, b), texts in sorted(edges.items()):
        print(f"edge {a} -> {b}: {', '.join(sorted(texts))}")

for p in problems:
    print(p)
for a, b, ra, fa, rb, fb, texts in upward:
    print(f"upward: {a} ({ra}, floor {fa}) -> {b} ({rb}, floor {fb}): {', '.join(sorted(texts))}")
for what, comp in circles:
    print(f"circle among {what}: {' <-> '.join(comp)}")
    for a in comp:
        for b in comp:
            key = (a, b) if what.startswith("files") else None
            if key and key in edges:
                print(f"    {a} -> {b}: {', '.join(sorted(edges[key]))}")
    if what.startswith("rooms"):
        for (a, b), texts in sorted(edges.items()):
            if room_of(a) in comp and room_of(b) in comp and room_of(a) != room_of(b):
                print(f"    {a} -> {b}: {', '.join(sorted(texts))}")
print(f"floors: {len(upward)} upward imports, {len(circles)} circles")
sys.exit(0 if not upward and not circles and not problems else 1)
PY
