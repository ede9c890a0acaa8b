"""Every workflow of the distributed-strategy monorepo.

Sessions:
    tests       one fresh venv per package holding only that package, the local pieces it
                declares, torch and the test tools; plus the multi-process integration tests.
    lint        ruff check and ruff format --check, and the lockstep-version check.
    typecheck   mypy --strict over every package and the benchmarks.
    build       a wheel and an sdist per package, metadata checked with twine.
    docs        MkDocs in strict mode, API pages from docstrings.
    bench       the DDP vs FSDP benchmark (CPU/gloo here, CUDA/NCCL on a GPU host).
    estimate    the planner: peak, fit, tokens/s, days and GPU-hours from a model's config.
    peers       the train step beside raw torch, Lightning Fabric and Accelerate.
    microbench  the pytest-benchmark suite: each hot path beside its raw-torch baseline.

torch always comes from one requirement, ``torch==2.13.0`` unless the environment variable
``TORCH_SPEC`` says otherwise (for example ``TORCH_SPEC='torch==2.11.0'``): never a bare
``torch``, which would make pip pick a multi-GB CUDA build.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PYPROJECT = nox.project.load_toml(ROOT / "pyproject.toml")
TORCH_SPEC = os.environ.get("TORCH_SPEC", "torch==2.13.0")

nox.options.reuse_venv = "yes"
# uv builds each session's venv in seconds (torch is linked from its cache, not unpacked
# again for every package's venv); without uv, nox falls back to virtualenv and pip.
nox.options.default_venv_backend = "uv|virtualenv"
# uv does not read pip's configuration: give it the same local wheel folder (where this
# project's machines keep the CPU build of torch), so both pick the same torch.
if "PIP_FIND_LINKS" in os.environ:
    os.environ.setdefault("UV_FIND_LINKS", os.environ["PIP_FIND_LINKS"])
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["tests", "lint", "typecheck"]


@dataclass(frozen=True)
class _Package:
    dist: str
    path: Path
    version: str
    requires: tuple[str, ...]

    @property
    def import_name(self) -> str:
        return self.dist.replace("-", "_")


# uv installs without compiling bytecode; where PYTHONDONTWRITEBYTECODE is set, every process
# would then compile torch's modules again (import torch: ~6 s instead of ~3 s, and the tests
# start many processes). An empty value lets Python cache what the tests import.
_WRITE_BYTECODE = {"PYTHONDONTWRITEBYTECODE": ""}


def _requirement_name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", requirement, maxsplit=1)[0].lower()


def _load_packages() -> dict[str, _Package]:
    folders = sorted((ROOT / "packages").iterdir())
    if (ROOT / "benchmarks" / "pyproject.toml").is_file():
        folders.append(ROOT / "benchmarks")
    packages: dict[str, _Package] = {}
    for folder in folders:
        meta = nox.project.load_toml(folder / "pyproject.toml")["project"]
        packages[meta["name"]] = _Package(
            dist=meta["name"],
            path=folder,
            version=meta["version"],
            requires=tuple(meta.get("dependencies", ())),
        )
    return packages


PACKAGES = _load_packages()


def _local_closure(dist: str) -> list[_Package]:
    """The package and every local package it declares, dependencies first."""
    ordered: list[_Package] = []

    def visit(name: str) -> None:
        package = PACKAGES[name]
        for requirement in package.requires:
            dep = _requirement_name(requirement)
            if dep in PACKAGES and PACKAGES[dep] not in ordered:
                visit(dep)
        if package not in ordered:
            ordered.append(package)

    visit(dist)
    return ordered


def _needs_torch(dist: str) -> bool:
    return any(_requirement_name(r) == "torch" for p in _local_closure(dist) for r in p.requires)


def _install(session: nox.Session, dist: str, *groups: str) -> None:
    """Install one package with its local pieces, torch from TORCH_SPEC, and tool groups.

    torch is installed once per TORCH_SPEC into a shared folder that each venv reaches through
    a ``.pth`` file: a venv still holds only the package, what it declares and the tools, but
    torch's bytecode is compiled once for all the venvs instead of once in each (on this
    project's 2-core machines that was about 10 s of every test session).
    """
    closure = _local_closure(dist)
    paths = [str(p.path) for p in closure]
    extras = [req for group in groups for req in nox.project.dependency_groups(PYPROJECT, group)]
    others = sorted(
        {
            r
            for p in closure
            for r in p.requires
            if _requirement_name(r) not in PACKAGES and _requirement_name(r) != "torch"
        }
    )
    if _needs_torch(dist):
        _link_shared_torch(session)
    session.install(*others, *extras, "hatchling")
    # --no-deps: the local pieces' only other requirement is torch (linked above). Reinstalled
    # every time, so that a reused venv sees this tree, not the previous build.
    session.install("--no-deps", "--force-reinstall", "--no-build-isolation", *paths)


def _link_shared_torch(session: nox.Session) -> None:
    """Install TORCH_SPEC once under .nox and put it on this venv's path with a .pth file."""
    shared = ROOT / ".nox" / ("_torch-" + re.sub(r"[^A-Za-z0-9.]+", "_", TORCH_SPEC))
    if not (shared / ".complete").exists():
        session.install("--target", str(shared), TORCH_SPEC)
        (shared / ".complete").write_text(TORCH_SPEC + "\n")
    purelib = session.run(
        "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", silent=True
    )
    Path(str(purelib).strip(), "_shared_torch.pth").write_text(str(shared) + "\n")


@nox.session
@nox.parametrize("package", [*PACKAGES, "integration"])
def tests(session: nox.Session, package: str) -> None:
    """Run one package's tests with only that package and its declared pieces installed."""
    dist = "distributed-strategy" if package == "integration" else package
    _install(session, dist, "test")
    if dist == "checkpoint-io":  # torchdata asks for an unpinned torch: --no-deps
        session.install("--no-deps", *nox.project.dependency_groups(PYPROJECT, "test-torchdata"))
    # distributed-strategy: transformers' models and its from_pretrained; strategy-bench:
    # --hf-config (its "hf" extra)
    if package in ("distributed-strategy", "strategy-bench"):
        session.install(*nox.project.dependency_groups(PYPROJECT, "test-transformers"))
    parallel: list[str] = []
    # Mostly processes starting and waiting (ranks, torchrun agents, SLURM jobs): two test
    # files at a time use both cores.
    if package in ("strategy-bench", "integration"):
        session.install(*nox.project.dependency_groups(PYPROJECT, "test-parallel"))
        parallel = ["-n", "2", "--dist", "loadfile"]
    if package == "integration":  # torchft's lighthouse and Manager (the wheel ships both)
        session.install("--no-deps", *nox.project.dependency_groups(PYPROJECT, "test-torchft"))
        session.install(*nox.project.dependency_groups(PYPROJECT, "test-torchft-deps"))
    folder = "integration" if package == "integration" else PACKAGES[dist].import_name
    session.run("pytest", f"tests/{folder}", *parallel, *session.posargs, env=_WRITE_BYTECODE)


@nox.session
def lint(session: nox.Session) -> None:
    """Ruff lint and format check, the lockstep-version check, the generated architecture page."""
    _check_lockstep()
    _check_declared_imports()
    _check_architecture_page()
    session.install(*nox.project.dependency_groups(PYPROJECT, "lint"))
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """Mypy in strict mode over every package and the benchmarks (search path derived here)."""
    session.install(TORCH_SPEC, *nox.project.dependency_groups(PYPROJECT, "typecheck"))
    session.install("matplotlib")
    mypy_path = os.pathsep.join(str(_source_root(p)) for p in PACKAGES.values())
    session.run("mypy", *session.posargs, env={"MYPYPATH": mypy_path})


@nox.session
def build(session: nox.Session) -> None:
    """Build a wheel and an sdist of every package and check their metadata."""
    _check_lockstep()
    session.install(*nox.project.dependency_groups(PYPROJECT, "build"))
    out = ROOT / "dist"
    shutil.rmtree(out, ignore_errors=True)
    for package in PACKAGES.values():
        session.run("python", "-m", "build", "--outdir", str(out), str(package.path))
    artifacts = sorted(str(p) for p in out.iterdir())
    session.run("twine", "check", "--strict", *artifacts)
    session.run("check-wheel-contents", *[a for a in artifacts if a.endswith(".whl")])


@nox.session
def docs(session: nox.Session) -> None:
    """Regenerate docs/architecture.md's graph, then build the site with MkDocs (strict)."""
    ARCHITECTURE.write_text(_architecture_page(ARCHITECTURE.read_text()))
    session.install(*nox.project.dependency_groups(PYPROJECT, "docs"))
    session.run("mkdocs", "build", "--strict", "--site-dir", "site", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Run the DDP vs FSDP benchmark; posargs replace the defaults (``nox -s bench -- sweep``)."""
    _install(session, "strategy-bench")
    args = session.posargs or ["run"]
    if not any(a == "--out" or a.startswith("--out=") for a in args) and args[0] != "plot":
        args = [*args, "--out", str(ROOT / "bench-results" / time.strftime("%Y%m%d-%H%M%S"))]
    session.run("strategy-bench", *args)


PLANNER_EXAMPLE = (
    "--hf-config",
    "docs/examples/hf/llama-3-8b",
    "--seq-len",
    "8192",
    "--batch-size",
    "1",
    "--param-dtype",
    "bf16",
    "--activation-checkpointing",
    "--world-size",
    "64",
    "128",
    "--gpu",
    "H100",
    "--train-tokens",
    "1e12",
    "--gpu-hour-price",
    "2.5",
)
"""The README's first command: Llama 3 8B's published shape on 64 and 128 H100s, 1T tokens."""


@nox.session
def estimate(session: nox.Session) -> None:
    """The planner on this machine (no GPU): ``strategy-bench estimate`` with its ``hf`` extra.

    Posargs replace the README's example (``nox -s estimate -- --hf-config PATH ...``).
    """
    _install(session, "strategy-bench")
    bench_meta = nox.project.load_toml(ROOT / "benchmarks" / "pyproject.toml")["project"]
    session.install(*bench_meta["optional-dependencies"]["hf"])
    args = list(session.posargs or PLANNER_EXAMPLE)
    if not any(a == "--out" or a.startswith("--out=") for a in args):
        args += ["--out", str(ROOT / "bench-results" / "estimate"), "--overwrite"]
    session.run("strategy-bench", "estimate", *args)


@nox.session
def peers(session: nox.Session) -> None:
    """The train step beside its peers (raw torch, ours, Fabric, Accelerate), then the pairs.

    Posargs go to ``benchmarks/step_peers.py`` (``nox -s peers -- --rounds 3``).
    """
    _install(session, "strategy-bench")
    bench_meta = nox.project.load_toml(ROOT / "benchmarks" / "pyproject.toml")["project"]
    session.install(*bench_meta["optional-dependencies"]["peers"])
    session.run("python", "benchmarks/step_peers.py", *session.posargs)
    session.run("python", "benchmarks/step_paired.py")


@nox.session
def microbench(session: nox.Session) -> None:
    """Run the pytest-benchmark suite: each case beside its raw-torch baseline, as ratios."""
    _install(session, "strategy-bench", "microbench")
    out = ROOT / "bench-results" / "microbench.json"
    out.parent.mkdir(exist_ok=True)
    session.run(
        "pytest",
        "benchmarks/microbench",
        "-p",
        "no:cacheprovider",
        f"--benchmark-json={out}",
        "--benchmark-columns=median,iqr,rounds",
        *session.posargs,
    )


def _source_root(package: _Package) -> Path:
    return package.path / "src"


# docs/architecture.md: the part between these markers is generated from the pyproject files.
ARCHITECTURE = ROOT / "docs" / "architecture.md"
_BEGIN = "<!-- generated by noxfile.py from the packages' pyproject.toml: do not edit -->"
_END = "<!-- end of generated part -->"


def _architecture_page(page: str) -> str:
    """``page`` with its generated parts rebuilt: the packages' graph and the bench's rooms.

    The packages' dependency table and graph come from PACKAGES; the bench's rooms and the
    imports between them from its source.
    """
    rows = [
        "| package | import | depends on (local pieces) | description |",
        "| --- | --- | --- | --- |",
    ]
    edges = []
    for package in PACKAGES.values():
        deps = [_requirement_name(r) for r in package.requires]
        local = [d for d in deps if d in PACKAGES]
        meta = nox.project.load_toml(package.path / "pyproject.toml")["project"]
        rows.append(
            f"| {package.dist} | `{package.import_name}` | {', '.join(local) or '-'} "
            f"| {meta.get('description', '')} |"
        )
        edges += [f"    {package.import_name} --> {d.replace('-', '_')}" for d in local]
    graph = ["```mermaid", "graph BT", *edges, "```"]
    generated = "\n".join([_BEGIN, "", *rows, "", *graph, "", _END])
    head, found, rest = page.partition(_BEGIN)
    if not found:
        sys.exit(f"{ARCHITECTURE} lacks the marker {_BEGIN!r}")
    page = head + generated + rest.partition(_END)[2]
    head, found, rest = page.partition(_BENCH_BEGIN)
    if not found:
        sys.exit(f"{ARCHITECTURE} lacks the marker {_BENCH_BEGIN!r}")
    return head + _bench_part() + rest.partition(_BENCH_END)[2]


def _check_architecture_page() -> None:
    page = ARCHITECTURE.read_text()
    if _architecture_page(page) != page:
        sys.exit(
            f"{ARCHITECTURE} is out of date with the packages or the bench's imports; run "
            "`nox -s docs` to regenerate"
        )


# The bench's rooms (its subpackages and core modules) and the imports between them.
BENCH = ROOT / "benchmarks" / "src" / "strategy_bench"
_BENCH_BEGIN = "<!-- generated by noxfile.py from strategy_bench's imports: do not edit -->"
_BENCH_END = "<!-- end of the bench's generated part -->"


def _bench_rooms() -> tuple[dict[str, str], dict[str, set[str]]]:
    """strategy-bench's rooms with their one-line purpose, and the imports between rooms.

    A room is a subpackage (``measure``, ``cli``, ...) or a top-level module (``_errors``).
    Exits if the rooms import each other in a circle.
    """
    import ast

    def room_of(path: Path) -> str | None:
        parts = path.relative_to(BENCH).parts
        if len(parts) > 1:
            return parts[0]
        return None if path.stem in ("__init__", "__main__") else path.stem

    purposes: dict[str, str] = {}
    edges: dict[str, set[str]] = {}
    for source in sorted(BENCH.rglob("*.py")):
        room = room_of(source)
        if room is None:
            continue
        tree = ast.parse(source.read_text(), str(source))
        if source.name == "__init__.py" or source.parent == BENCH:
            purposes[room] = (ast.get_docstring(tree) or "").split("\n")[0]
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            parts = node.module.split(".")
            if parts[0] != "strategy_bench":
                continue
            targets = [parts[1]] if len(parts) > 1 else [alias.name for alias in node.names]
            edges.setdefault(room, set()).update(t for t in targets if t != room)
    for start, first in edges.items():  # no circle: a walk from a room never returns to it
        todo, seen = list(first), set()
        while todo:
            room = todo.pop()
            if room == start:
                sys.exit(f"strategy_bench's rooms import each other in a circle through {start}")
            if room not in seen:
                seen.add(room)
                todo += edges.get(room, set())
    return purposes, edges


def _bench_part() -> str:
    purposes, edges = _bench_rooms()
    rows = ["| room | what it owns | imports |", "| --- | --- | --- |"]
    for room in sorted(purposes):
        imports = ", ".join(sorted(edges.get(room, set()))) or "-"
        rows.append(f"| `{room}` | {purposes[room]} | {imports} |")
    graph = ["```mermaid", "graph BT"]
    graph += [f"    {a} --> {b}" for a in sorted(edges) for b in sorted(edges[a])]
    graph.append("```")
    return "\n".join([_BENCH_BEGIN, "", *rows, "", *graph, "", _BENCH_END])


def _check_declared_imports() -> None:
    """No package imports a local piece that it does not declare (no sideways edges)."""
    import ast

    by_import = {p.import_name: p for p in PACKAGES.values()}
    for package in PACKAGES.values():
        declared = {_requirement_name(r).replace("-", "_") for r in package.requires}
        for source in sorted(_source_root(package).rglob("*.py")):
            for node in ast.walk(ast.parse(source.read_text(), str(source))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top in by_import and top != package.import_name and top not in declared:
                        sys.exit(
                            f"{source.relative_to(ROOT)} imports {top}, which {package.dist} "
                            f"does not declare; declare it or move the code to its owner"
                        )


def _check_lockstep() -> None:
    """Every package shares one version, and local requirements pin exactly that version."""
    versions = {p.version for p in PACKAGES.values()}
    if len(versions) != 1:
        listing = ", ".join(f"{p.dist}={p.version}" for p in PACKAGES.values())
        sys.exit(f"packages must share one version (lockstep releases); found {listing}")
    (version,) = versions
    for package in PACKAGES.values():
        for requirement in package.requires:
            name = _requirement_name(requirement)
            if name in PACKAGES and requirement.replace(" ", "") != f"{name}=={version}":
                sys.exit(
                    f"{package.dist} requires {requirement!r}; local pieces must be pinned as "
                    f"'{name}=={version}'"
                )
