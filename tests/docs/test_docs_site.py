"""The docs site: it builds with ``mkdocs build --strict`` (no warning), its generated reference
holds what the code has, and every code block of ``docs/`` and ``README.md`` runs or parses.

The conventions for code blocks (docs/contributing.md, "Code blocks in the docs are tests"):

- a ```python block runs as its own script in a fresh process (cwd an empty temporary
  directory, 120 s) and must exit 0;
- a ```python block whose first line is ``# test_NAME.py -- run with: pytest ARGS`` is a test
  module: saved as ``test_NAME.py`` there and run with ``python -m pytest ARGS``;
- a ```python block whose first line is ``# continued`` is appended to the python blocks of
  the same page before it (back to the last one that does not start so) and the combination
  runs instead;
- a block preceded by the line ``<!-- docs-test: skip REASON -->`` is not run (REASON must not
  be empty); a ``# continued`` block of a skipped one is skipped too;
- in a ```bash block, every ``llmdd-async ...`` / ``python -m llmdd_async ...`` command must
  parse with the CLI's own parser (nothing runs), and every ``pip install`` of this project
  must name only extras that pyproject.toml defines; other lines are not run;
- other languages (text, console, toml, ...) are not run.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import html
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs", reason="the docs tools (the docs or test extra)")
pytest.importorskip("mkdocstrings", reason="the docs tools (the docs or test extra)")
pytest.importorskip("material", reason="the docs tools (the docs or test extra)")

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [*sorted(DOCS.rglob("*.md")), ROOT / "README.md"]
BLOCK_TIMEOUT_S = 120
BUILD_TIMEOUT_S = 300

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\s]*)")
SKIP = re.compile(r"^<!--\s*docs-test:\s*skip\b(?P<reason>.*?)-->\s*$")
CONTINUED = "# continued"
#: a block that is a test module: ``# test_NAME.py -- run with: pytest ARGS`` on its first line
TEST_MODULE = re.compile(r"^# (test_\w+\.py) -- run with: pytest (.*)$")


@dataclasses.dataclass
class Block:
    page: str  # relative to the repository root
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    skip: str | None  # the reason, when marked to be skipped
    bad_marker: str | None = None  # a docs-test comment that is not a valid skip
    program: str = ""  # python: what runs (the chain of continued blocks)
    chain: tuple[int, ...] = ()  # python: the lines of the blocks in ``program``

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}:{self.lang or 'plain'}"


def _blocks(path: Path) -> list[Block]:
    return parse_blocks(path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8"))


def parse_blocks(rel: str, text: str) -> list[Block]:
    """The fenced code blocks of a page's markdown ``text``, marked and chained."""
    lines = text.splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = m.group("indent"), m.group("fence")
        lang = m.group("info").strip("{}.").split(",")[0].lower()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines):
            stripped = lines[i].strip()
            if stripped.startswith(fence[0] * len(fence)) and set(stripped) == {fence[0]}:
                break
            text = lines[i]
            body.append(text[len(indent) :] if text.startswith(indent) else text.lstrip())
            i += 1
        i += 1
        # the nearest non-blank line before the fence may mark the block
        j = start - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        marker = lines[j].strip() if j >= 0 else ""
        skip = bad = None
        if "docs-test" in marker:
            sm = SKIP.match(marker)
            if sm is None:
                bad = marker
            else:
                skip = sm.group("reason").strip()
                if not skip:
                    bad = marker
        out.append(Block(rel, start + 1, lang, "\n".join(body) + "\n", skip, bad))
    # python chains: a "# continued" block runs after the blocks it continues
    chain: list[Block] = []
    for block in out:
        if block.lang not in ("python", "py", "python3"):
            continue
        first = block.code.lstrip("\n").split("\n", 1)[0].strip()
        if first == CONTINUED:
            if not chain:
                block.bad_marker = f"'{CONTINUED}' with no python block before it on the page"
            chain.append(block)
            skipped = [b for b in chain[:-1] if b.skip is not None]
            if skipped and block.skip is None:
                block.skip = f"continues the skipped block of line {skipped[0].line}"
        else:
            chain = [block]
        block.program = "".join(b.code for b in chain)
        block.chain = tuple(b.line for b in chain)
    return out


ALL_BLOCKS = [b for page in PAGES for b in _blocks(page)]
PYTHON_BLOCKS = [b for b in ALL_BLOCKS if b.lang in ("python", "py", "python3")]
BASH_BLOCKS = [b for b in ALL_BLOCKS if b.lang in ("bash", "sh", "shell")]


def _check_marker(block: Block) -> None:
    assert block.bad_marker is None, (
        f"{block.page}:{block.line}: bad docs-test marker {block.bad_marker!r}: write "
        "'<!-- docs-test: skip REASON -->' with a non-empty reason"
    )
    if block.skip is not None:
        pytest.skip(f"{block.page}:{block.line}: {block.skip}")


# --- python blocks -------------------------------------------------------------------------


@pytest.mark.timeout(BLOCK_TIMEOUT_S + 30)
@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda b: b.id)
def test_python_block_runs(block: Block, tmp_path: Path) -> None:
    _check_marker(block)
    header = TEST_MODULE.match(block.program.split("\n", 1)[0])
    if header is not None:  # a test module: saved under its name, run with pytest
        (tmp_path / header.group(1)).write_text(block.program, encoding="utf-8")
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
        command += shlex.split(header.group(2))
    else:
        (tmp_path / "block.py").write_text(block.program, encoding="utf-8")
        command = [sys.executable, "block.py"]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        done = subprocess.run(
            command,
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(
            f"{block.page}:{block.line}: the block ran past {BLOCK_TIMEOUT_S} s\n"
            f"{_numbered(block)}\n--- output ---\n{exc.stdout or ''}{exc.stderr or ''}"
        )
    assert done.returncode == 0, (
        f"{block.page}:{block.line}: exit status {done.returncode} (blocks of lines "
        f"{list(block.chain)} ran as one script)\n{_numbered(block)}\n"
        f"--- stdout ---\n{done.stdout[-4000:]}\n--- stderr ---\n{done.stderr[-6000:]}"
    )


def _numbered(block: Block) -> str:
    return "\n".join(f"{n:4} | {line}" for n, line in enumerate(block.program.splitlines(), 1))


# --- bash blocks ---------------------------------------------------------------------------

SEPARATORS = {"&&", "||", ";", "|", "&", ";;", "|&"}
OUR_PROJECT = {".", "./", "llmdd-async", "llmdd_async"}
EXTRA_SPEC = re.compile(r"^(?P<name>[A-Za-z0-9_.\-/]*)\[(?P<extras>[^\]]*)\]")


def _extras() -> set[str]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return set(project.get("optional-dependencies", {}))


def _commands(code: str) -> list[list[str]]:
    """The commands of a bash block: continuation lines joined, split at ``&&``, ``;``, ``|``
    ...; comments dropped. A line shlex cannot split is no command we check."""
    text = re.sub(r"\\\n", " ", code)
    commands: list[list[str]] = []
    for line in text.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        try:
            tokens = list(lexer)
        except ValueError:
            continue
        current: list[str] = []
        for token in [*tokens, ";"]:
            if token in SEPARATORS:
                if current:
                    commands.append(current)
                current = []
            else:
                current.append(token)
    return commands


def _strip_env(tokens: list[str]) -> list[str]:
    while tokens and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", tokens[0]):
        tokens = tokens[1:]
    return tokens


def _is_python(tokens: list[str]) -> bool:
    return bool(tokens) and re.fullmatch(r"python3?(\.\d+)?", tokens[0]) is not None


def _cli_args(tokens: list[str]) -> list[str] | None:
    if tokens[:1] == ["llmdd-async"]:
        return tokens[1:]
    if _is_python(tokens) and tokens[1:3] == ["-m", "llmdd_async"]:
        return tokens[3:]
    return None


def _pip_args(tokens: list[str]) -> list[str] | None:
    if tokens[:1] in (["pip"], ["pip3"]) and tokens[1:2] == ["install"]:
        return tokens[2:]
    if _is_python(tokens) and tokens[1:4] == ["-m", "pip", "install"]:
        return tokens[4:]
    return None


def check_bash(code: str) -> list[str]:
    """What is wrong with a bash block's commands (empty: nothing)."""
    from llmdd_async._cli import build_parser

    problems = []
    extras = _extras()
    for command in _commands(code):
        tokens = _strip_env(command)
        args = _cli_args(tokens)
        if args is not None:
            err = io.StringIO()
            try:
                with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                    build_parser().parse_args(args)
            except SystemExit as exc:
                # "needs X: pip install ...": a valid value whose optional package is missing here
                last = (err.getvalue().strip().splitlines() or [""])[-1]
                needs_package = "pip install" in last
                if exc.code not in (0, None) and not needs_package:
                    problems.append(f"{shlex.join(tokens)!r} does not parse: {last}")
            continue
        pip = _pip_args(tokens)
        if pip is None:
            continue
        for arg in pip:
            m = EXTRA_SPEC.match(arg)
            if m is None or m.group("name") not in OUR_PROJECT:
                continue
            for extra in m.group("extras").split(","):
                if extra.strip() and extra.strip() not in extras:
                    problems.append(
                        f"{shlex.join(tokens)!r}: extra {extra.strip()!r} is not in "
                        f"pyproject.toml (it has {sorted(extras)})"
                    )
    return problems


@pytest.mark.parametrize("block", BASH_BLOCKS, ids=lambda b: b.id)
def test_bash_block_commands_parse(block: Block) -> None:
    _check_marker(block)
    problems = check_bash(block.code)
    assert not problems, f"{block.page}:{block.line}:\n" + "\n".join(problems)


def test_the_bash_check_catches_mistakes() -> None:
    assert check_bash("llmdd-async demo --layers 2 && python -m llmdd_async doctor\n") == []
    assert check_bash("pip install -e '.[demo,test]'  # a comment\nllmdd-async --help\n") == []
    assert len(check_bash("llmdd-async demo --layres 2\n")) == 1
    assert len(check_bash("llmdd-async demo \\\n  --mode sideways\n")) == 1
    assert len(check_bash("cd x && python -m llmdd_async frobnicate\n")) == 1
    assert len(check_bash("pip install 'llmdd-async[metrics,nope]'\n")) == 1
    assert check_bash("pip install 'mkdocstrings[python]' && vllm serve MODEL\n") == []
    assert check_bash("MODEL=x llmdd-async doctor | tee out.txt; llmdd-async bench -h\n") == []


def test_markers_are_found() -> None:
    text = (
        "```python\nx = 1\n```\n\n<!-- docs-test: skip needs a GPU -->\n```python\ny = 2\n```\n"
        "```python\n# continued\nassert x == 1\n```\n<!-- docs-test: skip -->\n```bash\nls\n```\n"
        "  ```python\n  z = 3\n  ```\n"
    )
    blocks = parse_blocks("probe.md", text)
    assert [b.lang for b in blocks] == ["python", "python", "python", "bash", "python"]
    assert [b.line for b in blocks] == [1, 6, 9, 14, 17]
    assert blocks[1].skip == "needs a GPU"
    assert blocks[2].skip == "continues the skipped block of line 6"
    assert blocks[2].program == "y = 2\n# continued\nassert x == 1\n"  # from the last head
    assert blocks[3].bad_marker is not None  # an empty reason
    assert blocks[4].program == "z = 3\n" and blocks[4].skip is None
    assert parse_blocks("p.md", "```python\n# continued\n```\n")[0].bad_marker is not None


def test_skips_are_listed(capsys: pytest.CaptureFixture[str]) -> None:
    skipped = [b for b in ALL_BLOCKS if b.skip is not None]
    with capsys.disabled():
        for b in skipped:
            print(f"\ndocs-test skip: {b.page}:{b.line} ({b.lang}): {b.skip}", end="")
    assert all(b.skip for b in skipped)
    bad = [f"{b.page}:{b.line}: {b.bad_marker}" for b in ALL_BLOCKS if b.bad_marker is not None]
    assert not bad, (
        "bad docs-test markers (write '<!-- docs-test: skip REASON -->'):\n" + "\n".join(bad)
    )


# --- the site ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )
    log = done.stdout + done.stderr
    warnings = [line for line in log.splitlines() if re.match(r"^(WARNING|ERROR)\b", line)]
    assert done.returncode == 0 and not warnings, f"mkdocs build --strict failed:\n{log[-8000:]}"
    return out


def _ids(page: Path) -> set[str]:
    return set(re.findall(r'\bid="([^"]+)"', page.read_text(encoding="utf-8")))


def _text(page: Path) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", page.read_text(encoding="utf-8")))


def _static_all(module_file: Path) -> list[str]:
    """A module's ``__all__``, read without importing it (torch and vLLM may be absent)."""
    tree = ast.parse(module_file.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"{module_file} has no __all__")


REFERENCE_MODULES = [
    ("api", "llmdd_async", "llmdd_async/__init__.py"),
    ("sync", "llmdd_async.sync", "llmdd_async/sync.py"),
    ("testing", "llmdd_async.testing", "llmdd_async/testing/__init__.py"),
    ("metrics", "llmdd_async.metrics", "llmdd_async/metrics.py"),
    ("torch", "llmdd_async.torch", "llmdd_async/torch.py"),
    ("vllm", "llmdd_async.vllm", "llmdd_async/vllm/__init__.py"),
]


@pytest.mark.parametrize(("page", "module", "source"), REFERENCE_MODULES)
def test_reference_lists_every_public_name(site: Path, page: str, module: str, source: str) -> None:
    ids = _ids(site / "reference" / page / "index.html")
    missing = [
        name
        for name in _static_all(ROOT / source)
        if f"{module}.{name}" not in ids
        and not any(i.startswith(f"{module}.") and i.endswith(f".{name}") for i in ids)
    ]
    assert not missing, f"reference/{page}.md does not document {module}.{missing}"


def test_options_table_is_generated(site: Path) -> None:
    from llmdd_async._options import DEFAULT_SYNC_KV_TIMEOUT_MS, KNOWN_OPTIONS

    text = _text(site / "reference" / "options" / "index.html")
    assert "generated: options" not in text
    row = re.search(r"llm\.SyncKvCacheWaitTime\s*\n?\s*sync_kv_timeout\s*\n?\s*(\d+)", text)
    assert row is not None and int(row.group(1)) == DEFAULT_SYNC_KV_TIMEOUT_MS, text[:3000]
    assert [k for k in KNOWN_OPTIONS if k not in text] == []


def test_status_codes_are_all_listed_and_explained(site: Path) -> None:
    from llmdd_async import LLMStatusCode

    text = _text(site / "reference" / "status-codes" / "index.html")
    assert "generated: status-codes" not in text
    for code in LLMStatusCode:
        assert f"{code.name}\n{int(code)}\n" in text, code.name
    source = (DOCS / "reference" / "status-codes.md").read_text(encoding="utf-8")
    causes = source.split("<!-- status-causes:begin -->", 1)[1].split("<!-- status-causes:end -->")
    explained = set(re.findall(r"^\| `(LLM_[A-Z_]+)` \| \S", causes[0], re.MULTILINE))
    missing = [c.name for c in LLMStatusCode if c.name not in explained]
    assert not missing, f"docs/reference/status-codes.md does not say what raises {missing}"
    unknown = explained - {c.name for c in LLMStatusCode}
    assert not unknown, f"docs/reference/status-codes.md explains unknown codes {unknown}"


def test_cli_reference_is_generated(site: Path) -> None:
    text = _text(site / "reference" / "cli" / "index.html")
    assert "generated: cli" not in text
    for command in ("llmdd-async", "llmdd-async demo", "llmdd-async bench", "llmdd-async doctor"):
        assert f"usage: {command} [-h]" in text, command
    assert "--transport" in text and "--mode" in text


def test_changelog_is_included(site: Path) -> None:
    text = _text(site / "changelog" / "index.html")
    first = next(
        line
        for line in (ROOT / "CHANGELOG.md").read_text(encoding="utf-8").splitlines()
        if line.startswith("- ")
    )
    words = re.sub(r"[`*\[\]()]", "", first[2:]).split()[:6]
    shown = re.sub(r"[`*\[\]()]", "", " ".join(text.split()))
    assert " ".join(words) in shown, words
