"""The documentation's structure, checked without Sphinx (scripts/docs builds
the site, with warnings as errors, in CI): every guide page is in the site,
every public name has its reference, every relative link of the README
and the guide reaches a file, and a heading where it names one, and the
architecture page's module map and lifecycle name the modules there are."""

import re

from harness import ROOT

import accel_mixin

DOCS = ROOT / "docs"
GUIDE = DOCS / "guide"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def toctree_entries():
    index = (DOCS / "index.rst").read_text(encoding="utf-8")
    entries = []
    for block in re.findall(r"^\.\. toctree::\n((?:[ \t]+.*\n|\n)+)", index, re.M):
        entries += [line.strip() for line in block.splitlines() if line.strip() and ":" not in line]
    return entries


def slug(heading):
    """The anchor of a heading, as GitHub and MyST (myst_heading_anchors) make it."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path):
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def relative_links(path):
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def broken_links(path):
    broken = []
    for target in relative_links(path):
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        missing = not dest.is_file()
        if missing or (anchor and dest.suffix == ".md" and anchor not in anchors(dest)):
            broken.append(target)
    return broken


def test_every_guide_page_is_in_the_site_and_every_entry_exists():
    entries = toctree_entries()
    pages = {f"guide/{p.stem}" for p in GUIDE.glob("*.md")}
    assert pages and pages <= set(entries), pages - set(entries)
    for entry in entries:
        assert (DOCS / f"{entry}.md").is_file() or (DOCS / f"{entry}.rst").is_file(), entry


def test_every_public_name_has_its_reference():
    api = (DOCS / "api.rst").read_text(encoding="utf-8")
    documented = set(re.findall(r"^\.\. auto\w+:: (\w+)$", api, re.M))
    assert set(accel_mixin.__all__) <= documented, set(accel_mixin.__all__) - documented


def test_the_readme_links_every_guide_page():
    linked = {t.partition("#")[0] for t in relative_links(ROOT / "README.md")}
    pages = {f"docs/guide/{p.name}" for p in GUIDE.glob("*.md")}
    assert pages <= linked, pages - linked


def test_relative_links_of_the_readme_and_the_guide_resolve():
    for path in [ROOT / "README.md", *sorted(GUIDE.glob("*.md"))]:
        assert not broken_links(path), (path.name, broken_links(path))


def test_the_link_check_finds_a_broken_link(tmp_path):
    (tmp_path / "a.md").write_text("# A page\n\n## Some: heading\n")
    page = tmp_path / "b.md"
    page.write_text(
        "[ok](a.md) [ok](a.md#some-heading) [bad](missing.md) [bad](a.md#other)\n"
        "```\n[in code](ignored.md)\n```\n[web](https://example.org)\n"
    )
    assert broken_links(page) == ["missing.md", "a.md#other"]


def test_the_quick_start_shows_the_readme_usage_example():
    # tests/test_readme.py runs the README's example; the guide's copy must
    # be the same code
    def usage(path):
        text = path.read_text(encoding="utf-8").split("## Usage", 1)[1]
        return re.search(r"```python\n(.*?)```", text, re.S).group(1)

    assert usage(GUIDE / "quickstart.md") == usage(ROOT / "README.md")


def test_the_module_map_lists_every_module_and_only_those():
    page = (GUIDE / "architecture.md").read_text(encoding="utf-8")
    block = page.split("## Modules", 1)[1].split("```")[1]
    listed = set(re.findall(r"^  ([\w/]+\.py) ", block.split("tests/")[0], re.M))
    modules = {
        p.relative_to(ROOT / "accel_mixin").as_posix() for p in (ROOT / "accel_mixin").rglob("*.py")
    }
    modules = {m for m in modules if not m.endswith("__init__.py")}
    assert listed == modules


def test_the_lifecycle_diagram_names_modules_that_exist():
    page = (GUIDE / "architecture.md").read_text(encoding="utf-8")
    diagram = page.split("## The lifecycle", 1)[1].split("```")[1]
    named = set(re.findall(r"([\w/]+\.py)", diagram))
    assert named and all((ROOT / "accel_mixin" / name).is_file() for name in named)


def settings_tables():
    """The launching guide's tables of accelerate settings: their rows'
    first cells and their tests (``file::name``, or a whole ``file``)."""
    text = (GUIDE / "launching.md").read_text(encoding="utf-8")
    section = text.split("## Every accelerate setting", 1)[1]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    settings = " ".join(row.split("|")[1] for row in rows)
    tests = [
        ("tests/" + match[0], match[1])
        for row in rows
        for match in re.findall(r"`(test_\w+\.py)(?:::(\w+))?", row.split("|")[3])
    ]
    return settings, tests


def test_the_settings_table_has_every_accelerate_setting_and_each_row_a_test():
    import dataclasses
    import inspect

    from accelerate import Accelerator, DataLoaderConfiguration

    settings, tests = settings_tables()
    names = [p for p in inspect.signature(Accelerator.__init__).parameters if p != "self"]
    names += [f.name for f in dataclasses.fields(DataLoaderConfiguration)]
    missing = [name for name in names if f"`{name}" not in settings and f"{name}`" not in settings]
    assert not missing, missing
    assert tests
    for path, name in tests:
        source = (ROOT / path).read_text(encoding="utf-8")
        assert not name or f"def {name}(" in source, (path, name)
