"""MkDocs hooks: the reference pages generated at build time from the code itself.

- ``reference/configuration.md`` from ``fairgate.proxy.config``: every key of ``GatewayConfig`` and of its
  nested sections (type and default from the dataclass fields, the description from the comment on the
  field's line or the comment lines just above it, read with ``tokenize``; allowed values from
  ``validate()``'s ``not in`` checks, read with ``ast``), the environment variables ``load_config`` reads,
  and the whole default configuration as YAML.
- ``reference/cli.md`` from the click command ``fairgate`` runs (``fairgate.cli.main.command()``, made of the
  typer app ``fairgate.cli.main:app``): click's introspection (also typer's own vendored click) walks every
  command and subcommand.
- ``reference/metrics.md`` from ``fairgate.proxy.control.metrics.GatewayMetrics``: every series' name, type, labels
  and help.

The repository holds a short stub for each (so that links to them resolve on the repository's web view too);
``on_page_markdown`` replaces the stub's text with the generated page. Nothing generated is committed.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # mkdocs loads this file by path: its generators sit beside it

from gen.cli_ref import cli_page  # noqa: E402
from gen.config_ref import config_page  # noqa: E402
from gen.metrics_ref import metrics_page  # noqa: E402

GENERATED = {
    "reference/configuration.md": config_page,
    "reference/cli.md": cli_page,
    "reference/metrics.md": metrics_page,
}


def on_page_markdown(markdown, page, config, files):
    """The committed file of a generated page is a stub for readers of the repository; the site gets the page
    generated from the code."""
    page_of = GENERATED.get(page.file.src_uri)
    return page_of() if page_of else markdown
