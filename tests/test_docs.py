"""The docs against the code: relative links resolve (files and #anchors), docs/hooks.md's hook
table is the set of targets the plugin plans, and docs/environment.md names every VASE_*
variable the core and the hooks read. Reads files only; no server."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"(?<!!)\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
IMAGE = re.compile(r"!\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def pages() -> list[Path]:
    """README.md, docs/*.md and docs/notes/*.md (docs/results/ holds generated reports)."""
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md")), *sorted(DOCS.glob("notes/*.md"))]


def prose_lines(path: Path) -> list[str]:
    """The lines outside code fences, with inline code removed."""
    out, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(re.sub(r"`[^`]*`", "", line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup dropped, lower case, punctuation other than - and _
    removed, each space a -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def relative_links(path: Path) -> list[str]:
    text = "\n".join(prose_lines(path))
    return [t for t in LINK.findall(text) + IMAGE.findall(text)
            if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I)]  # http:, mailto:, ...


def broken_links(paths, root: Path = ROOT) -> list[str]:
    bad = []
    for page in paths:
        for link in relative_links(page):
            target, _, anchor = link.partition("#")
            dest = (page.parent / target).resolve() if target else page
            where = f"{page.relative_to(root)}: ({link})"
            if not dest.exists():
                bad.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{where}: no heading with this anchor")
    return bad


def test_slug_follows_github():
    assert slug("Two processors, two curves: why 2.16× one day and 1.04× the next (2026-12-05)") \
        == "two-processors-two-curves-why-216-one-day-and-104-the-next-2026-12-05"
    assert slug("Budget curve (teacher-forced, 40 problems, R = T/4)") \
        == "budget-curve-teacher-forced-40-problems-r--t4"
    assert slug("The engine-free core (`vase_sglang/`)") == "the-engine-free-core-vase_sglang"


def test_relative_links_resolve():
    """The pages, and the reports under docs/results/ (their links point at files beside them)."""
    assert broken_links([*pages(), *sorted(DOCS.glob("results/**/*.md"))]) == []


def test_a_broken_link_is_caught(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## A heading\n", encoding="utf-8")
    page.write_text("[ok](other.md#a-heading) [gone](missing.md) [bad](other.md#nope)\n"
                    "```\n[in code](missing.md)\n```\n[self](#top)\n# Top\n", encoding="utf-8")
    assert broken_links([page], root=tmp_path) == ["page.md: (missing.md): no such file",
                   "page.md: (other.md#nope): no heading with this anchor"]


def test_docs_readme_lists_every_page():
    index = (DOCS / "README.md").read_text(encoding="utf-8")
    linked = {(DOCS / t.partition("#")[0]).resolve() for t in relative_links(DOCS / "README.md")}
    missing = [str(p.relative_to(ROOT)) for p in pages()[1:]
               if p != DOCS / "README.md" and p.resolve() not in linked]
    assert index and missing == []


# --- the hook table ---------------------------------------------------------------------------

def table_targets(text: str) -> list[str]:
    """The targets of docs/hooks.md's table (header `| module | target ... | why |`), each as
    written, a leading `.name` completed with the class of the item before it in its cell."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines)
                 if line.startswith("| module | target"))
    out = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cell = line.split("|")[2]
        owner = None
        for item in re.findall(r"`([^`]+)`", cell):
            if item.startswith("."):
                assert owner, f"{item!r} continues no class in {cell!r}"
                item = owner + item
            owner = item.rsplit(".", 1)[0]
            out.append(item)
    return out


def planned_targets(monkeypatch) -> set[str]:
    """Every target the plugin may register: with and without eviction configured, the CPU-only
    hooks included (their needed() depends on the machine)."""
    import patches
    from patches import distributed_cpu, rotary_cpu
    from vase_sglang.config import EvictionConfig

    monkeypatch.setattr(rotary_cpu, "needed", lambda: True)
    monkeypatch.setattr(distributed_cpu, "needed", lambda: True)
    return {t for cfg in (None, EvictionConfig()) for t, _kind, _fn in patches.planned_hooks(cfg)}


def mismatches(documented: list[str], planned: set[str]) -> list[str]:
    """A documented `Class.method` names the planned target ending in it; each planned target
    must be named exactly once and each documented one must name one."""
    bad = []
    for doc in documented:
        hits = [t for t in planned if t == doc or t.endswith("." + doc)]
        if len(hits) != 1:
            bad.append(f"documented {doc!r} names {len(hits)} planned targets")
    for target in sorted(planned):
        n = sum(target == d or target.endswith("." + d) for d in documented)
        if n != 1:
            bad.append(f"planned {target} is in the table {n} times")
    return bad


def test_hook_table_is_the_planned_hooks(monkeypatch):
    documented = table_targets((DOCS / "hooks.md").read_text(encoding="utf-8"))
    assert mismatches(documented, planned_targets(monkeypatch)) == []


def test_the_patches_docstring_lists_the_planned_hooks(monkeypatch):
    """patches/__init__.py's docstring table lists the same targets (it had drifted: three
    hooks gone, five missing, by issue 58)."""
    import patches

    documented = table_targets(patches.__doc__)
    assert mismatches(documented, planned_targets(monkeypatch)) == []


def test_hook_table_check_can_fail(monkeypatch):
    planned = planned_targets(monkeypatch)
    documented = table_targets((DOCS / "hooks.md").read_text(encoding="utf-8"))
    assert mismatches(documented[1:], planned)  # a row left out
    assert mismatches([*documented, "Scheduler.not_a_hook"], planned)  # a row too many


# --- environment variables ---------------------------------------------------------------------

def variables_read() -> set[str]:
    """The VASE_* names in vase_sglang/ and patches/, the VASE_KV_EVICT_* ones the settings build
    from the flag names included."""
    from patches import settings

    names = set()
    for folder in ("vase_sglang", "patches"):
        for path in (ROOT / folder).rglob("*.py"):
            names |= set(re.findall(r"\bVASE_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(encoding="utf-8")))
    names |= {settings.env_name(s) for s in (*settings.FLAGS, *settings.SERVER_FLAGS)}
    return names


def documented_variables() -> set[str]:
    names = set()
    for line in (DOCS / "environment.md").read_text(encoding="utf-8").splitlines():
        if line.startswith("| `"):
            names |= set(re.findall(r"`([A-Z][A-Z0-9_]+)`", line.split("|")[1]))
    return names


def test_environment_table_names_every_variable():
    missing = sorted(variables_read() - documented_variables())
    assert missing == [], f"add to docs/environment.md: {missing}"


@pytest.mark.parametrize("name", ["VASE_KERNELS", "VASE_KV_EVICT_RING"])
def test_environment_check_can_fail(name):
    assert name in variables_read() and name in documented_variables()
    assert name in variables_read() - (documented_variables() - {name})
