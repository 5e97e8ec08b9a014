"""mkdocs hooks: pages generated from the code, so that they cannot drift from it.

- `<!-- config-reference -->` in a page becomes every config key (`spinformer.config
  .reference_markdown()`: key, default, allowed values, meaning).
- The notebooks of `notebooks/` become pages `notebooks/<name>/` (rendered with their
  committed outputs by mkdocs-jupyter; nothing is executed), without copying them into
  `docs/`.
- The figures the experiments commit (`experiments/results/**/*.png`) are served at the same
  paths, so a results page shows the figure its report wrote
  (`![...](../experiments/results/scaling/loss_vs_flops.png)` from `docs/results/`), not a copy.
"""

from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def on_files(files, config):
    from mkdocs.structure.files import File
    from mkdocs_jupyter.plugin import NotebookFile  # (its own on_files ran before this hook)

    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        file = File(f"notebooks/{nb.name}", src_dir=str(ROOT), dest_dir=config["site_dir"],
                    use_directory_urls=config["use_directory_urls"])
        files.append(NotebookFile(file, **config))
    for png in sorted((ROOT / "experiments" / "results").rglob("*.png")):
        files.append(File(png.relative_to(ROOT).as_posix(), src_dir=str(ROOT),
                          dest_dir=config["site_dir"],
                          use_directory_urls=config["use_directory_urls"]))
    return files


def on_page_markdown(markdown, page, config, files):
    if "<!-- config-reference -->" in markdown:
        import spinformer.config

        markdown = markdown.replace("<!-- config-reference -->",
                                    spinformer.config.reference_markdown())
    return markdown
