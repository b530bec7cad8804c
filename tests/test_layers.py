"""The house's floors: every import in streamer/ and cli/ (at the top of a module or inside a function) goes to
the same floor or one below, and no modules import each other in a cycle. Read from the source with `ast`, the
way a reader would follow the imports, so a late import inside a function cannot hide an upward one."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# From the ground up. A module belongs to the floor of the longest prefix that names it.
FLOORS = [
    # facts and small helpers: errors, formats, sizes, options, the budget's arithmetic, mappings, buffers
    ("base", ["streamer", "streamer.errors", "streamer.formats", "streamer.io", "streamer.timing",
              "streamer.filewatch", "streamer.budget", "streamer.options", "streamer.mapping", "streamer.buffers",
              "streamer.interrupts"]),
    ("kernels", ["streamer.kernels"]),  # numba only
    # bytes to named tensors, the model's configuration, tokens; per-sequence state
    ("file", ["streamer.gguf_file", "streamer.config", "streamer.tokenizer", "streamer.pretokenize",
              "streamer.pagein", "streamer.inram", "streamer.weights", "streamer.state", "streamer.sampler"]),
    ("experts", ["streamer.experts", "streamer.traffic", "streamer.trace"]),  # storage: no model, no router
    ("layers", ["streamer.mixers", "streamer.model", "streamer.moe", "streamer.moe_compute", "streamer.moe_build"]),
    ("runtime", ["streamer.session", "streamer.generate", "streamer.chat", "streamer.perplexity", "streamer.bench",
                 "streamer.replay", "streamer.plan", "streamer.warmup", "streamer.plots", "streamer.synth",
                 "streamer.train"]),
    ("front", ["streamer.server", "streamer.cli"]),
]  # fmt: skip


def modules() -> dict[str, Path]:
    out = {}
    for base, pkg in ((ROOT / "streamer", "streamer"), (ROOT / "cli", "streamer.cli")):
        for p in base.rglob("*.py"):
            parts = [pkg, *p.relative_to(base).with_suffix("").parts]
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def imports(mods: dict[str, Path]) -> set[tuple[str, str, int]]:
    """(importer, imported, line) for every import of a project module."""

    def resolve(name: str) -> str:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    edges = set()
    for m, p in mods.items():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    pkg = m.split(".") if p.name == "__init__.py" else m.split(".")[:-1]
                    base = ".".join(pkg[: len(pkg) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for t in {resolve(n) for n in names if n.split(".")[0] == "streamer"} - {"", m}:
                edges.add((m, t, node.lineno))
    return edges


def floor(m: str) -> int:
    best = max(((len(p), i) for i, (_, ps) in enumerate(FLOORS) for p in ps if m == p or m.startswith(p + ".")),
               default=None)  # fmt: skip
    assert best is not None, f"{m} is on no floor: add it to FLOORS"
    return best[1]


def test_every_import_goes_to_the_same_floor_or_below():
    mods = modules()
    up = [
        f"{a}:{line} ({FLOORS[floor(a)][0]}) imports {b} ({FLOORS[floor(b)][0]})"
        for a, b, line in sorted(imports(mods))
        if floor(b) > floor(a)
    ]
    assert not up, "\n".join(up)


def test_no_import_cycle():
    graph: dict[str, set[str]] = {}
    for a, b, _ in imports(modules()):
        if not (b == "streamer" or a.startswith(b + ".")):  # a package's own __init__ runs first anyway
            graph.setdefault(a, set()).add(b)
    done, path, cycles = set(), [], []

    def visit(m: str) -> None:
        if m in path:
            cycles.append(path[path.index(m) :] + [m])
            return
        if m in done:
            return
        path.append(m)
        for n in sorted(graph.get(m, ())):
            visit(n)
        path.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)
