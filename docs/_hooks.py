"""mkdocs hooks: pages generated from the code, so that they cannot drift from it.

- `<!-- config-reference -->` in a page becomes every config key (`spinformer.config
  .reference_markdown()`: key, default, allowed values, meaning).
"""

from __future__ import annotations


def on_page_markdown(markdown, page, config, files):
    if "<!-- config-reference -->" in markdown:
        import spinformer.config

        markdown = markdown.replace("<!-- config-reference -->",
                                    spinformer.config.reference_markdown())
    return markdown
