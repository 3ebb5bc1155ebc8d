"""mkdocs hooks: pages made from the repository at build time, so they cannot drift.

- ``figures/`` (PNG and the generated ``*.md``) and ``notebooks/*.ipynb`` are added to the
  site from where they live; nothing is copied into ``docs/``.
- ``<!-- quantities -->`` in a page becomes the quantity reference, generated from
  :data:`gradscope.recorder.quantities.registry.REGISTRY` by :func:`quantity_reference`.
- Sphinx roles left in docstrings (``:class:`x` ``, ``:func:``...) lose the role prefix in the
  rendered API pages, so the reader sees ``x`` as code.
- ``<!-- results -->`` becomes ``benchmarks/RESULTS.md`` without its title, so the Benchmarks
  page shows the file as committed.
"""

from __future__ import annotations

import sys
import re
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- quantities -->"
RESULTS = "<!-- results -->"
ADDED = ("figures/*.png", "figures/*.md", "figures/paper/*.png", "figures/paper/*.md", "notebooks/*.ipynb")

if str(ROOT) not in sys.path:  # the checkout's gradscope, also when it is not installed
    sys.path.insert(0, str(ROOT))


@event_priority(100)  # before mkdocs-jupyter's on_files, which must see the notebooks
def on_files(files, config):
    for pattern in ADDED:
        for path in sorted(ROOT.glob(pattern)):
            # a File rooted at the checkout (not File.generated): mkdocs-jupyter's wrapper reads src_dir
            files.append(File(path.relative_to(ROOT).as_posix(), src_dir=str(ROOT), dest_dir=config.site_dir,
                              use_directory_urls=config.use_directory_urls))
    return files


def quantity_reference() -> str:
    """The quantity reference: the registry's table, then one section per quantity."""
    from gradscope.recorder.quantities.registry import REGISTRY, reference

    parts = [reference()]
    for name, q in REGISTRY.items():
        names = " / ".join(f"`{n}`" for n in q.names)
        taken = ("on steps whose index is a multiple of `every × slow_every` (every 10th step by default)" if q.slow
                 else "when the loop logs it (`rec.log`)" if q.logged else "every recorded step (a multiple of `every`)")
        spike = ", watched by `spike`" if q.spike_watched else ""
        lines = [f"### {name}", "", f"{names}: {q.description}.", "",
                 f"- **Taken**: {taken}; ranks combine it by `{q.across_ranks}`{spike}.",
                 f"- **Paper**: {q.paper or '—'}. **Class**: `{type(q).__module__}.{type(q).__name__}`."]
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)


def results_without_title() -> str:
    """benchmarks/RESULTS.md, less its ``# `` title line (the page has its own)."""
    lines = (ROOT / "benchmarks" / "RESULTS.md").read_text().splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    return "\n".join(lines) + "\n"


def on_page_markdown(markdown, page, config, files):
    if page is not None and page.file.src_uri.startswith("figures/"):  # the generated claims tables are wide
        page.meta.setdefault("hide", ["navigation"])
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, quantity_reference())
    if RESULTS in markdown:
        markdown = markdown.replace(RESULTS, results_without_title())
    return markdown


SPHINX_ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):(?=<code)")


DOCS_LINK = re.compile(r'href="\.\./docs/([^"#]*?)\.md(#[^"]*)?"')
"""A notebook's link to a docs page as the repository has it (``../docs/table.md#anchor``)."""


def docs_link_in_site(match: re.Match, page, directory_urls: bool) -> str:
    """The built page's address of a notebook's ``../docs/<page>.md`` link, relative to the
    notebook's own page (so the one link works on GitHub and in the built site)."""
    up = "../" * page.url.count("/")  # from the notebook's page to the site's root
    name = match[1]
    if directory_urls:
        target = "" if name == "index" else f"{name.removesuffix('/index')}/"
    else:
        target = f"{name}.html"
    return f'href="{up}{target}{match[2] or ""}"'


def on_page_content(html, page, config, files):
    if page.file.src_uri.startswith("notebooks/"):
        html = DOCS_LINK.sub(lambda m: docs_link_in_site(m, page, config.use_directory_urls), html)
    return SPHINX_ROLE.sub("", html)
