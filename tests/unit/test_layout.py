"""The layout is the architecture: dependencies point one way, and the tests mirror the tree they test.

server -> engine -> pool -> rpc and rank; launching beside the pool. These tests read the import statements
themselves (tests/e2e/repository/test_layout.py imports the MLX-free modules in a fresh interpreter to see that MLX
stays out). The tests' own tree: a unit test lies in tests/unit/ under the folder of the package it tests, an end-to-end
test in tests/e2e/ under its feature's; every helper they share lies in testkit/.
"""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import pytest

from testkit import ROOT
from testkit.layout import PACKAGE, SERVER, module_name, tier_problem

# What each room may not import at run time (imports under ``if TYPE_CHECKING:`` only name types). From the top:
# the commands, the HTTP server, the engine, the pool, then the ranks and the launching beside each other, and
# under them all the protocol, where models come from, the settings and the machine.
ABOVE_ALL = ("neuron.cli",)
BELOW_ONLY = (
    "neuron.rank", "neuron.pool", "neuron.engine", "neuron.server", "neuron.launch", "neuron.router", *ABOVE_ALL
)  # fmt: skip
FORBIDDEN = {
    "neuron.rpc": ("neuron.",),  # the protocol stands alone (bar itself)
    "neuron.server": (
        "neuron.rank",
        "neuron.pool",
        "neuron.engine.engine",
        "neuron.launch",
        "neuron.router",
        *ABOVE_ALL,
    ),
    # The router forwards to each model's server and loads none itself: no engine, pool, rank or launching.
    "neuron.router": ("neuron.rank", "neuron.pool", "neuron.engine", "neuron.launch", *ABOVE_ALL),
    "neuron.engine": ("neuron.rank", "neuron.server", "neuron.launch", "neuron.router", *ABOVE_ALL),
    "neuron.pool": ("neuron.engine", "neuron.server", "neuron.router", *ABOVE_ALL),
    "neuron.rank": ("neuron.pool", "neuron.engine", "neuron.server", "neuron.launch", "neuron.router", *ABOVE_ALL),
    "neuron.launch": ("neuron.rank", "neuron.pool", "neuron.engine", "neuron.server", "neuron.router", *ABOVE_ALL),
    "neuron.models": BELOW_ONLY,
    "neuron.config": BELOW_ONLY,
    "neuron.system": (*BELOW_ONLY, "neuron.models", "neuron.config"),
}


# The server's API families: each holds its routes, its body's checks, its replies and its part of the OpenAPI
# document. They share only server/common/ (rules and shapes) and server/http.py (the request's skeleton).
FAMILIES = (
    "chat_completions",
    "completions",
    "responses",
    "messages",
    "embeddings",
    "tokenize",
    "models",
    "lora_adapters",
    "hosts",
    "health",
    "status",
    "page",
)


def _import_nodes(path: Path, typing: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """``path``'s import statements at any depth (a function's too); outside ``if TYPE_CHECKING:`` blocks unless
    ``typing``."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if not typing
        and isinstance(node, ast.If)
        and isinstance(node.test, ast.Name)
        and node.test.id == "TYPE_CHECKING"
        for n in ast.walk(node)
    }
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in typing_only]


def _runtime_imports(path: Path) -> list[str]:
    """Every ``neuron...`` name imported by ``path`` at run time: each module, and each name taken from one."""
    out = []
    for node in _import_nodes(path):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
    return [name for name in out if name.startswith("neuron")]


def _modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def import_graph(modules: dict[str, Path], typing: bool = True) -> dict[str, set[str]]:
    """Which neuron modules each one imports (``from package import module`` names the module): the imports that
    only name types too, unless not ``typing`` (a module that names another's types cannot be read without it)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for node in _import_nodes(path, typing):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    edges.add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
        graph[name] = {m for m in edges if m in modules and m != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of two or more modules (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while (member := stack.pop()) != node:
                group.append(member)
            group.append(node)
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_dependencies_point_one_way(room: str) -> None:
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        if name != room and not name.startswith(room + "."):
            continue
        for imported in _runtime_imports(path):
            if imported.startswith(room + ".") or imported == room:
                continue
            if any(imported == f or imported.startswith(f) for f in FORBIDDEN[room]):
                wrong.append(f"{path.relative_to(ROOT)} imports {imported}")
    assert not wrong, "\n".join(wrong)


def deepest_chain(graph: dict[str, set[str]]) -> list[str]:
    """The longest run of imports, each module importing the next (the graph has no circle)."""
    longest: dict[str, list[str]] = {}

    def chain(node: str) -> list[str]:
        if node not in longest:
            longest[node] = [node, *max((chain(nxt) for nxt in sorted(graph[node])), key=len, default=[])]
        return longest[node]

    return max((chain(node) for node in sorted(graph)), key=len, default=[])


def test_no_module_imports_itself_round_a_circle() -> None:
    """A circle means neither module can be read (or loaded) without the other: one of them holds what belongs
    to a third, or they are one module. An import under ``if TYPE_CHECKING:`` counts: it is there because the
    module cannot be read without the other's types. Prints the import graph's shape (``pytest -s``)."""
    graph = import_graph(_modules())
    found = circles(graph)
    assert not found, "import circles: " + "; ".join(" -> ".join(c) for c in found)
    top = sorted(p.name for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists())
    deepest = deepest_chain(graph)
    print(f"circles 0; {len(top)} entries at the top of neuron/; the deepest chain, {len(deepest)} modules: "
          + " -> ".join(deepest))  # fmt: skip


def test_the_circle_check_sees_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_an_import_that_names_only_types_closes_a_circle_too(tmp_path: Path) -> None:
    """A circle planted through a ``TYPE_CHECKING`` import is found; read without such imports it is not."""
    package = tmp_path / "neuron"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from neuron.b import B\n")
    (package / "b.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from neuron.a import A\n")
    modules = {f"neuron.{name}": package / f"{name}.py" for name in ("a", "b")}
    assert circles(import_graph(modules)) == [["neuron.a", "neuron.b"]]
    assert circles(import_graph(modules, typing=False)) == []


# The entries at the top of neuron/: a room per subsystem, and the few leaves every room reads.
TOP_ENTRIES = 20


def test_the_top_of_the_package_holds_rooms_not_a_drawer() -> None:
    top = sorted(p.name for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists())
    assert len(top) <= TOP_ENTRIES, f"{len(top)} entries at the top of neuron/: {top}"


def _family_paths(family: str) -> list[Path]:
    folder = SERVER / family
    return sorted(folder.rglob("*.py")) if folder.is_dir() else [SERVER / f"{family}.py"]


def test_every_folder_of_modules_is_a_package() -> None:
    """setuptools' ``find`` packages only folders with an ``__init__.py``: one without it imports here (as a
    namespace package) and is missing from the wheel, the .deb and the .rpm."""
    folders = {path.parent for path in PACKAGE.rglob("*.py") if "__pycache__" not in path.parts}
    bare = sorted(str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").exists())
    assert not bare, f"folders of modules without __init__.py: {bare}"


def test_every_server_module_is_a_family_common_or_the_skeleton() -> None:
    """A new module is placed on purpose: in a family, in common/, or beside app.py as the HTTP plumbing."""
    plumbing = {"__init__", "app", "http", "openapi", "guard", "keys", "connections", "keepalive", "listener"}
    owned = {path for family in FAMILIES for path in _family_paths(family)}
    stray = [
        str(path.relative_to(ROOT))
        for path in sorted(SERVER.rglob("*.py"))
        if path not in owned and path.parent != SERVER / "common" and path.stem not in plumbing
    ]
    assert not stray, f"server modules outside a family, common/ and the skeleton: {stray}"


@pytest.mark.parametrize("family", FAMILIES)
def test_no_server_family_imports_another(family: str) -> None:
    """A family reads common/ and the skeleton, never another family: a rule two families share moves to common/."""
    others = tuple(f"neuron.server.{other}" for other in FAMILIES if other != family)
    wrong = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in _family_paths(family)
        for name in _runtime_imports(path)
        if any(name == other or name.startswith(other + ".") for other in others)
    ]
    assert not wrong, "\n".join(wrong)


def test_common_and_the_skeleton_import_no_family() -> None:
    """What the families share depends on none of them; only app.py and openapi.py put them together."""
    families = tuple(f"neuron.server.{family}" for family in FAMILIES)
    paths = [*sorted((SERVER / "common").rglob("*.py")), SERVER / "http.py", SERVER / "keepalive.py"]
    wrong = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in paths
        for name in _runtime_imports(path)
        if any(name == f or name.startswith(f + ".") for f in families)
    ]
    assert not wrong, "\n".join(wrong)


# The process-global group: MLX keeps one per process, so joining, leaving and remembering it live in one module.
GROUP_STATE = PACKAGE / "rank" / "dist" / "group.py"


def _group_state_touches(path: Path) -> list[str]:
    """Where ``path`` joins a group (``mx.distributed.init``), makes MLX forget one (``clear_backends``), or
    reads or writes the process's record of it (``_in_group``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr == "init":
            if isinstance(node.value, ast.Attribute) and node.value.attr == "distributed":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} mx.distributed.init")
        if isinstance(node, ast.Attribute) and node.attr in ("clear_backends", "_in_group"):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.attr}")
        elif isinstance(node, ast.Name) and node.id in ("clear_backends", "_in_group"):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.id}")
        elif isinstance(node, ast.Global) and "_in_group" in node.names:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} global _in_group")
    return found


def test_only_the_group_module_touches_the_process_global_group() -> None:
    assert _group_state_touches(GROUP_STATE), "the check finds nothing even where the state lives"
    elsewhere = [t for path in sorted(PACKAGE.rglob("*.py")) if path != GROUP_STATE for t in _group_state_touches(path)]
    assert not elsewhere, "the process-global group touched outside rank/dist/group.py:\n" + "\n".join(elsewhere)


# A class past this many lines is split along a seam a newcomer would guess (the developer guide).
CLASS_LINES = 300


def test_no_class_runs_past_the_limit() -> None:
    long = [
        f"{path.relative_to(ROOT)}: {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in sorted(PACKAGE.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and node.end_lineno and node.end_lineno - node.lineno + 1 > CLASS_LINES
    ]
    assert not long, f"classes past {CLASS_LINES} lines:\n" + "\n".join(long)


# No class of neuron inherits another of neuron's: each job is an object of its own (the developer guide).


def _neuron_names(tree: ast.Module, module: str) -> dict[str, str]:
    """What each name a module binds stands for, in full, where it is neuron's: the module's own classes, and what
    it imports from neuron (a module, or a name taken from one)."""
    names = {node.name: f"{module}.{node.name}" for node in tree.body if isinstance(node, ast.ClassDef)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("neuron"):
            names.update({alias.asname or alias.name: f"{node.module}.{alias.name}" for alias in node.names})
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("neuron"):
                    names[alias.asname or "neuron"] = alias.name if alias.asname else "neuron"
    return names


def _base_name(base: ast.expr, names: dict[str, str]) -> str:
    """A base class in full (``neuron.x.Y``) where it is neuron's, else as written (``Generic``, ``RuntimeError``)."""
    while isinstance(base, ast.Subscript):  # Generic[T], PerSequence[_Held]
        base = base.value
    written = ast.unparse(base)
    head, _, rest = written.partition(".")
    return ".".join(filter(None, [names[head], rest])) if head in names else written


def neuron_inheritance(sources: dict[str, str]) -> list[tuple[str, str, str]]:
    """Every class in ``sources`` (each file's text, by its path from the repository's root) with a base that is
    a class of neuron's, as (path, class, base); a class is known by its own name wherever a module re-exports it.
    Exceptions deriving from neuron's own are left out: that is what an exception's base is for."""
    bases_of: dict[str, list[str]] = {}  # class name -> its bases, in full, for every class defined in ``sources``
    found: list[tuple[str, str, list[str]]] = []
    for path, text in sources.items():
        tree = ast.parse(text)
        names = _neuron_names(tree, module_name(ROOT / path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = [_base_name(base, names) for base in node.bases]
                bases_of.setdefault(node.name, []).extend(bases)
                found.append((path, node.name, bases))
    builtin = {name for name, value in vars(builtins).items() if isinstance(value, type)}
    exceptions = {name for name in builtin if issubclass(getattr(builtins, name), BaseException)}
    while True:  # a class is an exception when a base is one, builtin or neuron's
        more = {
            name
            for name, bases in bases_of.items()
            if any(b in exceptions or (b.startswith("neuron.") and b.rpartition(".")[2] in exceptions) for b in bases)
        }
        if more <= exceptions:
            break
        exceptions |= more
    return [
        (path, name, base)
        for path, name, bases in found
        for base in bases
        if base.startswith("neuron.") and base.rpartition(".")[2] in bases_of.keys() - exceptions
    ]


def test_no_class_inherits_another_of_neurons() -> None:
    """A class that inherits another of neuron's borrows attributes a reader must look for up the chain: each job
    is an object of its own, held and called (the developer guide)."""
    sources = {str(path.relative_to(ROOT)): path.read_text() for path in sorted(PACKAGE.rglob("*.py"))}
    found = [f"{path}: {name}({base})" for path, name, base in neuron_inheritance(sources)]
    assert not found, "classes that inherit one of neuron's:\n" + "\n".join(found)


def test_the_inheritance_check_sees_a_chain() -> None:
    sources = {
        "neuron/a.py": "class Base: ...\nclass Same(Base): ...\nclass AError(RuntimeError): ...\n",
        "neuron/b/__init__.py": "from neuron.a import Base\n",
        "neuron/b/c.py": (
            "import neuron.a\nimport neuron.a as aa\nfrom neuron import a\nfrom neuron.b import Base as Other\n"
            "from typing import Generic, TypeVar\nT = TypeVar('T')\n"
            "class Dotted(neuron.a.Base): ...\nclass Aliased(aa.Base): ...\nclass Module(a.Base): ...\n"
            "class Reexported(Other): ...\nclass Kept(Generic[T]): ...\nclass BError(a.AError): ...\n"
            "class Sub(Kept[int]): ...\nclass Free(Exception): ...\n"
        ),
    }
    found = {(path, name) for path, name, _ in neuron_inheritance(sources)}
    assert found == {
        ("neuron/a.py", "Same"),
        ("neuron/b/c.py", "Dotted"),
        ("neuron/b/c.py", "Aliased"),
        ("neuron/b/c.py", "Module"),
        ("neuron/b/c.py", "Reexported"),
        ("neuron/b/c.py", "Sub"),
    }


def test_every_rank_steps_through_one_function() -> None:
    """Rank 0 (the pool, on its thread) and the workers run a step through ``rank.rank.run`` alone: nothing else
    drives a rank's run-ahead or reads its fingerprint, so the two step paths cannot drift apart again."""
    driven = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.func.attr}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path not in [PACKAGE / "rank" / name for name in ("rank.py", "ahead.py", "holdings.py")]
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("run_ahead", "fed", "fingerprint")
    ]
    assert not driven, "a rank's step driven outside rank/rank.py:\n" + "\n".join(driven)
    for caller in ("neuron/cli/worker.py", "neuron/pool/pool.py"):
        assert "neuron.rank.rank.run" in _runtime_imports(ROOT / caller), f"{caller} does not step through run"


# The tests mirror the tree: a folder under tests/unit/ names the package (or module) of neuron/ whose unit tests it
# holds, a folder under tests/e2e/ the feature it serves end to end, and a test shares helpers only through testkit/.
TESTS = ROOT / "tests"
LOOSE_FILES = 10  # files directly in tests/: conftest.py, and little else


def unmirrored(unit: Path, package: Path) -> list[str]:
    """Each folder under ``unit`` (tests/unit/) that names no package or module at the same place under ``package``
    (neuron/): tests/unit/rank/kv/ is neuron/rank/kv/'s, tests/unit/grammar/ would be neuron/grammar.py's."""
    folders = (p for p in unit.rglob("*") if p.is_dir() and not any(n.startswith((".", "__")) for n in p.parts))
    stray = []
    for folder in sorted(folders):
        mirrored = package / folder.relative_to(unit)
        if not (mirrored / "__init__.py").exists() and not mirrored.with_suffix(".py").exists():
            stray.append(str(folder.relative_to(unit.parent)))
    return stray


def shared_through_tests(*folders: Path) -> list[str]:
    """Each import of ``conftest`` or of a test module (``test_*``) in a file under ``folders``: pytest loads those
    itself, under names of its choosing, and what tests share lies in testkit/."""
    found = []
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            for node in _import_nodes(path, typing=True):
                if isinstance(node, ast.ImportFrom):
                    names = [".".join(filter(None, [node.module, alias.name])) for alias in node.names]
                else:
                    names = [alias.name for alias in node.names]
                found += [
                    f"{path.relative_to(folder.parent)}:{node.lineno} imports {name}"
                    for name in names
                    if any(part == "conftest" or part.startswith("test_") for part in name.split("."))
                ]
    return found


def loose_files(tests: Path) -> str | None:
    """What is wrong with the files directly in ``tests`` (tests/): more than ``LOOSE_FILES`` of them, a drawer that a
    folder under tests/unit/ or tests/e2e/ should be holding. None where nothing is."""
    loose = sorted(p.name for p in tests.iterdir() if p.is_file())
    return f"{len(loose)} files directly in {tests.name}/: {loose}" if len(loose) > LOOSE_FILES else None


def test_every_unit_folder_names_a_package_or_module_of_neuron() -> None:
    stray = unmirrored(TESTS / "unit", PACKAGE)
    assert not stray, f"folders under tests/unit/ that name nothing in neuron/: {stray}"


def test_the_mirror_check_sees_a_folder_that_names_nothing(tmp_path: Path) -> None:
    for package in ("neuron", "neuron/engine", "neuron/rank", "neuron/rank/kv"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "neuron" / "grammar.py").write_text("")
    for folder in ("engine", "grammar", "rank/kv", "rank/nowhere", "pool", "engine/__pycache__"):
        (tmp_path / "tests" / "unit" / folder).mkdir(parents=True)
    assert unmirrored(tmp_path / "tests" / "unit", tmp_path / "neuron") == ["unit/pool", "unit/rank/nowhere"]


def test_no_test_imports_conftest_or_another_test() -> None:
    found = shared_through_tests(TESTS, ROOT / "testkit", ROOT / "bench")
    assert not found, "imports of conftest or a test module (move what they share to testkit/):\n" + "\n".join(found)


def test_the_sharing_check_sees_an_import_of_conftest_and_of_a_test(tmp_path: Path) -> None:
    folder = tmp_path / "tests" / "e2e"
    folder.mkdir(parents=True)
    (folder / "test_a.py").write_text("from conftest import Server\nfrom testkit import serving\n")
    (folder / "test_b.py").write_text("def test_b() -> None:\n    from test_pool import scenario\n    import pytest\n")
    (folder / "test_c.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    import tests.conftest\n"
    )
    (folder / "test_d.py").write_text("from . import test_a\n")
    assert shared_through_tests(folder) == [
        "e2e/test_a.py:1 imports conftest.Server",
        "e2e/test_b.py:2 imports test_pool.scenario",
        "e2e/test_c.py:4 imports tests.conftest",
        "e2e/test_d.py:1 imports test_a",
    ]


def test_the_tests_folder_holds_folders_not_a_drawer() -> None:
    assert loose_files(TESTS) is None, loose_files(TESTS)


def test_the_drawer_check_sees_one_file_too_many(tmp_path: Path) -> None:
    (tmp_path / "unit").mkdir()
    for n in range(LOOSE_FILES):
        (tmp_path / f"helper_{n}.py").write_text("")
    assert loose_files(tmp_path) is None  # a folder is not a file
    (tmp_path / "one_more.py").write_text("")
    assert loose_files(tmp_path) == f"{LOOSE_FILES + 1} files directly in {tmp_path.name}/: " + str(
        sorted([*(f"helper_{n}.py" for n in range(LOOSE_FILES)), "one_more.py"])
    )


def test_the_tier_check_sees_a_test_in_the_wrong_folder() -> None:
    """tests/conftest.py applies ``tier_problem`` to every collected test (a problem stops the run): here each way a
    test can lie in the wrong tier's folder, planted, and the ways it can lie right."""
    for where, tiers, fixtures in (
        ("unit/engine/test_a.py", [], []),
        ("unit/engine/test_a.py", ["unit"], []),
        ("e2e/serving/test_a.py", [], ["tiny_models"]),
        ("e2e/hosts/test_a.py", ["hosts"], ["tiny_alone"]),
    ):
        assert tier_problem(Path(where), tiers, fixtures) is None, (where, tiers, fixtures)
    for where, tiers, fixtures, says in (
        ("e2e/serving/test_a.py", ["unit"], [], "is marked unit but lies outside tests/unit/"),
        ("test_a.py", ["unit"], [], "is marked unit but lies outside tests/unit/"),
        ("unit/rank/test_a.py", ["packaging"], [], "lies under tests/unit/ but is marked packaging"),
        (
            "unit/test_a.py",
            [],
            ["anyio_backend", "tiny_models"],
            "is a unit test (under tests/unit/) but uses tiny_models",
        ),
        ("e2e/hosts/test_a.py", ["e2e", "hosts"], [], "is marked e2e and hosts: a test belongs to one tier"),
    ):
        problem = tier_problem(Path(where), tiers, fixtures)
        assert problem is not None and problem.startswith(says), (where, problem)
