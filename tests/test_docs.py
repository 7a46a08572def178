"""Every Markdown file of the repository renders as its author meant: parsed by a CommonMark parser
(markdown-it-py, the `test` extra), each code fence it opens is closed.

CommonMark closes a fence left open at the end of the document without a word, so one missing or
malformed closing fence (three backticks glued to the end of a code line, say) turns the rest of the file
into code, or swaps prose and code from there on. A renderer shows it; nothing else does.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

markdown_it = pytest.importorskip(
    "markdown_it", reason="markdown-it-py is not installed (it is in the package's `test` extra: "
                          "pip install markdown-it-py); the Markdown files are not parsed")

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", ".test-envs", "build", "dist", "node_modules", ".venv", "venv"}


def tracked_files() -> list[Path]:
    """The files git tracks; outside a git checkout, those under the root less build and env folders."""
    try:
        res = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        res = None
    if res is not None and res.returncode == 0 and res.stdout:
        return sorted(ROOT / n for n in res.stdout.decode().split("\0") if n and (ROOT / n).is_file())
    return sorted(p for p in ROOT.rglob("*") if p.is_file()
                  and not any(part in SKIP_DIRS or part.startswith(".") for part in p.relative_to(ROOT).parts[:-1]))


def markdown_files() -> list[Path]:
    """The Markdown files among them."""
    return [p for p in tracked_files() if p.suffix == ".md"]


def closing_fence(line: str, marker: str) -> bool:
    """Whether `line` closes a fence opened with `marker` (CommonMark: the same character, at least as many,
    nothing after them but spaces). Container prefixes (list indentation, block-quote `>`) are stripped."""
    body = re.sub(r"^[ \t>]*", "", line)
    return re.fullmatch(re.escape(marker[0]) + "{%d,}[ \t]*" % len(marker), body) is not None


def fence_problems(text: str) -> list[str]:
    """Unclosed fences and closing markers glued to a code line, as 'line N: ...' strings (1-based)."""
    lines = text.splitlines()
    problems = []
    for tok in markdown_it.MarkdownIt("commonmark").parse(text):
        if tok.type != "fence" or tok.map is None:
            continue
        start, end = tok.map                       # lines [start, end) of the block, the fences included
        last = lines[end - 1] if end - 1 > start else ""
        if not closing_fence(last, tok.markup):
            problems.append(f"line {start + 1}: the code fence {tok.markup}{tok.info} opened here is never closed "
                            f"(CommonMark closes it at line {end}, the end of its container or the file)")
        for k, code_line in enumerate(tok.content.splitlines()):
            if code_line.rstrip().endswith(tok.markup) and not closing_fence(code_line, tok.markup):
                problems.append(f"line {start + 2 + k}: {code_line.strip()!r} ends with {tok.markup} inside a code "
                                "block: a closing fence must stand alone on its line")
    return problems


@pytest.mark.parametrize("md", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_markdown_fences_are_closed(md):
    problems = fence_problems(md.read_text(encoding="utf-8"))
    assert not problems, f"{md.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_markdown_files_are_found():
    names = {str(p.relative_to(ROOT)) for p in markdown_files()}
    assert {"README.md", "tests/README.md", "benchmarks/RESULTS.md", "integration/README.md"} <= names, names


@pytest.mark.parametrize("text,bad", [
    ("a\n\n```\ncode\n```\n\nb\n", False),
    ("- item\n\n  ```bash\n  x\n  ```\n", False),                     # a fence inside a list item
    ("> ```\n> quoted\n> ```\n", False),                                # inside a block quote
    ("````\n```\n````\n", False),                                      # a shorter run is content
    ("a\n\n```\ncode\n", True),                                         # never closed
    ("```\nx = (\n  1)```\n\nprose\n\n```\ny\n```\n", True),            # closing marker glued to code
    ("~~~\nx\n```\n", True),                                            # another character does not close
])
def test_fence_check_detects_what_it_should(text, bad):
    assert bool(fence_problems(text)) is bad, fence_problems(text)


def test_tests_readme_shows_the_noxfile_engine_table():
    """tests/README.md quotes the engine table of noxfile.py; the quote must be the table as it is."""
    def table(text: str) -> list[str]:
        lines = text[text.index("ENGINES = ["):].splitlines()
        end = next(i for i, line in enumerate(lines) if line.strip() == "]")
        return [" ".join(line.split()) for line in lines[:end + 1] if not line.lstrip().startswith("#")]
    readme = ROOT / "tests" / "README.md"
    blocks = [t.content for t in markdown_it.MarkdownIt("commonmark").parse(readme.read_text(encoding="utf-8"))
              if t.type == "fence" and "ENGINES = [" in t.content]
    assert len(blocks) == 1, f"tests/README.md should quote the engine table once, found {len(blocks)}"
    assert table(blocks[0]) == table((ROOT / "noxfile.py").read_text(encoding="utf-8"))


def heading_anchors(text: str) -> set[str]:
    """The anchors a GitHub-style renderer gives the headings of a Markdown text (lower case, punctuation
    dropped, spaces as hyphens, -1, -2, ... on repeats)."""
    tokens = markdown_it.MarkdownIt("commonmark").parse(text)
    anchors, seen = set(), {}
    for i, tok in enumerate(tokens):
        if tok.type != "heading_open":
            continue
        title = "".join(child.content for child in (tokens[i + 1].children or []))
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


@pytest.mark.parametrize("md", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_markdown_anchors_resolve(md):
    """A link to a heading (`#anchor`, `file.md#anchor`) names a heading that exists: the files point at each
    other's sections instead of restating them, and a renamed heading must not leave such a link dangling."""
    tokens = markdown_it.MarkdownIt("commonmark").parse(md.read_text(encoding="utf-8"))
    missing = []
    for tok in tokens:
        for child in tok.children or []:
            href = child.attrGet("href") if child.type == "link_open" else None
            if not href or "#" not in href or re.match(r"[a-z]+:", href):
                continue
            path, anchor = href.split("#", 1)
            target = md if not path else (md.parent / path).resolve()
            if target.suffix != ".md" or not target.is_file():
                continue                                 # test_readme.py checks that linked files exist
            if anchor not in heading_anchors(target.read_text(encoding="utf-8")):
                missing.append(href)
    assert not missing, f"{md.relative_to(ROOT)} links to headings that do not exist: {missing}"


def test_heading_anchors_follow_the_renderer():
    text = "# A title\n\n## FP8 KV cache: measured (H100, vLLM 0.26.0)\n\n## `--engines`: tests\n\n## A title\n"
    assert heading_anchors(text) == {"a-title", "fp8-kv-cache-measured-h100-vllm-0260", "--engines-tests", "a-title-1"}


# Build switches, settings and environment variables of the project: the kernels' defines (FMLA_..., also as
# -DFMLA_...) and the FLASHMLA_BACKEND_... settings of CMake, the launchers and the tests.
SWITCH_NAME = re.compile(r"(?:(?<=-D)|(?<![A-Za-z0-9_]))((?:FMLA|FLASHMLA_BACKEND)_[A-Z0-9_]*[A-Z0-9])\b")
# The one Markdown file that may name switches since removed: the measurement history.
HISTORY = {"docs/perf/journal.md"}


def unknown_switches(docs: dict[str, str], sources: str) -> dict[str, list[str]]:
    """The switch names each document names that no source text contains: {name: [documents]}."""
    known = set(SWITCH_NAME.findall(sources))
    unknown: dict[str, list[str]] = {}
    for doc, text in sorted(docs.items()):
        for name in sorted(set(SWITCH_NAME.findall(text)) - known):
            unknown.setdefault(name, []).append(doc)
    return unknown


def test_documented_switches_exist():
    """Every build switch or setting a Markdown file names (a kernel define FMLA_..., a FLASHMLA_BACKEND_...
    setting) exists in the sources, the journal excepted (it keeps the history of switches since removed): a reader
    who sets a switch that a change removed gets the default build and no error, so a description of one must go
    with it. docs/build.md once still listed two sparse candidates after they had left the sources."""
    docs, sources = {}, []
    for path in tracked_files():
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text(encoding="utf-8", errors="replace")
        if path.suffix == ".md":
            if rel not in HISTORY:
                docs[rel] = text
        else:
            sources.append(text)
    assert docs, "no Markdown files found"
    unknown = unknown_switches(docs, "\n".join(sources))
    assert not unknown, ("Markdown files name switches the sources do not have (removed or misspelled): "
                         + "; ".join(f"{n} in {', '.join(d)}" for n, d in unknown.items()))


def test_unknown_switch_check_detects_what_it_should():
    docs = {"a.md": "Build with `-DFMLA_SPARSE_GONE=1` or FLASHMLA_BACKEND_MEASURE=1.", "b.md": "FMLA_TL only."}
    sources = "#if defined(FMLA_TL)\n flashmla_setting(FLASHMLA_BACKEND_MEASURE ...)"
    assert unknown_switches(docs, sources) == {"FMLA_SPARSE_GONE": ["a.md"]}
    assert unknown_switches({"c.md": "FMLA_ alone, FLASHMLA_BACKEND_ alone"}, "") == {}
