"""Imports point one way: common <- kernels <- engine <- cluster <- actors <- serve <- rl <- bench / cli.

Every ``import`` in a module counts, the lazy ones inside functions too, so a layer
cannot reach upwards by deferring the import. The kernels take tensors only, and the
engine runs without Ray. Outside the engine, an engine is reached through its facade.
"""

import ast
import pathlib
import re
import subprocess
import sys

import pytest

import radixray

ROOT = pathlib.Path(radixray.__file__).parent
ORDER = ["common", "kernels", "engine", "cluster", "actors", "serve", "rl", "bench", "cli"]
RAY_FREE = {"common", "kernels", "engine"}


def _layer(module: str) -> str | None:
    """``radixray.engine.executor.sampler`` -> ``engine``; the package root itself has no layer."""
    parts = module.split(".")
    if parts[0] != "radixray" or len(parts) < 2:
        return None
    return parts[1].removesuffix(".py")


def _modules() -> list[tuple[str, pathlib.Path]]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        if _layer(name) in ORDER:
            out.append((name, path))
    return out


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, node.module)]
            if node.module == "radixray":  # from radixray import engine
                found += [(node.lineno, f"radixray.{a.name}") for a in node.names]
    return found


MODULES = _modules()


def test_every_layer_has_modules():
    assert {_layer(name) for name, _ in MODULES} == set(ORDER)


@pytest.mark.parametrize("name, path", MODULES, ids=[n for n, _ in MODULES])
def test_imports_point_down_the_layers(name, path):
    own = ORDER.index(_layer(name))
    wrong = []
    for line, target in _imports(path):
        layer = _layer(target)
        if layer in ORDER and ORDER.index(layer) > own and layer not in ("bench", "cli"):
            wrong.append(f"line {line}: {target}")
        if layer in ("bench", "cli") and _layer(name) not in ("bench", "cli"):
            wrong.append(f"line {line}: {target}")
        if _layer(name) in RAY_FREE and (target == "ray" or target.startswith("ray.")):
            wrong.append(f"line {line}: {target} (this layer runs without Ray)")
    assert not wrong, f"{name} imports against the layering:\n" + "\n".join(wrong)


def test_importing_the_kernels_and_the_engine_loads_nothing_above_them():
    """The same at run time: import every common, kernels and engine module in a fresh
    process."""
    names = [n for n, _ in MODULES if _layer(n) in RAY_FREE]
    code = ("import sys\n" + "".join(f"import {n}\n" for n in names)
            + "print(sorted({m.split('.')[1] for m in sys.modules if m.startswith('radixray.')}))\n"
            + "print('ray' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True).stdout.split("\n")
    assert out[0] == "['common', 'engine', 'kernels']", out
    assert out[1] == "False"


def _resolve(name: str, path: pathlib.Path, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(parts + ([node.module] if node.module else []))


def _import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (lazy imports included). A package's
    ``__init__`` is not a target: importing a submodule runs it, but it does not make the
    submodule depend on its siblings."""
    paths = dict(MODULES)
    targets = {n for n, p in MODULES if p.name != "__init__.py"}
    graph: dict[str, set[str]] = {n: set() for n in paths}
    for name, path in MODULES:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, path, node)
                found = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            graph[name].update(t for t in found if t in targets and t != name)
    return graph


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: the components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles():
    """Two modules that need each other are one module in two files: a registry or a factory
    breaks the tie."""
    cycles = _strongly_connected(_import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert _strongly_connected(graph) == [["a", "b", "c"]]


QUEUE_FIELDS = {"running", "waiting", "chunked_req", "chunked", "queues"}
SCHED = ROOT / "engine" / "sched"


def _queue_reads(path: pathlib.Path) -> list[str]:
    """Attribute accesses of the scheduler's queue fields (``x.running``, ``x.queues``, ...)
    in ``path``, other than on ``self`` (a class's own fields of the same name)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr in QUEUE_FIELDS:
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            found.append(f"line {node.lineno}: .{node.attr}")
    return found


@pytest.mark.parametrize("name, path", [(n, p) for n, p in MODULES if SCHED not in p.parents],
                         ids=[n for n, p in MODULES if SCHED not in p.parents])
def test_only_the_scheduler_package_reads_its_queues(name, path):
    """The scheduler's queues change only through its own methods; outside engine/sched/
    code asks it (num_running, num_queued(), enqueue, retract, abort, ...) instead."""
    reads = _queue_reads(path)
    assert not reads, f"{name} reaches into the scheduler's queues:\n" + "\n".join(reads)


def _documented() -> dict[str, set[str]]:
    """docs/structure.md: section folder (``engine``, ``serve``, ``""`` for the package root)
    -> the backticked names in that section's tables."""
    doc = (ROOT.parent / "docs" / "structure.md").read_text()
    found: dict[str, set[str]] = {}
    section = None
    for line in doc.splitlines():
        if line.startswith("## radixray"):
            head = line.split()[1]
            section = head.split("/", 1)[1] if "/" in head else ""
            found.setdefault(section, set())
        elif line.startswith("## "):
            section = None
        elif section is not None and line.startswith("|"):
            first = line.split("|")[1]
            found[section].update(part.strip("` ") for part in first.split(",") if "`" in part)
    return found


def test_structure_doc_lists_every_module():
    """Every module has its line in docs/structure.md, under its top folder's section."""
    documented = _documented()
    missing = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.name == "__init__.py":
            continue
        folder = rel.parts[0] if len(rel.parts) > 1 else ""
        inner = "/".join(rel.parts[1:]) if folder else rel.name
        if inner not in documented.get(folder, set()):
            missing.append(str(rel))
    assert not missing, "modules without a line in docs/structure.md:\n" + "\n".join(missing)


# ---- the engine is reached through its facade ------------------------------------------
ENGINE_PARTS = {"scheduler", "runner", "weights", "memory", "pd"}
ENGINE_NAME = re.compile(r"^(eng|engine|engines|.*_engine)$")
LOOP_CALLS = {"call_in_loop", "CallInLoop"}


def _engine_names(tree: ast.AST) -> set[str]:
    """Names a module binds to an ``Engine(...)``: ``x = Engine(...)``, ``with Engine(...) as
    x``, and ``{...: Engine(...) for ...}`` (then ``x[...]`` is an engine)."""
    def builds_engine(node) -> bool:
        if isinstance(node, ast.DictComp):
            node = node.value
        return isinstance(node, ast.Call) and (
            isinstance(node.func, ast.Name) and node.func.id == "Engine"
            or isinstance(node.func, ast.Attribute) and node.func.attr == "Engine")
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and builds_engine(node.value):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            names |= {t.attr for t in node.targets if isinstance(t, ast.Attribute)}
        elif isinstance(node, ast.withitem) and builds_engine(node.context_expr) \
                and isinstance(node.optional_vars, ast.Name):
            names.add(node.optional_vars.id)
    return names


def _is_engine(node: ast.AST, bound: set[str]) -> bool:
    """Whether an expression is (by its name, or how the module built it) an Engine."""
    if isinstance(node, ast.Name):
        return bool(ENGINE_NAME.match(node.id)) or node.id in bound
    if isinstance(node, ast.Attribute):  # self.engine, worker.engine
        return bool(ENGINE_NAME.match(node.attr)) or node.attr in bound
    if isinstance(node, ast.Subscript):  # engines["on"]
        return _is_engine(node.value, bound)
    if isinstance(node, ast.Call):  # Engine(...).runner
        return node.func.id == "Engine" if isinstance(node.func, ast.Name) else False
    return False


def _reach_ins(source: str, filename: str = "<source>") -> list[str]:
    """Where ``source`` touches an engine's parts or runs code on its scheduler thread."""
    tree = ast.parse(source, filename)
    bound = _engine_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ENGINE_PARTS \
                and _is_engine(node.value, bound):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Attribute) and node.attr in LOOP_CALLS \
                or isinstance(node, ast.Name) and node.id in LOOP_CALLS:
            found.append(f"line {node.lineno}: {ast.unparse(node)} (a typed verb instead)")
        elif isinstance(node, ast.ImportFrom) and any(a.name in LOOP_CALLS for a in node.names):
            found.append(f"line {node.lineno}: imports {node.module} (a typed verb instead)")
    return found


OUTSIDE_ENGINE = [(n, p) for n, p in MODULES if _layer(n) != "engine"]


@pytest.mark.parametrize("name, path", OUTSIDE_ENGINE, ids=[n for n, _ in OUTSIDE_ENGINE])
def test_nothing_outside_the_engine_reaches_into_it(name, path):
    """Outside engine/, an engine is reached through its facade (Engine's methods), never
    through its scheduler, runner, weights, memory or pd objects, nor with code run on its
    scheduler thread (call_in_loop)."""
    found = _reach_ins(path.read_text(), str(path))
    assert not found, f"{name} reaches into the engine:\n" + "\n".join(found)


def test_the_reach_in_finder_finds_reach_ins():
    source = (
        "from radixray.engine.sched.scheduler import CallInLoop\n"
        "def f(self, eng, hi, engines):\n"
        "    self.engine.pd.deliver(1)\n"
        "    eng.scheduler.kv.flush_cache()\n"
        "    engines['on'].runner.dtype\n"
        "    eng.call_in_loop(lambda s: s.waiting)\n"
        "    with Engine(model='m') as hi:\n"
        "        hi.weights.version\n"
        "    other = Engine(model='m')\n"
        "    other.memory.released\n"
        "    self.weights.version, rec.pd, self.engine.limits, engine.snapshot()\n")
    found = _reach_ins(source)
    assert sorted({f.split(":")[0] for f in found}, key=lambda x: int(x.split()[1])) == [
        "line 1", "line 3", "line 4", "line 5", "line 6", "line 8", "line 10"], found
