"""Loss and accuracy figures (PNG, matplotlib's Agg backend)."""

from __future__ import annotations

import pathlib



def _plt():
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def _series(records, split, key):
    pts = [(r["step"], r[key]) for r in records if r.get("split") == split and key in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_run(records: list[dict], out_dir) -> list[pathlib.Path]:
    """Write `loss.png` and `accuracy.png` (train and validation vs step) into `out_dir`."""
    return plot_runs({"": records}, out_dir)


def plot_runs(runs: dict[str, list[dict]], out_dir, prefix: str = "") -> list[pathlib.Path]:
    """Figures comparing several runs (`{label: records}`): `{prefix}loss.png`,
    `{prefix}accuracy.png`."""
    plt = _plt()
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for key, ylabel in (("loss", "cross-entropy"), ("accuracy", "accuracy")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for i, (label, records) in enumerate(runs.items()):
            color = f"C{i}"
            for split, style in (("train", ":"), ("val", "-")):
                xs, ys = _series(records, split, key)
                if xs:
                    name = f"{label} {split}".strip()
                    ax.plot(xs, ys, style, color=color, label=name)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        if ax.has_data():
            ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        p = out / f"{prefix}{key}.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        paths.append(p)
    return paths
